"""Offline fidelity (`sglang_compact.eval.fidelity`) on a tiny random Llama (no real weights needed)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from sglang_compact.eval import fidelity as F  # noqa: E402

PAGE, CHUNK, T = 16, 64, 300


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM
    F.register_capture()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      attn_implementation=F.CAPTURE_IMPL)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (T,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, ids


def test_capture_reproduces_the_models_attention(tiny):
    model, ids = tiny
    seen = {}
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, args[0][0].detach().clone()))
        for i, layer in enumerate(model.model.layers)]
    try:
        layers = F.capture_qkv(model, ids)
    finally:
        for h in hooks:
            h.remove()
    assert len(layers) == 2
    for i, lq in enumerate(layers):
        assert lq.q.shape == (T, 4, 16) and lq.k.shape == (T, 2, 16) and lq.v.shape == (T, 2, 16)
        o = torch.nn.functional.scaled_dot_product_attention(
            lq.q.transpose(0, 1)[None], lq.k.transpose(0, 1)[None], lq.v.transpose(0, 1)[None],
            is_causal=True, scale=lq.scale, enable_gqa=True)[0].transpose(0, 1).reshape(T, -1)
        torch.testing.assert_close(o, seen[i], atol=1e-5, rtol=1e-5)


def test_simulate_methods(tiny):
    model, ids = tiny
    layers = F.capture_qkv(model, ids)
    methods = ["dense", "compact:dense", "compact:budget:density=0.3", "compact:flashprefill:alpha=0.5",
               "blocksparse:flashprefill:alpha=0.5", "compact:oracle:top_p=0.9", "compact:xattention:threshold=0.9",
               "quoka:query_ratio=0.5,kv_budget=0.25"]
    r = F.simulate(layers, methods, chunk=CHUNK, page_size=PAGE, min_prefix_len=CHUNK, sink_blocks=1,
                   recent_blocks=1)
    # chunks start at 64, 128, 192, 256
    assert r.compact_chunks == 4
    s = r.summary()
    for m in ("dense", "compact-dense()"):
        assert s[m]["rel_err"] < 1e-5 and abs(s[m]["recall"] - 1) < 1e-6 and s[m]["density"] == 1.0
    b = s["compact-budget(density=0.3)"]
    assert 0.3 <= b["density"] < 0.8 and b["recall"] < 1 and b["rel_err"] > 1e-4
    # the unions only add blocks: compact reads at least what block-sparse reads, and loses less mass
    c, bs = s["compact-flashprefill(alpha=0.5)"], s["blocksparse-flashprefill(alpha=0.5)"]
    assert c["density"] >= bs["density"] - 1e-9 and c["recall"] >= bs["recall"] - 1e-9
    q = s["quoka(kv_budget=0.25,query_ratio=0.5)"]
    assert abs(q["density"] - 0.25) < 0.02
    for m, v in s.items():
        assert 0 <= v["density"] <= 1 and 0 <= v["recall"] <= 1 + 1e-6 and not math.isnan(v["rel_err"]), m
    assert all(len(x) == 2 for d in r.per_layer.values() for x in d.values())
    # density-only mode agrees on densities
    r2 = F.simulate(layers, methods[2:4], chunk=CHUNK, page_size=PAGE, min_prefix_len=CHUNK, sink_blocks=1,
                    recent_blocks=1, density_only=True)
    for m in r2.per_layer:
        assert r2.per_layer[m]["density"] == pytest.approx(r.per_layer[m]["density"])
    md = F.fidelity_markdown(r.as_dict(), "tiny")
    assert "| compact-budget(density=0.3) |" in md


def test_offline_density_and_parse(tiny):
    model, ids = tiny
    d = F.offline_density(model, ids, "compact:budget:density=0.3", chunk=CHUNK, page_size=PAGE,
                          min_prefix_len=CHUNK, sink_blocks=1, recent_blocks=1)
    assert 0.3 <= d < 1
    assert F.offline_density(model, ids[:60], "compact:budget:density=0.3", chunk=CHUNK, page_size=PAGE,
                             min_prefix_len=CHUNK) is None  # one chunk, no prefix
    m = F.parse_method("compact:flashprefill:alpha=0.06")
    assert m.kind == "compact" and dict(m.params) == {"alpha": 0.06}
    assert F.parse_method("quoka").params == (("kv_budget", 0.25), ("query_ratio", 0.25))
    with pytest.raises(ValueError):
        F.parse_method("sparse:flashprefill")


def test_hf_chunked_generation(tiny):
    from sglang_compact.eval import hf_runner as H
    model, ids = tiny
    kw = dict(max_new_tokens=6, chunk=CHUNK, page_size=PAGE, min_prefix_len=CHUNK, sink_blocks=1, recent_blocks=1)
    ref = H.generate(model, ids, "dense", **kw)
    assert len(ref.output_ids) == 6 and ref.density is None
    # plain HF greedy generation (one prefill pass, SDPA) gives the same tokens
    model.set_attn_implementation("sdpa")
    plain = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, T:].tolist()
    assert ref.output_ids == plain
    same = H.generate(model, ids, "compact:dense", **kw)
    assert same.output_ids == ref.output_ids and same.density == 1.0
    for m in ("compact:budget:density=0.3", "blocksparse:budget:density=0.3", "quoka"):
        g = H.generate(model, ids, m, **kw)
        assert len(g.output_ids) == 6 and 0 < g.density < 1, m


def test_dense_final_chunk_in_the_replay_and_the_hf_runner(tiny):
    """`dense_final_chunk` (on by default for compact/blocksparse): the prompt's last chunk reads every prefix block,
    at density 1.0 and zero error, in the offline replay and in the HF runner alike; the earlier chunks are the same."""
    from sglang_compact.eval import hf_runner as H
    model, ids = tiny
    on, off = "compact:budget:density=0.3", "compact:budget:density=0.3,dense_final_chunk=0"
    assert F.parse_method(on).dense_final_chunk and not F.parse_method(off).dense_final_chunk
    assert not F.parse_method("quoka").dense_final_chunk and F.parse_method("quoka:dense_final_chunk=1").dense_final_chunk
    layers = F.capture_qkv(model, ids)
    r = F.simulate(layers, [on, off], chunk=CHUNK, page_size=PAGE, min_prefix_len=CHUNK, sink_blocks=1,
                   recent_blocks=1)
    s_on, s_off = r.summary()["compact-budget(density=0.3)"], r.summary()["compact-budget(dense_final_chunk=0,density=0.3)"]
    # 4 compact chunks per layer; only the last differs: (3x + 1) / 4 against (3x + y) / 4, y < 1
    assert 0 < s_on["density"] - s_off["density"] < 0.25
    assert s_on["rel_err"] < s_off["rel_err"] and s_on["recall"] > s_off["recall"]
    kw = dict(max_new_tokens=4, chunk=CHUNK, page_size=PAGE, min_prefix_len=CHUNK, sink_blocks=1, recent_blocks=1)
    g_on, g_off = H.generate(model, ids, on, **kw), H.generate(model, ids, off, **kw)
    # 2 layers x 4 chunks each: the last chunk's two entries are 1.0 against y0 + y1 < 2
    assert 0 < (g_on.density - g_off.density) * 8 < 2
