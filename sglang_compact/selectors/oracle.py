"""`oracle`: exact attention mass per block, top-p. The accuracy ceiling (slow: O(C x L)).

mass[b, h, i, j] = mean over the queries t of block i of
    sum over keys s of block j of softmax_s(q_t . k_s * scale)   (softmax over the prefix)
Each row keeps the fewest blocks whose mass reaches `top_p`.
"""

from __future__ import annotations

import torch

from sglang_compact.selectors.base import NEG_INF, Selection, Selector, register_selector, top_p_rows, valid_cells


def block_attention_mass(batch, q_block: int, head_chunk: int = 4) -> torch.Tensor:
    """float32 [B, H_q, NQ, NKV]: exact softmax mass of each prefix block, averaged per query block."""
    q_pad, q_valid = batch.padded_queries(q_block)
    k, k_valid = batch.prefix_keys()  # [B, H_kv, NKV*P, D]
    B, H_q, LQ, D = q_pad.shape
    NQ, P = LQ // q_block, batch.page_size
    NKV = k.shape[2] // P
    G = batch.group_size
    out = torch.zeros(B, H_q, NQ, NKV, dtype=torch.float32, device=q_pad.device)
    if NKV == 0 or NQ == 0:
        return out
    neg = torch.zeros(B, 1, 1, NKV * P, device=q_pad.device).masked_fill(~k_valid[:, None, None, :], NEG_INF)
    nq = q_valid.reshape(B, NQ, q_block).sum(-1).clamp(min=1).to(torch.float32)  # [B, NQ]
    for h0 in range(0, H_q, head_chunk):
        h1 = min(H_q, h0 + head_chunk)
        q = q_pad[:, h0:h1].to(torch.float32)
        kk = k[:, torch.arange(h0, h1, device=q.device) // G].to(torch.float32)
        p = torch.softmax(torch.matmul(q, kk.transpose(-1, -2)) * batch.sm_scale + neg, dim=-1)
        p = p.nan_to_num_(0.0) * q_valid[:, None, :, None]
        m = p.reshape(B, h1 - h0, NQ, q_block, NKV, P).sum(dim=(3, 5))
        out[:, h0:h1] = m / nq[:, None, :, None]
    return out


@register_selector("oracle")
class OracleSelector(Selector):
    def select(self, batch, layer=0, pooled_keys=None):
        bs = self.config.block_size
        mass = block_attention_mass(batch, bs)
        valid = valid_cells(batch, bs).expand_as(mass)
        return Selection(top_p_rows(mass, valid, self.config.param("top_p")), mass)
