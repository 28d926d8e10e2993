"""Page summaries: incremental updates equal pooling the pool; Triton == torch."""

import pytest
import torch

from sglang_compact.kernels import summaries as summaries_triton
from sglang_compact.kernels import summaries_naive
from sglang_compact.summaries import PageSummaries


def simulate_writes(seed, num_pages=12, H=3, D=8, P=16, steps=25):
    """Requests fill pages left to right in chunks of any size; pages are freed and reused."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.zeros(num_pages, H, P, D)
    fill = [0] * num_pages          # tokens currently in each page
    writes = []
    for _ in range(steps):
        page = int(torch.randint(0, num_pages, (1,), generator=g))
        if fill[page] == P or torch.rand(1, generator=g).item() < 0.15:
            fill[page] = 0          # freed and reallocated: restart at slot 0
        n = int(torch.randint(1, P - fill[page] + 1, (1,), generator=g))
        slots = page * P + torch.arange(fill[page], fill[page] + n)
        keys = torch.randn(n, H, D, generator=g)
        k_pool[page, :, fill[page]:fill[page] + n] = keys.transpose(0, 1)
        fill[page] += n
        writes.append((slots, keys))
    return k_pool, fill, writes


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("use_triton", [False, True])
def test_incremental_summary_equals_pooling_the_pool(seed, use_triton):
    k_pool, fill, writes = simulate_writes(seed)
    num_pages, H, P, D = k_pool.shape
    s = PageSummaries(2, num_pages, H, D, P, "cpu", use_triton=use_triton)
    for slots, keys in writes:
        # several writes batched in one call too: split each write in two
        half = max(1, len(slots) // 2)
        s.update(1, slots[:half], keys[:half])
        s.update(1, slots[half:], keys[half:])
    written = [p for p in range(num_pages) if fill[p]]
    pooled = s.pooled(1, torch.tensor([written]))[0]
    for i, p in enumerate(written):
        want = k_pool[p, :, :fill[p]].mean(dim=1)
        torch.testing.assert_close(pooled[i], want, rtol=1e-5, atol=1e-5)
        assert int(s.count[1, p]) == fill[p]
    assert s.count[0].sum() == 0  # other layers untouched


@pytest.mark.parametrize("seed", range(8))
def test_triton_update_equals_reference(seed):
    g = torch.Generator().manual_seed(seed)
    P, num_pages, H, D = 16, 9, 2, 16
    ks_ref = torch.randn(num_pages, H, D, generator=g)
    cnt_ref = torch.randint(0, P, (num_pages,), generator=g, dtype=torch.int32)
    ks_tri, cnt_tri = ks_ref.clone(), cnt_ref.clone()
    slots = torch.randperm(num_pages * P, generator=g)[:40]  # distinct slots, some at offset 0
    keys = torch.randn(40, H, D, generator=g)
    summaries_naive.update_summaries(ks_ref, cnt_ref, slots, keys, P)
    summaries_triton.update_summaries(ks_tri, cnt_tri, slots, keys, P)
    assert torch.equal(cnt_ref, cnt_tri)
    torch.testing.assert_close(ks_tri, ks_ref, rtol=1e-6, atol=1e-6)


def test_clear_pages():
    s = PageSummaries(2, 4, 1, 4, 16, "cpu")
    s.update(0, torch.tensor([16, 17]), torch.ones(2, 1, 4))
    s.clear_pages(torch.tensor([1]))
    assert s.count.sum() == 0 and s.key_sum.abs().sum() == 0
