"""The InferenceService manifest (``serving.sluice.dev/v1alpha1``), as pydantic models.

This is the one definition of the resource: ``sluice up`` reads it, the operator reconciles
it, and the CRD's OpenAPI schema is generated from it, so every field carries a description.
Field names are camelCase in YAML (aliases); Python code may use either spelling. Spec
models forbid unknown fields, so a typo is an error that names the field, not a silent
default.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

SOURCE_SCHEMES = ("sluice", "file", "pvc")
MAX_REPLICAS = 10_000  # bounds on counts, so a typo cannot ask for a million pods
# The CRD's check of model.source (what ``ModelSpec._check_source`` accepts, in RE2 syntax, so
# the API server rejects a bad source at apply time; tests/test_crd.py checks they agree).
SOURCE_PATTERN = r"^(sluice://.+|file:///.*|pvc:///*[^/]+/.*[^/]/*)$"

RoutingStrategy = Literal["slo", "least-load", "prefix", "round-robin"]
EngineName = Literal["native", "vllm"]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _quantity(value: Any) -> Any:
    """Kubernetes quantities may be written as numbers in YAML (``cpu: 2``); keep them as
    the strings Kubernetes uses (``"2"``)."""
    if isinstance(value, bool):
        return value  # let validation reject it
    return str(value) if isinstance(value, int | float) else value


# A non-negative Kubernetes quantity (``2``, ``500m``, ``4Gi``, ``1e3``): what the API server
# would accept in a container's resources; checked here so a bad one fails at apply time.
QUANTITY_PATTERN = (r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)"
                    r"([KMGTPE]i|[numkMGTPE]|[eE][+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))?$")
Quantity = Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN),  # checked after
                     BeforeValidator(_quantity)]                         # numbers → strings
_INT_OR_STRING = {"x-kubernetes-int-or-string": True}


class _Spec(BaseModel):
    """Base of every spec model: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ModelSpec(_Spec):
    """Which model to serve, and under which name."""

    name: str = Field(min_length=1, pattern=r"^\S(.*\S)?$",
                      description="Served model name: the `model` clients put in requests.")
    source: str | None = Field(None, description="Where the weights come from: `sluice://NAME` "
                               "(the Sluice model store, fetched on first use), `file:///abs/path` "
                               "(a converted model folder) or `pvc://CLAIM/path` (a folder on a "
                               "PersistentVolumeClaim). Required, except on a cascade (none).",
                               json_schema_extra={"pattern": SOURCE_PATTERN})
    tokenizer: str | None = Field(None, description="Tokenizer folder or store name, when it "
                                  "is not stored with the weights (empty: the same as unset).")

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _empty_tokenizer_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @model_validator(mode="after")
    def _check_source(self) -> ModelSpec:
        if self.source is None:  # only a cascade has none (InferenceServiceSpec checks)
            return self
        scheme, _, rest = self.source.partition("://")
        if scheme not in SOURCE_SCHEMES or not rest:
            raise ValueError(f"source {self.source!r} must be sluice://NAME, file:///path or "
                             "pvc://claim/path")
        if scheme == "file" and not rest.startswith("/"):
            raise ValueError(f"source {self.source!r}: file:// needs an absolute path "
                             "(file:///abs/path)")
        if scheme == "pvc" and "/" not in rest.strip("/"):
            raise ValueError(f"source {self.source!r}: pvc:// needs a claim and a path "
                             "(pvc://claim/path)")
        return self

    @property
    def source_scheme(self) -> str:
        """``sluice``, ``file`` or ``pvc`` (empty on a cascade)."""
        return (self.source or "").partition("://")[0]

    @property
    def source_location(self) -> str:
        """The part after ``scheme://``: a store name, an absolute path, or ``claim/path``."""
        return (self.source or "").partition("://")[2]


class SpeculativeSpec(_Spec):
    """Speculative decoding: a proposer drafts tokens, the model verifies them in one pass."""

    method: Literal["ngram", "draft"] = Field("ngram", description="`ngram`: prompt lookup "
                                              "(no draft model); `draft`: a smaller draft model "
                                              "with the same tokenizer (`model`).")
    num_tokens: int = Field(4, ge=1, le=16, description="Draft tokens verified per step.")
    model: str | None = Field(None, min_length=1, description="Draft model for method `draft`: "
                              "a model-store name (e.g. Qwen2.5-Coder-0.5B-Instruct) or a folder.")
    quantization: Literal["int8", "int4"] | None = Field(
        None, description="`int8` or `int4` weights for the draft model (as the engine's).")

    @model_validator(mode="after")
    def _check_draft(self) -> SpeculativeSpec:
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("speculative.model is needed by, and only by, method: draft")
        return self


class NativeEngineOptions(_Spec):
    """Options of Sluice's own paged-attention engine. Unset fields use the engine's
    defaults (see ``sluice worker --help``)."""

    kv_cache_gib: float | None = Field(None, alias="kvCacheGiB", gt=0, le=4096,
                                       description="Memory for the paged KV cache, GiB.")
    block_size: int | None = Field(None, ge=1, le=1024, description="Tokens per KV-cache block.")
    max_num_seqs: int | None = Field(None, ge=1, le=65536, description="Most sequences in one batch.")
    max_num_batched_tokens: int | None = Field(None, ge=1, le=2**20, description="Token budget per "
                                               "engine step (prefill and decode tokens).")
    max_model_len: int | None = Field(None, ge=1, le=2**20, description="Context length in tokens "
                                      "(prompt + output); unset: the model's, capped.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse the KV blocks of "
                                               "shared prompt prefixes across requests.")
    quantization: Literal["int8", "int4"] | None = Field(
        None, description="`int8`: per-channel int8 weight-only linear layers; `int4`: the "
        "decoder layers' linears in 4-bit blocks of 32 weights with a scale and a minimum "
        "each (llama.cpp's Q4_1), the lm_head int8.")
    speculative: SpeculativeSpec | None = Field(None, description="Speculative decoding; "
                                                "unset: off.")


class EngineSpec(_Spec):
    """Which engine runs the model."""

    name: EngineName = Field("native", description="`native` (Sluice's engine) or `vllm`.")
    native: NativeEngineOptions = Field(default_factory=NativeEngineOptions,
                                        description="Options of the native engine.")
    tensor_parallel_size: int = Field(1, ge=1, le=1, description="Devices one replica is sharded "
                                      "over: 1 (neither engine shards a replica yet, so the "
                                      "API server refuses more at apply time).")


class ResourcesSpec(_Spec):
    """Resources of one replica (Kubernetes quantities; requests = limits)."""

    cpu: Quantity | None = Field(None, description="CPU, e.g. `2` or `500m`.",
                                 json_schema_extra=_INT_OR_STRING)
    memory: Quantity | None = Field(None, description="Memory, e.g. `4Gi`.",
                                    json_schema_extra=_INT_OR_STRING)
    gpu: int | None = Field(None, alias="nvidia.com/gpu", ge=0, le=64, description="NVIDIA GPUs.")

    def cpu_threads(self) -> int | None:
        """Threads one replica may run (OMP_NUM_THREADS): ``cpu`` rounded down, at least 1;
        None when ``cpu`` is unset. torch otherwise sizes its pool from the machine's cores,
        and replicas sharing them oversubscribe every core."""
        if self.cpu is None:
            return None
        from kubernetes.utils import parse_quantity

        return max(1, int(parse_quantity(self.cpu)))


class SLOSpec(_Spec):
    """Latency objectives the autoscaler and the router aim for."""

    ttft_ms: float | None = Field(None, gt=0, le=3_600_000, description="Time to first token, milliseconds.")
    itl_ms: float | None = Field(None, gt=0, le=3_600_000, description="Inter-token latency, milliseconds.")
    percentile: float = Field(95.0, gt=0, le=100, description="Percentile the objectives "
                              "apply to, e.g. 95 for p95.")


class AutoscalingSpec(_Spec):
    """How `spec.replicas` is driven. When disabled, `kubectl scale`, an HPA or KEDA may drive
    it through the scale subresource instead."""

    enabled: bool = Field(False, description="Let Sluice's autoscaler set spec.replicas.")
    scale_to_zero: bool = Field(False, description="Allow 0 replicas when idle (requires "
                                "minReplicas: 0).")
    scale_up_stabilization_seconds: float = Field(0.0, ge=0, le=3600, description="Seconds a higher "
                                                  "recommendation must persist before scaling up.")
    scale_down_stabilization_seconds: float = Field(300.0, ge=0, le=3600, description="Seconds a lower "
                                                    "recommendation must persist before scaling down.")
    idle_seconds: float = Field(300.0, ge=0, le=86400, description="With scaleToZero: seconds without "
                                "any request before going to 0 replicas.")
    capacity_rps: float | None = Field(None, alias="capacityRPS", gt=0, le=1e6, description="Requests "
                                       "per second one replica serves within the SLO at its "
                                       "percentile (`sluice profile` measures it); corrected "
                                       "online from observed attainment. Unset: 1.")
    boot_seconds: float = Field(30.0, ge=0, le=3600, description="Seconds from asking for a replica to "
                                "its readiness: the arrival forecast's horizon.")
    hold_seconds: float = Field(60.0, gt=0, le=3600, description="Seconds the router holds a request "
                                "while no replica is ready (scale from zero) before answering "
                                "503 with Retry-After.")
    drain_seconds: float = Field(120.0, gt=0, le=3600, description="Seconds a replica being removed may "
                                 "take to finish its in-flight requests after it leaves "
                                 "routing (the pod's termination grace covers it).")


class RoutingSpec(_Spec):
    """How the router spreads requests over replicas. A field left unset is the router's
    own flag (``--policy``, the chart's ``router.policy``; ``--load-factor``), whose
    defaults are ``slo`` and 1.25: the CRD defaults neither, so the router can tell."""

    strategy: RoutingStrategy | None = Field(
        None, description="`slo`: the replica predicted to meet the TTFT objective "
        "(`slo.ttftMs`), packing requests that share a prompt prefix where it is cached; "
        "`least-load`: fewest in-flight requests; `prefix`: consistent hashing with bounded "
        "load on the prompt's first characters; `round-robin`: each replica in turn. Unset: "
        "the router's `--policy` (default `slo`).")
    load_factor: float | None = Field(None, ge=1.0, le=100, description="`prefix`: no replica "
                                      "takes more than this times the average in-flight load. "
                                      "Unset: the router's `--load-factor` (default 1.25).")


class CascadeEscalationSpec(_Spec):
    """When a tier's answer goes up to the next tier."""

    signal: Literal["logprob-quantile", "min-logprob", "mean-logprob", "checks"] = Field(
        "logprob-quantile", description="The answer's score, from its token log probabilities "
        "(requested from the tier whatever the client asked): `logprob-quantile` (a low "
        "quantile: the mean is biased by length), `min-logprob` or `mean-logprob`; `checks`: "
        "the quantile, and an answer a check proves wrong escalates at any threshold (code "
        "that fails the examples its prompt writes down, run by the router in a sandbox with "
        "no network and a timeout; arithmetic steps that do not add up). It judges whole "
        "answers: `streaming.mode` must be `buffer`.")
    quantile: float = Field(0.1, gt=0, lt=1, description="`logprob-quantile`: which quantile.")
    threshold: float = Field(ge=-100, le=0, description="Escalate when the score (a log "
                             "probability, <= 0) is below this; `sluice cascade calibrate` "
                             "finds the one that meets a target share of top-tier requests.")


class PromptFeatureWeights(_Spec):
    """Weights of the prompt features (``sluice.cascade.policy.prompt_features``)."""

    log_chars: float = Field(0.0, description="ln(1 + characters of the prompt).")
    log_numbers: float = Field(0.0, description="ln(1 + numbers in the prompt).")
    code: float = Field(0.0, description="1 when the prompt holds code (a def, a fence, ...).")
    math: float = Field(0.0, description="Arithmetic operators and number words, per 100 "
                        "characters.")
    question: float = Field(0.0, description="1 when the prompt asks a question.")
    log_lines: float = Field(0.0, description="ln(1 + lines of the prompt).")


class CascadePreRouteSpec(_Spec):
    """A logistic model on cheap prompt features that sends a prompt it predicts hard
    straight to the top tier (``sluice cascade calibrate`` fits it)."""

    weights: PromptFeatureWeights = Field(description="Each feature's weight.")
    bias: float = Field(0.0, description="The logistic model's intercept.")
    threshold: float = Field(0.5, gt=0, lt=1, description="Go straight to the top tier when "
                             "the predicted probability that the first tier fails is above "
                             "this.")


class CascadeStreamingSpec(_Spec):
    """How a streamed request is answered while the first tier's answer is judged."""

    mode: Literal["buffer", "prefix"] = Field("buffer", description="`buffer`: hold the whole "
                                              "first answer until it is judged, then stream it "
                                              "or the next tier's; `prefix`: judge the first "
                                              "`prefixTokens` tokens, then stream on.")
    prefix_tokens: int = Field(16, ge=1, le=4096, description="`prefix`: tokens judged.")


class CascadeSpec(_Spec):
    """Serve from a small model first and escalate to bigger ones when it is unsure. An
    InferenceService with a cascade runs no workers of its own: clients send its
    ``spec.model.name``, which has no ``source``, and its tiers answer."""

    tiers: list[str] = Field(min_length=2, max_length=8, description="InferenceService names "
                             "of this namespace, smallest first; the last tier always answers.")
    costs: list[float] | None = Field(None, description="Each tier's relative cost per token, "
                                      "for the metrics and reports (default: 1, 2, 4, ...).")
    escalation: CascadeEscalationSpec = Field(description="When to go up a tier.")
    pre_route: CascadePreRouteSpec | None = Field(None, description="Optional: skip to the top "
                                                  "tier for prompts predicted hard.")
    streaming: CascadeStreamingSpec = Field(default_factory=CascadeStreamingSpec,
                                            description="Streamed requests.")

    @model_validator(mode="after")
    def _check_tiers(self) -> CascadeSpec:
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers {self.tiers} name one InferenceService twice")
        if self.costs is not None and (len(self.costs) != len(self.tiers)
                                       or any(not c > 0 for c in self.costs)):
            raise ValueError("costs must give one positive number per tier")
        if self.escalation.signal == "checks" and self.streaming.mode == "prefix":
            raise ValueError("escalation.signal checks judges whole answers (it runs their "
                             "code): streaming.mode must be buffer, not prefix")
        return self

    def tier_costs(self) -> list[float]:
        """``costs``, or 1, 2, 4, ... when unset."""
        return list(self.costs) if self.costs else [2.0 ** i for i in range(len(self.tiers))]


class InferenceServiceSpec(_Spec):
    """Desired state of an InferenceService."""

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="The engine.")
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description="Worker replicas (the scale subresource's "
                          "field; the autoscaler writes it when enabled).")
    min_replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description="Fewest replicas the autoscaler may set.")
    max_replicas: int | None = Field(None, ge=1, le=MAX_REPLICAS, description="Most replicas the autoscaler "
                                     "may set; unset: no more than `replicas`.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec,
                                     description="Resources of one replica.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="Latency objectives.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec,
                                         description="Autoscaling.")
    routing: RoutingSpec = Field(default_factory=RoutingSpec, description="Routing.")
    cascade: CascadeSpec | None = Field(None, description="Optional model cascade.")

    @model_validator(mode="after")
    def _check_bounds(self) -> InferenceServiceSpec:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas ({self.min_replicas}) must be <= maxReplicas "
                             f"({self.max_replicas})")
        if self.autoscaling.scale_to_zero and self.min_replicas != 0:
            raise ValueError("autoscaling.scaleToZero needs minReplicas: 0")
        if self.autoscaling.enabled and self.min_replicas == 0 \
                and not self.autoscaling.scale_to_zero:
            raise ValueError("spec.minReplicas 0 needs spec.autoscaling.scaleToZero: true "
                             "(or set minReplicas to 1 or more)")
        if self.autoscaling.enabled and self.max_replicas is None:
            raise ValueError("spec.maxReplicas is required with spec.autoscaling.enabled "
                             "(unset, the maximum would be replicas, which the autoscaler "
                             "writes)")
        if self.cascade is None and self.model.source is None:
            raise ValueError("model.source is required (only a cascade has none)")
        if self.cascade is not None and self.model.source is not None:
            raise ValueError("a cascade serves from its tiers: model.source must be omitted")
        if self.cascade is not None and self.autoscaling.enabled:
            raise ValueError("spec.autoscaling.enabled: a cascade runs no workers of its own "
                             "(autoscale its tiers)")
        return self


ConditionStatus = Literal["True", "False", "Unknown"]


class _Status(BaseModel):
    """Base of the status models: camelCase aliases; unknown keys ignored (status is written
    by the operator, and a newer one may add fields)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(_Status):
    """One observation about the service, in Kubernetes' condition conventions."""

    type: str = Field(min_length=1, description="`Ready`, `Progressing`, `Degraded` or "
                      "`Autoscaling`.")
    status: ConditionStatus = Field(description="`True`, `False` or `Unknown`.")
    reason: str = Field("", description="CamelCase reason for the last transition, e.g. "
                        "`MinimumReplicasAvailable`, `Unschedulable`, `InvalidSpec`.")
    message: str = Field("", description="Human-readable details.")
    last_transition_time: str | None = Field(None, description="When the status last changed "
                                             "(RFC 3339).",
                                             json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(None, ge=0, description="metadata.generation the "
                                            "condition was computed from.")


class InferenceServiceStatus(_Status):
    """Observed state of an InferenceService, written by the operator."""

    observed_generation: int | None = Field(None, ge=0, description="The last "
                                            "metadata.generation the operator acted on.")
    replicas: int = Field(0, ge=0, description="Worker pods that exist (the scale "
                          "subresource's status replicas).")
    ready_replicas: int = Field(0, ge=0, description="Worker pods that are ready.")
    selector: str | None = Field(None, description="Label selector of the worker pods, as a "
                                 "string (the scale subresource's selector, used by HPA).")
    endpoint: str | None = Field(None, description="URL of the worker Service, e.g. "
                                 "`http://NAME-worker.NAMESPACE.svc:8000`.")
    conditions: list[Condition] = Field(default_factory=list, description="`Ready`, "
                                        "`Progressing` and `Degraded`; `Autoscaling` while "
                                        "spec.autoscaling.enabled.")
    desired_replicas: int | None = Field(None, ge=0, description="Replicas wanted: the "
                                         "autoscaler's latest decision while "
                                         "spec.autoscaling.enabled, else spec.replicas.")
    last_scale_time: str | None = Field(None, description="When the autoscaler last changed "
                                        "spec.replicas (RFC 3339).",
                                        json_schema_extra={"format": "date-time"})
    last_scale_reason: str | None = Field(None, description="Why, with the figures it used "
                                          "(`burst`, `forecast`, `slo-miss`, `consolidate`, "
                                          "`idle`, `wake`, `bounds`, `override`, ...).")
    slo_attainment: float | None = Field(None, ge=0, le=1, description="Fraction of the "
                                         "requests of the last minute that met the SLO (the "
                                         "worse of TTFT and ITL), as the routers measured "
                                         "them; kept through a minute without requests; "
                                         "unset with autoscaling off.")

    def condition(self, type_: str) -> Condition | None:
        """The condition of this type, or None."""
        return next((c for c in self.conditions if c.type == type_), None)


class ObjectMeta(BaseModel):
    """The part of Kubernetes metadata Sluice reads; other keys (uid, labels, ...) are kept."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(max_length=63, pattern=_DNS_LABEL.pattern,
                      description="DNS-1123 label: lowercase letters, digits and '-'.")
    namespace: str | None = Field(None, description="Kubernetes namespace.")


class InferenceService(BaseModel):
    """An InferenceService manifest: ``apiVersion``, ``kind``, ``metadata``, ``spec``."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    api_version: Literal["serving.sluice.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["InferenceService"]
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = Field(None, description="Written by the "
                                                  "operator; ignored on input.")


def served_model(isvc: Mapping[str, Any]) -> str | None:
    """``spec.model.name`` of an InferenceService as JSON, or None when it has none."""
    name = ((isvc.get("spec") or {}).get("model") or {}).get("name")
    return name if isinstance(name, str) and name else None


def served_names(isvcs: list[Mapping[str, Any]]) -> dict[str, tuple[str | None, str]]:
    """InferenceServices as JSON → ``served_name_owners``' input: name → (served model
    name, creationTimestamp)."""
    return {meta["name"]: (served_model(body), str(meta.get("creationTimestamp") or ""))
            for body in isvcs if (meta := body.get("metadata") or {}).get("name")}


def served_name_owners(services: Mapping[str, tuple[str | None, str]]) -> dict[str, str]:
    """Which InferenceService serves each model name, when several of one namespace
    declare it.

    Args:
        services: InferenceService name → (``spec.model.name`` or None,
            ``metadata.creationTimestamp``, RFC 3339, so comparable as text).

    Returns:
        served model name → the one InferenceService that gets its traffic: the oldest,
        ties broken by name. The others get the ``Conflict`` condition from the operator and
        no traffic from the router, so an InferenceService that reuses a served name never
        receives another service's prompts.
    """
    owners: dict[str, tuple[str, str]] = {}
    for name, (model, created) in services.items():
        if model is not None and (model not in owners or (created, name) < owners[model]):
            owners[model] = (created, name)
    return {model: name for model, (_, name) in owners.items()}


def load_manifest(path: str | Path) -> InferenceService:
    """Read and validate a YAML file of one InferenceService.

    Raises:
        ValueError: the file cannot be read, does not hold exactly one YAML mapping, or does
            not validate; the message names the file and each bad field by its YAML path
            (e.g. ``spec.engine.native.kvCacheGiB``), with a suggestion for misspelled keys.
    """
    services = load_manifests(path)
    if len(services) != 1:
        raise ValueError(f"{path}: expected one InferenceService, found {len(services)}")
    return services[0]


def load_manifests(path: str | Path) -> list[InferenceService]:
    """Read and validate a YAML file of one or more InferenceServices (documents separated
    by ``---``; empty documents are skipped), e.g. a cascade and its tiers.

    Raises:
        ValueError: as ``load_manifest``; also two documents with one ``metadata.name``, or
            none at all. A document is named by its position (``FILE#2``) in messages.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read manifest {path}: {exc.strerror or exc}") from exc
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if not documents:
        raise ValueError(f"{path}: no InferenceService in the file")
    services: list[InferenceService] = []
    for i, data in enumerate(documents, 1):
        where = str(path) if len(documents) == 1 else f"{path}#{i}"
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a YAML mapping (an InferenceService), "
                             f"got {type(data).__name__}")
        service = parse_manifest(data, source=where)
        if any(s.metadata.name == service.metadata.name for s in services):
            raise ValueError(f"{where}: a second InferenceService named "
                             f"{service.metadata.name!r}")
        services.append(service)
    return services


def parse_manifest(data: dict[str, Any], source: str = "<manifest>") -> InferenceService:
    """Validate an already-parsed manifest; see ``load_manifest`` for the errors raised."""
    try:
        return InferenceService.model_validate(data)
    except ValidationError as exc:
        lines = [_describe_error(err) for err in exc.errors()]
        raise ValueError(f"{source}: invalid InferenceService:\n  " + "\n  ".join(lines)) from None


def _describe_error(err: dict[str, Any]) -> str:
    loc = [str(part) for part in err["loc"]]
    where = ".".join(loc) or "(top level)"
    message = err["msg"]
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{where}: unknown field{hint} (allowed: {', '.join(allowed)})"
    if err["type"] not in ("missing",) and "input" in err and not isinstance(err["input"], dict):
        message += f" (got {err['input']!r})"
    return f"{where}: {message}"


def _allowed_keys(loc: list[str]) -> list[str]:
    """The YAML keys accepted at ``loc`` (a path of aliases), walking the model classes."""
    model: Any = InferenceService
    for part in loc:
        fields = {(f.alias or name): f for name, f in model.model_fields.items()}
        field = fields.get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return [(f.alias or name) for name, f in model.model_fields.items()]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    candidates = getattr(annotation, "__args__", None) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
