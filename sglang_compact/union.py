"""Block union: per-(query head, q-block) selections -> one page set per row (kv head, window).

    T[g, w, j] = OR over the q-blocks q of window w, OR over the query heads h of kv group g,
                 of M[h, q, j]   | forced pages, j <= last page of w

T is the smallest per-row set that keeps every page a head selected for a
q-block of the window, so no coverage is lost; what it costs is density
(`row_density`): the union of W / P q-blocks' choices.
"""

from __future__ import annotations

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.kernels import union as union_kernel
from sglang_compact.kernels import union_naive, use_triton


def union_table(mask: torch.Tensor, batch: ChunkBatch, sink_blocks: int, recent_blocks: int):
    """mask bool [H_q or H_kv, NQB, NKV] -> table bool [H_kv, NW, NKV], counts int32 [H_kv * NW]."""
    impl = union_kernel.union_table if use_triton(mask) else union_naive.union_table
    return impl(mask, batch.num_kv_heads, batch.device_qblocks(), sink_blocks, recent_blocks)


def row_density(counts: torch.Tensor, batch: ChunkBatch) -> torch.Tensor:
    """Pages the sparse rows read over their context pages (device scalar, float64, no sync); 1.0 when
    no row is sparse."""
    def per_batch():
        qb = batch.qblocks
        w = torch.tensor([float(s) for s in qb.w_sparse] * batch.num_kv_heads, dtype=torch.float64)
        total = sum(a + 1 for a, s in zip(qb.w_last, qb.w_sparse) if s) * batch.num_kv_heads
        return w.to(counts.device, non_blocking=True), float(total)
    w, total = batch.memo(("sparse_row_weights",), per_batch)
    if total == 0:
        return torch.ones((), dtype=torch.float64, device=counts.device)
    return (counts.to(torch.float64) * w).sum() / total


def pass_density(counts: torch.Tensor, batch: ChunkBatch, counts_per_pass: bool) -> torch.Tensor:
    """`row_density`; once per forward pass for counts made once per pass (`Selection.counts_per_pass`), which
    every layer of a fixed-length selector shares: four kernels a layer fewer. The memo's entry keeps the counts
    alive, so their id names them for as long as it does."""
    if not counts_per_pass:
        return row_density(counts, batch)
    return batch.memo(("row_density", id(counts)), lambda: (counts, row_density(counts, batch)))[1]
