"""Synthetic chunk batches for tests and benchmarks.

`random_batch` scatters each request's context (its cached prefix and the
chunk's own tokens, whose K/V are already in the pool, as the server writes
them before attention) over random, shuffled pages of a shared pool; prefix
lengths need not be page multiples. With `structured=True` the keys carry
attention structure that real models show: a few sink tokens and a handful of
"heavy" pages per kv head whose keys align with the queries, so threshold
selectors have something to find.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_compact.batch import ChunkBatch, cdiv, gather_chunk_kv
from sglang_compact.summaries import LayerSummaries


def random_batch(prefix_lens: Sequence[int], chunk_lens: Sequence[int], *, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: int = 0, structured: bool = False, heavy_blocks: int = 4, extra_pages: int = 3,
                 share_prefix: bool = False, sparse_ranges: Sequence[tuple[int, int]] | None = None,
                 window_pages: int | None = None) -> ChunkBatch:
    """A batch whose pool holds every context in shuffled pages (plus unused pages).

    share_prefix: requests 1.. reuse request 0's full prefix pages where their prefixes overlap
        (radix-cache sharing); their other pages differ.
    sparse_ranges: per request, the windows that read a selection (default: all).
    window_pages: pages per union window (default: 1024 tokens).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, P = len(prefix_lens), page_size
    ctx = [L + C for L, C in zip(prefix_lens, chunk_lens)]
    n_pages = [cdiv(E, P) for E in ctx]
    total = sum(n_pages) + extra_pages
    perm = torch.randperm(max(total, 1), generator=g)
    page_table = torch.zeros(B, max(n_pages + [1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_pages):
        page_table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    if share_prefix and B > 1:
        for b in range(1, B):
            shared = min(prefix_lens[b], prefix_lens[0]) // P
            page_table[b, :shared] = page_table[0, :shared]
    D, Hq, Hk = head_dim, num_q_heads, num_kv_heads
    # tensors are drawn on the target device (a 128K-token pool is gigabytes)
    gd = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gd, device=device)  # noqa: E731
    page_table = page_table.to(device)
    k_pool = randn(max(total, 1), Hk, P, D)
    v_pool = randn(max(total, 1), Hk, P, D)
    q = randn(sum(chunk_lens), Hq, D)
    if structured:
        # one shared direction per kv head that the group's queries lean towards;
        # heavy pages and sinks lean the same way, everything else is noise.
        direction = randn(Hk, D)
        direction = direction / direction.norm(dim=-1, keepdim=True) * (D ** 0.5) * 1.5
        q += direction.repeat_interleave(Hq // Hk, dim=0)[None] * 0.7
        for b, n in enumerate(n_pages):
            if n == 0:
                continue
            pages = page_table[b, :n].long()
            for h in range(Hk):
                heavy = torch.randperm(n, generator=g)[:heavy_blocks].to(device)
                k_pool[pages[heavy], h] += direction[h] * 0.8
                k_pool[pages[0], h, :4] += direction[h] * 1.2  # sinks
    k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    # the chunk's own K/V as the server has them: read back from the pool
    k_chunk, v_chunk = gather_chunk_kv(k_pool, v_pool, page_table, prefix_lens, chunk_lens)
    return ChunkBatch.build(q.to(dtype), k_pool, v_pool, page_table, prefix_lens, chunk_lens,
                            sparse_ranges=sparse_ranges, k_chunk=k_chunk, v_chunk=v_chunk,
                            window_pages=window_pages)


def batch_summaries(batch: ChunkBatch) -> LayerSummaries:
    """The page summaries a server would hold for this batch's pool (with the key bounds `quest_budget` reads)."""
    return LayerSummaries.from_pool(batch.k_pool, batch.page_table, batch.context_lens_cpu(), key_bounds=True)
