"""Online latency models, one per endpoint: predicted TTFT and ITL from observed load.

Under load a request's TTFT is mostly queueing: the prefill work sent to the endpoint
before it must be worked off first. So TTFT is predicted from the queue's observed drain
rate (``TTFTFeatures``, ``DrainMeter``):

    wait_s  = (queued_prefill_tokens + uncached_prompt_tokens) / drain_tokens_per_s
    ttft_s ≈ w · [1, wait_s]

    queued_prefill_tokens   prompt tokens sent there with no first token yet: the work ahead
    uncached_prompt_tokens  this prompt's tokens the prefix index does not expect cached
    drain_tokens_per_s      the endpoint's observed drain rate: prefill tokens that got their
                            first token per second it had prefill in flight, over the last
                            ``DRAIN_HORIZON_S`` busy seconds (so it follows a worker whose speed
                            changes: other tenants, the mix of decodes sharing its steps)

``w`` (the fixed overhead, and a scale ≈ 1 that absorbs a biased rate) is fitted by
recursive least squares (RLS) with exponential forgetting; weights are kept ≥ 0 (a
projection after each update), so a noisy fit never makes a busier worker look faster. ITL
uses the same RLS on [1, running].

Known weakness (issue 12's MAPE): requests predicted at the drain meter's prior rate are
fitted too, so a worker's first cold prefills (1.4 s where the prior said 0.2) raise the
intercept to about a second and cached-prefix requests after them are predicted 5-10x too
slow until forgetting wears it off. Holding a fresh replica to one prefill at a time once a
sibling's rate is known (``policy.predict``) keeps most requests off the prior: 68 % -> 35 %
on ``sluice simulate`` of bench/router.py's prefix workload. Not fitting them cut the MAPE
further (before that change: 68 % -> 12 %; the real benchmark: 183-231 % -> 87-101 %)
but lowered the real benchmark's goodput (2 req/s: 31-38 % -> 10-12 % of requests in SLO;
prefix hit rate 0.59 -> 0.49): the inflated predictions keep the admission gate shut, and
with accurate ones more requests reach workers whose 0.06 GiB pools then evict the
tenants' cached prompts. It waits for an admission gate that sees KV pressure.

State is a few small lists and two numbers per endpoint (bounded by the number of
endpoints), and the error tracker keeps a fixed-size window.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import NamedTuple

logger = logging.getLogger(__name__)

# Where a fresh endpoint starts: 30 ms + the wait at its drain rate, which starts at 2,500
# tokens/s (a small model on a CPU, roughly) until the endpoint has been busy for
# MIN_BUSY_S; a few seconds of load move it wherever the worker really is.
TTFT_PRIOR = (0.03, 1.0)
PRIOR_DRAIN_TOKENS_PER_S = 2500.0
DRAIN_HORIZON_S = 5.0  # busy seconds over which the drain rate is averaged (1/e weight)
MIN_BUSY_S = 0.2  # busy seconds observed before the endpoint's own rate is used
ITL_PRIOR = (0.02, 0.002)


class RLSModel:
    """Recursive least squares with forgetting for y ≈ w0 + w1 · x (one feature and an
    intercept); non-negative weights; predictions ≥ 0.

    Args:
        prior: initial (w0, w1): the intercept (seconds) and the slope.
        forgetting: λ in (0, 1]; an observation's weight halves after ln 2 / -ln λ updates
            (λ = 0.98: ~34 observations).
        prior_variance: initial diagonal of the covariance P (how fast the prior is left).
        max_trace: P's trace is capped here so that a long quiet spell (no excitation)
            cannot wind the covariance up and make one outlier swing every weight.

    P (2 x 2, symmetric) is kept as its three distinct entries, and started afresh
    (``prior_variance`` · I) should rounding on nearly collinear data make it indefinite:
    an indefinite P gives huge gains, and the projection onto non-negative weights then
    kept a wild intercept for good. Written out for two weights: the general n-weight form
    (lists, comprehensions) cost 15 µs an update, two updates a request on the router's
    path; this is 1.9 µs, with the same arithmetic in the same order (the same bits).
    """

    def __init__(self, prior: tuple[float, float], forgetting: float = 0.98,
                 prior_variance: float = 1.0, max_trace: float = 1e3):
        if not 0 < forgetting <= 1:
            raise ValueError("forgetting must be in (0, 1]")
        if len(prior) != 2:
            raise ValueError(f"{len(prior)} prior weights; the model has 2 (w0 + w1 · x)")
        self.w = [float(v) for v in prior]
        self.prior_variance = prior_variance
        self.p = (prior_variance, 0.0, prior_variance)  # P[0][0], P[0][1] = P[1][0], P[1][1]
        self.forgetting = forgetting
        self.max_trace = max_trace
        self.updates = 0

    def predict(self, x: float) -> float:
        """max(0, w0 + w1 · x)."""
        w0, w1 = self.w
        return max(0.0, w0 + w1 * x)

    def update(self, x: float, y: float) -> None:
        """One observation: ``x`` gave ``y``; non-finite ones are ignored."""
        if not (math.isfinite(y) and math.isfinite(x)):
            return
        lam = self.forgetting
        a, b, c = self.p
        px0, px1 = a + b * x, b + c * x  # P · [1, x]
        denom = lam + (px0 + x * px1)
        if not denom >= lam:  # rounding made P indefinite (collinear data): start it afresh
            self.p = (self.prior_variance, 0.0, self.prior_variance)
            return
        g0, g1 = px0 / denom, px1 / denom
        w0, w1 = self.w
        error = y - (w0 + w1 * x)
        # weights ≥ 0: more load never predicts a faster answer, nor a negative overhead
        self.w = [max(0.0, w0 + g0 * error), max(0.0, w1 + g1 * error)]
        a, b, c = ((a - g0 * px0) / lam, (b - (g0 * px1 + g1 * px0) / 2) / lam,
                   (c - g1 * px1) / lam)
        trace = a + c
        if trace > self.max_trace:
            scale = self.max_trace / trace
            a, b, c = a * scale, b * scale, c * scale
        self.p = (a, b, c)
        self.updates += 1


class DrainMeter:
    """How fast one endpoint works off the prefill sent to it, as the router sees it.

    Busy time is time during which the endpoint had at least one request with no first
    token yet; drained tokens are the (estimated uncached) prompt tokens of the requests
    whose first token came. Both are averaged with exponential weights over the last
    ``horizon_s`` busy seconds, and the rate is their ratio. A plain answer's first token is
    not seen: its tokens count as drained when the answer arrives, so under mostly plain
    traffic the rate errs low (predictions err high).

    Args:
        horizon_s: busy seconds after which an observation's weight is 1/e.
    """

    def __init__(self, horizon_s: float = DRAIN_HORIZON_S):
        self.horizon_s = horizon_s
        self.busy_s = 0.0  # weighted busy seconds
        self.tokens = 0.0  # weighted drained tokens
        self._at: float | None = None  # the clock at the last ``advance``, seconds

    def advance(self, now: float, busy: bool) -> None:
        """Account the time since the last call: ``busy`` when prefill was in flight all
        along (call it before every change of the endpoint's prefilling count)."""
        if self._at is not None and busy and now > self._at:
            decay = math.exp(-(now - self._at) / self.horizon_s)
            self.busy_s = self.busy_s * decay + self.horizon_s * (1.0 - decay)
            self.tokens *= decay
        self._at = now if self._at is None else max(self._at, now)

    def drained(self, tokens: float) -> None:
        """A request's first token came: its ``tokens`` of prefill are done."""
        self.tokens += tokens

    def rate(self) -> float | None:
        """Tokens per busy second; None until ``MIN_BUSY_S`` busy seconds and some tokens
        were seen."""
        if self.busy_s < MIN_BUSY_S or self.tokens <= 0:
            return None
        return self.tokens / self.busy_s


class TTFTFeatures(NamedTuple):
    """One request's view of one endpoint when it is sent: what its TTFT is predicted from,
    and what the models are fitted on when its first token comes.

    Attributes:
        queued_prefill_tokens: prompt tokens sent there with no first token yet (the prefill
            work ahead of this request), or the worker's larger fresh report.
        uncached_prompt_tokens: this prompt's tokens the prefix index does not expect cached
            there (its own prefill work).
        drain_tokens_per_s: the endpoint's observed drain rate (``DrainMeter``), or
            ``PRIOR_DRAIN_TOKENS_PER_S`` before it has one.
        running: requests decoding there (the router's count, or a larger fresh report); the
            ITL model's input.
    """

    queued_prefill_tokens: float
    uncached_prompt_tokens: float
    drain_tokens_per_s: float = PRIOR_DRAIN_TOKENS_PER_S
    running: float = 0.0

    @property
    def wait_s(self) -> float:
        """Seconds to work off the queue ahead and this prompt at the drain rate."""
        return (self.queued_prefill_tokens + self.uncached_prompt_tokens) / \
            max(self.drain_tokens_per_s, 1e-9)


class LatencyModel:
    """One endpoint's (or the fleet's) TTFT and ITL models.

    Attributes:
        ttft: RLS over ``TTFTFeatures.wait_s``; seconds.
        itl: RLS over [1, running]; seconds per token.
    """

    def __init__(self) -> None:
        self.ttft = RLSModel(TTFT_PRIOR)
        self.itl = RLSModel(ITL_PRIOR)

    def ttft_s(self, features: TTFTFeatures) -> float:
        """Predicted TTFT, seconds (≥ 0)."""
        return self.ttft.predict(features.wait_s)

    def fit_ttft(self, features: TTFTFeatures, ttft_s: float) -> None:
        """A request sent with ``features`` had its first token ``ttft_s`` seconds later."""
        self.ttft.update(features.wait_s, ttft_s)

    def itl_s(self, running: float) -> float:
        """Predicted mean inter-token gap with ``running`` requests decoding, seconds."""
        return self.itl.predict(running)

    def fit_itl(self, running: float, gap_s: float) -> None:
        """A request decoding beside ``running`` others (itself included) had a mean gap of
        ``gap_s`` seconds between tokens."""
        self.itl.update(running, gap_s)


class ErrorTracker:
    """Mean absolute percentage error of the last ``window`` predictions (``window`` None:
    of all of them, in constant memory).

    MAPE = mean(|predicted - observed| / observed); observations under ``floor_s`` are
    clamped to it so a near-zero TTFT cannot blow the percentage up.
    """

    def __init__(self, window: int | None = 500, floor_s: float = 0.005):
        self._errors: deque[float] = deque(maxlen=window)
        self._window = window
        self._count = 0
        self._sum = 0.0
        self.floor_s = floor_s

    def observe(self, predicted: float, observed: float) -> None:
        """One prediction and what came, seconds; an infinite prediction (an endpoint taking
        one prefill at a time, ``policy.predict``) is no estimate and is left out."""
        if not math.isfinite(predicted):
            return
        error = abs(predicted - observed) / max(observed, self.floor_s)
        self._sum += error
        if self._window is None:
            self._count += 1
            return
        if len(self._errors) == self._window:
            self._sum -= self._errors[0]
        self._errors.append(error)

    def __len__(self) -> int:
        return self._count if self._window is None else len(self._errors)

    @property
    def mape(self) -> float:
        """Fraction (0.25 = 25 %); 0 with no observations."""
        return max(0.0, self._sum / len(self)) if len(self) else 0.0
