"""The executor interface: plan once per forward pass, run per layer.

An executor computes each chunk's attention over its context in the paged
pool, in one of two ways fixed for the whole forward pass:

* dense (no q-block reads a selection): each chunk against its whole context,
  read from the pool after the chunk's K/V were stored (`run_dense`: one causal
  paged pass, what stock SGLang's fa3 backend runs; with no cached prefix, the
  chunk's own K/V may be read instead, as stock's FlashInfer backend does);
* sparse: one causal paged pass over rows (kv head, window), each reading the
  pages of its `PagedIndices` (written per layer by the index kernel, into the
  executor's `index_buffers` when it has them); the pass's dense windows
  (`QBlocks.dense_apart`) are computed apart, by one causal paged pass over
  their whole contexts, and their rows name only their own pages.

    executor.plan_forward(shape, page_table)     # once per forward pass: host lengths only
    for each layer:
        indices = compact.select_pages(batch, ..., buffers=executor.index_buffers)  # sparse passes only
        o = executor.run(batch, indices)          # sparse pass
        o = executor.run_dense(q, k_pool, v_pool)  # dense pass (executor.run(batch, None) does the same)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_compact.batch import ChunkBatch, QBlocks, cdiv, host_cumsum
from sglang_compact.indices import IndexBuffers, PagedIndices


@dataclass(frozen=True)
class ForwardShape:
    """What a forward pass looks like, on the host: enough to plan every kernel once.

    row_pages: pages of every row r = g * NW + w when known on the host before any search (dense
        passes, selectors that fix row lengths); None when they depend on the scores.
    """

    prefix_lens: tuple[int, ...]
    chunk_lens: tuple[int, ...]
    qblocks: QBlocks
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    sm_scale: float
    row_pages: tuple[int, ...] | None = None

    @classmethod
    def of(cls, batch: ChunkBatch, row_pages=None) -> "ForwardShape":
        return cls(tuple(batch.prefix_lens_cpu), tuple(batch.chunk_lens_cpu), batch.qblocks, batch.num_q_heads,
                   batch.num_kv_heads, batch.head_dim, batch.page_size, batch.q.dtype, batch.sm_scale,
                   None if row_pages is None else tuple(row_pages))

    @property
    def sparse(self) -> bool:
        return self.qblocks.any_sparse

    @property
    def num_rows(self) -> int:
        return self.num_kv_heads * self.qblocks.windows

    @property
    def total_tokens(self) -> int:
        return sum(self.chunk_lens)

    def context_lens(self) -> list[int]:
        return [L + C for L, C in zip(self.prefix_lens, self.chunk_lens)]

    def context_pages(self) -> list[int]:
        return [cdiv(E, self.page_size) for E in self.context_lens()]

    def rows_upper_bound(self) -> list[int]:
        """kv_indptr of the rows when each sparse one reads its whole context (the densest plan; a window
        computed apart names its own pages only, `QBlocks.rows_bound`)."""
        return host_cumsum(self.qblocks.rows_bound() * self.num_kv_heads)

    def rows_indptr(self) -> list[int] | None:
        """kv_indptr of the rows' paged indices when `row_pages` is known on the host, else None."""
        if self.row_pages is None:
            return None
        if len(self.row_pages) != self.num_rows:
            raise ValueError(f"row_pages has {len(self.row_pages)} rows, the pass has {self.num_rows}")
        return host_cumsum(self.qblocks.row_counts(self.row_pages))


class Executor(Protocol):
    """Per forward pass `plan_forward`; per layer `run`."""

    #: buffers the index kernel writes a sparse pass's indices into (None: `run` takes any indices)
    index_buffers: IndexBuffers | None

    def plan_forward(self, shape: ForwardShape, page_table: torch.Tensor) -> None:
        ...

    def run(self, batch: ChunkBatch, indices: PagedIndices | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """o [T, H_q, D] in q's dtype (into `out` when given: SGLang's output buffer, so it copies nothing);
        `indices` None for a dense pass."""
        ...

    def run_dense(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  out: torch.Tensor | None = None, chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
        """A dense pass's layer from its tensors alone (into `out` when given). `chunk_kv`: the chunk's own
        K/V [T, H_kv, D] (also stored in the pool), which an executor may read instead of the pool in a pass
        with no cached prefix."""
        ...


def rows_from_tokens(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[T, H_q, ...] -> [H_kv * T, G, ...] (rows kv-head-major)."""
    T, H_q = x.shape[:2]
    G = H_q // num_kv_heads
    return x.reshape(T, num_kv_heads, G, *x.shape[2:]).transpose(0, 1).reshape(num_kv_heads * T, G, *x.shape[2:])


def tokens_from_rows(x: torch.Tensor, num_kv_heads: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `rows_from_tokens` (written into `out`, [T, H_q, ...], when given: the same one copy)."""
    R_T, G = x.shape[:2]
    T = R_T // num_kv_heads
    tokens = x.reshape(num_kv_heads, T, G, *x.shape[2:]).transpose(0, 1)
    if out is None:
        return tokens.reshape(T, num_kv_heads * G, *x.shape[2:])
    out.view(T, num_kv_heads, G, *x.shape[2:]).copy_(tokens)
    return out
