"""End-to-end time to first token: SGLang `flashinfer` vs `compact`, side by side (run on the H200).

    source scripts/gpu/setup.sh
    python3 scripts/bench_e2e.py --contexts 131072 --chunks 1024 --batches 1 \\
        --methods flashinfer,compact_budget_1.0,compact_budget_0.3 --out-dir $OUT

For each chunk size and method one server is started (Llama-3.1-8B config,
dummy weights, page 64, decode CUDA graphs on, prefill CUDA graphs off), then
for each (context, batch): one warm-up round, then `--reps` rounds of `batch`
concurrent requests with fresh random prompts (no radix-cache hits) and
`max_new_tokens=1`; TTFT is the median over rounds of the slowest request of
the round (the batch's time to first token). Dummy weights carry no attention
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

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


def method_args(method: str) -> tuple[str, list[str], float | None]:
    """(module, backend flags, density) of a method name."""
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
    for chunk in chunks:
        for method in methods:
            if a.deadline_s and time.time() - t_start > a.deadline_s:
                print(f"deadline reached; skipping chunk {chunk} {method}")
                continue
            module, flags, density = method_args(method)
            common = ["--model-path", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
                      "--page-size", "64", "--disable-prefill-cuda-graph", "--mem-fraction-static", "0.85",
                      "--tp", str(a.tp), "--chunked-prefill-size", str(chunk), "--context-length",
                      str(max(contexts) + 256), "--max-running-requests", str(max(batches))]
            if module == "sglang_compact.launch_server":
                common += ["--compact-min-prefix-len", str(a.min_prefix_len)]
            log = out / f"e2e_{method}_c{chunk}_tp{a.tp}.log"
            srv = Server(module, common + flags, log)
            try:
                for ctx in contexts:
                    for bsz in batches:
                        def round_():
                            prompts = [[rng.randrange(1000, 120000) for _ in range(ctx)] for _ in range(bsz)]
                            t0 = time.time()
                            with cf.ThreadPoolExecutor(bsz) as ex:
                                list(ex.map(lambda p: srv.generate(p, 1), prompts))
                            return time.time() - t0
                        round_()  # warm-up
                        times = [round_() for _ in range(a.reps)]
                        row = {"bench": "e2e", "gpu": gpu, "date": date, "cmd": cmd, "context": ctx, "chunk": chunk,
                               "batch": bsz, "q_heads": 32 // a.tp, "kv_heads": 8 // a.tp, "tp": a.tp,
                               "layers": a.layers, "method": method, "density": density,
                               "ms": 1000 * statistics.median(times), "ms_all": [1000 * t for t in times],
                               "speedup_vs_dense": None, "overhead_frac": None,
                               "density_note": None if method == "flashinfer" else a.density_note}
                        rows.append(row)
                        if bar:
                            bar.update(1)
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
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
