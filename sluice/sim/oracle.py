"""Sizing from hindsight: one replica's capacity, and the clairvoyant oracle's schedule.

``calibrate`` measures one simulated replica the way ``sluice profile`` measures a real one:
requests drawn from the trace (lengths and prefix blocks) arrive as a Poisson stream at a
rate r; the capacity is the highest r (bisection) at which the requests meet both objectives
at the attainment target, and the full-utilisation rate is what the replica completes when
every request is there at once (or the capacity, when a burst's preemptions make that less).

The oracle knows the whole trace. Per ``step_s`` interval it needs ceil(arrival rate ÷
capacity) replicas (the capacity searched in hindsight, see ``oracle``); each is started one
(maximum) boot time ahead of the interval that needs it and kept across dips shorter than a
boot (at time t it holds the most any interval within [t, t + boot] needs). The schedule is
replayed through the same simulator and refined in hindsight (see ``oracle``): the
per-replica rate that just meets the attainment target overall, and replicas added where
requests missed when no rate does. So it is achievable by construction, which makes
"× the oracle's replica-hours" fair. It is the cheapest schedule of this shape the search
finds, not a proven optimum: a policy can come in under it (a ratio below 1).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable

from sluice.sim.policies import Tick
from sluice.sim.profile import StepModel
from sluice.sim.simulator import Result, SimConfig, Simulator
from sluice.sim.trace import Trace

logger = logging.getLogger(__name__)


class Schedule:
    """A replica count per ``step_s`` interval, read at each tick (the oracle's policy)."""

    def __init__(self, counts: list[int], step_s: float):
        self.counts, self.interval_s = counts, step_s

    def decide(self, tick: Tick) -> int:
        return self.counts[min(int(tick.now / self.interval_s + 1e-9), len(self.counts) - 1)]


def attainment(result: Result, config: SimConfig) -> float:
    """Fraction of requests meeting both objectives (refused ones miss)."""
    return sum(met_both(result, config)) / max(1, len(result.arrival_s))


def met_both(result: Result, config: SimConfig) -> list[bool]:
    """Per request: TTFT and mean ITL within their objectives (a refused request fails)."""
    out = []
    for t, first, done, n in zip(result.arrival_s, result.first_s, result.done_s, result.output):
        ok = first - t <= config.ttft_slo_s  # NaN (refused) compares False
        if ok and n > 1 and config.itl_slo_s is not None:
            ok = (done - first) / (n - 1) <= config.itl_slo_s
        out.append(ok)
    return out


def _one_replica(trace: Trace, model: StepModel, config: SimConfig) -> Result:
    solo = SimConfig(boot_s=0.0, max_replicas=1, ttft_slo_s=config.ttft_slo_s,
                     itl_slo_s=config.itl_slo_s, routing="round-robin", limits=config.limits,
                     hold_s=math.inf, queue_timeout_s=math.inf, seed=config.seed)
    return Simulator(trace, model, solo, Schedule([1], 3600.0), initial=1).run()


def calibrate(trace: Trace, model: StepModel, config: SimConfig, target: float,
              requests: int = 2000, iterations: int = 8) -> tuple[float, float]:
    """(capacity_rps at the SLO, max_rps at full utilisation) of one replica, req/s.

    Raises:
        ValueError: the SLO is missed even at the lowest rate tried (max_rps / 2^iterations).
    """
    rng = random.Random(config.seed)
    picks = [rng.randrange(len(trace)) for _ in range(requests)]
    prompt = [trace.prompt[i] for i in picks]
    output = [trace.output[i] for i in picks]
    blocks = [trace.blocks[i] for i in picks]
    burst = Trace([0.0] * requests, prompt, output, blocks, trace.block_tokens)
    max_rps = requests / max(_one_replica(burst, model, config).end_s, 1e-9)

    def meets(rate: float) -> bool:
        t, times = 0.0, []
        for _ in range(requests):
            times.append(t)
            t += rng.expovariate(rate)
        result = _one_replica(Trace(times, prompt, output, blocks, trace.block_tokens),
                              model, config)
        return attainment(result, config) >= target

    lo, hi = 0.0, 4 * max_rps  # a full pool preempts: a burst understates the steady rate
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    if lo == 0.0:
        raise ValueError(f"one replica misses the SLO for more than {100 * (1 - target):g}% of "
                         f"requests even at {hi:.3g} req/s: loosen --slo-ttft-ms/--slo-itl-ms "
                         "or --attainment, or profile a faster replica")
    capacity, max_rps = lo, max(lo, max_rps)
    logger.debug("one replica: %.3f req/s at the SLO (%.0f%%), %.3f req/s saturated",
                capacity, 100 * target, max_rps)
    return capacity, max_rps


def needs(trace: Trace, capacity_rps: float, step_s: float, max_replicas: int) -> list[int]:
    """Replicas each ``step_s`` interval's arrivals need at ``capacity_rps`` each."""
    steps = int(trace.arrival_s[-1] // step_s) + 1
    arrivals = [0] * steps
    for t in trace.arrival_s:
        arrivals[int(t // step_s)] += 1
    return [min(max_replicas, math.ceil(a / step_s / capacity_rps - 1e-9)) for a in arrivals]


def ahead(need: list[int], step_s: float, boot_s: float) -> list[int]:
    """At each interval, the most that any interval starting within one boot needs (started
    a boot ahead; kept across dips shorter than a boot); one more interval to drain."""
    reach = math.ceil(boot_s / step_s) + 1
    return [max(need[i:i + reach]) for i in range(len(need))] + [need[-1]]


def oracle(trace: Trace, model: StepModel, config: SimConfig, capacity_rps: float,
           target: float, step_s: float = 10.0, search: int = 5, passes: int = 5,
           progress: Callable[[int, float], None] | None = None
           ) -> tuple[Result, list[int]]:
    """The oracle's replay and its schedule (replicas per ``step_s`` interval).

    One replica alone is only a guide to a fleet (requests pool; a burst is not a Poisson
    stream), so first the per-replica rate is searched (bisection over 0.5–2× ``capacity_rps``,
    ``search`` replays) for the highest whose schedule meets ``target`` overall. If none
    does, the intervals that missed it most (and the one before each, whose queue they
    inherited) get one replica more, and the trace is replayed again (``passes`` at most).
    """
    def replay(need: list[int]) -> tuple[Result, list[int], list[bool]]:
        counts = ahead(need, step_s, config.boot_max_s)
        result = Simulator(trace, model, config, Schedule(counts, step_s), initial=counts[0],
                           progress=progress).run()
        return result, counts, met_both(result, config)

    lo, hi, best = 0.5, 2.0, None
    for _ in range(search):
        mid = (lo + hi) / 2
        replayed = replay(needs(trace, capacity_rps * mid, step_s, config.max_replicas))
        if sum(replayed[2]) >= target * len(replayed[2]):
            lo, best = mid, replayed
        else:
            hi = mid
    need = needs(trace, capacity_rps * lo, step_s, config.max_replicas)
    result, counts, met = best or replay(need)
    for attempt in range(passes):
        if sum(met) >= target * len(met):
            break
        missed, total = [0] * len(need), [0] * len(need)
        for t, ok in zip(result.arrival_s, met):
            total[int(t // step_s)] += 1
            missed[int(t // step_s)] += not ok
        short = [i for i in range(len(need)) if missed[i] > (1 - target) * total[i]]
        for i in sorted({j for i in short for j in (i - 1, i) if j >= 0}):
            need[i] = min(config.max_replicas, need[i] + 1)
        result, counts, met = replay(need)
        logger.info("oracle pass %d: %.2f%% met (%d intervals had missed)", attempt + 1,
                    100 * sum(met) / len(met), len(short))
    logger.info("oracle: %.3f× the one-replica capacity, %.2f%% met", lo,
                100 * sum(met) / len(met))
    return result, counts
