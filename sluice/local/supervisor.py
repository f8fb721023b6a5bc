"""`sluice up -f MANIFEST`: run an InferenceService as local processes.

Starts ``spec.replicas`` workers on free ports of 127.0.0.1 and one router in front of
them, each in its own process group, with their output forwarded to this process's stdout
prefixed by the child's name. Waits (with a deadline) until all are healthy, prints the
endpoint and a curl line, then supervises: a child that dies is logged and restarted with
backoff. Ctrl-C or SIGTERM stops every child (SIGTERM, then SIGKILL after a grace period)
and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client import start_http_server

from sluice.api.service import InferenceService, load_manifest
from sluice.api.worker_args import worker_arguments
from sluice.argtypes import port
from sluice.autoscale.policy import Config
from sluice.local.autoscaler import LocalAutoscaler

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
    proc: subprocess.Popen | None = None
    started: float = 0.0
    crashes: int = 0
    restart_at: float | None = None
    pump: threading.Thread | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, type=Path, help="InferenceService YAML")
    parser.add_argument("--host", default="127.0.0.1", help="address the router binds")
    parser.add_argument("--port", type=port, default=8000, help="port the router binds")
    parser.add_argument("--replicas", type=int, default=None,
                        help="override spec.replicas (number of worker processes)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds to wait for every process to become healthy")
    parser.add_argument("--metrics-port", type=port, default=None,
                        help="with autoscaling: serve the autoscaler's Prometheus metrics on "
                        "127.0.0.1:PORT")
    parser.add_argument("--grace-period", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping children")


def run(args: argparse.Namespace) -> int:
    """Exit codes: 0 stopped by Ctrl-C/SIGTERM; 1 a child failed to start; 2 bad input
    (manifest, model source, busy port)."""
    try:
        service = load_manifest(args.file)
        replicas = initial_replicas(service, args.replicas)
        _check_port_free(args.host, args.port)  # before a fetch that may take minutes
        model_path = resolve_model(service)
        worker_args = worker_arguments(service, model_path)
        scaling = service.spec.autoscaling
        policy = Config.from_spec(service.spec) if scaling.enabled else None
        most = max(replicas, policy.max_replicas if policy else replicas)
        env = {"OMP_NUM_THREADS": str(worker_threads(service, most))}
        workers = [worker_child(service.spec.engine.name, worker_args, i, args.log_level, env)
                   for i in range(replicas)]
        router_args = router_arguments(service)
        state_dir = Path(tempfile.mkdtemp(prefix="sluice-up-"))
        workers_file = state_dir / "workers.json"
        if policy is not None:
            router_args += ["--discovery", "file", "--workers-file", str(workers_file),
                            "--hold-timeout", str(scaling.hold_seconds)]
        else:
            router_args += [a for w in workers for a in ("--worker", w.url)]
        router = router_child(args.host, args.port, args.log_level, router_args, replicas)
    except Exception as exc:  # bad manifest, model fetch failure, busy port: one line, exit 2
        logger.error("%s", exc)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe otherwise
    supervisor = Supervisor([*workers, router], grace_period=args.grace_period)
    on_tick = lambda: None  # noqa: E731
    if policy is not None:
        names = itertools.count(replicas)

        def add_worker() -> Child:
            child = worker_child(service.spec.engine.name, worker_args, next(names),
                                 args.log_level, env)
            supervisor.add(child)
            return child

        scaler = LocalAutoscaler(service.spec.model.name, policy, router.url, workers_file,
                                 add_worker, supervisor.retire, workers,
                                 drain_s=scaling.drain_seconds)
        if args.metrics_port:
            start_http_server(args.metrics_port, "127.0.0.1", registry=scaler.metrics.registry)
        poll = httpx.Client(timeout=2.0, trust_env=False)
        on_tick = lambda: scaler.tick(poll)  # noqa: E731
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        supervisor.start_all()
        if not supervisor.wait_healthy(args.startup_timeout, stop):
            return 0  # stopped by a signal while starting
        print_ready(service, args.host, args.port, replicas, policy)
        supervisor.supervise(stop, on_tick=on_tick)
        return 0
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        supervisor.stop_all()
        shutil.rmtree(state_dir, ignore_errors=True)


def initial_replicas(service: InferenceService, override: int | None) -> int:
    """Workers to start: ``--replicas`` or ``spec.replicas``; with autoscaling, clamped to
    its bounds (0 only with ``scaleToZero``).

    Raises:
        ValueError: 0 replicas without scale-to-zero (nothing would serve), or a negative
            override.
    """
    spec = service.spec
    if override is not None and override < 0:
        raise ValueError(f"--replicas must be >= 0, got {override}")
    replicas = spec.replicas if override is None else override
    if spec.autoscaling.enabled:
        policy = Config.from_spec(spec)
        replicas = min(max(replicas, policy.min_replicas), policy.max_replicas)
    if replicas == 0 and not (spec.autoscaling.enabled and spec.autoscaling.scale_to_zero):
        raise ValueError("0 replicas: nothing would serve; pass --replicas N (N >= 1), or "
                         "enable autoscaling with scaleToZero")
    return replicas


def worker_threads(service: InferenceService, workers: int) -> int:
    """Threads per worker (its OMP_NUM_THREADS): ``resources.cpu`` rounded down, else this
    machine's cores shared by the most workers that may run. Warns when the workers' CPU
    exceeds the cores (every team of threads then waits for preempted members)."""
    cores = len(os.sched_getaffinity(0))
    threads = service.spec.resources.cpu_threads() or max(1, cores // max(1, workers))
    if threads * workers > cores:
        logger.warning("%d worker(s) x %d thread(s) exceed this machine's %d cores: workers "
                       "will slow each other down; lower resources.cpu or maxReplicas",
                       workers, threads, cores)
    return threads


def resolve_model(service: InferenceService) -> str:
    """The local folder of the manifest's model; ``sluice://`` sources are fetched first.

    Raises:
        ValueError: a ``pvc://`` source (Kubernetes only).
        sluice.models.store.ModelStoreError: unknown name, failed fetch, bad folder.
    """
    from sluice.models import store

    model = service.spec.model
    if model.source_scheme == "sluice":
        return str(store.fetch(model.source_location))
    if model.source_scheme == "file":
        return str(store.resolve(model.source))
    raise ValueError(f"spec.model.source {model.source!r}: pvc:// sources only work in "
                     "Kubernetes; use file:///path for a local folder")


def worker_python(engine: str) -> str:
    """The interpreter that runs workers of ``engine``: vLLM lives in its own venv
    (``$SLUICE_VLLM_PYTHON``, default ``.venv-vllm`` of this checkout, made by ``make vllm``).

    Raises:
        ValueError: engine vllm and no such interpreter.
    """
    if engine != "vllm":
        return sys.executable
    default = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    python = Path(os.environ.get("SLUICE_VLLM_PYTHON", default))
    if not python.exists():
        raise ValueError(f"engine vllm needs vLLM's environment, and {python} is missing: "
                         "run `make vllm` (or set SLUICE_VLLM_PYTHON)")
    return str(python)


def router_arguments(service: InferenceService) -> list[str]:
    """The router flags that carry the manifest's ``spec.routing`` and ``spec.slo`` (what the
    Kubernetes router reads from the InferenceService itself)."""
    routing, slo = service.spec.routing, service.spec.slo
    argv = ["--policy", routing.strategy, "--load-factor", str(routing.load_factor)]
    if slo.ttft_ms is not None:
        argv += ["--slo-ttft-ms", str(slo.ttft_ms)]
    if slo.itl_ms is not None:
        argv += ["--slo-itl-ms", str(slo.itl_ms)]
    return argv


def worker_child(engine: str, worker_args: list[str], index: int, log_level: str = "INFO",
                 env: dict[str, str] | None = None) -> Child:
    """Worker ``index`` on a free local port.

    Raises:
        ValueError: from ``worker_python``.
    """
    port = free_port()
    argv = [worker_python(engine), "-m", "sluice.cli", "--log-level", log_level, "worker",
            *worker_args, "--host", "127.0.0.1", "--port", str(port)]
    return Child(f"worker-{index}", argv, f"http://127.0.0.1:{port}", env=dict(env or {}))


def router_child(host: str, port: int, log_level: str, router_args: list[str],
                 ready_workers: int) -> Child:
    """The router, started with ``router_args`` (``router_arguments`` plus its workers or its
    workers file); healthy once its ``/health`` lists ``ready_workers`` ready workers."""
    argv = [sys.executable, "-m", "sluice.cli", "--log-level", log_level, "router", "--host",
            host, "--port", str(port), *router_args]
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return Child("router", argv, f"http://{connect_host}:{port}", ready_workers=ready_workers)


def _check_port_free(host: str, port: int) -> None:
    """Raises ValueError if the router's address is taken (before any child starts)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); "
                             "pick another with --port") from None


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_ready(service: InferenceService, host: str, port: int, replicas: int,
                policy: Config | None = None) -> None:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    body = json.dumps({"model": service.spec.model.name,
                       "messages": [{"role": "user", "content": "Hello! Who are you?"}],
                       "max_tokens": 64})
    scaling = f", autoscaling {policy.min_replicas}-{policy.max_replicas}" if policy else ""
    print(f"\nsluice: {service.metadata.name} ready at {url}/v1 "
          f"(model {service.spec.model.name}, {replicas} worker(s){scaling}). Try:\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d {shlex.quote(body)}\n", flush=True)


class Supervisor:
    """Starts, watches, restarts and stops a list of children.

    Args:
        children: the processes, router last.
        grace_period: seconds between SIGTERM and SIGKILL in ``stop_all``.
    """

    def __init__(self, children: list[Child], grace_period: float = 10.0):
        self.children = children
        self.grace_period = grace_period

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
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env}
        child.proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, env=env)
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


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):  # the whole group is gone already
        pass


# uvicorn access-log lines of the health polls (router → workers, us → everyone): one per
# second per process, and never interesting when they succeed.
_POLL_LINE = re.compile(r'"GET /(health|metrics|v1/models) HTTP/1\.[01]" (200|503)')


def _forward_output(name: str, proc: subprocess.Popen) -> None:
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
