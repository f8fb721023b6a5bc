"""Routing policies: which ready endpoint gets the next request.

A policy is an object with one async method, ``choose``, chosen by name from ``POLICIES`` and
created once in the router's lifespan with the router's shared ``PolicyContext`` (the prefix
index, settings). Each decision is a pure function of the observed state passed to it
(``least_load``, ``round_robin``, ``chwbl``, ``slo_pick``), unit-tested without servers and
reusable by a simulator:

    least-load   fewest in-flight requests; ties: least queued prefill; then rotating
    round-robin  the next endpoint in turn (the benchmark's baseline)
    prefix       consistent hashing with bounded load (CHWBL) on the prompt's first
                 characters: same-prefix requests go where their KV blocks are cached, never
                 to an endpoint above load_factor × the average in-flight load
    slo          predicted TTFT per endpoint (``predict_ttft``); among those predicted to
                 meet the request's TTFT objective, the one expected to hold the longest
                 cached prefix (packing same-prefix work), then the one with most headroom;
                 when none meets it, the lowest prediction

State the policies read is bounded: per-endpoint counters and models (as many as
endpoints), the prefix index (an LRU with a capacity), and a small ring cache.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.router.endpoints import Endpoint
from sluice.router.predictor import PRIOR_DRAIN_TOKENS_PER_S, LatencyModel, TTFTFeatures
from sluice.router.prefix import PrefixIndex, PromptShape

logger = logging.getLogger(__name__)

Clock = Callable[[], float]  # seconds, monotonic: time.monotonic, or a simulator's virtual time
DEFAULT_LOAD_FACTOR = 1.25
MIN_OWN_UPDATES = 20  # observations before an endpoint's own model replaces the fleet's
VIRTUAL_NODES = 64  # ring points per endpoint: keys spread within a few % of even


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may look at.

    Attributes:
        model: the served model name.
        stream: the client streams.
        body: the parsed JSON body (read-only).
        shape: the prompt's prefix key, block hashes and estimated length.
        ttft_slo_s: the request's TTFT objective, seconds (None: none).
        itl_slo_s: the request's inter-token latency objective, seconds (None: none).
        deadline: the router's clock (seconds) by which the first token is due (arrival +
            TTFT objective); None without a TTFT objective.
        priority: lower is served first when requests queue.
        predicted: what the admission gate and the policy predicted for its current
            routing attempt (``Predicted``), so each candidate is predicted once per attempt.
            Not part of its identity.
    """

    model: str
    stream: bool = False
    body: Mapping[str, Any] = field(default_factory=dict)
    shape: PromptShape = field(default_factory=PromptShape)
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    deadline: float | None = None
    priority: int = 0
    predicted: Predicted = field(default_factory=lambda: Predicted(), compare=False,
                                 repr=False)

    def budget_s(self, now: float) -> float:
        """Seconds left to the deadline (may be negative); infinite without one."""
        return math.inf if self.deadline is None else self.deadline - now


@dataclass
class PolicyContext:
    """What the router shares with its policies (one per router).

    Attributes:
        prefix_index: which endpoints were recently sent which prompt blocks.
        load_factor: CHWBL's c = 1 + ε: no endpoint takes more than ⌈c · m / n⌉ of the m
            in-flight requests (counting the new one) over n endpoints.
        fleet: latency models fitted on every endpoint's observations (see ``predict``).
        clock: the router's clock (seconds); policies read the time only from it, so a
            simulator can run them on virtual time.
        rng: the draws of ``shortlist``.
    """

    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    load_factor: float = DEFAULT_LOAD_FACTOR
    fleet: LatencyModel = field(default_factory=LatencyModel)
    clock: Clock = time.monotonic
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def __post_init__(self) -> None:
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be ≥ 1, not {self.load_factor}")


class RoutingPolicy(Protocol):
    """Picks one endpoint for a request.

    Implementations must not block and must not await I/O: the router leases the chosen
    endpoint (counting the request against it) right after ``choose`` returns, and
    concurrent requests must see each other's choices.
    """

    async def choose(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        """Return one of ``candidates``.

        Args:
            candidates: non-empty, ready endpoints that serve ``request.model``, in a stable
                order (sorted by URL).
            request: the request being routed.
        """
        ...


# ---------------------------------------------------------------------------- pure decisions

def least_load(loads: Sequence[Any], start: int = 0) -> int:
    """Index of the smallest load; ties go to the first one at or after ``start``, cyclically.

    Rotating ``start`` between calls spreads ties (an idle fleet) round-robin instead of
    sending every burst to index 0.

    Args:
        loads: comparable loads, one per candidate (ints, or tuples such as (in-flight,
            queued tokens) to break ties by a second key); must be non-empty.
        start: where the tie-breaking scan begins (any int; taken modulo ``len(loads)``).

    Returns:
        an index into ``loads``.

    Raises:
        ValueError: ``loads`` is empty.

    Example: loads [2, 1, 0, 0], start 3 → 3; start 0 → 2.
    """
    if not loads:
        raise ValueError("least_load needs at least one candidate")
    n = len(loads)
    order = [(start + k) % n for k in range(n)]
    return min(order, key=lambda i: loads[i])  # min keeps the first minimum in scan order


def round_robin(n: int, turn: int) -> int:
    """The ``turn``-th pick over ``n`` candidates: ``turn mod n``."""
    if n < 1:
        raise ValueError("round_robin needs at least one candidate")
    return turn % n


def _point(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring: ``vnodes`` points per member, sorted.

    Adding or removing one of n members moves only ~1/n of the keys.
    """

    def __init__(self, members: Sequence[str], vnodes: int = VIRTUAL_NODES):
        points = sorted((_point(f"{m}#{v}"), m) for m in members for v in range(vnodes))
        self.hashes = [h for h, _ in points]
        self.members = [m for _, m in points]
        self.size = len(set(members))

    def walk(self, key: int) -> list[str]:
        """Distinct members in ring order, starting at the first point at or after ``key``."""
        seen: dict[str, None] = {}
        start = bisect.bisect_left(self.hashes, key % (1 << 64))
        n = len(self.members)
        for k in range(n):
            member = self.members[(start + k) % n]
            if member not in seen:
                seen[member] = None
                if len(seen) == self.size:
                    break
        return list(seen)


def chwbl(ring: HashRing, key: int, loads: Mapping[str, int], load_factor: float) -> str:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

    Walk the ring from ``key`` and take the first member whose load is under the capacity
    ``⌈load_factor · (total + 1) / n⌉``, where ``total`` is the sum of ``loads`` and the +1
    is the new request. Some member always qualifies (the capacities add up to at least
    total + 1).

    Args:
        ring: the candidates' ring.
        key: the request's prefix-key hash (64-bit).
        loads: member → in-flight requests (members missing here count 0).
        load_factor: c ≥ 1 (1.25: at most 25 % above the average).

    Returns:
        the chosen member.
    """
    members = ring.walk(key)
    total = sum(loads.get(m, 0) for m in members)
    capacity = math.ceil(load_factor * (total + 1) / len(members))
    for member in members:
        if loads.get(member, 0) < capacity:
            return member
    return min(members, key=lambda m: loads.get(m, 0))  # unreachable with load_factor ≥ 1


def slo_pick(predicted_ttft: Sequence[float], cached_blocks: Sequence[int], budget_s: float,
             predicted_itl: Sequence[float] | None = None, itl_slo_s: float | None = None,
             start: int = 0) -> int:
    """The ``slo`` decision over n candidates.

    1. Feasible: predicted TTFT ≤ ``budget_s`` (and predicted ITL ≤ ``itl_slo_s`` when
       both are given; if that leaves none, the TTFT test alone).
    2. Among the feasible, the most cached blocks (pack same-prefix work where its KV
       is), then the most headroom (budget − prediction).
    3. None feasible: the lowest predicted TTFT.
    Remaining ties go to the first in cyclic order from ``start`` (no herd on an idle fleet).

    Args:
        predicted_ttft: seconds, one per candidate.
        cached_blocks: prompt blocks expected cached there, one per candidate.
        budget_s: seconds left before the request's TTFT deadline (``math.inf``: none).
        predicted_itl: seconds per token, one per candidate (optional).
        itl_slo_s: the ITL objective, seconds (optional).
        start: where the tie-breaking scan begins.

    Returns:
        an index into the candidates.
    """
    n = len(predicted_ttft)
    if n == 0:
        raise ValueError("slo_pick needs at least one candidate")
    order = [(start + k) % n for k in range(n)]
    feasible = [i for i in order if predicted_ttft[i] <= budget_s]
    if feasible and predicted_itl is not None and itl_slo_s is not None:
        feasible = [i for i in feasible if predicted_itl[i] <= itl_slo_s] or feasible
    if feasible:
        return max(feasible, key=lambda i: (cached_blocks[i], -predicted_ttft[i]))
    return min(order, key=lambda i: predicted_ttft[i])


# ---------------------------------------------------------------------------- predictions

@dataclass(frozen=True)
class Prediction:
    """One endpoint's predicted latencies for one request, and the features behind them.

    Attributes:
        ttft_s: predicted time to first token from sending, seconds.
        itl_s: predicted mean inter-token gap, seconds.
        cached_blocks: leading prompt blocks the prefix index expects cached there.
        features: the endpoint's load as the request saw it (the models are fitted on it).
    """

    ttft_s: float
    itl_s: float
    cached_blocks: int
    features: TTFTFeatures


def predict(endpoint: Endpoint, shape: PromptShape, cached_blocks: int, now: float,
            fleet: LatencyModel | None = None, one_at_a_time: bool = False) -> Prediction:
    """Predict a request's TTFT and ITL on ``endpoint`` from its current observed load.

    Args:
        endpoint: its counters, last load report and latency models are read.
        shape: the request's prompt shape (estimated tokens).
        cached_blocks: leading prompt blocks the prefix index expects cached there.
        now: the router's clock, seconds (for report freshness).
        fleet: a model fitted on every endpoint's observations, used while the endpoint's
            own model has fewer than ``MIN_OWN_UPDATES`` (a new replica starts from what
            its siblings taught, not from the prior).
        one_at_a_time: an endpoint without a measured drain rate (``DrainMeter.rate`` None:
            a fresh replica) that already has a prefill in flight is predicted ``math.inf``:
            until its own prefills have shown how fast it is (``MIN_BUSY_S`` busy seconds
            of the drain meter: one slow CPU prefill, a few fast GPU ones), it takes one at
            a time.
            ``predict_all`` asks for it when a sibling's rate is measured (a scale-up):
            predicting the fresh one's queue at the prior rate let a burst flood a fresh
            one-thread CPU worker (four of five requests queued there, TTFT 1.6-2.2 s,
            while the measured sibling idled; ``bench/autoscale.py``, 2026-12-05). A cold
            fleet keeps the prior, so a first burst is not held a prefill (or a whole plain
            answer, whose first token the router sees only at its end) per replica.
    """
    cached_tokens = min(cached_blocks * shape.block_tokens, shape.tokens - 1)
    rate = endpoint.drain.rate()
    features = TTFTFeatures(endpoint.queued_prefill_tokens(now),
                            max(0.0, shape.tokens - cached_tokens),
                            rate or PRIOR_DRAIN_TOKENS_PER_S, endpoint.running(now))
    own = endpoint.latency
    ttft = own if fleet is None or own.ttft.updates >= MIN_OWN_UPDATES else fleet
    itl = own if fleet is None or own.itl.updates >= MIN_OWN_UPDATES else fleet
    held = one_at_a_time and rate is None and endpoint.prefilling > 0
    ttft_s = math.inf if held else ttft.ttft_s(features)
    return Prediction(ttft_s, itl.itl_s(features.running + 1), cached_blocks, features)


SHORTLIST = 16  # candidates the slo policy draws, past that many (power of d choices)


def shortlist(candidates: Sequence[Endpoint], request: RoutingRequest, index: PrefixIndex,
              rng: random.Random, d: int = SHORTLIST) -> Sequence[Endpoint]:
    """The candidates the ``slo`` policy predicts for: all of them, up to ``d``; past that,
    ``d`` drawn uniformly (the power of d choices: Mitzenmacher 2001; the simulator draws
    its candidates so too) and every candidate the prefix index says holds the prompt's
    leading blocks (so prefix affinity does not depend on the draw), in the candidates'
    order.

    Predicting for every candidate made the router's CPU per request grow with the fleet:
    0.64 ms with one worker, 1.22 ms with 100 and 10.1 ms with 1,000, where it served 50
    requests/s and 47 of 2,000 failed (null workers; ``bench/router.py --only scale``).
    """
    if len(candidates) <= d:
        return candidates
    picked = set(rng.sample(range(len(candidates)), d))
    holders = index.match(request.shape.blocks) if request.shape.blocks else {}
    if holders:
        picked.update(i for i, e in enumerate(candidates) if e.url in holders)
    return [candidates[i] for i in sorted(picked)]


def predict_all(candidates: Sequence[Endpoint], request: RoutingRequest, index: PrefixIndex,
                now: float, fleet: LatencyModel | None = None) -> list[Prediction]:
    """``predict`` for every candidate (one prefix-index lookup); fresh endpoints take one
    prefill at a time when some candidate's drain rate is measured."""
    matched = index.match(request.shape.blocks) if request.shape.blocks else {}
    measured = any(e.drain.rate() is not None for e in candidates)
    return [predict(e, request.shape, matched.get(e.url, 0), now, fleet, measured)
            for e in candidates]


def gate_open(candidates: Sequence[Endpoint], request: RoutingRequest, index: PrefixIndex,
              now: float, fleet: LatencyModel | None = None
              ) -> tuple[bool, list[Prediction] | None]:
    """The admission gate: may ``request`` go to one of ``candidates`` (ready endpoints)
    now, or wait in its model's queue? It may when it has no TTFT objective, when no
    endpoint is ready (the proxy answers), when some endpoint has no prefill in flight
    (``Endpoint.prefill_idle``; work conservation: an idle endpoint never waits while
    requests queue), or when some
    endpoint is predicted to give its first token within its remaining budget.

    Holding the rest at the router keeps each engine's queue about one prefill deep, so
    a request picks its endpoint when capacity frees (late binding) in priority and
    deadline order, and prefill chunks do not pile into running requests' decode steps.
    The price under overload is throughput: one worker behind the router at 3 req/s of
    512-token prompts ran 0.80 req/s with the gate and 0.96 without, at ITL p90 305 ms
    against 2.5 s.

    Returns:
        (open, the predictions made for ``candidates`` or None when none were needed).
    """
    if not candidates or request.deadline is None:
        return True, None
    if any(e.prefill_idle(now) for e in candidates):
        return True, None
    predictions = predict_all(candidates, request, index, now, fleet)
    budget = request.budget_s(now)
    return any(p.ttft_s <= budget for p in predictions), predictions


@dataclass
class Predicted:
    """The predictions of one routing attempt of one request, each read at most once, so
    no candidate is predicted twice in an attempt and nothing stale is read later:

        gate (all busy) ──▶ by_url ──▶ policy (slo) ──▶ chosen ──▶ Dispatcher.choose
         predicts all       taken      predicts only      taken     predicts only when
                                       when missing                 nothing was left

    Attributes:
        by_url: endpoint URL → the admission gate's prediction, from its last look (the
            one that let the request through).
        chosen: (URL, prediction) the policy left for its pick.
    """

    by_url: dict[str, Prediction] = field(default_factory=dict)
    chosen: tuple[str, Prediction] | None = None

    def take_all(self, candidates: Sequence[Endpoint]) -> list[Prediction] | None:
        """The gate's predictions for ``candidates`` if it made them all (then forgotten)."""
        by_url, self.by_url = self.by_url, {}
        if all(e.url in by_url for e in candidates):
            return [by_url[e.url] for e in candidates]
        return None

    def take(self, endpoint: Endpoint) -> Prediction | None:
        """The policy's or the gate's prediction for ``endpoint``; forgets them all."""
        chosen, by_url = self.chosen, self.by_url
        self.chosen, self.by_url = None, {}
        if chosen is not None and chosen[0] == endpoint.url:
            return chosen[1]
        return by_url.get(endpoint.url)


# ---------------------------------------------------------------------------- the policies

class _Turns:
    """A rotating counter (bounded; only its value modulo n matters)."""

    def __init__(self) -> None:
        self._turn = 0

    def next(self) -> int:
        turn = self._turn
        self._turn = (self._turn + 1) % 1_000_003
        return turn


class LeastLoadPolicy:
    """Fewest in-flight requests; ties by fewest queued prefill tokens, then rotating."""

    def __init__(self, context: PolicyContext | None = None) -> None:
        self.context = context or PolicyContext()
        self._turns = _Turns()

    async def choose(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        now = self.context.clock()
        loads = [(e.in_flight, e.queued_prefill_tokens(now)) for e in candidates]
        return candidates[least_load(loads, self._turns.next())]


class RoundRobinPolicy:
    """Each candidate in turn, whatever its load."""

    def __init__(self, context: PolicyContext | None = None) -> None:
        self._turns = _Turns()

    async def choose(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        return candidates[round_robin(len(candidates), self._turns.next())]


class PrefixPolicy:
    """CHWBL on the prompt's prefix key (``chwbl``), load = in-flight requests."""

    MAX_RINGS = 8  # rings cached per candidate set; candidate sets change rarely

    def __init__(self, context: PolicyContext | None = None) -> None:
        self.context = context or PolicyContext()
        self._rings: OrderedDict[tuple[str, ...], HashRing] = OrderedDict()

    def ring(self, urls: tuple[str, ...]) -> HashRing:
        ring = self._rings.get(urls)
        if ring is None:
            ring = self._rings[urls] = HashRing(urls)
            while len(self._rings) > self.MAX_RINGS:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(urls)
        return ring

    async def choose(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        by_url = {e.url: e for e in candidates}
        ring = self.ring(tuple(by_url))
        url = chwbl(ring, request.shape.key, {u: e.in_flight for u, e in by_url.items()},
                    self.context.load_factor)
        return by_url[url]


class SLOPolicy:
    """Predicted TTFT against the request's objective (``slo_pick``), over the admission
    gate's predictions when it made them for every candidate, else over a ``shortlist``."""

    def __init__(self, context: PolicyContext | None = None) -> None:
        self.context = context or PolicyContext()
        self._turns = _Turns()

    async def choose(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        now = self.context.clock()
        predictions = request.predicted.take_all(candidates)
        if predictions is None:
            candidates = shortlist(candidates, request, self.context.prefix_index,
                                   self.context.rng)
            predictions = predict_all(candidates, request, self.context.prefix_index, now,
                                      self.context.fleet)
        index = slo_pick([p.ttft_s for p in predictions], [p.cached_blocks for p in predictions],
                         request.budget_s(now), [p.itl_s for p in predictions],
                         request.itl_slo_s, self._turns.next())
        request.predicted.chosen = (candidates[index].url, predictions[index])
        return candidates[index]


POLICIES: dict[str, type] = {
    "slo": SLOPolicy,
    "least-load": LeastLoadPolicy,
    "prefix": PrefixPolicy,
    "round-robin": RoundRobinPolicy,
}
DEFAULT_POLICY = "slo"


def make_policy(name: str, context: PolicyContext | None = None) -> RoutingPolicy:
    """Create the policy registered under ``name``, sharing ``context``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(context)
