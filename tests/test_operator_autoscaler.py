"""The operator's autoscaler loop against a fake API and fake routers (real Routers, real
policy, real observe; the routers and workers answer through httpx.MockTransport).

The real-cluster proof is e2e/test_autoscaling.py; these pin the driver's decisions: two
routers' demand is summed, a router that does not answer is tolerated, spec.replicas is
written through the scale subresource only with autoscaling enabled, each scale is an Event
and status, a restart keeps the replicas, someone else's spec.replicas is overwritten.
"""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest

from sluice.autoscale.metrics import AutoscalerMetrics
from sluice.operator.autoscaler import Autoscaler, autoscaled
from sluice.operator.controller import Controller
from sluice.operator.drain import Drainer
from sluice.operator.resources import OperatorConfig
from sluice.operator.routers import Routers, WorkerView
from test_operator_controller import FakeKube
from test_operator_resources import deployment_status, isvc

NOW = "2026-11-29T10:00:00Z"
MODEL = "smol-chat"
ROUTER_LABELS = {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/component": "router"}
INTERVAL = 5.0


def autoscaled_isvc(replicas=1, enabled=True, **autoscaling) -> dict:
    scaling = {"enabled": enabled, "capacityRPS": 1.0, "bootSeconds": 10,
               "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 30,
               "drainSeconds": 30, **autoscaling}
    body = isvc(replicas=replicas, minReplicas=0 if scaling.get("scaleToZero") else 1,
                maxReplicas=3, autoscaling=scaling, slo={"ttftMs": 1000})
    body["spec"]["model"]["name"] = MODEL
    return body


def router_pod(name: str, ip: str, namespace="team-a", port=8000, phase="Running") -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "labels": dict(ROUTER_LABELS)},
            "spec": {"containers": [{"name": "router",
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": phase, "podIP": ip}}


def worker_pod(name: str, ip: str, ready=True, created="2026-11-29T09:00:00Z") -> dict:
    return {"metadata": {"name": name, "namespace": "team-a", "creationTimestamp": created,
                         "labels": {"app.kubernetes.io/name": "sluice-worker",
                                    "app.kubernetes.io/instance": "smol"}},
            "status": {"phase": "Running", "podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


class FakeNet:
    """Routers and workers by IP, answering over httpx.MockTransport.

    routers[ip]: {"models": {MODEL: counters and gauges}, "workers": [health entries]}
    (None: that router does not answer); workers[ip]: {"running", "waiting", "draining"}.
    """

    def __init__(self):
        self.routers: dict[str, dict | None] = {}
        self.workers: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.on_drain = lambda ip: None  # the kubelet's reaction to a draining worker

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    def handle(self, request: httpx.Request) -> httpx.Response:
        ip, path = request.url.host, request.url.path
        self.calls.append((request.method, f"{ip}{path}"))
        if ip in self.routers:
            router = self.routers[ip]
            if router is None:
                raise httpx.ConnectError("connection refused", request=request)
            if path == "/autoscale/demand":
                return httpx.Response(200, json={"models": copy.deepcopy(router["models"])})
            if path == "/health":
                workers = router.get("workers", [])
                return httpx.Response(200 if workers else 503, json={"workers": workers})
        if ip in self.workers and path == "/drain":
            worker = self.workers[ip]
            if request.method == "DELETE":
                worker["draining"] = False
                return httpx.Response(200, json={"status": "serving"})
            if not worker.get("draining"):
                worker["draining"] = True
                self.on_drain(ip)
            return httpx.Response(200, json={"status": "draining",
                                             "running": worker.get("running", 0),
                                             "waiting": worker.get("waiting", 0)})
        return httpx.Response(404)

    def demand(self, ip: str, **values: int) -> None:
        """Set (cumulative) counters and gauges of MODEL at router ``ip``."""
        self.routers[ip]["models"].setdefault(MODEL, {}).update(values)

    def add(self, ip: str, **values: int) -> None:
        """Add to counters of MODEL at router ``ip``."""
        entry = self.routers[ip]["models"].setdefault(MODEL, {})
        for key, value in values.items():
            entry[key] = entry.get(key, 0) + value


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class World:
    """A FakeKube with one InferenceService, its Deployment, two routers, and the
    controller and autoscaler the operator would build."""

    def __init__(self, body: dict, ready: int | None = None):
        self.kube = FakeKube(body)
        replicas = body["spec"]["replicas"]
        self.kube.deployments[("team-a", "smol-worker")] = {
            "spec": {"replicas": replicas},
            **deployment_status(replicas=replicas, ready=replicas if ready is None else ready)}
        self.net = FakeNet()
        for name, ip in (("router-a", "10.9.0.1"), ("router-b", "10.9.0.2")):
            self.kube.pods.append(router_pod(name, ip))
            self.net.routers[ip] = {"models": {}, "workers": []}
        self.clock = Clock()
        self.http = self.net.client()
        self.routers = Routers(self.kube, http=self.http)
        self.drainer = Drainer(self.kube, self.routers, http=self.http, poll_s=0,
                               clock=self.clock, wall=lambda: NOW)
        self.controller = Controller(self.kube, OperatorConfig(), probe=False,
                                     clock=lambda: NOW, drainer=self.drainer)
        self.metrics = AutoscalerMetrics()
        self.autoscaler = self.restart()

    def restart(self) -> Autoscaler:
        """A fresh autoscaler: what an operator restart leaves (nothing in memory)."""
        self.autoscaler = Autoscaler(self.kube, self.controller, self.routers, self.metrics,
                                     clock=self.clock, wall=lambda: NOW)
        return self.autoscaler

    def tick(self, seconds: float = INTERVAL) -> None:
        self.clock.now += seconds
        asyncio.run(self.autoscaler.tick(["team-a"]))

    @property
    def body(self) -> dict:
        return self.kube.isvcs[("team-a", "smol")]

    @property
    def replicas(self) -> int:
        return self.body["spec"]["replicas"]

    def status(self) -> dict:
        return self.body.get("status") or {}

    def metric(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"model": MODEL, **labels})


def burst(world: World, per_router: int = 10, queued: int = 3) -> None:
    """One interval of heavy demand at both routers."""
    for ip in ("10.9.0.1", "10.9.0.2"):
        world.net.add(ip, arrivals=per_router, ttft_total=per_router, ttft_met=per_router // 2)
        world.net.demand(ip, queued=queued, in_flight=2)


def quiet(world: World) -> None:
    for ip in ("10.9.0.1", "10.9.0.2"):
        world.net.demand(ip, queued=0, in_flight=0, held=0)


# ------------------------------------------------------------------ routers

def test_routers_are_found_by_label_and_a_silent_one_is_left_out():
    world = World(autoscaled_isvc())
    world.kube.pods.append(router_pod("router-c", "10.9.0.3", phase="Pending"))  # no answer due
    world.kube.pods.append({**router_pod("other", "10.9.0.4"),
                            "metadata": {"name": "other", "namespace": "team-a",
                                         "labels": {"app.kubernetes.io/name": "something"}}})
    world.net.demand("10.9.0.1", arrivals=4)
    world.net.routers["10.9.0.2"] = None  # refuses connections
    demand = asyncio.run(world.routers.demand("team-a"))
    assert demand == {"router-a": {MODEL: {"arrivals": 4}}}
    assert ("GET", "10.9.0.3/autoscale/demand") not in world.net.calls
    assert not any(call[1].startswith("10.9.0.4") for call in world.net.calls)


def test_router_port_comes_from_the_pod_and_workers_are_summed():
    kube = FakeKube()
    kube.pods = [router_pod("r1", "10.9.0.1", port=9000), router_pod("r2", "10.9.0.2")]
    net = FakeNet()
    net.routers["10.9.0.1"] = {"models": {}, "workers": [
        {"url": "http://10.1.0.5:8000", "ready": False, "in_flight": 2}]}
    net.routers["10.9.0.2"] = {"models": {}, "workers": [
        {"url": "http://10.1.0.5:8000", "ready": True, "in_flight": 1},
        {"url": "http://10.1.0.6:8000", "ready": True, "in_flight": 0}]}
    routers = Routers(kube, http=net.client())
    assert asyncio.run(routers.addresses("team-a")) == {"r1": "http://10.9.0.1:9000",
                                                       "r2": "http://10.9.0.2:8000"}
    views, answered = asyncio.run(routers.workers("team-a"))
    assert answered == 2
    assert views == {"http://10.1.0.5:8000": WorkerView(3, True),
                     "http://10.1.0.6:8000": WorkerView(0, True)}


# ------------------------------------------------------------------ decisions

def test_a_burst_at_two_routers_scales_up_through_the_scale_subresource():
    world = World(autoscaled_isvc())
    world.tick()  # first look: a baseline of each router's counters, no decision
    assert world.kube.isvc_scaled == [] and world.autoscaler.state("team-a", "smol")
    burst(world)
    world.tick()
    # 20 arrivals in 5 s at two routers (4 req/s) + 6 queued, 1 req/s per replica → max 3
    assert world.kube.isvc_scaled == [("smol", 3)]
    assert world.replicas == 3
    assert not world.kube.scaled  # the Deployment follows through the kopf update handler
    (event,) = world.kube.events
    assert event["reason"] == "ScaledUp" and event["type"] == "Normal"
    assert event["involvedObject"]["name"] == "smol" and event["involvedObject"]["uid"]
    assert event["message"].startswith("spec.replicas 1 → 3: bounds (demand ")
    assert "20 arrived in 5 s, 6 queued" in event["message"]
    status = world.status()
    assert status["desiredReplicas"] == 3 and status["lastScaleTime"] == NOW
    assert status["lastScaleReason"].startswith("bounds (demand ")
    assert status["sloAttainment"] == 0.5  # 10 of 20 first tokens within the objective
    assert world.metric("sluice_autoscaler_desired_replicas") == 3
    assert world.metric("sluice_autoscaler_decisions_total", direction="up",
                        reason="bounds") == 1


def test_a_service_in_conflict_is_not_scaled():
    """An InferenceService that reuses an older one's served name gets no traffic (the
    Conflict condition), so the demand for that name never scales it."""
    world = World(autoscaled_isvc())
    world.body["metadata"]["creationTimestamp"] = "2026-12-01T09:00:00Z"
    elder = autoscaled_isvc()
    elder["metadata"].update(name="elder", creationTimestamp="2026-11-30T10:00:00Z")
    world.kube.isvcs[("team-a", "elder")] = elder
    world.kube.deployments[("team-a", "elder-worker")] = copy.deepcopy(
        world.kube.deployments[("team-a", "smol-worker")])
    world.tick()
    burst(world)
    world.tick()
    assert world.autoscaler.state("team-a", "smol") is None
    assert [name for name, _ in world.kube.isvc_scaled] == ["elder"]


def test_demand_from_one_router_counts_as_much_as_from_two():
    world = World(autoscaled_isvc())
    world.tick()
    world.net.add("10.9.0.1", arrivals=10)  # 2 req/s, all at one router
    world.tick()
    assert world.replicas == 2


def test_a_router_that_stops_answering_is_tolerated():
    world = World(autoscaled_isvc())
    world.tick()
    world.net.routers["10.9.0.2"] = None
    world.net.add("10.9.0.1", arrivals=10)
    world.tick()
    assert world.replicas == 2


def test_no_router_no_decision_and_one_warning():
    world = World(autoscaled_isvc(replicas=2))
    world.kube.pods = []  # no router pod at all
    for _ in range(3):
        world.tick(60)
    assert world.kube.isvc_scaled == [] and world.replicas == 2
    (event,) = world.kube.events
    assert event["reason"] == "NoRouter" and event["type"] == "Warning"
    assert "spec.replicas stays 2" in event["message"]


def test_disabled_autoscaling_never_touches_spec_replicas():
    world = World(autoscaled_isvc(enabled=False))
    for _ in range(3):
        burst(world)
        world.tick()
    assert world.kube.isvc_scaled == [] and world.kube.events == []
    assert world.replicas == 1 and world.kube.status_writes == 0
    assert not autoscaled(world.body)
    assert not any(path.endswith("/autoscale/demand") for _, path in world.net.calls)


def test_a_cascade_is_never_scaled():
    """A cascade (spec.cascade, no model.source) has no workers: even with autoscaling on
    and demand for its name at the routers, the autoscaler leaves it alone."""
    body = autoscaled_isvc()
    body["spec"]["model"] = {"name": MODEL}
    body["spec"]["cascade"] = {"tiers": ["small", "big"],
                               "escalation": {"threshold": -1.0}}
    world = World(body)
    assert not autoscaled(world.body)
    for _ in range(3):
        burst(world)
        world.tick()
    assert world.kube.isvc_scaled == [] and world.kube.events == []
    assert world.replicas == 1 and world.kube.status_writes == 0
    assert not any(path.endswith("/autoscale/demand") for _, path in world.net.calls)


def test_scale_down_waits_for_the_window_then_consolidates():
    world = World(autoscaled_isvc(replicas=3))
    world.tick()
    for _ in range(5):  # 25 s of quiet: within the 30 s scale-down window
        quiet(world)
        world.tick()
        assert world.replicas == 3
    world.tick()
    world.tick()
    assert world.replicas == 1
    assert world.kube.events[-1]["reason"] == "ScaledDown"
    assert world.status()["lastScaleReason"].startswith("consolidate")


def test_a_restart_during_a_burst_does_not_drop_replicas():
    world = World(autoscaled_isvc())
    world.tick()
    burst(world)
    world.tick()
    assert world.replicas == 3
    world.restart()  # the operator restarts: nothing in memory
    world.tick()  # a baseline only
    assert world.autoscaler.state("team-a", "smol").replicas == 3
    for _ in range(5):  # demand quiet for less than the scale-down window: still 3
        world.net.add("10.9.0.1", arrivals=1)
        world.tick()
        assert world.replicas == 3, world.kube.isvc_scaled
    assert world.kube.isvc_scaled == [("smol", 3)]


def test_kubectl_scale_is_overwritten_while_autoscaling_is_enabled():
    world = World(autoscaled_isvc(replicas=2))
    world.tick()
    world.net.add("10.9.0.1", arrivals=10)
    world.tick()
    assert world.replicas == 2
    world.body["spec"]["replicas"] = 3  # kubectl scale --replicas=3
    world.net.add("10.9.0.1", arrivals=10)
    world.tick()
    assert world.replicas == 2
    assert world.kube.events[-1]["reason"] == "ScaledDown"
    assert world.kube.events[-1]["message"].startswith("spec.replicas 3 → 2: override")


def test_a_spec_out_of_bounds_is_brought_into_them():
    world = World(autoscaled_isvc(replicas=7))
    world.tick()
    world.tick()
    assert world.replicas == 3
    assert world.kube.events[-1]["message"].startswith("spec.replicas 7 → 3: bounds")


def test_raising_min_replicas_scales_up_for_the_bounds():
    """minReplicas edited from 1 to 2 above the current count: the scale-up's reason is
    ``bounds`` (the README's), not ``override`` (someone else wrote spec.replicas)."""
    world = World(autoscaled_isvc(replicas=1))
    world.tick()
    world.net.add("10.9.0.1", arrivals=1)
    world.tick()
    assert world.replicas == 1
    world.body["spec"]["minReplicas"] = 2
    world.net.add("10.9.0.1", arrivals=1)
    world.tick()
    assert world.replicas == 2
    assert world.kube.events[-1]["message"].startswith("spec.replicas 1 → 2: "), \
        world.kube.events[-1]["message"]
    assert world.kube.events[-1]["message"].startswith("spec.replicas 1 → 2: bounds")


def test_scale_to_zero_when_idle_and_a_held_request_wakes_it():
    world = World(autoscaled_isvc(replicas=1, scaleToZero=True, idleSeconds=20))
    world.tick()
    for _ in range(4):
        world.tick()
    assert world.replicas == 0
    assert world.status()["lastScaleReason"].startswith("idle")
    world.net.demand("10.9.0.2", held=1)  # a request waits at a router for a replica
    world.net.add("10.9.0.2", arrivals=1)
    world.tick()
    assert world.replicas == 1
    assert world.status()["lastScaleReason"].startswith("wake")
    assert [e["reason"] for e in world.kube.events] == ["ScaledDown", "ScaledUp"]


def test_status_is_written_only_when_it_changes():
    world = World(autoscaled_isvc(replicas=2))
    world.tick()
    world.net.add("10.9.0.1", arrivals=8, ttft_total=8, ttft_met=8)
    world.tick()
    assert world.status()["desiredReplicas"] == 2 and world.status()["sloAttainment"] == 1.0
    writes = world.kube.status_writes
    for _ in range(3):
        world.net.add("10.9.0.1", arrivals=8, ttft_total=8, ttft_met=8)
        world.tick()
    assert world.kube.status_writes == writes
    world.net.add("10.9.0.1", arrivals=8, ttft_total=8, ttft_met=0)
    world.tick()
    state = world.autoscaler.state("team-a", "smol")  # the policy's decayed attainment
    assert 0 < state.slo_met / state.slo_total < 1
    assert world.status()["sloAttainment"] == pytest.approx(state.slo_met / state.slo_total,
                                                             abs=1e-3)


def test_an_invalid_spec_is_left_to_the_controller():
    body = autoscaled_isvc()
    body["spec"]["minReplicas"] = 0  # without scaleToZero
    world = World(body)
    burst(world)
    world.tick()
    burst(world)
    world.tick()
    assert world.kube.isvc_scaled == [] and world.kube.events == []


def test_deleting_or_disabling_forgets_the_state():
    world = World(autoscaled_isvc())
    world.tick()
    assert world.autoscaler.state("team-a", "smol") is not None
    world.body["spec"]["autoscaling"]["enabled"] = False
    world.tick()
    assert world.autoscaler.state("team-a", "smol") is None


def test_routers_named_by_url_count_too():
    world = World(autoscaled_isvc())
    world.kube.pods = []  # `make e2e-local`'s first pass: the router is a local process
    world.net.routers["127.0.0.1"] = {"models": {}, "workers": []}
    world.routers.urls = ("http://127.0.0.1:8123",)
    world.tick()
    world.net.add("127.0.0.1", arrivals=10)
    world.tick()
    assert world.replicas == 2
    assert [e["reason"] for e in world.kube.events] == ["ScaledUp"]  # no NoRouter
