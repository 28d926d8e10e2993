"""The cost gate: which windows read a selection, and which read every page.

A window (W tokens at absolute positions [k * W, (k + 1) * W), see `ChunkBatch`) goes sparse when

* the selector is not `dense`,
* its context (the tokens before it) is at least `min_context`, and
* it holds none of the prompt's dense tail (the last `dense_tail` prompt
  tokens: the question of a long-context prompt reads everything).

All three depend only on absolute positions and the server's configuration,
never on how a prompt was cut into chunks or batched, so a request's answer
does not depend on what was cached before it.

A sparse window whose selection turns out dense reads every page instead
(`dense_windows`): at the forward pass's observing layer (its second; the
first reads every page, its attention being broad), where its row would read
more than `dense_above` of its context pages (mean over the kv heads), the
window is dense in every layer of the pass. That density depends only on the
window's queries and the keys before it, so the decision too is independent of
chunking and batching. `dense_above` is `--compact-dense-above`, else the cost
model's break-even density (`CostModel.break_even_density`): where the rows'
kernel reading that share of the pages, plus the search, costs what the dense
kernel costs for all of them.

`min_context` is the `--compact-min-context` flag when given; otherwise the
break-even context of the cost model: per layer, the sparse path costs its
search, its attention over the expected density of pages (on the kernel its
rows run on, which may be slower than the dense pass's) and a fixed
overhead, on the GPU and on the host (launches), against the dense
attention it replaces; the smallest context from which it is predicted faster
(by `margin`) for this model's heads and the server's chunk size is where the
gate opens. The model's coefficients are measured per GPU by
`scripts/gpu/calibrate_gate.py` and shipped in `data/cost_model.json`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from importlib import resources

from sglang_compact.batch import cdiv

logger = logging.getLogger(__name__)

#: the gate on a device without a calibrated cost model (the CPU path, uncalibrated GPUs)
FALLBACK_MIN_CONTEXT = 4096
NEVER = 1 << 62


@dataclass(frozen=True)
class ModelShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


@dataclass(frozen=True)
class CostModel:
    """Per-layer time model of one GPU, fitted from measurements (seconds, FLOP/s).

    dense_flops / rows_flops: attention throughput of FlashInfer's paged prefill per kernel ("fa2", "fa3"),
        dense (all heads per request) and in rows (one kv head, G query heads, selected pages);
    search_flops: the FlashPrefill search kernel's throughput on mean keys;
    sparse_gpu_s: GPU time per layer the sparse path adds whatever the sizes (index kernel, copies);
    sparse_host_s / dense_host_s: host time to launch one layer of each path (a layer takes at least this);
    margin: the sparse path must be predicted this much faster.
    """

    gpu: str
    dense_flops: dict = field(default_factory=dict)
    rows_flops: dict = field(default_factory=dict)
    search_flops: float = 0.0
    sparse_gpu_s: float = 0.0
    sparse_host_s: float = 0.0
    dense_host_s: float = 0.0
    margin: float = 0.1
    source: str = ""

    def layer_times(self, shape: ModelShape, context: int, chunk: int, density: float, kernel: str,
                    query_stride: int = 1, forced_pages: int = 0,
                    rows_kernel: str | None = None) -> tuple[float, float]:
        """(dense, sparse) seconds of one layer for a chunk of `chunk` tokens after `context` tokens; `kernel` runs
        the dense attention, `rows_kernel` (default: the same) the sparse rows."""
        H, D, P = shape.num_q_heads, shape.head_dim, shape.page_size
        attended = context + chunk / 2
        dense_gpu = 4.0 * chunk * attended * H * D / self.dense_flops[kernel]
        read = min(attended, density * attended + forced_pages * P)
        search = 4.0 * (chunk / query_stride) * (attended / P) * H * D / self.search_flops
        rows = self.rows_flops[rows_kernel or kernel]
        sparse_gpu = 4.0 * chunk * read * H * D / rows + search + self.sparse_gpu_s
        return max(self.dense_host_s, dense_gpu), max(self.sparse_host_s, sparse_gpu)

    def break_even(self, shape: ModelShape, chunk: int, density: float, kernel: str, max_context: int,
                   query_stride: int = 1, forced_pages: int = 0, rows_kernel: str | None = None) -> int | None:
        """Smallest context (a multiple of the page size) from which the sparse path is predicted faster by
        `margin` at every longer context up to `max_context`; None when it never is. `kernel`: the dense
        attention's; `rows_kernel`: the sparse rows' (default: the same)."""
        P = shape.page_size
        best = None
        for n in range(cdiv(max_context, P), 0, -1):
            dense, sparse = self.layer_times(shape, n * P, chunk, density, kernel, query_stride, forced_pages,
                                             rows_kernel)
            if sparse > (1 - self.margin) * dense:
                break
            best = n * P
        return best

    def break_even_density(self, shape: ModelShape, dense_kernel: str, rows_kernel: str,
                           query_stride: int = 1) -> float:
        """The density below which a window's sparse rows (search included, GPU time) are predicted faster than
        its dense attention by `margin`; per window both scale with its context, so one number serves every
        context. 0.0 when the rows never pay."""
        rows = self.rows_flops[rows_kernel]
        search = rows / (query_stride * shape.page_size * self.search_flops) if self.search_flops else 0.0
        return max(0.0, min(1.0, (1 - self.margin) * rows / self.dense_flops[dense_kernel] - search))


def load_cost_models() -> dict[str, CostModel]:
    text = resources.files("sglang_compact").joinpath("data/cost_model.json").read_text()
    return {name: CostModel(gpu=name, **entry) for name, entry in json.loads(text)["gpus"].items()}


def cost_model_for(device_name: str | None) -> CostModel | None:
    if not device_name:
        return None
    return load_cost_models().get(device_name)


@dataclass(frozen=True)
class GateDecision:
    """Where the gate opens and why (logged at start, exported on /metrics)."""

    min_context: int            # NEVER when no q-block goes sparse
    source: str                 # "flag", "cost model", "fallback", "selector dense"
    detail: str

    @property
    def never(self) -> bool:
        return self.min_context >= NEVER


class Gate:
    """Per-window sparse-or-dense decisions of one server (see the module docstring)."""

    def __init__(self, config, decision: GateDecision, window_tokens: int | None = None,
                 dense_above: float | None = None, dense_above_source: str = ""):
        self.config = config
        self.decision = decision
        self.window = window_tokens or config.window_tokens(None)
        if dense_above is None:
            dense_above = 1.0 if config.dense_above is None else config.dense_above
            dense_above_source = dense_above_source or ("never" if config.dense_above is None else "flag")
        #: a sparse window whose selection at the observing layer reads more than this share of its pages reads
        #: every page
        self.dense_above = float(dense_above)
        self.dense_above_source = dense_above_source

    @property
    def observes_density(self) -> bool:
        """Whether a sparse window can still turn dense from its observed density (`dense_windows`)."""
        return self.dense_above < 1.0

    def dense_windows(self, qblocks, window_density) -> list[int]:
        """The sparse windows (indices into `qblocks`' windows) whose observed density (`window_density[w]`: the
        share of its context pages its row reads, mean over the kv heads) is above `dense_above`."""
        return [w for w, (s, d) in enumerate(zip(qblocks.w_sparse, window_density)) if s and d > self.dense_above]

    @classmethod
    def for_server(cls, config, shape: ModelShape, chunk_size: int | None, device_name: str | None,
                   kernel: str, max_context: int, rows_kernel: str | None = None) -> "Gate":
        """The gate of a server: the flag, else the cost model of this GPU, else the fallback. `kernel`: the
        dense passes' FlashInfer kernel; `rows_kernel`: the sparse rows' (default: the same)."""
        spec = config.spec
        window = config.window_tokens(chunk_size)
        model = cost_model_for(device_name)
        rk = rows_kernel or kernel
        above, above_source = None, ""
        if config.dense_above is None and model is not None and config.selector != "dense":
            qs = getattr(config.params, "query_stride", 1)
            above = model.break_even_density(shape, kernel, rk, qs)
            above_source = f"cost model {model.gpu}: {kernel} dense vs {rk} rows"

        def gate(decision):
            return cls(config, decision, window, above, above_source)
        if config.selector == "dense":
            return gate(GateDecision(NEVER, "selector dense", "selector 'dense' reads every page"))
        if config.min_context is not None:
            return gate(GateDecision(config.min_context, "flag", f"--compact-min-context {config.min_context}"))
        if model is None:
            return gate(GateDecision(FALLBACK_MIN_CONTEXT, "fallback", f"no cost model for "
                                     f"{device_name or 'this device'}: min_context {FALLBACK_MIN_CONTEXT}"))
        density = spec.expected_density(config.params)
        chunk = chunk_size if chunk_size and chunk_size > 0 else 8192
        qs = getattr(config.params, "query_stride", 1)
        forced = config.sink_blocks + config.recent_blocks + window // shape.page_size
        # the rows' kernel, not the dense one: the default selector's rows run on fa2 where the dense pass runs fa3
        be = model.break_even(shape, chunk, density, kernel, max_context, qs, forced, rk)
        detail = (f"cost model {model.gpu} ({model.source}): heads {shape.num_q_heads}/{shape.num_kv_heads}, "
                  f"head_dim {shape.head_dim}, page {shape.page_size}, chunk {chunk}, expected density "
                  f"{density:.2f}, {kernel} dense vs {rk} rows: ")
        if be is None:
            return gate(GateDecision(NEVER, "cost model", detail + f"never pays up to {max_context} tokens"))
        return gate(GateDecision(be, "cost model", detail + f"pays from {be} tokens of context"))

    def sparse_range(self, prompt_len: int | None) -> tuple[int, int]:
        """[lo, hi): the absolute windows that read a selection, for a prompt of `prompt_len` tokens (None:
        unknown, so no dense tail)."""
        if self.decision.never:
            return (0, 0)
        W = self.window
        lo = cdiv(self.decision.min_context, W)
        hi = NEVER if prompt_len is None else max(0, (prompt_len - self.config.dense_tail) // W)
        return (lo, max(lo, hi))

    def uses_compact_path(self, prefix_len: int, chunk_len: int, prompt_len: int | None = None) -> bool:
        """Whether any window of a chunk of `chunk_len` tokens after `prefix_len` reads a selection."""
        if chunk_len <= 0:
            return False
        lo, hi = self.sparse_range(prompt_len)
        first, last = prefix_len // self.window, (prefix_len + chunk_len - 1) // self.window
        return max(first, lo) < min(last + 1, hi)

    def describe(self) -> str:
        d = self.decision
        where = "never" if d.never else f"from {d.min_context} tokens of context"
        above = (f"windows reading more than {self.dense_above:.2f} of their pages at the observing layer read every "
                 f"page ({self.dense_above_source})" if self.observes_density else
                 f"no observed-density fallback ({self.dense_above_source})")
        return (f"sparse {where} ({d.source}: {d.detail}); {above}; union window {self.window} tokens; dense tail "
                f"{self.config.dense_tail} tokens")


def cost_model_json(models: dict[str, CostModel]) -> str:
    """The data file's text for a set of models (written by the calibration script)."""
    gpus = {m.gpu: {k: v for k, v in asdict(m).items() if k != "gpu"} for m in models.values()}
    return json.dumps({"gpus": gpus}, indent=1, sort_keys=True) + "\n"


