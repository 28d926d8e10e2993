"""Cached KV that is exactly what a cold prefill would compute, and windows never split across passes.

The KV of a window's tokens depends on how the window was computed: dense (below the gate's
min_context, or in a prompt's dense tail) or sparse, where every query of the window reads the union
of the window's q-blocks' selections, so the window must be computed in one pass. The hooks here,
registered by the plugin and active in a scheduler whose model runner built a compact backend, keep
every prompt's computation the same whatever was cached before it, how it was chunked, or the batch
it landed in (`W` the window, `[lo, hi)` a prompt's sparse windows from the gate: `Gate.sparse_range`):

* chunk ends: the scheduler's `truncation_align_size` (what SGLang's deterministic mode uses to align
  chunk lengths) becomes a multiple of W, so a chunk that starts on a window boundary ends on one;
* what a request takes from the cache (`align_cache_hit`): the KV it would compute the same way cold
  (`first_inexact`). Each tree node records where the request that inserted it began reading every page,
  `hi * W` of that request (`compat.NODE_DENSE_FROM`; marked by `mark_inserted_node`, kept through splits by
  `mark_split_node`): its tokens from the gate's first sparse window to there were computed sparse, as
  every prompt sparse over the same whole windows computes them, and serve a request sparse there (before its
  own dense tail); its later tokens (the dense tail, the output) were computed reading every page, causally,
  and serve a request that reads every page there (in its own dense tail). Below the gate every request
  reads every page. A hit is cut back to a window start where it ends before the request's dense tail (a
  sparse window is computed whole, so chunks start, and so end, on window boundaries there);
* what enters the radix cache (`limit_cached_prefix`): the request's prompt and output, on top of cached KV it
  computed the same way. Where the cache already holds tokens of the request that it computed otherwise
  (another prompt's dense tail where this one is sparse), or part of one of its sparse windows (the KV of a
  sparse window's first tokens depends on its later tokens, which join the union, so a cached prompt that
  shares only the window's first tokens holds other KV for them), only up to there: SGLang would otherwise
  attach the request's later KV to the cached copies, and swap those in for the request's own when it caches
  a chunk. The dense tail the inserts mark is the one the request's prefill had (`compat.note_admission`, at
  its admission): a retracted request prefills its prompt and its output so far again, so its tail starts
  later than its prompt's own.

So every cached token was computed the way each request that reads it computes it cold. A repeated prompt,
parallel samples of one and a follow-up whose dense tail starts at the same window reuse it all. The cost is a
longer prompt sharing another's dense tail or output (a conversation's next turn, once past the gate): it
computes those windows sparse, so it recomputes them from where the earlier prompt's dense tail began (the
last turn's tail and answer, plus at most one window). `--compact-prefix-cache reuse` trades the exactness for
stock's reuse: every cached token serves, a hit is only cut back to a window start where it ends before the
request's dense tail, and a later prompt may read KV its cold run would have computed otherwise.

* a pass's prefill budget: with `--enable-mixed-chunk` SGLang takes the decode tokens mixed into a pass
  off the chunk budget; it is rounded back up to whole windows (`whole_window_budget`), else a chunk of one
  window would admit no prompt while any request decodes;
* the next chunk of a prompt: when the KV pool has room for less than the chunk budget, SGLang cuts the
  chunk to that room; it is cut back to the last window end (`align_continuing_chunk`).

One split is left: a pool with room for less than the rest of the current window. It is logged, and the
request's KV from that window on stays out of the radix cache (`continuing_chunk_len`). Radix trees other than
SGLang's `RadixCache`, and streaming sessions, are refused at start (`model_checks.check_server_features`).
`tests/cache_model.py` model-checks these rules on SGLang's own radix cache, requests and pools.
"""

from __future__ import annotations

import logging
import math

from sglang_compact.logs import log_once
from sglang_compact.srt import compat

logger = logging.getLogger(__name__)


#: the gate of this scheduler's compact backend (set by the backend at start; None: no compact backend)
ACTIVE_GATE = None
#: while the radix cache inserts a request's KV: the most tokens of it that may enter the cache, and where the
#: request began reading every page (its new tree node's `compat.NODE_DENSE_FROM`)
_INSERT_LIMIT: list[int | None] = [None]
_INSERT_DENSE_FROM: list[int | None] = [None]


def activate(gate) -> None:
    global ACTIVE_GATE
    ACTIVE_GATE = gate


def dense_tail_start(gate, prompt_len: int) -> int | None:
    """Where a prompt's dense tail starts (`hi * W`): before it, from the gate's first sparse window, its KV is
    computed as every prompt sharing those windows and sparse there computes it; from it on (the dense tail, the
    output) every page is read. None: no window is ever sparse, or `--compact-prefix-cache reuse` (every cached
    token is served)."""
    if gate is None or gate.decision.never or gate.config.prefix_cache == "reuse":
        return None
    _, hi = gate.sparse_range(prompt_len)
    return hi * gate.window


def sparse_start(gate, prompt_len: int) -> int:
    """Where the gate's first sparse window of a prompt starts (`lo * W`): every page is read before it."""
    return gate.sparse_range(prompt_len)[0] * gate.window


def window_start_before_tail(gate, pos: int, prompt_len: int) -> int:
    """Where a cache hit ending at `pos` is cut back to: a window start, where it falls before the prompt's dense
    tail and the prompt has a sparse window. Chunks are whole windows from where the hit ends, so a hit ending
    inside a window, even below the gate, would split the sparse windows after it across passes."""
    lo, hi = gate.sparse_range(prompt_len)
    if lo < hi and pos < hi * gate.window:
        return pos // gate.window * gate.window
    return pos


def first_inexact(gate, spans, prompt_len: int) -> int:
    """The first cached position whose KV a prompt of `prompt_len` tokens would compute otherwise cold, along the
    tree nodes `spans` ((start, end, dense_from) in token positions, from the prompt's start; dense_from: where the
    node's inserter began reading every page, None when not recorded: never). Below the gate every window reads
    every page; from there a node's tokens before its dense_from were computed sparse as in their inserter's
    sparse windows, and serve a prompt for which they are sparse too (before its own dense tail); its tokens
    from dense_from on were computed reading every page, and serve a prompt that reads every page there (in its
    dense tail or output). Every page read is causal, so those serve whatever follows; a sparse window serves
    only whole (`window_start_before_tail`, `insert_limit`)."""
    end = spans[-1][1] if spans else 0
    tail = dense_tail_start(gate, prompt_len)
    if tail is None:
        return end
    below = sparse_start(gate, prompt_len)
    for start, stop, dense_from in spans:
        dense_from = stop if dense_from is None else dense_from
        wrong = []
        a, b = max(start, below), min(stop, dense_from)        # computed sparse: wrong in the prompt's dense tail
        if a < b and max(a, tail) < b:
            wrong.append(max(a, tail))
        a = max(start, dense_from, below)                      # computed reading every page: wrong where sparse
        if a < stop and a < tail:
            wrong.append(a)
        if wrong:
            return min(wrong)
    return end


def insert_limit(gate, spans, prompt_len: int) -> int | None:
    """How much of a request's KV may enter the radix cache, which holds `spans` of it (as `first_inexact`): up to
    the first cached token it computed otherwise, and back to a window start where that falls inside one of its
    sparse windows (the cache holds another prompt's KV for part of the window, so the whole window is left out).
    None: all of it. Unlike a cache hit (`window_start_before_tail`), a limit below the gate is not cut: the end of
    what is cached there is no window's part, and cutting it would keep the request's KV out of the cache."""
    held = spans[-1][1] if spans else 0
    limit = first_inexact(gate, spans, prompt_len)
    if sparse_start(gate, prompt_len) < limit < dense_tail_start(gate, prompt_len) and limit % gate.window:
        limit = limit // gate.window * gate.window
    return None if limit >= held else limit


def align_chunk_ends(result, scheduler, *args, **kwargs):
    """AFTER hook of the scheduler's deterministic-inference setup: chunk lengths in whole windows."""
    window = compat.compact_window_tokens(scheduler)
    if window:
        current = compat.truncation_align_size(scheduler)
        compat.set_truncation_align_size(scheduler, window if not current else math.lcm(current, window))
    return None


def align_cache_hit(result, req, tree_cache=None, *args, **kwargs):
    """AFTER hook of `Req.init_next_round_input`: a cache hit is cut to what the request computes the same way
    cold (`first_inexact`), and back to a window start where that falls before the request's dense tail and the
    request has a sparse window. A tree path it cannot read keeps the hit only below the gate, where every request
    reads every page (exact, less reuse), rather than stop the scheduler."""
    gate = ACTIVE_GATE
    if gate is None or tree_cache is None:
        return None
    compat.note_admission(req)
    matched = compat.request_matched_len(req)
    if gate.decision.never or matched == 0:
        return None
    prompt = compat.request_prompt_len(req)
    try:
        exact = first_inexact(gate, compat.node_path_spans(compat.request_cache_node(req)), prompt)
    except Exception:  # a tree SGLang built otherwise than we read it
        log_once(logger, logging.ERROR, "sglang_compact: could not read the radix tree path of a request's cache "
                 "hit; hits are kept only below the gate", exc_info=True)
        exact = sparse_start(gate, prompt)
    keep = window_start_before_tail(gate, min(matched, exact), prompt)
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


def continuing_chunk_len(gate, req, room: int) -> int | None:
    """`continuing_chunk_tokens` of a request's next chunk, from where its prefill stands. Where the room is less
    than the rest of the current sparse window (0), SGLang must still admit the chunk, so that window is computed
    over two passes: the request is noted (`compat.note_split_window`), its KV from that window on is kept out
    of the radix cache (`limit_cached_prefix`), and the split is logged."""
    start = compat.request_matched_len(req)
    keep = continuing_chunk_tokens(start, compat.request_prompt_len(req), room, gate.window,
                                   gate.sparse_range(compat.request_prefill_len(req)))
    if keep == 0:
        compat.note_split_window(req, start // gate.window * gate.window)
        log_once(logger, logging.WARNING, "sglang_compact: the KV pool had room for %d tokens of a request's next "
                 "chunk, less than the rest of its %d-token union window: that window is computed over two passes, "
                 "so this prompt's output can differ from a cold run's, and its KV from there on is kept out of the "
                 "prefix cache. More KV pool room (memory, --mem-fraction-static, fewer running requests) avoids "
                 "it.", room, gate.window)
    return keep


def align_continuing_chunk(original, adder, req, *args, **kwargs):
    """AROUND hook of the admission of a request's next chunk (`PrefillAdder.add_chunked_req`): when the KV pool
    has room for less than the chunk budget, SGLang cuts the chunk to that room, mid-window; it is cut back to the
    last window end instead (`continuing_chunk_len`), so that each sparse window's queries stay in one pass.
    With room for less than the rest of the current window the split stays (SGLang must admit the request)."""
    gate, keep = ACTIVE_GATE, None
    try:
        room = compat.continuing_chunk_room(adder) if gate is not None else None
        if room is not None:
            keep = continuing_chunk_len(gate, req, room)
    except Exception:  # an SGLang whose scheduler we do not understand: SGLang's own chunk
        log_once(logger, logging.ERROR, "sglang_compact: could not read a continuing chunk's room; it keeps "
                 "SGLang's length", exc_info=True)
    if not keep:
        return original(adder, req, *args, **kwargs)
    budget = compat.chunk_budget(adder)
    compat.set_chunk_budget(adder, keep)
    try:
        return original(adder, req, *args, **kwargs)
    finally:   # what SGLang took off the budget, taken off the budget it had
        compat.set_chunk_budget(adder, budget - (keep - compat.chunk_budget(adder)))


def limit_cached_prefix(original, cache, req, *args, **kwargs):
    """AROUND hook of the radix cache's insertion of a request's KV (finished or chunked). Its new tree node is
    marked with where the request began reading every page (`compat.NODE_DENSE_FROM`), and the request's KV
    enters the cache only on top of cached KV it computes the same way: where the cache already holds KV of the
    request's tokens that the request computed otherwise (another prompt's dense tail where this one is sparse,
    or part of a sparse window another prompt completed with other tokens), only up to there
    (`cap_cache_key` cuts the key while this runs); the rest stays the request's own and is freed with it."""
    gate = ACTIVE_GATE
    prompt = compat.request_prefill_len(req)
    dense_from = dense_tail_start(gate, prompt)
    limit = None
    if dense_from is not None:
        try:
            spans = compat.cached_prefix_spans(cache, req)
        except Exception:  # an SGLang whose cache we do not understand: cache only the part below the gate
            log_once(logger, logging.ERROR, "sglang_compact: could not read the radix cache's match for a request; "
                     "caching only its part below the gate", exc_info=True)
            limit = sparse_start(gate, prompt)
        else:
            limit = insert_limit(gate, spans, prompt)
        split = compat.request_split_from(req)        # its KV from a window computed over two passes on: its own
        if split is not None and (limit is None or split < limit):
            limit = split
    _INSERT_LIMIT[0] = limit
    _INSERT_DENSE_FROM[0] = dense_from
    try:
        return original(cache, req, *args, **kwargs)
    finally:
        _INSERT_LIMIT[0] = _INSERT_DENSE_FROM[0] = None


def mark_inserted_node(result, cache, node, key, *args, **kwargs):
    """AFTER hook of the radix tree's insertion of a key (while `limit_cached_prefix` runs): the node it created
    for the key's uncached rest (the one it returns when it held less than the key) gets the inserting request's
    dense start."""
    dense_from = _INSERT_DENSE_FROM[0]
    created = compat.inserted_node(result, key) if dense_from is not None else None
    if created is not None:
        compat.set_node_dense_from(created, dense_from)
    return None


def mark_split_node(result, cache, key, child, *args, **kwargs):
    """AFTER hook of the radix tree's node split: the new node (the first part of the child's tokens) has the
    child's inserter, so its dense start."""
    dense_from = compat.node_dense_from(child)
    if dense_from is not None and result is not None:
        compat.set_node_dense_from(result, dense_from)
    return None


def cap_cache_key(result, *args, **kwargs):
    """AFTER hook of the radix key's page alignment: cut to the insert limit (a multiple of the window, so still
    page-aligned) while `limit_cached_prefix` runs."""
    limit = _INSERT_LIMIT[0]
    if limit is None or len(result) <= limit:
        return None
    return result[:limit]
