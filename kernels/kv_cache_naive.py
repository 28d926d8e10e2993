"""Plain-torch reference for the KV store and page-summary kernel (`kernels/kv_cache.py`)."""

from __future__ import annotations

import torch


def check_summaries(key_sum, count, key_max, key_min) -> None:
    """The summary buffers a store may keep: none, the sum and count, or those and both bounds."""
    if (key_sum is None) != (count is None):
        raise ValueError("key_sum and count go together")
    if (key_max is None) != (key_min is None):
        raise ValueError("key_max and key_min go together")
    if key_max is not None and key_sum is None:
        raise ValueError("key_max/key_min are kept only together with key_sum and count")


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             key_sum: torch.Tensor | None = None, count: torch.Tensor | None = None,
             key_max: torch.Tensor | None = None, key_min: torch.Tensor | None = None, runs: int = 1) -> None:
    """Write tokens into a head-major pool and refresh the summaries of the pages they touch (`runs`: the Triton
    kernel's launch hint, how many runs of consecutive tokens the write is; it changes nothing here).

    Args:
        k_pool, v_pool: [num_pages, H_kv, P, D]; slot s is [s // P, :, s % P, :]
        loc:            int [N] slots written (a request's tokens in order, as SGLang allocates them)
        k, v:           [N, H_kv, D]
        key_sum:        float32 [num_pages, H_kv, D] and count int32 [num_pages], or None (no summaries):
            every page a write ends in gets the sum of its keys at offsets 0..off and count off + 1,
            recomputed in a fixed order (so the summary of a page does not depend on how its tokens
            were split across writes).
        key_max, key_min: [num_pages, H_kv, D] in the pool's dtype, or None (no bounds; only with key_sum):
            every page a write ends in gets the channel-wise max / min of its keys at offsets 0..off as
            stored in the pool (after the cast to its dtype, so exact in it), recomputed like the sum.
    """
    check_summaries(key_sum, count, key_max, key_min)
    P = k_pool.shape[2]
    loc = loc.long()
    page, off = torch.div(loc, P, rounding_mode="floor"), loc % P
    k_pool[page, :, off] = k.to(k_pool.dtype)
    v_pool[page, :, off] = v.to(v_pool.dtype)
    if key_sum is None or loc.numel() == 0:
        return
    last = torch.ones_like(page, dtype=torch.bool)
    last[:-1] = page[1:] != page[:-1]
    p, o = page[last], off[last]
    upto = (torch.arange(P, device=loc.device)[None, :] <= o[:, None])[:, None, :, None]   # [n, 1, P, 1]
    key_sum[p] = (k_pool[p].to(torch.float32) * upto).sum(dim=2)
    count[p] = (o + 1).to(count.dtype)
    if key_max is not None:
        key_max[p], key_min[p] = page_key_bounds(k_pool[p], upto)


def page_key_bounds(keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise max and min of pages' keys [n, H, P, D] over the offsets where `valid` ([n, 1, P, 1]) holds,
    in the keys' dtype (exact)."""
    inf = torch.tensor(float("inf"), dtype=keys.dtype, device=keys.device)
    return torch.where(valid, keys, -inf).amax(dim=2), torch.where(valid, keys, inf).amin(dim=2)
