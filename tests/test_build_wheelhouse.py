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
    assert len(items) == len(pins) == 38  # the 35 of the GPU host bundle + prometheus-client + SGLang's
    assert pins["transformers"] == "5.12.1" and pins["tokenizers"] == "0.22.2"  # transformers / tokenizers pins
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
    assert "would fetch 38 and build 1 package(s)" in text
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


# --- trimming (synthetic wheels shaped like sglang-kernel's and xgrammar's; no network, no real wheel) ---------

import base64  # noqa: E402
import csv  # noqa: E402
import importlib.metadata  # noqa: E402
import io  # noqa: E402
import zipfile  # noqa: E402

KERNEL_FILES = {  # path: (bytes, mode, compression)
    "sgl_kernel/__init__.py": (b"from sgl_kernel.load_utils import *\n", 0o644, zipfile.ZIP_DEFLATED),
    "sgl_kernel/load_utils.py": (b"ops_subdir = 'sm90'\n", 0o644, zipfile.ZIP_DEFLATED),
    "sgl_kernel/sm90/common_ops.abi3.so": (b"\x7fELF sm90" * 500, 0o755, zipfile.ZIP_DEFLATED),
    "sgl_kernel/sm100/common_ops.abi3.so": (b"\x7fELF sm100" * 500, 0o755, zipfile.ZIP_DEFLATED),
    "sgl_kernel/flash_ops.abi3.so": (b"\x7fELF fa3" * 4000, 0o755, zipfile.ZIP_DEFLATED),
    "sgl_kernel/flashmla_ops.abi3.so": (b"\x7fELF mla" * 300, 0o755, zipfile.ZIP_DEFLATED),
    "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so": (b"\x7fELF infllm" * 300, 0o755, zipfile.ZIP_STORED),
    "sgl_kernel/spatial_ops.abi3.so": (b"\x7fELF spatial" * 100, 0o775, zipfile.ZIP_STORED),
    "triton_kernels/__init__.py": (b"", 0o644, zipfile.ZIP_DEFLATED),
}
XGRAMMAR_FILES = {
    "xgrammar/": (b"", 0o755, zipfile.ZIP_STORED),
    "xgrammar/__init__.py": (b"from .matcher import *\n", 0o644, zipfile.ZIP_DEFLATED),
    "xgrammar/matcher.py": (b"x = 1\n", 0o644, zipfile.ZIP_DEFLATED),
    "xgrammar/libxgrammar_bindings.so": (b"\x7fELF bindings" * 200, 0o755, zipfile.ZIP_DEFLATED),
    "xgrammar/include/": (b"", 0o755, zipfile.ZIP_STORED),
    "xgrammar/include/xgrammar.h": (b"#pragma once\n", 0o644, zipfile.ZIP_DEFLATED),
    "xgrammar/lib/": (b"", 0o755, zipfile.ZIP_STORED),
    "xgrammar/lib/libxgrammar.a": (b"!<arch>\n" * 3000, 0o644, zipfile.ZIP_DEFLATED),
}


def b64hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(where: Path, dist: str, version: str, tag: str, files: dict, project: str | None = None) -> Path:
    """A wheel as PyPI would ship it: the files, then dist-info METADATA, WHEEL, RECORD (RECORD last but one, as
    xgrammar's is: a licence after it)."""
    info = f"{dist}-{version}.dist-info"
    meta = (f"Metadata-Version: 2.1\nName: {project or dist}\nVersion: {version}\nSummary: test\n\n"
            f"Version: {version} in the description stays\n").encode()
    wheel_txt = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n".encode()
    entries = dict(files)
    entries[f"{info}/METADATA"] = (meta, 0o664, zipfile.ZIP_DEFLATED)
    entries[f"{info}/WHEEL"] = (wheel_txt, 0o644, zipfile.ZIP_DEFLATED)
    record = io.StringIO()
    w = csv.writer(record, lineterminator="\n")
    for name, (data, _, _) in entries.items():
        if not name.endswith("/"):
            w.writerow([name, b64hash(data), len(data)])
    w.writerow([f"{info}/RECORD", "", ""])
    w.writerow([f"{info}/licenses/LICENSE", b64hash(b"MIT\n"), 4])
    entries[f"{info}/RECORD"] = (record.getvalue().encode(), 0o644, zipfile.ZIP_DEFLATED)
    entries[f"{info}/licenses/LICENSE"] = (b"MIT\n", 0o644, zipfile.ZIP_DEFLATED)
    path = where / f"{dist}-{version}-{tag}.whl"
    where.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for name, (data, mode, comp) in entries.items():
            zi = zipfile.ZipInfo(name, (2025, 1, 2, 3, 4, 6))
            zi.compress_type = comp
            zi.external_attr = ((0o040000 if name.endswith("/") else 0o100000) | mode) << 16
            if name.endswith("/"):
                zi.external_attr |= 0x10
            z.writestr(zi, data)
    return path


def kernel_wheel(where: Path, tag="cp310-abi3-manylinux2014_x86_64", drop=()) -> Path:
    files = {k: v for k, v in KERNEL_FILES.items() if not any(k.startswith(d) for d in drop)}
    return make_wheel(where, "sglang_kernel", "0.4.5", tag, files, "sglang-kernel")


def xgrammar_wheel(where: Path, tag="cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64") -> Path:
    return make_wheel(where, "xgrammar", "0.2.1", tag, XGRAMMAR_FILES)


def check_trimmed(path: Path, original: Path, info_dir: str) -> dict[str, zipfile.ZipInfo]:
    """Every file of the trimmed wheel: listed in RECORD with the right hash and size (RECORD itself with none),
    and every entry also in the original is byte-identical with the same mode, compression and date."""
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(original) as o:
        infos = {i.filename: i for i in z.infolist()}
        rows = list(csv.reader(io.StringIO(z.read(f"{info_dir}/RECORD").decode())))
        record = {r[0]: (r[1], r[2]) for r in rows}
        assert len(rows) == len(record)
        files = {n for n in infos if not n.endswith("/")}
        assert set(record) == files
        assert record[f"{info_dir}/RECORD"] == ("", "")
        for name in files - {f"{info_dir}/RECORD"}:
            data = z.read(name)
            assert record[name] == (b64hash(data), str(len(data))), name
        old_info = next(n.split("/")[0] for n in o.namelist() if ".dist-info/" in n)
        for name, info in infos.items():
            src = name.replace(info_dir, old_info)
            if src.endswith(("/METADATA", "/RECORD")) and src.startswith(old_info):
                continue
            oi = o.getinfo(src)
            assert z.read(name) == o.read(src), name
            assert (info.external_attr, info.compress_type, info.date_time) == \
                   (oi.external_attr, oi.compress_type, oi.date_time), name
        assert z.testzip() is None
    return infos


def test_path_patterns_and_labels():
    m = bw.path_matches
    assert m("sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/sm*/")
    assert m("sgl_kernel/sm100/", "sgl_kernel/sm*/") and not m("sgl_kernel/sm100", "sgl_kernel/sm*/")
    assert not m("sgl_kernel/smx.py", "sgl_kernel/sm*/") and not m("other/sm90/x.so", "sgl_kernel/sm*/")
    assert m("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flash_ops.*")
    assert not m("sgl_kernel/sub/flash_ops.abi3.so", "sgl_kernel/flash_ops.*")
    assert [bw.sgl_kernel_arch_dir(a) for a in ("90", "90a", "100", "100a", "120", "80")] == \
           ["sm90", "sm90", "sm100", "sm100", "sm100", "sm100"]
    assert bw.local_version("0.4.5", "sm90") == "0.4.5+sm90"
    assert bw.local_version("2.1.0+cu121", "sm90") == "2.1.0+cu121.sm90"
    assert bw.trim_rule("sglang_kernel", "100a").label == "sm100" and bw.trim_rule("Xgrammar", "90").label == "nostatic"
    assert bw.trim_rule("sglang", "90") is None
    for rule in bw.TRIM_RULES.values():  # labels are valid PEP 440 local segments
        assert re.fullmatch(r"[a-z0-9{}]+", rule.label) and rule.why


def test_trim_sgl_kernel_keeps_only_the_target_arch(tmp_path):
    src = kernel_wheel(tmp_path / "in")
    before = src.read_bytes()
    done = bw.trim_wheel(src, tmp_path / "out", bw.trim_rule("sglang-kernel", "90"))
    assert src.read_bytes() == before  # the PyPI file is not touched by trim_wheel
    assert done["file"] == "sglang_kernel-0.4.5+sm90-cp310-abi3-manylinux2014_x86_64.whl"
    assert done["version"] == "0.4.5+sm90" and done["label"] == "sm90"
    gone = {"sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so",
            "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so"}
    assert {d["path"] for d in done["dropped"]} == gone
    assert done["dropped_bytes"] == sum(len(KERNEL_FILES[p][0]) for p in gone)
    out = tmp_path / "out" / done["file"]
    info = "sglang_kernel-0.4.5+sm90.dist-info"
    infos = check_trimmed(out, src, info)
    assert set(infos) == (set(KERNEL_FILES) - gone) | {f"{info}/{n}" for n in
                                                      ("METADATA", "WHEEL", "RECORD", "licenses/LICENSE")}
    assert (infos["sgl_kernel/sm90/common_ops.abi3.so"].external_attr >> 16) & 0o777 == 0o755
    assert (infos["sgl_kernel/spatial_ops.abi3.so"].external_attr >> 16) & 0o777 == 0o775
    assert infos["sgl_kernel/spatial_ops.abi3.so"].compress_type == zipfile.ZIP_STORED
    assert infos[f"{info}/METADATA"].external_attr >> 16 & 0o777 == 0o664
    with zipfile.ZipFile(out) as z, zipfile.ZipFile(src) as o:
        meta = z.read(f"{info}/METADATA").decode()
        assert "\nVersion: 0.4.5+sm90\n" in meta and "Version: 0.4.5 in the description stays" in meta
        assert meta.replace("0.4.5+sm90", "0.4.5", 1).encode() == o.read("sglang_kernel-0.4.5.dist-info/METADATA")
        assert z.read(f"{info}/WHEEL") == o.read("sglang_kernel-0.4.5.dist-info/WHEEL")
        assert z.namelist()[-1] == f"{info}/RECORD"


def test_trim_for_arch_100a_keeps_sm100(tmp_path):
    src = kernel_wheel(tmp_path / "in")
    done = bw.trim_wheel(src, tmp_path / "out", bw.trim_rule("sglang-kernel", "100a"))
    assert done["file"] == "sglang_kernel-0.4.5+sm100-cp310-abi3-manylinux2014_x86_64.whl"
    assert "sgl_kernel/sm90/common_ops.abi3.so" in {d["path"] for d in done["dropped"]}
    infos = check_trimmed(tmp_path / "out" / done["file"], src, "sglang_kernel-0.4.5+sm100.dist-info")
    assert "sgl_kernel/sm100/common_ops.abi3.so" in infos and not any("/sm90/" in n for n in infos)


def test_trim_without_the_needed_arch_dir_is_an_error(tmp_path):
    src = kernel_wheel(tmp_path / "in", drop=("sgl_kernel/sm90/",))
    with pytest.raises(bw.TrimError, match=r"has no sgl_kernel/sm90/ \(needed for this --cuda-arch\); "
                                           r"it has sgl_kernel/sm100/"):
        bw.trim_wheel(src, tmp_path / "out", bw.trim_rule("sglang-kernel", "90"))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_trim_refuses_a_wheel_whose_record_does_not_match(tmp_path):
    src = kernel_wheel(tmp_path / "in")
    with zipfile.ZipFile(src) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(src, "w") as z:
        for i, data in entries:
            z.writestr(i, data.replace(b"sm90", b"sm9x") if i.filename.endswith("load_utils.py") else data)
    with pytest.raises(bw.TrimError, match="load_utils.py does not match its RECORD"):
        bw.trim_wheel(src, tmp_path / "out", bw.trim_rule("sglang-kernel", "90"))
    assert list((tmp_path / "out").iterdir()) == []  # no half-written wheel left behind


def test_trim_xgrammar_drops_the_static_library(tmp_path):
    src = xgrammar_wheel(tmp_path / "in")
    done = bw.trim_wheel(src, tmp_path / "out", bw.trim_rule("xgrammar", "90"))
    assert done["file"] == "xgrammar-0.2.1+nostatic-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
    assert done["dropped"] == [{"path": "xgrammar/lib/libxgrammar.a", "size": 8 * 3000}]
    infos = check_trimmed(tmp_path / "out" / done["file"], src, "xgrammar-0.2.1+nostatic.dist-info")
    assert "xgrammar/lib/" not in infos  # left empty by the drop
    assert {"xgrammar/", "xgrammar/include/", "xgrammar/libxgrammar_bindings.so"} <= set(infos)


def test_trim_of_a_wheel_without_anything_to_drop_changes_nothing(tmp_path):
    src = make_wheel(tmp_path / "in", "xgrammar", "0.2.1", "py3-none-any", {"xgrammar/__init__.py": (b"", 0o644, 8)})
    assert bw.trim_wheel(src, tmp_path / "out", bw.trim_rule("xgrammar", "90")) is None


def test_trimmed_wheel_installs_with_pip_and_reports_the_local_version(tmp_path):
    rule = bw.trim_rule("sglang-kernel", "90")
    done = bw.trim_wheel(kernel_wheel(tmp_path / "in", tag="py3-none-any"), tmp_path / "out", rule)
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
                        "--no-deps", "--target", str(target), str(tmp_path / "out" / done["file"])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    dist = next(importlib.metadata.distributions(path=[str(target)]))
    assert dist.metadata["Name"] == "sglang-kernel" and dist.version == "0.4.5+sm90"
    assert (target / "sgl_kernel" / "sm90" / "common_ops.abi3.so").is_file()
    assert not (target / "sgl_kernel" / "sm100").exists()
    assert not list((target / "sgl_kernel").glob("flash*_ops*")) and not list(target.rglob("infllm_ops*"))
    assert os.stat(target / "sgl_kernel" / "sm90" / "common_ops.abi3.so").st_mode & 0o111


def test_trim_package_manifest_entry(tmp_path):
    wheels = tmp_path / "wheels"
    src = kernel_wheel(wheels)
    pypi_sha, pypi_size = hashlib.sha256(src.read_bytes()).hexdigest(), src.stat().st_size
    entry = {"name": "sglang-kernel", "version": "0.4.5", "requirement": "sglang-kernel==0.4.5",
             "file": f"wheels/{src.name}", "source": "pip download", "note": ""}
    e = bw.trim_package(entry, src, bw.trim_rule("sglang-kernel", "90"))
    new = "sglang_kernel-0.4.5+sm90-cp310-abi3-manylinux2014_x86_64.whl"
    assert sorted(os.listdir(wheels)) == [new]  # PyPI's file is replaced, never kept beside it
    assert e["requirement"] == "sglang-kernel==0.4.5+sm90" and e["version"] == "0.4.5+sm90"
    assert e["file"] == f"wheels/{new}"
    t = e["trimmed"]
    assert t["from"] == {"file": src.name, "sha256": pypi_sha, "size": pypi_size}
    assert t["to"] == {"file": new, "sha256": hashlib.sha256((wheels / new).read_bytes()).hexdigest(),
                       "size": (wheels / new).stat().st_size}
    assert t["label"] == "sm90" and "load_utils" in t["why"]
    assert {d["path"] for d in t["dropped"]} >= {"sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so"}
    assert t["dropped_bytes"] == sum(d["size"] for d in t["dropped"])


def test_dry_run_says_what_trimming_does():
    r = run("--dry-run", "--cuda-arch", "100a")
    assert "trim  sglang-kernel==0.4.5 -> sglang-kernel==0.4.5+sm100: drop sgl_kernel/sm*/" in r.stdout
    assert "(keeping sgl_kernel/sm100/)" in r.stdout and "flash_ops" in r.stdout
    assert "trim  xgrammar==0.2.1 -> xgrammar==0.2.1+nostatic: drop xgrammar/lib/libxgrammar.a" in r.stdout
    r = run("--dry-run", "--no-trim")
    assert "  trim " not in r.stdout and "no trimming (--no-trim)" in r.stdout


@pytest.mark.parametrize("trim", [True, False])
def test_build_trims_pinned_wheels_and_install_sh_installs_them(tmp_path, trim):
    """The whole build with pip fetching from a local folder (PIP_NO_INDEX + PIP_FIND_LINKS): the archive holds
    the relabelled wheels only, MANIFEST pins them, install.sh installs exactly those."""
    links = tmp_path / "links"
    kernel_wheel(links, tag="py3-none-any")
    xgrammar_wheel(links, tag="py3-none-any")
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("sglang-kernel==0.4.5\nxgrammar==0.2.1  # grammar\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}
    out = tmp_path / "wh.tar"
    r = run("--requirements", str(reqs), "--only", "sglang-kernel,xgrammar", "--python-version", PY,
            "--out", str(out), *([] if trim else ["--no-trim"]), env=env)
    with tarfile.open(out) as tar:
        tar.extractall(tmp_path / "x")
    top = tmp_path / "x" / "sglang-compact-wheelhouse"
    m = json.loads((top / "MANIFEST.json").read_text())
    wheels = sorted(os.listdir(top / "wheels"))
    reqs_ = [p["requirement"] for p in m["packages"]]
    assert m["trim"] is trim
    if trim:
        assert wheels == ["sglang_kernel-0.4.5+sm90-py3-none-any.whl", "xgrammar-0.2.1+nostatic-py3-none-any.whl"]
        assert reqs_ == ["sglang-kernel==0.4.5+sm90", "xgrammar==0.2.1+nostatic"]
        assert m["packages"][0]["trimmed"]["from"]["file"] == "sglang_kernel-0.4.5-py3-none-any.whl"
        assert m["packages"][1]["trimmed"]["dropped"][0]["path"] == "xgrammar/lib/libxgrammar.a"
        assert "trimmed sglang_kernel-0.4.5-py3-none-any.whl -> " in r.stderr
    else:
        assert wheels == ["sglang_kernel-0.4.5-py3-none-any.whl", "xgrammar-0.2.1-py3-none-any.whl"]
        assert reqs_ == ["sglang-kernel==0.4.5", "xgrammar==0.2.1"]
        assert not any("trimmed" in p for p in m["packages"])
    assert set(m["files"]) == {"install.sh", *(f"wheels/{w}" for w in wheels)}
    target = tmp_path / "site"
    r = subprocess.run(["bash", str(top / "install.sh"), "--target", str(target)], capture_output=True, text=True,
                       env={**env, "PYTHON": sys.executable}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    versions = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(target)])}
    assert versions == ({"sglang-kernel": "0.4.5+sm90", "xgrammar": "0.2.1+nostatic"} if trim
                        else {"sglang-kernel": "0.4.5", "xgrammar": "0.2.1"})
    assert (target / "sgl_kernel" / "flash_ops.abi3.so").exists() is not trim
    assert (target / "xgrammar" / "lib" / "libxgrammar.a").exists() is not trim
    assert (target / "sgl_kernel" / "sm90" / "common_ops.abi3.so").is_file()
