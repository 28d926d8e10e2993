"""Plain-torch reference for the rows' page-table kernel (`kernels/row_page_table.py`)."""

from __future__ import annotations

import torch


def row_page_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int,
                   table: torch.Tensor, seqlens: torch.Tensor) -> None:
    """Paged indices (FlashInfer's CSR form) -> the padded page table and KV lengths FA3's paged call reads.

    Args:
        kv_indptr:     int32 [R + 1]; row r's pages are kv_indices[kv_indptr[r]:kv_indptr[r + 1]] (at least one)
        kv_indices:    int32, valid up to kv_indptr[R]
        last_page_len: int32 [R] tokens of each row's last page
        page_size:     P
        table:         int32 [>= R, >= the longest row's pages], written: table[r, :n_r] = row r's pages; the
                       entries past n_r keep whatever they held (FA3 reads a row's first cdiv(seqlens[r], P))
        seqlens:       int32 [>= R], written: (n_r - 1) * P + last_page_len[r]
    """
    R = last_page_len.numel()
    ptr = kv_indptr.long().tolist()
    for r in range(R):
        n = ptr[r + 1] - ptr[r]
        table[r, :n] = kv_indices[ptr[r]:ptr[r + 1]]
    counts = kv_indptr[1:R + 1].long() - kv_indptr[:R].long()
    seqlens[:R] = ((counts - 1) * page_size + last_page_len.long()).to(seqlens.dtype)
