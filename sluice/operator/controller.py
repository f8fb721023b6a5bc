"""Reconcile and status refresh: the pure builders and status code, wired to the API.

The kopf handlers (handlers.py) only decide *when*; this decides *what*:

    reconcile(body)  build the children (resources.desired_objects) → server-side apply
                     → refresh. An invalid spec writes the InvalidSpec condition and raises
                     InvalidSpec (the handler turns it into kopf.PermanentError: no retries).
                     A cascade has no children: only its status (tiers that do not resolve
                     are an InvalidSpec condition, not an error: a tier created later makes
                     it valid at the next resync); a worker InferenceService turned into a
                     cascade has its worker Deployment, Service and PDB deleted.
    scale(body)      replicas-only change: patch the Deployment's spec.replicas → refresh.
    refresh(ns, n)   read Deployment, Pods, Endpoints; probe one ready address's /health;
                     compute the status (status.compute_status); write it if it changed.
                     A cascade's status comes from its namespace's InferenceServices
                     (status.compute_cascade_status); when a tier's Ready changes, the
                     cascades naming it are refreshed too.
    record(ns, n, f) write the autoscaler's status fields (under the same lock as refresh).
    deleted(body)    forget it; the others declaring its served name are refreshed at once
                     (the next oldest loses its Conflict condition now, not at the resync).

Neither reconcile nor scale ever lowers the Deployment's replicas itself: a lower count goes
to the Drainer (drain.py), which removes the chosen replicas once they are drained; a higher
or equal count cancels a drain in progress.

Refreshes of one InferenceService are serialized (a lock per object), so an older view never
overwrites a newer one written by a concurrent event.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from sluice.api.service import InferenceServiceStatus, served_model, served_name_owners, \
    served_names
from sluice.operator import resources
from sluice.operator.drain import Drainer
from sluice.operator.kube import ApiError, KubeApi
from sluice.operator.resources import InvalidSpec, OperatorConfig
from sluice.operator.status import Probe, compute_cascade_status, compute_status, \
    ready_addresses, same_status, status_patch

logger = logging.getLogger(__name__)


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Controller:
    """Args:
        kube: the API (``kube.Kube``, or a fake in tests).
        config: what the operator's flags decide about worker pods.
        probe: GET one ready address's /health before reporting Ready.
        probe_timeout: seconds for that GET.
        drainer: removes replicas after draining them (None: one with default routers).
    """

    def __init__(self, kube: KubeApi, config: OperatorConfig, probe: bool = True,
                 probe_timeout: float = 2.0, clock: Any = utc_now,
                 drainer: Drainer | None = None):
        self.kube, self.config, self.probe_enabled = kube, config, probe
        self._clock = clock
        if drainer is None:
            from sluice.operator.routers import Routers

            drainer = Drainer(kube, Routers(kube), wall=clock)
        self.drainer = drainer
        # Straight to the pod: no proxy from the environment.
        self._http = httpx.AsyncClient(timeout=probe_timeout, trust_env=False) if probe else None
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Specs the API server refused at apply time (e.g. a malformed quantity), by object:
        # (generation, message), so a later refresh keeps saying InvalidSpec.
        self._refused: dict[tuple[str, str], tuple[int | None, str]] = {}
        # The metadata.generation last reconciled (applied, or found invalid), by object.
        self._observed: dict[tuple[str, str], int | None] = {}

    async def close(self) -> None:
        await self.drainer.close()
        if self._http is not None:
            await self._http.aclose()

    async def reconcile(self, body: Mapping[str, Any]) -> None:
        """Make the children match the spec, then refresh the status.

        Raises:
            InvalidSpec: after writing it as the InvalidSpec condition.
            ApiError: a call failed for another reason (worth a retry).
        """
        key = _key(body)
        try:
            objects = resources.desired_objects(body, self.config)
            if objects:  # none for a cascade
                await self._keep_replicas_until_drained(body, objects[-1])
            else:
                await self._remove_workers(body)
            for obj in objects:
                await self._apply(obj)
        except InvalidSpec as exc:
            self._refused[key] = (_generation(body), str(exc))
            self._observed[key] = _generation(body)
            await self.refresh(*key)
            raise
        self._refused.pop(key, None)
        self._observed[key] = _generation(body)
        await self.refresh(*key)

    async def _apply(self, obj: dict[str, Any]) -> None:
        try:
            await self.kube.apply(obj)
        except ApiError as exc:
            if exc.status in (400, 422):  # the API server refuses the object as built
                raise InvalidSpec(f"{obj['kind']} {obj['metadata']['name']} was refused: "
                                  f"{exc.message}") from None
            raise
        logger.debug("applied %s %s/%s", obj["kind"], obj["metadata"]["namespace"],
                     obj["metadata"]["name"])

    async def _remove_workers(self, body: Mapping[str, Any]) -> None:
        """A cascade runs no workers: the ones it had as a worker InferenceService go (the
        Deployment last, so while it exists the others may still be there to delete). Only
        a Deployment this InferenceService owns: a ``NAME-worker`` of someone else's stays."""
        namespace, name = _key(body)
        worker = resources.worker_name(name)
        deployment = await self.kube.get_deployment(namespace, worker)
        owners = ((deployment or {}).get("metadata") or {}).get("ownerReferences") or ()
        if not any(o.get("uid") == body["metadata"].get("uid") for o in owners):
            return
        await self.drainer.cancel(namespace, name)
        for api_version, kind in (("v1", "Service"),
                                  (self.config.pdb_api_version, "PodDisruptionBudget"),
                                  ("apps/v1", "Deployment")):
            await self.kube.delete_child(namespace, api_version, kind, worker)
        logger.info("%s/%s is a cascade now: deleted its worker Deployment, Service and PDB",
                    namespace, name)

    async def _keep_replicas_until_drained(self, body: Mapping[str, Any],
                                           deployment: dict[str, Any]) -> None:
        """Apply keeps the Deployment's current replicas while fewer are wanted (the
        drainer lowers them); otherwise any drain is called off."""
        namespace, name = _key(body)
        current = await self.kube.get_deployment(namespace, resources.worker_name(name))
        have = int(((current or {}).get("spec") or {}).get("replicas") or 0)
        wanted = int(deployment["spec"]["replicas"])
        if current is not None and wanted < have:
            deployment["spec"]["replicas"] = have
            self.drainer.scale_down(body, wanted)
        else:
            await self.drainer.cancel(namespace, name)

    async def scale(self, body: Mapping[str, Any]) -> bool:
        """Replicas-only change: a higher count patches the Deployment's replicas, a lower
        one goes to the drainer. False when there is no Deployment yet (the caller
        reconciles instead)."""
        namespace, name = _key(body)
        replicas = int((body.get("spec") or {}).get("replicas", 1))
        deployment = await self.kube.get_deployment(namespace, resources.worker_name(name))
        if deployment is None:
            return False
        if replicas < int((deployment.get("spec") or {}).get("replicas") or 0):
            self.drainer.scale_down(body, replicas)
        else:
            await self.drainer.cancel(namespace, name)
            if not await self.kube.scale_deployment(namespace, resources.worker_name(name),
                                                    replicas):
                return False
        self._observed[(namespace, name)] = _generation(body)
        await self.refresh(namespace, name)
        return True

    async def record(self, namespace: str, name: str, fields: dict[str, Any]) -> None:
        """Write the autoscaler's status fields (camelCase JSON), serialized with refresh so
        neither overwrites the other with an older view."""
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            await self.kube.patch_isvc_status(namespace, name, fields)

    async def child_deleted(self, namespace: str, name: str) -> None:
        """A worker Deployment or Service vanished: put it back unless its owner is going."""
        body = await self.kube.get_isvc(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        try:
            await self.reconcile(body)
        except InvalidSpec:
            pass  # already written as the condition

    async def deleted(self, body: Mapping[str, Any]) -> None:
        """The InferenceService is gone: drop what we kept about it, and refresh the others
        of its namespace that declare its served name (one of them serves it now)."""
        namespace, name = _key(body)
        for kept in (self._locks, self._refused, self._observed):
            kept.pop((namespace, name), None)
        self.drainer.forget(namespace, name)
        model = served_model(body)
        if model is None:
            return
        for other in await self.kube.list_isvcs(namespace):
            if served_model(other) == model and other["metadata"]["name"] != name:
                await self.refresh(namespace, other["metadata"]["name"])

    async def refresh(self, namespace: str, name: str) -> InferenceServiceStatus | None:
        """Recompute and write the status; returns it (None: the object is gone)."""
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            body = await self.kube.get_isvc(namespace, name)
            if body is None:
                return None
            status = await self._observe(body)
            changed = not same_status(body.get("status"), status)
            if changed:
                await self.kube.patch_isvc_status(namespace, name,
                                                  status_patch(status, body.get("status")))
                ready = status.condition("Ready")
                logger.info("%s/%s: %d/%d ready; Ready=%s %s", namespace, name,
                            status.ready_replicas, int(body["spec"].get("replicas", 1)),
                            ready.status if ready else "?", ready.reason if ready else "")
        if changed and _ready_of(body.get("status")) != _ready_of(status_patch(status)) \
                and not resources.is_cascade(body):
            await self._refresh_cascades_over(namespace, name)
        return status

    async def _refresh_cascades_over(self, namespace: str, tier: str) -> None:
        """A tier's Ready changed: the cascades naming it follow now, not at the next
        resync."""
        for other in await self.kube.list_isvcs(namespace):
            if tier in (((other.get("spec") or {}).get("cascade") or {}).get("tiers") or ()):
                await self.refresh(namespace, other["metadata"]["name"])

    async def _observe(self, body: Mapping[str, Any]) -> InferenceServiceStatus:
        namespace, name = _key(body)
        invalid = self._invalid(body)
        if resources.is_cascade(body):
            neighbours = await self.kube.list_isvcs(namespace)
            return compute_cascade_status(body, neighbours, self._clock(), invalid,
                                          observed=self._observed.get((namespace, name)),
                                          conflict=_conflict(body, neighbours))
        worker = resources.worker_name(name)
        if not resources.usable_name(name):  # no children: nor a valid label value to list
            neighbours = await self.kube.list_isvcs(namespace)
            return compute_status(body, None, [], None, None, self._clock(), invalid,
                                  observed=self._observed.get((namespace, name)),
                                  conflict=_conflict(body, neighbours))
        deployment, pods, endpoints, neighbours = await asyncio.gather(
            self.kube.get_deployment(namespace, worker),
            self.kube.list_pods(namespace, resources.selector_string(name)),
            self.kube.get_endpoints(namespace, worker),
            self.kube.list_isvcs(namespace))
        probe = None
        addresses = ready_addresses(endpoints)
        if addresses and self._http is not None and invalid is None:
            probe = await self._probe(addresses[0])
        return compute_status(body, deployment, pods, endpoints, probe, self._clock(), invalid,
                              observed=self._observed.get((namespace, name)),
                              conflict=_conflict(body, neighbours))

    def _invalid(self, body: Mapping[str, Any]) -> str | None:
        refused = self._refused.get(_key(body))
        if refused is not None and refused[0] == _generation(body):
            return refused[1]
        try:
            resources.parse_service(body)
        except InvalidSpec as exc:
            return str(exc)
        return None

    async def _probe(self, address: str) -> Probe:
        assert self._http is not None
        url = f"http://{address}/health"
        try:
            response = await self._http.get(url)
        except httpx.HTTPError as exc:
            return Probe(url, False, f"{type(exc).__name__}: {exc}".rstrip(": "))
        return Probe(url, response.status_code == 200, f"HTTP {response.status_code}")

    async def resync(self, namespaces: list[str | None]) -> None:
        """Reconcile every InferenceService in these namespaces (None: all), the periodic
        reconcile: server-side apply puts back what someone edited in a child (a Deployment's
        image, args or replicas), re-creates a child whose re-create failed before, and the
        refresh catches what no event announces (a worker that stops answering /health).
        One object's failure is logged and does not stop the others."""
        for namespace in namespaces:
            for body in await self.kube.list_isvcs(namespace):
                if (body.get("metadata") or {}).get("deletionTimestamp"):
                    continue
                try:
                    await self.reconcile(body)
                except InvalidSpec:
                    pass  # written as the condition
                except ApiError as exc:
                    logger.warning("resync of %s/%s failed: %s", *_key(body), exc)


def _conflict(body: Mapping[str, Any], neighbours: list[Mapping[str, Any]]) -> str | None:
    """The older InferenceService that serves this one's model name, if another does."""
    owner = served_name_owners(served_names(neighbours)).get(served_model(body) or "")
    return owner if owner not in (None, _key(body)[1]) else None


def _ready_of(status: Mapping[str, Any] | None) -> str | None:
    """The Ready condition's status in a status as JSON, or None."""
    for condition in (status or {}).get("conditions") or ():
        if condition.get("type") == "Ready":
            return condition.get("status")
    return None


def _key(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body["metadata"]
    return meta["namespace"], meta["name"]


def _generation(body: Mapping[str, Any]) -> int | None:
    return (body.get("metadata") or {}).get("generation")
