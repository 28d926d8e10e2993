"""`dense_fa2` / `dense_fa3`: FlashInfer's paged prefill over each chunk's whole context (its prefix and the chunk's
own K/V, all in the pool; page ids, all heads, causal), planned once per forward pass; `dense_torch`: the torch
executor's dense pass (masked dense attention over the pool), without FlashInfer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from harness.bench_attention.common import cumsum
from harness.bench_attention.methods import Method, Skip
from sglang_compact.executors import ForwardShape, TorchExecutor

if TYPE_CHECKING:
    from harness.bench_attention.config_run import ConfigRun


def run_dense(run: ConfigRun, m: Method, row: dict):
    b, t = run.b, run.timer
    if m.backend == "torch":
        ex = TorchExecutor()
        db = run.dense_batch()
        row["begin_forward_ms"] = t.host_ms(lambda: ex.plan_forward(ForwardShape.of(db), db.page_table), reps=3)
        fn = lambda: ex.run(db, None)  # noqa: E731
        row["note"] = "torch executor, dense pass over every page (FlashInfer unavailable)"
    else:
        if not run.fi:
            raise Skip("needs FlashInfer on CUDA")
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper
        n = [-(-E // run.P) for E in b.context_lens_cpu()]
        kv_indptr = torch.tensor([0] + list(cumsum(n)), dtype=torch.int32)
        kv_indices = torch.cat([b.page_table[i, :n[i]] for i in range(b.batch_size)]).to(torch.int32)
        last = torch.tensor([E - (k - 1) * run.P for E, k in zip(b.context_lens_cpu(), n)], dtype=torch.int32)
        qo = torch.tensor([0] + list(cumsum(b.chunk_lens_cpu)), dtype=torch.int32)
        w = BatchPrefillWithPagedKVCacheWrapper(run.workspace(), "HND", backend=m.backend)

        def plan():  # what a forward pass plans once (not per layer)
            w.plan(qo, kv_indptr, kv_indices, last, run.H_q, run.H_kv, run.D, run.P, causal=True,
                   sm_scale=b.sm_scale, q_data_type=b.q.dtype, kv_data_type=b.q.dtype)

        row["begin_forward_ms"] = t.host_ms(plan, reps=3)
        fn = lambda: w.run(b.q, (b.k_pool, b.v_pool))  # noqa: E731
        row["note"] = (f"FlashInfer paged prefill ({m.backend}) over the whole context (prefix + chunk in the pool), "
                       "causal, all heads")

    out = fn()
    row["ms"] = t.device_ms(fn)
    if not run.args.no_split:
        row["attn_ms"] = row["ms"]
    row["density"] = 1.0
    run.check(row, out, table=b.full_table())
