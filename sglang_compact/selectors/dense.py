"""`dense`: every page. With it the compact path must reproduce dense attention."""

from __future__ import annotations

import torch

from sglang_compact.selectors.base import Selection, Selector
from sglang_compact.selectors.registry import register_selector


@register_selector("dense", fixes_row_lengths=True, expected_density=1.0)
class DenseSelector(Selector):
    """Every page of every row (dense attention through the same machinery)."""

    def row_pages(self, batch):
        return batch.qblocks.full_counts() * batch.num_kv_heads  # rows r = g * NW + w

    def select(self, batch, layer, summaries):
        counts = batch.memo(("full_counts",), lambda: batch.full_table().sum(-1, dtype=torch.int32).reshape(-1))
        return Selection(table=batch.full_table(), counts=counts, counts_per_pass=True)



