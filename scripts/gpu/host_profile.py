#!/usr/bin/env python3
"""Where the sparse path's host time per layer goes (GPU host): wall time per layer and a Python profile.

    source scripts/gpu/setup.sh
    python3 scripts/gpu/host_profile.py --out $OUT/host_profile

For each selector (`budget` 0.3 on fa3 rows planned once, `mass_budget` and `quest_budget` 0.33 on fa3 rows,
`flashprefill` on fa2 rows, and `flashprefill` with `fix_rows` on fa3 rows: a layer after the observing one,
filling its rows; `quest_budget` once more with our Triton kernels launched from their compiled kernels,
`kernels/launch.py`) one sparse forward pass of Llama-3.1-8B heads (32/8 x 128, page 64) is planned at a size where launches,
not kernels, bound a layer (context 4096, chunk 256: the size `calibrate_gate.py` takes its host time at), and
then a layer as the server runs it is called back to back: the layer's batch (`ExtendPlanner._layer_batch`),
`CompactAttention.select_pages` and `executor.run`, with no sync between layers. Reported per selector:

* host ms per layer: wall time of 200 back-to-back layers / 200 (the GPU is idle most of it), the median of 5
  rounds in which every variant is timed in turn (`host_ms_rounds`), with the rounds' min and max;
* CUDA kernels per layer (torch profiler, 20 layers);
* the top functions by own time (cProfile, 200 layers): what to take off the hot path.

With `--path dense` (or `both`) it profiles instead (or too) the layer of a dense pass with no cached prefix, where
`compact` must cost what stock SGLang costs (issue 13; Qwen2.5-0.5B heads, 14/2 x 64, page 32, one 4096-token
chunk, as in the Qwen 4K / chunk 8192 TTFT point): our layer (`store_kv` with the page sums and key bounds, then
`FlashInferExecutor.run_dense`, a planned ragged run on the chunk's K/V), its two parts apart (the store with and
without summaries, the ragged run on fa3 and fa2), the same with the cached Triton launch, and stock SGLang's
layer (its `store_cache` into an NHD pool, then FlashInfer's fa2 ragged wrapper planned once). Where sgl_kernel's
FA3 library loads (on the GPU host after pieces c01-c04), stock `fa3`'s layer too, SGLang's default on Hopper (the
same store, then Tri Dao's FA3 over the paged NHD cache, as `FlashAttentionBackend.forward_extend` runs it),
FA3's varlen kernel on the chunk's K/V (faster, but rounding unlike stock's call), and our layer with dense passes
making stock's FA3 call (`dense_fa3`, the default where it runs: `sglang_compact/executors/sgl_fa3.py`); the
attention kernels alone as well, so a gap between our dense pass and
stock `fa3`'s can be put on the kernel or on the rest. Each also gets its GPU time per layer (the profiler's kernel
time) beside the host time, each variant that returns the attention output its max abs error against the
plain-torch fp32 reference the GPU tests use (`causal_context_attention`; the run fails where one of ours is above
`DENSE_TOL`; stock's are reported, not judged), and the
pass's planning (`QBlocks.build`, `plan_forward`) its host time per pass.

    python3 scripts/gpu/host_profile.py --path dense --dense-tokens 8192 --out $OUT/hp   # Qwen's 8K pass

Writes `host_profile.json` and `host_profile.md` into --out.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from harness.synthetic import batch_summaries, random_batch  # noqa: E402
from sglang_compact.batch import QBlocks  # noqa: E402
from sglang_compact.compact import CompactAttention  # noqa: E402
from sglang_compact.config import CompactConfig  # noqa: E402
from sglang_compact.executors import ForwardShape  # noqa: E402
from sglang_compact.executors.flashinfer_adapter import ragged_wrapper  # noqa: E402
from sglang_compact.executors.flashinfer_executor import make_flashinfer_executor  # noqa: E402
from sglang_compact.executors.sgl_fa3 import unavailable_reason  # noqa: E402
from sglang_compact.executors.torch_executor import causal_context_attention  # noqa: E402
from sglang_compact.kernels.launch import Launcher  # noqa: E402
from sglang_compact.summaries import PageSummaries, store_kv  # noqa: E402

SELECTORS = (("budget", {"density": 0.3}, "fa3"), ("mass_budget", {"density": 0.33}, "fa3"),
             ("quest_budget", {"density": 0.33}, "fa3"),
             ("quest_budget", {"density": 0.33, "cached_launch": True}, "fa3"),
             ("flashprefill", {"alpha": 0.4}, "fa2"), ("flashprefill", {"alpha": 0.4, "fix_rows": True}, "fa3"),
             # the rows on sgl_kernel's FA3 (`--compact-prefill-kernel sgl-fa3`), where its library is there
             ("quest_budget", {"density": 0.33}, "sgl-fa3"), ("flashprefill", {"alpha": 0.4}, "sgl-fa3"))


def make_layer(selector: str, params: dict, kernel: str, context: int, chunk: int):
    """A function running one sparse layer as `ExtendPlanner.forward` does, after one `plan_forward`."""
    b = random_batch([context - chunk], [chunk], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64,
                     dtype=torch.bfloat16, device="cuda", seed=0, structured=True)
    s = batch_summaries(b)
    cached = params.get("cached_launch", False)   # not a selector parameter: our kernels' launch path
    params = {k: v for k, v in params.items() if k != "cached_launch"}
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

    return (cached_launch(layer) if cached else layer), ex.mode


QWEN = dict(num_q_heads=14, num_kv_heads=2, head_dim=64, page_size=32)


#: max |output - causal_context_attention| of a dense layer (bf16 outputs against the fp32 reference)
DENSE_TOL = 2e-2


def dense_layers(tokens: int) -> tuple[list[tuple[str, object]], torch.Tensor, set[str]]:
    """(name, one layer) of a dense pass with no cached prefix over one `tokens`-token chunk, ours and stock's,
    the chunk's attention output by the plain-torch reference (fp32), and the names of stock's layers."""
    H_q, H_kv, D, P = QWEN["num_q_heads"], QWEN["num_kv_heads"], QWEN["head_dim"], QWEN["page_size"]
    b = random_batch([0], [tokens], dtype=torch.bfloat16, device="cuda", seed=0, **QWEN)
    b = dataclasses.replace(b, qblocks=b.qblocks.with_dense(range(b.qblocks.windows)), derived={})
    q = torch.randn(tokens, H_q, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tokens, H_kv, D, dtype=torch.bfloat16, device="cuda")   # the chunk's K/V after RoPE
    v = torch.randn(tokens, H_kv, D, dtype=torch.bfloat16, device="cuda")
    t = torch.arange(tokens, device="cuda")
    loc = b.page_table[0].to("cuda").long()[t // P] * P + t % P
    num_pages = b.k_pool.shape[0]
    summaries = PageSummaries(1, num_pages, H_kv, D, "cuda", key_bounds=True, bounds_dtype=torch.bfloat16).layer(0)
    executors = {}
    for kernel in ("fa3-auto", "fa2"):
        ex = make_flashinfer_executor(kernel, "cuda", b.num_rows, b.num_rows * b.qblocks.max_pages)
        ex.plan_forward(ForwardShape.of(dataclasses.replace(b, q=q)), b.page_table)
        executors[kernel] = ex

    def ours(kernel="fa3-auto", summarize=True, attend=True):
        def layer():
            store_kv(b.k_pool, b.v_pool, loc, k, v, summaries if summarize else None)
            if attend:
                return executors[kernel].run_dense(q, b.k_pool, b.v_pool, chunk_kv=(k, v))
        return layer

    layers = [("compact dense layer (store with sums + bounds, fa3 ragged)", ours()),
              ("compact dense layer, cached Triton launch", cached_launch(ours())),
              ("compact dense layer, fa2 ragged", ours("fa2")),
              ("  store_kv with sums + bounds", ours(attend=False)),
              ("  store_kv with sums + bounds, cached Triton launch", cached_launch(ours(attend=False))),
              ("  store_kv without summaries", ours(summarize=False, attend=False))]
    try:
        from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache, store_cache
    except Exception as e:   # the bundle's SGLang is what the GPU host has; name what is missing
        print(f"stock store_cache unavailable ({e}): stock rows use index_put", flush=True)
        store_cache = None
    nhd_k = torch.zeros(num_pages * P, H_kv * D, dtype=torch.bfloat16, device="cuda")
    nhd_v = torch.zeros_like(nhd_k)
    row_bytes = H_kv * D * 2
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    stock_ragged = ragged_wrapper(ws, "fa2")
    indptr = torch.tensor([0, tokens], dtype=torch.int32)
    stock_ragged.plan(indptr, indptr, H_q, H_kv, D, causal=True, q_data_type=torch.bfloat16)

    def stock(attend=True):
        def layer():
            if store_cache is not None and can_use_store_cache(row_bytes, row_bytes):
                store_cache(k.reshape(-1, H_kv * D), v.reshape(-1, H_kv * D), nhd_k, nhd_v, loc,
                            row_bytes=row_bytes, v_row_bytes=row_bytes, size_limit=nhd_k.shape[0])
            else:
                nhd_k[loc] = k.reshape(-1, H_kv * D)
                nhd_v[loc] = v.reshape(-1, H_kv * D)
            if attend:
                return stock_ragged.run(q, k, v)
        return layer

    stock_layers = [("stock layer (store_cache into NHD, fa2 ragged planned once)", stock()),
                    ("  stock store_cache", stock(attend=False))]
    layers += stock_layers
    layers.append(("  FlashInfer fa3 ragged alone (ours)", lambda: executors["fa3-auto"].run_dense(
                   q, b.k_pool, b.v_pool, chunk_kv=(k, v))))
    stock_layers.append(("  FlashInfer fa2 ragged alone (stock `flashinfer`)", lambda: stock_ragged.run(q, k, v)))
    layers.append(stock_layers[-1])
    try:   # stock `fa3`: SGLang's default backend on Hopper, Tri Dao's FA3 from sgl_kernel (pieces c01-c04 here)
        from sgl_kernel.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        cu64 = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q[:64], k[:64], v[:64], cu64, cu64, 64, 64, causal=True)   # the library loads
    except Exception as e:   # the bundle trims the FA3 library: say so and time the rest
        print(f"stock fa3 unavailable ({type(e).__name__}: {e}): its rows are left out", flush=True)
    else:
        k_cache, v_cache = nhd_k.view(num_pages, P, H_kv, D), nhd_v.view(num_pages, P, H_kv, D)
        page_table = b.page_table[:1].to("cuda", torch.int32)
        seqlens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
        cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")

        def fa3_paged():   # what SGLang 0.5.17's FlashAttentionBackend.forward_extend runs for this pass
            return flash_attn_with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                                           cache_seqlens=seqlens, cu_seqlens_q=cu, cu_seqlens_k_new=cu,
                                           max_seqlen_q=tokens, softmax_scale=D ** -0.5, causal=True)

        stock_store = stock(attend=False)

        def stock_fa3():
            stock_store()
            return fa3_paged()

        ex = make_flashinfer_executor("fa3-auto", "cuda", b.num_rows, b.num_rows * b.qblocks.max_pages,
                                      dense_fa3=True)
        ex.plan_forward(ForwardShape.of(dataclasses.replace(b, q=q)), b.page_table)
        executors["sgl-fa3"] = ex
        layers.append(("compact dense layer on sgl_kernel FA3 (the default where it runs)", ours("sgl-fa3")))
        stock_fa3_layers = [("stock `fa3` layer (store_cache into NHD, FA3 over the paged cache)", stock_fa3),
                            ("  FA3 over the paged cache alone (stock `fa3`)", fa3_paged)]
        layers += stock_fa3_layers
        stock_layers += stock_fa3_layers
        layers.append(("  FA3 varlen on the chunk's K/V alone", lambda: flash_attn_varlen_func(
            q, k, v, cu, cu, tokens, tokens, softmax_scale=D ** -0.5, causal=True)))

    def plan_pass():
        qb = QBlocks.build([0], [tokens], P, b.qblocks.window_pages, [(0, 0)])
        bb = dataclasses.replace(b, q=q, qblocks=qb, derived={})
        executors["fa3-auto"].plan_forward(ForwardShape.of(bb), b.page_table)
    layers.append(("compact pass planning (QBlocks.build + plan_forward), per pass", plan_pass))
    store_kv(b.k_pool, b.v_pool, loc, k, v, None)   # the reference reads the chunk's K/V from the pool
    return layers, causal_context_attention(dataclasses.replace(b, q=q)), {name for name, _ in stock_layers}


def off_reference(rows: list[dict]) -> list[str]:
    """Our layers whose output is off the plain-torch reference by more than DENSE_TOL. Stock's rows are reported
    but not judged: their rounding is SGLang's (stock `fa3`'s paged call has been 0.015-0.040 off at 8192 tokens on
    an H100), and this check is about our kernels."""
    return [r["name"].strip() for r in rows
            if not r["stock"] and r["max_abs_error"] is not None and r["max_abs_error"] > DENSE_TOL]


def max_error(out, ref: torch.Tensor) -> float | None:
    """max |out - ref| for a variant that returns the attention output [T, H_q, D]; None for one that does not."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return None
    return (out.float() - ref).abs().max().item()


def cuda_kernels(fn, n: int = 20) -> list:
    """The profiler's CUDA kernel events of n calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def cached_launch(fn):
    """fn with our Triton kernels launched from their compiled kernels (`kernels/launch.py`)."""

    def call():
        was, Launcher.enabled = Launcher.enabled, True
        try:
            return fn()
        finally:
            Launcher.enabled = was
    return call


def gpu_ms(fn, n: int = 20) -> float:
    """Kernel time per call (the profiler's CUDA kernel durations, summed)."""
    return sum(e.time_range.elapsed_us() for e in cuda_kernels(fn, n)) / n / 1e3


def host_ms_rounds(fns: list, n: int, rounds: int, sync=None) -> list[list[float]]:
    """Host ms per call of each of `fns`, measured `rounds` times, the functions interleaved within each round
    (n back-to-back calls of fn 0, then of fn 1, ...): a slow spell of the host falls on every variant of a
    round alike instead of on one (session 28's `quest_budget` row read 1.6x `budget`'s in every function).
    `sync`: waits for the device (torch.cuda.synchronize on the GPU), outside the timed calls."""
    sync = sync or torch.cuda.synchronize
    for fn in fns:   # warm-up: compiles, plans, caches
        fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            ts.append((time.perf_counter() - t) * 1e3 / n)
            sync()
    return times


def spread(ts: list[float]) -> dict:
    """median, min and max of one variant's rounds."""
    return dict(host_ms=statistics.median(ts), host_ms_min=min(ts), host_ms_max=max(ts), host_ms_rounds=ts)


def kernels_per_layer(fn, n: int = 20) -> float:
    return len(cuda_kernels(fn, n)) / n


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
    ap.add_argument("--layers", type=int, default=200, help="back-to-back calls per timing")
    ap.add_argument("--rounds", type=int, default=5, help="timings per variant, interleaved; the median is reported")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--path", choices=["sparse", "dense", "both"], default="sparse",
                    help="profile the sparse path's layer (the default), a dense pass's layer against stock's, or both")
    ap.add_argument("--dense-tokens", type=int, default=4096, help="the dense pass's chunk (no cached prefix)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    dense = []
    layers, ref, stock_names = dense_layers(a.dense_tokens) if a.path in ("dense", "both") else ([], None, set())
    sparse = []
    fa3_missing = unavailable_reason(torch.device("cuda"), torch.bfloat16, 128)
    for selector, params, kernel in SELECTORS if a.path != "dense" else ():
        if kernel == "sgl-fa3" and fa3_missing:
            print(f"{selector} on sgl-fa3 rows: skipped ({fa3_missing})", flush=True)
            continue
        layer, mode = make_layer(selector, params, kernel, a.context, a.chunk)
        sparse.append((selector, params, kernel, mode, layer))
    host = [spread(ts) for ts in host_ms_rounds([fn for _, fn in layers] + [s[-1] for s in sparse], a.layers,
                                                a.rounds)]
    for (name, fn), h in zip(layers, host):
        err = max_error(fn(), ref)
        r = dict(name=name, stock=name in stock_names, tokens=a.dense_tokens, **h, gpu_ms=gpu_ms(fn),
                 kernels=kernels_per_layer(fn), max_abs_error=err, top=top_functions(fn, a.layers, 12))
        dense.append(r)
        print(f"{name}: host {r['host_ms']:.3f} ms [{r['host_ms_min']:.3f}, {r['host_ms_max']:.3f}], "
              f"GPU {r['gpu_ms']:.3f} ms, {r['kernels']:.1f} kernels"
              + ("" if err is None else f", max |out - reference| {err:.2e}"), flush=True)
    bad = off_reference(dense)
    if bad:
        print(f"FAILED: outputs off the plain-torch reference by more than {DENSE_TOL}: {bad}", flush=True)
    for (selector, params, kernel, mode, layer), h in zip(sparse, host[len(layers):]):
        r = dict(selector=selector, params=params, kernel=kernel, mode=mode, context=a.context, chunk=a.chunk,
                 host_ms_per_layer=h["host_ms"], **{k: v for k, v in h.items() if k != "host_ms"},
                 kernels_per_layer=kernels_per_layer(layer), top=top_functions(layer, a.layers, a.top))
        results.append(r)
        print(f"{selector} {params} ({kernel}, {mode}): host {r['host_ms_per_layer']:.3f} ms per layer "
              f"[{r['host_ms_min']:.3f}, {r['host_ms_max']:.3f}], {r['kernels_per_layer']:.1f} kernels", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command="python3 scripts/gpu/host_profile.py " + " ".join(sys.argv[1:]))
    (out / "host_profile.json").write_text(json.dumps(dict(meta, results=results, dense=dense), indent=1))
    lines = [f"# Host time per layer ({meta['gpu']}, {meta['date']})", "", f"`{meta['command']}`", ""]
    if dense:
        lines += [f"Dense pass, no cached prefix, {a.dense_tokens} tokens, Qwen2.5-0.5B heads (14/2 x 64, page 32); "
                  f"max |output - plain-torch fp32 reference| where the variant returns the output "
                  f"(tolerance {DENSE_TOL}):",
                  "", "| layer | host ms (median [min, max] of the rounds) | GPU ms | CUDA kernels | max abs error |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['name']} | {r['host_ms']:.3f} [{r['host_ms_min']:.3f}, {r['host_ms_max']:.3f}] | "
                  f"{r['gpu_ms']:.3f} | {r['kernels']:.1f} | "
                  f"{'' if r['max_abs_error'] is None else format(r['max_abs_error'], '.2e')} |" for r in dense]
        lines.append("")
    if results:
        lines += ["Sparse path:", "",
                  "| selector | parameters | rows kernel | plan | host ms / layer (median [min, max]) "
                  "| CUDA kernels / layer |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['selector']} | {json.dumps(r['params'])} | {r['kernel']} | {r['mode']} | "
                  f"{r['host_ms_per_layer']:.3f} [{r['host_ms_min']:.3f}, {r['host_ms_max']:.3f}] | "
                  f"{r['kernels_per_layer']:.1f} |" for r in results]
    summary = len(lines)   # the title, the command and the tables
    for r in dense:
        lines += ["", f"## {r['name'].strip()}: top functions by own time (per call)", "",
                  "| function | calls | own us | cumulative us |", "| --- | --- | --- | --- |"]
        lines += [f"| `{t['fn']}` | {t['calls']:.1f} | {t['own_us']:.1f} | {t['cum_us']:.1f} |" for t in r["top"]]
    for r in results:
        lines += ["", f"## {r['selector']} {json.dumps(r['params'])}: top functions by own time (per layer)", "",
                  "| function | calls | own us | cumulative us |", "| --- | --- | --- | --- |"]
        lines += [f"| `{t['fn']}` | {t['calls']:.1f} | {t['own_us']:.1f} | {t['cum_us']:.1f} |" for t in r["top"]]
    (out / "host_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:summary]))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
