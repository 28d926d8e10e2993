#!/usr/bin/env python3
"""The densities a fixed-budget selector reads over one prompt, replayed on the host (no model, no GPU).

A selector that fixes its rows from the lengths alone (`budget`, `quest_budget`, `mass_budget`: every row reads
`row_budget(context pages, density, forced, min_pages)` pages) reads the same share of pages whatever the prompt
says, so what a server will report for a prompt of E tokens can be computed before any run: each chunked-prefill
pass is built with the server's own objects (`QBlocks.build`, the gate's `sparse_range` and `dense_windows`,
`Selector.row_pages`) and two means are printed:

* `per-pass`: the mean over the prompt's sparse forward passes of the share of context pages they read, the
  figure `sglang:compact_density_forward` reports (and the accuracy rows' `density`);
* `page-weighted`: pages read over context pages summed over every pass of the prompt, dense ones (context below
  the gate, the dense tail, windows turned dense by `dense_above`) reading all of theirs: what
  `sglang:compact_prompt_pages_read_total / ..._pages_total` report (the rows' `prompt_density`), each pass weighed
  by its context, as its attention costs.

    python3 scripts/budget_density.py --lengths 16360 32450 --selector quest_budget \\
        --params density=0.28,min_pages=128 --min-context 512 6144 --dense-above 0.507

`--dense-above`: the cost model's break-even density on the GPU in question (the server prints it and exports
`sglang:compact_gate_dense_above`; 0.507 for Qwen2.5-Coder-0.5B on the H200 with fa3 rows); 1 never turns a window
dense. The layers of a pass all read the same rows here (no `layer_density`, no dense layers)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.eval.fidelity import _parse_params as parse_method_params  # noqa: E402  (the methods' 'k=v,...')
from sglang_compact.batch import QBlocks  # noqa: E402
from sglang_compact.config import CompactConfig  # noqa: E402
from sglang_compact.gate import Gate, GateDecision  # noqa: E402
from sglang_compact.selectors import make_selector  # noqa: E402


def prompt_densities(config: CompactConfig, prompt_len: int, chunk: int, dense_above: float = 1.0
                     ) -> dict[str, float | int | None]:
    """{per_pass, page_weighted, sparse_passes, passes} of one prompt of `prompt_len` tokens prefilled in chunks
    of `chunk` tokens by a server with `config` (its `min_context` set) and the gate's `dense_above`."""
    if config.min_context is None:
        raise ValueError("prompt_densities needs config.min_context (the gate's decision to replay)")
    selector = make_selector(config)
    if selector.own_layers() or not config.spec.fixes_row_lengths:
        raise ValueError(f"selector {config.selector!r} with these parameters does not fix one row length per "
                         "window from the lengths alone: its density depends on the scores")
    gate = Gate(config, GateDecision(config.min_context, "flag", ""), config.window_tokens(chunk), dense_above)
    P = config.block_size
    ranges = [gate.sparse_range(prompt_len)]
    per_pass, read, total, passes = [], 0.0, 0, 0
    for prefix in range(0, prompt_len, chunk):
        passes += 1
        qb = QBlocks.build([prefix], [min(chunk, prompt_len - prefix)], P, gate.window // P, ranges)
        context = [last + 1 for last in qb.w_last]
        total += sum(context)
        if not qb.any_sparse:
            read += sum(context)
            continue
        rows = selector.row_pages(SimpleNamespace(qblocks=qb, num_kv_heads=1))
        turned = set(gate.dense_windows(qb, qb.window_density(rows, 1)))
        pages = [n if (not s or w in turned) else k
                 for w, (n, s, k) in enumerate(zip(context, qb.w_sparse, rows))]
        selecting = sum(n for n, s in zip(context, qb.w_sparse) if s)
        per_pass.append(sum(k for k, s in zip(pages, qb.w_sparse) if s) / selecting)
        read += sum(pages)
    return dict(per_pass=sum(per_pass) / len(per_pass) if per_pass else None, page_weighted=read / total,
                sparse_passes=len(per_pass), passes=passes)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", required=True, help="prompt lengths (tokens)")
    p.add_argument("--selector", default="quest_budget")
    p.add_argument("--params", action="append", default=[],
                   help="selector parameters 'k=v,k=v', as the accuracy methods take them (repeat for several)")
    p.add_argument("--min-context", type=int, nargs="+", default=[512], help="the gate's min_context (tokens)")
    p.add_argument("--dense-above", type=float, default=1.0)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--dense-tail", type=int, default=CompactConfig.dense_tail)
    p.add_argument("--sink-blocks", type=int, default=2)
    p.add_argument("--recent-blocks", type=int, default=4)
    a = p.parse_args(argv)
    print("| length | selector parameters | min context | per-pass | page-weighted | sparse passes / passes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for params in a.params or [""]:
        overrides = parse_method_params(params) if params else {}
        for mc in a.min_context:
            config = CompactConfig(block_size=a.page_size, selector=a.selector, selector_params=overrides,
                                   min_context=mc, dense_tail=a.dense_tail, sink_blocks=a.sink_blocks,
                                   recent_blocks=a.recent_blocks).at_chunk(a.chunk)
            for E in a.lengths:
                d = prompt_densities(config, E, a.chunk, a.dense_above)
                pp = "-" if d["per_pass"] is None else f"{d['per_pass']:.3f}"
                print(f"| {E} | {params or '(defaults)'} | {mc} | {pp} | {d['page_weighted']:.3f} | "
                      f"{d['sparse_passes']} / {d['passes']} |")


if __name__ == "__main__":
    main()
