"""A real Kubernetes v1.20 control plane on this machine, for the e2e suite.

    python e2e/local/cluster.py up   --dir DIR     # prints KUBECONFIG=DIR/kubeconfig
    python e2e/local/cluster.py down --dir DIR

`up` starts etcd (Debian's etcd-server), kube-apiserver, kube-controller-manager and
kube-scheduler (built by e2e/local/build-kubernetes.sh) and the node agent
(e2e/local/node_agent.py, which plays the kubelet for one Node), each as a detached process
in its own process group, then waits for each to be healthy. Everything an instance owns
lives under DIR, and its ports are picked free at `up`, so two instances can share the
machine:

    DIR/kubeconfig        admin kubeconfig (client cert in group system:masters)
    DIR/cluster.json      ports, pod CIDR, pids: what `down` and tests read
    DIR/logs/NAME.log     one log per component (etcd, kube-apiserver, ..., node-agent)
    DIR/pki/              CA, serving and client certificates, service-account key pair
    DIR/etcd/             etcd data
    DIR/node/pods/NS_POD_UID8/CONTAINER.log   container output (no `kubectl logs`)
    DIR/pv/CLAIM/         PersistentVolumeClaim data (--pv-root to share it between runs)

Pod IPs come from a per-instance 10.200.K.0/24 that the node agent makes local with
`ip route add local 10.200.K.0/24 dev lo` (needs root; removed at exit). The apiserver
refuses loopback addresses (127.0.0.0/8) in Endpoints, so 127.0.0.N pod IPs would leave
every Service without endpoints; without root the agent falls back to them anyway and
warns. Services get ClusterIPs from 10.96.0.0/16 but nothing routes them (no kube-proxy):
reach pods through their Endpoints. Every wait has a deadline; a failure names the
component, prints the tail of its log, and stops what was started.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
K8S_VERSION = "v1.20.2"
SERVICE_CIDR = "10.96.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"
NODE_NAME = "sluice-local"
# Reverse of the start order; `down` stops them in this order.
T0 = time.monotonic()  # for the progress lines of `up`
COMPONENTS = ["node-agent", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]


class ClusterError(RuntimeError):
    """A component failed to start or become healthy; the message carries its log tail."""


def default_bin() -> Path:
    cache = Path(os.environ.get("SLUICE_HOME", Path.home() / ".cache" / "sluice"))
    return Path(os.environ.get("SLUICE_KUBE_BIN", cache / "kubernetes" / K8S_VERSION / "bin"))


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held together while picking, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def pick_pod_cidr() -> str:
    """A 10.200.K.0/24 no other instance routes, or 127.0.0.0/8 when we cannot add routes."""
    if os.geteuid() != 0 or not any(Path(d, "ip").exists() for d in ("/usr/sbin", "/sbin", "/usr/bin")):
        print("warning: not root: pod IPs fall back to 127.0.0.N, which the apiserver refuses "
              "in Endpoints (Services will have none)", file=sys.stderr)
        return "127.0.0.0/8"
    used = subprocess.run(["ip", "route", "show", "table", "local"], capture_output=True,
                          text=True, check=True).stdout
    free = [k for k in range(1, 255) if f"10.200.{k}.0/24" not in used]
    return f"10.200.{random.choice(free)}.0/24"


# ---------------------------------------------------------------------------- certificates

def openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise ClusterError(f"openssl {' '.join(args)} failed:\n{proc.stderr}")


def make_pki(pki: Path) -> None:
    """CA, apiserver serving cert, client certs, kubelet serving cert, SA signing key pair.

    EC P-256 keys (fast to generate); RSA 2048 for the service-account key. 10 years.
    """
    pki.mkdir(parents=True, exist_ok=True)
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650", "-subj", "/CN=sluice-local-ca",
            cwd=pki)
    sans = ("DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
            "DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1")
    certs = {  # name: (subject, extensions)
        "apiserver": ("/CN=kube-apiserver", f"subjectAltName={sans}\nextendedKeyUsage=serverAuth"),
        "admin": ("/O=system:masters/CN=sluice-admin", "extendedKeyUsage=clientAuth"),
        "controller-manager": ("/CN=system:kube-controller-manager", "extendedKeyUsage=clientAuth"),
        "scheduler": ("/CN=system:kube-scheduler", "extendedKeyUsage=clientAuth"),
        "kubelet": (f"/CN={NODE_NAME}", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth"),
    }
    for name, (subject, ext) in certs.items():
        (pki / f"{name}.ext").write_text(ext + "\n")
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "3650", "-out", f"{name}.crt", "-extfile", f"{name}.ext",
                cwd=pki)
    openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    b64 = lambda p: base64.b64encode((pki / p).read_bytes()).decode()  # noqa: E731
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "sluice-local",
        "clusters": [{"name": "sluice-local", "cluster": {
            "server": server, "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(f"{user}.crt"),
                                          "client-key-data": b64(f"{user}.key")}}],
        "contexts": [{"name": "sluice-local", "context": {"cluster": "sluice-local", "user": user}}],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


# ---------------------------------------------------------------------------- processes

def proc_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat); None if gone
    or a zombie (PID 1 here may reap orphans late)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def spawn(d: Path, name: str, argv: list[str], env: dict | None = None) -> int:
    """Start argv detached (own session and process group), output to DIR/logs/NAME.log."""
    log = open(d / "logs" / f"{name}.log", "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=d, env=env)
    log.close()
    (d / "run" / f"{name}.pid").write_text(f"{proc.pid} {proc_start_time(proc.pid)}\n")
    return proc.pid


def pid_of(d: Path, name: str) -> int | None:
    """The pid in DIR/run/NAME.pid if that very process (same start time) still runs."""
    try:
        pid, start = (d / "run" / f"{name}.pid").read_text().split()
    except (OSError, ValueError):
        return None
    return int(pid) if proc_start_time(int(pid)) == start else None


def stop(d: Path, name: str, grace_s: float) -> None:
    """SIGTERM the component's process group, SIGKILL it after grace_s seconds."""
    pid = pid_of(d, name)
    if pid is not None:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while pid_of(d, name) and time.monotonic() < deadline:
                reap(pid)
                time.sleep(0.1)
            if not pid_of(d, name):
                break
        if pid_of(d, name):
            print(f"warning: {name} (pid {pid}) survived SIGKILL", file=sys.stderr)
    (d / "run" / f"{name}.pid").unlink(missing_ok=True)


def reap(pid: int) -> None:
    try:  # our own child when `up` fails; otherwise not ours to reap
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_for(d: Path, name: str, check, deadline_s: float, what: str) -> None:
    """Poll check() (True when healthy) with backoff until deadline_s; fail fast if it died."""
    deadline, delay = time.monotonic() + deadline_s, 0.1
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        pid = pid_of(d, name)
        if pid is not None:
            reap(pid)
        if pid_of(d, name) is None:
            raise ClusterError(f"{name} exited while waiting for {what}; "
                               f"tail of {d}/logs/{name}.log:\n{log_tail(d / 'logs' / f'{name}.log')}")
        try:
            if check():
                print(f"{time.monotonic() - T0:5.1f} s  {name}: {what}", file=sys.stderr)
                return
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last_err = exc
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)
    raise ClusterError(f"{name}: no {what} after {deadline_s:.0f} s (last error: {last_err}); "
                       f"tail of {d}/logs/{name}.log:\n{log_tail(d / 'logs' / f'{name}.log')}")


def https_get(url: str, pki: Path, user: str | None = "admin", timeout_s: float = 3.0) -> str:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if user:
        ctx.load_cert_chain(str(pki / f"{user}.crt"), str(pki / f"{user}.key"))
    else:  # controller-manager and scheduler serve self-signed certs
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with urllib.request.urlopen(url, context=ctx, timeout=timeout_s) as resp:
        return resp.read().decode()


# ---------------------------------------------------------------------------- up / down

def up(d: Path, bin_dir: Path, pv_root: Path, deadline_s: float, capacity: list[str]) -> None:
    d = d.resolve()
    if any(pid_of(d, c) for c in COMPONENTS):
        raise ClusterError(f"a cluster already runs in {d}; run `down --dir {d}` first")
    for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        if not (bin_dir / b).is_file():
            raise ClusterError(f"{bin_dir / b} missing: run e2e/local/build-kubernetes.sh first")
    for sub in ("logs", "run", "etcd", "node"):  # a fresh cluster: no state from a last run
        shutil.rmtree(d / sub, ignore_errors=True)
        (d / sub).mkdir(parents=True)
    pki = d / "pki"
    if not (pki / "sa.pub").exists():
        make_pki(pki)
    etcd_port, peer_port, api_port, kcm_port, sched_port, kubelet_port = free_ports(6)
    server = f"https://127.0.0.1:{api_port}"
    for user in ("admin", "controller-manager", "scheduler"):
        write_kubeconfig(d / f"{user}.kubeconfig", server, pki, user)
    (d / "kubeconfig").write_bytes((d / "admin.kubeconfig").read_bytes())
    (d / "kubeconfig").chmod(0o600)
    info = {"dir": str(d), "server": server, "kubernetes_version": K8S_VERSION,
            "node_name": NODE_NAME, "pod_cidr": pick_pod_cidr(), "service_cidr": SERVICE_CIDR,
            "pv_root": str(pv_root.resolve()), "node_capacity": capacity, "logs": str(d / "logs"),
            "pod_logs": str(d / "node" / "pods"),
            "ports": {"etcd": etcd_port, "etcd_peer": peer_port, "kube-apiserver": api_port,
                      "kube-controller-manager": kcm_port, "kube-scheduler": sched_port,
                      "kubelet": kubelet_port}}
    (d / "cluster.json").write_text(json.dumps(info, indent=2) + "\n")
    t0 = time.monotonic()
    try:
        _start_all(d, bin_dir, info, deadline_s)
    except BaseException:
        down(d, quiet=True)
        raise
    print(f"cluster up in {time.monotonic() - t0:.1f} s (apiserver {server}, pod CIDR "
          f"{info['pod_cidr']}, logs {d / 'logs'})", file=sys.stderr)
    print(f"KUBECONFIG={d / 'kubeconfig'}")


def _start_all(d: Path, bin_dir: Path, info: dict, deadline_s: float) -> None:
    pki, ports, server = d / "pki", info["ports"], info["server"]
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
    spawn(d, "etcd", ["etcd", "--name", "sluice", "--data-dir", str(d / "etcd"),
                      "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                      "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                      "--initial-cluster", f"sluice={peer_url}", "--logger", "zap"])
    wait_for(d, "etcd", lambda: '"health":"true"' in urllib.request.urlopen(
        f"{etcd_url}/health", timeout=2).read().decode(), deadline_s, "/health")

    admission = ("NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultStorageClass,"
                 "DefaultTolerationSeconds,Priority,StorageObjectInUseProtection,"
                 "PersistentVolumeClaimResize,RuntimeClass,MutatingAdmissionWebhook,"
                 "ValidatingAdmissionWebhook,ResourceQuota,NodeRestriction")
    spawn(d, "kube-apiserver", [
        str(bin_dir / "kube-apiserver"), f"--etcd-servers={etcd_url}",
        "--bind-address=127.0.0.1", f"--secure-port={ports['kube-apiserver']}",
        "--advertise-address=127.0.0.1", "--insecure-port=0",
        # no kubernetes Service endpoints: 127.0.0.1 is not a valid endpoint address
        "--endpoint-reconciler-type=none",
        f"--tls-cert-file={pki}/apiserver.crt", f"--tls-private-key-file={pki}/apiserver.key",
        f"--client-ca-file={pki}/ca.crt",
        f"--kubelet-client-certificate={pki}/admin.crt", f"--kubelet-client-key={pki}/admin.key",
        "--kubelet-preferred-address-types=InternalIP",
        f"--service-account-key-file={pki}/sa.pub",
        f"--service-account-signing-key-file={pki}/sa.key",
        f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC", f"--enable-admission-plugins={admission}",
        # the not-ready taint it adds to new Nodes is lifted by nodelifecycle, which is off
        "--disable-admission-plugins=TaintNodesByCondition",
        "--allow-privileged=true", "--profiling=false", "--v=1"])
    wait_for(d, "kube-apiserver", lambda: https_get(f"{server}/readyz", pki) == "ok",
             deadline_s, "/readyz")

    for name, user, port, extra in (
        ("kube-controller-manager", "controller-manager", ports["kube-controller-manager"], [
            # nodelifecycle would evict the agent's Node, which has no real kubelet
            "--controllers=*,-nodelifecycle", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki}/sa.key", f"--root-ca-file={pki}/ca.crt",
            f"--cluster-signing-cert-file={pki}/ca.crt",
            f"--cluster-signing-key-file={pki}/ca.key", "--enable-garbage-collector=true"]),
        ("kube-scheduler", "scheduler", ports["kube-scheduler"], []),
    ):
        kubeconfig = d / f"{user}.kubeconfig"
        (d / "pki" / name).mkdir(exist_ok=True)
        spawn(d, name, [
            str(bin_dir / name), f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--port=0",
            f"--cert-dir={d / 'pki' / name}", "--leader-elect=false", "--v=1", *extra])
        wait_for(d, name, lambda port=port: https_get(f"https://127.0.0.1:{port}/healthz", pki,
                                                      user=None) == "ok", deadline_s, "/healthz")

    # ServiceAccount admission refuses pods until the namespace's "default" SA has a token.
    wait_for(d, "kube-controller-manager", lambda: json.loads(https_get(
        f"{server}/api/v1/namespaces/default/serviceaccounts/default", pki)).get("secrets"),
        deadline_s, "a token for the default ServiceAccount")

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("KUBECONFIG", None)
    spawn(d, "node-agent", [
        sys.executable, str(HERE / "node_agent.py"), "--kubeconfig", str(d / "kubeconfig"),
        "--node-name", info["node_name"], "--work-dir", str(d / "node"),
        "--pv-root", info["pv_root"], "--pod-cidr", info["pod_cidr"],
        "--kubelet-port", str(ports["kubelet"]), "--pki", str(pki),
        *(f"--capacity={c}" for c in info["node_capacity"])], env=env)
    wait_for(d, "node-agent", lambda: _node_ready(server, pki, info["node_name"]),
             deadline_s, f"Node {info['node_name']} Ready")


def _node_ready(server: str, pki: Path, node: str) -> bool:
    status = json.loads(https_get(f"{server}/api/v1/nodes/{node}", pki)).get("status", {})
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))


def down(d: Path, quiet: bool = False) -> None:
    """Stop all components (agent first, so it stops its pods), newest first; idempotent."""
    d = d.resolve()
    for name in COMPONENTS:
        stop(d, name, grace_s=15.0 if name == "node-agent" else 10.0)
    # If the agent died hard, its pod processes and route may have been left behind.
    for pidfile in (d / "node" / "pods").glob("*/*.pid"):
        try:
            pid, start = pidfile.read_text().split()
            if proc_start_time(int(pid)) == start:
                os.killpg(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    try:
        cidr = json.loads((d / "cluster.json").read_text())["pod_cidr"]
    except (OSError, ValueError, KeyError):
        cidr = None
    if cidr and not cidr.startswith("127.") and os.geteuid() == 0:
        subprocess.run(["ip", "route", "del", "local", cidr, "dev", "lo"], capture_output=True)
    if not quiet:
        print(f"cluster in {d} stopped", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["up", "down"])
    ap.add_argument("--dir", required=True, type=Path, help="instance directory (created)")
    ap.add_argument("--bin", type=Path, default=default_bin(),
                    help="directory with kube-apiserver, kube-controller-manager, kube-scheduler")
    ap.add_argument("--pv-root", type=Path, help="PersistentVolumeClaim data root (DIR/pv)")
    ap.add_argument("--node-capacity", action="append", default=[], metavar="KEY=VALUE",
                    help="override or add Node capacity, e.g. cpu=8 or nvidia.com/gpu=1")
    ap.add_argument("--deadline", type=float, default=60.0,
                    help="seconds each component may take to become healthy")
    args = ap.parse_args()
    try:
        if args.command == "up":
            up(args.dir, args.bin, args.pv_root or args.dir / "pv", args.deadline, args.node_capacity)
        else:
            down(args.dir)
    except ClusterError as exc:
        print(f"cluster.py {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
