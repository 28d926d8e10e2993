"""`budget`: a fixed fraction of each row's blocks, best pooled-key scores first.

Gives a chosen density for benchmarks; the same ranking implements
`CompactConfig.density_cap`.
"""

from __future__ import annotations

from sglang_compact.selectors.base import (Selection, Selector, pooled_block_scores, pooled_keys_from_pool,
                                           register_selector, top_fraction_rows, valid_cells)


@register_selector("budget")
class BudgetSelector(Selector):
    uses_summaries = True

    def select(self, batch, layer=0, pooled_keys=None):
        bs = self.config.block_size
        if pooled_keys is None:
            pooled_keys = pooled_keys_from_pool(batch)
        scores = pooled_block_scores(batch, pooled_keys, bs)
        valid = valid_cells(batch, bs).expand_as(scores)
        return Selection(top_fraction_rows(scores, valid, self.config.param("density")), scores)
