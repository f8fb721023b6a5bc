"""Cascade routing in the router: a small tier answers first; a doubtful answer goes up.

A request for a cascade's name (``spec.model.name`` of an InferenceService with
``spec.cascade``) is served by its tiers, each through the router's usual path (admission,
SLO-aware choice of a worker, retries), with ``model`` set to the tier's served name:

    x-sluice-cascade header / pre-route ──▶ a tier that answers as asked (relayed as is)
    otherwise the first tier, judged:
        logprobs requested internally (whatever the client asked) → the answer's score
        (``sluice.cascade.policy``; ``checks``: -inf when ``sluice.cascade.checks`` proves
        it wrong, its code run on the prompt's examples in a sandbox) → below the threshold:
        the next tier; else it answers

A judged tier's answer reaches the client only once judged:

- a plain request: the whole answer (its logprobs removed unless the client asked);
- a stream, ``buffer`` mode: the whole stream is held, then replayed or dropped;
- a stream, ``prefix`` mode: the first ``prefixTokens`` tokens are held and judged, then the
  stream goes on from the same answer; no later escalation (headers are sent).

An escalated answer's stream is closed, so its worker aborts it and frees its KV cache; its
tokens are counted as wasted. A tier that fails (429, 5xx) also sends the request up
(``tier-error``), and so does a prompt longer than a tier's context (its 400
``context_length_exceeded``: a larger tier may take it; ``context-length``); another 4xx is
the client's and is returned. The client leaving aborts whichever
tier is running.

Responses carry ``x-sluice-tier`` (the InferenceService that answered), ``x-sluice-escalated``
(``true``/``false``) and, when a tier was judged, ``x-sluice-score`` (its score). ``model`` in
the body is the answering tier's served model name, as its worker wrote it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from sluice.cascade.checks import refutation
from sluice.cascade.policy import BadCascadeHeader, CascadePolicy, Scores
from sluice.cascade.tiers import Resolved, manifest_cascades as resolve_manifest
from sluice.router.metrics import RouterMetrics
from sluice.router.proxy import CLIENT_CLOSED, openai_error
from sluice.router.relay import ClientDisconnected, RelayResponse, unless_disconnected

logger = logging.getLogger(__name__)

HEADER = "x-sluice-cascade"
CHECK_THREADS = 4  # answers checked at once (each a sandboxed process at most)
_CHECKS = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="cascade-check")
RETRYABLE = (429, 500, 502, 503, 504)  # a tier that could not answer: the next one tries

Send = Callable[[dict[str, Any], bool], Awaitable[Response]]


@dataclass(frozen=True)
class Cascade:
    """One served cascade.

    Attributes:
        name: the served name clients send.
        policy: its decisions (tiers, served names, threshold, pre-route).
        mode: ``buffer`` or ``prefix`` (streams).
        prefix_tokens: ``prefix``: tokens judged before streaming on.
        costs: each tier's relative cost per token (``spec.cascade.costs``), which prices
            the wasted tokens.
    """

    name: str
    policy: CascadePolicy
    mode: str = "buffer"
    prefix_tokens: int = 16
    costs: tuple[float, ...] = ()

    @classmethod
    def from_resolved(cls, resolved: Resolved) -> Cascade:
        spec = resolved.spec
        return cls(resolved.name, CascadePolicy.from_spec(spec, resolved.models),
                   spec.streaming.mode, spec.streaming.prefix_tokens, tuple(spec.tier_costs()))


def cascades_of(resolved: Mapping[str, Resolved]) -> dict[str, Cascade]:
    """``resolve_cascades``' served cascades as the router's ``Cascade``s."""
    return {name: Cascade.from_resolved(r) for name, r in resolved.items()}


def manifest_cascades(path: str) -> dict[str, Cascade]:
    """The cascades of an InferenceService manifest file (``sluice.cascade.tiers.
    manifest_cascades``) as the router's ``Cascade``s.

    Raises:
        ValueError: as ``sluice.cascade.tiers.manifest_cascades``.
    """
    return cascades_of(resolve_manifest(path))


def prompt_text(body: Mapping[str, Any]) -> str:
    """The prompt's text for pre-routing: a completions prompt (texts joined; token ids
    give none) or the chat messages' text contents joined."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    parts: list[str] = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p.get("text") for p in content
                      if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(parts)


async def serve(request: Request, cascade: Cascade, body: dict[str, Any], send: Send,
                metrics: RouterMetrics) -> Response:
    """Answer ``body`` (its ``model`` is ``cascade.name``) from the cascade's tiers.

    Args:
        request: the client's request (headers; its disconnect aborts the running tier).
        body: the parsed request body.
        send: ``send(body, final)`` sends a body to its ``model``'s workers through the
            router's usual path and returns the response (a ``RelayResponse`` for a stream);
            ``final``: what it answers goes to the client as is (not judged).
        metrics: the router's metrics (the cascade's counters).
    """
    policy = cascade.policy
    try:
        start = policy.start(prompt_text(body), request.headers.get(HEADER))
    except BadCascadeHeader as exc:
        return openai_error(400, str(exc), "invalid_request_error", HEADER)
    chat = "messages" in body
    tier, score = start.tier, None
    while True:
        if not start.escalate or tier == policy.top:
            response = await send({**body, "model": policy.models[tier]}, True)
            return _tagged(metrics, cascade, response, tier, start, score)
        judged = await _judge(request, cascade, body, tier, chat, send)
        if not isinstance(judged, Held):  # the tier's own error, or the client left
            reason = "tier-error" if judged.status_code in RETRYABLE else \
                "context-length" if _context_too_long(judged) else None
            if reason is not None:
                metrics.cascade_escalations.labels(cascade.name, policy.tiers[tier],
                                                   reason).inc()
                tier += 1
                continue
            return _tagged(metrics, cascade, judged, tier, start, score)
        score = judged.scores.signal(policy.signal)
        if math.isfinite(score):  # -inf: proven wrong (checks), no score to show
            metrics.cascade_score.labels(cascade.name, policy.tiers[tier]).observe(score)
        if not policy.escalates(tier, judged.scores):
            return _tagged(metrics, cascade, judged.respond(), tier, start, score)
        await judged.discard()
        reason = judged.scores.refuted or "low-score"
        metrics.cascade_escalations.labels(cascade.name, policy.tiers[tier], reason).inc()
        metrics.cascade_wasted_tokens.labels(cascade.name, policy.tiers[tier]).inc(judged.tokens)
        metrics.cascade_wasted_cost.labels(cascade.name, policy.tiers[tier]).inc(
            judged.tokens * cascade.costs[tier])
        tier += 1


def _context_too_long(response: Response) -> bool:
    """A tier's 400 says the prompt (or prompt + max_tokens) is past its context."""
    if response.status_code != 400 or isinstance(response, RelayResponse):
        return False
    try:
        error = json.loads(response.body).get("error") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "context_length_exceeded"


@dataclass
class Held:
    """A judged tier's answer, not sent yet.

    Attributes:
        scores: the worst choice's scores.
        tokens: tokens generated so far (wasted if it escalates).
        plain: a plain answer's response, ready to send; None for a stream.
        events: a stream's held SSE events.
        partial: the start of the next event, when the stream was held mid-event.
        rest: the tier's response of a stream still open, its source read up to ``events``
            (None: it ended, or a plain answer).
        strip: remove logprobs from what is sent (the client did not ask for them).
        headers: the tier's response headers.
    """

    scores: Scores
    tokens: int
    plain: Response | None = None
    events: list[bytes] = field(default_factory=list)
    partial: bytes = b""
    rest: RelayResponse | None = None
    strip: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    def respond(self) -> Response:
        """The client's response: the plain answer, or the held events then the rest."""
        if self.plain is not None:
            return self.plain
        rest = self.rest
        return RelayResponse(_replay(self.events, self.partial,
                                     rest.chunks if rest is not None else None, self.strip),
                             200, self.headers,
                             on_close=rest.on_close if rest is not None else None)

    async def discard(self) -> None:
        """Not sent: close a stream still open (its worker aborts the request)."""
        if self.rest is not None:
            await self.rest.aclose()


async def _judge(request: Request, cascade: Cascade, body: dict[str, Any], tier: int,
                 chat: bool, send: Send) -> Held | Response:
    """Ask tier ``tier`` with logprobs on and score its answer (a stream: its first
    ``prefix_tokens`` tokens in ``prefix`` mode, all of it in ``buffer`` mode).

    With the ``checks`` signal each choice is then checked (``checks.refutation`` in a
    thread: its code run on the prompt's examples takes at most 10 s, not watched for the
    client leaving).

    Returns:
        the held answer, or the tier's response when it did not answer 200 (or 499 when
        the client left while a stream was held, 502 when a stream held to its end carries
        an error event: the worker failed mid-answer, so its partial answer is not judged).
    """
    strip = not _asked_logprobs(body, chat)
    internal = {**body, "model": cascade.policy.models[tier]}
    if chat:
        internal["logprobs"] = True
    elif strip:
        internal["logprobs"] = 0  # the sampled token's logprob only
    response = await send(internal, False)
    if response.status_code != 200:
        return response
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
    if not isinstance(response, RelayResponse):  # a plain answer: all of it is here
        answer = json.loads(response.body)
        choices = answer.get("choices") or ()
        per_choice = [_choice_logprobs(c, chat) for c in choices]
        texts = [_choice_text(c, chat) for c in choices]
        if strip:
            for choice in choices:
                choice["logprobs"] = None
        return Held(await _worst(cascade.policy, body, per_choice, texts),
                    sum(map(len, per_choice)),
                    plain=Response(json.dumps(answer).encode(), 200, headers))
    limit = cascade.prefix_tokens if cascade.mode == "prefix" else None
    try:
        events, partial, done = await unless_disconnected(
            request, _hold(response.chunks, chat, limit))
    except ClientDisconnected:
        await response.aclose()
        return Response(status_code=CLIENT_CLOSED)
    if done:
        await response.aclose()
        # the relay's (or the worker's) error event ends a stream, just before [DONE]
        if any("error" in (_data(e) or {}) for e in events[-2:]):  # broke mid-answer:
            return Response(status_code=502)  # a tier error, not an answer to judge
    per_choice = _stream_logprobs(events, chat)
    scores = await _worst(cascade.policy, body, per_choice, _stream_texts(events, chat))
    return Held(scores, sum(map(len, per_choice)), events=events, partial=partial,
                rest=None if done else response, strip=strip, headers=headers)


def _asked_logprobs(body: Mapping[str, Any], chat: bool) -> bool:
    if chat:
        return body.get("logprobs") is True
    return isinstance(body.get("logprobs"), int) and not isinstance(body.get("logprobs"), bool)


async def _worst(policy: CascadePolicy, body: Mapping[str, Any], per_choice: list[list[float]],
                 texts: list[str]) -> Scores:
    """The lowest-scoring choice's scores (n > 1: every answer must hold); ``texts``: the
    choices' answers, checked (``checks.refutation``) for the ``checks`` signal."""
    scored = [policy.score(lps) for lps in per_choice] or [policy.score([])]
    if policy.signal == "checks":
        prompt = prompt_text(body)
        scored = [replace(s, refuted=await _refutation(prompt, text))
                  for s, text in zip(scored, texts)] or scored
    return min(scored, key=lambda s: s.signal(policy.signal))


async def _refutation(prompt: str, answer: str) -> str | None:
    """``checks.refutation`` on the checks' own threads (``CHECK_THREADS``: a flood of
    answers to check, each up to its 10 s sandbox timeout, queues there, not in the event
    loop's default executor); a check that fails to run proves nothing (logged)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(_CHECKS, refutation, prompt,
                                                                answer)
    except Exception:  # noqa: BLE001 - the answer stands on its score
        logger.exception("cascade check failed; the answer is judged on its score")
        return None


def _choice_text(choice: Mapping[str, Any], chat: bool) -> str:
    """One choice's answer text (or one chunk's piece of it)."""
    if chat:
        part = choice.get("message") or choice.get("delta") or {}
        text = part.get("content") if isinstance(part, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else ""


def _stream_texts(events: list[bytes], chat: bool) -> list[str]:
    per_index: dict[int, list[str]] = {}
    for event in events:
        for choice in (_data(event) or {}).get("choices") or ():
            per_index.setdefault(choice.get("index", 0), []).append(_choice_text(choice, chat))
    return ["".join(per_index[i]) for i in sorted(per_index)]


def _choice_logprobs(choice: Mapping[str, Any], chat: bool) -> list[float]:
    """The generated tokens' logprobs of one choice (or one chunk of it)."""
    logprobs = choice.get("logprobs") or {}
    if chat:
        return [e["logprob"] for e in logprobs.get("content") or ()
                if isinstance(e, dict) and isinstance(e.get("logprob"), int | float)]
    return [lp for lp in logprobs.get("token_logprobs") or () if isinstance(lp, int | float)]


async def _hold(chunks: AsyncIterator[bytes], chat: bool,
                limit: int | None) -> tuple[list[bytes], bytes, bool]:
    """Read SSE events until every choice seen has ``limit`` tokens (None: the end).

    Returns:
        (the whole events, each with its blank-line terminator; the start of the next
        event, if a chunk ended inside it; whether the stream ended).
    """
    events: list[bytes] = []
    buffer = b""
    counts: dict[int, int] = {}
    async for chunk in chunks:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n\n")
        for event in complete:
            events.append(event + b"\n\n")
            for index, lps in _event_logprobs(event, chat):
                counts[index] = counts.get(index, 0) + len(lps)
        if limit is not None and counts and min(counts.values()) >= limit:
            return events, buffer, False
    return events, buffer, True


def _event_logprobs(event: bytes, chat: bool) -> list[tuple[int, list[float]]]:
    """(choice index, its tokens' logprobs) in one SSE event."""
    data = _data(event)
    if data is None:
        return []
    return [(c.get("index", 0), _choice_logprobs(c, chat)) for c in data.get("choices") or ()]


def _stream_logprobs(events: list[bytes], chat: bool) -> list[list[float]]:
    per_index: dict[int, list[float]] = {}
    for event in events:
        for index, lps in _event_logprobs(event, chat):
            per_index.setdefault(index, []).extend(lps)
    return [per_index[i] for i in sorted(per_index)]


def _data(event: bytes) -> dict[str, Any] | None:
    line = event.strip()
    if not line.startswith(b"data: {"):
        return None
    try:
        data = json.loads(line[len(b"data: "):])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


async def _replay(events: list[bytes], partial: bytes, rest: AsyncIterator[bytes] | None,
                  strip: bool) -> AsyncIterator[bytes]:
    """The held events, then the rest of the stream (``partial`` continues in it); logprobs
    removed with ``strip``."""
    try:
        for event in events:
            yield _strip(event) if strip else event
        if not strip:
            if partial:
                yield partial
            if rest is not None:
                async for chunk in rest:
                    yield chunk
            return
        buffer = partial
        async for chunk in rest if rest is not None else _nothing():
            buffer += chunk
            *complete, buffer = buffer.split(b"\n\n")
            out = b"".join(_strip(e + b"\n\n") for e in complete)
            if out:
                yield out
        if buffer:
            yield buffer
    finally:
        if rest is not None:
            await rest.aclose()  # type: ignore[attr-defined]


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


def _strip(event: bytes) -> bytes:
    data = _data(event)
    if data is None or not any(c.get("logprobs") is not None for c in data.get("choices") or ()):
        return event
    for choice in data["choices"]:
        choice["logprobs"] = None
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _tagged(metrics: RouterMetrics, cascade: Cascade, response: Response, tier: int,
            start: Any, score: float | None) -> Response:
    """Add the cascade's headers and count the request at the tier that answered."""
    name = cascade.policy.tiers[tier]
    response.headers["x-sluice-tier"] = name
    escalated = tier > start.tier
    response.headers["x-sluice-escalated"] = "true" if escalated else "false"
    if score is not None:
        response.headers["x-sluice-score"] = f"{score:.4f}"
    metrics.cascade_requests.labels(cascade.name, name, start.reason,
                                    "true" if escalated else "false").inc()
    return response
