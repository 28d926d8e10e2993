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
recomputes its dense tail), and the cache keeps no prompt's last dense_tail + W tokens or output.

One split is left: when the pool is nearly full, SGLang may cut the continuing chunk of a request to
the tokens it has room for (`PrefillAdder.add_chunked_req`), not to a window boundary. Radix caches
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
    """The tokens of a prompt whose KV is computed as every longer prompt sharing them computes it (None:
    all of them, when no window is ever sparse)."""
    if gate is None or gate.decision.never:
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
    if limit is None or matched == 0:
        return None
    keep = min(matched, limit)
    lo, hi = gate.sparse_range(prompt)
    if lo < hi:
        keep = keep // gate.window * gate.window
    if keep < matched:
        compat.truncate_request_prefix(req, keep)
    return None


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
