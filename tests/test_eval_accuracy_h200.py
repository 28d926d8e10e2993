"""scripts/gpu/accuracy_h200.py without a GPU: the plan (--dry-run), the cell schedule and the rows, with fakes."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.eval import methods as M
from harness.eval.rows import HF_DENSITY_SOURCE, SERVER_DENSITY_SOURCE
from harness.eval.tasks import TASKS, Sample

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def acc():
    spec = importlib.util.spec_from_file_location("accuracy_h200", REPO_ROOT / "scripts" / "gpu" / "accuracy_h200.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _sample(task: str, length: int, index: int, answer: str = "1234567") -> Sample:
    return Sample(task=task, length=length, index=index, seed=0, prompt="p", input_ids=list(range(40)),
                  answers=[answer], max_new_tokens=8)


def test_dry_run_prints_the_plan(acc, tmp_path, capsys):
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--base-port", "31000"]) == 0
    out = capsys.readouterr().out
    cmds = [line for line in out.splitlines() if " -m sglang" in line]
    assert len(cmds) == 7
    dense = [c for c in cmds if "-m sglang.launch_server" in c]
    assert len(dense) == 1 and "--attention-backend flashinfer" in dense[0] and "--compact" not in dense[0]
    compact = [c for c in cmds if "-m sglang_compact.launch_server" in c]
    assert len(compact) == 6
    for c in cmds:
        for flag in ("--page-size 32", "--chunked-prefill-size 256", "--dtype bfloat16", "--enable-metrics",
                     "--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode 4", "--mem-fraction-static"):
            assert flag in c, (flag, c)
        assert "--device cpu" not in c
    for c in compact:
        assert "--compact-min-context 512 --compact-sink-blocks 2 --compact-recent-blocks 4" in c
        assert "--compact-dense-tail 256" in c
        assert "--compact-recall-every 1" in c   # per-prompt mass recall beside the density
    assert sorted(int(c.split("--port ")[1].split()[0]) for c in cmds) == list(range(31000, 31007))
    assert "--compact-selector-params '{\"alpha\": 0.4}'" in out
    assert "--hf-worker" not in out   # the HF methods run only when named (--hf-methods quoka ...)
    # every task at each default length, lengths outer: vt is the 7th task of the third length
    tasks = list(TASKS)
    assert out.count("length   8192") == len(tasks)
    assert f"{2 * len(tasks) + tasks.index('vt') + 1}. length   8192  vt" in out
    assert not (tmp_path / "accuracy.json").exists()


@pytest.mark.parametrize("smi, label", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("Tesla T4", "t4"), ("", "gpu"), (None, "gpu")])
def test_the_rows_name_the_gpu_that_ran_them(acc, tmp_path, monkeypatch, smi, label):
    """The rows' device is the GPU's model as nvidia-smi names it (a lent H100 is not an H200), 'gpu' where
    nvidia-smi is missing or says nothing; --device-label overrides it."""
    if smi is not None:
        tool = tmp_path / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\necho '{smi}'\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) if smi is not None else str(tmp_path / "none"))
    assert acc.gpu_label() == label
    assert acc.parse_args(["--out", str(tmp_path)]).device_label == label
    assert acc.parse_args(["--out", str(tmp_path), "--device-label", "h200"]).device_label == "h200"


def test_min_prefix_len_auto_leaves_the_gate_to_the_servers(acc, tmp_path, capsys):
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--methods", "dense", "compact:quest_budget",
                     "--min-prefix-len", "auto"]) == 0
    compact = [line for line in capsys.readouterr().out.splitlines() if "-m sglang_compact.launch_server" in line]
    assert len(compact) == 1 and "--compact-min-context auto " in compact[0]
    with pytest.raises(SystemExit):   # the in-process HF runners gate by a number of tokens
        acc.main(["--dry-run", "--out", str(tmp_path), "--methods", "dense", "--hf-methods", "quoka",
                  "--min-prefix-len", "auto"])
    with pytest.raises(SystemExit):
        acc.main(["--dry-run", "--out", str(tmp_path), "--min-prefix-len", "half"])


def test_dense_tail_per_method(acc, tmp_path, capsys):
    specs = ["compact:flashprefill:alpha=0.06", "compact:flashprefill:alpha=0.06,dense_tail=0"]
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--methods", *specs, "--hf-methods"]) == 0
    cmds = [line for line in capsys.readouterr().out.splitlines() if " -m sglang_compact" in line]
    assert len(cmds) == 2
    default, off = cmds
    assert "--compact-dense-tail 256" in default and "--compact-dense-tail 0" in off
    assert "--compact-selector-params '{\"alpha\": 0.06}'" in off  # not a selector parameter
    with pytest.raises(ValueError, match="dense_tail must be an integer >= 0"):
        acc.main(["--dry-run", "--out", str(tmp_path), "--methods", "compact:flashprefill:dense_tail=-2"])
    with pytest.raises(ValueError, match="replaced by dense_tail"):
        acc.main(["--dry-run", "--out", str(tmp_path), "--methods", "compact:flashprefill:dense_final_chunk=1"])


def test_bad_methods(acc, tmp_path):
    with pytest.raises(ValueError, match="in-process"):
        acc.main(["--dry-run", "--out", str(tmp_path), "--methods", "quoka"])
    with pytest.raises(SystemExit):
        acc.main(["--dry-run", "--out", str(tmp_path), "--methods", "dense", "dense"])


def test_explicit_cells(acc, tmp_path, capsys):
    """--cells replaces the lengths x tasks product, in the given order; --hf-cells gives the HF child its own."""
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--methods", "dense", "--hf-methods", "quoka",
                     "--cells", "8192/niah_multiquery", "2048/vt", "--hf-cells", "8192/niah_multivalue"]) == 0
    out = capsys.readouterr().out
    assert " 1. length   8192  niah_multiquery" in out and " 2. length   2048  vt" in out and " 3. length" not in out
    assert "HF cells (1): 8192/niah_multivalue" in out
    a = acc.parse_args(["--cells", "4096/vt", "--hf-methods", "quoka"])
    assert a.cells == [(4096, "vt")] and a.hf_cells == [(4096, "vt")]  # HF cells default to the server cells
    assert acc.parse_args(["--cells", "4096/vt", "--hf-cells"]).hf_cells == []
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--methods", "dense", "--hf-methods", "quoka",
                     "--cells", "4096/vt", "--hf-cells"]) == 0
    assert "HF child" not in capsys.readouterr().out  # no HF cells: the child is not started
    for bad in (["--cells", "8192"], ["--cells", "8k/vt"], ["--cells", "8192/niah_nothing"],
                ["--cells", "0/vt"], ["--cells", "2048/vt", "2048/vt"]):
        with pytest.raises(SystemExit):
            acc.parse_args(bad)
    assert "LENGTH/TASK" in capsys.readouterr().err


def test_cell_samples_are_the_suite_prompts(acc, model_dir):
    """A cell's prompts do not depend on which other cells run: the paired comparison across runs needs that."""
    from harness.eval.tasks import load_tokenizer, make_suite
    tok = load_tokenizer(model_dir)
    suite = make_suite(tok, ["niah_multikey", "niah_single_word"], [1024], 3, seed=0)
    by_cell = acc.cell_samples(tok, [(1024, "niah_single_word")], 3, 0)
    want = [s for s in suite if s.task == "niah_single_word"]
    assert [s.input_ids for s in by_cell[(1024, "niah_single_word")]] == [s.input_ids for s in want]


class FakeWorker:
    def __init__(self, label, per_sample=0.0, fail_at=None, clock=None):
        self.label, self.per_sample, self.fail_at, self.clock = label, per_sample, fail_at, clock
        self.calls = []

    def run_cell(self, samples, stop):
        out = []
        for s in samples:
            if stop():
                break
            if self.fail_at == (s.length, s.task):
                raise RuntimeError("server died")
            if self.clock is not None:
                self.clock.t += self.per_sample
            else:
                time.sleep(self.per_sample)
            out.append({"task": s.task, "length": s.length})
        self.calls.append((samples[0].length, samples[0].task, len(out)))
        return out


def _cells_and_samples(acc, lengths=(2048, 4096), tasks=("niah_single_number", "vt"), n=3):
    cells = acc.cell_order(lengths, tasks)
    return cells, {c: [_sample(c[1], c[0], i) for i in range(n)] for c in cells}


def test_schedule_cuts_every_method_at_the_same_cell(acc):
    cells, samples = _cells_and_samples(acc, lengths=(2048,), tasks=("niah_single_number", "vt", "niah_multikey"))
    fast, slow = FakeWorker("fast", 0.0), FakeWorker("slow", 0.01)
    seen = []

    def on_done(cell, recs):
        seen.append((cell, sorted(recs)))
        slow.per_sample = 1.0  # the next cell takes 3 s, past the deadline (its estimate, ~0.03 s, lets it start)

    res = acc.run_schedule([fast, slow], cells, samples, time.monotonic() + 1.0, on_done, parallel=True, grace=3.0,
                           log=lambda m: None)
    assert seen == [(cells[0], ["fast", "slow"])] and res.done == cells[:1]
    assert res.stopped and "cut" in res.stopped and str(cells[1]) in res.stopped
    assert fast.calls[1] == (2048, "vt", 3) and slow.calls[1] == (2048, "vt", 1)  # fast's full cell is dropped too


def test_schedule_all_cells_and_failures(acc):
    cells, samples = _cells_and_samples(acc)
    ws = [FakeWorker("a"), FakeWorker("b", fail_at=cells[1])]
    seen = []
    res = acc.run_schedule(ws, cells, samples, time.monotonic() + 30, lambda c, r: seen.append((c, sorted(r))),
                           log=lambda m: None)
    assert res.stopped is None and res.done == cells
    assert seen[0] == (cells[0], ["a", "b"]) and all(labels == ["a"] for _, labels in seen[1:])
    assert "server died" in res.failed["b"]


def test_schedule_does_not_start_a_cell_that_cannot_fit(acc):
    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()
    cells, samples = _cells_and_samples(acc, lengths=(2048, 8192))
    ws = [FakeWorker("hf-a", 10.0, clock=clock), FakeWorker("hf-b", 10.0, clock=clock)]
    # 2048 cells: 60 s each (2 workers x 3 samples x 10 s); the first 8192 cell is estimated at 4 x 60 = 240 s
    res = acc.run_schedule(ws, cells, samples, 300.0, lambda c, r: None, parallel=False, clock=clock,
                           log=lambda m: None)
    assert res.done == cells[:2] and clock.t == 120.0
    assert "not started" in res.stopped and "240" in res.stopped
    # sequential: a deadline inside a cell drops it for both
    clock.t = 0.0

    def slower(cell, recs):
        for w in ws:
            w.per_sample = 30.0  # the second cell takes 180 s; started at 60 s (estimate 60 s x 1.5 <= 90 s left)

    res = acc.run_schedule(ws, cells, samples, 150.0, slower, parallel=False, clock=clock, log=lambda m: None)
    assert res.done == cells[:1] and "cut" in res.stopped and clock.t == 150.0  # hf-b never ran the cut cell


class FakeClient:
    """run_samples' client: right on every other prompt; each request adds three compact forward passes of
    density 0.25 to the /metrics counters, and (`recall`) one measured pass of mass recall 0.9."""

    def __init__(self, recall: bool = False):
        self.sum = self.count = 0.0
        self.recall = (0.0, 0.0) if recall else None
        self.requests = 0

    def flush_cache(self):
        pass

    def compact_counters(self):
        return {"density": (self.sum, self.count), "recall": self.recall}

    def generate(self, input_ids, max_new_tokens):
        self.requests += 1
        self.sum += 3 * 0.25
        self.count += 3
        if self.recall is not None:
            self.recall = (self.recall[0] + 0.9, self.recall[1] + 1)
        return {"text": " 1234567." if self.requests % 2 else " no", "meta_info": {"prompt_tokens": len(input_ids)}}


def test_rows_from_a_fake_server(acc, tmp_path):
    a = argparse.Namespace(chunk=256, page_size=32, min_prefix_len=512, sink_blocks=2, recent_blocks=4,
                           mem_fraction_static=0.3, cuda_graph_max_bs=4, sleep_on_idle=True, server_arg=[],
                           compact_arg=[], hf_dtype="bfloat16")
    run = acc.server_run("compact:flashprefill:alpha=0.2", a)
    dense = acc.server_run("dense", a)
    hf = acc.hf_run("quoka", a)
    results = tmp_path / "accuracy.json"
    results.write_text(json.dumps([{"model": "m", "task": "vt", "length": 2048, "method": "dense", "params": {},
                                    "n": 1, "accuracy": 0.0, "density": None, "date": "2026-01-01",
                                    "device": "cpu"}]))
    written = []
    runs = {r.label: r for r in (run, dense)}
    writer = acc.row_writer(runs, results, "smollm2-135m-instruct", "h200", written, log=lambda m: None)
    cell = (2048, "niah_single_number")
    samples = [_sample(cell[1], cell[0], i) for i in range(4)]
    recs = {r.label: acc.ServerWorker(r.label, FakeClient(recall=r is run)).run_cell(samples, lambda: False)
            for r in (run, dense)}
    assert all(x["server_recall"] == pytest.approx(0.9) for x in recs[run.label])   # one measured pass per prompt
    assert not any("server_recall" in x for x in recs[dense.label])
    writer(cell, recs)
    rows = json.loads(results.read_text())
    assert len(rows) == 3 and rows[1:] == written
    by_method = {r["method"]: r for r in written}
    c, d = by_method["compact-flashprefill"], by_method["dense"]
    for r in written:
        assert set(r) >= set(("model", "task", "length", "method", "params", "n", "accuracy", "density", "date",
                              "device", "accuracy_all", "density_source", "seconds_per_sample",
                              "mean_prompt_tokens"))
        assert (r["model"], r["task"], r["length"], r["n"], r["device"]) == (
            "smollm2-135m-instruct", "niah_single_number", 2048, 4, "h200")
        assert r["accuracy"] == 50.0
    assert c["params"] == {"alpha": 0.2, "chunk": 256, "page_size": 32, "min_context": 512, "sink_blocks": 2,
                           "recent_blocks": 4, "dense_tail": 256}
    assert c["density"] == 0.25 and c["density_source"] == SERVER_DENSITY_SOURCE
    assert c["recall"] == pytest.approx(0.9) and "recall" not in d
    assert d["density"] is None and d["density_source"] is None and d["params"]["backend"] == "flashinfer"
    # HF rows: density from each record's own `density`
    hrecs = [{**s.as_dict(), "score": 1.0, "all_found": True, "seconds": 2.0, "density": 0.2 + 0.1 * i}
             for i, s in enumerate(samples)]
    (h,) = acc.cell_rows(hf, cell, hrecs, "smollm2-135m-instruct", "h200")
    assert h["method"] == "quoka" and h["params"]["runner"] == "hf" and h["params"]["dtype"] == "bfloat16"
    assert h["density"] == pytest.approx(0.35) and h["density_source"] == HF_DENSITY_SOURCE
    table = acc.summary_table(written + [h], [dense, run, hf], [2048, 4096])
    assert "compact:flashprefill:alpha=0.2" in table and "0.250 4x1" in table and "hf quoka" in table


def test_cli_params_of_the_presets():
    """The CPU preset's params: the selector's (defaults filled in), its `dense_tail` (tokens; rows of the earlier
    design have `dense_final_chunk` and `min_prefix_len` instead) and the chunking / gate settings, where
    `--min-prefix-len` is the server's min_context."""
    ns = argparse.Namespace(start="cpu-compact", selector="flashprefill", selector_params=None, alpha=0.06,
                            threshold=None, top_p=None, budget_density=None, chunk=256, page_size=32,
                            min_prefix_len=512, sink_blocks=2, recent_blocks=4)
    assert M.method_and_params(ns) == ("compact-flashprefill", {"alpha": 0.06, "dense_tail": 256, "chunk": 256,
                                                                "page_size": 32, "min_context": 512,
                                                                "sink_blocks": 2, "recent_blocks": 4})
    ns.dense_tail = 0
    assert M.method_and_params(ns)[1]["dense_tail"] == 0
    flags = M.compact_server_args("flashprefill", M.selector_params(ns), 512, 2, 4)
    assert flags[flags.index("--compact-dense-tail") + 1] == "0"
    assert flags[flags.index("--compact-min-context") + 1] == "512"
    assert json.loads(flags[flags.index("--compact-selector-params") + 1]) == {"alpha": 0.06}
    del ns.dense_tail
    ns.start = "cpu-compact-dense"
    assert M.method_and_params(ns)[1] == {"chunk": 256, "page_size": 32, "min_context": 512, "sink_blocks": 2,
                                          "recent_blocks": 4}
    ns.start, ns.selector, ns.alpha = "cpu-compact", "budget", None
    assert M.method_and_params(ns) == ("compact-budget", {"density": 0.3, "dense_tail": 256, "chunk": 256,
                                                          "page_size": 32, "min_context": 512, "sink_blocks": 2,
                                                          "recent_blocks": 4})
    ns.start, ns.hf_method = "hf", "quoka"
    name, params = M.method_and_params(ns)
    assert name == "quoka" and "dtype" not in params and params["runner"] == "hf"
    assert "dense_tail" not in params  # the baseline as published: every chunk sparse
    ns.hf_method = "blocksparse:flashprefill:alpha=0.06"
    assert M.method_and_params(ns)[1]["dense_tail"] == 256
    ns.hf_method = "blocksparse:flashprefill:alpha=0.06,dense_tail=0"
    assert M.method_and_params(ns)[1]["dense_tail"] == 0


def test_gpu_server_command(monkeypatch):
    from harness.server import SGLangServer
    for k in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET", "SGLANG_COMPACT_CPU_SHIM"):
        monkeypatch.delenv(k, raising=False)
    s = SGLangServer("/m", device="cuda", dtype="bfloat16", max_total_tokens=None, port=30001, log_path="/tmp/x.log",
                     extra_args=["--attention-backend", "flashinfer"])
    cmd = " ".join(s.command)
    assert "--device cpu" not in cmd and "--max-total-tokens" not in cmd and "--skip-server-warmup" not in cmd
    assert "--dtype bfloat16" in cmd and "--attention-backend flashinfer" in cmd
    assert not any(k in s.env for k in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET", "SGLANG_COMPACT_CPU_SHIM"))
    assert s.env["HF_HUB_OFFLINE"] == "1" and not s.require_cpu_shim
    cpu = SGLangServer("/m", port=30002, log_path="/tmp/y.log")
    assert "--device cpu" in " ".join(cpu.command) and "--max-total-tokens 8192" in " ".join(cpu.command)
    assert cpu.env["SGLANG_USE_CPU_ENGINE"] == "1" and cpu.require_cpu_shim



def _stub_server():
    """An HTTP stand-in for one SGLang server: /generate, /flush_cache, and /metrics with density counters."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    state = {"sum": 0.0, "count": 0.0, "generate": 0}

    class H(BaseHTTPRequestHandler):
        def _send(self, data: bytes, ctype="application/json"):
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/generate":
                state["generate"] += 1
                state["sum"] += 0.5
                state["count"] += 1
                self._send(json.dumps({"text": " nothing", "meta_info": {
                    "prompt_tokens": len(body["input_ids"])}}).encode())
            else:
                self._send(b"{}")

        def do_GET(self):
            text = (f'sglang:compact_density_forward_sum{{model_name="m"}} {state["sum"]}\n'
                    f'sglang:compact_density_forward_count{{model_name="m"}} {state["count"]}\n')
            self._send(text.encode(), "text/plain")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, state


def test_main_with_stub_servers(acc, model_dir, tmp_path, monkeypatch, capsys):
    """The whole run (prompts, concurrent clients, rows per cell, summary, table) against HTTP stubs."""
    stubs = []

    class FakeServer:
        def __init__(self, run, a, log_dir, port):
            srv, state = _stub_server()
            stubs.append((srv, state, self))
            self.base_url = f"http://127.0.0.1:{srv.server_port}"
            self.command, self.log_path = ["fake", run.spec], log_dir / f"server-{run.label}.log"
            self.start_timeout, self.startup_seconds, self.stopped = 0.0, None, 0

        def start(self):
            self.startup_seconds = 0.01

        def stop(self):
            self.stopped += 1

    monkeypatch.setattr(acc, "make_server", FakeServer)
    monkeypatch.setattr(acc, "gpu_label", lambda: "h200")
    monkeypatch.setattr(acc.R, "render_plot", lambda rows, path: False)  # matplotlib: slow, and not the point
    out = tmp_path / "out"
    rc = acc.main(["--out", str(out), "--model-dir", str(model_dir), "--methods", "dense",
                   "compact:flashprefill:alpha=0.2", "--hf-methods", "--tasks", "niah_single_number", "vt",
                   "--lengths", "1024", "--n", "2", "--deadline-s", "120", "--stagger-s", "0"])
    assert rc == 0
    try:
        assert all(st["generate"] == 4 for _, st, _ in stubs) and all(f.stopped for _, _, f in stubs)
        base = json.loads((REPO_ROOT / "docs" / "results" / "accuracy.json").read_text())
        rows = json.loads((out / "accuracy.json").read_text())
        assert rows[:len(base)] == base
        new = rows[len(base):]
        assert [(r["task"], r["method"], r["n"], r["density"], r["device"]) for r in new] == [
            ("niah_single_number", "dense", 2, None, "h200"), ("niah_single_number", "compact-flashprefill", 2, 0.5,
                                                               "h200"),
            ("vt", "dense", 2, None, "h200"), ("vt", "compact-flashprefill", 2, 0.5, "h200")]
        summary = json.loads((out / "accuracy_h200_summary.json").read_text())
        assert summary["schedule"]["stopped"] is None and len(summary["schedule"]["cells_done"]) == 2
        assert summary["servers"]["dense"]["status"] == "done"
        assert len((out / "preds" / "compact_flashprefill_alpha0.2.jsonl").read_text().splitlines()) == 4
        assert (out / "accuracy.md").exists()
        last = capsys.readouterr().out.strip().splitlines()
        assert last[-2].startswith("dense") and last[-1].startswith("compact:flashprefill:alpha=0.2")
        assert "0.500 2x2" in last[-1]
    finally:
        for srv, _, _ in stubs:
            srv.shutdown()


def test_main_start_failures(acc, model_dir, tmp_path, monkeypatch, capsys):
    """A server that dies of memory at start is retried once; one that never comes up is given up on and
    stopped; the others are evaluated."""
    from harness.server import ServerError
    stubs = []

    class FlakyServer:
        def __init__(self, run, a, log_dir, port):
            srv, state = _stub_server()
            stubs.append(srv)
            self.spec, self.base_url = run.spec, f"http://127.0.0.1:{srv.server_port}"
            self.command, self.log_path = ["fake", run.spec], log_dir / f"server-{run.label}.log"
            self.start_timeout, self.startup_seconds, self.attempts = 0.0, None, 0
            self.stopped = threading.Event()

        def start(self):
            self.attempts += 1
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text(f"attempt {self.attempts}\n")
            if self.spec == "dense" and self.attempts == 1:
                raise ServerError("exited: ValueError: Loaded weights leave no GPU memory for the KV cache")
            if self.spec == "compact:oracle:top_p=0.95":
                self.stopped.wait(30)
                raise ServerError("server is gone")
            self.startup_seconds = 0.01

        def stop(self):
            self.stopped.set()

    monkeypatch.setattr(acc, "make_server", FlakyServer)
    monkeypatch.setattr(acc.R, "render_plot", lambda rows, path: False)
    out = tmp_path / "out"
    t = time.monotonic()
    rc = acc.main(["--out", str(out), "--model-dir", str(model_dir), "--methods", "dense", "compact:oracle:top_p=0.95",
                   "--hf-methods", "--tasks", "vt", "--lengths", "1024", "--n", "1", "--deadline-s", "400",
                   "--stagger-s", "0", "--straggler-s", "1"])
    try:
        assert rc == 0 and time.monotonic() - t < 20
        summary = json.loads((out / "accuracy_h200_summary.json").read_text())
        assert summary["servers"]["dense"]["status"] == "done"
        assert summary["servers"]["compact:oracle:top_p=0.95"]["status"] == "not up in time"
        assert (out / "logs" / "server-dense.attempt1.log").read_text() == "attempt 1\n"
        base = json.loads((REPO_ROOT / "docs" / "results" / "accuracy.json").read_text())
        rows = json.loads((out / "accuracy.json").read_text())[len(base):]  # this run's rows
        assert [r["method"] for r in rows] == ["dense"]
        table = capsys.readouterr().out.strip().splitlines()
        assert "[not up in time" in table[-1]
    finally:
        for srv in stubs:
            srv.shutdown()


def test_hf_child_starts_after_the_servers_are_up(acc, model_dir, tmp_path, monkeypatch):
    """SGLang sizes a server's KV pool from the free memory it measures around its weight loading: the HF child
    (its model, its 32K prefills) must not start before every server is up, or it takes that memory from under
    them (H200, 2026-12-03: both servers died of memory at start)."""
    launched = []

    class SlowServer:
        def __init__(self, run, a, log_dir, port):
            srv, _ = _stub_server()
            self.srv, self.base_url = srv, f"http://127.0.0.1:{srv.server_port}"
            self.command, self.log_path = ["fake", run.spec], log_dir / f"server-{run.label}.log"
            self.start_timeout, self.startup_seconds, self.up = 0.0, None, False

        def start(self):
            time.sleep(0.5)
            self.up, self.startup_seconds = True, 0.5

        def stop(self):
            self.srv.shutdown()

    servers = []

    def make(*args):
        servers.append(SlowServer(*args))
        return servers[-1]

    class FakeChild:
        pid = 4242

        def __init__(self, cmd, **kw):
            launched.append((cmd, [s.up for s in servers]))

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(acc, "make_server", make)
    monkeypatch.setattr(acc, "gpu_label", lambda: "h200")
    monkeypatch.setattr(acc.subprocess, "Popen", FakeChild)
    monkeypatch.setattr(acc.R, "render_plot", lambda rows, path: False)
    out = tmp_path / "out"
    rc = acc.main(["--out", str(out), "--model-dir", str(model_dir), "--methods", "dense", "compact:flashprefill",
                   "--hf-methods", "quoka", "--tasks", "vt", "--lengths", "1024", "--n", "1", "--deadline-s", "120",
                   "--stagger-s", "0"])
    assert rc == 0
    assert len(launched) == 1 and "--hf-worker" in launched[0][0]
    assert launched[0][1] == [True, True]     # every server was up when the child was launched
    summary = json.loads((out / "accuracy_h200_summary.json").read_text())
    assert summary["hf"]["error"] == "no status written (see logs/hf-worker.log)"   # the fake child wrote none
