"""`xattention`: strided antidiagonal scoring (XAttention), cumulative-mass threshold.

For stride S, queries are regrouped in reversed order and keys in order into
S-token super-rows, so one dot product of super-rows sums an antidiagonal of
the S x S tile of Q.K^T. A softmax over the prefix's super-columns, summed per
block pair and averaged over the block's super-rows, estimates the block's
attention mass; each row keeps blocks by descending mass until `threshold` of
it is covered. Reads the prefix's keys (O(prefix tokens / S) per query super-row).
"""

from __future__ import annotations

import torch

from sglang_compact.selectors.base import NEG_INF, Selection, Selector, register_selector, top_p_rows, valid_cells


def antidiagonal_block_mass(batch, q_block: int, stride: int, head_chunk: int = 8) -> torch.Tensor:
    """float32 [B, H_q, NQ, NKV] estimated attention mass per block pair."""
    q_pad, q_valid = batch.padded_queries(q_block)
    k, k_valid = batch.prefix_keys()
    B, H_q, LQ, D = q_pad.shape
    NQ, P = LQ // q_block, batch.page_size
    LK = k.shape[2]
    NKV = LK // P
    G, S = batch.group_size, stride
    out = torch.zeros(B, H_q, NQ, NKV, dtype=torch.float32, device=q_pad.device)
    if NKV == 0 or NQ == 0:
        return out
    # super-column valid if any of its keys is valid; super-row valid likewise
    kcol_valid = k_valid.reshape(B, LK // S, S).any(-1)
    qrow_valid = q_valid.reshape(B, LQ // S, S).any(-1)
    neg = torch.zeros(B, 1, 1, LK // S, device=q_pad.device).masked_fill(~kcol_valid[:, None, None, :], NEG_INF)
    rows_per_block = q_block // S
    nrows = qrow_valid.reshape(B, NQ, rows_per_block).sum(-1).clamp(min=1).to(torch.float32)
    for h0 in range(0, H_q, head_chunk):
        h1 = min(H_q, h0 + head_chunk)
        q = q_pad[:, h0:h1].to(torch.float32).reshape(B, h1 - h0, LQ // S, S, D).flip(3).reshape(B, h1 - h0, LQ // S, S * D)
        kk = k[:, torch.arange(h0, h1, device=q.device) // G].to(torch.float32).reshape(B, h1 - h0, LK // S, S * D)
        s = torch.matmul(q, kk.transpose(-1, -2)) * (batch.sm_scale / S) + neg
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0) * qrow_valid[:, None, :, None]
        m = p.reshape(B, h1 - h0, NQ, rows_per_block, NKV, P // S).sum(dim=(3, 5))
        out[:, h0:h1] = m / nrows[:, None, :, None]
    return out


@register_selector("xattention")
class XAttentionSelector(Selector):
    def select(self, batch, layer=0, pooled_keys=None):
        bs = self.config.block_size
        mass = antidiagonal_block_mass(batch, bs, self.config.param("stride"))
        valid = valid_cells(batch, bs).expand_as(mass)
        return Selection(top_p_rows(mass, valid, self.config.param("threshold")), mass)
