"""`sluice cascade check`'s parts on known inputs: McNemar's exact p-values, the comparison of
live answers with the replay, the requests it sends (an in-process httpx transport; the real
router and workers are in test_router_cascade's README test), the items regenerated from
their ids, and the CLI's refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from sluice.cascade import live
from sluice.cascade.calibrate import Replay
from sluice.argtypes import server_url
from sluice.cascade.evalset import arithmetic_problems, items_by_id
from sluice.cascade.live import LiveAnswer, compare, mcnemar_p
from sluice.cascade.recorder import RecordError, user_message
from sluice.cascade.records import load_records
from test_cascade_calibrate import TIERS, rec, sse, ten, write

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("b", "c", "p"), [
    (0, 0, 1.0), (3, 3, 1.0), (5, 0, 2 / 32), (0, 6, 2 / 64), (1, 4, 2 * 6 / 32),
    (2, 9, 2 * (1 + 11 + 55) / 2048)])
def test_mcnemar_exact_p_values(b, c, p):
    assert mcnemar_p(b, c) == pytest.approx(p)


def test_mcnemar_refuses_negative_counts():
    with pytest.raises(ValueError, match="-1"):
        mcnemar_p(-1, 2)


def test_compare_counts_tiers_scores_and_discordant_items():
    """ten() at threshold -1: items 0-4 stay on small (right), 5-9 go to big (right but 9).
    Live: item 0 as replayed; item 4 escalated (its small answer scored -1.2 live, not
    -0.9) and right; item 5 as replayed; item 9 stayed on small and was right; item 7 was
    pre-routed and wrong."""
    replay = Replay.build(ten(), TIERS, costs=[1, 4])
    answers = [LiveAnswer("item-0", "small", False, -0.1, True, 20, 1.0),
               LiveAnswer("item-4", "big", True, -1.2, True, 20, 1.0),
               LiveAnswer("item-5", "big", True, -1.1, True, 20, 1.0),
               LiveAnswer("item-9", "small", False, -0.3, True, 20, 1.0),
               LiveAnswer("item-7", "big", False, None, False, 20, 1.0)]
    c = compare(replay, -1.0, {"item-7"}, answers)
    assert (c.items, c.same_tier, c.same_score) == (5, 3, 2)
    # replay: 0 right, 4 right, 5 right, 9 wrong, 7 right (big) → live only 9, replay only 7
    assert (c.live_only, c.replay_only) == (1, 1)
    assert (c.live_accuracy, c.replay_accuracy) == (0.8, 0.8)
    assert (c.live_top_share, c.replay_top_share) == (0.6, 0.6)
    assert c.p_value == 1.0 and c.within_noise and c.to_json()["within_noise"] is True


def test_compare_refuses_an_item_or_tier_the_replay_lacks():
    replay = Replay.build(ten(), TIERS)
    with pytest.raises(ValueError, match="item-99"):
        compare(replay, -1.0, (), [LiveAnswer("item-99", "small", False, -0.1, True, 1, 1.0)])
    with pytest.raises(ValueError, match="'medium'"):
        compare(replay, -1.0, (), [LiveAnswer("item-1", "medium", False, -0.1, True, 1, 1.0)])
    with pytest.raises(ValueError, match="no live answers"):
        compare(replay, -1.0, (), [])


def test_sample_is_seeded_and_keeps_the_replay_order():
    replay = Replay.build(ten(), TIERS)
    picked = live.sample(replay, 4, seed=3)
    assert picked == live.sample(replay, 4, seed=3) and len(picked) == 4
    assert picked == sorted(picked, key=replay.ids.index)
    assert live.sample(replay, None) == live.sample(replay, 50) == list(replay.ids)


def test_ask_all_sends_the_cascade_name_and_lets_the_router_decide():
    """No x-sluice-cascade header: the router's policy picks the tier; the answer's tier,
    escalation and score come from its headers; an answer from a tier the cascade does not
    have is refused."""
    items = arithmetic_problems(2, seed=1, steps=2, max_value=20)
    seen = []
    both_in_flight = threading.Barrier(2, timeout=10)  # concurrency=2: sent together

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((body["model"], request.headers.get("x-sluice-cascade")))
        both_in_flight.wait()
        item = next(i for i in items if i.prompt == body["messages"][0]["content"])
        escalate = item is items[1]
        response = sse("big" if escalate else "small", [f"Answer: {item.answer}"],
                       [[{"token": "x", "logprob": -0.2, "top_logprobs": []}]],
                       {"prompt_tokens": 9, "completion_tokens": 7})
        response.headers["x-sluice-escalated"] = "true" if escalate else "false"
        response.headers["x-sluice-score"] = "-1.5000" if escalate else "-0.2000"
        return response

    client = httpx.Client(transport=httpx.MockTransport(answer))
    answers, failed = live.ask_all(items, "http://router", "coder", TIERS, concurrency=2,
                                   client=client)
    assert seen == [("coder", None)] * 2 and failed == []
    assert [(a.id, a.tier, a.escalated, a.score, a.correct, a.completion_tokens)
            for a in answers] == [(items[0].id, "small", False, -0.2, True, 7),
                                  (items[1].id, "big", True, -1.5, True, 7)]
    both_in_flight = threading.Barrier(1)
    with pytest.raises(RecordError, match="'small'.*not a tier of coder"):
        live.ask_all(items[:1], "http://router", "coder", ["tiny", "big"], client=client)

    def openai_server(request: httpx.Request) -> httpx.Response:  # not a Sluice router
        response = sse("x", ["Answer: 1"], [[]], {"completion_tokens": 1})
        del response.headers["x-sluice-tier"]
        return response

    plain = httpx.Client(transport=httpx.MockTransport(openai_server))
    with pytest.raises(RecordError, match="no x-sluice-tier header: is http://router a Sluice"):
        live.ask_all(items[:1], "http://router", "coder", TIERS, client=plain)


def test_items_by_id_regenerates_arithmetic_and_refuses_unknown_ids():
    problems = arithmetic_problems(6, seed=0, steps=4, max_value=100)
    assert items_by_id(["arith-0-4x100-5", "arith-0-4x100-1"]) == [problems[5], problems[1]]
    with pytest.raises(ValueError, match="'nope-1'"):
        items_by_id(["nope-1"])
    # bounded before generating: an index of 10^8 took minutes and gigabytes
    with pytest.raises(ValueError, match="index 100000000 is past 100,000"):
        items_by_id(["arith-0-4x100-100000000"])
    with pytest.raises(ValueError, match="steps 99999999 is past 64"):
        items_by_id(["arith-0-99999999x100-0"])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        items_by_id(["arith-0-0x0-0"])


def test_a_prompt_that_is_not_the_recorded_one_is_refused():
    """The live side must ask what the replay's answers answered."""
    item = arithmetic_problems(1, seed=0, steps=2, max_value=20)[0]
    same = [rec(item.id, t, True, -0.1, prompt=user_message(item)) for t in TIERS]
    live.check_prompts([item], Replay.build(same, TIERS))
    other = [replace(r, prompt="Kenji has 88 shells.") for r in same]
    with pytest.raises(ValueError, match=f"{item.id}: the recorded prompt is not"):
        live.check_prompts([item], Replay.build(other, TIERS))


def test_each_item_is_asked_with_its_recorded_limit():
    a, b = arithmetic_problems(2, seed=0, steps=2, max_value=20)
    records = [replace(rec(a.id, t, True, -0.1), max_tokens=32) for t in TIERS]
    records += [rec(b.id, t, True, -0.1) for t in TIERS]  # recorded before the limit was kept
    assert live.recorded_limits([a, b], records, TIERS) == {a.id: 32, b.id: 384}
    assert live.recorded_limits([a, b], records, TIERS, override=16) == {a.id: 16, b.id: 16}


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    path = tmp_path / "r.jsonl"
    for line, why in [("[1, 2]", "not a record (a JSON object)"),
                      ("{}", "not a record (no 'scores')"),
                      ('{"scores": 3}', "not a record (TypeError")]:
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=re.escape(f"{path}:1: {why}")):
            load_records(path)
    path.write_bytes(b"\x86\xff\n")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        load_records(path)


def test_the_router_url_may_be_the_v1_base_that_sluice_up_prints():
    assert server_url("http://127.0.0.1:8000/v1") == server_url("http://127.0.0.1:8000/") == \
        "http://127.0.0.1:8000"


def test_check_cli_refuses_a_cascade_the_manifest_does_not_serve(tmp_path):
    records = write(tmp_path / "r.jsonl", [rec("arith-0-2x20-0", t, True, -0.1) for t in TIERS])
    cli = [sys.executable, "-m", "sluice.cli", "cascade", "check", "--url", "http://127.0.0.1:9",
           "--manifest", str(ROOT / "examples" / "cascade.yaml"), "--records", str(records)]
    wrong = subprocess.run([*cli, "--cascade", "nope"], capture_output=True, text=True,
                           timeout=60)
    assert wrong.returncode == 2
    assert "serves no cascade named 'nope' (it serves: coder)" in wrong.stderr
    # the records hold no item answered by the cascade's tiers (smollm2, qwen-coder)
    empty = subprocess.run([*cli, "--cascade", "coder"], capture_output=True, text=True,
                           timeout=60)
    assert empty.returncode == 2 and "no item in" in empty.stderr
    missing = subprocess.run([*cli[:-2], "--records", str(tmp_path / "absent.jsonl"),
                              "--cascade", "coder"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "absent.jsonl: no such file" in missing.stderr
    # --out is checked before any request: not the records, not a folder that is missing
    clobber = subprocess.run([*cli, "--cascade", "coder", "--out", str(records)],
                             capture_output=True, text=True, timeout=60)
    assert clobber.returncode == 2 and "would overwrite the records" in clobber.stderr
    nowhere = subprocess.run([*cli, "--cascade", "coder", "--out", str(tmp_path / "no" / "x")],
                             capture_output=True, text=True, timeout=60)
    assert nowhere.returncode == 2 and "its directory does not exist" in nowhere.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["check", "--timeout", "1e300"], "argument --timeout: must be finite and > 0 and <= 86400 seconds, got 1e300"),
    (["calibrate", "--tiers", "a,b", "--out", "/nonexistent/x.json"],
     "argument --out: /nonexistent/x.json: its directory does not exist"),
    (["calibrate", "--tiers", "a,b", "--out", ""], "argument --out: an empty path"),
    # spec.cascade.streaming.prefixTokens takes 1..4096: the snippet must validate
    (["calibrate", "--tiers", "a,b", "--prefix-tokens", "1000000"],
     "argument --prefix-tokens: must be >= 1 and <= 4,096, got 1000000"),
    # 0 still fitted a pre-route that sent ~2 % of held-out prompts up: leave it out instead
    (["calibrate", "--tiers", "a,b", "--pre-route-share", "0"],
     "argument --pre-route-share: must be finite and > 0 and <= 1, got 0")])
def test_cascade_cli_refuses_bad_flags_when_parsing(tmp_path, args, message):
    records = write(tmp_path / "r.jsonl", [rec("arith-0-2x20-0", t, True, -0.1) for t in TIERS])
    common = {"check": ["--manifest", str(ROOT / "examples" / "cascade.yaml"), "--cascade",
                        "coder", "--records", str(records)],
              "calibrate": ["--records", str(records)]}[args[0]]
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "cascade", *args, *common],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_check_cli_says_when_every_request_failed(tmp_path):
    """Nothing listens at the URL: each item is tried 3 times, then one line says so."""
    item = arithmetic_problems(1, seed=0, steps=2, max_value=20)[0]
    records = write(tmp_path / "r.jsonl", [rec(item.id, t, True, -0.1)
                                           for t in ("smollm2", "qwen-coder")])
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "cascade", "check", "--url",
                          "http://127.0.0.1:9", "--manifest", str(ROOT / "examples" / "cascade.yaml"),
                          "--cascade", "coder", "--records", str(records)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().endswith("sluice cascade check: all 1 requests failed: is the "
                                       "router at http://127.0.0.1:9 up and serving the cascade? "
                                       "(the warnings above say why)")


def test_the_live_checks_manifest_serves_its_cascades():
    """bench/cascade_live.yaml (the issue's live runs) validates, and its cascades resolve
    to the two Qwen tiers, each at the signal and threshold its committed check ran with."""
    from sluice.cascade.tiers import manifest_cascades

    served = manifest_cascades(ROOT / "bench" / "cascade_live.yaml")
    assert list(served) == ["coder-15", "coder-15-checks", "coder-15-prefix"]
    for name, resolved in served.items():
        assert resolved.models == ("Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct")
    for name, results in (("coder-15", "cascade_live.json"),
                          ("coder-15-checks", "cascade_live_checks.json")):
        ran = json.loads((ROOT / "bench" / "results" / results).read_text())
        escalation = served[name].spec.escalation
        assert (escalation.signal, escalation.threshold) == (ran["signal"], ran["threshold"])
    assert served["coder-15-prefix"].spec.streaming.mode == "prefix"
