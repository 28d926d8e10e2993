"""scripts/bench_attention.py runs end to end (`--smoke`, CPU torch paths) and writes well-formed results.

On a machine without CUDA the FlashInfer-only methods must be recorded as skipped with a note, every
other method must run and (with --check) match `reference_attention`; rows are appended to an existing
speed.json, and the Markdown table is written.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_attention.py"

REQUIRED = {"bench": str, "gpu": str, "date": str, "context": int, "chunk": int, "batch": int, "q_heads": int,
            "kv_heads": int, "method": str}
NULLABLE = {"density": float, "ms": float, "speedup_vs_dense": float, "overhead_frac": float}


def run_bench(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    if "torch" in sys.modules and __import__("torch").cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ""  # this test covers the CPU paths
    return subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--check", "--out-dir", str(out_dir), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    foreign = {"bench": "e2e", "note": "a row of another benchmark, must be kept"}
    (out / "speed.json").write_text(json.dumps([foreign]))
    # two budgets instead of six keep the test short; every method kind still runs
    proc = run_bench(out, "--budgets", "0.3,1.0", "--batches", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc, foreign


def test_rows_have_the_schema(smoke):
    out, _, foreign = smoke
    rows = json.loads((out / "speed.json").read_text())
    assert rows[0] == foreign
    rows = [r for r in rows if r.get("bench") == "attention"]
    methods = {r["method"] for r in rows}
    assert {"dense_torch", "dense_fa2", "dense_fa3", "compact_flashprefill", "compact_xattention",
            "compact_budget_0.3", "compact_budget_1.0", "compact_fa3_flashprefill", "bsparse_flashprefill",
            "bsparse_xattention", "quoka", "compact_flashprefill_fixed"} <= methods
    assert {r["context"] for r in rows} == {500, 1024}
    for r in rows:
        for k, t in REQUIRED.items():
            assert isinstance(r[k], t), (k, r)
        for k, t in NULLABLE.items():
            assert k in r and (r[k] is None or isinstance(r[k], (t, int))), (k, r)
        assert r["cmd"].startswith("python3 ") and "--smoke" in r["cmd"]
        assert r["status"] in ("ok", "skipped"), r
        if r["status"] == "skipped":
            assert r["ms"] is None and r["note"], r
            continue
        assert r["ms"] > 0 and r["speedup_vs_dense"] > 0, r
        assert r["rel_err"] <= 1e-4, r  # float32 on the CPU: the torch paths match the reference
        assert 0 < r["density"] <= 1.0, r
        assert r["attn_ms"] > 0, r
        if r["method"] != "dense_torch":
            assert r["overhead_frac"] >= 0 and r["search_ms"] > 0, r
        if r["method"].startswith("compact_"):  # one paged pass: no prefix / chunk / merge split any more
            assert r["index_ms"] > 0, r
            assert "prefix_ms" not in r and "merge_ms" not in r, r
        if r["method"].startswith(("bsparse_", "quoka")):
            assert r["gather_ms"] > 0 and r["prefix_ms"] > 0 and r["chunk_ms"] > 0 and r["merge_ms"] > 0, r
            assert r["attn_ms"] == pytest.approx(r["prefix_ms"] + r["chunk_ms"]), r
    skipped = {r["method"] for r in rows if r["status"] == "skipped"}
    assert skipped == {"dense_fa2", "dense_fa3", "compact_fa3_flashprefill", "compact_fa3_budget_0.3",
                       "compact_fa3_budget_1.0", "compact_fa3_flashprefill_fixed"}
    by = {(r["context"], r["method"]): r for r in rows}
    for ctx in (500, 1024):
        assert by[(ctx, "dense_torch")]["speedup_vs_dense"] == pytest.approx(1.0)
        fp = by[(ctx, "compact_flashprefill")]
        # per (head, q-block) before the unions <= per row (kv head, window) after them
        assert 0 < fp["density_selected"] <= fp["density_after_group"] <= 1 and "density_after_q" not in fp
        assert fp["union_window"] == 96  # the server's default for chunks of 100 tokens: min(1024, 100) in pages
        assert fp["density"] == fp["density_after_group"]  # threshold selector: measured density
        assert by[(ctx, "compact_budget_0.3")]["density"] == 0.3  # budget: the fixed density
        assert by[(ctx, "compact_budget_0.3")]["density_selected"] is None  # no per-head choice
        assert by[(ctx, "compact_budget_1.0")]["density_after_group"] == pytest.approx(1.0)
        assert all(by[(ctx, "compact_xattention")].get(k) is not None for k in ("union_ms", "index_ms"))
        # bsparse executes each q-block's choice (per kv head, without the window union): fewer pages than compact
        for sel in ("flashprefill", "xattention"):
            bs, c = by[(ctx, f"bsparse_{sel}")], by[(ctx, f"compact_{sel}")]
            assert bs["density_selected"] == pytest.approx(c["density_selected"])
            assert 0 < bs["density_selected"] <= bs["density_executed"] < c["density_after_group"], sel
            assert bs["density"] == bs["density_executed"] and bs["gather_ms"] > 0
        assert by[(ctx, "quoka")]["density"] == 0.25


def test_markdown_and_meta_are_written(smoke):
    out, proc, _ = smoke
    md = (out / "speed_attention.md").read_text()
    assert "| context | chunk | batch | heads | method |" in md
    for m in ("compact_flashprefill", "bsparse_xattention", "quoka", "dense_fa2"):
        assert f"| {m} |" in md
    meta = json.loads((out / "speed_attention_meta.json").read_text())
    (run,) = meta.values()
    assert run["cmd"] in md and run["gpu"].startswith("cpu")
    assert "speedup" in proc.stdout and "compact_flashprefill" in proc.stdout  # the closing table
    # the PNG needs matplotlib; without it the script says so instead of failing
    assert (out / "speed_attention.png").exists() or "matplotlib unavailable" in proc.stdout


def test_render_only_rebuilds_the_table(smoke):
    out, _, _ = smoke
    meta = json.loads((out / "speed_attention_meta.json").read_text())
    (run,) = meta.values()
    (out / "speed_attention.md").unlink()
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--render-only", "--run-tag", run["run_tag"], "--out-dir",
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| compact_flashprefill |" in (out / "speed_attention.md").read_text()


def test_each_row_records_the_query_stride_its_search_ran():
    """`--query-stride` unset runs each selector at its own stride (`quest_budget`: 16 queries of each page, 4 at
    page 64; `budget`: every query) and the row says which; given, it applies to every strided search."""
    import argparse

    from harness.bench_attention.methods import known_methods, query_stride_run

    def strides(qs):
        args = argparse.Namespace(page_size=64, query_stride=qs, alpha=0.06, xattn_threshold=0.9, xattn_stride=8,
                                  sink_blocks=1, recent_blocks=1)
        return {m.name: query_stride_run(args, m) for m in known_methods([0.25])}

    default, given = strides(None), strides(2)
    assert default["compact_fa3_quest_budget_0.25"] == 4 and default["compact_fa3_budget_0.25"] == 1
    assert default["dense_fa3"] is None and default["compact_fa3_xattention"] is None
    assert given["compact_fa3_quest_budget_0.25"] == given["compact_fa3_mass_budget_0.25"] == 2
