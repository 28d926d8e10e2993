"""scripts/layer_density.py: per-layer selection densities read from the real server's /metrics."""

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import layer_density as LD  # noqa: E402

METRICS = """# HELP sglang:compact_density Pages the sparse rows read
# TYPE sglang:compact_density gauge
sglang:compact_density{layer="0",model_name="m",tp_rank="0"} 0.9
sglang:compact_density{layer="0",model_name="m",tp_rank="1"} 0.7
sglang:compact_density{layer="1",model_name="m",tp_rank="0"} 0.25
sglang:compact_density_forward_count{model_name="m"} 3.0
sglang:compact_density_forward_sum{model_name="m"} 1.5
sglang:compact_densityX{layer="5"} 1.0
"""


def test_metrics_are_read_per_layer():
    assert LD.layer_densities(METRICS) == pytest.approx({0: 0.8, 1: 0.25})   # ranks averaged; other series ignored
    assert LD.layer_densities("") == {}


@pytest.mark.server
def test_smollm2_layers_on_the_cpu_server(smollm2_dir, tmp_path):
    """`flashprefill`, whose densities differ by layer. Two suite prompts: one below the gate (no sparse pass: left out), one past it (every layer measured, each
    within (0, 1]). On SmolLM2 the first layer reads more of its context than the others on average (the reason a
    pass's first layer reads every page)."""
    rc = LD.main(["--model-path", str(smollm2_dir), "--lengths", "200,1000", "--prompts", "1", "--page-size", "16",
                  "--chunk", "128", "--min-context", "256", "--dense-tail", "64", "--out-dir", str(tmp_path),
                  "--extra-args", "--compact-selector flashprefill"])
    assert rc == 0
    data = json.loads((tmp_path / "layer_density.json").read_text())
    short, long_ = data["prompts"]
    assert short["tokens"] <= 200 and short["per_layer"] == {}
    layers = json.loads((smollm2_dir / "config.json").read_text())["num_hidden_layers"]
    assert sorted(int(k) for k in long_["per_layer"]) == list(range(layers))
    assert all(0.0 < v <= 1.0 for v in long_["per_layer"].values())
    table = data["per_layer"]
    assert [t["prompts"] for t in table] == [1] * layers
    rest = [t["mean"] for t in table[1:]]
    assert table[0]["mean"] > sum(rest) / len(rest)
    md = (tmp_path / "layer_density.md").read_text()
    assert "| 0 |" in md and "left out (1 here)" in md
