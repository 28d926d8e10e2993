"""Long-context accuracy and fidelity evaluation (`python -m sglang_compact.eval` / `scripts/eval_longctx.py`).

    # accuracy through a server we start (one at a time), rows -> docs/results/accuracy.json
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
import datetime as _dt
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from sglang_compact.eval import results as R
from sglang_compact.eval.tasks import TASKS, Sample, load_tokenizer, make_suite

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
OUT_DIR = REPO_ROOT / ".out" / "eval"
START_PRESETS = ("cpu-dense", "cpu-compact", "cpu-compact-dense", "hf")
SELECTOR_PARAM_FLAGS = {"flashprefill": "alpha", "xattention": "threshold", "oracle": "top_p", "budget": "density"}


# --- HTTP client --------------------------------------------------------------------------------------

class Client:
    def __init__(self, url: str, timeout: float = 1800.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _req(self, path: str, payload: dict | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            body = r.read()
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> dict:
        return self._req("/generate", {"input_ids": [int(t) for t in input_ids],
                                       "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens)}})

    def flush_cache(self) -> None:
        try:
            self._req("/flush_cache", {})
        except urllib.error.URLError:
            pass

    def density_counters(self) -> tuple[float, float] | None:
        """(sum, count) of the server's per-forward-pass post-union density histogram
        (`sglang:compact_density_forward{stage="after_group"}` on `/metrics`, served with
        `--enable-metrics`); None when the server does not expose it."""
        try:
            text = self._req("/metrics")
        except (urllib.error.URLError, OSError):
            return None
        return parse_density_counters(text) if isinstance(text, str) else None


def parse_density_counters(text: str) -> tuple[float, float] | None:
    total = count = None
    for line in text.splitlines():
        if not line.startswith("sglang:compact_density_forward_") or 'stage="after_group"' not in line:
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        if name.endswith("_sum"):
            total = (total or 0.0) + value
        elif name.endswith("_count"):
            count = (count or 0.0) + value
    return None if total is None or count is None else (total, count)


def density_between(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Mean post-union density of the compact forward passes between two `density_counters` snapshots."""
    if after is None:
        return None
    b = before or (0.0, 0.0)
    n = after[1] - b[1]
    return (after[0] - b[0]) / n if n > 0 else None


# --- server presets -----------------------------------------------------------------------------------

def selector_params(args) -> dict[str, Any]:
    params = json.loads(args.selector_params) if args.selector_params else {}
    for flag, name in (("alpha", "alpha"), ("threshold", "threshold"), ("top_p", "top_p"),
                       ("budget_density", "density")):
        v = getattr(args, flag, None)
        if v is not None:
            params[name] = v
    dfc = getattr(args, "dense_final_chunk", None)
    if dfc is not None:
        params["dense_final_chunk"] = int(dfc == "on")
    return params


def compact_method(selector: str, params: dict[str, Any]):
    """The `fidelity.Method` of a compact server method: its `dense_final_chunk` and `selector_params`."""
    from sglang_compact.eval.fidelity import Method
    return Method("compact", selector, tuple(sorted(params.items())))


def compact_server_args(selector: str, params: dict[str, Any], min_prefix_len: int, sink_blocks: int,
                        recent_blocks: int) -> list[str]:
    """`sglang_compact.launch_server` flags of a compact method (with `--enable-metrics`, for the density)."""
    m = compact_method(selector, params)
    extra = ["--enable-metrics", "--attention-backend", "compact", "--compact-min-prefix-len", str(min_prefix_len),
             "--compact-sink-blocks", str(sink_blocks), "--compact-recent-blocks", str(recent_blocks),
             "--compact-selector", selector,
             "--compact-dense-final-chunk", "on" if m.dense_final_chunk else "off"]
    sel_params = m.selector_params
    if sel_params:
        extra += ["--compact-selector-params", json.dumps(sel_params)]
    return extra


def compact_method_params(selector: str, params: dict[str, Any], *, chunk: int, page_size: int,
                          min_prefix_len: int, sink_blocks: int, recent_blocks: int) -> tuple[str, dict[str, Any]]:
    """(method label, row params) of a compact server: the selector's parameters (defaults filled in) and
    the chunking / forced-block settings."""
    params = {} if selector == "dense" else {**params, "dense_final_chunk": int(compact_method(selector, params).dense_final_chunk)}
    if selector in SELECTOR_PARAM_FLAGS:
        from sglang_compact.config import SELECTOR_PARAMS
        name = SELECTOR_PARAM_FLAGS[selector]
        params.setdefault(name, SELECTOR_PARAMS[selector][name][0])
    params.update(chunk=chunk, page_size=page_size, min_prefix_len=min_prefix_len, sink_blocks=sink_blocks,
                  recent_blocks=recent_blocks)
    return f"compact-{selector}", params


def hf_method_params(hf_method: str, *, chunk: int, page_size: int, min_prefix_len: int, sink_blocks: int,
                     recent_blocks: int, dtype: str = "float32") -> tuple[str, dict[str, Any]]:
    """(method label, row params) of an in-process HF run (`--start hf --hf-method M`)."""
    from sglang_compact.eval.fidelity import parse_method
    m = parse_method(hf_method)
    name = "dense" if m.kind == "dense" else ("quoka" if m.kind == "quoka" else f"{m.kind}-{m.selector}")
    params = {**dict(m.params), "runner": "hf", "chunk": chunk, "page_size": page_size,
              "min_prefix_len": min_prefix_len, "sink_blocks": sink_blocks, "recent_blocks": recent_blocks}
    if m.kind in ("compact", "blocksparse") or m.dense_final_chunk:
        params["dense_final_chunk"] = int(m.dense_final_chunk)
    if dtype != "float32":
        params["dtype"] = dtype
    return name, params


def start_server(args, log_path: Path):
    from sglang_compact.eval.server import SGLangServer
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


def method_and_params(args) -> tuple[str, dict[str, Any]]:
    if args.start == "hf":
        return hf_method_params(args.hf_method, chunk=args.chunk, page_size=args.page_size,
                                min_prefix_len=args.min_prefix_len, sink_blocks=args.sink_blocks,
                                recent_blocks=args.recent_blocks, dtype=getattr(args, "hf_dtype", "float32"))
    if args.start == "cpu-dense":
        return "dense", {"backend": "torch_native", "chunk": args.dense_chunk or max(args.lengths),
                         "page_size": args.page_size}
    if args.start in ("cpu-compact", "cpu-compact-dense"):
        sel = "dense" if args.start == "cpu-compact-dense" else args.selector
        return compact_method_params(sel, {} if sel == "dense" else selector_params(args), chunk=args.chunk,
                                     page_size=args.page_size, min_prefix_len=args.min_prefix_len,
                                     sink_blocks=args.sink_blocks, recent_blocks=args.recent_blocks)
    return args.method, json.loads(args.params) if args.params else {}


# --- accuracy -------------------------------------------------------------------------------------------

class _NoProgress:
    def update(self, k=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress(total: int, desc: str, enabled: bool = True):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        class _P:
            def __init__(self):
                self.n = 0

            def update(self, k=1):
                self.n += k
                print(f"{desc}: {self.n}/{total}", file=sys.stderr, flush=True)

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass
        return _P()


def run_samples(client: Client, samples: list[Sample], desc: str, flush: bool = True,
                log_file=None, progress: bool = True, stop=None) -> list[dict[str, Any]]:
    """Greedy generation for every sample; each record has `server_density` (None when not exposed).

    `stop`: a callable checked before each sample; when it returns True the records so far are returned
    (fewer than `samples`)."""
    out = []
    bar = _progress(len(samples), desc, progress)
    try:
        for s in samples:
            if stop is not None and stop():
                break
            if flush:
                client.flush_cache()  # independent samples: chunks start at 0 as in the offline replay
            before = client.density_counters()
            t0 = time.monotonic()
            r = client.generate(s.input_ids, s.max_new_tokens)
            dt = time.monotonic() - t0
            server_density = density_between(before, client.density_counters())
            pred = r.get("text", "")
            rec = {**s.as_dict(), "pred": pred, "score": s.score(pred), "all_found": s.all_found(pred),
                   "seconds": round(dt, 3), "prompt_tokens": r.get("meta_info", {}).get("prompt_tokens"),
                   "completion_tokens": r.get("meta_info", {}).get("completion_tokens"),
                   "server_density": server_density}
            _keep(out, rec, log_file, bar, s, dt)
    finally:
        bar.close()
    return out


def _keep(out: list, rec: dict, log_file, bar, s: Sample, seconds: float) -> None:
    """Keep one scored sample: in `out`, in the JSONL log if any, and on the progress bar."""
    out.append(rec)
    if log_file is not None:
        log_file.write(json.dumps(rec) + "\n")
        log_file.flush()
    bar.update(1)
    bar.set_postfix_str(f"{s.task}@{s.length} {seconds:.1f}s score {rec['score']:.2f}")


def load_hf_model(args):
    """The HF model of `--start hf` (`--hf-dtype`, on `--hf-device`)."""
    import torch
    from sglang_compact.eval import hf_runner as H
    dtype = getattr(torch, getattr(args, "hf_dtype", "float32"))
    return H.load_model(args.model, dtype=dtype, device=getattr(args, "hf_device", None))


def run_samples_hf(args, samples: list[Sample], desc: str, log_file=None, model=None, tok=None,
                   progress: bool = True, stop=None) -> tuple[list[dict[str, Any]], dict]:
    """Greedy generation in-process with HF transformers and chunked sparse prefill (`hf_runner`).

    `model`/`tok`: already loaded (default: load them from `args.model`); `stop` as in `run_samples`."""
    from sglang_compact.eval import hf_runner as H
    tok = tok if tok is not None else load_tokenizer(args.model)
    model = model if model is not None else load_hf_model(args)
    eos = [model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int) \
        else list(model.generation_config.eos_token_id or [])
    out, dens = [], {}
    bar = _progress(len(samples), desc, progress)
    try:
        for s in samples:
            if stop is not None and stop():
                break
            g = H.generate(model, s.input_ids, args.hf_method, max_new_tokens=s.max_new_tokens, chunk=args.chunk,
                           page_size=args.page_size, min_prefix_len=args.min_prefix_len,
                           sink_blocks=args.sink_blocks, recent_blocks=args.recent_blocks, eos_token_ids=eos)
            pred = tok.decode(g.output_ids, skip_special_tokens=True)
            rec = {**s.as_dict(), "pred": pred, "score": s.score(pred), "all_found": s.all_found(pred),
                   "seconds": round(g.seconds, 3), "density": g.density}
            if g.density is not None:
                dens.setdefault((s.task, s.length), []).append(g.density)
            _keep(out, rec, log_file, bar, s, g.seconds)
    finally:
        bar.close()
    return out, {k: sum(v) / len(v) for k, v in dens.items()}


def offline_densities(args, samples: list[Sample], method: str, params: dict[str, Any]) -> dict[tuple, float]:
    """(task, length) -> mean offline post-union density over the first `--density-samples` prompts."""
    from sglang_compact.eval import fidelity as F
    sel = method.removeprefix("compact-")
    sp = {k: v for k, v in params.items() if k not in ("chunk", "page_size", "min_prefix_len", "sink_blocks",
                                                          "recent_blocks")}
    m = F.Method("compact", sel, tuple(sorted(sp.items())))
    model = F.load_model(args.model)
    by_key: dict[tuple, list[float]] = {}
    todo = [s for s in samples if s.index < args.density_samples]
    bar = _progress(len(todo), "offline density")
    for s in todo:
        d = F.offline_density(model, s.input_ids, m, chunk=params["chunk"], page_size=params["page_size"],
                              min_prefix_len=params["min_prefix_len"], sink_blocks=params["sink_blocks"],
                              recent_blocks=params["recent_blocks"])
        if d is not None:
            by_key.setdefault((s.task, s.length), []).append(d)
        bar.update(1)
    bar.close()
    return {k: sum(v) / len(v) for k, v in by_key.items()}


SERVER_DENSITY_SOURCE = "server /metrics (compact_density_forward after_group, every prompt)"
HF_DENSITY_SOURCE = "hf run (measured on every prompt)"


def cell_densities(recs: list[dict[str, Any]], key: str = "server_density") -> dict[tuple, float]:
    """(task, length) -> mean of the records' `key` (server_density, or density for HF runs) where present."""
    by_key: dict[tuple, list[float]] = {}
    for r in recs:
        if r.get(key) is not None:
            by_key.setdefault((r["task"], r["length"]), []).append(r[key])
    return {k: sum(v) / len(v) for k, v in by_key.items()}


def accuracy_rows(recs: list[dict[str, Any]], *, model: str, method: str, params: dict[str, Any], device: str,
                  tasks: Sequence[str], lengths: Sequence[int], densities: dict[tuple, float] | None = None,
                  density_source: str | None = None, offline_densities: dict[tuple, float] | None = None,
                  dense_selector: bool = False, date: str | None = None) -> list[dict[str, Any]]:
    """accuracy.json rows (one per task and length with records, in length-then-task order) from scored records.

    `dense_selector`: the compact pipeline with selector dense (density 1.0 by construction)."""
    densities = densities or {}
    offline_densities = offline_densities or {}
    date = date or _dt.date.today().isoformat()
    rows = []
    for L in lengths:
        for t in tasks:
            rs = [r for r in recs if r["task"] == t and r["length"] == L]
            if not rs:
                continue
            dens = None
            if dense_selector:
                dens = 1.0
            elif (t, L) in densities:
                dens = round(densities[(t, L)], 4)
            rows.append({
                "model": model, "task": t, "length": L, "method": method, "params": params, "n": len(rs),
                "accuracy": round(100.0 * sum(r["score"] for r in rs) / len(rs), 2),
                "density": dens, "date": date, "device": device,
                "accuracy_all": round(100.0 * sum(r["all_found"] for r in rs) / len(rs), 2),
                "density_source": density_source if dens is not None else None,
                "seconds_per_sample": round(sum(r["seconds"] for r in rs) / len(rs), 2),
                "mean_prompt_tokens": round(sum(r["num_tokens"] for r in rs) / len(rs), 1),
            })
            if (t, L) in offline_densities:
                rows[-1]["density_offline"] = round(offline_densities[(t, L)], 4)
    return rows


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
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    log_path = OUT_DIR / f"{stamp}-{method}.jsonl"
    print(f"{len(samples)} samples ({', '.join(args.tasks)}; lengths {args.lengths}; n={args.n}); method {method} "
          f"{params}; predictions -> {log_path}", file=sys.stderr)
    server = None
    t_start = time.monotonic()
    with open(log_path, "w") as lf:
        try:
            if args.start == "hf":
                recs, hf_densities = run_samples_hf(args, samples, method, log_file=lf)
            elif args.start:
                server = start_server(args, OUT_DIR / f"{stamp}-{method}-server.log")
                server.start()
                print(f"server up in {server.startup_seconds:.0f}s at {server.base_url} (log {server.log_path})",
                      file=sys.stderr)
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
    if args.no_write:
        print(json.dumps(rows, indent=1))
    else:
        R.append_rows(rows, args.results)
        written = R.regenerate(args.results)
        print("wrote " + ", ".join(str(p) for p in [args.results, *written]), file=sys.stderr)
    for r in rows:
        print(f"{r['task']:>20} @ {r['length']}: acc {r['accuracy']:5.1f} (all-of {r['accuracy_all']:5.1f})"
              f" density {r['density']} {r['seconds_per_sample']:.1f} s/sample")
    print(f"total {wall:.0f}s for {len(recs)} samples ({wall / max(len(recs), 1):.1f} s/sample incl. start-up)")
    return 0


# --- fidelity -------------------------------------------------------------------------------------------

def cmd_fidelity(args) -> int:
    from sglang_compact.eval import fidelity as F
    from sglang_compact.eval.tasks import make_sample
    tok = load_tokenizer(args.model)
    s = make_sample(args.task, args.length, args.index, tok, seed=args.seed)
    model = F.load_model(args.model)
    t0 = time.monotonic()
    layers = F.capture_qkv(model, s.input_ids)
    t_cap = time.monotonic() - t0
    bar = _progress(len(layers), "fidelity layers")
    res = F.simulate(layers, args.methods or F.DEFAULT_METHODS, chunk=args.chunk, page_size=args.page_size,
                     min_prefix_len=args.min_prefix_len, sink_blocks=args.sink_blocks,
                     recent_blocks=args.recent_blocks, progress=lambda _m: bar.update(1))
    bar.close()
    print(F.fidelity_markdown(res.as_dict(), f"{Path(args.model).name}: {args.task} #{args.index} at {args.length}"))
    if not args.no_write:
        out = args.results.parent / "fidelity.json"
        data = json.loads(out.read_text()) if out.exists() else []
        data.append({"model": Path(args.model).name, "task": args.task, "index": args.index, "length": args.length,
                     "date": _dt.date.today().isoformat(), "device": f"cpu ({os.cpu_count()} cores)",
                     "capture_seconds": round(t_cap, 1), **res.as_dict()})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        out.with_suffix(".md").write_text(F.render_fidelity_md(data))
        print(f"wrote {out}, {out.with_suffix('.md')}", file=sys.stderr)
    return 0


def cmd_paired(args) -> int:
    from sglang_compact.eval.paired import main_paired
    try:
        print(main_paired(args.a, args.b, args.length, args.tasks, args.n_boot), end="")
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"eval_longctx paired: {e}")
    return 0


def cmd_report(args) -> int:
    for p in R.regenerate(args.results):
        print(f"wrote {p}")
    return 0


# --- argument parsing --------------------------------------------------------------------------------------

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF model folder (tokenizer, and weights for offline)")
    p.add_argument("--results", type=Path, default=R.ACCURACY_JSON)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256, help="chunked prefill size (a multiple of --page-size)")
    p.add_argument("--min-prefix-len", type=int, default=512)
    p.add_argument("--sink-blocks", type=int, default=2)
    p.add_argument("--recent-blocks", type=int, default=4)
    p.add_argument("--no-write", action="store_true", help="print the rows, write nothing")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eval_longctx", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy", help="RULER-style accuracy through a server")
    _common(a)
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
    a.add_argument("--selector", default="flashprefill")
    a.add_argument("--selector-params", help="JSON")
    a.add_argument("--alpha", type=float)
    a.add_argument("--threshold", type=float)
    a.add_argument("--top-p", dest="top_p", type=float)
    a.add_argument("--budget-density", type=float, default=None, help="budget selector density")
    a.add_argument("--dense-final-chunk", choices=("on", "off"), default=None,
                   help="cpu-compact: the server's --compact-dense-final-chunk (default: its default, on)")
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
    _common(f)
    f.add_argument("--task", default="niah_single_number", choices=list(TASKS))
    f.add_argument("--length", type=int, default=2048)
    f.add_argument("--index", type=int, default=0)
    f.add_argument("--methods", nargs="+", help="e.g. dense compact:flashprefill:alpha=0.06 "
                   "blocksparse:xattention:threshold=0.9 quoka:query_ratio=0.25,kv_budget=0.25")
    f.set_defaults(func=cmd_fidelity)
    r = sub.add_parser("report", help="re-render accuracy.md / accuracy.png")
    r.add_argument("--results", type=Path, default=R.ACCURACY_JSON)
    r.set_defaults(func=cmd_report)
    pr = sub.add_parser("paired", help="B - A on the same prompts, from two scored-prediction JSONL files")
    pr.add_argument("a", help="JSONL of method A (e.g. preds/dense.jsonl of accuracy_h200.py)")
    pr.add_argument("b", help="JSONL of method B")
    pr.add_argument("--length", type=int, required=True)
    pr.add_argument("--tasks", nargs="+", choices=list(TASKS), help="default: every task both files have")
    pr.add_argument("--n-boot", type=int, default=2000)
    pr.set_defaults(func=cmd_paired)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
