"""Plain-torch reference for the plan kernel (`kernels/plan.py`).

Rows are ordered kv-head-major, r = g * B + b, so that the query reshape
`[T, H_q, D] -> [H_kv * T, G, D]` is one transpose for the whole batch.
"""

from __future__ import annotations

import torch


def build_plan(table: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor,
               prefix_lens: torch.Tensor, cu_chunk: torch.Tensor, page_size: int):
    """Union table -> FlashInfer paged metadata for the zero-copy layout.

    Args:
        table:       bool [B, H_kv, NKV]
        counts:      int32 [B, H_kv] selected blocks per row (= table.sum(-1))
        page_table:  int32 [B, >= NKV] prefix page ids
        prefix_lens: int32 [B]
        cu_chunk:    int32 [B + 1] prefix sums of chunk lengths (T = cu_chunk[-1])
    Returns:
        qo_indptr int32 [R + 1], kv_indptr int32 [R + 1],
        kv_indices int32 [counts.sum()] (page * H_kv + g),
        kv_last_page_len int32 [R], with R = B * H_kv.
    """
    B, H_kv, NKV = table.shape
    dev = table.device
    T = cu_chunk[-1].to(torch.int64)
    g = torch.arange(H_kv, device=dev)
    qo = (g[:, None] * T + cu_chunk[None, :-1].long()).reshape(-1)
    qo_indptr = torch.cat([qo, (H_kv * T).reshape(1)]).to(torch.int32)
    row_counts = counts.t().reshape(-1).long()  # [R] in row order
    kv_indptr = torch.zeros(B * H_kv + 1, dtype=torch.int64, device=dev)
    kv_indptr[1:] = torch.cumsum(row_counts, 0)
    # Selected (g, b, j) in row order, ascending j within a row.
    sel = table.permute(1, 0, 2)  # [H_kv, B, NKV]
    gg, bb, jj = sel.nonzero(as_tuple=True)
    kv_indices = (page_table[bb, jj].long() * H_kv + gg).to(torch.int32)
    n_b = torch.div(prefix_lens.long() + page_size - 1, page_size, rounding_mode="floor")  # [B]
    last_len = prefix_lens.long() - (n_b - 1) * page_size
    last_in = table.gather(2, (n_b - 1).clamp(min=0)[:, None, None].expand(B, H_kv, 1))[..., 0]  # [B, H_kv]
    lpl = torch.where(last_in, last_len[:, None], torch.full_like(last_in, page_size, dtype=torch.long))
    lpl = torch.where(counts > 0, lpl, torch.zeros_like(lpl))
    kv_last_page_len = lpl.t().reshape(-1).to(torch.int32)
    return qo_indptr, kv_indptr.to(torch.int32), kv_indices, kv_last_page_len
