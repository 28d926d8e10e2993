"""`--compact-*` launch flags -> one validated `CompactConfig`.

The flags are parsed apart from SGLang's (which keeps every one of its own);
the config is validated once, then attached to SGLang's `ServerArgs`, which
SGLang hands (pickled) to every scheduler process it spawns. Selector names,
parameters and their help come from the selector registry.
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

from sglang_compact.config import DENSE_KERNELS, PREFILL_KERNELS, PREFIX_CACHE_POLICIES, CompactConfig, parse_layer_ids
from sglang_compact.selectors.registry import describe_params, import_selector_modules, selector_names

PROG = "sglang_compact.launch_server"
#: parameter shorthands: flag -> (selector, parameter)
# flag -> (the selectors that take it, their parameter)
SHORTHANDS = {"--compact-alpha": (("flashprefill",), "alpha"),
              "--compact-density": (("quest_budget", "budget", "mass_budget"), "density")}


def _auto_or(kind, lo: float, hi: float | None, what: str):
    """An argparse type: 'auto' (None) or a `kind` number in [lo, hi]."""
    def parse(value: str):
        if value == "auto":
            return None
        try:
            x = kind(value)
        except ValueError:
            x = None
        if x is None or x != x or x < lo or (hi is not None and x > hi):   # x != x: nan
            raise argparse.ArgumentTypeError(f"must be 'auto' or {what}, got {value!r}")
        return x
    return parse


_min_context = _auto_or(int, 0, None, "a number of tokens >= 0")
_dense_above = _auto_or(float, 0.0, 1.0, "a density in [0, 1]")


def _layer_ids(value: str) -> tuple[int, ...]:
    """An argparse type: layer ids and ranges, '21,22,23' or '20-23'."""
    try:
        return parse_layer_ids(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_compact_args(parser: argparse.ArgumentParser) -> None:
    d = CompactConfig()
    params = "; ".join(f"{name}: " + (", ".join(f"{p} (default {default}: {help_})" for p, default, help_ in ps) or "-")
                       for name, ps in describe_params().items())
    g = parser.add_argument_group("CompactAttention (sglang-compact)")
    g.add_argument("--compact-selector", default=d.selector,
                   help=f"pattern-search method, one of {', '.join(selector_names())} (default {d.selector})")
    g.add_argument("--compact-selector-module", action="append", default=[], metavar="MODULE",
                   help="import MODULE (which registers a selector) before looking the selector up; repeatable")
    g.add_argument("--compact-selector-params", default=None, metavar="JSON",
                   help=("selector parameters as a JSON object, e.g. '{\"alpha\": 0.3}'; per selector: " + params)
                   .replace("%", "%%"))
    g.add_argument("--compact-alpha", type=float, default=None,
                   help="flashprefill threshold (shorthand for --compact-selector-params '{\"alpha\": X}')")
    g.add_argument("--compact-density", type=float, default=None,
                   help="the fixed-budget selectors' density: quest_budget (the default), budget, mass_budget "
                        "(shorthand for --compact-selector-params '{\"density\": X}'); it holds at every chunk "
                        "size (the default's 0.25 becomes 0.33 from --chunked-prefill-size 8192: chunk_density)")
    g.add_argument("--compact-sink-blocks", type=int, default=d.sink_blocks,
                   help=f"leading pages every q-block reads (default {d.sink_blocks})")
    g.add_argument("--compact-recent-blocks", type=int, default=d.recent_blocks,
                   help=f"pages before a q-block's own page it always reads (default {d.recent_blocks})")
    g.add_argument("--compact-union-window", type=int, default=None, metavar="TOKENS",
                   help="tokens of a union window: the queries of one window (at absolute positions) read one "
                        "union of their selections (default: min(1024, --chunked-prefill-size); a multiple of "
                        "--page-size dividing --chunked-prefill-size)")
    g.add_argument("--compact-min-context", "--compact-min-prefix-len", dest="compact_min_context",
                   type=_min_context, default=None, metavar="auto|TOKENS",
                   help="context (tokens before a q-block) from which it reads a selection; auto (default): the "
                        "cost gate's break-even for this GPU, model and chunk size")
    g.add_argument("--compact-dense-tail", type=int, default=d.dense_tail, metavar="TOKENS",
                   help=f"the union windows holding the last TOKENS prompt tokens read every page (default "
                        f"{d.dense_tail}; 0: only a prompt's last, partial window)")
    g.add_argument("--compact-dense-above", type=_dense_above, default=None, metavar="auto|DENSITY",
                   help="a sparse window whose selection at the forward pass's second layer reads more than DENSITY "
                        "of its context pages reads every page instead (1: never); auto (default): the cost "
                        "model's break-even density for this GPU, where the sparse rows stop paying")
    g.add_argument("--compact-dense-layers", type=_layer_ids, default=(), metavar="IDS",
                   help="model layers that read every page in a sparse forward pass, e.g. '21-23' (default: none): "
                        "where the selection loses attention mass (measure with scripts/eval_longctx.py fidelity); "
                        "the gate prices them as reading every page")
    g.add_argument("--compact-density-cap", type=float, default=None,
                   help="upper bound on each row's density, in (0, 1]")
    g.add_argument("--compact-prefill-kernel", default=d.prefill_kernel, choices=PREFILL_KERNELS,
                   help="kernel of the sparse rows on CUDA: auto (default: sgl-fa3 where it runs, else FlashInfer's "
                        "fa3 on Hopper where one plan serves every layer, else fa2), fa2, fa3 (FlashInfer's), sgl-fa3 "
                        "(sgl_kernel's FA3, what stock --attention-backend fa3 runs: planned once for every selector; "
                        "Hopper)")
    g.add_argument("--compact-dense-kernel", default=d.dense_kernel, choices=DENSE_KERNELS,
                   help="kernel of passes with nothing sparse in them, on CUDA: auto (default: sgl-fa3 where it runs, "
                        "else flashinfer), sgl-fa3 (sgl_kernel's FA3, what stock --attention-backend fa3 runs; "
                        "Hopper), flashinfer (the --compact-prefill-kernel)")
    g.add_argument("--compact-recall-every", type=int, default=d.recall_every, metavar="N",
                   help="every N-th sparse forward pass, one layer measures how much of its attention mass the "
                        "selection reads (sglang:compact_recall on /metrics; needs --enable-metrics; default 0: off)")
    g.add_argument("--compact-prefix-cache", default=d.prefix_cache, choices=PREFIX_CACHE_POLICIES,
                   help="exact (default): the radix cache keeps only KV a cold run of every longer prompt would "
                        "compute, so an answer never depends on what is cached, and a conversation's next turn "
                        "recomputes the last turn's dense tail, last window and output; reuse: it keeps and serves "
                        "them as stock SGLang does (a hit recomputes at most one window), and an answer can depend "
                        "on what was cached before it")
    g.add_argument("--compact-block-size", type=int, default=None,
                   help="must equal --page-size if given (a block is one KV page)")


def split_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Separate our flags from SGLang's. Ours are `--compact-*`; everything else goes to SGLang."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    add_compact_args(parser)
    ours, rest = parser.parse_known_args(list(argv))
    return ours, rest


def build_config(ns: argparse.Namespace, page_size: int) -> CompactConfig:
    """The validated config; raises ValueError with a one-line reason that says how to fix it."""
    if ns.compact_block_size is not None and ns.compact_block_size != page_size:
        raise ValueError(f"--compact-block-size {ns.compact_block_size} differs from --page-size {page_size}: "
                         "drop --compact-block-size (a compact block is one KV page)")
    import_selector_modules(ns.compact_selector_module)
    if ns.compact_selector not in selector_names():
        raise ValueError(f"--compact-selector {ns.compact_selector!r}: use one of {', '.join(selector_names())} "
                         "(or --compact-selector-module to import another)")
    params: dict = {}
    if ns.compact_selector_params:
        try:
            params = json.loads(ns.compact_selector_params)
        except json.JSONDecodeError as e:
            raise ValueError(f"--compact-selector-params is not valid JSON ({e}): give an object such as "
                             "'{\"alpha\": 0.3}'") from None
        if not isinstance(params, dict):
            raise ValueError("--compact-selector-params must be a JSON object, such as '{\"alpha\": 0.3}'")
    for flag, (selectors, name) in SHORTHANDS.items():
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if ns.compact_selector not in selectors:
            raise ValueError(f"{flag} sets the {' / '.join(selectors)} selector's {name}: add --compact-selector "
                             f"{selectors[0]}, or drop {flag} (the {ns.compact_selector} selector's parameters go in "
                             "--compact-selector-params)")
        params[name] = value
    return CompactConfig(block_size=page_size, selector=ns.compact_selector, selector_params=params,
                         selector_modules=tuple(ns.compact_selector_module), sink_blocks=ns.compact_sink_blocks,
                         recent_blocks=ns.compact_recent_blocks, union_window=ns.compact_union_window,
                         min_context=ns.compact_min_context,
                         dense_tail=ns.compact_dense_tail, dense_above=ns.compact_dense_above,
                         dense_layers=ns.compact_dense_layers,
                         density_cap=ns.compact_density_cap,
                         prefill_kernel=ns.compact_prefill_kernel,
                         dense_kernel=ns.compact_dense_kernel, recall_every=ns.compact_recall_every,
                         prefix_cache=ns.compact_prefix_cache)


def config_error_message(e: ValueError) -> str:
    """A config error as a flag-level message: `CompactConfig.sink_blocks: ...` -> `--compact-sink-blocks: ...`."""
    msg = str(e)
    if msg.startswith("CompactConfig."):
        field, _, rest = msg[len("CompactConfig."):].partition(":")
        flag = {"selector_params": "--compact-selector-params", "block_size": "--page-size",
                "min_context": "--compact-min-context", "union_window": "--compact-union-window"}.get(field.split("[")[0],
                                                            "--compact-" + field.split("[")[0].replace("_", "-"))
        return f"{flag}{field[len(field.split('[')[0]):]}:{rest}"
    return msg
