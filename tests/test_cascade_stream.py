"""The router cascade's stream handling on bytes as a worker sends them: events split
across chunks, held up to K tokens, replayed with or without logprobs."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.responses import Response
from starlette.requests import Request

from sluice.api.service import CascadeSpec
from sluice.cascade.policy import CascadePolicy
from sluice.router.cascade import (Cascade, _hold, _replay, _stream_logprobs, _stream_texts,
                                   prompt_text, serve)
from sluice.router.metrics import RouterMetrics
from sluice.router.relay import RelayResponse


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def completion_chunk(text: str, lp: float, index: int = 0) -> bytes:
    return event({"choices": [{"index": index, "text": text, "finish_reason": None,
                               "logprobs": {"tokens": [text], "token_logprobs": [lp],
                                            "top_logprobs": None, "text_offset": [0]}}]})


async def chunks_of(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def run(coro):
    return asyncio.run(coro)


STREAM = b"".join(completion_chunk(t, lp) for t, lp in
                  [("a", -0.1), ("b", -0.2), ("c", -3.0), ("d", -0.4)]) + b"data: [DONE]\n\n"


def test_hold_reads_whole_events_up_to_the_limit_across_chunk_boundaries():
    async def hold_then_replay():
        source = chunks_of(STREAM, 7)  # events split mid-line
        events, partial, done = await _hold(source, chat=False, limit=2)
        stripped = b"".join(await _collect(_replay(events, partial, source, strip=True)))
        return events, done, stripped

    events, done, stripped = run(hold_then_replay())
    assert not done
    assert _stream_logprobs(events, False) == [[-0.1, -0.2]]
    parsed = [json.loads(e[6:]) for e in stripped.split(b"\n\n") if e.startswith(b"data: {")]
    assert [p["choices"][0]["text"] for p in parsed] == ["a", "b", "c", "d"]  # none lost
    assert all(p["choices"][0]["logprobs"] is None for p in parsed)  # nor left half-stripped
    assert stripped.endswith(b"data: [DONE]\n\n")

    async def verbatim():
        source = chunks_of(STREAM, 7)
        events, partial, _ = await _hold(source, chat=False, limit=3)
        return b"".join(await _collect(_replay(events, partial, source, strip=False)))

    assert run(verbatim()) == STREAM  # byte for byte


def test_hold_without_a_limit_reads_to_the_end_and_replay_strips_logprobs():
    events, partial, done = run(_hold(chunks_of(STREAM, 50), chat=False, limit=None))
    assert done and not partial
    assert _stream_logprobs(events, False) == [[-0.1, -0.2, -3.0, -0.4]]
    out = b"".join(run(_collect(_replay(events, partial, None, strip=True))))
    parsed = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert [p["choices"][0]["text"] for p in parsed] == ["a", "b", "c", "d"]
    assert all(p["choices"][0]["logprobs"] is None for p in parsed)
    assert out.endswith(b"data: [DONE]\n\n")


def test_chat_logprobs_per_choice():
    stream = b"".join(event({"choices": [{"index": i, "delta": {"content": "x"},
                                          "logprobs": {"content": [{"token": "x",
                                                                    "logprob": lp}]}}]})
                      for i, lp in [(0, -0.5), (1, -1.5), (0, -0.25)])
    events, _, _ = run(_hold(chunks_of(stream, 1000), chat=True, limit=None))
    assert _stream_logprobs(events, True) == [[-0.5, -0.25], [-1.5]]
    assert _stream_texts(events, True) == ["xx", "x"]  # what the checks read, per choice
    role = event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert _stream_texts([role] + events + [event({"choices": [], "usage": {}})], True) \
        == ["xx", "x"]
    assert _stream_texts(run(_hold(chunks_of(STREAM, 9), chat=False, limit=None))[0],
                         False) == ["abcd"]


def test_prompt_text():
    assert prompt_text({"prompt": "hi"}) == "hi"
    assert prompt_text({"prompt": ["a", "b"]}) == "a\nb"
    assert prompt_text({"prompt": [1, 2, 3]}) == ""
    assert prompt_text({"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text",
                                                                   "text": "2+2?"}]}]}) \
        == "be brief\n2+2?"


async def _collect(agen):
    return [chunk async for chunk in agen]


@pytest.mark.parametrize("code, escalates", [("context_length_exceeded", True),
                                              ("invalid_value", False)])
def test_a_prompt_past_a_tiers_context_goes_to_the_next_tier(code, escalates):
    """The first tier's context is smaller than the prompt (SmolLM2's 5,824 tokens under
    Qwen's 8,192 in examples/cascade.yaml): its 400 context_length_exceeded sends the
    request up, counted as ``context-length``; any other 400 is the client's and returned."""
    spec = CascadeSpec(tiers=["small", "big"], escalation={"threshold": -100.0})
    cascade = Cascade("coder", CascadePolicy.from_spec(spec, ["small-model", "big-model"]))
    metrics = RouterMetrics()
    asked = []
    refusal = json.dumps({"error": {"message": "too long", "type": "invalid_request_error",
                                    "param": "messages", "code": code}}).encode()

    async def send(body: dict, final: bool):
        asked.append((body["model"], final))
        if body["model"] == "small-model":
            return Response(refusal, 400, {"content-type": "application/json"})
        return Response(b'{"choices": []}', 200, {})

    async def receive():
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    body = {"model": "coder", "messages": [{"role": "user", "content": "hi " * 6000}]}
    response = run(serve(request, cascade, body, send, metrics))
    reasons = {s.labels["reason"]: s.value for s in metrics.cascade_escalations.collect()[0].samples
               if s.name.endswith("_total")}
    if escalates:
        assert asked == [("small-model", False), ("big-model", True)]
        assert response.status_code == 200 and response.headers["x-sluice-tier"] == "big"
        assert reasons == {"context-length": 1.0}
    else:
        assert asked == [("small-model", False)]
        assert response.status_code == 400 and response.headers["x-sluice-tier"] == "small"
        assert reasons == {}


def test_a_first_tier_whose_stream_breaks_escalates_as_a_tier_error():
    """The worker died mid-answer: the router's relay ends the stream with an error event.
    That partial answer is not judged (no score, no low-score escalation): the next tier
    answers, counted as a tier error (found by killing a worker under `sluice cascade
    check`: the cut answer was scored and counted as low-score)."""
    spec = CascadeSpec(tiers=["small", "big"], escalation={"threshold": -100.0})
    cascade = Cascade("coder", CascadePolicy.from_spec(spec, ["small-model", "big-model"]))
    metrics = RouterMetrics()
    broken = (completion_chunk("a", -0.1) + completion_chunk("b", -0.2)
              + event({"error": {"message": "the worker stream broke: ServerDisconnectedError",
                                 "type": "server_error", "param": None,
                                 "code": "upstream_error"}}) + b"data: [DONE]\n\n")
    asked = []

    async def send(body: dict, final: bool):
        asked.append((body["model"], final))
        if body["model"] == "small-model":
            return RelayResponse(chunks_of(broken, 16), 200, {})
        return Response(b'{"choices": []}', 200, {})

    async def receive():
        await asyncio.sleep(60)  # the client stays
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    body = {"model": "coder", "prompt": "hi", "stream": True, "max_tokens": 8}
    response = run(serve(request, cascade, body, send, metrics))
    assert asked == [("small-model", False), ("big-model", True)]
    assert response.headers["x-sluice-tier"] == "big"
    assert response.headers["x-sluice-escalated"] == "true"
    assert "x-sluice-score" not in response.headers
    reasons = {s.labels["reason"]: s.value for s in metrics.cascade_escalations.collect()[0].samples
               if s.name.endswith("_total")}
    assert reasons == {"tier-error": 1.0}
