"""The OpenAI HTTP contract: request models, errors, and response/chunk builders.

Pure code (no engine, no torch): the worker's server validates requests with these models
and builds its answers with the builders (its shaping of engine output into them is
``sluice.worker.shaping``); the router reads requests with the same models. Request models accept unknown fields (clients send extras such as
``continuous_usage_stats`` or ``user``) but check the types of the known ones strictly, so a
string where a number belongs is a 400, as with OpenAI. Known fields the engines do not
honour (``NOT_HONOURED``: guided decoding, vLLM's other extras) are refused
unless they ask for nothing, never ignored.

Shapes follow the OpenAI API: legacy completions logprobs
``{tokens, token_logprobs, top_logprobs, text_offset}``, chat logprobs
``{content: [{token, logprob, bytes, top_logprobs: [...]}]}``, errors
``{"error": {message, type, param, code}}``, SSE ``data: {...}\\n\\n`` ending with
``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      ValidationInfo, field_validator, model_validator)

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # most alternatives per position (vLLM's default max_logprobs)
MAX_N = 128  # most choices per prompt (OpenAI's cap)
MAX_PROMPTS = 2048  # most prompts in one completions request (OpenAI's cap)
MAX_MESSAGES = 2048  # most messages in one chat request (the same bound)
MAX_LOGIT_BIAS = 2048  # most logit_bias entries (the same bound: counted before validation)
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range, [-100, 100]
MAX_CONTENT_PARTS = 64  # most content parts in one message (text only: a few in practice)
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; lm-eval tasks send a few)
MAX_STOP_CHARS = 256  # characters per stop string: each token checks every tail against them
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request
MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's upper bound
# repetition_penalty's range (vLLM only asks > 0): 1e-45 made an fp32 logit / it infinite
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_INT32 = 2**31 - 1
LOGPROB_FLOOR = -9999.0  # stands in for -inf, which JSON cannot carry


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered as an OpenAI error body with an HTTP status.

    Attributes:
        status_code: HTTP status (4xx for the client's fault, 5xx for ours).
        message: human-readable; names the numbers involved.
        param: the request field at fault, or None.
        code: a stable machine-readable code (``model_not_found``, ...), or None.
        type: OpenAI error type, ``invalid_request_error`` for any 4xx by default.
    """

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def http_error_body(status: int, detail: str) -> dict:
    """The OpenAI error object for a plain HTTP error (unknown route, wrong method): 4xx are
    ``invalid_request_error``, 5xx ``server_error``."""
    return error_body(detail, "invalid_request_error" if status < 500 else "server_error")


def validation_error(errors: Sequence[dict]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first bad field.

    ``errors`` are pydantic error dicts whose ``loc`` may start with ``"body"`` (FastAPI).
    Malformed JSON (``json_invalid``) gets ``param=None``.
    """
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return APIError(400, f"request body is not valid JSON: {detail}", code="json_invalid")
    loc = _loc(first)
    param = str(loc[0]) if loc and isinstance(loc[0], str) else None
    union = next((i for i, part in enumerate(loc) if _is_type_tag(part)), None)
    if union is not None:  # one error per member of a union ("prompt.str: ..."): one message
        tags = dict.fromkeys(where[union] for where in map(_loc, errors)
                             if where[:union] == loc[:union] and len(where) > union
                             and _is_type_tag(where[union]))
        *some, last = map(_describe, tags)
        return APIError(400, f"{'.'.join(map(str, loc[:union]))}: must be "
                        f"{', '.join(some)}{' or ' if some else ''}{last}", param=param)
    where = ".".join(str(p) for p in loc) or "body"
    message = first.get("msg", "invalid value").removeprefix("Value error, ")  # a validator's
    return APIError(400, f"{where}: {message}", param=param)


def _loc(error: dict) -> list:
    return [part for part in error.get("loc", ()) if part != "body"]


_TYPE_NAMES = {"str": ("a string", "strings"), "int": ("an integer", "integers"),
               "float": ("a number", "numbers"), "bool": ("a boolean", "booleans"),
               "ContentPart": ("a content part", "content parts")}


def _is_type_tag(part: Any) -> bool:
    """Whether a pydantic ``loc`` part names a union member (``str``, ``list[int]``)."""
    return isinstance(part, str) and (part in _TYPE_NAMES or part.startswith(("list[", "dict[")))


def _describe(tag: str, plural: bool = False) -> str:
    """A union member's tag in words: ``list[list[int]]`` → "a list of lists of integers"."""
    if tag.startswith("list[") and tag.endswith("]"):
        return ("lists of " if plural else "a list of ") + _describe(tag[5:-1], True)
    if tag.startswith("dict["):
        return "objects" if plural else "an object"
    one, many = _TYPE_NAMES.get(tag, (tag, tag))
    return many if plural else one


# --------------------------------------------------------------------------- requests


# OpenAI fields and vLLM extras that neither engine honours, each with the values that ask
# for nothing (clients send those): any other value is refused with a 400 naming the field,
# never ignored.
NOT_HONOURED: dict[str, tuple[Any, ...]] = {
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "allowed_token_ids": (None, []), "bad_words": (None, []), "use_beam_search": (None, False),
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,),
}
NOT_HONOURED_COMPLETIONS = {"suffix": (None, "")}
NOT_HONOURED_CHAT = {"echo": (None, False), "modalities": (None, ["text"]), "audio": (None,),
                     "prediction": (None,)}


def _refuse_unless_no_op(value: Any, info: ValidationInfo, no_ops: dict[str, tuple]) -> Any:
    """``value`` when it asks for nothing (``no_ops[field]``); ValueError otherwise."""
    allowed = no_ops[info.field_name]
    if value in allowed:
        return value
    shown = " or ".join("null" if v is None else json.dumps(v) for v in allowed)
    raise ValueError(f"not supported by this server; send {shown} or leave it out")


# A list's first bad item ends its validation. Without it, a 16 MiB body of 2M token ids with
# one string at the end built one error per item for each union member it failed: 37 s on
# the event loop (a prompt), 13 s (a stop list or a message's content), and every other
# request on the worker or router waited.
FAIL_FAST = Field(fail_fast=True)


def _at_most(value: Any, limit: int, what: str) -> Any:
    """``value``, a list counted before any of its items is validated (validating 480,000
    tiny chat messages took 2.2 s on the worker's event loop: long enough for the router to
    eject it). ``what`` names the items and their scope: "messages per request".

    Raises:
        ValueError: more than ``limit`` items.
    """
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"at most {limit} {what}, got {len(value)}")
    return value


class _Lenient(BaseModel):
    """Strict types for known fields, unknown fields kept (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # accepted; usage goes in the last chunk only


class _GenerationRequest(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Every number is finite and in the range vLLM's ``SamplingParams._verify_args`` accepts
    (a 400 naming the field otherwise), so no request can reach the sampler with a value
    that makes it raise.
    """

    model: str | None = None
    # >= 0 here (0 only with echo), so the router refuses a negative value itself (at zero
    # replicas, a request that only a worker refused woke a replica first); 0 without echo
    # and the prompt length are checked by the worker (max_tokens_for())
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY,
                                             le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | Annotated[list[str], FAIL_FAST] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0, le=MAX_INT32)  # and <= max_tokens (engine)
    n: int | None = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # NOT_HONOURED's other fields: any type, refused unless a no-op
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator(*NOT_HONOURED)
    @classmethod
    def _not_honoured(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_no_op(value, info, NOT_HONOURED)

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, value: StreamOptions | None, info: ValidationInfo
                          ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true (as OpenAI and vLLM)")
        return value

    @field_validator("logit_bias", mode="before")  # (counted before its items are checked)
    @classmethod
    def _bounded_logit_bias(cls, value: Any) -> Any:
        if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_items(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT32):
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS_VALUE):
                raise ValueError(f"values must be finite numbers in [-100, 100], got {bias}")
        return value

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with token ids as ints; None when empty."""
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias \
            else None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value != n:
            raise ValueError(f"best_of {value} other than n = {n} is not supported by this "
                             "server (nor by vLLM's V1 engine)")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and "type" not in value:
            raise ValueError("response_format needs a 'type'")
        kind = (value or {"type": "text"})["type"]
        if kind != "text":  # JSON mode and schemas need guided decoding: refused, not ignored
            raise ValueError(f"response_format type {kind!r} is not supported by this "
                             "server (only 'text')")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, "
                             f"got {longest}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_id_range(cls, value: list[int] | None) -> list[int] | None:
        bad = next((t for t in value or [] if not 0 <= t <= MAX_INT32), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of range [0, {MAX_INT32}]")
        return value

    def stop_strings(self) -> list[str]:
        """``stop`` as a list. Raises APIError (param ``stop``) on an empty string."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output cap the client asked for and the field it came in."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. ``prompt`` is text, texts, token ids, or lists of token ids."""

    prompt: (str | Annotated[list[str], FAIL_FAST] | Annotated[list[int], FAIL_FAST]
             | Annotated[list[Annotated[list[int], FAIL_FAST]], FAIL_FAST])
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Any = None  # NOT_HONOURED_COMPLETIONS

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], int):
            return value  # (one prompt of token ids)
        return _at_most(value, MAX_PROMPTS, "prompts per request")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_no_op(value, info, NOT_HONOURED_COMPLETIONS)

    def num_prompts(self) -> int:
        """Prompts in ``prompt``: a text or one list of token ids is one."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return 1
        return len(self.prompt)


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], FAIL_FAST] | None = None

    @field_validator("content", mode="before")  # (at the field: not one union member's error)
    @classmethod
    def _bounded_parts(cls, value: Any) -> Any:
        return _at_most(value, MAX_CONTENT_PARTS, "content parts per message")

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # as OpenAI: only an assistant message (one that made tool calls) may have none
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or a list of "
                             "content parts)")
        return self

    def text(self) -> str:
        """The message content as one string. Raises APIError on non-text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise APIError(400, f"content part type {part.type!r} is not supported; "
                                    "only text parts are", param="messages")
            if part.text is None:
                raise APIError(400, "a content part of type 'text' needs a 'text' string",
                               param="messages")
        return "".join(part.text for part in self.content)


Messages = Annotated[list[ChatMessage], FAIL_FAST, BeforeValidator(
    lambda value: _at_most(value, MAX_MESSAGES, "messages per request"))]


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: Messages = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None  # ... of tool_choice
    echo: Any = None  # NOT_HONOURED_CHAT (vLLM's: the last message's text first)
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    @field_validator(*NOT_HONOURED_CHAT)
    @classmethod
    def _chat_not_honoured(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_no_op(value, info, NOT_HONOURED_CHAT)

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:  # a tool call the client waits for would never come: refused
            raise ValueError("function calling is not supported by this server")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: str | dict[str, Any] | None
                          ) -> str | dict[str, Any] | None:
        if value not in (None, "none"):
            raise ValueError("function_call other than 'none' is not supported by this server")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value not in (None, "none"):
            raise ValueError("tool_choice other than 'none' is not supported by this server")
        return value

    def template_messages(self) -> list[dict]:
        """Messages as plain dicts for the tokenizer's chat template."""
        return template_messages(self.messages)


def template_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """``[{"role", "content"}]`` with text content. Raises APIError on non-text parts."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class TokenizeRequest(_Lenient):
    """POST /tokenize: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Lenient):
    """POST /detokenize."""

    model: str | None = None
    tokens: Annotated[list[int], FAIL_FAST]


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate ``data`` with ``model``. Raises APIError (400) naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


# --------------------------------------------------------------------------- limits


def check_fan_out(num_prompts: int, n: int, limit: int) -> None:
    """Refuse a request that fans out into more than ``limit`` engine requests.

    Raises:
        APIError: 400 naming ``n`` (or ``prompt`` when n is 1) with the numbers involved.
    """
    if num_prompts * n > limit:
        raise APIError(
            400, f"{num_prompts} prompt(s) x n {n} = {num_prompts * n} sequences, more than "
                 f"the {limit} one request may ask for on this server",
            param="n" if n > 1 else "prompt", code="too_many_sequences")


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_model_len: int, param: str) -> None:
    """Reject an empty prompt, out-of-vocabulary ids, or a prompt that fills the context.

    Raises:
        APIError: 400 with ``param``; the context message reads
            "N input tokens, maximum context M".
    """
    if not token_ids:
        raise APIError(400, f"{param} must not be empty", param=param)
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range [0, {vocab_size})", param=param)
    if len(token_ids) >= max_model_len:
        raise APIError(
            400, f"{len(token_ids)} input tokens, maximum context {max_model_len}: "
                 "the prompt leaves no room for output tokens",
            param=param, code="context_length_exceeded")


def max_tokens_for(requested: int | None, param: str, prompt_len: int, max_model_len: int,
                   allow_zero: bool = False) -> int:
    """The output cap to use: the request's, or the rest of the context when absent.

    Args:
        requested: ``max_tokens``/``max_completion_tokens`` from the request, or None.
        param: the field name it came in, for the error.
        prompt_len: prompt tokens (already known to be < max_model_len).
        max_model_len: context length in tokens.
        allow_zero: echo requests may ask for 0 new tokens.

    Raises:
        APIError: 400 (``param``) when negative, zero without echo, or prompt + output
            would exceed the context.
    """
    if requested is None:
        return max_model_len - prompt_len
    lowest = 0 if allow_zero else 1
    if requested < lowest:
        raise APIError(400, f"{param} must be at least {lowest}, got {requested}", param=param)
    if prompt_len + requested > max_model_len:
        raise APIError(
            400, f"{param} {requested} + {prompt_len} input tokens = {prompt_len + requested} "
                 f"tokens, maximum context {max_model_len}",
            param=param, code="context_length_exceeded")
    return requested


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, logprobs: dict | None,
                      finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta_choice(index: int, delta: dict, logprobs: dict | None,
                      finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"],
             response_id: str, created: int, model: str, choices: list[dict],
             usage_: dict | None = None) -> dict:
    """A response or chunk object; ``usage`` only when given (the last chunk, or non-stream).

    Streamed completions chunks use kind ``text_completion`` too, as OpenAI does.
    """
    body = {"id": response_id, "object": kind, "created": created, "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def model_list(name: str, max_model_len: int, root: str, created: int | None = None) -> dict:
    """GET /v1/models: one model, with vLLM's ``max_model_len`` extension."""
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": created or int(time.time()),
        "owned_by": "sluice", "root": root, "parent": None, "max_model_len": max_model_len,
    }]}


# Characters that JSON leaves raw (with ensure_ascii=False) and Python's str.splitlines,
# which httpx's iter_lines follows, takes for line ends: escaped, an event stays one line.
_LINE_BREAKS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (a str is sent as is, e.g. [DONE]).
    Non-ASCII text goes out as UTF-8, except U+0085, U+2028 and U+2029, which are escaped:
    raw, they split the event for clients that read lines with ``str.splitlines``."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                             separators=(",", ":"))
    for char, escaped in _LINE_BREAKS.items():
        if char in payload:
            payload = payload.replace(char, escaped)
    return f"data: {payload}\n\n".encode("utf-8")


SSE_DONE = sse("[DONE]")


def now() -> int:
    """Unix seconds, for ``created``."""
    return int(time.time())


