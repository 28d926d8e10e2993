"""Entry point of SGLang's `sglang.srt.plugins` group.

SGLang 0.5.17 calls every plugin of that group in the launcher and again in each
spawned scheduler process (`load_plugins()`), so registering here makes the
attention backend `compact` known everywhere the model runner builds backends.
"""

from __future__ import annotations

BACKEND_NAME = "compact"


def create_compact_backend(model_runner):
    from sglang_compact.srt.backend import CompactAttnBackend

    return CompactAttnBackend(model_runner)


def register() -> None:
    """Register the backend and its CLI choice (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_compact_backend)
