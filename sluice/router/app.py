"""`sluice router`: one OpenAI endpoint in front of several workers.

Every OpenAI route goes through ``route_request``: read ``model`` (and ``stream``) from the
JSON body, pass admission control (a per-model priority/EDF queue; ``sluice.router.dispatch``),
let the policy pick a ready worker that serves the model, forward the raw body, and hand
back the worker's status and bytes unchanged (streams are relayed chunk by chunk,
unbuffered). The client going away closes the upstream request, so the worker aborts it and
frees its KV cache.

A worker that refuses the connection or answers 503 has processed nothing: the request goes
to the next candidate. A worker that dies after taking the request but before its first
byte (SIGKILL, OOM) costs one retry elsewhere; a stream that breaks after its first byte
ends with an SSE error event. Either way the worker is marked down until a poll finds it
healthy again (passive health checking).

Errors are OpenAI error bodies: 400 malformed JSON or routing header, 404 unknown model (no
worker contacted), 429 admission queue full (with ``Retry-After``), 503 no ready worker,
502 worker unreachable or failed, 504 no first byte within ``--first-byte-timeout`` or a gap
longer than ``--read-timeout``.

Workers come from ``--worker URL`` (static discovery) or, with ``--discovery kubernetes``,
from the InferenceServices and worker Endpoints of one namespace (``sluice.router.discovery``);
both feed the same ``EndpointSet`` and the same proxy path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sluice.api.openai import error_body, http_error_body
from sluice.argtypes import http_url, port
from sluice.logs import quiet_probe_access_logs
from sluice.router import discovery
from sluice.router.admission import Rejected
from sluice.router.dispatch import BadRoutingHeader, Dispatcher, DispatchSettings
from sluice.router.endpoints import Endpoint, EndpointSet, Lease, WorkerLoad
from sluice.router.metrics import DemandCollector, RouterMetrics
from sluice.router.policy import DEFAULT_POLICY, POLICIES, Prediction, RoutingRequest
from sluice.router.relay import ClientDisconnected, RelayResponse, unless_disconnected

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Hop-by-hop headers (RFC 9110 §7.6.1) and ones the HTTP client or server sets itself.
DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                        "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection"}
DROP_RESPONSE_HEADERS = {"content-length", "connection", "keep-alive", "transfer-encoding",
                         "date", "server"}
CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; only seen in metrics
DISCOVERY = ("static", "kubernetes", "file")
NO_WORKER_RETRY_AFTER_S = 5  # a replica may be starting (scale from zero)


@dataclass
class RouterConfig:
    """Router settings (flags map 1:1).

    Attributes:
        workers: worker base URLs (static discovery).
        discovery: ``static`` (``workers``), ``kubernetes``, or ``file`` (``workers_file``,
            re-read when it changes: the ``sluice up`` supervisor's autoscaled worker set).
        workers_file: the JSON file of file discovery (``EndpointSet.reload_file``).
        namespace: the namespace Kubernetes discovery watches.
        kubeconfig: kubeconfig path for Kubernetes discovery; None: ``$KUBECONFIG``, the
            in-cluster service account, or ``~/.kube/config``.
        dispatch: policy, objectives and admission settings (``DispatchSettings``).
        connect_timeout: seconds to open a connection to a worker.
        first_byte_timeout: seconds from sending a request to its first byte of body (the
            worker's whole answer for a plain request); above realistic TTFT plus queueing.
        read_timeout: seconds allowed between two chunks of a stream.
        poll_interval: seconds between health polls of each worker.
    """

    workers: list[str] = field(default_factory=list)
    discovery: str = "static"
    workers_file: str | None = None
    namespace: str = "default"
    kubeconfig: str | None = None
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    connect_timeout: float = 5.0
    first_byte_timeout: float = 300.0
    read_timeout: float = 600.0
    poll_interval: float = 1.0


@dataclass
class RouterState:
    """Everything the request path needs, created in the lifespan."""

    config: RouterConfig
    endpoints: EndpointSet
    dispatcher: Dispatcher
    metrics: RouterMetrics
    client: httpx.AsyncClient  # polls
    session: aiohttp.ClientSession  # the proxy path (aiohttp: about half httpx's CPU per request)


def openai_error(status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    """An OpenAI error response (the body shape is ``sluice.api.openai.error_body``'s)."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


# ---------------------------------------------------------------------------- the proxy path

class _Exchange:
    """Bookkeeping of one request sent to one endpoint: the lease, the metric hooks and the
    latency observations.

    ``on_chunk`` runs per upstream chunk; ``on_complete`` (idempotent) from ``finally``.
    The first token is the first SSE event after a chat stream's role events (one per
    choice, sent before any token); for a plain response, the whole body.
    """

    def __init__(self, state: RouterState, routing: RoutingRequest, endpoint: Endpoint,
                 start: float, prediction: Prediction):
        self.state, self.routing, self.model, self.start = state, routing, routing.model, start
        self.endpoint, self.prediction = endpoint, prediction
        self.lease = Lease(endpoint, prefill_tokens=prediction.features[3] * 1000.0)
        self.sent_at = time.monotonic()
        self.status = 0
        self._role_events = _role_events(routing)
        self._events = 0
        self._first_token_at: float | None = None
        self._last_chunk: float | None = None
        self._gaps = 0
        state.metrics.in_flight.inc()
        state.dispatcher.dispatched(endpoint, routing)
        state.dispatcher.demand.started(self.model)

    def on_headers(self, status: int, headers: Any) -> None:
        self.status = status
        report = WorkerLoad.from_headers(headers, time.monotonic())
        if report is not None:
            self.endpoint.reported = report

    def on_chunk(self, chunk: bytes) -> None:
        now = time.monotonic()
        if self._first_token_at is None:
            self._events += chunk.count(b"data: ")
            if self._events > self._role_events:
                self._first_token(now)
        else:
            self.state.metrics.itl.observe(now - self._last_chunk)
            self._gaps += 1
        self._last_chunk = now

    def _first_token(self, now: float) -> None:
        self._first_token_at = now
        self.state.metrics.ttft.observe(now - self.start)
        self.state.dispatcher.demand.first_token(self.model, now - self.start,
                                                 self.routing.ttft_slo_s)
        self.lease.first_token()
        self.state.dispatcher.first_token(self.endpoint, self.prediction, now - self.sent_at,
                                          self.model)

    def on_complete(self, counted: bool = True) -> None:
        """Release the endpoint; count the request unless ``counted`` is False (it will be
        tried elsewhere)."""
        if not self.lease.release():
            return
        self.state.metrics.in_flight.dec()
        gap = None
        if self._gaps and self._first_token_at is not None and self._last_chunk is not None:
            gap = (self._last_chunk - self._first_token_at) / self._gaps
        self.state.dispatcher.finished(self.endpoint, self.prediction, gap, self.model)
        self.state.dispatcher.demand.finished(self.model, gap if counted else None,
                                              self.routing.itl_slo_s)
        if counted:
            self.state.metrics.e2e.observe(time.monotonic() - self.start)
            self.state.metrics.requests.labels(self.model, str(self.status)).inc()


def _role_events(routing: RoutingRequest) -> int:
    """SSE events a chat stream sends before its first token (the role chunks)."""
    if not routing.stream or "messages" not in routing.body:
        return 0
    n = routing.body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


async def route_request(request: Request, path: str) -> Response:
    """Proxy one OpenAI request to a worker; see the module docstring for the error cases.

    Args:
        request: the client's request (its body is read here).
        path: the worker path to call, e.g. ``/v1/chat/completions``.
    """
    state: RouterState = request.app.state.router
    start = time.monotonic()
    try:
        raw = await request.body()
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    body, error = _parse(raw, state.endpoints)
    if error is not None:
        return _count(state, None, error)
    model = body["model"]
    try:
        routing = state.dispatcher.routing_request(body, request.headers, start)
    except BadRoutingHeader as exc:
        return _count(state, model, openai_error(400, str(exc), "invalid_request_error",
                                                 exc.param))
    state.dispatcher.demand.arrived(model)
    try:
        if not state.endpoints.ready_for(model) and not await unless_disconnected(
                request.receive, state.dispatcher.hold(model)):
            return _no_ready_worker(state, model)
        released = not state.dispatcher.admit_now(routing) and await unless_disconnected(
            request.receive, state.dispatcher.admit(routing))
    except Rejected as exc:
        state.dispatcher.demand.rejected(model)
        response = openai_error(429, str(exc), "rate_limit_error", code=exc.reason)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return _count(state, model, response)
    except ClientDisconnected:
        return _count(state, model, Response(status_code=CLIENT_CLOSED))
    try:
        return await _dispatch(request, state, routing, raw, path, start, released)
    finally:
        if released:  # (normally settled at its lease already; this covers giving up)
            state.dispatcher.settled(model)


async def _dispatch(request: Request, state: RouterState, routing: RoutingRequest, raw: bytes,
                    path: str, start: float, released: bool) -> Response:
    """Send to the policy's pick; on a worker that took nothing, the next candidate.
    ``released``: the request came out of the admission queue (settle it once leased)."""
    model = routing.model
    headers = _forward_headers(request)
    tried: set[str] = set()
    refused_by_all, retried = True, False
    while candidates := [e for e in state.endpoints.ready_for(model) if e.url not in tried]:
        endpoint, prediction = await state.dispatcher.choose(candidates, routing)
        exchange = _Exchange(state, routing, endpoint, start, prediction)
        if released:  # its load is visible now: the queue may release the next one
            state.dispatcher.settled(model)
            released = False
        try:
            return await _forward(request, state, endpoint, path, raw, headers, exchange)
        except _TryElsewhere as exc:
            state.endpoints.mark_down(endpoint, str(exc))
            tried.add(endpoint.url)
            refused_by_all &= exc.refused
            if exc.sent:  # the worker may have started on it: one more try, no more
                if retried:
                    return _count(state, model, openai_error(
                        502, f"two workers failed before answering: {exc}", "server_error",
                        code="upstream_error"))
                retried = True
                state.metrics.retries.inc()
    if tried and refused_by_all:
        return _count(state, model, openai_error(
            502, f"could not connect to any worker serving `{model}`", "server_error",
            code="upstream_unreachable"))
    return _no_ready_worker(state, model)


def _no_ready_worker(state: RouterState, model: str) -> Response:
    """503 + ``Retry-After``: no replica of ``model`` is ready (after any hold)."""
    state.dispatcher.demand.rejected(model)
    response = openai_error(503, f"no ready worker serves `{model}`; retry shortly",
                            "server_error", code="no_ready_worker")
    response.headers["Retry-After"] = str(NO_WORKER_RETRY_AFTER_S)
    return _count(state, model, response)


def _parse(raw: bytes, endpoints: EndpointSet) -> tuple[dict[str, Any], Response | None]:
    """The JSON body, or an error response: 400 malformed, 404 a model no worker serves,
    503 no worker has reported its models yet (the router just started)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        return {}, openai_error(400, f"the request body is not valid JSON: {type(exc).__name__}",
                                "invalid_request_error")
    if not isinstance(body, dict):
        return {}, openai_error(400, "the request body must be a JSON object",
                                "invalid_request_error")
    model = body.get("model")
    if not isinstance(model, str):
        return {}, openai_error(400, "'model' is required and must be a string",
                                "invalid_request_error", "model")
    well_formed = bool(model) and model == model.strip()
    if well_formed and endpoints.serves(model):
        return body, None
    if well_formed and not endpoints.any_models_known():
        return {}, openai_error(503, "no worker has reported its models yet; retry shortly",
                                "server_error", code="no_ready_worker")
    return {}, openai_error(404, f"The model `{model}` does not exist.",
                            "invalid_request_error", "model", "model_not_found")


class _TryElsewhere(Exception):
    """The worker did not answer this request.

    Attributes:
        refused: no connection was made (nothing was sent).
        sent: the request was sent, then the connection died before any byte came back.
        (Neither: the worker answered 503, loading or draining.)
    """

    def __init__(self, message: str, refused: bool, sent: bool = False):
        super().__init__(message)
        self.refused = refused
        self.sent = sent


# the connection died under a request: it may be resent elsewhere if nothing came back yet
_BROKEN = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError)
_TIMEOUTS = (asyncio.TimeoutError, aiohttp.ServerTimeoutError)


async def _forward(request: Request, state: RouterState, endpoint: Endpoint, path: str,
                   raw: bytes, headers: dict[str, str], exchange: _Exchange) -> Response:
    """Send to ``endpoint`` and return its answer (streamed when it is an event stream).

    The first body chunk (or the whole body of a plain answer) is awaited here, within
    ``first_byte_timeout``, so a worker that dies before answering can still be replaced.

    Raises:
        _TryElsewhere: no connection, a 503, or a connection that broke before any byte;
            the exchange is released uncounted.
    """
    streaming = False
    upstream: aiohttp.ClientResponse | None = None

    async def first_byte() -> tuple[aiohttp.ClientResponse, bytes | None,
                                    AsyncIterator[bytes] | None]:
        nonlocal upstream
        upstream = await state.session.post(endpoint.url + path, data=raw, headers=headers)
        exchange.on_headers(upstream.status, upstream.headers)
        if upstream.status == 503:
            return upstream, None, None
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return upstream, await upstream.read(), None
        chunks = upstream.content.iter_any()
        return upstream, await anext(chunks, b""), chunks

    try:
        upstream, content, rest = await unless_disconnected(
            request.receive, _within(state.config.first_byte_timeout, first_byte()))
        if upstream.status == 503:
            exchange.on_complete(counted=False)
            raise _TryElsewhere("answered 503", refused=False)
        out_headers = _response_headers(upstream)
        if rest is not None:
            streaming = True
            return RelayResponse(_relay(upstream, rest, exchange, content or b""),
                                 upstream.status, out_headers,
                                 on_disconnect=lambda: setattr(exchange, "status", CLIENT_CLOSED))
        return Response(content, upstream.status, out_headers)
    except ClientDisconnected:
        logger.info("client left; closed the request to %s", endpoint.url)
        exchange.status = CLIENT_CLOSED
        return Response(status_code=CLIENT_CLOSED)
    except aiohttp.ClientConnectorError as exc:  # nothing was sent
        exchange.on_complete(counted=False)
        raise _TryElsewhere(f"connect failed: {exc}", refused=True) from exc
    except _TIMEOUTS as exc:
        exchange.status = 504
        return openai_error(504, f"worker {endpoint.url} did not answer in time "
                            f"({type(exc).__name__})", "server_error", code="upstream_timeout")
    except _BROKEN as exc:  # sent, and the worker died before answering
        exchange.on_complete(counted=False)
        raise _TryElsewhere(f"connection lost before the first byte: {type(exc).__name__}",
                            refused=False, sent=True) from exc
    except aiohttp.ClientError as exc:
        state.endpoints.mark_down(endpoint, f"{type(exc).__name__}: {exc}")
        exchange.status = 502
        return openai_error(502, f"worker {endpoint.url} failed: {type(exc).__name__}",
                            "server_error", code="upstream_error")
    finally:
        if not streaming:
            if upstream is not None:
                _close(upstream)
            exchange.on_complete()


async def _within(seconds: float, work: Awaitable[T]) -> T:
    async with asyncio.timeout(seconds):  # no extra task, unlike wait_for
        return await work


def _close(upstream: aiohttp.ClientResponse) -> None:
    """Give the connection back when the answer was read to its end; otherwise close it, so
    the worker sees the client leave and aborts the request."""
    if upstream.content.at_eof():
        upstream.release()
    else:
        upstream.close()


async def _relay(upstream: aiohttp.ClientResponse, rest: AsyncIterator[bytes],
                 exchange: _Exchange, first: bytes) -> AsyncIterator[bytes]:
    """Yield ``first``, then the rest of the worker's bytes as they arrive; close the
    upstream response when done, failed, or closed early (client gone)."""
    try:
        if first:
            exchange.on_chunk(first)
            yield first
        async for chunk in rest:
            exchange.on_chunk(chunk)
            yield chunk
    except (aiohttp.ClientError, *_TIMEOUTS) as exc:  # headers are sent: an error event
        logger.warning("stream from %s broke: %s: %s", exchange.endpoint.url,
                       type(exc).__name__, exc)
        if not isinstance(exc, _TIMEOUTS):
            exchange.state.endpoints.mark_down(exchange.endpoint, "its stream broke")
        error = {"error": {"message": f"the worker stream broke: {type(exc).__name__}",
                           "type": "server_error", "param": None, "code": "upstream_error"}}
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        _close(upstream)
        exchange.on_complete()


def _forward_headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP_REQUEST_HEADERS}
    headers.setdefault("accept-encoding", "identity")  # we relay bytes; don't invite gzip
    return headers


def _response_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in DROP_RESPONSE_HEADERS}


def _count(state: RouterState, model: str | None, response: Response) -> Response:
    """Count a request answered by the router itself. Unknown names are not used as label
    values (clients choose them: unbounded), they count as ``model=""``."""
    state.metrics.requests.labels(model or "", str(response.status_code)).inc()
    return response


# ---------------------------------------------------------------------------- the app

def create_app(config: RouterConfig) -> FastAPI:
    """Build the router app. The shared HTTP client, the endpoint poller and the dispatcher
    (policy, admission queues, latency models) are created in the lifespan and live in
    ``app.state.router``.

    Raises:
        ValueError: unknown policy or discovery name, or a bad setting.
        kubernetes.config.ConfigException: Kubernetes discovery without a usable kubeconfig.
    """
    Dispatcher(EndpointSet(), config.dispatch, RouterMetrics())  # fail before serving
    if config.discovery not in DISCOVERY:
        raise ValueError(f"unknown discovery {config.discovery!r}; known: {', '.join(DISCOVERY)}")
    kube_client = discovery.api_client(config.kubeconfig) if config.discovery == "kubernetes" \
        else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(connect=config.connect_timeout, read=config.read_timeout,
                                write=config.connect_timeout, pool=config.connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        proxy_timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout,
                                              sock_read=config.read_timeout)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client, \
                aiohttp.ClientSession(connector=connector, timeout=proxy_timeout,
                                      auto_decompress=False, trust_env=False) as session:
            endpoints = EndpointSet(config.workers, poll_interval=config.poll_interval,
                                    workers_file=config.workers_file)
            metrics = RouterMetrics()
            dispatcher = Dispatcher(endpoints, config.dispatch, metrics)
            metrics.registry.register(DemandCollector(dispatcher.demand_snapshot))
            endpoints.on_polled = dispatcher.tick
            app.state.router = RouterState(config, endpoints, dispatcher, metrics, client,
                                           session)
            watcher = None
            if kube_client is not None:
                watcher = discovery.KubernetesDiscovery(endpoints, config.namespace, kube_client,
                                                        asyncio.get_running_loop())
                watcher.start()
            try:  # a first look, so a router started after its workers serves at once
                await asyncio.wait_for(endpoints.poll(client), timeout=endpoints.poll_timeout + 1)
            except asyncio.TimeoutError:
                pass
            poller = asyncio.create_task(endpoints.poll_forever(client), name="endpoint-poller")
            try:
                yield
            finally:
                poller.cancel()
                if watcher is not None:
                    watcher.stop()
                await asyncio.gather(poller, return_exceptions=True)

    app = FastAPI(title="sluice router", lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)  # unknown route, wrong method: OpenAI shape
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(http_error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code, headers=exc.headers)  # 405: Allow

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route_request(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route_request(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": request.app.state.router.endpoints.model_entries()}

    @app.get("/autoscale/demand")
    async def autoscale_demand(request: Request) -> dict[str, Any]:
        """Per served model: demand counters and gauges for autoscalers
        (``sluice.router.demand``, ``sluice.autoscale.observe``)."""
        return {"models": request.app.state.router.dispatcher.demand_snapshot()}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 while at least one worker is ready, else 503; the body lists the workers."""
        endpoints: EndpointSet = request.app.state.router.endpoints
        ready = endpoints.any_ready()
        body = {"status": "ok" if ready else "no ready worker",
                "workers": [e.summary() for e in endpoints]}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        """200 while the router itself serves, workers or not (its pod's probes: a router
        with no ready worker still answers, with 503 or 404, rather than vanish)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry = request.app.state.router.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="append", default=[], metavar="URL", type=http_url,
                        help="worker base URL, e.g. http://127.0.0.1:8001 (repeatable; static "
                        "discovery)")
    parser.add_argument("--discovery", choices=DISCOVERY, default="static",
                        help="static: the --worker URLs; kubernetes: the ready endpoints of the "
                        "InferenceServices' worker Services in --namespace; file: the "
                        "--workers-file, re-read when it changes")
    parser.add_argument("--workers-file", default=None, metavar="PATH",
                        help="file discovery: JSON {\"workers\": [URL, ...], \"models\": "
                        "[NAME, ...]} (written by `sluice up` when it autoscales)")
    parser.add_argument("--namespace", default=None,
                        help="namespace to watch (kubernetes discovery; default: the pod's own "
                        "namespace, else 'default')")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig file (kubernetes discovery; default: $KUBECONFIG, the "
                        "in-cluster service account, ~/.kube/config)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=port, default=8000, help="port to bind")
    defaults = DispatchSettings()
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                        help="routing policy (default: %(default)s)")
    parser.add_argument("--load-factor", type=float, default=defaults.load_factor,
                        help="prefix policy: no worker takes more than this times the average "
                        "in-flight load (default: %(default)s)")
    parser.add_argument("--prefix-key-chars", type=int, default=defaults.prefix_key_chars,
                        help="prompt characters hashed into the prefix key (default: %(default)s)")
    parser.add_argument("--slo-ttft-ms", type=float, default=defaults.slo_ttft_ms,
                        help="TTFT objective of requests whose InferenceService and x-slo-ttft-ms "
                        "header set none; 0: none (default: %(default)s)")
    parser.add_argument("--slo-itl-ms", type=float, default=0.0,
                        help="inter-token latency objective, likewise; 0: none (default)")
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue,
                        help="requests that may wait per model when no worker is predicted to "
                        "meet their TTFT objective; beyond it: 429 (default: %(default)s)")
    parser.add_argument("--queue-timeout", type=float, default=defaults.queue_timeout,
                        help="seconds a request may wait in the queue before 429 "
                        "(default: %(default)s)")
    parser.add_argument("--hold-timeout", type=float, default=defaults.hold_s,
                        help="seconds a request waits for a ready worker when none is ready "
                        "(scale from zero) before 503; an InferenceService with autoscaling "
                        "sets its own (default: %(default)s: no wait)")
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="seconds to connect to a worker (default: %(default)s)")
    parser.add_argument("--first-byte-timeout", type=float, default=300.0,
                        help="seconds from sending a request to its first byte (a plain "
                        "request: its whole answer) (default: %(default)s)")
    parser.add_argument("--read-timeout", type=float, default=600.0,
                        help="seconds allowed between stream chunks (default: %(default)s)")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between health polls of each worker")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    kubernetes = args.discovery == "kubernetes"
    if args.discovery != "static" and args.worker:
        logger.error("--worker and --discovery %s are exclusive", args.discovery)
        return 2
    if (args.discovery == "file") != (args.workers_file is not None):
        logger.error("--workers-file goes with, and only with, --discovery file")
        return 2
    if args.discovery == "static" and not args.worker:
        logger.warning("no --worker given: every request will get 503")
    namespace = args.namespace or discovery.default_namespace()
    dispatch = DispatchSettings(
        policy=args.policy, load_factor=args.load_factor, slo_ttft_ms=args.slo_ttft_ms or None,
        slo_itl_ms=args.slo_itl_ms or None, max_queue=args.max_queue,
        queue_timeout=args.queue_timeout, prefix_key_chars=args.prefix_key_chars,
        hold_s=args.hold_timeout)
    config = RouterConfig(workers=args.worker, discovery=args.discovery,
                          workers_file=args.workers_file, namespace=namespace,
                          kubeconfig=args.kubeconfig, dispatch=dispatch,
                          connect_timeout=args.connect_timeout,
                          first_byte_timeout=args.first_byte_timeout,
                          read_timeout=args.read_timeout, poll_interval=args.poll_interval)
    if kubernetes:
        from kubernetes.config import ConfigException
        try:
            app = create_app(config)
        except (ConfigException, OSError) as exc:
            logger.error("kubernetes discovery: no usable cluster configuration: %s", exc)
            return 2
    else:
        app = create_app(config)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    quiet_probe_access_logs()
    logger.info("router on http://%s:%d in front of %s", args.host, args.port,
                f"the InferenceServices in namespace {namespace}" if kubernetes
                else f"the workers in {args.workers_file}" if args.workers_file
                else ", ".join(args.worker) or "no workers")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=30)
    return 0
