"""Statistics, goodput and cost from request records (pure), and their outputs: a rich
table, a JSON file, PNG plots.

Definitions (llmperf's metrics, as the seed article lists them):
- duration: first send to last completion of the measured requests (warm-up excluded).
- rps: successful requests / duration; output_tok_s: their output tokens / duration.
- ttft, e2e: per successful request. itl: every per-token gap of every successful request,
  pooled (token-weighted). tpot: per successful request, the mean of its gaps.
- goodput: successful requests with ttft ≤ SLO and the ``slo_itl_percentile``-th percentile
  of their own gaps ≤ SLO, per second of duration. A request with no gap (one output token)
  passes the ITL objective. An objective that is not given is not checked.
- cost: ``cost_per_hour × replicas × duration``, shared over successful requests and over
  their output tokens.
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from sluice.bench.client import RequestRecord

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0–100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def describe(values: Sequence[float], scale: float = 1.0) -> dict:
    """``{count, mean, min, p50, p90, p99, max}`` of ``values × scale`` (None when empty)."""
    if not values:
        return {"count": 0, "mean": None, "min": None, "p50": None, "p90": None,
                "p99": None, "max": None}
    scaled = [v * scale for v in values]
    out = {"count": len(scaled), "mean": sum(scaled) / len(scaled), "min": min(scaled)}
    out.update({f"p{p}": percentile(scaled, p) for p in PERCENTILES})
    out["max"] = max(scaled)
    return out


def duration_s(records: Sequence[RequestRecord]) -> float:
    """First send to last completion (0 for no records)."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.start_s for r in records)


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_itl_ms: float | None,
              itl_percentile: float) -> bool:
    """Whether one request counts toward goodput (see the module docstring)."""
    if not record.ok or record.ttft_s is None:
        return False
    if slo_ttft_ms is not None and record.ttft_s * 1000.0 > slo_ttft_ms:
        return False
    if slo_itl_ms is not None and record.itl_s:
        return percentile(record.itl_s, itl_percentile) * 1000.0 <= slo_itl_ms
    return True


def cost(cost_per_hour: float | None, replicas: int, duration: float, requests: int,
         output_tokens: int) -> dict | None:
    """Run cost in the currency of ``cost_per_hour`` (per replica-hour); None without a price."""
    if cost_per_hour is None:
        return None
    total = cost_per_hour * replicas * duration / 3600.0
    return {"total": total,
            "per_request": total / requests if requests else None,
            "per_1m_output_tokens": total / output_tokens * 1e6 if output_tokens else None}


def summarize(records: Sequence[RequestRecord], slo_ttft_ms: float | None = None,
              slo_itl_ms: float | None = None, slo_itl_percentile: float = 90.0,
              cost_per_hour: float | None = None, replicas: int = 1) -> dict:
    """The run summary: counts, throughput, latency distributions (ms), goodput, errors, cost."""
    ok = [r for r in records if r.ok]
    duration = duration_s(records)
    out_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    good = None
    if slo_ttft_ms is not None or slo_itl_ms is not None:
        n_good = sum(meets_slo(r, slo_ttft_ms, slo_itl_ms, slo_itl_percentile) for r in ok)
        good = {"rps": per_s(n_good), "requests": n_good,
                "fraction": n_good / len(records) if records else 0.0,
                "slo_ttft_ms": slo_ttft_ms, "slo_itl_ms": slo_itl_ms,
                "slo_itl_percentile": slo_itl_percentile}
    return {
        "requests": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "rps": per_s(len(ok)),
        "output_tok_s": per_s(out_tokens),
        "input_tok_s": per_s(sum(r.input_tokens for r in ok)),
        "output_tokens": out_tokens,
        "input_tokens": sum(r.input_tokens for r in ok),
        "ttft_ms": describe([r.ttft_s for r in ok if r.ttft_s is not None], 1000.0),
        "itl_ms": describe([g for r in ok for g in r.itl_s], 1000.0),
        "tpot_ms": describe([sum(r.itl_s) / len(r.itl_s) for r in ok if r.itl_s], 1000.0),
        "e2e_ms": describe([r.e2e_s for r in ok if r.e2e_s is not None], 1000.0),
        "goodput": good,
        "errors": dict(sorted(Counter(r.error_code for r in records if not r.ok).items())),
        "token_count_mismatches": sum(1 for r in ok if r.usage_output_tokens is not None
                                      and r.usage_output_tokens != r.output_tokens),
        "cost": cost(cost_per_hour, replicas, duration, len(ok), out_tokens),
    }


# --------------------------------------------------------------------------- outputs


def table(summary: dict, title: str = "sluice bench"):
    """A rich Table of the summary."""
    from rich.table import Table

    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right")

    def row(name: str, stats: dict) -> None:
        t.add_row(name, *(_fmt(stats[c]) for c in ("mean", "p50", "p90", "p99")))

    row("TTFT (ms)", summary["ttft_ms"])
    row("ITL (ms)", summary["itl_ms"])
    row("TPOT (ms)", summary["tpot_ms"])
    row("E2E (ms)", summary["e2e_ms"])
    t.add_section()
    lines = [
        ("requests ok / total", f"{summary['succeeded']} / {summary['requests']}"),
        ("duration (s)", _fmt(summary["duration_s"])),
        ("requests/s", _fmt(summary["rps"])),
        ("output tokens/s", _fmt(summary["output_tok_s"])),
    ]
    if summary["goodput"]:
        g = summary["goodput"]
        lines.append(("goodput (req/s)", f"{_fmt(g['rps'])} ({g['fraction']:.0%} of requests)"))
    if summary["errors"]:
        lines.append(("errors", ", ".join(f"{k}: {v}" for k, v in summary["errors"].items())))
    if summary["cost"]:
        c = summary["cost"]
        lines.append(("cost / request", _fmt(c["per_request"], 6)))
        lines.append(("cost / 1M output tokens", _fmt(c["per_1m_output_tokens"], 4)))
    for name, value in lines:
        t.add_row(name, value, "", "", "")
    return t


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}f}"


def write_json(path: str | Path, config: dict, summary: dict,
               records: Iterable[RequestRecord], started_at: float | None = None) -> None:
    """``{"config", "started_at", "summary", "records"}``: ``started_at`` is the Unix time
    of offset 0 of the records' ``*_s`` times. NaN never appears (None instead)."""
    data = {"config": config, "started_at": started_at, "summary": summary,
            "records": [r.to_json() for r in records]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")


def plot(directory: str | Path, records: Sequence[RequestRecord]) -> list[Path]:
    """PNG histograms of TTFT, ITL and E2E, and latency over time; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.ok]
    series = {
        "ttft": [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
        "itl": [g * 1000 for r in ok for g in r.itl_s],
        "e2e": [r.e2e_s * 1000 for r in ok if r.e2e_s is not None],
    }
    files = []
    for name, values in series.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.hist(values, bins=min(50, max(5, len(values) // 4)) if values else 5)
        for p, style in zip(PERCENTILES, (":", "--", "-.")):
            if values:
                ax.axvline(percentile(values, p), color="k", linestyle=style, label=f"p{p}")
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("tokens" if name == "itl" else "requests")
        if values:
            ax.legend()
        files.append(_save(fig, out / f"{name}_hist.png"))
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, attr in (("E2E", "e2e_s"), ("TTFT", "ttft_s")):
        points = [(r.start_s, getattr(r, attr) * 1000) for r in ok if getattr(r, attr) is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], ".", label=name)
    failed = [r for r in records if not r.ok]
    if failed:
        ax.plot([r.start_s for r in failed], [0] * len(failed), "rx", label="error")
    ax.set_xlabel("request start (s)")
    ax.set_ylabel("latency (ms)")
    ax.legend()
    files.append(_save(fig, out / "latency_over_time.png"))
    return files


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
