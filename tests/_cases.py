"""Random q-block geometries and page tables shared by the kernel property tests."""

import torch

from sglang_compact.batch import QBlocks, cdiv


def random_geometry(seed, B=3, P=16, max_pages=12, page_aligned=False, window_pages=2):
    """Prefix / chunk lengths (prefixes not page aligned unless asked), sparse window ranges, a page table of
    distinct shuffled pages, and the q-blocks / windows."""
    g = torch.Generator().manual_seed(seed)
    rint = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    prefix = [rint(0, max_pages * P) for _ in range(B)]
    if page_aligned:
        prefix = [L // P * P for L in prefix]
    chunk = [rint(1, 3 * P) for _ in range(B)]
    ranges = [(rint(0, 2), rint(1, max_pages // window_pages + 2)) for _ in range(B)]
    qb = QBlocks.build(prefix, chunk, P, window_pages, ranges)
    n_ctx = list(qb.n_ctx)
    pages = torch.randperm(sum(n_ctx) + 5, generator=g).to(torch.int32)
    page_table = torch.zeros(B, max(n_ctx), dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_ctx):
        page_table[b, :n] = pages[used:used + n]
        used += n
    return dict(prefix=prefix, chunk=chunk, ranges=ranges, qb=qb, page_table=page_table,
                num_pages=sum(n_ctx) + 5, generator=g, cdiv=cdiv)
