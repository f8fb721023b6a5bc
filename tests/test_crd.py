"""The generated InferenceService CRD: no drift, structural, and in agreement with pydantic."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from sluice.api import crd
from sluice.api.names import API_VERSION, KIND
from sluice.api.service import ModelSpec, parse_manifest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SCHEMA = crd.resource_schema()
SPEC = SCHEMA["properties"]["spec"]
MINIMAL = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "smol"},
           "spec": {"model": {"name": "SmolLM2-135M-Instruct",
                              "source": "sluice://SmolLM2-135M-Instruct"}}}


def errors_of(obj: dict) -> list[jsonschema.ValidationError]:
    """What the API server's schema validation would say (draft 4 semantics: boolean
    exclusiveMinimum; ``nullable`` and ``x-kubernetes-*`` are ignored, as no test sends null)."""
    return list(jsonschema.Draft4Validator(SCHEMA).iter_errors(obj))


# ------------------------------------------------------------------ files

def test_generated_files_are_current():
    assert crd.check() == [], "CRD drifted: run `python -m sluice.api.crd`"
    assert crd.OUTPUTS[0].read_text() == crd.OUTPUTS[1].read_text()


def test_check_reports_a_stale_file_with_a_diff(tmp_path):
    stale = tmp_path / crd.FILE_NAME
    stale.write_text(crd.render().replace("sisvc", "isvc"))
    (diff,) = crd.check((stale,))
    assert "-    - isvc" in diff and "+    - sisvc" in diff
    missing = tmp_path / "missing.yaml"
    (diff,) = crd.check((missing,))
    assert diff.startswith(f"--- {missing} (on disk)") and "+kind: CustomResourceDefinition" in diff


def test_check_exits_one_with_the_diff_when_stale(monkeypatch, capsys):
    monkeypatch.setattr(crd, "render", lambda: "kind: Other\n")
    assert crd.main(["--check"]) == 1
    out = capsys.readouterr()
    assert "+kind: Other" in out.out and "-kind: CustomResourceDefinition" in out.out
    assert "run `python -m sluice.api.crd`" in out.err


def test_check_command_exits_zero_when_current():
    result = subprocess.run([sys.executable, "-m", "sluice.api.crd", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ the CRD object

def test_names_scope_and_version():
    obj = yaml.safe_load(crd.OUTPUTS[0].read_text())
    assert obj["apiVersion"] == "apiextensions.k8s.io/v1"
    assert obj["metadata"]["name"] == "inferenceservices.serving.sluice.dev"
    spec = obj["spec"]
    assert spec["group"] == "serving.sluice.dev" and spec["scope"] == "Namespaced"
    assert spec["names"] == {"kind": "InferenceService", "listKind": "InferenceServiceList",
                             "plural": "inferenceservices", "singular": "inferenceservice",
                             "shortNames": ["sisvc"], "categories": ["sluice"]}
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]


def test_subresources_status_and_scale():
    version = crd.build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {
        "status": {},
        "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                  "labelSelectorPath": ".status.selector"}}


def test_printer_columns():
    columns = {c["name"]: c for c in crd.build_crd()["spec"]["versions"][0]
               ["additionalPrinterColumns"]}
    assert list(columns) == ["Model", "Engine", "Replicas", "Desired", "Ready-Replicas",
                             "TTFT-SLO-ms", "Ready", "Age"]
    assert columns["Desired"] == {"name": "Desired", "type": "integer",
                                  "jsonPath": ".status.desiredReplicas"}
    assert columns["Model"]["jsonPath"] == ".spec.model.name"
    assert columns["Ready-Replicas"]["jsonPath"] == ".status.readyReplicas"
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Age"] == {"name": "Age", "type": "date",
                              "jsonPath": ".metadata.creationTimestamp"}
    for column in columns.values():  # every path exists in the schema (or is metadata)
        path = column["jsonPath"].split("[")[0].strip(".").split(".")
        if path[0] != "metadata":
            node = SCHEMA
            for part in path:
                node = node["properties"][part]


# ------------------------------------------------------------------ structural schema

def _walk(node: dict, path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural():
    nodes = list(_walk(SCHEMA))
    assert len(nodes) > 50
    forbidden = {"$ref", "anyOf", "allOf", "oneOf", "not", "const", "$defs", "title",
                 "x-kubernetes-validations", "additionalProperties"}
    for path, node in nodes:
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not forbidden & set(node), (path, forbidden & set(node))
        if node.get("type") == "object" and path not in ("", ".metadata"):
            assert "properties" in node, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound, True) is True, (path, bound)  # draft 4: a boolean
        if "pattern" in node:  # RE2: no look-around or back-references
            assert not re.search(r"\(\?[=!<]|\\[1-9]", node["pattern"]), path
    assert SCHEMA["properties"]["metadata"] == {"type": "object"}


def test_defaults_validate_against_their_own_schema():
    for path, node in _walk(SCHEMA):
        if "default" in node:
            sub = copy.deepcopy(node)
            assert not list(jsonschema.Draft4Validator(sub).iter_errors(node["default"])), path


def test_optional_fields_are_nullable_not_unions():
    native = SPEC["properties"]["engine"]["properties"]["native"]["properties"]
    assert native["kvCacheGiB"] == {"description": "Memory for the paged KV cache, GiB.",
                                    "type": "number", "minimum": 0, "exclusiveMinimum": True,
                                    "maximum": 4096, "nullable": True}
    assert native["quantization"]["enum"] == ["int8", "int4"] and native["quantization"]["nullable"]
    cpu = SPEC["properties"]["resources"]["properties"]["cpu"]
    assert cpu["x-kubernetes-int-or-string"] is True and "type" not in cpu
    assert SPEC["properties"]["cascade"]["nullable"] is True
    assert SPEC["required"] == ["model"]


def test_status_schema():
    status = SCHEMA["properties"]["status"]["properties"]
    assert set(status) == {"observedGeneration", "replicas", "readyReplicas", "selector",
                           "endpoint", "conditions", "desiredReplicas", "lastScaleTime",
                           "lastScaleReason", "sloAttainment"}
    assert status["lastScaleTime"]["format"] == "date-time"
    assert status["sloAttainment"]["minimum"] == 0 and status["sloAttainment"]["maximum"] == 1
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = conditions["items"]
    assert set(item["properties"]) == {"type", "status", "reason", "message",
                                       "lastTransitionTime", "observedGeneration"}
    assert item["required"] == ["type", "status"]
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"


# ------------------------------------------------------------------ agreement with pydantic

def test_api_server_defaults_match_pydantic_defaults():
    defaulted = crd.apply_defaults(SCHEMA, MINIMAL)
    spec = defaulted["spec"]
    assert spec["engine"] == {"name": "native", "native": {}, "tensorParallelSize": 1}
    assert spec["replicas"] == 1 and spec["minReplicas"] == 1 and "maxReplicas" not in spec
    assert spec["slo"] == {"percentile": 95.0}
    assert spec["routing"] == {}  # unset: the router's --policy and --load-factor
    assert spec["autoscaling"]["scaleDownStabilizationSeconds"] == 300.0
    assert "cascade" not in spec
    assert errors_of(defaulted) == []
    assert (parse_manifest(defaulted).model_dump() == parse_manifest(MINIMAL).model_dump())


def test_nested_defaults_apply_inside_given_objects():
    obj = copy.deepcopy(MINIMAL)
    obj["spec"]["engine"] = {"native": {"speculative": {}}}
    obj["spec"]["cascade"] = {"tiers": ["small", "big"], "escalation": {"threshold": -2}}
    del obj["spec"]["model"]["source"]
    spec = crd.apply_defaults(SCHEMA, obj)["spec"]
    assert spec["engine"]["name"] == "native"
    assert spec["engine"]["native"]["speculative"] == {"method": "ngram", "numTokens": 4}
    assert spec["cascade"]["escalation"] == {"signal": "logprob-quantile", "quantile": 0.1,
                                             "threshold": -2}
    assert spec["cascade"]["streaming"] == {"mode": "buffer", "prefixTokens": 16}
    assert parse_manifest(crd.apply_defaults(SCHEMA, obj)).model_dump() == \
        parse_manifest(obj).model_dump()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_validates_against_the_crd(path):
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert documents, path
    for obj in documents:  # a file may hold several (a cascade and its tiers)
        defaulted = crd.apply_defaults(SCHEMA, obj)
        assert errors_of(defaulted) == [], obj["metadata"]["name"]
        assert parse_manifest(defaulted).model_dump() == parse_manifest(obj).model_dump()
        assert defaulted["spec"]["engine"]["tensorParallelSize"] == 1  # a default appears


def test_examples_exist():
    assert any(p.name == "smollm2.yaml" for p in EXAMPLES)


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"engine": {"name": "tgi"}}, ["spec", "engine", "name"], "'tgi' is not one of"),
    ({"replicas": -1}, ["spec", "replicas"], "less than the minimum"),
    ({"slo": {"percentile": 0}}, ["spec", "slo", "percentile"],
     "less than or equal to the minimum"),
    ({"slo": {"percentile": 101}}, ["spec", "slo", "percentile"], "greater than the maximum"),
    ({"engine": {"native": {"speculative": {"numTokens": 17}}}},
     ["spec", "engine", "native", "speculative", "numTokens"], "greater than the maximum"),
    ({"cascade": {"tiers": ["only-one"], "escalation": {"threshold": -1}}},
     ["spec", "cascade", "tiers"], "too short"),
    ({"model": {"name": "m", "source": "hf://org/model"}}, ["spec", "model", "source"],
     "does not match"),
    ({"model": {"name": " padded", "source": "sluice://x"}}, ["spec", "model", "name"],
     "does not match"),
    ({"model": {"source": "sluice://x"}}, ["spec", "model"], "'name' is a required property"),
    ({"replicas": "two"}, ["spec", "replicas"], "is not of type 'integer'"),
    ({"replicas": 10_001}, ["spec", "replicas"], "greater than the maximum"),
    ({"maxReplicas": 10_001}, ["spec", "maxReplicas"], "greater than the maximum"),
    ({"engine": {"native": {"maxModelLen": 2**20 + 1}}},
     ["spec", "engine", "native", "maxModelLen"], "greater than the maximum"),
    ({"autoscaling": {"drainSeconds": 3601}}, ["spec", "autoscaling", "drainSeconds"],
     "greater than the maximum"),
])
def test_schema_rejects_bad_values_naming_the_field(change, field, words):
    obj = copy.deepcopy(MINIMAL)
    obj["spec"].update(change)
    errors = errors_of(crd.apply_defaults(SCHEMA, obj))
    assert [list(e.absolute_path) for e in errors] == [field], [e.message for e in errors]
    assert words in errors[0].message
    with pytest.raises(ValueError):  # pydantic agrees
        parse_manifest(obj)


@pytest.mark.parametrize("source", [
    "sluice://SmolLM2-135M-Instruct", "sluice://x", "file:///models/smol", "file:///",
    "pvc://claim/path", "pvc://claim/a/b/", "pvc:///claim//path", "pvc://claim", "pvc://claim/",
    "pvc:///claim", "file://relative/path", "sluice://", "s3://bucket/key", "hf://org/model",
    "", "sluice:/x", "SmolLM2-135M-Instruct",
])
def test_source_pattern_agrees_with_pydantic(source):
    pattern = SPEC["properties"]["model"]["properties"]["source"]["pattern"]
    try:
        ModelSpec(name="m", source=source)
        accepted = True
    except ValueError:
        accepted = False
    assert (re.search(pattern, source) is not None) == accepted, (source, accepted)
