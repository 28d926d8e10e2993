"""Page summaries: the sum of keys (and their count) per (page, kv head), per layer, and optionally
the keys' channel-wise max and min (Quest's page bounds).

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
    key_max  pool dtype [layers, num_pages, H_kv, D]   only with key_bounds: channel max of the page's keys
    key_min  pool dtype [layers, num_pages, H_kv, D]   only with key_bounds: channel min of the page's keys
The bounds are of the keys as the pool stores them, so in the pool's dtype they are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.kernels import kv_cache as kv_cache_kernel
from sglang_compact.kernels import kv_cache_naive, use_triton


@dataclass
class LayerSummaries:
    """One layer's summaries: key_sum float32 [num_pages, H_kv, D], count int32 [num_pages], and optionally
    key_max / key_min [num_pages, H_kv, D] in the pool's dtype (None when the bounds are not kept)."""

    key_sum: torch.Tensor
    count: torch.Tensor
    key_max: torch.Tensor | None = None
    key_min: torch.Tensor | None = None

    def mean_keys(self, pages: torch.Tensor) -> torch.Tensor:
        """float32 [..., H_kv, D] mean keys of the given page ids (zeros for pages never written)."""
        p = pages.long()
        return self.key_sum[p] / self.count[p].clamp(min=1).to(torch.float32)[..., None, None]

    @classmethod
    def from_pool(cls, k_pool: torch.Tensor, page_table: torch.Tensor, context_lens,
                  key_bounds: bool = False) -> "LayerSummaries":
        """Summaries computed from a pool's keys (for batches built outside the server): each request's
        pages summed over the context tokens in them (and, with key_bounds, their max / min in the pool's
        dtype)."""
        num_pages, H, P, D = k_pool.shape
        key_sum = torch.zeros(num_pages, H, D, dtype=torch.float32, device=k_pool.device)
        count = torch.zeros(num_pages, dtype=torch.int32, device=k_pool.device)
        key_max = torch.zeros(num_pages, H, D, dtype=k_pool.dtype, device=k_pool.device) if key_bounds else None
        key_min = torch.zeros_like(key_max) if key_bounds else None
        for b, E in enumerate(context_lens):
            n = -(-int(E) // P)
            if n == 0:
                continue
            pages = page_table[b, :n].long()
            filled = (E - torch.arange(n, device=k_pool.device) * P).clamp(max=P)            # tokens per page
            valid = torch.arange(P, device=k_pool.device)[None, :] < filled[:, None]          # [n, P]
            key_sum[pages] = (k_pool[pages].to(torch.float32) * valid[:, None, :, None]).sum(dim=2)
            count[pages] = filled.to(torch.int32)
            if key_bounds:
                key_max[pages], key_min[pages] = kv_cache_naive.page_key_bounds(k_pool[pages],
                                                                                valid[:, None, :, None])
        return cls(key_sum, count, key_max, key_min)


class PageSummaries:
    """Summaries for every page of a paged KV pool, one table per layer; the key bounds (key_max, key_min,
    in bounds_dtype: the pool's) only with key_bounds. The tables are allocated once and cannot be rebound:
    `layer` hands out views of them made at construction."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str, key_bounds: bool = False, bounds_dtype: torch.dtype = torch.float32):
        shape = (num_layers, num_pages, num_kv_heads, head_dim)
        self._key_sum = torch.zeros(shape, dtype=torch.float32, device=device)
        self._count = torch.zeros(num_layers, num_pages, dtype=torch.int32, device=device)
        self._key_max = torch.zeros(shape, dtype=bounds_dtype, device=device) if key_bounds else None
        self._key_min = torch.zeros(shape, dtype=bounds_dtype, device=device) if key_bounds else None
        bounds = (lambda i: (self._key_max[i], self._key_min[i])) if key_bounds else lambda i: ()
        # per-layer views made once: every layer of every forward pass asks for its tables
        self._layers = [LayerSummaries(self._key_sum[i], self._count[i], *bounds(i)) for i in range(num_layers)]

    # read-only: a rebound table would leave the per-layer views pointing at the old one
    key_sum = property(lambda self: self._key_sum, doc="float32 [layers, num_pages, H_kv, D]")
    count = property(lambda self: self._count, doc="int32 [layers, num_pages]")
    key_max = property(lambda self: self._key_max, doc="[layers, num_pages, H_kv, D] in bounds_dtype, or None")
    key_min = property(lambda self: self._key_min, doc="[layers, num_pages, H_kv, D] in bounds_dtype, or None")

    @staticmethod
    def bytes_needed(num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                     key_bounds: bool = False, bounds_itemsize: int = 4) -> int:
        per_page = num_kv_heads * head_dim * 4 + 4
        if key_bounds:
            per_page += 2 * num_kv_heads * head_dim * bounds_itemsize
        return num_layers * num_pages * per_page

    def layer(self, layer: int) -> LayerSummaries:
        """Layer `layer`'s tables (views of this pool's)."""
        return self._layers[layer]


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             summaries: LayerSummaries | None = None, runs: int = 1) -> None:
    """Write tokens into a head-major pool `[num_pages, H_kv, P, D]` at slots `loc`, refreshing the
    summaries of the pages the write ends in (one launch on CUDA); key bounds too where `summaries`
    has them. `runs`: runs of consecutive tokens in the write (an extend's requests, a decode step's tokens), the
    kernel's launch shape (`kernels.kv_cache.block_tokens`)."""
    sums = () if summaries is None else (summaries.key_sum, summaries.count, summaries.key_max, summaries.key_min)
    impl = kv_cache_kernel.store_kv if use_triton(k_pool) else kv_cache_naive.store_kv
    impl(k_pool, v_pool, loc, k, v, *sums, runs=runs)
