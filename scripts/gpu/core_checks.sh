# GPU checks of the core engine; log to $OUT/gpu_core.log.  Usage: bash scripts/gpu/core_checks.sh [pytest args]
set -o pipefail
source scripts/gpu/setup.sh
date -u +"%Y-%m-%dT%H:%MZ"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -m gpu tests/test_gpu_core.py -s -q -p no:cacheprovider "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_core.log"
