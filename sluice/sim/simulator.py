"""The discrete-event loop: a trace's requests through the simulated router onto replicas,
and an autoscaling policy moving the replica count, all on one virtual clock (seconds).

    arrivals (trace, in order) ─▶ router.admits ─▶ router.choose ─▶ replica.add ─▶ step ends
            │ refused: the router's queue ──▲ kick            (heap) ─▶ first token / finished:
            └────────────────────────────────┴──── SLO verdicts, the router learns ◀──┘
    policy ticks (heap, every interval_s) ─▶ Tick ─▶ decide ─▶ start (boot) / drain replicas

Events are (time, order, kind, replica, version) in a ``heapq``; arrivals are read from the
sorted trace beside it, not pushed. A replica's pending step end is replaced by bumping its
``version`` (stale events are skipped). Replicas are billed from start to stop; they take
requests once ready (boot time: mean × U[1 − jitter, 1 + jitter]); a removed replica first
stops taking requests, then stops when its last one finishes (a booting one stops at once).
With no replica ready, requests are held up to ``hold_s`` (then refused), and join the
router's admission queue as soon as one turns ready. A request the admission gate refuses
waits in that queue, in arrival order, up to ``queue_timeout_s`` from when it joined (then
refused, as the router's 429); every first token, end, replica turning ready and poll
re-checks the queue's head. The queue is not bounded (the router's ``--max-queue`` is a
deployment's choice).
"""

from __future__ import annotations

import heapq
import logging
import math
import random
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.sim.policies import Policy, Tick
from sluice.sim.profile import StepModel
from sluice.sim.replica import EngineLimits, Replica, Seq
from sluice.sim.router import SimRouter
from sluice.sim.trace import Trace

logger = logging.getLogger(__name__)

STEP, READY, TICK, SAMPLE, POLL = 0, 1, 2, 3, 4
BOOTING, SERVING, DRAINING, STOPPED = 0, 1, 2, 3


@dataclass(frozen=True)
class SimConfig:
    """Attributes:
        boot_s: mean seconds from start to ready; boot_jitter: relative spread (uniform).
        max_replicas: the fleet's cap.
        ttft_slo_s / itl_slo_s: objectives (a request's TTFT; its mean inter-token gap).
        hold_s: seconds a request waits for a ready replica before it is refused.
        queue_timeout_s: seconds a request waits in the router's admission queue before it
            is refused (the router's ``--queue-timeout`` default).
        routing / candidates: the router's policy and its sampled candidates (0: all).
        limits: the engine's scheduling limits.
        sample_s: seconds between timeline samples (and the expiry checks of requests held
            or queued).
        poll_s: seconds between the router's polls of every ready replica's load (its
            ``/metrics`` poll; responses also carry it, at first tokens and ends).
        seed: random seed (boot jitter, candidate sampling).
    """

    boot_s: float = 30.0
    boot_jitter: float = 0.2
    max_replicas: int = 1000
    ttft_slo_s: float = 2.0
    itl_slo_s: float | None = 0.2
    hold_s: float = 120.0
    queue_timeout_s: float = 60.0
    routing: str = "least-load"
    candidates: int = 4
    limits: EngineLimits = field(default_factory=EngineLimits)
    sample_s: float = 5.0
    poll_s: float = 1.0
    seed: int = 0

    @property
    def boot_max_s(self) -> float:
        return self.boot_s * (1 + self.boot_jitter)


@dataclass
class Result:
    """One run. Per request (indexed like the trace): arrival, first token and finish
    times (s; NaN when refused), output tokens; per replica: start and stop (s); the
    timeline: (t, billed, ready, in flight, held: waiting at the router, for a ready replica
    or in its admission queue) samples; counts; the router's TTFT predictions' MAPE (0.25 =
    25 %)."""

    arrival_s: list[float]
    output: list[int]
    first_s: array
    done_s: array
    refused: int
    starts: list[float]
    stops: list[float]
    timeline: list[tuple[float, int, int, int, int]]
    scale_events: int
    end_s: float
    events: int
    prefix_hit_tokens: int
    preemptions: int
    ttft_mape: float


class Simulator:
    """Args:
        trace: the requests.
        model: the replicas' step model.
        config: see ``SimConfig``.
        policy: the autoscaling policy.
        initial: replicas ready at time 0.
        progress: called with (requests done or refused, virtual now) now and then.
    """

    def __init__(self, trace: Trace, model: StepModel, config: SimConfig, policy: Policy,
                 initial: int, progress: Callable[[int, float], None] | None = None):
        self.trace, self.model, self.config, self.policy = trace, model, config, policy
        self.progress = progress
        self.rng = random.Random(config.seed)
        self.router = SimRouter(config.routing, config.candidates, config.ttft_slo_s,
                                config.itl_slo_s, trace.block_tokens, config.seed)
        n = len(trace)
        self.first_s = array("d", [math.nan]) * n
        self.done_s = array("d", [math.nan]) * n
        self.sent_s = array("d", [0.0]) * n
        self.replicas: list[Replica] = []
        self.status: list[int] = []
        self.starts: list[float] = []
        self.stops: list[float] = []
        self.booting: dict[int, float] = {}  # index → ready time
        self.held: deque[int] = deque()  # no replica ready
        self.queued: deque[tuple[int, float]] = deque()  # the router's queue: (rid, since)
        self.heap: list[tuple[float, int, int, int, int]] = []
        self._order = 0
        self.counts = dict.fromkeys(("arrivals", "refused", "ttft_met", "ttft_total",
                                     "itl_met", "itl_total"), 0)
        self._last_counts = dict(self.counts)
        self._last_tick = 0.0
        self.finished = 0
        self.scale_events = 0
        self.timeline: list[tuple[float, int, int, int, int]] = []
        self.in_flight = 0
        for _ in range(min(initial, config.max_replicas)):
            self._start(0.0, boot_s=0.0)

    # ------------------------------------------------------------------ the loop

    def run(self) -> Result:
        trace, heap, n, policy = self.trace, self.heap, len(self.trace), self.policy
        arrivals = trace.arrival_s
        self._push(policy.interval_s, TICK)  # the first window starts at 0
        self._push(0.0, SAMPLE)
        self._push(0.0, POLL)
        i, now, events = 0, 0.0, 0
        while self.finished < n:
            if heap and (i >= n or heap[0][0] <= arrivals[i]):
                now, _, kind, index, version = heapq.heappop(heap)
                if kind == STEP:
                    replica = self.replicas[index]
                    if version == replica.version and replica.busy_until is not None:
                        self._step_end(replica, now)
                elif kind == READY:
                    self._ready(index, now)
                elif kind == TICK:
                    self._tick(now)
                elif kind == POLL:
                    self._poll(now)
                else:
                    self._sample(now)
            else:
                now = arrivals[i]
                self.counts["arrivals"] += 1
                if not self.router.ready:
                    self.held.append(i)
                elif self.queued or not self._admits(i, now):
                    self.queued.append((i, now))
                else:
                    self._send(i, now)
                i += 1
            events += 1
            if self.progress is not None and events % 4096 == 0:
                self.progress(self.finished, now)
        for index, status in enumerate(self.status):
            if status != STOPPED:
                self.stops[index] = now
        if self.progress is not None:
            self.progress(self.finished, now)
        return Result(list(arrivals), list(trace.output), self.first_s, self.done_s,
                      self.counts["refused"], self.starts, self.stops, self.timeline,
                      self.scale_events, now, events,
                      sum(r.prefix_hit_tokens for r in self.replicas),
                      sum(r.preemptions for r in self.replicas), self.router.errors.mape)

    def _push(self, t: float, kind: int, index: int = -1, version: int = 0) -> None:
        self._order += 1
        heapq.heappush(self.heap, (t, self._order, kind, index, version))

    # ------------------------------------------------------------------ requests

    def _admits(self, rid: int, now: float) -> bool:
        trace = self.trace
        return self.router.admits(rid, trace.prompt[rid], trace.blocks[rid],
                                  trace.arrival_s[rid], now)

    def _kick(self, now: float) -> None:
        """Send the queue's head while the gate lets it through (``Dispatcher.kick``)."""
        queued = self.queued
        while queued and self.router.ready and self._admits(queued[0][0], now):
            self._send(queued.popleft()[0], now)

    def _send(self, rid: int, now: float) -> None:
        trace = self.trace
        index = self.router.choose(rid, trace.prompt[rid], trace.blocks[rid],
                                   trace.arrival_s[rid], now)
        self.sent_s[rid] = now
        self.in_flight += 1
        replica = self.replicas[index]
        end = replica.add(Seq(rid, trace.prompt[rid], trace.output[rid], trace.blocks[rid]), now)
        if end is not None:
            self._push(end, STEP, index, replica.version)

    def _step_end(self, replica: Replica, now: float) -> None:
        first, done, end = replica.step_end(now)
        counts, cfg, router = self.counts, self.config, self.router
        for seq in first:
            rid = seq.rid
            self.first_s[rid] = now
            counts["ttft_total"] += 1
            counts["ttft_met"] += now - self.trace.arrival_s[rid] <= cfg.ttft_slo_s
            router.first_token(rid, now - self.sent_s[rid], replica, now)
        for seq in done:
            rid = seq.rid
            self.done_s[rid] = now
            self.finished += 1
            self.in_flight -= 1
            out = self.trace.output[rid]
            gap = (now - self.first_s[rid]) / (out - 1) if out > 1 else None
            if gap is not None and cfg.itl_slo_s is not None:
                counts["itl_total"] += 1
                counts["itl_met"] += gap <= cfg.itl_slo_s
            router.finished(rid, gap, replica, now)
        if end is not None:
            self._push(end, STEP, replica.index, replica.version)
        elif self.status[replica.index] == DRAINING and not replica.num_seqs:
            self._stop(replica.index, now)
        if (first or done) and self.queued:
            self._kick(now)

    # ------------------------------------------------------------------ replicas

    def _start(self, now: float, boot_s: float | None = None) -> None:
        index = len(self.replicas)
        self.replicas.append(Replica(index, self.model, self.config.limits,
                                     self.trace.block_tokens))
        self.status.append(BOOTING)
        self.starts.append(now)
        self.stops.append(math.inf)
        if boot_s is None:
            j = self.config.boot_jitter
            boot_s = self.config.boot_s * self.rng.uniform(1 - j, 1 + j)
        if boot_s <= 0:
            self._ready(index, now)
        else:
            self.booting[index] = now + boot_s
            self._push(now + boot_s, READY, index)

    def _ready(self, index: int, now: float) -> None:
        if self.status[index] != BOOTING:
            return  # stopped while booting
        self.booting.pop(index, None)
        self.status[index] = SERVING
        self.router.add(index)
        self.queued.extend((rid, now) for rid in self.held)  # after any still queued
        self.held.clear()
        self._kick(now)

    def _stop(self, index: int, now: float) -> None:
        self.status[index] = STOPPED
        self.stops[index] = now
        self.router.forget(index)

    def _scale(self, target: int, now: float) -> None:
        active = len(self.booting) + len(self.router.ready)
        if target == active:
            return
        self.scale_events += 1
        for _ in range(target - active):
            self._start(now)
        surplus = active - target
        if surplus <= 0:
            return
        for index in sorted(self.booting, key=self.booting.get, reverse=True)[:surplus]:
            del self.booting[index]
            self._stop(index, now)
            surplus -= 1
        if surplus > 0:
            victims = sorted(self.router.ready, key=lambda k: self.replicas[k].num_seqs)
            for index in victims[:surplus]:
                self.router.unroute(index)
                if self.replicas[index].num_seqs:
                    self.status[index] = DRAINING
                else:
                    self._stop(index, now)

    # ------------------------------------------------------------------ observation

    def _tick(self, now: float) -> None:
        counts, last = self.counts, self._last_counts
        ready = self.router.ready
        replicas = self.replicas
        tick = Tick(now=now, window_s=max(now - self._last_tick, 1e-3),
                    arrivals=counts["arrivals"] - last["arrivals"],
                    refused=counts["refused"] - last["refused"],
                    ttft_met=counts["ttft_met"] - last["ttft_met"],
                    ttft_total=counts["ttft_total"] - last["ttft_total"],
                    itl_met=counts["itl_met"] - last["itl_met"],
                    itl_total=counts["itl_total"] - last["itl_total"],
                    held=len(self.held), queued=len(self.queued), in_flight=self.in_flight,
                    waiting=sum(len(replicas[k].waiting) for k in ready) + len(self.queued),
                    kv_usage=sum(replicas[k].load(now)[2] for k in ready) / len(ready)
                    if ready else 0.0,
                    ready=len(ready), starting=len(self.booting))
        self._last_counts, self._last_tick = dict(counts), now
        target = min(max(0, self.policy.decide(tick)), self.config.max_replicas)
        self._scale(target, now)
        self._push(now + self.policy.interval_s, TICK)

    def _poll(self, now: float) -> None:
        router = self.router
        for index in router.ready:
            router.report(router.endpoints[index], self.replicas[index], now)
        if self.queued:
            self._kick(now)
        self._push(now + self.config.poll_s, POLL)

    def _sample(self, now: float) -> None:
        held, queued, arrival_s = self.held, self.queued, self.trace.arrival_s
        expired = 0
        while held and now - arrival_s[held[0]] >= self.config.hold_s:
            held.popleft()
            expired += 1
        while queued and now - queued[0][1] >= self.config.queue_timeout_s:  # FIFO: oldest
            queued.popleft()
            expired += 1
        self.counts["refused"] += expired
        self.finished += expired
        billed = len(self.booting) + sum(1 for s in self.status if s in (SERVING, DRAINING))
        self.timeline.append((now, billed, len(self.router.ready), self.in_flight,
                              len(self.held) + len(self.queued)))
        self._push(now + self.config.sample_s, SAMPLE)
