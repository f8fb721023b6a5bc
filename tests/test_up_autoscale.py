"""`sluice up` with autoscaling: real router and worker processes follow the policy.

    examples/autoscaling.yaml (1..2 workers, one thread each): an open-loop burst adds a
    worker, the new worker takes traffic, the load stops, the least busy worker is drained
    and stopped; every stream across both transitions ends with [DONE] and all its tokens.

    scale to zero: starts at 0 workers, /v1/models lists the model; a request is held and
    answered after the cold start; idle again → 0; with a hold shorter than the cold start:
    503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import free_port
from test_up import MODEL, Up

ROOT = Path(__file__).resolve().parents[1]
AUTOSCALING = ROOT / "examples" / "autoscaling.yaml"
pytestmark = pytest.mark.slow


async def stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, bool, int]:
    """One streamed completion: (status, ended with [DONE], completion tokens in usage)."""
    body = {"model": MODEL, "prompt": "Count slowly: one, two,", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    done, tokens = False, -1
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
        return response.status_code, done, tokens


def wait_for_line(up: Up, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, up.output())):
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{up.output()[-4000:]}"
        time.sleep(0.25)
    return found


def test_a_burst_adds_a_worker_that_takes_traffic_and_scale_down_loses_nothing(tmp_path):
    metrics_port = free_port()
    up = Up(["--metrics-port", str(metrics_port)], tmp_path / "up.log", example=AUTOSCALING)
    try:
        assert len(httpx.get(f"{up.url}/health", timeout=5).json()["workers"]) == 1
        busiest: dict[str, int] = {}

        async def watch(stop: asyncio.Event) -> None:
            async with httpx.AsyncClient(timeout=5) as client:
                while not stop.is_set():
                    for w in (await client.get(f"{up.url}/health")).json()["workers"]:
                        busiest[w["url"]] = max(busiest.get(w["url"], 0), w["in_flight"])
                    await asyncio.sleep(0.3)

        async def load() -> list[tuple[int, bool, int]]:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            async with httpx.AsyncClient(timeout=300) as client:
                burst = []
                for _ in range(36):  # 3 req/s for 12 s against a capacity of 1 req/s
                    burst.append(asyncio.create_task(stream(client, up.url, 16)))
                    await asyncio.sleep(1 / 3)
                results = await asyncio.gather(*burst)
                # a trickle of longer streams while the autoscaler drains a worker
                trickle = []
                deadline = time.monotonic() + 150
                while not re.search(r"worker-\d stopped", up.output()):
                    assert time.monotonic() < deadline, up.output()[-4000:]
                    trickle.append(asyncio.create_task(stream(client, up.url, 48)))
                    await asyncio.sleep(4)
                results += await asyncio.gather(*trickle)
            stop.set()
            await watcher
            return results

        results = asyncio.run(load())
        assert [r for r in results if r[0] != 200 or not r[1]] == []  # no failed, no cut
        assert [r[2] for r in results] == [16] * 36 + [48] * (len(results) - 36)
        added = wait_for_line(up, r"started worker-1 \(pid \d+\): (\S+)", 5).group(1)
        assert "autoscaler: 1 -> 2 replicas" in up.output()
        assert busiest.get(added, 0) > 0, busiest  # the new worker took traffic
        assert "autoscaler: 2 -> 1 replicas (consolidate" in up.output()
        drained = wait_for_line(up, r"draining (worker-\d) \(\S+, (\d+) in flight\)", 5)
        assert f"{drained.group(1)} stopped" in up.output()
        workers = httpx.get(f"{up.url}/health", timeout=5).json()["workers"]
        assert len([w for w in workers if w["listed"]]) == 1
        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert f'sluice_autoscaler_desired_replicas{{model="{MODEL}"}} 1.0' in scrape
        assert (f'sluice_autoscaler_decisions_total{{direction="down",model="{MODEL}",'
                'reason="consolidate"} 1.0') in scrape, scrape
    finally:
        up.close()


def zero_manifest(tmp_path: Path, hold_s: float) -> Path:
    body = yaml.safe_load(AUTOSCALING.read_text())
    body["spec"].update(replicas=0, minReplicas=0)
    body["spec"]["autoscaling"].update(scaleToZero=True, idleSeconds=3, holdSeconds=hold_s)
    path = tmp_path / f"zero-{hold_s:g}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_scale_to_zero_holds_a_request_through_the_cold_start(tmp_path):
    up = Up([], tmp_path / "up.log", example=zero_manifest(tmp_path, 120))
    try:
        models = httpx.get(f"{up.url}/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == [MODEL]  # listed at zero replicas
        started = time.monotonic()
        r = httpx.post(f"{up.url}/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                          "max_tokens": 4}, timeout=180)
        assert r.status_code == 200, r.text
        assert "autoscaler: 0 -> 1 replicas (wake" in up.output()
        assert time.monotonic() - started > 1.0  # it waited for a worker to load
        wait_for_line(up, r"autoscaler: 1 -> 0 replicas \(idle", 60)
        wait_for_line(up, r"worker-0 stopped", 30)
    finally:
        up.close()


def test_a_hold_shorter_than_the_cold_start_is_a_503_with_retry_after(tmp_path):
    up = Up([], tmp_path / "up.log", example=zero_manifest(tmp_path, 0.5))
    try:
        r = httpx.post(f"{up.url}/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                          "max_tokens": 4}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_ready_worker"
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        up.close()
