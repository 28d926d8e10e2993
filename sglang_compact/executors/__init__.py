"""Executors: plan once per forward pass (`plan_forward`), run per layer (`run`).

`TorchExecutor` (CPU), `FlashInferFA2Executor` / `FlashInferFA3Executor` (GPU);
the FlashInfer ones are imported lazily (`make_flashinfer_executor`) so the CPU
path never imports FlashInfer.
"""

from sglang_compact.executors.base import Executor, ForwardShape, rows_from_tokens, tokens_from_rows
from sglang_compact.executors.torch_executor import TorchExecutor, reference_attention


def make_flashinfer_executor(kernel: str, device, max_rows: int, max_indices: int, dense_fa3: bool = False):
    from sglang_compact.executors.flashinfer_executor import make_flashinfer_executor as make
    return make(kernel, device, max_rows, max_indices, dense_fa3=dense_fa3)


__all__ = ["Executor", "ForwardShape", "TorchExecutor", "make_flashinfer_executor", "reference_attention",
           "rows_from_tokens", "tokens_from_rows"]
