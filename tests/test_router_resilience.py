"""Router resilience: timeouts, retries, admission and draining with workers that misbehave.

Scripted fake workers (a few lines of asyncio HTTP, no model) make the edge cases exact:
a worker that never answers, one that drops the connection, one that is slow to its first
token. Real `sluice worker` processes then show the same under SIGTERM and SIGKILL, and the
inter-token timing through the router.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from conftest import free_port, serve
from sluice.api import metrics as names
from sluice.router.upstream import Upstream
from test_router import (MODEL, health, metric, ready_workers, serve_router, successes,
                         wait_until)

slow = pytest.mark.slow


# ------------------------------------------------------------------ a scripted fake worker

class FakeWorker:
    """An HTTP/1.1 server on 127.0.0.1 that serves /health, /v1/models, /metrics and answers
    POSTs by the prompt: ``hang`` never answers; ``die`` closes the connection unanswered;
    ``slow:S`` streams one token after S seconds; anything else answers at once. Runs its
    own event loop in a thread; ``posts`` counts the generation requests it received."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.posts = 0
        self.health = 200
        self.override: str | None = None  # a prompt that replaces every request's
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeWorker:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = next((int(v) for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
                               if k.strip().lower() == "content-length"), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                if method == "GET":
                    await self._get(path, writer)
                    continue
                self.posts += 1
                prompt = self.override or str(body.get("prompt", ""))
                if prompt == "hang":
                    await asyncio.sleep(3600)
                if prompt == "die":
                    writer.transport.abort()
                    return
                delay = float(prompt.split(":")[1]) if prompt.startswith("slow:") else 0.0
                await self._stream(writer, delay)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _get(self, path: str, writer: asyncio.StreamWriter) -> None:
        if path == "/v1/models":
            body, status = json.dumps({"object": "list", "data": [{"id": MODEL}]}), 200
        elif path == "/health":
            body, status = "{}", self.health
        else:
            body, status = "", 200
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n{body}".encode())
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, delay: float) -> None:
        # (as a worker does: the request's prompt counts as queued prefill until its first
        # token, which comes after ``delay``)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"x-sluice-num-running: 0\r\nx-sluice-queued-prefill-tokens: 3\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(delay)
        for event in (b'data: {"choices":[{"text":"hi","index":0}]}\n\n', b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@contextmanager
def fakes(n: int):
    workers = [FakeWorker() for _ in range(n)]
    for w in workers:
        w.__enter__()
    try:
        yield workers
    finally:
        for w in workers:
            w.__exit__()


@contextmanager
def router_over(workers: list[FakeWorker], *extra: str):
    with serve_router([w.url for w in workers], free_port(), *extra) as url:
        assert wait_until(lambda: len(ready_workers(url)) == len(workers), 10)
        yield url


def complete(router: str, prompt: str, timeout: float = 30, **headers: str) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", timeout=timeout, headers=headers,
                      json={"model": MODEL, "prompt": prompt, "stream": True})


# ------------------------------------------------------------------ fast: fake workers

def test_first_byte_timeout_is_504_and_configurable():
    with fakes(1) as (worker,), router_over([worker], "--first-byte-timeout", "1") as router:
        start = time.monotonic()
        r = complete(router, "hang")
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert 0.9 < time.monotonic() - start < 5


def test_a_worker_dying_before_its_first_byte_costs_one_retry_elsewhere():
    with fakes(2) as (a, b), router_over([a, b], "--policy", "round-robin") as router:
        a_posts = a.posts
        statuses = []
        for _ in range(4):
            r = complete(router, "die")  # both die: the retry fails too → 502, never a third
            statuses.append(r.status_code)
            # both were ejected (passive health checking); polls re-admit them
            assert wait_until(lambda: len(ready_workers(router)) == 2, 10)
        assert statuses == [502] * 4
        assert a.posts + b.posts - a_posts == 8  # exactly one retry per request
        assert metric(router, names.ROUTER_RETRIES) == 4


def test_retry_after_a_drop_succeeds_on_the_other_worker():
    with fakes(2) as (a, b), router_over([a, b], "--policy", "round-robin") as router:
        a.override = "die"  # a takes every request and drops the connection
        for _ in range(4):
            r = complete(router, "ok")
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert wait_until(lambda: len(ready_workers(router)) == 2, 10)
        assert b.posts == 4 and 1 <= a.posts <= 4
        assert metric(router, names.ROUTER_RETRIES) == a.posts


def test_admission_queue_full_is_429_with_retry_after():
    """One worker busy with a prefill (no first token yet); a request whose TTFT objective
    cannot be met and that finds the queue full is refused at once, OpenAI-style."""
    with fakes(1) as (worker,), router_over([worker], "--max-queue", "0") as router, \
            ThreadPoolExecutor(1) as pool:
        busy = pool.submit(complete, router, "slow:2")
        assert wait_until(lambda: worker.posts == 1, 5)
        start = time.monotonic()
        r = complete(router, "hello", **{"x-slo-ttft-ms": "1"})
        assert time.monotonic() - start < 1.0
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert busy.result().status_code == 200
        assert complete(router, "hello", **{"x-slo-ttft-ms": "1"}).status_code == 200  # idle
        text = httpx.get(f"{router}/metrics", timeout=5).text
        assert f'{names.ROUTER_REJECTED}{{model="{MODEL}",reason="queue_full"}} 1.0' in text


def test_queued_requests_are_served_by_priority():
    """With the worker busy on a prefill and objectives nobody can meet, requests wait in
    the router and reach the worker by ``x-priority`` (lower first), not by arrival; each
    is released when the one before it has its first token (EDF within a priority is
    tested in test_admission)."""
    with fakes(1) as (worker,), router_over([worker], "--slo-ttft-ms", "1") as router, \
            ThreadPoolExecutor(4) as pool:
        order: list[str] = []
        lock = threading.Lock()

        def send(name: str, prompt: str, **headers: str):
            r = complete(router, prompt, **headers)
            with lock:
                order.append(name)
            return r.status_code

        first = pool.submit(send, "first", "slow:1.5")
        assert wait_until(lambda: worker.posts == 1, 5)
        later = []
        for priority in ("3", "2", "1"):
            later.append(pool.submit(send, f"p{priority}", "slow:0.2", **{"x-priority": priority}))
            time.sleep(0.2)
        assert worker.posts == 1  # all three wait in the router
        assert metric(router, names.ROUTER_QUEUE_LENGTH) == 3
        assert [f.result() for f in (first, *later)] == [200] * 4
        assert order == ["first", "p1", "p2", "p3"]
        assert metric(router, names.ROUTER_QUEUE_LENGTH) == 0
        assert metric(router, names.ROUTER_QUEUE_WAIT + "_count") >= 3


def test_a_loading_worker_gets_nothing():
    with fakes(2) as (loading, ready):
        loading.health = 503
        with serve_router([loading.url, ready.url], free_port()) as router:
            assert wait_until(lambda: ready_workers(router) == [ready.url], 10)
            for _ in range(6):
                assert complete(router, "hi").status_code == 200
            assert loading.posts == 0 and ready.posts == 6


def test_a_booting_worker_is_routed_within_a_fast_poll_of_its_readiness():
    """A scale-up's worker is polled every BOOT_POLL_S until its first readiness, not once a
    poll interval (5 s here), and not backed off while its port is still closed: routed
    within about a second of binding, then of answering 200. Before, the closed port backed
    it off to 2-4 poll intervals (10-20 s here)."""
    unbound, loading = FakeWorker(), FakeWorker()
    with fakes(0), serve_router([unbound.url, loading.url], free_port(), "--poll-interval", "5") \
            as router:
        time.sleep(3)  # several refused polls of the unbound port
        with loading:
            loading.health = 503
            time.sleep(1)
            loading.health = 200
            became = time.monotonic()
            assert wait_until(lambda: loading.url in ready_workers(router), 3)
            assert time.monotonic() - became < 1.5
            with unbound:
                bound = time.monotonic()
                assert wait_until(lambda: unbound.url in ready_workers(router), 3)
                assert time.monotonic() - bound < 1.5
                assert complete(router, "hi").status_code == 200


def test_scale_ups_teach_the_expected_boot_and_the_startup_fleet_does_not(tmp_path):
    """``EndpointSet.boot_s`` (what the gate's late binding expects of a booting worker)
    follows scale-ups' listed-to-ready times: a worker listed at the first poll (it booted
    with the router, or was up) teaches nothing; one added later that answers /health 503
    for 0.8 s after it is listed teaches about that."""
    from sluice.router.endpoints import EndpointSet

    workers_file = tmp_path / "workers.json"

    def publish(urls: list[str]) -> None:
        tmp = tmp_path / "workers.tmp"
        tmp.write_text(json.dumps({"workers": urls, "models": [MODEL]}))
        os.replace(tmp, workers_file)

    async def scenario(first: FakeWorker, added: FakeWorker) -> tuple:
        publish([first.url])
        endpoints = EndpointSet(poll_interval=5.0, workers_file=str(workers_file))
        client = Upstream(1.0, 2.0, 4.0)
        poller = asyncio.create_task(endpoints.poll_forever(client))
        try:
            while not endpoints.ready_for(MODEL):
                await asyncio.sleep(0.05)
            before = endpoints.boot_s
            added.health = 503
            publish([first.url, added.url])
            listed = time.monotonic()
            await asyncio.sleep(0.4)
            booting = endpoints.ready_in_s(MODEL, time.monotonic())
            await asyncio.sleep(0.4)
            added.health = 200
            while len(endpoints.ready_for(MODEL)) < 2:
                await asyncio.sleep(0.05)
            return before, booting, endpoints.boot_s, time.monotonic() - listed
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            await client.close()

    with fakes(2) as (first, added):
        before, booting, learnt, took = asyncio.run(scenario(first, added))
    assert before is None and booting is None  # nothing to expect before a scale-up
    # listed when the router re-read the file (within a 0.2 s boot poll of the write),
    # ready 0.8 s after the write: so 0.6-0.8 s, never more than the client saw
    assert 0.8 - 0.25 <= learnt <= took and took < 1.3, (learnt, took)


def test_boot_seconds_sets_the_retry_after_of_a_503_while_a_worker_boots(tmp_path):
    """``--boot-seconds 30`` (what ``sluice up`` passes from ``bootSeconds``): a request
    while the only listed worker has not bound its port yet gets 503 no_ready_worker with
    ``Retry-After`` counting down from 30 (listed ~1 s before); without the flag, 5."""
    workers_file = tmp_path / "workers.json"
    workers_file.write_text(json.dumps({"workers": [f"http://127.0.0.1:{free_port()}"],
                                        "models": [MODEL]}))
    for extra, expected in ((["--boot-seconds", "30"], {29, 30}), ([], {5})):
        with serve_router([], free_port(), "--discovery", "file", "--workers-file",
                          str(workers_file), *extra) as router:
            r = complete(router, "hi")
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_worker"
            assert int(r.headers["retry-after"]) in expected, r.headers


def test_ready_in_s_counts_down_the_soonest_boot_of_the_model():
    from sluice.router.endpoints import BOOT_LATE_FACTOR, EndpointSet

    endpoints = EndpointSet(["http://a", "http://b"], boot_s=2.0)
    now = time.monotonic()
    a, b = endpoints
    a.listed_at, b.listed_at = now - 0.5, now - 1.5
    assert endpoints.ready_in_s(MODEL, now) == pytest.approx(0.5)  # b's boot, the soonest
    b.models, b.models_known = {"other": {}}, True  # b turns out to serve another model
    assert endpoints.ready_in_s(MODEL, now) == pytest.approx(1.5)
    a.listed_at = now - 2.5
    assert endpoints.ready_in_s(MODEL, now) == 0.0  # late: any moment now
    a.listed_at = now - BOOT_LATE_FACTOR * 2.0 - 0.1
    assert endpoints.ready_in_s(MODEL, now) is None  # too late to wait for
    a.listed_at, a.ready = now - 0.5, True
    assert endpoints.ready_in_s(MODEL, now) is None  # ready: a candidate, not a boot


# ------------------------------------------------------------------ slow: real workers

def start_worker(model_path, port: int, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sluice.cli", "worker", "--model",
                             str(model_path), "--served-model-name", MODEL, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stream_events(url: str, body: dict, timeout: float = 120) -> tuple[int, list[str]]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        return r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@slow
def test_draining_worker_finishes_its_streams_under_constant_load(worker_url, model_path,
                                                                  tmp_path):
    """Streams at a constant rate through a router over two workers; one is SIGTERMed
    mid-run: every stream completes ([DONE], all tokens, no error event), none fails."""
    port = free_port()
    with open(tmp_path / "w.log", "wb") as log:
        proc = start_worker(model_path, port, log)
        drained = f"http://127.0.0.1:{port}"
        try:
            assert wait_until(lambda: health(drained) == 200, 180, period=0.5)
            with serve_router([worker_url, drained], free_port(), "--policy", "round-robin") \
                    as router, ThreadPoolExecutor(16) as pool:
                assert wait_until(lambda: len(ready_workers(router)) == 2, 10)
                body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 12,
                        "ignore_eos": True, "stream": True}
                futures = []
                for i in range(24):  # 4 per second for 6 s
                    futures.append(pool.submit(stream_events, router, body))
                    if i == 8:  # SIGTERM while it holds streams
                        assert wait_until(lambda: metric(drained, names.NUM_RUNNING) >= 1, 5)
                        os.killpg(proc.pid, signal.SIGTERM)
                    time.sleep(0.25)
                results = [f.result() for f in futures]
            assert [status for status, _ in results] == [200] * 24
            for _, events in results:
                assert events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert not any("error" in c for c in chunks)
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert successes(worker_url) > 0
            assert proc.wait(60) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@slow
def test_a_worker_draining_after_sigterm_answers_its_plain_requests(model_path, tmp_path):
    """The only worker is SIGTERMed while it holds plain (unanswered: no first byte until
    the end) requests: it closes its listener and finishes them. The router's poll finds
    nothing listening and ejects it, but leaves those requests on their connections: each
    is answered 200 in full (it was a 503 when the ejection sent them elsewhere)."""
    port = free_port()
    drained = f"http://127.0.0.1:{port}"
    with open(tmp_path / "w.log", "wb") as log:
        proc = start_worker(model_path, port, log)
        try:
            assert wait_until(lambda: health(drained) == 200, 180, period=0.5)
            with serve_router([drained], free_port(), "--poll-interval", "0.2") as router, \
                    ThreadPoolExecutor(3) as pool:
                assert wait_until(lambda: len(ready_workers(router)) == 1, 10)
                body = {"model": MODEL, "prompt": "Tell me about rivers.", "max_tokens": 48,
                        "ignore_eos": True}
                futures = [pool.submit(httpx.post, f"{router}/v1/completions", json=body,
                                       timeout=180) for _ in range(3)]
                assert wait_until(lambda: metric(drained, names.NUM_RUNNING) >= 1, 30)
                os.killpg(proc.pid, signal.SIGTERM)
                answers = [f.result() for f in futures]
                assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
                assert [a.json()["usage"]["completion_tokens"] for a in answers] == [48] * 3
                assert ready_workers(router) == []
                assert metric(router, names.ROUTER_RETRIES) == 0
            assert proc.wait(60) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@slow
def test_sigkill_retries_unanswered_requests_ejects_and_readmits(worker_url, model_path,
                                                                 tmp_path):
    """SIGKILL one of two workers while it holds unanswered (plain) requests: each is
    retried once on the other worker and succeeds; the dead one is ejected, and re-admitted
    once a worker answers on its address again."""
    port = free_port()
    victim = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "w.log", "wb")
    proc = start_worker(model_path, port, log)
    try:
        assert wait_until(lambda: health(victim) == 200, 180, period=0.5)
        with serve_router([worker_url, victim], free_port(), "--policy", "round-robin",
                          "--poll-interval", "0.5") as router, ThreadPoolExecutor(6) as pool:
            assert wait_until(lambda: len(ready_workers(router)) == 2, 10)
            body = {"model": MODEL, "prompt": "Tell me about rivers.", "max_tokens": 64,
                    "ignore_eos": True}
            futures = [pool.submit(httpx.post, f"{router}/v1/completions", json=body,
                                   timeout=180) for _ in range(6)]
            assert wait_until(lambda: metric(victim, names.NUM_RUNNING) >= 1, 30)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            statuses = [f.result().status_code for f in futures]
            assert statuses == [200] * 6
            assert metric(router, names.ROUTER_RETRIES) >= 1
            assert wait_until(lambda: ready_workers(router) == [worker_url], 5)
            proc = start_worker(model_path, port, log)  # the same address answers again
            assert wait_until(lambda: victim in ready_workers(router), 180, period=0.5)
            with ThreadPoolExecutor(4) as pool2:
                list(pool2.map(lambda _: httpx.post(f"{router}/v1/completions", json={
                    **body, "max_tokens": 2}, timeout=120), range(4)))
            assert successes(victim) >= 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def paired_gap_difference(direct: list[float], proxied: list[float]) -> float:
    """Median of (proxied gap − direct gap) over tokens produced by the same engine step.

    Two streams decoding in one batch get a token per step each; the proxied stream may
    have joined the batch a step or two later, so its token i pairs with the direct
    stream's token i + k, k chosen to put the arrival times closest together.

    Args:
        direct, proxied: client-side arrival times (seconds) of each token event.
    """
    def offset(k: int) -> float:
        pairs = [(p, direct[i + k]) for i, p in enumerate(proxied) if 0 <= i + k < len(direct)]
        return statistics.median(abs(p - d) for p, d in pairs)

    k = min(range(-3, 4), key=offset)
    diffs = [(proxied[i] - proxied[i - 1]) - (direct[i + k] - direct[i + k - 1])
             for i in range(1, len(proxied)) if 1 <= i + k < len(direct)]
    return statistics.median(diffs)


def test_paired_gap_difference_aligns_steps():
    steps = [0.0, 0.05, 0.09, 0.2, 0.22, 0.3, 0.41, 0.45]
    direct = [t + 0.001 for t in steps]
    proxied = [t + 0.0015 for t in steps[1:]]  # joined one step later, 0.5 ms behind
    assert abs(paired_gap_difference(direct, proxied)) < 1e-9
    lagging = [t + 0.005 * i for i, t in enumerate(steps)]  # 5 ms more per token
    assert paired_gap_difference(direct, lagging) == pytest.approx(0.005)


@slow
def test_inter_token_gaps_through_the_router_match_direct(worker_url):
    """Two streams at once on the same worker (so both get their tokens from the same
    engine steps), one direct and one through the router: per step, the gap the client
    sees through the router is within 2 ms of the direct one (median over the steps)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64,
            "ignore_eos": True, "stream": True, "temperature": 0}

    def arrivals(url: str) -> list[float]:
        times = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
        return times

    port = free_port()
    with serve(["router", "--port", str(port), "--worker", worker_url], port) as router, \
            ThreadPoolExecutor(2) as pool:
        httpx.post(f"{router}/v1/completions", json={**body, "stream": False, "max_tokens": 1},
                   timeout=120)  # warm the router's connection
        direct, proxied = pool.submit(arrivals, worker_url), pool.submit(arrivals, router)
        direct, proxied = direct.result(), proxied.result()
    assert len(direct) == len(proxied) == 64
    gap = lambda ts: statistics.median(b - a for a, b in zip(ts, ts[1:]))  # noqa: E731
    difference = paired_gap_difference(direct, proxied)
    assert abs(difference) <= 0.002, (difference, gap(direct), gap(proxied))
