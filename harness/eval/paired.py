"""Paired comparison of two methods on the same prompts, from their scored-prediction JSONL files.

Every accuracy run writes one JSON record per prompt (`task`, `length`, `index`, `seed`, `score`, ...):
`scripts/gpu/accuracy_h200.py` under `preds/`, `scripts/eval_longctx.py accuracy` under its `--out-dir`. Two
methods run on the same seed see the same prompts, so their difference can be measured prompt by prompt, which
removes the prompts' own difficulty from the noise. The averages here weigh the tasks equally, as the reports do
(mean over tasks of the per-task mean score, in percent); the confidence interval is a bootstrap that resamples
prompts within each task.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

Key = tuple[str, int, int, int]  # task, length, seed, index


def prompt_key(record: dict) -> Key:
    """A scored record's prompt: (task, length, seed, index); records from before seeds were kept: seed 0."""
    return record["task"], int(record["length"]), int(record.get("seed", 0)), int(record["index"])


def load_scores(path: str | Path) -> dict[Key, float]:
    """(task, length, seed, index) -> score in [0, 1]; a prompt seen twice keeps its last record."""
    out: dict[Key, float] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            out[prompt_key(r)] = float(r["score"])
    return out


@dataclass
class PairedResult:
    length: int
    tasks: list[str]
    n_per_task: dict[str, int]
    mean_a: float                  # task-balanced mean score of A, percent
    mean_b: float
    diff: float                    # mean_b - mean_a, percent
    ci_low: float                  # bootstrap interval of diff (percent)
    ci_high: float
    per_task: dict[str, tuple[float, float]] = field(default_factory=dict)  # task -> (A, B) percent


def _task_means(per_task_pairs: dict[str, list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """task -> (A, B) mean score, as a fraction."""
    return {t: (sum(x for x, _ in v) / len(v), sum(y for _, y in v) / len(v)) for t, v in per_task_pairs.items()}


def _balanced(per_task_pairs: dict[str, list[tuple[float, float]]]) -> tuple[float, float]:
    """(A, B) mean over tasks of the per-task means, in percent."""
    means = _task_means(per_task_pairs).values()
    return 100 * (sum(a for a, _ in means) / len(means)), 100 * (sum(b for _, b in means) / len(means))


def paired_difference(a: dict[Key, float], b: dict[Key, float], length: int, tasks: Iterable[str] | None = None,
                      n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> PairedResult:
    """B - A on the prompts of `length` both have (tasks: those given, else every task both have)."""
    common = sorted(set(a) & set(b))
    by_task: dict[str, list[tuple[float, float]]] = {}
    wanted = None if tasks is None else set(tasks)
    for k in common:
        task, L = k[0], k[1]
        if L == length and (wanted is None or task in wanted):
            by_task.setdefault(task, []).append((a[k], b[k]))
    if wanted is not None and set(by_task) != wanted:
        missing = sorted(wanted - set(by_task))
        raise ValueError(f"no prompts of length {length} that both files score for task(s) {missing}")
    if not by_task:
        raise ValueError(f"no prompts of length {length} in both files")
    mean_a, mean_b = _balanced(by_task)
    rng = random.Random(seed)
    diffs = []
    for _ in range(n_boot):
        sample = {t: [v[rng.randrange(len(v))] for _ in v] for t, v in by_task.items()}
        x, y = _balanced(sample)
        diffs.append(y - x)
    diffs.sort()
    lo = diffs[int((1 - level) / 2 * (n_boot - 1))]
    hi = diffs[int((1 + level) / 2 * (n_boot - 1))]
    per_task = {t: (100 * a, 100 * b) for t, (a, b) in sorted(_task_means(by_task).items())}
    return PairedResult(length, sorted(by_task), {t: len(v) for t, v in sorted(by_task.items())}, mean_a, mean_b,
                        mean_b - mean_a, lo, hi, per_task)


def paired_markdown(r: PairedResult, name_a: str, name_b: str) -> str:
    lines = [f"{name_b} - {name_a}, {r.length} tokens, tasks weighed equally: "
             f"{r.mean_b:.2f} - {r.mean_a:.2f} = {r.diff:+.2f} points, 95% bootstrap interval "
             f"[{r.ci_low:+.1f}, {r.ci_high:+.1f}] (prompts resampled within each task)", "",
             f"| task | n | {name_a} | {name_b} | difference |", "| --- | --- | --- | --- | --- |"]
    for t, (x, y) in r.per_task.items():
        lines.append(f"| {t} | {r.n_per_task[t]} | {x:.1f} | {y:.1f} | {y - x:+.1f} |")
    return "\n".join(lines) + "\n"


def paired_summary(rows: Sequence[tuple[str, PairedResult]], name_a: str) -> str:
    """One line per method B against the same A: its tasks, n, the difference and its interval."""
    lines = [f"| method (B) | tasks | n per task | {name_a} | B | B - {name_a} | 95% interval |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows:
        n = sorted(set(r.n_per_task.values()))
        lines.append(f"| {name} | {', '.join(r.tasks)} | {'/'.join(map(str, n))} | {r.mean_a:.1f} | {r.mean_b:.1f} | "
                     f"{r.diff:+.1f} | [{r.ci_low:+.1f}, {r.ci_high:+.1f}] |")
    return "\n".join(lines) + "\n"


def main_paired(path_a: str, paths_b: str | Sequence[str], length: int, tasks: Sequence[str] | None,
                n_boot: int) -> str:
    """B - A for each B; with several Bs a summary table comes first, then each B's per-task table."""
    if isinstance(paths_b, (str, Path)):
        paths_b = [paths_b]
    a = load_scores(path_a)
    rows = [(Path(b).stem, paired_difference(a, load_scores(b), length, tasks, n_boot=n_boot)) for b in paths_b]
    parts = [paired_markdown(r, Path(path_a).stem, name) for name, r in rows]
    if len(rows) > 1:
        parts.insert(0, paired_summary(rows, Path(path_a).stem))
    return "\n".join(parts)


def _prompt_identity(r: dict) -> tuple:
    """What makes two records the same prompt: the generator's answers and the prompt's token count."""
    return tuple(r.get("answers") or ()), r.get("num_tokens")


def merge_predictions(run_dirs: Sequence[str | Path], out_dir: str | Path) -> dict[str, int]:
    """Concatenate the scored predictions of several runs, method by method (file name), into `out_dir`.

    A suite that does not fit one GPU-host call runs as several calls on the same seed, each covering some cells
    and some methods; paired comparisons need them side by side. Each record gains `run` (its folder's name).
    Refused (ValueError, nothing written): a prompt that one method scored in two runs, or two records of one
    prompt key that are different prompts (answers or token count differ), which means the seeds or generator
    differed and nothing is paired. Returns file name -> records written.
    """
    merged: dict[str, dict[Key, dict]] = {}
    identity: dict[Key, tuple[tuple, str]] = {}
    for run in map(Path, run_dirs):
        preds = run / "preds" if (run / "preds").is_dir() else run
        files = sorted(preds.glob("*.jsonl"))
        if not files:
            raise ValueError(f"{run}: no scored predictions (*.jsonl in it or in its preds/)")
        for f in files:
            seen = merged.setdefault(f.name, {})
            for line in f.read_text().splitlines():
                if not line.strip():
                    continue
                r = json.loads(line)
                key = prompt_key(r)
                if key in seen and seen[key]["run"] != run.name:
                    raise ValueError(f"{f.name}: prompt {key} is scored in both {seen[key]['run']} and {run.name}")
                ident = _prompt_identity(r)
                if key in identity and identity[key][0] != ident:
                    raise ValueError(f"prompt {key} differs between {identity[key][1]} and {run.name}/{f.name} "
                                     f"(answers or token count): not the same prompts, nothing to pair")
                identity.setdefault(key, (ident, f"{run.name}/{f.name}"))
                r["run"] = run.name
                seen[key] = r  # within one run the last record of a prompt stands, as in load_scores
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, records in merged.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    return {name: len(records) for name, records in sorted(merged.items())}
