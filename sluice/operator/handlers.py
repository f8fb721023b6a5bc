"""kopf handlers of the Sluice operator: when to reconcile and when to refresh status.

    InferenceService  create / resume / update  → Controller.reconcile (children + status);
                      an update that only changes spec.replicas → Controller.scale
    worker Deployment, Pod, Endpoints events    → Controller.refresh of the owner
                      (a deleted Deployment or Service is put back)
    every --resync-seconds                      → Controller.resync (catches what no event
                                                  announces, e.g. /health stops answering)

No deletion handler, daemon or timer, so kopf never puts a finalizer on anything: deleting
an InferenceService is instant even with the operator down, and the garbage collector
removes the children through their ownerReferences. Handler progress and the last-handled
spec live in annotations (``serving.sluice.dev/...``), never in status.

RBAC the operator needs (namespaced Role per watched namespace, or a ClusterRole with
--all-namespaces); nothing else is called:

    apiGroups: [serving.sluice.dev]
      resources: [inferenceservices]             verbs: [get, list, watch, patch]
      resources: [inferenceservices/status]      verbs: [get, patch]
      resources: [inferenceservices/finalizers]  verbs: [update]   # ownerReferences with
                                                  # blockOwnerDeletion, where the
                                                  # OwnerReferencesPermissionEnforcement
                                                  # admission plugin is on
    apiGroups: [apps]
      resources: [deployments]                   verbs: [get, list, watch, create, patch]
    apiGroups: [""]
      resources: [services]                      verbs: [get, create, patch]
      resources: [endpoints]                     verbs: [get, list, watch]
      resources: [pods]                          verbs: [list, watch]
      resources: [events]                        verbs: [create]    # kopf posts warnings
    apiGroups: [events.k8s.io]
      resources: [events]                        verbs: [create]    # newer kopf/clusters

Not needed: namespaces and customresourcedefinitions (scanning is off: namespaces are the
exact names given), kopf's peering resources (standalone), deletes (garbage collection).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from sluice.operator import resources
from sluice.operator.controller import Controller
from sluice.operator.kube import ApiError, Kube
from sluice.operator.resources import GROUP, PLURAL, InvalidSpec
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
    memo.kube = await Kube.connect(options.request_timeout)
    memo.controller = Controller(memo.kube, options.config, probe=options.probe)
    memo.resync_task = asyncio.create_task(_resync_forever(memo.controller, options))
    logger.info("worker image %s, model cache %s, namespaces %s", options.config.worker_image,
                options.config.model_cache, options.namespaces or "all")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("resync_task")
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if memo.get("controller") is not None:
        await memo.controller.close()
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
async def forget(type: str, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED" and memo.get("controller") is not None:
        memo.controller.forget(namespace, name)


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


async def _resync_forever(controller: Controller, options: OperatorOptions) -> None:
    namespaces: list[str | None] = list(options.namespaces) or [None]
    while True:
        await asyncio.sleep(options.resync_seconds)  # a background task, not a handler
        try:
            await controller.resync(namespaces)
        except ApiError as exc:
            logging.getLogger(__name__).warning("resync failed: %s", exc)
