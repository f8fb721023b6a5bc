"""Fit the cascade's pre-route: a logistic model of P(the first tier fails | prompt features).

Pure Python (a 7×7 linear system per Newton step needs no torch): features from
``policy.prompt_features``, standardised for the fit (so one L2 strength suits them all),
then mapped back to raw-feature weights, which is what ``spec.cascade.preRoute`` holds and
``policy.hard_probability`` reads. A prompt is pre-routed when its probability is above the
threshold, as in ``CascadePolicy.start``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.cascade.policy import FEATURES, hard_probability, prompt_features


@dataclass(frozen=True)
class PreRoute:
    """A fitted pre-route model (``spec.cascade.preRoute``).

    Attributes:
        weights: feature (``FEATURES``) → weight on the raw feature.
        bias: the intercept.
        threshold: pre-route when P(first tier fails) > this; within (0, 1).
        share: fraction of the fitting prompts it pre-routes.
        hit_rate: of those, the fraction whose first tier did fail (None when none).
    """

    weights: dict[str, float]
    bias: float
    threshold: float
    share: float
    hit_rate: float | None

    def probability(self, prompt: str) -> float:
        return hard_probability(prompt_features(prompt), self.weights, self.bias)

    def routes(self, prompt: str) -> bool:
        """Whether ``prompt`` goes straight to the top tier."""
        return self.probability(prompt) > self.threshold


def fit_logistic(prompts: Sequence[str], hard: Sequence[bool], max_share: float = 0.1,
                 l2: float = 1.0, min_probability: float = 0.5,
                 iterations: int = 50) -> PreRoute:
    """Fit the model and pick its threshold.

    Args:
        prompts: the prompts' texts (what the router's pre-route reads).
        hard: per prompt, whether the first tier answered it wrongly (the label).
        max_share: pre-route at most this fraction of ``prompts``.
        l2: ridge strength on the standardised weights (the bias gets 1e-3 of it, so a
            one-class set still converges).
        min_probability: never pre-route below this probability, whatever ``max_share``.
        iterations: most Newton steps (each with step halving; stops when a step moves no
            weight by 1e-9).

    Raises:
        ValueError: no prompts, lengths differ, or ``max_share`` outside [0, 1].
    """
    if not prompts or len(prompts) != len(hard):
        raise ValueError(f"need one label per prompt, got {len(prompts)} prompts, "
                         f"{len(hard)} labels")
    if not 0.0 <= max_share <= 1.0:
        raise ValueError(f"max_share {max_share} is not within [0, 1]")
    raw = [[prompt_features(p)[f] for f in FEATURES] for p in prompts]
    y = [1.0 if h else 0.0 for h in hard]
    mean = [sum(col) / len(raw) for col in zip(*raw)]
    sd = [math.sqrt(sum((v - m) ** 2 for v in col) / len(raw)) for col, m in zip(zip(*raw), mean)]
    x = [[(v - m) / s if s > 0 else 0.0 for v, m, s in zip(row, mean, sd)] + [1.0] for row in raw]
    penalty = [l2] * len(FEATURES) + [1e-3 * l2]
    w = _newton(x, y, penalty, iterations)
    weights = {f: w[j] / s if s > 0 else 0.0 for j, (f, s) in enumerate(zip(FEATURES, sd))}
    bias = w[-1] - sum(weights[f] * m for f, m in zip(FEATURES, mean))
    probs = [hard_probability(dict(zip(FEATURES, row)), weights, bias) for row in raw]
    ranked = sorted(probs, reverse=True)
    k = math.floor(max_share * len(probs) + 1e-9)  # pre-route at most k prompts
    threshold = max(ranked[k] if k < len(ranked) else 0.0, min_probability)
    threshold = min(max(threshold, 1e-6), 1 - 1e-6)
    routed = [h for p, h in zip(probs, hard) if p > threshold]
    return PreRoute(weights, bias, threshold, len(routed) / len(probs),
                    sum(routed) / len(routed) if routed else None)


def _loss(x: list[list[float]], y: list[float], w: list[float], penalty: list[float]) -> float:
    total = 0.0
    for row, label in zip(x, y):
        z = sum(a * b for a, b in zip(row, w))
        # -log σ(z) = softplus(-z); -log(1 - σ(z)) = softplus(z), computed stably
        total += _softplus(-z) if label else _softplus(z)
    return total + 0.5 * sum(p * v * v for p, v in zip(penalty, w))


def _softplus(z: float) -> float:
    return z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))


def _newton(x: list[list[float]], y: list[float], penalty: list[float],
            iterations: int) -> list[float]:
    """Minimise the L2-penalised logistic loss; x: [n][d] (last column ones), y: [n]."""
    d = len(penalty)
    w = [0.0] * d
    loss = _loss(x, y, w, penalty)
    for _ in range(iterations):
        grad = [p * v for p, v in zip(penalty, w)]
        hess = [[penalty[i] if i == j else 0.0 for j in range(d)] for i in range(d)]
        for row, label in zip(x, y):
            z = sum(a * b for a, b in zip(row, w))
            p = 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0
            for i in range(d):
                grad[i] += (p - label) * row[i]
                for j in range(d):
                    hess[i][j] += p * (1 - p) * row[i] * row[j]
        step = solve(hess, grad)
        scale = 1.0
        while scale > 1e-6:  # halve until the loss does not rise
            trial = [v - scale * s for v, s in zip(w, step)]
            trial_loss = _loss(x, y, trial, penalty)
            if trial_loss <= loss:
                break
            scale /= 2
        else:
            return w
        w, loss = trial, trial_loss
        if max(abs(scale * s) for s in step) < 1e-9:
            break
    return w


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a·x = b by Gaussian elimination with partial pivoting (a: [d][d], b: [d]).

    Raises ZeroDivisionError for a singular ``a`` (the ridge keeps the Hessian regular).
    """
    d = len(b)
    m = [list(row) + [rhs] for row, rhs in zip(a, b)]
    for col in range(d):
        pivot = max(range(col, d), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            raise ZeroDivisionError("singular system")
        for r in range(col + 1, d):
            factor = m[r][col] / m[col][col]
            for c in range(col, d + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * d
    for r in reversed(range(d)):
        x[r] = (m[r][d] - sum(m[r][c] * x[c] for c in range(r + 1, d))) / m[r][r]
    return x
