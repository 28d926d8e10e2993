"""An accuracy.json (rows appended by every run; the repository's is `docs/results/accuracy.json`) -> the
`accuracy.md` table and `accuracy.png` beside it. Every function takes the path it reads or writes."""

from __future__ import annotations

import json
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

ROW_KEYS = ("model", "task", "length", "method", "params", "n", "accuracy", "density", "date", "device")


def load_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = json.loads(path.read_text() or "[]")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows")
    return data


def append_rows(rows: Iterable[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    rows = list(rows)
    for r in rows:
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"row lacks {missing}: {r}")
    all_rows = load_rows(path) + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(all_rows, indent=1) + "\n")
    return all_rows


def params_label(params: dict[str, Any] | None) -> str:
    if not params:
        return ""
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items()))


def _seed(r: dict[str, Any]) -> int:
    """The prompts' seed (rows without one: seed 0)."""
    return int(r.get("seed", 0))


def _key(r: dict[str, Any]) -> tuple:
    label = params_label(r.get("params"))
    if _seed(r):   # another seed's prompts: a group of its own
        label = f"{label}, seed={_seed(r)}" if label else f"seed={_seed(r)}"
    return (r["model"], int(r["length"]), r["method"], label, r["device"])


def latest(rows: list[dict[str, Any]]) -> "OrderedDict[tuple, dict[str, dict]]":
    """(model, length, method, params, device) -> task -> the latest row (file order)."""
    out: "OrderedDict[tuple, dict[str, dict]]" = OrderedDict()
    for r in rows:
        out.setdefault(_key(r), {})[r["task"]] = r
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


MIN_N = 25               # rows with fewer prompts are smoke runs: not compared
NEAR_CHANCE_PCT = 10.0   # a task where the dense reference scores below this is named and left out


@dataclass
class Comparison:
    """One method's rows against the dense reference on the same model, length, device, tasks and prompt count."""
    model: str
    length: int
    method: str
    params: str
    device: str
    tasks: list[str]
    n: list[int]
    dense_n: list[int]         # the reference rows' prompt counts (differ from `n` only where dense lacks that n)
    avg: float                 # mean over `tasks` of the method's accuracy (tasks weighed equally)
    dense_avg: float           # the same for the dense reference rows of the same tasks and n
    density: float | None

    @property
    def diff(self) -> float:
        return self.avg - self.dense_avg


def _chunk(r: dict[str, Any]) -> Any:
    return (r.get("params") or {}).get("chunk")


def _runner(r: dict[str, Any]) -> str:
    return (r.get("params") or {}).get("runner", "server")


def compare_to_dense(rows: list[dict[str, Any]], min_n: int = MIN_N, chance: float = NEAR_CHANCE_PCT
                     ) -> tuple[list[Comparison], dict[tuple, list[str]]]:
    """Every non-dense method against dense, task by task on the tasks both have.

    The reference for a method's row is the latest dense row of the same model, length, device and task, from
    the same runner when there is one (the HF runner's dense for HF rows) else the server's, and with the same
    `n` when there is one: runs of one seed share their first prompts, so equal `n` means the same prompts; and
    always of the same seed (`seed`, absent for 0). Among those, a dense row of the same chunk size
    (`params["chunk"]`) comes first: another chunk size is the same attention, but not the same kernels' rounding.
    Rows with `n < min_n` are left out. Returns the comparisons and, per (model, length, device), the tasks
    left out because the dense reference is near chance there (below `chance` percent)."""
    dense: dict[tuple, dict] = {}
    for r in rows:
        if r["method"] == "dense" and r["n"] >= min_n:
            base = (r["model"], int(r["length"]), r["device"], _runner(r), r["task"], _seed(r))
            for chunk in (_chunk(r), None):
                dense[base + (chunk, r["n"])] = r
                dense[base + (chunk, None)] = r
    near_chance: dict[tuple, list[str]] = {}
    for key, r in dense.items():
        if key[-2:] == (None, None) and r["accuracy"] < chance:
            near_chance.setdefault(key[:3], []).append(r["task"])

    def reference(r: dict[str, Any]) -> dict | None:
        for runner in dict.fromkeys((_runner(r), "server")):
            base = (r["model"], int(r["length"]), r["device"], runner, r["task"], _seed(r))
            for tail in ((_chunk(r), r["n"]), (None, r["n"]), (_chunk(r), None), (None, None)):
                ref = dense.get(base + tail)
                if ref is not None:
                    return ref
        return None

    out = []
    for k, g in latest(rows).items():
        if k[2] == "dense":
            continue
        skip = set(near_chance.get((k[0], k[1], k[4]), []))
        pairs = [(t, r, reference(r)) for t, r in g.items() if r["n"] >= min_n and t not in skip]
        pairs = [(t, r, ref) for t, r, ref in pairs if ref is not None]
        if not pairs:
            continue
        out.append(Comparison(model=k[0], length=k[1], method=k[2], params=k[3], device=k[4],
                              tasks=[t for t, _, _ in pairs], n=sorted({r["n"] for _, r, _ in pairs}),
                              dense_n=sorted({ref["n"] for _, _, ref in pairs}),
                              avg=_mean([r["accuracy"] for _, r, _ in pairs]),
                              dense_avg=_mean([ref["accuracy"] for _, _, ref in pairs]),
                              density=_mean([r.get("density") for _, r, _ in pairs])))
    return out, {k: sorted(v) for k, v in near_chance.items()}


def render_comparison(rows: list[dict[str, Any]]) -> list[str]:
    comps, near_chance = compare_to_dense(rows)
    if not comps:
        return []
    lines = ["## Against dense on the same tasks and prompts", "",
             f"Each method minus the dense reference, both averaged over the same tasks (weighed equally) with "
             f"the same number of prompts `n` where dense has it (one seed: equal `n` means the same prompts; "
             f"`dense n` shows where it differs). Rows with n < {MIN_N} "
             f"are left out, and so are tasks where dense scores below {NEAR_CHANCE_PCT:.0f}% (near chance, named "
             f"under each table). HF-runner rows are compared with the HF runner's dense where there is one, "
             f"else with the server's.", ""]
    for model in OrderedDict((c.model, None) for c in comps):
        for length in sorted({c.length for c in comps if c.model == model}):
            sel = [c for c in comps if c.model == model and c.length == length]
            lines += [f"### {model}, {length} tokens", "",
                      "| method | params | device | n | density | tasks | avg | dense, same tasks | dense n | "
                      "difference |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
            for c in sel:
                lines.append(f"| {c.method} | {c.params} | {c.device} | {'/'.join(map(str, c.n))} | "
                             f"{'' if c.density is None else f'{c.density:.3f}'} | {len(c.tasks)} | {c.avg:.1f} | "
                             f"{c.dense_avg:.1f} | {'/'.join(map(str, c.dense_n))} | {c.diff:+.2f} |")
            left = [f"{dev}: {', '.join(ts)}" for (m, L, dev), ts in sorted(near_chance.items())
                    if m == model and L == length]
            lines += [""] + ([f"Left out (dense near chance): {'; '.join(left)}.", ""] if left else [])
    return lines


def render_markdown(rows: list[dict[str, Any]]) -> str:
    groups = latest(rows)
    tasks: list[str] = []
    for g in groups.values():
        for t in g:
            if t not in tasks:
                tasks.append(t)
    lines = ["# Long-context accuracy (RULER-style, our generator)", "",
             "Generated by `python scripts/eval_longctx.py report` from `accuracy.json` (the latest row per "
             "model, length, method, params, device and task). Accuracy: RULER string match (% of expected "
             "answers found in the greedy output), mean over `n` samples. Density: pages the sparse windows read "
             "over their context pages on the compact path (rows with `min_prefix_len` in their params come from "
             "the earlier design: the post-union fraction of prefix blocks read), mean over tasks (each row's "
             "`density_source` in "
             "accuracy.json says where it came from: the server's `/metrics` (`--enable-metrics`), an offline "
             "replay of chunked prefill with HF q/k/v on the same prompts, or the HF runner); empty for dense. "
             "`runner=hf` rows are generated in-process by `harness.eval.hf_runner` (HF transformers, "
             "chunked sparse prefill), not by SGLang.", ""]
    for model in OrderedDict((k[0], None) for k in groups):
        for length in sorted({k[1] for k in groups if k[0] == model}):
            lines += [f"## {model}, {length} tokens", "",
                      "| method | params | device | n | density | " + " | ".join(tasks) + " | avg |",
                      "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in tasks) + " | --- |"]
            for k, g in groups.items():
                if k[0] != model or k[1] != length:
                    continue
                accs = [g[t]["accuracy"] if t in g else None for t in tasks]
                dens = _mean([g[t].get("density") for t in g])
                n = sorted({g[t]["n"] for t in g})
                cells = [f"{a:.1f}" if a is not None else "" for a in accs]
                avg = _mean(accs)
                lines.append(f"| {k[2]} | {k[3]} | {k[4]} | {'/'.join(map(str, n))} | "
                             f"{'' if dens is None else f'{dens:.3f}'} | " + " | ".join(cells)
                             + f" | {'' if avg is None else f'{avg:.1f}'} |")
            lines.append("")
    lines += render_comparison(rows)
    dates = sorted({r["date"] for r in rows})
    if dates:
        lines.append(f"Runs dated {dates[0]} .. {dates[-1]}.")
    return "\n".join(lines) + "\n"


def render_plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Accuracy minus dense (same tasks and prompts, `compare_to_dense`) vs density; False (with a message)
    when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping {path.name} (pip install matplotlib)", file=sys.stderr)
        return False
    comps, _ = compare_to_dense(rows)
    fig, ax = plt.subplots(figsize=(11.0, 5.5))
    series: dict[tuple, list[tuple[float, float]]] = {}
    for c in comps:
        if c.density is None:
            continue
        variant = " dense-final" if "dense_final_chunk=1" in c.params else ""   # rows of the earlier design
        tail = re.search(r"\bdense_tail=(\d+)", c.params)
        variant += f" dense-tail {tail.group(1)}" if tail and tail.group(1) != "0" else ""
        variant += " (hf)" if "runner=hf" in c.params else ""
        device = "" if c.device == "h200" else f" {c.device}"
        series.setdefault((c.length, f"{c.method}{variant}{device}"), []).append((c.density, c.diff))
    lengths = sorted({L for L, _ in series})
    markers = dict(zip(lengths, "osD^v<>"))
    colors = plt.get_cmap("tab20").colors
    for i, ((length, name), pts) in enumerate(sorted(series.items())):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[length], color=colors[i % len(colors)],
                label=f"{name} @ {length}")
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axhline(-1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("density (fraction of the context pages the sparse windows read)")
    ax.set_ylabel("accuracy - dense, same tasks and prompts (points)")
    ax.set_xlim(0, 1.05)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"RULER-style accuracy against dense vs density (n >= {MIN_N})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def regenerate(json_path: Path) -> list[Path]:
    """Write `<name>.md` (the tables, then `<name>_notes.md` when it exists beside the json: the hand-written
    commands and reading of the runs) and `<name>.png`."""
    rows = load_rows(json_path)
    md = json_path.with_suffix(".md")
    text = render_markdown(rows)
    notes = json_path.with_name(json_path.stem + "_notes.md")
    if notes.is_file():
        text = text.rstrip("\n") + "\n\n" + notes.read_text()
    md.write_text(text)
    out = [md]
    png = json_path.with_suffix(".png")
    if render_plot(rows, png):
        out.append(png)
    return out
