"""The router's Prometheus metrics (names in ``sluice.api.metrics``), one registry per app.

Label values are bounded: ``model`` is only ever a model some worker serves (unknown names
count as ``""``), ``status`` an HTTP status, ``reason`` one of a fixed few, ``tenant`` a
tenant of the API key file (``sluice.router.tenants``), ``cascade`` and ``tier`` a declared
cascade and one of its tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sluice.api import metrics as names

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                      20.0, 40.0, 80.0)
ERROR_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SCORE_BUCKETS = (-10.0, -7.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.75, -0.5, -0.25,
                 -0.1, -0.05, 0.0)  # token log probabilities


MAX_CHILDREN = 1024  # cached label children (``RouterMetrics.of``, ``request_counter``)


@dataclass(frozen=True)
class ModelMetrics:
    """One model's children of the per-model histograms."""

    ttft: Any
    itl: Any
    e2e: Any


class RouterMetrics:
    """The router's metrics.

    The proxy path takes its labelled children from ``of`` and ``request_counter``, which
    resolve each label set once (``labels()`` takes a lock and builds its key on every call,
    several times per request). Both caches are bounded (cleared past ``MAX_CHILDREN``;
    label values are bounded anyway, see the module docstring) and never hold a child
    that the registry has dropped: the router removes no label sets.
    """

    def __init__(self) -> None:
        self._models: dict[str, ModelMetrics] = {}
        self._requests: dict[tuple[str, int], Any] = {}
        self.registry = reg = CollectorRegistry()
        self.requests = Counter(names.ROUTER_REQUESTS, "Requests by served model and HTTP status.",
                                ["model", "status"], registry=reg)
        self.ttft = Histogram(names.ROUTER_TTFT, "Seconds from request arrival (queueing "
                              "included) to the first token from the worker: a stream's first "
                              "chunk, a plain answer's x-sluice-ttft-ms (a Sluice worker's), "
                              "or a plain answer of one token per choice (another server's "
                              "longer plain answer's first token is not seen), by model.", ["model"],
                              buckets=names.TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(names.ROUTER_ITL, "Seconds between streamed chunks from the worker, "
                             "by model.", ["model"], buckets=names.ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(names.ROUTER_E2E, "Seconds from request arrival to the end of the "
                             "worker's response, by model.", ["model"], buckets=names.E2E_BUCKETS,
                             registry=reg)
        # The two gauges set on every request are read at scrape time instead: a
        # Gauge.inc/dec/set is four Python calls and a lock.
        self.in_flight_requests = 0  # (``Exchange`` counts them)
        self.in_flight = Gauge(names.ROUTER_IN_FLIGHT, "Requests being served by a worker.",
                               registry=reg)
        self.in_flight.set_function(lambda: self.in_flight_requests)
        self.queue_length = Gauge(names.ROUTER_QUEUE_LENGTH, "Requests waiting in the router's "
                                  "admission queue, by model.", ["model"], registry=reg)
        self.rejected = Counter(names.ROUTER_REJECTED, "Requests answered 429 by admission "
                                "control, by model and reason (queue_full, queue_timeout).",
                                ["model", "reason"], registry=reg)
        self.queue_wait = Histogram(names.ROUTER_QUEUE_WAIT, "Seconds admitted requests waited "
                                    "in the router's queue.", buckets=QUEUE_WAIT_BUCKETS,
                                    registry=reg)
        self.retries = Counter(names.ROUTER_RETRIES, "Requests sent to a second worker after the "
                               "first died before answering.", registry=reg)
        self.broken_streams = Counter(names.ROUTER_BROKEN_STREAMS, "Answers cut after their "
                                      "200 headers (the worker's stream broke or stalled past "
                                      "--read-timeout): the client got an error event and "
                                      "[DONE], and requests_total counted a 200; by model and "
                                      "reason (broken, timeout).", ["model", "reason"],
                                      registry=reg)
        self.ejections = Counter(names.ROUTER_EJECTIONS, "Workers taken out of routing until a "
                                 "health poll finds them well, by reason (unreachable, "
                                 "unhealthy, timeout, broken, refused); their unanswered "
                                 "requests go elsewhere.", ["reason"], registry=reg)
        self.mape = Gauge(names.ROUTER_TTFT_PREDICTION_MAPE, "Mean absolute percentage error of "
                          "the TTFT predictor over its last 500 predictions (0.2 = 20 %).",
                          registry=reg)  # (its function is the dispatcher's, ``Dispatcher``)
        self.prediction_error = Histogram(names.ROUTER_TTFT_PREDICTION_ERROR, "Absolute error "
                                          "of each TTFT prediction, seconds.",
                                          buckets=ERROR_BUCKETS, registry=reg)
        self.cascade_requests = Counter(
            names.ROUTER_CASCADE_REQUESTS, "Cascade requests by the tier that answered, where "
            "they started (cascade, pre-route, header) and whether they escalated; the top "
            "tier's share is its count over the sum.", ["cascade", "tier", "start", "escalated"],
            registry=reg)
        self.cascade_escalations = Counter(
            names.ROUTER_CASCADE_ESCALATIONS, "Answers sent up from a tier, by reason "
            "(low-score, failed-examples, wrong-arithmetic, tier-error).", ["cascade", "tier", "reason"], registry=reg)
        self.cascade_score = Histogram(
            names.ROUTER_CASCADE_SCORE, "Scores of judged answers (the escalation signal, a "
            "log probability; an answer a check proved wrong has none).", ["cascade", "tier"], buckets=SCORE_BUCKETS, registry=reg)
        self.cascade_wasted_tokens = Counter(
            names.ROUTER_CASCADE_WASTED_TOKENS, "Tokens a tier generated for answers that "
            "escalated (never sent).", ["cascade", "tier"], registry=reg)
        self.cascade_wasted_cost = Counter(
            names.ROUTER_CASCADE_WASTED_COST, "Those tokens priced at their tier's relative "
            "cost (spec.cascade.costs).", ["cascade", "tier"], registry=reg)


    def of(self, model: str) -> ModelMetrics:
        """``model``'s children of ``ttft``, ``itl`` and ``e2e``."""
        children = self._models.get(model)
        if children is None:
            if len(self._models) >= MAX_CHILDREN:
                self._models.clear()
            children = self._models[model] = ModelMetrics(
                self.ttft.labels(model), self.itl.labels(model), self.e2e.labels(model))
        return children

    def request_counter(self, model: str, status: int) -> Any:
        """The ``requests`` child of (``model``, ``status``)."""
        child = self._requests.get((model, status))
        if child is None:
            if len(self._requests) >= MAX_CHILDREN:
                self._requests.clear()
            child = self._requests[(model, status)] = self.requests.labels(model, str(status))
        return child


class DemandCollector:
    """Exports the dispatcher's demand snapshot (``Dispatcher.demand_snapshot``) at scrape
    time: arrivals, held requests and SLO attainment counts per model."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Mapping[str, int]]]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        arrivals = CounterMetricFamily(names.ROUTER_ARRIVALS, "Requests that reached "
                                       "admission (admitted, queued, held or refused), by "
                                       "model.", labels=["model"])
        held = GaugeMetricFamily(names.ROUTER_HELD, "Requests held now because no replica "
                                 "of their model is ready (scale from zero).", labels=["model"])
        requests = CounterMetricFamily(names.ROUTER_SLO_REQUESTS, "Requests with an objective "
                                       "whose first token the router saw (streams; plain answers "
                                       "with x-sluice-ttft-ms or of one token per choice), by "
                                       "model and objective (ttft, itl).",
                                       labels=["model", "objective"])
        met = CounterMetricFamily(names.ROUTER_SLO_MET, "Of those, the ones that met it.",
                                  labels=["model", "objective"])
        for model, entry in self.snapshot().items():
            arrivals.add_metric([model], entry.get("arrivals", 0))
            held.add_metric([model], entry.get("held", 0))
            for objective in ("ttft", "itl"):
                requests.add_metric([model, objective], entry.get(f"{objective}_total", 0))
                met.add_metric([model, objective], entry.get(f"{objective}_met", 0))
        yield from (arrivals, held, requests, met)
