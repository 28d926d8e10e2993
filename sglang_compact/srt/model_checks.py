"""What the compact backend refuses at start, with the reason and the fix."""

from __future__ import annotations

import torch

from sglang_compact.config import CompactConfig
from sglang_compact.kernels import flashprefill as flashprefill_kernel
from sglang_compact.srt import compat
from sglang_compact.srt.compat import AttentionLayerInfo, RunnerView

FLASHINFER_HEAD_DIMS = (64, 128, 256)
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class UnsupportedModelError(ValueError):
    """The model or server configuration cannot be served by the compact backend (raised at start)."""


def config_for(attached: CompactConfig | None, page_size: int) -> CompactConfig:
    """The launcher's validated config, or the defaults for this page size (the stock launcher)."""
    cfg = attached
    if cfg is None:
        try:
            cfg = CompactConfig(block_size=page_size)
        except ValueError as e:
            raise UnsupportedModelError(f"attention backend 'compact' needs --page-size to be a power of two in "
                                        f"[16, 256] (e.g. --page-size 64): {e}") from None
    if cfg.block_size != page_size:
        raise UnsupportedModelError(f"--compact-block-size {cfg.block_size} differs from --page-size {page_size}; "
                                    "a compact block is one KV page: drop --compact-block-size")
    return cfg


def check_search_kernel(config: CompactConfig, device_type: str) -> None:
    """On CUDA, refuse a selector `query_stride` that leaves the search kernel fewer than
    `MIN_QUERY_TILE` queries of each page: the search would fall back to its plain-torch twin, right but slow
    and memory-hungry at long contexts, with nothing to say so. (The CPU runs the twin anyway.)"""
    qs = config.params.query_stride_at(config.block_size)
    bs, least = config.block_size, flashprefill_kernel.MIN_QUERY_TILE
    if device_type == "cuda" and bs // qs < least:
        raise UnsupportedModelError(f"selector {config.selector!r}: query_stride {qs} scores {bs // qs} queries of "
                                    f"each {bs}-token page, the CUDA search kernel needs at least {least}: use "
                                    f"query_stride <= {max(bs // least, 1)} at --page-size {bs}, or a larger page")


#: why a page the backend did not write is wrong for it
_NO_SUMMARIES = ("outside the attention backend, so they would not carry the page summaries the selectors rank "
                 "pages by (silently wrong selections)")


def _kv_outside_backend(sa) -> list[tuple[str, str]]:
    """(flag, why) of each SGLang feature on in `sa` that puts KV into the device pool outside the backend."""
    on = []
    if getattr(sa, "enable_hierarchical_cache", False) or getattr(sa, "hicache_storage_backend", None):
        on.append(("--enable-hierarchical-cache / --hicache-storage-backend",
                   f"SGLang's hierarchical cache writes pages back into the device pool {_NO_SUMMARIES}"))
    if getattr(sa, "enable_lmcache", False):
        on.append(("--enable-lmcache", f"LMCache writes pages back into the device pool {_NO_SUMMARIES}"))
    if getattr(sa, "enable_flexkv", False):
        on.append(("--enable-flexkv", f"FlexKV loads pages from its host tiers back into the device pool "
                   f"{_NO_SUMMARIES}"))
    mode = getattr(sa, "disaggregation_mode", "null") or "null"
    if mode != "null":
        on.append((f"--disaggregation-mode {mode}", "SGLang 0.5.17 transfers KV between prefill and decode servers "
                   "by token slot and does not support the head-major pool the backend needs "
                   "(SGLANG_USE_HND_KVCACHE)"))
    if getattr(sa, "enable_hisparse", False):
        on.append(("--enable-hisparse", "SGLang's hierarchical sparse attention moves KV between host and device "
                   "and selects pages itself"))
    cp = getattr(sa, "attn_cp_size", 1) or 1
    if cp > 1 or getattr(sa, "enable_prefill_cp", False):
        on.append((f"--attn-cp-size {cp}" if cp > 1 else "--enable-prefill-cp", "context parallelism splits a "
                   f"prompt's tokens across ranks and writes their KV {_NO_SUMMARIES}"))
    return on


def _other_radix_tree(sa) -> list[tuple[str, str]]:
    """(flag or switch, why) where SGLang would build a radix tree other than its `RadixCache`: the hooks that keep
    the prefix cache exact (`srt/alignment.py`) wrap that class's match and insert, so with another tree a
    request's answer would depend on what is cached, with nothing to say so."""
    why = ("the compact backend keeps its prefix cache exact through SGLang's default RadixCache, and this {} "
           "replaces it (answers would depend on what is cached, and its pages on where the tree loads them from)")
    on = []
    if getattr(sa, "disable_radix_cache", False):
        return on                                   # nothing is cached
    backend = getattr(sa, "radix_cache_backend", None)
    if backend:
        on.append((f"--radix-cache-backend {backend}", why.format("registered radix cache backend")))
    env = compat.other_radix_tree_env()
    if env is not None:
        on.append((f"{env}=1", why.format("environment switch")))
    return on


def _streaming_sessions(sa) -> list[tuple[str, str]]:
    """(flag, why) where SGLang keeps streaming sessions: a session's KV stays in a slot outside the radix tree and
    all of it serves the session's next turn, whose prefill then starts inside a window (a sparse window computed
    over two turns), with the earlier turns' dense tails and answers read as they were computed."""
    if not getattr(sa, "enable_streaming_session", False):
        return []
    return [("--enable-streaming-session", "a streaming session serves all of its KV to its next turn from a slot "
             "outside the radix tree, so the turn would start inside a sparse window and read KV its cold run "
             "computes otherwise (sessions without streaming work: their turns go through the radix cache)")]


def check_server_features(server_args) -> None:
    """Refuse SGLang features that put KV into the device pool outside the attention backend: the backend writes
    each page's summaries with its KV, in a head-major pool, and a page written by anything else would be
    ranked by stale summaries or read in the wrong layout, wrong answers with nothing to say so. Refuse radix
    trees other than SGLang's `RadixCache` and streaming sessions too (`_other_radix_tree`, `_streaming_sessions`)."""
    on = _kv_outside_backend(server_args) + _other_radix_tree(server_args) + _streaming_sessions(server_args)
    if on:
        flag, why = on[0]
        raise UnsupportedModelError(f"{flag}: not supported with attention backend 'compact': {why}; drop it, or "
                                    "use another attention backend")


def check_runner(view: RunnerView) -> None:
    if view.is_mla:
        raise UnsupportedModelError("attention backend 'compact' does not support MLA models "
                                    "(use --attention-backend flashinfer or an MLA backend)")
    if not view.head_major:
        raise UnsupportedModelError("attention backend 'compact' needs SGLang's head-major KV pool: set "
                                    "SGLANG_USE_HND_KVCACHE=1 before starting the server (sglang_compact's "
                                    "launcher and plugin set it for you)")
    if view.kv_quantized or view.kv_dtype not in KV_DTYPES:
        raise UnsupportedModelError(f"attention backend 'compact' supports bf16/fp16/fp32 KV caches, not "
                                    f"{view.kv_dtype}: drop --kv-cache-dtype")
    if view.device.type == "cuda" and view.head_dim not in FLASHINFER_HEAD_DIMS:
        raise UnsupportedModelError(f"attention backend 'compact' supports head_dim {FLASHINFER_HEAD_DIMS} on CUDA "
                                    f"(FlashInfer), the model has {view.head_dim}")


def check_attention_layers(layers: list[AttentionLayerInfo], num_kv_heads: int, head_dim: int) -> tuple[int, float]:
    """Refuse models whose attention layers the compact path cannot compute exactly.

    Returns (query heads per rank, softmax scale), equal across the layers.
    """
    if not layers:
        raise UnsupportedModelError("attention backend 'compact' found no attention layers in the model")
    for layer in layers:
        if not layer.decoder_self_attention:
            raise UnsupportedModelError("attention backend 'compact' supports decoder self-attention only")
        if layer.logit_cap > 0:
            raise UnsupportedModelError("attention backend 'compact' does not support attention logit soft-capping")
        if layer.sliding_window is not None:
            raise UnsupportedModelError("attention backend 'compact' does not support sliding-window attention layers")
        if layer.qk_head_dim != head_dim or layer.v_head_dim != head_dim or layer.kv_heads != num_kv_heads:
            raise UnsupportedModelError(f"attention backend 'compact' needs every layer to match the KV pool "
                                        f"({num_kv_heads} kv heads x {head_dim}); layer {layer.layer_id} differs")
    shapes = {(layer.q_heads, layer.scaling) for layer in layers}
    if len(shapes) != 1:
        raise UnsupportedModelError(f"attention backend 'compact' needs one query-head count and scale, got {shapes}")
    (h_q, scale), = shapes
    if h_q % num_kv_heads:
        raise UnsupportedModelError(f"{h_q} query heads per rank is not a multiple of {num_kv_heads} kv heads")
    return h_q, scale
