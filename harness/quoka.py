"""QUOKA-style token-level baseline, for comparisons only (not a selector of the compact path).

Subsample the chunk's queries (the `query_ratio` least similar to the mean
query, by cosine), score every PREFIX token (the request's cached tokens
before the chunk) by its largest softmax weight under those queries (max over
the kv head's query heads), keep the top `kv_budget` fraction of them per
(request, kv head); the chunk then attends to the kept prefix tokens and
densely, causally, to itself.

Per window (the chunk's tokens in one union window, see `ChunkBatch`): the
queries of a sparse window read the kept prefix tokens and the chunk
causally; those of a dense one (`QBlocks.w_sparse` false: below the gate's
min_context, or in the prompt's dense tail) their whole causal context.
"""

from __future__ import annotations

import math

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.executors.torch_executor import masked_context_attention


def quoka_token_mask(batch: ChunkBatch, query_ratio: float = 0.25, kv_budget: float = 0.25) -> torch.Tensor:
    """bool [B, H_kv, max_b L_b]: the prefix tokens each (request, kv head) keeps (False past L_b)."""
    if not (0 < query_ratio <= 1 and 0 < kv_budget <= 1):
        raise ValueError(f"query_ratio and kv_budget must be in (0, 1], got {query_ratio}, {kv_budget}")
    H_kv, G, D = batch.num_kv_heads, batch.group_size, batch.head_dim
    max_L = max(batch.prefix_lens_cpu, default=0)
    out = torch.zeros(batch.batch_size, H_kv, max_L, dtype=torch.bool, device=batch.q.device)
    cu = batch.cu_chunk_cpu()
    for b, (L, C) in enumerate(zip(batch.prefix_lens_cpu, batch.chunk_lens_cpu)):
        if L == 0 or C == 0:
            continue
        q = batch.q[cu[b]:cu[b + 1]].to(torch.float32).transpose(0, 1)  # [H_q, C, D]
        n_q = max(1, math.ceil(query_ratio * C - 1e-9))
        mean = q.mean(dim=1, keepdim=True)
        cos = torch.nn.functional.cosine_similarity(q, mean, dim=-1)  # [H_q, C]
        idx = torch.topk(cos, n_q, dim=-1, largest=False).indices
        q_sel = q.gather(1, idx[..., None].expand(-1, -1, D))  # [H_q, n_q, D]
        kb = batch.context_keys(b)[:, :L].to(torch.float32).repeat_interleave(G, dim=0)  # [H_q, L, D]
        p = torch.softmax(torch.matmul(q_sel, kb.transpose(-1, -2)) * batch.sm_scale, dim=-1)
        score = p.amax(dim=1).reshape(H_kv, G, L).amax(dim=1)  # [H_kv, L]
        n_keep = max(1, math.ceil(kv_budget * L - 1e-9))
        keep = torch.topk(score, n_keep, dim=-1).indices
        out[b, :, :L].scatter_(1, keep, True)
    return out


def quoka_allowed(batch: ChunkBatch, mask: torch.Tensor):
    """`masked_context_attention`'s allowed_fn for a token mask (`quoka_token_mask`): a query of a sparse window
    reads, causally, the kept prefix tokens and the chunk's tokens; one of a dense window its whole causal context.
    Returns bool [H_kv, C, E] per request."""
    qb = batch.qblocks
    W = qb.window_pages * batch.page_size
    first: dict[int, int] = {}
    for w, r in enumerate(qb.w_req):
        first.setdefault(r, w)
    sparse = torch.tensor(qb.w_sparse, dtype=torch.bool, device=batch.q.device)

    def allowed(b, L, C):
        dev = batch.q.device
        E = L + C
        pos = L + torch.arange(C, device=dev)
        causal = torch.arange(E, device=dev)[None, :] <= pos[:, None]                     # [C, E]
        keep = torch.ones(batch.num_kv_heads, E, dtype=torch.bool, device=dev)
        keep[:, :L] = mask[b, :, :L]
        dense_q = ~sparse[first[b] + pos // W - L // W]                                  # [C]
        return causal[None] & (keep[:, None, :] | dense_q[None, :, None])
    return allowed


def quoka_attention(batch: ChunkBatch, query_ratio: float = 0.25, kv_budget: float = 0.25):
    """(o [T, H_q, D] float32, token_mask) with plain torch (`masked_context_attention`)."""
    mask = quoka_token_mask(batch, query_ratio, kv_budget)
    return masked_context_attention(batch, quoka_allowed(batch, mask)), mask
