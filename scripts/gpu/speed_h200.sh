#!/usr/bin/env bash
# Attention speed on the H200 (issue "Speed at 128K"), one call: GPU correctness checks of the
# executors and kernels first, then scripts/bench_attention.py side by side. From the repo root:
#   source scripts/gpu/setup.sh; bash scripts/gpu/speed_h200.sh     # writes under $OUT/r
# TESTS (pytest -k of the GPU checks), TAG (run tag) and BENCH_ARGS (extra bench_attention.py
# arguments, e.g. "--query-stride 2") are read from the environment.
# Copy $OUT/r/{speed.json,speed_attention*} back into docs/results/.
set -u
R=${OUT:-/tmp/out}/r
mkdir -p "$R"
cp docs/results/speed.json "$R/" 2>/dev/null || true
TESTS=${TESTS:-fa3 or triton or executor_matches or reused}
{
  echo "\$ python3 -m pytest -m gpu -q -s tests/test_gpu_core.py -k '$TESTS'"
  python3 -m pytest -m gpu -q -s tests/test_gpu_core.py -k "$TESTS" 2>&1 | grep -v "^$"
  echo "\$ python3 scripts/gpu/check_flashprefill_kernel.py"
  python3 scripts/gpu/check_flashprefill_kernel.py 2>&1
} > "$R/gpu_checks.log"
grep -E "passed|failed|error" "$R/gpu_checks.log" | tail -3
BENCH="python3 scripts/bench_attention.py --out-dir $R --run-tag ${TAG:-attn-fa3} --budgets 0.1,0.2,0.25,0.3,0.5,1.0 ${BENCH_ARGS:-}"
METHODS="dense_*,compact_flashprefill,compact_fa3_flashprefill,compact_budget_0.3,compact_fa3_budget_*,bsparse_flashprefill,quoka"
{
  $BENCH --contexts 131072 --chunks 1024,8192 --batches 8 --heads 16/4 --methods "$METHODS" --deadline-s 150
  $BENCH --contexts 65536,32768 --chunks 1024 --batches 8 --heads 16/4 --methods "$METHODS" --deadline-s 90
  $BENCH --contexts 131072 --chunks 1024 --batches 1,8 --heads 32/8 \
    --methods "dense_*,compact_flashprefill,compact_fa3_budget_0.3,compact_fa3_budget_1.0" --deadline-s 100
  python3 scripts/bench_attention.py --out-dir $R --run-tag ${TAG:-attn-fa3} --render-only
} > "$R/bench.log" 2>&1
tail -40 "$R/bench.log"
