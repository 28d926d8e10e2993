"""`eval_longctx.py accuracy`: RULER-style accuracy of one method through a server (one we start, or `--url`) or
in-process with HF transformers (`--start hf`); rows appended to `--results`, scored predictions and the started
server's log under `--out-dir` (nothing at all with `--no-write`)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.eval import results as R
from harness.eval.client import Client
from harness.eval.methods import compact_server_args, method_and_params, selector_params
from harness.eval.rows import HF_DENSITY_SOURCE, SERVER_DENSITY_SOURCE, accuracy_rows, cell_densities
from harness.eval.runs import offline_densities, run_samples, run_samples_hf
from harness.eval.tasks import load_tokenizer, make_suite


def start_server(args, log_path: Path | None):
    """The server of a `--start` preset (not started yet); `log_path` None: its output is kept in memory only."""
    from harness.server import SGLangServer
    max_len = max(args.lengths)
    env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None
    common = dict(max_total_tokens=max(2 * max_len, 4096), max_running_requests=4, log_path=log_path,
                  start_timeout=600.0, request_timeout=3600.0, env=env)
    if args.start == "cpu-dense":
        chunk = args.dense_chunk or max_len
        # one big chunk: SGLang's auto --mem-fraction-static leaves no KV room for an 8K chunk on the CPU
        extra = ["--attention-backend", "torch_native", "--mem-fraction-static", "0.1"]
        return SGLangServer(args.model, module="sglang.launch_server", page_size=args.page_size,
                            chunked_prefill_size=chunk, extra_args=extra + list(args.server_arg), **common)
    if args.start == "cpu-compact-dense":
        extra = compact_server_args("dense", {}, args.min_prefix_len, args.sink_blocks, args.recent_blocks)
    else:
        extra = compact_server_args(args.selector, selector_params(args), args.min_prefix_len, args.sink_blocks,
                                    args.recent_blocks)
    return SGLangServer(args.model, module="sglang_compact.launch_server", page_size=args.page_size,
                        chunked_prefill_size=args.chunk, extra_args=extra + list(args.server_arg), **common)


@dataclass
class AccuracyOutputs:
    """Where a run writes; None: not written."""
    predictions: Path | None   # JSONL of scored predictions
    server_log: Path | None    # the started server's output
    results: Path | None       # accuracy.json the rows are appended to (md/png re-rendered beside it)


def accuracy_outputs(args, method: str, stamp: str) -> AccuracyOutputs:
    """The files of an `accuracy` run: none with `--no-write`; else under `--out-dir` and `--results`, which the
    command line must give (the harness has no default paths of its own)."""
    if args.no_write:
        return AccuracyOutputs(None, None, None)
    missing = [flag for flag, v in (("--out-dir", args.out_dir), ("--results", args.results)) if v is None]
    if missing:
        sys.exit(f"accuracy: give {' and '.join(missing)} (or --no-write)")
    out_dir = Path(args.out_dir)
    return AccuracyOutputs(out_dir / f"{stamp}-{method}.jsonl", out_dir / f"{stamp}-{method}-server.log",
                           Path(args.results))


def cmd_accuracy(args) -> int:
    if (args.url is None) == (args.start is None):
        sys.exit("give exactly one of --url and --start")
    if args.url and not args.method:
        sys.exit("--url needs --method (what the server runs), e.g. dense or compact-flashprefill")
    tok = load_tokenizer(args.model)
    samples = make_suite(tok, args.tasks, args.lengths, args.n, args.seed)
    if args.start == "hf" and not args.hf_method:
        sys.exit("--start hf needs --hf-method (e.g. quoka, blocksparse:flashprefill:alpha=0.06)")
    method, params = method_and_params(args)
    hf_device = getattr(args, "hf_device", None)
    device = args.device_label or (hf_device if args.start == "hf" and hf_device not in (None, "cpu")
                                   else f"cpu ({os.cpu_count()} cores)" if args.start else "unknown")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    outs = accuracy_outputs(args, method, stamp)
    if outs.predictions is not None:
        outs.predictions.parent.mkdir(parents=True, exist_ok=True)
    print(f"{len(samples)} samples ({', '.join(args.tasks)}; lengths {args.lengths}; n={args.n}); method {method} "
          f"{params}; predictions -> {outs.predictions or 'not written (--no-write)'}", file=sys.stderr)
    server = None
    t_start = time.monotonic()
    with (open(outs.predictions, "w") if outs.predictions else contextlib.nullcontext()) as lf:
        try:
            if args.start == "hf":
                recs, hf_densities = run_samples_hf(args, samples, method, log_file=lf)
            elif args.start:
                server = start_server(args, outs.server_log)
                server.start()
                print(f"server up in {server.startup_seconds:.0f}s at {server.base_url} "
                      f"(log {server.log_path or 'kept in memory'})", file=sys.stderr)
                client = Client(server.base_url)
            else:
                client = Client(args.url)
            if args.start != "hf":
                recs = run_samples(client, samples, method, flush=not args.no_flush, log_file=lf)
        finally:
            if server is not None:
                server.stop()
    wall = time.monotonic() - t_start
    densities: dict[tuple, float] = {}
    offline_by_key: dict[tuple, float] = {}
    density_source = None
    if args.start == "hf":
        densities = hf_densities
        density_source = HF_DENSITY_SOURCE if densities else None
    elif method != "dense" and method != "compact-dense":
        by_key = cell_densities(recs)
        if by_key:
            densities = by_key
            density_source = SERVER_DENSITY_SOURCE
        if method.startswith("compact-") and (args.density == "both" or (args.density == "offline" and not by_key)):
            offline = offline_densities(args, samples, method, params)
            src = f"offline replay ({args.density_samples} prompt(s) per task and length)"
            if not by_key:
                densities, density_source = offline, src
            else:
                offline_by_key = offline
    elif method == "compact-dense":
        density_source = "dense selector"
    rows = accuracy_rows(recs, model=Path(args.model).name, method=method, params=params, device=device,
                         tasks=args.tasks, lengths=args.lengths, densities=densities, density_source=density_source,
                         offline_densities=offline_by_key,
                         dense_selector=method == "compact-dense" and args.start != "hf")
    if outs.results is None:
        print(json.dumps(rows, indent=1))
    else:
        R.append_rows(rows, outs.results)
        written = R.regenerate(outs.results)
        print("wrote " + ", ".join(str(p) for p in [outs.results, *written]), file=sys.stderr)
    for r in rows:
        print(f"{r['task']:>20} @ {r['length']}: acc {r['accuracy']:5.1f} (all-of {r['accuracy_all']:5.1f})"
              f" density {r['density']} {r['seconds_per_sample']:.1f} s/sample")
    print(f"total {wall:.0f}s for {len(recs)} samples ({wall / max(len(recs), 1):.1f} s/sample incl. start-up)")
    return 0
