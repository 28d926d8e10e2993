#!/usr/bin/env bash
# Install the offline wheelhouse on the GPU host and import what it serves with (issue "Ship it").
#
# The archive (scripts/build_wheelhouse.py, ~74 MiB) is larger than one 64 MiB transfer, so it
# travels in pieces in back-to-back calls to one warm machine: every call copies the pieces it
# carries (.whl/*/part_*) into /tmp/wheelhouse, which outlives a call there. Once every piece named
# in .whl/SHA256SUMS has arrived it joins them, checks the sha256, installs with the archive's own
# install.sh into a fresh folder and imports from that folder alone (not the .gpu bundle):
#   bash scripts/gpu/wheelhouse_h200.sh          # from the repository root; logs to $OUT/wheelhouse.log
set -u
W=/tmp/wheelhouse
LOG=${OUT:-/tmp/out}/wheelhouse.log
mkdir -p "$W" "$(dirname "$LOG")"
exec > >(tee -a "$LOG") 2>&1
for p in .whl/*/part_*; do [ -f "$p" ] && cp "$p" "$W/" && echo "received $(basename "$p") ($(stat -c %s "$p") bytes)"; done
[ -f .whl/SHA256SUMS ] && cp .whl/SHA256SUMS "$W/"
if [ ! -f "$W/SHA256SUMS" ]; then echo "no .whl/SHA256SUMS carried yet"; exit 0; fi
read -r WANT NAME < "$W/SHA256SUMS"
PARTS=$(ls "$W"/part_* 2>/dev/null | sort)
TOTAL=$(cat $PARTS | wc -c)
GOT=$(cat $PARTS | sha256sum | cut -d' ' -f1)
if [ "$GOT" != "$WANT" ]; then echo "pieces so far: $TOTAL bytes, sha256 $GOT (want $WANT): waiting for more"; exit 0; fi
cat $PARTS > "$W/$NAME"
echo "joined $NAME: $TOTAL bytes, sha256 ok"
set -e
cd "$W" && rm -rf sglang-compact-wheelhouse site && tar xf "$NAME"
echo "\$ bash sglang-compact-wheelhouse/install.sh --target $W/site"
/usr/bin/time -f "install: %e s" env PYTHON=python3 bash sglang-compact-wheelhouse/install.sh --target "$W/site" -q
du -sh "$W/site"
echo "\$ PYTHONPATH=$W/site python3 (imports from the wheelhouse alone)"
cd /
PYTHONPATH="$W/site" python3 - <<'PY'
import importlib.metadata as md, os, sys, torch
import sglang, flashinfer, sgl_kernel, sglang_compact
import sglang_compact.srt.plugin, sglang_compact.launch_server  # noqa: F401  (registers the backend and flags)
from sglang.srt.server_args import ServerArgs  # noqa: F401
for mod in (sglang, flashinfer, sgl_kernel, sglang_compact):
    where = os.path.dirname(mod.__file__)
    print(f"{mod.__name__:15s} from {where}")
    assert where.startswith(os.environ["PYTHONPATH"]), f"{mod.__name__} not imported from the wheelhouse"
for dist in ("sglang", "sglang-kernel", "flashinfer-python", "xgrammar", "sglang-compact"):
    print(f"{dist:18s} {md.version(dist)}")
print(f"torch {torch.__version__} (the node's own), gpu {torch.cuda.get_device_name()}")
kdir = os.path.dirname(sgl_kernel.__file__)
print("sgl_kernel builds:", sorted(d for d in os.listdir(kdir) if d.startswith("sm")),
      "flash_ops present:", any(f.startswith("flash_ops") for f in os.listdir(kdir)))
PY
PYTHONPATH="$W/site" python3 -m sglang_compact.launch_server --help 2>&1 | grep -E "^\s+--compact-(selector|density|prefill-kernel)" | head -3
echo "wheelhouse: installed and imported on $(hostname -s 2>/dev/null || echo host)"
