"""The proxy path's HTTP/1.1 client: kept-alive connections to the workers, answers parsed by
httptools (llhttp, the parser uvicorn serves with), bodies handed on as they arrive.

A proxy needs a small part of a general HTTP client: POST a body it already holds to a
worker, read the status and headers, then move the body's bytes (and GET the workers'
``/health``, ``/v1/models`` and ``/metrics`` for the poller: ``get``). This client does that on
one ``asyncio.Protocol`` a connection and one future a wait. In place of aiohttp's client
session (a request object, cookie jar, timers, a response stream reader a request) it took
the router's CPU per request from 0.71 to 0.43 ms at 1,000 concurrent streams
(``bench/router.py --only overhead``, one run each, back to back).

What it does:
- **Pooling.** Connections are kept per ``host:port`` and reused last-in first-out; one idle
  for ``keepalive_timeout`` is closed rather than used, or by a sweep every half of it (keep
  that below the worker's own idle timeout, so the worker rarely closes one just as a
  request is written); a request that finds its pooled connection closed by the worker
  (nothing answered) is written again, once, on a new one. A connection that receives
  bytes no request asked for is closed.
- **Framing.** ``content-length``, chunked (decoded here) or read-until-close bodies; interim
  1xx answers are skipped, trailer fields dropped; a ``connection: close`` answer's
  connection is not pooled.
- **Backpressure.** Reading pauses while more than ``HIGH_WATER`` bytes wait unconsumed.
- **Timeouts.** ``connect_timeout`` for a new connection; ``read_timeout`` for each wait
  for body bytes (checked by a sweep, ``sluice.router.deadlines``: up to a tenth of it, at
  most 1 s, late). The wait for the status line is the caller's (``sluice.router.proxy``:
  the first-byte timeout).

Errors: ``ConnectFailed`` (nothing was sent), ``ConnectionLost`` (with ``reused``: the
connection had served a request before), ``ReadTimeout``, ``BadResponse``; all are
``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

from sluice.router.deadlines import Deadlines

logger = logging.getLogger(__name__)

HIGH_WATER = 1 << 18  # bytes of body read but not consumed before reading pauses (256 KiB)
MAX_GET_BYTES = 16 << 20  # the most of a GET's body kept (a worker's /metrics: ~10-100 KB)


class UpstreamError(Exception):
    """A worker connection failed; see the subclasses."""


class ConnectFailed(UpstreamError):
    """No connection was made (refused, unreachable, or over the connect timeout): nothing
    was sent."""


class ConnectionLost(UpstreamError):
    """The connection closed or broke under a request, before its answer was complete.

    Attributes:
        reused: the connection had carried an earlier request (a kept-alive one the worker
            may have closed just as this request was written).
        answered: some of the answer (its status line at least) had arrived.
    """

    def __init__(self, message: str, reused: bool, answered: bool):
        super().__init__(message)
        self.reused = reused
        self.answered = answered


class ReadTimeout(UpstreamError, TimeoutError):
    """No body bytes arrived within the read timeout."""


class BadResponse(UpstreamError):
    """The worker's answer is not valid HTTP/1.1."""


class UpstreamResponse:
    """One worker answer: ``status`` and ``headers`` are set when it is returned; the body
    comes through ``read`` (all of it) or ``async for`` (the bytes as they arrive, each
    item everything received since the last one).

    Give the connection back with ``release`` once done (it is pooled only when the answer
    was read to its end and the worker keeps it alive), or drop it with ``close``.

    Attributes:
        status: the HTTP status code.
        headers: header name (lower case) to value; the last one of a repeated name.
    """

    def __init__(self, connection: _Connection):
        self._connection = connection
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._eof = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def at_eof(self) -> bool:
        """True once the whole body has arrived and been taken."""
        return self._eof and not self._chunks

    async def read(self) -> bytes:
        """The rest of the body, whole.

        Raises:
            ConnectionLost, ReadTimeout, BadResponse.
        """
        parts = [chunk async for chunk in self]
        return b"".join(parts)

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        while not self._chunks:
            if self._eof:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            await self._wait()
        chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > HIGH_WATER:
            self._connection.resume()
        self._buffered = 0
        return chunk

    async def _wait(self) -> None:
        """Until more of the answer arrives (or it fails), at most the read timeout (a
        deadline in the pool's sweep, ``sluice.router.deadlines``: a stream waits once a
        chunk, and a timer a wait cost more than the rest of the chunk's relay)."""
        connection = self._connection
        waiter = self._waiter = connection.loop.create_future()
        deadlines = connection.pool.read_deadlines
        if deadlines is not None:
            deadlines.add(self, self._time_out, connection.loop.time())
        try:
            await waiter
        finally:
            self._waiter = None
            if deadlines is not None:
                deadlines.remove(self)

    def _time_out(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ReadTimeout(f"no bytes from {self._connection.key} in "
                                             f"{self._connection.pool.read_timeout} s"))

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if it can be reused."""
        self._connection.done(reusable=self._eof)

    def close(self) -> None:
        """Done with it before its end: close the connection (the worker sees the client
        leave and stops generating)."""
        self._connection.done(reusable=False)

    # ------------------------------------------------------------------ the connection's side

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._connection.pause()
        self._wake()

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        self._wake()


class _Connection(asyncio.Protocol):
    """One kept-alive connection: the protocol its transport feeds, and the httptools
    parser callbacks of the answer in progress."""

    def __init__(self, pool: Upstream, key: str):
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.headers_future: asyncio.Future[UpstreamResponse] | None = None
        self.requests = 0  # carried so far
        self.idle_since = 0.0
        self.closed = False
        self.complete = True  # no answer in progress
        self.keep_alive = True
        self.until_close = False  # the answer's body ends when the connection does
        self.headers_done = False  # (header fields after them are trailers: not kept)
        self.stray = False  # bytes came that no request asked for: never reused
        self.paused = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._abort(BadResponse(f"{self.key} answered with a protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._abort(BadResponse(f"{self.key} sent a malformed answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.complete:
            return
        if self.until_close and exc is None and self.response is not None:
            self.complete = True
            self.response._end()
            return
        answered = self.response is not None
        why = f"{type(exc).__name__}: {exc}" if exc is not None else "closed by the worker"
        self._fail(ConnectionLost(f"the connection to {self.key} was lost ({why})",
                                  reused=self.requests > 1, answered=answered))

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # an answer to no request: what else the stream holds is unknown
            self.stray, self.keep_alive = True, False
            if self.response is None:  # idle in the pool
                self.close()
            return
        self.response = UpstreamResponse(self)
        self.until_close = self.headers_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not (self.stray or self.headers_done):
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.stray:
            return
        response = self.response
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self.response = None
            return
        self.headers_done = True
        response.status = status
        self.keep_alive = self.parser.should_keep_alive()
        coding = response.headers.get("transfer-encoding", "").rstrip().lower()
        self.until_close = "content-length" not in response.headers \
            and not coding.endswith("chunked")
        future = self.headers_future
        if future is not None and not future.done():
            future.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None and not self.stray:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.response is None or self.stray:  # the end of an interim or stray answer
            return
        self.complete = True
        self.response._end()

    # ------------------------------------------------------------------ the pool's side

    def send(self, head: bytes, body: bytes) -> asyncio.Future[UpstreamResponse]:
        """Write one request; the future is the answer once its headers are in."""
        self.requests += 1
        self.complete = False
        self.response = None
        self.headers_future = self.loop.create_future()
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)
        return self.headers_future

    def done(self, reusable: bool) -> None:
        """The answer's reader is finished with the connection."""
        if self.paused and not self.closed:
            self.resume()
        self.response = None
        self.headers_future = None
        if reusable and self.complete and self.keep_alive and not self.closed:
            self.pool.park(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def _fail(self, error: UpstreamError) -> None:
        self.complete = True
        future = self.headers_future
        if future is not None and not future.done():
            future.set_exception(error)
        elif self.response is not None:
            self.response._fail(error)

    def _abort(self, error: UpstreamError) -> None:
        self._fail(error)
        self.close()
        self.pool.forget(self)


class Upstream:
    """A pool of kept-alive HTTP/1.1 connections to worker endpoints.

    Args:
        connect_timeout: seconds to open a new connection.
        read_timeout: seconds to wait for each piece of a body; None waits forever.
        keepalive_timeout: seconds an idle connection is kept for reuse.
    """

    def __init__(self, connect_timeout: float, read_timeout: float | None,
                 keepalive_timeout: float):
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.read_deadlines = None if read_timeout is None else \
            Deadlines(read_timeout, self.loop.time)
        self.keepalive_timeout = keepalive_timeout
        self._idle: dict[str, list[_Connection]] = {}  # oldest first
        self._open: set[_Connection] = set()
        self._origins: dict[str, tuple[str, int, str]] = {}  # base → host, port, authority
        self._sweep_timer: asyncio.TimerHandle | None = None

    async def request(self, method: str, base: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> UpstreamResponse:
        """Send ``method`` (``POST`` with ``body``: the proxy path; ``GET``: the endpoint
        poller) to ``base + path`` and return the answer once its headers are in.

        A pooled connection the worker closed (its keep-alive ran out) just as the request
        was written fails before any byte comes back, and the worker never read the
        request: the request is written again once, on a new connection, which neither
        marks the worker down nor uses the proxy's retry. A new connection that fails is a
        real failure.

        Args:
            base: ``http://host:port`` of the worker.
            headers: request headers, without ``host``, ``content-length`` or hop-by-hop
                ones (they are set here).

        Raises:
            ConnectFailed: no connection (nothing sent).
            ConnectionLost: the connection died before the answer's headers came.
            BadResponse: not HTTP.
        Cancelling the call closes the connection.
        """
        head = f"{method} {path} HTTP/1.1\r\nhost: {self._origin(base)[2]}\r\n"
        if body or method == "POST":
            head += f"content-length: {len(body)}\r\n"
        if headers:
            head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        head = (head + "\r\n").encode("latin-1")
        try:
            return await self._send(self._reuse(base) or await self._connect(base), head, body)
        except ConnectionLost as exc:
            if not exc.reused or exc.answered:
                raise
            logger.debug("a kept-alive connection to %s was closed under a request (%s); "
                         "writing it again", base, exc)
        return await self._send(await self._connect(base), head, body)

    @staticmethod
    async def _send(connection: _Connection, head: bytes, body: bytes) -> UpstreamResponse:
        future = connection.send(head, body)
        try:
            return await future
        except BaseException:
            connection.close()
            raise

    async def get(self, base: str, path: str, timeout: float,
                  max_bytes: int = MAX_GET_BYTES) -> tuple[int, bytes]:
        """GET ``base + path``: its status and whole body, within ``timeout`` seconds.

        It took ~0.1 ms of CPU a call here where httpx's client took 1.1 ms (2.1 ms for
        concurrent calls): the poller asks each worker three of these a second.

        Raises:
            UpstreamError: as ``request``; a body cut short; ``BadResponse`` for a body
                over ``max_bytes``.
            TimeoutError: no whole answer within ``timeout``.
        """
        response = None
        try:
            async with asyncio.timeout(timeout):
                response = await self.request("GET", base, path)
                parts, size = [], 0
                async for chunk in response:
                    size += len(chunk)
                    if size > max_bytes:
                        raise BadResponse(f"{base}{path} answered more than {max_bytes} bytes")
                    parts.append(chunk)
                return response.status, b"".join(parts)
        finally:
            if response is not None:  # (pooled only when read to its end)
                response.release()

    def _reuse(self, base: str) -> _Connection | None:
        idle = self._idle.get(base)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive_timeout:
                return connection
            connection.close()
        return None

    def _origin(self, base: str) -> tuple[str, int, str]:
        """``base``'s host, port and ``host`` header value (an IPv6 address in brackets)."""
        origin = self._origins.get(base)
        if origin is None:
            parts = urlsplit(base)
            if parts.scheme != "http" or not parts.hostname:
                raise ConnectFailed(f"{base}: only http://host:port workers are supported")
            host, port = parts.hostname, parts.port or 80
            authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            origin = self._origins[base] = (host, port, authority)
        return origin

    async def _connect(self, base: str) -> _Connection:
        host, port, _ = self._origin(base)
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await self.loop.create_connection(
                    lambda: _Connection(self, base), host, port)
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"could not connect to {base}: "
                                f"{type(exc).__name__}: {exc}") from exc
        self._open.add(connection)
        return connection

    def park(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)
        if self._sweep_timer is None:
            self._sweep_timer = self.loop.call_later(self.keepalive_timeout / 2, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for the keep-alive timeout (each request reuses the
        newest, so the oldest may wait under them for long); again while any are idle."""
        self._sweep_timer = None
        now = time.monotonic()
        for idle in self._idle.values():
            while idle and now - idle[0].idle_since >= self.keepalive_timeout:
                idle.pop(0).close()
        if any(self._idle.values()):
            self._sweep_timer = self.loop.call_later(self.keepalive_timeout / 2, self._sweep)

    def forget(self, connection: _Connection) -> None:
        """A connection closed: drop it from the pool."""
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    async def close(self) -> None:
        """Close every connection."""
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their connection_lost
