"""The SLO autoscaler on a real cluster (fixtures and environment: conftest.py).

One autoscaled InferenceService (SmolLM2, one thread per worker, min 1, max 2, short
windows), in ordered steps (TestAutoscaling is incremental):

    Ready at 1 → a burst through the router scales it to 2 (.spec.replicas, status, a
    ScaledUp Event) and an operator restart during the burst drops nothing → the load stops:
    back to 1, the removed pod is the one that was drained, and no stream failed or was cut
    → kubectl scale is overwritten while autoscaling is on, kept once it is off → scale to
    zero when idle, and a request then is held by the router and answered after the cold
    start → delete

Both passes of `make e2e-local` run it: the operator reads the local router through
--router, the chart's operator finds the chart's two router pods by label.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import httpx
import pytest

from conftest import CRD, READY_TIMEOUT_S, SHORT_TIMEOUT_S, Sluice, condition, wait_for
from test_inferenceservice import client, delete_isvc, pod_urls, ready_pods, router_ready

NAME, MODEL = "autoscaled", "auto-smol"
SELECTOR = f"app.kubernetes.io/instance={NAME}"
DRAINING = "serving.sluice.dev/draining"
TICK_S = 5  # the operator's --autoscale-interval (its default)
SCALE_TIMEOUT_S = 120  # a decision within a few ticks, plus a model load for a new pod
PROMPT = "Count slowly: one, two,"


def autoscaled_manifest() -> dict:
    """min 1, max 2, one thread per worker (cpu 500m: OMP_NUM_THREADS=1, and two workers fit
    the 2-core node beside the chart's pods); capacity 1 req/s per replica, so 3 req/s
    needs the second; 15 s of quiet before a scale-down."""
    return {
        "apiVersion": "serving.sluice.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": MODEL, "source": "sluice://SmolLM2-135M-Instruct"},
            "engine": {"name": "native", "native": {"kvCacheGiB": 0.25, "maxNumSeqs": 16}},
            "replicas": 1, "minReplicas": 1, "maxReplicas": 2,
            "resources": {"cpu": "500m"},
            "slo": {"ttftMs": 2000, "itlMs": 500},
            "autoscaling": {"enabled": True, "capacityRPS": 1.0, "bootSeconds": 10,
                            "scaleUpStabilizationSeconds": 0,
                            "scaleDownStabilizationSeconds": 15, "holdSeconds": 150,
                            "drainSeconds": 30, "idleSeconds": 10},
        },
    }


@dataclass
class Load:
    """Streamed completions through the router from a background thread, open loop at
    `rate` per second (it may be changed while it runs). Every stream must end with [DONE]
    and exactly `max_tokens` tokens (ignore_eos), or it counts as failed."""

    url: str
    rate: float
    max_tokens: int = 16
    results: list[tuple[int, bool, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 300) -> list[str]:
        """Stop issuing, wait for the streams in flight; the failures, described."""
        self._stop.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "streams still open after stopping the load"
        return [f"HTTP {status}, [DONE] {done}, {tokens} tokens {error}".strip()
                for status, done, tokens, error in self.results
                if status != 200 or not done or tokens != self.max_tokens]

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=300, trust_env=False, limits=limits) as http:
            tasks = []
            while not self._stop.is_set():
                tasks.append(asyncio.create_task(self._stream(http)))
                await asyncio.sleep(1 / self.rate)
            self.results.extend(await asyncio.gather(*tasks))

    async def _stream(self, http: httpx.AsyncClient) -> tuple[int, bool, int, str]:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        done, tokens, status = False, -1, 0
        try:
            async with http.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                status = resp.status_code
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage")
                        tokens = usage["completion_tokens"] if usage else tokens
        except httpx.HTTPError as exc:
            return status, done, tokens, f"{type(exc).__name__}: {exc}"
        return status, done, tokens, ""


def spec_replicas(sluice: Sluice) -> int:
    return int(sluice.isvc(NAME)["spec"]["replicas"])


def events(sluice: Sluice, reason: str) -> list[dict]:
    """Events about the InferenceService with this reason, oldest first."""
    found = [e for e in sluice.kubectl.get("events")
             if e["involvedObject"].get("name") == NAME and e.get("reason") == reason]
    return sorted(found, key=lambda e: e.get("lastTimestamp") or "")


def state(sluice: Sluice):
    return lambda: sluice.state((NAME,))


def serving_at(sluice: Sluice, replicas: int):
    """check(): spec, status and ready pods all at `replicas`, and the router routes to
    exactly those pods."""
    def check() -> dict | None:
        isvc = sluice.isvc(NAME)
        status = (isvc or {}).get("status") or {}
        if not isvc or isvc["spec"]["replicas"] != replicas \
                or status.get("readyReplicas") != replicas or status.get("replicas") != replicas:
            return None
        pods = ready_pods(sluice, SELECTOR)
        if len(pods) != replicas or router_ready(sluice, MODEL) != pod_urls(pods):
            return None
        return isvc
    return check


def metric(sluice: Sluice, name: str) -> float:
    """The sum of one of the operator's autoscaler metrics for MODEL."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(sluice.operator_metrics_url(), timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and f'model="{MODEL}"' in line)


@pytest.fixture(scope="class")
def autoscaled(sluice: Sluice):
    notes: dict = {}
    yield notes
    delete_isvc(sluice, NAME)


@pytest.mark.incremental
class TestAutoscaling:
    def test_ready_at_one_with_autoscaling_on(self, sluice: Sluice, autoscaled: dict):
        sluice.kubectl.apply(autoscaled_manifest())
        isvc = wait_for(f"{NAME}: 1/1 ready and routed", serving_at(sluice, 1),
                        READY_TIMEOUT_S, state(sluice))
        assert isvc["status"]["desiredReplicas"] == 1
        scaling = condition(isvc, "Autoscaling")
        assert (scaling["status"], scaling["reason"]) == ("True", "Enabled"), scaling
        assert "within [1, 2]" in scaling["message"]
        assert "TTFT <= 2000 ms and ITL <= 500 ms at p95" in scaling["message"]
        pod = ready_pods(sluice, SELECTOR)[0]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["OMP_NUM_THREADS"] == "1"
        assert pod["spec"]["terminationGracePeriodSeconds"] == 60  # drainSeconds 30 + 30
        pdb = sluice.kubectl.get("poddisruptionbudget", f"{NAME}-worker")
        assert pdb and pdb["spec"]["maxUnavailable"] == 1
        table = sluice.kubectl.run("get", CRD, NAME).stdout
        assert "DESIRED" in table.splitlines()[0], table

    def test_a_burst_scales_to_two_and_an_operator_restart_drops_nothing(
            self, sluice: Sluice, autoscaled: dict):
        """3 req/s for a capacity of 1 req/s per replica: spec.replicas 1 → 2 through the
        scale subresource; the second replica ready under 2 req/s; then 1.2 req/s (still two
        replicas' worth) while the operator restarts, and 2 stay.

        The second replica is awaited at 2 req/s: a worker pod builds the native kernels at
        boot (46-104 s here), and under 1.2 req/s with the SLO met the capacity estimate
        rises 5 % per 10 s, so a slow boot ended in a right consolidation to one replica."""
        load = Load(sluice.router_url, rate=3.0).start()
        try:
            wait_for(f"{NAME}: spec.replicas 2 under the burst",
                     lambda: spec_replicas(sluice) == 2, SCALE_TIMEOUT_S, state(sluice))
            load.rate = 2.0
            isvc = wait_for(f"{NAME}: 2/2 ready and routed", serving_at(sluice, 2),
                            READY_TIMEOUT_S, state(sluice))
            load.rate = 1.2
            sluice.restart_operator()
            # a restarted operator starts from the replicas that exist: none dropped while
            # the load goes on (past a whole scale-down window after the restart)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                assert spec_replicas(sluice) == 2, f"replicas dropped after the restart\n" \
                    f"{sluice.state((NAME,))}"
                time.sleep(1)
        finally:
            failures = load.stop()
        assert not failures, f"{len(failures)} of {len(load.results)} streams failed:\n" + \
            "\n".join(failures[:10])
        assert len(load.results) > 30
        status = isvc["status"]
        assert status["desiredReplicas"] == 2 and status["lastScaleTime"]
        assert status["lastScaleReason"].split(" ")[0] in ("burst", "load", "forecast",
                                                           "slo-miss", "bounds")
        (up,) = events(sluice, "ScaledUp")
        assert up["message"].startswith("spec.replicas 1 → 2: "), up["message"]
        managers = {m["manager"] for m in json.loads(sluice.kubectl.run(
            "get", CRD, NAME, "-o", "json", "--show-managed-fields").stdout)["metadata"]
            ["managedFields"]}
        # written through the scale subresource: Kubernetes < 1.22 names the writer of a
        # scale patch after its user agent, later ones after its fieldManager
        assert managers & {"sluice-autoscaler", "sluice-operator"}, managers
        assert metric(sluice, "sluice_autoscaler_decisions_total") > 0

    def test_back_to_one_drains_the_removed_pod_and_loses_nothing(
            self, sluice: Sluice, autoscaled: dict):
        """The burst stops but for a trickle of longer streams: after the scale-down window
        the idlest worker is drained (annotated, out of routing) and it is the pod removed."""
        before = {p["metadata"]["name"] for p in ready_pods(sluice, SELECTOR)}
        assert len(before) == 2
        trickle = Load(sluice.router_url, rate=0.25, max_tokens=48).start()
        drained: set[str] = set()
        try:
            def at_one() -> bool:
                pods = sluice.pods(SELECTOR)
                drained.update(p["metadata"]["name"] for p in pods
                               if DRAINING in (p["metadata"].get("annotations") or {}))
                return spec_replicas(sluice) == 1 and len(pods) == 1 \
                    and not pods[0]["metadata"].get("deletionTimestamp")
            wait_for(f"{NAME}: back to one pod", at_one, SCALE_TIMEOUT_S, state(sluice))
            wait_for(f"{NAME}: 1/1 ready and routed", serving_at(sluice, 1), SHORT_TIMEOUT_S,
                     state(sluice))
        finally:
            failures = trickle.stop()
        assert not failures, f"{len(failures)} of {len(trickle.results)} streams failed:\n" \
            + "\n".join(failures[:10])
        assert len(trickle.results) >= 3
        (left,) = [p["metadata"]["name"] for p in sluice.pods(SELECTOR)]
        removed = before - {left}
        assert len(removed) == 1 and drained == removed, (drained, removed)
        (draining,) = events(sluice, "Draining")
        assert f"pod {removed.pop()} " in draining["message"], draining["message"]
        down = events(sluice, "ScaledDown")
        assert down and down[-1]["message"].startswith("spec.replicas 2 → 1: ")
        status = sluice.isvc(NAME)["status"]
        assert status["desiredReplicas"] == 1
        assert 0 <= status["sloAttainment"] <= 1

    def test_kubectl_scale_is_overwritten_only_while_autoscaling_is_on(
            self, sluice: Sluice, autoscaled: dict):
        sluice.kubectl.run("scale", f"sisvc/{NAME}", "--replicas=2")
        wait_for(f"{NAME}: the autoscaler to put spec.replicas back to 1",
                 lambda: spec_replicas(sluice) == 1, 6 * TICK_S, state(sluice))
        assert any(" override " in f" {e['message']} " for e in events(sluice, "ScaledDown"))

        sluice.kubectl.run("patch", CRD, NAME, "--type=merge", "-p",
                           json.dumps({"spec": {"autoscaling": {"enabled": False}}}))
        wait_for(f"{NAME}: no Autoscaling condition once it is off",
                 lambda: not condition(sluice.isvc(NAME), "Autoscaling"), SHORT_TIMEOUT_S,
                 state(sluice))
        sluice.kubectl.run("scale", f"sisvc/{NAME}", "--replicas=2")
        deadline = time.monotonic() + 3 * TICK_S
        while time.monotonic() < deadline:
            assert spec_replicas(sluice) == 2, "spec.replicas was changed with autoscaling off"
            time.sleep(1)
        wait_for(f"{NAME}: desiredReplicas is spec.replicas with autoscaling off",
                 lambda: sluice.isvc(NAME)["status"].get("desiredReplicas") == 2,
                 SHORT_TIMEOUT_S, state(sluice))
        sluice.kubectl.run("scale", f"sisvc/{NAME}", "--replicas=1")
        wait_for(f"{NAME}: one pod again", lambda: len(sluice.pods(SELECTOR)) == 1,
                 SCALE_TIMEOUT_S, state(sluice))

    def test_scale_to_zero_and_back_with_a_held_request(self, sluice: Sluice,
                                                        autoscaled: dict):
        sluice.kubectl.run("patch", CRD, NAME, "--type=merge", "-p", json.dumps({"spec": {
            "minReplicas": 0, "autoscaling": {"enabled": True, "scaleToZero": True}}}))
        wait_for(f"{NAME}: idle → 0 replicas, no pod", lambda: spec_replicas(sluice) == 0
                 and not sluice.pods(SELECTOR), SCALE_TIMEOUT_S, state(sluice))
        assert sluice.isvc(NAME)["status"]["lastScaleReason"].startswith("idle")
        oai = client(sluice, timeout_s=300)
        assert MODEL in [m.id for m in oai.models.list().data]  # listed at zero
        started = time.monotonic()
        reply = oai.chat.completions.create(  # held by the router until a replica is ready
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of "
                                    "France?"}], max_tokens=16, temperature=0)
        waited = time.monotonic() - started
        assert "paris" in (reply.choices[0].message.content or "").lower()
        assert spec_replicas(sluice) == 1
        assert sluice.isvc(NAME)["status"]["lastScaleReason"].startswith("wake")
        assert waited > 2, f"answered in {waited:.1f} s: was it really at zero?"
        wake = events(sluice, "ScaledUp")[-1]
        assert wake["message"].startswith("spec.replicas 0 → 1: wake"), wake["message"]
