"""SGLang attention backend `compact`: CompactAttention for chunked prefill.

EXTEND with a cached prefix of at least `min_prefix_len` tokens takes the
compact path (search -> union -> plan -> zero-copy paged execution); other
extends and mixed-in single-token rows read every prefix page (the same
executor with a full table); DECODE reads every page with FlashInfer's decode
kernel over the head-major pool (GPU, with SGLang's decode CUDA graphs) or
with the torch executor (CPU).

The KV pool must be SGLang's head-major layout `[num_pages, H_kv, P, D]`
(`SGLANG_USE_HND_KVCACHE=1`, set by `sglang_compact.launch_server`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from sglang_compact.batch import ChunkBatch, cdiv
from sglang_compact.compact import CompactAttention
from sglang_compact.config import CompactConfig
from sglang_compact.execute import TorchPagedExecutor, causal_chunk_attention
from sglang_compact.plan import build_plan
from sglang_compact.summaries import PageSummaries
from sglang_compact.srt.plugin import FORWARD_BATCH_INIT
from sglang_compact.srt.telemetry import CompactTelemetry, metrics_for_runner

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FLASHINFER_HEAD_DIMS = (64, 128, 256)


class UnsupportedModelError(ValueError):
    """The model cannot be served by the compact backend (raised at start)."""


def config_for_runner(model_runner: "ModelRunner") -> CompactConfig:
    """The launcher's validated config (attached to server_args), or the defaults for this page size."""
    page_size = model_runner.page_size
    cfg = getattr(model_runner.server_args, "_compact_config", None)
    if cfg is None:
        try:
            cfg = CompactConfig(block_size=page_size)
        except ValueError as e:
            raise UnsupportedModelError(f"attention backend 'compact' needs --page-size to be a power of two in "
                                        f"[16, 256]: {e}") from None
    if cfg.block_size != page_size:
        raise UnsupportedModelError(f"--compact-block-size {cfg.block_size} differs from --page-size {page_size}; "
                                    "a compact block is one KV page")
    return cfg


def check_model_supported(model_runner: "ModelRunner", head_dim: int) -> None:
    if getattr(model_runner, "use_mla_backend", False):
        raise UnsupportedModelError("attention backend 'compact' does not support MLA models "
                                    "(use --attention-backend flashinfer or an MLA backend)")
    pool = model_runner.token_to_kv_pool
    if not getattr(pool, "use_hnd", False):
        raise UnsupportedModelError("attention backend 'compact' needs the head-major KV pool: start the server "
                                    "with `python -m sglang_compact.launch_server` (it sets SGLANG_USE_HND_KVCACHE=1)")
    if getattr(pool, "is_quantized_kv_cache", False) or pool.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UnsupportedModelError(f"attention backend 'compact' supports bf16/fp16/fp32 KV caches, not {pool.dtype}")
    if model_runner.device == "cuda" and head_dim not in FLASHINFER_HEAD_DIMS:
        raise UnsupportedModelError(f"attention backend 'compact' supports head_dim {FLASHINFER_HEAD_DIMS} on CUDA "
                                    f"(FlashInfer), the model has {head_dim}")


def resolve_prefill_kernel(config: CompactConfig, compact: CompactAttention, device: torch.device,
                           dtype: torch.dtype) -> str:
    """The FlashInfer backend ("fa2" / "fa3") of the paged prefix attention for `config.prefill_kernel`."""
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    fixed_rows = compact.selector.row_blocks([1]) is not None
    if config.prefill_kernel == "auto":
        return "fa3" if hopper and fixed_rows and config.selector != "dense" and dtype != torch.float32 else "fa2"
    if config.prefill_kernel == "fa3":
        if not hopper:
            raise UnsupportedModelError("--compact-prefill-kernel fa3 needs a Hopper (sm90) GPU")
        if dtype == torch.float32:
            raise UnsupportedModelError("--compact-prefill-kernel fa3 needs a bf16 or fp16 KV cache")
        if not fixed_rows:
            logger.warning("compact: prefill kernel fa3 with selector %r plans every layer from host copies of the "
                           "row lengths (a device->host sync per layer); fa2 plans once per forward pass",
                           config.selector)
    return config.prefill_kernel


def check_attention_layers(model: torch.nn.Module, num_kv_heads: int, head_dim: int) -> tuple[int, float]:
    """Refuse models whose attention layers the compact path cannot compute exactly.

    Returns (query heads per rank, softmax scale), equal across the layers.
    """
    from sglang.srt.layers.radix_attention import RadixAttention
    layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
    if not layers:
        raise UnsupportedModelError("attention backend 'compact' found no attention layers in the model")
    for layer in layers:
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            raise UnsupportedModelError("attention backend 'compact' supports decoder self-attention only")
        if (layer.logit_cap or 0) > 0:
            raise UnsupportedModelError("attention backend 'compact' does not support attention logit soft-capping")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise UnsupportedModelError("attention backend 'compact' does not support sliding-window attention layers")
        if layer.qk_head_dim != head_dim or layer.v_head_dim != head_dim or layer.tp_k_head_num != num_kv_heads:
            raise UnsupportedModelError(f"attention backend 'compact' needs every layer to match the KV pool "
                                        f"({num_kv_heads} kv heads x {head_dim}); layer {layer.layer_id} differs")
    shapes = {(layer.tp_q_head_num, float(layer.scaling)) for layer in layers}
    if len(shapes) != 1:
        raise UnsupportedModelError(f"attention backend 'compact' needs one query-head count and scale, got {shapes}")
    (h_q, scale), = shapes
    if h_q % num_kv_heads:
        raise UnsupportedModelError(f"{h_q} query heads per rank is not a multiple of {num_kv_heads} kv heads")
    return h_q, scale


@dataclasses.dataclass
class ExtendMetadata:
    template: ChunkBatch | None          # batch whose per-layer tensors each layer replaces
    compact_rows: torch.Tensor | None    # bool [B]
    any_compact: bool
    any_prefix: bool
    any_dense_final: bool = False        # a final prompt chunk read its whole prefix by `dense_final_chunk`


@dataclasses.dataclass
class DecodeMetadata:
    plan: object | None                  # PagedPlan (CPU) or None (GPU wrapper holds it)
    template: ChunkBatch | None
    wrapper: object | None


class CompactAttnBackend(AttentionBackend):
    def __init__(self, model_runner: "ModelRunner"):
        super().__init__()
        self.config = config_for_runner(model_runner)
        pool = model_runner.token_to_kv_pool
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = model_runner.page_size
        self.device = torch.device(model_runner.device)
        self.num_kv_heads = pool.head_num
        self.head_dim = pool.head_dim
        check_model_supported(model_runner, self.head_dim)
        self.num_q_heads, self.sm_scale = check_attention_layers(model_runner.model, self.num_kv_heads, self.head_dim)
        self.num_layers = pool.layer_num
        self.start_layer = getattr(pool, "start_layer", 0) or 0
        self.max_context_len = model_runner.model_config.context_len
        self.max_pages_per_req = cdiv(self.max_context_len + self.page_size, self.page_size)
        self.is_cuda = self.device.type == "cuda"
        self.compact = CompactAttention(self.config, executor=TorchPagedExecutor())
        self.summaries = None
        if self.compact.selector.uses_summaries:
            self.summaries = PageSummaries(self.num_layers, pool.num_pages, self.num_kv_heads, self.head_dim,
                                           self.page_size, self.device)
        self.telemetry = CompactTelemetry(self.num_layers, metrics_for_runner(model_runner, self.num_layers),
                                          coverage_needed=self.config.density_cap is not None)
        self.compact.select = self.telemetry.wrap_select(self.compact.select)  # identity unless coverage is measured
        self.forward_metadata = None
        self._final_chunk_notes: dict[tuple[str, int], bool] = {}
        self._warned_no_final_flags = False
        if self.is_cuda:
            self._init_cuda(model_runner)
        logger.info("compact attention: %s, page size %d, %d kv heads x %d, summaries %s, prefill kernel %s",
                    self.config, self.page_size, self.num_kv_heads, self.head_dim,
                    "on" if self.summaries is not None else "off",
                    self.executor.backend if self.is_cuda else "torch")

    # --- CUDA resources -----------------------------------------------------------------
    def _init_cuda(self, model_runner):
        from sglang_compact.execute_flashinfer import FlashInferExecutor
        max_reqs = model_runner.req_to_token_pool.size
        max_rows = max_reqs * self.num_kv_heads
        max_indices = min(self.pool.num_pages * max_reqs, self.max_pages_per_req * max_reqs) * self.num_kv_heads
        kernel = resolve_prefill_kernel(self.config, self.compact, self.device, self.pool.dtype)
        self.executor = FlashInferExecutor(self.device, max_rows=max_rows, max_indices=max_indices, backend=kernel)
        self.compact.executor = self.executor
        self.decode_workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=self.device)
        self.decode_wrapper = None
        self.graph_wrappers: dict[int, object] = {}
        self.graph_buffers = None

    def _decode_wrapper_eager(self):
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper
        if self.decode_wrapper is None:
            self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self.decode_workspace, "HND",
                                                                     use_tensor_cores=True)
        return self.decode_wrapper

    # --- metadata -------------------------------------------------------------------------
    def _page_table(self, req_pool_indices: torch.Tensor, n_pages: int) -> torch.Tensor:
        """int32 [B, n_pages]: page ids of each request's first n_pages pages (garbage past its own)."""
        pos = torch.arange(n_pages, device=self.req_to_token.device) * self.page_size
        pos = pos.clamp(max=self.req_to_token.shape[1] - 1)
        slots = self.req_to_token[req_pool_indices.long()[:, None], pos[None, :]]
        return torch.div(slots, self.page_size, rounding_mode="floor").to(torch.int32)

    def _template(self, fb: "ForwardBatch", prefix_lens, chunk_lens, scale: float = 1.0) -> ChunkBatch:
        n_pages = max([cdiv(L, self.page_size) for L in prefix_lens] + [1])
        page_table = self._page_table(fb.req_pool_indices, n_pages)
        # per-layer tensors are filled in by each layer; these stand-ins carry the shapes
        q_empty = torch.empty(0, self.num_q_heads, self.head_dim, device=self.device, dtype=self.pool.dtype)
        kv_empty = torch.empty(0, self.num_kv_heads, self.head_dim, device=self.device, dtype=self.pool.dtype)
        dev = self.device
        cu = [0]
        for c in chunk_lens:
            cu.append(cu[-1] + c)
        as_dev = lambda v: torch.tensor(v, dtype=torch.int32).to(dev, non_blocking=True)  # noqa: E731
        return ChunkBatch(q=q_empty, k_chunk=kv_empty, v_chunk=kv_empty, k_pool=self.pool.k_buffer[0],
                          v_pool=self.pool.v_buffer[0],
                          page_table=page_table, prefix_lens=as_dev(prefix_lens), chunk_lens=as_dev(chunk_lens),
                          cu_chunk=as_dev(cu), prefix_lens_cpu=list(prefix_lens), chunk_lens_cpu=list(chunk_lens),
                          sm_scale=scale)

    def init_forward_metadata(self, forward_batch: "ForwardBatch"):
        mode = forward_batch.forward_mode
        if forward_batch.batch_size == 0:
            self.forward_metadata = None  # idle: the base class returns empty outputs
        elif mode.is_decode_or_idle():
            self.telemetry.flush()  # publish the last extend's summary (no-op when none is pending)
            self.forward_metadata = self._decode_metadata(forward_batch)
        elif mode.name in ("EXTEND", "MIXED"):
            self.forward_metadata = self._extend_metadata(forward_batch)
        else:
            raise NotImplementedError(f"attention backend 'compact' does not support forward mode {mode.name} "
                                      "(speculative decoding is not supported)")

    MAX_FINAL_CHUNK_NOTES = 4096  # notes of batches that never ran (a bound, not a cache)

    def note_final_chunks(self, rids, prefix_lens, final) -> None:
        """From the plugin's `ForwardBatch.init_new` hook: per request of the coming extend batch, whether
        its chunk at `prefix_len` is its last prompt chunk (kept only under `dense_final_chunk`)."""
        if not self.config.dense_final_chunk:
            return
        if len(self._final_chunk_notes) > self.MAX_FINAL_CHUNK_NOTES:
            self._final_chunk_notes.clear()
        for rid, L, f in zip(rids, prefix_lens, final):
            self._final_chunk_notes[(rid, int(L))] = bool(f)

    def _final_chunks(self, fb: "ForwardBatch", prefix: list[int], sparse: list[bool]) -> list[bool]:
        """Per request: is this its last prompt chunk (noted by the plugin's hook; each note taken once).
        `sparse`: the requests whose chunk would take the compact path. A missing note counts as not
        final; it is warned about (once) only where it matters, on such a chunk."""
        n = len(prefix)
        if not self.config.dense_final_chunk:
            return [False] * n
        rids = getattr(fb, "rids", None) or ()
        notes = [self._final_chunk_notes.pop((rid, L), None) for rid, L in zip(rids, prefix)]
        notes += [None] * (n - len(notes))
        if any(x is None and s for x, s in zip(notes, sparse)) and not self._warned_no_final_flags:
            self._warned_no_final_flags = True
            logger.warning("compact: an extend batch came without the final-chunk note of the %s hook "
                           "(sglang_compact's plugin), so its chunks take the compact path even when final; "
                           "dense_final_chunk is off for such batches", FORWARD_BATCH_INIT)
        return [bool(x) for x in notes]

    def _extend_metadata(self, fb: "ForwardBatch") -> ExtendMetadata:
        prefix = [int(x) for x in fb.extend_prefix_lens_cpu]
        chunk = [int(x) for x in fb.extend_seq_lens_cpu]
        any_prefix = any(prefix)
        sparse = [self.config.uses_compact_path(L) and C > 1 for L, C in zip(prefix, chunk)]
        final = self._final_chunks(fb, prefix, sparse)
        compact_cpu = [s and not f for s, f in zip(sparse, final)]
        dense_final = [s and f for s, f in zip(sparse, final)]
        template = self._template(fb, prefix, chunk)
        if self.is_cuda:
            rows = self.compact.row_blocks(prefix, compact_cpu) if self.executor.backend == "fa3" else None
            self.executor.begin_forward(prefix, chunk, self.num_q_heads, self.num_kv_heads,
                                        self.head_dim, self.page_size, self.pool.dtype, self.sm_scale, rows)
        # None when every request is on the compact path (the common case): nothing to override per layer
        compact_rows = None if all(compact_cpu) else torch.tensor(compact_cpu).to(self.device, non_blocking=True)
        self.telemetry.begin_forward(prefix, chunk, compact_cpu, dense_final)
        return ExtendMetadata(template, compact_rows, any(compact_cpu), any_prefix, any(dense_final))

    def _decode_metadata(self, fb: "ForwardBatch") -> DecodeMetadata:
        bs = fb.batch_size
        seq_lens = self._host_seq_lens(fb, bs)
        template = self._template(fb, seq_lens, [1] * bs)
        if not self.is_cuda:
            table = template.kv_block_valid()[:, None, :].expand(bs, self.num_kv_heads, -1).contiguous()
            counts = table.sum(-1, dtype=torch.int32)
            plan = build_plan(table, counts, template.page_table, template.prefix_lens, template.cu_chunk,
                              self.page_size, use_triton=False)
            return DecodeMetadata(plan, template, None)
        w = self._decode_wrapper_eager()
        self._plan_decode(w, fb.req_pool_indices[:bs], seq_lens)
        return DecodeMetadata(None, template, w)

    def _decode_page_metadata(self, req_pool_indices: torch.Tensor, seq_lens: list[int]):
        """Host indptr / last-page lengths and device page ids of every request's pages (no sync)."""
        P = self.page_size
        n = [cdiv(L, P) for L in seq_lens]
        indptr = [0]
        for k in n:
            indptr.append(indptr[-1] + k)
        total = indptr[-1]
        counts = torch.tensor(n, dtype=torch.long).to(self.device, non_blocking=True)
        starts = torch.tensor(indptr[:-1], dtype=torch.long).to(self.device, non_blocking=True)
        req = torch.repeat_interleave(torch.arange(len(n), device=self.device), counts, output_size=total)
        page_pos = torch.arange(total, device=self.device) - starts[req]
        slots = self.req_to_token[req_pool_indices.long()[req], page_pos * P]
        indices = torch.div(slots, P, rounding_mode="floor").to(torch.int32)
        last = [L - (k - 1) * P for L, k in zip(seq_lens, n)]
        return (torch.tensor(indptr, dtype=torch.int32), indices, torch.tensor(last, dtype=torch.int32))

    def _plan_decode(self, wrapper, req_pool_indices, seq_lens):
        indptr, indices, last = self._decode_page_metadata(req_pool_indices, seq_lens)
        H_q = self.num_q_heads
        wrapper.plan(indptr, indices, last, H_q, self.num_kv_heads, self.head_dim, self.page_size,
                     q_data_type=self.pool.dtype, kv_data_type=self.pool.dtype, sm_scale=self.sm_scale)

    # --- decode CUDA graphs -------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.graph_buffers = dict(
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            indices=torch.zeros(max_bs * self.max_pages_per_req, dtype=torch.int32, device=self.device),
            last=torch.zeros(max_bs, dtype=torch.int32, device=self.device),
        )

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata_out_graph(self, forward_batch: "ForwardBatch", in_capture: bool = False):
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper
        mode = forward_batch.forward_mode
        if not mode.is_decode_or_idle():
            raise NotImplementedError(f"attention backend 'compact' captures CUDA graphs for decode only, "
                                      f"not {mode.name}; pass --disable-prefill-cuda-graph")
        self.telemetry.flush()  # outside the graph; no-op when no extend summary is pending
        bs = forward_batch.batch_size
        w = self.graph_wrappers.get(bs)
        if w is None:
            g = self.graph_buffers
            w = BatchDecodeWithPagedKVCacheWrapper(
                self.decode_workspace, "HND", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=g["indptr"][:bs + 1], paged_kv_indices_buffer=g["indices"],
                paged_kv_last_page_len_buffer=g["last"][:bs])
            self.graph_wrappers[bs] = w
        self._plan_decode(w, forward_batch.req_pool_indices[:bs], self._host_seq_lens(forward_batch, bs))
        self.forward_metadata = DecodeMetadata(None, None, w)

    @staticmethod
    def _host_seq_lens(forward_batch: "ForwardBatch", bs: int) -> list[int]:
        if forward_batch.seq_lens_cpu is not None:
            return [int(x) for x in forward_batch.seq_lens_cpu[:bs]]
        return forward_batch.seq_lens[:bs].tolist()  # graph capture: outside the graph, once per size

    # --- forward ---------------------------------------------------------------------------
    def _save_kv(self, layer, forward_batch, k, v, save_kv_cache):
        if save_kv_cache and k is not None and v is not None:
            loc = forward_batch.out_cache_loc
            self.pool.set_kv_buffer(layer, loc, k, v)
            if self.summaries is not None:
                self.summaries.update(layer.layer_id - self.start_layer, loc,
                                      k.view(-1, self.num_kv_heads, self.head_dim))

    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache=True):
        self._save_kv(layer, forward_batch, k, v, save_kv_cache)
        md: ExtendMetadata = self.forward_metadata
        H_q, D = layer.tp_q_head_num, self.head_dim
        q3 = q.contiguous().view(-1, H_q, D)
        k3 = k.contiguous().view(-1, self.num_kv_heads, D)
        v3 = v.contiguous().view(-1, self.num_kv_heads, D)
        if not md.any_prefix:
            o = self._chunk_only(q3, k3, v3, md.template, float(layer.scaling))
            return o.reshape(-1, H_q * D)
        layer_idx = layer.layer_id - self.start_layer
        batch = dataclasses.replace(md.template, q=q3, k_chunk=k3, v_chunk=v3,
                                    k_pool=self.pool.get_key_buffer(layer.layer_id),
                                    v_pool=self.pool.get_value_buffer(layer.layer_id), sm_scale=float(layer.scaling))
        buffers = self.executor.buffers if self.is_cuda else None
        if md.any_compact:
            pooled = None
            if self.summaries is not None:
                pages = batch.memo(("prefix_pages",), lambda: batch.page_table[:, :batch.max_kv_blocks].long())
                pooled = self.summaries.pooled(layer_idx, pages)
            cp = self.compact.plan(batch, layer_idx, pooled, md.compact_rows, buffers=buffers,
                                   with_stats=self.telemetry.wants_stats())
            if cp.stats is not None:
                self.telemetry.record(layer_idx, cp.stats, cp.table)
        else:
            cp = self.compact.plan_dense(batch, buffers=buffers)
            if md.any_dense_final and self.telemetry.wants_stats():
                self.telemetry.record(layer_idx, cp.stats)  # density 1.0: what the policy costs
        o = self.compact.executor.run(batch, cp.plan)
        return o.to(q.dtype).reshape(-1, H_q * D)

    def _chunk_only(self, q3, k3, v3, template: ChunkBatch, scale: float):
        if self.is_cuda:
            return self.executor.chunk_attention(q3, k3, v3)
        o, _ = causal_chunk_attention(q3, k3, v3, template.chunk_lens_cpu, scale)
        return o.to(q3.dtype)

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache=True):
        self._save_kv(layer, forward_batch, k, v, save_kv_cache)
        md: DecodeMetadata = self.forward_metadata
        H_q, D = layer.tp_q_head_num, self.head_dim
        q3 = q.contiguous().view(-1, H_q, D)
        k_buf = self.pool.get_key_buffer(layer.layer_id)
        v_buf = self.pool.get_value_buffer(layer.layer_id)
        if self.is_cuda:
            o = md.wrapper.run(q3, (k_buf, v_buf))
        else:
            batch = dataclasses.replace(md.template, q=q3, k_pool=k_buf, v_pool=v_buf, sm_scale=float(layer.scaling))
            o, _ = TorchPagedExecutor().prefix_attention(batch, md.plan)
        return o.to(q.dtype).reshape(-1, H_q * D)
