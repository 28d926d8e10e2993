"""`scripts/eval_longctx.py` end to end without SGLang: a stub HTTP server, and the offline paths on SmolLM2.

Uses SmolLM2's tokenizer and weights (converted by scripts/convert_smollm2.py, as the server tests do);
skips when the GGUF package is not installed.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest



class _Stub(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        type(self).requests.append((self.path, body))
        out = {"text": " 1234567.", "meta_info": {"prompt_tokens": len(body.get("input_ids", []))}}
        data = json.dumps(out if self.path == "/generate" else {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def _stub_server() -> HTTPServer:
    _Stub.requests = []
    srv = HTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_accuracy_against_a_stub_server(model_dir, tmp_path):
    from harness.eval.cli import main
    srv = _stub_server()
    results = tmp_path / "accuracy.json"
    try:
        rc = main(["accuracy", "--url", f"http://127.0.0.1:{srv.server_port}", "--method", "dense",
                   "--params", '{"chunk": 256}', "--device-label", "stub", "--model", str(model_dir),
                   "--tasks", "niah_single_number", "vt", "--lengths", "2048", "--n", "2", "--results", str(results),
                   "--out-dir", str(tmp_path / "preds")])
    finally:
        srv.shutdown()
    assert rc == 0
    (preds,) = (tmp_path / "preds").iterdir()
    assert preds.name.endswith("-dense.jsonl") and len(preds.read_text().splitlines()) == 4
    gens = [b for p, b in _Stub.requests if p == "/generate"]
    assert len(gens) == 4 and all(b["sampling_params"]["temperature"] == 0 for b in gens)
    assert all(2048 * 0.95 < len(b["input_ids"]) <= 2048 for b in gens)
    assert sum(p == "/flush_cache" for p, _ in _Stub.requests) == 4
    rows = json.loads(results.read_text())
    assert [(r["task"], r["n"], r["accuracy"], r["density"], r["device"]) for r in rows] == [
        ("niah_single_number", 2, 0.0, None, "stub"), ("vt", 2, 0.0, None, "stub")]
    assert "| dense | chunk=256 | stub | 2 |" in results.with_suffix(".md").read_text()


def test_fidelity_on_smollm2(model_dir):
    """Real weights, short prompt, two layers: the dense selector is exact; flashprefill drops little mass."""
    from harness.eval import fidelity as F
    from harness.eval.tasks import load_tokenizer, make_sample
    s = make_sample("niah_single_word", 1024, 0, load_tokenizer(str(model_dir)))
    model = F.load_model(str(model_dir))
    layers = F.capture_qkv(model, s.input_ids)
    assert len(layers) == 30 and layers[0].q.shape[1:] == (9, 64) and layers[0].k.shape[1:] == (3, 64)
    # dense_tail=0: every window but the prompt's last, partial one may go sparse
    r = F.simulate(layers, ["compact:dense:dense_tail=0", "compact:flashprefill:alpha=0.3,dense_tail=0",
                            "blocksparse:flashprefill:alpha=0.3,dense_tail=0"],
                   chunk=256, page_size=32, min_context=256, layer_ids=[0, 15])
    sm = r.summary()
    # windows of 256 tokens (the chunk size): windows 1 and 2 are sparse; the prompt's last window (< 1024 tokens)
    # is partial, which the gate keeps dense
    assert len(s.input_ids) < 1024 and r.compact_chunks == 2
    assert sm["compact-dense(dense_tail=0)"]["rel_err"] < 1e-5
    fp = sm["compact-flashprefill(alpha=0.3,dense_tail=0)"]
    assert fp["recall"] > 0.9 and 0 < fp["density"] <= 1
    # per head and q-block, without the group and window unions: fewer pages, less mass
    bs = sm["blocksparse-flashprefill(alpha=0.3,dense_tail=0)"]
    assert bs["density"] < fp["density"] and bs["recall"] <= fp["recall"] + 1e-9 and bs["rel_err"] > fp["rel_err"]


def test_density_from_metrics_text():
    from harness.eval.client import mean_between, parse_density_counters
    text = "\n".join([
        "# TYPE sglang:compact_density_forward histogram",
        'sglang:compact_density_forward_bucket{le="0.5",model_name="m",tp_rank="0"} 1.0',
        'sglang:compact_density_forward_sum{model_name="m",tp_rank="0"} 4.5',
        'sglang:compact_density_forward_count{model_name="m",tp_rank="0"} 5.0',
        'sglang:compact_density_forward_created{model_name="m",tp_rank="0"} 1.7e9',
        'sglang:compact_density{layer="0",model_name="m",tp_rank="0"} 0.25',
    ])
    c = parse_density_counters(text)
    assert c == (4.5, 5.0)
    # a server of the earlier design labels the histogram by stage: only the post-union one counts
    legacy = "\n".join([
        'sglang:compact_density_forward_sum{model_name="m",stage="after_group",tp_rank="0"} 4.5',
        'sglang:compact_density_forward_count{model_name="m",stage="after_group",tp_rank="0"} 5.0',
        'sglang:compact_density_forward_sum{model_name="m",stage="selected",tp_rank="0"} 1.5',
        'sglang:compact_density_forward_count{model_name="m",stage="selected",tp_rank="0"} 5.0',
    ])
    assert parse_density_counters(legacy) == (4.5, 5.0)
    assert mean_between((0.9, 1.0), c) == pytest.approx(0.9)
    assert mean_between(c, c) is None and mean_between(None, None) is None
    assert parse_density_counters("sglang:other 1") is None
    from harness.eval.client import parse_histogram_counters
    recall = "\n".join([
        'sglang:compact_recall_forward_bucket{le="0.9",model_name="m",tp_rank="0"} 1.0',
        'sglang:compact_recall_forward_sum{model_name="m",tp_rank="0"} 1.7',
        'sglang:compact_recall_forward_count{model_name="m",tp_rank="0"} 2.0',
        'sglang:compact_recall{model_name="m",tp_rank="0"} 0.8',
    ])
    assert parse_histogram_counters(text + "\n" + recall, "sglang:compact_recall_forward") == (1.7, 2.0)
    assert parse_histogram_counters(text, "sglang:compact_recall_forward") is None
    from harness.eval.client import parse_prompt_pages
    pages = "\n".join([
        'sglang:compact_prompt_pages_total{model_name="m",tp_rank="0"} 200.0',
        'sglang:compact_prompt_pages_created{model_name="m",tp_rank="0"} 1.7e9',
        'sglang:compact_prompt_pages_read_total{model_name="m",tp_rank="0"} 80.0',
        'sglang:compact_prompt_pages_read_created{model_name="m",tp_rank="0"} 1.7e9',
    ])
    assert parse_prompt_pages(text + "\n" + pages) == (80.0, 200.0)
    assert mean_between((20.0, 100.0), (80.0, 200.0)) == pytest.approx(0.6)   # the passes in between
    assert parse_prompt_pages(text) is None


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_no_write_writes_nothing(model_dir, tmp_path, monkeypatch, capsys):
    """`accuracy --no-write` through `scripts/eval_longctx.py`'s defaults (results, predictions under this
    checkout): the rows are printed, and no file is created, neither in the cwd nor under the default paths."""
    import importlib.util
    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("eval_longctx", repo / "scripts" / "eval_longctx.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from harness.eval.cli import main
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out_dir_existed = script.DEFAULTS["out_dir"].exists()
    watched = {d: _files(d) for d in (script.DEFAULTS["out_dir"], script.DEFAULTS["results"].parent) if d.exists()}
    results_before = script.DEFAULTS["results"].read_bytes() if script.DEFAULTS["results"].exists() else None
    srv = _stub_server()
    try:
        rc = main(["accuracy", "--url", f"http://127.0.0.1:{srv.server_port}", "--method", "dense",
                   "--device-label", "stub", "--model", str(model_dir), "--tasks", "vt", "--lengths", "1024",
                   "--n", "1", "--no-write"], defaults=script.DEFAULTS)
    finally:
        srv.shutdown()
    assert rc == 0
    rows, _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)  # the rows, then the summary lines
    assert [(r["task"], r["n"], r["device"]) for r in rows] == [("vt", 1, "stub")]
    assert _files(tmp_path) == set()
    for d, before in watched.items():
        assert _files(d) == before, d
    assert script.DEFAULTS["out_dir"].exists() == out_dir_existed
    assert (script.DEFAULTS["results"].read_bytes() if script.DEFAULTS["results"].exists() else None) == results_before


def test_accuracy_outputs():
    """Where `accuracy` writes: nothing with --no-write; else under --out-dir and --results, which must be given
    (the harness has no default paths of its own)."""
    import argparse
    from harness.eval.cmd_accuracy import accuracy_outputs
    ns = argparse.Namespace(no_write=True, out_dir=None, results=None)
    o = accuracy_outputs(ns, "dense", "T")
    assert (o.predictions, o.server_log, o.results) == (None, None, None)
    ns = argparse.Namespace(no_write=True, out_dir=Path("/x"), results=Path("/r/a.json"))
    assert accuracy_outputs(ns, "dense", "T").predictions is None
    ns = argparse.Namespace(no_write=False, out_dir=Path("/x"), results=Path("/r/a.json"))
    o = accuracy_outputs(ns, "compact-flashprefill", "T")
    assert o.predictions == Path("/x/T-compact-flashprefill.jsonl")
    assert o.server_log == Path("/x/T-compact-flashprefill-server.log") and o.results == Path("/r/a.json")
    with pytest.raises(SystemExit, match="--out-dir"):
        accuracy_outputs(argparse.Namespace(no_write=False, out_dir=None, results=Path("/r/a.json")), "dense", "T")
