"""The Kubernetes driver of the SLO autoscaler: routers' demand → the pure policy →
``spec.replicas`` through the scale subresource.

Every ``--autoscale-interval`` seconds (a background task of the operator, never a kopf
handler), for each InferenceService with ``spec.autoscaling.enabled`` (and no ``Conflict``:
the router sends an InferenceService that reuses an older one's served name no traffic; and
no ``spec.cascade``: a cascade has no workers, its tiers are scaled each on its own):

    routers   GET /autoscale/demand of every router pod (routers.Routers), once per
              namespace; a router that does not answer is left out of the window
    observe   sluice.autoscale.observe: the sum over routers of each one's counter
              increases since the last tick, and of their gauges (held, queued, in flight);
              ready = the worker Deployment's readyReplicas, starting = spec.replicas − ready
    decide    sluice.autoscale.policy.recommend with the State kept here per object
    act       when the decision differs from spec.replicas: PATCH .../NAME/scale (field
              manager sluice-autoscaler), a ScaledUp/ScaledDown Event with the reason and
              figures, and status desiredReplicas, lastScaleTime, lastScaleReason,
              sloAttainment (through Controller.record); the kopf update handler then moves
              the Deployment (scale-down through the drainer)

Exactly one writer: the operator runs alone (kopf standalone, one replica), and with
autoscaling off nothing here touches spec.replicas (kubectl scale, an HPA or KEDA own it);
with it on, a spec.replicas written by someone else is overwritten at the next tick
(reason ``override``; ``bounds`` when it lies outside min/maxReplicas). State lives in
memory: after a restart the first tick only takes a baseline of the routers' counters and
starts ``State.initial`` from the current spec.replicas, which the policy keeps for a whole
scale-down window — nothing drops.
No router answering means no decision (and one NoRouter warning Event), not a scale-down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sluice.api.service import served_model, served_name_owners, served_names
from sluice.autoscale.metrics import AutoscalerMetrics
from sluice.autoscale.observe import Snapshot, observe
from sluice.autoscale.policy import Config, Decision, Observation, State, recommend
from sluice.operator import events, resources
from sluice.operator.controller import Controller, utc_now
from sluice.operator.kube import ApiError, KubeApi
from sluice.operator.resources import InvalidSpec
from sluice.operator.routers import Routers

logger = logging.getLogger(__name__)

Key = tuple[str, str]


@dataclass
class _Tracked:
    """What the driver keeps per InferenceService between ticks."""

    state: State
    snapshots: dict[str, Snapshot]
    seen_at: float


def autoscaled(body: Mapping[str, Any]) -> bool:
    """``spec.autoscaling.enabled`` is true, the object is not being deleted, and it is no
    cascade (which has no workers to scale)."""
    if (body.get("metadata") or {}).get("deletionTimestamp") or resources.is_cascade(body):
        return False
    return ((body.get("spec") or {}).get("autoscaling") or {}).get("enabled") is True


class Autoscaler:
    """Args:
        kube: the API.
        controller: writes status fields under its per-object lock (``record``).
        routers: where demand comes from.
        metrics: where decisions are recorded (a new registry by default).
        clock: monotonic seconds (the policy's clock); wall: RFC 3339 now.
    """

    def __init__(self, kube: KubeApi, controller: Controller, routers: Routers,
                 metrics: AutoscalerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], str] = utc_now):
        self.kube, self.controller, self.routers = kube, controller, routers
        self.metrics = metrics or AutoscalerMetrics()
        self._clock, self._wall = clock, wall
        self._tracked: dict[Key, _Tracked] = {}
        self._routerless: set[Key] = set()  # warned: no router answered

    def state(self, namespace: str, name: str) -> State | None:
        tracked = self._tracked.get((namespace, name))
        return tracked.state if tracked else None

    async def tick(self, namespaces: list[str | None]) -> None:
        """One round over every autoscaled InferenceService of these namespaces (None:
        all). API errors about one object are logged; the next tick tries again."""
        bodies: list[Mapping[str, Any]] = []
        for listed_namespace in namespaces:
            listed: dict[str, list[Mapping[str, Any]]] = {}
            for body in await self.kube.list_isvcs(listed_namespace):
                listed.setdefault(_key(body)[0], []).append(body)
            for group in listed.values():  # one with a Conflict gets no traffic
                owners = served_name_owners(served_names(group))
                bodies += [b for b in group if autoscaled(b)
                           and owners.get(served_model(b) or "") == _key(b)[1]]
        keys = {_key(b) for b in bodies}
        for key in [k for k in self._tracked if k not in keys]:
            del self._tracked[key]  # deleted, or autoscaling turned off: start anew later
        self._routerless &= keys
        by_namespace: dict[str, list[Mapping[str, Any]]] = {}
        for body in bodies:
            by_namespace.setdefault(self.routers.namespace_for(_key(body)[0]), []).append(body)
        for router_namespace, group in sorted(by_namespace.items()):
            snapshots = await self.routers.demand(router_namespace)
            now = self._clock()
            for body in group:
                try:
                    await self.decide(body, snapshots, now, router_namespace)
                except ApiError as exc:
                    logger.warning("autoscaling %s/%s: %s", *_key(body), exc)

    async def decide(self, body: Mapping[str, Any], snapshots: dict[str, Snapshot], now: float,
                     router_namespace: str) -> Decision | None:
        """Observe, decide and act for one InferenceService; the decision, or None when
        there was nothing to decide (first look, no router, invalid spec, no Deployment)."""
        key = _key(body)
        try:
            service = resources.parse_service(body)
            config = Config.from_spec(service.spec)
        except (InvalidSpec, ValueError):  # the controller reports it as InvalidSpec
            self._tracked.pop(key, None)
            return None
        deployment = await self.kube.get_deployment(key[0], resources.worker_name(key[1]))
        if deployment is None:
            return None
        replicas = service.spec.replicas
        ready = int(((deployment.get("status") or {}).get("readyReplicas")) or 0)
        tracked = self._tracked.get(key)
        if not snapshots:
            await self._no_router(body, router_namespace, replicas)
            return None
        if key in self._routerless:
            self._routerless.discard(key)
            logger.info("%s/%s: routers answer again", *key)
        if tracked is None:  # a baseline of the counters; keep what exists for a window
            start = min(max(replicas, config.min_replicas), config.max_replicas)
            self._tracked[key] = _Tracked(State.initial(start, config, now), snapshots, now)
            logger.info("%s/%s: autoscaling from %d replica(s) within [%d, %d]", *key, start,
                        config.min_replicas, config.max_replicas)
            return None
        window = now - tracked.seen_at
        if window <= 0:
            return None
        obs = observe(service.spec.model.name, tracked.snapshots, snapshots, window, ready,
                      max(0, replicas - ready))
        tracked.snapshots, tracked.seen_at = snapshots, now
        previous = tracked.state.replicas
        decision = recommend(obs, tracked.state, config, now)
        tracked.state = decision.state
        attainment = decision.attainment  # recent, decayed over the policy's ATTAINMENT_TAU_S
        self.metrics.record(service.spec.model.name, previous, decision, ready)
        if decision.replicas != replicas:
            await self._scale(body, replicas, decision, obs, attainment,
                              config.min_replicas <= replicas <= config.max_replicas)
        else:
            await self._record_quietly(body, decision.replicas, attainment)
        return decision

    async def _scale(self, body: Mapping[str, Any], replicas: int, decision: Decision,
                     obs: Observation, attainment: float | None, within_bounds: bool) -> None:
        """Write the decision's count; a count the policy kept while spec.replicas moved is
        ``bounds`` when spec.replicas lies outside [minReplicas, maxReplicas] (the bounds
        were edited, or it was set past them), ``override`` when someone else wrote it."""
        namespace, name = _key(body)
        if not await self.kube.scale_isvc(namespace, name, decision.replicas):
            return  # gone
        reason = decision.reason
        if reason in ("steady", "stabilizing"):
            reason = "override" if within_bounds else "bounds"
        figures = describe(decision, obs, reason)
        now = self._wall()
        logger.info("%s/%s: spec.replicas %d → %d (%s)", namespace, name, replicas,
                    decision.replicas, figures)
        await events.post(self.kube, body, "ScaledUp" if decision.replicas > replicas
                          else "ScaledDown", f"spec.replicas {replicas} → {decision.replicas}: "
                          f"{figures}", now)
        fields: dict[str, Any] = {"desiredReplicas": decision.replicas, "lastScaleTime": now,
                                  "lastScaleReason": figures}
        if attainment is not None:
            fields["sloAttainment"] = round(attainment, 3)
        await self.controller.record(namespace, name, fields)

    async def _record_quietly(self, body: Mapping[str, Any], desired: int,
                              attainment: float | None) -> None:
        """Status without a scale: only when desiredReplicas or the attainment (to 0.01)
        changed, so a steady service is not rewritten every tick."""
        status = body.get("status") or {}
        fields: dict[str, Any] = {}
        if status.get("desiredReplicas") != desired:
            fields["desiredReplicas"] = desired
        old = status.get("sloAttainment")
        if attainment is not None and (not isinstance(old, int | float)
                                       or abs(old - attainment) >= 0.01):
            fields["sloAttainment"] = round(attainment, 3)
        if fields:
            await self.controller.record(*_key(body), fields)

    async def _no_router(self, body: Mapping[str, Any], router_namespace: str,
                         replicas: int) -> None:
        if _key(body) in self._routerless:
            return
        self._routerless.add(_key(body))
        message = (f"no router pod ({self.routers.selector}) in namespace {router_namespace} "
                   f"answered GET /autoscale/demand; spec.replicas stays {replicas} until one "
                   "does")
        logger.warning("%s/%s: %s", *_key(body), message)
        await events.post(self.kube, body, "NoRouter", message, self._wall(), "Warning")


def describe(decision: Decision, obs: Observation, reason: str) -> str:
    """The reason and the figures behind a decision, for Events and status."""
    attainment = f"{decision.attainment:.0%}" if decision.attainment is not None else "n/a"
    return (f"{reason} (demand {decision.demand_rps:.2f} req/s for "
            f"{decision.capacity_rps:.2f} req/s per replica; {obs.arrivals} arrived in "
            f"{obs.window_s:.0f} s, {obs.queued} queued, {obs.held} held, {obs.in_flight} in "
            f"flight, {obs.rejected} refused; {obs.ready} ready; SLO attainment {attainment})")


def _key(body: Mapping[str, Any]) -> Key:
    meta = body["metadata"]
    return meta["namespace"], meta["name"]
