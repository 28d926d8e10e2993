"""`xattention`: strided antidiagonal scoring (XAttention), cumulative-mass threshold.

For stride S, each q-block's queries are regrouped in reversed order and the keys in order into
S-token super-rows, so one dot product of super-rows sums an antidiagonal of the S x S tile of
Q.K^T. A softmax over the candidate super-columns (those in pages before the q-block's window),
summed per page and averaged over the q-block's super-rows, estimates each page's attention
mass; each head keeps pages by descending mass until `threshold` of it is covered. Reads the
context's keys (O(context tokens / S) per super-row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.selectors.base import NEG_INF, Selection, Selector, qblock_queries, request_qblocks, top_p_rows
from sglang_compact.selectors.registry import SelectorParams, param, register_selector


def antidiagonal_page_mass(batch, stride: int, head_chunk: int = 8) -> torch.Tensor:
    """float32 [H_q, NQB, NKV] estimated attention mass of each candidate page."""
    q_pad, q_valid = qblock_queries(batch)                       # [NQB, P, H_q, D]
    H_q, P, G, S, D = batch.num_q_heads, batch.page_size, batch.group_size, stride, batch.head_dim
    out = torch.zeros(H_q, batch.qblocks.count, batch.qblocks.max_pages, dtype=torch.float32, device=q_pad.device)
    for idx, a, k, n in request_qblocks(batch):
        NQ = idx.stop - idx.start
        E = k.shape[1]
        k = torch.nn.functional.pad(k, (0, 0, 0, n * P - E))      # [H_kv, n * P, D]
        cols = n * P // S
        cand = torch.arange(cols, device=k.device)[None, :] < (a * (P // S))[:, None]   # [NQ, cols]
        rows_ok = q_valid[idx].reshape(NQ, P // S, S).any(-1)                             # [NQ, P/S]
        nrows = rows_ok.sum(-1).clamp(min=1).to(torch.float32)
        for h0 in range(0, H_q, head_chunk):
            h1 = min(H_q, h0 + head_chunk)
            qq = q_pad[idx][:, :, h0:h1].permute(2, 0, 1, 3).reshape(h1 - h0, NQ, P // S, S, D).flip(3)
            qq = qq.reshape(h1 - h0, NQ, P // S, S * D)
            kk = k[torch.arange(h0, h1, device=k.device) // G].reshape(h1 - h0, cols, S * D)
            s = torch.einsum("hqrd,hcd->hqrc", qq, kk) * (batch.sm_scale / S)
            s = s.masked_fill(~cand[None, :, None, :], NEG_INF)
            p = torch.softmax(s, dim=-1).nan_to_num_(0.0) * rows_ok[None, :, :, None]
            m = p.reshape(h1 - h0, NQ, P // S, n, P // S).sum(dim=(2, 4))
            out[h0:h1, idx, :n] = m / nrows[None, :, None]
    return out


@dataclass(frozen=True)
class XAttentionParams(SelectorParams):
    threshold: float = param(0.9, lo=0.0, hi=1.0, help="cumulative estimated mass each head keeps")
    stride: int = param(8, lo=1, hi=16, power_of_two=True, help="antidiagonal stride S")


@register_selector("xattention", params=XAttentionParams, expected_density=0.4, priced_search=False)
class XAttentionSelector(Selector):
    """Strided antidiagonal page scores, cumulative-mass threshold (XAttention)."""

    def select(self, batch, layer, summaries):
        if batch.page_size % self.params.stride:
            raise ValueError(f"xattention stride {self.params.stride} must divide the page size {batch.page_size}")
        mass = antidiagonal_page_mass(batch, self.params.stride)
        return Selection(mask=top_p_rows(mass, batch.candidates()[None].expand_as(mass), self.params.threshold),
                         scores=mass)
