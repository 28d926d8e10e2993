"""SmolLM2-135M-Instruct with REAL weights served by the `compact` backend on an (offline) H200.

    source scripts/gpu/setup.sh; python3 scripts/gpu/smollm2_h200.py --out $OUT

Input: the GGUF (SmolLM2-135M-Instruct.Q4_1.gguf, 98,362,432 bytes, SHA-256 in
scripts/gpu/smollm2.gguf.sha256) carried to the host in pieces under --parts-dir
(/tmp/smollm2): `part_00, part_01, ...` are pieces of the zstd-compressed file
(`.gguf.zst`), or `raw_00, raw_01, ...` pieces of the file itself.

Steps (each recorded in $OUT/smollm2_h200.json; a failing step is recorded and
the next independent one still runs; exit status 1 if any check failed):
  convert   join the pieces (zstd: python `zstandard`, else the `zstd` binary),
            check the SHA-256, `scripts/convert_smollm2.py --gguf ... --dtype bfloat16
            --out /tmp/smollm2-hf`; skipped when that folder already holds a conversion
            of this file.
  dense     stock `sglang.launch_server --attention-backend flashinfer` and
            `sglang_compact.launch_server --attention-backend compact --compact-selector
            dense`, same flags: 12 RULER-style prompts (2K-8K tokens) as input_ids,
            greedy, 32 new tokens, top-2 logprobs; ids compared token for token; at a
            first divergence the top-2 logprob gap of both servers is recorded, and the
            flip passes only as a near-tie (both gaps < 1e-2).
  compact   `compact` with its default selector (flashprefill, default parameters) and
            --enable-metrics: the same prompts; exact match vs the stock outputs and the
            RULER score (recorded, not checked); /metrics saved to $OUT/metrics_h200.txt,
            every `sglang:compact_*` series must be there with a non-zero value.
  frontend  against that server: the SGLang frontend program of tests/frontend_client.py
            (`sgl.function`, a shared ~3K-token document, two `sgl.gen` turns, run_batch
            through `sgl.RuntimeEndpoint`) and one OpenAI-client chat completion on /v1.

The three servers start at the same time on the one GPU. Each caps its KV pool
(--max-total-tokens 32768, 0.75 GB) so that SGLang's memory profile, which
charges whatever the other servers hold at that moment against
--mem-fraction-static 0.1, keeps room in any start order (without the cap the
first server to profile takes all of it and the others fail); a server that
still dies of memory at start is retried once. Decode CUDA graphs up to batch
16 (--cuda-graph-max-bs-decode 16) to shorten the starts. Server logs: $OUT/logs/.
A summary table is printed at the end (and written to $OUT/smollm2_h200.md).

Other uses:
    python3 scripts/gpu/smollm2_h200.py --dry-run            # plan, server commands, prompt lengths
    python3 scripts/gpu/smollm2_h200.py --steps convert      # join + verify + convert only
    python scripts/gpu/smollm2_h200.py --cpu --out /tmp/smoke # the same logic on the CPU (small prompts)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository root: `harness`
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "gpu"))
sys.path.insert(0, str(REPO / "tests"))

from serving_check import top2_gap  # noqa: E402

from harness.server import BASE_ARGS, SERVER_ENV, SGLangServer  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
SHA_FILE = REPO / "scripts" / "gpu" / "smollm2.gguf.sha256"
STEPS = ("convert", "dense", "compact", "frontend")
NEAR_TIE = 1e-2
# the series of sglang_compact/srt/telemetry.py (histogram: its _count/_sum samples)
COMPACT_SERIES = ("sglang:compact_density", "sglang:compact_density_forward", "sglang:compact_coverage",
                  "sglang:compact_forward_passes_total", "sglang:compact_chunks_total",
                  "sglang:compact_tokens_total")
MEMORY_ERRORS = ("out of memory", "not enough memory", "leave no gpu memory", "outofmemoryerror")
# stations added to tests/frontend_client.py's document to make it ~3K tokens
EXTRA_STATIONS = ["Alness", "Banff", "Brora", "Callander", "Crieff", "Dornoch", "Dunbar", "Forres", "Golspie",
                  "Huntly", "Inveraray", "Keith", "Kinross", "Lairg", "Lanark", "Melrose", "Moffat", "Nethy",
                  "Peebles", "Pitlochry", "Portree", "Rothes", "Selkirk", "Tain", "Thurso", "Tomintoul",
                  "Ullapool", "Wick", "Alford", "Aboyne", "Ballater", "Braemar", "Cromarty", "Dufftown", "Ellon",
                  "Fochabers", "Girvan", "Hawick", "Insch", "Jedburgh", "Kirriemuir", "Largs", "Mallaig",
                  "Newtonmore", "Oldmeldrum", "Plockton", "Rosehearty", "Strathpeffer"]
FRONTEND_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[3])
import frontend_client as fc
fc.STATIONS = fc.STATIONS + json.loads(sys.argv[2])
print(json.dumps(fc.run(sys.argv[1])))
"""


def now() -> float:
    return time.monotonic()


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def expected_sha() -> str:
    return SHA_FILE.read_text().split()[0].strip().lower()


def tail(path: Path, n: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def headline(text: str) -> str:
    """The last error-looking line of a log tail (else its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|error:|Exception|Traceback|Killed)", ln)
            and not ln.startswith("Traceback")]
    return (errs or lines or [""])[-1][:500]


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "sglang", "flashinfer-python", "transformers", "gguf", "accelerate", "zstandard",
                 "openai", "prometheus_client", "sglang-compact"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def nvidia_smi() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    return r.stdout.strip() or r.stderr.strip()


# --- step 1: join + verify + convert --------------------------------------------------------------

def numbered_parts(folder: Path, prefix: str) -> list[Path]:
    """`prefix00, prefix01, ...` in numeric order; raises if a number is missing."""
    found = {}
    for p in folder.glob(prefix + "*"):
        m = re.fullmatch(re.escape(prefix) + r"(\d+)", p.name)
        if m and p.is_file():
            found[int(m.group(1))] = p
    if found and sorted(found) != list(range(len(found))):
        raise RuntimeError(f"{folder}/{prefix}*: pieces {sorted(found)} are not numbered 0..{len(found) - 1}")
    return [found[i] for i in sorted(found)]


def concat(parts: list[Path], dest: Path) -> None:
    with open(dest, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)


def zstd_decompress(src: Path, dest: Path) -> str:
    """Decompress with the python `zstandard` module, else the `zstd` binary; returns which was used."""
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        dctx = zstandard.ZstdDecompressor()
        with open(src, "rb") as fi, open(dest, "wb") as fo:
            try:
                reader = dctx.stream_reader(fi, read_across_frames=True)
            except TypeError:  # old zstandard: one frame (what `zstd -19` writes)
                reader = dctx.stream_reader(fi)
            with reader:
                shutil.copyfileobj(reader, fo, 1 << 20)
        return f"python zstandard {zstandard.__version__}"
    exe = shutil.which("zstd")
    if exe is None:
        raise RuntimeError("cannot decompress the part_* pieces: neither the python module `zstandard` nor the "
                           "`zstd` binary is available here; send the raw_* (uncompressed) pieces instead")
    r = subprocess.run([exe, "-d", "-q", "-f", str(src), "-o", str(dest)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"zstd -d failed ({r.returncode}): {r.stderr.strip()}")
    return f"zstd binary {exe}"


def join_gguf(parts_dir: Path, rec: dict) -> Path:
    """The verified GGUF under `parts_dir`, joined (and decompressed) from its pieces when needed."""
    want = expected_sha()
    dest = parts_dir / GGUF_NAME
    if dest.is_file() and dest.stat().st_size == GGUF_SIZE and sha256(dest) == want:
        rec["join"] = {"source": f"{dest} (already joined)"}
        return dest
    raw, zst = numbered_parts(parts_dir, "raw_"), numbered_parts(parts_dir, "part_")
    tmp = dest.with_name(dest.name + ".tmp")
    t0 = now()
    if raw:
        concat(raw, tmp)
        rec["join"] = {"source": f"{len(raw)} raw_* pieces", "tool": "concatenation"}
    elif zst:
        zfile = dest.with_name(dest.name + ".zst")
        concat(zst, zfile)
        rec["join"] = {"source": f"{len(zst)} part_* (zstd) pieces", "zst_bytes": zfile.stat().st_size,
                       "tool": zstd_decompress(zfile, tmp)}
    else:
        raise FileNotFoundError(f"no {GGUF_NAME}, raw_NN or part_NN pieces in {parts_dir}")
    size, digest = tmp.stat().st_size, sha256(tmp)
    rec["join"].update(bytes=size, sha256=digest, seconds=round(now() - t0, 1))
    if size != GGUF_SIZE or digest != want:
        tmp.rename(dest.with_name(dest.name + ".bad"))
        raise RuntimeError(f"joined file does not match: {size} bytes sha256 {digest}, want {GGUF_SIZE} bytes "
                           f"sha256 {want} ({SHA_FILE.name}); kept as {dest.name}.bad")
    tmp.rename(dest)
    return dest


def already_converted(model_dir: Path) -> dict | None:
    try:
        record = json.loads((model_dir / "conversion.json").read_text())
    except (OSError, ValueError):
        return None
    ok = (record.get("source_sha256") == expected_sha() and record.get("dtype") == "bfloat16"
          and (model_dir / "model.safetensors").is_file() and (model_dir / "config.json").is_file())
    return record if ok else None


def step_convert(a, rec: dict, logs: Path) -> None:
    done = already_converted(a.model_dir)
    if done is not None:
        rec.update(summary=f"already converted ({a.model_dir}, transformers {done.get('transformers')})",
                   conversion=done)
        return
    gguf = join_gguf(a.parts_dir, rec)
    cmd = [sys.executable, str(REPO / "scripts" / "convert_smollm2.py"), "--gguf", str(gguf),
           "--dtype", "bfloat16", "--out", str(a.model_dir)]
    rec["cmd"] = " ".join(cmd)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(logs / "convert.log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                           timeout=max(60.0, a.deadline - now() - 60))
    if r.returncode != 0:
        raise RuntimeError(f"convert_smollm2.py exited {r.returncode}:\n{tail(logs / 'convert.log')}")
    done = already_converted(a.model_dir)
    if done is None:
        raise RuntimeError(f"{a.model_dir} holds no bfloat16 conversion of this GGUF after convert_smollm2.py")
    rec["conversion"] = done
    rec["summary"] = (f"{rec['join']['source']} ({rec['join'].get('tool', 'verified')}), sha256 ok, converted to "
                      f"{a.model_dir} in {done.get('seconds')} s (transformers {done.get('transformers')})")


# --- servers ----------------------------------------------------------------------------------------

def make_server(name: str, module: str, flags: list[str], model_dir: Path, logs: Path, cpu: bool) -> SGLangServer:
    """`harness.server.SGLangServer` (own process group, free port, /health wait, killed as a whole on stop) with
    exactly the flags given here (no dtype, pool or CPU flags of its own), its output in logs/server_<name>.log."""
    # SGLANG_USE_HND_KVCACHE and PROMETHEUS_MULTIPROC_DIR are not inherited: each server sets its own
    env = {"SGLANG_USE_HND_KVCACHE": None, "PROMETHEUS_MULTIPROC_DIR": None, "PYTHONUNBUFFERED": "1"}
    return SGLangServer(model_dir, module=module, device="cpu" if cpu else "cuda", dtype=None, max_total_tokens=None,
                        max_running_requests=None, cpu_flags=False, extra_args=flags, env=env,
                        log_path=logs / f"server_{name}.log", request_timeout=180, require_cpu_shim=cpu, cwd=REPO)


def server_flags(a) -> dict[str, tuple[str, list[str]]]:
    """name -> (module, flags) of the three servers."""
    common = ["--page-size", "32", "--chunked-prefill-size", "256", "--disable-prefill-cuda-graph",
              "--mem-fraction-static", "0.1", "--max-total-tokens", str(a.max_total_tokens)]
    if a.cpu:
        stock_backend = "torch_native"
        common += ["--dtype", "float32", *[x for x in BASE_ARGS if x not in ("--attention-backend", "torch_native")],
                   "--max-running-requests", "4"]
    else:
        stock_backend = "flashinfer"
        common += ["--dtype", "bfloat16", "--cuda-graph-max-bs-decode", "16"]
    common += a.server_arg
    fp = ["--attention-backend", "compact", "--enable-metrics"]
    if a.min_prefix_len is not None:
        fp += ["--compact-min-prefix-len", str(a.min_prefix_len)]
    return {
        "flashinfer": ("sglang.launch_server", ["--attention-backend", stock_backend, *common]),
        "compact_dense": ("sglang_compact.launch_server",
                          ["--attention-backend", "compact", "--compact-selector", "dense", *common]),
        "compact_flashprefill": ("sglang_compact.launch_server", [*fp, *common]),
    }


class Fleet:
    """Starts servers concurrently (one thread each) and stops every one it ever started."""

    def __init__(self, a, logs: Path):
        self.a, self.logs = a, logs
        self.all: list[SGLangServer] = []
        self.ready: dict[str, SGLangServer] = {}
        self.info: dict[str, dict] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.lock = threading.Lock()
        self.closed = False

    def start(self, name: str, module: str, flags: list[str]) -> None:
        with self.lock:
            self.info[name] = {"module": module, "attempts": []}
        t = threading.Thread(target=self._run, args=(name, module, flags), daemon=True, name=f"start-{name}")
        self.threads[name] = t
        t.start()

    def _run(self, name: str, module: str, flags: list[str]) -> None:
        for attempt in range(2):
            with self.lock:
                if self.closed:
                    return
                srv = make_server(name, module, flags, self.a.model_dir, self.logs, self.a.cpu)
                if attempt:
                    srv.log_path = self.logs / f"server_{name}.retry.log"
                srv.start_timeout = max(30.0, self.a.deadline - now() - 45)
                self.all.append(srv)
                self.info[name].update(cmd=" ".join(srv.command), log=str(srv.log_path.relative_to(self.a.out)))
            t0 = now()
            try:
                srv.start()
            except Exception as e:  # ServerError, or stop() from the main thread
                log = tail(srv.log_path, 20000).lower()
                with self.lock:
                    self.info[name]["attempts"].append({"ok": False, "seconds": round(now() - t0, 1),
                                                        "error_line": headline(str(e)), "error": str(e)[-3000:]})
                retry = any(m in log for m in MEMORY_ERRORS) and self.a.deadline - now() > 150
                if not retry:
                    return
                time.sleep(5)  # the others hold their memory by now: their share is known
                continue
            with self.lock:
                self.info[name]["attempts"].append({"ok": True, "seconds": round(now() - t0, 1)})
                self.info[name]["start_s"] = round(now() - t0, 1)
                self.ready[name] = srv
            return

    def wait(self, name: str) -> SGLangServer:
        t = self.threads.get(name)
        if t is None:
            raise RuntimeError(f"server {name} was not started")
        t.join(max(1.0, self.a.deadline - now()))
        if name not in self.ready:
            attempts = self.info[name]["attempts"]
            why = attempts[-1]["error_line"] if attempts else "did not become healthy within the time budget"
            raise RuntimeError(f"server {name} is not up: {why} (see {self.info[name].get('log')})")
        return self.ready[name]

    def stop(self, name: str) -> None:
        srv = self.ready.pop(name, None)
        if srv is not None:
            srv.stop()

    def stop_all(self) -> None:
        with self.lock:
            self.closed = True
        for srv in list(self.all):
            srv.stop()
        for t in self.threads.values():
            t.join(10)
        for srv in list(self.all):  # one that a thread launched while we were stopping
            srv.stop()


# --- step 2/3: prompts through the servers --------------------------------------------------------

def build_prompts(a):
    from harness.eval.tasks import load_tokenizer, make_suite

    tok = load_tokenizer(str(a.model_dir))
    samples = make_suite(tok, tasks=a.tasks, lengths=a.lengths, n=1, seed=0)
    limit = getattr(tok, "model_max_length", None)
    cfg = json.loads((a.model_dir / "config.json").read_text())
    context = int(cfg.get("max_position_embeddings", 8192))
    too_long = [s.num_tokens for s in samples if s.num_tokens + a.new_tokens >= context]
    if too_long:
        raise RuntimeError(f"prompts of {too_long} tokens + {a.new_tokens} new exceed the context {context} "
                           f"(tokenizer max {limit}); lower --lengths")
    return tok, samples


def generate(srv: SGLangServer, ids: list[int], n: int) -> dict:
    try:
        srv.flush_cache()  # every prompt from an empty radix cache: chunks start at token 0
    except Exception:
        pass
    payload = {"input_ids": [int(t) for t in ids],
               "sampling_params": {"temperature": 0.0, "max_new_tokens": int(n)},
               "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": len(ids) - 1}
    t0 = now()
    r = srv.post("/generate", payload)
    m = r.get("meta_info", {})
    return {"ids": list(r.get("output_ids", [])), "text": r.get("text", ""), "seconds": round(now() - t0, 3),
            "meta": m, "prompt_tokens": m.get("prompt_tokens"), "cached_tokens": m.get("cached_tokens")}


def run_prompts(srv: SGLangServer, samples, n: int) -> list[dict]:
    return [generate(srv, s.input_ids, n) for s in samples]


def compare(want: dict, got: dict) -> dict:
    """Token-for-token comparison; at the first divergence the top-2 logprob gap of both sides."""
    wi, gi = want["ids"], got["ids"]
    k = next((i for i, (x, y) in enumerate(zip(wi, gi)) if x != y), None)
    if k is None and len(wi) != len(gi):
        k = min(len(wi), len(gi))  # one stopped (EOS) where the other went on
    row = {"equal": wi == gi, "first_divergence": k, "len_ref": len(wi), "len_got": len(gi)}
    if k is not None:
        row.update(gap_ref=top2_gap(want["meta"], k), gap_got=top2_gap(got["meta"], k),
                   ref_token=wi[k] if k < len(wi) else None, got_token=gi[k] if k < len(gi) else None)
        gaps = [row["gap_ref"], row["gap_got"]]
        row["near_tie"] = all(g is not None and g < NEAR_TIE for g in gaps)
    return row


def step_dense(a, rec: dict, fleet: Fleet, samples, outputs: dict) -> None:
    fi = fleet.wait("flashinfer")
    rec["gpu"] = None if a.cpu else nvidia_smi()
    outputs["flashinfer"] = run_prompts(fi, samples, a.new_tokens)  # the reference of step `compact` too
    fleet.stop("flashinfer")
    cd = fleet.wait("compact_dense")
    outputs["compact_dense"] = run_prompts(cd, samples, a.new_tokens)
    rows = []
    for s, w, g in zip(samples, outputs["flashinfer"], outputs["compact_dense"]):
        rows.append({"task": s.task, "length": s.length, "prompt_tokens": s.num_tokens, **compare(w, g),
                     "flashinfer_s": w["seconds"], "compact_s": g["seconds"],
                     "flashinfer_text": w["text"], "compact_text": g["text"],
                     "flashinfer_ids": w["ids"], "compact_ids": g["ids"]})
    flips = [r for r in rows if not r["equal"]]
    bad = [r for r in flips if not r.get("near_tie")]
    rec.update(n=len(rows), equal=len(rows) - len(flips), near_tie_flips=len(flips) - len(bad),
               real_divergences=len(bad), rows=rows)
    rec["checks"] = {"all prompts equal or near-tie flips": not bad}
    rec["summary"] = (f"{rec['equal']}/{len(rows)} token-identical, {rec['near_tie_flips']} near-tie flips, "
                      f"{len(bad)} real divergences")
    fleet.stop("compact_dense")


def parse_metrics(text: str) -> dict[str, list[tuple[str, float]]]:
    """sample name -> [(labels, value)] of the Prometheus text format."""
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(\{.*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((m.group(2) or "", value))
    return out


def check_series(text: str) -> dict[str, dict]:
    samples = parse_metrics(text)
    res = {}
    for name in COMPACT_SERIES:
        if name == "sglang:compact_density_forward":
            vals = [v for k in ("_count", "_sum") for _, v in samples.get(name + k, [])]
        else:
            vals = [v for _, v in samples.get(name, [])]
        res[name] = {"present": bool(vals), "samples": len(vals), "nonzero": sum(v != 0 for v in vals),
                     "max": max(vals) if vals else None}
    fwd = {k: sum(v for lab, v in samples.get("sglang:compact_density_forward" + k, []) if 'after_group' in lab)
           for k in ("_sum", "_count")}
    res["_mean_density_after_group"] = fwd["_sum"] / fwd["_count"] if fwd["_count"] else None
    return res


def step_compact(a, rec: dict, fleet: Fleet, samples, outputs: dict, out: Path) -> None:
    srv = fleet.wait("compact_flashprefill")
    rec["gpu"] = None if a.cpu else nvidia_smi()
    got = outputs["compact_flashprefill"] = run_prompts(srv, samples, a.new_tokens)
    ref_name = "flashinfer" if "flashinfer" in outputs else ("compact_dense" if "compact_dense" in outputs else None)
    rows = []
    for i, (s, g) in enumerate(zip(samples, got)):
        row = {"task": s.task, "length": s.length, "prompt_tokens": s.num_tokens, "seconds": g["seconds"],
               "text": g["text"], "ids": g["ids"], "score": s.score(g["text"])}
        if ref_name:
            w = outputs[ref_name][i]
            row.update(compare(w, g), ref_score=s.score(w["text"]))
        rows.append(row)
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    rec.update(rows=rows, n=len(rows), reference=ref_name, score=mean([r["score"] for r in rows]),
               ref_score=mean([r["ref_score"] for r in rows]) if ref_name else None,
               exact_match=sum(r["equal"] for r in rows) if ref_name else None)
    # the telemetry of a forward pass is flushed on the next one: one short request more
    generate(srv, samples[0].input_ids[:64], 2)
    text = srv.get_text("/metrics")
    (out / "metrics_h200.txt").write_text(text)
    series = check_series(text)
    rec["metrics"] = series
    missing = [k for k in COMPACT_SERIES if not series[k]["present"]]
    zero = [k for k in COMPACT_SERIES if series[k]["present"] and not series[k]["nonzero"]]
    rec["checks"] = {"all requests answered": all(len(g["ids"]) > 0 for g in got),
                     "compact_* series present": not missing, "compact_* series non-zero": not zero}
    rec["summary"] = (f"exact {rec['exact_match']}/{len(rows)} vs {ref_name}, score {rec['score']} "
                      f"(ref {rec['ref_score']}), density {fmt(series['_mean_density_after_group'])}; "
                      f"metrics {len(COMPACT_SERIES) - len(missing) - len(zero)}/{len(COMPACT_SERIES)} series "
                      f"non-zero" + (f" (missing {missing})" if missing else "") + (f" (zero {zero})" if zero else ""))


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


# --- step 4: frontend ------------------------------------------------------------------------------

def frontend_extra_stations(tok, target: int) -> list[str]:
    """Stations to add to tests/frontend_client.py's document so that it has about `target` tokens."""
    import frontend_client as fc

    base = list(fc.STATIONS)
    try:
        for k in range(len(EXTRA_STATIONS) + 1):
            fc.STATIONS = base + EXTRA_STATIONS[:k]
            if len(tok.encode(fc.document(), add_special_tokens=False)) >= target:
                break
        return EXTRA_STATIONS[:k]
    finally:
        fc.STATIONS = base


def step_frontend(a, rec: dict, fleet: Fleet, tok, logs: Path) -> None:
    srv = fleet.wait("compact_flashprefill")
    extra = frontend_extra_stations(tok, a.doc_tokens)
    before = check_series(srv.get_text("/metrics"))
    env = {**os.environ, **(SERVER_ENV if a.cpu else {})}
    cmd = [sys.executable, "-c", FRONTEND_CHILD, srv.base_url, json.dumps(extra), str(REPO / "tests")]
    t0 = now()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=max(30.0, min(300.0, a.deadline - now() - 20)))
    (logs / "frontend.log").write_text(f"$ python -c FRONTEND_CHILD {srv.base_url} ...\n{r.stdout}\n{r.stderr}")
    if r.returncode != 0:
        raise RuntimeError(f"frontend program exited {r.returncode}:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    progs = res["programs"]
    rec["program"] = {"seconds": round(now() - t0, 1), "stations": 16 + len(extra), "programs": progs}
    page = 32
    answers_ok = all(p[n].strip() and (p[n + "_meta"].get("completion_tokens") or 0) > 0
                     for p in progs for n in ("answer", "short"))
    turn2_cached = all((p["short_meta"].get("cached_tokens") or 0) >= (p["answer_meta"].get("prompt_tokens") or 0)
                       - page for p in progs)
    shared = sorted((p["answer_meta"].get("cached_tokens") or 0) / max(1, p["answer_meta"].get("prompt_tokens") or 1)
                    for p in progs)
    doc_tokens = min(p["answer_meta"].get("prompt_tokens") or 0 for p in progs)

    import openai

    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="EMPTY",
                           timeout=max(30.0, min(120.0, a.deadline - now() - 10)))
    model = client.models.list().data[0].id
    t0 = now()
    resp = client.chat.completions.create(
        model=model, temperature=0, max_tokens=16,
        messages=[{"role": "system", "content": res["system"]},
                  {"role": "user", "content": "Which crop did station Moray sow?"}])
    reply = resp.choices[0].message.content or ""
    rec["openai"] = {"model": model, "reply": reply, "prompt_tokens": resp.usage.prompt_tokens,
                     "completion_tokens": resp.usage.completion_tokens, "seconds": round(now() - t0, 2)}
    after = check_series(srv.get_text("/metrics"))
    chunks = [s["sglang:compact_chunks_total"]["max"] or 0 for s in (before, after)]
    rec["compact_chunks_during_frontend"] = chunks[1] - chunks[0]
    rec["checks"] = {
        "program answers non-empty": bool(answers_ok),
        f"document >= {int(0.8 * a.doc_tokens)} tokens": doc_tokens >= 0.8 * a.doc_tokens,
        "second turn served from the radix cache": turn2_cached,
        "shared document cached for programs 2..": all(x >= 0.5 for x in shared[1:]),
        "openai reply non-empty": bool(reply.strip()),
        "openai usage sane": resp.usage.prompt_tokens > 0.8 * a.doc_tokens and 0 < resp.usage.completion_tokens <= 16,
    }
    rec["summary"] = (f"{len(progs)} programs, doc {doc_tokens} tokens, answers {[p['answer'] for p in progs]}; "
                      f"openai: {reply!r} ({resp.usage.prompt_tokens} prompt tokens)")


# --- driver ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    p.add_argument("--parts-dir", type=Path, default=Path("/tmp/smollm2"))
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/smollm2-hf"))
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the server commands, start nothing")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run (default 345; 1800 with --cpu)")
    p.add_argument("--tasks", default="niah_single_number,niah_multikey,vt")
    p.add_argument("--lengths", default="2048,4096,6144,8064", help="RULER lengths (prompt = length - task tokens)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--doc-tokens", type=int, default=None, help="frontend document size (default 3000; 800 on CPU)")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool cap of every server")
    p.add_argument("--min-prefix-len", type=int, default=None,
                   help="--compact-min-prefix-len of the flashprefill server (default: the backend's, 4096)")
    p.add_argument("--server-arg", action="append", default=[], help="one more flag for every server (repeatable)")
    p.add_argument("--cpu", action="store_true",
                   help="smoke test of this script on a CPU machine: torch_native instead of flashinfer, "
                        "float32, SGLang's CPU flags (use small --lengths)")
    a = p.parse_args(argv)
    a.steps = [s for s in a.steps.split(",") if s]
    unknown = [s for s in a.steps if s not in STEPS]
    if unknown:
        p.error(f"unknown steps {unknown}; known: {', '.join(STEPS)}")
    a.tasks = [t for t in a.tasks.split(",") if t]
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    a.budget = a.budget or (1800.0 if a.cpu else 345.0)
    a.doc_tokens = a.doc_tokens or (800 if a.cpu else 3000)
    a.model_dir, a.parts_dir, a.out = a.model_dir.resolve(), a.parts_dir.resolve(), a.out.resolve()
    return a


def table(report: dict) -> str:
    lines = ["| step | result | seconds | summary |", "| --- | --- | --- | --- |"]
    for name, rec in report["steps"].items():
        ok = rec.get("ok")
        res = "skipped" if ok is None else ("ok" if ok else "FAILED")
        summary = rec.get("summary") or rec.get("skipped") or (rec.get("error") or "").split("\n")[0]
        failed = [k for k, v in rec.get("checks", {}).items() if not v]
        if failed:
            summary += f" -- failed: {'; '.join(failed)}"
        lines.append(f"| {name} | {res} | {rec.get('seconds', '-')} | {summary.replace('|', '/')[:400]} |")
    starts = [f"{n} {i['start_s']} s" + (" (2nd try)" if len(i["attempts"]) > 1 else "") if "start_s" in i
              else f"{n} NOT UP" for n, i in report.get("servers", {}).items()]
    if starts:
        lines.append(f"| (server starts) | | | {', '.join(starts)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = now()
    a.deadline = t_start + a.budget
    out, logs = a.out, a.out / "logs"
    if a.dry_run:
        return dry_run(a)
    logs.mkdir(parents=True, exist_ok=True)
    report = {"script": "scripts/gpu/smollm2_h200.py", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "argv": sys.argv[1:], "cpu": a.cpu, "versions": versions(), "model_dir": str(a.model_dir),
              "budget_s": a.budget, "steps": {}, "servers": {}}

    fleet = Fleet(a, logs)

    def save():
        report["elapsed_s"] = round(now() - t_start, 1)
        with fleet.lock:  # the start threads write fleet.info (= report["servers"])
            text = json.dumps(report, indent=1, default=str)
        (out / "smollm2_h200.json").write_text(text)

    def run_step(name: str, fn, *args, needs: str | None = None) -> None:
        rec = report["steps"].setdefault(name, {})
        if name not in a.steps:
            rec.update(ok=None, skipped="not in --steps")
            return save()
        if needs:
            rec.update(ok=False, skipped=needs)
            return save()
        if now() > a.deadline - 10:
            rec.update(ok=False, skipped="time budget spent")
            return save()
        print(f"[smollm2_h200] {name} ...", flush=True)
        t0 = now()
        try:
            fn(a, rec, *args)
            rec["ok"] = all(rec.get("checks", {}).values())
        except BaseException as e:
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[-4000:], traceback=traceback.format_exc()[-4000:])
            if not isinstance(e, Exception):
                raise
        finally:
            rec["seconds"] = round(now() - t0, 1)
            save()
        print(f"[smollm2_h200] {name}: {'ok' if rec['ok'] else 'FAILED'} ({rec['seconds']} s) "
              f"{rec.get('summary') or rec.get('skipped') or rec.get('error', '')[-300:]}", flush=True)

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    try:
        run_step("convert", step_convert, logs)
        no_model = None if already_converted(a.model_dir) or (a.cpu and (a.model_dir / "config.json").is_file()) \
            else f"no converted model in {a.model_dir}"
        serving = [s for s in ("dense", "compact", "frontend") if s in a.steps]
        if serving and not no_model:
            flags = server_flags(a)
            wanted = (["flashinfer", "compact_dense"] if "dense" in serving else []) + \
                (["compact_flashprefill"] if {"compact", "frontend"} & set(serving) else [])
            for name in wanted:
                fleet.start(name, *flags[name])
            report["servers"] = fleet.info
        tok = samples = None
        outputs: dict[str, list] = {}
        if serving and not no_model:
            try:
                tok, samples = build_prompts(a)
                report["prompts"] = [s.as_dict() for s in samples]
            except Exception as e:
                no_model = f"prompts: {type(e).__name__}: {e}"
        run_step("dense", step_dense, fleet, samples, outputs, needs=no_model)
        run_step("compact", step_compact, fleet, samples, outputs, out, needs=no_model)
        run_step("frontend", step_frontend, fleet, tok, logs, needs=no_model)
    finally:
        fleet.stop_all()
        report["servers"] = fleet.info
        save()
    checks_failed = [n for n, r in report["steps"].items() if r.get("ok") is False]
    report["ok"] = not checks_failed
    save()
    md_table = table(report)
    (out / "smollm2_h200.md").write_text(md_table + "\n")
    print("\n" + md_table)
    print(f"\n{out / 'smollm2_h200.json'}: {'all checks passed' if report['ok'] else 'FAILED: ' + ', '.join(checks_failed)}"
          f" in {report['elapsed_s']} s")
    return 0 if report["ok"] else 1


def dry_run(a) -> int:
    print(f"steps: {', '.join(a.steps)}; budget {a.budget:.0f} s; out {a.out}")
    done = already_converted(a.model_dir)
    if done:
        print(f"convert: skipped, {a.model_dir} holds the bfloat16 conversion ({done.get('transformers')})")
    else:
        try:
            raw, zst = numbered_parts(a.parts_dir, "raw_"), numbered_parts(a.parts_dir, "part_")
        except RuntimeError as e:
            raw, zst = [], []
            print(f"convert: {e}")
        try:
            import zstandard  # noqa: F401
            tool = "python zstandard"
        except ImportError:
            tool = f"zstd binary {shutil.which('zstd')}" if shutil.which("zstd") else "NONE (send raw_* pieces)"
        joined = a.parts_dir / GGUF_NAME
        print(f"convert: {joined} {'exists' if joined.is_file() else 'missing'}; {len(raw)} raw_* pieces, "
              f"{len(zst)} part_* pieces (decompressor: {tool}); want sha256 {expected_sha()}")
        print(f"  then: {sys.executable} scripts/convert_smollm2.py --gguf {joined} --dtype bfloat16 "
              f"--out {a.model_dir}")
    for name, (module, flags) in server_flags(a).items():
        print(f"server {name}: {sys.executable} -m {module} --model-path {a.model_dir} --host 127.0.0.1 "
              f"--port PORT {' '.join(flags)}")
    if (a.model_dir / "config.json").is_file():
        tok, samples = build_prompts(a)
        print(f"prompts: {[(s.task, s.num_tokens) for s in samples]}")
        extra = frontend_extra_stations(tok, a.doc_tokens)
        import frontend_client as fc
        base = list(fc.STATIONS)
        fc.STATIONS = base + extra
        n = len(tok.encode(fc.document(), add_special_tokens=False))
        fc.STATIONS = base
        print(f"frontend document: {16 + len(extra)} stations, {n} tokens")
    else:
        print(f"prompts: built after the conversion ({a.model_dir} has no config.json yet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
