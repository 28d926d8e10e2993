#!/usr/bin/env python3
"""Per-layer selection density of a real model on the real server: which layers read how much of their context.

Starts `python -m sglang_compact.launch_server` (CPU or GPU) with `--enable-metrics` and, by default,
`--compact-dense-above 1` (no observed-density fallback, so every layer of a sparse pass selects and is measured),
sends each prompt alone, and after each reads `sglang:compact_density{layer=...}` from `/metrics`: the pages the
sparse rows of that layer read over their context pages, in the prompt's last sparse forward pass. Writes
`<out-dir>/<name>.json` (every prompt's per-layer densities) and `<name>.md` (per layer: mean, min, max over the
prompts), which is the evidence for per-layer choices (the first layer reading nearly everything, say).

    python3 scripts/layer_density.py --model-path MODEL_DIR --lengths 1200 --prompts 4 --page-size 16 \\
        --chunk 128 --min-context 256 --dense-tail 64 --out-dir /tmp/ld                 (CPU, SmolLM2)
    python3 scripts/layer_density.py --model-path /tmp/qwen --device cuda --dtype bfloat16 --lengths 16384,32512 \\
        --prompts 6 --page-size 32 --chunk 1024 --min-context 4096 --out-dir $OUT/ld      (GPU host)

Prompts: `--source suite` (default) takes the accuracy suite's haystack prompts (`harness/eval/tasks.py`, the
model's tokenizer and chat template), cycling through `--tasks`; `--source random` sends uniform random token ids
(no tokenizer; attention on them is unlike text's)."""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.eval.client import parse_density_counters  # noqa: E402
from harness.server import SGLangServer  # noqa: E402

DENSITY = "sglang:compact_density"


def layer_densities(metrics_text: str) -> dict[int, float]:
    """layer -> value of the per-layer density gauge (mean over the series of a layer, e.g. TP ranks)."""
    per: dict[int, list[float]] = {}
    for line in metrics_text.splitlines():
        m = re.match(r"^" + re.escape(DENSITY) + r"\{(.*)\}\s+(\S+)$", line)
        if not m:
            continue
        layer = re.search(r'(?:^|,)layer="(\d+)"', m.group(1))
        if layer:
            per.setdefault(int(layer.group(1)), []).append(float(m.group(2)))
    return {k: sum(v) / len(v) for k, v in sorted(per.items())}


def make_prompts(a) -> list[tuple[str, list[int]]]:
    """(label, token ids) per prompt: `--prompts` per length."""
    lengths = [int(x) for x in a.lengths.split(",")]
    out = []
    if a.source == "random":
        rng = random.Random(a.seed)
        for L in lengths:
            out += [(f"random {L} #{i}", [rng.randrange(*a.random_ids) for _ in range(L)]) for i in range(a.prompts)]
        return out
    from harness.eval.tasks import load_tokenizer, make_sample

    tok = load_tokenizer(a.model_path)
    tasks = a.tasks.split(",")
    for L in lengths:
        for i in range(a.prompts):
            s = make_sample(tasks[i % len(tasks)], L, i, tok, seed=a.seed)
            out.append((f"{s.task} {L} #{i}", s.input_ids))
    return out


def summarise(rows: list[dict]) -> list[dict]:
    layers = sorted({int(k) for r in rows for k in r["per_layer"]})
    out = []
    for layer in layers:
        vals = [r["per_layer"][str(layer)] for r in rows if str(layer) in r["per_layer"]]
        out.append({"layer": layer, "mean": statistics.fmean(vals), "min": min(vals), "max": max(vals),
                    "prompts": len(vals)})
    return out


def markdown(a, rows: list[dict], table: list[dict], cmd: str) -> str:
    lines = [f"# Per-layer selection density: {Path(a.model_path).name}", "",
             f"Command: `{cmd}`", "",
             f"{len(rows)} prompts ({a.source}), lengths {a.lengths}, page {a.page_size}, chunk {a.chunk}; server flags "
             f"`{' '.join(server_flags(a))}`. Density: pages a layer's sparse rows read over their context pages, in "
             f"each prompt's last sparse forward pass (`{DENSITY}`); prompts without a sparse pass are left out "
             f"({sum(not r['per_layer'] for r in rows)} here).", "",
             "| layer | mean | min | max | prompts |", "|---|---|---|---|---|"]
    lines += [f"| {t['layer']} | {t['mean']:.3f} | {t['min']:.3f} | {t['max']:.3f} | {t['prompts']} |" for t in table]
    if table:
        rest = [t["mean"] for t in table[1:]]
        lines += ["", f"Layer 0: {table[0]['mean']:.3f}; the other layers: mean {statistics.fmean(rest):.3f}, "
                      f"{min(rest):.3f}-{max(rest):.3f}." if rest else ""]
    return "\n".join(lines) + "\n"


def server_flags(a) -> list[str]:
    flags = ["--attention-backend", "compact", "--enable-metrics", "--compact-dense-above", a.dense_above,
             "--compact-dense-tail", str(a.dense_tail)]
    if a.min_context is not None:
        flags += ["--compact-min-context", str(a.min_context)]
    return flags + a.extra_args.split()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, the model's on the GPU")
    ap.add_argument("--lengths", default="1200", help="prompt lengths in tokens, comma separated")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per length")
    ap.add_argument("--source", choices=("suite", "random"), default="suite")
    ap.add_argument("--tasks", default="story_single,niah_single_number,niah_multikey",
                    help="suite tasks the prompts cycle through")
    ap.add_argument("--random-ids", type=int, nargs=2, default=(200, 40000), metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=128, help="--chunked-prefill-size")
    ap.add_argument("--min-context", type=int, default=None, help="--compact-min-context (default: the server's)")
    ap.add_argument("--dense-tail", type=int, default=64, help="--compact-dense-tail")
    ap.add_argument("--dense-above", default="1", help="--compact-dense-above (default 1: every layer selects)")
    ap.add_argument("--extra-args", default="", help="more server flags, e.g. '--compact-selector budget'")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="default: the longest prompt + 1024")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--name", default="layer_density")
    a = ap.parse_args(argv)
    cmd = "python3 scripts/layer_density.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(a)
    longest = max(len(ids) for _, ids in prompts)
    dtype = a.dtype or ("float32" if a.device == "cpu" else None)
    srv = SGLangServer(a.model_path, module="sglang_compact.launch_server", device=a.device, dtype=dtype,
                       page_size=a.page_size, chunked_prefill_size=a.chunk,
                       max_total_tokens=a.max_total_tokens or longest + 1024, max_running_requests=2,
                       extra_args=server_flags(a), start_timeout=a.start_timeout,
                       log_path=out / f"{a.name}_server.log", cwd=REPO)
    rows = []
    with srv:
        for label, ids in prompts:
            before = parse_density_counters(srv.metrics()) or (0.0, 0.0)
            srv.generate(input_ids=ids, max_new_tokens=1)
            text = srv.metrics()
            went_sparse = (parse_density_counters(text) or (0.0, 0.0))[1] > before[1]   # sparse passes counted
            per = layer_densities(text) if went_sparse else {}
            rows.append({"prompt": label, "tokens": len(ids), "per_layer": {str(k): v for k, v in per.items()}})
            print(f"{label}: {len(ids)} tokens, " + (f"layers {min(per)}-{max(per)}: "
                  f"{' '.join(f'{v:.2f}' for v in per.values())}" if per else "no sparse pass"), flush=True)
            srv.flush_cache()
    table = summarise([r for r in rows if r["per_layer"]])
    (out / f"{a.name}.json").write_text(json.dumps({"cmd": cmd, "server_flags": server_flags(a), "prompts": rows,
                                                     "per_layer": table}, indent=1) + "\n")
    (out / f"{a.name}.md").write_text(markdown(a, rows, table, cmd))
    print(f"wrote {out / (a.name + '.md')} and .json ({len(table)} layers)")
    return 0 if table else 1


if __name__ == "__main__":
    sys.exit(main())
