"""Routing policies, the prompt shape, the prefix index and the latency predictor: pure
functions of observed state, tested without servers."""

from __future__ import annotations

import asyncio
import math
import random
import tracemalloc
from collections import Counter
from typing import get_args

import pytest

from sluice.api.service import RoutingSpec, RoutingStrategy
from sluice.router.endpoints import Endpoint, Lease, WorkerLoad
from sluice.router.policy import (DEFAULT_POLICY, POLICIES, SHORTLIST, HashRing,
                                  LeastLoadPolicy, PolicyContext, PrefixPolicy, RoundRobinPolicy,
                                  RoutingRequest, SLOPolicy, chwbl, least_load, make_policy,
                                  predict_all, round_robin, shortlist, slo_pick)
from sluice.router.predictor import ErrorTracker, RLSModel, TTFTFeatures
from sluice.router.prefix import PrefixIndex, prompt_text, shape

MODEL = "m"


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(f"http://w{i}") for i in range(n)]


# ------------------------------------------------------------------ registry and spec

def test_registry_default_and_spec_agree():
    """spec.routing leaves both fields unset (the router's flags apply), and its
    descriptions name the flags' defaults: they must be the router's."""
    from sluice.router.dispatch import DispatchSettings

    assert set(POLICIES) == {"least-load", "round-robin", "prefix", "slo"}
    assert RoutingSpec().strategy is None and RoutingSpec().load_factor is None
    fields = RoutingSpec.model_fields
    assert DEFAULT_POLICY == "slo" and "(default `slo`)" in fields["strategy"].description
    assert DispatchSettings().load_factor == 1.25
    assert "(default 1.25)" in fields["load_factor"].description
    assert set(get_args(RoutingStrategy)) == set(POLICIES)
    for name, cls in POLICIES.items():
        assert isinstance(make_policy(name), cls)
    with pytest.raises(ValueError, match="round-robin"):
        make_policy("random")


# ------------------------------------------------------------------ least-load, round-robin

def test_least_load_ties_by_queued_tokens_then_rotation():
    assert least_load([(1, 500.0), (1, 20.0), (2, 0.0)]) == 1
    assert least_load([(0, 0.0), (0, 0.0), (0, 0.0)], start=2) == 2


def test_least_load_policy_reads_in_flight_then_queued_prefill():
    policy, eps = LeastLoadPolicy(), endpoints(3)
    Lease(eps[0], 900, 0.0)
    Lease(eps[1], 10, 0.0)
    eps[2].in_flight = 5
    assert run(policy.choose(eps, RoutingRequest(MODEL))).url == "http://w1"


def test_least_load_idle_fleet_rotates():
    policy, eps = LeastLoadPolicy(), endpoints(3)
    assert [run(policy.choose(eps, RoutingRequest(MODEL))).url for _ in range(6)] == \
        [e.url for e in eps] * 2


def test_round_robin():
    assert [round_robin(3, t) for t in range(5)] == [0, 1, 2, 0, 1]
    policy, eps = RoundRobinPolicy(), endpoints(2)
    eps[0].in_flight = 100  # ignores load: it is the baseline
    assert [run(policy.choose(eps, RoutingRequest(MODEL))).url for _ in range(4)] == \
        ["http://w0", "http://w1"] * 2


# ------------------------------------------------------------------ prompt shape

def test_prompt_text_of_each_request_form():
    assert prompt_text({"prompt": "hello"}) == ("hello", None)
    assert prompt_text({"prompt": ["first", "second"]}) == ("first", None)
    assert prompt_text({"prompt": [1, 2, 3]}) == ("1 2 3", 3.0)
    assert prompt_text({"prompt": [[7, 8], [9]]}) == ("7 8", 2.0)
    text, tokens = prompt_text({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]})
    assert text == "system\nbe brief\nuser\nhi\n" and tokens == pytest.approx(len(text) / 4 + 8)
    for junk in ({}, {"prompt": 5}, {"messages": "x"}, {"prompt": []}):
        assert prompt_text(junk)[0] == ""


def test_shape_key_blocks_and_tokens():
    system = "You are a helpful assistant for ACME. " * 10  # 380 characters
    a = shape({"prompt": system + "What is 2+2?"})
    b = shape({"prompt": system + "Write a poem about the sea, please, at length." * 3})
    other = shape({"prompt": "Something else entirely. " * 20})
    assert a.key == b.key != other.key  # the key covers the first 256 characters only
    assert a.blocks[:5] == b.blocks[:5] and a.blocks[0] != other.blocks[0]
    assert len(a.blocks) == len(system + "What is 2+2?") // 64
    assert a.tokens == round(len(system + "What is 2+2?") / 4)
    ids = shape({"prompt": list(range(100))})
    assert ids.tokens == 100 and ids.block_tokens == pytest.approx(64 * 100 / len(
        " ".join(map(str, range(100)))))
    assert shape({"prompt": ""}).key == 0 and shape({"prompt": ""}).tokens == 1
    assert len(shape({"prompt": "x" * 100_000}).blocks) == 128  # bounded work per request


# ------------------------------------------------------------------ prefix index

def test_prefix_index_matches_longest_recorded_prefix_per_endpoint():
    index = PrefixIndex()
    index.record([1, 2, 3, 4], "a")
    index.record([1, 2, 9], "b")
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.match([1, 2, 9]) == {"a": 2, "b": 3}
    assert index.match([7, 1]) == {}


def test_prefix_index_is_bounded_lru():
    index = PrefixIndex(capacity=4, max_endpoints=2)
    index.record([1, 2], "a")
    index.record([3, 4], "a")
    index.record([1], "a")  # refreshes block 1
    index.record([5, 6], "a")  # evicts 2 and 3, the least recently recorded
    assert len(index) == 4 and index.match([1]) == {"a": 1} and index.match([3]) == {}
    for url in "bcd":
        index.record([1], url)
    assert index.match([1]) == {"c": 1, "d": 1}  # at most 2 endpoints per block, newest kept


def test_prefix_index_memory_stays_flat():
    """A long stream of distinct prompts (the worst case) does not grow the index."""
    index = PrefixIndex(capacity=2_000)
    rng = random.Random(0)

    def burst(n: int) -> None:
        for _ in range(n):
            blocks = [rng.getrandbits(64) for _ in range(8)]
            index.record(blocks, f"http://w{rng.randrange(4)}")
            index.match(blocks)

    tracemalloc.start()
    burst(2_000)
    base = tracemalloc.take_snapshot()
    burst(20_000)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
    tracemalloc.stop()
    assert len(index) == 2_000
    assert grown < 50_000, grown  # 160k blocks went through; the index holds 2k


# ------------------------------------------------------------------ CHWBL

def test_hash_ring_moves_few_keys_when_a_member_leaves():
    four, three = HashRing(["a", "b", "c", "d"]), HashRing(["a", "b", "c"])
    keys = [random.Random(i).getrandbits(64) for i in range(2000)]
    moved = sum(four.walk(k)[0] != three.walk(k)[0] for k in keys if four.walk(k)[0] != "d")
    assert moved == 0  # keys of the remaining members stay put
    spread = Counter(four.walk(k)[0] for k in keys)
    assert min(spread.values()) > 2000 / 4 * 0.6, spread  # virtual nodes spread keys


def test_chwbl_sticks_to_the_key_until_the_bound():
    ring = HashRing(["a", "b", "c", "d"])
    key = 12345
    home = ring.walk(key)[0]
    assert chwbl(ring, key, {}, 1.25) == home
    # 8 in flight over 4: capacity ⌈1.25 · 9 / 4⌉ = 3; home holds 2 → still home
    loads = {m: 2 for m in "abcd"}
    assert chwbl(ring, key, loads, 1.25) == home
    loads[home] = 3  # at capacity ⌈1.25 · 10 / 4⌉ = 4? no: 3 < 4 → still home
    assert chwbl(ring, key, loads, 1.25) == home
    loads[home] = 5  # 11 in flight: capacity ⌈1.25 · 12 / 4⌉ = 4 → the next on the ring
    assert chwbl(ring, key, loads, 1.25) == ring.walk(key)[1]


def test_prefix_policy_bounds_load_under_a_single_hot_prefix():
    """Every request shares one prefix: CHWBL keeps each endpoint ≤ ⌈c · m / n⌉."""
    policy, eps = PrefixPolicy(PolicyContext(load_factor=1.25)), endpoints(4)
    request = RoutingRequest(MODEL, shape=shape({"prompt": "tenant A system prompt " * 20}))
    leases = [Lease(run(policy.choose(eps, request)), 0.0, 0.0) for _ in range(40)]
    assert max(e.in_flight for e in eps) <= math.ceil(1.25 * 40 / 4)
    for lease in leases:
        lease.release(0.0)
    # idle again: the same prefix goes back to its home endpoint every time
    assert len({run(policy.choose(eps, request)).url for _ in range(5)}) == 1


def test_prefix_policy_groups_land_on_distinct_homes_and_are_stable():
    policy, eps = PrefixPolicy(), endpoints(4)
    homes = {}
    for g in range(16):
        req = RoutingRequest(MODEL, shape=shape({"prompt": f"tenant {g} " * 40 + "question"}))
        homes[g] = run(policy.choose(eps, req)).url
        assert run(policy.choose(eps, req)).url == homes[g]
    assert len(set(homes.values())) >= 3


# ------------------------------------------------------------------ predictor

def test_rls_learns_a_linear_law_and_keeps_weights_non_negative():
    rng = random.Random(1)
    model = RLSModel((0.0, 0.0))
    truth = (0.02, 0.8)
    for _ in range(400):
        x = rng.uniform(0, 4)
        model.update(x, (truth[0] + truth[1] * x) * rng.uniform(0.95, 1.05))
    assert model.predict(2.0) == pytest.approx(truth[0] + truth[1] * 2.0, rel=0.05)
    assert model.w[1] == pytest.approx(0.8, rel=0.05)
    for _ in range(50):  # adversarial data: more load, faster answers
        model.update(4.0, 0.0)
    assert all(w >= 0 for w in model.w) and model.predict(2.0) >= 0
    with pytest.raises(ValueError, match="3 prior weights"):
        RLSModel((0.0, 0.0, 0.0))


def test_rls_matches_the_closed_form_least_squares_without_forgetting():
    """λ = 1 and a wide prior: RLS is ordinary least squares (the prior's pull vanishes)."""
    rng = random.Random(2)
    model = RLSModel((0.0, 0.0), forgetting=1.0, prior_variance=1e6, max_trace=1e9)
    xs = [rng.uniform(0, 10) for _ in range(200)]
    ys = [0.3 + 0.05 * x + rng.gauss(0, 0.01) for x in xs]
    for x, y in zip(xs, ys):
        model.update(x, y)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert model.w[1] == pytest.approx(slope, rel=1e-4)
    assert model.w[0] == pytest.approx(my - slope * mx, rel=1e-4)


def test_rls_covariance_stays_bounded_without_excitation():
    model = RLSModel((0.1, 0.1), forgetting=0.9, max_trace=100.0)
    for _ in range(5000):
        model.update(0.0, 0.1)  # the feature never moves
    a, _, c = model.p
    assert a + c <= 100.0 + 1e-9
    assert model.predict(0.0) == pytest.approx(0.1, rel=1e-3)


def test_rls_ignores_non_finite_observations():
    model = RLSModel((0.1, 0.1))
    model.update(math.nan, 1.0)
    model.update(1.0, math.inf)
    assert model.updates == 0 and model.w == [0.1, 0.1]


def test_error_tracker_mape_over_a_window():
    tracker = ErrorTracker(window=3)
    assert tracker.mape == 0
    for predicted, observed in ((1.0, 1.0), (1.5, 1.0), (0.5, 1.0)):
        tracker.observe(predicted, observed)
    assert tracker.mape == pytest.approx((0 + 0.5 + 0.5) / 3)
    tracker.observe(2.0, 1.0)  # the first (0 error) leaves the window
    assert tracker.mape == pytest.approx((0.5 + 0.5 + 1.0) / 3) and len(tracker) == 3


# ------------------------------------------------------------------ slo

def test_slo_pick_packs_on_cached_prefix_while_the_slo_holds():
    # w0 is busier but holds the prefix and still meets the 1 s budget: packed there
    assert slo_pick([0.8, 0.2, 0.3], [6, 0, 0], budget_s=1.0) == 0
    # w0 would miss the budget: most headroom among the feasible
    assert slo_pick([1.2, 0.4, 0.3], [6, 0, 0], budget_s=1.0) == 2
    # none feasible: lowest prediction
    assert slo_pick([3.0, 2.0, 2.5], [6, 0, 0], budget_s=1.0) == 1
    # no objective: everything is feasible
    assert slo_pick([5.0, 1.0], [2, 0], budget_s=math.inf) == 0
    # ITL objective: exclude the replica with too many decodes, unless nothing is left
    assert slo_pick([0.1, 0.2], [0, 0], 1.0, predicted_itl=[0.09, 0.03], itl_slo_s=0.05) == 1
    assert slo_pick([0.1, 0.2], [0, 0], 1.0, predicted_itl=[0.09, 0.08], itl_slo_s=0.05) == 0
    # exact ties rotate
    assert [slo_pick([0.1, 0.1, 0.1], [0, 0, 0], 1.0, start=s) for s in range(3)] == [0, 1, 2]


def test_slo_predictions_use_queued_prefill_running_and_cached_prefix():
    eps = endpoints(2)
    index = PrefixIndex()
    system = "shared system prompt. " * 40
    request = RoutingRequest(MODEL, shape=shape({"prompt": system + "q1"}))
    index.record(request.shape.blocks, eps[0].url)
    p = predict_all(eps, request, index, now=0.0)
    assert p[0].cached_blocks == len(request.shape.blocks) and p[1].cached_blocks == 0
    assert p[0].ttft_s < p[1].ttft_s  # fewer uncached tokens
    Lease(eps[0], 5_000, 0.0)  # a long prefill queued ahead on w0
    p = predict_all(eps, request, index, now=0.0)
    assert p[0].ttft_s > p[1].ttft_s
    eps[1].reported = WorkerLoad(running=3, queued_prefill_tokens=9_000, at=1e12)  # fresh
    assert predict_all(eps, request, index, now=1e12)[1].features.queued_prefill_tokens == pytest.approx(9000)
    assert predict_all(eps, request, index, now=1e12 + 60)[1].features.queued_prefill_tokens == 0  # stale


def test_shortlist_draws_d_candidates_past_d_and_keeps_the_prefix_holders():
    index, rng = PrefixIndex(), random.Random(1)
    request = RoutingRequest(MODEL, shape=shape({"prompt": "x" * 2000}))
    few = endpoints(SHORTLIST)
    assert shortlist(few, request, index, rng) is few  # up to d: every candidate
    fleet = endpoints(1000)
    index.record(request.shape.blocks, "http://w737")
    drawn = [shortlist(fleet, request, index, rng) for _ in range(200)]
    for picked in drawn:
        assert len(picked) in (SHORTLIST, SHORTLIST + 1) and fleet[737] in picked
        assert picked == sorted(picked, key=fleet.index)  # in the candidates' order
    counts = Counter(e.url for picked in drawn for e in picked if e is not fleet[737])
    assert len(counts) > 900  # uniform draws: 200 x 16 of 1,000 reach nearly all


def test_slo_policy_at_1000_candidates_predicts_a_shortlist_and_keeps_prefix_affinity(
        monkeypatch):
    """Past SHORTLIST candidates the policy predicts for d drawn ones plus the prefix's
    holders, not for all: a request whose prefix w737 holds still goes there."""
    import sluice.router.policy as policy_module
    predicted = []
    real = policy_module.predict_all
    monkeypatch.setattr(policy_module, "predict_all", lambda candidates, *a, **k: (
        predicted.append(len(candidates)), real(candidates, *a, **k))[1])
    policy, fleet = SLOPolicy(), endpoints(1000)
    request = RoutingRequest(MODEL, shape=shape({"prompt": "x" * 2000}), ttft_slo_s=1.0,
                             deadline=policy.context.clock() + 1.0)
    policy.context.prefix_index.record(request.shape.blocks, "http://w737")
    assert run(policy.choose(fleet, request)).url == "http://w737"
    assert predicted == [SHORTLIST + 1]


def test_slo_policy_follows_the_observed_drain_rates():
    """w0 works off prefill ten times faster than w1: a busier w0 still answers sooner."""
    eps = endpoints(2)
    policy = SLOPolicy()
    for ep, tokens_per_s in ((eps[0], 10_000.0), (eps[1], 1_000.0)):
        ep.drain.advance(0.0, True)
        ep.drain.advance(10.0, True)  # busy 10 s...
        ep.drain.drained(tokens_per_s * ep.drain.busy_s)  # ...at this rate
        assert ep.drain.rate() == pytest.approx(tokens_per_s)
    Lease(eps[0], 500, 10.0)  # w0: 0.03 + 0.6k / 10k ≈ 0.09 s; idle w1: 0.03 + 0.1 ≈ 0.13 s
    request = RoutingRequest(MODEL, shape=shape({"prompt": "x" * 400}), deadline=None)
    assert run(policy.choose(eps, request)).url == "http://w0"  # least-load would pick w1
    Lease(eps[0], 2_500, 10.0)  # w0: ≈ 0.34 s
    assert run(policy.choose(eps, request)).url == "http://w1"


def test_budget_from_deadline():
    assert RoutingRequest(MODEL).budget_s(5.0) == math.inf
    assert RoutingRequest(MODEL, deadline=10.0).budget_s(9.5) == 0.5


def test_a_new_endpoint_predicts_with_the_fleet_model_until_it_has_its_own():
    from sluice.router.policy import MIN_OWN_UPDATES, predict
    from sluice.router.predictor import LatencyModel

    fleet, ep = LatencyModel(), Endpoint("http://new")
    x_shape = shape({"prompt": "y" * 4000})  # 1,000 tokens
    for _ in range(100):  # the fleet learnt: 2 s for 1k uncached tokens at the prior rate
        fleet.fit_ttft(TTFTFeatures(0, 1000), 2.0)
    assert predict(ep, x_shape, 0, 0.0, fleet).ttft_s == pytest.approx(2.0, rel=0.1)
    assert predict(ep, x_shape, 0, 0.0).ttft_s < 1.0  # the prior alone
    for _ in range(MIN_OWN_UPDATES):
        ep.latency.fit_ttft(TTFTFeatures(0, 1000), 0.5)
    assert predict(ep, x_shape, 0, 0.0, fleet).ttft_s == pytest.approx(0.5, rel=0.2)


def test_a_fresh_endpoint_takes_one_prefill_at_a_time_until_its_rate_is_measured():
    """The burst that met a fresh one-thread worker (bench/autoscale.py, 2026-12-05): the
    measured w0 drains 300 tokens/s and has one prefill queued; the fresh w1 took the first
    of the burst. Predicted at the 2,500 tokens/s prior, w1 looked faster and took four of
    five; now it takes no second prefill until its own rate is known."""
    from sluice.router.policy import predict

    measured, fresh = endpoints(2)
    measured.drain.advance(0.0, True)
    measured.drain.advance(10.0, True)
    measured.drain.drained(300.0 * measured.drain.busy_s)
    request = RoutingRequest(MODEL, shape=shape({"prompt": "x" * 400}), deadline=20.0)
    policy = SLOPolicy()
    Lease(measured, 100, 10.0)
    lease = Lease(fresh, 100, 10.0)
    ttft = [p.ttft_s for p in predict_all([measured, fresh], request, PrefixIndex(), 10.0)]
    assert ttft == [pytest.approx(0.03 + 200 / 300, rel=0.01), math.inf]
    assert predict(fresh, request.shape, 0, 10.0).ttft_s < 0.2  # a cold fleet: the prior
    picks = [run(policy.choose([measured, fresh], request)).url for _ in range(3)]
    assert picks == ["http://w0"] * 3  # (least-load and the prior would have picked w1)
    lease.first_token(12.0)  # its first prefill: 100 tokens in 2 s of busy time
    rate = 100 / (fresh.drain.horizon_s * (1 - math.exp(-2 / fresh.drain.horizon_s)))
    assert fresh.drain.rate() == pytest.approx(rate)  # (2 busy s, exponentially weighted)
    assert predict(fresh, request.shape, 0, 12.0, one_at_a_time=True).ttft_s == \
        pytest.approx(0.03 + 100 / rate)


def test_the_gate_opens_on_a_worker_whose_plain_answer_is_past_its_prefill():
    """A plain (not streamed) answer counts as prefilling at the router until it arrives
    whole, so a worker decoding one long plain answer closed the gate to everything else
    (the break-it pass of 2026-12-05: 1 req/s of plain requests through the router, e2e p50
    14.1 s against 7.5 s direct). A load report the worker sent after the router's last
    request there, with nothing waiting to prefill, opens it; an older one does not."""
    from sluice.router.policy import gate_open

    (ep,) = endpoints(1)
    request = RoutingRequest(MODEL, shape=shape({"prompt": "x" * 400}), deadline=10.0)
    Lease(ep, 50_000, 1.0)  # predicted 20 s at the prior drain rate: past the 8 s budget
    assert not gate_open([ep], request, PrefixIndex(), 2.0)[0]
    ep.reported = WorkerLoad(running=1, waiting=0, queued_prefill_tokens=0, at=0.5)
    assert not gate_open([ep], request, PrefixIndex(), 2.0)[0]  # sent before the report
    ep.reported = WorkerLoad(running=1, waiting=0, queued_prefill_tokens=0, at=1.5)
    assert gate_open([ep], request, PrefixIndex(), 2.0) == (True, None)
    ep.reported = WorkerLoad(running=1, waiting=1, queued_prefill_tokens=400, at=1.5)
    assert not gate_open([ep], request, PrefixIndex(), 2.0)[0]  # one waits there
    ep.reported = WorkerLoad(running=1, waiting=0, queued_prefill_tokens=0, at=1.5)
    Lease(ep, 100, 1.8)  # sent after the report: it says nothing of this one
    assert not gate_open([ep], request, PrefixIndex(), 2.0)[0]


def test_an_infinite_prediction_is_no_error_sample():
    tracker = ErrorTracker(window=3)
    tracker.observe(math.inf, 1.0)
    assert len(tracker) == 0 and tracker.mape == 0
    tracker.observe(1.5, 1.0)
    assert tracker.mape == pytest.approx(0.5)


def test_ttft_follows_the_observed_drain_rate_of_a_queue():
    """A replica works off prefill first come, first served at R tokens/s (plus 10 ms for
    the first decode step) at 80 % utilisation; halfway R drops from 4,000 to 1,000 tokens/s
    (another tenant took the GPU). Predicting TTFT as the work ahead plus its own over the
    observed drain rate stays within 20 % MAPE in each phase once the rate is learnt."""
    from sluice.router.policy import predict
    from sluice.router.predictor import LatencyModel
    from sluice.router.prefix import PromptShape

    rng = random.Random(7)
    ep, fleet = Endpoint("http://w0"), LatencyModel()
    phases = [ErrorTracker(window=150), ErrorTracker(window=150)]
    pending: list = []  # FCFS: first tokens come in sending order
    t = free_at = 0.0

    def first_tokens(until: float) -> None:
        while pending and pending[0][0] <= until:
            at, lease, sent, prediction, phase = pending.pop(0)
            lease.first_token(at)
            lease.release(at)
            ep.latency.fit_ttft(prediction.features, at - sent)
            fleet.fit_ttft(prediction.features, at - sent)
            if phase is not None:
                phase.observe(prediction.ttft_s, at - sent)

    for i in range(600):
        rate = 4000.0 if i < 300 else 1000.0
        t += rng.expovariate(0.8 * rate / (275 + 10 * rate / 1000))
        first_tokens(t)
        own = rng.randint(50, 500)
        prediction = predict(ep, PromptShape(tokens=own), 0, t, fleet)
        assert prediction.features.uncached_prompt_tokens == own
        free_at = max(t, free_at) + own / rate + 0.01
        pending.append((free_at, Lease(ep, own, t), t, prediction,
                        phases[i // 300] if i % 300 >= 150 else None))
    first_tokens(math.inf)
    assert all(p.mape <= 0.2 for p in phases), [p.mape for p in phases]
    assert 700 < ep.drain.rate() < 1300  # tokens/s, the second phase's
