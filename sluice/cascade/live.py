"""``sluice cascade check``: the cascade as the router serves it, against its replay.

The replay (``calibrate.Replay``) says from recorded answers which tier answers each item and
whether that answer is right. The live check sends a sample of the same items to the
cascade's served name through the router, with no override header, so the router's own
policy (pre-route, the first tier's score, escalation) decides, and checks the answers with
the same checker (``evalset.check``). The two should agree within noise: the answers differ
only where batched greedy decoding differs (two tokens that tie to float rounding), which
moves a score across the threshold or changes a checked answer.

    item ──▶ router (model: the cascade) ──▶ x-sluice-tier, x-sluice-score, the answer
         └─▶ replay (records + the spec's threshold) ──▶ its tier, its answer's check

Agreement is reported three ways: the answering tier, the first tier's score (the router's
``x-sluice-score`` against the recorded one: equal means the first tier said the same), and
accuracy, whose difference is tested with McNemar's exact test on the items where exactly
one side is right (McNemar, 1947).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx

from sluice.cascade.calibrate import Replay
from sluice.cascade.evalset import Item, check
from sluice.cascade.policy import CascadePolicy
from sluice.cascade.recorder import (BATCH_HEADERS, MAX_TOKENS, RecordError, post,
                                     request_body, user_message)
from sluice.cascade.records import Record

SCORE_DIGITS = 4  # x-sluice-score's decimals: scores this close are the same answer's


@dataclass(frozen=True)
class LiveAnswer:
    """One item answered through the cascade.

    Attributes:
        id: the item.
        tier: the InferenceService that answered (``x-sluice-tier``).
        escalated: ``x-sluice-escalated``.
        score: ``x-sluice-score``: the last judged tier's score (None when none was judged:
            pre-routed).
        correct: ``evalset.check`` on the answer.
        completion_tokens: the answer's (the answering tier's usage).
        seconds: the request's wall time.
    """

    id: str
    tier: str
    escalated: bool
    score: float | None
    correct: bool
    completion_tokens: int
    seconds: float


@dataclass(frozen=True)
class Comparison:
    """The live cascade against its replay on the same items.

    Attributes:
        items: items compared.
        live_accuracy, replay_accuracy: fraction answered correctly.
        live_top_share, replay_top_share: fraction answered by the top tier.
        same_tier: items the same tier answered live and in the replay.
        same_score: items not pre-routed whose live score equals the replay's score of the
            tier the router judged last, to ``SCORE_DIGITS`` decimals (that tier answered
            alike).
        live_only, replay_only: items right live and wrong in the replay, and the reverse.
        p_value: McNemar's exact two-sided test of ``live_only`` against ``replay_only``.
    """

    items: int
    live_accuracy: float
    replay_accuracy: float
    live_top_share: float
    replay_top_share: float
    same_tier: int
    same_score: int
    live_only: int
    replay_only: int
    p_value: float

    @property
    def within_noise(self) -> bool:
        """No significant accuracy difference at the 5 % level."""
        return self.p_value >= 0.05

    def to_json(self) -> dict:
        return {**asdict(self), "within_noise": self.within_noise}


def mcnemar_p(b: int, c: int) -> float:
    """McNemar's exact test: the two-sided p-value of ``b`` against ``c`` discordant pairs,
    each side equally likely under the null (a binomial with p = 1/2); 1.0 with none.

    Raises ValueError for negative counts.
    """
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts {b}, {c} must be >= 0")
    n = b + c
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(replay: Replay, threshold: float, pre_routed: Collection[str],
            answers: Sequence[LiveAnswer]) -> Comparison:
    """Each live answer against the replay's prediction for its item.

    Args:
        replay: the recorded answers (its tiers, signal and quantile the cascade's).
        threshold: ``spec.cascade.escalation.threshold``.
        pre_routed: ids the cascade's pre-route sends to the top tier.
        answers: one per item compared.

    Raises:
        ValueError: no answers, or an answer whose item or tier the replay lacks.
    """
    if not answers:
        raise ValueError("no live answers to compare")
    row = {id_: i for i, id_ in enumerate(replay.ids)}
    same_tier = same_score = live_only = replay_only = live_right = replay_right = 0
    live_top = replay_top = 0
    for a in answers:
        if a.id not in row or a.tier not in replay.tiers:
            raise ValueError(f"{a.id} answered by {a.tier!r}: not in the replay's items and "
                             f"tiers ({', '.join(replay.tiers)})")
        i = row[a.id]
        skip = a.id in pre_routed
        tier = replay.answering_tier(i, threshold, skip)
        live_tier = replay.tiers.index(a.tier)
        right = replay.correct[i][tier]
        same_tier += live_tier == tier
        if a.score is not None and not skip:
            judged = min(live_tier, replay.top - 1)  # the top tier answers unjudged
            same_score += round(a.score, SCORE_DIGITS) == round(replay.scores[i][judged],
                                                                 SCORE_DIGITS)
        live_only += a.correct and not right
        replay_only += right and not a.correct
        live_right += a.correct
        replay_right += right
        live_top += live_tier == replay.top
        replay_top += tier == replay.top
    n = len(answers)
    return Comparison(n, live_right / n, replay_right / n, live_top / n, replay_top / n,
                      same_tier, same_score, live_only, replay_only,
                      mcnemar_p(live_only, replay_only))


def pre_routed_ids(replay: Replay, policy: CascadePolicy) -> set[str]:
    """The items whose recorded prompt the cascade's pre-route sends to the top tier."""
    return {i for i, p in zip(replay.ids, replay.prompts)
            if policy.start(p).reason == "pre-route"}


def sample(replay: Replay, n: int | None, seed: int = 0) -> list[str]:
    """``n`` of the replay's item ids, seeded, in the replay's order (all when None)."""
    if n is None or n >= len(replay):
        return list(replay.ids)
    keep = set(random.Random(seed).sample(range(len(replay)), n))
    return [id_ for i, id_ in enumerate(replay.ids) if i in keep]


def check_prompts(items: Sequence[Item], replay: Replay) -> None:
    """Each regenerated item asks what was recorded (the eval set has not changed since).

    Raises:
        ValueError: an item whose recorded prompt differs from ``user_message(item)``
            (records without prompts are not checked).
    """
    recorded = dict(zip(replay.ids, replay.prompts))
    for item in items:
        prompt = recorded.get(item.id, "")
        if prompt and prompt != user_message(item):
            raise ValueError(f"{item.id}: the recorded prompt is not the one this eval set "
                             f"asks now (recorded {prompt[:60]!r}...): record it again")


def recorded_limits(items: Sequence[Item], records: Sequence[Record], tiers: Sequence[str],
                    override: int | None = None) -> dict[str, int]:
    """Each item's completion-token limit: ``override``, else the largest its tiers'
    records were asked with, else the recorder's default for its kind (``MAX_TOKENS``:
    records written before the limit was recorded were asked with those)."""
    asked: dict[str, int] = {}
    for r in records:
        if r.tier in tiers and r.max_tokens is not None:
            asked[r.id] = max(asked.get(r.id, 0), r.max_tokens)
    return {i.id: override or asked.get(i.id) or MAX_TOKENS[i.kind] for i in items}


def ask_all(items: Sequence[Item], base_url: str, model: str, tiers: Sequence[str], *,
            max_tokens: Mapping[str, int] | None = None, concurrency: int = 1,
            timeout_s: float = 600.0, retries: int = 2,
            client: httpx.Client | None = None) -> tuple[list[LiveAnswer], list[str]]:
    """Send each item to the cascade ``model`` (no override header), ``concurrency`` at
    once, and check the answers.

    Args:
        max_tokens: item id → completion-token limit (``recorded_limits``); items not in
            it get the recorder's default for their kind.

    Returns:
        (the answers, in ``items`` order, the ids that failed after the retries).

    Raises:
        RecordError: a 4xx other than 429, or an answer without ``x-sluice-tier`` or from a
            tier not in ``tiers``.
    """
    limits = max_tokens or {}
    own = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))

    def ask(item: Item) -> LiveAnswer | None:
        limit = limits.get(item.id, MAX_TOKENS[item.kind])
        answered = post(client, base_url, request_body(model, item, limit), BATCH_HEADERS,
                        retries, f"{item.id} on {model}")
        if answered is None:
            return None
        headers, answer, seconds = answered
        tier = headers.get("x-sluice-tier")
        if tier is None:
            raise RecordError(f"{item.id}: the answer has no x-sluice-tier header: is "
                              f"{base_url} a Sluice router serving the cascade {model}?")
        if tier not in tiers:
            raise RecordError(f"{item.id}: answered by {tier!r}, not a tier of {model} "
                              f"({', '.join(tiers)}): is {model} the cascade the manifest "
                              "declares?")
        score = headers.get("x-sluice-score")
        return LiveAnswer(item.id, tier, headers.get("x-sluice-escalated") == "true",
                          None if score is None else float(score), check(item, answer["text"]),
                          int(answer["usage"].get("completion_tokens", 0)), round(seconds, 3))

    pool = ThreadPoolExecutor(concurrency)
    try:
        results = list(pool.map(ask, items))
    finally:  # on a RecordError, the requests not sent yet are not sent
        pool.shutdown(wait=False, cancel_futures=True)
        if own:
            client.close()
    return ([r for r in results if r is not None],
            [item.id for item, r in zip(items, results) if r is None])
