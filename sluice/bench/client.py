"""One streamed request → one record; errors are recorded, never raised.

Timing (``time.perf_counter``, seconds):

    send ──────── first content chunk ── chunk ── … ── last chunk ── [DONE], stream closed
    |<──── ttft ────>|<─ gap ─>|                                                  |
    |<──────────────────────────────── e2e ──────────────────────────────────────>|

A *content chunk* is an SSE event whose first choice carries non-empty text (completions
``text``, chat ``delta.content``); the chat role chunk and the usage chunk are not content.

ITL attribution. A chunk may carry several tokens (speculative decoding, servers that
batch). Each chunk gets a token count: 1 each when the server's ``usage.completion_tokens``
equals the number of content chunks (one token per chunk, the common case); otherwise by
re-tokenizing the text so far (a chunk's count is how much the running maximum of
``count(text[:end of chunk])`` grows). A chunk that arrives ``g`` seconds after the previous
token-bearing chunk and carries ``k`` tokens adds ``k`` gaps of ``g/k``; tokens that arrive
in the first chunk add no gap (they are part of TTFT). So the gaps sum to
``t(last token chunk) - t(first chunk)``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import httpx

from sluice.bench.workload import RequestSpec, Tokenizer

logger = logging.getLogger(__name__)

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestRecord:
    """What one request did. Times are seconds: ``*_s`` offsets from the run start, the
    rest durations. Token counts: ``input_tokens``/``output_tokens`` by the bench's
    tokenizer, ``usage_*`` as the server reported them (None when it did not).

    ``error_code`` is the HTTP status as text for a non-200 answer (``"404"``), the httpx
    exception name for a transport failure (``"ConnectError"``, ``"ReadTimeout"``),
    ``"deadline"`` past ``--request-timeout``, ``"stream_error"`` for an error event inside
    a 200 stream, ``"incomplete_stream"`` when the stream ended without ``[DONE]``, and
    ``"bad_stream"`` for an event that is not JSON.
    """

    index: int
    max_tokens: int
    input_tokens: int
    group: int | None = None
    scheduled_s: float | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    ok: bool = False
    status: int | None = None
    error_code: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    usage_input_tokens: int | None = None
    usage_output_tokens: int | None = None
    num_chunks: int = 0
    chunk_offsets_s: list[float] = field(default_factory=list)  # from send, per content chunk
    itl_s: list[float] = field(default_factory=list)
    _texts: list[str] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("_texts")
        return data

    def fail(self, code: str, message: str) -> None:
        self.ok, self.error_code, self.error = False, code, message[:500]


def request_body(endpoint: str, model: str, spec: RequestSpec, ignore_eos: bool,
                 temperature: float | None, extra: dict | None) -> dict:
    """The JSON body for one streamed request."""
    body: dict = {"model": model, "max_tokens": spec.max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if temperature is not None:
        body["temperature"] = temperature
    return {**body, **(extra or {})}


async def send(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord,
               t0: float, deadline_s: float) -> RequestRecord:
    """Stream one request into ``record`` (raw: call :func:`finalize` after the run)."""
    start = time.perf_counter()
    record.start_s = start - t0
    try:
        async with asyncio.timeout(deadline_s):
            await _stream(client, url, body, record, start)
    except TimeoutError:
        record.fail("deadline", f"no complete answer within {deadline_s:g} s")
    except httpx.HTTPError as exc:
        record.fail(type(exc).__name__, str(exc) or type(exc).__name__)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        record.fail("bad_stream", f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    record.end_s, record.e2e_s = end - t0, end - start
    return record


async def _stream(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord,
                  start: float) -> None:
    chat = "messages" in body
    async with client.stream("POST", url, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            raw = await response.aread()
            record.fail(str(response.status_code), _error_message(raw))
            return
        done = False
        async for line in sse_lines(response):
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                record.fail("stream_error", _error_message(payload.encode()))
                return
            if event.get("usage"):
                record.usage_input_tokens = event["usage"].get("prompt_tokens")
                record.usage_output_tokens = event["usage"].get("completion_tokens")
            choices = event.get("choices") or []
            if choices:
                text = (choices[0].get("delta") or {}).get("content") if chat \
                    else choices[0].get("text")
                if text:
                    now = time.perf_counter()
                    record.chunk_offsets_s.append(now - start)
                    record._texts.append(text)
        if not done:
            record.fail("incomplete_stream", "the stream ended without [DONE]")
            return
        record.ok = True


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """An event stream's lines, split where the SSE spec ends a line (LF, CRLF) and nowhere
    else: httpx's ``aiter_lines`` also splits at U+2028, U+0085 and the like, which JSON may
    carry raw inside a string (a server that writes its JSON as UTF-8 does)."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


def _error_message(raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
        return f"{error.get('code') or error.get('type')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return raw.decode(errors="replace")[:500] or "(empty body)"


def chunk_tokens(texts: list[str], tokenizer: Tokenizer, usage_tokens: int | None) -> list[int]:
    """Tokens carried by each content chunk (see the module docstring)."""
    if usage_tokens is not None and usage_tokens == len(texts):
        return [1] * len(texts)
    counts, seen, text = [], 0, ""
    for piece in texts:
        text += piece
        total = tokenizer.count(text)
        counts.append(max(0, total - seen))
        seen = max(seen, total)
    return counts


def itl_gaps(offsets_s: list[float], tokens: list[int]) -> list[float]:
    """Per-token gaps from chunk arrival offsets and per-chunk token counts."""
    gaps: list[float] = []
    last = offsets_s[0] if offsets_s else 0.0
    for t, k in zip(offsets_s[1:], tokens[1:]):
        if k > 0:
            gaps.extend([(t - last) / k] * k)
            last = t
    return gaps


def finalize(record: RequestRecord, tokenizer: Tokenizer) -> RequestRecord:
    """Count output tokens, attribute ITL, set TTFT; drop the output text."""
    texts, record._texts = record._texts, []
    record.num_chunks = len(texts)
    record.output_tokens = tokenizer.count("".join(texts))
    if texts:
        record.ttft_s = record.chunk_offsets_s[0]
        record.itl_s = itl_gaps(record.chunk_offsets_s,
                                chunk_tokens(texts, tokenizer, record.usage_output_tokens))
    return record
