"""Page summaries: mean-pooled keys per (page, kv-head), per layer.

Selectors that score pooled keys read these instead of the prefix itself, so a
chunk's search costs O(prefix pages), not O(prefix tokens). They are updated
incrementally whenever KV is written to the pool; pages shared through the
radix cache share their summaries because the summary is keyed by page id.

Update rule (exact for how SGLang fills pages: each page is written left to
right, each slot once between page allocations): a write that touches a page's
slot 0 starts that page afresh (the page was (re)allocated), then every written
key is added to its page's running sum and count.

Buffers, for one layer:
    key_sum  float32 [num_pages, H_kv, D]
    count    int32   [num_pages]          tokens summed in the page
"""

from __future__ import annotations

import torch

from sglang_compact.kernels import summaries as summary_kernels
from sglang_compact.kernels import summaries_naive


class PageSummaries:
    """Pooled keys for every page of a paged KV pool, one table per layer."""

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, head_dim: int,
                 page_size: int, device: torch.device | str, use_triton: bool | None = None):
        self.page_size = page_size
        self.key_sum = torch.zeros(num_layers, num_pages, num_kv_heads, head_dim, dtype=torch.float32, device=device)
        self.count = torch.zeros(num_layers, num_pages, dtype=torch.int32, device=device)
        dev = torch.device(device)
        self.use_triton = (dev.type == "cuda") if use_triton is None else use_triton

    def update(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Account for keys written at pool slots.

        Args:
            slots: int [N] pool slots (slot = page * P + offset) just written.
            keys:  [N, H_kv, D] the keys written there.
        """
        if slots.numel() == 0:
            return
        impl = summary_kernels.update_summaries if self.use_triton else summaries_naive.update_summaries
        impl(self.key_sum[layer], self.count[layer], slots, keys, self.page_size)

    def pooled(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Mean keys of the given pages.

        Args:
            pages: int [B, NKV] page ids.
        Returns:
            float32 [B, NKV, H_kv, D]; zeros for pages never written.
        """
        p = pages.long()
        cnt = self.count[layer][p].clamp(min=1).to(torch.float32)
        return self.key_sum[layer][p] / cnt[..., None, None]

    def clear_pages(self, pages: torch.Tensor) -> None:
        """Forget pages (all layers), e.g. when the pool frees them."""
        p = pages.long()
        self.key_sum[:, p] = 0
        self.count[:, p] = 0
