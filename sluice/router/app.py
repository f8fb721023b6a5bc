"""`sluice router`: one OpenAI endpoint in front of several workers.

Every OpenAI route goes through ``route_request``: read ``model`` (and ``stream``) from the
JSON body, let the policy pick a ready worker that serves the model, forward the raw body,
and hand back the worker's status and bytes unchanged (streams are relayed chunk by chunk,
unbuffered). The client going away closes the upstream request, so the worker aborts it and
frees its KV cache.

Errors are OpenAI error bodies: 400 malformed JSON, 404 unknown model (no worker contacted),
503 no ready worker, 502 worker unreachable, 504 worker silent past ``--read-timeout``.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from sluice.api import metrics as names
from sluice.api.openai import error_body
from sluice.logs import quiet_probe_access_logs
from sluice.router import discovery
from sluice.router.endpoints import Endpoint, EndpointSet, Lease
from sluice.router.policy import POLICIES, RoutingPolicy, RoutingRequest, make_policy

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Hop-by-hop headers (RFC 9110 §7.6.1) and ones the HTTP client or server sets itself.
DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                        "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection"}
DROP_RESPONSE_HEADERS = {"content-length", "connection", "keep-alive", "transfer-encoding",
                         "date", "server"}
CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; only seen in metrics
DISCOVERY = ("static", "kubernetes")


@dataclass
class RouterConfig:
    """Router settings (flags map 1:1).

    Attributes:
        workers: worker base URLs (static discovery).
        discovery: ``static`` (``workers``) or ``kubernetes``.
        namespace: the namespace Kubernetes discovery watches.
        kubeconfig: kubeconfig path for Kubernetes discovery; None: ``$KUBECONFIG``, the
            in-cluster service account, or ``~/.kube/config``.
        policy: a name in ``sluice.router.policy.POLICIES``.
        connect_timeout: seconds to open a connection to a worker.
        read_timeout: seconds to wait for any byte from a worker (the first one, and each gap
            between stream chunks).
        poll_interval: seconds between health polls of each worker.
    """

    workers: list[str] = field(default_factory=list)
    discovery: str = "static"
    namespace: str = "default"
    kubeconfig: str | None = None
    policy: str = "least-load"
    connect_timeout: float = 5.0
    read_timeout: float = 600.0
    poll_interval: float = 1.0


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(names.ROUTER_REQUESTS, "Requests by served model and HTTP status.",
                                ["model", "status"], registry=self.registry)
        self.ttft = Histogram(names.ROUTER_TTFT, "Seconds from request arrival to the first "
                              "streamed chunk from the worker.", buckets=names.TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram(names.ROUTER_ITL, "Seconds between streamed chunks from the worker.",
                             buckets=names.ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(names.ROUTER_E2E, "Seconds from request arrival to the end of the "
                             "worker's response.", buckets=names.E2E_BUCKETS, registry=self.registry)
        self.in_flight = Gauge(names.ROUTER_IN_FLIGHT, "Requests being served by a worker.",
                               registry=self.registry)


@dataclass
class RouterState:
    """Everything the request path needs, created in the lifespan."""

    config: RouterConfig
    endpoints: EndpointSet
    policy: RoutingPolicy
    metrics: RouterMetrics
    client: httpx.AsyncClient


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was complete."""


def openai_error(status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    """An OpenAI error response (the body shape is ``sluice.api.openai.error_body``'s)."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


# ---------------------------------------------------------------------------- the proxy path

class _Exchange:
    """Bookkeeping of one proxied request: the endpoint lease and the metric hooks.

    ``on_chunk`` runs per upstream chunk; ``on_complete`` (idempotent) from ``finally``.
    """

    def __init__(self, state: RouterState, model: str, endpoint: Endpoint, start: float):
        self.state, self.model, self.start = state, model, start
        self.lease = Lease(endpoint)
        self.status = 0
        self._last_chunk: float | None = None
        state.metrics.in_flight.inc()

    def on_chunk(self) -> None:
        now = time.monotonic()
        if self._last_chunk is None:
            self.state.metrics.ttft.observe(now - self.start)
        else:
            self.state.metrics.itl.observe(now - self._last_chunk)
        self._last_chunk = now

    def on_complete(self, counted: bool = True) -> None:
        """Release the endpoint; count the request unless ``counted`` is False (a connect
        failure that will be retried elsewhere)."""
        if not self.lease.release():
            return
        self.state.metrics.in_flight.dec()
        if counted:
            self.state.metrics.e2e.observe(time.monotonic() - self.start)
            self.state.metrics.requests.labels(self.model, str(self.status)).inc()


async def route_request(request: Request, path: str) -> Response:
    """Proxy one OpenAI request to a worker; see the module docstring for the error cases.

    A worker that refuses the connection or answers 503 (loading, draining) has processed
    nothing, so the request is tried on the next candidate; the worker is marked not ready
    until the poller sees it healthy again.

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
    routing = RoutingRequest(model=model, stream=body.get("stream") is True, body=body)
    headers = _forward_headers(request)
    tried: set[str] = set()
    refused_by_all = True
    while candidates := [e for e in state.endpoints.ready_for(model) if e.url not in tried]:
        endpoint = await state.policy.choose(candidates, routing)
        exchange = _Exchange(state, model, endpoint, start)
        try:
            return await _forward(request, state, endpoint, path, raw, headers, exchange)
        except _TryElsewhere as exc:
            state.endpoints.mark_down(endpoint, str(exc))
            tried.add(endpoint.url)
            refused_by_all &= exc.refused
    if tried and refused_by_all:
        return _count(state, model, openai_error(
            502, f"could not connect to any worker serving `{model}`", "server_error",
            code="upstream_unreachable"))
    return _count(state, model, openai_error(
        503, f"no ready worker serves `{model}`; retry shortly", "server_error",
        code="no_ready_worker"))


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
    """The worker did not take the request (``refused``: no connection; else a 503)."""

    def __init__(self, message: str, refused: bool):
        super().__init__(message)
        self.refused = refused


async def _forward(request: Request, state: RouterState, endpoint: Endpoint, path: str,
                   raw: bytes, headers: dict[str, str], exchange: _Exchange) -> Response:
    """Send to ``endpoint`` and return its answer (streamed when it is an event stream).

    Raises:
        _TryElsewhere: connection refused or 503; the exchange is released uncounted.
    """
    upstream_request = state.client.build_request("POST", endpoint.url + path, content=raw,
                                                  headers=headers)
    streaming = False
    upstream: httpx.Response | None = None
    try:
        upstream = await _unless_disconnected(
            request.receive, state.client.send(upstream_request, stream=True))
        exchange.status = upstream.status_code
        if upstream.status_code == 503:
            exchange.on_complete(counted=False)
            raise _TryElsewhere("answered 503", refused=False)
        out_headers = _response_headers(upstream)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            streaming = True
            return RelayResponse(_relay(upstream, exchange), upstream.status_code, out_headers,
                                 on_disconnect=lambda: setattr(exchange, "status", CLIENT_CLOSED))
        content = await _unless_disconnected(request.receive, _read_raw(upstream))
        return Response(content, upstream.status_code, out_headers)
    except ClientDisconnected:
        logger.info("client left; closed the request to %s", endpoint.url)
        exchange.status = CLIENT_CLOSED
        return Response(status_code=CLIENT_CLOSED)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing was sent
        exchange.on_complete(counted=False)
        raise _TryElsewhere(f"connect failed: {exc}", refused=True) from exc
    except httpx.TimeoutException as exc:
        exchange.status = 504
        return openai_error(504, f"worker {endpoint.url} did not answer in time "
                            f"({type(exc).__name__})", "server_error", code="upstream_timeout")
    except httpx.HTTPError as exc:
        state.endpoints.mark_down(endpoint, f"{type(exc).__name__}: {exc}")
        exchange.status = 502
        return openai_error(502, f"worker {endpoint.url} failed: {type(exc).__name__}",
                            "server_error", code="upstream_error")
    finally:
        if not streaming:
            if upstream is not None:
                await upstream.aclose()
            exchange.on_complete()


async def _relay(upstream: httpx.Response, exchange: _Exchange) -> AsyncIterator[bytes]:
    """Yield the worker's bytes as they arrive; close the upstream response when done,
    failed, or closed early (client gone)."""
    try:
        async for chunk in upstream.aiter_raw():
            exchange.on_chunk()
            yield chunk
    except httpx.HTTPError as exc:  # headers are sent: end the stream with an error event
        logger.warning("stream from %s broke: %s: %s", exchange.lease.endpoint.url,
                       type(exc).__name__, exc)
        error = {"error": {"message": f"the worker stream broke: {type(exc).__name__}",
                           "type": "server_error", "param": None, "code": "upstream_error"}}
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await upstream.aclose()
        exchange.on_complete()


class RelayResponse(Response):
    """Streams an async byte iterator; stops it as soon as the client disconnects.

    Unlike Starlette's StreamingResponse this always closes the iterator (running its
    ``finally``) on every exit path, including a disconnect before the first chunk.
    """

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int, headers: dict[str, str],
                 on_disconnect: Callable[[], None] = lambda: None):
        self.chunks = chunks
        self.on_disconnect = on_disconnect
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.ensure_future(self._send_all(send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done() and not relay.done():
                self.on_disconnect()
        finally:
            for task in (relay, gone):
                task.cancel()
            results = await asyncio.gather(relay, gone, return_exceptions=True)
            await self.chunks.aclose()
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):
            raise error

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _read_raw(upstream: httpx.Response) -> bytes:
    return b"".join([chunk async for chunk in upstream.aiter_raw()])


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected.

    Must only be called after the request body has been read.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


def _forward_headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP_REQUEST_HEADERS}
    headers.setdefault("accept-encoding", "identity")  # we relay bytes; don't invite gzip
    return headers


def _response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in DROP_RESPONSE_HEADERS}


def _count(state: RouterState, model: str | None, response: Response) -> Response:
    """Count a request answered by the router itself. Unknown names are not used as label
    values (clients choose them: unbounded), they count as ``model=""``."""
    state.metrics.requests.labels(model or "", str(response.status_code)).inc()
    return response


# ---------------------------------------------------------------------------- the app

def create_app(config: RouterConfig) -> FastAPI:
    """Build the router app. The shared HTTP client, the endpoint poller and the policy are
    created in the lifespan and live in ``app.state.router``.

    Raises:
        ValueError: unknown policy or discovery name.
        kubernetes.config.ConfigException: Kubernetes discovery without a usable kubeconfig.
    """
    policy = make_policy(config.policy)  # fail before serving, not on the first request
    if config.discovery not in DISCOVERY:
        raise ValueError(f"unknown discovery {config.discovery!r}; known: {', '.join(DISCOVERY)}")
    kube_client = discovery.api_client(config.kubeconfig) if config.discovery == "kubernetes" \
        else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(connect=config.connect_timeout, read=config.read_timeout,
                                write=config.connect_timeout, pool=config.connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            endpoints = EndpointSet(config.workers, poll_interval=config.poll_interval)
            app.state.router = RouterState(config, endpoints, policy, RouterMetrics(), client)
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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route_request(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route_request(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": request.app.state.router.endpoints.model_entries()}

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
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="worker base URL, e.g. http://127.0.0.1:8001 (repeatable; static "
                        "discovery)")
    parser.add_argument("--discovery", choices=DISCOVERY, default="static",
                        help="static: the --worker URLs; kubernetes: the ready endpoints of the "
                        "InferenceServices' worker Services in --namespace")
    parser.add_argument("--namespace", default=None,
                        help="namespace to watch (kubernetes discovery; default: the pod's own "
                        "namespace, else 'default')")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig file (kubernetes discovery; default: $KUBECONFIG, the "
                        "in-cluster service account, ~/.kube/config)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind")
    parser.add_argument("--policy", default="least-load", choices=sorted(POLICIES),
                        help="routing policy")
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="seconds to connect to a worker")
    parser.add_argument("--read-timeout", type=float, default=600.0,
                        help="seconds to wait for the first byte and between stream chunks")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between health polls of each worker")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    kubernetes = args.discovery == "kubernetes"
    if kubernetes and args.worker:
        logger.error("--worker and --discovery kubernetes are exclusive")
        return 2
    if not kubernetes and not args.worker:
        logger.warning("no --worker given: every request will get 503")
    namespace = args.namespace or discovery.default_namespace()
    config = RouterConfig(workers=args.worker, discovery=args.discovery, namespace=namespace,
                          kubeconfig=args.kubeconfig, policy=args.policy,
                          connect_timeout=args.connect_timeout, read_timeout=args.read_timeout,
                          poll_interval=args.poll_interval)
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
                else ", ".join(args.worker) or "no workers")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=30)
    return 0
