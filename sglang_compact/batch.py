"""`ChunkBatch`: one prefill chunk per request, each attending to its cached prefix.

This is the algorithm's whole view of a batch; it knows nothing of SGLang.

Shapes (B requests, T = sum of chunk lengths, P = page size = block size):
    q            [T, H_q, D]   chunk queries, ragged by `cu_chunk`
    k_chunk      [T, H_kv, D]  the chunk's own keys (already rotated)
    v_chunk      [T, H_kv, D]
    k_pool       [num_pages, H_kv, P, D]  head-major paged KV pool ("HND")
    v_pool       [num_pages, H_kv, P, D]
    page_table   int32 [B, >= max_b n_kv_b]  page ids of each prefix, in order
    prefix_lens  int32 [B]   L_b, cached prefix tokens (may not be page aligned)
    chunk_lens   int32 [B]   C_b
    cu_chunk     int32 [B + 1]

Host copies of the lengths (`*_cpu`) size every buffer without a device sync.

Tensors derived from the lengths alone (block counts, validity masks, forced
blocks) are computed once per batch and shared by every layer: a layer's batch
is `dataclasses.replace(template, q=..., k_pool=...)`, which keeps the template's
`derived` store (see `ChunkBatch.memo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ChunkBatch:
    q: torch.Tensor
    k_chunk: torch.Tensor
    v_chunk: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor
    prefix_lens: torch.Tensor
    chunk_lens: torch.Tensor
    cu_chunk: torch.Tensor
    prefix_lens_cpu: Sequence[int]
    chunk_lens_cpu: Sequence[int]
    sm_scale: float
    #: tensors derived from the lengths, shared by the layers' copies of one batch (see `memo`)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        q: torch.Tensor,
        k_chunk: torch.Tensor,
        v_chunk: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        page_table: torch.Tensor,
        prefix_lens_cpu: Sequence[int],
        chunk_lens_cpu: Sequence[int],
        sm_scale: float | None = None,
    ) -> "ChunkBatch":
        """Validate shapes and make the device length tensors from host lengths."""
        prefix_lens_cpu = [int(x) for x in prefix_lens_cpu]
        chunk_lens_cpu = [int(x) for x in chunk_lens_cpu]
        if len(prefix_lens_cpu) != len(chunk_lens_cpu):
            raise ValueError("prefix_lens and chunk_lens differ in length")
        if q.dim() != 3 or k_chunk.dim() != 3 or k_pool.dim() != 4:
            raise ValueError("expected q [T, H_q, D], k_chunk [T, H_kv, D], k_pool [pages, H_kv, P, D]")
        T, H_q, D = q.shape
        _, H_kv, P, Dk = k_pool.shape
        if sum(chunk_lens_cpu) != T or k_chunk.shape != (T, H_kv, D) or v_chunk.shape != (T, H_kv, D):
            raise ValueError(f"chunk tensors do not match chunk lengths (T={T}, sum={sum(chunk_lens_cpu)})")
        if Dk != D or v_pool.shape != k_pool.shape:
            raise ValueError("pool shape does not match q")
        if H_q % H_kv:
            raise ValueError(f"query heads {H_q} not a multiple of kv heads {H_kv}")
        need = max([cdiv(L, P) for L in prefix_lens_cpu] + [0])
        if page_table.dim() != 2 or page_table.shape[0] != len(prefix_lens_cpu) or page_table.shape[1] < need:
            raise ValueError(f"page_table must be [B, >= {need}], got {tuple(page_table.shape)}")
        dev = q.device
        cu = [0]
        for c in chunk_lens_cpu:
            cu.append(cu[-1] + c)
        return cls(
            q=q, k_chunk=k_chunk, v_chunk=v_chunk, k_pool=k_pool, v_pool=v_pool,
            page_table=page_table.to(torch.int32),
            prefix_lens=torch.tensor(prefix_lens_cpu, dtype=torch.int32).to(dev, non_blocking=True),
            chunk_lens=torch.tensor(chunk_lens_cpu, dtype=torch.int32).to(dev, non_blocking=True),
            cu_chunk=torch.tensor(cu, dtype=torch.int32).to(dev, non_blocking=True),
            prefix_lens_cpu=prefix_lens_cpu, chunk_lens_cpu=chunk_lens_cpu,
            sm_scale=float(sm_scale) if sm_scale is not None else D ** -0.5,
        )

    # --- sizes (host values, no sync) -------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens_cpu)

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pool.shape[1]

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pool.shape[2]

    def kv_blocks_cpu(self) -> list[int]:
        """n_kv_b = ceil(L_b / P): prefix blocks (pages) per request."""
        return [cdiv(L, self.page_size) for L in self.prefix_lens_cpu]

    def q_blocks_cpu(self, q_block: int) -> list[int]:
        return [cdiv(C, q_block) for C in self.chunk_lens_cpu]

    @property
    def max_kv_blocks(self) -> int:
        return max(self.kv_blocks_cpu() + [0])

    def max_q_blocks(self, q_block: int) -> int:
        return max(self.q_blocks_cpu(q_block) + [0])

    # --- tensors derived from the lengths (computed once per batch) -----------------------
    def memo(self, key: tuple, compute: Callable[[], object]):
        """`compute()` once per (key, lengths, page size): layers of one forward pass share it.

        Entries are keyed by the identity of the length tensors (kept alive by the entry), so a
        batch whose lengths were replaced never sees another batch's values."""
        full = (key, id(self.prefix_lens), id(self.chunk_lens), id(self.cu_chunk), self.page_size)
        hit = self.derived.get(full)
        if hit is None:
            hit = (self.prefix_lens, self.chunk_lens, self.cu_chunk, compute())
            self.derived[full] = hit
        return hit[3]

    def kv_blocks(self) -> torch.Tensor:
        """int32 [B] device copy of n_kv_b."""
        return self.memo(("kv_blocks",), lambda: torch.div(self.prefix_lens + self.page_size - 1, self.page_size,
                                                           rounding_mode="floor").to(torch.int32))

    def q_blocks(self, q_block: int) -> torch.Tensor:
        return self.memo(("q_blocks", q_block), lambda: torch.div(self.chunk_lens + q_block - 1, q_block,
                                                                  rounding_mode="floor").to(torch.int32))

    # --- padded views used by the selectors ----------------------------------------------
    def padded_queries(self, q_block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries padded per request to whole query blocks.

        Returns:
            q_pad [B, H_q, NQ * q_block, D] (zeros in padding),
            valid [B, NQ * q_block] bool.
        """
        B, NQ = self.batch_size, self.max_q_blocks(q_block)
        L = NQ * q_block
        H, D = self.num_q_heads, self.head_dim
        pos = torch.arange(L, device=self.q.device)
        valid = pos[None, :] < self.chunk_lens[:, None]
        src = (self.cu_chunk[:-1, None] + pos[None, :]).clamp(max=max(self.q.shape[0] - 1, 0))
        q_pad = self.q[src.reshape(-1)].reshape(B, L, H, D) if self.q.shape[0] else self.q.new_zeros(B, L, H, D)
        q_pad = q_pad * valid[:, :, None, None].to(q_pad.dtype)
        return q_pad.permute(0, 2, 1, 3), valid

    def prefix_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix keys, read from the pool (O(prefix tokens)).

        Returns:
            k [B, H_kv, NKV * P, D] (zeros beyond L_b), valid [B, NKV * P] bool.
        """
        NKV, P = self.max_kv_blocks, self.page_size
        pages = self.page_table[:, :NKV].long()
        k = self.k_pool[pages]  # [B, NKV, H_kv, P, D]
        B, _, H, _, D = k.shape
        k = k.permute(0, 2, 1, 3, 4).reshape(B, H, NKV * P, D)
        valid = torch.arange(NKV * P, device=k.device)[None, :] < self.prefix_lens[:, None]
        return k * valid[:, None, :, None].to(k.dtype), valid

    def kv_block_valid(self) -> torch.Tensor:
        """bool [B, NKV]: block j exists in request b's prefix."""
        return self.memo(("kv_block_valid",), lambda: torch.arange(
            self.max_kv_blocks, device=self.prefix_lens.device)[None, :] < self.kv_blocks()[:, None])

    def q_block_valid(self, q_block: int) -> torch.Tensor:
        """bool [B, NQ]."""
        return self.memo(("q_block_valid", q_block), lambda: torch.arange(
            self.max_q_blocks(q_block), device=self.chunk_lens.device)[None, :] < self.q_blocks(q_block)[:, None])

    def valid_cells(self, q_block: int) -> torch.Tensor:
        """bool [B, 1, NQ, NKV]: (query block, prefix block) cells that exist."""
        return self.memo(("valid_cells", q_block), lambda: (
            self.q_block_valid(q_block)[:, :, None] & self.kv_block_valid()[:, None, :])[:, None])
