#!/usr/bin/env python3
"""One layer's attention for one prefill chunk against its context: CompactAttention vs baselines.

For every configuration (context = prefix length L, chunk C, batch B, heads H_q/H_kv, head_dim D) all
methods run side by side in one process on the same inputs, then memory is freed before the next one. The
chunk's own K/V are in the paged pool with its prefix (as the server writes them before attention). The
chunk's queries are cut at absolute positions into q-blocks (one page: what selectors score) and union
windows (--union-window tokens, by default the server's min(1024, chunk): the rows of the compact path,
which read the union of their q-blocks' and heads' selections, their own pages causally); every window of
the benchmark's batches is sparse.

  dense_fa2 / dense_fa3   FlashInfer BatchPrefillWithPagedKVCacheWrapper over the HND pool with page ids
                          (all heads), one causal pass over each chunk's whole context (prefix + chunk);
                          planned once outside the timed region (plan is per forward pass).
  dense_torch             the torch executor's dense pass (without FlashInfer).
  compact_<sel>           CompactAttention.select_pages (buffers=executor.index_buffers) + executor.run: one
                          causal paged pass over the rows (kv head, window) on the fa2 executor
                          (make_flashinfer_executor("fa2"): planned once per forward pass, the index kernel
                          writes the wrapper's buffers). <sel> = flashprefill (alpha), xattention
                          (threshold), budget_<d> (fixed density d; budget_1.0 = everything, which separates
                          kernel choice from sparsity), mass_budget_<d> (fixed density d ranked by the
                          xattention mass estimate, stride --xattn-stride), quest_budget_<d> (fixed density d
                          ranked by Quest's bound from the pages' key max / min).
  compact_fa3_<sel>       the same on the fa3 executor: for budget_<d> (row lengths fixed on the host,
                          CompactAttention.row_pages) planned once per forward pass like fa2 (its host plan
                          is begin_forward_ms); for threshold selectors a plan() per layer with a device->host
                          sync (counted in its attention time).
  bsparse_<sel>           the selector's choice per q-block, before the window union (per kv head: OR over the
                          group's query heads, FlashInfer's block-sparse wrapper shares one mask per kv head;
                          budget chooses per window: its window's row) + the forced pages, executed block-sparse:
                          FlashInfer's VariableBlockSparseAttentionWrapper over the selected pages before each
                          q-block's window (non-causal; rows = q-blocks, one launch for the whole batch, requests
                          block-diagonal) on K/V gathered from the paged pool into contiguous [H_kv, sum E, D]
                          ("gather_ms", counted in ms), the window's own pages causally (a paged prefill, one row
                          per window, "chunk_ms"), merge_state. Its plan() (host, expands blocks to token
                          indices, syncs) is reported as plan_ms but NOT counted in ms, since a native
                          block-sparse kernel takes the mask directly.
  quoka                   QUOKA-style: quoka_token_mask over each request's prefix tokens (query ratio 0.25, KV
                          budget 0.25), gather of the selected tokens per kv head into contiguous K/V
                          [N, H_kv, D], FlashInfer ragged non-causal over them + the chunk against itself
                          (ragged causal over k_chunk / v_chunk) + merge.

Split times (each timed on its own with the same inputs): search_ms (selector.select on the page summaries;
xattention reads the context keys), union_ms (union_table, selectors with per-head masks), index_ms
(build_indices into the executor's buffers; quoka: the selected-token index), attn_ms (compact: executor.run;
dense: ms; bsparse / quoka: prefix_ms + chunk_ms), prefix_ms (bsparse: the block-sparse pass; quoka: the
selected prefix tokens), chunk_ms (quoka: the chunk against itself, shared per config; bsparse: the windows'
own pages, causally), merge_ms (merge_state; shared per config), gather_ms (bsparse / quoka). "ms" is the method's
end-to-end time, timed as one closure. begin_forward_ms is host time of the per-forward-pass planning
(executor.plan_forward, the dense wrapper's plan; not per layer, not in ms).

Timing: CUDA events around each call, L2 flushed (256 MB write) before each call, warm-up calls first,
median of N calls where N = clamp(--budget-ms / estimate, --min-reps, --reps).

Inputs are structured (attention sinks, a local window, a few heavy blocks, per-query-block topic
mixtures correlated across query blocks and heads), built directly on the device; see `structured_batch`.

Outputs (under --out-dir, default docs/results): rows appended to speed.json, speed_attention.md and
speed_attention.png rendered from the rows of this --run-tag, speed_attention_meta.json (per run: command,
GPU, versions, generator parameters).

GPU host (from the repository root, after ../shared/gpu-host/stage.sh and carrying .gpu):
  source scripts/gpu/setup.sh
  python3 scripts/bench_attention.py --smoke --check --out-dir $OUT/smoke      # ~1 min: checks outputs
  mkdir -p $OUT/results && cp docs/results/* $OUT/results/ 2>/dev/null
  python3 scripts/bench_attention.py --out-dir $OUT/results --deadline-s 540 ...
On a CPU machine `--smoke` runs the torch paths (FlashInfer-only methods are recorded as skipped).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Mapping

import torch

from harness.bench_attention.config_run import ConfigRun
from harness.bench_attention.inputs import GenParams, structured_batch
from harness.bench_attention.methods import (DEFAULT_METHODS, FI_VERSION, HAVE_FI, Skip, query_stride_run,
                                             select_methods)
from harness.bench_attention.report import (finish_rows, load_rows, print_pivots, print_summary, render_markdown,
                                            render_png, save_json)
from harness.bench_attention.timing import Timer
from sglang_compact.config import CompactConfig

FULL = dict(contexts="32768,65536,131072,262144", chunks="1024,8192", batches="1,8", heads="32/8,16/4")
# smoke sizes are not page aligned on purpose (partial last pages and query blocks); GPU: head_dim 128 (JIT cache)
SMOKE = dict(contexts="4000,8192", chunks="200", batches="1,2", heads="8/2")
SMOKE_CPU = dict(contexts="500,1024", chunks="100", batches="1,2", heads="8/2", head_dim=32, page_size=16)


def parse_args(argv=None, defaults: Mapping[str, Any] | None = None):
    """The command line; `defaults`: its default paths from the entry point (`out_dir`; none given: --out-dir is
    required)."""
    defaults = dict(defaults or {})
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Methods (fnmatch patterns for --methods): dense_fa2 dense_fa3 dense_torch "
                                       "compact[_fa3]_{flashprefill,xattention,budget_<d>,mass_budget_<d>,quest_budget_<d>} "
                                       "bsparse_{flashprefill,xattention,budget_<d>} quoka")
    p.add_argument("--contexts", help=f"prefix lengths (default {FULL['contexts']}; the chunk follows them)")
    p.add_argument("--chunks", help=f"chunk lengths (default {FULL['chunks']})")
    p.add_argument("--batches", help=f"batch sizes (default {FULL['batches']})")
    p.add_argument("--heads", help=f"H_q/H_kv pairs (default {FULL['heads']}: TP1, TP2 per rank)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (32 for --smoke on the CPU)")
    p.add_argument("--page-size", type=int, default=None,
                   help="KV page size = block size (default 64; 16 for --smoke on the CPU)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of patterns (default {DEFAULT_METHODS})")
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.4,0.5,1.0", help="fixed densities for budget_<d> methods")
    p.add_argument("--alpha", type=float, default=0.06, help="flashprefill alpha")
    p.add_argument("--query-stride", type=int, default=None,
                   help="flashprefill / budget search: score every s-th query of each block; mass_budget: every "
                        "s-th antidiagonal row (its row_stride); s times cheaper (default: each selector's own; "
                        "the row records the stride run)")
    p.add_argument("--xattn-threshold", type=float, default=0.9)
    p.add_argument("--xattn-stride", type=int, default=8)
    p.add_argument("--union-window", type=int, default=None, metavar="TOKENS",
                   help="tokens of a union window (the rows' query unit; a multiple of --page-size); default: the "
                        "server's for the chunk size, min(1024, chunk) in whole pages")
    p.add_argument("--sink-blocks", type=int, default=2)
    p.add_argument("--recent-blocks", type=int, default=4)
    p.add_argument("--quoka-query-ratio", type=float, default=0.25)
    p.add_argument("--quoka-kv-budget", type=float, default=0.25)
    p.add_argument("--quoka-backend", default="fa2", help="FlashInfer ragged backend for quoka (fa2/fa3)")
    p.add_argument("--bsparse-backend", default="auto", help="VariableBlockSparseAttentionWrapper backend")
    p.add_argument("--bsparse-max-indices", type=float, default=1e9,
                   help="skip bsparse when its token-level kv_indices would exceed this (int32, memory)")
    p.add_argument("--reps", type=int, default=50, help="max timed calls per measurement")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before each measurement")
    p.add_argument("--budget-ms", type=float, default=300.0, help="target measured time per measurement")
    p.add_argument("--no-split", action="store_true", help="time only the end-to-end ms")
    p.add_argument("--check", action="store_true", help="compare every method's output with reference_attention "
                                                        "(where H_q * C * L <= --check-max-elems)")
    p.add_argument("--check-max-elems", type=float, default=2 ** 29)
    p.add_argument("--check-tol", type=float, default=2e-2)
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes (GPU {SMOKE}; CPU {SMOKE_CPU}), few reps")
    p.add_argument("--device", default=None, help="cuda / cuda:N / cpu (default cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) / float16 / float32 (default on CPU)")
    p.add_argument("--seed", type=int, default=0)
    if defaults.get("out_dir") is None:
        p.add_argument("--out-dir", required=True)
    else:
        p.add_argument("--out-dir", default=str(defaults["out_dir"]), help="(default %(default)s)")
    p.add_argument("--run-tag", default=None, help="rows of this tag are rendered into the md/png (default: this run)")
    p.add_argument("--deadline-s", type=float, default=None, help="start no new configuration after this many seconds")
    p.add_argument("--render-only", action="store_true", help="only re-render md/png from speed.json for --run-tag")
    for k, v in GenParams().__dict__.items():
        p.add_argument("--gen-" + k.replace("_", "-"), type=type(v), default=v, dest="gen_" + k)
    return p.parse_args(argv)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None, defaults: Mapping[str, Any] | None = None) -> int:
    """Run the benchmark; `defaults` as in `parse_args`."""
    t_start = time.time()
    args = parse_args(argv, defaults)
    cmd = "python3 " + " ".join(shlex.quote(a) for a in ([sys.argv[0]] + (list(argv) if argv is not None else sys.argv[1:])))
    out_dir = Path(args.out_dir)
    json_path, md_path, png_path = out_dir / "speed.json", out_dir / "speed_attention.md", out_dir / "speed_attention.png"
    meta_path = out_dir / "speed_attention_meta.json"
    if args.render_only:
        if not args.run_tag:
            raise SystemExit("--render-only needs --run-tag")
        rows = [r for r in load_rows(json_path) if r.get("bench") == "attention" and r.get("run_tag") == args.run_tag]
        metas = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        meta = next((v for v in metas.values() if v.get("run_tag") == args.run_tag), {"run_tag": args.run_tag})
        md_path.write_text(render_markdown(rows, meta))
        print(render_png(rows, png_path) or f"wrote {md_path}, {png_path}")
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = dict(FULL, head_dim=128, page_size=64)
    if args.smoke:
        sizes = dict(sizes, **(SMOKE if device.type == "cuda" else SMOKE_CPU))
    args.head_dim = args.head_dim or sizes["head_dim"]
    args.page_size = args.page_size or sizes["page_size"]
    if args.union_window is not None and (args.union_window <= 0 or args.union_window % args.page_size):
        raise SystemExit(f"--union-window {args.union_window}: a positive multiple of the page size {args.page_size}")
    if args.smoke:  # a functional run: on the CPU one timed call per measurement
        cuda = device.type == "cuda"
        args.reps, args.min_reps = min(args.reps, 5 if cuda else 1), min(args.min_reps, 2 if cuda else 1)
        args.warmup, args.budget_ms = (1, 50.0) if cuda else (0, 0.0)
    contexts = ints(args.contexts or sizes["contexts"])
    chunks = ints(args.chunks or sizes["chunks"])
    batches = ints(args.batches or sizes["batches"])
    heads = [tuple(int(x) for x in h.split("/")) for h in (args.heads or sizes["heads"]).split(",")]
    budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    methods = select_methods(args.methods, budgets, HAVE_FI and device.type == "cuda")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    gp = GenParams(**{k: getattr(args, "gen_" + k) for k in GenParams().__dict__})

    now = datetime.datetime.now(datetime.timezone.utc)
    run_id = now.strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}"
    run_tag = args.run_tag or run_id
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    meta = dict(run_id=run_id, run_tag=run_tag, cmd=cmd, gpu=gpu, date=now.isoformat(timespec="seconds"),
                torch=torch.__version__, flashinfer=FI_VERSION, cuda=torch.version.cuda, python=platform.python_version(),
                page_size=args.page_size, head_dim=args.head_dim, dtype=str(dtype).replace("torch.", ""),
                inputs=gp.describe(), gen_params=gp.__dict__, methods=[m.name for m in methods],
                timing=dict(reps=args.reps, min_reps=args.min_reps, warmup=args.warmup, budget_ms=args.budget_ms,
                            l2_flush_mb=256 if device.type == "cuda" else 0),
                selector_params=dict(alpha=args.alpha, query_stride=args.query_stride, xattn_threshold=args.xattn_threshold, xattn_stride=args.xattn_stride,
                                     sink_blocks=args.sink_blocks, recent_blocks=args.recent_blocks,
                                     union_window=args.union_window,
                                     quoka_query_ratio=args.quoka_query_ratio, quoka_kv_budget=args.quoka_kv_budget))
    metas = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    metas[run_id] = meta
    save_json(meta_path, metas)
    print(f"[bench_attention] {gpu}; torch {torch.__version__}; flashinfer {FI_VERSION}; run {run_id}", flush=True)

    configs = [(hq, hk, bsz, ch, ctx) for (hq, hk) in heads for bsz in batches for ch in chunks for ctx in contexts]
    timer = Timer(device, args.reps, args.min_reps, args.warmup, args.budget_ms)
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(configs) * len(methods), desc="attention", dynamic_ncols=True)
    except ImportError:
        bar = None
    all_rows: list[dict] = []
    for ci, (hq, hk, bsz, ch, ctx) in enumerate(configs):
        window = args.union_window or CompactConfig(block_size=args.page_size).window_tokens(ch)
        base = dict(bench="attention", gpu=gpu, date=meta["date"], context=ctx, chunk=ch, batch=bsz, q_heads=hq,
                    kv_heads=hk, head_dim=args.head_dim, page_size=args.page_size, dtype=meta["dtype"], run_id=run_id,
                    run_tag=run_tag, cmd=cmd, inputs=meta["inputs"], union_window=window)
        rows: list[dict] = []
        run, why, why_status = None, "", "skipped"
        if args.deadline_s is not None and time.time() - t_start > args.deadline_s:
            why = f"not run: --deadline-s {args.deadline_s:g} passed"
        else:
            try:
                if bar is not None:
                    bar.set_postfix_str(f"ctx {ctx} chunk {ch} B {bsz} heads {hq}/{hk}: inputs")
                batch = structured_batch([ctx] * bsz, [ch] * bsz, hq, hk, args.head_dim, args.page_size, device=device,
                                         dtype=dtype, seed=args.seed + ci, gp=gp, window_pages=window // args.page_size)
                run = ConfigRun(args, batch, timer)
            except torch.OutOfMemoryError as e:
                why, why_status = f"out of memory building inputs: {str(e).splitlines()[0][:200]}", "oom"
            except Exception as e:  # noqa: BLE001
                why, why_status = f"inputs/shared kernels failed: {type(e).__name__}: {str(e)[:300]}", "error"
                traceback.print_exc(file=sys.stderr)
        for mi, m in enumerate(methods):
            row = dict(base, method=m.name, density=m.fixed_density, ms=None, speedup_vs_dense=None, overhead_frac=None,
                       status="ok", order=mi, query_stride=query_stride_run(args, m))
            if run is None:
                row.update(status=why_status, note=why)
            else:
                if bar is not None:
                    bar.set_postfix_str(f"ctx {ctx} chunk {ch} B {bsz} heads {hq}/{hk}: {m.name}")
                try:
                    run.run(m, row)
                    timer.sync()
                except Skip as e:
                    row.update(status="skipped", note=str(e))
                except torch.OutOfMemoryError as e:
                    row.update(status="oom", ms=None, note=f"out of memory: {str(e).splitlines()[0][:200]}")
                except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
                    row.update(status="error", ms=None, note=f"{type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc(file=sys.stderr)
                if row["status"] != "ok":
                    row["ms"] = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            if bar is not None:
                bar.update(1)
        finish_rows(rows)
        all_rows += rows
        stored = load_rows(json_path)
        save_json(json_path, stored + rows)
        del run
        batch = None  # noqa: F841
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    tagged = [r for r in load_rows(json_path) if r.get("bench") == "attention" and r.get("run_tag") == run_tag]
    md_path.write_text(render_markdown(tagged, meta))
    try:
        png_note = render_png(tagged, png_path)
    except Exception as e:  # noqa: BLE001  (the rows and the table are already written)
        png_note = f"no PNG: {type(e).__name__}: {e}"
    print()
    print_summary(all_rows)
    print_pivots(all_rows)
    bad = [r for r in all_rows if r["status"] in ("error", "oom")]
    failed_checks = [r for r in all_rows if "CHECK FAILED" in (r.get("note") or "")]
    print(f"\nrows -> {json_path} ({len(all_rows)} new, {len(bad)} error/oom, {len(failed_checks)} failed checks); "
          f"table -> {md_path}; {png_note or 'plot -> ' + str(png_path)}; {time.time() - t_start:.0f} s")
    for r in bad:
        print(f"  {r['status']}: {r['method']} ctx {r['context']} chunk {r['chunk']} B {r['batch']} "
              f"{r['q_heads']}/{r['kv_heads']}: {(r.get('note') or '')[:160]}")
    return 2 if failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
