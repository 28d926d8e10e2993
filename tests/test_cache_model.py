"""The exact prefix cache, model-checked: SGLang's radix cache, requests and pools with our hooks applied, driven
through random schedules (`tests/cache_model.py`), every KV slot labelled with how it was computed."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "SGLANG_COMPACT_CPU_SHIM": "1", "SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1"}
SEEDS = range(1, 81)


def run_python(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "Failed to apply hooks" not in r.stderr, r.stderr[-5000:]
    return r.stdout


def test_random_schedules_serve_each_request_what_its_cold_run_computes():
    """80 schedules (page 16 or 32, windows of 2 or 4 pages, the gate from 0 to 197 tokens or never, dense tails
    of 0 to 2 windows, chunks of 1 to 4 windows, a continuing chunk cut to a short KV pool's room three times in
    ten; one in five under `reuse`): no violation of the model's checks (`tests/cache_model.py`), and the
    schedules did what they are for."""
    r = subprocess.run([sys.executable, "tests/cache_model.py", *map(str, SEEDS)], cwd=REPO_ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["seed"] for row in rows] == list(SEEDS)
    bad = [(row["seed"], row["violations"]) for row in rows if row["violation_count"]]
    assert not bad, bad
    total = {k: sum(row[k] for row in rows) for k in ("admitted", "served", "chunks", "split", "retracted",
                                                     "evicted")}
    assert total["served"] > 100_000 and total["chunks"] > total["admitted"] and total["split"] > 50, total
    assert total["retracted"] > 100 and total["evicted"] > 10_000, total
    assert {row["prefix_cache"] for row in rows} == {"exact", "reuse"}
    assert any(row["min_context"] == 0 for row in rows) and any(row["min_context"] > 1 << 40 for row in rows)


BREAK_AND_RUN = """
    import sys
    sys.path.insert(0, "tests")
    import cache_model
    from sglang_compact.srt import alignment, compat
    {patch}
    print(sum(1 for seed in range(1, 21) if cache_model.Model(seed).run(60)["violation_count"]))
"""


@pytest.mark.parametrize("patch", [
    # the KV a request computed enters the cache on top of whatever the cache holds of its tokens
    "alignment.insert_limit = lambda gate, spans, prompt_len: None",
    # a hit ending inside a window is served as it ends
    "alignment.window_start_before_tail = lambda gate, pos, prompt_len: pos",
    # every cached token serves, however it was computed
    "alignment.first_inexact = lambda gate, spans, prompt_len: spans[-1][1] if spans else 0",
    # a retracted request's cache inserts marked with its prompt's dense tail, not its prefill's
    "compat.note_admission = lambda req: None",
    # a window a request computed over two passes (the KV pool's room was short) enters the cache
    "compat.request_split_from = lambda req: None",
], ids=["no insert limit", "hit not cut to a window", "every hit served", "retraction's prefill not noted",
        "split window cached"])
def test_the_model_catches_a_broken_rule(patch):
    """Each rule the hooks keep, broken on purpose: the model check finds violations in some of 20 schedules."""
    broken = int(run_python(BREAK_AND_RUN.format(patch=patch)).strip().splitlines()[-1])
    assert broken > 0, patch


UNREADABLE_PATH = """
    import sys
    sys.path.insert(0, "tests")
    import cache_model
    from sglang_compact.srt import compat
    compat.node_path_spans = lambda node: 1 / 0
    rows = [cache_model.Model(seed).run(60) for seed in range(1, 21)]
    print(sum(r["violation_count"] for r in rows), sum(r["served"] for r in rows))
"""


def test_a_tree_path_the_hook_cannot_read_keeps_hits_below_the_gate_and_stays_exact():
    """With the radix tree's path unreadable (`compat.node_path_spans` raising, as it would on a tree SGLang built
    otherwise), the scheduler keeps running: hits are kept only below the gate, and every request still reads
    what its cold run computes."""
    out = run_python(UNREADABLE_PATH)
    violations, served = map(int, out.strip().splitlines()[-1].split())
    assert violations == 0 and served > 0, out[-2000:]
