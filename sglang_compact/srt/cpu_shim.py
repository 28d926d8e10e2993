"""Import shims for CUDA-only packages, so that SGLang 0.5.17 can serve on a CPU.

SGLang imports a few packages at module level that cannot load with a CPU
build of torch (or are not installed at all on a CPU machine):

* ``sgl_kernel`` (PyPI ``sglang-kernel``): with ``SGLANG_USE_CPU_ENGINE=1``
  several modules do ``from sgl_kernel import <op>_cpu`` at import time; the
  paths used without Intel AMX never call them (``cpu_has_amx_support()``
  probes ``torch.ops.sgl_kernel``, which stays empty, so SGLang falls back to
  torch code).
* ``torchvision``: ``sglang/srt/utils/common.py`` does
  ``from torchvision.io import decode_jpeg``, and two config modules import
  ``torchvision.transforms(.functional).InterpolationMode`` (images only).
  The PyPI wheel is a CUDA build: with CPU torch its import raises
  ``RuntimeError: operator torchvision::nms does not exist``.

``install_cpu_shims()`` puts a finder at the front of ``sys.meta_path`` that
answers these names with stand-in modules, but only

* when torch has no CUDA device (or ``force=True``), and
* for a package that really fails to import (not installed, or its import
  raises, e.g. a CUDA-only shared library).

A stand-in module holds only the names SGLang's import chain needs to exist
at import time (``_SHIM_API``). Each is a stub whose call raises
``CpuShimError`` (a ``RuntimeError``); any other attribute raises
``CpuShimError`` too (it is also an ``AttributeError``, so ``hasattr`` and
``getattr(mod, name, default)`` keep working as feature probes), and
``importlib.util.find_spec`` reports a shimmed package as absent (so
transformers does not take torchvision for installed). Nothing here computes.

One consequence is fixed too: without torchvision, transformers 5.12's
top-level ``AutoImageProcessor`` is a placeholder that raises, and SGLang
calls ``AutoImageProcessor.register`` at import time; see
``_fix_transformers_without_torchvision``.

Getting the shim into every SGLang process
------------------------------------------
The ``sglang.srt.plugins`` entry points are loaded too late for this in every
process: ``sglang/launch_server.py`` calls ``load_plugins()`` in its
``__main__`` block, after its module-level imports (``server_args`` ->
``configs`` -> transformers, ``utils.common`` -> torchvision); the scheduler
subprocesses are started with ``spawn`` (``engine.py``:
``mp.set_start_method("spawn")``), so the child re-imports the main module
(as ``__mp_main__``) and unpickles ``run_scheduler_process`` -- importing
``sglang.srt.managers.scheduler`` and the whole model stack -- before that
function's first statement, ``load_plugins()``, runs; the detokenizer
process never calls it. What works: a ``.pth`` file in site-packages
(``sglang_compact_cpu_shim.pth``, written by
``python -m sglang_compact.srt.cpu_shim --install-pth``, which
``scripts/setup_cpu.sh`` runs). At interpreter start-up, and only when
``SGLANG_COMPACT_CPU_SHIM=1`` is set, it loads this file by path (without
running the ``sglang_compact`` package ``__init__``) and calls
``install_cpu_shims()``. Spawned children inherit the environment, so each
process of the server has the shim before its first SGLang import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import types
from typing import Dict, FrozenSet, Iterable, List, Optional

ENV_VAR = "SGLANG_COMPACT_CPU_SHIM"
PTH_NAME = "sglang_compact_cpu_shim.pth"
MODULE_NAME = "sglang_compact.srt.cpu_shim"

# Module name -> names that must exist on the stand-in at import time: exactly
# what SGLang 0.5.17's CPU import chain (SGLANG_USE_CPU_ENGINE=1, launcher,
# HTTP server, scheduler, model runner, Llama, torch_native backend) touches.
_SHIM_API: Dict[str, FrozenSet[str]] = {
    "sgl_kernel": frozenset({
        "copy_all_layer_kv_cache_cpu",      # sglang/kernels/ops/kvcache/cache_move.py
        "assign_req_to_token_pool_cpu",     # sglang/srt/mem_cache/allocation.py (spec decode only)
        "assign_extend_cache_locs_cpu",     # sglang/kernels/ops/speculative/cache_locs.py
        "fill_accept_out_cache_loc_cpu",    # sglang/kernels/ops/speculative/eagle.py
        "fill_bonus_tokens_cpu",            # sglang/kernels/ops/speculative/eagle.py
        "build_tree_kernel_efficient_cpu",  # sglang/srt/speculative/eagle_utils.py
        "verify_tree_greedy_cpu",           # sglang/srt/speculative/eagle_utils.py
    }),
    "torchvision": frozenset(),
    "torchvision.io": frozenset({"decode_jpeg"}),  # sglang/srt/utils/common.py
    # sglang/srt/multimodal/internvl_utils.py (via configs/nano_nemotron_vl.py),
    # sglang/srt/configs/deepseek_ocr.py
    "torchvision.transforms": frozenset({"InterpolationMode"}),
    "torchvision.transforms.functional": frozenset({"InterpolationMode"}),
}

# Top-level packages the shim may stand in for.
SHIMMABLE: FrozenSet[str] = frozenset(n.split(".")[0] for n in _SHIM_API)

_installed: Dict[str, bool] = {}  # top-level name -> shimmed?
_finder: Optional["_CpuShimFinder"] = None
_orig_find_spec = importlib.util.find_spec


class CpuShimError(RuntimeError, AttributeError):
    """Raised by every use of a shimmed CUDA-only package on CPU."""


def _message(qualname: str) -> str:
    return f"{qualname} is not available on CPU (sglang_compact CPU shim)"


class _Stub:
    """A name that must exist at import time; calling it raises."""

    __slots__ = ("_qualname",)

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise CpuShimError(_message(self._qualname))

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise CpuShimError(_message(f"{self._qualname}.{name}"))

    def __repr__(self) -> str:
        return f"<sglang_compact CPU shim stub {self._qualname}>"


class ShimModule(types.ModuleType):
    """Stand-in module: only allow-listed names exist, and they raise when used."""

    __sglang_compact_cpu_shim__ = True

    def __getattr__(self, name: str):
        # Only reached for names that are not set on the module.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise CpuShimError(_message(f"{self.__name__}.{name}"))

    def __repr__(self) -> str:
        return f"<sglang_compact CPU shim module {self.__name__!r}>"


def is_shim(module: object) -> bool:
    return bool(getattr(type(module), "__sglang_compact_cpu_shim__", False))


class _ShimLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return ShimModule(spec.name)

    def exec_module(self, module):
        name = module.__name__
        for attr in sorted(_SHIM_API.get(name, ())):
            setattr(module, attr, _Stub(f"{name}.{attr}"))
        # Bind already-created child shims (``import a.b`` binds b on a itself).
        for child in _SHIM_API:
            if child.rpartition(".")[0] == name and child in sys.modules:
                setattr(module, child.rpartition(".")[2], sys.modules[child])


def _fix_transformers_without_torchvision(tf: types.ModuleType) -> None:
    """Let ``from transformers import AutoImageProcessor`` work without torchvision.

    transformers 5.x derives the backends of each name from its file's text: a
    file named ``image_processing_*`` that mentions ``TorchvisionBackend``
    needs torchvision. ``models/auto/image_processing_auto.py`` does (for a
    backward-compatible alias), so without torchvision the top-level
    ``AutoImageProcessor`` is a placeholder that raises on first use, though
    the class itself needs only PIL. SGLang 0.5.17 calls
    ``AutoImageProcessor.register(...)`` at import time
    (``sglang/srt/configs/utils.py``, reached from ``server_args``), so it
    cannot even be imported without this. Bind the real class.
    """
    missing = getattr(tf, "_object_missing_backend", None) or {}
    if "torchvision" not in missing.get("AutoImageProcessor", ()):
        return
    try:
        from transformers.models.auto.image_processing_auto import AutoImageProcessor
    except Exception as e:  # leave transformers' own error in place
        sys.stderr.write(f"sglang_compact CPU shim: AutoImageProcessor fix skipped ({e!r})\n")
        return
    # Importing the submodule may leave a new lazy module in sys.modules: bind both.
    for mod in (tf, sys.modules.get("transformers")):
        if mod is not None:
            setattr(mod, "AutoImageProcessor", AutoImageProcessor)


# Packages to post-process once their real import finished, when the shim of
# the key is active: name -> (shimmed top-level it depends on, fix).
_POST_IMPORT_FIXES = {
    "transformers": ("torchvision", _fix_transformers_without_torchvision),
}


class _PostImportLoader(importlib.abc.Loader):
    """Runs the real loader, then a fix on the module left in ``sys.modules``."""

    def __init__(self, inner, fix):
        self._inner = inner
        self._fix = fix

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._fix(sys.modules.get(module.__name__, module))


class _CpuShimFinder(importlib.abc.MetaPathFinder):
    """Answers ``import X`` for shimmed packages (and their listed submodules)."""

    def find_spec(self, fullname, path=None, target=None):
        fix = _POST_IMPORT_FIXES.get(fullname)
        if fix is not None and _installed.get(fix[0]):
            return self._wrapped_real_spec(fullname, path, target, fix[1])
        top = fullname.partition(".")[0]
        if not _installed.get(top):
            return None
        if fullname not in _SHIM_API:
            return None  # unknown submodule: a normal ModuleNotFoundError
        is_pkg = any(k.startswith(fullname + ".") for k in _SHIM_API) or "." not in fullname
        return importlib.machinery.ModuleSpec(
            fullname, _ShimLoader(), origin="sglang_compact-cpu-shim", is_package=is_pkg
        )

    def _wrapped_real_spec(self, fullname, path, target, fix):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PostImportLoader(spec.loader, fix)
                return spec
        return None


def _find_spec_hiding_shims(name, package=None):
    """``importlib.util.find_spec`` that reports shimmed packages as absent.

    Feature probes (transformers' ``is_torchvision_available()`` and the like)
    use ``find_spec``; a stand-in must not make them believe the real package
    is there, or they import its real API at module level.
    """
    fullname = importlib.util.resolve_name(name, package) if name.startswith(".") else name
    if _installed.get(fullname.partition(".")[0]):
        return None
    return _orig_find_spec(name, package)


def _purge(top: str) -> None:
    for key in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
        del sys.modules[key]


def _real_import_fails(top: str) -> bool:
    """True when ``import top`` does not work for real on this machine."""
    mod = sys.modules.get(top)
    if mod is not None:
        return is_shim(mod)
    try:
        if _orig_find_spec(top) is None:
            return True
    except (ImportError, ValueError):
        return True
    try:
        importlib.import_module(top)
        return False
    except Exception:  # e.g. OSError from a CUDA-only .so, ImportError of torch ops
        _purge(top)
        return True


def _has_cuda() -> bool:
    try:
        import torch
    except Exception:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def install_cpu_shims(
    modules: Optional[Iterable[str]] = None, force: bool = False
) -> List[str]:
    """Install stand-ins for CUDA-only packages that fail to import here.

    Does nothing when torch sees a CUDA device, unless ``force``. Idempotent.
    Returns the top-level names now served by the shim.
    """
    global _finder
    if not force and _has_cuda():
        return sorted(k for k, v in _installed.items() if v)
    wanted = SHIMMABLE if modules is None else frozenset(modules)
    unknown = wanted - SHIMMABLE
    if unknown:
        raise ValueError(f"no CPU shim for {sorted(unknown)}; shimmable: {sorted(SHIMMABLE)}")
    for top in sorted(wanted):
        if top in _installed:
            continue
        _installed[top] = _real_import_fails(top)
    if _finder is None and any(_installed.values()):
        _finder = _CpuShimFinder()
        sys.meta_path.insert(0, _finder)
        importlib.util.find_spec = _find_spec_hiding_shims
    return sorted(k for k, v in _installed.items() if v)


def shimmed_modules() -> List[str]:
    return sorted(k for k, v in _installed.items() if v)


def _pth_hook() -> None:
    """Called from ``sglang_compact_cpu_shim.pth`` when SGLANG_COMPACT_CPU_SHIM=1."""
    try:
        install_cpu_shims()
    except Exception as e:  # never break interpreter start-up
        sys.stderr.write(f"sglang_compact CPU shim: not installed ({e!r})\n")


# Run by the .pth line at interpreter start-up. It loads this file by path
# under its package name, so that the parents' __init__ (which may import
# SGLang one day) do not run before the shim is in place; a later
# ``import sglang_compact.srt.cpu_shim`` finds it in sys.modules.
_BOOT = """\
import sys, importlib.util
try:
    mod = sys.modules.get(NAME)
    if mod is None and os.path.isfile(PATH):
        spec = importlib.util.spec_from_file_location(NAME, PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[NAME]
            raise
    if mod is None:
        mod = importlib.import_module(NAME)
    mod._pth_hook()
except Exception as e:
    sys.stderr.write('sglang_compact CPU shim: not installed (%r)\\n' % (e,))
"""


def pth_line(module_path: Optional[str] = None) -> str:
    """The one line of the .pth file (site.py executes lines starting with 'import')."""
    module_path = os.path.abspath(module_path or __file__)
    code = _BOOT.replace("NAME", repr(MODULE_NAME)).replace("PATH", repr(module_path))
    return (
        f"import os; exec({code!r}) if os.environ.get({ENV_VAR!r}) == '1' else None\n"
    )


def pth_path(site_dir: Optional[str] = None) -> str:
    return os.path.join(site_dir or sysconfig.get_paths()["purelib"], PTH_NAME)


def install_pth(site_dir: Optional[str] = None) -> str:
    """Write the start-up hook into site-packages (idempotent)."""
    path = pth_path(site_dir)
    line = pth_line()
    old = None
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    if old != line:
        with open(path, "w") as f:
            f.write(line)
    return path


def _main(argv: Optional[List[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install-pth", action="store_true", help="write the .pth start-up hook")
    p.add_argument("--site-dir", default=None, help="site-packages dir (default: purelib)")
    p.add_argument("--check", action="store_true", help="install the shims here and list them")
    args = p.parse_args(argv)
    if args.install_pth:
        print(f"wrote {install_pth(args.site_dir)}")
    if args.check:
        print(f"CUDA available: {_has_cuda()}; shimmed: {install_cpu_shims()}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
