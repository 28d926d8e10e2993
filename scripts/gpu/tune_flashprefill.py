"""Launch-parameter sweep of the FlashPrefill search kernel (kernels/flashprefill.py) on the GPU.

    source scripts/gpu/setup.sh; python3 scripts/gpu/tune_flashprefill.py [--split-check | --quest-sweep]

For a few serving shapes (chunks of C tokens after long prefixes; the kernel reads the page summaries
of each q-block's candidate pages) it times every (BN, num_warps, num_stages) that compiles for the
group-max scores (budget), the per-head scores, the fused threshold mask (flashprefill's default
path) and the group max of Quest's bound (quest_budget: two dot products per tile), checks each
output against the default configuration's, and prints the table;
`launch_config` in the kernel module holds the choice made from it (results kept in
docs/results/tune_flashprefill.md).

`--quest-sweep` times instead the search the server runs by default at 128K (`quest_budget`: Quest's bound,
group max, Llama-3.1-8B heads 32/8 x 128, page 64, query_stride 4, batch 1, chunk 1024) over BN, num_warps,
num_stages and SPLIT, each checked against the default configuration's output.

`--ab FILE` times that search's default launch in this tree's kernel module against another version of the
module (FILE: e.g. `git show main:kernels/flashprefill.py > .ab/flashprefill_main.py` here, carried as `.ab`), in
one process, rounds interleaved, with each version's output checked against the other's and against the torch
twin: a kernel change's speed without a second machine start or a second sweep.
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `harness`

from harness.bench_attention.timing import Timer  # noqa: E402
from harness.synthetic import batch_summaries, random_batch  # noqa: E402
from sglang_compact.kernels import flashprefill as k  # noqa: E402
from sglang_compact.kernels import flashprefill_naive  # noqa: E402

SHAPES = [  # (name, prefix lens, chunk lens, H_q, H_kv, D, page)
    ("128K C1024 B8 16/4 d128", [131072] * 8, [1024] * 8, 16, 4, 128, 64),
    ("128K C8192 B2 16/4 d128", [131072] * 2, [8192] * 2, 16, 4, 128, 64),
    ("8K C256 B1 9/3 d64", [8192], [256], 9, 3, 64, 32),
]


MODES = ("group_max", "per_head", "threshold", "bounds")   # bounds: group max of Quest's bound (quest_budget)


def run(mode: str, args, P: int, cfg=None, bounds=None):
    if mode == "threshold":
        return k.threshold_mask(*args, 0.4, page_size=P, config=cfg).to(torch.float32)
    return k.block_scores(*args, group_max=mode in ("group_max", "bounds"), page_size=P, config=cfg,
                          key_bounds=bounds if mode == "bounds" else None)


def split_check() -> int:
    """Pages split over several programs (as many as an idle GPU would get, whatever the default's gates)
    against one program per (kv head, q-block), at Llama-3.1-8B heads, batch 1, chunk 1024, for each output
    mode; the last column is the SPLIT the default launch picks there."""
    timer = Timer(torch.device("cuda"), reps=20, min_reps=20, warmup=3, budget_ms=1e9)
    print("| prefix | mode | SPLIT | ms | ms with SPLIT 1 | speedup | max rel diff | default SPLIT |\n"
          "|---|---|---|---|---|---|---|---|")
    for prefix in (16384, 32768, 78848, 130048):
        b = random_batch([prefix], [1024], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64,
                         dtype=torch.bfloat16, device="cuda", seed=0, structured=True)
        s = batch_summaries(b)
        args = (b.q, b.device_qblocks(), b.page_table, s.key_sum, s.count, b.sm_scale, 8, b.qblocks.max_pages)
        sms, NKV = k._sm_count(b.q.device), b.qblocks.max_pages
        for mode in MODES:
            launch = dict(rows=4 * 64, NKV=NKV, group_max=mode in ("group_max", "bounds"), programs=8 * b.qblocks.count,
                          sms=sms)
            default = k.launch_config(**launch, splittable=mode != "threshold")["SPLIT"]
            one = dict(k.launch_config(**launch), SPLIT=1)
            cut = dict(one, SPLIT=max(2, min(-(-4 * sms // launch["programs"]), NKV // (4 * one["BN"]), k.MAX_SPLIT)))
            bounds = (s.key_max, s.key_min)
            got, ref = run(mode, args, 64, cut, bounds), run(mode, args, 64, one, bounds)
            err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
            ms = timer.device_ms(lambda: run(mode, args, 64, cut, bounds))
            ms1 = timer.device_ms(lambda: run(mode, args, 64, one, bounds))
            print(f"| {prefix} | {mode} | {cut['SPLIT']} | {ms:.3f} | {ms1:.3f} | {ms1 / ms:.2f} | {err:.1e} | {default} |",
                  flush=True)
        del b, s
    return 0


def server_search_at(prefix: int):
    """The batch of the server's default search after `prefix` tokens (`quest_budget`: Quest's bound, group max,
    Llama-3.1-8B heads 32/8 x 128, page 64, query stride 4, one 1024-token chunk) and search(module, config=None):
    that search by `module` (a version of the kernel module, or the torch twin)."""
    b = random_batch([prefix], [1024], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64,
                     dtype=torch.bfloat16, device="cuda", seed=0, structured=True)
    s = batch_summaries(b)
    args = (b.q, b.device_qblocks(), b.page_table, s.key_sum, s.count, b.sm_scale, 8, b.qblocks.max_pages)

    def search(module, config=None):
        kw = {} if module is flashprefill_naive else dict(page_size=64, config=config)
        return module.block_scores(*args, group_max=True, query_stride=4, key_bounds=(s.key_max, s.key_min), **kw)
    return b, search


def quest_sweep() -> int:
    """The default launch of the server's 128K search against every (BN, warps, stages, SPLIT) that compiles."""
    timer = Timer(torch.device("cuda"), reps=20, min_reps=20, warmup=3, budget_ms=1e9)
    print(f"{torch.cuda.get_device_name()}\n\n| prefix | BN | warps | stages | SPLIT | ms | of default | max rel diff |\n"
          "|---|---|---|---|---|---|---|---|")
    for prefix in (32768, 130048):
        b, server_search = server_search_at(prefix)

        def search(cfg):
            return server_search(k, cfg)
        ref = search(None)
        base = timer.device_ms(lambda: search(None))
        default = k.launch_config(4 * 16, b.qblocks.max_pages, True, 8 * b.qblocks.count, k._sm_count(b.q.device))
        print(f"| {prefix} | {default['BN']} | {default['num_warps']} | {default['num_stages']} | {default['SPLIT']} | "
              f"{base:.4f} | 1.00 (default) | 0 |", flush=True)
        rows = []
        for bn, warps, stages, split in itertools.product((64, 128), (4, 8), (2, 3), (1, 5, 8, 16)):
            cfg = dict(BN=bn, num_warps=warps, num_stages=stages, SPLIT=split)
            try:
                out = search(cfg)
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                ms = timer.device_ms(lambda: search(cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit
                print(f"| {prefix} | {bn} | {warps} | {stages} | {split} | - | {type(e).__name__} | - |")
                continue
            rows.append((ms, cfg, err))
        for ms, cfg, err in sorted(rows, key=lambda r: r[0])[:12]:
            print(f"| {prefix} | {cfg['BN']} | {cfg['num_warps']} | {cfg['num_stages']} | {cfg['SPLIT']} | {ms:.4f} | "
                  f"{ms / base:.2f} | {err:.1e}{' DIFFERS' if err > 1e-3 else ''} |", flush=True)
        del b, search
        torch.cuda.empty_cache()
    return 0


def load_version(path: str):
    """Another version of the kernel module, imported from `path` beside this tree's (its imports resolve here)."""
    spec = importlib.util.spec_from_file_location("flashprefill_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ab(path: str, rounds: int = 7) -> int:
    """The server's default search (quest_budget's launch at 128K and 32K) in this tree's module against `path`'s:
    per context, `rounds` rounds of (this, other) in turn, each the mean of 50 launches; the medians and their
    ratio. Fails when the two outputs differ by more than 1e-4 of the largest score, or either is off the torch
    twin by more than 3e-2 of it."""
    other = load_version(path)
    timer = Timer(torch.device("cuda"), reps=50, min_reps=50, warmup=10, budget_ms=1e9)
    print(f"{torch.cuda.get_device_name()}: this tree's kernels/flashprefill.py against {path}\n\n"
          "| prefix | this ms (median) | other ms (median) | this / other | rounds this | rounds other | "
          "max rel diff |\n|---|---|---|---|---|---|---|")
    bad = []
    for prefix in (130048, 32768):
        b, search = server_search_at(prefix)
        mine, theirs, twin = search(k), search(other), search(flashprefill_naive)
        scale = twin.abs().max().clamp(min=1e-30)
        err = ((mine - theirs).abs().max() / scale).item()
        off_twin = max(((x - twin).abs().max() / scale).item() for x in (mine, theirs))
        if err > 1e-4 or off_twin > 3e-2:   # the twin in bf16: the GPU tests' tolerance (rtol 2e-2, atol 2e-3)
            bad.append(f"{prefix}: this vs other {err:.1e}, vs the twin {off_twin:.1e}")
        times = {"this": [], "other": []}
        for _ in range(rounds):
            for name, module in (("this", k), ("other", other)):
                times[name].append(timer.device_ms(lambda: search(module)))
        t_mine, t_other = statistics.median(times["this"]), statistics.median(times["other"])
        print(f"| {prefix} | {t_mine:.4f} | {t_other:.4f} | {t_mine / t_other:.3f} | "
              f"{', '.join(f'{x:.4f}' for x in times['this'])} | {', '.join(f'{x:.4f}' for x in times['other'])} | "
              f"{err:.1e} |", flush=True)
        del b, search
        torch.cuda.empty_cache()
    if bad:
        print("FAILED: " + "; ".join(bad), flush=True)
    return 1 if bad else 0


def main() -> int:
    if "--ab" in sys.argv:
        return ab(sys.argv[sys.argv.index("--ab") + 1])
    if "--split-check" in sys.argv:
        return split_check()
    if "--quest-sweep" in sys.argv:
        return quest_sweep()
    print(f"{torch.cuda.get_device_name()}")
    timer = Timer(torch.device("cuda"), reps=20, min_reps=20, warmup=3, budget_ms=1e9)
    for name, prefix, chunk, hq, hkv, d, P in SHAPES:
        b = random_batch(prefix, chunk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P,
                         dtype=torch.bfloat16, device="cuda", seed=0, structured=True)
        s = batch_summaries(b)
        args = (b.q, b.device_qblocks(), b.page_table, s.key_sum, s.count, b.sm_scale, b.num_kv_heads,
                b.qblocks.max_pages)
        GP = 1 << (hq // hkv - 1).bit_length()
        bounds = (s.key_max, s.key_min)
        rows = []
        for mode in MODES:
            ref = run(mode, args, P, bounds=bounds)
            for bn, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
                cfg = dict(BN=bn, num_warps=warps, num_stages=stages)
                try:
                    out = run(mode, args, P, cfg, bounds)
                    if mode == "threshold":
                        err = (out != ref).float().mean().item()
                    else:
                        err = ((out - ref).abs().max() / ref.abs().max()).item()
                    ms = timer.device_ms(lambda: run(mode, args, P, cfg, bounds))
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit
                    rows.append((mode, cfg, None, f"{type(e).__name__}"))
                    continue
                rows.append((mode, cfg, ms, f"err {err:.1e}" + (" DIFFERS" if err > 1e-3 else "")))
        print(f"\n## {name}")
        print("| mode | BN | warps | stages | ms | note |\n|---|---|---|---|---|---|")
        for mode, cfg, ms, note in sorted(rows, key=lambda r: (MODES.index(r[0]), r[2] if r[2] is not None else 1e9)):
            grouped = mode in ("group_max", "bounds")
            mark = " (default)" if cfg == k.launch_config(GP * P, b.qblocks.max_pages, grouped) else ""
            ms_s = f"{ms:.3f}" if ms is not None else "-"
            print(f"| {mode} | {cfg['BN']} | {cfg['num_warps']} | {cfg['num_stages']} | {ms_s} | {note}{mark} |")
        del b, s
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
