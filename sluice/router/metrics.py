"""The router's Prometheus metrics (names in ``sluice.api.metrics``), one registry per app.

Label values are bounded: ``model`` is only ever a model some worker serves (unknown names
count as ``""``), ``status`` an HTTP status, ``reason`` one of a fixed few, ``tenant`` a
tenant of the API key file (``sluice.router.tenants``), ``cascade`` and ``tier`` a declared
cascade and one of its tiers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

from sluice.api import metrics as names

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                      20.0, 40.0, 80.0)
ERROR_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SCORE_BUCKETS = (-10.0, -7.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.75, -0.5, -0.25,
                 -0.1, -0.05, 0.0)  # token log probabilities


MAX_CHILDREN = 1024  # cached per-model children (``RouterMetrics.of``)


class Buckets:
    """One histogram's counts as plain Python numbers: ``observe`` is a bisection and two
    additions. prometheus_client's ``Histogram.observe`` made four Python calls and took
    two locks, and the request path observes four histograms and counts one request: about
    4 % of the router's CPU a request. No lock is needed: the router's event loop is the
    only writer, and its scrapes run on that loop too.

    Args:
        bounds: the buckets' upper bounds, ascending, without +Inf.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # (a bound is its bucket's "le")
        self.sum += value


class HistogramFamily:
    """A histogram by label values, kept in ``Buckets`` and exported at scrape time through
    the registry (``collect``) in prometheus_client's own text format.

    Args:
        labelnames: the label names; none: one child, made now (as prometheus_client's).
        buckets: upper bounds, ascending (+Inf is implied).
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float], registry: CollectorRegistry):
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self.bounds = tuple(b for b in buckets if b != float("inf"))
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self._children: dict[tuple[str, ...], Buckets] = {}
        if not self.labelnames:
            self.labels()
        registry.register(self)

    def labels(self, *values: str) -> Buckets:
        """The child of these label values (made on first use)."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = Buckets(self.bounds)
        return child

    def observe(self, value: float) -> None:
        """Observe on the one child of an unlabelled histogram."""
        self._children[()].observe(value)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), list(zip(self._le, accumulate(child.counts))),
                              child.sum)
        yield family


@dataclass(frozen=True)
class ModelMetrics:
    """One model's children of the per-model histograms."""

    ttft: Buckets
    itl: Buckets
    e2e: Buckets


class RouterMetrics:
    """The router's metrics.

    The request path's histograms are ``HistogramFamily``s and its request count a plain
    dict (``count_request``), exported at scrape time (see ``Buckets`` for why); the
    others are prometheus_client's. It takes each model's histogram children from ``of``,
    resolved once a model (a bounded cache: cleared past ``MAX_CHILDREN``; label values are
    bounded anyway, see the module docstring).
    """

    def __init__(self) -> None:
        self._models: dict[str, ModelMetrics] = {}
        self.requests: dict[tuple[str, int], int] = {}  # (model, status) → requests
        self.registry = reg = CollectorRegistry()
        reg.register(self)  # (``collect``: the request counts)
        self.ttft = HistogramFamily(names.ROUTER_TTFT, "Seconds from request arrival (queueing "
                              "included) to the first token from the worker: a stream's first "
                              "chunk, a plain answer's x-sluice-ttft-ms (a Sluice worker's), "
                              "or a plain answer of one token per choice (another server's "
                              "longer plain answer's first token is not seen), by model.", ["model"],
                              names.TTFT_BUCKETS, reg)
        self.itl = HistogramFamily(names.ROUTER_ITL, "Seconds between streamed chunks from the "
                                   "worker, by model.", ["model"], names.ITL_BUCKETS, reg)
        self.e2e = HistogramFamily(names.ROUTER_E2E, "Seconds from request arrival to the end of "
                                   "the worker's response, by model.", ["model"],
                                   names.E2E_BUCKETS, reg)
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
        self.queue_wait = HistogramFamily(names.ROUTER_QUEUE_WAIT, "Seconds admitted requests "
                                          "waited in the router's queue.", [],
                                          QUEUE_WAIT_BUCKETS, reg)
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
        self.prediction_error = HistogramFamily(names.ROUTER_TTFT_PREDICTION_ERROR, "Absolute "
                                                "error of each TTFT prediction, seconds.", [],
                                                ERROR_BUCKETS, reg)
        self.cascade_requests = Counter(
            names.ROUTER_CASCADE_REQUESTS, "Cascade requests by the tier that answered, where "
            "they started (cascade, pre-route, header) and whether they escalated; the top "
            "tier's share is its count over the sum.", ["cascade", "tier", "start", "escalated"],
            registry=reg)
        self.cascade_escalations = Counter(
            names.ROUTER_CASCADE_ESCALATIONS, "Answers sent up from a tier, by reason "
            "(low-score, failed-examples, wrong-arithmetic, tier-error, context-length).", ["cascade", "tier", "reason"], registry=reg)
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

    def count_request(self, model: str, status: int) -> None:
        """One more answered request of ``model`` (``""``: none resolved) with ``status``."""
        key = (model, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        """The request counts (``requests``), for the registry."""
        family = CounterMetricFamily(names.ROUTER_REQUESTS, "Requests by served model and "
                                     "HTTP status.", labels=["model", "status"])
        for (model, status), count in list(self.requests.items()):
            family.add_metric([model, str(status)], count)
        yield family


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
