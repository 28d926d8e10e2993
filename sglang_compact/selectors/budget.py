"""`budget`: a fixed fraction of each row's context pages.

Pages are ranked by their best mean-key score over the row's query heads and the q-blocks of its
window (forced sink / recent / window pages first), and the top `row_budget(last + 1, density)`
are kept (at least `min_pages` where the context has them), so the density the paged kernel
reads is the requested one and every row's length is known on the host before any search: FlashInfer
fa3 is planned once per forward pass. `query_stride` s scores every s-th query of each q-block only.
`CompactConfig.density_cap` ranks the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_compact.selectors.base import Selection, Selector, budget_counts, budget_row_pages, page_scores
from sglang_compact.selectors.registry import SelectorParams, param, register_selector


@dataclass(frozen=True)
class BudgetParams(SelectorParams):
    density: float = param(0.3, lo=0.0, hi=1.0, help="fraction of each row's context pages kept")
    query_stride: int = param(1, lo=1, hi=16, power_of_two=True,
                              help="score every s-th query of each q-block (s times cheaper search)")
    min_pages: int = param(0, lo=0, hi=1 << 20,
                           help="each sparse row keeps at least this many pages (its context permitting)")


@register_selector("budget", params=BudgetParams, fixes_row_lengths=True, uses_summaries=True,
                   expected_density=lambda p: p.density)
class BudgetSelector(Selector):
    """A fixed fraction of each row's pages, best mean-key scores first."""

    def row_pages(self, batch):
        cfg = self.config
        return budget_row_pages(batch, self.params.density, cfg.sink_blocks, cfg.recent_blocks, self.params.min_pages)

    def counts(self, batch):
        cfg = self.config
        return budget_counts(batch, self.params.density, cfg.sink_blocks, cfg.recent_blocks, self.params.min_pages)

    def select(self, batch, layer, summaries):
        scores = page_scores(batch, summaries, group_max=True, query_stride=self.params.query_stride)  # [H_kv, NQB, NKV]
        return Selection(ranked=scores, counts=self.counts(batch), scores=scores)
