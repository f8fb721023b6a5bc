"""Online latency models, one per endpoint: predicted TTFT and ITL from observed load.

TTFT is modelled as linear in four features of the endpoint's state when the request is
sent (``TTFTFeatures``), fitted by recursive least squares (RLS) with exponential
forgetting, so the model follows a worker whose speed changes (other tenants, a different
GPU):

    ttft_s ≈ w · [1, queued_prefill_ktok, running, uncached_prompt_ktok, kv_usage]

    queued_prefill_ktok   prompt tokens (thousands) sent there that have not yet produced a
                          first token: prefill work ahead of this request
    running               requests decoding there (they share every step with our prefill)
    uncached_prompt_ktok  this prompt's tokens (thousands) the prefix index does not expect
                          the worker to have cached
    kv_usage              the worker's reported KV-cache usage, 0..1 (a full pool preempts
                          and evicts prefixes)

Slopes are kept ≥ 0 (a projection after each update), so a noisy fit never makes a busier
worker look faster. ITL uses the same RLS on [1, running].

State is a few small lists per endpoint (bounded by the number of endpoints), and the error
tracker keeps a fixed-size window.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

logger = logging.getLogger(__name__)

# Where a fresh endpoint starts: 30 ms + 0.4 s per 1k queued prefill tokens + 10 ms per
# running decode + 0.4 s per 1k uncached prompt tokens (a small model on a CPU, roughly);
# a few dozen observations move it wherever the worker really is.
TTFT_PRIOR = (0.03, 0.4, 0.01, 0.4, 0.0)
ITL_PRIOR = (0.02, 0.002)


class RLSModel:
    """Recursive least squares with forgetting; non-negative slopes; predictions ≥ 0.

    Args:
        prior: initial weights, one per feature (the first feature is the constant 1).
        forgetting: λ in (0, 1]; an observation's weight halves after ln 2 / -ln λ updates
            (λ = 0.98: ~34 observations).
        prior_variance: initial diagonal of the covariance P (how fast the prior is left).
        max_trace: P's trace is capped here so that a long quiet spell (no excitation)
            cannot wind the covariance up and make one outlier swing every weight.
    """

    def __init__(self, prior: Sequence[float], forgetting: float = 0.98,
                 prior_variance: float = 1.0, max_trace: float = 1e3):
        if not 0 < forgetting <= 1:
            raise ValueError("forgetting must be in (0, 1]")
        n = len(prior)
        self.w = [float(v) for v in prior]
        self.p = [[prior_variance if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.forgetting = forgetting
        self.max_trace = max_trace
        self.updates = 0

    def predict(self, x: Sequence[float]) -> float:
        self._check(x)
        return max(0.0, sum(w * v for w, v in zip(self.w, x)))

    def update(self, x: Sequence[float], y: float) -> None:
        """One observation: features ``x`` (same order as the prior) gave ``y``."""
        self._check(x)
        if not math.isfinite(y) or not all(math.isfinite(v) for v in x):
            return
        n, lam, p = len(self.w), self.forgetting, self.p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        if denom <= 1e-12:
            return
        gain = [v / denom for v in px]
        error = y - sum(w * v for w, v in zip(self.w, x))
        self.w = [w + g * error for w, g in zip(self.w, gain)]
        for i in range(1, n):  # slopes ≥ 0: more load never predicts a faster answer
            self.w[i] = max(0.0, self.w[i])
        self.w[0] = max(0.0, self.w[0])
        new_p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        trace = sum(new_p[i][i] for i in range(n))
        if trace > self.max_trace:
            scale = self.max_trace / trace
            new_p = [[v * scale for v in row] for row in new_p]
        self.p = new_p
        self.updates += 1

    def _check(self, x: Sequence[float]) -> None:
        if len(x) != len(self.w):
            raise ValueError(f"{len(x)} features for a model of {len(self.w)}")


class TTFTFeatures(NamedTuple):
    """One request's view of one endpoint when it is sent: what its TTFT is predicted from,
    and what the models are fitted on when its first token comes.

    Attributes:
        queued_prefill_tokens: prompt tokens sent there with no first token yet (the prefill
            work ahead of this request), or the worker's larger fresh report.
        running: requests decoding there (the router's count, or a larger fresh report).
        uncached_prompt_tokens: this prompt's tokens the prefix index does not expect cached
            there (its own prefill work).
        kv_usage: the worker's reported KV-cache usage, 0..1.
    """

    queued_prefill_tokens: float
    running: float
    uncached_prompt_tokens: float
    kv_usage: float = 0.0

    def regressors(self) -> tuple[float, ...]:
        """The TTFT model's input: [1, queued ktok, running, uncached ktok, kv usage]."""
        return (1.0, self.queued_prefill_tokens / 1000.0, float(self.running),
                self.uncached_prompt_tokens / 1000.0, min(max(self.kv_usage, 0.0), 1.0))


def _itl_regressors(running: float) -> tuple[float, ...]:
    return (1.0, float(running))


class LatencyModel:
    """One endpoint's (or the fleet's) TTFT and ITL models.

    Attributes:
        ttft: RLS over ``TTFTFeatures.regressors``; seconds.
        itl: RLS over [1, running]; seconds per token.
    """

    def __init__(self) -> None:
        self.ttft = RLSModel(TTFT_PRIOR)
        self.itl = RLSModel(ITL_PRIOR)

    def ttft_s(self, features: TTFTFeatures) -> float:
        """Predicted TTFT, seconds (≥ 0)."""
        return self.ttft.predict(features.regressors())

    def fit_ttft(self, features: TTFTFeatures, ttft_s: float) -> None:
        """A request sent with ``features`` had its first token ``ttft_s`` seconds later."""
        self.ttft.update(features.regressors(), ttft_s)

    def itl_s(self, running: float) -> float:
        """Predicted mean inter-token gap with ``running`` requests decoding, seconds."""
        return self.itl.predict(_itl_regressors(running))

    def fit_itl(self, running: float, gap_s: float) -> None:
        """A request decoding beside ``running`` others (itself included) had a mean gap of
        ``gap_s`` seconds between tokens."""
        self.itl.update(_itl_regressors(running), gap_s)


class ErrorTracker:
    """Mean absolute percentage error of the last ``window`` predictions.

    MAPE = mean(|predicted - observed| / observed); observations under ``floor_s`` are
    clamped to it so a near-zero TTFT cannot blow the percentage up.
    """

    def __init__(self, window: int = 500, floor_s: float = 0.005):
        self._errors: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self.floor_s = floor_s

    def observe(self, predicted: float, observed: float) -> None:
        if len(self._errors) == self._errors.maxlen:
            self._sum -= self._errors[0]
        error = abs(predicted - observed) / max(observed, self.floor_s)
        self._errors.append(error)
        self._sum += error

    def __len__(self) -> int:
        return len(self._errors)

    @property
    def mape(self) -> float:
        """Fraction (0.25 = 25 %); 0 with no observations."""
        return max(0.0, self._sum / len(self._errors)) if self._errors else 0.0
