"""Bookkeeping of one request sent to one worker endpoint: the lease, the metric hooks, the
latency observations, the tenant's token charge, and its ejection.

    sent ─▶ waiting() ........ first byte ─▶ answered() ─▶ on_chunk … ─▶ on_complete()
               │ the endpoint is ejected meanwhile (EndpointSet.eject)
               ▼
            eject(): cancels the proxy's wait; absorb_ejection() turns that into
            "try elsewhere" (the client has had nothing yet, so the request may be resent)
               │ or no first byte within the first-byte timeout (``sluice.router.deadlines``)
               ▼
            time_out(): cancels the proxy's wait likewise; ``timed_out`` says it was that

``on_complete`` (idempotent) runs from the proxy's ``finally``.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

from sluice.router.endpoints import HEADER_TTFT_MS, Endpoint, Lease, WorkerLoad
from sluice.router.policy import Prediction, RoutingRequest
from sluice.router.limits import Charge, usage_in

if TYPE_CHECKING:
    from sluice.router.app import RouterState


CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; only seen in metrics
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class Exchange:
    """One request at one endpoint.

    The first token is a stream's first chunk (a worker sends nothing before its first
    token; a chat stream's role events come with it, as vLLM sends them). A plain answer
    arrives whole: a Sluice worker reports its first output's time in ``x-sluice-ttft-ms``
    (from the worker's receipt), so the first token came that long after the request was
    sent (the network's share is left out). Without that header (another server): when its
    usage shows one token per choice, the first token was the last, so its arrival is an
    exact TTFT; otherwise the arrival only bounds the TTFT from above
    (``Dispatcher.ttft_at_most``), and the router records no TTFT for it.

    Args:
        state: the router's state (metrics, dispatcher).
        routing: the request's routing view.
        endpoint: where it is sent.
        start: its arrival at the router, on the dispatcher's clock (seconds).
        prediction: the policy's prediction for it there.
        charge: its tenant's charge (settled, with the usage, when it completes), if any.
    """

    def __init__(self, state: RouterState, routing: RoutingRequest, endpoint: Endpoint,
                 start: float, prediction: Prediction, charge: Charge | None = None):
        self.state, self.routing, self.model, self.start = state, routing, routing.model, start
        self.endpoint, self.prediction, self.charge = endpoint, prediction, charge
        self.clock = state.dispatcher.clock
        self.sent_at = self.clock()
        self.lease = Lease(endpoint, prediction.features.uncached_prompt_tokens, self.sent_at)
        self.status = 0
        self.ejected: str | None = None  # why its endpoint was ejected while it waited
        self.timed_out = False  # no first byte within the first-byte timeout
        self._task: asyncio.Task | None = None  # the proxy's task while it waits
        self._role_events = role_events(routing)
        self._events = 0
        self._usage: int | None = None
        self._first_token_at: float | None = None
        self._worker_ttft_s: float | None = None
        self._last_chunk: float | None = None
        self._gaps = 0
        self._metrics = state.metrics.of(self.model)
        state.metrics.in_flight_requests += 1
        state.dispatcher.dispatched(endpoint, routing)
        state.dispatcher.demand.started(self.model)

    # ------------------------------------------------------------------ ejection

    def waiting(self, task: asyncio.Task) -> None:
        """The request is on its way in ``task``: until ``answered``, an ejection of the
        endpoint, or the first-byte deadline, cancels it (see ``absorb_ejection``)."""
        self._task = task
        self.endpoint.unanswered.add(self)
        self.state.first_byte.add(self, self.time_out, self.sent_at)

    def answered(self) -> None:
        """Its first byte came (or it ended): an ejection no longer concerns it."""
        if self._task is not None:
            self._task = None
            self.endpoint.unanswered.discard(self)
            self.state.first_byte.remove(self)

    def eject(self, reason: str) -> None:
        if self._task is not None and self.ejected is None and not self.timed_out:
            self.ejected = reason
            self._task.cancel()

    def time_out(self) -> None:
        """The first-byte deadline passed (``RouterState.first_byte``)."""
        if self._task is not None and self.ejected is None and not self.timed_out:
            self.timed_out = True
            self._task.cancel()

    def absorb_ejection(self) -> bool:
        """After a CancelledError: True (and the cancellation is consumed) when it was the
        endpoint's ejection or the first-byte deadline (``timed_out``)."""
        if self.ejected is None and not self.timed_out:
            return False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True

    # ------------------------------------------------------------------ hooks

    def on_headers(self, status: int, headers: Any) -> None:
        self.status = status
        self._worker_ttft_s = _seconds(headers.get(HEADER_TTFT_MS))
        report = WorkerLoad.from_headers(headers, self.clock())
        if report is not None:
            self.endpoint.reported = report

    def on_body(self, body: bytes) -> None:
        """A plain (not streamed) answer arrived whole (see the class docstring)."""
        now = self.clock()
        if self.charge is not None:
            self._usage = usage_in(body)
        if self.status >= 400:
            return
        found = _COMPLETION_TOKENS.findall(body)
        if self._worker_ttft_s is not None:
            self._first_token(min(now, self.sent_at + self._worker_ttft_s))
        elif found and int(found[-1]) <= choices(self.routing):
            self._first_token(now)
        else:
            self.lease.first_token(now)  # (some time before now)
            self.state.dispatcher.ttft_at_most(self.endpoint, self.prediction,
                                               now - self.sent_at)

    def on_chunk(self, chunk: bytes) -> None:
        now = self.clock()
        if self.charge is not None:
            self._events += chunk.count(b"data: ")
            self._usage = usage_in(chunk) or self._usage
        if self._first_token_at is None:
            self._first_token(now)
        else:
            self._metrics.itl.observe(now - self._last_chunk)
            self._gaps += 1
        self._last_chunk = now

    def _first_token(self, now: float) -> None:
        self._first_token_at = now
        self._metrics.ttft.observe(now - self.start)
        self.state.dispatcher.demand.first_token(self.model, now - self.start,
                                                 self.routing.ttft_slo_s)
        self.lease.first_token(now)
        self.state.dispatcher.first_token(self.endpoint, self.prediction, now - self.sent_at,
                                          self.model)

    def on_complete(self, counted: bool = True) -> None:
        """Release the endpoint; count the request unless ``counted`` is False (it will be
        tried elsewhere)."""
        self.answered()
        now = self.clock()
        if not self.lease.release(now):
            return
        self.state.metrics.in_flight_requests -= 1
        gap = None
        if self._gaps and self._first_token_at is not None and self._last_chunk is not None:
            gap = (self._last_chunk - self._first_token_at) / self._gaps
        self.state.dispatcher.finished(self.endpoint, self.prediction, gap, self.model)
        self.state.dispatcher.demand.finished(self.model, gap if counted else None,
                                              self.routing.itl_slo_s)
        if counted and 400 <= self.status < 500 and self.status not in (429, CLIENT_CLOSED):
            self.state.dispatcher.demand.invalid(self.model)
        if counted:
            self._metrics.e2e.observe(now - self.start)
            self.state.metrics.count_request(self.model, self.status)
            if self.charge is not None:
                self.charge.settle(self.status, self._used_tokens(), now)

    def _used_tokens(self) -> float | None:
        """Tokens the worker used: its usage report; else, for a stream, the prompt estimate
        plus one token per event (role events and [DONE] aside); else None (the estimate
        stands), or 0 for an error answer."""
        if self._usage is not None:
            return float(self._usage)
        if self.status >= 400:
            return 0.0
        if self._events and self.routing.stream:
            tokens = max(0, self._events - self._role_events - 1)
            return self.charge.prompt_tokens + tokens if self.charge is not None else None
        return None


def _seconds(ms: str | None) -> float | None:
    """A header's milliseconds as seconds; None when absent or not a finite number ≥ 0."""
    try:
        value = float(ms) / 1000.0 if ms is not None else None
    except ValueError:
        return None
    return value if value is not None and 0.0 <= value < float("inf") else None


def choices(routing: RoutingRequest) -> int:
    """The choices the request asks for (its ``n``; 1 by default)."""
    n = routing.body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def role_events(routing: RoutingRequest) -> int:
    """SSE events of a chat stream that carry no token (the role chunks, one per choice,
    sent with the first token)."""
    if not routing.stream or "messages" not in routing.body:
        return 0
    return choices(routing)
