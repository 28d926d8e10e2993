"""The dense final chunk (`CompactConfig.dense_final_chunk`): which chunk is a request's last (the plugin's
`ForwardBatch.init_new` hook) and how the backend uses that note.

The hook and backend checks (`tests/_final_chunk_checks.py`) run in a child process where SGLang imports through
the CPU shim. End to end on a real CPU server: `tests/test_telemetry.py` (on, the default: the last chunk is a
dense final chunk on `/metrics`) and `tests/test_compact_server.py` (off: every chunk compact)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_compact.config import CompactConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import REPO_ROOT, SERVER_ENV  # noqa: E402


def test_config_decides_the_path():
    on, off = CompactConfig(min_prefix_len=512), CompactConfig(min_prefix_len=512, dense_final_chunk=False)
    assert on.dense_final_chunk  # the default
    assert on.uses_compact_path(1024) and not on.uses_compact_path(1024, final_chunk=True)
    assert off.uses_compact_path(1024, final_chunk=True)
    assert not on.uses_compact_path(256, final_chunk=False)
    with pytest.raises(ValueError, match="dense_final_chunk: must be a bool"):
        CompactConfig(dense_final_chunk=1)


def test_hook_and_backend_notes():
    script = Path(__file__).resolve().parent / "_final_chunk_checks.py"
    run = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"  # -c: the checkout first on sys.path
    r = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **SERVER_ENV}, cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert r.stdout.strip().splitlines()[-1] == "ok 3"
