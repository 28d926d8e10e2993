"""Chunks that start and end on union-window boundaries, so a window is never split across passes.

A window's selection is the union of its q-blocks' selections (`ChunkBatch`); it is the same
whatever the chunking only when every pass holds the window whole. Two hooks on SGLang's scheduler
(registered by the plugin, active in a scheduler whose model runner built a compact backend):

* chunk ends: the scheduler's `truncation_align_size` (what SGLang's deterministic mode uses to
  align chunk lengths) becomes a multiple of the window, so a truncated chunk ends on a window
  boundary when it starts on one;
* chunk starts: a radix-cache hit that ends inside a window, with a window that reads a selection (the
  gate's decision for this prompt) at or after it, is cut back to the window's start. The chunk
  lengths being whole windows, a chunk that started mid-window would split every later window,
  sparse ones included. The request recomputes those tokens (less than one window) and the cache
  frees the duplicate KV when the request is cached again, as it does for any two requests that
  computed the same prefix.

A hit inside the dense tail (no sparse window after it) is never cut back: the split of a window
that reads every page does not change what it reads.

One split is left: when the pool is nearly full, SGLang may cut the continuing chunk of a request to
the tokens it has room for (`PrefillAdder.add_chunked_req`), not to a window boundary.
"""

from __future__ import annotations

import math

from sglang_compact.srt import compat

#: the gate of this scheduler's compact backend (set by the backend at start; None: no compact backend)
ACTIVE_GATE = None


def activate(gate) -> None:
    global ACTIVE_GATE
    ACTIVE_GATE = gate


def align_chunk_ends(result, scheduler, *args, **kwargs):
    """AFTER hook of the scheduler's deterministic-inference setup: chunk lengths in whole windows."""
    window = compat.compact_window_tokens(scheduler)
    if window:
        current = compat.truncation_align_size(scheduler)
        compat.set_truncation_align_size(scheduler, window if not current else math.lcm(current, window))
    return None


def align_cache_hit(result, req, tree_cache=None, *args, **kwargs):
    """AFTER hook of `Req.init_next_round_input`: a cache hit ending inside a window is cut back to the window's
    start when a window at or after it reads a selection."""
    gate = ACTIVE_GATE
    if gate is None or tree_cache is None:
        return None
    matched = compat.request_matched_len(req)
    W = gate.window
    k = matched // W
    if matched % W == 0:
        return None
    lo, hi = gate.sparse_range(compat.request_prompt_len(req))
    if k < hi and lo < hi:
        compat.truncate_request_prefix(req, k * W)
    return None
