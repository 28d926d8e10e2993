"""`CompactConfig` and the selector registry: validation names the field and the allowed range;
the selector's parameters are its typed dataclass."""

import pytest

from sglang_compact.config import CompactConfig
from sglang_compact.selectors.registry import selector_names, selector_spec


def test_defaults_valid():
    c = CompactConfig()
    assert c.selector == "quest_budget" and c.params.density == pytest.approx(0.25) and c.params.min_tokens == 2560
    assert c.min_context is None and c.dense_tail == 256
    assert type(c.params).__name__ == "QuestBudgetParams"


@pytest.mark.parametrize("page, pages", [(16, 160), (32, 80), (64, 40), (256, 10)])
def test_the_default_floor_is_in_tokens(page, pages):
    """The default's floor means the same candidates at every page size; min_pages raises it, never lowers."""
    c = CompactConfig(block_size=page)
    assert c.params.floor_pages(page) == pages
    assert CompactConfig(block_size=page, selector_params={"min_pages": 200}).params.floor_pages(page) == max(200, pages)
    assert CompactConfig(block_size=page, selector_params={"min_tokens": 0}).params.floor_pages(page) == 0
    assert CompactConfig(block_size=page, selector_params={"min_tokens": 100}).params.floor_pages(page) == -(-100 // page)


@pytest.mark.parametrize("kwargs, field, words", [
    ({"block_size": 48}, "block_size", "power of two in [16, 256]"),
    ({"block_size": 8}, "block_size", "power of two in [16, 256]"),
    ({"block_size": 512}, "block_size", "power of two in [16, 256]"),
    ({"selector": "nope"}, "selector", "must be one of"),
    ({"sink_blocks": -1}, "sink_blocks", ">= 0"),
    ({"recent_blocks": -1}, "recent_blocks", ">= 0"),
    ({"dense_tail": -5}, "dense_tail", ">= 0"),
    ({"recall_every": -1}, "recall_every", ">= 0"),
    ({"recall_every": 2.5}, "recall_every", ">= 0"),
    ({"min_context": -5}, "min_context", ">= 0"),
    ({"min_context": 1.5}, "min_context", ">= 0"),
    ({"dense_above": 1.5}, "dense_above", "[0, 1]"),
    ({"dense_above": float("nan")}, "dense_above", "[0, 1]"),
    ({"dense_above": True}, "dense_above", "[0, 1]"),
    ({"prefill_kernel": "fa4"}, "prefill_kernel", "one of auto, fa2, fa3"),
    ({"dense_kernel": "fa3"}, "dense_kernel", "one of auto, flashinfer, sgl-fa3"),
    ({"selector": "flashprefill", "selector_params": {"query_stride": 3}}, "selector_params['query_stride']",
     "power of two in [1, 16]"),
    ({"selector": "budget", "selector_params": {"query_stride": 32}}, "selector_params['query_stride']",
     "integer in [0, 16]"),
    ({"selector": "quest_budget", "selector_params": {"query_stride": 3}}, "selector_params['query_stride']",
     "0 or a power of two in [1, 16]"),
    ({"density_cap": 0.0}, "density_cap", "(0, 1]"),
    ({"density_cap": 1.5}, "density_cap", "(0, 1]"),
    ({"selector": "flashprefill", "selector_params": {"alpha": 2.0}}, "selector_params['alpha']", "[0.0, 1.0]"),
    ({"selector": "flashprefill", "selector_params": {"alpha": True}}, "selector_params['alpha']", "number"),
    ({"selector_params": {"beta": 1}}, "selector_params", "unknown parameter"),
    ({"selector_params": {"alpha": 0.2}}, "selector_params", "allowed: density, min_pages, min_tokens"),
    ({"selector": "xattention", "selector_params": {"stride": 3}}, "selector_params['stride']", "power of two"),
    ({"selector": "seer"}, "selector_params['gate_path']", "safetensors"),
    ({"selector": "seer", "selector_params": {"gate_path": 3}}, "selector_params['gate_path']", "string"),
    ({"selector": "dense", "density_cap": 0.5}, "density_cap", "budget"),
    ({"dense_layers": (1, 20)}, "dense_layers", "must be layers after 1"),
    ({"dense_layers": (20, 2.0)}, "dense_layers", "tuple of layer ids"),
    ({"dense_layers": "21"}, "dense_layers", "tuple of layer ids"),
    ({"selector_modules": "not.a.tuple"}, "selector_modules", "tuple of module names"),
    ({"selector_modules": ("no_such_module_xyz",)}, "selector", "could not be imported"),
])
def test_invalid_values_name_field_and_range(kwargs, field, words):
    with pytest.raises(ValueError) as e:
        CompactConfig(**kwargs)
    msg = str(e.value)
    assert f"CompactConfig.{field}:" in msg and words in msg, msg


def test_every_registered_selector_constructible_with_its_defaults():
    for name in selector_names():
        params = {"gate_path": "/x.safetensors"} if name == "seer" else {}
        c = CompactConfig(selector=name, selector_params=params)
        assert c.selector == name and isinstance(c.params, selector_spec(name).params)


def test_params_given_as_the_dataclass_or_a_mapping_are_equal():
    spec = selector_spec("budget")
    a = CompactConfig(selector="budget", selector_params={"density": 0.25})
    b = CompactConfig(selector="budget", selector_params=spec.params(density=0.25))
    assert a == b and a.params.density == 0.25
    with pytest.raises(ValueError, match="parameters of another selector"):
        CompactConfig(selector="flashprefill", selector_params=spec.params())


def test_replace_with_another_selector_resets_its_params():
    c = CompactConfig(selector="flashprefill", selector_params={"alpha": 0.1}).replace(selector="budget")
    assert c.params.density == pytest.approx(0.3)


def test_expected_densities_come_from_the_selectors():
    assert selector_spec("budget").expected_density(CompactConfig(selector="budget",
                                                                  selector_params={"density": 0.2}).params) == 0.2
    assert selector_spec("dense").expected_density(CompactConfig(selector="dense").params) == 1.0
    # per-layer budgets: the mean over the model's layers (5 of 24 layers at 0.6, the rest at 0.28)
    per_layer = CompactConfig(selector="mass_budget", selector_params={"density": 0.28, "layer_density": "2-6:0.6"})
    assert selector_spec("mass_budget").expected_density(per_layer.params) == pytest.approx(0.28)
    assert selector_spec("mass_budget").expected_density(per_layer.params, 24) == pytest.approx(
        (5 * 0.6 + 19 * 0.28) / 24)
    assert selector_spec("dense").expected_density(CompactConfig(selector="dense").params, 24) == 1.0
    assert selector_spec("budget").fixes_row_lengths and not selector_spec("flashprefill").fixes_row_lengths
    assert selector_spec("flashprefill").uses_summaries and not selector_spec("oracle").uses_summaries


def test_dense_layers_are_checked_against_the_model_and_the_rows_plan():
    """At server start (`srt.runtime.check_dense_layers`): ids of the model's layers, none of a pipeline stage's
    first layers up to its observing one, and not with rows planned once from their lengths (fa3)."""
    from types import SimpleNamespace

    from sglang_compact.srt.model_checks import UnsupportedModelError
    from sglang_compact.srt.runtime import check_dense_layers

    cfg = CompactConfig(dense_layers=(21, 22, 23))
    check_dense_layers(cfg, SimpleNamespace(model_layers=24, start_layer=0), planned_once=False)
    check_dense_layers(CompactConfig(), SimpleNamespace(model_layers=24, start_layer=0), planned_once=True)
    with pytest.raises(UnsupportedModelError, match=r"the model has 24 layers \(0-23\)"):
        check_dense_layers(CompactConfig(dense_layers=(23, 24)), SimpleNamespace(model_layers=24, start_layer=0),
                           planned_once=False)
    with pytest.raises(UnsupportedModelError, match="layers 12-13 are this pipeline stage's first layers"):
        check_dense_layers(CompactConfig(dense_layers=(13, 22)), SimpleNamespace(model_layers=24, start_layer=12),
                           planned_once=False)
    with pytest.raises(UnsupportedModelError, match="add --compact-prefill-kernel fa2"):
        check_dense_layers(cfg, SimpleNamespace(model_layers=24, start_layer=0), planned_once=True)


def test_dense_kernel_off_hopper():
    """`--compact-dense-kernel`: auto falls back to FlashInfer where sgl_kernel's FA3 cannot run (here: no CUDA);
    sgl-fa3 asked for there is refused at start, with the reason."""
    import torch

    from sglang_compact.srt.model_checks import UnsupportedModelError
    from sglang_compact.srt.runtime import resolve_dense_kernel

    cpu = torch.device("cpu")
    assert resolve_dense_kernel(CompactConfig(), cpu, torch.bfloat16, 64) == "flashinfer"
    assert resolve_dense_kernel(CompactConfig(dense_kernel="flashinfer"), cpu, torch.bfloat16, 64) == "flashinfer"
    with pytest.raises(UnsupportedModelError, match="--compact-dense-kernel sgl-fa3: FA3 runs on CUDA GPUs, the KV "
                                                    "cache is on cpu; use auto or flashinfer"):
        resolve_dense_kernel(CompactConfig(dense_kernel="sgl-fa3"), cpu, torch.bfloat16, 64)


def test_prefill_kernel_off_hopper():
    """`--compact-prefill-kernel`: auto runs the rows on fa2 where no Hopper GPU holds the cache (sgl_kernel's FA3
    and FlashInfer's fa3 need one); sgl-fa3 asked for there is refused at start, with the reason."""
    import torch

    from sglang_compact.srt.model_checks import UnsupportedModelError
    from sglang_compact.srt.runtime import resolve_prefill_kernel

    cpu = torch.device("cpu")
    for selector in ("flashprefill", "budget"):
        assert resolve_prefill_kernel(CompactConfig(selector=selector), cpu, torch.bfloat16, 64) == "fa2"
    with pytest.raises(UnsupportedModelError, match="--compact-prefill-kernel sgl-fa3: FA3 runs on CUDA GPUs"):
        resolve_prefill_kernel(CompactConfig(prefill_kernel="sgl-fa3"), cpu, torch.bfloat16, 64)
    with pytest.raises(UnsupportedModelError, match="--compact-prefill-kernel fa3 needs a Hopper"):
        resolve_prefill_kernel(CompactConfig(prefill_kernel="fa3"), cpu, torch.bfloat16, 64)


@pytest.mark.parametrize("page, stride, ok", [(32, 2, True), (64, 4, True), (32, 4, False), (16, 2, False)])
def test_a_query_stride_below_the_search_kernels_tile_is_refused_on_cuda(page, stride, ok):
    """At launch and server start (`srt.model_checks.check_search_kernel`): on CUDA a `query_stride` leaving fewer
    than 16 scored queries per page would send the search to its torch twin without a word; the CPU runs the
    twin anyway, and a selector without the parameter passes."""
    from sglang_compact.kernels.flashprefill import supports
    from sglang_compact.srt.model_checks import UnsupportedModelError, check_search_kernel

    for selector in ("quest_budget", "budget", "flashprefill"):
        cfg = CompactConfig(block_size=page, selector=selector, selector_params={"query_stride": stride})
        check_search_kernel(cfg, "cpu")
        assert supports(64, page, stride) == ok
        if ok:
            check_search_kernel(cfg, "cuda")
        else:
            with pytest.raises(UnsupportedModelError, match=f"query_stride {stride} scores {page // stride} queries "
                               f"of each {page}-token page.*use query_stride <= {max(page // 16, 1)} at --page-size"):
                check_search_kernel(cfg, "cuda")
    check_search_kernel(CompactConfig(block_size=16, selector="xattention"), "cuda")


@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
def test_the_default_selectors_query_stride_follows_the_page_size(page):
    """`quest_budget`'s default `query_stride` (0) scores 16 queries of each page, the search kernel's smallest query
    tile: the cheapest search the CUDA kernel runs at every page size, never refused at launch. `budget` scores
    every query unless asked (0 there too); `flashprefill` takes no 0."""
    from sglang_compact.kernels.flashprefill import MIN_QUERY_TILE, supports
    from sglang_compact.selectors.registry import SCORED_QUERIES_PER_PAGE
    from sglang_compact.srt.model_checks import check_search_kernel

    assert SCORED_QUERIES_PER_PAGE == MIN_QUERY_TILE
    cfg = CompactConfig(block_size=page)
    assert cfg.selector == "quest_budget" and cfg.params.query_stride == 0
    stride = cfg.params.query_stride_at(page)
    assert stride == page // 16 and supports(64, page, stride)
    assert f"query_stride=0; query stride {stride} at this page size" in cfg.describe()   # the server's start line
    check_search_kernel(cfg, "cuda")
    assert CompactConfig(block_size=page, selector="budget").params.query_stride_at(page) == 1
    assert CompactConfig(block_size=page, selector="budget",
                         selector_params={"query_stride": 0}).params.query_stride_at(page) == stride
    assert CompactConfig(block_size=page, selector="xattention").params.query_stride_at(page) == 1
    with pytest.raises(ValueError, match=r"selector_params\['query_stride'\]: must be an integer in \[1, 16\]"):
        CompactConfig(block_size=page, selector="flashprefill", selector_params={"query_stride": 0})


@pytest.mark.parametrize("text,match", [("2-6", "layers:value"), ("2-6:1.5", r"value in \[0.0, 1.0\]"),
                                        ("x:0.3", "layer ids or ranges"), ("2:0.3,2:0.4", "layer 2 is given twice"),
                                        ("6-2:0.3", "layer ids or ranges")])
def test_layer_density_is_checked_when_configured(text, match):
    for selector in ("budget", "mass_budget"):
        with pytest.raises(ValueError, match=r"CompactConfig.selector_params: layer_density: .*" + match):
            CompactConfig(selector=selector, selector_params={"layer_density": text})


def test_per_layer_selector_rows_need_rows_planned_with_bounds():
    """A selector's per-layer parameters (`budget` `layer_density`): the layers it names exist, and its rows do not
    run on fa3 planned once (their lengths differ between layers)."""
    from types import SimpleNamespace

    from sglang_compact.selectors import make_selector
    from sglang_compact.srt.model_checks import UnsupportedModelError
    from sglang_compact.srt.runtime import check_layer_rows

    cfg = CompactConfig(selector="budget", selector_params={"density": 0.25, "layer_density": "2-4:0.6,9:0.1"})
    layers = make_selector(cfg).own_layers()
    assert layers == (2, 3, 4, 9)
    assert make_selector(CompactConfig(selector="budget")).own_layers() == ()
    model = SimpleNamespace(model_layers=24, start_layer=0)
    check_layer_rows(cfg, model, planned_once=False, selector_layers=layers)
    with pytest.raises(UnsupportedModelError, match="add --compact-prefill-kernel fa2"):
        check_layer_rows(cfg, model, planned_once=True, selector_layers=layers)
    with pytest.raises(UnsupportedModelError, match=r"layers \[9\] are not among the model's 8 layers"):
        check_layer_rows(cfg, SimpleNamespace(model_layers=8, start_layer=0), planned_once=False,
                         selector_layers=layers)


def test_features_that_write_kv_outside_the_backend_are_refused():
    """`srt.model_checks.check_server_features`, run at launch and at server start: SGLang's defaults pass; each
    feature that puts KV into the pool outside the backend, or replaces the radix tree the exact prefix cache
    wraps, is refused, naming its flag."""
    from types import SimpleNamespace

    from sglang_compact.srt.model_checks import UnsupportedModelError, check_server_features
    stock = dict(enable_hierarchical_cache=False, hicache_storage_backend=None, enable_lmcache=False,
                 disaggregation_mode="null", enable_hisparse=False, attn_cp_size=1, enable_prefill_cp=False)
    check_server_features(SimpleNamespace(**stock))
    check_server_features(SimpleNamespace(**{**stock, "attn_cp_size": None}))   # before SGLang resolves it
    # another radix tree caches nothing with the radix cache off
    check_server_features(SimpleNamespace(**{**stock, "radix_cache_backend": "flexkv", "disable_radix_cache": True}))
    for change, flag in [(dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
                         (dict(hicache_storage_backend="file"), "--hicache-storage-backend"),
                         (dict(enable_lmcache=True), "--enable-lmcache"),
                         (dict(enable_flexkv=True), "--enable-flexkv"),
                         (dict(radix_cache_backend="flexkv"), "--radix-cache-backend flexkv"),
                         (dict(enable_streaming_session=True), "--enable-streaming-session"),
                         (dict(disaggregation_mode="decode"), "--disaggregation-mode decode"),
                         (dict(enable_hisparse=True), "--enable-hisparse"),
                         (dict(attn_cp_size=4), "--attn-cp-size 4"),
                         (dict(enable_prefill_cp=True), "--enable-prefill-cp")]:
        with pytest.raises(UnsupportedModelError, match=flag):
            check_server_features(SimpleNamespace(**{**stock, **change}))


def test_the_default_reads_a_larger_share_from_chunk_8192():
    """`quest_budget`'s `chunk_density` ('8192:0.33'): a server whose chunked-prefill size is 8192 or more (or off)
    keeps 0.33 of each row's pages, below it 0.25; the cost gate prices the resolved share."""
    from sglang_compact.gate import Gate, ModelShape

    cfg = CompactConfig(block_size=32)
    assert cfg.params.chunk_density == "8192:0.33"
    got = {chunk: cfg.at_chunk(chunk).params.density for chunk in (256, 1024, 4096, 8191, 8192, 16384, None, -1)}
    assert got == {256: 0.25, 1024: 0.25, 4096: 0.25, 8191: 0.25, 8192: 0.33, 16384: 0.33, None: 0.33, -1: 0.33}
    # resolved once: the rule is spent, so the share holds wherever the configuration goes next
    for chunk, share in ((1024, 0.25), (8192, 0.33)):
        resolved = cfg.at_chunk(chunk)
        assert resolved.params.chunk_density is None and resolved.at_chunk(None) == resolved
        assert [resolved.at_chunk(c).params.density for c in (256, 8192, 65536)] == [share] * 3
    assert "density=0.33, " in cfg.at_chunk(8192).describe()      # the server's start line
    for chunk, share in ((1024, 0.25), (8192, 0.33)):
        gate = Gate.for_server(cfg.at_chunk(chunk), ModelShape(14, 2, 64, 32), chunk, "NVIDIA H200", "fa3", 32768,
                               "fa3", num_layers=24, capability="9.0", multiprocessors=132)
        assert f"expected density {share} " in gate.describe()
    steps = CompactConfig(selector="budget", selector_params={"density": 0.2, "chunk_density": "4096:0.3,16384:0.4"})
    assert [steps.at_chunk(c).params.density for c in (1024, 4096, 8192, 16384, None)] == [0.2, 0.3, 0.3, 0.4, 0.4]
    assert CompactConfig(selector="budget").at_chunk(8192).params.density == 0.3   # no rule: `density` everywhere


def test_a_density_given_alone_holds_at_every_chunk_size():
    """Asking for `density` by name (flags, method specs, programs) turns the default's chunk rule off, unless
    `chunk_density` is given too; an instance keeps what it holds."""
    only = CompactConfig(selector_params={"density": 0.2})
    assert only.params.chunk_density is None and only.at_chunk(8192).params.density == 0.2
    both = CompactConfig(selector_params={"density": 0.2, "chunk_density": "8192:0.4"})
    assert both.at_chunk(1024).params.density == 0.2 and both.at_chunk(8192).params.density == 0.4
    again = CompactConfig(selector_params=both.params)
    assert again.params == both.params
    from sglang_compact.srt.args import build_config, split_args
    for flags in (["--compact-selector-params", '{"density": 0.2}'], ["--compact-density", "0.2"]):
        ns, _ = split_args(flags)
        assert build_config(ns, 64).at_chunk(8192).params.density == 0.2


@pytest.mark.parametrize("text,match", [("8192", "tokens:fraction"), ("8192:1.5", "tokens:fraction"),
                                        ("0:0.3", "tokens:fraction"), ("x:0.3", "tokens:fraction"),
                                        ("8192:0.3,8192:0.4", "chunk size 8192 is given twice")])
def test_chunk_density_is_checked_when_configured(text, match):
    for selector in ("budget", "mass_budget", "quest_budget"):
        with pytest.raises(ValueError, match=r"CompactConfig.selector_params: chunk_density: .*" + match):
            CompactConfig(selector=selector, selector_params={"chunk_density": text})
