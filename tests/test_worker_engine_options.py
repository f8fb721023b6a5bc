"""Engine options through `sluice worker` flags, observed on the worker's /metrics."""

from __future__ import annotations

import re

import httpx
import pytest

from conftest import free_port, serve

PROMPT = "apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple,"  # repetitive: n-gram drafts get accepted


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.mark.slow
def test_prefix_cache_and_ngram_speculation_metrics(model_path, tmp_path):
    port = free_port()
    args = ["worker", "--model", str(model_path), "--port", str(port), "--kv-cache-gib", "0.1",
            "--speculative-method", "ngram", "--speculative-num-tokens", "4"]
    with serve(args, port, log=tmp_path / "worker.log") as url:
        tokens = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        body = {"model": model_path.name, "prompt": tokens, "max_tokens": 24, "temperature": 0}
        before = httpx.get(f"{url}/metrics").text
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        second = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        after = httpx.get(f"{url}/metrics").text
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    queries = metric(after, "vllm:prefix_cache_queries_total") - metric(before, "vllm:prefix_cache_queries_total")
    hits = metric(after, "vllm:prefix_cache_hits_total") - metric(before, "vllm:prefix_cache_hits_total")
    assert queries == 2 * len(tokens)
    assert hits == (len(tokens) - 1) // 16 * 16  # the second request reuses every full block
    drafted = metric(after, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(after, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted
    assert metric(after, "vllm:spec_decode_draft_acceptance_rate") == pytest.approx(accepted / drafted)


def test_draft_speculation_flags_are_checked_before_loading(model_path):
    """A draft method without a draft model, or a draft model not in the store, is a one-line
    error and exit code 1 before any model is loaded."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "sluice.cli", "worker", "--model", str(model_path), "--port",
            str(free_port()), "--speculative-method", "draft"]
    missing = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert "speculative_model is needed by, and only by, speculative_method draft" in missing.stderr
    unknown = subprocess.run(base + ["--speculative-model", "/nonexistent/draft"], capture_output=True,
                             text=True, timeout=120)
    assert unknown.returncode == 1
    assert "/nonexistent/draft/config.json is missing" in unknown.stderr
