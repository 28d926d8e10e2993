# Source on the GPU host from the repository root (after ../shared/gpu-host/stage.sh here and carry [".gpu"]):
#   source scripts/gpu/setup.sh
# Unpacks the offline SGLang/FlashInfer bundle and installs this package (no network there).
# The bundle unpacks into /tmp, which outlives a call on a warm machine: a later call there may leave
# .gpu behind (to carry something else in its 64 MiB) and this falls back to /tmp/gpu-env.sh.
if [ -f .gpu/env.sh ]; then
  cp .gpu/env.sh /tmp/gpu-env.sh
  source .gpu/env.sh
elif [ -f /tmp/gpu-env.sh ] && [ -f /tmp/site/.complete ]; then
  source /tmp/gpu-env.sh
else
  echo "scripts/gpu/setup.sh: no .gpu bundle here (carry .gpu) and none unpacked in /tmp" >&2
  return 1 2>/dev/null || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | grep -v -i "warning" || true
python3 - <<'PY'
import torch, triton, flashinfer, sglang_compact.kernels
print(f"torch {torch.__version__} triton {triton.__version__} flashinfer {flashinfer.__version__} "
      f"gpu {torch.cuda.get_device_name()}")
PY
