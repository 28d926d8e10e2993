"""`dense`: every valid block. With it the compact path must reproduce dense attention."""

from __future__ import annotations

from sglang_compact.selectors.base import Selection, Selector, register_selector, valid_cells


@register_selector("dense")
class DenseSelector(Selector):
    def row_blocks(self, n_blocks):
        return list(n_blocks)

    def select(self, batch, layer=0, pooled_keys=None):
        bs = self.config.block_size
        valid = valid_cells(batch, bs)
        B, _, NQ, NKV = valid.shape
        return Selection(valid.expand(B, batch.num_q_heads, NQ, NKV).contiguous(), None)
