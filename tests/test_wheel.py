"""The wheel ships the product only: `sglang_compact/**` (with `sglang_compact/kernels/**`, built from `kernels/`)
and its `*.dist-info/**`; never the harness (`harness/`: eval, quoka, synthetic, benchmarks), the tests or the
scripts.

Builds offline from a copy of the source tree (so that the build's `build/` and `*.egg-info` stay out of the
checkout): `pip wheel . --no-deps --no-build-isolation --no-index`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

REPO_ROOT = Path(__file__).resolve().parent.parent
# not part of a source tree, or big and never packaged
SKIP = {".git", "models", ".out", "build", "dist", ".gpu", ".whl", "__pycache__", ".pytest_cache", ".hypothesis",
        ".benchmarks"}
FORBIDDEN = {"harness", "eval", "quoka", "synthetic", "tests", "scripts"}


def _ignore(_dir: str, names: list[str]) -> set[str]:
    return {n for n in names if n in SKIP or n.endswith(".egg-info")}


def test_wheel_ships_only_the_product(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO_ROOT, src, ignore=_ignore, symlinks=True)
    out = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index",
                        "--disable-pip-version-check", "-w", str(out)],
                       cwd=src, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = out.glob("sglang_compact-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
    dist_info = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    assert len(dist_info) == 1, dist_info
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"sglang_compact", *dist_info}, sorted(top)
    for n in names:
        parts = PurePosixPath(n).parts
        assert not FORBIDDEN & ({p for p in parts} | {PurePosixPath(p).stem for p in parts}), n
    assert "sglang_compact/__init__.py" in names and "sglang_compact/kernels/__init__.py" in names
    assert any(n.startswith("sglang_compact/srt/") for n in names)
