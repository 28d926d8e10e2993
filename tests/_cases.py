"""Random union/plan inputs shared by the property tests."""

import torch

from sglang_compact.batch import cdiv


def random_union_case(seed, B, H_kv, G, P, max_blocks=12, density=0.2, invalid_noise=True):
    g = torch.Generator().manual_seed(seed)
    prefix = [int(torch.randint(0, max_blocks * P + 1, (1,), generator=g)) for _ in range(B)]
    chunk = [int(torch.randint(1, 3 * P + 1, (1,), generator=g)) for _ in range(B)]
    n_kv = [cdiv(L, P) for L in prefix]
    n_q = [cdiv(C, P) for C in chunk]
    NKV, NQ = max(n_kv + [1]), max(n_q)
    mask = torch.rand(B, H_kv * G, NQ, NKV, generator=g) < density
    if not invalid_noise:
        jv = torch.arange(NKV)[None, :] < torch.tensor(n_kv)[:, None]
        iv = torch.arange(NQ)[None, :] < torch.tensor(n_q)[:, None]
        mask &= (iv[:, :, None] & jv[:, None, :])[:, None]
    pages = torch.randperm(sum(n_kv) + 5, generator=g).to(torch.int32)
    page_table = torch.zeros(B, NKV, dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_kv):
        page_table[b, :n] = pages[used:used + n]
        used += n
    return dict(mask=mask, prefix=prefix, chunk=chunk, n_kv=n_kv, n_q=n_q, page_table=page_table,
                kv_blocks=torch.tensor(n_kv, dtype=torch.int32), q_blocks=torch.tensor(n_q, dtype=torch.int32),
                prefix_lens=torch.tensor(prefix, dtype=torch.int32),
                cu_chunk=torch.tensor([0] + torch.tensor(chunk).cumsum(0).tolist(), dtype=torch.int32))
