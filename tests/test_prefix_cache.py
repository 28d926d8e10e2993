"""`--compact-prefix-cache`: what the radix cache keeps of a conversation's turn, and what its next turn reuses.

Under `exact` (the default) the cache keeps only KV that a cold run of every longer prompt would compute
(`srt/alignment.py`): not a prompt's dense tail, its last window or its output, so the next turn of a conversation
recomputes them (answers never depend on what is cached: `test_reproducibility.py`). Under `reuse` it keeps
everything, as stock SGLang does, and a hit is only cut back to a window start.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from sglang_compact.config import CompactConfig
from sglang_compact.gate import Gate, GateDecision
from sglang_compact.srt.alignment import exact_prefix_len

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAGE, CHUNK = 16, 128       # the union window is the chunk: 128 tokens


def test_reuse_keeps_every_token_exact_keeps_the_exact_prefix():
    def gate(policy):
        return Gate(CompactConfig(block_size=64, prefix_cache=policy), GateDecision(4096, "flag", ""), 1024)
    assert exact_prefix_len(gate("exact"), 20000) == 18 * 1024       # windows 4..17 sparse, the dense tail not kept
    assert exact_prefix_len(gate("reuse"), 20000) is None            # all of it
    with pytest.raises(ValueError, match="prefix_cache"):
        CompactConfig(prefix_cache="all")


@pytest.mark.server
def test_the_next_turn_of_a_conversation_reuses_the_last_turn_under_reuse(model_dir):
    from serving import SGLangServer

    rng = random.Random(7)
    first = [rng.randrange(100, 40000) for _ in range(1500)]
    new_message = [rng.randrange(100, 40000) for _ in range(60)]
    greedy = {"temperature": 0, "ignore_eos": True}
    sparse = ["--attention-backend", "compact", "--compact-min-context", "256",
              "--compact-selector-params", '{"min_tokens": 320}']      # the default dense tail, 1024 tokens
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
    # exact: the first prompt's KV up to its dense tail, (1500 - 1024) // 128 windows
    assert cached["exact"] == (len(first) - 1024) // CHUNK * CHUNK == 384, cached
    # reuse: the first turn's prompt and answer (as stock caches them), back to a window start
    assert cached["reuse"] == (len(first) + 16) // CHUNK * CHUNK == 1408, cached
