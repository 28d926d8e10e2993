"""SGLang attention backend `compact`: CompactAttention for chunked prefill.

This class keeps only SGLang's `AttentionBackend` interface. What it builds at
start is in `runtime.py` (config, model checks, gate, selector, executor,
summaries, telemetry); extend passes are planned and run by `extend.py`,
decode passes by `decode.py`.

The KV pool must be SGLang's head-major layout `[num_pages, H_kv, P, D]`
(`SGLANG_USE_HND_KVCACHE=1`, set by `sglang_compact.launch_server` and by the
plugin when `--attention-backend compact` is on the command line).
"""

from __future__ import annotations

from sglang_compact.srt import compat
from sglang_compact.srt.decode import DecodeMetadata, DecodePlanner
from sglang_compact.srt.extend import ExtendMetadata, ExtendPlanner
from sglang_compact.srt.runtime import CompactRuntime

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend


class CompactAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.rt = CompactRuntime.from_runner(model_runner)
        self.extend = ExtendPlanner(self.rt)
        self.decode = DecodePlanner(self.rt)
        self.forward_metadata: ExtendMetadata | DecodeMetadata | None = None

    def init_forward_metadata(self, forward_batch):
        if forward_batch.batch_size == 0:
            self.forward_metadata = None  # idle: the base class returns empty outputs
        elif compat.is_decode_or_idle(forward_batch):
            self.rt.telemetry.flush()  # publish the last extend's summary (no-op when none is pending)
            self.forward_metadata = self.decode.plan(forward_batch)
        elif compat.is_extend_mode(forward_batch):
            self.forward_metadata = self.extend.plan(forward_batch)
        else:
            raise NotImplementedError(f"attention backend 'compact' does not support forward mode "
                                      f"{compat.forward_mode_name(forward_batch)} (speculative decoding is not supported)")

    # decode CUDA graphs; prefill under SGLang's breakable CUDA graphs runs attention eagerly (the
    # generic init_forward_metadata above), so it needs nothing here
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.decode.init_cuda_graph_state(max_bs)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not compat.is_decode_or_idle(forward_batch):
            raise NotImplementedError(f"attention backend 'compact' captures full CUDA graphs for decode only, not "
                                      f"{compat.forward_mode_name(forward_batch)}: use --cuda-graph-backend-prefill "
                                      "breakable (the default) or disabled")
        self.rt.telemetry.flush()  # outside the graph; no-op when no extend summary is pending
        self.forward_metadata = self.decode.plan_for_graph(forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self.extend.forward(self.forward_metadata, q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self.decode.forward(self.forward_metadata, q, k, v, layer, forward_batch, save_kv_cache)
