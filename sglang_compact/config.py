"""`CompactConfig`: the one configuration object of CompactAttention.

Filled once (from `--compact-*` launch flags or by hand), validated once in
`__post_init__`; every other component takes it as is. The selector's own
parameters are a typed dataclass declared by the selector (`config.params`),
validated by the registry (`sglang_compact.selectors.registry`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from sglang_compact.selectors.registry import (SelectorParams, SelectorSpec, import_selector_modules,  # noqa: F401
                                               parse_layer_ids, selector_names, selector_spec)

PREFILL_KERNELS = ("auto", "fa2", "fa3", "sgl-fa3")
DENSE_KERNELS = ("auto", "flashinfer", "sgl-fa3")
PREFIX_CACHE_POLICIES = ("exact", "reuse")

#: The layer of a sparse forward pass (counted from the pass's first) that reads how many pages each row
#: selected, when the pass needs that (the gate's observed-density fallback, a selector that fixes its rows
#: there); the layers before it read every page: a first layer's attention is broad (SmolLM2: density 0.94 at
#: layer 0, 0.33-0.82 after), so its density would turn every window dense.
OBSERVING_LAYER = 1


def _fail(field_name: str, allowed: str, value: Any) -> None:
    raise ValueError(f"CompactConfig.{field_name}: {allowed}, got {value!r}")


@dataclass(frozen=True)
class CompactConfig:
    """What CompactAttention selects and where it switches on.

    Attributes:
        block_size: KV block size in tokens. Must equal the KV pool's page size
            (a block *is* a page; a q-block is the chunk's tokens in one page);
            a power of two in [16, 256].
        selector: pattern-search method, a registered selector name.
        selector_params: that selector's parameters: a mapping of overrides or
            the selector's parameter dataclass; stored as the dataclass
            (`params`), missing ones at their defaults.
        selector_modules: modules imported before the selector is looked up
            (selectors defined outside this package).
        sink_blocks: leading pages every q-block reads (attention sinks), >= 0.
        recent_blocks: pages before a window that it always reads, >= 0; the
            window's own pages are always read, causally.
        union_window: tokens of a union window (a multiple of block_size): the
            queries of one window, at absolute positions, share one page set
            (the union of their selections) and read it as one row of the paged
            kernel. None: min(1024, the chunk size) (`window_tokens`).
        min_context: q-blocks whose context (the tokens before them) is shorter
            than this read every page; None (the default) takes it from the cost
            gate (`sglang_compact.gate`): the context length from which the
            sparse path is predicted to be faster on this GPU for this model.
        dense_tail: the union windows holding the last `dense_tail` prompt
            tokens read every page (the question of a long-context prompt),
            >= 0; a prompt's last, partial window always does (windows are
            sparse only whole: `Gate.sparse_range`). 256 (the default) keeps
            at least the window holding a question of a few hundred tokens
            dense; each window more is a window of queries reading the whole
            prefix (1024 tokens of tail were 0.044 of a 32K prompt's page reads).
        dense_above: a sparse window whose selection at the pass's observing
            layer (its second: the first reads every page) reads more than
            this share of its context pages (mean over the kv heads) reads
            every page instead, in every layer: where the sparse
            rows would cost more than the dense pass they replace. In [0, 1]
            (1: never); None (the default): the cost model's break-even density
            on this GPU (`sglang_compact.gate`), never without one.
        dense_layers: model layers (ids, each after OBSERVING_LAYER) that read every page of their context in
            a sparse forward pass, their rows through the same paged kernel; the others select. For models
            whose selection loses its attention mass in a few layers (Qwen2.5-Coder-0.5B: its last ones, see
            docs/results/accuracy.md). Empty by default.
        density_cap: optional upper bound on each row's density, in (0, 1].
        prefill_kernel: the sparse rows' kernel on CUDA: FlashInfer's "fa2", "fa3" (Hopper; planned
            once per forward pass only when the row lengths are known on the host:
            dense passes, selectors that fix row lengths), "sgl-fa3" (the sparse rows on
            sgl_kernel's FA3, stock fa3's kernel, planned once for every selector; Hopper only),
            or "auto" (sgl-fa3 where it runs; else fa3 on sm90 where it is planned once, else fa2). Ignored on
            CPU.
        dense_kernel: the kernel of dense passes on CUDA: "sgl-fa3" (sgl_kernel's FA3, what stock SGLang's
            fa3 backend, its default on Hopper, runs; Hopper only), "flashinfer" (`prefill_kernel`'s), or
            "auto" (sgl-fa3 where it runs, else flashinfer). Ignored on CPU.
        recall_every: every `recall_every`-th sparse forward pass (0: never), one
            layer (in turn) measures the mass recall of its selection: for each
            sparse window, the share of the window's last query's attention (one
            kv head in turn, its group's first query head) that falls in the pages
            its row reads. Published on `/metrics` (`sglang:compact_recall`).
        prefix_cache: what the radix cache keeps and serves of a prompt (`srt/alignment.py`). "exact"
            (default): only KV computed as every longer prompt sharing it computes it cold, so a request's
            answer does not depend on what was cached before it; a prompt's dense tail, its last window and
            its output are not kept, and a conversation's next turn recomputes them. "reuse": everything, as
            stock SGLang keeps it (a hit is cut back to a window start only); a later prompt then reads KV
            that its cold run would have computed sparse (the earlier prompt's tail and output were computed
            dense), so its answer can depend on what is cached.
    """

    block_size: int = 64
    selector: str = "quest_budget"
    selector_params: Mapping[str, Any] | SelectorParams = field(default_factory=dict)
    selector_modules: tuple[str, ...] = ()
    sink_blocks: int = 2
    recent_blocks: int = 4
    union_window: int | None = None
    min_context: int | None = None
    dense_tail: int = 256
    dense_above: float | None = None
    dense_layers: tuple[int, ...] = ()
    density_cap: float | None = None
    prefill_kernel: str = "auto"
    dense_kernel: str = "auto"
    recall_every: int = 0
    prefix_cache: str = "exact"

    def __post_init__(self) -> None:
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or not 16 <= bs <= 256 or bs & (bs - 1):
            _fail("block_size", "must be a power of two in [16, 256] (equal to the KV page size)", bs)
        mods = self.selector_modules
        if isinstance(mods, str) or not all(isinstance(m, str) and m for m in mods):
            _fail("selector_modules", "must be a tuple of module names", mods)
        object.__setattr__(self, "selector_modules", tuple(mods))
        try:
            import_selector_modules(self.selector_modules)
            spec = selector_spec(self.selector)
        except ValueError as e:
            _fail("selector", f"must be one of {', '.join(selector_names())} ({e})", self.selector)
        for name, lo in (("sink_blocks", 0), ("recent_blocks", 0), ("dense_tail", 0), ("recall_every", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                _fail(name, f"must be an integer >= {lo}", v)
        uw = self.union_window
        if uw is not None and (isinstance(uw, bool) or not isinstance(uw, int) or uw < bs or uw % bs):
            _fail("union_window", f"must be a multiple of the block size {bs} (tokens), or None", uw)
        mc = self.min_context
        if mc is not None and (isinstance(mc, bool) or not isinstance(mc, int) or mc < 0):
            _fail("min_context", "must be an integer >= 0, or None (the cost gate decides)", mc)
        da = self.dense_above
        if da is not None and (isinstance(da, bool) or not isinstance(da, (int, float)) or not (0.0 <= da <= 1.0)
                               or math.isnan(da)):
            _fail("dense_above", "must be in [0, 1] or None (the cost model decides)", da)
        dl = self.dense_layers
        if isinstance(dl, (str, bytes)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in dl):
            _fail("dense_layers", "must be a tuple of layer ids (integers)", dl)
        if any(x <= OBSERVING_LAYER for x in dl):
            _fail("dense_layers", f"must be layers after {OBSERVING_LAYER} (a sparse pass's first layers are its own: "
                                  "the first reads every page when the pass observes its density, the next "
                                  "observes)", dl)
        object.__setattr__(self, "dense_layers", tuple(sorted(set(dl))))
        if self.prefix_cache not in PREFIX_CACHE_POLICIES:
            _fail("prefix_cache", f"must be one of {', '.join(PREFIX_CACHE_POLICIES)}", self.prefix_cache)
        if self.prefill_kernel not in PREFILL_KERNELS:
            _fail("prefill_kernel", f"must be one of {', '.join(PREFILL_KERNELS)}", self.prefill_kernel)
        if self.dense_kernel not in DENSE_KERNELS:
            _fail("dense_kernel", f"must be one of {', '.join(DENSE_KERNELS)}", self.dense_kernel)
        cap = self.density_cap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (0.0 < cap <= 1.0) or math.isnan(cap):
                _fail("density_cap", "must be in (0, 1] or None", cap)
            if self.selector == "dense":
                _fail("density_cap", "cannot be combined with selector 'dense' (use selector 'budget')", cap)
        object.__setattr__(self, "selector_params",
                           spec.params.validated(self.selector_params, "CompactConfig.selector_params"))
        if spec.name == "seer" and self.selector_params.gate_path is None:
            _fail("selector_params['gate_path']", "selector 'seer' needs a safetensors file of AttnGate weights", None)

    def window_tokens(self, chunk_size: int | None) -> int:
        """The union window in tokens: `union_window`, else min(DEFAULT, the chunk size), in whole pages."""
        from sglang_compact.batch import DEFAULT_WINDOW_TOKENS

        if self.union_window is not None:
            return self.union_window
        w = DEFAULT_WINDOW_TOKENS if not chunk_size or chunk_size <= 0 else min(DEFAULT_WINDOW_TOKENS, chunk_size)
        return max(self.block_size, w // self.block_size * self.block_size)

    @property
    def spec(self) -> SelectorSpec:
        return selector_spec(self.selector)

    @property
    def params(self) -> SelectorParams:
        """The selector's parameters (its typed dataclass)."""
        return self.selector_params

    def at_chunk(self, chunk_size: int | None) -> "CompactConfig":
        """This configuration as a server with this chunked-prefill size runs it (None or <= 0: chunked prefill
        off): the selector's parameters resolved for the chunk size (`SelectorParams.at_chunk`)."""
        params = self.params.at_chunk(chunk_size)
        return self if params is self.params else self.replace(selector_params=params)

    def replace(self, **changes: Any) -> "CompactConfig":
        if "selector" in changes and "selector_params" not in changes:
            changes["selector_params"] = {}
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line for logs: the selector, its parameters, and the rest."""
        p = ", ".join(f"{k}={v}" for k, v in self.params.as_dict().items())
        if getattr(self.params, "query_stride", None) == 0:
            p += f"; query stride {self.params.query_stride_at(self.block_size)} at this page size"
        gate = "auto" if self.min_context is None else self.min_context
        window = "auto" if self.union_window is None else self.union_window
        return (f"selector={self.selector!r}({p}), page {self.block_size}, sink {self.sink_blocks}, "
                f"recent {self.recent_blocks}, union_window {window}, min_context {gate}, dense_tail "
                f"{self.dense_tail}, dense_above {'auto' if self.dense_above is None else self.dense_above}, "
                f"density_cap {self.density_cap}, prefill_kernel {self.prefill_kernel}, dense_kernel {self.dense_kernel}"
                + (f", dense layers {','.join(map(str, self.dense_layers))}" if self.dense_layers else "")
                + (f", recall every {self.recall_every} sparse passes" if self.recall_every else "")
                + (f", prefix cache {self.prefix_cache}" if self.prefix_cache != "exact" else ""))
