"""Scale-down that loses nothing: the drainer against a fake API, fake routers and fake
workers (drain.py), and the worker's own /drain endpoint (a real app, a fake engine).

The drained pod must be the one the ReplicaSet removes: it is chosen by the fewest requests
in flight, leaves readiness first, and the Deployment's replicas drop only once it is not
ready and idle (or drainSeconds passed).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from sluice.operator.resources import DELETION_COST_ANNOTATION, DRAINING_ANNOTATION
from sluice.worker.server import Worker, create_app
from test_operator_autoscaler import World, autoscaled_isvc, worker_pod

KEY = ("team-a", "smol")
A, B, C = "10.1.0.5", "10.1.0.6", "10.1.0.7"


def two_workers(replicas: int = 2, in_flight: dict[str, int] | None = None) -> World:
    """Two ready worker pods (A older, B younger) seen by router-a with these in flight."""
    world = World(autoscaled_isvc(replicas=replicas))
    world.kube.pods += [worker_pod("smol-worker-a", A, created="2026-11-29T09:00:00Z"),
                        worker_pod("smol-worker-b", B, created="2026-11-29T09:30:00Z")]
    in_flight = in_flight or {A: 0, B: 0}
    world.net.routers["10.9.0.1"]["workers"] = [
        {"url": f"http://{ip}:8000", "ready": True, "in_flight": n} for ip, n in in_flight.items()]
    for ip in (A, B):
        world.net.workers[ip] = {"running": in_flight.get(ip, 0)}
    return world


def pod_of(world: World, name: str) -> dict | None:
    return next((p for p in world.kube.pods if p["metadata"]["name"] == name), None)


def kubelet(world: World, ip: str, ready: bool) -> None:
    """The kubelet's readiness probe of the pod at ``ip``, and the routers' view."""
    for pod in world.kube.pods:
        if pod["status"].get("podIP") == ip:
            pod["status"]["conditions"] = [{"type": "Ready", "status": str(ready)}]
    for router in world.net.routers.values():
        for worker in (router or {}).get("workers", []):
            if worker["url"] == f"http://{ip}:8000":
                worker["ready"] = ready


def replicaset(world: World, removes: str | None = None) -> None:
    """What the ReplicaSet controller does when the Deployment's replicas drop: it deletes
    (sets deletionTimestamp on) a not-ready pod first, else ``removes``."""
    want = world.kube.deployments[("team-a", "smol-worker")]["spec"]["replicas"]
    alive = [p for p in world.kube.pods if p["metadata"].get("labels", {}).get(
        "app.kubernetes.io/name") == "sluice-worker" and not p["metadata"].get(
        "deletionTimestamp")]
    alive.sort(key=lambda p: (p["status"]["conditions"][0]["status"] == "True",
                              p["metadata"]["name"] != removes))
    for pod in alive[:max(0, len(alive) - want)]:
        pod["metadata"]["deletionTimestamp"] = "2026-11-29T10:00:01Z"


async def scale(world: World, replicas: int, drained=lambda: None) -> None:
    """spec.replicas → ``replicas`` and the kopf update handler's Controller.scale; then
    let the drain run to its end (``drained`` is called at each of its steps)."""
    world.body["spec"]["replicas"] = replicas
    assert await world.controller.scale(world.body)
    task = world.drainer._tasks.get(KEY)
    for _ in range(2000):
        if task is None or task.done():
            break
        drained()
        replicaset(world)
        await asyncio.sleep(0)
    assert task is None or task.done(), "the drain did not finish"
    replicaset(world)


def test_the_idlest_pod_is_drained_first_then_the_replicas_drop():
    world = two_workers(in_flight={A: 2, B: 0})
    world.net.on_drain = lambda ip: kubelet(world, ip, False)  # /health 503 → not ready
    asyncio.run(scale(world, 1))
    # B (0 in flight) was chosen: annotated, told to drain, then the Deployment went to 1
    assert world.kube.pod_patches[0] == ("smol-worker-b", {
        DRAINING_ANNOTATION: "2026-11-29T10:00:00Z", DELETION_COST_ANNOTATION: "-1000"})
    assert ("POST", f"{B}/drain") in world.net.calls
    assert ("POST", f"{A}/drain") not in world.net.calls
    assert world.kube.scaled == [("smol-worker", 1)]
    assert pod_of(world, "smol-worker-b")["metadata"].get("deletionTimestamp")
    assert not pod_of(world, "smol-worker-a")["metadata"].get("deletionTimestamp")
    (event,) = [e for e in world.kube.events if e["reason"] == "Draining"]
    assert "pod smol-worker-b (0 request(s) in flight) leaves routing" in event["message"]


def test_replicas_do_not_drop_while_a_request_is_in_flight():
    world = two_workers(in_flight={A: 3, B: 1})
    world.net.on_drain = lambda ip: kubelet(world, ip, False)
    steps = []

    def finish_later() -> None:
        steps.append(world.kube.scaled[:])
        if len(steps) == 50:  # the stream on B ends
            world.net.routers["10.9.0.1"]["workers"][1]["in_flight"] = 0
            world.net.workers[B]["running"] = 0

    asyncio.run(scale(world, 1, finish_later))
    assert all(not scaled for scaled in steps[:50])  # nothing removed while B served
    assert world.kube.scaled == [("smol-worker", 1)]
    assert pod_of(world, "smol-worker-b")["metadata"].get("deletionTimestamp")


def test_the_workers_own_count_also_holds_the_removal():
    world = two_workers(in_flight={A: 1, B: 0})
    world.net.workers[B]["running"] = 1  # a request sent to it directly, past the routers
    world.net.on_drain = lambda ip: kubelet(world, ip, False)
    steps = []

    def idle_later() -> None:
        steps.append(world.kube.scaled[:])
        if len(steps) == 30:
            world.net.workers[B]["running"] = 0

    asyncio.run(scale(world, 1, idle_later))
    assert all(not scaled for scaled in steps[:30]) and world.kube.scaled


def test_a_pod_still_ready_holds_the_removal_until_drain_seconds():
    world = two_workers()
    # the kubelet never marks it not ready (e.g. /drain did not reach it)
    steps = []

    def time_passes() -> None:
        steps.append(world.kube.scaled[:])
        world.clock.now += 1.0

    asyncio.run(scale(world, 1, time_passes))
    assert 29 <= len(steps) <= 32  # drainSeconds: 30
    assert world.kube.scaled == [("smol-worker", 1)]


def test_not_ready_pods_go_first_without_a_drain():
    world = two_workers(replicas=3)
    world.kube.pods.append(worker_pod("smol-worker-c", C, ready=False))  # still loading
    asyncio.run(scale(world, 2))
    assert world.kube.scaled == [("smol-worker", 2)]
    assert world.kube.pod_patches == [] and not any(
        path.endswith("/drain") for _, path in world.net.calls)
    assert pod_of(world, "smol-worker-c")["metadata"].get("deletionTimestamp")


def test_scaling_up_during_a_drain_calls_it_off_and_puts_the_pod_back():
    world = two_workers(in_flight={A: 1, B: 1})

    async def go() -> None:
        world.body["spec"]["replicas"] = 1
        await world.controller.scale(world.body)
        for _ in range(20):
            await asyncio.sleep(0)
        assert world.drainer.draining(*KEY)
        world.body["spec"]["replicas"] = 2
        await world.controller.scale(world.body)

    asyncio.run(go())
    assert not world.drainer.draining(*KEY)
    assert world.kube.scaled == [("smol-worker", 2)]
    drained = [name for name, a in world.kube.pod_patches if a.get(DRAINING_ANNOTATION)]
    assert drained and all(DRAINING_ANNOTATION not in (pod_of(world, n)["metadata"].get(
        "annotations") or {}) for n in drained)
    ip = A if drained[0].endswith("-a") else B
    assert ("DELETE", f"{ip}/drain") in world.net.calls
    assert world.net.workers[ip]["draining"] is False


def test_a_drained_pod_the_replicaset_kept_is_put_back():
    world = two_workers()
    world.net.on_drain = lambda ip: kubelet(world, ip, False)

    async def go() -> None:
        world.body["spec"]["replicas"] = 1
        await world.controller.scale(world.body)
        task = world.drainer._tasks[KEY]
        for _ in range(500):
            if task.done():
                break
            if world.kube.scaled:  # a ReplicaSet that removed the other pod after all
                for pod in world.kube.pods:
                    if not pod["metadata"].get("annotations", {}).get(DRAINING_ANNOTATION) \
                            and pod["metadata"]["name"].startswith("smol-worker"):
                        pod["metadata"]["deletionTimestamp"] = "2026-11-29T10:00:01Z"
            await asyncio.sleep(0)
        assert task.done()

    asyncio.run(go())
    kept = [p for p in world.kube.pods if not p["metadata"].get("deletionTimestamp")
            and p["metadata"]["name"].startswith("smol-worker")]
    assert len(kept) == 1
    assert DRAINING_ANNOTATION not in (kept[0]["metadata"].get("annotations") or {})


def test_reconcile_keeps_the_replicas_while_draining():
    world = two_workers(in_flight={A: 1, B: 1})
    world.kube.deployments[("team-a", "smol-worker")]["spec"]["replicas"] = 2

    async def go() -> None:
        world.body["spec"]["replicas"] = 1
        await world.controller.reconcile(world.body)
        assert world.drainer.draining(*KEY)
        await world.drainer.close()

    asyncio.run(go())
    deployment = [o for o in world.kube.applied if o["kind"] == "Deployment"][-1]
    assert deployment["spec"]["replicas"] == 2  # the drainer lowers it, not the apply


def test_a_restarted_operator_puts_back_a_drain_nothing_needs():
    world = two_workers()
    pod_of(world, "smol-worker-a")["metadata"]["annotations"] = {
        DRAINING_ANNOTATION: "2026-11-29T09:59:00Z", DELETION_COST_ANNOTATION: "-1000"}
    asyncio.run(world.controller.reconcile(world.body))  # resume: 2 wanted, 2 exist
    assert pod_of(world, "smol-worker-a")["metadata"]["annotations"] == {}
    assert ("DELETE", f"{A}/drain") in world.net.calls


# ------------------------------------------------------------------ the worker's /drain

@dataclass
class _Stats:
    num_running: int = 0
    num_waiting: int = 0


class _Engine:
    def __init__(self):
        self.load = _Stats()

    def stats(self) -> _Stats:
        return self.load


def _worker() -> tuple[Worker, httpx.AsyncClient]:
    worker = Worker(lambda: None, "m")
    worker.engine = _Engine()  # loaded (the lifespan's loader does not run here)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(worker)),
                               base_url="http://worker")
    return worker, client


def test_worker_drain_leaves_readiness_and_can_be_undone():
    async def go() -> None:
        worker, client = _worker()
        assert (await client.get("/health")).status_code == 200
        worker.engine.load = _Stats(num_running=2, num_waiting=1)
        answer = await client.post("/drain")
        assert answer.json() == {"status": "draining", "running": 2, "waiting": 1}
        assert (await client.get("/health")).json() == {"status": "draining"}
        assert (await client.get("/health")).status_code == 503
        assert (await client.delete("/drain")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        worker.terminating = worker.draining = True  # SIGTERM came: no way back
        assert (await client.delete("/drain")).status_code == 409
        assert (await client.get("/health")).status_code == 503

    asyncio.run(go())


def test_worker_prestop_drain_waits_until_idle_within_its_bounds(monkeypatch):
    import sluice.worker.server as server

    monkeypatch.setattr(server, "DRAIN_POLL_S", 0.01)

    async def go() -> None:
        worker, client = _worker()
        worker.engine.load = _Stats(num_running=1)

        async def finish() -> None:
            await asyncio.sleep(0.2)
            worker.engine.load = _Stats()

        loop = asyncio.get_running_loop()
        started = loop.time()
        done, answer = await asyncio.gather(finish(), client.get("/drain?wait=5&min=0"))
        assert 0.2 <= loop.time() - started < 2
        assert answer.json()["running"] == 0
        started = loop.time()
        await client.get("/drain?wait=5&min=0.3")  # idle, but serves at least `min`
        assert 0.3 <= loop.time() - started < 2
        worker.engine.load = _Stats(num_running=1)
        started = loop.time()
        answer = await client.get("/drain?wait=0.2")  # never idle: gives up at `wait`
        assert 0.2 <= loop.time() - started < 2 and answer.json()["running"] == 1

    asyncio.run(go())


def test_a_restarted_operator_resumes_the_drain_it_finds():
    world = two_workers(in_flight={A: 0, B: 0})
    pod_of(world, "smol-worker-a")["metadata"]["annotations"] = {
        DRAINING_ANNOTATION: "2026-11-29T09:59:00Z", DELETION_COST_ANNOTATION: "-1000"}
    kubelet(world, A, False)  # it was drained before the restart
    world.body["spec"]["replicas"] = 1  # the scale-down the old operator was doing

    async def go() -> None:
        await world.controller.reconcile(world.body)  # resume
        task = world.drainer._tasks[KEY]
        for _ in range(500):
            if task.done():
                break
            replicaset(world)
            await asyncio.sleep(0)
        assert task.done()

    asyncio.run(go())
    assert world.kube.scaled == [("smol-worker", 1)]
    assert not any(a.get(DRAINING_ANNOTATION) for _, a in world.kube.pod_patches)  # no other
    assert pod_of(world, "smol-worker-a")["metadata"].get("deletionTimestamp")
    assert not pod_of(world, "smol-worker-b")["metadata"].get("deletionTimestamp")
