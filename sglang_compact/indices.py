"""Paged indices: a table of rows -> FlashInfer's paged kv metadata for the zero-copy layout.

The pool `[num_pages, H_kv, P, D]` is viewed as `[num_pages * H_kv, 1, P, D]`:
every (page, kv head) is one contiguous P x D tile, addressed as
`page * H_kv + g`. Each (kv head g, window w) is one row r = g * NW + w with
G query heads:

    kv_indptr        int32 [R + 1]  prefix sum of the rows' page counts
    kv_indices       int32 [<= cap] page * H_kv + g, ascending pages per row

Per forward pass the rest is fixed by the lengths (`QBlocks`): qo_indptr
(`rows_qo_indptr`) and kv_last_page_len (`last_page_len`: a row's last page
is the page of its window's last query, always read). Everything here is computed on the device
into buffers sized from host-known bounds: no device->host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.kernels import indices as indices_kernel
from sglang_compact.kernels import indices_naive, use_triton


@dataclass
class PagedIndices:
    kv_indptr: torch.Tensor      # int32 [R + 1]
    kv_indices: torch.Tensor     # int32, valid up to kv_indptr[-1]
    num_rows: int


class IndexBuffers:
    """Preallocated, bounded index buffers reused by every layer of a forward pass.

    Args:
        max_rows: bound on R = H_kv * NW.
        max_indices: bound on the selected (row, page) pairs.
    """

    def __init__(self, max_rows: int, max_indices: int, device: torch.device | str):
        self.kv_indptr = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(max(max_indices, 1), dtype=torch.int32, device=device)

    @classmethod
    def wrap(cls, kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> "IndexBuffers":
        """Use existing int32 device tensors (e.g. the ones a FlashInfer wrapper runs from)."""
        self = cls.__new__(cls)
        self.kv_indptr, self.kv_indices = kv_indptr, kv_indices
        return self

    @property
    def max_rows(self) -> int:
        return self.kv_indptr.numel() - 1

    @property
    def max_indices(self) -> int:
        return self.kv_indices.numel()

    def check_fits(self, rows: int, indices: int) -> None:
        if rows > self.max_rows or indices > self.max_indices:
            raise ValueError(f"indices need {rows} rows / {indices} pages, buffers hold "
                             f"{self.max_rows} / {self.max_indices}")


def index_bound(batch: ChunkBatch) -> int:
    """Host bound on the pages all rows' indices name: every sparse row dense."""
    return batch.num_kv_heads * sum(batch.qblocks.rows_bound())


def rows_table(table: torch.Tensor, counts: torch.Tensor, batch: ChunkBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """What the rows' kernel reads of a table: a window computed apart (`QBlocks.dense_apart`: dense, in a pass
    with sparse windows) keeps only its own pages; the executor computes its attention over every page in
    its own pass. Unchanged when no window is apart."""
    qb = batch.qblocks
    apart = qb.dense_apart
    if not any(apart):
        return table, counts

    def masks():
        first = torch.tensor([f if a else 0 for f, a in zip(qb.w_first, apart)], dtype=torch.int32)
        keep = torch.arange(table.shape[-1])[None, :] >= first[:, None]            # [NW, NKV]
        return (keep.to(table.device, non_blocking=True),
                first.repeat(table.shape[0]).to(counts.device, non_blocking=True))
    keep, drop = batch.memo(("apart_rows", table.shape[0], table.shape[-1]), masks)
    return table & keep[None], counts - drop


def build_indices(table: torch.Tensor, counts: torch.Tensor, batch: ChunkBatch,
                  buffers: IndexBuffers | None = None) -> PagedIndices:
    """The paged indices of a rows' table (bool [H_kv, NW, NKV], counts int32 [R]); the rows of windows
    computed apart name their own pages only (`rows_table`)."""
    table, counts = rows_table(table, counts, batch)
    R = batch.num_rows
    row_req = batch.device_qblocks()["w_req"]
    if use_triton(table):
        out = None
        if buffers is not None:
            buffers.check_fits(R, index_bound(batch))
            out = (buffers.kv_indptr, buffers.kv_indices)
        kv_indptr, kv_indices = indices_kernel.build_indices(table, counts, batch.page_table, row_req, out=out)
    else:
        kv_indptr, kv_indices = indices_naive.build_indices(table, counts, batch.page_table, row_req)
    return PagedIndices(kv_indptr, kv_indices, R)
