#!/usr/bin/env python3
"""Move files bigger than one transfer to the GPU host: split here, carry the pieces over back-to-back
calls into /tmp there, join and check there.

    # here: pieces named NAME.000, NAME.001, ... of at most SIZE bytes, and NAME.sha256
    # (52 MB leaves room for the tracked tree, which travels with every call, under the 64 MiB upload limit)
    python3 scripts/gpu/pieces.py split FILE --name NAME --size 52000000 --out .pieces/NAME
    # there, in each call: collect what this call carried
    python3 scripts/gpu/pieces.py collect .pieces --into /tmp/pieces
    # there, once all are in: concatenate in order, check the sha256 (and zstd-decompress with --unzstd)
    python3 scripts/gpu/pieces.py join NAME --dir /tmp/pieces --out FILE [--unzstd]

`--first SIZE` makes the first piece smaller (to share a call with the bundle).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path


def split(a) -> None:
    src, out = Path(a.file), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with open(src, "rb") as f:
        i, size = 0, a.first or a.size
        while block := f.read(size):
            h.update(block)
            (out / f"{a.name}.{i:03d}").write_bytes(block)
            i, size = i + 1, a.size
    (out / f"{a.name}.sha256").write_text(h.hexdigest() + "\n")
    print(f"{src}: {i} pieces in {out}, sha256 {h.hexdigest()}")


def collect(a) -> None:
    into = Path(a.into)
    into.mkdir(parents=True, exist_ok=True)
    n = 0
    for p in Path(a.src).rglob("*"):
        if p.is_file():
            shutil.copy2(p, into / p.name)
            n += 1
    print(f"collected {n} files into {into}: {sorted(x.name for x in into.iterdir())}")


def join(a) -> int:
    d = Path(a.dir)
    pieces = sorted(d.glob(f"{a.name}.[0-9][0-9][0-9]"))
    want = (d / f"{a.name}.sha256").read_text().split()[0]
    h = hashlib.sha256()
    tmp = Path(str(a.out) + ".part")
    with open(tmp, "wb") as out:
        for p in pieces:
            block = p.read_bytes()
            h.update(block)
            if not a.unzstd:
                out.write(block)
    if h.hexdigest() != want:
        print(f"{a.name}: sha256 {h.hexdigest()} != {want} ({len(pieces)} pieces: a piece is missing?)")
        return 1
    if a.unzstd:
        import zstandard
        with open(tmp, "wb") as out:
            dec = zstandard.ZstdDecompressor(max_window_size=1 << 31).decompressobj()
            for p in pieces:
                out.write(dec.decompress(p.read_bytes()))
    tmp.rename(a.out)
    print(f"{a.name}: {len(pieces)} pieces joined into {a.out}, sha256 ok")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("file")
    s.add_argument("--name", required=True)
    s.add_argument("--size", type=int, required=True)
    s.add_argument("--first", type=int, default=None)
    s.add_argument("--out", required=True)
    c = sub.add_parser("collect")
    c.add_argument("src")
    c.add_argument("--into", required=True)
    j = sub.add_parser("join")
    j.add_argument("name")
    j.add_argument("--dir", required=True)
    j.add_argument("--out", required=True)
    j.add_argument("--unzstd", action="store_true")
    a = ap.parse_args()
    return {"split": split, "collect": collect, "join": join}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
