"""The worker side of the proxy path: send one request to one worker endpoint and move its
answer's bytes back, unbuffered.

``forward`` awaits the first byte (a plain answer: all of it) within the first-byte timeout,
watching the client and the endpoint meanwhile; what it cannot get from this endpoint it
reports as ``TryElsewhere`` (nothing sent, a 503, a connection lost before any byte, the
endpoint ejected), and the caller (``sluice.router.app``) picks another. Streams are relayed
chunk by chunk; one that breaks after its first byte ends with an SSE error event.

A timeout, a refused or broken connection ejects the endpoint (``EndpointSet.eject``): the
requests waiting there for their first byte go elsewhere too. A kept-alive connection the
worker closed just as a request was written is not a failure (``Upstream.request``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from sluice.api.openai import error_body
from sluice.router.endpoints import Endpoint
from sluice.router.exchange import CLIENT_CLOSED, Exchange
from sluice.router.relay import ClientDisconnected, RelayResponse, unless_disconnected
from sluice.router.upstream import (ConnectFailed, ConnectionLost, ReadTimeout, UpstreamError,
                                   UpstreamResponse)

if TYPE_CHECKING:
    from sluice.router.app import RouterState
    from sluice.router.tenants import KeyRing

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 §7.6.1) and ones the HTTP client or server sets itself.
DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                        "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection",
                        "expect"}  # (the router has read the body: no 100 Continue to wait for)
DROP_RESPONSE_HEADERS = {"content-length", "connection", "keep-alive", "transfer-encoding",
                         "date", "server"}


def openai_error(status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    """An OpenAI error response (the body shape is ``sluice.api.openai.error_body``'s)."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class TryElsewhere(Exception):
    """The worker did not answer this request.

    Attributes:
        refused: no connection was made (nothing was sent).
        sent: the request was sent, then the connection died (or the worker was ejected)
            before any byte came back.
        kind: why to eject the worker (``EndpointSet.eject``): ``refused`` or ``broken``;
            None when it answered 503 (loading or draining) or was ejected already.
    """

    def __init__(self, message: str, refused: bool, sent: bool = False,
                 kind: str | None = None):
        super().__init__(message)
        self.refused = refused
        self.sent = sent
        self.kind = kind


async def forward(request: Request, state: RouterState, endpoint: Endpoint, path: str,
                  raw: bytes, headers: dict[str, str], exchange: Exchange) -> Response:
    """Send to ``endpoint`` and return its answer (streamed when it is an event stream).

    The first body chunk (or the whole body of a plain answer) is awaited here, within
    ``first_byte_timeout``, so a worker that dies before answering can still be replaced;
    so can one that is ejected meanwhile (``EndpointSet.eject``). A timeout is a 504; it
    ejects the worker unless the worker is still generating (``EndpointSet.generating``):
    a long plain answer on a busy worker is that request's timeout, and ejecting the
    worker would send its other unanswered requests away to start over.

    Raises:
        TryElsewhere: no connection, a 503, a connection that broke before any byte, or
            the worker ejected; the exchange is released uncounted.
    """
    streaming = False
    upstream: UpstreamResponse | None = None

    async def first_byte() -> tuple[UpstreamResponse, bytes | None, bool]:
        nonlocal upstream
        upstream = await state.upstream.request("POST", endpoint.url, path, raw, headers)
        exchange.on_headers(upstream.status, upstream.headers)
        if upstream.status == 503:
            return upstream, None, False
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return upstream, await upstream.read(), False
        return upstream, await anext(upstream, b""), True

    try:
        exchange.waiting(asyncio.current_task())
        try:
            upstream, content, stream = await unless_disconnected(request, first_byte())
        finally:
            exchange.answered()
        if upstream.status == 503:
            exchange.on_complete(counted=False)
            raise TryElsewhere("answered 503", refused=False)
        out_headers = response_headers(upstream)
        if stream:
            streaming = True
            finish = _finisher(upstream, exchange)
            return RelayResponse(_relay(upstream, exchange, content or b"", finish),
                                 upstream.status, out_headers,
                                 on_disconnect=lambda: setattr(exchange, "status", CLIENT_CLOSED),
                                 ended=upstream.at_eof, on_close=finish)
        exchange.on_body(content)
        return Response(content, upstream.status, out_headers)
    except asyncio.CancelledError:
        if not exchange.absorb_ejection():
            raise
        if exchange.timed_out:
            return _timed_out(state, endpoint, exchange, "no first byte")
        exchange.on_complete(counted=False)
        raise TryElsewhere(f"its worker was ejected ({exchange.ejected})", refused=False,
                            sent=True) from None
    except ClientDisconnected:
        exchange.absorb_ejection()  # (both at once: the client's leaving wins)
        logger.info("client left; closed the request to %s", endpoint.url)
        exchange.status = CLIENT_CLOSED
        return Response(status_code=CLIENT_CLOSED)
    except ConnectFailed as exc:  # not sent
        exchange.on_complete(counted=False)
        raise TryElsewhere(f"connect failed: {exc}", refused=True, kind="refused") from exc
    except TimeoutError as exc:  # (a ReadTimeout)
        return _timed_out(state, endpoint, exchange, type(exc).__name__)
    except ConnectionLost as exc:  # sent, and the worker died before answering
        exchange.on_complete(counted=False)
        raise TryElsewhere(f"connection lost before the first byte: {exc}",
                            refused=False, sent=True, kind="broken") from exc
    except UpstreamError as exc:
        state.endpoints.mark_down(endpoint, f"{type(exc).__name__}: {exc}")
        exchange.status = 502
        return openai_error(502, f"worker {endpoint.url} failed: {type(exc).__name__}",
                            "server_error", code="upstream_error")
    finally:
        if not streaming:
            if upstream is not None:
                _close(upstream)
            exchange.on_complete()


def _timed_out(state: RouterState, endpoint: Endpoint, exchange: Exchange,
               why: str) -> Response:
    """504: no first byte within ``--first-byte-timeout`` (``Exchange.time_out``), or a
    ``ReadTimeout``. The worker is ejected unless it is still generating
    (``EndpointSet.generating``): then only this request ends."""
    if state.endpoints.generating(endpoint):
        logger.warning("no answer from %s in time; it is still generating, so only this "
                       "request ends", endpoint.url)
    else:
        state.endpoints.eject(endpoint, "timeout", f"no answer in time ({why})")
    exchange.status = 504
    return openai_error(504, f"worker {endpoint.url} did not answer in time ({why})",
                        "server_error", code="upstream_timeout")


def _close(upstream: UpstreamResponse) -> None:
    """Give the connection back when the answer was read to its end; otherwise close it, so
    the worker sees the client leave and aborts the request."""
    if upstream.at_eof():
        upstream.release()
    else:
        upstream.close()


def _finisher(upstream: UpstreamResponse, exchange: Exchange) -> Callable[[], None]:
    """Close a relayed answer and complete its exchange, once: from the relay's ``finally``
    when it ran, else from its ``RelayResponse``'s ``on_close`` (a relay that never started
    runs no ``finally``: the client left before its answer began)."""
    finished = False

    def finish() -> None:
        nonlocal finished
        if not finished:
            finished = True
            _close(upstream)
            exchange.on_complete()
    return finish


async def _relay(upstream: UpstreamResponse, exchange: Exchange, first: bytes,
                 finish: Callable[[], None]) -> AsyncIterator[bytes]:
    """Yield ``first``, then the rest of the worker's bytes as they arrive; ``finish`` when
    done, failed, or closed early (client gone)."""
    try:
        if first:
            exchange.on_chunk(first)
            yield first
        async for chunk in upstream:
            exchange.on_chunk(chunk)
            yield chunk
    except asyncio.CancelledError:  # the client left while the worker was generating
        exchange.status = CLIENT_CLOSED
        raise
    except UpstreamError as exc:  # headers are sent: an error event
        logger.warning("stream from %s broke: %s: %s", exchange.endpoint.url,
                       type(exc).__name__, exc)
        timeout = isinstance(exc, ReadTimeout)
        exchange.state.metrics.broken_streams.labels(
            exchange.model, "timeout" if timeout else "broken").inc()
        exchange.state.endpoints.eject(exchange.endpoint, "timeout" if timeout else "broken",
                                       "its stream timed out" if timeout else "its stream broke")
        error = {"error": {"message": f"the worker stream broke: {type(exc).__name__}",
                           "type": "server_error", "param": None, "code": "upstream_error"}}
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        finish()


def forward_headers(request: Request, keys: KeyRing | None) -> dict[str, str]:
    """The client's headers to send on: not the hop-by-hop ones, nor those its
    ``Connection`` header names (RFC 9110 §7.6.1); its router API key stays here."""
    drop = DROP_REQUEST_HEADERS if keys is None else DROP_REQUEST_HEADERS | {"authorization"}
    listed = request.headers.get("connection")
    if listed and listed.lower() not in ("keep-alive", "close"):  # (the usual values: no set)
        drop = drop | {name.strip().lower() for name in listed.split(",")}
    headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
    headers.setdefault("accept-encoding", "identity")  # we relay bytes; don't invite gzip
    return headers


def response_headers(upstream: UpstreamResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k not in DROP_RESPONSE_HEADERS}
