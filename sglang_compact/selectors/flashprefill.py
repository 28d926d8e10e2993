"""`flashprefill` (default): threshold on pooled-key block scores. Training-free.

Score each query block against the mean key of every prefix block (max over
its queries of the softmax-normalised scores) and keep the blocks scoring at
least `alpha` x the row maximum. Reads page summaries when given them, so its
cost is O(prefix pages) per chunk; `query_stride` s scores only every s-th
query of each block (s times cheaper).
"""

from __future__ import annotations

from sglang_compact.selectors.base import (Selection, Selector, pooled_block_scores, pooled_keys_from_pool,
                                           register_selector, threshold_rows, valid_cells)


@register_selector("flashprefill")
class FlashPrefillSelector(Selector):
    uses_summaries = True

    def select(self, batch, layer=0, pooled_keys=None):
        bs = self.config.block_size
        if pooled_keys is None:
            pooled_keys = pooled_keys_from_pool(batch)
        scores = pooled_block_scores(batch, pooled_keys, bs, query_stride=self.config.param("query_stride"))
        valid = valid_cells(batch, bs).expand_as(scores)
        return Selection(threshold_rows(scores, valid, self.config.param("alpha")), scores)
