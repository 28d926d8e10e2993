#!/usr/bin/env python3
"""Where the sparse path's time per layer goes at long context (GPU host), against stock `fa3`'s layer.

    source scripts/gpu/setup.sh
    python3 scripts/gpu/sparse_breakdown.py --contexts 32768,65536,131072 --out $OUT/breakdown

One chunk (1024 tokens) of Llama-3.1-8B heads (32/8 x 128, page 64) after a cached prefix, structured synthetic
inputs (`harness.synthetic.random_batch`). For each context:

* the sparse layer as the server runs it (`host_profile.make_layer`: the layer's batch, `select_pages`,
  `executor.run`, after one `plan_forward`), for each `--selectors` entry;
* stock `fa3`'s attention for the same chunk: Tri Dao's FA3 over the whole paged cache (prefix + chunk), the call
  SGLang 0.5.17's `FlashAttentionBackend.forward_extend` makes.

Reported per layer: ms by CUDA events over `--layers` layers launched back to back (gaps included: a layer whose
host work outlasts its kernels shows its host time), and the profiler's kernel time by kernel (what to shrink:
search, top pages, table, rows). The sparse path's time over stock's, beside the density it read, says how far the
fixed cost is from the rows' share.

Writes `sparse_breakdown.json` and `.md` into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

import torch  # noqa: E402

from host_profile import cuda_kernels, make_layer  # noqa: E402


def event_ms(fn, n: int) -> float:
    """ms per call of n calls launched back to back (CUDA events), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def kernel_ms(fn, n: int) -> dict[str, float]:
    """Kernel ms per call by kernel name (the profiler's CUDA kernel events, `host_profile.cuda_kernels`)."""
    per = defaultdict(float)
    for e in cuda_kernels(fn, n):
        per[short(e.name)] += e.time_range.elapsed_us() / 1000 / n
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def short(name: str) -> str:
    name = name.split("(")[0]
    name = name.split("<")[0]
    return name[:80]


def stock_fa3_layer(context: int, chunk: int):
    from sgl_kernel.flash_attn import flash_attn_with_kvcache
    H_q, H_kv, D, P = 32, 8, 128, 64
    pages = -(-context // P)
    g = torch.Generator(device="cuda").manual_seed(1)
    k_cache = torch.randn(pages + 1, P, H_kv, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(pages + 1, P, H_kv, D, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(chunk, H_q, D, generator=g, device="cuda", dtype=torch.bfloat16)
    page_table = torch.randperm(pages + 1, device="cuda")[:pages].to(torch.int32)[None]
    seqlens = torch.tensor([context], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")

    def layer():
        return flash_attn_with_kvcache(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                                       cache_seqlens=seqlens, cu_seqlens_q=cu, cu_seqlens_k_new=cu,
                                       max_seqlen_q=chunk, softmax_scale=D ** -0.5, causal=True)
    return layer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/breakdown")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--selectors", default="quest_budget:0.3:sgl-fa3,quest_budget:1.0:sgl-fa3",
                    help="selector:density:rows kernel, comma-separated")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for context in map(int, a.contexts.split(",")):
        stock = stock_fa3_layer(context, a.chunk)
        s_ms = event_ms(stock, a.layers)
        rows.append(dict(context=context, variant="stock fa3", density=1.0, ms=s_ms,
                         kernels=kernel_ms(stock, 10)))
        print(f"{context} stock fa3: {s_ms:.3f} ms", flush=True)
        for spec in a.selectors.split(","):
            selector, density, kernel = spec.split(":")
            try:
                layer, mode = make_layer(selector, {"density": float(density)}, kernel, context, a.chunk)
            except Exception as e:   # say which variant could not be built and time the others
                print(f"{context} {spec}: not built ({type(e).__name__}: {e})", flush=True)
                continue
            ms = event_ms(layer, a.layers)
            rows.append(dict(context=context, variant=f"{selector} {density} on {kernel} ({mode})",
                             density=float(density), ms=ms, vs_stock=ms / s_ms, kernels=kernel_ms(layer, 10)))
            print(f"{context} {spec}: {ms:.3f} ms = {ms / s_ms:.3f} of stock", flush=True)
            del layer
            torch.cuda.empty_cache()
        del stock
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command="python3 scripts/gpu/sparse_breakdown.py " + " ".join(sys.argv[1:]))
    (out / "sparse_breakdown.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    lines = [f"# Sparse layer's time against stock `fa3`'s ({meta['gpu']}, {meta['date']})", "",
             f"`{meta['command']}`", "",
             "| context | variant | ms / layer (CUDA events, layers back to back) | of stock fa3 |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['context']} | {r['variant']} | {r['ms']:.3f} | {r.get('vs_stock', 1.0):.3f} |" for r in rows]
    for r in rows:
        lines += ["", f"## {r['context']}, {r['variant']}: kernel ms per layer", "", "| kernel | ms |", "| --- | --- |"]
        lines += [f"| `{k}` | {v:.4f} |" for k, v in list(r["kernels"].items())[:12]]
    (out / "sparse_breakdown.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
