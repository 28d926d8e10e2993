#!/usr/bin/env bash
# End-to-end A/B on one warm machine, after pieces c01-c04 (stock fa3's library): the sparse rows of a one-window pass
# on FA3's batch call over strided views (`FA3Rows.one_window`, the tree as it is) against the varlen rows with their
# two layout copies (the same tree with `one_window` forced off in this machine's copy of `executors/sgl_fa3.py`).
# Llama-3.1-8B shapes, 128K (AB_CONTEXT), chunk 1024, batch 1, `quest_budget` 0.3 (AB_METHOD); one server at a time,
# warm-up, median of 2, each its own bench_ttft run (--name), so the order of the servers is the script's:
#   bash scripts/gpu/one_window_ab.sh 1     stock fa3, then one window, then varlen   (~300 s at 128K)
#   bash scripts/gpu/one_window_ab.sh 2     varlen, then one window                   (~200 s)
# Each step prints every run's table so far; results in $OUT/ab.tgz.
set -uo pipefail
STEP=${1:?step 1 or 2}
source scripts/gpu/setup.sh > /dev/null 2>&1 || exit 1
source scripts/gpu/fa3_library.sh
CTX=${AB_CONTEXT:-130816}
METHOD=${AB_METHOD:-compact-quest_budget-0.3}
R=/tmp/res/ab; mkdir -p $R
SRC=sglang_compact/executors/sgl_fa3.py
ONE='self.one_window = R == shape.num_kv_heads'
VARLEN='self.one_window = False  # one_window_ab.sh: varlen rows'
restore() { sed -i "s/$VARLEN/$ONE/" $SRC; }
trap restore EXIT

serve() {   # serve NAME METHOD ROWS: one bench_ttft run of one server, ROWS 'one' or 'varlen'
  restore
  if [[ $3 == varlen ]]; then
    sed -i "s/$ONE/$VARLEN/" $SRC
    grep -q "one_window_ab.sh: varlen" $SRC || { echo "could not switch $SRC to varlen rows"; exit 1; }
  fi
  timeout ${SERVER_S:-160} python3 scripts/bench_ttft.py --name $1 --out-dir $R/$1 --model llama-3.1-8b --page-size 64 \
    --contexts $CTX --chunks 1024 --batches 1 --reps 2 --methods $2 --start-timeout 150 --deadline-s 150 \
    > $R/$1.log 2>&1
  echo "$1 ($3): exit $?"
  restore
}

if [[ $STEP == 1 ]]; then
  serve ab_fa3 fa3 -
  serve ab_one_1 $METHOD one
  serve ab_varlen_1 $METHOD varlen
else
  serve ab_varlen_2 $METHOD varlen
  serve ab_one_2 $METHOD one
fi
python3 scripts/gpu/ab_table.py $R
pkill -9 -f "sglang[:][:]|[l]aunch_server --model" 2>/dev/null
tar czf $OUT/ab.tgz -C /tmp/res ab
