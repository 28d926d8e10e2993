"""SGLang's frontends against ONE `compact` server on the CPU (SmolLM2-135M-Instruct, page 16, chunks of 128,
selector flashprefill from a 256-token prefix with a 64-token dense tail, so the ~1100-token document is prefilled
mostly sparse):

(a) an SGLang frontend program (`@sgl.function`, a long shared document, two `sgl.gen` turns) run with
    `run_batch` over three questions through `sgl.RuntimeEndpoint` at temperature 0 (tests/frontend_client.py,
    run in a child process with the CPU shim: `import sglang` needs it on a machine without CUDA): every
    answer is non-empty, each second turn is served from the radix cache (the first turn's context, but for its
    dense tail and last window: sglang_compact/srt/alignment.py), and so is the shared document for the programs
    after the first;
(b) the OpenAI client on `/v1`: a chat completion with the document as a long system message, temperature 0,
    max_tokens 16: a non-empty reply and usage.prompt_tokens > 500.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from frontend_client import QUESTIONS  # noqa: E402  (no sglang import at module level)
from serving import SERVER_ENV, SGLangServer  # noqa: E402

MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
ARGS = ["--attention-backend", "compact", "--compact-selector", "flashprefill", "--compact-min-context", "256",
        "--compact-dense-tail", "64"]
#: what a cache hit leaves to recompute at most: the cached prompt's dense tail and one window (the chunk)
RECOMPUTED = 64 + 128


@pytest.fixture(scope="module")
def server():
    from convert_smollm2 import convert

    model = convert(MODEL_DIR, "float32", quiet=True)
    with SGLangServer(model, module="sglang_compact.launch_server", page_size=16, chunked_prefill_size=128,
                      extra_args=ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def frontend_result(server):
    env = {**os.environ, **SERVER_ENV}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "frontend_client.py"), server.base_url],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)
    assert r.returncode == 0, f"{r.stderr[-4000:]}\nserver log tail:\n{server.log_tail()}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["seconds"] = time.monotonic() - t0
    return out


def test_frontend_program_run_batch(frontend_result, server):
    progs = frontend_result["programs"]
    assert [p["question"] for p in progs] == QUESTIONS
    for p in progs:
        for name in ("answer", "short"):
            assert p[name].strip(), f"empty {name!r} for {p['question']!r}"
            assert p[name + "_meta"]["completion_tokens"] > 0
        first, second = p["answer_meta"], p["short_meta"]
        assert first["prompt_tokens"] > 1000  # the document went through chunked (compact) prefill
        # the second turn re-sends the first turn's context: served from the radix cache, but for the first
        # prompt's dense tail and last window (computed dense or from part of a window's queries)
        assert second["cached_tokens"] >= first["prompt_tokens"] - RECOMPUTED, p
    # the programs share the document: after the first one prefilled it, the others hit the cache
    # (with chunked prefill the programs are admitted one chunk budget at a time)
    shared = sorted(p["answer_meta"]["cached_tokens"] / p["answer_meta"]["prompt_tokens"] for p in progs)
    assert all(s >= 0.5 for s in shared[1:]), shared
    log = server.log_path.read_text()
    assert "selector='flashprefill'" in log


def test_openai_chat_completion(frontend_result, server):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", timeout=600)
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(
        model=model, temperature=0, max_tokens=16,
        messages=[{"role": "system", "content": frontend_result["system"]},
                  {"role": "user", "content": "Which crop did station Moray sow?"}])
    reply = resp.choices[0].message.content
    assert reply and reply.strip()
    assert resp.usage.prompt_tokens > 500 and 0 < resp.usage.completion_tokens <= 16
