"""Extend (prefill) passes of the compact backend: planned once per forward pass, run per layer.

`ExtendPlanner.plan` (SGLang's `init_forward_metadata`) decides, from host lengths only, which
windows read a selection (the gate), builds the batch's page table, q-blocks and windows, and plans
the executor; `ExtendPlanner.forward` (each layer's `forward_extend`) only launches device work: the KV
store (with page summaries), then, in a dense pass, one planned attention run into SGLang's output
buffer; in a sparse pass, the selection kernels and the rows' attention (a layer of the config's
`dense_layers`: the rows of every page, `CompactAttention.read_all`, under the same plan).

The one exception: a sparse pass whose row lengths depend on the scores reads, once, at its observing
layer, how many pages each row selected (one device->host copy per pass), for
* the gate's observed-density fallback (`Gate.dense_windows`): windows that read more than `dense_above`
  turn dense for the whole pass (a pass left with no sparse window becomes a dense pass);
* a selector that fixes its rows there (`flashprefill` with `fix_rows`): every later layer
  fills each row to that count (`Selector.fill`), so the rows' lengths are known and fa3 is planned once;
and the executor is planned again for what changed. The observing layer is the pass's second: the first
reads every page (its attention is broad, its density says little of the other layers'). Selectors that
fix row lengths from the lengths alone are decided at `plan`, with no copy, and every layer selects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import logging

import torch

from sglang_compact.batch import ChunkBatch, QBlocks
from sglang_compact.compact import mass_recall
from sglang_compact.config import OBSERVING_LAYER
from sglang_compact.executors import ForwardShape
from sglang_compact.summaries import store_kv
from sglang_compact.srt import compat
from sglang_compact.srt.prompt_notes import NOTES
from sglang_compact.srt.runtime import CompactRuntime


logger = logging.getLogger(__name__)


@dataclass
class ExtendMetadata:
    template: ChunkBatch   # lengths, q-blocks and page table of the pass; each layer swaps in its tensors
    sparse: bool           # some q-block reads a selection
    recall: tuple[int, int] | None = None   # (layer, kv head) that measures its selection's mass recall
    observe: bool = False  # the next sparse layer reads the rows' page counts (density fallback, fixed rows)
    fill: torch.Tensor | None = None   # rows fixed at the observing layer: pages per row (device int32)
    first_read_all: int = 0  # layers that read every page before the observing one
    executor_dense: bool = False   # the executor is planned for the dense first layer (until the observing one)


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
        gated = qb
        row_pages = rt.compact.row_pages(template) if qb.any_sparse else None
        if row_pages is not None and gate.observes_density:   # lengths known on the host: decided here
            dense = gate.dense_windows(qb, qb.window_density(row_pages, template.num_kv_heads))
            if dense:
                template = self._with_dense(template, dense, prefix, chunk)
                qb = template.qblocks
                row_pages = rt.compact.row_pages(template) if qb.any_sparse else None
        observe = qb.any_sparse and row_pages is None and (gate.observes_density or self._fixes_rows)
        first_read_all = OBSERVING_LAYER if observe and rt.view.num_layers > OBSERVING_LAYER else 0
        shape_of = dataclasses.replace(template, qblocks=qb.with_dense(range(qb.windows)), derived={}) \
            if first_read_all else template
        rt.executor.plan_forward(ForwardShape.of(shape_of, None if first_read_all else row_pages), page_table)
        if rt.telemetry.wants_stats():
            rt.telemetry.begin_forward(prefix, chunk, *self._pass_paths(qb, gated),
                                       context_pages=sum(a + 1 for a in qb.w_last))
        return ExtendMetadata(template, qb.any_sparse, self._recall_target() if qb.any_sparse else None, observe,
                              first_read_all=first_read_all, executor_dense=bool(first_read_all))

    @property
    def _fixes_rows(self) -> bool:
        cfg = self.rt.config
        return cfg.spec.fixes_rows_at_observing_layer(cfg.params)

    def _pass_paths(self, qb: QBlocks, gated: QBlocks) -> tuple[dict[str, int], int, tuple[int, int]]:
        """The pass's telemetry, as `CompactTelemetry.begin_forward` / `update_paths` take it: q-blocks per path,
        tokens of sparse q-blocks, and (context pages of the sparse windows, of those that turned dense by their
        observed density: the pass's density counts the latter as reading every page). `gated`: the q-blocks as
        the gate made them."""
        sparse_tokens = sum(n for n, s in zip(qb.w_length, qb.w_sparse) if s)
        sparse = sum(a + 1 for a, s in zip(qb.w_last, qb.w_sparse) if s)
        turned = sum(a + 1 for a, s, g in zip(qb.w_last, qb.w_sparse, gated.w_sparse) if g and not s)
        return self._paths(qb, gated), sparse_tokens, (sparse, turned)

    def _with_dense(self, template: ChunkBatch, windows: list[int], prefix, chunk) -> ChunkBatch:
        qb = template.qblocks
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("compact pass prefix=%s chunk=%s: windows %s (request, first token) read more than %.3f "
                         "of their pages: dense", prefix, chunk, [(qb.w_req[w], qb.w_first[w] * qb.page_size)
                                                                  for w in windows], self.rt.gate.dense_above)
        return dataclasses.replace(template, qblocks=qb.with_dense(windows), derived={})

    def _observe(self, md: ExtendMetadata, sel, executor_dense: bool) -> bool:
        """At a sparse pass's observing layer, from the rows' page counts (one device->host copy): windows whose
        rows read more than the gate's dense_above turn dense, and a selector that fixes its rows there has them
        fixed for the pass; the executor is planned again for what changed (`executor_dense`: it was planned
        for the dense first layer). True when the windows changed (the layer selects again)."""
        rt = self.rt
        md.observe = False
        if rt.is_cuda and torch.cuda.is_current_stream_capturing():
            return False   # (a dense-planned executor then runs every layer dense: `run` follows its plan)
        t = md.template
        qb, H_kv = t.qblocks, t.num_kv_heads
        counts = sel.counts.tolist()
        dense = rt.gate.dense_windows(qb, qb.window_density(counts, H_kv)) if rt.gate.observes_density else []
        if dense:
            md.template = self._with_dense(t, dense, t.prefix_lens_cpu, t.chunk_lens_cpu)
            new = md.template.qblocks
            md.sparse = new.any_sparse
            if not md.sparse:
                md.recall = None
            if rt.telemetry.wants_stats():
                rt.telemetry.update_paths(*self._pass_paths(new, qb))
        row_pages = None
        if md.sparse and self._fixes_rows:
            new = md.template.qblocks
            NW, full = new.windows, new.full_counts()
            row_pages = [c if new.w_sparse[r % NW] else full[r % NW] for r, c in enumerate(counts)]
            md.fill = torch.tensor(row_pages, dtype=torch.int32).to(rt.device, non_blocking=True)
        replan = executor_dense or bool(dense) or row_pages is not None if md.sparse else not executor_dense
        if replan:
            rt.executor.plan_forward(ForwardShape.of(md.template, row_pages), t.page_table)
        return bool(dense)

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

    def _paths(self, qb: QBlocks, gated: QBlocks) -> dict[str, int]:
        """q-blocks per path of their window (telemetry): sparse, or dense and why (`gated`: the q-blocks as
        the gate made them, before windows turned dense from their observed density)."""
        gate = self.rt.gate
        counts = dict.fromkeys(("sparse", "dense_context", "dense_tail", "dense", "dense_density"), 0)
        context_lo = None if gate.decision.never else gate.decision.min_context
        for w in qb.window:
            if qb.w_sparse[w]:
                path = "sparse"
            elif gated.w_sparse[w]:
                path = "dense_density"
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
            store_kv(k_buf, v_buf, compat.cache_locations(fb), k.view(-1, H_kv, D), v.view(-1, H_kv, D), summaries,
                     runs=len(md.template.chunk_lens_cpu))   # the requests' new tokens, one run each
        elif md.sparse:
            raise RuntimeError("sglang_compact: a sparse pass reads the chunk's keys from the pool, but this layer "
                               "was asked not to store them (save_kv_cache=False)")
        # with save_kv_cache=False the caller has stored the chunk's K/V (SGLang's contract): both paths read the pool
        if q3.dtype != k_buf.dtype:
            q3 = q3.to(k_buf.dtype)
        sel = None
        if md.sparse and md.first_read_all:
            md.first_read_all -= 1
            rt.telemetry.record_read_all(li)
        elif md.sparse and lid in rt.config.dense_layers:
            batch = self._layer_batch(md, q3, k_buf, v_buf, layer)
            sel = batch, rt.compact.read_all(batch, buffers=rt.executor.index_buffers,
                                             with_stats=rt.telemetry.wants_stats())
        elif md.sparse:
            sel = self._select(md, q3, k_buf, v_buf, layer, lid, summaries)
            if md.observe and self._observe(md, sel[1], md.executor_dense):
                sel = self._select(md, q3, k_buf, v_buf, layer, lid, summaries) if md.sparse else None
        # both paths write into SGLang's output buffer where it fits, so SGLang copies nothing after the call
        out = compat.take_attention_output(fb, q3) if q3.dtype == q.dtype else None
        if sel is None:
            chunk_kv = (k.view(-1, H_kv, D), v.view(-1, H_kv, D)) if k is not None and v is not None else None
            o = rt.executor.run_dense(q3, k_buf, v_buf, out=out, chunk_kv=chunk_kv)
        else:
            batch, sel = sel
            rt.telemetry.record(li, sel.density, sel.coverage)
            if md.recall is not None and md.recall[0] == li:
                rt.telemetry.record_recall(mass_recall(batch, sel.table, md.recall[1]))
            o = rt.executor.run(batch, sel.indices, out=out)
        if o.dtype != q.dtype:
            o = o.to(q.dtype)
        return o.view(-1, H_q * D)

    @staticmethod
    def _layer_batch(md: ExtendMetadata, q3, k_buf, v_buf, layer) -> ChunkBatch:
        return dataclasses.replace(md.template, q=q3, k_pool=k_buf, v_pool=v_buf, sm_scale=compat.layer_scaling(layer))

    def _select(self, md: ExtendMetadata, q3, k_buf, v_buf, layer, lid: int, summaries):
        """(this layer's batch, its page selection) in a sparse pass; `lid` the model's layer id."""
        rt = self.rt
        batch = self._layer_batch(md, q3, k_buf, v_buf, layer)
        return batch, rt.compact.select_pages(batch, lid, summaries, buffers=rt.executor.index_buffers,
                                              with_stats=rt.telemetry.wants_stats(), fill=md.fill)
