"""The attention benchmark of `scripts/bench_attention.py` (one layer, one prefill chunk against its cached prefix:
CompactAttention vs baselines); see `cli` for what it measures and writes.

Modules: `inputs` (structured synthetic batches), `timing` (CUDA-event / host timer), `methods` (the method list),
`config_run` (one configuration's inputs and shared kernels), `run_dense` / `run_compact` / `run_bsparse` /
`run_quoka` (one method each), `common` (shared helpers), `report` (rows -> speed.json, Markdown, PNG, tables),
`cli` (the command line).
"""

import os

import torch

if not torch.cuda.is_available():  # Triton kernels (not used on the CPU paths) would need the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
