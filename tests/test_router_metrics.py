"""The router's request-path metrics (sluice.router.metrics): kept in plain numbers, and
exported in exactly prometheus_client's text format."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from sluice.api import metrics as names
from sluice.router.metrics import HistogramFamily, RouterMetrics

VALUES = (0.0, 0.001, 0.0011, 0.5, 3.0, 59.9, 1e9)  # on a bound, between, past the last


def _lines(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]  # (prometheus_client's own adds creation times)


def test_a_histogram_family_exposes_what_prometheus_client_histogram_does():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h_seconds", "doc", ["model"], buckets=names.TTFT_BUCKETS,
                          registry=theirs)
    family = HistogramFamily("h_seconds", "doc", ["model"], names.TTFT_BUCKETS, ours)
    for value in VALUES:
        reference.labels("m").observe(value)
        family.labels("m").observe(value)
    reference.labels("other").observe(0.2)
    family.labels("other").observe(0.2)
    assert _lines(ours) == _lines(theirs)
    assert ours.get_sample_value("h_seconds_bucket", {"model": "m", "le": "0.001"}) == 2.0  # 0 and 0.001
    assert ours.get_sample_value("h_seconds_count", {"model": "m"}) == len(VALUES)


def test_an_unlabelled_family_is_exposed_at_zero_before_any_observation():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    Histogram("w_seconds", "doc", buckets=(0.1, 1.0), registry=theirs)
    family = HistogramFamily("w_seconds", "doc", [], (0.1, 1.0), ours)
    assert _lines(ours) == _lines(theirs)
    family.observe(0.5)
    assert ours.get_sample_value("w_seconds_bucket", {"le": "1.0"}) == 1.0


def test_request_counts_are_exposed_as_prometheus_client_counter_does():
    theirs = CollectorRegistry()
    reference = Counter(names.ROUTER_REQUESTS, "Requests by served model and HTTP status.",
                        ["model", "status"], registry=theirs)
    metrics = RouterMetrics()
    for model, status in (("", 431), ("m", 200), ("", 431)):
        reference.labels(model, str(status)).inc()
        metrics.count_request(model, status)
    ours = [line for line in _lines(metrics.registry) if "router_requests_total" in line]
    assert ours == [line for line in _lines(theirs)]
    assert metrics.registry.get_sample_value(
        names.ROUTER_REQUESTS, {"model": "", "status": "431"}) == 2.0
