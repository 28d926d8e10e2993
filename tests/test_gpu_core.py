"""GPU checks of the core engine (H200): the FlashInfer executors against the plain-torch reference,
plans made once per forward pass against fresh ones, no-sync index building, and every Triton kernel
against its torch twin. Run with `pytest -m gpu tests/test_gpu_core.py` on the GPU host."""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected everywhere, runs only with a GPU
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

flashinfer = pytest.importorskip("flashinfer")

from harness.synthetic import batch_summaries, random_batch  # noqa: E402
from sglang_compact.batch import QBlocks, cdiv  # noqa: E402
from sglang_compact.compact import CompactAttention  # noqa: E402
from sglang_compact.config import CompactConfig  # noqa: E402
from sglang_compact.executors import ForwardShape, TorchExecutor, reference_attention  # noqa: E402
from sglang_compact.executors.base import rows_from_tokens, tokens_from_rows  # noqa: E402
from sglang_compact.executors.flashinfer_executor import make_flashinfer_executor  # noqa: E402
from sglang_compact.kernels import antidiagonal_naive, flashprefill, flashprefill_naive, indices, indices_naive, \
    kv_cache, kv_cache_naive, union, union_naive  # noqa: E402

DEV = "cuda"
P = 64


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gpu_batch(prefix, chunk, hq, hkv, d, seed, dtype=torch.bfloat16, page=P, sparse_ranges=None):
    return random_batch(prefix, chunk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, dtype=dtype,
                        device=DEV, seed=seed, structured=True, sparse_ranges=sparse_ranges)


def layers_of_one_pass(prefix, chunk, hq, hkv, d, seeds, **kw):
    """One batch per layer of one forward pass: each layer's own queries and pool contents, on the first one's page
    table (a pass plans once from one page table, as in the server)."""
    first = gpu_batch(prefix, chunk, hq, hkv, d, seed=seeds[0], **kw)
    out = [first]
    for seed in seeds[1:]:
        b = gpu_batch(prefix, chunk, hq, hkv, d, seed=seed, **kw)
        k, v = torch.zeros_like(first.k_pool), torch.zeros_like(first.v_pool)
        for r, E in enumerate(first.context_lens_cpu()):
            dst, src = first.page_table[r, :cdiv(E, P)].long(), b.page_table[r, :cdiv(E, P)].long()
            k[dst], v[dst] = b.k_pool[src], b.v_pool[src]
        out.append(dataclasses.replace(first, q=b.q, k_pool=k, v_pool=v))
    return out


def executor(b, kernel="fa2"):
    if kernel == "sgl-fa3":
        sgl_fa3_or_skip()
    return make_flashinfer_executor(kernel, DEV, max_rows=b.num_rows, max_indices=b.num_rows * b.qblocks.max_pages)


def run_layer(b, cfg, ex, layer=0, plan=True):
    ca = CompactAttention(cfg)
    if plan:
        ex.plan_forward(ForwardShape.of(b, ca.row_pages(b)), b.page_table)
    sel = ca.select_pages(b, layer, batch_summaries(b), buffers=ex.index_buffers, with_stats=True)
    return ex.run(b, sel.indices), sel


SHAPES = [(32, 8, 128), (16, 4, 128), (9, 3, 64), (14, 2, 64)]


@pytest.mark.parametrize("context", [8192, 65536])
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("selector", ["flashprefill", "budget"])
@pytest.mark.parametrize("kernel", ["fa2", "fa3-auto", "sgl-fa3"])
def test_rows_executor_matches_reference(context, hq, hkv, d, selector, kernel):
    # two requests: prefixes not page aligned, a 1024 chunk and a shorter one; the second's last windows dense
    b = gpu_batch([context, context - 1000 - 17], [1024, 517], hq, hkv, d, seed=context + hq + d,
                  sparse_ranges=[(0, 1 << 40), (0, (context - 1000) // 1024)])
    cfg = CompactConfig(block_size=P, selector=selector, selector_params={"alpha": 0.1} if selector == "flashprefill"
                        else {})
    ex = executor(b, kernel)
    out, sel = run_layer(b, cfg, ex)
    err = rel_err(out, reference_attention(b, sel.table))
    print(f"{kernel} context={context} heads={hq}/{hkv} d={d} {selector}: density={float(sel.density):.3f} "
          f"mode={ex.mode} rel_err={err:.2e}")
    assert err <= 1e-2 and out.isfinite().all()


@pytest.mark.parametrize("kernel", ["fa2", "fa3-auto", "sgl-fa3"])
@pytest.mark.parametrize("selector", ["flashprefill", "budget"])
def test_dense_windows_of_a_sparse_pass_are_one_dense_pass(kernel, selector):
    """A pass mixing sparse and dense windows: the dense ones' rows name their own pages only, and their output is
    bit for bit a fresh FlashInfer causal paged plan over their contexts (consecutive windows merged), fa3 on
    Hopper whatever the rows run on."""
    b = gpu_batch([8192 + 33, 4096], [2048, 1024], 32, 8, 128, seed=11, sparse_ranges=[(0, 9), (0, 0)])
    qb = b.qblocks
    assert qb.w_sparse == (True, False, False, False)
    segs = qb.apart_segments()   # (request, first token in q, tokens, position): windows 9-10 of request 0 merged
    assert segs == [(0, 9216 - 8225, 10273 - 9216, 9216), (1, 2048, 1024, 4096)]
    cfg = CompactConfig(block_size=P, selector=selector, selector_params={"alpha": 0.1} if selector == "flashprefill"
                        else {})
    ex = executor(b, kernel)
    out, sel = run_layer(b, cfg, ex)
    assert rel_err(out, reference_attention(b, sel.table)) <= 1e-2
    counts = (sel.indices.kv_indptr[1:] - sel.indices.kv_indptr[:-1]).tolist()
    NW = qb.windows
    for r, c in enumerate(counts):
        w = r % NW
        if not qb.w_sparse[w]:
            assert c == qb.w_last[w] - qb.w_first[w] + 1
    dense_kernel = "fa2" if kernel == "fa2" else "fa3"
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    fresh = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend=dense_kernel)
    ends = [pos + n for _, _, n, pos in segs]
    pages = [cdiv(e, P) for e in ends]
    kv = torch.cat([b.page_table[r, :k] for (r, *_), k in zip(segs, pages)])
    fresh.plan(torch.tensor([0, *torch.tensor([n for _, _, n, _ in segs]).cumsum(0).tolist()], dtype=torch.int32),
               torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32), kv,
               torch.tensor([e - (k - 1) * P for e, k in zip(ends, pages)], dtype=torch.int32), 32, 8, 128, P,
               causal=True, sm_scale=b.sm_scale, q_data_type=b.q.dtype, kv_data_type=b.q.dtype)
    tokens = torch.cat([torch.arange(st, st + n) for _, st, n, _ in segs]).to(DEV)
    want = fresh.run(b.q[tokens], (b.k_pool, b.v_pool))
    assert torch.equal(out[tokens], want)


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (14, 2, 64)])
def test_dense_pass_matches_reference(kernel, hq, hkv, d):
    """One causal paged pass over each context, with one request without a prefix in the batch; through `run`
    and through `run_dense` into a given output buffer."""
    b = gpu_batch([8192 + 33, 0, 4096], [1024, 300, 517], hq, hkv, d, seed=7, sparse_ranges=[(0, 0)] * 3)
    ex = executor(b, kernel)
    ex.plan_forward(ForwardShape.of(b), b.page_table)
    assert ex.mode == "dense"
    out = ex.run(b, None)
    err = rel_err(out, reference_attention(b, b.full_table()))
    print(f"dense {kernel} heads={hq}/{hkv} d={d}: rel_err={err:.2e}")
    assert err <= 1e-2
    buf = torch.full_like(b.q, float("nan"))
    got = ex.run_dense(b.q, b.k_pool, b.v_pool, out=buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, out)


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
@pytest.mark.parametrize("hq,hkv,d,page", [(32, 8, 128, 64), (14, 2, 64, 32)])
def test_pass_with_no_prefix_is_one_flashinfer_ragged_pass(kernel, hq, hkv, d, page):
    """A dense pass in which no request has a cached prefix reads the chunks' own K/V: bit for bit a fresh
    FlashInfer causal ragged plan over them (the kernel stock SGLang's FlashInfer backend runs there), for every
    layer of the pass; without the chunk's K/V (or in another dtype) it reads them from the pool instead."""
    b = gpu_batch([0, 0, 0], [1024, 300, 4096], hq, hkv, d, seed=21, page=page, sparse_ranges=[(0, 0)] * 3)
    ex = executor(b, kernel)
    ex.plan_forward(ForwardShape.of(b), b.page_table)
    assert ex.mode == "dense"
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    fresh = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=kernel)
    cu = torch.tensor([0, 1024, 1324, 5420], dtype=torch.int32)
    fresh.plan(cu, cu, hq, hkv, d, causal=True, sm_scale=b.sm_scale, q_data_type=b.q.dtype, kv_data_type=b.q.dtype)
    want = reference_attention(b, b.full_table())
    g = torch.Generator(device=DEV).manual_seed(5)
    for layer in range(2):   # a second layer: other queries and keys under the same plan
        q, k, v = (b.q, b.k_chunk, b.v_chunk) if layer == 0 else \
            (torch.randn(t.shape, generator=g, device=DEV).to(t.dtype) for t in (b.q, b.k_chunk, b.v_chunk))
        out = ex.run_dense(q, b.k_pool, b.v_pool, chunk_kv=(k, v))
        assert torch.equal(out, fresh.run(q, k, v))
    assert rel_err(ex.run(b, None), want) <= 1e-2            # `run` hands over the batch's chunk K/V
    pooled = ex.run_dense(b.q, b.k_pool, b.v_pool)           # no chunk K/V: the pool, planned then
    err = rel_err(pooled, want)
    print(f"no-prefix {kernel} heads={hq}/{hkv} d={d}: pool fallback rel_err={err:.2e}")
    assert err <= 1e-2


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_dense_passes_of_a_32k_prompt_on_qwen_shapes(kernel):
    """The chunked prefill of one 32K prompt as a Qwen2.5-Coder-0.5B server runs it (14/2 heads x 64, page 32,
    chunk 1024): one executor re-planned for every pass, each pass against the plain-torch reference. On the
    H200 (2026-12-02) compact's dense path crashed there (illegal memory access, selector dense) and answered
    differently from stock; this isolates the dense executor from the server."""
    page, ex = 32, None
    for i, prefix in enumerate([0, 1024, 8192, 16384, 24576, 30720, 31744]):
        b = gpu_batch([prefix], [1024], 14, 2, 64, seed=100 + i, page=page, sparse_ranges=[(0, 0)])
        if ex is None:
            ex = make_flashinfer_executor(kernel, DEV, max_rows=64, max_indices=64 * 1100)
        ex.plan_forward(ForwardShape.of(b), b.page_table)
        assert ex.mode == "dense"
        for layer in range(2):   # a pass's layers share its plan
            q = b.q if layer == 0 else b.q.flip(0).contiguous()
            out = ex.run_dense(q, b.k_pool, b.v_pool)
            err = rel_err(out, reference_attention(dataclasses.replace(b, q=q), b.full_table()))
            print(f"qwen dense {kernel} prefix {prefix} layer {layer}: rel_err={err:.2e}")
            assert torch.isfinite(out).all() and err <= 1e-2, (prefix, layer, err)
    torch.cuda.synchronize()


@pytest.mark.parametrize("kernel,selector", [("fa2", "dense"), ("fa3", "dense"), ("fa2", "flashprefill"),
                                             ("fa3-auto", "budget"), ("sgl-fa3", "flashprefill")])
def test_passes_planned_while_the_gpu_lags(kernel, selector):
    """Every pass planned while the GPU still runs the earlier ones (a sleep kernel queued before each, as when
    other processes share the GPU) gives, bit for bit, what it gives planned on an idle GPU. FlashInfer's plan()
    queues its schedule's copy from a page-locked host buffer without waiting for it; re-planning the wrapper
    before that copy ran handed the earlier pass the later schedule (H200, 2026-12-02: wrong outputs on fa2, an
    illegal memory access on fa3; scripts/gpu/plan_race_check.py). Qwen2.5-Coder-0.5B's shapes, page 32."""
    ranges = [(0, 0)] if selector == "dense" else None
    passes = [gpu_batch([prefix], [1024], 14, 2, 64, seed=200 + i, page=32, sparse_ranges=ranges)
              for i, prefix in enumerate([2048, 30720, 4096, 16384, 8192])]
    params = {"alpha": 0.1} if selector == "flashprefill" else {"density": 0.3}
    cfg = None if selector == "dense" else CompactConfig(block_size=32, selector=selector, selector_params=params)
    biggest = max(passes, key=lambda b: b.num_rows * b.qblocks.max_pages)

    def run_pass(ex, b):
        if selector == "dense":
            ex.plan_forward(ForwardShape.of(b), b.page_table)
            assert ex.mode == "dense"
            return ex.run_dense(b.q, b.k_pool, b.v_pool)
        return run_layer(b, cfg, ex)[0]

    lagging = executor(biggest, kernel)
    outs = []
    for b in passes:
        torch.cuda._sleep(50_000_000)
        outs.append(run_pass(lagging, b))
    torch.cuda.synchronize()
    idle = executor(biggest, kernel)
    for i, (b, out) in enumerate(zip(passes, outs)):
        expected = run_pass(idle, b)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), (i, b.prefix_lens_cpu, rel_err(out, expected))
        if selector == "dense":
            assert rel_err(out, reference_attention(b, b.full_table())) <= 1e-2


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_dense_pass_is_one_flashinfer_paged_pass(kernel):
    """Bit for bit what a fresh FlashInfer causal paged plan over each request's context pages gives (the pass is
    planned once per forward pass and reused by every layer: here a second layer's pool and queries)."""
    b = gpu_batch([8192 + 33, 4096], [1024, 1024], 32, 8, 128, seed=3, sparse_ranges=[(0, 0)] * 2)
    ex = executor(b, kernel)
    ex.plan_forward(ForwardShape.of(b), b.page_table)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    n = [cdiv(L + C, P) for L, C in zip(b.prefix_lens_cpu, b.chunk_lens_cpu)]
    fresh = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend=kernel)
    fresh.plan(torch.tensor([0, 1024, 2048], dtype=torch.int32),
               torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32), torch.cat([b.page_table[i, :n[i]] for i in range(2)]).int(),
               torch.tensor([L + C - (k - 1) * P for L, C, k in zip(b.prefix_lens_cpu, b.chunk_lens_cpu, n)],
                            dtype=torch.int32),
               32, 8, 128, P, causal=True, sm_scale=b.sm_scale, q_data_type=b.q.dtype)
    g = torch.Generator(device=DEV).manual_seed(11)
    for layer in range(2):
        q = b.q if layer == 0 else torch.randn(b.q.shape, generator=g, device=DEV).to(b.q.dtype)
        k_pool = b.k_pool if layer == 0 else torch.randn(b.k_pool.shape, generator=g, device=DEV).to(b.q.dtype)
        v_pool = b.v_pool if layer == 0 else torch.randn(b.v_pool.shape, generator=g, device=DEV).to(b.q.dtype)
        assert torch.equal(ex.run_dense(q, k_pool, v_pool), fresh.run(q, (k_pool, v_pool)))


def sgl_fa3_or_skip():
    from sglang_compact.executors.sgl_fa3 import unavailable_reason
    why = unavailable_reason(torch.device(DEV), torch.bfloat16, 64)
    if why is not None:
        pytest.skip(why)
    from sgl_kernel.flash_attn import flash_attn_with_kvcache
    return flash_attn_with_kvcache


@pytest.mark.parametrize("kernel", ["fa2", "fa3-auto"])
@pytest.mark.parametrize("hq,hkv,d,page", [(32, 8, 128, 64), (14, 2, 64, 32)])
@pytest.mark.parametrize("prefix", [[8192 + 33, 0, 4096], [0, 0, 0]])
def test_dense_pass_on_sgl_fa3_is_stock_fa3s_kernel(kernel, hq, hkv, d, page, prefix):
    """`dense_fa3`: a dense pass makes stock SGLang's fa3 call, with or without a cached prefix (and with a
    request without one in the batch): bit for bit FA3 over a token-major copy of the pool, the layout stock
    reads (ours reads the head-major pool in place), even where the chunk's own K/V is handed over. Every layer
    of the pass under one plan, into a given output buffer, against the plain-torch reference."""
    with_kvcache = sgl_fa3_or_skip()
    b = gpu_batch(prefix, [1024, 300, 517], hq, hkv, d, seed=31, page=page, sparse_ranges=[(0, 0)] * 3)
    ex = make_flashinfer_executor(kernel, DEV, max_rows=b.num_rows, max_indices=b.num_rows * b.qblocks.max_pages,
                                  dense_fa3=True)
    ex.plan_forward(ForwardShape.of(b), b.page_table)
    assert ex.mode == "dense"
    ctx = torch.tensor([L + C for L, C in zip(b.prefix_lens_cpu, b.chunk_lens_cpu)], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, 1024, 1324, 1841], dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(13)
    for layer in range(2):   # a second layer: other queries, keys and pool under the same plan
        if layer == 0:
            q, k, v, k_pool, v_pool = b.q, b.k_chunk, b.v_chunk, b.k_pool, b.v_pool
        else:
            q, k, v, k_pool, v_pool = (torch.randn(t.shape, generator=g, device=DEV).to(t.dtype)
                                       for t in (b.q, b.k_chunk, b.v_chunk, b.k_pool, b.v_pool))
        buf = torch.full_like(q, float("nan"))
        out = ex.run_dense(q, k_pool, v_pool, out=buf, chunk_kv=(k, v))
        assert out.data_ptr() == buf.data_ptr()
        stock = with_kvcache(q=q, k_cache=k_pool.transpose(1, 2).contiguous(),
                             v_cache=v_pool.transpose(1, 2).contiguous(), page_table=b.page_table.int(),
                             cache_seqlens=ctx, cu_seqlens_q=cu, max_seqlen_q=1024, softmax_scale=b.sm_scale,
                             causal=True)
        assert torch.equal(out, stock), rel_err(out, stock)
        if layer == 0:
            err = rel_err(out, reference_attention(b, b.full_table()))
            print(f"dense sgl-fa3 {kernel} heads={hq}/{hkv} d={d} page={page} prefix={prefix}: rel_err={err:.2e}")
            assert err <= 1e-2
    if not any(prefix):   # no chunk K/V handed over: the same call
        assert torch.equal(ex.run_dense(b.q, b.k_pool, b.v_pool), ex.run_dense(b.q, b.k_pool, b.v_pool,
                                                                               chunk_kv=(b.k_chunk, b.v_chunk)))


def test_dense_passes_of_a_32k_prompt_on_sgl_fa3_while_the_gpu_lags():
    """A 32K prompt's chunked prefill on Qwen2.5-Coder-0.5B's shapes (page 32, chunk 1024) through FA3 dense
    passes, each pass planned while the GPU still runs the ones before (a sleep kernel queued before each): every
    pass equals what it gives on an idle GPU and the plain-torch reference."""
    sgl_fa3_or_skip()
    passes = [gpu_batch([prefix], [1024], 14, 2, 64, seed=300 + i, page=32, sparse_ranges=[(0, 0)])
              for i, prefix in enumerate([0, 1024, 30720, 8192, 16384, 31744])]

    def run_all(lag):
        ex = make_flashinfer_executor("fa3-auto", DEV, max_rows=64, max_indices=64 * 1100, dense_fa3=True)
        outs = []
        for b in passes:
            if lag:
                torch.cuda._sleep(50_000_000)
            ex.plan_forward(ForwardShape.of(b), b.page_table)
            outs.append(ex.run_dense(b.q, b.k_pool, b.v_pool, chunk_kv=(b.k_chunk, b.v_chunk)))
        torch.cuda.synchronize()
        return outs

    for b, lagged, idle in zip(passes, run_all(True), run_all(False)):
        assert torch.equal(lagged, idle), b.prefix_lens_cpu
        err = rel_err(idle, reference_attention(b, b.full_table()))
        print(f"qwen dense sgl-fa3 prefix {b.prefix_lens_cpu[0]}: rel_err={err:.2e}")
        assert torch.isfinite(idle).all() and err <= 1e-2, (b.prefix_lens_cpu, err)


@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 128), (9, 3, 64)])
@pytest.mark.parametrize("selector", ["flashprefill", "budget"])
def test_fa2_planned_once_serves_every_layer(hq, hkv, d, selector):
    """fa2 planned once with each row's whole context, split-KV off; layers with different data (so different
    selections) then equal, bit for bit, a fresh plan with each layer's exact lengths."""
    prefix, chunk = [30000 + 7, 12345, 4100], [1024, 517, 64]
    cfg = CompactConfig(block_size=P, selector=selector, selector_params={"alpha": 0.1} if selector == "flashprefill"
                        else {"density": 0.3})
    layers = layers_of_one_pass(prefix, chunk, hq, hkv, d, [40, 41, 42])
    once = executor(layers[0], "fa2")
    once.plan_forward(ForwardShape.of(layers[0]), layers[0].page_table)
    assert once.mode == "rows"
    for i, b in enumerate(layers):
        out, sel = run_layer(b, cfg, once, layer=i, plan=False)
        # a fresh fa2 plan with this layer's exact lengths
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend="fa2")
        qb = b.qblocks
        w.plan(torch.tensor(qb.rows_qo_indptr(hkv, b.num_tokens), dtype=torch.int32), sel.indices.kv_indptr.cpu(),
               sel.indices.kv_indices[:int(sel.indices.kv_indptr[-1])],
               torch.tensor(qb.last_page_len() * hkv, dtype=torch.int32), hq // hkv, 1, d, P, causal=True,
               sm_scale=b.sm_scale, q_data_type=b.q.dtype, disable_split_kv=True)
        fresh = tokens_from_rows(w.run(rows_from_tokens(b.q, hkv), (b.k_pool.view(-1, 1, P, d),
                                                                    b.v_pool.view(-1, 1, P, d))), hkv)
        err = rel_err(out, reference_attention(b, sel.table))
        print(f"fa2 once heads={hq}/{hkv} d={d} {selector} layer {i}: density={float(sel.density):.3f} "
              f"rel_err={err:.2e} == fresh plan: {torch.equal(out, fresh)}")
        assert err <= 1e-2
        assert torch.equal(out, fresh)


@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 128), (9, 3, 64)])
@pytest.mark.parametrize("selector,density,cap", [("budget", 0.3, None), ("budget", 0.1, None), ("budget", 0.5, 0.25),
                                                  ("budget", 1.0, None), ("mass_budget", 0.33, None),
                                                  ("mass_budget", 0.5, 0.25), ("quest_budget", 0.33, None)])
def test_fa3_planned_once_serves_every_layer(hq, hkv, d, selector, density, cap):
    """fa3 planned once from `row_pages`; layers with different data then equal the reference and, bit for
    bit, fa3 planned per layer from host copies of the lengths."""
    prefix, chunk = [30000 + 7, 12345, 4100], [1024, 517, 64]
    cfg = CompactConfig(block_size=P, selector=selector, selector_params={"density": density}, density_cap=cap)
    ranges = [(0, 1 << 40), (0, 1 << 40), (0, 0)]   # the third request's windows read everything
    layers = layers_of_one_pass(prefix, chunk, hq, hkv, d, [40, 41, 42], sparse_ranges=ranges)
    rows = CompactAttention(cfg).row_pages(layers[0])
    once = executor(layers[0], "fa3")
    once.plan_forward(ForwardShape.of(layers[0], rows), layers[0].page_table)
    assert once.mode == "rows"
    per_layer = executor(layers[0], "fa3")
    per_layer.plan_forward(ForwardShape.of(layers[0], None), layers[0].page_table)
    assert per_layer.mode == "rows-per-layer"
    for i, b in enumerate(layers):
        out, sel = run_layer(b, cfg, once, layer=i, plan=False)
        assert sel.counts.tolist() == rows
        fresh, _ = run_layer(b, cfg, per_layer, layer=i, plan=False)
        err = rel_err(out, reference_attention(b, sel.table))
        print(f"fa3 once {selector} heads={hq}/{hkv} d={d} density={density} cap={cap} layer {i}: rel_err={err:.2e} "
              f"== per-layer plan: {torch.equal(out, fresh)}")
        assert err <= 1e-2
        assert torch.equal(out, fresh)


@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 128), (9, 3, 64)])
def test_flashprefill_rows_fixed_at_the_first_layer_run_on_fa3_planned_once(hq, hkv, d):
    """`fix_rows`: the first layer thresholds; its row counts fix the pass; fa3 planned once from them serves the
    later layers (each filled to those counts), bit for bit fa3 planned per layer, within tolerance of the
    reference; a mixed pass (the third request dense)."""
    prefix, chunk = [30000 + 7, 12345, 4100], [1024, 517, 64]
    ranges = [(0, 1 << 40), (0, 1 << 40), (0, 0)]
    layers = layers_of_one_pass(prefix, chunk, hq, hkv, d, [50, 51, 52], sparse_ranges=ranges)
    ca = CompactAttention(CompactConfig(block_size=P, selector="flashprefill",
                                        selector_params={"alpha": 0.1, "fix_rows": True}))
    first = ca.select_pages(layers[0], 0, batch_summaries(layers[0]))
    rows = first.counts.tolist()
    once = executor(layers[0], "fa3-auto")
    once.plan_forward(ForwardShape.of(layers[0], rows), layers[0].page_table)
    assert once.mode == "rows" and once._rows_kernel == "fa3"
    per_layer = executor(layers[0], "fa3")
    per_layer.plan_forward(ForwardShape.of(layers[0], None), layers[0].page_table)
    fill = first.counts
    for i, b in enumerate(layers):
        s = batch_summaries(b)
        sel = ca.select_pages(b, i, s, buffers=once.index_buffers, fill=None if i == 0 else fill)
        assert sel.counts.tolist() == rows
        out = once.run(b, sel.indices)
        fresh = per_layer.run(b, ca.select_pages(b, i, s, fill=None if i == 0 else fill).indices)
        err = rel_err(out, reference_attention(b, sel.table))
        print(f"fix_rows fa3 once heads={hq}/{hkv} d={d} layer {i}: rel_err={err:.2e} == per-layer plan: "
              f"{torch.equal(out, fresh)}")
        assert err <= 1e-2 and torch.equal(out, fresh)


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_dense_layers_read_all_under_the_passs_plan(kernel):
    """`dense_layers`: in a sparse pass (a mixed one: the third request dense), a layer that reads every page runs
    the rows of the full table under the plan the selecting layers share (fa2 planned once; fa3 planned per
    layer): its output is dense attention, the selecting layers' theirs."""
    prefix, chunk = [30000 + 7, 12345, 4100], [1024, 517, 64]
    ranges = [(0, 1 << 40), (0, 1 << 40), (0, 0)]
    layers = layers_of_one_pass(prefix, chunk, 16, 4, 128, [60, 61, 62], sparse_ranges=ranges)
    ca = CompactAttention(CompactConfig(block_size=P, selector="flashprefill", selector_params={"alpha": 0.1},
                                        dense_layers=(2,)))
    ex = executor(layers[0], kernel)
    ex.plan_forward(ForwardShape.of(layers[0]), layers[0].page_table)
    assert ex.mode == ("rows" if kernel == "fa2" else "rows-per-layer")
    for i, b in enumerate(layers):
        sel = ca.read_all(b, buffers=ex.index_buffers, with_stats=True) if i == 2 else \
            ca.select_pages(b, i, batch_summaries(b), buffers=ex.index_buffers, with_stats=True)
        out = ex.run(b, sel.indices)
        err = rel_err(out, reference_attention(b, sel.table))
        print(f"dense layers {kernel} layer {i}: density={float(sel.density):.3f} rel_err={err:.2e}")
        assert err <= 1e-2 and (float(sel.density) == 1.0) == (i == 2)
        if i == 2:
            assert torch.equal(sel.table, b.full_table())


def test_fa3_auto_runs_varying_rows_on_fa2_planned_once():
    b = gpu_batch([9000, 20000], [512, 256], 16, 4, 128, seed=11)
    ex = executor(b, "fa3-auto")
    out, sel = run_layer(b, CompactConfig(block_size=P, selector="flashprefill"), ex)
    assert ex.mode == "rows" and ex._rows_kernel == "fa2"
    assert rel_err(out, reference_attention(b, sel.table)) <= 1e-2


def test_torch_executor_on_gpu_matches_reference():
    b = gpu_batch([3000, 700], [256, 100], 8, 2, 64, seed=9, dtype=torch.float32)
    ca = CompactAttention(CompactConfig(block_size=P))
    sel = ca.select_pages(b, summaries=batch_summaries(b))
    ex = TorchExecutor()
    ex.plan_forward(ForwardShape.of(b), b.page_table)
    torch.testing.assert_close(ex.run(b, sel.indices), reference_attention(b, sel.table), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("selector", ["flashprefill", "budget", "dense", "xattention", "mass_budget", "quest_budget"])
def test_selecting_pages_never_syncs(selector):
    b = gpu_batch([65536 + 11, 30000], [1024, 1024], 32, 8, 128, seed=11)
    ex = executor(b)
    ca = CompactAttention(CompactConfig(block_size=P, selector=selector))
    ex.plan_forward(ForwardShape.of(b, ca.row_pages(b)), b.page_table)
    summaries = batch_summaries(b)
    b.device_qblocks()
    ca.select_pages(b, 0, summaries, buffers=ex.index_buffers)  # warm-up: Triton compiles, memos fill
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sel = ca.select_pages(b, 1, summaries, buffers=ex.index_buffers)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # execution is not part of the claim; report whether FlashInfer's run syncs
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ex.run(b, sel.indices)
        print(f"{selector}: selection and run without a sync")
    except RuntimeError as e:
        torch.cuda.set_sync_debug_mode("default")
        print(f"{selector}: selection without a sync; run synced: {e}")
        out = ex.run(b, sel.indices)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, reference_attention(b, sel.table)) <= 1e-2


def test_mass_recall_never_syncs_and_matches_the_cpu():
    """The recall telemetry (`--compact-recall-every`) on the GPU: no host sync, the CPU's values."""
    from sglang_compact.compact import mass_recall
    b = gpu_batch([65536 + 11, 30000], [1024, 1024], 32, 8, 128, seed=12)
    ca = CompactAttention(CompactConfig(block_size=P))
    sel = ca.select_pages(b, 0, batch_summaries(b))
    mass_recall(b, sel.table, 3)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = mass_recall(b, sel.table, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = dataclasses.replace(b, q=b.q.cpu(), k_pool=b.k_pool.cpu(), v_pool=b.v_pool.cpu(),
                              page_table=b.page_table.cpu(), derived={})
    torch.testing.assert_close(got.cpu(), mass_recall(cpu, sel.table.cpu(), 3), rtol=1e-3, atol=1e-4)
    assert ((got > 0) & (got <= 1 + 1e-5)).all()


@pytest.mark.parametrize("seed", range(8))
def test_triton_kernels_equal_references_on_gpu(seed):
    g = torch.Generator().manual_seed(seed)
    hkv, G, d = [1, 2, 4, 8][seed % 4], [1, 3, 4, 7][(seed // 2) % 4], [64, 128][seed % 2]
    B = 1 + seed % 3
    prefix = [int(x) // P * P for x in torch.randint(0, 40000, (B,), generator=g)]
    chunk = [int(x) for x in torch.randint(1, 1500, (B,), generator=g)]
    b = gpu_batch(prefix, chunk, hkv * G, hkv, d, seed=seed, sparse_ranges=[(2, 40)] * B)
    qb, s = b.device_qblocks(), batch_summaries(b)
    NKV = b.qblocks.max_pages
    args = (b.q, qb, b.page_table, s.key_sum, s.count, b.sm_scale, hkv, NKV)
    for gm in (False, True):
        torch.testing.assert_close(flashprefill.block_scores(*args, group_max=gm, page_size=P),
                                   flashprefill_naive.block_scores(*args, group_max=gm), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(flashprefill.ratio_scores(*args, page_size=P),
                               flashprefill_naive.ratio_scores(*args), rtol=2e-2, atol=2e-3)
    bounds = (s.key_max, s.key_min)   # Quest's bound (bf16 like the pool), `quest_budget`'s search
    for gm in (False, True):
        torch.testing.assert_close(flashprefill.block_scores(*args, group_max=gm, page_size=P, key_bounds=bounds),
                                   flashprefill_naive.block_scores(*args, group_max=gm, key_bounds=bounds),
                                   rtol=2e-2, atol=2e-3)
    tk = flashprefill.threshold_mask(*args, 0.3, page_size=P)
    tn = flashprefill_naive.threshold_mask(*args, 0.3)
    mism = (tk != tn).float().mean().item()
    print(f"seed {seed}: threshold masks differ on {mism:.2e} of cells (bf16 scores near the threshold)")
    assert mism < 2e-3
    mask = (torch.rand(hkv * G, b.qblocks.count, NKV, generator=g) < 0.02).to(DEV)
    ut, uc = union.union_table(mask, hkv, qb, 2, 4)
    nt, nc = union_naive.union_table(mask, hkv, qb, 2, 4)
    assert torch.equal(ut, nt) and torch.equal(uc, nc)
    kp, ki = indices.build_indices(ut, uc, b.page_table, qb["w_req"])
    np_, ni = indices_naive.build_indices(nt, nc, b.page_table, qb["w_req"])
    assert torch.equal(kp, np_) and torch.equal(ki[:int(np_[-1])], ni)
    # the KV store with summaries, writes split as chunks then decode steps
    pages, E = 64, 1000
    loc = (torch.randperm(pages, generator=g)[torch.arange(E) // P] * P + torch.arange(E) % P).to(DEV)
    k = torch.randn(E, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(E, hkv, d, device=DEV, dtype=torch.bfloat16)
    outs = []
    for impl in (kv_cache, kv_cache_naive):
        st = [torch.zeros(pages, hkv, P, d, device=DEV, dtype=torch.bfloat16) for _ in range(2)] + \
             [torch.zeros(pages, hkv, d, device=DEV), torch.zeros(pages, dtype=torch.int32, device=DEV)] + \
             [torch.zeros(pages, hkv, d, device=DEV, dtype=torch.bfloat16) for _ in range(2)]   # key max / min
        for a, z in ((0, 700), (700, 701), (701, 1000)):
            impl.store_kv(*st[:2], loc[a:z], k[a:z], v[a:z], *st[2:])
        outs.append(st)
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-3)
    assert torch.equal(outs[0][4], outs[1][4]) and torch.equal(outs[0][5], outs[1][5])   # max / min are exact


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("context,page", [(131072, 64), (65536, 16), (20000, 32)])
def test_top_pages_kernel_equals_reference_on_gpu(seed, context, page):
    """Rows of a fixed length ranked to paged indices in one kernel, at real row widths (2048, 4096 and 625
    pages): the same table and indices as the plain-torch twin, ties included."""
    from sglang_compact.kernels import top_pages, top_pages_naive
    from sglang_compact.selectors.base import budget_row_pages
    g = torch.Generator().manual_seed(seed)
    hkv, G = [1, 2, 8][seed % 3], [1, 4][seed % 2]
    B = 1 + seed % 2
    prefix = [context - 1024 - int(x) // page * page for x in torch.randint(0, 4096, (B,), generator=g)]
    chunk = [1024] * B
    qb = QBlocks.build(prefix, chunk, page, 1024 // page, [(1, 1 << 30)] * B)
    d = qb.on(DEV)
    pt = torch.randperm(B * qb.max_pages + 3, generator=g)[:B * qb.max_pages].view(B, -1).to(torch.int32).to(DEV)
    b = dataclasses.replace(gpu_batch([64], [64], 2, 1, 64, seed=0), qblocks=qb, page_table=pt,
                            prefix_lens_cpu=prefix, chunk_lens_cpu=chunk, derived={})
    counts = torch.tensor(budget_row_pages(b, [0.1, 0.3][seed % 2], 2, 4) * hkv, dtype=torch.int32).to(DEV)
    for per_qblock in (True, False):
        S2 = qb.count if per_qblock else qb.windows
        scores = torch.rand(hkv * G, S2, qb.max_pages, generator=g)
        scores[..., ::7] = 0.5                                     # ties
        scores = scores.to(DEV)
        args = (scores, d, counts, pt, hkv, 2, 4, per_qblock, True)
        t, kp, ki = top_pages.top_pages(*args)
        tn, kpn, kin = top_pages_naive.top_pages(*args)
        assert torch.equal(t, tn) and torch.equal(kp, kpn) and torch.equal(ki[:int(kpn[-1])], kin)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("stride,row_stride", [(8, 1), (16, 1), (8, 4)])
def test_antidiagonal_kernel_equals_reference_on_gpu(seed, stride, row_stride):
    """XAttention's page-mass estimate (`xattention`, `mass_budget`): the Triton kernel, reading the bf16 pool
    through the page table, against its torch twin in float32 on the same inputs."""
    from sglang_compact.selectors.xattention import antidiagonal_page_mass, antidiagonal_rows
    g = torch.Generator().manual_seed(100 + seed)
    hq, hkv, d = [(32, 8, 128), (14, 2, 64), (16, 4, 128), (9, 3, 64)][seed]
    B = 1 + seed % 3
    prefix = [int(x) for x in torch.randint(0, 40000, (B,), generator=g)]
    chunk = [int(x) for x in torch.randint(1, 1500, (B,), generator=g)]
    b = gpu_batch(prefix, chunk, hq, hkv, d, seed=seed, sparse_ranges=[(1, 40)] * B)
    got = antidiagonal_page_mass(b, stride, row_stride)                       # the kernel (CUDA)
    q_rows, weight = antidiagonal_rows(b, stride, row_stride)
    qb = b.device_qblocks()
    want = antidiagonal_naive.page_mass(q_rows, b.k_pool, b.page_table, qb["req"], qb["cand"], weight,
                                        hq // hkv, b.qblocks.max_pages, b.sm_scale / stride)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    has = qb["cand"] > 0
    assert has.any()
    torch.testing.assert_close(got.sum(-1)[:, has], weight.sum(-1)[has][None].expand(hq, -1), rtol=1e-3, atol=1e-4)


def test_row_reshapes_round_trip():
    x = torch.randn(37, 12, 8, device=DEV)
    assert torch.equal(tokens_from_rows(rows_from_tokens(x, 4), 4), x)
    given = torch.empty_like(x)
    assert tokens_from_rows(rows_from_tokens(x, 4), 4, out=given) is given and torch.equal(given, x)


@pytest.mark.parametrize("kernel", ["fa2", "fa3-auto", "sgl-fa3"])
@pytest.mark.parametrize("prefix,chunk", [([30000 + 7, 12345, 4100], [1024, 517, 64]), ([65536], [1024])])
def test_sparse_layers_write_into_the_output_buffer_they_are_given(kernel, prefix, chunk):
    """What the backend hands the executor in the server: SGLang's output buffer. A sparse layer written into it
    (one window: FA3's own call writes there; several, and a dense window computed apart: the copy back from the
    rows' layout does) is bit for bit the layer returned in a new tensor."""
    ranges = [(0, 1 << 40)] * (len(prefix) - 1) + [(0, 0) if len(prefix) > 1 else (0, 1 << 40)]
    b = gpu_batch(prefix, chunk, 32, 8, 128, seed=5, sparse_ranges=ranges)
    cfg = CompactConfig(block_size=P, selector="quest_budget", selector_params={"density": 0.3})
    ca = CompactAttention(cfg)
    ex = executor(b, kernel)
    ex.plan_forward(ForwardShape.of(b, ca.row_pages(b)), b.page_table)
    sel = ca.select_pages(b, 3, batch_summaries(b), buffers=ex.index_buffers)
    want = ex.run(b, sel.indices)
    given = torch.full_like(want, float("nan"))
    assert ex.run(b, sel.indices, out=given) is given and torch.equal(given, want)
    assert rel_err(given, reference_attention(b, sel.table)) <= 1e-2


def test_windows_of_a_pass_match_the_executors_plan():
    qb = QBlocks.build([0, 100, 4096], [130, 60, 1024], P)
    assert qb.rows_qo_indptr(2, 1214)[-1] == 2 * 1214 and len(qb.last_page_len()) == qb.windows


@pytest.mark.parametrize("selector", ["quest_budget", "flashprefill", "mass_budget", "budget"])
def test_cached_launch_equals_tritons_launch(selector, monkeypatch):
    """`kernels/launch.py`: with the cached launch on, a store and a selection whose kernels launch from the cache
    (second and later calls of a signature) give bit for bit what Triton's own launch gives."""
    from sglang_compact.kernels import kv_cache
    from sglang_compact.kernels.launch import Launcher
    b = gpu_batch([20000 + 5, 9000], [1024, 1024], 16, 4, 128, seed=5)
    summaries = batch_summaries(b)
    ca = CompactAttention(CompactConfig(block_size=P, selector=selector))
    T, H = 777, b.num_kv_heads
    k = torch.randn(T, H, b.head_dim, device="cuda", dtype=b.k_pool.dtype)
    loc = torch.arange(T, device="cuda") + 3 * P + 5   # one request's slots, from the middle of a page

    def run():
        kp, vp = b.k_pool.clone(), b.v_pool.clone()
        ks = torch.zeros(kp.shape[0], H, b.head_dim, device="cuda")
        cnt = torch.zeros(kp.shape[0], dtype=torch.int32, device="cuda")
        kmax, kmin = torch.zeros_like(ks, dtype=kp.dtype), torch.zeros_like(ks, dtype=kp.dtype)
        for _ in range(3):
            kv_cache.store_kv(kp, vp, loc, k, k, ks, cnt, kmax, kmin)
            sel = ca.select_pages(b, 1, summaries)
        torch.cuda.synchronize()
        indptr = sel.indices.kv_indptr
        return kp, vp, ks, cnt, kmax, kmin, sel.table, indptr, sel.indices.kv_indices[:int(indptr[-1])]

    monkeypatch.setattr(Launcher, "enabled", False)
    want = run()
    monkeypatch.setattr(Launcher, "enabled", True)
    got = run()
    assert kv_cache._store_kv_launch._compiled, "the store never launched from the cache"
    for x, y in zip(got, want):
        assert torch.equal(x, y)


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (14, 2, 64)])
def test_rows_on_sgl_fa3_planned_once_serve_layers_whose_rows_differ(hq, hkv, d):
    """`--compact-prefill-kernel sgl-fa3`: FA3 reads the rows' lengths on the device, so the plan made once per
    forward pass serves layers whose rows' lengths differ (flashprefill, whose rows follow each layer's scores):
    every layer bit for bit what a plan made for that layer alone gives, and each against the plain-torch
    reference; a row's pages past its length in the table (left by a longer earlier layer) are never read."""
    layers = layers_of_one_pass([30000 + 17, 9000], [1024, 777], hq, hkv, d, seeds=[41, 42, 43])
    b0 = layers[0]
    cfg = CompactConfig(block_size=P, selector="flashprefill", selector_params={"alpha": 0.1})
    once = executor(b0, "sgl-fa3")
    once.plan_forward(ForwardShape.of(b0), b0.page_table)
    assert once.mode == "rows"
    counts = set()
    for layer, b in enumerate(layers):
        out, sel = run_layer(b, cfg, once, plan=False)
        counts.add(tuple((sel.indices.kv_indptr[1:] - sel.indices.kv_indptr[:-1]).tolist()))
        fresh, _ = run_layer(b, cfg, executor(b, "sgl-fa3"))
        assert torch.equal(out, fresh), (layer, rel_err(out, fresh))
        err = rel_err(out, reference_attention(b, sel.table))
        print(f"sgl-fa3 rows heads={hq}/{hkv} d={d} layer {layer}: density={float(sel.density):.3f} "
              f"rel_err={err:.2e}")
        assert err <= 1e-2 and out.isfinite().all()
    assert len(counts) > 1, "the layers' rows should differ in length"


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("prefix,chunk", [(32768, 1024), (32768 + 17, 1000)])
def test_rows_on_sgl_fa3_of_one_window_take_the_tokens_layout(hq, hkv, d, prefix, chunk):
    """A pass of one window (a long prompt's chunk, chunk size <= the window) hands FA3 strided views of the
    queries and the output, one row per kv head: against the plain-torch reference, and against the same rows
    handed over kv-head-major (the copies it skips)."""
    b = gpu_batch([prefix], [chunk], hq, hkv, d, seed=prefix + hq)
    assert b.qblocks.windows == 1 and b.qblocks.any_sparse
    cfg = CompactConfig(block_size=P, selector="quest_budget", selector_params={"density": 0.3})
    ex = executor(b, "sgl-fa3")
    out, sel = run_layer(b, cfg, ex)
    assert ex._fa3_rows.one_window
    ex._fa3_rows.one_window = False
    copied = ex.run(b, sel.indices)
    err = rel_err(out, reference_attention(b, sel.table))
    diff = (out.float() - copied.float()).abs().max().item()
    print(f"sgl-fa3 one window heads={hq}/{hkv} d={d} prefix={prefix}: density={float(sel.density):.3f} "
          f"rel_err={err:.2e} max |tokens layout - rows layout|={diff:.2e}")
    assert err <= 1e-2 and out.isfinite().all() and diff <= 1e-2


@pytest.mark.parametrize("selector", ["flashprefill", "budget"])
def test_auto_takes_sgl_fa3_rows_where_its_library_runs(selector):
    """`--compact-prefill-kernel auto`: the rows go to sgl_kernel's FA3 on Hopper where it runs (faster than
    FlashInfer's fa3 rows at 128K and 32K on the H100, docs/results/rows_sgl_fa3/), else to FlashInfer's kernels;
    fp32 caches keep fa2."""
    from sglang_compact.executors.sgl_fa3 import unavailable_reason
    from sglang_compact.srt.runtime import is_hopper, resolve_prefill_kernel

    cfg, dev = CompactConfig(selector=selector), torch.device(DEV)
    got = resolve_prefill_kernel(cfg, dev, torch.bfloat16, 128)
    if unavailable_reason(dev, torch.bfloat16, 128) is None:
        assert got == "sgl-fa3"
    else:
        assert got == ("fa3-auto" if is_hopper(dev) else "fa2")
    assert resolve_prefill_kernel(cfg, dev, torch.float32, 128) == "fa2"
