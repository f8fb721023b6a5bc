"""The router: pure policy and bookkeeping first, then real worker processes behind a real
router process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import free_port, http_stub, serve
from test_worker_api import abort_deadline
from sluice.api import metrics as names
from sluice.models import store
from sluice.router.endpoints import BOOT_GRACE_S, Endpoint, EndpointSet, Lease
from sluice.router.policy import LeastLoadPolicy, RoutingRequest, least_load, make_policy
from sluice.router.upstream import Upstream

MODEL = store.DEFAULT_MODEL
slow = pytest.mark.slow  # starts model-loading processes


# ------------------------------------------------------------------ pure: policy, bookkeeping

def test_least_load_picks_the_minimum():
    assert least_load([3, 1, 2]) == 1
    assert least_load([0]) == 0


def test_least_load_ties_rotate_from_start():
    assert least_load([2, 1, 0, 0], start=3) == 3
    assert least_load([2, 1, 0, 0], start=0) == 2
    assert least_load([0, 0, 0], start=4) == 1  # start is taken modulo len


def test_least_load_rejects_empty():
    with pytest.raises(ValueError):
        least_load([])


def test_make_policy():
    assert isinstance(make_policy("least-load"), LeastLoadPolicy)
    with pytest.raises(ValueError, match="least-load"):
        make_policy("nope")


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_idle_fleet_gets_round_robin():
    policy = LeastLoadPolicy()
    eps = [Endpoint(f"http://w{i}") for i in range(3)]
    picks = [run(policy.choose(eps, RoutingRequest(MODEL))).url for _ in range(6)]
    assert picks == ["http://w0", "http://w1", "http://w2"] * 2


def test_concurrent_choices_spread_with_leases():
    """Choosing and leasing back to back (as the router does) never piles onto one worker."""
    policy = LeastLoadPolicy()
    eps = [Endpoint("http://a"), Endpoint("http://b")]
    leases = [Lease(run(policy.choose(eps, RoutingRequest(MODEL))), 0.0, 0.0) for _ in range(10)]
    assert [e.in_flight for e in eps] == [5, 5]
    eps[0].in_flight += 3  # a busier worker is avoided
    assert run(policy.choose(eps, RoutingRequest(MODEL))).url == "http://b"
    eps[0].in_flight -= 3
    for lease in leases:
        assert lease.release(0.0) is True
        assert lease.release(0.0) is False  # idempotent
    assert [e.in_flight for e in eps] == [0, 0]


@contextlib.asynccontextmanager
async def fake_workers(table: dict[str, tuple[int, list[str]] | None]):
    """Real HTTP servers on 127.0.0.1 that answer /health and /v1/models as ``table`` says
    (read at each request); a name mapped to None is a port nobody listens on. Yields the
    name → URL map and the router's client. (For the poller's bookkeeping only; the proxy
    is tested against real workers below.)"""

    def answer(name: str):
        def reply(path: str) -> tuple[int, object]:
            status, models = table[name]
            if path == "/health":
                return status, None
            return 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]}
        return reply

    async with contextlib.AsyncExitStack() as stack:
        urls = {name: f"http://127.0.0.1:{free_port()}" if entry is None
                else await stack.enter_async_context(http_stub(answer(name)))
                for name, entry in table.items()}
        client = Upstream(1.0, 2.0, 4.0)
        try:
            yield urls, client
        finally:
            await client.close()


def test_poll_learns_readiness_models_and_backs_off(caplog):
    table = {"a": (200, [MODEL]), "b": (503, [MODEL]), "c": None}

    async def scenario():
        async with fake_workers(table) as (url, client):
            a, b, c = url["a"], url["b"], url["c"]
            endpoints = EndpointSet([c + "/", a, b, a + "/"])
            assert [e.url for e in endpoints] == sorted([a, b, c])
            assert endpoints.serves(MODEL) is False and not endpoints.any_models_known()
            await endpoints.poll(client)
            assert [e.url for e in endpoints.ready_for(MODEL)] == [a]
            assert endpoints.serves(MODEL) and not endpoints.serves("other")
            assert [m["id"] for m in endpoints.model_entries()] == [MODEL]
            c_ = next(e for e in endpoints if e.url == c)  # booting: never ready since
            assert c_.failures == 0 and c_.booting(time.monotonic())  # listed, so not
            assert c_.next_poll <= time.monotonic()                  # backed off
            assert "unreachable" not in caplog.text  # starting is not failing
            c_.listed_at -= BOOT_GRACE_S  # past its boot grace: an unreachable worker
            await endpoints.poll(client)
            assert c_.failures == 1 and c_.next_poll > time.monotonic()
            assert caplog.text.count(f"worker {c} unreachable: ConnectFailed") == 1
            table["b"] = (200, [MODEL, "other"])
            await endpoints.poll(client)  # c is not due: backed off
            assert c_.failures == 1
            assert [e.url for e in endpoints.ready_for(MODEL)] == sorted([a, b])
            assert [m["id"] for m in endpoints.model_entries()] == [MODEL, "other"]
            endpoints.mark_down(next(e for e in endpoints if e.url == a), "test")
            assert [e.url for e in endpoints.ready_for(MODEL)] == [b]
            await endpoints.poll(client)  # a poll brings it back
            assert len(endpoints.ready_for(MODEL)) == 2

    run(scenario())


def test_a_worker_with_malformed_answers_neither_stops_the_poll_nor_its_round(caplog):
    """A break-it pass: a /metrics sample that is not a number, or a /v1/models nested past
    the recursion limit, raised out of the poll (the router exited at startup; later, that
    worker's state froze and the round skipped its admission re-check)."""
    bad_answers = {"/health": (200, None), "/v1/models": (200, b"[" * 200_000),
                   "/metrics": (200, b"vllm:num_requests_running abc\nvllm:num_requests_running 2\n")}
    rounds = []

    async def scenario():
        async with http_stub(lambda path: bad_answers[path]) as bad, \
                fake_workers({"a": (200, [MODEL])}) as (url, client):
            endpoints = EndpointSet([url["a"], bad])
            endpoints.on_polled = lambda: rounds.append(1)
            await endpoints.poll(client)
            assert [e.url for e in endpoints.ready_for(MODEL)] == [url["a"]] and rounds == [1]
            worker = next(e for e in endpoints if e.url == bad)
            assert worker.ready and not worker.models_known  # its /v1/models was refused
            assert worker.reported.running == 2  # the sample that is a number counts
            assert f"worker {bad} sent a malformed /v1/models answer" in caplog.text
            assert "endpoint poll failed" not in caplog.text

    run(scenario())


def test_a_worker_slow_to_answer_its_poll_does_not_hold_up_the_round():
    """A worker whose /health hangs is polled in the background: the round ends after the
    poll interval, not the poll timeout, and that poll is not started again meanwhile."""
    asked = []

    async def hang(reader, writer):
        asked.append(await reader.readuntil(b"\r\n\r\n"))
        await asyncio.sleep(3600)

    async def scenario():
        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        slow = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with fake_workers({"a": (200, [MODEL])}) as (url, client):
            endpoints = EndpointSet([url["a"], slow], poll_interval=0.3, poll_timeout=30.0)
            for _ in range(2):
                started = time.monotonic()
                await endpoints.poll(client)
                assert time.monotonic() - started < 2.0
            assert [e.url for e in endpoints.ready_for(MODEL)] == [url["a"]]
            assert len(asked) == 1  # still under way: not asked again
            endpoints.stop_polls()
            await asyncio.sleep(0)
        server.close()

    run(scenario())


def test_a_booting_worker_that_answers_but_not_as_a_worker_is_logged_once(caplog):
    """Something listens there but does not speak HTTP: while it boots the poller says why,
    once; a refused connection (a worker still starting) is not logged."""
    async def garbage(reader, writer):
        writer.write(b"garbage\r\n\r\n")
        writer.close()

    async def scenario():
        server = await asyncio.start_server(garbage, "127.0.0.1", 0)
        odd = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        refusing = f"http://127.0.0.1:{free_port()}"
        endpoints = EndpointSet([odd, refusing])
        client = Upstream(1.0, 2.0, 4.0)
        for _ in range(3):
            await endpoints.poll(client)
        await client.close()
        server.close()
        return odd, refusing

    odd, refusing = run(scenario())
    lines = [r.getMessage() for r in caplog.records if "not ready yet" in r.getMessage()]
    assert lines == [f"worker {odd} not ready yet: BadResponse: {odd} sent a malformed answer: "
                     "Expected HTTP/, RTSP/ or ICE/"]  # (llhttp's words)
    assert refusing not in caplog.text


# ------------------------------------------------------------------ real workers behind a router

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
              "temperature": 0}
LONG = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 2000,
        "ignore_eos": True, "temperature": 1.0}


def metric(url: str, name: str, text: str | None = None) -> float:
    """Sum of every sample of ``name`` (all label sets) in ``url``'s /metrics (or in
    ``text``, a scrape of it already taken)."""
    if text is None:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def successes(url: str) -> float:
    return metric(url, names.REQUEST_SUCCESS)


def wait_until(predicate, timeout: float, period: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


def idle(urls: list[str]) -> bool:
    return all(metric(u, names.NUM_RUNNING) == 0 and metric(u, names.KV_CACHE_USAGE) == 0
               and metric(u, names.QUEUED_PREFILL_TOKENS) == 0 for u in urls)


def ready_workers(router_url: str) -> list[str]:
    return [w["url"] for w in httpx.get(f"{router_url}/health", timeout=5).json()["workers"]
            if w["ready"]]


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def serve_router(worker_urls: list[str], port: int, *extra: str):
    """A router process; unlike ``serve`` it does not need a ready worker to be 'up'."""

    @contextlib.contextmanager
    def running():
        args = [sys.executable, "-m", "sluice.cli", "router", "--port", str(port), *extra]
        for u in worker_urls:
            args += ["--worker", u]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            def answers():
                try:
                    return httpx.get(f"{url}/health", timeout=1).status_code in (200, 503)
                except httpx.HTTPError:
                    return False
            assert wait_until(answers, 30, period=0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)

    return running()


@pytest.fixture(scope="module")
def second_worker(model_path, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("worker2") / "worker.log"
    with serve(["worker", "--model", str(model_path), "--served-model-name", MODEL,
                "--port", str(port)], port, log=log) as url:
        yield url


@pytest.fixture(scope="module")
def workers(worker_url, second_worker) -> list[str]:
    return [worker_url, second_worker]


@pytest.fixture(scope="module")
def dead_worker() -> str:
    return dead_url()


@pytest.fixture(scope="module")
def router(workers, dead_worker, tmp_path_factory):
    """A router process in front of the two real workers and one URL where nothing listens."""
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    args = ["router", "--port", str(port), "--worker", dead_worker]
    for url in workers:
        args += ["--worker", url]
    with serve(args, port, log=log) as url:
        assert wait_until(lambda: set(ready_workers(url)) == set(workers), 10)
        yield url


@slow
def test_non_streamed_chat_and_completion(router):
    chat = httpx.post(f"{router}/v1/chat/completions", json=CHAT, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    assert chat.headers["content-type"].startswith("application/json")
    completion = httpx.post(f"{router}/v1/completions", json=COMPLETION, timeout=60)
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"]
    assert completion.json()["usage"]["completion_tokens"] > 0


@slow
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", COMPLETION)])
def test_streamed_through_the_router(router, path, body):
    with httpx.stream("POST", f"{router}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert {"x-sluice-num-running", "x-sluice-num-waiting", "x-sluice-kv-cache-usage",
                "x-sluice-queued-prefill-tokens"} <= set(r.headers)  # the worker's, relayed
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) > 3
    for event in events[:-1]:
        json.loads(event[len("data: "):])


def normalized(raw: bytes) -> bytes:
    """SSE bytes without what differs per request (ids and timestamps)."""
    raw = re.sub(rb'"id": ?"[^"]*"', b'"id":""', raw)
    return re.sub(rb'"created": ?\d+', b'"created":0', raw)


@slow
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("usage", [False, True])
def test_stream_bytes_identical_to_direct(router, workers, path, body, usage):
    body = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}

    def raw_stream(base: str) -> bytes:
        with httpx.stream("POST", f"{base}{path}", json=body, timeout=60) as r:
            assert r.status_code == 200
            return b"".join(r.iter_raw())

    direct = raw_stream(workers[0])
    proxied = raw_stream(router)
    assert direct.count(b"data: ") > 3
    assert (b'"prompt_tokens"' in direct) == usage
    assert normalized(proxied) == normalized(direct)


@slow
@pytest.mark.parametrize("model", ["no-such-model", "", " " + MODEL, MODEL + " ", "smollm2"])
def test_unknown_model_is_404_without_contacting_a_worker(router, workers, model):
    before = [successes(u) for u in workers] + [metric(u, names.PROMPT_TOKENS) for u in workers]
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        r = httpx.post(f"{router}{path}", json={**body, "model": model}, timeout=10)
        assert r.status_code == 404
        assert r.json() == {"error": {
            "message": f"The model `{model}` does not exist.", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}}
    after = [successes(u) for u in workers] + [metric(u, names.PROMPT_TOKENS) for u in workers]
    assert after == before


@slow
def test_unknown_routes_and_methods_get_openai_errors(router):
    r = httpx.get(f"{router}/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"error": {"message": "Method Not Allowed", "type": "invalid_request_error",
                                  "param": None, "code": None}}
    for path in ("/v1/embeddings", "/v1/foo"):
        r = httpx.post(f"{router}{path}", json={}, timeout=10)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "Not Found"


@slow
def test_malformed_requests_are_400(router):
    for content in (b"{not json", b"[1, 2]", json.dumps({"prompt": "x"}).encode(),
                    json.dumps({"model": 7}).encode(), b"[" * 100_000 + b"]" * 100_000,
                    b'{"model": "m", "x": ' + b"9" * 5000 + b"}"):  # past int()'s 4,300 digits
        r = httpx.post(f"{router}/v1/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, content
        assert r.json()["error"]["type"] == "invalid_request_error"


@slow
def test_worker_errors_pass_through_and_are_no_demand(router):
    """A request the worker refuses as invalid is counted as such in the router's demand
    snapshot, which the autoscaler's ``observe`` takes off the arrivals: a stream of
    malformed requests does not scale a service up."""
    def demand() -> dict:
        entry = httpx.get(f"{router}/autoscale/demand", timeout=10).json()["models"].get(MODEL, {})
        return {"arrivals": entry.get("arrivals", 0), "invalid": entry.get("invalid", 0)}

    before = demand()
    r = httpx.post(f"{router}/v1/completions", json={**COMPLETION, "max_tokens": -5}, timeout=10)
    assert r.status_code == 400 and "error" in r.json()
    after = demand()
    assert (after["arrivals"] - before["arrivals"], after["invalid"] - before["invalid"]) == (1, 1)


@slow
def test_models_is_the_union_of_workers_models(router):
    data = httpx.get(f"{router}/v1/models", timeout=10).json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [MODEL]


@slow
def test_dead_worker_is_not_ready_and_traffic_flows(router, dead_worker):
    assert dead_worker not in ready_workers(router)
    for _ in range(2):
        assert httpx.post(f"{router}/v1/completions", json=COMPLETION, timeout=60).status_code == 200


@slow
def test_least_load_spreads_concurrent_requests(workers):
    """(The default policy, slo, would pack these identical prompts where their prefix is
    cached while the TTFT objective holds.)"""
    before = [successes(u) for u in workers]
    body = {**COMPLETION, "max_tokens": 8, "ignore_eos": True}
    with serve_router(workers, free_port(), "--policy", "least-load") as router, \
            ThreadPoolExecutor(6) as pool:
        assert wait_until(lambda: set(ready_workers(router)) == set(workers), 10)
        statuses = list(pool.map(
            lambda _: httpx.post(f"{router}/v1/completions", json=body, timeout=120).status_code,
            range(6)))
    assert statuses == [200] * 6
    served = [successes(u) - b for u, b in zip(workers, before)]
    assert sum(served) == 6
    assert min(served) >= 2, served  # least-load with in-flight counts: about 3 and 3


@slow
def test_router_metrics(router):
    httpx.post(f"{router}/v1/completions", json={**COMPLETION, "stream": True}, timeout=60)
    httpx.post(f"{router}/v1/completions", json={**COMPLETION, "model": "nope"}, timeout=60)
    text = httpx.get(f"{router}/metrics", timeout=10).text
    assert f'{names.ROUTER_REQUESTS}{{model="{MODEL}",status="200"}}' in text
    assert f'{names.ROUTER_REQUESTS}{{model="",status="404"}}' in text
    assert metric(router, names.ROUTER_TTFT + "_count") >= 1
    assert metric(router, names.ROUTER_ITL + "_count") >= 1
    assert metric(router, names.ROUTER_E2E + "_count") >= 1
    assert metric(router, names.ROUTER_IN_FLIGHT) == 0


@slow
def test_client_leaving_a_stream_stops_the_worker(router, workers):
    assert idle(workers)
    deadline = abort_deadline(workers[0])  # a few decode steps, measured (load stretches them)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{router}/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            start = time.monotonic()
            received = b""
            # held in a name: a `for` over r.iter_raw() left early drops the generator, and
            # closing it closes the connection, so the client would already have left (and
            # the worker aborted) by the scrape below: most runs won that race, some CI runs not
            chunks = r.iter_raw()
            for chunk in chunks:  # 0.5 s in, and tokens flowing (not just a role chunk)
                received += chunk
                if time.monotonic() - start > 0.5 and received.count(b"data: ") >= 3:
                    break
            else:
                pytest.fail(f"the stream ended early: {received[-2000:]!r}")
            assert b"[DONE]" not in received and b'"error"' not in received, received
            # one scrape per worker: the running request's blocks show in the same snapshot
            load = [(metric(u, names.NUM_RUNNING, text), metric(u, names.KV_CACHE_USAGE, text))
                    for u, text in ((u, httpx.get(f"{u}/metrics", timeout=5).text)
                                    for u in workers)]
            assert sorted(running for running, _ in load) == [0, 1], load
            assert all((usage > 0) == (running == 1) for running, usage in load), load
            chunks.close()  # the client leaves
    assert wait_until(lambda: idle(workers), deadline)
    assert wait_until(lambda: metric(router, names.ROUTER_IN_FLIGHT) == 0, deadline)


@slow
def test_client_leaving_a_plain_request_stops_the_worker(router, workers):
    assert idle(workers)
    deadline = abort_deadline(workers[0])
    host, port = router.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        assert wait_until(lambda: sum(metric(u, names.NUM_RUNNING) for u in workers) == 1, 5)
        time.sleep(0.5)
        assert sum(metric(u, names.NUM_RUNNING) for u in workers) == 1  # still generating
    assert wait_until(lambda: idle(workers), deadline)
    assert wait_until(lambda: metric(router, names.ROUTER_IN_FLIGHT) == 0, deadline)


def test_only_dead_workers_fail_fast():
    port = free_port()
    with serve_router([dead_url(), dead_url()], port) as url:
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30)
        assert r.status_code in (502, 503)
        assert r.json()["error"]["type"] == "server_error"
        assert time.monotonic() - start < 5


@slow
def test_loading_worker_gets_no_traffic_then_joins_and_its_death_is_survived(
        worker_url, model_path, tmp_path):
    """A worker that is still loading (/health 503) is skipped; once ready it gets traffic;
    stopped, its requests go to the other worker (503s while it drains and connection
    errors after it exits are retried elsewhere). Round-robin, so requests do go to the
    stopping worker (slo routing may keep them on the faster one)."""
    port = free_port()
    new = f"http://127.0.0.1:{port}"
    with serve_router([worker_url, new], free_port(), "--policy", "round-robin") as router_url:
        log = open(tmp_path / "worker.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "worker", "--model",
                                 str(model_path), "--served-model-name", MODEL, "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            sent_while_loading = 0
            deadline = time.monotonic() + 120
            while health(new) != 200:
                assert proc.poll() is None and time.monotonic() < deadline
                before = health(new)
                r = httpx.post(f"{router_url}/v1/completions",
                               json={**COMPLETION, "max_tokens": 1}, timeout=60)
                assert r.status_code == 200, r.text
                sent_while_loading += before == 503 and health(new) == 503
            assert sent_while_loading >= 1
            assert wait_until(lambda: new in ready_workers(router_url), 5)
            body = {**COMPLETION, "max_tokens": 4, "ignore_eos": True}
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda _: httpx.post(f"{router_url}/v1/completions", json=body,
                                                   timeout=120), range(4)))
            assert successes(new) >= 1
            os.killpg(proc.pid, signal.SIGTERM)  # drains (503), then exits (refused)
            for _ in range(3):
                r = httpx.post(f"{router_url}/v1/completions", json={**COMPLETION, "max_tokens": 1},
                               timeout=60)
                assert r.status_code == 200, r.text
            assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
            assert httpx.post(f"{router_url}/v1/completions", json={**COMPLETION, "max_tokens": 1},
                              timeout=60).status_code == 200
            assert new not in ready_workers(router_url)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


@slow
def test_stream_from_a_killed_worker_ends_with_an_error_event(model_path, tmp_path):
    """SIGKILL a worker mid-stream: the client gets an error event and [DONE], not a silent cut."""
    worker_port, router_port = free_port(), free_port()
    worker = subprocess.Popen([sys.executable, "-m", "sluice.cli", "worker", "--model", str(model_path),
                               "--port", str(worker_port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    try:
        with serve(["router", "--worker", f"http://127.0.0.1:{worker_port}", "--port", str(router_port)],
                   router_port) as router:
            deadline = time.monotonic() + 120
            while httpx.get(f"{router}/health", timeout=5).status_code != 200:
                assert time.monotonic() < deadline, "worker never became ready"
                time.sleep(0.5)
            body = {"model": model_path.name, "prompt": "Once upon a time", "max_tokens": 2000,
                    "ignore_eos": True, "stream": True}
            events = []
            with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            worker.kill()
    finally:
        worker.kill()
        worker.wait()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "upstream_error"
