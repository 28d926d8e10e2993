"""QUOKA-style token-level baseline, for comparisons only (not a selector of the compact path).

Subsample the chunk's queries (the `query_ratio` least similar to the mean
query, by cosine), score every prefix token by its largest softmax weight
under those queries (max over the kv head's query heads), keep the top
`kv_budget` fraction of tokens per (request, kv head), then attend densely
to the gathered tokens (and causally to the chunk).
"""

from __future__ import annotations

import math

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.execute import reference_attention


def quoka_token_mask(batch: ChunkBatch, query_ratio: float = 0.25, kv_budget: float = 0.25) -> torch.Tensor:
    """bool [B, H_kv, NKV * P]: the prefix tokens each (request, kv head) keeps."""
    if not (0 < query_ratio <= 1 and 0 < kv_budget <= 1):
        raise ValueError(f"query_ratio and kv_budget must be in (0, 1], got {query_ratio}, {kv_budget}")
    k, k_valid = batch.prefix_keys()  # [B, H_kv, LP, D]
    B, H_kv, LP, D = k.shape
    G = batch.group_size
    out = torch.zeros(B, H_kv, LP, dtype=torch.bool, device=k.device)
    start = 0
    for b, (L, C) in enumerate(zip(batch.prefix_lens_cpu, batch.chunk_lens_cpu)):
        q = batch.q[start:start + C].to(torch.float32).transpose(0, 1)  # [H_q, C, D]
        start += C
        if L == 0 or C == 0:
            continue
        n_q = max(1, math.ceil(query_ratio * C - 1e-9))
        mean = q.mean(dim=1, keepdim=True)
        cos = torch.nn.functional.cosine_similarity(q, mean, dim=-1)  # [H_q, C]
        idx = torch.topk(cos, n_q, dim=-1, largest=False).indices
        q_sel = q.gather(1, idx[..., None].expand(-1, -1, D))  # [H_q, n_q, D]
        kb = k[b, :, :L].to(torch.float32).repeat_interleave(G, dim=0)  # [H_q, L, D]
        p = torch.softmax(torch.matmul(q_sel, kb.transpose(-1, -2)) * batch.sm_scale, dim=-1)
        score = p.amax(dim=1).reshape(H_kv, G, L).amax(dim=1)  # [H_kv, L]
        n_keep = max(1, math.ceil(kv_budget * L - 1e-9))
        keep = torch.topk(score, n_keep, dim=-1).indices
        out[b].scatter_(1, keep, True)
    return out


def quoka_attention(batch: ChunkBatch, query_ratio: float = 0.25, kv_budget: float = 0.25):
    """(o [T, H_q, D], token_mask) with plain torch."""
    mask = quoka_token_mask(batch, query_ratio, kv_budget)
    return reference_attention(batch, token_mask=mask), mask
