"""The parts between the router and the policy, without servers: demand accounting and
holding at the router, summing routers' snapshots, file discovery, and the `sluice up`
driver's choice of the replica to drain."""

from __future__ import annotations

import asyncio
import json
import os
import types
from pathlib import Path

import httpx
import pytest

from sluice.autoscale.observe import observe
from sluice.autoscale.policy import Config
from sluice.local.autoscaler import LocalAutoscaler
from sluice.router.demand import Demand
from sluice.router.dispatch import Dispatcher, DispatchSettings
from sluice.router.endpoints import EndpointSet, ModelSettings
from sluice.router.metrics import DemandCollector, RouterMetrics

MODEL = "m"


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


# ------------------------------------------------------------------ router: demand and hold

def test_demand_counts_arrivals_refusals_and_slo_verdicts():
    demand = Demand()
    for _ in range(3):
        demand.arrived(MODEL)
    demand.rejected(MODEL)
    demand.invalid(MODEL)
    demand.started(MODEL)
    demand.started(MODEL)
    demand.first_token(MODEL, ttft_s=0.4, slo_s=0.5)
    demand.first_token(MODEL, ttft_s=0.6, slo_s=0.5)
    demand.first_token(MODEL, ttft_s=9.0, slo_s=None)  # no objective: no verdict
    demand.finished(MODEL, mean_gap_s=0.05, slo_s=0.1)
    demand.finished(MODEL, mean_gap_s=None, slo_s=0.1)  # not streamed: no ITL verdict
    assert demand.snapshot() == {MODEL: {"arrivals": 3, "rejected": 1, "invalid": 1, "ttft_met": 1,
                                         "ttft_total": 2, "itl_met": 1, "itl_total": 1,
                                         "held": 0, "in_flight": 0}}


def test_a_held_request_is_released_when_a_replica_turns_ready():
    async def scenario():
        demand, ready = Demand(), [False]
        waiter = asyncio.create_task(demand.hold(MODEL, lambda: ready[0], timeout_s=10))
        await asyncio.sleep(0.01)
        assert demand.snapshot()[MODEL]["held"] == 1
        demand.wake()  # a poll that found nothing new: still held
        await asyncio.sleep(0.01)
        assert not waiter.done()
        ready[0] = True
        demand.wake()
        assert await asyncio.wait_for(waiter, 1) is True
        assert demand.snapshot()[MODEL]["held"] == 0

    run(scenario())


def test_a_hold_ends_at_its_timeout():
    async def scenario():
        demand = Demand()
        assert await demand.hold(MODEL, lambda: False, timeout_s=0.05) is False
        assert demand.snapshot()[MODEL]["held"] == 0

    run(scenario())


def test_hold_time_comes_from_the_inferenceservice_or_the_flag():
    async def scenario():
        endpoints = EndpointSet()
        d = Dispatcher(endpoints, DispatchSettings(hold_s=0.0), RouterMetrics())
        assert await d.hold(MODEL) is False  # no hold configured: no wait
        endpoints.sync([], [MODEL], {MODEL: ModelSettings(hold_s=0.05)})
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await d.hold(MODEL) is False
        assert loop.time() - start >= 0.05

    run(scenario())


def test_demand_snapshot_adds_the_queue_and_is_exported_at_scrape():
    endpoints = EndpointSet()
    metrics = RouterMetrics()
    d = Dispatcher(endpoints, DispatchSettings(), metrics)
    metrics.registry.register(DemandCollector(d.demand_snapshot))
    d.demand.arrived(MODEL)
    d.demand.first_token(MODEL, 0.1, 0.5)
    assert d.demand_snapshot()[MODEL]["queued"] == 0
    from prometheus_client import generate_latest
    text = generate_latest(metrics.registry).decode()
    assert 'sluice_router_arrivals_total{model="m"} 1.0' in text
    assert 'sluice_router_slo_met_total{model="m",objective="ttft"} 1.0' in text
    assert 'sluice_router_held_requests{model="m"} 0.0' in text


# ------------------------------------------------------------------ several routers

def snap(**fields) -> dict:
    return {MODEL: fields}


def test_observe_sums_routers_and_survives_a_router_restart():
    before = {"r1": snap(arrivals=10, ttft_met=5, ttft_total=6),
              "r2": snap(arrivals=100, rejected=3)}
    now = {"r1": snap(arrivals=14, ttft_met=7, ttft_total=8, queued=2, in_flight=3),
           "r2": snap(arrivals=4, rejected=0, held=1),     # restarted: counts from 0
           "r3": snap(arrivals=50, in_flight=1)}           # new: its gauges only
    obs = observe(MODEL, before, now, window_s=5.0, ready=2, starting=1)
    assert (obs.arrivals, obs.rejected, obs.ttft_met, obs.ttft_total) == (8, 0, 2, 2)
    assert (obs.queued, obs.held, obs.in_flight, obs.ready, obs.starting) == (2, 1, 4, 2, 1)
    assert observe("other", before, now, 5.0, 0, 0).arrivals == 0
    invalid = {"r1": snap(arrivals=16, invalid=5)}  # 6 arrived, 5 of them refused as invalid
    assert observe(MODEL, before, invalid, 5.0, 1, 0).arrivals == 1
    assert observe(MODEL, before, {"r1": snap(arrivals=11, invalid=3)}, 5.0, 1, 0).arrivals == 0


# ------------------------------------------------------------------ file discovery

def test_workers_file_lists_workers_and_declares_models_at_zero(tmp_path):
    path = tmp_path / "workers.json"
    endpoints = EndpointSet(workers_file=str(path))
    endpoints.reload_file()  # missing: nothing, no error
    assert len(endpoints) == 0
    path.write_text(json.dumps({"workers": ["http://w0", "http://w1/"], "models": [MODEL]}))
    endpoints.reload_file()
    assert [e.url for e in endpoints.listed()] == ["http://w0", "http://w1"]
    assert endpoints.serves(MODEL) and endpoints.ready_for(MODEL) == []
    path.write_text(json.dumps({"workers": [], "models": [MODEL]}))
    endpoints.reload_file()
    assert endpoints.listed() == []
    assert [m["id"] for m in endpoints.model_entries()] == [MODEL]  # listed at zero
    path.write_text("{not json")
    endpoints.reload_file()  # a bad file keeps the last good view
    assert endpoints.serves(MODEL)


@pytest.mark.parametrize("data, problem", [
    ({"workers": "http://w0"}, '"workers" must be a list of URLs'),  # was read per character
    ({"workers": ["w0:8001"]}, "\"workers\": not an http(s) URL with a host: 'w0:8001'"),
    ({"workers": ["https://w0"]},
     "\"workers\": the router reaches workers over http:// only, not 'https://w0'"),
    ({"workers": ["http://w0"], "models": "m"}, '"models" must be a list of model names'),
    ([], 'not a JSON object with a "workers" list'),
])
def test_a_bad_workers_file_is_refused_naming_the_field_and_logged_once(
        tmp_path, caplog, data, problem):
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"workers": ["http://w1"], "models": [MODEL]}))
    endpoints = EndpointSet(workers_file=str(path))
    endpoints.reload_file()
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="sluice.router.endpoints"):
        for _ in range(3):
            endpoints.reload_file()
            os.utime(path)  # a rewrite with the same bad content: still one line
    assert [e.url for e in endpoints.listed()] == ["http://w1"]  # the last good view
    assert [r.getMessage() for r in caplog.records] == \
        [f"workers file {path} not used: ValueError: {problem}"]


def test_a_missing_workers_file_is_logged_once_not_at_every_poll(tmp_path, caplog):
    path = tmp_path / "workers.json"
    endpoints = EndpointSet(workers_file=str(path))
    with caplog.at_level("WARNING", logger="sluice.router.endpoints"):
        for _ in range(5):
            endpoints.reload_file()
    assert len(caplog.records) == 1 and "FileNotFoundError" in caplog.records[0].getMessage()


# ------------------------------------------------------------------ sluice up driver

def child(name: str, url: str):
    return types.SimpleNamespace(name=name, url=url)


def test_the_drained_replica_is_the_least_busy_and_stops_only_once_idle(tmp_path: Path):
    workers = [child("worker-0", "http://a"), child("worker-1", "http://b"),
               child("worker-2", "http://c")]
    retired: list[str] = []
    now = [0.0]
    scaler = LocalAutoscaler(MODEL, Config(max_replicas=3), "http://router",
                             tmp_path / "workers.json", add_worker=lambda: None,
                             retire_worker=lambda c: retired.append(c.name), workers=workers,
                             drain_s=30.0, clock=lambda: now[0])
    seen = {"http://a": {"ready": True, "listed": True, "in_flight": 3},
            "http://b": {"ready": True, "listed": True, "in_flight": 1},
            "http://c": {"ready": True, "listed": True, "in_flight": 2}}
    scaler._scale_to(2, seen, now[0])
    listed = json.loads((tmp_path / "workers.json").read_text())
    assert listed == {"workers": ["http://a", "http://c"], "models": [MODEL]}
    scaler._drain(seen, now[0])  # the router still lists it: keep waiting
    seen["http://b"] = {"ready": False, "listed": False, "in_flight": 1}
    scaler._drain(seen, now[0])  # unlisted, one request still streaming: keep waiting
    assert retired == []
    seen["http://b"]["in_flight"] = 0
    scaler._drain(seen, now[0])
    assert retired == ["worker-1"] and scaler.draining == []


def test_a_drain_that_outlives_its_deadline_is_stopped(tmp_path: Path):
    workers = [child("worker-0", "http://a"), child("worker-1", "http://b")]
    retired: list[str] = []
    now = [0.0]
    scaler = LocalAutoscaler(MODEL, Config(max_replicas=2), "http://router",
                             tmp_path / "workers.json", add_worker=lambda: None,
                             retire_worker=lambda c: retired.append(c.name), workers=workers,
                             drain_s=30.0, clock=lambda: now[0])
    seen = {"http://a": {"ready": True, "in_flight": 0}, "http://b": {"ready": False}}
    scaler._scale_to(1, seen, 0.0)  # a replica not ready yet goes first
    busy = {"http://b": {"listed": False, "in_flight": 2}}
    scaler._drain(busy, 29.0)
    assert retired == []
    scaler._drain(busy, 30.0)
    assert retired == ["worker-1"]


def router_client(demand: Demand, workers: list) -> httpx.Client:
    """The router's two GETs the driver makes, answered by a MockTransport from a real
    ``Demand``; only ``http://a`` is ready."""
    def router(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"workers": [
                {"url": w.url, "ready": w.url == "http://a", "listed": True, "in_flight": 0}
                for w in workers]})
        return httpx.Response(200, json={"models": demand.snapshot()})
    return httpx.Client(transport=httpx.MockTransport(router))


def test_a_burst_starts_a_worker_at_the_next_supervisor_round(tmp_path: Path):
    """Decisions come every 0.5 s (the supervisor's period), not every 2 s: a burst's first
    seconds are what the interval costs. The router's two GETs are answered by a
    MockTransport from a real ``Demand``: the driver's timing is the subject, not HTTP."""
    demand, started = Demand(), []
    workers = [child("worker-0", "http://a")]
    now = [0.0]

    def add_worker():
        started.append(now[0])
        return child(f"worker-{len(started)}", f"http://w{len(started)}")

    scaler = LocalAutoscaler(MODEL, Config(max_replicas=2, capacity_rps=1.0, boot_s=5.0),
                             "http://router", tmp_path / "workers.json", add_worker=add_worker,
                             retire_worker=lambda c: None, workers=workers,
                             clock=lambda: now[0])
    client = router_client(demand, workers)
    scaler.tick(client)  # the first snapshot opens the window
    for _ in range(4):
        demand.arrived(MODEL)
    now[0] = 0.5
    scaler.tick(client)
    assert started == [0.5] and len(scaler.workers) == 2


@pytest.mark.parametrize("bad", [{"min_replicas": 0}, {"max_replicas": 0}])
def test_the_drivers_refuse_configs_the_policy_cannot_use(bad):
    with pytest.raises(ValueError):
        Config(**bad)


def test_idle_seconds_count_from_the_first_decision_not_from_before_the_boot(tmp_path: Path):
    """A break-it pass: the first worker took 12.5 s to boot and ``idleSeconds: 10`` took the
    service to zero 1 s after the ready banner; the idle time now starts at the driver's
    first snapshot (the supervisor ticks once the workers are healthy)."""
    demand, retired = Demand(), []
    workers = [child("worker-0", "http://a")]
    now = [0.0]
    config = Config(min_replicas=0, max_replicas=1, scale_to_zero=True, idle_s=10.0,
                    capacity_rps=1.0, boot_s=5.0, scale_down_window_s=5.0)
    scaler = LocalAutoscaler(MODEL, config, "http://router", tmp_path / "workers.json",
                             add_worker=lambda: None, retire_worker=retired.append,
                             workers=workers, clock=lambda: now[0])
    client = router_client(demand, workers)
    now[0] = 12.5  # the boot
    scaler.tick(client)
    for t in (13.0, 18.0, 22.0):
        now[0] = t
        scaler.tick(client)
        assert len(scaler.workers) == 1, t  # idle 9.5 s, not 22
    now[0] = 23.0
    scaler.tick(client)
    assert scaler.workers == [] and scaler.state.replicas == 0
