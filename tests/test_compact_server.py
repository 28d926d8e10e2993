"""The `compact` backend inside SGLang 0.5.17's real CPU server (torch executor).

Real scheduler, radix cache, chunked prefill and a paged head-major pool
(page 16, chunks of 128 tokens, so a 1-2K-token prompt spans 8-16 chunks),
on SmolLM2-135M-Instruct's real weights in float32:

1. selector `dense` through the whole compact pipeline (search, union, plan,
   paged execution) gives greedy tokens equal to SGLang's `torch_native`
   backend on 6 prompts;
2. selector `flashprefill` serves a long prompt (chunks of one page); the same
   prompt again is served from the radix cache (cached_tokens > 0) with the
   same tokens; with `--compact-dense-final-chunk off` every chunk from the
   threshold on, the final ones included, takes the compact path (`/metrics`);
3. bad `--compact-*` flags make `launch_server` exit 2 with a one-line reason.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SERVER_ENV, SGLangServer  # noqa: E402

MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
PAGE, CHUNK, NEW = 16, 128, 12
COMPACT = ["--attention-backend", "compact"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from convert_smollm2 import convert

    return convert(MODEL_DIR, "float32", quiet=True)


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    lengths = [700, 1100, 1500, 900, 1300, 1900][:n]
    return [[rng.randrange(200, 40000) for _ in range(L)] for L in lengths]


def greedy(server, ids):
    r = server.post("/generate", {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": len(ids) - 1,
    })
    return list(r["output_ids"]), r["meta_info"]


def top2_gap(meta, step):
    (lp1, _, _), (lp2, _, _) = meta["output_top_logprobs"][step][:2]
    return abs(lp1 - lp2)


def server(model_dir, backend_args, **kw):
    return SGLangServer(model_dir, module="sglang_compact.launch_server", page_size=PAGE, chunked_prefill_size=CHUNK,
                        extra_args=backend_args, **kw)


def test_dense_selector_matches_torch_native(model_dir):
    ps = prompts()
    with server(model_dir, ["--attention-backend", "torch_native"]) as ref_srv:
        want = [greedy(ref_srv, p) for p in ps]
    with server(model_dir, COMPACT + ["--compact-selector", "dense", "--compact-min-prefix-len", "0"]) as srv:
        got = [greedy(srv, p) for p in ps]
        log = srv.log_path.read_text()
    assert "selector='dense'" in log  # the launcher's config reached the scheduler
    for i, ((w, wm), (g, gm)) in enumerate(zip(want, got)):
        if w != g:
            k = next(j for j, (a, b) in enumerate(zip(w, g)) if a != b)
            pytest.fail(f"prompt {i}: token {k} differs ({w[k]} vs {g[k]}); top-2 logprob gap there: "
                        f"torch_native {top2_gap(wm, k):.2e}, compact {top2_gap(gm, k):.2e}")


def test_flashprefill_long_prompt_and_radix_cache(model_dir):
    # The sparse selection of a chunk depends on where the chunk starts. With
    # chunks of one page, every page-aligned radix-cache hit is also a chunk
    # boundary of the uncached run, so the cached repeat recomputes exactly the
    # uncached run's last chunks over the same prefix: its tokens must be equal.
    ids = prompts(n=6, seed=1)[-1][:1200 + 5]
    args = COMPACT + ["--compact-selector", "flashprefill", "--compact-min-prefix-len", "256",
                      "--compact-sink-blocks", "1", "--compact-recent-blocks", "2",
                      "--compact-dense-final-chunk", "off", "--enable-metrics"]
    with SGLangServer(model_dir, module="sglang_compact.launch_server", page_size=PAGE, chunked_prefill_size=PAGE,
                      extra_args=args) as srv:
        first, _ = greedy(srv, ids)
        again, meta = greedy(srv, ids)
        log = srv.log_path.read_text()
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
    assert len(first) == NEW
    assert int(meta["cached_tokens"]) == 1200
    assert again == first
    assert "selector='flashprefill'" in log and "dense_final_chunk=False" in log
    # first run: the chunks at prefixes 256, 272, ..., 1200 (60); the cached repeat: its one chunk at 1200
    assert metric_value(metrics, "sglang:compact_chunks_total") == 61
    assert metric_value(metrics, "sglang:compact_dense_final_chunks_total") == 0


def metric_value(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"{name} is not on /metrics"
    return sum(values)


@pytest.mark.parametrize("flags, reason", [
    (["--compact-selector", "nope"], "CompactConfig.selector: must be one of"),
    (["--compact-block-size", "32"], "--compact-block-size 32 differs from --page-size 16"),
    (["--compact-min-prefix-len", "-1"], "CompactConfig.min_prefix_len: must be an integer >= 0"),
    (["--compact-alpha", "-0.5"], "selector_params['alpha']: must be a number in [0.0, 1.0]"),
    (["--compact-prefill-kernel", "fa4"], "CompactConfig.prefill_kernel: must be one of auto, fa2, fa3"),
    (["--attention-backend", "torch_native", "--compact-alpha", "0.1"], "--compact-* flags need --attention-backend compact"),
])
def test_bad_flags_exit_with_one_line_reason(model_dir, flags, reason):
    cmd = [sys.executable, "-m", "sglang_compact.launch_server", "--model-path", str(model_dir), "--device", "cpu",
           "--page-size", str(PAGE)] + COMPACT + flags
    env = {**os.environ, **SERVER_ENV}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang_compact.launch_server: error: ") and reason in last, last


def test_help_lists_the_compact_flags_and_sglangs():
    cmd = [sys.executable, "-m", "sglang_compact.launch_server", "--help"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **SERVER_ENV},
                       cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for flag in ("--compact-selector", "--compact-density", "--compact-prefill-kernel", "--compact-min-prefix-len"):
        assert flag in r.stdout
    assert "--chunked-prefill-size" in r.stdout and r.stdout.index("--compact-selector") < r.stdout.index(
        "--chunked-prefill-size")

