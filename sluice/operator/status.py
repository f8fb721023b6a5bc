"""Pure status: what exists (Deployment, Pods, Endpoints, one /health probe) → the
InferenceService's status and its three conditions (``compute_status``); for a cascade,
its tiers' InferenceServices → its status (``compute_cascade_status``).

    Ready        True when at least one replica is ready, the worker Service lists a ready
                 address, and that address answers /health (when the operator probes).
    Progressing  True while the Deployment rolls out or scales (not all replicas updated,
                 available and ready); False with ProgressDeadlineExceeded when it is stuck.
    Degraded     True with a pod's reason: Unschedulable (the scheduler's message, e.g.
                 ``0/1 nodes are available: 1 Insufficient nvidia.com/gpu.``),
                 ImagePullBackOff, CrashLoopBackOff, ... or InvalidSpec.
    Autoscaling  only while spec.autoscaling.enabled: True (the operator writes
                 spec.replicas within the bounds), naming the objective it scales for,
                 which with no spec.slo is the router's default TTFT objective.
    Conflict     only while another, older InferenceService of the namespace declares the
                 same spec.model.name (``served_name_owners``): True, ServedNameInUse,
                 naming it; Ready is then False (ServedNameConflict): the router sends
                 this one no traffic, and its autoscaler does not scale it.

A cascade (``spec.cascade``) runs no workers: replicas 0, no selector or endpoint, and

    Ready        True, CascadeServing, when every tier InferenceService is Ready; else
                 False, TiersNotReady, naming the tiers that are not (and their reasons);
                 False, InvalidSpec when a tier cannot serve (``resolve_cascades``: an
                 unknown name, a cascade, a tier serving the cascade's own name), the
                 message naming the field, e.g. ``spec.cascade.tiers[1]: no
                 InferenceService 'x' in this namespace``. Tiers are looked up again at
                 every refresh, so one created later makes the cascade valid.
    Progressing  always False (NoWorkers, or InvalidSpec): no rollout of its own.
    Degraded     True only with InvalidSpec.
    Conflict     as above, when an older InferenceService serves the cascade's name.

The autoscaler's fields (desiredReplicas, lastScaleTime, lastScaleReason, sloAttainment) are
written by sluice.operator.autoscaler; a refresh keeps them as they are, except that with
autoscaling off desiredReplicas is spec.replicas and sloAttainment is dropped.

``lastTransitionTime`` only moves when a condition's status changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.api.service import CascadeSpec, Condition, InferenceServiceStatus, served_model
from sluice.cascade.tiers import resolve_cascades
from sluice.api.names import WORKER_PORT_NAME
from sluice.operator.resources import endpoint_url, selector_string

READY, PROGRESSING, DEGRADED, AUTOSCALING = "Ready", "Progressing", "Degraded", "Autoscaling"
CONFLICT = "Conflict"
# The router's --slo-ttft-ms default (sluice.router.dispatch.DispatchSettings.slo_ttft_ms):
# the objective of a model whose InferenceService sets no spec.slo.
ROUTER_DEFAULT_TTFT_MS = 2000

# Container waiting reasons that mean "this will not fix itself soon".
PROBLEM_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                   "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
                   "ErrImageNeverPull")


@dataclass(frozen=True)
class Probe:
    """One GET of a ready worker address's /health.

    Attributes:
        url: what was requested.
        ok: it answered 200.
        detail: the status code or the error, for the condition message.
    """

    url: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


def ready_addresses(endpoints: Mapping[str, Any] | None) -> list[str]:
    """``ip:port`` of each ready address of the worker Service's Endpoints (port ``http``)."""
    out = []
    for subset in (endpoints or {}).get("subsets") or ():
        ports = subset.get("ports") or ()
        port = next((p.get("port") for p in ports if p.get("name") == WORKER_PORT_NAME),
                    ports[0].get("port") if len(ports) == 1 else None)
        if port is None:
            continue
        for address in subset.get("addresses") or ():
            ip = address.get("ip")
            if ip:
                out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return sorted(out)


def pod_problem(pod: Mapping[str, Any]) -> Problem | None:
    """Why this pod cannot serve, if the reason is one that needs a person: unschedulable,
    image pull failures, crash loops (also of the fetch-model init container), failure."""
    status = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name", "?")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None  # leaving anyway
    for cond in status.get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return Problem("Unschedulable", f"pod {name}: {cond.get('message', 'unschedulable')}")
    for key, kind in (("initContainerStatuses", "init container"),
                      ("containerStatuses", "container")):
        for cs in status.get(key) or ():
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in PROBLEM_REASONS:
                message = "; ".join(m for m in (waiting.get("message"), _last_exit(cs)) if m)
                message = message or reason
                return Problem(reason, f"pod {name}: {kind} {cs.get('name')}: {message}")
    if status.get("phase") == "Failed":
        reason = status.get("reason") or "PodFailed"
        return Problem(reason, f"pod {name}: {status.get('message') or 'failed'}")
    return None


def _last_exit(cs: Mapping[str, Any]) -> str:
    last = (cs.get("lastState") or {}).get("terminated") or {}
    if not last:
        return ""
    return (f"restarted {cs.get('restartCount', 0)} time(s); last exit code "
            f"{last.get('exitCode')} ({last.get('reason') or 'Error'})")


def _deployment_problem(deployment: Mapping[str, Any] | None) -> Problem | None:
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return Problem(cond.get("reason") or "ReplicaFailure", cond.get("message", ""))
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Problem("ProgressDeadlineExceeded", cond.get("message", ""))
    return None


def compute_status(body: Mapping[str, Any], deployment: Mapping[str, Any] | None,
                   pods: list[Mapping[str, Any]], endpoints: Mapping[str, Any] | None,
                   probe: Probe | None, now: str, invalid: str | None = None,
                   observed: int | None = None,
                   conflict: str | None = None) -> InferenceServiceStatus:
    """The status to write.

    Args:
        body: the InferenceService (metadata.generation, spec.replicas, the current status).
        deployment: the worker Deployment, or None if it does not exist (yet).
        pods: the worker pods (any order).
        endpoints: the worker Service's Endpoints, or None.
        probe: the /health probe of one ready address; None when not probed (no ready
            address, or probing is off).
        now: RFC 3339 timestamp for conditions that change now.
        invalid: the InvalidSpec message, when the spec cannot be served.
        observed: the metadata.generation the operator last reconciled; None: unknown (after
            a restart, until it reconciles again), and the current status' value is kept.
        conflict: the name of the older InferenceService that serves this one's model name,
            when there is one (``served_name_owners``).
    """
    meta = body.get("metadata") or {}
    name, namespace = meta.get("name", ""), meta.get("namespace", "")
    desired = int((body.get("spec") or {}).get("replicas", 1))
    dstatus = (deployment or {}).get("status") or {}
    replicas, ready = int(dstatus.get("replicas") or 0), int(dstatus.get("readyReplicas") or 0)
    addresses = ready_addresses(endpoints)
    problem = Problem("InvalidSpec", invalid) if invalid else _first_problem(deployment, pods)
    conditions = [
        _ready(desired, ready, addresses, probe, problem, deployment is not None),
        _progressing(desired, deployment, problem),
        (DEGRADED, "True", problem.reason, problem.message) if problem
        else (DEGRADED, "False", "AsExpected", "no worker pod reports a problem"),
    ]
    spec = body.get("spec") or {}
    autoscaled = (spec.get("autoscaling") or {}).get("enabled") is True
    if autoscaled:
        conditions.append(_autoscaling(spec, invalid))
    if conflict is not None and not invalid:
        _add_conflict(conditions, spec, conflict)
    before = _previous(body)
    generation, stamped = _stamped(before, conditions, now, observed)
    return InferenceServiceStatus(
        observed_generation=generation, replicas=replicas, ready_replicas=ready,
        selector=selector_string(name), endpoint=endpoint_url(name, namespace),
        conditions=stamped,
        desired_replicas=(before.desired_replicas if autoscaled and
                          before.desired_replicas is not None else desired),
        last_scale_time=before.last_scale_time, last_scale_reason=before.last_scale_reason,
        slo_attainment=before.slo_attainment if autoscaled else None)


def compute_cascade_status(body: Mapping[str, Any], neighbours: list[Mapping[str, Any]],
                           now: str, invalid: str | None = None, observed: int | None = None,
                           conflict: str | None = None) -> InferenceServiceStatus:
    """The status of a cascade (an InferenceService with ``spec.cascade``; no workers).

    Args:
        body: the cascade, as JSON.
        neighbours: the InferenceServices of its namespace as JSON, with their status: which
            tiers exist, what they serve, whether they are Ready (``body`` itself may be
            among them).
        now, observed, conflict: as ``compute_status``.
        invalid: the InvalidSpec message of a spec that does not validate; None: the tiers
            are checked (``cascade_problem``).
    """
    spec = body.get("spec") or {}
    problem = invalid or cascade_problem(body, neighbours)
    if problem:
        conditions = [(READY, "False", "InvalidSpec", problem),
                      (PROGRESSING, "False", "InvalidSpec", problem),
                      (DEGRADED, "True", "InvalidSpec", problem)]
    else:
        tiers = list((spec.get("cascade") or {}).get("tiers") or ())
        waiting = tiers_not_ready(tiers, neighbours)
        ready = ((READY, "False", "TiersNotReady", "tiers not ready: " + "; ".join(waiting))
                 if waiting else (READY, "True", "CascadeServing",
                                  f"every tier is ready: {', '.join(tiers)}"))
        conditions = [ready,
                      (PROGRESSING, "False", "NoWorkers", "a cascade runs no workers of its "
                       "own; its tiers do"),
                      (DEGRADED, "False", "AsExpected", "every tier resolves to a served model")]
    if conflict is not None and not problem:
        _add_conflict(conditions, spec, conflict)
    generation, stamped = _stamped(_previous(body), conditions, now, observed)
    return InferenceServiceStatus(
        observed_generation=generation, replicas=0, ready_replicas=0, desired_replicas=0,
        conditions=stamped)


def _stamped(before: InferenceServiceStatus, conditions: list[tuple[str, str, str, str]],
             now: str, observed: int | None) -> tuple[int | None, list[Condition]]:
    """(the observed generation: ``observed``, else the current status' own; the
    conditions with their generation and transition times, ``_condition``)."""
    previous = {c.type: c for c in before.conditions}
    generation = observed if observed is not None else before.observed_generation
    return generation, [_condition(previous, *c, generation=generation, now=now)
                        for c in conditions]


def cascade_problem(body: Mapping[str, Any], neighbours: list[Mapping[str, Any]]) -> str | None:
    """Why a cascade's tiers cannot be served (``resolve_cascades``' message, naming the
    field), or None. ``body``'s ``spec.cascade`` must validate (``parse_service``)."""
    name = (body.get("metadata") or {}).get("name", "")
    services = {(b.get("metadata") or {}).get("name", ""): (served_model(b), _cascade_of(b))
                for b in neighbours}
    own = CascadeSpec.model_validate((body.get("spec") or {})["cascade"])
    services[name] = (served_model(body), own)
    return resolve_cascades(services)[1].get(name)


def _cascade_of(body: Mapping[str, Any]) -> CascadeSpec | None:
    """A neighbour's ``spec.cascade``; one that does not validate still marks it a cascade
    (with no tiers of its own to check here: its own status says what is wrong)."""
    raw = (body.get("spec") or {}).get("cascade")
    if raw is None:
        return None
    try:
        return CascadeSpec.model_validate(raw)
    except ValueError:
        return CascadeSpec.model_construct(tiers=[])


def tiers_not_ready(tiers: list[str], neighbours: list[Mapping[str, Any]]) -> list[str]:
    """Each tier whose InferenceService is not Ready, with its Ready reason, in tier order
    (e.g. ``qwen-coder (NoReplicasReady)``)."""
    ready: dict[str, Mapping[str, Any]] = {}
    for b in neighbours:
        for condition in (b.get("status") or {}).get("conditions") or ():
            if condition.get("type") == READY:
                ready[(b.get("metadata") or {}).get("name", "")] = condition
    waiting = []
    for tier in tiers:
        condition = ready.get(tier)
        if condition is None:
            waiting.append(f"{tier} (no status yet)")
        elif condition.get("status") != "True":
            waiting.append(f"{tier} ({condition.get('reason') or 'Ready=False'})")
    return waiting


def _add_conflict(conditions: list[tuple[str, str, str, str]], spec: Mapping[str, Any],
                  conflict: str) -> None:
    """Ready=False and Conflict=True: an older InferenceService serves this one's name."""
    model = (spec.get("model") or {}).get("name")
    message = (f"spec.model.name {model!r} is already served by InferenceService "
               f"{conflict!r} (the older; of two created in the same second, the first by "
               "name): this one gets no traffic until that one is deleted or renames its "
               "model")
    conditions[0] = (READY, "False", "ServedNameConflict", message)
    conditions.append((CONFLICT, "True", "ServedNameInUse", message))


def objective(spec: Mapping[str, Any]) -> str:
    """The SLO the autoscaler scales for, in words (the router measures attainment against
    the same objectives)."""
    slo = spec.get("slo") or {}
    percentile = f"p{float(slo.get('percentile') or 95):g}"
    parts = [f"{label} <= {slo[key]:g} ms" for key, label in (("ttftMs", "TTFT"),
                                                               ("itlMs", "ITL"))
             if isinstance(slo.get(key), int | float)]
    if parts:
        return f"{' and '.join(parts)} at {percentile}"
    return (f"TTFT <= {ROUTER_DEFAULT_TTFT_MS} ms at {percentile}: spec.slo sets no objective, "
            f"so the router's default applies (its --slo-ttft-ms, {ROUTER_DEFAULT_TTFT_MS} ms "
            "unless changed)")


def _autoscaling(spec: Mapping[str, Any], invalid: str | None) -> tuple[str, str, str, str]:
    if invalid:
        return AUTOSCALING, "False", "InvalidSpec", invalid
    low, high = spec.get("minReplicas", 1), spec.get("maxReplicas")
    return (AUTOSCALING, "True", "Enabled",
            f"the operator sets spec.replicas within [{low}, {high}] from the routers' demand "
            f"(kubectl scale is overwritten); objective: {objective(spec)}")


def _first_problem(deployment: Mapping[str, Any] | None,
                   pods: list[Mapping[str, Any]]) -> Problem | None:
    found = [p for p in (pod_problem(pod) for pod in sorted(
        pods, key=lambda p: (p.get("metadata") or {}).get("name", ""))) if p]
    if not found:
        return _deployment_problem(deployment)
    if len(found) > 1:
        return Problem(found[0].reason, f"{found[0].message} (and {len(found) - 1} more "
                       "pod(s) with problems)")
    return found[0]


def _ready(desired: int, ready: int, addresses: list[str], probe: Probe | None,
           problem: Problem | None, exists: bool) -> tuple[str, str, str, str]:
    counts = f"{ready}/{desired} replicas ready"
    if problem and problem.reason == "InvalidSpec":
        return READY, "False", "InvalidSpec", problem.message
    if desired == 0 and ready == 0:
        return READY, "False", "ScaledToZero", "spec.replicas is 0"
    if ready < 1:
        if problem:
            return READY, "False", problem.reason, f"{counts}; {problem.message}"
        return READY, "False", "NoReplicasReady" if exists else "Creating", counts
    if not addresses:
        return READY, "False", "EndpointsNotReady", f"{counts}; the worker Service lists no " \
            "ready address yet"
    if probe is not None and not probe.ok:
        return READY, "False", "EndpointNotAnswering", f"{counts}; GET {probe.url}: " \
            f"{probe.detail}"
    checked = f"; {probe.url} answered" if probe is not None else ""
    return READY, "True", "Serving", f"{counts}{checked}"


def _progressing(desired: int, deployment: Mapping[str, Any] | None,
                 problem: Problem | None) -> tuple[str, str, str, str]:
    if problem and problem.reason in ("InvalidSpec", "ProgressDeadlineExceeded"):
        return PROGRESSING, "False", problem.reason, problem.message
    if deployment is None:
        return PROGRESSING, "True", "Creating", "creating the worker Deployment"
    meta, status = deployment.get("metadata") or {}, deployment.get("status") or {}
    if (status.get("observedGeneration") or 0) < (meta.get("generation") or 0):
        return PROGRESSING, "True", "RolloutStarting", "the Deployment controller has not " \
            "seen the latest worker spec yet"
    replicas = int(status.get("replicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    if updated < desired or replicas > updated:
        return PROGRESSING, "True", "RollingUpdate", f"{updated}/{desired} replicas updated, " \
            f"{replicas} exist"
    if ready != desired or replicas != desired:
        verb = "ScalingUp" if ready < desired else "ScalingDown"
        return PROGRESSING, "True", verb, f"{ready}/{desired} replicas ready, {replicas} exist"
    return PROGRESSING, "False", "Complete", f"{desired} replica(s) updated and ready"


def _previous(body: Mapping[str, Any]) -> InferenceServiceStatus:
    """The current status (empty when it does not validate)."""
    try:
        return InferenceServiceStatus.model_validate(body.get("status") or {})
    except ValueError:
        return InferenceServiceStatus()


def _condition(previous: dict[str, Condition], type_: str, status: str, reason: str,
               message: str, generation: int | None, now: str) -> Condition:
    before = previous.get(type_)
    since = before.last_transition_time if before and before.status == status else None
    return Condition(type=type_, status=status, reason=reason, message=message,
                     last_transition_time=since or now, observed_generation=generation)


def status_patch(status: InferenceServiceStatus,
                 current: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON merge patch (RFC 7396) the status subresource gets: camelCase, unset fields
    left out, and set to null (removed) where ``current``, the status as it is, has them
    (``endpoint`` of a worker InferenceService turned cascade, ``sloAttainment`` with
    autoscaling turned off)."""
    patch = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    for key in current or ():
        if key not in patch and key in _STATUS_KEYS:
            patch[key] = None
    return patch


_STATUS_KEYS = frozenset(f.alias or n for n, f in InferenceServiceStatus.model_fields.items())


def same_status(current: Mapping[str, Any] | None, new: InferenceServiceStatus) -> bool:
    """Whether writing ``new`` would change nothing (so no write, and no watch event)."""
    try:
        old = InferenceServiceStatus.model_validate(current or {})
    except ValueError:
        return False
    return status_patch(old) == status_patch(new)
