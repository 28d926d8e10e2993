"""Triton KV store with page summaries; reference: `kv_cache_naive.store_kv`.

One launch per layer writes the new keys and values into the head-major pool
and refreshes the summaries of the pages the write ends in: the key sum and
count (mean keys) and, when asked (BOUNDS), the channel-wise key max and min
(Quest's page bounds). Program (b, h) stores head h of a block of BN
consecutive tokens (`block_tokens`: 16 in a long write, so a 1024-token chunk
is one wave of programs, not one program per token); for each token of its
block that is the last one of its page in this write, it also reads that
page's keys at offsets 0..off in offset order, taking the offsets written by
this same launch from its inputs (other programs may not have stored them yet)
and the earlier ones from the pool, and reduces them. A fixed order makes a page's summary
independent of how its tokens were split across writes (chunks, decode steps),
which the selection's reproducibility relies on. The bounds are taken over the
keys as the pool holds them (cast to its dtype), so they are exact in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_compact.kernels.kv_cache_naive import check_summaries
from sglang_compact.kernels.launch import Launcher


@triton.jit
def _store_kv_kernel(k_pool, v_pool, loc, k, v, key_sum, count, key_max, key_min, N, H,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     P: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, SUMMARIZE: tl.constexpr,
                     BOUNDS: tl.constexpr):
    n0 = tl.program_id(0) * BN
    h = tl.program_id(1)
    i = tl.arange(0, BN)
    offs_n = n0 + i
    ok = offs_n < N
    slot = tl.load(loc + offs_n, mask=ok, other=0).to(tl.int64)
    offs_d = tl.arange(0, D)
    rows = offs_n.to(tl.int64)[:, None]
    kn = tl.load(k + rows * stride_kt + h * stride_kh + offs_d[None, :], mask=ok[:, None], other=0.0)
    vn = tl.load(v + rows * stride_vt + h * stride_vh + offs_d[None, :], mask=ok[:, None], other=0.0)
    dst = (((slot // P) * H + h) * P + slot % P)[:, None] * D + offs_d[None, :]
    tl.store(k_pool + dst, kn.to(k_pool.dtype.element_ty), mask=ok[:, None])
    tl.store(v_pool + dst, vn.to(v_pool.dtype.element_ty), mask=ok[:, None])
    if SUMMARIZE:
        nxt = tl.load(loc + tl.minimum(offs_n + 1, N - 1), mask=ok, other=0).to(tl.int64)
        ends = ok & ((offs_n == N - 1) | (nxt // P != slot // P))
        # the block's page ends in token order, one page reduced at a time (a block of a long chunk holds one or
        # two; a decode step's writes are launched one token per block)
        e = n0 * 0 - 1
        for _ in range(0, tl.sum(ends.to(tl.int32), axis=0)):
            e = tl.min(tl.where(ends & (i > e), i, BN), axis=0)
            n = n0 + e
            s_n = tl.sum(tl.where(i == e, slot, 0), axis=0)
            page = s_n // P
            off = s_n % P
            offs_p = tl.arange(0, P)
            upto = offs_p <= off
            m = n - (off - offs_p)                          # input index holding offset p, if this write has it
            m_ok = upto & (m >= 0)
            m_slot = tl.load(loc + tl.maximum(m, 0), mask=m_ok, other=-1).to(tl.int64)
            from_input = m_ok & (m_slot == page * P + offs_p)
            # inputs cast to the pool's dtype first: the summaries are of the keys as the pool holds them
            x_in = tl.load(k + tl.maximum(m, 0).to(tl.int64)[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                           mask=from_input[:, None], other=0.0).to(k_pool.dtype.element_ty).to(tl.float32)
            x_pool = tl.load(k_pool + ((page * H + h) * P + offs_p)[:, None] * D + offs_d[None, :],
                             mask=(upto & ~from_input)[:, None], other=0.0).to(tl.float32)
            s = tl.sum(x_in + x_pool, axis=0)
            tl.store(key_sum + (page * H + h) * D + offs_d, s)
            if BOUNDS:
                # float32 holds every pool value exactly, so the max / min are the pool dtype's
                x = tl.where(from_input[:, None], x_in, x_pool)
                hi = tl.max(tl.where(upto[:, None], x, float("-inf")), axis=0)
                lo = tl.min(tl.where(upto[:, None], x, float("inf")), axis=0)
                tl.store(key_max + (page * H + h) * D + offs_d, hi.to(key_max.dtype.element_ty))
                tl.store(key_min + (page * H + h) * D + offs_d, lo.to(key_min.dtype.element_ty))
            if h == 0:
                tl.store(count + page, (off + 1).to(tl.int32))


_store_kv_launch = Launcher(_store_kv_kernel)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             key_sum: torch.Tensor | None = None, count: torch.Tensor | None = None,
             key_max: torch.Tensor | None = None, key_min: torch.Tensor | None = None, runs: int = 1) -> None:
    """Same contract as `kv_cache_naive.store_kv` (head_dim and page size powers of two). `runs`: how many runs of
    consecutive tokens the write is (an extend's requests; a decode step's tokens are a run each): it only picks the
    tokens per program (`block_tokens`), never the result."""
    check_summaries(key_sum, count, key_max, key_min)
    N = loc.numel()
    if N == 0:
        return
    _, H, P, D = k_pool.shape
    k = k.view(N, H, D)
    v = v.view(N, H, D)
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    summarize = key_sum is not None
    bounds = key_max is not None
    sums = (key_sum if summarize else k_pool, count if summarize else loc, key_max if bounds else k_pool,
            key_min if bounds else k_pool)
    strides = (N, H, k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    bn = block_tokens(N, P, runs)
    flags = dict(P=P, D=D, BN=bn, SUMMARIZE=summarize, BOUNDS=bounds)
    _store_kv_launch((triton.cdiv(N, bn), H), k_pool, v_pool, loc, k, v, *sums, *strides, **flags)


def block_tokens(n: int, page_size: int, runs: int = 1) -> int:
    """Tokens per program: 16 (at most a page) for a write of several pages in runs (requests) of at least that many
    tokens on average, where a block holds one or two page ends; else 1: a short write, or a decode step's, whose
    tokens each end a page (a block of them would reduce its pages one after another, one program each does them
    side by side)."""
    bn = min(16, page_size)
    return bn if n >= 4 * page_size and n >= bn * max(runs, 1) else 1
