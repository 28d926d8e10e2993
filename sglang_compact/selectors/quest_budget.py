"""`quest_budget`: a fixed fraction of each row's context pages, ranked by Quest's per-channel bound.

A page's keys bound a query's logit from above: for every channel d, q_d k_d <= max(q_d kmax_d, q_d kmin_d),
with kmax / kmin the channel's largest and smallest key in the page (Quest, Tang et al. 2024), so
u(q, page) = q+ . kmax + q- . kmin >= every q . k of the page. Unlike a page's mean key, the bound is not
diluted when one token of the page (a needle sentence) matches the query and the rest do not. Each q-block
scores its candidate pages by the softmax of the scaled bounds over those pages, maxed over its queries
(normalised per query as FlashPrefill's mean-key scores are); rows keep `row_budget(last + 1, density)`
pages, forced sink / recent / window pages first, as `budget` and `mass_budget` do, so the rows are fixed on
the host and FlashInfer fa3 is planned once per forward pass.

What it is for: the evidence on Qwen2.5-Coder-0.5B (docs/results/accuracy_notes.md, session 14) is that the
ranking, not the density, loses retrieval at a third of the pages, and that reading the keys (`mass_budget`)
rather than their page means recovers it. This selector tests whether per-page channel bounds, which a
serving path could keep beside the mean keys (two vectors per page and kv head), rank as well. It computes the
bounds from the pool's keys in every layer (plain torch, O(context tokens) per layer): an accuracy
experiment, not a fast path; the cost model does not price it (`priced_search=False`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.selectors.base import Selection, qblock_queries, request_qblocks
from sglang_compact.selectors.budget import BudgetSelector, RowBudgetParams, expected_density
from sglang_compact.selectors.registry import param, register_selector


@dataclass(frozen=True)
class QuestBudgetParams(RowBudgetParams):
    density: float = param(0.33, lo=0.0, hi=1.0, help="fraction of each row's context pages kept")


def channel_bounds(keys: torch.Tensor, pages: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kmax, kmin) float32 [H_kv, pages, D]: each of the first `pages` full pages' largest and smallest key
    per channel. keys: [H_kv, >= pages * page_size, D]."""
    H, _, D = keys.shape
    k = keys[:, :pages * page_size].to(torch.float32).reshape(H, pages, page_size, D)
    return k.amax(dim=2), k.amin(dim=2)


def bound_scores(batch) -> torch.Tensor:
    """float32 [H_q, NQB, NKV]: per query head and q-block, the softmax over its candidate pages of
    sm_scale x u(q, page), maxed over the q-block's queries; 0 outside the candidates."""
    q_pad, q_valid = qblock_queries(batch)                                   # [NQB, P, H_q, D], [NQB, P]
    NQB, P, H_q, D = q_pad.shape
    H_kv, G = batch.num_kv_heads, batch.group_size
    out = torch.zeros(H_q, NQB, batch.qblocks.max_pages, dtype=torch.float32, device=q_pad.device)
    for sl, cand, keys, _ in request_qblocks(batch):
        a = int(cand.max()) if cand.numel() else 0
        if a == 0:
            continue
        kmax, kmin = channel_bounds(keys, a, P)                               # [H_kv, a, D]
        q = q_pad[sl].reshape(-1, P, H_kv, G, D).permute(2, 3, 0, 1, 4)       # [H_kv, G, n, P, D]
        u = (torch.einsum("hgnpd,had->hgnpa", q.clamp(min=0), kmax)
             + torch.einsum("hgnpd,had->hgnpa", q.clamp(max=0), kmin)) * batch.sm_scale
        ok = torch.arange(a, device=u.device)[None, :] < cand[:, None]          # [n, a]
        u = u.masked_fill(~ok[None, None, :, None, :], float("-inf"))
        p = torch.softmax(u, dim=-1).nan_to_num_(0.0) * q_valid[sl][None, None, :, :, None]
        out[:, sl, :a] = p.amax(dim=3).reshape(H_q, -1, a)
    return out


@register_selector("quest_budget", params=QuestBudgetParams, fixes_row_lengths=True, priced_search=False,
                   expected_density=expected_density)
class QuestBudgetSelector(BudgetSelector):
    """A fixed fraction of each row's pages, highest Quest channel bound (per-page key max / min) first."""

    # row_pages: `budget`'s (the same per-row budget, known on the host)

    def select(self, batch, layer, summaries):
        scores = bound_scores(batch)
        return Selection(ranked=scores, counts=self.counts(batch, layer), scores=scores)
