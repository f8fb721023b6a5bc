"""Scale-down that loses nothing: the replica to remove is chosen, drained, then removed.

Whoever lowers ``spec.replicas`` (the autoscaler, ``kubectl scale``, an HPA), the controller
never lowers the worker Deployment's replicas at once; it hands the new count to
``Drainer.scale_down``, which runs in the background (never in a kopf handler):

    choose   the ready pods with the fewest requests in flight, summed over the routers'
             /health (ties: the youngest); pods that are not ready (starting, failing) go
             first and need no drain
    drain    annotate it (serving.sluice.dev/draining, and
             controller.kubernetes.io/pod-deletion-cost so 1.21+ ReplicaSets remove it
             first) and POST its /drain: its /health answers 503, so the routers stop
             picking it within a poll and the kubelet marks it not ready; requests in
             flight finish
    wait     until the API says the pod is not ready, no answering router counts a request
             in flight there or still routes to it, and the worker itself reports nothing
             running or waiting, or until drainSeconds pass
    remove   lower the Deployment's replicas: a ReplicaSet deletes not-ready pods before
             ready ones (Kubernetes 1.20 has no pod-deletion-cost), so the drained pod is
             the one that goes; its preStop hook finds it idle
    settle   a drained pod that the ReplicaSet kept after all is put back (DELETE /drain)

A higher count while a drain runs cancels it and puts the drained pods back. The annotation
is the drain's memory across operator restarts: a restarted operator resumes the drain of
the pods it finds annotated (reconcile sees the Deployment above spec.replicas), or puts
them back when nothing needs removing.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from sluice.api.service import AutoscalingSpec
from sluice.operator import events, resources
from sluice.operator.kube import ApiError, KubeApi
from sluice.operator.resources import (DELETION_COST_ANNOTATION, DRAINING_ANNOTATION,
                                       WORKER_PORT)
from sluice.operator.routers import Routers, WorkerView, worker_url

logger = logging.getLogger(__name__)

DELETION_COST = "-1000"  # below every other pod's default 0: removed first (1.21+)
Key = tuple[str, str]


class Drainer:
    """Args:
        kube: the API.
        routers: where the routers' views of the workers come from.
        http: a client for the worker pods (POST/DELETE /drain), or None to make one.
        poll_s: seconds between checks while a drain runs.
        settle_s: how long to wait for the ReplicaSet to remove the drained pods.
        clock: monotonic seconds (deadlines); wall: RFC 3339 now (annotations, Events).
    """

    def __init__(self, kube: KubeApi, routers: Routers, http: httpx.AsyncClient | None = None,
                 poll_s: float = 1.0, settle_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], str] | None = None):
        from sluice.operator.controller import utc_now

        self.kube, self.routers = kube, routers
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=3.0, trust_env=False)
        self.poll_s, self.settle_s = poll_s, settle_s
        self._clock, self._wall = clock, wall or utc_now
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._targets: dict[Key, int] = {}
        self._bodies: dict[Key, Mapping[str, Any]] = {}
        self._started: dict[Key, float] = {}

    async def close(self) -> None:
        """Stop every drain where it is (the annotations let a restart resume it)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._own_http:
            await self._http.aclose()

    def draining(self, namespace: str, name: str) -> bool:
        task = self._tasks.get((namespace, name))
        return task is not None and not task.done()

    def scale_down(self, body: Mapping[str, Any], target: int) -> None:
        """Bring the worker Deployment down to ``target`` replicas, draining what goes
        (returns at once; a running drain takes the new target)."""
        key = _key(body)
        self._targets[key], self._bodies[key] = target, body
        if not self.draining(*key):
            self._started[key] = self._clock()
            self._tasks[key] = asyncio.create_task(self._run(key), name=f"drain {key}")

    async def cancel(self, namespace: str, name: str) -> None:
        """Stop a drain (replicas are going up, or stay): put drained pods back."""
        key = (namespace, name)
        task = self._tasks.pop(key, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for pod in await self._pods(key):
            if _marked(pod):
                await self._undrain(pod)

    def forget(self, namespace: str, name: str) -> None:
        """The InferenceService is gone (its pods go with it)."""
        key = (namespace, name)
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
        for kept in (self._targets, self._bodies, self._started):
            kept.pop(key, None)

    # ------------------------------------------------------------------ the drain

    async def _run(self, key: Key) -> None:
        try:
            while not await self._step(key):
                await asyncio.sleep(self.poll_s)
        except asyncio.CancelledError:
            raise
        except ApiError as exc:  # the next scale or reconcile starts over
            logger.warning("scale-down of %s/%s stopped: %s", *key, exc)
        except Exception:  # noqa: BLE001 - a background task must say why it died
            logger.exception("scale-down of %s/%s failed", *key)

    async def _step(self, key: Key) -> bool:
        """One look; True when done (the Deployment is at the target, or gone)."""
        namespace, name = key
        target = self._targets[key]
        deployment = await self.kube.get_deployment(namespace, resources.worker_name(name))
        if deployment is None:
            return True
        current = int((deployment.get("spec") or {}).get("replicas") or 0)
        if current <= target:
            return True
        pods = await self._pods(key)
        marked = [p for p in pods if _marked(p)]
        idle = [p for p in pods if not _ready(p) and not _marked(p)]
        need = max(0, current - target - len(idle))
        for pod in marked[need:]:  # the target went up meanwhile
            await self._undrain(pod)
        marked = marked[:need]
        if len(marked) < need:
            views, _ = await self.routers.workers(self.routers.namespace_for(namespace))
            chosen = sorted((p for p in pods if _ready(p) and not _marked(p)),
                            key=lambda p: (_view(views, p).in_flight, _youngest_first(p)))
            for pod in chosen[:need - len(marked)]:
                await self._drain(key, pod, _view(views, pod).in_flight, target)
                marked.append(pod)
            self._started[key] = self._clock()  # each drained pod gets its drainSeconds
        drain_s = _drain_seconds(self._bodies[key])
        overdue = self._clock() - self._started[key] >= drain_s
        if marked and not overdue and not await self._drained(namespace, marked):
            return False
        if marked and overdue:
            logger.warning("%s/%s: drainSeconds (%g) passed; removing %s anyway", *key, drain_s,
                           ", ".join(_name(p) for p in marked))
        await self.kube.scale_deployment(namespace, resources.worker_name(name), target)
        logger.info("%s/%s: worker Deployment %d → %d replicas (removing %s)", *key, current,
                    target, ", ".join(_name(p) for p in marked + idle) or "-")
        await self._settle(key, {_name(p) for p in marked}, target)
        return True

    async def _drained(self, namespace: str, marked: list[Mapping[str, Any]]) -> bool:
        """Every marked pod is not ready, and neither the routers nor the worker itself count
        a request there."""
        if any(_ready(p) for p in marked):
            return False
        views, _ = await self.routers.workers(self.routers.namespace_for(namespace))
        for pod in marked:
            view = _view(views, pod)
            if view.in_flight or view.ready:
                return False
            if await self._worker_busy(pod):
                return False
        return True

    async def _settle(self, key: Key, marked: set[str], target: int) -> None:
        """Wait for the ReplicaSet to delete the drained pods; put back any it kept."""
        deadline = self._clock() + self.settle_s
        while True:
            pods = await self._pods(key)
            kept = [p for p in pods if _name(p) in marked]
            if not kept:
                return
            if len(pods) <= target or self._clock() >= deadline:
                for pod in kept:
                    logger.info("%s/%s: pod %s was drained but kept; putting it back", *key,
                                _name(pod))
                    await self._undrain(pod)
                return
            await asyncio.sleep(self.poll_s)

    async def _drain(self, key: Key, pod: Mapping[str, Any], in_flight: int,
                     target: int) -> None:
        namespace, name = key
        await self.kube.patch_pod_annotations(namespace, _name(pod), {
            DRAINING_ANNOTATION: self._wall(), DELETION_COST_ANNOTATION: DELETION_COST})
        answered = await self._worker_call(pod, "POST")
        message = (f"pod {_name(pod)} ({in_flight} request(s) in flight) leaves routing and "
                   f"finishes its requests before the scale-down to {target} replica(s)")
        if answered is None:
            message += "; it did not answer POST /drain, so it is removed after drainSeconds"
        logger.info("%s/%s: %s", namespace, name, message)
        await events.post(self.kube, self._bodies[key], "Draining", message, self._wall())

    async def _undrain(self, pod: Mapping[str, Any]) -> None:
        await self._worker_call(pod, "DELETE")
        await self.kube.patch_pod_annotations(
            (pod.get("metadata") or {}).get("namespace", ""), _name(pod),
            {DRAINING_ANNOTATION: None, DELETION_COST_ANNOTATION: None})

    async def _worker_busy(self, pod: Mapping[str, Any]) -> bool:
        """The worker reports requests running or waiting (POST /drain is idempotent and
        answers with them); a worker that does not answer has nothing left to lose."""
        answer = await self._worker_call(pod, "POST")
        if answer is None:
            return False
        return bool(int(answer.get("running") or 0) + int(answer.get("waiting") or 0))

    async def _worker_call(self, pod: Mapping[str, Any], method: str) -> dict[str, Any] | None:
        url = worker_url(pod, WORKER_PORT)
        if url is None:
            return None
        try:
            response = await self._http.request(method, f"{url}/drain")
            response.raise_for_status()
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("%s %s/drain: %s", method, url, exc)
            return None
        return body if isinstance(body, dict) else {}

    async def _pods(self, key: Key) -> list[dict[str, Any]]:
        """The worker pods of the InferenceService that are not terminating."""
        pods = await self.kube.list_pods(key[0], resources.selector_string(key[1]))
        return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]


def _key(body: Mapping[str, Any]) -> Key:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def _name(pod: Mapping[str, Any]) -> str:
    return (pod.get("metadata") or {}).get("name", "?")


def _marked(pod: Mapping[str, Any]) -> bool:
    return DRAINING_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {})


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or ())


def _view(views: Mapping[str, WorkerView], pod: Mapping[str, Any]) -> WorkerView:
    url = worker_url(pod, WORKER_PORT)
    return views.get(url, WorkerView()) if url else WorkerView()


def _youngest_first(pod: Mapping[str, Any]) -> float:
    """A sort key putting the latest creationTimestamp first (its KV cache is the coldest)."""
    created = (pod.get("metadata") or {}).get("creationTimestamp") or ""
    try:
        return -datetime.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _drain_seconds(body: Mapping[str, Any]) -> float:
    scaling = (body.get("spec") or {}).get("autoscaling") or {}
    value = scaling.get("drainSeconds")
    return float(value) if isinstance(value, int | float) and value > 0 \
        else AutoscalingSpec().drain_seconds
