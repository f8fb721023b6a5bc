"""Is the engine loop alive and making progress? The answer behind ``/health`` and ``/livez``.

::

    the engine's loop thread has died ─────────────────────────▶ "engine_dead"
    engine requests are open and none has made progress
      (an output, or the engine's computed-token count moving)
      for ``stall_timeout_s`` ──────────────────────────────────▶ "engine_stalled"
    otherwise ──────────────────────────────────────────────────▶ None (healthy)

Either problem makes ``/health`` (readiness: the router ejects the worker and re-dispatches
what it had not answered) and ``/livez`` (the pod's liveness probe: Kubernetes restarts it)
answer 503 with the problem as ``status``, and new generation requests 503. A dead engine
will never answer the requests it holds: ``EngineWatch.run`` fails them with ``EngineDead``
(a 503 before any byte, an SSE error event after). A stall may end (a long step), so the
requests of a stalled engine are left to finish.

The server feeds the watch (``started`` / ``progressed`` / ``ended`` per engine request);
the watch reads the engine only through ``alive()`` and ``stats()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

ENGINE_DEAD = "engine_dead"
ENGINE_STALLED = "engine_stalled"
STALL_TIMEOUT_S = 120.0  # a step, even a long prefill chunk on a CPU, is far shorter
WATCH_INTERVAL_S = 0.5


class EngineDead(RuntimeError):
    """The engine's loop has died: the requests it holds will never get another output."""


def engine_alive(engine: Any) -> bool:
    """Whether ``engine``'s loop still runs: its ``alive()`` (the native engine's step
    thread; vLLM's loop thread and engine core); True for an engine without one."""
    alive = getattr(engine, "alive", None)
    return bool(alive()) if callable(alive) else True


class EngineWatch:
    """Tracks the engine requests in flight and when the engine last made progress.

    Args:
        stall_timeout_s: seconds without progress, while engine requests are open, after
            which the engine counts as stalled.
        clock: seconds, monotonic (``time.monotonic``).
    """

    def __init__(self, stall_timeout_s: float = STALL_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.open_requests = 0
        self.last_progress = clock()
        self._computed: Any = None  # the engine's computed-token count at the last sample
        self._waiters: set[asyncio.Queue] = set()
        self._reported: str | None = None  # the problem last logged

    # ------------------------------------------------------------------ fed by the server

    def started(self) -> None:
        """An engine request was submitted."""
        if self.open_requests == 0:  # work starts now: the stall clock starts with it
            self.last_progress = self.clock()
        self.open_requests += 1

    def progressed(self) -> None:
        """An engine request got an output."""
        self.last_progress = self.clock()

    def ended(self) -> None:
        """An engine request finished, failed or was aborted."""
        self.open_requests -= 1

    def subscribe(self, queue: asyncio.Queue) -> None:
        """``queue`` gets an ``EngineDead`` if the engine dies (until ``unsubscribe``)."""
        self._waiters.add(queue)

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._waiters.discard(queue)

    # ------------------------------------------------------------------ verdict

    def problem(self, engine: Any) -> str | None:
        """``ENGINE_DEAD``, ``ENGINE_STALLED`` or None for ``engine`` (None: not loaded)."""
        if engine is None:
            return None
        if not engine_alive(engine):
            return ENGINE_DEAD
        self._sample(engine)
        if self.open_requests > 0 and self.clock() - self.last_progress > self.stall_timeout_s:
            return ENGINE_STALLED
        return None

    def _sample(self, engine: Any) -> None:
        """Count a move of the engine's computed-token count (``stats().num_computed_tokens``,
        when the engine reports it) as progress: a long prefill makes no output for a while
        but computes tokens every step."""
        try:
            computed = getattr(engine.stats(), "num_computed_tokens", None)
        except Exception:  # noqa: BLE001 - stats of a broken engine: no sample
            return
        if computed is not None and computed != self._computed:
            self._computed = computed
            self.last_progress = self.clock()

    async def run(self, engine: Callable[[], Any], interval: float = WATCH_INTERVAL_S) -> None:
        """Until cancelled: every ``interval`` seconds, sample progress; once the engine
        (``engine()``, None until loaded) is found dead, fail every subscribed request with
        ``EngineDead`` (and any that subscribe later, on the next round)."""
        while True:
            problem = self.problem(engine())
            if problem != self._reported:
                if problem is not None:
                    logger.error("%s: %d engine request(s) open, last progress %.1f s ago; "
                                 "/health and /livez answer 503", problem, self.open_requests,
                                 self.clock() - self.last_progress)
                else:
                    logger.info("the engine makes progress again")
                self._reported = problem
            if problem == ENGINE_DEAD:
                for queue in list(self._waiters):
                    queue.put_nowait(EngineDead("the engine loop has died"))
                self._waiters.clear()
            await asyncio.sleep(interval)


__all__ = ["ENGINE_DEAD", "ENGINE_STALLED", "EngineDead", "EngineWatch", "engine_alive"]
