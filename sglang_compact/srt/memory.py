"""Page summaries inside SGLang's KV budget.

The summaries (`PageSummaries`: float32 key sums per page, kv head and layer, plus a count) live
beside the KV pool. SGLang sizes the pool as the memory left after the weights (times
`--mem-fraction-static`) divided by the pool's bytes per token; an AFTER hook on that per-token
size (`compat.POOL_CELL_SIZE`) adds the summaries' share, so the pool shrinks to make room for
them and a server sized by `--mem-fraction-static` does not run out of memory under load.

Per token and layer the pool holds K and V (2 x H_kv x D x kv bytes); the summaries hold
H_kv x D x 4 + 4 bytes per page, i.e. (H_kv x D x 4 + 4) / P per token: 1/P of the pool at bf16
(1.6% at page 64).
"""

from __future__ import annotations

import math

import torch

from sglang_compact.srt import compat


def summary_bytes_per_token(cell_size: int, num_layers: int, kv_dtype: torch.dtype, page_size: int) -> int:
    """The summaries' bytes per pool token, from the pool's own bytes per token (K and V of every layer)."""
    kv_elems_per_layer = cell_size / (2 * num_layers * torch.empty((), dtype=kv_dtype).element_size())  # H_kv x D
    return math.ceil(num_layers * (kv_elems_per_layer * 4 + 4) / page_size)


def summaries_in_use(server_args) -> bool:
    """Whether this server's compact backend keeps page summaries (its selector reads them)."""
    from sglang_compact.config import CompactConfig

    if "compact" not in compat.attention_backends(server_args):
        return False
    config = compat.attached_config(server_args)
    if config is None:
        try:
            config = CompactConfig(block_size=int(server_args.page_size or 64))
        except ValueError:
            return False
    return config.spec.uses_summaries and config.selector != "dense"


def add_summaries_to_cell_size(cell_size, configurator, kvc, num_layers, *args, **kwargs):
    """AFTER hook of the pool's bytes per token: the summaries' share added when they are in use."""
    try:
        server_args, page_size, kv_dtype = compat.cell_size_context(kvc)
        if cell_size and num_layers and summaries_in_use(server_args):
            return cell_size + summary_bytes_per_token(cell_size, int(num_layers), kv_dtype, page_size)
    except Exception:  # an SGLang we do not understand: leave its sizing alone
        return None
    return None
