# Source on the GPU host from the repository root (after ../shared/gpu-host/stage.sh here and carry [".gpu"]):
#   source scripts/gpu/setup.sh
# Unpacks the offline SGLang/FlashInfer bundle and installs this package (no network there).
source .gpu/env.sh
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | grep -v -i "warning" || true
python3 - <<'PY'
import torch, triton, flashinfer, sglang_compact.kernels
print(f"torch {torch.__version__} triton {triton.__version__} flashinfer {flashinfer.__version__} "
      f"gpu {torch.cuda.get_device_name()}")
PY
