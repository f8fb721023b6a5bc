"""`sluice profile`: the verdict and the capacity from fixed records (pure), bad input in
one line with exit 2, and real runs against a real worker (tiny steps)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, free_port
from sluice import cli
from sluice.bench import profile
from sluice.bench.client import RequestRecord
from sluice.models import store

SLO = profile.Objectives(ttft_ms=500, itl_ms=100, percentile=50)


def _ok(i: int, ttft_s: float, gaps: list[float]) -> RequestRecord:
    return RequestRecord(i, max_tokens=len(gaps) + 1, input_tokens=8, start_s=i, ok=True,
                         end_s=i + ttft_s + sum(gaps), ttft_s=ttft_s, itl_s=gaps,
                         output_tokens=len(gaps) + 1)


def test_a_step_is_judged_at_the_percentile_on_mean_itl():
    records = [_ok(0, 0.1, [0.05, 0.05]), _ok(1, 0.2, [0.3, 0.01]), _ok(2, 0.9, [0.2])]
    step = profile.judge(2.0, records, SLO)
    assert step.ttft_ms == pytest.approx(200) and step.itl_ms == pytest.approx(155)
    assert not step.met  # p50 mean ITL 155 ms > 100 ms
    assert step.attainment == pytest.approx(1 / 3)  # only the first meets both
    assert profile.judge(2.0, records[:1], SLO).met


def test_a_failed_request_misses_and_one_token_meets_itl():
    failed = RequestRecord(1, max_tokens=4, input_tokens=8, error_code="500")
    assert not profile.judge(1.0, [_ok(0, 0.1, []), failed], SLO).met
    one_token = profile.judge(1.0, [_ok(0, 0.1, [])], SLO)
    assert one_token.met and one_token.itl_ms is None and one_token.attainment == 1.0


def step(rate, met):
    return profile.Step(rate, 1, 0, 1.0, 1.0, 1.0, 1.0 if met else 0.0, met)


def test_capacity_is_the_highest_rate_met_below_the_lowest_miss():
    assert profile.capacity([step(0.5, True), step(1, True), step(2, False)]) == 1
    assert profile.capacity([step(0.5, False)]) == 0
    assert profile.capacity([step(0.5, True), step(1, False), step(2, True)]) == 0.5
    assert profile.capacity([]) == 0
    assert profile.capacity([step(0.25, True), step(0.5, False), step(0.38, True),
                             step(0.44, False)]) == 0.38  # after bisection


def test_refinement_bisects_between_the_capacity_and_the_lowest_miss():
    """The midpoint to two significant digits; no bracket (nothing met or nothing missed),
    or a midpoint that rounds onto an end, stops it."""
    coarse = [step(0.25, True), step(0.5, False)]
    assert profile.refine_rate(coarse) == 0.38
    assert profile.refine_rate([*coarse, step(0.38, True)]) == 0.44
    assert profile.refine_rate([*coarse, step(0.38, False)]) == 0.32
    assert profile.refine_rate([step(0.5, False)]) is None
    assert profile.refine_rate([step(1, True), step(2, True)]) is None
    assert profile.refine_rate([step(1, True), step(1.1, False)]) is None  # 1.05 -> 1.1


def test_rates_are_sorted_positive_numbers():
    assert profile.parse_rates("2, 0.5,1,1") == [0.5, 1.0, 2.0]
    for bad in ("", "0,1", "-1", "a,b", "inf"):
        with pytest.raises(ValueError, match="--rates"):
            profile.parse_rates(bad)


@pytest.mark.parametrize("extra, message", [
    (["--rates", "0,1"], "--rates must be positive"),
    (["--slo-ttft-ms", "0"], "argument --slo-ttft-ms: must be finite and > 0 milliseconds, got 0"),
    (["--percentile", "120"], "argument --percentile: must be finite and > 0 and <= 100, got 120"),
    (["--refine", "-1"], "argument --refine: must be >= 0, got -1"),
    ([], "no server at"),  # nothing listens on the port
])
def test_bad_input_is_one_line_and_exit_2(extra, message):
    argv = ["profile", "--url", f"http://127.0.0.1:{free_port()}", "--model", "m",
            "--slo-ttft-ms", "1000", "--slo-itl-ms", "200", *extra]
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert proc.stderr.startswith("sluice profile: ") and message in proc.stderr


def test_a_model_the_server_does_not_serve_is_bad_input(worker_url, capsys):
    assert cli.main(["profile", "--url", worker_url, "--model", "no-such-model",
                     "--slo-ttft-ms", "1000", "--slo-itl-ms", "200"]) == 2
    assert "does not serve 'no-such-model'" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, "No such file"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "empty trace"),
    ("ts,in,out\n1,2,3\n", "an Azure 2023 CSV needs the columns"),
])
def test_a_bad_lengths_trace_is_bad_input(worker_url, tmp_path, capsys, content, message):
    trace = tmp_path / "lengths.csv"
    if content is not None:
        trace.write_text(content)
    assert cli.main(["profile", "--url", worker_url, "--model", store.DEFAULT_MODEL,
                     "--slo-ttft-ms", "1000", "--slo-itl-ms", "200",
                     "--lengths-from", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice profile: ") and message in err


def test_lengths_from_a_trace_are_its_rows_drawn_with_a_seed():
    """A long-tailed mix, not its mean: every request carries one row's (input, output)
    lengths, and the same seed draws the same rows."""
    from argparse import Namespace

    from sluice.bench import workload

    rows = [workload.TraceRow(0.0, 8, 2), workload.TraceRow(1.0, 200, 30)]
    builder = workload.PromptBuilder(workload.Tokenizer(
        workload.resolve_tokenizer(None, store.DEFAULT_MODEL)))
    args = Namespace(duration=20.0, min_requests=10, input_len=128, output_len=64)
    specs = profile.step_specs(builder, 2.0, args, seed=3, rows=rows)
    assert len(specs) >= 10
    pairs = [(s.input_tokens, s.max_tokens) for s in specs]
    assert set(pairs) == {(8, 2), (200, 30)}
    assert all(builder.tok.count(s.prompt) == s.input_tokens for s in specs)
    again = profile.step_specs(builder, 2.0, args, seed=3, rows=rows)
    assert [(s.input_tokens, s.max_tokens, s.arrival_s) for s in again] == \
        [(s.input_tokens, s.max_tokens, s.arrival_s) for s in specs]


def test_trace_arrivals_replay_its_gaps_at_the_steps_rate_with_each_rows_lengths():
    """--arrivals trace: rate x duration consecutive rows from a seeded one (wrapping from
    the trace's end to its start, one mean gap), in their own gaps' proportions, scaled so
    that the step delivers its rate: the n gaps, the one after the last row included, last
    n / rate seconds."""
    from argparse import Namespace

    from sluice.bench import workload

    rows = [workload.TraceRow(0.0, 8, 2), workload.TraceRow(1.0, 16, 3),
            workload.TraceRow(3.0, 24, 4)]  # gaps 1, 2, then 1.5 back to the start
    gaps = [1.0, 2.0, 1.5]
    for seed in range(4):
        picks = profile.replay(rows, 4 / 3, 6.0, 5, seed)  # 8 requests in 6 s
        start = rows.index(picks[0][1])
        own = [gaps[(start + k) % 3] for k in range(len(picks))]
        scale = 6.0 / sum(own)
        assert len(picks) == 8 and picks[0][0] == 0.0
        assert [b[0] - a[0] for a, b in zip(picks, picks[1:])] == pytest.approx(
            [g * scale for g in own[:-1]])
        assert [r.input_tokens for _, r in picks] == [8 * (1 + (start + k) % 3)
                                                      for k in range(len(picks))]
    assert len(profile.replay(rows, 4 / 3, 1.0, 5, 0)) == 5  # at least --min-requests
    instant = [workload.TraceRow(0.0, 8, 2), workload.TraceRow(0.0, 8, 2),
               workload.TraceRow(0.0, 8, 2), workload.TraceRow(2.0, 8, 2)]
    picks = profile.replay(instant, 1.0, 2.0, 1, 2)  # seed 2 starts at row 0: 2 rows take
    assert [at for at, _ in picks] == [0.0, 0.0, 0.0]  # no time; 3 rows at 1 req/s: 3 s
    builder = workload.PromptBuilder(workload.Tokenizer(
        workload.resolve_tokenizer(None, store.DEFAULT_MODEL)))
    args = Namespace(duration=10.0, min_requests=5, input_len=128, output_len=64,
                     arrivals="trace")
    specs = profile.step_specs(builder, 4 / 3, args, seed=1, rows=rows)
    assert [(s.arrival_s, s.input_tokens, s.max_tokens) for s in specs] == \
        [(at, r.input_tokens, r.output_tokens) for at, r in profile.replay(rows, 4 / 3, 10.0, 5, 1)]
    with pytest.raises(ValueError, match="two or more distinct arrival times"):
        profile.replay(rows[:1], 1.0, 10.0, 5, 0)


def test_trace_arrivals_deliver_the_steps_rate_from_any_stretch_of_an_on_off_trace():
    """A 20 s step at 1.6 req/s is 32 requests over 20 s wherever its stretch starts; scaled
    by the whole trace's rate, a stretch of an idle spell brought a handful and passed."""
    from sluice.bench import workload

    rows = workload.read_trace("/work/shared/traces/azure2023_code.csv")
    rows = [r for r in rows if 2100 <= r.arrival_s < 2700][::25]  # on and off, like the cut
    for seed in range(20):
        picks = profile.replay(rows, 1.6, 20.0, 10, seed)
        assert len(picks) == 32 and picks[-1][0] < 20.0


@pytest.mark.parametrize("extra, message", [
    ([], "--arrivals trace replays the --lengths-from trace"),
    (["--lengths-from", "ONE_ROW"], "two or more distinct arrival times"),
])
def test_trace_arrivals_need_a_trace_with_a_rate(tmp_path, capsys, extra, message):
    one = tmp_path / "one.csv"
    one.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:01,10,5\n")
    extra = [str(one) if a == "ONE_ROW" else a for a in extra]
    assert cli.main(["profile", "--url", "http://127.0.0.1:9", "--model", "m",
                     "--slo-ttft-ms", "1000", "--slo-itl-ms", "200", "--arrivals", "trace",
                     *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice profile: ") and message in err


# --------------------------------------------------------------------------- real worker

RATES = [1.0, 2.0]


def _profile(url: str, out, ttft_ms: str, itl_ms: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "profile", "--url", url, "--model",
         store.DEFAULT_MODEL, "--slo-ttft-ms", ttft_ms, "--slo-itl-ms", itl_ms,
         "--input-len", "16", "--output-len", "4", "--rates", ",".join(map(str, RATES)),
         "--duration", "1", "--min-requests", "2", "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_profile_a_real_worker(worker_url, tmp_path):
    data, stdout = _profile(worker_url, tmp_path / "p.json", "60000", "60000")
    assert set(data) >= {"model", "input_len", "output_len", "slo", "percentile",
                         "capacity_rps", "steps"}
    assert (data["model"], data["input_len"], data["output_len"]) == (store.DEFAULT_MODEL, 16, 4)
    assert data["slo"] == {"ttft_ms": 60000, "itl_ms": 60000} and data["percentile"] == 95
    assert data["capacity_rps"] in [0, *(s["rate_rps"] for s in data["steps"])]
    steps = data["steps"]
    upward = [s for s in steps if s["rate_rps"] in RATES]
    assert [s["rate_rps"] for s in upward] == RATES[:len(upward)]
    assert all(s["met"] for s in upward[:-1])  # stepping stops at the first miss,
    refined = steps[len(upward):]  # then bisects (--refine 2) between it and the capacity
    assert len(refined) <= 2 and all(1.0 < s["rate_rps"] < 2.0 for s in refined)
    assert not refined or not upward[-1]["met"]
    for s in steps:
        assert s["requests"] >= 2 and s["failed"] == 0 and 0 < s["ttft_ms"]
    assert "TTFT p95 (ms)" in stdout and "attainment" in stdout
    if data["capacity_rps"]:
        assert f"capacityRPS: {data['capacity_rps']:g}" in stdout.strip().splitlines()[-1]


def test_an_slo_no_rate_meets_gives_capacity_0_and_says_so(worker_url, tmp_path):
    data, stdout = _profile(worker_url, tmp_path / "p.json", "1", "1")
    assert data["capacity_rps"] == 0
    assert len(data["steps"]) == 1 and not data["steps"][0]["met"]
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("capacity: 0 req/s: even the lowest rate (1 req/s) misses")
    assert "capacityRPS" not in last
