"""`budget`: a fixed fraction of each row's context pages.

Pages are ranked by their best mean-key score over the row's query heads and the q-blocks of its
window (forced sink / recent / window pages first), and the top `row_budget(last + 1, density)`
are kept (at least `min_pages`, or `min_tokens` of pages, where the context has them), so the density the paged kernel
reads is the requested one and every row's length is known on the host before any search: FlashInfer
fa3 is planned once per forward pass. `query_stride` s scores every s-th query of each q-block only (0: 16 of
each page, the stride following the page size).
`CompactConfig.density_cap` ranks the same way.

`layer_density` gives some layers their own fraction (e.g. more pages in the first layers, fewer in the
rest): the rows' lengths then differ between layers, so they run on fa2 rows planned once per forward pass
with each row's whole context as its bound (`--compact-prefill-kernel fa2`; the server says so at start).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sglang_compact.selectors.base import Selection, Selector, budget_counts, budget_row_pages, page_scores
from sglang_compact.selectors.registry import SelectorParams, param, parse_layer_values, register_selector


QUERY_STRIDE_HELP = ("score every s-th query of each q-block (s times cheaper search); 0: score 16 queries of each "
                     "page (page size / 16: 2 at page 32, 4 at page 64)")
MIN_TOKENS_HELP = ("each sparse row keeps at least this many tokens of pages, ceil(min_tokens / page size) (its "
                   "context permitting); the larger of this and min_pages applies")


@dataclass(frozen=True)
class RowBudgetParams(SelectorParams):
    """The parameters of a fixed budget per row (`budget`, `mass_budget`, `quest_budget`)."""

    density: float = param(0.3, lo=0.0, hi=1.0, help="fraction of each row's context pages kept")
    min_pages: int = param(0, lo=0, hi=1 << 20,
                           help="each sparse row keeps at least this many pages (its context permitting)")
    min_tokens: int = param(0, lo=0, hi=1 << 30, help=MIN_TOKENS_HELP)
    layer_density: str | None = param(None, help="fractions of given model layers, 'lo-hi:fraction,...' "
                                                 "(e.g. '2-6:0.6,7-23:0.28'); the others keep `density`")

    def __post_init__(self):
        layer_densities(self)   # a clear error at configuration time

    def floor_pages(self, page_size: int) -> int:
        """The rows' page floor at this page size: max(min_pages, ceil(min_tokens / page_size))."""
        return max(self.min_pages, -(-self.min_tokens // page_size))


@dataclass(frozen=True)
class BudgetParams(RowBudgetParams):
    query_stride: int = param(1, lo=0, hi=16, power_of_two=True, help=QUERY_STRIDE_HELP)


def layer_densities(params) -> dict[int, float]:
    """{model layer: fraction} of `params.layer_density` (`RowBudgetParams`)."""
    if not params.layer_density:
        return {}
    try:
        return _parse_densities(params.layer_density)
    except ValueError as e:
        raise ValueError(f"layer_density: {e}") from None


def expected_density(params, num_layers: int | None = None) -> float:
    """The fraction a pass reads, before forced pages: `density`, or with `layer_density` and the model's
    layer count, the mean over its layers."""
    own = layer_densities(params)
    if not own or not num_layers:
        return params.density
    return sum(own.get(layer, params.density) for layer in range(num_layers)) / num_layers


@functools.lru_cache(maxsize=64)
def _parse_densities(text: str) -> dict[int, float]:
    return parse_layer_values(text, 0.0, 1.0)


@register_selector("budget", params=BudgetParams, fixes_row_lengths=True, uses_summaries=True,
                   expected_density=expected_density)
class BudgetSelector(Selector):
    """A fixed fraction of each row's pages, best mean-key scores first."""

    def row_pages(self, batch):
        """The rows of the layers without a `layer_density` of their own."""
        cfg = self.config
        return budget_row_pages(batch, self.params.density, cfg.sink_blocks, cfg.recent_blocks,
                                self.params.floor_pages(cfg.block_size))

    def own_layers(self):
        return tuple(sorted(layer_densities(self.params)))

    def density_of(self, layer: int) -> float:
        return layer_densities(self.params).get(layer, self.params.density)

    def counts(self, batch, layer: int):
        cfg = self.config
        return budget_counts(batch, self.density_of(layer), cfg.sink_blocks, cfg.recent_blocks,
                             self.params.floor_pages(cfg.block_size))

    def select(self, batch, layer, summaries):
        scores = page_scores(batch, summaries, group_max=True,
                             query_stride=self.params.query_stride_at(batch.page_size))   # [H_kv, NQB, NKV]
        return Selection(ranked=scores, counts=self.counts(batch, layer), scores=scores)
