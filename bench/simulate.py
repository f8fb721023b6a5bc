"""How fast `sluice simulate` runs: simulated requests per wall second and peak memory.

Each scale (trace × K requests on N replicas) runs in its own process (so the peak RSS is
its own): a fixed fleet of N ready replicas behind the simulated router (the production
routing decisions, d sampled candidates), the trace replayed once. The issue's target is
1,000 replicas × 1M requests (the conversation trace × 52) in under 10 minutes on 2 cores.

    .venv/bin/python bench/simulate.py --scale 1:100 --scale 5:200 \\
        --output bench/results/sim_speed.json

Without --profile it uses the SYNTHETIC step profile bench/results/sim_synthetic_profile.json
(labelled so in its model name): speed depends on the load's shape, not on its source.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SYNTHETIC = Path(__file__).parent / "results" / "sim_synthetic_profile.json"


def one(args: argparse.Namespace) -> dict:
    from sluice.sim import profile, trace
    from sluice.sim.oracle import Schedule
    from sluice.sim.simulator import SimConfig, Simulator

    model = profile.load(args.profile)
    k, n = (int(v) for v in args.one.split(":"))
    started = time.perf_counter()
    requests = trace.scale(trace.load(args.trace), k)
    load_s = time.perf_counter() - started
    config = SimConfig(routing=args.routing, candidates=args.candidates, max_replicas=n)
    started = time.perf_counter()
    result = Simulator(requests, model, config, Schedule([n], 3600.0), n).run()
    wall = time.perf_counter() - started
    return {"trace": Path(args.trace).name, "scale_requests": k, "replicas": n,
            "requests": len(requests), "routing": args.routing, "candidates": args.candidates,
            "profile": model.model, "load_s": round(load_s, 2), "sim_wall_s": round(wall, 2),
            "sim_requests_per_s": round(len(requests) / wall),
            "events": result.events, "events_per_s": round(result.events / wall),
            "simulated_s": round(result.end_s, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="/work/shared/traces/azure2023_conv.csv")
    parser.add_argument("--scale", action="append", default=[], metavar="K:N",
                        help="trace × K requests on N replicas (repeatable; default 1:100)")
    parser.add_argument("--routing", default="least-load",
                        help="least-load (default) | slo | round-robin")
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--profile", default=str(SYNTHETIC),
                        help="step profile JSON (default: the synthetic one)")
    parser.add_argument("--output", help="write the rows as JSON here")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return 0
    rows = []
    for scale in args.scale or ["1:100"]:
        cmd = [sys.executable, __file__, "--one", scale, "--trace", args.trace, "--routing",
               args.routing, "--candidates", str(args.candidates), "--profile", args.profile]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"bench/simulate.py: scale {scale} failed:\n{proc.stderr[-2000:]}",
                  file=sys.stderr)
            return 2
        rows.append(json.loads(proc.stdout))
        r = rows[-1]
        print(f"{r['requests']:>9,} requests × {r['replicas']:>5} replicas ({r['routing']}, "
              f"d={r['candidates']}): {r['sim_wall_s']:>7.1f} s wall, "
              f"{r['sim_requests_per_s']:>6,} req/s, {r['events_per_s']:>7,} events/s, "
              f"peak RSS {r['peak_rss_mib']} MiB", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"profile": args.profile, "rows": rows},
                                                indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
