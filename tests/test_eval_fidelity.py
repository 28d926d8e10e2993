"""Offline fidelity (`harness.eval.fidelity`) on a tiny random Llama (no real weights needed)."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from harness.eval import fidelity as F  # noqa: E402

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
    # dense_tail=0: every window but the prompt's last, partial one may go sparse
    methods = ["dense", "compact:dense:dense_tail=0", "compact:budget:density=0.3,dense_tail=0",
               "compact:budget:density=1.0,dense_tail=0", "compact:flashprefill:alpha=0.5,dense_tail=0",
               "blocksparse:flashprefill:alpha=0.5,dense_tail=0", "compact:oracle:top_p=0.9,dense_tail=0",
               "compact:xattention:threshold=0.9,dense_tail=0", "blocksparse:xattention:threshold=0.9,dense_tail=0",
               "quoka:query_ratio=0.5,kv_budget=0.25"]
    r = F.simulate(layers, methods, chunk=CHUNK, page_size=PAGE, min_context=CHUNK, sink_blocks=1,
                   recent_blocks=1)
    # windows of 64 tokens (the chunk size): windows 1.. have >= 64 tokens of context; the chunk 256..300 is a partial
    # window, which the gate keeps dense (it reaches past the prompt's end): chunks 64, 128, 192 are replayed
    assert r.compact_chunks == 3
    s = r.summary()
    for m in ("dense", "compact-dense(dense_tail=0)", "compact-budget(dense_tail=0,density=1.0)"):
        assert s[m]["rel_err"] < 1e-5 and abs(s[m]["recall"] - 1) < 1e-6 and s[m]["density"] == 1.0, m
    assert s["dense"]["rel_err"] == 0.0
    b = s["compact-budget(dense_tail=0,density=0.3)"]
    assert 0.3 <= b["density"] < 0.8 and b["recall"] < 1 and b["rel_err"] > 1e-4
    # the group and window unions only add pages: compact reads at least what block-sparse reads, and loses less
    for sel in ("flashprefill(alpha=0.5,dense_tail=0)", "xattention(dense_tail=0,threshold=0.9)"):
        c, bs = s[f"compact-{sel}"], s[f"blocksparse-{sel}"]
        assert c["density"] >= bs["density"] - 1e-9 and c["recall"] >= bs["recall"] - 1e-9, sel
    # (a random tiny model attends almost uniformly: flashprefill keeps every page at alpha 0.5; xattention's
    # top-p drops some per head and q-block, which the unions over a window's 4 q-blocks and 2 heads restore)
    c, bs = s["compact-xattention(dense_tail=0,threshold=0.9)"], s["blocksparse-xattention(dense_tail=0,threshold=0.9)"]
    assert bs["density"] < c["density"] <= 1 and bs["rel_err"] > c["rel_err"] and bs["recall"] < c["recall"]
    q = s["quoka(kv_budget=0.25,query_ratio=0.5)"]
    assert abs(q["density"] - 0.25) < 0.02 and q["recall"] < 1
    for m, v in s.items():
        assert 0 <= v["density"] <= 1 and 0 <= v["recall"] <= 1 + 1e-6 and not math.isnan(v["rel_err"]), m
    assert all(len(x) == 2 for d in r.per_layer.values() for x in d.values())
    # density-only mode agrees on densities
    r2 = F.simulate(layers, methods[2:6] + methods[-1:], chunk=CHUNK, page_size=PAGE, min_context=CHUNK,
                    sink_blocks=1, recent_blocks=1, density_only=True)
    for m in r2.per_layer:
        assert r2.per_layer[m]["density"] == pytest.approx(r.per_layer[m]["density"])
    md = F.fidelity_markdown(r.as_dict(), "tiny")
    assert "| compact-budget(dense_tail=0,density=0.3) |" in md and "64 tokens of context" in md


def test_recall_and_error_against_a_direct_computation(tiny):
    """Layer 1 by hand: per chunk, recall is the dense causal softmax mass on the keys the method reads (the compact
    table's pages per window, causally), the output is attention over exactly those keys, and the replay's figures
    are the means over the chunks."""
    model, ids = tiny
    lq = F.capture_qkv(model, ids)[1]
    m = F.parse_method("compact:budget:density=0.3,dense_tail=0")
    cfg = m.config(PAGE, 1, 1, CHUNK, CHUNK)
    G = 2
    recalls, errs = [], []
    for s, e in [(64, 128), (128, 192), (192, 256)]:
        batch = F.chunk_batch(lq.q[s:e], lq.k, lq.v, s, PAGE, lq.scale, m.gate(cfg, CHUNK), T)
        o, allowed, d, _ = F.run_method(m, batch, 1, cfg, F.CompactAttention(cfg))
        k = lq.k[:e].transpose(0, 1).repeat_interleave(G, 0)                    # [H_q, E, D]
        v = lq.v[:e].transpose(0, 1).repeat_interleave(G, 0)
        logits = lq.q[s:e].transpose(0, 1) @ k.transpose(1, 2) * lq.scale     # [H_q, C, E]
        causal = torch.arange(e)[None, :] <= torch.arange(s, e)[:, None]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
        keep = allowed.repeat_interleave(G, 0)
        assert not (keep & ~causal).any() and keep[:, torch.arange(e - s), torch.arange(s, e)].all()  # own token
        recalls.append(float((probs * keep).sum(-1).mean()))
        assert 0 < recalls[-1] < 1 and 0.3 <= d < 0.8
        want = (torch.softmax(logits.masked_fill(~keep, float("-inf")), -1) @ v).transpose(0, 1)
        torch.testing.assert_close(o, want, rtol=1e-4, atol=1e-5)
        dense = (probs @ v).transpose(0, 1)
        errs.append(float((o - dense).norm() / dense.norm()))
    r = F.simulate([lq], [m], chunk=CHUNK, page_size=PAGE, min_context=CHUNK, sink_blocks=1, recent_blocks=1)
    assert r.compact_chunks == 3
    assert r.per_layer[m.label]["recall"][0] == pytest.approx(sum(recalls) / 3, rel=1e-5)
    assert r.per_layer[m.label]["rel_err"][0] == pytest.approx(sum(errs) / 3, rel=1e-3)


def test_blocksparse_needs_a_per_head_choice(tiny):
    model, ids = tiny
    layers = F.capture_qkv(model, ids)
    with pytest.raises(ValueError, match="blocksparse supports flashprefill"):
        F.simulate(layers, ["blocksparse:budget:density=0.3,dense_tail=0"], chunk=CHUNK, page_size=PAGE,
                   min_context=CHUNK, layer_ids=[0])


def test_offline_density_and_parse(tiny):
    model, ids = tiny
    d = F.offline_density(model, ids, "compact:budget:density=0.3,dense_tail=0", chunk=CHUNK, page_size=PAGE,
                          min_context=CHUNK, sink_blocks=1, recent_blocks=1)
    assert 0.3 <= d < 1
    assert F.offline_density(model, ids[:60], "compact:budget:density=0.3", chunk=CHUNK, page_size=PAGE,
                             min_context=CHUNK) is None  # one chunk, no context
    # a dense tail of 1024 tokens covers the whole 300-token prompt: no q-block goes sparse
    assert F.offline_density(model, ids, "compact:budget:density=0.3,dense_tail=1024", chunk=CHUNK, page_size=PAGE,
                             min_context=CHUNK) is None
    m = F.parse_method("compact:flashprefill:alpha=0.06")
    assert m.kind == "compact" and dict(m.params) == {"alpha": 0.06}
    assert F.parse_method("quoka").params == (("kv_budget", 0.25), ("query_ratio", 0.25))
    with pytest.raises(ValueError):
        F.parse_method("sparse:flashprefill")
    # booleans parse; what the selector does not take fails at parsing, before any server or model starts
    assert dict(F.parse_method("compact:flashprefill:fix_rows=true,query_stride=2").params) == \
        {"fix_rows": True, "query_stride": 2}
    with pytest.raises(ValueError, match="unknown parameter.*dense_layer.*given to the server"):
        F.parse_method("compact:flashprefill:dense_layer=1")
    # dense_above: the server's observed-density fallback, a compact server method's, never replayed offline
    from harness.eval.methods import compact_server_args
    m = F.parse_method("compact:flashprefill:dense_above=1")
    assert m.dense_above == 1.0 and m.selector_params == {}
    args = compact_server_args(m.selector, dict(m.params), 64, 1, 1)
    assert args[args.index("--compact-dense-above") + 1] == "1.0" and "--compact-selector-params" not in args
    m.check_replayable()   # 1: never falls back, as the replay runs it
    with pytest.raises(ValueError, match="not modelled offline"):
        F.parse_method("compact:flashprefill:dense_above=0.3").check_replayable()
    with pytest.raises(ValueError, match=r"dense_above must be a density in \[0, 1\]"):
        F.parse_method("compact:flashprefill:dense_above=2")
    with pytest.raises(ValueError, match="dense_above is a compact method's"):
        F.parse_method("blocksparse:flashprefill:dense_above=1")
    with pytest.raises(ValueError, match="must be a number or true/false"):
        F.parse_method("compact:flashprefill:alpha=high")


def test_density_cap_is_a_server_param_and_the_replay_caps_the_oracle(tiny):
    from harness.eval.methods import compact_server_args
    m = F.parse_method("compact:oracle:top_p=1,density_cap=0.35,dense_above=1")
    assert m.density_cap == 0.35 and m.selector_params == {"top_p": 1}
    args = compact_server_args(m.selector, dict(m.params), 64, 1, 1)
    assert args[args.index("--compact-density-cap") + 1] == "0.35"
    assert json.loads(args[args.index("--compact-selector-params") + 1]) == {"top_p": 1}
    assert m.config(PAGE, 1, 1, CHUNK, CHUNK).density_cap == 0.35
    assert F.parse_method("compact:oracle").density_cap is None
    with pytest.raises(ValueError, match=r"density_cap must be a density in \(0, 1\]"):
        F.parse_method("compact:oracle:density_cap=0")
    with pytest.raises(ValueError, match="budget"):   # the config's own rule: the dense selector takes no cap
        F.parse_method("compact:dense:density_cap=0.5")
    # the replay runs the cap: every candidate page by exact mass (top_p 1), then the best 30% per row
    model, ids = tiny
    kw = dict(chunk=CHUNK, page_size=PAGE, min_context=CHUNK, sink_blocks=1, recent_blocks=1)
    full = F.offline_density(model, ids, "compact:oracle:top_p=1,dense_tail=0", **kw)
    capped = F.offline_density(model, ids, "compact:oracle:top_p=1,density_cap=0.3,dense_tail=0", **kw)
    assert full == pytest.approx(1.0) and capped < 0.8


def test_hf_chunked_generation(tiny):
    from harness.eval import hf_runner as H
    model, ids = tiny
    kw = dict(max_new_tokens=6, chunk=CHUNK, page_size=PAGE, min_context=CHUNK, sink_blocks=1, recent_blocks=1)
    ref = H.generate(model, ids, "dense", **kw)
    assert len(ref.output_ids) == 6 and ref.density is None
    # plain HF greedy generation (one prefill pass, SDPA) gives the same tokens
    model.set_attn_implementation("sdpa")
    plain = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, T:].tolist()
    assert ref.output_ids == plain
    same = H.generate(model, ids, "compact:dense:dense_tail=0", **kw)
    assert same.output_ids == ref.output_ids and same.density == 1.0 and len(same.densities) == 2 * 3
    for m in ("compact:budget:density=0.3,dense_tail=0", "blocksparse:xattention:threshold=0.9,dense_tail=0", "quoka"):
        g = H.generate(model, ids, m, **kw)
        assert len(g.output_ids) == 6 and 0 < g.density < 1 and len(g.densities) == 2 * 3, m
    # the default dense tail covers the whole prompt: nothing sparse, SDPA throughout
    assert H.generate(model, ids, "compact:budget:density=0.3", **kw).density is None


@pytest.fixture(scope="module")
def four_layers():
    """A 4-layer tiny Llama whose attention is peaked enough to select (larger initial weights), its prompt and
    captured layers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    F.register_capture()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      attn_implementation=F.CAPTURE_IMPL, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (T,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, ids, F.capture_qkv(model, ids)


def test_rows_fixed_at_the_observing_layer_are_replayed_as_served(four_layers):
    """`flashprefill` with `fix_rows` runs as the server runs it (`layer_role`): in each chunk layer 0 reads every
    page (density 1, no error), layer 1 selects as without `fix_rows`, and every later layer keeps layer 1's page
    count per row (the same density, its own pages); in the replay, for a subset of layers, and in the HF runner."""
    from harness.eval import hf_runner as H
    model, ids, layers = four_layers
    fixed, free = "compact:flashprefill:alpha=0.8,dense_tail=0,fix_rows=true", "compact:flashprefill:alpha=0.8,dense_tail=0"
    mf, mfree = F.parse_method(fixed), F.parse_method(free)
    kw = dict(chunk=CHUNK, page_size=PAGE, min_context=CHUNK, sink_blocks=1, recent_blocks=1)
    r = F.simulate(layers, [mf, mfree], **kw)
    pf, pfree = r.per_layer[mf.label], r.per_layer[mfree.label]
    roles = [F.layer_role(mf, mf.config(PAGE, 1, 1, CHUNK, CHUNK), i) for i in range(4)]
    assert roles == ["dense", "observe", "fill", "fill"]
    assert F.layer_role(mfree, mfree.config(PAGE, 1, 1, CHUNK, CHUNK), 0) == "select"
    assert pf["density"][0] == 1.0 and pf["rel_err"][0] == 0.0 and pf["recall"][0] == pytest.approx(1.0)
    assert pfree["density"][0] < 1.0
    assert pf["density"][1] == pytest.approx(pfree["density"][1], abs=1e-12)
    assert pf["rel_err"][1] == pytest.approx(pfree["rel_err"][1], abs=1e-12)
    assert pf["density"][2] == pytest.approx(pf["density"][1], abs=1e-12)
    assert pf["density"][3] == pytest.approx(pf["density"][1], abs=1e-12)
    assert any(abs(pfree["density"][i] - pfree["density"][1]) > 1e-6 for i in (2, 3))   # free layers differ
    # one chunk directly: the fill keeps each row's count, not the rows' pages; without the counts it refuses
    m_cfg = mf.config(PAGE, 1, 1, CHUNK, CHUNK)
    engine = F.CompactAttention(m_cfg)
    gate = mf.gate(m_cfg, CHUNK)
    b1 = F.chunk_batch(layers[1].q[128:192], layers[1].k, layers[1].v, 128, PAGE, layers[1].scale, gate, T)
    b2 = F.chunk_batch(layers[2].q[128:192], layers[2].k, layers[2].v, 128, PAGE, layers[2].scale, gate, T)
    obs = F.run_method(mf, b1, 1, m_cfg, engine, role="observe")
    counts = obs.fixed
    assert counts.dtype == torch.int32 and counts.shape == (b1.num_rows,)
    filled = engine.select_pages(b2, 2, fill=obs.fixed)
    assert torch.equal(filled.counts.to(torch.int32), counts)
    assert F.run_method(mf, b2, 2, m_cfg, engine, role="fill", fill=obs.fixed).density == pytest.approx(obs.density)
    with pytest.raises(ValueError, match="run the observing layer of this chunk first"):
        F.run_method(mf, b2, 2, m_cfg, engine, role="fill")
    # a subset of layers: the observing layer runs for its counts and is not reported
    sub = F.simulate(layers, [mf], layer_ids=[3], **kw).per_layer[mf.label]
    assert len(sub["density"]) == 1 and sub["density"][0] == pytest.approx(pf["density"][3], abs=1e-12)
    assert sub["rel_err"][0] == pytest.approx(pf["rel_err"][3], abs=1e-12)
    # the HF runner: per sparse chunk, densities 1 (layer 0), then layer 1's three times
    g = H.generate(model, ids, mf, max_new_tokens=2, **kw)
    d = g.densities
    assert len(d) == 4 * 3
    for c in range(3):
        first, obs_d, *rest = d[4 * c:4 * c + 4]
        assert first == 1.0 and all(x == pytest.approx(obs_d, abs=1e-12) for x in rest) and obs_d < 1.0


def test_dense_layers_in_the_replay_the_hf_runner_and_the_server_flags(four_layers):
    """`dense_layers=3` (the server's --compact-dense-layers): layer 3 reads every page (density 1, no error) in
    the replay and the HF runner, the other layers select as without it; the server method gets the flag."""
    from harness.eval import hf_runner as H
    from harness.eval.methods import compact_server_args
    model, ids, layers = four_layers
    with_, without = "compact:flashprefill:alpha=0.8,dense_tail=0,dense_layers=3", "compact:flashprefill:alpha=0.8,dense_tail=0"
    mw, mo = F.parse_method(with_), F.parse_method(without)
    assert mw.dense_layers == (3,) and mw.selector_params == {"alpha": 0.8} and "dense_layers=3" in mw.label
    assert F.parse_method("compact:budget:dense_layers=2+5-7").dense_layers == (2, 5, 6, 7)
    with pytest.raises(ValueError, match="must be layers after 1"):
        F.parse_method("compact:budget:dense_layers=1-3")
    with pytest.raises(ValueError, match="dense_layers is a compact method's"):
        F.parse_method("blocksparse:flashprefill:dense_layers=3")
    args = compact_server_args(mw.selector, dict(mw.params), 64, 1, 1)
    assert args[args.index("--compact-dense-layers") + 1] == "3"
    assert "dense_layers" not in args[args.index("--compact-selector-params") + 1]
    kw = dict(chunk=CHUNK, page_size=PAGE, min_context=CHUNK, sink_blocks=1, recent_blocks=1)
    r = F.simulate(layers, [mw, mo], **kw)
    pw, po = r.per_layer[mw.label], r.per_layer[mo.label]
    assert pw["density"][3] == 1.0 and pw["rel_err"][3] == 0.0 and po["density"][3] < 1.0
    for k in ("density", "rel_err", "recall"):
        assert pw[k][:3] == po[k][:3]
    # the last layer's output reaches no layer's K/V within the prompt: layers 0-2 select as without it
    g = H.generate(model, ids, mw, max_new_tokens=2, **kw).densities
    o = H.generate(model, ids, mo, max_new_tokens=2, **kw).densities
    assert len(g) == len(o) == 4 * 3
    for c in range(3):
        assert g[4 * c + 3] == 1.0 and g[4 * c:4 * c + 3] == o[4 * c:4 * c + 3]


def test_dense_tail_in_the_replay_and_the_hf_runner(tiny):
    """`dense_tail` (default `CompactConfig.dense_tail` for compact/blocksparse, 0 for quoka): the windows holding
    any of the prompt's last `dense_tail` tokens read every page. With 64 of 300 tokens (windows of 64 tokens),
    windows from (300 - 64) // 64 = 3 on are dense: the chunk 192..256 is dense with it and sparse without (density
    1.0 and no error in the replay; SDPA, not recorded, in the HF runner)."""
    from harness.eval import hf_runner as H
    model, ids = tiny
    on, off = "compact:budget:density=0.3,dense_tail=64", "compact:budget:density=0.3,dense_tail=0"
    assert F.parse_method(on).dense_tail == 64 and F.parse_method(off).dense_tail == 0
    assert F.parse_method("compact:budget:density=0.3").dense_tail == F.CompactConfig.dense_tail
    assert F.parse_method("quoka").dense_tail == 0 and F.parse_method("quoka:dense_tail=32").dense_tail == 32
    with pytest.raises(ValueError, match="dense_tail must be an integer >= 0"):
        _ = F.parse_method("compact:budget:dense_tail=-1").dense_tail
    with pytest.raises(ValueError, match="replaced by dense_tail"):
        _ = F.parse_method("compact:budget:dense_final_chunk=1").dense_tail
    layers = F.capture_qkv(model, ids)
    r = F.simulate(layers, [on, off], chunk=CHUNK, page_size=PAGE, min_context=CHUNK, sink_blocks=1,
                   recent_blocks=1)
    assert r.compact_chunks == 3
    s_on = r.summary()["compact-budget(dense_tail=64,density=0.3)"]
    s_off = r.summary()["compact-budget(dense_tail=0,density=0.3)"]
    # budget densities depend on the lengths only: the third chunk is 1.0 against y < 1, the others the same
    assert 0 < s_on["density"] - s_off["density"] < 0.25
    assert s_on["rel_err"] < s_off["rel_err"] and s_on["recall"] > s_off["recall"]
    kw = dict(max_new_tokens=4, chunk=CHUNK, page_size=PAGE, min_context=CHUNK, sink_blocks=1, recent_blocks=1)
    g_on, g_off = H.generate(model, ids, on, **kw), H.generate(model, ids, off, **kw)
    # 2 layers x (2 sparse chunks on, 3 off); budget densities are those of the replay, without its dense chunk
    assert len(g_on.densities) == 4 and len(g_off.densities) == 6
    d_on = r.per_layer[F.parse_method(on).label]["density"][0]
    d_off = r.per_layer[F.parse_method(off).label]["density"][0]
    assert g_off.density == pytest.approx(d_off)
    assert g_on.density == pytest.approx((3 * d_on - 1.0) / 2)


def test_layer_density_in_method_specs_and_the_server_flags():
    """`layer_density` (budget, mass_budget) in a method spec: its items joined by '/' (',' separates the
    method's parameters), handed to the server in --compact-selector-params as the selector reads them."""
    import json

    from harness.eval.methods import compact_server_args
    m = F.parse_method("compact:mass_budget:density=0.2,layer_density=3:1.0/1:0.5")
    assert m.selector_params == {"density": 0.2, "layer_density": "3:1.0,1:0.5"}
    args = compact_server_args(m.selector, dict(m.params), 64, 1, 1)
    assert json.loads(args[args.index("--compact-selector-params") + 1]) == m.selector_params
    with pytest.raises(ValueError, match="layers:value"):
        F.parse_method("compact:budget:layer_density=3")
    with pytest.raises(ValueError, match="layer_density"):
        F.parse_method("compact:flashprefill:layer_density=3:0.5")     # not a flashprefill parameter


def test_accuracy_rows_record_the_share_the_server_runs_at_their_chunk():
    """A row of the default selector records the `density` a server with the row's chunk size keeps (0.33 from
    chunk 8192, `chunk_density`), so it pairs with a row that asked for that share by name; a share asked for
    alone is recorded as given."""
    from harness.eval.methods import compact_method_params

    def recorded(params, chunk):
        return compact_method_params("quest_budget", params, chunk=chunk, page_size=32, min_context=0,
                                     sink_blocks=2, recent_blocks=4)[1]

    assert recorded({}, 1024)["density"] == 0.25 and recorded({}, 8192)["density"] == 0.33
    assert recorded({}, 8192) == recorded({"density": 0.33}, 8192)
    assert recorded({"density": 0.2}, 8192)["density"] == 0.2
    assert recorded({"density": 0.2, "chunk_density": "8192:0.4"}, 8192)["density"] == 0.4   # what runs
    assert recorded({"density": 1}, 1024)["density"] == 1   # as given where it runs as given
    m = F.parse_method("compact:quest_budget")
    assert m.config(32, 2, 4, 0, 8192).params.density == 0.33 and m.config(32, 2, 4, 0, 1024).params.density == 0.25
