"""Triton FlashPrefill block scores; reference: `flashprefill_naive.block_scores`.

One program per (request, kv head, query block): the queries of all G query
heads of the group are stacked into one tile of G * BQ rows, so each pooled
key block is read once per group rather than once per query head. Two passes
over the request's prefix blocks: the first keeps each query's running max and
softmax denominator (online softmax over the blocks' mean keys), the second
recomputes the logits, normalises them and stores, for every (query head,
prefix block), the largest probability any query of the block gives it (with
`group_max`, the largest over the group's heads too: one row per kv head, what
the row-level `budget` ranking needs, at 1/G of the output). Reads
the ragged queries in place (no padded copy); the pooled keys are cast once to
the queries' dtype, and the dot products run on the tensor cores with float32
accumulation, so scores match the float32 reference to the input precision
(bf16 ~ 1e-2 relative).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_scores_kernel(q, cu_chunk, pooled, kv_blocks, out,
                         stride_qt, stride_qh, H_q, H_kv, NKV, NQ, sm_scale,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr,
                         GROUP_MAX: tl.constexpr, QS: tl.constexpr, BQS: tl.constexpr):
    pid_bg = tl.program_id(0)
    i = tl.program_id(1)
    b = pid_bg // H_kv
    g = pid_bg % H_kv
    start = tl.load(cu_chunk + b)
    C = tl.load(cu_chunk + b + 1) - start
    n_b = tl.load(kv_blocks + b)
    # tile rows r = hp * BQS + u: query head g * G + hp, token i * BQ + u * QS (hp < GP, padded heads masked)
    offs_r = tl.arange(0, GP * BQS)
    hp = offs_r // BQS
    offs_t = i * BQ + (offs_r % BQS) * QS
    r_ok = (hp < G) & (offs_t < C)
    h = g * G + hp
    offs_d = tl.arange(0, D)
    qv = tl.load(q + (start + offs_t).to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                 mask=r_ok[:, None], other=0.0)
    k_base = pooled + (b.to(tl.int64) * NKV * H_kv + g) * D
    qk_scale = sm_scale * 1.4426950408889634  # logits in base 2: exp2 is the native instruction
    # pass 1: per-query max and denominator over the valid prefix blocks
    m = tl.full([GP * BQS], float("-inf"), tl.float32)
    l = tl.zeros([GP * BQS], tl.float32)
    n_iter = tl.where((i * BQ < C) & (n_b > 0), n_b, 0)
    for j0 in range(0, n_iter, BN):
        offs_j = j0 + tl.arange(0, BN)
        j_ok = offs_j < n_b
        k = tl.load(k_base + offs_j.to(tl.int64)[:, None] * (H_kv * D) + offs_d[None, :], mask=j_ok[:, None],
                    other=0.0)
        s = tl.dot(qv, tl.trans(k)) * qk_scale
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    # pass 2: normalised probabilities, max over each head's queries of the block
    inv_l = tl.where(r_ok, 1.0 / l, 0.0)
    m = tl.where(r_ok, m, 0.0)
    offs_hp = tl.arange(0, GP)
    if GROUP_MAX:
        out_row = out + ((b.to(tl.int64) * H_kv + g) * NQ + i) * NKV
    else:
        out_rows = out + ((b.to(tl.int64) * H_q + g * G + offs_hp) * NQ + i) * NKV  # [GP]
    for j0 in range(0, NKV, BN):
        offs_j = j0 + tl.arange(0, BN)
        j_ok = offs_j < n_iter
        score = tl.zeros([GP, BN], tl.float32)
        if j0 < n_iter:
            k = tl.load(k_base + offs_j.to(tl.int64)[:, None] * (H_kv * D) + offs_d[None, :], mask=j_ok[:, None],
                        other=0.0)
            s = tl.dot(qv, tl.trans(k)) * qk_scale
            p = tl.exp2(s - m[:, None]) * inv_l[:, None]
            p = tl.where(r_ok[:, None] & j_ok[None, :], p, 0.0)
            score = tl.max(tl.reshape(p, [GP, BQS, BN]), axis=1)
        if GROUP_MAX:
            tl.store(out_row + offs_j, tl.max(score, axis=0), mask=offs_j < NKV)
        else:
            tl.store(out_rows[:, None] + offs_j[None, :], score,
                     mask=(offs_hp < G)[:, None] & (offs_j < NKV)[None, :])


def launch_config(rows: int, NKV: int, group_max: bool) -> dict:
    """BN / num_warps / num_stages for a tile of `rows` stacked queries: the fastest measured on the
    H200 (docs/results/tune_flashprefill.md, from scripts/gpu/tune_flashprefill.py)."""
    bn = 64 if NKV >= 64 else max(16, triton.next_power_of_2(NKV))
    return dict(BN=bn, num_warps=8 if rows >= 256 and not group_max else 4, num_stages=3 if group_max else 2)


def block_scores(q: torch.Tensor, cu_chunk: torch.Tensor, chunk_lens_cpu, pooled_keys: torch.Tensor,
                 kv_blocks: torch.Tensor, sm_scale: float, q_block: int, n_q_blocks: int,
                 group_max: bool = False, config: dict | None = None, query_stride: int = 1) -> torch.Tensor:
    """Same contract as `flashprefill_naive.block_scores` (`config` overrides `launch_config`)."""
    B, NKV, H_kv, D = pooled_keys.shape
    T, H_q, Dq = q.shape
    if Dq != D or D & (D - 1) or D < 16 or q_block < 16:
        raise ValueError(f"block_scores kernel needs a power-of-two head_dim >= 16 and q_block >= 16 "
                         f"(head_dim {D}, q_block {q_block})")
    if query_stride < 1 or query_stride & (query_stride - 1) or q_block % query_stride or q_block // query_stride < 16:
        raise ValueError(f"block_scores kernel: query_stride {query_stride} must be a power of two leaving >= 16 "
                         f"queries of each {q_block}-query block")
    if H_q % H_kv:
        raise ValueError(f"block_scores kernel: {H_q} query heads are not a multiple of {H_kv} kv heads")
    out = torch.empty(B, H_kv if group_max else H_q, n_q_blocks, NKV, dtype=torch.float32, device=q.device)
    if B == 0 or n_q_blocks == 0 or NKV == 0:
        return out.zero_()
    if q.stride(2) != 1:
        q = q.contiguous()
    pooled = pooled_keys.to(q.dtype).contiguous()
    G = H_q // H_kv
    GP = triton.next_power_of_2(G)
    cfg = launch_config(GP * q_block // query_stride, NKV, group_max) if config is None else config
    _block_scores_kernel[(B * H_kv, n_q_blocks)](
        q, cu_chunk.to(torch.int32), pooled, kv_blocks.to(torch.int32), out,
        q.stride(0), q.stride(1), H_q, H_kv, NKV, n_q_blocks, float(sm_scale),
        G=G, GP=GP, D=D, BQ=q_block, BN=cfg["BN"], GROUP_MAX=group_max, QS=query_stride,
        BQS=q_block // query_stride,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
