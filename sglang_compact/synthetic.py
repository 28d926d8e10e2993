"""Synthetic chunk batches for tests and benchmarks.

`random_batch` scatters each request's prefix over random (non-contiguous,
shuffled) pages of a shared pool, with prefix lengths that need not be page
multiples. With `structured=True` the keys carry attention structure that real
models show: a few sink tokens and a handful of "heavy" blocks per kv head
whose keys align with the queries, plus a local window, so threshold
selectors have something to find.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_compact.batch import ChunkBatch, cdiv


def random_batch(prefix_lens: Sequence[int], chunk_lens: Sequence[int], *, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 seed: int = 0, structured: bool = False, heavy_blocks: int = 4, extra_pages: int = 3,
                 share_prefix: bool = False) -> ChunkBatch:
    """A batch whose pool holds every prefix in shuffled pages (plus unused pages).

    share_prefix: requests 1.. reuse request 0's full prefix pages where their
        prefixes overlap (radix-cache sharing); only the tail pages differ.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(prefix_lens)
    n_pages = [cdiv(L, page_size) for L in prefix_lens]
    total = sum(n_pages) + extra_pages
    perm = torch.randperm(max(total, 1), generator=g)
    page_table = torch.zeros(B, max(n_pages + [1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_pages):
        page_table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    if share_prefix and B > 1:
        for b in range(1, B):
            shared = min(prefix_lens[b], prefix_lens[0]) // page_size
            shared = min(shared, n_pages[b] - 1) if n_pages[b] > 0 else 0
            page_table[b, :shared] = page_table[0, :shared]
    D, Hq, Hk = head_dim, num_q_heads, num_kv_heads
    # tensors are drawn on the target device (a 64K-token pool is gigabytes)
    gd = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gd, device=device)  # noqa: E731
    page_table = page_table.to(device)
    k_pool = randn(max(total, 1), Hk, page_size, D)
    v_pool = randn(max(total, 1), Hk, page_size, D)
    T = sum(chunk_lens)
    q = randn(T, Hq, D)
    k_chunk = randn(T, Hk, D)
    v_chunk = randn(T, Hk, D)
    if structured:
        # one shared direction per kv head that the group's queries lean towards;
        # heavy blocks and sinks lean the same way, everything else is noise.
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
    return ChunkBatch.build(q.to(dtype), k_chunk.to(dtype), v_chunk.to(dtype), k_pool.to(dtype), v_pool.to(dtype),
                            page_table, prefix_lens, chunk_lens)
