"""The selector registry: the one source of selector names, parameters and traits.

A selector is one module that defines a `Selector` subclass and a frozen
dataclass of its parameters, and registers them:

    @dataclass(frozen=True)
    class MyParams(SelectorParams):
        threshold: float = param(0.5, lo=0.0, hi=1.0, help="...")

    @register_selector("mine", params=MyParams, uses_summaries=True)
    class MySelector(Selector):
        def select(self, batch, layer, summaries): ...

The config (`CompactConfig`), the `--compact-*` flags, the evaluation and the
docs read names, parameters, bounds and help from here. Selectors outside this
package register the same way from any importable module, named by
`CompactConfig.selector_modules` (`--compact-selector-module`) or by an entry
point of the group `sglang_compact.selectors`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from sglang_compact.selectors.base import Selector

ENTRY_POINT_GROUP = "sglang_compact.selectors"

# A `query_stride` of 0 scores this many queries of each page-sized q-block (stride page_size // 16, at least 1): the
# FlashPrefill search kernel's smallest query tile (`kernels.flashprefill.MIN_QUERY_TILE`), so the cheapest search
# the kernel runs at every page size. On Qwen2.5-Coder-0.5B (page 32, stride 2) it gave the answers of stride 1
# (docs/results/accuracy_notes.md, session 31).
SCORED_QUERIES_PER_PAGE = 16


def param(default: Any, *, lo: float | None = None, hi: float | None = None, power_of_two: bool = False,
          help: str = "") -> Any:
    """A selector parameter: its default (whose type is the parameter's kind: float, int, bool, or None for a
    path string), inclusive bounds (numbers) and help text."""
    return dataclasses.field(default=default, metadata={"lo": lo, "hi": hi, "power_of_two": power_of_two,
                                                        "help": help})


def parse_layer_ids(text: str, sep: str = ",") -> tuple[int, ...]:
    """Layer ids and inclusive ranges, '21,22,23' or '20-23' (`sep` between items); ValueError otherwise."""
    out: list[int] = []
    for item in filter(None, (x.strip() for x in text.split(sep))):
        lo, dash, hi = item.partition("-")
        try:
            ids = range(int(lo), int(hi) + 1) if dash else [int(lo)]
        except ValueError:
            ids = []
        if not ids:
            raise ValueError(f"must be layer ids or ranges such as '21{sep}22{sep}23' or '20-23', got {text!r}")
        out.extend(ids)
    return tuple(out)


def parse_layer_values(text: str, lo: float, hi: float) -> dict[int, float]:
    """'2-6:0.6,13:0.2' -> {2: 0.6, ..., 6: 0.6, 13: 0.2}: values of given layers (ids or inclusive ranges, as
    `parse_layer_ids` reads them), each in [lo, hi]; a layer given twice is an error. ValueError otherwise."""
    out: dict[int, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        ids, colon, value = item.partition(":")
        try:
            v = float(value) if colon else math.nan
        except ValueError:
            v = math.nan
        if not lo <= v <= hi:
            raise ValueError(f"must be items 'layers:value' with layers such as '13' or '2-6' and a value in "
                             f"[{lo}, {hi}], separated by ',', got {text!r}")
        for layer in parse_layer_ids(ids, sep="+"):
            if layer in out:
                raise ValueError(f"layer {layer} is given twice in {text!r}")
            out[layer] = v
    return out


@dataclass(frozen=True)
class SelectorParams:
    """Base of every selector's parameter dataclass (frozen; fields declared with `param`)."""

    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    def floor_pages(self, page_size: int) -> int:
        """Pages every sparse row reads at least at this page size (its context permitting); 0: no floor (the
        fixed budgets override it). The cost gate prices rows at no less."""
        return 0

    def at_chunk(self, chunk_size: int | None) -> "SelectorParams":
        """These parameters at a server's chunked-prefill size (None or <= 0: chunked prefill off); the same
        for a selector whose parameters do not depend on it."""
        return self

    def query_stride_at(self, page_size: int) -> int:
        """The search's query stride at this page size: every s-th query of each q-block is scored. 1 for a
        selector without a `query_stride` parameter; a `query_stride` of 0 scores SCORED_QUERIES_PER_PAGE queries
        of each page (page_size // 16, at least 1)."""
        qs = getattr(self, "query_stride", 1)
        return qs if qs else max(1, page_size // SCORED_QUERIES_PER_PAGE)

    @classmethod
    def validated(cls, given: "Mapping[str, Any] | SelectorParams | None", owner: str) -> "SelectorParams":
        """An instance from a mapping of overrides (or an instance), checked against the declared kinds and
        bounds. Raises ValueError naming `owner` (e.g. "CompactConfig.selector_params") and the field."""
        if isinstance(given, cls):
            given = dataclasses.asdict(given)
        elif isinstance(given, SelectorParams):
            raise ValueError(f"{owner}: parameters of another selector ({type(given).__name__}), "
                             f"expected {cls.__name__}")
        given = dict(given or {})
        names = [f.name for f in cls.fields()]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"{owner}: unknown parameter(s) {unknown} (allowed: {', '.join(names) or 'none'}), "
                             f"got {given!r}")
        values = {}
        for f in cls.fields():
            v = given.get(f.name, f.default)
            values[f.name] = _check(f, v, f"{owner}[{f.name!r}]")
        try:
            return cls(**values)
        except ValueError as e:   # the dataclass's own checks (`__post_init__`) across its fields
            raise ValueError(f"{owner}: {e}") from None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(f: dataclasses.Field, v: Any, where: str) -> Any:
    meta = f.metadata
    kind = str if f.default is None else type(f.default)   # a parameter's kind is its default's
    lo, hi = meta.get("lo"), meta.get("hi")
    if kind is str:
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{where}: must be a string (a path), got {v!r}")
        return v
    if kind is bool:
        if not isinstance(v, bool):
            raise ValueError(f"{where}: must be true or false, got {v!r}")
        return v
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"{where}: must be an integer in [{lo}, {hi}], got {v!r}")
        if meta.get("power_of_two") and v & (v - 1):
            which = f"0 or a power of two in [1, {hi}]" if lo == 0 else f"a power of two in [{lo}, {hi}]"
            raise ValueError(f"{where}: must be {which}, got {v!r}")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or \
            (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{where}: must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


@dataclass(frozen=True)
class NoParams(SelectorParams):
    """A selector without parameters."""


@dataclass(frozen=True)
class SelectorSpec:
    """What the rest of the system needs to know about a selector.

    fixes_row_lengths: the pages each row reads depend only on the lengths (known on the host before any
        search), so a kernel whose plan needs exact lengths (FlashInfer fa3) is planned once per forward pass.
    fixes_rows_at_observing_layer: (from the parameters) the pass's first selecting layer (its observing layer,
        `srt/extend.py`) selects as usual and every later layer fills each row to that layer's page count
        (`Selector.fill`), so the row lengths are known on the host after it and one fa3 plan serves the rest
        of the pass.
    uses_summaries: it scores the pages' mean keys (`PageSummaries`), which the backend then keeps.
    uses_key_bounds: it also reads each page's per-channel key max and min (`PageSummaries(key_bounds=True)`),
        which the backend then keeps beside the mean keys (implies uses_summaries).
    expected_density: the fraction of a long context it typically reads (from the parameters and, where they
        set layers apart, the model's layer count: `expected_density(params, num_layers=None)`), which the cost
        gate weighs against its overhead.
    priced_search: the cost model's search term (the FlashPrefill mean-key kernel, calibrated per GPU) prices
        its search. False: nothing calibrated prices it, so the gate does not predict when it pays (a fixed
        context threshold, or `--compact-min-context`) and there is no observed-density fallback.
    """

    name: str
    cls: type
    params: type[SelectorParams]
    fixes_row_lengths: bool
    uses_summaries: bool
    expected_density: Callable[..., float]
    help: str
    fixes_rows_at_observing_layer: Callable[[SelectorParams], bool] = lambda _p: False
    priced_search: bool = True
    uses_key_bounds: bool = False

    def make(self, config) -> "Selector":
        return self.cls(config)


def _per_pass_density(expected_density) -> Callable[..., float]:
    """`expected_density` as `f(params, num_layers=None)`: a constant, a function of the parameters only, or one
    that also takes the model's layer count (per-layer budgets)."""
    if not callable(expected_density):
        return lambda _p, num_layers=None, d=float(expected_density): d
    try:
        takes_layers = len(inspect.signature(expected_density).parameters) >= 2
    except (TypeError, ValueError):
        takes_layers = False
    return expected_density if takes_layers else (lambda p, num_layers=None, f=expected_density: f(p))


_REGISTRY: dict[str, SelectorSpec] = {}
_entry_points_loaded = False


def register_selector(name: str, *, params: type[SelectorParams] = NoParams, fixes_row_lengths: bool = False,
                      uses_summaries: bool = False,
                      expected_density: float | Callable[..., float] = 1.0,
                      fixes_rows_at_observing_layer: Callable[[SelectorParams], bool] | None = None,
                      priced_search: bool = True, uses_key_bounds: bool = False) -> Callable[[type], type]:
    """Class decorator registering a `Selector` subclass under `name` (re-registering a name replaces it)."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"selector name {name!r} must be letters, digits, '-' or '_'")
    if not (isinstance(params, type) and issubclass(params, SelectorParams)):
        raise TypeError(f"selector {name!r}: params must be a SelectorParams dataclass, got {params!r}")
    density = _per_pass_density(expected_density)

    def deco(cls: type) -> type:
        doc = (cls.__doc__ or "").strip().splitlines()
        spec = SelectorSpec(name, cls, params, fixes_row_lengths, uses_summaries or uses_key_bounds, density,
                            doc[0] if doc else "", fixes_rows_at_observing_layer or (lambda _p: False), priced_search,
                            uses_key_bounds)
        cls.name = name
        cls.spec = spec
        _REGISTRY[name] = spec
        return cls
    return deco


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def import_selector_modules(modules: Sequence[str]) -> None:
    """Import modules that register selectors (`--compact-selector-module`); a clear error if one fails."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as e:  # an ImportError, or the module's own error
            raise ValueError(f"selector module {mod!r} could not be imported: {type(e).__name__}: {e}") from None


def selector_spec(name: str) -> SelectorSpec:
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; one of {', '.join(selector_names())}") from None


def selector_names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def describe_params() -> dict[str, list[tuple[str, Any, str]]]:
    """Per selector: (parameter, default, help), for flags and docs."""
    return {name: [(f.name, f.default, f.metadata.get("help", "")) for f in _REGISTRY[name].params.fields()]
            for name in selector_names()}

