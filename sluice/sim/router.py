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

Candidates are ``d`` ready endpoints sampled uniformly (power of d choices, Mitzenmacher
2001), sorted by URL as the router sorts them; ``d = 0`` scores every ready endpoint, as
the production router does today (``Dispatcher`` has no sampling path: O(replicas) per
request, too slow at 1,000 replicas in the simulator and in the router alike).

Not driven here: the admission gate and queue (``Dispatcher.gate`` reads
``time.monotonic()`` itself); requests go to a replica at once, where they queue in the
engine. Workers' load reports are refreshed at each request's first token and end (what
the response headers carry) and by the simulator's poll.
"""

from __future__ import annotations

import logging
import math
import random

from sluice.router.endpoints import Endpoint, Lease, WorkerLoad
from sluice.router.policy import (PolicyContext, Prediction, RoutingRequest, least_load,
                                  predict_all, round_robin, slo_pick)
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
        self._leases: dict[int, tuple[Endpoint, Lease, Prediction | None]] = {}
        self._turn = 0

    def add(self, index: int) -> None:
        """Replica ``index`` turned ready."""
        self.endpoints[index] = Endpoint(url(index), ready=True)
        self.ready.append(index)

    def unroute(self, index: int) -> None:
        """Replica ``index`` leaves routing (draining); its in-flight leases stay counted."""
        self.ready.remove(index)

    def forget(self, index: int) -> None:
        self.endpoints.pop(index, None)

    def choose(self, rid: int, prompt: int, blocks: tuple[int, ...], arrival: float,
               now: float) -> int:
        """The replica for request ``rid`` (``ready`` must be non-empty); leases it."""
        ready = self.ready
        picked = ready if not self.d or len(ready) <= self.d else \
            sorted(self.rng.sample(ready, self.d))
        candidates = [self.endpoints[i] for i in picked]
        self._turn += 1
        prediction = None
        uncached = float(prompt)
        if self.policy == "round-robin":
            k = round_robin(len(candidates), self._turn)
        elif self.policy == "least-load":
            k = least_load([(e.in_flight, e.queued_prefill_tokens(now)) for e in candidates],
                           self._turn)
        else:
            shape = PromptShape(key=blocks[0] if blocks else 0, blocks=blocks, tokens=prompt,
                                block_tokens=float(self.block_tokens))
            request = RoutingRequest(
                model=MODEL, shape=shape, ttft_slo_s=self.ttft_slo_s, itl_slo_s=self.itl_slo_s,
                deadline=arrival + self.ttft_slo_s if self.ttft_slo_s else None)
            predictions = predict_all(candidates, request, self.context.prefix_index, now=now,
                                      fleet=self.context.fleet)
            k = slo_pick([p.ttft_s for p in predictions], [p.cached_blocks for p in predictions],
                         request.budget_s(now), [p.itl_s for p in predictions],
                         self.itl_slo_s, self._turn)
            prediction = predictions[k]
            uncached = max(0.0, prompt - prediction.cached_blocks * self.block_tokens)
        endpoint = candidates[k]
        if blocks:
            self.context.prefix_index.record(blocks, endpoint.url)
        lease = Lease(endpoint, prefill_tokens=uncached, now=now)
        self._leases[rid] = (endpoint, lease, prediction)
        return picked[k]

    def first_token(self, rid: int, ttft_s: float, replica: Replica, now: float) -> None:
        """Its first token came ``ttft_s`` after it was sent (``Dispatcher.first_token``)."""
        endpoint, lease, prediction = self._leases[rid]
        lease.first_token(now)
        self.report(endpoint, replica, now)
        if prediction is not None:
            endpoint.latency.fit_ttft(prediction.features, ttft_s)
            self.context.fleet.fit_ttft(prediction.features, ttft_s)

    def finished(self, rid: int, mean_gap_s: float | None, replica: Replica, now: float) -> None:
        """It ended (``Dispatcher.finished``: the ITL models learn its mean gap)."""
        endpoint, lease, prediction = self._leases.pop(rid)
        lease.release(now)
        self.report(endpoint, replica, now)
        if prediction is not None and mean_gap_s is not None and math.isfinite(mean_gap_s):
            running = prediction.features.running + 1
            endpoint.latency.fit_itl(running, mean_gap_s)
            self.context.fleet.fit_itl(running, mean_gap_s)

    def report(self, endpoint: Endpoint, replica: Replica, now: float) -> None:
        """``replica``'s load as its worker reports it (headers or a /metrics poll)."""
        endpoint.reported = WorkerLoad(*replica.load(now), now)
