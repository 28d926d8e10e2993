"""Entry point of SGLang's `sglang.srt.plugins` group.

SGLang 0.5.17 calls every plugin of that group in the launcher and again in each
spawned scheduler process (`load_plugins()`), so registering here makes the
attention backend `compact` known everywhere the model runner builds backends.

It also registers one hook (SGLang's `HookRegistry`, applied by `load_plugins()`
right after the plugins ran): an AFTER hook on `ForwardBatch.init_new(batch,
model_runner, ...)` that tells the model runner's compact backend, per request
of an extend batch, whether this chunk is the request's last prompt chunk. The
backend needs that on the host (`dense_final_chunk`); the forward batch carries
only a device copy of the prompt lengths (`orig_seq_lens`, a device->host sync
per forward pass to read). The note goes to the backend, keyed by (request id,
prefix length), not onto the forward batch: SGLang's runners may hand the
backend a `dataclasses.replace` copy of it, which drops attributes set on it.
"""

from __future__ import annotations

BACKEND_NAME = "compact"
FORWARD_BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def create_compact_backend(model_runner):
    from sglang_compact.srt.backend import CompactAttnBackend

    return CompactAttnBackend(model_runner)


def final_chunk_flags(reqs) -> list[bool]:
    """Per request: True when its extend reaches the end of what it has to prefill (prompt, plus any
    output of a retracted request); the same comparison SGLang uses for `orig_seq_lens`."""
    return [r.extend_range is not None and r.extend_range.end >= len(r.full_untruncated_fill_ids) for r in reqs]


def mark_final_chunks(forward_batch, cls, batch, model_runner=None, *args, **kwargs):
    """AFTER hook of `ForwardBatch.init_new(batch, model_runner, ...)`: for an extend batch, hands
    (request id, prefix length, final?) of each request to `model_runner.attn_backend.note_final_chunks`
    when that backend has it (the compact backend); does nothing otherwise. Returns None (keeps the result)."""
    note = getattr(getattr(model_runner, "attn_backend", None), "note_final_chunks", None)
    mode = getattr(forward_batch, "forward_mode", None)
    reqs = getattr(batch, "reqs", None)
    if note is None or mode is None or not mode.is_extend() or not reqs:
        return None
    prefix_lens = getattr(batch, "prefix_lens", None) or [len(r.prefix_indices) for r in reqs]
    note([r.rid for r in reqs], list(prefix_lens), final_chunk_flags(reqs))
    return None


def register() -> None:
    """Register the backend, its CLI choice and the final-chunk hook (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_compact_backend)
    registered = getattr(HookRegistry, "_hooks", {}).get(FORWARD_BATCH_INIT, [])
    if not any(hook is mark_final_chunks for _, hook, _ in registered):
        HookRegistry.register(FORWARD_BATCH_INIT, mark_final_chunks, HookType.AFTER)
