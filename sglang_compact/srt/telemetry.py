"""Per-layer telemetry of the compact path: densities before/after the unions, per forward pass.

Device scalars are kept as they are produced and only read (one sync) when the
forward pass's summary is asked for, so recording costs nothing on the hot path.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sglang_compact.telemetry")


class CompactTelemetry:
    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._stats: dict[int, object] = {}
        self._batch: tuple | None = None
        self.totals = {"forward_passes": 0, "compact_rows": 0, "compact_tokens": 0}
        self.last_summary: dict | None = None

    def begin_forward(self, prefix_lens, chunk_lens, compact_rows) -> None:
        self.flush()
        self._batch = (list(prefix_lens), list(chunk_lens), list(compact_rows))

    def record(self, layer: int, stats) -> None:
        self._stats[layer] = stats

    def flush(self) -> dict | None:
        """Summarise the previous forward pass (reads the device scalars once)."""
        if not self._stats or self._batch is None:
            self._stats.clear()
            return None
        per_layer = {layer: s.as_floats() for layer, s in sorted(self._stats.items())}
        prefix, chunk, rows = self._batch
        mean = lambda k: sum(v[k] for v in per_layer.values()) / len(per_layer)  # noqa: E731
        summary = {
            "prefix_lens": prefix, "chunk_lens": chunk, "compact_rows": rows,
            "density_selected": mean("selected"), "density_after_q": mean("after_q"),
            "density_after_group": mean("after_group"), "per_layer": per_layer,
        }
        self.totals["forward_passes"] += 1
        self.totals["compact_rows"] += sum(rows)
        self.totals["compact_tokens"] += sum(c for c, r in zip(chunk, rows) if r)
        self.last_summary = summary
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("compact chunk: prefix=%s chunk=%s density selected=%.3f after_q=%.3f after_group=%.3f",
                         prefix, chunk, summary["density_selected"], summary["density_after_q"],
                         summary["density_after_group"])
        self._stats.clear()
        return summary
