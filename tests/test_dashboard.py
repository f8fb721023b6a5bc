"""The Grafana dashboard shipped with the chart (charts/sluice/dashboards/sluice.json).

Every metric its PromQL names is one Sluice exports (``sluice.api.metrics``) and appears,
with the labels the query uses, in the Prometheus text of the router, the autoscaler and a
worker (their real registries, built here without a model or a server); its variables are
well-formed; and the chart ships it, unchanged, in a ConfigMap Grafana's sidecar loads when
``dashboard.enabled=true``. Helm comes from tests/test_chart.py's fixture.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_chart import (CHART, KUBE_VERSIONS, RELEASE, find, helm,  # noqa: F401 (fixture)
                        one, render, run_helm)
from test_chart import pytestmark as kubernetes_validate_warnings

from sluice.api import metrics as names
from sluice.autoscale.metrics import AutoscalerMetrics
from sluice.autoscale.policy import Config, Decision, State
from sluice.router.metrics import DemandCollector, RouterMetrics
from sluice.worker.metrics import WorkerMetrics
from sluice.worker.vllm_backend import VLLMStats

DASHBOARD_FILE = CHART / "dashboards" / "sluice.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
EXPORTED = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels Prometheus adds to every scraped series (the target's), so queries may use them.
TARGET_LABELS = {"job", "instance"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s",
                    "__range_ms", "__dashboard", "__from", "__to", "__name", "__org", "__user"}
# What issue 9 asks the dashboard to show: each of these must be queried by some panel.
REQUIRED = {names.ROUTER_TTFT, names.ROUTER_ITL, names.TTFT, names.ITL,
            names.AUTOSCALER_DESIRED, names.AUTOSCALER_READY, names.AUTOSCALER_DEMAND,
            names.AUTOSCALER_CAPACITY, names.AUTOSCALER_ATTAINMENT, names.AUTOSCALER_DECISIONS,
            names.ROUTER_SLO_MET, names.ROUTER_SLO_REQUESTS, names.ROUTER_QUEUE_LENGTH,
            names.ROUTER_HELD, names.ROUTER_REJECTED, names.ROUTER_ARRIVALS,
            names.KV_CACHE_USAGE, names.NUM_RUNNING, names.NUM_WAITING}
MODEL = "smollm2"


# ------------------------------------------------------------------ a small PromQL reader

_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<matchers>\{(?:[^}"']|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')*\})
  | (?P<range>\[[^\]]*\])
  | (?P<variable>\$\{?\w+\}?)
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)[a-zA-Z]*)
  | (?P<name>[a-zA-Z_:][\w:]*)
  | (?P<other>\S)
""", re.X)
_MATCHER = re.compile(
    r"""([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')""")
AGGREGATIONS = {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "count_values", "group", "limitk", "limit_ratio"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


@dataclass
class Query:
    """What one PromQL expression refers to."""

    selectors: list[tuple[str, set[str]]] = field(default_factory=list)  # (metric, matcher labels)
    grouping: set[str] = field(default_factory=set)  # labels in by/without/on/ignoring/group_*

    @property
    def metrics(self) -> set[str]:
        return {name for name, _ in self.selectors}


def read_promql(expr: str) -> Query:
    """The metric selectors and grouping labels of ``expr`` (Grafana variables allowed).

    A name followed by ``(`` is a function, an aggregation followed by ``by``/``without``
    too; any other name outside strings, matchers and ranges is a metric selector.
    Selecting by ``__name__`` is refused: it would hide a metric from this reader.
    """
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    query = Query()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else (None, "")
        if kind == "matchers":
            raise AssertionError(f"a selector without a metric name in {expr!r}")
        if kind != "name" or text in KEYWORDS:
            i += 1
        elif text in GROUPING and nxt[1] == "(":
            close = next(j for j in range(i + 2, len(tokens)) if tokens[j][1] == ")")
            query.grouping |= {t for k, t in tokens[i + 2:close] if k == "name"}
            i = close + 1
        elif nxt[1] == "(" or (text in AGGREGATIONS and nxt[1] in ("by", "without")):
            i += 1
        else:
            labels = set()
            if nxt[0] == "matchers":
                labels = {label for label, _ in _MATCHER.findall(nxt[1])}
                i += 1
            assert "__name__" not in labels, f"selects by __name__: {expr!r}"
            query.selectors.append((text, labels))
            i += 1
    return query


def exported_name(metric: str) -> str:
    """``metric`` as ``sluice.api.metrics`` names it (a histogram's series without suffix)."""
    if metric in EXPORTED:
        return metric
    for suffix in HISTOGRAM_SUFFIXES:
        if metric.endswith(suffix) and metric[: -len(suffix)] in EXPORTED:
            return metric[: -len(suffix)]
    return metric


def test_the_promql_reader():
    q = read_promql('histogram_quantile(0.95, sum by (model_name, le) (rate('
                    'vllm:time_to_first_token_seconds_bucket{model_name=~"$model", '
                    'job!="x,y}"}[$__rate_interval])))')
    assert q.selectors == [("vllm:time_to_first_token_seconds_bucket", {"model_name", "job"})]
    assert q.grouping == {"model_name", "le"}
    q = read_promql('sum without (instance) (a_total{m="1"} offset 5m) / on (m) group_left '
                    '(reason) b and bool c > 1e3 or vector($slo)')
    assert q.metrics == {"a_total", "b", "c"} and q.grouping == {"instance", "m", "reason"}
    assert read_promql("vector(${ttft_slo})").selectors == []
    with pytest.raises(AssertionError):
        read_promql('{__name__="sluice_router_queue_length"}')
    assert exported_name(names.ROUTER_TTFT + "_bucket") == names.ROUTER_TTFT
    assert exported_name(names.ROUTER_ARRIVALS) == names.ROUTER_ARRIVALS
    assert exported_name("nosuch_bucket") == "nosuch_bucket"


# ------------------------------------------------------------------ the dashboard

@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside collapsed rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: dict) -> Iterator[tuple[dict, dict]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def test_dashboard_is_grafana_10_json(dashboard):
    assert dashboard["uid"] == "sluice" and dashboard["title"] == "Sluice"
    assert 36 <= dashboard["schemaVersion"] <= 39   # Grafana 10.0 .. 10.4
    assert dashboard.get("id") is None              # provisioned: Grafana assigns it
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel.get("description"), panel
        assert panel["datasource"] == DATASOURCE, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]


def test_every_query_names_a_metric_sluice_exports(dashboard):
    used = set()
    for panel, target in targets(dashboard):
        for metric in read_promql(target["expr"]).metrics:
            assert exported_name(metric) in EXPORTED, \
                f"panel {panel['title']!r} queries {metric}, not in sluice/api/metrics.py"
            used.add(exported_name(metric))
    assert REQUIRED <= used, f"no panel shows {sorted(REQUIRED - used)}"


def test_variables_are_well_formed(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert len(variables) == len(dashboard["templating"]["list"]), "variable names repeat"
    assert set(variables) == {"datasource", "model", "ttft_slo", "itl_slo"}
    assert all(re.fullmatch(r"[a-zA-Z_]\w*", name) for name in variables)

    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")

    model = variables["model"]
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    definition = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert definition == model.get("definition", definition)
    metric, label = re.fullmatch(r"label_values\((\S+),\s*(\w+)\)", definition).groups()
    assert metric in EXPORTED and label == "model"
    assert model["includeAll"] and model["multi"] and model["allValue"] == ".*"
    assert model["refresh"] in (1, 2)  # on load / on time range change: new models appear

    for name in ("ttft_slo", "itl_slo"):
        slo = variables[name]
        assert slo["type"] in ("textbox", "constant")
        assert 0 < float(slo["query"]) == float(slo["current"]["value"]) < 60  # seconds

    # every $variable used is defined (or Grafana's own), and every variable is used
    text = json.dumps(dashboard["panels"])
    used = set(re.findall(r"\$\{?(\w+)", text))
    assert used - GRAFANA_BUILTINS <= set(variables), used - GRAFANA_BUILTINS - set(variables)
    assert set(variables) <= used, f"unused variables: {set(variables) - used}"


# ------------------------------------------------------------------ the real exporters

@pytest.fixture(scope="module")
def exposition() -> dict[str, set[str]]:
    """Sample name -> its label names, from the Prometheus text of the router, the autoscaler
    and one worker, each with one sample recorded."""
    router = RouterMetrics()
    router.registry.register(DemandCollector(lambda: {MODEL: {
        "arrivals": 3, "held": 1, "ttft_total": 2, "ttft_met": 1, "itl_total": 2, "itl_met": 2}}))
    router.ttft.labels(MODEL).observe(0.2)
    router.itl.labels(MODEL).observe(0.02)
    router.e2e.labels(MODEL).observe(0.5)
    router.queue_length.labels(MODEL).set(2)
    router.rejected.labels(MODEL, "queue_full").inc()

    autoscaler = AutoscalerMetrics()
    state = State.initial(1, Config(max_replicas=4), now=0.0)
    autoscaler.record(MODEL, 1, Decision(2, "burst", state, demand_rps=3.0, capacity_rps=1.5,
                                         attainment=0.9), ready=1)

    worker = WorkerMetrics(MODEL, lambda: VLLMStats(num_running=2, num_waiting=1,
                                                    kv_cache_usage=0.25))
    worker.ttft.observe(0.1)
    worker.itl.observe(0.01)

    labels: dict[str, set[str]] = {}
    for registry in (router.registry, autoscaler.registry, worker.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def test_every_queried_series_and_label_is_exported(dashboard, exposition):
    for panel, target in targets(dashboard):
        where = f"panel {panel['title']!r}, {target['refId']}: {target['expr']}"
        query = read_promql(target["expr"])
        available = set(TARGET_LABELS)
        for metric, matched in query.selectors:
            assert metric in exposition, f"{where}: {metric} is not in any /metrics output"
            assert matched <= exposition[metric] | TARGET_LABELS, \
                f"{where}: {metric} has no label {matched - exposition[metric]}"
            available |= exposition[metric]
        assert query.grouping <= available, f"{where}: grouping by {query.grouping - available}"
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        shown = query.grouping - {"le"} if query.grouping else available
        assert legend <= shown, f"{where}: the legend names {legend - shown}, not in the result"


def test_model_variable_reads_an_exported_label(dashboard, exposition):
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    metric, label = re.fullmatch(r"label_values\((\S+),\s*(\w+)\)", model["definition"]).groups()
    assert label in exposition[metric]


# ------------------------------------------------------------------ the chart

def test_chart_ships_the_dashboard_for_grafanas_sidecar(helm):
    assert find(render(helm), "ConfigMap") == []   # off by default
    objects = render(helm, "--set", "dashboard.enabled=true",
                     "--set", "dashboard.annotations.grafana_folder=LLM")
    config_map = one(objects, "ConfigMap", f"{RELEASE}-sluice-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["labels"]["app.kubernetes.io/component"] == "dashboard"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert list(config_map["data"]) == ["sluice.json"]
    assert config_map["data"]["sluice.json"] == DASHBOARD_FILE.read_text().rstrip("\n")
    assert json.loads(config_map["data"]["sluice.json"]) == json.loads(DASHBOARD_FILE.read_text())


@kubernetes_validate_warnings
def test_chart_with_the_dashboard_lints_and_validates(helm):
    done = run_helm(helm, "lint", "--strict", str(CHART), "--set", "dashboard.enabled=true")
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    config_map = one(render(helm, "--set", "dashboard.enabled=true"), "ConfigMap",
                     f"{RELEASE}-sluice-dashboard")
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(config_map, version, strict=True)
    done = run_helm(helm, "template", RELEASE, str(CHART), "--set", "dashboard.enabled=yes",
                    check=False)
    assert done.returncode != 0 and "dashboard.enabled: Invalid type" in done.stderr
