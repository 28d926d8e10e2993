"""Long-context accuracy (RULER-style tasks through a server) and offline attention fidelity.

Modules: `tasks` (the seeded task generator and scorers), `fidelity` (HF q/k/v
capture and chunked-prefill replay), `server` (CPU SGLang launcher), `results`
(accuracy.json -> accuracy.md / accuracy.png), `cli` (the command line,
also `scripts/eval_longctx.py`).
"""
