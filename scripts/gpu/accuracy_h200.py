#!/usr/bin/env python3
"""RULER-style accuracy of SmolLM2-135M-Instruct on one H200: every method at once, within a deadline.

    source scripts/gpu/setup.sh
    python3 scripts/gpu/accuracy_h200.py --out $OUT            # --dry-run: print the plan, start nothing

One SGLang server per server method, all started together on the one GPU
(distinct ports, small capped KV pools), then evaluated together: one client
thread per server, through `harness.eval.runs.run_samples` (URL mode:
greedy, `/flush_cache` before every prompt, density from the server's
`/metrics`, never the offline replay). Server methods (`--methods`):
  dense                   stock `sglang.launch_server --attention-backend flashinfer`
  compact:SEL[:k=v,...]   `sglang_compact.launch_server --attention-backend compact --compact-selector SEL`
                          (min context 512, sink 2, recent 4 as in the CPU rows; `--enable-metrics`);
                          k=v may include dense_tail=N (`--compact-dense-tail N`: the prompt's last N
                          tokens read every page; default the backend's), recorded in every compact
                          row's params, and dense_layers=IDS (`--compact-dense-layers`, ids and ranges
                          joined by '+': dense_layers=21-23), recorded when given, and dense_above=D
                          (`--compact-dense-above D`; default the server's cost model's), recorded when given
HF methods (`--hf-methods`, e.g. quoka, blocksparse:flashprefill:alpha=0.4) run
in-process with HF transformers (`harness.eval.hf_runner`) on the GPU,
in a child process of this script, alongside the servers, on the first
`--hf-n` prompts of each cell. The child starts once the servers are up (or
given up on), so that its memory does not move under their KV-pool sizing.

Schedule: cells (length, task) in a fixed order, lengths outer, or the
`--cells LENGTH/TASK ...` given, in their order. Every server
method finishes a cell before any starts the next, so when the deadline hits
all methods have the same cells; a cell cut by the deadline is dropped for
every method (its predictions stay in the JSONL logs). A cell that clearly
cannot finish in the time left (1.5x the longest cell of its length so far)
is not started. The HF child keeps its own schedule (the same cells unless
`--hf-cells` names others; its methods one after the other per cell) and
records why it stopped. A cell's prompts do not depend on the other cells, so
runs with different cell lists can be compared prompt by prompt.

Rows (schema of docs/results/accuracy.json, device: the GPU's model) are appended to
`--results` (default $OUT/accuracy.json, first copied from
docs/results/accuracy.json) when a cell is done, and accuracy.md/.png are
re-rendered beside it at the end. Also under --out: logs/ (server logs, HF
child log), preds/ (one JSONL of scored predictions per method),
accuracy_h200_summary.json (commands, start times, cells, stop reasons).
Every server runs in its own process group and is killed at the end, on
errors and on SIGTERM/SIGINT.

Memory: SGLang sizes the KV pool from the free memory it measures around
its own weight loading (`--mem-fraction-static f`: pool = free_now - (1 - f) *
free_before_load). Servers starting together see each other's allocations in
between, so a small f (0.06) can leave a late server no pool at all; f=0.3
with `--max-total-tokens` 65536 (1.5 GiB of KV per server) leaves room for
the others' allocations whatever the order.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

T0 = time.monotonic()
_PROCESS_START = [T0]   # the first main() of a process counts its deadline from here (imports included)
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository root: `harness`
# the accuracy.json a new --results starts from
BASE_RESULTS = REPO / "docs" / "results" / "accuracy.json"

from harness.eval import results as R  # noqa: E402
from harness.eval.client import Client  # noqa: E402
from harness.eval.methods import compact_method_params, compact_server_args, file_label, hf_method_params  # noqa: E402
from harness.eval.rows import HF_DENSITY_SOURCE, SERVER_DENSITY_SOURCE, accuracy_rows, cell_densities  # noqa: E402
from harness.eval.runs import load_hf_model, run_samples, run_samples_hf  # noqa: E402
from harness.eval.tasks import TASKS, LENGTHS  # noqa: E402

DEFAULT_METHODS = (
    "dense",
    "compact:flashprefill:alpha=0.2", "compact:flashprefill:alpha=0.4", "compact:flashprefill:alpha=0.6",
    "compact:xattention:threshold=0.9", "compact:oracle:top_p=0.95", "compact:budget:density=0.3",
)
HF_METHOD_EXAMPLES = ("quoka", "blocksparse:flashprefill:alpha=0.4")
MEMORY_ERRORS = ("out of memory", "not enough memory", "leave no gpu memory", "outofmemoryerror")
SKIP_FACTOR = 1.5   # a cell is not started when 1.5x its estimate already exceeds the time left

Cell = tuple[int, str]  # (length, task)


# --- methods ---------------------------------------------------------------------------------------------

@dataclass
class MethodRun:
    """One method of the run: how it is served (or run in-process) and how its rows are labelled."""

    spec: str                        # as given on the command line
    kind: str                        # server | hf
    method: str                      # the rows' method
    params: dict[str, Any]           # the rows' params
    density_key: str | None = None   # record field holding the per-prompt density
    density_source: str | None = None
    dense_selector: bool = False
    module: str | None = None        # server launcher module
    extra_args: list[str] = field(default_factory=list)
    server: Any = None
    status: str = "pending"
    error: str | None = None
    start_seconds: float | None = None

    @property
    def label(self) -> str:
        return file_label(self.spec)


def server_run(spec: str, a) -> MethodRun:
    """A server method from its spec: `dense` or `compact:SELECTOR[:k=v,...]`."""
    from harness.eval.fidelity import parse_method
    m = parse_method(spec)
    common = ["--mem-fraction-static", str(a.mem_fraction_static),
              "--cuda-graph-max-bs-decode", str(a.cuda_graph_max_bs), "--disable-prefill-cuda-graph"]
    if a.sleep_on_idle:
        common.append("--sleep-on-idle")
    if m.kind == "dense":
        return MethodRun(spec, "server", "dense", {"backend": "flashinfer", "chunk": a.chunk, "page_size": a.page_size},
                         module="sglang.launch_server",
                         extra_args=["--enable-metrics", "--attention-backend", "flashinfer", *common,
                                     *a.server_arg])
    if m.kind != "compact":
        raise ValueError(f"{spec!r}: server methods are dense | compact:SELECTOR[:k=v,...]; "
                         "blocksparse:* and quoka run in-process (--hf-methods)")
    sel_params = dict(m.params)
    method, params = compact_method_params(m.selector, sel_params, chunk=a.chunk, page_size=a.page_size,
                                           min_context=a.min_prefix_len, sink_blocks=a.sink_blocks,
                                           recent_blocks=a.recent_blocks)
    extra = compact_server_args(m.selector, sel_params, a.min_prefix_len, a.sink_blocks, a.recent_blocks)
    if getattr(a, "recall_every", 0) and m.selector != "dense":
        extra += ["--compact-recall-every", str(a.recall_every)]   # per-prompt `server_recall` in the records
    return MethodRun(spec, "server", method, params, density_key="server_density",
                     density_source=SERVER_DENSITY_SOURCE, dense_selector=m.selector == "dense",
                     module="sglang_compact.launch_server", extra_args=[*extra, *common, *a.compact_arg, *a.server_arg])


def hf_run(spec: str, a) -> MethodRun:
    method, params = hf_method_params(spec, chunk=a.chunk, page_size=a.page_size, min_context=a.min_prefix_len,
                                      sink_blocks=a.sink_blocks, recent_blocks=a.recent_blocks, dtype=a.hf_dtype)
    return MethodRun(spec, "hf", method, params, density_key="density", density_source=HF_DENSITY_SOURCE)


def make_server(run: MethodRun, a, log_dir: Path, port: int | None):
    from harness.server import SGLangServer
    return SGLangServer(a.model_dir, module=run.module, device="cuda", dtype="bfloat16", page_size=a.page_size,
                        chunked_prefill_size=a.chunk, max_total_tokens=a.max_total_tokens, max_running_requests=4,
                        extra_args=run.extra_args, port=port, log_path=log_dir / f"server-{run.label}.log",
                        start_timeout=a.start_timeout, request_timeout=a.request_timeout, cwd=REPO)


# --- the cell schedule --------------------------------------------------------------------------------------

def cell_order(lengths: Sequence[int], tasks: Sequence[str]) -> list[Cell]:
    return [(L, t) for L in lengths for t in tasks]


def _min_prefix_len(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: auto or a number of tokens") from None


def parse_cell(text: str) -> Cell:
    """`LENGTH/TASK` (as `8192/niah_multikey`) -> (length, task); argparse type of `--cells`."""
    length, sep, task = text.partition("/")
    if not sep or not length.strip().isdigit() or int(length) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a cell is LENGTH/TASK, as 8192/niah_multikey")
    if task not in TASKS:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown task {task!r}; known: {', '.join(TASKS)}")
    return int(length), task


def cell_samples(tokenizer, cells: Sequence[Cell], n: int, seed: int) -> dict[Cell, list]:
    """The first `n` prompts of every cell, as `make_suite` would make them (the same prompts for any cell list)."""
    from harness.eval.tasks import make_sample
    return {(L, t): [make_sample(t, L, i, tokenizer, seed=seed) for i in range(n)] for L, t in cells}


def estimate_cell(cell: Cell, seconds: dict[Cell, float]) -> float | None:
    """Longest finished cell of the same length; else the longest of the last length done, scaled by length."""
    same = [s for (L, _), s in seconds.items() if L == cell[0]]
    if same:
        return max(same)
    if not seconds:
        return None
    last_len = list(seconds)[-1][0]
    return max(s for (L, _), s in seconds.items() if L == last_len) * cell[0] / last_len


@dataclass
class ScheduleResult:
    done: list[Cell] = field(default_factory=list)
    stopped: str | None = None                       # why cells are left; None when all were done
    failed: dict[str, str] = field(default_factory=dict)
    cell_seconds: dict[Cell, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"cells_done": [list(c) for c in self.done], "stopped": self.stopped, "failed": self.failed,
                "cell_seconds": {f"{L}/{t}": round(s, 1) for (L, t), s in self.cell_seconds.items()}}


def run_schedule(workers: Sequence, cells: Sequence[Cell], samples: dict[Cell, list], deadline: float,
                 on_cell_done: Callable[[Cell, dict[str, list]], None], *, parallel: bool = True,
                 clock: Callable[[], float] = time.monotonic, grace: float = 5.0,
                 log: Callable[[str], None] = print) -> ScheduleResult:
    """Run `cells` in order; every live worker finishes a cell before the next starts.

    A worker has `label` and `run_cell(samples, stop) -> records` (it checks `stop()` before each sample and
    returns early when it is true). `parallel`: the workers of a cell run at once (one thread each), else one
    after the other in this thread. A cell counts when every live worker returned all its records;
    `on_cell_done(cell, {label: records})` is then called (in this thread). A worker that raises is dropped
    (`failed`); the others go on. When the deadline cuts a cell, that cell is dropped for every worker and the
    schedule ends.
    """
    res = ScheduleResult()
    alive = list(workers)
    ex = cf.ThreadPoolExecutor(max_workers=max(len(alive), 1), thread_name_prefix="cell") if parallel else None
    try:
        for cell in cells:
            if not alive:
                res.stopped = "no method left (all failed)"
                break
            left = deadline - clock()
            est = estimate_cell(cell, res.cell_seconds)
            if left <= 0 or (est is not None and est * SKIP_FACTOR > left):
                res.stopped = (f"deadline: cell {cell} not started ({left:.0f} s left, estimate "
                               f"{'?' if est is None else f'{est:.0f}'} s)")
                break
            ev = threading.Event()
            stop = lambda: ev.is_set() or clock() >= deadline  # noqa: E731
            todo = samples[cell]
            t_cell = clock()
            outcome: dict[str, tuple[str, Any]] = {}
            if parallel:
                futs = {ex.submit(w.run_cell, todo, stop): w for w in alive}
                cf.wait(futs, timeout=max(deadline - clock(), 0.0))
                if not all(f.done() for f in futs):
                    ev.set()
                    cf.wait(futs, timeout=grace)
                for f, w in futs.items():
                    if not f.done():
                        outcome[w.label] = ("cut", None)
                    elif f.exception() is not None:
                        outcome[w.label] = ("error", f.exception())
                    else:
                        outcome[w.label] = ("ok", f.result())
            else:
                for w in alive:
                    try:
                        outcome[w.label] = ("ok", w.run_cell(todo, stop))
                    except Exception as e:  # noqa: BLE001 - recorded, the others go on
                        outcome[w.label] = ("error", e)
                    if stop():
                        break
            complete: dict[str, list] = {}
            cut = False
            for w in list(alive):
                kind, val = outcome.get(w.label, ("cut", None))
                if kind == "error":
                    res.failed[w.label] = f"{type(val).__name__}: {val} (in cell {cell})"
                    log(f"  {w.label} failed in cell {cell}: {type(val).__name__}: {val}")
                    alive.remove(w)
                elif kind == "ok" and len(val) == len(todo):
                    complete[w.label] = val
                else:
                    cut = True
            if cut:
                res.stopped = f"deadline: cell {cell} cut ({len(complete)}/{len(alive)} methods had finished it)"
                break
            if not complete:
                continue
            res.cell_seconds[cell] = clock() - t_cell
            res.done.append(cell)
            on_cell_done(cell, complete)
        else:
            res.stopped = None
    finally:
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
    return res


class ServerWorker:
    """One method's server, as a schedule worker (through `runs.run_samples`)."""

    def __init__(self, label: str, client, log_file=None):
        self.label = label
        self.client = client
        self.log_file = log_file

    def run_cell(self, samples: list, stop) -> list[dict]:
        return run_samples(self.client, samples, self.label, flush=True, log_file=self.log_file, progress=False,
                           stop=stop)


class HFWorker:
    """One in-process HF method (through `runs.run_samples_hf`, the model loaded once)."""

    def __init__(self, label: str, ns: argparse.Namespace, model, tok, log_file=None):
        self.label, self.ns, self.model, self.tok, self.log_file = label, ns, model, tok, log_file

    def run_cell(self, samples: list, stop) -> list[dict]:
        recs, _ = run_samples_hf(self.ns, samples, self.label, log_file=self.log_file, model=self.model,
                                 tok=self.tok, progress=False, stop=stop)
        return recs


# --- rows -------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock beside `path` (the results file is appended to by this script and its HF child)."""
    import fcntl
    with open(str(path) + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cell_rows(run: MethodRun, cell: Cell, recs: list[dict], model_name: str, device: str) -> list[dict]:
    L, t = cell
    dens = cell_densities(recs, run.density_key) if run.density_key else {}
    return accuracy_rows(recs, model=model_name, method=run.method, params=run.params, device=device, tasks=[t],
                         lengths=[L], densities=dens, density_source=run.density_source if dens else None,
                         dense_selector=run.dense_selector)


def row_writer(runs: dict[str, MethodRun], results: Path, model_name: str, device: str, written: list,
               log: Callable[[str], None] = print, t0: float = T0):
    """`on_cell_done` for `run_schedule`: the cell's rows of every method, appended under the lock."""
    def on_cell_done(cell: Cell, recs_by_label: dict[str, list]) -> None:
        rows = []
        for label, recs in recs_by_label.items():
            rows += cell_rows(runs[label], cell, recs, model_name, device)
        with locked(results):
            R.append_rows(rows, results)
        written.extend(rows)
        parts = []
        for label, recs in recs_by_label.items():
            r = [x for x in rows if x["method"] == runs[label].method and x["params"] == runs[label].params]
            acc = r[0]["accuracy"] if r else float("nan")
            d = r[0]["density"] if r else None
            parts.append(f"{runs[label].spec} {acc:.0f}" + (f"/{d:.2f}" if d is not None else ""))
            if runs[label].density_key and (not r or d is None):
                parts[-1] += " (no density!)"
        log(f"[{time.monotonic() - t0:5.0f}s] cell {cell[0]}/{cell[1]} done: " + "; ".join(parts))
    return on_cell_done


def summary_table(rows: Sequence[dict], runs: Sequence[MethodRun], lengths: Sequence[int]) -> str:
    """method x length -> mean accuracy over the tasks done, mean density, n x tasks."""
    head = f"{'method':<40}" + "".join(f"{str(L) + ' (acc dens n x tasks)':>28}" for L in lengths)
    lines = [head, "-" * len(head)]
    for run in runs:
        line = f"{run.spec if run.kind == 'server' else 'hf ' + run.spec:<40}"
        for L in lengths:
            rs = [r for r in rows if r["method"] == run.method and r["params"] == run.params and r["length"] == L]
            if not rs:
                line += f"{'-':>28}"
                continue
            acc = sum(r["accuracy"] for r in rs) / len(rs)
            ds = [r["density"] for r in rs if r.get("density") is not None]
            dens = f"{sum(ds) / len(ds):.3f}" if ds else "-"
            ns = sorted({r["n"] for r in rs})
            ns = "/".join(map(str, ns))
            cell = f"{acc:5.1f} {dens:>5} {ns}x{len(rs)}"
            line += f"{cell:>28}"
        if run.status not in ("up", "done"):
            line += f"   [{run.status}{': ' + run.error.splitlines()[0][:80] if run.error else ''}]"
        lines.append(line)
    return "\n".join(lines)


# --- HF child process -----------------------------------------------------------------------------------------

def hf_worker_main(a) -> int:
    """`--hf-worker`: the HF methods on the GPU, cell by cell until `--deadline-at` (wall-clock epoch)."""
    out = Path(a.out)
    status_path = out / "hf_status.json"
    runs = {r.label: r for r in (hf_run(s, a) for s in a.hf_methods)}
    status: dict[str, Any] = {"methods": [r.spec for r in runs.values()], "n": a.hf_n, "device": a.hf_device,
                              "dtype": a.hf_dtype, "cells_done": [], "stopped": None, "error": None, "rows": []}

    def save():
        status_path.write_text(json.dumps(status, indent=1) + "\n")

    deadline = time.monotonic() + (a.deadline_at - time.time())
    save()
    try:
        from harness.eval.tasks import load_tokenizer
        ns = argparse.Namespace(model=a.model_dir, hf_device=a.hf_device, hf_dtype=a.hf_dtype, chunk=a.chunk,
                                page_size=a.page_size, min_prefix_len=a.min_prefix_len, sink_blocks=a.sink_blocks,
                                recent_blocks=a.recent_blocks, hf_method=None)
        t = time.monotonic()
        tok = load_tokenizer(a.model_dir)
        model = load_hf_model(ns)
        print(f"HF model on {a.hf_device} ({a.hf_dtype}) in {time.monotonic() - t:.0f}s", flush=True)
        cells = a.hf_cells
        by_cell = cell_samples(tok, cells, a.hf_n, a.seed)
        preds = out / "preds"
        preds.mkdir(parents=True, exist_ok=True)
        files = {label: open(preds / f"hf-{label}.jsonl", "a") for label in runs}
        workers = [HFWorker(label, argparse.Namespace(**{**vars(ns), "hf_method": r.spec}), model, tok, files[label])
                   for label, r in runs.items()]
        results = Path(a.results)
        written: list = status["rows"]
        writer = row_writer(runs, results, a.model_name, a.device_label, written)

        def on_cell_done(cell, recs_by_label):
            writer(cell, recs_by_label)
            status["cells_done"].append(list(cell))
            save()

        res = run_schedule(workers, cells, by_cell, deadline, on_cell_done, parallel=False)
        status["stopped"] = res.stopped
        status["failed"] = res.failed
        status["cell_seconds"] = res.as_dict()["cell_seconds"]
    except Exception as e:  # noqa: BLE001 - recorded for the parent's summary
        import traceback
        traceback.print_exc()
        status["error"] = f"{type(e).__name__}: {e}"
    save()
    return 0 if status["error"] is None else 1


# --- main -------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="output folder (default $OUT)")
    p.add_argument("--results", type=Path, default=None,
                   help="accuracy.json to append to (default OUT/accuracy.json, first copied from "
                        "docs/results/accuracy.json)")
    p.add_argument("--model-dir", default="/tmp/smollm2-hf", help="HF folder of SmolLM2-135M-Instruct (bf16)")
    p.add_argument("--model-name", default="smollm2-135m-instruct", help="the rows' model")
    p.add_argument("--device-label", default=None,
                   help="the rows' device (default: the GPU's model from nvidia-smi, e.g. h100, h200)")
    p.add_argument("--methods", nargs="*", default=list(DEFAULT_METHODS),
                   help="server methods: dense | compact:SELECTOR[:k=v,...] (default: %(default)s)")
    p.add_argument("--hf-methods", nargs="*", default=[],
                   help="in-process HF methods on the GPU: quoka[:..] | blocksparse:SEL[:k=v,..] | compact:.. "
                        f"(e.g. {' '.join(HF_METHOD_EXAMPLES)}; default none: their child process and its "
                        "minutes only when asked for)")
    p.add_argument("--hf-n", type=int, default=5, help="prompts per cell for the HF methods (the first of --n)")
    p.add_argument("--hf-device", default="cuda")
    p.add_argument("--hf-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    p.add_argument("--cells", nargs="+", type=parse_cell, default=None, metavar="LENGTH/TASK",
                   help="run these cells, in this order, instead of every --lengths x --tasks pair")
    p.add_argument("--hf-cells", nargs="*", type=parse_cell, default=None, metavar="LENGTH/TASK",
                   help="the HF methods' cells (default: the server methods' cells; none given: no HF cells)")
    p.add_argument("--n", type=int, default=25, help="prompts per task and length (server methods)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=480.0,
                   help="the whole run, server starts included, ends within this (default %(default)s)")
    p.add_argument("--stop-margin-s", type=float, default=30.0,
                   help="kept at the end for stopping servers and writing (default %(default)s)")
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size of every server")
    p.add_argument("--min-prefix-len", type=_min_prefix_len, default=512, metavar="auto|TOKENS",
                   help="min_context of every method: windows with less context read every page "
                        "(--compact-min-context; auto: the servers' cost gate, as shipped, server methods only; "
                        "default %(default)s)")
    p.add_argument("--recall-every", type=int, default=1, metavar="N",
                   help="compact servers measure their selection's mass recall every N-th sparse pass (one layer in "
                        "turn; records get `server_recall`, rows `recall`); 0: off (default: %(default)s)")
    p.add_argument("--sink-blocks", type=int, default=2)
    p.add_argument("--recent-blocks", type=int, default=4)
    p.add_argument("--mem-fraction-static", type=float, default=0.3,
                   help="per server; see the module docstring (Memory) before lowering it")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool cap per server (tokens)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=4, help="decode CUDA graph batch sizes up to this")
    p.add_argument("--no-sleep-on-idle", dest="sleep_on_idle", action="store_false",
                   help="drop --sleep-on-idle (idle schedulers otherwise spin, one core each)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for every server (repeat; --server-arg=--foo=1)")
    p.add_argument("--compact-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for the compact servers only (e.g. --compact-arg=--compact-prefill-kernel=fa2)")
    p.add_argument("--base-port", type=int, default=None, help="ports BASE, BASE+1, ... (default: free ports)")
    p.add_argument("--start-timeout", type=float, default=420.0, help="per server (capped by the deadline)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--stagger-s", type=float, default=1.0, help="delay between server launches")
    p.add_argument("--straggler-s", type=float, default=150.0,
                   help="once a server is up, wait at most this long for the others (then go on without them)")
    p.add_argument("--min-eval-s", type=float, default=60.0,
                   help="servers not up this long before the work deadline are given up")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and the schedule; start nothing")
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    return p


def gpu_label() -> str:
    """The GPU's model as the rows name it ('h100', 'h200'), from nvidia-smi; 'gpu' where it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
        name = out.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return "gpu"
    model = re.search(r"\b([A-Z]\d{1,4})\b", name)        # H100, H200, A100, T4
    return model.group(1).lower() if model else (name.lower().replace(" ", "-") or "gpu")


def parse_args(argv: Sequence[str] | None = None):
    a = build_parser().parse_args(argv)
    if a.device_label is None and not a.dry_run:
        a.device_label = gpu_label()
    a.results = Path(a.results) if a.results else Path(a.out) / "accuracy.json"
    a.cells = list(a.cells) if a.cells else cell_order(a.lengths, a.tasks)
    a.hf_cells = list(a.cells) if a.hf_cells is None else list(a.hf_cells)
    for name, cells in (("--cells", a.cells), ("--hf-cells", a.hf_cells)):
        if len(set(cells)) != len(cells):
            raise SystemExit(f"{name}: a cell is given twice: {[f'{L}/{t}' for L, t in cells]}")
    a.lengths = list(dict.fromkeys(L for L, _ in a.cells + a.hf_cells))
    if a.min_prefix_len == "auto" and a.hf_methods and a.hf_cells:
        raise SystemExit("--min-prefix-len auto is the servers' cost gate; the HF methods need a number of tokens")
    labels = [file_label(s) for s in a.methods] + ["hf-" + file_label(s) for s in a.hf_methods]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"duplicate methods: {labels}")
    return a


class _Terminated(BaseException):
    pass


def _on_signal(signum, frame):
    raise _Terminated(f"signal {signum}")


def stop_servers(runs: Sequence[MethodRun]) -> None:
    """Kill every server's process group, all at once (SIGTERM, then SIGKILL)."""
    live = [r.server for r in runs if r.server is not None]
    if live:
        with cf.ThreadPoolExecutor(len(live)) as ex:
            list(ex.map(lambda s: s.stop(), live))


def save_compact_metrics(runs: Sequence[MethodRun], log_dir: Path) -> None:
    """Each compact server's `sglang:compact_*` series at the end (logs/metrics-LABEL.txt): which path its
    q-blocks took (sparse, or dense and why), beside the densities the rows hold."""
    for r in runs:
        if r.kind != "server" or r.method == "dense":
            continue
        try:
            text = Client(r.server.base_url, timeout=10).metrics_text()
        except Exception as e:  # noqa: BLE001 (a diagnostic: never fail the run for it)
            text = f"# /metrics not read: {type(e).__name__}: {e}\n"
        lines = [ln for ln in text.splitlines() if ln.startswith(("sglang:compact_", "# /metrics"))]
        (log_dir / f"metrics-{r.label}.txt").write_text("\n".join(lines) + "\n")


def servers_summary(runs: Sequence[MethodRun]) -> dict[str, Any]:
    return {r.spec: {"command": shlex.join(r.server.command), "log": str(r.server.log_path), "status": r.status,
                     "start_seconds": None if r.start_seconds is None else round(r.start_seconds, 1),
                     "error": r.error} for r in runs}


def kill_group(proc: subprocess.Popen | None, grace: float = 3.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.hf_worker:
        return hf_worker_main(a)
    # a later main() in the same process (the tests) counts from its own start, not from the import
    t0 = _PROCESS_START.pop() if _PROCESS_START else time.monotonic()
    out = Path(a.out)
    log_dir, pred_dir = out / "logs", out / "preds"
    server_runs = [server_run(s, a) for s in a.methods]
    hf_runs = [hf_run(s, a) for s in a.hf_methods] if a.hf_cells else []  # no cells: no HF child
    cells = a.cells
    work_deadline = t0 + a.deadline_s - a.stop_margin_s

    ports: list[int | None] = [None] * len(server_runs)
    if a.base_port:
        ports = [a.base_port + i for i in range(len(server_runs))]
    else:
        from harness.server import free_port
        seen: set[int] = set()
        for i in range(len(server_runs)):
            p = free_port()
            while p in seen:
                p = free_port()
            seen.add(p)
            ports[i] = p
    for run, port in zip(server_runs, ports):
        run.server = make_server(run, a, log_dir, port)
    hf_cmd = [sys.executable, str(Path(__file__).resolve()), *(x for x in argv if x != "--dry-run"), "--hf-worker"]

    if a.dry_run:
        print(f"# {len(server_runs)} servers, started together (stagger {a.stagger_s} s); deadline {a.deadline_s:.0f} s "
              f"(work stops at {a.deadline_s - a.stop_margin_s:.0f} s)")
        for run in server_runs:
            print(f"# {run.spec} -> rows method={run.method} params={json.dumps(run.params)}")
            print(shlex.join(run.server.command) + f"  > {run.server.log_path}")
        if hf_runs:
            print(f"# HF child ({', '.join(r.spec for r in hf_runs)}; {a.hf_n} prompts per cell, {a.hf_device} "
                  f"{a.hf_dtype}):")
            for r in hf_runs:
                print(f"#   {r.spec} -> rows method={r.method} params={json.dumps(r.params)}")
            print(shlex.join(hf_cmd) + " --deadline-at EPOCH" + f"  > {log_dir / 'hf-worker.log'}")
            print(f"#   HF cells ({len(a.hf_cells)}): " + (", ".join(f"{L}/{t}" for L, t in a.hf_cells) or "none"))
        print(f"# cells ({len(cells)}, in this order; every server method finishes a cell before the next): "
              f"{a.n} prompts per method per cell (seed {a.seed})")
        for i, (L, t) in enumerate(cells, 1):
            print(f"  {i:2d}. length {L:>6}  {t}")
        device = a.device_label or "the GPU's model, from nvidia-smi"
        print(f"# rows -> {a.results} (device {device!r}, model {a.model_name!r})")
        return 0

    if not Path(a.model_dir).is_dir():
        raise SystemExit(f"--model-dir {a.model_dir}: no such folder")
    for d in (log_dir, pred_dir):
        d.mkdir(parents=True, exist_ok=True)
    if not a.results.exists():
        a.results.parent.mkdir(parents=True, exist_ok=True)
        if BASE_RESULTS.exists():
            shutil.copyfile(BASE_RESULTS, a.results)
    summary: dict[str, Any] = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                               "argv": argv, "deadline_s": a.deadline_s, "cells": [list(c) for c in cells],
                               "hf_cells": [list(c) for c in a.hf_cells] if hf_runs else [],
                               "servers": {}, "hf": None}
    summary_path = out / "accuracy_h200_summary.json"
    written: list[dict] = []
    hf_proc = None
    hf_log = None
    rc = 0
    old_handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    try:
        (out / "hf_status.json").unlink(missing_ok=True)  # none from an earlier run in this folder

        def start_hf_child():
            hf_log = open(log_dir / "hf-worker.log", "w")
            cmd = hf_cmd + ["--deadline-at", f"{time.time() + (work_deadline - time.monotonic()):.2f}"]
            hf_log.write("$ " + shlex.join(cmd) + "\n")
            hf_log.flush()
            proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=hf_log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            log(f"[{time.monotonic() - t0:5.0f}s] HF child started (pid {proc.pid}; log {log_dir / 'hf-worker.log'})")
            return proc, hf_log

        status_lock = threading.Lock()

        def start(run: MethodRun) -> MethodRun:
            for attempt in (1, 2):
                run.server.start_timeout = max(min(a.start_timeout, work_deadline - a.min_eval_s - time.monotonic()),
                                               1.0)
                run.status = "starting"
                try:
                    run.server.start()
                except Exception as e:  # noqa: BLE001 - recorded; the other methods go on
                    with status_lock:
                        if run.status != "starting":  # given up on by the main thread
                            return run
                        run.error = f"{type(e).__name__}: {e}"
                        memory = any(m in str(e).lower() for m in MEMORY_ERRORS)
                        if attempt == 1 and memory and work_deadline - time.monotonic() > a.min_eval_s + 120:
                            log(f"[{time.monotonic() - t0:5.0f}s] {run.spec} died of memory at start: retrying once")
                            with contextlib.suppress(OSError):
                                run.server.log_path.rename(run.server.log_path.with_suffix(".attempt1.log"))
                            continue
                        run.status = "failed to start"
                    log(f"[{time.monotonic() - t0:5.0f}s] {run.spec} FAILED to start: {str(e)[:3000]}")
                    return run
                with status_lock:
                    if run.status == "starting":
                        run.status, run.start_seconds = "up", run.server.startup_seconds
                        run.error = None
                log(f"[{time.monotonic() - t0:5.0f}s] {run.spec} {run.status} in {run.server.startup_seconds:.0f}s "
                    f"at {run.server.base_url}")
                return run
            return run

        starter = cf.ThreadPoolExecutor(len(server_runs) or 1, thread_name_prefix="start")
        start_futs = []
        for i, run in enumerate(server_runs):
            if i:
                time.sleep(a.stagger_s)
            start_futs.append(starter.submit(start, run))
        if server_runs:
            log(f"[{time.monotonic() - t0:5.0f}s] {len(server_runs)} servers launching; generating prompts")

        by_cell: dict[Cell, list] = {}
        if server_runs:
            from harness.eval.tasks import load_tokenizer
            by_cell = cell_samples(load_tokenizer(a.model_dir), cells, a.n, a.seed)
            log(f"[{time.monotonic() - t0:5.0f}s] {len(cells) * a.n} prompts ready ({len(cells)} cells x {a.n})")
        # wait for every server, but not past the time the evaluation needs, nor long after the first is up
        pending, first_up = set(start_futs), None
        while pending:
            now = time.monotonic()
            limit = work_deadline - a.min_eval_s - now
            if first_up is not None:
                limit = min(limit, first_up + a.straggler_s - now)
            if limit <= 0:
                break
            _, pending = cf.wait(pending, timeout=min(limit, 2.0), return_when=cf.FIRST_COMPLETED)
            if first_up is None and any(r.status == "up" for r in server_runs):
                first_up = time.monotonic()
        for r in server_runs:
            with status_lock:
                late = r.status == "starting"
                if late:
                    r.status = "not up in time"
                    r.error = (f"not healthy after {time.monotonic() - t0:.0f}s (straggler limit {a.straggler_s:.0f}s "
                               f"after the first server, {a.min_eval_s:.0f}s kept for the evaluation)")
            if late:
                log(f"[{time.monotonic() - t0:5.0f}s] {r.spec}: {r.error}; stopped")
                r.server.stop()
        starter.shutdown(wait=False)
        # the HF child starts once the servers have sized their KV pools: SGLang sizes a pool from the free memory
        # it measures before and after loading its weights, and an HF model loading (or a 32K prefill running) in
        # between left the servers no pool at all (H200, 2026-12-03: both died of memory at start, 169 s lost)
        if hf_runs:
            hf_proc, hf_log = start_hf_child()
        up = [r for r in server_runs if r.status == "up"]
        summary["servers"] = servers_summary(server_runs)
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
        if server_runs and not up:
            log("no server came up")
            rc = 1
        elif up:
            files = {r.label: open(pred_dir / f"{r.label}.jsonl", "a") for r in up}
            workers = [ServerWorker(r.label, Client(r.server.base_url, timeout=a.request_timeout), files[r.label])
                       for r in up]
            writer = row_writer({r.label: r for r in up}, a.results, a.model_name, a.device_label, written, log=log)
            log(f"[{time.monotonic() - t0:5.0f}s] evaluating {len(up)} methods, {len(cells)} cells, "
                f"{work_deadline - time.monotonic():.0f}s left")
            res = run_schedule(workers, cells, by_cell, work_deadline, writer, parallel=True, log=log)
            for f in files.values():
                f.close()
            for r in up:
                if r.label in res.failed:
                    r.status, r.error = "failed", res.failed[r.label]
                else:
                    r.status = "done"
            summary["schedule"] = res.as_dict()
            log(f"[{time.monotonic() - t0:5.0f}s] server cells: {len(res.done)}/{len(cells)} done"
                + (f"; stopped: {res.stopped}" if res.stopped else ""))
            save_compact_metrics(up, log_dir)
        stop_servers(server_runs)
        if hf_proc is not None:
            try:
                hf_proc.wait(max(work_deadline + 8.0 - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log("HF child still running at the deadline: killed")
    except _Terminated as e:
        log(f"terminated ({e}); stopping servers")
        summary["terminated"] = str(e)
        rc = 1
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        summary["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    finally:
        for sig in old_handlers:
            signal.signal(sig, signal.SIG_IGN)  # clean up undisturbed
        stop_servers(server_runs)
        kill_group(hf_proc)
        if hf_log is not None:
            hf_log.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    hf_status = None
    if hf_runs:
        try:
            hf_status = json.loads((out / "hf_status.json").read_text())
        except (OSError, json.JSONDecodeError):
            hf_status = {"error": "no status written (see logs/hf-worker.log)"}
        if hf_status.get("stopped") is None and hf_status.get("error") is None and \
                len(hf_status.get("cells_done", [])) < len(a.hf_cells):
            hf_status["stopped"] = "killed at the deadline"
        summary["hf"] = {k: v for k, v in hf_status.items() if k != "rows"}
        for r in hf_runs:
            r.status = "done" if not hf_status.get("error") else "error"
            r.error = hf_status.get("error")
    summary["servers"] = servers_summary(server_runs)
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    summary["rows_written"] = len(written) + len((hf_status or {}).get("rows", []))
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    try:
        with locked(a.results):
            rendered = R.regenerate(a.results) if a.results.exists() else []
        log("wrote " + ", ".join(str(p) for p in [a.results, *rendered, summary_path]))
    except Exception as e:  # noqa: BLE001
        log(f"could not render accuracy.md: {e}")
    if hf_status is not None:
        log(f"HF methods: {len(hf_status.get('cells_done', []))}/{len(a.hf_cells)} cells of {a.hf_n} prompts"
            + (f"; stopped: {hf_status['stopped']}" if hf_status.get("stopped") else "")
            + (f"; error: {hf_status['error']}" if hf_status.get("error") else ""))
    log(f"total {time.monotonic() - t0:.0f}s")
    print(summary_table(written + list((hf_status or {}).get("rows", [])), server_runs + hf_runs, a.lengths),
          flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
