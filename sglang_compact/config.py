"""`CompactConfig`: the one configuration object of CompactAttention.

Filled once (from `--compact-*` launch flags or by hand), validated once in
`__post_init__`; every other component takes it as is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

SELECTOR_NAMES = ("flashprefill", "xattention", "oracle", "dense", "budget", "seer")
PREFILL_KERNELS = ("auto", "fa2", "fa3")

# Per-selector parameters: name -> (default, min, max, kind). Bounds are inclusive.
SELECTOR_PARAMS: dict[str, dict[str, tuple[Any, float, float, type]]] = {
    "flashprefill": {"alpha": (0.4, 0.0, 1.0, float), "query_stride": (1, 1, 16, int)},
    "xattention": {"threshold": (0.9, 0.0, 1.0, float), "stride": (8, 1, 16, int)},
    "oracle": {"top_p": (0.95, 0.0, 1.0, float)},
    "dense": {},
    "budget": {"density": (0.3, 0.0, 1.0, float), "query_stride": (1, 1, 16, int)},
    "seer": {"threshold": (0.9, 0.0, 1.0, float), "gate_path": (None, 0, 0, str)},
}


def _fail(field_name: str, allowed: str, value: Any) -> None:
    raise ValueError(f"CompactConfig.{field_name}: {allowed}, got {value!r}")


@dataclass(frozen=True)
class CompactConfig:
    """What CompactAttention selects and when it switches on.

    Attributes:
        block_size: KV block size in tokens. Must equal the KV pool's page size
            (a block *is* a page); a power of two in [16, 256].
        selector: pattern-search method, one of `SELECTOR_NAMES`.
        selector_params: that selector's parameters (see `SELECTOR_PARAMS`);
            missing ones take their defaults.
        sink_blocks: leading prefix blocks always kept (attention sinks), >= 0.
        recent_blocks: trailing prefix blocks always kept, >= 1 (the last,
            possibly partial, prefix page is always attended).
        min_prefix_len: prefixes shorter than this (tokens) take the dense
            path, >= 0.
        density_cap: optional upper bound on the post-union density of each
            (request, kv-head) row, in (0, 1]; None for no cap.
        prefill_kernel: FlashInfer backend of the paged prefix attention on
            CUDA: "fa2" (one plan per forward pass, no host sync), "fa3"
            (Hopper; one plan per forward pass when the selector fixes every
            row's length on the host, e.g. `budget`; otherwise a plan per layer
            with a device->host sync), or "auto" (fa3 on sm90 for selectors
            that fix the row lengths other than `dense`, else fa2). Ignored on CPU.
        dense_final_chunk: a request's last prompt chunk (the one whose logits
            give the first output token: the question of a long-context
            prompt) reads its whole prefix; the earlier chunks take the
            compact path. One chunk of a long prompt, so little time; it counts
            as density 1.0 in the telemetry.
    """

    block_size: int = 64
    selector: str = "flashprefill"
    selector_params: Mapping[str, Any] = field(default_factory=dict)
    sink_blocks: int = 2
    recent_blocks: int = 4
    min_prefix_len: int = 4096
    density_cap: float | None = None
    prefill_kernel: str = "auto"
    dense_final_chunk: bool = True

    def __post_init__(self) -> None:
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or not 16 <= bs <= 256 or bs & (bs - 1):
            _fail("block_size", "must be a power of two in [16, 256] (equal to the KV page size)", bs)
        if self.selector not in SELECTOR_NAMES:
            _fail("selector", f"must be one of {', '.join(SELECTOR_NAMES)}", self.selector)
        for name, lo in (("sink_blocks", 0), ("recent_blocks", 1), ("min_prefix_len", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                _fail(name, f"must be an integer >= {lo}", v)
        if not isinstance(self.dense_final_chunk, bool):
            _fail("dense_final_chunk", "must be a bool", self.dense_final_chunk)
        if self.prefill_kernel not in PREFILL_KERNELS:
            _fail("prefill_kernel", f"must be one of {', '.join(PREFILL_KERNELS)}", self.prefill_kernel)
        cap = self.density_cap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (0.0 < cap <= 1.0) or math.isnan(cap):
                _fail("density_cap", "must be in (0, 1] or None", cap)
        object.__setattr__(self, "selector_params", self._validated_params())
        if cap is not None and self.selector == "dense":
            _fail("density_cap", "cannot be combined with selector 'dense' (use selector 'budget')", cap)

    def _validated_params(self) -> dict[str, Any]:
        spec = SELECTOR_PARAMS[self.selector]
        given = dict(self.selector_params or {})
        unknown = sorted(set(given) - set(spec))
        if unknown:
            allowed = ", ".join(spec) or "none"
            _fail("selector_params", f"unknown parameter(s) {unknown} for selector "
                  f"{self.selector!r} (allowed: {allowed})", given)
        out: dict[str, Any] = {}
        for name, (default, lo, hi, kind) in spec.items():
            v = given.get(name, default)
            fname = f"selector_params[{name!r}]"
            if kind is str:
                if v is not None and not isinstance(v, str):
                    _fail(fname, "must be a path string", v)
            elif kind is int:
                if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                    _fail(fname, f"must be an integer in [{lo}, {hi}]", v)
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not lo <= v <= hi:
                    _fail(fname, f"must be a number in [{lo}, {hi}]", v)
                v = float(v)
            out[name] = v
        if self.selector == "xattention" and out["stride"] & (out["stride"] - 1):
            _fail("selector_params['stride']", "must be a power of two in [1, 16]", out["stride"])
        qs = out.get("query_stride", 1)
        if qs & (qs - 1):
            _fail("selector_params['query_stride']", "must be a power of two in [1, 16]", qs)
        if self.selector == "seer" and out["gate_path"] is None:
            _fail("selector_params['gate_path']", "selector 'seer' needs a safetensors file of AttnGate weights", None)
        return out

    def param(self, name: str) -> Any:
        return self.selector_params[name]

    def replace(self, **changes: Any) -> "CompactConfig":
        return dataclasses.replace(self, **changes)

    def uses_compact_path(self, prefix_len: int, final_chunk: bool = False) -> bool:
        """Whether a chunk whose cached prefix has `prefix_len` tokens takes the compact path
        (`final_chunk`: it is the request's last prompt chunk, dense under `dense_final_chunk`)."""
        return prefix_len > 0 and prefix_len >= self.min_prefix_len and not (final_chunk and self.dense_final_chunk)
