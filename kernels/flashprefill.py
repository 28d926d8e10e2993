"""Triton FlashPrefill search over page summaries; reference: `flashprefill_naive`.

One program per (kv head g, q-block q): the queries of all G query heads of
the group are stacked into one tile of G * P / query_stride rows, so each
candidate page's mean key is read once per group. The mean keys come straight
from the page summaries (`key_sum / count`, addressed through the page table),
so no pooled copy is made. Two passes over the q-block's candidate pages (those
before its window): the first keeps each query's running max and softmax
denominator l (online softmax), the second recomputes the logits and either
stores, per (query head or group, page), the largest probability any query of
the q-block gives it (`block_scores`), that over its head's best score, maxed
over the group (`ratio_scores`: what `threshold_mask` compares with alpha), or
thresholds them in place (`threshold_mask`): a head keeps page j when its score reaches alpha x the
head's best score, and a query's best probability is exactly 1 / l (its
largest logit), so the best score is known after the first pass; the kv
head's mask (OR over the group's heads) is written directly. The union over a
window's q-blocks and the forced pages follow (`kernels/union.py`).

When one program per (kv head, q-block) would leave most of the GPU idle (one chunk after a long prefix:
Llama-3.1-8B heads, chunk 1024, are 128 programs over thousands of pages each), SPLIT programs share each
q-block's pages (`launch_config`): a first launch writes each share's per-query max and denominator, a
second combines them and writes its share of the output columns.

With `key_bounds` (each page's per-channel key max and min, `summaries.PageSummaries(key_bounds=True)`) a
page's logit is Quest's upper bound q+ . kmax + q- . kmin on every q . k of the page instead of q . mean key:
two dot products per tile, the rest unchanged (`quest_budget`).

Dot products run on the tensor cores in the queries' dtype with float32
accumulation, so scores match the float32 reference to the input precision
(bf16 ~ 1e-2 relative).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_compact.kernels.launch import Launcher

SCORES, GROUP_SCORES, THRESHOLD, GROUP_RATIO = 0, 1, 2, 3


@triton.jit
def _search_kernel(q, qb_req, qb_cand, qb_start, qb_len, page_table, key_sum, count, key_max, key_min, out, stats,
                   stride_qt, stride_qh, stride_pt, H_q, H_kv, NQB, NKV, sm_scale, alpha,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr,
                   QS: tl.constexpr, BQS: tl.constexpr, SPLIT: tl.constexpr, PHASE: tl.constexpr,
                   BOUNDS: tl.constexpr, HC: tl.constexpr, GPC: tl.constexpr):
    g = tl.program_id(0)
    qi = tl.program_id(1)
    sp = tl.program_id(2)
    b = tl.load(qb_req + qi)
    n_iter = tl.load(qb_cand + qi)   # candidates: the pages before the q-block's window (none for a dense one)
    start = tl.load(qb_start + qi)
    n_q = tl.load(qb_len + qi)
    pt_row = page_table + b.to(tl.int64) * stride_pt
    qk_scale = sm_scale * 1.4426950408889634  # logits in base 2: exp2 is the native instruction
    offs_d = tl.arange(0, D)
    # the group's GP heads in HC chunks of GPC, one after another: a tile (two with BOUNDS) of GP * BQS rows
    # would not fit in shared memory for 8 heads x 64 queries x head_dim 128 (`head_chunks`)
    for hc in tl.static_range(HC):
        # tile rows r = hp * BQS + u: query head g * G + hc * GPC + hp, token start + u * QS (padded heads masked)
        offs_r = tl.arange(0, GPC * BQS)
        hp = hc * GPC + offs_r // BQS
        offs_u = (offs_r % BQS) * QS
        r_ok = (hp < G) & (offs_u < n_q)
        h = g * G + hp
        qv = tl.load(q + (start + offs_u).to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh
                     + offs_d[None, :], mask=r_ok[:, None], other=0.0)
        # with BOUNDS a page's logit is Quest's bound q+ . kmax + q- . kmin: q_pos holds q+, q_neg q- (else q_pos
        # is q)
        if BOUNDS:
            q_pos = tl.maximum(qv, 0.0).to(qv.dtype)
            q_neg = tl.minimum(qv, 0.0).to(qv.dtype)
        else:
            q_pos = qv
            q_neg = qv
        # pass 1: per-query max and denominator over the candidate pages (PHASE 1: over this split's share of
        # them, stored to `stats`; PHASE 2: the splits' shares combined)
        m = tl.full([GPC * BQS], float("-inf"), tl.float32)
        l = tl.zeros([GPC * BQS], tl.float32)
        stats_rows = hc * GPC * BQS + offs_r
        if PHASE == 2:
            for t in range(0, SPLIT):
                part = stats + ((t * H_kv + g) * NQB + qi).to(tl.int64) * (2 * GP * BQS) + stats_rows
                m_t = tl.load(part)
                m = tl.maximum(m, m_t)
            for t in range(0, SPLIT):
                part = stats + ((t * H_kv + g) * NQB + qi).to(tl.int64) * (2 * GP * BQS) + stats_rows
                m_t = tl.load(part)
                l_t = tl.load(part + GP * BQS)
                l += tl.where(l_t > 0, l_t * tl.exp2(m_t - m), 0.0)
        else:
            lo1 = 0
            hi1 = n_iter
            if PHASE == 1:
                share = tl.cdiv(tl.cdiv(n_iter, SPLIT), BN) * BN
                lo1 = sp * share
                hi1 = tl.minimum(n_iter, lo1 + share)
            for j0 in range(lo1, hi1, BN):
                offs_j = j0 + tl.arange(0, BN)
                j_ok = offs_j < hi1
                s = _page_logits(q_pos, q_neg, pt_row, offs_j, j_ok, key_sum, count, key_max, key_min, g, H_kv,
                                 offs_d, D, BOUNDS) * qk_scale
                s = tl.where(j_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
                m = m_new
        if PHASE == 1:
            stats_row = stats + ((sp * H_kv + g) * NQB + qi).to(tl.int64) * (2 * GP * BQS) + stats_rows
            tl.store(stats_row, m)
            tl.store(stats_row + GP * BQS, l)
        else:
            if hc > 0:
                tl.debug_barrier()   # the previous chunk's output columns, read back below, are written
            _scores_out(out, q_pos, q_neg, m, l, r_ok, pt_row, key_sum, count, key_max, key_min, g, qi, sp, H_kv,
                        NQB, NKV, n_iter, qk_scale, alpha, offs_d, hc * GPC, hc > 0, G, GPC, D, BN, MODE, BQS,
                        SPLIT, BOUNDS)


_search_launch = Launcher(_search_kernel)


@triton.jit
def _page_logits(q_pos, q_neg, pt_row, offs_j, j_ok, key_sum, count, key_max, key_min, g, H_kv, offs_d, D: tl.constexpr,
                 BOUNDS: tl.constexpr):
    # unscaled logits [rows, BN] of the query tile against pages offs_j of the row: q . mean key, or with
    # BOUNDS q+ . kmax + q- . kmin (the summaries in the pool's dtype, exact)
    pid = tl.load(pt_row + offs_j, mask=j_ok, other=0).to(tl.int64)
    cell = (pid * H_kv + g)[:, None] * D + offs_d[None, :]
    if BOUNDS:
        kmax = tl.load(key_max + cell, mask=j_ok[:, None], other=0.0).to(q_pos.dtype)
        kmin = tl.load(key_min + cell, mask=j_ok[:, None], other=0.0).to(q_pos.dtype)
        s = tl.dot(q_pos, tl.trans(kmax)) + tl.dot(q_neg, tl.trans(kmin))
    else:
        inv_n = 1.0 / tl.maximum(tl.load(count + pid, mask=j_ok, other=1), 1).to(tl.float32)
        k = tl.load(key_sum + cell, mask=j_ok[:, None], other=0.0)
        s = tl.dot(q_pos, tl.trans((k * inv_n[:, None]).to(q_pos.dtype)))
    return s


@triton.jit
def _scores_out(out, q_pos, q_neg, m, l, r_ok, pt_row, key_sum, count, key_max, key_min, g, qi, sp, H_kv, NQB, NKV,
                n_iter, qk_scale, alpha, offs_d, HP0: tl.constexpr, COMBINE: tl.constexpr, G: tl.constexpr,
                GPC: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr, BQS: tl.constexpr,
                SPLIT: tl.constexpr, BOUNDS: tl.constexpr):
    # pass 2 for heads HP0 .. HP0 + GPC of the group: normalised probabilities, max over each head's queries of
    # the q-block; a group output (MODE >= 1) with COMBINE folds in what the group's earlier heads stored
    valid_row = r_ok & (l > 0)
    inv_l = tl.where(valid_row, 1.0 / l, 0.0)
    m = tl.where(valid_row, m, 0.0)
    offs_hp = HP0 + tl.arange(0, GPC)
    row = g * NQB + qi
    if MODE >= 2:
        best = tl.max(tl.reshape(inv_l, [GPC, BQS]), axis=1)      # [GPC] each head's best score
        thr = alpha * best
        head_ok = (offs_hp < G) & (best > 0)
        inv_best = tl.where(head_ok, 1.0 / tl.where(head_ok, best, 1.0), 0.0)
        out_row = out + row.to(tl.int64) * NKV
    elif MODE == 1:
        out_row = out + row.to(tl.int64) * NKV
    else:
        out_rows = out + ((g * G + offs_hp).to(tl.int64) * NQB + qi) * NKV  # [GPC]
    lo2 = 0
    hi2 = NKV
    if SPLIT > 1:   # this split's share of the output columns
        share = tl.cdiv(tl.cdiv(NKV, SPLIT), BN) * BN
        lo2 = sp * share
        hi2 = tl.minimum(NKV, lo2 + share)
    for j0 in range(lo2, hi2, BN):
        offs_j = j0 + tl.arange(0, BN)
        j_ok = offs_j < n_iter
        col_ok = offs_j < hi2
        score = tl.zeros([GPC, BN], tl.float32)
        if j0 < n_iter:
            s = _page_logits(q_pos, q_neg, pt_row, offs_j, j_ok, key_sum, count, key_max, key_min, g, H_kv, offs_d, D,
                             BOUNDS) * qk_scale
            p = tl.exp2(s - m[:, None]) * inv_l[:, None]
            p = tl.where(valid_row[:, None] & j_ok[None, :], p, 0.0)
            score = tl.max(tl.reshape(p, [GPC, BQS, BN]), axis=1)
        if MODE == 2:
            keep = (score >= thr[:, None]) & head_ok[:, None] & j_ok[None, :]
            keep_any = tl.max(keep.to(tl.int32), axis=0)
            if COMBINE:
                keep_any = tl.maximum(keep_any, tl.load(out_row + offs_j, mask=col_ok, other=0).to(tl.int32))
            tl.store(out_row + offs_j, (keep_any > 0).to(tl.int8), mask=col_ok)
        elif MODE == 3:
            ratio = tl.max(tl.where(head_ok[:, None] & j_ok[None, :], score * inv_best[:, None], 0.0), axis=0)
            if COMBINE:
                ratio = tl.maximum(ratio, tl.load(out_row + offs_j, mask=col_ok, other=0.0))
            tl.store(out_row + offs_j, ratio, mask=col_ok)
        elif MODE == 1:
            group = tl.max(score, axis=0)
            if COMBINE:
                group = tl.maximum(group, tl.load(out_row + offs_j, mask=col_ok, other=0.0))
            tl.store(out_row + offs_j, group, mask=col_ok)
        else:
            tl.store(out_rows[:, None] + offs_j[None, :], score, mask=(offs_hp < G)[:, None] & col_ok[None, :])


def launch_config(rows: int, NKV: int, group_max: bool, programs: int = 0, sms: int = 0,
                  splittable: bool = True) -> dict:
    """BN / num_warps / num_stages for a tile of `rows` stacked queries: the fastest measured on the
    H200 (docs/results/tune_flashprefill.md, from scripts/gpu/tune_flashprefill.py); SPLIT: how many programs
    share each q-block's pages, when its `programs` (kv heads x q-blocks) would leave most of the GPU's `sms`
    idle (a batch of one chunk after a long prefix: one program per SM, each over thousands of pages).

    The split paid on the H200 only where a q-block has at least MIN_SPLIT_PAGES pages and each share at least
    4 tiles, and not for the threshold mask (`splittable` False), whose second phase re-derives each head's best
    page (docs/results/split_search.md: 1.38-1.41x for the group max at 78K-128K, 0.64-0.91x for the threshold,
    0.84-0.88x at 32K)."""
    bn = 64 if NKV >= 64 else max(16, triton.next_power_of_2(NKV))
    split = 1
    if splittable and programs and sms and programs < 2 * sms and NKV >= MIN_SPLIT_PAGES:
        split = max(1, min(-(-4 * sms // programs), NKV // (4 * bn), MAX_SPLIT))
    return dict(BN=bn, num_warps=8 if rows >= 256 and not group_max else 4, num_stages=3 if group_max else 2,
                SPLIT=split)


def head_chunks(GP: int, BQS: int, D: int, itemsize: int, bounds: bool) -> int:
    """How many chunks a program takes its group's GP (padded) query heads in, one after another: the query
    tile (two, q+ and q-, with key bounds) of a chunk stays within MAX_QUERY_TILE_BYTES. One but for the bounds
    at 8 heads x 64 queries x head_dim 128 in bf16 (two 128 KiB tiles do not fit in the H200's 227 KiB of
    shared memory beside the pages' tiles: Triton's OutOfResources)."""
    tile = GP * BQS * D * itemsize * (2 if bounds else 1)
    hc = 1
    while hc < GP and tile // hc > MAX_QUERY_TILE_BYTES:
        hc *= 2
    return hc


MAX_QUERY_TILE_BYTES = 128 * 1024
MAX_SPLIT = 8
MIN_SPLIT_PAGES = 1024
_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


#: the fewest scored queries of a q-block (page_size / query_stride) the kernel tiles (tl.dot's minimum)
MIN_QUERY_TILE = 16


def supports(head_dim: int, page_size: int, query_stride: int = 1) -> bool:
    """Whether the kernel can run these shapes: it tiles head_dim and each q-block's scored queries
    (page_size / query_stride) as power-of-two blocks of at least MIN_QUERY_TILE."""
    D, BQS = head_dim, page_size // max(query_stride, 1)
    return (D >= 16 and not D & (D - 1) and page_size % max(query_stride, 1) == 0 and BQS >= MIN_QUERY_TILE
            and not BQS & (BQS - 1))


# the scores' kernels write every cell of their output (zeros past a q-block's candidates): it is not cleared
def _launch(mode, q, qb, page_table, key_sum, count, sm_scale, num_kv_heads, n_pages, query_stride, config,
            alpha=0.0, out=None, page_size=None, key_bounds=None):
    T, H_q, D = q.shape
    NQB = qb["cand"].numel()
    P = page_size
    if not supports(D, P, query_stride):
        raise ValueError(f"flashprefill kernel: head_dim {D}, page size {P}, query_stride {query_stride} unsupported")
    if H_q % num_kv_heads:
        raise ValueError(f"flashprefill kernel: {H_q} query heads are not a multiple of {num_kv_heads} kv heads")
    if NQB == 0 or n_pages == 0:
        return
    if key_bounds is not None and any(t.shape != key_sum.shape or not t.is_contiguous() for t in key_bounds):
        raise ValueError(f"flashprefill kernel: key_max / key_min must be contiguous {tuple(key_sum.shape)} "
                         f"like key_sum, got {[tuple(t.shape) for t in key_bounds]}")
    key_max, key_min = key_bounds if key_bounds is not None else (key_sum, key_sum)
    if q.stride(2) != 1:
        q = q.contiguous()
    G = H_q // num_kv_heads
    GP = triton.next_power_of_2(G)
    grouped = mode in (GROUP_SCORES, GROUP_RATIO)
    if config is None:
        config = launch_config(GP * P // query_stride, n_pages, grouped, num_kv_heads * NQB, _sm_count(q.device),
                               splittable=mode != THRESHOLD)
    split = config.get("SPLIT", 1)
    BQS = P // query_stride
    hc = config.get("HC") or head_chunks(GP, BQS, D, q.element_size(), key_bounds is not None)
    if GP % hc:
        raise ValueError(f"flashprefill kernel: {hc} head chunks do not divide the group's {GP} padded heads")
    # split: PHASE 1 writes each share's softmax statistics (max, denominator per query row), PHASE 2 combines
    # them and writes its share of the output columns; else one PHASE 0 program per (kv head, q-block)
    stats = torch.empty(split * num_kv_heads * NQB * 2 * GP * BQS, dtype=torch.float32, device=q.device) \
        if split > 1 else out
    for phase in ((1, 2) if split > 1 else (0,)):
        _search_launch(
            (num_kv_heads, NQB, split),
            q, qb["req"], qb["cand"], qb["start"], qb["length"], page_table, key_sum, count, key_max, key_min, out,
            stats,
            q.stride(0), q.stride(1), page_table.stride(0), H_q, num_kv_heads, NQB, n_pages, float(sm_scale),
            float(alpha), G=G, GP=GP, D=D, BN=config["BN"], MODE=mode, QS=query_stride, BQS=BQS, SPLIT=split,
            PHASE=phase, BOUNDS=key_bounds is not None, HC=hc, GPC=GP // hc, num_warps=config["num_warps"],
            num_stages=config["num_stages"])


def block_scores(q: torch.Tensor, qb: dict, page_table: torch.Tensor, key_sum: torch.Tensor, count: torch.Tensor,
                 sm_scale: float, num_kv_heads: int, n_pages: int, group_max: bool = False,
                 query_stride: int = 1, config: dict | None = None, page_size: int | None = None,
                 key_bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Same contract as `flashprefill_naive.block_scores` (`page_size`: the q-block size, required)."""
    H = num_kv_heads if group_max else q.shape[1]
    out = torch.empty(H, qb["cand"].numel(), n_pages, dtype=torch.float32, device=q.device)
    _launch(GROUP_SCORES if group_max else SCORES, q, qb, page_table, key_sum, count, sm_scale, num_kv_heads,
            n_pages, query_stride, config, out=out, page_size=page_size, key_bounds=key_bounds)
    return out


def ratio_scores(q: torch.Tensor, qb: dict, page_table: torch.Tensor, key_sum: torch.Tensor, count: torch.Tensor,
                 sm_scale: float, num_kv_heads: int, n_pages: int, query_stride: int = 1, config: dict | None = None,
                 page_size: int | None = None) -> torch.Tensor:
    """Same contract as `flashprefill_naive.ratio_scores`."""
    out = torch.empty(num_kv_heads, qb["cand"].numel(), n_pages, dtype=torch.float32, device=q.device)
    _launch(GROUP_RATIO, q, qb, page_table, key_sum, count, sm_scale, num_kv_heads, n_pages, query_stride, config,
            out=out, page_size=page_size)
    return out


def threshold_mask(q: torch.Tensor, qb: dict, page_table: torch.Tensor, key_sum: torch.Tensor, count: torch.Tensor,
                   sm_scale: float, num_kv_heads: int, n_pages: int, alpha: float, query_stride: int = 1,
                   config: dict | None = None, page_size: int | None = None) -> torch.Tensor:
    """Same contract as `flashprefill_naive.threshold_mask`."""
    NQB = qb["cand"].numel()
    mask = torch.zeros(num_kv_heads, NQB, n_pages, dtype=torch.bool, device=q.device)
    _launch(THRESHOLD, q, qb, page_table, key_sum, count, sm_scale, num_kv_heads, n_pages, query_stride, config,
            alpha=alpha, out=mask.view(torch.int8), page_size=page_size)
    return mask
