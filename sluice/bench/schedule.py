"""Open-loop arrival schedules: pure, deterministic for a seed.

Gaps between arrivals are gamma-distributed with mean ``1/rate`` and shape ``burstiness``
(vLLM's benchmark_serving convention): shape 1 is exponential gaps, a Poisson process;
shape < 1 is burstier (coefficient of variation of the gaps = 1/sqrt(shape), e.g. 0.25 → 2);
shape > 1 is smoother than Poisson.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

BURSTY_DEFAULT = 0.25  # `--arrival bursty` without --burstiness: gap CV 2


def arrivals(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless arrival offsets in seconds: 0, then cumulative gamma gaps.

    Args:
        rate: mean arrivals per second (> 0).
        burstiness: gamma shape k (> 0); gaps have mean 1/rate and CV 1/sqrt(k).
        seed: the same seed gives the same schedule.
    """
    if not rate > 0 or not burstiness > 0 or math.isinf(rate):
        raise ValueError(f"rate ({rate}) and burstiness ({burstiness}) must be positive")
    rng = random.Random(seed)
    t = 0.0
    yield t
    while True:
        t += (rng.expovariate(rate) if burstiness == 1.0
              else rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
        yield t


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """The first ``n`` offsets of :func:`arrivals`."""
    return list(itertools.islice(arrivals(rate, burstiness, seed), n))
