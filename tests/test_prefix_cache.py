"""`--compact-prefix-cache`: what the radix cache keeps of a conversation's turn, and what its next turn reuses.

Under `exact` (the default) a hit serves only KV that the request would compute the same way cold
(`srt/alignment.py`): a prompt's dense tail and output (computed reading every page) serve a prompt that reads
every page there too (a repeat, a short follow-up), but not a longer turn, which computes those windows sparse
and so recomputes them (answers never depend on what is cached: `test_reproducibility.py`). Under `reuse` every
cached token serves, as in stock SGLang, and a hit is only cut back to a window start where it ends before the
request's dense tail.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from sglang_compact.config import CompactConfig
from sglang_compact.gate import Gate, GateDecision
from sglang_compact.srt.alignment import dense_tail_start

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import metric_value  # noqa: E402

PAGE, CHUNK = 16, 128       # the union window is the chunk: 128 tokens


def test_reuse_serves_every_token_exact_marks_the_dense_tail():
    def gate(policy):
        return Gate(CompactConfig(block_size=64, prefix_cache=policy), GateDecision(4096, "flag", ""), 1024)
    assert dense_tail_start(gate("exact"), 20000) == 19 * 1024       # windows 4..18 sparse, then the dense tail (256)
    assert dense_tail_start(gate("reuse"), 20000) is None            # every cached token serves
    with pytest.raises(ValueError, match="prefix_cache"):
        CompactConfig(prefix_cache="all")


@pytest.mark.server
def test_the_next_turn_of_a_conversation_reuses_the_last_turn_under_reuse(model_dir):
    from serving import SGLangServer

    rng = random.Random(7)
    first = [rng.randrange(100, 40000) for _ in range(1500)]
    new_message = [rng.randrange(100, 40000) for _ in range(60)]
    greedy = {"temperature": 0, "ignore_eos": True}
    sparse = ["--attention-backend", "compact", "--compact-min-context", "256", "--compact-dense-tail", "1024",
              "--compact-selector-params", '{"min_tokens": 320}']      # a tail of 8 windows: the numbers below
    cached = {}
    for policy in ("exact", "reuse"):
        with SGLangServer(model_dir, module="sglang_compact.launch_server", page_size=PAGE,
                          chunked_prefill_size=CHUNK, extra_args=sparse + ["--compact-prefix-cache", policy]) as srv:
            answer = srv.post("/generate", {"input_ids": first,
                                            "sampling_params": dict(greedy, max_new_tokens=16)})["output_ids"]
            turn = first + list(answer) + new_message
            r = srv.post("/generate", {"input_ids": turn, "sampling_params": dict(greedy, max_new_tokens=4)})
            assert len(r["output_ids"]) == 4
            cached[policy] = r["meta_info"]["cached_tokens"]
    # exact: the first prompt's KV up to its dense tail, (1500 - 1024) // 128 windows (this turn's own dense tail
    # starts a window later: it computes that window sparse)
    assert cached["exact"] == (len(first) - 1024) // CHUNK * CHUNK == 384, cached
    # reuse: the first turn's prompt and answer as stock caches them ((1500 + 16 - 1) // 16 pages: the last answer
    # token's KV is never computed), not cut back to a window start: this turn's dense tail (from 512) holds the end
    assert cached["reuse"] == (len(first) + 16 - 1) // PAGE * PAGE == 1504, cached


@pytest.mark.server
def test_exact_serves_the_dense_tail_to_prompts_that_read_every_page_there(model_dir):
    """Under `exact` a prompt's dense tail and output are cached too, marked as computed reading every page: they
    serve a prompt whose own dense tail covers them (a repeat, parallel samples, a follow-up short enough that
    its dense tail starts at the same window), with the answer a cold run gives; a longer prompt stops where it
    would compute sparse (`alignment.first_inexact`)."""
    from serving import SGLangServer

    rng = random.Random(11)
    first = [rng.randrange(100, 40000) for _ in range(1500)]       # dense tail from (1500 - 1024) // 128 = 3 windows
    greedy = {"temperature": 0, "ignore_eos": True}
    sparse = ["--attention-backend", "compact", "--compact-min-context", "256", "--enable-metrics",
              "--compact-dense-tail", "1024", "--compact-selector-params", '{"min_tokens": 320}']
    with SGLangServer(model_dir, module="sglang_compact.launch_server", page_size=PAGE,
                      chunked_prefill_size=CHUNK, extra_args=sparse) as srv:
        def run(ids, n=4):
            r = srv.post("/generate", {"input_ids": ids, "sampling_params": dict(greedy, max_new_tokens=n)})
            return list(r["output_ids"]), r["meta_info"]["cached_tokens"]

        answer, hit = run(first, 16)
        assert hit == 0
        follow_up = first + answer + [rng.randrange(100, 40000) for _ in range(10)]   # 1526: tail from window 3
        longer = first + answer + [rng.randrange(100, 40000) for _ in range(60)]      # 1576: tail from window 4
        warm = {name: run(ids) for name, ids in (("repeat", first), ("follow_up", follow_up), ("longer", longer))}
        # parallel samples: SGLang caches the prompt with a request of no output, then sends n copies of it
        samples = srv.post("/generate", {"input_ids": first, "sampling_params": dict(greedy, max_new_tokens=4, n=2)})
        cold = {}
        for name, ids in (("repeat", first), ("follow_up", follow_up), ("longer", longer)):
            srv.flush_cache()
            cold[name] = run(ids)
        sparse_blocks = metric_value(srv.get_text("/metrics"), "sglang:compact_qblocks_total", 'path="sparse"')
    assert sparse_blocks > 0
    # the repeat: its whole prompt but the last token, page-aligned (SGLang computes at least one token)
    assert warm["repeat"][1] == (len(first) - 1) // PAGE * PAGE == 1488, warm
    # the follow-up: the first turn's prompt and answer as cached ((1500 + 16 - 1) // 16 pages: the last answer
    # token's KV is never computed)
    assert warm["follow_up"][1] == (len(first) + 16 - 1) // PAGE * PAGE == 1504, warm
    # the longer turn: up to the first turn's dense tail, as before
    assert warm["longer"][1] == 384, warm
    assert [s["meta_info"]["cached_tokens"] for s in samples] == [1488, 1488], samples
    assert all(list(s["output_ids"]) == cold["repeat"][0] for s in samples), (samples, cold["repeat"])
    assert all(cold[name][1] == 0 for name in cold), cold
    for name in cold:
        assert warm[name][0] == cold[name][0], (name, warm[name][0], cold[name][0])
