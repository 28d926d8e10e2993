#!/usr/bin/env python3
"""Long-context accuracy (RULER-style) and offline fidelity evaluation; see `harness/eval/cli.py`.

    python scripts/eval_longctx.py accuracy --start cpu-compact --lengths 2048 --n 5
    python scripts/eval_longctx.py fidelity --length 2048
    python scripts/eval_longctx.py report
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository root: `harness` (and this checkout's package first)

from harness.eval.cli import main  # noqa: E402

# the command line's default paths (the harness has none of its own)
DEFAULTS = {
    "model": REPO / "models" / "smollm2-135m-instruct",      # HF folder (scripts/convert_smollm2.py)
    "results": REPO / "docs" / "results" / "accuracy.json",  # rows; accuracy.md/.png and fidelity.json beside it
    "out_dir": REPO / ".out" / "eval",                       # scored predictions and server logs of `accuracy`
}

if __name__ == "__main__":
    sys.exit(main(defaults=DEFAULTS))
