"""Every touchpoint of SGLang's internals, in one module, with the versions it was checked against.

The rest of sglang-compact reaches SGLang only through this module (and the
backend's base class in `srt/backend.py`): moving to a newer SGLang means
reading this file against the new release. What is used, and why:

* the attention-backend registry and the `--attention-backend` choices
  (`attention_registry`, `server_args`): the backend is registered by name;
* the plugin hook registry (`HookRegistry`): hooks on `ForwardBatch.init_new`
  (per-request prompt lengths), on request validation, and on the scheduler's
  chunking and radix cache (`srt/alignment.py`: `truncation_align_size`,
  `PrefillAdder`'s chunk budget and continuing chunk, the cache's insertions);
* `ServerArgs`: the validated `CompactConfig` travels to the scheduler
  processes on it (pickled) as the private attribute `_compact_config`;
* `ForwardBatch` fields: `extend_prefix_lens_cpu`, `extend_seq_lens_cpu`,
  `seq_lens_cpu`, `req_pool_indices`, `out_cache_loc`, `rids`, `forward_mode`;
* the KV pool: SGLang's head-major layout (`SGLANG_USE_HND_KVCACHE=1`,
  `use_hnd`, per-layer buffers `[num_pages, H_kv, P, D]` from
  `get_key_buffer` / `get_value_buffer`), written directly by our KV kernel;
* the model runner: `req_to_token_pool`, `model_config.context_len`,
  `server_args` (page size, chunk size, metrics), the model's `RadixAttention`
  layers (checked at start);
* Prometheus: SGLang runs prometheus_client in multiprocess mode
  (`PROMETHEUS_MULTIPROC_DIR` set by the launcher before the schedulers are
  spawned), so metrics created in a scheduler process appear on `/metrics`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

#: SGLang releases this module was read against
SUPPORTED_SGLANG = ("0.5.17",)
ALLOW_UNTESTED_ENV = "SGLANG_COMPACT_ALLOW_UNTESTED_SGLANG"
HND_ENV = "SGLANG_USE_HND_KVCACHE"
CONFIG_ATTR = "_compact_config"
FORWARD_BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
#: the scheduler's chunk-length alignment (SGLang's deterministic mode), set at scheduler start
SCHEDULER_ALIGNMENT = "sglang.srt.managers.scheduler.Scheduler.init_deterministic_inference_config"
#: a request's radix-cache match for its next prefill
REQUEST_CACHE_MATCH = "sglang.srt.managers.schedule_batch.Req.init_next_round_input"
#: the radix cache's insertion of a finished / a chunked request's KV, and the page alignment of its key
CACHE_FINISHED = "sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req"
CACHE_UNFINISHED = "sglang.srt.mem_cache.radix_cache.RadixCache.cache_unfinished_req"
CACHE_KEY_ALIGN = "sglang.srt.mem_cache.radix_cache.RadixKey.page_aligned"
#: the radix tree's node split (a match or insert ending inside a node) and its insertion of a key's new node
CACHE_NODE_SPLIT = "sglang.srt.mem_cache.radix_cache.RadixCache._split_node"
CACHE_NODE_INSERT = "sglang.srt.mem_cache.radix_cache.RadixCache._insert_helper"
#: on a radix tree node: the position (tokens from the prompt's start) from which the request that inserted the
#: node computed its tokens' KV reading every page (its dense tail and output); None: not recorded
NODE_DENSE_FROM = "compact_dense_from"
#: on a request: the tokens its prefill covers, as at its last admission (`note_admission`), and where the first
#: window its prefill computed over two passes starts (`note_split_window`)
REQUEST_PREFILL_LEN = "compact_prefill_len"
REQUEST_SPLIT_FROM = "compact_split_from"
#: the scheduler's prefill budget of one pass (built per pass), and its admission of the continuing chunk of a
#: request whose prompt did not fit the previous pass
PREFILL_BUDGET_INIT = "sglang.srt.managers.schedule_policy.PrefillAdder.__init__"
CONTINUING_CHUNK = "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req"
#: bytes per token of the KV pool across layers (SGLang sizes the pool from the free memory with it)
POOL_CELL_SIZE = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"


class UnsupportedSGLangError(RuntimeError):
    pass


def sglang_version() -> str:
    return importlib.metadata.version("sglang")


def check_sglang_version() -> None:
    """Refuse an SGLang release this module was not read against (override: the env variable)."""
    v = sglang_version()
    if v.split("+")[0] not in SUPPORTED_SGLANG and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise UnsupportedSGLangError(
            f"sglang-compact supports sglang {', '.join(SUPPORTED_SGLANG)}, found {v}; install a supported "
            f"release, or set {ALLOW_UNTESTED_ENV}=1 to try this one")


# --- registration -------------------------------------------------------------------------------

def register_attention_backend(name: str, factory: Callable) -> None:
    """Make `name` a valid --attention-backend choice creating `factory(model_runner)` (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.attention_registry import register_attention_backend as register
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if name not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([name])
    if name not in ATTENTION_BACKENDS:
        register(name)(factory)


def register_hook(target: str, fn: Callable, kind: str) -> None:
    """Register `fn` as a BEFORE / AFTER / AROUND hook on `target` (once, however often plugins load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    registered = getattr(HookRegistry, "_hooks", {}).get(target, [])
    if not any(hook is fn for _, hook, *_ in registered):
        HookRegistry.register(target, fn, HookType[kind])


# --- chunk alignment (the SCHEDULER_ALIGNMENT and REQUEST_CACHE_MATCH hooks) -------------------------------

def compact_window_tokens(scheduler) -> int | None:
    """The union window (tokens) of a scheduler serving the compact backend, else None."""
    sa = scheduler.server_args
    if "compact" not in attention_backends(sa):
        return None
    from sglang_compact.config import CompactConfig
    config = attached_config(sa) or CompactConfig(block_size=int(sa.page_size or 64))
    return config.window_tokens(getattr(sa, "chunked_prefill_size", None))


def truncation_align_size(scheduler) -> int | None:
    return getattr(scheduler, "truncation_align_size", None)


def set_truncation_align_size(scheduler, tokens: int) -> None:
    scheduler.truncation_align_size = tokens


def request_matched_len(req) -> int:
    return len(req.prefix_indices)


def prefill_budget_args(args: tuple, kwargs: dict) -> tuple[int | None, int]:
    """(chunk budget, decode tokens mixed into the pass) that `PrefillAdder.__init__` was called with."""
    bound = _prefill_adder_signature().bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments["rem_chunk_tokens"], int(bound.arguments["num_mixed_decode_tokens"] or 0)


@functools.cache
def _prefill_adder_signature() -> inspect.Signature:
    from sglang.srt.managers.schedule_policy import PrefillAdder

    return inspect.signature(PrefillAdder.__init__)   # through the hook registry's wrapper (`__wrapped__`)


def chunk_budget(adder) -> int | None:
    """Prefill tokens the pass may still take (None: chunked prefill is off)."""
    return adder.rem_chunk_tokens


def set_chunk_budget(adder, tokens: int) -> None:
    adder.rem_chunk_tokens = tokens


def continuing_chunk_room(adder) -> int | None:
    """The tokens `add_chunked_req` gives the continuing chunk (SGLang's `_rem_tokens`: the chunk budget, or the
    KV pool's room when that is smaller); None where SGLang computes it otherwise (diffusion LMs, hybrid SWA) or
    where it is not positive (more mixed decode tokens than the chunk)."""
    if adder.dllm_config is not None or adder.is_hybrid_swa or adder.rem_chunk_tokens is None:
        return None
    room = min(adder.rem_chunk_tokens, int(adder.rem_total_tokens))
    room = room if room > 0 else adder.rem_chunk_tokens
    return room if room > 0 else None


#: SGLang environment switches that build a radix tree other than `RadixCache`, whose methods the cache hooks wrap
OTHER_RADIX_TREE_ENVS = ("SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", "SGLANG_ENABLE_UNIFIED_RADIX_TREE")


def other_radix_tree_env() -> str | None:
    """The first switch of `OTHER_RADIX_TREE_ENVS` that is on in this process, read as SGLang's `EnvBool` reads it
    (without importing SGLang, which the launcher checks before)."""
    on = ("true", "1", "yes", "y")
    return next((name for name in OTHER_RADIX_TREE_ENVS if os.environ.get(name, "").lower() in on), None)


def note_admission(req) -> None:
    """At the request's admission to a prefill: keep what the prefill covers (`request_prompt_len`), so that its
    cache inserts mark the dense tail that prefill had after its output has grown too; and no window of it is
    split yet."""
    setattr(req, REQUEST_PREFILL_LEN, request_prompt_len(req))
    setattr(req, REQUEST_SPLIT_FROM, None)


def note_split_window(req, position: int) -> None:
    """The request's prefill computes the window starting at `position` over two passes."""
    split = request_split_from(req)
    setattr(req, REQUEST_SPLIT_FROM, position if split is None else min(split, position))


def request_split_from(req) -> int | None:
    """Where the first window the request's prefill computed over two passes starts (None: none)."""
    return getattr(req, REQUEST_SPLIT_FROM, None)


def request_prefill_len(req) -> int:
    """The tokens the request's last prefill covered (its prompt, plus the output a retracted request had), the
    prompt length the backend planned its dense tail with (`note_admission`; its own prompt where none was
    noted)."""
    noted = getattr(req, REQUEST_PREFILL_LEN, None)
    return len(req.origin_input_ids) if noted is None else noted


def cached_prefix_spans(cache, req) -> list[tuple[int, int, int | None]]:
    """What the radix cache holds now of the request's prompt and output: (start, end, dense_from) of each tree
    node along them (`NODE_DENSE_FROM`), in token positions, page-aligned."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(req.origin_input_ids + req.output_ids, req.extra_key, is_bigram=getattr(cache, "is_eagle", False))
    return node_path_spans(cache.match_prefix(MatchPrefixParams(key=key)).last_device_node)


def node_path_spans(node) -> list[tuple[int, int, int | None]]:
    """(start, end, dense_from) of each radix tree node from the root's child to `node`, in token positions."""
    path = []
    while node is not None and node.parent is not None:
        path.append(node)
        node = node.parent
    spans, start = [], 0
    for n in reversed(path):
        spans.append((start, start + len(n.key), node_dense_from(n)))
        start += len(n.key)
    return spans


def request_cache_node(req):
    """The radix tree node that ends a request's cache hit."""
    return req.last_node


def inserted_node(insert_result, key):
    """The node `RadixCache._insert_helper` created for the part of `key` the tree did not hold (the node it
    returns, with the length it held), or None when it held all of the key."""
    held, last = insert_result
    return last if held < len(key) else None


def set_node_dense_from(node, position: int) -> None:
    setattr(node, NODE_DENSE_FROM, position)


def node_dense_from(node) -> int | None:
    return getattr(node, NODE_DENSE_FROM, None)


def truncate_request_prefix(req, tokens: int) -> None:
    """Use only the first `tokens` of a request's cache hit: the rest is recomputed by this request, which owns
    its new KV (`cache_protected_len`), so caching it later frees the duplicates. The lock the scheduler takes on
    the matched node still covers the kept part."""
    req.prefix_indices = req.prefix_indices[:tokens]
    req.cache_protected_len = min(req.cache_protected_len, tokens)


# --- the KV pool's sizing (the POOL_CELL_SIZE hook) ----------------------------------------------------

def cell_size_context(kvc) -> tuple[object, int, torch.dtype]:
    """(server args, page size, KV dtype) of a KV cache configurator."""
    sa = kvc.server_args
    return sa, int(sa.page_size or 1), kvc.kv_cache_dtype


# --- request checks (the hooks of srt/request_checks.py) -----------------------------------------------
# SGLang 0.5.17 does not check a request's token ids against the vocabulary (its
# `TokenizerManager._validate_input_ids_in_vocab` is never called) nor the types inside `sampling_params`:
# such requests crash the scheduler (or the detokenizer), and SGLang then kills the whole server. Its HTTP
# server answers a ValueError raised while a request is normalized or validated with a 400 and the message.

#: `GenerateReqInput.normalize_batch_and_arguments()` (launcher process): resolves single vs batch, `n`
#: (parallel samples) and per-request lists, first thing for every /generate and OpenAI request
REQUEST_NORMALIZE = "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments"
#: `TokenizerManager._validate_one_request(obj, input_ids)` (launcher process): SGLang's per-request validation,
#: called for each request (single, or each one of a batch; generate or embedding) with its final token ids
#: (given, or from the tokenizer) before the request is sent to the scheduler
REQUEST_VALIDATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
#: `validate_input_length(req, max_req_input_len, allow_auto_truncate)` (scheduler process, imported by
#: name into the scheduler module): an error message it returns aborts the request with a 400
SCHEDULER_INPUT_CHECK = "sglang.srt.managers.utils.validate_input_length"
#: GenerateReqInput fields that hold one value per request, or a list of them in a batch
PER_REQUEST_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
#: SamplingParams fields SGLang fills itself (not request parameters)
INTERNAL_SAMPLING_FIELDS = ("stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                            "is_normalized")


@dataclass(frozen=True)
class RequestView:
    """What the request checks read of a GenerateReqInput / EmbeddingReqInput (whole, or one of a batch)."""

    generate: bool            # a generate request (else an embedding request: no sampling)
    single: bool              # one request (before normalization: as far as known)
    count: int                # requests it stands for once normalized (prompts x parallel samples)
    ids_are_tokens: bool      # no multimodal data or input embeddings (whose ids may be placeholders)
    sampling_params: Any
    per_request: dict         # PER_REQUEST_FIELDS present -> value
    rid: Any = None           # request id(s)


def request_view(obj) -> RequestView:
    from sglang.srt.managers.io_struct import GenerateReqInput

    def count(x):
        return x if type(x) is int and x > 0 else 1

    try:
        multimodal = bool(obj.contains_mm_input()) if hasattr(obj, "contains_mm_input") else False
    except Exception:  # malformed multimodal data: SGLang's to refuse
        multimodal = True
    return RequestView(
        generate=isinstance(obj, GenerateReqInput), single=bool(getattr(obj, "is_single", True)),
        count=count(getattr(obj, "batch_size", 1)) * count(getattr(obj, "parallel_sample_num", 1)),
        ids_are_tokens=not multimodal and getattr(obj, "input_embeds", None) is None,
        sampling_params=getattr(obj, "sampling_params", None),
        per_request={f: getattr(obj, f) for f in PER_REQUEST_FIELDS if hasattr(obj, f)},
        rid=getattr(obj, "rid", None))


def tokenizer_manager_vocab_size(tokenizer_manager) -> int | None:
    vocab = getattr(getattr(tokenizer_manager, "model_config", None), "vocab_size", None)
    return int(vocab) if vocab else None


def tokenizer_manager_device(tokenizer_manager) -> str | None:
    """The server's `--device` ("cuda", "cpu", ...; None when unknown)."""
    device = getattr(getattr(tokenizer_manager, "server_args", None), "device", None)
    return str(device) if device else None


def sampling_param_names() -> frozenset[str]:
    """The request parameters of SGLang's SamplingParams."""
    from sglang.srt.sampling.sampling_params import SamplingParams
    return frozenset(SamplingParams.__struct_fields__) - frozenset(INTERNAL_SAMPLING_FIELDS)


def scheduler_request_ids(req) -> tuple[Sequence[int] | None, int | None]:
    """(prompt ids, vocab size) of a scheduler `Req`; (None, None) where its ids may be placeholders (multimodal
    data, input embeddings)."""
    if getattr(req, "multimodal_inputs", None) is not None or getattr(req, "input_embeds", None) is not None:
        return None, None
    vocab = getattr(req, "vocab_size", None)
    return req.origin_input_ids, int(vocab) if vocab else None


# --- server args ----------------------------------------------------------------------------------

def attach_config(server_args: Any, config: Any) -> None:
    """ServerArgs is read-only once resolved except for private names; it reaches the scheduler processes
    pickled, attributes included."""
    setattr(server_args, CONFIG_ATTR, config)


def attached_config(server_args: Any):
    return getattr(server_args, CONFIG_ATTR, None)


def attention_backends(server_args: Any) -> tuple[str | None, str | None]:
    """(prefill, decode) attention backends SGLang resolved."""
    return server_args.get_attention_backends()


def prepare_server_args(argv: Sequence[str]):
    from sglang.srt.server_args import prepare_server_args as prepare
    return prepare(list(argv))


def load_plugins() -> None:
    from sglang.srt.plugins import load_plugins as load
    load()


def run_server(server_args) -> None:
    from sglang.launch_server import run_server as run
    from sglang.srt.utils import kill_process_tree
    try:
        run(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


# --- forward batches ---------------------------------------------------------------------------------

def forward_mode_name(fb) -> str:
    return fb.forward_mode.name


def is_decode_or_idle(fb) -> bool:
    return fb.forward_mode.is_decode_or_idle()


def is_extend_mode(fb) -> bool:
    """EXTEND or MIXED (what the compact path serves); other extend-like modes (speculative) are not."""
    return fb.forward_mode.name in ("EXTEND", "MIXED")


def extend_lens(fb) -> tuple[list[int], list[int]]:
    """Host (cached prefix, new tokens) per request of an extend batch."""
    return [int(x) for x in fb.extend_prefix_lens_cpu], [int(x) for x in fb.extend_seq_lens_cpu]


def request_ids(fb) -> Sequence[str]:
    return getattr(fb, "rids", None) or ()


def host_seq_lens(fb, bs: int) -> list[int]:
    if fb.seq_lens_cpu is not None:
        return [int(x) for x in fb.seq_lens_cpu[:bs]]
    return fb.seq_lens[:bs].tolist()  # graph capture: outside the graph, once per size


def cache_locations(fb) -> torch.Tensor:
    return fb.out_cache_loc


def take_attention_output(fb, q: torch.Tensor) -> torch.Tensor | None:
    """The output buffer SGLang's attention op hands the backend for this call (`ForwardBatch._attn_output`,
    set by `unified_attention_with_output` before each layer's call), viewed like q [T, H_q, D]; None when
    there is none or it does not fit (the backend then returns a new tensor and SGLang copies it). Taken: the
    attribute is cleared, so a later call that SGLang makes without setting it never writes into a stale one."""
    out = getattr(fb, "_attn_output", None)
    if out is not None:
        fb._attn_output = None
    if out is None or out.dtype != q.dtype or out.numel() != q.numel() or not out.is_contiguous():
        return None
    return out.view(q.shape)


# --- schedule batches (in the ForwardBatch.init_new hook) ----------------------------------------------

def batch_requests(batch) -> list:
    return getattr(batch, "reqs", None) or []


def request_prompt_len(req) -> int:
    """Tokens the request prefills in all now (prompt, plus the output of a retracted request)."""
    return len(req.full_untruncated_fill_ids)


def request_prefix_len(batch, i: int, req) -> int:
    prefix_lens = getattr(batch, "prefix_lens", None)
    return int(prefix_lens[i]) if prefix_lens else len(req.prefix_indices)


# --- the model runner ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunnerView:
    """What the backend reads from SGLang's model runner, once, at start."""

    device: torch.device
    page_size: int
    num_pages: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    num_layers: int
    start_layer: int
    model_layers: int   # the model's, over every pipeline stage
    max_requests: int
    context_len: int
    chunked_prefill_size: int | None
    head_major: bool
    kv_quantized: bool
    is_mla: bool
    enable_metrics: bool
    metric_labels: dict


def runner_view(model_runner) -> RunnerView:
    pool = model_runner.token_to_kv_pool
    sa = model_runner.server_args
    return RunnerView(
        device=torch.device(model_runner.device), page_size=model_runner.page_size,
        num_pages=pool.k_buffer[0].shape[0] if getattr(pool, "use_hnd", False) else 0,
        num_kv_heads=pool.head_num, head_dim=pool.head_dim, kv_dtype=pool.dtype, num_layers=pool.layer_num,
        start_layer=getattr(pool, "start_layer", 0) or 0,
        model_layers=int(getattr(model_runner.model_config, "num_hidden_layers", 0) or pool.layer_num),
        max_requests=model_runner.req_to_token_pool.size,
        context_len=model_runner.model_config.context_len, chunked_prefill_size=getattr(sa, "chunked_prefill_size", None),
        head_major=bool(getattr(pool, "use_hnd", False)), kv_quantized=bool(getattr(pool, "is_quantized_kv_cache", False)),
        is_mla=bool(getattr(model_runner, "use_mla_backend", False)), enable_metrics=bool(getattr(sa, "enable_metrics", False)),
        metric_labels={"model_name": sa.served_model_name or sa.model_path, "tp_rank": getattr(model_runner, "tp_rank", 0)},
    )


def req_to_token(model_runner) -> torch.Tensor:
    """int [max_requests, max_context]: pool slot of each request's token positions."""
    return model_runner.req_to_token_pool.req_to_token


def kv_pool(model_runner):
    return model_runner.token_to_kv_pool


def layer_kv_buffers(pool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head-major K and V buffers [num_pages, H_kv, P, D] of a layer (by SGLang's global layer id)."""
    return pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)


@dataclass(frozen=True)
class AttentionLayerInfo:
    layer_id: int
    decoder_self_attention: bool
    logit_cap: float
    sliding_window: int | None
    qk_head_dim: int
    v_head_dim: int
    q_heads: int
    kv_heads: int
    scaling: float


def attention_layers(model: torch.nn.Module) -> list[AttentionLayerInfo]:
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    out = []
    for m in model.modules():
        if isinstance(m, RadixAttention):
            sw = m.sliding_window_size
            out.append(AttentionLayerInfo(
                m.layer_id, not m.is_cross_attention and m.attn_type == AttentionType.DECODER, float(m.logit_cap or 0),
                sw if sw is not None and sw > -1 else None, m.qk_head_dim, m.v_head_dim, m.tp_q_head_num,
                m.tp_k_head_num, float(m.scaling)))
    return out


def layer_id(layer) -> int:
    return layer.layer_id


def layer_scaling(layer) -> float:
    return float(layer.scaling)


def layer_q_heads(layer) -> int:
    return layer.tp_q_head_num


def attention_backend_base():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    return AttentionBackend
