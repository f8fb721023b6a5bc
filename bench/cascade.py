"""Cascade benchmark (issue 11): replay recorded answers into the quality-vs-cost figures.

No model runs here: the input is the JSONL that ``sluice cascade record`` writes (every tier's
answer to every item of the eval set, checked, with token logprobs), committed as
bench/results/cascade_records.jsonl so anyone (and CI) can replay it. Figures:

- each tier alone, per kind (arithmetic, code): accuracy; and the kinds where a smaller tier
  beats the top one;
- per signal (logprob quantile at q = 0.05, 0.1, 0.25; min logprob; mean logprob;
  ``checks``: q = 0.1 with answers a check proves wrong sent up at any threshold: code that
  fails the examples its prompt writes, arithmetic steps that do not add up; and
  ``q0.1 prefixK``: the router's ``prefix`` streaming mode, q = 0.1 over each answer's first K
  tokens, an escalated answer paying its prompt and those K tokens only), the curve of
  accuracy and compute against the share of requests answered by the top tier, one point
  per candidate threshold, over all items (the PNG);
- held-out: for targets 0.2 / 0.3 / 0.4 of top-tier share, 20 random halves, threshold
  calibrated on one half (``calibrate.threshold_for_share``) and measured on the other:
  accuracy relative to the top tier alone, top-tier share, compute relative to the top tier
  (every tier visited: (prompt + completion tokens) × the tier's cost, wasted tokens
  included); and, for q0.1 and checks, the same with a pre-route model fitted on each
  calibration half;
- pass/fail against the issue's targets, on the held-out means: >= 95 % of the top tier's
  accuracy, <= 40 % of requests at the top tier, <= 0.75 of its compute.

    .venv/bin/python bench/cascade.py [--records FILE] [--tiers a,b] [--costs 1,4]

Tiers default to the order of their first appearance in the file (the recorder writes an
item's tiers in the order given, smallest first); costs to 1, 2, 4, ... A missing records
file exits 2. Prints tables and writes JSON (default bench/results/cascade.json) and a PNG
beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sluice.argtypes import number, output_file  # noqa: E402
from sluice.cascade.calibrate import Replay, held_out, load_records  # noqa: E402

SIGNALS = {  # label → (signal, quantile, prefix tokens: None judges the whole answer)
    "q0.05": ("logprob-quantile", 0.05, None),
    "q0.1": ("logprob-quantile", 0.1, None),
    "q0.25": ("logprob-quantile", 0.25, None),
    "min": ("min-logprob", 0.1, None),
    "mean": ("mean-logprob", 0.1, None),
    "checks": ("checks", 0.1, None),  # q0.1, and answers a check proves wrong sent up
    "q0.1 prefix16": ("logprob-quantile", 0.1, 16),  # spec.cascade.streaming's default K
    "q0.1 prefix32": ("logprob-quantile", 0.1, 32),
}
DEFAULT = "q0.1"  # spec.cascade.escalation's defaults
PRE_ROUTED = (DEFAULT, "checks")  # signals also replayed with a pre-route
TARGETS = {"accuracy": 0.95, "top_share": 0.40, "cost": 0.75}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default="bench/results/cascade_records.jsonl")
    parser.add_argument("--tiers", default=None, help="comma-separated, smallest first")
    parser.add_argument("--costs", default=None, help="comma-separated, per tier")
    parser.add_argument("--targets", default="0.2,0.3,0.4", help="top-tier shares")
    parser.add_argument("--splits", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pre-route-share", type=number(strict=True, maximum=1.0), default=0.1)
    parser.add_argument("--out", type=output_file, default="bench/results/cascade.json")
    args = parser.parse_args()

    path = Path(args.records)
    if not path.exists():
        print(f"{path} is missing: record it first with `sluice cascade record` "
              "(see the module docstring)", file=sys.stderr)
        return 2
    records = load_records(path)
    tiers = args.tiers.split(",") if args.tiers else list(dict.fromkeys(r.tier for r in records))
    costs = [float(c) for c in args.costs.split(",")] if args.costs else None
    targets = [float(t) for t in args.targets.split(",")]
    replays = {label: Replay.build(records, tiers, signal, q, costs, prefix)
               for label, (signal, q, prefix) in SIGNALS.items()}
    base = replays[DEFAULT]
    if len(base) < 4:
        print(f"{path}: {len(base)} items answered by every tier of {tiers}; need >= 4",
              file=sys.stderr)
        return 2

    result = {"records": str(path), "items": len(base), "tiers": list(base.tiers),
              "costs": list(base.costs), "targets": TARGETS, "splits": args.splits,
              "seed": args.seed, **alone(base)}
    result["curves"] = {label: [point(o) for o in r.curve()] for label, r in replays.items()}
    result["held_out"] = {label: {f"{t:g}": held_out(r, target=t, splits=args.splits,
                                                       seed=args.seed).to_json()
                                  for t in targets} for label, r in replays.items()}
    if any(base.prompts):
        result["pre_route"] = {
            "max_share": args.pre_route_share, "signals": list(PRE_ROUTED),
            "fit_all": vars(base.fit_pre_route(args.pre_route_share)),
            "held_out": {label: {f"{t:g}": held_out(replays[label], target=t,
                                                     splits=args.splits, seed=args.seed,
                                                     pre_route_share=args.pre_route_share
                                                     ).to_json() for t in targets}
                         for label in PRE_ROUTED}}
    else:
        result["pre_route"] = None  # records without prompts
    result["verdict"] = verdict(result)

    print_tables(result)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    png = out.with_suffix(".png")
    plot(result, png)
    print(f"wrote {out} and {png}")
    return 0


def alone(replay: Replay) -> dict:
    """Each tier alone: accuracy per kind and overall, cost relative to the top tier; and
    the kinds where a smaller tier beats the top one."""
    kinds = sorted(set(replay.kinds))
    accuracy = {"all": replay.tier_accuracy(), **{k: replay.tier_accuracy(k) for k in kinds}}
    top_cost = sum(s[-1] for s in replay.spent)
    cost = {t: sum(s[j] for s in replay.spent) / top_cost for j, t in enumerate(replay.tiers)}
    top = replay.tiers[-1]
    better = {k: [t for t in replay.tiers[:-1] if accuracy[k][t] > accuracy[k][top]]
              for k in kinds}
    return {"tier_accuracy": accuracy, "tier_relative_cost": cost,
            "smaller_tier_better_at": {k: v for k, v in better.items() if v}}


def point(o) -> dict:
    return {"threshold": o.threshold, "top_share": o.top_share, "accuracy": o.accuracy,
            "relative_accuracy": o.relative_accuracy, "relative_cost": o.relative_cost}


def held_rows(result: dict) -> list[tuple[str, str, dict]]:
    """(signal label, target, held-out result) per row, the pre-route rows last."""
    rows = [(label, target, row) for label, by_target in result["held_out"].items()
            for target, row in by_target.items()]
    if result["pre_route"]:
        rows += [(f"{label}+pre-route", target, row)
                 for label, by_target in result["pre_route"]["held_out"].items()
                 for target, row in by_target.items()]
    return rows


def verdict(result: dict) -> dict:
    """Which (signal, target) rows meet all three targets on the held-out means."""
    rows = held_rows(result)
    meeting = [{"signal": label, "target": t} for label, t, row in rows if row["meets_targets"]]
    return {"meets": bool(meeting), "rows": len(rows), "rows_meeting": meeting,
            "default_signal_meets": any(m["signal"].startswith(DEFAULT) for m in meeting)}


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    tiers = result["tiers"]
    t = Table(title=f"each tier alone ({result['items']} items)", header_style="bold")
    t.add_column("kind")
    for tier in tiers:
        t.add_column(tier, justify="right")
    for kind, row in result["tier_accuracy"].items():
        t.add_row(kind, *(f"{row[tier]:.1%}" for tier in tiers))
    t.add_row("cost vs top", *(f"{result['tier_relative_cost'][tier]:.2f}" for tier in tiers))
    console.print(t)

    t = Table(title=f"held out: {result['splits']} random halves, mean ± sd (targets: "
              f">= {TARGETS['accuracy']:.0%} of top accuracy, <= {TARGETS['top_share']:.0%} "
              f"at top, <= {TARGETS['cost']} of top compute)", header_style="bold")
    for col in ("signal", "target", "vs top accuracy", "top share", "cost vs top", "meets"):
        t.add_column(col, justify="left" if col == "signal" else "right")
    for label, target, row in held_rows(result):
        t.add_row(label, target, _pm(row["relative_accuracy"], "%"), _pm(row["top_share"], "%"),
                  _pm(row["relative_cost"], "f"), "yes" if row["meets_targets"] else "no")
    console.print(t)
    v = result["verdict"]
    console.print(f"targets met: {'yes' if v['meets'] else 'no'} "
                  f"({len(v['rows_meeting'])} of {v['rows']} rows; "
                  f"default signal {DEFAULT}: {'yes' if v['default_signal_meets'] else 'no'})")


def _pm(spread: dict, style: str) -> str:
    if style == "%":
        return f"{spread['mean']:.1%} ± {spread['sd']:.1%}"
    return f"{spread['mean']:.2f} ± {spread['sd']:.2f}"


def plot(result: dict, path: Path) -> None:
    """Accuracy and compute against the top-tier share, one line per signal; each tier
    alone as a point; the targets dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, cost) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, points in result["curves"].items():
        xs = [p["top_share"] for p in points]
        acc.plot(xs, [p["accuracy"] for p in points], label=label,
                 lw=2 if label == DEFAULT else 1)
        cost.plot(xs, [p["relative_cost"] for p in points], label=label)
    tiers, accuracy = result["tiers"], result["tier_accuracy"]["all"]
    for j, (tier, marker) in enumerate(((tiers[0], "o"), (tiers[-1], "s"))):
        x = 0.0 if j == 0 else 1.0
        acc.plot([x], [accuracy[tier]], marker, color="black", label=f"{tier} alone")
        cost.plot([x], [result["tier_relative_cost"][tier]], marker, color="black")
    top = accuracy[tiers[-1]]
    acc.axhline(TARGETS["accuracy"] * top, ls="--", color="grey", lw=0.8)
    acc.axvline(TARGETS["top_share"], ls="--", color="grey", lw=0.8)
    cost.axhline(TARGETS["cost"], ls="--", color="grey", lw=0.8)
    cost.axvline(TARGETS["top_share"], ls="--", color="grey", lw=0.8)
    acc.set(xlabel="share of requests answered by the top tier", ylabel="accuracy",
            title=f"accuracy ({result['items']} items, all)")
    cost.set(xlabel="share of requests answered by the top tier",
             ylabel="compute / top tier alone", title="compute (wasted tokens included)")
    acc.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
