"""Compact telemetry (sglang_compact/srt/telemetry.py): per-forward summaries, coverage, and the Prometheus
series on SGLang's `/metrics`.

* `CompactTelemetry.flush()` summarises a forward pass (densities, coverage, chunk/token counts);
* `selection_coverage` against a hand-made mask and table;
* `CompactMetrics` in prometheus_client's multiprocess mode (as SGLang runs it): written by one process,
  read back through a `MultiProcessCollector` (what SGLang's `/metrics` route does), in a child process;
* (server) a CPU `compact` server started with `--enable-metrics` and a density cap serves one long
  prompt; `/metrics` then has the compact series with non-zero values.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sglang_compact.srt.telemetry import STAGES, CompactTelemetry, selection_coverage

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SGLangServer  # noqa: E402

MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"

try:
    import prometheus_client  # noqa: F401
    HAVE_PROMETHEUS = True
except ImportError:
    HAVE_PROMETHEUS = False
needs_prometheus = pytest.mark.skipif(
    not HAVE_PROMETHEUS, reason="prometheus_client is not installed (SGLang's --enable-metrics needs it: "
                                "pip install prometheus-client==0.26.0)")


@dataclass
class FakeStats:
    selected: float
    after_q: float
    after_group: float

    def as_floats(self):
        return {"selected": self.selected, "after_q": self.after_q, "after_group": self.after_group}


class RecordingMetrics:
    def __init__(self):
        self.summaries = []

    def observe(self, summary):
        self.summaries.append(summary)


def test_flush_summarises_the_previous_forward_pass():
    metrics = RecordingMetrics()
    t = CompactTelemetry(num_layers=2, metrics=metrics)
    assert t.flush() is None
    t.begin_forward([512, 0], [128, 64], [True, False])
    t.record(0, FakeStats(0.2, 0.4, 0.5))
    t.record(1, FakeStats(0.4, 0.6, 0.7))
    t.begin_forward([640], [128], [True])  # flushes the first pass
    s = metrics.summaries[-1]
    assert s["density_selected"] == pytest.approx(0.3) and s["density_after_group"] == pytest.approx(0.6)
    assert s["coverage"] == 1.0  # no density cap: nothing measured, 1.0 by construction
    assert s["compact_chunks"] == 1 and s["compact_tokens"] == 128
    assert t.totals == {"forward_passes": 1, "compact_rows": 1, "compact_tokens": 128, "dense_final_chunks": 0}
    assert t.flush() is None and len(metrics.summaries) == 1  # the second pass recorded nothing


def test_a_dense_final_chunk_counts_at_density_one():
    metrics = RecordingMetrics()
    t = CompactTelemetry(num_layers=2, metrics=metrics)
    t.begin_forward([768], [32], [False], [True])  # the request's last chunk, read dense by the policy
    for layer in range(2):
        t.record(layer, FakeStats(1.0, 1.0, 1.0))
    s = t.flush()
    assert s["dense_final_chunks"] == 1 and s["compact_chunks"] == 0 and s["density_after_group"] == 1.0
    assert t.totals["dense_final_chunks"] == 1 and t.totals["forward_passes"] == 1


def test_selection_coverage():
    # 1 request, 4 query heads in 2 kv groups, 2 query blocks, 4 prefix blocks
    mask = torch.zeros(1, 4, 2, 4, dtype=torch.bool)
    mask[0, 0, 0, [0, 1]] = True   # group 0
    mask[0, 1, 1, 2] = True        # group 0
    mask[0, 2, 0, 3] = True        # group 1
    table = torch.zeros(1, 2, 4, dtype=torch.bool)
    table[0, 0, [0, 1, 2]] = True
    table[0, 1, 3] = True
    assert float(selection_coverage(mask, table)) == 1.0
    table[0, 0, 2] = False          # a cap dropped one of the 4 selected cells
    assert float(selection_coverage(mask, table)) == pytest.approx(0.75)
    assert float(selection_coverage(torch.zeros_like(mask), table)) == 0.0


def test_coverage_is_measured_only_when_a_cap_can_drop_blocks():
    t = CompactTelemetry(2, metrics=None, coverage_needed=True)
    select = object()
    assert t.wrap_select(select) is select  # metrics off: nothing wrapped
    t = CompactTelemetry(2, metrics=RecordingMetrics(), coverage_needed=False)
    assert t.wrap_select(select) is select

    @dataclass
    class Sel:
        mask: torch.Tensor

    metrics = RecordingMetrics()
    t = CompactTelemetry(1, metrics=metrics, coverage_needed=True)
    mask = torch.ones(1, 2, 1, 2, dtype=torch.bool)
    wrapped = t.wrap_select(lambda *a, **k: Sel(mask))
    t.begin_forward([256], [16], [True])
    wrapped()
    t.record(0, FakeStats(0.5, 0.5, 0.5), torch.tensor([[[True, False]]]))
    t.flush()
    assert metrics.summaries[-1]["coverage"] == pytest.approx(0.5)


@needs_prometheus
def test_metrics_in_multiprocess_mode(tmp_path):
    """Written by one process, aggregated by a MultiProcessCollector as SGLang's /metrics route does."""
    code = textwrap.dedent("""
        import sys
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        from sglang_compact.srt.telemetry import CompactMetrics, CompactTelemetry

        import torch
        from sglang_compact.union import UnionStats

        def Stats(v):
            return UnionStats(*(torch.tensor(x, dtype=torch.float64) for x in (v, v + 0.1, v + 0.2)))

        m = CompactMetrics({"model_name": "m", "tp_rank": 0}, num_layers=3)
        CompactMetrics({"model_name": "m", "tp_rank": 0}, num_layers=3)  # a second instance does not clash
        t = CompactTelemetry(3, metrics=m)
        for _ in range(2):
            t.begin_forward([512], [128], [True])
            for layer in range(3):
                t.record(layer, Stats(0.1 * (layer + 1)))
        t.flush()
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        sys.stdout.write(generate_latest(reg).decode())
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                       cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    samples = parse_metrics(r.stdout)
    assert samples[("sglang:compact_chunks_total", ())] == 2
    assert samples[("sglang:compact_tokens_total", ())] == 256
    assert samples[("sglang:compact_forward_passes_total", ())] == 2
    assert samples[("sglang:compact_coverage", ())] == 1.0
    assert samples[("sglang:compact_density", (("layer", "2"), ("stage", "after_group")))] == pytest.approx(0.5)
    assert samples[("sglang:compact_density_forward_count", (("stage", "selected"),))] == 2
    assert list(tmp_path.glob("*.db"))  # really the multiprocess files


def parse_metrics(text: str) -> dict:
    """{(sample name, sorted labels other than model_name/tp_rank/le... kept): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "tp_rank", "engine_type", "pp_rank", "moe_ep_rank")))
            out[(s.name, labels)] = s.value
    return out


@pytest.mark.server
@needs_prometheus
def test_metrics_endpoint_of_a_compact_server():
    from convert_smollm2 import convert

    model = convert(MODEL_DIR, "float32", quiet=True)
    rng = random.Random(3)
    ids = [rng.randrange(200, 40000) for _ in range(800)]  # 7 chunks of 128: 4 of them past the 256 threshold
    args = ["--attention-backend", "compact", "--compact-selector", "flashprefill", "--compact-min-prefix-len", "256",
            "--compact-density-cap", "0.5", "--enable-metrics"]
    with SGLangServer(model, module="sglang_compact.launch_server", page_size=16, chunked_prefill_size=128,
                      extra_args=args) as srv:
        out = srv.generate(input_ids=ids, max_new_tokens=2, ignore_eos=True)
        assert len(out.output_ids) == 2
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        num_layers = 30  # SmolLM2-135M
    samples = parse_metrics(text)
    assert ("sglang:num_running_reqs", ()) in samples  # SGLang's own scheduler series are there too
    chunks = samples[("sglang:compact_chunks_total", ())]
    # prefixes 256, 384, 512, 640 take the compact path; the last chunk (prefix 768, 32 tokens) is the
    # request's final one, read dense (dense_final_chunk, on by default): the plugin's ForwardBatch hook works
    assert chunks == 4, chunks
    assert samples[("sglang:compact_tokens_total", ())] == 4 * 128
    assert samples[("sglang:compact_dense_final_chunks_total", ())] == 1
    passes = samples[("sglang:compact_forward_passes_total", ())]
    assert passes == chunks + 1
    assert 0 < samples[("sglang:compact_coverage", ())] <= 1
    for layer in range(num_layers):
        d = {stage: samples[("sglang:compact_density", (("layer", str(layer)), ("stage", stage)))] for stage in STAGES}
        # (the cap may take the group union below the q-block union: no order between those two)
        assert 0 < d["selected"] <= d["after_q"] <= 1 and 0 < d["after_group"] <= 1, (layer, d)
    for stage in STAGES:
        assert samples[("sglang:compact_density_forward_count", (("stage", stage),))] == passes
        # the dense final pass is in the mean at 1.0
        assert 1.0 < samples[("sglang:compact_density_forward_sum", (("stage", stage),))] <= passes
