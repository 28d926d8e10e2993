"""Launch-parameter sweep of the antidiagonal page-mass kernel (kernels/antidiagonal.py) on the GPU.

    source scripts/gpu/setup.sh; python3 scripts/gpu/tune_antidiagonal.py [--quick]

For a few serving shapes it times every (tile rows, BN, BK, num_warps, num_stages) that compiles, checks
each output against the torch twin (`antidiagonal_naive`, float32, on the GPU) and prints one table per
shape; `page_mass`'s defaults hold the choice made from it (results kept in docs/results/tune_antidiagonal.md).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `harness`

from harness.bench_attention.timing import Timer  # noqa: E402
from harness.synthetic import random_batch  # noqa: E402
from sglang_compact.kernels import antidiagonal as k  # noqa: E402
from sglang_compact.kernels import antidiagonal_naive  # noqa: E402
from sglang_compact.selectors.xattention import antidiagonal_rows  # noqa: E402

SHAPES = [  # (name, prefix lens, chunk lens, H_q, H_kv, D, page, stride)
    ("128K C1024 B8 16/4 d128 P64 S8", [131072] * 8, [1024] * 8, 16, 4, 128, 64, 8),
    ("32K C1024 B1 14/2 d64 P32 S8 (Qwen2.5-0.5B)", [31744], [1024], 14, 2, 64, 32, 8),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller grid (BK 64/128, stages 2/3, rows 64/128)")
    a = ap.parse_args()
    print(torch.cuda.get_device_name())
    timer = Timer(torch.device("cuda"), reps=10, min_reps=10, warmup=2, budget_ms=1e9)
    grid = list(itertools.product((64, 128) if a.quick else (64, 128, 256), (64, 128), (64, 128),
                                  (4, 8), (2, 3)))
    for name, prefix, chunk, hq, hkv, d, P, S in SHAPES:
        b = random_batch(prefix, chunk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P,
                         dtype=torch.bfloat16, device="cuda", seed=0, structured=True)
        q_rows, w = antidiagonal_rows(b, S)
        qb = b.device_qblocks()
        args = (q_rows, b.k_pool, b.page_table, qb["req"], qb["cand"], w, hq // hkv, b.qblocks.max_pages,
                b.sm_scale / S)
        ref = antidiagonal_naive.page_mass(*args)
        rows = []
        for tr, bn, bk, warps, stages in grid:
            cfg = dict(rows=tr, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
            try:
                err = (k.page_mass(*args, config=cfg) - ref).abs().max().item()
                ms = timer.device_ms(lambda: k.page_mass(*args, config=cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit
                rows.append((cfg, None, type(e).__name__))
                continue
            rows.append((cfg, ms, f"max abs err {err:.1e}" + (" DIFFERS" if err > 1e-4 else "")))
        default_ms = timer.device_ms(lambda: k.page_mass(*args))
        print(f"\n## {name}: default {default_ms:.3f} ms")
        print("| rows | BN | BK | warps | stages | ms | note |\n|---|---|---|---|---|---|---|")
        for cfg, ms, note in sorted(rows, key=lambda r: r[1] if r[1] is not None else 1e9):
            ms_s = f"{ms:.3f}" if ms is not None else "-"
            print(f"| {cfg['rows']} | {cfg['BN']} | {cfg['BK']} | {cfg['num_warps']} | {cfg['num_stages']} | {ms_s} "
                  f"| {note} |", flush=True)
        del b, q_rows, ref
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
