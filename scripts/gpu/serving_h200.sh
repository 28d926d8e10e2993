#!/usr/bin/env bash
# One GPU-host call: scripts/gpu/serving_check.py with the given flags; the report and the server logs tarred into
# $OUT/serving.tgz.   bash scripts/gpu/serving_h200.sh [serving_check.py flags]
set -uo pipefail
source scripts/gpu/setup.sh > /dev/null 2>&1 || exit 1
R=/tmp/res/serving; rm -rf $R; mkdir -p $R
timeout ${SERVING_S:-540} python3 scripts/gpu/serving_check.py --out $R "$@" > $R/run.log 2>&1
echo "serving_check: exit $?"
python3 - <<'PY'
import json
r = json.load(open("/tmp/res/serving/serving_check.json"))
for name, step in r["steps"].items():
    if name.startswith("dense_vs_"):
        print(name, f"{step.get('equal', 0)}/{step.get('n', '?')} equal;", step.get("error", ""),
              [(x["len"], x.get("error") or (x["first_divergence"], x["gap_flashinfer"], x["gap_compact"]))
               for x in step.get("rows", []) if not x["equal"]])
    else:
        print(name, {k: v for k, v in step.items() if k not in ("concurrent",)}, step.get("concurrent", {}).get("ok"),
              step.get("concurrent", {}).get("used_tokens_after_flush"))
PY
grep -h -E "Traceback|Error" $R/*.log 2>/dev/null | grep -v "Ignore import error\|openai_harmony" | head -5
pkill -9 -f "sglang::|launch_server --model" 2>/dev/null
tar czf $OUT/serving.tgz -C /tmp/res serving
