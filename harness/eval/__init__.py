"""Long-context accuracy (RULER-style tasks through a server) and offline attention fidelity.

Modules: `tasks` (the seeded task generator and scorers), `fidelity` (HF q/k/v capture and chunked-prefill
replay), `hf_runner` (in-process HF generation with chunked sparse prefill), `client` (HTTP client of a running
server, with its density counters), `methods` (a method's server flags and row labels), `runs` (scored
generation of samples, through a server or HF), `rows` (accuracy.json rows from scored records), `results`
(accuracy.json -> accuracy.md / accuracy.png), `paired` (B - A on the same prompts), `cmd_accuracy` /
`cmd_fidelity` (those commands), `cli` (the command line of `scripts/eval_longctx.py`). Servers are started
with `harness.server`.
"""
