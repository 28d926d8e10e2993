"""Every use of FlashInfer's internals, in one place, with the versions it was checked against.

The sparse path plans a paged wrapper once per forward pass and then lets the
index kernel write each layer's `kv_indptr` / `kv_indices` straight into the
device tensors the wrapper runs from. FlashInfer keeps those tensors in
private attributes (`_paged_kv_indptr_buf`, `_paged_kv_indices_buf`, set by
`plan()`); `index_buffers` reads them and fails with a clear message when a
FlashInfer release renames them.

Every plan goes through `plan`: FlashInfer's `plan()` writes its schedule into a
page-locked host buffer of the wrapper and queues the copy to the device
without waiting for it, so planning the same wrapper again before the GPU has
made that copy hands the work planned first the second schedule (wrong outputs
on fa2, an illegal memory access on fa3: `scripts/gpu/plan_race_check.py`).
That happens whenever the GPU lags the host by a whole pass, e.g. when other
processes share it.
"""

from __future__ import annotations

import logging

import torch

from sglang_compact.indices import IndexBuffers

logger = logging.getLogger(__name__)

#: FlashInfer releases whose private wrapper buffers were checked (GPU tests on the H200)
TESTED_VERSIONS = ("0.6.15.post1",)
_checked = False


def flashinfer():
    """The flashinfer module, with a one-time warning for an untested release."""
    global _checked
    import flashinfer as fi
    if not _checked:
        _checked = True
        if fi.__version__ not in TESTED_VERSIONS:
            logger.warning("sglang-compact was checked with flashinfer %s, found %s: its private wrapper "
                           "buffers may differ", ", ".join(TESTED_VERSIONS), fi.__version__)
    return fi


def paged_wrapper(workspace: torch.Tensor, backend: str):
    """Paged prefill over a head-major ("HND") pool."""
    return flashinfer().BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend=backend)


def ragged_wrapper(workspace: torch.Tensor, backend: str):
    """Prefill over contiguous K/V [T, H_kv, D] ("NHD"): a chunk's own keys, as stock SGLang runs a pass with
    no cached prefix."""
    return flashinfer().BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=backend)


def decode_wrapper(workspace: torch.Tensor, **buffers):
    """Decode over a head-major pool with tensor cores (CUDA-graph buffers in `buffers` when given)."""
    return flashinfer().BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=True, **buffers)


def plan(wrapper, *args, **kwargs) -> None:
    """`wrapper.plan(*args, **kwargs)`, after the GPU has made the host-to-device copy of the wrapper's previous
    plan (the host waits on an event recorded after it; no wait unless the GPU lags that far behind)."""
    capturing = torch.cuda.is_current_stream_capturing()
    copied = getattr(wrapper, "_compact_plan_copied", None)
    if copied is not None and not capturing:
        copied.synchronize()
    wrapper.plan(*args, **kwargs)
    if not capturing:
        if copied is None:
            copied = wrapper._compact_plan_copied = torch.cuda.Event()
        copied.record()


def index_buffers(wrapper) -> IndexBuffers:
    """The device tensors a planned paged wrapper reads kv_indptr / kv_indices from."""
    try:
        return IndexBuffers.wrap(wrapper._paged_kv_indptr_buf, wrapper._paged_kv_indices_buf)
    except AttributeError as e:
        import flashinfer as fi
        raise RuntimeError(f"flashinfer {fi.__version__}: the paged wrapper has no {e.name}; sglang-compact "
                           f"writes each layer's indices into it (checked with {', '.join(TESTED_VERSIONS)})") from None
