"""The RULER-style task generator and scorers (`harness.eval.tasks`), and the results table.

Most tests use a toy word tokenizer (no model needed); the length-targeting
test also runs with SmolLM2's real tokenizer when models/ has it (the server
tests' fixture converts it; tokenizer files only, no weights are loaded).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.eval import results as R
from harness.eval.tasks import TASKS, make_sample, make_suite, score_string_match_all

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"


class WordTokenizer:
    """Toy tokenizer: words and punctuation marks are tokens; a ChatML-like template."""

    chat_template = "toy"

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in re.findall(r"\w+|[^\w\s]", text)]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        s = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return s + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def real_tokenizer():
    if not (MODEL_DIR / "tokenizer.json").exists():
        return None
    from harness.eval.tasks import load_tokenizer
    return load_tokenizer(str(MODEL_DIR))


TOKENIZERS = ["toy", "smollm2"]


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request):
    if request.param == "toy":
        return WordTokenizer()
    tok = real_tokenizer()
    if tok is None:
        pytest.skip("models/smollm2-135m-instruct not converted (scripts/convert_smollm2.py)")
    return tok


def test_deterministic():
    a = make_suite(WordTokenizer(), lengths=(1024,), n=2, seed=3)
    b = make_suite(WordTokenizer(), lengths=(1024,), n=2, seed=3)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.answers for s in a] == [s.answers for s in b]
    c = make_suite(WordTokenizer(), lengths=(1024,), n=2, seed=4)
    assert [s.answers for s in a] != [s.answers for s in c]
    # samples differ from each other
    assert len({s.prompt for s in a}) == len(a)


@pytest.mark.parametrize("length", [2048, 4096, 8192])
def test_length_targeting(tokenizer, length):
    for task in TASKS:
        s = make_sample(task, length, 1, tokenizer)
        target = length - s.max_new_tokens
        n = len(tokenizer.encode(s.prompt, add_special_tokens=False))
        assert n == s.num_tokens
        assert 0.97 * target <= n <= target, (task, n, target)


def test_answers_in_prompt_and_structure(tokenizer):
    for task, spec in TASKS.items():
        for i in range(3):
            s = make_sample(task, 2048, i, tokenizer)
            assert s.prompt.count("<|im_start|>assistant") == 1
            body, _, tail = s.prompt.rpartition("<|im_start|>assistant\n")
            for a in s.answers:
                assert a in body, (task, a)
            if task == "vt":
                assert len(s.answers) == spec.needles + 1
                value = re.search(r"VAR \w+ = (\d+)\.", body).group(1)
                assert f"VAR {s.answers[0]} = {value}." in body
                for x, y in zip(s.answers, s.answers[1:]):
                    assert f"VAR {y} = VAR {x}." in body
                    assert body.index(f"VAR {x} ") < body.index(f"VAR {y} =")  # chain in order
                assert tail.startswith("Answer:")
            elif spec.kind == "story":
                check_story(s, spec, body, tail)
            else:
                expect = spec.needles * spec.values_per_key
                assert len(s.answers) == expect
                assert body.count("One of the special magic") == expect + spec.distractors
                for a in s.answers:
                    assert body.count(a) == 1  # no value collides with another needle or the haystack
                assert tail.startswith("The special magic")


def check_story(s, spec, body, tail):
    """A counting sentence in the haystack's grammar per needle; the asked one named by the question and the
    answer prefix; no filler sentence shares a needle's subject, verb and object; no template cue."""
    from harness.eval.tasks import _OBJECTS, _OBJECTS_PLURAL, _SUBJECTS, _VERBS
    assert "special magic" not in s.prompt
    (count,) = s.answers
    needles = re.findall(r"(?:^|(?<=\. ))([A-Z][^.]*? (\d{5}) [^.]*\.)", body)
    assert len(needles) == 1 + spec.distractors
    assert body.count(count) == 1 and count in [n for _, n in needles]
    asked = next(sent for sent, n in needles if n == count)
    subj, verb = tail.strip().lower().rsplit(" ", 1)
    assert asked.lower().startswith(f"{subj} {verb} {count} ")
    obj = asked.split(f" {count} ", 1)[1]
    plural = next(p for p in _OBJECTS_PLURAL if obj.startswith(p))
    assert f"how many {plural} did {subj}" in body.lower()
    triples = set()
    for sent, n in needles:
        sj = next(x for x in _SUBJECTS if sent.lower().startswith(x + " "))
        vb = sent[len(sj) + 1:].split(" ", 1)[0]
        ob = _OBJECTS[_OBJECTS_PLURAL.index(next(p for p in _OBJECTS_PLURAL if sent.split(f" {n} ", 1)[1].startswith(p)))]
        triples.add((sj, vb, ob))
    filler = [x for x in re.split(r"(?<=\.) ", body) if not re.search(r"\d{5}", x)]
    for sj, vb, ob in triples:
        assert not any(x.lower().startswith(f"{sj} {vb} {ob} ") for x in filler), (sj, vb, ob)


def test_story_needles_blend_into_the_haystack():
    """Across samples the asked sentence's subject, verb and object each also occur in filler sentences (the
    needle is told apart only by its count and its exact combination), and its position varies."""
    tok = WordTokenizer()
    shared, depths = 0, []
    for i in range(10):
        s = make_sample("story_single", 1024, i, tok)
        body = s.prompt.rpartition("<|im_start|>assistant")[0]
        asked = re.search(r"[A-Z][^.]*? " + s.answers[0] + r" [^.]*\.", body).group(0)
        subject_verb = asked.split(f" {s.answers[0]} ")[0]
        shared += body.count(subject_verb) > 1
        depths.append(s.depths[0])
    assert shared >= 3 and min(depths) < 0.5 < max(depths)


def test_value_kinds(tokenizer):
    num = make_sample("niah_single_number", 2048, 0, tokenizer).answers[0]
    word = make_sample("niah_single_word", 2048, 0, tokenizer).answers[0]
    uid = make_sample("niah_single_uuid", 2048, 0, tokenizer).answers[0]
    assert re.fullmatch(r"\d{7}", num)
    assert re.fullmatch(r"[a-z]+", word)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uid)


def test_depths_spread():
    # needle depth is uniform over the haystack: across samples both halves are used
    depths = [make_sample("niah_single_number", 1024, i, WordTokenizer()).depths[0] for i in range(20)]
    assert min(depths) < 0.5 < max(depths)


def test_scorer():
    assert score_string_match_all("The number is 1234567.", ["1234567"]) == 1.0
    assert score_string_match_all("it is 123456", ["1234567"]) == 0.0
    assert score_string_match_all("Zeppelin!", ["zeppelin"]) == 1.0  # case-insensitive
    assert score_string_match_all("1111111, 2222222 and 4444444", ["1111111", "2222222", "3333333", "4444444"]) == 0.75
    s = make_sample("niah_multivalue", 1024, 0, WordTokenizer())
    full = ", ".join(s.answers)
    assert s.score(full) == 1.0 and s.all_found(full)
    assert s.score(full.replace(s.answers[-1], "")) == 0.75 and not s.all_found(full.replace(s.answers[-1], ""))
    assert s.score("") == 0.0


def test_results_markdown_and_append(tmp_path):
    path = tmp_path / "accuracy.json"
    row = dict(model="m", task="niah_single_number", length=2048, method="dense", params={}, n=5, accuracy=80.0,
               density=None, date="2026-11-29", device="cpu")
    R.append_rows([row, {**row, "task": "vt", "accuracy": 40.0}], path)
    R.append_rows([{**row, "method": "compact-flashprefill", "params": {"alpha": 0.06}, "density": 0.5}], path)
    assert len(json.loads(path.read_text())) == 3
    md = R.render_markdown(R.load_rows(path))
    assert "| dense |  | cpu | 5 |  | 80.0 | 40.0 | 60.0 |" in md
    assert "| compact-flashprefill | alpha=0.06 | cpu | 5 | 0.500 | 80.0 |  | 80.0 |" in md
    with pytest.raises(ValueError):
        R.append_rows([{"model": "m"}], path)
    written = R.regenerate(path)
    assert path.with_suffix(".md") in written
    assert "## How" not in path.with_suffix(".md").read_text()
    (tmp_path / "accuracy_notes.md").write_text("## How these were run\n\ncommands\n")
    R.regenerate(path)
    text = path.with_suffix(".md").read_text()
    assert text.endswith("## How these were run\n\ncommands\n") and text.index("| dense |") < text.index("## How")


def test_compare_to_dense_matches_tasks_prompts_and_runner():
    """The comparison section: same tasks, same n where dense has it, the HF runner's dense for HF rows, and
    near-chance tasks named and left out."""
    def row(task, method, acc, n=25, params=None, density=None, device="h200", length=4096):
        return dict(model="m", task=task, length=length, method=method, params=params or {}, n=n, accuracy=acc,
                    density=density, date="2026-11-30", device=device)

    fp = {"alpha": 0.4}
    hf = {"runner": "hf"}
    rows = [row("a", "dense", 60.0), row("b", "dense", 40.0), row("vt", "dense", 4.0),
            row("a", "dense", 70.0, n=50),  # a later, larger dense run: the n=25 rows keep their reference
            row("a", "dense", 90.0, params=hf),
            row("a", "compact-flashprefill", 64.0, params=fp, density=0.3),
            row("b", "compact-flashprefill", 30.0, params=fp, density=0.5),
            row("vt", "compact-flashprefill", 50.0, params=fp, density=0.4),
            row("a", "compact-flashprefill", 66.0, n=50, params={"alpha": 0.6}, density=0.2),
            row("b", "compact-flashprefill", 20.0, n=5, params={"alpha": 0.6}, density=0.2),   # a smoke run
            row("a", "quoka", 80.0, params=hf, density=0.25), row("b", "quoka", 30.0, params=hf, density=0.25)]
    comps, near = R.compare_to_dense(rows)
    assert near == {("m", 4096, "h200"): ["vt"]}
    by = {(c.method, c.params): c for c in comps}
    c = by[("compact-flashprefill", "alpha=0.4")]
    assert c.tasks == ["a", "b"] and c.avg == 47.0 and c.dense_avg == 50.0 and c.diff == -3.0
    assert c.density == pytest.approx(0.4)
    c = by[("compact-flashprefill", "alpha=0.6")]
    assert c.tasks == ["a"] and c.n == [50] and c.dense_n == [50] and c.dense_avg == 70.0 and c.diff == -4.0
    smoke_only = [row("b", "compact-oracle", 10.0, n=5, params={"top_p": 0.9}, density=0.9)]
    assert not [c for c in R.compare_to_dense(rows + smoke_only)[0] if c.method == "compact-oracle"]
    q = by[("quoka", "runner=hf")]
    assert q.tasks == ["a", "b"] and q.dense_avg == (90.0 + 40.0) / 2  # b: no HF dense, the server's
    assert q.dense_n == [25]
    md = R.render_markdown(rows)
    assert "## Against dense on the same tasks and prompts" in md and "Left out (dense near chance): h200: vt." in md
    assert "| compact-flashprefill | alpha=0.4 | h200 | 25 | 0.400 | 2 | 47.0 | 50.0 | 25 | -3.00 |" in md


def test_rows_of_another_seed_compare_with_dense_of_that_seed():
    """Prompts drawn with another seed are other prompts: their rows form groups of their own and are compared
    with dense rows of the same seed only, and a later dense run of another seed does not become the reference
    of the seed-0 rows (H200 session 16: a seed-1 dense run had re-paired seed-0 rows in the report)."""
    def row(task, method, acc, seed=0, params=None):
        r = dict(model="m", task=task, length=16384, method=method, params=params or {}, n=50, accuracy=acc,
                 density=None if method == "dense" else 0.4, date="2026-12-02", device="h200")
        if seed:
            r["seed"] = seed
        return r

    mb = {"density": 0.33}
    rows = [row("a", "dense", 90.0), row("a", "compact-mass_budget", 80.0, params=mb),
            row("a", "compact-mass_budget", 88.0, params={"density": 0.5}),
            row("a", "dense", 70.0, seed=1), row("a", "compact-mass_budget", 66.0, seed=1, params=mb)]
    by = {(c.method, c.params): c for c in R.compare_to_dense(rows)[0]}
    assert by[("compact-mass_budget", "density=0.33")].diff == -10.0
    assert by[("compact-mass_budget", "density=0.5")].diff == -2.0
    assert by[("compact-mass_budget", "density=0.33, seed=1")].diff == -4.0


def test_accuracy_rows_carry_the_seed_of_their_prompts():
    from harness.eval.rows import accuracy_rows
    rec = dict(task="a", length=4096, score=1.0, all_found=1, seconds=0.1, num_tokens=4000)
    kw = dict(model="m", method="dense", params={}, device="h200", tasks=["a"], lengths=[4096])
    assert "seed" not in accuracy_rows([dict(rec, seed=0)], **kw)[0]
    assert accuracy_rows([dict(rec, seed=1), dict(rec, seed=1)], **kw)[0]["seed"] == 1
    with pytest.raises(ValueError, match="several seeds"):
        accuracy_rows([dict(rec, seed=1), dict(rec, seed=2)], **kw)


def test_accuracy_rows_carry_the_page_weighted_prompt_density():
    from harness.eval.rows import accuracy_rows
    rec = dict(task="a", length=4096, score=1.0, all_found=1, seconds=0.1, num_tokens=4000)
    kw = dict(model="m", method="compact", params={}, device="h200", tasks=["a"], lengths=[4096])
    assert "prompt_density" not in accuracy_rows([rec], **kw)[0]     # servers without the counters
    recs = [dict(rec, server_prompt_density=0.5), dict(rec, server_prompt_density=0.7), rec]
    assert accuracy_rows(recs, **kw)[0]["prompt_density"] == pytest.approx(0.6)


def test_dense_of_the_same_chunk_size_is_the_reference():
    """A method run at chunk 8192 is compared with dense at chunk 8192 when there is one, and a later dense run
    at chunk 8192 does not become the reference of the chunk-1024 rows (session 22: it had, moving every 32K
    difference by 0.1-0.3 points); with no dense row of its chunk size, the latest dense row of the same prompts."""
    def row(method, acc, chunk, n=50, params=None):
        return dict(model="m", task="a", length=32512, method=method, params={"chunk": chunk, **(params or {})},
                    n=n, accuracy=acc, density=None if method == "dense" else 0.34, date="2026-12-03",
                    device="h200")

    q = {"density": 0.33}
    rows = [row("dense", 68.0, 1024), row("compact-quest_budget", 70.0, 1024, params=q),
            row("compact-quest_budget", 60.0, 2048, params=q),
            row("dense", 66.0, 8192), row("compact-quest_budget", 76.0, 8192, params=q)]
    by = {(c.method, c.params): c for c in R.compare_to_dense(rows)[0]}
    assert by[("compact-quest_budget", "chunk=1024, density=0.33")].dense_avg == 68.0
    assert by[("compact-quest_budget", "chunk=8192, density=0.33")].dense_avg == 66.0
    assert by[("compact-quest_budget", "chunk=2048, density=0.33")].dense_avg == 66.0   # none at 2048: the latest
