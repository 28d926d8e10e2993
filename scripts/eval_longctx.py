#!/usr/bin/env python3
"""Long-context accuracy (RULER-style) and offline fidelity evaluation; see `sglang_compact/eval/cli.py`.

    python scripts/eval_longctx.py accuracy --start cpu-compact --lengths 2048 --n 5
    python scripts/eval_longctx.py fidelity --length 2048
    python scripts/eval_longctx.py report
"""

import sys

from sglang_compact.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
