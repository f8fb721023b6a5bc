"""`sluice up`: the manifest → flags mapping, then the real thing driven by the openai client."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import free_port
from sluice.api.service import load_manifests, parse_manifest
from sluice.local.supervisor import (check_services, initial_replicas, local_policy, plan,
                                     ready_banner, router_arguments, router_child,
                                     worker_arguments, worker_child, worker_threads)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "smollm2.yaml"
CASCADE = ROOT / "examples" / "cascade.yaml"
MODEL = "SmolLM2-135M-Instruct"
slow = pytest.mark.slow  # starts model-loading processes


def manifest(**spec) -> dict:
    base = {"model": {"name": MODEL, "source": f"sluice://{MODEL}"}}
    return {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "smol"}, "spec": {**base, **spec}}


# ------------------------------------------------------------------ pure: flags and wiring

def test_worker_arguments_from_the_manifest():
    service = parse_manifest(manifest(engine={"native": {"kvCacheGiB": 0.25, "maxNumSeqs": 8,
                                                         "blockSize": 32}}))
    argv = worker_arguments(service, "/models/smol")
    pairs = dict(zip(argv[::2], argv[1::2]))
    assert pairs == {"--model": "/models/smol", "--served-model-name": MODEL,
                     "--kv-cache-gib": "0.25", "--max-num-seqs": "8", "--block-size": "32"}


def test_unset_engine_options_are_left_to_the_worker():
    argv = worker_arguments(parse_manifest(manifest()), "/m")
    assert argv == ["--model", "/m", "--served-model-name", MODEL]


def test_options_the_worker_lacks_are_clear_errors(monkeypatch):
    """A worker (say an older image's) without a flag the manifest needs: an error naming
    the flag, not an option dropped."""
    from sluice.api import worker_args

    flags = worker_args.worker_flags()
    monkeypatch.setattr(worker_args, "worker_flags", lambda: flags - {"--engine"})
    service = parse_manifest(manifest(engine={"name": "vllm"}))
    with pytest.raises(ValueError, match="--engine .from the manifest. is not supported"):
        worker_arguments(service, "/m")


def test_children_wiring():
    workers = [worker_child("native", ["--model", "/m"], i, env={"OMP_NUM_THREADS": "1"})
               for i in range(2)]
    router = router_child("0.0.0.0", 9000, "INFO", ["--worker", workers[0].url], 2)
    assert [c.name for c in workers] == ["worker-0", "worker-1"]
    assert len({w.url for w in workers}) == 2
    for worker in workers:
        assert worker.argv[worker.argv.index("worker") + 1:][:2] == ["--model", "/m"]
        assert worker.argv[worker.argv.index("--port") + 1] == worker.url.rsplit(":", 1)[1]
        assert worker.env == {"OMP_NUM_THREADS": "1"}
    assert router.argv[-2:] == ["--worker", workers[0].url]
    assert router.url == "http://127.0.0.1:9000" and router.ready_workers == 2


def test_router_gets_the_manifests_routing_and_objectives():
    assert router_arguments(parse_manifest(manifest())) == []  # the router's own defaults
    service = parse_manifest(manifest(routing={"strategy": "prefix", "loadFactor": 1.5},
                                      slo={"ttftMs": 500, "itlMs": 80}))
    argv = router_arguments(service)
    assert argv == ["--policy", "prefix", "--load-factor", "1.5", "--slo-ttft-ms", "500.0",
                    "--slo-itl-ms", "80.0"]
    router = router_child("127.0.0.1", 9000, "INFO", argv, 1)
    start = router.argv.index("--port") + 2
    assert router.argv[start:start + len(argv)] == argv


def test_each_worker_gets_its_share_of_the_cores(caplog):
    """resources.cpu when set; else the cores over the most workers that may run; a
    warning when they exceed the machine."""
    cores = len(os.sched_getaffinity(0))
    assert worker_threads(parse_manifest(manifest(resources={"cpu": "1500m"})), 1) == 1
    assert worker_threads(parse_manifest(manifest()), 1) == cores
    assert worker_threads(parse_manifest(manifest()), cores) == 1
    caplog.clear()
    assert worker_threads(parse_manifest(manifest(resources={"cpu": cores})), 2) == cores
    assert f"2 worker(s) x {cores} thread(s) exceed this machine's {cores} cores" in caplog.text


def test_initial_replicas_follow_the_autoscaling_bounds(caplog):
    scaled = {"enabled": True}
    assert initial_replicas(parse_manifest(manifest(replicas=5, maxReplicas=2,
                                                    autoscaling=scaled)), None) == 2
    assert "starting 2 worker(s), not 5: autoscaling keeps replicas within minReplicas 1 " \
        "and maxReplicas 2" in caplog.text
    assert initial_replicas(parse_manifest(manifest(replicas=1, minReplicas=2, maxReplicas=3,
                                                    autoscaling=scaled)), None) == 2
    zero = parse_manifest(manifest(replicas=0, minReplicas=0, maxReplicas=2,
                                   autoscaling={"enabled": True, "scaleToZero": True}))
    assert initial_replicas(zero, None) == 0
    with pytest.raises(ValueError, match="nothing would serve"):
        initial_replicas(parse_manifest(manifest()), 0)
    # a break-it pass ran --replicas 100000: workers forked until the machine stalled
    with pytest.raises(ValueError, match="100000 replicas: sluice up runs at most 64 workers"):
        initial_replicas(parse_manifest(manifest()), 100000)
    assert initial_replicas(parse_manifest(manifest()), 64) == 64


def test_the_autoscaler_of_sluice_up_forks_at_most_64_workers(caplog):
    """A break-it pass: ``maxReplicas: 10000`` started with a warning about cores only,
    and 150 held requests made the policy ask for 305 workers; the bound is capped at
    ``MAX_LOCAL_WORKERS`` like ``--replicas``."""
    scaled = {"enabled": True}
    huge = parse_manifest(manifest(maxReplicas=10000, autoscaling=scaled))
    assert (local_policy(huge).max_replicas, local_policy(huge).min_replicas) == (64, 1)
    assert "autoscaling up to 64 workers, not spec.maxReplicas 10000" in caplog.text
    with pytest.raises(ValueError, match="spec.minReplicas 65: sluice up runs at most 64"):
        local_policy(parse_manifest(manifest(minReplicas=65, maxReplicas=100,
                                             autoscaling=scaled)))


# ------------------------------------------------------------------ several InferenceServices

def planned(path: Path, tmp_path: Path, replicas: int | None = None):
    """``plan`` for a manifest file, each model's folder faked as /models/NAME (no fetch)."""
    services = load_manifests(path)
    check_services(services, path)
    args = argparse.Namespace(file=path, host="127.0.0.1", port=9000, replicas=replicas,
                              log_level="INFO")
    return services, plan(services, args, tmp_path / "workers.json",
                          resolve=lambda s: f"/models/{s.metadata.name}")


def after(argv: list[str], word: str) -> list[str]:
    return argv[argv.index(word) + 1:]


def test_a_cascade_manifest_runs_each_tiers_workers_behind_one_router(tmp_path):
    """examples/cascade.yaml: one worker per tier (named after its InferenceService), none
    for the cascade, and one router with every worker and --manifest FILE."""
    services, up = planned(CASCADE, tmp_path)
    assert [w.name for w in up.workers] == ["smollm2-worker-0", "qwen-coder-worker-0"]
    smol, qwen = up.workers
    for worker, folder, model in ((smol, "/models/smollm2", "SmolLM2-135M-Instruct"),
                                  (qwen, "/models/qwen-coder", "Qwen2.5-Coder-0.5B-Instruct")):
        assert after(worker.argv, "worker") == [
            "--model", folder, "--served-model-name", model, "--kv-cache-gib", "0.25",
            "--host", "127.0.0.1", "--port", worker.url.rsplit(":", 1)[1]]
        assert worker.env == {"OMP_NUM_THREADS": "1"}  # resources.cpu: "1"
    assert smol.url != qwen.url
    assert after(up.router.argv, "router") == [
        "--host", "127.0.0.1", "--port", "9000",
        "--worker", smol.url, "--worker", qwen.url, "--manifest", str(CASCADE.resolve())]
    assert up.router.ready_workers == 2 and up.policy is None
    banner = ready_banner(services, up, "0.0.0.0", 9000)
    assert "sluice: ready at http://127.0.0.1:9000/v1, serving:\n" \
        "  SmolLM2-135M-Instruct        smollm2: 1 worker(s)\n" \
        "  Qwen2.5-Coder-0.5B-Instruct  qwen-coder: 1 worker(s)\n" \
        "  coder                        coder: cascade of smollm2 -> qwen-coder\nTry:\n" \
        "  curl http://127.0.0.1:9000/v1/chat/completions " in banner
    assert '"model": "coder"' in banner


def test_replicas_override_applies_to_every_service_and_one_service_keeps_its_names(tmp_path):
    _, up = planned(CASCADE, tmp_path, replicas=2)
    assert [w.name for w in up.workers] == ["smollm2-worker-0", "smollm2-worker-1",
                                            "qwen-coder-worker-0", "qwen-coder-worker-1"]
    assert up.router.ready_workers == 4
    services, up = planned(EXAMPLE, tmp_path)  # one InferenceService: names as before
    assert [w.name for w in up.workers] == ["worker-0", "worker-1"]
    assert "--manifest" not in up.router.argv
    assert up.router.argv[-4:] == ["--worker", up.workers[0].url, "--worker", up.workers[1].url]
    assert "sluice: smollm2 ready at http://127.0.0.1:9000/v1 (model SmolLM2-135M-Instruct, " \
        "2 worker(s)). Try:\n  curl " in ready_banner(services, up, "127.0.0.1", 9000)


def cascade_file(tmp_path: Path, old: str, new: str) -> Path:
    path = tmp_path / "cascade.yaml"
    text = CASCADE.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))  # the first document that has it
    return path


def test_a_cascade_whose_tier_does_not_resolve_exits_2_naming_the_field(tmp_path):
    path = cascade_file(tmp_path, "tiers: [smollm2, qwen-coder]", "tiers: [smollm2, qwen]")
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "-f", str(path),
                             "--port", str(free_port())], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert f"{path}: InferenceService 'coder': spec.cascade.tiers[1]: no InferenceService " \
        "'qwen' in this namespace" in result.stderr
    assert "started" not in result.stderr


@pytest.mark.parametrize("old, new, words", [
    ("  replicas: 1\n  resources:\n    cpu: \"1\"\n---\napiVersion",
     "  replicas: 1\n  maxReplicas: 2\n  autoscaling: {enabled: true}\n  resources:\n"
     "    cpu: \"1\"\n---\napiVersion",
     "InferenceService 'smollm2': spec.autoscaling.enabled: sluice up autoscales a manifest "
     "of one InferenceService, and this one runs the workers of 2"),
    ("    name: Qwen2.5-Coder-0.5B-Instruct\n", "    name: SmolLM2-135M-Instruct\n",
     "spec.model.name 'SmolLM2-135M-Instruct' is declared by InferenceServices 'smollm2' and "
     "'qwen-coder'"),
    ("  replicas: 1\n  resources:\n    cpu: \"1\"\n---\napiVersion",
     "  replicas: 1\n  slo: {ttftMs: 300}\n  resources:\n    cpu: \"1\"\n---\napiVersion",
     "InferenceServices 'smollm2' and 'qwen-coder' differ in spec.slo: sluice up runs one "
     "router for all of them"),
    ("  name: smollm2\n", "  name: smollm2\n", None),  # unchanged: accepted
], ids=["autoscaling", "served-name-twice", "objectives-differ", "example"])
def test_what_several_services_in_one_manifest_must_agree_on(tmp_path, old, new, words):
    path = cascade_file(tmp_path, old, new)
    services = load_manifests(path)
    if words is None:
        check_services(services, path)
        return
    with pytest.raises(ValueError) as error:
        check_services(services, path)
    assert str(error.value).startswith(f"{path}: ") and words in str(error.value)


def test_pvc_source_is_refused_locally(tmp_path):
    path = tmp_path / "pvc.yaml"
    path.write_text(EXAMPLE.read_text().replace("sluice://SmolLM2-135M-Instruct",
                                                "pvc://models/smol"))
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "-f", str(path),
                             "--port", str(free_port())], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "pvc://" in result.stderr and "Kubernetes" in result.stderr


def test_bad_manifest_exits_2_naming_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(EXAMPLE.read_text().replace("replicas: 2", "replicas: -2"))
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "-f", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "bad.yaml" in result.stderr and "spec.replicas" in result.stderr


@pytest.mark.parametrize("replicas, message", [("0", "0 replicas: nothing would serve"),
                                               ("-1", "argument --replicas: must be >= 0, got -1")])
def test_up_needs_a_worker(replicas, message):
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "-f", str(EXAMPLE),
                             "--replicas", replicas, "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr


def test_busy_port_exits_2_before_starting_anything():
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "-f", str(EXAMPLE),
                                 "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "started" not in result.stderr


def test_a_metrics_port_that_is_taken_exits_2_before_starting_anything():
    port = free_port()
    for metrics_port, message in ((port, f"--metrics-port {port} is the router's --port"),
                                  (None, "pick another with --metrics-port")):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            result = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "-f",
                                     str(EXAMPLE), "--port", str(port), "--metrics-port",
                                     str(metrics_port or taken.getsockname()[1])],
                                    capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "started" not in result.stderr


# ------------------------------------------------------------------ real processes

class Up:
    """A running `sluice up` process, its output in a file."""

    def __init__(self, args: list[str], log: Path, timeout: float = 240.0,
                 example: Path = EXAMPLE):
        self.port = free_port()
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "up", "-f", str(example), "--port",
             str(self.port), *args], stdout=self._out, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + timeout
        while "ready at" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"sluice up did not get ready:\n{self.output()[-4000:]}")
            time.sleep(0.25)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.proc.send_signal(signum)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Stop it the way a user would (SIGTERM: it stops its children); kill what is left."""
        if self.proc.poll() is None:
            children = self.descendants()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            for child in children:  # each in its own process group
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        self._out.close()


def gone(processes: list[psutil.Process], wait: float = 0.0) -> bool:
    """None of ``processes`` runs, within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`sluice up -f examples/smollm2.yaml` with the manifest's 2 replicas."""
    up = Up([], tmp_path_factory.mktemp("up") / "up.log")
    try:
        yield up
    finally:
        up.close()


@pytest.fixture(scope="module")
def client(up):
    from openai import OpenAI

    return OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)


@slow
def test_ready_line_and_curl(up):
    out = up.output()
    assert f"ready at {up.url}/v1" in out
    assert f"curl {up.url}/v1/chat/completions" in out and f'"model": "{MODEL}"' in out
    workers = httpx.get(f"{up.url}/health", timeout=5).json()["workers"]
    assert len(workers) == 2 and all(w["ready"] for w in workers)
    printed = next(line for line in out.splitlines() if line.strip().startswith("curl "))
    readme = (ROOT / "README.md").read_text()
    documented = re.search(r"^curl .*?\n(?:  .*\n)*", readme, re.M).group(0)
    for command in (printed, documented.replace("http://127.0.0.1:8000", up.url)):
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
        answer = json.loads(result.stdout)
        assert answer["choices"][0]["message"]["content"], command
        assert answer["usage"]["completion_tokens"] <= 64
    assert "Paris" in answer["choices"][0]["message"]["content"]  # README's: greedy


@slow
def test_openai_client_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


@slow
def test_openai_client_chat_and_completion(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
        temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 8
    completion = client.completions.create(model=MODEL, prompt="Once upon a time",
                                           max_tokens=8, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 8


@slow
def test_openai_client_stream_with_usage(client):
    messages = [{"role": "user", "content": "Count to ten."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    *body, last = chunks
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in body if c.choices)
    assert text == plain.choices[0].message.content
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


@slow
def test_openai_client_completion_stream(client):
    kwargs = dict(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    *body, last = chunks
    assert all(c.usage is None for c in body)
    assert last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert "".join(c.choices[0].text for c in body if c.choices) == plain.choices[0].text


@slow
def test_sigterm_stops_every_child(up):
    children = up.descendants()
    assert len(children) >= 3  # two workers and the router
    assert up.stop(signal.SIGTERM) == 0
    # the zygote's fork server and resource tracker see the supervisor's pipes close
    assert gone(children, wait=5.0), [p.cmdline() for p in children if p.is_running()]
    assert "stopped 3 process(es)" in up.output()


@slow
def test_a_killed_supervisors_children_stop_on_their_own(tmp_path):
    """SIGKILL of `sluice up` stops nothing itself; its worker and router see their parent
    gone (sluice.local.parent) and stop within a few seconds (they lived on, holding their
    ports, before)."""
    up = Up(["--replicas", "1"], tmp_path / "up.log")
    children = up.descendants()
    try:
        assert len(children) >= 2
        up.proc.kill()
        up.proc.wait(10)
        deadline = time.monotonic() + 20
        while not gone(children):
            assert time.monotonic() < deadline, [p.cmdline() for p in children if p.is_running()]
            time.sleep(0.25)
    finally:
        up.close()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


@slow
def test_replicas_override_restart_and_ctrl_c(tmp_path):
    """One worker (--replicas 1): killed, it is restarted and serves again; SIGINT exits 0."""
    up = Up(["--replicas", "1"], tmp_path / "up.log")
    try:
        workers = httpx.get(f"{up.url}/health", timeout=5).json()["workers"]
        assert len(workers) == 1
        worker = next(p for p in up.descendants() if " worker " in " ".join(p.cmdline()))
        worker.kill()
        deadline = time.monotonic() + 120
        while "restarting worker-0" not in up.output() or \
                httpx.get(f"{up.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, up.output()[-3000:]
            time.sleep(0.5)
        r = httpx.post(f"{up.url}/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                          "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        children = up.descendants()
        assert up.stop(signal.SIGINT) == 0
        assert gone(children, wait=5.0)
    finally:
        up.close()


def test_vllm_workers_run_in_vllms_own_environment(tmp_path, monkeypatch):
    from sluice.local.supervisor import worker_python

    monkeypatch.setenv("SLUICE_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(ValueError, match="run `make vllm`"):
        worker_child("vllm", ["--model", "/m"], 0)
    fake = tmp_path / "python"
    fake.touch()
    monkeypatch.setenv("SLUICE_VLLM_PYTHON", str(fake))
    worker = worker_child("vllm", ["--model", "/m"], 0)
    router = router_child("127.0.0.1", 9000, "INFO", [], 1)
    assert worker.argv[0] == str(fake) and router.argv[0] == sys.executable
    assert worker_python("native") == sys.executable


def test_a_manifest_with_zero_replicas_needs_an_override(tmp_path):
    path = tmp_path / "zero.yaml"
    path.write_text(EXAMPLE.read_text().replace("replicas: 2", "replicas: 0"))
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "-f", str(path),
                             "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "nothing would serve" in result.stderr


def test_make_up_passes_up_args():
    """README: `make up UP_ARGS="--replicas 1 --port 8080"` (the command line make would run)."""
    done = subprocess.run(["make", "--no-print-directory", "-n", "up",
                           'UP_ARGS=--replicas 1 --port 8080'], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.splitlines()[-1] == \
        ".venv/bin/sluice up -f examples/smollm2.yaml --replicas 1 --port 8080"
