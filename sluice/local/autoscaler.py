"""The ``sluice up`` driver of the autoscaling policy: worker processes follow
``sluice.autoscale.policy.recommend``.

Every ``interval`` seconds (by default each 0.5 s round of the supervisor's loop, which reads
the router's /health for the drains anyway):

    router GET /autoscale/demand, /health ──▶ observe ──▶ recommend ──▶ target replicas
      more:  start workers, list them in the workers file (the router polls them ready)
      fewer: pick the worker with fewest in flight (a starting one first), unlist it, and
             once the router shows it unlisted with 0 in flight (or drainSeconds passed)
             SIGTERM it (the worker finishes what it still has, then exits)

The router runs with ``--discovery file``: the workers file is the one list of workers,
written atomically here. Decisions are logged with their reason and exported as
``sluice_autoscaler_*`` metrics when ``metrics_port`` is set.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from sluice.autoscale.metrics import AutoscalerMetrics
from sluice.autoscale.observe import observe
from sluice.autoscale.policy import Config, State, recommend

logger = logging.getLogger(__name__)

ROUTER = "router"  # the one router's id in the snapshots


@dataclass
class _Draining:
    child: Any  # processes.Child
    deadline: float


class LocalAutoscaler:
    """Args:
        model: the served model name.
        config: the policy's configuration (``Config.from_spec``).
        router_url: the router's base URL.
        workers_file: the file discovery path the router reads.
        add_worker: starts one more worker process; returns its ``Child``.
        retire_worker: SIGTERMs a worker ``Child`` and forgets it once it exited.
        workers: the workers running now (routed), in start order.
        drain_s: the longest a removed worker may take to finish its requests.
        interval: seconds between decisions. Short, because a burst's first seconds are
            what an interval costs: on ``bench/autoscale.py``'s on-off cut, 2 s between
            decisions left the simulator's Sluice at 94.4 % of requests within the SLO,
            0.5 s at 100 % (``bench/autoscale_sim.py --tick-s``); the policy's smoothing
            is time-aware, so its windows may be short.
        clock: monotonic seconds (tests pass their own).
        metrics: where decisions are recorded.
    """

    def __init__(self, model: str, config: Config, router_url: str, workers_file: Path,
                 add_worker: Callable[[], Any], retire_worker: Callable[[Any], None],
                 workers: list[Any], drain_s: float = 120.0, interval: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 metrics: AutoscalerMetrics | None = None):
        self.model, self.config, self.router_url = model, config, router_url
        self.workers_file = workers_file
        self.add_worker, self.retire_worker = add_worker, retire_worker
        self.workers = list(workers)
        self.drain_s, self.interval, self.clock = drain_s, interval, clock
        self.metrics = metrics or AutoscalerMetrics()
        self.draining: list[_Draining] = []
        now = clock()
        self.state = State.initial(len(self.workers), config, now)
        self._last: tuple[float, dict[str, Any]] | None = None
        self._next = now
        self.write_workers_file()

    def write_workers_file(self) -> None:
        """List the routed workers (atomically: the router never reads half a file)."""
        tmp = self.workers_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"workers": [w.url for w in self.workers],
                                   "models": [self.model]}))
        os.replace(tmp, self.workers_file)

    def tick(self, client: httpx.Client) -> None:
        """One decision if it is due, and progress on draining workers. Never raises for a
        router that does not answer (that window is skipped)."""
        now = self.clock()
        try:
            health = client.get(f"{self.router_url}/health").json()
            demand = client.get(f"{self.router_url}/autoscale/demand").json()["models"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.debug("autoscaler: router not answering: %s", exc)
            return
        seen = {w.get("url"): w for w in health.get("workers", []) if isinstance(w, dict)}
        self._drain(seen, now)
        if now < self._next:
            return
        self._next = now + self.interval
        last, self._last = self._last, (now, demand)
        if last is None:  # the first snapshot only starts the window, and the idle time:
            self.state = replace(self.state, last_active=now)  # the workers' boot is none
            return
        urls = {w.url for w in self.workers}
        ready = sum(1 for url, w in seen.items() if url in urls and w.get("ready"))
        obs = observe(self.model, {ROUTER: last[1]}, {ROUTER: demand}, max(now - last[0], 1e-3),
                      ready=ready, starting=len(self.workers) - ready)
        previous = self.state.replicas
        decision = recommend(obs, self.state, self.config, now)
        self.state = decision.state
        self.metrics.record(self.model, previous, decision, ready)
        if decision.replicas != len(self.workers):
            logger.info("autoscaler: %d -> %d replicas (%s; demand %.2f req/s, capacity "
                        "%.2f req/s per replica, %d queued, %d held)", len(self.workers),
                        decision.replicas, decision.reason, decision.demand_rps,
                        decision.capacity_rps, obs.queued, obs.held)
            self._scale_to(decision.replicas, seen, now)

    def _scale_to(self, target: int, seen: dict[str, dict[str, Any]], now: float) -> None:
        while len(self.workers) < target:
            self.workers.append(self.add_worker())
        while len(self.workers) > target:
            # a worker not ready yet (nothing in flight) first, then the least busy
            victim = min(self.workers, key=lambda w: (bool(seen.get(w.url, {}).get("ready")),
                                                      seen.get(w.url, {}).get("in_flight", 0)))
            self.workers.remove(victim)
            self.draining.append(_Draining(victim, now + self.drain_s))
            logger.info("autoscaler: draining %s (%s, %s in flight)", victim.name, victim.url,
                        seen.get(victim.url, {}).get("in_flight", 0))
        self.write_workers_file()

    def _drain(self, seen: dict[str, dict[str, Any]], now: float) -> None:
        """Retire draining workers the router no longer routes to and has nothing in
        flight on (or whose drain deadline passed)."""
        for entry in list(self.draining):
            view = seen.get(entry.child.url)
            idle = view is None or (not view.get("listed", True) and not view.get("in_flight"))
            if idle or now >= entry.deadline:
                if not idle:
                    logger.warning("autoscaler: %s still has %s in flight after %.0f s; "
                                   "stopping it", entry.child.name, view.get("in_flight"),
                                   self.drain_s)
                self.draining.remove(entry)
                self.retire_worker(entry.child)
