"""Plain-torch reference for the top-pages kernel (`kernels/top_pages.py`).

Rows of a fixed length, ranked: each row r = g * NW + w (kv head g, window w) of a sparse window keeps
exactly `counts[r]` pages, its forced pages first (the first `sink_blocks`, the `recent_blocks` before the
window and the window's own up to its last query's), then its candidates (the pages before the window) by
score, best first, equal scores lower page first. A row's score of a page is the best over the kv head's
score rows (its query heads, when `scores` has one per query head) and the window's q-blocks (when
`scores` has one per q-block). A dense window's table row is every page 0..last; its indices name only its
own pages first..last when `apart` (in a sparse pass it is computed apart: `QBlocks.dense_apart`).
"""

from __future__ import annotations

import torch

from sglang_compact.kernels.indices_naive import build_indices


def row_scores(scores: torch.Tensor, qb: dict, num_kv_heads: int, per_qblock: bool) -> torch.Tensor:
    """float32 [H_kv, NW, NKV]: each row's score of each page (the max over its score rows)."""
    H_s, S2, NKV = scores.shape
    s = scores.to(torch.float32).reshape(num_kv_heads, H_s // num_kv_heads, S2, NKV).amax(1)
    if not per_qblock:
        return s
    rows = [s[:, lo:hi].amax(1) for lo, hi in zip(qb["w_qlo"].tolist(), qb["w_qhi"].tolist())]
    return torch.stack(rows, 1) if rows else s.new_zeros(num_kv_heads, 0, NKV)


def top_pages(scores: torch.Tensor, qb: dict, counts: torch.Tensor, page_table: torch.Tensor, num_kv_heads: int,
              sink_blocks: int, recent_blocks: int, per_qblock: bool = True, apart: bool = True):
    """Args:
        scores: float [H_kv * GS, NQB (per_qblock) or NW, NKV] page scores; only the candidates' are read.
        qb: the q-blocks' device arrays (`QBlocks.on`): w_req, w_first, w_last, w_sparse, w_qlo, w_qhi.
        counts: int [H_kv * NW] pages each row reads (a dense window's: last + 1).
        page_table: int32 [B, >= NKV].
        apart: a dense window's indices name its own pages only (a sparse pass computes it apart); else all
            of 0..last.
    Returns:
        table bool [H_kv, NW, NKV], kv_indptr int32 [R + 1], kv_indices int32 [kv_indptr[-1]].
    """
    H_kv = num_kv_heads
    NKV = scores.shape[-1]
    first, last = qb["w_first"].long(), qb["w_last"].long()
    sparse = qb["w_sparse"].bool()
    NW = first.numel()
    s = row_scores(scores, qb, H_kv, per_qblock)
    j = torch.arange(NKV, device=scores.device)[None, :]
    ctx = j <= last[:, None]
    forced = ctx & ((j < sink_blocks) | (j >= first[:, None] - recent_blocks))
    cand = j < first[:, None]
    ranked = torch.where(forced, float("inf"), torch.where(cand, s, float("-inf")))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    keep_sorted = torch.arange(NKV, device=scores.device)[None, None, :] < counts.reshape(H_kv, NW, 1).long()
    table = torch.zeros(H_kv, NW, NKV, dtype=torch.bool, device=scores.device).scatter_(-1, order, keep_sorted)
    table = torch.where(sparse[None, :, None], table, ctx[None].expand(H_kv, -1, -1))
    rows = table & (sparse[:, None] | (j >= first[:, None]) | (not apart))[None]
    kv_indptr, kv_indices = build_indices(rows, rows.sum(-1, dtype=torch.int32).reshape(-1), page_table, qb["w_req"])
    return table, kv_indptr, kv_indices
