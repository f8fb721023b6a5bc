"""The router's view of its workers: readiness, served models and in-flight counts.

Discovery is static (``--worker URL``) or comes from Kubernetes (``sluice.router.discovery``
calls ``EndpointSet.sync`` whenever the ready addresses of the worker Services change). A
background task polls each listed worker's ``/health`` and ``/v1/models`` about once a
second; routing only reads what the poll last saw and never waits on it. In-flight counts
are kept by the router itself through ``Lease`` objects, each released exactly once from the
proxy's ``finally``.

An endpoint that discovery drops is unlisted at once: no new requests, no more polls. It is
kept (so its in-flight count stays right if it comes back) until its last request finishes,
then forgotten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)

MAX_BACKOFF_FACTOR = 8  # an unreachable worker is polled at most every 8 poll intervals


@dataclass
class Endpoint:
    """One worker.

    Attributes:
        url: base URL, no trailing slash, e.g. ``http://127.0.0.1:8001``.
        ready: the last ``/health`` answered 200 and no connection failed since.
        listed: discovery currently lists this endpoint (always True for static workers);
            an unlisted endpoint gets no new requests and is not polled.
        models: served model id → the worker's ``/v1/models`` entry (last good answer).
        models_known: ``/v1/models`` has answered at least once.
        in_flight: requests the router has sent here that have not finished.
        failures: consecutive polls that could not reach the worker.
        next_poll: ``time.monotonic()`` of the next poll (backs off while unreachable).
    """

    url: str
    ready: bool = False
    listed: bool = True
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    models_known: bool = False
    in_flight: int = 0
    failures: int = 0
    next_poll: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"url": self.url, "ready": self.ready and self.listed, "listed": self.listed,
                "models": sorted(self.models), "in_flight": self.in_flight}


class Lease:
    """Counts one request against an endpoint until ``release`` (idempotent) is called."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        endpoint.in_flight += 1
        self._held = True

    def release(self) -> bool:
        """Return True if this call released the lease, False if it was already released."""
        if not self._held:
            return False
        self._held = False
        self.endpoint.in_flight -= 1
        return True


class EndpointSet:
    """The endpoints the router may use, and the poller that keeps their state fresh.

    Args:
        urls: worker base URLs; duplicates and trailing slashes are dropped.
        poll_interval: seconds between polls of a reachable worker.
        poll_timeout: seconds allowed for each ``/health`` or ``/v1/models`` call.

    Static discovery passes the URLs here once. Dynamic discovery starts empty and calls
    ``sync``; it must do so on the event loop's thread.
    """

    def __init__(self, urls: Sequence[str] = (), poll_interval: float = 1.0,
                 poll_timeout: float = 2.0):
        self._endpoints: dict[str, Endpoint] = {}
        for url in sorted(u.rstrip("/") for u in urls):
            self._endpoints.setdefault(url, Endpoint(url))
        self._declared: frozenset[str] | None = None  # models discovery says exist
        self._wake: asyncio.Event | None = None  # set by sync: poll new endpoints now
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout

    def sync(self, urls: Iterable[str], declared_models: Iterable[str]) -> None:
        """Make ``urls`` the listed endpoints (dynamic discovery).

        New URLs are added not ready and the poller is woken to confirm them at once; URLs
        that are gone are unlisted at once and forgotten when their last request finishes.

        Args:
            urls: base URLs of the endpoints discovery lists now (ready addresses).
            declared_models: every served model name discovery knows of, with or without a
                listed endpoint; a request for one of them gets 503 (retry) rather than 404
                while it has no ready worker.
        """
        wanted = {u.rstrip("/") for u in urls}
        joined = False
        for url in sorted(wanted):
            endpoint = self._endpoints.get(url)
            if endpoint is None:
                self._endpoints[url] = Endpoint(url)
                logger.info("worker %s discovered", url)
                joined = True
            elif not endpoint.listed:
                endpoint.listed, endpoint.ready, endpoint.next_poll = True, False, 0.0
                logger.info("worker %s listed again", url)
                joined = True
        if joined and self._wake is not None:
            self._wake.set()
        for endpoint in list(self):
            if endpoint.url not in wanted and endpoint.listed:
                endpoint.listed, endpoint.ready = False, False
                logger.info("worker %s left the ready addresses (%d in flight finish there)",
                            endpoint.url, endpoint.in_flight)
        self._endpoints = dict(sorted(self._endpoints.items()))
        self._declared = frozenset(declared_models)
        self.prune()

    def prune(self) -> None:
        """Forget unlisted endpoints that have no request in flight."""
        for endpoint in list(self):
            if not endpoint.listed and endpoint.in_flight <= 0:
                del self._endpoints[endpoint.url]

    def __iter__(self) -> Iterator[Endpoint]:
        return iter(self._endpoints.values())

    def __len__(self) -> int:
        return len(self._endpoints)

    def listed(self) -> list[Endpoint]:
        """The endpoints discovery lists now, sorted by URL."""
        return [e for e in self if e.listed]

    def ready_for(self, model: str) -> list[Endpoint]:
        """Listed, ready endpoints that serve ``model``, sorted by URL."""
        return [e for e in self if e.listed and e.ready and model in e.models]

    def serves(self, model: str) -> bool:
        """Some endpoint has reported serving ``model`` (ready or not), or discovery
        declares it."""
        return any(model in e.models for e in self) or model in (self._declared or ())

    def any_models_known(self) -> bool:
        """Some endpoint has answered ``/v1/models`` at least once, or discovery has synced
        (so an unknown model is really unknown)."""
        return self._declared is not None or any(e.models_known for e in self)

    def any_ready(self) -> bool:
        return any(e.listed and e.ready for e in self)

    def model_entries(self) -> list[dict[str, Any]]:
        """The union of the listed workers' ``/v1/models`` entries, one per id, sorted by id."""
        union: dict[str, dict[str, Any]] = {}
        for endpoint in self.listed():
            for model_id, entry in endpoint.models.items():
                union.setdefault(model_id, entry)
        return [union[k] for k in sorted(union)]

    def mark_down(self, endpoint: Endpoint, reason: str) -> None:
        """Stop routing to ``endpoint`` until a poll finds it healthy again."""
        if endpoint.ready:
            logger.warning("worker %s marked not ready: %s", endpoint.url, reason)
        endpoint.ready = False
        endpoint.next_poll = 0.0

    async def poll(self, client: httpx.AsyncClient) -> None:
        """Poll every listed endpoint that is due, concurrently; never raises for a bad
        worker. Also forgets unlisted endpoints whose last request has finished."""
        self.prune()
        now = time.monotonic()
        due = [e for e in self.listed() if e.next_poll <= now]
        await asyncio.gather(*(self._poll_one(client, e) for e in due))

    async def poll_forever(self, client: httpx.AsyncClient) -> None:
        """Run ``poll`` every ``poll_interval`` seconds, and at once when ``sync`` adds an
        endpoint, until cancelled."""
        self._wake = wake = asyncio.Event()
        while True:
            try:
                await self.poll(client)
            except Exception:  # a bug here must not stop the poller
                logger.exception("endpoint poll failed")
            try:
                await asyncio.wait_for(wake.wait(), self.poll_interval)
            except asyncio.TimeoutError:
                pass
            wake.clear()

    async def _poll_one(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        try:
            health = await client.get(f"{endpoint.url}/health", timeout=self.poll_timeout)
            models = await client.get(f"{endpoint.url}/v1/models", timeout=self.poll_timeout)
        except httpx.HTTPError as exc:
            endpoint.failures += 1
            backoff = min(2 ** (endpoint.failures - 1), MAX_BACKOFF_FACTOR)
            endpoint.next_poll = time.monotonic() + backoff * self.poll_interval
            if endpoint.ready or endpoint.failures == 1:
                logger.warning("worker %s unreachable: %s", endpoint.url, _describe(exc))
            endpoint.ready = False
            return
        if not endpoint.listed:  # unlisted while we waited: its state no longer matters
            return
        endpoint.failures = 0
        endpoint.next_poll = 0.0
        if models.status_code == 200:
            try:
                entries = models.json()["data"]
                endpoint.models = {str(m["id"]): m for m in entries}
                endpoint.models_known = True
            except (ValueError, KeyError, TypeError):
                logger.warning("worker %s sent a malformed /v1/models answer", endpoint.url)
        ready = health.status_code == 200
        if ready != endpoint.ready:
            logger.info("worker %s is %s (models: %s)", endpoint.url,
                        "ready" if ready else "not ready", ", ".join(sorted(endpoint.models)) or "?")
        endpoint.ready = ready


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
