#!/usr/bin/env bash
# One GPU-host call after the pieces arrived (scripts/gpu/pieces.py): stock SGLang's fa3 library
# (sgl_kernel/flash_ops, which the bundle trims) and Qwen2.5-Coder-0.5B's GGUF are joined, checked and
# installed / converted (once per warm machine: /tmp keeps them), then one job runs:
#   bash scripts/gpu/qwen_h200.sh [ttft] [bench_ttft.py flags to add]    time to first token, 4K-31K
#       (results tarred into $OUT/qwen.tgz)
#   bash scripts/gpu/qwen_h200.sh accuracy [accuracy_h200.py flags]       the accuracy suite on /tmp/qwen
#       (default: 8K, 16K and 32K, chunk 1024; results tarred into $OUT/qwen_accuracy.tgz)
#   bash scripts/gpu/qwen_h200.sh prepare                                  only the joins and the conversion (~2-3 min on
#       a fresh machine): send it with the last piece's call so the next call's time goes to its job
#   bash scripts/gpu/qwen_h200.sh dense-check [serving_check.py flags]    compact's dense path on Qwen's shapes:
#       the executor's GPU test through a 32K prompt, then `compact --compact-selector dense` (fa2 and auto)
#       against stock `flashinfer` and stock `fa3` token for token at 4K-32K, page 32, chunk 1024 (results in
#       $OUT/qwen_dense.tgz)
# Under an outer `timeout`, a job cut short still stops its servers and tars what it wrote (the SIGTERM trap).
set -uo pipefail
JOB=ttft
if [[ ${1:-} =~ ^(ttft|accuracy|dense-check|prepare)$ ]]; then JOB=$1; shift; fi
PACK=""
cut_short() {
  echo "qwen_h200.sh: terminated; packing what the job wrote"
  pkill -9 -f "launch_server|sglang::" 2>/dev/null
  [ -n "$PACK" ] && eval "$PACK"
  exit 124
}
trap cut_short TERM
t0=$SECONDS
source scripts/gpu/setup.sh || exit 1
echo "setup: $((SECONDS - t0)) s"
source scripts/gpu/fa3_library.sh
echo "fa3 library ready: $((SECONDS - t0)) s"
if [ ! -f /tmp/qwen/config.json ]; then
  mkdir -p /tmp/res
  python3 scripts/gpu/pieces.py join qwen --dir /tmp/pieces --out /tmp/qwen.gguf && \
  python3 scripts/convert_gguf.py --model qwen2.5-coder --gguf /tmp/qwen.gguf --out /tmp/qwen --dtype bfloat16 \
    --quiet > /tmp/res/qwen_convert.log 2>&1; echo "convert: exit $?"; tail -2 /tmp/res/qwen_convert.log
  echo "model ready: $((SECONDS - t0)) s"
fi
if [[ $JOB == prepare ]]; then
  [ -f /tmp/qwen/config.json ] && echo "prepared: /tmp/qwen" || { echo "prepare: no /tmp/qwen"; exit 1; }
  exit 0
fi
if [[ $JOB == dense-check ]]; then
  R=/tmp/res/qwen_dense; rm -rf $R; mkdir -p $R
  PACK="tar czf $OUT/qwen_dense.tgz -C /tmp/res qwen_dense"
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_core.py -k "qwen_shapes or dense_pass" -s \
    > $R/gpu_test.log 2>&1
  echo "gpu tests: $(tail -1 $R/gpu_test.log)"; grep -E "^FAILED|qwen dense .* rel_err=[^0]" $R/gpu_test.log | head
  timeout ${DENSE_CHECK_S:-380} python3 scripts/gpu/serving_check.py --model-path /tmp/qwen --page-size 32 --chunk 1024 \
    --lengths 4096,16384,32000,32000,32000 --new-tokens 16 --dense-kernels fa2,auto --stock flashinfer,fa3 \
    --skip long,concurrent,tight \
    --out $R "$@" > $R/run.log 2>&1
  echo "serving_check: exit $?"
  python3 scripts/gpu/serving_check.py --summary /tmp/res/qwen_dense/serving_check.json
  pkill -9 -f "launch_server|sglang::" 2>/dev/null
  tar czf $OUT/qwen_dense.tgz -C /tmp/res qwen_dense
  exit 0
fi
if [[ $JOB == accuracy ]]; then
  R=/tmp/res/qwen_accuracy; rm -rf $R; mkdir -p $R
  PACK="tar czf $OUT/qwen_accuracy.tgz -C /tmp/res qwen_accuracy"
  python3 scripts/gpu/accuracy_h200.py --model-dir /tmp/qwen --model-name qwen2.5-coder-0.5b --chunk 1024 \
    --lengths 8192 16384 32512 --out $R "$@" > $R/run.log 2>&1
  echo "accuracy: exit $?"; tail -30 $R/accuracy.md 2>/dev/null || tail -30 $R/run.log
  pkill -9 -f "launch_server|sglang::" 2>/dev/null
  tar czf $OUT/qwen_accuracy.tgz -C /tmp/res qwen_accuracy
  exit 0
fi
R=/tmp/res/qwen
[[ " $* " == *" --resume "* ]] || rm -rf $R   # --resume: continue the run kept in $R (bench_ttft.py)
mkdir -p $R
PACK="tar czf $OUT/qwen.tgz -C /tmp/res qwen"
python3 scripts/bench_ttft.py --model-path /tmp/qwen --model-name qwen2.5-coder-0.5b --page-size 32 \
  --contexts 4096,8192,16384,31744 --chunks 1024,8192 --batches 1 \
  --methods flashinfer,fa3,compact,compact-dense,flashinfer-again \
  --out-dir $R "$@" >> $R/bench.log 2>&1
echo "bench: exit $?"; tail -44 $R/speed_no_harm.md 2>/dev/null || tail -30 $R/bench.log
grep -h -E "Traceback|Error" $R/*.log 2>/dev/null | grep -v "Ignore import error" | head -5
pkill -9 -f "launch_server|sglang::" 2>/dev/null
tar czf $OUT/qwen.tgz -C /tmp/res qwen; cp $R/speed_no_harm.md $R/speed.json $OUT/ 2>/dev/null
