"""Between a parsed request and the proxy: its routing view, admission, the choice of an
endpoint, and what each exchange teaches the latency models.

    body + headers ──▶ routing_request ──▶ admit (queue, 429) ──▶ choose (policy)
                                                                      │ lease + prefix record
    first token ──▶ first_token: fit the endpoint's TTFT model, MAPE ◀┘
    plain answer ─▶ first_token when it has one token, else ttft_at_most (an upper bound)
    finished    ──▶ finished: fit its ITL model; kick the model's queue

The admission gate (``gate``, deciding by ``policy.gate_open``) lets a request through when
some ready endpoint is predicted to meet its TTFT objective, or has no prefill in flight at
all (work conservation: an idle endpoint never waits while requests queue). Every capacity
event (first token, finished request, a poll) kicks the queue, which re-checks its head.
Past ``policy.SHORTLIST`` ready endpoints, the gate and the ``slo`` policy predict for a
``policy.shortlist`` of them (16 drawn, plus the prompt prefix's holders), not for all; the
idle test still reads every one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.router.admission import AdmissionQueue
from sluice.router.demand import Demand
from sluice.router.endpoints import Endpoint, EndpointSet, ModelSettings
from sluice.router.metrics import RouterMetrics
from sluice.router.policy import (DEFAULT_LOAD_FACTOR, DEFAULT_POLICY, POLICIES, SHORTLIST,
                                  Clock, PolicyContext, Prediction, RoutingPolicy,
                                  RoutingRequest, gate_open, make_policy, predict_all,
                                  shortlist)
from sluice.router.predictor import ErrorTracker
from sluice.router.prefix import KEY_CHARS, PrefixIndex, shape
from sluice.router.tenants import PRIORITY_LIMIT

logger = logging.getLogger(__name__)

HEADER_TTFT = "x-slo-ttft-ms"
HEADER_ITL = "x-slo-itl-ms"
HEADER_PRIORITY = "x-priority"
EWMA_ALPHA = 0.1
RELEASE_HOLD_S = 1.0  # a released request that never settles blocks its queue this long
NO_WORKER_RETRY_AFTER_S = 5  # no ready replica and none expected soon: one may be starting
MAX_RETRY_AFTER_S = 3600  # bootSeconds' own bound


class BadRoutingHeader(ValueError):
    """An ``x-slo-*`` or ``x-priority`` header (or the body's ``priority``) is malformed or
    out of bounds (400), or asks for a priority its sender may not use (403).

    Attributes:
        param: the header or field name.
        status: 400, or 403 for a priority above the sender's ceiling.
    """

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class DispatchSettings:
    """Routing and admission settings (router flags map 1:1).

    Attributes:
        policy: a name in ``sluice.router.policy.POLICIES``.
        load_factor: CHWBL's bound for ``prefix``.
        slo_ttft_ms: default TTFT objective when neither the request nor its
            InferenceService sets one; None: no objective (no queueing, no deadline).
        slo_itl_ms: default ITL objective, likewise.
        max_queue: most requests waiting per model; 0: reject what the gate refuses.
        queue_timeout: seconds a request may wait in the queue.
        prefix_key_chars: characters of the prompt that make the prefix key.
        hold_s: seconds a request for a served model with no ready replica waits for one
            (scale from zero) before 503, unless its InferenceService sets its own; 0: none.
        max_slo_ms: the loosest objective an ``x-slo-*`` header may ask for (400 beyond): a
            looser one would pass the admission gate whatever the load.
        public_priority: the most urgent (lowest) priority a request may ask for unless its
            API-key tenant is allowed more (``sluice.router.tenants``); 403 beyond.
    """

    policy: str = DEFAULT_POLICY
    load_factor: float = DEFAULT_LOAD_FACTOR
    slo_ttft_ms: float | None = 2000.0
    slo_itl_ms: float | None = None
    max_queue: int = 256
    queue_timeout: float = 60.0
    prefix_key_chars: int = KEY_CHARS
    hold_s: float = 0.0
    max_slo_ms: float = 60_000.0
    public_priority: int = 0

    def __post_init__(self) -> None:
        if not (self.max_slo_ms > 0 and math.isfinite(self.max_slo_ms)):
            raise ValueError("max_slo_ms must be a number > 0")
        if abs(self.public_priority) > PRIORITY_LIMIT:
            raise ValueError(f"public_priority must be from {-PRIORITY_LIMIT} to "
                             f"{PRIORITY_LIMIT}")


def _positive_ms(value: Any, param: str, most: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadRoutingHeader(param, f"{param} must be a number of milliseconds") from None
    if not (0 < number <= most):  # NaN fails too
        raise BadRoutingHeader(param, f"{param} must be > 0 and at most {most:g} "
                               "(the router's --max-slo-ms)")
    return number


def _priority(value: Any, param: str) -> int:
    """An integer priority in [-PRIORITY_LIMIT, PRIORITY_LIMIT]: a header's text (ASCII
    digits with an optional sign: not ``int()``'s ``1_000`` or other scripts' digits), or a
    JSON integer (or integral number)."""
    number: Any = None
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"[+-]?[0-9]{1,6}", text):
            number = int(text)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        number = int(value)
    if number is None or abs(number) > PRIORITY_LIMIT:
        raise BadRoutingHeader(param, f"{param} must be an integer from {-PRIORITY_LIMIT} to "
                               f"{PRIORITY_LIMIT}")
    return number


NO_SETTINGS = ModelSettings()  # a model no InferenceService declares (frozen: shared)


class Dispatcher:
    """Admission, policy and latency models of one router (created in its lifespan).

    Args:
        endpoints: the router's endpoint set (read; its per-endpoint models are fitted).
        settings: see ``DispatchSettings``.
        metrics: the router's metrics (queue, rejections, predictor error).
        clock: the time every decision reads, seconds: ``time.monotonic`` in the router, a
            virtual clock in a simulator. Arrivals, deadlines and load-report times passed
            in must be on the same clock.
    """

    def __init__(self, endpoints: EndpointSet, settings: DispatchSettings,
                 metrics: RouterMetrics, clock: Clock = time.monotonic):
        self.endpoints = endpoints
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.context = PolicyContext(PrefixIndex(), settings.load_factor, clock=clock)
        self.policy: RoutingPolicy = make_policy(settings.policy, self.context)
        # model → (its InferenceService's strategy and load factor, the policy made for them)
        self._policies: dict[str, tuple[tuple[str, float], RoutingPolicy]] = {}
        self.admission: AdmissionQueue[RoutingRequest] = AdmissionQueue(
            settings.max_queue, settings.queue_timeout, self._retry_after, self._queue_changed,
            clock)
        self.errors = ErrorTracker()
        metrics.mape.set_function(lambda: self.errors.mape)  # (read at scrape time)
        self.demand = Demand()  # what the autoscaler reads (GET /autoscale/demand)
        self.mean_ttft_s = 0.0  # EWMA of observed TTFTs (Retry-After estimates)
        # model → the request its queue last released, not leased yet, and when (clock): until
        # it is leased, the load the gate reads does not show it, so nothing else goes
        self._releasing: dict[str, tuple[RoutingRequest, float]] = {}

    # ------------------------------------------------------------------ the request's view

    def routing_request(self, body: Mapping[str, Any], headers: Mapping[str, str],
                        arrival: float, ceiling: int | None = None) -> RoutingRequest:
        """The routing view of a parsed request.

        Objectives: the ``x-slo-ttft-ms`` / ``x-slo-itl-ms`` headers (at most
        ``max_slo_ms``), else the model's InferenceService ``spec.slo``, else the router's
        defaults. Priority: ``x-priority``, else the body's ``priority`` (vLLM's field),
        else 0 (or ``ceiling`` when that is above 0); lower is served first.

        Args:
            ceiling: the most urgent priority the sender may ask for (its tenant's
                ``maxPriority``); None: ``public_priority``.

        Raises:
            BadRoutingHeader: a malformed or out-of-bounds header or priority (400), or a
                priority more urgent than ``ceiling`` (403).
        """
        model = body["model"]
        declared = self.endpoints.settings.get(model) or NO_SETTINGS
        declared_ttft, declared_itl = declared.ttft_ms, declared.itl_ms
        ttft_ms = headers.get(HEADER_TTFT)
        itl_ms = headers.get(HEADER_ITL)
        most = self.settings.max_slo_ms
        ttft = _positive_ms(ttft_ms, HEADER_TTFT, most) if ttft_ms is not None \
            else declared_ttft or self.settings.slo_ttft_ms
        itl = _positive_ms(itl_ms, HEADER_ITL, most) if itl_ms is not None \
            else declared_itl or self.settings.slo_itl_ms
        ceiling = self.settings.public_priority if ceiling is None else ceiling
        param = HEADER_PRIORITY if headers.get(HEADER_PRIORITY) is not None \
            else "priority" if body.get("priority") is not None else None
        if param is None:
            priority = max(0, ceiling)
        else:
            priority = _priority(headers[param] if param == HEADER_PRIORITY else body[param],
                                 param)
            if priority < ceiling:
                raise BadRoutingHeader(param, f"{param} {priority} is more urgent than this "
                                       f"client may ask for (at most {ceiling}; lower is more "
                                       "urgent): use an API key whose tenant allows it", 403)
        ttft_s = ttft / 1000.0 if ttft else None
        return RoutingRequest(
            model=model, stream=body.get("stream") is True, body=body,
            shape=shape(body, key_chars=self.settings.prefix_key_chars),
            ttft_slo_s=ttft_s, itl_slo_s=itl / 1000.0 if itl else None,
            deadline=arrival + ttft_s if ttft_s else None, priority=priority)

    # ------------------------------------------------------------------ admission

    def gate(self, request: RoutingRequest) -> bool:
        """True when ``request`` may be sent now (see the module docstring). The predictions
        it makes stay in ``request.predicted`` for the choice that follows it."""
        request.predicted.by_url = {}  # a new look: earlier predictions are stale
        now = self.clock()
        held = self._releasing.get(request.model)
        if held is not None:
            if now - held[1] < RELEASE_HOLD_S:
                return False
            del self._releasing[request.model]  # it never settled: stop waiting for it
        if request.deadline is None:  # no objective (gate_open's first test, without
            return True                 # listing the fleet)
        candidates = self.endpoints.ready_for(request.model)
        if len(candidates) > SHORTLIST and not any(e.prefill_idle(now) for e in candidates):
            # every worker is busy: the predictions are made for a shortlist, not the fleet
            candidates = shortlist(candidates, request, self.context.prefix_index,
                                   self.context.rng)
        is_open, predictions = gate_open(candidates, request, self.context.prefix_index, now,
                                         self.context.fleet)
        if predictions is not None:
            request.predicted.by_url = {e.url: p for e, p in zip(candidates, predictions)}
        return is_open

    def admit_now(self, request: RoutingRequest) -> bool:
        """True when ``request`` may go at once (nobody queued, the gate open)."""
        if self.admission.admit_now(request.model, request, self.gate):
            self.metrics.queue_wait.observe(0.0)
            return True
        return False

    async def admit(self, request: RoutingRequest) -> bool:
        """Wait until ``request`` may be sent. True when it waited in the queue: then the
        caller must call ``settled(request)`` once, when it is leased to an endpoint or
        given up.

        Raises:
            Rejected: its model's queue is full (or it waited too long).
        """
        waited = await self.admission.admit(
            request.model, request, request.priority,
            request.deadline if request.deadline is not None else math.inf, self.gate)
        self.metrics.queue_wait.observe(waited)
        return waited > 0

    def settled(self, request: RoutingRequest) -> None:
        """``request``, released from its model's queue, was leased (or gave up): the gate
        sees its load now, so the queue may release the next one. Only ``request``'s own
        hold is cleared (a later release's hold stays until that request settles)."""
        held = self._releasing.get(request.model)
        if held is not None and held[0] is request:
            del self._releasing[request.model]
            self.kick(request.model)

    def kick(self, model: str) -> None:
        """Release the head of ``model``'s queue if the gate lets it through; it then holds
        the gate (for at most ``RELEASE_HOLD_S``) until it settles."""
        released = self.admission.kick(model, self.gate)
        if released is not None:
            self._releasing[model] = (released, self.clock())

    def tick(self) -> None:
        """Re-check every queue and held request (after a poll: workers may have turned
        ready)."""
        self.admission.kick_all(lambda model: self.gate)
        self.demand.wake()

    async def hold(self, model: str) -> bool:
        """Wait for a ready replica of ``model`` (scale from zero) up to its hold time;
        True when one is ready. No hold configured: False at once."""
        declared = self.endpoints.settings.get(model)
        hold_s = declared.hold_s if declared is not None and declared.hold_s else \
            self.settings.hold_s
        if hold_s <= 0:
            return self.endpoints.any_ready_for(model)
        return await self.demand.hold(model, lambda: self.endpoints.any_ready_for(model),
                                      hold_s)

    def demand_snapshot(self) -> dict[str, dict[str, int]]:
        """Per model: the demand counters and gauges, with ``queued`` (admission) added."""
        snapshot = self.demand.snapshot()
        for model in self.admission.models():
            snapshot.setdefault(model, {})
        for model, entry in snapshot.items():
            entry["queued"] = self.admission.waiting(model)
        return snapshot

    def _queue_changed(self, model: str, waiting: int, rejected: str | None) -> None:
        self.metrics.queue_length.labels(model).set(max(0, waiting))
        if rejected is not None:
            self.metrics.rejected.labels(model, rejected).inc()

    def no_worker_retry_after(self, model: str) -> int:
        """``Retry-After`` (whole seconds, ≥ 1) of a 503 for ``model`` with no ready replica:
        until its booting replica is expected ready (``EndpointSet.ready_in_s``); with none
        listed yet (a hold shorter than the autoscaler's tick), a whole boot
        (``EndpointSet.boot_s``); else ``NO_WORKER_RETRY_AFTER_S``."""
        soon = self.endpoints.ready_in_s(model, self.clock())
        if soon is None:
            soon = self.endpoints.boot_s
        return NO_WORKER_RETRY_AFTER_S if soon is None else \
            min(MAX_RETRY_AFTER_S, max(1, math.ceil(soon)))

    def _retry_after(self, model: str) -> float:
        """Seconds until the queue has likely drained: waiting × mean TTFT / ready replicas."""
        ready = max(1, len(self.endpoints.ready_for(model)))
        return (self.admission.waiting(model) + 1) * max(self.mean_ttft_s, 0.1) / ready

    # ------------------------------------------------------------------ the choice

    async def choose(self, candidates: Sequence[Endpoint],
                     request: RoutingRequest) -> tuple[Endpoint, Prediction]:
        """The policy's pick, and the prediction for it (the features its TTFT model will be
        fitted on when the first token comes): the one the policy or the gate made in this
        attempt (``Predicted``), else made now; a retry elsewhere predicts afresh."""
        endpoint = await self.policy_for(request.model).choose(candidates, request)
        prediction = request.predicted.take(endpoint) or predict_all(
            [endpoint], request, self.context.prefix_index, self.clock(), self.context.fleet)[0]
        return endpoint, prediction

    def policy_for(self, model: str) -> RoutingPolicy:
        """The policy its InferenceService names (``spec.routing``), else ``--policy``.
        Policies made for a service share the router's prefix index and fleet models."""
        declared = self.endpoints.settings.get(model)
        if declared is None or declared.strategy not in POLICIES:
            self._policies.pop(model, None)
            return self.policy
        key = (declared.strategy, declared.load_factor or self.context.load_factor)
        cached = self._policies.get(model)
        if cached is None or cached[0] != key:
            if len(self._policies) >= 1024:  # models come and go with discovery: bounded
                self._policies.clear()
            context = dataclasses.replace(self.context, load_factor=max(1.0, key[1]))
            cached = self._policies[model] = (key, make_policy(key[0], context))
        return cached[1]

    def dispatched(self, endpoint: Endpoint, request: RoutingRequest) -> None:
        """``request`` was leased to ``endpoint``: remember its prefix there."""
        if request.shape.blocks:
            self.context.prefix_index.record(request.shape.blocks, endpoint.url)

    def first_token(self, endpoint: Endpoint, prediction: Prediction, ttft_s: float,
                    model: str) -> None:
        """The worker's first token came ``ttft_s`` after the request was sent there."""
        endpoint.latency.fit_ttft(prediction.features, ttft_s)
        self.context.fleet.fit_ttft(prediction.features, ttft_s)
        self.errors.observe(prediction.ttft_s, ttft_s)
        if math.isfinite(prediction.ttft_s):
            self.metrics.prediction_error.observe(abs(prediction.ttft_s - ttft_s))
        self.mean_ttft_s += EWMA_ALPHA * (ttft_s - self.mean_ttft_s)
        self.kick(model)

    def ttft_at_most(self, endpoint: Endpoint, prediction: Prediction, bound_s: float) -> None:
        """A plain answer of several tokens came ``bound_s`` seconds after it was sent: its
        first token came no later, at an unknown time. Below the prediction, the bound says
        the prediction was too high, so the TTFT models are fitted on it (a step toward the
        truth, which is lower still); above it, it says nothing. Either way it is no TTFT
        observation: the MAPE and the mean TTFT leave it out."""
        if bound_s < prediction.ttft_s:
            endpoint.latency.fit_ttft(prediction.features, bound_s)
            self.context.fleet.fit_ttft(prediction.features, bound_s)

    def finished(self, endpoint: Endpoint, prediction: Prediction, mean_gap_s: float | None,
                 model: str) -> None:
        """The exchange ended (any way); ``mean_gap_s``: its mean inter-token gap, if any."""
        if mean_gap_s is not None:
            running = prediction.features.running + 1
            endpoint.latency.fit_itl(running, mean_gap_s)
            self.context.fleet.fit_itl(running, mean_gap_s)
        self.kick(model)

