"""CompactAttention for one layer and one batch of chunks: search -> union -> plan -> execute.

Each stage lives in its own module and is tested on its own; this file only
wires them together and applies the config (forced blocks, density cap,
the dense fallback for short prefixes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_compact.batch import ChunkBatch, cdiv
from sglang_compact.config import CompactConfig
from sglang_compact.plan import PagedPlan, PlanBuffers, build_plan
from sglang_compact.selectors import Selection, make_selector
from sglang_compact.selectors.base import row_budget, top_blocks_per_row, valid_cells
from sglang_compact.union import UnionStats, union_stats, union_table


@dataclass
class ChunkPlan:
    """What the search decided for one layer.

    table: bool [B, H_kv, NKV] blocks each (request, kv head) reads
    plan:  the paged metadata of `table`
    stats: densities before/after the unions (device scalars); None when not asked for
    """

    table: torch.Tensor
    plan: PagedPlan
    stats: UnionStats | None


def apply_density_cap(table: torch.Tensor, scores: torch.Tensor, kv_blocks: torch.Tensor, cap: float,
                      sink_blocks: int, recent_blocks: int, max_blocks: int,
                      batch: ChunkBatch | None = None) -> torch.Tensor:
    """Limit each row of the table to max(ceil(cap * n_b), forced) blocks (never dropping forced blocks).

    Blocks are ranked by their best score over the row's query heads and query blocks.

    Args:
        table: bool [B, H_kv, NKV]; scores: float [B, H_q or H_kv, NQ, NKV]; kv_blocks: int [B];
        max_blocks: host bound on n_b; batch: the batch kv_blocks belongs to (keeps the ranking's
        per-batch part for the next layers).
    """
    B, H_kv, NKV = table.shape
    row = scores.reshape(B, H_kv, scores.shape[1] // H_kv * scores.shape[2], NKV).amax(dim=2)
    return top_blocks_per_row(row, kv_blocks, max_blocks, cap, sink_blocks, recent_blocks, allowed=table,
                              batch=batch)


class CompactAttention:
    """Runs the compact path for one model (all its layers share the config and buffers).

    Args:
        config: the validated `CompactConfig`.
        executor: object with `run(batch, plan, return_lse=False)`; default the
            torch executor (CPU). The GPU path passes a `FlashInferExecutor`.
    """

    def __init__(self, config: CompactConfig, executor=None):
        self.config = config
        self.selector = make_selector(config)
        if executor is None:
            from sglang_compact.execute import TorchPagedExecutor
            executor = TorchPagedExecutor()
        self.executor = executor

    def row_blocks(self, prefix_lens: Sequence[int], compact: Sequence[bool]) -> list[int] | None:
        """Blocks each (request, kv head) row will read, per request, known on the host before any
        search (after the unions, forced blocks and the density cap); None when they depend on the
        scores. Requests outside the compact path (compact False) read every prefix block.

        This is what lets a FlashInfer fa3 plan be made once per forward pass: `plan` gives every
        row exactly this many blocks, whatever the layer.
        """
        cfg = self.config
        n = [cdiv(L, cfg.block_size) for L in prefix_lens]
        chosen = self.selector.row_blocks([k for k, c in zip(n, compact) if c])
        if chosen is None:
            return None if any(compact) else n
        chosen = iter(chosen)
        out = []
        for k, c in zip(n, compact):
            r = next(chosen) if c else k
            if c and cfg.density_cap is not None:
                r = min(r, row_budget(k, cfg.density_cap, cfg.sink_blocks, cfg.recent_blocks))
            out.append(r)
        return out

    def select(self, batch: ChunkBatch, layer: int = 0, pooled_keys: torch.Tensor | None = None,
               compact_rows: torch.Tensor | None = None) -> Selection:
        """The selector's mask, with requests outside the compact path (compact_rows False) made dense."""
        if not self.selector.uses_summaries:
            pooled_keys = None
        sel = self.selector.select(batch, layer, pooled_keys)
        if compact_rows is not None:
            if sel.rows is not None:
                sel.rows = torch.where(compact_rows[:, None, None], sel.rows, batch.kv_block_valid()[:, None, :])
            else:
                valid = valid_cells(batch, self.config.block_size)
                sel.mask = torch.where(compact_rows[:, None, None, None], sel.mask, valid)
        return sel

    def plan(self, batch: ChunkBatch, layer: int = 0, pooled_keys: torch.Tensor | None = None,
             compact_rows: torch.Tensor | None = None, buffers: PlanBuffers | None = None,
             with_stats: bool = True) -> ChunkPlan:
        """Search, union (with forced blocks and the density cap) and plan. No host sync on CUDA.

        compact_rows: bool [B] requests on the compact path (None: all of them); the others read
        every prefix block. with_stats: compute the densities (`ChunkPlan.stats`, else None).
        """
        cfg = self.config
        if cfg.block_size != batch.page_size:
            raise ValueError(f"CompactConfig.block_size={cfg.block_size} differs from the KV page size {batch.page_size}")
        sel = self.select(batch, layer, pooled_keys, compact_rows)
        kv_blocks = batch.kv_blocks()
        # a row selection is its own union: the kernel only adds the forced blocks and clips ([B, H_kv, 1, NKV])
        union_in = sel.rows[:, :, None, :] if sel.rows is not None else sel.mask
        table, counts = union_table(union_in, batch.num_kv_heads, kv_blocks, cfg.sink_blocks, cfg.recent_blocks)
        if cfg.density_cap is not None and sel.scores is not None:
            capped = apply_density_cap(table, sel.scores, kv_blocks, cfg.density_cap, cfg.sink_blocks,
                                       cfg.recent_blocks, batch.max_kv_blocks, batch=batch)
            if compact_rows is not None:
                capped = torch.where(compact_rows[:, None, None], capped, table)
            table = capped
            counts = table.sum(-1, dtype=torch.int32)
        stats = union_stats(sel.mask, table, kv_blocks, batch.q_blocks(cfg.block_size)) if with_stats else None
        plan = build_plan(table, counts, batch.page_table, batch.prefix_lens, batch.cu_chunk, batch.page_size,
                          buffers=buffers, index_bound=batch.num_kv_heads * sum(batch.kv_blocks_cpu()))
        return ChunkPlan(table, plan, stats)

    def plan_dense(self, batch: ChunkBatch, buffers: PlanBuffers | None = None) -> ChunkPlan:
        """Every prefix block of every row (the dense path through the same executor); no search."""
        valid = batch.kv_block_valid()  # [B, NKV]
        table = valid[:, None, :].expand(batch.batch_size, batch.num_kv_heads, valid.shape[1]).contiguous()
        counts = batch.kv_blocks()[:, None].expand(batch.batch_size, batch.num_kv_heads).contiguous()
        plan = build_plan(table, counts, batch.page_table, batch.prefix_lens, batch.cu_chunk, batch.page_size,
                          buffers=buffers, index_bound=batch.num_kv_heads * sum(batch.kv_blocks_cpu()))
        one = torch.ones((), dtype=torch.float64, device=table.device)
        return ChunkPlan(table, plan, UnionStats(one, one, one))

    def forward(self, batch: ChunkBatch, layer: int = 0, pooled_keys: torch.Tensor | None = None,
                compact_rows: torch.Tensor | None = None):
        """Returns (o [T, H_q, D], ChunkPlan)."""
        chunk_plan = self.plan(batch, layer, pooled_keys, compact_rows)
        return self.executor.run(batch, chunk_plan.plan), chunk_plan
