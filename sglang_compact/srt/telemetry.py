"""Telemetry of the compact path: per-layer densities, the gate's decisions, per forward pass.

Device scalars are kept as they are produced and read (one sync) only when the
forward pass's summary is asked for, so recording costs nothing on the hot
path; nothing is computed at all unless `/metrics` or debug logging reads it.

With `--enable-metrics`, `CompactMetrics` publishes each summary to SGLang's
`/metrics` (SGLang runs prometheus_client in multiprocess mode, see
`srt/compat.py`: metrics created here, in the scheduler process, are
aggregated by the HTTP server's collector with nothing else wired). They are
created unregistered (`registry=None`): in multiprocess mode the files are what
is read, and a second backend in the same process cannot clash on the default
registry.

Series (labels: SGLang's `model_name`, `tp_rank`, plus those below):
  sglang:compact_density{layer}             gauge, latest sparse forward pass: pages its sparse windows read
                                            over their context pages (1.0 for a layer that read every page
                                            before the pass's observing layer; windows that turned dense by
                                            their observed density count as reading every page)
  sglang:compact_density_forward            histogram, per sparse forward pass (mean over its layers, those
                                            that read every page included); a pass the gate made sparse
                                            whose windows all turned dense counts, at 1.0
  sglang:compact_coverage                   gauge, min over layers of the latest sparse pass: fraction of the
                                            selector's pages a density cap kept (1.0 without a cap)
  sglang:compact_forward_passes_total       counter, sparse forward passes (some q-block read a selection, or
                                            turned dense by its observed density)
  sglang:compact_qblocks_total{path}        counter, q-blocks (one page of a chunk) by path: `sparse`,
                                            `dense_context` (context below the gate's min_context),
                                            `dense_tail` (in the prompt's dense tail), `dense` (selector dense),
                                            `dense_density` (its window's selection read more than the gate's
                                            dense_above at the pass's observing layer)
  sglang:compact_tokens_total               counter, tokens of sparse q-blocks
  sglang:compact_prompt_pages_total         counter, context pages (per kv head) of every window of every extend
                                            pass, sparse or dense: the pages dense attention would read
  sglang:compact_prompt_pages_read_total    counter, the pages those windows read (mean over layers; a dense
                                            window reads all of its): read / total between two scrapes is the
                                            prompts' page-weighted density, every chunk and the dense tail
                                            counted (each pass weighs by its context, as its attention costs)
  sglang:compact_gate_min_context           gauge, context (tokens) from which q-blocks go sparse; -1: never
  sglang:compact_gate_dense_above           gauge, density above which a sparse window reads every page (1: never)
  sglang:compact_recall                     gauge, latest measured pass (`--compact-recall-every`): mean over its
                                            sparse windows of the attention mass their selection reads (one
                                            layer, one kv head, each window's last query; 1.0: nothing missed)
  sglang:compact_recall_min                 gauge, the same pass's lowest window
  sglang:compact_recall_forward             histogram, every measured pass's mean recall (its _sum / _count
                                            between two scrapes: the mean recall of the requests in between)
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sglang_compact.telemetry")

DENSITY_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
RECALL_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
PATHS = ("sparse", "dense_context", "dense_tail", "dense", "dense_density")


class CompactMetrics:
    """Prometheus series of the compact path, fed one forward-pass summary at a time."""

    def __init__(self, labels: dict, num_layers: int, min_context: int | None, dense_above: float = 1.0):
        from prometheus_client import Counter, Gauge, Histogram  # after PROMETHEUS_MULTIPROC_DIR is set

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        kw = dict(registry=None)
        density = Gauge("sglang:compact_density", "Pages the sparse rows read over their context pages, per layer "
                        "(latest sparse forward pass).", labelnames=names + ["layer"], multiprocess_mode="mostrecent",
                        **kw)
        forward = Histogram("sglang:compact_density_forward", "Density of a sparse forward pass (mean over layers).",
                            labelnames=names, buckets=DENSITY_BUCKETS, **kw)
        coverage = Gauge("sglang:compact_coverage", "Fraction of the selector's pages the density cap kept (min "
                         "over layers, latest sparse forward pass); 1.0 without a cap.", labelnames=names,
                         multiprocess_mode="mostrecent", **kw)
        passes = Counter("sglang:compact_forward_passes", "Sparse forward passes (the gate made a q-block sparse).",
                         labelnames=names, **kw)
        qblocks = Counter("sglang:compact_qblocks", "Chunk q-blocks (the chunk's tokens in one page) by path.",
                          labelnames=names + ["path"], **kw)
        tokens = Counter("sglang:compact_tokens", "Tokens of sparse q-blocks.", labelnames=names, **kw)
        prompt_pages = Counter("sglang:compact_prompt_pages", "Context pages (per kv head) of every window of every "
                               "extend pass.", labelnames=names, **kw)
        prompt_read = Counter("sglang:compact_prompt_pages_read", "Pages the windows of every extend pass read "
                              "(mean over layers; dense windows read all of theirs).", labelnames=names, **kw)
        recall = Gauge("sglang:compact_recall", "Attention mass the selection reads (mean over the sparse windows "
                       "of the latest measured pass; --compact-recall-every).", labelnames=names,
                       multiprocess_mode="mostrecent", **kw)
        recall_min = Gauge("sglang:compact_recall_min", "Attention mass the selection reads (lowest window of the "
                           "latest measured pass).", labelnames=names, multiprocess_mode="mostrecent", **kw)
        recall_forward = Histogram("sglang:compact_recall_forward", "Attention mass the selection reads (mean over "
                                   "the sparse windows of each measured pass).", labelnames=names,
                                   buckets=RECALL_BUCKETS, **kw)
        gate = Gauge("sglang:compact_gate_min_context", "Context (tokens) from which q-blocks read a selection; "
                     "-1: never.", labelnames=names, multiprocess_mode="mostrecent", **kw)
        above = Gauge("sglang:compact_gate_dense_above", "Density (at the pass's observing layer) above which a sparse "
                      "window reads every page; 1: never.", labelnames=names, multiprocess_mode="mostrecent", **kw)
        # label children resolved once: the per-forward update is plain float writes
        self._density = {layer: density.labels(**self.labels, layer=str(layer)) for layer in range(num_layers)}
        self._forward = forward.labels(**self.labels)
        self._coverage = coverage.labels(**self.labels)
        self._passes = passes.labels(**self.labels)
        self._qblocks = {p: qblocks.labels(**self.labels, path=p) for p in PATHS}
        self._tokens = tokens.labels(**self.labels)
        self._prompt_pages = prompt_pages.labels(**self.labels)
        self._prompt_read = prompt_read.labels(**self.labels)
        self._recall = recall.labels(**self.labels)
        self._recall_min = recall_min.labels(**self.labels)
        self._recall_forward = recall_forward.labels(**self.labels)
        gate.labels(**self.labels).set(-1 if min_context is None else min_context)
        above.labels(**self.labels).set(dense_above)

    def observe(self, summary: dict) -> None:
        for path, n in summary["qblocks"].items():
            if n:
                self._qblocks[path].inc(n)
        if summary["context_pages"]:
            self._prompt_pages.inc(summary["context_pages"])
            self._prompt_read.inc(summary["read_pages"])
        if summary["density"] is None:
            return
        for layer, value in summary["per_layer"].items():
            child = self._density.get(layer)
            if child is not None:
                child.set(value)
        self._forward.observe(summary["density"])
        self._coverage.set(summary["coverage"])
        self._passes.inc()
        self._tokens.inc(summary["sparse_tokens"])
        if summary["recall"] is not None:
            self._recall.set(summary["recall"])
            self._recall_min.set(summary["recall_min"])
            self._recall_forward.observe(summary["recall"])


def metrics_for(enable_metrics: bool, labels: dict, num_layers: int, min_context: int | None,
                dense_above: float = 1.0):
    """`CompactMetrics` when the server runs with `--enable-metrics`, else None (no cost)."""
    if not enable_metrics:
        return None
    try:
        return CompactMetrics(labels, num_layers, min_context, dense_above)
    except Exception as e:  # never let telemetry stop the server
        logger.warning("sglang_compact: metrics disabled: %s", e)
        return None


class CompactTelemetry:
    def __init__(self, num_layers: int, metrics: CompactMetrics | None = None):
        self.num_layers = num_layers
        self.metrics = metrics
        self._density: dict[int, torch.Tensor] = {}
        self._coverage: dict[int, torch.Tensor] = {}
        self._recall: torch.Tensor | None = None
        self._read_all: set[int] = set()
        self._pass: dict | None = None
        self.totals = {"forward_passes": 0, "sparse_qblocks": 0, "sparse_tokens": 0}
        self.last_summary: dict | None = None

    def wants_stats(self) -> bool:
        """Whether densities will be read (metrics on, or debug logging); when not, layers skip them."""
        return self.metrics is not None or logger.isEnabledFor(logging.DEBUG)

    def begin_forward(self, prefix_lens, chunk_lens, qblock_paths: dict[str, int], sparse_tokens: int,
                      pages: tuple[int, int] = (0, 0), context_pages: int = 0) -> None:
        """A new extend pass: flushes the previous one. `qblock_paths`: q-blocks per path (see PATHS); `pages`:
        context pages (per kv head) of its sparse windows and of those that turned dense by their density;
        `context_pages`: of all its windows (pages 0..last of each, per kv head), the dense ones included."""
        self.flush()
        self._pass = dict(prefix_lens=list(prefix_lens), chunk_lens=list(chunk_lens),
                          qblocks={p: int(qblock_paths.get(p, 0)) for p in PATHS}, sparse_tokens=int(sparse_tokens),
                          pages=tuple(pages), context_pages=int(context_pages))

    def update_paths(self, qblock_paths: dict[str, int], sparse_tokens: int, pages: tuple[int, int] = (0, 0)) -> None:
        """The current pass's paths after windows turned dense at its observing layer."""
        if self._pass is not None:
            self._pass.update(qblocks={p: int(qblock_paths.get(p, 0)) for p in PATHS}, sparse_tokens=int(sparse_tokens),
                              pages=tuple(pages))

    def record_recall(self, values: torch.Tensor | None) -> None:
        """The mass recall of this pass's sparse windows (float [S], device), from the one layer measured."""
        self._recall = values

    def record(self, layer: int, density: torch.Tensor | None, coverage: torch.Tensor | None = None) -> None:
        if density is not None:
            self._density[layer] = density
        if coverage is not None:
            self._coverage[layer] = coverage

    def record_read_all(self, layer: int) -> None:
        """A layer of a sparse pass that read every page of its windows (those before the pass's observing
        layer): density 1.0, counted in the pass's density when some later layer selected."""
        self._read_all.add(layer)

    def flush(self) -> dict | None:
        """Summarise the previous forward pass: one device->host copy of all its scalars, and none at all
        when neither metrics nor debug logging would use them."""
        p, self._pass = self._pass, None
        density, coverage, recall, read_all = self._density, self._coverage, self._recall, self._read_all
        self._density, self._coverage, self._recall, self._read_all = {}, {}, None, set()
        if p is None or not self.wants_stats():
            return None
        layers = sorted(density)
        scalars = [density[i] for i in layers] + list(coverage.values())
        if recall is not None:
            scalars += [recall.mean(), recall.min()]
        values = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in scalars]).tolist() if scalars else []
        recall_mean, recall_min = values[-2:] if recall is not None else (None, None)
        if recall is not None:
            values = values[:-2]
        per_layer = dict(zip(layers, values[:len(layers)]))
        sparse_pages, dense_pages = p.get("pages", (0, 0))
        if dense_pages:
            # windows that turned dense by their observed density read every page of their context: weighted by
            # pages into each selecting layer's density, and a pass whose windows all turned dense read 1.0
            # in every layer (what it read, so a mean over such passes is not left to the sparse ones)
            per_layer = {i: (x * sparse_pages + dense_pages) / (sparse_pages + dense_pages)
                         for i, x in per_layer.items()} if sparse_pages else dict.fromkeys(range(self.num_layers), 1.0)
        if per_layer:
            per_layer = dict(sorted({**per_layer, **dict.fromkeys(read_all, 1.0)}.items()))
        density = sum(per_layer.values()) / len(per_layer) if per_layer else None
        total = p.get("context_pages", 0)
        selecting = min(sparse_pages + dense_pages, total) if density is not None else 0
        summary = dict(p, per_layer=per_layer, density=density, coverage=min(values[len(layers):], default=1.0),
                       recall=recall_mean, recall_min=recall_min, context_pages=total,
                       # the windows of the pass's density read that share of theirs, the others all of theirs
                       read_pages=(density or 0.0) * selecting + (total - selecting))
        if summary["density"] is not None:
            self.totals["forward_passes"] += 1
            self.totals["sparse_tokens"] += p["sparse_tokens"]
        self.totals["sparse_qblocks"] += p["qblocks"]["sparse"]
        self.last_summary = summary
        if logger.isEnabledFor(logging.DEBUG):
            d = summary["density"]
            r = summary["recall"]
            logger.debug("compact pass: prefix=%s chunk=%s q-blocks %s density %s coverage %.3f recall %s",
                         p["prefix_lens"], p["chunk_lens"], p["qblocks"], "n/a" if d is None else f"{d:.3f}",
                         summary["coverage"], "n/a" if r is None else f"{r:.3f} (min {summary['recall_min']:.3f})")
        if self.metrics is not None:
            try:
                self.metrics.observe(summary)
            except Exception as e:  # never let telemetry stop the server
                logger.warning("sglang_compact: metrics update failed, disabling them: %s", e)
                self.metrics = None
        return summary
