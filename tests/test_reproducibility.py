"""Token-level reproducibility across cache states, on a real CPU server (page 16, chunks of 128).

20 prompts of 600-700 tokens share leading slices of one random document (0 to 600 tokens, page-aligned or
not) and continue with their own random ids. Each is answered greedily (`return_logprob`, top-2 logprobs) in
three cache states:

* cold: the cache flushed before each prompt;
* partial hit: the cache flushed once, then the prompts in order of their shared slice, so each one finds
  the previous one's slice cached (a hit of a different length each time, cut at a page boundary of the
  prompt's own length or not);
* mixed batch: the cache flushed once, then all prompts sent concurrently (4 at a time, shuffled): their
  chunks are batched with other requests' chunks and decode steps.

For the default selector (`--compact-min-context 256 --compact-dense-tail 64`, its page floor at 320 tokens) and
for `--compact-selector dense`, count the (prompt, state) runs whose tokens differ from the cold run and, among
those, the near-tie flips: the first divergence is where both runs' top-2 logprob gap is under `NEAR_TIE`. Every
difference must be a near-tie flip, and the default selector (whose selection depends only on absolute
positions) must flip no more often than the dense one on the same prompts.
"""

from __future__ import annotations

import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import NEAR_TIE, SGLangServer, first_divergence, greedy_with_top2, metric_value  # noqa: E402

PAGE, CHUNK, NEW = 16, 128, 4
#: shared document slice of each prompt: page-aligned (multiples of 16) or not
SHARED = (0, 16, 37, 64, 100, 128, 150, 192, 250, 256, 300, 333, 384, 400, 448, 470, 512, 530, 576, 600)
MIN_CONTEXT, DENSE_TAIL = 256, 64
#: the default selector with its page floor scaled to these prompts (its 4096 tokens would read all of a
#: 700-token prompt): 320 tokens, 20 pages, above the forced pages, so the floor and the share both decide rows
FLOOR_TOKENS = 320
SELECTORS = {"default": ["--compact-min-context", str(MIN_CONTEXT), "--compact-dense-tail", str(DENSE_TAIL),
                         "--compact-selector-params", f'{{"min_tokens": {FLOOR_TOKENS}}}', "--enable-metrics"],
             "dense": ["--compact-selector", "dense"]}


def make_prompts(seed=7):
    rng = random.Random(seed)
    doc = [rng.randrange(200, 40000) for _ in range(max(SHARED))]
    out = []
    for s in SHARED:
        n = rng.randint(max(600, s + 64), 700)
        out.append(doc[:s] + [rng.randrange(200, 40000) for _ in range(n - s)])
    return out


PROMPTS = make_prompts()



LO = -(-MIN_CONTEXT // CHUNK)   # the first sparse window (windows of CHUNK tokens)


def tail_start(prompt_len: int) -> int:
    """Where a prompt's dense tail starts for the default selector's server (sglang_compact/srt/alignment.py): it
    computes its windows sparse from MIN_CONTEXT to there, and reads every page from there on."""
    return max(LO, (prompt_len - DENSE_TAIL) // CHUNK) * CHUNK


def shared_pages(a, b, limit: int) -> int:
    n = next((i for i, (x, y) in enumerate(zip(a[:limit], b[:limit])) if x != y), min(limit, len(a), len(b)))
    return n // PAGE * PAGE


def first_inexact(matched: int, cached_tail: int, tail: int) -> int:
    """The first of `matched` cached tokens (computed by a prompt whose dense tail starts at `cached_tail`) that a
    prompt whose dense tail starts at `tail` computes otherwise: cached sparse where it reads every page, or the
    other way round (below the gate both read every page)."""
    below = LO * CHUNK
    wrong = [max(below, tail)] if max(below, tail) < min(matched, cached_tail) else []
    a = max(cached_tail, below)
    wrong += [a] if a < min(matched, tail) else []
    return min(wrong, default=matched)


def expected_hits(prompts) -> list[int]:
    """The default selector's cache hits when `prompts` are sent one after another to an empty cache, modelling
    its radix cache as the prompts it was given, each with where its dense tail starts: a hit is cut to what the
    prompt computes the same way cold (`first_inexact`), back to a window start where that falls before its own
    dense tail; a prompt enters the cache whole, unless the cache already held tokens of it that it computed
    otherwise, or part of one of its sparse windows: then only up to there."""
    cached, hits = [], []   # (tokens, dense tail start) of each prompt cached
    for p in prompts:
        tail = tail_start(len(p))
        has_sparse = tail > LO * CHUNK
        best = max(cached, key=lambda c: shared_pages(p, c[0], len(p) - 1), default=None)
        keep = 0 if best is None else first_inexact(shared_pages(p, best[0], len(p) - 1), best[1], tail)
        hits.append(keep // CHUNK * CHUNK if has_sparse and keep < tail else keep)
        held = 0 if best is None else shared_pages(p, best[0], len(p))
        limit = 0 if best is None else first_inexact(held, best[1], tail)
        if LO * CHUNK < limit < tail and limit % CHUNK:
            limit = limit // CHUNK * CHUNK
        cached.append((p if limit >= held else p[:limit], tail))
    return hits


def greedy(srv, ids):
    return greedy_with_top2(srv, ids, NEW)


def cache_states(srv) -> dict[str, list]:
    cold = []
    for p in PROMPTS:
        srv.flush_cache()
        cold.append(greedy(srv, p))
    srv.flush_cache()
    partial = [greedy(srv, p) for p in PROMPTS]          # in order of SHARED: each finds its predecessor's slice
    srv.flush_cache()
    order = list(range(len(PROMPTS)))
    random.Random(3).shuffle(order)
    with ThreadPoolExecutor(4) as pool:
        outs = dict(zip(order, pool.map(lambda i: greedy(srv, PROMPTS[i]), order)))
    mixed = [outs[i] for i in range(len(PROMPTS))]
    return {"cold": cold, "partial": partial, "mixed": mixed}


def compare(cold, other) -> tuple[list[int], list[int], list[str]]:
    """(prompts that differ, near-tie flips among them, descriptions of the differences)."""
    differ, flips, notes = [], [], []
    for i, (a, b) in enumerate(zip(cold, other)):
        d = first_divergence(a, b)
        if d is None:
            continue
        k, wk, gk, gw, gg = d
        differ.append(i)
        if max(gw, gg) < NEAR_TIE:
            flips.append(i)
        notes.append(f"prompt {i}: token {k} ({wk} vs {gk}), top-2 gaps {gw:.2e} / {gg:.2e}")
    return differ, flips, notes


def test_tokens_do_not_depend_on_the_cache_state(model_dir):
    t0 = time.monotonic()
    results = {}
    for name, args in SELECTORS.items():
        with SGLangServer(model_dir, module="sglang_compact.launch_server", page_size=PAGE,
                          chunked_prefill_size=CHUNK, extra_args=["--attention-backend", "compact"] + args) as srv:
            results[name] = cache_states(srv)
            if name == "default":   # the sparse path ran, so the check is not of dense reads
                sparse = metric_value(srv.get_text("/metrics"), "sglang:compact_qblocks_total", 'path="sparse"')
                assert sparse > 0, sparse
    report, counts = [], {}
    for name, states in results.items():
        assert all(len(out) == NEW for state in states.values() for out, _ in state)
        assert all(m["cached_tokens"] == 0 for _, m in states["cold"])
        hits = [m["cached_tokens"] for _, m in states["partial"]]
        # each prompt finds the page-aligned part of its predecessor's shared slice; the default selector's
        # server caches and reuses only KV computed as a cold prefill computes it (`expected_hits`); the dense
        # selector reads every page, so its hits are never cut
        most = [0] + [s // PAGE * PAGE for s in SHARED[:-1]]
        if name == "dense":
            assert hits == most, hits
        else:
            assert hits == expected_hits(PROMPTS), (hits, expected_hits(PROMPTS))
        assert len(set(hits)) >= 3 and sum(h > 0 for h in hits) >= 14, (name, hits)
        states["hits"] = hits
        differ, flips = 0, 0
        for state in ("partial", "mixed"):  # (the mixed batch also finds slices cached by the requests before)
            d, f, notes = compare(states["cold"], states[state])
            differ, flips = differ + len(d), flips + len(f)
            report += [f"{name} {state}: {note}" for note in notes]
        counts[name] = (differ, flips)
    runs = 2 * len(PROMPTS)
    print(f"\nreproducibility ({time.monotonic() - t0:.0f}s, {len(PROMPTS)} prompts x 2 cache states vs cold): "
          + "; ".join(f"{n}: {d} of {runs} runs differ, {f} near-tie flips" for n, (d, f) in counts.items()))
    print("  partial hits: " + "; ".join(f"{n} {results[n]['hits']}" for n in results))
    for line in report:
        print("  " + line)
    for name, (differ, flips) in counts.items():
        assert differ == flips, f"{name}: differences that are not near-tie flips:\n" + "\n".join(report)
    assert counts["default"][1] <= counts["dense"][1], counts
