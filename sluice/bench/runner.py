"""Drive the load: closed loop (N requests in flight) or open loop (requests at scheduled
arrival times, from a rate or a trace), warm-up first, through one shared httpx client.

The hot loop only sends and timestamps; tokenizing the output (token counts, ITL
attribution) happens after the run, so it cannot delay the timestamps of other streams.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import httpx

from sluice.bench import client as bench_client
from sluice.bench.client import RequestRecord
from sluice.bench.workload import RequestSpec, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadConfig:
    """How to send.

    Attributes:
        url: ``http://host:port`` of the OpenAI server; ``endpoint`` picks the path.
        concurrency: closed loop: requests in flight; open loop: a cap (None = no cap).
        open_loop: send at ``RequestSpec.arrival_s`` (or ``arrivals``) instead of closed loop.
        num_requests, duration_s: stop issuing after this many / this long (either, both).
        connect_timeout_s, read_timeout_s: httpx deadlines; read covers the first byte and
            every gap between chunks. request_timeout_s: the whole request.
    """

    url: str
    model: str
    endpoint: str = "completions"
    concurrency: int | None = 1
    open_loop: bool = False
    num_requests: int | None = None
    duration_s: float | None = None
    ignore_eos: bool = True
    temperature: float | None = None
    extra_body: dict | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0
    request_timeout_s: float = 600.0


@dataclass
class RunResult:
    """A finished run.

    Attributes:
        records: finished measured requests, finalized, in send order.
        interrupted: the run was cut short (Ctrl-C); requests then in flight are dropped.
        started_at: wall clock (Unix seconds) at offset 0 of the records' ``*_s`` times.
    """

    records: list[RequestRecord] = field(default_factory=list)
    interrupted: bool = False
    started_at: float = 0.0


async def run(cfg: LoadConfig, specs: Iterable[RequestSpec], tokenizer: Tokenizer,
              arrivals: Iterator[float] | None = None, warmup_specs: Iterable[RequestSpec] = (),
              on_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Send the warm-up, then the measured requests. ``arrivals`` gives open-loop
    offsets for specs without ``arrival_s``."""
    timeout = httpx.Timeout(connect=cfg.connect_timeout_s, read=cfg.read_timeout_s,
                            write=cfg.connect_timeout_s, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.concurrency or 64)
    url = cfg.url.rstrip("/") + bench_client.PATHS[cfg.endpoint]
    result = RunResult()
    records = result.records
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        try:
            warm: list[RequestRecord] = []
            await _closed(cfg, client, url, warmup_specs, None, None, warm, time.perf_counter())
            failed = [r for r in warm if not r.ok]
            if failed:
                logger.warning("%d of %d warm-up requests failed (%s: %s)", len(failed),
                               len(warm), failed[0].error_code, failed[0].error)
            if cfg.num_requests is not None:
                specs = itertools.islice(specs, cfg.num_requests)
            t0, result.started_at = time.perf_counter(), time.time()
            if cfg.open_loop:
                await _open(cfg, client, url, specs, arrivals, on_done, records, t0)
            else:
                await _closed(cfg, client, url, specs, cfg.duration_s, on_done, records, t0)
        except asyncio.CancelledError:  # Ctrl-C under asyncio.run: report what finished
            result.interrupted = True
            logger.warning("interrupted: reporting the %d requests that finished", len(records))
    records.sort(key=lambda r: r.index)
    for record in records:
        bench_client.finalize(record, tokenizer)
    return result


def _record(cfg: LoadConfig, index: int, spec: RequestSpec) -> tuple[dict, RequestRecord]:
    body = bench_client.request_body(cfg.endpoint, cfg.model, spec, cfg.ignore_eos,
                                     cfg.temperature, cfg.extra_body)
    return body, RequestRecord(index, spec.max_tokens, spec.input_tokens, spec.group)


async def _closed(cfg: LoadConfig, client: httpx.AsyncClient, url: str,
                  specs: Iterable[RequestSpec], duration_s: float | None,
                  on_done: Callable | None, records: list[RequestRecord], t0: float) -> None:
    """``cfg.concurrency`` loops, each sending its next request when its last one ends;
    finished records are appended to ``records``; times count from ``t0`` (perf_counter)."""
    numbered = enumerate(specs)

    async def loop() -> None:
        while duration_s is None or time.perf_counter() - t0 < duration_s:
            item = next(numbered, None)
            if item is None:
                return
            body, record = _record(cfg, *item)
            records.append(await bench_client.send(client, url, body, record, t0,
                                                   cfg.request_timeout_s))
            if on_done:
                on_done(record)

    await asyncio.gather(*(loop() for _ in range(cfg.concurrency or 1)))


async def _open(cfg: LoadConfig, client: httpx.AsyncClient, url: str,
                specs: Iterable[RequestSpec], arrivals: Iterator[float] | None,
                on_done: Callable | None, records: list[RequestRecord], t0: float) -> None:
    """Each request at its arrival offset, whatever is in flight. With a cap
    (``cfg.concurrency``) a request may wait for a free slot: latencies count from the
    actual send, and ``start_s - scheduled_s`` is that wait."""
    cap = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    tasks = []

    async def fire(body: dict, record: RequestRecord) -> None:
        if cap:
            async with cap:
                await bench_client.send(client, url, body, record, t0, cfg.request_timeout_s)
        else:
            await bench_client.send(client, url, body, record, t0, cfg.request_timeout_s)
        records.append(record)
        if on_done:
            on_done(record)

    try:
        for index, spec in enumerate(specs):
            if spec.arrival_s is None and arrivals is None:
                raise ValueError("open loop needs arrival times: a rate or a trace")
            at = spec.arrival_s if spec.arrival_s is not None else next(arrivals)
            if cfg.duration_s is not None and at >= cfg.duration_s:
                break
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body, record = _record(cfg, index, spec)
            record.scheduled_s = at
            tasks.append(asyncio.create_task(fire(body, record)))
        await asyncio.gather(*tasks)
    finally:  # interrupted while scheduling: no request outlives the run
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
