"""Triton paged-index kernel; reference: `indices_naive.build_indices`.

The rows' offsets into `kv_indices` are one `cumsum` of their counts (written
straight into `kv_indptr[1:]`); then one program per row scans its table row
tile by tile and writes `page_table[b, j] * H_kv + g` for every selected page j,
in ascending order. No device->host traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_compact.kernels.launch import Launcher


@triton.jit
def _indices_kernel(table, kv_indptr, kv_indices, page_table, row_req, NW, NKV, H_kv, stride_pt,
                    BLOCK_J: tl.constexpr):
    r = tl.program_id(0)
    g = r // NW
    b = tl.load(row_req + r % NW)
    written = tl.load(kv_indptr + r)
    row = table + r.to(tl.int64) * NKV
    pt = page_table + b.to(tl.int64) * stride_pt
    for start in range(0, NKV, BLOCK_J):
        j = start + tl.arange(0, BLOCK_J)
        sel = tl.load(row + j, mask=j < NKV, other=0).to(tl.int32)
        pos = written + tl.cumsum(sel, axis=0) - 1
        page = tl.load(pt + j, mask=sel != 0, other=0)
        tl.store(kv_indices + pos, page * H_kv + g, mask=sel != 0)
        written += tl.sum(sel, axis=0)


_indices_launch = Launcher(_indices_kernel)


def build_indices(table: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor, row_req: torch.Tensor,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Same contract as `indices_naive.build_indices`, except that `kv_indices` is the whole output
    buffer (valid up to kv_indptr[-1]).

    Args:
        out: optional preallocated (kv_indptr [>= R + 1] with kv_indptr[0] == 0, kv_indices [>= counts.sum()]),
            int32; without it kv_indices is sized by the host bound R * NKV.
    """
    H_kv, NW, NKV = table.shape
    R = H_kv * NW
    dev = table.device
    if out is None:
        out = (torch.zeros(R + 1, dtype=torch.int32, device=dev),
               torch.empty(max(R * NKV, 1), dtype=torch.int32, device=dev))
    kv_indptr, kv_indices = out   # kv_indptr[0] is 0 in a given buffer (planned, or zero-initialised)
    if R == 0:
        return kv_indptr[:1], kv_indices
    torch.cumsum(counts[:R], 0, dtype=torch.int32, out=kv_indptr[1:R + 1])
    page_table = page_table.to(torch.int32)
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    block_j = min(1024, triton.next_power_of_2(max(NKV, 1)))
    _indices_launch((R,), table.contiguous().view(torch.int8), kv_indptr, kv_indices, page_table,
                    row_req.to(torch.int32), NW, NKV, H_kv, page_table.stride(0), BLOCK_J=block_j)
    return kv_indptr[:R + 1], kv_indices
