"""Chunk ends in whole union windows under SGLang's mixed chunked prefill and a nearly full KV pool.

`srt/alignment.py` ends every chunk on a window boundary, so that a sparse window's queries share one pass.
With `--enable-mixed-chunk` SGLang takes the running decodes' tokens off each pass's chunk budget: a budget of
one window less a few tokens then admitted no prompt at all (the chunk of one window could not end on a
boundary), and a long prompt waited until every running request had finished decoding, where stock SGLang
prefills it beside them (the second test failed so: both decodes had ended when the prompt was answered). The
budget is now rounded back up to whole windows.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from sglang_compact.srt.alignment import continuing_chunk_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAGE, CHUNK = 16, 128       # the union window is the chunk: 128 tokens
PREFILL_LINE = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+),.*?#running-req: (\d+)")


def test_a_continuing_chunk_is_cut_back_to_a_window_end():
    w, sparse = 1024, (4, 30)           # windows 4-29 sparse: tokens [4096, 30720)
    # SGLang's room ends inside a sparse window: cut back to its start
    assert continuing_chunk_tokens(8192, 32000, 3000, w, sparse) == 2048
    assert continuing_chunk_tokens(8292, 32000, 3000, w, sparse) == 11264 - 8292       # back onto a boundary
    # room for less than the rest of the window: the split cannot be avoided (0: the caller logs it)
    assert continuing_chunk_tokens(8192, 32000, 500, w, sparse) == 0
    # nothing to do: a boundary, the prompt's end, a chunk ending below or past the sparse windows
    assert continuing_chunk_tokens(8192, 32000, 2048, w, sparse) is None
    assert continuing_chunk_tokens(30000, 30500, 700, w, sparse) is None
    assert continuing_chunk_tokens(1024, 32000, 2500, w, sparse) is None          # ends at 3524 < 4096
    assert continuing_chunk_tokens(29696, 32000, 1500, w, sparse) is None         # ends at 31196 >= 30720
    assert continuing_chunk_tokens(8192, 32000, 3000, w, (0, 0)) is None          # no sparse window


@pytest.mark.server
def test_a_prompt_is_prefilled_in_whole_windows_while_others_decode(model_dir):
    from serving import SGLangServer

    rng = random.Random(1)
    long_prompt = [rng.randrange(100, 40000) for _ in range(1500)]
    short = [rng.randrange(100, 40000) for _ in range(40)]
    args = ["--attention-backend", "compact", "--enable-mixed-chunk", "--compact-min-context", "256",
            "--compact-dense-tail", "64", "--compact-selector-params", '{"min_tokens": 320}']
    with SGLangServer(model_dir, module="sglang_compact.launch_server", page_size=PAGE, chunked_prefill_size=CHUNK,
                      extra_args=args) as srv:
        def decode():
            srv.post("/generate", {"input_ids": short, "sampling_params": {"temperature": 0, "max_new_tokens": 300,
                                                                           "ignore_eos": True}})
        decoding = [threading.Thread(target=decode) for _ in range(2)]
        for t in decoding:
            t.start()
        deadline = time.monotonic() + 120
        while not re.search(r"Decode batch", Path(srv.log_path).read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        lines_before = len(PREFILL_LINE.findall(Path(srv.log_path).read_text()))
        out = srv.post("/generate", {"input_ids": long_prompt, "sampling_params": {"temperature": 0,
                                                                                    "max_new_tokens": 2}})
        still_decoding = sum(t.is_alive() for t in decoding)
        for t in decoding:
            t.join()
        log = Path(srv.log_path).read_text()
    assert len(out["output_ids"]) == 2
    # answered while the others decode (300 tokens each), not after them
    assert still_decoding == 2, "the long prompt waited for the running requests to finish decoding"
    passes = [(int(n), int(r)) for s, n, r in PREFILL_LINE.findall(log)[lines_before:]]
    tokens = [n for n, _ in passes]
    assert sum(tokens) >= len(long_prompt) - PAGE and len(passes) >= len(long_prompt) // CHUNK, passes
    # whole windows, the last chunk excepted, and mixed with the running decodes
    assert all(n == CHUNK for n in tokens[:-1]), tokens
    assert any(r > 0 for _, r in passes), passes
