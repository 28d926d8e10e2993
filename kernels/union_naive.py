"""Plain-torch reference for the fused block-union kernel (`kernels/union.py`)."""

from __future__ import annotations

import torch


def forced_blocks(kv_blocks: torch.Tensor, n_kv: int, sink_blocks: int, recent_blocks: int) -> torch.Tensor:
    """bool [B, n_kv]: the first `sink_blocks` and last `recent_blocks` blocks of each prefix.

    Args:
        kv_blocks: int [B] number of prefix blocks n_b of each request.
    """
    j = torch.arange(n_kv, device=kv_blocks.device)[None, :]
    n = kv_blocks.long()[:, None]
    return (j < n) & ((j < sink_blocks) | (j >= n - recent_blocks))


def union_table(mask: torch.Tensor, num_kv_heads: int, kv_blocks: torch.Tensor,
                sink_blocks: int, recent_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q-block union, intra-group union, forced blocks, clipped to each prefix.

    Args:
        mask: bool [B, H_q, NQ, NKV]
        kv_blocks: int [B] prefix blocks per request (n_b <= NKV)
    Returns:
        table bool [B, H_kv, NKV], counts int32 [B, H_kv] (blocks per row).
    """
    B, H_q, NQ, NKV = mask.shape
    G = H_q // num_kv_heads
    table = mask.reshape(B, num_kv_heads, G * NQ, NKV).any(dim=2)
    table = table | forced_blocks(kv_blocks, NKV, sink_blocks, recent_blocks)[:, None, :]
    valid = torch.arange(NKV, device=mask.device)[None, :] < kv_blocks.long()[:, None]
    table = table & valid[:, None, :]
    return table, table.sum(dim=-1, dtype=torch.int32)
