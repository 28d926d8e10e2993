import pytest

from sglang_compact.config import SELECTOR_NAMES, CompactConfig


def test_defaults_valid():
    c = CompactConfig()
    assert c.selector == "flashprefill" and c.param("alpha") == pytest.approx(0.4)
    assert c.uses_compact_path(c.min_prefix_len) and not c.uses_compact_path(c.min_prefix_len - 1)
    assert not CompactConfig(min_prefix_len=0).uses_compact_path(0)


@pytest.mark.parametrize("kwargs, field, words", [
    ({"block_size": 48}, "block_size", "power of two in [16, 256]"),
    ({"block_size": 8}, "block_size", "power of two in [16, 256]"),
    ({"block_size": 512}, "block_size", "power of two in [16, 256]"),
    ({"selector": "nope"}, "selector", "one of"),
    ({"sink_blocks": -1}, "sink_blocks", ">= 0"),
    ({"recent_blocks": 0}, "recent_blocks", ">= 1"),
    ({"min_prefix_len": -5}, "min_prefix_len", ">= 0"),
    ({"prefill_kernel": "fa4"}, "prefill_kernel", "one of auto, fa2, fa3"),
    ({"selector_params": {"query_stride": 3}}, "selector_params['query_stride']", "power of two in [1, 16]"),
    ({"selector": "budget", "selector_params": {"query_stride": 32}}, "selector_params['query_stride']", "integer in [1, 16]"),
    ({"density_cap": 0.0}, "density_cap", "(0, 1]"),
    ({"density_cap": 1.5}, "density_cap", "(0, 1]"),
    ({"selector_params": {"alpha": 2.0}}, "selector_params['alpha']", "[0.0, 1.0]"),
    ({"selector_params": {"beta": 1}}, "selector_params", "unknown parameter"),
    ({"selector": "xattention", "selector_params": {"stride": 3}}, "selector_params['stride']", "power of two"),
    ({"selector": "seer"}, "selector_params['gate_path']", "safetensors"),
    ({"selector": "dense", "density_cap": 0.5}, "density_cap", "budget"),
])
def test_invalid_values_name_field_and_range(kwargs, field, words):
    with pytest.raises(ValueError) as e:
        CompactConfig(**kwargs)
    msg = str(e.value)
    assert f"CompactConfig.{field}:" in msg and words in msg


def test_every_selector_constructible():
    for name in SELECTOR_NAMES:
        params = {"gate_path": "/x.safetensors"} if name == "seer" else {}
        assert CompactConfig(selector=name, selector_params=params).selector == name
