"""bench/autoscale.py's question asked of the simulator over many trace cuts, in seconds.

The real benchmark replays one cut against real workers (~20 minutes for three
configurations); this replays several cuts of the same kind (``bench/autoscale.py``'s
``Cut``: a stretch of an Azure 2023 trace, thinned, time-scaled, lengths scaled and capped)
through ``sluice simulate`` with the same fleet: max 2 replicas, the benchmark's boot
(2 s: a 1-thread SmolLM2 worker forked by sluice up, start to routed), the benchmark's SLO, the
measured SmolLM2 step profile, and one replica's capacity calibrated by the simulator for
each cut's lengths. Per cut it runs the clairvoyant oracle (the best any policy could do),
static 1 and 2 replicas, and Sluice's policy (``recommend`` every 0.5 s as ``sluice up``
decides, ``--tick-s``; the benchmark's scale-down window), and reports SLO attainment (both objectives) and replica-hours relative to static-2.

Issue 9's target, per cut: Sluice within 1 point of static-2's attainment at <= 70 % of its
replica-seconds. The oracle's column says whether a cut allows it at all.

Each cut is replayed at several phases against the decision ticks (``--shift``: every
arrival but the first moved by S seconds; default 0, 1/4, 1/2 and 3/4 of a tick): a policy
whose verdict depends on which tick a cluster of requests falls in passes one phase and
fails the next (one cut went 100 → 92.5 % with a 0.25 s shift before bursts were tested on
every span ending at a tick).

    .venv/bin/python bench/autoscale_sim.py [--cut START,SPAN,KEEP,TIME_SCALE[,TRACE]]...
        [--shift S]...

Prints a table and writes JSON (default bench/results/autoscale_sim.json).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from autoscale import (SCALING, TARGET_POINTS, TARGET_RATIO, TRACES, Cut,  # noqa: E402
                       cut_trace, describe_cut, write_azure_csv)
from sluice.bench import workload  # noqa: E402
from sluice.cli import main as sluice_main  # noqa: E402

PROFILE = ROOT / "sluice" / "sim" / "profiles" / "SmolLM2-135M-Instruct.json"
POLICIES = {"oracle": "oracle", "static-1": "static:replicas=1",
            "static-2": "static:replicas=2", "sluice": "sluice:down={down:g},tick={tick:g}"}
# (start s, span s, keep, time scale, trace): code-trace stretches that static-2 serves
# (>= 95 % in the simulator), bench/autoscale.py's default first, and a 10x-compressed
# conversation trace, whose load ramps instead of switching on and off.
CUTS = [(2100, 600, 0.04, 0.5, "code"), (0, 600, 0.04, 0.5, "code"),
        (1200, 600, 0.04, 0.5, "code"), (1800, 600, 0.04, 0.5, "code"),
        (500, 440, 0.03, 0.7, "code"), (0, 3500, 0.01, 0.1, "conv")]


def run_cut(cut: Cut, shift_s: float, args: argparse.Namespace, workdir: Path) -> dict:
    """One cut through the simulator, every arrival but the first ``shift_s`` later; its
    row."""
    rows = cut_trace(workload.read_trace(cut.trace), cut)
    rows = rows[:1] + [replace(r, arrival_s=r.arrival_s + shift_s) for r in rows[1:]]
    info = describe_cut(rows, cut)
    name = f"{Path(cut.trace).stem}_{cut.start_s:g}_{cut.span_s:g}_{cut.keep:g}_{cut.time_scale:g}"
    trace, output = workdir / f"{name}_{shift_s:g}.csv", workdir / f"{name}_{shift_s:g}.json"
    write_azure_csv(rows, trace)
    argv = ["--log-level", "WARNING", "simulate", "--trace", str(trace), "--profile",
            str(args.profile), "--boot-time", str(args.boot_s), "--max-replicas", "2",
            "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms),
            "--attainment", str(args.attainment),
            "--no-progress", "--oracle-passes", "1", "--output", str(output)]
    for policy in list(POLICIES.values())[1:]:  # the simulator runs the oracle anyway
        argv += ["--policy", policy.format(down=args.scale_down_s, tick=args.tick_s)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = sluice_main(argv)
    if status != 0:
        raise RuntimeError(f"sluice simulate failed on {name}")
    sim = json.loads(output.read_text())
    runs = dict(zip(POLICIES, sim["policies"], strict=True))  # in the order asked
    base = runs["static-2"]["replica_hours"]
    row = {"cut": name, "shift_s": shift_s, "requests": info["requests"],
           "peak_rps_10s": info["peak_rps_10s"],
           "idle_10s_bins": info["idle_10s_bins"], "capacity_rps": sim["capacity_rps"]}
    for column, run in runs.items():
        row[column] = {"policy": run["policy"], "attainment_pct": run["slo_attainment_pct"],
                       "replica_ratio": run["replica_hours"] / base,
                       "scale_events": run["scale_events"]}
    s2, sl = row["static-2"], row["sluice"]
    row["target_met"] = (sl["attainment_pct"] >= s2["attainment_pct"] - TARGET_POINTS
                         and sl["replica_ratio"] <= TARGET_RATIO)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cut", action="append", default=[],
                        help="START,SPAN,KEEP,TIME_SCALE[,code|conv] (repeatable)")
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--boot-s", type=float, default=SCALING["bootSeconds"])
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=300.0)
    parser.add_argument("--attainment", type=float, default=99.0,
                        help="percent of requests that must meet the SLO: the percentile "
                        "one replica's capacity is calibrated at (default %(default)g)")
    parser.add_argument("--scale-down-s", type=float,
                        default=SCALING["scaleDownStabilizationSeconds"],
                        help="Sluice's scale-down window (default: the benchmark manifest's)")
    parser.add_argument("--tick-s", type=float, default=0.5,
                        help="seconds between Sluice's decisions (default: sluice up's)")
    parser.add_argument("--shift", action="append", type=float, default=[],
                        help="seconds every arrival but the first is moved (repeatable; "
                        "default 0 and 1/4, 1/2, 3/4 of --tick-s)")
    parser.add_argument("--out", default="bench/results/autoscale_sim.json")
    args = parser.parse_args()
    specs = [tuple(c.split(",")) for c in args.cut] or CUTS
    cuts = [Cut(str(TRACES / f"azure2023_{(s[4:] or ['code'])[0]}.csv"), float(s[0]),
                float(s[1]), float(s[2]), float(s[3]), 1 / 16, 256, 32, 0) for s in specs]
    shifts = args.shift or [args.tick_s * k / 4 for k in range(4)]
    with tempfile.TemporaryDirectory(prefix="autoscale-sim-") as tmp:
        rows = [run_cut(cut, shift, args, Path(tmp)) for cut in cuts for shift in shifts]
    cols = tuple(POLICIES)
    print(f"{'cut':34s} {'shift':>5s} {'req':>4s} {'peak':>5s} {'cap':>5s} " +
          " ".join(f"{c:>19s}" for c in cols) + "  target")
    for row in rows:
        cells = " ".join(f"{row[c]['attainment_pct']:6.1f}% {row[c]['replica_ratio']:4.2f}x "
                         f"ev{row[c]['scale_events']:<3d}" for c in cols)
        print(f"{row['cut']:34s} {row['shift_s']:5.3f} {row['requests']:4d} "
              f"{row['peak_rps_10s']:5.1f} {row['capacity_rps']:5.2f} {cells}  "
              f"{'met' if row['target_met'] else 'missed'}")
    met = sum(row["target_met"] for row in rows)
    worst = min(row["sluice"]["attainment_pct"] for row in rows)
    print("cells: SLO attainment (TTFT and ITL), replica-hours / static-2's, scale events; "
          f"target: sluice >= static-2 - {TARGET_POINTS:g} point at <= {TARGET_RATIO:.0%}\n"
          f"target met on {met} of {len(rows)} cut-phases; Sluice's lowest attainment "
          f"{worst:.1f} %")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"boot_s": args.boot_s, "tick_s": args.tick_s, "shifts_s": shifts,
                               "target_met": met, "runs": len(rows),
                               "profile": Path(args.profile).name,
                               "slo": {"ttftMs": args.slo_ttft_ms, "itlMs": args.slo_itl_ms,
                                       "attainmentPct": args.attainment},
                               "cuts": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
