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

A worker that fails (a poll cannot reach it or finds it unhealthy, a request to it times out
or loses its connection) is ejected: every request waiting there for its first byte goes to
another worker at once, rather than wait out a timeout (``sluice.router.endpoints``). A
kept-alive connection that the worker closed just as a request was written is not a failure:
the request is written again on another connection (``sluice.router.upstream``); the
router's idle keep-alive (4 s) stays below the worker's (uvicorn's 5 s), so that is rare.

With ``--api-keys FILE`` every /v1 route needs ``Authorization: Bearer KEY``; each key's
tenant has a priority ceiling and RPM/TPM limits (``sluice.router.tenants``). /health,
/livez, /metrics and /autoscale/demand stay open (probes, Prometheus, the autoscaler).

Errors are OpenAI error bodies: 400 malformed JSON or routing header (out of bounds too),
401 no or unknown API key, 403 a priority the client may not use, 404 unknown model (no
worker contacted), 413 a body over ``--max-body-bytes`` (refused while reading it), 429
admission queue full or a tenant's limit (with ``Retry-After``), 503 no ready worker, 502
worker unreachable or failed, 504 no first byte within ``--first-byte-timeout`` or a gap
longer than ``--read-timeout``.

A request for a cascade's name (an InferenceService with ``spec.cascade``: ``--manifest``, or
found by Kubernetes discovery) is answered by its tiers, smallest first, each through the
same path: ``sluice.router.cascade``.

Workers come from ``--worker URL`` (static discovery) or, with ``--discovery kubernetes``,
from the InferenceServices and worker Endpoints of one namespace (``sluice.router.discovery``);
both feed the same ``EndpointSet`` and the same proxy path.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import resource
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from sluice.api.body import MAX_BODY_BYTES, BodyTooLarge, read_body
from sluice.api.openai import (APIError, ChatCompletionRequest, CompletionRequest,
                               http_error_body, parse)
from sluice.argtypes import (count, factor, milliseconds, port, positive_count,
                             positive_milliseconds, positive_seconds, seconds, worker_url)
from sluice.logs import quiet_probe_access_logs
from sluice.router import discovery
from sluice.router.admission import Rejected
from sluice.router.cascade import manifest_cascades
from sluice.router.cascade import serve as serve_cascade
from sluice.router.dispatch import (NO_WORKER_RETRY_AFTER_S, BadRoutingHeader, Dispatcher,
                                    DispatchSettings)
from sluice.router.endpoints import EndpointSet
from sluice.router.deadlines import Deadlines
from sluice.router.exchange import Exchange
from sluice.router.metrics import DemandCollector, RouterMetrics
from sluice.router.http import RouterHTTP
from sluice.router.policy import DEFAULT_POLICY, POLICIES, RoutingRequest
from sluice.router.proxy import CLIENT_CLOSED, TryElsewhere, forward, forward_headers, openai_error
from sluice.router.relay import ClientDisconnected, unless_disconnected
from sluice.router.limits import (Charge, RateLimited, TenantCollector, TenantLimits,
                                  estimate_tokens)
from sluice.router.tenants import KeyFileError, KeyRing, Tenant, Unauthorized
from sluice.router.upstream import Upstream

logger = logging.getLogger(__name__)

DISCOVERY = ("static", "kubernetes", "file")
KEEPALIVE_S = 4.0  # below the worker's idle keep-alive (uvicorn's timeout_keep_alive, 5 s)


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
        boot_s: seconds a new worker takes to turn ready (``EndpointSet``'s prior for a
            503's ``Retry-After`` while none is ready); None: learnt from scale-ups.
        max_body_bytes: the largest request body accepted (413 beyond, found while reading).
        keepalive_timeout: seconds an idle worker connection is kept for reuse; below the
            worker's own idle timeout, so the router never writes on one the worker closes.
        api_keys: the API key file (``sluice.router.tenants``); None: no keys needed.
        manifest: an InferenceService manifest file (one or more documents) whose cascades
            the router serves, their tiers resolved to served names from the same file
            (static and file discovery; ``sluice up`` passes its own). Kubernetes discovery
            finds cascades in the namespace instead.
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
    boot_s: float | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    keepalive_timeout: float = KEEPALIVE_S
    api_keys: str | None = None
    manifest: str | None = None


@dataclass
class RouterState:
    """Everything the request path needs, created in the lifespan."""

    config: RouterConfig
    endpoints: EndpointSet
    dispatcher: Dispatcher
    metrics: RouterMetrics
    upstream: Upstream  # the proxy path's connections
    first_byte: Deadlines  # the requests waiting for their first byte (--first-byte-timeout)
    keys: KeyRing | None = None  # --api-keys
    tenants: TenantLimits = field(default_factory=TenantLimits)


# ---------------------------------------------------------------------------- the proxy path

# A request's header fields (names and values) are bounded as its body is: they are forwarded
# whole, and a worker that refuses a larger set (a reset before any byte) would be ejected
# for one client's request, its other clients answered 503 meanwhile.
MAX_HEADER_BYTES = 64 * 1024

async def route_request(request: Request, path: str) -> Response:
    """Proxy one OpenAI request to a worker; see the module docstring for the error cases.

    Args:
        request: the client's request (its body is read here).
        path: the worker path to call, e.g. ``/v1/chat/completions``.
    """
    state: RouterState = request.app.state.router
    start = time.monotonic()
    if sum(len(k) + len(v) for k, v in request.scope["headers"]) > MAX_HEADER_BYTES:
        return _count(state, None, _headers_too_large())
    try:
        tenant = _tenant(state, request, start)
    except Unauthorized as exc:
        return _count(state, None, _unauthorized(exc))
    try:
        raw = await read_body(request, state.config.max_body_bytes)
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    except BodyTooLarge:
        return _count(state, None, _too_large(state.config.max_body_bytes), tenant)
    body, error = _parse(raw, state.endpoints)
    if error is not None:
        return _count(state, None, error, tenant)
    model = body["model"]
    try:
        charge = None if tenant is None else _charge(state, tenant, body, start)
    except RateLimited as exc:  # (counted for the tenant already)
        response = openai_error(429, str(exc), "rate_limit_error", code="rate_limit_exceeded")
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return _count(state, model, response)
    cascade = state.endpoints.cascades.get(model)
    if cascade is None:
        return await _to_model(request, state, body, raw, path, start, tenant, charge)

    async def send(tier_body: dict[str, Any], final: bool) -> Response:
        """A tier's request; the tenant's charge goes with the answer the client gets."""
        return await _to_model(request, state, tier_body, json.dumps(tier_body).encode(), path,
                               start, tenant, charge if final else None)
    response = await serve_cascade(request, cascade, body, send, state.metrics)
    if charge is not None:  # a judged tier's answer or an error (else settled already)
        charge.settle(response.status_code, None, time.monotonic(),
                      served=response.status_code < 400)
    return response


# The worker's request models, checked by the router only when no replica is ready (a held
# request wakes one): elsewhere the worker checks, and the proxy only moves bytes.
REQUESTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


async def _to_model(request: Request, state: RouterState, body: dict[str, Any], raw: bytes,
                    path: str, start: float, tenant: Tenant | None,
                    charge: Charge | None) -> Response:
    """Admission, then a worker of ``body["model"]``: the path of every request (a
    cascade's: of each tier it asks)."""
    model = body["model"]
    try:
        routing = state.dispatcher.routing_request(
            body, request.headers, start, tenant.max_priority if tenant is not None else None)
    except BadRoutingHeader as exc:
        return _count(state, model, openai_error(
            exc.status, str(exc), "invalid_request_error" if exc.status == 400 else
            "permission_error", exc.param, None if exc.status == 400 else "priority_not_allowed"),
            tenant, charge)
    at_zero = not state.endpoints.any_ready_for(model)
    if at_zero and path in REQUESTS:
        try:  # at zero replicas: what a worker would refuse must not wake one first
            parse(REQUESTS[path], body)
        except APIError as exc:
            return _count(state, model, openai_error(exc.status_code, exc.message, exc.type,
                                                     exc.param, exc.code), tenant, charge)
    state.dispatcher.demand.arrived(model)
    try:
        if at_zero and not await unless_disconnected(
                request, state.dispatcher.hold(model)):
            return _no_ready_worker(state, model, charge)
        released = not state.dispatcher.admit_now(routing) and await unless_disconnected(
            request, state.dispatcher.admit(routing))
    except Rejected as exc:
        state.dispatcher.demand.rejected(model)
        response = openai_error(429, str(exc), "rate_limit_error", code=exc.reason)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return _count(state, model, response, charge=charge)
    except ClientDisconnected:
        return _count(state, model, Response(status_code=CLIENT_CLOSED), charge=charge)
    return await _dispatch(request, state, routing, raw, path, start, released, charge)


async def _dispatch(request: Request, state: RouterState, routing: RoutingRequest, raw: bytes,
                    path: str, start: float, released: bool, charge: Charge | None) -> Response:
    """Send to the policy's pick; on a worker that took nothing, the next candidate.
    ``released``: the request came out of the admission queue: it is settled exactly once,
    at its first lease, or on the way out when it never got one."""
    model = routing.model
    headers = forward_headers(request, state.keys)
    tried: set[str] = set()
    refused_by_all, retried = True, False
    try:
        while candidates := [e for e in state.endpoints.ready_for(model) if e.url not in tried]:
            endpoint, prediction = await state.dispatcher.choose(candidates, routing)
            exchange = Exchange(state, routing, endpoint, start, prediction, charge)
            if released:  # its load is visible now: the queue may release the next one
                released = False
                state.dispatcher.settled(routing)
            try:
                return await forward(request, state, endpoint, path, raw, headers, exchange)
            except TryElsewhere as exc:
                if exc.kind is not None:
                    state.endpoints.eject(endpoint, exc.kind, str(exc))
                else:  # it answered 503 (loading, draining), or was ejected already
                    state.endpoints.mark_down(endpoint, str(exc))
                tried.add(endpoint.url)
                refused_by_all &= exc.refused
                if exc.sent:  # the worker may have started on it: one more try, no more
                    if retried:
                        return _count(state, model, openai_error(
                            502, f"two workers failed before answering: {exc}", "server_error",
                            code="upstream_error"), charge=charge)
                    retried = True
                    state.metrics.retries.inc()
    finally:
        if released:  # it never got a lease
            state.dispatcher.settled(routing)
    if tried and refused_by_all:
        return _count(state, model, openai_error(
            502, f"could not connect to any worker serving `{model}`", "server_error",
            code="upstream_unreachable"), charge=charge)
    return _no_ready_worker(state, model, charge)


def _no_ready_worker(state: RouterState, model: str, charge: Charge | None = None) -> Response:
    """503 + ``Retry-After``: no replica of ``model`` is ready (after any hold)."""
    state.dispatcher.demand.rejected(model)
    response = openai_error(503, f"no ready worker serves `{model}`; retry shortly",
                            "server_error", code="no_ready_worker")
    response.headers["Retry-After"] = str(state.dispatcher.no_worker_retry_after(model))
    return _count(state, model, response, charge=charge)


def _tenant(state: RouterState, request: Request, now: float) -> Tenant | None:
    """The API-key tenant of ``request``; None when the router has no key file.

    Raises:
        Unauthorized: keys are required and this request has no known one.
    """
    if state.keys is None:
        return None
    if state.keys.refresh(now):
        state.tenants.update(state.keys.tenants, now)
    return state.keys.tenant_for(request.headers.get("authorization"))


def _charge(state: RouterState, tenant: Tenant, body: dict[str, Any], now: float) -> Charge:
    """Take one request and its estimated tokens from ``tenant``'s limits.

    Raises:
        RateLimited: over its RPM or TPM.
    """
    tokens, prompt = estimate_tokens(body, state.endpoints.context_tokens(body["model"]))
    return state.tenants.charge(tenant, tokens, now, prompt_tokens=prompt)


def _unauthorized(exc: Unauthorized) -> Response:
    response = openai_error(401, str(exc), "invalid_request_error", code=exc.code)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _headers_too_large() -> Response:
    response = openai_error(431, f"the request's header fields are larger than "
                            f"{MAX_HEADER_BYTES} bytes", "invalid_request_error",
                            code="request_header_fields_too_large")
    response.headers["Connection"] = "close"  # (its body is not read)
    return response


def _too_large(limit: int) -> Response:
    response = openai_error(413, f"the request body is larger than {limit} bytes (the "
                            "router's --max-body-bytes)", "invalid_request_error",
                            code="request_too_large")
    response.headers["Connection"] = "close"  # the rest of the body is not read
    return response


def _parse(raw: bytes, endpoints: EndpointSet) -> tuple[dict[str, Any], Response | None]:
    """The JSON body, or an error response: 400 malformed, 404 a model no worker serves,
    503 no worker has reported its models yet (the router just started)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError, and
        # an integer literal past Python's 4,300-digit conversion limit are ValueErrors)
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
        response = openai_error(503, "no worker has reported its models yet; retry shortly",
                                "server_error", code="no_ready_worker")
        response.headers["Retry-After"] = str(NO_WORKER_RETRY_AFTER_S)
        return {}, response
    shown = model.encode("utf-8", "backslashreplace").decode()  # a lone surrogate is not UTF-8
    return {}, openai_error(404, f"The model `{shown}` does not exist.",
                            "invalid_request_error", "model", "model_not_found")


def _count(state: RouterState, model: str | None, response: Response,
           tenant: Tenant | None = None, charge: Charge | None = None) -> Response:
    """Count a request answered by the router itself (and for its tenant: a ``charge`` is
    settled unserved, refunding its tokens). Unknown names are not used as label values
    (clients choose them: unbounded), they count as ``model=""``."""
    status = response.status_code
    state.metrics.count_request(model or "", status)
    if charge is not None:
        charge.settle(status, None, time.monotonic(), served=False)
    elif tenant is not None:
        state.tenants.count(tenant, status)
    return response


# ---------------------------------------------------------------------------- the app

OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")  # POST; the proxy path


class ProxyRequest(Request):
    """The proxy path's request, with its headers as a plain dict built once: names lower
    case (as ASGI gives them), a repeated name's last value (the one forwarded to the
    worker). Starlette's ``Headers`` scans and decodes the raw list on every lookup, and the
    proxy path looks up several (key, objectives, priority, length, the forwarded set)."""

    @cached_property
    def headers(self) -> dict[str, str]:  # type: ignore[override]
        return {k.decode("latin-1"): v.decode("latin-1") for k, v in self.scope["headers"]}


class RouterApp(FastAPI):
    """The router's app: ``POST`` to an ``OPENAI_ROUTES`` path goes straight to
    ``route_request``; everything else (lifespan, the other routes, their errors) goes
    through FastAPI.

    The proxy path answers its own errors in OpenAI's shape and needs nothing of FastAPI's
    (no dependencies, no validation): its middleware stack and routing (seven ASGI layers,
    each wrapping ``send``) were about a fifth of the router's CPU per request at 1,000
    concurrent streams. An exception escaping ``route_request`` still reaches the server
    (uvicorn logs it and answers 500 if nothing was sent), as FastAPI's outermost layer
    re-raised it to. The two routes stay declared on the app as well (the OpenAPI schema).
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if path in OPENAI_ROUTES and scope["type"] == "http" and scope["method"] == "POST" \
                and not scope.get("root_path"):
            scope["app"] = self
            response = await route_request(ProxyRequest(scope, receive, send), path)
            await response(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(config: RouterConfig) -> RouterApp:
    """Build the router app. The shared HTTP client, the endpoint poller and the dispatcher
    (policy, admission queues, latency models) are created in the lifespan and live in
    ``app.state.router``.

    Raises:
        ValueError: unknown policy or discovery name, or a bad setting.
        kubernetes.config.ConfigException: Kubernetes discovery without a usable kubeconfig.
        OSError, KeyFileError: the API key file cannot be read or is malformed.
        ValueError: the manifest does not validate, or a cascade's tiers do not resolve.
    """
    Dispatcher(EndpointSet(), config.dispatch, RouterMetrics())  # fail before serving
    if config.discovery not in DISCOVERY:
        raise ValueError(f"unknown discovery {config.discovery!r}; known: {', '.join(DISCOVERY)}")
    if config.max_body_bytes < 1 or not 0 < config.keepalive_timeout:
        raise ValueError("max_body_bytes must be ≥ 1 and keepalive_timeout > 0")
    keys = KeyRing(config.api_keys, time.monotonic()) if config.api_keys else None
    cascades = manifest_cascades(config.manifest) if config.manifest else {}
    kube_client = discovery.api_client(config.kubeconfig) if config.discovery == "kubernetes" \
        else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        upstream = Upstream(config.connect_timeout, config.read_timeout,
                            config.keepalive_timeout)
        # the poller's own pool: a request that reused a connection a poll kept alive, and
        # lost it unanswered, would be written again to the same worker (``request``)
        polls = Upstream(config.connect_timeout, None, config.keepalive_timeout)
        endpoints = EndpointSet(config.workers, poll_interval=config.poll_interval,
                                workers_file=config.workers_file, boot_s=config.boot_s)
        endpoints.cascades = dict(cascades)
        metrics = RouterMetrics()
        dispatcher = Dispatcher(endpoints, config.dispatch, metrics)
        metrics.registry.register(DemandCollector(dispatcher.demand_snapshot))
        endpoints.on_polled = dispatcher.tick
        endpoints.on_ejected = lambda reason: metrics.ejections.labels(reason).inc()
        tenants = TenantLimits()
        if keys is not None:
            tenants.update(keys.tenants, time.monotonic())
            metrics.registry.register(TenantCollector(tenants))
        app.state.router = RouterState(config, endpoints, dispatcher, metrics, upstream,
                                       Deadlines(config.first_byte_timeout, dispatcher.clock),
                                       keys, tenants)
        watcher = None
        if kube_client is not None:
            watcher = discovery.KubernetesDiscovery(endpoints, config.namespace, kube_client,
                                                    asyncio.get_running_loop())
            watcher.start()
        try:  # a first look, so a router started after its workers serves at once
            await asyncio.wait_for(endpoints.poll(polls), timeout=endpoints.poll_timeout + 1)
        except asyncio.TimeoutError:
            pass
        poller = asyncio.create_task(endpoints.poll_forever(polls), name="endpoint-poller")
        try:
            yield
        finally:
            poller.cancel()
            if watcher is not None:
                watcher.stop()
            await asyncio.gather(poller, return_exceptions=True)
            await upstream.close()
            await polls.close()

    app = RouterApp(title="sluice router", lifespan=lifespan)

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
    async def models(request: Request) -> Response:
        state: RouterState = request.app.state.router
        try:
            _tenant(state, request, time.monotonic())
        except Unauthorized as exc:
            return _unauthorized(exc)
        return JSONResponse({"object": "list", "data": state.endpoints.model_entries()})

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


HTTP_PROTOCOLS = {"sluice": RouterHTTP, "httptools": "httptools"}  # --http → uvicorn's http=


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="append", default=[], metavar="URL", type=worker_url,
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
    parser.add_argument("--load-factor", type=factor, default=defaults.load_factor,
                        help="prefix policy: no worker takes more than this times the average "
                        "in-flight load (default: %(default)s)")
    parser.add_argument("--prefix-key-chars", type=positive_count, default=defaults.prefix_key_chars,
                        help="prompt characters hashed into the prefix key (default: %(default)s)")
    parser.add_argument("--slo-ttft-ms", type=milliseconds, default=defaults.slo_ttft_ms,
                        help="TTFT objective of requests whose InferenceService and x-slo-ttft-ms "
                        "header set none; 0: none (default: %(default)s)")
    parser.add_argument("--slo-itl-ms", type=milliseconds, default=0.0,
                        help="inter-token latency objective, likewise; 0: none (default)")
    parser.add_argument("--max-queue", type=count, default=defaults.max_queue,
                        help="requests that may wait per model when no worker is predicted to "
                        "meet their TTFT objective; beyond it: 429 (default: %(default)s)")
    parser.add_argument("--queue-timeout", type=positive_seconds, default=defaults.queue_timeout,
                        help="seconds a request may wait in the queue before 429 "
                        "(default: %(default)s)")
    parser.add_argument("--hold-timeout", type=seconds, default=defaults.hold_s,
                        help="seconds a request waits for a ready worker when none is ready "
                        "(scale from zero) before 503; an InferenceService with autoscaling "
                        "sets its own (default: %(default)s: no wait)")
    parser.add_argument("--boot-seconds", type=seconds, default=None,
                        help="seconds a new worker takes to turn ready: a 503 while none is "
                        "ready says in Retry-After when a booting one is expected (an "
                        "InferenceService with autoscaling sets its bootSeconds; default: "
                        "learnt from the first scale-up)")
    parser.add_argument("--connect-timeout", type=positive_seconds, default=5.0,
                        help="seconds to connect to a worker (default: %(default)s)")
    parser.add_argument("--first-byte-timeout", type=positive_seconds, default=300.0,
                        help="seconds from sending a request to its first byte (a plain "
                        "request: its whole answer) (default: %(default)s)")
    parser.add_argument("--read-timeout", type=positive_seconds, default=600.0,
                        help="seconds allowed between stream chunks (default: %(default)s)")
    parser.add_argument("--poll-interval", type=positive_seconds, default=1.0,
                        help="seconds between health polls of each worker")
    parser.add_argument("--keepalive-timeout", type=positive_seconds, default=KEEPALIVE_S,
                        help="seconds an idle worker connection is kept for reuse; keep it below "
                        "the workers' own idle timeout (uvicorn: 5 s) (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=positive_count, default=MAX_BODY_BYTES,
                        help="largest request body accepted; beyond it: 413, found while "
                        "reading (default: %(default)s, 16 MiB)")
    parser.add_argument("--max-slo-ms", type=positive_milliseconds, default=defaults.max_slo_ms,
                        help="loosest objective an x-slo-ttft-ms or x-slo-itl-ms header may ask "
                        "for; beyond it: 400 (default: %(default)s)")
    parser.add_argument("--public-priority", type=int, default=defaults.public_priority,
                        help="most urgent priority (x-priority or the body's priority; lower is "
                        "served first) a request may ask for unless its API-key tenant allows "
                        "more; beyond it: 403 (default: %(default)s)")
    parser.add_argument("--manifest", default=None, metavar="FILE",
                        help="InferenceService manifest (one or more YAML documents) whose "
                        "cascades to serve, tiers resolved from the same file (static and file "
                        "discovery; kubernetes discovery finds them in the namespace)")
    parser.add_argument("--http", choices=HTTP_PROTOCOLS, default="sluice",
                        help="HTTP/1.1 server protocol: sluice (sluice.router.http, leaner) or "
                        "httptools (uvicorn's own) (default: %(default)s)")
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help="require Authorization: Bearer KEY on /v1 routes, with the keys, "
                        "tenants, priority ceilings and RPM/TPM limits of this YAML or JSON file "
                        "(a mounted Secret works); re-read when it changes")


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one (at most 2^20), and return it.

    The router holds a connection to each worker for its polls and one for each request in
    flight, each a file: with 1,000 workers under the usual soft limit of 1,024, every
    request failed (``Too many open files``) and the workers were marked down.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit from %d: %s", soft, exc)
    return soft


def freeze_gc() -> None:
    """Move every object alive now (modules, the app; in a router forked from ``sluice up``'s
    zygote, torch's too) to a permanent generation that the garbage collector no longer
    walks: called once everything is imported and built, just before serving.

    A router's requests keep their objects young and short-lived, but the full collections
    that their churn sets off walked the whole process each time: at 200 concurrent streams
    (about 1,800 requests/s from a null worker, ``bench/router.py``'s) collections took
    about 18 % of the router's CPU, 0.10 ms per request, and half that once frozen.
    """
    gc.collect()
    gc.freeze()


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
    if args.api_keys:
        try:
            KeyRing(args.api_keys, 0.0)
        except (OSError, KeyFileError) as exc:
            logger.error("--api-keys %s: %s", args.api_keys, exc)
            return 2
    if args.manifest:
        if kubernetes:
            logger.error("--manifest goes with static or file discovery; kubernetes discovery "
                         "finds the cascades of the namespace")
            return 2
        try:
            manifest_cascades(args.manifest)
        except ValueError as exc:
            logger.error("--manifest %s: %s", args.manifest, exc)
            return 2
    namespace = args.namespace or discovery.default_namespace()
    try:
        dispatch = DispatchSettings(
            policy=args.policy, load_factor=args.load_factor,
            slo_ttft_ms=args.slo_ttft_ms or None, slo_itl_ms=args.slo_itl_ms or None,
            max_queue=args.max_queue, queue_timeout=args.queue_timeout,
            prefix_key_chars=args.prefix_key_chars, hold_s=args.hold_timeout,
            max_slo_ms=args.max_slo_ms, public_priority=args.public_priority)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    config = RouterConfig(workers=args.worker, discovery=args.discovery,
                          workers_file=args.workers_file, namespace=namespace,
                          kubeconfig=args.kubeconfig, dispatch=dispatch,
                          connect_timeout=args.connect_timeout,
                          first_byte_timeout=args.first_byte_timeout,
                          read_timeout=args.read_timeout, poll_interval=args.poll_interval,
                          boot_s=args.boot_seconds, max_body_bytes=args.max_body_bytes,
                          keepalive_timeout=args.keepalive_timeout, api_keys=args.api_keys,
                          manifest=args.manifest)
    if kubernetes:
        from kubernetes.config import ConfigException
        try:
            app = create_app(config)
        except (ConfigException, OSError) as exc:
            logger.error("kubernetes discovery: no usable cluster configuration: %s", exc)
            return 2
    else:
        app = create_app(config)
    quiet_probe_access_logs()
    logger.info("router on http://%s:%d in front of %s", args.host, args.port,
                f"the InferenceServices in namespace {namespace}" if kubernetes
                else f"the workers in {args.workers_file}" if args.workers_file
                else ", ".join(args.worker) or "no workers")
    class Server(uvicorn.Server):
        """uvicorn's server, which on SIGTERM/SIGINT also answers the requests held for a
        replica at once (``Demand.close``): the graceful shutdown waits for open
        connections, and a held request would otherwise wait there until the supervisor's
        kill."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            state = getattr(app.state, "router", None)
            if state is not None:  # runs in the loop's thread, between its callbacks
                asyncio.get_running_loop().call_soon_threadsafe(state.dispatcher.demand.close)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port,
                                   log_level=args.log_level.lower(),
                                   # (above INFO, uvicorn drops each access-log line only
                                   # after working out its arguments: none at all then)
                                   access_log=logging.getLogger().isEnabledFor(logging.INFO),
                                   timeout_graceful_shutdown=30,
                                   http=HTTP_PROTOCOLS[args.http],
                                   # X-Forwarded-For is trusted only from 127.0.0.1 by
                                   # default (no ingress is): a middleware for nothing
                                   proxy_headers=False))
    logger.info("open-files limit %d", raise_open_files_limit())
    freeze_gc()
    server.run()
    return 0
