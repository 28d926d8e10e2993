"""Long-context accuracy and fidelity evaluation: the command line of `scripts/eval_longctx.py`.

    # accuracy through a server we start (one at a time), rows -> --results (docs/results/accuracy.json),
    # scored predictions and the server's log -> --out-dir (.out/eval)
    python scripts/eval_longctx.py accuracy --start cpu-compact --selector flashprefill --alpha 0.06 \\
        --lengths 2048 --n 5 --page-size 32 --chunk 256 --min-prefix-len 512
    python scripts/eval_longctx.py accuracy --start cpu-dense --lengths 2048 --n 5
    # ... or through a running server (say what it runs: --method/--params/--device-label)
    python scripts/eval_longctx.py accuracy --url http://127.0.0.1:30000 --method compact-flashprefill \\
        --params '{"alpha": 0.06, "chunk": 1024, "page_size": 64}' --device-label h200
    # offline attention-level fidelity (HF transformers q/k/v, float32 CPU)
    python scripts/eval_longctx.py fidelity --length 2048 --page-size 32 --chunk 256
    # re-render accuracy.md / accuracy.png from accuracy.json
    python scripts/eval_longctx.py report
    # B - A prompt by prompt (same seed), with a bootstrap interval, from two runs' scored predictions
    python scripts/eval_longctx.py paired preds/dense.jsonl preds/compact_flashprefill_alpha0.4.jsonl --length 8192
    # one file per method from several GPU-host calls on the same seed (then `paired` across them)
    python scripts/eval_longctx.py merge merged/ call1/ call2/ call3/

Density of a compact run: from the server's `/metrics` when it exposes
`sglang:compact_density_forward` (our presets pass `--enable-metrics`),
snapshotted around every request; else (or with `--density-mode both`, as
a cross-check) an offline replay of the chunked prefill on the first
`--density-samples` prompts per task and length (`fidelity.offline_density`).
Each request runs on an empty radix cache (`/flush_cache` first) so its
chunks start at token 0, as in the replay.

`--start hf --hf-method M` generates in-process with HF transformers and
chunked sparse prefill (`hf_runner`): the only end-to-end path for
`blocksparse:*` (no unions) and `quoka`; its density is measured on every
prompt. `--hf-device cuda --hf-dtype bfloat16` runs it on a GPU (the dtype
is then recorded in the row's params).

Through a running server (`--url`), a compact method's density comes from
its `/metrics` when the server has `--enable-metrics`; the offline replay
only runs when /metrics has none (or with `--density-mode both`), and
`--density-mode none` never runs it. `scripts/gpu/accuracy_h200.py` runs
every method's server at once on one GPU with these functions.

Start presets (`--start`): `cpu-dense` is SGLang's `torch_native` backend
(stock `sglang.launch_server`); since that backend recomputes attention over
the whole sequence for every chunk (O(L^2) per chunk), it runs the prompt as
one chunk (`--dense-chunk`, default the longest length): dense attention does
not depend on the chunking. `cpu-compact-dense` is our backend with selector
`dense` (the chunked compact pipeline reading every block; token-identical to
torch_native in tests/test_compact_server.py), the cheap dense baseline at
long lengths. `cpu-compact` is our backend with `--selector` and its params.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.eval import results as R
from harness.eval.cmd_accuracy import cmd_accuracy
from harness.eval.cmd_fidelity import cmd_fidelity
from harness.eval.methods import START_PRESETS
from harness.eval.tasks import TASKS
from sglang_compact.config import CompactConfig


def cmd_paired(args) -> int:
    from harness.eval.paired import main_paired
    try:
        print(main_paired(args.a, args.b, args.length, args.tasks, args.n_boot), end="")
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"eval_longctx paired: {e}")
    return 0


def cmd_merge(args) -> int:
    from harness.eval.paired import merge_predictions
    try:
        counts = merge_predictions(args.runs, args.out)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"eval_longctx merge: {e}")
    for name, n in counts.items():
        print(f"{args.out}/{name}: {n} prompts")
    return 0


def cmd_report(args) -> int:
    for p in R.regenerate(args.results):
        print(f"wrote {p}")
    return 0


# --- argument parsing --------------------------------------------------------------------------------------

def _path_flag(p: argparse.ArgumentParser, flag: str, default: Any, help: str, required: bool = False,
               type=Path) -> None:
    """A path flag with the entry point's default (none given: no default, and `required` makes it required)."""
    if default is None:
        p.add_argument(flag, type=type, required=required, help=help)
    else:
        p.add_argument(flag, type=type, default=type(default), help=help + " (default %(default)s)")


def _common(p: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    _path_flag(p, "--model", defaults.get("model"), "HF model folder (tokenizer, and weights for offline)",
               required=True, type=str)
    _path_flag(p, "--results", defaults.get("results"), "accuracy.json the rows are appended to "
               "(fidelity: fidelity.json beside it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256, help="chunked prefill size (a multiple of --page-size)")
    p.add_argument("--min-prefix-len", type=int, default=512, metavar="TOKENS",
                   help="min_context: windows (a chunk's tokens in one union window) with less context read "
                        "every page (the server's --compact-min-context; default %(default)s)")
    p.add_argument("--sink-blocks", type=int, default=2)
    p.add_argument("--recent-blocks", type=int, default=4)
    p.add_argument("--no-write", action="store_true", help="print the rows, write nothing (no file at all)")


def build_parser(defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """The command line. `defaults`: its default paths, from the entry point (`scripts/eval_longctx.py`):
    `model` (HF folder), `results` (accuracy.json), `out_dir` (predictions and server logs of `accuracy`). A path
    without a default must be given on the command line where it is used (`--model` always)."""
    defaults = dict(defaults or {})
    ap = argparse.ArgumentParser(prog="eval_longctx", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy", help="RULER-style accuracy through a server")
    _common(a, defaults)
    _path_flag(a, "--out-dir", defaults.get("out_dir"), "scored predictions (JSONL) and the started server's log")
    a.add_argument("--url", help="an already running server")
    a.add_argument("--start", choices=START_PRESETS, help="start one server for this run (CPU presets)")
    a.add_argument("--method", help="with --url: the method label (dense, compact-flashprefill, ...)")
    a.add_argument("--params", help="with --url: JSON of the server's method parameters, for the row")
    a.add_argument("--device-label", help="the row's device (default cpu with --start)")
    a.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    a.add_argument("--lengths", nargs="+", type=int, default=[2048])
    a.add_argument("--n", type=int, default=5, help="samples per task and length")
    a.add_argument("--hf-method", help="with --start hf: dense | compact:SEL[:k=v,..] | blocksparse:SEL[:k=v,..] "
                   "| quoka[:query_ratio=..,kv_budget=..]")
    a.add_argument("--hf-device", default="cpu", help="with --start hf: torch device of the model (cpu, cuda)")
    a.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="with --start hf: model dtype (recorded in the row's params unless float32)")
    a.add_argument("--selector", default=CompactConfig.selector,
                   help="cpu-compact: the selector (default: the package's, %(default)s)")
    a.add_argument("--selector-params", help="JSON")
    a.add_argument("--alpha", type=float)
    a.add_argument("--threshold", type=float)
    a.add_argument("--top-p", dest="top_p", type=float)
    a.add_argument("--budget-density", type=float, default=None,
                   help="density of a fixed-budget selector (quest_budget, budget, mass_budget)")
    a.add_argument("--dense-tail", type=int, default=None, metavar="TOKENS",
                   help="cpu-compact: the server's --compact-dense-tail, the prompt's last TOKENS read every page "
                        "(default: its default)")
    a.add_argument("--dense-chunk", type=int, default=None, help="cpu-dense chunk size (default the longest length)")
    a.add_argument("--density-mode", dest="density", choices=("offline", "both", "none"), default="offline",
                   help="compact density when the server's /metrics lacks it: offline replay (default); "
                        "both: also replay offline next to the server's figure (density_offline)")
    a.add_argument("--density-samples", type=int, default=1, help="prompts per task and length for offline density")
    a.add_argument("--no-flush", action="store_true", help="keep the radix cache between samples")
    a.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for a started server (repeat; e.g. --server-arg=--mem-fraction-static=0.2)")
    a.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS of a started server (1 avoids thread thrashing on a shared CPU)")
    a.set_defaults(func=cmd_accuracy)
    f = sub.add_parser("fidelity", help="offline attention-level fidelity on HF q/k/v")
    _common(f, defaults)
    f.add_argument("--task", default="niah_single_number", choices=list(TASKS))
    f.add_argument("--length", type=int, default=2048)
    f.add_argument("--index", type=int, default=0)
    f.add_argument("--methods", nargs="+", help="e.g. dense compact:flashprefill:alpha=0.06 "
                   "blocksparse:xattention:threshold=0.9 quoka:query_ratio=0.25,kv_budget=0.25")
    f.set_defaults(func=cmd_fidelity)
    r = sub.add_parser("report", help="re-render accuracy.md / accuracy.png")
    _path_flag(r, "--results", defaults.get("results"), "accuracy.json (md/png written beside it)",
               required=True)
    r.set_defaults(func=cmd_report)
    pr = sub.add_parser("paired", help="B - A on the same prompts, from two scored-prediction JSONL files")
    pr.add_argument("a", help="JSONL of method A (e.g. preds/dense.jsonl of accuracy_h200.py)")
    pr.add_argument("b", nargs="+", help="JSONL of method B (several: a summary table first)")
    pr.add_argument("--length", type=int, required=True)
    pr.add_argument("--tasks", nargs="+", choices=list(TASKS), help="default: every task both files have")
    pr.add_argument("--n-boot", type=int, default=2000)
    pr.set_defaults(func=cmd_paired)
    mg = sub.add_parser("merge", help="one JSONL per method from several runs' scored predictions (same seed)")
    mg.add_argument("out", help="folder for the merged files")
    mg.add_argument("runs", nargs="+", help="run folders (each holding preds/*.jsonl, or the *.jsonl directly)")
    mg.set_defaults(func=cmd_merge)
    return ap


def main(argv: Sequence[str] | None = None, defaults: Mapping[str, Any] | None = None) -> int:
    """Run the command line; `defaults` as in `build_parser`."""
    args = build_parser(defaults).parse_args(argv)
    return args.func(args)
