"""Test-side name for the server harness, `harness.server` (the evaluation and the benchmarks start the same
servers): `SGLangServer`, `SERVER_ENV`, `free_port`, `cpu_shim_hook_installed`, `GenerateResult`, `ServerError`.

The tests' `SGLangServer` writes its log under `.out/server-logs/` of this checkout unless given `log_path`, and
runs the server from the repository root (the harness itself has no default paths).

The greedy-comparison helpers the server tests share: `greedy_with_top2`, `top2_gap`, `first_divergence`,
`NEAR_TIE`, `assert_same_tokens`."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from harness.server import (  # noqa: F401
    BASE_ARGS,
    SERVER_ENV,
    GenerateResult,
    ServerError,
    cpu_shim_hook_installed,
    free_port,
)
from harness.server import SGLangServer as _SGLangServer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LOG_DIR = REPO_ROOT / ".out" / "server-logs"


class SGLangServer(_SGLangServer):
    """`harness.server.SGLangServer` with the tests' defaults: a fresh log file in `DEFAULT_LOG_DIR`, cwd the
    repository root."""

    def __init__(self, model_path, *, log_path=None, cwd=REPO_ROOT, **kwargs):
        super().__init__(model_path, log_path=log_path, cwd=cwd, **kwargs)
        if log_path is None:
            DEFAULT_LOG_DIR.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log", dir=DEFAULT_LOG_DIR)
            os.close(fd)
            self.log_path = Path(path)


#: top-2 logprob gap under which a greedy flip is rounding, not a difference
NEAR_TIE = 0.02


def greedy_with_top2(srv, ids, new_tokens: int):
    """(output ids, meta_info) of a greedy request that returns the top-2 logprobs of every output token."""
    r = srv.post("/generate", {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": len(ids) - 1,
    })
    return list(r["output_ids"]), r["meta_info"]


def top2_gap(meta, step: int) -> float:
    (lp1, _, _), (lp2, _, _) = meta["output_top_logprobs"][step][:2]
    return abs(lp1 - lp2)


def first_divergence(want, got):
    """None when two `greedy_with_top2` results agree; else (step, want token, got token, want gap, got gap)."""
    (w, wm), (g, gm) = want, got
    if w == g:
        return None
    k = next(j for j, (a, b) in enumerate(zip(w, g)) if a != b)
    return k, w[k], g[k], top2_gap(wm, k), top2_gap(gm, k)


def assert_same_tokens(want, got, what):
    """Equal greedy tokens, or a first divergence at a near tie in both runs."""
    for i, (a, b) in enumerate(zip(want, got)):
        d = first_divergence(a, b)
        if d is not None:
            k, wk, gk, gw, gg = d
            assert max(gw, gg) < NEAR_TIE, (f"{what}, prompt {i}: token {k} differs ({wk} vs {gk}); top-2 "
                                            f"logprob gaps there {gw:.2e} / {gg:.2e}")


def metric_value(text: str, name: str, label: str = "") -> float:
    """The sum of a Prometheus metric's samples on a /metrics page whose labels contain `label`."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line]
    assert values, f"{name} {label} is not on /metrics"
    return sum(values)
