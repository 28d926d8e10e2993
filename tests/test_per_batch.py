"""The per-layer hot path does per-batch work once: derived length tensors shared by the layers'
copies of a batch, row selections (`budget`, `dense`) kept as rows, densities only when asked for.
Each shortcut must give exactly what the long way gives."""

import dataclasses
import os
import random

import pytest
import torch

from sglang_compact.compact import CompactAttention
from sglang_compact.config import CompactConfig
from sglang_compact.kernels import union as union_kernel
from sglang_compact.kernels import union_naive
from sglang_compact.selectors.base import Selection, row_budget, top_blocks_per_row, valid_cells
from sglang_compact.synthetic import random_batch

P = 16


def batch(seed, prefix=(100, 37, 260), chunk=(40, 17, 33), hq=6, hkv=2):
    return random_batch(list(prefix), list(chunk), num_q_heads=hq, num_kv_heads=hkv, head_dim=16, page_size=P,
                        seed=seed, structured=True)


def cfg(selector, **kw):
    params = kw.pop("params", {})
    return CompactConfig(block_size=P, selector=selector, selector_params=params, sink_blocks=1, recent_blocks=1,
                         min_prefix_len=0, **kw)


def test_derived_tensors_are_shared_by_layer_copies_and_follow_new_lengths():
    b = batch(0)
    layer = dataclasses.replace(b, q=b.q.clone())
    assert layer.kv_blocks() is b.kv_blocks() and layer.valid_cells(P) is b.valid_cells(P)
    assert torch.equal(b.kv_blocks(), torch.tensor([7, 3, 17], dtype=torch.int32))
    assert torch.equal(b.q_blocks(P), torch.tensor([3, 2, 3], dtype=torch.int32))
    # new lengths (a different batch built from the same store) never see the old values
    other = dataclasses.replace(b, prefix_lens=torch.tensor([16, 16, 16], dtype=torch.int32),
                                prefix_lens_cpu=[16, 16, 16])
    assert torch.equal(other.kv_blocks(), torch.tensor([1, 1, 1], dtype=torch.int32))
    assert other.kv_block_valid().shape == (3, 1) and other.kv_block_valid().all()
    assert torch.equal(b.kv_blocks(), torch.tensor([7, 3, 17], dtype=torch.int32))


def test_valid_cells_match_their_definition():
    b = batch(1)
    q = torch.arange(b.max_q_blocks(P))[None, :] < torch.tensor([3, 2, 3])[:, None]
    kv = torch.arange(b.max_kv_blocks)[None, :] < torch.tensor([7, 3, 17])[:, None]
    assert torch.equal(valid_cells(b, P), (q[:, :, None] & kv[:, None, :])[:, None])


def long_way_top_blocks(row_scores, kv_blocks, fraction, sink, recent):
    """`top_blocks_per_row` by sorting each row in Python (forced first, then by score)."""
    B, H, NKV = row_scores.shape
    out = torch.zeros(B, H, NKV, dtype=torch.bool)
    for b in range(B):
        n = int(kv_blocks[b])
        forced = {j for j in range(n) if j < sink or j >= n - recent}
        k = row_budget(n, fraction, sink, recent)
        for h in range(H):
            order = sorted(range(n), key=lambda j: (j not in forced, -float(row_scores[b, h, j])))
            out[b, h, order[:k]] = True
    return out


@pytest.mark.parametrize("seed", [random.randrange(10**6) for _ in range(3)])
@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.55, 1.0])
def test_top_blocks_with_the_batch_store_equal_the_long_way(seed, fraction):
    b = batch(seed % 97)
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(3, 2, b.max_kv_blocks, generator=g)  # distinct scores: one right answer
    fresh = top_blocks_per_row(scores, b.kv_blocks(), b.max_kv_blocks, fraction, 1, 1)
    first = top_blocks_per_row(scores, b.kv_blocks(), b.max_kv_blocks, fraction, 1, 1, batch=b)
    layer = dataclasses.replace(b, q=b.q.clone())
    scores2 = torch.rand(3, 2, b.max_kv_blocks, generator=g)
    second = top_blocks_per_row(scores2, layer.kv_blocks(), layer.max_kv_blocks, fraction, 1, 1, batch=layer)
    assert torch.equal(fresh, first)
    assert torch.equal(first, long_way_top_blocks(scores, b.kv_blocks(), fraction, 1, 1))
    assert torch.equal(second, long_way_top_blocks(scores2, b.kv_blocks(), fraction, 1, 1))


def test_row_selection_mask_is_derived_on_demand():
    b = batch(2)
    rows = torch.rand(3, 2, b.max_kv_blocks) < 0.4
    rows &= b.kv_block_valid()[:, None, :]
    sel = Selection(rows=rows, valid=valid_cells(b, P), group_size=3)
    assert sel._mask is None
    want = rows.repeat_interleave(3, dim=1)[:, :, None, :] & valid_cells(b, P)
    assert torch.equal(sel.mask, want)
    sel.rows = torch.zeros_like(rows)
    assert not sel.mask.any()
    with pytest.raises(ValueError, match="exactly one"):
        Selection()
    with pytest.raises(ValueError, match="needs valid"):
        Selection(rows=rows)
    with pytest.raises(ValueError, match="is a mask"):
        Selection(mask=want).rows = rows


@pytest.mark.parametrize("seed", [random.randrange(10**6) for _ in range(3)])
def test_union_of_rows_equals_union_of_their_mask(seed):
    b = batch(seed % 89)
    rows = (torch.rand(3, 2, b.max_kv_blocks, generator=torch.Generator().manual_seed(seed)) < 0.3)
    rows &= b.kv_block_valid()[:, None, :]
    sel = Selection(rows=rows, valid=valid_cells(b, P), group_size=3)
    want = union_naive.union_table(sel.mask, 2, b.kv_blocks(), 1, 1)
    got = union_naive.union_table(rows[:, :, None, :], 2, b.kv_blocks(), 1, 1)
    assert all(torch.equal(x, y) for x, y in zip(want, got))
    if os.environ.get("TRITON_INTERPRET") == "1":
        tri = union_kernel.union_table(rows[:, :, None, :], 2, b.kv_blocks(), 1, 1)
        assert all(torch.equal(x, y) for x, y in zip(want, tri))


@pytest.mark.parametrize("selector,params", [("budget", {"density": 0.3}), ("dense", {}),
                                             ("flashprefill", {"alpha": 0.1})])
def test_plan_without_stats_is_the_same_plan(selector, params):
    ca = CompactAttention(cfg(selector, params=params))
    b = batch(3)
    with_stats = ca.plan(b, 0)
    without = ca.plan(dataclasses.replace(b, q=b.q.clone()), 0, with_stats=False)
    assert without.stats is None and with_stats.stats is not None
    assert torch.equal(with_stats.table, without.table)
    for f in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
        assert torch.equal(getattr(with_stats.plan, f), getattr(without.plan, f))
    n = int(with_stats.plan.kv_indptr[-1])
    assert torch.equal(with_stats.plan.kv_indices[:n], without.plan.kv_indices[:n])


def test_budget_rows_with_requests_off_the_compact_path():
    ca = CompactAttention(cfg("budget", params={"density": 0.2}))
    b = batch(4)
    compact_rows = torch.tensor([True, False, True])
    cp = ca.plan(b, 0, compact_rows=compact_rows)
    assert cp.table[1].sum(-1).tolist() == [3, 3]          # every prefix block of request 1
    assert cp.table[0].sum(-1).tolist() == [2, 2]          # ceil(0.2 * 7) = 2 (sink + recent)
    assert cp.table[2].sum(-1).tolist() == [4, 4]          # ceil(0.2 * 17) = 4
    assert torch.equal(ca.plan(b, 0).table[[0, 2]], cp.table[[0, 2]])
