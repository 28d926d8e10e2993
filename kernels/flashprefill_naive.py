"""Plain-torch reference for the FlashPrefill search kernel (`kernels/flashprefill.py`).

For q-block q (request b) and query head h, over its candidate pages j < c (c: the first page of its
window, `qb["cand"]`):

    s[t, j]   = q_t . kbar_j * sm_scale          kbar_j = key_sum[page_j] / count[page_j]
    p[t, j]   = softmax_j(s[t, :])
    score[j]  = max over the q-block's queries t (every `query_stride`-th) of p[t, j]

With `key_bounds` = (kmax, kmin), each page's per-channel key max and min, the logit is Quest's bound
s[t, j] = (q_t+ . kmax_j + q_t- . kmin_j) * sm_scale (q+ / q-: the positive / negative parts of q_t), which is
>= q_t . k for every key k of the page.

`block_scores` returns the scores; `threshold_mask` keeps, per (kv head g, q-block q), the pages
some query head of the group scores >= alpha x that head's best score; `ratio_scores` gives, per
(kv head, q-block, page), the largest score / best over the group's heads: the page is kept at
every alpha up to it.
"""

from __future__ import annotations

import torch


def _head_scores(q, qb, page_table, key_sum, count, sm_scale, num_kv_heads, n_pages, query_stride, key_bounds=None):
    """float32 [H_q, NQB, NKV] per-head scores (0 outside candidates) and bool [NQB] 'has candidates'."""
    T, H_q, D = q.shape
    G = H_q // num_kv_heads
    NQB = len(qb["cand"])
    out = torch.zeros(H_q, NQB, n_pages, dtype=torch.float32, device=q.device)
    for i in range(NQB):
        b, a, st, n = (int(qb[k][i]) for k in ("req", "cand", "start", "length"))
        if a == 0 or n == 0:
            continue
        pages = page_table[b, :a].long()
        qq = q[st:st + n:query_stride].to(torch.float32).transpose(0, 1)      # [H_q, n', D]
        if key_bounds is None:
            kbar = key_sum[pages].to(torch.float32) / count[pages].clamp(min=1).to(torch.float32)[:, None, None]
            logits = torch.matmul(qq, _per_query_head(kbar, G).transpose(1, 2))
        else:
            kmax, kmin = (_per_query_head(t[pages].to(torch.float32), G) for t in key_bounds)
            logits = (torch.matmul(qq.clamp(min=0), kmax.transpose(1, 2))
                      + torch.matmul(qq.clamp(max=0), kmin.transpose(1, 2)))
        p = torch.softmax(logits * sm_scale, dim=-1)
        out[:, i, :a] = p.amax(dim=1)
    return out


def _per_query_head(x, G):
    """[a, H_kv, D] page vectors -> [H_q, a, D], each kv head's repeated for its G query heads."""
    return x.permute(1, 0, 2).repeat_interleave(G, 0)


def block_scores(q: torch.Tensor, qb: dict, page_table: torch.Tensor, key_sum: torch.Tensor, count: torch.Tensor,
                 sm_scale: float, num_kv_heads: int, n_pages: int, group_max: bool = False,
                 query_stride: int = 1, config: dict | None = None,
                 key_bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-head scores of each q-block's candidate pages.

    Args:
        q:          [T, H_q, D] chunk queries
        qb:         the q-blocks' req / cand / start / length (int32 [NQB] each, see `QBlocks.on`)
        page_table: int32 [B, >= n_pages]
        key_sum:    float32 [num_pages, H_kv, D] and count: int32 [num_pages] (page summaries of one layer)
        n_pages:    NKV, the table width
        group_max:  reduce over each kv head's G query heads (one row per kv head)
        config:     launch parameters of the kernel (ignored here)
        key_bounds: (key_max, key_min) [num_pages, H_kv, D] each: score Quest's bound, not the mean key
    Returns:
        float32 [H_q, NQB, NKV] ([H_kv, NQB, NKV] with group_max); 0 outside candidates.
    """
    s = _head_scores(q, qb, page_table, key_sum, count, sm_scale, num_kv_heads, n_pages, query_stride, key_bounds)
    if group_max:
        H_q = s.shape[0]
        s = s.reshape(num_kv_heads, H_q // num_kv_heads, *s.shape[1:]).amax(dim=1)
    return s


def ratio_scores(q: torch.Tensor, qb: dict, page_table: torch.Tensor, key_sum: torch.Tensor, count: torch.Tensor,
                 sm_scale: float, num_kv_heads: int, n_pages: int, query_stride: int = 1,
                 config: dict | None = None) -> torch.Tensor:
    """float32 [H_kv, NQB, NKV]: per kv head g and q-block q, the largest over the group's query heads of a
    candidate page's score over that head's best score (in (0, 1]; 0 outside candidates): `threshold_mask`
    keeps exactly the pages whose ratio is >= alpha."""
    s = _head_scores(q, qb, page_table, key_sum, count, sm_scale, num_kv_heads, n_pages, query_stride)
    H_q, NQB, NKV = s.shape
    best = s.amax(dim=-1, keepdim=True)
    r = torch.where(best > 0, s / torch.where(best > 0, best, torch.ones_like(best)), torch.zeros_like(s))
    return r.reshape(num_kv_heads, H_q // num_kv_heads, NQB, NKV).amax(dim=1)


def threshold_mask(q: torch.Tensor, qb: dict, page_table: torch.Tensor, key_sum: torch.Tensor,
                   count: torch.Tensor, sm_scale: float, num_kv_heads: int, n_pages: int, alpha: float,
                   query_stride: int = 1, config: dict | None = None) -> torch.Tensor:
    """bool [H_kv, NQB, NKV]: the candidate pages some query head of kv head g's group scores at least
    alpha x its best (see the module docstring)."""
    s = _head_scores(q, qb, page_table, key_sum, count, sm_scale, num_kv_heads, n_pages, query_stride)
    H_q, NQB, NKV = s.shape
    cand = torch.arange(NKV, device=s.device)[None, :] < qb["cand"].long()[:, None]    # [NQB, NKV]
    best = s.amax(dim=-1, keepdim=True)                                                # [H_q, NQB, 1]
    keep = (s >= alpha * best) & cand[None] & (best > 0)
    return keep.reshape(num_kv_heads, H_q // num_kv_heads, NQB, NKV).any(dim=1)
