"""scripts/bench_ttft.py without a GPU: its method names and its dry run (the plan and the KV arithmetic)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_ttft import COMPACT, STOCK, method_args  # noqa: E402


def test_method_names():
    assert method_args("flashinfer") == (STOCK, ["--attention-backend", "flashinfer"])
    assert method_args("fa3") == (STOCK, ["--attention-backend", "fa3"])
    module, flags = method_args("compact-budget-0.3-fa2-at0")
    assert module == COMPACT and flags[-2:] == ["--compact-density", "0.3"]
    assert "--compact-prefill-kernel" in flags and "--compact-min-context" in flags and "--enable-metrics" in flags
    assert method_args("compact-dense")[1][-2:] == ["--compact-selector", "dense"]
    with pytest.raises(ValueError):
        method_args("nope")


def test_dry_run_prints_the_plan_and_the_kv_per_rank():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--model", "llama-3.1-8b",
                        "--contexts", "130816", "--chunks", "1024", "--batches", "8", "--tp", "2",
                        "--methods", "flashinfer,compact-budget-0.3", "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    # 8 x (130816 + 1024) + 4096 tokens x 32 layers x 2 x 4 kv heads x 128 x 2 bytes
    assert "1058816 tokens" in first and "64.6 GiB of KV per rank at TP2" in first
    assert "--tp 2 --attention-backend compact" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--model", "llama-3.1-8b",
                        "--contexts", "131072", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "exceeds the model's 131072 positions" in r.stderr
