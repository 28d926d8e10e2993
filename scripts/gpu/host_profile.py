#!/usr/bin/env python3
"""Where the sparse path's host time per layer goes (GPU host): wall time per layer and a Python profile.

    source scripts/gpu/setup.sh
    python3 scripts/gpu/host_profile.py --out $OUT/host_profile

For each selector (`budget` 0.3 on fa3 rows planned once, `mass_budget` and `quest_budget` 0.33 on fa3 rows,
`flashprefill` on fa2 rows, and `flashprefill` with `fix_rows` on fa3 rows: a layer after the observing one,
filling its rows) one sparse forward pass of Llama-3.1-8B heads (32/8 x 128, page 64) is planned at a size where launches,
not kernels, bound a layer (context 4096, chunk 256: the size `calibrate_gate.py` takes its host time at), and
then a layer as the server runs it is called back to back: the layer's batch (`ExtendPlanner._layer_batch`),
`CompactAttention.select_pages` and `executor.run`, with no sync between layers. Reported per selector:

* host ms per layer: wall time of 200 back-to-back layers / 200 (the GPU is idle most of it);
* CUDA kernels per layer (torch profiler, 20 layers);
* the top functions by own time (cProfile, 200 layers): what to take off the hot path.

Writes `host_profile.json` and `host_profile.md` into --out.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from harness.synthetic import batch_summaries, random_batch  # noqa: E402
from sglang_compact.compact import CompactAttention  # noqa: E402
from sglang_compact.config import CompactConfig  # noqa: E402
from sglang_compact.executors import ForwardShape  # noqa: E402
from sglang_compact.executors.flashinfer_executor import make_flashinfer_executor  # noqa: E402

SELECTORS = (("budget", {"density": 0.3}, "fa3"), ("mass_budget", {"density": 0.33}, "fa3"),
             ("quest_budget", {"density": 0.33}, "fa3"),
             ("flashprefill", {"alpha": 0.4}, "fa2"), ("flashprefill", {"alpha": 0.4, "fix_rows": True}, "fa3"))


def make_layer(selector: str, params: dict, kernel: str, context: int, chunk: int):
    """A function running one sparse layer as `ExtendPlanner.forward` does, after one `plan_forward`."""
    b = random_batch([context - chunk], [chunk], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64,
                     dtype=torch.bfloat16, device="cuda", seed=0, structured=True)
    s = batch_summaries(b)
    ca = CompactAttention(CompactConfig(block_size=64, selector=selector, selector_params=params))
    ex = make_flashinfer_executor(kernel, "cuda", b.num_rows, b.num_rows * b.qblocks.max_pages)
    row_pages, fill = ca.row_pages(b), None
    if params.get("fix_rows"):   # a later layer of the pass: rows filled to the observing layer's counts
        row_pages = ca.select_pages(b, 1, s).counts.tolist()
        fill = torch.tensor(row_pages, dtype=torch.int32, device="cuda")
    ex.plan_forward(ForwardShape.of(b, row_pages), b.page_table)

    def layer():
        batch = dataclasses.replace(b, q=b.q, k_pool=b.k_pool, v_pool=b.v_pool, sm_scale=b.sm_scale)
        sel = ca.select_pages(batch, 3, s, buffers=ex.index_buffers, with_stats=False, fill=fill)
        return ex.run(batch, sel.indices)

    return layer, ex.mode


def host_ms(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host * 1e3 / n


def kernels_per_layer(fn, n: int = 20) -> float:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / n


def top_functions(fn, n: int, k: int) -> list[dict]:
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr, stream=io.StringIO())
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        where = f"{Path(file).name}:{line}({name})" if line else name
        rows.append(dict(fn=where, calls=nc / n, own_us=tt * 1e6 / n, cum_us=ct * 1e6 / n))
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:k]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/host_profile")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for selector, params, kernel in SELECTORS:
        layer, mode = make_layer(selector, params, kernel, a.context, a.chunk)
        ms = host_ms(layer, a.layers)
        r = dict(selector=selector, params=params, kernel=kernel, mode=mode, context=a.context, chunk=a.chunk,
                 host_ms_per_layer=ms, kernels_per_layer=kernels_per_layer(layer),
                 top=top_functions(layer, a.layers, a.top))
        results.append(r)
        print(f"{selector} {params} ({kernel}, {mode}): host {ms:.3f} ms per layer, {r['kernels_per_layer']:.1f} kernels",
              flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command="python3 scripts/gpu/host_profile.py " + " ".join(sys.argv[1:]))
    (out / "host_profile.json").write_text(json.dumps(dict(meta, results=results), indent=1))
    lines = [f"# Sparse path host time per layer ({meta['gpu']}, {meta['date']})", "", f"`{meta['command']}`", "",
             "| selector | parameters | rows kernel | plan | host ms / layer | CUDA kernels / layer |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['selector']} | {json.dumps(r['params'])} | {r['kernel']} | {r['mode']} | "
              f"{r['host_ms_per_layer']:.3f} | {r['kernels_per_layer']:.1f} |" for r in results]
    summary = len(lines)   # the title, the command and the per-selector table
    for r in results:
        lines += ["", f"## {r['selector']} {json.dumps(r['params'])}: top functions by own time (per layer)", "",
                  "| function | calls | own us | cumulative us |", "| --- | --- | --- | --- |"]
        lines += [f"| `{t['fn']}` | {t['calls']:.1f} | {t['own_us']:.1f} | {t['cum_us']:.1f} |" for t in r["top"]]
    (out / "host_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:summary]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
