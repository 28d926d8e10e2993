"""Execution: attend each chunk to its selected prefix blocks and causally to itself.

Two executors of the same plan, plus the reference they are tested against:
- `reference_attention`: plain torch, from a block mask; the ground truth.
- `TorchPagedExecutor`: plain torch, from a `PagedPlan` (reads the pool through
  the same `kv_indices` FlashInfer would); the CPU serving path.
- `FlashInferExecutor` (`execute_flashinfer.py`): the GPU path.

LSEs here are natural-log; outputs are [T, H_q, D] in the query dtype.
"""

from __future__ import annotations

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.plan import PagedPlan

NEG_INF = float("-inf")


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine two partial attentions over disjoint key sets.

    Args: o_* [N, H, D], lse_* [N, H] (natural log; -inf for an empty key set).
    Returns: (o [N, H, D] float32, lse [N, H] float32).
    """
    lse_a = lse_a.to(torch.float32)
    lse_b = lse_b.to(torch.float32)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(lse_a - m)
    wb = torch.exp(lse_b - m)
    s = wa + wb
    o = (o_a.to(torch.float32) * wa[..., None] + o_b.to(torch.float32) * wb[..., None]) / s.clamp(min=1e-30)[..., None]
    return o, m + torch.log(s)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float):
    """q [H, M, D], k/v [H, N, D], allowed bool [H or 1, M, N] -> (o [M, H, D], lse [M, H]) in float32."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # [H, M]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    o = torch.matmul(p, v)
    return o.transpose(0, 1), lse.transpose(0, 1)


def causal_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_lens, scale: float):
    """Each request's chunk attends causally to itself.

    Args: q [T, H_q, D], k/v [T, H_kv, D], chunk_lens: host ints.
    Returns: (o [T, H_q, D], lse [T, H_q]) float32.
    """
    T, H_q, D = q.shape
    G = H_q // k.shape[1]
    o = torch.empty(T, H_q, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(T, H_q, dtype=torch.float32, device=q.device)
    start = 0
    for C in chunk_lens:
        sl = slice(start, start + C)
        qb = q[sl].to(torch.float32).transpose(0, 1)
        kb = k[sl].to(torch.float32).repeat_interleave(G, dim=1).transpose(0, 1)
        vb = v[sl].to(torch.float32).repeat_interleave(G, dim=1).transpose(0, 1)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()[None]
        o[sl], lse[sl] = _attend(qb, kb, vb, causal, scale)
        start += C
    return o, lse


def reference_attention(batch: ChunkBatch, *, block_mask: torch.Tensor | None = None,
                        table: torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
                        q_block: int | None = None, return_lse: bool = False):
    """Ground truth: every query attends to the prefix keys its mask allows and causally to its chunk.

    Give exactly one of:
        block_mask: bool [B, H_q, NQ, NKV] per query block (size `q_block`, default
            the page size) and query head: block-sparse semantics.
        table: bool [B, H_kv, NKV] union table: every query of a (request, kv head)
            sees the same blocks: CompactAttention's semantics.
        token_mask: bool [B, H_q or H_kv, >= L_max] per prefix token (QUOKA-style).
    Returns:
        o [T, H_q, D] in q's dtype (and lse [T, H_q] float32, natural log).
    """
    if sum(x is not None for x in (block_mask, table, token_mask)) != 1:
        raise ValueError("give exactly one of block_mask, table, token_mask")
    q_block = q_block or batch.page_size
    P, G, H_q = batch.page_size, batch.group_size, batch.num_q_heads
    o_c, lse_c = causal_chunk_attention(batch.q, batch.k_chunk, batch.v_chunk, batch.chunk_lens_cpu, batch.sm_scale)
    o = torch.empty_like(o_c)
    lse = torch.empty_like(lse_c)
    start = 0
    for b, (L, C) in enumerate(zip(batch.prefix_lens_cpu, batch.chunk_lens_cpu)):
        sl = slice(start, start + C)
        start += C
        n = -(-L // P)
        pages = batch.page_table[b, :n].long()
        kb = batch.k_pool[pages].permute(1, 0, 2, 3).reshape(batch.num_kv_heads, n * P, batch.head_dim)[:, :L]
        vb = batch.v_pool[pages].permute(1, 0, 2, 3).reshape(batch.num_kv_heads, n * P, batch.head_dim)[:, :L]
        kb = kb.to(torch.float32).repeat_interleave(G, dim=0)
        vb = vb.to(torch.float32).repeat_interleave(G, dim=0)
        tok_block = torch.arange(L, device=kb.device) // P
        if block_mask is not None:
            q_blk = torch.arange(C, device=kb.device) // q_block
            allowed = block_mask[b][:, q_blk][:, :, tok_block]  # [H_q, C, L]
        else:
            rows = table[b][:, tok_block] if table is not None else token_mask[b][:, :L]
            rows = rows.repeat_interleave(H_q // rows.shape[0], dim=0)
            allowed = rows[:, None, :].expand(H_q, C, L)
        o_p, lse_p = _attend(batch.q[sl].to(torch.float32).transpose(0, 1), kb, vb, allowed, batch.sm_scale)
        o[sl], lse[sl] = merge_states(o_p, lse_p, o_c[sl], lse_c[sl])
    o = o.to(batch.q.dtype)
    return (o, lse) if return_lse else o


class TorchPagedExecutor:
    """Runs a `PagedPlan` with plain torch (the CPU path; reads host copies of the plan)."""

    def prefix_attention(self, batch: ChunkBatch, plan: PagedPlan):
        """Non-causal attention of every row's queries to its planned pages.

        Returns: (o [T, H_q, D], lse [T, H_q]) float32; lse = -inf where a row has no pages.
        """
        T, H_q, D = batch.q.shape
        H_kv, G, P = batch.num_kv_heads, batch.group_size, batch.page_size
        q_rows = batch.q.view(T, H_kv, G, D).transpose(0, 1).reshape(H_kv * T, G, D)
        k_tiles = batch.k_pool.view(-1, P, D)  # [num_pages * H_kv, P, D]
        v_tiles = batch.v_pool.view(-1, P, D)
        qo = plan.qo_indptr.tolist()
        kvp = plan.kv_indptr.tolist()
        lpl = plan.kv_last_page_len.tolist()
        o_rows = torch.zeros(H_kv * T, G, D, dtype=torch.float32, device=q_rows.device)
        lse_rows = torch.full((H_kv * T, G), NEG_INF, dtype=torch.float32, device=q_rows.device)
        for r in range(plan.num_rows):
            if qo[r + 1] == qo[r] or kvp[r + 1] == kvp[r]:
                continue
            idx = plan.kv_indices[kvp[r]:kvp[r + 1]].long()
            n_tok = (idx.numel() - 1) * P + lpl[r]
            k = k_tiles[idx].reshape(-1, D)[:n_tok].to(torch.float32)
            v = v_tiles[idx].reshape(-1, D)[:n_tok].to(torch.float32)
            q = q_rows[qo[r]:qo[r + 1]].to(torch.float32).transpose(0, 1)  # [G, C, D]
            allowed = torch.ones(1, q.shape[1], n_tok, dtype=torch.bool, device=q.device)
            o_rows[qo[r]:qo[r + 1]], lse_rows[qo[r]:qo[r + 1]] = _attend(q, k[None], v[None], allowed, batch.sm_scale)
        o = o_rows.view(H_kv, T, G, D).transpose(0, 1).reshape(T, H_q, D)
        lse = lse_rows.view(H_kv, T, G).transpose(0, 1).reshape(T, H_q)
        return o, lse

    def run(self, batch: ChunkBatch, plan: PagedPlan, return_lse: bool = False):
        o_p, lse_p = self.prefix_attention(batch, plan)
        o_c, lse_c = causal_chunk_attention(batch.q, batch.k_chunk, batch.v_chunk, batch.chunk_lens_cpu, batch.sm_scale)
        o, lse = merge_states(o_p, lse_p, o_c, lse_c)
        o = o.to(batch.q.dtype)
        return (o, lse) if return_lse else o
