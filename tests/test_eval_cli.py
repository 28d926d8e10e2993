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


@pytest.fixture(scope="module")
def model_dir(smollm2_dir) -> Path:
    return smollm2_dir


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


def test_accuracy_against_a_stub_server(model_dir, tmp_path):
    from sglang_compact.eval.cli import main
    srv = HTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    results = tmp_path / "accuracy.json"
    try:
        rc = main(["accuracy", "--url", f"http://127.0.0.1:{srv.server_port}", "--method", "dense",
                   "--params", '{"chunk": 256}', "--device-label", "stub", "--model", str(model_dir),
                   "--tasks", "niah_single_number", "vt", "--lengths", "2048", "--n", "2", "--results", str(results)])
    finally:
        srv.shutdown()
    assert rc == 0
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
    from sglang_compact.eval import fidelity as F
    from sglang_compact.eval.tasks import load_tokenizer, make_sample
    s = make_sample("niah_single_word", 1024, 0, load_tokenizer(str(model_dir)))
    model = F.load_model(str(model_dir))
    layers = F.capture_qkv(model, s.input_ids)
    assert len(layers) == 30 and layers[0].q.shape[1:] == (9, 64) and layers[0].k.shape[1:] == (3, 64)
    r = F.simulate(layers, ["compact:dense", "compact:flashprefill:alpha=0.06", "blocksparse:flashprefill:alpha=0.06"],
                   chunk=256, page_size=32, min_prefix_len=256, layer_ids=[0, 15])
    sm = r.summary()
    assert r.compact_chunks == 3
    assert sm["compact-dense()"]["rel_err"] < 1e-5
    fp = sm["compact-flashprefill(alpha=0.06)"]
    assert fp["recall"] > 0.9 and 0 < fp["density"] <= 1
    assert sm["blocksparse-flashprefill(alpha=0.06)"]["density"] <= fp["density"] + 1e-9


def test_density_from_metrics_text():
    from sglang_compact.eval.cli import density_between, parse_density_counters
    text = "\n".join([
        "# TYPE sglang:compact_density_forward histogram",
        'sglang:compact_density_forward_bucket{le="0.5",model_name="m",stage="after_group",tp_rank="0"} 1.0',
        'sglang:compact_density_forward_sum{model_name="m",stage="after_group",tp_rank="0"} 4.5',
        'sglang:compact_density_forward_count{model_name="m",stage="after_group",tp_rank="0"} 5.0',
        'sglang:compact_density_forward_sum{model_name="m",stage="selected",tp_rank="0"} 1.5',
    ])
    c = parse_density_counters(text)
    assert c == (4.5, 5.0)
    assert density_between((0.9, 1.0), c) == pytest.approx(0.9)
    assert density_between(c, c) is None and density_between(None, None) is None
    assert parse_density_counters("sglang:other 1") is None
