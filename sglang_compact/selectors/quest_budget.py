"""`quest_budget`: a fixed fraction of each row's context pages, ranked by Quest's per-channel bound.

A page's keys bound a query's logit from above: for every channel d, q_d k_d <= max(q_d kmax_d, q_d kmin_d),
with kmax / kmin the channel's largest and smallest key in the page (Quest, Tang et al. 2024), so
u(q, page) = q+ . kmax + q- . kmin >= every q . k of the page. Unlike a page's mean key, the bound is not
diluted when one token of the page (a needle sentence) matches the query and the rest do not. Each q-block
scores its candidate pages by the softmax of the scaled bounds over those pages, maxed over its queries and
the group's heads (the FlashPrefill search with `key_bounds`: `kernels/flashprefill.py`); rows keep
`row_budget(last + 1, density)` pages, forced sink / recent / window pages first, as `budget` does, so the
rows are fixed on the host and FlashInfer fa3 is planned once per forward pass.

The backend keeps each page's key max and min beside its key sum (`PageSummaries(key_bounds=True)`, refreshed
by the KV store launch: two vectors per page and kv head in the pool's dtype), so the search reads
O(context pages) per layer, as `budget`'s does, with two dot products per page tile instead of one.
`query_stride` s (as `budget`'s) scores every s-th query of each q-block, an s times cheaper search. The default,
0, scores 16 queries of each page (the search kernel's smallest query tile: stride 2 at page 32, 4 at page 64):
on Qwen2.5-Coder-0.5B at page 32 stride 2 gave stride 1's answers on 96 of 100 32K prompts (the same score) and
kept the suite within the interval of dense (32K +0.5 [-2.2, +3.0], 16K -1.3 [-3.3, +0.2]); at 128K (page 64,
stride 4) the search takes 0.39 ms of a 4.5 ms layer instead of 1.76 of 5.75 (docs/results/accuracy_notes.md and
speed_no_harm.md, sessions 30-31).

Why: on Qwen2.5-Coder-0.5B (chunk 1024, page 32) mean-key ranking (`budget`) loses 5 points at 32K at a third
of the pages; this ranking at density 0.33 was within the interval of dense at 32K (+1.2 [-2.8, +5.3]) and
16K (-1.7 [-5.8, +2.3]) on the H200 (docs/results/accuracy_notes.md, session 20; measured with float32
bounds from the pool's keys; session 21 served them from the summaries through the kernel and got the same
250 predictions). The cost gate prices its search with the key-bound kernel's throughput
(`CostModel.bounds_search_flops`, about half the mean-key search's on the H200).

The defaults (density 0.25, at least 2560 tokens of pages per row) are the default selector's: a share alone
lost the story needles at 16K (0.33: -3.3; 0.42: -3.7), where the short-context passes keep a few dozen pages;
a floor of 128 pages (page 32) brought 16K to -0.7 [-3.3, +1.3] and 32K to +0.0 [-2.0, +2.0] on 250 prompt
pairs, but read 0.436 of a 32K prompt's pages per pass (sessions 24-25). A floor of 2560 tokens (80 pages at
page 32), with the backend's 256-token dense tail, reads 0.345 per pass and 0.316 page-weighted at 32K and holds
it, +0.2 [-2.3, +2.5], and 16K, +0.5 [-2.2, +3.3], on 300 prompt pairs each over two seeds; at chunk 8192 it
reads 0.25 per pass, -0.5 (32K) and -1.0 (16K) on one seed (docs/results/accuracy_notes.md, session 35). The
floor is in tokens so that it means the same candidates at every page size.

From chunk 8192 up (`chunk_density` '8192:0.33'; SGLang's default chunk on H100 and H200) the share is 0.33: the
gate opens at 8K there, so the floor hardly binds and 0.25 read 0.25 per pass, -1.7 [-3.7, +0.3] at 32K on 450
prompt pairs over three seeds (multi-key -3.3); 0.33 read 0.33 per pass, -0.8 [-2.7, +0.8] on the same prompts
(docs/results/accuracy_notes.md, session 42). The cost gate prices the share the server resolves.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_compact.selectors.base import Selection, page_scores
from sglang_compact.selectors.budget import (CHUNK_DENSITY_HELP, MIN_TOKENS_HELP, QUERY_STRIDE_HELP, BudgetParams,
                                            BudgetSelector, expected_density)
from sglang_compact.selectors.registry import param, register_selector


@dataclass(frozen=True)
class QuestBudgetParams(BudgetParams):
    density: float = param(0.25, lo=0.0, hi=1.0, help="fraction of each row's context pages kept")
    min_tokens: int = param(2560, lo=0, hi=1 << 30, help=MIN_TOKENS_HELP)
    chunk_density: str | None = param("8192:0.33", help=CHUNK_DENSITY_HELP)
    query_stride: int = param(0, lo=0, hi=16, power_of_two=True, help=QUERY_STRIDE_HELP)


@register_selector("quest_budget", params=QuestBudgetParams, fixes_row_lengths=True, uses_key_bounds=True,
                   expected_density=expected_density)
class QuestBudgetSelector(BudgetSelector):
    """A fixed fraction of each row's pages, highest Quest channel bound (per-page key max / min) first."""

    # row_pages: `budget`'s (the same per-row budget, known on the host)

    def select(self, batch, layer, summaries):
        scores = page_scores(batch, summaries, group_max=True, key_bounds=True,
                             query_stride=self.params.query_stride_at(batch.page_size))  # [H_kv, NQB, NKV]
        return Selection(ranked=scores, counts=self.counts(batch, layer), scores=scores, counts_per_pass=True)
