"""The router's view of its workers: readiness, served models and in-flight counts.

Discovery is static (``--worker URL``) or comes from Kubernetes (``sluice.router.discovery``
calls ``EndpointSet.sync`` whenever the ready addresses of the worker Services change). A
background task polls each listed worker's ``/health``, ``/v1/models`` and ``/metrics``
about once a second; routing only reads what the poll last saw and never waits on it.
Workers also report their load in ``x-sluice-*`` headers on every generation response
(``WorkerLoad.from_headers``). In-flight and queued-prefill counts are kept by the router
itself through ``Lease`` objects, each released exactly once from the proxy's ``finally``.

An endpoint that discovery drops is unlisted at once: no new requests, no more polls (while
requests sent there still wait for their first byte it is polled on, so a dead one is still
found out). It is kept (so its in-flight count stays right if it comes back) until its last
request finishes, then forgotten.

An endpoint is *ejected* (``EndpointSet.eject``) when it fails: a poll cannot reach it or
finds it unhealthy for another reason than draining, or a request to it timed out or lost
its connection. Like ``mark_down`` it gets no new requests until a poll finds it healthy,
and every request sent there that has had no byte back yet is told to go elsewhere
(``Endpoint.unanswered``), so none waits out a timeout on a dead worker. A draining worker
(``/health`` 503 ``{"status": "draining"}``) is only taken out of routing: it finishes what
it has. So is one whose poll is refused (nothing listens there: a worker draining after
SIGTERM has closed its listener and still answers its requests; one that exited has broken
their connections, and each goes elsewhere on its own).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.api import metrics as names
from sluice.argtypes import worker_url
from sluice.router.predictor import DrainMeter, LatencyModel
from sluice.router.upstream import ConnectFailed, Upstream, UpstreamError

logger = logging.getLogger(__name__)

MAX_BACKOFF_FACTOR = 8  # an unreachable worker is polled at most every 8 poll intervals
# A listed worker that has never been ready is booting: it is polled every BOOT_POLL_S, and
# not backed off while unreachable (it has not bound its port yet), for BOOT_GRACE_S after
# it was listed. A scale-up or a wake from zero is then routed within BOOT_POLL_S of the
# worker's readiness instead of within a poll interval (or a backed-off 2-8 of them).
BOOT_POLL_S = 0.2
BOOT_GRACE_S = 600.0
# The boot time expected of a booting endpoint (``EndpointSet.boot_s``: a 503's Retry-After
# while none is ready): an EWMA (weight BOOT_EWMA) of scale-ups' listed-to-ready times; a
# boot that takes over BOOT_LATE_FACTOR times it is no longer counted on.
BOOT_EWMA = 0.5
BOOT_LATE_FACTOR = 2.0
REPORT_FRESH_S = 3.0  # a worker's load report older than this is ignored

# the load headers every generation response carries (sluice.worker.generation)
HEADER_RUNNING = "x-sluice-num-running"
HEADER_WAITING = "x-sluice-num-waiting"
HEADER_KV_USAGE = "x-sluice-kv-cache-usage"
HEADER_QUEUED_PREFILL = "x-sluice-queued-prefill-tokens"
HEADER_TTFT_MS = "x-sluice-ttft-ms"  # a plain answer's TTFT at the worker (ms since its arrival)
DRAINING = "draining"  # the worker's /health status while it finishes its requests


class Unanswered(Protocol):
    """A request sent to an endpoint that has had no byte back yet."""

    def eject(self, reason: str) -> None:
        """The endpoint failed: stop waiting for it and go elsewhere."""


@dataclass(frozen=True)
class ModelSettings:
    """What discovery says about one served model (its InferenceService's spec); None where
    the router's own flags apply.

    Attributes:
        ttft_ms: ``spec.slo.ttftMs``.
        itl_ms: ``spec.slo.itlMs``.
        strategy: ``spec.routing.strategy`` (a name in ``sluice.router.policy.POLICIES``).
        load_factor: ``spec.routing.loadFactor``.
        hold_s: ``spec.autoscaling.holdSeconds`` when autoscaling is on: how long a request
            waits for a ready replica (scale from zero) before 503.
    """

    ttft_ms: float | None = None
    itl_ms: float | None = None
    strategy: str | None = None
    load_factor: float | None = None
    hold_s: float | None = None


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's own report of its load (headers or a /metrics scrape).

    Attributes:
        running: requests in its running batch.
        waiting: requests waiting for admission there.
        kv_usage: used fraction of its KV-cache blocks, 0..1.
        queued_prefill_tokens: prompt tokens of its requests that have no first token yet.
        at: the router's clock (seconds) when it received the report.
    """

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    queued_prefill_tokens: float = 0.0
    at: float = 0.0

    @classmethod
    def from_headers(cls, headers: Any, at: float) -> WorkerLoad | None:
        """The report in a response's headers, or None when it has none (or a bad one)."""
        try:
            running = headers.get(HEADER_RUNNING)
            if running is None:
                return None
            return cls(float(running), float(headers.get(HEADER_WAITING, 0)),
                       float(headers.get(HEADER_KV_USAGE, 0)),
                       float(headers.get(HEADER_QUEUED_PREFILL, 0)), at)
        except (TypeError, ValueError):
            return None

    @classmethod
    def from_metrics(cls, text: str, at: float) -> WorkerLoad | None:
        """The report in a Prometheus text scrape (vLLM names), or None without them."""
        values: dict[str, float] = {}
        for name in (names.NUM_RUNNING, names.NUM_WAITING, names.KV_CACHE_USAGE,
                     names.QUEUED_PREFILL_TOKENS):
            total = sample_total(text, name)
            if total is not None:
                values[name] = total
        if names.NUM_RUNNING not in values:
            return None
        return cls(values[names.NUM_RUNNING], values.get(names.NUM_WAITING, 0.0),
                   values.get(names.KV_CACHE_USAGE, 0.0),
                   values.get(names.QUEUED_PREFILL_TOKENS, 0.0), at)


_SAMPLE: dict[str, re.Pattern[str]] = {}


def sample_total(text: str, name: str) -> float | None:
    """The sum of metric ``name``'s samples (over all label sets) in a Prometheus text
    scrape, or None when it has none."""
    found = _SAMPLE.get(name) or _SAMPLE.setdefault(name, re.compile(
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M))
    values = []
    for value in found.findall(text):
        try:
            values.append(float(value))
        except ValueError:  # not a number: that sample is skipped
            pass
    return sum(values) if values else None


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
        prefilling: of those, requests that have not had their first token yet.
        prefill_tokens: estimated uncached prompt tokens of the ``prefilling`` requests.
        failures: consecutive polls that could not reach the worker (after its boot grace).
        next_poll: ``time.monotonic()`` of the next poll (backs off while unreachable).
        reported: the worker's last load report (headers or scrape), if any.
        last_sent: the router's clock (seconds) when it last sent a request here.
        latency: the online TTFT/ITL models of this endpoint (``sluice.router.predictor``).
        drain: the observed rate at which it works off its prefill (``Lease`` feeds it).
        unanswered: requests sent here with no byte back yet (each removes itself when its
            first byte comes or it ends): what an ejection sends elsewhere.
        generated: the worker's output tokens so far (its ``vllm:generation_tokens_total``,
            last scrape).
        generated_at: ``time.monotonic()`` of the last scrape that found ``generated`` grown.
        listed_at: ``time.monotonic()`` when discovery listed it (again).
        seen_ready: a poll has found it ready since it was listed.
        problem: why its last poll could not reach it (None after one that did); a booting
            endpoint's is logged once per change when something answers there, but not as
            a worker (a refused connection is a worker still starting: not logged).
    """

    url: str
    ready: bool = False
    listed: bool = True
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    models_known: bool = False
    in_flight: int = 0
    prefilling: int = 0
    prefill_tokens: float = 0.0
    failures: int = 0
    next_poll: float = 0.0
    reported: WorkerLoad | None = None
    last_sent: float = -math.inf
    latency: LatencyModel = field(default_factory=LatencyModel, repr=False, compare=False)
    drain: DrainMeter = field(default_factory=DrainMeter, repr=False, compare=False)
    unanswered: set[Unanswered] = field(default_factory=set, repr=False, compare=False)
    generated: float = 0.0
    generated_at: float = -math.inf
    listed_at: float = field(default_factory=time.monotonic)
    seen_ready: bool = False
    problem: str | None = None  # why its last poll failed

    def booting(self, now: float) -> bool:
        """Listed, never ready since, and within ``BOOT_GRACE_S`` of being listed."""
        return self.listed and not self.seen_ready and now - self.listed_at < BOOT_GRACE_S

    def summary(self) -> dict[str, Any]:
        return {"url": self.url, "ready": self.ready and self.listed, "listed": self.listed,
                "models": sorted(self.models), "in_flight": self.in_flight,
                "prefilling": self.prefilling}

    def report(self, now: float) -> WorkerLoad | None:
        """The worker's load report if it is fresh at ``now`` (the router's clock, seconds):
        younger than ``REPORT_FRESH_S``."""
        if self.reported is None or now - self.reported.at > REPORT_FRESH_S:
            return None
        return self.reported

    def settled_report(self, now: float) -> WorkerLoad | None:
        """The fresh report if it came after the last request sent here: it counts all of
        them, including plain (not streamed) requests whose first token the router sees only
        when their whole answer arrives, and which it still counts as prefilling."""
        report = self.report(now)
        return report if report is not None and report.at > self.last_sent else None

    def prefill_idle(self, now: float) -> bool:
        """No prefill waits here: none in flight by the router's count, or none by a
        settled report (a plain answer past its first token is decoding, not prefilling)."""
        if self.prefilling == 0:
            return True
        report = self.settled_report(now)
        return report is not None and report.waiting == 0 and report.queued_prefill_tokens == 0

    def queued_prefill_tokens(self, now: float) -> float:
        """Prefill work ahead of a new request: the router's own count, or the worker's
        fresh report when that is larger (traffic from elsewhere)."""
        report = self.report(now)
        return max(self.prefill_tokens, report.queued_prefill_tokens if report else 0.0)

    def running(self, now: float) -> float:
        """Requests decoding there: the router's count, or a larger fresh report."""
        report = self.report(now)
        return max(self.in_flight - self.prefilling, report.running if report else 0.0)


class Lease:
    """Counts one request against an endpoint until ``release`` (idempotent) is called.

    While the request has no first token it also counts as prefilling, with its
    ``prefill_tokens``; ``first_token`` (or ``release``) ends that, once, and the endpoint's
    drain meter sees each change (``now``: the router's clock, seconds).
    """

    def __init__(self, endpoint: Endpoint, prefill_tokens: float, now: float):
        self.endpoint = endpoint
        self.prefill_tokens = prefill_tokens
        endpoint.drain.advance(now, endpoint.prefilling > 0)
        endpoint.last_sent = now
        endpoint.in_flight += 1
        endpoint.prefilling += 1
        endpoint.prefill_tokens += prefill_tokens
        self._held = True
        self._prefilling = True

    def first_token(self, now: float) -> bool:
        """The request's first token arrived: its prefill is drained. True if this call
        ended its prefill."""
        if not self._end_prefill(now):
            return False
        self.endpoint.drain.drained(self.prefill_tokens)
        return True

    def release(self, now: float) -> bool:
        """Return True if this call released the lease, False if it was already released.
        A request released with no first token drained nothing that was seen."""
        if not self._held:
            return False
        self._end_prefill(now)
        self._held = False
        self.endpoint.in_flight -= 1
        return True

    def _end_prefill(self, now: float) -> bool:
        if not self._prefilling:
            return False
        self.endpoint.drain.advance(now, True)
        self._prefilling = False
        self.endpoint.prefilling -= 1
        self.endpoint.prefill_tokens = max(0.0, self.endpoint.prefill_tokens - self.prefill_tokens)
        return True


class EndpointSet:
    """The endpoints the router may use, and the poller that keeps their state fresh.

    Args:
        urls: worker base URLs; duplicates and trailing slashes are dropped.
        poll_interval: seconds between polls of a reachable worker.
        poll_timeout: seconds allowed for each GET of a poll (``/health``, ``/v1/models``,
            ``/metrics``), connection and whole answer.
        boot_s: the seconds a worker takes from being listed to ready, until scale-ups show
            it (``boot_s`` then follows them); None: not known until then.

    Static discovery passes the URLs here once. Dynamic discovery starts empty and calls
    ``sync``; it must do so on the event loop's thread.
    """

    def __init__(self, urls: Sequence[str] = (), poll_interval: float = 1.0,
                 poll_timeout: float = 2.0, workers_file: str | None = None,
                 boot_s: float | None = None):
        self._endpoints: dict[str, Endpoint] = {}
        for url in sorted(u.rstrip("/") for u in urls):
            self._endpoints.setdefault(url, Endpoint(url))
        self._declared: frozenset[str] | None = None  # models discovery says exist
        self._last_entries: dict[str, dict[str, Any]] = {}  # model → a worker's last entry
        self._wake: asyncio.Event | None = None  # set by sync: poll new endpoints now
        self._polling: dict[str, asyncio.Task] = {}  # url → its poll under way
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout
        self.on_polled: Callable[[], None] = lambda: None  # e.g. re-check admission queues
        self.on_ejected: Callable[[str], None] = lambda reason: None  # metrics
        # served model → its InferenceService's objectives and routing (discovery)
        self.settings: dict[str, ModelSettings] = {}
        # cascade served name → its sluice.router.cascade.Cascade (--manifest or discovery)
        self.cascades: dict[str, Any] = {}
        self.workers_file = workers_file  # file discovery (``sluice up``): re-read on change
        self._file_stamp: tuple[int, int] | None = None
        self._file_problem: str | None = None  # why the workers file was last not used
        self.boot_s = boot_s
        # endpoints listed after the first poll are scale-ups: their boots teach ``boot_s``
        # (those listed before it booted with the router, or were up already)
        self._first_polled: float | None = None

    def sync(self, urls: Iterable[str], declared_models: Iterable[str],
             settings: dict[str, ModelSettings] | None = None,
             cascades: dict[str, Any] | None = None) -> None:
        """Make ``urls`` the listed endpoints (dynamic discovery).

        New URLs are added not ready and the poller is woken to confirm them at once; URLs
        that are gone are unlisted at once and forgotten when their last request finishes.

        Args:
            urls: base URLs of the endpoints discovery lists now (ready addresses).
            declared_models: every served model name discovery knows of, with or without a
                listed endpoint; a request for one of them gets 503 (retry) rather than 404
                while it has no ready worker.
            settings: served model name → its InferenceService's objectives and routing
                (missing: the router's flags apply).
            cascades: cascade served name → ``sluice.router.cascade.Cascade``; None keeps
                the current ones.
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
                endpoint.listed_at, endpoint.seen_ready = time.monotonic(), False
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
        self.settings = dict(settings or {})
        if cascades is not None:
            self.cascades = dict(cascades)
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

    def any_ready_for(self, model: str) -> bool:
        """Some listed, ready endpoint serves ``model`` (``ready_for``'s test, stopping at
        the first: the request path asks it of every request, over the whole fleet)."""
        return any(e.listed and e.ready and model in e.models for e in self)

    def ready_in_s(self, model: str, now: float) -> float | None:
        """Seconds until the soonest booting endpoint that may serve ``model`` (its models
        are not known yet, or include it) is expected ready (``ready_in``), or None."""
        return ready_in(self.boot_s, [now - e.listed_at for e in self
                                      if e.booting(now) and not e.ready
                                      and (not e.models_known or model in e.models)])

    def serves(self, model: str) -> bool:
        """Some endpoint has reported serving ``model`` (ready or not), discovery declares
        it, or it is a cascade's name."""
        return any(model in e.models for e in self) or model in (self._declared or ()) \
            or model in self.cascades

    def any_models_known(self) -> bool:
        """Some endpoint has answered ``/v1/models`` at least once, or discovery has synced
        (so an unknown model is really unknown)."""
        return self._declared is not None or any(e.models_known for e in self)

    def context_tokens(self, model: str) -> int | None:
        """``model``'s context length (``max_model_len`` in a worker's /v1/models), if known."""
        for endpoint in self:
            length = endpoint.models.get(model, {}).get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                return length
        return None

    def any_ready(self) -> bool:
        return any(e.listed and e.ready for e in self)

    def model_entries(self) -> list[dict[str, Any]]:
        """The union of the listed workers' ``/v1/models`` entries, one per id, sorted by id;
        a model discovery declares and no listed worker serves (e.g. at zero replicas) gets
        the last entry a worker gave for it (``max_model_len`` and all), else a minimal one,
        so clients still find it."""
        union: dict[str, dict[str, Any]] = {}
        for endpoint in self.listed():
            for model_id, entry in endpoint.models.items():
                union.setdefault(model_id, entry)
        self._last_entries.update(union)
        for model_id in self._declared or ():
            union.setdefault(model_id, self._last_entries.get(model_id) or {
                "id": model_id, "object": "model", "created": 0, "owned_by": "sluice"})
        for name, cascade in self.cascades.items():
            union[name] = {"id": name, "object": "model", "created": 0, "owned_by": "sluice",
                           "cascade": list(cascade.policy.tiers)}
        return [union[k] for k in sorted(union)]

    def generating(self, endpoint: Endpoint) -> bool:
        """Did ``endpoint``'s output-token count grow within the last few polls? A worker
        that is slow to answer one request but still generating is busy, not wedged."""
        window = 2 * self.poll_interval + self.poll_timeout
        return time.monotonic() - endpoint.generated_at <= window

    def mark_down(self, endpoint: Endpoint, reason: str) -> None:
        """Stop routing to ``endpoint`` until a poll finds it healthy again."""
        if endpoint.ready:
            logger.warning("worker %s marked not ready: %s", endpoint.url, reason)
        endpoint.ready = False
        endpoint.next_poll = 0.0

    def eject(self, endpoint: Endpoint, kind: str, reason: str,
              redispatch: bool = True) -> None:
        """``endpoint`` failed (``kind``: unreachable, unhealthy, timeout, broken, refused):
        ``mark_down``, and send every request waiting there for its first byte elsewhere
        (``redispatch``; False: their own connections decide, as when nothing listens there
        any more: a worker that exited broke them, one draining after SIGTERM answers them)."""
        was_ready = endpoint.ready
        if was_ready or (endpoint.unanswered and redispatch):  # requests left waiting there
            self.on_ejected(kind)  # are counted once, when it leaves, not at every poll
        self.mark_down(endpoint, reason)
        if not redispatch:
            if was_ready and endpoint.unanswered:
                logger.warning("worker %s ejected (%s): its %d unanswered requests stay on "
                               "their connections", endpoint.url, reason,
                               len(endpoint.unanswered))
            return
        if endpoint.unanswered:
            logger.warning("worker %s ejected (%s): %d unanswered requests go elsewhere",
                           endpoint.url, reason, len(endpoint.unanswered))
        for request in list(endpoint.unanswered):
            request.eject(reason)

    def reload_file(self) -> None:
        """File discovery: when ``workers_file`` changed, ``sync`` to what it lists now.

        The file is JSON, ``{"workers": [URL, ...], "models": [NAME, ...]}``, replaced
        atomically by its writer (the ``sluice up`` supervisor adds and drains workers
        through it); ``models`` are served even with no worker (scale to zero). A missing or
        malformed file keeps the last good view (logged once per change).
        """
        try:
            stat = os.stat(self.workers_file)
            stamp = (stat.st_mtime_ns, stat.st_ino)
            if stamp == self._file_stamp:
                return
            self._file_stamp = stamp
            with open(self.workers_file) as f:
                urls, models = parse_workers_file(json.load(f))
        except (OSError, ValueError) as exc:
            problem = _describe(exc)
            if problem != self._file_problem:  # once per change, not at every poll
                logger.warning("workers file %s not used: %s", self.workers_file, problem)
                self._file_problem = problem
            return
        self._file_problem = None
        self.sync(urls, models, self.settings)

    async def poll(self, client: Upstream) -> None:
        """Poll every listed endpoint that is due, concurrently (``_poll_due``); never
        raises for a bad worker. Also forgets unlisted endpoints whose last request has
        finished."""
        if self.workers_file is not None:
            self.reload_file()
        self.prune()
        now = time.monotonic()
        await self._poll_due(client, [e for e in self
                                      if (e.listed or e.unanswered) and e.next_poll <= now])
        if self._first_polled is None:
            self._first_polled = time.monotonic()
        self.on_polled()

    async def poll_booting(self, client: Upstream) -> None:
        """Between full polls: re-read the workers file (a change wakes a full poll) and
        poll the booting endpoints (``Endpoint.booting``) only."""
        if self.workers_file is not None:
            self.reload_file()
        now = time.monotonic()
        booting = [e for e in self if e.booting(now) and e.next_poll <= now]
        if booting:
            await self._poll_due(client, booting)
            self.on_polled()

    async def _poll_due(self, client: Upstream, due: list[Endpoint]) -> None:
        """Start a poll of each of ``due`` not being polled already, and wait for them at
        most ``poll_interval``: a worker slow to answer (each GET may take
        ``poll_timeout``) goes on being polled in the background, rather than hold up
        everyone's next round (a break-it pass: one worker answering each GET in 1.5 s
        delayed noticing another's death from 0.4 s to 4.3 s)."""
        started = []
        for endpoint in due:
            if endpoint.url not in self._polling:
                task = asyncio.create_task(self._guarded(self._poll_one(client, endpoint)))
                self._polling[endpoint.url] = task
                task.add_done_callback(lambda _, url=endpoint.url: self._polling.pop(url, None))
                started.append(task)
        if started:
            await asyncio.wait(started, timeout=self.poll_interval)

    def stop_polls(self) -> None:
        """Cancel the polls still going on (the poller is stopping)."""
        for task in self._polling.values():
            task.cancel()

    async def poll_forever(self, client: Upstream) -> None:
        """Run ``poll`` every ``poll_interval`` seconds, and at once when ``sync`` adds an
        endpoint, until cancelled; in between, ``poll_booting`` every ``BOOT_POLL_S`` while
        an endpoint is booting or a workers file is watched."""
        self._wake = wake = asyncio.Event()
        try:
            await self._poll_forever(client, wake)
        finally:
            self.stop_polls()

    async def _poll_forever(self, client: Upstream, wake: asyncio.Event) -> None:
        while True:
            await self._guarded(self.poll(client))
            deadline = time.monotonic() + self.poll_interval
            while not wake.is_set() and (left := deadline - time.monotonic()) > 0:
                now = time.monotonic()
                fast = self.workers_file is not None or any(e.booting(now) for e in self)
                try:
                    await asyncio.wait_for(wake.wait(), min(left, BOOT_POLL_S) if fast else left)
                except asyncio.TimeoutError:
                    if fast:
                        await self._guarded(self.poll_booting(client))
            wake.clear()

    @staticmethod
    async def _guarded(poll: Any) -> None:
        try:
            await poll
        except Exception:  # a bug here must not stop the poller (nor one worker's, a round)
            logger.exception("endpoint poll failed")

    async def _poll_one(self, client: Upstream, endpoint: Endpoint) -> None:
        try:
            health, health_body = await client.get(endpoint.url, "/health", self.poll_timeout)
            models, models_body = await client.get(endpoint.url, "/v1/models",
                                                   self.poll_timeout)
            scrape, scrape_body = await client.get(endpoint.url, "/metrics", self.poll_timeout)
        except (UpstreamError, TimeoutError) as exc:
            why = _describe(exc)
            booting = endpoint.booting(time.monotonic())  # not bound yet: no backoff, and
            if not booting:  # no warning (a worker starting is not a failure)
                endpoint.failures += 1
            if endpoint.ready or endpoint.failures == 1:
                logger.warning("worker %s unreachable: %s", endpoint.url, why)
            elif booting and not isinstance(exc, ConnectFailed) and why != endpoint.problem:
                # something answers there, but not as a worker: why, once per change
                logger.warning("worker %s not ready yet: %s", endpoint.url, why)
            endpoint.problem = why
            self.eject(endpoint, "unreachable", f"unreachable: {why}",
                       redispatch=not _refused(exc))
            backoff = 0 if booting else min(2 ** (endpoint.failures - 1), MAX_BACKOFF_FACTOR)
            endpoint.next_poll = time.monotonic() + backoff * self.poll_interval
            return
        status = _health_status(health_body) if health != 200 else None
        if health != 200 and status != DRAINING:  # draining: it finishes its own
            self.eject(endpoint, "unhealthy", f"/health answered {health} "
                       f"({status or 'no status'})")
        if not endpoint.listed:  # unlisted while we waited: its state no longer matters
            return
        endpoint.failures = 0
        endpoint.next_poll = 0.0
        endpoint.problem = None
        if models == 200:
            try:
                entries = json.loads(models_body)["data"]
                endpoint.models = {str(m["id"]): m for m in entries}
                endpoint.models_known = True
                self._last_entries.update(endpoint.models)  # kept for a model at zero
            except (ValueError, KeyError, TypeError, RecursionError):
                logger.warning("worker %s sent a malformed /v1/models answer", endpoint.url)
        if scrape == 200:
            text = scrape_body.decode("utf-8", "replace")
            report = WorkerLoad.from_metrics(text, time.monotonic())
            if report is not None:
                endpoint.reported = report
            generated = sample_total(text, names.GENERATION_TOKENS)
            if generated is not None and generated > endpoint.generated:
                endpoint.generated, endpoint.generated_at = generated, time.monotonic()
        ready = health == 200
        if ready != endpoint.ready:
            logger.info("worker %s is %s (models: %s)", endpoint.url,
                        "ready" if ready else "not ready", ", ".join(sorted(endpoint.models)) or "?")
        endpoint.ready = ready
        if ready and not endpoint.seen_ready and self._first_polled is not None \
                and endpoint.listed_at > self._first_polled:
            self.boot_s = boot_learnt(self.boot_s, time.monotonic() - endpoint.listed_at)
        endpoint.seen_ready = endpoint.seen_ready or ready


def ready_in(boot_s: float | None, ages: Iterable[float]) -> float | None:
    """Seconds until the soonest of the booting endpoints listed ``ages`` seconds ago is
    expected ready: ``boot_s`` after it was listed, 0 once that has passed; None when none
    is booting, ``boot_s`` is not known, or each is more than ``BOOT_LATE_FACTOR`` ×
    ``boot_s`` into its boot (no longer waited for)."""
    if boot_s is None:
        return None
    late = BOOT_LATE_FACTOR * boot_s
    oldest = max((a for a in ages if 0.0 <= a <= late), default=None)
    return None if oldest is None else max(0.0, boot_s - oldest)


def boot_learnt(boot_s: float | None, observed_s: float) -> float:
    """The expected boot (seconds) after one more observed listed-to-ready time: an EWMA
    of weight ``BOOT_EWMA``, or the observation itself when none was expected yet."""
    return observed_s if boot_s is None else boot_s + BOOT_EWMA * (observed_s - boot_s)


def _refused(exc: Exception) -> bool:
    """A connect every address refused: the host is up and nothing listens on the port
    (asyncio raises a plain OSError naming each attempt when a name has several)."""
    cause = exc.__cause__ if isinstance(exc, ConnectFailed) else None
    if isinstance(cause, ConnectionRefusedError):
        return True
    attempts = re.findall(r"\[Errno (\d+)\]", str(cause)) if isinstance(cause, OSError) and \
        str(cause).startswith("Multiple exceptions") else []
    return bool(attempts) and all(int(n) == errno.ECONNREFUSED for n in attempts)


def _health_status(body: bytes) -> str | None:
    """The ``status`` of a worker's /health body, if it has one."""
    try:
        status = json.loads(body).get("status")
    except (ValueError, AttributeError, RecursionError):
        return None
    return status if isinstance(status, str) else None


def parse_workers_file(data: object) -> tuple[list[str], list[str]]:
    """The worker URLs and model names of a workers file's JSON (``EndpointSet.reload_file``).

    Raises:
        ValueError: not an object, ``workers`` missing or not a list of http:// URLs with a
            host, or ``models`` not a list of names; the message names the field.
    """
    if not isinstance(data, dict) or "workers" not in data:
        raise ValueError('not a JSON object with a "workers" list')
    urls, models = data["workers"], data.get("models", [])
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise ValueError('"workers" must be a list of URLs')
    try:
        urls = [worker_url(u) for u in urls]
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f'"workers": {exc}') from None
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ValueError('"models" must be a list of model names')
    return urls, models


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
