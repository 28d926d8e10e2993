"""Triton plan kernel; reference: `plan_naive.build_plan`.

One program per row r = g * B + b. Each program finds its own offset into
`kv_indices` by summing the counts of the rows before it (R = B * H_kv is
small), so the whole plan is one launch with no device->host traffic. It
then scans its row of the union table tile by tile, writing
`page_table[b, j] * H_kv + g` for every selected block j in ascending order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _plan_kernel(table, counts, page_table, prefix_lens, cu_chunk,
                 qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                 B, H_kv, NKV, page_table_stride, page_size,
                 R_POW2: tl.constexpr, BLOCK_J: tl.constexpr):
    r = tl.program_id(0)
    R = B * H_kv
    g = r // B
    b = r % B
    # counts is [B, H_kv]; row r' = g' * B + b' has count counts[b' * H_kv + g'].
    rr = tl.arange(0, R_POW2)
    prev = tl.load(counts + (rr % B) * H_kv + rr // B, mask=rr < r, other=0)
    offset = tl.sum(prev, axis=0)
    my_count = tl.load(counts + b * H_kv + g)
    tl.store(kv_indptr + r, offset)
    T = tl.load(cu_chunk + B)
    tl.store(qo_indptr + r, g * T + tl.load(cu_chunk + b))
    if r == R - 1:
        tl.store(kv_indptr + R, offset + my_count)
        tl.store(qo_indptr + R, H_kv * T)

    L = tl.load(prefix_lens + b)
    n_b = (L + page_size - 1) // page_size
    row_base = table + (b.to(tl.int64) * H_kv + g) * NKV
    pt_base = page_table + b.to(tl.int64) * page_table_stride
    written = offset
    for start in range(0, NKV, BLOCK_J):
        j = start + tl.arange(0, BLOCK_J)
        sel = tl.load(row_base + j, mask=j < NKV, other=0).to(tl.int32)
        pos = written + tl.cumsum(sel, axis=0) - 1
        page = tl.load(pt_base + j, mask=sel != 0, other=0)
        tl.store(kv_indices + pos, page * H_kv + g, mask=sel != 0)
        written += tl.sum(sel, axis=0)

    last_sel = tl.load(row_base + tl.maximum(n_b - 1, 0), mask=n_b > 0, other=0)
    lpl = tl.where(last_sel != 0, L - (n_b - 1) * page_size, page_size)
    lpl = tl.where(my_count > 0, lpl, 0)
    tl.store(kv_last_page_len + r, lpl)


def build_plan(table: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor,
               prefix_lens: torch.Tensor, cu_chunk: torch.Tensor, page_size: int,
               out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Same contract as `plan_naive.build_plan`, except that `kv_indices` is the
    whole preallocated buffer (valid up to kv_indptr[-1]) when `out` is given.

    Args:
        out: optional preallocated (qo_indptr [>= R+1], kv_indptr [>= R+1],
            kv_indices [>= sum of counts], kv_last_page_len [>= R]), int32.
            Without it, kv_indices is sized by the host bound H_kv * B * NKV.
    """
    B, H_kv, NKV = table.shape
    R = B * H_kv
    dev = table.device
    if out is None:
        out = (torch.empty(R + 1, dtype=torch.int32, device=dev),
               torch.empty(R + 1, dtype=torch.int32, device=dev),
               torch.empty(max(R * NKV, 1), dtype=torch.int32, device=dev),
               torch.empty(R, dtype=torch.int32, device=dev))
    qo_indptr, kv_indptr, kv_indices, kv_last_page_len = out
    if R == 0:
        qo_indptr[:1].zero_()
        kv_indptr[:1].zero_()
        return qo_indptr[:1], kv_indptr[:1], kv_indices[:0], kv_last_page_len[:0]
    page_table = page_table.to(torch.int32)
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    block_j = min(1024, triton.next_power_of_2(max(NKV, 1)))
    _plan_kernel[(R,)](table.contiguous().view(torch.int8), counts.contiguous(), page_table,
                       prefix_lens.to(torch.int32), cu_chunk.to(torch.int32),
                       qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                       B, H_kv, NKV, page_table.stride(0), page_size,
                       R_POW2=triton.next_power_of_2(R), BLOCK_J=block_j)
    return qo_indptr[:R + 1], kv_indptr[:R + 1], kv_indices, kv_last_page_len[:R]
