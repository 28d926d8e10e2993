"""GPU serving checks of the `compact` backend against stock `flashinfer` (run on the H200).

    source scripts/gpu/setup.sh; python3 scripts/gpu/serving_check.py --out $OUT

Starts SGLang servers one after another on a Llama-3.1-8B config with dummy
weights (`--load-format dummy --skip-tokenizer-init`, page 64):
  1. stock `--attention-backend flashinfer`: greedy ids of N prompts (4K-32K tokens);
  2. `compact` with selector `dense`: the same prompts, compared token for token
     (at a divergence, the top-2 logprob gap of both servers is recorded);
  3. `compact` with `flashprefill`: a 128K-token prompt with chunk 1024 (and a
     second server with chunk 8192), decode CUDA graphs on; 32 concurrent
     requests sharing prefixes; after a cache flush the pool's used-token count
     returns to zero.
Writes `serving_check.json` and the server logs under --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from make_llama_config import write_model_dir  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, module, args, log_path, timeout=600):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.cmd = cmd
        self.log = open(log_path, "w")
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}; see {log_path}:\n" + tail(log_path))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    break
            except Exception:
                if time.time() - t0 > timeout:
                    self.stop()
                    raise RuntimeError(f"server did not start in {timeout}s:\n" + tail(log_path))
                time.sleep(2)
        self.start_s = time.time() - t0

    def post(self, path, payload, timeout=1200):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        try:
            return json.loads(body)
        except json.JSONDecodeError:  # e.g. /flush_cache answers plain text
            return body.decode(errors="replace")

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def generate(self, ids, n, logprobs=False):
        payload = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
        if logprobs:
            payload.update(return_logprob=True, top_logprobs_num=2, logprob_start_len=len(ids) - 1)
        t0 = time.time()
        r = self.post("/generate", payload)
        r["_wall_s"] = time.time() - t0
        return r

    def used_tokens(self):
        loads = self.get("/v1/loads?include=core")
        rows = loads.get("loads", loads) if isinstance(loads, dict) else loads
        return [int(r.get("num_used_tokens", r.get("core", {}).get("num_used_tokens", -1))) for r in rows], loads

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def tail(path, n=4000):
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def top2_gap(meta, step):
    try:
        (a, _, _), (b, _, _) = meta["output_top_logprobs"][step][:2]
        return abs(a - b)
    except Exception:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma list of steps to skip: dense,long,concurrent")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = write_model_dir("/tmp/llama-3.1-8b-dummy", "llama-3.1-8b", a.layers)
    skip = set(filter(None, a.skip.split(",")))
    common = ["--model-path", str(model), "--load-format", "dummy", "--skip-tokenizer-init", "--page-size", "64",
              "--disable-prefill-cuda-graph", "--mem-fraction-static", "0.8", "--tp", str(a.tp),
              "--max-running-requests", "48"]
    rng = random.Random(0)
    lengths = [4096, 6000, 8192, 10000, 12288, 16384, 20000, 24576, 28000, 32000][:a.prompts]
    prompts = [[rng.randrange(1000, 120000) for _ in range(L)] for L in lengths]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tp": a.tp, "layers": a.layers,
              "new_tokens": a.new_tokens, "steps": {}}

    def save():
        (out / "serving_check.json").write_text(json.dumps(report, indent=1))

    if "dense" not in skip:
        chunk = ["--chunked-prefill-size", "8192"]
        srv = Server("sglang.launch_server", common + chunk + ["--attention-backend", "flashinfer"], out / "fi.log")
        try:
            want = [srv.generate(p, a.new_tokens, logprobs=True) for p in prompts]
        finally:
            srv.stop()
        srv = Server("sglang_compact.launch_server", common + chunk + [
            "--attention-backend", "compact", "--compact-selector", "dense", "--compact-min-prefix-len", "0"],
            out / "compact_dense.log")
        try:
            got = [srv.generate(p, a.new_tokens, logprobs=True) for p in prompts]
        finally:
            srv.stop()
        rows = []
        for L, w, g in zip(lengths, want, got):
            wi, gi = w["output_ids"], g["output_ids"]
            k = next((i for i, (x, y) in enumerate(zip(wi, gi)) if x != y), None)
            rows.append({"len": L, "equal": wi == gi, "first_divergence": k,
                         "gap_flashinfer": None if k is None else top2_gap(w["meta_info"], k),
                         "gap_compact": None if k is None else top2_gap(g["meta_info"], k),
                         "fi_s": round(w["_wall_s"], 3), "compact_s": round(g["_wall_s"], 3)})
        report["steps"]["dense_vs_flashinfer"] = {"rows": rows, "equal": sum(r["equal"] for r in rows),
                                                  "n": len(rows)}
        save()

    if "long" not in skip:
        for chunk in (1024, 8192):
            srv = Server("sglang_compact.launch_server", common + [
                "--chunked-prefill-size", str(chunk), "--attention-backend", "compact",
                "--compact-selector", "flashprefill", "--context-length", "131072"], out / f"compact_long_{chunk}.log")
            try:
                ids = [rng.randrange(1000, 120000) for _ in range(128 * 1024 - 64)]
                r = srv.generate(ids, a.new_tokens)
                step = {"prompt_tokens": len(ids), "ok": len(r["output_ids"]) == a.new_tokens,
                        "wall_s": round(r["_wall_s"], 2), "server_start_s": round(srv.start_s, 1),
                        "cuda_graph_decode": "Capture cuda graph" in tail(out / f"compact_long_{chunk}.log", 10**7)
                        or "cuda graph" in tail(out / f"compact_long_{chunk}.log", 10**7).lower()}
                report["steps"][f"long_{chunk}"] = step
                save()
                if chunk == 1024 and "concurrent" not in skip:
                    srv.post("/flush_cache", {})
                    time.sleep(2)
                    used0, _ = srv.used_tokens()
                    doc = [rng.randrange(1000, 120000) for _ in range(8192)]
                    reqs = [doc[: 4096 + 64 * (i % 8)] + [rng.randrange(1000, 120000) for _ in range(200 + i)]
                            for i in range(32)]
                    with cf.ThreadPoolExecutor(32) as ex:
                        outs = list(ex.map(lambda p: srv.generate(p, a.new_tokens), reqs))
                    srv.post("/flush_cache", {})
                    time.sleep(2)
                    used1, loads = srv.used_tokens()
                    step["concurrent"] = {"n": len(outs), "ok": all(len(o["output_ids"]) == a.new_tokens for o in outs),
                                          "cached_tokens": [o["meta_info"].get("cached_tokens") for o in outs],
                                          "used_tokens_before": used0, "used_tokens_after_flush": used1,
                                          "loads_after": loads}
                report["steps"][f"long_{chunk}"] = step
                save()
            finally:
                srv.stop()
    save()
    print(json.dumps(report, indent=1)[-6000:])


if __name__ == "__main__":
    main()
