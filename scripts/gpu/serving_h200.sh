#!/usr/bin/env bash
# One GPU-host call: scripts/gpu/serving_check.py with the given flags; the report and the server logs tarred into
# $OUT/serving.tgz.   bash scripts/gpu/serving_h200.sh [serving_check.py flags]
set -uo pipefail
source scripts/gpu/setup.sh > /dev/null 2>&1 || exit 1
R=/tmp/res/serving; rm -rf $R; mkdir -p $R
timeout ${SERVING_S:-540} python3 scripts/gpu/serving_check.py --out $R "$@" > $R/run.log 2>&1
echo "serving_check: exit $?"
python3 scripts/gpu/serving_check.py --summary /tmp/res/serving/serving_check.json
grep -h -E "Traceback|Error" $R/*.log 2>/dev/null | grep -v "Ignore import error\|openai_harmony" | head -5
pkill -9 -f "sglang::|launch_server --model" 2>/dev/null
tar czf $OUT/serving.tgz -C /tmp/res serving
