"""The page summaries inside SGLang's KV budget (sglang_compact/srt/memory.py).

(a) `summary_bytes_per_token` against hand computations (with and without the pages' key bounds), and the
    AFTER hook on SGLang's per-token pool size (`compat.POOL_CELL_SIZE`) adding it only where summaries are
    kept (and the bounds only where the selector reads them);
(b) (server) SGLang sizes the pool from the memory left after the weights: stock `torch_native` and `compact`
    (default selector, which keeps summaries) started with the same `--mem-fraction-static 0.1` and no
    `--max-total-tokens` get `max_total_num_tokens` = budget // bytes per token (page-aligned), compact's
    smaller by exactly the summaries' share; then the compact server is filled to its token limit with
    concurrent long prompts, which all complete, and it stays healthy.

On the CPU, SGLang's "free device memory" is the host's available memory (`psutil`), which the other
processes of a shared machine change between and during server starts (by more than the summaries' ~3% here),
so (b) pins that reading to `FREE_GB` with a test-only SGLang plugin (a hook on SGLang's
`get_available_gpu_memory`, from a throw-away `*.dist-info` on the servers' PYTHONPATH): the budget is then
`FREE_GB * mem_fraction_static` on both servers and the expected pool sizes are exact. On the CPU the
summaries live in host memory, so "no OOM" here means the pool accounting holds at the limit (all requests
complete, the pool returns to 0 used tokens); running out of GPU memory is checked on a GPU
(scripts/gpu/serving_check.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_compact.config import CompactConfig
from sglang_compact.srt.memory import add_summaries_to_cell_size, summary_bytes_per_token
from sglang_compact.summaries import PageSummaries

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SGLangServer  # noqa: E402

PAGE, CHUNK, NEW = 16, 128, 4
FREE_GB, FRACTION = 2.0, 0.1


# --- (a) the formula -----------------------------------------------------------------------------------------

def kv_cell(layers, kv_heads, head_dim, dtype_bytes):
    """SGLang's bytes per token of an MHA pool: K and V of every layer."""
    return kv_heads * (head_dim + head_dim) * layers * dtype_bytes


@pytest.mark.parametrize("layers, kv_heads, head_dim, dtype, page, want", [
    # per page and layer: a float32 key sum per kv head and dim, and an int32 count; per token: / page
    (30, 3, 64, torch.float32, 16, 1448),      # SmolLM2-135M: 30 * (3*64*4 + 4) / 16 = 1447.5 -> 1448
    (30, 3, 64, torch.bfloat16, 16, 1448),     # the summaries do not depend on the KV dtype
    (32, 8, 128, torch.bfloat16, 64, 2050),    # Llama-3-8B: 32 * (8*128*4 + 4) / 64 = 2050
    (32, 8, 128, torch.bfloat16, 16, 8200),    # 32 * 4100 / 16
    (80, 8, 128, torch.float16, 128, 2563),    # Llama-3-70B: 80 * 4100 / 128 = 2562.5 -> 2563
    (1, 1, 16, torch.float32, 16, 5),          # 1 * (1*16*4 + 4) / 16 = 4.25 -> 5
])
def test_summary_bytes_per_token_by_hand(layers, kv_heads, head_dim, dtype, page, want):
    cell = kv_cell(layers, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())
    got = summary_bytes_per_token(cell, layers, dtype, page)
    assert got == want
    # the same bytes as the summaries the backend allocates, per pool token
    assert got == math.ceil(PageSummaries.bytes_needed(layers, 1, kv_heads, head_dim) / page)


@pytest.mark.parametrize("layers, kv_heads, head_dim, dtype, page, want", [
    # per page and layer, beside the sum and count: a key max and min per kv head and dim in the KV dtype
    (30, 3, 64, torch.float32, 16, 4328),      # 30 * (3*64*4 + 4 + 2*3*64*4) / 16 = 4327.5 -> 4328
    (30, 3, 64, torch.bfloat16, 16, 2888),     # 30 * (772 + 2*3*64*2) / 16 = 2887.5 -> 2888
    (32, 8, 128, torch.bfloat16, 64, 4098),    # 32 * (4100 + 4096) / 64 = 4098
    (1, 1, 16, torch.float32, 16, 13),         # 1 * (16*4 + 4 + 2*16*4) / 16 = 12.25 -> 13
])
def test_summary_bytes_per_token_with_key_bounds_by_hand(layers, kv_heads, head_dim, dtype, page, want):
    itemsize = torch.empty((), dtype=dtype).element_size()
    cell = kv_cell(layers, kv_heads, head_dim, itemsize)
    got = summary_bytes_per_token(cell, layers, dtype, page, key_bounds=True)
    assert got == want
    assert got == math.ceil(PageSummaries.bytes_needed(layers, 1, kv_heads, head_dim, key_bounds=True,
                                                       bounds_itemsize=itemsize) / page)
    assert got > summary_bytes_per_token(cell, layers, dtype, page)


def test_the_summaries_share_is_one_page_at_bf16_and_half_that_at_fp32():
    for page in (16, 32, 64, 128, 256):
        bf16 = kv_cell(32, 8, 128, 2)
        share = summary_bytes_per_token(bf16, 32, torch.bfloat16, page) / bf16
        assert share == pytest.approx(1 / page, rel=2e-3)      # H*D*4 / P per layer vs 2*H*D*2: 1/P
        fp32 = kv_cell(32, 8, 128, 4)
        assert summary_bytes_per_token(fp32, 32, torch.float32, page) / fp32 == pytest.approx(share / 2, rel=1e-3)


def kvc(backend="compact", selector=None, page=16, dtype=torch.float32):
    config = None if selector is None else CompactConfig(block_size=page, selector=selector)
    args = SimpleNamespace(page_size=page, get_attention_backends=lambda: (backend, backend))
    if config is not None:
        args._compact_config = config
    return SimpleNamespace(server_args=args, kv_cache_dtype=dtype)


def test_the_cell_size_hook_adds_the_summaries_only_where_they_are_kept():
    cell = kv_cell(30, 3, 64, 4)
    # stock launcher: the default selector (quest_budget) keeps the key sums and the key bounds
    assert add_summaries_to_cell_size(cell, None, kvc(), 30) == cell + 4328
    assert add_summaries_to_cell_size(cell, None, kvc(selector="quest_budget"), 30) == cell + 4328
    assert add_summaries_to_cell_size(cell, None, kvc(selector="flashprefill"), 30) == cell + 1448
    assert add_summaries_to_cell_size(cell, None, kvc(selector="dense"), 30) is None   # keeps SGLang's size
    assert add_summaries_to_cell_size(cell, None, kvc(backend="torch_native"), 30) is None
    assert add_summaries_to_cell_size(cell, None, SimpleNamespace(), 30) is None       # unknown: left alone


def test_the_cell_size_hook_adds_the_key_bounds_only_for_a_selector_that_reads_them():
    cell = kv_cell(30, 3, 64, 4)

    def with_spec(**spec):
        k = kvc()
        k.server_args._compact_config = SimpleNamespace(selector="bounds", spec=SimpleNamespace(**spec))
        return k

    assert add_summaries_to_cell_size(cell, None, with_spec(uses_summaries=True, uses_key_bounds=True), 30) == \
        cell + 4328
    assert add_summaries_to_cell_size(cell, None, with_spec(uses_summaries=True, uses_key_bounds=False), 30) == \
        cell + 1448
    assert add_summaries_to_cell_size(cell, None, with_spec(uses_summaries=False, uses_key_bounds=True), 30) is None


# --- (b) the server ------------------------------------------------------------------------------------------

PLUGIN = '''
"""Test-only SGLang plugin: the CPU's free memory reads as $SGLANG_COMPACT_TEST_FREE_GB (tests/test_memory.py)."""
import os


def fixed_free_memory(original, device, *args, **kwargs):
    if str(device) == "cpu" and os.environ.get("SGLANG_COMPACT_TEST_FREE_GB"):
        return float(os.environ["SGLANG_COMPACT_TEST_FREE_GB"])
    return original(device, *args, **kwargs)


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register("sglang.srt.utils.common.get_available_gpu_memory", fixed_free_memory, HookType.AROUND)
'''


@pytest.fixture(scope="module")
def fixed_memory_env(tmp_path_factory):
    """Environment of a server whose CPU free-memory reading is FREE_GB (a plugin found through PYTHONPATH)."""
    d = tmp_path_factory.mktemp("memplugin")
    (d / "sglang_compact_memtest.py").write_text(textwrap.dedent(PLUGIN))
    info = d / "sglang_compact_memtest-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-compact-memtest\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nmemtest = sglang_compact_memtest:register\n")
    return {"PYTHONPATH": os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]),
            "SGLANG_COMPACT_TEST_FREE_GB": str(FREE_GB)}



def expected_tokens(cell: int) -> int:
    """SGLang 0.5.17's profile on the CPU: budget = free - free * (1 - fraction) (GB), // bytes per token, paged."""
    budget = int((FREE_GB - FREE_GB * (1 - FRACTION)) * (1 << 30))
    return budget // cell // PAGE * PAGE


def server(model_dir, env, args):
    return SGLangServer(model_dir, module="sglang_compact.launch_server", page_size=PAGE, chunked_prefill_size=CHUNK,
                        max_total_tokens=None, env=env, extra_args=["--mem-fraction-static", str(FRACTION)] + args)


def pool_tokens(srv) -> int:
    info = srv.get_json("/server_info")
    log = srv.log_path.read_text(errors="replace")
    assert f"avail mem={FREE_GB:.2f} GB" in log, "the test plugin did not pin the free-memory reading"
    assert f"max_total_num_tokens={info['max_total_num_tokens']}," in log
    return int(info["max_total_num_tokens"])


@pytest.mark.server
def test_the_pool_makes_room_for_the_summaries_and_fills_to_its_limit(model_dir, fixed_memory_env):
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cell = kv_cell(layers, kv_heads, head_dim, 4)  # float32 KV
    summaries = summary_bytes_per_token(cell, layers, torch.float32, PAGE, key_bounds=True)  # the default's

    with server(model_dir, fixed_memory_env, ["--attention-backend", "torch_native"]) as srv:
        stock = pool_tokens(srv)
    with server(model_dir, fixed_memory_env, ["--attention-backend", "compact", "--compact-min-context", "256",
                                              "--compact-dense-tail", "64"]) as srv:
        compact = pool_tokens(srv)
        assert "summaries on" in srv.log_path.read_text(errors="replace")
        print(f"\npool: torch_native {stock} tokens, compact {compact} tokens ({compact / stock:.4f}; "
              f"cells {cell} / {cell + summaries} bytes per token)")
        assert stock == expected_tokens(cell)
        assert compact == expected_tokens(cell + summaries)
        assert compact / stock == pytest.approx(cell / (cell + summaries), abs=2 * PAGE / stock)
        assert compact < stock

        # fill the pool: concurrent prompts of 0.7-1.1K tokens, about 1.6 times what it holds
        rng = random.Random(5)
        lengths = []
        while sum(lengths) < 1.6 * compact:
            lengths.append(rng.randint(700, 1100))
        prompts = [[rng.randrange(200, 40000) for _ in range(n)] for n in lengths]
        peak, done = [0.0], threading.Event()

        def watch():
            while not done.is_set():
                load = srv.get_json("/v1/loads?include=core")["loads"][0]
                peak[0] = max(peak[0], int(load["num_used_tokens"]) / compact)
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(lambda p: srv.generate(input_ids=p, max_new_tokens=NEW, ignore_eos=True),
                                     prompts))
        finally:
            done.set()
            watcher.join(timeout=10)
        assert [len(o.output_ids) for o in outs] == [NEW] * len(prompts)
        assert srv.get_text("/health") is not None and srv.proc.poll() is None
        load = srv.get_json("/v1/loads?include=core")["loads"][0]
        log = srv.log_path.read_text(errors="replace")
    print(f"filled with {len(prompts)} prompts ({sum(lengths)} tokens): peak {peak[0]:.0%} of the pool")
    assert peak[0] >= 0.85, f"the pool never filled: peak {peak[0]:.0%}"
    assert int(load["num_used_tokens"]) == 0 and int(load["num_running_reqs"]) == 0
    runtime = log[log.index("The server is fired up"):]
    assert "Traceback" not in runtime and "out of memory" not in runtime.lower()
