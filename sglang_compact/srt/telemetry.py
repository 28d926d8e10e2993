"""Per-layer telemetry of the compact path: densities before/after the unions, per forward pass.

Device scalars are kept as they are produced and only read (one sync) when the
forward pass's summary is asked for, so recording costs nothing on the hot path.

With `--enable-metrics`, `CompactMetrics` publishes each summary to SGLang's
`/metrics`. SGLang 0.5.17 runs prometheus_client in multiprocess mode: the
launcher sets `PROMETHEUS_MULTIPROC_DIR` (`set_prometheus_multiproc_dir()` in
`_set_envs_and_config`) before it spawns the scheduler processes, every metric
a process creates writes its samples to mmap files in that folder, and the HTTP
server's `/metrics` (`add_prometheus_middleware`: a `MultiProcessCollector`)
aggregates the files of all processes. So metrics created here, in the
scheduler process that runs the model, show up on `/metrics` with nothing else
wired. They are created unregistered (`registry=None`): in multiprocess mode
the files are what is read, and a second backend in the same process cannot
clash with the first on the default registry.

Series (labels: SGLang's `model_name`, `tp_rank`, plus those below):
  sglang:compact_density{stage, layer}          gauge, latest compact forward pass;
      stage `selected` (before the unions), `after_q` (after the query-block union),
      `after_group` (after the kv-group union and the forced blocks: what the kernel reads)
  sglang:compact_density_forward{stage}         histogram, per forward pass (mean over layers)
  sglang:compact_coverage                       gauge, min over layers of the latest forward pass:
      fraction of the selector's (query block, head, kv block) cells whose block the
      union table keeps; 1.0 by construction unless a density cap drops blocks
  sglang:compact_forward_passes_total           counter, forward passes with a compact chunk or a dense final chunk
  sglang:compact_dense_final_chunks_total       counter, final prompt chunks that read their whole prefix
      (`dense_final_chunk`); a forward pass of only such chunks counts as density 1.0 above
  sglang:compact_chunks_total                   counter, request chunks that took the compact path
  sglang:compact_tokens_total                   counter, tokens of those chunks
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger("sglang_compact.telemetry")

STAGES = ("selected", "after_q", "after_group")
DENSITY_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def selection_coverage(mask: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Fraction of selected cells whose block the union table keeps (device scalar, no sync).

    Args:
        mask: bool [B, H_q, NQ, NKV] selector output; table: bool [B, H_kv, NKV].
    """
    group = mask.shape[1] // table.shape[1]
    kept_table = table.repeat_interleave(group, dim=1)[:, :, None, :]
    kept = (mask & kept_table).sum(dtype=torch.float64)
    return kept / mask.sum(dtype=torch.float64).clamp(min=1)


class CompactMetrics:
    """Prometheus series of the compact path, fed one forward-pass summary at a time."""

    def __init__(self, labels: dict[str, str], num_layers: int):
        from prometheus_client import Counter, Gauge, Histogram  # after PROMETHEUS_MULTIPROC_DIR is set

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)
        self.density = Gauge("sglang:compact_density",
                             "Compact path block density per layer and union stage (latest compact forward pass).",
                             labelnames=names + ["stage", "layer"], registry=None, multiprocess_mode="mostrecent")
        self.density_forward = Histogram("sglang:compact_density_forward",
                                         "Compact path block density per forward pass (mean over layers), "
                                         "per union stage.", labelnames=names + ["stage"], registry=None,
                                         buckets=DENSITY_BUCKETS)
        self.coverage = Gauge("sglang:compact_coverage",
                              "Fraction of the selector's blocks that the union table keeps (min over layers, "
                              "latest compact forward pass); 1.0 unless a density cap applies.",
                              labelnames=names, registry=None, multiprocess_mode="mostrecent")
        self.forward_passes = Counter("sglang:compact_forward_passes",
                                      "Forward passes with at least one compact chunk or dense final chunk.",
                                      labelnames=names, registry=None)
        self.dense_final_chunks = Counter("sglang:compact_dense_final_chunks",
                                          "Final prompt chunks that read their whole prefix (dense_final_chunk).",
                                          labelnames=names, registry=None)
        self.chunks = Counter("sglang:compact_chunks", "Request chunks that took the compact path.",
                              labelnames=names, registry=None)
        self.tokens = Counter("sglang:compact_tokens", "Tokens of the request chunks that took the compact path.",
                              labelnames=names, registry=None)
        # label children resolved once: the per-forward update is plain float writes
        self._density = {(stage, layer): self.density.labels(**self.labels, stage=stage, layer=str(layer))
                         for stage in STAGES for layer in range(num_layers)}
        self._density_forward = {s: self.density_forward.labels(**self.labels, stage=s) for s in STAGES}
        self._coverage = self.coverage.labels(**self.labels)
        self._forward_passes = self.forward_passes.labels(**self.labels)
        self._chunks = self.chunks.labels(**self.labels)
        self._tokens = self.tokens.labels(**self.labels)
        self._dense_final_chunks = self.dense_final_chunks.labels(**self.labels)

    def observe(self, summary: dict) -> None:
        for layer, values in summary["per_layer"].items():
            for stage in STAGES:
                child = self._density.get((stage, layer))
                if child is not None:
                    child.set(values[stage])
        for stage in STAGES:
            self._density_forward[stage].observe(summary[f"density_{stage}"])
        self._coverage.set(summary["coverage"])
        self._forward_passes.inc()
        self._chunks.inc(summary["compact_chunks"])
        self._tokens.inc(summary["compact_tokens"])
        self._dense_final_chunks.inc(summary.get("dense_final_chunks", 0))


def metrics_for_runner(model_runner, num_layers: int) -> CompactMetrics | None:
    """`CompactMetrics` when the server runs with `--enable-metrics`, else None (no cost)."""
    server_args = getattr(model_runner, "server_args", None)
    if not getattr(server_args, "enable_metrics", False):
        return None
    labels = {"model_name": server_args.served_model_name or server_args.model_path,
              "tp_rank": getattr(model_runner, "tp_rank", 0)}
    try:
        return CompactMetrics(labels, num_layers)
    except Exception as e:  # never let telemetry stop the server
        logger.warning("compact metrics disabled: %s", e)
        return None


class CompactTelemetry:
    def __init__(self, num_layers: int, metrics: CompactMetrics | None = None, coverage_needed: bool = False):
        """`coverage_needed`: a density cap may drop selected blocks, so coverage is measured
        (needs the selector's mask, see `wrap_select`); otherwise it is 1.0 by construction."""
        self.num_layers = num_layers
        self.metrics = metrics
        self.coverage_needed = coverage_needed and metrics is not None
        self._stats: dict[int, object] = {}
        self._coverage: dict[int, torch.Tensor] = {}
        self._last_mask: torch.Tensor | None = None
        self._batch: tuple | None = None
        self.totals = {"forward_passes": 0, "compact_rows": 0, "compact_tokens": 0, "dense_final_chunks": 0}
        self.last_summary: dict | None = None

    def wrap_select(self, select: Callable) -> Callable:
        """Wrap `CompactAttention.select` to keep the last mask when coverage is measured."""
        if not self.coverage_needed:
            return select

        def select_keeping_mask(*args, **kwargs):
            sel = select(*args, **kwargs)
            self._last_mask = sel.mask
            return sel
        return select_keeping_mask

    def wants_stats(self) -> bool:
        """Whether a forward pass's densities will be read (metrics on, or debug logging): when not,
        the layers skip computing them."""
        return self.metrics is not None or logger.isEnabledFor(logging.DEBUG)

    def begin_forward(self, prefix_lens, chunk_lens, compact_rows, dense_final_rows=None) -> None:
        self.flush()
        final = list(dense_final_rows) if dense_final_rows is not None else [False] * len(compact_rows)
        self._batch = (list(prefix_lens), list(chunk_lens), list(compact_rows), final)

    def record(self, layer: int, stats, table: torch.Tensor | None = None) -> None:
        self._stats[layer] = stats
        if self.coverage_needed and table is not None and self._last_mask is not None:
            self._coverage[layer] = selection_coverage(self._last_mask, table)
            self._last_mask = None

    def flush(self) -> dict | None:
        """Summarise the previous forward pass: one device->host copy of all its scalars,
        and none at all when neither metrics nor debug logging would use them."""
        if not self._stats or self._batch is None or not self.wants_stats():
            self._stats.clear()
            self._coverage.clear()
            return None
        layers = sorted(self._stats)
        stages = ("selected", "after_q", "after_group")
        scalars = [getattr(self._stats[layer], k) for layer in layers for k in stages]
        scalars += list(self._coverage.values())
        values = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in scalars]).tolist()
        per_layer = {layer: dict(zip(stages, values[3 * i:3 * i + 3])) for i, layer in enumerate(layers)}
        prefix, chunk, rows, final = self._batch
        mean = lambda k: sum(v[k] for v in per_layer.values()) / len(per_layer)  # noqa: E731
        coverage = min(values[3 * len(layers):], default=1.0)
        compact_chunks = sum(1 for r in rows if r)
        compact_tokens = sum(c for c, r in zip(chunk, rows) if r)
        summary = {
            "prefix_lens": prefix, "chunk_lens": chunk, "compact_rows": rows,
            "density_selected": mean("selected"), "density_after_q": mean("after_q"),
            "density_after_group": mean("after_group"), "per_layer": per_layer,
            "coverage": coverage, "compact_chunks": compact_chunks, "compact_tokens": compact_tokens,
            "dense_final_chunks": sum(1 for f in final if f),
        }
        self.totals["forward_passes"] += 1
        self.totals["compact_rows"] += compact_chunks
        self.totals["compact_tokens"] += compact_tokens
        self.totals["dense_final_chunks"] += summary["dense_final_chunks"]
        self.last_summary = summary
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("compact chunk: prefix=%s chunk=%s density selected=%.3f after_q=%.3f after_group=%.3f "
                         "coverage=%.3f", prefix, chunk, summary["density_selected"], summary["density_after_q"],
                         summary["density_after_group"], coverage)
        if self.metrics is not None:
            try:
                self.metrics.observe(summary)
            except Exception as e:  # never let telemetry stop the server
                logger.warning("compact metrics update failed, disabling them: %s", e)
                self.metrics = None
        self._stats.clear()
        self._coverage.clear()
        return summary
