"""Launching our Triton kernels with less host time per call.

`JITFunction.__getitem__(grid)(*args)` binds and specializes every argument, builds a cache key and looks the
compiled kernel up on each call: tens of microseconds of Python per launch, paid by every layer of a forward
pass (SGLang's prefill CUDA graphs run attention eagerly, so a host-bound pass pays it in full). `Launcher`
does that work once per argument signature: the first call of a signature goes through Triton (compiling if
needed) and keeps the `CompiledKernel` it returns; later calls with the same signature launch it through
Triton's own launcher (`CompiledKernel[grid](*args)`), skipping the binding.

The signature key is at least as fine as Triton's specialization (what selects a compiled kernel): per
tensor its dtype and device and whether its address is 16-byte aligned; per integer whether it is 1, divisible
by 16, and which of Triton's integer types holds it; constexprs and launch options by value; the kinds of the
other arguments. `tests/test_kernels.py::test_launcher_key_is_at_least_as_fine_as_tritons` checks that claim
against Triton's own specializer. Launch hooks (profilers such as Proton) and Triton's interpreter take
Triton's path on every call.

Off unless `SGLANG_COMPACT_CACHED_LAUNCH=1` (or `Launcher.enabled = True`): the cached path runs only on a GPU,
and is switched on by default once the GPU suite and a host profile have checked it there.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton


def _hook_is_set(hook) -> bool:
    """Whether a launch hook is set: Triton 3.6 always holds a `HookChain` there, set when its `calls` are not
    empty; earlier versions hold None or the hook itself."""
    return hook is not None and bool(getattr(hook, "calls", True))


try:  # Triton >= 3.4 keeps the launch hooks in knobs; before, on CompiledKernel
    from triton import knobs as _knobs

    def _hooked() -> bool:
        return _hook_is_set(_knobs.runtime.launch_enter_hook) or _hook_is_set(_knobs.runtime.launch_exit_hook)
except ImportError:  # pragma: no cover - older Triton
    from triton.compiler import CompiledKernel as _CK

    def _hooked() -> bool:
        return (_hook_is_set(getattr(_CK, "launch_enter_hook", None))
                or _hook_is_set(getattr(_CK, "launch_exit_hook", None)))

_I32 = (-(1 << 31), 1 << 31)
_U64 = 1 << 63


def _arg_key(value: Any, constexpr: bool):
    if constexpr:
        return ("c", value)
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):   # before int: a bool is an int
        return ("b", value)
    if isinstance(value, int):
        return ("i", value == 1, value % 16 == 0, _I32[0] <= value < _I32[1], value >= _U64)
    if isinstance(value, float):
        return ("f",)
    if value is None:
        return None
    return ("?", type(value), value)   # anything else: by value (hashable or the key raises, and Triton's path runs)


class Launcher:
    """`Launcher(kernel)(grid, *args, **kwargs)` launches `kernel[grid](*args, **kwargs)`, through the cached
    compiled kernel where one exists for the arguments' signature (module docstring). `args` and `kwargs` name
    every kernel parameter (constexprs included); other keyword arguments are launch options (num_warps, ...)."""

    enabled = os.environ.get("SGLANG_COMPACT_CACHED_LAUNCH", "0") == "1"

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)   # (Triton's interpreter has none: it always takes Triton's path)
        self._names = list(fn.arg_names) if params is not None else None
        self._constexpr = [p.is_constexpr for p in params] if params is not None else None
        self._compiled: dict = {}

    def _full(self, args: tuple, kwargs: dict) -> list | None:
        """Every parameter's value in order, or None when one is left to its default."""
        rest = self._names[len(args):]
        if any(name not in kwargs for name in rest):
            return None
        return list(args) + [kwargs[name] for name in rest]

    def _key_of(self, full: list, kwargs: dict):
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self._names))
        return tuple(_arg_key(v, c) for v, c in zip(full, self._constexpr)) + (options,)

    def key(self, args: tuple, kwargs: dict):
        """The signature key of one call's arguments (module docstring), or None when they cannot be keyed."""
        full = self._full(args, kwargs) if self._names is not None else None
        return None if full is None else self._key_of(full, kwargs)

    def __call__(self, grid, *args, **kwargs):
        if not self.enabled or self._names is None or callable(grid) or _hooked():
            return self.fn[grid](*args, **kwargs)
        full = self._full(args, kwargs)
        try:
            key = self._key_of(full, kwargs) if full is not None else None
            compiled = self._compiled.get(key) if key is not None else None
        except TypeError:   # an unhashable argument
            key = compiled = None
        if compiled is None:
            compiled = self.fn[grid](*args, **kwargs)
            if key is not None and isinstance(compiled, triton.compiler.CompiledKernel):
                self._compiled[key] = compiled
            return compiled
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*full)
        return compiled
