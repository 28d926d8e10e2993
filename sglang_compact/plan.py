"""Plan: union table -> FlashInfer paged metadata for the zero-copy layout.

The pool `[num_pages, H_kv, P, D]` is viewed as `[num_pages * H_kv, 1, P, D]`:
every (page, kv head) is one contiguous P x D tile, addressed as
`page * H_kv + g`. Each (request b, kv head g) becomes one row r = g * B + b
with G query heads:

    qo_indptr        int32 [R + 1]  rows' query tokens in q_rows [H_kv * T, G, D]
    kv_indptr        int32 [R + 1]  prefix sum of |T[b, g]|
    kv_indices       int32 [<= cap] page * H_kv + g, ascending j per row
    kv_last_page_len int32 [R]      tokens in the row's last page (the prefix's
                                    last page may be partial)

Everything is computed on the device into buffers sized from host-known bounds:
no device->host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.kernels import plan as plan_kernel
from sglang_compact.kernels import plan_naive


@dataclass
class PagedPlan:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    num_rows: int          # R = B * H_kv
    batch_size: int        # B
    num_kv_heads: int      # H_kv
    page_size: int


class PlanBuffers:
    """Preallocated, bounded plan buffers (reused every layer; CUDA-graph friendly).

    Args:
        max_rows: bound on R = B * H_kv.
        max_indices: bound on the selected (row, block) pairs, e.g. H_kv * sum_b n_b.
    """

    def __init__(self, max_rows: int, max_indices: int, device: torch.device | str):
        self.max_rows = max_rows
        self.max_indices = max_indices
        self.qo_indptr = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.kv_indptr = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(max(max_indices, 1), dtype=torch.int32, device=device)
        self.kv_last_page_len = torch.zeros(max(max_rows, 1), dtype=torch.int32, device=device)

    @classmethod
    def wrap(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_last_page_len: torch.Tensor) -> "PlanBuffers":
        """Use existing int32 device tensors (e.g. the ones a FlashInfer wrapper runs from)."""
        self = cls.__new__(cls)
        self.max_rows = qo_indptr.numel() - 1
        self.max_indices = kv_indices.numel()
        self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len = (
            qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        return self

    def check_fits(self, rows: int, indices: int) -> None:
        if rows > self.max_rows or indices > self.max_indices:
            raise ValueError(f"plan needs {rows} rows / {indices} indices, buffers hold "
                             f"{self.max_rows} / {self.max_indices}")


def build_plan(table: torch.Tensor, counts: torch.Tensor, page_table: torch.Tensor,
               prefix_lens: torch.Tensor, cu_chunk: torch.Tensor, page_size: int, *,
               buffers: PlanBuffers | None = None, use_triton: bool | None = None,
               index_bound: int | None = None) -> PagedPlan:
    """Build the paged plan of a union table.

    Args:
        table: bool [B, H_kv, NKV]; counts: int32 [B, H_kv];
        page_table: int32 [B, >= NKV]; prefix_lens: int32 [B]; cu_chunk: int32 [B + 1].
        buffers: preallocated outputs (required for the no-allocation path); must hold
            R = B * H_kv rows and `index_bound` indices.
        index_bound: host-known bound on the selected (row, block) pairs, H_kv * sum_b n_b
            (default B * H_kv * NKV).
    """
    B, H_kv, NKV = table.shape
    if use_triton is None:
        use_triton = table.is_cuda
    if use_triton:
        out = None
        if buffers is not None:
            buffers.check_fits(B * H_kv, B * H_kv * NKV if index_bound is None else index_bound)
            out = (buffers.qo_indptr, buffers.kv_indptr, buffers.kv_indices, buffers.kv_last_page_len)
        qo, kvp, kvi, lpl = plan_kernel.build_plan(table, counts, page_table, prefix_lens, cu_chunk,
                                                   page_size, out=out)
    else:
        qo, kvp, kvi, lpl = plan_naive.build_plan(table, counts, page_table, prefix_lens, cu_chunk, page_size)
    return PagedPlan(qo, kvp, kvi, lpl, B * H_kv, B, H_kv, page_size)
