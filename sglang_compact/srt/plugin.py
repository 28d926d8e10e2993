"""Entry point of SGLang's `sglang.srt.plugins` group.

SGLang 0.5.17 calls every plugin of that group in the launcher and again in
each spawned scheduler process (`load_plugins()`), so registering here makes
the attention backend `compact` known everywhere the model runner builds
backends. It also registers the hooks the backend relies on (SGLang's
`HookRegistry`, applied by `load_plugins()` right after the plugins ran), and
arranges SGLang's head-major KV pool when `compact` is named on the command
line, so the stock launcher works too. The request checks (`request_checks.py`:
malformed requests get a 400 instead of crashing SGLang's scheduler) are
registered for every attention backend.
"""

from __future__ import annotations

import os
import sys

from sglang_compact.srt import compat
from sglang_compact.srt.alignment import (align_cache_hit, align_chunk_ends, align_continuing_chunk, cap_cache_key,
                                          limit_cached_prefix, mark_inserted_node, mark_split_node,
                                          whole_window_budget)
from sglang_compact.srt.memory import add_summaries_to_cell_size
from sglang_compact.srt.prompt_notes import note_prompt_lengths
from sglang_compact.srt.request_checks import hooks as request_check_hooks

BACKEND_NAME = "compact"
BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")


def create_compact_backend(model_runner):
    from sglang_compact.srt.backend import CompactAttnBackend

    return CompactAttnBackend(model_runner)


def names_compact(argv) -> bool:
    """Whether a command line selects the compact backend (`--flag compact` or `--flag=compact`)."""
    argv = list(argv)
    for i, a in enumerate(argv):
        for flag in BACKEND_FLAGS:
            if (a == flag and i + 1 < len(argv) and argv[i + 1] == BACKEND_NAME) or a == f"{flag}={BACKEND_NAME}":
                return True
    return False


def register() -> None:
    """Register the backend, its CLI choice and its hooks (idempotent)."""
    compat.check_sglang_version()
    if names_compact(sys.argv):
        # read when SGLang builds the KV pool, in the scheduler processes, which inherit it
        os.environ.setdefault(compat.HND_ENV, "1")
    compat.register_attention_backend(BACKEND_NAME, create_compact_backend)
    compat.register_hook(compat.FORWARD_BATCH_INIT, note_prompt_lengths, "AFTER")
    compat.register_hook(compat.POOL_CELL_SIZE, add_summaries_to_cell_size, "AFTER")
    for target, hook, kind in request_check_hooks():  # any backend
        compat.register_hook(target, hook, kind)
    compat.register_hook(compat.SCHEDULER_ALIGNMENT, align_chunk_ends, "AFTER")
    compat.register_hook(compat.REQUEST_CACHE_MATCH, align_cache_hit, "AFTER")
    compat.register_hook(compat.CACHE_FINISHED, limit_cached_prefix, "AROUND")
    compat.register_hook(compat.CACHE_UNFINISHED, limit_cached_prefix, "AROUND")
    compat.register_hook(compat.CACHE_KEY_ALIGN, cap_cache_key, "AFTER")
    compat.register_hook(compat.CACHE_NODE_INSERT, mark_inserted_node, "AFTER")
    compat.register_hook(compat.CACHE_NODE_SPLIT, mark_split_node, "AFTER")
    compat.register_hook(compat.PREFILL_BUDGET_INIT, whole_window_budget, "AFTER")
    compat.register_hook(compat.CONTINUING_CHUNK, align_continuing_chunk, "AROUND")
