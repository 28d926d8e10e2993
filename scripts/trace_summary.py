"""Summarise a torch-profiler Chrome trace (what SGLang's `/start_profile` writes): is the forward
pass GPU-bound or host-bound, and where does the time go.

    python scripts/trace_summary.py TRACE.json[.gz] [--steps N | --layers L] [--json OUT.json]

Figures (milliseconds; per step = divided by the forward passes the trace holds: --steps, or counted as
the calls of the once-per-layer paged attention kernel over --layers):
  span       first GPU kernel start -> last kernel end (CPU-only traces: first -> last CPU op)
  gpu_busy   union of the kernel / memcpy / memset intervals
  gpu_idle   span - gpu_busy: time the GPU waited for the host
  kernels    kernel launches, and the top kernels by total time
  runtime    CUDA runtime calls by total time (cudaStreamSynchronize / cudaMemcpy* D2H are host syncs)
  cpu_ops    top-level CPU ops (not nested in another op of the same thread) by total time

With --place NAME it tells instead where the host events called NAME (a CPU op or a runtime call, e.g.
`aten::to`, `cudaMemcpyAsync`) come from, in a trace taken without Python stacks: each distinct placement (the
ops it is nested in, outer first, and the top-level ops just before and after the one that holds it) with how
many times it occurs per step.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")


def load_trace(path: str | Path) -> list[dict]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def top(counter: dict[str, list[float]], k: int, steps: int) -> list[dict]:
    rows = sorted(counter.items(), key=lambda kv: -sum(kv[1]))[:k]
    return [{"name": name[:100], "calls_per_step": len(d) / steps, "ms_per_step": sum(d) / 1000 / steps}
            for name, d in rows]


def top_level(ops: list[dict]) -> list[dict]:
    """Ops not contained in an earlier op of the same (pid, tid)."""
    out = []
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        end = float("-inf")
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


ATTENTION_OP = "sglang::unified_attention_with_output"


def count_forward_passes(events: list[dict], layers: int, kernel_substring: str = "Paged") -> float:
    """Forward passes in a trace: calls of the kernel that runs once per attention layer (FlashInfer's paged
    prefill, fa2 or fa3: its name contains "Paged") divided by the model's layers; where no such kernel ran (stock
    `fa3`, `compact`'s FA3 rows), calls of SGLang's attention op, which every backend's layer goes through."""
    calls = sum(1 for e in events if e.get("cat") == "kernel" and kernel_substring in e.get("name", ""))
    if not calls:
        calls = sum(1 for e in events if e.get("cat") == "cpu_op" and e.get("name") == ATTENTION_OP)
    return calls / layers


def restep(summary: dict, steps: float) -> dict:
    """The same summary divided by another step count (e.g. one counted from the trace afterwards)."""
    f = summary["steps"] / steps
    out = dict(summary, steps=steps)
    for key in ("span_ms_per_step", "gpu_busy_ms_per_step", "kernels_per_step"):
        out[key] = summary[key] * f
    for key in ("top_kernels", "top_runtime_calls", "top_cpu_ops"):
        out[key] = [dict(r, calls_per_step=r["calls_per_step"] * f, ms_per_step=r["ms_per_step"] * f)
                    for r in summary[key]]
    return out


def summarize(events: list[dict], steps: float = 1, k: int = 12) -> dict:
    if not steps > 0:
        raise ValueError(f"steps must be > 0, got {steps}")
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATS]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    timed = gpu or cpu_ops
    if not timed:
        raise ValueError("trace holds no GPU kernels and no CPU ops")
    span = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    kernels, calls, ops = (collections.defaultdict(list) for _ in range(3))
    for e in gpu:
        kernels[e["name"]].append(e["dur"])
    for e in runtime:
        calls[e["name"]].append(e["dur"])
    for e in top_level(cpu_ops):
        ops[e["name"]].append(e["dur"])
    return {
        "steps": steps,
        "span_ms_per_step": span / 1000 / steps,
        "gpu_busy_ms_per_step": busy / 1000 / steps,
        "gpu_idle_frac": (1 - busy / span) if gpu and span > 0 else None,
        "kernels_per_step": len([e for e in gpu if e.get("cat") == "kernel"]) / steps,
        "top_kernels": top(kernels, k, steps),
        "top_runtime_calls": top(calls, 8, steps),
        "top_cpu_ops": top(ops, k, steps),
    }


HOST_CATS = ("cpu_op", "user_annotation", "python_function") + RUNTIME_CATS


def place(events: list[dict], name: str, steps: float = 1, k: int = 12) -> list[dict]:
    """Where the host events called `name` occur: one row per distinct (enclosing ops, outer first; the top-level
    op before the one that holds it; the one after), most frequent first."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATS:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    seen = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        tops = top_level(evs)
        where = {id(t): i for i, t in enumerate(tops)}
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if e["name"] == name:
                outer = stack[0] if stack else e
                i = where.get(id(outer))
                before = tops[i - 1]["name"] if i else ""
                after = tops[i + 1]["name"] if i is not None and i + 1 < len(tops) else ""
                seen[(tuple(o["name"] for o in stack), before, after)] += 1
            stack.append(e)
    return [{"inside": " > ".join(chain) or "(top level)", "after_op": before[:80], "before_op": after[:80],
             "calls_per_step": n / steps} for (chain, before, after), n in seen.most_common(k)]


def render_place(rows: list[dict], name: str) -> str:
    lines = [f"## where `{name}` is called", "", "| inside | top-level op before | top-level op after | calls/step |",
             "|---|---|---|---|"]
    lines += [f"| `{r['inside']}` | `{r['after_op']}` | `{r['before_op']}` | {r['calls_per_step']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def render(summary: dict, title: str = "") -> str:
    s = summary
    idle = "n/a (no GPU events)" if s["gpu_idle_frac"] is None else f"{100 * s['gpu_idle_frac']:.1f}%"
    lines = [f"## {title}" if title else "", "",
             f"per step ({s['steps']:g} steps): span {s['span_ms_per_step']:.2f} ms, GPU busy "
             f"{s['gpu_busy_ms_per_step']:.2f} ms, GPU idle {idle}, {s['kernels_per_step']:.0f} kernels", ""]
    for key, head in (("top_kernels", "kernel"), ("top_runtime_calls", "runtime call"), ("top_cpu_ops", "CPU op")):
        if not s[key]:
            continue
        lines += [f"| {head} | calls/step | ms/step |", "|---|---|---|"]
        lines += [f"| `{r['name']}` | {r['calls_per_step']:.1f} | {r['ms_per_step']:.3f} |" for r in s[key]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=float, default=None, help="forward passes in the trace (for per-step figures)")
    ap.add_argument("--layers", type=int, default=None,
                    help="count the forward passes instead: paged attention kernel calls / this many layers")
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--place", default=None, metavar="NAME",
                    help="instead: where the host events called NAME come from (enclosing and neighbouring ops)")
    a = ap.parse_args(argv)
    try:
        events = load_trace(a.trace)
        steps = a.steps if a.steps else (count_forward_passes(events, a.layers) if a.layers else 1)
        if not steps:
            raise ValueError(f"no paged attention kernel and no attention op to count passes by "
                             f"(--layers {a.layers}): give --steps")
        if a.place:
            print(render_place(place(events, a.place, steps), a.place))
            return 0
        s = summarize(events, steps)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {a.trace}: {e}", file=sys.stderr)
        return 2
    print(render(s, Path(a.trace).name))
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
