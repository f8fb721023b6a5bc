"""Cascade calibration on synthetic records with known answers: the replay's accuracy, share
and cost; the threshold for a share; held-out halves; the pre-route fit; the record file's
resume logic; the CLI and bench/cascade.py end to end (no model, no server)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from sluice.api.service import CascadeSpec
from sluice.cascade import recorder
from sluice.cascade.calibrate import (Record, Replay, fit_pre_route, held_out, simulate,
                                      snippet, threshold_for_share)
from sluice.cascade.evalset import arithmetic_problems
from sluice.cascade.checks import (examples_pass, prompt_examples, refutation, written_examples,
                                   wrong_steps)
from sluice.cascade.policy import FEATURES, Scores, answer_scores
from sluice.cascade.preroute import solve
from sluice.cascade.records import done_pairs, load_records

ROOT = Path(__file__).resolve().parents[1]
TIERS = ["small", "big"]
COSTS = [1.0, 4.0]
CODE = "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n"


def rec(id: str, tier: str, correct: bool, score: float, kind: str = "arithmetic",
        prompt: str = "", tokens: tuple[int, int] = (10, 20)) -> Record:
    """A record whose every signal reads ``score`` (all its 5 tokens have that logprob)."""
    return Record(id, kind, tier, correct, answer_scores([score] * 5), 0.1, (score,) * 5,
                  tokens[0], tokens[1], "answer", 1.0, prompt)


def ten() -> list[Record]:
    """Item i: the small tier scores -0.1 - 0.2 i and is right exactly when its score > -1
    (items 0-4); the big tier is right on all but item 9 and scores -0.05."""
    out = []
    for i in range(10):
        score = -0.1 - 0.2 * i
        out += [rec(f"item-{i}", "small", score > -1, score),
                rec(f"item-{i}", "big", i != 9, -0.05)]
    return out


def test_simulate_counts_accuracy_share_and_every_tier_paid():
    o = simulate(ten(), TIERS, threshold=-1.0, costs=COSTS)
    # items 5-9 escalate; 0-4 right on small, 5-8 right on big, 9 wrong
    assert (o.items, o.accuracy, o.top_share, o.shares) == (10, 0.9, 0.5, (0.5, 0.5))
    # small: 30 tokens x 1; big: 30 x 4; escalated items pay both
    assert o.cost == pytest.approx((5 * 30 + 5 * 150) / 10) == 90.0
    assert o.wasted == pytest.approx(15.0)
    assert (o.top_accuracy, o.top_cost) == (0.9, 120.0)
    assert o.relative_accuracy == pytest.approx(1.0) and o.relative_cost == pytest.approx(0.75)
    assert o.kind_accuracy == {"arithmetic": 0.9}
    nothing = simulate(ten(), TIERS, threshold=-5.0, costs=COSTS)
    assert (nothing.accuracy, nothing.top_share, nothing.cost) == (0.5, 0.0, 30.0)
    everything = simulate(ten(), TIERS, threshold=0.0, costs=COSTS)
    assert (everything.accuracy, everything.top_share, everything.cost) == (0.9, 1.0, 150.0)


def test_pre_routed_items_skip_the_small_tier():
    o = simulate(ten(), TIERS, threshold=-1.0, costs=COSTS, pre_routed={"item-0", "item-9"})
    # item 0 loses nothing (big is right too) and pays 120 instead of 30; item 9 saves 30
    assert (o.accuracy, o.top_share, o.pre_routed) == (0.9, 0.6, 0.2)
    assert o.cost == pytest.approx((4 * 30 + 120 + 4 * 150 + 120) / 10)


def test_threshold_for_share_hits_an_exact_share():
    threshold = threshold_for_share(ten(), TIERS, 0.3, costs=COSTS)
    assert threshold == pytest.approx(-1.3)  # the 4th lowest score: 3 below it escalate
    assert simulate(ten(), TIERS, threshold).top_share == 0.3
    assert threshold_for_share(ten(), TIERS, 0.35) == pytest.approx(-1.3)  # not above
    assert threshold_for_share(ten(), TIERS, 0.0) == pytest.approx(-1.9)  # escalates nothing
    assert threshold_for_share(ten(), TIERS, 1.0) == 0.0
    replay = Replay.build(ten(), TIERS)
    # two low scorers pre-routed count towards the share: one more escalation (item 7) fits
    assert replay.threshold_for_share(0.3, {"item-8", "item-9"}) == pytest.approx(-1.3)
    with pytest.raises(ValueError, match="within"):
        replay.threshold_for_share(1.5)


def test_other_signals_and_quantiles_replay_from_the_logprobs():
    r = Record("a", "code", "small", True, answer_scores([-0.1, -0.2, -3.0, -0.4]), 0.1,
               (-0.1, -0.2, -3.0, -0.4), 5, 4)
    assert r.score("logprob-quantile", 0.1) == pytest.approx(-3.0 + 0.3 * 2.6)
    assert r.score("logprob-quantile", 0.5) == pytest.approx(-0.3)  # recomputed
    assert (r.score("min-logprob"), r.score("mean-logprob")) == (-3.0, pytest.approx(-0.925))
    back = Record.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and r.to_json()["scores"]["q"] == 0.1


def prefixed(i: int, tier: str, correct: bool, head: float) -> Record:
    """A 40-token answer whose first 16 tokens have logprob ``head`` and the rest -3.0."""
    logprobs = (head,) * 16 + (-3.0,) * 24
    return Record(f"item-{i}", "code", tier, correct, answer_scores(logprobs), 0.1, logprobs,
                  10, 40)


def test_prefix_mode_judges_the_first_k_tokens_and_pays_only_them_when_escalating():
    records = [prefixed(0, "small", True, -0.1), prefixed(0, "big", True, -0.1),
               prefixed(1, "small", False, -2.0), prefixed(1, "big", True, -0.1)]
    assert records[0].score("logprob-quantile", 0.1, prefix_tokens=16) == pytest.approx(-0.1)
    assert records[0].score("logprob-quantile", 0.1) == pytest.approx(-3.0)  # the whole answer
    assert records[1].score("min-logprob", prefix_tokens=4) == pytest.approx(-0.1)
    assert (records[0].escalation_tokens(), records[0].escalation_tokens(16),
            records[0].escalation_tokens(99)) == (50, 26, 50)
    whole = Replay.build(records, TIERS, costs=COSTS).simulate(-1.0)
    prefix = Replay.build(records, TIERS, costs=COSTS, prefix_tokens=16).simulate(-1.0)
    # judged whole, both small answers look unsure (-3.0) and both escalate: 2 x (50 + 200)
    assert (whole.top_share, whole.cost, whole.wasted) == (1.0, 250.0, 50.0)
    # judged on 16 tokens, item 0 stays small (50); item 1 pays 10 + 16 tokens, then 200
    assert (prefix.top_share, prefix.accuracy) == (0.5, 1.0)
    assert prefix.cost == pytest.approx((50 + 26 + 200) / 2) and prefix.wasted == 13.0
    with pytest.raises(ValueError, match="no prefix mode"):
        Replay.build(records, TIERS, signal="checks", prefix_tokens=16)
    with pytest.raises(ValueError, match="positive"):
        Replay.build(records, TIERS, prefix_tokens=0)
    text = snippet(-1.0, prefix_tokens=16)
    spec = CascadeSpec.model_validate({"tiers": TIERS, **yaml.safe_load(text)})
    assert (spec.streaming.mode, spec.streaming.prefix_tokens) == ("prefix", 16)


def test_items_missing_a_tier_are_left_out():
    replay = Replay.build(ten() + [rec("lonely", "small", True, -0.1)], TIERS)
    assert len(replay) == 10 and "lonely" not in replay.ids
    with pytest.raises(ValueError, match="costs"):
        Replay.build(ten(), TIERS, costs=[1.0])
    with pytest.raises(ValueError, match="signal"):
        Replay.build(ten(), TIERS, signal="vibes")


def test_held_out_is_deterministic_for_a_seed():
    a = held_out(ten(), TIERS, target=0.3, costs=COSTS, splits=20, seed=7)
    assert a == held_out(Replay.build(ten(), TIERS, costs=COSTS), target=0.3, splits=20, seed=7)
    assert a.splits == 20 and len(a.thresholds) == 20
    assert 0.0 <= a.top_share.min <= a.top_share.mean <= a.top_share.max <= 1.0
    assert a.relative_cost.mean < 1.0 and a.pre_routed.max == 0.0
    assert a.thresholds != held_out(ten(), TIERS, target=0.3, splits=20, seed=8).thresholds
    with pytest.raises(ValueError, match=">= 4 items"):
        held_out(ten()[:6], TIERS, target=0.3)


def separable() -> list[Record]:
    """20 items: code prompts are hard for the small tier, arithmetic prose is easy."""
    out = []
    for i in range(20):
        code = i % 2 == 0
        prompt = (CODE + "    # a step\n" * i if code else
                  f"Maya has {i + 3} apples. She buys {i} more. How many apples does she have?")
        kind = "code" if code else "arithmetic"
        out += [rec(f"p{i}", "small", not code, -0.5 - 0.01 * i, kind, prompt),
                rec(f"p{i}", "big", True, -0.1, kind, prompt)]
    return out


def test_fit_pre_route_separates_code_from_prose():
    model = fit_pre_route(separable(), TIERS, max_share=0.5)
    assert set(model.weights) == set(FEATURES) and model.weights["code"] > 0
    for r in separable()[::2]:
        assert model.routes(r.prompt) == (r.kind == "code"), r.prompt
    assert (model.share, model.hit_rate) == (0.5, 1.0) and 0.5 <= model.threshold < 1
    # at most a tenth pre-routed: two of the ten code prompts
    assert fit_pre_route(separable(), TIERS, max_share=0.1).share == 0.1
    with_pre = held_out(separable(), TIERS, target=0.5, splits=5, pre_route_share=0.5)
    assert with_pre.pre_routed.mean > 0.3 and with_pre.relative_accuracy.mean >= 0.9


def test_solve_matches_a_known_system():
    assert solve([[2.0, 1.0], [1.0, 3.0]], [3.0, 5.0]) == pytest.approx([0.8, 1.4])
    assert solve([[0.0, 1.0], [1.0, 0.0]], [2.0, 3.0]) == pytest.approx([3.0, 2.0])  # pivots


def test_snippet_is_a_valid_cascade_spec():
    model = fit_pre_route(separable(), TIERS, max_share=0.5)
    text = snippet(-1.3, "logprob-quantile", 0.1, model, comment="calibrated\non 10 items")
    assert text.startswith("# calibrated\n# on 10 items\nescalation:\n")
    spec = CascadeSpec.model_validate({"tiers": TIERS, **yaml.safe_load(text)})
    assert spec.escalation.threshold == -1.3 and spec.escalation.quantile == 0.1
    assert spec.pre_route.weights.code == pytest.approx(model.weights["code"], abs=1e-6)
    assert spec.pre_route.threshold == pytest.approx(model.threshold, abs=1e-6)
    plain = yaml.safe_load(snippet(-2.0, "min-logprob"))
    assert plain == {"escalation": {"signal": "min-logprob", "threshold": -2.0}}


def write(path: Path, records: list[Record]) -> Path:
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    return path


def test_done_pairs_lists_what_a_resumed_recording_skips(tmp_path):
    path = write(tmp_path / "r.jsonl", ten()[:3])
    with path.open("a") as f:
        f.write('{"id": "item-1", "tier": "big", "corr')  # torn by a crash
    assert done_pairs(path) == {("item-0", "small"), ("item-0", "big"), ("item-1", "small")}
    assert len(load_records(path)) == 3
    assert done_pairs(tmp_path / "absent.jsonl") == set()
    recorder._end_with_newline(path)
    assert path.read_text().endswith('"corr\n')


def sse(tier: str, texts: list[str], contents: list[list[dict]], usage: dict,
        end: str = "data: [DONE]\n\n") -> httpx.Response:
    """A chat completion stream from ``tier``: one chunk per text (with its logprob
    entries), a usage chunk, then ``end``."""
    chunks = [{"choices": [{"index": 0, "delta": {"content": text},
                            "logprobs": {"content": content}}]}
              for text, content in zip(texts, contents)]
    chunks.append({"choices": [], "usage": usage})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + end
    return httpx.Response(200, headers={"x-sluice-tier": tier,
                                        "content-type": "text/event-stream"}, text=body)


def test_record_asks_each_tier_once_and_resumes(tmp_path):
    """The request's shape, the line written, and a rerun that asks nothing (an in-process
    httpx transport; no server)."""
    items = arithmetic_problems(2, seed=1, steps=2, max_value=20)
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        tier = request.headers["x-sluice-cascade"]
        asked.append((body["messages"][0]["content"], tier))
        assert (body["model"], body["temperature"], body["logprobs"]) == ("coder", 0, True)
        assert body["max_tokens"] == 384
        assert request.headers["x-slo-ttft-ms"] == "60000"  # the batch job's lax objective
        item = next(i for i in items if i.prompt == body["messages"][0]["content"])
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        text = f"Answer: {item.answer + (tier == 'small')}"  # small is off by one
        content = [{"token": "x", "logprob": -0.5, "top_logprobs": [{"token": "x",
                                                                     "logprob": -0.5}]}] * 3
        return sse(tier, [text[:3], text[3:]], [content[:1], content[1:]],
                   {"prompt_tokens": 50, "completion_tokens": 3})

    out = tmp_path / "r.jsonl"
    client = httpx.Client(transport=httpx.MockTransport(answer))
    summary = recorder.record(items, TIERS, "http://router", "coder", out, client=client,
                              progress=False)
    assert (summary.recorded, summary.skipped, summary.failed) == (4, 0, 0)
    assert summary.correct == {"small": 0, "big": 2}
    records = load_records(out)
    assert [(r.id, r.tier) for r in records] == [(i.id, t) for i in items for t in TIERS]
    assert records[1].scores == Scores(-0.5, -0.5, -0.5, 0.0, 3)
    assert (records[1].prompt_tokens, records[1].prompt) == (50, items[0].prompt)
    assert records[1].max_tokens == 384  # what the check asks with again
    again = recorder.record(items, TIERS, "http://router", "coder", out, client=client,
                            progress=False)
    assert (again.recorded, again.skipped, len(asked)) == (0, 4, 4)


def test_a_stream_that_breaks_is_retried_then_left_out(tmp_path):
    """An error event, or a stream cut before [DONE]: the pair is asked again, and left
    out (for a rerun) after the retries; nothing is written for it."""
    items = arithmetic_problems(1, seed=3, steps=2, max_value=20)
    ends = iter(['data: {"error": {"message": "worker lost"}}\n\n', "", "data: [DONE]\n\n"])

    def answer(request: httpx.Request) -> httpx.Response:
        content = [{"token": "x", "logprob": -0.1, "top_logprobs": []}]
        return sse("small", [f"Answer: {items[0].answer}"], [content],
                   {"prompt_tokens": 9, "completion_tokens": 1}, end=next(ends))

    out = tmp_path / "r.jsonl"
    client = httpx.Client(transport=httpx.MockTransport(answer))
    left = recorder.record(items, ["small"], "http://router", "coder", out, client=client,
                           retries=1, progress=False)
    assert (left.recorded, left.failed) == (0, 1) and not out.read_text()
    again = recorder.record(items, ["small"], "http://router", "coder", out, client=client,
                            retries=0, progress=False)
    assert (again.recorded, again.correct) == (1, {"small": 1})


def test_record_in_blocks_sends_a_block_to_one_tier_at_once(tmp_path):
    """batch=2: each tier gets a block's two items together (the handler waits until both
    are in flight), every tier answers a block before the next block; a resume after a
    partial block asks only what is missing; batch 0 is refused."""
    items = arithmetic_problems(3, seed=2, steps=2, max_value=20)
    both_in_flight = threading.Barrier(2, timeout=10)
    asked, resuming = [], False

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        tier = request.headers["x-sluice-cascade"]
        item = next(i for i in items if i.prompt == body["messages"][0]["content"])
        asked.append((item.id, tier))
        if not resuming and item is not items[2]:  # the last block holds one item
            both_in_flight.wait()
        content = [{"token": "x", "logprob": -0.1, "top_logprobs": []}]
        return sse(tier, [f"Answer: {item.answer}"], [content],
                   {"prompt_tokens": 9, "completion_tokens": 1})

    out = tmp_path / "r.jsonl"
    client = httpx.Client(transport=httpx.MockTransport(answer))
    summary = recorder.record(items, TIERS, "http://router", "coder", out, client=client,
                              batch=2, progress=False)
    assert (summary.recorded, summary.failed, summary.correct) == (6, 0, {"small": 3, "big": 3})
    a, b, c = (i.id for i in items)
    pairs = [(r.id, r.tier) for r in load_records(out)]
    assert pairs == [(a, "small"), (b, "small"), (a, "big"), (b, "big"), (c, "small"),
                     (c, "big")]
    out.write_text("".join(line + "\n" for line in out.read_text().splitlines()[:3]))
    asked.clear()
    resuming = True
    again = recorder.record(items, TIERS, "http://router", "coder", out, client=client,
                            batch=2, progress=False)
    assert (again.recorded, again.skipped) == (3, 3)
    assert asked == [(b, "big"), (c, "small"), (c, "big")]
    with pytest.raises(ValueError, match="--batch 0"):
        recorder.record(items, TIERS, "http://router", "coder", out, client=client, batch=0)


def mixed(n: int = 40) -> list[Record]:
    """n items, half code: the small tier is right on easy items (score > -1), the big one
    on all but every tenth; prompts included so the pre-route fits."""
    out = []
    for i in range(n):
        kind = "code" if i % 2 else "arithmetic"
        prompt = CODE if kind == "code" else f"Omar has {i} coins. How many now?"
        score = -0.05 * i
        out += [rec(f"m{i:02}", "small", score > -1, score, kind, prompt),
                rec(f"m{i:02}", "big", i % 10 != 9, -0.02, kind, prompt, (10, 40))]
    return out


def test_cli_calibrate_prints_the_snippet(tmp_path):
    path = write(tmp_path / "r.jsonl", mixed())
    out = tmp_path / "cal.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "cascade", "calibrate", "--records", str(path),
         "--tiers", "small,big", "--costs", "1,4", "--target-top-share", "0.5", "--splits",
         "4", "--pre-route-share", "0.1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "escalation:\n  signal: logprob-quantile\n  quantile: 0.1\n  threshold: " in proc.stdout
    assert "preRoute:\n  weights:\n    logChars: " in proc.stdout
    result = json.loads(out.read_text())
    assert result["items"] == 40 and result["all_items"]["top_share"] <= 0.5
    assert set(result["held_out"]) >= {"relative_accuracy", "top_share", "relative_cost"}
    prefix = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "cascade", "calibrate", "--records", str(path),
         "--tiers", "small,big", "--splits", "4", "--prefix-tokens", "16"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert prefix.returncode == 0, prefix.stderr[-2000:]
    assert "streaming:\n  mode: prefix\n  prefixTokens: 16\n" in prefix.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "cascade", "calibrate", "--records",
         str(tmp_path / "none.jsonl"), "--tiers", "small,big"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def bench_cascade(records, costs: str, out) -> dict:
    """Run bench/cascade.py on ``records`` (4 splits) and return the JSON it wrote."""
    proc = subprocess.run([sys.executable, "bench/cascade.py", "--records", str(records),
                           "--costs", costs, "--splits", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_bench_cascade_writes_its_json(tmp_path):
    path, out = write(tmp_path / "r.jsonl", mixed()), tmp_path / "cascade.json"
    result = bench_cascade(path, "1,4", out)
    assert {"tier_accuracy", "tier_relative_cost", "curves", "held_out", "pre_route",
            "verdict", "smaller_tier_better_at"} <= set(result)
    assert result["tiers"] == ["small", "big"]  # the file's order
    assert set(result["curves"]) == {"q0.05", "q0.1", "q0.25", "min", "mean", "checks",
                                     "q0.1 prefix16", "q0.1 prefix32"}
    assert set(result["held_out"]["q0.1"]) == {"0.2", "0.3", "0.4"}
    assert set(result["pre_route"]["held_out"]) == {"q0.1", "checks"}
    assert result["verdict"]["rows"] == 8 * 3 + 2 * 3
    assert result["tier_accuracy"]["code"]["big"] == 0.8  # 9, 19, 29, 39 are code
    assert out.with_suffix(".png").stat().st_size > 10_000
    absent = subprocess.run([sys.executable, "bench/cascade.py", "--records",
                             str(tmp_path / "none.jsonl"), "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert absent.returncode == 2 and "missing" in absent.stderr
    nowhere = subprocess.run([sys.executable, "bench/cascade.py", "--records", str(path),
                              "--out", "/proc/x/y.json"],  # was a traceback after the replay
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert nowhere.returncode == 2 and "its directory does not exist" in nowhere.stderr


def test_spread_leaves_out_undefined_splits():
    from sluice.cascade.calibrate import Spread

    assert Spread.of([1.0, math.inf, 3.0]) == Spread(2.0, math.sqrt(2.0), 1.0, 3.0)
    assert Spread.of([math.inf, math.inf]) == Spread(math.inf, 0.0, math.inf, math.inf)


STUB = '''```python
from typing import List


def below(numbers: List[int], limit: int) -> bool:
    """Are all numbers below limit?
    >>> below([1, 2], 3)
    True
    >>> below([1, 5], 3) == False
    >>> below([], 0)
    True
    """
```'''
RIGHT = ("Here:\n```python\ndef below(numbers: List[int], limit: int) -> bool:\n"
         "    return all(n < limit for n in numbers)\n```")


def test_examples_pass_runs_the_answers_code_on_the_prompts_examples():
    """The code-execution signal: the prompt's stub (its import) then the answer's code,
    each >>> example compared by value (or True when written as `== y`); a wrong answer,
    an answer without code, or one that never returns fails; no examples is None."""
    assert prompt_examples(STUB) == [("below([1, 2], 3)", "True"),
                                     ("below([1, 5], 3) == False", ""), ("below([], 0)", "True")]
    assert examples_pass(STUB, RIGHT) is True
    assert examples_pass(STUB, RIGHT.replace("n < limit", "n <= limit")) is True  # examples miss it
    assert examples_pass(STUB, RIGHT.replace("all(", "any(")) is False
    assert examples_pass(STUB, "I cannot write that.") is False
    assert examples_pass(STUB, "```python\ndef below(n, l):\n    while True: pass\n```",
                         timeout_s=2) is False
    assert examples_pass("Add 2 and 3.", RIGHT) is None


WRITTEN = '''```python
def digit_sum(s, scale=1):
    """Sum of the upper characters' ASCII codes, times scale.

    Examples:
        digit_sum("") => 0
        digit_sum("abAB") == 131
        digit_sum("aA", 2) ==> 130.
        * digit_sum("A")   # returns 65
        for digit_sum("B") ➞ 66
        digit_sum("C") should return 67
        digit_sum("a") -> true
        digit_sum(s) = 1 + s, if s is even.
        digit_sum("x", scale=2) => 0
        digit_sum("D") => 68 (the code of D)
        not_digit_sum("E") => 69
    Input: s = "F"  Output: 70
    """
```'''


def test_written_examples_are_read_when_a_prompt_has_no_doctest():
    """HumanEval's other example styles (`f(x) => y`, `==`, `==>`, `➞`, `# returns`,
    `should return`, `->`): literal calls of a function the prompt defines, with a literal
    value; a formula, a keyword argument, trailing prose or another function's name is not an
    example."""
    assert written_examples(WRITTEN) == [
        ('digit_sum("")', "0"), ('digit_sum("abAB")', "131"), ('digit_sum("aA", 2)', "130"),
        ('digit_sum("A")', "65"), ('digit_sum("B")', "66"), ('digit_sum("C")', "67"),
        ('digit_sum("a")', "True")]
    assert prompt_examples(WRITTEN) == written_examples(WRITTEN)
    assert prompt_examples(STUB) == [("below([1, 2], 3)", "True"),  # doctests come first
                                     ("below([1, 5], 3) == False", ""), ("below([], 0)", "True")]
    right = ("```python\ndef digit_sum(s, scale=1):\n"
             "    return scale * sum(ord(c) for c in s if c.isupper())\n```")
    assert examples_pass(WRITTEN, right) is False  # digit_sum("a") is 0, written as true
    fixed = WRITTEN.replace('digit_sum("a") -> true', 'digit_sum("a") -> 0')
    assert examples_pass(fixed, right) is True
    assert examples_pass(fixed, right.replace("isupper", "islower")) is False


DOCTESTS = '''```python
def d(x=None):
    """
    >>> x = 3
    >>> d(x)
    6
    >>> d(
    ...     4)
    8
    >>> d()
    hello
    <BLANKLINE>
    >>> d("a")
    Traceback (most recent call last):
    TypeError: can only concatenate str (not "int") to str
    >>> list(range(d(3)))
    [0, 1, ..., 5]
    >>> d(1.0) / 3
    0.67
    """
```'''
D_RIGHT = ("```python\ndef d(x=None):\n    if x is None:\n        print('hello')\n"
           "        print()\n        return None\n    return x + x if not isinstance(x, str) else "
           "x + 1\n```")


def test_examples_run_as_doctest_reads_them():
    """Found by a break-it pass, each once a right answer failed: a name set by one example
    is there for the next, continuation lines, printed output, <BLANKLINE>, an expected
    exception, doctest's ELLIPSIS, a value written rounded; and code that exits 0 before the
    examples ran does not pass."""
    assert examples_pass(DOCTESTS, D_RIGHT) is True
    assert examples_pass(DOCTESTS, D_RIGHT.replace("x + x", "x * 3")) is False
    assert examples_pass(DOCTESTS, D_RIGHT.replace("print('hello')", "print('bye')")) is False
    assert examples_pass(DOCTESTS, D_RIGHT.replace("x + 1", "x")) is False  # no TypeError
    exits = "```python\nraise SystemExit(0)\n```"
    assert examples_pass(DOCTESTS, exits) is False
    assert examples_pass(DOCTESTS, "```python\nimport os\nos._exit(0)\n```") is False
    one_line = '''```python\ndef add(a, b):\n    """add(1, 2) => 3"""\n```'''
    assert written_examples(one_line) == [("add(1, 2)", "3")]
    assert written_examples("def f(n):\n    f(5) => [0, 1, ..., 4]\n") == []  # abbreviated
    deep = "def f(x):\n    pass\nf(" + "-" * 5000 + "1) => 1\nf(" + "1+" * 5000 + "1) => 1\n"
    assert written_examples(deep) == [] and refutation(deep, "x") is None


def test_cli_rescore_runs_recorded_code_on_its_examples_again(tmp_path):
    """Records of a reader that did not know written examples get them; a cut answer (at
    the recorder's limit) and non-code lines are left alone; the rest of a line is kept."""
    fixed = WRITTEN.replace('digit_sum("a") -> true', 'digit_sum("a") -> 0')
    right = ("```python\ndef digit_sum(s, scale=1):\n"
             "    return scale * sum(ord(c) for c in s if c.isupper())\n```")
    code = replace(rec("c", "small", True, -0.1, "code", fixed), answer=right)
    cut = replace(code, id="cut", answer=right + " " * recorder.ANSWER_CHARS)
    before = [code, replace(code, tier="big", answer="no code"), cut,
              rec("a", "small", True, -0.1, prompt="1 + 1 = ?")]
    path = write(tmp_path / "r.jsonl", before)
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "cascade", "rescore",
                           "--records", str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 code answers run on their prompts' examples; 2 changed" in proc.stdout
    after = load_records(path)
    assert [r.examples for r in after] == [True, False, None, None]
    assert [replace(r, examples=None) for r in after] == before  # nothing else changed
    assert after[0].to_json() == {**code.to_json(), "examples": True}
    missing = subprocess.run([sys.executable, "-m", "sluice.cli", "cascade", "rescore",
                              "--records", str(tmp_path / "none.jsonl")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such records file" in missing.stderr


def test_rescore_keeps_what_it_cannot_read_and_replaces_only_regular_files(tmp_path):
    """Found by a break-it pass: rescore of /dev/null put a regular file in its place, a
    torn line was dropped, the file's mode was lost, and an answer that is not text was a
    traceback."""
    path = write(tmp_path / "r.jsonl", [rec("a", "small", True, -0.1, prompt="1 + 1 = ?")])
    with path.open("a") as f:
        f.write('{"torn": \n')
    path.chmod(0o640)
    recorder.rescore_examples(path)
    assert path.read_text().endswith('{"torn": \n') and path.stat().st_mode & 0o777 == 0o640
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    for bad in (link, tmp_path):
        with pytest.raises(ValueError, match="not a regular file"):
            recorder.rescore_examples(bad)
    assert link.is_symlink() and path.read_text().endswith('{"torn": \n')
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        recorder.rescore_examples(fifo)
    number = tmp_path / "n.jsonl"
    number.write_text(json.dumps({**rec("c", "small", True, -0.1, "code").to_json(),
                                  "answer": 5}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "cascade", "rescore",
                           "--records", str(number)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "n.jsonl:1: not a record (TypeError: answer is not text)" \
        in proc.stderr


def test_the_checks_signal_sends_refuted_answers_up():
    """Code that fails its prompt's examples, or an answer with a step that does not add
    up, is proven wrong: -inf, below any threshold the spec allows, so even the lowest
    calibrated threshold escalates it; other answers score the quantile (the router's
    Scores.signal and the replay's Record.score agree)."""
    failing = replace(rec("c", "small", False, -0.1, "code"), examples=False)
    passing = replace(failing, examples=True)
    assert (failing.refuted(), passing.refuted()) == ("failed-examples", None)
    assert failing.score("checks") == failing.score("checks", 0.5) == -math.inf
    assert passing.score("checks") == passing.score("logprob-quantile") == pytest.approx(-0.1)
    slip = replace(rec("m", "small", False, -0.1), answer="So 165 ÷ 5 = 31.\nAnswer: 39")
    assert (slip.refuted(), slip.score("checks")) == ("wrong-arithmetic", -math.inf)
    assert replace(failing.scores, refuted="failed-examples").signal("checks") == -math.inf
    assert failing.scores.signal("checks") == pytest.approx(-0.1)
    assert Record.from_json(failing.to_json()).examples is False
    assert "refuted" not in failing.to_json()["scores"]  # replayed from the record itself
    assert Record.from_json({**passing.to_json(), "examples": None}).examples is None
    # item c: failing code that looks sure (-0.1); b and a: passing code, unsure and sure
    records = [failing, rec("c", "big", True, -0.05),
               replace(rec("b", "small", False, -2.0, "code"), examples=True),
               rec("b", "big", True, -0.05),
               replace(rec("a", "small", True, -0.2, "code"), examples=True),
               rec("a", "big", True, -0.05)]
    replay = Replay.build(records, TIERS, signal="checks", costs=COSTS)
    assert replay.candidates() == [-2.0, -0.2, 0.0]  # no -inf: it is no threshold
    low = replay.simulate(replay.candidates()[0])
    assert (low.top_share, low.accuracy) == (pytest.approx(1 / 3), 2 / 3)  # c went up
    assert replay.threshold_for_share(0.0) == -2.0  # the share proven wrong is not negotiable
    assert replay.simulate(-1.0).top_share == pytest.approx(2 / 3)  # and b below -1


def test_wrong_steps_reads_plain_arithmetic_and_skips_what_it_cannot_read():
    """Steps as small models write them (plain, LaTeX, thousands separators, rounded
    decimals); a chain, a parenthesis, a power, a percentage, a variable are not read."""
    assert wrong_steps("1. 88 - 33 = 55\n2. \\(55 \\times 3 = 165\\)\n3. \\(165 \\div 5 = 31\\) "
                       "shells\n4. 31 + 8 = 39") == ["165 \\div 5 = 31"]
    assert wrong_steps("551 ÷ 3 = 183 pencils, 3 x 4 = 13, 10/3=3.4, 5 / 0 = 1") == [
        "551 ÷ 3 = 183", "3 x 4 = 13", "10/3=3.4", "5 / 0 = 1"]
    assert wrong_steps("total = 95 + 6 + 30 - 64 + 79 = 194") == ["95 + 6 + 30 - 64 + 79 = 194"]
    assert wrong_steps("10 / 3 = 3.33, 1,000 + 2 = 1,002, 2 * 3 + 1 = 7, 7 − 2 = 5") == []
    for unread in ("2 + 3 = 5 + 1 = 6", "(2 + 3) * 4 = 21", "x^2 + 3 = 12", "50 * 20% = 11",
                   "2 + 3 = 6x", "assert 2 + 2 == 5", "n + 1 = 3",
                   " + ".join(["1"] * 20) + " = 20",  # over 16 operations; its tail is no step
                   "3 * " * 200 + "3 = 1",  # a line over 500 characters
                   "1 + " * 1000 + "1 = 2", "(" * 5000 + "1 = 2"):  # deep: no RecursionError
        assert wrong_steps(unread) == [], unread
    # right, in other ways of writing (a break-it pass found each flagged): times, rounding,
    # remainders, thousands, ranges, roots, clocks, modulo, hex, asides, questions
    for right in ("10:30 + 2 = 12:30", "9:45 - 15 = 9:30", "5 / 8 = 0.63", "1 / 8 = 0.13",
                  "12.5 / 100 = 0.13", "5 / 2 = 3", "29 / 8 = 3 remainder 5", "7 ÷ 2 = 3 R 1",
                  "1.000 + 500 = 1.500", "1 000 + 500 = 1 500", "1'000 + 500 = 1'500",
                  "1,00,000 + 50,000 = 1,50,000", "1,5 * 2 = 3", "pages 10-12 = 3 pages",
                  "9-5 = 8 hours", "√16 + 2 = 6", "11 + 3 = 2 o'clock", "22 + 5 = 3 am",
                  "5 + 3 = 1 (mod 7)", "0x10 + 1 = 17", "In C, 7 / 2 = 3 (integer division)",
                  "It is not true that 2 + 2 = 5.", "Is 2 + 3 = 6? No, 2 + 3 = 5."):
        assert wrong_steps(right) == [], right
    assert refutation("Add them.", "2 + 2 = 5") == "wrong-arithmetic"
    assert refutation(STUB, RIGHT.replace("all(", "any(")) == "failed-examples"
    assert refutation(STUB, RIGHT) is None and refutation("Add them.", "2 + 2 = 4") is None


def test_bench_cascade_replays_the_committed_recording(tmp_path):
    """CI replays the committed records (real answers of the three-tier ladder; recording
    takes hours on two cores): each tier's accuracy in the JSON is the file's own count,
    the ladder is ordered, and the pilot's check (the 1.5B tier at least 10 points above
    the 0.5B one on the mix) holds."""
    records = ROOT / "bench/results/cascade_records.jsonl"
    result = bench_cascade(records, "1,4,11", tmp_path / "cascade.json")
    tiers = ["smollm2", "qwen-coder", "qwen-coder-15"]
    assert result["tiers"] == tiers
    lines = load_records(records)
    pairs = {(r.id, r.tier) for r in lines}
    full = {r.id for r in lines if all((r.id, t) in pairs for t in tiers)}
    counted = {t: sum(r.correct for r in lines if r.tier == t and r.id in full) / len(full)
               for t in tiers}
    assert result["items"] == len(full) >= 40
    accuracy = result["tier_accuracy"]["all"]
    assert accuracy == pytest.approx(counted)
    assert accuracy["smollm2"] < accuracy["qwen-coder"] < accuracy["qwen-coder-15"]
    assert accuracy["qwen-coder-15"] - accuracy["qwen-coder"] >= 0.10
