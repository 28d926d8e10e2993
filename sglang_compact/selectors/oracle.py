"""`oracle`: exact attention mass per page, top-p. The accuracy ceiling (slow: O(chunk x context)).

mass[h, q, j] = mean over the queries t of q-block q of
    sum over keys s of page j of softmax_s(q_t . k_s * scale)   (softmax over the candidate pages: those
                                                                  before the q-block's window)
Each head keeps the fewest pages whose mass reaches `top_p`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.selectors.base import NEG_INF, Selection, Selector, qblock_queries, request_qblocks, top_p_rows
from sglang_compact.selectors.registry import SelectorParams, param, register_selector


def page_attention_mass(batch, head_chunk: int = 4) -> torch.Tensor:
    """float32 [H_q, NQB, NKV]: exact softmax mass of each candidate page, averaged over each q-block's queries."""
    q_pad, q_valid = qblock_queries(batch)                       # [NQB, P, H_q, D], [NQB, P]
    H_q, P, G = batch.num_q_heads, batch.page_size, batch.group_size
    out = torch.zeros(H_q, batch.qblocks.count, batch.qblocks.max_pages, dtype=torch.float32, device=q_pad.device)
    for idx, a, k, n in request_qblocks(batch):
        E = k.shape[1]
        cand = torch.arange(E, device=k.device)[None, :] < (a * P)[:, None]           # [NQ_b, E]
        nq = q_valid[idx].sum(-1).clamp(min=1).to(torch.float32)                       # [NQ_b]
        for h0 in range(0, H_q, head_chunk):
            h1 = min(H_q, h0 + head_chunk)
            qq = q_pad[idx][:, :, h0:h1].permute(2, 0, 1, 3)                           # [h, NQ_b, P, D]
            kk = k[torch.arange(h0, h1, device=k.device) // G]                         # [h, E, D]
            s = torch.einsum("hqpd,hed->hqpe", qq, kk) * batch.sm_scale
            s = s.masked_fill(~cand[None, :, None, :], NEG_INF)
            p = torch.softmax(s, dim=-1).nan_to_num_(0.0) * q_valid[idx][None, :, :, None]
            NQ = idx.stop - idx.start
            p = torch.nn.functional.pad(p, (0, n * P - E)).reshape(h1 - h0, NQ, P, n, P).sum(dim=(2, 4))
            out[h0:h1, idx, :n] = p / nq[None, :, None]
    return out


@dataclass(frozen=True)
class OracleParams(SelectorParams):
    top_p: float = param(0.95, lo=0.0, hi=1.0, help="attention mass each head keeps")


@register_selector("oracle", params=OracleParams, expected_density=0.3, priced_search=False)
class OracleSelector(Selector):
    """Exact attention mass per page, top-p: the accuracy ceiling (evaluation only; slow)."""

    def select(self, batch, layer, summaries):
        mass = page_attention_mass(batch)
        return Selection(mask=top_p_rows(mass, batch.candidates()[None].expand_as(mass), self.params.top_p),
                         scores=mass)
