"""Pure builders: an InferenceService → the worker Deployment and Service it should have.

Nothing here talks to Kubernetes. ``desired_objects(body, config)`` is the reconcile
function; the controller server-side-applies what it returns. Children get deterministic
names (``NAME-worker``, the name the router's discovery joins on), app.kubernetes.io
labels, and a controller ownerReference, so garbage collection deletes them with their
InferenceService and a restarted operator adopts instead of duplicating them.

Worker pod, for ``sluice://NAME`` (the model store)::

    initContainer fetch-model: sluice models fetch NAME     (SLUICE_HOME on the model cache;
                                                             also one per store draft model)
    container worker:          sluice worker --model NAME ... --host $(POD_IP) --port 8000
      readiness GET /health (503 while loading, draining, or the engine is dead or
      stalled), liveness GET /livez (503 only for a dead or stalled engine),
      preStop GET drain?wait=drainSeconds (leave readiness, finish in-flight requests),
      termination grace covering that drain, non-root, read-only root filesystem, /tmp
      an emptyDir
    PodDisruptionBudget NAME-worker: maxUnavailable 1 (a node drain evicts one at a time)

``pvc://CLAIM/path`` mounts the claim read-only at /models/CLAIM; ``file:///path`` passes the
path as is (it must exist in the image or on the node).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.api.names import (API_VERSION, GROUP, KIND, MANAGED_BY, MANAGED_BY_LABEL,
                              NAME_LABEL, WORKER_APP, WORKER_PORT_NAME, WORKER_SUFFIX)
from sluice.api.service import InferenceService, parse_manifest
from sluice.api.worker_args import worker_arguments

FIELD_MANAGER = "sluice-operator"

INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"

WORKER_PORT = 8000
WORKER_UID = 1000  # the images' non-root user
CACHE_MOUNT = "/var/lib/sluice"  # SLUICE_HOME for emptyDir and PVC model caches
PVC_SOURCE_ROOT = "/models"
TERMINATION_GRACE_SECONDS = 60  # the least a worker pod gets
PRESTOP_SLEEP_SECONDS = 5  # the least a worker keeps serving after its deletion starts
SHUTDOWN_MARGIN_SECONDS = 30  # after the preStop drain: uvicorn's close, the engine's exit
DRAINING_ANNOTATION = f"{GROUP}/draining"  # on a pod the operator drains before a scale-down
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"  # 1.21+; 1.20 ignores
DEFAULT_WORKER_IMAGE = "sluice:0.1.0"
PDB_API_VERSION = "policy/v1"  # policy/v1beta1 on Kubernetes 1.20 (kube.Kube asks)
MODEL_CACHE_DEFAULT = "emptyDir"

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class InvalidSpec(ValueError):
    """The InferenceService cannot be served as written; the message says why (one line per
    problem). Becomes the InvalidSpec condition, never a retry."""


@dataclass(frozen=True)
class ModelCache:
    """Where ``sluice://`` models are stored in the pod (``$SLUICE_HOME``).

    Attributes:
        kind: ``emptyDir`` (per pod; fetched by the init container on each start),
            ``hostPath`` (shared by the pods of a node; mounted at the same path),
            ``pvc`` (a shared claim, mounted at /var/lib/sluice), or ``image`` (baked into the
            worker image: no volume, no fetch, the image's own ``$SLUICE_HOME``).
        location: the host path (hostPath) or the claim name (pvc); empty otherwise.
    """

    kind: str = "emptyDir"
    location: str = ""

    @classmethod
    def parse(cls, text: str) -> ModelCache:
        """``emptyDir`` | ``image`` | ``hostPath:/abs/path`` | ``pvc:CLAIM``.

        Raises:
            ValueError: anything else.
        """
        kind, _, location = text.partition(":")
        if kind in ("emptyDir", "image") and not location:
            return cls(kind)
        if kind == "hostPath" and location.startswith("/"):
            return cls(kind, location.rstrip("/") or "/")
        if kind == "pvc" and location:
            return cls(kind, location)
        raise ValueError(f"model cache {text!r}: expected emptyDir, image, hostPath:/abs/path "
                         "or pvc:CLAIM")

    @property
    def mount_path(self) -> str | None:
        if self.kind == "image":
            return None
        return self.location if self.kind == "hostPath" else CACHE_MOUNT

    def volume(self) -> dict[str, Any] | None:
        source: dict[str, Any]
        if self.kind == "emptyDir":
            source = {"emptyDir": {}}
        elif self.kind == "hostPath":
            source = {"hostPath": {"path": self.location, "type": "DirectoryOrCreate"}}
        elif self.kind == "pvc":
            source = {"persistentVolumeClaim": {"claimName": self.location}}
        else:
            return None
        return {"name": "model-cache", **source}

    def __str__(self) -> str:
        return f"{self.kind}:{self.location}" if self.location else self.kind


@dataclass(frozen=True)
class OperatorConfig:
    """What the operator's flags decide about every worker pod.

    Attributes:
        worker_image: image of native-engine workers (and of the fetch init container).
        vllm_worker_image: image of ``engine: vllm`` workers; None: ``worker_image``.
        model_cache: see ``ModelCache``.
        worker_command: the executable that takes ``--log-level LEVEL worker ...``.
        worker_log_level: the workers' ``--log-level``.
        image_pull_policy: of every container.
        pdb_api_version: of the workers' PodDisruptionBudget (what the API server serves).
    """

    worker_image: str = DEFAULT_WORKER_IMAGE
    vllm_worker_image: str | None = None
    model_cache: ModelCache = field(default_factory=ModelCache)
    worker_command: tuple[str, ...] = ("sluice",)
    worker_log_level: str = "INFO"
    image_pull_policy: str = "IfNotPresent"
    pdb_api_version: str = PDB_API_VERSION

    def image_for(self, engine: str) -> str:
        return (self.vllm_worker_image or self.worker_image) if engine == "vllm" \
            else self.worker_image


# ------------------------------------------------------------------ names and labels

def is_cascade(body: Mapping[str, Any]) -> bool:
    """The InferenceService as JSON has a ``spec.cascade``: it runs no workers."""
    return (body.get("spec") or {}).get("cascade") is not None


def worker_name(service_name: str) -> str:
    """Name of the worker Deployment and Service (the router joins on it)."""
    return service_name + WORKER_SUFFIX


def usable_name(service_name: str) -> bool:
    """Whether ``service_name`` can name its children: ``NAME-worker`` a DNS-1035 label (a
    Service name) of at most 63 characters, so ``NAME`` is also a valid label value."""
    name = worker_name(service_name)
    return len(name) <= 63 and _DNS_1035.match(name) is not None


def selector_labels(service_name: str) -> dict[str, str]:
    """The worker pods' selector (immutable once a Deployment exists)."""
    return {NAME_LABEL: WORKER_APP, INSTANCE_LABEL: service_name}


def labels(service_name: str) -> dict[str, str]:
    return {**selector_labels(service_name), COMPONENT_LABEL: "worker",
            MANAGED_BY_LABEL: MANAGED_BY, PART_OF_LABEL: "sluice"}


def selector_string(service_name: str) -> str:
    """``selector_labels`` as a label-selector string (status.selector, for the scale
    subresource and HPA)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(service_name).items()))


def endpoint_url(service_name: str, namespace: str) -> str:
    return f"http://{worker_name(service_name)}.{namespace}.svc:{WORKER_PORT}"


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _metadata(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {"name": worker_name(meta["name"]), "namespace": meta["namespace"],
            "labels": labels(meta["name"]), "ownerReferences": [owner_reference(body)]}


# ------------------------------------------------------------------ validation

def parse_service(body: Mapping[str, Any]) -> InferenceService:
    """Validate an InferenceService object as the operator sees it (status is ignored).

    Raises:
        InvalidSpec: what the CRD schema cannot catch: pydantic's cross-field checks
            (minReplicas > maxReplicas, ...), an unknown ``sluice://`` model, a name too long
            or not usable as a Service name.
    """
    meta = body.get("metadata") or {}
    data = {"apiVersion": body.get("apiVersion", API_VERSION), "kind": body.get("kind", KIND),
            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
            "spec": _plain(body.get("spec") or {})}
    try:
        service = parse_manifest(data, source=f"{meta.get('namespace')}/{meta.get('name')}")
    except ValueError as exc:  # "SOURCE: invalid InferenceService:\n  path: message ..."
        details = str(exc).partition("invalid InferenceService:")[2]
        problems = [line.strip().replace("Value error, ", "") for line in details.splitlines()]
        raise InvalidSpec("; ".join(p for p in problems if p) or str(exc)) from None
    if not usable_name(service.metadata.name):
        name = worker_name(service.metadata.name)
        raise InvalidSpec(f"metadata.name {service.metadata.name!r}: the worker Service "
                          f"{name!r} must be a DNS-1035 label (start with a letter, at most "
                          f"{63 - len(WORKER_SUFFIX)} characters before {WORKER_SUFFIX!r})")
    model = service.spec.model
    if model.source_scheme == "sluice":
        from sluice.models import store

        try:
            store.get_spec(model.source_location)
        except store.ModelStoreError as exc:
            raise InvalidSpec(f"spec.model.source {model.source!r}: {exc}") from None
    return service


def _plain(value: Any) -> Any:
    """Plain dicts and lists (kopf hands out read-only mapping views)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# ------------------------------------------------------------------ the pod

@dataclass
class _Model:
    """How the pod gets its model(s): the --model value and what it needs mounted."""

    arg: str
    env: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    fetch: list[str] = field(default_factory=list)  # store names the init containers fetch


def _model(service: InferenceService, cache: ModelCache) -> _Model:
    from sluice.models import store

    model = service.spec.model
    location = model.source_location
    if model.source_scheme == "file":
        out = _Model(location)
    elif model.source_scheme == "pvc":
        claim, _, path = location.strip("/").partition("/")
        root = f"{PVC_SOURCE_ROOT}/{claim}"
        out = _Model(f"{root}/{path.strip('/')}",
                     volumes=[{"name": "model-source", "persistentVolumeClaim":
                               {"claimName": claim, "readOnly": True}}],
                     mounts=[{"name": "model-source", "mountPath": root, "readOnly": True}])
    else:
        out = _Model(store.get_spec(location).name)  # canonical spelling
        out.fetch.append(out.arg)
    draft = _draft_store_model(service)
    if draft is not None:
        out.fetch.append(draft)
    volume, mount_path = cache.volume(), cache.mount_path
    if not out.fetch or volume is None or mount_path is None:  # no store model, or baked in
        out.fetch = []
        return out
    out.env.append({"name": "SLUICE_HOME", "value": mount_path})
    if cache.kind in ("hostPath", "pvc"):  # shared: the native kernels are built once, not
        out.env.append({"name": "TORCH_EXTENSIONS_DIR",  # in each pod's /tmp at its start
                        "value": f"{mount_path}/torch_extensions"})
    out.volumes.append(volume)
    out.mounts.append({"name": "model-cache", "mountPath": mount_path})
    return out


def _draft_store_model(service: InferenceService) -> str | None:
    """The speculative draft model's store name, when it is one (else it is a folder)."""
    from sluice.models import store

    speculative = service.spec.engine.native.speculative
    draft = getattr(speculative, "model", None)
    if not draft or draft.strip().lower() not in store.REGISTRY:
        return None
    return store.get_spec(draft).name


def _resources(service: InferenceService) -> dict[str, Any]:
    wanted = service.spec.resources
    amounts = {"cpu": wanted.cpu, "memory": wanted.memory}
    if wanted.gpu:
        amounts["nvidia.com/gpu"] = str(wanted.gpu)
    amounts = {k: v for k, v in amounts.items() if v is not None}
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _thread_env(service: InferenceService) -> list[dict[str, str]]:
    """OMP_NUM_THREADS = the CPU limit rounded down (at least 1), when one is set.

    torch sizes its thread pool from the node's cores, not the container's CPU quota: a
    2-CPU pod on a 64-core node would run 64 OpenMP threads, and a team that loses cores
    to CFS throttling waits at every barrier (decode steps many times slower).
    """
    cpu = service.spec.resources.cpu
    if cpu is None:
        return []
    from kubernetes.utils import parse_quantity

    return [{"name": "OMP_NUM_THREADS", "value": str(max(1, int(parse_quantity(cpu))))}]


_CONTAINER_SECURITY = {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                       "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def build_pod_template(service: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """The worker pod template, with its spec-hash annotation.

    Raises:
        ValueError: the spec asks for something ``sluice worker`` has no flag for.
    """
    name = service.metadata.name
    engine = service.spec.engine.name
    image = config.image_for(engine)
    model = _model(service, config.model_cache)
    resources = _resources(service)
    base_env = [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
                *_thread_env(service), *model.env]
    tmp = {"name": "tmp", "mountPath": "/tmp"}
    worker_args = worker_arguments(service, model.arg)
    command, *prefix = config.worker_command
    container = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": [command],
        "args": [*prefix, "--log-level", config.worker_log_level, "worker", *worker_args,
                 "--host", "$(POD_IP)", "--port", str(WORKER_PORT)],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                *base_env],
        "ports": [{"name": WORKER_PORT_NAME, "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": WORKER_PORT},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
        # /livez answers 200 while the model loads and while draining (when /health is 503):
        # only a wedged process or a dead or stalled engine loop fails it. Generous, since
        # loading takes tens of seconds.
        "livenessProbe": {"httpGet": {"path": "/livez", "port": WORKER_PORT},
                          "initialDelaySeconds": 60, "periodSeconds": 20, "timeoutSeconds": 10,
                          "failureThreshold": 6},
        "lifecycle": {"preStop": {"httpGet": {"path": _drain_hook_path(service),
                                              "port": WORKER_PORT}}},
        "resources": resources,
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
        "volumeMounts": [tmp, *model.mounts],
    }
    volumes = [{"name": "tmp", "emptyDir": {}}, *model.volumes]
    if engine == "vllm":  # vLLM's worker processes share tensors through /dev/shm
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(service),
        "securityContext": {"runAsNonRoot": True, "runAsUser": WORKER_UID,
                            "runAsGroup": WORKER_UID, "fsGroup": WORKER_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if model.fetch:  # one init container per store model, main model first
        pod["initContainers"] = _cache_owner(config.model_cache, image, config) + [{
            "name": "fetch-model" if i == 0 else f"fetch-model-{i}",
            "image": image,
            "imagePullPolicy": config.image_pull_policy,
            "command": [command],
            "args": [*prefix, "--log-level", config.worker_log_level, "models", "fetch", name_],
            "env": base_env,
            "resources": copy.deepcopy(resources),
            "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
            "volumeMounts": [tmp, *model.mounts],
        } for i, name_ in enumerate(model.fetch)]
    if service.spec.resources.gpu:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                               "effect": "NoSchedule"}]
    template = copy.deepcopy({"metadata": {"labels": labels(name)}, "spec": pod})  # no aliases
    template["metadata"]["annotations"] = {SPEC_HASH_ANNOTATION: spec_hash(template)}
    return template


def _cache_owner(cache: ModelCache, image: str, config: OperatorConfig) -> list[dict[str, Any]]:
    """For a hostPath cache, an init container that gives the cache folder to the workers'
    non-root user before they fetch into it: the kubelet creates a missing hostPath folder
    owned by root (mode 0755), and fsGroup does not apply to hostPath volumes. It runs as
    root with only CAP_CHOWN, and changes the folder itself, not its contents (what the
    workers write there is theirs already). A namespace that enforces the ``restricted``
    Pod Security Standard refuses it: use a pvc or image cache there."""
    if cache.kind != "hostPath":
        return []
    return [{
        "name": "cache-owner",
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["chown", f"{WORKER_UID}:{WORKER_UID}", cache.location],
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False,
                            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}},
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                      "limits": {"cpu": "100m", "memory": "64Mi"}},
        "volumeMounts": [{"name": "model-cache", "mountPath": cache.location}],
    }]


def drain_seconds(service: InferenceService) -> int:
    """Seconds a worker leaving (scale-down, rollout, eviction) may take to finish its
    in-flight requests: ``spec.autoscaling.drainSeconds``, rounded up."""
    return math.ceil(service.spec.autoscaling.drain_seconds)


def termination_grace_seconds(service: InferenceService) -> int:
    """The pod's grace: the preStop drain, then uvicorn's close and the engine's exit."""
    return max(TERMINATION_GRACE_SECONDS, drain_seconds(service) + SHUTDOWN_MARGIN_SECONDS)


def _drain_hook_path(service: InferenceService) -> str:
    """The preStop hook's path: the worker leaves readiness (``/health`` 503), keeps serving
    what arrives for at least PRESTOP_SLEEP_SECONDS (routers and Endpoints catch up), and
    answers once nothing runs or waits, or after drainSeconds; SIGTERM follows.

    No leading slash: kubelets before 1.23 build a hook's URL as ``http://HOST:PORT/`` +
    path (a leading slash would make ``//drain``); newer ones add the slash themselves.
    """
    return f"drain?wait={drain_seconds(service)}&min={PRESTOP_SLEEP_SECONDS}"


def spec_hash(template: Mapping[str, Any]) -> str:
    """A short digest of a pod template (without its own hash annotation): it changes exactly
    when the pods must be replaced, so replicas-only and SLO-only edits do not roll."""
    template = copy.deepcopy(dict(template))
    meta = template.get("metadata") or {}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k != SPEC_HASH_ANNOTATION}
    meta.pop("annotations", None)
    if annotations:
        meta["annotations"] = annotations
    text = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------ the children

def build_deployment(body: Mapping[str, Any], service: InferenceService,
                     config: OperatorConfig) -> dict[str, Any]:
    """The worker Deployment: ``spec.replicas`` pods of ``build_pod_template``.

    A rollout surges one pod and may take down half the old ones, rounded down: a single
    replica is never taken down before its successor is ready (the rollout waits for room),
    and two or more roll even on a cluster with no spare accelerator. The Deployment
    controller applies the percentage to the current replicas, so scaling needs no change.
    """
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(body),
        "spec": {
            "replicas": service.spec.replicas,
            "selector": {"matchLabels": selector_labels(service.metadata.name)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "50%"}},
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": 600,
            "template": build_pod_template(service, config),
        },
    }


def build_service(body: Mapping[str, Any], service: InferenceService) -> dict[str, Any]:
    """The worker Service (ClusterIP, port ``http`` 8000); its Endpoints list ready pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(body),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(service.metadata.name),
            "ports": [{"name": WORKER_PORT_NAME, "port": WORKER_PORT,
                       "targetPort": WORKER_PORT, "protocol": "TCP"}],
        },
    }


def build_pdb(body: Mapping[str, Any], service: InferenceService,
              api_version: str = PDB_API_VERSION) -> dict[str, Any]:
    """The workers' PodDisruptionBudget: voluntary evictions (``kubectl drain``, node
    upgrades) take one worker at a time, each draining through its preStop hook, instead of
    every worker of the model at once. ``maxUnavailable`` rather than ``minAvailable``, so a
    single replica can still be evicted (its successor starts elsewhere).

    Args:
        api_version: ``policy/v1`` (Kubernetes 1.21+) or ``policy/v1beta1`` (1.20, and
            the only one there); the operator asks the API server which it serves.
    """
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(body),
        "spec": {"maxUnavailable": 1,
                 "selector": {"matchLabels": selector_labels(service.metadata.name)}},
    }


def desired_objects(body: Mapping[str, Any], config: OperatorConfig) -> list[dict[str, Any]]:
    """The reconcile function: an InferenceService object → its children: Service,
    PodDisruptionBudget, Deployment; none for a cascade (its tiers run the workers).

    Raises:
        InvalidSpec: see ``parse_service``; also a spec ``sluice worker`` cannot run.
    """
    service = parse_service(body)
    if service.spec.cascade is not None:
        return []
    try:
        deployment = build_deployment(body, service, config)
    except ValueError as exc:
        raise InvalidSpec(str(exc)) from None
    return [build_service(body, service), build_pdb(body, service, config.pdb_api_version),
            deployment]
