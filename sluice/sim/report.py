"""Figures of a run (attainment, TTFT percentiles, replica-hours), the table and the plots.

Attainment counts every request of the trace: a refused one misses both objectives; ITL
attainment is over requests of two or more output tokens (a mean inter-token gap exists).
Percentiles are nearest-rank over all requests, a refused one counting as infinite.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from sluice.sim.simulator import Result, SimConfig

logger = logging.getLogger(__name__)

SUMMARY_KEYS = ("policy", "requests", "ttft_attainment_pct", "itl_attainment_pct",
                "slo_attainment_pct", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                "e2e_p50_ms", "replica_hours", "oracle_ratio", "peak_replicas", "scale_events",
                "refused", "preemptions", "prefix_hit_tokens", "ttft_mape_pct", "sim_wall_s",
                "sim_requests_per_s")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile (0–100) of an ascending list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def replica_hours(result: Result) -> float:
    return sum(stop - start for start, stop in zip(result.starts, result.stops)) / 3600.0


def summarize(name: str, result: Result, config: SimConfig, wall_s: float,
              oracle_hours: float | None) -> dict[str, Any]:
    """The row of ``SUMMARY_KEYS`` for one run (times in ms, attainment in %)."""
    n = len(result.arrival_s)
    ttfts, e2es, ttft_met, itl_met, itl_total, both = [], [], 0, 0, 0, 0
    for t, first, done, out in zip(result.arrival_s, result.first_s, result.done_s,
                                   result.output):
        ttft = first - t if first == first else math.inf  # NaN: refused
        ttfts.append(ttft)
        e2es.append(done - t if done == done else math.inf)
        ok = ttft <= config.ttft_slo_s
        ttft_met += ok
        if out > 1:
            itl_total += 1
            gap_ok = ttft < math.inf and (config.itl_slo_s is None
                                          or (done - first) / (out - 1) <= config.itl_slo_s)
            itl_met += gap_ok
            ok = ok and gap_ok
        both += ok
    ttfts.sort()
    e2es.sort()
    hours = replica_hours(result)
    return {"policy": name, "requests": n,
            "ttft_attainment_pct": round(100 * ttft_met / n, 3),
            "itl_attainment_pct": round(100 * itl_met / itl_total, 3) if itl_total else None,
            "slo_attainment_pct": round(100 * both / n, 3),
            "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p90_ms": _ms(percentile(ttfts, 90)),
            "ttft_p99_ms": _ms(percentile(ttfts, 99)), "e2e_p50_ms": _ms(percentile(e2es, 50)),
            "replica_hours": round(hours, 4),
            "oracle_ratio": round(hours / oracle_hours, 3) if oracle_hours else None,
            "peak_replicas": max((b for _, b, *_ in result.timeline), default=0),
            "scale_events": result.scale_events, "refused": result.refused,
            "preemptions": result.preemptions, "prefix_hit_tokens": result.prefix_hit_tokens,
            "ttft_mape_pct": round(100 * result.ttft_mape, 1),
            "sim_wall_s": round(wall_s, 2),
            "sim_requests_per_s": round(n / wall_s) if wall_s > 0 else None}


def _ms(seconds: float) -> float | None:
    return round(1000 * seconds, 1) if math.isfinite(seconds) else None


def table(rows: list[dict[str, Any]], title: str) -> Any:
    """A rich Table of the summaries."""
    from rich.table import Table

    t = Table(title=title)
    columns = [("policy", "policy"), ("TTFT ok %", "ttft_attainment_pct"),
               ("ITL ok %", "itl_attainment_pct"), ("TTFT p50 ms", "ttft_p50_ms"),
               ("p90", "ttft_p90_ms"), ("p99", "ttft_p99_ms"), ("replica-h", "replica_hours"),
               ("× oracle", "oracle_ratio"), ("peak", "peak_replicas"),
               ("scale events", "scale_events"), ("refused", "refused"),
               ("TTFT MAPE %", "ttft_mape_pct")]
    for header, _ in columns:
        t.add_column(header, justify="left" if header == "policy" else "right")
    for row in rows:
        t.add_row(*("-" if row[key] is None else str(row[key]) for _, key in columns))
    return t


def dominance(rows: list[dict[str, Any]], ours: str = "sluice") -> dict[str, dict[str, int]]:
    """Does ``ours``'s curve dominate each baseline's (issue 12: higher attainment at equal
    replica-hours)? Each baseline run is set against the best SLO attainment among ``ours``'s
    runs at no more replica-hours (a step frontier, no interpolation).

    Returns:
        family → counts of its runs: ``beaten`` (ours higher), ``tied``, ``ahead`` (the
        baseline higher), ``cheaper`` (fewer replica-hours than any run of ours: not
        compared). Empty without runs of ``ours``.
    """
    frontier = [(r["oracle_ratio"], r["slo_attainment_pct"]) for r in rows
                if r["policy"].split(":")[0] == ours]
    if not frontier:
        return {}
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        family = row["policy"].split(":")[0]
        if family in (ours, "oracle"):
            continue
        counts = out.setdefault(family, dict.fromkeys(("beaten", "tied", "ahead", "cheaper"), 0))
        best = max((a for r, a in frontier if r <= row["oracle_ratio"]), default=None)
        theirs = row["slo_attainment_pct"]
        key = "cheaper" if best is None else "beaten" if best > theirs else \
            "tied" if best == theirs else "ahead"
        counts[key] += 1
    return out


def ttft_over_time(result: Result, bin_s: float = 30.0) -> list[tuple[float, float]]:
    """(bin start s, p90 TTFT s) by arrival time; refused requests count as infinite."""
    bins: dict[int, list[float]] = {}
    for t, first in zip(result.arrival_s, result.first_s):
        bins.setdefault(int(t // bin_s), []).append(first - t if first == first else math.inf)
    return [(k * bin_s, percentile(sorted(v), 90)) for k, v in sorted(bins.items())]


ATTAINMENT_FLOOR_PCT = 90.0  # the attainment plot's floor: runs below it sit on it (▼)


def plot_attainment(rows: list[dict[str, Any]], ylabel: str, path: Path) -> None:
    """Attainment against replica-hours ÷ the oracle's (log scale), a curve per policy over
    its knob (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        families.setdefault(row["policy"].split(":")[0], []).append(row)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for family, members in families.items():
        members = sorted(members, key=lambda r: r["oracle_ratio"])
        x = [r["oracle_ratio"] for r in members]
        y = [max(r["slo_attainment_pct"], ATTAINMENT_FLOOR_PCT) for r in members]
        line, = ax.plot(x, y, marker="*" if family == "oracle" else "o", ms=10 if family ==
                        "oracle" else 5, label=family)
        low = [(a, b) for a, b, r in zip(x, y, members)
               if r["slo_attainment_pct"] < ATTAINMENT_FLOOR_PCT]
        if low:
            ax.plot(*zip(*low), ls="none", marker="v", ms=9, color=line.get_color())
    ax.set_xscale("log")
    ax.set_ylim(ATTAINMENT_FLOOR_PCT - 0.5, 100.2)
    ax.axhline(99.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("replica-hours ÷ the oracle's (log)")
    ax.set_ylabel(ylabel + f"; ▼ below {ATTAINMENT_FLOOR_PCT:g}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot(rows: list[dict[str, Any]], shown: dict[str, Result], config: SimConfig,
         directory: Path, stem: str) -> list[Path]:
    """Under ``directory``: ``sim_<stem>_attainment.png`` (every row, ``plot_attainment``) and ``sim_<stem>_timeline.png``
    (replicas and p90 TTFT over time of the ``shown`` runs); [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots")
        return []
    directory.mkdir(parents=True, exist_ok=True)
    label = (f"requests within SLO (TTFT ≤ {config.ttft_slo_s * 1000:g} ms"
             + (f", ITL ≤ {config.itl_slo_s * 1000:g} ms" if config.itl_slo_s else "") + "), %")
    paths = [directory / f"sim_{stem}_attainment.png"]
    plot_attainment(rows, label, paths[0])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, result in shown.items():
        top.step([s[0] for s in result.timeline], [s[1] for s in result.timeline], where="post",
                 label=name)
        points = ttft_over_time(result)
        bottom.plot([p[0] for p in points], [min(p[1], 60.0) for p in points], label=name)
    top.set_ylabel("replicas (billed)")
    bottom.set_ylabel("TTFT p90 by arrival, s (cut at 60)")
    bottom.axhline(config.ttft_slo_s, color="k", lw=0.8, ls="--")
    bottom.set_yscale("log")
    bottom.set_xlabel("trace time, s")
    top.legend(fontsize=7)
    paths.append(directory / f"sim_{stem}_timeline.png")
    fig.savefig(paths[1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths
