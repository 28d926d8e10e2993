"""Paired comparison of two methods' scored predictions (`harness.eval.paired`, `eval_longctx.py paired`)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from harness.eval.paired import load_scores, merge_predictions, paired_difference

REPO_ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, scores: dict) -> Path:
    with open(path, "w") as f:
        for (task, length, index), s in scores.items():
            f.write(json.dumps({"task": task, "length": length, "index": index, "seed": 0, "score": s,
                                "pred": "x"}) + "\n")
    return path


def test_paired_difference_is_task_balanced_and_its_interval_covers_it(tmp_path):
    rng = random.Random(1)
    a, b = {}, {}
    for i in range(25):
        a[("t1", 2048, i)] = float(rng.random() < 0.5)
        b[("t1", 2048, i)] = a[("t1", 2048, i)]              # no change on t1
    for i in range(5):                                       # t2 has 5 prompts: weighs as much as t1
        a[("t2", 2048, i)], b[("t2", 2048, i)] = 0.0, 1.0
    a[("t1", 4096, 0)] = 1.0                                 # other lengths and unpaired prompts are ignored
    b[("t3", 2048, 0)] = 1.0
    A, B = load_scores(write(tmp_path / "a.jsonl", a)), load_scores(write(tmp_path / "b.jsonl", b))
    r = paired_difference(A, B, 2048, n_boot=500)
    assert r.tasks == ["t1", "t2"] and r.n_per_task == {"t1": 25, "t2": 5}
    assert r.diff == pytest.approx(50.0)  # (0 + 100) / 2
    assert r.ci_low == pytest.approx(50.0) and r.ci_high == pytest.approx(50.0)  # every resample: t1 0, t2 +100
    assert r.per_task["t2"] == (0.0, 100.0)
    with pytest.raises(ValueError, match="t3"):
        paired_difference(A, B, 2048, tasks=["t1", "t3"])


def test_noise_gives_an_interval_around_zero():
    rng = random.Random(7)
    a = {("t", 8192, 0, i): float(rng.random() < 0.5) for i in range(200)}
    b = {k: (v if rng.random() < 0.8 else 1.0 - v) for k, v in a.items()}  # 20% of prompts flip either way
    r = paired_difference(a, b, 8192, n_boot=1000)
    assert r.ci_low < r.diff < r.ci_high and r.ci_low < 0 < r.ci_high
    assert r.ci_high - r.ci_low < 20


def test_cli(tmp_path):
    a = write(tmp_path / "dense.jsonl", {("t1", 2048, i): 1.0 for i in range(4)})
    b = write(tmp_path / "compact.jsonl", {("t1", 2048, i): float(i % 2) for i in range(4)})
    r = subprocess.run([sys.executable, "scripts/eval_longctx.py", "paired", str(a), str(b), "--length", "2048"],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "compact - dense, 2048 tokens" in r.stdout and "= -50.00 points" in r.stdout
    assert "| t1 | 4 | 100.0 | 50.0 | -50.0 |" in r.stdout
    r = subprocess.run([sys.executable, "scripts/eval_longctx.py", "paired", str(a), str(b), "--length", "4096"],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 1 and "no prompts of length 4096" in r.stderr


def write_run(run: Path, name: str, records: list[tuple[str, int, float, str]]) -> None:
    """records: (task, index, score, answer) at 32512 tokens, seed 0, as accuracy_h200.py writes them."""
    (run / "preds").mkdir(parents=True, exist_ok=True)
    with open(run / "preds" / name, "w") as f:
        for task, index, score, answer in records:
            f.write(json.dumps({"task": task, "length": 32512, "index": index, "seed": 0, "score": score,
                                "answers": [answer], "num_tokens": 32400 + index, "pred": answer}) + "\n")


def test_merge_joins_calls_by_method_and_refuses_what_cannot_pair(tmp_path):
    # call 1: dense and a compact method on cell mk; call 2: the compact method on cell mv, dense on mv
    write_run(tmp_path / "call1", "dense.jsonl", [("mk", i, 1.0, f"a{i}") for i in range(4)])
    write_run(tmp_path / "call1", "compact.jsonl", [("mk", i, float(i % 2), f"a{i}") for i in range(4)])
    write_run(tmp_path / "call2", "dense.jsonl", [("mv", i, 1.0, f"b{i}") for i in range(4)])
    write_run(tmp_path / "call2", "compact.jsonl", [("mv", i, 1.0, f"b{i}") for i in range(4)])
    r = subprocess.run([sys.executable, "scripts/eval_longctx.py", "merge", str(tmp_path / "m"),
                        str(tmp_path / "call1"), str(tmp_path / "call2")],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    merged = [json.loads(x) for x in (tmp_path / "m" / "compact.jsonl").read_text().splitlines()]
    assert [(x["task"], x["run"]) for x in merged][::4] == [("mk", "call1"), ("mv", "call2")]
    A, B = load_scores(tmp_path / "m" / "dense.jsonl"), load_scores(tmp_path / "m" / "compact.jsonl")
    assert paired_difference(A, B, 32512, n_boot=200).per_task == {"mk": (100.0, 50.0), "mv": (100.0, 100.0)}
    # the same method scoring a prompt in two calls: which one counts is not ours to pick
    write_run(tmp_path / "call3", "compact.jsonl", [("mv", 0, 0.0, "b0")])
    with pytest.raises(ValueError, match="scored in both call2 and call3"):
        merge_predictions([tmp_path / "call1", tmp_path / "call2", tmp_path / "call3"], tmp_path / "m2")
    # a different prompt under the same key (another seed or generator): nothing pairs, nothing is written
    write_run(tmp_path / "call4", "other.jsonl", [("mk", 1, 1.0, "zz")])
    with pytest.raises(ValueError, match="not the same prompts"):
        merge_predictions([tmp_path / "call1", tmp_path / "call4"], tmp_path / "m3")
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m3").exists()


def test_paired_with_several_methods_prints_a_summary_first(tmp_path):
    a = write(tmp_path / "dense.jsonl", {("t1", 2048, i): 1.0 for i in range(4)})
    b = write(tmp_path / "half.jsonl", {("t1", 2048, i): float(i % 2) for i in range(4)})
    c = write(tmp_path / "same.jsonl", {("t1", 2048, i): 1.0 for i in range(4)})
    r = subprocess.run([sys.executable, "scripts/eval_longctx.py", "paired", str(a), str(b), str(c),
                        "--length", "2048"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("| method (B) |")
    assert "| half | t1 | 4 | 100.0 | 50.0 | -50.0 |" in lines[2]
    assert lines[3] == "| same | t1 | 4 | 100.0 | 100.0 | +0.0 | [+0.0, +0.0] |"
    assert "half - dense, 2048 tokens" in r.stdout and "same - dense, 2048 tokens" in r.stdout
