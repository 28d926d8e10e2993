"""Page summaries: the sum of keys (and their count) per (page, kv head), per layer.

Selectors that score mean keys read these instead of the context itself, so a
chunk's search costs O(context pages), not O(context tokens). They are kept by
the same launch that writes K/V into the pool (`kernels/kv_cache.py`): every
page a write ends in gets its sum recomputed over offsets 0..off in a fixed
order, so a page's summary does not depend on how its tokens were split into
writes. Pages shared through the radix cache share their summaries because
the summary is keyed by page id.

Buffers, for all layers:
    key_sum  float32 [layers, num_pages, H_kv, D]
    count    int32   [layers, num_pages]      tokens summed in the page
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.kernels import kv_cache as kv_cache_kernel
from sglang_compact.kernels import kv_cache_naive, use_triton


@dataclass
class LayerSummaries:
    """One layer's summaries: key_sum float32 [num_pages, H_kv, D], count int32 [num_pages]."""

    key_sum: torch.Tensor
    count: torch.Tensor

    def mean_keys(self, pages: torch.Tensor) -> torch.Tensor:
        """float32 [..., H_kv, D] mean keys of the given page ids (zeros for pages never written)."""
        p = pages.long()
        return self.key_sum[p] / self.count[p].clamp(min=1).to(torch.float32)[..., None, None]

    @classmethod
    def from_pool(cls, k_pool: torch.Tensor, page_table: torch.Tensor, context_lens) -> "LayerSummaries":
        """Summaries computed from a pool's keys (for batches built outside the server): each request's
        pages summed over the context tokens in them."""
        num_pages, H, P, D = k_pool.shape
        key_sum = torch.zeros(num_pages, H, D, dtype=torch.float32, device=k_pool.device)
        count = torch.zeros(num_pages, dtype=torch.int32, device=k_pool.device)
        for b, E in enumerate(context_lens):
            n = -(-int(E) // P)
            if n == 0:
                continue
            pages = page_table[b, :n].long()
            filled = (E - torch.arange(n, device=k_pool.device) * P).clamp(max=P)            # tokens per page
            valid = torch.arange(P, device=k_pool.device)[None, :] < filled[:, None]          # [n, P]
            key_sum[pages] = (k_pool[pages].to(torch.float32) * valid[:, None, :, None]).sum(dim=2)
            count[pages] = filled.to(torch.int32)
        return cls(key_sum, count)


class PageSummaries:
    """Summaries for every page of a paged KV pool, one table per layer."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str):
        self.key_sum = torch.zeros(num_layers, num_pages, num_kv_heads, head_dim, dtype=torch.float32, device=device)
        self.count = torch.zeros(num_layers, num_pages, dtype=torch.int32, device=device)

    @staticmethod
    def bytes_needed(num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int) -> int:
        return num_layers * num_pages * (num_kv_heads * head_dim * 4 + 4)

    def layer(self, layer: int) -> LayerSummaries:
        return LayerSummaries(self.key_sum[layer], self.count[layer])


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             summaries: LayerSummaries | None = None) -> None:
    """Write tokens into a head-major pool `[num_pages, H_kv, P, D]` at slots `loc`, refreshing the
    summaries of the pages the write ends in (one launch on CUDA)."""
    impl = kv_cache_kernel.store_kv if use_triton(k_pool) else kv_cache_naive.store_kv
    s = (summaries.key_sum, summaries.count) if summaries is not None else (None, None)
    impl(k_pool, v_pool, loc, k, v, *s)
