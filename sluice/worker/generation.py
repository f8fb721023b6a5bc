"""The request path of `sluice worker`, from a validated OpenAI request to the HTTP response.

Preparation: tokenize off the event loop and validate, giving one ``Choice`` (one engine
request) per prompt of a list and per ``n``. Generation: every choice runs as its own engine
request; their deltas are merged and shaped (sluice.worker.shaping) into SSE chunks or
one JSON response. A client that goes away aborts its engine requests: for streams the
response generator is closed; for plain responses a watcher on the ASGI ``receive`` channel
cancels the work.

A stream's first bytes go out with the engine's first output (headers included): a chat
stream's role chunk with its first token, as vLLM's server sends it. So a request that
fails before its first token (the engine refused it, or died: ``sluice.worker.health``)
is answered with an HTTP error a router can retry elsewhere, and a client's time to the
first event is its time to the first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sluice.api import openai as oa
from sluice.worker import shaping
from sluice.worker.health import EngineDead, EngineWatch
from sluice.worker.metrics import RequestTimer, WorkerMetrics
from sluice.worker.outputs import RequestOutput
from sluice.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What the worker needs from sluice.worker.engine.async_engine.AsyncEngine."""

    tokenizer: Any
    max_model_len: int
    model_name: str
    max_sequences_per_request: int  # prompts × n of one API request, at most (400 beyond)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str, group: str | None = None) -> AsyncIterator[RequestOutput]: ...
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def stats(self) -> Any: ...
    def shutdown(self) -> None: ...


# --------------------------------------------------------------------------- preparation


@dataclasses.dataclass
class Choice:
    """One engine request of a response and how to show it."""

    view: shaping.ChoiceView
    params: SamplingParams


def _sampling_params(req: oa.CompletionRequest | oa.ChatCompletionRequest, max_tokens: int,
                     number: int, logprobs: int | None, prompt_logprobs: int | None
                     ) -> SamplingParams:
    """Engine parameters for choice ``number`` (0..n-1) of a prompt.

    With a seed, choice j uses seed + j so the n samples differ but stay reproducible.
    """
    seed = req.seed if req.seed is None or number == 0 else (req.seed + number) % 2**63
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=seed,
        stop=req.stop_strings(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or 0,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        logit_bias=req.token_bias(),
    )


@functools.lru_cache(maxsize=8)
def _longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token string (a byte-level BPE token string
    has one character per byte, so no token covers more text characters than this)."""
    return max(map(len, tokenizer.get_vocab()))


def check_text_length(tokenizer: Any, text: str, max_model_len: int, param: str) -> None:
    """Reject, without tokenizing it, a text that cannot fit ``max_model_len`` tokens:
    it would need at least len(text) / longest-token-characters tokens. Tokenizing a
    10 MB prompt holds the GIL for seconds and stalls every request on the worker.

    Raises:
        APIError: 400 ``context_length_exceeded`` (``param``).
    """
    if len(text) > max_model_len * _longest_token_chars(tokenizer):
        raise oa.APIError(400, f"{len(text)} characters cannot fit the maximum context of "
                               f"{max_model_len} tokens", param=param,
                          code="context_length_exceeded")


def _tokenize_prompts(tokenizer: Any, prompt: Any, max_model_len: int
                      ) -> list[tuple[list[int], str | None]]:
    """A completions ``prompt`` as (token ids, text or None) per prompt.

    Raises:
        APIError: 400 (param ``prompt``) for an empty list or a text far over the context.
    """
    def encode(text: str) -> list[int]:
        check_text_length(tokenizer, text, max_model_len, "prompt")
        return tokenizer.encode(text)

    if isinstance(prompt, str):
        return [(encode(prompt), prompt)]
    if not prompt:
        raise oa.APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [(list(prompt), None)]
    if isinstance(prompt[0], str):
        return [(encode(p), p) for p in prompt]
    return [(list(p), None) for p in prompt]


def chat_prompt(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                max_model_len: int | None = None) -> tuple[list[int], str]:
    """Render ``messages`` with the tokenizer's chat template; return (token ids, text).

    Blocking (template rendering and tokenization): call it off the event loop.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: OpenAI messages already in template form (``oa.template_messages``).
        add_generation_prompt: end with the assistant turn's opening, as for generation.
        max_model_len: when given, a rendered text far over this context is refused
            before tokenizing (``check_text_length``).

    Raises:
        APIError: 400 (param ``messages``) when the template rejects the messages or the
            text cannot fit ``max_model_len``.
    """
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as exc:  # jinja raise_exception, missing template, ...
        raise oa.APIError(400, f"the chat template rejected the messages: {exc}",
                          param="messages") from None
    if max_model_len is not None:
        check_text_length(tokenizer, text, max_model_len, "messages")
    return tokenizer.encode(text, add_special_tokens=False), text


async def completion_choices(engine: Engine, req: oa.CompletionRequest) -> list[Choice]:
    """Tokenize and validate a completions request into one Choice per prompt and n.

    Tokenizes on a worker thread. Choice ``index`` is ``prompt_number * n + j``; only the
    first choice of each prompt counts the prompt's tokens in usage. With ``echo`` and
    ``max_tokens=0`` a choice still runs one engine step but shows no output.

    Raises:
        APIError: 400 for an empty or over-long prompt, bad token ids, bad max_tokens, or
            more prompts × n than the engine's ``max_sequences_per_request``.
    """
    _check_fan_out(engine, req.num_prompts(), req.n or 1)
    prompts = await asyncio.to_thread(_tokenize_prompts, engine.tokenizer, req.prompt,
                                      engine.max_model_len)
    requested, param = req.requested_max_tokens()
    vocab = len(engine.tokenizer)
    plans = []
    for ids, _ in prompts:
        oa.check_prompt(ids, vocab, engine.max_model_len, "prompt")
        plans.append(oa.max_tokens_for(requested, param, len(ids), engine.max_model_len,
                                       allow_zero=bool(req.echo)))
    n = req.n or 1
    choices = []
    for p, ((ids, text), max_tokens) in enumerate(zip(prompts, plans)):
        if req.echo and text is None:
            text = engine.tokenizer.decode(ids)
        for j in range(n):
            view = shaping.ChoiceView(index=p * n + j, prompt_ids=ids, prompt_text=text or "",
                                 count_prompt=j == 0, echo=bool(req.echo),
                                 show_output=max_tokens > 0)
            params = _sampling_params(req, max(max_tokens, 1), j, req.logprobs,
                                      req.logprobs if req.echo else None)
            choices.append(Choice(view, params))
    return choices


async def chat_choices(engine: Engine, req: oa.ChatCompletionRequest) -> list[Choice]:
    """Render, tokenize and validate a chat request into ``n`` Choices (indices 0..n-1).

    Renders and tokenizes on a worker thread.

    Raises:
        APIError: 400 for bad messages, an over-long prompt, bad max_tokens, top_logprobs
            without logprobs, or n over the engine's ``max_sequences_per_request``.
    """
    _check_fan_out(engine, 1, req.n or 1)
    if req.top_logprobs is not None and not req.logprobs:
        raise oa.APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    messages = req.template_messages()
    ids, _ = await asyncio.to_thread(chat_prompt, engine.tokenizer, messages, True,
                                     engine.max_model_len)
    oa.check_prompt(ids, len(engine.tokenizer), engine.max_model_len, "messages")
    requested, param = req.requested_max_tokens()
    max_tokens = oa.max_tokens_for(requested, param, len(ids), engine.max_model_len)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return [Choice(shaping.ChoiceView(index=j, prompt_ids=ids, count_prompt=j == 0),
                   _sampling_params(req, max_tokens, j, logprobs, None))
            for j in range(req.n or 1)]


def _check_fan_out(engine: Engine, num_prompts: int, n: int) -> None:
    """Raise APIError (400 ``too_many_sequences``) beyond the engine's fan-out cap."""
    limit = getattr(engine, "max_sequences_per_request", None)
    if limit is not None:
        oa.check_fan_out(num_prompts, n, limit)


def _engine_check(engine: Engine, choices: list[Choice]) -> None:
    """Let the engine veto requests it could never run (e.g. more KV than its whole pool,
    or sampling values its own validation refuses).

    Raises:
        APIError: 400 with the engine's reason, naming the field it names (its
            ``InvalidSamplingParams.param``), else ``max_tokens``.
    """
    for choice in choices:
        try:
            engine.check_request(choice.view.prompt_ids, choice.params)
        except ValueError as exc:
            param = getattr(exc, "param", None) or "max_tokens"
            raise oa.APIError(400, str(exc), param=param) from None


# --------------------------------------------------------------------------- generation


async def _pump(engine: Engine, choice: Choice, request_id: str, group: str,
                timer: RequestTimer, watch: EngineWatch, queue: asyncio.Queue) -> None:
    """Feed one engine request's deltas into ``queue`` as (index, output), then (index, None).

    ``group`` is the API request's id, shared by its choices (the engine shares its batch
    fairly between groups).

    An engine error is put on the queue as the exception. Cancelling the task leaves the
    engine's generator, which aborts the request and frees its KV blocks.
    """
    index = choice.view.index
    watch.started()
    try:
        stream = engine.generate(choice.view.prompt_ids, choice.params, request_id,
                                 group=group)
        async with aclosing(stream) as outputs:
            async for out in outputs:
                watch.progressed()
                timer.observe(out)
                queue.put_nowait((index, out))
        queue.put_nowait((index, None))
    except Exception as exc:  # noqa: BLE001 - handed to the consumer
        queue.put_nowait(exc)
    finally:
        watch.ended()
        timer.close()


async def _outputs(metrics: WorkerMetrics, watch: EngineWatch, engine: Engine,
                   choices: list[Choice], response_id: str, arrival: float
                   ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run every choice as its own engine request; yield (choice index, delta) as they come.

    Raises:
        EngineDead: the engine's loop died (``watch`` found it).
        Exception: the first engine error (the other requests are aborted).
    """
    queue: asyncio.Queue = asyncio.Queue()
    watch.subscribe(queue)
    timers = [metrics.track(arrival, len(c.view.prompt_ids)) for c in choices]
    tasks = [asyncio.create_task(_pump(engine, c, f"{response_id}-{c.view.index}", response_id,
                                       timer, watch, queue))
             for c, timer in zip(choices, timers)]
    try:
        pending = len(tasks)
        while pending:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            index, out = item
            if out is None:
                pending -= 1
            else:
                yield index, out
    finally:
        watch.unsubscribe(queue)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for timer in timers:  # a task cancelled before it ran never closed its own
            timer.close()


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], shaper: shaping.Shaper
                   ) -> tuple[dict, float | None]:
    """The whole response body, and ``time.monotonic()`` of the first output (None when
    there was none)."""
    first_at = None
    async with aclosing(outputs) as stream:
        async for index, out in stream:
            if first_at is None:
                first_at = time.monotonic()
            shaper.on_output(index, out)
    return shaper.response(), first_at


async def _sse(first: tuple[int, RequestOutput] | None,
               outputs: AsyncIterator[tuple[int, RequestOutput]], shaper: shaping.Shaper,
               include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: chunks, the usage chunk if asked, then [DONE].

    ``first`` is the first output, taken from ``outputs`` before the response started
    (None: there was none). The shaper's first chunks (chat: the role of every choice) go
    out in one write with the first output's chunk, as vLLM sends them: at the first token.
    An engine error becomes an SSE error event followed by [DONE].
    """
    async with aclosing(outputs) as stream:
        try:
            if first is not None:
                chunk = shaper.on_output(*first)
                head = [*shaper.first_chunks(), *([chunk] if chunk is not None else [])]
                if head:
                    yield b"".join(map(oa.sse, head))
            async for index, out in stream:
                chunk = shaper.on_output(index, out)
                if chunk is not None:
                    yield oa.sse(chunk)
            if include_usage:
                yield oa.sse(shaper.usage_chunk())
        except Exception as exc:  # noqa: BLE001 - reported in-band: headers are sent
            logger.exception("generation failed inside stream %s", shaper.response_id)
            yield oa.sse(oa.error_body(f"generation failed: {exc}", "server_error",
                                       code=_error_code(exc)))
    yield oa.SSE_DONE


def _error_code(exc: Exception) -> str:
    return "engine_dead" if isinstance(exc, EngineDead) else "engine_error"


def _generation_failed(exc: Exception, response_id: str) -> oa.APIError:
    """The HTTP error for a generation that failed before any byte was sent: 503 when the
    engine died (another worker can serve it), else 500."""
    if isinstance(exc, EngineDead):
        logger.error("the engine died under %s", response_id)
        return oa.APIError(503, f"generation failed: {exc}", code="engine_dead",
                           type="service_unavailable_error")
    logger.error("generation failed for %s", response_id, exc_info=exc)
    return oa.APIError(500, f"generation failed: {exc}", code="engine_error",
                       type="server_error")


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator when the response ends.

    Starlette cancels the send loop when the client disconnects but leaves the generator
    suspended; closing it here aborts the engine requests at once instead of at GC.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class ClientGone(Exception):
    """The client disconnected before the response was ready (its work was cancelled)."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work`` (a coroutine), cancelling it if the client disconnects first.

    Raises:
        ClientGone: the client went away (the work was cancelled).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def generate_response(request: Request, metrics: WorkerMetrics, engine: Engine,
                            choices: list[Choice], shaper: shaping.Shaper, arrival: float,
                            stream: bool, include_usage: bool,
                            watch: EngineWatch | None = None) -> Response:
    """Run validated choices and answer as SSE or as one JSON response.

    Every response carries the ``x-sluice-*`` load headers; a plain one also
    ``x-sluice-ttft-ms``, its first output's time since ``arrival`` (the router cannot see
    it in a body that comes whole). A stream starts (headers and
    first bytes) with the engine's first output; it reports a later engine error in-band (an
    SSE error event, then [DONE]). An engine error before that is an HTTP error: 503
    ``engine_dead`` when the engine died, else 500 ``engine_error``. A client that leaves
    aborts every choice's engine request; the response is then a 499 nobody reads.

    Args:
        request: the HTTP request, watched for a client disconnect.
        metrics: fed each choice's tokens and latencies.
        engine: the loaded engine.
        choices: from ``completion_choices`` or ``chat_choices``.
        shaper: turns engine deltas into the OpenAI chunks or body.
        arrival: when the request arrived, in seconds of ``time.monotonic()``; the start of
            TTFT and E2E.
        stream: answer as Server-Sent Events.
        include_usage: (streams) add the usage chunk before [DONE].
        watch: told of each engine request and output, and tells of a dead engine (a
            watch of its own when None).

    Raises:
        APIError: 400 when the engine could never run a choice (e.g. more KV-cache than its
            whole pool); 503 ``engine_dead`` or 500 ``engine_error`` when generation fails
            before a plain response or before a stream's first output.
    """
    _engine_check(engine, choices)
    outputs = _outputs(metrics, watch or EngineWatch(), engine, choices, shaper.response_id,
                       arrival)
    work = _first(outputs) if stream else _collect(outputs, shaper)
    try:
        result = await _unless_disconnected(request, work)
    except ClientGone:
        logger.info("client left; aborted %s", shaper.response_id)
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001 - an engine failure, not the client's fault
        raise _generation_failed(exc, shaper.response_id) from None
    headers = _load_headers(engine, metrics)  # fresh: at the first output (or the end)
    if stream:
        return _ClosingStreamingResponse(_sse(result, outputs, shaper, include_usage),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
    body, first_at = result
    if first_at is not None:
        headers["x-sluice-ttft-ms"] = f"{(first_at - arrival) * 1000:.1f}"
    return JSONResponse(body, headers=headers)


async def _first(outputs: AsyncIterator[tuple[int, RequestOutput]]
                 ) -> tuple[int, RequestOutput] | None:
    """The first output of ``outputs`` (None when it ends without one); closes it on error
    or cancellation."""
    try:
        return await anext(outputs, None)
    except BaseException:
        await outputs.aclose()
        raise


def _load_headers(engine: Engine, metrics: WorkerMetrics) -> dict[str, str]:
    """Cheap load report for the router on every generation response (names in
    sluice.router.endpoints)."""
    s = engine.stats()
    return {"x-sluice-num-running": str(s.num_running),
            "x-sluice-num-waiting": str(s.num_waiting),
            "x-sluice-kv-cache-usage": f"{s.kv_cache_usage:.4f}",
            "x-sluice-queued-prefill-tokens": str(max(0, metrics.queued_prefill_tokens))}


__all__ = ["Choice", "ClientGone", "Engine", "chat_choices", "chat_prompt", "completion_choices",
           "generate_response"]
