"""A progress bar on stderr: tqdm when installed, else a line per step; or none."""

from __future__ import annotations

import sys


class _NoProgress:
    def update(self, k=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def progress(total: int, desc: str, enabled: bool = True):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        class _P:
            def __init__(self):
                self.n = 0

            def update(self, k=1):
                self.n += k
                print(f"{desc}: {self.n}/{total}", file=sys.stderr, flush=True)

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass
        return _P()
