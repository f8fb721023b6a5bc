"""The InferenceService manifest model: defaults, validation messages, and every example."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import get_args

import pytest
import yaml

from sluice.api.names import API_VERSION, KIND
from sluice.api.service import (
    InferenceService,
    RoutingStrategy,
    load_manifest,
    load_manifests,
    parse_manifest,
)
from sluice.cascade.tiers import resolve_cascades
from sluice.router.policy import POLICIES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

MINIMAL = {
    "apiVersion": API_VERSION,
    "kind": KIND,
    "metadata": {"name": "smol"},
    "spec": {"model": {"name": "SmolLM2-135M-Instruct",
                       "source": "sluice://SmolLM2-135M-Instruct"}},
}


def with_spec(**changes) -> dict:
    data = copy.deepcopy(MINIMAL)
    data["spec"].update(changes)
    return data


def error_of(data: dict) -> str:
    with pytest.raises(ValueError) as info:
        parse_manifest(data, source="m.yaml")
    return str(info.value)


def test_an_empty_tokenizer_is_unset():
    """``tokenizer: ""`` (a chart's empty value) means the model's own tokenizer, as unset."""
    service = parse_manifest({**MINIMAL, "spec": {**MINIMAL["spec"], "model": {
        **MINIMAL["spec"]["model"], "tokenizer": ""}}})
    assert service.spec.model.tokenizer is None


def test_minimal_manifest_gets_defaults():
    service = parse_manifest(MINIMAL)
    spec = service.spec
    assert service.metadata.name == "smol"
    assert spec.replicas == 1 and spec.min_replicas == 1 and spec.max_replicas is None
    assert spec.engine.name == "native" and spec.engine.tensor_parallel_size == 1
    assert spec.engine.native.kv_cache_gib is None  # unset: the engine's own default
    assert spec.routing.strategy is None and spec.routing.load_factor is None  # the router's
    assert spec.autoscaling.enabled is False
    assert spec.slo.percentile == 95
    assert spec.cascade is None
    assert spec.model.source_scheme == "sluice"
    assert spec.model.source_location == "SmolLM2-135M-Instruct"


def test_camel_case_aliases_and_python_names_both_work():
    data = with_spec(engine={"native": {"kvCacheGiB": 0.25, "maxNumSeqs": 8}},
                     resources={"cpu": 2, "memory": "4Gi", "nvidia.com/gpu": 1},
                     slo={"ttftMs": 500, "itlMs": 50, "percentile": 99})
    spec = parse_manifest(data).spec
    assert spec.engine.native.kv_cache_gib == 0.25 and spec.engine.native.max_num_seqs == 8
    assert spec.resources.cpu == "2" and spec.resources.gpu == 1  # numbers become quantities
    assert spec.slo.ttft_ms == 500
    dumped = parse_manifest(data).model_dump(by_alias=True, exclude_none=True)
    assert dumped["spec"]["engine"]["native"] == {"kvCacheGiB": 0.25, "maxNumSeqs": 8}
    assert dumped["spec"]["resources"]["nvidia.com/gpu"] == 1
    assert parse_manifest(dumped) == parse_manifest(data)  # round trip


def test_misspelled_field_is_named_with_a_suggestion():
    message = error_of(with_spec(engine={"native": {"kvCacheGb": 1}}))
    assert "m.yaml" in message
    assert "spec.engine.native.kvCacheGb: unknown field" in message
    assert "did you mean 'kvCacheGiB'" in message


def test_unknown_top_level_spec_field():
    message = error_of(with_spec(replica=2))
    assert "spec.replica: unknown field" in message and "'replicas'" in message


@pytest.mark.parametrize("change, field", [
    ({"replicas": -1}, "spec.replicas"),
    ({"minReplicas": 3, "maxReplicas": 2}, "minReplicas (3) must be <= maxReplicas (2)"),
    ({"engine": {"name": "tgi"}}, "spec.engine.name"),
    ({"engine": {"native": {"kvCacheGiB": 0}}}, "spec.engine.native.kvCacheGiB"),
    ({"engine": {"tensorParallelSize": 0}}, "spec.engine.tensorParallelSize"),
    ({"engine": {"tensorParallelSize": 2}}, "spec.engine.tensorParallelSize"),
    ({"slo": {"percentile": 120}}, "spec.slo.percentile"),
    ({"routing": {"strategy": "random"}}, "spec.routing.strategy"),
    ({"cascade": {"tiers": ["only-one"], "escalation": {"threshold": -1}}}, "spec.cascade.tiers"),
    ({"model": {"name": "c"}, "cascade": {"tiers": ["a", "b"], "escalation": {"threshold": -1}},
      "autoscaling": {"enabled": True}, "maxReplicas": 2}, "spec.autoscaling.enabled"),
    ({"autoscaling": {"scaleToZero": True}}, "scaleToZero needs minReplicas: 0"),
    # a break-it pass: sluice up took these and failed later, or ran "autoscaling 1-1"
    ({"minReplicas": 0, "maxReplicas": 2, "autoscaling": {"enabled": True}},
     "spec.minReplicas 0 needs spec.autoscaling.scaleToZero: true"),
    ({"autoscaling": {"enabled": True}}, "spec.maxReplicas is required with spec.autoscaling.enabled"),
    ({"model": {"name": "x", "source": "hf://x"}}, "must be sluice://NAME"),
    ({"model": {"name": "x", "source": "file://relative/dir"}}, "absolute path"),
    ({"model": {"name": " x", "source": "sluice://x"}}, "spec.model.name"),
    ({"model": {"source": "sluice://x"}}, "spec.model.name: Field required"),
])
def test_bad_values_name_the_field(change, field):
    assert field in error_of(with_spec(**change))


def test_bad_kind_metadata_and_api_version():
    data = copy.deepcopy(MINIMAL)
    data["kind"] = "Deployment"
    data["apiVersion"] = "serving.sluice.dev/v9"
    data["metadata"]["name"] = "Not_A_DNS_Label"
    message = error_of(data)
    assert "kind" in message and "apiVersion" in message and "metadata.name" in message


def test_scale_to_zero_with_min_zero_is_valid():
    spec = parse_manifest(with_spec(replicas=0, minReplicas=0, maxReplicas=3,
                                    autoscaling={"enabled": True, "scaleToZero": True})).spec
    assert spec.replicas == 0 and spec.autoscaling.scale_to_zero


def cascade_manifest(**cascade) -> dict:
    data = with_spec(cascade={"tiers": ["small", "big"], "escalation": {"threshold": -1.5},
                              **cascade})
    del data["spec"]["model"]["source"]
    return data


def test_cascade():
    spec = parse_manifest(cascade_manifest(streaming={"mode": "prefix"})).spec
    assert spec.cascade.tiers == ["small", "big"] and spec.cascade.escalation.threshold == -1.5
    assert spec.cascade.escalation.signal == "logprob-quantile"
    assert spec.cascade.escalation.quantile == 0.1
    assert (spec.cascade.streaming.mode, spec.cascade.streaming.prefix_tokens) == ("prefix", 16)
    assert spec.cascade.tier_costs() == [1.0, 2.0] and spec.model.source is None
    checked = parse_manifest(cascade_manifest(escalation={"threshold": -1, "signal": "checks"}))
    assert checked.spec.cascade.escalation.signal == "checks"


@pytest.mark.parametrize(("data", "words"), [
    (cascade_manifest(tiers=["a", "a"]), "name one InferenceService twice"),
    (cascade_manifest(costs=[1.0]), "one positive number per tier"),
    (cascade_manifest(escalation={"threshold": 0.5}), "spec.cascade.escalation.threshold"),
    (cascade_manifest(escalation={}), "spec.cascade.escalation.threshold: Field required"),
    (cascade_manifest(escalation={"threshold": -1, "signal": "checks"},
                      streaming={"mode": "prefix"}),
     "spec.cascade: Value error, escalation.signal checks judges whole answers"),
    (cascade_manifest(escalation={"threshold": -1, "signal": "code"}),
     "spec.cascade.escalation.signal: Input should be"),
    (with_spec(cascade={"tiers": ["a", "b"], "escalation": {"threshold": -1}}),
     "model.source must be omitted"),
    ({**cascade_manifest(), "spec": {k: v for k, v in cascade_manifest()["spec"].items()
                                     if k != "cascade"}}, "model.source is required"),
])
def test_bad_cascades_name_the_field(data, words):
    assert words in error_of(data)


def test_kubernetes_metadata_extras_are_accepted():
    data = copy.deepcopy(MINIMAL)
    data["metadata"].update(namespace="ml", uid="abc", labels={"team": "x"}, generation=3)
    data["status"] = {"readyReplicas": 1}
    service = parse_manifest(data)
    assert service.metadata.namespace == "ml"


def test_load_manifest_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ValueError, match="nope.yaml"):
        load_manifest(missing)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("spec: [unclosed\n")
    with pytest.raises(ValueError, match="bad.yaml: not valid YAML"):
        load_manifest(bad_yaml)
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="list.yaml: expected a YAML mapping"):
        load_manifest(a_list)
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(with_spec(replicaz=2)))
    with pytest.raises(ValueError, match=r"typo.yaml: invalid InferenceService:\n  spec.replicaz"):
        load_manifest(typo)


def test_load_manifests_reads_every_document(tmp_path):
    small, big = with_spec(), with_spec()
    big["metadata"] = {"name": "big"}
    cascade = cascade_manifest()
    cascade["metadata"] = {"name": "coder"}
    path = tmp_path / "cascade.yaml"
    path.write_text(yaml.safe_dump_all([small, None, big, cascade]))
    assert [s.metadata.name for s in load_manifests(path)] == ["smol", "big", "coder"]
    with pytest.raises(ValueError, match="expected one InferenceService, found 3"):
        load_manifest(path)
    path.write_text(yaml.safe_dump_all([small, small]))
    with pytest.raises(ValueError, match="cascade.yaml#2: a second InferenceService named "
                                         "'smol'"):
        load_manifests(path)
    path.write_text(yaml.safe_dump_all([small, {"kind": "InferenceService"}]))
    with pytest.raises(ValueError, match="cascade.yaml#2: invalid InferenceService"):
        load_manifests(path)
    path.write_text("---\n")
    with pytest.raises(ValueError, match="no InferenceService in the file"):
        load_manifests(path)


def test_routing_strategies_match_the_router_registry():
    assert set(get_args(RoutingStrategy)) == set(POLICIES)


def test_json_schema_is_documented():
    """The CRD is generated from this schema: every spec field needs a description."""
    schema = InferenceService.model_json_schema(by_alias=True)
    undocumented = [f"{name}.{prop}" for name, definition in schema["$defs"].items()
                    if name.endswith(("Spec", "Options"))
                    for prop, body in definition.get("properties", {}).items()
                    if "description" not in body]
    assert undocumented == []


def test_there_are_examples():
    assert any(p.name == "smollm2.yaml" for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses(path):
    """Each document parses, and a file's cascades resolve to the file's other services."""
    services = load_manifests(path)
    assert all(service.kind == KIND for service in services)
    served, problems = resolve_cascades({s.metadata.name: (s.spec.model.name, s.spec.cascade)
                                         for s in services})
    assert problems == {}
    assert len(served) == sum(s.spec.cascade is not None for s in services)


def test_cascade_example():
    services = {s.metadata.name: s for s in load_manifests(ROOT / "examples" / "cascade.yaml")}
    assert list(services) == ["smollm2", "qwen-coder", "coder"]
    coder = services["coder"].spec
    assert coder.model.name == "coder" and coder.model.source is None
    assert coder.cascade.tiers == ["smollm2", "qwen-coder"]
    assert (coder.cascade.escalation.signal, coder.cascade.escalation.quantile,
            coder.cascade.escalation.threshold) == ("logprob-quantile", 0.1, -1.0)
    assert coder.cascade.streaming.mode == "buffer"
    for tier, model in (("smollm2", "SmolLM2-135M-Instruct"),
                        ("qwen-coder", "Qwen2.5-Coder-0.5B-Instruct")):
        spec = services[tier].spec
        assert (spec.model.name, spec.model.source) == (model, f"sluice://{model}")
        assert spec.engine.native.kv_cache_gib == 0.25 and spec.resources.cpu == "1"
    served, _ = resolve_cascades({n: (s.spec.model.name, s.spec.cascade)
                                  for n, s in services.items()})
    assert served["coder"].models == ("SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct")


def test_smollm2_example():
    spec = load_manifest(ROOT / "examples" / "smollm2.yaml").spec
    assert spec.model.name == "SmolLM2-135M-Instruct"
    assert spec.model.source == "sluice://SmolLM2-135M-Instruct"
    assert spec.replicas == 2 and spec.engine.name == "native"
    assert spec.engine.native.kv_cache_gib == 0.25
    assert spec.slo.ttft_ms and spec.slo.itl_ms


def test_draft_model_speculation_maps_to_worker_flags():
    from sluice.api.worker_args import worker_arguments

    speculative = {"method": "draft", "numTokens": 3, "model": "Qwen2.5-Coder-0.5B-Instruct",
                   "quantization": "int8"}
    service = parse_manifest(with_spec(engine={"native": {"speculative": speculative}}))
    argv = worker_arguments(service, "Qwen2.5-Coder-1.5B-Instruct")
    i = argv.index("--speculative-method")
    assert argv[i:] == ["--speculative-method", "draft", "--speculative-num-tokens", "3",
                        "--speculative-model", "Qwen2.5-Coder-0.5B-Instruct",
                        "--speculative-quantization", "int8"]
    four_bit = parse_manifest(with_spec(engine={"native": {
        "quantization": "int4", "speculative": {**speculative, "quantization": "int4"}}}))
    argv = worker_arguments(four_bit, "Qwen2.5-Coder-1.5B-Instruct")
    assert argv[argv.index("--quantization") + 1] == "int4"
    assert argv[argv.index("--speculative-quantization") + 1] == "int4"
    assert "spec.engine.native.quantization" in error_of(
        with_spec(engine={"native": {"quantization": "int3"}}))
    assert "speculative.model is needed by, and only by, method: draft" in error_of(
        with_spec(engine={"native": {"speculative": {"method": "draft"}}}))
    assert "speculative.model is needed by, and only by, method: draft" in error_of(
        with_spec(engine={"native": {"speculative": {"method": "ngram", "model": "x"}}}))
