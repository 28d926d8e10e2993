#!/usr/bin/env python3
"""Calibrate the cost gate's model on this GPU: writes `sglang_compact/data/cost_model.json`.

    source scripts/gpu/setup.sh
    python3 scripts/gpu/calibrate_gate.py --out sglang_compact/data/cost_model.json --report $OUT/calibration.json

Times, per layer and with the library's own executors and selectors (one forward pass planned, then
many layers), on synthetic inputs of two model shapes (Llama-3.1-8B: 32/8 heads x 128, page 64;
Qwen2.5-0.5B: 14/2 heads x 64, page 32):

* the dense path (`executor.run(batch, None)`: one causal paged pass over each context) at contexts 8K-128K;
* the sparse path (`select_pages` + `executor.run`) with `budget` at density 0.3 on fa3 rows (fixed row
  lengths, planned once) and on fa2 rows, and `flashprefill` (fa2 rows): the search, the attention, and the
  whole layer. The rows' throughput per kernel comes from the `budget` points only: `flashprefill` on
  synthetic inputs reads 1-20% of the pages, where the rows' fixed costs, not their throughput, set the
  time (the first calibration fitted fa2 rows from those and put them at 157 TF/s, against ~0.65x dense fa3
  in the attention benchmark at density 0.3); and `quest_budget` (fa3 rows), whose search on key bounds
  gives `bounds_search_flops`;
* host time per layer: back-to-back layers at a size where the GPU work is negligible (what a layer
  costs when launches, not kernels, bound it).

From these it fits the `CostModel` coefficients (attention throughput per kernel, search throughput,
the sparse path's fixed GPU cost, host times), prints each measured point beside the model's
prediction, and writes the model for `torch.cuda.get_device_name()` into the data file (other GPUs'
entries are kept).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
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
from sglang_compact.gate import CostModel, ModelShape, SparsePassLayers, cost_model_json, load_cost_models  # noqa: E402

SHAPES = {"llama-8b": (ModelShape(32, 8, 128, 64)), "qwen-0.5b": (ModelShape(14, 2, 64, 32))}
NUM_LAYERS = {"llama-8b": 32, "qwen-0.5b": 24}


def cuda_ms(fn, reps: int) -> float:
    """Median GPU time of fn() in ms (events around each call, after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_ms(fn, layers: int = 200) -> float:
    """Wall time per call of back-to-back calls (no sync between them): launch-bound when the work is small."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(layers):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / layers


def setup(shape: ModelShape, context: int, chunk: int, sparse: bool, seed: int = 0):
    prefix = context - chunk
    b = random_batch([prefix], [chunk], num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                     head_dim=shape.head_dim, page_size=shape.page_size, dtype=torch.bfloat16, device="cuda",
                     seed=seed, structured=True, sparse_ranges=None if sparse else [(0, 0)])
    return b, batch_summaries(b)


def layer_fns(shape, context, chunk, selector, kernel):
    """(selection fn, attention fn, whole-layer fn, batch, selection) of one planned sparse pass."""
    b, s = setup(shape, context, chunk, sparse=True)
    params = {"density": 0.3} if selector in ("budget", "quest_budget") else {"alpha": 0.4}
    ca = CompactAttention(CompactConfig(block_size=shape.page_size, selector=selector, selector_params=params))
    ex = make_flashinfer_executor(kernel, "cuda", b.num_rows, b.num_rows * b.qblocks.max_pages)
    ex.plan_forward(ForwardShape.of(b, ca.row_pages(b)), b.page_table)
    sel = ca.select_pages(b, 0, s, buffers=ex.index_buffers, with_stats=True)
    select = lambda: ca.select_pages(b, 0, s, buffers=ex.index_buffers)  # noqa: E731
    attend = lambda: ex.run(b, sel.indices)  # noqa: E731
    return select, attend, lambda: ex.run(b, select().indices), b, sel


def dense_fn(shape, context, chunk, kernel):
    b, _ = setup(shape, context, chunk, sparse=False)
    ex = make_flashinfer_executor(kernel, "cuda", b.num_rows, b.num_rows * b.qblocks.max_pages)
    ex.plan_forward(ForwardShape.of(b), b.page_table)
    return (lambda: ex.run(b, None)), b


def attn_flops(shape: ModelShape, context: int, chunk: int, density: float = 1.0) -> float:
    """FLOPs of a chunk's attention (QK and PV) at `density` of its context (the model's own formula)."""
    return 4.0 * chunk * density * (context - chunk / 2) * shape.num_q_heads * shape.head_dim


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "sglang_compact" / "data" / "cost_model.json"))
    ap.add_argument("--report", default=None, help="JSON of every measured point and the fit")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--chunks", default="1024,8192")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--margin", type=float, default=0.1)
    a = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    props = torch.cuda.get_device_properties(0)
    contexts = [int(x) for x in a.contexts.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    points = []
    dense_tp = {"fa2": [], "fa3": []}
    rows_tp = {"fa2": [], "fa3": []}
    search_tp, bounds_tp, sparse_fixed = [], [], []
    for name, shape in SHAPES.items():
        for chunk in chunks:
            for context in contexts:
                if context <= chunk:
                    continue
                for kernel in ("fa2", "fa3"):
                    fn, b = dense_fn(shape, context, chunk, kernel)
                    ms = cuda_ms(fn, a.reps)
                    f = attn_flops(shape, context, chunk)
                    dense_tp[kernel].append(f / (ms * 1e-3))
                    points.append(dict(model=name, path="dense", kernel=kernel, context=context, chunk=chunk, ms=ms))
                for selector, kernel in (("budget", "fa3"), ("budget", "fa2"), ("flashprefill", "fa2"),
                                         ("quest_budget", "fa3")):
                    select, attend, layer, b, sel = layer_fns(shape, context, chunk, selector, kernel)
                    d = float(sel.density)
                    ms_sel, ms_att, ms_layer = cuda_ms(select, a.reps), cuda_ms(attend, a.reps), cuda_ms(layer, a.reps)
                    read = attn_flops(shape, context, chunk, d)
                    if selector == "budget":
                        rows_tp[kernel].append(read / (ms_att * 1e-3))
                    search = 4.0 * chunk * (context / shape.page_size) * shape.num_q_heads * shape.head_dim
                    (bounds_tp if selector == "quest_budget" else search_tp).append(search / (ms_sel * 1e-3))
                    points.append(dict(model=name, path="sparse", selector=selector, kernel=kernel, context=context,
                                       chunk=chunk, density=d, ms_select=ms_sel, ms_attention=ms_att, ms=ms_layer))
                print(f"{name} chunk {chunk} context {context}: " + ", ".join(
                    f"{p['path']}/{p.get('selector', '')}/{p['kernel']} {p['ms']:.3f} ms" for p in points[-6:]),
                    flush=True)
    # host time per layer: a small pass (context 4096, chunk 256) where launches bound the layer
    shape = SHAPES["llama-8b"]
    fn, _ = dense_fn(shape, 4096, 256, "fa3")
    dense_host = host_ms(fn)
    _, _, layer, _, _ = layer_fns(shape, 4096, 256, "budget", "fa3")
    sparse_host = host_ms(layer)
    _, _, layer2, _, _ = layer_fns(shape, 4096, 256, "flashprefill", "fa2")
    sparse_host = max(sparse_host, host_ms(layer2))
    med = lambda xs: statistics.median(xs)  # noqa: E731
    model = CostModel(gpu=gpu, dense_flops={k: med(v) for k, v in dense_tp.items()},
                      rows_flops={k: med(v) for k, v in rows_tp.items()}, search_flops=med(search_tp),
                      bounds_search_flops=med(bounds_tp),
                      sparse_gpu_s=0.0, sparse_host_s=sparse_host * 1e-3, dense_host_s=dense_host * 1e-3,
                      margin=a.margin, source=f"scripts/gpu/calibrate_gate.py, {datetime.date.today()}",
                      capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count)
    # the sparse path's fixed GPU cost: what a GPU-bound layer takes beyond its modelled search and attention
    for p in points:
        if p["path"] == "sparse" and p["ms"] * 1e-3 > model.sparse_host_s:
            shape = SHAPES[p["model"]]
            L, C = p["context"] - p["chunk"], p["chunk"]
            flops = model.bounds_search_flops if p["selector"] == "quest_budget" else model.search_flops
            search = 4.0 * C * ((L + C / 2) / shape.page_size) * shape.num_q_heads * shape.head_dim / flops
            attention = attn_flops(shape, p["context"], C, p["density"]) / model.rows_flops[p["kernel"]]
            sparse_fixed.append(max(0.0, p["ms"] * 1e-3 - search - attention))
    model = CostModel(**{**model.__dict__, "sparse_gpu_s": statistics.median(sparse_fixed) if sparse_fixed else 0.0})
    print(f"\n{gpu}: dense TF/s {({k: round(v / 1e12) for k, v in model.dense_flops.items()})}, rows TF/s "
          f"{({k: round(v / 1e12) for k, v in model.rows_flops.items()})}, search TF/s {model.search_flops / 1e12:.0f} "
          f"(key bounds {model.bounds_search_flops / 1e12:.0f}), "
          f"host per layer: dense {dense_host:.3f} ms, sparse {sparse_host:.3f} ms")
    print("| model | path | kernel | context | chunk | density | measured ms | predicted ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in points:
        shape = SHAPES[p["model"]]
        priced = model.search_model(p.get("selector") == "quest_budget")
        dense, sparse = priced.layer_times(shape, p["context"] - p["chunk"], p["chunk"], p.get("density", 1.0),
                                           p["kernel"])
        p["predicted_ms"] = 1e3 * (dense if p["path"] == "dense" else sparse)
        print(f"| {p['model']} | {p['path']}/{p.get('selector', '')} | {p['kernel']} | {p['context']} | {p['chunk']} | "
              f"{p.get('density', 1.0):.2f} | {p['ms']:.3f} | {p['predicted_ms']:.3f} |")
    for name, shape in SHAPES.items():
        for chunk in chunks:
            for d in (0.3, 0.5):
                for rows in ("fa2", "fa3"):
                    be = model.break_even(shape, chunk, d, "fa3", 131072, rows_kernel=rows)
                    print(f"break-even {name} chunk {chunk} density {d}, fa3 dense vs {rows} rows: {be}")
            # what a server's gate decides: whole passes, the first layer dense where the pass observes its density
            be = model.break_even(shape, chunk, 0.5, "fa3", 131072, rows_kernel="fa3",
                                  layers=SparsePassLayers(NUM_LAYERS[name], dense_first=1))
            print(f"break-even {name} chunk {chunk} density 0.5, fa3 dense vs fa3 rows, passes of "
                  f"{NUM_LAYERS[name]} layers observing at the second (flashprefill fix_rows): {be}")
        for dense, rows in (("fa3", "fa2"), ("fa3", "fa3"), ("fa2", "fa2")):
            print(f"break-even density {name}, {dense} dense vs {rows} rows: "
                  f"{model.break_even_density(shape, dense, rows):.3f}")
    models = load_cost_models()
    models[gpu] = model
    Path(a.out).write_text(cost_model_json(models))
    if a.report:
        Path(a.report).write_text(json.dumps({"gpu": gpu, "points": points, "model": model.__dict__}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
