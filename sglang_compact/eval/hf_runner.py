"""End-to-end greedy generation with HF transformers and chunked sparse prefill, for methods without a server path.

The prompt is prefilled in chunks of C tokens through a `DynamicCache`; a
registered attention function replaces each layer's attention for chunks
whose cached prefix takes the compact path (C > 1, prefix >= min_prefix_len)
with a `fidelity.Method` (compact / blocksparse / quoka / dense) run on a
head-major pool built from the cache, exactly as in `fidelity.simulate`, but
with the sparse outputs propagating through the model (errors compound, as
in serving). Decode steps and short prefixes use SDPA (dense), and so does the
prompt's last chunk under the method's `dense_final_chunk` (as the server does;
recorded at density 1.0). The post-union density of every compact (layer,
chunk) is recorded.

Slow (the prefix pool is rebuilt per layer and chunk), but it gives accuracy
for block-sparse-without-unions and QUOKA, which the server cannot run.
Runs where the model is (`load_model(..., device="cuda")` for the GPU): the
library's torch paths are device-agnostic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.compact import CompactAttention
from sglang_compact.config import CompactConfig
from sglang_compact.eval.fidelity import Method, head_major_pool, parse_method, run_method

CHUNKED_IMPL = "sglang_compact_chunked"


@dataclass
class _State:
    method: Method
    page_size: int
    cfg: CompactConfig
    engine: CompactAttention | None = None
    dense_now: bool = False
    densities: list[float] = field(default_factory=list)


_STATE: _State | None = None


def _chunked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    st = _STATE
    C = query.shape[2]
    L = key.shape[2] - C
    sparse_here = st is not None and st.method.kind != "dense" and C > 1 and st.cfg.uses_compact_path(L)
    if sparse_here and st.dense_now:
        st.densities.append(1.0)  # the dense final chunk reads the whole prefix
    if not sparse_here or st.dense_now or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    q = query[0].transpose(0, 1)  # [C, H_q, D]
    k = key[0].transpose(0, 1)    # [L + C, H_kv, D]
    v = value[0].transpose(0, 1)
    P = st.page_size
    k_pool, v_pool = head_major_pool(k[:L], P), head_major_pool(v[:L], P)
    page_table = torch.arange(k_pool.shape[0], dtype=torch.int32, device=q.device)[None]
    scale = float(scaling if scaling is not None else q.shape[-1] ** -0.5)
    batch = ChunkBatch.build(q.contiguous(), k[L:].contiguous(), v[L:].contiguous(), k_pool, v_pool, page_table,
                             [L], [C], sm_scale=scale)
    o, _, d = run_method(st.method, batch, int(module.layer_idx), st.cfg, st.engine)
    st.densities.append(d)
    return o.to(query.dtype)[None], None


def register() -> str:
    from transformers import AttentionInterface
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionMaskInterface.register(CHUNKED_IMPL, sdpa_mask)
    except ImportError:
        pass
    AttentionInterface.register(CHUNKED_IMPL, _chunked_attention)
    return CHUNKED_IMPL


def load_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """The HF model with the chunked attention registered; on `device` when given (default: where it loads, the CPU)."""
    from transformers import AutoModelForCausalLM
    register()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=CHUNKED_IMPL)
    if device is not None:
        model = model.to(device)
    return model.eval()


@dataclass
class Generation:
    output_ids: list[int]
    density: float | None  # mean over compact (layer, chunk) calls; None when there were none
    seconds: float


@torch.no_grad()
def generate(model, input_ids: Sequence[int], method: Method | str, *, max_new_tokens: int, chunk: int,
             page_size: int, min_prefix_len: int, sink_blocks: int = 2, recent_blocks: int = 4,
             eos_token_ids: Sequence[int] = ()) -> Generation:
    """Chunked prefill with `method`, then greedy dense decode. Under the method's `dense_final_chunk`
    the prompt's last chunk reads its whole prefix (density 1.0), as the server does."""
    global _STATE
    from transformers import DynamicCache
    if getattr(model.config, "_attn_implementation", None) != CHUNKED_IMPL:
        register()
        model.set_attn_implementation(CHUNKED_IMPL)
    m = parse_method(method) if isinstance(method, str) else method
    cfg = m.config(page_size, sink_blocks, recent_blocks, min_prefix_len)
    engine = CompactAttention(cfg) if m.kind in ("compact", "blocksparse") else None
    _STATE = _State(m, page_size, cfg, engine)
    dev = next(model.parameters()).device
    t0 = time.monotonic()
    try:
        cache = DynamicCache()
        ids = list(input_ids)
        logits = None
        for s in range(0, len(ids), chunk):
            x = torch.tensor([ids[s:s + chunk]], dtype=torch.long, device=dev)
            _STATE.dense_now = m.dense_final_chunk and s + chunk >= len(ids)
            logits = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        out: list[int] = []
        eos = set(int(e) for e in eos_token_ids)
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            if nxt in eos:
                break
            logits = model(input_ids=torch.tensor([[nxt]], device=dev), past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[0, -1]
        d = _STATE.densities
        return Generation(out, sum(d) / len(d) if d else None, time.monotonic() - t0)
    finally:
        _STATE = None
