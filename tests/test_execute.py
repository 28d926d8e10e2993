"""Executors: reference == float64 masked dense; paged torch executor == reference; pipeline wiring."""

import math

import pytest
import torch

from sglang_compact.compact import CompactAttention, apply_density_cap
from sglang_compact.config import CompactConfig
from sglang_compact.execute import TorchPagedExecutor, merge_states, reference_attention
from sglang_compact.kernels import union_naive
from sglang_compact.plan import build_plan
from sglang_compact.quoka import quoka_attention, quoka_token_mask
from sglang_compact.synthetic import random_batch
from sglang_compact.union import forced_blocks


def make(seed, P=16, prefix=(100, 0, 333, 48), chunk=(40, 20, 17, 64), hq=8, hkv=2, d=32, **kw):
    return random_batch(list(prefix), list(chunk), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P,
                        seed=seed, **kw)


def float64_masked_dense(b, allowed_prefix):
    """allowed_prefix(r, h, t, s) -> bool tensor [H_q, C, L]; plain softmax over [prefix; chunk] in float64."""
    out = torch.empty(b.q.shape, dtype=torch.float64)
    P, G = b.page_size, b.group_size
    start = 0
    for r, (L, C) in enumerate(zip(b.prefix_lens_cpu, b.chunk_lens_cpu)):
        n = math.ceil(L / P)
        pages = b.page_table[r, :n].long()
        kp = b.k_pool[pages].permute(1, 0, 2, 3).reshape(b.num_kv_heads, n * P, b.head_dim)[:, :L]
        vp = b.v_pool[pages].permute(1, 0, 2, 3).reshape(b.num_kv_heads, n * P, b.head_dim)[:, :L]
        k = torch.cat([kp, b.k_chunk[start:start + C].transpose(0, 1)], 1).double().repeat_interleave(G, 0)
        v = torch.cat([vp, b.v_chunk[start:start + C].transpose(0, 1)], 1).double().repeat_interleave(G, 0)
        q = b.q[start:start + C].transpose(0, 1).double()
        allowed = torch.cat([allowed_prefix(r, L, C), torch.ones(C, C, dtype=torch.bool).tril().expand(q.shape[0], C, C)], 2)
        s = (q @ k.transpose(1, 2) * b.sm_scale).masked_fill(~allowed, float("-inf"))
        out[start:start + C] = (torch.softmax(s, -1) @ v).transpose(0, 1)
        start += C
    return out


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("seed", range(6))
def test_reference_equals_float64_masked_dense(seed):
    b = make(seed)
    g = torch.Generator().manual_seed(seed)
    NQ, NKV = b.max_q_blocks(16), b.max_kv_blocks
    block_mask = torch.rand(4, 8, NQ, NKV, generator=g) < 0.3
    table = torch.rand(4, 2, NKV, generator=g) < 0.4
    token_mask = torch.rand(4, 2, NKV * 16, generator=g) < 0.3
    cases = {
        "block": (dict(block_mask=block_mask), lambda r, L, C: block_mask[r][:, torch.arange(C) // 16][:, :, torch.arange(L) // 16]),
        "table": (dict(table=table), lambda r, L, C: table[r].repeat_interleave(4, 0)[:, torch.arange(L) // 16][:, None].expand(8, C, L)),
        "token": (dict(token_mask=token_mask), lambda r, L, C: token_mask[r].repeat_interleave(4, 0)[:, None, :L].expand(8, C, L)),
    }
    for name, (kw, allowed) in cases.items():
        got = reference_attention(b, **kw)
        want = float64_masked_dense(b, allowed)
        assert (got.double() - want).abs().max().item() <= 1e-5, name


def test_dense_selector_is_plain_causal_attention_over_prefix_and_chunk():
    b = make(11)
    cfg = CompactConfig(block_size=16, selector="dense", min_prefix_len=0, sink_blocks=0, recent_blocks=1)
    out, cp = CompactAttention(cfg).forward(b)
    want = float64_masked_dense(b, lambda r, L, C: torch.ones(8, C, L, dtype=torch.bool))
    assert (out.double() - want).abs().max().item() <= 1e-5
    assert cp.stats.as_floats() == {"selected": 1.0, "after_q": 1.0, "after_group": 1.0}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("selector", ["flashprefill", "oracle", "xattention", "budget", "dense"])
def test_paged_executor_equals_reference_on_the_union_table(seed, selector):
    P = [16, 32][seed % 2]
    b = make(seed, P=P, prefix=(3 * P + 5, 0, 9 * P + 1, P), chunk=(P + 3, 7, 2 * P, 1), hq=[4, 8, 6, 9][seed % 4],
             hkv=[1, 2, 3, 3][seed % 4], structured=True)
    cfg = CompactConfig(block_size=P, selector=selector, min_prefix_len=0, sink_blocks=1, recent_blocks=1)
    ca = CompactAttention(cfg)
    out, cp = ca.forward(b)
    ref = reference_attention(b, table=cp.table)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # and the table covers the selector's own mask (CompactAttention never drops a selected block)
    sel = ca.select(b)
    covered = cp.table.repeat_interleave(b.group_size, 1)[:, :, None, :]
    assert not (sel.mask & ~covered).any()


def test_bf16_paged_executor_close_to_float32_reference():
    b32 = make(21, structured=True)
    b16 = make(21, structured=True, dtype=torch.bfloat16)
    cfg = CompactConfig(block_size=16, selector="flashprefill", min_prefix_len=0)
    out, cp = CompactAttention(cfg).forward(b16)
    ref = reference_attention(b32, table=cp.table)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2


def test_density_cap_limits_rows_and_keeps_forced_blocks():
    b = make(31, prefix=(640, 400), chunk=(32, 32), structured=True)
    base = CompactConfig(block_size=16, selector="flashprefill", selector_params={"alpha": 0.0}, min_prefix_len=0,
                         sink_blocks=1, recent_blocks=2)
    full = CompactAttention(base).plan(b)
    assert full.table[0].all()  # alpha 0 keeps everything
    capped = CompactAttention(base.replace(density_cap=0.25)).plan(b)
    n = torch.tensor([40, 25])
    counts = capped.table.sum(-1)
    assert (counts == torch.ceil(n * 0.25).long()[:, None]).all()
    forced = forced_blocks(n, 40, 1, 2)
    assert capped.table[forced[:, None, :].expand_as(capped.table)].all()


def test_apply_density_cap_ranks_by_best_score():
    table = torch.ones(1, 1, 6, dtype=torch.bool)
    scores = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3, 0.0]).reshape(1, 1, 1, 6)
    t = apply_density_cap(table, scores, torch.tensor([6]), 0.5, sink_blocks=0, recent_blocks=1, max_blocks=6)
    assert t[0, 0].tolist() == [False, True, False, True, False, True]


def test_rows_below_threshold_are_dense():
    b = make(41, prefix=(600, 100), chunk=(32, 32), structured=True)
    cfg = CompactConfig(block_size=16, selector="budget", selector_params={"density": 0.2}, min_prefix_len=200,
                        sink_blocks=0, recent_blocks=1)
    compact_rows = torch.tensor([cfg.uses_compact_path(L) for L in b.prefix_lens_cpu])
    cp = CompactAttention(cfg).plan(b, compact_rows=compact_rows)
    assert cp.table[1, :, :7].all() and not cp.table[0].all()


def test_block_size_must_match_page_size():
    b = make(1)
    with pytest.raises(ValueError, match="page size"):
        CompactAttention(CompactConfig(block_size=32, min_prefix_len=0)).plan(b)


def test_merge_states_handles_empty_sides():
    o = torch.randn(3, 2, 4)
    lse = torch.randn(3, 2)
    empty = torch.full((3, 2), float("-inf"))
    m, l = merge_states(o, lse, torch.zeros_like(o), empty)
    torch.testing.assert_close(m, o)
    torch.testing.assert_close(l, lse)
    m, l = merge_states(o, lse, o * 2, lse)
    torch.testing.assert_close(m, o * 1.5)
    torch.testing.assert_close(l, lse + math.log(2))


def test_torch_paged_executor_matches_hand_plan():
    b = make(51, prefix=(40,), chunk=(5,), hq=2, hkv=1)
    table = torch.tensor([[[True, False, True]]])
    table_t, counts = union_naive.union_table(table[:, :, None, :].repeat(1, 2, 1, 1), 1, b.kv_blocks(), 0, 1)
    plan = build_plan(table_t, counts, b.page_table, b.prefix_lens, b.cu_chunk, 16)
    assert plan.kv_last_page_len.tolist() == [8]  # 40 = 16 + 16 + 8
    out = TorchPagedExecutor().run(b, plan)
    torch.testing.assert_close(out, reference_attention(b, table=table_t))


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5])
def test_quoka_baseline(budget):
    b = make(61, structured=True)
    mask = quoka_token_mask(b, 0.25, budget)
    for r, L in enumerate(b.prefix_lens_cpu):
        want = max(1, math.ceil(budget * L - 1e-9)) if L else 0
        assert (mask[r].sum(-1) == want).all() and not mask[r, :, L:].any()
    out, m2 = quoka_attention(b, 0.25, budget)
    assert torch.equal(mask, m2)
    torch.testing.assert_close(out, reference_attention(b, token_mask=mask))
    with pytest.raises(ValueError):
        quoka_token_mask(b, 0.0, 0.25)
