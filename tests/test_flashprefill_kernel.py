"""FlashPrefill block-score kernel == torch reference (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

from sglang_compact.kernels import flashprefill as fp_triton
from sglang_compact.kernels import flashprefill_naive as fp_naive
from sglang_compact.selectors.base import pooled_keys_from_pool, threshold_rows, valid_cells
from sglang_compact.synthetic import random_batch


def case(seed, P, hq, hkv, d, prefix, chunk):
    b = random_batch(prefix, chunk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P, seed=seed,
                     structured=True)
    return b, pooled_keys_from_pool(b)


@pytest.mark.parametrize("seed,P,hq,hkv,d,prefix,chunk", [
    (0, 16, 4, 2, 16, [100, 0, 333], [40, 20, 17]),
    (1, 32, 6, 3, 32, [500, 64], [70, 33]),
    (2, 16, 8, 1, 64, [1000], [16]),
    (3, 64, 2, 2, 32, [4100, 257, 900], [130, 1, 64]),
    (4, 32, 9, 3, 64, [700, 100], [90, 33]),   # G = 3: a padded head in the kernel's group tile
    (5, 16, 5, 1, 16, [300], [50]),            # G = 5
])
def test_kernel_equals_reference(seed, P, hq, hkv, d, prefix, chunk):
    b, pooled = case(seed, P, hq, hkv, d, prefix, chunk)
    args = (b.q, b.cu_chunk, b.chunk_lens_cpu, pooled, b.kv_blocks(), b.sm_scale, P, b.max_q_blocks(P))
    ref = fp_naive.block_scores(*args)
    got = fp_triton.block_scores(*args)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # and the thresholded masks agree
    valid = valid_cells(b, P).expand_as(ref)
    assert torch.equal(threshold_rows(got, valid, 0.06), threshold_rows(ref, valid, 0.06))
    # the group-max output (one row per kv head) is the max over each group's heads
    ref_g = fp_naive.block_scores(*args, group_max=True)
    assert torch.equal(ref_g, ref.reshape(len(prefix), hkv, hq // hkv, *ref.shape[2:]).amax(dim=2))
    torch.testing.assert_close(fp_triton.block_scores(*args, group_max=True), ref_g, rtol=1e-5, atol=1e-6)


def test_kernel_rejects_unsupported_shapes():
    b, pooled = case(0, 16, 4, 2, 16, [100], [40])
    with pytest.raises(ValueError, match="head_dim"):
        fp_triton.block_scores(b.q[..., :12], b.cu_chunk, b.chunk_lens_cpu, pooled[..., :12], b.kv_blocks(),
                               b.sm_scale, 16, 3)


@pytest.mark.parametrize("stride", [2, 4])
@pytest.mark.parametrize("group_max", [False, True])
def test_query_stride_kernel_equals_reference(stride, group_max):
    b, pooled = case(7, 64, 8, 2, 32, [900, 300], [150, 64])
    args = (b.q, b.cu_chunk, b.chunk_lens_cpu, pooled, b.kv_blocks(), b.sm_scale, 64, b.max_q_blocks(64))
    ref = fp_naive.block_scores(*args, group_max=group_max, query_stride=stride)
    torch.testing.assert_close(fp_triton.block_scores(*args, group_max=group_max, query_stride=stride), ref,
                               rtol=1e-5, atol=1e-6)
    # a strided score never exceeds the full one (a max over fewer queries), and stride 1 is the full one
    full = fp_naive.block_scores(*args, group_max=group_max)
    assert (ref <= full + 1e-7).all() and not torch.equal(ref, full)
    assert torch.equal(fp_naive.block_scores(*args, group_max=group_max, query_stride=1), full)


def test_query_stride_must_leave_16_queries_per_block():
    b, pooled = case(0, 32, 4, 2, 16, [100], [40])
    with pytest.raises(ValueError, match="query_stride"):
        fp_triton.block_scores(b.q, b.cu_chunk, b.chunk_lens_cpu, pooled, b.kv_blocks(), b.sm_scale, 32, 2,
                               query_stride=4)
