"""The `compact` backend inside SGLang 0.5.17's real CPU server (torch executor).

Real scheduler, radix cache, chunked prefill and a paged head-major pool
(page 16, chunks of 128 tokens, so a 1-2K-token prompt spans 8-16 chunks),
on SmolLM2-135M-Instruct's real weights in float32:

1. selector `dense` (the stock path), `budget`, `mass_budget` and `quest_budget` at density 1.0 (every q-block
   through the sparse machinery: search, union, paged indices, rows) give greedy
   tokens equal to SGLang's `torch_native` backend on 6 prompts (up to near ties);
2. selector `flashprefill` serves a long prompt; the same prompt after a cache hit
   of an unrelated length (cut back to a union-window boundary by the plugin's scheduler
   hook) is answered with the same tokens;
3. a selector defined in a test module (`toy_selector.py`) is served end to end
   with `--compact-selector-module`, no other file edited;
4. bad `--compact-*` flags make `launch_server` exit 2 with a one-line reason.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SERVER_ENV, SGLangServer, assert_same_tokens, greedy_with_top2, metric_value  # noqa: E402

PAGE, CHUNK, NEW = 16, 128, 12
COMPACT = ["--attention-backend", "compact"]



def prompts(n=6, seed=0):
    rng = random.Random(seed)
    lengths = [700, 1100, 1500, 900, 1300, 1900][:n]
    return [[rng.randrange(200, 40000) for _ in range(L)] for L in lengths]


#: a density between what the windows just past the gate read (their forced pages alone are ~1/3 of their
#: context) and what the later ones read, for the prompt of the cache test
DENSE_ABOVE_MIXED = "0.6"


def greedy(server, ids):
    return greedy_with_top2(server, ids, NEW)


def server(model_dir, backend_args, **kw):
    return SGLangServer(model_dir, module="sglang_compact.launch_server", page_size=PAGE, chunked_prefill_size=CHUNK,
                        extra_args=backend_args, **kw)


@pytest.fixture(scope="module")
def torch_native_tokens(model_dir):
    """SGLang's `torch_native` backend's greedy tokens (and top-2 margins) on `prompts()`: one server for every
    selector compared with it."""
    with server(model_dir, ["--attention-backend", "torch_native"]) as ref_srv:
        return [greedy(ref_srv, p) for p in prompts()]


@pytest.mark.parametrize("selector_args", [
    ["--compact-selector", "dense"],
    ["--compact-selector", "budget", "--compact-density", "1.0", "--compact-min-context", "0"],
    ["--compact-selector", "mass_budget", "--compact-selector-params", '{"density": 1.0}',
     "--compact-min-context", "0"],
    ["--compact-selector", "quest_budget", "--compact-selector-params", '{"density": 1.0}',
     "--compact-min-context", "0"],
], ids=["dense", "budget-1.0", "mass_budget-1.0", "quest_budget-1.0"])
def test_dense_reads_match_torch_native(model_dir, torch_native_tokens, selector_args):
    want = torch_native_tokens
    with server(model_dir, COMPACT + selector_args + ["--enable-metrics"]) as srv:
        got = [greedy(srv, p) for p in prompts()]
        # streamed (the decode timings of scripts/bench_ttft.py): the same tokens, each with its arrival time
        streamed = srv.generate_stream(prompts()[0], NEW)
        log = srv.log_path.read_text()
        metrics = srv.get_text("/metrics")
    assert streamed.output_ids == got[0][0] and streamed.meta_info["completion_tokens"] == NEW
    assert len(streamed.token_times) == NEW and streamed.token_times == sorted(streamed.token_times)
    assert f"selector={selector_args[1]!r}" in log  # the launcher's config reached the scheduler
    sparse = metric_value(metrics, "sglang:compact_qblocks_total", 'path="sparse"')
    assert (sparse > 0) == (selector_args[1] != "dense")
    assert_same_tokens(want, got, selector_args[1])


@pytest.mark.parametrize("params, extra", [
    ('{}', []),
    ('{"fix_rows": true}', []),
    ('{}', ["--compact-dense-above", DENSE_ABOVE_MIXED]),
], ids=["per-layer rows", "rows fixed at the observing layer", "some windows dense by their density"])
def test_flashprefill_answer_does_not_depend_on_the_cache(model_dir, params, extra):
    ids = prompts(n=6, seed=1)[-1][:1200 + 5]
    args = COMPACT + ["--compact-selector", "flashprefill", "--compact-min-context", "256",
                      "--compact-sink-blocks", "1", "--compact-recent-blocks", "2", "--compact-dense-tail", "64",
                      "--compact-selector-params", params, "--enable-metrics"] + extra
    with server(model_dir, args) as srv:
        first = greedy(srv, ids)
        again = greedy(srv, ids)                      # served from the radix cache: 1200 tokens cached
        srv.flush_cache()
        srv.generate(input_ids=ids[:37 * PAGE + 3], max_new_tokens=1)   # cache a prefix of an unrelated length
        after_hit = greedy(srv, ids)
        log = srv.log_path.read_text()
        metrics = srv.get_text("/metrics")
    assert len(first[0]) == NEW
    # windows of 128 tokens (the chunk size), sparse from 256 tokens of context up to the dense tail (the last 64 of
    # 1205 tokens: windows from (1205 - 64) // 128 = 8 on). A hit serves only KV computed as a cold prefill computes
    # it (sglang_compact/srt/alignment.py): the repeat all of its prompt but the last token, page-aligned (it reads
    # every page from 1024 on, as the cached copy was computed); of the 595-token prompt, whose dense tail starts at
    # (595 - 64) // 128 * 128 = 512, the first 512 tokens (this prompt computes the next window sparse)
    assert int(again[1]["cached_tokens"]) == 1200 and int(after_hit[1]["cached_tokens"]) == 512
    assert_same_tokens([first, first], [again, after_hit], "cold vs cached")
    assert "selector='flashprefill'" in log and "dense_tail 64" in log
    assert f"fix_rows={'fix_rows' in params}" in log
    assert metric_value(metrics, "sglang:compact_qblocks_total", 'path="sparse"') > 0
    assert metric_value(metrics, "sglang:compact_qblocks_total", 'path="dense_tail"') > 0
    if "fix_rows" in params:   # the pass's first layer reads every page and its density says so
        assert metric_value(metrics, "sglang:compact_density", 'layer="0"') == 1.0
        assert metric_value(metrics, "sglang:compact_density", 'layer="1"') < 1.0
    if extra:   # windows near the gate (forced pages a large share of their context) turn dense, later ones not
        assert metric_value(metrics, "sglang:compact_qblocks_total", 'path="dense_density"') > 0


@pytest.mark.parametrize("layers", [
    ["--compact-density", "0.3", "--compact-dense-layers", "2-29"],
    ["--compact-selector-params", '{"density": 0.3, "layer_density": "2-29:1.0"}'],
])
def test_dense_layers_read_every_page_in_a_sparse_pass(model_dir, layers):
    """--compact-dense-layers 2-29 (or `budget`'s own `layer_density` of 1.0 there): in a sparse pass those layers'
    rows read every page (density 1.0 on /metrics), the first two select their budget (no observed-density
    fallback here, so layer 0 selects too)."""
    ids = prompts(n=3, seed=4)[-1]
    args = COMPACT + ["--compact-selector", "budget", "--compact-min-context", "256", "--compact-dense-tail", "64",
                      "--compact-dense-above", "1", "--enable-metrics"] + layers
    with server(model_dir, args) as srv:
        out, _ = greedy(srv, ids)
        log = srv.log_path.read_text()
        metrics = srv.get_text("/metrics")
    assert len(out) == NEW
    if "--compact-dense-layers" in layers:
        assert "dense layers " + ",".join(map(str, range(2, 30))) in log
    assert metric_value(metrics, "sglang:compact_qblocks_total", 'path="sparse"') > 0
    density = {i: metric_value(metrics, "sglang:compact_density", f'layer="{i}"') for i in range(30)}
    assert all(density[i] == 1.0 for i in range(2, 30)), density
    assert density[0] < 0.8 and density[1] < 0.8, density
    mean = metric_value(metrics, "sglang:compact_density_forward_sum") / \
        metric_value(metrics, "sglang:compact_density_forward_count")
    assert 28 / 30 < mean < 1.0


def test_a_selector_from_a_test_module_is_served(model_dir):
    ids = prompts(n=1, seed=2)[0]
    args = COMPACT + ["--compact-selector-module", "toy_selector", "--compact-selector", "toy_every_other",
                      "--compact-selector-params", '{"offset": 1}', "--compact-min-context", "256",
                      "--compact-dense-tail", "64", "--enable-metrics"]
    tests_dir = str(Path(__file__).resolve().parent)
    env = {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    with server(model_dir, args, env=env) as srv:
        out, _ = greedy(srv, ids)
        log = srv.log_path.read_text()
        metrics = srv.get_text("/metrics")
    assert len(out) == NEW
    assert "selector='toy_every_other'(offset=1)" in log
    assert metric_value(metrics, "sglang:compact_qblocks_total", 'path="sparse"') > 0
    # every other candidate page, plus sink, recent and own pages: a density around half
    assert 0.4 < metric_value(metrics, "sglang:compact_density_forward_sum") / \
        metric_value(metrics, "sglang:compact_density_forward_count") < 0.9


BAD_FLAGS = [
    (["--compact-selector", "nope"], "--compact-selector 'nope': use one of"),
    (["--compact-block-size", "32"], "--compact-block-size 32 differs from --page-size 16: drop --compact-block-size"),
    (["--compact-min-context", "-1"], "must be 'auto' or a number of tokens >= 0"),
    (["--compact-min-prefix-len", "x"], "must be 'auto' or a number of tokens"),
    (["--compact-dense-above", "2"], "must be 'auto' or a density in [0, 1]"),
    (["--compact-selector", "flashprefill", "--compact-alpha", "-0.5"],
     "--compact-selector-params['alpha']: must be a number in [0.0, 1.0]"),
    (["--compact-alpha", "0.2"], "--compact-alpha sets the flashprefill selector's alpha: add --compact-selector flashprefill"),
    (["--compact-density", "1.5"], "--compact-selector-params['density']: must be a number in [0.0, 1.0]"),
    (["--compact-selector", "xattention", "--compact-density", "0.2"],
     "--compact-density sets the quest_budget / budget / mass_budget selector's density: add --compact-selector quest_budget"),
    (["--compact-sink-blocks", "-2"], "--compact-sink-blocks: must be an integer >= 0"),
    (["--compact-recall-every", "-3"], "--compact-recall-every: must be an integer >= 0"),
    (["--compact-prefill-kernel", "fa4"], "invalid choice: 'fa4'"),
    (["--compact-dense-layers", "20-x"], "must be layer ids or ranges such as '21,22,23' or '20-23'"),
    (["--compact-dense-layers", "0,20"], "--compact-dense-layers: must be layers after 1"),
    (["--compact-selector-module", "no_such_module_xyz"], "selector module 'no_such_module_xyz' could not be imported"),
    (["--compact-selector", "budget", "--compact-selector-params", '{"layer_density": "2-6"}'],
     "layer_density: must be items 'layers:value'"),
    (["--attention-backend", "torch_native", "--compact-alpha", "0.1"], "--compact-* flags need --attention-backend compact"),
    # SGLang's own refusal of a combination: its reason, on one line
    (["--enable-deterministic-inference"], "attention backends are supported for deterministic inference, but you "
                                           "explicitly specified 'compact'"),
    # SGLang features that put KV into the pool outside the backend (pages without their summaries)
    (["--enable-hierarchical-cache"], "--enable-hierarchical-cache / --hicache-storage-backend: not supported with "
                                      "attention backend 'compact': SGLang's hierarchical cache writes pages back"),
    (["--hicache-storage-backend", "file"], "--hicache-storage-backend: not supported with attention backend"),
    (["--enable-lmcache"], "--enable-lmcache: not supported with attention backend 'compact'"),
    (["--enable-flexkv"], "--enable-flexkv: not supported with attention backend 'compact': FlexKV loads pages"),
    # a radix tree the exact prefix cache's hooks do not wrap
    (["--radix-cache-backend", "flexkv"], "--radix-cache-backend flexkv: not supported with attention backend "
                                          "'compact': the compact backend keeps its prefix cache exact"),
    (["--enable-streaming-session"], "--enable-streaming-session: not supported with attention backend 'compact': "
                                     "a streaming session serves all of its KV"),
    (["--disaggregation-mode", "prefill"], "--disaggregation-mode prefill: not supported with attention backend "
                                           "'compact': SGLang 0.5.17 transfers KV"),
    (["--enable-hisparse"], "--enable-hisparse: not supported with attention backend 'compact'"),
    (["--tp-size", "2", "--attn-cp-size", "2"], "--attn-cp-size 2: not supported with attention backend 'compact'"),
]

#: runs `launch_server.main` on each argv of a JSON list in one process (SGLang imported once, not once per
#: case) and prints each one's exit code and stderr; a case that validates would start a server: it exits
#: with a message instead
MAIN_ON_EACH = """
import contextlib, io, json, sys
from sglang_compact import launch_server
from sglang_compact.srt import compat

def no_server(server_args):
    raise SystemExit("validated: would start a server")

compat.run_server = no_server
results = []
for argv in json.loads(sys.argv[1]):
    err, code = io.StringIO(), None
    with contextlib.redirect_stderr(err):
        try:
            launch_server.main(argv)
        except SystemExit as e:
            code = e.code
    results.append(dict(code=code, stderr=err.getvalue()))
print("RESULTS " + json.dumps(results))
"""


def bad_flags_argv(model_dir, flags):
    return ["--model-path", str(model_dir), "--device", "cpu", "--page-size", str(PAGE)] + COMPACT + flags


def assert_one_line_reason(code, stderr, reason):
    assert code == 2, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("sglang_compact.launch_server: error: ") and reason in last, last


def run_main_on_each(argvs, env=None):
    r = subprocess.run([sys.executable, "-c", MAIN_ON_EACH, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, **(env or {})}, cwd=REPO_ROOT)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, (r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(line[len("RESULTS "):])


@pytest.fixture(scope="module")
def bad_flags_results(model_dir):
    return run_main_on_each([bad_flags_argv(model_dir, flags) for flags, _ in BAD_FLAGS])


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_exit_with_one_line_reason(bad_flags_results, case):
    """`launch_server.main` (one process for every case: `MAIN_ON_EACH`)."""
    res = bad_flags_results[case]
    assert_one_line_reason(res["code"], res["stderr"], BAD_FLAGS[case][1])


def test_a_radix_tree_switched_on_by_environment_is_refused_unless_nothing_is_cached(model_dir):
    """SGLang's environment switch for its unified radix tree replaces the RadixCache the exact prefix cache's
    hooks wrap: refused, with the switch named; with `--disable-radix-cache` nothing is cached, so it serves."""
    on, off = run_main_on_each([bad_flags_argv(model_dir, []), bad_flags_argv(model_dir, ["--disable-radix-cache"])],
                               env={"SGLANG_ENABLE_UNIFIED_RADIX_TREE": "1"})
    assert_one_line_reason(on["code"], on["stderr"], "SGLANG_ENABLE_UNIFIED_RADIX_TREE=1: not supported with "
                                                     "attention backend 'compact'")
    assert off["code"] == "validated: would start a server", off["stderr"][-3000:]


@pytest.mark.parametrize("flags, reason", [next(c for c in BAD_FLAGS if c[1].startswith(start))
                                           for start in ("--compact-selector 'nope'", "invalid choice")],
                         ids=["our check", "argparse's"])
def test_bad_flags_exit_2_from_the_command_line(model_dir, flags, reason):
    """`python -m sglang_compact.launch_server` itself exits 2 with the reason, from our checks and from
    argparse's."""
    cmd = [sys.executable, "-m", "sglang_compact.launch_server"] + bad_flags_argv(model_dir, flags)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=REPO_ROOT)
    assert_one_line_reason(r.returncode, r.stderr, reason)


def test_help_lists_the_compact_flags_and_sglangs():
    """--help works from a plain environment (the launcher arranges the CPU shim itself)."""
    env = {k: v for k, v in os.environ.items() if k not in SERVER_ENV}
    r = subprocess.run([sys.executable, "-m", "sglang_compact.launch_server", "--help"], capture_output=True,
                       text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for flag in ("--compact-selector", "--compact-density", "--compact-prefill-kernel", "--compact-min-context",
                 "--compact-dense-tail", "--compact-dense-above", "--compact-selector-module"):
        assert flag in r.stdout
    assert "--chunked-prefill-size" in r.stdout and r.stdout.index("--compact-selector") < r.stdout.index(
        "--chunked-prefill-size")
