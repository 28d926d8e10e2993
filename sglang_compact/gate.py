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
attention it replaces. A sparse pass is priced whole (`SparsePassLayers`): a
first layer that reads every page on the dense kernel (passes that observe
their density) and the `dense_layers`, which read every page through the
rows, save nothing. The smallest context from which the pass is predicted
faster (by `margin`) for this model's heads and the server's chunk size is
where the gate opens; `dense_above` likewise prices the layers left after the
observing layer, dense layers included. The model's coefficients are measured per GPU by
`scripts/gpu/calibrate_gate.py` and shipped in `data/cost_model.json`; a GPU
without its own borrows the nearest calibrated one's (`cost_model_for`). The search
term is the FlashPrefill kernel's on mean keys, or on key bounds for a selector
that reads them (`quest_budget`: two dot products per page tile,
`CostModel.search_model`). A selector whose search nothing calibrated prices
(`SelectorSpec.priced_search` false: `mass_budget`, `xattention`, `oracle`; or
key bounds on a GPU whose model lacks their throughput) gets the fixed
fallback context and no observed-density fallback.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from importlib import resources

from sglang_compact.batch import cdiv

logger = logging.getLogger(__name__)

#: the gate where no cost model applies (the CPU path; a selector whose search the model does not price)
FALLBACK_MIN_CONTEXT = 4096
NEVER = 1 << 62


@dataclass(frozen=True)
class ModelShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


@dataclass(frozen=True)
class SparsePassLayers:
    """How the layers of a sparse forward pass spend their time: `total` layers, of which the first
    `dense_first` read every page on the dense kernel (1 when the pass observes its density at its second
    layer, `OBSERVING_LAYER`), `read_all` read every page through the rows (`--compact-dense-layers`), and the
    rest select."""

    total: int
    dense_first: int = 0
    read_all: int = 0

    def __post_init__(self):
        if self.total < 1 or self.dense_first < 0 or self.read_all < 0 or self.dense_first + self.read_all > self.total:
            raise ValueError(f"SparsePassLayers: {self.dense_first} dense-first and {self.read_all} read-all layers "
                             f"do not fit {self.total} layers")

    @property
    def selecting(self) -> int:
        return self.total - self.dense_first - self.read_all

    @classmethod
    def of(cls, config, num_layers: int, observes: bool) -> "SparsePassLayers":
        """A server's sparse passes: `observes` when its rows are not fixed from the lengths alone and it reads
        its density at the observing layer (the fallback, or a selector fixing its rows there)."""
        from sglang_compact.config import OBSERVING_LAYER
        first = 1 if observes and num_layers > OBSERVING_LAYER else 0
        read_all = sum(1 for x in config.dense_layers if first <= x < num_layers)
        return cls(num_layers, first, read_all)


@dataclass(frozen=True)
class CostModel:
    """Per-layer time model of one GPU, fitted from measurements (seconds, FLOP/s).

    dense_flops / rows_flops: attention throughput of FlashInfer's paged prefill per kernel ("fa2", "fa3"),
        dense (all heads per request) and in rows (one kv head, G query heads, selected pages);
    search_flops: the FlashPrefill search kernel's throughput on mean keys;
    bounds_search_flops: its throughput on key bounds (q+ . kmax + q- . kmin: two dot products per page
        tile); 0: not measured on this GPU, so a selector that reads the bounds is not priced;
    sparse_gpu_s: GPU time per layer the sparse path adds whatever the sizes (index kernel, copies);
    sparse_host_s / dense_host_s: host time to launch one layer of each path (a layer takes at least this);
    margin: the sparse path must be predicted this much faster;
    capability / multiprocessors: the GPU's compute capability ("9.0") and SM count, by which a GPU without a
        model of its own borrows this one (`cost_model_for`).
    """

    gpu: str
    dense_flops: dict = field(default_factory=dict)
    rows_flops: dict = field(default_factory=dict)
    search_flops: float = 0.0
    bounds_search_flops: float = 0.0
    sparse_gpu_s: float = 0.0
    sparse_host_s: float = 0.0
    dense_host_s: float = 0.0
    margin: float = 0.1
    source: str = ""
    capability: str = ""
    multiprocessors: int = 0

    def search_model(self, key_bounds: bool) -> "CostModel | None":
        """This model priced for a selector's search: as it is for the mean-key search, with the key-bound
        search's throughput for `key_bounds`; None when that was not measured on this GPU."""
        if not key_bounds:
            return self
        if self.bounds_search_flops <= 0:
            return None
        return replace(self, search_flops=self.bounds_search_flops)

    def layer_times(self, shape: ModelShape, context: int, chunk: int, density: float, kernel: str,
                    query_stride: int = 1, forced_pages: int = 0,
                    rows_kernel: str | None = None, search: bool = True, min_pages: int = 0) -> tuple[float, float]:
        """(dense, sparse) seconds of one layer for a chunk of `chunk` tokens after `context` tokens; `kernel` runs
        the dense attention, `rows_kernel` (default: the same) the sparse rows; `search=False`: rows that read
        without selecting (a read-all layer); `min_pages`: the rows' page floor (a fixed budget's `min_pages`)."""
        H, D, P = shape.num_q_heads, shape.head_dim, shape.page_size
        attended = context + chunk / 2
        dense_gpu = 4.0 * chunk * attended * H * D / self.dense_flops[kernel]
        read = min(attended, max(density * attended + forced_pages * P, min_pages * P))
        search = 4.0 * (chunk / query_stride) * (attended / P) * H * D / self.search_flops if search else 0.0
        rows = self.rows_flops[rows_kernel or kernel]
        sparse_gpu = 4.0 * chunk * read * H * D / rows + search + self.sparse_gpu_s
        return max(self.dense_host_s, dense_gpu), max(self.sparse_host_s, sparse_gpu)

    def pass_times(self, shape: ModelShape, context: int, chunk: int, density: float, kernel: str,
                   layers: SparsePassLayers, query_stride: int = 1, forced_pages: int = 0,
                   rows_kernel: str | None = None, min_pages: int = 0) -> tuple[float, float]:
        """(dense, sparse) seconds of one forward pass of `layers.total` layers (as `layer_times`): a sparse pass's
        dense-first layers cost the dense layer, its read-all layers the rows over every page (no search)."""
        dense, sparse = self.layer_times(shape, context, chunk, density, kernel, query_stride, forced_pages,
                                         rows_kernel, min_pages=min_pages)
        _, read_all = self.layer_times(shape, context, chunk, 1.0, kernel, query_stride, 0, rows_kernel,
                                       search=False)
        return (layers.total * dense,
                layers.dense_first * dense + layers.read_all * read_all + layers.selecting * sparse)

    def break_even(self, shape: ModelShape, chunk: int, density: float, kernel: str, max_context: int,
                   query_stride: int = 1, forced_pages: int = 0, rows_kernel: str | None = None,
                   layers: SparsePassLayers | None = None, min_pages: int = 0) -> int | None:
        """Smallest context (a multiple of the page size) from which the sparse path is predicted faster by
        `margin` at every longer context up to `max_context`; None when it never is. `kernel`: the dense
        attention's; `rows_kernel`: the sparse rows' (default: the same); `layers`: price whole passes of
        these layers (default: one selecting layer)."""
        layers = layers or SparsePassLayers(1)
        if not layers.selecting:
            return None
        P = shape.page_size
        best = None
        for n in range(cdiv(max_context, P), 0, -1):
            dense, sparse = self.pass_times(shape, n * P, chunk, density, kernel, layers, query_stride, forced_pages,
                                            rows_kernel, min_pages)
            if sparse > (1 - self.margin) * dense:
                break
            best = n * P
        return best

    def break_even_density(self, shape: ModelShape, dense_kernel: str, rows_kernel: str,
                           query_stride: int = 1, layers: SparsePassLayers | None = None) -> float:
        """The density below which a window's sparse rows (search included, GPU time) are predicted faster than
        its dense attention by `margin`; per window both scale with its context, so one number serves every
        context. With `layers`, over the layers after the observing one (the decision is made there): its
        read-all layers cost the rows over every page and save nothing. 0.0 when the rows never pay."""
        rows = self.rows_flops[rows_kernel]
        dense = self.dense_flops[dense_kernel]
        search = rows / (query_stride * shape.page_size * self.search_flops) if self.search_flops else 0.0
        after = SparsePassLayers(1) if layers is None else layers
        left = after.total - after.dense_first            # the layers the decision is about
        selecting = left - after.read_all
        if left <= 0 or selecting <= 0:
            return 0.0
        # in rows-kernel time per unit of work: selecting * (d + search) + read_all < (1 - margin) * left * rows / dense
        budget = ((1 - self.margin) * left * rows / dense - after.read_all) / selecting
        return max(0.0, min(1.0, budget - search))


def load_cost_models() -> dict[str, CostModel]:
    text = resources.files("sglang_compact").joinpath("data/cost_model.json").read_text()
    return {name: CostModel(gpu=name, **entry) for name, entry in json.loads(text)["gpus"].items()}


def _capability(text: str) -> int | None:
    """"9.0" -> 90, "8.9" -> 89; None when unknown or not of that form."""
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        return None
    return 10 * major + minor


def cost_model_for(device_name: str | None, capability: str = "", multiprocessors: int = 0) -> CostModel | None:
    """The cost model calibrated on this GPU; else one calibrated on another, named as borrowed in its `gpu` and
    `source`:
    * a GPU of the same compute capability and SM count (an H100 SXM borrows the H200's: the same Hopper SMs,
      less memory bandwidth);
    * else the calibrated GPU nearest in compute capability, then in SM count. On a GPU of an older
      architecture, or of the same with no more SMs (an A100, an L40S, an H100 PCIe), attention is slower than
      where the model was measured, so the sparse path pays from a shorter context than the model predicts: the
      gate opens later than a calibration here would, which costs speed-up, not speed (the host's own speed is
      not priced apart: a slower host CPU delays the break-even on any GPU). On a newer or larger GPU
      it may open early: its source ends with `UNPRICED_FASTER_GPU` and the server warns at start.
    None when the device's capability is unknown (the CPU path): the gate's fixed fallback."""
    if not device_name:
        return None
    models = load_cost_models()
    if device_name in models:
        return models[device_name]
    mine = _capability(capability)
    if mine is None or multiprocessors <= 0:
        return None
    for m in models.values():
        if (m.capability, m.multiprocessors) == (capability, multiprocessors):
            return borrowed_from(m, device_name, f"the same compute capability {capability} and "
                                                 f"{multiprocessors} SMs")
    known = [m for m in models.values() if _capability(m.capability) is not None and m.multiprocessors > 0]
    if not known:
        return None
    m = min(known, key=lambda m: (abs(_capability(m.capability) - mine), abs(m.multiprocessors - multiprocessors)))
    theirs = _capability(m.capability)
    slower = mine < theirs or (mine == theirs and multiprocessors <= m.multiprocessors)
    here = (f"the nearest calibrated GPU (compute capability {capability} and {multiprocessors} SMs here, "
            f"{m.capability} and {m.multiprocessors} there)")
    return borrowed_from(m, device_name, here + (": attention is slower here, so the gate is expected to open "
                                                 "later than a calibration of this GPU would" if slower else
                                                 f": {UNPRICED_FASTER_GPU}"))


#: the end of a borrowed model's `source` on a GPU that may be faster than the one it was measured on
UNPRICED_FASTER_GPU = ("this GPU may be faster, so the gate may open before the sparse path pays: calibrate it "
                       "with scripts/gpu/calibrate_gate.py or set --compact-min-context")


def borrowed_from(model: CostModel, device_name: str, why: str) -> CostModel:
    """`model` applied to a GPU it was not calibrated on, its name and source saying so."""
    return replace(model, gpu=f"{model.gpu}, applied to {device_name}",
                   source=f"{model.source}; not calibrated on {device_name}: {why}")


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
                   kernel: str, max_context: int, rows_kernel: str | None = None,
                   num_layers: int | None = None, capability: str = "", multiprocessors: int = 0) -> "Gate":
        """The gate of a server: the flag, else the cost model of this GPU (or one borrowed by its `capability`
        and `multiprocessors`: `cost_model_for`), else the fallback. `kernel`: the dense passes' FlashInfer kernel;
        `rows_kernel`: the sparse rows' (default: the same); `num_layers`: the model's (its sparse passes are
        priced whole, `SparsePassLayers`; None: one selecting layer)."""
        spec = config.spec
        window = config.window_tokens(chunk_size)
        model = cost_model_for(device_name, capability, multiprocessors)
        if model is not None and model.source.endswith(UNPRICED_FASTER_GPU) and config.selector != "dense" \
                and config.min_context is None:
            logger.warning("sglang_compact: the cost gate prices %s with %s", device_name, model.source)
        priced = model.search_model(spec.uses_key_bounds) if model is not None and spec.priced_search else None
        rk = rows_kernel or kernel
        qs = config.params.query_stride_at(config.block_size)

        def pass_layers(falls_back: bool) -> SparsePassLayers | None:
            """A sparse pass's layers; `falls_back`: the observed-density fallback is on (dense_above < 1), so
            the pass's first layer reads every page to observe the density."""
            if num_layers is None:
                return None
            observes = not spec.fixes_row_lengths and (falls_back or spec.fixes_rows_at_observing_layer(config.params))
            return SparsePassLayers.of(config, num_layers, observes)

        above, above_source = None, ""
        if config.dense_above is None and priced is not None and config.selector != "dense":
            # the break-even density is what a pass that observes its density (the fallback on) must stay below
            above = priced.break_even_density(shape, kernel, rk, qs, pass_layers(True))
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
        if priced is None:
            what = "key-bound search (no bounds_search_flops for this GPU)" if spec.priced_search else "search"
            return gate(GateDecision(FALLBACK_MIN_CONTEXT, "fallback", f"the cost model does not price selector "
                                     f"{config.selector!r}'s {what}: min_context {FALLBACK_MIN_CONTEXT} "
                                     "(--compact-min-context sets another)"))
        model = priced
        density = spec.expected_density(config.params, num_layers)
        chunk = chunk_size if chunk_size and chunk_size > 0 else 8192
        forced = config.sink_blocks + config.recent_blocks + window // shape.page_size
        dense_above = above if above is not None else (1.0 if config.dense_above is None else config.dense_above)
        layers = pass_layers(dense_above < 1.0)
        # the rows' kernel, not the dense one: flashprefill's rows run on fa2 where the dense pass runs fa3
        floor = config.params.floor_pages(shape.page_size)
        be = model.break_even(shape, chunk, density, kernel, max_context, qs, forced, rk, layers, floor)
        passes = "" if layers is None else (f", passes of {layers.total} layers ({layers.dense_first} dense first, "
                                            f"{layers.read_all} read-all)")
        detail = (f"cost model {model.gpu} ({model.source}): heads {shape.num_q_heads}/{shape.num_kv_heads}, "
                  f"head_dim {shape.head_dim}, page {shape.page_size}, chunk {chunk}, expected density "
                  f"{density:.2f}{f' (at least {floor} pages)' if floor else ''}, {kernel} dense vs {rk} rows{passes}: ")
        if be is None:
            return gate(GateDecision(NEVER, "cost model", detail + f"never pays up to {max_context} tokens"))
        # The model prices a pass by its cached prefix, but windows are gated by their absolute start (what is
        # cached must not change the answer). Where a chunk holds several windows, starting at a whole chunk
        # keeps the sparse windows to passes the model priced: a prompt's first chunk (no cached prefix) stays
        # one dense pass, where a start inside it would make that pass mixed (measured slower than dense at
        # chunk 8192). With one window per chunk, `sparse_range` already starts at a whole window.
        start = cdiv(be, chunk_size) * chunk_size if chunk_size and chunk_size > window else be
        where = f"pays from {be} tokens of context" + (f"; sparse from {start} (whole chunks)" if start != be else "")
        return gate(GateDecision(start, "cost model", detail + where))

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


