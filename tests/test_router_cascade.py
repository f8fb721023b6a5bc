"""Cascade routing through a real router in front of two real workers: SmolLM2-135M (tier
``smol``) and Qwen2.5-Coder-0.5B (tier ``qwen``), the cascades declared by a manifest
(``--manifest``). Thresholds at the ends of the range make the outcome certain: -100 never
escalates, 0 always does (a 10-token answer's low quantile is below 0 unless the model is
certain of almost every token, which a small model writing code is not)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import yaml

from conftest import free_port, serve
from sluice.api import metrics as names
from sluice.models import store
from test_router import idle, metric, wait_until

QWEN = "Qwen2.5-Coder-0.5B-Instruct"
SMOL = store.DEFAULT_MODEL
PROMPT = "Write a Python function that returns the sum of a list of numbers."
pytestmark = pytest.mark.slow


def isvc(name: str, model: str, **spec) -> dict:
    source = {"source": f"sluice://{model}"} if "cascade" not in spec else {}
    return {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": {"model": {"name": model, **source}, **spec}}


def cascade(name: str, threshold: float, mode: str = "buffer",
            signal: str = "logprob-quantile") -> dict:
    return isvc(name, name, cascade={"tiers": ["smol", "qwen"], "costs": [3, 8],
                                     "escalation": {"threshold": threshold, "signal": signal},
                                     "streaming": {"mode": mode, "prefixTokens": 4}})


@pytest.fixture(scope="module")
def qwen_worker(tmp_path_factory):
    path = store.fetch(QWEN)
    port = free_port()
    log = tmp_path_factory.mktemp("qwen") / "worker.log"
    with serve(["worker", "--model", str(path), "--served-model-name", QWEN, "--port",
                str(port), "--kv-cache-gib", "0.25"], port, timeout=300, log=log) as url:
        yield url


@pytest.fixture(scope="module")
def router(worker_url, qwen_worker, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cascade")
    manifest = folder / "cascade.yaml"
    manifest.write_text(yaml.safe_dump_all([
        isvc("smol", SMOL), isvc("qwen", QWEN), cascade("sure", -100.0),
        cascade("unsure", 0.0), cascade("sure-prefix", -100.0, "prefix"),
        cascade("unsure-prefix", 0.0, "prefix"),
        cascade("checks", -100.0, signal="checks")]))
    port = free_port()
    with serve(["router", "--port", str(port), "--worker", worker_url, "--worker", qwen_worker,
                "--manifest", str(manifest)], port, log=folder / "router.log") as url:
        yield url


def complete(router: str, model: str, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", headers=headers or {}, timeout=300, json={
        "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body})


def cascade_metric(router: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{router}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sse(raw: bytes) -> list[dict | str]:
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# an example no 12-token answer of SmolLM2 passes (its code is cut short, or returns
# something else): with the checks signal the answer is proven wrong
EXAMPLE_PROMPT = ('Complete this function.\n```python\ndef secret(n):\n'
                  '    """Return the secret code of n.\n    >>> secret(3)\n    918273645\n'
                  '    """\n```')


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_code_that_fails_its_prompts_examples_escalates_at_any_threshold(router, stream):
    """At threshold -100 no score escalates; code failing the prompt's example does (the
    router runs it in its sandbox), counted as failed-examples; a prompt without examples
    is judged on its score alone and stays."""
    def failed() -> float:
        return cascade_metric(router, names.ROUTER_CASCADE_ESCALATIONS, cascade="checks",
                              tier="smol", reason="failed-examples")

    before = failed()
    r = complete(router, "checks", prompt=EXAMPLE_PROMPT, stream=stream)
    assert r.status_code == 200, r.text
    assert (r.headers["x-sluice-tier"], r.headers["x-sluice-escalated"]) == ("qwen", "true")
    assert r.headers["x-sluice-score"] == "-inf"
    if stream:
        events = sse(r.content)
        assert events[-1] == "[DONE]" and all(e["model"] == QWEN for e in events[:-1])
    else:
        assert r.json()["model"] == QWEN
    assert failed() == before + 1
    plain = complete(router, "checks", stream=stream)  # PROMPT writes no example
    assert plain.status_code == 200, plain.text
    assert (plain.headers["x-sluice-tier"], plain.headers["x-sluice-escalated"]) == \
        ("smol", "false")
    assert float(plain.headers["x-sluice-score"]) > -100
    assert failed() == before + 1


def test_models_lists_the_cascades(router):
    ids = {m["id"]: m for m in httpx.get(f"{router}/v1/models", timeout=5).json()["data"]}
    assert {SMOL, QWEN, "sure", "unsure", "sure-prefix", "unsure-prefix"} <= set(ids)
    assert ids["sure"]["cascade"] == ["smol", "qwen"]


def test_a_confident_answer_stays_on_the_first_tier(router, worker_url):
    direct = httpx.post(f"{worker_url}/v1/completions", timeout=120, json={
        "model": SMOL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    r = complete(router, "sure")
    assert r.status_code == 200, r.text
    assert (r.headers["x-sluice-tier"], r.headers["x-sluice-escalated"]) == ("smol", "false")
    assert float(r.headers["x-sluice-score"]) <= 0
    body = r.json()
    assert body["model"] == SMOL
    assert body["choices"][0]["text"] == direct["choices"][0]["text"]  # greedy: same tokens
    assert body["choices"][0]["logprobs"] is None  # asked internally, not by the client
    assert body["usage"] == direct["usage"]
    asked = complete(router, "sure", logprobs=2).json()["choices"][0]["logprobs"]
    assert len(asked["token_logprobs"]) == 12 and len(asked["top_logprobs"][0]) == 2


def test_a_doubtful_answer_escalates_and_its_tokens_count_as_wasted(router, qwen_worker):
    before = cascade_metric(router, names.ROUTER_CASCADE_WASTED_TOKENS, cascade="unsure")
    cost_before = cascade_metric(router, names.ROUTER_CASCADE_WASTED_COST, cascade="unsure")
    r = complete(router, "unsure")
    assert r.status_code == 200, r.text
    assert (r.headers["x-sluice-tier"], r.headers["x-sluice-escalated"]) == ("qwen", "true")
    body = r.json()
    assert body["model"] == QWEN and body["usage"]["completion_tokens"] == 12
    assert cascade_metric(router, names.ROUTER_CASCADE_WASTED_TOKENS, cascade="unsure") \
        == before + 12
    # priced at the first tier's spec.cascade.costs entry (3)
    assert cascade_metric(router, names.ROUTER_CASCADE_WASTED_COST, cascade="unsure") \
        == cost_before + 36
    assert cascade_metric(router, names.ROUTER_CASCADE_ESCALATIONS, cascade="unsure",
                          tier="smol", reason="low-score") >= 1
    assert cascade_metric(router, names.ROUTER_CASCADE_REQUESTS, cascade="unsure",
                          tier="qwen", escalated="true") >= 1


@pytest.mark.parametrize("name", ["sure", "unsure", "sure-prefix", "unsure-prefix"])
def test_streams_end_as_one_valid_stream_with_its_usage(router, name):
    """Both modes, both outcomes: one chat stream, the answering tier's tokens only, its
    usage, no logprobs the client did not ask for, and [DONE] once."""
    with httpx.stream("POST", f"{router}/v1/chat/completions", timeout=300, json={
            "model": name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        tier = r.headers["x-sluice-tier"]
        events = sse(r.read())
    assert tier == ("qwen" if name.startswith("unsure") else "smol")
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["model"] for c in chunks} == {QWEN if tier == "qwen" else SMOL}
    assert all(c["choices"][0].get("logprobs") is None for c in chunks)
    content = [c["choices"][0]["delta"].get("content") for c in chunks
               if c["choices"][0]["delta"].get("content")]
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 10 and len(content) <= 10
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("name", "header", "tier"), [
    ("sure", "top", "qwen"), ("unsure", "off", "smol"), ("unsure", "smol", "smol"),
    ("sure", QWEN, "qwen")])
def test_the_header_overrides(router, name, header, tier):
    r = complete(router, name, {"x-sluice-cascade": header})
    assert r.status_code == 200, r.text
    assert (r.headers["x-sluice-tier"], r.headers["x-sluice-escalated"]) == (tier, "false")
    assert "x-sluice-score" not in r.headers


def test_a_bad_header_is_a_400_naming_it(router):
    r = complete(router, "sure", {"x-sluice-cascade": "huge"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "x-sluice-cascade" and "off, top or a tier" in error["message"]


@pytest.mark.parametrize("name", ["unsure", "sure-prefix"])
def test_a_client_that_leaves_aborts_the_running_tier(router, worker_url, qwen_worker, name):
    """The client leaves while the first tier answers (held whole in buffer mode, streamed
    on in prefix mode): that tier stops, frees its KV cache, and the next never starts."""
    qwen_before = metric(qwen_worker, names.REQUEST_SUCCESS)

    async def leave() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async def stream() -> None:
                async with client.stream("POST", f"{router}/v1/completions", json={
                        "model": name, "prompt": PROMPT, "max_tokens": 2000,
                        "ignore_eos": True, "stream": True}) as r:
                    async for _ in r.aiter_bytes():
                        pass
            task = asyncio.create_task(stream())
            until = time.monotonic() + 60
            while metric(worker_url, names.NUM_RUNNING) < 1 and time.monotonic() < until:
                await asyncio.sleep(0.1)
            assert metric(worker_url, names.NUM_RUNNING) >= 1, "the first tier never started"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave())
    assert wait_until(lambda: idle([worker_url, qwen_worker]), 15)
    assert metric(qwen_worker, names.REQUEST_SUCCESS) == qwen_before


def test_readme_cascade_commands_under_sluice_up(tmp_path):
    """README's cascade section, as written: `sluice up -f examples/cascade.yaml`, its curl
    (the answer names its tier), then `sluice cascade record` of four arithmetic problems
    (one block of four per tier) through that router (answers cut at 48 tokens: the plumbing
    is under test, not the models), `sluice cascade rescore` of them (no code: nothing
    changes), `sluice cascade calibrate` on what it recorded, and
    `sluice cascade check` of the served cascade against the replay of those records."""
    import re
    import subprocess
    import sys

    from conftest import ROOT
    from test_up import Up

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Cascade routing"):readme.index("### Models")]
    curl = re.search(r"^curl .*?\n(?:  .*\n)*", section, re.M).group(0)
    up = Up([], tmp_path / "up.log", timeout=600, example=ROOT / "examples" / "cascade.yaml")
    try:
        result = subprocess.run(["bash", "-c", curl.replace("http://127.0.0.1:8000", up.url)],
                                capture_output=True, text=True, timeout=600)
        head, _, body = result.stdout.replace("\r\n", "\n").partition("\n\n")
        assert head.startswith("HTTP/1.1 200"), result.stdout[-2000:]
        tier = re.search(r"^x-sluice-tier: (\S+)$", head, re.M | re.I).group(1)
        assert tier in ("smollm2", "qwen-coder")
        assert json.loads(body)["choices"][0]["message"]["content"]
        records = tmp_path / "records.jsonl"
        cli = [sys.executable, "-m", "sluice.cli", "cascade"]
        record = subprocess.run([*cli, "record", "--url", up.url, "--cascade", "coder",
                                 "--tiers", "smollm2,qwen-coder", "--set", "arithmetic",
                                 "--sample", "4", "--steps", "2", "--max-value", "20", "--max-tokens", "48",
                                 "--batch", "4", "--out", str(records)], capture_output=True, text=True,
                                timeout=1200)
        assert record.returncode == 0, record.stderr[-3000:]
        lines = [json.loads(line) for line in records.read_text().splitlines()]
        assert sorted((r["id"], r["tier"]) for r in lines) == sorted(
            {(r["id"], t) for r in lines for t in ("smollm2", "qwen-coder")})
        assert len(lines) == 8 and all(isinstance(r["correct"], bool) for r in lines)
        rescore = subprocess.run([*cli, "rescore", "--records", str(records)],
                                 capture_output=True, text=True, timeout=300)
        assert rescore.returncode == 0, rescore.stderr[-3000:]
        assert "0 code answers run on their prompts' examples; 0 changed" in rescore.stdout
        assert [json.loads(line) for line in records.read_text().splitlines()] == lines
        calibrate = subprocess.run([*cli, "calibrate", "--records", str(records), "--tiers",
                                    "smollm2,qwen-coder", "--target-top-share", "0.5",
                                    "--splits", "2"], capture_output=True, text=True,
                                   timeout=300)
        assert calibrate.returncode == 0, calibrate.stderr[-3000:]
        assert "escalation:" in calibrate.stdout and "  threshold: " in calibrate.stdout
        # the live cascade (the example's threshold) against its replay on those records
        report = tmp_path / "check.json"
        check = subprocess.run([*cli, "check", "--url", up.url, "--manifest",
                                str(ROOT / "examples" / "cascade.yaml"), "--cascade", "coder",
                                "--records", str(records), "--concurrency", "4",
                                "--out", str(report)],  # asked with the recorded 48 tokens
                               capture_output=True, text=True, timeout=1200)
        assert check.returncode == 0, check.stderr[-3000:]
        result = json.loads(report.read_text())
        compared = result["comparison"]
        assert compared["items"] == 4 and result["failed"] == []
        assert {a["tier"] for a in result["answers"]} <= {"smollm2", "qwen-coder"}
        # a first-tier answer that scored as recorded was judged as the replay judges it:
        # with two tiers, the same score means the same answering tier
        assert compared["same_score"] >= 1
        assert compared["same_tier"] >= compared["same_score"]
    finally:
        up.close()
