"""Autoscaling benchmark: static 1 replica, static max, and the SLO autoscaler, on a bursty
stretch of a real trace replayed against real workers under `sluice up`.

Each configuration runs in its own ``sluice up`` (one after another, same machine), with a
manifest derived from examples/autoscaling.yaml: one thread per worker (``resources.cpu:
"1"``), min 1, max 2 replicas, the benchmark's SLO, and ``capacityRPS`` from a quick
``sluice profile`` of one worker with lengths drawn from the cut (``--lengths-from``; or
``--capacity-rps``):

    static-1    autoscaling off, 1 worker
    static-2    autoscaling off, 2 workers (static max)
    autoscale   autoscaling on, starts at 1, the policy adds and drains workers

The load is a cut of ../shared/traces (default: Azure 2023 "code", which switches on and
off), replayed open loop by `sluice bench`'s runner with its own arrival times: the rows in
``[--start, --start + --span)`` trace seconds, each kept with probability ``--keep``
(seeded), times multiplied by ``--time-scale``; input lengths × ``--input-scale``, capped
at ``--max-input``; outputs capped at ``--max-output`` and forced with ignore_eos. So the
burst shape is the trace's and the rate is what two 1-thread SmolLM2 workers serve: with
``--time-scale`` unset (the default), once the profile has measured one worker's capacity
the cut is replayed at the fastest time scale whose peak 10 s rate is at most
``--peak-load`` (1.5) × that capacity, so bursts need both workers on a machine of any
speed. (The default cut is trace seconds 2100-2700, 4 % of rows: 72 requests, on and off.
At a fixed x0.2 it compared the configurations one day, static 1 79 %, static 2 100 %,
profiled capacity 1.6 req/s; at x0.5 one worker held it another day; at x0.2 both workers
missed on a slower day, capacity 0.62 req/s, static 2 93 %.)

Per configuration, over the window from the first arrival to the later of the cut's end and
the last completion:

- SLO attainment (% of all requests): TTFT within the objective, ITL (the request's mean
  inter-token gap, as the router judges it) within the objective, and both;
- replica-seconds: worker processes running (started, booting included, until stopped),
  from the supervisor's ``started worker-K`` / ``worker-K stopped`` log lines and their
  timestamps, integrated over the window; ready workers are sampled from the router's
  /health for the plot;
- scale events (``autoscaler: N -> M replicas (REASON; ...)``);
- failed requests (an HTTP or transport error) and truncated ones (a stream without
  [DONE], or fewer tokens than asked with ignore_eos).

Targets (issue 9): the autoscaler within 1 point of static-2's attainment (both objectives)
at <= 70 % of its replica-seconds, with 0 failed or truncated requests. Static-2 serves
the cut's quiet stretches with ~100 % attainment, so the SLO the autoscaler is given is
p``--slo-percentile`` (99): it plans to meet the objectives for 99 % of requests, the
profile measures one worker's capacity at that tail, and bench/autoscale_sim.py sizes at
the same 99 %. (At p95 the policy is asked to let 1 request in 20 miss, and does: one
worker held at 0.8x its p95 capacity missed 2 of 19 requests by 6-9 % in the 2026-12-04
run, which static-2 served; in the simulator p95 sizing meets the target on 2 of
bench/autoscale_sim.py's 6 cuts, p99 on 5.)

    .venv/bin/python bench/autoscale.py [--capacity-rps X] [--tiny]

Prints a table and writes JSON (default bench/results/autoscale.json) and a PNG beside it
(replicas, arrivals and TTFT over time per configuration).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from router import Proc, free_port  # noqa: E402  (bench/router.py)
from sluice.bench import report, workload  # noqa: E402
from sluice.bench.client import RequestRecord  # noqa: E402
from sluice.bench.profile import mean_itl_s, verdicts  # noqa: E402
from sluice.bench.runner import LoadConfig, run as run_load  # noqa: E402
from sluice.models import store  # noqa: E402

EXAMPLE = ROOT / "examples" / "autoscaling.yaml"
TRACES = Path("/work/shared/traces")
CONFIGS = ("static-1", "static-2", "autoscale")
TARGET_POINTS = 1.0  # autoscale attainment >= static-2's - 1 point
TARGET_RATIO = 0.70  # autoscale replica-seconds <= 70 % of static-2's
BIN_S = 10.0  # arrivals-per-second bins in the plot and the cut's summary


# ------------------------------------------------------------------------------ the load

@dataclass(frozen=True)
class Cut:
    """Which stretch of which trace, thinned and scaled (units in the names)."""

    trace: str
    start_s: float
    span_s: float
    keep: float
    time_scale: float = 1.0
    input_scale: float = 1.0
    max_input: int = 512
    max_output: int = 32
    seed: int = 0

    @property
    def replay_s(self) -> float:
        """The cut's length in replay seconds."""
        return self.span_s * self.time_scale


def cut_trace(rows: Sequence[workload.TraceRow], cut: Cut) -> list[workload.TraceRow]:
    """The rows in ``[start_s, start_s + span_s)``, each kept with probability ``keep``
    (one seeded draw per row in order), arrival offsets from ``start_s`` × ``time_scale``,
    lengths scaled and capped (at least 1 token each)."""
    rng = random.Random(cut.seed)
    out = []
    for row in rows:
        if not cut.start_s <= row.arrival_s < cut.start_s + cut.span_s:
            continue
        if rng.random() >= cut.keep:
            continue
        n_in = min(cut.max_input, max(1, round(row.input_tokens * cut.input_scale)))
        out.append(workload.TraceRow((row.arrival_s - cut.start_s) * cut.time_scale, n_in,
                                     max(1, min(cut.max_output, row.output_tokens))))
    return out


def rate_bins(times_s: Sequence[float], span_s: float, bin_s: float = BIN_S) -> list[float]:
    """Arrivals per second in consecutive ``bin_s`` bins over ``[0, span_s)``."""
    counts = [0] * max(1, math.ceil(span_s / bin_s))
    for t in times_s:
        if 0 <= t < span_s:
            counts[int(t // bin_s)] += 1
    return [c / bin_s for c in counts]


def describe_cut(rows: Sequence[workload.TraceRow], cut: Cut) -> dict:
    """Requests, mean/peak rate (10 s bins), mean lengths of the cut."""
    bins = rate_bins([r.arrival_s for r in rows], cut.replay_s)
    n = len(rows)
    return {"requests": n, "replay_s": cut.replay_s, "mean_rps": n / cut.replay_s,
            "peak_rps_10s": max(bins), "idle_10s_bins": sum(1 for b in bins if b == 0),
            "bins_rps": bins,
            "mean_input_tokens": sum(r.input_tokens for r in rows) / max(1, n),
            "mean_output_tokens": sum(r.output_tokens for r in rows) / max(1, n)}


# -------------------------------------------------------------------------- manifests

def fit_time_scale(trace: Sequence[workload.TraceRow], cut: Cut, peak_rps: float) -> Cut:
    """``cut`` at the fastest time scale (on a grid of 5 % steps, 0.05-5) whose peak 10 s
    arrival rate is at most ``peak_rps``: the trace's burst shape at the load that one
    machine's measured capacity calls for."""
    scale = 0.05
    while scale < 5.0:
        fitted = replace(cut, time_scale=round(scale, 4))
        if describe_cut(cut_trace(trace, fitted), fitted)["peak_rps_10s"] <= peak_rps:
            return fitted
        scale *= 1.05
    return replace(cut, time_scale=5.0)


class Load:
    """The cut being replayed and its requests; refitted to the capacity once it is known
    (``--time-scale`` unset)."""

    def __init__(self, trace: Sequence[workload.TraceRow], cut: Cut, tok: workload.Tokenizer,
                 seed: int):
        self.trace, self.tok, self.seed = trace, tok, seed
        self.set(cut)

    def set(self, cut: Cut) -> None:
        self.cut = cut
        self.rows = cut_trace(self.trace, cut)
        self.info = describe_cut(self.rows, cut)
        self.specs = list(workload.from_trace(self.rows, workload.PromptBuilder(self.tok),
                                              seed=self.seed))
        info = self.info
        print(f"cut: x{cut.time_scale:g}, {info['requests']} requests over {cut.replay_s:.0f} s, "
              f"mean {info['mean_rps']:.2f} req/s, peak {info['peak_rps_10s']:.1f} req/s "
              f"(10 s bins), {info['idle_10s_bins']} idle bins; mean lengths "
              f"{info['mean_input_tokens']:.0f} in / {info['mean_output_tokens']:.0f} out",
              flush=True)


def build_manifest(base: dict, config: str, slo: dict, capacity_rps: float,
                   scaling: dict) -> dict:
    """The example manifest for one configuration: ``static-N`` (autoscaling off, N
    workers) or ``autoscale`` (on, from 1); always one thread per worker, min 1, max 2."""
    body = json.loads(json.dumps(base))  # a deep copy
    spec = body["spec"]
    body["metadata"]["name"] = f"bench-{config}"
    spec.update(minReplicas=1, maxReplicas=2)
    spec["resources"] = {**spec.get("resources", {}), "cpu": "1"}
    spec["slo"] = dict(slo)
    auto = {**spec.get("autoscaling", {}), **scaling, "capacityRPS": capacity_rps}
    if config == "autoscale":
        spec["replicas"] = 1
        auto["enabled"] = True
    else:
        spec["replicas"] = int(config.rsplit("-", 1)[1])
        auto["enabled"] = False
    spec["autoscaling"] = auto
    return body


# ------------------------------------------------------------------ the supervisor's log

_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ "
STARTED = re.compile(_STAMP + r"sluice\.local\.processes: started (worker-\d+) \(pid \d+\): (\S+)")
STOPPED = re.compile(_STAMP + r"sluice\.local\.processes: (worker-\d+) (?:stopped|exited with)")
SCALED = re.compile(_STAMP + r"sluice\.local\.autoscaler: autoscaler: (\d+) -> (\d+) replicas "
                    r"\(([^;)]+)")


def _stamp(text: str) -> float:
    """The logging module's ``asctime`` (local time, ms) → Unix seconds."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def worker_events(log: str) -> list[tuple[float, int]]:
    """``(unix_s, running workers after)`` at every start and stop, in order: a worker runs
    from ``started worker-K`` (booting counts) to ``worker-K stopped`` or ``exited``."""
    events = []
    for line in log.splitlines():
        if m := STARTED.match(line):
            events.append((_stamp(m.group(1)), m.group(2), True))
        elif m := STOPPED.match(line):
            events.append((_stamp(m.group(1)), m.group(2), False))
    running: set[str] = set()
    out = []
    for t, name, up in sorted(events, key=lambda e: e[0]):
        (running.add if up else running.discard)(name)
        out.append((t, len(running)))
    return out


def scale_events(log: str) -> list[dict]:
    """``{"t_unix", "from", "to", "reason"}`` for every autoscaler decision that changed the
    replica count."""
    return [{"t_unix": _stamp(m.group(1)), "from": int(m.group(2)), "to": int(m.group(3)),
             "reason": m.group(4)} for line in log.splitlines() if (m := SCALED.match(line))]


def integrate(events: Sequence[tuple[float, int]], t0: float, t1: float) -> float:
    """∫ running workers dt over ``[t0, t1]`` (worker-seconds) of a step function given as
    ``(t, value from t on)``; 0 before the first event."""
    total, value, at = 0.0, 0, t0
    for t, n in events:
        if t > at:
            total += value * (min(t, t1) - at)
            at = min(t, t1)
        if t >= t1:
            break
        value = n
    if at < t1:
        total += value * (t1 - at)
    return total


# ---------------------------------------------------------------------------- one run

class HealthPoller(threading.Thread):
    """Samples ``(unix_s, ready workers)`` from the router's /health every ``period`` s."""

    def __init__(self, url: str, period: float = 0.5):
        super().__init__(daemon=True, name="health-poller")
        self.url, self.period = url, period
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while not self.stop.wait(self.period):
                try:
                    workers = client.get(f"{self.url}/health").json().get("workers", [])
                    self.samples.append((time.time(), sum(1 for w in workers if w.get("ready"))))
                except (httpx.HTTPError, ValueError, AttributeError):
                    pass


def start_up(config: str, manifest: dict, workdir: Path, timeout_s: float) -> tuple[Proc, str]:
    """``sluice up`` on the manifest, on a free port; returns it once it printed ready."""
    path = workdir / f"{config}.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    port = free_port()
    up = Proc([sys.executable, "-m", "sluice.cli", "up", "-f", str(path), "--port", str(port),
               "--grace-period", "30"], workdir / f"{config}.log")
    deadline = time.monotonic() + timeout_s
    while "ready at" not in up.log.read_text(errors="replace"):
        if up.proc.poll() is not None or time.monotonic() > deadline:
            up.stop()
            raise RuntimeError(f"sluice up ({config}) did not get ready:\n"
                               f"{up.log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.25)
    return up, f"http://127.0.0.1:{port}"


def write_azure_csv(rows: Sequence[workload.TraceRow], path: Path) -> None:
    """Trace rows in the Azure 2023 CSV format (``sluice simulate``, ``sluice profile
    --lengths-from``), arrival offsets from midnight of an arbitrary day."""
    t0 = datetime(2023, 11, 16)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for row in rows:
            stamp = (t0 + timedelta(seconds=row.arrival_s)).strftime("%Y-%m-%d %H:%M:%S.%f")
            out.writerow([stamp, row.input_tokens, row.output_tokens])


def profile_capacity(worker_url: str, model: str, rows: Sequence[workload.TraceRow],
                     slo: dict, args, workdir: Path) -> dict:
    """``sluice profile`` of one worker with the cut's own requests: their lengths (at the
    mean lengths the capacity came out above what one replica holds for the trace, 0.75
    req/s for the code cut where static-1 met 56 %) and, with ``--profile-arrivals trace``,
    their arrivals time-scaled to each step's rate (Poisson steps overstate what one worker
    holds of on-off traffic); its JSON."""
    out, lengths = workdir / "profile.json", workdir / "cut_lengths.csv"
    write_azure_csv(rows, lengths)
    argv = [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "profile", "--url",
            worker_url, "--model", model, "--slo-ttft-ms", str(slo["ttftMs"]), "--slo-itl-ms",
            str(slo["itlMs"]), "--percentile", str(slo["percentile"]),
            "--lengths-from", str(lengths), "--arrivals", args.profile_arrivals,
            "--rates", args.profile_rates,
            "--duration", str(args.profile_duration),
            "--min-requests", str(args.profile_min_requests), "--output", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    print(proc.stdout, end="")
    if proc.returncode != 0:
        raise RuntimeError(f"sluice profile failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def warm_up(worker_urls: Sequence[str], model: str, tok: workload.Tokenizer) -> None:
    """Two short requests to each worker directly, not through the router, so that the
    autoscaler's demand never sees them."""
    specs = list(itertools.islice(workload.synthetic(
        workload.PromptBuilder(tok), workload.LengthDist("fixed", 32),
        workload.LengthDist("fixed", 8), seed=1_000_003), 2))
    for url in worker_urls:
        asyncio.run(run_load(LoadConfig(url=url, model=model, concurrency=1), specs, tok))


def replay(url: str, model: str, specs: list[workload.RequestSpec], tok: workload.Tokenizer,
           replay_s: float) -> tuple[list[RequestRecord], float, float]:
    """The cut, open loop at its arrival times; returns the records and the window
    ``(t0, t1)`` in Unix seconds: from the first arrival to the later of the cut's end and
    the last completion (waiting out the cut's end)."""
    cfg = LoadConfig(url=url, model=model, concurrency=None, open_loop=True,
                     num_requests=len(specs), request_timeout_s=600.0)
    result = asyncio.run(run_load(cfg, specs, tok))
    if result.interrupted:
        raise KeyboardInterrupt
    t0 = result.started_at
    last = max((r.end_s for r in result.records), default=0.0)
    wait = t0 + replay_s - time.time()
    if wait > 0:  # the cut's quiet tail is part of the run (and of its cost)
        time.sleep(wait)
    return result.records, t0, t0 + max(replay_s, last)


def run_config(config: str, manifest: dict, load: Load, model: str, args, workdir: Path,
               profile_cb=None) -> dict:
    """One configuration end to end: up, (profile, which may refit ``load``,) replay, stop;
    raw material for the summary."""
    clock = time.monotonic()
    timings = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.monotonic()
        timings[name] = round(now - clock, 1)
        clock = now

    load_before = os.getloadavg()
    up, url = start_up(config, manifest, workdir, args.startup_timeout)
    lap("startup_s")
    try:
        workers = [m.group(3) for line in up.log.read_text(errors="replace").splitlines()
                   if (m := STARTED.match(line))]
        profiled = None
        if profile_cb is not None:
            profiled = profile_cb(workers[0])
            lap("profile_s")
        warm_up(workers, model, load.tok)
        poller = HealthPoller(url)
        poller.start()
        try:
            records, t0, t1 = replay(url, model, load.specs, load.tok, load.cut.replay_s)
        finally:
            poller.stop.set()
            poller.join(5)
        time.sleep(1.0)  # the supervisor's last lines of the window
        lap("replay_s")
    finally:
        up.stop()
    lap("stop_s")
    log = up.log.read_text(errors="replace")
    return {"records": records, "t0": t0, "t1": t1, "log": log, "ready": poller.samples,
            "profile": profiled, "timings_s": timings,
            "load_avg": {"before": load_before, "after": os.getloadavg()}}


# ----------------------------------------------------------------------------- figures

def truncated(record: RequestRecord) -> bool:
    """A stream cut short: no [DONE], or fewer tokens than asked (ignore_eos)."""
    if record.error_code == "incomplete_stream":
        return True
    got = record.usage_output_tokens if record.usage_output_tokens is not None \
        else record.output_tokens
    return record.ok and got < record.max_tokens


def summarize(raw: dict, slo: dict) -> dict:
    """Attainment, replica-seconds, scale events, failures and latency of one run."""
    records, t0, t1 = raw["records"], raw["t0"], raw["t1"]
    n = len(records)
    ttft_ms, itl_ms = slo["ttftMs"], slo["itlMs"]
    marks = [verdicts(r, ttft_ms, itl_ms) for r in records]
    events = worker_events(raw["log"])
    replica_s = integrate(events, t0, t1)
    ok = [r for r in records if r.ok]
    return {
        "load_avg": raw["load_avg"],
        "timings_s": raw["timings_s"],
        "requests": n,
        "window_s": t1 - t0,
        "attainment_pct": 100.0 * sum(a and b for a, b in marks) / max(1, n),
        "ttft_attainment_pct": 100.0 * sum(a for a, _ in marks) / max(1, n),
        "itl_attainment_pct": 100.0 * sum(b for _, b in marks) / max(1, n),
        "replica_seconds": replica_s,
        "mean_replicas": replica_s / (t1 - t0) if t1 > t0 else 0.0,
        "scale_events": [{**e, "t_s": e["t_unix"] - t0} for e in scale_events(raw["log"])
                         if t0 - 5 <= e["t_unix"] <= t1],
        "failed": sum(1 for r in records if not r.ok and r.error_code != "incomplete_stream"),
        "failures": [{"index": r.index, "start_s": r.start_s, "end_s": r.end_s,
                      "error_code": r.error_code, "error": r.error, "max_tokens": r.max_tokens,
                      "output_tokens": r.usage_output_tokens}
                     for r in records if not r.ok or truncated(r)],
        "truncated": sum(1 for r in records if truncated(r)),
        "errors": dict(sorted(Counter(r.error_code for r in records if not r.ok).items())),
        "ttft_ms": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_mean_ms": _stats([g for r in ok if (g := mean_itl_s(r)) is not None]),
        "timeline": {  # seconds from t0 (0.01 s), TTFT in ms (0.1 ms)
            "running": [[round(t - t0, 2), k] for t, k in events],
            "ready": changes([[round(t - t0, 2), k] for t, k in raw["ready"]]),
            "ttft": [[round(r.start_s, 2), round(r.ttft_s * 1000.0, 1)] for r in ok
                     if r.ttft_s is not None],
            "arrivals_s": [round(r.scheduled_s, 3) for r in records if r.scheduled_s is not None],
        },
    }


def changes(samples: Sequence[list]) -> list[list]:
    """A sampled step function ``[[t, value], ...]`` reduced to its changes (and its last
    sample)."""
    out = [s for i, s in enumerate(samples) if i == 0 or s[1] != samples[i - 1][1]]
    if samples and out[-1] is not samples[-1]:
        out.append(samples[-1])
    return out


def _stats(values_s: Sequence[float]) -> dict:
    """mean/p50/p90/p95/p99/max in ms of values in seconds (None when empty)."""
    out = report.describe(values_s, 1000.0)
    out["p95"] = report.percentile(values_s, 95) * 1000.0 if values_s else None
    return out


def verdict(runs: dict) -> dict:
    """The issue's targets: autoscale vs static-2."""
    auto, full = runs["autoscale"], runs["static-2"]
    points = auto["attainment_pct"] - full["attainment_pct"]
    ratio = auto["replica_seconds"] / full["replica_seconds"] if full["replica_seconds"] else None
    clean = auto["failed"] == 0 and auto["truncated"] == 0
    return {"attainment_points_vs_static_max": points,
            "replica_seconds_ratio_vs_static_max": ratio,
            "attainment_met": points >= -TARGET_POINTS,
            "replica_seconds_met": ratio is not None and ratio <= TARGET_RATIO,
            "no_failed_or_truncated": clean,
            "all_met": points >= -TARGET_POINTS and ratio is not None and ratio <= TARGET_RATIO
            and clean}


def print_table(runs: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, header_style="bold")
    for name in ("config", "requests", "SLO met", "TTFT met", "ITL met", "TTFT p50/p95 ms",
                 "replica-s", "mean replicas", "scaled", "failed", "truncated"):
        t.add_column(name, justify="right")
    for config, r in runs.items():
        ups = sum(1 for e in r["scale_events"] if e["to"] > e["from"])
        downs = len(r["scale_events"]) - ups
        t.add_row(config, str(r["requests"]), f"{r['attainment_pct']:.1f}%",
                  f"{r['ttft_attainment_pct']:.1f}%", f"{r['itl_attainment_pct']:.1f}%",
                  f"{_f(r['ttft_p50_ms'])} / {_f(r['ttft_p95_ms'])}",
                  f"{r['replica_seconds']:.0f}", f"{r['mean_replicas']:.2f}",
                  f"{ups} up, {downs} down", _failed(r), str(r["truncated"]))
    Console(width=max(150, Console().width)).print(t)


def _failed(run: dict) -> str:
    """``3 (429: 2, ReadError: 1)``: failed requests and their error codes."""
    codes = ", ".join(f"{code}: {n}" for code, n in run["errors"].items()
                      if code != "incomplete_stream")
    return f"{run['failed']} ({codes})" if codes else str(run["failed"])


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot(path: Path, rounds: dict[str, list[dict]], slo: dict) -> Path:
    """One panel per configuration (rows) and round (columns): running and ready workers,
    arrivals per second (10 s bins) and each request's TTFT (right axis, log) against the
    objective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rounds = max(len(rs) for rs in rounds.values())
    fig, axes = plt.subplots(len(rounds), n_rounds, figsize=(10 * n_rounds, 3.2 * len(rounds)),
                             sharex=True, squeeze=False)
    for row, (config, runs) in enumerate(rounds.items()):
        for col, r in enumerate(runs):
            _panel(axes[row][col], f"{config}" + (f", round {col + 1}" if n_rounds > 1 else ""),
                   r, slo)
    for ax in axes[-1]:
        ax.set_xlabel("seconds from the first arrival")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _panel(ax, name: str, r: dict, slo: dict) -> None:
    tl = r["timeline"]
    span = r["window_s"]
    start = ([k for t, k in tl["running"] if t <= 0] or [0])[-1]
    steps = [(0.0, start)] + [(t, k) for t, k in tl["running"] if 0 < t <= span]
    xs, ys = [t for t, _ in steps] + [span], [k for _, k in steps] + [steps[-1][1]]
    ax.step(xs, ys, where="post", color="C0", lw=2, label="workers running")
    if tl["ready"]:
        ax.step([t for t, _ in tl["ready"]], [k for _, k in tl["ready"]], where="post",
                color="C2", lw=1, alpha=0.8, label="ready (router /health)")
    bins = rate_bins(tl["arrivals_s"], span)
    ax.step([i * BIN_S for i in range(len(bins) + 1)], bins + bins[-1:], where="post",
            color="0.5", lw=1, label=f"arrivals (req/s, {BIN_S:.0f} s bins)")
    ax.set_ylim(0, max(3.0, max(bins) * 1.1))
    ax.set_ylabel("workers | req/s")
    ax.set_title(f"{name}: SLO attained {r['attainment_pct']:.1f}%, "
                 f"{r['replica_seconds']:.0f} replica-s, load avg "
                 f"{r['load_avg']['before'][0]:.1f}-{r['load_avg']['after'][0]:.1f}")
    ax2 = ax.twinx()
    if tl["ttft"]:
        ax2.plot([t for t, _ in tl["ttft"]], [v for _, v in tl["ttft"]], ".", color="C3", ms=3,
                 label="TTFT (ms)")
    ax2.axhline(slo["ttftMs"], color="C3", ls="--", lw=1, label="TTFT objective")
    failed = [f["start_s"] for f in r["failures"]]
    if failed:
        ax.plot(failed, [0.05] * len(failed), "kx", ms=8, label="failed / truncated")
    ax2.set_yscale("log")
    ax2.set_ylabel("TTFT (ms)")
    lines, lines2 = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=7)


# -------------------------------------------------------------------------------- main

# The autoscaler's windows here (over the example manifest's, which suit a loaded machine):
# bootSeconds as measured on this machine (a 1-thread SmolLM2 worker forked by sluice up's
# zygote: 1.4-1.5 s from start to /health, quiet or under load, bench/boot.py; routed
# within 0.2 s of it) and a 12 s scale-down window. An idle replica kept that long costs
# what taking it away wrongly costs: a boot of replica-seconds plus the SLO misses of a
# burst's first seconds on the smaller fleet (ski rental's break-even); a 4 s window (two
# boots) gave a worker back 3 s before the next burst of the code cut on 2026-12-03.
SCALING = {"bootSeconds": 2, "scaleDownStabilizationSeconds": 12}
# With --time-scale unset, the cut's peak 10 s rate is fitted to this x one worker's
# profiled capacity: its bursts need both workers and a gap between them needs one. A
# fixed scale compared nothing on a faster day (x0.5: one worker held it) and overloaded
# both workers on a slower one (x0.2 at 0.62 req/s: static-2 met 93 %).
PEAK_LOAD = 1.5
TINY = {"start": 560.0, "span": 40.0, "keep": 0.025, "time_scale": 0.5, "max_input": 128,
        "max_output": 8,
        "profile_rates": "1", "profile_duration": 2.0, "profile_min_requests": 3,
        "scaling": {"bootSeconds": 5, "scaleDownStabilizationSeconds": 5, "drainSeconds": 20}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=store.DEFAULT_MODEL)
    parser.add_argument("--trace", default=str(TRACES / "azure2023_code.csv"))
    parser.add_argument("--start", type=float, default=2100.0, help="trace seconds")
    parser.add_argument("--span", type=float, default=600.0, help="trace seconds")
    parser.add_argument("--keep", type=float, default=0.04, help="fraction of rows kept")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="replay time = trace time x this (default: fitted to the "
                        "capacity, see --peak-load)")
    parser.add_argument("--peak-load", type=float, default=PEAK_LOAD,
                        help="with --time-scale unset: replay the cut at the fastest time "
                        "scale whose peak 10 s rate is at most this x one worker's capacity "
                        "(default %(default)s)")
    parser.add_argument("--input-scale", type=float, default=1 / 16)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0,
                        help="TTFT objective (ms; the example manifest's is 1000)")
    parser.add_argument("--slo-itl-ms", type=float, default=300.0,
                        help="ITL objective (ms; the example manifest's is 200)")
    parser.add_argument("--slo-percentile", type=float, default=99.0,
                        help="the percentile of requests the objectives hold at: the profile "
                        "measures capacity there and the autoscaler targets it (default "
                        "%(default)g; the example manifest's is 95)")
    parser.add_argument("--capacity-rps", type=float, default=None,
                        help="skip the profile and use this capacityRPS")
    parser.add_argument("--profile-rates", default="0.25,0.5,0.75,1,1.25,1.5,2")
    parser.add_argument("--profile-duration", type=float, default=20.0)
    parser.add_argument("--profile-min-requests", type=int, default=10)
    parser.add_argument("--profile-arrivals", choices=("trace", "poisson"), default="trace",
                        help="the profile's arrivals: the cut's own, time-scaled to each "
                        "step's rate (default), or Poisson")
    parser.add_argument("--boot-seconds", type=float, default=SCALING["bootSeconds"],
                        help="the autoscaler's bootSeconds (default %(default)s)")
    parser.add_argument("--scale-down-seconds", type=float,
                        default=SCALING["scaleDownStabilizationSeconds"],
                        help="the autoscaler's scaleDownStabilizationSeconds (default %(default)s)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the configurations this many times, in alternating order")
    parser.add_argument("--logs", help="keep each run's `sluice up` output in this folder")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--tiny", action="store_true",
                        help="a ~2-minute smoke run: a 20 s cut, a one-rate profile, short windows")
    parser.add_argument("--out", default="bench/results/autoscale.json")
    args = parser.parse_args()
    scaling = {"bootSeconds": args.boot_seconds,
               "scaleDownStabilizationSeconds": args.scale_down_seconds}
    if args.tiny:
        for key, value in TINY.items():
            if key != "scaling":
                setattr(args, key, value)
        scaling = TINY["scaling"]

    base = yaml.safe_load(EXAMPLE.read_text())
    slo = {**base["spec"]["slo"], "ttftMs": args.slo_ttft_ms, "itlMs": args.slo_itl_ms,
           "percentile": args.slo_percentile}
    cut = Cut(args.trace, args.start, args.span, args.keep, args.time_scale or 1.0,
              args.input_scale, args.max_input, args.max_output, args.seed)
    trace = workload.read_trace(args.trace)
    if not cut_trace(trace, cut):
        print(f"bench/autoscale.py: no trace rows in the cut {cut}", file=sys.stderr)
        return 2
    model_path = store.fetch(args.model)
    load = Load(trace, cut, workload.Tokenizer(model_path / "tokenizer.json"), args.seed)

    def fit(capacity_rps: float) -> None:  # --time-scale unset: the load fits the capacity
        if args.time_scale is None:
            print(f"time scale: peak <= {args.peak_load:g} x {capacity_rps:g} req/s", flush=True)
            load.set(fit_time_scale(trace, cut, args.peak_load * capacity_rps))

    capacity = {"source": "--capacity-rps", "capacity_rps": args.capacity_rps}
    if args.capacity_rps is not None:
        fit(args.capacity_rps)
    rounds: dict[str, list[dict]] = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as tmp:
        workdir = Path(tmp)
        for r in range(args.rounds):  # alternating order: a drift in the machine's load
            order = args.configs if r % 2 == 0 else args.configs[::-1]  # hits all alike
            for config in order:
                profile_cb = None
                if capacity["capacity_rps"] is None:  # profile the first config's worker-0
                    if config == "autoscale":
                        print("bench/autoscale.py: the autoscaler needs a capacity: run a "
                              "static configuration first or pass --capacity-rps",
                              file=sys.stderr)
                        return 2

                    def profile_cb(worker_url: str) -> dict:
                        profiled = profile_capacity(worker_url, args.model, load.rows, slo,
                                                    args, workdir)
                        fit(_capacity_from(profiled)["capacity_rps"])
                        return profiled
                manifest = build_manifest(base, config, slo, capacity["capacity_rps"] or 1.0,
                                          scaling)
                print(f"\n== {config}, round {r + 1} of {args.rounds} ==", flush=True)
                raw = run_config(config, manifest, load, args.model, args, workdir,
                                 profile_cb)
                if args.logs:
                    Path(args.logs).mkdir(parents=True, exist_ok=True)
                    (Path(args.logs) / f"{config}-r{r + 1}.log").write_text(raw["log"])
                if raw["profile"] is not None:
                    capacity = _capacity_from(raw["profile"])
                    print(f"capacityRPS for the autoscaler: {capacity['capacity_rps']:g} "
                          f"({capacity['source']})", flush=True)
                run = summarize(raw, slo)
                rounds[config].append(run)
                print(f"{config}: {run['requests']} requests, SLO attained "
                      f"{run['attainment_pct']:.1f}%, {run['replica_seconds']:.0f} replica-s, "
                      f"{len(run['scale_events'])} scale events, {run['failed']} failed, "
                      f"{run['truncated']} truncated, load average "
                      f"{run['load_avg']['before'][0]:.1f} -> {run['load_avg']['after'][0]:.1f}",
                      flush=True)
    runs = {config: aggregate(rs) for config, rs in rounds.items()}

    title = (f"bench/autoscale.py: {load.info['requests']} requests from "
             f"{Path(args.trace).name} [{args.start:g}, {args.start + args.span:g}) s, SLO p"
             f"{slo['percentile']:g} TTFT <= {slo['ttftMs']:g} ms, ITL <= {slo['itlMs']:g} ms"
             + (f", mean of {args.rounds} rounds" if args.rounds > 1 else ""))
    print()
    print_table(runs, title)
    result = {"model": args.model, "cut": {**vars(load.cut), **load.info,
                                            "peak_load": args.peak_load
                                            if args.time_scale is None else None}, "slo": slo,
              "capacity": capacity, "manifest_autoscaling": build_manifest(
                  base, "autoscale", slo, capacity["capacity_rps"] or 1.0, scaling)["spec"][
                  "autoscaling"], "tiny": args.tiny, "rounds": args.rounds,
              "cores": len(os.sched_getaffinity(0)), "configs": runs}
    if {"autoscale", "static-2"} <= set(runs):
        result["targets"] = verdict(runs)
        v = result["targets"]
        print(f"autoscale vs static-2: attainment {v['attainment_points_vs_static_max']:+.1f} "
              f"points (target >= -{TARGET_POINTS:g}: "
              f"{'met' if v['attainment_met'] else 'missed'}), replica-seconds "
              f"{v['replica_seconds_ratio_vs_static_max']:.2f}x (target <= {TARGET_RATIO:g}: "
              f"{'met' if v['replica_seconds_met'] else 'missed'}), its failed/truncated "
              f"requests: {'none' if v['no_failed_or_truncated'] else 'some'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    png = plot(out.with_suffix(".png"), rounds, slo)
    print(f"wrote {png}")
    print(f"wrote {out}")
    return 0


def aggregate(runs: Sequence[dict]) -> dict:
    """One configuration over its rounds: means of the rates and costs, sums of the
    failures, every scale event (with its round); the rounds themselves under ``rounds``."""
    def mean(key: str) -> float:
        return sum(r[key] for r in runs) / len(runs)

    errors: Counter = Counter()
    for r in runs:
        errors.update(r["errors"])
    return {
        "requests": runs[0]["requests"],
        **{key: mean(key) for key in ("attainment_pct", "ttft_attainment_pct",
                                      "itl_attainment_pct", "replica_seconds", "mean_replicas",
                                      "window_s")},
        "ttft_p50_ms": _mean_of(r["ttft_ms"]["p50"] for r in runs),
        "ttft_p95_ms": _mean_of(r["ttft_ms"]["p95"] for r in runs),
        "scale_events": [{**e, "round": i + 1} for i, r in enumerate(runs)
                         for e in r["scale_events"]],
        "failed": sum(r["failed"] for r in runs),
        "truncated": sum(r["truncated"] for r in runs),
        "errors": dict(sorted(errors.items())),
        "rounds": list(runs),
    }


def _mean_of(values) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _capacity_from(profiled: dict) -> dict:
    """The autoscaler's capacityRPS from a profile: its capacity, or, when no rate met the
    SLO, the lowest rate tried (said so in ``source``)."""
    cap = profiled["capacity_rps"]
    source = (f"sluice profile (lengths from {Path(profiled['lengths_from']).name}, "
              f"{len(profiled['steps'])} steps)")
    if not cap:
        cap = profiled["steps"][0]["rate_rps"]
        source += ": no rate met the SLO; the lowest rate tried is used"
    return {"source": source, "capacity_rps": cap, "profile": profiled}


if __name__ == "__main__":
    sys.exit(main())
