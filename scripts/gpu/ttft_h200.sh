#!/usr/bin/env bash
# One GPU-host call: scripts/bench_ttft.py with the given flags; the table, the first server errors, and all
# results tarred into $OUT/<name>.tgz (the profiler traces of --profile-steps into $OUT/<name>_traces.tar).
#   bash scripts/gpu/ttft_h200.sh NAME [bench_ttft.py flags]
# Stock `fa3`'s library is joined first where its pieces (c01-c04) have arrived. With --resume, the same command
# again continues the run in /tmp/res/NAME (on the same warm machine) instead of starting afresh.
set -uo pipefail
NAME=$1; shift
source scripts/gpu/setup.sh > /dev/null 2>&1 || exit 1
source scripts/gpu/fa3_library.sh   # stock `fa3` where pieces c01-c04 have arrived
R=/tmp/res/$NAME
# --resume: the next call of a run longer than one call (bench_ttft.py keeps its state in $R): keep what is there
[[ " $* " == *" --resume "* ]] || rm -rf $R
mkdir -p $R
python3 scripts/bench_ttft.py --name $NAME --out-dir $R "$@" >> $R/bench.log 2>&1
echo "bench: exit $?"; tail -24 $R/$NAME.md 2>/dev/null
grep -h -E "Traceback|Error|error:" $R/*.log 2>/dev/null | grep -v "Ignore import error" | head -8 | cut -c1-300
grep -h "sglang_compact:" $R/*.log 2>/dev/null | head -2 | cut -c1-500
pkill -9 -f "sglang::|launch_server --model" 2>/dev/null
# the profiler's traces (--profile-steps) apart: a large one must not keep the tables from coming back
tar czf $OUT/$NAME.tgz --exclude=traces -C /tmp/res $NAME
if [[ -d $R/traces ]]; then tar cf $OUT/${NAME}_traces.tar -C $R traces; fi
