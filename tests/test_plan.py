"""Plan: the paged metadata describes exactly the union table; Triton kernel == torch reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _cases import random_union_case
from sglang_compact.kernels import plan as plan_triton
from sglang_compact.kernels import plan_naive, union_naive
from sglang_compact.plan import PlanBuffers, build_plan


def check_plan_describes_table(c, table, counts, H_kv, P, plan):
    qo, kvp, kvi, lpl = (x.tolist() for x in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len))
    B = len(c["prefix"])
    T = sum(c["chunk"])
    assert len(qo) == len(kvp) == B * H_kv + 1 and len(lpl) == B * H_kv
    assert qo[-1] == H_kv * T and kvp[0] == 0 and kvp[-1] == int(counts.sum())
    for g in range(H_kv):
        for b in range(B):
            r = g * B + b
            cs = int(c["cu_chunk"][b])
            assert qo[r] == g * T + cs and qo[r + 1] - qo[r] == c["chunk"][b]
            js = table[b, g].nonzero().flatten().tolist()
            assert kvi[kvp[r]:kvp[r + 1]] == [int(c["page_table"][b, j]) * H_kv + g for j in js]
            # tokens the row reads == sum of the selected blocks' token counts
            L = c["prefix"][b]
            want = sum(min(P, L - j * P) for j in js)
            got = (len(js) - 1) * P + lpl[r] if js else 0
            assert got == want and (lpl[r] == 0) == (not js)


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 4), st.integers(1, 8),
       st.sampled_from([16, 32, 64, 128]), st.integers(0, 3), st.integers(1, 3))
def test_reference_plan_describes_table(seed, B, H_kv, G, P, sink, recent):
    c = random_union_case(seed, B, H_kv, G, P, max_blocks=15, density=0.25)
    table, counts = union_naive.union_table(c["mask"], H_kv, c["kv_blocks"], sink, recent)
    plan = build_plan(table, counts, c["page_table"], c["prefix_lens"], c["cu_chunk"], P, use_triton=False)
    check_plan_describes_table(c, table, counts, H_kv, P, plan)


def test_empty_rows_and_unselected_last_block():
    # recent_blocks is >= 1 in every config, but the plan itself must handle any table
    c = random_union_case(3, 2, 2, 2, 16, max_blocks=6, density=0.0)
    table = torch.zeros(2, 2, c["page_table"].shape[1], dtype=torch.bool)
    if c["n_kv"][0]:
        table[0, 0, 0] = True
    counts = table.sum(-1, dtype=torch.int32)
    for use_triton in (False, True):
        plan = build_plan(table, counts, c["page_table"], c["prefix_lens"], c["cu_chunk"], 16, use_triton=use_triton)
        check_plan_describes_table(c, table, counts, 2, 16, plan)


@pytest.mark.parametrize("seed", range(40))
def test_triton_plan_equals_reference(seed):
    g = torch.Generator().manual_seed(2000 + seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    B, H_kv, G, P = pick(1, 4), pick(1, 4), pick(1, 8), [16, 32, 64, 128][pick(0, 3)]
    c = random_union_case(seed, B, H_kv, G, P, max_blocks=pick(1, 50), density=0.1)
    table, counts = union_naive.union_table(c["mask"], H_kv, c["kv_blocks"], pick(0, 2), pick(1, 3))
    ref = plan_naive.build_plan(table, counts, c["page_table"], c["prefix_lens"], c["cu_chunk"], P)
    bufs = PlanBuffers(B * H_kv + 3, B * H_kv * table.shape[-1] + 7, "cpu")
    bufs.kv_indices.fill_(-7)
    tri = plan_triton.build_plan(table, counts, c["page_table"], c["prefix_lens"], c["cu_chunk"], P,
                                 out=(bufs.qo_indptr, bufs.kv_indptr, bufs.kv_indices, bufs.kv_last_page_len))
    n = int(ref[1][-1])
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1]) and torch.equal(ref[3], tri[3])
    assert torch.equal(ref[2], tri[2][:n])
    assert (tri[2][n:] == -7).all()  # nothing written past the plan


def test_buffers_too_small_raise():
    c = random_union_case(1, 2, 2, 1, 16, max_blocks=8, density=0.5)
    table, counts = union_naive.union_table(c["mask"], 2, c["kv_blocks"], 0, 1)
    with pytest.raises(ValueError, match="buffers hold"):
        build_plan(table, counts, c["page_table"], c["prefix_lens"], c["cu_chunk"], 16,
                   buffers=PlanBuffers(1, 1, "cpu"), use_triton=True)
