"""The router's HTTP/1.1 server protocol (sluice.router.http) under uvicorn's real server on
127.0.0.1, spoken to over raw sockets where the wire bytes matter (pipelining, 100-continue,
HTTP/1.0, malformed requests) and with httpx elsewhere."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from conftest import free_port

from sluice.router.http import MAX_HEAD_BYTES, MAX_HEADER_FIELDS, MAX_TARGET_BYTES, RouterHTTP
from sluice.router.relay import DISCONNECT_EXTENSION

EVENTS: list[str] = []  # what the app saw (disconnect callbacks), for the tests to read


async def app(scope, receive, send):
    """Routes: /early (401 before reading the body), /echo (the body back, content-length), /chunks (a body in 3 chunks, no
    length), /slow-body (headers, then the body 0.3 s later), /boom (raises before
    answering), /cut (raises mid-answer), /split (a header value with CRLF), /none (returns
    without answering), /wait-gone (waits for the client to leave: the extension),
    /bytes?n=N (N bytes in 64 KiB chunks, for a client that does not read)."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if path == "/early":  # answers before reading the body (as a 401 or a 413 does)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if path == "/echo":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body)),
                                (b"x-method", scope["method"].encode()),
                                (b"x-query", scope["query_string"])]})
        await send({"type": "http.response.body", "body": body})
    elif path == "/chunks":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one ", b"two ", b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/slow-body":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"4")]})
        await asyncio.sleep(0.3)
        await send({"type": "http.response.body", "body": b"late"})
    elif path == "/boom":
        raise ValueError("boom")
    elif path == "/cut":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"100")]})
        await send({"type": "http.response.body", "body": b"x" * 10, "more_body": True})
        raise ValueError("cut")
    elif path == "/split":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-evil", b"a\r\nset-cookie: pwned=1")]})
    elif path == "/none":
        return
    elif path == "/wait-gone":
        gone = asyncio.Event()
        scope["extensions"][DISCONNECT_EXTENSION](lambda: (EVENTS.append("gone"), gone.set()))
        await gone.wait()
    elif path == "/bytes":
        n = int(scope["query_string"].split(b"=")[1])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % n)]})
        sent = 0
        while sent < n:
            part = min(65536, n - sent)
            await send({"type": "http.response.body", "body": b"b" * part,
                        "more_body": sent + part < n})
            sent += part
            EVENTS.append(f"sent {sent}")


def start_server() -> tuple[uvicorn.Server, threading.Thread, tuple[str, int]]:
    """uvicorn's server with RouterHTTP on a free port, in a thread."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=RouterHTTP,
                            log_level="warning", timeout_keep_alive=1)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return srv, thread, ("127.0.0.1", port)


@pytest.fixture(scope="module")
def server():
    """A server for the module; yields (host, port)."""
    srv, thread, address = start_server()
    yield address
    srv.should_exit = True
    thread.join(10)


def raw(server, data: bytes, wait: float = 1.0) -> bytes:
    """Send ``data`` on a new connection; everything read until the server closes it or
    ``wait`` seconds pass with nothing more."""
    with socket.create_connection(server) as sock:
        sock.sendall(data)
        sock.settimeout(wait)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def test_a_body_is_echoed_with_its_length_and_the_query_string(server):
    host, port = server
    r = httpx.post(f"http://{host}:{port}/echo?a=1&b=%20", content=b"hello")
    assert (r.status_code, r.content) == (200, b"hello")
    assert r.headers["content-length"] == "5"
    assert r.headers["x-method"] == "POST" and r.headers["x-query"] == "a=1&b=%20"
    assert r.headers["server"] == "uvicorn" and "date" in r.headers


def test_an_answer_without_a_length_is_chunked(server):
    out = raw(server, b"GET /chunks HTTP/1.1\r\nhost: x\r\n\r\n", wait=0.3)
    head, _, body = out.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    assert body == b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n"


def test_http_1_0_gets_a_close_delimited_body_and_the_connection_closes(server):
    out = raw(server, b"GET /chunks HTTP/1.0\r\n\r\n")
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"transfer-encoding" not in head and b"connection: close" in head
    assert body == b"one two three"  # (raw() returned: the server closed the connection)


def test_pipelined_requests_are_answered_in_order_on_one_connection(server):
    out = raw(server, b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nonePOST "
              b"/echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\ntwoGET /echo?q=3 "
              b"HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    answers = out.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert len(answers) == 3
    assert answers[0].endswith(b"\r\n\r\none") and answers[1].endswith(b"\r\n\r\ntwo")
    assert b"x-query: q=3" in answers[2] and b"connection: close" in answers[2]


def test_expect_100_continue_is_answered_before_the_body_is_sent(server):
    with socket.create_connection(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                     b"expect: 100-continue\r\n\r\n")
        sock.settimeout(2)
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"body")
        answer = sock.recv(1000)
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\nbody")


def test_a_chunked_request_body_is_delivered_whole(server):
    out = raw(server, b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
              b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", wait=0.3)
    assert b"\r\ncontent-length: 5\r\n" in out and out.endswith(b"\r\n\r\nabcde")


def test_a_head_request_gets_the_headers_and_no_body(server):
    out = raw(server, b"HEAD /echo HTTP/1.1\r\nhost: x\r\n\r\n", wait=0.3)
    assert out.startswith(b"HTTP/1.1 200 OK") and b"\r\ncontent-length: 0\r\n" in out
    assert out.endswith(b"\r\nx-query: \r\n\r\n")  # (and nothing after the headers)


def test_the_status_line_and_headers_are_not_held_back_for_a_late_body(server):
    with socket.create_connection(server) as sock:
        sock.sendall(b"GET /slow-body HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(0.25)
        head = sock.recv(1000)
        assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
        sock.settimeout(2)
        assert sock.recv(100) == b"late"


def test_an_upgrade_request_is_answered_over_http_1_1_with_its_body_then_closed(server):
    """``curl --http2`` on an http:// URL asks to upgrade to h2c; llhttp leaves the body to
    the new protocol (uvicorn's protocol gave the app an empty body). Here the body arrives
    in two packets, and bytes after it are dropped with the connection."""
    with socket.create_connection(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings"
                     b"\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
                     b"content-length: 11\r\n\r\nhello")
        time.sleep(0.1)
        sock.sendall(b" world" + b"GET /echo HTTP/1.1\r\n\r\n")
        sock.settimeout(2)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.count(b"HTTP/1.1") == 1
    assert b"\r\nconnection: close\r\n" in out and out.endswith(b"\r\n\r\nhello world")
    websocket = raw(server, b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\n"
                    b"upgrade: websocket\r\n\r\n")
    assert websocket.startswith(b"HTTP/1.1 200 OK\r\n") and websocket.endswith(b"\r\n\r\n")


def test_a_malformed_request_is_400_and_closed(server):
    out = raw(server, b"GARBAGE\x00 / HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"\r\nserver: uvicorn\r\n" in out and b"\r\ndate: " in out
    assert out.endswith(b"Invalid HTTP request received.")


def test_header_fields_past_the_bound_are_431_and_closed(server):
    big = b"x-big: " + b"a" * 8000 + b"\r\n"
    out = raw(server, b"GET /echo HTTP/1.1\r\nhost: x\r\n" + big * (MAX_HEAD_BYTES // 8000 + 2))
    assert out.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    many = raw(server, b"GET /echo HTTP/1.1\r\n" + b"a:\r\n" * (MAX_HEADER_FIELDS + 1) + b"\r\n")
    assert many.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    fine = raw(server, b"GET /echo HTTP/1.1\r\n" + b"a:\r\n" * (MAX_HEADER_FIELDS - 1) +
               b"connection: close\r\n\r\n")
    assert fine.startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_request_target_past_the_bound_is_414_and_closed(server):
    out = raw(server, b"GET /echo?" + b"q" * MAX_TARGET_BYTES + b" HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 414 ") and out.endswith(b"Request target too long.")


def test_a_fragment_in_the_request_target_is_not_part_of_the_path_or_query(server):
    out = raw(server, b"GET /echo?q=1#frag HTTP/1.1\r\nhost: x\r\n\r\n", wait=0.3)
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nx-query: q=1\r\n" in out


def test_a_body_still_arriving_after_its_answer_is_dropped_and_the_connection_goes_on(server):
    """An answer before the body was read (a 401, a 413): the rest of the body that arrives
    later is read and dropped, and the next request on the connection is answered (it was
    a parse error, a 400 and a closed connection)."""
    with socket.create_connection(server) as sock:
        sock.settimeout(2)
        for head, body in ((b"content-length: 10\r\n", b"0123456789"),
                           (b"transfer-encoding: chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n")):
            sock.sendall(b"POST /early HTTP/1.1\r\nhost: x\r\n" + head + b"\r\n")
            assert sock.recv(1000).startswith(b"HTTP/1.1 401 Unauthorized\r\n")
            time.sleep(0.1)
            sock.sendall(body)
            time.sleep(0.1)
            sock.sendall(b"GET /echo?after HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = sock.recv(1000)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-query: after" in answer


def test_an_app_failing_before_its_answer_gives_500_and_after_it_a_cut_connection(server):
    host, port = server
    r = httpx.get(f"http://{host}:{port}/boom")
    assert (r.status_code, r.text) == (500, "Internal Server Error")
    assert r.headers["connection"] == "close"
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(f"http://{host}:{port}/cut")
    r = httpx.get(f"http://{host}:{port}/none")
    assert r.status_code == 500


def test_a_header_value_with_crlf_never_reaches_the_wire(server):
    out = raw(server, b"GET /split HTTP/1.1\r\nhost: x\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    assert b"pwned" not in out


def test_the_disconnect_extension_tells_the_app_when_the_client_leaves(server):
    EVENTS.clear()
    with socket.create_connection(server) as sock:
        sock.sendall(b"GET /wait-gone HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.2)
    deadline = time.monotonic() + 2
    while "gone" not in EVENTS and time.monotonic() < deadline:
        time.sleep(0.02)
    assert EVENTS == ["gone"]


def test_writing_pauses_while_the_client_does_not_read(server):
    EVENTS.clear()
    n = 64 * 1024 * 1024
    with socket.create_connection(server) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(b"GET /bytes?n=%d HTTP/1.1\r\nhost: x\r\n\r\n" % n)
        time.sleep(1.0)
        stalled = len(EVENTS)
        assert 0 < stalled < n // 65536 // 4  # not all 1,024 chunks went into a buffer
        got = 0
        sock.settimeout(10)
        while got < n:
            got += len(sock.recv(1 << 20))
    assert EVENTS[-1] == f"sent {n}"


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(server):
    with socket.create_connection(server) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(1000).startswith(b"HTTP/1.1 200 OK")
        start = time.monotonic()
        assert sock.recv(1000) == b""  # closed by the server (timeout_keep_alive=1)
        assert 0.8 < time.monotonic() - start < 3


def test_a_connection_kept_busy_is_not_closed_by_an_earlier_idle_timer(server):
    with socket.create_connection(server) as sock:
        sock.settimeout(5)
        for _ in range(6):  # 1.8 s of requests 0.3 s apart: past one keep-alive timeout
            sock.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
            assert sock.recv(1000).startswith(b"HTTP/1.1 200 OK")
            time.sleep(0.3)


def test_graceful_shutdown_finishes_the_answers_in_flight_and_pipelined_then_ends():
    srv, thread, address = start_server()
    with socket.create_connection(address) as sock:
        sock.sendall(b"GET /slow-body HTTP/1.1\r\nhost: x\r\n\r\n"
                     b"GET /echo?next HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(2)
        assert sock.recv(1000).startswith(b"HTTP/1.1 200 OK")  # the headers; body in 0.3 s
        srv.should_exit = True
        rest = b""
        while chunk := sock.recv(1000):  # (until the server closes the connection)
            rest += chunk
    assert rest.startswith(b"late") and rest.count(b"HTTP/1.1 200 OK") == 1
    assert b"x-query: next" in rest and b"connection: close" in rest
    thread.join(10)
    assert not thread.is_alive() and not srv.server_state.tasks
