#!/usr/bin/env python3
"""Time to first token, stock SGLang against `compact`, side by side (run on the GPU host).

    source scripts/gpu/setup.sh
    # Qwen2.5-Coder-0.5B with real weights, 4K-31K, chunk 1024 and 8192, batch 1:
    python3 scripts/bench_ttft.py --model-path /tmp/qwen --model-name qwen2.5-coder-0.5b --page-size 32 \\
        --contexts 4096,8192,16384,31744 --chunks 1024,8192 --batches 1 \\
        --methods flashinfer,fa3,compact,compact-dense --out-dir $OUT/r
    # Llama-3.1-8B shapes (dummy weights), 8K-128K:
    python3 scripts/bench_ttft.py --model llama-3.1-8b --page-size 64 --contexts 8192,32768,65536,130816 \
        --sequential ...        (the longest prompt + 256 must fit Llama-3.1's 131,072 positions)

For each chunk size, one server per method starts (side by side on the one GPU, each with a capped
KV pool and `--sleep-on-idle`, so the idle ones do not spin a CPU core each; one at a time with
--sequential; SGLang's defaults otherwise, prefill CUDA graphs included,
unless --no-prefill-graphs); each gets a warm-up request at the longest context (so every code path,
the sparse one included, has compiled). For each (context, batch): `--reps` rounds, interleaved across
the servers (rep 1 of every server, then rep 2, ...; each round timed alone, the others idle), of `batch`
concurrent requests with fresh random prompts (no radix-cache hits) and `max_new_tokens=1`; the TTFT of a
round is its slowest request; the row takes the median, and against `flashinfer` also the per-round ratio
(round i of the one over round i of the other: its median and an order-statistic interval, `round_ratios`;
marked when the two servers were not in one group of interleaved rounds). `--starts N` starts every group
N times in turn and pools the rounds of all starts (each start's median is kept in `ms_per_start`): on a
host-bound model (Qwen2.5-0.5B at chunk 1024) one configuration's TTFT moves between server processes by more
than the do-no-harm margin, so a ratio from one process per method ranks processes, not methods.
`--warmup-rounds K` adds K untimed rounds before each (context, batch). With
`--profile-steps` one more round runs under SGLang's profiler and `scripts/trace_summary.py` summarises
the trace (kernel launches and host time per layer; the traces are kept in <out-dir>/traces/). A compact
server runs with `--enable-metrics`: the density of its round (mean over its sparse forward passes of
the pages read over the context pages; 1.0 when nothing went sparse), the fraction of its q-blocks
that went sparse and the fraction the gate turned dense from their observed density are read from
`/metrics` around the round.

Methods: `flashinfer`, `fa3` (stock SGLang backends); `flashinfer-again` (a second stock `flashinfer` server: its
ratio to the first is the spread between two identical servers, the band a do-no-harm ratio is read against);
`flashinfer-metrics`, `fa3-metrics` (stock with `--enable-metrics`, as every compact server here runs: what SGLang's
metrics cost a stock server);
`compact` (its defaults), `compact-dense`
(`--compact-selector dense`), `compact-budget-D` (`budget` at density D; `compact-mass_budget-D` and
`compact-quest_budget-D` likewise), `compact:SELECTOR[:k=v,...]` (the accuracy scripts' syntax, e.g.
`compact:quest_budget:density=0.2,min_tokens=3072`: a candidate timed as its accuracy was measured), any of them with
`-fa2` (`--compact-prefill-kernel fa2`), `-fidense` (`--compact-dense-kernel flashinfer`: dense passes on
FlashInfer, as before sgl_kernel's FA3 ran them), `-sglrows` (`--compact-prefill-kernel sgl-fa3`: the sparse rows
on sgl_kernel's FA3, `auto`'s choice where it runs), `-firows` (`--compact-prefill-kernel fa3`: the rows on
FlashInfer's fa3, `auto`'s choice before; planned per layer for a threshold selector), `-at0`
(`--compact-min-context 0`: sparse from the start) or `-nometrics`
(no `--enable-metrics`, as a user runs it by default: its rows have no density) or `-cachedlaunch`
(`SGLANG_COMPACT_CACHED_LAUNCH=1`: our Triton kernels launched from their compiled kernels, `kernels/launch.py`)
or `-reuse` (`--compact-prefix-cache reuse`: the radix cache keeps and serves everything, as stock does).

`--decode-tokens N` streams N output tokens per request instead of 1 and adds the decode time per token (rows'
`decode_ms`): after every request of a round has its first token, each request's time from its next token to its
last over the tokens in between; the median over the round's requests, then over the rounds. The TTFT is then the
first streamed token's. Stock `fa3` decodes on FA3, stock `flashinfer` on FlashInfer's decode kernel.

`--next-turn M` times a conversation's next turn instead of a fresh prompt: each timed request of `context`
tokens is a first turn of `context - M - --answer-tokens` tokens, answered just before (untimed), then its
answer and M new tokens; the rows add `next_turn`, `answer_tokens` and `cached_tokens` (median over the rounds
of the tokens the timed requests took from the radix cache). Stock caches the whole first turn; `compact`'s
default cache (`exact`) keeps it only up to its dense tail, so the next turn prefills the tail and the answer
again: what multi-turn serving pays for answers independent of the cache.

Rows `{"bench": "ttft", "model", "context", "chunk", "batch", "tp", "method", "density", "ms",
"speedup_vs_flashinfer", "gpu", "date", ...}` are appended to `<out-dir>/speed.json`; the table goes
to `<out-dir>/<--name>.md` and the ratios against prompt length to `<--name>.png`.

One run over several calls (`--resume`): after each group of servers the run's state (its rounds so far, the
groups timed) is written to `<out-dir>/<--name>.state.json`. The same command again with `--resume`, on the same
machine (`--deadline-s` may differ), times only the groups not yet timed and writes the rows, table and plot of
the whole run, under the first call's date and command (`"calls"` in the rows says how many calls it took); its
rows replace those the earlier calls appended. A sweep longer than one GPU-host call (10 minutes) stays one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import random
import statistics
from math import comb
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "gpu"))
from make_llama_config import write_model_dir  # noqa: E402
from serving_check import generate, start_server  # noqa: E402
import trace_summary  # noqa: E402
from harness.eval.methods import file_label  # noqa: E402

STOCK = "sglang.launch_server"
COMPACT = "sglang_compact.launch_server"


# method suffixes that set a compact server's environment: our Triton kernels launched from their compiled kernels
# (`kernels/launch.py`, off by default)
ENV_SUFFIXES = {"-cachedlaunch": {"SGLANG_COMPACT_CACHED_LAUNCH": "1"}}


def method_args(method: str) -> tuple[str, list[str]]:
    """(module, backend flags) of a method name (see the module docstring)."""
    if method == "flashinfer-again":   # a second stock server: the spread between two identical servers
        return method_args("flashinfer")
    if method in ("flashinfer-metrics", "fa3-metrics"):   # what SGLang's metrics cost (compact servers run with them)
        module, flags = method_args(method.rsplit("-", 1)[0])
        return module, flags + ["--enable-metrics"]
    if method == "flashinfer":
        return STOCK, ["--attention-backend", "flashinfer"]
    if method == "fa3":
        return STOCK, ["--attention-backend", "fa3"]
    if not method.startswith("compact"):
        raise ValueError(f"unknown method {method!r}")
    flags = ["--attention-backend", "compact", "--enable-metrics"]
    name = method
    suffixes = {"-fa2": ["--compact-prefill-kernel", "fa2"], "-fidense": ["--compact-dense-kernel", "flashinfer"],
                "-sglrows": ["--compact-prefill-kernel", "sgl-fa3"], "-firows": ["--compact-prefill-kernel", "fa3"],
                "-at0": ["--compact-min-context", "0"], "-nometrics": [],
                "-reuse": ["--compact-prefix-cache", "reuse"],
                **dict.fromkeys(ENV_SUFFIXES, [])}   # (environment variables: method_env)
    while any(name.endswith(x) for x in suffixes):
        suffix = next(x for x in suffixes if name.endswith(x))
        name, flags = name[:-len(suffix)], flags + suffixes[suffix]
        if suffix == "-nometrics":   # as a user runs it by default (no density read)
            flags.remove("--enable-metrics")
    if name == "compact":
        return COMPACT, flags
    if name == "compact-dense":
        return COMPACT, flags + ["--compact-selector", "dense"]
    if name.startswith("compact-budget-"):
        return COMPACT, flags + ["--compact-selector", "budget", "--compact-density", name.rsplit("-", 1)[1]]
    if name.startswith("compact:"):
        return COMPACT, flags + spec_flags(name)
    for selector in ("mass_budget", "quest_budget"):
        if name.startswith(f"compact-{selector}-"):
            density = float(name.rsplit("-", 1)[1])
            return COMPACT, flags + ["--compact-selector", selector,
                                     "--compact-selector-params", json.dumps({"density": density})]
    raise ValueError(f"unknown method {method!r}")


def spec_flags(spec: str) -> list[str]:
    """The flags of a method in the accuracy scripts' syntax, `compact:SELECTOR[:k=v,...]`: the selector and its
    parameters, and the method-level dense_tail / dense_layers / dense_above / density_cap where given (the rest
    at the server's defaults), so a candidate is timed exactly as its accuracy was measured."""
    from harness.eval.fidelity import parse_method
    from harness.eval.methods import method_level_flags

    m = parse_method(spec)
    flags = ["--compact-selector", m.selector]
    if m.selector_params:
        flags += ["--compact-selector-params", json.dumps(m.selector_params, sort_keys=True)]
    if "dense_tail" in dict(m.params):
        flags += ["--compact-dense-tail", str(m.dense_tail)]
    return flags + method_level_flags(m)


def split_methods(text: str) -> list[str]:
    """--methods: names joined by ',', where a `compact:SELECTOR:k=v,k=v` method keeps its own commas (a piece
    holding '=' that does not start a method continues the one before it)."""
    out: list[str] = []
    for piece in filter(None, text.split(",")):
        if "=" in piece and not piece.startswith("compact:") and out and out[-1].startswith("compact:"):
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def method_env(method: str) -> dict[str, str]:
    """The server's extra environment (ENV_SUFFIXES)."""
    if not method.startswith("compact"):
        return {}
    return {k: v for suffix, env in ENV_SUFFIXES.items() if suffix in method for k, v in env.items()}


def metered(method: str) -> bool:
    """A compact server whose /metrics give each round's density."""
    return method.startswith("compact") and "--enable-metrics" in method_args(method)[1]


def compact_counters(srv) -> dict:
    """The compact series needed for a round's density, summed over their label sets."""
    want = {"sglang:compact_density_forward_sum": "dsum", "sglang:compact_density_forward_count": "dcount"}
    out = {"dsum": 0.0, "dcount": 0.0, "sparse": 0.0, "dense_density": 0.0, "qblocks": 0.0}
    for line in srv.metrics().splitlines():
        if not line.startswith("sglang:compact_"):
            continue
        name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
        if name in want:
            out[want[name]] += value
        elif name == "sglang:compact_qblocks_total":
            out["qblocks"] += value
            if 'path="sparse"' in line:
                out["sparse"] += value
            elif 'path="dense_density"' in line:
                out["dense_density"] += value
    return out


def pooled_fields(got: dict, metered_server: bool, unread: bool) -> dict:
    """A row's measured fields from the rounds of every start of one (chunk, context, batch, method): the
    median over all of them (not the median of the starts' medians, so a start that timed fewer rounds weighs
    less). Density fields are None for a compact server without metrics, 1.0 / 0.0 for stock."""
    med = lambda xs: statistics.median(xs) if xs else None   # noqa: E731
    return {"density": med(got["dens"]) if metered_server else None if unread else 1.0,
            "sparse_qblocks": med(got["frac"]) if metered_server else None if unread else 0.0,
            "dense_density_qblocks": med(got["fell"]) if metered_server else None if unread else 0.0,
            "ms": 1000 * statistics.median(got["times"]),
            "ms_all": [round(1000 * t, 1) for t in got["times"]],
            **({"decode_ms": med(got["decode"]), "decode_ms_all": [round(x, 3) for x in got["decode"]]}
               if got.get("decode") else {})}


def decode_ms_per_token(token_times: list[list[float]]) -> float | None:
    """Decode time per token of one round of concurrent streamed requests, each given the arrival times of its
    tokens: from the moment every request has its first token (before it, some were still prefilling), each
    request's span from its first token then to its last over the tokens in between; the median over the
    requests, in ms. None where no request has two tokens in that span."""
    if not token_times or not all(token_times):
        return None
    all_started = max(t[0] for t in token_times)
    per_request = []
    for times in token_times:
        after = [t for t in times if t >= all_started]
        if len(after) >= 2:
            per_request.append(1000 * (after[-1] - after[0]) / (len(after) - 1))
    return statistics.median(per_request) if per_request else None


def round_ratios(base_ms, ms, level: float = 0.95) -> dict | None:
    """The per-round ratio base / method of two servers timed in the same rounds (round i of each, one after the
    other): its median and a distribution-free interval for that median (order statistics; with few rounds the
    widest, [min, max], whose coverage 1 - 2 / 2^n is reported). None without rounds to pair."""
    n = min(len(base_ms), len(ms))
    if n == 0:
        return None
    ratios = sorted(b / m for b, m in zip(base_ms[:n], ms[:n]))

    def coverage(k: int) -> float:   # of [x_(k), x_(n-k+1)], 1-based: 1 - 2 P(Binomial(n, 1/2) <= k - 1)
        return 1.0 - 2.0 * sum(comb(n, j) for j in range(k)) / 2.0 ** n
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return {"median": statistics.median(ratios), "lo": ratios[k - 1], "hi": ratios[n - k],
            "coverage": round(coverage(k), 4), "rounds": n}


RESUME_FREE_FLAGS = ("--resume",)            # flags that may differ between the calls of one run
RESUME_FREE_VALUES = ("--deadline-s",)      # ... with their values


def run_signature(argv: list[str]) -> list[str]:
    """The command line that identifies a run across `--resume` calls: argv less the flags free to change."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in RESUME_FREE_FLAGS or any(x.startswith(f + "=") for f in RESUME_FREE_VALUES):
            pass
        elif x in RESUME_FREE_VALUES:
            skip = True
        else:
            out.append(x)
    return out


def load_run_state(path: Path, signature: list[str], gpu: str) -> dict | None:
    """The state an earlier call of this run left at `path` (None: there is none, a new run starts). A state of
    another command or another GPU stops the call: continuing it would mix two runs in one table."""
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
        theirs, their_gpu = state["signature"], state["gpu"]
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--resume: {path} is not a run state ({e}); remove it to start afresh")
    if theirs != signature:
        raise SystemExit(f"--resume: {path} is the state of another command:\n  {' '.join(theirs)}\nnot\n  "
                         f"{' '.join(signature)}\n(only --deadline-s may differ); run that command with --resume, "
                         "or this one without it to start afresh")
    if their_gpu != gpu:
        raise SystemExit(f"--resume: {path} was timed on {their_gpu}, this is {gpu}: one run is one machine")
    return state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--replot", metavar="SPEED_JSON",
                     help="no timing: redraw <out-dir>/<name>.png from the ttft rows of this speed.json dated "
                          "--replot-date* (several runs and models in one figure; rows of --layers configs left out)")
    src.add_argument("--model", choices=["llama-3.1-8b", "qwen2.5-0.5b"], help="a config with dummy weights")
    src.add_argument("--model-path", help="an HF folder with real weights")
    ap.add_argument("--model-name", default=None, help="name in the rows (default: --model or the folder name)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the dummy config (default: all)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--chunks", default="1024,8192")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--methods", default="flashinfer,compact,compact-dense")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel size. KV per rank = batch x (context + 1024) x layers x 2 x (kv heads / tp) "
                         "x head_dim x 2 bytes: Llama-3.1-8B at batch 8 x 128K is 8 x 132K x 32 x 2 x 4 x 128 x 2 "
                         "= 69 GB per rank at TP2, plus 8 GB of weights per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--starts", type=int, default=1,
                    help="start each group of servers this many times, in turn (every group, then every group "
                         "again): a row takes the median over the rounds of all starts and lists each start's "
                         "median (ms_per_start). A host-bound model's TTFT moves between server processes of one "
                         "configuration (1.4x at Qwen 8K chunk 1024 in session 41), which more rounds of one "
                         "process do not average")
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="untimed rounds at each (context, batch) before its timed ones (default 0: only the one "
                         "warm-up request at the longest context)")
    ap.add_argument("--no-prefill-graphs", action="store_true", help="start every server with "
                    "--disable-prefill-cuda-graph (default: SGLang's breakable prefill CUDA graphs)")
    ap.add_argument("--extra-args", default="", help="more flags for every server")
    ap.add_argument("--name", default="speed_no_harm", help="basename of the table and plot")
    ap.add_argument("--out-dir", default=str(REPO / "docs" / "results"))
    ap.add_argument("--deadline-s", type=float, default=None, help="start no new (chunk, method) after this")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run whose state this command left in <out-dir>/<--name>.state.json: time "
                         "only the groups not yet timed, then write the whole run's rows, table and plot (a new "
                         "run where there is no state)")
    ap.add_argument("--side-by-side", type=int, default=0,
                    help="servers started together, in --methods order (default: all of a chunk size; several "
                         "8B servers at 128K do not fit one GPU)")
    ap.add_argument("--sequential", action="store_true",
                    help="start one server at a time (big models: several side by side may not fit)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing each (context, batch), one more round with SGLang's torch profiler on for "
                         "this many forward passes, started --profile-at of the way through (0: off); the trace "
                         "summaries go to <out-dir>/profile_<name>.{md,json} (scripts/trace_summary.py), the "
                         "traces themselves to <out-dir>/traces/")
    ap.add_argument("--profile-at", type=float, default=0.6,
                    help="fraction of the timed TTFT after which profiling starts (default 0.6)")
    ap.add_argument("--next-turn", type=int, default=0, metavar="TOKENS",
                    help="time the next turn of a conversation instead of a fresh prompt: each timed request of "
                         "--contexts tokens is a first turn (answered just before, untimed, with --answer-tokens) "
                         "followed by its answer and TOKENS new tokens; rows record the tokens served from the "
                         "cache (0: off)")
    ap.add_argument("--answer-tokens", type=int, default=256, help="with --next-turn: the first turn's answer")
    ap.add_argument("--decode-tokens", type=int, default=0, metavar="N",
                    help="stream N output tokens per timed request (not 1) and add the decode time per token to the "
                         "rows (decode_ms; 0: off)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--replot-date", default="", help="with --replot: the rows' date prefix (ISO, UTC)")
    ap.add_argument("--dry-run", action="store_true", help="print the servers, their flags and the per-rank KV "
                    "memory, then exit")
    a = ap.parse_args()
    if a.starts < 1 or a.warmup_rounds < 0 or a.reps < 1:
        raise SystemExit("--starts and --reps must be >= 1, --warmup-rounds >= 0")
    if a.decode_tokens and a.decode_tokens < 3:
        raise SystemExit(f"--decode-tokens {a.decode_tokens}: at least 3 (a first token and two decode steps), "
                         "or 0 for time to first token only")
    if a.replot:
        return replot(a)
    t_start = time.time()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.model:
        model = write_model_dir(f"/tmp/{a.model}-dummy", a.model, a.layers)
        model_flags = ["--load-format", "dummy", "--skip-tokenizer-init"]
        name = a.model_name or a.model
        vocab = (1000, 120000 if a.model.startswith("llama") else 150000)
    else:
        model = Path(a.model_path)
        model_flags = []
        name = a.model_name or model.name
        vocab = (1000, json.loads((model / "config.json").read_text())["vocab_size"] - 1000)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    contexts, chunks, batches = ints(a.contexts), ints(a.chunks), ints(a.batches)
    if a.next_turn < 0 or a.answer_tokens < 1 or (a.next_turn and min(contexts) <= a.next_turn + a.answer_tokens):
        raise SystemExit(f"--next-turn {a.next_turn} / --answer-tokens {a.answer_tokens}: both must leave a first "
                         f"turn in the shortest context ({min(contexts)} tokens); --answer-tokens >= 1")
    methods = split_methods(a.methods)
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cmd = "python3 scripts/bench_ttft.py " + " ".join(sys.argv[1:])
    state_path = out / f"{a.name}.state.json"
    signature = run_signature(sys.argv[1:])
    prior, calls = None, 1
    if a.resume and not a.dry_run:
        prior = load_run_state(state_path, signature, gpu)
        if prior:
            date, cmd, calls = prior["date"], prior["cmd"], prior["calls"] + 1
            print(f"--resume: call {calls} of the run of {date}: {len(prior['done'])} groups timed before",
                  flush=True)
        else:
            print(f"--resume: no state in {state_path}: a new run", flush=True)
    rng = random.Random(calls - 1)   # fresh prompts in every call (the servers are new: no cache hits anyway)
    rows = []
    pool_tokens = (max(contexts) + 1024) * max(batches) + 4096
    context_len = max(contexts) + 256
    hf = json.loads((Path(model) / "config.json").read_text())
    model_max = hf.get("max_position_embeddings")
    if model_max and context_len > model_max:
        raise SystemExit(f"--contexts: the longest prompt plus 256 ({context_len}) exceeds the model's "
                         f"{model_max} positions; use at most {model_max - 256}")

    def start(method: str, chunk: int):
        module, flags = method_args(method)
        common = model_flags + ["--page-size", str(a.page_size), "--tp", str(a.tp), "--chunked-prefill-size",
                                str(chunk), "--context-length", str(context_len), "--max-running-requests",
                                str(max(batches)), "--cuda-graph-max-bs", str(max(batches)),
                                "--mem-fraction-static", "0.9", "--max-total-tokens", str(pool_tokens),
                                # idle side-by-side schedulers would each spin a CPU core while another is timed
                                "--sleep-on-idle"]
        if a.no_prefill_graphs:
            common.append("--disable-prefill-cuda-graph")
        common += a.extra_args.split()
        return start_server(module, model, common + flags, out / f"ttft_{name}_{file_label(method)}_c{chunk}.log",
                            timeout=a.start_timeout, env=method_env(method))

    def round_(srv, n_tokens: int, n_req: int) -> tuple[float, int, float | None]:
        """(seconds to the last request's first token, tokens served from the cache summed over the requests,
        decode ms per token with --decode-tokens else None) of one timed round: `n_req` fresh prompts of
        `n_tokens`; with --next-turn, each the next turn of a conversation whose first turn (the prompt less the
        answer and the new message) was answered just before, untimed."""
        M, R = a.next_turn, a.answer_tokens
        prompts = [[rng.randrange(*vocab) for _ in range(n_tokens - (M + R if M else 0))] for _ in range(n_req)]
        with cf.ThreadPoolExecutor(n_req) as ex:
            if M:
                answers = list(ex.map(lambda p: generate(srv, p, R).output_ids, prompts))
                prompts = [p + list(ans) + [rng.randrange(*vocab) for _ in range(M)]
                           for p, ans in zip(prompts, answers)]
            if a.decode_tokens:
                t0 = time.monotonic()
                done = list(ex.map(lambda p: srv.generate_stream(p, a.decode_tokens), prompts))
                return (max(r.token_times[0] for r in done) - t0, sum(r.cached_tokens for r in done),
                        decode_ms_per_token([r.token_times for r in done]))
            t0 = time.time()
            done = list(ex.map(lambda p: generate(srv, p, 1), prompts))
            return time.time() - t0, sum(r.cached_tokens for r in done), None

    samples: dict = {}   # (chunk, context, batch, method) -> the rounds of every start, pooled
    done: set = set()    # (chunk, start, group index) timed, in this call or an earlier one of the run
    if prior:
        samples.update({tuple(s["key"]): s["got"] for s in prior["samples"]})
        done.update(tuple(d) for d in prior["done"])

    def measure(servers: dict, chunk: int, group: int, start_no: int) -> None:
        """Every server of one chunk size, interleaved: for each (context, batch), rep after rep, each server
        times one round alone (the others idle), so drift over the run reaches every method alike."""
        for srv in servers.values():
            # warm-up at the longest context: every code path (the sparse one included) compiles before timing
            generate(srv, [rng.randrange(*vocab) for _ in range(max(contexts))], 1)
        for ctx in contexts:
            for bsz in batches:
                for _ in range(a.warmup_rounds):
                    for srv in servers.values():
                        round_(srv, ctx, bsz)
                got = {m: samples.setdefault((chunk, ctx, bsz, m), {
                    "times": [], "cached": [], "dens": [], "frac": [], "fell": [], "per_start": [], "decode": [],
                    "group": group, "start_s": []}) for m in servers}
                times = {m: [] for m in servers}
                for _ in range(a.reps):
                    for method, srv in servers.items():
                        compact = metered(method)
                        before = compact_counters(srv) if compact else None
                        seconds, hit, decode_ms = round_(srv, ctx, bsz)
                        times[method].append(seconds)
                        got[method]["cached"].append(hit)
                        if decode_ms is not None:
                            got[method]["decode"].append(decode_ms)
                        if compact:
                            after = compact_counters(srv)
                            dc = after["dcount"] - before["dcount"]
                            got[method]["dens"].append((after["dsum"] - before["dsum"]) / dc if dc else 1.0)
                            dq = after["qblocks"] - before["qblocks"]
                            got[method]["frac"].append((after["sparse"] - before["sparse"]) / dq if dq else 0.0)
                            got[method]["fell"].append(
                                (after["dense_density"] - before["dense_density"]) / dq if dq else 0.0)
                for method, srv in servers.items():
                    got[method]["times"] += times[method]
                    got[method]["per_start"].append(1000 * statistics.median(times[method]))
                    got[method]["start_s"].append(round(srv.startup_seconds or 0, 1))
                    decode = (f"; decode {statistics.median(got[method]['decode']):.2f} ms per token"
                              if got[method]["decode"] else "")
                    print(f"{method} chunk {chunk} ctx {ctx} batch {bsz} start {start_no + 1}: "
                          f"{1000 * statistics.median(times[method]):.1f} ms "
                          f"(all {[round(1000 * t, 1) for t in times[method]]}){decode}", flush=True)
                if a.profile_steps:
                    for method, srv in servers.items():
                        profile(srv, method, chunk, ctx, bsz, statistics.median(times[method]))

    def make_rows() -> None:
        for (chunk, ctx, bsz, method), got in samples.items():
            compact = metered(method)
            unread = method.startswith("compact") and not compact   # a compact server without metrics
            row = {"bench": "ttft", "model": name, "context": ctx, "chunk": chunk, "batch": bsz,
                   "tp": a.tp, "method": method, **pooled_fields(got, compact, unread),
                   "speedup_vs_flashinfer": None, "prefill_graphs": not a.no_prefill_graphs,
                   "page_size": a.page_size, "server_start_s": got["start_s"][0],
                   "gpu": gpu, "date": date, "cmd": cmd, "group": got["group"]}
            if a.starts > 1:
                row.update(starts=len(got["per_start"]), ms_per_start=[round(x, 1) for x in got["per_start"]],
                           server_start_s_all=got["start_s"])
            if calls > 1:
                row["calls"] = calls
            if a.next_turn:
                row.update(next_turn=a.next_turn, answer_tokens=a.answer_tokens,
                           cached_tokens=statistics.median(got["cached"]))
            rows.append(row)
            print(f"{method} chunk {chunk} ctx {ctx} batch {bsz}: {row['ms']:.1f} ms (all {row['ms_all']}) " +
                  ("density not read" if unread else
                   f"density {row['density']:.3f} sparse q-blocks {row['sparse_qblocks']:.2f} dense by density "
                   f"{row['dense_density_qblocks']:.2f}"), flush=True)

    profiles = list(prior["profiles"]) if prior else []

    def save_state() -> None:
        state = {"signature": signature, "gpu": gpu, "date": date, "cmd": cmd, "calls": calls,
                 "done": sorted(done), "samples": [{"key": list(k), "got": g} for k, g in samples.items()],
                 "profiles": profiles}
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(state_path)

    def profile(srv, method: str, chunk: int, ctx: int, bsz: int, ttft_s: float) -> None:
        """One more round, untimed, with SGLang's profiler on for a few forward passes part way through."""
        pid = f"{method}_c{chunk}_ctx{ctx}_b{bsz}"
        trace_dir = (out / "traces").resolve()   # kept beside the summaries, which keep only the top ops
        trace_dir.mkdir(parents=True, exist_ok=True)
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(round_, srv, ctx, bsz)
            time.sleep(a.profile_at * ttft_s)
            reply = srv.post("/start_profile", {"output_dir": str(trace_dir), "num_steps": a.profile_steps,
                                                "activities": ["CPU", "GPU"], "with_stack": False,
                                                "record_shapes": False, "profile_id": pid})
            fut.result()
        trace = trace_dir / f"{pid}-TP-0.trace.json.gz"
        stopped = None
        for i in range(60):  # the scheduler writes it when the last profiled step ends
            if trace.exists():
                break
            if i == 5:
                # a prompt that ended before its profiled steps did leaves the profiler waiting for passes that
                # never come (the round is over): stop it, so it writes what it has
                try:
                    stopped = srv.post("/stop_profile", {})
                except Exception as e:  # noqa: BLE001
                    stopped = f"stop_profile failed: {e}"
            time.sleep(1)
        if not trace.exists():
            print(f"profile {pid}: no trace (start: {reply}; stop: {stopped})", flush=True)
            return
        time.sleep(2)  # let the export finish
        events = trace_summary.load_trace(trace)
        layers = a.layers or (32 if a.model == "llama-3.1-8b" else 24)
        steps = trace_summary.count_forward_passes(events, layers) or a.profile_steps + 1
        summary = trace_summary.summarize(events, steps)
        summary.update(method=method, chunk=chunk, context=ctx, batch=bsz, prefix_at_start=int(a.profile_at * ctx))
        profiles.append(summary)
        print(trace_summary.render(summary, pid).splitlines()[2], flush=True)

    if a.dry_run:
        layers = hf["num_hidden_layers"]
        kv_heads, head_dim = hf["num_key_value_heads"], hf.get("head_dim") or hf["hidden_size"] // hf[
            "num_attention_heads"]
        kv = pool_tokens * layers * 2 * (kv_heads // a.tp) * head_dim * 2
        print(f"model {name}: {layers} layers, {kv_heads} kv heads x {head_dim}; pool {pool_tokens} tokens: "
              f"{kv / 2**30:.1f} GiB of KV per rank at TP{a.tp}")
        for chunk in chunks:
            for m in methods:
                module, flags = method_args(m)
                print(f"chunk {chunk} {m}: python3 -m {module} --model-path {model} --chunked-prefill-size {chunk} "
                      f"--tp {a.tp} {' '.join(flags)}")
            print(f"  then per server: contexts {contexts} x batches {batches}, {a.reps} reps each"
                  f"{f', each server started {a.starts} times' if a.starts > 1 else ''}")
        return 0
    group_id = 0   # servers timed in one group had their rounds interleaved
    for chunk in chunks:
        n = 1 if a.sequential else (a.side_by_side or len(methods))
        groups = [methods[i:i + n] for i in range(0, len(methods), n)]
        first_group = group_id + 1   # group ids depend on the command alone: the same in every call of a run
        group_id = first_group + len(groups) - 1
        if a.deadline_s and time.time() - t_start > a.deadline_s:
            print(f"deadline reached; skipping chunk {chunk}", flush=True)
            continue
        for start_no in range(a.starts):
            for gi, group in enumerate(groups):
                # the same group in every start: its servers' rounds were interleaved in each of them
                group_id = first_group + gi
                if (chunk, start_no, gi) in done:
                    print(f"chunk {chunk} {group} (start {start_no + 1}): timed in an earlier call", flush=True)
                    continue
                if a.deadline_s and time.time() - t_start > a.deadline_s:
                    print(f"deadline reached; skipping chunk {chunk} {group} (start {start_no + 1})", flush=True)
                    continue
                with cf.ThreadPoolExecutor(len(group)) as ex:
                    futures = {m: ex.submit(start, m, chunk) for m in group}
                servers = {}
                for m, f in futures.items():
                    try:
                        servers[m] = f.result()
                    except Exception as e:  # noqa: BLE001
                        print(f"{m} chunk {chunk}: server failed: {e}", flush=True)
                try:
                    if servers and not (a.deadline_s and time.time() - t_start > a.deadline_s):
                        measure(servers, chunk, group_id, start_no)
                        # (a server that failed to start is not retried by --resume, as in a single call)
                        done.add((chunk, start_no, gi))
                        save_state()
                finally:
                    for srv in servers.values():
                        srv.stop()
    make_rows()
    for r in rows:
        base = [x for x in rows if x["method"] == "flashinfer" and all(
            x[k] == r[k] for k in ("model", "context", "chunk", "batch", "tp"))]
        if base:
            r["speedup_vs_flashinfer"] = base[0]["ms"] / r["ms"]
            # rounds interleaved with flashinfer's only when the two servers ran in one group
            r["round_ratio_vs_flashinfer"] = round_ratios(base[0]["ms_all"], r["ms_all"])
            r["interleaved_with_flashinfer"] = base[0]["group"] == r["group"]
        for stock in ("flashinfer", "fa3"):   # decode time per token: the stock server's over the method's
            ref = [x for x in rows if x["method"] == stock and all(
                x[k] == r[k] for k in ("model", "context", "chunk", "batch", "tp"))]
            if r.get("decode_ms") and ref and ref[0].get("decode_ms"):
                r[f"decode_speedup_vs_{stock}"] = ref[0]["decode_ms"] / r["decode_ms"]
    path = out / "speed.json"
    old = json.loads(path.read_text()) if path.exists() else []
    # rows an earlier call of this run appended are replaced: they are in `rows`, with this call's rounds
    old = [r for r in old if not (r.get("date") == date and r.get("cmd") == cmd)]
    path.write_text(json.dumps(old + rows, indent=1))
    turn = (f"Each timed request: the next turn of a conversation ({a.next_turn} new tokens after a first turn "
            f"and its {a.answer_tokens}-token answer); cached: tokens it took from the radix cache (median).\n\n"
            if a.next_turn else "")
    resumed = f" (one run in {calls} calls: the same command again with --resume)" if calls > 1 else ""
    decode = (f"Each timed request streams {a.decode_tokens} tokens; decode: ms per token once every request of "
              "the round has its first token (median over the requests, then over the rounds), and the stock "
              "server's over the method's.\n\n" if a.decode_tokens else "")
    lines = [f"# Time to first token: {name} ({gpu}, {date})", "", f"Command: `{cmd}`{resumed}", "", turn + decode +
             "| context | chunk | batch | method | density | sparse q-blocks | dense by density | TTFT ms (median) | "
             "vs flashinfer | per-round ratio: median [interval] |" + (" cached |" if a.next_turn else "") +
             (" decode ms/token | decode vs flashinfer | decode vs fa3 |" if a.decode_tokens else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if a.next_turn else "") +
             ("---|---|---|" if a.decode_tokens else "")]
    for r in rows:
        sp = f"{r['speedup_vs_flashinfer']:.2f}" if r["speedup_vs_flashinfer"] else ""
        rr = r.get("round_ratio_vs_flashinfer")
        paired = "" if not rr or r["method"] == "flashinfer" else (
            f"{rr['median']:.2f} [{rr['lo']:.2f}, {rr['hi']:.2f}] ({rr['coverage']:.0%}"
            f"{'' if r['interleaved_with_flashinfer'] else ', not interleaved'})")
        num = lambda x: "n/a" if x is None else f"{x:.2f}"   # noqa: E731  (a compact server without metrics)
        per_start = lambda r: (" (starts: " + " / ".join(f"{x:.1f}" for x in r["ms_per_start"]) + ")"  # noqa: E731
                               if r.get("ms_per_start") else "")
        lines.append(f"| {r['context']} | {r['chunk']} | {r['batch']} | {r['method']} | {num(r['density'])} | "
                     f"{num(r['sparse_qblocks'])} | {num(r.get('dense_density_qblocks', 0.0))} | {r['ms']:.1f}"
                     f"{per_start(r)} | "
                     f"{sp} | {paired} |" + (f" {r['cached_tokens']:.0f} |" if a.next_turn else "") +
                     (f" {num(r.get('decode_ms'))} | {num(r.get('decode_speedup_vs_flashinfer'))} | "
                      f"{num(r.get('decode_speedup_vs_fa3'))} |" if a.decode_tokens else ""))
    (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    if profiles:
        (out / f"profile_{a.name}.json").write_text(json.dumps(profiles, indent=1))
        md = [f"# Forward-pass profiles: {name} ({gpu}, {date})", "", f"Command: `{cmd}`", "",
              f"SGLang's torch profiler asked for {a.profile_steps} forward passes, started {a.profile_at:.0%} of the "
              "way through a prompt; per-step figures divide by the forward passes the trace holds.", ""]
        for p in profiles:
            md.append(trace_summary.render(p, f"{p['method']} chunk {p['chunk']} context {p['context']} batch "
                                              f"{p['batch']} (prefix ~{p['prefix_at_start']})"))
        (out / f"profile_{a.name}.md").write_text("\n".join(md) + "\n")
    plot(rows, out / f"{a.name}.png", f"{name}: TTFT of stock flashinfer / TTFT of the method ({gpu})")
    print("\n".join(lines))
    return 0


def plot(rows, path: Path, title: str) -> None:
    """Each method's TTFT ratio against stock flashinfer's over prompt length: one panel per model, a line per
    (method, chunk, batch), solid for the smallest chunk."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.4), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        chunks = sorted({r["chunk"] for r in mine})
        keys = sorted({(r["chunk"], r["method"], r["batch"]) for r in mine if r["method"] != "flashinfer"})
        for c, m, b in keys:
            pts = sorted((r["context"], r["speedup_vs_flashinfer"]) for r in mine
                         if (r["method"], r["chunk"], r["batch"]) == (m, c, b) and r["speedup_vs_flashinfer"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-" if c == chunks[0] else "--", marker="o",
                        label=f"{m}, chunk {c}, batch {b}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(0.97, color="red", lw=0.8, ls=":", label="0.97 (do no harm)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(model, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("TTFT of stock flashinfer / TTFT of the method")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(a) -> int:
    """--replot: the figure of the `ttft` rows in a speed.json whose date starts with --replot-date."""
    rows = [r for r in json.loads(Path(a.replot).read_text()) if r.get("bench") == "ttft"
            and r.get("date", "").startswith(a.replot_date) and r.get("speedup_vs_flashinfer")
            and "--layers" not in r.get("cmd", "")]
    if not rows:
        raise SystemExit(f"{a.replot}: no ttft rows of whole models dated {a.replot_date!r}*")
    out = Path(a.out_dir) / f"{a.name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = ", ".join(sorted({r["date"][:16] for r in rows}))
    plot(rows, out, f"Time to first token against stock SGLang flashinfer ({rows[0].get('gpu', '')}; runs {runs})")
    print(f"{out}: {len(rows)} rows of {len({r['model'] for r in rows})} model(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
