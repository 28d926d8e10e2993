"""scripts/build_wheelhouse.py: the plan (--dry-run, no network) and a real run restricted with --only to
this package's own wheel (built locally, no network): archive layout, MANIFEST hashes, install.sh."""

from __future__ import annotations

import hashlib
import re
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "build_wheelhouse.py"
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import build_wheelhouse as bw  # noqa: E402

PY = f"{sys.version_info[0]}.{sys.version_info[1]}"


def run(*args, check=True, **kw):
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO_ROOT,
                       timeout=300, **kw)
    if check and r.returncode != 0:
        pytest.fail(f"build_wheelhouse {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def pyproject_pins() -> dict[str, str]:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    return {bw.canonical(n): v for n, v in
            re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', text)}


def test_pins_file_matches_the_known_good_host_set_and_pyproject():
    items = bw.read_pins(bw.DEFAULT_REQUIREMENTS)
    pins = {i.name: i.version for i in items}
    assert len(items) == len(pins) == 36  # the 35 of the GPU host bundle + prometheus-client
    for name, version in pyproject_pins().items():  # sglang, flashinfer-python
        assert pins[name] == version, name
    host = REPO_ROOT.parent / "shared" / "gpu-host" / "requirements.txt"
    if host.exists():  # the workspace's bundle list, when it is beside the repository
        want = {i.name: i.version for i in bw.read_pins(host)}
        assert len(want) == 35
        assert {k: pins.get(k) for k in want} == want


def test_platform_expansion():
    tags = bw.expand_platforms("manylinux_2_34_x86_64")
    assert tags[0] == "manylinux_2_34_x86_64" and "manylinux_2_28_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and tags[-1] == "manylinux1_x86_64"
    assert bw.expand_platforms("manylinux_2_28_x86_64")[0] == "manylinux_2_28_x86_64"
    assert "manylinux_2_34_x86_64" not in bw.expand_platforms("manylinux_2_28_x86_64")
    assert bw.expand_platforms("manylinux2014_x86_64")[0] == "manylinux_2_17_x86_64"
    assert bw.expand_platforms("musllinux_1_2_x86_64") == ["musllinux_1_2_x86_64"]


def test_dry_run_lists_every_pin_without_fetching(tmp_path):
    out = tmp_path / "wh.tar"
    r = run("--dry-run", "--out", str(out))
    text = r.stdout
    assert "would fetch 36 and build 1 package(s)" in text
    for spec in ("sglang==0.5.17", "flashinfer-python==0.6.15.post1", "sglang-kernel==0.4.5", "sglang-compact=="):
        assert spec in text, spec
    assert "--only-binary=:all: --no-deps --implementation cp --python-version 3.12" in text
    assert "--platform manylinux_2_34_x86_64" in text and "--platform manylinux2014_x86_64" in text
    assert "wheel --no-deps" in text and "sm90" in text and "FA3" in text
    assert not out.exists()


def test_dry_run_only_and_options():
    r = run("--dry-run", "--only", "sglang,flashinfer-python", "--python-version", "3.11", "--cuda-arch", "100",
            "--platform", "manylinux_2_28_x86_64")
    lines = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith(("  fetch", "  build"))]
    assert lines == ["sglang==0.5.17", "flashinfer-python==0.6.15.post1"]
    assert "--python-version 3.11" in r.stdout and "sm100" in r.stdout
    assert "--platform manylinux_2_28_x86_64" in r.stdout and "--platform manylinux_2_34" not in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--only", "no-such-package"], "unknown package(s) no-such-package"),
    (["--out", "x.zip"], "use .tar"),
    (["--python-version", "312"], "expected MAJOR.MINOR"),
    (["--resolve"], "--resolve goes with --dry-run"),
])
def test_bad_arguments_exit_2(args, message):
    r = run("--dry-run", *args, check=False) if "--resolve" not in args else run(*args, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr


@pytest.fixture(scope="module")
def own_archive(tmp_path_factory):
    out = tmp_path_factory.mktemp("wh") / "own.tar.gz"
    r = run("--only", "sglang-compact", "--python-version", PY, "--out", str(out))
    assert f"wrote {out}" in r.stdout
    return out


def test_archive_layout_manifest_and_hashes(own_archive, tmp_path):
    with tarfile.open(own_archive) as tar:
        names = sorted(tar.getnames())
        modes = {m.name: m.mode for m in tar.getmembers()}
        tar.extractall(tmp_path)
    root = "sglang-compact-wheelhouse"
    wheel = f"{root}/wheels/sglang_compact-{bw.own_version()}-py3-none-any.whl"
    assert names == sorted([f"{root}/MANIFEST.json", f"{root}/install.sh", wheel])
    assert modes[f"{root}/install.sh"] & 0o111
    top = tmp_path / root
    m = json.loads((top / "MANIFEST.json").read_text())
    assert m["target"]["python_version"] == PY and m["target"]["platform"] == "manylinux_2_34_x86_64"
    assert m["arch"]["cuda_arch"] == "90" and any("FA3" in n for n in m["arch"]["notes"])
    assert [p["requirement"] for p in m["packages"]] == [f"sglang-compact=={bw.own_version()}"]
    assert set(m["files"]) == {"install.sh", wheel.split("/", 1)[1]}
    for rel, meta in m["files"].items():
        data = (top / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == meta["sha256"] and len(data) == meta["size"], rel
    # the wheel carries the package, its kernels and the SGLang plugin entry point
    import zipfile
    with zipfile.ZipFile(top / wheel.split("/", 1)[1]) as z:
        files = set(z.namelist())
        ep = next(n for n in files if n.endswith("entry_points.txt"))
        assert "sglang.srt.plugins" in z.read(ep).decode()
    assert "sglang_compact/srt/backend.py" in files and "sglang_compact/kernels/union.py" in files
    assert not any("__pycache__" in f for f in files)


def test_install_sh_installs_offline_and_refuses_tampering(own_archive, tmp_path):
    with tarfile.open(own_archive) as tar:
        tar.extractall(tmp_path)
    top = tmp_path / "sglang-compact-wheelhouse"
    script = (top / "install.sh").read_text()
    assert "--no-index --find-links" in script and "--no-deps" in script
    env = {**os.environ, "PYTHON": sys.executable, "PIP_NO_INDEX": "1"}
    target = tmp_path / "site"
    r = subprocess.run(["bash", str(top / "install.sh"), "--target", str(target)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "files verified" in r.stdout and (target / "sglang_compact" / "srt" / "backend.py").is_file()
    # a changed file is refused before pip runs
    wheel = next((top / "wheels").glob("*.whl"))
    wheel.write_bytes(wheel.read_bytes() + b"x")
    r = subprocess.run(["bash", str(top / "install.sh"), "--target", str(tmp_path / "site2")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode != 0 and "sha256 mismatch" in r.stderr
    assert not (tmp_path / "site2").exists()


def test_install_sh_refuses_another_python(tmp_path):
    out = tmp_path / "other.tar"
    run("--only", "sglang-compact", "--python-version", "3.99", "--out", str(out))
    with tarfile.open(out) as tar:
        tar.extractall(tmp_path)
    r = subprocess.run(["bash", str(tmp_path / "sglang-compact-wheelhouse" / "install.sh")], capture_output=True,
                       text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert r.returncode != 0 and "this wheelhouse is for Python 3.99" in r.stderr
