"""`--compact-*` launch flags -> one validated `CompactConfig`.

The flags are parsed apart from SGLang's (which keeps every one of its own);
the config is validated once, then attached to SGLang's `ServerArgs`, which
SGLang hands (pickled) to every scheduler process it spawns.
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

from sglang_compact.config import PREFILL_KERNELS, SELECTOR_NAMES, SELECTOR_PARAMS, CompactConfig

BACKEND_NAME = "compact"


def add_compact_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CompactAttention (sglang-compact)")
    g.add_argument("--compact-selector", default="flashprefill",
                   help=f"pattern-search method, one of {', '.join(SELECTOR_NAMES)} (default flashprefill)")
    g.add_argument("--compact-selector-params", default=None, metavar="JSON",
                   help="selector parameters as JSON, e.g. '{\"alpha\": 0.06}'; per selector: "
                        + "; ".join(f"{k}: {', '.join(v) or '-'}" for k, v in SELECTOR_PARAMS.items()).replace("%", "%%"))
    g.add_argument("--compact-alpha", type=float, default=None,
                   help="flashprefill threshold (shorthand for --compact-selector-params '{\"alpha\": X}')")
    g.add_argument("--compact-density", type=float, default=None,
                   help="budget selector density (shorthand)")
    g.add_argument("--compact-sink-blocks", type=int, default=CompactConfig.sink_blocks)
    g.add_argument("--compact-recent-blocks", type=int, default=CompactConfig.recent_blocks)
    g.add_argument("--compact-min-prefix-len", type=int, default=CompactConfig.min_prefix_len,
                   help="cached-prefix tokens from which a chunk takes the compact path")
    g.add_argument("--compact-density-cap", type=float, default=None)
    g.add_argument("--compact-prefill-kernel", default=CompactConfig.prefill_kernel,
                   help=f"FlashInfer backend of the sparse prefix attention on CUDA, one of "
                        f"{', '.join(PREFILL_KERNELS)} (auto: fa3 on Hopper for selectors that fix the row "
                        "lengths, e.g. budget; else fa2)")
    g.add_argument("--compact-dense-final-chunk", choices=("on", "off"), default="on",
                   help="a request's last prompt chunk (the question of a long prompt) reads its whole prefix "
                        "(default on; the earlier chunks take the compact path)")
    g.add_argument("--compact-block-size", type=int, default=None,
                   help="must equal --page-size if given (a block is one KV page)")


def split_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Separate our flags from SGLang's. Ours are `--compact-*`; everything else goes to SGLang."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_compact_args(parser)
    ours, rest = parser.parse_known_args(list(argv))
    return ours, rest


def build_config(ns: argparse.Namespace, page_size: int) -> CompactConfig:
    """The validated config; raises ValueError with a one-line reason."""
    if ns.compact_block_size is not None and ns.compact_block_size != page_size:
        raise ValueError(f"--compact-block-size {ns.compact_block_size} differs from --page-size {page_size} "
                         "(a compact block is one KV page)")
    params: dict = {}
    if ns.compact_selector_params:
        try:
            params = json.loads(ns.compact_selector_params)
        except json.JSONDecodeError as e:
            raise ValueError(f"--compact-selector-params is not valid JSON: {e}") from None
        if not isinstance(params, dict):
            raise ValueError("--compact-selector-params must be a JSON object")
    if ns.compact_alpha is not None:
        params["alpha"] = ns.compact_alpha
    if ns.compact_density is not None:
        params["density"] = ns.compact_density
    return CompactConfig(block_size=page_size, selector=ns.compact_selector, selector_params=params,
                         sink_blocks=ns.compact_sink_blocks, recent_blocks=ns.compact_recent_blocks,
                         min_prefix_len=ns.compact_min_prefix_len, density_cap=ns.compact_density_cap,
                         prefill_kernel=ns.compact_prefill_kernel,
                         dense_final_chunk=ns.compact_dense_final_chunk == "on")
