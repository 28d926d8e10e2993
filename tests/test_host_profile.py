"""The host-time harness of `scripts/gpu/host_profile.py` (its GPU parts run on the H200 only)."""

import sys
import time
from pathlib import Path

GPU_SCRIPTS = str(Path(__file__).resolve().parent.parent / "scripts" / "gpu")
sys.path.insert(0, GPU_SCRIPTS)
try:
    import host_profile
finally:
    sys.path.remove(GPU_SCRIPTS)


def test_rounds_interleave_the_variants_and_time_each_call():
    log = []

    def variant(name, sleep_s=0.0):
        def call():
            log.append(name)
            if sleep_s:
                time.sleep(sleep_s)
        return call

    syncs = []
    times = host_profile.host_ms_rounds([variant("a"), variant("b", 0.002)], n=3, rounds=2,
                                        sync=lambda: syncs.append(len(log)))
    # one warm-up call each, then per round 3 calls of a, then 3 of b
    assert log == ["a", "b"] + (["a"] * 3 + ["b"] * 3) * 2
    # the device is waited for after the warm-up and after each timing, never inside one
    assert syncs == [2, 5, 8, 11, 14]
    assert [len(t) for t in times] == [2, 2]
    assert all(t >= 2.0 for t in times[1]) and all(t < 2.0 for t in times[0])   # ms per call


def test_spread_reports_the_median_and_the_range_of_the_rounds():
    assert host_profile.spread([0.3, 0.1, 0.2, 0.9, 0.25]) == dict(
        host_ms=0.25, host_ms_min=0.1, host_ms_max=0.9, host_ms_rounds=[0.3, 0.1, 0.2, 0.9, 0.25])


def test_max_error_reads_the_output_and_skips_variants_without_one():
    import torch
    ref = torch.zeros(3, 2, 4)
    out = ref.clone().to(torch.bfloat16)
    out[1, 0, 2] = 0.5
    assert host_profile.max_error(out, ref) == 0.5
    assert host_profile.max_error((out, torch.ones(1)), ref) == 0.5   # kernels that return (out, lse)
    assert host_profile.max_error(None, ref) is None                   # a store alone
    assert host_profile.max_error(torch.zeros(3, 8), ref) is None      # another shape: not an attention output


def test_only_our_layers_fail_the_reference_check():
    rows = [dict(name="compact dense layer", stock=False, max_abs_error=0.008),
            dict(name="  FA3 varlen on the chunk's K/V alone", stock=False, max_abs_error=0.03),
            dict(name="  FA3 over the paged cache alone (stock `fa3`)", stock=True, max_abs_error=0.04),
            dict(name="  store_kv with sums + bounds", stock=False, max_abs_error=None)]
    assert host_profile.off_reference(rows) == ["FA3 varlen on the chunk's K/V alone"]
    rows[1]["max_abs_error"] = host_profile.DENSE_TOL
    assert host_profile.off_reference(rows) == []
