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

import logging
from dataclasses import dataclass

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.kernels import indices as indices_kernel
from sglang_compact.kernels import indices_naive, top_pages_naive, use_triton
from sglang_compact.kernels import top_pages as top_pages_kernel
from sglang_compact.logs import log_once

logger = logging.getLogger(__name__)


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
    """Host bound on the pages all rows' indices name: every sparse row dense (once per batch)."""
    return batch.memo(("index_bound",), lambda: batch.num_kv_heads * sum(batch.qblocks.rows_bound()))


def _out(batch: ChunkBatch, buffers: IndexBuffers | None):
    if buffers is None:
        return None
    buffers.check_fits(batch.num_rows, index_bound(batch))
    return buffers.kv_indptr, buffers.kv_indices


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
        kv_indptr, kv_indices = indices_kernel.build_indices(table, counts, batch.page_table, row_req,
                                                             out=_out(batch, buffers))
    else:
        kv_indptr, kv_indices = indices_naive.build_indices(table, counts, batch.page_table, row_req)
    return PagedIndices(kv_indptr, kv_indices, R)


def top_pages_indices(ranked: torch.Tensor, counts: torch.Tensor, batch: ChunkBatch, sink_blocks: int,
                      recent_blocks: int, per_qblock: bool = True, buffers: IndexBuffers | None = None
                      ) -> tuple[torch.Tensor, PagedIndices]:
    """Rows of a fixed length from scores, straight to paged indices (`kernels/top_pages.py`): row r keeps
    exactly counts[r] pages, its forced pages first, then its best-scoring candidates (ties: lower pages);
    a dense window's row reads every page (its indices its own pages only, when computed apart).

    Args:
        ranked: float [H_kv * GS, NQB (per_qblock) or NW, NKV]: a row's score of a page is the best over its
            kv head's GS score rows and its window's q-blocks.
        counts: int32 [H_kv * NW] on the device (a dense window's: last + 1).
    Returns:
        table bool [H_kv, NW, NKV] (a dense window's row: every page 0..last), the rows' paged indices.
    """
    args = (ranked, batch.device_qblocks(), counts, batch.page_table, batch.num_kv_heads, sink_blocks,
            recent_blocks, per_qblock, batch.qblocks.any_sparse)
    if use_triton(ranked) and top_pages_kernel.supports(ranked.shape[-1]):
        table, kv_indptr, kv_indices = top_pages_kernel.top_pages(*args, out=_out(batch, buffers))
    else:
        if use_triton(ranked):  # a row longer than the kernel's tile: ranked on its torch twin (right, slower)
            log_once(logger, logging.WARNING, "sglang_compact: rows of %d pages exceed the top-pages kernel's %d; "
                     "they are ranked by its torch twin (slower). A larger --page-size keeps such prompts on the "
                     "kernel.", ranked.shape[-1], top_pages_kernel.MAX_PAGES)
        table, kv_indptr, kv_indices = top_pages_naive.top_pages(*args)
    return table, PagedIndices(kv_indptr, kv_indices, batch.num_rows)
