"""scripts/bench_ttft.py without a GPU: its method names, its dry run (the plan and the KV arithmetic) and one run
over several calls (--resume)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_ttft import (COMPACT, STOCK, decode_ms_per_token, metered, method_args, method_env,  # noqa: E402
                        pooled_fields, round_ratios, split_methods)


def test_method_names():
    assert method_args("flashinfer") == (STOCK, ["--attention-backend", "flashinfer"])
    assert method_args("fa3") == (STOCK, ["--attention-backend", "fa3"])
    module, flags = method_args("compact-budget-0.3-fa2-at0")
    assert module == COMPACT and flags[-2:] == ["--compact-density", "0.3"]
    assert "--compact-prefill-kernel" in flags and "--compact-min-context" in flags and "--enable-metrics" in flags
    assert method_args("compact-dense")[1][-2:] == ["--compact-selector", "dense"]
    fidense = method_args("compact-dense-fidense")[1]   # dense passes on FlashInfer, not sgl_kernel's FA3
    assert fidense[-4:] == ["--compact-dense-kernel", "flashinfer", "--compact-selector", "dense"]
    sglrows = method_args("compact-quest_budget-0.3-sglrows")[1]   # the sparse rows on sgl_kernel's FA3
    assert sglrows[3:5] == ["--compact-prefill-kernel", "sgl-fa3"] and sglrows[-3] == "quest_budget"
    firows = method_args("compact-quest_budget-0.3-firows")[1]   # the sparse rows on FlashInfer's fa3
    assert firows[3:5] == ["--compact-prefill-kernel", "fa3"] and firows[-3] == "quest_budget"
    assert method_args("compact-quest_budget-0.33")[1][-4:] == ["--compact-selector", "quest_budget",
                                                                "--compact-selector-params", '{"density": 0.33}']
    with pytest.raises(ValueError):
        method_args("compact-quest_budget-x")
    with pytest.raises(ValueError):
        method_args("nope")
    assert method_args("flashinfer-again") == method_args("flashinfer")   # the A/A control: the same server again
    assert method_args("flashinfer-metrics") == (STOCK, ["--attention-backend", "flashinfer", "--enable-metrics"])
    assert method_args("fa3-metrics")[1][-1] == "--enable-metrics"
    bare = method_args("compact-dense-nometrics")[1]   # a compact server as a user runs it: no density read
    assert "--enable-metrics" not in bare and bare[-2:] == ["--compact-selector", "dense"]
    assert metered("compact") and not metered("compact-nometrics") and not metered("flashinfer-metrics")
    assert method_args("compact-cachedlaunch") == method_args("compact")
    # a candidate in the accuracy scripts' syntax, suffixes allowed: selector, its parameters, method-level flags
    module, flags = method_args("compact:quest_budget:density=0.2,min_tokens=3072,query_stride=2,dense_tail=512"
                                "-nometrics")
    assert module == COMPACT and "--enable-metrics" not in flags
    assert flags[flags.index("--compact-selector") + 1] == "quest_budget"
    assert json.loads(flags[flags.index("--compact-selector-params") + 1]) == dict(density=0.2, min_tokens=3072,
                                                                                  query_stride=2)
    assert flags[flags.index("--compact-dense-tail") + 1] == "512"
    assert "--compact-dense-tail" not in method_args("compact:quest_budget:density=0.2")[1]
    flags = method_args("compact:flashprefill:dense_layers=21-23,dense_above=0.6")[1]
    assert flags[-4:] == ["--compact-dense-layers", "21,22,23", "--compact-dense-above", "0.6"]
    with pytest.raises(ValueError, match="bad method"):
        method_args("compact:quest_budget:density=2")
    with pytest.raises(ValueError, match="unknown selector 'nope'"):
        method_args("compact:nope")
    assert split_methods("flashinfer,compact:quest_budget:density=0.2,min_tokens=3072-nometrics,compact-dense,"
                         "compact:budget:density=0.3,") == [
        "flashinfer", "compact:quest_budget:density=0.2,min_tokens=3072-nometrics", "compact-dense",
        "compact:budget:density=0.3"]
    assert method_env("compact-dense-cachedlaunch") == {"SGLANG_COMPACT_CACHED_LAUNCH": "1"} and not method_env("compact")
    assert method_env("compact-cachedlaunch") == {"SGLANG_COMPACT_CACHED_LAUNCH": "1"}
    reuse = method_args("compact-dense-reuse")[1]     # the radix cache as stock's (the next-turn runs)
    assert reuse[reuse.index("--compact-prefix-cache") + 1] == "reuse" and reuse[-2:] == ["--compact-selector", "dense"]


def test_decode_time_per_token_starts_once_every_request_has_its_first_token():
    # request 0 decodes at 10 ms per token while request 1 still prefills; from t = 1.0 both decode at 20 ms
    r0 = [0.5, 0.51, 0.52, 1.0, 1.02, 1.04, 1.06]
    r1 = [1.0, 1.02, 1.04, 1.06]
    assert decode_ms_per_token([r0, r1]) == pytest.approx(20.0)
    assert decode_ms_per_token([r0]) == pytest.approx((1.06 - 0.5) / 6 * 1000)
    # tokens that arrived in one event share its time: the span still counts each of them
    assert decode_ms_per_token([[0.0, 0.1, 0.1, 0.3]]) == pytest.approx(100.0)
    # the median over the requests
    assert decode_ms_per_token([[0.0, 0.01, 0.02], [0.0, 0.02, 0.04], [0.0, 0.05, 0.10]]) == pytest.approx(20.0)
    assert decode_ms_per_token([[0.0]]) is None and decode_ms_per_token([]) is None
    assert decode_ms_per_token([[0.0, 0.1], []]) is None   # a request that streamed nothing
    fields = pooled_fields({"times": [0.1, 0.2, 0.3], "dens": [], "frac": [], "fell": [], "decode": [7.0, 9.0, 8.0]},
                           False, False)
    assert fields["decode_ms"] == 8.0 and fields["decode_ms_all"] == [7.0, 9.0, 8.0]
    assert "decode_ms" not in pooled_fields({"times": [0.1], "dens": [], "frac": [], "fell": [], "decode": []},
                                            False, False)


def test_round_ratios_pair_the_rounds_and_bound_their_median():
    """Round i against round i: the median ratio, and the order-statistic interval of the median whose
    coverage is at least 95% when there are rounds enough (n >= 6), else [min, max] with its coverage."""
    r = round_ratios([20.9, 21.7, 20.7, 20.8, 20.9], [22.2, 21.4, 19.4, 22.7, 20.3])
    assert r["rounds"] == 5 and r["coverage"] == pytest.approx(1 - 2 / 32)
    assert r["lo"] == pytest.approx(20.8 / 22.7) and r["hi"] == pytest.approx(20.7 / 19.4)
    assert r["median"] == pytest.approx(21.7 / 21.4)
    base = [100.0 + i for i in range(20)]
    r = round_ratios(base, [b / 1.25 for b in base])     # a constant speed-up: a point interval
    assert r["median"] == r["lo"] == pytest.approx(1.25) and r["hi"] == pytest.approx(1.25)
    assert r["coverage"] >= 0.95
    ratios = sorted(b / m for b, m in zip(base, [100.0 + (7 * i) % 20 for i in range(20)]))
    r = round_ratios(base, [100.0 + (7 * i) % 20 for i in range(20)])
    assert ratios[0] < r["lo"] <= r["median"] <= r["hi"] < ratios[-1]   # 20 rounds: an inner interval
    assert round_ratios([], []) is None and round_ratios([1.0, 2.0], [1.0])["rounds"] == 1


def test_a_row_pools_the_rounds_of_every_server_start():
    """--starts: one median over the rounds of all starts (a slow process and a fast one, as host-bound servers
    give, land between them), not the first start's; density fields by kind of server."""
    got = {"times": [0.106, 0.106, 0.105, 0.058, 0.060, 0.059, 0.061, 0.062, 0.057], "dens": [1.0] * 9,
           "frac": [0.0] * 9, "fell": [0.0] * 9}
    row = pooled_fields(got, metered_server=True, unread=False)
    assert row["ms"] == pytest.approx(61.0) and len(row["ms_all"]) == 9 and row["density"] == 1.0
    stock = pooled_fields({**got, "dens": [], "frac": [], "fell": []}, metered_server=False, unread=False)
    assert stock["density"] == 1.0 and stock["sparse_qblocks"] == 0.0
    bare = pooled_fields({**got, "dens": [], "frac": [], "fell": []}, metered_server=False, unread=True)
    assert bare["density"] is None and bare["dense_density_qblocks"] is None
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--model", "qwen2.5-0.5b",
                        "--contexts", "4096", "--chunks", "1024", "--starts", "3", "--warmup-rounds", "2",
                        "--methods", "flashinfer,compact", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "each server started 3 times" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--model", "qwen2.5-0.5b",
                        "--starts", "0", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--starts and --reps must be >= 1" in r.stderr


def test_dry_run_prints_the_plan_and_the_kv_per_rank():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--model", "llama-3.1-8b",
                        "--contexts", "130816", "--chunks", "1024", "--batches", "8", "--tp", "2",
                        "--methods", "flashinfer,compact-budget-0.3", "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    # 8 x (130816 + 1024) + 4096 tokens x 32 layers x 2 x 4 kv heads x 128 x 2 bytes
    assert "1058816 tokens" in first and "64.6 GiB of KV per rank at TP2" in first
    assert "--tp 2 --attention-backend compact" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--model", "llama-3.1-8b",
                        "--contexts", "131072", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "exceeds the model's 131072 positions" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--model", "llama-3.1-8b",
                        "--contexts", "1024,8192", "--next-turn", "800", "--dry-run"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "leave a first turn in the shortest context (1024 tokens)" in r.stderr


def test_replot_draws_the_rows_of_the_dated_runs(tmp_path):
    """--replot: the ttft rows dated with the prefix, into a folder it makes; runs of whole models only."""
    pytest.importorskip("matplotlib")

    def row(method, ctx, ms, date, cmd="python3 scripts/bench_ttft.py --model llama-3.1-8b"):
        return {"bench": "ttft", "model": "m", "context": ctx, "chunk": 1024, "batch": 1, "method": method,
                "ms": ms, "speedup_vs_flashinfer": 100.0 / ms, "gpu": "G", "date": date, "cmd": cmd}
    rows = [row("flashinfer", c, 100.0, "2026-12-01T20:58:48") for c in (4096, 8192)] + \
        [row("compact", c, 90.0, "2026-12-01T21:03:04") for c in (4096, 8192)] + \
        [row("compact", 4096, 50.0, "2026-11-30T10:00:00"),
         row("compact", 4096, 50.0, "2026-12-01T22:00:00", cmd="bench_ttft.py --layers 4")]
    src = tmp_path / "speed.json"
    src.write_text(json.dumps(rows))
    out = tmp_path / "new" / "dir"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--replot", str(src),
                        "--replot-date", "2026-12-01", "--out-dir", str(out), "--name", "fig"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "fig.png").stat().st_size > 0 and "4 rows of 1 model(s)" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ttft.py"), "--replot", str(src),
                        "--replot-date", "2027", "--out-dir", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no ttft rows" in r.stderr


def test_run_signature_leaves_out_only_the_flags_free_between_calls():
    from bench_ttft import run_signature
    argv = ["--model", "llama-3.1-8b", "--deadline-s", "470", "--resume", "--reps", "2", "--deadline-s=30"]
    assert run_signature(argv) == ["--model", "llama-3.1-8b", "--reps", "2"]


def test_resume_times_the_rest_of_one_run_in_a_later_call(tmp_path, monkeypatch):
    """A sweep longer than one GPU-host call: the first call times what its deadline allows, the same command
    with --resume times only the rest, and the rows, table and speed.json hold one run (the first call's date
    and rounds, each row once). The servers are stand-ins (stock `flashinfer` and `fa3` do not run on a CPU);
    what is tested is the run's bookkeeping across calls."""
    import types

    import bench_ttft
    started = []

    class Server:
        startup_seconds = 0.0

        def __init__(self, label):
            self.label = label

        def generate(self, input_ids=None, max_new_tokens=1, ignore_eos=True, request=None):
            time.sleep(0.05)
            return types.SimpleNamespace(output_ids=[7], cached_tokens=0)

        def stop(self):
            pass

    def start_server(module, model, flags, log_path, timeout=600, env=None):
        started.append(log_path.name)
        return Server(log_path.name)

    monkeypatch.setattr(bench_ttft, "start_server", start_server)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 3000, "max_position_embeddings": 8192}))
    out = tmp_path / "out"
    base = ["bench_ttft.py", "--model-path", str(model), "--contexts", "2048", "--chunks", "1024,8192",
            "--methods", "flashinfer,fa3", "--side-by-side", "1", "--reps", "2", "--out-dir", str(out),
            "--name", "sweep"]

    def call(*extra):
        monkeypatch.setattr(sys, "argv", base + list(extra))
        return bench_ttft.main()

    # each group: a warm-up and two rounds of 0.05 s; the deadline lets only the first group (chunk 1024) start
    assert call("--deadline-s", "0.1") == 0
    assert started == ["ttft_model_flashinfer_c1024.log"]
    first = json.loads((out / "speed.json").read_text())
    assert [r["method"] for r in first] == ["flashinfer"]
    state = json.loads((out / "sweep.state.json").read_text())
    assert state["done"] == [[1024, 0, 0]] and state["calls"] == 1

    with pytest.raises(SystemExit, match="the state of another command"):   # another sweep: not this run
        call("--resume", "--reps", "3")
    assert call("--resume", "--deadline-s", "60") == 0
    assert started[1:] == ["ttft_model_fa3_c1024.log", "ttft_model_flashinfer_c8192.log",
                           "ttft_model_fa3_c8192.log"]
    rows = json.loads((out / "speed.json").read_text())
    assert sorted((r["chunk"], r["method"]) for r in rows) == [(1024, "fa3"), (1024, "flashinfer"),
                                                              (8192, "fa3"), (8192, "flashinfer")]
    assert {r["date"] for r in rows} == {first[0]["date"]} and {r["calls"] for r in rows} == {2}
    assert {r["cmd"] for r in rows} == {first[0]["cmd"]} and "--deadline-s 0.1" in first[0]["cmd"]
    again = next(r for r in rows if (r["chunk"], r["method"]) == (1024, "flashinfer"))
    assert again["ms_all"] == first[0]["ms_all"]                 # the first call's rounds, not re-timed
    assert {r["group"] for r in rows} == {1, 2, 3, 4}           # group ids as one call would give them
    assert all(r["speedup_vs_flashinfer"] for r in rows)
    assert "one run in 2 calls" in (out / "sweep.md").read_text()

    assert call("--resume") == 0 and len(started) == 4           # nothing left to time: the outputs again
    assert len(json.loads((out / "speed.json").read_text())) == 4
    assert call() == 0 and len(started) == 8                     # without --resume: a new run
    assert len(json.loads((out / "speed.json").read_text())) == 8
