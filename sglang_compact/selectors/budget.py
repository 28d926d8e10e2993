"""`budget`: a fixed fraction of each row's context pages.

Pages are ranked by their best mean-key score over the row's query heads and the q-blocks of its
window (forced sink / recent / window pages first), and the top `row_budget(last + 1, density)`
are kept (at least `min_pages`, or `min_tokens` of pages, where the context has them), so the density the paged kernel
reads is the requested one and every row's length is known on the host before any search: FlashInfer
fa3 is planned once per forward pass. `query_stride` s scores every s-th query of each q-block only (0: 16 of
each page, the stride following the page size).
`CompactConfig.density_cap` ranks the same way.

`chunk_density` sets the fraction by the server's chunked-prefill size ('8192:0.33': from chunk 8192 up,
0.33): the runtime resolves it once (`at_chunk`), so the selector, the cost gate and `/metrics` see one `density`.
An explicit `density` without `chunk_density` holds at every chunk size.

`layer_density` gives some layers their own fraction (e.g. more pages in the first layers, fewer in the
rest): the rows' lengths then differ between layers, so they run on fa2 rows planned once per forward pass
with each row's whole context as its bound (`--compact-prefill-kernel fa2`; the server says so at start).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from sglang_compact.selectors.base import Selection, Selector, budget_counts, budget_row_pages, page_scores
from sglang_compact.selectors.registry import SelectorParams, param, parse_layer_values, register_selector


QUERY_STRIDE_HELP = ("score every s-th query of each q-block (s times cheaper search); 0: score 16 queries of each "
                     "page (page size / 16: 2 at page 32, 4 at page 64)")
CHUNK_DENSITY_HELP = ("fractions by the server's chunked-prefill size, 'tokens:fraction,...' (e.g. '8192:0.33': "
                      "from chunk 8192 up, keep 0.33; chunked prefill off counts as the largest); below the "
                      "smallest, `density`. Cleared when `density` is given without it")
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
    chunk_density: str | None = param(None, help=CHUNK_DENSITY_HELP)

    def __post_init__(self):
        layer_densities(self)   # clear errors at configuration time
        chunk_densities(self)

    @classmethod
    def validated(cls, given, owner):
        # a fraction asked for by name holds at every chunk size, unless the chunk rule is asked for too
        if isinstance(given, Mapping) and "density" in given and "chunk_density" not in given:
            given = {**given, "chunk_density": None}
        return super().validated(given, owner)

    def at_chunk(self, chunk_size: int | None) -> "RowBudgetParams":
        """These parameters at a server's chunked-prefill size (None or <= 0: chunked prefill off): `density`
        from `chunk_density`'s largest step at or below the chunk size (below the smallest: `density` as given),
        and no rule left, so a resolved configuration keeps its share wherever it goes next."""
        steps = chunk_densities(self)
        if not steps:
            return self
        unbounded = chunk_size is None or chunk_size <= 0
        share = next((f for tokens, f in reversed(steps) if unbounded or tokens <= chunk_size), self.density)
        return dataclasses.replace(self, density=share, chunk_density=None)

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


def chunk_densities(params) -> tuple[tuple[int, float], ...]:
    """((chunk tokens, fraction), ...) of `params.chunk_density`, by chunk size (`RowBudgetParams`)."""
    if not params.chunk_density:
        return ()
    try:
        return _parse_chunk_densities(params.chunk_density)
    except ValueError as e:
        raise ValueError(f"chunk_density: {e}") from None


@functools.lru_cache(maxsize=64)
def _parse_chunk_densities(text: str) -> tuple[tuple[int, float], ...]:
    out: dict[int, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        tokens, colon, value = item.partition(":")
        try:
            t, v = int(tokens), float(value)
        except ValueError:
            t, v = 0, math.nan
        if not colon or t < 1 or not 0.0 <= v <= 1.0:
            raise ValueError(f"must be items 'tokens:fraction' with a chunk size >= 1 and a fraction in [0, 1], "
                             f"separated by ',', got {text!r}")
        if t in out:
            raise ValueError(f"chunk size {t} is given twice in {text!r}")
        out[t] = v
    return tuple(sorted(out.items()))


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
        return Selection(ranked=scores, counts=self.counts(batch, layer), scores=scores, counts_per_pass=True)
