"""`sluice bench`: exact statistics from fixed records, deterministic arrival schedules,
exact-length and shared-prefix prompts, SSE parsing, and real runs against a real worker."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, free_port
from sluice import cli
from sluice.bench import client as bench_client
from sluice.bench import report, schedule, workload
from sluice.bench.client import RequestRecord
from sluice.models import store

TRACES = Path("/work/shared/traces")


@pytest.fixture(scope="module")
def tok(model_path) -> workload.Tokenizer:
    return workload.Tokenizer(model_path / "tokenizer.json")


# --------------------------------------------------------------------------- statistics


def _records() -> list[RequestRecord]:
    """Three successes and one 404 over 2.5 s; ITL in seconds."""
    def ok(i, start, ttft, e2e, itl, out):
        return RequestRecord(i, max_tokens=out, input_tokens=10, start_s=start,
                             end_s=start + e2e, ok=True, status=200, ttft_s=ttft, e2e_s=e2e,
                             output_tokens=out, usage_output_tokens=out, itl_s=itl)
    failed = RequestRecord(3, max_tokens=4, input_tokens=10, start_s=1.5, end_s=1.6,
                           status=404, error_code="404", error="model_not_found: no", e2e_s=0.1)
    return [ok(0, 0.0, 0.1, 1.0, [0.1, 0.1, 0.2], 4),
            ok(1, 0.5, 0.3, 2.0, [0.2, 0.4, 0.6], 4),
            ok(2, 1.0, 0.5, 1.0, [0.05], 2),
            failed]


def test_percentile_interpolates_linearly():
    assert report.percentile([4, 1, 3, 2], 50) == 2.5
    assert report.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert report.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert report.percentile([7], 99) == 7
    assert math.isnan(report.percentile([], 50))


def test_summary_is_exact_for_fixed_records():
    s = report.summarize(_records(), slo_ttft_ms=400, slo_itl_ms=300, slo_itl_percentile=90,
                         cost_per_hour=3.6, replicas=2)
    assert (s["requests"], s["succeeded"], s["failed"]) == (4, 3, 1)
    assert s["duration_s"] == pytest.approx(2.5)
    assert s["rps"] == pytest.approx(1.2)
    assert s["output_tok_s"] == pytest.approx(4.0)
    assert s["ttft_ms"] == pytest.approx({"count": 3, "mean": 300, "min": 100, "p50": 300,
                                          "p90": 460, "p99": 496, "max": 500})
    # pooled gaps (ms): 50 100 100 200 200 400 600
    assert s["itl_ms"] == pytest.approx({"count": 7, "mean": 1650 / 7, "min": 50, "p50": 200,
                                         "p90": 480, "p99": 588, "max": 600})
    assert s["tpot_ms"]["p50"] == pytest.approx(400 / 3)  # per-request means 133.3, 400, 50
    assert s["e2e_ms"]["p50"] == pytest.approx(1000)
    # r0: ttft 100, own p90 gap 180 -> good; r1: own p90 gap 560 > 300; r2: ttft 500 > 400
    assert s["goodput"]["requests"] == 1
    assert s["goodput"]["rps"] == pytest.approx(0.4)
    assert s["goodput"]["fraction"] == pytest.approx(0.25)
    assert s["errors"] == {"404": 1}
    # 3.6/h x 2 replicas x 2.5 s = 0.005; 3 requests, 10 output tokens
    assert s["cost"] == pytest.approx({"total": 0.005, "per_request": 0.005 / 3,
                                       "per_1m_output_tokens": 500})


def test_goodput_objectives_are_optional_and_single_token_requests_pass_itl():
    records = _records()
    assert report.summarize(records)["goodput"] is None
    only_ttft = report.summarize(records, slo_ttft_ms=300)["goodput"]
    assert only_ttft["requests"] == 2
    one_token = RequestRecord(9, 1, 1, ok=True, ttft_s=0.01, e2e_s=0.01, itl_s=[])
    assert report.meets_slo(one_token, None, 1.0, 90)
    assert not report.meets_slo(records[3], None, None, 90)  # failed


def test_itl_attribution_spreads_multi_token_chunks():
    # chunks at 0.1 (first: TTFT), 0.2 (1 token), 0.5 (3 tokens), 0.6 (0 tokens), 0.8 (1)
    gaps = bench_client.itl_gaps([0.1, 0.2, 0.5, 0.6, 0.8], [1, 1, 3, 0, 1])
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.3])
    assert sum(gaps) == pytest.approx(0.8 - 0.1)


def test_chunk_tokens_one_per_chunk_when_usage_agrees(tok):
    texts = [" sim", "m", "ered", " slowly"]
    assert bench_client.chunk_tokens(texts, tok, usage_tokens=4) == [1, 1, 1, 1]
    counted = bench_client.chunk_tokens(texts, tok, usage_tokens=None)
    assert sum(counted) == tok.count("".join(texts))


# --------------------------------------------------------------------------- arrivals


def test_poisson_schedule_is_deterministic_with_the_right_mean_rate():
    a = schedule.arrival_times(20001, rate=5.0, seed=7)
    assert a == schedule.arrival_times(20001, rate=5.0, seed=7)
    assert a[:10] != schedule.arrival_times(10, rate=5.0, seed=8)
    assert a[0] == 0.0 and all(y > x for x, y in zip(a, a[1:]))
    # 20000 exponential gaps: the relative standard error of the mean gap is 1/sqrt(20000)
    # = 0.71 %, so 3 % is over 4 sigma: a wrong rate fails, sampling noise never does.
    assert 20000 / a[-1] == pytest.approx(5.0, rel=0.03)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)


def test_bursty_schedule_keeps_the_rate_with_larger_gap_variation():
    a = schedule.arrival_times(20001, rate=5.0, burstiness=0.25, seed=1)
    # gamma shape 0.25: gap CV 2, standard error of the mean gap 2/sqrt(20000) = 1.4 %;
    # 6 % is over 4 sigma.
    assert 20000 / a[-1] == pytest.approx(5.0, rel=0.06)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(2.0, rel=0.1)
    with pytest.raises(ValueError):
        schedule.arrival_times(3, rate=0.0)


# --------------------------------------------------------------------------- workloads


def test_length_distributions():
    import random

    rng = random.Random(0)
    assert workload.LengthDist.parse("128").sample(rng) == 128
    assert workload.LengthDist.parse("fixed:7").sample(rng) == 7
    u = workload.LengthDist.parse("uniform:10:20")
    assert {u.sample(rng) for _ in range(500)} == set(range(10, 21))
    n = workload.LengthDist.parse("normal:100:10")
    values = [n.sample(rng) for _ in range(2000)]
    assert statistics.fmean(values) == pytest.approx(100, abs=1.5)
    for bad in ("0", "uniform:5:2", "normal:10", "gauss:1:2", "x"):
        with pytest.raises(ValueError):
            workload.LengthDist.parse(bad)


def test_synthetic_prompts_have_exact_token_counts(tok):
    builder = workload.PromptBuilder(tok)
    specs = list(zip(range(30), workload.synthetic(
        builder, workload.LengthDist.parse("uniform:1:600"), workload.LengthDist("fixed", 9),
        seed=3)))
    for _, spec in specs:
        assert tok.count(spec.prompt) == spec.input_tokens
        assert spec.max_tokens == 9
    again = [s for _, s in zip(range(30), workload.synthetic(
        builder, workload.LengthDist.parse("uniform:1:600"), workload.LengthDist("fixed", 9),
        seed=3))]
    assert [s for _, s in specs] == again
    # distinct prompts start differently: no accidental shared first KV block (16 tokens)
    heads = {tuple(tok.encode(s.prompt)[:16]) for _, s in specs if s.input_tokens >= 16}
    assert len(heads) == sum(1 for _, s in specs if s.input_tokens >= 16)


def test_shared_prefix_groups_share_exactly_p_tokens(tok):
    groups, p = 3, 100
    gen = workload.synthetic(workload.PromptBuilder(tok), workload.LengthDist.parse("uniform:20:60"),
                             workload.LengthDist("fixed", 8), seed=0, prefix_groups=groups,
                             prefix_tokens=p)
    specs = [next(gen) for _ in range(12)]
    ids = [tok.encode(s.prompt) for s in specs]
    for spec, i in zip(specs, ids):
        assert len(i) == spec.input_tokens and spec.input_tokens > p
    for g in range(groups):
        members = [i for s, i in zip(specs, ids) if s.group == g]
        assert len(members) == 4
        assert all(m[:p] == members[0][:p] for m in members)
        # the suffixes are the request's own: they differ right after the prefix
        assert len({tuple(m[p:p + 8]) for m in members}) == len(members)
    heads = {tuple(i[:p]) for i in ids}
    assert len(heads) == groups


def test_jsonl_dataset(tmp_path, tok):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "max_tokens": 5}\n\n{"prompt": "Hi"}\n')
    specs = workload.from_jsonl(path, tok, default_max_tokens=7)
    assert [(s.prompt, s.max_tokens, s.input_tokens) for s in specs] == [
        ("Hello there", 5, tok.count("Hello there")), ("Hi", 7, tok.count("Hi"))]
    path.write_text('{"max_tokens": 5}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        workload.from_jsonl(path, tok, 7)


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"{TRACES} is not on this machine")
def test_traces_replay_lengths_arrivals_and_mooncake_prefixes(tok):
    rows = workload.read_trace(TRACES / "azure2023_code.csv")
    assert len(rows) == 8819 and rows[0].arrival_s == 0.0
    assert rows[-1].arrival_s == pytest.approx(3435.9, abs=0.1)  # the README's span
    builder = workload.PromptBuilder(tok)
    specs = [s for _, s in zip(range(3), workload.from_trace(rows, builder, time_scale=0.5,
                                                             max_input_tokens=300))]
    for row, spec in zip(rows, specs):
        assert spec.arrival_s == pytest.approx(row.arrival_s * 0.5)
        assert spec.input_tokens == min(row.input_tokens, 300) == tok.count(spec.prompt)
        assert spec.max_tokens == row.output_tokens
    rows = [workload.TraceRow(0.0, 1000, 5, (1, 2)), workload.TraceRow(1.0, 700, 5, (1, 3))]
    a, b = workload.from_trace(rows, builder)
    ia, ib = tok.encode(a.prompt), tok.encode(b.prompt)
    assert ia[:512] == ib[:512] and ia[512:520] != ib[512:520]
    moon = workload.read_trace(TRACES / "mooncake_synthetic_trace.jsonl")
    assert len(moon) == 3993 and moon[0].hash_ids


@pytest.mark.parametrize("name, content, message", [
    ("t.csv", "time,in,out\n1,2,3\n",
     "t.csv: an Azure 2023 CSV needs the columns TIMESTAMP, ContextTokens, GeneratedTokens; "
     "TIMESTAMP, ContextTokens, GeneratedTokens missing"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
     "2023-11-16 18:17:03.9799600,12,3\n2023-11-16 18:17:04.1,many,3\n",
     "t.csv:3: a malformed request (invalid literal for int() with base 10: 'many')"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n",
     "t.csv:2: a malformed request"),
    ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{"timestamp": 9}\n',
     "t.jsonl:3: a malformed request (no 'input_length')"),
    ("t.jsonl", "{not json\n", "t.jsonl:1: a malformed request (Expecting property name"),
    ("t.jsonl", "\n", "t.jsonl: empty trace"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,12\n",
     "t.csv:2: a malformed request (3 columns wanted, fewer given)"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,-5,44\n",
     "t.csv:2: a malformed request (a negative token count (-5 in, 44 out))"),
    ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": -1}\n',
     "t.jsonl:1: a malformed request (a negative token count (5 in, -1 out))"),
    ("t.csv", b"\xff\xfe\x00binary", "t.csv: not a text trace (invalid start byte at byte 0)"),
])
def test_a_bad_trace_names_its_line_and_what_is_wrong(tmp_path, name, content, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        workload.read_trace(path)
    assert str(err.value).startswith(str(tmp_path))
    assert message in str(err.value)


def test_a_trace_is_sorted_by_arrival_and_limited_in_file_order(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"timestamp": {t}, "input_length": {n}, "output_length": 0}}\n'
                            for t, n in ((2000, 1), (1000, 2), (5000, 3))))
    rows = workload.read_trace(path)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in rows] == [
        (0.0, 2, 1), (1.0, 1, 1), (4.0, 3, 1)]  # lengths at least 1
    assert [r.input_tokens for r in workload.read_trace(path, limit=2)] == [2, 1]


# --------------------------------------------------------------------------- SSE parsing


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode())
                    + b"\n\n" for e in events)


def _send(response: httpx.Response, body: dict | None = None) -> RequestRecord:
    async def go():
        transport = httpx.MockTransport(lambda request: response)
        async with httpx.AsyncClient(transport=transport) as c:
            record = RequestRecord(0, 3, 1)
            return await bench_client.send(c, "http://bench.test/v1/x", body or {"prompt": "x"},
                                           record, t0=0.0, deadline_s=10)
    return asyncio.run(go())


def test_chat_stream_skips_role_and_usage_chunks():
    def delta(d):
        return {"choices": [{"index": 0, "delta": d}]}
    body = _sse(delta({"role": "assistant", "content": ""}), delta({"content": "a"}),
                delta({"content": "b"}), delta({"content": "c"}),
                {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}, b"[DONE]")
    r = _send(httpx.Response(200, content=body), {"messages": []})
    assert r.ok and r.status == 200 and r.error_code is None
    assert r._texts == ["a", "b", "c"] and len(r.chunk_offsets_s) == 3
    assert (r.usage_input_tokens, r.usage_output_tokens) == (9, 3)


def test_a_stream_splits_at_line_feeds_only():
    """U+2028, U+0085 and a lone CR inside a JSON string are text, not line ends (httpx's
    aiter_lines splits there and the event failed as bad_stream); CRLF ends a line."""
    text = "one\u2028two\u0085three\rfour"
    body = ("data: " + json.dumps({"choices": [{"text": text}]}, ensure_ascii=False)
            + "\r\n\r\ndata: [DONE]\r\n\r\n").encode()
    r = _send(httpx.Response(200, content=body))
    assert r.ok and r._texts == [text]


@pytest.mark.parametrize("response, code", [
    (httpx.Response(404, json={"error": {"message": "no such model", "code": "model_not_found",
                                         "type": "invalid_request_error"}}), "404"),
    (httpx.Response(200, content=_sse({"choices": [{"text": "a"}]}, {"error": {
        "message": "the worker stream broke", "type": "server_error"}}, b"[DONE]")),
     "stream_error"),
    (httpx.Response(200, content=_sse({"choices": [{"text": "a"}]})), "incomplete_stream"),
    (httpx.Response(200, content=b"data: {not json\n\n"), "bad_stream"),
])
def test_errors_are_recorded_not_raised(response, code):
    r = _send(response)
    assert not r.ok and r.error_code == code and r.error
    if code == "404":
        assert r.status == 404 and "model_not_found" in r.error


def test_unreachable_server_is_recorded_per_request(tmp_path, model_path):
    out = tmp_path / "down.json"
    rc = cli.main(["bench", "--url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                   "--tokenizer", str(model_path), "--num-requests", "3", "--warmup", "0",
                   "--input-len", "8", "--output-len", "2", "--quiet", "--output", str(out)])
    assert rc == 1
    data = json.loads(out.read_text())
    assert data["summary"]["errors"] == {"ConnectError": 3}
    assert [r["error_code"] for r in data["records"]] == ["ConnectError"] * 3


@pytest.mark.parametrize("args, message", [
    (["--time-scale", "0.5"], "--time-scale applies to --trace replays only"),
    (["--max-input-tokens", "64"], "--max-input-tokens applies to --trace replays only"),
    (["--max-output-tokens", "8"], "--max-output-tokens applies to --trace replays only"),
    (["--burstiness", "0.5"], "--burstiness shapes open-loop arrivals: it needs --rate"),
    (["--arrival", "bursty"], "--arrival shapes open-loop arrivals: it needs --rate"),
    (["--arrival", "poisson"], "--arrival shapes open-loop arrivals: it needs --rate"),
])
def test_flags_that_would_be_ignored_exit_2(model_path, capsys, args, message):
    """Found by a fresh user: these were silently ignored without --trace or --rate."""
    assert cli.main(["bench", "--url", "http://127.0.0.1:1", "--model", store.DEFAULT_MODEL,
                     "--tokenizer", str(model_path), *args]) == 2
    assert capsys.readouterr().err == f"sluice bench: {message}\n"


def test_bad_arguments_exit_2(model_path, tmp_path, capsys):
    assert cli.main(["bench", "--url", "http://127.0.0.1:1", "--model", "not-in-store"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope")  # was a traceback from the tokenizers library
    assert cli.main(["bench", "--url", "http://127.0.0.1:1", "--model", "m", "--tokenizer",
                     str(bad)]) == 2
    assert f"sluice bench: {bad}: not a readable tokenizer.json (" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--num-requests", "0"], "argument --num-requests: must be >= 1, got 0"),
    (["--num-requests", "-3"], "argument --num-requests: must be >= 1, got -3"),
    (["--duration", "-1"], "argument --duration: must be finite and > 0 seconds, got -1"),
    (["--time-scale", "-1"], "argument --time-scale: must be finite and > 0, got -1"),
    (["--time-scale", "nan"], "argument --time-scale: must be finite and > 0, got nan"),
    (["--rate", "nan"], "argument --rate: must be finite and > 0, got nan"),  # was a traceback
    (["--rate", "0"], "argument --rate: must be finite and > 0, got 0"),
    (["--concurrency", "0"], "argument --concurrency: must be >= 1 and <= 100,000, got 0"),
    (["--concurrency", "100000000"],  # each a task and a connection: memory grew
     "argument --concurrency: must be >= 1 and <= 100,000, got 100000000"),
    (["--extra-body", '{"a": NaN}'], "argument --extra-body: not JSON (NaN is not a JSON "
     "value): '{\"a\": NaN}'"),
    (["--extra-body", '{"a": 1e999}'], "argument --extra-body: not JSON (1e999 is out of "
     "range for a number): '{\"a\": 1e999}'"),
    (["--warmup", "-2"], "argument --warmup: must be >= 0, got -2"),
    (["--prefix-groups", "-1"], "argument --prefix-groups: must be >= 0, got -1"),  # was taken
    (["--temperature", "-1"], "argument --temperature: must be finite and >= 0, got -1"),
    (["--request-timeout", "0"],
     "argument --request-timeout: must be finite and > 0 seconds, got 0"),
    (["--slo-ttft-ms", "-5"], "argument --slo-ttft-ms: must be finite and > 0 milliseconds, got -5"),
    (["--slo-itl-percentile", "150"],
     "argument --slo-itl-percentile: must be finite and > 0 and <= 100, got 150"),
    (["--replicas", "0"], "argument --replicas: must be >= 1, got 0"),
    (["--max-output-tokens", "0"], "argument --max-output-tokens: must be >= 1, got 0"),
    (["--input-len", "uniform:9:1"],
     "argument --input-len: bad length distribution 'uniform:9:1': lengths must be ≥ 1"),
    (["--input-len", "normal:10:inf"], "argument --input-len: bad length distribution "
     "'normal:10:inf': lengths must be at most 1,000,000 tokens"),  # was an OverflowError
    (["--output-len", "10000000000"], "argument --output-len: bad length distribution "
     "'10000000000': lengths must be at most 1,000,000 tokens"),  # memory grew until killed
    (["--url", "notaurl"], "argument --url: not an http(s) URL with a host: 'notaurl'"),
    (["--output", "/tmp"], "argument --output: /tmp: cannot write it (Is a directory)"),
    (["--output", "/nonexistent/x.json"],  # was made as root, after the run
     "argument --output: /nonexistent/x.json: its directory does not exist"),
    (["--plot", "/etc/hostname"], "argument --plot: /etc/hostname: not a directory"),
    (["--extra-body", "[1]"], "argument --extra-body: must be a JSON object {...}, got [1]"),
    (["--extra-body", "{min_tokens: 4}"], "argument --extra-body: not JSON (Expecting property "
     "name enclosed in double quotes: line 1 column 2 (char 1)): '{min_tokens: 4}'"),
])
def test_out_of_range_numbers_exit_2_naming_the_flag(capsys, args, message):
    """Found by fresh users: a negative --duration or --time-scale was accepted (the run
    went on to the last request; a trace played backwards), --rate nan died in a
    traceback, --prefix-groups -1 was taken, a bad --extra-body did not name the flag."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--url", "http://127.0.0.1:1", "--model", "m", *args])
    assert exited.value.code == 2
    assert capsys.readouterr().err == \
        f"sluice bench: error: {message} (see sluice bench --help)\n"


# --------------------------------------------------------------------------- real worker


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice.cli", "bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_against_a_real_worker(worker_url, model_path, tmp_path):
    out, plots = tmp_path / "results.json", tmp_path / "plots"
    n, max_tokens = 8, 12
    proc = _bench("--url", worker_url, "--model", store.DEFAULT_MODEL, "--tokenizer",
                  str(model_path), "--num-requests", str(n), "--concurrency", "2",
                  "--input-len", "32", "--output-len", str(max_tokens), "--slo-ttft-ms", "60000",
                  "--slo-itl-ms", "60000", "--cost-per-hour", "2.0", "--replicas", "1",
                  # greedy: sampled at the server's default temperature, SmolLM2 sometimes
                  # picks byte tokens that re-tokenize into fewer (a CI run: 8 for 12)
                  "--temperature", "0",
                  "--output", str(out), "--plot", str(plots), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT (ms)" in proc.stdout and "output tokens/s" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"config", "started_at", "summary", "records"}
    s = data["summary"]
    assert {"requests", "succeeded", "failed", "duration_s", "rps", "output_tok_s", "ttft_ms",
            "itl_ms", "tpot_ms", "e2e_ms", "goodput", "errors", "cost"} <= set(s)
    assert (s["requests"], s["succeeded"], s["failed"], s["errors"]) == (n, n, 0, {})
    assert s["goodput"]["requests"] == n and s["cost"]["per_request"] > 0
    for r in data["records"]:
        assert r["ok"] and r["status"] == 200
        assert r["usage_output_tokens"] == max_tokens
        # one token per chunk, except that the worker holds back a token that ends inside a
        # UTF-8 character and sends it with the next one; re-tokenizing may merge a few
        assert 1 <= r["num_chunks"] <= max_tokens
        assert abs(r["output_tokens"] - max_tokens) <= 2
        assert r["input_tokens"] == r["usage_input_tokens"] == 32
        if r["num_chunks"] == max_tokens:
            assert len(r["itl_s"]) == max_tokens - 1
        else:
            assert abs(len(r["itl_s"]) - (max_tokens - 1)) <= 2
        assert 0 < r["ttft_s"] < r["e2e_s"]
        assert r["ttft_s"] + sum(r["itl_s"]) <= r["e2e_s"]
    assert sorted(p.name for p in plots.iterdir()) == [
        "e2e_hist.png", "itl_hist.png", "latency_over_time.png", "ttft_hist.png"]


def test_bench_records_http_errors_per_request(worker_url, model_path, tmp_path):
    out = tmp_path / "errors.json"
    proc = _bench("--url", worker_url, "--model", "no-such-model", "--tokenizer",
                  str(model_path), "--num-requests", "4", "--concurrency", "2",
                  "--rate", "50", "--input-len", "8", "--output-len", "2", "--warmup", "0",
                  "--output", str(out), "--quiet")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # finished, some requests failed
    data = json.loads(out.read_text())
    assert data["summary"]["errors"] == {"404": 4} and data["summary"]["succeeded"] == 0
    for r in data["records"]:
        assert r["status"] == 404 and r["error_code"] == "404"
        assert "model_not_found" in r["error"] and r["scheduled_s"] is not None
