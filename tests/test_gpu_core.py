"""GPU checks of the core engine (H200): FlashInfer executor vs the references, no-sync planning,
Triton kernels vs their torch references. Run with `pytest -m gpu tests/test_gpu_core.py`."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected everywhere, runs only with a GPU
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

flashinfer = pytest.importorskip("flashinfer")

from sglang_compact.batch import ChunkBatch  # noqa: E402
from sglang_compact.compact import CompactAttention  # noqa: E402
from sglang_compact.config import CompactConfig  # noqa: E402
from sglang_compact.execute import TorchPagedExecutor, reference_attention  # noqa: E402
from sglang_compact.execute_flashinfer import FlashInferExecutor, rows_from_tokens, tokens_from_rows  # noqa: E402
from sglang_compact.kernels import plan as plan_triton  # noqa: E402
from sglang_compact.kernels import plan_naive, summaries_naive, union_naive  # noqa: E402
from sglang_compact.kernels import summaries as summaries_triton  # noqa: E402
from sglang_compact.kernels import union as union_triton  # noqa: E402
from sglang_compact.plan import build_plan  # noqa: E402
from sglang_compact.synthetic import random_batch  # noqa: E402

DEV = "cuda"
P = 64


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gpu_batch(prefix, chunk, hq, hkv, d, seed, dtype=torch.bfloat16):
    return random_batch(prefix, chunk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P, dtype=dtype,
                        device=DEV, seed=seed, structured=True)


def executor_for(b, backend="fa2"):
    ex = FlashInferExecutor(DEV, max_rows=b.batch_size * b.num_kv_heads,
                            max_indices=b.batch_size * b.num_kv_heads * b.max_kv_blocks, backend=backend)
    ex.begin_forward_for(b)
    return ex


SHAPES = [(32, 8, 128), (16, 4, 128), (9, 3, 64), (32, 8, 64), (16, 4, 64), (9, 3, 128)]


@pytest.mark.parametrize("prefix_len", [8192, 65536])
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("selector", ["flashprefill", "budget"])
def test_flashinfer_executor_matches_reference(prefix_len, hq, hkv, d, selector):
    # two requests, prefixes not page aligned, chunk 1024 and a shorter one
    b = gpu_batch([prefix_len, prefix_len - 1000 - 17], [1024, 517], hq, hkv, d, seed=prefix_len + hq + d)
    cfg = CompactConfig(block_size=P, selector=selector, min_prefix_len=0)
    ex = executor_for(b)
    ca = CompactAttention(cfg, executor=ex)
    cp = ca.plan(b, buffers=ex.buffers)
    out = ex.run(b, cp.plan)
    ref = reference_attention(b, table=cp.table)
    density = cp.stats.as_floats()["after_group"]
    err = rel_err(out, ref)
    print(f"prefix={prefix_len} heads={hq}/{hkv} d={d} {selector}: density={density:.3f} rel_err={err:.2e}")
    assert err <= 1e-2
    assert out.isfinite().all()


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_full_density_equals_flashinfer_dense_paged_prefill(hq, hkv, d):
    b = gpu_batch([8192 + 33, 4096], [1024, 1024], hq, hkv, d, seed=7)
    cfg = CompactConfig(block_size=P, selector="dense", min_prefix_len=0)
    ex = executor_for(b)
    cp = CompactAttention(cfg, executor=ex).plan(b, buffers=ex.buffers)
    o_rows, lse_rows = ex.prefix_attention(b, cp.plan)

    # FlashInfer's own dense paged prefill over the same pool: all heads, page ids, HND.
    n = b.kv_blocks_cpu()
    kv_indptr = torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32)
    kv_indices = torch.cat([b.page_table[i, :n[i]] for i in range(2)]).to(torch.int32)
    last = torch.tensor([L - (k - 1) * P for L, k in zip(b.prefix_lens_cpu, n)], dtype=torch.int32)
    qo = torch.tensor([0, 1024, 2048], dtype=torch.int32)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    results = {}
    for split_kv in (False, True):
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", backend="fa2")
        w.plan(qo, kv_indptr, kv_indices, last, hq, hkv, d, P, causal=False, q_data_type=b.q.dtype,
               sm_scale=b.sm_scale, disable_split_kv=not split_kv)
        results[split_kv] = w.run(b.q, (b.k_pool, b.v_pool), return_lse=True)
    (o_same, lse_same), (o_split, _) = results[False], results[True]
    print(f"heads={hq}/{hkv} d={d}: vs dense (split-KV off, as ours) bit-identical={torch.equal(o_rows, o_same)} "
          f"lse bit-identical={torch.equal(lse_rows, lse_same)}; vs dense with split-KV: "
          f"bit-identical={torch.equal(o_rows, o_split)} rel_err={rel_err(o_rows, o_split):.2e}")
    # the same kernel over the same tiles in the same order: exactly the same numbers
    assert torch.equal(o_rows, o_same)
    assert torch.equal(lse_rows, lse_same)
    # FlashInfer's default (split-KV) schedule sums in another order: rounding-level differences only
    assert rel_err(o_rows, o_split) <= 1e-2


def test_fa3_backend_matches_reference():
    b = gpu_batch([16384 + 5, 9000], [1024, 300], 32, 8, 128, seed=3)
    cfg = CompactConfig(block_size=P, selector="budget", selector_params={"density": 0.3}, min_prefix_len=0)
    ex = executor_for(b, backend="fa3")
    cp = CompactAttention(cfg, executor=ex).plan(b)
    err = rel_err(ex.run(b, cp.plan), reference_attention(b, table=cp.table))
    print(f"fa3 rel_err={err:.2e}")
    assert err <= 1e-2


@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 128), (9, 3, 64)])
@pytest.mark.parametrize("density,cap", [(0.3, None), (0.1, None), (0.5, 0.25), (1.0, None)])
def test_fa3_planned_once_serves_every_layer(hq, hkv, d, density, cap):
    """fa3 planned once from CompactAttention.row_blocks; layers with different data (so different
    selections) then equal the reference and, bit for bit, a fresh fa3 plan per layer."""
    prefix, chunk = [30000 + 7, 12345, 4100], [1024, 517, 64]
    cfg = CompactConfig(block_size=P, selector="budget", selector_params={"density": density}, min_prefix_len=0,
                        density_cap=cap)
    compact = [True, True, False]
    rows = CompactAttention(cfg).row_blocks(prefix, compact)
    layers = [gpu_batch(prefix, chunk, hq, hkv, d, seed=40 + i) for i in range(3)]
    once = executor_for(layers[0], backend="fa3")
    once.begin_forward_for(layers[0], row_blocks=rows)
    assert once.mode == "fa3"
    per_layer = executor_for(layers[0], backend="fa3")
    assert per_layer.mode == "fa3-per-layer"
    compact_rows = torch.tensor(compact, device=DEV)
    for i, b in enumerate(layers):
        cp = CompactAttention(cfg, executor=once).plan(b, layer=i, compact_rows=compact_rows, buffers=once.buffers)
        assert cp.table.sum(-1).tolist() == [[r] * hkv for r in rows]
        out = once.run(b, cp.plan)
        err = rel_err(out, reference_attention(b, table=cp.table))
        fresh = per_layer.run(b, CompactAttention(cfg).plan(b, layer=i, compact_rows=compact_rows).plan)
        print(f"fa3 once heads={hq}/{hkv} d={d} density={density} cap={cap} layer {i}: rel_err={err:.2e} "
              f"== per-layer plan: {torch.equal(out, fresh)}")
        assert err <= 1e-2
        assert torch.equal(out, fresh)


def test_fa3_executor_runs_batches_with_an_unprefixed_request_on_fa2():
    b = gpu_batch([9000, 0], [512, 256], 16, 4, 128, seed=11)
    cfg = CompactConfig(block_size=P, selector="budget", min_prefix_len=0)
    ex = executor_for(b, backend="fa3")
    ex.begin_forward_for(b, row_blocks=CompactAttention(cfg).row_blocks(b.prefix_lens_cpu, [True, True]))
    assert ex.mode == "fa2"
    cp = CompactAttention(cfg, executor=ex).plan(b, buffers=ex.buffers)
    assert rel_err(ex.run(b, cp.plan), reference_attention(b, table=cp.table)) <= 1e-2


def test_plan_reused_across_layers_with_different_tables():
    """One begin_forward, several layers with different selections (the serving pattern)."""
    b = gpu_batch([20000, 12345], [1024, 1024], 16, 4, 128, seed=5)
    ex = executor_for(b)
    for layer, density in enumerate([0.1, 0.5, 0.2, 1.0]):
        cfg = CompactConfig(block_size=P, selector="budget", selector_params={"density": density}, min_prefix_len=0)
        cp = CompactAttention(cfg, executor=ex).plan(b, layer=layer, buffers=ex.buffers)
        err = rel_err(ex.run(b, cp.plan), reference_attention(b, table=cp.table))
        assert err <= 1e-2, (layer, density, err)


def test_torch_executor_on_gpu_matches_reference():
    b = gpu_batch([3000, 700], [256, 100], 8, 2, 64, seed=9, dtype=torch.float32)
    cp = CompactAttention(CompactConfig(block_size=P, min_prefix_len=0)).plan(b)
    torch.testing.assert_close(TorchPagedExecutor().run(b, cp.plan), reference_attention(b, table=cp.table),
                               rtol=1e-4, atol=1e-4)


def test_row_reshapes_round_trip():
    x = torch.randn(37, 12, 8, device=DEV)
    assert torch.equal(tokens_from_rows(rows_from_tokens(x, 4), 4), x)


@pytest.mark.parametrize("selector", ["flashprefill", "budget", "dense", "xattention"])
def test_building_the_plan_never_syncs(selector):
    b = gpu_batch([65536 + 11, 30000], [1024, 1024], 32, 8, 128, seed=11)
    ex = executor_for(b)
    ca = CompactAttention(CompactConfig(block_size=P, selector=selector, min_prefix_len=0), executor=ex)
    ca.plan(b, buffers=ex.buffers)  # warm-up: Triton compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cp = ca.plan(b, buffers=ex.buffers)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # execution is not part of the claim; report whether FlashInfer's run syncs
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ex.run(b, cp.plan)
        print(f"{selector}: plan and run without a sync")
    except RuntimeError as e:
        print(f"{selector}: plan without a sync; run synced: {e}")
        torch.cuda.set_sync_debug_mode("default")
        out = ex.run(b, cp.plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, reference_attention(b, table=cp.table)) <= 1e-2


@pytest.mark.parametrize("seed", range(10))
def test_triton_kernels_equal_references_on_gpu(seed):
    g = torch.Generator().manual_seed(seed)
    B, H_kv, G = 1 + seed % 4, [1, 2, 4, 8][seed % 4], [1, 3, 4, 8][(seed // 2) % 4]
    n_kv = [int(x) for x in torch.randint(0, 3000, (B,), generator=g)]
    NKV, NQ = max(n_kv + [1]), 16
    mask = (torch.rand(B, H_kv * G, NQ, NKV, generator=g) < 0.02).to(DEV)
    kv_blocks = torch.tensor(n_kv, dtype=torch.int32, device=DEV)
    ref_t, ref_c = union_naive.union_table(mask, H_kv, kv_blocks, 2, 4)
    tri_t, tri_c = union_triton.union_table(mask, H_kv, kv_blocks, 2, 4)
    assert torch.equal(ref_t, tri_t) and torch.equal(ref_c, tri_c)
    page_table = torch.randperm(B * NKV + 3, generator=g)[:B * NKV].reshape(B, NKV).to(torch.int32).to(DEV)
    prefix = (kv_blocks * P - torch.randint(0, P, (B,), generator=g, dtype=torch.int32).to(DEV)).clamp(min=0)
    prefix = torch.where(kv_blocks > 0, prefix, 0).to(torch.int32)
    cu = torch.tensor([0] + list(range(1024, 1024 * B + 1, 1024)), dtype=torch.int32, device=DEV)
    ref = plan_naive.build_plan(ref_t, ref_c, page_table, prefix, cu, P)
    tri = plan_triton.build_plan(ref_t, ref_c, page_table, prefix, cu, P)
    n = int(ref[1][-1])
    assert all(torch.equal(a, b) for a, b in ((ref[0], tri[0]), (ref[1], tri[1]), (ref[3], tri[3])))
    assert torch.equal(ref[2], tri[2][:n])
    # summaries
    num_pages, D = 500, 128
    ks = torch.randn(num_pages, H_kv, D, device=DEV)
    cnt = torch.randint(0, P, (num_pages,), dtype=torch.int32, device=DEV)
    ks2, cnt2 = ks.clone(), cnt.clone()
    slots = torch.randperm(num_pages * P, generator=g)[:4000].to(DEV)
    keys = torch.randn(4000, H_kv, D, device=DEV, dtype=torch.bfloat16)
    summaries_naive.update_summaries(ks, cnt, slots, keys, P)
    summaries_triton.update_summaries(ks2, cnt2, slots, keys, P)
    assert torch.equal(cnt, cnt2)
    torch.testing.assert_close(ks2, ks, rtol=1e-5, atol=1e-4)


def test_chunk_batch_rejects_bad_shapes():
    b = gpu_batch([100], [10], 8, 2, 64, seed=1)
    with pytest.raises(ValueError):
        ChunkBatch.build(b.q, b.k_chunk, b.v_chunk, b.k_pool, b.v_pool, b.page_table, [100], [11])
