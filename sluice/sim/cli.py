"""``sluice simulate``: replay a trace through the real routing and autoscaling decisions on
a virtual clock, one run per policy, beside the clairvoyant oracle.

    sluice simulate --trace /work/shared/traces/azure2023_conv.csv --profile P.json \\
        --policy sluice --policy kpa:target=8 --sweep --boot-time 30 --output sim.json

Steps: load the trace (× ``--scale-requests``) and the step profile; calibrate one replica
(capacity at the SLO, rate at full utilisation) unless ``--capacity-rps`` is given; the
oracle's schedule and replay; then each policy on the same simulated router. Prints a table
per policy and writes the figures as JSON (``--output``) and plots (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from sluice.argtypes import (count, fraction, milliseconds, output_dir, output_file, percent,
                             positive, positive_count, positive_milliseconds, positive_seconds,
                             seconds)
from sluice.worker.engine.config import DEFAULT_MAX_MODEL_LEN

logger = logging.getLogger(__name__)

ALL = ("static", "sluice", "kubeai", "kpa", "keda", "dynamo", "dynamo-reactive")
# sluice.sim.router.ROUTING, not imported: it pulls in the router (0.14 s on every `sluice`)
ROUTING = ("slo", "least-load", "round-robin")
# each baseline's main knob, swept (--sweep): static's as fractions of the oracle's peak
SWEEPS = {"static": (0.5, 0.75, 1.0), "sluice": (30, 60, 90, 120, 180, 300, 600),
          "kubeai": (1, 2, 4, 8, 16, 32), "kpa": (1, 2, 4, 8, 16, 32), "keda": (1, 2, 5, 10),
          "dynamo": (0.1, 0.25, 0.5, 0.75, 1.0), "dynamo-reactive": (0.25, 0.5, 1.0)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Azure 2023 CSV or Mooncake JSONL")
    parser.add_argument("--policy", action="append", default=[],
                        help="NAME[:knob=value,...]; repeatable (default: all of "
                        f"{', '.join(ALL)}); 'oracle' alone runs only the oracle")
    parser.add_argument("--sweep", action="store_true",
                        help="also run each chosen policy over its main knob")
    parser.add_argument("--profile", help="step profile JSON (sluice profile --steps; "
                        "default: the file in sluice/sim/profiles/ when it holds one; it "
                        "holds SmolLM2's and Qwen 0.5B's, so pass one)")
    parser.add_argument("--scale-requests", type=positive_count, default=1, metavar="K",
                        help="each request K times, copies within 1 s (time is not compressed)")
    parser.add_argument("--limit", type=positive_count, help="only the trace's first N requests")
    parser.add_argument("--boot-time", type=seconds, default=30.0, metavar="S",
                        help="mean seconds from start to ready (default 30)")
    parser.add_argument("--boot-jitter", type=fraction, default=0.2,
                        help="boot time spread: uniform ×[1-j, 1+j] (default 0.2)")
    parser.add_argument("--max-replicas", type=positive_count, default=1000)
    parser.add_argument("--max-model-len", type=positive_count, default=DEFAULT_MAX_MODEL_LEN,
                        help="the replicas' context length in tokens: longer requests (prompt "
                        "+ output) are refused by the worker, so left out (default "
                        f"{DEFAULT_MAX_MODEL_LEN}, the worker's cap)")
    parser.add_argument("--slo-ttft-ms", type=positive_milliseconds, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=milliseconds, default=200.0,
                        help="objective on a request's mean inter-token gap (0: none)")
    parser.add_argument("--attainment", type=percent, default=99.0,
                        help="percent of requests that must meet the SLO (sizing target)")
    parser.add_argument("--routing", default="slo", choices=ROUTING,
                        help="slo (default, as in the router) | least-load | round-robin; "
                        "least-load is about 4x faster to simulate. (The slo policy's former "
                        "five-feature TTFT model diverged here: "
                        "bench/results/sim_rls_divergence.json; its drain-rate model does not)")
    parser.add_argument("--candidates", type=count, default=4,
                        help="endpoints sampled per request (power of d; 0: all)")
    parser.add_argument("--hold-s", type=seconds, default=120.0,
                        help="seconds a request waits for a ready replica before refused")
    parser.add_argument("--capacity-rps", type=positive,
                        help="one replica's rate at the SLO (skip calibration; the "
                        "full-utilisation rate is then taken as 1.25× it)")
    parser.add_argument("--oracle-step", type=positive_seconds, default=10.0,
                        help="seconds per interval of the oracle's schedule")
    parser.add_argument("--oracle-passes", type=positive_count, default=5,
                        help="replays refining the oracle where it missed (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=output_file,
                        help="write the figures as JSON here (timelines: the "
                        "oracle and the asked-for runs, not the swept ones)")
    parser.add_argument("--plot", type=output_dir,
                        help="write PNG plots into this directory "
                        "(sim_<trace>_x<K>_boot<S>_attainment.png, …_timeline.png)")
    parser.add_argument("--no-progress", action="store_true")


def plan(specs: list[tuple[str, dict[str, float]]], sweep: bool,
         peak: int) -> list[tuple[str, str, dict[str, float], bool]]:
    """(label, policy, knobs, asked for) per run: each spec, and with ``sweep`` its main
    knob's other values (static's as fractions of the oracle's ``peak``). Labels name the
    main knob's value, e.g. ``kpa:target=32``. The oracle is run apart."""
    from sluice.sim.policies import KNOBS, default

    runs = []
    for name, knobs in specs:
        if name == "oracle":
            continue
        knob = KNOBS[name]
        taken = knobs.get(knob, peak if name == "static" else default(name, knob))
        label = f"{name}:{knob}={taken:g}" + "".join(
            f",{k}={v:g}" for k, v in knobs.items() if k != knob)
        runs.append((label, name, knobs, True))
        if sweep:
            values = [max(1, round(f * peak)) for f in SWEEPS[name]] if name == "static" \
                else SWEEPS[name]
            runs += [(f"{name}:{knob}={v:g}", name, {**knobs, knob: v}, False)
                     for v in dict.fromkeys(values) if v != taken]
    return runs


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    from sluice.sim import oracle as orc
    from sluice.sim import policies, profile, report
    from sluice.sim import trace as traces
    from sluice.sim.replica import EngineLimits
    from sluice.sim.simulator import SimConfig, Simulator

    err = Console(stderr=True)
    try:
        specs = [policies.parse(s) for s in args.policy or ALL]
        for i, spec in enumerate(specs):  # two rows of one name in the table and the JSON
            if spec in specs[:i]:
                raise ValueError(f"--policy {args.policy[i]} is given twice")
        probe = policies.Context(1.0, 1.0, args.boot_time, args.max_replicas, peak=1)
        for name, knobs in specs:  # a knob the policy does not take, before the long part
            if name != "oracle":
                policies.make(name, knobs, probe)
        path = args.profile or profile.default_path()
        if path is None:
            raise ValueError("no step profile: pass --profile (sluice profile --steps writes one)")
        model = profile.load(path)
        loaded = traces.load(args.trace, args.limit)
        limit = min(model.kv_capacity_tokens, args.max_model_len)
        why = (f"its whole KV pool ({limit:,} tokens in {path})"
               if limit == model.kv_capacity_tokens else f"--max-model-len {limit:,}")
        fitting, too_large = traces.without_too_large(loaded, limit)
        if not len(fitting):
            raise ValueError(f"{args.trace}: every request is longer than a replica serves: {why}")
        trace = traces.scale(fitting, args.scale_requests, args.seed)
        config = SimConfig(boot_s=args.boot_time, boot_jitter=args.boot_jitter,
                           max_replicas=args.max_replicas, ttft_slo_s=args.slo_ttft_ms / 1000,
                           itl_slo_s=args.slo_itl_ms / 1000 if args.slo_itl_ms else None,
                           hold_s=args.hold_s, routing=args.routing,
                           candidates=args.candidates, limits=EngineLimits(), seed=args.seed)
    except (ValueError, OSError) as exc:
        print(f"sluice simulate: {exc}", file=sys.stderr)
        return 2
    if too_large:
        first = too_large[0]
        err.print(f"left out {len(too_large):,} request{'s' if len(too_large) > 1 else ''} "
                  f"longer than a replica serves, {why}: the worker refuses them with a 400 "
                  f"whatever the fleet (the first: request {first + 1} by arrival, "
                  f"{loaded.prompt[first]:,} + {loaded.output[first]:,} tokens)")
    target = args.attainment / 100
    err.print(f"{len(trace):,} requests over {trace.span_s:,.0f} s; profile {model.model} "
              f"({path})")
    try:
        capacity, max_rps = (args.capacity_rps, 1.25 * args.capacity_rps) if args.capacity_rps \
            else orc.calibrate(trace, model, config, target)
    except ValueError as exc:
        print(f"sluice simulate: {exc}", file=sys.stderr)
        return 2
    err.print(f"one replica: {capacity:.3f} req/s at the SLO, {max_rps:.3f} req/s saturated")
    rows, results, shown = [], {}, ["oracle"]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[now]}"), TimeElapsedColumn(), console=err,
                  disable=args.no_progress) as bar:
        def tracker(label: str):
            task = bar.add_task(label, total=len(trace), now="")
            return lambda done, now: bar.update(task, completed=done, now=f"t={now:,.0f} s")

        started = time.perf_counter()
        result, counts = orc.oracle(trace, model, config, capacity, target,
                                    args.oracle_step, passes=args.oracle_passes,
                                    progress=tracker("oracle"))
        oracle_hours = report.replica_hours(result)
        rows.append(report.summarize("oracle", result, config, time.perf_counter() - started,
                                     oracle_hours))
        results["oracle"] = result
        ctx = policies.Context(capacity, max_rps, args.boot_time, args.max_replicas,
                               peak=max(counts), attainment_target=target)
        for label, name, knobs, asked in plan(specs, args.sweep, ctx.peak):
            policy = policies.make(name, knobs, ctx)
            initial = policy.replicas if isinstance(policy, policies.Static) else counts[0]
            started = time.perf_counter()
            result = Simulator(trace, model, config, policy, initial,
                               progress=tracker(label)).run()
            rows.append(report.summarize(label, result, config, time.perf_counter() - started,
                                         oracle_hours))
            results[label] = result
            if asked:
                shown.append(label)
    title = (f"{Path(args.trace).name} × {args.scale_requests}, boot {args.boot_time:g} s, "
             f"SLO TTFT {args.slo_ttft_ms:g} ms ITL {args.slo_itl_ms:g} ms, routing "
             f"{args.routing} (d={args.candidates}): one row per policy run")
    Console(width=max(140, Console().width)).print(report.table(rows, title))
    dominance = report.dominance(rows)
    for family, runs in dominance.items():
        err.print(f"sluice vs {family}: at no more replica-hours, sluice is higher on "
                  f"{runs['beaten']}, equal on {runs['tied']}, lower on {runs['ahead']} "
                  f"of its runs ({runs['cheaper']} cheaper than any sluice run)")
    if args.output:
        out = {"trace": str(args.trace), "requests": len(trace), "too_large": len(too_large),
               "span_s": trace.span_s,
               "scale_requests": args.scale_requests, "boot_s": args.boot_time,
               "boot_jitter": args.boot_jitter, "max_replicas": args.max_replicas,
               "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms,
                       "attainment_pct": args.attainment},
               "routing": {"policy": args.routing, "candidates": args.candidates},
               "profile": {"path": str(path), "model": model.model},
               "capacity_rps": capacity, "max_rps": max_rps, "oracle_schedule": counts,
               "oracle_step_s": args.oracle_step, "policies": rows, "dominance": dominance,
               "timeline_fields": ["t_s", "billed", "ready", "in_flight", "held"],
               "timelines": {k: [list(s) for s in results[k].timeline] for k in shown}}
        Path(args.output).write_text(json.dumps(out, indent=1))
    if args.plot:
        stem = f"{Path(args.trace).stem}_x{args.scale_requests}_boot{args.boot_time:g}"
        for p in report.plot(rows, {k: results[k] for k in shown}, config, Path(args.plot),
                             stem):
            err.print(f"wrote {p}")
    return 0
