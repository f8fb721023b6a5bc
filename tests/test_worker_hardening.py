"""Issue 10, the worker's side: body limit, health that tells the truth about the engine
loop, chat streams that start at the first token, and a fuzz of the OpenAI request schema
and the routing headers against a real worker with a real router in front of it.

Faults are real where they can be: the dead engine is the real engine thread ended by an
exception raised in it (``PyThreadState_SetAsyncExc``: no request can kill the loop, which
catches every error of a step, an add or an abort); the stall is a real ``step`` held on an
event (injected: nothing a client sends wedges the loop).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port, serve
from sluice.api import metrics as names
from sluice.api.body import BodyTooLarge, read_body
from sluice.models import store
from sluice.worker.engine.outputs import RequestOutput
from sluice.worker.health import ENGINE_DEAD, ENGINE_STALLED, EngineWatch
from sluice.worker.server import Worker, WorkerServer, create_app

MODEL = store.DEFAULT_MODEL
MSGS = [{"role": "user", "content": "Name a color."}]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def wait_until(predicate, timeout: float, period: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


def sse_events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]


# --------------------------------------------------------------------------- fakes


class FakeTokenizer:
    """Characters are tokens (id = code point)."""

    eos_token = bos_token = pad_token = None
    chat_template = None

    def __len__(self) -> int:
        return 0x110000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return chr(token_id)

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(128)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class Stats:
    num_running = num_waiting = 0
    num_free_blocks = num_total_blocks = 10
    kv_cache_usage = 0.0
    prefix_cache_queries = prefix_cache_hits = spec_draft_tokens = spec_accepted_tokens = 0


class ScriptedEngine:
    """Emits ``texts`` one output each (the last finishes), or raises ``fail`` first."""

    tokenizer = FakeTokenizer()
    max_model_len = 64
    model_name = "fake"
    max_sequences_per_request = 16

    def __init__(self, texts: list[str], fail: Exception | None = None, alive: bool = True):
        self.texts, self.fail, self._alive = texts, fail, alive

    def alive(self) -> bool:
        return self._alive

    def check_request(self, prompt, params) -> None:
        pass

    async def generate(self, prompt, params, request_id, group=None) -> AsyncIterator:
        if self.fail is not None:
            raise self.fail
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1
            yield RequestOutput(request_id, [ord(text[0])], text, len(prompt), i + 1,
                                finished=last, finish_reason="length" if last else None)

    def stats(self) -> Stats:
        return Stats()

    def shutdown(self) -> None:
        pass


def fake_app(engine, **worker_args):
    worker = Worker(lambda: engine, "fake", **worker_args)
    worker.start_loading().join()
    return worker, create_app(worker)


def asgi(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


# --------------------------------------------------------------------------- item 3: body size


def test_read_body_stops_reading_past_the_limit():
    """The shared reader (router and worker) gives up at the first chunk past the limit."""
    class Request:
        def __init__(self, headers: dict[str, str]):
            self.headers, self.read = headers, 0

        async def stream(self):
            for _ in range(100):
                self.read += 1
                yield b"x" * 1024

    request = Request({})
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(request, 10 * 1024))
    assert request.read == 11
    declared = Request({"content-length": str(10**9)})
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(declared, 10 * 1024))
    assert declared.read == 0  # refused on its Content-Length, nothing read
    assert asyncio.run(read_body(Request({}), 100 * 1024)) == b"x" * 100 * 1024


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_body_over_the_limit_is_413_with_an_openai_error(path):
    _, app = fake_app(ScriptedEngine(["a"]), max_body_bytes=1000)
    body = {"model": "fake", "prompt": "x" * 2000, "messages": MSGS}

    async def chunks():  # no Content-Length: found while reading
        raw = json.dumps(body).encode()
        for i in range(0, len(raw), 100):
            yield raw[i:i + 100]

    for content in (json.dumps(body).encode(), chunks()):
        r = asgi(app, "POST", path, content=content)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "--max-body-bytes" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close"
    small = {"model": "fake", "max_tokens": 1,
             **({"messages": MSGS} if "chat" in path else {"prompt": "hi"})}
    assert asgi(app, "POST", path, json=small).status_code == 200


def test_real_worker_refuses_a_declared_17_mib_body_before_reading_it(worker_url):
    """The default limit (16 MiB) on a real worker: only the headers are sent."""
    host, port = worker_url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {17 * 2**20}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    status, _, rest = answer.partition(b"\r\n")
    assert b" 413 " in status, answer
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"
    r = httpx.post(f"{worker_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200


def test_max_body_bytes_and_stall_timeout_flags():
    import argparse

    from sluice.worker.server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-body-bytes", "1000", "--engine-stall-timeout", "5"])
    assert args.max_body_bytes == 1000 and args.engine_stall_timeout == 5.0
    assert parser.parse_args([]).max_body_bytes == 16 * 2**20  # at most 16 MiB by default
    for bad in (["--max-body-bytes", "0"], ["--engine-stall-timeout", "-1"],
                ["--engine-stall-timeout", "nan"], ["--engine-stall-timeout", "inf"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


# --------------------------------------------------------------------------- item 6: the watch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watch_stalls_only_while_requests_are_open_and_silent():
    clock = Clock()
    watch = EngineWatch(stall_timeout_s=10, clock=clock)
    engine = ScriptedEngine([])
    clock.now += 1000  # idle for long: no work, no stall
    assert watch.problem(engine) is None
    watch.started()  # the stall clock starts with the work
    clock.now += 9
    assert watch.problem(engine) is None
    watch.progressed()
    clock.now += 9
    assert watch.problem(engine) is None
    clock.now += 2
    assert watch.problem(engine) == ENGINE_STALLED
    watch.progressed()
    assert watch.problem(engine) is None
    clock.now += 11
    watch.ended()
    assert watch.problem(engine) is None  # nothing open
    assert watch.problem(None) is None  # not loaded yet


def test_watch_counts_computed_tokens_as_progress():
    """A long prefill makes no output but computes tokens every step (when the engine
    reports ``num_computed_tokens`` in its stats)."""
    class Computing(ScriptedEngine):
        computed = 0

        def stats(self):
            stats = Stats()
            stats.num_computed_tokens = self.computed
            return stats

    clock, engine = Clock(), Computing([])
    watch = EngineWatch(stall_timeout_s=10, clock=clock)
    watch.started()
    for _ in range(5):
        clock.now += 8
        engine.computed += 512
        assert watch.problem(engine) is None
    clock.now += 11
    assert watch.problem(engine) == ENGINE_STALLED


def test_watch_fails_waiters_once_the_engine_is_dead():
    engine = ScriptedEngine([])
    watch = EngineWatch()

    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        watch.subscribe(queue)
        task = asyncio.create_task(watch.run(lambda: engine, interval=0.01))
        engine._alive = False
        item = await asyncio.wait_for(queue.get(), 30)
        task.cancel()
        return item

    assert "died" in str(asyncio.run(go()))
    assert watch.problem(engine) == ENGINE_DEAD


def test_dead_engine_health_livez_and_requests_are_503_with_the_reason():
    worker, app = fake_app(ScriptedEngine(["a"], alive=False))
    r = asgi(app, "GET", "/health")
    assert (r.status_code, r.json()) == (503, {"status": ENGINE_DEAD})
    r = asgi(app, "GET", "/livez")
    assert (r.status_code, r.json()) == (503, {"status": ENGINE_DEAD})
    worker.draining = True  # dead wins over draining: the router must eject it
    assert asgi(app, "GET", "/health").json() == {"status": ENGINE_DEAD}
    r = asgi(app, "POST", "/v1/chat/completions", json={"messages": MSGS, "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == ENGINE_DEAD


def test_livez_is_200_while_loading_and_draining_and_health_keeps_draining():
    worker = Worker(lambda: ScriptedEngine(["a"]), "fake")  # not loaded yet
    app = create_app(worker)
    assert asgi(app, "GET", "/livez").status_code == 200
    assert asgi(app, "GET", "/health").json() == {"status": "loading"}
    worker.start_loading().join()
    worker.draining = True
    assert asgi(app, "GET", "/livez").json() == {"status": "alive"}
    r = asgi(app, "GET", "/health")
    assert (r.status_code, r.json()) == (503, {"status": "draining"})


# --------------------------------------------------------------------------- item 7: first bytes


def test_chat_stream_sends_the_role_with_the_first_token_bytes_as_before():
    _, app = fake_app(ScriptedEngine(["Re", "d."]))
    r = asgi(app, "POST", "/v1/chat/completions", json={"messages": MSGS, "stream": True,
                                                         "n": 2})
    events = sse_events(r.content)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    # vLLM's layout: the role of every choice at the first output, then the deltas
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    assert "role" not in chunks[2]["choices"][0]["delta"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                   if c["choices"][0]["index"] == 0) == "Red."


@pytest.mark.parametrize("fail,status,code", [
    (RuntimeError("engine failed: CUDA error"), 500, "engine_error"),
])
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSGS})])
def test_failure_before_the_first_token_is_an_http_error_not_a_200_stream(path, body, fail,
                                                                          status, code):
    _, app = fake_app(ScriptedEngine([], fail=fail))
    r = asgi(app, "POST", path, json={**body, "stream": True})
    assert r.status_code == status and r.json()["error"]["code"] == code


def test_chat_stream_first_byte_comes_after_the_first_token(worker_url):
    """With a long prompt (prefill takes a while), the first byte of a chat stream —
    headers included — reaches the client only after the worker measured its first token:
    client time to first byte >= the worker's TTFT of that request (both from before the
    request's arrival, so this holds whatever the machine's load)."""
    prompt = " ".join(f"item {i}," for i in range(40))  # ~250 tokens: a prefill of some ms
    ttft_sum, ttft_count = metric(worker_url, names.TTFT + "_sum"), \
        metric(worker_url, names.TTFT + "_count")
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client:
        sent = time.monotonic()
        with client.stream("POST", f"{worker_url}/v1/chat/completions", json=body) as r:
            raw = r.iter_raw()
            first = next(raw)
            first_byte = time.monotonic() - sent
            rest = b"".join(raw)
    assert metric(worker_url, names.TTFT + "_count") == ttft_count + 1
    worker_ttft = metric(worker_url, names.TTFT + "_sum") - ttft_sum
    assert first_byte >= worker_ttft > 0, (first_byte, worker_ttft)
    events = sse_events(first + rest)
    assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(events[1])["choices"][0]["delta"].get("content") is not None
    assert events[-1] == "[DONE]"


# --------------------------------------------------------------------------- item 6: real engine


@contextmanager
def in_process_worker(model_path):
    """A real worker (real engine, real uvicorn on a port) in this process, so that its
    engine thread can be reached."""
    from sluice.worker.engine.async_engine import AsyncEngine
    from sluice.worker.engine.config import EngineConfig

    config = EngineConfig(model=str(model_path), served_model_name=MODEL)
    worker = Worker(lambda: AsyncEngine(config), MODEL)
    port = free_port()
    server = WorkerServer(uvicorn.Config(create_app(worker), host="127.0.0.1", port=port,
                                         log_level="warning"), worker)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        assert wait_until(healthy, 180, 0.2), "the in-process worker never became healthy"
        yield url, worker
    finally:
        server.should_exit = True
        thread.join(30)


def _blocked_in_wait(thread: threading.Thread) -> bool:
    """The engine thread sits in ``Event.wait`` (idle, between steps)."""
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code.co_name == "wait" \
        and frame.f_code.co_filename == threading.__file__


def _kill(thread: threading.Thread) -> None:
    """Raise SystemExit in ``thread`` at its next Python instruction."""
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                      ctypes.py_object(SystemExit))
    assert done == 1


def _stream(url: str, body: dict, timeout: float = 120) -> tuple[int, list[str]]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=timeout,
                      json={"model": MODEL, **body, "stream": True}) as r:
        return r.status_code, sse_events(r.read())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # _kill
def test_wedged_then_dead_engine_fails_health_and_the_router_goes_elsewhere(
        model_path, worker_url, tmp_path):
    """A real engine: its step held (stall) — /health and /livez 503 engine_stalled, new
    requests 503, the held stream finishes once released; then its thread killed — the
    request that woke it gets 503 engine_dead, /health and /livez say engine_dead, and a
    router in front of it and a healthy worker ejects it and answers every request."""
    with in_process_worker(model_path) as (url, worker):
        engine = worker.engine
        # ---- stall: hold the real step on an event
        gate = threading.Event()
        real_step = engine.engine.step

        def held_step():
            gate.wait()
            return real_step()

        engine.engine.step = held_step
        worker.watch.stall_timeout_s = 1.0
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(_stream, url, {"messages": MSGS, "max_tokens": 4})
            assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, 30)
            r = httpx.get(f"{url}/health")
            assert r.json() == {"status": ENGINE_STALLED}
            assert httpx.get(f"{url}/livez").json() == {"status": ENGINE_STALLED}
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == ENGINE_STALLED
            assert not held.done()
            gate.set()
            del engine.engine.step
            status, events = held.result(60)
        assert status == 200 and events[-1] == "[DONE]"
        assert not any('"error"' in e for e in events)
        worker.watch.stall_timeout_s = 120.0
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 10)

        # ---- dead: a router in front of it and of the healthy session worker
        router_port = free_port()
        args = ["router", "--port", str(router_port), "--worker", url, "--worker", worker_url]
        with serve(args, router_port, log=tmp_path / "router.log") as router:
            def ready() -> set[str]:
                return {w["url"] for w in httpx.get(f"{router}/health").json()["workers"]
                        if w["ready"]}
            assert wait_until(lambda: ready() == {url, worker_url}, 30)
            assert wait_until(lambda: _blocked_in_wait(engine._thread), 30)
            _kill(engine._thread)  # raised when a request wakes it
            r = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == ENGINE_DEAD
            assert not engine._thread.is_alive()
            assert httpx.get(f"{url}/health").json() == {"status": ENGINE_DEAD}
            assert httpx.get(f"{url}/livez").status_code == 503
            with ThreadPoolExecutor(4) as pool:  # some are sent to the dead one first
                results = list(pool.map(lambda _: _stream(router, {
                    "messages": MSGS, "max_tokens": 4, "temperature": 0}), range(4)))
            for status, events in results:
                assert status == 200 and events[-1] == "[DONE]", events
                assert not any('"error"' in e for e in events)
            assert wait_until(lambda: ready() == {worker_url}, 30)
