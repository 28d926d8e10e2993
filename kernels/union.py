"""Triton window union; reference: `union_naive.union_table`.

One program per (row, tile of pages), row r = g * NW + w: ORs the tile over the
q-blocks of window w and the G query heads of kv head g, adds the forced pages
(sinks, the recent pages before the window, the window's own pages; all of
0..last for a dense window), clips to the window's context, stores the table
tile and adds its popcount to the row's count (atomically: a row spans several
tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_compact.kernels.launch import Launcher


@triton.jit
def _union_kernel(mask, table, counts, w_first, w_last, w_sparse, w_qlo, w_qhi, NW, NQB, NKV, sink, recent,
                  G: tl.constexpr, BLOCK_J: tl.constexpr):
    row = tl.program_id(0)  # g * NW + w
    tile = tl.program_id(1)
    g = row // NW
    w = row % NW
    first = tl.load(w_first + w)
    last = tl.load(w_last + w)
    sparse = tl.load(w_sparse + w)
    qlo = tl.load(w_qlo + w)
    qhi = tl.load(w_qhi + w)
    j = tile * BLOCK_J + tl.arange(0, BLOCK_J)
    in_ctx = j <= last
    acc = tl.zeros([BLOCK_J], dtype=tl.int32)
    # mask is [H_kv * G, NQB, NKV]; the group's heads g*G .. g*G+G-1 are adjacent
    for qi in range(qlo, qhi):
        for hi in range(G):
            m = tl.load(mask + ((g * G + hi).to(tl.int64) * NQB + qi) * NKV + j, mask=in_ctx & (j < NKV), other=0)
            acc = acc | m.to(tl.int32)
    forced = (j < sink) | (j >= first - recent) | (sparse == 0)
    sel = ((acc != 0) | forced) & in_ctx
    tl.store(table + row.to(tl.int64) * NKV + j, sel.to(tl.int8), mask=j < NKV)
    tl.atomic_add(counts + row, tl.sum(sel.to(tl.int32), axis=0))


_union_launch = Launcher(_union_kernel)


def union_table(mask: torch.Tensor, num_kv_heads: int, w: dict, sink_blocks: int,
                recent_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `union_naive.union_table`."""
    H, NQB, NKV = mask.shape
    G = H // num_kv_heads
    NW = w["w_first"].numel()
    R = num_kv_heads * NW
    table = torch.empty(num_kv_heads, NW, NKV, dtype=torch.bool, device=mask.device)
    counts = torch.zeros(R, dtype=torch.int32, device=mask.device)
    if R == 0 or NKV == 0:
        return table, counts
    block_j = min(1024, triton.next_power_of_2(NKV))
    _union_launch(
        (R, triton.cdiv(NKV, block_j)),
        mask.contiguous().view(torch.uint8), table.view(torch.int8), counts, w["w_first"], w["w_last"], w["w_sparse"],
        w["w_qlo"], w["w_qhi"], NW, NQB, NKV, sink_blocks, recent_blocks, G=G, BLOCK_J=block_j)
    return table, counts
