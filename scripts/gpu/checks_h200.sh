#!/usr/bin/env bash
# One GPU-host call: the core GPU checks, the cost gate's calibration, and a serving smoke run under SGLang's
# default (breakable) prefill CUDA graphs. Results tarred into $OUT/checks.tgz.
#   bash scripts/gpu/checks_h200.sh            (from the repository root, .gpu carried or unpacked earlier)
#   STEPS="tests smoke" bash scripts/gpu/checks_h200.sh   (a subset of: tests calibrate smoke search)
#   search: the FlashPrefill search split over pages against one program per q-block (equality and time),
#   then the sparse path's host time per layer (scripts/gpu/host_profile.py)
#   fastpaths: the GPU suite with the cached Triton launch switched on (SGLANG_COMPACT_CACHED_LAUNCH=1, off by
#   default), then the dense and the sparse path's host and GPU time per layer with and without it
#   (host_profile.py --path both)
set -uo pipefail
source scripts/gpu/setup.sh || exit 1
R=/tmp/res/checks; rm -rf $R; mkdir -p $R
python3 scripts/gpu/pieces.py collect .pieces --into /tmp/pieces > /dev/null 2>&1 || true
if ls /tmp/pieces/zstandard-*.whl > /dev/null 2>&1 && ! python3 -c "import zstandard" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/site /tmp/pieces/zstandard-*.whl
fi
pack() { tar czf $OUT/checks.tgz -C /tmp/res checks; }
STEPS=" ${STEPS:-tests calibrate smoke} "
if [[ $STEPS == *" tests "* ]]; then
t0=$SECONDS
timeout ${GPU_TESTS_S:-330} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_core.py -s -rf > $R/gpu_core.log 2>&1
echo "gpu_core: $(tail -1 $R/gpu_core.log) ($((SECONDS - t0)) s)"; grep -E "^FAILED" $R/gpu_core.log | head; pack
fi
if [[ $STEPS == *" calibrate "* ]]; then
t0=$SECONDS
timeout ${CALIBRATE_S:-160} python3 scripts/gpu/calibrate_gate.py --report $R/calibration.json > $R/calibration.log 2>&1
echo "calibration: exit $? ($((SECONDS - t0)) s)"; grep -E "TF/s|break-even" $R/calibration.log
cp sglang_compact/data/cost_model.json $R/; pack
fi
if [[ $STEPS == *" smoke "* ]]; then
t0=$SECONDS
timeout ${SMOKE_S:-150} python3 scripts/bench_ttft.py --model llama-3.1-8b --layers 4 --page-size 64 --contexts 32768 --chunks 1024 \
  --batches 1 --reps 1 --methods flashinfer,compact-budget-0.3,compact-dense --name smoke_bcg \
  --out-dir $R/smoke > $R/smoke.log 2>&1
echo "smoke: exit $? ($((SECONDS - t0)) s)"; tail -12 $R/smoke/smoke_bcg.md 2>/dev/null || tail -30 $R/smoke.log
grep -h -i -E "error|traceback" $R/smoke/*.log 2>/dev/null | head -5
pkill -9 -f "launch_server|sglang::" 2>/dev/null; pack
fi
if [[ $STEPS == *" search "* ]]; then
t0=$SECONDS
timeout ${SEARCH_S:-90} python3 scripts/gpu/tune_flashprefill.py --split-check > $R/split_check.md 2>&1
echo "split check: exit $? ($((SECONDS - t0)) s)"; cat $R/split_check.md | tail -14
timeout ${PROFILE_S:-90} python3 scripts/gpu/host_profile.py --out $R/host_profile > $R/host_profile.log 2>&1
tail -8 $R/host_profile.log; pack
fi
if [[ $STEPS == *" fastpaths "* ]]; then
t0=$SECONDS
SGLANG_COMPACT_CACHED_LAUNCH=1 timeout ${GPU_TESTS_S:-330} python3 -m pytest -m gpu -q \
  -p no:cacheprovider tests/test_gpu_core.py -rf > $R/gpu_core_fastpaths.log 2>&1
echo "gpu_core, fast paths on: $(tail -1 $R/gpu_core_fastpaths.log) ($((SECONDS - t0)) s)"
grep -E "^FAILED" $R/gpu_core_fastpaths.log | head; pack
t0=$SECONDS
timeout ${PROFILE_S:-150} python3 scripts/gpu/host_profile.py --path both --out $R/host_profile > $R/host_profile.log 2>&1
echo "host profile: exit $? ($((SECONDS - t0)) s)"; sed -n '/^Dense pass/,/^Sparse path/p' $R/host_profile/host_profile.md
pack
fi
