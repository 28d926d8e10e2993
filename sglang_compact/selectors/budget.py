"""`budget`: a fixed fraction of each (request, kv head) row's prefix blocks.

Blocks are ranked by their best pooled-key score over the row's query heads and
query blocks (forced sink/recent blocks first), and the top ceil(density * n_b)
are given to every query block and head of the row. So the density the paged
kernel reads after the unions is the requested one (for benchmarks at a chosen
density); `CompactConfig.density_cap` ranks the same way.
"""

from __future__ import annotations

from sglang_compact.kernels.union_naive import forced_blocks
from sglang_compact.selectors.base import (Selection, Selector, pooled_block_scores, pooled_keys_from_pool,
                                           register_selector, top_row_blocks, valid_cells)


@register_selector("budget")
class BudgetSelector(Selector):
    uses_summaries = True

    def select(self, batch, layer=0, pooled_keys=None):
        cfg = self.config
        bs = cfg.block_size
        if pooled_keys is None:
            pooled_keys = pooled_keys_from_pool(batch)
        scores = pooled_block_scores(batch, pooled_keys, bs)  # [B, H_q, NQ, NKV]
        kv_blocks = batch.kv_blocks()
        forced = forced_blocks(kv_blocks, scores.shape[-1], cfg.sink_blocks, cfg.recent_blocks)
        valid = batch.kv_block_valid()[:, None, :].expand(-1, batch.num_kv_heads, -1)
        rows = top_row_blocks(scores, valid, kv_blocks, forced, cfg.param("density"), min_keep=1)
        mask = rows.repeat_interleave(batch.group_size, dim=1)[:, :, None, :] & valid_cells(batch, bs)
        return Selection(mask.contiguous(), scores)
