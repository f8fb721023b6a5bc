"""The processes of ``sluice up``: start, watch, restart with backoff, stop.

Each child runs in its own process group, its output forwarded to this process's stdout
prefixed by its name. ``sluice.cli`` children of this interpreter (native workers, the
router) are forked from a zygote that has torch and Sluice imported (``sluice.local.zygote``:
a worker boots in ~1.5 s instead of ~5 s here); others start as fresh processes.
``Supervisor.wait_healthy`` waits (with a deadline) until all are
healthy; ``supervise`` restarts a child that dies, with backoff; ``stop_all`` sends SIGTERM,
then SIGKILL after a grace period, to each child's whole group. A child stops itself when
this process is gone without stopping it (SIGKILL: ``sluice.local.parent``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from sluice.local.parent import LIFELINE_ENV, lifeline
from sluice.local.zygote import ForkedProcess, Zygote, forkable

logger = logging.getLogger(__name__)

MAX_RESTART_BACKOFF = 30.0  # seconds
STABLE_AFTER = 60.0  # seconds up after which a crash counts as the first in a row


class StartupError(RuntimeError):
    """A child exited or stayed unhealthy past the deadline while starting."""


@dataclass
class Child:
    """One supervised process.

    Attributes:
        name: log prefix, e.g. ``worker-0`` or ``router``.
        argv: the command line.
        url: base URL whose ``/health`` tells readiness.
        proc: the running process, or None before start.
        started: ``time.monotonic()`` of the last start.
        crashes: crashes in a row (reset after ``STABLE_AFTER`` seconds up).
        restart_at: when to restart it after a crash (monotonic seconds), or None.
        ready_workers: for the router, how many workers its ``/health`` must list as ready;
            None for a worker (its ``/health`` 200 is enough).
        env: extra environment variables (e.g. a worker's ``OMP_NUM_THREADS``).
        retired_at: when it was stopped on purpose (scaled down), or None: a retired child
            is not restarted, and is forgotten once it exited.
    """

    name: str
    argv: list[str]
    url: str
    ready_workers: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    retired_at: float | None = None
    proc: subprocess.Popen | ForkedProcess | None = None
    started: float = 0.0
    crashes: int = 0
    restart_at: float | None = None
    pump: threading.Thread | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts, watches, restarts and stops a list of children.

    Args:
        children: the processes, router last.
        grace_period: seconds between SIGTERM and SIGKILL in ``stop_all``.
        zygote: forks the children it can (``sluice.local.zygote.forkable``: native
            workers and the router), which then boot without importing torch; None starts
            every child as a fresh process.
    """

    def __init__(self, children: list[Child], grace_period: float = 10.0,
                 zygote: Zygote | None = None):
        self.children = children
        self.grace_period = grace_period
        self.zygote = zygote
        self._lifeline, self._lifeline_kept = lifeline()  # the write end: open until we exit

    def start_all(self) -> None:
        for child in self.children:
            self._start(child)

    def add(self, child: Child) -> None:
        """Start one more child (a worker added by the autoscaler)."""
        self.children.insert(-1, child)  # the router stays last
        self._start(child)

    def retire(self, child: Child) -> None:
        """SIGTERM a child on purpose (scale-down): it finishes its in-flight requests and
        exits; it is not restarted, and ``supervise`` forgets it once it has exited."""
        child.retired_at = time.monotonic()
        if child.alive():
            _signal_group(child.proc, signal.SIGTERM)
        logger.info("stopping %s (scaled down)", child.name)

    def _start(self, child: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", LIFELINE_ENV: str(self._lifeline),
               **child.env}
        child.proc = None
        if self.zygote is not None and forkable(child.argv):
            try:
                child.proc = self.zygote.spawn(child.argv, env, self._lifeline)
            except (OSError, EOFError) as exc:  # no fork server: start it the usual way
                logger.warning("could not fork %s (%s); starting a fresh process", child.name,
                               exc)
        if child.proc is None:
            child.proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=env,
                                          pass_fds=(self._lifeline,))
        child.started = time.monotonic()
        child.restart_at = None
        child.pump = threading.Thread(target=_forward_output, args=(child.name, child.proc),
                                      name=f"log-{child.name}", daemon=True)
        child.pump.start()
        logger.info("started %s (pid %d): %s", child.name, child.proc.pid, child.url)

    def wait_healthy(self, timeout: float, stop: threading.Event) -> bool:
        """Block until every worker's ``/health`` answers 200 and the router's lists all
        workers as ready. Returns False if ``stop`` was set meanwhile.

        Raises:
            StartupError: a child exited, or the deadline passed.
        """
        deadline = time.monotonic() + timeout
        pending = list(self.children)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for child in list(pending):
                    if not child.alive():
                        raise StartupError(f"{child.name} exited with code {child.proc.returncode} "
                                           "while starting (see its output above)")
                    if _healthy(client, child):
                        logger.info("%s is healthy", child.name)
                        pending.remove(child)
                if not pending:
                    break
                if time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise StartupError(f"not healthy after {timeout:.0f} s: {names}")
                if stop.wait(0.25):
                    return False
        return True

    def supervise(self, stop: threading.Event, period: float = 0.5,
                  on_tick: Callable[[], None] = lambda: None) -> None:
        """Until ``stop`` is set: log children that exit and restart them with backoff,
        forget retired children that exited, and call ``on_tick`` (the autoscaler)."""
        while not stop.wait(period):
            now = time.monotonic()
            try:
                on_tick()
            except Exception:  # a bug there must not stop supervision
                logger.exception("autoscaler tick failed")
            for child in list(self.children):
                if child.retired_at is not None:
                    overdue = now - child.retired_at > self.grace_period
                    if not child.alive() or overdue:
                        if overdue and child.alive():
                            logger.warning("%s did not stop in %.0f s; killing it", child.name,
                                           self.grace_period)
                        _signal_group(child.proc, signal.SIGKILL)  # grandchildren too
                        self.children.remove(child)
                        logger.info("%s stopped", child.name)
                    continue
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        logger.info("restarting %s", child.name)
                        self._start(child)
                    continue
                if child.alive():
                    continue
                up_for = now - child.started
                child.crashes = 1 if up_for > STABLE_AFTER else child.crashes + 1
                delay = min(2.0 ** (child.crashes - 1), MAX_RESTART_BACKOFF)
                child.restart_at = now + delay
                logger.error("%s exited with code %s after %.0f s; restarting in %.0f s",
                             child.name, child.proc.returncode, up_for, delay)

    def stop_all(self) -> None:
        """SIGTERM every child's process group, wait up to the grace period, then SIGKILL."""
        running = [c for c in self.children if c.alive()]
        for child in running:
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_period
        for child in running:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0f s; killing it", child.name,
                               self.grace_period)
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()
        for child in self.children:  # the group may hold grandchildren; leave none behind
            if child.proc is not None:
                _signal_group(child.proc, signal.SIGKILL)
            if child.pump is not None:
                child.pump.join(timeout=2.0)
        if running:
            logger.info("stopped %d process(es)", len(running))


def _healthy(client: httpx.Client, child: Child) -> bool:
    try:
        response = client.get(f"{child.url}/health")
        if child.ready_workers is None:
            return response.status_code == 200
        ready = [w for w in response.json().get("workers", []) if w.get("ready")]
        return len(ready) >= child.ready_workers
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def _signal_group(proc: subprocess.Popen | ForkedProcess, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):  # the group is gone, or not made yet:
        try:  # a forked child signalled before its setsid()
            os.kill(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


# uvicorn access-log lines of the health polls (router → workers, us → everyone): one per
# second per process, and never interesting when they succeed.
_POLL_LINE = re.compile(r'"GET /(health|metrics|v1/models) HTTP/1\.[01]" (200|503)')


def _forward_output(name: str, proc: subprocess.Popen | ForkedProcess) -> None:
    """Copy a child's output lines to our stdout, prefixed with ``[name]``, until EOF
    (successful health-poll access lines are dropped)."""
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        text = line.decode(errors="replace")
        if _POLL_LINE.search(text):
            continue
        try:
            sys.stdout.write(f"[{name}] {text}")
            sys.stdout.flush()
        except (OSError, ValueError):  # our stdout is gone; keep draining so the child never blocks
            pass
    proc.stdout.close()
