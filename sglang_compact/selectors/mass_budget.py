"""`mass_budget`: a fixed fraction of each row's context pages, ranked by estimated attention mass.

The pages are ranked by XAttention's strided antidiagonal estimate of each page's attention mass
(`xattention.antidiagonal_page_mass`: it reads the context's keys, not their page means), taking the
best over the row's query heads and the q-blocks of its window, and the top `row_budget(last + 1,
density)` are kept (forced sink / recent / window pages first), as `budget` keeps its pages.

Why it exists: on Qwen2.5-Coder-0.5B at 32K (chunk 1024, page 32), mean-key scores (`budget`,
`flashprefill`) lose 5-7 points of multi-key retrieval at a third of the pages, while this ranking at
the same density keeps dense accuracy (docs/results/accuracy.md, session 14). The likely reason (both
keep the same mean attention mass in a replay; they keep different pages): a needle is one sentence in
a page of haystack, and the page's mean key dilutes it where an 8-token antidiagonal sum does not.

Every row's length is known on the host before any search (`fixes_row_lengths`), so FlashInfer fa3
is planned once per forward pass. The search costs O(chunk x context / stride) per head, more than
the mean-key search, and the cost model has no calibration for it: the gate falls back to a fixed
context threshold unless `--compact-min-context` sets one (`gate.Gate.for_server`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_compact.selectors.base import Selection
from sglang_compact.selectors.budget import BudgetSelector, RowBudgetParams, expected_density
from sglang_compact.selectors.registry import param, register_selector
from sglang_compact.selectors.xattention import antidiagonal_page_mass


@dataclass(frozen=True)
class MassBudgetParams(RowBudgetParams):
    density: float = param(0.33, lo=0.0, hi=1.0, help="fraction of each row's context pages kept")
    stride: int = param(8, lo=1, hi=16, power_of_two=True,
                        help="antidiagonal stride S of the mass estimate (a power of two <= 16 divides every "
                             "page size the config allows)")
    row_stride: int = param(1, lo=1, hi=16, power_of_two=True,
                            help="score every r-th antidiagonal row of a q-block, back from its last row holding a "
                                 "query (r times less search work; must divide page_size / stride)")


@register_selector("mass_budget", params=MassBudgetParams, fixes_row_lengths=True, priced_search=False,
                   expected_density=expected_density)
class MassBudgetSelector(BudgetSelector):
    """A fixed fraction of each row's pages, highest estimated attention mass (XAttention's scoring) first."""

    # row_pages: `budget`'s (the same per-row budget, known on the host)

    def select(self, batch, layer, summaries):
        mass = antidiagonal_page_mass(batch, self.params.stride, self.params.row_stride)    # [H_q, NQB, NKV]
        return Selection(ranked=mass, counts=self.counts(batch, layer), scores=mass, counts_per_pass=True)
