"""The selector interface and the scoring helpers selectors share.

A selector looks at one batch of chunks (their q-blocks and windows, see
`ChunkBatch`) and returns the pages to read (`Selection`):

    table  bool [H_kv, NW, NKV]           the rows' final page sets (per kv head and window: unions and
                                          forced pages done), or
    mask   bool [H_q or H_kv, NQB, NKV]   per query head (or kv head) and q-block: the candidate pages it
                                          selected (the caller unions them per window and adds the forced
                                          pages)

    ranked float [H_q or H_kv, NQB or NW, NKV] with counts int32 [H_kv * NW]: rows of a fixed length,
                                          row r keeping exactly counts[r] pages (its forced pages
                                          first, then the best-scoring candidates: `indices.top_pages_indices`,
                                          one kernel from scores to paged indices)

and optionally `scores` float [H_q or H_kv, NQB or NW, NKV] (higher = more important), which the
density cap ranks by. A q-block's candidates are the pages before its window
(`ChunkBatch.candidates`); the window's own pages and the recent ones are always read.

Registration and parameters: `sglang_compact.selectors.registry`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_compact.batch import ChunkBatch, cdiv
from sglang_compact.kernels import flashprefill as flashprefill_kernel
from sglang_compact.kernels import flashprefill_naive, use_triton
from sglang_compact.selectors.registry import SelectorSpec
from sglang_compact.summaries import LayerSummaries

if TYPE_CHECKING:
    from sglang_compact.config import CompactConfig

NEG_INF = float("-inf")


@dataclass
class Selection:
    """A selector's output: exactly one of `table` (with `counts`), `ranked` (with `counts`; `per_qblock`: its
    second dim is the q-blocks, else the windows) and `mask`; `scores` optional. `counts_per_pass`: `counts` is
    made once per forward pass (`ChunkBatch.memo`, or the rows fixed at the observing layer) and never written
    after, so the same tensor in every layer that gets it: what is derived from it (the density) is derived once."""

    table: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    ranked: torch.Tensor | None = None
    per_qblock: bool = True
    counts_per_pass: bool = False

    def __post_init__(self):
        if sum(x is not None for x in (self.table, self.mask, self.ranked)) != 1:
            raise ValueError("Selection needs exactly one of table, ranked and mask")
        if self.mask is None and self.counts is None:
            raise ValueError("Selection(table=...) and Selection(ranked=...) need counts (int32 [H_kv * NW])")


class Selector:
    """Base class; subclasses are registered with `register_selector` and implement `select`."""

    name: str = ""
    spec: SelectorSpec

    def __init__(self, config: "CompactConfig"):
        self.config = config
        self.params = config.params

    def row_pages(self, batch: ChunkBatch) -> list[int] | None:
        """Pages every row reads, rows r = g * NW + w, when the selector fixes them from the lengths alone
        (`spec.fixes_row_lengths`); None when they depend on the scores."""
        return None

    def own_layers(self) -> tuple[int, ...]:
        """The model layers whose own parameters make their rows differ from `row_pages` (sorted; none by
        default): the rows then cannot run on one fa3 plan per forward pass."""
        return ()

    def select(self, batch: ChunkBatch, layer: int, summaries: LayerSummaries | None) -> Selection:
        """Args:
            batch: the chunks and their contexts.
            layer: the model's layer id (for per-layer weights and parameters).
            summaries: this layer's page summaries (mean keys); selectors that use them get them.
        """
        raise NotImplementedError

    def fill(self, batch: ChunkBatch, layer: int, summaries: LayerSummaries | None, counts: torch.Tensor
             ) -> Selection:
        """Exactly `counts[r]` pages in each row r = g * NW + w (device int [H_kv * NW]):
        the later layers of a pass whose observing layer fixed the row lengths (`spec.fixes_rows_at_observing_layer`)."""
        raise NotImplementedError(f"selector {self.name!r} does not fill rows to given counts")


# --- shared helpers -------------------------------------------------------------------

def page_scores(batch: ChunkBatch, summaries: LayerSummaries, *, group_max: bool = False,
                query_stride: int = 1, key_bounds: bool = False) -> torch.Tensor:
    """FlashPrefill-style scores of each q-block's candidate pages against their mean keys, or with `key_bounds`
    against Quest's bound from their per-channel key max / min (`kernels/flashprefill_naive.py`): float32
    [H_q or H_kv (group_max), NQB, NKV], 0 outside candidates. The Triton kernel on CUDA when it supports the
    shapes, else the torch twin."""
    bounds = None
    if key_bounds:
        if summaries.key_max is None or summaries.key_min is None:
            raise ValueError("page_scores: the summaries keep no key max / min (PageSummaries(key_bounds=True))")
        bounds = (summaries.key_max, summaries.key_min)
    args = (batch.q, batch.device_qblocks(), batch.page_table, summaries.key_sum, summaries.count, batch.sm_scale,
            batch.num_kv_heads, batch.qblocks.max_pages)
    if use_triton(batch.q) and flashprefill_kernel.supports(batch.head_dim, batch.page_size, query_stride):
        return flashprefill_kernel.block_scores(*args, group_max=group_max, query_stride=query_stride,
                                                page_size=batch.page_size, key_bounds=bounds)
    return flashprefill_naive.block_scores(*args, group_max=group_max, query_stride=query_stride, key_bounds=bounds)


def threshold_rows(scores: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """Keep cells scoring >= alpha * (row max over the valid cells). Rows are the last dim."""
    s = scores.masked_fill(~valid, NEG_INF)
    rowmax = s.amax(dim=-1, keepdim=True)
    return (s >= alpha * rowmax) & valid


def top_p_rows(mass: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    """Smallest set of cells per row (last dim) whose mass reaches p of the row's mass.

    The cell that crosses p is kept; a row with any valid cell keeps at least one.
    """
    m = mass.masked_fill(~valid, 0.0).to(torch.float64)
    total = m.sum(dim=-1, keepdim=True)
    order = torch.argsort(m, dim=-1, descending=True, stable=True)
    ms = m.gather(-1, order)
    before = torch.cumsum(ms, dim=-1) - ms  # mass strictly before this cell
    keep_sorted = before < p * total
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep & valid


def row_budget(n_pages: int, fraction: float, forced: int, min_pages: int = 0) -> int:
    """Pages a row with n_pages context pages, `forced` of them forced, keeps at `fraction` with a floor of
    `min_pages`: min(n, max(ceil(fraction * n), forced, min_pages)). The host twin of `top_pages_per_row`'s
    count."""
    return min(n_pages, max(math.ceil(n_pages * fraction - 1e-9), forced, min_pages))


def forced_count(first: int, last: int, sink_blocks: int, recent_blocks: int) -> int:
    """How many pages `batch.forced_pages` forces for a sparse window (pages first..last, context 0..last)."""
    before = set(range(min(sink_blocks, first))) | set(range(max(0, first - recent_blocks), first))
    return len(before) + last - first + 1


def budget_row_pages(batch: ChunkBatch, fraction: float, sink_blocks: int, recent_blocks: int,
                     min_pages: int = 0) -> list[int]:
    """Host page counts of every row r = g * NW + w: `row_budget` for a sparse window, last + 1 for a dense one."""
    qb = batch.qblocks
    per_w = [row_budget(l + 1, fraction, forced_count(f, l, sink_blocks, recent_blocks), min_pages) if s else l + 1
             for f, l, s in zip(qb.w_first, qb.w_last, qb.w_sparse)]
    return per_w * batch.num_kv_heads


def budget_counts(batch: ChunkBatch, fraction: float, sink_blocks: int, recent_blocks: int,
                  min_pages: int = 0) -> torch.Tensor:
    """`budget_row_pages` on the device (int32 [H_kv * NW]), made once per batch."""
    return batch.memo(("budget_rows", fraction, sink_blocks, recent_blocks, min_pages), lambda: torch.tensor(
        budget_row_pages(batch, fraction, sink_blocks, recent_blocks, min_pages), dtype=torch.int32).to(
        batch.q.device, non_blocking=True))


def window_scores(scores: torch.Tensor, batch: ChunkBatch) -> torch.Tensor:
    """float [H, NQB, NKV] per-q-block scores -> [H, NW, NKV]: the best over each window's q-blocks."""
    d = batch.device_qblocks()
    out = torch.zeros(scores.shape[0], batch.qblocks.windows, scores.shape[2], dtype=scores.dtype,
                      device=scores.device)
    return out.index_reduce_(1, d["window"].long(), scores, "amax", include_self=True)


def row_scores(scores: torch.Tensor, batch: ChunkBatch) -> torch.Tensor:
    """Scores per query head or kv head, per q-block or per window -> float [H_kv, NW, NKV], one row per kv
    head and window: the best over each kv head's query-head group, then over each window's q-blocks (a
    row reads its pages for every query head and every q-block of its window)."""
    H_kv = batch.num_kv_heads
    if scores.shape[0] != H_kv:
        scores = scores.reshape(H_kv, scores.shape[0] // H_kv, *scores.shape[1:]).amax(dim=1)
    if scores.shape[1] != batch.qblocks.windows:
        scores = window_scores(scores, batch)
    return scores


def top_pages_per_row(row_scores: torch.Tensor, batch: ChunkBatch, fraction: float, sink_blocks: int,
                      recent_blocks: int, allowed: torch.Tensor | None = None, min_pages: int = 0):
    """Keep `row_budget` pages of each sparse row: the forced pages first, then the best-scoring candidates
    (equal scores in any order); a dense row keeps every page 0..last. The density cap's ranking (with
    `allowed`, the rows' table, of which at most that many cells survive); the selectors that fix their rows
    rank in one kernel instead (`Selection.ranked`, `indices.top_pages_indices`).

    Args:
        row_scores: float [H_kv, NW, NKV]; allowed: bool [H_kv, NW, NKV] or None.
    Returns:
        table bool [H_kv, NW, NKV], counts int32 [H_kv * NW].
    """
    H, NW, NKV = row_scores.shape

    def per_batch():
        counts = budget_row_pages(batch, fraction, sink_blocks, recent_blocks, min_pages)[:NW]
        return torch.tensor(counts, dtype=torch.long).to(row_scores.device, non_blocking=True), max(counts, default=0)
    k, k_max = batch.memo(("budget_counts", fraction, sink_blocks, recent_blocks, min_pages), per_batch)
    out = _keep_top(_ranked(row_scores, batch, sink_blocks, recent_blocks, allowed), k[None, :].expand(H, NW), k_max)
    if allowed is not None:
        out &= allowed
    return out, out.sum(dim=-1, dtype=torch.int32).reshape(-1)


def _ranked(row_scores: torch.Tensor, batch: ChunkBatch, sink_blocks: int, recent_blocks: int,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [H_kv, NW, NKV]: the rows' scores with their forced pages at +inf and the pages they may not read
    (past their last; outside `allowed`, when given) at -inf."""
    H, NW, NKV = row_scores.shape

    def per_batch():
        forced = batch.forced(sink_blocks, recent_blocks)                     # [NW, NKV]
        ctx = batch.full_table()[0]                                           # [NW, NKV] j <= last
        bias = torch.zeros(NW, NKV, dtype=torch.float32, device=row_scores.device)
        bias.masked_fill_(~ctx, NEG_INF).masked_fill_(forced, float("inf"))
        return forced, ctx, bias
    forced, ctx, bias = batch.memo(("ranked", sink_blocks, recent_blocks), per_batch)
    if allowed is None:
        return row_scores.to(torch.float32) + bias
    return torch.where(forced, float("inf"), torch.where(ctx & allowed, row_scores.to(torch.float32), NEG_INF))


def _keep_top(ranked: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """bool [H, NW, NKV]: the k[h, w] best pages of each row of `ranked` (k_max >= every k, on the host)."""
    H, NW, NKV = ranked.shape
    k_max = min(NKV, k_max)
    out = torch.zeros(H, NW, NKV, dtype=torch.bool, device=ranked.device)
    if k_max <= 0 or NW == 0:
        return out
    top = ranked.topk(k_max, dim=-1).indices                                  # [H, NW, k_max], best first
    keep = torch.arange(k_max, device=ranked.device)[None, None, :] < k[:, :, None]
    return out.scatter_(-1, top, keep)


def qblock_queries(batch: ChunkBatch, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Each q-block's queries at their offsets in its page: [NQB, P, H_q, D] in `dtype` (zeros where the
    page has no query of this chunk) and valid bool [NQB, P]."""
    def index():
        qb, P = batch.qblocks, batch.page_size
        u = torch.arange(P)[None, :]
        off = torch.tensor([p - a * P for p, a in zip(qb.pos, qb.page)])[:, None]
        ln = torch.tensor(qb.length)[:, None]
        valid = (u >= off) & (u < off + ln)
        src = (torch.tensor(qb.start)[:, None] + u - off).clamp(0, max(batch.num_tokens - 1, 0))
        return src.to(batch.q.device), valid.to(batch.q.device)
    src, valid = batch.memo(("qblock_queries",), index)
    q = batch.q[src.reshape(-1)].reshape(*src.shape, batch.num_q_heads, batch.head_dim).to(dtype)
    return q * valid[:, :, None, None], valid


def request_qblocks(batch: ChunkBatch):
    """Per request with q-blocks: (qblocks, cand, keys, n_pages). `qblocks` is a slice (a request's q-blocks
    are contiguous, pages ascending), `cand` their candidate page counts on the device (a slice, not an index
    list: no host->device copy), `keys` float32 [H_kv, E, D] the request's context keys, `n_pages` cdiv(E, P)."""
    cand_all = batch.device_qblocks()["cand"]
    for b in range(batch.batch_size):
        idx = [i for i, r in enumerate(batch.qblocks.req) if r == b]
        if not idx:
            continue
        sl = slice(idx[0], idx[-1] + 1)
        keys = batch.context_keys(b).to(torch.float32)
        yield sl, cand_all[sl].long(), keys, cdiv(keys.shape[1], batch.page_size)
