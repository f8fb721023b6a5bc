"""Prometheus metrics of one `sluice worker` (vLLM metric names, from sluice.api.metrics).

Latency histograms (seconds) and token counters are fed per engine request through a
``RequestTimer``; the load gauges (running, waiting, KV-cache usage) are computed from the
engine's stats at scrape time, so they cost nothing between scrapes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sluice.api import metrics as names
from sluice.worker.outputs import RequestOutput

logger = logging.getLogger(__name__)


class WorkerMetrics:
    """Prometheus metrics of one worker, in a registry of its own (vLLM names).

    Latency histograms (seconds) and token counters are fed per engine request by
    ``track``; the load gauges (running, waiting, KV usage) are read from ``stats()`` at
    scrape time.

    Args:
        model_name: the ``model_name`` label on every series.
        stats: returns the engine's stats (``num_running``, ``num_waiting``,
            ``kv_cache_usage``), or None before the engine is loaded (gauges read 0).
    """

    def __init__(self, model_name: str, stats: Callable[[], Any]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = ["model_name"]
        reg = self.registry
        self.ttft = Histogram(names.TTFT, "Time to first token, seconds.", label,
                              buckets=names.TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(names.ITL, "Time between output tokens, seconds.", label,
                             buckets=names.ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(names.E2E, "Request latency, arrival to last token, seconds.",
                             label, buckets=names.E2E_BUCKETS, registry=reg).labels(model_name)
        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "Prompt tokens admitted.", label,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "Output tokens generated.",
                                         label, registry=reg).labels(model_name)
        self.success = Counter(names.REQUEST_SUCCESS, "Engine requests finished, by reason.",
                               ["model_name", "finished_reason"], registry=reg)
        self.queued_prefill_tokens = 0  # prompt tokens of tracked requests with no token yet
        reg.register(_LoadCollector(model_name, stats, lambda: self.queued_prefill_tokens))

    def track(self, arrival: float, num_prompt_tokens: int) -> RequestTimer:
        """Start timing one engine request and count its prompt tokens.

        Args:
            arrival: when the HTTP request arrived, in seconds of ``time.monotonic()``; the
                start of TTFT and E2E.
            num_prompt_tokens: the request's prompt length in tokens.

        Returns:
            The request's timer; feed it every delta, and close it when the request ends.
        """
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, arrival, num_prompt_tokens)

    def scrape(self) -> bytes:
        """Every metric in the Prometheus text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)


class _LoadCollector:
    """Load gauges and prefix-cache counters read from the engine's stats at scrape time
    (0 before loading)."""

    def __init__(self, model_name: str, stats: Callable[[], Any],
                 queued_prefill_tokens: Callable[[], int] = lambda: 0):
        self.model_name = model_name
        self.stats = stats
        self.queued_prefill_tokens = queued_prefill_tokens

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        for name, doc, value in (
            (names.QUEUED_PREFILL_TOKENS, "Prompt tokens of requests with no output token yet.",
             self.queued_prefill_tokens()),
            (names.NUM_RUNNING, "Requests in the running batch.", s.num_running if s else 0),
            (names.NUM_WAITING, "Requests waiting for admission.", s.num_waiting if s else 0),
            (names.KV_CACHE_USAGE, "Used fraction of the KV-cache blocks, 0..1.",
             s.kv_cache_usage if s else 0.0),
            (names.SPEC_ACCEPTANCE_RATE, "Accepted / proposed speculative tokens, 0..1.",
             s.spec_accepted_tokens / s.spec_draft_tokens if s and s.spec_draft_tokens else 0.0),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family
        for name, doc, value in (
            (names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries if s else 0),
            (names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hits if s else 0),
            (names.SPEC_DRAFT_TOKENS, "Speculative tokens proposed.",
             s.spec_draft_tokens if s else 0),
            (names.SPEC_ACCEPTED_TOKENS, "Speculative tokens accepted by the model.",
             s.spec_accepted_tokens if s else 0),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family


class RequestTimer:
    """Records one engine request's TTFT, ITL, E2E and outcome from its deltas.

    TTFT = first output token - arrival; a later delta of k tokens after a gap g adds k ITL
    samples of g/k; E2E at finish. A request closed before finishing counts as "abort".
    All times are seconds of ``time.monotonic()``.
    """

    def __init__(self, metrics: WorkerMetrics, arrival: float, num_prompt_tokens: int = 0):
        self.m = metrics
        self.arrival = arrival
        self.last_token_at: float | None = None
        self.finished = False
        self.prefill_tokens = num_prompt_tokens  # counted in m.queued_prefill_tokens until
        metrics.queued_prefill_tokens += num_prompt_tokens  # the first token (or close)

    def _prefilled(self) -> None:
        self.m.queued_prefill_tokens -= self.prefill_tokens
        self.prefill_tokens = 0

    def observe(self, out: RequestOutput) -> None:
        """Record one engine delta: its new tokens (TTFT or ITL) and, if final, E2E/outcome."""
        now = time.monotonic()
        k = len(out.new_token_ids)
        if k:
            if self.last_token_at is None:
                self._prefilled()
                self.m.ttft.observe(now - self.arrival)
            else:
                gap = (now - self.last_token_at) / k
                for _ in range(k):
                    self.m.itl.observe(gap)
            self.last_token_at = now
            self.m.generation_tokens.inc(k)
        if out.finished:
            self.finished = True
            self.m.e2e.observe(now - self.arrival)
            self.m.success.labels(self.m.model_name, out.finish_reason or "abort").inc()

    def close(self) -> None:
        """End timing; idempotent. Counts the request as "abort" unless it finished."""
        self._prefilled()
        if not self.finished:
            self.finished = True
            self.m.success.labels(self.m.model_name, "abort").inc()


__all__ = ["RequestTimer", "WorkerMetrics"]
