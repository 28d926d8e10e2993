#!/usr/bin/env python3
"""Long-context accuracy (RULER-style) and offline fidelity evaluation; see `sglang_compact/eval/cli.py`.

    python scripts/eval_longctx.py accuracy --start cpu-compact --lengths 2048 --n 5
    python scripts/eval_longctx.py fidelity --length 2048
    python scripts/eval_longctx.py report
"""

import sys
from pathlib import Path

# this checkout's package first: the results files are written beside the imported package
# (docs/results of its repository), so another installed copy would write into its own tree
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_compact.eval.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
