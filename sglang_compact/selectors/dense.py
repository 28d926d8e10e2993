"""`dense`: every valid block. With it the compact path must reproduce dense attention."""

from __future__ import annotations

from sglang_compact.selectors.base import Selection, Selector, register_selector, valid_cells


@register_selector("dense")
class DenseSelector(Selector):
    def row_blocks(self, n_blocks):
        return list(n_blocks)

    def select(self, batch, layer=0, pooled_keys=None):
        bs = self.config.block_size
        kv_valid = batch.kv_block_valid()  # [B, NKV]
        rows = kv_valid[:, None, :].expand(batch.batch_size, batch.num_kv_heads, kv_valid.shape[1])
        return Selection(rows=rows, valid=valid_cells(batch, bs), group_size=batch.group_size)
