"""The router relays SSE byte for byte: real processes on 127.0.0.1 (the null worker of
bench/router.py as the upstream, ``sluice router`` in front of it), no mocks, no model.

Two upstream shapes: an answer that arrives whole (Content-Length; the relay sends it as
its body's last chunk, ``RelayResponse``'s ``ended``) and one event per HTTP chunk with
gaps (chunked, as a worker streams: the relay forwards each as it comes).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import router as bench_router  # noqa: E402  (bench/router.py)
from conftest import free_port, serve  # noqa: E402

from sluice.models.store import DEFAULT_MODEL  # noqa: E402

BODY = {"model": DEFAULT_MODEL, "prompt": "hello", "max_tokens": 8, "stream": True}


@contextlib.contextmanager
def null_and_router(tokens: int, gap_ms: float, tmp: Path, http: str = "sluice"):
    """(direct URL, router URL): a null worker streaming ``tokens`` events, and a router
    on the HTTP protocol ``http`` (``sluice router --http``)."""
    null_port = free_port()
    direct = f"http://127.0.0.1:{null_port}"
    null = bench_router.Proc([sys.executable, "bench/router.py", "--serve-null", str(null_port),
                              "--null-tokens", str(tokens), "--null-gap-ms", str(gap_ms)],
                             tmp / "null.log")
    try:
        null.ready(f"{direct}/health", timeout=60)
        router_port = free_port()
        with serve(["--log-level", "WARNING", "router", "--port", str(router_port),
                    "--worker", direct, "--http", http], router_port, timeout=60, log=tmp / "router.log") as routed:
            yield direct, routed
    finally:
        null.stop()


async def _streams(url: str, count: int) -> list[tuple[int, str, bytes]]:
    async with httpx.AsyncClient(timeout=30) as client:
        async def one() -> tuple[int, str, bytes]:
            async with client.stream("POST", f"{url}/v1/completions", json=BODY) as r:
                return r.status_code, r.headers["content-type"], b"".join(
                    [chunk async for chunk in r.aiter_raw()])
        return await asyncio.gather(*(one() for _ in range(count)))


@pytest.mark.parametrize("tokens, gap_ms", [(16, 0.0), (5, 20.0)])
def test_relayed_sse_is_byte_identical(tokens, gap_ms, tmp_path):
    """Whole answers (gap 0) and chunk-by-chunk streams (gap 20 ms), one at a time and 50
    at once: every relayed body equals the upstream's, byte for byte."""
    with null_and_router(tokens, gap_ms, tmp_path) as (direct, routed):
        (status, content_type, expected), = asyncio.run(_streams(direct, 1))
        assert status == 200 and content_type == "text/event-stream"
        assert expected.count(b"data: ") == tokens + 1 and expected.endswith(b"data: [DONE]\n\n")
        for count in (1, 50):
            for status, content_type, body in asyncio.run(_streams(routed, count)):
                assert (status, content_type) == (200, "text/event-stream")
                assert body == expected
        metrics = httpx.get(f"{routed}/metrics", timeout=10).text
        assert f'sluice_router_requests_total{{model="{DEFAULT_MODEL}",status="200"}} 51.0' \
            in metrics
        assert "sluice_router_in_flight_requests 0.0" in metrics


def test_a_client_leaving_mid_stream_is_counted_499(tmp_path):
    """The client closes after its first event while the worker is still generating: the
    router counts a 499 (not a 200), and nothing stays in flight."""
    async def leave(url: str) -> bytes:
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{url}/v1/completions", json=BODY) as r:
                async for chunk in r.aiter_raw():
                    return chunk  # and close the connection
        raise AssertionError("no event came")

    with null_and_router(100, 50.0, tmp_path) as (_, routed):
        assert asyncio.run(leave(routed)).startswith(b"data: ")
        for _ in range(100):  # the router sees the connection go at its next event
            metrics = httpx.get(f"{routed}/metrics", timeout=10).text
            if "sluice_router_in_flight_requests 0.0" in metrics:
                break
            time.sleep(0.05)
        assert f'sluice_router_requests_total{{model="{DEFAULT_MODEL}",status="499"}} 1.0' \
            in metrics
        assert 'status="200"' not in metrics
        assert "sluice_router_in_flight_requests 0.0" in metrics


def test_a_first_byte_wait_given_up_before_it_starts_leaves_no_coroutine_unawaited():
    """The client left before the first-byte wait began (the helper's reproduction: 300
    clients leaving a slow worker's queue logged "coroutine 'first_byte' was never awaited"):
    the wait is closed unstarted, and Python warns of nothing."""
    import gc
    import warnings

    from starlette.requests import Request

    from sluice.router.relay import ClientDisconnected, _DisconnectWatch, unless_disconnected

    started = []

    async def first_byte():
        started.append(True)

    async def go():
        async def receive():
            return {"type": "http.disconnect"}
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []},
                          receive)
        _DisconnectWatch.of(request.scope, request.receive)
        await asyncio.sleep(0)  # the watcher sees the client gone
        with pytest.raises(ClientDisconnected):
            await unless_disconnected(request, first_byte())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(go())
        gc.collect()
    assert not started
    assert not [w for w in caught if "never awaited" in str(w.message)], caught


def test_a_relay_the_client_left_before_it_began_still_releases_its_answer():
    """The client left before its stream's first send: the source never starts, so its own
    ``finally`` never runs; ``on_close`` still releases the upstream answer and the
    exchange, once."""
    from sluice.router.relay import RelayResponse, _DisconnectWatch

    started, closed, sent = [], [], []

    async def source():
        started.append(True)
        yield b"data: x\n\n"

    async def go():
        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
        _DisconnectWatch.of(scope, receive)
        await asyncio.sleep(0)  # the watcher sees the client gone
        response = RelayResponse(source(), 200, {}, on_close=lambda: closed.append(True))
        await response(scope, receive, send)

    asyncio.run(go())
    assert (started, sent, closed) == ([], [], [True])


def test_the_headers_a_connection_header_names_are_not_forwarded():
    """Hop-by-hop headers stay at the router, and so do the ones the client's Connection
    header lists (RFC 9110 §7.6.1); a repeated header goes on with its last value, the one
    routing reads too; the router's API key stays with an API key file."""
    from sluice.router.app import ProxyRequest
    from sluice.router.proxy import forward_headers

    raw = [(b"host", b"r:8000"), (b"connection", b"keep-alive, X-Trace, x-Other"),
           (b"x-trace", b"1"), (b"x-other", b"2"), (b"x-slo-ttft-ms", b"100"),
           (b"x-slo-ttft-ms", b"200"), (b"authorization", b"Bearer k"),
           (b"content-type", b"application/json"), (b"content-length", b"2"),
           (b"te", b"trailers"), (b"keep-alive", b"timeout=5")]
    request = ProxyRequest({"type": "http", "method": "POST", "path": "/", "headers": raw})
    assert forward_headers(request, None) == {
        "x-slo-ttft-ms": "200", "authorization": "Bearer k",
        "content-type": "application/json", "accept-encoding": "identity"}
    assert "authorization" not in forward_headers(request, keys=object())
    plain = ProxyRequest({"type": "http", "method": "POST", "path": "/",
                          "headers": [(b"connection", b"keep-alive"), (b"x-trace", b"1")]})
    assert forward_headers(plain, None) == {"x-trace": "1", "accept-encoding": "identity"}


@pytest.mark.parametrize("http", ["sluice", "httptools"])
def test_http_picks_the_protocol_only_the_routers_own_keeps_an_upgrade_requests_body(
        http, tmp_path):
    """``curl --http2 -d ...`` on an http:// URL asks to upgrade to h2c. Under ``--http
    sluice`` (the default) the request is answered over HTTP/1.1 with its body, then the
    connection closes; under ``--http httptools`` (uvicorn's protocol) the app gets an empty
    body and answers 400. Over a raw socket, as curl sends it."""
    import json
    import socket

    body = json.dumps({**BODY, "stream": False}).encode()
    with null_and_router(4, 0.0, tmp_path, http) as (_, routed):
        port = int(routed.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                         b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
                         b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
                         b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            answer = b""
            while chunk := sock.recv(65536):  # the router closes after an upgrade request
                answer += chunk
        head, _, rest = answer.partition(b"\r\n\r\n")
        if http == "sluice":
            assert head.startswith(b"HTTP/1.1 200 ")
            assert b"connection: close" in head.lower()
            assert json.loads(rest)["choices"][0]["text"] == " x" * 4
        else:
            assert head.startswith(b"HTTP/1.1 400 ")
            assert json.loads(rest)["error"]["message"].startswith(
                "the request body is not valid JSON")


def test_header_fields_past_the_bound_are_431_and_the_worker_stays_in(tmp_path):
    """A request with 70 KB of header fields is answered 431 at the router, in OpenAI's
    error shape, not forwarded: the null worker (64 KB lines at most) would reset it and be
    ejected, its other clients answered 503 meanwhile. The next request is served."""
    with null_and_router(4, 0.0, tmp_path) as (_, routed):
        big = httpx.post(f"{routed}/v1/completions", json=BODY, timeout=30,
                         headers={"x-padding": "a" * 70_000})
        assert big.status_code == 431
        assert big.json()["error"]["code"] == "request_header_fields_too_large"
        small = httpx.post(f"{routed}/v1/completions", json=BODY, timeout=30,
                           headers={"x-padding": "a" * 30_000})
        assert small.status_code == 200 and small.text.endswith("data: [DONE]\n\n")
        metrics = httpx.get(f"{routed}/metrics", timeout=10).text
        assert 'sluice_router_requests_total{model="",status="431"} 1.0' in metrics
        assert "sluice_router_ejections_total{" not in metrics
