"""Page summaries inside SGLang's KV budget.

The summaries (`PageSummaries`: float32 key sums per page, kv head and layer, plus a count) live
beside the KV pool. SGLang sizes the pool as the memory left after the weights (times
`--mem-fraction-static`) divided by the pool's bytes per token; an AFTER hook on that per-token
size (`compat.POOL_CELL_SIZE`) adds the summaries' share, so the pool shrinks to make room for
them and a server sized by `--mem-fraction-static` does not run out of memory under load.

Per token and layer the pool holds K and V (2 x H_kv x D x kv bytes); the summaries hold
H_kv x D x 4 + 4 bytes per page, i.e. (H_kv x D x 4 + 4) / P per token: 1/P of the pool at bf16
(1.6% at page 64). A selector that reads the keys' page bounds (`SelectorSpec.uses_key_bounds`) adds a
channel max and min per page in the pool's dtype, 2 x H_kv x D x kv bytes per page: another 1/P of the pool.
"""

from __future__ import annotations

import math

import torch

from sglang_compact.srt import compat


def summary_bytes_per_token(cell_size: int, num_layers: int, kv_dtype: torch.dtype, page_size: int,
                            key_bounds: bool = False) -> int:
    """The summaries' bytes per pool token, from the pool's own bytes per token (K and V of every layer);
    key_bounds: with the pages' key max and min (in the pool's dtype)."""
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    kv_elems_per_layer = cell_size / (2 * num_layers * itemsize)  # H_kv x D
    per_page = kv_elems_per_layer * 4 + 4
    if key_bounds:
        per_page += 2 * kv_elems_per_layer * itemsize
    return math.ceil(num_layers * per_page / page_size)


def _summarizing_config(server_args):
    """This server's compact config if its backend keeps page summaries (its selector reads them), else None."""
    from sglang_compact.config import CompactConfig

    if "compact" not in compat.attention_backends(server_args):
        return None
    config = compat.attached_config(server_args)
    if config is None:
        try:
            config = CompactConfig(block_size=int(server_args.page_size or 64))
        except ValueError:
            return None
    return config if config.spec.uses_summaries and config.selector != "dense" else None


def summaries_in_use(server_args) -> bool:
    """Whether this server's compact backend keeps page summaries (its selector reads them)."""
    return _summarizing_config(server_args) is not None


def add_summaries_to_cell_size(cell_size, configurator, kvc, num_layers, *args, **kwargs):
    """AFTER hook of the pool's bytes per token: the summaries' share added when they are in use."""
    try:
        server_args, page_size, kv_dtype = compat.cell_size_context(kvc)
        config = _summarizing_config(server_args)
        if cell_size and num_layers and config is not None:
            bounds = config.spec.uses_key_bounds
            return cell_size + summary_bytes_per_token(cell_size, int(num_layers), kv_dtype, page_size, bounds)
    except Exception:  # an SGLang we do not understand: leave its sizing alone
        return None
    return None
