"""scripts/gpu/serving_check.py without a GPU: the one-line-per-step summary the GPU-host scripts print from a
saved report (also from one a timeout cut short)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

from serving_check import summary  # noqa: E402

REPORT = {"steps": {
    "dense_vs_fa3_auto": {"n": 3, "equal": 1, "rows": [
        {"len": 4096, "equal": True},
        {"len": 16384, "equal": False, "first_divergence": 2, "gap_flashinfer": 0.03125, "gap_compact": 0.0},
        {"len": 32000, "equal": False, "error": "HTTP 500: boom"}]},
    "dense_vs_flashinfer_fa2": {"n": 2, "error": "server did not start", "rows": []},
    "long_1024": {"prompt_tokens": 131008, "ok": True, "wall_s": 9.1,
                  "concurrent": {"ok": True, "used_tokens_after_flush": 0, "n": 32}},
}}


def test_a_dense_step_names_each_unequal_prompt_and_other_steps_their_figures():
    lines = summary(REPORT)
    assert lines[0] == "dense_vs_fa3_auto 1/3 equal;  [(16384, (2, 0.03125, 0.0)), (32000, 'HTTP 500: boom')]"
    assert lines[1] == "dense_vs_flashinfer_fa2 0/2 equal; server did not start []"
    assert lines[2] == "long_1024 {'prompt_tokens': 131008, 'ok': True, 'wall_s': 9.1} True 0"
    assert len(lines) == 3


def test_summary_flag_prints_a_saved_report_and_starts_nothing(tmp_path):
    path = tmp_path / "serving_check.json"
    path.write_text(json.dumps(REPORT))
    out = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/serving_check.py"), "--summary", str(path),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == summary(REPORT)
    assert not (tmp_path / "out").exists()
