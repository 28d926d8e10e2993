"""GPU serving checks of the `compact` backend against stock `flashinfer` (run on the H200).

    source scripts/gpu/setup.sh; python3 scripts/gpu/serving_check.py --out $OUT

Starts SGLang servers one after another on a Llama-3.1-8B config with dummy
weights (`--load-format dummy --skip-tokenizer-init`, page 64), with SGLang's default
(breakable) prefill CUDA graphs unless --no-prefill-graphs:
  1. stock `--attention-backend flashinfer`: greedy ids of N prompts (4K-32K tokens);
  2. `compact` with selector `dense`, once per `--dense-kernels` entry (default fa2: dense passes on FlashInfer's
     fa2, stock `flashinfer`'s kernels; `auto` is the default configuration: sgl_kernel's FA3 on Hopper, the kernel
     stock `fa3` runs), the same prompts, compared token for token with each stock server of `--stock` (stock
     `flashinfer` by default; `fa3` needs sgl_kernel's FA3 library) (at a divergence, the top-2 logprob gap of
     both servers is recorded);
  3. `compact` with `flashprefill`: a 128K-token prompt with chunk 1024 (and a
     second server with chunk 8192), decode CUDA graphs on; 32 concurrent
     requests sharing prefixes; after a cache flush the pool's used-token count
     returns to zero;
  4. tight memory (`tight`): stock `flashinfer` and `compact` (defaults: page summaries on) started with
     the same high `--mem-fraction-static` (--tight-fraction) and no `--max-total-tokens`; compact's
     pool must be stock's shrunk by the summaries' share (`sglang_compact/srt/memory.py`), then it is
     filled past its token limit with concurrent long prompts, which must all complete without an
     out-of-memory error, the pool returning to 0 used tokens.
Writes `serving_check.json` and the server logs under --out. `--summary FILE` prints a report's steps one line each
(also after a run cut short: the report is saved after every step).

With `--model-path DIR` the servers load real weights from DIR (e.g. Qwen2.5-Coder-0.5B, converted by
scripts/convert_gguf.py) instead of the dummy 8B config; `--page-size`, `--chunk` and `--lengths` set the
dense step's shapes. The check that found compact's dense path wrong on Qwen at 32K (2026-12-02) is
    python3 scripts/gpu/serving_check.py --model-path /tmp/qwen --page-size 32 --chunk 1024 \
        --lengths 4096,16384,32000,32000,32000 --dense-kernels fa2,auto --stock flashinfer,fa3 \
        --skip long,concurrent,tight
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository root: `harness`
sys.path.insert(0, str(REPO / "scripts"))
from make_llama_config import write_model_dir  # noqa: E402

from harness.server import GenerateResult, SGLangServer  # noqa: E402


#: where the servers run: the GPU host; `--device cpu` runs the dense step on the CPU server (a smoke check)
DEVICE = {"device": "cuda", "dtype": None}


def start_server(module: str, model, args: list[str], log_path: Path, timeout: float = 600,
                 env: dict | None = None) -> SGLangServer:
    """A started server of `module` on `model` with exactly `args` (SGLang's defaults otherwise; `env`: extra
    environment variables), its output in `log_path`; stopped with SIGTERM, then its process group killed
    after 30 s."""
    cpu = DEVICE["device"] == "cpu"
    return SGLangServer(model, module=module, device=DEVICE["device"], dtype=DEVICE["dtype"],
                        max_total_tokens=8192 if cpu else None, max_running_requests=8 if cpu else None,
                        extra_args=args, log_path=log_path, start_timeout=timeout, request_timeout=1200,
                        stop_grace=30.0, env=env).start()


def generate(srv: SGLangServer, ids: list[int], n: int, logprobs: bool = False) -> GenerateResult:
    """`n` greedy tokens after `ids` (EOS ignored); with `logprobs` the top-2 logprobs of every output token."""
    extra = dict(return_logprob=True, top_logprobs_num=2, logprob_start_len=len(ids) - 1) if logprobs else None
    return srv.generate(input_ids=ids, max_new_tokens=n, ignore_eos=True, request=extra)


def used_tokens(srv: SGLangServer):
    loads = srv.get_json("/v1/loads?include=core")
    rows = loads.get("loads", loads) if isinstance(loads, dict) else loads
    return [int(r.get("num_used_tokens", r.get("core", {}).get("num_used_tokens", -1))) for r in rows], loads


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


def summary(report: dict) -> list[str]:
    """One line per step: a dense step's equal count and, per unequal prompt, its length with the error or the first
    divergence and both servers' top-2 logprob gaps there; any other step's own figures."""
    lines = []
    for name, step in report["steps"].items():
        if name.startswith("dense_vs_"):
            diverged = [(x["len"], x.get("error") or (x["first_divergence"], x["gap_flashinfer"], x["gap_compact"]))
                        for x in step.get("rows", []) if not x["equal"]]
            lines.append(f"{name} {step.get('equal', 0)}/{step.get('n', '?')} equal; {step.get('error', '')} {diverged}")
        else:
            concurrent = step.get("concurrent", {})
            lines.append(f"{name} { {k: v for k, v in step.items() if k != 'concurrent'} } {concurrent.get('ok')} "
                         f"{concurrent.get('used_tokens_after_flush')}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--summary", metavar="FILE", default=None,
                    help="print the steps of the report FILE (a serving_check.json) one line each, and exit")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma list of steps to skip: dense,long,concurrent,tight")
    ap.add_argument("--long-chunks", default="1024,8192", help="chunk sizes of the 128K step")
    ap.add_argument("--tight-fraction", type=float, default=0.93,
                    help="--mem-fraction-static of the tight-memory step's servers")
    ap.add_argument("--tight-prompt", type=int, default=32768, help="prompt length of the tight-memory step")
    ap.add_argument("--no-prefill-graphs", action="store_true",
                    help="--disable-prefill-cuda-graph for every server (default: SGLang's breakable prefill graphs)")
    ap.add_argument("--model-path", default=None,
                    help="real weights (an HF folder) instead of the dummy Llama-3.1-8B config")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size of the dense step")
    ap.add_argument("--lengths", default=None, help="comma list of the dense step's prompt lengths "
                    "(default: 10 from 4K to 32K, the first --prompts of them)")
    ap.add_argument("--dense-kernels", default="fa2",
                    help="comma list of compact configurations the dense step compares with stock: fa2 / fa3 "
                         "(--compact-prefill-kernel, dense passes on FlashInfer), sgl-fa3 (--compact-dense-kernel "
                         "sgl-fa3), auto (the defaults)")
    ap.add_argument("--stock", default="flashinfer",
                    help="comma list of stock --attention-backend values the dense step compares with (flashinfer, "
                         "fa3; the CPU server runs torch_native)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the CPU server in float32 (a smoke check of the dense step on a small model)")
    a = ap.parse_args()
    if a.summary:
        print("\n".join(summary(json.loads(Path(a.summary).read_text()))))
        return
    if a.device == "cpu":
        DEVICE.update(device="cpu", dtype="float32")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    if a.model_path:
        model = a.model_path
        common = ["--page-size", str(a.page_size), "--tp", str(a.tp)]
        if a.device == "cuda":
            common += ["--mem-fraction-static", "0.8", "--max-running-requests", "48"]
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        id_range = (1000, min(120000, vocab - 1000))
    else:
        model = write_model_dir("/tmp/llama-3.1-8b-dummy", "llama-3.1-8b", a.layers)
        common = ["--load-format", "dummy", "--skip-tokenizer-init", "--page-size", str(a.page_size),
                  "--mem-fraction-static", "0.8", "--tp", str(a.tp), "--max-running-requests", "48"]
        id_range = (1000, 120000)
    if a.no_prefill_graphs:
        common.append("--disable-prefill-cuda-graph")
    rng = random.Random(0)
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else \
        [4096, 6000, 8192, 10000, 12288, 16384, 20000, 24576, 28000, 32000][:a.prompts]
    prompts = [[rng.randrange(*id_range) for _ in range(L)] for L in lengths]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tp": a.tp, "layers": a.layers,
              "new_tokens": a.new_tokens, "steps": {}}

    def save():
        (out / "serving_check.json").write_text(json.dumps(report, indent=1))

    if "dense" not in skip:
        chunk = ["--chunked-prefill-size", str(a.chunk)]
        if a.model_path and max(lengths) > 32000:
            chunk += ["--context-length", str(max(lengths) + a.new_tokens + 64)]
        stocks = a.stock.split(",") if a.device == "cuda" else ["torch_native"]   # SGLang's CPU server: torch_native
        wants = {}
        for stock in stocks:
            srv = start_server("sglang.launch_server", model, common + chunk + ["--attention-backend", stock],
                               out / ("fi.log" if stock == "flashinfer" else f"stock_{stock}.log"))
            try:
                wants[stock] = [generate(srv, p, a.new_tokens, logprobs=True) for p in prompts]
            finally:
                srv.stop()
        for kernel in a.dense_kernels.split(","):
            # on stock's kernels (fa2 against flashinfer, sgl-fa3 against fa3) equal numbers, not just equal
            # tokens, are expected
            got = dense_answers(model, common + chunk + ["--attention-backend", "compact", "--compact-selector",
                                                         "dense"] + DENSE_KERNEL_FLAGS.get(kernel, []),
                                out / f"compact_dense_{kernel}.log", prompts, a.new_tokens)
            for stock, want in wants.items():
                name = "flashinfer" if stock == "torch_native" else stock   # the CPU smoke check's old step name
                report["steps"][f"dense_vs_{name}_{kernel}"] = compare(got, lengths, want, len(prompts))
            save()

    if "long" not in skip:
        for chunk in [int(c) for c in a.long_chunks.split(",")]:
            srv = start_server("sglang_compact.launch_server", model, common + [
                "--chunked-prefill-size", str(chunk), "--attention-backend", "compact",
                "--compact-selector", "flashprefill", "--context-length", "131072"], out / f"compact_long_{chunk}.log")
            try:
                ids = [rng.randrange(1000, 120000) for _ in range(128 * 1024 - 64)]
                r = generate(srv, ids, a.new_tokens)
                step = {"prompt_tokens": len(ids), "ok": len(r.output_ids) == a.new_tokens,
                        "wall_s": round(r.seconds, 2), "server_start_s": round(srv.startup_seconds, 1),
                        "cuda_graph_decode": "Capture cuda graph" in tail(out / f"compact_long_{chunk}.log", 10**7)
                        or "cuda graph" in tail(out / f"compact_long_{chunk}.log", 10**7).lower()}
                report["steps"][f"long_{chunk}"] = step
                save()
                if chunk == 1024 and "concurrent" not in skip:
                    srv.post("/flush_cache", {})
                    time.sleep(2)
                    used0, _ = used_tokens(srv)
                    doc = [rng.randrange(1000, 120000) for _ in range(8192)]
                    reqs = [doc[: 4096 + 64 * (i % 8)] + [rng.randrange(1000, 120000) for _ in range(200 + i)]
                            for i in range(32)]
                    with cf.ThreadPoolExecutor(32) as ex:
                        outs = list(ex.map(lambda p: generate(srv, p, a.new_tokens), reqs))
                    srv.post("/flush_cache", {})
                    time.sleep(2)
                    used1, loads = used_tokens(srv)
                    step["concurrent"] = {"n": len(outs), "ok": all(len(o.output_ids) == a.new_tokens for o in outs),
                                          "cached_tokens": [o.meta_info.get("cached_tokens") for o in outs],
                                          "used_tokens_before": used0, "used_tokens_after_flush": used1,
                                          "loads_after": loads}
                report["steps"][f"long_{chunk}"] = step
                save()
            finally:
                srv.stop()
    if "tight" not in skip:
        report["steps"]["tight_memory"] = tight_memory(a, model, out, rng, save, report)
    save()
    print(json.dumps(report, indent=1)[-6000:])


#: the compact flags of each `--dense-kernels` entry (dense passes on FlashInfer unless the entry names sgl-fa3)
DENSE_KERNEL_FLAGS = {
    "fa2": ["--compact-prefill-kernel", "fa2", "--compact-dense-kernel", "flashinfer"],
    "fa3": ["--compact-prefill-kernel", "fa3", "--compact-dense-kernel", "flashinfer"],
    "sgl-fa3": ["--compact-dense-kernel", "sgl-fa3"],
    "auto": [],
}


def dense_answers(model, args: list[str], log: Path, prompts, new_tokens: int) -> dict:
    """One compact server (`args`) on the dense step's prompts: {"results": its answers, in order, up to the first
    that failed}, with "error" (and its log's last lines) when it did not start or a request failed: recorded,
    not raised, so the other kernels still run."""
    try:
        srv = start_server("sglang_compact.launch_server", model, args, log)
    except Exception as e:  # noqa: BLE001
        return {"results": [], "error": f"start: {type(e).__name__}: {e}", "log_tail": tail(log, 3000)}
    got = {"results": []}
    try:
        for p in prompts:
            try:
                got["results"].append(generate(srv, p, new_tokens, logprobs=True))
            except Exception as e:  # noqa: BLE001
                got.update(error=f"{type(e).__name__}: {e}", log_tail=tail(log, 3000))
                break
    finally:
        srv.stop()
    return got


def compare(got: dict, lengths, want, n: int) -> dict:
    """A compact server's answers (`dense_answers`) against one stock server's (`want`): per prompt whether the
    tokens are equal, where they first differ and both servers' top-2 gap there."""
    if "error" in got and not got["results"] and got["error"].startswith("start:"):
        return {"error": got["error"], "log_tail": got["log_tail"]}
    rows = []
    for L, w, g in zip(lengths, want, got["results"]):
        wi, gi = w.output_ids, g.output_ids
        k = next((i for i, (x, y) in enumerate(zip(wi, gi)) if x != y), None)
        rows.append({"len": L, "equal": wi == gi, "first_divergence": k,
                     "gap_flashinfer": None if k is None else top2_gap(w.meta_info, k),
                     "gap_compact": None if k is None else top2_gap(g.meta_info, k),
                     "fi_s": round(w.seconds, 3), "compact_s": round(g.seconds, 3)})
    if "error" in got:
        rows.append({"len": lengths[len(rows)], "equal": False, "error": got["error"]})
    step = {"rows": rows, "equal": sum(r["equal"] for r in rows), "n": n}
    if "error" in got:
        step["log_tail"] = got["log_tail"]
    return step


def tight_memory(a, model, out: Path, rng, save, report) -> dict:
    from sglang_compact.srt.memory import summary_bytes_per_token
    import torch

    cfg = json.loads((Path(model) / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"] // a.tp
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cell = kv_heads * 2 * head_dim * layers * 2          # bf16 K and V of every layer, per token
    share = summary_bytes_per_token(cell, layers, torch.bfloat16, 64)
    common = ["--load-format", "dummy", "--skip-tokenizer-init", "--page-size", "64", "--tp", str(a.tp),
              "--mem-fraction-static", str(a.tight_fraction), "--chunked-prefill-size", "8192",
              "--context-length", str(a.tight_prompt + 256)]
    step = {"fraction": a.tight_fraction, "cell_bytes": cell, "summary_bytes": share}
    report["steps"]["tight_memory"] = step
    srv = start_server("sglang.launch_server", model, common + ["--attention-backend", "flashinfer"],
                       out / "tight_fi.log")
    try:
        step["stock_tokens"] = int(srv.get_json("/server_info")["max_total_num_tokens"])
    finally:
        srv.stop()
    save()
    srv = start_server("sglang_compact.launch_server", model, common + ["--attention-backend", "compact"],
                       out / "tight_compact.log")
    try:
        pool = int(srv.get_json("/server_info")["max_total_num_tokens"])
        step["compact_tokens"] = pool
        step["ratio"] = round(pool / step["stock_tokens"], 5)
        step["expected_ratio"] = round(cell / (cell + share), 5)
        n = int(1.3 * pool / a.tight_prompt) + 1
        prompts = [[rng.randrange(1000, 120000) for _ in range(a.tight_prompt)] for _ in range(n)]
        peak, done = [0], [False]

        def watch():
            while not done[0]:
                used, _ = used_tokens(srv)
                peak[0] = max(peak[0], max(used))
                time.sleep(0.5)

        t0 = time.time()
        with cf.ThreadPoolExecutor(n + 1) as ex:
            watcher = ex.submit(watch)
            try:
                outs = list(ex.map(lambda p: generate(srv, p, a.new_tokens), prompts))
            finally:
                done[0] = True
                watcher.result(timeout=30)
        time.sleep(2)
        used, _ = used_tokens(srv)
        log = tail(out / "tight_compact.log", 10**8)
        runtime = log[log.find("The server is fired up"):]
        step.update(prompts=n, prompt_tokens=a.tight_prompt, wall_s=round(time.time() - t0, 1),
                    ok=all(len(o.output_ids) == a.new_tokens for o in outs), peak_used=peak[0],
                    peak_fraction=round(peak[0] / pool, 3), used_after=used,
                    oom="out of memory" in runtime.lower(), traceback="Traceback" in runtime,
                    alive=srv.proc.poll() is None)
    finally:
        srv.stop()
    save()
    return step


if __name__ == "__main__":
    main()
