"""Offline attention-level fidelity of the selection methods on a real model's q/k/v.

1. `capture_qkv` runs a Hugging Face Llama-family model (float32, CPU) once,
   densely, on a prompt and records every layer's post-RoPE q, k, v (through a
   registered attention function that stores its inputs, then runs SDPA).
2. `simulate` replays SGLang's chunked prefill on those tensors (chunk C,
   page P). Each chunk is a one-request `ChunkBatch` over a head-major pool
   `[pages, H_kv, P, D]` that holds its context (the prefix and the chunk's own
   K/V). Which windows (the chunk's tokens in one union window of
   `CompactConfig.window_tokens(chunk)` tokens, as the server cuts them) read a
   selection is decided per absolute window by the method's cost gate (`Gate`
   with the given `min_context` and the method's `dense_tail`, the prompt
   length known); the others read every page. Methods (`Method`):
     * `compact`: `CompactAttention.select_pages` + the torch executor (one causal
       paged pass over the rows (kv head, window)), i.e. exactly the served path;
     * `blocksparse`: the selector's own choice per query HEAD and q-block (the
       chunk's tokens in one page) plus the forced pages (sinks, the recent pages
       and the window's own pages, causally), without the group and window
       unions (`head_masks`; flashprefill and the selectors that return per-head
       masks);
     * `quoka`: `harness.quoka` (prefix tokens selected, the chunk dense and causal);
     * `dense`: every page.
   The replayed chunks are those in which some method has a sparse window
   (`compact_chunks`); a chunk in which a method has none runs its dense path
   (density 1.0, no error). Per layer (means over those chunks):
     * `rel_err`: ||o - o_dense||_F / ||o_dense||_F over the chunk's outputs;
     * `recall`: attention mass (the dense softmax over each query's causal
       context) on the keys the method reads, mean over queries and heads;
     * `density`: pages read over context pages of the sparse windows
       (compact: `PageSelection.density`, after the unions and forced pages;
       blocksparse: per-(head, q-block) cells over context cells; quoka: kept
       prefix tokens over prefix tokens).

A compact selector that fixes its rows at the pass's observing layer
(`flashprefill` with `fix_rows`) is replayed as the server runs it
(`layer_role`): in each chunk, layer 0 reads every page (density 1.0, no
error), layer 1 selects and fixes each row's page count, every later layer
keeps that many pages per row. A compact method's `dense_layers`
(`compact:flashprefill:dense_layers=21-23`, the server's
`--compact-dense-layers`) read every page in those layers; its `density_cap`
(`compact:oracle:top_p=1,density_cap=0.35`, the server's `--compact-density-cap`:
the best pages by exact mass at that density) keeps at most that share of each row.

Every layer sees the dense model's activations (errors do not compound
across layers): this isolates each method's attention-level error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from sglang_compact.batch import ChunkBatch, cdiv
from sglang_compact.compact import CompactAttention
from sglang_compact.config import OBSERVING_LAYER, CompactConfig, parse_layer_ids
from sglang_compact.selectors.registry import parse_layer_values
from sglang_compact.executors import ForwardShape, TorchExecutor
from sglang_compact.executors.torch_executor import causal_context_attention, masked_context_attention
from sglang_compact.gate import NEVER, Gate, GateDecision
from sglang_compact.selectors.base import page_scores, threshold_rows
from sglang_compact.selectors.registry import selector_spec
from sglang_compact.summaries import LayerSummaries
from harness.quoka import quoka_allowed, quoka_token_mask

CAPTURE_IMPL = "sglang_compact_capture"


# --- capture ---------------------------------------------------------------------------------------

@dataclass
class LayerQKV:
    q: torch.Tensor  # [T, H_q, D] post-RoPE
    k: torch.Tensor  # [T, H_kv, D] post-RoPE
    v: torch.Tensor  # [T, H_kv, D]
    scale: float


_CAPTURE: dict[int, LayerQKV] | None = None


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if _CAPTURE is not None:
        # [B=1, H, T, D] -> [T, H, D]
        _CAPTURE[int(module.layer_idx)] = LayerQKV(query[0].transpose(0, 1).contiguous().clone(),
                                                    key[0].transpose(0, 1).contiguous().clone(),
                                                    value[0].transpose(0, 1).contiguous().clone(),
                                                    float(scaling if scaling is not None else query.shape[-1] ** -0.5))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register_capture() -> str:
    from transformers import AttentionInterface
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionMaskInterface.register(CAPTURE_IMPL, sdpa_mask)
    except ImportError:  # older transformers: masks follow the attention name's defaults
        pass
    AttentionInterface.register(CAPTURE_IMPL, _capture_attention)
    return CAPTURE_IMPL


def load_model(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    register_capture()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=CAPTURE_IMPL)
    return model.eval()


@torch.no_grad()
def capture_qkv(model, input_ids: Sequence[int]) -> list[LayerQKV]:
    """One dense forward pass (no logits); every layer's post-RoPE q, k, v, in layer order."""
    global _CAPTURE
    if getattr(model.config, "_attn_implementation", None) != CAPTURE_IMPL:
        register_capture()
        model.set_attn_implementation(CAPTURE_IMPL)
    _CAPTURE = {}
    try:
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        base = getattr(model, "model", model)
        base(input_ids=ids, use_cache=False)
        out = [_CAPTURE[i] for i in sorted(_CAPTURE)]
    finally:
        _CAPTURE = None
    return out


# --- methods ---------------------------------------------------------------------------------------

#: the selectors blocksparse supports: flashprefill (per-head masks recomputed from its page scores: its fused
#: kernel returns the rows' table only) and every selector whose `select` returns per-head masks (xattention,
#: oracle, seer, and external ones that do). Those that return a per-kv-head table directly (budget, dense) make
#: no per-head choice to execute.
BLOCKSPARSE_FROM_SCORES = ("flashprefill",)


@dataclass(frozen=True)
class Method:
    """kind: dense | compact | blocksparse | quoka; selector/params as in `CompactConfig`, plus `dense_tail`
    (tokens: the prompt's last `dense_tail` tokens read every page; default `CompactConfig.dense_tail` for compact
    and blocksparse, 0 for quoka, the baseline as published)."""

    kind: str
    selector: str = "dense"
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        if self.kind in ("dense",):
            return "dense"
        p = ",".join(f"{k}={'+'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in self.params)
        if self.kind == "quoka":
            return f"quoka({p})"
        return f"{self.kind}-{self.selector}({p})"

    @property
    def dense_tail(self) -> int:
        given = dict(self.params)
        if "dense_final_chunk" in given:
            raise ValueError(f"{self.label}: dense_final_chunk was replaced by dense_tail (the prompt's last N tokens "
                             "read every page; N tokens, 0: off)")
        tail = given.get("dense_tail")
        if tail is not None:
            if isinstance(tail, bool) or not isinstance(tail, int) or tail < 0:
                raise ValueError(f"{self.label}: dense_tail must be an integer >= 0 (tokens), got {tail!r}")
            return tail
        return CompactConfig.dense_tail if self.kind in ("compact", "blocksparse") else 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Model layers that read every page in a sparse pass (`CompactConfig.dense_layers`; compact only)."""
        return tuple(dict(self.params).get("dense_layers", ()))

    @property
    def dense_above(self) -> float | None:
        """The server's observed-density fallback (`--compact-dense-above`: a sparse window whose selection at the
        pass's observing layer reads more than this share of its pages reads every page; compact servers only);
        None: the server's own (its cost model's break-even density, or never)."""
        v = dict(self.params).get("dense_above")
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{self.label}: dense_above must be a density in [0, 1], got {v!r}")
        return float(v)

    @property
    def density_cap(self) -> float | None:
        """At most this share of each sparse row's pages, best scores first (`CompactConfig.density_cap`, the
        server's `--compact-density-cap`); None: no cap. With `oracle` at top_p 1 it is the best page choice at a
        given density."""
        v = dict(self.params).get("density_cap")
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
            raise ValueError(f"{self.label}: density_cap must be a density in (0, 1], got {v!r}")
        return float(v)

    @property
    def selector_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.params if k not in SERVER_PARAMS}

    def check_replayable(self) -> None:
        """The offline replay and the HF runner run every gated window sparse: they do not model the server's
        observed-density fallback, so a method that sets one below 1 cannot be run there."""
        if self.dense_above is not None and self.dense_above < 1.0:
            raise ValueError(f"{self.label}: dense_above (the server's observed-density fallback) is not modelled "
                             "offline; run it as a server method")

    def config(self, page_size: int, sink_blocks: int, recent_blocks: int, min_context: int,
               chunk: int | None) -> CompactConfig:
        """The configuration a server with this chunked-prefill size runs (`CompactConfig.at_chunk`)."""
        sparse = self.kind in ("compact", "blocksparse")
        return CompactConfig(block_size=page_size, selector=self.selector if sparse else "dense",
                             selector_params=self.selector_params if sparse else {},
                             sink_blocks=sink_blocks, recent_blocks=recent_blocks, min_context=min_context,
                             dense_tail=self.dense_tail, dense_layers=self.dense_layers if sparse else (),
                             density_cap=self.density_cap if sparse else None).at_chunk(chunk)

    def gate(self, config: CompactConfig, chunk: int | None) -> Gate:
        """The windows this method runs sparse: from `config.min_context` on, outside the dense tail; none for
        `dense`. Windows of `config.window_tokens(chunk)` tokens, as a server with that chunked-prefill size."""
        window = config.window_tokens(chunk)
        if self.kind == "dense":
            return Gate(config, GateDecision(NEVER, "selector dense", "method dense"), window)
        return Gate(config, GateDecision(config.min_context, "flag", f"min_context {config.min_context}"), window)


DENSE = Method("dense")
#: a compact method's parameters that are not its selector's
SERVER_PARAMS = ("dense_tail", "dense_layers", "dense_above", "density_cap")


def parse_method(text: str) -> Method:
    """'compact:flashprefill:alpha=0.06', 'blocksparse:xattention:threshold=0.9', 'quoka:query_ratio=0.25,kv_budget=0.25',
    'dense'; any but dense may add dense_tail=N (tokens)."""
    parts = text.split(":", 2)   # the parameters may hold ':' (layer_density)
    kind = parts[0]
    if kind == "dense":
        return Method("dense")
    if kind == "quoka":
        params = _parse_params(parts[1] if len(parts) > 1 else "")
        params = {"query_ratio": 0.25, "kv_budget": 0.25, **params}
        return Method("quoka", "quoka", tuple(sorted(params.items())))
    if kind not in ("compact", "blocksparse") or len(parts) < 2:
        raise ValueError(f"bad method {text!r}: use dense | compact:SELECTOR[:k=v,...] | blocksparse:SELECTOR[:k=v,...] "
                         "| quoka[:query_ratio=..,kv_budget=..]")
    params = _parse_params(parts[2] if len(parts) > 2 else "")
    m = Method(kind, parts[1], tuple(sorted(params.items())))
    try:   # the selector's own validation, before any server or model starts
        _ = m.dense_tail
        selector_spec(m.selector).params.validated(m.selector_params, f"{m.selector} parameters")
        if m.dense_layers:
            if kind != "compact":
                raise ValueError("dense_layers is a compact method's (the server's --compact-dense-layers)")
            CompactConfig(dense_layers=m.dense_layers)
        if m.dense_above is not None and kind != "compact":
            raise ValueError("dense_above is a compact method's (the server's --compact-dense-above)")
        if m.density_cap is not None:
            CompactConfig(selector=m.selector, selector_params=m.selector_params, density_cap=m.density_cap)
    except ValueError as e:
        raise ValueError(f"bad method {text!r}: {e} (after the selector come its parameters, dense_tail, "
                         "dense_layers, dense_above and density_cap only; other server flags are given to the "
                         "server)") from None
    return m


def _parse_params(text: str) -> dict[str, Any]:
    """'k=v,...': integers, floats and true/false; `dense_layers` takes layer ids and ranges joined by '+'
    ('dense_layers=9+21-23'); `layer_density` (budget, mass_budget) its items joined by '/'
    ('layer_density=2-6:0.6/7-23:0.28')."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        v = v.strip()
        if k.strip() == "dense_layers":
            try:
                out["dense_layers"] = parse_layer_ids(v, sep="+")
            except ValueError as e:
                raise ValueError(f"parameter {item!r}: {e}") from None
            continue
        if k.strip() == "layer_density":
            out["layer_density"] = v.replace("/", ",")
            try:
                parse_layer_values(out["layer_density"], 0.0, 1.0)
            except ValueError as e:
                raise ValueError(f"parameter {item!r}: {e}") from None
            continue
        if v.lower() in ("true", "false"):
            out[k.strip()] = v.lower() == "true"
            continue
        try:
            out[k.strip()] = int(v) if v.lstrip("-").isdigit() else float(v)
        except ValueError:
            raise ValueError(f"parameter {item!r}: the value must be a number or true/false") from None
    return out


DEFAULT_METHODS = (
    "dense",
    "compact:flashprefill:alpha=0.02", "compact:flashprefill:alpha=0.06", "compact:flashprefill:alpha=0.1",
    "compact:flashprefill:alpha=0.2",
    "compact:xattention:threshold=0.9", "compact:oracle:top_p=0.95", "compact:budget:density=0.3",
    "blocksparse:flashprefill:alpha=0.06", "blocksparse:xattention:threshold=0.9",
    "quoka:query_ratio=0.25,kv_budget=0.25",
)


# --- one chunk -------------------------------------------------------------------------------------------

def head_major_pool(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """[T, H, D] tokens in order -> [ceil(T / P), H, P, D] pages (zero padded)."""
    T, H, D = x.shape
    n = max(cdiv(T, page_size), 1)
    pad = x.new_zeros(n * page_size, H, D)
    pad[:T] = x
    return pad.view(n, page_size, H, D).permute(0, 2, 1, 3).contiguous()


def chunk_starts(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, num_tokens)) for s in range(0, num_tokens, chunk)]


def chunk_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, page_size: int, sm_scale: float,
                gate: Gate, prompt_len: int | None, k_pool: torch.Tensor | None = None,
                v_pool: torch.Tensor | None = None) -> ChunkBatch:
    """One request's chunk: queries q [C, H_q, D] at positions start.., over the context k/v [>= start + C, H_kv, D]
    in order (a head-major pool of them when none is given; pages in order), in the gate's windows (its sparse
    ones for a prompt of `prompt_len` tokens)."""
    C = q.shape[0]
    if k_pool is None:
        k_pool, v_pool = head_major_pool(k[:start + C], page_size), head_major_pool(v[:start + C], page_size)
    page_table = torch.arange(k_pool.shape[0], dtype=torch.int32, device=q.device)[None]
    return ChunkBatch.build(q.contiguous(), k_pool, v_pool, page_table, [start], [C], sm_scale=sm_scale,
                            sparse_ranges=[gate.sparse_range(prompt_len)], k_chunk=k[start:start + C].contiguous(),
                            v_chunk=v[start:start + C].contiguous(), window_pages=gate.window // page_size)


def table_allowed(batch: ChunkBatch, table: torch.Tensor, b: int = 0, per: str = "window") -> torch.Tensor:
    """bool [H, C, E]: the keys each query of request b reads under a table of pages, causally: bool [H, NW, NKV]
    per window row (`per="window"`, the executors' tables) or [H, NQB, NKV] per q-block (`per="qblock"`); H kv
    heads or query heads."""
    qb, P, dev = batch.qblocks, batch.page_size, batch.q.device
    L, C = batch.prefix_lens_cpu[b], batch.chunk_lens_cpu[b]
    E = L + C
    pos = L + torch.arange(C, device=dev)
    if per == "window":
        W = qb.window_pages * P
        row = qb.w_req.index(b) + pos // W - L // W
    else:
        row = qb.req.index(b) + pos // P - L // P
    pages = table[:, row][:, :, torch.arange(E, device=dev) // P]
    return pages & (torch.arange(E, device=dev)[None, :] <= pos[:, None])[None]


def context_probs(batch: ChunkBatch, b: int = 0) -> torch.Tensor:
    """float32 [H_q, C, E]: the dense softmax of request b's chunk queries over their causal context."""
    L, C = batch.prefix_lens_cpu[b], batch.chunk_lens_cpu[b]
    cu = batch.cu_chunk_cpu()
    k = batch.context_keys(b).to(torch.float32).repeat_interleave(batch.group_size, dim=0)  # [H_q, E, D]
    q = batch.q[cu[b]:cu[b + 1]].to(torch.float32).transpose(0, 1)                         # [H_q, C, D]
    s = torch.matmul(q, k.transpose(-1, -2)) * batch.sm_scale
    pos = L + torch.arange(C, device=s.device)
    s = s.masked_fill(torch.arange(L + C, device=s.device)[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1)


def head_masks(batch: ChunkBatch, layer: int, cfg: CompactConfig, compact: CompactAttention,
               summaries: LayerSummaries | None) -> torch.Tensor:
    """bool [H_q, NQB, NKV]: per query head and q-block, the pages it reads under blocksparse: the selector's
    choice among the pages before its window plus the forced pages of its window (sinks, the recent pages, the
    window's own pages; every page of a dense window), up to its own page (causally in it): no group union, no
    window union.

    Supported selectors: flashprefill (`page_scores` + `threshold_rows`, what its fused kernel thresholds per head
    before the group union) and those whose `select` returns per-query-head masks; a ValueError for the others
    (budget and dense return the rows' table, a kv head's choice per window)."""
    if summaries is None and compact.uses_summaries:
        summaries = LayerSummaries.from_pool(batch.k_pool, batch.page_table, batch.context_lens_cpu(),
                                             key_bounds=compact.uses_key_bounds)
    if cfg.selector in BLOCKSPARSE_FROM_SCORES:
        p = cfg.params
        scores = page_scores(batch, summaries, query_stride=p.query_stride_at(batch.page_size))
        mask = threshold_rows(scores, batch.candidates()[None], p.alpha)
    else:
        sel = compact.selector.select(batch, layer, summaries)
        if sel.mask is None or (sel.mask.shape[0] != batch.num_q_heads):
            raise ValueError(f"blocksparse: selector {cfg.selector!r} returns "
                             f"{'the rows table' if sel.mask is None else 'a mask per kv head'}, not a choice per "
                             "query head; blocksparse supports flashprefill and the selectors that return per-head "
                             "masks (xattention, oracle, seer, ...)")
        mask = sel.mask
    d = batch.device_qblocks()
    forced = batch.forced(cfg.sink_blocks, cfg.recent_blocks)[d["window"].long()]       # [NQB, NKV]
    upto = torch.arange(batch.qblocks.max_pages, device=mask.device)[None, :] <= d["page"].long()[:, None]
    return (mask | forced[None]) & upto[None]


def sparse_qblock_cells(batch: ChunkBatch) -> tuple[torch.Tensor, int]:
    """(bool [NQB] the q-blocks of sparse windows, their context pages 0..a summed)."""
    qb = batch.qblocks
    flags = [qb.w_sparse[w] for w in qb.window]
    sparse = torch.tensor(flags, dtype=torch.bool, device=batch.q.device)
    return sparse, sum(a + 1 for a, s in zip(qb.page, flags) if s)


def layer_role(method: Method, cfg: CompactConfig | None, layer: int) -> str:
    """How the server runs `layer` of a sparse pass for this method (`srt/extend.py`): "dense" for a layer of
    its `dense_layers`; else "select" (every layer selects), or, for a compact selector that fixes its rows at the
    pass's `OBSERVING_LAYER`, "dense" before it
    (every page), "observe" there (selects, and its rows' page counts are kept) and "fill" after it (exactly that
    many pages per row, `Selector.fill`)."""
    if method.kind == "compact" and cfg is not None and layer in cfg.dense_layers:
        return "dense"
    if method.kind != "compact" or cfg is None or not cfg.spec.fixes_rows_at_observing_layer(cfg.params):
        return "select"
    return "dense" if layer < OBSERVING_LAYER else "observe" if layer == OBSERVING_LAYER else "fill"


class MethodRun(NamedTuple):
    output: torch.Tensor | None    # [C, H_q, D]
    allowed: torch.Tensor | None   # bool, broadcastable to [H_q, C, E] (causal)
    density: float
    fixed: torch.Tensor | None = None   # at the observing layer: pages per row (int32), for `fill`


def run_method(method: Method, batch: ChunkBatch, layer: int, cfg: CompactConfig, compact: CompactAttention | None,
               summaries: LayerSummaries | None = None, outputs: bool = True, with_allowed: bool = True, *,
               role: str = "select", fill: tuple[torch.Tensor, int] | None = None) -> MethodRun:
    """(output, allowed keys, density, rows fixed) for a one-request batch; output and allowed are None without
    `outputs` (the density alone), allowed without `with_allowed`. A chunk without a sparse window runs the dense
    path (density 1.0), as the server does. `role` (`layer_role`): "dense" reads every page; "observe" also returns
    the rows' page counts (`fixed`); "fill" keeps `fill`'s counts (what "observe" returned for this chunk)."""
    L, C = batch.prefix_lens_cpu[0], batch.chunk_lens_cpu[0]
    E = L + C
    if method.kind == "dense" or not batch.qblocks.any_sparse or role == "dense":
        if not outputs:
            return MethodRun(None, None, 1.0)
        allowed = torch.ones(1, 1, E, dtype=torch.bool, device=batch.q.device) if with_allowed else None
        return MethodRun(causal_context_attention(batch).to(batch.q.dtype), allowed, 1.0)
    if method.kind == "compact":
        if role == "fill" and fill is None:
            raise ValueError(f"{method.label}: layer {layer} fills its rows to the observing layer's counts; "
                             "run the observing layer of this chunk first")
        sel = compact.select_pages(batch, layer, summaries, with_stats=True, fill=fill if role == "fill" else None)
        d = float(sel.density)
        fixed = sel.counts.to(torch.int32) if role == "observe" else None
        if not outputs:
            return MethodRun(None, None, d, fixed)
        ex = TorchExecutor()
        ex.plan_forward(ForwardShape.of(batch, compact.row_pages(batch)), batch.page_table)
        o = ex.run(batch, sel.indices)
        return MethodRun(o, table_allowed(batch, sel.table) if with_allowed else None, d, fixed)
    if method.kind == "blocksparse":
        masks = head_masks(batch, layer, cfg, compact, summaries)       # [H_q, NQB, NKV]
        sparse, cells = sparse_qblock_cells(batch)
        d = float(masks[:, sparse].sum()) / float(max(1, cells * batch.num_q_heads))
        if not outputs:
            return MethodRun(None, None, d)
        allowed = table_allowed(batch, masks, per="qblock")             # [H_q, C, E]
        o = masked_context_attention(batch, lambda b, L_, C_: allowed).to(batch.q.dtype)
        return MethodRun(o, allowed if with_allowed else None, d)
    if method.kind == "quoka":
        p = dict(method.params)
        tm = quoka_token_mask(batch, p["query_ratio"], p["kv_budget"])   # [1, H_kv, L]
        d = float(tm[0, :, :L].float().mean()) if L else 1.0
        if not outputs:
            return MethodRun(None, None, d)
        fn = quoka_allowed(batch, tm)
        o = masked_context_attention(batch, fn).to(batch.q.dtype)
        return MethodRun(o, fn(0, L, C) if with_allowed else None, d)
    raise ValueError(f"unknown method kind {method.kind!r}")


# --- the replay ------------------------------------------------------------------------------------------

@dataclass
class FidelityResult:
    methods: list[str]
    num_tokens: int
    chunk: int
    page_size: int
    min_context: int
    compact_chunks: int
    # method -> metric -> per-layer list
    per_layer: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for m, d in self.per_layer.items():
            out[m] = {k: (sum(v) / len(v) if v else float("nan")) for k, v in d.items()}
            if d.get("rel_err"):
                out[m]["rel_err_max_layer"] = max(d["rel_err"])
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"methods": self.methods, "num_tokens": self.num_tokens, "chunk": self.chunk,
                "page_size": self.page_size, "min_context": self.min_context,
                "compact_chunks": self.compact_chunks, "seconds": round(self.seconds, 1),
                "summary": self.summary(), "per_layer": self.per_layer}


@dataclass
class _Engine:
    method: Method
    cfg: CompactConfig
    gate: Gate
    compact: CompactAttention | None


def _engines(methods: Sequence[Method], page_size: int, sink_blocks: int, recent_blocks: int,
             min_context: int, chunk: int) -> dict[str, _Engine]:
    out = {}
    for m in methods:
        m.check_replayable()
        cfg = m.config(page_size, sink_blocks, recent_blocks, min_context, chunk)
        out[m.label] = _Engine(m, cfg, m.gate(cfg, chunk),
                               CompactAttention(cfg) if m.kind in ("compact", "blocksparse") else None)
    return out


def replayed_chunks(engines: Iterable[_Engine], num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """The chunks (start, end) in which some method has a sparse window (the prompt length known)."""
    gates = [e.gate for e in engines]
    return [(s, e) for s, e in chunk_starts(num_tokens, chunk)
            if any(g.uses_compact_path(s, e - s, num_tokens) for g in gates)]


@torch.no_grad()
def simulate(layers: Sequence[LayerQKV], methods: Iterable[Method | str], *, chunk: int = 256, page_size: int = 64,
             min_context: int = 512, sink_blocks: int = 2, recent_blocks: int = 4,
             density_only: bool = False, layer_ids: Sequence[int] | None = None,
             progress: Callable[[str], None] | None = None) -> FidelityResult:
    """Replay chunked prefill on captured q/k/v; see the module docstring.

    min_context: windows with less context (tokens before them) read every page (`CompactConfig.min_context`).
    density_only: skip outputs and recall (selection only; fast).
    """
    methods = [parse_method(m) if isinstance(m, str) else m for m in methods]
    t0 = time.monotonic()
    T = layers[0].q.shape[0]
    engines = _engines(methods, page_size, sink_blocks, recent_blocks, min_context, chunk)
    spans = replayed_chunks(engines.values(), T, chunk)
    res = FidelityResult([m.label for m in methods], T, chunk, page_size, min_context, len(spans))
    for m in methods:
        res.per_layer[m.label] = {"density": []} if density_only else {"rel_err": [], "recall": [], "density": []}
    wanted = list(range(len(layers))) if layer_ids is None else sorted(set(layer_ids))
    roles = {m.label: [layer_role(m, engines[m.label].cfg, li) for li in range(len(layers))] for m in methods}
    ids = wanted
    if any(roles[m.label][li] == "fill" for m in methods for li in wanted) and OBSERVING_LAYER not in wanted:
        ids = sorted({*wanted, OBSERVING_LAYER})   # run for its counts (the later layers keep them), not reported
    fixed: dict[tuple[str, int], torch.Tensor] = {}   # (method, chunk start) -> the observing layer's
    for li in ids:
        report = li in wanted
        lq = layers[li]
        k_pool = head_major_pool(lq.k, page_size)
        v_pool = head_major_pool(lq.v, page_size)
        acc = {m.label: {k: [] for k in res.per_layer[m.label]} for m in methods}
        for s, e in spans:
            batches = {}
            for m in methods:
                gate = engines[m.label].gate
                key = (gate.sparse_range(T), gate.window)
                if key not in batches:
                    batches[key] = chunk_batch(lq.q[s:e], lq.k, lq.v, s, page_size, lq.scale, gate, T, k_pool, v_pool)
            any_batch = next(iter(batches.values()))
            summaries = LayerSummaries.from_pool(k_pool, any_batch.page_table, any_batch.context_lens_cpu(),
                                                 key_bounds=any(e.compact is not None and e.compact.uses_key_bounds
                                                                for e in engines.values()))
            probs = o_ref = None
            if not density_only and report:
                probs = context_probs(any_batch)                                     # [H_q, C, E]
                o_ref = causal_context_attention(any_batch)
            for m in methods:
                eng = engines[m.label]
                batch = batches[(eng.gate.sparse_range(T), eng.gate.window)]
                role = roles[m.label][li]
                run = run_method(m, batch, li, eng.cfg, eng.compact, summaries,
                                 outputs=not density_only and report, role=role, fill=fixed.get((m.label, s)))
                if run.fixed is not None:
                    fixed[(m.label, s)] = run.fixed
                if not report:
                    continue
                o, allowed, d = run.output, run.allowed, run.density
                a = acc[m.label]
                a["density"].append(d)
                if density_only:
                    continue
                o = o.to(torch.float32)
                a["rel_err"].append(float((o - o_ref).norm() / o_ref.norm().clamp(min=1e-30)))
                if allowed.shape[0] not in (1, probs.shape[0]):
                    allowed = allowed.repeat_interleave(probs.shape[0] // allowed.shape[0], dim=0)
                a["recall"].append(float((probs * allowed).sum(-1).mean()))
        for m in methods:
            for k, v in acc[m.label].items():
                if report:
                    res.per_layer[m.label][k].append(sum(v) / len(v) if v else float("nan"))
        if progress:
            progress(f"layer {li}")
    res.seconds = time.monotonic() - t0
    return res


def offline_density(model, input_ids: Sequence[int], method: Method | str, *, chunk: int, page_size: int,
                    min_context: int, sink_blocks: int = 2, recent_blocks: int = 4) -> float | None:
    """Mean density (over layers and the chunks with a sparse window) of one prompt, as the server's
    `compact_density_forward` measures it; None when no chunk has a sparse window."""
    m = parse_method(method) if isinstance(method, str) else method
    engines = _engines([m], page_size, sink_blocks, recent_blocks, min_context, chunk)
    if not replayed_chunks(engines.values(), len(input_ids), chunk):
        return None
    layers = capture_qkv(model, input_ids)
    r = simulate(layers, [m], chunk=chunk, page_size=page_size, min_context=min_context,
                 sink_blocks=sink_blocks, recent_blocks=recent_blocks, density_only=True)
    d = next(iter(r.per_layer.values()))["density"]
    d = [x for x in d if not math.isnan(x)]
    return sum(d) / len(d) if d else None


def fidelity_markdown(entry: dict[str, Any], title: str) -> str:
    """One `FidelityResult.as_dict()` (plus optional date/capture fields) as a markdown section."""
    e = entry
    when = f"{e['date']}, " if "date" in e else ""
    if "min_context" in e:
        gate = f"a window with >= {e['min_context']} tokens of context"
    else:  # entries from before the per-q-block gate
        gate = f"prefix >= {e['min_prefix_len']}, earlier definitions"
    lines = [f"## {title}", "",
             f"{when}{e['num_tokens']} tokens, chunk {e['chunk']}, page {e['page_size']}; compact chunks ({gate}): "
             f"{e['compact_chunks']}; means over layers and those chunks (replay {e['seconds']:.0f} s)", "",
             "| method | density | recall (attention mass) | rel. output error (mean / worst layer) |",
             "| --- | --- | --- | --- |"]
    for m, s in e["summary"].items():
        err = f"{s['rel_err']:.4f} / {s['rel_err_max_layer']:.4f}" if "rel_err" in s else "-"
        rec = f"{s['recall']:.4f}" if "recall" in s else "-"
        lines.append(f"| {m} | {s['density']:.3f} | {rec} | {err} |")
    return "\n".join(lines) + "\n"


def render_fidelity_md(entries: list[dict[str, Any]]) -> str:
    head = ("# Offline attention fidelity\n\nGenerated by `python scripts/eval_longctx.py fidelity` "
            "(`harness/eval/fidelity.py`): every layer's post-RoPE q/k/v from one dense HF forward pass "
            "(float32, CPU), SGLang's chunked prefill replayed with the library; windows (a chunk's tokens in one "
            "union window, as the server cuts them) go sparse from `min_context` tokens of context on, outside each "
            "method's dense tail. Density: pages the sparse windows read over their context pages (compact: after the "
            "group and window unions and the forced pages), per-(head, q-block) cells incl. sink/recent/own window "
            "pages (blocksparse, no union), kept prefix tokens "
            "(quoka). Recall: attention mass (dense softmax over each query's causal context) on the keys read. "
            "Error: relative Frobenius error of the chunk's attention output vs dense. Entries with `min_prefix_len` "
            "(no `min_context`) come from the earlier design (a chunk's query blocks unioned, prefix-only recall, "
            "post-union prefix density). Per-layer values are in fidelity.json.\n\n")
    return head + "\n".join(fidelity_markdown(e, f"{e.get('model', '?')}: {e.get('task', '?')} "
                                               f"#{e.get('index', 0)} at {e.get('length', e['num_tokens'])}")
                             for e in entries)
