"""Plain-torch reference for the window-union kernel (`kernels/union.py`)."""

from __future__ import annotations

import torch

from sglang_compact.batch import forced_pages


def union_table(mask: torch.Tensor, num_kv_heads: int, w: dict, sink_blocks: int,
                recent_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (kv head g, window w): the pages a query head of the group selected for a q-block of the
    window, plus the forced pages, within the window's context 0..last.

    Args:
        mask: bool [H_kv * G, NQB, NKV] per (query head or kv head with G = 1) and q-block
        w:    the windows' w_first / w_last / w_sparse / w_qlo / w_qhi (int [NW] each, see `QBlocks.on`)
    Returns:
        table bool [H_kv, NW, NKV], counts int32 [H_kv * NW] (rows r = g * NW + w).
    """
    H, NQB, NKV = mask.shape
    G = H // num_kv_heads
    NW = w["w_first"].numel()
    per_head = mask.reshape(num_kv_heads, G, NQB, NKV).any(dim=1)                       # [H_kv, NQB, NKV]
    qb_window = torch.repeat_interleave(torch.arange(NW, device=mask.device),
                                        (w["w_qhi"] - w["w_qlo"]).long(), output_size=NQB)
    hits = torch.zeros(num_kv_heads, NW, NKV, dtype=torch.int32, device=mask.device)
    table = hits.index_add_(1, qb_window, per_head.to(torch.int32)) > 0
    valid = torch.arange(NKV, device=mask.device)[None, :] <= w["w_last"].long()[:, None]
    table = (table & valid[None]) | forced_pages(w["w_first"], w["w_last"], w["w_sparse"], NKV, sink_blocks,
                                                 recent_blocks)[None]
    return table, table.sum(dim=-1, dtype=torch.int32).reshape(-1)
