"""The request checks (sglang_compact/srt/request_checks.py): malformed requests raise `RequestError` (a
ValueError: SGLang's HTTP server answers it with a 400) before they reach SGLang's scheduler.

* the checks themselves, on plain values;
* the hooks applied by SGLang's own `load_plugins()` to SGLang 0.5.17's real functions (in a fresh interpreter,
  with the CPU shim): the target names resolve, and a bad request raises our message through them.
The server side (every malformed request gets a 4xx and the server keeps serving) is
tests/test_fuzz_requests.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_compact.srt import compat
from sglang_compact.srt.request_checks import (
    RequestError,
    check_normalized,
    check_request,
    check_sampling_params,
    check_token_ids,
    scheduler_input_check,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 49152
KNOWN = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "logit_bias",
                   "skip_special_tokens", "n", "min_new_tokens", "json_schema", "regex", "stop_regex",
                   "custom_params", "stream_interval", "sampling_seed", "ignore_eos", "min_p"})


def view(sp=None, single=True, count=1, ids_are_tokens=True, generate=True, rid=None, **per_request):
    return compat.RequestView(generate=generate, single=single, count=count, ids_are_tokens=ids_are_tokens,
                              sampling_params=sp, per_request=per_request, rid=rid)


@pytest.mark.parametrize("ids", [[0], [1, 2, 3], [VOCAB - 1] * 5, list(range(0, VOCAB, 97)), (4, 5),
                                 array("q", [1, 2]), torch.tensor([3, 4])])
def test_good_ids_pass(ids):
    check_token_ids(ids, VOCAB)


def test_arrays_of_ids_are_checked_too():
    with pytest.raises(RequestError, match=r"input_ids\[1\] = 49152 is outside"):
        check_token_ids(torch.tensor([3, VOCAB]), VOCAB)


@pytest.mark.parametrize("ids, message", [
    ([1, VOCAB, 2], f"input_ids[1] = {VOCAB} is outside the model's vocabulary [0, {VOCAB})"),
    ([10**9], "input_ids[0] = 1000000000 is outside the model's vocabulary"),
    ([5, 6, -1], "input_ids[2] = -1 is outside the model's vocabulary"),
    ([], "input_ids is empty"),
    ([1, 1.5], "input_ids[1] = 1.5 is not a token id (an integer)"),
    ([1.0], "input_ids[0] = 1.0 is not a token id"),
    ([True, 2], "input_ids[0] = True is not a token id"),
    (["12"], "input_ids[0] = '12' is not a token id"),
    ([[1, 2]], "input_ids[0] = [1, 2] is not a token id"),
    ([None], "input_ids[0] = None is not a token id"),
    ("hello", "input_ids must be a list of token ids"),
])
def test_bad_ids_are_refused_with_the_position_and_the_reason(ids, message):
    with pytest.raises(RequestError) as e:
        check_token_ids(ids, VOCAB)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError) and e.value.status_code == 400


def test_good_sampling_params_pass():
    check_sampling_params(None, VOCAB, KNOWN)
    check_sampling_params({}, VOCAB, KNOWN)
    check_sampling_params({"max_new_tokens": 8, "temperature": 0, "top_p": 0.9, "top_k": -1, "stop": ["\n", "x"],
                           "stop_token_ids": [2, 3], "logit_bias": {"5": -1.5, "7": 2}, "n": 2, "ignore_eos": True,
                           "skip_special_tokens": False, "json_schema": None, "regex": "[a-z]+",
                           "stop_regex": r"\d+", "custom_params": {"a": 1}, "stream_interval": 4,
                           "sampling_seed": 123, "min_new_tokens": 0, "min_p": 0.05}, VOCAB, KNOWN)
    check_sampling_params({"max_new_tokens": None, "temperature": None}, VOCAB, KNOWN)  # SGLang's defaults
    check_sampling_params({"top_k": 10**6}, VOCAB, KNOWN)  # more than the vocabulary: all
    check_sampling_params({"top_k": 0, "temperature": 0}, VOCAB, KNOWN)  # ranges: SGLang's (greedy ignores it)


@pytest.mark.parametrize("sp, message", [
    ({"max_new_tokens": 1.5}, "sampling_params.max_new_tokens must be an integer, got 1.5"),
    ({"max_new_tokens": "5"}, "sampling_params.max_new_tokens must be an integer, got '5'"),
    ({"max_new_tokens": True}, "sampling_params.max_new_tokens must be an integer, got True"),
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens must be an integer in [0, 2**63), got -1"),
    ({"max_new_tokens": 2**70}, "sampling_params.max_new_tokens must be an integer in [0, 2**63)"),
    ({"temperature": "0"}, "sampling_params.temperature must be a finite number, got '0'"),
    ({"temperature": float("nan")}, "sampling_params.temperature must be a finite number, got nan"),
    ({"temperature": 10**400}, "sampling_params.temperature must be a finite number, got 1000000"),
    ({"logit_bias": {"1": 10**400}}, "sampling_params.logit_bias['1'] must be a finite number"),
    ({"top_p": [1]}, "sampling_params.top_p must be a finite number"),
    ({"top_k": 1.5}, "sampling_params.top_k must be an integer (-1: all), got 1.5"),
    ({"top_k": 2**31}, "sampling_params.top_k must be an integer in [-2**31, 2**31) (-1: all), got 2147483648"),
    ({"n": 0}, "sampling_params.n must be an integer in [1, 2**31), got 0"),
    ({"n": "2"}, "sampling_params.n must be an integer"),
    ({"stream_interval": -1}, "sampling_params.stream_interval must be an integer in [0, 2**31)"),
    ({"skip_special_tokens": "no"}, "sampling_params.skip_special_tokens must be true or false, got 'no'"),
    ({"ignore_eos": 1}, "sampling_params.ignore_eos must be true or false"),
    ({"stop": 5}, "sampling_params.stop must be a string or a list of strings, got 5"),
    ({"stop": ["a", None]}, "sampling_params.stop must be a string or a list of strings"),
    ({"stop_regex": "("}, "sampling_params.stop_regex '(' is not a valid regular expression"),
    ({"regex": ["a"]}, "sampling_params.regex must be a string"),
    ({"json_schema": {"type": "object"}}, "sampling_params.json_schema must be a string"),
    ({"custom_params": "x"}, "sampling_params.custom_params must be a JSON object"),
    ({"stop_token_ids": 5}, "sampling_params.stop_token_ids must be a list of token ids, got 5"),
    ({"stop_token_ids": [VOCAB]}, f"sampling_params.stop_token_ids[0] = {VOCAB} is outside the model's vocabulary"),
    ({"stop_token_ids": [1.5]}, "sampling_params.stop_token_ids[0] = 1.5 is not a token id"),
    ({"logit_bias": [1]}, "sampling_params.logit_bias must be a JSON object {token id: bias}"),
    ({"logit_bias": {"abc": 1}}, "sampling_params.logit_bias key 'abc' is not a token id in [0, 49152)"),
    ({"logit_bias": {str(VOCAB): 1}}, "sampling_params.logit_bias key '49152' is not a token id"),
    ({"logit_bias": {"1": "x"}}, "sampling_params.logit_bias['1'] must be a finite number, got 'x'"),
    ({"no_such_parameter": 1}, "unknown sampling parameter(s) 'no_such_parameter'; known: "),
    ([{"max_new_tokens": 2}], "sampling_params must be a JSON object (one per request)"),
])
def test_bad_sampling_params_are_refused(sp, message):
    with pytest.raises(RequestError) as e:
        check_sampling_params(sp, VOCAB, KNOWN)
    assert message in str(e.value)


@pytest.mark.parametrize("fields, message", [
    ({"return_logprob": [True, False]}, "return_logprob must be true or false"),
    ({"logprob_start_len": [0, 0]}, "logprob_start_len must be an integer (-1: the default)"),
    ({"logprob_start_len": -5}, "logprob_start_len must be an integer in [-1, 2**63) (-1: the default), got -5"),
    ({"top_logprobs_num": VOCAB + 1}, f"top_logprobs_num must be an integer in [0, {VOCAB + 1})"),
    ({"top_logprobs_num": -1}, "top_logprobs_num must be an integer in [0, 49153)"),
    ({"top_logprobs_num": [1, 2]}, "top_logprobs_num must be an integer"),
])
def test_a_requests_logprob_fields_are_single_values_in_range(fields, message):
    with pytest.raises(RequestError) as e:
        check_request(view({"max_new_tokens": 1}, **fields), [1, 2], VOCAB, KNOWN)
    assert message in str(e.value)
    check_request(view({"max_new_tokens": 1}, return_logprob=True, logprob_start_len=-1, top_logprobs_num=VOCAB),
                  [1, 2], VOCAB, KNOWN)


def test_a_cpu_server_refuses_constrained_decoding():
    for grammar in ({"regex": "[0-9]+"}, {"json_schema": "{}"}, {"ebnf": "root ::= 'a'"}, {"structural_tag": "{}"}):
        sp = {"max_new_tokens": 4, **grammar}
        with pytest.raises(RequestError, match=f"sampling_params.{next(iter(grammar))}: constrained decoding is not "
                                               "available on a CPU server"):
            check_request(view(sp), [1, 2], VOCAB, KNOWN, device="cpu")
        check_request(view(sp), [1, 2], VOCAB, None, device="cuda")           # a GPU server runs them
        check_request(view(sp), [1, 2], VOCAB, None)                          # device unknown: left to SGLang
    check_request(view({"max_new_tokens": 4, "regex": None}), [1, 2], VOCAB, KNOWN, device="cpu")


def test_what_a_request_check_looks_at():
    check_request(view(), [1, 2], VOCAB, KNOWN)
    with pytest.raises(RequestError, match="outside the model's vocabulary"):
        check_request(view(generate=False), [VOCAB], VOCAB, KNOWN)          # embedding requests too
    check_request(view(generate=False, sp="ignored"), [5], VOCAB, KNOWN)   # (they have no sampling)
    check_request(view(ids_are_tokens=False), [10**9, -3], VOCAB, KNOWN)   # multimodal placeholders: SGLang's
    check_request(view(), None, VOCAB, KNOWN)                              # input embeddings: no ids


def test_a_normalized_request_has_one_rid_per_prompt_and_one_value_per_request():
    check_normalized(view(rid="abc"))
    check_normalized(view(rid=["a", "b"], generate=False))
    with pytest.raises(RequestError, match=r"rid must be a string for one prompt, got \['a', 'b'\]"):
        check_normalized(view(rid=["a", "b"]))
    check_normalized(view([{}, {}], single=False, count=2, return_logprob=[True, False], top_logprobs_num=2))
    check_normalized(view([{}] * 3, single=True, count=1))   # single requests: their values are checked alone
    with pytest.raises(RequestError, match="sampling_params has 3 values for a batch of 2 requests"):
        check_normalized(view([{}] * 3, single=False, count=2))
    with pytest.raises(RequestError, match="logprob_start_len has 1 values for a batch of 2 requests"):
        check_normalized(view({}, single=False, count=2, logprob_start_len=[0]))


def test_the_scheduler_backstop_aborts_ids_out_of_the_vocabulary():
    def req(ids, **kw):
        return SimpleNamespace(origin_input_ids=array("q", ids), vocab_size=VOCAB, multimodal_inputs=None,
                               input_embeds=None, **kw)

    assert scheduler_input_check(None, req([1, 2, VOCAB - 1]), 8192, False) is None
    assert "token id 49152 outside the model's vocabulary [0, 49152)" in scheduler_input_check(None, req([1, VOCAB]))
    assert "token id -7 outside" in scheduler_input_check(None, req([-7, 3]))
    assert scheduler_input_check("too long", req([VOCAB]), 8192, False) is None  # keeps SGLang's own message
    mm = req([10**9])
    mm.multimodal_inputs = object()                                             # placeholders: left alone
    assert scheduler_input_check(None, mm) is None


HOOKS_IN_SGLANG = """
    import types
    from array import array
    from sglang.srt.plugins import load_plugins
    load_plugins()   # SGLang's own loader: runs our entry point, then applies every registered hook

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    import sglang.srt.managers.scheduler as scheduler_module
    from sglang_compact.srt.request_checks import RequestError

    def refused(fn, *args):
        try:
            fn(*args)
        except ValueError as e:
            assert isinstance(e, RequestError), repr(e)
            return str(e)
        raise AssertionError(f"not refused: {args}")

    # 1. normalization: a bad `n` (SGLang: a TypeError), a rid list for one prompt (SGLang: a TypeError later)
    print(refused(GenerateReqInput(input_ids=[1, 2], sampling_params={"n": "2"}).normalize_batch_and_arguments))
    print(refused(GenerateReqInput(input_ids=[1, 2], rid=["a", "b"]).normalize_batch_and_arguments))
    print(refused(GenerateReqInput(input_ids=[[1], [2]],
                                   sampling_params=[{}, {}, {}]).normalize_batch_and_arguments))
    ok = GenerateReqInput(input_ids=[[1], [2]], sampling_params=[{}, {}])
    ok.normalize_batch_and_arguments()

    # 2. the tokenizer manager's per-request validation, with the request's final ids
    tm = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=49152))
    obj = GenerateReqInput(input_ids=[1, 49152], sampling_params={"max_new_tokens": 2})
    obj.normalize_batch_and_arguments()
    print(refused(TokenizerManager._validate_one_request, tm, obj, [1, 49152]))
    obj = GenerateReqInput(text="hi", sampling_params={"skip_special_tokens": "no"})
    obj.normalize_batch_and_arguments()
    print(refused(TokenizerManager._validate_one_request, tm, obj, [5, 6]))
    print(refused(TokenizerManager._validate_one_request, tm, ok[1], []))

    # 3. the scheduler's check, through the name the scheduler module calls
    req = types.SimpleNamespace(origin_input_ids=array("q", [3, -1]), vocab_size=49152, multimodal_inputs=None,
                                input_embeds=None)
    print("scheduler:", scheduler_module.validate_input_length(req, 8192, False))
"""


def test_the_hooks_apply_to_sglangs_functions():
    env = {**os.environ, "SGLANG_COMPACT_CPU_SHIM": "1", "SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(HOOKS_IN_SGLANG)], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]
    assert "Failed to apply hooks" not in r.stderr, r.stderr[-5000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "sampling_params.n must be an integer, got '2'"
    assert lines[1] == "rid must be a string for one prompt, got ['a', 'b']"
    assert lines[2].startswith("sampling_params has 3 values for a batch of 2 requests"), lines[2]
    assert lines[3].startswith("input_ids[1] = 49152 is outside the model's vocabulary [0, 49152)"), lines[3]
    assert lines[4] == "sampling_params.skip_special_tokens must be true or false, got 'no'"
    assert lines[5].startswith("input_ids is empty"), lines[5]
    assert lines[6].startswith("scheduler: input_ids has token id -1 outside the model's vocabulary"), lines[6]
