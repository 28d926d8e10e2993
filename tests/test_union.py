"""Block union: coverage, minimality, forced blocks, stats; Triton kernel == torch reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _cases import random_union_case
from sglang_compact.kernels import union as union_triton
from sglang_compact.kernels import union_naive
from sglang_compact.union import block_union, forced_blocks, union_stats, union_table

case_params = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1),
    "B": st.integers(1, 4),
    "H_kv": st.integers(1, 4),
    "G": st.integers(1, 8),
    "P": st.sampled_from([16, 32, 64, 128]),
    "max_blocks": st.integers(1, 20),
    "density": st.floats(0.0, 0.6),
    "sink": st.integers(0, 3),
    "recent": st.integers(1, 3),
})


@settings(max_examples=2000, deadline=None)
@given(case_params)
def test_union_covers_exactly_the_selected_and_forced_blocks(p):
    c = random_union_case(p["seed"], p["B"], p["H_kv"], p["G"], p["P"], p["max_blocks"], p["density"])
    mask, n_kv, G = c["mask"], c["n_kv"], p["G"]
    table, counts = union_table(mask, p["H_kv"], c["kv_blocks"], p["sink"], p["recent"])
    B, H_q, NQ, NKV = mask.shape
    assert table.shape == (B, p["H_kv"], NKV) and table.dtype == torch.bool
    assert torch.equal(counts, table.sum(-1, dtype=torch.int32))
    forced = forced_blocks(c["kv_blocks"], NKV, p["sink"], p["recent"])
    valid_j = torch.arange(NKV)[None, :] < c["kv_blocks"][:, None]
    # coverage: every valid selected (b, h, i, j) is in row (b, h // G)
    sel = mask & valid_j[:, None, None, :]
    b_idx, h_idx, _, j_idx = sel.nonzero(as_tuple=True)
    assert table[b_idx, h_idx // G, j_idx].all()
    assert table[forced[:, None, :].expand_as(table)].all()
    # minimality: anything in the table was selected by a head of its group, or forced
    chosen = mask.reshape(B, p["H_kv"], -1, NKV).any(2)
    assert not (table & ~(chosen | forced[:, None, :])).any()
    assert not (table & ~valid_j[:, None, :]).any()
    # the public entry point is the same union before forcing/clipping
    pub = block_union(mask, p["H_kv"], forced=forced)
    assert torch.equal(pub & valid_j[:, None, :], table)
    valid_i = torch.arange(NQ)[None, :] < c["q_blocks"][:, None]
    s = union_stats(sel & valid_i[:, None, :, None], table, c["kv_blocks"], c["q_blocks"])
    if sum(n_kv):
        assert float(s.selected) <= float(s.after_q) + 1e-12 <= float(s.after_group) + 2e-12 <= 1 + 3e-12


def test_block_union_examples():
    m = torch.zeros(1, 4, 2, 5, dtype=torch.bool)
    m[0, 0, 0, 1] = True   # group 0
    m[0, 1, 1, 3] = True   # group 0
    m[0, 3, 1, 4] = True   # group 1
    t = block_union(m, 2)
    assert t.tolist() == [[[False, True, False, True, False], [False, False, False, False, True]]]
    t = block_union(m, 2, forced=torch.tensor([[True, False, False, False, False]]))
    assert t[0, :, 0].all()
    with pytest.raises(ValueError, match="multiple"):
        block_union(m, 3)
    with pytest.raises(ValueError, match="bool"):
        block_union(m.to(torch.int8), 2)


def test_stats_values():
    m = torch.zeros(1, 2, 2, 4, dtype=torch.bool)
    m[0, 0, 0, 0] = True
    m[0, 0, 1, 1] = True
    t, _ = union_naive.union_table(m, 1, torch.tensor([4]), 0, 1)
    s = union_stats(m, t, torch.tensor([4]), torch.tensor([2])).as_floats()
    assert s["selected"] == pytest.approx(2 / 2 / (4 * 2))   # one block per q block, head 0 only
    assert s["after_q"] == pytest.approx(2 / 8)
    assert s["after_group"] == pytest.approx(3 / 4)          # blocks 0, 1 and the recent block 3


@pytest.mark.parametrize("seed", range(40))
def test_triton_union_equals_reference(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    B, H_kv, G, P = pick(1, 3), pick(1, 3), pick(1, 8), [16, 32, 64, 128][pick(0, 3)]
    c = random_union_case(seed, B, H_kv, G, P, max_blocks=pick(1, 40), density=0.15)
    sink, recent = pick(0, 2), pick(1, 3)
    ref_t, ref_c = union_naive.union_table(c["mask"], H_kv, c["kv_blocks"], sink, recent)
    tri_t, tri_c = union_triton.union_table(c["mask"], H_kv, c["kv_blocks"], sink, recent)
    assert torch.equal(ref_t, tri_t) and torch.equal(ref_c, tri_c)
