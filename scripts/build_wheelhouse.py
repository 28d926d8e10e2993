#!/usr/bin/env python3
"""Build an offline wheelhouse (one tar) for an air-gapped GPU serving node.

    python scripts/build_wheelhouse.py --out dist/wheelhouse.tar          # everything, trimmed (~74 MiB)
    python scripts/build_wheelhouse.py --no-trim --out dist/full.tar      # PyPI's wheels untouched (~454 MiB)
    python scripts/build_wheelhouse.py --dry-run                          # what it would fetch
    python scripts/build_wheelhouse.py --dry-run --resolve                # + the files (index metadata only)
    python scripts/build_wheelhouse.py --only sglang-compact --out x.tar  # just this package's wheel

What goes in:
* every pin of `requirements/gpu-wheelhouse.txt` (sglang==0.5.17, sglang-kernel,
  flashinfer-python==0.6.15.post1 and the server dependencies the offline GPU host
  bundle was seen serving with), each `pip download`ed with `--no-deps
  --only-binary=:all:` for the target interpreter (`--python-version`,
  CPython) and platform: `--platform` names the node's newest manylinux tag
  and is expanded to every older manylinux tag it can run (pip does not do
  that for an explicit `--platform`; sglang 0.5.17 ships only manylinux_2_34
  wheels while e.g. sglang-kernel is manylinux2014);
* this package's own wheel (`pip wheel --no-deps .`).

Trimming (default; `--no-trim` keeps PyPI's wheels as they are): a wheel with a rule in TRIM_RULES is rewritten
without what the node never loads: sglang-kernel keeps only the common_ops arch dir the target loads (`sm90/`
for `--cuda-arch 90`, `sm100/` otherwise) and loses flash_ops (FA3), flashmla_ops and infllm_ops; xgrammar
loses its static C++ library. A trimmed wheel gets a PEP 440 local version (`0.4.5+sm90`, `0.2.1+nostatic`):
new file name, dist-info dir, METADATA Version and RECORD; MANIFEST.json records PyPI's file and sha256, what
was dropped, and pins the local version for install.sh.

The archive holds one folder: `wheels/`, `MANIFEST.json` (target, arch notes,
packages, sha256 and size of every other file) and `install.sh`, which checks
the hashes and the interpreter, then installs the pinned set with
`pip install --no-index --find-links wheels --no-deps` (extra arguments, e.g.
`--target DIR`, are passed to pip). The node must already have what the pinned
set leaves out: torch 2.11.0+cu130, triton, numpy, huggingface-hub, ...

Exit status: 0 done, 1 a download/build failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REQUIREMENTS = REPO_ROOT / "requirements" / "gpu-wheelhouse.txt"
OWN_NAME = "sglang-compact"
ARCHIVE_ROOT = "sglang-compact-wheelhouse"
# sglang 0.5.17's wheels are manylinux_2_34 only; older tags are added by expand_platforms()
DEFAULT_PLATFORM = "manylinux_2_34_x86_64"
LEGACY_MANYLINUX = {(2, 5): "manylinux1", (2, 12): "manylinux2010", (2, 17): "manylinux2014"}

try:  # progress bar when tqdm is there, plain lines otherwise
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover - depends on the environment
    _tqdm = None


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Item:
    name: str            # canonical project name
    version: str
    note: str = ""
    own: bool = False    # built from this repository, not downloaded

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def read_pins(path: Path) -> list[Item]:
    items = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line, _, note = raw.partition("#")
        line = line.strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if not m:
            raise ValueError(f"{path}:{n}: expected NAME==VERSION, got {line!r}")
        items.append(Item(canonical(m.group(1)), m.group(2), note.strip()))
    return items


def own_version() -> str:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        m = re.search(r'^version\s*=\s*"([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text(), re.M)
        return m.group(1)
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def expand_platforms(platform: str) -> list[str]:
    """`manylinux_2_34_x86_64` -> itself and every older manylinux tag of that arch (newest first)."""
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    legacy = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", platform)
    if legacy:
        glibc = {v: k for k, v in LEGACY_MANYLINUX.items()}[legacy.group(1)]
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", f"manylinux_{glibc[0]}_{glibc[1]}_{legacy.group(2)}")
    if not m:
        return [platform]  # not manylinux (e.g. a musllinux or macOS tag): taken as is
    major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
    if major != 2:
        return [platform]
    tags = []
    for mi in range(minor, 4, -1):
        tags.append(f"manylinux_2_{mi}_{arch}")
        if (2, mi) in LEGACY_MANYLINUX:
            tags.append(f"{LEGACY_MANYLINUX[(2, mi)]}_{arch}")
    return tags


def target_flags(args) -> list[str]:
    flags = ["--only-binary=:all:", "--no-deps", "--implementation", "cp", "--python-version", args.python_version]
    for p in expand_platforms(args.platform):
        flags += ["--platform", p]
    return flags


def arch_notes(cuda_arch: str, trim: bool = True) -> dict:
    sm, kdir = f"sm{cuda_arch}", sgl_kernel_arch_dir(cuda_arch)
    if trim:
        kernel = (f"sglang-kernel is trimmed to the common_ops build sgl_kernel loads on {sm} ({kdir}/; version "
                  f"+{kdir}); the other arch dirs and the flash_ops (FA3), flashmla_ops and infllm_ops libraries are "
                  "not in it, so attention backends fa3, flashmla and InfLLM-V2 are unavailable. xgrammar is "
                  "without its static C++ library (+nostatic). Build with --no-trim for PyPI's wheels as they are.")
    else:
        kernel = (f"sglang-kernel ships one wheel holding a common_ops build per arch dir (sm90/, sm100/); on {sm} "
                  f"sgl_kernel loads {kdir}/, so only that build matters (the others may be deleted after install "
                  "to save space).")
    return {
        "cuda_arch": cuda_arch,
        "sm": sm,
        "sgl_kernel_arch_dir": kdir,
        "notes": [
            kernel,
            "FA3 (sgl_kernel's flash_ops library) is not needed: `compact` serves prefill and decode through "
            "FlashInfer. Name the backend explicitly (`--attention-backend compact`, or `flashinfer`): SGLang's "
            "default on Hopper is fa3.",
            f"flashinfer-python compiles its kernels just in time for {sm} on first use (needs nvcc / "
            "CUDA_HOME); carry a JIT cache built at the same absolute path to skip that.",
            "Not included (the node must have them): torch 2.11.0+cu130, triton 3.6, numpy, safetensors, "
            "huggingface-hub and the other dependencies of transformers (which is included, at SGLang's pin).",
        ],
    }


def select(items: list[Item], only: list[str] | None) -> list[Item]:
    if not only:
        return items
    want = [canonical(n) for n in only]
    known = {i.name: i for i in items}
    unknown = [n for n in want if n not in known]
    if unknown:
        raise ValueError(f"--only: unknown package(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [i for i in items if i.name in want]


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def wheel_project(filename: str) -> str:
    return canonical(filename.split("-")[0])


# ---------------------------------------------------------------------------------------------------------------
# Trimming: a wheel with a rule below is rewritten without what the node never loads, under a PEP 440 local
# version (`0.4.5+sm90`), so a trimmed file is never named like PyPI's. `--no-trim` keeps PyPI's wheels as is.

@dataclass(frozen=True)
class TrimRule:
    label: str                  # the local version label; "{sm}" is the sgl_kernel arch dir kept (sm90 / sm100)
    drop: tuple[str, ...]       # paths in the wheel: `*` matches within one path part, a trailing `/` = a folder
    why: str
    keep: tuple[str, ...] = ()  # never dropped and must be there (a wheel without it is an error)


TRIM_RULES = {
    "sglang-kernel": TrimRule(
        label="{sm}",
        drop=("sgl_kernel/sm*/", "sgl_kernel/flash_ops.*", "sgl_kernel/flashmla_ops.*", "sgl_kernel/infllm_ops.*"),
        keep=("sgl_kernel/{sm}/",),
        why="one wheel holds a common_ops build per arch dir; sgl_kernel/load_utils.py loads sm90/ on compute "
            "capability 9.0 and sm100/ on every other GPU, so only {sm}/ is ever loaded on the target. flash_ops "
            "(FA3, 1.1 GB unpacked), flashmla_ops (FlashMLA) and infllm_ops (InfLLM-V2) are imported only by their "
            "own attention backends (guarded imports); `compact` serves through FlashInfer"),
    "xgrammar": TrimRule(
        label="nostatic",
        drop=("xgrammar/lib/libxgrammar.a",),
        why="static C++ library, only for linking C++ code against xgrammar; Python loads libxgrammar_bindings.so"),
}
# RECORD signatures would no longer match the rebuilt RECORD
RECORD_SIGNATURES = ("RECORD.jws", "RECORD.p7s")


class TrimError(Exception):
    pass


def sgl_kernel_arch_dir(cuda_arch: str) -> str:
    """The common_ops dir sgl_kernel loads on that GPU: sm90 on compute capability 9.0 (also `90a`), else sm100."""
    return "sm90" if int(re.match(r"\d+", cuda_arch).group()) == 90 else "sm100"


def trim_rule(project: str, cuda_arch: str) -> TrimRule | None:
    rule = TRIM_RULES.get(canonical(project))
    if rule is None:
        return None
    sm = sgl_kernel_arch_dir(cuda_arch)
    fill = lambda s: s.replace("{sm}", sm)  # noqa: E731
    return TrimRule(fill(rule.label), tuple(map(fill, rule.drop)), fill(rule.why), tuple(map(fill, rule.keep)))


def local_version(version: str, label: str) -> str:
    return f"{version}.{label}" if "+" in version else f"{version}+{label}"


def path_matches(path: str, pattern: str) -> bool:
    """`pattern` against a wheel entry: part by part, `*`/`?` never cross `/`; `dir/` matches all under dir."""
    parts, pat = path.split("/"), pattern.rstrip("/").split("/")
    if pattern.endswith("/"):
        return len(parts) > len(pat) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pat))
    return len(parts) == len(pat) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pat))


def record_hash(digest: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _set_version(metadata: bytes, old: str, new: str) -> bytes:
    head, sep, body = metadata.partition(b"\n\n")
    head, n = re.subn(rb"^Version:[ \t]*" + re.escape(old.encode()) + rb"[ \t]*(\r?)$",
                      b"Version: " + new.encode() + rb"\1", head, count=1, flags=re.M)
    if n != 1:
        raise TrimError(f"METADATA has no `Version: {old}` header")
    return head + sep + body


def trim_wheel(wheel: Path, out_dir: Path, rule: TrimRule) -> dict | None:
    """Write `wheel` without the entries `rule` drops, as version `<version>+<label>`, into out_dir (the dist-info
    dir renamed, METADATA's Version set, RECORD rebuilt; every kept entry keeps its bytes, date, compression and
    permissions; WHEEL is untouched). Returns what was done, or None when the rule drops nothing there."""
    parts = wheel.name[:-len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise TrimError(f"{wheel.name}: not a wheel file name")
    version = parts[1]
    new_version = local_version(version, rule.label)
    new_name = "-".join([parts[0], new_version, *parts[2:]]) + ".whl"
    with zipfile.ZipFile(wheel) as zin:
        infos = zin.infolist()
        names = [i.filename for i in infos]
        info_dirs = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
        if len(info_dirs) != 1:
            raise TrimError(f"{wheel.name}: expected one .dist-info dir, found {sorted(info_dirs) or 'none'}")
        old_info = info_dirs.pop()
        dist, _, info_version = old_info[:-len(".dist-info")].partition("-")
        if info_version != version:
            raise TrimError(f"{wheel.name}: its dist-info dir {old_info} has another version")
        renames = {f"{dist}-{version}.dist-info/": f"{dist}-{new_version}.dist-info/",
                   f"{dist}-{version}.data/": f"{dist}-{new_version}.data/"}
        record_name, metadata_name = f"{old_info}/RECORD", f"{old_info}/METADATA"
        if record_name not in names or metadata_name not in names:
            raise TrimError(f"{wheel.name}: no {record_name} or {metadata_name}")

        for k in rule.keep:
            if not any(path_matches(n, k) and not n.endswith("/") for n in names):
                have = sorted({"/".join(n.split("/")[:len(k.rstrip("/").split("/"))]) + "/"
                               for n in names if any(path_matches(n, d) for d in rule.drop if d.endswith("/"))})
                raise TrimError(f"{wheel.name} has no {k} (needed for this --cuda-arch); it has "
                                f"{', '.join(have) or 'no such dirs'}")
        kept = lambda n: any(path_matches(n, k) for k in rule.keep)  # noqa: E731
        drop = {n for n in names if not kept(n) and any(path_matches(n, p) for p in rule.drop)}
        if not drop:
            return None
        drop |= {n for n in names if n in (f"{old_info}/{s}" for s in RECORD_SIGNATURES)}
        # folder entries left empty by the drop go too
        files_left = [n for n in names if n not in drop and not n.endswith("/")]
        drop |= {n for n in names if n.endswith("/") and any(d.startswith(n) for d in drop)
                 and not any(f.startswith(n) for f in files_left)}

        old_record = {}
        for row in csv.reader(io.StringIO(zin.read(record_name).decode())):
            if row:
                old_record[row[0]] = row[1] if len(row) > 1 else ""

        def rename(n: str) -> str:
            for old, new in renames.items():
                if n.startswith(old):
                    return new + n[len(old):]
            return n

        out_dir.mkdir(parents=True, exist_ok=True)
        part = out_dir / (new_name + ".part")
        record_rows, dropped = [], []
        try:
            with zipfile.ZipFile(part, "w") as zout:
                for info in infos:
                    if info.filename in drop:
                        if not info.filename.endswith("/"):
                            dropped.append({"path": info.filename, "size": info.file_size})
                        continue
                    if info.filename == record_name:
                        continue  # rebuilt, written last
                    zi = _clone(info, rename(info.filename))
                    if info.is_dir():
                        zout.writestr(zi, b"")
                        continue
                    if info.filename == metadata_name:
                        data = _set_version(zin.read(info), version, new_version)
                        zout.writestr(zi, data)
                        digest, size = hashlib.sha256(data).digest(), len(data)
                    else:
                        digest, size = _copy_entry(zin, info, zout, zi)
                        want = old_record.get(info.filename)
                        if want and want != record_hash(digest):
                            raise TrimError(f"{wheel.name}: {info.filename} does not match its RECORD")
                    record_rows.append([zi.filename, record_hash(digest), str(size)])
                new_record = rename(record_name)
                record_rows.append([new_record, "", ""])
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(record_rows)
                zout.writestr(_clone(zin.getinfo(record_name), new_record), buf.getvalue().encode())
            out = out_dir / new_name
            part.replace(out)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    return {"file": new_name, "version": new_version, "label": rule.label, "dropped": dropped,
            "dropped_bytes": sum(d["size"] for d in dropped)}


def _clone(info: zipfile.ZipInfo, name: str) -> zipfile.ZipInfo:
    zi = zipfile.ZipInfo(name, info.date_time)
    zi.compress_type, zi.external_attr, zi.create_system = info.compress_type, info.external_attr, info.create_system
    zi.comment, zi.file_size = info.comment, info.file_size
    return zi


def _copy_entry(zin: zipfile.ZipFile, info: zipfile.ZipInfo, zout: zipfile.ZipFile, zi: zipfile.ZipInfo):
    h, size = hashlib.sha256(), 0
    with zin.open(info) as src, zout.open(zi, "w", force_zip64=info.file_size >= zipfile.ZIP64_LIMIT) as dst:
        while chunk := src.read(1 << 20):
            h.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    return h.digest(), size


def pip_cmd(args) -> list[str]:
    return [args.python, "-m", "pip", "--disable-pip-version-check"]


def plan_commands(args, items: list[Item], dest: str, src: str = ".") -> list[tuple[Item, list[str]]]:
    out = []
    for it in items:
        if it.own:
            cmd = pip_cmd(args) + ["wheel", "--no-deps", "--wheel-dir", dest]
            if not build_isolation(args):
                cmd.append("--no-build-isolation")
            cmd.append(src)
        else:
            cmd = pip_cmd(args) + ["download", *target_flags(args), "--dest", dest, it.spec]
        out.append((it, cmd))
    return out


SOURCE_PATHS = ("pyproject.toml", "README.md", "sglang_compact", "kernels")


def copy_source(dest: Path) -> Path:
    """This package's sources (what pyproject.toml builds from) in a clean folder: the wheel is built there,
    so no build/ or stale files of the working tree end up in it or are left behind."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    dest.mkdir(parents=True)
    for rel in SOURCE_PATHS:
        src = REPO_ROOT / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=ignore)
        else:
            shutil.copy2(src, dest / rel)
    return dest


def build_isolation(args) -> bool:
    """Build our wheel in isolation unless the running Python already has the build backend (offline-safe)."""
    if args.build_isolation != "auto":
        return args.build_isolation == "yes"
    try:
        import setuptools
        import wheel  # noqa: F401
    except ImportError:
        return True
    return int(setuptools.__version__.split(".")[0]) < 68


def resolve(args, items: list[Item]) -> int:
    """Ask the index which file each pin would fetch (metadata only, nothing downloaded)."""
    pins = [i for i in items if not i.own]
    if not pins:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = pip_cmd(args) + ["install", "--dry-run", "--ignore-installed", "--target", str(Path(tmp) / "t"),
                               "--report", str(report), *target_flags(args), *[i.spec for i in pins]]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stdout[-3000:] + r.stderr[-3000:], file=sys.stderr)
            print("resolve: failed (see pip's message above)", file=sys.stderr)
            return 1
        files = {canonical(e["metadata"]["name"]): e["download_info"]["url"].rsplit("/", 1)[-1]
                 for e in json.loads(report.read_text())["install"]}
    print(f"resolved {len(files)} of {len(pins)} pins:")
    for i in pins:
        print(f"  {i.spec:40s} {files.get(i.name, 'NOT RESOLVED')}")
    return 0 if all(i.name in files for i in pins) else 1


INSTALL_SH = r"""#!/usr/bin/env bash
# Install this offline wheelhouse (built by sglang-compact's scripts/build_wheelhouse.py).
#
#   bash install.sh                      # into the current interpreter's site-packages
#   bash install.sh --target /opt/site   # extra arguments go to pip
#   PYTHON=/path/to/python bash install.sh
#
# Checks every file against MANIFEST.json (sha256) and the interpreter against the
# target, then: pip install --no-index --find-links wheels --no-deps <the pinned set>.
# The node must already have what the set leaves out (see MANIFEST.json "arch" notes).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
"$PY" - "$HERE" <<'EOF'
import hashlib, json, pathlib, sys
here = pathlib.Path(sys.argv[1])
m = json.loads((here / "MANIFEST.json").read_text())
want = m["target"]["python_version"]
have = "%d.%d" % sys.version_info[:2]
if have != want:
    sys.exit(f"install.sh: this wheelhouse is for Python {want}, {sys.executable} is {have} (set PYTHON=...)")
bad = []
for rel, meta in m["files"].items():
    p = here / rel
    if not p.is_file():
        bad.append(f"missing {rel}")
    elif hashlib.sha256(p.read_bytes()).hexdigest() != meta["sha256"]:
        bad.append(f"sha256 mismatch {rel}")
if bad:
    sys.exit("install.sh: " + "; ".join(bad))
print(f"install.sh: {len(m['files'])} files verified, Python {have}, target {m['target']['platform']} "
      f"sm{m['arch']['cuda_arch']}")
EOF
mapfile -t SPECS < <("$PY" -c 'import json, sys
for p in json.load(open(sys.argv[1]))["packages"]:
    print(p["requirement"])' "$HERE/MANIFEST.json")
"$PY" -m pip install --disable-pip-version-check --no-index --find-links "$HERE/wheels" --no-deps "$@" "${SPECS[@]}"
echo "install.sh: installed ${#SPECS[@]} packages"
"""


def add_file(tar: tarfile.TarFile, path: Path, arcname: str, mode: int = 0o644) -> None:
    info = tar.gettarinfo(str(path), arcname)
    info.mode, info.uid, info.gid, info.uname, info.gname = mode, 0, 0, "", ""
    with open(path, "rb") as f:
        tar.addfile(info, f)


def tar_mode(out: Path) -> str:
    name = out.name
    if name.endswith((".tar.gz", ".tgz")):
        return "w:gz"
    if name.endswith((".tar.xz", ".txz")):
        return "w:xz"
    if name.endswith(".tar"):
        return "w"
    raise ValueError(f"--out {out}: use .tar, .tar.gz/.tgz or .tar.xz")


def progress(items, desc: str):
    if _tqdm is not None and sys.stderr.isatty():
        return _tqdm(items, desc=desc, unit="pkg")
    return _PlainProgress(items, desc)


class _PlainProgress:
    def __init__(self, items, desc):
        self.items, self.desc = list(items), desc

    def __iter__(self):
        for k, it in enumerate(self.items, 1):
            print(f"[{self.desc} {k}/{len(self.items)}] {it[0].spec}", file=sys.stderr, flush=True)
            yield it

    def set_postfix_str(self, s):
        pass


def trim_package(entry: dict, wheel: Path, rule: TrimRule) -> dict:
    """Trim the downloaded `wheel` in place (PyPI's file replaced by the relabelled one); the MANIFEST entry says
    what it was, what went and what it is now. Unchanged when the rule drops nothing in this wheel."""
    src = {"file": wheel.name, "sha256": sha256(wheel), "size": wheel.stat().st_size}
    done = trim_wheel(wheel, wheel.parent, rule)
    if done is None:
        print(f"warning: {wheel.name}: trim rule matched nothing, kept as is", file=sys.stderr)
        return entry
    new = wheel.parent / done["file"]
    wheel.unlink()
    to = {"file": new.name, "sha256": sha256(new), "size": new.stat().st_size}
    print(f"trimmed {src['file']} -> {to['file']}: dropped {len(done['dropped'])} file(s), "
          f"{done['dropped_bytes'] / 2**20:.0f} MiB unpacked; "
          f"{src['size'] / 2**20:.1f} -> {to['size'] / 2**20:.1f} MiB",
          file=sys.stderr)
    return {**entry, "version": done["version"], "requirement": f"{entry['name']}=={done['version']}",
            "file": f"wheels/{new.name}",
            "trimmed": {"from": src, "to": to, "label": done["label"], "why": rule.why,
                        "dropped": done["dropped"], "dropped_bytes": done["dropped_bytes"]}}


def build(args, items: list[Item]) -> int:
    out = Path(args.out).resolve()
    mode = tar_mode(out)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        stage = Path(tmp) / ARCHIVE_ROOT
        wheels = stage / "wheels"
        wheels.mkdir(parents=True)
        packages = []
        src = copy_source(Path(tmp) / "src") if any(i.own for i in items) else Path(tmp)
        bar = progress(plan_commands(args, items, str(wheels), str(src)), "wheelhouse")
        for it, cmd in bar:
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(it.spec)
            before = set(os.listdir(wheels))
            r = subprocess.run(cmd, capture_output=True, text=True)
            new = sorted(set(os.listdir(wheels)) - before)
            if r.returncode != 0:
                print(f"error: {it.spec}: {shlex.join(cmd)} failed:\n{(r.stdout + r.stderr)[-4000:]}", file=sys.stderr)
                return 1
            mine = [f for f in new if f.endswith(".whl") and wheel_project(f) == it.name]
            if len(mine) != 1:
                print(f"error: {it.spec}: expected one new wheel, pip left {new or 'nothing'}", file=sys.stderr)
                return 1
            entry = {"name": it.name, "version": it.version, "requirement": it.spec,
                     "file": f"wheels/{mine[0]}", "source": "built from this repository" if it.own
                     else "pip download", "note": it.note}
            rule = trim_rule(it.name, args.cuda_arch) if args.trim and not it.own else None
            if rule is not None:
                try:
                    entry = trim_package(entry, wheels / mine[0], rule)
                except (TrimError, zipfile.BadZipFile, OSError) as e:
                    print(f"error: {it.spec}: trimming {mine[0]}: {e}", file=sys.stderr)
                    return 1
            packages.append(entry)
        (stage / "install.sh").write_text(INSTALL_SH)
        files = {}
        for p in sorted(stage.rglob("*")):
            if p.is_file():
                rel = p.relative_to(stage).as_posix()
                files[rel] = {"sha256": sha256(p), "size": p.stat().st_size}
        manifest = {
            "format": 1,
            "built_by": "sglang-compact scripts/build_wheelhouse.py",
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "target": {"python_version": args.python_version, "implementation": "cp", "platform": args.platform,
                       "platform_tags": expand_platforms(args.platform)},
            "arch": arch_notes(args.cuda_arch, args.trim),
            "trim": args.trim,
            "requirements_file": os.path.relpath(args.requirements, REPO_ROOT),
            "only": args.only or None,
            "install": "bash install.sh [pip args]  (pip install --no-index --find-links wheels --no-deps ...)",
            "packages": packages,
            "files": files,
        }
        (stage / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        with tarfile.open(part, mode) as tar:
            for p in sorted(stage.rglob("*")):
                if p.is_file():
                    rel = p.relative_to(stage).as_posix()
                    add_file(tar, p, f"{ARCHIVE_ROOT}/{rel}", 0o755 if rel == "install.sh" else 0o644)
        part.replace(out)
    size = out.stat().st_size
    print(f"wrote {out} ({len(packages)} packages, {size / 2**20:.1f} MiB) in {time.monotonic() - t0:.1f}s")
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python-version", default="3.12", help="target interpreter, MAJOR.MINOR (default 3.12)")
    p.add_argument("--platform", default=DEFAULT_PLATFORM,
                   help=f"the node's newest manylinux tag (default {DEFAULT_PLATFORM}: sglang 0.5.17 has only "
                        "manylinux_2_34 wheels); every older manylinux tag is accepted too")
    p.add_argument("--cuda-arch", default="90",
                   help="target GPU arch, e.g. 90 for sm90 (H100/H200; default), 100a, 120; picks the sglang-kernel "
                        "build kept (sm90/ for 90, sm100/ otherwise); recorded in MANIFEST.json")
    p.add_argument("--out", default=None, help="archive to write (.tar, .tar.gz, .tar.xz); default "
                   "dist/sglang-compact-wheelhouse-py<ver>-sm<arch>.tar")
    p.add_argument("--requirements", default=str(DEFAULT_REQUIREMENTS), help="pinned NAME==VERSION list")
    p.add_argument("--only", action="append", default=None, metavar="NAMES",
                   help=f"restrict to these packages (comma-separated, repeatable); {OWN_NAME} is this package")
    p.add_argument("--no-trim", dest="trim", action="store_false",
                   help="keep PyPI's wheels untouched (default: trim sglang-kernel to the target's arch and drop "
                        "FA3/FlashMLA/InfLLM, drop xgrammar's static library; ~74 MiB instead of ~454 MiB)")
    p.add_argument("--dry-run", action="store_true", help="print what would be fetched and built; fetch nothing")
    p.add_argument("--resolve", action="store_true",
                   help="with --dry-run: also ask the index which file each pin resolves to (metadata only)")
    p.add_argument("--build-isolation", choices=("auto", "yes", "no"), default="auto",
                   help="for this package's wheel; auto: off when this Python has setuptools>=68 and wheel")
    p.add_argument("--python", default=sys.executable, help="interpreter whose pip runs (default this one)")
    args = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        p.error(f"--python-version {args.python_version!r}: expected MAJOR.MINOR, e.g. 3.12")
    if not re.fullmatch(r"\d+[a-z]?", args.cuda_arch):
        p.error(f"--cuda-arch {args.cuda_arch!r}: expected digits, e.g. 90 (sm90) or 100a")
    if args.resolve and not args.dry_run:
        p.error("--resolve goes with --dry-run")
    if args.only:
        args.only = [n.strip() for chunk in args.only for n in chunk.split(",") if n.strip()]
    if args.out is None:
        args.out = str(REPO_ROOT / "dist" / f"{ARCHIVE_ROOT}-py{args.python_version.replace('.', '')}"
                       f"-sm{args.cuda_arch}.tar")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        items = read_pins(Path(args.requirements)) + [Item(OWN_NAME, own_version(), "this package", own=True)]
        items = select(items, args.only)
        tar_mode(Path(args.out))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        tags = expand_platforms(args.platform)
        older = f" and {len(tags) - 1} older manylinux tags (down to {tags[-1]})" if len(tags) > 1 else ""
        print(f"target: CPython {args.python_version}, platform {tags[0]}{older}, sm{args.cuda_arch}")
        print(f"would fetch {sum(not i.own for i in items)} and build {sum(i.own for i in items)} "
              f"package(s) into {args.out}:")
        common = shlex.join(pip_cmd(args) + ["download", *target_flags(args), "--dest", "<stage>/wheels"])
        for it, cmd in plan_commands(args, items, "<stage>/wheels", str(REPO_ROOT)):
            if it.own:
                print(f"  build {it.spec:38s} $ {shlex.join(cmd)}")
            else:
                print(f"  fetch {it.spec:38s} {('# ' + it.note) if it.note else ''}".rstrip())
        if any(not i.own for i in items):
            print(f"each fetch runs: {common} NAME==VERSION")
        trims = [(it, trim_rule(it.name, args.cuda_arch)) for it in items if not it.own]
        trims = [(it, r) for it, r in trims if r is not None]
        if trims and not args.trim:
            print(f"no trimming (--no-trim): {', '.join(it.name for it, _ in trims)} kept as PyPI ships them")
        for it, r in trims if args.trim else ():
            drop = ", ".join(r.drop) + (f" (keeping {', '.join(r.keep)})" if r.keep else "")
            print(f"  trim  {it.spec} -> {it.name}=={local_version(it.version, r.label)}: drop {drop}")
            print(f"        why: {r.why}")
        for note in arch_notes(args.cuda_arch, args.trim)["notes"]:
            print(f"note: {note}")
        return resolve(args, items) if args.resolve else 0
    return build(args, items)


if __name__ == "__main__":
    sys.exit(main())
