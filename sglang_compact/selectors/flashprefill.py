"""`flashprefill` (default): threshold on mean-key page scores. Training-free.

Each q-block scores its candidate pages (those before its window) against their mean keys: the
softmax of q . kbar over the candidates, maxed over the q-block's queries. A query head keeps
the pages scoring at least `alpha` x its best page; the row of a kv head and window reads the
pages any of its query heads kept for any q-block of the window, plus the forced ones. It reads
page summaries, so it costs O(context pages) per q-block; `query_stride` s scores every s-th
query of each q-block only (s times cheaper). On CUDA, search, threshold and group union are one
kernel launch (`kernels/flashprefill.py`), the window union another.

`fix_rows`: the forward pass's observing layer (its second; the first reads every page) thresholds
as above; every later layer keeps, in each row, exactly as many pages as that layer's row read,
ranked by the threshold's own measure (a page's score over its head's best, maxed over the group's
heads and the window's q-blocks: `fill`), which is the threshold moved per layer and row to give
that count. The row lengths are then known on the host
after the observing layer, and one FlashInfer fa3 plan serves the rest of the pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.kernels import flashprefill as flashprefill_kernel
from sglang_compact.kernels import flashprefill_naive, use_triton
from sglang_compact.selectors.base import Selection, Selector, page_scores, threshold_rows
from sglang_compact.selectors.registry import SelectorParams, param, register_selector


@dataclass(frozen=True)
class FlashPrefillParams(SelectorParams):
    alpha: float = param(0.4, lo=0.0, hi=1.0, help="keep pages scoring >= alpha x the head's best page")
    query_stride: int = param(1, lo=1, hi=16, power_of_two=True,
                              help="score every s-th query of each q-block (s times cheaper search)")
    fix_rows: bool = param(False, help="later layers keep as many pages per row as the pass's second layer, "
                                       "best ratio first (fa3 planned once after it)")


@register_selector("flashprefill", params=FlashPrefillParams, uses_summaries=True, expected_density=0.5,
                   fixes_rows_at_observing_layer=lambda p: p.fix_rows)
class FlashPrefillSelector(Selector):
    """Threshold on mean-key page scores (FlashPrefill); the default."""

    def select(self, batch, layer, summaries):
        p, cfg = self.params, self.config
        if cfg.density_cap is None:   # the fused kernel: a kv head's mask per q-block, no scores materialised
            args = (batch.q, batch.device_qblocks(), batch.page_table, summaries.key_sum, summaries.count,
                    batch.sm_scale, batch.num_kv_heads, batch.qblocks.max_pages, p.alpha)
            if use_triton(batch.q) and flashprefill_kernel.supports(batch.head_dim, batch.page_size, p.query_stride):
                mask = flashprefill_kernel.threshold_mask(*args, query_stride=p.query_stride, page_size=batch.page_size)
            else:
                mask = flashprefill_naive.threshold_mask(*args, query_stride=p.query_stride)
            return Selection(mask=mask)
        scores = page_scores(batch, summaries, query_stride=p.query_stride)     # [H_q, NQB, NKV]
        mask = threshold_rows(scores, batch.candidates()[None], p.alpha)
        return Selection(mask=mask, scores=scores)

    def fill(self, batch, layer, summaries, counts):
        """Exactly `counts[r]` pages per row r (device int [H_kv * NW]): the forced pages,
        then the candidates by their best ratio to their head's best score over the window's q-blocks."""
        p = self.params
        args = (batch.q, batch.device_qblocks(), batch.page_table, summaries.key_sum, summaries.count,
                batch.sm_scale, batch.num_kv_heads, batch.qblocks.max_pages)
        if use_triton(batch.q) and flashprefill_kernel.supports(batch.head_dim, batch.page_size, p.query_stride):
            ratio = flashprefill_kernel.ratio_scores(*args, query_stride=p.query_stride, page_size=batch.page_size)
        else:
            ratio = flashprefill_naive.ratio_scores(*args, query_stride=p.query_stride)
        return Selection(ranked=ratio, counts=counts.to(torch.int32), counts_per_pass=counts.dtype == torch.int32)
