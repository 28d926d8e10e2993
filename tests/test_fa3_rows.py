"""The sparse rows on sgl_kernel's FA3 (`executors/sgl_fa3.FA3Rows`) without a GPU: the rows' queries, page tables,
lengths and the pool's view that it hands FA3's paged call, checked through a plain-torch twin of that call's
contract (paged KV through a page table, varlen queries, the causal mask aligned bottom-right) against the
plain-torch reference attention of the selection. Bit equality with FA3 itself is checked on the GPU
(tests/test_gpu_core.py)."""

import dataclasses

import pytest
import torch

from harness.synthetic import batch_summaries, random_batch
from sglang_compact.batch import cdiv
from sglang_compact.compact import CompactAttention
from sglang_compact.config import CompactConfig
from sglang_compact.executors import ForwardShape, reference_attention
from sglang_compact.executors.sgl_fa3 import FA3Rows


def paged_twin(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale, causal, cu_seqlens_q=None,
               max_seqlen_q=None, out=None):
    """flash_attn_with_kvcache's contract in plain torch: q [total_q, H, D] in varlen rows (cu_seqlens_q), or
    [B, S, H, D] in a batch of rows of S queries each, any strides but the last; k/v_cache [blocks, page, H_kv, D],
    row b's keys the first cache_seqlens[b] tokens of its pages page_table[b], query i of a row of n seeing the
    keys up to cache_seqlens[b] - n + i; written into `out` (q's shape) when given."""
    assert causal and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and page_table.dtype == torch.int32
    P, H_kv = k_cache.shape[1], k_cache.shape[2]
    batched = cu_seqlens_q is None
    if batched:   # rows of S queries: the twin of that call is the varlen one over q's rows stacked
        B, S = q.shape[:2]
        o = paged_twin(q.reshape(B * S, *q.shape[2:]), k_cache, v_cache, page_table, cache_seqlens, softmax_scale,
                       causal, torch.arange(0, B * S + 1, S), S)
        if out is None:
            return o.view(q.shape)
        assert out.shape == q.shape and out.stride(-1) == 1
        out.copy_(o.view(q.shape))
        return out
    out = torch.empty_like(q) if out is None else out
    for b in range(page_table.shape[0]):
        lo, hi, L = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cache_seqlens[b])
        assert hi - lo <= max_seqlen_q
        pages = page_table[b, :cdiv(L, P)].long()
        k = k_cache[pages].reshape(-1, H_kv, k_cache.shape[-1])[:L].float()
        v = v_cache[pages].reshape(-1, H_kv, v_cache.shape[-1])[:L].float()
        G = q.shape[1] // H_kv
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * softmax_scale
        n = hi - lo
        seen = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
        s = s.masked_fill(~seen[None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("selector,params", [("flashprefill", {"alpha": 0.1}), ("quest_budget", {"density": 0.3})])
def test_fa3_rows_hand_fa3_each_rows_pages_and_queries(seed, selector, params):
    # prefixes not page aligned, a second request whose last windows are dense (computed apart by the executor:
    # its rows name their own pages only, so their output here is not the reference's and is left out)
    b = random_batch([2100 + 13 * seed, 1500], [700, 333], num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=16,
                     seed=seed, structured=True, sparse_ranges=[(0, 1 << 40), (0, 1)], window_pages=16)
    assert b.qblocks.any_sparse
    ca = CompactAttention(CompactConfig(block_size=16, selector=selector, selector_params=params))
    shape = ForwardShape.of(b)
    sel = ca.select_pages(b, 3, batch_summaries(b), with_stats=True)
    R, qb = shape.num_rows, shape.qblocks
    width = max(qb.rows_bound())
    table = torch.full((R * width + 5,), -1, dtype=torch.int32)
    rows = FA3Rows(shape, qb.rows_qo_indptr(shape.num_kv_heads, shape.total_tokens),
                   qb.last_page_len() * shape.num_kv_heads, table, torch.zeros(R, dtype=torch.int32), "cpu",
                   paged=paged_twin)
    out = rows.run(b.q, b.k_pool, b.v_pool, sel.indices)
    given = torch.full_like(out, float("nan"))   # SGLang's output buffer: the rows are written into it
    assert rows.run(b.q, b.k_pool, b.v_pool, sel.indices, out=given) is given and torch.equal(given, out)
    want = reference_attention(b, sel.table)
    keep = torch.zeros(b.q.shape[0], dtype=torch.bool)
    for w, (st, n) in enumerate(zip(qb.w_start, qb.w_length)):
        keep[st:st + n] = not qb.dense_apart[w]
    assert keep.any()
    torch.testing.assert_close(out[keep], want[keep], atol=2e-5, rtol=2e-5)
    counts = (sel.indices.kv_indptr[1:] - sel.indices.kv_indptr[:-1]).tolist()
    assert rows.seqlens.tolist() == [(c - 1) * 16 + last for c, last in zip(counts, rows.last_page_len.tolist())]


@pytest.mark.parametrize("selector,params", [("flashprefill", {"alpha": 0.1}), ("quest_budget", {"density": 0.3})])
@pytest.mark.parametrize("prefix,chunk", [(2048, 256), (2048 + 37, 200)])
def test_a_pass_of_one_window_hands_fa3_the_tokens_own_layout(selector, params, prefix, chunk):
    # one request whose chunk lies in one window (256 tokens here): one row per kv head, FA3's batch call over
    # strided views of the queries and the output, no copy between the layouts; a query tensor sliced from a
    # wider one (the model's fused qkv) keeps its row stride
    b = random_batch([prefix], [chunk], num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=16, seed=prefix,
                     structured=True, window_pages=16)
    assert b.qblocks.windows == 1 and b.qblocks.any_sparse
    qkv = torch.cat([b.q, torch.randn(chunk, 4, 16)], dim=1)
    b = dataclasses.replace(b, q=qkv[:, :6])
    assert not b.q.is_contiguous()
    ca = CompactAttention(CompactConfig(block_size=16, selector=selector, selector_params=params))
    shape = ForwardShape.of(b)
    sel = ca.select_pages(b, 3, batch_summaries(b), with_stats=True)
    R, qb = shape.num_rows, shape.qblocks
    calls = []

    def recording(**kw):
        calls.append(kw)
        return paged_twin(**kw)
    rows = FA3Rows(shape, qb.rows_qo_indptr(shape.num_kv_heads, shape.total_tokens),
                   qb.last_page_len() * shape.num_kv_heads, torch.zeros(R * max(qb.rows_bound()), dtype=torch.int32),
                   torch.zeros(R, dtype=torch.int32), "cpu", paged=recording)
    out = rows.run(b.q, b.k_pool, b.v_pool, sel.indices)
    (call,) = calls
    assert call["q"].shape == (2, chunk, 3, 16) and call["q"].data_ptr() == b.q.data_ptr()
    assert call["out"].data_ptr() == out.data_ptr() and "cu_seqlens_q" not in call
    torch.testing.assert_close(out, reference_attention(b, sel.table), atol=2e-5, rtol=2e-5)
    # into SGLang's output buffer: FA3 writes there itself
    given = torch.full_like(out, float("nan"))
    assert rows.run(b.q, b.k_pool, b.v_pool, sel.indices, out=given) is given and torch.equal(given, out)
    assert calls[-1]["out"].data_ptr() == given.data_ptr()


def test_the_ab_script_switches_the_one_window_call_it_names():
    # scripts/gpu/one_window_ab.sh times the varlen rows by rewriting this line in the GPU host's copy: the line
    # it looks for must be the source's, once
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "scripts/gpu/one_window_ab.sh").read_text()
    line = re.search(r"^ONE='(.*)'$", script, re.M).group(1)
    assert (root / "sglang_compact/executors/sgl_fa3.py").read_text().count(line) == 1
