"""Kubernetes discovery for the router (``sluice router --discovery kubernetes``).

Two list-then-watch loops, each in a daemon thread (the kubernetes client is synchronous, so
the event loop never blocks on it), keep a small view of the router's namespace:

    InferenceServices   name → spec.model.name, spec.slo,     (serving.sluice.dev, read-only;
                        spec.cascade                          of several declaring one served
                                                              name, only the oldest counts)
    Endpoints (v1)      name → ready URLs on the port ``http``  (v1: EndpointSlice is only
                        (the operator's labels select them)      v1beta1 on Kubernetes 1.20)

Whenever either view changes, ``discovered`` joins them (InferenceService ``X`` ↔ Endpoints
``X-worker``, the worker Service the operator creates; names from
``sluice.api.names``) and the result is handed to
``EndpointSet.sync`` on the event loop's thread. Only ``subsets[].addresses`` count:
an address that fails readiness or whose pod starts terminating moves out of them (to
``notReadyAddresses``, or away), and is unlisted at once; requests already on it finish.
The router's own ``/health`` poll still confirms each listed endpoint before it is used.

Every watch has a server-side timeout and a client-side read timeout, resumes from the last
resourceVersion, relists after ``410 Gone``, and backs off exponentially after errors.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from sluice.api.names import (GROUP, MANAGED_SELECTOR, PLURAL, VERSION, WORKER_PORT_NAME,
                              WORKER_SUFFIX)
from sluice.api.service import (AutoscalingSpec, CascadeSpec, RoutingSpec, SLOSpec, served_model,
                                served_name_owners)
from sluice.cascade.tiers import resolve_cascades
from sluice.router.cascade import Cascade, cascades_of
from sluice.router.endpoints import EndpointSet, ModelSettings

logger = logging.getLogger(__name__)

Section = TypeVar("Section", bound=BaseModel)

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

WATCH_TIMEOUT_S = 240      # server ends each watch after this; we resume from resourceVersion
CONNECT_TIMEOUT_S = 10.0
READ_GRACE_S = 30.0        # client read timeout = watch timeout + this (a dead connection ends)
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
QUICK_WATCH_S = 1.0        # a watch the server ends sooner than this is retried with backoff


# ------------------------------------------------------------------ pure translation

def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip  # IPv6 literals need brackets in a URL


def _port(ports: list[Mapping[str, Any]], name: str) -> int | None:
    """The port named ``name``; the only port when it is unnamed (a one-port Service)."""
    for port in ports:
        if port.get("name") == name:
            return port.get("port")
    if len(ports) == 1 and not ports[0].get("name"):
        return ports[0].get("port")
    return None


def ready_urls(endpoints: Mapping[str, Any], port_name: str = WORKER_PORT_NAME) -> list[str]:
    """The base URLs of an Endpoints object's ready addresses on the port ``port_name``.

    Args:
        endpoints: a v1 Endpoints object as JSON (camelCase keys), e.g. one watch event's
            ``object``.
        port_name: the Service port's name.

    Returns:
        sorted, de-duplicated ``http://IP:PORT`` strings. ``notReadyAddresses`` never count;
        a subset without the named port contributes nothing.

    Example: subsets [{addresses: [{ip: 10.0.0.7}], notReadyAddresses: [{ip: 10.0.0.8}],
    ports: [{name: http, port: 8000}]}] → ["http://10.0.0.7:8000"].
    """
    urls: set[str] = set()
    for subset in endpoints.get("subsets") or ():
        port = _port(subset.get("ports") or [], port_name)
        if port is None:
            continue
        for address in subset.get("addresses") or ():
            if address.get("ip"):
                urls.add(f"http://{_host(address['ip'])}:{port}")
    return sorted(urls)


@dataclass(frozen=True)
class ServiceView:
    """What the router keeps of one InferenceService: its served model name, latency
    objectives (``spec.slo``, milliseconds) and routing (``spec.routing``); None where unset."""

    model: str | None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    strategy: str | None = None
    load_factor: float | None = None
    hold_s: float | None = None
    created: str = ""
    cascade: CascadeSpec | None = None


def service_view(isvc: Mapping[str, Any]) -> ServiceView:
    """``spec.model.name``, ``spec.slo.{ttftMs, itlMs}``, ``spec.routing.{strategy,
    loadFactor}``, with autoscaling on ``spec.autoscaling.holdSeconds``,
    ``metadata.creationTimestamp`` and ``spec.cascade`` of an InferenceService as JSON.

    Each section is read with its ``InferenceServiceSpec`` model (strictly: as the API
    server admits it); a section the model refuses counts as absent (the operator reports
    the invalid spec), and a routing field the spec leaves unset is None (the CRD defaults
    neither), so the router's own flag applies."""
    spec = isvc.get("spec") or {}
    slo = _section(SLOSpec, spec.get("slo")) or SLOSpec()
    routing = _section(RoutingSpec, spec.get("routing")) or RoutingSpec()
    scaling = _section(AutoscalingSpec, spec.get("autoscaling")) or AutoscalingSpec()
    return ServiceView(served_model(isvc), slo.ttft_ms, slo.itl_ms,
                       routing.strategy, routing.load_factor,
                       scaling.hold_seconds if scaling.enabled else None,
                       str((isvc.get("metadata") or {}).get("creationTimestamp") or ""),
                       _section(CascadeSpec, spec.get("cascade"), strict=False))


def _section(model: type[Section], raw: Any, strict: bool = True) -> Section | None:
    """``raw`` as ``model``, or None when it is absent or the model refuses it."""
    if raw is None:
        return None
    try:
        return model.model_validate(raw, strict=strict)
    except ValidationError:
        return None


def serving(views: Mapping[str, ServiceView]) -> dict[str, ServiceView]:
    """The views that get traffic: of InferenceServices declaring one served name, only
    the oldest (``served_name_owners``; the operator gives the others ``Conflict``)."""
    owners = served_name_owners({name: (v.model, v.created) for name, v in views.items()})
    return {name: v for name, v in views.items() if v.model is not None
            and owners.get(v.model) == name}


def model_settings(views: Mapping[str, ServiceView]) -> dict[str, ModelSettings]:
    """Served model name → its InferenceService's objectives and routing (``views`` as
    ``serving`` returns them: one per served name)."""
    return {v.model: ModelSettings(v.ttft_ms, v.itl_ms, v.strategy, v.load_factor, v.hold_s)
            for v in views.values() if v.model is not None}


@dataclass(frozen=True)
class Discovered:
    """What the router may route to.

    Attributes:
        urls: listed endpoint URL → the served model name of its InferenceService.
        models: every InferenceService's served model name (with or without ready endpoints).
    """

    urls: Mapping[str, str]
    models: frozenset[str]


def discovered(models: Mapping[str, str | None], urls: Mapping[str, list[str]]) -> Discovered:
    """Join the two watched views.

    Args:
        models: InferenceService name → served model name (None: the spec has none).
        urls: Endpoints name → ready URLs (``ready_urls``); names that are not some
            InferenceService's worker Service are ignored.

    Returns:
        the endpoints of every InferenceService's ``NAME-worker`` Endpoints, each under that
        InferenceService's model name. A URL listed by two InferenceServices keeps the first
        name in sorted order.
    """
    listed: dict[str, str] = {}
    for isvc in sorted(models):
        model = models[isvc]
        if model is None:
            continue
        for url in urls.get(isvc + WORKER_SUFFIX, ()):
            listed.setdefault(url, model)
    return Discovered(dict(sorted(listed.items())),
                      frozenset(m for m in models.values() if m is not None))


def joined(views: Mapping[str, ServiceView], urls: Mapping[str, list[str]]
           ) -> tuple[Discovered, dict[str, ModelSettings], dict[str, Cascade]]:
    """Both watched views → what ``EndpointSet.sync`` takes: the routable endpoints and
    declared models (``discovered``; a cascade runs no workers, so its name is not
    declared as a model), each served model's settings, and the cascades whose tiers
    resolve (``resolve_cascades``; the operator reports the others as InvalidSpec). Of
    InferenceServices sharing a served name, only the oldest counts (``serving``)."""
    views = serving(views)
    served, _ = resolve_cascades({k: (v.model, v.cascade) for k, v in views.items()})
    workers = {k: v.model for k, v in views.items() if v.cascade is None}
    return discovered(workers, urls), model_settings(views), cascades_of(served)


# ------------------------------------------------------------------ list + watch

class Reflector:
    """Keeps ``view`` (object name → ``transform(object)``) equal to one namespaced
    collection: list, then watch from the list's resourceVersion.

    Args:
        kind: for logs, e.g. ``endpoints``.
        list_call: the client's list function with everything but the list/watch options
            bound (``functools.partial``); called with ``_preload_content=False``.
        transform: object JSON → the value kept (small, comparable).
        on_change: called (in this thread, without arguments) after ``view`` changed.
        lock: held while ``view`` is written; readers take it too.
        stop: set to end ``run``.
        watch_timeout: server-side timeout of one watch request, seconds.
    """

    def __init__(self, kind: str, list_call: Callable[..., Any], transform: Callable[[dict], Any],
                 on_change: Callable[[], None], lock: threading.Lock, stop: threading.Event,
                 watch_timeout: int = WATCH_TIMEOUT_S):
        self.kind, self.list_call, self.transform = kind, list_call, transform
        self.on_change, self.lock, self.stop = on_change, lock, stop
        self.watch_timeout = watch_timeout
        self.view: dict[str, Any] = {}
        self.synced = False  # a list has succeeded at least once
        self._response: Any = None

    def run(self) -> None:
        """List and watch until ``stop`` is set; never raises."""
        delay = BACKOFF_START_S
        while not self.stop.is_set():
            try:
                version = self.list()
                delay = quick = BACKOFF_START_S
                while not self.stop.is_set():
                    started = time.monotonic()
                    version = self.watch(version)
                    if time.monotonic() - started < QUICK_WATCH_S:  # ended at once: no spin
                        self.stop.wait(quick)
                        quick = min(quick * 2, BACKOFF_MAX_S)
                    else:
                        quick = BACKOFF_START_S
            except Exception as exc:  # noqa: BLE001 — any failure: back off, relist
                if self.stop.is_set():
                    break
                if getattr(exc, "status", None) == 410:
                    logger.info("%s watch expired (410 Gone); relisting", self.kind)
                    continue
                logger.warning("%s list/watch failed (%s); retrying in %.1f s", self.kind,
                               _describe(exc), delay)
                self.stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)

    def close(self) -> None:
        """Unblock a watch in progress (call after setting ``stop``); never blocks.

        Closing the response itself from another thread would wait for the reader's buffer
        lock, held while it blocks in ``recv``; shutting the socket down wakes that ``recv``.
        """
        sock = getattr(getattr(self._response, "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass

    def list(self) -> str:
        """Replace ``view`` with a fresh list; return the list's resourceVersion."""
        response = self.list_call(_preload_content=False,
                                  _request_timeout=(CONNECT_TIMEOUT_S, CONNECT_TIMEOUT_S * 3))
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        view = {item["metadata"]["name"]: self.transform(item) for item in body.get("items") or ()}
        with self.lock:
            changed = view != self.view or not self.synced
            self.view, self.synced = view, True
        logger.debug("%s listed: %d objects", self.kind, len(view))
        if changed:
            self.on_change()
        return body["metadata"]["resourceVersion"]

    def watch(self, version: str) -> str:
        """One watch request from ``version``; apply its events; return the last version.

        Raises:
            ApiException: status 410 when ``version`` is too old (relist), or another error.
        """
        from kubernetes.client.exceptions import ApiException

        response = self.list_call(watch=True, resource_version=version, allow_watch_bookmarks=True,
                                  timeout_seconds=self.watch_timeout, _preload_content=False,
                                  _request_timeout=(CONNECT_TIMEOUT_S,
                                                    self.watch_timeout + READ_GRACE_S))
        self._response = response
        try:
            for line in _lines(response):
                if self.stop.is_set():
                    break
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = obj.get("metadata", {}).get("resourceVersion") or version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.apply(kind, obj)
        finally:
            self._response = None
            response.close()
        return version

    def apply(self, kind: str, obj: dict) -> None:
        """Apply one ADDED/MODIFIED/DELETED event to ``view``."""
        name = obj["metadata"]["name"]
        with self.lock:
            before = self.view.get(name, _MISSING)
            if kind == "DELETED":
                self.view.pop(name, None)
            else:
                self.view[name] = self.transform(obj)
            changed = self.view.get(name, _MISSING) != before
        if changed:
            self.on_change()


_MISSING = object()


def _lines(response: Any) -> Iterator[bytes]:
    """Complete non-empty lines of a streamed watch response."""
    pending = b""
    for chunk in response.stream(amt=None, decode_content=False):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (line for line in lines if line.strip())
    if pending.strip():
        yield pending


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ------------------------------------------------------------------ wiring

class KubernetesDiscovery:
    """Watches one namespace and keeps an ``EndpointSet`` in sync with it.

    Args:
        endpoints: the router's endpoint set; only touched on ``loop``'s thread.
        namespace: the namespace to watch.
        api_client: a ``kubernetes.client.ApiClient`` (see ``api_client``).
        loop: the router's running event loop.
        watch_timeout: server-side timeout of each watch request, seconds.
    """

    def __init__(self, endpoints: EndpointSet, namespace: str, api_client: Any,
                 loop: asyncio.AbstractEventLoop, watch_timeout: int = WATCH_TIMEOUT_S):
        from kubernetes import client

        self.endpoints, self.namespace, self.loop = endpoints, namespace, loop
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last: tuple[Discovered, dict, dict] | None = None
        custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
        self.isvcs = Reflector(
            PLURAL,
            functools.partial(custom.list_namespaced_custom_object, GROUP, VERSION, namespace,
                              PLURAL),
            service_view, self._changed, self._lock, self._stop, watch_timeout)
        self.worker_endpoints = Reflector(
            "endpoints",
            # only the worker Services' Endpoints (they carry their Service's labels)
            functools.partial(core.list_namespaced_endpoints, namespace,
                              label_selector=MANAGED_SELECTOR),
            ready_urls, self._changed, self._lock, self._stop, watch_timeout)
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start both watch threads (daemons: they never keep the process alive)."""
        logger.info("discovering InferenceServices and their worker Endpoints in namespace %s",
                    self.namespace)
        for reflector in (self.isvcs, self.worker_endpoints):
            thread = threading.Thread(target=reflector.run, name=f"watch-{reflector.kind}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Ask both threads to end and unblock their watches; does not wait for them."""
        self._stop.set()
        self.isvcs.close()
        self.worker_endpoints.close()

    def _changed(self) -> None:
        with self._lock:
            if not (self.isvcs.synced and self.worker_endpoints.synced):
                return  # half a view would unlist every endpoint of the other half
            now = joined(self.isvcs.view, self.worker_endpoints.view)
            if now == self._last:
                return
            self._last = now
        try:
            self.loop.call_soon_threadsafe(self._apply, now)
        except RuntimeError:  # the loop is closed: the router is shutting down
            pass

    def _apply(self, now: tuple[Discovered, dict, dict]) -> None:
        found, slos, cascades = now
        self.endpoints.sync(found.urls, found.models, slos, cascades)


def default_namespace() -> str:
    """The pod's own namespace in a cluster, else ``default``."""
    try:
        with open(NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def api_client(kubeconfig: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient``: from ``kubeconfig`` or ``$KUBECONFIG`` when given,
    else the in-cluster service account, else ``~/.kube/config``.

    Raises:
        kubernetes.config.ConfigException: no usable configuration.
    """
    from kubernetes import client, config

    path = kubeconfig or os.environ.get("KUBECONFIG")
    if not path and os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return config.new_client_from_config(config_file=path or None)
