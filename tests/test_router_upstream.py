"""The proxy path's HTTP/1.1 client (sluice.router.upstream) against real servers on
127.0.0.1 that write raw HTTP/1.1, each test's server scripted to one behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from sluice.router.upstream import (HIGH_WATER, BadResponse, ConnectFailed, ConnectionLost,
                                    ReadTimeout, Upstream)

BODY = b'{"model": "m", "prompt": "hi"}'


class Server:
    """A raw HTTP/1.1 server: ``handle(reader, writer, n)`` is called per request, ``n``
    counting requests over all connections; ``connections`` counts accepted ones and
    ``requests`` keeps each request's head; a handler returning "close" closes the
    connection."""

    def __init__(self, handle):
        self.handle = handle
        self.connections = 0
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length")), b"0"))
                await reader.readexactly(length)
                self.requests.append(head)
                if await self.handle(reader, writer, len(self.requests)) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def answer(body: bytes = b"hello", extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nX-Load: 3\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def plain(reader, writer, n):
    writer.write(answer(b"answer %d" % n))


def run(coro):
    asyncio.run(coro)


def test_a_plain_answer_then_a_second_request_on_the_same_connection():
    async def main():
        server = Server(plain)
        async with server as base:
            pool = Upstream(5, 5, 4)
            for n in (1, 2):
                response = await pool.request("POST", base, "/v1/completions", BODY,
                                           {"content-type": "application/json"})
                assert (response.status, await response.read()) == (200, b"answer %d" % n)
                assert response.headers["x-load"] == "3"  # names lower-cased
                assert response.at_eof()
                response.release()
            assert server.connections == 1
            head = server.requests[0].decode()
            assert head.startswith("POST /v1/completions HTTP/1.1\r\n")
            assert f"host: 127.0.0.1:{base.rsplit(':', 1)[1]}\r\n" in head
            assert f"content-length: {len(BODY)}\r\n" in head
            assert "content-type: application/json\r\n" in head
            await pool.close()
    run(main())


def test_get_gives_status_and_body_on_a_kept_connection_and_times_out_whole():
    """The poller's GET: no body, no content-length; the answer read whole; a worker that
    does not answer within the timeout is a TimeoutError and its connection is closed."""
    async def health(reader, writer, n):
        if n == 3:
            await asyncio.sleep(3600)
        writer.write(answer(b'{"status": "ok"}') if n in (1, 5, 6) else
                     b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")

    async def main():
        server = Server(health)
        async with server as base:
            pool = Upstream(5, 5, 4)
            assert await pool.get(base, "/health", 5.0) == (200, b'{"status": "ok"}')
            assert await pool.get(base, "/health", 5.0) == (503, b"")
            assert server.connections == 1
            head = server.requests[0].decode()
            assert head.startswith("GET /health HTTP/1.1\r\n") and "content-length" not in head
            with pytest.raises(TimeoutError):
                await pool.get(base, "/health", 0.2)
            assert await pool.get(base, "/health", 5.0) == (503, b"")
            assert server.connections == 2  # the one that timed out was closed, not pooled
            with pytest.raises(BadResponse, match="more than 8 bytes"):  # 5: 16 bytes
                await pool.get(base, "/metrics", 5.0, max_bytes=8)
            assert await pool.get(base, "/health", 5.0, max_bytes=16) == (200, b'{"status": "ok"}')
            assert server.connections == 2  # (the refused answer had all come: kept)
            await pool.close()
    run(main())


def test_an_ipv6_worker_gets_a_bracketed_host_header():
    async def main():
        server = Server(plain)
        try:
            server.server = await asyncio.start_server(server._serve, "::1", 0)
        except OSError as exc:
            pytest.skip(f"no IPv6 loopback here: {exc}")
        port = server.server.sockets[0].getsockname()[1]
        pool = Upstream(5, 5, 4)
        assert await pool.get(f"http://[::1]:{port}", "/health", 5.0) == (200, b"answer 1")
        assert f"host: [::1]:{port}\r\n" in server.requests[0].decode()
        await pool.close()
        server.server.close()
    run(main())


def test_a_chunked_stream_is_decoded_and_handed_on_as_it_arrives():
    events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
    sent = asyncio.Queue()

    async def stream(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await sent.get()  # the next event only once the client has this one
        writer.write(b"0\r\n\r\n")

    async def main():
        async with Server(stream) as base:
            pool = Upstream(5, 5, 4)
            response = await pool.request("POST", base, "/v1/completions", BODY, {})
            got = []
            async for piece in response:
                got.append(piece)
                sent.put_nowait(None)
            assert got == events
            response.release()
            assert len(pool._idle[base]) == 1  # read to its end: pooled
            await pool.close()
    run(main())


def test_an_interim_100_continue_is_skipped():
    async def interim(reader, writer, n):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b"done"))

    async def main():
        async with Server(interim) as base:
            pool = Upstream(5, 5, 4)
            response = await pool.request("POST", base, "/", BODY, {})
            assert (response.status, await response.read()) == (200, b"done")
            await pool.close()
    run(main())


@pytest.mark.parametrize("head, body", [
    (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n", b"all of it"),  # ends at close
    (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\n", b"bye")])
def test_an_answer_that_ends_the_connection_is_not_pooled(head, body):
    async def closing(reader, writer, n):
        writer.write(head + body)
        return "close"

    async def main():
        server = Server(closing)
        async with server as base:
            pool = Upstream(5, 5, 4)
            for _ in range(2):
                response = await pool.request("POST", base, "/", BODY, {})
                assert await response.read() == body
                response.release()
            assert server.connections == 2
            assert not pool._idle.get(base)
            await pool.close()
    run(main())


def test_a_kept_alive_connection_closed_under_a_request_is_written_again_once():
    """The worker closes its idle connection just as the second request arrives: the pool
    sees it lost (reused, nothing answered) and writes the request again on a new one;
    likewise for a GET (the poller's)."""
    async def drops_2_and_4(reader, writer, n):
        if n in (2, 4):
            return "close"
        writer.write(answer(b"answer %d" % n))

    async def main():
        server = Server(drops_2_and_4)
        async with server as base:
            pool = Upstream(5, 5, 4)
            first = await pool.request("POST", base, "/", BODY, {})
            await first.read()
            first.release()
            response = await pool.request("POST", base, "/", BODY, {})  # 2 dropped, 3 answers
            assert await response.read() == b"answer 3"
            response.release()
            assert server.connections == 2
            assert await pool.get(base, "/health", 5.0) == (200, b"answer 5")  # 4 dropped
            assert server.connections == 3
            await pool.close()
    run(main())


def test_a_new_connection_lost_before_an_answer_is_not_retried():
    async def drop(reader, writer, n):
        return "close"

    async def main():
        server = Server(drop)
        async with server as base:
            pool = Upstream(5, 5, 4)
            with pytest.raises(ConnectionLost) as lost:
                await pool.request("POST", base, "/", BODY, {})
            assert (lost.value.reused, lost.value.answered) == (False, False)
            assert len(server.requests) == 1
            await pool.close()
    run(main())


def test_a_refused_connection_is_connect_failed():
    async def main():
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pool = Upstream(5, 5, 4)
        with pytest.raises(ConnectFailed, match="ConnectionRefusedError"):
            await pool.request("POST", f"http://127.0.0.1:{port}", "/", BODY, {})
        with pytest.raises(ConnectFailed, match="only http://"):
            await pool.request("POST", "https://127.0.0.1:1", "/", BODY, {})
    run(main())


def test_a_stream_that_stops_sending_times_out_and_one_that_breaks_is_lost():
    async def stalls(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        if n == 1:
            await asyncio.sleep(5)
        return "close"  # n == 2: the connection dies mid-stream

    async def main():
        async with Server(stalls) as base:
            pool = Upstream(5, 0.2, 4)
            response = await pool.request("POST", base, "/", BODY, {})
            assert await anext(response) == b"first"
            with pytest.raises(ReadTimeout):
                await anext(response)
            response.close()
            response = await pool.request("POST", base, "/", BODY, {})
            assert await anext(response) == b"first"
            with pytest.raises(ConnectionLost) as lost:
                await anext(response)
            assert lost.value.answered
            response.close()
            await pool.close()
    run(main())


def test_a_malformed_answer_is_bad_response():
    async def garbage(reader, writer, n):
        writer.write(b"SPDY/9 what\r\n\r\n")

    async def main():
        async with Server(garbage) as base:
            pool = Upstream(5, 5, 4)
            with pytest.raises(BadResponse, match="malformed"):
                await pool.request("POST", base, "/", BODY, {})
            await pool.close()
    run(main())


def test_an_idle_connection_older_than_the_keepalive_timeout_is_not_reused():
    async def main():
        server = Server(plain)
        async with server as base:
            pool = Upstream(5, 5, keepalive_timeout=0.05)
            for _ in range(2):
                response = await pool.request("POST", base, "/", BODY, {})
                await response.read()
                response.release()
                await asyncio.sleep(0.1)
            assert server.connections == 2
            await pool.close()
    run(main())


def test_reading_pauses_above_the_high_water_mark_and_nothing_is_lost():
    big = bytes(range(256)) * (4 * HIGH_WATER // 256)

    async def large(reader, writer, n):
        writer.write(answer(big))
        await writer.drain()

    async def main():
        async with Server(large) as base:
            pool = Upstream(5, 5, 4)
            response = await pool.request("POST", base, "/", BODY, {})
            for _ in range(50):  # the client reads nothing for a while
                await asyncio.sleep(0.01)
                if response._connection.paused:
                    break
            assert response._connection.paused
            assert response._buffered <= 2 * HIGH_WATER  # (one socket read past the mark)
            assert await response.read() == big
            assert not response._connection.paused
            await pool.close()
    run(main())


def test_a_cancelled_request_closes_its_connection():
    gone = asyncio.Event()

    async def never_answers(reader, writer, n):
        assert await reader.read() == b""  # until the client closes
        gone.set()
        return "close"

    async def main():
        async with Server(never_answers) as base:
            pool = Upstream(5, 5, 4)
            task = asyncio.ensure_future(pool.request("POST", base, "/", BODY, {}))
            await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.wait_for(gone.wait(), 2)  # the worker saw it go
            await asyncio.sleep(0)
            assert not pool._open
    run(main())


def test_bytes_no_request_asked_for_close_the_connection():
    """A worker that sends more than its answer (here the start of a second one, in the same
    write or later while the connection is idle): that connection is never used again."""
    async def extra(reader, writer, n):
        if n == 1:  # with the answer
            writer.write(answer(b"one") + b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\nabc")
        else:
            writer.write(answer(b"answer %d" % n))
            if n == 2:  # after the answer, while the router's connection is idle
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\nabc")

    async def main():
        server = Server(extra)
        async with server as base:
            pool = Upstream(5, 5, 4)
            for n in (1, 2):
                response = await pool.request("POST", base, "/", BODY, {})
                assert await response.read() == (b"one" if n == 1 else b"answer 2")
                response.release()
                await asyncio.sleep(0.1)
            assert not pool._idle.get(base)  # neither connection was kept
            response = await pool.request("POST", base, "/", BODY, {})
            assert await response.read() == b"answer 3"
            assert server.connections == 3
            await pool.close()
    run(main())


def test_idle_connections_are_swept_after_the_keepalive_timeout():
    closed = asyncio.Event()

    async def answers_then_waits(reader, writer, n):
        writer.write(answer())
        await writer.drain()
        if await reader.read() == b"":  # the router closed it
            closed.set()
        return "close"

    async def main():
        async with Server(answers_then_waits) as base:
            pool = Upstream(5, 5, keepalive_timeout=0.1)
            response = await pool.request("POST", base, "/", BODY, {})
            await response.read()
            response.release()
            assert len(pool._idle[base]) == 1
            await asyncio.wait_for(closed.wait(), 2)  # no request came: the sweep closed it
            assert not pool._idle[base]
            await pool.close()
    run(main())


def test_trailers_are_dropped_and_a_non_chunked_coding_ends_with_the_connection():
    async def trailers(reader, writer, n):
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-t\r\n\r\n"
                         b"3\r\nabc\r\n0\r\nx-t: 1\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\n\r\nto the end")
            return "close"

    async def main():
        async with Server(trailers) as base:
            pool = Upstream(5, 5, 4)
            response = await pool.request("POST", base, "/", BODY, {})
            assert await response.read() == b"abc"
            assert "x-t" not in response.headers and response.headers["trailer"] == "x-t"
            response.release()
            response = await pool.request("POST", base, "/", BODY, {})
            assert await response.read() == b"to the end"
            await pool.close()
    run(main())
