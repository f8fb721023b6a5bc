"""Play the kubelet for one Node on this machine (KWOK's idea, with real processes).

Started by e2e/local/cluster.py; standalone:
    python e2e/local/node_agent.py --kubeconfig K --work-dir D --pod-cidr 10.200.7.0/24

What it emulates, and how:
- Node: registered with this machine's cpu count, memory and 110 pods as capacity, and no
  `nvidia.com/gpu`, so a pod asking for a GPU stays Pending with the scheduler's
  "Insufficient nvidia.com/gpu" (`--capacity nvidia.com/gpu=2` fakes GPUs). The Ready
  condition and the node Lease are renewed every HEARTBEAT_S seconds.
- Containers: `image` is ignored. command + args (no command: the container fails, there is
  no image entrypoint) run as a local process in its own process group, with the agent's
  environment (minus KUBECONFIG), PATH starting with the repo's .venv/bin (so `sluice ...`
  and `python` resolve there), then the container's env: value, valueFrom fieldRef
  (metadata.name/namespace/uid/labels/annotations, spec.nodeName/serviceAccountName,
  status.podIP/hostIP), configMapKeyRef, secretKeyRef, envFrom. `$(VAR)` in env values,
  command and args expands as Kubernetes does (`$$` escapes; unknown names stay literal).
  Output goes to WORK/pods/NS_POD_UID8/CONTAINER.log (also `kubectl logs`, served on
  --kubelet-port); the pid to CONTAINER.pid.
- Pod IP: each pod gets its own address from --pod-cidr (from .10 up), made local with
  `ip route add local CIDR dev lo` (root; removed at exit), reported as status.podIP and
  podIPs. A process must bind that address (`--host $(POD_IP)`), not 0.0.0.0, or two pods
  on one port collide. With a 127.0.0.0/8 CIDR (no root) addresses start at a random
  127.0.R.10, but the apiserver refuses loopback addresses in Endpoints. hostNetwork pods
  get the node address 127.0.0.1.
- Volumes: hostPath is the same path; emptyDir a directory under the pod's directory;
  persistentVolumeClaim is --pv-root/CLAIM (shared by claims of the same name in any
  namespace: a cache); configMap, secret and projected (configMap/secret) are written as
  files. Nothing is mounted: wherever a container's mountPath appears as a path prefix in
  its command, args, env values or workingDir, it is rewritten to that local directory
  (subPath appended). The ServiceAccount token volume is written like any secret, and
  KUBECONFIG points to a kubeconfig with that token, so in-cluster clients that fall back
  to KUBECONFIG (kopf does) act as the pod's ServiceAccount with its RBAC.
- PersistentVolumeClaims of StorageClass `standard` (created as the default class) are
  bound to hostPath PVs under --pv-root; Released PVs are deleted, their data kept.
- Probes (startup, readiness, liveness; httpGet, tcpSocket, exec) run at periodSeconds
  with timeoutSeconds and the thresholds; readiness sets containerStatuses[].ready and the
  ContainersReady/Ready conditions; a failed liveness or startup probe restarts the
  container. Exits restart per restartPolicy with backoff 1, 2, 4 ... 60 s, shown as
  waiting reason CrashLoopBackOff; restartCount counts restarts.
- Deletion (deletionTimestamp set): the pod turns not-ready, preStop runs (exec, where
  `sleep N` is a sleep, or httpGet at `http://IP:PORT/` + path, as kubelet 1.20 builds a
  hook's URL), SIGTERM goes to each process group, SIGKILL when the grace period
  (deletionGracePeriodSeconds) ends, then the pod is deleted with grace 0.
- Not emulated: exec/attach/port-forward, resource limits, securityContext, DNS, ClusterIP
  routing (no kube-proxy: use Endpoints), hostPort, image pulls.
"""
from __future__ import annotations

import argparse
import base64
import http.server
import ipaddress
import json
import logging
import os
import random
import re
import shlex
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 10.0          # node status and Lease renewal period
TICK_S = 0.25               # pod loop period (process exits, probes due)
BACKOFF_MAX_S = 60.0        # crash-loop backoff cap; the first restart waits 1 s, doubling
SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
PROVISIONER = "sluice.dev/node-agent"
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(s: str, env: dict) -> str:
    """Kubernetes `$(VAR)` expansion: `$$` is a literal `$`, unknown `$(X)` stays as is."""
    out, i = [], 0
    while i < len(s):
        j = s.find(")", i)
        if s.startswith("$$", i):
            out.append("$"); i += 2  # noqa: E702
        elif s.startswith("$(", i) and j > 0:
            out.append(env.get(s[i + 2:j], s[i:j + 1])); i = j + 1  # noqa: E702
        else:
            out.append(s[i]); i += 1  # noqa: E702
    return "".join(out)


def rewriter(mounts: dict[str, str]):
    """A function replacing each mountPath used as a path prefix by its local directory."""
    if not mounts:
        return lambda s: s
    alts = "|".join(re.escape(m.rstrip("/")) for m in sorted(mounts, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.\-/])({alts})(?=/|$|[^\w.\-])")
    table = {m.rstrip("/"): v for m, v in mounts.items()}
    return lambda s: pattern.sub(lambda m: table[m.group(1)], s)


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Probe:
    """Counters of one probe; `ok` is None until a threshold is crossed."""

    def __init__(self, spec: dict):
        self.spec, self.ok, self.successes, self.failures, self.due = spec, None, 0, 0, 0.0

    def reset(self, now: float) -> None:
        self.ok, self.successes, self.failures = None, 0, 0
        self.due = now + self.spec.get("initialDelaySeconds", 0)

    def record(self, passed: bool, now: float) -> None:
        self.due = now + self.spec.get("periodSeconds", 10)
        if passed:
            self.successes, self.failures = self.successes + 1, 0
        else:
            self.successes, self.failures = 0, self.failures + 1
        if self.successes >= self.spec.get("successThreshold", 1):
            self.ok = True
        elif self.failures >= self.spec.get("failureThreshold", 3):
            self.ok = False


class Container:
    """One container's process and the state its containerStatus is built from."""

    def __init__(self, spec: dict):
        self.spec, self.name = spec, spec["name"]
        self.proc: subprocess.Popen | None = None
        self.restarts, self.ready, self.started_at, self.t_start = 0, False, None, 0.0
        self.terminated: dict | None = None     # the last run's state.terminated
        self.waiting = ("ContainerCreating", "")
        self.next_start = 0.0                   # monotonic time of the next allowed start
        self.backoff = 0.0                      # seconds between the last exit and next_start
        self.probes = {k: Probe(spec[f"{k}Probe"]) for k in ("startup", "readiness", "liveness")
                       if spec.get(f"{k}Probe")}

    def status(self) -> dict:
        if self.proc:
            state = {"running": {"startedAt": self.started_at}}
        elif self.terminated and not self.waiting:
            state = {"terminated": self.terminated}
        else:
            state = {"waiting": {"reason": self.waiting[0], "message": self.waiting[1]}}
        startup = self.probes.get("startup")
        last = self.terminated if self.terminated and "terminated" not in state else None
        st = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
              "ready": self.ready, "restartCount": self.restarts, "state": state,
              "started": bool(self.proc) and (startup is None or startup.ok is True),
              "lastState": {"terminated": last} if last else {}}
        if self.proc:
            st["containerID"] = f"local://{self.proc.pid}"
        return st


class PodWorker(threading.Thread):
    """Runs one pod's containers until the pod is deleted; owns its status."""

    def __init__(self, agent: "Agent", pod: dict):
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.agent, self.pod = agent, pod
        md = pod["metadata"]
        self.ns, self.name, self.uid = md["namespace"], md["name"], md["uid"]
        self.dir = agent.work / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.wake, self.gone = threading.Event(), threading.Event()
        self.init = [Container(c) for c in pod["spec"].get("initContainers", [])]
        self.containers = [Container(c) for c in pod["spec"]["containers"]]
        self.ip = agent.node_ip if pod["spec"].get("hostNetwork") else agent.ips.popleft()
        self.start_time, self.conditions, self.pushed = now_iso(), {}, None
        self.volumes: dict[str, Path] = {}

    def update(self, pod: dict) -> None:
        self.pod = pod
        self.wake.set()

    def run(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.volumes = {v["name"]: self.volume(v) for v in self.pod["spec"].get("volumes", [])}
            while not self.gone.is_set():
                if self.pod["metadata"].get("deletionTimestamp"):
                    return self.terminate()
                self.step(time.monotonic())
                self.push_status()
                self.wake.wait(TICK_S)
                self.wake.clear()
        except Exception:  # noqa: BLE001 - keep the agent alive, say which pod broke
            log.exception("pod %s/%s", self.ns, self.name)
        finally:
            self.stop_all(deadline=time.monotonic())
            if self.ip != self.agent.node_ip:
                self.agent.ips.append(self.ip)

    # -- volumes and environment ---------------------------------------------------------
    def volume(self, vol: dict) -> Path:
        """The local directory standing for one pod volume (files written for cm/secret)."""
        if "hostPath" in vol:
            path = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type", "") in ("", "DirectoryOrCreate") and not path.exists():
                path.mkdir(parents=True, exist_ok=True)
            return path
        if "persistentVolumeClaim" in vol:
            path = self.agent.pv_root / vol["persistentVolumeClaim"]["claimName"]
        else:
            path = self.dir / "volumes" / vol["name"]
        path.mkdir(parents=True, exist_ok=True)
        sources = vol.get("projected", {}).get("sources", [vol])
        for src in sources:
            for kind in ("configMap", "secret"):
                if kind in src:
                    ref = src[kind]
                    data = self.agent.data_of(kind, self.ns, ref.get("name") or ref["secretName"],
                                              ref.get("optional", False))
                    items = ({i["key"]: i["path"] for i in ref.get("items", [])}
                             or {k: k for k in data})
                    for key, rel in items.items():
                        (path / rel).parent.mkdir(parents=True, exist_ok=True)
                        (path / rel).write_bytes(data.get(key, b""))
        return path

    def mounts(self, c: Container) -> dict[str, str]:
        return {m["mountPath"]: str(self.volumes[m["name"]] / m.get("subPath", ""))
                for m in c.spec.get("volumeMounts", []) if m["name"] in self.volumes}

    def field(self, path: str) -> str:
        md, spec = self.pod["metadata"], self.pod["spec"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return md.get(m.group(1), {}).get(m.group(2), "")
        return {"metadata.name": self.name, "metadata.namespace": self.ns, "metadata.uid": self.uid,
                "spec.nodeName": spec.get("nodeName", ""), "status.podIP": self.ip,
                "status.podIPs": self.ip, "status.hostIP": self.agent.node_ip,
                "spec.serviceAccountName": spec.get("serviceAccountName", "")}[path]

    def environment(self, c: Container, rewrite) -> tuple[dict, dict]:
        """(full process env, the container's own vars used for $(VAR) expansion)."""
        own: dict[str, str] = {}
        for src in c.spec.get("envFrom", []):
            kind = "configMap" if "configMapRef" in src else "secret"
            ref = src[f"{kind}Ref"]
            data = self.agent.data_of(kind, self.ns, ref["name"], ref.get("optional", False))
            own.update((src.get("prefix", "") + k, v.decode()) for k, v in data.items())
        for e in c.spec.get("env", []):
            vf = e.get("valueFrom")
            if vf is None:
                own[e["name"]] = rewrite(expand(e.get("value", ""), own))
            elif "fieldRef" in vf:
                own[e["name"]] = self.field(vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                res = vf["resourceFieldRef"]["resource"].split(".")
                own[e["name"]] = str(c.spec.get("resources", {}).get(res[0], {}).get(res[1], ""))
            else:
                kind = "configMap" if "configMapKeyRef" in vf else "secret"
                ref = vf[f"{kind}KeyRef"]
                data = self.agent.data_of(kind, self.ns, ref["name"], ref.get("optional", False))
                if ref["key"] in data:
                    own[e["name"]] = data[ref["key"]].decode()
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env.update(PATH=f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
                   HOSTNAME=self.name, PYTHONUNBUFFERED="1")
        token = Path(rewrite(SA_PATH)) / "token"
        if rewrite(SA_PATH) != SA_PATH and token.exists():
            env["KUBECONFIG"] = str(self.agent.pod_kubeconfig(self.dir, token.read_text()))
        env.update(own)
        return env, own

    # -- the container loop -------------------------------------------------------------
    def step(self, now: float) -> None:
        for c in self.init:
            if not (c.terminated and c.terminated["exitCode"] == 0 and not c.proc):
                self.drive(c, now, init=True)
                return
        for c in self.containers:
            self.drive(c, now, init=False)

    def should_restart(self, c: Container, init: bool) -> bool:
        policy, code = self.pod["spec"].get("restartPolicy", "Always"), c.terminated["exitCode"]
        if init:
            return code != 0 and policy != "Never"
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def drive(self, c: Container, now: float, init: bool) -> None:
        if c.proc and c.proc.poll() is None:
            return self.probe_all(c, now)
        if c.proc:
            self.exited(c, c.proc.returncode, now)
        if c.terminated is None or self.should_restart(c, init):
            if now >= c.next_start:
                self.start_container(c, now)
            else:
                c.waiting = ("CrashLoopBackOff", f"back-off {c.backoff:.0f}s restarting "
                             f"failed container={c.name} pod={self.name}")

    def start_container(self, c: Container, now: float) -> None:
        if c.terminated is not None:
            c.restarts += 1
        rewrite = rewriter(self.mounts(c))
        env, own = self.environment(c, rewrite)
        argv = [rewrite(expand(a, own)) for a in c.spec.get("command", []) + c.spec.get("args", [])]
        cwd = rewrite(c.spec["workingDir"]) if c.spec.get("workingDir") else self.dir
        with open(self.dir / f"{c.name}.log", "ab") as out:
            out.write(f"=== {now_iso()} start #{c.restarts}: {shlex.join(argv)}\n".encode())
            out.flush()
            try:
                if not c.spec.get("command"):
                    raise OSError("no command: the node agent ignores images and entrypoints")
                c.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
            except OSError as exc:
                out.write(f"=== start failed: {exc}\n".encode())
                c.terminated = {"exitCode": 128, "reason": "StartError", "message": str(exc),
                                "startedAt": now_iso(), "finishedAt": now_iso()}
                c.backoff = min(2.0 ** c.restarts, BACKOFF_MAX_S)
                c.next_start, c.waiting = now + c.backoff, ("CrashLoopBackOff", str(exc))
                return
        stat = Path(f"/proc/{c.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (self.dir / f"{c.name}.pid").write_text(f"{c.proc.pid} {stat}\n")
        c.started_at, c.t_start, c.waiting, c.ready = now_iso(), now, None, False
        for p in c.probes.values():
            p.reset(now)

    def exited(self, c: Container, code: int, now: float) -> None:
        code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N
        c.terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                        "startedAt": c.started_at, "finishedAt": now_iso()}
        c.proc, c.ready, c.waiting = None, False, None
        c.backoff = min(2.0 ** c.restarts, BACKOFF_MAX_S)
        c.next_start = now + c.backoff
        (self.dir / f"{c.name}.pid").unlink(missing_ok=True)

    def probe_all(self, c: Container, now: float) -> None:
        startup = c.probes.get("startup")
        for kind in ("startup",) if startup and not startup.ok else ("readiness", "liveness"):
            p = c.probes.get(kind)
            if p and now >= p.due:
                p.record(self.check(c, p.spec), time.monotonic())
                if p.ok is False and kind != "readiness":
                    log.info("%s/%s %s: %s probe failed, restarting",
                             self.ns, self.name, c.name, kind)
                    self.stop_container(c, time.monotonic() + self.grace())
                    return self.exited(c, c.proc.wait(), time.monotonic())
        readiness = c.probes.get("readiness")
        c.ready = (not startup or startup.ok is True) and (not readiness or readiness.ok is True)

    def check(self, c: Container, spec: dict, hook: bool = False) -> bool:
        """Run one probe: HTTP 200-399, a TCP connect, or exit status 0, within timeoutSeconds.
        hook: a lifecycle hook's httpGet, whose URL kubelet 1.20 builds as
        `http://HOST:PORT/` + path (so a path with a leading slash gets two)."""
        timeout = spec.get("timeoutSeconds", 1)
        named = {x.get("name"): x["containerPort"] for x in c.spec.get("ports", [])}
        port_of = lambda p: named[p] if p in named else int(p)  # noqa: E731
        try:
            if "httpGet" in spec:
                h = spec["httpGet"]
                url = (f"{h.get('scheme', 'HTTP').lower()}://{h.get('host') or self.ip}:"
                       f"{port_of(h['port'])}{'/' if hook else ''}{h.get('path', '/')}")
                req = urllib.request.Request(url, headers={x["name"]: x["value"]
                                                           for x in h.get("httpHeaders", [])})
                with NO_PROXY.open(req, timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            if "tcpSocket" in spec:
                t = spec["tcpSocket"]
                address = (t.get("host") or self.ip, port_of(t["port"]))
                socket.create_connection(address, timeout).close()
                return True
            rewrite = rewriter(self.mounts(c))
            env, own = self.environment(c, rewrite)
            argv = [rewrite(expand(a, own)) for a in spec["exec"]["command"]]
            return subprocess.run(argv, env=env, cwd=self.dir, timeout=timeout,
                                  capture_output=True).returncode == 0
        except Exception:  # noqa: BLE001 - any error is a failed probe
            return False

    # -- termination --------------------------------------------------------------------
    def grace(self) -> float:
        md, spec = self.pod["metadata"], self.pod["spec"]
        g = md.get("deletionGracePeriodSeconds")
        return float(g if g is not None else spec.get("terminationGracePeriodSeconds", 30))

    def terminate(self) -> None:
        deadline = time.monotonic() + self.grace()
        for c in self.init + self.containers:
            c.ready = False
        self.push_status()
        threads = [threading.Thread(target=self.stop_container, args=(c, deadline), daemon=True)
                   for c in self.init + self.containers if c.proc]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            self.agent.core.delete_namespaced_pod(self.name, self.ns, body=client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)))
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def stop_container(self, c: Container, deadline: float, pre_stop: bool = True) -> None:
        """preStop, SIGTERM to the process group, SIGKILL at deadline (monotonic seconds)."""
        hook = c.spec.get("lifecycle", {}).get("preStop") if pre_stop else None
        left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
        if hook and "exec" in hook:
            cmd = hook["exec"]["command"]
            if len(cmd) > 1 and cmd[0].endswith("sh"):  # sh -c "sleep N"
                cmd = cmd[-1:]
            m = re.fullmatch(r"(?:/bin/)?sleep (\d+(?:\.\d+)?)", " ".join(cmd))
            if m:
                self.gone.wait(min(float(m.group(1)), left()))
            else:
                self.check(c, {"exec": hook["exec"], "timeoutSeconds": left()})
        elif hook and "httpGet" in hook:
            self.check(c, {"httpGet": hook["httpGet"], "timeoutSeconds": left()}, hook=True)
        if not c.proc:
            return
        kill_group(c.proc.pid, signal.SIGTERM)
        while c.proc.poll() is None and time.monotonic() < deadline and not self.gone.is_set():
            time.sleep(0.1)
        kill_group(c.proc.pid, signal.SIGKILL)
        c.proc.wait()

    def stop_all(self, deadline: float) -> None:
        for c in self.init + self.containers:
            if c.proc:
                self.stop_container(c, deadline, pre_stop=False)
                self.exited(c, c.proc.returncode, time.monotonic())

    # -- status -------------------------------------------------------------------------
    def condition(self, kind: str, ok: bool) -> dict:
        status = "True" if ok else "False"
        if self.conditions.get(kind, (None,))[0] != status:
            self.conditions[kind] = (status, now_iso())
        return {"type": kind, "status": status, "lastTransitionTime": self.conditions[kind][1]}

    def finished(self, c: Container, init: bool) -> bool:
        """Exited and will not be restarted."""
        return bool(c.terminated) and not c.proc and not self.should_restart(c, init)

    def push_status(self) -> None:
        """PATCH the pod's status when it differs from the last one sent."""
        ok = lambda c: c.terminated["exitCode"] == 0  # noqa: E731
        initialized = all(self.finished(c, True) and ok(c) for c in self.init)
        failed_init = any(self.finished(c, True) and not ok(c) for c in self.init)
        done = [c for c in self.containers if self.finished(c, False)]
        if failed_init or len(done) == len(self.containers):
            phase = "Failed" if failed_init or not all(ok(c) for c in done) else "Succeeded"
        elif initialized and any(c.proc or c.terminated for c in self.containers):
            phase = "Running"
        else:
            phase = "Pending"
        ready = initialized and all(c.ready for c in self.containers)
        status = {"phase": phase, "hostIP": self.agent.node_ip, "podIP": self.ip,
                  "podIPs": [{"ip": self.ip}], "startTime": self.start_time,
                  "conditions": [self.condition("PodScheduled", True),
                                 self.condition("Initialized", initialized),
                                 self.condition("ContainersReady", ready),
                                 self.condition("Ready", ready)],
                  "containerStatuses": [c.status() for c in self.containers],
                  "initContainerStatuses": [c.status() for c in self.init]}
        if status != self.pushed:
            try:
                self.agent.core.patch_namespaced_pod_status(self.name, self.ns, {"status": status})
                self.pushed = status
            except ApiException as exc:
                if exc.status != 404:
                    raise
                self.gone.set()


class Agent:
    """The Node, its heartbeat, the pod watch, PVC provisioning and the log endpoint."""

    def __init__(self, args: argparse.Namespace):
        config.load_kube_config(args.kubeconfig)
        self.api = client.ApiClient()
        self.core, self.args = client.CoreV1Api(self.api), args
        self.node, self.node_ip = args.node_name, "127.0.0.1"
        self.work, self.pv_root = Path(args.work_dir).resolve(), Path(args.pv_root).resolve()
        self.kubeconfig = yaml.safe_load(Path(args.kubeconfig).read_text())
        net = ipaddress.ip_network(args.pod_cidr)
        self.route = None if net.is_loopback else args.pod_cidr
        if net.is_loopback:
            net = ipaddress.ip_network(f"127.0.{random.randint(1, 250)}.0/24")
        hosts = range(10, min(net.num_addresses - 1, 255))
        self.ips = deque(str(net.network_address + i) for i in hosts)  # free pod IPs, oldest first
        self.workers: dict[str, PodWorker] = {}
        self.stopping, self.t0 = threading.Event(), now_iso()

    def data_of(self, kind: str, ns: str, name: str, optional: bool) -> dict[str, bytes]:
        """A ConfigMap's or Secret's data as bytes per key ({} when optional and missing)."""
        read = (self.core.read_namespaced_config_map if kind == "configMap"
                else self.core.read_namespaced_secret)
        try:
            obj = json.loads(read(name, ns, _preload_content=False).data)
        except ApiException as exc:
            if exc.status == 404 and optional:
                return {}
            raise
        text = {} if kind == "secret" else obj.get("data") or {}
        binary = obj.get("data" if kind == "secret" else "binaryData") or {}
        return {**{k: v.encode() for k, v in text.items()},
                **{k: base64.b64decode(v) for k, v in binary.items()}}

    def pod_kubeconfig(self, pod_dir: Path, token: str) -> Path:
        """A kubeconfig for the pod's ServiceAccount token (same server and CA as ours)."""
        kc = dict(self.kubeconfig, users=[{"name": "pod", "user": {"token": token.strip()}}])
        kc["contexts"] = [{"name": "pod", "context": {"cluster": kc["clusters"][0]["name"],
                                                      "user": "pod"}}]
        kc["current-context"] = "pod"
        path = pod_dir / "kubeconfig"
        path.write_text(yaml.safe_dump(kc))
        return path

    # -- node -----------------------------------------------------------------------------
    def node_status(self) -> dict:
        """Capacity (cpu cores, memory KiB, pods; --capacity overrides), conditions, info."""
        meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        capacity = {"cpu": str(os.cpu_count()), "pods": "110", "ephemeral-storage": "100Gi",
                    "memory": f"{int(meminfo['MemTotal'].split()[0])}Ki",
                    **dict(c.split("=", 1) for c in self.args.capacity)}
        conditions = [(f"{k}Pressure", "False", f"KubeletHasSufficient{k}")
                      for k in ("Memory", "Disk", "PID")] + [("Ready", "True", "KubeletReady")]
        return {
            "capacity": capacity, "allocatable": capacity,
            "conditions": [{"type": k, "status": s, "reason": r, "message": "sluice node agent",
                            "lastHeartbeatTime": now_iso(), "lastTransitionTime": self.t0}
                           for k, s, r in conditions],
            "addresses": [{"type": "InternalIP", "address": self.node_ip},
                          {"type": "Hostname", "address": self.node}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.args.kubelet_port}},
            "nodeInfo": {"kubeletVersion": "v1.20.2", "kubeProxyVersion": "v1.20.2",
                         "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "sluice-node-agent://0",
                         "osImage": "local processes", "kernelVersion": os.uname().release,
                         "machineID": "", "systemUUID": "", "bootID": ""}}

    def register(self) -> None:
        """Create (or adopt) the Node, untainted, and the default StorageClass `standard`."""
        labels = {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", "type": "sluice-node-agent"}
        try:
            self.core.create_node({"metadata": {"name": self.node, "labels": labels},
                                   "status": self.node_status()})
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_node(self.node, {"metadata": {"labels": labels},
                                             "spec": {"taints": None}})
        self.core.patch_node_status(self.node, {"status": self.node_status()})
        default = {"storageclass.kubernetes.io/is-default-class": "true"}
        sc = {"metadata": {"name": "standard", "annotations": default}, "provisioner": PROVISIONER,
              "reclaimPolicy": "Delete", "volumeBindingMode": "Immediate"}
        try:
            client.StorageV1Api(self.api).create_storage_class(sc)
        except ApiException as exc:
            if exc.status != 409:
                raise

    def housekeeping(self) -> None:
        """Every 2 s: provision PVCs; every HEARTBEAT_S: node status and Lease."""
        leases, last_beat = client.CoordinationV1Api(self.api), 0.0
        while not self.stopping.wait(2.0):
            try:
                self.provision()
                if time.monotonic() - last_beat < HEARTBEAT_S:
                    continue
                self.core.patch_node_status(self.node, {"status": self.node_status()})
                renew = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                lease = {"metadata": {"name": self.node}, "spec": {
                    "holderIdentity": self.node, "leaseDurationSeconds": 40, "renewTime": renew}}
                try:
                    leases.patch_namespaced_lease(self.node, "kube-node-lease", lease)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    leases.create_namespaced_lease("kube-node-lease", lease)
                last_beat = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the apiserver may blip; retry next round
                log.warning("housekeeping: %s", exc)

    def provision(self) -> None:
        """Bind unbound `standard` PVCs to hostPath PVs at PV_ROOT/CLAIM; drop Released PVs."""
        def items(lister) -> list[dict]:
            return json.loads(lister(_preload_content=False, _request_timeout=10).data)["items"]

        for pvc in items(self.core.list_persistent_volume_claim_for_all_namespaces):
            md, spec = pvc["metadata"], pvc["spec"]
            if spec.get("volumeName") or spec.get("storageClassName") != "standard":
                continue
            path = self.pv_root / md["name"]
            path.mkdir(parents=True, exist_ok=True)
            claim = {"namespace": md["namespace"], "name": md["name"], "uid": md["uid"]}
            pv = {"metadata": {"name": f"pvc-{md['uid']}",
                               "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER}},
                  "spec": {"capacity": {"storage": spec["resources"]["requests"]["storage"]},
                           "accessModes": spec["accessModes"], "storageClassName": "standard",
                           "persistentVolumeReclaimPolicy": "Delete",
                           "hostPath": {"path": str(path)}, "claimRef": claim}}
            try:
                self.core.create_persistent_volume(pv)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        for pv in items(self.core.list_persistent_volume):
            annotations = pv["metadata"].get("annotations", {})
            if (annotations.get("pv.kubernetes.io/provisioned-by") == PROVISIONER
                    and pv.get("status", {}).get("phase") == "Released"):
                self.core.delete_persistent_volume(pv["metadata"]["name"])

    # -- pods -----------------------------------------------------------------------------
    def seen(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if worker:
            worker.update(pod)
        elif (pod.get("status", {}).get("phase") not in ("Succeeded", "Failed")
              or pod["metadata"].get("deletionTimestamp")):  # finished before an agent restart
            worker = PodWorker(self, pod)
            worker.start()
            self.workers[uid] = worker

    def forget(self, uid: str) -> None:
        worker = self.workers.pop(uid, None)
        if worker:
            worker.gone.set()
            worker.wake.set()

    def watch_pods(self) -> None:
        """List, then watch from that resourceVersion (60 s server timeout); relist on any end."""
        selector, delay = f"spec.nodeName={self.node}", 1.0
        while not self.stopping.is_set():
            try:
                listing = json.loads(self.core.list_pod_for_all_namespaces(
                    field_selector=selector, _preload_content=False, _request_timeout=30).data)
                pods = {p["metadata"]["uid"]: p for p in listing["items"]}
                for uid in set(self.workers) - set(pods):
                    self.forget(uid)
                for pod in pods.values():
                    self.seen(pod)
                events = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces, field_selector=selector,
                    resource_version=listing["metadata"]["resourceVersion"],
                    timeout_seconds=60, _request_timeout=90)
                for ev in events:
                    if self.stopping.is_set() or ev["type"] == "ERROR":
                        break
                    if ev["type"] == "DELETED":
                        self.forget(ev["raw_object"]["metadata"]["uid"])
                    else:
                        self.seen(ev["raw_object"])
                delay = 1.0
            except Exception as exc:  # noqa: BLE001 - reconnect with backoff
                log.warning("pod watch: %s; relisting in %.0f s", exc, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, 30.0)

    def pod_log(self, ns: str, name: str, container: str) -> Path | None:
        for w in list(self.workers.values()):
            if (w.ns, w.name) == (ns, name):
                return w.dir / f"{container or w.containers[0].name}.log"
        return None

    def serve_logs(self) -> None:
        """`kubectl logs` support: the kubelet's GET /containerLogs/NS/POD/CONTAINER over TLS."""
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                url = urllib.parse.urlparse(self.path)
                parts, query = url.path.strip("/").split("/"), urllib.parse.parse_qs(url.query)
                path = None
                if parts[0] == "containerLogs" and len(parts) >= 3:
                    path = agent.pod_log(*(parts[1:] + [""])[:3])
                if not path or not path.exists():
                    return self.send_error(404)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                lines = path.read_bytes().splitlines(keepends=True)
                tail = int(query.get("tailLines", ["0"])[0])
                self.wfile.write(b"".join(lines[-tail:] if tail else lines))

            def log_message(self, *a):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.args.kubelet_port), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(f"{self.args.pki}/kubelet.crt", f"{self.args.pki}/kubelet.key")
        ctx.load_verify_locations(f"{self.args.pki}/ca.crt")
        ctx.verify_mode = ssl.CERT_REQUIRED
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        server.serve_forever()

    def run(self) -> None:
        if self.route:
            subprocess.run(["ip", "route", "add", "local", self.route, "dev", "lo"], check=True)
        try:
            self.register()
            threads = [threading.Thread(target=self.housekeeping, daemon=True),
                       threading.Thread(target=self.watch_pods, daemon=True)]
            if self.args.kubelet_port and self.args.pki:
                threads.append(threading.Thread(target=self.serve_logs, daemon=True))
            for t in threads:
                t.start()
            log.info("node %s ready; pod CIDR %s", self.node, self.args.pod_cidr)
            while not self.stopping.wait(1.0):
                pass
            log.info("stopping %d pods", len(self.workers))
            workers = list(self.workers.values())
            for uid in list(self.workers):
                self.forget(uid)
            for worker in workers:
                worker.join(timeout=10)
        finally:
            if self.route:
                subprocess.run(["ip", "route", "del", "local", self.route, "dev", "lo"],
                               check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description="Play the kubelet for one Node with local processes.")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--node-name", default="sluice-local")
    ap.add_argument("--work-dir", required=True, help="pod directories and logs go under WORK/pods")
    ap.add_argument("--pv-root", required=True, help="claim CLAIM lives in PV_ROOT/CLAIM")
    ap.add_argument("--pod-cidr", default="127.0.0.0/8",
                    help="pod addresses: a /24 made local via lo (root), or loopback")
    ap.add_argument("--capacity", action="append", default=[], metavar="KEY=VALUE",
                    help="override or add Node capacity, e.g. nvidia.com/gpu=2")
    ap.add_argument("--kubelet-port", type=int, default=0,
                    help="TLS port for `kubectl logs` (0: off)")
    ap.add_argument("--pki", help="directory with ca.crt, kubelet.crt, kubelet.key")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    agent = Agent(args)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stopping.set())
    agent.run()


if __name__ == "__main__":
    main()
