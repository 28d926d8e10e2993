"""Plain-torch reference for the KV store and page-summary kernel (`kernels/kv_cache.py`)."""

from __future__ import annotations

import torch


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             key_sum: torch.Tensor | None = None, count: torch.Tensor | None = None) -> None:
    """Write tokens into a head-major pool and refresh the summaries of the pages they touch.

    Args:
        k_pool, v_pool: [num_pages, H_kv, P, D]; slot s is [s // P, :, s % P, :]
        loc:            int [N] slots written (a request's tokens in order, as SGLang allocates them)
        k, v:           [N, H_kv, D]
        key_sum:        float32 [num_pages, H_kv, D] and count int32 [num_pages], or None (no summaries):
            every page a write ends in gets the sum of its keys at offsets 0..off and count off + 1,
            recomputed in a fixed order (so the summary of a page does not depend on how its tokens
            were split across writes).
    """
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
    keys = k_pool[p].to(torch.float32)                                        # [n, H, P, D]
    upto = torch.arange(P, device=loc.device)[None, :] <= o[:, None]          # [n, P]
    key_sum[p] = (keys * upto[:, None, :, None]).sum(dim=2)
    count[p] = (o + 1).to(count.dtype)
