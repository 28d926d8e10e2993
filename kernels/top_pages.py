"""Triton top-pages kernel: rows of a fixed length, ranked, straight to paged indices; reference:
`top_pages_naive.top_pages`.

One program per row r = g * NW + w. It takes the row's score of each candidate page (the max over the kv
head's score rows and the window's q-blocks), ranks the forced pages at +inf and the pages past the
window's last at -inf, and finds the `counts[r]`-th best score T by one sort of the row: it keeps the pages
scoring above T and, of those scoring exactly T, the lowest pages (what a stable descending sort keeps).
Its offset into kv_indices is the sum of the earlier rows' lengths (their counts; a dense window's row
names its own pages only when `apart`), so the program also writes kv_indptr[r + 1]: no cumsum launch, no table
pass, no device->host traffic. One launch replaces the window max, the ranking, top-k, the table and the
index kernel of a fixed-length selector's layer.

The row is one tile of next_power_of_2(NKV) pages (`supports`: at most MAX_PAGES).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_compact.kernels.launch import Launcher

MAX_PAGES = 8192


@triton.jit
def _top_pages_kernel(scores, counts, w_req, w_first, w_last, w_sparse, w_qlo, w_qhi, page_table, kv_indptr,
                      kv_indices, table, NW, NKV, H_kv, GS, S2, stride_pt, sink_blocks, recent_blocks, apart,
                      PER_QBLOCK: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0)
    g = r // NW
    w = r % NW
    b = tl.load(w_req + w)
    first = tl.load(w_first + w)
    last = tl.load(w_last + w)
    sparse = tl.load(w_sparse + w) != 0
    # offset of this row: the lengths of rows 0..r-1
    offset = 0
    for i0 in range(0, r, BR):
        i = i0 + tl.arange(0, BR)
        ok = i < r
        wi = i % NW
        c = tl.load(counts + i, mask=ok, other=0)
        own = tl.load(w_last + wi, mask=ok, other=0) - tl.load(w_first + wi, mask=ok, other=0) * apart + 1
        sp = tl.load(w_sparse + wi, mask=ok, other=0) != 0
        offset += tl.sum(tl.where(ok, tl.where(sp, c, own), 0), axis=0)
    j = tl.arange(0, BLOCK)
    ctx = j <= last
    if sparse:
        cand = j < first
        if PER_QBLOCK:
            lo = tl.load(w_qlo + w)
            hi = tl.load(w_qhi + w)
        else:
            lo = w
            hi = w + 1
        s = tl.full([BLOCK], float("-inf"), tl.float32)
        for h in range(0, GS):
            for q in range(lo, hi):
                row = scores + ((g * GS + h) * S2 + q).to(tl.int64) * NKV
                s = tl.maximum(s, tl.load(row + j, mask=cand, other=float("-inf")).to(tl.float32))
        forced = ctx & ((j < sink_blocks) | (j >= first - recent_blocks))
        ranked = tl.where(forced, float("inf"), tl.where(cand, s, float("-inf")))
        k = tl.load(counts + r)
        best_first = tl.sort(ranked, descending=True)
        kth = tl.max(tl.where(j == k - 1, best_first, float("-inf")), axis=0)
        above = ranked > kth
        tied = (ranked == kth).to(tl.int32)
        room = k - tl.sum(above.to(tl.int32), axis=0)
        keep = above | ((tied != 0) & (tl.cumsum(tied, axis=0) <= room))
        sel = keep
        in_table = keep
    else:
        sel = ctx & (j >= first * apart)
        in_table = ctx
    sel_i = sel.to(tl.int32)
    pos = offset + tl.cumsum(sel_i, axis=0) - 1
    page = tl.load(page_table + b.to(tl.int64) * stride_pt + j, mask=sel, other=0)
    tl.store(kv_indices + pos, page * H_kv + g, mask=sel)
    tl.store(kv_indptr + r + 1, offset + tl.sum(sel_i, axis=0))
    tl.store(kv_indptr + r, offset, mask=r == 0)
    tl.store(table + r.to(tl.int64) * NKV + j, in_table.to(tl.int8), mask=j < NKV)


_top_pages_launch = Launcher(_top_pages_kernel)


def supports(n_pages: int) -> bool:
    return n_pages <= MAX_PAGES


def top_pages(scores: torch.Tensor, qb: dict, counts: torch.Tensor, page_table: torch.Tensor, num_kv_heads: int,
              sink_blocks: int, recent_blocks: int, per_qblock: bool = True, apart: bool = True,
              out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Same contract as `top_pages_naive.top_pages`, except that `kv_indices` is the whole output buffer
    (valid up to kv_indptr[-1]).

    Args:
        out: optional preallocated int32 (kv_indptr [>= R + 1], kv_indices [>= the rows' pages]); without it
            kv_indices is sized by the host bound R * NKV.
    """
    H_s, S2, NKV = scores.shape
    NW = qb["w_first"].numel()
    R = num_kv_heads * NW
    dev = scores.device
    if not supports(NKV):
        raise ValueError(f"top_pages kernel: {NKV} pages per row, at most {MAX_PAGES}")
    if H_s % num_kv_heads:
        raise ValueError(f"top_pages kernel: {H_s} score rows are not a multiple of {num_kv_heads} kv heads")
    table = torch.empty(num_kv_heads, NW, NKV, dtype=torch.bool, device=dev)
    if out is None:
        out = (torch.empty(R + 1, dtype=torch.int32, device=dev),
               torch.empty(max(R * NKV, 1), dtype=torch.int32, device=dev))
    kv_indptr, kv_indices = out
    if R == 0 or NKV == 0:
        kv_indptr[:1].zero_()
        table.zero_()
        return table, kv_indptr[:R + 1], kv_indices
    if scores.dtype != torch.float32 or not scores.is_contiguous():
        scores = scores.float().contiguous()
    if page_table.dtype != torch.int32 or page_table.stride(1) != 1:
        page_table = page_table.to(torch.int32).contiguous()
    if counts.dtype != torch.int32:
        counts = counts.to(torch.int32)
    block = max(16, triton.next_power_of_2(NKV))   # tl.sort and tl.cumsum on a tile of at least 16
    _top_pages_launch(
        (R,),
        scores, counts, qb["w_req"], qb["w_first"], qb["w_last"], qb["w_sparse"], qb["w_qlo"], qb["w_qhi"],
        page_table, kv_indptr, kv_indices, table.view(torch.int8), NW, NKV, num_kv_heads, H_s // num_kv_heads, S2,
        page_table.stride(0), sink_blocks, recent_blocks, int(apart), PER_QBLOCK=per_qblock, BLOCK=block, BR=256,
        num_warps=4 if block <= 1024 else 8)
    return table, kv_indptr[:R + 1], kv_indices
