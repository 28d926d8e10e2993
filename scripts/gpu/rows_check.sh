#!/usr/bin/env bash
# One GPU-host call after pieces c01-c04 (stock fa3's library): the sparse rows on sgl_kernel's FA3
# (`--compact-prefill-kernel sgl-fa3`, `auto`'s choice where it runs) checked, then timed beside FlashInfer's fa3
# rows (`-firows`) and stock fa3.
#   bash scripts/gpu/rows_check.sh [tests] [bench]     (default: both; results in $OUT/rows.tgz)
# tests  the GPU tests of the rows on FA3 and of `auto`'s choice (`-k "sgl or auto_takes"`): against the plain-torch
#        reference, one plan serving layers whose rows differ (bit for bit a plan per layer), the windows computed
#        apart, plans made while the GPU lags; and the dense passes on FA3 (~2 min)
# bench  Llama-3.1-8B shapes, 128K (BENCH_CONTEXT), chunk 1024, batch 1: TTFT of stock fa3, quest_budget 0.3 on
#        FlashInfer's fa3 rows and on FA3's (`auto`), and the default (METHODS); one server at a time, warm-up,
#        median of 2 (~80 s a server at 128K); BENCH_S bounds it (default 420), DEADLINE_S (330) stops starting servers,
#        and the same command again (`--resume`) times the rest in a later call on the same machine
set -uo pipefail
STEPS=${*:-tests bench}
source scripts/gpu/setup.sh > /dev/null 2>&1 || exit 1
source scripts/gpu/fa3_library.sh
R=/tmp/res/rows; mkdir -p $R
pack() { tar czf $OUT/rows.tgz -C /tmp/res rows; }
if [[ " $STEPS " == *" tests "* ]]; then
  timeout ${TESTS_S:-200} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_core.py \
    -k "sgl or auto_takes" -s > $R/gpu_tests.log 2>&1
  echo "gpu tests: $(tail -1 $R/gpu_tests.log)"; grep -E "^FAILED|Error" $R/gpu_tests.log | head -8
  grep -E "sgl-fa3 rows|rows.*sgl-fa3|sgl-fa3 context" $R/gpu_tests.log | head -12
fi
if [[ " $STEPS " == *" bench "* ]]; then
  METHODS=${METHODS:-fa3,compact-quest_budget-0.3-firows,compact-quest_budget-0.3,compact}
  CTX=${BENCH_CONTEXT:-130816}
  # one run (name, log, server logs) per context, so that `--resume` of one never meets another's state
  timeout ${BENCH_S:-420} python3 scripts/bench_ttft.py --name rows_8b_$CTX --out-dir $R/$CTX --model llama-3.1-8b \
    --page-size 64 --contexts $CTX --chunks 1024 --batches 1 --reps 2 --methods $METHODS \
    --side-by-side 1 --start-timeout 150 --deadline-s ${DEADLINE_S:-330} --resume > $R/bench_$CTX.log 2>&1
  echo "bench: exit $?"; tail -6 $R/$CTX/rows_8b_$CTX.md 2>/dev/null
  grep -h "sglang_compact:" $R/$CTX/*.log 2>/dev/null | grep -o "prefill kernel.*summaries" | sort -u | head -3
fi
pkill -9 -f "sglang::|launch_server --model" 2>/dev/null
pack
