"""The autoscaler's Prometheus metrics (names in ``sluice.api.metrics``), per model.

One instance per driver (the operator, the ``sluice up`` supervisor); ``record`` is called
with every decision. Label values are bounded: ``model`` is a served model name the driver
manages, ``direction`` is up/down/none and ``reason`` one of ``policy.REASONS``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from sluice.api import metrics as names
from sluice.autoscale.policy import Decision


class AutoscalerMetrics:
    """Args:
        registry: where to register (a new one by default; serve it with
            ``prometheus_client.start_http_server(port, registry=...)``).
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = reg = registry or CollectorRegistry()
        self.desired = Gauge(names.AUTOSCALER_DESIRED, "Replicas the autoscaler wants.",
                             ["model"], registry=reg)
        self.ready = Gauge(names.AUTOSCALER_READY, "Replicas ready when it last decided.",
                           ["model"], registry=reg)
        self.decisions = Counter(names.AUTOSCALER_DECISIONS, "Decisions by direction (up, "
                                 "down, none) and reason.", ["model", "direction", "reason"],
                                 registry=reg)
        self.demand = Gauge(names.AUTOSCALER_DEMAND, "Arrival rate planned for (forecast + "
                            "backlog), requests/s.", ["model"], registry=reg)
        self.capacity = Gauge(names.AUTOSCALER_CAPACITY, "Estimated requests/s one replica "
                              "serves within the SLO.", ["model"], registry=reg)
        self.attainment = Gauge(names.AUTOSCALER_ATTAINMENT, "Fraction of the last window's "
                                "requests that met the SLO (TTFT and ITL).", ["model"],
                                registry=reg)

    def record(self, model: str, previous: int, decision: Decision, ready: int) -> None:
        """Record ``decision`` for ``model``, taken when ``previous`` replicas were desired."""
        direction = "up" if decision.replicas > previous else \
            "down" if decision.replicas < previous else "none"
        self.decisions.labels(model, direction, decision.reason).inc()
        self.desired.labels(model).set(decision.replicas)
        self.ready.labels(model).set(ready)
        self.demand.labels(model).set(decision.demand_rps)
        self.capacity.labels(model).set(decision.capacity_rps)
        if decision.attainment is not None:
            self.attainment.labels(model).set(decision.attainment)
