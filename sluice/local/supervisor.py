"""`sluice up -f MANIFEST`: run the InferenceServices of a manifest as local processes.

The manifest holds one InferenceService, or several (YAML documents separated by ``---``),
e.g. a cascade and its tiers. Every InferenceService that is not a cascade gets its
``spec.replicas`` workers on free ports of 127.0.0.1 (named ``worker-0``, ... for a single
one, ``NAME-worker-0``, ... when there are several); one router fronts them all, started with
``--manifest FILE`` when the file holds a cascade (the router serves the cascade's name from
its tiers). A cascade whose tiers do not resolve (``sluice.cascade.tiers.resolve_cascades``)
is refused before anything starts (exit 2, naming the field).

The processes (``sluice.local.processes``) are waited for until healthy, then the endpoint,
each served name and a curl line are printed, and a child that dies is restarted with
backoff. Ctrl-C or SIGTERM stops every child and exits 0.

Autoscaling (``spec.autoscaling.enabled``) works for a manifest of one InferenceService:
workers come and go through the router's workers file (``sluice.local.autoscaler``). A
manifest that runs the workers of several refuses it (exit 2): their workers would share
one workers file and one machine's cores, and no per-service driver exists yet.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from prometheus_client import start_http_server

from sluice.api.service import InferenceService, load_manifests
from sluice.api.worker_args import worker_arguments
from sluice.argtypes import count, port, positive_seconds, seconds
from sluice.autoscale.policy import Config
from sluice.cascade.tiers import resolve_cascades
from sluice.local.autoscaler import LocalAutoscaler
from sluice.local.processes import Child, StartupError, Supervisor
from sluice.local.zygote import Zygote

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, type=Path,
                        help="InferenceService YAML (one, or several separated by ---)")
    parser.add_argument("--host", default="127.0.0.1", help="address the router binds")
    parser.add_argument("--port", type=port, default=8000, help="port the router binds")
    parser.add_argument("--replicas", type=count, default=None,
                        help="override spec.replicas (worker processes) of every "
                        "InferenceService that runs workers")
    parser.add_argument("--startup-timeout", type=positive_seconds, default=300.0,
                        help="seconds to wait for every process to become healthy")
    parser.add_argument("--metrics-port", type=port, default=None,
                        help="with autoscaling: serve the autoscaler's Prometheus metrics on "
                        "127.0.0.1:PORT")
    parser.add_argument("--grace-period", type=seconds, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping children")


@dataclass
class Pool:
    """The workers of one InferenceService that runs them (not a cascade).

    Attributes:
        service: its manifest.
        worker_args: its ``sluice worker`` flags (``worker_arguments``).
        env: its workers' extra environment (``OMP_NUM_THREADS``).
        prefix: its workers' name prefix: ``NAME-`` when the manifest runs several pools.
        workers: its workers, in start order.
    """

    service: InferenceService
    worker_args: list[str]
    env: dict[str, str]
    prefix: str = ""
    workers: list[Child] = field(default_factory=list)

    def worker(self, index: int, log_level: str) -> Child:
        """Worker ``index`` of this pool on a free port (not started)."""
        return worker_child(self.service.spec.engine.name, self.worker_args, index, log_level,
                            self.env, self.prefix)


@dataclass
class Plan:
    """What ``sluice up`` starts for a manifest.

    Attributes:
        pools: one per InferenceService that runs workers, in manifest order.
        router: the one router, in front of every pool.
        policy: the autoscaling policy of the only pool, or None (autoscaling off).
        workers_file: the router's workers file (with autoscaling).
    """

    pools: list[Pool]
    router: Child
    policy: Config | None
    workers_file: Path

    @property
    def workers(self) -> list[Child]:
        return [w for pool in self.pools for w in pool.workers]


def run(args: argparse.Namespace) -> int:
    """Exit codes: 0 stopped by Ctrl-C/SIGTERM; 1 a child failed to start; 2 bad input
    (manifest, a cascade's tiers, model source, busy port)."""
    state_dir = Path(tempfile.mkdtemp(prefix="sluice-up-"))
    try:
        services = load_manifests(args.file)
        check_services(services, args.file)
        _check_port_free(args.host, args.port)  # before a fetch that may take minutes
        if args.metrics_port:
            if args.metrics_port == args.port:
                raise ValueError(f"--metrics-port {args.metrics_port} is the router's --port; "
                                 "pick another")
            _check_port_free("127.0.0.1", args.metrics_port, "--metrics-port")
        up = plan(services, args, state_dir / "workers.json")
    except Exception as exc:  # bad manifest, model fetch failure, busy port: one line, exit 2
        logger.error("%s", exc)
        shutil.rmtree(state_dir, ignore_errors=True)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe otherwise
    native = any(pool.service.spec.engine.name == "native" for pool in up.pools)
    supervisor = Supervisor([*up.workers, up.router], grace_period=args.grace_period,
                            zygote=Zygote() if native else None)
    on_tick = _autoscaler(up, supervisor, args) if up.policy is not None else lambda: None
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        supervisor.start_all()
        if not supervisor.wait_healthy(args.startup_timeout, stop):
            return 0  # stopped by a signal while starting
        print(ready_banner(services, up, args.host, args.port), flush=True)
        supervisor.supervise(stop, on_tick=on_tick)
        return 0
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        supervisor.stop_all()
        shutil.rmtree(state_dir, ignore_errors=True)


def check_services(services: list[InferenceService], path: str | Path) -> None:
    """What ``sluice up`` needs of a manifest beyond each InferenceService's own validation.

    Raises:
        ValueError: naming the file, the InferenceService and the field: a cascade whose
            tiers do not resolve (``resolve_cascades``: an unknown name, a cascade, a tier
            serving the cascade's name); one ``spec.model.name`` declared twice; with the
            workers of several InferenceServices, ``spec.autoscaling.enabled``, or a
            ``spec.routing`` or ``spec.slo`` objective that differs between them (one router
            serves them all, with one set of flags).
    """
    _, problems = resolve_cascades({s.metadata.name: (s.spec.model.name, s.spec.cascade)
                                    for s in services})
    if problems:
        raise ValueError("; ".join(f"{path}: InferenceService {name!r}: {problem}"
                                   for name, problem in sorted(problems.items())))
    owners: dict[str, str] = {}
    for service in services:
        owner = owners.setdefault(service.spec.model.name, service.metadata.name)
        if owner != service.metadata.name:
            raise ValueError(f"{path}: spec.model.name {service.spec.model.name!r} is declared "
                             f"by InferenceServices {owner!r} and {service.metadata.name!r}: "
                             "the router could not tell them apart")
    pools = [s for s in services if s.spec.cascade is None]
    if len(pools) == 1:
        return
    for service in pools:
        if service.spec.autoscaling.enabled:
            raise ValueError(f"{path}: InferenceService {service.metadata.name!r}: "
                             "spec.autoscaling.enabled: sluice up autoscales a manifest of one "
                             f"InferenceService, and this one runs the workers of {len(pools)}; "
                             "turn it off here, or run that InferenceService from its own file")
    first = pools[0]
    for service in pools[1:]:
        differs = ("spec.routing" if service.spec.routing != first.spec.routing else
                   "spec.slo" if router_arguments(service) != router_arguments(first) else None)
        if differs:
            raise ValueError(f"{path}: InferenceServices {first.metadata.name!r} and "
                             f"{service.metadata.name!r} differ in {differs}: sluice up runs "
                             "one router for all of them, with one routing strategy and one "
                             "objective; make them equal")


def plan(services: list[InferenceService], args: argparse.Namespace, workers_file: Path,
         resolve: Callable[[InferenceService], str] | None = None) -> Plan:
    """The children for a manifest that passed ``check_services``; nothing is started.

    Args:
        services: the manifest's InferenceServices (``load_manifests``).
        args: the flags (``file``, ``host``, ``port``, ``replicas``, ``log_level``).
        workers_file: where the router's workers file goes (with autoscaling).
        resolve: an InferenceService → its local model folder (default ``resolve_model``,
            which may fetch for minutes).

    Raises:
        ValueError: from ``initial_replicas``, ``worker_arguments``, ``resolve_model``.
        sluice.models.store.ModelStoreError: see ``resolve_model``.
    """
    resolve = resolve or resolve_model
    serving = [s for s in services if s.spec.cascade is None]
    counts = [initial_replicas(s, args.replicas) for s in serving]  # before any fetch
    alone = len(serving) == 1
    policy = local_policy(serving[0]) if alone and serving[0].spec.autoscaling.enabled else None
    most = max(sum(counts), policy.max_replicas if policy else 0)
    pools = []
    for service, replicas in zip(serving, counts):
        env = {"OMP_NUM_THREADS": str(worker_threads(service, most))}
        pool = Pool(service, worker_arguments(service, resolve(service)), env,
                    "" if alone else f"{service.metadata.name}-")
        pool.workers = [pool.worker(i, args.log_level) for i in range(replicas)]
        pools.append(pool)
    router_args = router_arguments(serving[0])
    if policy is not None:
        router_args += ["--discovery", "file", "--workers-file", str(workers_file),
                        "--hold-timeout", str(serving[0].spec.autoscaling.hold_seconds),
                        "--boot-seconds", str(serving[0].spec.autoscaling.boot_seconds)]
    else:
        router_args += [a for pool in pools for w in pool.workers for a in ("--worker", w.url)]
    if len(serving) < len(services):  # cascades: the router resolves their tiers from it
        router_args += ["--manifest", str(Path(args.file).resolve())]
    router = router_child(args.host, args.port, args.log_level, router_args, sum(counts))
    return Plan(pools, router, policy, workers_file)


def _autoscaler(up: Plan, supervisor: Supervisor, args: argparse.Namespace
                ) -> Callable[[], None]:
    """The supervisor's tick for the only pool's autoscaler (``up.policy`` is set)."""
    assert up.policy is not None and len(up.pools) == 1
    pool = up.pools[0]
    names = itertools.count(len(pool.workers))

    def add_worker() -> Child:
        child = pool.worker(next(names), args.log_level)
        supervisor.add(child)
        return child

    scaler = LocalAutoscaler(pool.service.spec.model.name, up.policy, up.router.url,
                             up.workers_file, add_worker, supervisor.retire, pool.workers,
                             drain_s=pool.service.spec.autoscaling.drain_seconds)
    if args.metrics_port:
        start_http_server(args.metrics_port, "127.0.0.1", registry=scaler.metrics.registry)
    poll = httpx.Client(timeout=2.0, trust_env=False)
    return lambda: scaler.tick(poll)


MAX_LOCAL_WORKERS = 64  # --replicas 100000 forked workers until the machine stalled


def local_policy(service: InferenceService) -> Config:
    """The autoscaling policy ``sluice up`` runs for ``service``: the spec's, with
    ``maxReplicas`` capped at ``MAX_LOCAL_WORKERS`` (with a warning): a burst sized for
    ``maxReplicas: 10000`` would fork workers until the machine stalls.

    Raises:
        ValueError: ``minReplicas`` above ``MAX_LOCAL_WORKERS``, or what
            ``Config.from_spec`` raises.
    """
    policy = Config.from_spec(service.spec)
    if policy.min_replicas > MAX_LOCAL_WORKERS:
        raise ValueError(f"spec.minReplicas {policy.min_replicas}: sluice up runs at most "
                         f"{MAX_LOCAL_WORKERS} workers of a service on one machine")
    if policy.max_replicas > MAX_LOCAL_WORKERS:
        logger.warning("autoscaling up to %d workers, not spec.maxReplicas %d: sluice up runs "
                       "at most %d workers of a service on one machine", MAX_LOCAL_WORKERS,
                       policy.max_replicas, MAX_LOCAL_WORKERS)
        policy = replace(policy, max_replicas=MAX_LOCAL_WORKERS)
    return policy


def initial_replicas(service: InferenceService, override: int | None) -> int:
    """Workers to start: ``--replicas`` or ``spec.replicas``; with autoscaling, clamped to
    its bounds (0 only with ``scaleToZero``).

    Raises:
        ValueError: 0 replicas without scale-to-zero (nothing would serve), a negative
            override, or more than ``MAX_LOCAL_WORKERS``.
    """
    spec = service.spec
    if override is not None and override < 0:
        raise ValueError(f"--replicas must be >= 0, got {override}")
    replicas = spec.replicas if override is None else override
    if replicas > MAX_LOCAL_WORKERS:
        raise ValueError(f"{replicas} replicas: sluice up runs at most {MAX_LOCAL_WORKERS} "
                         "workers of a service on one machine")
    if spec.autoscaling.enabled:
        policy = Config.from_spec(spec)
        bounded = min(max(replicas, policy.min_replicas), policy.max_replicas)
        if bounded != replicas:
            logger.warning("starting %d worker(s), not %d: autoscaling keeps replicas within "
                           "minReplicas %d and maxReplicas %d", bounded, replicas,
                           policy.min_replicas, policy.max_replicas)
        replicas = bounded
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
    argv = []
    if routing.strategy is not None:
        argv += ["--policy", routing.strategy]
    if routing.load_factor is not None:
        argv += ["--load-factor", str(routing.load_factor)]
    if slo.ttft_ms is not None:
        argv += ["--slo-ttft-ms", str(slo.ttft_ms)]
    if slo.itl_ms is not None:
        argv += ["--slo-itl-ms", str(slo.itl_ms)]
    return argv


def worker_child(engine: str, worker_args: list[str], index: int, log_level: str = "INFO",
                 env: dict[str, str] | None = None, prefix: str = "") -> Child:
    """Worker ``index`` on a free local port, named ``{prefix}worker-{index}``.

    Raises:
        ValueError: from ``worker_python``.
    """
    port = free_port()
    argv = [worker_python(engine), "-m", "sluice.cli", "--log-level", log_level, "worker",
            *worker_args, "--host", "127.0.0.1", "--port", str(port)]
    return Child(f"{prefix}worker-{index}", argv, f"http://127.0.0.1:{port}",
                 env=dict(env or {}))


def router_child(host: str, port: int, log_level: str, router_args: list[str],
                 ready_workers: int) -> Child:
    """The router, started with ``router_args`` (``router_arguments`` plus its workers or its
    workers file); healthy once its ``/health`` lists ``ready_workers`` ready workers."""
    argv = [sys.executable, "-m", "sluice.cli", "--log-level", log_level, "router", "--host",
            host, "--port", str(port), *router_args]
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return Child("router", argv, f"http://{connect_host}:{port}", ready_workers=ready_workers)


def _check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Raises ValueError if the address (``flag``'s) is taken (before any child starts)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); "
                             f"pick another with {flag}") from None


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready_banner(services: list[InferenceService], up: Plan, host: str, port: int) -> str:
    """What is printed once every child is healthy: the endpoint, what it serves (each
    served name, cascades included) and a curl line (for the first cascade's name when the
    manifest has one, else the first model's)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    cascades = [s for s in services if s.spec.cascade is not None]
    model = (cascades or [p.service for p in up.pools])[0].spec.model.name
    body = json.dumps({"model": model,
                       "messages": [{"role": "user", "content": "Hello! Who are you?"}],
                       "max_tokens": 64})
    if len(services) == 1:
        (pool,) = up.pools
        scaling = (f", autoscaling {up.policy.min_replicas}-{up.policy.max_replicas}"
                   if up.policy else "")
        serving = (f"sluice: {pool.service.metadata.name} ready at {url}/v1 (model {model}, "
                   f"{len(pool.workers)} worker(s){scaling}). Try:")
    else:
        width = max(len(s.spec.model.name) for s in services)
        rows = [f"  {p.service.spec.model.name:<{width}}  {p.service.metadata.name}: "
                f"{len(p.workers)} worker(s)" for p in up.pools]
        rows += [f"  {c.spec.model.name:<{width}}  {c.metadata.name}: cascade of "
                 f"{' -> '.join(c.spec.cascade.tiers)}" for c in cascades if c.spec.cascade]
        serving = f"sluice: ready at {url}/v1, serving:\n" + "\n".join(rows) + "\nTry:"
    return (f"\n{serving}\n  curl {url}/v1/chat/completions -H 'Content-Type: "
            f"application/json' -d {shlex.quote(body)}\n")
