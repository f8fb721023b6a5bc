"""What the routers see: the autoscaler's demand and the drainer's in-flight counts.

Router pods are found by label (``--router-selector``, the chart's router labels) in
``--router-namespace`` (default: each InferenceService's own namespace, where the chart's
router serves it); routers outside the cluster are named by URL (``--router``). Each is
asked directly, by pod IP or URL, with a short timeout:

    GET /autoscale/demand → {"models": {MODEL: {arrivals, rejected, ..., held, queued}}}
    GET /health           → {"workers": [{"url", "ready", "in_flight", ...}]}  (200 or 503)

A router that does not answer is left out of that round (``sluice.autoscale.observe`` then
counts nothing from it for the window); the callers decide what "no router answered" means.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from sluice.operator.kube import ApiError, KubeApi

logger = logging.getLogger(__name__)

DEFAULT_ROUTER_SELECTOR = "app.kubernetes.io/name=sluice,app.kubernetes.io/component=router"
DEFAULT_ROUTER_PORT = 8000
ROUTER_PORT_NAME = "http"


@dataclass(frozen=True)
class WorkerView:
    """One worker URL as the answering routers see it.

    Attributes:
        in_flight: requests the routers have sent there and not finished, summed.
        ready: some router would still route to it.
    """

    in_flight: int = 0
    ready: bool = False


class Routers:
    """Args:
        kube: the API (pods are listed with it).
        selector: label selector of router pods.
        namespace: where they run; None: the InferenceService's namespace.
        http: a client for the pods (no proxy from the environment), or None to make one.
        timeout: seconds for each GET.
        urls: base URLs of routers that are not pods of the cluster (asked for every
            namespace: they serve whichever InferenceServices they were started for).
    """

    def __init__(self, kube: KubeApi, selector: str = DEFAULT_ROUTER_SELECTOR,
                 namespace: str | None = None, http: httpx.AsyncClient | None = None,
                 timeout: float = 2.0, urls: tuple[str, ...] = ()):
        self.kube, self.selector, self.namespace = kube, selector, namespace
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout, trust_env=False)

    async def close(self) -> None:
        if self._own_http:
            await self._http.aclose()

    def namespace_for(self, isvc_namespace: str) -> str:
        return self.namespace or isvc_namespace

    async def addresses(self, namespace: str) -> dict[str, str]:
        """Router id (pod name, or the URL of a --router) → its base URL, for the running,
        not terminating router pods and the routers named by URL."""
        out = {url: url for url in self.urls}
        try:
            pods = await self.kube.list_pods(namespace, self.selector)
        except ApiError as exc:
            logger.warning("cannot list router pods in %s (%s): %s", namespace, self.selector,
                           exc)
            return out
        for pod in pods:
            meta, status = pod.get("metadata") or {}, pod.get("status") or {}
            ip = status.get("podIP")
            if not ip or meta.get("deletionTimestamp") or status.get("phase") != "Running":
                continue
            host = f"[{ip}]" if ":" in ip else ip
            out[meta.get("name", ip)] = f"http://{host}:{_router_port(pod)}"
        return out

    async def demand(self, namespace: str) -> dict[str, dict[str, dict[str, int]]]:
        """Router pod name → its demand snapshot (model → counters and gauges), for the
        routers that answered."""
        answers = await self._get_all(namespace, "/autoscale/demand")
        return {name: dict(body.get("models") or {}) for name, body in answers.items()}

    async def workers(self, namespace: str) -> tuple[dict[str, WorkerView], int]:
        """Worker URL → what the answering routers report about it, and how many answered."""
        answers = await self._get_all(namespace, "/health")
        views: dict[str, WorkerView] = {}
        for body in answers.values():
            for worker in body.get("workers") or ():
                url = worker.get("url")
                if not isinstance(url, str):
                    continue
                seen = views.get(url, WorkerView())
                views[url] = WorkerView(seen.in_flight + int(worker.get("in_flight") or 0),
                                        seen.ready or bool(worker.get("ready")))
        return views, len(answers)

    async def _get_all(self, namespace: str, path: str) -> dict[str, Mapping[str, Any]]:
        addresses = await self.addresses(namespace)
        names = sorted(addresses)
        results = await asyncio.gather(*(self._get(addresses[n] + path) for n in names))
        return {name: body for name, body in zip(names, results) if body is not None}

    async def _get(self, url: str) -> Mapping[str, Any] | None:
        try:
            response = await self._http.get(url)
            body = response.json()  # /health answers 503 with the same body
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("router %s did not answer: %s", url, exc)
            return None
        return body if isinstance(body, dict) else None


def _router_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == ROUTER_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return DEFAULT_ROUTER_PORT


def worker_url(pod: Mapping[str, Any], port: int) -> str | None:
    """The URL routers know a worker pod by (``http://IP:PORT``, as their discovery builds
    it from the worker Service's Endpoints)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"
