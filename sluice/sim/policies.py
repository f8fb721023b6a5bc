"""Autoscaling policies side by side: Sluice's (the production ``recommend``), baselines
modelled on published autoscalers, and a fixed count.

Each policy sees a ``Tick`` every ``interval_s`` seconds of virtual time (what its real
counterpart would scrape) and returns the replicas it wants. The simulator applies it the
same way for all: new replicas boot, removed ones drain (``sluice.sim.simulator``).

    static          a fixed count (default: the oracle's peak)
    sluice          sluice.autoscale.policy.recommend, every 2 s (knob tick; sluice up: 0.5 s)
    kubeai          KubeAI: ceil(moving average of in-flight requests (at its proxy: sent,
                    queued or held) over timeWindow ÷
                    targetRequests), every 10 s, window 10 min, scale-down delay 30 s
                    (kubeai.org docs, "Autoscaling"; model spec targetRequests)
    kpa             Knative KPA: average concurrency over a 60 s stable window and a 6 s panic
                    window (10 %), desired = ceil(avg ÷ (target × 0.7 utilisation)); panic when
                    the panic desire ≥ 2× ready (200 %), no scale-down while panicking (60 s);
                    scale-down at most halves per 2 s tick; zero after 30 s grace
                    (knative.dev docs, "Configuring the autoscaler"; pkg/autoscaler/scaling)
    keda            KEDA → HPA on vllm:num_requests_waiting, AverageValue threshold 5 (vLLM
                    production-stack's default): desired = ceil(Σ waiting ÷ threshold), 10 %
                    tolerance, HPA sync 15 s, scale-up ≤ max(4 pods, 100 %) per 15 s, 300 s
                    scale-down stabilisation (Kubernetes HPA v2 algorithm and behavior
                    defaults; keda.sh Prometheus scaler)
    dynamo          NVIDIA Dynamo planner (throughput-based): every 180 s, the last interval's
                    arrival rate (constant predictor) ÷ one replica's rate at full utilisation
                    (× util) (ai-dynamo docs, "Planner": SLA planner, adjustment interval)
    dynamo-reactive the same, plus the load planner's ±1 loop every 10 s: +1 when mean KV usage
                    > 0.9 or requests wait, −1 when KV usage < 0.5 and none wait
    oracle          a clairvoyant schedule from the trace (``oracle.py``)

Knobs: ``name:key=value,key=value`` (see ``KNOBS``), e.g. ``kpa:target=10``.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from sluice.autoscale.policy import Config, Observation, State, recommend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tick:
    """What a policy observes at ``now`` (counts since its previous tick; gauges now).

    Attributes:
        now: virtual seconds.
        window_s: seconds since the previous tick.
        arrivals / refused: requests that arrived / were refused in the window.
        ttft_met, ttft_total, itl_met, itl_total: SLO verdicts in the window.
        held: requests waiting for a ready replica (none ready).
        queued: requests in the router's admission queue (its gate refused them so far).
        in_flight: requests sent to replicas and not finished (router leases).
        waiting: requests waiting for their prefill: in the engines' queues
            (vllm:num_requests_waiting), and in the router's admission queue, where Sluice's
            router holds what a router that does not queue (vLLM production-stack's, which
            KEDA and Dynamo's load planner run behind) would have put in the engines'.
        kv_usage: mean KV usage over ready replicas, 0..1.
        ready / starting: replicas routable / booting (draining ones excluded).
    """

    now: float
    window_s: float
    arrivals: int = 0
    refused: int = 0
    ttft_met: int = 0
    ttft_total: int = 0
    itl_met: int = 0
    itl_total: int = 0
    held: int = 0
    queued: int = 0
    in_flight: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    ready: int = 0
    starting: int = 0

    @property
    def current(self) -> int:
        return self.ready + self.starting


class Policy(Protocol):
    interval_s: float

    def decide(self, tick: Tick) -> int:
        """Desired replicas (the simulator clamps to [0, max_replicas])."""
        ...


@dataclass
class Context:
    """What policies may be sized from (the same for all).

    Attributes:
        capacity_rps: one replica's request rate meeting the SLO at its percentile.
        max_rps: one replica's request rate at full utilisation (saturated).
        boot_s: mean boot time, s.
        max_replicas: the fleet's cap.
        peak: the oracle's peak replicas (the static default).
        attainment_target: fraction of requests that must meet the SLO.
    """

    capacity_rps: float
    max_rps: float
    boot_s: float
    max_replicas: int
    peak: int
    attainment_target: float = 0.99


class Static:
    interval_s = 3600.0

    def __init__(self, ctx: Context, replicas: float | None = None):
        self.replicas = int(replicas) if replicas is not None else ctx.peak

    def decide(self, tick: Tick) -> int:
        return self.replicas


MIN_TICK_S = 0.1  # no driver decides faster; a tick of 1e-6 s made a 20-request run crawl


class Sluice:
    """The production policy (``recommend``), deciding every ``tick`` seconds (default 2,
    between ``sluice up``'s 0.5 and the operator's 5).

    Knobs: down (scale-down stabilisation, s: the main knob, the one a user tunes to trade
    replica-hours for attainment; default the spec's 300), cap (× the calibrated
    capacity_rps), zero (1: scale to zero after idle_s), margin (``Config.down_margin``),
    tick (s between decisions).
    """

    def __init__(self, ctx: Context, cap: float = 1.0, zero: float = 0, down: float = 300.0,
                 idle: float = 300.0, margin: float = Config.down_margin, tick: float = 2.0):
        if tick < MIN_TICK_S:
            raise ValueError(f"knob tick of sluice must be >= {MIN_TICK_S:g} s, got {tick:g}")
        self.interval_s = tick
        self.config = Config(min_replicas=0 if zero else 1, max_replicas=ctx.max_replicas,
                             scale_to_zero=bool(zero), idle_s=idle, scale_down_window_s=down,
                             down_margin=margin,
                             capacity_rps=ctx.capacity_rps * cap,
                             attainment_target=ctx.attainment_target, boot_s=ctx.boot_s)
        self.state: State | None = None

    def decide(self, tick: Tick) -> int:
        if self.state is None:
            self.state = State.initial(tick.current, self.config, tick.now)
        obs = Observation(window_s=tick.window_s, arrivals=tick.arrivals, rejected=tick.refused,
                          ttft_met=tick.ttft_met, ttft_total=tick.ttft_total,
                          itl_met=tick.itl_met, itl_total=tick.itl_total, held=tick.held,
                          queued=tick.queued, in_flight=tick.in_flight, ready=tick.ready,
                          starting=tick.starting)
        decision = recommend(obs, self.state, self.config, tick.now)
        self.state = decision.state
        return decision.replicas


class KubeAI:
    """Knobs: target (requests per replica; KubeAI's default is 100), window (s), min."""

    interval_s = 10.0

    def __init__(self, ctx: Context, target: float = 32, window: float = 600.0,
                 delay: float = 30.0, min: float = 0):
        self.target, self.delay, self.min = target, delay, int(min)
        self.samples: deque[float] = deque(maxlen=max(1, int(window / self.interval_s)))
        self.below_since: float | None = None

    def decide(self, tick: Tick) -> int:
        self.samples.append(tick.in_flight + tick.queued + tick.held)
        desired = max(self.min, math.ceil(sum(self.samples) / len(self.samples) / self.target))
        if tick.held and desired == 0:
            desired = 1
        if desired >= tick.current:
            self.below_since = None
            return desired
        if self.below_since is None:
            self.below_since = tick.now
        return desired if tick.now - self.below_since >= self.delay else tick.current


class KPA:
    """Knobs: target (concurrency per replica; Knative's default is 100), util (0.7),
    min (0: scale to zero after the 30 s grace)."""

    interval_s = 2.0
    STABLE_S, PANIC_S, PANIC_THRESHOLD, MAX_DOWN_RATE, GRACE_S = 60.0, 6.0, 2.0, 2.0, 30.0

    def __init__(self, ctx: Context, target: float = 32, util: float = 0.7, min: float = 0):
        self.target, self.min = target * util, int(min)
        self.samples: deque[tuple[float, float]] = deque()
        self.panic_until = -math.inf
        self.last_active = 0.0

    def decide(self, tick: Tick) -> int:
        now, load = tick.now, tick.in_flight + tick.queued + tick.held
        self.samples.append((now, load))
        while self.samples[0][0] <= now - self.STABLE_S:
            self.samples.popleft()
        stable = sum(v for _, v in self.samples) / len(self.samples)
        recent = [v for t, v in self.samples if t > now - self.PANIC_S]
        panic = sum(recent) / len(recent)
        want_stable, want_panic = math.ceil(stable / self.target), math.ceil(panic / self.target)
        if want_panic >= self.PANIC_THRESHOLD * max(1, tick.ready) and want_panic > tick.ready:
            self.panic_until = now + self.STABLE_S
        if now < self.panic_until:
            desired = max(want_panic, want_stable, tick.current)
        else:
            desired = max(want_stable, math.floor(tick.current / self.MAX_DOWN_RATE))
        if load:
            self.last_active = now
        if desired == 0 and (self.min or now - self.last_active < self.GRACE_S):
            desired = max(self.min, 1)
        return max(desired, self.min)


class KEDA:
    """Knobs: threshold (waiting requests per replica, 5), min (1)."""

    interval_s = 15.0
    TOLERANCE, DOWN_WINDOW_S = 0.1, 300.0

    def __init__(self, ctx: Context, threshold: float = 5, min: float = 1):
        self.threshold, self.min = threshold, int(min)
        self.history: deque[tuple[float, int]] = deque()

    def decide(self, tick: Tick) -> int:
        current = max(1, tick.current)
        ratio = tick.waiting / current / self.threshold
        raw = tick.current if abs(ratio - 1) <= self.TOLERANCE else \
            math.ceil(tick.waiting / self.threshold)
        raw = max(self.min, min(raw, max(2 * current, current + 4)))
        self.history.append((tick.now, raw))
        while self.history[0][0] < tick.now - self.DOWN_WINDOW_S:
            self.history.popleft()
        if raw < tick.current:  # the highest recommendation of the window
            return min(tick.current, max(r for _, r in self.history))
        return raw


class Dynamo:
    """Knobs: util (fraction of full-utilisation rate to plan for, 1.0), interval (180 s),
    reactive (1: the ±1 load loop every 10 s)."""

    def __init__(self, ctx: Context, util: float = 1.0, interval: float = 180.0,
                 reactive: float = 0):
        self.rate_per_replica = ctx.max_rps * util
        self.plan_every, self.reactive = interval, bool(reactive)
        self.interval_s = 10.0 if reactive else interval
        self.arrivals, self.since, self.planned = 0, 0.0, None

    def decide(self, tick: Tick) -> int:
        self.arrivals += tick.arrivals
        self.since += tick.window_s
        desired = tick.current if self.planned is None else self.planned
        if self.since >= self.plan_every - 1e-9:
            desired = max(1, math.ceil(self.arrivals / self.since / self.rate_per_replica))
            self.arrivals, self.since = 0, 0.0
        elif self.reactive:
            if tick.kv_usage > 0.9 or tick.waiting > 0:
                desired = tick.current + 1
            elif tick.kv_usage < 0.5:
                desired = max(1, tick.current - 1)
        self.planned = desired
        return desired


POLICIES = {"static": Static, "sluice": Sluice, "kubeai": KubeAI, "kpa": KPA, "keda": KEDA,
            "dynamo": Dynamo}
KNOBS = {"static": "replicas", "sluice": "down", "kubeai": "target", "kpa": "target",
         "keda": "threshold", "dynamo": "util", "dynamo-reactive": "util"}


# knobs that divide (and static's fleet: 0 replicas serve nothing), and replica counts
POSITIVE = frozenset(("target", "threshold", "util", "cap", "interval", "window", "replicas",
                      "tick"))
WHOLE = frozenset(("replicas", "min"))


def parse(spec: str) -> tuple[str, dict[str, float]]:
    """``"kpa:target=10,util=0.7"`` → ("kpa", {"target": 10.0, "util": 0.7}).

    Raises:
        ValueError: an unknown policy, a malformed knob, a knob given twice, a knob out
            of range (negative, zero where it divides, a fractional replica count), or a
            knob of the oracle (it takes none).
    """
    name, _, rest = spec.partition(":")
    if name not in POLICIES and name not in ("dynamo-reactive", "oracle"):
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(KNOBS)}, oracle")
    knobs = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"knob {item!r} of {spec!r} is not key=value")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"knob {key} of {spec!r}: {value!r} is not a number") from None
        if not math.isfinite(number) or number < 0 or (key in POSITIVE and number == 0):
            raise ValueError(f"knob {key} of {spec!r} must be "
                             f"{'> 0' if key in POSITIVE else '≥ 0'}, got {value}")
        if key in WHOLE and number != int(number):
            raise ValueError(f"knob {key} of {spec!r} is a count, got {value}")
        if key in knobs:
            raise ValueError(f"knob {key} of {spec!r} is given twice")
        knobs[key] = number
    if name == "oracle" and knobs:
        raise ValueError(f"the oracle takes no knobs, got {spec!r} (--oracle-step and "
                         "--oracle-passes set its interval and replays)")
    return name, knobs


def default(name: str, knob: str) -> float | None:
    """The value policy ``name`` gives ``knob`` when it is not set."""
    cls = POLICIES["dynamo" if name == "dynamo-reactive" else name]
    return inspect.signature(cls).parameters[knob].default


def make(name: str, knobs: dict[str, float], ctx: Context) -> Policy:
    """The policy ``name`` (not the oracle) with ``knobs``.

    Raises:
        ValueError: a knob the policy does not take.
    """
    if name == "dynamo-reactive":
        name, knobs = "dynamo", {"reactive": 1, **knobs}
    takes = list(inspect.signature(POLICIES[name]).parameters)[1:]  # after ctx
    unknown = [k for k in knobs if k not in takes]
    if unknown:
        raise ValueError(f"policy {name} has no knob {unknown[0]!r} (its knobs: "
                         f"{', '.join(takes)})")
    return POLICIES[name](ctx, **knobs)
