"""`budget`: a fixed fraction of each (request, kv head) row's prefix blocks.

Blocks are ranked by their best pooled-key score over the row's query heads and
query blocks (forced sink/recent blocks first), and the top ceil(density * n_b)
are given to every query block and head of the row. So the density the paged
kernel reads after the unions is the requested one (for benchmarks at a chosen
density); `CompactConfig.density_cap` ranks the same way.
"""

from __future__ import annotations

import torch

from sglang_compact.kernels.union_naive import forced_blocks
from sglang_compact.selectors.base import (Selection, Selector, pooled_block_scores, pooled_keys_from_pool,
                                           register_selector, top_k_rows, valid_cells)


@register_selector("budget")
class BudgetSelector(Selector):
    uses_summaries = True

    def select(self, batch, layer=0, pooled_keys=None):
        cfg = self.config
        bs = cfg.block_size
        if pooled_keys is None:
            pooled_keys = pooled_keys_from_pool(batch)
        scores = pooled_block_scores(batch, pooled_keys, bs)  # [B, H_q, NQ, NKV]
        B, H_q, NQ, NKV = scores.shape
        H_kv = batch.num_kv_heads
        kv_blocks = batch.kv_blocks()
        row_score = scores.reshape(B, H_kv, -1, NKV).amax(dim=2)
        forced = forced_blocks(kv_blocks, NKV, cfg.sink_blocks, cfg.recent_blocks)
        row_score = row_score.masked_fill(forced[:, None, :], float("inf"))
        k = torch.ceil(kv_blocks.to(torch.float64) * cfg.param("density") - 1e-9).clamp(min=1).to(torch.long)
        rows = top_k_rows(row_score, batch.kv_block_valid()[:, None, :].expand_as(row_score), k[:, None, None])
        mask = rows.repeat_interleave(batch.group_size, dim=1)[:, :, None, :] & valid_cells(batch, bs)
        return Selection(mask.contiguous(), scores)
