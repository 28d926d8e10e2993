"""`python -m sglang_compact.eval ...`: see `sglang_compact.eval.cli`."""

import sys

from sglang_compact.eval.cli import main

sys.exit(main())
