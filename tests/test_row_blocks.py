"""CompactAttention.row_blocks: the host-side row lengths that let fa3 plan once per forward pass
must equal what every layer's plan then contains, for any data."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st
import torch

from sglang_compact.compact import CompactAttention
from sglang_compact.config import CompactConfig
from sglang_compact.execute_flashinfer import upper_bound_rows
from sglang_compact.synthetic import random_batch

P = 16


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    density=st.sampled_from([0.01, 0.1, 0.3, 0.5, 0.999, 1.0]),
    cap=st.sampled_from([None, 0.05, 0.2, 0.6]),
    sink=st.integers(0, 3), recent=st.integers(1, 5),
    compact_bits=st.integers(0, 7), seed=st.integers(0, 10_000),
)
def test_budget_row_blocks_equal_the_planned_rows(prefix, density, cap, sink, recent, compact_bits, seed):
    assume(max(prefix) > 0)  # batches without any prefix never reach the paged path
    chunk = [17 + 13 * i for i in range(len(prefix))]
    b = random_batch(prefix, chunk, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=P, seed=seed,
                     structured=seed % 2 == 0)
    compact = [bool(compact_bits >> i & 1) and L > 0 for i, L in enumerate(prefix)]
    cfg = CompactConfig(block_size=P, selector="budget", selector_params={"density": density}, sink_blocks=sink,
                        recent_blocks=recent, min_prefix_len=0, density_cap=cap)
    ca = CompactAttention(cfg)
    rows = ca.row_blocks(prefix, compact)
    cp = ca.plan(b, compact_rows=torch.tensor(compact))
    assert cp.table.sum(-1).tolist() == [[r, r] for r in rows]
    # and the plan's own indptr is the one fa3 is planned with
    _, kv_indptr, _ = upper_bound_rows(prefix, chunk, 2, P, rows)
    assert torch.equal(cp.plan.kv_indptr.cpu(), kv_indptr)


def test_dense_rows_are_every_block_and_threshold_selectors_are_data_dependent():
    prefix = [100, 0, 33]
    assert CompactAttention(CompactConfig(block_size=P, selector="dense")).row_blocks(prefix, [True] * 3) == [7, 0, 3]
    fp = CompactAttention(CompactConfig(block_size=P, selector="flashprefill"))
    assert fp.row_blocks(prefix, [True, False, False]) is None
    assert fp.row_blocks(prefix, [False] * 3) == [7, 0, 3]  # no compact request: every block


def test_upper_bound_rows_with_row_blocks():
    qo, kv, last = upper_bound_rows([100, 40], [5, 3], 2, P, row_blocks=[3, 1])
    assert qo.tolist() == [0, 5, 8, 13, 16]
    assert kv.tolist() == [0, 3, 4, 7, 8]
    assert last.tolist() == [4, 8, 4, 8]
