"""Prompt lengths for the dense tail: the plugin's `ForwardBatch.init_new` hook notes them, the backend
takes them per batch. (End to end, on a CPU server: tests/test_compact_server.py.)"""

import logging
from types import SimpleNamespace

from sglang_compact.srt.prompt_notes import PromptNotes, note_prompt_lengths
from sglang_compact.srt import prompt_notes


def req(rid, start, fill_len):
    return SimpleNamespace(rid=rid, full_untruncated_fill_ids=list(range(fill_len)), prefix_indices=list(range(start)))


def fb(mode):
    return SimpleNamespace(forward_mode=SimpleNamespace(name=mode))


def test_notes_are_taken_once_and_bounded(caplog):
    n = PromptNotes()
    n.note(["a"], [0], [100])
    assert n.take(["a"], [0]) == [None]          # a process without a compact backend keeps nothing
    n.enable()
    n.note(["a", "b"], [0, 512], [900, 700])
    assert n.take(["b", "a"], [512, 0]) == [700, 900]
    with caplog.at_level(logging.WARNING):
        assert n.take(["a"], [0]) == [None]      # taken once
        assert n.take(["x"], [0]) == [None]
    assert sum("without prompt-length notes" in r.message for r in caplog.records) == 1  # warned once
    for i in range(PromptNotes.MAX_NOTES + 10):
        n.note([f"r{i}"], [0], [1])
    assert len(n._notes) <= PromptNotes.MAX_NOTES + 1


def test_the_hook_notes_extend_batches_only(monkeypatch):
    notes = PromptNotes()
    monkeypatch.setattr(prompt_notes, "NOTES", notes)
    batch = SimpleNamespace(reqs=[req("a", 0, 800), req("b", 768, 800)], prefix_lens=[0, 768])
    assert note_prompt_lengths(fb("EXTEND"), None, batch) is None  # disabled: nothing kept
    notes.enable()
    assert note_prompt_lengths(fb("DECODE"), None, batch) is None
    assert notes._notes == {}
    assert note_prompt_lengths(fb("EXTEND"), None, batch, SimpleNamespace()) is None  # keeps init_new's result
    assert notes.take(["a", "b"], [0, 768]) == [800, 800]
    # without the batch's prefix lengths, each request's cached prefix is used
    note_prompt_lengths(fb("MIXED"), None, SimpleNamespace(reqs=[req("c", 256, 900)]))
    assert notes.take(["c"], [256]) == [900]
