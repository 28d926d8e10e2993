#!/usr/bin/env bash
# End-to-end A/B of two versions of the code on one warm machine: the tree as it is ("new") against an older
# revision's sglang_compact/ and kernels/ ("old"), swapped into this machine's copy of the tree for its servers and
# swapped back after. The editable install maps both packages to these two folders, so the swap is all it takes.
#
# Here, before the device calls (the machine has no .git):
#   bash scripts/gpu/code_ab.sh pack 128105a        # .ab/old.tgz, .ab/old.rev, .ab/new.rev (.ab is ignored: carry it)
# On the machine, after pieces c01-c04 (stock fa3's library), carry [".ab"] with the first of these calls:
#   bash scripts/gpu/code_ab.sh run fa3 new old     # stock fa3, then new, then old          (~300 s at 128K)
#   bash scripts/gpu/code_ab.sh run old new         # old, then new                          (~200 s)
# Llama-3.1-8B shapes, AB_CONTEXT (130816), chunk 1024, batch 1, AB_METHOD (compact-quest_budget-0.3) for "new" and
# "old"; one server at a time, warm-up, median of 2, each server its own bench_ttft run, in the order given. Each call
# prints every run's table so far; results in $OUT/code_ab.tgz. AB_BENCH (a stand-in for bench_ttft.py) and AB_RES
# (the results' folder, /tmp/res) are for the CPU test.
set -uo pipefail
MODE=${1:?pack REV or run ORDER...}
shift
AB=.ab
if [[ $MODE == pack ]]; then
  REV=${1:?a revision to compare against}
  mkdir -p $AB
  git archive --format=tar.gz -o $AB/old.tgz "$REV" sglang_compact kernels || exit 1
  git rev-parse --short "$REV" > $AB/old.rev
  # the tree that goes to the machine: HEAD, plus a mark where the working tree differs from it
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- sglang_compact kernels || echo +changes)" > $AB/new.rev
  echo "packed old $(cat $AB/old.rev), new $(cat $AB/new.rev): $(du -h $AB/old.tgz | cut -f1)"
  exit 0
fi
[[ $MODE == run ]] || { echo "usage: code_ab.sh pack REV | run ORDER..."; exit 2; }
[[ -f $AB/old.tgz ]] || { echo "no $AB/old.tgz: pack it here and carry $AB"; exit 2; }
source scripts/gpu/setup.sh > /dev/null 2>&1 || exit 1
source scripts/gpu/fa3_library.sh
CTX=${AB_CONTEXT:-130816}
METHOD=${AB_METHOD:-compact-quest_budget-0.3}
RES=${AB_RES:-/tmp/res}
R=$RES/code_ab; mkdir -p $R
NEW_TREE=$RES/code_ab_new_tree   # the tree's own packages while the old ones are in place

use_new() {
  if [[ -d $NEW_TREE/sglang_compact ]]; then
    rm -rf sglang_compact kernels && mv $NEW_TREE/sglang_compact $NEW_TREE/kernels . || exit 1
  fi
}
use_old() {
  use_new
  mkdir -p $NEW_TREE && mv sglang_compact kernels $NEW_TREE/ || exit 1
  tar xzf $AB/old.tgz || { use_new; exit 1; }
}
trap use_new EXIT

serve() {   # serve LABEL: one bench_ttft run of one server
  local label=$1 method=$METHOD n=1
  while [[ -d $R/ab_${label}_$n ]]; do n=$((n + 1)); done
  local name=ab_${label}_$n
  case $label in
    fa3) use_new; method=fa3 ;;
    new) use_new ;;
    old) use_old ;;
    *) echo "unknown label $label (fa3, new, old)"; exit 2 ;;
  esac
  timeout ${SERVER_S:-160} python3 ${AB_BENCH:-scripts/bench_ttft.py} --name $name --out-dir $R/$name \
    --model llama-3.1-8b --page-size 64 --contexts $CTX --chunks 1024 --batches 1 --reps 2 --methods $method \
    --start-timeout 150 --deadline-s 150 > $R/$name.log 2>&1
  local rc=$? code
  if [[ $label == old ]]; then code=$(cat $AB/old.rev); else code=$(cat $AB/new.rev 2>/dev/null || echo tree); fi
  echo "$name ($method, code $code): exit $rc"
  use_new
}

for label in "$@"; do serve $label; done
python3 scripts/gpu/ab_table.py $R
[[ -n ${AB_BENCH:-} ]] || pkill -9 -f "sglang[:][:]|[l]aunch_server --model" 2>/dev/null
tar czf $OUT/code_ab.tgz -C $RES code_ab
