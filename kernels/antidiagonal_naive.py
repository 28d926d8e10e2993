"""Plain-torch reference for the antidiagonal page-mass kernel (`kernels/antidiagonal.py`)."""

from __future__ import annotations

import torch


def page_mass(q_rows: torch.Tensor, k_pool: torch.Tensor, page_table: torch.Tensor, qb_req: torch.Tensor,
              qb_cand: torch.Tensor, row_weight: torch.Tensor, group_size: int, n_pages: int, scale: float,
              tiles: torch.Tensor | None = None) -> torch.Tensor:
    """XAttention's strided antidiagonal estimate of each candidate page's attention mass.

    A q-block (one page of queries) is cut into P / S groups of S consecutive queries (its antidiagonal
    rows, of which RQ are scored), the context into groups of S consecutive keys (its columns, R = P / S per
    page). Row u of q-block q and
    column c score  sum_s q[u*S + S-1-s] . k[c*S + s]  (the antidiagonal of the S x S block), times `scale`
    (sm_scale / S); a softmax over the q-block's candidate columns (the first cand[q] pages of its request)
    gives each row's mass per column, summed per page, then weighed over the rows (`row_weight`).

    Args:
        q_rows: [H_kv, NQB, GP, RQ, S * D], the queries of query head g * G + hp (hp < G; GP >= G padded
            heads are ignored), q-block q, scored row u, laid out s-major as the antidiagonal reads them
            (flipped).
        k_pool: [num_pages, H_kv, P, D] the key pool; page_table int [B, W] each request's pages.
        qb_req, qb_cand: int [NQB] each q-block's request and candidate page count.
        row_weight: float32 [NQB, RQ] each scored row's weight in its q-block's sum (0 for a row without queries).
        tiles: the kernel's launch tiles (ignored here).
    Returns:
        float32 [H_kv * G, NQB, n_pages]: estimated mass per (query head, q-block, page); 0 outside the
        candidates.
    """
    H_kv, NQB, GP, RQ, SD = q_rows.shape
    G = group_size
    P, D = k_pool.shape[2], k_pool.shape[3]
    S = SD // D
    R = P // S
    out = torch.zeros(H_kv * G, NQB, n_pages, dtype=torch.float32, device=q_rows.device)
    req, cand = qb_req.tolist(), qb_cand.tolist()
    for b in sorted(set(req)):
        idx = torch.tensor([q for q in range(NQB) if req[q] == b], device=q_rows.device)
        a = max(cand[q] for q in range(NQB) if req[q] == b)
        if a == 0:
            continue
        keys = k_pool[page_table[b, :a].long()].to(torch.float32)               # [a, H_kv, P, D]
        keys = keys.permute(1, 0, 2, 3).reshape(H_kv, a * R, S * D)             # column c: keys c*S..c*S+S-1
        qq = q_rows[:, idx, :G].to(torch.float32)                               # [H_kv, n, G, RQ, S*D]
        s = torch.einsum("hngrd,hcd->hngrc", qq, keys) * scale
        ok = torch.arange(a * R, device=s.device)[None, :] < (qb_cand[idx].long() * R)[:, None]   # [n, cols]
        s = s.masked_fill(~ok[None, :, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0) * row_weight[idx].to(torch.float32)[None, :, None, :, None]
        mass = p.sum(dim=3).reshape(H_kv, len(idx), G, a, R).sum(dim=-1)       # [H_kv, n, G, a]
        out[:, idx, :a] = mass.permute(0, 2, 1, 3).reshape(H_kv * G, len(idx), a)
    return out
