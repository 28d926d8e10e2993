"""Block union: per-query-block, per-query-head masks -> one block set per (request, kv head).

    T[b, g, j] = OR_i OR_{h in group g} M[b, h, i, j]   (| forced blocks)

T is the smallest per-row set that keeps every block the mask selected, so no
coverage is lost; what it costs is density, reported by `union_stats`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.kernels import union as union_kernel
from sglang_compact.kernels import union_naive
from sglang_compact.kernels.union_naive import forced_blocks

__all__ = ["block_union", "union_table", "forced_blocks", "UnionStats", "union_stats"]


def block_union(mask: torch.Tensor, num_kv_heads: int, *, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Q-block union over the chunk and intra-group union over each kv head's query heads.

    Args:
        mask: bool [B, H_q, n_q_blocks, n_kv_blocks]
        num_kv_heads: H_kv; H_q must be a multiple of it (G = H_q / H_kv consecutive heads per group).
        forced: optional bool [B, n_kv_blocks] (or [B, H_kv, n_kv_blocks]) ORed in.
    Returns:
        bool [B, H_kv, n_kv_blocks]
    """
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(f"mask must be bool [B, H_q, NQ, NKV], got {mask.dtype} {tuple(mask.shape)}")
    B, H_q, NQ, NKV = mask.shape
    if num_kv_heads <= 0 or H_q % num_kv_heads:
        raise ValueError(f"H_q={H_q} is not a multiple of num_kv_heads={num_kv_heads}")
    table = mask.reshape(B, num_kv_heads, (H_q // num_kv_heads) * NQ, NKV).any(dim=2)
    if forced is not None:
        table = table | (forced[:, None, :] if forced.dim() == 2 else forced)
    return table


def union_table(mask: torch.Tensor, num_kv_heads: int, kv_blocks: torch.Tensor,
                sink_blocks: int, recent_blocks: int, *, use_triton: bool | None = None,
                out_table: torch.Tensor | None = None, out_counts: torch.Tensor | None = None):
    """Fused union + forced blocks + clip to each prefix, with per-row counts.

    Args:
        mask: bool [B, H_q, NQ, NKV]; kv_blocks: int32 [B] prefix blocks n_b.
    Returns:
        table bool [B, H_kv, NKV], counts int32 [B, H_kv].
    Runs the Triton kernel on CUDA (or when `use_triton`), else the torch reference.
    """
    if use_triton is None:
        use_triton = mask.is_cuda
    if use_triton:
        return union_kernel.union_table(mask, num_kv_heads, kv_blocks, sink_blocks, recent_blocks,
                                        out_table=out_table, out_counts=out_counts)
    return union_naive.union_table(mask, num_kv_heads, kv_blocks, sink_blocks, recent_blocks)


@dataclass
class UnionStats:
    """Densities over the valid (query block, prefix block) cells; device scalars until read.

    selected:   fraction of prefix blocks a query block selects, averaged over query blocks and heads
    after_q:    fraction of (q-head, kv-block) kept after the Q-block union
    after_group: fraction of (kv-head, kv-block) rows kept after the group union and forced
                blocks: the density the paged kernel actually reads.
    """

    selected: torch.Tensor
    after_q: torch.Tensor
    after_group: torch.Tensor

    def as_floats(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in ("selected", "after_q", "after_group")}


def union_stats(mask: torch.Tensor, table: torch.Tensor, kv_blocks: torch.Tensor,
                q_blocks: torch.Tensor) -> UnionStats:
    """Densities before and after each union (no host sync).

    Args:
        mask: bool [B, H_q, NQ, NKV] selector output (False outside valid cells)
        table: bool [B, H_kv, NKV] union table (False beyond each prefix)
        kv_blocks, q_blocks: int [B] valid kv / q blocks per request
    """
    H_q, H_kv = mask.shape[1], table.shape[1]
    kvb = kv_blocks.to(torch.float64)
    per_head = kvb.sum().clamp(min=1)
    # every figure weights request b by its n_b blocks, so selected <= after_q <= after_group
    per_q_block = mask.sum(dim=(1, 2, 3), dtype=torch.float64) / q_blocks.to(torch.float64).clamp(min=1)
    selected = per_q_block.sum() / (per_head * H_q)
    after_q = mask.any(dim=2).sum(dtype=torch.float64) / (per_head * H_q)
    after_group = table.sum(dtype=torch.float64) / (per_head * H_kv)
    return UnionStats(selected, after_q, after_group)
