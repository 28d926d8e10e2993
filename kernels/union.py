"""Triton block union; reference: `union_naive.union_table`.

One program per (request, kv head, tile of kv blocks): ORs the tile over the
G query heads of the group and the NQ query blocks, adds the forced blocks,
clips to the request's prefix, stores the table tile and adds its popcount to
the row's count (atomically: the row spans several tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _union_kernel(mask, table, counts, kv_blocks,
                  H_kv, NKV, sink_blocks, recent_blocks,
                  GNQ, BLOCK_J: tl.constexpr):
    row = tl.program_id(0)  # b * H_kv + g
    tile = tl.program_id(1)
    b = row // H_kv
    g = row % H_kv
    j = tile * BLOCK_J + tl.arange(0, BLOCK_J)
    n_b = tl.load(kv_blocks + b)
    in_prefix = j < n_b
    acc = tl.zeros([BLOCK_J], dtype=tl.int32)
    # mask is [B, H_q, NQ, NKV]; the group's heads g*G .. g*G+G-1 are adjacent.
    base = (b.to(tl.int64) * H_kv + g) * GNQ * NKV
    for hi in range(GNQ):
        m = tl.load(mask + base + hi * NKV + j, mask=in_prefix, other=0)
        acc = acc | m.to(tl.int32)
    forced = (j < sink_blocks) | (j >= n_b - recent_blocks)
    sel = (acc != 0) | forced
    sel = sel & in_prefix
    tl.store(table + row.to(tl.int64) * NKV + j, sel.to(tl.int8), mask=j < NKV)
    tl.atomic_add(counts + row, tl.sum(sel.to(tl.int32), axis=0))


def union_table(mask: torch.Tensor, num_kv_heads: int, kv_blocks: torch.Tensor,
                sink_blocks: int, recent_blocks: int,
                out_table: torch.Tensor | None = None,
                out_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `union_naive.union_table`; optional preallocated outputs
    (`out_table` bool [B, H_kv, >= NKV] contiguous rows of NKV, `out_counts` int32 [B * H_kv])."""
    B, H_q, NQ, NKV = mask.shape
    G = H_q // num_kv_heads
    mask_u8 = mask.contiguous().view(torch.uint8)
    table = out_table if out_table is not None else torch.empty(B, num_kv_heads, NKV, dtype=torch.bool, device=mask.device)
    counts = out_counts if out_counts is not None else torch.empty(B * num_kv_heads, dtype=torch.int32, device=mask.device)
    counts.zero_()
    if B == 0 or NKV == 0:
        table.zero_()
        return table, counts.view(B, num_kv_heads)
    block_j = min(1024, triton.next_power_of_2(NKV))
    grid = (B * num_kv_heads, triton.cdiv(NKV, block_j))
    _union_kernel[grid](mask_u8, table.view(torch.int8), counts, kv_blocks.to(torch.int32),
                        num_kv_heads, NKV, sink_blocks, recent_blocks,
                        G * NQ, BLOCK_J=block_j)
    return table, counts.view(B, num_kv_heads)
