"""Selector interface, registry and the shared scoring helpers.

A selector looks at one chunk per request (its queries) and the prefix (its
keys, or page summaries) and returns a block mask

    mask  bool [B, H_q, NQ, NKV]   query block i of request b may read prefix block j

with False everywhere outside a request's valid (query block, prefix block)
cells. Query blocks have the KV block size. Scoring selectors also return
`scores` float [B, H_q, NQ, NKV] (or [B, H_kv, NQ, NKV], already reduced over each
group's heads, as `budget` does; higher = more important) which the density
cap ranks by.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from sglang_compact.batch import ChunkBatch
from sglang_compact.config import CompactConfig
from sglang_compact.kernels import flashprefill as flashprefill_kernel
from sglang_compact.kernels import flashprefill_naive
from sglang_compact.kernels.union_naive import forced_blocks

NEG_INF = float("-inf")


class Selection:
    """A selector's output.

    mask:   bool [B, H_q, NQ, NKV] (see the module docstring).
    scores: float [B, H_q or H_kv, NQ, NKV] or None.
    rows:   bool [B, H_kv, NKV] or None: set when the selection is the same for every query block
            and every query head of a kv group (`budget`, `dense`). The mask is then derived from it only
            when asked for, and the union of such a selection is the rows themselves.
    """

    def __init__(self, mask: torch.Tensor | None = None, scores: torch.Tensor | None = None, *,
                 rows: torch.Tensor | None = None, valid: torch.Tensor | None = None, group_size: int = 1):
        if (mask is None) == (rows is None):
            raise ValueError("Selection needs exactly one of mask and rows")
        if rows is not None and valid is None:
            raise ValueError("Selection(rows=...) needs valid (bool [B, 1, NQ, NKV]) to derive its mask")
        self._mask, self.scores, self._rows, self._valid, self._group = mask, scores, rows, valid, group_size

    @property
    def rows(self) -> torch.Tensor | None:
        return self._rows

    @rows.setter
    def rows(self, value: torch.Tensor) -> None:
        if self._rows is None:
            raise ValueError("this Selection is a mask, not rows")
        self._rows, self._mask = value, None

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = (self._rows.repeat_interleave(self._group, dim=1)[:, :, None, :] & self._valid).contiguous()
        return self._mask

    @mask.setter
    def mask(self, value: torch.Tensor) -> None:
        self._mask, self._rows = value, None


class Selector:
    """Base class. Subclasses set `name` and implement `select`."""

    name: str = ""
    #: reads pooled keys (page summaries) rather than the prefix's keys
    uses_summaries: bool = False

    def __init__(self, config: CompactConfig):
        self.config = config

    def row_blocks(self, n_blocks: Sequence[int]) -> list[int] | None:
        """Blocks every (request, kv head) row reads after the unions (forced blocks
        included), per request, when the selector fixes that number without looking at
        the data; None when it depends on the scores (threshold selectors).

        Args:
            n_blocks: prefix blocks n_b of each request on the compact path.
        """
        return None

    def select(self, batch: ChunkBatch, layer: int = 0, pooled_keys: torch.Tensor | None = None) -> Selection:
        """Args:
            batch: the chunks and their prefixes.
            layer: layer index (for per-layer weights).
            pooled_keys: float [B, NKV, H_kv, D] mean key per prefix block, from page
                summaries; computed from the pool when None.
        """
        raise NotImplementedError


_REGISTRY: dict[str, type[Selector]] = {}


def register_selector(name: str) -> Callable[[type[Selector]], type[Selector]]:
    def deco(cls: type[Selector]) -> type[Selector]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def make_selector(config: CompactConfig) -> Selector:
    try:
        cls = _REGISTRY[config.selector]
    except KeyError:
        raise ValueError(f"unknown selector {config.selector!r}; registered: {sorted(_REGISTRY)}") from None
    return cls(config)


def registered_selectors() -> list[str]:
    return sorted(_REGISTRY)


# --- shared helpers -------------------------------------------------------------------

def valid_cells(batch: ChunkBatch, q_block: int) -> torch.Tensor:
    """bool [B, 1, NQ, NKV]: (query block, prefix block) cells that exist (once per batch)."""
    return batch.valid_cells(q_block)


def pooled_keys_from_pool(batch: ChunkBatch) -> torch.Tensor:
    """float32 [B, NKV, H_kv, D]: mean of each prefix block's valid keys (O(prefix tokens))."""
    k, valid = batch.prefix_keys()  # [B, H_kv, NKV*P, D], [B, NKV*P]
    B, H, LP, D = k.shape
    P = batch.page_size
    NKV = LP // P
    s = k.to(torch.float32).reshape(B, H, NKV, P, D).sum(dim=3)
    n = valid.reshape(B, NKV, P).sum(dim=2).clamp(min=1).to(torch.float32)  # [B, NKV]
    return (s / n[:, None, :, None]).permute(0, 2, 1, 3)


def pooled_block_scores(batch: ChunkBatch, pooled_keys: torch.Tensor, q_block: int,
                        use_triton: bool | None = None, group_max: bool = False,
                        query_stride: int = 1) -> torch.Tensor:
    """FlashPrefill-style block scores against pooled keys (see `kernels/flashprefill_naive.py`).

    s[t, j] = q_t . kbar_j * scale, softmax over the valid prefix blocks j,
    then the max over the queries t of each query block (every `query_stride`-th query only: the
    search's cost falls by that factor).

    Returns:
        float32 [B, H_q, NQ, NKV] ([B, H_kv, NQ, NKV], the max over each group's heads, with
        `group_max`); 0 outside valid cells.
    Runs the Triton kernel on CUDA (or when `use_triton`), else the torch reference.
    """
    if use_triton is None:
        use_triton = batch.q.is_cuda
    D = batch.head_dim
    if D < 16 or D & (D - 1) or q_block // query_stride < 16:
        use_triton = False  # the kernel tiles head_dim, and each block's scored queries, as power-of-two blocks
    impl = flashprefill_kernel.block_scores if use_triton else flashprefill_naive.block_scores
    return impl(batch.q, batch.cu_chunk, batch.chunk_lens_cpu, pooled_keys, batch.kv_blocks(), batch.sm_scale,
                q_block, batch.max_q_blocks(q_block), group_max=group_max, query_stride=query_stride)


def threshold_rows(scores: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """Keep cells scoring >= alpha * (row max). Rows are the last dim."""
    s = scores.masked_fill(~valid, NEG_INF)
    rowmax = s.amax(dim=-1, keepdim=True)
    return (s >= alpha * rowmax) & valid


def top_p_rows(mass: torch.Tensor, valid: torch.Tensor, p: float) -> torch.Tensor:
    """Smallest set of cells per row (last dim) whose mass reaches p of the row's mass.

    The cell that crosses p is kept; a row keeps at least one valid cell.
    """
    m = mass.masked_fill(~valid, 0.0).to(torch.float64)
    total = m.sum(dim=-1, keepdim=True)
    order = torch.argsort(m, dim=-1, descending=True, stable=True)
    ms = m.gather(-1, order)
    before = torch.cumsum(ms, dim=-1) - ms  # mass strictly before this cell
    keep_sorted = before < p * total
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep & valid


def row_budget(n_blocks: int, fraction: float, sink_blocks: int, recent_blocks: int) -> int:
    """The number of blocks `top_blocks_per_row` keeps of a row of n_blocks prefix blocks, on the host
    (same formula and rounding): min(n, max(ceil(fraction * n), 1, forced))."""
    forced = min(n_blocks, sink_blocks + recent_blocks)
    return min(n_blocks, max(math.ceil(n_blocks * fraction - 1e-9), 1, forced))


def top_blocks_per_row(row_scores: torch.Tensor, kv_blocks: torch.Tensor, max_blocks: int, fraction: float,
                       sink_blocks: int, recent_blocks: int, allowed: torch.Tensor | None = None,
                       batch: ChunkBatch | None = None) -> torch.Tensor:
    """Keep min(n_b, max(ceil(fraction * n_b), 1, forced)) blocks of each (request b, kv head) row:
    the forced (sink / recent) blocks first, then the best-scoring ones (equal scores in any order).
    The `budget` selector's ranking, and the density cap's (with `allowed` = the union table, of
    which at most that many cells survive). `row_budget` is its host twin.

    Args:
        row_scores: float [B, H_kv, NKV]; kv_blocks: int [B] (device); max_blocks: host bound on
            every row's count (max over the batch of n_b suffices); allowed: bool [B, H_kv, NKV]
            cells that may be kept (default every valid prefix block); batch: the batch kv_blocks
            belongs to, whose store keeps the per-batch part (bias, counts) for the next layers.
    Returns:
        bool [B, H_kv, NKV]
    """
    B, H, NKV = row_scores.shape
    dev = row_scores.device
    k_max = min(max_blocks, NKV)
    if k_max <= 0:
        return torch.zeros(B, H, NKV, dtype=torch.bool, device=dev)

    def per_batch():
        n = kv_blocks.to(torch.long)[:, None]
        valid = torch.arange(NKV, device=dev) < n                         # [B, NKV]
        forced = forced_blocks(kv_blocks, NKV, sink_blocks, recent_blocks)
        # +inf ranks forced blocks first, -inf puts blocks past the prefix last
        bias = torch.zeros(B, 1, NKV, dtype=torch.float32, device=dev)
        bias.masked_fill_(~valid[:, None], float("-inf")).masked_fill_(forced[:, None], float("inf"))
        # the epsilon keeps 0.3 * 10 at 3 blocks, not 4
        k = torch.ceil(n.to(torch.float64) * fraction - 1e-9).to(torch.long).clamp(min=1)
        k = torch.minimum(torch.maximum(k, forced.sum(-1, keepdim=True)), n)  # [B, 1]
        keep = torch.arange(k_max, device=dev)[None, None, :] < k[:, :, None]  # [B, 1, k_max]
        return valid, forced, bias, keep

    key = ("top_blocks_per_row", NKV, k_max, fraction, sink_blocks, recent_blocks)
    valid, forced, bias, keep = batch.memo(key, per_batch) if batch is not None else per_batch()
    if allowed is None:
        ranked = row_scores.to(torch.float32) + bias
    else:
        ranked = torch.where(forced[:, None], float("inf"),
                             torch.where(valid[:, None] & allowed, row_scores.to(torch.float32), float("-inf")))
    top = ranked.topk(k_max, dim=-1).indices                          # [B, H, k_max], best first
    out = torch.zeros(B, H, NKV, dtype=torch.bool, device=dev).scatter_(-1, top, keep.expand(B, H, k_max))
    return out if allowed is None else out & allowed
