"""The InferenceService on a real cluster, end to end (fixtures and environment: conftest.py).

    chart → every example passes server-side validation → invalid specs are refused by the
    schema or explained by a condition → a GPU request is Degraded with the scheduler's
    message → examples/smollm2.yaml (1 replica) becomes Ready → a chat answer through the
    router → an operator restart changes nothing → kubectl scale → a spec change rolls out
    while requests keep succeeding → delete garbage-collects everything

The quick checks come first, so an operator that does not work at all fails in seconds. The
lifecycle steps share one InferenceService and run in order (TestLifecycle is incremental).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from conftest import CRD, READY_TIMEOUT_S, SHORT_TIMEOUT_S, Sluice, condition, wait_for

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SMOLLM2 = REPO / "examples" / "smollm2.yaml"
SPEC_HASH = "serving.sluice.dev/spec-hash"
PROMPT = "What is the capital of France?"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def manifest(name: str, model: str, **spec: object) -> dict:
    """A small InferenceService of the store's SmolLM2 (no resources unless given)."""
    body = {"model": {"name": model, "source": "sluice://SmolLM2-135M-Instruct"},
            "engine": {"name": "native", "native": {"kvCacheGiB": 0.25}}, "replicas": 1}
    body.update(spec)
    return {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": body}


def client(sluice: Sluice, timeout_s: float = 120.0) -> openai.OpenAI:
    """An OpenAI client on the router; no retries, so every failure is seen."""
    return openai.OpenAI(base_url=f"{sluice.router_url}/v1", api_key="e2e", max_retries=0,
                         timeout=timeout_s, http_client=httpx.Client(trust_env=False))


def router_ready(sluice: Sluice, model: str) -> set[str]:
    """The worker URLs the router would send `model` to now (its /health body)."""
    resp = httpx.get(f"{sluice.router_url}/health", timeout=10, trust_env=False)
    return {w["url"] for w in resp.json()["workers"] if w["ready"] and model in w["models"]}


def pod_urls(pods: list[dict]) -> set[str]:
    return {f"http://{p['status']['podIP']}:8000" for p in pods}


def ready_pods(sluice: Sluice, selector: str) -> list[dict]:
    """Pods of the selector that are Ready and not terminating."""
    return [p for p in sluice.pods(selector) if not p["metadata"].get("deletionTimestamp")
            and condition(p, "Ready").get("status") == "True"]


def delete_isvc(sluice: Sluice, name: str) -> None:
    sluice.kubectl.run("delete", CRD, name, "--ignore-not-found", "--wait=true",
                       "--timeout=60s", timeout=90)


def local_pids(pods: list[dict]) -> list[int]:
    """The process ids of containers run by e2e/local's node agent (containerID local://PID)."""
    return [int(cs["containerID"].split("://", 1)[1]) for p in pods
            for cs in (p.get("status") or {}).get("containerStatuses") or ()
            if cs.get("containerID", "").startswith("local://")]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


# ------------------------------------------------------------------ the chart and the examples

def test_chart_installed_the_crd(sluice: Sluice):
    crd = sluice.kubectl.get("crd", CRD, namespaced=False)
    spec = crd["spec"]
    assert spec["group"] == "serving.sluice.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceService"
    assert "sisvc" in spec["names"].get("shortNames", [])
    version = next(v for v in spec["versions"] if v["name"] == "v1alpha1")
    assert version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    columns = {c["name"].lower() for c in version.get("additionalPrinterColumns", [])}
    assert {"model", "ready"} <= columns, columns


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_passes_server_side_validation(sluice: Sluice, path: Path):
    """Every example is applied (a server-side dry run: the heavier models do not run here;
    examples/smollm2.yaml also runs for real in TestLifecycle)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(d["kind"] == "InferenceService" for d in docs), path
    out = sluice.kubectl.run("apply", "--dry-run=server", "-f", str(path)).stdout
    assert out.count("(server dry run)") == len(docs), out  # every document (a cascade's too)
    for doc in docs:
        assert sluice.isvc(doc["metadata"]["name"]) is None  # a dry run leaves nothing behind


# ------------------------------------------------------------------ invalid specs

@pytest.mark.parametrize("spec, field", [
    ({"replicas": -1}, "spec.replicas"),
    ({"engine": {"name": "foo"}}, "spec.engine.name"),
    ({"model": {"name": "m", "source": "hf://org/model"}}, "spec.model.source"),
    ({"resources": {"memory": "lots"}}, "spec.resources.memory"),
    ({"slo": {"percentile": 101}}, "spec.slo.percentile"),
], ids=["negative-replicas", "unknown-engine", "source-scheme", "bad-quantity", "percentile"])
def test_schema_rejects_invalid_spec(sluice: Sluice, spec: dict, field: str):
    body = manifest("rejected", "rejected-model")
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body["spec"].get(key), dict):
            body["spec"][key] = {**body["spec"][key], **value}
        else:
            body["spec"][key] = value
    proc = sluice.kubectl.apply(body, check=False)
    assert proc.returncode != 0, f"the API server accepted {spec}: {proc.stdout}"
    assert field in proc.stderr, f"the error does not name {field}: {proc.stderr}"
    assert sluice.isvc("rejected") is None


@pytest.mark.parametrize("name, spec, words, fix", [
    ("unknown-model", {"model": {"name": "nope", "source": "sluice://NoSuchModel"}},
     ["NoSuchModel"], {"model": {"name": "nope", "source": "sluice://SmolLM2-135M-Instruct"}}),
    ("min-over-max", {"minReplicas": 3, "maxReplicas": 2}, ["minReplicas", "maxReplicas"],
     {"maxReplicas": 4}),
    ("autoscaled-zero", {"minReplicas": 0, "maxReplicas": 2, "autoscaling": {"enabled": True}},
     ["spec.minReplicas", "spec.autoscaling.scaleToZero"], {"autoscaling": {"enabled": False}}),
], ids=["unknown-model", "min-over-max", "autoscaled-zero-without-scale-to-zero"])
def test_invalid_spec_the_schema_cannot_catch_is_a_condition(
        sluice: Sluice, name: str, spec: dict, words: list[str], fix: dict):
    """An InvalidSpec condition, nothing created; fixing the spec recovers (with replicas: 0,
    so no model loads)."""
    body = manifest(name, f"{name}-model")
    body["spec"].update(spec)
    sluice.kubectl.apply(body)
    try:
        isvc = wait_for(f"{name}: Ready=False with reason InvalidSpec",
                        lambda: (lambda i: i if condition(i, "Ready").get("reason") ==
                                 "InvalidSpec" else None)(sluice.isvc(name)),
                        SHORT_TIMEOUT_S, lambda: sluice.state((name,)))
        ready, degraded = condition(isvc, "Ready"), condition(isvc, "Degraded")
        assert ready["status"] == "False"
        assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec", degraded
        for word in words:
            assert word in degraded["message"], degraded
        assert isvc["status"].get("observedGeneration") == isvc["metadata"]["generation"]
        # Nothing is created for a spec that cannot be served.
        assert sluice.kubectl.get("deployment", f"{name}-worker") is None
        assert not sluice.pods(f"app.kubernetes.io/instance={name}")

        sluice.kubectl.run("patch", CRD, name, "--type=merge", "-p",
                           json.dumps({"spec": {**fix, "replicas": 0}}))
        # a refresh from a child's event may show the new spec's status before the
        # reconcile of that generation finishes: wait for observedGeneration too
        isvc = wait_for(f"{name}: fixed, Ready=False with reason ScaledToZero",
                        lambda: (lambda i: i if condition(i, "Ready").get("reason") ==
                                 "ScaledToZero" and i["status"].get("observedGeneration") ==
                                 i["metadata"]["generation"] else None)(sluice.isvc(name)),
                        SHORT_TIMEOUT_S, lambda: sluice.state((name,)))
        assert condition(isvc, "Degraded")["status"] == "False", condition(isvc, "Degraded")
        assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
        deployment = sluice.kubectl.get("deployment", f"{name}-worker")
        assert deployment and deployment["spec"]["replicas"] == 0
    finally:
        delete_isvc(sluice, name)


def test_deleted_children_are_put_back(sluice: Sluice):
    """Someone deletes the worker Deployment and Service: the operator recreates them (an
    InferenceService with replicas: 0, so no model loads)."""
    name = "children"
    sluice.kubectl.apply(manifest(name, f"{name}-model", replicas=0))
    try:
        def children() -> dict | None:
            found = {kind: sluice.kubectl.get(kind, f"{name}-worker")
                     for kind in ("deployment", "service")}
            return found if all(found.values()) else None

        before = wait_for(f"{name}: its Deployment and Service", children, SHORT_TIMEOUT_S,
                          lambda: sluice.state((name,)))
        sluice.kubectl.run("delete", "deployment,service", f"{name}-worker", "--wait=true",
                           "--timeout=30s", timeout=60)
        after = wait_for(f"{name}: a new Deployment and Service",
                         lambda: (lambda c: c if c and all(
                             c[k]["metadata"]["uid"] != before[k]["metadata"]["uid"]
                             for k in c) else None)(children()),
                         SHORT_TIMEOUT_S, lambda: sluice.state((name,)))
        uid = sluice.isvc(name)["metadata"]["uid"]
        for child in after.values():
            assert [o["uid"] for o in child["metadata"]["ownerReferences"]] == [uid]
    finally:
        delete_isvc(sluice, name)


def test_a_second_service_of_one_served_name_gets_conflict(sluice: Sluice):
    """Two InferenceServices declare one served model name: the later one gets
    Conflict=True (ServedNameInUse, naming the older) and Ready=False; when the older is
    deleted, the periodic reconcile clears it (issue 10, item 8). Replicas 0: no model loads;
    that the router routes only to the older is test_router_dispatch's serving()."""
    first, second = "served-first", "served-second"
    sluice.kubectl.apply(manifest(first, "shared-name", replicas=0))
    try:
        wait_for(f"{first}: a status", lambda: (sluice.isvc(first) or {}).get("status"),
                 SHORT_TIMEOUT_S, lambda: sluice.state((first,)))
        time.sleep(1.1)  # creationTimestamp has one-second resolution
        sluice.kubectl.apply(manifest(second, "shared-name", replicas=0))
        isvc = wait_for(f"{second}: Conflict=True",
                        lambda: (lambda i: i if condition(i, "Conflict").get("status") == "True"
                                 else None)(sluice.isvc(second)),
                        SHORT_TIMEOUT_S, lambda: sluice.state((first, second)))
        conflict = condition(isvc, "Conflict")
        assert conflict["reason"] == "ServedNameInUse"
        assert f"already served by InferenceService '{first}'" in conflict["message"]
        assert condition(isvc, "Ready")["reason"] == "ServedNameConflict"
        assert not condition(sluice.isvc(first), "Conflict")
        delete_isvc(sluice, first)
        wait_for(f"{second}: Conflict gone", lambda: not condition(
            sluice.isvc(second), "Conflict") or None, 2 * SHORT_TIMEOUT_S,
                 lambda: sluice.state((second,)))
    finally:
        delete_isvc(sluice, first)
        delete_isvc(sluice, second)


def test_an_edited_worker_deployment_is_put_back(sluice: Sluice):
    """Someone edits the worker Deployment's image by hand: the periodic
    reconcile (--resync-seconds, 30 s) applies the spec over it (issue 10, item 9)."""
    name = "drift"
    sluice.kubectl.apply(manifest(name, f"{name}-model", replicas=0))
    try:
        def image() -> str | None:
            found = sluice.kubectl.get("deployment", f"{name}-worker")
            return found["spec"]["template"]["spec"]["containers"][0]["image"] if found else None

        original = wait_for(f"{name}: its Deployment", image, SHORT_TIMEOUT_S,
                            lambda: sluice.state((name,)))
        patch = {"spec": {"template": {"spec": {"containers": [
            {"name": "worker", "image": "edited-by-hand:1"}]}}}}
        sluice.kubectl.run("patch", "deployment", f"{name}-worker", "--type=strategic",
                           "-p", json.dumps(patch))
        assert image() == "edited-by-hand:1"
        wait_for(f"{name}: the image put back to {original}",
                 lambda: image() == original or None, 2 * SHORT_TIMEOUT_S,
                 lambda: sluice.state((name,)))
    finally:
        delete_isvc(sluice, name)


def test_a_two_tier_cascade_is_served_through_the_router(sluice: Sluice):
    """Two tiers (SmolLM2 under two served names, so the e2e stays light: the cascade's
    wiring is under test, not its quality) and a cascade whose threshold 0 always
    escalates: the operator reports it Ready (CascadeServing), the router finds it in the
    namespace, answers from the second tier (x-sluice-tier, x-sluice-escalated), and
    `x-sluice-cascade: off` keeps the first. A cascade naming a missing tier gets
    InvalidSpec naming the field (issue 11); it was a worker InferenceService first, and
    its worker Deployment and Service are deleted when it becomes a cascade."""
    tiers = {"tier-a": "e2e-tier-a", "tier-b": "e2e-tier-b"}
    cascade = {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "e2e-cascade"},
               "spec": {"model": {"name": "e2e-cascade"},
                        "cascade": {"tiers": list(tiers), "escalation": {"threshold": 0}}}}
    broken = copy.deepcopy(cascade)
    broken["metadata"]["name"] = broken["spec"]["model"]["name"] = "e2e-broken-cascade"
    broken["spec"]["cascade"]["tiers"] = ["tier-a", "tier-missing"]
    names = (*tiers, "e2e-cascade", "e2e-broken-cascade")
    for name, model in tiers.items():
        sluice.kubectl.apply(manifest(name, model))
    sluice.kubectl.apply(cascade)
    sluice.kubectl.apply(manifest("e2e-broken-cascade", "e2e-broken-cascade", replicas=0))
    try:
        wait_for("e2e-broken-cascade: its worker Deployment", lambda: sluice.kubectl.get(
            "deployment", "e2e-broken-cascade-worker"), SHORT_TIMEOUT_S,
                 lambda: sluice.state(names))
        sluice.kubectl.apply(broken)
        wait_for("e2e-cascade: Ready=True CascadeServing",
                 lambda: condition(sluice.isvc("e2e-cascade"), "Ready").get("reason")
                 == "CascadeServing" or None, READY_TIMEOUT_S, lambda: sluice.state(names))
        bad = wait_for("e2e-broken-cascade: InvalidSpec",
                       lambda: condition(sluice.isvc("e2e-broken-cascade"), "Ready")
                       if condition(sluice.isvc("e2e-broken-cascade"), "Ready").get("reason")
                       == "InvalidSpec" else None, SHORT_TIMEOUT_S, lambda: sluice.state(names))
        assert "spec.cascade.tiers[1]: no InferenceService 'tier-missing'" in bad["message"]
        wait_for("e2e-broken-cascade: its worker Deployment and Service deleted",
                 lambda: not any(sluice.kubectl.get(kind, "e2e-broken-cascade-worker")
                                 for kind in ("deployment", "service")) or None,
                 SHORT_TIMEOUT_S, lambda: sluice.state(names))
        assert "endpoint" not in sluice.isvc("e2e-broken-cascade")["status"]

        def ask(**headers: str) -> httpx.Response | None:
            r = httpx.post(f"{sluice.router_url}/v1/completions", timeout=120, trust_env=False,
                           headers=headers, json={"model": "e2e-cascade", "prompt": "Hello",
                                                  "max_tokens": 4, "temperature": 0})
            return r if r.status_code == 200 else None

        escalated = wait_for("the router to serve e2e-cascade", ask, SHORT_TIMEOUT_S,
                             lambda: sluice.state(names))
        assert escalated.headers["x-sluice-tier"] == "tier-b"
        assert escalated.headers["x-sluice-escalated"] == "true"
        assert escalated.json()["model"] == "e2e-tier-b"
        first = ask(**{"x-sluice-cascade": "off"})
        assert first is not None and first.headers["x-sluice-tier"] == "tier-a"
        assert first.json()["model"] == "e2e-tier-a"
        models = httpx.get(f"{sluice.router_url}/v1/models", timeout=10, trust_env=False).json()
        assert "e2e-cascade" in {m["id"] for m in models["data"]}
        assert "e2e-broken-cascade" not in {m["id"] for m in models["data"]}
    finally:
        for name in names:
            delete_isvc(sluice, name)


def test_gpu_request_is_degraded_with_the_schedulers_message(sluice: Sluice):
    nodes = sluice.kubectl.get("nodes", namespaced=False)
    if any("nvidia.com/gpu" in (n["status"].get("allocatable") or {}) for n in nodes):
        pytest.skip("a node advertises nvidia.com/gpu: the pod would be scheduled")
    name = "gpu"
    sluice.kubectl.apply(manifest(name, "gpu-model", resources={"nvidia.com/gpu": 1}))
    try:
        isvc = wait_for(f"{name}: Degraded=True with the scheduler's message",
                        lambda: (lambda i: i if condition(i, "Degraded").get("status") == "True"
                                 else None)(sluice.isvc(name)),
                        SHORT_TIMEOUT_S, lambda: sluice.state((name,)))
        degraded, ready = condition(isvc, "Degraded"), condition(isvc, "Ready")
        assert degraded["reason"] == "Unschedulable", degraded
        assert "Insufficient nvidia.com/gpu" in degraded["message"], degraded
        assert ready["status"] == "False" and "Insufficient nvidia.com/gpu" in ready["message"]
        pods = sluice.pods(isvc["status"]["selector"])
        assert pods and all(p["status"]["phase"] == "Pending" for p in pods)
        container = pods[0]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    finally:
        delete_isvc(sluice, name)
    wait_for(f"{name}: its pods to be garbage-collected",
             lambda: not sluice.pods(f"app.kubernetes.io/instance={name}"), SHORT_TIMEOUT_S,
             sluice.state)


# ------------------------------------------------------------------ the lifecycle

@pytest.fixture(scope="class")
def served(sluice: Sluice):
    """What the lifecycle steps share: the name, model and notes of one InferenceService
    (deleted after the last step, whether or not the steps got that far)."""
    doc = load(SMOLLM2)
    state = {"name": doc["metadata"]["name"], "model": doc["spec"]["model"]["name"],
             "doc": doc}
    yield state
    delete_isvc(sluice, state["name"])


def isvc_state(sluice: Sluice, name: str):
    return lambda: sluice.state((name,))


def serving(sluice: Sluice, name: str, replicas: int):
    """check(): the InferenceService once its status says `replicas` serve its generation."""
    def check() -> dict | None:
        isvc = sluice.isvc(name)
        status = (isvc or {}).get("status") or {}
        if (isvc and condition(isvc, "Ready").get("status") == "True"
                and condition(isvc, "Progressing").get("status") == "False"
                and status.get("observedGeneration") == isvc["metadata"]["generation"]
                and status.get("replicas") == replicas
                and status.get("readyReplicas") == replicas):
            return isvc
        return None
    return check


@pytest.mark.incremental
class TestLifecycle:
    def test_apply_example_becomes_ready(self, sluice: Sluice, served: dict):
        """examples/smollm2.yaml with one replica and no resource requests (CI nodes and
        kind nodes may have fewer cores than the example asks for) → Ready, with children
        owned by it."""
        doc = copy.deepcopy(served["doc"])
        doc["spec"]["replicas"] = 1
        doc["spec"].pop("resources", None)
        name = served["name"]
        assert "created" in sluice.kubectl.apply(doc).stdout
        isvc = wait_for(f"{name}: Ready with 1/1 replicas at its generation",
                        serving(sluice, name, 1), READY_TIMEOUT_S, isvc_state(sluice, name))
        status = isvc["status"]
        assert status["endpoint"] == f"http://{name}-worker.{sluice.namespace}.svc:8000"
        assert condition(isvc, "Degraded")["status"] == "False"
        assert "answered" in condition(isvc, "Ready")["message"] or not sluice.local

        uid = isvc["metadata"]["uid"]
        for kind in ("deployment", "service"):
            child = sluice.kubectl.get(kind, f"{name}-worker")
            assert child, f"no {kind} {name}-worker"
            owners = child["metadata"].get("ownerReferences") or []
            assert [(o["uid"], o.get("controller")) for o in owners] == [(uid, True)], owners
        pods = ready_pods(sluice, status["selector"])
        assert len(pods) == 1
        endpoints = sluice.kubectl.get("endpoints", f"{name}-worker")
        ips = [a["ip"] for s in endpoints.get("subsets") or () for a in s.get("addresses") or ()]
        assert ips == [pods[0]["status"]["podIP"]], endpoints
        served["uid"] = uid

    def test_chat_through_the_router(self, sluice: Sluice, served: dict):
        oai = client(sluice)
        pods = ready_pods(sluice, sluice.isvc(served["name"])["status"]["selector"])
        wait_for(f"the router to route {served['model']} to the ready pod",
                 lambda: router_ready(sluice, served["model"]) == pod_urls(pods),
                 SHORT_TIMEOUT_S, isvc_state(sluice, served["name"]))
        assert served["model"] in [m.id for m in oai.models.list().data]
        reply = oai.chat.completions.create(
            model=served["model"], messages=[{"role": "user", "content": PROMPT}],
            max_tokens=32, temperature=0)
        text = reply.choices[0].message.content or ""
        assert reply.model == served["model"]
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens > 0
        assert "paris" in text.lower(), f"SmolLM2 (greedy) should name Paris: {text!r}"

        streamed = oai.chat.completions.create(
            model=served["model"], messages=[{"role": "user", "content": PROMPT}],
            max_tokens=32, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        assert "".join(pieces) == text  # the same greedy answer, relayed as SSE

        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="no-such-model", max_tokens=4,
                                        messages=[{"role": "user", "content": PROMPT}])

    def test_operator_restart_changes_nothing(self, sluice: Sluice, served: dict):
        """resume: a restarted operator adopts what exists (no new ReplicaSet, no pod
        replaced) and keeps the status."""
        name = served["name"]
        deployment = sluice.kubectl.get("deployment", f"{name}-worker")
        pods = {p["metadata"]["uid"] for p in sluice.pods(f"app.kubernetes.io/instance={name}")}
        replicasets = {r["metadata"]["uid"] for r in sluice.kubectl.get(
            "replicasets", selector=f"app.kubernetes.io/instance={name}")}
        sluice.restart_operator()
        wait_for("the restarted operator's resume pass", lambda: "Resuming is processed: 1 "
                 "succeeded; 0 failed" in sluice.logs_of("operator", 300).rsplit(
                     "=== e2e: starting", 1)[-1], SHORT_TIMEOUT_S, isvc_state(sluice, name))
        isvc = wait_for(f"{name}: still Ready after the operator restart",
                        serving(sluice, name, 1), SHORT_TIMEOUT_S, isvc_state(sluice, name))
        after = sluice.kubectl.get("deployment", f"{name}-worker")
        assert after["metadata"]["uid"] == deployment["metadata"]["uid"]
        assert after["metadata"]["generation"] == deployment["metadata"]["generation"], \
            "the restarted operator changed the Deployment"
        assert {r["metadata"]["uid"] for r in sluice.kubectl.get(
            "replicasets", selector=f"app.kubernetes.io/instance={name}")} == replicasets
        assert {p["metadata"]["uid"] for p in
                sluice.pods(f"app.kubernetes.io/instance={name}")} == pods
        assert isvc["metadata"]["uid"] == served["uid"]

    def test_kubectl_scale_to_two(self, sluice: Sluice, served: dict):
        name = served["name"]
        sluice.kubectl.run("scale", f"sisvc/{name}", "--replicas=2")
        isvc = wait_for(f"{name}: 2/2 replicas ready", serving(sluice, name, 2),
                        READY_TIMEOUT_S, isvc_state(sluice, name))
        assert isvc["spec"]["replicas"] == 2
        deployment = sluice.kubectl.get("deployment", f"{name}-worker")
        assert deployment["spec"]["replicas"] == 2
        assert deployment["status"].get("readyReplicas") == 2
        pods = ready_pods(sluice, isvc["status"]["selector"])
        assert len(pods) == 2 and len({p["status"]["podIP"] for p in pods}) == 2
        wait_for("the router to route to both pods",
                 lambda: router_ready(sluice, served["model"]) == pod_urls(pods),
                 SHORT_TIMEOUT_S, isvc_state(sluice, name))
        # A replicas-only change scales; it does not roll the pods.
        hashes = {p["metadata"]["labels"]["pod-template-hash"] for p in pods}
        assert len(hashes) == 1, hashes
        served["template_hash"] = hashes.pop()
        scale = json.loads(sluice.kubectl.run(
            "get", "--raw", f"/apis/serving.sluice.dev/v1alpha1/namespaces/{sluice.namespace}/"
            f"inferenceservices/{name}/scale").stdout)
        assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
        assert scale["status"]["selector"] == isvc["status"]["selector"]

    def test_spec_change_rolls_out_while_serving(self, sluice: Sluice, served: dict):
        """engine.native.maxNumSeqs 32 → 16: a new ReplicaSet whose pods run with the new
        flag; a request every second or so through the router meanwhile, all answered."""
        name, oai = served["name"], client(sluice)
        before = sluice.kubectl.get("deployment", f"{name}-worker")
        old_hash = before["spec"]["template"]["metadata"]["annotations"][SPEC_HASH]
        sluice.kubectl.run("patch", CRD, name, "--type=merge", "-p",
                           json.dumps({"spec": {"engine": {"native": {"maxNumSeqs": 16}}}}))
        generation = sluice.isvc(name)["metadata"]["generation"]
        done = serving(sluice, name, 2)
        failures: list[str] = []
        answered, seen = 0, set()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                reply = oai.chat.completions.create(
                    model=served["model"], messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=4, temperature=0)
                answered += bool(reply.choices[0].message.content)
            except openai.OpenAIError as exc:
                failures.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")
            isvc = sluice.isvc(name)
            progressing = condition(isvc, "Progressing")
            seen.add(f"{progressing.get('status')}/{progressing.get('reason')}")
            pods = sluice.pods(isvc["status"]["selector"])
            rolled = all(p["metadata"].get("annotations", {}).get(SPEC_HASH) != old_hash
                         for p in pods)
            if rolled and isvc["status"].get("observedGeneration") == generation and done():
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{name}: the rollout did not finish in {READY_TIMEOUT_S} s "
                            f"(Progressing seen: {sorted(seen)})\n{sluice.state((name,))}",
                            pytrace=False)
            time.sleep(1.0)
        assert not failures, f"{len(failures)} requests failed during the rollout " \
                             f"({answered} answered):\n" + "\n".join(failures[:10])
        assert "True/RollingUpdate" in seen, f"Progressing never showed the rollout: {seen}"

        after = sluice.kubectl.get("deployment", f"{name}-worker")
        assert after["spec"]["template"]["metadata"]["annotations"][SPEC_HASH] != old_hash
        pods = ready_pods(sluice, sluice.isvc(name)["status"]["selector"])
        assert len(pods) == 2
        hashes = {p["metadata"]["labels"]["pod-template-hash"] for p in pods}
        assert hashes and served["template_hash"] not in hashes, hashes
        for pod in pods:
            args = pod["spec"]["containers"][0]["args"]
            assert args[args.index("--max-num-seqs") + 1] == "16", args
        wait_for("the router to route to the new pods only",
                 lambda: router_ready(sluice, served["model"]) == pod_urls(pods),
                 SHORT_TIMEOUT_S, isvc_state(sluice, name))
        reply = oai.chat.completions.create(
            model=served["model"], messages=[{"role": "user", "content": PROMPT}],
            max_tokens=32, temperature=0)
        assert "paris" in (reply.choices[0].message.content or "").lower()

    def test_delete_garbage_collects_everything(self, sluice: Sluice, served: dict):
        name = served["name"]
        isvc = sluice.isvc(name)
        assert not isvc["metadata"].get("finalizers"), "a finalizer would block deletion"
        selector = f"app.kubernetes.io/instance={name}"
        pids = local_pids(sluice.pods(selector))
        assert pids or not sluice.local, "the node agent reports local://PID container ids"
        assert all(alive(pid) for pid in pids)
        started = time.monotonic()
        sluice.kubectl.run("delete", CRD, name, "--wait=true", "--timeout=30s", timeout=60)
        deleted_in = time.monotonic() - started
        assert sluice.isvc(name) is None
        assert deleted_in < 15, f"deleting took {deleted_in:.0f} s (a finalizer?)"

        def leftovers() -> list[str]:
            found = [f"{kind}/{name}-worker" for kind in ("deployment", "service", "endpoints")
                     if sluice.kubectl.get(kind, f"{name}-worker") is not None]
            found += [f"replicaset/{r['metadata']['name']}" for r in
                      sluice.kubectl.get("replicasets", selector=selector)]
            found += [f"pod/{p['metadata']['name']}" for p in sluice.pods(selector)]
            return found + [f"process {pid}" for pid in pids if alive(pid)]

        wait_for(f"{name}: its Deployment, Service, Endpoints, ReplicaSets, pods and "
                 "processes to be gone", lambda: not leftovers() or None, SHORT_TIMEOUT_S,
                 lambda: f"left: {leftovers()}\n{sluice.state()}")
        oai = client(sluice)
        wait_for(f"the router to stop listing {served['model']} and its workers",
                 lambda: served["model"] not in [m.id for m in oai.models.list().data]
                 and not router_ready(sluice, served["model"]),
                 SHORT_TIMEOUT_S, lambda: sluice.logs_of("router"))
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model=served["model"], max_tokens=4,
                                        messages=[{"role": "user", "content": PROMPT}])


def test_nothing_left_behind(sluice: Sluice):
    """Every test deleted what it created: no InferenceService, worker or stuck object."""
    assert sluice.kubectl.get(CRD) == []
    wait_for("no worker pods in the namespace",
             lambda: not sluice.pods("app.kubernetes.io/name=sluice-worker"), SHORT_TIMEOUT_S,
             sluice.state)
    assert all(p.running() for p in sluice.processes.values()), \
        "the local operator or router exited"
