"""`budget`: a fixed fraction of each (request, kv head) row's prefix blocks.

Blocks are ranked by their best pooled-key score over the row's query heads and
query blocks (forced sink/recent blocks first), and the top ceil(density * n_b)
are given to every query block and head of the row (`query_stride` s scores
every s-th query of each block only). So the density the paged
kernel reads after the unions is the requested one (for benchmarks at a chosen
density); `CompactConfig.density_cap` ranks the same way.
"""

from __future__ import annotations

from sglang_compact.selectors.base import (Selection, Selector, pooled_block_scores,
                                           pooled_keys_from_pool, register_selector, row_budget,
                                           top_blocks_per_row, valid_cells)


@register_selector("budget")
class BudgetSelector(Selector):
    uses_summaries = True

    def row_blocks(self, n_blocks):
        cfg = self.config
        return [row_budget(n, cfg.param("density"), cfg.sink_blocks, cfg.recent_blocks) for n in n_blocks]

    def select(self, batch, layer=0, pooled_keys=None):
        cfg = self.config
        bs = cfg.block_size
        if pooled_keys is None:
            pooled_keys = pooled_keys_from_pool(batch)
        scores = pooled_block_scores(batch, pooled_keys, bs, group_max=True,
                                     query_stride=cfg.param("query_stride"))  # [B, H_kv, NQ, NKV]
        rows = top_blocks_per_row(scores.amax(dim=2), batch.kv_blocks(), batch.max_kv_blocks,
                                  cfg.param("density"), cfg.sink_blocks, cfg.recent_blocks, batch=batch)
        return Selection(rows=rows, scores=scores, valid=valid_cells(batch, bs), group_size=batch.group_size)
