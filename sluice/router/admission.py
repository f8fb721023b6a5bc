"""Admission control: a bounded, priority + earliest-deadline-first queue per model.

A request may go to a worker at once when its model's queue is empty and the gate says yes
(some ready replica is predicted to meet its TTFT SLO, or has no prefill queued at all:
the router never holds work back from an idle replica). Otherwise it waits in its model's
queue, ordered by

    (priority, deadline, arrival order)     lower priority value first (vLLM's convention),
                                            deadline = arrival + TTFT SLO (EDF)

and the head is re-checked on every capacity event (a first token, a finished request, a
worker turning ready) and on a periodic tick. When the queue is full, the request is
rejected at once (the router answers 429 with ``Retry-After``) instead of letting every
queued request's latency grow. A request that waits longer than ``queue_timeout`` is
rejected the same way.

Every waiter is removed from its queue in a ``finally``; an empty queue is dropped, so the
number of queues is bounded by the number of models with waiting requests.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

R = TypeVar("R")


class Rejected(Exception):
    """The request is not admitted: answer 429.

    Attributes:
        retry_after_s: whole seconds the client should wait before retrying (≥ 1).
        reason: ``queue_full`` or ``queue_timeout``.
    """

    def __init__(self, reason: str, retry_after_s: int, message: str):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(order=True)
class _Waiter(Generic[R]):
    priority: int
    deadline: float
    seq: int
    request: R = field(compare=False)
    future: asyncio.Future = field(compare=False)


class _ModelQueue(Generic[R]):
    def __init__(self) -> None:
        self.heap: list[_Waiter[R]] = []

    def head(self) -> _Waiter[R] | None:
        while self.heap and self.heap[0].future.done():
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None

    def waiting(self) -> int:
        return len(self.heap)  # a waiter leaves the heap when released or given up


class AdmissionQueue(Generic[R]):
    """Per-model bounded queues in front of the routing policy.

    Args:
        max_queue: most requests waiting per model; 0 disables waiting (a request the gate
            refuses is rejected at once).
        queue_timeout: seconds a request may wait before it is rejected.
        retry_after: returns the ``Retry-After`` seconds for a rejection of a model's
            request (e.g. from predicted drain time); at least 1 is sent.
        on_change: called with (model, waiting count, rejected reason or None) after every
            change, for metrics.
        clock: the router's clock (seconds) that waits are measured on. (``queue_timeout``
            is enforced by the event loop's own timer.)
    """

    def __init__(self, max_queue: int = 256, queue_timeout: float = 60.0,
                 retry_after: Callable[[str], float] = lambda model: 1.0,
                 on_change: Callable[[str, int, str | None], None] = lambda *_: None,
                 clock: Callable[[], float] = time.monotonic):
        if max_queue < 0 or queue_timeout <= 0:
            raise ValueError("max_queue must be ≥ 0 and queue_timeout > 0")
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.retry_after = retry_after
        self.on_change = on_change
        self.clock = clock
        self._queues: dict[str, _ModelQueue[R]] = {}
        self._seq = itertools.count()

    def waiting(self, model: str) -> int:
        queue = self._queues.get(model)
        return queue.waiting() if queue else 0

    def models(self) -> list[str]:
        return list(self._queues)

    def admit_now(self, model: str, request: R, gate: Callable[[R], bool]) -> bool:
        """The fast path of ``admit``, without awaiting: True when nobody waits for
        ``model`` and ``gate`` lets ``request`` through."""
        queue = self._queues.get(model)
        return (queue is None or queue.head() is None) and gate(request)

    async def admit(self, model: str, request: R, priority: int, deadline: float,
                    gate: Callable[[R], bool]) -> float:
        """Return once ``request`` may be dispatched; the seconds it waited (on ``clock``).

        Args:
            model: the served model name (one queue each).
            request: handed to ``gate`` when it reaches the head of the queue.
            priority: lower is served first.
            deadline: when its first token is due, on ``clock``.
            gate: ``gate(request)`` is True when the request may be dispatched now.

        Raises:
            Rejected: the queue is full, or the request waited past ``queue_timeout``.
        """
        if self.admit_now(model, request, gate):
            return 0.0
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue()
        if queue.waiting() >= self.max_queue:
            self.on_change(model, queue.waiting(), "queue_full")
            self._drop_if_empty(model)
            raise Rejected("queue_full", self._retry_after(model),
                           f"the router's queue for `{model}` is full and no replica is "
                           "predicted to meet this request's TTFT objective; retry later")
        start = self.clock()
        waiter = _Waiter(priority, deadline, next(self._seq), request,
                         asyncio.get_running_loop().create_future())
        heapq.heappush(queue.heap, waiter)
        self.on_change(model, queue.waiting(), None)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.queue_timeout)
        except asyncio.TimeoutError:
            self.on_change(model, queue.waiting() - 1, "queue_timeout")
            raise Rejected("queue_timeout", self._retry_after(model),
                           f"waited {self.queue_timeout:g} s in the router's queue for "
                           f"`{model}`; retry later") from None
        finally:
            if not waiter.future.done():  # timed out or cancelled: leave the heap now
                waiter.future.cancel()
                try:
                    queue.heap.remove(waiter)
                    heapq.heapify(queue.heap)
                except ValueError:
                    pass
            self.on_change(model, queue.waiting(), None)
            self._drop_if_empty(model)
        return self.clock() - start

    def kick(self, model: str, gate: Callable[[R], bool]) -> R | None:
        """Release the head of ``model``'s queue if ``gate`` lets it through.

        Releases at most one request: the released request's dispatch changes the load the
        gate reads, so the caller kicks again after it (and on every capacity event).

        Returns:
            the released request, or None.
        """
        queue = self._queues.get(model)
        if queue is None:
            return None
        head = queue.head()
        if head is None or not gate(head.request):
            return None
        heapq.heappop(queue.heap)
        head.future.set_result(None)
        return head.request

    def kick_all(self, gate: Callable[[str], Callable[[R], bool]]) -> None:
        """``kick`` every model's queue (a periodic tick, a worker turning ready)."""
        for model in list(self._queues):
            self.kick(model, gate(model))

    def _drop_if_empty(self, model: str) -> None:
        queue = self._queues.get(model)
        if queue is not None and queue.head() is None:
            del self._queues[model]

    def _retry_after(self, model: str) -> int:
        try:
            seconds = float(self.retry_after(model))
        except Exception:  # noqa: BLE001 - a bad estimate must not turn a 429 into a 500
            logger.exception("retry-after estimate failed")
            seconds = 1.0
        return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1
