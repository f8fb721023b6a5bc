"""The operator's pure parts: spec → Deployment/Service, and what exists → status."""

from __future__ import annotations

import copy

import pytest

from sluice.api.names import API_VERSION, KIND
from sluice.api.service import SpeculativeSpec
from sluice.operator import resources as r
from sluice.operator.resources import InvalidSpec, ModelCache, OperatorConfig
from sluice.operator.status import Probe, compute_status, pod_problem, ready_addresses

MODEL = "SmolLM2-135M-Instruct"
NOW, LATER = "2026-11-29T10:00:00Z", "2026-11-29T10:05:00Z"


def isvc(name: str = "smol", namespace: str = "team-a", **spec) -> dict:
    base = {"model": {"name": MODEL, "source": f"sluice://{MODEL}"}}
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": "uid-1", "generation": 3},
            "spec": {**base, **spec}}


def deployment_of(body: dict, config: OperatorConfig | None = None) -> dict:
    service, pdb, deployment = r.desired_objects(body, config or OperatorConfig())
    assert service["kind"] == "Service" and deployment["kind"] == "Deployment"
    assert pdb["kind"] == "PodDisruptionBudget"
    return deployment


def container_of(body: dict, config: OperatorConfig | None = None) -> dict:
    (container,) = deployment_of(body, config)["spec"]["template"]["spec"]["containers"]
    return container


def worker_args(body: dict, config: OperatorConfig | None = None) -> list[str]:
    args = container_of(body, config)["args"]
    return args[args.index("worker") + 1:]


# ------------------------------------------------------------------ names, labels, owners

def test_children_names_labels_and_owner():
    service, pdb, deployment = r.desired_objects(isvc(), OperatorConfig())
    labels = {"app.kubernetes.io/name": "sluice-worker", "app.kubernetes.io/instance": "smol",
              "app.kubernetes.io/component": "worker",
              "app.kubernetes.io/managed-by": "sluice-operator",
              "app.kubernetes.io/part-of": "sluice"}
    owner = {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "InferenceService",
             "name": "smol", "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
    for obj in (service, pdb, deployment):
        assert obj["metadata"] == {"name": "smol-worker", "namespace": "team-a",
                                   "labels": labels, "ownerReferences": [owner]}
    selector = {"app.kubernetes.io/name": "sluice-worker", "app.kubernetes.io/instance": "smol"}
    assert deployment["spec"]["selector"] == {"matchLabels": selector}
    assert deployment["spec"]["template"]["metadata"]["labels"] == labels
    assert service["spec"] == {"type": "ClusterIP", "selector": selector,
                               "ports": [{"name": "http", "port": 8000, "targetPort": 8000,
                                          "protocol": "TCP"}]}
    assert r.selector_string("smol") == \
        "app.kubernetes.io/instance=smol,app.kubernetes.io/name=sluice-worker"
    assert r.endpoint_url("smol", "team-a") == "http://smol-worker.team-a.svc:8000"


def test_a_cascade_has_no_children():
    body = isvc(name="coder", cascade={"tiers": ["smol", "big"],
                                       "escalation": {"threshold": -1.0}})
    body["spec"]["model"] = {"name": "coder"}
    assert r.is_cascade(body) and not r.is_cascade(isvc())
    assert r.desired_objects(body, OperatorConfig()) == []
    body["spec"]["model"]["source"] = f"sluice://{MODEL}"
    with pytest.raises(InvalidSpec, match="a cascade serves from its tiers: model.source "
                       "must be omitted"):
        r.desired_objects(body, OperatorConfig())


def test_deployment_replicas_and_strategy():
    spec = deployment_of(isvc(replicas=3))["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"] == {"type": "RollingUpdate",
                                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "50%"}}


# ------------------------------------------------------------------ the worker container

def test_store_model_with_the_default_emptydir_cache():
    body = isvc(engine={"native": {"kvCacheGiB": 0.25, "maxNumSeqs": 32,
                                   "enablePrefixCaching": False}})
    pod = deployment_of(body)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["sluice"]
    assert container["args"] == [
        "--log-level", "INFO", "worker", "--model", MODEL, "--served-model-name", MODEL,
        "--kv-cache-gib", "0.25", "--max-num-seqs", "32", "--no-enable-prefix-caching",
        "--host", "$(POD_IP)", "--port", "8000"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"] == {"name": "POD_IP",
                             "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert env["SLUICE_HOME"]["value"] == "/var/lib/sluice"
    assert env["HOME"]["value"] == "/tmp"
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/var/lib/sluice"} in container["volumeMounts"]
    (fetch,) = pod["initContainers"]
    assert fetch["name"] == "fetch-model" and fetch["image"] == container["image"]
    assert fetch["args"] == ["--log-level", "INFO", "models", "fetch", MODEL]
    assert {"name": "SLUICE_HOME", "value": "/var/lib/sluice"} in fetch["env"]
    assert fetch["volumeMounts"] == container["volumeMounts"]


def test_store_name_is_canonicalised():
    body = isvc(model={"name": "smol", "source": "sluice://smollm2-135m-instruct"})
    assert worker_args(body)[:4] == ["--model", MODEL, "--served-model-name", "smol"]


def test_hostpath_cache_is_mounted_at_the_same_path():
    config = OperatorConfig(model_cache=ModelCache.parse("hostPath:/var/cache/sluice/"))
    pod = deployment_of(isvc(), config)["spec"]["template"]["spec"]
    assert {"name": "model-cache", "hostPath": {"path": "/var/cache/sluice",
                                                "type": "DirectoryOrCreate"}} in pod["volumes"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["SLUICE_HOME"] == "/var/cache/sluice"
    # a node's pods share one build of the native kernels (keyed by CPU flags among others)
    assert env["TORCH_EXTENSIONS_DIR"] == "/var/cache/sluice/torch_extensions"
    # the kubelet creates the folder owned by root; the non-root workers get it first
    owner, fetch = pod["initContainers"]
    assert owner["name"] == "cache-owner" and fetch["name"] == "fetch-model"
    assert owner["command"] == ["chown", "1000:1000", "/var/cache/sluice"]
    assert owner["securityContext"]["runAsUser"] == 0
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert owner["volumeMounts"] == [{"name": "model-cache", "mountPath": "/var/cache/sluice"}]
    emptydir = deployment_of(isvc())["spec"]["template"]["spec"]
    assert [c["name"] for c in emptydir["initContainers"]] == ["fetch-model"]


def test_pvc_cache_and_image_cache():
    pod = deployment_of(isvc(), OperatorConfig(model_cache=ModelCache.parse("pvc:models")))[
        "spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}} \
        in pod["volumes"]
    assert {"name": "TORCH_EXTENSIONS_DIR", "value": "/var/lib/sluice/torch_extensions"} \
        in pod["containers"][0]["env"]
    emptydir = deployment_of(isvc())["spec"]["template"]["spec"]  # per pod: its /tmp
    assert "TORCH_EXTENSIONS_DIR" not in {e["name"] for e in emptydir["containers"][0]["env"]}
    baked = deployment_of(isvc(), OperatorConfig(model_cache=ModelCache.parse("image")))[
        "spec"]["template"]["spec"]
    assert "initContainers" not in baked
    assert [v["name"] for v in baked["volumes"]] == ["tmp"]
    assert "SLUICE_HOME" not in {e["name"] for e in baked["containers"][0]["env"]}
    assert worker_args(isvc(), OperatorConfig(model_cache=ModelCache("image")))[:2] == \
        ["--model", MODEL]


def test_pvc_source_is_mounted_read_only():
    body = isvc(model={"name": "m", "source": "pvc://weights/qwen/0.5b/"})
    pod = deployment_of(body)["spec"]["template"]["spec"]
    assert worker_args(body)[:2] == ["--model", "/models/weights/qwen/0.5b"]
    assert {"name": "model-source", "persistentVolumeClaim": {"claimName": "weights",
                                                              "readOnly": True}} in pod["volumes"]
    assert {"name": "model-source", "mountPath": "/models/weights", "readOnly": True} in \
        pod["containers"][0]["volumeMounts"]
    assert "initContainers" not in pod


@pytest.mark.skipif("model" not in SpeculativeSpec.model_fields,
                    reason="no draft-model speculative decoding in this checkout")
def test_a_store_draft_model_is_fetched_too():
    draft = "Qwen2.5-Coder-0.5B-Instruct"
    body = isvc(model={"name": "coder", "source": "file:///opt/qwen-1.5b"},
                engine={"native": {"speculative": {"method": "draft", "model": draft}}})
    pod = deployment_of(body)["spec"]["template"]["spec"]
    assert [c["args"][-1] for c in pod["initContainers"]] == [draft]
    assert {"name": "SLUICE_HOME", "value": "/var/lib/sluice"} in pod["containers"][0]["env"]
    args = worker_args(body)
    assert args[:2] == ["--model", "/opt/qwen-1.5b"]
    assert args[args.index("--speculative-model") + 1] == draft
    both = isvc(engine={"native": {"speculative": {"method": "draft", "model": draft}}})
    names = [(c["name"], c["args"][-1]) for c in
             deployment_of(both)["spec"]["template"]["spec"]["initContainers"]]
    assert names == [("fetch-model", MODEL), ("fetch-model-1", draft)]


def test_file_source_is_passed_as_is():
    body = isvc(model={"name": "m", "source": "file:///opt/models/smol"})
    pod = deployment_of(body)["spec"]["template"]["spec"]
    assert worker_args(body)[:2] == ["--model", "/opt/models/smol"]
    assert "initContainers" not in pod and [v["name"] for v in pod["volumes"]] == ["tmp"]


def test_probes_lifecycle_and_grace():
    pod = deployment_of(isvc())["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": 8000}
    assert container["livenessProbe"]["initialDelaySeconds"] >= 30
    assert container["livenessProbe"]["failureThreshold"] * \
        container["livenessProbe"]["periodSeconds"] >= 60
    # preStop: leave readiness, finish in-flight requests (at most drainSeconds, 120 by
    # default), then SIGTERM; the grace covers that drain and the shutdown after it.
    assert container["lifecycle"] == {"preStop": {"httpGet": {
        "path": "drain?wait=120&min=5", "port": 8000}}}
    assert pod["terminationGracePeriodSeconds"] == 150
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


@pytest.mark.parametrize(("drain", "wait", "grace"), [(10, 10, 60), (60, 60, 90),
                                                      (299.5, 300, 330)])
def test_the_grace_covers_the_drain(drain, wait, grace):
    pod = deployment_of(isvc(autoscaling={"drainSeconds": drain}))["spec"]["template"]["spec"]
    hook = pod["containers"][0]["lifecycle"]["preStop"]["httpGet"]
    assert hook["path"] == f"drain?wait={wait}&min=5"
    assert not hook["path"].startswith("/")  # kubelets < 1.23 prepend the slash
    assert pod["terminationGracePeriodSeconds"] == grace  # max(60, drain + 30)


@pytest.mark.parametrize(("version"), ["policy/v1", "policy/v1beta1"])
def test_worker_pod_disruption_budget(version):
    _, pdb, _ = r.desired_objects(isvc(replicas=3), OperatorConfig(pdb_api_version=version))
    assert pdb["apiVersion"] == version
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
        "app.kubernetes.io/name": "sluice-worker", "app.kubernetes.io/instance": "smol"}}}


def test_security_context():
    pod = deployment_of(isvc())["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000,
                                      "runAsGroup": 1000, "fsGroup": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    for container in pod["containers"] + pod["initContainers"]:
        assert container["securityContext"] == {
            "runAsNonRoot": True, "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert pod["automountServiceAccountToken"] is False
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert {"name": "tmp", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]


def test_resources_are_requests_equal_limits():
    body = isvc(resources={"cpu": 2, "memory": "4Gi", "nvidia.com/gpu": 1})
    pod = deployment_of(body)["spec"]["template"]["spec"]
    wanted = {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}
    assert pod["containers"][0]["resources"] == {"requests": wanted, "limits": wanted}
    assert pod["initContainers"][0]["resources"] == {"requests": wanted, "limits": wanted}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert worker_args(body)[-6:] == ["--device", "cuda", "--host", "$(POD_IP)", "--port",
                                      "8000"]
    cpu_only = deployment_of(isvc())["spec"]["template"]["spec"]
    assert cpu_only["containers"][0]["resources"] == {} and "tolerations" not in cpu_only


@pytest.mark.parametrize("cpu, threads", [(2, "2"), ("500m", "1"), ("3500m", "3"), ("1.5", "1"),
                                          (None, None)])
def test_torch_threads_follow_the_cpu_limit(cpu, threads):
    pod = deployment_of(isvc(resources={"cpu": cpu} if cpu is not None else {}))["spec"]["template"]["spec"]
    for container in (*pod.get("initContainers", []), *pod["containers"]):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env.get("OMP_NUM_THREADS") == threads


def test_images_and_command_come_from_the_operator_config():
    config = OperatorConfig(worker_image="reg/sluice:1", vllm_worker_image="reg/sluice-vllm:1",
                            worker_command=("python", "-m", "sluice.cli"),
                            worker_log_level="DEBUG", image_pull_policy="Always")
    container = container_of(isvc(), config)
    assert container["image"] == "reg/sluice:1" and container["imagePullPolicy"] == "Always"
    assert container["command"] == ["python"]
    assert container["args"][:5] == ["-m", "sluice.cli", "--log-level", "DEBUG", "worker"]
    vllm = deployment_of(isvc(engine={"name": "vllm"}), config)["spec"]["template"]["spec"]
    assert vllm["containers"][0]["image"] == "reg/sluice-vllm:1"
    assert "--engine" in vllm["containers"][0]["args"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in vllm["volumes"]
    assert container_of(isvc(engine={"name": "vllm"}))["image"] == r.DEFAULT_WORKER_IMAGE


# ------------------------------------------------------------------ spec hash

def _hash(body: dict, config: OperatorConfig | None = None) -> str:
    return deployment_of(body, config)["spec"]["template"]["metadata"]["annotations"][
        "serving.sluice.dev/spec-hash"]


def test_spec_hash_changes_with_the_pods_not_with_replicas():
    base = _hash(isvc(replicas=1))
    assert len(base) == 16
    assert _hash(isvc(replicas=5)) == base
    assert _hash(isvc(replicas=1, minReplicas=0, maxReplicas=9, slo={"ttftMs": 200})) == base
    assert _hash(isvc(engine={"native": {"maxNumSeqs": 8}})) != base
    assert _hash(isvc(resources={"cpu": "1"})) != base
    assert _hash(isvc(), OperatorConfig(worker_image="other:2")) != base
    template = deployment_of(isvc())["spec"]["template"]
    assert r.spec_hash(template) == base  # the annotation itself is not hashed


# ------------------------------------------------------------------ invalid specs

@pytest.mark.parametrize(("body", "words"), [
    (isvc(minReplicas=3, maxReplicas=2), "spec: minReplicas (3) must be <= maxReplicas (2)"),
    (isvc(model={"name": "m", "source": "sluice://NoSuchModel"}),
     "unknown model 'NoSuchModel'; the store knows: SmolLM2-135M-Instruct"),
    (isvc(engine={"tensorParallelSize": 2}), "spec.engine.tensorParallelSize"),
    (isvc(name="a" * 57), "must be a DNS-1035 label"),
    (isvc(name="7b"), "'7b-worker' must be a DNS-1035 label"),
    (isvc(autoscaling={"scaleToZero": True}), "autoscaling.scaleToZero needs minReplicas: 0"),
    (isvc(minReplicas=0, maxReplicas=2, autoscaling={"enabled": True}),
     "spec.minReplicas 0 needs spec.autoscaling.scaleToZero: true"),
    (isvc(replicas=2, autoscaling={"enabled": True}),
     "spec.maxReplicas is required with spec.autoscaling.enabled"),
    (isvc(resources={"cpu": "lots"}), "spec.resources.cpu"),
])
def test_invalid_specs_the_schema_cannot_catch(body, words):
    with pytest.raises(InvalidSpec) as info:
        r.desired_objects(body, OperatorConfig())
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_longest_valid_name():
    deployment = deployment_of(isvc(name="a" * 56))
    assert deployment["metadata"]["name"] == "a" * 56 + "-worker"


@pytest.mark.parametrize(("text", "want"), [
    ("emptyDir", ModelCache("emptyDir")), ("image", ModelCache("image")),
    ("hostPath:/data/sluice", ModelCache("hostPath", "/data/sluice")),
    ("pvc:model-cache", ModelCache("pvc", "model-cache")),
])
def test_model_cache_parse(text, want):
    assert ModelCache.parse(text) == want
    assert str(want) == text


@pytest.mark.parametrize("text", ["hostPath:relative", "pvc:", "nfs:/x", "emptyDir:1Gi", ""])
def test_model_cache_parse_rejects(text):
    with pytest.raises(ValueError, match="expected emptyDir, image"):
        ModelCache.parse(text)


# ------------------------------------------------------------------ status

def deployment_status(replicas=1, ready=0, updated=None, generation=1, observed=1,
                      conditions=()) -> dict:
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "replicas": replicas,
                       "readyReplicas": ready,
                       "updatedReplicas": replicas if updated is None else updated,
                       "conditions": list(conditions)}}


def pod(name="smol-worker-abc-1", *, phase="Pending", conditions=(), containers=(),
        init=()) -> dict:
    return {"metadata": {"name": name},
            "status": {"phase": phase, "conditions": list(conditions),
                       "containerStatuses": list(containers),
                       "initContainerStatuses": list(init)}}


ENDPOINTS = {"subsets": [{"addresses": [{"ip": "10.200.0.11"}, {"ip": "10.200.0.10"}],
                          "notReadyAddresses": [{"ip": "10.200.0.12"}],
                          "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]}]}
GPU_MESSAGE = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."


def conditions(status) -> dict:
    return {c.type: (c.status, c.reason, c.message) for c in status.conditions}


def test_ready_when_a_replica_is_ready_and_answers():
    body = isvc(replicas=2)
    probe = Probe("http://10.200.0.10:8000/health", True, "HTTP 200")
    status = compute_status(body, deployment_status(replicas=2, ready=1), [], ENDPOINTS, probe,
                            NOW, observed=3)
    assert status.replicas == 2 and status.ready_replicas == 1
    assert status.observed_generation == 3
    assert status.selector == "app.kubernetes.io/instance=smol,app.kubernetes.io/name=sluice-worker"
    assert status.endpoint == "http://smol-worker.team-a.svc:8000"
    got = conditions(status)
    assert got["Ready"] == ("True", "Serving",
                            "1/2 replicas ready; http://10.200.0.10:8000/health answered")
    assert got["Progressing"] == ("True", "ScalingUp", "1/2 replicas ready, 2 exist")
    assert got["Degraded"][:2] == ("False", "AsExpected")
    assert all(c.last_transition_time == NOW and c.observed_generation == 3
               for c in status.conditions)


def test_stable_service():
    status = compute_status(isvc(replicas=2), deployment_status(replicas=2, ready=2), [],
                            ENDPOINTS, None, NOW)
    got = conditions(status)
    assert got["Ready"] == ("True", "Serving", "2/2 replicas ready")
    assert got["Progressing"] == ("False", "Complete", "2 replica(s) updated and ready")


def test_probe_failure_keeps_ready_false():
    probe = Probe("http://10.200.0.10:8000/health", False, "ConnectError: refused")
    status = compute_status(isvc(), deployment_status(ready=1), [], ENDPOINTS, probe, NOW)
    assert conditions(status)["Ready"] == (
        "False", "EndpointNotAnswering",
        "1/1 replicas ready; GET http://10.200.0.10:8000/health: ConnectError: refused")


def test_ready_replicas_without_endpoints_yet():
    status = compute_status(isvc(), deployment_status(ready=1), [], {"subsets": []}, None, NOW)
    assert conditions(status)["Ready"][:2] == ("False", "EndpointsNotReady")


def test_unschedulable_gpu_pod_is_degraded_with_the_scheduler_message():
    body = isvc(resources={"nvidia.com/gpu": 1})
    pending = pod(conditions=[{"type": "PodScheduled", "status": "False",
                               "reason": "Unschedulable", "message": GPU_MESSAGE}])
    status = compute_status(body, deployment_status(replicas=1, ready=0), [pending], None,
                            None, NOW)
    got = conditions(status)
    assert got["Degraded"] == ("True", "Unschedulable",
                               f"pod smol-worker-abc-1: {GPU_MESSAGE}")
    assert got["Ready"] == ("False", "Unschedulable",
                            f"0/1 replicas ready; pod smol-worker-abc-1: {GPU_MESSAGE}")
    assert got["Progressing"][0] == "True"


def test_image_pull_backoff():
    failing = pod(containers=[{"name": "worker", "ready": False, "state": {"waiting": {
        "reason": "ImagePullBackOff",
        "message": 'Back-off pulling image "sluice:0.1.0"'}}}])
    problem = pod_problem(failing)
    assert problem.reason == "ImagePullBackOff"
    assert problem.message == \
        'pod smol-worker-abc-1: container worker: Back-off pulling image "sluice:0.1.0"'


def test_crash_loop_names_the_last_exit():
    crashing = pod(phase="Running", containers=[{
        "name": "worker", "restartCount": 4,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}])
    status = compute_status(isvc(), deployment_status(), [crashing], None, None, NOW)
    assert conditions(status)["Degraded"] == (
        "True", "CrashLoopBackOff", "pod smol-worker-abc-1: container worker: restarted 4 "
        "time(s); last exit code 1 (Error)")


def test_init_container_crash_is_reported():
    fetching = pod(init=[{"name": "fetch-model", "restartCount": 2, "state": {"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}])
    assert pod_problem(fetching).message == ("pod smol-worker-abc-1: init container "
                                             "fetch-model: back-off 20s restarting failed "
                                             "container; restarted 2 time(s); last exit code "
                                             "1 (Error)")


def test_several_problem_pods_are_counted_and_terminating_pods_ignored():
    bad = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
           "message": GPU_MESSAGE}
    pods = [pod("b", conditions=[bad]), pod("a", conditions=[bad]), pod("c", conditions=[bad])]
    pods[2]["metadata"]["deletionTimestamp"] = NOW
    status = compute_status(isvc(replicas=2), deployment_status(replicas=2), pods, None, None,
                            NOW)
    assert conditions(status)["Degraded"][2] == \
        f"pod a: {GPU_MESSAGE} (and 1 more pod(s) with problems)"


def test_rolling_update_and_stuck_rollout():
    status = compute_status(isvc(replicas=2), deployment_status(replicas=3, ready=2, updated=1),
                            [], ENDPOINTS, None, NOW)
    assert conditions(status)["Progressing"] == ("True", "RollingUpdate",
                                                 "1/2 replicas updated, 3 exist")
    stale = deployment_status(replicas=2, ready=2, generation=5, observed=4)
    assert conditions(compute_status(isvc(replicas=2), stale, [], ENDPOINTS, None, NOW))[
        "Progressing"][:2] == ("True", "RolloutStarting")
    stuck = deployment_status(replicas=2, ready=1, updated=1, conditions=[{
        "type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "smol-worker-x" has timed out progressing.'}])
    got = conditions(compute_status(isvc(replicas=2), stuck, [], ENDPOINTS, None, NOW))
    assert got["Progressing"][:2] == ("False", "ProgressDeadlineExceeded")
    assert got["Degraded"] == ("True", "ProgressDeadlineExceeded",
                               'ReplicaSet "smol-worker-x" has timed out progressing.')


def test_replica_failure_from_the_deployment():
    quota = deployment_status(replicas=0, conditions=[{
        "type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
        "message": 'pods "smol-worker-x" is forbidden: exceeded quota: gpus'}])
    got = conditions(compute_status(isvc(), quota, [], None, None, NOW))
    assert got["Degraded"][:2] == ("True", "FailedCreate")
    assert "exceeded quota" in got["Ready"][2]


def test_not_created_yet_and_scaled_to_zero():
    got = conditions(compute_status(isvc(), None, [], None, None, NOW))
    assert got["Ready"] == ("False", "Creating", "0/1 replicas ready")
    assert got["Progressing"][:2] == ("True", "Creating")
    zero = compute_status(isvc(replicas=0, minReplicas=0), deployment_status(replicas=0), [],
                          None, None, NOW)
    assert conditions(zero)["Ready"] == ("False", "ScaledToZero", "spec.replicas is 0")
    assert conditions(zero)["Progressing"][:2] == ("False", "Complete")


def test_invalid_spec_condition():
    message = "spec: minReplicas (3) must be <= maxReplicas (2)"
    got = conditions(compute_status(isvc(), None, [], None, None, NOW, invalid=message))
    assert got == {"Ready": ("False", "InvalidSpec", message),
                   "Progressing": ("False", "InvalidSpec", message),
                   "Degraded": ("True", "InvalidSpec", message)}


def test_last_transition_time_moves_only_on_status_change():
    body = isvc(replicas=1)
    first = compute_status(body, deployment_status(ready=0), [], None, None, NOW)
    body = copy.deepcopy(body)
    body["status"] = first.model_dump(by_alias=True, exclude_none=True)
    second = compute_status(body, deployment_status(ready=1), [], ENDPOINTS, None, LATER)
    times = {c.type: c.last_transition_time for c in second.conditions}
    assert times == {"Ready": LATER, "Progressing": LATER, "Degraded": NOW}


def test_observed_generation_is_what_was_reconciled():
    body = isvc()  # metadata.generation 3
    assert compute_status(body, None, [], None, None, NOW, observed=2).observed_generation == 2
    unknown = compute_status(body, None, [], None, None, NOW)  # after a restart, say
    assert unknown.observed_generation is None
    body["status"] = {"observedGeneration": 2}
    kept = compute_status(body, None, [], None, None, NOW)
    assert kept.observed_generation == 2
    assert {c.observed_generation for c in kept.conditions} == {2}


def test_ready_addresses():
    assert ready_addresses(ENDPOINTS) == ["10.200.0.10:8000", "10.200.0.11:8000"]
    assert ready_addresses(None) == [] and ready_addresses({}) == []
    unnamed = {"subsets": [{"addresses": [{"ip": "fd00::1"}], "ports": [{"port": 8000}]}]}
    assert ready_addresses(unnamed) == ["[fd00::1]:8000"]


# ------------------------------------------------------------------ autoscaling status

def test_autoscaling_condition_names_the_objective():
    body = isvc(replicas=1, maxReplicas=2, autoscaling={"enabled": True},
                slo={"ttftMs": 500, "itlMs": 100, "percentile": 99})
    status = compute_status(body, deployment_status(replicas=1, ready=1), [], ENDPOINTS, None,
                            NOW)
    state, reason, message = conditions(status)["Autoscaling"]
    assert (state, reason) == ("True", "Enabled")
    assert "within [1, 2]" in message and "TTFT <= 500 ms and ITL <= 100 ms at p99" in message
    assert status.desired_replicas == 1


def test_autoscaling_without_an_slo_documents_the_routers_default_objective():
    from sluice.router.dispatch import DispatchSettings

    from sluice.operator.status import ROUTER_DEFAULT_TTFT_MS

    assert ROUTER_DEFAULT_TTFT_MS == DispatchSettings().slo_ttft_ms  # the same default
    body = isvc(maxReplicas=2, autoscaling={"enabled": True})
    _, _, message = conditions(compute_status(body, None, [], None, None, NOW))["Autoscaling"]
    assert "TTFT <= 2000 ms at p95: spec.slo sets no objective, so the router's default " \
           "applies (its --slo-ttft-ms" in message


def test_no_autoscaling_condition_when_disabled_and_desired_is_the_spec():
    body = isvc(replicas=3)
    body["status"] = {"desiredReplicas": 1, "sloAttainment": 0.9, "lastScaleReason": "idle",
                      "lastScaleTime": NOW}
    status = compute_status(body, deployment_status(replicas=3), [], None, None, LATER)
    assert "Autoscaling" not in conditions(status)
    assert status.desired_replicas == 3 and status.slo_attainment is None
    assert status.last_scale_reason == "idle"  # history stays


def test_refresh_keeps_the_autoscalers_fields():
    body = isvc(replicas=2, maxReplicas=3, autoscaling={"enabled": True})
    body["status"] = {"desiredReplicas": 3, "sloAttainment": 0.93, "lastScaleTime": NOW,
                      "lastScaleReason": "burst (demand 3.10 req/s ...)"}
    status = compute_status(body, deployment_status(replicas=2), [], None, None, LATER)
    assert (status.desired_replicas, status.slo_attainment, status.last_scale_time,
            status.last_scale_reason) == (3, 0.93, NOW, "burst (demand 3.10 req/s ...)")


def test_an_invalid_autoscaled_spec_says_so_in_the_autoscaling_condition():
    body = isvc(minReplicas=0, maxReplicas=2, autoscaling={"enabled": True})
    status = compute_status(body, None, [], None, None, NOW, invalid="spec.minReplicas: 0 ...")
    assert conditions(status)["Autoscaling"][:2] == ("False", "InvalidSpec")
