"""Checks of the local control plane and its node agent (e2e/local).

The cluster tests run only against a cluster started by e2e/local/cluster.py (KUBECONFIG
set and a Node labelled type=sluice-node-agent); the expansion and rewrite tests always run.

    python e2e/local/cluster.py up --dir /tmp/k
    KUBECONFIG=/tmp/k/kubeconfig .venv/bin/python -m pytest e2e/local -q
    python e2e/local/cluster.py down --dir /tmp/k
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_agent import expand, rewriter  # noqa: E402


def test_expand_follows_kubernetes_rules():
    env = {"PORT": "8080", "POD_IP": "10.200.1.10"}
    assert expand("--port=$(PORT)", env) == "--port=8080"
    assert expand("$(POD_IP):$(PORT)", env) == "10.200.1.10:8080"
    assert expand("$$(PORT) $(NOPE) $ $(", env) == "$(PORT) $(NOPE) $ $("


def test_rewriter_replaces_mount_paths_only_as_path_prefixes():
    rw = rewriter({"/models": "/tmp/pv/models", "/models/cache": "/tmp/e/c", "/etc/cfg/": "/tmp/cfg"})
    assert rw("--model-dir=/models/smollm2") == "--model-dir=/tmp/pv/models/smollm2"
    assert rw("/models/cache/x /models") == "/tmp/e/c/x /tmp/pv/models"
    assert rw("/etc/cfg/a.yaml") == "/tmp/cfg/a.yaml"
    assert rw("/modelsX /data/models ./models") == "/modelsX /data/models ./models"


@pytest.fixture(scope="module")
def core():
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("KUBECONFIG not set")
    kubernetes = pytest.importorskip("kubernetes")
    kubernetes.config.load_kube_config()
    core = kubernetes.client.CoreV1Api()
    nodes = core.list_node(label_selector="type=sluice-node-agent").items
    if not nodes:
        pytest.skip("not a cluster from e2e/local/cluster.py (no node agent)")
    return core


def wait(what: str, fn, timeout_s: float = 30.0):
    """fn() until truthy, polling every 0.2 s; fail naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture
def ns(core):
    from kubernetes import client

    name = f"local-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait("the default ServiceAccount's token", lambda: (core.read_namespaced_service_account(
        "default", name).secrets if core.list_namespaced_service_account(name).items else None))
    yield name
    core.delete_namespace(name)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def web_manifests(replicas: int) -> tuple[dict, dict]:
    container = {
        "name": "http", "image": "ignored",
        "command": ["python", "-m", "http.server", "$(PORT)", "--bind", "$(POD_IP)"],
        "env": [{"name": "PORT", "value": "8080"},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    }
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}, "spec": {
        "replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
        "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
            "terminationGracePeriodSeconds": 5, "containers": [container]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]}}
    return deployment, service


def test_deployment_serves_through_endpoints_and_scales_down(core, ns):
    from kubernetes import client

    apps = client.AppsV1Api()
    deployment, service = web_manifests(2)
    apps.create_namespaced_deployment(ns, deployment)
    core.create_namespaced_service(ns, service)

    def ready_pods():
        pods = core.list_namespaced_pod(ns, label_selector="app=web").items
        ok = [p for p in pods if p.status.container_statuses and p.status.container_statuses[0].ready]
        return ok if len(ok) == 2 else None

    pods = wait("2 ready pods", ready_pods)
    ips = sorted(p.status.pod_ip for p in pods)
    assert len(set(ips)) == 2 and all(p.status.pod_ips[0].ip == p.status.pod_ip for p in pods)

    def endpoint_ips():
        subsets = core.read_namespaced_endpoints("web", ns).subsets or []
        found = sorted(a.ip for s in subsets for a in (s.addresses or []))
        return found if found == ips else None

    wait("Endpoints listing both pod IPs", endpoint_ips)
    with urllib.request.urlopen(f"http://{ips[0]}:8080/", timeout=5) as resp:
        assert resp.status == 200

    pids = {p.metadata.name: int(p.status.container_statuses[0].container_id.split("://")[1])
            for p in pods}
    apps.patch_namespaced_deployment_scale("web", ns, {"spec": {"replicas": 1}})
    wait("one process to end after scaling to 1",
         lambda: sum(pid_alive(pid) for pid in pids.values()) == 1, timeout_s=20)
    wait("one pod left", lambda: len(core.list_namespaced_pod(ns).items) == 1, timeout_s=20)

    apps.delete_namespaced_deployment("web", ns)
    wait("all processes to end after deleting the Deployment",
         lambda: not any(pid_alive(pid) for pid in pids.values()), timeout_s=20)


def test_gpu_pod_stays_pending_with_insufficient_gpu(core, ns):
    node = core.list_node(label_selector="type=sluice-node-agent").items[0]
    if "nvidia.com/gpu" in (node.status.capacity or {}):
        pytest.skip("the node advertises GPUs (cluster.py up --node-capacity nvidia.com/gpu=N)")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu"}, "spec": {"containers": [{
        "name": "c", "image": "ignored", "command": ["sleep", "1000"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    core.create_namespaced_pod(ns, pod)

    def unschedulable():
        status = core.read_namespaced_pod("gpu", ns).status
        cond = next((c for c in status.conditions or [] if c.type == "PodScheduled"), None)
        return cond if cond and cond.status == "False" else None

    cond = wait("the scheduler to refuse the GPU pod", unschedulable)
    assert cond.reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond.message
    assert core.read_namespaced_pod("gpu", ns).status.phase == "Pending"


def test_crashing_container_backs_off_and_counts_restarts(core, ns):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crash"}, "spec": {"containers": [{
        "name": "c", "image": "ignored", "command": ["sh", "-c", "exit 3"]}]}}
    core.create_namespaced_pod(ns, pod)

    def backing_off():
        statuses = core.read_namespaced_pod("crash", ns).status.container_statuses or []
        s = statuses[0] if statuses else None
        waiting = s and s.state.waiting
        return s if waiting and waiting.reason == "CrashLoopBackOff" and s.restart_count >= 1 else None

    status = wait("CrashLoopBackOff with a restart", backing_off)
    assert status.last_state.terminated.exit_code == 3
    raw = json.loads(core.read_namespaced_pod("crash", ns, _preload_content=False).data)
    assert raw["status"]["phase"] == "Running"
