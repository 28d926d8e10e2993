"""Triton kernels of sglang-compact, each beside its plain-torch twin (`*_naive.py`).

The one dispatch rule: a Triton kernel runs on CUDA tensors, its torch twin
everywhere else (the CPU server, the reference in tests). Tests run the
kernels on the CPU under `TRITON_INTERPRET=1` by calling them directly.
"""

from __future__ import annotations

import torch


def use_triton(x: torch.Tensor, override: bool | None = None) -> bool:
    """Whether to run the Triton kernel for inputs living where `x` lives (`override` wins when given)."""
    return x.is_cuda if override is None else bool(override)
