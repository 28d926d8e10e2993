"""Checks of the final-chunk hook and the backend's use of its notes, run by tests/test_final_chunk.py in a child
process with SGLang importable (`SERVER_ENV`: the CPU import shim), so the shim stays out of pytest's process."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from sglang.srt.managers.schedule_batch import Range
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_compact.config import CompactConfig
from sglang_compact.srt.backend import CompactAttnBackend
from sglang_compact.srt.plugin import final_chunk_flags, mark_final_chunks


def req(rid, start, end, fill_len):
    return SimpleNamespace(rid=rid, extend_range=Range(start, end), full_untruncated_fill_ids=list(range(fill_len)),
                           prefix_indices=list(range(start)))


class NoteTaker:
    def __init__(self):
        self.notes = []

    def note_final_chunks(self, rids, prefix_lens, final):
        self.notes.append((list(rids), list(prefix_lens), list(final)))


def check_final_chunk_flags():
    reqs = [req("a", 0, 256, 800), req("b", 768, 800, 800), req("c", 512, 700, 700)]
    assert final_chunk_flags(reqs) == [False, True, True]
    # a retracted request re-prefills its prompt and its output so far: final once both are in
    assert final_chunk_flags([req("d", 256, 512, 900)]) == [False]
    assert final_chunk_flags([SimpleNamespace(rid="e", extend_range=None, full_untruncated_fill_ids=[1])]) == [False]


def check_hook_notes_extend_batches_only():
    backend = NoteTaker()
    runner = SimpleNamespace(attn_backend=backend)
    batch = SimpleNamespace(reqs=[req("a", 256, 512, 800), req("b", 768, 800, 800)], prefix_lens=[256, 768])
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    assert mark_final_chunks(fb, object, batch, runner) is None  # keeps init_new's result
    assert backend.notes == [(["a", "b"], [256, 768], [False, True])], backend.notes
    mark_final_chunks(fb, object, batch, model_runner=runner)  # keyword form of init_new's call
    assert len(backend.notes) == 2
    mark_final_chunks(SimpleNamespace(forward_mode=ForwardMode.DECODE), object, batch, runner)
    mark_final_chunks(fb, object, batch, SimpleNamespace(attn_backend=object()))  # another backend: nothing
    assert len(backend.notes) == 2


def fake_backend(dense_final_chunk=True):
    return SimpleNamespace(config=CompactConfig(block_size=16, dense_final_chunk=dense_final_chunk),
                           _final_chunk_notes={}, _warned_no_final_flags=False,
                           MAX_FINAL_CHUNK_NOTES=CompactAttnBackend.MAX_FINAL_CHUNK_NOTES)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_backend_takes_each_note_once():
    be = fake_backend()
    CompactAttnBackend.note_final_chunks(be, ["a", "b"], [256, 768], [False, True])
    fb = SimpleNamespace(rids=["a", "b"])
    assert CompactAttnBackend._final_chunks(be, fb, [256, 768], [True, True]) == [False, True]
    assert be._final_chunk_notes == {}
    records = Records()
    logging.getLogger("sglang_compact.srt.backend").addHandler(records)
    # no note for chunks that are dense anyway (say no prefix, or one token): nothing to warn about
    assert CompactAttnBackend._final_chunks(be, fb, [0, 768], [False, False]) == [False, False]
    assert records.messages == []
    # no note where it matters (the hook did not run): compact, with one warning per backend
    assert CompactAttnBackend._final_chunks(be, fb, [256, 768], [True, True]) == [False, False]
    assert CompactAttnBackend._final_chunks(be, fb, [256, 768], [True, True]) == [False, False]
    assert sum("final-chunk note" in m for m in records.messages) == 1, records.messages
    # the option off: nothing is kept, every chunk compact
    off = fake_backend(dense_final_chunk=False)
    CompactAttnBackend.note_final_chunks(off, ["a"], [768], [True])
    assert off._final_chunk_notes == {}
    assert CompactAttnBackend._final_chunks(off, SimpleNamespace(rids=["a"]), [768], [True]) == [False]
    # a batch noted for some of its requests only: the noted ones count
    CompactAttnBackend.note_final_chunks(be, ["a"], [768], [True])
    assert CompactAttnBackend._final_chunks(be, fb, [768, 768], [True, True]) == [True, False]
    # notes of batches that never ran are bounded
    big = fake_backend()
    big.MAX_FINAL_CHUNK_NOTES = 3
    for i in range(10):
        CompactAttnBackend.note_final_chunks(big, [f"r{i}"], [0], [True])
    assert len(big._final_chunk_notes) <= 4


def main() -> None:
    checks = [v for k, v in sorted(globals().items()) if k.startswith("check_")]
    for check in checks:
        check()
    print(f"ok {len(checks)}")


if __name__ == "__main__":
    main()
