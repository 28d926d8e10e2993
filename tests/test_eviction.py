"""Radix-cache eviction, page reuse and client aborts on a real CPU server with a small KV pool.

The pool (`--max-total-tokens 1536`: 96 pages of 16 tokens, chunks of 128) holds about three of the ~0.5K-token
prompts. The run, the same on every server:

1. three distinct prompts P1-P3, one after the other: they fit in the pool, so each is served on pages never
   used before (what a fresh server does);
2. pressure: two 1.4K-token prompts whose client closes the connection mid-prefill (one plain request, one
   streamed) around another distinct prompt: the radix cache evicts P1-P3 (or part of them) and their pages
   are reused;
3. P1-P3 again, concurrently (one mixed batch), recomputed on reused pages where they were evicted.

Checks: `--compact-selector dense` gives, in both passes, the tokens of stock `--attention-backend
torch_native` (served once, fresh); the default selector (`--compact-min-context 256 --compact-dense-tail 64`)
gives in the third step the tokens it gave fresh in the first (both up to near ties: a first divergence where
both runs' top-2 logprob gap is under `NEAR_TIE`); eviction really happened; after the run the pool is back
to 0 used tokens (`/v1/loads?include=core`, which counts neither free nor evictable cached tokens); the
server log has no traceback and no error besides SGLang's line for each client disconnect.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import NEAR_TIE, ServerError, SGLangServer, assert_same_tokens, greedy_with_top2  # noqa: E402

PAGE, CHUNK, POOL, NEW = 16, 128, 1536, 8
CHECKED = (460, 480, 500)         # P1-P3: with their outputs, 93 of the pool's 96 pages
PRESSURE = (480,)
ABORTED = (1400, 1400)            # seconds of prefill each on these 2 cores: the client leaves after 1 s, and
#                                   SGLang notices a plain request's client is gone at its 4 s disconnect poll
ABORTED_NEW = 120                 # and then decode to fill the pool (1400 + 120 of 1536 tokens), so that a fast
#                                   machine's request is still running at that poll (a 1400-token prefill alone took
#                                   under 4 s on one CI machine: no disconnect, the abort untested)
DEFAULT_ARGS = ["--compact-min-context", "256", "--compact-dense-tail", "64"]
#: the log line SGLang writes for a client that went away (expected once per aborted request, at most)
DISCONNECT = "Request is disconnected from the client side"


def prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(200, 40000) for _ in range(n)] for n in lengths]


P = prompts(CHECKED, 11)
Q = prompts(PRESSURE, 12)
A = prompts(ABORTED, 13)



def greedy(srv, ids):
    return greedy_with_top2(srv, ids, NEW)


def abort_mid_prefill(srv, ids, stream: bool, after_s: float = 1.0) -> None:
    """Send a request and close the connection before it is done (its prefill takes seconds here)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": ABORTED_NEW, "ignore_eos": True},
            "stream": stream}
    conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
    time.sleep(after_s)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def used_tokens(srv) -> tuple[int, int]:
    """(KV tokens held by requests, running + waiting requests): neither free nor evictable cached tokens."""
    load = srv.get_json("/v1/loads?include=core")["loads"][0]
    return int(load["num_used_tokens"]), int(load["num_running_reqs"]) + int(load["num_waiting_reqs"])


def wait_for_idle_pool(srv, timeout=30.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        state = used_tokens(srv)
        if state == (0, 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)  # an aborted request is noticed within SGLang's 4 s disconnect poll


def runtime_log_problems(log: str, aborts: int) -> list[str]:
    """Tracebacks and errors after start-up (start-up prints import warnings), but SGLang's disconnect lines."""
    runtime = log[log.index("The server is fired up"):]
    lines = runtime.splitlines()
    bad = [ln for ln in lines if "Traceback" in ln or ("Error" in ln and DISCONNECT not in ln)]
    disconnects = sum(DISCONNECT in ln for ln in lines)
    if not 1 <= disconnects <= aborts:  # the plain request was aborted before it finished
        bad.append(f"{disconnects} disconnect errors for {aborts} aborted requests")
    return bad


def eviction_run(srv) -> dict:
    fresh = [greedy(srv, p) for p in P]
    assert used_tokens(srv)[0] == 0
    abort_mid_prefill(srv, A[0], stream=False)
    pressure = [greedy(srv, Q[0])]
    abort_mid_prefill(srv, A[1], stream=True)
    with ThreadPoolExecutor(len(P)) as pool:
        again = list(pool.map(lambda p: greedy(srv, p), P))
    return {"fresh": fresh, "pressure": pressure, "again": again, "idle": wait_for_idle_pool(srv),
            "log": srv.log_path.read_text(errors="replace")}


def check_run(run: dict, what: str) -> None:
    for out, _ in run["fresh"] + run["pressure"] + run["again"]:
        assert len(out) == NEW, what
    assert [m["cached_tokens"] for _, m in run["fresh"]] == [0, 0, 0], what
    recomputed = [len(p) - m["cached_tokens"] for p, (_, m) in zip(P, run["again"])]
    assert sum(recomputed) >= 2 * CHUNK, f"{what}: P1-P3 were not evicted ({recomputed} tokens recomputed)"
    assert run["idle"] == (0, 0), f"{what}: (used tokens, requests) after the run: {run['idle']}"
    problems = runtime_log_problems(run["log"], len(ABORTED))
    assert not problems, f"{what}: " + "\n".join(problems[:20])


def server(model_dir, module, args, pool=POOL):
    return SGLangServer(model_dir, module=module, page_size=PAGE, chunked_prefill_size=CHUNK, max_total_tokens=pool,
                        extra_args=args)


def test_eviction_page_reuse_and_aborts(model_dir):
    t0 = time.monotonic()
    with server(model_dir, "sglang.launch_server", ["--attention-backend", "torch_native"], pool=4 * POOL) as srv:
        stock = [greedy(srv, p) for p in P]
        # (the plugin's request checks hold for any backend: an id out of the vocabulary is a 400, not a crash)
        with pytest.raises(ServerError, match="HTTP 400.*outside the model's vocabulary"):
            srv.generate(input_ids=[5, 49152], max_new_tokens=1)
        assert greedy(srv, P[0])[0] == stock[0][0]
    with server(model_dir, "sglang_compact.launch_server",
                ["--attention-backend", "compact", "--compact-selector", "dense"]) as srv:
        dense = eviction_run(srv)
    with server(model_dir, "sglang_compact.launch_server", ["--attention-backend", "compact"] + DEFAULT_ARGS) as srv:
        default = eviction_run(srv)
    print(f"\neviction run: {time.monotonic() - t0:.0f}s; tokens recomputed after eviction (dense / default): "
          f"{[len(p) - m['cached_tokens'] for p, (_, m) in zip(P, dense['again'])]} / "
          f"{[len(p) - m['cached_tokens'] for p, (_, m) in zip(P, default['again'])]}; near tie < {NEAR_TIE}")
    check_run(dense, "dense")
    check_run(default, "default")
    assert_same_tokens(stock, dense["fresh"], "dense (fresh pages) vs torch_native")
    assert_same_tokens(stock, dense["again"], "dense (after eviction) vs torch_native")
    assert_same_tokens(default["fresh"], default["again"], "default selector: fresh vs after eviction")
