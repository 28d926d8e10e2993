"""GPU check: the FlashPrefill search kernel (`kernels/flashprefill.py`) against its torch reference
(`kernels/flashprefill_naive.py`) over page summaries: bf16 and fp32 inputs; per-head and group-max scores;
every query and every 2nd query of each q-block; and the fused threshold mask (search + threshold + group
union, per kv head and q-block), on batches whose chunks start mid-page, with a dense window."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `harness`

from harness.synthetic import batch_summaries, random_batch  # noqa: E402
from sglang_compact.kernels import flashprefill as k  # noqa: E402
from sglang_compact.kernels import flashprefill_naive as n  # noqa: E402

P = 64
for dtype in (torch.float32, torch.bfloat16):
    for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
        # windows of 4 pages (256 tokens); request 1's window 31 (tokens 7936..) is dense (a dense tail): its
        # q-blocks have no candidates
        b = random_batch([20000, 7777], [1024, 300], num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P,
                         dtype=dtype, device="cuda", seed=1, structured=True, window_pages=4,
                         sparse_ranges=[(0, 1 << 40), (0, 31)])
        assert not all(b.qblocks.w_sparse) and any(b.qblocks.w_sparse)
        s = batch_summaries(b)
        args = (b.q, b.device_qblocks(), b.page_table, s.key_sum, s.count, b.sm_scale, b.num_kv_heads,
                b.qblocks.max_pages)
        for group_max in (False, True):
            for stride in (1, 2):
                kw = dict(group_max=group_max, query_stride=stride)
                ref, got = n.block_scores(*args, **kw), k.block_scores(*args, **kw, page_size=P)
                err = ((got - ref).norm() / ref.norm()).item()
                print(f"flashprefill block_scores {dtype} {hq}/{hkv} d={d} group_max={group_max} "
                      f"query_stride={stride}: rel_err={err:.2e} max_abs={(got - ref).abs().max().item():.2e}")
                assert err < (2e-2 if dtype == torch.bfloat16 else 1e-2)
        cand = b.candidates()                                            # [NQB, NKV]: pages before the window
        for alpha in (0.1, 0.4):
            for stride in (1, 2):
                ref = n.threshold_mask(*args, alpha, query_stride=stride)
                got = k.threshold_mask(*args, alpha, query_stride=stride, page_size=P)
                assert got.shape == ref.shape == (hkv, b.qblocks.count, b.qblocks.max_pages)
                assert not (got & ~cand[None]).any()  # nothing but candidates (none in the dense window)
                differ = (got != ref).sum().item() / max(1, cand.sum().item() * hkv)
                print(f"flashprefill threshold_mask {dtype} {hq}/{hkv} d={d} alpha={alpha} query_stride={stride}: "
                      f"cells differing from the reference {differ:.2e} "
                      f"(kept {ref.sum().item() / max(1, cand.sum().item() * hkv):.3f} of the candidates)")
                # scores at the threshold may round either way at the input precision
                assert differ < (2e-2 if dtype == torch.bfloat16 else 1e-3)
print("flashprefill kernel: ok")
