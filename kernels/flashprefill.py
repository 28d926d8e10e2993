"""Triton FlashPrefill block scores; reference: `flashprefill_naive.block_scores`.

One program per (request, query head, query block). Two passes over the
request's prefix blocks: the first keeps each query's running max and
softmax denominator (online softmax over the blocks' mean keys), the second
recomputes the logits, normalises them and stores, for every prefix block, the
largest probability any query of the block gives it. Reads the ragged queries
in place (no padded copy); the dot products run on the tensor cores in the
queries' dtype with float32 accumulation, so scores match the float32
reference to the input precision (bf16 ~ 1e-2 relative).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_scores_kernel(q, cu_chunk, pooled, kv_blocks, out,
                         stride_qt, stride_qh, H_q, H_kv, NKV, NQ, sm_scale,
                         G: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr):
    pid_bh = tl.program_id(0)
    i = tl.program_id(1)
    b = pid_bh // H_q
    h = pid_bh % H_q
    g = h // G
    start = tl.load(cu_chunk + b)
    C = tl.load(cu_chunk + b + 1) - start
    n_b = tl.load(kv_blocks + b)
    out_row = out + ((b.to(tl.int64) * H_q + h) * NQ + i) * NKV
    offs_t = i * BQ + tl.arange(0, BQ)
    t_ok = offs_t < C
    offs_d = tl.arange(0, D)
    qv = tl.load(q + (start + offs_t).to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                 mask=t_ok[:, None], other=0.0)
    k_base = pooled + (b.to(tl.int64) * NKV * H_kv + g) * D
    # pass 1: per-query max and denominator over the valid prefix blocks
    m = tl.full([BQ], float("-inf"), tl.float32)
    l = tl.zeros([BQ], tl.float32)
    n_iter = tl.where((i * BQ < C) & (n_b > 0), n_b, 0)
    for j0 in range(0, n_iter, BN):
        offs_j = j0 + tl.arange(0, BN)
        j_ok = offs_j < n_b
        k = tl.load(k_base + offs_j.to(tl.int64)[:, None] * (H_kv * D) + offs_d[None, :], mask=j_ok[:, None],
                    other=0.0).to(qv.dtype)
        s = tl.dot(qv, tl.trans(k)) * sm_scale
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
    # pass 2: normalised probabilities, max over the block's queries
    inv_l = tl.where(t_ok, 1.0 / l, 0.0)
    for j0 in range(0, NKV, BN):
        offs_j = j0 + tl.arange(0, BN)
        j_ok = offs_j < n_iter
        score = tl.zeros([BN], tl.float32)
        if j0 < n_iter:
            k = tl.load(k_base + offs_j.to(tl.int64)[:, None] * (H_kv * D) + offs_d[None, :], mask=j_ok[:, None],
                        other=0.0).to(qv.dtype)
            s = tl.dot(qv, tl.trans(k)) * sm_scale
            p = tl.exp(s - m[:, None]) * inv_l[:, None]
            p = tl.where(t_ok[:, None] & j_ok[None, :], p, 0.0)
            score = tl.max(p, axis=0)
        tl.store(out_row + offs_j, score, mask=offs_j < NKV)


def block_scores(q: torch.Tensor, cu_chunk: torch.Tensor, chunk_lens_cpu, pooled_keys: torch.Tensor,
                 kv_blocks: torch.Tensor, sm_scale: float, q_block: int, n_q_blocks: int) -> torch.Tensor:
    """Same contract as `flashprefill_naive.block_scores`."""
    B, NKV, H_kv, D = pooled_keys.shape
    T, H_q, Dq = q.shape
    if Dq != D or D & (D - 1) or D < 16 or q_block < 16:
        raise ValueError(f"block_scores kernel needs a power-of-two head_dim >= 16 and q_block >= 16 "
                         f"(head_dim {D}, q_block {q_block})")
    out = torch.empty(B, H_q, n_q_blocks, NKV, dtype=torch.float32, device=q.device)
    if B == 0 or n_q_blocks == 0 or NKV == 0:
        return out.zero_()
    if q.stride(2) != 1:
        q = q.contiguous()
    pooled = pooled_keys.contiguous()
    bn = 64 if NKV >= 64 else max(16, triton.next_power_of_2(NKV))
    _block_scores_kernel[(B * H_q, n_q_blocks)](
        q, cu_chunk.to(torch.int32), pooled, kv_blocks.to(torch.int32), out,
        q.stride(0), q.stride(1), H_q, H_kv, NKV, n_q_blocks, float(sm_scale),
        G=H_q // H_kv, D=D, BQ=q_block, BN=bn, num_warps=4 if q_block <= 64 else 8)
    return out
