"""The evaluation and benchmark harness of this repository (not part of the `sglang-compact` wheel).

Used from the repository root: `scripts/*.py` and `scripts/gpu/*.py` put the root on `sys.path`, and the
tests run from it. Modules: `eval` (long-context accuracy and fidelity), `bench_attention` (the attention
benchmark of `scripts/bench_attention.py`), `server` (starts real SGLang servers), `quoka` (a token-level
baseline), `synthetic` (random chunk batches for tests and benchmarks).

The harness writes only to the paths it is given: the default paths of the command lines live in their
entry points under `scripts/`.
"""
