#!/usr/bin/env python3
"""One layer's attention for one prefill chunk against its context: CompactAttention vs baselines.

The benchmark lives in `harness/bench_attention/` (what it measures and writes: `harness/bench_attention/cli.py`,
or --help). Results go to --out-dir, by default docs/results of this checkout.

    python3 scripts/bench_attention.py --smoke --check --out-dir $OUT/smoke
    python3 scripts/bench_attention.py --out-dir $OUT/results --deadline-s 540 ...
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository root: `harness`

from harness.bench_attention.cli import main  # noqa: E402

# the command line's default paths (the harness has none of its own)
DEFAULTS = {"out_dir": REPO / "docs" / "results"}  # speed.json, speed_attention.{md,png}, speed_attention_meta.json

if __name__ == "__main__":
    sys.exit(main(defaults=DEFAULTS))
