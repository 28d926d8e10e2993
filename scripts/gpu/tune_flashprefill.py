"""Launch-parameter sweep of the FlashPrefill block-score kernel (kernels/flashprefill.py) on the GPU.

    source scripts/gpu/setup.sh; python3 scripts/gpu/tune_flashprefill.py

For a few serving shapes it times every (BN, num_warps, num_stages) that compiles, checks each
output against the default configuration's, and prints the table; `launch_config` in the kernel
module holds the choice made from it (results kept in docs/results/tune_flashprefill.md).
"""

from __future__ import annotations

import itertools
import statistics
import sys

import torch

from sglang_compact.kernels import flashprefill as k
from sglang_compact.selectors.base import pooled_keys_from_pool
from sglang_compact.synthetic import random_batch

SHAPES = [  # (name, prefix lens, chunk lens, H_q, H_kv, D, page)
    ("128K C1024 B8 16/4 d128", [131072] * 8, [1024] * 8, 16, 4, 128, 64),
    ("128K C8192 B2 16/4 d128", [131072] * 2, [8192] * 2, 16, 4, 128, 64),
    ("8K C256 B1 9/3 d64", [8192], [256], 9, 3, 64, 32),
]


def time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def main() -> int:
    print(f"{torch.cuda.get_device_name()}")
    for name, prefix, chunk, hq, hkv, d, P in SHAPES:
        b = random_batch(prefix, chunk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P,
                         dtype=torch.bfloat16, device="cuda", seed=0, structured=True)
        pooled = pooled_keys_from_pool(b)
        args = (b.q, b.cu_chunk, b.chunk_lens_cpu, pooled, b.kv_blocks(), b.sm_scale, P, b.max_q_blocks(P))
        GP = 1 << (hq // hkv - 1).bit_length()
        rows = []
        for group_max in (True, False):
            ref = k.block_scores(*args, group_max=group_max)
            for bn, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
                cfg = dict(BN=bn, num_warps=warps, num_stages=stages)
                try:
                    out = k.block_scores(*args, group_max=group_max, config=cfg)
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    ms = time_ms(lambda: k.block_scores(*args, group_max=group_max, config=cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit
                    rows.append((group_max, cfg, None, f"{type(e).__name__}"))
                    continue
                rows.append((group_max, cfg, ms, f"err {err:.1e}" + (" DIFFERS" if err > 1e-3 else "")))
        print(f"\n## {name}")
        print("| group_max | BN | warps | stages | ms | note |\n|---|---|---|---|---|---|")
        for gm, cfg, ms, note in sorted(rows, key=lambda r: (not r[0], r[2] if r[2] is not None else 1e9)):
            mark = " (default)" if cfg == k.launch_config(GP * P, b.max_kv_blocks, gm) else ""
            ms_s = f"{ms:.3f}" if ms is not None else "-"
            print(f"| {gm} | {cfg['BN']} | {cfg['num_warps']} | {cfg['num_stages']} | {ms_s} | {note}{mark} |")
        del b, pooled
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
