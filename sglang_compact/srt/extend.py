"""Extend (prefill) passes of the compact backend: planned once per forward pass, run per layer.

`ExtendPlanner.plan` (SGLang's `init_forward_metadata`) decides, from host lengths only, which
windows read a selection (the gate), builds the batch's page table, q-blocks and windows, and plans
the executor; `ExtendPlanner.forward` (each layer's `forward_extend`) only launches device work: the KV
store (with page summaries), then, in a dense pass, one planned attention run into SGLang's output
buffer; in a sparse pass, the selection kernels and the rows' attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sglang_compact.batch import ChunkBatch, QBlocks
from sglang_compact.compact import mass_recall
from sglang_compact.executors import ForwardShape
from sglang_compact.summaries import store_kv
from sglang_compact.srt import compat
from sglang_compact.srt.prompt_notes import NOTES
from sglang_compact.srt.runtime import CompactRuntime


@dataclass
class ExtendMetadata:
    template: ChunkBatch   # lengths, q-blocks and page table of the pass; each layer swaps in its tensors
    sparse: bool           # some q-block reads a selection
    recall: tuple[int, int] | None = None   # (layer, kv head) that measures its selection's mass recall


class ExtendPlanner:
    def __init__(self, rt: CompactRuntime):
        self.rt = rt
        v = rt.view
        self._q_stub = torch.empty(0, rt.num_q_heads, v.head_dim, dtype=v.kv_dtype, device=v.device)
        self._sparse_passes = 0

    def plan(self, fb) -> ExtendMetadata:
        rt = self.rt
        P = rt.view.page_size
        prefix, chunk = compat.extend_lens(fb)
        gate = rt.gate
        prompt = NOTES.take(compat.request_ids(fb), prefix,
                            needed=[gate.uses_compact_path(L, C) for L, C in zip(prefix, chunk)])
        ranges = [gate.sparse_range(n) for n in prompt]
        qb = QBlocks.build(prefix, chunk, P, rt.window_pages, ranges)
        page_table = rt.page_table(fb.req_pool_indices, qb.max_pages)
        k0, v0 = compat.layer_kv_buffers(rt.pool, rt.view.start_layer)
        template = ChunkBatch(q=self._q_stub, k_pool=k0, v_pool=v0, page_table=page_table, prefix_lens_cpu=prefix,
                              chunk_lens_cpu=chunk, qblocks=qb, sm_scale=rt.sm_scale)
        row_pages = rt.compact.row_pages(template) if qb.any_sparse else None
        rt.executor.plan_forward(ForwardShape.of(template, row_pages), page_table)
        if rt.telemetry.wants_stats():
            rt.telemetry.begin_forward(prefix, chunk, self._paths(qb),
                                       sum(n for n, s in zip(qb.w_length, qb.w_sparse) if s))
        return ExtendMetadata(template, qb.any_sparse, self._recall_target() if qb.any_sparse else None)

    def _recall_target(self) -> tuple[int, int] | None:
        """Every `recall_every`-th sparse pass (when its stats are read): the layer and kv head that measure the
        selection's mass recall, each in turn."""
        rt, every = self.rt, self.rt.config.recall_every
        k = self._sparse_passes
        self._sparse_passes += 1
        if not every or k % every or not rt.telemetry.wants_stats():
            return None
        m = k // every
        return m % rt.view.num_layers, m % rt.view.num_kv_heads

    def _paths(self, qb: QBlocks) -> dict[str, int]:
        """q-blocks per path of their window (telemetry): sparse, or dense and why."""
        gate = self.rt.gate
        counts = dict.fromkeys(("sparse", "dense_context", "dense_tail", "dense"), 0)
        context_lo = None if gate.decision.never else gate.decision.min_context
        for w in qb.window:
            if qb.w_sparse[w]:
                path = "sparse"
            elif context_lo is None:
                path = "dense"
            else:
                path = "dense_context" if qb.w_first[w] * qb.page_size < context_lo else "dense_tail"
            counts[path] += 1
        return counts

    def forward(self, md: ExtendMetadata, q, k, v, layer, fb, save_kv_cache: bool) -> torch.Tensor:
        rt = self.rt
        H_q, D, H_kv = rt.num_q_heads, rt.view.head_dim, rt.view.num_kv_heads
        lid = compat.layer_id(layer)
        li = lid - rt.view.start_layer
        k_buf, v_buf = compat.layer_kv_buffers(rt.pool, lid)
        q3 = q.view(-1, H_q, D)
        summaries = rt.summaries.layer(li) if rt.summaries is not None else None
        if save_kv_cache:
            store_kv(k_buf, v_buf, compat.cache_locations(fb), k.view(-1, H_kv, D), v.view(-1, H_kv, D), summaries)
        elif md.sparse:
            raise RuntimeError("sglang_compact: a sparse pass reads the chunk's keys from the pool, but this layer "
                               "was asked not to store them (save_kv_cache=False)")
        # with save_kv_cache=False the caller has stored the chunk's K/V (SGLang's contract): both paths read the pool
        if q3.dtype != k_buf.dtype:
            q3 = q3.to(k_buf.dtype)
        if not md.sparse:
            out = compat.take_attention_output(fb, q3) if q3.dtype == q.dtype else None
            o = rt.executor.run_dense(q3, k_buf, v_buf, out=out)
        else:
            batch = dataclasses.replace(md.template, q=q3, k_pool=k_buf, v_pool=v_buf,
                                        sm_scale=compat.layer_scaling(layer))
            sel = rt.compact.select_pages(batch, li, summaries, buffers=rt.executor.index_buffers,
                                          with_stats=rt.telemetry.wants_stats())
            rt.telemetry.record(li, sel.density, sel.coverage)
            if md.recall is not None and md.recall[0] == li:
                rt.telemetry.record_recall(mass_recall(batch, sel.table, md.recall[1]))
            o = rt.executor.run(batch, sel.indices)
        if o.dtype != q.dtype:
            o = o.to(q.dtype)
        return o.view(-1, H_q * D)
