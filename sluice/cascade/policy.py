"""The cascade policy: which tier answers first, and when an answer goes up a tier.

Pure (no I/O, no clock): the router calls it on live requests and ``sluice cascade
calibrate`` on recorded answers, so both decide alike.

    prompt ──▶ x-sluice-cascade header? ──▶ that tier (no escalation)
           └─▶ pre-route: P(first tier fails | prompt features) > threshold ──▶ top tier
           └─▶ first tier ──▶ its answer's token logprobs ──▶ score < threshold? ──▶ next tier

The score is taken over the answer span. The default signal is a low quantile of the token
log probabilities: the mean is biased by length (a long answer of confident tokens hides
one guessed number), the minimum is one token's noise. ``checks`` adds proof: an answer a
check refutes (``sluice.cascade.checks``: code failing the examples its prompt writes down,
run by the router in a sandbox; arithmetic steps that do not add up) scores -inf and
escalates at any threshold; other answers score the quantile. RouteLLM (Ong et al., 2024) routes
from the prompt alone; vLLM Semantic Router escalates on token confidence with hand-set
thresholds. Here both run in one policy, and ``calibrate.threshold_for_share`` sets the
threshold from a target share of top-tier requests.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sluice.api.service import CascadeSpec, PromptFeatureWeights

FEATURES = tuple(PromptFeatureWeights.model_fields)  # prompt_features' keys, in order
SIGNALS = ("logprob-quantile", "min-logprob", "mean-logprob", "checks")

_CODE = re.compile(r"```|^\s*(def|class|import|from|return|for|while|if)\b|[{};]\s*$|=>|::",
                   re.MULTILINE)
_MATH = re.compile(r"[+\-*/^=%]|\b(sum|total|each|times|twice|half|percent|product|"
                   r"difference|remain\w*|left)\b", re.IGNORECASE)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_QUESTION = re.compile(r"\?\s*$|^\s*(what|how|why|which|who|when|where|is|are|can|does|"
                       r"do)\b", re.IGNORECASE | re.MULTILINE)


def prompt_features(prompt: str) -> dict[str, float]:
    """Cheap features of a prompt, for pre-routing (O(characters); no tokenizer).

    Returns:
        ``FEATURES`` → value: ``log_chars`` ln(1 + characters), ``log_numbers`` ln(1 +
        numbers), ``code`` 1.0 when a code marker appears (a fence, a line starting with
        def/class/import/return/..., a line ending in ``{`` ``}`` ``;``), ``math`` arithmetic
        operators and quantity words per 100 characters, ``question`` 1.0 when a line ends
        with ``?`` or starts with a question word, ``log_lines`` ln(1 + lines).
    """
    chars = len(prompt)
    return {
        "log_chars": math.log1p(chars),
        "log_numbers": math.log1p(len(_NUMBER.findall(prompt))),
        "code": 1.0 if _CODE.search(prompt) else 0.0,
        "math": 100.0 * len(_MATH.findall(prompt)) / max(chars, 1),
        "question": 1.0 if _QUESTION.search(prompt) else 0.0,
        "log_lines": math.log1p(prompt.count("\n") + 1 if prompt else 0),
    }


def hard_probability(features: Mapping[str, float], weights: Mapping[str, float],
                     bias: float) -> float:
    """The logistic model's P(the first tier fails): σ(bias + Σ weight·feature)."""
    z = bias + sum(weights.get(name, 0.0) * features.get(name, 0.0) for name in FEATURES)
    return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


@dataclass(frozen=True)
class Scores:
    """An answer's confidence, from its generated tokens' log probabilities (natural log).

    Attributes:
        quantile: the ``q``-quantile of the token logprobs (linear interpolation).
        min: the lowest token logprob.
        mean: their mean.
        entropy: mean per-token entropy (nats) of the top-k alternatives, renormalized; None
            without alternatives. Reported, not used to decide.
        tokens: how many tokens were scored.
        refuted: why a check proved the answer wrong (``checks.refutation``: a reason such
            as ``failed-examples``), None when none did or none ran.
    """

    quantile: float
    min: float
    mean: float
    entropy: float | None
    tokens: int
    refuted: str | None = None

    def signal(self, name: str) -> float:
        """The score a signal (``SIGNALS``) reads: ``checks`` is -inf for a refuted answer
        (below every threshold), else the quantile."""
        if name == "checks":
            return -math.inf if self.refuted else self.quantile
        return {"logprob-quantile": self.quantile, "min-logprob": self.min,
                "mean-logprob": self.mean}[name]


def answer_scores(logprobs: Sequence[float],
                  alternatives: Sequence[Sequence[float]] | None = None,
                  q: float = 0.1) -> Scores:
    """Score an answer span.

    Args:
        logprobs: each generated token's log probability, shape [tokens]; non-finite values
            (a token of probability 0 under the sampler) count as -100.
        alternatives: per token, the top-k alternatives' logprobs (shape [tokens][k]), for
            the entropy; None or empty lists: no entropy.
        q: the quantile, 0 < q < 1.

    Returns:
        ``Scores``; an empty answer scores 0.0 everywhere (nothing was guessed).
    """
    values = sorted(lp if math.isfinite(lp) else -100.0 for lp in logprobs)
    if not values:
        return Scores(0.0, 0.0, 0.0, None, 0)
    pos = q * (len(values) - 1)
    low, high = math.floor(pos), math.ceil(pos)
    quantile = values[low] + (values[high] - values[low]) * (pos - low)
    entropies = [_entropy(top) for top in alternatives or () if top]
    return Scores(quantile, values[0], sum(values) / len(values),
                  sum(entropies) / len(entropies) if entropies else None, len(values))


def _entropy(top: Sequence[float]) -> float:
    probs = [math.exp(lp) for lp in top if math.isfinite(lp)]
    total = sum(probs)
    return -sum(p / total * math.log(p / total) for p in probs if p > 0) if total > 0 else 0.0


@dataclass(frozen=True)
class Start:
    """Where a request starts.

    Attributes:
        tier: index into the tiers, 0 = smallest.
        escalate: whether a low score may still send it up.
        reason: ``cascade`` (the first tier, as usual), ``pre-route`` (predicted hard), or
            ``header`` (``x-sluice-cascade``).
    """

    tier: int
    escalate: bool
    reason: str


class BadCascadeHeader(ValueError):
    """``x-sluice-cascade`` names no tier of the cascade (a 400 naming the header)."""


@dataclass(frozen=True)
class CascadePolicy:
    """One cascade's decisions.

    Attributes:
        tiers: the InferenceService names, smallest first.
        models: their served model names (what the workers answer to), same order.
        signal / quantile / threshold: ``spec.cascade.escalation``.
        weights / bias / pre_route_threshold: ``spec.cascade.preRoute`` (None: off).
    """

    tiers: tuple[str, ...]
    models: tuple[str, ...]
    signal: str
    quantile: float
    threshold: float
    weights: Mapping[str, float] | None = None
    bias: float = 0.0
    pre_route_threshold: float = 0.5

    @classmethod
    def from_spec(cls, spec: CascadeSpec, models: Sequence[str]) -> CascadePolicy:
        """``models``: the tiers' served model names, in ``spec.tiers`` order."""
        pre = spec.pre_route
        return cls(tuple(spec.tiers), tuple(models), spec.escalation.signal,
                   spec.escalation.quantile, spec.escalation.threshold,
                   pre.weights.model_dump() if pre else None, pre.bias if pre else 0.0,
                   pre.threshold if pre else 0.5)

    @property
    def top(self) -> int:
        return len(self.tiers) - 1

    def start(self, prompt: str, header: str | None = None) -> Start:
        """The first tier to ask.

        Args:
            prompt: the prompt's text (chat: the messages' text joined).
            header: ``x-sluice-cascade``: ``off`` (the first tier, no escalation), ``top``
                (the top tier), or a tier's InferenceService or served model name (that
                tier, no escalation); None: the policy decides.

        Raises:
            BadCascadeHeader: the header names nothing of this cascade.
        """
        if header is not None:
            value = header.strip()
            if value == "off":
                return Start(0, False, "header")
            if value == "top":
                return Start(self.top, False, "header")
            for i, (tier, model) in enumerate(zip(self.tiers, self.models)):
                if value in (tier, model):
                    return Start(i, False, "header")
            raise BadCascadeHeader(
                f"x-sluice-cascade {value!r} is not off, top or a tier of this cascade "
                f"({', '.join(self.tiers)})")
        if self.weights is not None and hard_probability(
                prompt_features(prompt), self.weights, self.bias) > self.pre_route_threshold:
            return Start(self.top, False, "pre-route")
        return Start(0, True, "cascade")

    def score(self, logprobs: Sequence[float],
              alternatives: Sequence[Sequence[float]] | None = None) -> Scores:
        """``answer_scores`` with this cascade's quantile."""
        return answer_scores(logprobs, alternatives, self.quantile)

    def escalates(self, tier: int, scores: Scores) -> bool:
        """Whether tier ``tier``'s answer, scored ``scores``, goes up to the next tier."""
        return tier < self.top and scores.signal(self.signal) < self.threshold
