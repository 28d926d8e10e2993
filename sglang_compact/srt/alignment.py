"""Cached KV that is exactly what a cold prefill would compute, and windows never split across passes.

The KV of a window's tokens depends on how the window was computed: dense (below the gate's
min_context, or in a prompt's dense tail) or sparse, where every query of the window reads the union
of the window's q-blocks' selections, so the window must be computed in one pass. The hooks here,
registered by the plugin and active in a scheduler whose model runner built a compact backend, keep
every prompt's computation the same whatever was cached before it, how it was chunked, or the batch
it landed in (`W` the window, `[lo, hi)` a prompt's sparse windows from the gate: `Gate.sparse_range`):

* chunk ends: the scheduler's `truncation_align_size` (what SGLang's deterministic mode uses to align
  chunk lengths) becomes a multiple of W, so a chunk that starts on a window boundary ends on one;
* what enters the radix cache: a request's KV is cached only up to `hi * W` of its prompt (`lo * W`
  when none of its windows is sparse). Its later windows were computed dense (its dense tail) or
  from part of a window's queries, which a longer prompt sharing them would compute sparse, over
  the whole window. And only up to the start of a sparse window that the cache already holds part
  of: the KV of a sparse window's first tokens depends on its later tokens (they join the union),
  so a cached prompt that shares only the window's first tokens holds other KV for them, which
  SGLang would otherwise swap in for the request's own when it caches the request's chunk;
* what a request takes from the cache: at most `hi * W` of its own prompt (its dense-tail windows
  are computed dense, which the cached copies were not), cut back to a window start when it has a
  sparse window (chunks then start, and so end, on window boundaries).

So every cached window was computed the way each request that reads it would compute it cold. The
cost: a request recomputes at most its dense tail plus one window of a cache hit (a repeated prompt
recomputes its dense tail), and the cache keeps no prompt's last dense_tail + W tokens or output: a
conversation's next turn recomputes the last turn's tail and answer. `--compact-prefix-cache reuse` trades
the exactness for stock's reuse: the cache keeps and serves everything, a hit is only cut back to a window
start (chunks still start and end on window boundaries), and a later prompt reads KV its cold run would
have computed otherwise (the tail and output were computed dense).

* a pass's prefill budget: with `--enable-mixed-chunk` SGLang takes the decode tokens mixed into a pass
  off the chunk budget; it is rounded back up to whole windows (`whole_window_budget`), else a chunk of one
  window would admit no prompt while any request decodes;
* the next chunk of a prompt: when the KV pool has room for less than the chunk budget, SGLang cuts the
  chunk to that room; it is cut back to the last window end (`align_continuing_chunk`).

One split is left: a pool with room for less than the rest of the current window (logged). Radix caches
other than SGLang's `RadixCache` (hierarchical, SWA, ...) are not limited.
"""

from __future__ import annotations

import logging
import math

from sglang_compact.logs import log_once
from sglang_compact.srt import compat

logger = logging.getLogger(__name__)


#: the gate of this scheduler's compact backend (set by the backend at start; None: no compact backend)
ACTIVE_GATE = None
#: while the radix cache inserts a request's KV: the most tokens of it that may enter the cache
_INSERT_LIMIT: list[int | None] = [None]


def activate(gate) -> None:
    global ACTIVE_GATE
    ACTIVE_GATE = gate


def exact_prefix_len(gate, prompt_len: int) -> int | None:
    """The tokens of a prompt whose KV is computed as every longer prompt sharing them computes it, the most the
    cache keeps and serves of it (None: all of them, when no window is ever sparse, or under
    `--compact-prefix-cache reuse`, which keeps everything)."""
    if gate is None or gate.decision.never or gate.config.prefix_cache == "reuse":
        return None
    _, hi = gate.sparse_range(prompt_len)
    return hi * gate.window


def align_chunk_ends(result, scheduler, *args, **kwargs):
    """AFTER hook of the scheduler's deterministic-inference setup: chunk lengths in whole windows."""
    window = compat.compact_window_tokens(scheduler)
    if window:
        current = compat.truncation_align_size(scheduler)
        compat.set_truncation_align_size(scheduler, window if not current else math.lcm(current, window))
    return None


def align_cache_hit(result, req, tree_cache=None, *args, **kwargs):
    """AFTER hook of `Req.init_next_round_input`: a cache hit is cut to the request's exact prefix, and back to a
    window start when the request has a sparse window."""
    gate = ACTIVE_GATE
    if gate is None or tree_cache is None:
        return None
    matched = compat.request_matched_len(req)
    prompt = compat.request_prompt_len(req)
    limit = exact_prefix_len(gate, prompt)
    if gate.decision.never or matched == 0:
        return None
    keep = matched if limit is None else min(matched, limit)
    lo, hi = gate.sparse_range(prompt)
    if lo < hi:
        keep = keep // gate.window * gate.window
    if keep < matched:
        compat.truncate_request_prefix(req, keep)
    return None


def whole_window_budget(result, adder, *args, **kwargs):
    """AFTER hook of a pass's prefill budget (`PrefillAdder.__init__`): in whole windows again after SGLang takes
    the decode tokens of a mixed pass (`--enable-mixed-chunk`) off it.

    A chunk ends on a window boundary (`align_chunk_ends`), so a budget of the chunk size less the running decodes
    admits one window fewer than the chunk, and none at all when the chunk is one window (chunk <= 1024 tokens):
    the prompt then waits until every running request has finished decoding. The budget is rounded up to whole
    windows instead (never above the chunk size): the decode tokens ride on top of the prefill chunk, at most
    W - 1 tokens more in a pass than `--chunked-prefill-size`.
    """
    gate = ACTIVE_GATE
    if gate is None:
        return None
    try:
        chunk, decode_tokens = compat.prefill_budget_args((adder,) + args, kwargs)
    except Exception:  # an SGLang whose prefill budget we do not understand: keep its budget
        log_once(logger, logging.ERROR, "sglang_compact: could not read the scheduler's prefill budget; mixed "
                 "chunks keep SGLang's budget", exc_info=True)
        return None
    budget, w = compat.chunk_budget(adder), gate.window
    if not decode_tokens or chunk is None or budget is None or chunk % w or budget <= 0 or budget % w == 0:
        return None
    compat.set_chunk_budget(adder, min(chunk, -(-budget // w) * w))
    return None


def continuing_chunk_tokens(start: int, fill_len: int, room: int, window: int, sparse: tuple[int, int]) -> int | None:
    """The tokens of a prompt's next chunk, from `start`, when SGLang would take `room` of them: cut back to the
    last window end where the chunk would end inside a sparse window (`sparse`: [lo, hi) in windows). None: take
    `room` (the chunk ends on a window boundary, at the prompt's end, or outside the sparse windows); 0: the room is
    less than the rest of the current sparse window, which then cannot stay in one pass."""
    lo, hi = sparse
    end = start + room
    if lo >= hi or end >= fill_len or end % window == 0 or end <= lo * window or end >= hi * window:
        return None
    return max(end // window * window - start, 0)


def align_continuing_chunk(original, adder, req, *args, **kwargs):
    """AROUND hook of the admission of a request's next chunk (`PrefillAdder.add_chunked_req`): when the KV pool
    has room for less than the chunk budget, SGLang cuts the chunk to that room, mid-window; it is cut back to the
    last window end instead (`continuing_chunk_tokens`), so that each sparse window's queries stay in one pass.
    With room for less than the rest of the current window the split stays (SGLang must admit the request), and
    is logged."""
    gate, keep = ACTIVE_GATE, None
    try:
        room = compat.continuing_chunk_room(adder) if gate is not None else None
        if room is not None:
            keep = continuing_chunk_tokens(compat.request_matched_len(req), compat.request_fill_len(req), room,
                                           gate.window, gate.sparse_range(compat.request_origin_len(req)))
    except Exception:  # an SGLang whose scheduler we do not understand: SGLang's own chunk
        log_once(logger, logging.ERROR, "sglang_compact: could not read a continuing chunk's room; it keeps "
                 "SGLang's length", exc_info=True)
    if not keep:
        if keep == 0:
            log_once(logger, logging.WARNING, "sglang_compact: the KV pool had room for %d tokens of a request's "
                     "next chunk, less than the rest of its %d-token union window: that window is computed over two "
                     "passes, so this prompt's output can differ from a cold run's. More KV pool room (memory, "
                     "--mem-fraction-static, fewer running requests) avoids it.", room, gate.window)
        return original(adder, req, *args, **kwargs)
    budget = compat.chunk_budget(adder)
    compat.set_chunk_budget(adder, keep)
    try:
        return original(adder, req, *args, **kwargs)
    finally:   # what SGLang took off the budget, taken off the budget it had
        compat.set_chunk_budget(adder, budget - (keep - compat.chunk_budget(adder)))


def limit_cached_prefix(original, cache, req, *args, **kwargs):
    """AROUND hook of the radix cache's insertion of a request's KV (finished or chunked): at most its exact
    prefix enters the cache (`cap_cache_key` cuts the key while this runs); the rest stays the request's own
    and is freed with it."""
    gate = ACTIVE_GATE
    prompt = compat.request_origin_len(req)
    limit = exact_prefix_len(gate, prompt)
    if limit:
        dense_below = gate.sparse_range(prompt)[0] * gate.window   # windows below the gate: dense, causal
        try:
            held = compat.cached_prefix_len(cache, req, limit)
        except Exception:  # an SGLang whose cache we do not understand: cache only the part below the gate
            log_once(logger, logging.ERROR, "sglang_compact: could not read the radix cache's match for a request; "
                     "caching only its part below the gate", exc_info=True)
            held = limit = min(limit, dense_below)
        if held % gate.window and held > dense_below:
            limit = held // gate.window * gate.window
    _INSERT_LIMIT[0] = limit
    try:
        return original(cache, req, *args, **kwargs)
    finally:
        _INSERT_LIMIT[0] = None


def cap_cache_key(result, *args, **kwargs):
    """AFTER hook of the radix key's page alignment: cut to the insert limit (a multiple of the window, so still
    page-aligned) while `limit_cached_prefix` runs."""
    limit = _INSERT_LIMIT[0]
    if limit is None or len(result) <= limit:
        return None
    return result[:limit]
