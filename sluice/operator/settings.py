"""The operator's options and the explicit kopf settings they imply.

Options come from ``sluice operator`` flags (main.py) or, when kopf is run directly
(``kopf run -m sluice.operator.handlers``, ``kopf.testing.KopfRunner``), from the
environment: SLUICE_WORKER_IMAGE, SLUICE_VLLM_WORKER_IMAGE, SLUICE_MODEL_CACHE,
SLUICE_WORKER_COMMAND, SLUICE_NAMESPACES (comma-separated; empty: all),
SLUICE_ENDPOINT_PROBE (0 turns the /health probe off), SLUICE_RESYNC_SECONDS,
SLUICE_AUTOSCALE_INTERVAL, SLUICE_METRICS_PORT (0: off), SLUICE_ROUTER_SELECTOR,
SLUICE_ROUTER_NAMESPACE (empty: each InferenceService's own).
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, field
from typing import Any

from sluice.api.names import GROUP, MANAGED_SELECTOR
from sluice.operator.resources import (
    DEFAULT_WORKER_IMAGE,
    MODEL_CACHE_DEFAULT,
    ModelCache,
    OperatorConfig,
)
from sluice.operator.routers import DEFAULT_ROUTER_SELECTOR


@dataclass(frozen=True)
class OperatorOptions:
    """Attributes:
        config: what worker pods look like.
        namespaces: the namespaces served; empty: all of them.
        probe: GET a ready worker's /health before reporting Ready.
        resync_seconds: how often every InferenceService is reconciled again (drift repair
            and a status refresh).
        request_timeout: seconds for each API request the operator makes.
        watch_timeout: seconds the API server keeps one watch open (kopf reconnects).
        autoscale_interval: seconds between the autoscaler's rounds.
        metrics_port: where the autoscaler's Prometheus metrics are served; 0: nowhere.
        metrics_host: the address they are served on.
        router_selector: label selector of the router pods the autoscaler asks.
        router_namespace: their namespace; None: each InferenceService's own.
        router_urls: routers outside the cluster, by base URL (asked as well).
    """

    config: OperatorConfig = field(default_factory=OperatorConfig)
    namespaces: tuple[str, ...] = ()
    probe: bool = True
    resync_seconds: float = 30.0
    request_timeout: float = 15.0
    watch_timeout: int = 300
    autoscale_interval: float = 5.0
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    router_selector: str = DEFAULT_ROUTER_SELECTOR
    router_namespace: str | None = None
    router_urls: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorOptions:
        env = dict(os.environ if env is None else env)
        config = OperatorConfig(
            worker_image=env.get("SLUICE_WORKER_IMAGE") or DEFAULT_WORKER_IMAGE,
            vllm_worker_image=env.get("SLUICE_VLLM_WORKER_IMAGE") or None,
            model_cache=ModelCache.parse(env.get("SLUICE_MODEL_CACHE") or MODEL_CACHE_DEFAULT),
            worker_command=tuple(shlex.split(env.get("SLUICE_WORKER_COMMAND") or "sluice")))
        namespaces = tuple(n.strip() for n in env.get("SLUICE_NAMESPACES", "").split(",")
                           if n.strip())
        return cls(config=config, namespaces=namespaces,
                   probe=env.get("SLUICE_ENDPOINT_PROBE", "1") not in ("0", "false", "no"),
                   resync_seconds=float(env.get("SLUICE_RESYNC_SECONDS") or 30.0),
                   autoscale_interval=float(env.get("SLUICE_AUTOSCALE_INTERVAL") or 5.0),
                   metrics_port=int(env.get("SLUICE_METRICS_PORT") or 0),
                   router_selector=env.get("SLUICE_ROUTER_SELECTOR") or DEFAULT_ROUTER_SELECTOR,
                   router_namespace=env.get("SLUICE_ROUTER_NAMESPACE") or None)


def configure(settings: Any, options: OperatorOptions) -> None:
    """Set every kopf setting the operator relies on, explicitly.

    Args:
        settings: ``kopf.OperatorSettings`` (from a startup handler).
    """
    import kopf

    # Standalone: the chart installs no kopf peering CRDs, and one replica runs at a time.
    settings.peering.standalone = True
    settings.peering.mandatory = False
    # Exact namespaces from the flags: no cluster-wide namespace/CRD scanning (and no RBAC).
    settings.scanning.disabled = True
    # Every watch ends server-side after watch_timeout s and the client gives up 30 s later,
    # so a silently dead connection is reopened (kopf also reopens a stream that stays
    # silent past its inactivity timeout, 70 s by default).
    settings.watching.server_timeout = options.watch_timeout
    settings.watching.client_timeout = options.watch_timeout + 30
    settings.watching.connect_timeout = 10
    for resource in (("apps", "deployments"), ("v1", "pods"), ("v1", "endpoints")):
        settings.watching.label_selectors[resource] = MANAGED_SELECTOR  # server-side filter
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    # Kubernetes Events only for warnings and errors (not one per successful handler).
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "sluice-operator"
    # Handler progress and the last-handled spec in annotations; never a finalizer (there
    # are no deletion handlers, daemons or timers, so kopf adds none).
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.execution.max_workers = 4  # sync handlers only; the operator's are async
