"""Triton antidiagonal page-mass search (XAttention's estimate); reference: `antidiagonal_naive`.

One program per (tile, kv head g). A tile is up to QPT consecutive q-blocks of one request; its rows are every
(q-block, query head of the group, scored antidiagonal row) of the tile, GP * RQ rows per q-block, so each key column
of the group's context is read once per tile, not once per query head or q-block. The keys come straight from
the pool through the request's page table: a column is S consecutive keys of one page, S * D contiguous
elements of the head-major page, and its score against a row is one dot product of length S * D (the row's
queries are stored flipped, `xattention.antidiagonal_rows`). Two passes over the tile's candidate columns:
the first keeps each row's running max and softmax denominator (online softmax), the second recomputes the
logits and sums the normalised probabilities per page and over the q-block's rows (weighed by `row_weight`),
storing one value per (query head, q-block, page).

Dot products run on the tensor cores in the inputs' dtype with float32 accumulation. bf16 queries and keys
(the model's) multiply exactly in float32, so the result matches the float32 reference up to the order of the
float32 sums; float32 inputs are multiplied in IEEE float32, not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_compact.kernels.launch import Launcher


@triton.jit
def _dots(q_rows, q_off, m_ok, k_pool, pt_row, g, c, c_ok, stride_kp, stride_kh, R: tl.constexpr, SD: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """[BM, BN] float32: each tile row's dot products with columns c (S keys of one page of kv head g, contiguous
    in the head-major page, read through the request's page table)."""
    pid = tl.load(pt_row + c // R, mask=c_ok, other=0).to(tl.int64)
    k_off = pid * stride_kp + g * stride_kh + (c % R) * SD
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    # a plain loop: unrolled (tl.static_range), the compiler hoists every step's query tile out of the caller's
    # column loop, which needs S * D / BK tiles of shared memory at once
    for k0 in range(0, SD, BK):
        qv = tl.load(q_rows + q_off[:, None] + k0 + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        kv = tl.load(k_pool + k_off[:, None] + k0 + offs_k[None, :], mask=c_ok[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(qv, tl.trans(kv), input_precision="ieee")
        else:
            acc += tl.dot(qv, tl.trans(kv))
    return acc


@triton.jit
def _page_mass_kernel(q_rows, k_pool, page_table, qb_req, qb_cand, row_weight, tiles, out,
                      stride_kp, stride_kh, stride_pt, NQB, NKV,
                      qk_scale, G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr, RQ: tl.constexpr,
                      SD: tl.constexpr, QPT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      IEEE: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    qb0 = tl.load(tiles + 2 * t)
    n_qb = tl.load(tiles + 2 * t + 1)
    BM: tl.constexpr = QPT * GP * RQ
    offs_m = tl.arange(0, BM)
    qb_loc = offs_m // (GP * RQ)
    hp = (offs_m // RQ) % GP
    u = offs_m % RQ
    qb = qb0 + qb_loc
    m_ok = (qb_loc < n_qb) & (hp < G)
    qb_c = tl.where(m_ok, qb, qb0)
    lim = tl.where(m_ok, tl.load(qb_cand + qb_c) * R, 0)             # candidate columns of each row
    w = tl.where(m_ok, tl.load(row_weight + qb_c * RQ + u), 0.0)
    n_cols = tl.max(lim, axis=0)
    b = tl.load(qb_req + qb0)
    pt_row = page_table + b.to(tl.int64) * stride_pt
    # row offsets in q_rows [H_kv, NQB, GP, RQ, SD]
    q_off = ((g * NQB + qb_c).to(tl.int64) * (GP * RQ) + hp * RQ + u) * SD
    offs_n = tl.arange(0, BN)
    # pass 1: per-row max and denominator over the candidate columns (logits in base 2)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    for c0 in range(0, n_cols, BN):
        c = c0 + offs_n
        c_ok = c < n_cols
        acc = _dots(q_rows, q_off, m_ok, k_pool, pt_row, g, c, c_ok, stride_kp, stride_kh, R, SD, BM, BN, BK, IEEE)
        s = tl.where(c[None, :] < lim[:, None], acc * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m = m_new
    # pass 2: probabilities, summed per page and over each q-block's rows
    row_ok = l > 0
    coef = tl.where(row_ok, w / tl.where(row_ok, l, 1.0), 0.0)
    m = tl.where(row_ok, m, 0.0)
    PB: tl.constexpr = BN // R
    offs_j = tl.arange(0, PB)
    HQ: tl.constexpr = QPT * GP
    offs_hq = tl.arange(0, HQ)
    o_qb = qb0 + offs_hq // GP
    o_h = g * G + offs_hq % GP
    o_ok = (offs_hq // GP < n_qb) & (offs_hq % GP < G)
    o_row = (o_h.to(tl.int64) * NQB + o_qb) * NKV
    for c0 in range(0, n_cols, BN):
        c = c0 + offs_n
        c_ok = c < n_cols
        acc = _dots(q_rows, q_off, m_ok, k_pool, pt_row, g, c, c_ok, stride_kp, stride_kh, R, SD, BM, BN, BK, IEEE)
        p = tl.where(c[None, :] < lim[:, None], tl.exp2(acc * qk_scale - m[:, None]) * coef[:, None], 0.0)
        per_page = tl.sum(tl.reshape(p, [BM, PB, R]), axis=2)                # [BM, PB]
        per_head = tl.sum(tl.reshape(per_page, [HQ, RQ, PB]), axis=1)        # [QPT * GP, PB]
        j = c0 // R + offs_j
        tl.store(out + o_row[:, None] + j[None, :], per_head, mask=o_ok[:, None] & (j < NKV)[None, :])


#: launch parameters chosen on the H200 by scripts/gpu/tune_antidiagonal.py (each checked against the twin there):
#: the fastest on the Qwen2.5-0.5B shape and within 17% of the fastest on the 128K 8B one
#: (docs/results/tune_antidiagonal.md); BN is raised to a page's columns where a page has more
DEFAULT_CONFIG = {"rows": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3}


_page_mass_launch = Launcher(_page_mass_kernel)


def qblocks_per_tile(group_size: int, rows_per_page: int, target_rows: int = DEFAULT_CONFIG["rows"]) -> int:
    """q-blocks per tile: as many as fill about `target_rows` rows (at least one; the rows are a power of
    two of at least 16, what tl.dot needs)."""
    per_qb = triton.next_power_of_2(group_size) * rows_per_page
    return max(1, triton.next_power_of_2(max(target_rows, 16)) // per_qb, triton.cdiv(16, per_qb))


def make_tiles(qb_req: list[int] | tuple[int, ...], per_tile: int) -> list[tuple[int, int]]:
    """(first q-block, count) per tile: runs of at most `per_tile` consecutive q-blocks of one request."""
    tiles = []
    i = 0
    while i < len(qb_req):
        j = i
        while j < len(qb_req) and j - i < per_tile and qb_req[j] == qb_req[i]:
            j += 1
        tiles.append((i, j - i))
        i = j
    return tiles


def supports(head_dim: int, page_size: int, stride: int) -> bool:
    """Power-of-two head_dim >= 16, stride dividing the page (power-of-two page)."""
    return (head_dim >= 16 and not head_dim & (head_dim - 1) and page_size % stride == 0
            and not page_size & (page_size - 1))


def page_mass(q_rows: torch.Tensor, k_pool: torch.Tensor, page_table: torch.Tensor, qb_req: torch.Tensor,
              qb_cand: torch.Tensor, row_weight: torch.Tensor, group_size: int, n_pages: int, scale: float,
              tiles: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Same contract as `antidiagonal_naive.page_mass`. `tiles`: int32 [T, 2] from `make_tiles(qb_req,
    qblocks_per_tile(G, RQ))` (by default computed here, which reads `qb_req` on the host). `config`: launch
    parameters BN, BK, num_warps, num_stages and `rows` (the tile's target rows; tiles are then computed here)."""
    H_kv, NQB, GP, RQ, SD = q_rows.shape
    P, D = k_pool.shape[2], k_pool.shape[3]
    if k_pool.stride(3) != 1 or k_pool.stride(2) != D:
        raise ValueError("antidiagonal kernel: each page's keys must be contiguous [P, D]")
    R = P // (SD // D)                                   # columns per page
    if R * (SD // D) != P or GP & (GP - 1) or R & (R - 1) or RQ & (RQ - 1) or RQ > R:
        raise ValueError(f"antidiagonal kernel: page {P}, stride {SD // D}, {RQ} rows per q-block: "
                         "not powers of two dividing the page")
    out = torch.zeros(H_kv * group_size, NQB, n_pages, dtype=torch.float32, device=q_rows.device)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    qpt = qblocks_per_tile(group_size, RQ, cfg["rows"])
    if tiles is None or (config and "rows" in config):
        tiles = torch.tensor(make_tiles(qb_req.tolist(), qpt), dtype=torch.int32, device=q_rows.device)
    if NQB == 0 or n_pages == 0 or tiles.numel() == 0:
        return out
    q_rows = q_rows.contiguous()
    BN = max(cfg["BN"], R)
    BK = min(cfg["BK"], SD)
    _page_mass_launch(
        (tiles.shape[0], H_kv),
        q_rows, k_pool, page_table, qb_req, qb_cand, row_weight.contiguous(), tiles, out,
        k_pool.stride(0), k_pool.stride(1), page_table.stride(0), NQB, n_pages,
        float(scale) * 1.4426950408889634, G=group_size, GP=GP, R=R, RQ=RQ, SD=SD, QPT=qpt, BN=BN, BK=BK,
        IEEE=q_rows.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
