"""Triton rows' page-table kernel; reference: `row_page_table_naive.row_page_table`.

sgl_kernel's FA3 (the kernel stock SGLang's fa3 backend runs) reads paged KV
through a page table, one padded row of page ids per sequence, and the
sequences' KV lengths on the device; FlashInfer reads the same pages as CSR
(`kv_indptr` / `kv_indices`), which is what the selectors' index kernels write.
One program per row copies its pages into its table row, tile by tile, and
writes its length: one launch per layer, no device->host traffic, so one
plan of the FA3 call serves every layer whatever each row's length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_compact.kernels.launch import Launcher


@triton.jit
def _row_page_table_kernel(kv_indptr, kv_indices, last_page_len, table, seqlens, stride_t, P,
                           BLOCK: tl.constexpr):
    r = tl.program_id(0)
    start = tl.load(kv_indptr + r)
    n = tl.load(kv_indptr + r + 1) - start
    row = table + r.to(tl.int64) * stride_t
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < n
        tl.store(row + j, tl.load(kv_indices + start + j, mask=ok, other=0), mask=ok)
    tl.store(seqlens + r, (n - 1) * P + tl.load(last_page_len + r))


_row_page_table_launch = Launcher(_row_page_table_kernel)


def row_page_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int,
                   table: torch.Tensor, seqlens: torch.Tensor) -> None:
    """Same contract as `row_page_table_naive.row_page_table` (all int32; table's last dimension contiguous)."""
    R = last_page_len.numel()
    if R == 0:
        return
    if table.stride(1) != 1:
        raise ValueError("row_page_table: the table's rows must be contiguous")
    block = min(1024, triton.next_power_of_2(max(table.shape[1], 16)))
    _row_page_table_launch((R,), kv_indptr, kv_indices, last_page_len, table, seqlens, table.stride(0), page_size,
                           BLOCK=block)
