"""The simulated router: the production routing decisions over sampled candidates.

Per request it calls the router's own pure code (``sluice.router.policy``) on the router's
own state objects (``sluice.router.endpoints.Endpoint`` with its ``Lease`` counts and
worker load reports, the ``PrefixIndex``, the online ``LatencyModel``\\ s), exactly as
``Dispatcher.choose`` / ``first_token`` / ``finished`` do, with the virtual clock passed as
``now``:

    least-load   least_load over (in flight, queued prefill tokens)
    round-robin  round_robin
    slo          predict_all (TTFT/ITL predictions, prefix matches) → slo_pick;
                 first token: the endpoint's and the fleet's TTFT models learn (RLS)

Every chosen endpoint gets a TTFT prediction (the policy's, else one made for it, as
``Dispatcher.choose`` does), and its TTFT and ITL models learn from every request whatever
the policy, since the admission gate reads them; ``errors`` keeps the predictions' MAPE
(the router's ``sluice_router_ttft_prediction_mape``, over the whole run).

Admission (``admits``): the router's gate, ``policy.gate_open``, on the same objects. A
request the gate refuses waits in the simulator's queue (the router's admission queue:
with one objective and one priority for all, its EDF order is arrival order) until a
capacity event (a first token, an end, a replica turning ready, a poll) opens it.

Candidates are ``d`` ready endpoints sampled uniformly (power of d choices, Mitzenmacher
2001), sorted by URL as the router sorts them; ``d = 0`` scores every ready endpoint. The
production router draws so too past 16 ready endpoints (``policy.shortlist``: 16 drawn,
plus the prompt prefix's holders; below that it scores all of them). The gate's
first test, some ready endpoint with no prefill in flight, reads a count kept over every
ready endpoint, as the router's scan does; only its predictions are over the sample (the
same sample the choice then takes). Workers' load reports are refreshed at each request's
first token and end (what the response headers carry) and by the simulator's poll.
"""

from __future__ import annotations

import logging
import math
import random

from sluice.router.endpoints import Endpoint, Lease, WorkerLoad
from sluice.router.policy import (PolicyContext, Prediction, RoutingRequest, gate_open,
                                  least_load, predict_all, round_robin, slo_pick)
from sluice.router.predictor import ErrorTracker
from sluice.router.prefix import PrefixIndex, PromptShape
from sluice.sim.replica import Replica

logger = logging.getLogger(__name__)

ROUTING = ("slo", "least-load", "round-robin")
MODEL = "sim"


def url(index: int) -> str:
    """Replica ``index``'s endpoint URL (sorts like the index)."""
    return f"http://replica-{index:06d}"


class SimRouter:
    """Args:
        policy: one of ``ROUTING``.
        candidates: endpoints sampled per request (0: all ready ones).
        ttft_slo_s / itl_slo_s: the objectives every request carries (None: none).
        block_tokens: tokens per prefix block of the trace.
        seed: the sampling's random seed.
    """

    def __init__(self, policy: str = "slo", candidates: int = 4, ttft_slo_s: float | None = 2.0,
                 itl_slo_s: float | None = None, block_tokens: int = 512, seed: int = 0):
        if policy not in ROUTING:
            raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(ROUTING)}")
        self.policy, self.d = policy, candidates
        self.ttft_slo_s, self.itl_slo_s = ttft_slo_s, itl_slo_s
        self.block_tokens = block_tokens
        self.rng = random.Random(seed)
        self.context = PolicyContext(PrefixIndex())
        self.endpoints: dict[int, Endpoint] = {}
        self.ready: list[int] = []  # replica indices that take requests
        self.idle = 0  # ready endpoints with no prefill in flight
        self.errors = ErrorTracker(window=None)  # the TTFT predictions' MAPE, over the run
        self._leases: dict[int, tuple[Endpoint, Lease, Prediction]] = {}
        # the gate's look at the request it last let through: (rid, sample, predictions)
        self._gated: tuple[int, list[int], list[Prediction]] | None = None
        self._turn = 0

    def add(self, index: int) -> None:
        """Replica ``index`` turned ready."""
        self.endpoints[index] = Endpoint(url(index), ready=True)
        self.ready.append(index)
        self.idle += 1

    def unroute(self, index: int) -> None:
        """Replica ``index`` leaves routing (draining); its in-flight leases stay counted."""
        self.ready.remove(index)
        endpoint = self.endpoints[index]
        endpoint.ready = False
        self.idle -= endpoint.prefilling == 0

    def forget(self, index: int) -> None:
        self.endpoints.pop(index, None)

    def admits(self, rid: int, prompt: int, blocks: tuple[int, ...], arrival: float,
               now: float) -> bool:
        """The admission gate (``policy.gate_open``) for request ``rid`` at ``now``: True
        when it may be sent (``ready`` must be non-empty), False when it waits."""
        if self.idle or self.ttft_slo_s is None:
            return True
        picked = self._sample()
        is_open, predictions = gate_open(
            [self.endpoints[i] for i in picked], self._request(prompt, blocks, arrival),
            self.context.prefix_index, now, self.context.fleet)
        if is_open and predictions is not None:
            self._gated = (rid, picked, predictions)
        return is_open

    def choose(self, rid: int, prompt: int, blocks: tuple[int, ...], arrival: float,
               now: float) -> int:
        """The replica for request ``rid`` (``ready`` must be non-empty); leases it."""
        gated, self._gated = self._gated, None
        if gated is not None and gated[0] == rid:
            picked, predictions = gated[1], gated[2]
        else:
            picked, predictions = self._sample(), None
        candidates = [self.endpoints[i] for i in picked]
        self._turn += 1
        request = self._request(prompt, blocks, arrival)
        if self.policy == "round-robin":
            k = round_robin(len(candidates), self._turn)
        elif self.policy == "least-load":
            k = least_load([(e.in_flight, e.queued_prefill_tokens(now)) for e in candidates],
                           self._turn)
        else:
            if predictions is None:
                predictions = predict_all(candidates, request, self.context.prefix_index,
                                          now=now, fleet=self.context.fleet)
            k = slo_pick([p.ttft_s for p in predictions], [p.cached_blocks for p in predictions],
                         request.budget_s(now), [p.itl_s for p in predictions],
                         self.itl_slo_s, self._turn)
        endpoint = candidates[k]
        prediction = predictions[k] if predictions is not None else predict_all(
            [endpoint], request, self.context.prefix_index, now=now, fleet=self.context.fleet)[0]
        if blocks:
            self.context.prefix_index.record(blocks, endpoint.url)
        was_idle = endpoint.prefilling == 0
        lease = Lease(endpoint, prediction.features.uncached_prompt_tokens, now)  # as Exchange
        self._idle_changed(endpoint, was_idle)
        self._leases[rid] = (endpoint, lease, prediction)
        return picked[k]

    def first_token(self, rid: int, ttft_s: float, replica: Replica, now: float) -> None:
        """Its first token came ``ttft_s`` after it was sent (``Dispatcher.first_token``)."""
        endpoint, lease, prediction = self._leases[rid]
        was_idle = endpoint.prefilling == 0
        lease.first_token(now)
        self._idle_changed(endpoint, was_idle)
        self.report(endpoint, replica, now)
        self.errors.observe(prediction.ttft_s, ttft_s)
        endpoint.latency.fit_ttft(prediction.features, ttft_s)
        self.context.fleet.fit_ttft(prediction.features, ttft_s)

    def finished(self, rid: int, mean_gap_s: float | None, replica: Replica, now: float) -> None:
        """It ended (``Dispatcher.finished``: the ITL models learn its mean gap)."""
        endpoint, lease, prediction = self._leases.pop(rid)
        was_idle = endpoint.prefilling == 0
        lease.release(now)
        self._idle_changed(endpoint, was_idle)
        self.report(endpoint, replica, now)
        if mean_gap_s is not None and math.isfinite(mean_gap_s):
            running = prediction.features.running + 1
            endpoint.latency.fit_itl(running, mean_gap_s)
            self.context.fleet.fit_itl(running, mean_gap_s)

    def report(self, endpoint: Endpoint, replica: Replica, now: float) -> None:
        """``replica``'s load as its worker reports it (headers or a /metrics poll)."""
        endpoint.reported = WorkerLoad(*replica.load(now), now)

    def _sample(self) -> list[int]:
        ready = self.ready
        if not self.d or len(ready) <= self.d:
            return ready
        return sorted(self.rng.sample(ready, self.d))

    def _request(self, prompt: int, blocks: tuple[int, ...], arrival: float) -> RoutingRequest:
        shape = PromptShape(key=blocks[0] if blocks else 0, blocks=blocks, tokens=prompt,
                            block_tokens=float(self.block_tokens))
        return RoutingRequest(model=MODEL, shape=shape, ttft_slo_s=self.ttft_slo_s,
                              itl_slo_s=self.itl_slo_s,
                              deadline=arrival + self.ttft_slo_s if self.ttft_slo_s else None)

    def _idle_changed(self, endpoint: Endpoint, was_idle: bool) -> None:
        if endpoint.ready:
            self.idle += (endpoint.prefilling == 0) - was_idle
