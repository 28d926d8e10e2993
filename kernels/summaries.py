"""Triton page-summary update; reference: `summaries_naive.update_summaries`.

Two launches, so that every restart (write at slot 0) lands before any add:
  1. restart: one program per written slot; a slot-0 write zeroes its page.
  2. add:     one program per written slot; atomically adds its key and 1.
Float atomics make the sum's rounding order-dependent: exact for counts,
equal to the reference within float32 rounding for sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _restart_pages(key_sum, count, slots, page_size, HD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    if slot % page_size == 0:
        page = slot // page_size
        offs = tl.arange(0, BLOCK)
        tl.store(key_sum + page * HD + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < HD)
        tl.store(count + page, 0)


@triton.jit
def _add_keys(key_sum, count, slots, keys, page_size, HD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    page = slot // page_size
    offs = tl.arange(0, BLOCK)
    k = tl.load(keys + i.to(tl.int64) * HD + offs, mask=offs < HD, other=0.0).to(tl.float32)
    tl.atomic_add(key_sum + page * HD + offs, k, mask=offs < HD)
    tl.atomic_add(count + page, 1)


def update_summaries(key_sum: torch.Tensor, count: torch.Tensor, slots: torch.Tensor,
                     keys: torch.Tensor, page_size: int) -> None:
    """Same contract as `summaries_naive.update_summaries`."""
    n = slots.numel()
    if n == 0:
        return
    hd = key_sum.shape[1] * key_sum.shape[2]
    keys = keys.reshape(n, hd).contiguous()
    slots = slots.contiguous()
    block = triton.next_power_of_2(hd)
    _restart_pages[(n,)](key_sum, count, slots, page_size, HD=hd, BLOCK=block)
    _add_keys[(n,)](key_sum, count, slots, keys, page_size, HD=hd, BLOCK=block)
