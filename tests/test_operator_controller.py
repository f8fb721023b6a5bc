"""The operator's controller against a fake API, its kopf settings, and its flags.

The real-apiserver proof is the e2e suite; these pin the decisions: what is applied, when
status is written, what an invalid spec leaves behind, and which kopf settings are set.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging

import kopf
import pytest

from sluice.operator import main as operator_main
from sluice.operator.controller import Controller
from sluice.operator.kube import ApiError
from sluice.operator.resources import InvalidSpec, ModelCache, OperatorConfig
from sluice.operator.settings import OperatorOptions, configure
from sluice.operator.status import tiers_not_ready
from test_operator_resources import ENDPOINTS, MODEL, deployment_status, isvc

NOW = "2026-11-29T10:00:00Z"


class FakeKube:
    """An in-memory API: InferenceServices, Deployments, Endpoints, Pods; records calls.

    Pods without a namespace in their metadata are the worker pods of team-a/smol (the
    label selector still applies to those that carry labels)."""

    def __init__(self, *bodies: dict):
        self.isvcs = {(b["metadata"]["namespace"], b["metadata"]["name"]): copy.deepcopy(b)
                      for b in bodies}
        self.deployments: dict[tuple[str, str], dict] = {}
        self.endpoints: dict[tuple[str, str], dict] = {}
        self.pods: list[dict] = []
        self.applied: list[dict] = []
        self.children: set[tuple[str, str, str]] = set()  # (namespace, kind, name) applied
        self.deleted: list[tuple[str, str, str, str]] = []  # (namespace, apiVersion, kind, name)
        self.status_writes = 0
        self.scaled: list[tuple[str, int]] = []
        self.isvc_scaled: list[tuple[str, int]] = []
        self.events: list[dict] = []
        self.pod_patches: list[tuple[str, dict]] = []
        self.refuse: ApiError | None = None

    async def apply(self, obj):
        if self.refuse is not None:
            raise self.refuse
        self.applied.append(obj)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.children.add((key[0], obj["kind"], key[1]))
        if obj["kind"] == "Deployment":
            stored, status = copy.deepcopy(obj), deployment_status(
                replicas=obj["spec"]["replicas"], ready=0)
            stored["metadata"].update(status["metadata"])  # the owner reference stays
            self.deployments[key] = {**stored, "status": status["status"]}

    async def delete_child(self, namespace, api_version, kind, name):
        self.deleted.append((namespace, api_version, kind, name))
        self.children.discard((namespace, kind, name))
        if kind == "Deployment":
            self.deployments.pop((namespace, name), None)

    async def scale_isvc(self, namespace, name, replicas):
        body = self.isvcs.get((namespace, name))
        if body is None:
            return False
        self.isvc_scaled.append((name, replicas))
        body["spec"]["replicas"] = replicas
        return True

    async def patch_pod_annotations(self, namespace, name, annotations):
        self.pod_patches.append((name, dict(annotations)))
        for pod in self.pods:
            if pod["metadata"]["name"] == name:
                kept = pod["metadata"].setdefault("annotations", {})
                for key, value in annotations.items():
                    if value is None:
                        kept.pop(key, None)
                    else:
                        kept[key] = value

    async def create_event(self, namespace, event):
        self.events.append(copy.deepcopy(event))

    async def scale_deployment(self, namespace, name, replicas):
        if (namespace, name) not in self.deployments:
            return False
        self.scaled.append((name, replicas))
        self.deployments[(namespace, name)]["spec"]["replicas"] = replicas
        return True

    async def get_isvc(self, namespace, name):
        return copy.deepcopy(self.isvcs.get((namespace, name)))

    async def list_isvcs(self, namespace):
        return [copy.deepcopy(b) for (ns, _), b in self.isvcs.items()
                if namespace in (None, ns)]

    async def get_deployment(self, namespace, name):
        return copy.deepcopy(self.deployments.get((namespace, name)))

    async def list_pods(self, namespace, selector):
        wanted = dict(part.split("=", 1) for part in selector.split(","))
        if any(len(value) > 63 for value in wanted.values()):  # as the API server answers
            raise ApiError(400, "unable to parse requirement: invalid label value: must be "
                           "no more than 63 characters")
        if wanted.get("app.kubernetes.io/name") == "sluice-worker":
            assert wanted.get("app.kubernetes.io/instance") == "smol", selector
        return [copy.deepcopy(p) for p in self.pods
                if p["metadata"].get("namespace", namespace) == namespace
                and all(p["metadata"].get("labels", wanted).get(k) == v
                        for k, v in wanted.items())]

    async def get_endpoints(self, namespace, name):
        return copy.deepcopy(self.endpoints.get((namespace, name)))

    async def patch_isvc_status(self, namespace, name, status):
        """A JSON merge patch of the status (None removes a field)."""
        self.status_writes += 1
        merged = self.isvcs[(namespace, name)].setdefault("status", {})
        for key, value in copy.deepcopy(status).items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value

    def status(self, name="smol", namespace="team-a") -> dict:
        return self.isvcs[(namespace, name)].get("status") or {}

    def condition(self, type_: str, name="smol") -> tuple[str, str]:
        found = [c for c in self.status(name).get("conditions", []) if c["type"] == type_]
        return (found[0]["status"], found[0]["reason"]) if found else ("", "")


def controller(kube: FakeKube, **kwargs) -> Controller:
    return Controller(kube, OperatorConfig(), probe=False, clock=lambda: NOW, **kwargs)


def run(coro):
    return asyncio.run(coro)


def test_reconcile_applies_service_then_deployment_and_writes_status():
    body = isvc(replicas=2)
    kube = FakeKube(body)
    run(controller(kube).reconcile(body))
    assert [(o["kind"], o["metadata"]["name"]) for o in kube.applied] == \
        [("Service", "smol-worker"), ("PodDisruptionBudget", "smol-worker"),
         ("Deployment", "smol-worker")]
    status = kube.status()
    assert status["replicas"] == 2 and status["readyReplicas"] == 0
    assert status["observedGeneration"] == 3
    assert status["endpoint"] == "http://smol-worker.team-a.svc:8000"
    assert kube.condition("Ready") == ("False", "NoReplicasReady")


def test_reconcile_twice_is_idempotent_and_status_is_written_once():
    body = isvc()
    kube = FakeKube(body)
    ctl = controller(kube)
    run(ctl.reconcile(body))
    run(ctl.reconcile(body))
    assert kube.applied[:3] == kube.applied[3:]  # the same objects, applied again (SSA no-op)
    assert kube.status_writes == 1  # nothing changed the second time


def test_status_follows_the_deployment_and_endpoints():
    body = isvc()
    kube = FakeKube(body)
    ctl = controller(kube)
    run(ctl.reconcile(body))
    kube.deployments[("team-a", "smol-worker")].update(deployment_status(replicas=1, ready=1))
    kube.endpoints[("team-a", "smol-worker")] = ENDPOINTS
    run(ctl.refresh("team-a", "smol"))
    assert kube.condition("Ready") == ("True", "Serving")
    assert kube.condition("Progressing") == ("False", "Complete")


def test_probe_result_decides_ready(monkeypatch):
    body = isvc()
    kube = FakeKube(body)
    ctl = Controller(kube, OperatorConfig(), probe=True, probe_timeout=0.5, clock=lambda: NOW)
    kube.deployments[("team-a", "smol-worker")] = deployment_status(replicas=1, ready=1)
    kube.endpoints[("team-a", "smol-worker")] = {"subsets": [{
        "addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "http", "port": 9}]}]}
    status = run(ctl.refresh("team-a", "smol"))  # nothing listens on port 9
    ready = status.condition("Ready")
    assert (ready.status, ready.reason) == ("False", "EndpointNotAnswering")
    assert "GET http://127.0.0.1:9/health" in ready.message
    run(ctl.close())


def test_invalid_spec_writes_the_condition_applies_nothing_and_raises():
    body = isvc(minReplicas=3, maxReplicas=2)
    kube = FakeKube(body)
    with pytest.raises(InvalidSpec, match=r"minReplicas \(3\) must be <= maxReplicas \(2\)"):
        run(controller(kube).reconcile(body))
    assert kube.applied == []
    assert kube.condition("Ready") == ("False", "InvalidSpec")
    assert kube.condition("Degraded") == ("True", "InvalidSpec")


@pytest.mark.parametrize("length", [57, 63, 70])
def test_a_name_too_long_for_its_children_is_invalid_spec_and_lists_nothing(length):
    """A name whose ``NAME-worker`` is past 63 characters (past 63 itself, it is not even a
    label value, so listing its pods by label is a 400 from the API server): InvalidSpec
    naming metadata.name, written once; nothing is applied, nothing listed by label."""
    body = isvc(name="c" * length)
    kube = FakeKube(body)
    ctl = controller(kube)
    with pytest.raises(InvalidSpec, match="metadata.name"):
        run(ctl.reconcile(body))
    assert kube.applied == []
    assert kube.condition("Ready", name="c" * length) == ("False", "InvalidSpec")
    assert "metadata.name" in message(kube, "Degraded", "c" * length)
    writes = kube.status_writes
    run(ctl.resync(["team-a"]))
    assert kube.status_writes == writes


def test_a_spec_the_api_server_refuses_stays_invalid_until_the_spec_changes():
    body = isvc()
    kube = FakeKube(body)
    kube.refuse = ApiError(422, 'Deployment.apps "smol-worker" is invalid: spec.template...')
    ctl = controller(kube)
    with pytest.raises(InvalidSpec, match="Service smol-worker was refused: Deployment.apps"):
        run(ctl.reconcile(body))
    run(ctl.refresh("team-a", "smol"))  # e.g. from the resync loop: still InvalidSpec
    assert kube.condition("Ready") == ("False", "InvalidSpec")
    kube.isvcs[("team-a", "smol")]["metadata"]["generation"] = 4  # the user edits the spec
    run(ctl.refresh("team-a", "smol"))
    assert kube.condition("Ready") == ("False", "Creating")


def test_other_api_errors_propagate_for_a_retry():
    body = isvc()
    kube = FakeKube(body)
    kube.refuse = ApiError(503, "etcdserver: leader changed")
    with pytest.raises(ApiError):
        run(controller(kube).reconcile(body))


def test_observed_generation_follows_reconciles_not_reads():
    body = isvc()
    kube = FakeKube(body)
    ctl = controller(kube)
    run(ctl.reconcile(body))
    assert kube.status()["observedGeneration"] == 3
    kube.isvcs[("team-a", "smol")]["metadata"]["generation"] = 4  # edited, not reconciled yet
    run(ctl.refresh("team-a", "smol"))
    assert kube.status()["observedGeneration"] == 3
    run(ctl.reconcile(kube.isvcs[("team-a", "smol")]))
    assert kube.status()["observedGeneration"] == 4


def test_scale_patches_only_replicas():
    body = isvc(replicas=1)
    kube = FakeKube(body)
    ctl = controller(kube)
    assert run(ctl.scale(body)) is False  # no Deployment yet: the caller reconciles
    run(ctl.reconcile(body))
    applied = len(kube.applied)
    scaled = isvc(replicas=4)
    kube.isvcs[("team-a", "smol")]["spec"]["replicas"] = 4
    assert run(ctl.scale(scaled)) is True
    assert kube.scaled == [("smol-worker", 4)] and len(kube.applied) == applied


def test_a_deleted_child_is_recreated_unless_the_owner_is_going():
    body = isvc()
    kube = FakeKube(body)
    ctl = controller(kube)
    run(ctl.child_deleted("team-a", "smol"))
    assert [o["kind"] for o in kube.applied] == ["Service", "PodDisruptionBudget", "Deployment"]
    kube.isvcs[("team-a", "smol")]["metadata"]["deletionTimestamp"] = NOW
    run(ctl.child_deleted("team-a", "smol"))
    assert len(kube.applied) == 3
    run(ctl.child_deleted("team-a", "gone"))  # owner already deleted: nothing to do


def test_resync_reconciles_a_failed_recreate_and_an_edited_deployment():
    """The periodic reconcile converges to the spec: a re-create that failed once is
    retried, and a hand-edited worker Deployment is applied over (the real apiserver's
    server-side apply proof is e2e's test_an_edited_worker_deployment_is_put_back)."""
    kube = FakeKube(isvc())
    ctl = controller(kube)
    kube.refuse = ApiError(500, "etcd timeout")
    with pytest.raises(ApiError):
        run(ctl.child_deleted("team-a", "smol"))
    assert kube.deployments == {}
    kube.refuse = None
    run(ctl.resync(["team-a"]))
    deployment = kube.deployments[("team-a", "smol-worker")]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    deployment["spec"]["template"]["spec"]["containers"][0]["image"] = "edited:latest"
    run(ctl.resync(["team-a"]))
    edited = kube.deployments[("team-a", "smol-worker")]
    assert edited["spec"]["template"]["spec"]["containers"][0]["image"] == image
    kube.isvcs[("team-a", "smol")]["metadata"]["deletionTimestamp"] = NOW
    applied = len(kube.applied)
    run(ctl.resync(["team-a"]))  # an object being deleted is left to the garbage collector
    assert len(kube.applied) == applied


def test_a_second_service_of_one_served_name_gets_the_conflict_condition():
    """Two InferenceServices declare one spec.model.name: the later one is Ready=False
    with Conflict=True naming the older (the router sends it no traffic); deleting the
    older clears it at the next refresh."""
    elder = isvc(name="elder")
    elder["metadata"]["creationTimestamp"] = "2026-11-30T10:00:00Z"
    smol = isvc()
    smol["metadata"]["creationTimestamp"] = "2026-12-01T09:00:00Z"
    other = isvc(name="other", model={"name": "another-model", "source": "sluice://x"})
    kube = FakeKube(elder, smol, other)
    kube.list_pods = _any_pods
    ctl = controller(kube)
    run(ctl.resync(["team-a"]))
    assert kube.condition("Conflict") == ("True", "ServedNameInUse")
    assert kube.condition("Ready") == ("False", "ServedNameConflict")
    message = [c for c in kube.status()["conditions"] if c["type"] == "Conflict"][0]["message"]
    assert "already served by InferenceService 'elder'" in message
    assert kube.condition("Conflict", name="elder") == ("", "")
    assert kube.condition("Conflict", name="other") == ("", "")
    del kube.isvcs[("team-a", "elder")]
    run(ctl.refresh("team-a", "smol"))
    assert kube.condition("Conflict") == ("", "")
    assert kube.condition("Ready") == ("False", "NoReplicasReady")


def test_the_next_service_of_a_served_name_loses_conflict_when_the_older_is_deleted():
    """The older of two services declaring one served name is deleted: the other is
    refreshed at once (its Conflict condition goes), not at the next resync."""
    elder, smol = isvc(name="elder"), isvc()
    elder["metadata"]["creationTimestamp"] = "2026-11-30T10:00:00Z"
    smol["metadata"]["creationTimestamp"] = "2026-12-01T09:00:00Z"
    kube = FakeKube(elder, smol, isvc(name="other", model={"name": "m2", "source": "sluice://x"}))
    kube.list_pods = _any_pods
    ctl = controller(kube)
    run(ctl.resync(["team-a"]))
    assert kube.condition("Conflict") == ("True", "ServedNameInUse")
    other_status = kube.status("other")
    run(ctl.deleted(kube.isvcs.pop(("team-a", "elder"))))
    assert kube.condition("Conflict") == ("", "")
    assert kube.condition("Ready") == ("False", "NoReplicasReady")
    assert kube.status("other") == other_status


def test_status_fields_left_unset_are_removed_and_then_nothing_is_written():
    """Autoscaling turned off: ``sloAttainment`` (the autoscaler's) is removed from the
    status (a JSON merge patch with null), and the next refresh writes nothing."""
    body = isvc(autoscaling={"enabled": True}, minReplicas=1, maxReplicas=3)
    kube = FakeKube(body)
    kube.list_pods = _any_pods
    ctl = controller(kube)
    run(ctl.reconcile(body))
    run(ctl.record("team-a", "smol", {"sloAttainment": 0.97, "desiredReplicas": 1}))
    assert kube.status()["sloAttainment"] == 0.97
    kube.isvcs[("team-a", "smol")]["spec"]["autoscaling"] = {"enabled": False}
    run(ctl.refresh("team-a", "smol"))
    assert "sloAttainment" not in kube.status()
    writes = kube.status_writes
    run(ctl.refresh("team-a", "smol"))
    assert kube.status_writes == writes


def test_a_worker_service_turned_cascade_has_its_workers_deleted():
    """``smol`` served a model with workers, then becomes a cascade over two others: its
    Service, PodDisruptionBudget and Deployment are deleted (the Deployment last), its
    status loses ``endpoint`` and ``selector``; later reconciles delete nothing more."""
    body = isvc()
    kube = FakeKube(body, isvc(name="a", model={"name": "ma", "source": f"sluice://{MODEL}"}),
                    isvc(name="b", model={"name": "mb", "source": f"sluice://{MODEL}"}))
    kube.list_pods = _any_pods
    ctl = controller(kube)
    run(ctl.resync(["team-a"]))
    assert {c for c in kube.children if c[2] == "smol-worker"} == {
        ("team-a", kind, "smol-worker") for kind in ("Service", "PodDisruptionBudget",
                                                      "Deployment")}
    assert kube.status()["endpoint"] == "http://smol-worker.team-a.svc:8000"
    turned = cascade(name="smol", tiers=("a", "b"))
    kube.isvcs[("team-a", "smol")]["spec"] = turned["spec"]
    run(ctl.reconcile(kube.isvcs[("team-a", "smol")]))
    assert kube.deleted == [("team-a", "v1", "Service", "smol-worker"),
                            ("team-a", "policy/v1", "PodDisruptionBudget", "smol-worker"),
                            ("team-a", "apps/v1", "Deployment", "smol-worker")]
    assert not {c for c in kube.children if c[2] == "smol-worker"}
    assert "endpoint" not in kube.status() and "selector" not in kube.status()
    run(ctl.resync(["team-a"]))
    assert len(kube.deleted) == 3
    foreign = cascade(name="coder", tiers=("a", "b"))  # someone else's coder-worker
    kube.isvcs[("team-a", "coder")] = foreign
    kube.deployments[("team-a", "coder-worker")] = {"metadata": {"name": "coder-worker"}}
    run(ctl.reconcile(foreign))
    assert len(kube.deleted) == 3 and ("team-a", "coder-worker") in kube.deployments


def test_a_connection_the_api_server_cut_is_an_api_error():
    """aiohttp's ServerDisconnectedError and ClientPayloadError are not OSErrors: the
    client turns them into ApiError(0), which every caller handles (the resync went on)."""
    import aiohttp

    from sluice.operator.kube import Kube

    kube = Kube(api_client=object())
    for exc in (aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError("cut")):
        async def method(*_, exc=exc, **__):
            raise exc
        with pytest.raises(ApiError) as caught:
            run(kube._call(method))
        assert caught.value.status == 0 and type(exc).__name__ in caught.value.message


def test_the_resync_loop_outlives_a_round_that_raises(caplog):
    """A round failing with anything, not only ApiError, is logged and the next runs."""
    from sluice.operator import handlers

    rounds = []

    class Failing:
        async def resync(self, namespaces):
            rounds.append(namespaces)
            if len(rounds) == 1:
                raise RuntimeError("boom")
            if len(rounds) == 3:
                raise asyncio.CancelledError

    options = OperatorOptions(resync_seconds=0.0)
    with pytest.raises(asyncio.CancelledError):
        run(handlers._resync_forever(Failing(), options))
    assert len(rounds) == 3
    assert "resync failed" in caplog.text and "boom" in caplog.text


def test_resync_reconciles_every_service_and_deleted_drops_state():
    kube = FakeKube(isvc(), isvc(name="other", namespace="team-b"))
    kube.list_pods = _any_pods
    ctl = controller(kube)
    run(ctl.resync([None]))
    assert sorted(kube.deployments) == [("team-a", "smol-worker"), ("team-b", "other-worker")]
    assert kube.condition("Ready") == ("False", "NoReplicasReady")
    assert kube.isvcs[("team-b", "other")]["status"]["endpoint"] == \
        "http://other-worker.team-b.svc:8000"
    run(ctl.deleted(kube.isvcs.pop(("team-a", "smol"))))
    assert ("team-a", "smol") not in ctl._locks


async def _any_pods(namespace, selector):
    return []


# ------------------------------------------------------------------ cascades

BIG = {"name": "big-model", "source": "sluice://Qwen2.5-Coder-0.5B-Instruct"}

def cascade(name: str = "coder", tiers: tuple[str, ...] = ("smol", "big")) -> dict:
    """A cascade InferenceService: a served name, no source, tiers."""
    body = isvc(name=name, cascade={"tiers": list(tiers), "escalation": {"threshold": -1.0}})
    body["spec"]["model"] = {"name": name}
    return body


def make_ready(kube: FakeKube, name: str) -> None:
    """The worker Deployment of ``name`` has its replica ready and listed."""
    kube.deployments[("team-a", f"{name}-worker")].update(deployment_status(replicas=1, ready=1))
    kube.endpoints[("team-a", f"{name}-worker")] = ENDPOINTS


def message(kube: FakeKube, type_: str, name: str) -> str:
    return [c for c in kube.status(name)["conditions"] if c["type"] == type_][0]["message"]


def test_a_cascade_gets_no_children_and_is_ready_when_every_tier_is():
    """The cascade applies nothing; its Ready follows the tiers' Ready, refreshed as soon
    as a tier's Ready changes (not only at the next resync)."""
    kube = FakeKube(isvc(), isvc(name="big", model=BIG),
                    cascade())
    kube.list_pods = _any_pods
    ctl = controller(kube)
    run(ctl.resync(["team-a"]))
    assert sorted((o["kind"], o["metadata"]["name"]) for o in kube.applied) == [
        ("Deployment", "big-worker"), ("Deployment", "smol-worker"),
        ("PodDisruptionBudget", "big-worker"), ("PodDisruptionBudget", "smol-worker"),
        ("Service", "big-worker"), ("Service", "smol-worker")]
    assert kube.condition("Ready", name="coder") == ("False", "TiersNotReady")
    assert message(kube, "Ready", "coder") == \
        "tiers not ready: smol (NoReplicasReady); big (NoReplicasReady)"
    assert kube.condition("Progressing", name="coder") == ("False", "NoWorkers")
    assert kube.condition("Degraded", name="coder") == ("False", "AsExpected")
    status = kube.status("coder")
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (0, 0, 0)
    assert "endpoint" not in status and "selector" not in status
    assert status["observedGeneration"] == 3
    make_ready(kube, "smol")
    run(ctl.refresh("team-a", "smol"))
    assert message(kube, "Ready", "coder") == "tiers not ready: big (NoReplicasReady)"
    make_ready(kube, "big")
    run(ctl.refresh("team-a", "big"))
    assert kube.condition("Ready", name="coder") == ("True", "CascadeServing")
    assert message(kube, "Ready", "coder") == "every tier is ready: smol, big"
    writes = kube.status_writes
    run(ctl.reconcile(kube.isvcs[("team-a", "coder")]))
    assert kube.status_writes == writes and len(kube.applied) == 6  # nothing new to write


@pytest.mark.parametrize("tiers, others, problem", [
    (("smol", "x"), [], "spec.cascade.tiers[1]: no InferenceService 'x' in this namespace"),
    (("inner", "smol"), [cascade("inner", ("smol", "big"))],
     "spec.cascade.tiers[0]: 'inner' is a cascade itself; tiers must serve a model"),
    (("smol", "same"), [isvc(name="same", model={**BIG, "name": "coder"})],
     "spec.cascade.tiers[1]: 'same' serves the model name 'coder', the cascade's own"),
], ids=["unknown-tier", "nested-cascade", "tier-serves-the-cascades-name"])
def test_a_cascade_whose_tiers_cannot_serve_is_invalid_spec(tiers, others, problem):
    kube = FakeKube(isvc(), cascade(tiers=tiers), *others)
    kube.list_pods = _any_pods
    ctl = controller(kube)
    run(ctl.reconcile(kube.isvcs[("team-a", "coder")]))  # no error: a tier may come later
    assert kube.applied == []
    assert kube.condition("Ready", name="coder") == ("False", "InvalidSpec")
    assert kube.condition("Degraded", name="coder") == ("True", "InvalidSpec")
    assert kube.condition("Progressing", name="coder") == ("False", "InvalidSpec")
    assert message(kube, "Ready", "coder") == problem


def test_a_cascade_becomes_valid_when_its_missing_tier_is_created():
    kube = FakeKube(isvc(), cascade())
    kube.list_pods = _any_pods
    ctl = controller(kube)
    run(ctl.resync(["team-a"]))
    assert message(kube, "Ready", "coder") == \
        "spec.cascade.tiers[1]: no InferenceService 'big' in this namespace"
    big = isvc(name="big", model=BIG)
    kube.isvcs[("team-a", "big")] = big
    assert tiers_not_ready(["smol", "big"], list(kube.isvcs.values())) == \
        ["smol (NoReplicasReady)", "big (no status yet)"]
    run(ctl.resync(["team-a"]))  # the periodic reconcile
    assert kube.condition("Ready", name="coder") == ("False", "TiersNotReady")
    assert kube.condition("Degraded", name="coder") == ("False", "AsExpected")
    # coder was refreshed before big had a status; big's first Ready refreshed it again
    assert message(kube, "Ready", "coder") == \
        "tiers not ready: smol (NoReplicasReady); big (NoReplicasReady)"


# ------------------------------------------------------------------ kopf settings, flags

def test_kopf_settings_are_explicit():
    settings = kopf.OperatorSettings()
    configure(settings, OperatorOptions(watch_timeout=120))
    assert settings.peering.standalone is True and settings.peering.mandatory is False
    assert settings.scanning.disabled is True
    assert settings.watching.server_timeout == 120 and settings.watching.client_timeout == 150
    assert settings.watching.connect_timeout == 10
    assert settings.networking.request_timeout == 60
    assert settings.posting.level == logging.WARNING
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    selectors = dict(settings.watching.label_selectors.items())
    assert sorted(s.any_name for s in selectors) == ["deployments", "endpoints", "pods"]
    assert set(selectors.values()) == {
        "app.kubernetes.io/managed-by=sluice-operator,app.kubernetes.io/name=sluice-worker"}


def test_no_handler_needs_a_finalizer():
    import sluice.operator.handlers  # noqa: F401  (registers into kopf's default registry)

    registry = kopf.get_default_registry()
    assert registry._spawning.get_all_handlers() == []  # no daemons or timers
    for handler in registry._changing.get_all_handlers():
        assert not handler.requires_finalizer, handler.id
        assert handler.reason != "delete", handler.id


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="INFO")
    operator_main.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_operator_flags(monkeypatch):
    monkeypatch.delenv("SLUICE_NAMESPACES", raising=False)
    options = operator_main.options_from(parse(
        "-n", "team-a", "--namespace", "team-b", "--worker-image", "reg/sluice:2",
        "--model-cache", "hostPath:/var/cache/sluice", "--worker-command", "python -m sluice.cli",
        "--no-endpoint-probe", "--resync-seconds", "5"))
    assert options.namespaces == ("team-a", "team-b")
    assert options.config.worker_image == "reg/sluice:2"
    assert options.config.model_cache == ModelCache("hostPath", "/var/cache/sluice")
    assert options.config.worker_command == ("python", "-m", "sluice.cli")
    assert options.config.worker_log_level == "INFO"
    assert options.probe is False and options.resync_seconds == 5
    assert operator_main.options_from(parse("-A")).namespaces == ()
    with pytest.raises(SystemExit):
        parse("-A", "-n", "x")
    with pytest.raises(SystemExit):
        parse("--model-cache", "nfs:/x")


def test_options_from_env():
    options = OperatorOptions.from_env({"SLUICE_WORKER_IMAGE": "w:1", "SLUICE_MODEL_CACHE": "image",
                                        "SLUICE_NAMESPACES": "a, b", "SLUICE_ENDPOINT_PROBE": "0"})
    assert options.config.worker_image == "w:1"
    assert options.config.model_cache == ModelCache("image")
    assert options.namespaces == ("a", "b") and options.probe is False


def test_autoscaler_flags(monkeypatch):
    monkeypatch.delenv("SLUICE_NAMESPACES", raising=False)
    options = operator_main.options_from(parse("-n", "a"))
    assert options.autoscale_interval == 5.0 and options.metrics_port == 0
    assert options.router_selector == \
        "app.kubernetes.io/name=sluice,app.kubernetes.io/component=router"
    assert options.router_namespace is None
    options = operator_main.options_from(parse(
        "-n", "a", "--autoscale-interval", "2", "--metrics-port", "9090", "--metrics-host",
        "10.0.0.1", "--router-selector", "app=r", "--router-namespace", "routers",
        "--router", "http://127.0.0.1:8000/", "--router", "http://10.0.0.2:8000"))
    assert (options.autoscale_interval, options.metrics_port, options.metrics_host,
            options.router_selector, options.router_namespace, options.router_urls) == \
        (2.0, 9090, "10.0.0.1", "app=r", "routers",
         ("http://127.0.0.1:8000", "http://10.0.0.2:8000"))
    for bad in (("--autoscale-interval", "0"), ("--metrics-port", "70000"),
                ("--router", "127.0.0.1:8000")):
        with pytest.raises(SystemExit):
            parse(*bad)
    env = OperatorOptions.from_env({"SLUICE_AUTOSCALE_INTERVAL": "3", "SLUICE_METRICS_PORT": "9"})
    assert env.autoscale_interval == 3.0 and env.metrics_port == 9
