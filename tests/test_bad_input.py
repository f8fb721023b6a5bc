"""Bad requests get a 4xx OpenAI error body naming the field, and the worker keeps serving.

Most cases run against the real worker process (``worker_url``); engine failures are
provoked in-process with a fake engine, and the pure validation helpers are unit-tested.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
import uvicorn
from pydantic import ValidationError

from sluice.api import openai as oa
from sluice.models import store
from sluice.worker.outputs import RequestOutput
from sluice.worker.sampling_params import InvalidSamplingParams
from sluice.worker.server import Worker, WorkerServer, create_app

MODEL = store.DEFAULT_MODEL
MSGS = [{"role": "user", "content": "hi"}]
LONG = "hello " * 9000  # > 8192 tokens


def post(url: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=60, **({"json": body} if body is not None else kw))


def assert_error(r: httpx.Response, status: int, param: str | None,
                 code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    assert err["type"] == "invalid_request_error"
    return err


CASES = [
    # (id, path, body, param)
    ("max_tokens-zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens-negative", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("max_tokens-negative-echo", "/v1/completions",
     {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("max_completion_tokens-negative", "/v1/chat/completions",
     {"messages": MSGS, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("max_tokens-over-context", "/v1/chat/completions",
     {"messages": MSGS, "max_tokens": 10**6}, "max_tokens"),
    ("temperature-negative", "/v1/completions", {"prompt": "hi", "temperature": -0.1},
     "temperature"),
    ("top_p-zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("top_p-above-one", "/v1/chat/completions", {"messages": MSGS, "top_p": 1.5}, "top_p"),
    ("top_k-below-minus-one", "/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("temperature-string", "/v1/completions", {"prompt": "hi", "temperature": "hot"},
     "temperature"),
    ("max_tokens-string", "/v1/chat/completions", {"messages": MSGS, "max_tokens": "ten"},
     "max_tokens"),
    ("max_tokens-float", "/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("stream-string", "/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("prompt-number", "/v1/completions", {"prompt": 123}, "prompt"),
    ("prompt-missing", "/v1/completions", {"max_tokens": 3}, "prompt"),
    ("prompt-empty", "/v1/completions", {"prompt": ""}, "prompt"),
    ("prompt-empty-list", "/v1/completions", {"prompt": []}, "prompt"),
    ("prompt-empty-token-list", "/v1/completions", {"prompt": [[]]}, "prompt"),
    ("prompt-bad-token-id", "/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
    ("prompt-negative-token-id", "/v1/completions", {"prompt": [-5]}, "prompt"),
    ("logprobs-bool-on-completions", "/v1/completions", {"prompt": "hi", "logprobs": True},
     "logprobs"),
    ("logprobs-too-many", "/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("messages-empty", "/v1/chat/completions", {"messages": []}, "messages"),
    ("messages-missing", "/v1/chat/completions", {"max_tokens": 3}, "messages"),
    ("messages-string", "/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("messages-null-content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": None}]}, "messages"),
    ("messages-no-content", "/v1/chat/completions", {"messages": [{"role": "system"}]},
     "messages"),
    ("messages-bad-role", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("messages-image", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    ("messages-text-part-without-text", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ("top_logprobs-without-logprobs", "/v1/chat/completions",
     {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs-too-many", "/v1/chat/completions",
     {"messages": MSGS, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("n-zero", "/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("stop-empty-string", "/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("stop-number", "/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("stream_options-string", "/v1/completions",
     {"prompt": "hi", "stream": True, "stream_options": "yes"}, "stream_options"),
    # issue 10: the ranges of vLLM's SamplingParams._verify_args, and bounded fan-out
    ("temperature-above-two", "/v1/completions", {"prompt": "hi", "temperature": 2.5},
     "temperature"),
    ("top_k-beyond-int32", "/v1/completions", {"prompt": "hi", "top_k": 2**40}, "top_k"),
    ("min_p-above-one", "/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("presence_penalty-above-two", "/v1/chat/completions",
     {"messages": MSGS, "presence_penalty": 3}, "presence_penalty"),
    ("frequency_penalty-below-minus-two", "/v1/completions",
     {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("repetition_penalty-zero", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0},
     "repetition_penalty"),
    # (a positive logit divided by 1e-45 in fp32 is inf: it was a 500, "no mass")
    ("repetition_penalty-tiny", "/v1/completions",
     {"prompt": "hi", "repetition_penalty": 1e-45, "temperature": 1}, "repetition_penalty"),
    ("repetition_penalty-huge", "/v1/completions", {"prompt": "hi", "repetition_penalty": 1e39},
     "repetition_penalty"),
    ("n-over-128", "/v1/completions", {"prompt": "hi", "n": 129}, "n"),
    ("chat-n-over-128", "/v1/chat/completions", {"messages": MSGS, "n": 129}, "n"),
    ("prompts-over-2048", "/v1/completions", {"prompt": ["hi"] * 2049}, "prompt"),
    ("prompts-times-n-over-the-limit", "/v1/completions",
     {"prompt": ["hi"] * 100, "n": 21}, "n"),  # 2,100 > the default 2,048
    ("stop-too-many", "/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("stop-too-long", "/v1/completions", {"prompt": "hi", "stop": "x" * 257}, "stop"),
    ("stop_token_ids-too-many", "/v1/completions",
     {"prompt": "hi", "stop_token_ids": [1] * 257}, "stop_token_ids"),
    ("stop_token_ids-beyond-int32", "/v1/chat/completions",
     {"messages": MSGS, "stop_token_ids": [2**40]}, "stop_token_ids"),
    # fields that were accepted and ignored: applied (min_tokens) or refused, never ignored
    ("min_tokens-negative", "/v1/completions", {"prompt": "hi", "min_tokens": -1},
     "min_tokens"),
    ("min_tokens-over-max_tokens", "/v1/chat/completions",
     {"messages": MSGS, "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("best_of-over-n", "/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("chat-best_of-over-n", "/v1/chat/completions", {"messages": MSGS, "best_of": 2},
     "best_of"),
    ("response_format-without-type", "/v1/chat/completions",
     {"messages": MSGS, "response_format": {}}, "response_format"),
    ("functions", "/v1/chat/completions", {"messages": MSGS, "functions": [
        {"name": "f", "parameters": {}}]}, "functions"),
    ("function_call-auto", "/v1/chat/completions", {"messages": MSGS, "function_call": "auto"},
     "function_call"),
    ("response_format-number", "/v1/chat/completions", {"messages": MSGS, "response_format": 5},
     "response_format"),
    ("response_format-json", "/v1/chat/completions",
     {"messages": MSGS, "response_format": {"type": "json_object"}}, "response_format"),
    ("tools", "/v1/chat/completions", {"messages": MSGS, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("tool_choice-required", "/v1/chat/completions", {"messages": MSGS, "tool_choice": "required"},
     "tool_choice"),
    ("messages-over-2048", "/v1/chat/completions", {"messages": MSGS * 2049}, "messages"),
    ("stream_options-without-stream", "/v1/completions",
     {"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}},
     "stream_options"),
    # OpenAI fields and vLLM extras neither engine honours: refused, never ignored
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("include_stop_str_in_output", "/v1/completions",
     {"prompt": "hi", "stop": [" 5"], "include_stop_str_in_output": True},
     "include_stop_str_in_output"),
    ("allowed_token_ids", "/v1/completions", {"prompt": "hi", "allowed_token_ids": [1, 2]},
     "allowed_token_ids"),
    ("bad_words", "/v1/chat/completions", {"messages": MSGS, "bad_words": ["x"]}, "bad_words"),
    ("use_beam_search", "/v1/completions", {"prompt": "hi", "use_beam_search": True},
     "use_beam_search"),
    ("prompt_logprobs", "/v1/completions", {"prompt": "hi", "prompt_logprobs": 1},
     "prompt_logprobs"),
    ("truncate_prompt_tokens", "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 5},
     "truncate_prompt_tokens"),
    ("skip_special_tokens-false", "/v1/completions",
     {"prompt": "hi", "skip_special_tokens": False}, "skip_special_tokens"),
    ("guided_choice", "/v1/chat/completions", {"messages": MSGS, "guided_choice": ["a", "b"]},
     "guided_choice"),
    ("guided_json", "/v1/completions", {"prompt": "hi", "guided_json": {"type": "object"}},
     "guided_json"),
    ("structured_outputs", "/v1/chat/completions",
     {"messages": MSGS, "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ("chat-echo", "/v1/chat/completions", {"messages": MSGS, "echo": True}, "echo"),
    ("modalities-audio", "/v1/chat/completions", {"messages": MSGS, "modalities": ["audio"]},
     "modalities"),
    ("audio", "/v1/chat/completions", {"messages": MSGS, "audio": {"voice": "alloy"}}, "audio"),
    ("prediction", "/v1/chat/completions",
     {"messages": MSGS, "prediction": {"type": "content", "content": "x"}}, "prediction"),
]


@pytest.mark.parametrize("path,body,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "stream"])
def test_bad_field_is_400_naming_it(worker_url, path, body, param, streamed):
    body = {"model": MODEL, **body}
    if streamed and "stream" not in body:
        body["stream"] = True  # must fail before the stream starts: a status, not SSE
    assert_error(post(worker_url, path, body), 400, param)


def test_a_text_part_without_text_is_told_so(worker_url):
    """Found by a break-it pass: it said "content part type 'text' is not supported; only
    text parts are"."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    err = assert_error(post(worker_url, "/v1/chat/completions", body), 400, "messages")
    assert err["message"] == "a content part of type 'text' needs a 'text' string"


@pytest.mark.parametrize("max_tokens", [None, 10], ids=["no-max_tokens", "max_tokens"])
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "stream"])
def test_prompt_longer_than_context(worker_url, max_tokens, streamed):
    body = {"model": MODEL, "prompt": LONG, "stream": streamed}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    err = assert_error(post(worker_url, "/v1/completions", body), 400, "prompt",
                       "context_length_exceeded")
    max_len = httpx.get(f"{worker_url}/v1/models").json()["data"][0]["max_model_len"]
    assert re.search(rf"\b\d+ input tokens, maximum context {max_len}\b", err["message"]), err
    assert "-" not in err["message"]  # never "max_tokens must be >= 1, got -808"


def test_chat_longer_than_context(worker_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}
    err = assert_error(post(worker_url, "/v1/chat/completions", body), 400, "messages")
    assert "input tokens, maximum context" in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_huge_prompt_is_refused_without_tokenizing(worker_url, path):
    """3 MB of text cannot fit any context: refused by its length alone (tokenizing it would
    hold the GIL for seconds and stall every other request)."""
    text = "a " * 1_500_000
    body = ({"prompt": text} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": text}]})
    err = assert_error(post(worker_url, path, {"model": MODEL, **body}), 400,
                       "prompt" if path == "/v1/completions" else "messages",
                       "context_length_exceeded")
    assert "characters cannot fit the maximum context" in err["message"]


def test_prompt_plus_max_tokens_over_context(worker_url):
    max_len = httpx.get(f"{worker_url}/v1/models").json()["data"][0]["max_model_len"]
    ids = [28120] * (max_len - 10)  # fits alone, but not with 11+ output tokens
    err = assert_error(post(worker_url, "/v1/completions",
                            {"model": MODEL, "prompt": ids, "max_tokens": 11}),
                       400, "max_tokens", "context_length_exceeded")
    assert f"{max_len - 10} input tokens" in err["message"]
    assert str(max_len) in err["message"] and "11" in err["message"]


def test_unknown_model_is_404(worker_url):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": MSGS, "stream": True})):
        r = post(worker_url, path, {"model": "gpt-4o", **body})
        assert_error(r, 404, "model", "model_not_found")


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"null", b'"text"',
                                 b"[" * 100_000 + b"]" * 100_000])
def test_malformed_body_is_400(worker_url, raw):
    r = post(worker_url, "/v1/completions", None, content=raw,
             headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_lone_surrogate_is_400_naming_the_field(worker_url):
    for path, body, field in (
            ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800"}]}',
             "messages[0].content"),
            ("/v1/completions", '{"model": "%s", "prompt": "\\udfff"}', "prompt"),
            ("/tokenize", '{"model": "%s", "prompt": "\\udfff"}', "prompt"),
            ("/v1/completions", '{"model": "%s", "prompt": "\\uD83D"}', "prompt")):
        r = post(worker_url, path, None, content=(body % MODEL).encode(),
                 headers={"content-type": "application/json"})
        assert_error(r, 400, field)
    # no escape: a surrogate's own bytes (json.loads decodes UTF-8 with surrogatepass), and
    # a UTF-16 body (json.loads detects it)
    raw = b'{"model": "%s", "prompt": "a\xed\xa0\x80"}' % MODEL.encode()
    utf16 = ('{"model": "%s", "prompt": "\ud800"}' % MODEL).encode("utf-16", "surrogatepass")
    for content in (raw, utf16):
        r = post(worker_url, "/v1/completions", None, content=content,
                 headers={"content-type": "application/json"})
        assert_error(r, 400, "prompt")
    assert post(worker_url, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1}).status_code == 200


def test_unknown_fields_are_accepted(worker_url):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "me", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "frequency_penalty": 0, "some_future_field": {"x": 1}}
    assert post(worker_url, "/v1/completions", body).status_code == 200


def test_tokenizer_routes_reject_bad_input(worker_url):
    assert_error(post(worker_url, "/tokenize", {}), 400, "prompt")
    assert_error(post(worker_url, "/tokenize", {"prompt": 5}), 400, "prompt")
    assert_error(post(worker_url, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    assert_error(post(worker_url, "/detokenize", {"tokens": "abc"}), 400, "tokens")


def test_worker_keeps_serving_after_bad_requests(worker_url):
    post(worker_url, "/v1/completions", {"model": MODEL, "prompt": LONG})
    post(worker_url, "/v1/completions", {"model": MODEL, "prompt": LONG, "stream": True})
    for i in range(10):
        r = post(worker_url, "/v1/completions",
                 {"model": MODEL, "prompt": f"Count: {i}", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{worker_url}/health").status_code == 200


# --------------------------------------------------------------------------- fake engine


class FakeTokenizer:
    """Characters are tokens (id = code point), enough for the server's needs."""

    eos_token = bos_token = pad_token = None
    chat_template = None

    def __len__(self) -> int:
        return 0x110000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return chr(token_id)

    def get_vocab(self) -> dict[str, int]:  # every token is one character (ASCII shown)
        return {chr(i): i for i in range(128)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class Stats:
    num_running = num_waiting = 0
    num_free_blocks = num_total_blocks = 10
    kv_cache_usage = 0.0
    prefix_cache_queries = prefix_cache_hits = spec_draft_tokens = spec_accepted_tokens = 0


class FakeEngine:
    """Emits "ab" then fails, or vetoes requests like LLMEngine.check_request."""

    tokenizer = FakeTokenizer()
    max_model_len = 64
    model_name = "fake"

    def __init__(self, fail_after: int = 1, pool_tokens: int = 10**6,
                 max_sequences_per_request: int = 2048):
        self.fail_after = fail_after
        self.pool_tokens = pool_tokens
        self.max_sequences_per_request = max_sequences_per_request

    def check_request(self, prompt, params) -> None:
        if len(prompt) + params.max_tokens > self.pool_tokens:
            raise ValueError(f"{len(prompt)} input tokens + max_tokens {params.max_tokens} need "
                             f"more KV cache than this worker has ({self.pool_tokens} tokens)")

    async def generate(self, prompt, params, request_id, group=None):
        for i in range(self.fail_after):
            yield RequestOutput(request_id, [97 + i], chr(97 + i), len(prompt), i + 1)
        raise RuntimeError("engine failed: CUDA error: device-side assert triggered")

    def stats(self) -> Stats:
        return Stats()

    def shutdown(self) -> None:
        pass


def _fake_app(engine: FakeEngine):
    worker = Worker(lambda: engine, "fake")
    worker.start_loading().join()
    return create_app(worker)


def _fake_post(engine: FakeEngine, path: str, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=_fake_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return await client.post(path, json=body)
    return asyncio.run(go())


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5}),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 5}),
])
def test_engine_error_in_stream_is_an_sse_error_then_done(path, body):
    r = _fake_post(FakeEngine(), path, {**body, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "engine failed" in events[-2]
    assert '"a"' in r.text  # the text before the failure was streamed


def test_engine_error_without_stream_is_500_body():
    r = _fake_post(FakeEngine(), "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"


def test_engine_veto_is_400_before_the_stream():
    engine = FakeEngine(pool_tokens=20)
    r = _fake_post(engine, "/v1/completions", {"prompt": "hi", "max_tokens": 30, "stream": True})
    err = assert_error(r, 400, "max_tokens")
    assert "more KV cache" in err["message"]


class VetoingEngine(FakeEngine):
    """Refuses every request as the vLLM backend does for values vLLM's own validation
    refuses (``vllm_backend.vllm_sampling_params``)."""

    def check_request(self, prompt, params) -> None:
        raise InvalidSamplingParams("vllm refused the request: top_k must be ...", "top_k")


def test_engine_veto_of_a_sampling_field_is_400_naming_it():
    r = _fake_post(VetoingEngine(), "/v1/completions", {"prompt": "hi", "stream": True})
    assert "vllm refused" in assert_error(r, 400, "top_k")["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
    ("/v1/completions", {"prompt": [[97], [98], [99], [100], [101]]}, "prompt"),
    ("/v1/chat/completions", {"messages": MSGS, "n": 5}, "n"),
])
def test_fan_out_over_the_configured_limit_is_400(path, body, param):
    err = assert_error(_fake_post(FakeEngine(max_sequences_per_request=4), path, body), 400,
                       param, "too_many_sequences")
    assert "more than the 4 one request may ask for" in err["message"]
    ok = {"prompt": ["a", "b"], "n": 2} if path == "/v1/completions" else {"messages": MSGS,
                                                                          "n": 4}
    r = _fake_post(FakeEngine(max_sequences_per_request=4, fail_after=0), path, ok)
    assert r.status_code == 500  # past the limit check: the fake engine then fails


def test_loading_worker_answers_503():
    worker = Worker(lambda: FakeEngine(), "fake")  # never started loading

    async def go():
        transport = httpx.ASGITransport(app=create_app(worker))
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return (await client.get("/health"),
                    await client.post("/v1/completions", json={"prompt": "hi"}))
    health, completion = asyncio.run(go())
    assert health.status_code == 503 and completion.status_code == 503
    assert completion.json()["error"]["code"] == "model_loading"


# --------------------------------------------------------------------------- pure helpers


def test_max_tokens_for():
    assert oa.max_tokens_for(None, "max_tokens", 10, 100) == 90
    assert oa.max_tokens_for(0, "max_tokens", 10, 100, allow_zero=True) == 0
    with pytest.raises(oa.APIError, match="at least 1, got 0") as e:
        oa.max_tokens_for(0, "max_tokens", 10, 100)
    assert e.value.param == "max_tokens"
    with pytest.raises(oa.APIError, match="91 .* = 101 tokens, maximum context 100"):
        oa.max_tokens_for(91, "max_tokens", 10, 100)


def test_check_prompt():
    oa.check_prompt([1, 2], 10, 3, "prompt")
    with pytest.raises(oa.APIError, match="3 input tokens, maximum context 3"):
        oa.check_prompt([1, 2, 3], 10, 3, "prompt")
    with pytest.raises(oa.APIError, match="out of range"):
        oa.check_prompt([10], 10, 30, "prompt")
    with pytest.raises(oa.APIError, match="empty"):
        oa.check_prompt([], 10, 30, "messages")


def test_validation_error_names_top_level_field():
    with pytest.raises(oa.APIError) as e:
        oa.parse(oa.ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert e.value.param == "messages" and e.value.status_code == 400
    assert oa.parse(oa.CompletionRequest, {"prompt": "x", "extra": 1}).model_extra == {"extra": 1}


@pytest.mark.parametrize("model, body", [
    (oa.CompletionRequest, {"prompt": [1] * 100_000 + ["x"]}),
    (oa.CompletionRequest, {"prompt": [[1]] * 2000 + [[1] * 100_000 + ["x"]]}),
    (oa.CompletionRequest, {"prompt": "a", "stop": [1] * 100_000}),
    (oa.DetokenizeRequest, {"tokens": ["x"] * 100_000})])
def test_a_long_list_with_bad_items_is_a_few_errors_not_one_per_item(model, body):
    """A list's first bad item ends its validation: one error per union member, not one per
    item (2M token ids and a string, 12 MB: 37 s of errors on the event loop before)."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert e.value.error_count() <= 4


def test_content_parts_and_tokenize_messages_are_counted():
    part = {"type": "text", "text": "a"}
    oa.parse(oa.ChatCompletionRequest, {"messages": [{"role": "user", "content": [part] * 64}]})
    with pytest.raises(oa.APIError) as e:
        oa.parse(oa.ChatCompletionRequest,
                 {"messages": [{"role": "user", "content": [part] * 65}]})
    assert (e.value.message, e.value.param) == (
        "messages.0.content: at most 64 content parts per message, got 65", "messages")
    with pytest.raises(oa.APIError, match="at most 2048 messages per request, got 2049"):
        oa.parse(oa.TokenizeRequest, {"messages": [{"role": "user", "content": "a"}] * 2049})


@pytest.mark.parametrize("model, body, param, message", [
    (oa.CompletionRequest, {"prompt": None}, "prompt", "prompt: must be a string, a list of "
     "strings, a list of integers or a list of lists of integers"),
    (oa.CompletionRequest, {"prompt": ["a", [1]]}, "prompt", "prompt: must be a string, a "
     "list of strings, a list of integers or a list of lists of integers"),
    (oa.CompletionRequest, {"prompt": "a", "stop": 5}, "stop",
     "stop: must be a string or a list of strings"),
    (oa.ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages",
     "messages.0.content: must be a string or a list of content parts")])
def test_a_value_of_no_type_in_a_union_is_told_what_the_field_takes(model, body, param,
                                                                     message):
    """One message naming what the field accepts, not pydantic's first union member's
    ("prompt.str: Input should be a valid string" for a list of token ids gone wrong)."""
    with pytest.raises(oa.APIError) as e:
        oa.parse(model, body)
    assert (e.value.message, e.value.param) == (message, param)


@pytest.mark.parametrize("model, field, item", [
    (oa.ChatCompletionRequest, "messages", {"role": "user", "content": "hi"}),
    (oa.CompletionRequest, "prompt", "hi")])
def test_too_many_messages_or_prompts_are_refused_before_any_is_validated(model, field, item):
    """2,048 messages (or prompts) at most, counted before any is validated: 480,000 tiny
    messages (16 MB) took 2.2 s to validate on the worker's event loop, long enough for the
    router's health poll to eject the worker (a helper's break-it pass). The last item here
    is invalid: the count is what is told."""
    oa.parse(model, {field: [item] * 2048})
    with pytest.raises(oa.APIError) as e:
        oa.parse(model, {field: [item] * 100_000 + [5]})
    assert e.value.param == field and e.value.status_code == 400
    assert f"at most 2048 {'messages' if field == 'messages' else 'prompts'} per request, " \
        "got 100001" in e.value.message


# --------------------------------------------------------------------------- lifecycle


class SlowEngine(FakeEngine):
    """Emits ``n`` tokens, one per ``delay`` seconds, then finishes."""

    def __init__(self, n: int = 8, delay: float = 0.05):
        super().__init__()
        self.n, self.delay = n, delay

    async def generate(self, prompt, params, request_id, group=None):
        for i in range(self.n):
            await asyncio.sleep(self.delay)
            last = i == self.n - 1
            yield RequestOutput(request_id, [120], "x", len(prompt), i + 1, finished=last,
                                finish_reason="length" if last else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_requests():
    """SIGTERM drops readiness at once but lets a running stream finish."""
    worker = Worker(lambda: SlowEngine(n=8, delay=0.1), "fake")
    app = create_app(worker)
    port = _free_port()
    server = WorkerServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                          worker)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "fake worker never became healthy"
        time.sleep(0.05)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"prompt": "hi", "max_tokens": 8, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        server.handle_exit(signal.SIGTERM, None)
        assert worker.draining
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    thread.join(15)
    assert not thread.is_alive(), "the server did not exit after draining"

    async def health():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return await client.get("/health")
    assert asyncio.run(health()).status_code == 503


def _sluice(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_missing_model_is_a_clear_error(tmp_path):
    result = _sluice("worker", "--model", str(tmp_path / "nope"), "--port", "1", timeout=60)
    assert result.returncode == 1
    assert "is not a model folder" in result.stderr and "Traceback" not in result.stderr
    result = _sluice("worker", "--model", "NoSuchModel", "--port", "1", timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "'NoSuchModel' is neither a model folder nor a model the store knows " \
        "(SmolLM2-135M-Instruct," in result.stderr


def test_model_that_fails_to_load_exits_1(tmp_path, model_path):
    """A folder that looks like a model but whose weights are garbage: the worker starts,
    never becomes ready, and exits 1."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, tmp_path / name)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    result = _sluice("worker", "--model", str(tmp_path), "--port", str(_free_port()),
                     timeout=180)
    assert result.returncode == 1
    assert "failed to load" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    result = _sluice("worker", "--device", "cuda", "--port", str(_free_port()), timeout=60)
    assert result.returncode == 1
    assert "--device cuda: torch sees no CUDA device" in result.stderr
    assert "Traceback" not in result.stderr


def test_options_that_do_not_fit_the_model_fail_in_one_line(model_path):
    result = _sluice("worker", "--model", str(model_path), "--kv-cache-gib", "0.0001",
                     "--port", str(_free_port()), timeout=180)
    assert result.returncode == 1
    assert "kv_cache_gib 0.0001 holds no KV block" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("bias,words", [
    ({"28": 100.5}, "in [-100, 100]"), ({"x": 1}, "token ids"), ({"-3": 1}, "token ids"),
    ({"28": "big"}, "number"), ({"49152": 1}, "out of the vocabulary"),
    ({str(i): 1 for i in range(2049)}, "at most 2048"), ([28], "dictionary")],
    ids=["value-over-100", "key-not-an-id", "key-negative", "value-a-string", "out-of-vocab",
         "too-many", "not-an-object"])
def test_bad_logit_bias_is_400_naming_it(worker_url, bias, words):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": bias}
    assert words in assert_error(post(worker_url, "/v1/completions", body), 400,
                                 "logit_bias")["message"]


def test_infinite_sampling_values_are_400(worker_url):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    r = post(worker_url, "/v1/completions", None, content=b'{"model": "%s", "prompt": "hi", '
             b'"logit_bias": {"28": NaN}}' % MODEL.encode(),
             headers={"content-type": "application/json"})
    assert_error(r, 400, "logit_bias")
    r = post(worker_url, "/v1/completions", None, content=b'{"model": "%s", "prompt": "hi", "temperature": Infinity}'
             % MODEL.encode(), headers={"content-type": "application/json"})
    assert_error(r, 400, "temperature")
    r = post(worker_url, "/v1/completions", None, content=b'{"model": "%s", "prompt": "hi", "top_p": NaN}'
             % MODEL.encode(), headers={"content-type": "application/json"})
    assert "finite number" in assert_error(r, 400, "top_p")["message"]
    assert post(worker_url, "/v1/completions", {**body, "logit_bias": {}}).status_code == 200


def test_a_refused_field_is_told_without_pydantic_wording(worker_url):
    r = post(worker_url, "/v1/chat/completions", {"model": MODEL, "messages": MSGS,
                                                  "tools": [{"type": "function"}]})
    assert assert_error(r, 400, "tools")["message"] == \
        "tools: function calling is not supported by this server"


def test_the_no_op_forms_of_refused_fields_are_accepted(worker_url):
    """What the refused fields' defaults look like (clients send them): served."""
    assert post(worker_url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                "best_of": 2, "n": 2}).status_code == 200
    assert post(worker_url, "/v1/chat/completions", {
        "model": MODEL, "messages": MSGS, "max_tokens": 1, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}}).status_code == 200
    noop = {"skip_special_tokens": True, "include_stop_str_in_output": False,
            "allowed_token_ids": None, "bad_words": [], "use_beam_search": False,
            "prompt_logprobs": None, "truncate_prompt_tokens": None, "guided_json": None,
            "structured_outputs": None}
    assert post(worker_url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                "suffix": None, **noop}).status_code == 200
    assert post(worker_url, "/v1/chat/completions", {
        "model": MODEL, "messages": MSGS, "max_tokens": 1, "echo": False,
        "modalities": ["text"], "audio": None, "prediction": None, **noop}).status_code == 200


def test_unknown_routes_and_methods_get_openai_errors(worker_url):
    r = httpx.get(f"{worker_url}/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"error": {"message": "Method Not Allowed", "type": "invalid_request_error",
                                  "param": None, "code": None}}
    r = httpx.post(f"{worker_url}/v1/embeddings", json={}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


@pytest.mark.parametrize("field,literal", [("presence_penalty", b"NaN"),
                                           ("frequency_penalty", b"1e400"),
                                           ("repetition_penalty", b"Infinity"),
                                           ("min_p", b"-Infinity"), ("top_p", b"1e-400")])
def test_non_finite_sampling_fields_are_400_naming_them(worker_url, field, literal):
    r = post(worker_url, "/v1/completions", None,
             content=b'{"model": "%s", "prompt": "hi", "%s": %s}'
             % (MODEL.encode(), field.encode(), literal),
             headers={"content-type": "application/json"})
    assert_error(r, 400, field)


def test_tiny_temperature_is_greedy_and_never_cuts_a_concurrent_stream(worker_url):
    """Issue 10: temperature 1e-300 made the sampler raise inside the engine step, and every
    request in flight on the worker failed with engine_error. Now it samples greedily (as
    temperature 0) and a stream running beside it completes."""
    stream_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40,
                   "ignore_eos": True, "stream": True, "temperature": 0}
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{worker_url}/v1/completions", json=stream_body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60), "the stream never started"
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6}
    tiny = post(worker_url, "/v1/completions", {**body, "temperature": 1e-300})
    thread.join(120)
    assert tiny.status_code == 200, tiny.text
    zero = post(worker_url, "/v1/completions", {**body, "temperature": 0})
    assert tiny.json()["choices"][0]["text"] == zero.json()["choices"][0]["text"]
    assert lines[-1] == "data: [DONE]" and not any("error" in line for line in lines)
    assert '"finish_reason":"length"' in lines[-2]
