"""The benchmark's inputs: structured synthetic chunk batches in an HND page pool (each request's context: its
prefix and the chunk's own K/V, as the server writes them before attention), and their page summaries."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang_compact.batch import ChunkBatch, cdiv, gather_chunk_kv
from sglang_compact.summaries import LayerSummaries


@dataclass
class GenParams:
    """Structure of the synthetic inputs (all strengths in nats of the attention logit).

    Every kv head g has a shared direction u0 (the one every query leans towards) and `topics`
    orthogonal topic directions. A prefix block j carries topic weights w_j ~ N(0, 1) scaled so that a
    query block's logit for block j varies by `spread` nats (std) across blocks; `heavy_blocks` random
    blocks per (request, kv head) get +`heavy_nats` along u0; the first `sink_tokens` tokens get
    +`sink_nats`; the last `window_tokens` prefix tokens a ramp up to +`window_nats` (recency).
    Each query block of each query head mixes a per-(request, kv head) shared topic vector (weight
    `rho`) with an independent one, so query blocks and the heads of a group want overlapping but
    different blocks: the unions inflate density as they do on real models. Token-level noise keeps
    per-token logits at std ~1.
    """

    topics: int = 32
    spread: float = 2.0
    rho: float = 0.8
    heavy_blocks: int = 8
    heavy_nats: float = 3.0
    sink_tokens: int = 4
    sink_nats: float = 8.0
    window_tokens: int = 256
    window_nats: float = 2.0

    def describe(self) -> str:
        return "structured(" + ",".join(f"{k}={v}" for k, v in self.__dict__.items()) + ")"


def structured_batch(prefix_lens: list[int], chunk_lens: list[int], H_q: int, H_kv: int, D: int, P: int, *,
                     device: torch.device, dtype: torch.dtype, seed: int, gp: GenParams,
                     extra_pages: int = 3, window_pages: int | None = None) -> ChunkBatch:
    """A ChunkBatch whose contexts (prefix + chunk) lie in shuffled pages of an HND pool, generated on `device`.

    The prefix keys carry the structure of `GenParams`; the chunk's keys and values are noise (written into the
    pool at the chunk's positions, and kept as `k_chunk` / `v_chunk` for the kernels that read them ragged).
    Queries mix topics per q-block (the chunk's tokens in one absolute page). Union windows of `window_pages`
    pages (default: `ChunkBatch`'s); every window reads a selection."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)

    B, G = len(prefix_lens), H_q // H_kv
    ctx = [L + C for L, C in zip(prefix_lens, chunk_lens)]
    n_pages = [cdiv(E, P) for E in ctx]
    total = sum(n_pages) + extra_pages
    perm = torch.randperm(total, generator=g, device=dev).to(torch.int32)
    page_table = torch.zeros(B, max(n_pages + [1]), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(n_pages):
        page_table[b, :n] = perm[used:used + n]
        used += n
    m = max(1, min(gp.topics, D - 1))
    # orthonormal directions per kv head, norm sqrt(D): q.k * D^-0.5 = sqrt(D) per unit coefficient
    U = torch.linalg.qr(randn(H_kv, D, m + 1))[0].transpose(1, 2).contiguous() * D ** 0.5  # [H_kv, m+1, D]
    unit = D ** 0.5
    k_pool = randn(total, H_kv, P, D, dt=dtype)
    v_pool = randn(total, H_kv, P, D, dt=dtype)
    for b, L in enumerate(prefix_lens):
        n = cdiv(L, P)  # pages holding prefix tokens (the last may be shared with the chunk)
        if n == 0:
            continue
        W = randn(n, H_kv, m) * (gp.spread / unit)
        w0 = torch.zeros(n, H_kv, device=dev)
        if gp.heavy_blocks > 0:
            heavy = torch.rand(n, H_kv, generator=g, device=dev).argsort(dim=0)[:min(gp.heavy_blocks, n)]
            w0.scatter_(0, heavy, gp.heavy_nats / unit)
        block_sig = torch.einsum("nhm,hmd->nhd", W, U[:, 1:]) + w0[..., None] * U[None, :, 0]  # [n, H_kv, D]
        tok_boost = torch.zeros(n * P, device=dev)
        tok_boost[:min(gp.sink_tokens, L)] += gp.sink_nats
        if gp.window_tokens > 0 and L > 0:
            ws = max(L - gp.window_tokens, 0)
            tok_boost[ws:L] += gp.window_nats * torch.arange(1, L - ws + 1, device=dev, dtype=torch.float32) / gp.window_tokens
        is_prefix = (torch.arange(n * P, device=dev) < L).view(n, P)
        pages = page_table[b, :n].long()
        for s in range(0, n, 4096):  # bounded temporaries
            e = min(n, s + 4096)
            sig = block_sig[s:e, :, None, :] + (tok_boost.view(n, P)[s:e, None, :, None] / unit) * U[None, :, 0, None, :]
            k_pool[pages[s:e]] += (sig * is_prefix[s:e, None, :, None]).to(dtype)
    T = sum(chunk_lens)
    q = randn(T, H_q, D)
    start = 0
    for b, (L, C) in enumerate(zip(prefix_lens, chunk_lens)):
        if C == 0:
            continue
        nq = cdiv(L + C, P) - L // P  # q-blocks: absolute pages L // P .. of the chunk's tokens
        shared = randn(H_kv, 1, m)
        ind = randn(H_kv, G * nq, m)
        A = gp.rho * shared / shared.norm(dim=-1, keepdim=True) + math.sqrt(max(0.0, 1 - gp.rho ** 2)) * ind / ind.norm(dim=-1, keepdim=True)
        A = (A / A.norm(dim=-1, keepdim=True)).view(H_kv, G, nq, m)
        qs = torch.einsum("hgim,hmd->ihgd", A, U[:, 1:]) + U[:, 0][None, :, None, :]  # [nq, H_kv, G, D]
        qblock = (L + torch.arange(C, device=dev)) // P - L // P
        q[start:start + C] += qs.reshape(nq, H_q, D)[qblock]
        start += C
    # the chunk's own K/V as the server has them: in the pool at the chunk's positions (noise written above)
    k_chunk, v_chunk = gather_chunk_kv(k_pool, v_pool, page_table, prefix_lens, chunk_lens)
    return ChunkBatch.build(q.to(dtype), k_pool, v_pool, page_table, prefix_lens, chunk_lens,
                            k_chunk=k_chunk, v_chunk=v_chunk, window_pages=window_pages)


def fill_summaries(batch: ChunkBatch) -> LayerSummaries:
    """Page summaries of the pool as serving would hold them (sum and count of each context page's written keys,
    and their channel max / min, which `quest_budget` reads)."""
    return LayerSummaries.from_pool(batch.k_pool, batch.page_table, batch.context_lens_cpu(), key_bounds=True)
