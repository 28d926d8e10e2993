"""Decode passes of the compact backend: every page of every request.

GPU: FlashInfer's decode kernel over the head-major pool with page ids (tensor cores), planned once
per forward pass, eagerly or into SGLang's decode CUDA-graph buffers. CPU: the torch executor's
dense attention. The new token's K/V (and its page's summary) are stored first, as in extend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.batch import ChunkBatch, QBlocks, cdiv, host_cumsum
from sglang_compact.executors import flashinfer_adapter as fi
from sglang_compact.executors.torch_executor import causal_context_attention
from sglang_compact.summaries import store_kv
from sglang_compact.srt import compat
from sglang_compact.srt.runtime import CompactRuntime

DECODE_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class DecodeMetadata:
    wrapper: object | None        # GPU: the planned FlashInfer decode wrapper
    template: ChunkBatch | None   # CPU: the batch (one query per request)


class DecodePlanner:
    def __init__(self, rt: CompactRuntime):
        self.rt = rt
        if rt.is_cuda:
            self.workspace = torch.empty(DECODE_WORKSPACE_BYTES, dtype=torch.uint8, device=rt.device)
            self.eager_wrapper = None
            self.graph_wrappers: dict[int, object] = {}
            self.graph_buffers = None

    def plan(self, fb) -> DecodeMetadata:
        rt = self.rt
        bs = fb.batch_size
        seq_lens = compat.host_seq_lens(fb, bs)
        if rt.is_cuda:
            if self.eager_wrapper is None:
                self.eager_wrapper = fi.decode_wrapper(self.workspace)
            self._plan(self.eager_wrapper, fb.req_pool_indices[:bs], seq_lens)
            return DecodeMetadata(self.eager_wrapper, None)
        P = rt.view.page_size
        prefix, chunk = [n - 1 for n in seq_lens], [1] * bs
        qb = QBlocks.build(prefix, chunk, P, sparse_ranges=[(0, 0)] * bs)
        page_table = rt.page_table(fb.req_pool_indices[:bs], qb.max_pages)
        k0, v0 = compat.layer_kv_buffers(rt.pool, rt.view.start_layer)
        q = torch.empty(0, rt.num_q_heads, rt.view.head_dim, dtype=rt.view.kv_dtype)
        return DecodeMetadata(None, ChunkBatch(q=q, k_pool=k0, v_pool=v0, page_table=page_table, prefix_lens_cpu=prefix,
                                               chunk_lens_cpu=chunk, qblocks=qb, sm_scale=rt.sm_scale))

    def _plan(self, wrapper, req_pool_indices: torch.Tensor, seq_lens: list[int]) -> None:
        """Plan over every page of every request: host indptr / last-page lengths, device page ids (no sync)."""
        rt = self.rt
        P, dev = rt.view.page_size, rt.device
        n = [cdiv(L, P) for L in seq_lens]
        indptr = host_cumsum(n)
        total = indptr[-1]
        counts = torch.tensor(n, dtype=torch.long).to(dev, non_blocking=True)
        starts = torch.tensor(indptr[:-1], dtype=torch.long).to(dev, non_blocking=True)
        req = torch.repeat_interleave(torch.arange(len(n), device=dev), counts, output_size=total)
        page_pos = torch.arange(total, device=dev) - starts[req]
        slots = rt.req_to_token[req_pool_indices.long()[req], page_pos * P]
        indices = torch.div(slots, P, rounding_mode="floor").to(torch.int32)
        last = [L - (k - 1) * P for L, k in zip(seq_lens, n)]
        fi.plan(wrapper, torch.tensor(indptr, dtype=torch.int32), indices, torch.tensor(last, dtype=torch.int32),
                rt.num_q_heads, rt.view.num_kv_heads, rt.view.head_dim, P, q_data_type=rt.view.kv_dtype,
                kv_data_type=rt.view.kv_dtype, sm_scale=rt.sm_scale)

    # --- decode CUDA graphs ---------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        dev = self.rt.device
        self.graph_buffers = dict(
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            indices=torch.zeros(max_bs * self.rt.max_pages_per_req, dtype=torch.int32, device=dev),
            last=torch.zeros(max_bs, dtype=torch.int32, device=dev),
        )

    def plan_for_graph(self, fb) -> DecodeMetadata:
        bs = fb.batch_size
        w = self.graph_wrappers.get(bs)
        if w is None:
            g = self.graph_buffers
            w = fi.decode_wrapper(self.workspace, use_cuda_graph=True, paged_kv_indptr_buffer=g["indptr"][:bs + 1],
                                  paged_kv_indices_buffer=g["indices"], paged_kv_last_page_len_buffer=g["last"][:bs])
            self.graph_wrappers[bs] = w
        self._plan(w, fb.req_pool_indices[:bs], compat.host_seq_lens(fb, bs))
        return DecodeMetadata(w, None)

    # --- per layer ----------------------------------------------------------------------------------
    def forward(self, md: DecodeMetadata, q, k, v, layer, fb, save_kv_cache: bool) -> torch.Tensor:
        rt = self.rt
        H_q, D, H_kv = rt.num_q_heads, rt.view.head_dim, rt.view.num_kv_heads
        lid = compat.layer_id(layer)
        k_buf, v_buf = compat.layer_kv_buffers(rt.pool, lid)
        if save_kv_cache:
            summaries = rt.summaries.layer(lid - rt.view.start_layer) if rt.summaries is not None else None
            loc = compat.cache_locations(fb)   # a decode step's tokens each end a page: a run each
            store_kv(k_buf, v_buf, loc, k.view(-1, H_kv, D), v.view(-1, H_kv, D), summaries, runs=loc.numel())
        q3 = q.reshape(-1, H_q, D).to(k_buf.dtype)
        if md.wrapper is not None:
            o = md.wrapper.run(q3, (k_buf, v_buf))
        else:
            batch = ChunkBatch(q=q3, k_pool=k_buf, v_pool=v_buf, page_table=md.template.page_table,
                               prefix_lens_cpu=md.template.prefix_lens_cpu, chunk_lens_cpu=md.template.chunk_lens_cpu,
                               qblocks=md.template.qblocks, sm_scale=compat.layer_scaling(layer))
            o = causal_context_attention(batch)
        return o.to(q.dtype).reshape(-1, H_q * D)
