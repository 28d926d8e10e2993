"""CompactAttention for one layer and one batch of chunks: search -> block union -> paged indices.

Each stage lives in its own module and is tested on its own; this file wires
them together and applies the config (forced pages, the density cap). The
per-forward-pass planning and the attention itself are the executor's
(`sglang_compact.executors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.config import CompactConfig
from sglang_compact.indices import IndexBuffers, PagedIndices, build_indices, top_pages_indices
from sglang_compact.selectors import make_selector
from sglang_compact.selectors.base import Selection, forced_count, row_budget, row_scores, top_pages_per_row
from sglang_compact.summaries import LayerSummaries
from sglang_compact.union import pass_density, union_table


@dataclass
class PageSelection:
    """What one layer reads.

    table:    bool [H_kv, NW, NKV] pages of each row r = g * NW + w (kv head, window)
    counts:   int32 [H_kv * NW]
    indices:  the rows' paged indices
    density:  pages the sparse rows read over their context pages (device scalar), when asked for
    coverage: fraction of the selector's choices the density cap kept (device scalar), when a cap applies
              and stats are asked for
    """

    table: torch.Tensor
    counts: torch.Tensor
    indices: PagedIndices
    density: torch.Tensor | None = None
    coverage: torch.Tensor | None = None


class CompactAttention:
    """Selects the pages of every layer of one model (the layers share the config).

    Args:
        config: the validated `CompactConfig`.
    """

    def __init__(self, config: CompactConfig):
        self.config = config
        self.selector = make_selector(config)

    @property
    def uses_summaries(self) -> bool:
        return self.selector.spec.uses_summaries

    @property
    def uses_key_bounds(self) -> bool:
        return self.selector.spec.uses_key_bounds

    def row_pages(self, batch: ChunkBatch) -> list[int] | None:
        """Pages each row reads (rows r = g * NW + w), known on the host before any search, after the forced
        pages and the density cap; None when they depend on the scores. What lets a FlashInfer fa3 plan serve
        every layer of a forward pass."""
        qb = batch.qblocks
        pages = self.selector.row_pages(batch) if qb.any_sparse else qb.full_counts() * batch.num_kv_heads
        cfg = self.config
        if pages is None or cfg.density_cap is None:
            return pages
        caps = [row_budget(l + 1, cfg.density_cap, forced_count(f, l, cfg.sink_blocks, cfg.recent_blocks)) if s
                else l + 1 for f, l, s in zip(qb.w_first, qb.w_last, qb.w_sparse)] * batch.num_kv_heads
        return [min(p, c) for p, c in zip(pages, caps)]

    def select_pages(self, batch: ChunkBatch, layer: int = 0, summaries: LayerSummaries | None = None,
                     buffers: IndexBuffers | None = None, with_stats: bool = False,
                     fill: torch.Tensor | None = None) -> PageSelection:
        """Search, union (forced pages, the density cap) and paged indices. No host sync on CUDA.

        summaries: this layer's page summaries (computed from the pool when the selector needs them and
        none are given). with_stats: compute the density (and the cap's coverage). fill: pages per row
        (device int32 [H_kv * NW]): every row keeps exactly that many pages (`Selector.fill`; rows fixed at the pass's first
        layer), the density cap already in the counts.
        """
        cfg = self.config
        if cfg.block_size != batch.page_size:
            raise ValueError(f"CompactConfig.block_size={cfg.block_size} differs from the KV page size {batch.page_size}")
        if summaries is None and self.uses_summaries:
            summaries = LayerSummaries.from_pool(batch.k_pool, batch.page_table, batch.context_lens_cpu(),
                                                 key_bounds=self.uses_key_bounds)
        sel = self.selector.select(batch, layer, summaries) if fill is None else \
            self.selector.fill(batch, layer, summaries, fill)
        # rows of a fixed length (filled rows have the density cap in their counts): one kernel to the indices
        if sel.ranked is not None and (fill is not None or cfg.density_cap is None):
            table, indices = top_pages_indices(sel.ranked, sel.counts, batch, cfg.sink_blocks, cfg.recent_blocks,
                                               sel.per_qblock, buffers)
            return PageSelection(table, sel.counts, indices,
                                 pass_density(sel.counts, batch, sel.counts_per_pass) if with_stats else None)
        if sel.ranked is not None:
            table, counts = top_pages_indices(sel.ranked, sel.counts, batch, cfg.sink_blocks, cfg.recent_blocks,
                                              sel.per_qblock)[0], sel.counts
        elif sel.table is not None:
            table, counts = sel.table, sel.counts
        else:
            table, counts = union_table(sel.mask, batch, cfg.sink_blocks, cfg.recent_blocks)
        coverage = None
        if cfg.density_cap is not None:
            capped, counts = self._cap(sel, table, batch)
            if with_stats:
                coverage = (capped & table).sum(dtype=torch.float64) / table.sum(dtype=torch.float64).clamp(min=1)
            table = capped
        indices = build_indices(table, counts, batch, buffers)
        density = pass_density(counts, batch, sel.counts_per_pass and counts is sel.counts) if with_stats else None
        return PageSelection(table, counts, indices, density, coverage)

    def read_all(self, batch: ChunkBatch, buffers: IndexBuffers | None = None,
                 with_stats: bool = False) -> PageSelection:
        """Every context page of every row (a layer of `config.dense_layers` in a sparse pass): the same paged
        rows as a selection, so the pass's plan serves it; table and counts made once per batch."""
        table, counts = batch.memo(("read_all",), lambda: (batch.full_table().contiguous(), torch.tensor(
            batch.qblocks.full_counts() * batch.num_kv_heads, dtype=torch.int32).to(batch.q.device, non_blocking=True)))
        indices = build_indices(table, counts, batch, buffers)
        return PageSelection(table, counts, indices, pass_density(counts, batch, True) if with_stats else None)

    def _cap(self, sel: Selection, table: torch.Tensor, batch: ChunkBatch):
        """At most `row_budget(last + 1, density_cap)` pages per sparse row, best scores first (group max over
        the query heads, max over the window's q-blocks)."""
        cfg = self.config
        if sel.scores is None:   # a selector without scores: keep the lowest pages (deterministic)
            scores = -torch.arange(table.shape[-1], device=table.device, dtype=torch.float32).expand_as(table)
        else:
            scores = row_scores(sel.scores, batch)
        return top_pages_per_row(scores, batch, cfg.density_cap, cfg.sink_blocks, cfg.recent_blocks, allowed=table)


def mass_recall(batch: ChunkBatch, table: torch.Tensor, kv_head: int) -> torch.Tensor | None:
    """float32 [S] on the batch's device, one value per sparse window: the share of the window's last query's
    attention (kv head `kv_head`, the first query head of its group, causal over the request's context) that
    falls in the pages its row reads (`table` bool [H_kv, NW, NKV]). 1.0: the selection misses nothing of that
    query's attention. None when no window is sparse. No host sync (shapes come from the host lengths)."""
    qb, P = batch.qblocks, batch.page_size
    q_head = kv_head * batch.group_size
    values = []
    keys: dict[int, torch.Tensor] = {}
    for w, sparse in enumerate(qb.w_sparse):
        if not sparse:
            continue
        b = qb.w_req[w]
        position = qb.w_pos[w] + qb.w_length[w] - 1          # the window's last query, absolute position
        if b not in keys:
            n = qb.n_ctx[b]
            keys[b] = batch.k_pool[batch.page_table[b, :n].long(), kv_head].reshape(n * P, -1)
        k = keys[b][:position + 1].to(torch.float32)
        q = batch.q[qb.w_start[w] + qb.w_length[w] - 1, q_head].to(torch.float32)
        p = torch.softmax((k @ q) * batch.sm_scale, dim=0)
        pages = -(-(position + 1) // P)
        page_mass = torch.nn.functional.pad(p, (0, pages * P - p.numel())).view(pages, P).sum(dim=1)
        values.append((page_mass * table[kv_head, w, :pages]).sum())
    return torch.stack(values) if values else None
