"""The cascade's pure policy: prompt features, answer scores, where a request starts and
when it escalates."""

from __future__ import annotations

import math

import pytest

from sluice.api.service import CascadeSpec
from sluice.cascade.policy import (FEATURES, BadCascadeHeader, CascadePolicy, Scores,
                                   answer_scores, hard_probability, prompt_features)


def policy(**escalation) -> CascadePolicy:
    spec = CascadeSpec.model_validate({"tiers": ["smol", "qwen", "big"],
                                       "escalation": {"threshold": -1.0, **escalation}})
    return CascadePolicy.from_spec(spec, ["smol-chat", "qwen-coder", "big-coder"])


def test_prompt_features():
    code = "def add(a, b):\n    return a + b\n"
    f = prompt_features(code)
    assert tuple(f) == FEATURES
    assert f["code"] == 1.0 and f["question"] == 0.0
    assert f["log_chars"] == pytest.approx(math.log1p(len(code)))
    assert f["log_lines"] == pytest.approx(math.log1p(3))
    word = prompt_features("Tom has 3 apples and buys 4 more each day. How many in total?")
    assert word["code"] == 0.0 and word["question"] == 1.0
    assert word["log_numbers"] == pytest.approx(math.log1p(2))
    assert word["math"] == pytest.approx(100 * 2 / 61)  # "each", "total"
    assert prompt_features("") == dict.fromkeys(FEATURES, 0.0)


def test_hard_probability_is_a_logistic_model():
    f = {"code": 1.0, "log_chars": 2.0}
    assert hard_probability(f, {"code": 1.5, "log_chars": -0.5}, bias=0.25) == \
        pytest.approx(1 / (1 + math.exp(-(0.25 + 1.5 - 1.0))))
    assert hard_probability(f, {}, bias=-1e6) == 0.0


def test_answer_scores_take_a_low_quantile_over_the_span():
    lps = [-0.01, -0.02, -3.0, -0.05, -0.1, -0.2, -0.03, -0.04, -0.06, -0.5]
    s = answer_scores(lps, q=0.1)
    # sorted: -3.0, -0.5, -0.2, ...; position 0.1 * 9 = 0.9 → -3.0 + 0.9 * 2.5
    assert s.quantile == pytest.approx(-0.75)
    assert s.min == -3.0 and s.mean == pytest.approx(sum(lps) / 10) and s.tokens == 10
    assert s.entropy is None
    assert answer_scores([]) == Scores(0.0, 0.0, 0.0, None, 0)
    assert answer_scores([float("-inf"), -1.0], q=0.5).quantile == pytest.approx(-50.5)
    # two equally likely alternatives: ln 2 nats
    assert answer_scores([-0.69], [[math.log(0.5), math.log(0.5)]]).entropy == \
        pytest.approx(math.log(2))


def test_length_does_not_hide_a_guess_from_the_quantile():
    short = [-0.01] * 9 + [-4.0]
    long = [-0.01] * 99 + [-4.0] * 12  # 11 % of the tokens guessed
    assert answer_scores(long).mean > -0.5  # the mean forgives twelve guessed tokens
    assert answer_scores(long).quantile < -3.0 and answer_scores(short).quantile < -0.4


def test_start_and_escalate():
    p = policy()
    assert p.start("hello") == p.start("hello", None)
    start = p.start("hello")
    assert (start.tier, start.escalate, start.reason) == (0, True, "cascade")
    confident, unsure = Scores(-0.5, -2, -0.1, None, 5), Scores(-1.5, -3, -0.4, None, 5)
    assert not p.escalates(0, confident) and p.escalates(0, unsure) and p.escalates(1, unsure)
    assert not p.escalates(2, unsure)  # the top tier always answers
    assert p.score([-0.5] * 4).quantile == -0.5
    assert policy(signal="mean-logprob").escalates(0, unsure) is False  # mean -0.4 ≥ -1


@pytest.mark.parametrize(("header", "tier"), [
    ("off", 0), ("top", 2), ("qwen", 1), ("qwen-coder", 1), (" big ", 2)])
def test_the_header_picks_a_tier_without_escalation(header, tier):
    start = policy().start("x", header)
    assert (start.tier, start.escalate, start.reason) == (tier, False, "header")


def test_an_unknown_header_value_is_an_error_naming_the_tiers():
    with pytest.raises(BadCascadeHeader, match="'huge' is not off, top or a tier of this "
                                               "cascade \\(smol, qwen, big\\)"):
        policy().start("x", "huge")


def test_pre_route_sends_predicted_hard_prompts_to_the_top():
    spec = CascadeSpec.model_validate({
        "tiers": ["smol", "big"], "escalation": {"threshold": -1.0},
        "preRoute": {"weights": {"code": 4.0}, "bias": -2.0, "threshold": 0.8}})
    p = CascadePolicy.from_spec(spec, ["s", "b"])
    assert p.start("def f():\n    return 1").reason == "pre-route"  # σ(2) = 0.88
    assert p.start("def f():\n    return 1").tier == 1
    assert p.start("What is 2 + 2?").reason == "cascade"  # σ(-2) = 0.12
