"""Plain-torch executor (the CPU serving path) and the ground-truth attention it is tested against.

`reference_attention` computes, for every query, softmax attention over exactly the keys its
window's row may read (a table of pages, causal within the window), in float32 from the pool:
the definition every executor must meet. `TorchExecutor` runs a forward pass's plan the way the
GPU executors do (dense: each chunk against its whole context; sparse: rows through their paged
indices, causal at the row's end), reading host copies of the indices.
"""

from __future__ import annotations

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.executors.base import ForwardShape
from sglang_compact.indices import PagedIndices

NEG_INF = float("-inf")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float):
    """q [H, M, D], k/v [H or 1, N, D], allowed bool [M, N] -> (o [M, H, D], lse [M, H]) in float32."""
    s = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    o = torch.matmul(p, v.to(torch.float32))
    return o.transpose(0, 1), lse.transpose(0, 1)


def masked_context_attention(batch: ChunkBatch, allowed_fn) -> torch.Tensor:
    """Each request's chunk queries against its context keys (from the pool) where `allowed_fn(b, L, C)`
    (bool [H_q, H_kv or 1, C, E]: per query head, per kv head, or for all) allows. float32 [T, H_q, D]."""
    T, H_q, D = batch.q.shape
    G = batch.group_size
    o = torch.zeros(T, H_q, D, dtype=torch.float32, device=batch.q.device)
    cu = batch.cu_chunk_cpu()
    for b, (L, C) in enumerate(zip(batch.prefix_lens_cpu, batch.chunk_lens_cpu)):
        if C == 0:
            continue
        k = batch.context_keys(b).repeat_interleave(G, dim=0)          # [H_q, E, D]
        v = batch.context_values(b).repeat_interleave(G, dim=0)
        allowed = allowed_fn(b, L, C)
        if allowed.shape[0] not in (1, H_q):
            allowed = allowed.repeat_interleave(G, dim=0)
        o[cu[b]:cu[b + 1]], _ = _attend(batch.q[cu[b]:cu[b + 1]].transpose(0, 1), k, v, allowed, batch.sm_scale)
    return o


def _causal(L: int, C: int, device) -> torch.Tensor:
    """bool [1, C, L + C]: chunk query i (position L + i) reads keys 0..L + i."""
    return (torch.arange(L + C, device=device)[None, :] <= (L + torch.arange(C, device=device))[:, None])[None]


def causal_context_attention(batch: ChunkBatch) -> torch.Tensor:
    """Dense attention: each chunk query at absolute position L_b + i reads the keys 0..L_b + i of its
    context, from the pool. float32 [T, H_q, D]."""
    return masked_context_attention(batch, lambda b, L, C: _causal(L, C, batch.q.device))


def table_attention(batch: ChunkBatch, table: torch.Tensor) -> torch.Tensor:
    """Every query reads the pages its window row's table (bool [H_kv, NW, NKV]) allows, causally. float32."""
    qb, P, dev = batch.qblocks, batch.page_size, batch.q.device
    W = qb.window_pages * P
    first = {}
    for i, r in enumerate(qb.w_req):
        first.setdefault(r, i)

    def allowed(b, L, C):
        E = L + C
        window = first[b] + (L + torch.arange(C, device=dev)) // W - L // W        # each query's window row
        pages = table[:, window][:, :, torch.arange(E, device=dev) // P]          # [H_kv, C, E]
        return pages & _causal(L, C, dev)
    return masked_context_attention(batch, allowed)


def reference_attention(batch: ChunkBatch, table: torch.Tensor, return_lse: bool = False):
    """Ground truth: every query reads the pages its window row's table allows (bool [H_kv, NW, NKV]),
    causally, one (window, kv head) at a time.

    Returns o [T, H_q, D] in q's dtype (and lse [T, H_q] float32, natural log).
    """
    T, H_q, D = batch.q.shape
    H_kv, G, P = batch.num_kv_heads, batch.group_size, batch.page_size
    o = torch.zeros(T, H_q, D, dtype=torch.float32, device=batch.q.device)
    lse = torch.full((T, H_q), NEG_INF, dtype=torch.float32, device=batch.q.device)
    qb = batch.qblocks
    keys = {b: (batch.context_keys(b), batch.context_values(b)) for b in set(qb.w_req)}
    for w, (b, pos, st, n) in enumerate(zip(qb.w_req, qb.w_pos, qb.w_start, qb.w_length)):
        k_all, v_all = keys[b]
        E = k_all.shape[1]
        tok_page = torch.arange(E, device=k_all.device) // P
        qpos = pos + torch.arange(n, device=k_all.device)
        causal = torch.arange(E, device=k_all.device)[None, :] <= qpos[:, None]        # [n, E]
        for g in range(H_kv):
            allowed = causal & table[g, w][tok_page][None, :]
            hs = slice(g * G, (g + 1) * G)
            oo, ll = _attend(batch.q[st:st + n, hs].transpose(0, 1), k_all[g:g + 1], v_all[g:g + 1], allowed,
                             batch.sm_scale)
            o[st:st + n, hs], lse[st:st + n, hs] = oo, ll
    o = o.to(batch.q.dtype)
    return (o, lse) if return_lse else o


class TorchExecutor:
    """Runs a forward pass with plain torch (the CPU path)."""

    index_buffers = None

    def __init__(self):
        self.shape: ForwardShape | None = None
        self._page_table: torch.Tensor | None = None

    def plan_forward(self, shape: ForwardShape, page_table: torch.Tensor) -> None:
        self.shape = shape
        self._page_table = page_table

    def run(self, batch: ChunkBatch, indices: PagedIndices | None, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.shape is None:
            raise RuntimeError("TorchExecutor.run before plan_forward")
        if indices is None:
            if self.shape.sparse:
                raise ValueError("a sparse forward pass needs the layer's paged indices")
            return self.run_dense(batch.q, batch.k_pool, batch.v_pool, out=out)
        table = self.table_from_indices(batch, indices)
        apart = batch.qblocks.dense_apart
        if any(apart):   # their rows name their own pages; they read every page (computed apart on the GPU)
            mask = torch.tensor(apart, dtype=torch.bool, device=table.device)[None, :, None]
            table = table | (batch.full_table() & mask)
        o = table_attention(batch, table).to(batch.q.dtype)
        return o if out is None else out.copy_(o)

    def run_dense(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  out: torch.Tensor | None = None, chunk_kv=None) -> torch.Tensor:
        """Reads every context from the pool (`chunk_kv` is there too)."""
        s = self.shape
        if s is None:
            raise RuntimeError("TorchExecutor.run_dense before plan_forward")
        if s.sparse:
            raise RuntimeError("TorchExecutor.run_dense in a sparse forward pass")
        batch = ChunkBatch(q=q, k_pool=k_pool, v_pool=v_pool, page_table=self._page_table,
                           prefix_lens_cpu=s.prefix_lens, chunk_lens_cpu=s.chunk_lens, qblocks=s.qblocks,
                           sm_scale=s.sm_scale)
        o = causal_context_attention(batch).to(q.dtype)
        return o if out is None else out.copy_(o)

    def table_from_indices(self, batch: ChunkBatch, indices: PagedIndices) -> torch.Tensor:
        """bool [H_kv, NW, NKV]: the pages the rows' paged indices name (read back, the way a paged kernel
        reads them: entry page * H_kv + g of row r = g * NW + w)."""
        qb, H_kv = batch.qblocks, batch.num_kv_heads
        NW, NKV = qb.windows, qb.max_pages
        dev = batch.q.device
        counts = (indices.kv_indptr[1:] - indices.kv_indptr[:-1]).long()
        n = int(indices.kv_indptr[-1])
        row = torch.repeat_interleave(torch.arange(indices.num_rows, device=dev), counts, output_size=n)
        entry = indices.kv_indices[:n].long()
        g, w = row // NW, row % NW
        if not torch.equal(entry % H_kv, g):
            raise ValueError("paged indices name another kv head's tiles")
        # page id -> its position j in the request's context
        position = torch.full((batch.k_pool.shape[0], batch.batch_size), -1, dtype=torch.long, device=dev)
        for b, E in enumerate(batch.context_lens_cpu()):
            m = -(-E // batch.page_size)
            position[batch.page_table[b, :m].long(), b] = torch.arange(m, device=dev)
        req = torch.tensor(qb.w_req, dtype=torch.long, device=dev)[w]
        j = position[entry // H_kv, req]
        if (j < 0).any():
            raise ValueError("paged indices name a page outside the request's context")
        table = torch.zeros(H_kv, NW, NKV, dtype=torch.bool, device=dev)
        table[g, w, j] = True
        return table
