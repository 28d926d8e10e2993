"""A method's server flags and its accuracy.json label and params (`--start` presets, `--url`, `--start hf`)."""

from __future__ import annotations

import json
from typing import Any

START_PRESETS = ("cpu-dense", "cpu-compact", "cpu-compact-dense", "hf")
# the selector parameters a row records even when the method leaves them at their defaults: the ones a
# command line usually sets, and quest_budget's page floor (on by default: 2560 tokens)
RECORDED_DEFAULTS = {"flashprefill": ("alpha",), "xattention": ("threshold",), "oracle": ("top_p",),
                     "budget": ("density",), "mass_budget": ("density",), "quest_budget": ("density", "min_tokens")}


def selector_params(args) -> dict[str, Any]:
    params = json.loads(args.selector_params) if args.selector_params else {}
    for flag, name in (("alpha", "alpha"), ("threshold", "threshold"), ("top_p", "top_p"),
                       ("budget_density", "density")):
        v = getattr(args, flag, None)
        if v is not None:
            params[name] = v
    tail = getattr(args, "dense_tail", None)
    if tail is not None:
        params["dense_tail"] = tail
    return params


def compact_method(selector: str, params: dict[str, Any]):
    """The `fidelity.Method` of a compact server method: its `dense_tail` and `selector_params`."""
    from harness.eval.fidelity import Method
    return Method("compact", selector, tuple(sorted(params.items())))


def compact_server_args(selector: str, params: dict[str, Any], min_context: int, sink_blocks: int,
                        recent_blocks: int) -> list[str]:
    """`sglang_compact.launch_server` flags of a compact method (with `--enable-metrics`, for the density).
    `min_context`: the command lines' `--min-prefix-len` (windows with less context read every page)."""
    m = compact_method(selector, params)
    extra = ["--enable-metrics", "--attention-backend", "compact", "--compact-min-context", str(min_context),
             "--compact-sink-blocks", str(sink_blocks), "--compact-recent-blocks", str(recent_blocks),
             "--compact-selector", selector, "--compact-dense-tail", str(m.dense_tail)]
    sel_params = m.selector_params
    if sel_params:
        extra += ["--compact-selector-params", json.dumps(sel_params)]
    return extra + method_level_flags(m)


def file_label(spec: str) -> str:
    """A method spec as a file name (`compact:quest_budget:density=0.2` -> `compact_quest_budget_density0.2`)."""
    return spec.replace(":", "_").replace("=", "").replace(",", "_").replace("/", "_")


def method_level_flags(m) -> list[str]:
    """The server flags of a compact `fidelity.Method`'s method-level parameters, where given: dense_layers,
    dense_above, density_cap."""
    flags = []
    if m.dense_layers:
        flags += ["--compact-dense-layers", ",".join(map(str, m.dense_layers))]
    if m.dense_above is not None:
        flags += ["--compact-dense-above", str(m.dense_above)]
    if m.density_cap is not None:
        flags += ["--compact-density-cap", str(m.density_cap)]
    return flags


def compact_method_params(selector: str, params: dict[str, Any], *, chunk: int, page_size: int,
                          min_context: int, sink_blocks: int, recent_blocks: int) -> tuple[str, dict[str, Any]]:
    """(method label, row params) of a compact server: the selector's parameters (defaults filled in), its
    dense tail and the chunking / gate / forced-page settings."""
    params = {} if selector == "dense" else {**params, "dense_tail": compact_method(selector, params).dense_tail}
    if selector in RECORDED_DEFAULTS:
        from sglang_compact.selectors.registry import selector_spec
        # what the server runs at this chunk size: a default `density` can depend on it (`chunk_density`)
        spec = selector_spec(selector)
        given = {k: v for k, v in params.items() if k in {f.name for f in spec.params.fields()}}
        resolved = spec.params.validated(given, f"compact:{selector}").at_chunk(chunk)
        for name in RECORDED_DEFAULTS[selector]:
            if params.get(name) != getattr(resolved, name):   # not given, or moved by the chunk rule
                params[name] = getattr(resolved, name)
    params.update(chunk=chunk, page_size=page_size, min_context=min_context, sink_blocks=sink_blocks,
                  recent_blocks=recent_blocks)
    return f"compact-{selector}", params


def hf_method_params(hf_method: str, *, chunk: int, page_size: int, min_context: int, sink_blocks: int,
                     recent_blocks: int, dtype: str = "float32") -> tuple[str, dict[str, Any]]:
    """(method label, row params) of an in-process HF run (`--start hf --hf-method M`)."""
    from harness.eval.fidelity import parse_method
    m = parse_method(hf_method)
    name = "dense" if m.kind == "dense" else ("quoka" if m.kind == "quoka" else f"{m.kind}-{m.selector}")
    params = {**dict(m.params), "runner": "hf", "chunk": chunk, "page_size": page_size,
              "min_context": min_context, "sink_blocks": sink_blocks, "recent_blocks": recent_blocks}
    if m.kind in ("compact", "blocksparse") or m.dense_tail:
        params["dense_tail"] = m.dense_tail
    if dtype != "float32":
        params["dtype"] = dtype
    return name, params


def method_and_params(args) -> tuple[str, dict[str, Any]]:
    if args.start == "hf":
        return hf_method_params(args.hf_method, chunk=args.chunk, page_size=args.page_size,
                                min_context=args.min_prefix_len, sink_blocks=args.sink_blocks,
                                recent_blocks=args.recent_blocks, dtype=getattr(args, "hf_dtype", "float32"))
    if args.start == "cpu-dense":
        return "dense", {"backend": "torch_native", "chunk": args.dense_chunk or max(args.lengths),
                         "page_size": args.page_size}
    if args.start in ("cpu-compact", "cpu-compact-dense"):
        sel = "dense" if args.start == "cpu-compact-dense" else args.selector
        return compact_method_params(sel, {} if sel == "dense" else selector_params(args), chunk=args.chunk,
                                     page_size=args.page_size, min_context=args.min_prefix_len,
                                     sink_blocks=args.sink_blocks, recent_blocks=args.recent_blocks)
    return args.method, json.loads(args.params) if args.params else {}
