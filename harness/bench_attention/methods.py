"""The benchmarked methods: their names, selection by fnmatch pattern, and their selector configuration."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from sglang_compact.config import CompactConfig

try:
    import flashinfer  # noqa: F401
    HAVE_FI = True
    FI_VERSION = getattr(flashinfer, "__version__", "?")
except Exception as e:  # noqa: BLE001
    HAVE_FI = False
    FI_VERSION = f"unavailable ({type(e).__name__})"

DEFAULT_METHODS = ("dense_*,compact_flashprefill,compact_xattention,compact_budget_*,compact_fa3_flashprefill,"
                   "compact_fa3_budget_*,compact_flashprefill_fixed,compact_fa3_flashprefill_fixed,"
                   "bsparse_flashprefill,bsparse_xattention,quoka")


@dataclass
class Method:
    name: str
    kind: str                    # dense | compact | bsparse | quoka
    backend: str | None = None   # fa2 / fa3 / torch
    selector: str | None = None
    params: dict = field(default_factory=dict)
    fixed_density: float | None = None


def known_methods(budgets: list[float]) -> list[Method]:
    ms = [Method("dense_fa2", "dense", "fa2"), Method("dense_fa3", "dense", "fa3"), Method("dense_torch", "dense", "torch")]
    sels = [("flashprefill", "flashprefill", None), ("xattention", "xattention", None)]
    sels += [(f"budget_{d}", "budget", d) for d in budgets]
    for prefix, bk in (("compact", "fa2"), ("compact_fa3", "fa3")):
        for tag, sel, d in sels:
            ms.append(Method(f"{prefix}_{tag}", "compact", bk, sel, fixed_density=d))
    for tag, sel, d in sels:
        ms.append(Method(f"bsparse_{tag}", "bsparse", None, sel, fixed_density=d))
    # budgets ranked by XAttention's mass estimate (its torch search against budget's mean-key kernel)
    for prefix, bk in (("compact", "fa2"), ("compact_fa3", "fa3")):
        ms += [Method(f"{prefix}_mass_budget_{d}", "compact", bk, "mass_budget", fixed_density=d) for d in budgets]
    # budgets ranked by Quest's bound from the pages' key max / min (the same kernel as budget's, two dots per tile)
    for prefix, bk in (("compact", "fa2"), ("compact_fa3", "fa3")):
        ms += [Method(f"{prefix}_quest_budget_{d}", "compact", bk, "quest_budget", fixed_density=d) for d in budgets]
    # the default selector with its rows fixed at the pass's observing layer (on fa3: planned once)
    for prefix, bk in (("compact", "fa2"), ("compact_fa3", "fa3")):
        ms.append(Method(f"{prefix}_flashprefill_fixed", "compact", bk, "flashprefill", params={"fix_rows": True}))
    ms.append(Method("quoka", "quoka"))
    return ms


def select_methods(spec: str, budgets: list[float], fi_usable: bool) -> list[Method]:
    pats = [p.strip() for p in spec.split(",") if p.strip()]
    out = [m for m in known_methods(budgets) if any(fnmatch.fnmatchcase(m.name, p) for p in pats)]
    unknown = [p for p in pats if not any(fnmatch.fnmatchcase(m.name, p) for m in known_methods(budgets))]
    if unknown:
        raise SystemExit(f"--methods: no method matches {unknown}; known: {[m.name for m in known_methods(budgets)]}")
    if not fi_usable and not any(m.name == "dense_torch" for m in out):
        out.insert(0, Method("dense_torch", "dense", "torch"))  # the baseline without FlashInfer
    if fi_usable:
        out = [m for m in out if m.name != "dense_torch" or "dense_torch" in pats]
    return out


def query_stride_run(args, m: Method) -> int | None:
    """The query stride the method's search runs with (`mass_budget`: its row_stride); None: no strided search."""
    if not m.selector:
        return None
    params = selector_config(args, m).params
    if hasattr(params, "query_stride"):
        return params.query_stride_at(args.page_size)
    return getattr(params, "row_stride", None)


def selector_config(args, m: Method, union_window: int | None = None) -> CompactConfig:
    # --query-stride unset: the selector's own default (`quest_budget`: 16 scored queries of each page)
    given = {} if args.query_stride is None else {"query_stride": args.query_stride}
    if m.selector == "flashprefill":
        params = {"alpha": args.alpha, **given, **m.params}
    elif m.selector == "xattention":
        params = {"threshold": args.xattn_threshold, "stride": args.xattn_stride}
    elif m.selector == "mass_budget":
        params = {"density": m.fixed_density, "stride": args.xattn_stride}
        if args.query_stride is not None:
            params["row_stride"] = args.query_stride
    else:
        params = {"density": m.fixed_density, **given}
    # the benchmark's batches fix their windows (`union_window` tokens) and make every one sparse: min_context and
    # dense_tail are not read
    return CompactConfig(block_size=args.page_size, selector=m.selector, selector_params=params,
                         sink_blocks=args.sink_blocks, recent_blocks=args.recent_blocks, min_context=0, dense_tail=0,
                         union_window=union_window)


class Skip(Exception):
    """A method that cannot run here (recorded as status 'skipped')."""
