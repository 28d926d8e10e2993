"""Plain-torch reference for the paged-index kernel (`kernels/indices.py`).

Rows are ordered kv-head-major, r = g * NW + w (kv head, window), so that the query reshape
`[T, H_q, D] -> [H_kv * T, G, D]` is one transpose for the whole batch.
"""

from __future__ import annotations

import torch


def build_indices(table: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor, row_req: torch.Tensor):
    """A table of rows -> FlashInfer's paged kv_indptr / kv_indices for the zero-copy layout.

    Args:
        table:      bool [H_kv, NW, NKV] pages each row reads
        counts:     int32 [H_kv * NW] pages per row (= table.sum(-1))
        page_table: int32 [B, >= NKV] page ids of each request's context
        row_req:    int [NW] request of each window
    Returns:
        kv_indptr int32 [R + 1], kv_indices int32 [counts.sum()] (page * H_kv + g, ascending pages per row).
    """
    H_kv, NW, NKV = table.shape
    kv_indptr = torch.zeros(H_kv * NW + 1, dtype=torch.int64, device=table.device)
    kv_indptr[1:] = torch.cumsum(counts.long(), 0)
    gg, ww, jj = table.nonzero(as_tuple=True)
    kv_indices = (page_table[row_req.long()[ww], jj].long() * H_kv + gg).to(torch.int32)
    return kv_indptr.to(torch.int32), kv_indices
