"""End-to-end time to first token: SGLang `flashinfer` vs `compact`, side by side (run on the H200).

    source scripts/gpu/setup.sh
    python3 scripts/bench_e2e.py --contexts 131072 --chunks 1024 --batches 1 \\
        --methods flashinfer,compact_budget_1.0,compact_budget_0.3 --out-dir $OUT

For each chunk size and method one server is started (Llama-3.1-8B config,
dummy weights, page 64, decode CUDA graphs on, prefill CUDA graphs off). With
`--concurrent-servers` the servers of one chunk size start at the same time on
the one GPU (each with `--mem-fraction-static 0.9` of the memory free when it
starts and its KV pool capped by `--max-total-tokens` at the largest
context x batch, so they fit side by side); they are then measured one after
another, the others idle. For each (context, batch): one warm-up request of
min(context, 16K) tokens, then `--reps` rounds of `batch` concurrent requests
with fresh random prompts (no radix-cache hits) and `max_new_tokens=1`; TTFT is
the median over rounds of the slowest request of the round (the batch's time
to first token). Dummy weights carry no attention
structure, so compact runs at fixed post-union densities (`budget`) and the
rows carry the density that applies (`--density-note`).

Rows `{"bench": "e2e", ...}` are appended to `<out-dir>/speed.json`; the
Markdown table goes to `<out-dir>/speed_e2e.md`. `speedup_vs_dense` is
against the `flashinfer` row of the same (context, chunk, batch, tp).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "gpu"))
from make_llama_config import write_model_dir  # noqa: E402
from serving_check import Server  # noqa: E402
import trace_summary  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


def method_args(method: str) -> tuple[str, list[str], float | None]:
    """(module, backend flags, density) of a method name; a `_nofinal` suffix on a compact method adds
    `--compact-dense-final-chunk off` (every chunk compact, the last included)."""
    if method.startswith("compact") and method.endswith("_nofinal"):
        module, flags, density = method_args(method.removesuffix("_nofinal"))
        return module, flags + ["--compact-dense-final-chunk", "off"], density
    if method == "flashinfer":
        return "sglang.launch_server", ["--attention-backend", "flashinfer"], 1.0
    if method.startswith("compact_budget_"):
        d = float(method.rsplit("_", 1)[1])
        return "sglang_compact.launch_server", ["--attention-backend", "compact", "--compact-selector", "budget",
                                                "--compact-density", str(d)], d
    if method == "compact_flashprefill":
        return "sglang_compact.launch_server", ["--attention-backend", "compact"], None
    raise ValueError(f"unknown method {method!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--chunks", default="1024,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--methods", default="flashinfer,compact_budget_1.0,compact_budget_0.3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-prefix-len", type=int, default=4096)
    ap.add_argument("--density-note", default="0.3 (no accuracy result yet for Llama-3.1-8B)")
    ap.add_argument("--out-dir", default=str(REPO / "docs" / "results"))
    ap.add_argument("--deadline-s", type=float, default=None, help="start no new configuration after this")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing each (context, batch), one more round with SGLang's torch profiler on for "
                         "this many forward passes, started --profile-at of the way through (0: off); the trace "
                         "summaries go to <out-dir>/profile_e2e.{md,json}")
    ap.add_argument("--profile-at", type=float, default=0.6,
                    help="fraction of the timed TTFT after which profiling starts (default 0.6)")
    ap.add_argument("--concurrent-servers", action="store_true",
                    help="start the methods' servers of a chunk size side by side (capped KV pools)")
    a = ap.parse_args()
    t_start = time.time()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = write_model_dir("/tmp/llama-3.1-8b-dummy", "llama-3.1-8b", a.layers)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    contexts, chunks, batches = ints(a.contexts), ints(a.chunks), ints(a.batches)
    methods = [m for m in a.methods.split(",") if m]
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cmd = "python3 scripts/bench_e2e.py " + " ".join(sys.argv[1:])
    rng = random.Random(0)
    rows = []
    total = len(chunks) * len(methods) * len(contexts) * len(batches)
    bar = tqdm(total=total, desc="e2e") if tqdm else None
    pool_tokens = max(contexts) * max(batches) + 4096
    context_len = min(max(contexts) + 256, 131072)  # Llama-3.1's limit; longer prompts are cut to fit

    def start(method: str, chunk: int) -> Server:
        module, flags, _ = method_args(method)
        common = ["--model-path", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
                  "--page-size", "64", "--disable-prefill-cuda-graph", "--tp", str(a.tp),
                  "--chunked-prefill-size", str(chunk), "--context-length", str(context_len),
                  "--max-running-requests", str(max(batches)), "--cuda-graph-max-bs", str(max(batches))]
        if a.concurrent_servers:
            common += ["--mem-fraction-static", "0.9", "--max-total-tokens", str(pool_tokens)]
        else:
            common += ["--mem-fraction-static", "0.85"]
        if module == "sglang_compact.launch_server":
            common += ["--compact-min-prefix-len", str(a.min_prefix_len)]
        return Server(module, common + flags, out / f"e2e_{method}_c{chunk}_tp{a.tp}.log")

    def measure(srv: Server, method: str, chunk: int) -> None:
        _, _, density = method_args(method)
        for ctx in contexts:
            for bsz in batches:
                def round_(n_tokens, n_req):
                    prompts = [[rng.randrange(1000, 120000) for _ in range(n_tokens)] for _ in range(n_req)]
                    t0 = time.time()
                    with cf.ThreadPoolExecutor(n_req) as ex:
                        list(ex.map(lambda p: srv.generate(p, 1), prompts))
                    return time.time() - t0
                round_(min(ctx, 16384), 1)  # warm-up
                n_tokens = min(ctx, context_len - 8)
                times = [round_(n_tokens, bsz) for _ in range(a.reps)]
                row = {"bench": "e2e", "gpu": gpu, "date": date, "cmd": cmd, "context": ctx, "chunk": chunk,
                       "prompt_tokens": n_tokens, "batch": bsz, "q_heads": 32 // a.tp, "kv_heads": 8 // a.tp, "tp": a.tp,
                       "layers": a.layers, "method": method, "density": density,
                       "ms": 1000 * statistics.median(times), "ms_all": [1000 * t for t in times],
                       "speedup_vs_dense": None, "overhead_frac": None, "server_start_s": round(srv.start_s, 1),
                       "density_note": None if method == "flashinfer" else a.density_note}
                rows.append(row)
                if a.profile_steps:
                    profile(srv, method, chunk, ctx, bsz, n_tokens, statistics.median(times), round_)
                print(f"{method} chunk {chunk} ctx {ctx} batch {bsz}: {row['ms']:.0f} ms (all {row['ms_all']})",
                      flush=True)
                if bar:
                    bar.update(1)

    profiles = []

    def profile(srv: Server, method: str, chunk: int, ctx: int, bsz: int, n_tokens: int, ttft_s: float,
                round_) -> None:
        """One more round, untimed, with the profiler on for a few forward passes part way through."""
        pid = f"{method}_c{chunk}_ctx{ctx}_b{bsz}"
        trace_dir = Path("/tmp/e2e_traces")
        trace_dir.mkdir(parents=True, exist_ok=True)
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(round_, n_tokens, bsz)
            time.sleep(a.profile_at * ttft_s)
            reply = srv.post("/start_profile", {"output_dir": str(trace_dir), "num_steps": a.profile_steps,
                                                "activities": ["CPU", "GPU"], "with_stack": False,
                                                "record_shapes": False, "profile_id": pid})
            fut.result()
        trace = trace_dir / f"{pid}-TP-0.trace.json.gz"
        for _ in range(60):  # the scheduler writes it when the last profiled step ends
            if trace.exists():
                break
            time.sleep(1)
        if not trace.exists():
            print(f"profile {pid}: no trace ({reply})", flush=True)
            return
        time.sleep(2)  # let the export finish
        events = trace_summary.load_trace(trace)
        # the profiler may start and stop mid-pass: count the passes from the trace itself
        steps = trace_summary.count_forward_passes(events, a.layers) or a.profile_steps + 1
        summary = trace_summary.summarize(events, steps)
        summary.update(method=method, chunk=chunk, context=ctx, batch=bsz,
                       prefix_at_start=int(a.profile_at * n_tokens))
        profiles.append(summary)
        print(trace_summary.render(summary, pid).splitlines()[2], flush=True)

    for chunk in chunks:
        if a.deadline_s and time.time() - t_start > a.deadline_s:
            print(f"deadline reached; skipping chunk {chunk}")
            continue
        if a.concurrent_servers:
            with cf.ThreadPoolExecutor(len(methods)) as ex:
                futures = {m: ex.submit(start, m, chunk) for m in methods}
            servers = {}
            for m, f in futures.items():
                try:
                    servers[m] = f.result()
                except Exception as e:  # noqa: BLE001
                    print(f"{m} chunk {chunk}: server failed: {e}", flush=True)
            try:
                for m in methods:
                    if m in servers and not (a.deadline_s and time.time() - t_start > a.deadline_s):
                        measure(servers[m], m, chunk)
            finally:
                for srv in servers.values():
                    srv.stop()
            continue
        for method in methods:
            if a.deadline_s and time.time() - t_start > a.deadline_s:
                print(f"deadline reached; skipping chunk {chunk} {method}")
                continue
            srv = start(method, chunk)
            try:
                measure(srv, method, chunk)
            finally:
                srv.stop()
    for r in rows:
        base = [x for x in rows if x["method"] == "flashinfer" and all(
            x[k] == r[k] for k in ("context", "chunk", "batch", "tp"))]
        if base:
            r["speedup_vs_dense"] = base[0]["ms"] / r["ms"]
    path = out / "speed.json"
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(old + rows, indent=1))
    lines = [f"# End-to-end TTFT ({gpu}, {date})", "", f"Command: `{cmd}`", "",
             "| context | chunk | batch | tp | method | density | TTFT ms (median) | speedup vs flashinfer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = f"{r['speedup_vs_dense']:.2f}" if r["speedup_vs_dense"] else ""
        dens = "" if r["density"] is None else f"{r['density']:.2f}"
        lines.append(f"| {r['context']} | {r['chunk']} | {r['batch']} | {r['tp']} | {r['method']} | {dens} | "
                     f"{r['ms']:.0f} | {sp} |")
    (out / "speed_e2e.md").write_text("\n".join(lines) + "\n")
    if profiles:
        (out / "profile_e2e.json").write_text(json.dumps(profiles, indent=1))
        md = [f"# E2E forward-pass profiles ({gpu}, {date})", "", f"Command: `{cmd}`", "",
              f"SGLang's torch profiler asked for {a.profile_steps} forward passes, started "
              f"{a.profile_at:.0%} of the way through a prompt; per-step figures divide by the forward passes "
              f"the trace holds (paged attention kernel calls / {a.layers} layers).", ""]
        for p in profiles:
            md.append(trace_summary.render(p, f"{p['method']} chunk {p['chunk']} context {p['context']} "
                                              f"batch {p['batch']} (prefix ~{p['prefix_at_start']})"))
        (out / "profile_e2e.md").write_text("\n".join(md) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
