"""scripts/trace_summary.py: GPU busy/idle and per-forward-pass figures of a Chrome trace."""

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import trace_summary as ts  # noqa: E402


def ev(name, cat, ts_, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts_, "dur": dur, "pid": 1, "tid": tid}


def synthetic_trace(tmp_path, layers=4, passes=2):
    """Each layer: one paged attention kernel (10 us) and a GEMM (5 us), launched 20 us apart."""
    events, t = [], 0.0
    for _ in range(passes * layers):
        events.append(ev("BatchPrefillWithPagedKVCacheKernel", "kernel", t, 10, tid=7))
        events.append(ev("nvjet_gemm", "kernel", t + 10, 5, tid=7))
        events.append(ev("cudaLaunchKernel", "cuda_runtime", t, 2))
        events.append(ev("aten::linear", "cpu_op", t, 3))
        events.append(ev("aten::mm", "cpu_op", t + 1, 1))  # nested in aten::linear
        t += 20
    events.append({"ph": "i", "name": "marker", "ts": 0})  # not a complete event: ignored
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_busy_idle_and_counts(tmp_path):
    events = ts.load_trace(synthetic_trace(tmp_path))
    assert ts.count_forward_passes(events, layers=4) == 2
    # no paged kernel (FA3's): SGLang's attention op, once per layer, counts the passes instead
    fa3 = [e for e in events if "Paged" not in e["name"]]
    assert ts.count_forward_passes(fa3, layers=4) == 0
    fa3 += [ev(ts.ATTENTION_OP, "cpu_op", 40 * i, 4) for i in range(8)]
    assert ts.count_forward_passes(fa3, layers=4) == 2
    s = ts.summarize(events, steps=2)
    # kernels cover 15 of every 20 us; span = 7 * 20 + 15 = 155 us
    assert s["span_ms_per_step"] == pytest.approx(0.155 / 2)
    assert s["gpu_busy_ms_per_step"] == pytest.approx(8 * 15 / 1000 / 2)
    assert s["gpu_idle_frac"] == pytest.approx(1 - 120 / 155)
    assert s["kernels_per_step"] == 8
    assert [r["name"] for r in s["top_cpu_ops"]] == ["aten::linear"]  # the nested op is not counted again
    again = ts.restep(ts.summarize(events, steps=1), 2)
    assert again["kernels_per_step"] == 8 and again["gpu_busy_ms_per_step"] == pytest.approx(s["gpu_busy_ms_per_step"])
    assert "GPU idle 22.6%" in ts.render(s, "x")


def test_union_length_merges_overlaps():
    assert ts.union_length([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


def test_real_cpu_profiler_trace(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a = torch.randn(64, 64)
        for _ in range(3):
            a = torch.relu(a @ a)
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    s = ts.summarize(ts.load_trace(path), steps=3)
    assert s["gpu_idle_frac"] is None and s["kernels_per_step"] == 0
    names = {r["name"] for r in s["top_cpu_ops"]}
    assert {"aten::matmul", "aten::relu"} <= names
    assert ts.main([str(path), "--steps", "3", "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 3


def test_errors(tmp_path):
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    assert ts.main([str(tmp_path / "empty.json")]) == 2
    with pytest.raises(ValueError, match="steps"):
        ts.summarize([ev("k", "kernel", 0, 1)], steps=0)


def test_place_names_the_ops_around_a_call(tmp_path, capsys):
    """A real CPU trace: the one `aten::to` that converts inside the loop's body is placed between the ops that
    surround it, with its enclosing ops, and counted per step; a name the trace lacks gives no rows."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a = torch.randn(32, 32)
        for _ in range(4):
            b = torch.relu(a @ a)
            c = b.to(torch.float64)
            a = torch.sigmoid(c).to(torch.float32)
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    rows = ts.place(ts.load_trace(path), "aten::_to_copy", steps=4)
    by = {(r["after_op"], r["before_op"]): r for r in rows}
    first = by[("aten::relu", "aten::sigmoid")]
    assert first["inside"] == "aten::to" and first["calls_per_step"] == pytest.approx(1)
    assert sum(r["calls_per_step"] for r in rows) == pytest.approx(2)
    assert ts.place(ts.load_trace(path), "no_such_op") == []
    assert ts.main([str(path), "--steps", "4", "--place", "aten::_to_copy"]) == 0
    assert "| `aten::to` | `aten::relu` | `aten::sigmoid` | 1.0 |" in capsys.readouterr().out
