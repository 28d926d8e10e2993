"""Compact telemetry (sglang_compact/srt/telemetry.py): per-forward summaries, and the Prometheus series on
SGLang's `/metrics`.

* `CompactTelemetry.flush()` summarises a forward pass (densities, coverage, q-blocks by path);
* `CompactMetrics` in prometheus_client's multiprocess mode (as SGLang runs it): written by one process,
  read back through a `MultiProcessCollector` (what SGLang's `/metrics` route does), in a child process;
* (server) a CPU `compact` server started with `--enable-metrics` and a density cap serves one long
  prompt; `/metrics` then has the compact series with the gate's decisions.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sglang_compact.srt.telemetry import PATHS, CompactTelemetry

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


class RecordingMetrics:
    def __init__(self):
        self.summaries = []

    def observe(self, summary):
        self.summaries.append(summary)


def d(x):
    return torch.tensor(x, dtype=torch.float64)


def test_flush_summarises_the_previous_forward_pass():
    metrics = RecordingMetrics()
    t = CompactTelemetry(num_layers=2, metrics=metrics)
    assert t.flush() is None
    t.begin_forward([512, 0], [128, 64], {"sparse": 8, "dense_context": 4}, 128)
    t.record(0, d(0.4))
    t.record(1, d(0.6), d(0.9))
    t.begin_forward([640], [128], {"dense_tail": 8}, 0)  # flushes the first pass
    s = metrics.summaries[-1]
    assert s["density"] == pytest.approx(0.5) and s["per_layer"] == {0: 0.4, 1: 0.6}
    assert s["coverage"] == pytest.approx(0.9)
    assert s["qblocks"] == {"sparse": 8, "dense_context": 4, "dense_tail": 0, "dense": 0, "dense_density": 0}
    assert t.flush()["density"] is None             # a dense pass: no density, its q-blocks counted
    assert metrics.summaries[-1]["qblocks"]["dense_tail"] == 8
    assert t.totals == {"forward_passes": 1, "sparse_qblocks": 8, "sparse_tokens": 128}
    assert t.flush() is None
    # windows that turned dense at the pass's first layer (their observed density): the pass's paths change
    t.begin_forward([4096], [128], {"sparse": 8}, 128)
    t.update_paths({"sparse": 2, "dense_density": 6}, 32)
    s = t.flush()
    assert s["qblocks"]["sparse"] == 2 and s["qblocks"]["dense_density"] == 6 and s["sparse_tokens"] == 32
    t.update_paths({"sparse": 1}, 1)                # no pass open: nothing to change
    assert t.flush() is None


def test_layers_that_read_every_page_count_in_the_pass_density():
    """The layers of a sparse pass before its observing layer read every page: density 1.0 in the pass's mean
    (what the pass read, not only what its selecting layers read); so do the windows that turned dense by their
    observed density, a pass whose windows all did reading 1.0."""
    metrics = RecordingMetrics()
    t = CompactTelemetry(num_layers=4, metrics=metrics)
    t.begin_forward([4096], [1024], {"sparse": 32}, 1024)
    t.record_read_all(0)
    for layer, x in ((1, 0.3), (2, 0.2), (3, 0.3)):
        t.record(layer, d(x))
    s = t.flush()
    assert s["per_layer"] == {0: 1.0, 1: pytest.approx(0.3), 2: pytest.approx(0.2), 3: pytest.approx(0.3)}
    assert list(s["per_layer"]) == [0, 1, 2, 3] and s["density"] == pytest.approx(0.45)
    t.begin_forward([4096], [1024], {"sparse": 32}, 1024, pages=(160, 0))
    t.record_read_all(0)
    t.update_paths({"dense_density": 32}, 0, pages=(0, 160))
    s = t.flush()   # every window turned dense at the observing layer: the pass read every page, in every layer
    assert s["density"] == 1.0 and s["per_layer"] == dict.fromkeys(range(4), 1.0) and t.totals["forward_passes"] == 2
    # some windows turned dense: they weigh in by their context pages (a layer's selection covers the others)
    t.begin_forward([4096], [1024], {"sparse": 32}, 1024)
    t.record_read_all(0)
    t.update_paths({"sparse": 8, "dense_density": 24}, 256, pages=(120, 40))
    for layer in (1, 2, 3):
        t.record(layer, d(0.2))
    s = t.flush()
    assert s["per_layer"] == {0: 1.0, 1: pytest.approx(0.4), 2: pytest.approx(0.4), 3: pytest.approx(0.4)}
    assert s["density"] == pytest.approx(0.55)
    t.begin_forward([4096], [1024], {"dense_context": 32}, 0)   # a dense pass (the gate's): no density
    assert t.flush()["density"] is None
    t.begin_forward([4096], [1024], {"sparse": 32}, 1024)   # the next pass starts clean
    t.record(1, d(0.5))
    assert t.flush()["per_layer"] == {1: pytest.approx(0.5)}


def test_prompt_pages_weigh_every_window_by_its_context():
    """`context_pages` (all the pass's windows) and `read_pages`: the windows of the pass's density read that
    share of their pages, the dense ones (context below the gate, the dense tail, turned dense) all of theirs;
    a dense pass reads everything. These feed the page-weighted `sglang:compact_prompt_pages*` counters."""
    metrics = RecordingMetrics()
    t = CompactTelemetry(num_layers=2, metrics=metrics)
    t.begin_forward([4096, 0], [1024, 512], {"sparse": 32, "dense_context": 16}, 1024, pages=(160, 0),
                    context_pages=176)
    t.record(0, d(0.25))
    t.record(1, d(0.35))
    s = t.flush()
    assert s["context_pages"] == 176 and s["read_pages"] == pytest.approx(0.3 * 160 + 16)
    t.begin_forward([4096], [1024], {"sparse": 32}, 1024, pages=(160, 0), context_pages=160)
    t.update_paths({"sparse": 8, "dense_density": 24}, 256, pages=(120, 40))
    t.record(0, d(0.2))
    t.record(1, d(0.2))
    s = t.flush()    # turned-dense windows are in the pass's density already (0.4 = (0.2 * 120 + 40) / 160)
    assert s["read_pages"] == pytest.approx(0.4 * 160)
    t.begin_forward([8192], [1024], {"dense_tail": 32}, 0, context_pages=288)
    s = t.flush()
    assert s["density"] is None and s["context_pages"] == s["read_pages"] == 288
    assert [m["context_pages"] for m in metrics.summaries] == [176, 160, 288]


def test_recall_is_summarised_with_the_pass_that_measured_it():
    metrics = RecordingMetrics()
    t = CompactTelemetry(num_layers=2, metrics=metrics)
    t.begin_forward([512], [128], {"sparse": 8}, 128)
    t.record(0, d(0.4))
    t.record_recall(torch.tensor([0.9, 0.6, 0.75]))
    t.record(1, d(0.6))
    s = t.flush()
    assert s["recall"] == pytest.approx(0.75) and s["recall_min"] == pytest.approx(0.6)
    assert s["density"] == pytest.approx(0.5) and s["coverage"] == 1.0
    t.begin_forward([640], [128], {"sparse": 8}, 128)
    t.record(0, d(0.3))
    assert t.flush()["recall"] is None  # a pass that did not measure reports none


def test_nothing_is_read_when_no_one_reads_it():
    t = CompactTelemetry(2, metrics=None)
    assert not t.wants_stats()
    t.begin_forward([512], [128], {"sparse": 8}, 128)
    t.record(0, d(0.5))
    assert t.flush() is None and t.totals["forward_passes"] == 0


@needs_prometheus
def test_metrics_in_multiprocess_mode(tmp_path):
    """Written by one process, aggregated by a MultiProcessCollector as SGLang's /metrics route does."""
    code = textwrap.dedent("""
        import sys
        import torch
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        from sglang_compact.srt.telemetry import CompactMetrics, CompactTelemetry

        m = CompactMetrics({"model_name": "m", "tp_rank": 0}, num_layers=3, min_context=4096)
        CompactMetrics({"model_name": "m", "tp_rank": 0}, num_layers=3, min_context=4096)  # no clash
        t = CompactTelemetry(3, metrics=m)
        for _ in range(2):
            t.begin_forward([512], [128], {"sparse": 8, "dense_tail": 2}, 128)
            for layer in range(3):
                t.record(layer, torch.tensor(0.1 * (layer + 1), dtype=torch.float64))
            t.record_recall(torch.tensor([0.8, 0.95]))
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
    assert samples[("sglang:compact_qblocks_total", (("path", "sparse"),))] == 16
    assert samples[("sglang:compact_qblocks_total", (("path", "dense_tail"),))] == 4
    assert samples[("sglang:compact_tokens_total", ())] == 256
    assert samples[("sglang:compact_forward_passes_total", ())] == 2
    assert samples[("sglang:compact_coverage", ())] == 1.0
    assert samples[("sglang:compact_gate_min_context", ())] == 4096
    assert samples[("sglang:compact_density", (("layer", "2"),))] == pytest.approx(0.3)
    assert samples[("sglang:compact_density_forward_count", ())] == 2
    assert samples[("sglang:compact_recall", ())] == pytest.approx(0.875)
    assert samples[("sglang:compact_recall_min", ())] == pytest.approx(0.8)
    # the flush at the second begin_forward and the last one: two measured passes of mean 0.875 each
    assert samples[("sglang:compact_recall_forward_count", ())] == 2
    assert samples[("sglang:compact_recall_forward_sum", ())] == pytest.approx(1.75)
    assert list(tmp_path.glob("*.db"))  # really the multiprocess files


def parse_metrics(text: str) -> dict:
    """{(sample name, sorted labels other than SGLang's own): value}."""
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
    ids = [rng.randrange(200, 40000) for _ in range(800)]  # 7 chunks of 128 tokens, pages of 16
    args = ["--attention-backend", "compact", "--compact-selector", "flashprefill", "--compact-min-context", "256",
            "--compact-dense-tail", "100", "--compact-density-cap", "0.5", "--enable-metrics",
            "--compact-recall-every", "1"]
    with SGLangServer(model, module="sglang_compact.launch_server", page_size=16, chunked_prefill_size=128,
                      extra_args=args) as srv:
        before = parse_metrics(srv.get_text("/metrics"))   # (health checks may have run a token or two)
        out = srv.generate(input_ids=ids, max_new_tokens=2, ignore_eos=True)
        assert len(out.output_ids) == 2
        text = srv.get_text("/metrics")
    num_layers = 30  # SmolLM2-135M
    samples = parse_metrics(text)
    for key, value in before.items():
        if key[0].endswith("_total") or key[0].endswith("_count") or key[0].endswith("_sum"):
            samples[key] = samples.get(key, 0) - value
    assert ("sglang:num_running_reqs", ()) in samples  # SGLang's own scheduler series are there too
    q = {p: samples.get(("sglang:compact_qblocks_total", (("path", p),)), 0) for p in PATHS}
    # union windows of 128 tokens (the chunk): windows 0-1 (context < 256: pages 0-15) dense; the windows holding
    # the tail (the last 100 of 800 tokens, as noted by the plugin's ForwardBatch hook: windows from
    # (800 - 100) // 128 = 5 on, pages 40-49) dense; windows 2-4 (pages 16-39) sparse
    assert q == {"sparse": 24, "dense_context": 16, "dense_tail": 10, "dense": 0, "dense_density": 0}, q
    assert samples[("sglang:compact_tokens_total", ())] == 24 * 16
    assert samples[("sglang:compact_gate_min_context", ())] == 256
    assert samples[("sglang:compact_gate_dense_above", ())] == 1.0   # no cost model on the CPU: never
    passes = samples[("sglang:compact_forward_passes_total", ())]
    assert passes == 3  # the chunks at 256, 384 and 512 hold sparse windows
    assert 0 < samples[("sglang:compact_coverage", ())] <= 1
    for layer in range(num_layers):
        assert 0 < samples[("sglang:compact_density", (("layer", str(layer)),))] <= 1
    assert samples[("sglang:compact_density_forward_count", ())] == passes
    # page-weighted over every extend pass: chunk k's window reads pages 0..8k+7 (the last chunk 0..49); the
    # dense windows (chunks 0-1 below the gate, 5-6 in the tail: 8 + 16 + 48 + 50 pages) read all of theirs,
    # the sparse ones (24, 32, 40 pages) each its pass's density of theirs: between 24 and 40 times the sum
    # of the three passes' densities
    total = samples[("sglang:compact_prompt_pages_total", ())]
    read = samples[("sglang:compact_prompt_pages_read_total", ())] - 122
    assert total == 8 + 16 + 24 + 32 + 40 + 48 + 50
    dsum = samples[("sglang:compact_density_forward_sum", ())]
    assert 24 * dsum - 1e-6 <= read <= 40 * dsum + 1e-6 and read < 96, (read, dsum)
    # every sparse pass measured one layer's mass recall (the share of attention its capped selection reads)
    recall, recall_min = samples[("sglang:compact_recall", ())], samples[("sglang:compact_recall_min", ())]
    assert 0 < recall_min <= recall + 1e-6 and recall <= 1 + 1e-5, (recall_min, recall)  # float32 sums
    # ... each observed by the histogram the accuracy harness averages per prompt
    assert samples[("sglang:compact_recall_forward_count", ())] == passes
    assert 0 < samples[("sglang:compact_recall_forward_sum", ())] <= passes * (1 + 1e-5)


@pytest.mark.server
@needs_prometheus
def test_windows_that_select_densely_turn_dense_for_the_pass():
    """--compact-dense-above 0: every sparse window's first-layer selection reads more than 0 of its pages, so
    each such pass runs as a dense pass: the same greedy tokens as the dense selector, its q-blocks counted
    as dense_density, and the passes the gate made sparse report what they read: density 1.0."""
    from convert_smollm2 import convert

    model = convert(MODEL_DIR, "float32", quiet=True)
    rng = random.Random(5)
    ids = [rng.randrange(200, 40000) for _ in range(800)]
    common = ["--attention-backend", "compact", "--compact-min-context", "256", "--compact-dense-tail", "100"]
    outputs, samples = {}, {}
    for name, extra in (("dense_above 0", ["--compact-dense-above", "0", "--enable-metrics"]),
                        ("dense", ["--compact-selector", "dense"])):
        with SGLangServer(model, module="sglang_compact.launch_server", page_size=16, chunked_prefill_size=128,
                          extra_args=common + extra) as srv:
            metrics = "--enable-metrics" in extra
            before = parse_metrics(srv.get_text("/metrics")) if metrics else {}
            outputs[name] = srv.generate(input_ids=ids, max_new_tokens=4, ignore_eos=True).output_ids
            if metrics:
                samples = parse_metrics(srv.get_text("/metrics"))
                for key, value in before.items():
                    if key[0].endswith("_total"):
                        samples[key] = samples.get(key, 0) - value
    assert outputs["dense_above 0"] == outputs["dense"]
    q = {p: samples.get(("sglang:compact_qblocks_total", (("path", p),)), 0) for p in PATHS}
    assert q == {"sparse": 0, "dense_context": 16, "dense_tail": 10, "dense": 0, "dense_density": 24}, q
    passes = samples[("sglang:compact_forward_passes_total", ())]
    assert passes == 3   # the chunks after the first 256 tokens of context and before the dense tail
    assert samples[("sglang:compact_density_forward_count", ())] == passes
    assert samples[("sglang:compact_density_forward_sum", ())] == passes * 1.0
    assert samples[("sglang:compact_gate_dense_above", ())] == 0.0


@pytest.mark.server
@needs_prometheus
def test_budget_density_replay_is_what_the_server_reports():
    """`scripts/budget_density.py` replays a fixed-budget selector's page counts on the host; a CPU server running
    that selector on one prompt reports the same two densities on `/metrics`: the mean over its sparse passes
    (`compact_density_forward`) and the page-weighted one over every pass (`compact_prompt_pages*`). The share
    comes from `chunk_density` at the server's chunk size, resolved once at start (`CompactConfig.at_chunk`)."""
    from budget_density import prompt_densities
    from convert_smollm2 import convert

    from sglang_compact.config import CompactConfig

    model = convert(MODEL_DIR, "float32", quiet=True)
    rng = random.Random(11)
    ids = [rng.randrange(200, 40000) for _ in range(1000)]
    params = {"chunk_density": "64:0.3", "min_pages": 12, "min_tokens": 0}
    config = CompactConfig(block_size=16, selector="quest_budget", selector_params=params, min_context=256,
                           dense_tail=100, sink_blocks=2, recent_blocks=4)
    assert config.params.density == 0.25 and config.at_chunk(128).params.density == 0.3
    replay = prompt_densities(config.at_chunk(128), len(ids), 128)
    assert replay["per_pass"] != prompt_densities(config, len(ids), 128)["per_pass"]
    args = ["--attention-backend", "compact", "--compact-selector", "quest_budget", "--compact-selector-params",
            json.dumps(params), "--compact-min-context", "256", "--compact-dense-tail", "100", "--enable-metrics"]
    with SGLangServer(model, module="sglang_compact.launch_server", page_size=16, chunked_prefill_size=128,
                      extra_args=args) as srv:
        before = parse_metrics(srv.get_text("/metrics"))
        srv.generate(input_ids=ids, max_new_tokens=1)
        samples = parse_metrics(srv.get_text("/metrics"))
    for key, value in before.items():
        samples[key] = samples.get(key, 0) - value if key[0].endswith(("_total", "_sum", "_count")) else samples[key]
    count = samples[("sglang:compact_density_forward_count", ())]
    assert count == replay["sparse_passes"] > 0 and replay["passes"] == 8
    assert samples[("sglang:compact_density_forward_sum", ())] / count == pytest.approx(replay["per_pass"], abs=1e-6)
    page_weighted = (samples[("sglang:compact_prompt_pages_read_total", ())]
                     / samples[("sglang:compact_prompt_pages_total", ())])
    assert page_weighted == pytest.approx(replay["page_weighted"], abs=1e-6)
    assert replay["per_pass"] < 1 and replay["page_weighted"] < 1
