"""kopf handlers of the Sluice operator: when to reconcile and when to refresh status.

    InferenceService  create / resume / update  → Controller.reconcile (children + status);
                      an update that only changes spec.replicas → Controller.scale
    worker Deployment, Pod, Endpoints events    → Controller.refresh of the owner
                      (a deleted Deployment or Service is put back)
    every --resync-seconds                      → Controller.resync: reconcile every one
                                                  (heals edited or missing children; catches
                                                  what no event announces, e.g. /health
                                                  stops answering)
    every --autoscale-interval                  → Autoscaler.tick (autoscaler.py): routers'
                                                  demand → policy → spec.replicas through
                                                  the scale subresource; a lower count is
                                                  removed by the Drainer (drain.py); its
                                                  metrics on --metrics-port (/metrics)

No deletion handler, daemon or timer, so kopf never puts a finalizer on anything: deleting
an InferenceService is instant even with the operator down, and the garbage collector
removes the children through their ownerReferences. Handler progress and the last-handled
spec live in annotations (``serving.sluice.dev/...``), never in status.

RBAC the operator needs (namespaced Role per watched namespace, or a ClusterRole with
--all-namespaces); nothing else is called:

    apiGroups: [serving.sluice.dev]
      resources: [inferenceservices]             verbs: [get, list, watch, patch]
      resources: [inferenceservices/status]      verbs: [get, patch]
      resources: [inferenceservices/scale]       verbs: [patch]     # the autoscaler's
                                                  # spec.replicas (only with autoscaling on)
      resources: [inferenceservices/finalizers]  verbs: [update]   # ownerReferences with
                                                  # blockOwnerDeletion, where the
                                                  # OwnerReferencesPermissionEnforcement
                                                  # admission plugin is on
    apiGroups: [apps]
      resources: [deployments]                   verbs: [get, list, watch, create, patch, delete]
    apiGroups: [policy]
      resources: [poddisruptionbudgets]          verbs: [create, patch, delete]  # the workers'
                                                  # (server-side apply; v1, or v1beta1 on 1.20)
    apiGroups: [""]
      resources: [services]                      verbs: [get, create, patch, delete]
      resources: [endpoints]                     verbs: [get, list, watch]
      resources: [pods]                          verbs: [list, watch, patch]  # patch: the
                                                  # draining and pod-deletion-cost
                                                  # annotations of a worker being removed;
                                                  # list also finds router pods
      resources: [events]                        verbs: [create]    # kopf's warnings, and
                                                  # ScaledUp/ScaledDown/Draining/NoRouter
    apiGroups: [events.k8s.io]
      resources: [events]                        verbs: [create]    # newer kopf/clusters

Not needed: namespaces and customresourcedefinitions (scanning is off: namespaces are the
exact names given), kopf's peering resources (standalone), other deletes (garbage
collection removes the children of a deleted InferenceService; the ReplicaSet a drained
pod; the three deletes above are of a worker InferenceService edited into a cascade),
pods/eviction. The operator also talks HTTP to pods
(no RBAC): a worker's /health and /drain, a router's /autoscale/demand and /health.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import kopf

from sluice.api.names import GROUP, PLURAL
from sluice.operator import resources
from sluice.operator.autoscaler import Autoscaler
from sluice.operator.controller import Controller
from sluice.operator.drain import Drainer
from sluice.operator.kube import ApiError, Kube
from sluice.operator.resources import InvalidSpec
from sluice.operator.routers import Routers
from sluice.operator.settings import OperatorOptions, configure

VERSION = "v1alpha1"
ISVC = (GROUP, VERSION, PLURAL)
CHILD_LABELS = {resources.MANAGED_BY_LABEL: resources.MANAGED_BY,
                resources.NAME_LABEL: resources.WORKER_APP}


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger,
                  **_: Any) -> None:
    options: OperatorOptions = memo.get("options") or OperatorOptions.from_env()
    configure(settings, options)
    _quiet_logs()
    memo.options = options
    memo.kube = kube = await Kube.connect(options.request_timeout)
    config = dataclasses.replace(options.config, pdb_api_version=await _pdb_version(kube))
    routers = Routers(kube, options.router_selector, options.router_namespace,
                      urls=options.router_urls)
    memo.controller = Controller(kube, config, probe=options.probe,
                                 drainer=Drainer(kube, routers))
    memo.autoscaler = Autoscaler(kube, memo.controller, routers)
    memo.routers = routers
    memo.metrics_server = _serve_metrics(memo.autoscaler, options, logger)
    memo.tasks = [asyncio.create_task(_resync_forever(memo.controller, options)),
                  asyncio.create_task(_autoscale_forever(memo.autoscaler, options))]
    logger.info("worker image %s, model cache %s, namespaces %s, workers' PDB %s",
                config.worker_image, config.model_cache, options.namespaces or "all",
                config.pdb_api_version)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    tasks = memo.get("tasks") or []
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if memo.get("metrics_server") is not None:
        memo.metrics_server.shutdown()
    if memo.get("controller") is not None:
        await memo.controller.close()
    if memo.get("routers") is not None:
        await memo.routers.close()
    if memo.get("kube") is not None:
        await memo.kube.close()


@kopf.on.resume(*ISVC)
@kopf.on.create(*ISVC)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _reconcile(memo.controller, body)


@kopf.on.update(*ISVC)
async def update(body: kopf.Body, diff: kopf.Diff, memo: kopf.Memo, logger: logging.Logger,
                 **_: Any) -> None:
    replicas_only = bool(diff) and all(path == ("spec", "replicas") for _, path, _, _ in diff)
    if replicas_only and await _call(memo.controller.scale(body)):
        logger.info("scaled the worker Deployment to %s", body["spec"].get("replicas"))
        return
    await _reconcile(memo.controller, body)


@kopf.on.event(*ISVC)
async def forget(type: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger,
                 **_: Any) -> None:
    if type == "DELETED" and memo.get("controller") is not None:
        try:  # event handlers are not retried: the resync loop catches up after a failure
            await memo.controller.deleted(body)
        except ApiError as exc:
            logger.warning("services sharing its served name not refreshed: %s", exc)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("v1", "endpoints", labels=CHILD_LABELS)
@kopf.on.event("v1", "pods", labels=CHILD_LABELS)
async def child_changed(type: str, body: kopf.Body, namespace: str, labels: kopf.Labels,
                        memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    owner = labels.get(resources.INSTANCE_LABEL)
    if not owner or memo.get("controller") is None:
        return
    try:  # event handlers are not retried: the resync loop catches up after a failure
        if type == "DELETED" and body.get("kind") in ("Deployment", "Endpoints"):
            await memo.controller.child_deleted(namespace, owner)
        await memo.controller.refresh(namespace, owner)
    except ApiError as exc:
        logger.warning("status of %s/%s not refreshed: %s", namespace, owner, exc)


async def _reconcile(controller: Controller, body: kopf.Body) -> None:
    try:
        await _call(controller.reconcile(body))
    except InvalidSpec as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from None


async def _call(coro: Any) -> Any:
    """Await a controller call; API failures become kopf's "retry later"."""
    try:
        return await coro
    except ApiError as exc:
        delay = 30 if exc.status in (403, 404) else 10
        raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=delay) from None


class _DropRoutineSuccesses(logging.Filter):
    """kopf logs every successful event handler at INFO: one line per pod status change."""

    ROUTINE = ("Handler 'child_changed' succeeded.", "Handler 'forget' succeeded.")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or record.getMessage() not in self.ROUTINE


def _quiet_logs() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health probe
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # kubelet's liveness GETs
    kopf_objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, _DropRoutineSuccesses) for f in kopf_objects.filters):
        kopf_objects.addFilter(_DropRoutineSuccesses())


async def _pdb_version(kube: Kube) -> str:
    try:
        return await kube.pdb_api_version()
    except ApiError as exc:
        logging.getLogger(__name__).warning("policy API discovery failed (%s); using %s", exc,
                                            resources.PDB_API_VERSION)
        return resources.PDB_API_VERSION


def _serve_metrics(autoscaler: Autoscaler, options: OperatorOptions,
                   logger: logging.Logger) -> Any:
    """The autoscaler's Prometheus metrics on --metrics-port (a thread of
    prometheus_client's own server); None when off."""
    if not options.metrics_port:
        return None
    from prometheus_client import start_http_server

    server, _ = start_http_server(options.metrics_port, options.metrics_host,
                                  registry=autoscaler.metrics.registry)
    logger.info("autoscaler metrics on http://%s:%d/metrics", options.metrics_host,
                options.metrics_port)
    return server


async def _autoscale_forever(autoscaler: Autoscaler, options: OperatorOptions) -> None:
    namespaces: list[str | None] = list(options.namespaces) or [None]
    while True:
        await asyncio.sleep(options.autoscale_interval)  # a background task, not a handler
        try:
            await autoscaler.tick(namespaces)
        except ApiError as exc:
            logging.getLogger(__name__).warning("autoscaler round failed: %s", exc)
        except Exception:  # noqa: BLE001 - the loop must outlive one bad round
            logging.getLogger(__name__).exception("autoscaler round failed")


async def _resync_forever(controller: Controller, options: OperatorOptions) -> None:
    namespaces: list[str | None] = list(options.namespaces) or [None]
    while True:
        await asyncio.sleep(options.resync_seconds)  # a background task, not a handler
        try:
            await controller.resync(namespaces)
        except ApiError as exc:
            logging.getLogger(__name__).warning("resync failed: %s", exc)
        except Exception:  # noqa: BLE001 - the loop must outlive one bad round
            logging.getLogger(__name__).exception("resync failed")
