"""The CPU import shim for CUDA-only packages (sglang_compact.srt.cpu_shim).

Each check runs in a fresh interpreter: the shim changes sys.meta_path and
importlib.util.find_spec for the whole process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import cpu_shim_hook_installed  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_py(code: str, env_extra=None, timeout=300) -> str:
    env = dict(os.environ)
    env.pop("SGLANG_COMPACT_CPU_SHIM", None)
    env.update(env_extra or {})
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=str(REPO_ROOT), env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    return r.stdout


def _really_importable(name: str) -> bool:
    code = f"import {name}"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=str(REPO_ROOT),
                       env={k: v for k, v in os.environ.items() if k != "SGLANG_COMPACT_CPU_SHIM"})
    return r.returncode == 0


needs_missing_sgl_kernel = pytest.mark.skipif(
    _really_importable("sgl_kernel"), reason="a working sgl_kernel is installed here"
)


@needs_missing_sgl_kernel
def test_shimmed_attribute_raises():
    out = run_py("""
        import importlib.util
        from sglang_compact.srt import cpu_shim
        assert "sgl_kernel" in cpu_shim.install_cpu_shims(force=True)

        import sgl_kernel
        from sgl_kernel import assign_req_to_token_pool_cpu   # exists at import time ...
        try:
            assign_req_to_token_pool_cpu(1, 2)                  # ... but never computes
        except RuntimeError as e:
            assert "sgl_kernel.assign_req_to_token_pool_cpu is not available on CPU" in str(e), e
            assert isinstance(e, cpu_shim.CpuShimError)
        else:
            raise AssertionError("stub did not raise")

        # Any other attribute: a clear error, which is also an AttributeError
        # so that feature probes (hasattr / getattr with default) still work.
        try:
            sgl_kernel.merge_state_v2
        except RuntimeError as e:
            assert "sgl_kernel.merge_state_v2 is not available on CPU (sglang_compact CPU shim)" == str(e)
            assert isinstance(e, AttributeError)
        else:
            raise AssertionError("attribute did not raise")
        assert not hasattr(sgl_kernel, "fused_add_rmsnorm")
        assert getattr(sgl_kernel, "rmsnorm", None) is None
        try:
            from sgl_kernel import flash_attn_varlen_func
        except ImportError:
            pass
        else:
            raise AssertionError("unlisted name imported")
        try:
            import sgl_kernel.flash_attn
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("unlisted submodule imported")

        # torchvision: listed names exist, raise when used
        from torchvision.io import decode_jpeg
        from torchvision.transforms.functional import InterpolationMode
        for stub in (lambda: decode_jpeg(b""), lambda: InterpolationMode.BICUBIC):
            try:
                stub()
            except RuntimeError as e:
                assert "not available on CPU" in str(e)
            else:
                raise AssertionError("torchvision stub did not raise")

        # Feature probes see the shimmed packages as absent.
        assert importlib.util.find_spec("sgl_kernel") is None
        assert importlib.util.find_spec("torchvision") is None
        assert importlib.util.find_spec("json") is not None
        print("OK")
    """)
    assert out.strip().endswith("OK")


@needs_missing_sgl_kernel
def test_shim_only_on_cpu_and_only_for_failing_imports(tmp_path):
    # A package whose import raises (like a CUDA-only .so on a CPU machine) is
    # shimmed; a package that imports is never replaced; nothing at all
    # happens when torch sees a CUDA device.
    out = run_py("""
        import sys
        from sglang_compact.srt import cpu_shim
        assert cpu_shim._real_import_fails("sgl_kernel")
        assert not cpu_shim._real_import_fails("json")
        try:
            cpu_shim.install_cpu_shims(["json"], force=True)
        except ValueError:
            pass
        else:
            raise AssertionError("json is not shimmable")

        cpu_shim._has_cuda = lambda: True          # as on a GPU node
        assert cpu_shim.install_cpu_shims() == []
        assert cpu_shim._finder is None
        try:
            import sgl_kernel
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("shim active although CUDA is available")
        print("OK")
    """)
    assert out.strip().endswith("OK")

    broken = tmp_path / "torchvision"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise OSError('libcudart.so.13: cannot open shared object file')\n")
    out = run_py(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from sglang_compact.srt import cpu_shim
        assert "torchvision" in cpu_shim.install_cpu_shims(["torchvision"], force=True)
        import torchvision.io
        assert cpu_shim.is_shim(torchvision.io), torchvision.io
        print("OK")
    """)
    assert out.strip().endswith("OK")


@needs_missing_sgl_kernel
def test_transformers_auto_image_processor_without_torchvision():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed")
    out = run_py("""
        from sglang_compact.srt import cpu_shim
        cpu_shim.install_cpu_shims(force=True)
        from transformers import AutoImageProcessor
        assert AutoImageProcessor.__module__ == "transformers.models.auto.image_processing_auto", AutoImageProcessor
        assert callable(AutoImageProcessor.register)
        print("OK")
    """)
    assert out.strip().endswith("OK")


@needs_missing_sgl_kernel
@pytest.mark.skipif(not cpu_shim_hook_installed(), reason="run scripts/setup_cpu.sh (installs the .pth hook)")
def test_pth_hook_reaches_spawned_processes():
    # The .pth hook runs at start-up of every interpreter with the env var set,
    # including multiprocessing's spawned children (as SGLang's scheduler).
    code = """
        import multiprocessing as mp

        def child(q):
            import sgl_kernel, torchvision.io
            q.put(type(sgl_kernel).__name__)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=120))
            p.join()
    """
    script = REPO_ROOT / ".out" / "spawn_child_check.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, SGLANG_COMPACT_CPU_SHIM="1")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ShimModule"
    env.pop("SGLANG_COMPACT_CPU_SHIM")
    r = subprocess.run([sys.executable, "-c", "import sgl_kernel"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "No module named 'sgl_kernel'" in r.stderr


@needs_missing_sgl_kernel
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
@pytest.mark.skipif(not cpu_shim_hook_installed(), reason="run scripts/setup_cpu.sh (installs the .pth hook)")
def test_sglang_cpu_import_chain():
    # What the launcher and the scheduler subprocess import, with the CPU engine on.
    out = run_py("""
        import sglang.launch_server
        import sglang.srt.entrypoints.http_server
        import sglang.srt.managers.scheduler
        import sglang.srt.managers.detokenizer_manager
        import sglang.srt.model_executor.model_runner
        import sglang.srt.models.llama
        import sglang.srt.layers.attention.torch_native_backend
        from sglang.srt.utils.common import is_cpu, cpu_has_amx_support
        assert is_cpu() and not cpu_has_amx_support()
        print("OK")
    """, env_extra={"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_COMPACT_CPU_SHIM": "1"}, timeout=600)
    assert out.strip().endswith("OK")
