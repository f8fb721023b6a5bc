"""Fixtures of the e2e suite: the cluster in $KUBECONFIG, a fresh namespace, the Sluice chart
installed in it, an operator serving that namespace, and the router's URL.

The suite runs against whatever KUBECONFIG points at. Where the operator and the router run
depends on the cluster:

    SLUICE_E2E_LOCAL=1             e2e/local's control plane (`make e2e-local`): the chart is
                                   installed with operator.enabled=false,router.enabled=false
                                   (the CRD only), and `sluice operator -n NS` and `sluice router
                                   --discovery kubernetes --namespace NS` run as local processes
                                   of this test session (logs beside $KUBECONFIG, in
                                   e2e-logs/); the router is reached on 127.0.0.1. Worker pods
                                   find sluice:// models in this machine's store
                                   ($SLUICE_HOME, default ~/.cache/sluice) through a hostPath
                                   model cache (the node agent runs pods as local processes).
    SLUICE_E2E_LOCAL=1 SLUICE_E2E_LOCAL_CHART=1
                                   e2e/local, with the chart's own operator and router
                                   Deployments (their pods run under the node agent with their
                                   ServiceAccounts' RBAC, bindAddress=$(POD_IP), a hostPath
                                   model cache); the router is reached at its Service's ready
                                   address (e2e/local has no port-forward, but pod IPs route).
    SLUICE_E2E_CHART_INSTALLED=1   the chart is installed already (e2e/kind/run.sh): release
                                   SLUICE_E2E_RELEASE in namespace SLUICE_E2E_NAMESPACE; used
                                   as it is and left in place.
    otherwise                      `helm install` into a fresh namespace (SLUICE_E2E_VALUES, if
                                   set, is the values file), uninstalled at the end.

`make e2e-local` runs the suite in both local modes, one after the other, on one cluster. In
the last two cases the chart's own operator and router Deployments run, and the router is
reached through `kubectl port-forward` (not run here: no kind on this machine). SLUICE_E2E_HELM names the helm binary (default:
scripts/get-helm.sh, which fetches a pinned one).

Every wait has a deadline; a timeout fails with the state of the namespace (objects,
InferenceService status, pod states, events, worker, operator and router log tails).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "sluice"
CRD = "inferenceservices.serving.sluice.dev"
WORKER_SELECTOR = "app.kubernetes.io/name=sluice-worker"   # every worker pod the operator makes
KUBECTL_TIMEOUT_S = 60      # one kubectl call
HELM_TIMEOUT_S = 300        # helm install --wait
START_TIMEOUT_S = 90        # a local operator/router process to answer its health endpoint
READY_TIMEOUT_S = 300       # an InferenceService to serve (model load ~10-30 s per worker here)
SHORT_TIMEOUT_S = 60        # status reactions: conditions, garbage collection, scheduling
LOCAL = os.environ.get("SLUICE_E2E_LOCAL") == "1"
LOCAL_CHART = LOCAL and os.environ.get("SLUICE_E2E_LOCAL_CHART") == "1"
PREINSTALLED = os.environ.get("SLUICE_E2E_CHART_INSTALLED") == "1"
T = TypeVar("T")


# ------------------------------------------------------------------ ordered steps

def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "incremental: the class's tests are ordered steps; after "
                                       "one fails, the later ones are skipped")


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> None:
    if "incremental" in item.keywords and call.excinfo is not None \
            and not call.excinfo.errisinstance(pytest.skip.Exception):
        item.parent._failed_step = item.name  # type: ignore[attr-defined]


def pytest_runtest_setup(item: pytest.Item) -> None:
    failed = getattr(item.parent, "_failed_step", None)
    if "incremental" in item.keywords and failed:
        pytest.skip(f"an earlier step failed: {failed}")


# ------------------------------------------------------------------ kubectl and waiting

class KubectlError(AssertionError):
    pass


@dataclass
class Kubectl:
    """kubectl against $KUBECONFIG in one namespace; every call has a timeout."""

    namespace: str
    env: dict[str, str]

    def run(self, *args: str, input: str | None = None, check: bool = True,
            timeout: float = KUBECTL_TIMEOUT_S, namespaced: bool = True
            ) -> subprocess.CompletedProcess:
        argv = ["kubectl", *(["-n", self.namespace] if namespaced else []), *args]
        try:
            proc = subprocess.run(argv, input=input, capture_output=True, text=True,
                                  timeout=timeout, env=self.env)
        except subprocess.TimeoutExpired as exc:
            raise KubectlError(f"`{' '.join(argv)}` took over {timeout:.0f} s "
                               f"(stderr: {exc.stderr!r})") from None
        if check and proc.returncode:
            raise KubectlError(f"`{' '.join(argv)}` failed with exit code {proc.returncode}:\n"
                               f"{proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def get(self, kind: str, name: str | None = None, selector: str | None = None,
            namespaced: bool = True) -> Any:
        """The object as JSON, None when it does not exist; with no name, the list's items."""
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        if selector:
            args += ["-l", selector]
        proc = self.run(*args, check=False, namespaced=namespaced)
        if proc.returncode:
            if name and "NotFound" in proc.stderr:
                return None
            raise KubectlError(f"`kubectl get {kind} {name or ''}` failed: {proc.stderr.strip()}")
        obj = json.loads(proc.stdout)
        return obj if name else obj["items"]

    def apply(self, manifest: dict | str, *extra: str, check: bool = True
              ) -> subprocess.CompletedProcess:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.run("apply", "-f", "-", *extra, input=text, check=check)


def wait_for(what: str, check: Callable[[], T | None], timeout_s: float,
             state: Callable[[], str] | None = None) -> T:
    """check() until it returns something truthy, polling with backoff (0.5 → 3 s).

    An exception from check() counts as "not yet" (an API or router blip). On timeout the
    test fails naming `what`, the last value seen (or check's last error), and state() (what
    the cluster looks like)."""
    deadline, delay = time.monotonic() + timeout_s, 0.5
    last: Any = None
    while True:
        try:
            last = check()
        except Exception as exc:  # noqa: BLE001 - pytest.fail/skip are BaseExceptions: not here
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            break
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, 3.0)
    detail = state() if state else ""
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {last!r}\n"
                f"{detail}", pytrace=False)


def condition(obj: dict | None, type_: str) -> dict:
    """status.conditions[type] of an object ({} when missing)."""
    for cond in ((obj or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == type_:
            return cond
    return {}


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=3) as resp:
            return resp.status == 200
    except OSError:
        return False


# ------------------------------------------------------------------ local processes

@dataclass
class LocalProcess:
    """A process this session started (own process group, output to a log file)."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            out.write(f"\n=== e2e: starting {' '.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=REPO,
                                         start_new_session=True)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM its process group, SIGKILL after grace_s."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        self.proc = None


# ------------------------------------------------------------------ the installation

@dataclass
class Sluice:
    """The installed system the tests drive."""

    kubectl: Kubectl
    namespace: str
    release: str
    local: bool
    router_url: str = ""
    processes: dict[str, LocalProcess] = field(default_factory=dict)
    restart_operator: Callable[[], None] = lambda: None
    operator_metrics_url: Callable[[], str] = lambda: ""  # the autoscaler's /metrics

    @property
    def release_selector(self) -> str:
        return f"app.kubernetes.io/instance={self.release}"

    def isvc(self, name: str) -> dict | None:
        return self.kubectl.get(CRD, name)

    def pods(self, selector: str) -> list[dict]:
        return self.kubectl.get("pods", selector=selector)

    def logs_of(self, component: str, lines: int = 40) -> str:
        """Tail of the operator's or the router's log (a local process or the chart's pod)."""
        proc = self.processes.get(component)
        if proc:
            return tail(proc.log, lines)
        selector = f"{self.release_selector},app.kubernetes.io/component={component}"
        out = self.kubectl.run("logs", "-l", selector, "--all-containers", "--prefix",
                               f"--tail={lines}", check=False, timeout=20)
        return (out.stdout + out.stderr).strip()

    def state(self, names: tuple[str, ...] = ()) -> str:
        """What the namespace looks like, for a failure message; never raises."""
        parts: list[str] = []

        def section(title: str, fn: Callable[[], str]) -> None:
            try:
                text = fn()
            except Exception as exc:  # noqa: BLE001 - diagnostics must not mask the failure
                text = f"({type(exc).__name__}: {exc})"
            parts.append(f"----- {title}\n{text.strip()}")

        k = self.kubectl
        section("objects", lambda: k.run(
            "get", f"{CRD},deployments,replicasets,pods,services,endpoints", "-o", "wide",
            check=False).stdout)
        for isvc in k.get(CRD) if not names else [k.get(CRD, n) for n in names]:
            if isvc:
                section(f"InferenceService {isvc['metadata']['name']}", lambda i=isvc: yaml.dump({
                    "generation": i["metadata"].get("generation"),
                    "finalizers": i["metadata"].get("finalizers"),
                    "spec": i.get("spec"), "status": i.get("status")}, sort_keys=False))
        section("pods", lambda: "\n".join(_pod_line(p) for p in k.get("pods")))
        section("events", lambda: "\n".join(k.run(
            "get", "events", "--sort-by=.lastTimestamp", check=False).stdout.splitlines()[-20:]))
        for pod in (k.get("pods", selector=WORKER_SELECTOR) or [])[:4]:
            name = pod["metadata"]["name"]
            section(f"logs of pod {name}", lambda n=name: (lambda r: r.stdout + r.stderr)(k.run(
                "logs", n, "--all-containers", "--prefix", "--tail=15", check=False,
                timeout=20)))
        for component in ("operator", "router"):
            section(f"{component} log", lambda c=component: self.logs_of(c))
        return "\n".join(parts)


def _pod_line(pod: dict) -> str:
    md, st = pod["metadata"], pod.get("status") or {}
    bits = [f"{md['name']}: {st.get('phase')}", f"ip={st.get('podIP')}"]
    if md.get("deletionTimestamp"):
        bits.append("terminating")
    for c in st.get("conditions") or ():
        if c.get("status") != "True":
            bits.append(f"{c['type']}=False({c.get('reason', '')}: {c.get('message', '')})")
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in st.get(key) or ():
            state = cs.get("state") or {}
            kind = next(iter(state), "?")
            reason = (state.get(kind) or {}).get("reason", "")
            bits.append(f"{cs['name']}:{kind}{'(' + reason + ')' if reason else ''}"
                        f" ready={cs.get('ready')} restarts={cs.get('restartCount')}")
    return "  ".join(bits)


@pytest.fixture(scope="session")
def kube_env() -> dict[str, str]:
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        pytest.skip("the e2e suite needs a cluster: set KUBECONFIG (make e2e-local starts one)")
    env = dict(os.environ)
    if LOCAL:
        # kubectl's discovery cache per throwaway cluster goes with the cluster, not to ~/.kube
        env.setdefault("KUBECACHEDIR", str(Path(kubeconfig).resolve().parent / "kubectl-cache"))
    proc = subprocess.run(["kubectl", "get", "--raw", "/readyz"], capture_output=True, text=True,
                          timeout=30, env=env)
    if proc.returncode or proc.stdout.strip() != "ok":
        pytest.fail(f"the cluster in KUBECONFIG={kubeconfig} is not ready: "
                    f"{proc.stderr.strip() or proc.stdout.strip()}", pytrace=False)
    return env


@pytest.fixture(scope="session")
def namespace(kube_env: dict[str, str]):
    """A fresh namespace (deleted at the end), or the preinstalled chart's."""
    if PREINSTALLED:
        yield os.environ.get("SLUICE_E2E_NAMESPACE", "sluice-e2e")
        return
    name = f"sluice-e2e-{uuid.uuid4().hex[:6]}"
    k = Kubectl(name, kube_env)
    k.run("create", "namespace", name, namespaced=False)
    # Kubernetes < 1.24 admits pods only once the default ServiceAccount has its token secret.
    wait_for(f"the default ServiceAccount of namespace {name}",
             lambda: (lambda sa: sa and (sa.get("secrets") or not LOCAL))(
                 k.get("serviceaccount", "default")), SHORT_TIMEOUT_S)
    yield name
    proc = k.run("delete", "namespace", name, "--wait=true", "--timeout=120s", check=False,
                 namespaced=False, timeout=150)
    if proc.returncode:
        print(f"warning: namespace {name} not deleted in time: {proc.stderr.strip()}")


def _helm() -> str:
    helm = os.environ.get("SLUICE_E2E_HELM")
    if helm:
        return helm
    proc = subprocess.run(["bash", str(REPO / "scripts" / "get-helm.sh")], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        pytest.fail(f"scripts/get-helm.sh failed: {proc.stderr.strip()}", pytrace=False)
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def release(kube_env: dict[str, str], namespace: str):
    """The chart's release name, installed in `namespace` (helm install --wait)."""
    if PREINSTALLED:
        yield os.environ.get("SLUICE_E2E_RELEASE", "sluice")
        return
    helm, name = _helm(), "sluice-e2e"
    argv = [helm, "install", name, str(CHART), "--namespace", namespace, "--wait",
            "--timeout", f"{HELM_TIMEOUT_S}s"]
    if LOCAL_CHART:  # pods share this machine's network: bind the pod IP; the local store
        argv += ["--set-string", "bindAddress=$(POD_IP)", "--set", "worker.modelCache.type="
                 f"hostPath,worker.modelCache.path={model_store()}"]
    elif LOCAL:
        argv += ["--set", "operator.enabled=false,router.enabled=false"]
    elif os.environ.get("SLUICE_E2E_VALUES"):
        argv += ["--values", os.environ["SLUICE_E2E_VALUES"]]
    proc = subprocess.run(argv, capture_output=True, text=True, env=kube_env,
                          timeout=HELM_TIMEOUT_S + 60)
    if proc.returncode:
        state = Sluice(Kubectl(namespace, kube_env), namespace, name, local=False).state()
        pytest.fail(f"`{' '.join(argv)}` failed:\n{proc.stderr.strip()}\n{state}", pytrace=False)
    yield name
    proc = subprocess.run([helm, "uninstall", name, "--namespace", namespace, "--wait",
                           "--timeout", "120s"], capture_output=True, text=True, env=kube_env,
                          timeout=180)
    if proc.returncode:
        print(f"warning: helm uninstall {name}: {proc.stderr.strip()}")


@pytest.fixture(scope="session")
def sluice(kube_env: dict[str, str], namespace: str, release: str):
    """The installed system: CRD, an operator serving `namespace`, the router's URL."""
    k = Kubectl(namespace, kube_env)
    wait_for(f"CRD {CRD} to be Established",
             lambda: condition(k.get("crd", CRD, namespaced=False), "Established")
             .get("status") == "True", SHORT_TIMEOUT_S)
    system = Sluice(k, namespace, release, local=LOCAL)
    if LOCAL and not LOCAL_CHART:
        yield from _local_processes(system, kube_env)
        return
    _chart_deployments(system)
    if LOCAL:
        _router_endpoint(system)
        yield system
    else:
        yield from _port_forward(system)


def model_store() -> Path:
    """$SLUICE_HOME of this machine: where pods run by e2e/local's node agent find models."""
    from sluice.models.store import sluice_home

    return sluice_home().resolve()


def _local_processes(system: Sluice, env: dict[str, str]):
    """`sluice operator` and `sluice router --discovery kubernetes` for the namespace."""
    logs = Path(env["KUBECONFIG"]).resolve().parent / "e2e-logs"
    logs.mkdir(exist_ok=True)
    sluice_bin = str(REPO / ".venv" / "bin" / "sluice")
    ns = system.namespace
    health, router_port, metrics = free_port(), free_port(), free_port()
    penv = {k: v for k, v in env.items() if k.lower() not in
            ("http_proxy", "https_proxy", "all_proxy")}  # everything here is local
    operator = LocalProcess("operator", [
        sluice_bin, "--log-level", "INFO", "operator", "--namespace", ns,
        "--model-cache", f"hostPath:{model_store()}",
        "--liveness", f"http://127.0.0.1:{health}/healthz",
        # the router is a local process, not a pod the autoscaler could find by label
        "--router", f"http://127.0.0.1:{router_port}",
        "--metrics-port", str(metrics), "--metrics-host", "127.0.0.1"],
        logs / f"operator-{ns}.log", penv)
    router = LocalProcess("router", [
        sluice_bin, "--log-level", "INFO", "router", "--discovery", "kubernetes",
        "--namespace", ns, "--host", "127.0.0.1", "--port", str(router_port)],
        logs / f"router-{ns}.log", penv)
    system.processes = {"operator": operator, "router": router}
    system.router_url = f"http://127.0.0.1:{router_port}"
    system.operator_metrics_url = lambda: f"http://127.0.0.1:{metrics}/metrics"

    def wait_started(proc: LocalProcess, url: str) -> None:
        def up() -> bool:
            if not proc.running():
                pytest.fail(f"{proc.name} exited; log:\n{tail(proc.log)}", pytrace=False)
            return http_ok(url)
        wait_for(f"the {proc.name} to answer {url}", up, START_TIMEOUT_S,
                 lambda: f"{proc.name} log:\n{tail(proc.log)}")

    def restart_operator() -> None:
        operator.stop()
        operator.start()
        wait_started(operator, f"http://127.0.0.1:{health}/healthz")

    system.restart_operator = restart_operator
    try:
        for proc in (operator, router):
            proc.start()
        wait_started(operator, f"http://127.0.0.1:{health}/healthz")
        wait_started(router, f"{system.router_url}/livez")
        yield system
    finally:
        for proc in (router, operator):
            proc.stop()


def _chart_deployments(system: Sluice) -> None:
    """Wait for the chart's operator and router Deployments; restart_operator restarts it."""
    k = system.kubectl
    selector = system.release_selector
    for component in ("operator", "router"):
        sel = f"{selector},app.kubernetes.io/component={component}"
        deployments = k.get("deployments", selector=sel)
        assert deployments, f"no {component} Deployment ({sel}) in the release\n{system.state()}"
        name = deployments[0]["metadata"]["name"]
        k.run("rollout", "status", f"deployment/{name}", f"--timeout={READY_TIMEOUT_S}s",
              timeout=READY_TIMEOUT_S + 30)

    def restart_operator() -> None:
        name = k.get("deployments", selector=f"{selector},app.kubernetes.io/component=operator"
                     )[0]["metadata"]["name"]
        k.run("rollout", "restart", f"deployment/{name}")
        k.run("rollout", "status", f"deployment/{name}", f"--timeout={READY_TIMEOUT_S}s",
              timeout=READY_TIMEOUT_S + 30)

    def operator_metrics_url() -> str:
        sel = f"{selector},app.kubernetes.io/component=operator"
        pods = [p for p in k.get("pods", selector=sel) if not p["metadata"].get(
            "deletionTimestamp") and (p.get("status") or {}).get("podIP")]
        return f"http://{pods[0]['status']['podIP']}:9090/metrics" if pods else ""

    system.restart_operator = restart_operator
    system.operator_metrics_url = operator_metrics_url


def _router_service(system: Sluice) -> dict:
    selector = f"{system.release_selector},app.kubernetes.io/component=router"
    services = system.kubectl.get("services", selector=selector)
    assert services, f"the chart installed no router Service ({selector})\n{system.state()}"
    return services[0]


def _router_endpoint(system: Sluice) -> None:
    """e2e/local has no kube-proxy and no port-forward, but pod IPs route: use the router
    Service's ready address."""
    name = _router_service(system)["metadata"]["name"]

    def address() -> str | None:
        for subset in (system.kubectl.get("endpoints", name) or {}).get("subsets") or ():
            port = next((p["port"] for p in subset.get("ports") or () if p.get("name") == "http"),
                        None)
            for a in subset.get("addresses") or ():
                if port:
                    return f"http://{a['ip']}:{port}"
        return None

    system.router_url = wait_for(f"a ready address of Service {name}", address,
                                 SHORT_TIMEOUT_S, system.state)
    wait_for("the router's /livez", lambda: http_ok(f"{system.router_url}/livez"),
             SHORT_TIMEOUT_S, system.state)


def _port_forward(system: Sluice):
    """Forward a local port to the router Service (kubectl port-forward)."""
    k = system.kubectl
    service = _router_service(system)
    port = service["spec"]["ports"][0]["port"]
    argv = ["kubectl", "-n", system.namespace, "port-forward", "--address", "127.0.0.1",
            f"service/{service['metadata']['name']}", f":{port}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=k.env, start_new_session=True)
    found: list[str] = []
    lines: list[str] = []

    def read() -> None:  # "Forwarding from 127.0.0.1:41234 -> 8000"
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip())
            if line.startswith("Forwarding from 127.0.0.1:") and not found:
                found.append(line.split("127.0.0.1:", 1)[1].split()[0])

    threading.Thread(target=read, daemon=True).start()
    try:
        local = wait_for("kubectl port-forward to the router", lambda: found[0] if found else
                         (pytest.fail(f"port-forward exited: {lines}", pytrace=False)
                          if proc.poll() is not None else None), SHORT_TIMEOUT_S)
        system.router_url = f"http://127.0.0.1:{local}"
        wait_for("the router's /livez through the port-forward",
                 lambda: http_ok(f"{system.router_url}/livez"), SHORT_TIMEOUT_S, system.state)
        yield system
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            proc.kill()
