"""One configuration of the benchmark: its inputs, the kernels several methods share (the chunk's causal part over
`k_chunk` / `v_chunk`, the merge), the accuracy check, and the per-forward-pass state of the compact methods; `run`
runs one method."""

from __future__ import annotations

from typing import Any

import torch

from harness.bench_attention.common import cumsum, rel_err, torch_chunk_attention, torch_merge
from harness.bench_attention.inputs import fill_summaries
from harness.bench_attention.methods import HAVE_FI, Method, Skip
from harness.bench_attention.run_bsparse import run_bsparse
from harness.bench_attention.run_compact import run_compact
from harness.bench_attention.run_dense import run_dense
from harness.bench_attention.run_quoka import run_quoka
from harness.bench_attention.timing import Timer
from sglang_compact.batch import ChunkBatch
from sglang_compact.compact import CompactAttention
from sglang_compact.executors import ForwardShape, TorchExecutor, make_flashinfer_executor, reference_attention
from sglang_compact.indices import index_bound


class ConfigRun:
    """Everything for one configuration: inputs, shared chunk/merge kernels, and the method runners."""

    def __init__(self, args, batch: ChunkBatch, timer: Timer):
        self.args, self.b, self.timer = args, batch, timer
        self.dev = batch.q.device
        self.fi = HAVE_FI and self.dev.type == "cuda"
        self.P, self.H_kv, self.H_q, self.D = batch.page_size, batch.num_kv_heads, batch.num_q_heads, batch.head_dim
        self.G = self.H_q // self.H_kv
        self.NKV = batch.qblocks.max_pages
        self.window = batch.qblocks.window_pages * self.P   # union window (tokens) of the batch
        self.index_bound = index_bound(batch)
        self.summaries = fill_summaries(batch)
        self.searches: dict[str, tuple] = {}
        self.executors: dict[Any, Any] = {}
        self.check_ok = args.check and self.H_q * max(batch.chunk_lens_cpu) * max(batch.context_lens_cpu()) <= \
            args.check_max_elems
        self._setup_shared_chunk()

    # --- shared pieces ---------------------------------------------------------------------
    def workspace(self):
        return torch.empty(256 << 20, dtype=torch.uint8, device=self.dev)

    def _setup_shared_chunk(self):
        """Each chunk against itself only, causally (ragged over k_chunk / v_chunk), and the merge of two attention
        states: the parts of the methods that attend to a selection of the prefix and densely to the chunk
        (quoka), measured once per configuration."""
        b = self.b
        if self.fi:
            import flashinfer
            self.chunk_wrapper = self.ragged_causal("fa2")
            self.chunk_fn = lambda: self.chunk_wrapper.run(b.q, b.k_chunk, b.v_chunk, return_lse=True)
            self.merge_fn = lambda oa, la, ob, lb: flashinfer.merge_state(oa, la, ob, lb)[0]
        else:
            self.chunk_fn = lambda: torch_chunk_attention(b)
            self.merge_fn = lambda oa, la, ob, lb: torch_merge(oa, la, ob, lb).to(b.q.dtype)
        o_c, lse_c = self.chunk_fn()
        self.o_c, self.lse_c = o_c, lse_c
        self.chunk_ms = self.timer.device_ms(self.chunk_fn)
        o_p = torch.randn_like(o_c)
        lse_p = torch.randn_like(lse_c)
        self.merge_ms = self.timer.device_ms(lambda: self.merge_fn(o_p, lse_p, o_c, lse_c))

    def ragged_causal(self, backend):
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper
        b = self.b
        cu = torch.tensor([0] + list(cumsum(b.chunk_lens_cpu)), dtype=torch.int32)
        w = BatchPrefillWithRaggedKVCacheWrapper(self.workspace(), "NHD", backend=backend)
        w.plan(cu, cu, self.H_q, self.H_kv, self.D, causal=True, sm_scale=b.sm_scale, q_data_type=b.q.dtype,
               kv_data_type=b.q.dtype)
        return w

    def check(self, row: dict, out: torch.Tensor, table: torch.Tensor | None = None, ref: Any = None):
        """rel_err of `out` against `reference_attention(batch, table)` (or `ref()`, a reference of its own)."""
        if not self.check_ok:
            return
        want = reference_attention(self.b, table) if ref is None else ref()
        row["rel_err"] = rel_err(out, want)
        if not (row["rel_err"] <= self.args.check_tol):
            row["status"] = "error"
            row["note"] = (row.get("note", "") + f" CHECK FAILED: rel_err {row['rel_err']:.3e} > {self.args.check_tol}").strip()

    def dense_batch(self) -> ChunkBatch:
        """The batch with no sparse window (a dense forward pass)."""
        b = self.b
        return ChunkBatch.build(b.q, b.k_pool, b.v_pool, b.page_table, b.prefix_lens_cpu, b.chunk_lens_cpu,
                                b.sm_scale, sparse_ranges=[(0, 0)] * b.batch_size, k_chunk=b.k_chunk,
                                v_chunk=b.v_chunk, window_pages=b.qblocks.window_pages)

    # --- per-forward-pass state of the compact methods ------------------------------------------
    def executor(self, backend: str, row_pages: list[int] | None = None):
        """(executor, plan_forward host ms) planned for this configuration's forward pass; fa3 with `row_pages`
        (selectors that fix the row lengths) is planned once with those lengths, without them per layer."""
        key = (backend, None if row_pages is None else tuple(row_pages))
        if key in self.executors:
            return self.executors[key]
        b = self.b
        if not self.fi:
            if backend == "fa3":
                raise Skip("needs FlashInfer on CUDA")
            ex = TorchExecutor()
        else:
            ex = make_flashinfer_executor(backend, self.dev, max_rows=b.num_rows, max_indices=self.index_bound)
        shape = ForwardShape.of(b, row_pages)
        bf_ms = self.timer.host_ms(lambda: ex.plan_forward(shape, b.page_table), reps=3)
        self.executors[key] = (ex, bf_ms)
        return ex, bf_ms

    def search(self, m: Method, ca: CompactAttention, retime: bool = False):
        """(Selection, search_ms) of the method's selector; cached per selector configuration. `retime`
        measures search_ms again (every compact row times its own search: a figure timed once and
        shared between rows was seen off by 0.5 ms on the H200)."""
        key = f"{m.selector}:{ca.config.params!r}"
        if key not in self.searches or retime:
            fn = lambda: ca.selector.select(self.b, 0, self.summaries)  # noqa: E731
            sel = fn()
            self.searches[key] = (sel, self.timer.device_ms(fn))
        return self.searches[key]

    def run(self, m: Method, row: dict):
        {"dense": run_dense, "compact": run_compact, "bsparse": run_bsparse, "quoka": run_quoka}[m.kind](self, m, row)
