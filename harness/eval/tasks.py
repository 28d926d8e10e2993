"""Seeded, deterministic RULER-style long-context tasks (our own generator).

Tasks (after RULER, Hsieh et al. 2024; templates follow RULER's):

| name | what is hidden | what is asked | answers |
| --- | --- | --- | --- |
| `niah_single_number` / `_word` / `_uuid` | one keyed needle | its value | 1 |
| `niah_multikey` | the asked needle among `distractors` other keyed needles | the asked key's value | 1 |
| `niah_multivalue` | `values` needles with the same key | every value | `values` |
| `niah_multiquery` | `queries` keyed needles | every asked key's value | `queries` |
| `vt` (variable tracking) | `VAR X = 12345` then a chain `VAR Y = VAR X` ... | every variable holding the value | hops + 1 |
| `story_single` | one sentence of the haystack's own grammar that carries a count | that count | 1 |
| `story_multikey` | the asked counting sentence among `distractors` others | the asked count | 1 |

The `story_*` family has no template cue: its needles are haystack sentences ("The baker sold 48213
wooden chairs at the market.") that differ from the filler only in carrying a number, and the
question names the sentence's subject, verb, object and place. No filler sentence shares a needle's
subject, verb and object, so the count is the only answer the text supports.

The haystack is generated English-like sentences (a seeded grammar over a
small vocabulary that no needle value or key uses). A sample's prompt is the
task text rendered through the model's chat template with the generation
prompt, followed by RULER's answer prefix. Its length in the model's
tokenizer is ``length - max_new_tokens`` tokens (RULER's convention: prompt
plus generation fit in ``length``), hit to within one haystack sentence.

Scoring follows RULER's string match: ``score`` is the fraction of expected
answers found (case-insensitive substring) in the prediction
(`string_match_all`); ``all_found`` is the strict all-of variant.

Everything is a function of ``(seed, task, length, index)`` and the
tokenizer: the same arguments give the same prompts and ids.
"""

from __future__ import annotations

import random
import uuid as _uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

# --- haystack: generated sentences ---------------------------------------------------------

_SUBJECTS = ["the farmer", "a teacher", "the old sailor", "my neighbour", "the young painter", "a quiet student",
             "the baker", "our guide", "the musician", "a tired traveller", "the gardener", "the doctor",
             "a curious child", "the captain", "the librarian", "an engineer"]
_VERBS = ["carried", "painted", "repaired", "watched", "found", "described", "cleaned", "measured", "sold",
          "borrowed", "admired", "counted", "moved", "studied", "forgot", "wrapped"]
_OBJECTS = ["a wooden chair", "the long letter", "a basket of apples", "the broken clock", "an old map",
            "the blue door", "a pair of boots", "the heavy box", "a small boat", "the garden fence",
            "a stack of books", "the kitchen table", "a warm blanket", "the iron gate", "a paper lantern",
            "the stone bridge"]
_PLACES = ["near the river", "in the morning", "after the storm", "before dinner", "at the market",
           "beside the station", "during the festival", "on the hill", "in the village square",
           "under the bridge", "late in the evening", "at the edge of the forest", "behind the school",
           "in the harbour", "on a rainy day", "by the lake"]
_TAILS = ["", "", "", " and then went home", " while the wind grew colder", " because nobody else would",
          " as everyone had expected", " without saying a word", " for the second time that week",
          " with great care"]


def _capitalise(s: str) -> str:
    return s[0].upper() + s[1:]


def filler_sentence(rng: random.Random, avoid: frozenset = frozenset()) -> str:
    """A haystack sentence; none whose (subject, verb index, object index) is in `avoid` (redrawn)."""
    while True:
        subj, verb, obj = rng.choice(_SUBJECTS), rng.randrange(len(_VERBS)), rng.randrange(len(_OBJECTS))
        s = f"{subj} {_VERBS[verb]} {_OBJECTS[obj]} {rng.choice(_PLACES)}{rng.choice(_TAILS)}."
        if (subj, verb, obj) not in avoid:
            return _capitalise(s)


# the haystack's verbs in the base form and its objects in the plural (the `story_*` questions and needles)
_VERBS_BASE = ["carry", "paint", "repair", "watch", "find", "describe", "clean", "measure", "sell", "borrow",
               "admire", "count", "move", "study", "forget", "wrap"]
_OBJECTS_PLURAL = ["wooden chairs", "long letters", "baskets of apples", "broken clocks", "old maps", "blue doors",
                   "pairs of boots", "heavy boxes", "small boats", "garden fences", "stacks of books",
                   "kitchen tables", "warm blankets", "iron gates", "paper lanterns", "stone bridges"]


# --- needle keys and values (vocabulary disjoint from the haystack's) -------------------------

_KEY_ADJ = ["ancient", "bitter", "brave", "crimson", "dizzy", "eager", "fancy", "gentle", "hollow", "icy",
            "jolly", "lucky", "mighty", "nimble", "odd", "proud", "rapid", "silent", "tidy", "vivid",
            "wild", "zesty", "fuzzy", "humble"]
_KEY_NOUN = ["pelican", "walrus", "teapot", "volcano", "glacier", "compass", "violin", "lobster", "meteor",
             "cactus", "kettle", "falcon", "trumpet", "octopus", "canyon", "jaguar", "lantern-fish",
             "pyramid", "comet", "penguin", "sapphire", "tornado", "orchid", "dolphin"]
_WORD_VALUES = ["zeppelin", "marmalade", "quicksilver", "buttercup", "hieroglyph", "saxophone", "kaleidoscope",
                "porcupine", "thunderbolt", "cinnamon", "labyrinth", "pomegranate", "chandelier", "armadillo",
                "avalanche", "tangerine", "harmonica", "mosaic", "flamingo", "periscope", "nectarine",
                "obsidian", "gazebo", "sombrero"]
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _key(rng: random.Random, used: set[str]) -> str:
    while True:
        k = f"{rng.choice(_KEY_ADJ)}-{rng.choice(_KEY_NOUN)}"
        if k not in used:
            used.add(k)
            return k


def _value(rng: random.Random, kind: str, used: set[str]) -> str:
    while True:
        if kind == "number":
            v = str(rng.randint(1_000_000, 9_999_999))
        elif kind == "word":
            v = rng.choice(_WORD_VALUES)
        elif kind == "uuid":
            v = str(_uuid.UUID(int=rng.getrandbits(128), version=4))
        else:
            raise ValueError(f"unknown needle value kind {kind!r}")
        if v not in used:
            used.add(v)
            return v


def _var_name(rng: random.Random, used: set[str]) -> str:
    while True:
        v = "".join(rng.choice(_LETTERS) for _ in range(5))
        if v not in used:
            used.add(v)
            return v


# --- tasks ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskSpec:
    """One task: how to make its needles/question and how many tokens to generate."""

    name: str
    kind: str                 # niah | vt
    value_kind: str = "number"
    needles: int = 1          # keyed needles that are asked about (niah) / chain hops (vt)
    distractors: int = 0      # other keyed needles (multikey)
    values_per_key: int = 1   # multivalue
    max_new_tokens: int = 16


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("niah_single_number", "niah", "number", max_new_tokens=16),
    TaskSpec("niah_single_word", "niah", "word", max_new_tokens=12),
    TaskSpec("niah_single_uuid", "niah", "uuid", max_new_tokens=40),
    TaskSpec("niah_multikey", "niah", "number", distractors=3, max_new_tokens=16),
    TaskSpec("niah_multivalue", "niah", "number", values_per_key=4, max_new_tokens=64),
    TaskSpec("niah_multiquery", "niah", "number", needles=4, max_new_tokens=64),
    TaskSpec("vt", "vt", needles=4, max_new_tokens=30),
    TaskSpec("story_single", "story", max_new_tokens=16),
    TaskSpec("story_multikey", "story", distractors=3, max_new_tokens=16),
)}

LENGTHS = (2048, 4096, 8192)


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def score_string_match_all(pred: str, answers: Sequence[str]) -> float:
    """RULER `string_match_all`: fraction of answers contained (case-insensitively) in the prediction."""
    p = pred.lower()
    return sum(a.lower() in p for a in answers) / len(answers) if answers else 0.0


@dataclass
class Sample:
    task: str
    length: int
    index: int
    seed: int
    prompt: str
    input_ids: list[int]
    answers: list[str]
    max_new_tokens: int
    depths: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def score(self, pred: str) -> float:
        """RULER string-match (partial credit for several answers)."""
        return score_string_match_all(pred, self.answers)

    def all_found(self, pred: str) -> bool:
        return score_string_match_all(pred, self.answers) == 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "length": self.length, "index": self.index, "seed": self.seed,
                "num_tokens": self.num_tokens, "answers": self.answers, "depths": self.depths,
                "max_new_tokens": self.max_new_tokens}


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _plural(kind: str) -> str:
    return {"number": "numbers", "word": "words", "uuid": "uuids"}[kind]


def _story_needles(spec: TaskSpec, rng: random.Random):
    """Counting sentences in the haystack's grammar: the asked one first, then the distractors (distinct
    (subject, verb, object) triples, distinct counts). Returns (needles, question, prefix, answers, avoid)."""
    triples: set[tuple[str, int, int]] = set()
    counts: set[int] = set()
    facts = []
    while len(facts) < 1 + spec.distractors:
        t = (rng.choice(_SUBJECTS), rng.randrange(len(_VERBS)), rng.randrange(len(_OBJECTS)))
        n = rng.randint(10_000, 99_999)
        if t in triples or n in counts:
            continue
        triples.add(t)
        counts.add(n)
        facts.append((t, n, rng.choice(_PLACES)))
    needles = [_capitalise(f"{subj} {_VERBS[v]} {n} {_OBJECTS_PLURAL[o]} {place}.") for (subj, v, o), n, place in facts]
    (subj, v, o), n, place = facts[0]
    question = (f"According to the text above, how many {_OBJECTS_PLURAL[o]} did {subj} {_VERBS_BASE[v]} "
                f"{place}? Answer with the number.")
    prefix = f"{_capitalise(subj)} {_VERBS[v]}"
    return needles, question, prefix, [str(n)], frozenset(triples)


def _needles_and_question(spec: TaskSpec, rng: random.Random):
    """(needle sentences in insertion order, question text, answer prefix, answers, needles ordered?)."""
    used: set[str] = set()
    if spec.kind == "vt":
        value = str(rng.randint(10_000, 99_999))
        names = [_var_name(rng, used) for _ in range(spec.needles + 1)]
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
        question = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (f"Answer: According to the chain(s) of variables assignment in the text above, {len(names)} "
                  f"variables are assigned the value {value}, they are:")
        return needles, question, prefix, names, True
    kind_pl = _plural(spec.value_kind)
    kind_sg = spec.value_kind
    needle = "One of the special magic {kind} for {key} is: {value}."
    items: list[tuple[str, str]] = []  # (key, value)
    asked = [_key(rng, used) for _ in range(spec.needles)]
    answers: list[str] = []
    for k in asked:
        for _ in range(spec.values_per_key):
            v = _value(rng, spec.value_kind, used)
            items.append((k, v))
            answers.append(v)
    for _ in range(spec.distractors):
        items.append((_key(rng, used), _value(rng, spec.value_kind, used)))
    rng.shuffle(items)
    needles = [needle.format(kind=kind_sg, key=k, value=v) for k, v in items]
    query = _join_keys(asked)
    if len(answers) == 1:
        question = f"What is the special magic {kind_sg} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind_sg} for {query} mentioned in the provided text is"
    else:
        question = f"What are all the special magic {kind_pl} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind_pl} for {query} mentioned in the provided text are"
    return needles, question, prefix, answers, False


def _task_text(spec: TaskSpec, haystack: str, question: str) -> str:
    if spec.kind == "story":
        return f"Read the following story carefully. I will ask you about it afterwards.\n{haystack}\n{question}"
    if spec.kind == "vt":
        return (f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                f"{haystack}\n{question}")
    kind_pl = _plural(spec.value_kind)
    return (f"Some special magic {kind_pl} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind_pl} afterwards.\n{haystack}\n{question}")


def render_chat(tokenizer: Any, user_text: str) -> str:
    """The chat template with the generation prompt (plain text when the tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                             add_generation_prompt=True)
    return user_text + "\n"


def _encode(tokenizer: Any, text: str) -> list[int]:
    # the chat template already carries the special tokens as text
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_sample(task: str, length: int, index: int, tokenizer: Any, *, seed: int = 0,
                render: Callable[[Any, str], str] = render_chat) -> Sample:
    """One deterministic sample of `task` whose prompt has `length - max_new_tokens` tokens (to a sentence)."""
    spec = TASKS[task]
    rng = random.Random(f"sglang-compact-ruler/{seed}/{task}/{length}/{index}")
    avoid: frozenset = frozenset()
    if spec.kind == "story":
        needles, question, prefix, answers, avoid = _story_needles(spec, rng)
        ordered = False
        rng.shuffle(needles)  # the asked sentence is anywhere among the distractors
    else:
        needles, question, prefix, answers, ordered = _needles_and_question(spec, rng)
    depths = sorted(rng.random() for _ in needles) if ordered else [rng.random() for _ in needles]
    target = length - spec.max_new_tokens
    sentences: list[str] = []

    def build(n: int) -> tuple[str, list[int]]:
        while len(sentences) < n:
            sentences.append(filler_sentence(rng, avoid))
        body = list(sentences[:n])
        # insert from the deepest so earlier positions stay put; ties keep the needles' order
        for d, s in sorted(zip(depths, needles), key=lambda x: x[0], reverse=True):
            body.insert(round(d * n), s)
        text = render(tokenizer, _task_text(spec, " ".join(body), question)) + prefix
        return text, _encode(tokenizer, text)

    # estimate tokens per sentence, then walk to the largest n that fits
    _, base = build(0)
    _, probe = build(64)
    per = max((len(probe) - len(base)) / 64, 1.0)
    n = max(int((target - len(base)) / per), 0)
    text, ids = build(n)
    for _ in range(8):  # correct the estimate (tokens per sentence vary a little)
        if len(ids) <= target and target - len(ids) < 2 * per:
            break
        n = max(n + int((target - len(ids)) / per), 0)
        text, ids = build(n)
    while len(ids) > target and n > 0:
        n -= 1
        text, ids = build(n)
    while True:
        t2, i2 = build(n + 1)
        if len(i2) > target:
            break
        n, text, ids = n + 1, t2, i2
    return Sample(task=task, length=length, index=index, seed=seed, prompt=text, input_ids=ids,
                  answers=list(answers), max_new_tokens=spec.max_new_tokens, depths=[round(d, 4) for d in depths])


def make_suite(tokenizer: Any, tasks: Iterable[str] | None = None, lengths: Iterable[int] = (2048,),
               n: int = 5, seed: int = 0) -> list[Sample]:
    """Samples for every (task, length), `n` each, in a fixed order."""
    tasks = list(TASKS) if tasks is None else list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known: {', '.join(TASKS)}")
    return [make_sample(t, L, i, tokenizer, seed=seed) for L in lengths for t in tasks for i in range(n)]


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))
