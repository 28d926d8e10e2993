"""Plain-torch reference for the FlashPrefill block-score kernel (`kernels/flashprefill.py`)."""

from __future__ import annotations

import torch


def block_scores(q: torch.Tensor, cu_chunk: torch.Tensor, chunk_lens_cpu, pooled_keys: torch.Tensor,
                 kv_blocks: torch.Tensor, sm_scale: float, q_block: int, n_q_blocks: int,
                 group_max: bool = False, config: dict | None = None, query_stride: int = 1) -> torch.Tensor:
    """Score every (query block, prefix block) pair against the prefix blocks' mean keys.

        s[t, j]     = q_t . kbar_j * sm_scale          (t a query of the chunk, j < n_b)
        p[t, j]     = softmax_j(s[t, :])
        out[i, j]   = max over the queries t of block i of p[t, j]
                      (with query_stride s: only the block's queries 0, s, 2s, ...)

    Args:
        q:            [T, H_q, D] chunk queries, ragged by cu_chunk
        cu_chunk:     int [B + 1]
        chunk_lens_cpu: host ints [B]
        pooled_keys:  [B, NKV, H_kv, D] mean key of each prefix block
        kv_blocks:    int [B] valid prefix blocks n_b
        q_block:      queries per query block; n_q_blocks: NQ (>= every request's block count)
        group_max:    reduce over each kv head's G query heads too
        query_stride: score every s-th query of each block (a power of two dividing q_block)
        config:       launch parameters of the kernel (ignored here)
    Returns:
        float32 [B, H_q, NQ, NKV] ([B, H_kv, NQ, NKV] with group_max); 0 outside valid cells.
    """
    B, NKV, H_kv, D = pooled_keys.shape
    H_q = q.shape[1]
    G = H_q // H_kv
    out = torch.zeros(B, H_q, n_q_blocks, NKV, dtype=torch.float32, device=q.device)
    starts = cu_chunk.tolist()
    n_kv = kv_blocks.tolist()
    for b, C in enumerate(chunk_lens_cpu):
        n = n_kv[b]
        if C == 0 or n == 0:
            continue
        qb = q[starts[b]:starts[b] + C].to(torch.float32).transpose(0, 1)                 # [H_q, C, D]
        kb = pooled_keys[b, :n].to(torch.float32).permute(1, 0, 2).repeat_interleave(G, 0)  # [H_q, n, D]
        p = torch.softmax(torch.matmul(qb, kb.transpose(1, 2)) * sm_scale, dim=-1)          # [H_q, C, n]
        if query_stride > 1:
            p = p * (torch.arange(C, device=p.device) % query_stride == 0).to(p.dtype)[None, :, None]
        nq = -(-C // q_block)
        pad = nq * q_block - C
        if pad:
            p = torch.cat([p, p.new_zeros(H_q, pad, n)], dim=1)
        out[b, :, :nq, :n] = p.reshape(H_q, nq, q_block, n).amax(dim=2)
    if group_max:
        out = out.reshape(B, H_kv, G, n_q_blocks, NKV).amax(dim=2)
    return out
