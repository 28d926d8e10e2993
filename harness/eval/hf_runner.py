"""End-to-end greedy generation with HF transformers and chunked sparse prefill, for methods without a server path.

The prompt is prefilled in chunks of C tokens through a `DynamicCache`; a
registered attention function replaces each layer's attention for chunks
with a sparse window (the method's gate: `min_context`, its `dense_tail`,
the prompt length known, windows as a server with chunk C cuts them; C > 1)
with a `fidelity.Method` (compact /
blocksparse / quoka / dense) run on a head-major pool holding the chunk's
context (the cached prefix and the chunk's own K/V), exactly as in
`fidelity.simulate`, but with the sparse outputs propagating through the
model (errors compound, as in serving). Decode steps and chunks without a
sparse window use SDPA (dense), as the server runs them; a selector that
fixes its rows at the observing layer, and a method's `dense_layers`, run
each chunk's layers as the server does (`fidelity.layer_role`). The density of
every sparse (layer, chunk) is recorded (pages the sparse windows read over
their context pages; the server's `compact_density_forward` likewise counts
sparse forward passes only).

Slow (the pool is rebuilt per layer and chunk), but it gives accuracy for
block-sparse-without-unions and QUOKA, which the server cannot run. Runs
where the model is (`load_model(..., device="cuda")` for the GPU): the
library's torch paths are device-agnostic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from sglang_compact.compact import CompactAttention
from sglang_compact.config import CompactConfig
from sglang_compact.gate import Gate
from harness.eval.fidelity import Method, chunk_batch, layer_role, parse_method, run_method

CHUNKED_IMPL = "sglang_compact_chunked"


@dataclass
class _State:
    method: Method
    page_size: int
    cfg: CompactConfig
    gate: Gate
    prompt_len: int
    engine: CompactAttention | None = None
    densities: list[float] = field(default_factory=list)
    fixed: dict[int, torch.Tensor] = field(default_factory=dict)   # chunk start -> the observing layer's pages per row


_STATE: _State | None = None


def _chunked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    st = _STATE
    C = query.shape[2]
    L = key.shape[2] - C
    sparse_here = (st is not None and st.method.kind != "dense" and C > 1 and query.shape[0] == 1
                   and st.gate.uses_compact_path(L, C, st.prompt_len))
    if not sparse_here:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    q = query[0].transpose(0, 1)  # [C, H_q, D]
    k = key[0].transpose(0, 1)    # [L + C, H_kv, D]: the prefix and the chunk's own K/V
    v = value[0].transpose(0, 1)
    scale = float(scaling if scaling is not None else q.shape[-1] ** -0.5)
    batch = chunk_batch(q, k, v, L, st.page_size, scale, st.gate, st.prompt_len)
    layer = int(module.layer_idx)
    run = run_method(st.method, batch, layer, st.cfg, st.engine, with_allowed=False,
                     role=layer_role(st.method, st.cfg, layer), fill=st.fixed.get(L))
    if run.fixed is not None:
        st.fixed[L] = run.fixed
    st.densities.append(run.density)
    return run.output.to(query.dtype)[None], None


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
    density: float | None  # mean over sparse (layer, chunk) calls; None when there were none
    seconds: float
    densities: list[float] = field(default_factory=list)  # per sparse (layer, chunk) call, in call order


@torch.no_grad()
def generate(model, input_ids: Sequence[int], method: Method | str, *, max_new_tokens: int, chunk: int,
             page_size: int, min_context: int, sink_blocks: int = 2, recent_blocks: int = 4,
             eos_token_ids: Sequence[int] = ()) -> Generation:
    """Chunked prefill with `method` (windows sparse from `min_context` tokens of context on, outside the method's
    `dense_tail`), then greedy dense decode."""
    global _STATE
    from transformers import DynamicCache
    if getattr(model.config, "_attn_implementation", None) != CHUNKED_IMPL:
        register()
        model.set_attn_implementation(CHUNKED_IMPL)
    m = parse_method(method) if isinstance(method, str) else method
    m.check_replayable()
    cfg = m.config(page_size, sink_blocks, recent_blocks, min_context, chunk)
    engine = CompactAttention(cfg) if m.kind in ("compact", "blocksparse") else None
    ids = list(input_ids)
    _STATE = _State(m, page_size, cfg, m.gate(cfg, chunk), len(ids), engine)
    dev = next(model.parameters()).device
    t0 = time.monotonic()
    try:
        cache = DynamicCache()
        logits = None
        for s in range(0, len(ids), chunk):
            x = torch.tensor([ids[s:s + chunk]], dtype=torch.long, device=dev)
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
        return Generation(out, sum(d) / len(d) if d else None, time.monotonic() - t0, list(d))
    finally:
        _STATE = None
