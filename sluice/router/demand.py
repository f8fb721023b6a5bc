"""Demand as the router's admission sees it: what the autoscaler reads, and the requests
held while a model has no ready replica (scale from zero).

Counted where requests arrive, never from completions (a fleet under back-pressure completes
no more than it already serves, however fast the queue grows):

    arrival ─▶ [held: no ready replica] ─▶ admission queue ─▶ worker ─▶ first token ─▶ end
      │            │ hold timeout: 503          │ full/timeout: 429        │ TTFT met?     │ ITL met?
    arrivals     held (gauge), rejected      queued (admission's gauge)   ttft_met/total  itl_met/total

``snapshot`` gives cumulative counters and current gauges per model; a driver (operator,
``sluice up`` supervisor, simulator) takes differences between two snapshots to build an
``sluice.autoscale.policy.Observation``. Counters only grow while the router lives; a
driver that sees one fall treats it as a router restart.

Nothing here does I/O or reads the wall clock: waits use asyncio, durations come from the
caller. There is one entry per model the router serves (bounded by discovery).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass
class ModelDemand:
    """One model's demand counters (cumulative) and gauges (now).

    Attributes:
        arrivals: requests that reached admission.
        rejected: of those, refused (429 from admission, 503 after a hold timeout).
        invalid: of those, refused by the worker as invalid (a 4xx other than 429): not
            demand (``sluice.autoscale.observe`` takes them off the arrivals), so a stream
            of malformed requests cannot hold a service at its maximum. Counted when the
            worker answers, milliseconds after the arrival.
        ttft_met / ttft_total: requests whose TTFT (from arrival, queueing and holding
            included) met their objective / all with a first token the router saw (see
            ``sluice.router.exchange``) and an objective.
        itl_met / itl_total: streamed requests whose mean inter-token gap met their ITL
            objective / all with gaps and an objective.
        held: requests waiting now for a replica to become ready.
        in_flight: requests being served by a worker now.
    """

    arrivals: int = 0
    rejected: int = 0
    invalid: int = 0
    ttft_met: int = 0
    ttft_total: int = 0
    itl_met: int = 0
    itl_total: int = 0
    held: int = 0
    in_flight: int = 0


class Demand:
    """Per-model demand accounting and the hold of requests that found no ready replica.

    Model names are the ones the router serves (bounded by discovery), never raw client
    input: callers count a request only once its model is known.
    """

    def __init__(self) -> None:
        self._models: dict[str, ModelDemand] = {}
        self._changed = asyncio.Event()  # replaced at each wake; binds to the loop at first use
        self._closed = False

    def model(self, model: str) -> ModelDemand:
        entry = self._models.get(model)
        if entry is None:
            entry = self._models[model] = ModelDemand()
        return entry

    def arrived(self, model: str) -> None:
        self.model(model).arrivals += 1

    def rejected(self, model: str) -> None:
        self.model(model).rejected += 1

    def invalid(self, model: str) -> None:
        """The worker refused it as invalid (see ``ModelDemand.invalid``)."""
        self.model(model).invalid += 1

    def started(self, model: str) -> None:
        """A worker took the request."""
        self.model(model).in_flight += 1

    def first_token(self, model: str, ttft_s: float, slo_s: float | None) -> None:
        """Its first token came ``ttft_s`` seconds after arrival; objective ``slo_s``."""
        if slo_s is not None:
            entry = self.model(model)
            entry.ttft_total += 1
            entry.ttft_met += ttft_s <= slo_s

    def finished(self, model: str, mean_gap_s: float | None, slo_s: float | None) -> None:
        """The worker is done with it (any way); ``mean_gap_s``: its mean ITL, if streamed."""
        entry = self.model(model)
        entry.in_flight = max(0, entry.in_flight - 1)
        if mean_gap_s is not None and slo_s is not None:
            entry.itl_total += 1
            entry.itl_met += mean_gap_s <= slo_s

    async def hold(self, model: str, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``ready()`` is True (a replica of ``model`` is ready), at most
        ``timeout_s`` seconds; True when it is. Counted in ``held`` meanwhile. ``wake`` is
        called whenever readiness may have changed (each endpoint poll). False at once
        after ``close``."""
        if ready():
            return True
        entry = self.model(model)
        entry.held += 1
        try:
            async with asyncio.timeout(timeout_s):
                while not ready():
                    if self._closed:
                        return False
                    await self._changed.wait()
            return True
        except TimeoutError:
            return False
        finally:
            entry.held -= 1

    def wake(self) -> None:
        """Readiness may have changed: every held request re-checks it."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def close(self) -> None:
        """The router is stopping: every held request, and any held later, gives up now
        (its client gets 503 + Retry-After rather than a connection dropped at the end of
        the graceful shutdown, which waited for them)."""
        self._closed = True
        self.wake()

    def holding(self) -> int:
        return sum(entry.held for entry in self._models.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """model → its counters and gauges (``ModelDemand`` fields)."""
        return {model: asdict(entry) for model, entry in sorted(self._models.items())}
