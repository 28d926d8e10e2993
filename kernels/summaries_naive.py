"""Plain-torch reference for the page-summary update (see `summaries.py`)."""

from __future__ import annotations

import torch


def update_summaries(key_sum: torch.Tensor, count: torch.Tensor, slots: torch.Tensor,
                     keys: torch.Tensor, page_size: int) -> None:
    """In place: pages whose slot 0 is written restart; then add each key to its page.

    Args:
        key_sum: float32 [num_pages, H_kv, D]
        count:   int32 [num_pages]
        slots:   int [N] pool slots written
        keys:    [N, H_kv, D]
    """
    slots = slots.long()
    pages = torch.div(slots, page_size, rounding_mode="floor")
    keep = (slots % page_size != 0).to(torch.float32)
    # keep_page[p] = 0 if any write hits slot 0 of page p: identical for duplicate
    # page ids, so the indexed assignment below is deterministic.
    keep_page = torch.ones(count.shape[0], dtype=torch.float32, device=count.device)
    keep_page.scatter_reduce_(0, pages, keep, reduce="amin")
    factor = keep_page[pages]
    key_sum[pages] = key_sum[pages] * factor[:, None, None]
    count[pages] = count[pages] * factor.to(count.dtype)
    key_sum.index_add_(0, pages, keys.to(torch.float32))
    count.index_add_(0, pages, torch.ones_like(pages, dtype=count.dtype))
