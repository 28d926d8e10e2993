"""`scripts/gpu/code_ab.sh`: an older revision's packages swapped in for its servers, and the tree's own back after,
whatever the server run does. Run here in a small git repository with a stand-in for bench_ttft.py (the GPU host
has no .git and no second copy of the tree, so this swap is the whole mechanism)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the stand-in for bench_ttft.py: reports which code it imported (the version mark in both packages) as its time,
# and fails for the method named in FAIL_FOR
FAKE_BENCH = """
import json, os, sys, pathlib
a = sys.argv
out = pathlib.Path(a[a.index("--out-dir") + 1]); out.mkdir(parents=True)
method = a[a.index("--methods") + 1]
version = {p: pathlib.Path(p).read_text().strip() for p in ("sglang_compact/version.py", "kernels/k.py")}
assert len(set(version.values())) == 1, version
ms = {"NEW": 1.0, "OLD": 2.0}[version["kernels/k.py"]]
json.dump([dict(method=method, ms=ms, ms_all=[ms, ms])], open(out / "speed.json", "w"))
sys.exit(1 if os.environ.get("FAIL_FOR") == str(ms) else 0)
"""


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    r = tmp_path / "repo"
    (r / "scripts/gpu").mkdir(parents=True)
    for name in ("code_ab.sh", "ab_table.py"):
        shutil.copy(ROOT / "scripts/gpu" / name, r / "scripts/gpu" / name)
    for name in ("setup.sh", "fa3_library.sh"):   # the GPU host's set-up: nothing to do here
        (r / "scripts/gpu" / name).write_text(":\n")
    (r / ".gitignore").write_text("/.ab/\n")
    (r / "sglang_compact").mkdir()
    (r / "kernels").mkdir()
    (r / "bench.py").write_text(FAKE_BENCH)

    def mark(version, extra=None):
        (r / "sglang_compact/version.py").write_text(version + "\n")
        (r / "kernels/k.py").write_text(version + "\n")
        if extra:
            (r / "sglang_compact" / extra).write_text("only in the new tree\n")
        _git(r, "add", "-A")
        _git(r, "commit", "-qm", version)
    _git(r, "init", "-q")
    mark("OLD")
    mark("NEW", extra="added.py")
    return r


def _run(repo, tmp_path, *args, **env):
    full = dict(os.environ, OUT=str(tmp_path / "out"), AB_RES=str(tmp_path / "res"), AB_BENCH="bench.py", **env)
    (tmp_path / "out").mkdir(exist_ok=True)
    return subprocess.run(["bash", "scripts/gpu/code_ab.sh", *args], cwd=repo, env=full, capture_output=True,
                          text=True, timeout=60)


def _tree(repo):
    return {p.relative_to(repo).as_posix(): p.read_text() for d in ("sglang_compact", "kernels")
            for p in sorted((repo / d).rglob("*")) if p.is_file()}


def test_old_revision_serves_in_between_and_the_tree_comes_back(repo, tmp_path):
    before = _tree(repo)
    p = _run(repo, tmp_path, "pack", "HEAD~1")
    assert p.returncode == 0, p.stderr
    assert (repo / ".ab/old.tgz").is_file()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    old = subprocess.run(["git", "rev-parse", "--short", "HEAD~1"], cwd=repo, capture_output=True, text=True).stdout
    assert (repo / ".ab/new.rev").read_text().strip() == head.strip()
    assert (repo / ".ab/old.rev").read_text().strip() == old.strip()

    p = _run(repo, tmp_path, "run", "fa3", "new", "old", "new")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {line.split("|")[1].strip(): float(line.split("|")[3]) for line in p.stdout.splitlines()
            if line.startswith("| ab_")}
    assert rows == {"ab_fa3_1": 1.0, "ab_new_1": 1.0, "ab_old_1": 2.0, "ab_new_2": 1.0}
    assert f"ab_old_1 (compact-quest_budget-0.3, code {old.strip()}): exit 0" in p.stdout
    assert _tree(repo) == before            # the new tree's own files, its added one included
    assert (tmp_path / "out/code_ab.tgz").is_file()
    speed = json.loads((tmp_path / "res/code_ab/ab_fa3_1/speed.json").read_text())
    assert speed[0]["method"] == "fa3"


def test_a_failed_server_run_of_the_old_code_still_restores_the_tree(repo, tmp_path):
    before = _tree(repo)
    assert _run(repo, tmp_path, "pack", "HEAD~1").returncode == 0
    p = _run(repo, tmp_path, "run", "old", FAIL_FOR="2.0")
    assert "ab_old_1 (compact-quest_budget-0.3" in p.stdout and "exit 1" in p.stdout
    assert _tree(repo) == before


def test_run_without_a_pack_says_what_to_do(repo, tmp_path):
    p = _run(repo, tmp_path, "run", "new")
    assert p.returncode == 2 and "pack it here" in p.stdout
