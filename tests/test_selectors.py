"""Selectors: shapes, validity, and each one's defining rule checked against a direct computation."""

import math

import pytest
import torch

from sglang_compact.config import SELECTOR_NAMES, CompactConfig
from sglang_compact.selectors import make_selector, registered_selectors
from sglang_compact.selectors.base import pooled_keys_from_pool, valid_cells
from sglang_compact.selectors.oracle import block_attention_mass
from sglang_compact.selectors.xattention import antidiagonal_block_mass
from sglang_compact.summaries import PageSummaries
from sglang_compact.synthetic import random_batch

P = 16


def batch(seed=0, structured=True, prefix=(100, 37, 260), chunk=(40, 17, 33), hq=6, hkv=2, d=16):
    return random_batch(list(prefix), list(chunk), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P,
                        seed=seed, structured=structured)


def cfg(selector, **params):
    return CompactConfig(block_size=P, selector=selector, selector_params=params, sink_blocks=0, recent_blocks=1,
                         min_prefix_len=0)


def test_registry_has_every_configured_selector():
    assert set(registered_selectors()) == set(SELECTOR_NAMES)


@pytest.mark.parametrize("name", ["flashprefill", "xattention", "oracle", "dense", "budget"])
def test_masks_are_shaped_and_clipped(name):
    b = batch(1)
    sel = make_selector(cfg(name)).select(b)
    valid = valid_cells(b, P).expand_as(sel.mask)
    assert sel.mask.shape == (3, 6, 3, 17) and sel.mask.dtype == torch.bool
    assert not (sel.mask & ~valid).any()
    # every valid query block keeps at least one block
    assert (sel.mask.any(-1) | ~valid.any(-1)).all()


def test_dense_selects_every_valid_cell():
    b = batch(2)
    assert torch.equal(make_selector(cfg("dense")).select(b).mask, valid_cells(b, P).expand(3, 6, 3, 17))


def direct_flashprefill(b, alpha):
    """Loops over (request, head, query block): softmax over pooled keys, max over queries, threshold."""
    kbar = pooled_keys_from_pool(b)
    out = torch.zeros(3, 6, 3, 17, dtype=torch.bool)
    G = b.group_size
    start = 0
    for r, (L, C) in enumerate(zip(b.prefix_lens_cpu, b.chunk_lens_cpu)):
        n = math.ceil(L / P)
        for h in range(b.num_q_heads):
            for i in range(math.ceil(C / P)):
                q = b.q[start + i * P:start + min(C, (i + 1) * P), h]
                p = torch.softmax(q @ kbar[r, :n, h // G].T * b.sm_scale, dim=-1).amax(0)
                out[r, h, i, :n] = p >= alpha * p.max()
        start += C
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.06, 0.3, 0.9, 1.0])
def test_flashprefill_matches_direct_computation(alpha):
    b = batch(3)
    assert torch.equal(make_selector(cfg("flashprefill", alpha=alpha)).select(b).mask, direct_flashprefill(b, alpha))


def test_flashprefill_from_page_summaries_equals_from_pool():
    b = batch(4)
    pages, H, _, D = b.k_pool.shape
    s = PageSummaries(1, pages, H, D, P, "cpu")
    for r, L in enumerate(b.prefix_lens_cpu):
        for j in range(math.ceil(L / P)):
            page = int(b.page_table[r, j])
            n = min(P, L - j * P)
            s.update(0, page * P + torch.arange(n), b.k_pool[page, :, :n].transpose(0, 1))
    n_kv = b.max_kv_blocks
    pooled = s.pooled(0, b.page_table[:, :n_kv])
    torch.testing.assert_close(pooled * b.kv_block_valid()[:, :, None, None], pooled_keys_from_pool(b))
    sel = make_selector(cfg("flashprefill"))
    assert torch.equal(sel.select(b, 0, pooled).mask, sel.select(b).mask)


@pytest.mark.parametrize("density", [0.1, 0.3, 0.5, 1.0])
def test_budget_gives_the_requested_density_after_the_unions(density):
    from sglang_compact.union import union_table
    b = batch(5)
    c = cfg("budget", density=density)
    m = make_selector(c).select(b).mask
    table, counts = union_table(m, b.num_kv_heads, b.kv_blocks(), c.sink_blocks, c.recent_blocks)
    for r, L in enumerate(b.prefix_lens_cpu):
        n = math.ceil(L / P)
        want = max(1, math.ceil(density * n - 1e-9))
        nq = math.ceil(b.chunk_lens_cpu[r] / P)
        assert (m[r, :, :nq].sum(-1) == want).all()  # every query block and head: the same budget
        assert (counts[r] == want).all()             # so the union adds nothing (forced blocks rank first)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_oracle_is_the_smallest_set_reaching_top_p(top_p):
    b = batch(6)
    sel = make_selector(cfg("oracle", top_p=top_p)).select(b)
    mass, mask = sel.scores, sel.mask
    valid = valid_cells(b, P).expand_as(mass)
    total = mass.sum(-1)
    kept = (mass * mask).sum(-1)
    rows = valid.any(-1)
    assert (kept[rows] >= top_p * total[rows] - 1e-6).all()
    # dropping the least-massive kept block falls below top_p (minimality)
    smallest = mass.masked_fill(~mask, float("inf")).amin(-1)
    assert ((kept - smallest)[rows] < top_p * total[rows] + 1e-6).all()
    # mass per query block sums to 1 over the prefix
    torch.testing.assert_close(total[rows], torch.ones_like(total[rows]), rtol=1e-4, atol=1e-4)


def test_xattention_stride_one_is_the_exact_block_mass():
    b = batch(7)
    torch.testing.assert_close(antidiagonal_block_mass(b, P, 1), block_attention_mass(b, P), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stride", [2, 4, 8, 16])
def test_xattention_estimates_are_normalised(stride):
    b = batch(8)
    mass = antidiagonal_block_mass(b, P, stride)
    rows = valid_cells(b, P).expand_as(mass).any(-1)
    torch.testing.assert_close(mass.sum(-1)[rows], torch.ones(int(rows.sum())), rtol=1e-4, atol=1e-4)
    m = make_selector(cfg("xattention", stride=stride, threshold=0.9)).select(b).mask
    assert m.any(-1)[rows].all()


def test_threshold_selectors_find_the_planted_heavy_blocks():
    """On structured inputs the sink block and a few heavy blocks hold most of the mass.

    Pooled keys dilute the 4 sink tokens (that is what forced sink blocks are for),
    so recall is measured on the oracle's blocks after the sink block.
    """
    b = batch(9, prefix=(1024, 700), chunk=(64, 64), hq=4, hkv=2, d=32)
    oracle = make_selector(cfg("oracle", top_p=0.9)).select(b).mask[..., 1:]
    fp = make_selector(cfg("flashprefill", alpha=0.06)).select(b).mask[..., 1:]
    recall = (oracle & fp).sum() / oracle.sum()
    assert oracle.sum() > 0 and recall > 0.9
    assert fp.float().mean() < 0.7  # and it is actually sparse


def seer_weights(tmp_path, b, layers=2, d_g=8, seed=0):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    w = {}
    for layer in range(layers):
        w[f"layers.{layer}.q_gate.weight"] = torch.randn(b.num_q_heads, b.head_dim, d_g, generator=g)
        w[f"layers.{layer}.k_gate.weight"] = torch.randn(b.num_kv_heads, 3 * b.head_dim, d_g, generator=g)
    path = tmp_path / "gates.safetensors"
    save_file(w, str(path))
    return str(path)


def test_seer_with_random_gate_weights(tmp_path):
    b = batch(10)
    sel = make_selector(cfg("seer", gate_path=seer_weights(tmp_path, b), threshold=0.8))
    s0, s1 = sel.select(b, layer=0), sel.select(b, layer=1)
    valid = valid_cells(b, P).expand_as(s0.mask)
    rows = valid.any(-1)
    assert not (s0.mask & ~valid).any() and s0.mask.any(-1)[rows].all()
    torch.testing.assert_close(s0.scores.sum(-1)[rows], torch.ones(int(rows.sum())), rtol=1e-4, atol=1e-4)
    assert not torch.equal(s0.scores, s1.scores)  # per-layer weights are used
    with pytest.raises(ValueError, match="missing"):
        sel.select(b, layer=5)


def test_seer_rejects_bad_weights(tmp_path):
    b = batch(11)
    other = batch(11, hq=4, hkv=2)
    sel = make_selector(cfg("seer", gate_path=seer_weights(tmp_path, other)))
    with pytest.raises(ValueError, match="shapes"):
        sel.select(b)
    with pytest.raises(ValueError, match="not found"):
        make_selector(cfg("seer", gate_path=str(tmp_path / "none.safetensors")))
