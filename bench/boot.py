"""Worker boot: a fresh ``python -m sluice.cli worker`` process vs one forked from
``sluice up``'s zygote (``sluice.local.zygote``), side by side in one run.

Boot is from the start call to the worker's first ``/health`` 200 (polled every 20 ms):
what a scale-up waits for before the router can route to the new worker. The two ways
alternate, ``--rounds`` each, one thread per worker (``OMP_NUM_THREADS=1``, as
``sluice up`` gives two workers on two cores), first quiet, then (``--load``) while another
worker serves a closed loop of ``sluice bench`` (C = 4, 128 in / 32 out) on the other core:
the condition of a scale-up during a burst. The zygote's own start (its imports, paid once
by ``sluice up`` at start) is reported apart.

    .venv/bin/python bench/boot.py [--rounds 5] [--no-load]

Prints a table and writes JSON (default bench/results/boot.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from router import Proc, free_port  # noqa: E402  (bench/router.py)
from sluice.local.zygote import Zygote  # noqa: E402
from sluice.models import store  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def worker_argv(model: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "worker", "--model",
            str(model), "--served-model-name", MODEL, "--port", str(port)]


def wait_healthy(url: str, started: float, timeout: float = 120.0) -> float:
    """Seconds from ``started`` (perf_counter) to the first ``/health`` 200."""
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while time.perf_counter() - started < timeout:
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def boot_once(way: str, zygote: Zygote, model: Path, env: dict) -> float:
    port = free_port()
    argv = worker_argv(model, port)
    started = time.perf_counter()
    if way == "fresh":
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)
    else:
        proc = zygote.spawn(argv, env)
    try:
        return wait_healthy(f"http://127.0.0.1:{port}", started)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
        if way == "forked":
            proc.stdout.close()


def measure(zygote: Zygote, model: Path, rounds: int) -> dict[str, list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {"fresh": [], "forked": []}
    for _ in range(rounds):
        for way in times:
            times[way].append(boot_once(way, zygote, model, env))
    return times


def summarize(times: dict[str, list[float]]) -> dict:
    row = {way: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "boots_s": t}
           for way, t in times.items()}
    row["speedup"] = row["fresh"]["median_s"] / row["forked"]["median_s"]
    return row


def start_load(model: Path, tmp: Path) -> tuple[Proc, subprocess.Popen]:
    """A serving worker on one thread and an endless closed loop against it."""
    port = free_port()
    worker = Proc(worker_argv(model, port), tmp / "load_worker.log",
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    worker.ready(f"{url}/health")
    client = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "bench", "--url", url,
         "--model", MODEL, "--tokenizer", str(model), "--concurrency", "4", "--duration", "3600",
         "--input-len", "128", "--output-len", "32", "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    time.sleep(3.0)  # the loop at its steady state
    return worker, client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="boots of each way per condition")
    parser.add_argument("--load", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure while another worker serves a closed loop")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "boot.json")
    args = parser.parse_args()
    model = store.resolve(MODEL)
    started = time.perf_counter()
    zygote = Zygote()
    zygote_s = first_fork_s(zygote, model)
    result = {"model": MODEL, "rounds": args.rounds, "cores": os.cpu_count(),
              "zygote_start_s": zygote_s, "conditions": {}}
    result["conditions"]["quiet"] = summarize(measure(zygote, model, args.rounds))
    if args.load:
        with tempfile.TemporaryDirectory(prefix="bench-boot-") as tmp:
            worker, client = start_load(model, Path(tmp))
            try:
                result["conditions"]["under load"] = summarize(measure(zygote, model,
                                                                       args.rounds))
            finally:
                os.killpg(client.pid, 15)
                client.wait(30)
                worker.stop()
    result["elapsed_s"] = time.perf_counter() - started
    print(f"worker boot to /health 200, {MODEL}, 1 thread, {args.rounds} boots each "
          f"(first fork, the zygote's imports included: {zygote_s:.2f} s)")
    print(f"{'condition':<12} {'fresh p50 s':>12} {'forked p50 s':>13} {'speedup':>8}  "
          "fresh min-max / forked min-max")
    for name, row in result["conditions"].items():
        print(f"{name:<12} {row['fresh']['median_s']:>12.2f} {row['forked']['median_s']:>13.2f} "
              f"{row['speedup']:>7.2f}x  {row['fresh']['min_s']:.2f}-{row['fresh']['max_s']:.2f}"
              f" / {row['forked']['min_s']:.2f}-{row['forked']['max_s']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def first_fork_s(zygote: Zygote, model: Path) -> float:
    """The first forked boot, which waits for the zygote's imports (what ``sluice up`` pays
    once, at its start); kept out of the comparison."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    boot_once("forked", zygote, model, env)
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
