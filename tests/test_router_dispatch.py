"""The dispatcher between parsing and proxying: objectives and priorities from headers,
the InferenceService and flags; the admission gate; load reports; bounded state under a
long run of requests (no servers)."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from sluice.api import metrics as names
from sluice.router.admission import Rejected
from sluice.router.discovery import ServiceView, model_settings, service_view, serving
from sluice.router.dispatch import (MAX_RETRY_AFTER_S, NO_WORKER_RETRY_AFTER_S, RELEASE_HOLD_S,
                                    BadRoutingHeader, Dispatcher, DispatchSettings)
from sluice.router.endpoints import (REPORT_FRESH_S, Endpoint, EndpointSet, Lease, ModelSettings,
                                     WorkerLoad)
from sluice.router.policy import SHORTLIST, LeastLoadPolicy, PrefixPolicy, SLOPolicy
from sluice.router.metrics import RouterMetrics

MODEL = "m"


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def fleet(n: int = 2, clock=time.monotonic, **settings) -> tuple[EndpointSet, Dispatcher]:
    endpoints = EndpointSet([f"http://w{i}" for i in range(n)])
    for e in endpoints:
        e.ready, e.models, e.models_known = True, {MODEL: {"id": MODEL}}, True
    return endpoints, Dispatcher(endpoints, DispatchSettings(**settings), RouterMetrics(),
                                 clock=clock)


BODY = {"model": MODEL, "prompt": "Tell me a story. " * 20, "stream": True}


# ------------------------------------------------------------------ objectives, priority

def test_service_view_and_settings_from_inferenceservices():
    isvc = {"spec": {"model": {"name": "A"}, "slo": {"ttftMs": 500, "itlMs": 50.5},
                     "routing": {"strategy": "prefix", "loadFactor": 1.5}}}
    assert service_view(isvc) == ServiceView("A", 500.0, 50.5, "prefix", 1.5)
    assert service_view({"spec": {"model": {"name": "B"}, "slo": {"ttftMs": True},
                                  "routing": {"strategy": 3}}}) == ServiceView("B")
    assert service_view({}) == ServiceView(None)
    older, newer = "2026-11-30T10:00:00Z", "2026-12-01T09:00:00Z"
    views = {"a": ServiceView("A", 500.0, created=newer), "w": ServiceView("A", 900.0,
                                                                           created=older),
             "y": ServiceView("B", created=newer), "x": ServiceView("B", 300.0, created=newer),
             "z": ServiceView(None, 100.0)}
    # of two services of one served name, the oldest serves it (a tie: the first name)
    assert serving(views) == {"w": views["w"], "x": views["x"]}
    assert model_settings(serving(views)) == {"A": ModelSettings(900.0),
                                              "B": ModelSettings(300.0)}
    assert service_view({"metadata": {"creationTimestamp": older},
                         "spec": {"model": {"name": "A"}}}) == ServiceView("A", created=older)


def test_service_view_reads_each_section_through_the_spec_model():
    """spec.slo, spec.routing and spec.autoscaling are read with InferenceServiceSpec's own
    section models (strictly, as the API server would admit them): a section the model
    refuses counts as unset, whole, and unset fields stay None (the router's flags apply)."""
    out_of_bounds = {"spec": {"model": {"name": "C"},
                              "slo": {"ttftMs": 5_000_000, "itlMs": 20},  # > 1 h
                              "routing": {"strategy": "nope", "loadFactor": 2.0},
                              "autoscaling": {"enabled": True, "holdSeconds": 7200}}}
    assert service_view(out_of_bounds) == ServiceView("C")
    partial = {"spec": {"model": {"name": "D"}, "slo": {"itlMs": 20},
                        "routing": {"loadFactor": 3}, "autoscaling": {"enabled": True}}}
    assert service_view(partial) == ServiceView("D", itl_ms=20.0, load_factor=3.0, hold_s=60.0)


def test_an_inferenceservice_as_the_api_server_defaults_it_leaves_routing_to_the_flags():
    """The API server fills in the CRD's defaults: none for spec.routing's fields, so a
    service that names no strategy gets the router's --policy (the chart's router.policy),
    not a default the CRD chose for it."""
    from sluice.api import crd

    minimal = {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "e"}, "spec": {"model": {"name": "E", "source": "sluice://x"}}}
    stored = crd.apply_defaults(crd.resource_schema(), minimal)
    assert stored["spec"]["routing"] == {}
    assert service_view(stored) == ServiceView("E")


def test_each_model_gets_the_policy_its_inferenceservice_names():
    endpoints, d = fleet(policy="least-load")
    assert isinstance(d.policy_for(MODEL), LeastLoadPolicy)  # no discovery: --policy
    endpoints.sync([e.url for e in endpoints], [MODEL, "other"], {
        MODEL: ModelSettings(strategy="prefix", load_factor=2.0),
        "other": ModelSettings(strategy="slo")})
    prefix = d.policy_for(MODEL)
    assert isinstance(prefix, PrefixPolicy) and prefix.context.load_factor == 2.0
    assert prefix.context.prefix_index is d.context.prefix_index  # shared state
    assert d.policy_for(MODEL) is prefix  # made once
    assert isinstance(d.policy_for("other"), SLOPolicy)
    endpoints.sync([e.url for e in endpoints], [MODEL], {MODEL: ModelSettings(strategy="nope")})
    assert d.policy_for(MODEL) is d.policy


def test_objectives_headers_then_inferenceservice_then_flags():
    endpoints, d = fleet(slo_ttft_ms=2000.0, slo_itl_ms=None)
    r = d.routing_request(BODY, {}, arrival=100.0)
    assert r.ttft_slo_s == 2.0 and r.deadline == 102.0 and r.itl_slo_s is None
    assert r.priority == 0 and r.stream and r.shape.tokens > 50
    endpoints.sync([e.url for e in endpoints], [MODEL], {MODEL: ModelSettings(300.0, 40.0)})
    r = d.routing_request(BODY, {}, arrival=100.0)
    assert (r.ttft_slo_s, r.itl_slo_s) == (0.3, 0.04)
    r = d.routing_request(BODY, {"x-slo-ttft-ms": "150", "x-slo-itl-ms": "20"}, arrival=100.0)
    assert (r.ttft_slo_s, r.itl_slo_s, r.deadline) == (0.15, 0.02, 100.15)
    _, none = fleet(slo_ttft_ms=None)
    r = none.routing_request(BODY, {}, arrival=1.0)
    assert r.ttft_slo_s is None and r.deadline is None and math.isinf(r.budget_s(5.0))


def test_priority_from_header_or_body():
    _, d = fleet()
    assert d.routing_request({**BODY, "priority": 3}, {}, 0).priority == 3
    assert d.routing_request({**BODY, "priority": 3}, {"x-priority": "-2"}, 0,
                             ceiling=-2).priority == -2  # a tenant allowed -2 (test_tenants)


@pytest.mark.parametrize("headers, body, param", [
    ({"x-slo-ttft-ms": "soon"}, {}, "x-slo-ttft-ms"),
    ({"x-slo-ttft-ms": "0"}, {}, "x-slo-ttft-ms"),
    ({"x-slo-itl-ms": "nan"}, {}, "x-slo-itl-ms"),
    ({"x-priority": "high"}, {}, "x-priority"),
    ({}, {"priority": True}, "priority"),
    ({}, {"priority": 1e30}, "priority"),
])
def test_bad_routing_headers(headers, body, param):
    _, d = fleet()
    with pytest.raises(BadRoutingHeader) as info:
        d.routing_request({**BODY, **body}, headers, 0)
    assert info.value.param == param


# ------------------------------------------------------------------ load reports

def test_worker_load_from_headers_and_scrape():
    headers = {"x-sluice-num-running": "3", "x-sluice-num-waiting": "1",
               "x-sluice-kv-cache-usage": "0.25", "x-sluice-queued-prefill-tokens": "700"}
    assert WorkerLoad.from_headers(headers, 5.0) == WorkerLoad(3, 1, 0.25, 700, 5.0)
    assert WorkerLoad.from_headers({}, 5.0) is None
    assert WorkerLoad.from_headers({"x-sluice-num-running": "x"}, 5.0) is None
    text = (f'# HELP x\n{names.NUM_RUNNING}{{model_name="m"}} 2.0\n'
            f'{names.NUM_WAITING}{{model_name="m"}} 4.0\n{names.KV_CACHE_USAGE}{{model_name="m"}} 0.5\n'
            f'{names.QUEUED_PREFILL_TOKENS}{{model_name="m"}} 1200.0\n')
    assert WorkerLoad.from_metrics(text, 1.0) == WorkerLoad(2, 4, 0.5, 1200, 1.0)
    assert WorkerLoad.from_metrics("nothing here", 1.0) is None


def test_lease_counts_prefill_until_the_first_token():
    e = Endpoint("http://w")
    a, b = Lease(e, 100, 0.0), Lease(e, 50, 0.0)
    assert (e.in_flight, e.prefilling, e.prefill_tokens) == (2, 2, 150)
    assert a.first_token(0.0) and not a.first_token(0.0)
    assert (e.in_flight, e.prefilling, e.prefill_tokens, e.running(0.0)) == (2, 1, 50, 1)
    a.release(0.0)
    b.release(0.0)  # released before its first token: its prefill is dropped too
    assert (e.in_flight, e.prefilling, e.prefill_tokens) == (0, 0, 0)


# ------------------------------------------------------------------ the gate

def test_gate_work_conserving_then_predicted_ttft():
    endpoints, d = fleet(2, slo_ttft_ms=1000.0)
    r = d.routing_request(BODY, {}, arrival=time.monotonic())
    assert d.gate(r)  # idle fleet
    leases = [Lease(e, 50_000, 0.0) for e in endpoints]  # long prefills ahead
    assert not d.gate(r)  # each replica busy and predicted far above 1 s
    leases[0].first_token(0.0)  # w0's prefill is done: it has no prefill in flight
    assert d.gate(r)
    no_slo = fleet(2, slo_ttft_ms=None)[1]
    assert no_slo.gate(no_slo.routing_request(BODY, {}, arrival=0))


def test_gate_over_a_large_busy_fleet_predicts_a_shortlist():
    """1,000 busy workers: the gate predicts for SHORTLIST of them (plus the prefix's
    holders), not for every one; one idle worker still opens it; the choice that follows
    goes where the prefix is."""
    endpoints, d = fleet(1000, slo_ttft_ms=1000.0)
    r = d.routing_request(BODY, {}, arrival=time.monotonic())
    leases = [Lease(e, 50_000, 0.0) for e in endpoints]  # long prefills ahead everywhere
    assert not d.gate(r)
    assert len(r.predicted.by_url) == SHORTLIST
    holder = list(endpoints)[737]
    d.context.prefix_index.record(r.shape.blocks, holder.url)
    assert not d.gate(r) and holder.url in r.predicted.by_url
    assert len(r.predicted.by_url) in (SHORTLIST, SHORTLIST + 1)
    leases[737].first_token(0.0)  # the holder's prefill is done: idle, so the gate opens
    assert d.gate(r) and r.predicted.by_url == {}
    endpoint, _ = run(d.choose(endpoints.ready_for(MODEL), r))
    assert endpoint is holder


def test_any_ready_for_is_ready_for_nonempty():
    endpoints, _ = fleet(3)
    assert endpoints.any_ready_for(MODEL) and not endpoints.any_ready_for("other")
    for e in endpoints:
        e.ready = False
        assert endpoints.any_ready_for(MODEL) == bool(endpoints.ready_for(MODEL))


def booting_fleet(boot_s: float | None = 1.0, age_s: float = 0.5,
                  slo_ttft_ms: float = 1000.0):
    """One ready endpoint decoding a full batch with a deep prefill queue of its own (its
    report), and one listed ``age_s`` ago that is booting, with ``boot_s`` the expected
    boot."""
    endpoints, d = fleet(1, slo_ttft_ms=slo_ttft_ms)
    endpoints.boot_s = boot_s
    busy = next(iter(endpoints))
    busy.reported = WorkerLoad(8, 3, 0.5, 20_000, time.monotonic())
    endpoints.sync([busy.url, "http://new"], [MODEL])
    new = next(e for e in endpoints if e.url == "http://new")
    new.listed_at = time.monotonic() - age_s
    return endpoints, d, busy, new


def test_a_503_without_a_ready_replica_says_when_the_booting_one_is_expected():
    """Retry-After of ``no_ready_worker``: the booting replica's expected seconds left
    (1.5 -> 2), at least 1 once it is due, the old fixed 5 when none is expected, at most
    an hour (a 301-digit header for --boot-seconds 1e300)."""
    endpoints, d, busy, new = booting_fleet(boot_s=2.0, age_s=0.5)
    assert d.no_worker_retry_after(MODEL) == 2
    new.listed_at = time.monotonic() - 2.5
    assert d.no_worker_retry_after(MODEL) == 1
    endpoints.boot_s = None
    assert d.no_worker_retry_after(MODEL) == NO_WORKER_RETRY_AFTER_S == 5
    endpoints.boot_s, new.listed_at = 1e300, time.monotonic()  # found by a fresh user
    assert d.no_worker_retry_after(MODEL) == MAX_RETRY_AFTER_S == 3600
    # none booting yet (a break-it pass: a hold of 0.3 s ended before the autoscaler's tick
    # listed one, and the first client was told 5 s of a 30 s boot, later ones 30, 29, ...)
    endpoints.boot_s = 30.0
    endpoints.sync([busy.url], [MODEL])
    assert endpoints.ready_in_s(MODEL, time.monotonic()) is None
    assert d.no_worker_retry_after(MODEL) == 30


def test_full_queue_answers_rejected_with_retry_after():
    endpoints, d = fleet(1, slo_ttft_ms=100.0, max_queue=1)
    for e in endpoints:
        Lease(e, 50_000, 0.0)

    async def scenario():
        r = d.routing_request(BODY, {}, arrival=time.monotonic())
        waiting = asyncio.create_task(d.admit(r))
        await asyncio.sleep(0.01)
        with pytest.raises(Rejected) as info:
            await d.admit(r)
        assert info.value.retry_after_s >= 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    run(scenario())
    assert d.metrics.registry.get_sample_value(
        names.ROUTER_REJECTED, {"model": MODEL, "reason": "queue_full"}) == 1.0
    assert d.metrics.registry.get_sample_value(names.ROUTER_QUEUE_LENGTH, {"model": MODEL}) == 0


# ------------------------------------------------------------------ bounded under load

def test_state_stays_bounded_over_many_requests():
    """10,000 requests with distinct prompts through choose/lease/first token/finish: every
    counter returns to zero, no queue is left, the prefix index stays at its capacity, the
    predictor's error window at its size."""
    endpoints, d = fleet(4, slo_ttft_ms=500.0)
    d.context.prefix_index.capacity = 1_000
    rng = random.Random(0)

    async def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"tenant {i % 50} " * 30 + str(rng.random()) * 20}
        r = d.routing_request(body, {}, arrival=time.monotonic())
        released = await d.admit(r)
        endpoint, prediction = await d.choose(endpoints.ready_for(MODEL), r)
        lease = Lease(endpoint, prediction.features.uncached_prompt_tokens, 0.0)
        d.dispatched(endpoint, r)
        if released:
            d.settled(r)
        await asyncio.sleep(0)
        lease.first_token(0.0)
        d.first_token(endpoint, prediction, 0.05 + rng.random() * 0.05, MODEL)
        lease.release(0.0)
        d.finished(endpoint, prediction, 0.02, MODEL)

    async def scenario():
        for start in range(0, 10_000, 100):
            await asyncio.gather(*(one(i) for i in range(start, start + 100)))

    run(scenario())
    assert all((e.in_flight, e.prefilling, e.prefill_tokens) == (0, 0, 0) for e in endpoints)
    assert d.admission.models() == [] and len(d.context.prefix_index) <= 1_000
    assert len(d.errors) == 500 and 0 <= d.errors.mape < 10


# ------------------------------------------------------------------ a virtual clock

def test_decisions_read_only_the_injected_clock():
    """A simulator drives the dispatcher on virtual time: the release hold, the freshness of
    load reports and the queue wait all follow the injected clock, not the machine's."""
    now = [5_000_000.0]  # far from time.monotonic(): any read of the real clock shows
    endpoints, d = fleet(2, slo_ttft_ms=1000.0, clock=lambda: now[0])
    w0, w1 = endpoints
    leases = [Lease(e, 50_000, now[0]) for e in endpoints]  # both busy: the gate shuts

    async def scenario():
        first = d.routing_request(BODY, {}, arrival=now[0])
        waiting = asyncio.create_task(d.admit(first))
        await asyncio.sleep(0)
        assert d.admission.waiting(MODEL) == 1
        now[0] += 2.5
        leases[0].first_token(now[0])
        d.kick(MODEL)  # w0 is free: the head goes, and holds the gate until it is leased
        assert await waiting  # it waited...
        second = d.routing_request(BODY, {}, arrival=now[0])
        assert not d.gate(second)  # ...and holds the gate on virtual time
        now[0] += RELEASE_HOLD_S + 0.1
        assert d.gate(second)

    run(scenario())
    assert d.metrics.registry.get_sample_value(
        names.ROUTER_QUEUE_WAIT + "_sum") == pytest.approx(2.5)
    leases[1].first_token(now[0])  # w1 has no prefill of the router's own ahead...
    w1.reported = WorkerLoad(running=0, queued_prefill_tokens=90_000, at=now[0])
    r = d.routing_request(BODY, {}, arrival=now[0])
    _, fresh = run(d.choose([w1], r))
    assert fresh.ttft_s > 3  # ...but its own report, fresh on virtual time, shows a queue
    now[0] += REPORT_FRESH_S + 1
    _, stale = run(d.choose([w1], r))
    assert stale.ttft_s < 1



def test_a_release_is_settled_by_its_own_request_only():
    """Two queued requests of one model: the first one settling (even twice) never clears
    the hold the second one's release put on the gate."""
    endpoints, d = fleet(2, slo_ttft_ms=1000.0)
    w0, w1 = endpoints
    busy = [Lease(e, 50_000, 0.0) for e in endpoints]

    async def scenario():
        a, b = (d.routing_request(BODY, {}, arrival=time.monotonic()) for _ in range(2))
        waits = [asyncio.create_task(d.admit(r)) for r in (a, b)]
        await asyncio.sleep(0)
        busy[0].first_token(0.0)
        d.kick(MODEL)  # w0 is free: a goes
        assert await waits[0]
        Lease(w0, 50_000, 0.0)  # a is leased there...
        d.settled(a)  # ...and settles: b stays (both replicas busy again)
        assert d.admission.waiting(MODEL) == 1
        busy[1].first_token(0.0)
        d.kick(MODEL)  # w1 is free: b goes, and holds the gate until it is leased
        assert await waits[1]
        c = d.routing_request(BODY, {}, arrival=time.monotonic())
        assert not d.gate(c)
        d.settled(a)  # a settling again (its give-up path) is not b's settling
        assert not d.gate(c)
        d.settled(b)
        assert d.gate(c)  # w1 has no prefill in flight

    run(scenario())


def test_a_routing_attempt_predicts_each_candidate_once(monkeypatch):
    """The gate's predictions are the policy's and the exchange's (one per candidate); a
    retry elsewhere predicts afresh. The features read back have names."""
    import sluice.router.policy as policy

    endpoints, d = fleet(2, slo_ttft_ms=1000.0)
    for e in endpoints:
        Lease(e, 500, 0.0)  # both busy: the gate predicts
    calls: list[str] = []
    real = policy.predict
    monkeypatch.setattr(policy, "predict",
                        lambda endpoint, *a: calls.append(endpoint.url) or real(endpoint, *a))
    r = d.routing_request(BODY, {}, arrival=time.monotonic())
    assert d.admit_now(r)
    endpoint, prediction = run(d.choose(endpoints.ready_for(MODEL), r))
    assert sorted(calls) == ["http://w0", "http://w1"]
    assert prediction.features.queued_prefill_tokens == 500
    assert prediction.features.uncached_prompt_tokens == r.shape.tokens
    other = [e for e in endpoints if e is not endpoint]
    run(d.choose(other, r))  # the first worker refused it: the next attempt
    assert calls[2:] == [other[0].url]


# ------------------------------------------------------------------ plain (not streamed) answers

def test_a_plain_answer_teaches_the_ttft_model_only_what_it_shows():
    """A plain answer's first token is not seen: with one token per choice its arrival is
    that token's (an exact TTFT); otherwise it is only an upper bound, learnt from when it
    is below the prediction, never counted as a TTFT nor in the predictor's error."""
    from types import SimpleNamespace

    from sluice.router.exchange import Exchange

    now = [100.0]
    endpoints, d = fleet(1, clock=lambda: now[0])
    state = SimpleNamespace(metrics=d.metrics, dispatcher=d)
    w0 = endpoints.ready_for(MODEL)[0]

    def answer(tokens: int, after_s: float, headers: dict | None = None) -> None:
        r = d.routing_request({**BODY, "stream": False}, {}, arrival=now[0] - 0.5)
        endpoint, prediction = run(d.choose([w0], r))
        exchange = Exchange(state, r, endpoint, now[0] - 0.5, prediction)  # 0.5 s admission
        now[0] += after_s
        exchange.on_headers(200, headers or {})
        exchange.on_body(b'{"choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": '
                         b'%d, "total_tokens": %d}}' % (tokens, tokens + 90))
        exchange.on_complete()

    def ttfts() -> float | None:
        return d.metrics.registry.get_sample_value(names.ROUTER_TTFT + "_count",
                                                   {"model": MODEL})

    answer(1, 0.25)  # one token: exact
    assert ttfts() == 1 and w0.latency.ttft.updates == 1 and len(d.errors) == 1
    answer(16, 30.0)  # 16 tokens, slower than predicted: says nothing about the first
    assert ttfts() == 1 and w0.latency.ttft.updates == 1 and len(d.errors) == 1
    answer(16, 0.001)  # faster than predicted: the prediction was too high
    assert ttfts() == 1 and w0.latency.ttft.updates == 2 and len(d.errors) == 1
    # a Sluice worker says when its first output came: an exact TTFT from the send
    answer(16, 3.0, {"x-sluice-ttft-ms": "250.0"})
    assert ttfts() == 2 and w0.latency.ttft.updates == 3 and len(d.errors) == 2
    assert d.metrics.registry.get_sample_value(names.ROUTER_TTFT + "_sum", {"model": MODEL}) \
        == pytest.approx(0.75 + 0.75)  # each: 0.5 s from arrival to send, then 0.25 s
    answer(16, 3.0, {"x-sluice-ttft-ms": "nan"})  # unreadable: back to the usage rule
    assert ttfts() == 2
    assert w0.in_flight == 0 and w0.prefilling == 0


def test_deadlines_fire_once_after_their_timeout_within_a_tick_and_never_once_removed():
    """``Deadlines``: one sweep timer for every first-byte deadline, running only while one
    is pending; an expired entry fires once, a removed one never."""
    from sluice.router.deadlines import Deadlines

    async def scenario() -> tuple[dict, bool, bool]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(0.2, loop.time)  # ticks every 0.02 s
        fired: dict[str, float] = {}
        start = loop.time()
        deadlines.add("a", lambda: fired.setdefault("a", loop.time() - start), start)
        deadlines.add("b", lambda: fired.setdefault("b", loop.time() - start), start)
        deadlines.remove("b")
        await asyncio.sleep(0.1)
        early = dict(fired)
        await asyncio.sleep(0.3)
        return fired | {"early": len(early)}, deadlines._timer is None, not deadlines._pending

    fired, stopped, empty = asyncio.run(scenario())
    assert fired["early"] == 0 and "b" not in fired
    assert 0.2 <= fired["a"] < 0.2 + 0.02 + 0.05  # (a tick late at most, and loop slack)
    assert stopped and empty


def test_a_worker_nothing_listens_on_is_ejected_once_and_its_requests_stay():
    """Polls find nothing listening (refused: the worker exited, or drains after SIGTERM):
    it is ejected once, counted once however many polls follow, and its unanswered
    requests stay on their connections; any other failure sends them elsewhere."""
    from sluice.router.endpoints import _refused
    from sluice.router.upstream import ConnectFailed

    def failed(cause: OSError) -> ConnectFailed:
        try:
            raise ConnectFailed("could not connect") from cause
        except ConnectFailed as exc:
            return exc

    assert _refused(failed(ConnectionRefusedError(111, "Connect call failed")))
    both = "Multiple exceptions: [Errno 111] Connect call failed ('::1', 8000, 0, 0), " \
           "[Errno 111] Connect call failed ('127.0.0.1', 8000)"
    assert _refused(failed(OSError(both)))  # a name with two addresses (localhost)
    assert not _refused(failed(OSError(both.replace("111", "113", 1))))  # one unreachable
    assert not _refused(failed(TimeoutError()))
    assert not _refused(TimeoutError())

    class Waiting:
        def __init__(self):
            self.ejected: list[str] = []

        def eject(self, reason: str) -> None:
            self.ejected.append(reason)

    endpoints, _ = fleet(2)
    counted: list[str] = []
    endpoints.on_ejected = counted.append
    drained, hung = list(endpoints)
    waiting = [Waiting(), Waiting()]
    drained.unanswered.add(waiting[0])
    hung.unanswered.add(waiting[1])
    for _ in range(3):
        endpoints.eject(drained, "unreachable", "unreachable: refused", redispatch=False)
    assert counted == ["unreachable"] and not drained.ready
    assert waiting[0].ejected == [] and drained.unanswered == {waiting[0]}
    endpoints.eject(hung, "unreachable", "unreachable: TimeoutError")
    assert counted == ["unreachable"] * 2 and waiting[1].ejected == ["unreachable: TimeoutError"]
