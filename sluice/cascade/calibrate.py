"""Calibrate a cascade from recorded answers: replay, threshold for a target top-tier share,
held-out halves, the pre-route model, and the YAML for ``spec.cascade``.

Pure (no network, no clock): the input is the JSONL that ``sluice.cascade.recorder`` writes,
one line per (item, tier), every tier answering every item on its own. A replay then asks
what the cascade would have done, with the router's rule (``CascadePolicy.escalates``):

    item ──▶ pre-routed? ──▶ top tier
         └─▶ tier 0 ──▶ score < threshold and not the top? ──▶ tier 1 ──▶ ... ──▶ answers

Accuracy is the answering tier's; cost counts every tier visited, (prompt + completion
tokens) × the tier's relative cost, so tokens of answers that escalated are paid for. A replay
of the router's ``prefix`` streaming mode (``prefix_tokens``) scores each answer's first K
tokens and pays an escalated answer's prompt and those K tokens only: the router closes its
stream there (plain, non-streamed answers are always judged whole).

The record format is ``sluice.cascade.records``.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from sluice.cascade.policy import FEATURES, SIGNALS
from sluice.cascade.preroute import PreRoute, fit_logistic
from sluice.cascade.records import (DEFAULT_QUANTILE, Record, done_pairs,
                                    load_records)

logger = logging.getLogger(__name__)

__all__ = ["Record", "load_records", "done_pairs", "Replay", "Outcome", "HeldOut", "Spread",
           "simulate", "threshold_for_share", "held_out", "fit_pre_route", "PreRoute",
           "snippet"]


# --- replay ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """A replayed cascade over a set of items (costs are means per item, in token × tier-cost
    units).

    Attributes:
        items: items replayed.
        threshold: the escalation threshold.
        accuracy: fraction answered correctly by the answering tier.
        top_share: fraction answered by the top tier (escalated or pre-routed).
        shares: fraction answered by each tier.
        pre_routed: fraction sent straight to the top tier.
        cost: mean cost per item, every tier visited.
        wasted: the part of ``cost`` spent on answers that escalated.
        top_accuracy, top_cost: the top tier alone on the same items.
        kind_accuracy: kind → accuracy of the cascade.
    """

    items: int
    threshold: float
    accuracy: float
    top_share: float
    shares: tuple[float, ...]
    pre_routed: float
    cost: float
    wasted: float
    top_accuracy: float
    top_cost: float
    kind_accuracy: dict[str, float] = field(default_factory=dict)

    @property
    def relative_accuracy(self) -> float:
        """accuracy / the top tier's (inf when the top tier gets none right)."""
        return self.accuracy / self.top_accuracy if self.top_accuracy else math.inf

    @property
    def relative_cost(self) -> float:
        return self.cost / self.top_cost if self.top_cost else math.inf

    def to_json(self) -> dict:
        return {**asdict(self), "relative_accuracy": self.relative_accuracy,
                "relative_cost": self.relative_cost}


@dataclass(frozen=True)
class Replay:
    """Recorded answers as a table: one row per item that every tier answered.

    Attributes:
        tiers: InferenceService names, smallest first; costs: their relative costs.
        signal, quantile: what ``scores`` holds.
        prefix_tokens: the ``prefix`` streaming mode's K (None: answers judged whole).
        ids, kinds, prompts: per item.
        correct, spent, escalated, scores: per item, per tier: ``check`` passed; (prompt +
            completion tokens) × the tier's cost; what the tier costs when its answer
            escalates (``Record.escalation_tokens`` × cost); the signal's score. Shape
            [items][tiers].
    """

    tiers: tuple[str, ...]
    costs: tuple[float, ...]
    signal: str
    quantile: float
    ids: tuple[str, ...]
    kinds: tuple[str, ...]
    prompts: tuple[str, ...]
    correct: tuple[tuple[bool, ...], ...]
    spent: tuple[tuple[float, ...], ...]
    escalated: tuple[tuple[float, ...], ...]
    scores: tuple[tuple[float, ...], ...]
    prefix_tokens: int | None = None

    @classmethod
    def build(cls, records: Iterable[Record], tiers: Sequence[str],
              signal: str = "logprob-quantile", quantile: float = DEFAULT_QUANTILE,
              costs: Sequence[float] | None = None,
              prefix_tokens: int | None = None) -> Replay:
        """Items missing a tier are left out (logged); a later record of a pair wins.

        Args:
            prefix_tokens: replay the ``prefix`` streaming mode with this K (None: answers
                judged whole, the ``buffer`` mode's and plain answers' rule).

        Raises:
            ValueError: an unknown signal, fewer than 2 tiers, costs not one positive
                number per tier, a ``prefix_tokens`` below 1, or ``checks`` with it.
        """
        if prefix_tokens is not None and prefix_tokens < 1:
            raise ValueError(f"prefix_tokens {prefix_tokens} is not a positive count")
        if signal not in SIGNALS:
            raise ValueError(f"signal {signal!r} is not one of {', '.join(SIGNALS)}")
        if len(tiers) < 2:
            raise ValueError(f"a cascade has at least 2 tiers, got {list(tiers)}")
        costs = tuple(costs) if costs is not None else tuple(2.0 ** i for i in range(len(tiers)))
        if len(costs) != len(tiers) or any(not c > 0 for c in costs):
            raise ValueError(f"costs {list(costs)} must give one positive number per tier")
        by_item: dict[str, dict[str, Record]] = {}
        for r in records:
            if r.tier in tiers:
                by_item.setdefault(r.id, {})[r.tier] = r
        complete = {i: rs for i, rs in sorted(by_item.items()) if len(rs) == len(tiers)}
        if len(complete) < len(by_item):
            logger.warning("%d of %d items lack a tier's record and are left out",
                           len(by_item) - len(complete), len(by_item))
        rows = [[rs[t] for t in tiers] for rs in complete.values()]
        return cls(tuple(tiers), costs, signal, quantile, tuple(complete),
                   tuple(row[0].kind for row in rows),
                   tuple(next((r.prompt for r in row if r.prompt), "") for row in rows),
                   tuple(tuple(r.correct for r in row) for row in rows),
                   tuple(tuple((r.prompt_tokens + r.completion_tokens) * c
                               for r, c in zip(row, costs)) for row in rows),
                   tuple(tuple(r.escalation_tokens(prefix_tokens) * c
                               for r, c in zip(row, costs)) for row in rows),
                   tuple(tuple(r.score(signal, quantile, prefix_tokens) for r in row)
                         for row in rows),
                   prefix_tokens)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def top(self) -> int:
        return len(self.tiers) - 1

    def subset(self, indices: Sequence[int]) -> Replay:
        """The rows at ``indices`` (in that order)."""
        def pick(column: tuple) -> tuple:
            return tuple(column[i] for i in indices)
        return replace(self, ids=pick(self.ids), kinds=pick(self.kinds),
                       prompts=pick(self.prompts), correct=pick(self.correct),
                       spent=pick(self.spent), escalated=pick(self.escalated),
                       scores=pick(self.scores))

    def tier_accuracy(self, kind: str | None = None) -> dict[str, float]:
        """Each tier alone: tier → accuracy over the items (of ``kind``, if given)."""
        rows = [c for c, k in zip(self.correct, self.kinds) if kind in (None, k)]
        return {t: sum(c[j] for c in rows) / len(rows) if rows else math.nan
                for j, t in enumerate(self.tiers)}

    def answering_tier(self, i: int, threshold: float, pre_routed: bool = False) -> int:
        """The tier that answers item ``i``: the first whose score is >= ``threshold``."""
        if pre_routed:
            return self.top
        tier = 0
        while tier < self.top and self.scores[i][tier] < threshold:
            tier += 1
        return tier

    def simulate(self, threshold: float, pre_routed: Collection[str] = ()) -> Outcome:
        """Replay every item; ``pre_routed``: ids sent straight to the top tier.

        Raises ValueError when there are no items.
        """
        n = len(self)
        if not n:
            raise ValueError("no item has a record for every tier")
        answered = [0] * len(self.tiers)
        right = cost = wasted = pre = 0.0
        kinds: dict[str, list[int]] = {}
        for i in range(n):
            skip = self.ids[i] in pre_routed
            tier = self.answering_tier(i, threshold, skip)
            paid = self.spent[i][tier] + (0.0 if skip else sum(self.escalated[i][:tier]))
            answered[tier] += 1
            right += self.correct[i][tier]
            cost += paid
            wasted += paid - self.spent[i][tier]
            pre += skip
            kinds.setdefault(self.kinds[i], []).append(self.correct[i][tier])
        return Outcome(n, threshold, right / n, answered[-1] / n, tuple(a / n for a in answered),
                       pre / n, cost / n, wasted / n,
                       sum(c[-1] for c in self.correct) / n, sum(s[-1] for s in self.spent) / n,
                       {k: sum(v) / len(v) for k, v in sorted(kinds.items())})

    def candidates(self, pre_routed: Collection[str] = ()) -> list[float]:
        """Thresholds worth trying, ascending: the distinct finite scores of the tiers below
        the top (of items not pre-routed) and 0.0, within the spec's [-100, 0]. The first
        escalates nothing but the answers proven wrong (-inf: ``checks``); each next
        one escalates the answers scoring the one before."""
        values = {min(max(s, -100.0), 0.0) for i, row in enumerate(self.scores)
                  if self.ids[i] not in pre_routed for s in row[:-1] if math.isfinite(s)}
        return sorted(values | {0.0})

    def threshold_for_share(self, target: float, pre_routed: Collection[str] = ()) -> float:
        """The candidate threshold whose top-tier share is the largest not above ``target``
        (the share only grows with the threshold, so a bisection finds it); the lowest
        candidate when even that exceeds it (pre-routing alone may).

        Raises ValueError for a target outside [0, 1] or no items.
        """
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"target top-tier share {target} is not within [0, 1]")
        cands = self.candidates(pre_routed)
        low, high = 0, len(cands) - 1  # invariant: the answer's index is in [low, high]
        while low < high:
            mid = (low + high + 1) // 2
            if self.simulate(cands[mid], pre_routed).top_share <= target + 1e-12:
                low = mid
            else:
                high = mid - 1
        return cands[low]

    def fit_pre_route(self, max_share: float = 0.1, l2: float = 1.0,
                      min_probability: float = 0.5) -> PreRoute:
        """``preroute.fit_logistic`` on these items' prompts; label: tier 0 was wrong."""
        if not any(self.prompts):
            raise ValueError("the records hold no prompts: record them again to fit a pre-route")
        return fit_logistic(self.prompts, [not c[0] for c in self.correct], max_share, l2,
                            min_probability)

    def curve(self, points: int = 200) -> list[Outcome]:
        """Outcomes at up to ``points`` candidate thresholds spread evenly over the list,
        the first (nothing escalates) and the last (0.0) included."""
        cands = self.candidates()
        step = max(1, math.ceil((len(cands) - 1) / max(points - 1, 1)))
        chosen = cands[::step] + ([cands[-1]] if (len(cands) - 1) % step else [])
        return [self.simulate(t) for t in chosen]


def simulate(records: Iterable[Record], tiers: Sequence[str], threshold: float,
             signal: str = "logprob-quantile", quantile: float = DEFAULT_QUANTILE,
             costs: Sequence[float] | None = None, pre_routed: Collection[str] = ()) -> Outcome:
    """``Replay.build(...).simulate(threshold, pre_routed)``."""
    return Replay.build(records, tiers, signal, quantile, costs).simulate(threshold, pre_routed)


def threshold_for_share(records: Iterable[Record], tiers: Sequence[str], target_top_share: float,
                        signal: str = "logprob-quantile", quantile: float = DEFAULT_QUANTILE,
                        costs: Sequence[float] | None = None) -> float:
    """``Replay.build(...).threshold_for_share(target_top_share)``."""
    return Replay.build(records, tiers, signal, quantile, costs).threshold_for_share(
        target_top_share)


# --- held-out halves ------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """A figure over the splits: mean, sample standard deviation, min, max. Splits where
    it is undefined (a ratio to a top tier that got nothing right: inf) are left out; all
    of them undefined gives inf."""

    mean: float
    sd: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            return cls(math.inf, 0.0, math.inf, math.inf)
        return cls(statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1
                   else 0.0, min(finite), max(finite))


@dataclass(frozen=True)
class HeldOut:
    """Calibrated on one random half, measured on the other, ``splits`` times.

    Attributes:
        target: the top-tier share the threshold was calibrated to.
        thresholds: each split's threshold.
        relative_accuracy, relative_cost: accuracy and cost over the top tier alone's on
            the same (held-out) half.
        top_share, accuracy, pre_routed: the held-out half's.
    """

    target: float
    splits: int
    thresholds: tuple[float, ...]
    relative_accuracy: Spread
    top_share: Spread
    relative_cost: Spread
    accuracy: Spread
    pre_routed: Spread

    def meets(self, accuracy: float = 0.95, top_share: float = 0.40, cost: float = 0.75) -> bool:
        """The issue's targets, on the means: >= 95 % of the top tier's accuracy, <= 40 % of
        requests at the top tier, <= 0.75 of its compute."""
        return (self.relative_accuracy.mean >= accuracy and self.top_share.mean <= top_share
                and self.relative_cost.mean <= cost)

    def to_json(self) -> dict:
        return {**asdict(self), "meets_targets": self.meets()}


def held_out(records: Iterable[Record] | Replay, tiers: Sequence[str] = (),
             target: float = 0.3, signal: str = "logprob-quantile",
             quantile: float = DEFAULT_QUANTILE, costs: Sequence[float] | None = None,
             splits: int = 20, seed: int = 0, pre_route_share: float | None = None) -> HeldOut:
    """Calibrate on a random half, evaluate on the other, ``splits`` times.

    Args:
        records: the recorded answers, or a built ``Replay`` (then ``tiers``, ``signal``,
            ``quantile`` and ``costs`` are its own and these arguments are ignored).
        target: the top-tier share to calibrate to.
        splits: random halves (seeded: the same splits for the same ``seed`` and items).
        pre_route_share: fit the pre-route model on each calibration half too, keeping at
            most this fraction pre-routed there (needs the records' prompts); None: none.

    Raises ValueError with fewer than 4 items or splits < 1.
    """
    replay = records if isinstance(records, Replay) else Replay.build(
        records, tiers, signal, quantile, costs)
    n = len(replay)
    if n < 4 or splits < 1:
        raise ValueError(f"held-out halves need >= 4 items and >= 1 split, got {n}, {splits}")
    rng = random.Random(seed)
    outcomes, thresholds = [], []
    for _ in range(splits):
        order = list(range(n))
        rng.shuffle(order)
        calib, test = replay.subset(order[:n // 2]), replay.subset(order[n // 2:])
        calib_pre: set[str] = set()
        test_pre: set[str] = set()
        if pre_route_share is not None:
            model = calib.fit_pre_route(pre_route_share)
            calib_pre = {i for i, p in zip(calib.ids, calib.prompts) if model.routes(p)}
            test_pre = {i for i, p in zip(test.ids, test.prompts) if model.routes(p)}
        threshold = calib.threshold_for_share(target, calib_pre)
        thresholds.append(threshold)
        outcomes.append(test.simulate(threshold, test_pre))
    return HeldOut(target, splits, tuple(thresholds),
                   Spread.of([o.relative_accuracy for o in outcomes]),
                   Spread.of([o.top_share for o in outcomes]),
                   Spread.of([o.relative_cost for o in outcomes]),
                   Spread.of([o.accuracy for o in outcomes]),
                   Spread.of([o.pre_routed for o in outcomes]))


def fit_pre_route(records: Iterable[Record] | Replay, tiers: Sequence[str] = (),
                  max_share: float = 0.1, l2: float = 1.0,
                  min_probability: float = 0.5) -> PreRoute:
    """The pre-route model fitted on the recorded prompts, label: tier 0 answered wrongly
    (``preroute.fit_logistic``); it pre-routes at most ``max_share`` of them.

    Raises ValueError when the records hold no prompts.
    """
    replay = records if isinstance(records, Replay) else Replay.build(records, tiers)
    return replay.fit_pre_route(max_share, l2, min_probability)


# --- the spec snippet -----------------------------------------------------------------------
def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


def snippet(threshold: float, signal: str = "logprob-quantile",
            quantile: float = DEFAULT_QUANTILE, pre_route: PreRoute | None = None,
            comment: str = "", prefix_tokens: int | None = None) -> str:
    """The YAML to paste under ``spec.cascade`` (keys ``escalation``, with a pre-route
    model ``preRoute``, and with ``prefix_tokens`` ``streaming``), camelCase as the CRD
    spells them; ``comment`` goes on top."""
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += ["escalation:", f"  signal: {signal}"]
    if signal in ("logprob-quantile", "checks"):
        lines.append(f"  quantile: {quantile:g}")
    lines.append(f"  threshold: {round(threshold, 6)!r}")
    if pre_route is not None:
        lines += ["preRoute:", "  weights:"]
        lines += [f"    {_camel(f)}: {round(pre_route.weights[f], 6)!r}" for f in FEATURES]
        lines += [f"  bias: {round(pre_route.bias, 6)!r}",
                  f"  threshold: {round(pre_route.threshold, 6)!r}"]
    if prefix_tokens is not None:
        lines += ["streaming:", "  mode: prefix", f"  prefixTokens: {prefix_tokens}"]
    return "\n".join(lines) + "\n"
