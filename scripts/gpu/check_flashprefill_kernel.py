"""GPU check: the FlashPrefill block-score kernel against its torch reference (bf16 and fp32 inputs;
per-head and group-max outputs; every query and every 2nd query of each block)."""
import torch

from sglang_compact.kernels import flashprefill as k
from sglang_compact.kernels import flashprefill_naive as n
from sglang_compact.selectors.base import pooled_keys_from_pool
from sglang_compact.synthetic import random_batch

for dtype in (torch.float32, torch.bfloat16):
    for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
        b = random_batch([20000, 7777], [1024, 300], num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=64,
                         dtype=dtype, device="cuda", seed=1, structured=True)
        pooled = pooled_keys_from_pool(b)
        args = (b.q, b.cu_chunk, b.chunk_lens_cpu, pooled, b.kv_blocks(), b.sm_scale, 64, b.max_q_blocks(64))
        for group_max in (False, True):
            for stride in (1, 2):
                kw = dict(group_max=group_max, query_stride=stride)
                ref, got = n.block_scores(*args, **kw), k.block_scores(*args, **kw)
                err = ((got - ref).norm() / ref.norm()).item()
                print(f"flashprefill kernel {dtype} {hq}/{hkv} d={d} group_max={group_max} query_stride={stride}: "
                      f"rel_err={err:.2e} max_abs={(got - ref).abs().max().item():.2e}")
                assert err < (2e-2 if dtype == torch.bfloat16 else 1e-2)
