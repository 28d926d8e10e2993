"""Offline attention-level fidelity of the selection methods on a real model's q/k/v.

1. `capture_qkv` runs a Hugging Face Llama-family model (float32, CPU) once,
   densely, on a prompt and records every layer's post-RoPE q, k, v (through a
   registered attention function that stores its inputs, then runs SDPA).
2. `simulate` replays SGLang's chunked prefill on those tensors (chunk C,
   page P): for every chunk whose cached prefix takes the compact path
   (prefix >= `min_prefix_len`), it builds a `ChunkBatch` over a head-major
   pool `[pages, H_kv, P, D]` and runs each `Method`:
     * `compact`: `CompactAttention` (selector -> block union -> plan ->
       torch paged executor), i.e. exactly the served path;
     * `blocksparse`: the selector's own per-(query block, head) mask plus the
       sink/recent blocks, executed without the unions
       (`reference_attention(block_mask=...)`);
     * `quoka`: `sglang_compact.quoka` (token-level, gathered);
     * `dense`: every block.
   and reports, per layer (means over the compact chunks):
     * `rel_err`: ||o - o_dense||_F / ||o_dense||_F over the chunk's outputs;
     * `recall`: attention mass (softmax over the prefix only) that the kept
       prefix keys carry, mean over queries and heads;
     * `density`: the fraction of prefix blocks read: post-union
       (`UnionStats.after_group`) for compact, per-query-block cells for
       blocksparse, kept tokens for quoka.

Every layer sees the dense model's activations (errors do not compound
across layers): this isolates each method's attention-level error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from sglang_compact.batch import ChunkBatch, cdiv
from sglang_compact.compact import CompactAttention
from sglang_compact.config import CompactConfig
from sglang_compact.execute import reference_attention
from sglang_compact.kernels.union_naive import forced_blocks
from sglang_compact.quoka import quoka_token_mask

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

@dataclass(frozen=True)
class Method:
    """kind: dense | compact | blocksparse | quoka; selector/params as in `CompactConfig`, plus
    `dense_final_chunk` (0/1: the prompt's last chunk reads its whole prefix; default: `CompactConfig`'s for
    compact and blocksparse, off for quoka, the baseline as published)."""

    kind: str
    selector: str = "dense"
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        if self.kind in ("dense",):
            return "dense"
        p = ",".join(f"{k}={v}" for k, v in self.params)
        if self.kind == "quoka":
            return f"quoka({p})"
        return f"{self.kind}-{self.selector}({p})"

    @property
    def dense_final_chunk(self) -> bool:
        given = dict(self.params).get("dense_final_chunk")
        if given is not None:
            if given not in (0, 1):
                raise ValueError(f"{self.label}: dense_final_chunk must be 0 or 1, got {given!r}")
            return bool(given)
        return CompactConfig.dense_final_chunk if self.kind in ("compact", "blocksparse") else False

    @property
    def selector_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.params if k != "dense_final_chunk"}

    def config(self, page_size: int, sink_blocks: int, recent_blocks: int, min_prefix_len: int) -> CompactConfig:
        sparse = self.kind in ("compact", "blocksparse")
        return CompactConfig(block_size=page_size, selector=self.selector if sparse else "dense",
                             selector_params=self.selector_params if sparse else {},
                             sink_blocks=sink_blocks, recent_blocks=recent_blocks, min_prefix_len=min_prefix_len,
                             dense_final_chunk=self.dense_final_chunk)


DENSE = Method("dense")


def parse_method(text: str) -> Method:
    """'compact:flashprefill:alpha=0.06', 'blocksparse:xattention:threshold=0.9', 'quoka:query_ratio=0.25,kv_budget=0.25',
    'dense'."""
    parts = text.split(":")
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
    return Method(kind, parts[1], tuple(sorted(params.items())))


def _parse_params(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else float(v)
    return out


DEFAULT_METHODS = (
    "dense",
    "compact:flashprefill:alpha=0.02", "compact:flashprefill:alpha=0.06", "compact:flashprefill:alpha=0.1",
    "compact:flashprefill:alpha=0.2",
    "compact:xattention:threshold=0.9", "compact:oracle:top_p=0.95", "compact:budget:density=0.3",
    "blocksparse:flashprefill:alpha=0.06", "blocksparse:xattention:threshold=0.9",
    "quoka:query_ratio=0.25,kv_budget=0.25",
)


# --- simulation ----------------------------------------------------------------------------------------

def head_major_pool(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """[T, H, D] tokens in order -> [ceil(T / P), H, P, D] pages (zero padded)."""
    T, H, D = x.shape
    n = max(cdiv(T, page_size), 1)
    pad = x.new_zeros(n * page_size, H, D)
    pad[:T] = x
    return pad.view(n, page_size, H, D).permute(0, 2, 1, 3).contiguous()


def chunk_starts(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, num_tokens)) for s in range(0, num_tokens, chunk)]


def _prefix_probs(batch: ChunkBatch) -> torch.Tensor:
    """float32 [H_q, C, L]: softmax over the prefix keys of each query (one request)."""
    L = batch.prefix_lens_cpu[0]
    k, _ = batch.prefix_keys()
    kk = k[0, :, :L].to(torch.float32).repeat_interleave(batch.group_size, dim=0)  # [H_q, L, D]
    q = batch.q.to(torch.float32).transpose(0, 1)  # [H_q, C, D]
    return torch.softmax(torch.matmul(q, kk.transpose(-1, -2)) * batch.sm_scale, dim=-1)


def run_method(method: Method, batch: ChunkBatch, layer: int, cfg: CompactConfig,
               compact: CompactAttention | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(output [C, H_q, D], allowed-prefix mask broadcastable to [H_q, C, L], density) for one request."""
    L, C = batch.prefix_lens_cpu[0], batch.chunk_lens_cpu[0]
    P, G = batch.page_size, batch.group_size
    tok_block = torch.arange(L) // P
    if method.kind == "dense":
        table = batch.kv_block_valid()[:, None, :].expand(1, batch.num_kv_heads, -1)
        return reference_attention(batch, table=table), torch.ones(1, 1, L, dtype=torch.bool), 1.0
    if method.kind == "compact":
        o, cp = compact.forward(batch, layer)
        allowed = cp.table[0].repeat_interleave(G, dim=0)[:, tok_block][:, None, :]  # [H_q, 1, L]
        return o, allowed, float(cp.stats.after_group)
    if method.kind == "blocksparse":
        sel = compact.select(batch, layer)
        kvb = batch.kv_blocks()
        forced = forced_blocks(kvb, sel.mask.shape[-1], cfg.sink_blocks, cfg.recent_blocks)  # [1, NKV]
        valid = batch.q_block_valid(P)[:, None, :, None] & batch.kv_block_valid()[:, None, None, :]
        mask = (sel.mask | forced[:, None, None, :]) & valid
        o = reference_attention(batch, block_mask=mask)
        q_blk = torch.arange(C) // P
        allowed = mask[0][:, q_blk][:, :, tok_block]  # [H_q, C, L]
        density = float(mask.sum()) / float(valid.sum() * batch.num_q_heads)
        return o, allowed, density
    if method.kind == "quoka":
        p = dict(method.params)
        tm = quoka_token_mask(batch, p["query_ratio"], p["kv_budget"])  # [1, H_kv, LP]
        o = reference_attention(batch, token_mask=tm)
        allowed = tm[0, :, :L].repeat_interleave(G, dim=0)[:, None, :]
        return o, allowed, float(tm[0, :, :L].float().mean())
    raise ValueError(f"unknown method kind {method.kind!r}")


@dataclass
class FidelityResult:
    methods: list[str]
    num_tokens: int
    chunk: int
    page_size: int
    min_prefix_len: int
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
                "page_size": self.page_size, "min_prefix_len": self.min_prefix_len,
                "compact_chunks": self.compact_chunks, "seconds": round(self.seconds, 1),
                "summary": self.summary(), "per_layer": self.per_layer}


@torch.no_grad()
def simulate(layers: Sequence[LayerQKV], methods: Iterable[Method | str], *, chunk: int = 256, page_size: int = 64,
             min_prefix_len: int = 512, sink_blocks: int = 2, recent_blocks: int = 4,
             density_only: bool = False, layer_ids: Sequence[int] | None = None,
             progress: Callable[[str], None] | None = None) -> FidelityResult:
    """Replay chunked prefill on captured q/k/v; see the module docstring.

    density_only: skip outputs and recall (selection + union only; fast).
    """
    methods = [parse_method(m) if isinstance(m, str) else m for m in methods]
    t0 = time.monotonic()
    T = layers[0].q.shape[0]
    spans = [(s, e) for s, e in chunk_starts(T, chunk) if s > 0 and s >= min_prefix_len]
    res = FidelityResult([m.label for m in methods], T, chunk, page_size, min_prefix_len, len(spans))
    engines = {}
    for m in methods:
        cfg = m.config(page_size, sink_blocks, recent_blocks, min_prefix_len)
        engines[m.label] = (cfg, CompactAttention(cfg) if m.kind in ("compact", "blocksparse") else None)
        res.per_layer[m.label] = {"density": []} if density_only else {"rel_err": [], "recall": [], "density": []}
    ids = range(len(layers)) if layer_ids is None else layer_ids
    for li in ids:
        lq = layers[li]
        k_pool = head_major_pool(lq.k, page_size)
        v_pool = head_major_pool(lq.v, page_size)
        page_table = torch.arange(k_pool.shape[0], dtype=torch.int32)[None]
        acc = {m.label: {k: [] for k in res.per_layer[m.label]} for m in methods}
        for s, e in spans:
            batch = ChunkBatch.build(lq.q[s:e], lq.k[s:e], lq.v[s:e], k_pool, v_pool, page_table, [s], [e - s],
                                     sm_scale=lq.scale)
            final = e >= T
            if density_only:
                for m in methods:
                    cfg, eng = engines[m.label]
                    if final and m.dense_final_chunk:
                        d = 1.0
                    elif m.kind == "compact":
                        d = float(eng.plan(batch, li).stats.after_group)
                    else:
                        _, _, d = run_method(m, batch, li, cfg, eng)
                    acc[m.label]["density"].append(d)
                continue
            probs = _prefix_probs(batch)  # [H_q, C, L]
            o_ref = None
            for m in methods:
                cfg, eng = engines[m.label]
                o, allowed, d = run_method(DENSE if final and m.dense_final_chunk else m, batch, li, cfg, eng)
                o = o.to(torch.float32)
                if o_ref is None:
                    o_ref = reference_attention(batch, table=batch.kv_block_valid()[:, None, :].expand(
                        1, batch.num_kv_heads, -1)).to(torch.float32)
                err = float((o - o_ref).norm() / o_ref.norm().clamp(min=1e-30))
                recall = float((probs * allowed).sum(-1).mean())
                a = acc[m.label]
                a["rel_err"].append(err)
                a["recall"].append(recall)
                a["density"].append(d)
        for m in methods:
            for k, v in acc[m.label].items():
                res.per_layer[m.label][k].append(sum(v) / len(v) if v else float("nan"))
        if progress:
            progress(f"layer {li}")
    res.seconds = time.monotonic() - t0
    return res


def offline_density(model, input_ids: Sequence[int], method: Method | str, *, chunk: int, page_size: int,
                    min_prefix_len: int, sink_blocks: int = 2, recent_blocks: int = 4) -> float | None:
    """Mean post-union prefix density (over layers and compact chunks) of one prompt; None when no chunk is compact."""
    layers = capture_qkv(model, input_ids)
    r = simulate(layers, [method], chunk=chunk, page_size=page_size, min_prefix_len=min_prefix_len,
                 sink_blocks=sink_blocks, recent_blocks=recent_blocks, density_only=True)
    if r.compact_chunks == 0:
        return None
    d = next(iter(r.per_layer.values()))["density"]
    d = [x for x in d if not math.isnan(x)]
    return sum(d) / len(d) if d else None


def fidelity_markdown(entry: dict[str, Any], title: str) -> str:
    """One `FidelityResult.as_dict()` (plus optional date/capture fields) as a markdown section."""
    e = entry
    when = f"{e['date']}, " if "date" in e else ""
    lines = [f"## {title}", "",
             f"{when}{e['num_tokens']} tokens, chunk {e['chunk']}, page {e['page_size']}; compact chunks (prefix >= "
             f"{e['min_prefix_len']}): {e['compact_chunks']}; means over layers and those chunks "
             f"(replay {e['seconds']:.0f} s)", "",
             "| method | density | recall (prefix mass) | rel. output error (mean / worst layer) |",
             "| --- | --- | --- | --- |"]
    for m, s in e["summary"].items():
        err = f"{s['rel_err']:.4f} / {s['rel_err_max_layer']:.4f}" if "rel_err" in s else "-"
        rec = f"{s['recall']:.4f}" if "recall" in s else "-"
        lines.append(f"| {m} | {s['density']:.3f} | {rec} | {err} |")
    return "\n".join(lines) + "\n"


def render_fidelity_md(entries: list[dict[str, Any]]) -> str:
    head = ("# Offline attention fidelity\n\nGenerated by `python scripts/eval_longctx.py fidelity` "
            "(`sglang_compact/eval/fidelity.py`): every layer's post-RoPE q/k/v from one dense HF forward pass "
            "(float32, CPU), SGLang's chunked prefill replayed with the library. Density: post-union fraction of "
            "prefix blocks (compact), selected (query block, prefix block) cells incl. sink/recent "
            "(blocksparse, no unions), kept prefix tokens (quoka). Recall: prefix attention mass (softmax over "
            "the prefix) on the kept keys. Error: relative Frobenius error of the chunk's attention output vs "
            "dense. Per-layer values are in fidelity.json.\n\n")
    return head + "\n".join(fidelity_markdown(e, f"{e.get('model', '?')}: {e.get('task', '?')} "
                                               f"#{e.get('index', 0)} at {e.get('length', e['num_tokens'])}")
                             for e in entries)
