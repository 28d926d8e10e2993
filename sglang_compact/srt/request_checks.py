"""Malformed generate requests get an HTTP 400 instead of killing the server.

SGLang 0.5.17 checks a request's length and its sampling ranges, but not its token ids
(`TokenizerManager._validate_input_ids_in_vocab` exists and is never called) nor the types inside
`sampling_params`: an id outside [0, vocab), an empty prompt (one row of a batch), a non-boolean
`skip_special_tokens`, a `top_logprobs_num` above the vocabulary, a list where one value belongs... reach the
scheduler or the detokenizer and raise there, and SGLang then kills the whole process tree. Other ill-typed
values raise a TypeError in the HTTP process (a 500) or are silently misread (`"max_new_tokens": true`).

The plugin registers three hooks (`hooks()`), for every attention backend (the gap is SGLang's); SGLang's
`load_plugins()` applies them in the launcher process, where the HTTP server and the tokenizer manager run,
and in each scheduler process. The first two raise `RequestError`, a ValueError, which SGLang's HTTP server
answers with a 400 and the message:

1. AROUND `GenerateReqInput.normalize_batch_and_arguments` (`compat.REQUEST_NORMALIZE`): `n` is checked
   before SGLang's normalization compares it; an exception other than ValueError raised while SGLang
   normalizes the request (a malformed request, by construction) becomes one; after it, one prompt must have
   one request id, and a batch's per-request lists one value per request (SGLang would silently drop the
   surplus, or fail on a short list);
2. BEFORE `TokenizerManager._validate_one_request` (`compat.REQUEST_VALIDATE`): SGLang's per-request
   validation, called for each request (single, or each of a batch, generate or embedding) with its final
   token ids (given, or from the tokenizer) before it is sent to the scheduler. The ids must be a non-empty
   flat list of integers in [0, vocab); a generate request's sampling parameters must be known names of the
   right JSON type (ranges are left to SGLang's `SamplingParams.verify`), stop ids and logit-bias keys in the
   vocabulary, its logprob fields integers in range; on a CPU server, no grammar (`regex`, `json_schema`,
   `ebnf`, `structural_tag`: SGLang applies the grammar's mask on accelerators only and crashed on it);
3. AFTER the scheduler's `validate_input_length` (`compat.SCHEDULER_INPUT_CHECK`), a backstop for requests
   that reach a scheduler without the tokenizer manager (SGLang's gRPC entry point): ids out of the vocabulary
   abort the request with a 400 (SGLang's way for a too long prompt) instead of crashing the scheduler.

Requests with multimodal data or input embeddings are left to SGLang: their ids may carry placeholders.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Sequence

from sglang_compact.srt import compat

INT64 = 2**63
INT32 = 2**31


class RequestError(ValueError):
    """A malformed request (SGLang answers a ValueError with HTTP 400 and its message)."""

    status_code = 400


def _show(value: Any, limit: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= limit else s[:limit] + "..."


def _is_int(x) -> bool:
    return type(x) is int  # not bool, not float


def _is_finite_number(x) -> bool:
    try:
        return type(x) in (int, float) and math.isfinite(x)
    except OverflowError:  # an integer beyond any float
        return False


# --- token ids ------------------------------------------------------------------------------------------

def check_token_ids(ids: Any, vocab_size: int | None, what: str = "input_ids") -> None:
    """A prompt's ids: a non-empty flat list of integers in [0, vocab_size)."""
    if not isinstance(ids, (list, tuple, str, dict)) and callable(getattr(ids, "tolist", None)):
        ids = ids.tolist()  # an array or tensor of ids (a multimodal processor's)
    if not isinstance(ids, (list, tuple)):
        raise RequestError(f"{what} must be a list of token ids, got {_show(ids)}")
    if not ids:
        raise RequestError(f"{what} is empty: a prompt needs at least one token (give non-empty text or ids)")
    if not set(map(type, ids)) <= {int}:
        i, bad = next((i, x) for i, x in enumerate(ids) if not _is_int(x))
        raise RequestError(f"{what}[{i}] = {_show(bad)} is not a token id (an integer)")
    if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        i, bad = next((i, x) for i, x in enumerate(ids) if x < 0 or (vocab_size is not None and x >= vocab_size))
        raise RequestError(f"{what}[{i}] = {bad} is outside the model's vocabulary [0, {vocab_size}): "
                           "token ids must come from the model's tokenizer")


# --- sampling parameters --------------------------------------------------------------------------------

def _bound(n: int) -> str:
    """A bound for a message: 2**63 rather than 9223372036854775808."""
    a = abs(n)
    return f"{'-' if n < 0 else ''}2**{a.bit_length() - 1}" if a > 1024 and a & (a - 1) == 0 else str(n)


def _int_in(lo: int, hi: int, hint: str = ""):
    def check(name, v):
        if not _is_int(v):
            return f"must be an integer{hint}, got {_show(v)}"
        if not lo <= v < hi:
            return f"must be an integer in [{_bound(lo)}, {_bound(hi)}){hint}, got {_show(v)}"
    return check


def _number(name, v):
    if not _is_finite_number(v):
        return f"must be a finite number, got {_show(v)}"


def _boolean(name, v):
    if type(v) is not bool:
        return f"must be true or false, got {_show(v)}"


def _string(name, v):
    if not isinstance(v, str):
        return f"must be a string, got {_show(v)}"


def _strings(name, v):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        return f"must be a string or a list of strings, got {_show(v)}"
    if name == "stop_regex":
        for s in v:
            try:
                re.compile(s)
            except (re.error, RecursionError, OverflowError) as e:
                return f"{s!r} is not a valid regular expression ({e})"


def _object(name, v):
    if not isinstance(v, dict):
        return f"must be a JSON object, got {_show(v)}"


#: sampling parameter -> check (value -> error or None); None is SGLang's default for each of them. Ranges
#: are SGLang's to check (`SamplingParams.verify`), except where a value would overflow the int32 / int64
#: tensors the scheduler builds, and `n` (SGLang reads n < 1 as 1) and `stream_interval` (0: the default)
SAMPLING_CHECKS: dict[str, Callable[[str, Any], str | None]] = {
    "max_new_tokens": _int_in(0, INT64),
    "min_new_tokens": _int_in(0, INT64),
    "n": _int_in(1, INT32),
    "top_k": _int_in(-INT32, INT32, " (-1: all)"),
    "stream_interval": _int_in(0, INT32),
    "sampling_seed": _int_in(-INT64, INT64),
    **{k: _number for k in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                            "repetition_penalty")},
    **{k: _boolean for k in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                             "no_stop_trim")},
    **{k: _strings for k in ("stop", "stop_regex")},
    **{k: _string for k in ("json_schema", "regex", "ebnf", "structural_tag")},
    "custom_params": _object,
}


def check_parallel_samples(sampling_params: Any) -> None:
    """`n` of each sampling-params object (read by SGLang's normalization before anything else)."""
    for sp in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        if isinstance(sp, dict) and sp.get("n") is not None:
            err = SAMPLING_CHECKS["n"]("n", sp["n"])
            if err:
                raise RequestError(f"sampling_params.n {err}")


def check_sampling_params(sp: Any, vocab_size: int | None, known: frozenset[str] | None = None) -> None:
    """One request's sampling parameters: known names, JSON types, ids in the vocabulary."""
    if sp is None:
        return
    if not isinstance(sp, dict):
        raise RequestError(f"sampling_params must be a JSON object (one per request), got {_show(sp)}")
    if known is not None:
        unknown = sorted(k for k in sp if k not in known)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; known: "
                               f"{', '.join(sorted(known))}")
    for name, value in sp.items():
        check = SAMPLING_CHECKS.get(name)
        err = check(name, value) if check is not None and value is not None else None
        if err:
            raise RequestError(f"sampling_params.{name} {err}")
    stop_ids = sp.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise RequestError(f"sampling_params.stop_token_ids must be a list of token ids, got {_show(stop_ids)}")
        if stop_ids:
            check_token_ids(stop_ids, vocab_size, "sampling_params.stop_token_ids")
    bias = sp.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise RequestError(f"sampling_params.logit_bias must be a JSON object {{token id: bias}}, got "
                               f"{_show(bias)}")
        for key, value in bias.items():
            if not (isinstance(key, str) and re.fullmatch(r"\d+", key)) or (
                    vocab_size is not None and int(key) >= vocab_size):
                raise RequestError(f"sampling_params.logit_bias key {key!r} is not a token id in "
                                   f"[0, {vocab_size})")
            if not _is_finite_number(value):
                raise RequestError(f"sampling_params.logit_bias[{key!r}] must be a finite number, got "
                                   f"{_show(value)}")


# --- one request ----------------------------------------------------------------------------------------

def check_logprob_fields(fields: dict, vocab_size: int | None) -> None:
    """One request's logprob fields (single values by then)."""
    checks = {"return_logprob": _boolean, "logprob_start_len": _int_in(-1, INT64, " (-1: the default)"),
              "top_logprobs_num": _int_in(0, vocab_size + 1 if vocab_size else INT32, " (at most the vocabulary)")}
    for name, check in checks.items():
        value = fields.get(name)
        err = check(name, value) if value is not None else None
        if err:
            raise RequestError(f"{name} {err}")


#: sampling parameters that constrain decoding with a grammar (SGLang's grammar backend)
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


def check_grammar_device(sp: Any, device: str | None) -> None:
    """SGLang 0.5.17 applies a grammar's token mask on CUDA, XPU, MUSA or NPU only: on a CPU server a constrained
    request raises in the scheduler (`pin_memory=True` for the mask, then "Unsupported device: cpu"), which kills
    the server. Refused there instead."""
    if device != "cpu" or not isinstance(sp, dict):
        return
    used = [k for k in GRAMMAR_FIELDS if sp.get(k) is not None]
    if used:
        raise RequestError(f"sampling_params.{used[0]}: constrained decoding is not available on a CPU server "
                           "(SGLang applies the grammar's token mask on CUDA, XPU, MUSA or NPU only); leave out "
                           f"{', '.join(GRAMMAR_FIELDS)}")


def check_request(view: compat.RequestView, input_ids: Any, vocab_size: int | None,
                  known_sampling: frozenset[str] | None = None, device: str | None = None) -> None:
    """One request (single, or one of a batch), with its final token ids, for a server on `device`."""
    if view.generate:
        check_grammar_device(view.sampling_params, device)
    if not view.ids_are_tokens:
        return
    if input_ids is not None:
        check_token_ids(input_ids, vocab_size)
    if view.generate:
        check_sampling_params(view.sampling_params, vocab_size, known_sampling)
        check_logprob_fields(view.per_request, vocab_size)


def check_normalized(view: compat.RequestView) -> None:
    """A normalized request: one request has one id; a batch's per-request lists have one value per request."""
    if not view.generate:
        return
    if view.single:
        if view.rid is not None and not isinstance(view.rid, str):
            raise RequestError(f"rid must be a string for one prompt, got {_show(view.rid)}")
        return
    for name, value in [("sampling_params", view.sampling_params), *view.per_request.items()]:
        if isinstance(value, list) and len(value) != view.count:
            raise RequestError(f"{name} has {len(value)} values for a batch of {view.count} requests: give "
                               "one value for all, or one per request")


# --- the hooks ------------------------------------------------------------------------------------------

_CONVERTED = (TypeError, AttributeError, IndexError, KeyError, AssertionError)


def normalize_request(original, obj, *args, **kwargs):
    """AROUND hook of `GenerateReqInput.normalize_batch_and_arguments`."""
    check_parallel_samples(compat.request_view(obj).sampling_params)
    try:
        result = original(obj, *args, **kwargs)
    except _CONVERTED as e:
        raise RequestError(f"malformed request: {type(e).__name__}: {e}") from e
    check_normalized(compat.request_view(obj))
    return result


def validate_request(tokenizer_manager, obj, input_ids=None, *args, **kwargs):
    """BEFORE hook of `TokenizerManager._validate_one_request(obj, input_ids)`; returns None (arguments kept)."""
    check_request(compat.request_view(obj), input_ids, compat.tokenizer_manager_vocab_size(tokenizer_manager),
                  compat.sampling_param_names(), compat.tokenizer_manager_device(tokenizer_manager))
    return None


def scheduler_input_check(error_msg, req, *args, **kwargs):
    """AFTER hook of the scheduler's `validate_input_length(req, ...)`: its error message, or ours."""
    if error_msg:
        return None
    ids, vocab_size = compat.scheduler_request_ids(req)
    if ids is None or vocab_size is None or not len(ids):
        return None
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        return (f"input_ids has token id {lo if lo < 0 else hi} outside the model's vocabulary [0, {vocab_size}): "
                "token ids must come from the model's tokenizer")
    return None


def hooks() -> Sequence[tuple[str, Callable, str]]:
    """(target, hook, kind) of each request check, for `compat.register_hook`."""
    return ((compat.REQUEST_NORMALIZE, normalize_request, "AROUND"),
            (compat.REQUEST_VALIDATE, validate_request, "BEFORE"),
            (compat.SCHEDULER_INPUT_CHECK, scheduler_input_check, "AFTER"))
