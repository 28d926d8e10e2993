"""Per-request prompt lengths for the gate's dense tail, from a hook on `ForwardBatch.init_new`.

The dense tail (the windows holding the last `dense_tail` prompt tokens read every page) needs each
request's prompt length on the host when its extend batch is planned. The
forward batch carries only a device copy (`orig_seq_lens`: a device->host sync
per forward pass to read), so an AFTER hook on `ForwardBatch.init_new(batch,
model_runner, ...)` (registered by the plugin, applied by SGLang's
`load_plugins()` in every scheduler process) notes `(request id, prefix
length) -> prompt length` for each request of an extend batch, and the backend
takes the notes of the batch it plans. The notes are keyed, not attached to the
forward batch: SGLang's runners may hand the backend a `dataclasses.replace`
copy of it, which drops attributes set on it. Only a process that built a
compact backend keeps notes (`PromptNotes.enable`).
"""

from __future__ import annotations

import logging
from typing import Sequence

from sglang_compact.srt import compat

logger = logging.getLogger(__name__)


class PromptNotes:
    """(request id, prefix length) -> prompt length, taken once each; bounded."""

    MAX_NOTES = 4096  # notes of batches that never ran (a bound, not a cache)

    def __init__(self):
        self.enabled = False
        self._notes: dict[tuple[str, int], int] = {}
        self._warned = False

    def enable(self) -> None:
        self.enabled = True

    def note(self, rids: Sequence[str], prefix_lens: Sequence[int], prompt_lens: Sequence[int]) -> None:
        if not self.enabled:
            return
        if len(self._notes) > self.MAX_NOTES:
            self._notes.clear()
        for rid, L, n in zip(rids, prefix_lens, prompt_lens):
            self._notes[(rid, int(L))] = int(n)

    def take(self, rids: Sequence[str], prefix_lens: Sequence[int],
             needed: Sequence[bool] | None = None) -> list[int | None]:
        """Each request's prompt length (None where no note was made: a batch that did not go through
        `ForwardBatch.init_new`, such as SGLang's CUDA-graph capture). A missing note is warned about (once)
        where it matters: for a request whose chunk could read a selection (`needed`, default all)."""
        out = [self._notes.pop((rid, int(L)), None) for rid, L in zip(rids, prefix_lens)]
        out += [None] * (len(prefix_lens) - len(out))
        needed = [True] * len(out) if needed is None else needed
        missing = any(n is None and need for n, need in zip(out, needed))
        if missing and not self._warned:
            self._warned = True
            logger.warning("sglang_compact: an extend batch came without prompt-length notes (the %s hook of "
                           "sglang_compact's plugin did not run for it); its requests have no dense tail",
                           compat.FORWARD_BATCH_INIT)
        return out


NOTES = PromptNotes()


def note_prompt_lengths(forward_batch, cls, batch, model_runner=None, *args, **kwargs):
    """AFTER hook of `ForwardBatch.init_new(batch, model_runner, ...)`: notes (request id, prefix length,
    prompt length) of an extend batch's requests. Returns None (keeps the result)."""
    if not NOTES.enabled or not compat.is_extend_mode(forward_batch):
        return None
    reqs = compat.batch_requests(batch)
    if reqs:
        NOTES.note([r.rid for r in reqs], [compat.request_prefix_len(batch, i, r) for i, r in enumerate(reqs)],
                   [compat.request_prompt_len(r) for r in reqs])
    return None
