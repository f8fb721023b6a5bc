"""The router's HTTP/1.1 server protocol: uvicorn's server (sockets, lifespan, signals,
graceful shutdown) with a leaner protocol class in place of uvicorn's own
(``uvicorn.Config(http=RouterHTTP)``; ``sluice router --http httptools`` goes back to it).

It speaks the same ASGI 3 to the same app, on the same parser (httptools, i.e. llhttp), and
keeps what the router relies on: keep-alive with an idle timeout, pipelined requests answered
in order, ``Expect: 100-continue``, request bodies delivered as they arrive (reading paused
past 64 KiB until the app takes them), writes paused while the client does not read,
``http.disconnect`` from ``receive`` once the client leaves or the answer is complete (and
the router's ``DISCONNECT_EXTENSION``: a callback instead of a task reading ``receive``), a 500
for an app that fails before answering, uvicorn's access-log line, ``date``/``server``
headers, and uvicorn's graceful shutdown (``shutdown``, ``server_state.tasks``).

Why: the router's own work a request is small, so the server's share is large. Under
uvicorn's protocol (a scope built with ``httptools.parse_url``, an ``asyncio.Event`` and a
task reading ``receive`` a request, two regular expressions per response header, the status
line and the body in two writes) the router ran 767,000 instructions a request (callgrind,
100 concurrent streams through a null worker) and 3 writes; on this one, 715,000 and 2
(strace). ``bench/router.py --only overhead`` compares the router on both.

What it does not do: WebSocket or h2c upgrades (the router serves none: such a request is
answered over HTTP/1.1, body included, and the connection then closed), TLS beyond the
scheme, and uvicorn's ``--limit-concurrency`` (the router's admission control bounds work).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools

from sluice.router.relay import DISCONNECT_EXTENSION

logger = logging.getLogger("uvicorn.error")  # (uvicorn's loggers: same configuration)
access_logger = logging.getLogger("uvicorn.access")

HIGH_WATER = 64 * 1024  # request body bytes buffered before reading pauses
MAX_TARGET_BYTES = 64 * 1024  # a request target past this: 414, closed
MAX_HEAD_BYTES = 1024 * 1024  # header field lines past this: 431, closed
MAX_HEADER_FIELDS = 1000  # header fields past this: 431, closed
STATUS_LINE = {code: b"HTTP/1.1 %d %s\r\n" % (code, HTTPStatus(code).phrase.encode())
               for code in HTTPStatus}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
NO_BODY_STATUS = (204, 304)


def _status_line(code: int) -> bytes:
    return STATUS_LINE.get(code) or b"HTTP/1.1 %d \r\n" % code


def _plain(code: int, text: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole plain-text answer that closes the connection (parser errors)."""
    body = text.encode()
    return b"".join([_status_line(code), *(name + b": " + value + b"\r\n"
                                           for name, value in default_headers),
                     b"content-type: text/plain; charset=utf-8\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body), body])


class Cycle:
    """One request and its answer: the ASGI ``receive`` and ``send`` of one call of the app.

    ``receive`` gives the body as it arrives (``http.request``), then waits and answers
    ``http.disconnect`` once the client is gone or the answer is complete (what the router's
    disconnect watch waits on). ``send`` writes the answer: the status line and headers are
    held until the first body message (one write for both, the usual case) or the end of the
    current loop iteration, whichever comes first; a body without ``content-length`` is
    chunked (HTTP/1.0: close-delimited). After the client left, ``send`` does nothing
    (uvicorn's behaviour).
    """

    __slots__ = ("conn", "scope", "keep_alive", "expect_continue", "body", "more_body",
                 "delivered", "waiter", "gone", "started", "complete", "head", "chunked",
                 "length_left", "status", "on_gone", "task")

    def __init__(self, conn: RouterHTTP, scope: dict[str, Any], keep_alive: bool,
                 expect_continue: bool):
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body = bytearray()
        self.more_body = True  # the request's body has more to come
        self.delivered = False  # its last body message was given to the app
        self.waiter: asyncio.Future | None = None
        self.gone = False  # the client closed the connection
        self.started = False
        self.complete = False
        self.head: bytes | None = None  # status line and headers not written yet
        self.chunked = False
        self.length_left: int | None = None  # content-length still to send, when declared
        self.status = 0
        self.on_gone: Callable[[], None] | None = None
        self.task: asyncio.Task | None = None  # the one running the app (``RouterHTTP._run``)
        scope["extensions"] = {DISCONNECT_EXTENSION: self.tell_when_gone}

    def tell_when_gone(self, callback: Callable[[], None]) -> None:
        """The ``DISCONNECT_EXTENSION``: call ``callback()`` once, when the client leaves
        before the answer is complete (from the loop, at once if it has left already)."""
        self.on_gone = callback
        if self.gone:
            self.conn.loop.call_soon(self.left)

    def left(self) -> None:
        """The client closed the connection."""
        if self.complete:
            return
        self.gone = True
        self.wake()
        callback, self.on_gone = self.on_gone, None
        if callback is not None:
            callback()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self.waiter = self.conn.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    # ------------------------------------------------------------------ receive

    async def receive(self) -> dict[str, Any]:
        while not (self.gone or self.complete):
            if not self.delivered:
                if self.body or not self.more_body:
                    body = bytes(self.body)
                    self.body.clear()
                    self.delivered = not self.more_body
                    self.conn.resume_reading()
                    return {"type": "http.request", "body": body, "more_body": self.more_body}
                if self.expect_continue:
                    self.expect_continue = False
                    self.conn.transport.write(CONTINUE)
                self.conn.resume_reading()
            await self._wait()
        return {"type": "http.disconnect"}

    # ------------------------------------------------------------------ send

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        if conn.write_paused and not self.gone:
            await conn.drain()
        if self.gone:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected ASGI message 'http.response.start', got {kind!r}")
            self._start(message["status"], message.get("headers", ()))
            return
        if kind != "http.response.body":
            raise RuntimeError(f"expected ASGI message 'http.response.body', got {kind!r}")
        if self.complete:
            raise RuntimeError("ASGI message 'http.response.body' after the answer's end")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.scope["method"] == "HEAD" or self.status in NO_BODY_STATUS:
            body = b""
        elif self.chunked:
            body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + \
                (b"" if more else LAST_CHUNK)
        elif self.length_left is not None:
            self.length_left -= len(body)
            if self.length_left < 0:
                raise RuntimeError("response content longer than content-length")
            if not more and self.length_left:
                raise RuntimeError("response content shorter than content-length")
        if self.head is not None:
            body, self.head = self.head + body, None
        if body:
            conn.transport.write(body)
        if not more:
            self.complete = True
            self.wake()
            if not self.keep_alive:
                conn.transport.close()
            conn.answered(self)

    def _start(self, status: int, headers: Any) -> None:
        conn = self.conn
        self.chunked, self.length_left = False, None
        out = [_status_line(status)]
        close = False
        for name, value in (*conn.server_state.default_headers, *headers):
            name = name.lower()
            if name == b"content-length":
                self.length_left = int(value)
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.chunked = True  # (the app's own header: framed here all the same)
            elif name == b"connection" and value.lower().find(b"close") >= 0:
                self.keep_alive, close = False, True
            out.append(name + b": " + value + b"\r\n")
        if self.length_left is None and not self.chunked and status not in NO_BODY_STATUS \
                and self.scope["method"] != "HEAD":
            if self.scope["http_version"] == "1.1":
                self.chunked = True
                out.append(b"transfer-encoding: chunked\r\n")
            else:  # HTTP/1.0 has no chunked framing: the body ends with the connection
                self.keep_alive = False
        if not self.keep_alive and not close:
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        self.head = b"".join(out)
        if self.head.count(b"\n") != len(out) or self.head.count(b"\r") != len(out):
            # (one CRLF per line: a field's own would split the answer)
            raise RuntimeError(f"a CR or LF in a response header field: {headers!r}")
        self.started = True
        self.expect_continue = False
        self.status = status
        conn.loop.call_soon(self._flush_head)
        if conn.access_log:
            scope = self.scope
            path = scope["path"] + ("?" + scope["query_string"].decode("latin-1")
                                    if scope["query_string"] else "")
            client = scope["client"]
            access_logger.info('%s - "%s %s HTTP/%s" %d',
                               "%s:%d" % client if client else "-", scope["method"], path,
                               scope["http_version"], status)

    def _flush_head(self) -> None:
        """The app started its answer and has not sent a body yet in this loop iteration:
        the client gets the status line and headers now."""
        if self.head is not None and not self.gone:
            self.conn.transport.write(self.head)
        self.head = None

    # ------------------------------------------------------------------ the app

    async def run(self, app: Any) -> None:
        """Call the app; an app that fails before answering gets a 500, after: the
        connection closed (the client sees a cut answer, not a whole one)."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:  # (uvicorn's rule: also a cancellation at shutdown)
            logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.started and not self.gone:
                self.keep_alive = False
                await self.send({"type": "http.response.start", "status": 500, "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", b"21")]})
                await self.send({"type": "http.response.body", "body": b"Internal Server Error"})
            elif not self.complete:
                self.conn.transport.close()
        else:
            if not self.started and not self.gone:
                logger.error("ASGI callable returned without starting response.")
                self.keep_alive = False
                await self.send({"type": "http.response.start", "status": 500, "headers": [
                    (b"content-length", b"0")]})
                await self.send({"type": "http.response.body", "body": b""})
            elif not self.complete and not self.gone:
                logger.error("ASGI callable returned without completing response.")
                self.conn.transport.close()
        finally:  # (what a done callback would do, without the callback's own scheduling)
            self.conn.server_state.tasks.discard(self.task)


class RouterHTTP(asyncio.Protocol):
    """One client connection (see the module docstring). Constructed by uvicorn's server
    with its config, server state and lifespan state, as uvicorn's own protocols are.

    Raises (from the app's ``send``): RuntimeError for ASGI messages out of order, a header
    name or value that could split the answer (CR, LF), or a body longer or shorter than
    its ``content-length``.
    """

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None):
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.app_state = app_state
        self.root_path = config.root_path
        self.keepalive_s = config.timeout_keep_alive
        self.access_log = access_logger.hasHandlers() and config.access_log
        self.parser = httptools.HttpRequestParser(self)
        # answer a request even when data follows its "connection: close" (as uvicorn)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.cycles: deque[Cycle] = deque()  # the one answered first, then pipelined ones
        self.parsing: Cycle | None = None  # the request whose body is being read (last in)
        self.closing = False  # graceful shutdown: the last answer closes the connection
        self.idle: asyncio.TimerHandle | None = None  # the keep-alive timeout's check
        self.idle_since: float | None = None  # loop time of the last answer; None: busy
        self.write_paused = False
        self.read_paused = False
        self.drainers: list[asyncio.Future] = []
        # the request being parsed
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.expect_continue = False
        self.upgrade_left: int | None = None  # body bytes still due after an ignored upgrade

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.server_state.connections.add(self)
        self.transport = transport
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        if self.idle is not None:
            self.idle.cancel()
        for cycle in list(self.cycles):
            cycle.left()
        self.write_paused = False
        self._release_drainers()

    def shutdown(self) -> None:
        """Graceful shutdown (uvicorn's server calls it): an idle connection closes now, a
        busy one after its answers (the pipelined ones too)."""
        self.closing = True
        if not self.cycles:
            self.transport.close()
        else:
            self.cycles[-1].keep_alive = False

    def data_received(self, data: bytes) -> None:
        self.idle_since = None
        if self.upgrade_left is not None:
            self._upgrade_body(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._ignore_upgrade(data[exc.args[0]:])
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _TargetTooLong):  # (a callback's, wrapped)
                self._refuse(414, "Request target too long.")
            elif isinstance(exc.__context__, _HeadTooLarge):
                self._refuse(431, "Request header fields too large.")
            else:
                logger.warning("Invalid HTTP request received.")
                self._refuse(400, "Invalid HTTP request received.")

    def _ignore_upgrade(self, rest: bytes) -> None:
        """llhttp stops at a request asking to upgrade (h2c from ``curl --http2``, a
        WebSocket) and leaves what follows its headers to the new protocol. The router
        answers over HTTP/1.1 instead: those bytes are the request's body (its
        content-length; none without one), and the connection closes after the answer,
        since the parser cannot go on. (uvicorn's protocol gave such a request an empty
        body.)"""
        cycle = self.parsing
        cycle.keep_alive = False
        length = next((int(value) for name, value in cycle.scope["headers"]
                       if name == b"content-length"), 0)  # (llhttp checked it is a number)
        self.upgrade_left = length
        if length:
            cycle.more_body = True  # (llhttp said it was complete: its app has not run yet)
        self._upgrade_body(rest)

    def _upgrade_body(self, data: bytes) -> None:
        """The body of a request whose upgrade was ignored, up to its length; anything
        after it is dropped."""
        if not self.upgrade_left:
            return
        part = data[:self.upgrade_left]
        self.upgrade_left -= len(part)
        if part:
            self.on_body(part)
        if not self.upgrade_left:
            self.on_message_complete()

    def _refuse(self, code: int, text: str) -> None:
        if not self.cycles or not self.cycles[0].started:
            self.transport.write(_plain(code, text, self.server_state.default_headers))
        self.transport.close()

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.head_bytes = 0
        self.expect_continue = False

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_TARGET_BYTES:
            raise _TargetTooLong

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4  # (": ", CRLF)
        if self.head_bytes > MAX_HEAD_BYTES or len(self.headers) >= MAX_HEADER_FIELDS:
            raise _HeadTooLarge
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace (RFC 9110 §5.5)
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        version = parser.get_http_version()
        url = self.url.partition(b"#")[0]  # (a fragment is the client's own)
        if url[:1] != b"/":  # absolute form (or "*")
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        else:
            raw_path, _, query = url.partition(b"?")
        path = raw_path.decode("latin-1")
        if "%" in path:
            from urllib.parse import unquote
            path = unquote(path)
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": version, "server": self.server, "client": self.client,
                 "scheme": self.scheme, "method": parser.get_method().decode("ascii"),
                 "root_path": self.root_path, "path": self.root_path + path,
                 "raw_path": self.root_path.encode() + raw_path, "query_string": query,
                 "headers": self.headers, "state": self.app_state.copy()}
        cycle = self.parsing = Cycle(
            self, scope, version != "1.0" and parser.should_keep_alive() and not self.closing,
            self.expect_continue)
        self.cycles.append(cycle)
        if len(self.cycles) == 1:
            self._run(cycle)
        else:  # pipelined: answered after the ones before it; read no further meanwhile
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle.complete:  # answered before its body was read (a 401, a 413): dropped
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.parsing
        cycle.more_body = False
        cycle.wake()

    # ------------------------------------------------------------------ answers

    def _run(self, cycle: Cycle) -> None:
        """Run the app for ``cycle`` in a task of its own, which uvicorn's graceful
        shutdown waits for (``server_state.tasks``; ``Cycle.run`` takes it out)."""
        cycle.task = self.loop.create_task(cycle.run(self.app))
        self.server_state.tasks.add(cycle.task)

    def answered(self, cycle: Cycle) -> None:
        """``cycle``'s answer is complete: start the next pipelined request, or wait for
        one (at most the keep-alive timeout)."""
        self.server_state.total_requests += 1
        if self.cycles and self.cycles[0] is cycle:
            self.cycles.popleft()
        if self.transport.is_closing():
            return
        self.resume_reading()
        if self.cycles:
            self._run(self.cycles[0])
        else:
            self.idle_since = self.loop.time()
            if self.idle is None:
                self.idle = self.loop.call_later(self.keepalive_s, self._idle_check)

    def _idle_check(self) -> None:
        """Close the connection once idle for the keep-alive timeout. One timer a
        connection, moved on when it was busy meanwhile, rather than one an answer; data
        arriving (a request begun) stops it until the next answer, as in uvicorn."""
        self.idle = None
        if self.cycles or self.idle_since is None or self.transport.is_closing():
            return
        left = self.idle_since + self.keepalive_s - self.loop.time()
        if left > 0:
            self.idle = self.loop.call_later(left, self._idle_check)
        else:
            self.transport.close()

    # ------------------------------------------------------------------ flow control

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and not (self.parsing and len(self.parsing.body) > HIGH_WATER):
            self.read_paused = False
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._release_drainers()

    async def drain(self) -> None:
        waiter = self.loop.create_future()
        self.drainers.append(waiter)
        await waiter

    def _release_drainers(self) -> None:
        for waiter in self.drainers:
            if not waiter.done():
                waiter.set_result(None)
        self.drainers.clear()


class _HeadTooLarge(Exception):
    """Header fields past ``MAX_HEAD_BYTES`` or ``MAX_HEADER_FIELDS`` (raised from a parser
    callback; ``feed_data`` raises an ``HttpParserCallbackError`` whose context it is)."""


class _TargetTooLong(Exception):
    """A request target past ``MAX_TARGET_BYTES`` (likewise)."""


def _address(info: Any) -> tuple[str, int] | None:
    """(host, port) of a socket address; None for a Unix socket's."""
    return (str(info[0]), int(info[1])) if isinstance(info, tuple) and len(info) >= 2 else None
