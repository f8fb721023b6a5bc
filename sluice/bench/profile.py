"""`sluice profile`: one replica's capacity at the SLO's tail, for ``spec.autoscaling.capacityRPS``.

Drives one server (a worker, or a router in front of one) with open-loop arrivals at
increasing rates, one step per rate: Poisson, or (``--arrivals trace``) a stretch of the
``--lengths-from`` trace's own arrivals (consecutive rows), time-scaled to deliver the
step's rate, so that the capacity holds for that traffic's bursts (the wait in a queue
grows with the arrivals' burstiness, as the square of their gaps' coefficient of
variation: Kingman's formula), through `sluice bench`'s runner; each step's
requests all finish before the next step starts. A step *meets* the objectives when every
request succeeded, the p{percentile} TTFT is within ``--slo-ttft-ms`` and the p{percentile}
ITL is within ``--slo-itl-ms``. Stepping stops at the first rate that misses; ``--refine``
bisection steps then narrow the gap between it and the highest rate that met. The capacity
is the highest rate that met below the lowest that missed (0 when even the lowest missed).

    rate (req/s)  0.25   0.5    1     2     4          then 1.5 (no), 1.2 (yes)
    met?           yes   yes   yes    no    (not run)      → capacity_rps = 1.2

Per-request ITL is the request's mean inter-token gap, the quantity the router's SLO
verdicts use (``sluice.router.demand``); a request with one output token has none and meets
the ITL objective. A failed request misses both objectives.

Exit status: 0 measured (the capacity may be 0: the last line says so); 2 bad arguments or
no usable server (nothing measured); 130 interrupted (Ctrl-C).

``sluice profile --steps --model NAME`` measures something else, in-process, with no server:
the native engine's step time over a grid of batch shapes, and the simulator's step-time
model fitted to it (``sluice.bench.steps``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import random
import sys
from collections.abc import Sequence
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from sluice.argtypes import (count, percent, positive_count, positive_milliseconds,
                             positive_seconds, server_url)
from sluice.bench import report, schedule, steps as step_profile, workload
from sluice.bench.client import RequestRecord
from sluice.bench.runner import LoadConfig, run as run_load

logger = logging.getLogger(__name__)

DEFAULT_RATES = "0.25,0.5,1,1.5,2,3,4,6,8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", type=server_url, help="worker or router base URL, e.g. "
                        "http://127.0.0.1:8001 (one replica behind it); required without --steps")
    parser.add_argument("--model", required=True, help="model name sent in each request "
                        "(with --steps: a store name or converted model folder)")
    parser.add_argument("--tokenizer", help="tokenizer.json, a model folder or a model-store "
                        "name (default: --model in the model store)")
    parser.add_argument("--slo-ttft-ms", type=positive_milliseconds,
                        help="TTFT objective (ms); required without --steps")
    parser.add_argument("--slo-itl-ms", type=positive_milliseconds,
                        help="ITL objective (ms): a request's "
                        "mean inter-token gap; required without --steps")
    parser.add_argument("--percentile", type=percent, default=95.0,
                        help="the objectives hold at this percentile of requests (default 95)")
    parser.add_argument("--input-len", type=positive_count, default=128,
                        help="prompt tokens per request")
    parser.add_argument("--output-len", type=positive_count, default=64,
                        help="output tokens per request (exact: ignore_eos)")
    parser.add_argument("--lengths-from", metavar="TRACE",
                        help="draw each request's input and output lengths from a row of this "
                        "trace (Azure 2023 CSV or Mooncake JSONL; seeded, with replacement) "
                        "instead of --input-len/--output-len: the capacity for the trace's "
                        "length mix, which a long tail of prompts puts below the mean's")
    parser.add_argument("--arrivals", choices=("poisson", "trace"), default="poisson",
                        help="poisson (default), or trace: each step replays a stretch of the "
                        "--lengths-from trace, its arrivals time-scaled to the step's mean rate "
                        "and each request with its own row's lengths: the capacity for that "
                        "traffic's burstiness (on-off traffic holds far less than Poisson)")
    parser.add_argument("--rates", default=DEFAULT_RATES,
                        help=f"comma-separated request rates (req/s), tried in increasing order "
                        f"(default {DEFAULT_RATES})")
    parser.add_argument("--refine", type=count, default=2,
                        help="after the first rate that misses, this many bisection steps "
                        "between it and the capacity so far (default 2: the listed rates are "
                        "coarse, e.g. 0.25 met and 0.5 missed)")
    parser.add_argument("--duration", type=positive_seconds, default=30.0,
                        help="seconds of arrivals per rate (default 30)")
    parser.add_argument("--min-requests", type=positive_count, default=10,
                        help="at least this many requests per rate: a low rate's step runs "
                        "longer than --duration (default 10)")
    parser.add_argument("--request-timeout", type=positive_seconds, default=120.0,
                        help="seconds per request; a request past it fails (default 120)")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals")
    parser.add_argument("--output", help="write the profile as JSON")
    step_profile.add_arguments(parser)


@dataclass(frozen=True)
class Objectives:
    """The SLO a step is judged by: ``ttft_ms`` and ``itl_ms`` at the ``percentile``-th
    percentile (0–100] of requests."""

    ttft_ms: float
    itl_ms: float
    percentile: float = 95.0


@dataclass(frozen=True)
class Step:
    """One rate's result.

    Attributes:
        rate_rps: the offered Poisson rate (requests/s).
        requests, failed: requests sent / of those, not answered in full.
        duration_s: first send to last completion (s).
        ttft_ms, itl_ms: the objectives' percentile of TTFT and of per-request mean ITL
            over successful requests (ms; None when there is none).
        attainment: fraction of requests that met both objectives (0–1).
        met: every request succeeded and both percentiles are within the objectives.
        errors: failed requests by error code (``RequestRecord.error_code``).
    """

    rate_rps: float
    requests: int
    failed: int
    duration_s: float
    ttft_ms: float | None
    itl_ms: float | None
    attainment: float
    met: bool
    errors: dict[str, int] = field(default_factory=dict)


def mean_itl_s(record: RequestRecord) -> float | None:
    """A request's mean inter-token gap (s); None with fewer than two output tokens."""
    return sum(record.itl_s) / len(record.itl_s) if record.itl_s else None


def verdicts(record: RequestRecord, ttft_ms: float | None, itl_ms: float | None
             ) -> tuple[bool, bool]:
    """(TTFT met, ITL met) for one request, as the router judges them: a failed request
    meets neither; no ITL (one token) meets the ITL objective; None objectives are met."""
    if not record.ok or record.ttft_s is None:
        return False, False
    ttft_ok = ttft_ms is None or record.ttft_s * 1000.0 <= ttft_ms
    itl = mean_itl_s(record)
    return ttft_ok, itl_ms is None or itl is None or itl * 1000.0 <= itl_ms


def judge(rate_rps: float, records: Sequence[RequestRecord], slo: Objectives) -> Step:
    """One step's statistics and verdict from its finished records (pure)."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None]
    itls = [g * 1000.0 for r in ok if (g := mean_itl_s(r)) is not None]
    ttft_p = report.percentile(ttfts, slo.percentile) if ttfts else None
    itl_p = report.percentile(itls, slo.percentile) if itls else None
    both = sum(all(verdicts(r, slo.ttft_ms, slo.itl_ms)) for r in records)
    met = (bool(records) and len(ok) == len(records) and ttft_p is not None
           and ttft_p <= slo.ttft_ms and (itl_p is None or itl_p <= slo.itl_ms))
    errors = Counter(r.error_code or "unknown" for r in records if not r.ok)
    return Step(rate_rps, len(records), len(records) - len(ok), report.duration_s(records),
                ttft_p, itl_p, both / len(records) if records else 0.0, met,
                dict(sorted(errors.items())))


def capacity(steps: Sequence[Step]) -> float:
    """The highest rate (req/s) that met below the lowest rate that missed; 0.0 when none
    did (the first step missed)."""
    missed = min((s.rate_rps for s in steps if not s.met), default=math.inf)
    return max((s.rate_rps for s in steps if s.met and s.rate_rps < missed), default=0.0)


def refine_rate(steps: Sequence[Step]) -> float | None:
    """The next rate of the bisection between the capacity so far and the lowest rate that
    missed: their midpoint to two significant digits (req/s); None without such a bracket
    (nothing met, or nothing missed) or once the midpoint rounds onto one of its ends."""
    missed = min((s.rate_rps for s in steps if not s.met), default=None)
    low = capacity(steps)
    if missed is None or low == 0:
        return None
    mid = float(f"{(low + missed) / 2:.2g}")
    return mid if low < mid < missed else None


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2"`` → ``[0.5, 1.0, 2.0]``, sorted and without duplicates.

    Raises:
        ValueError: an empty list, or a rate that is not a finite number > 0.
    """
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates or not all(r > 0 and math.isfinite(r) for r in rates):
        raise ValueError(f"--rates must be positive request rates (req/s), got {text!r}")
    return sorted(set(rates))


def _check(args: argparse.Namespace) -> list[float]:
    """The rates; raises ValueError naming the first bad argument."""
    if None in (args.url, args.slo_ttft_ms, args.slo_itl_ms):
        raise ValueError("--url, --slo-ttft-ms and --slo-itl-ms are required (or --steps)")
    rates = parse_rates(args.rates)
    if args.arrivals == "trace" and not args.lengths_from:
        raise ValueError("--arrivals trace replays the --lengths-from trace: pass one")
    return rates


def check_server(url: str, model: str, timeout_s: float = 5.0) -> None:
    """Raises ValueError unless ``url`` answers ``GET /v1/models`` listing ``model``."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s, trust_env=False)
        response.raise_for_status()
        served = [m.get("id") for m in response.json().get("data", [])]
    except httpx.HTTPError as exc:
        raise ValueError(f"no server at {url} ({type(exc).__name__}: {exc}); start a worker "
                         "with `sluice worker` or pass --url") from None
    except (ValueError, AttributeError):
        raise ValueError(f"{url}/v1/models is not an OpenAI model list") from None
    if model not in served:
        raise ValueError(f"{url} does not serve {model!r} (it serves: "
                         f"{', '.join(map(str, served)) or 'none'})")


def step_specs(builder: workload.PromptBuilder, rate_rps: float, args: argparse.Namespace,
               seed: int, rows: Sequence[workload.TraceRow] = ()) -> list[workload.RequestSpec]:
    """One step's requests with arrival offsets (s): those before ``--duration``, and at
    least ``--min-requests``; lengths ``--input-len``/``--output-len``, or those of a row of
    ``rows`` drawn at random (seeded). With ``args.arrivals == "trace"``, ``replay``'s stretch
    of ``rows`` at ``rate_rps``, each request with its row's lengths. Prompts are built
    before the clock starts."""
    if getattr(args, "arrivals", "poisson") == "trace":
        picks = replay(rows, rate_rps, args.duration, args.min_requests, seed)
        rng = random.Random(seed)
        return [workload.RequestSpec(builder.text(row.input_tokens, rng), row.output_tokens,
                                     row.input_tokens, arrival_s=at) for at, row in picks]
    arrivals = schedule.arrivals(rate_rps, 1.0, seed)
    times = []
    for at in arrivals:
        if at >= args.duration and len(times) >= args.min_requests:
            break
        times.append(at)
    if rows:
        rng = random.Random(seed)
        picks = [rng.choice(rows) for _ in times]
        return [workload.RequestSpec(builder.text(row.input_tokens, rng), row.output_tokens,
                                     row.input_tokens, arrival_s=at)
                for at, row in zip(times, picks)]
    lengths = workload.synthetic(builder, workload.LengthDist("fixed", args.input_len),
                                 workload.LengthDist("fixed", args.output_len), seed)
    return [workload.RequestSpec(spec.prompt, spec.max_tokens, spec.input_tokens, arrival_s=at)
            for at, spec in zip(times, lengths)]


def replay(rows: Sequence[workload.TraceRow], rate_rps: float, duration_s: float,
           min_requests: int, seed: int) -> list[tuple[float, workload.TraceRow]]:
    """A stretch of a trace at mean rate ``rate_rps``: (offset s, row) for
    n = max(``min_requests``, ceil(rate x ``duration_s``)) consecutive rows from a seeded
    row on, wrapping around to the trace's start (one mean gap after its end), their gaps
    scaled so that the n gaps (the one after the last row included) last n / ``rate_rps``
    seconds. So a step delivers its nominal rate whichever stretch it drew, in that
    stretch's own burst shape. (Scaled by the whole trace's mean rate instead, a 20 s
    stretch of an on-off trace brought anywhere from none to several times the step's rate:
    11 requests in 20 s of a "1.6 req/s" step, which then passed.) Rows at one instant take
    more rows until time passes.

    Raises:
        ValueError: fewer than two rows, or all at one instant (no rate to scale).
    """
    span = rows[-1].arrival_s - rows[0].arrival_s if len(rows) > 1 else 0.0
    if not span > 0:
        raise ValueError("--arrivals trace needs a trace of two or more distinct arrival times")
    period = span * len(rows) / (len(rows) - 1)  # the wrap adds one mean gap
    start = random.Random(seed).randrange(len(rows))

    def offset(k: int) -> float:  # trace seconds from the start row to its k-th successor
        laps, index = divmod(start + k, len(rows))
        return rows[index].arrival_s - rows[start].arrival_s + period * laps

    n = max(1, min_requests, math.ceil(rate_rps * duration_s - 1e-9))
    while not offset(n) > 0:
        n += 1
    scale = n / rate_rps / offset(n)
    return [(offset(k) * scale, rows[(start + k) % len(rows)]) for k in range(n)]


def run(args: argparse.Namespace) -> int:
    if args.steps:
        return step_profile.run(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        rates = _check(args)
        rows = workload.read_trace(args.lengths_from) if args.lengths_from else []
        if args.arrivals == "trace":
            replay(rows, 1.0, 0.0, 1, args.seed)  # a trace with no rate: refused now
        check_server(args.url, args.model)
        tok = workload.Tokenizer(workload.resolve_tokenizer(args.tokenizer, args.model))
        builder = workload.PromptBuilder(tok)
    except (ValueError, OSError) as exc:
        print(f"sluice profile: {exc}", file=sys.stderr)
        return 2
    slo = Objectives(args.slo_ttft_ms, args.slo_itl_ms, args.percentile)
    err = Console(stderr=True)
    steps: list[Step] = []
    interrupted = False
    warmup = list(itertools.islice(workload.synthetic(
        builder, workload.LengthDist("fixed", 32), workload.LengthDist("fixed", 8),
        args.seed + 1_000_003), 1))
    upward, refine = iter(rates), args.refine  # the rates until one misses, then bisection
    while True:
        if all(s.met for s in steps):
            rate = next(upward, None)
        else:
            rate, refine = (refine_rate(steps) if refine else None), refine - 1
        if rate is None:
            break
        i = len(steps)
        specs = step_specs(builder, rate, args, args.seed + i, rows)
        cfg = LoadConfig(url=args.url, model=args.model, concurrency=None, open_loop=True,
                         num_requests=len(specs), request_timeout_s=args.request_timeout)
        err.print(f"rate {rate:g} req/s: {len(specs)} requests ...")
        result = asyncio.run(run_load(cfg, specs, tok, None, warmup if i == 0 else ()))
        if result.interrupted:
            interrupted = True
            break
        steps.append(judge(rate, result.records, slo))
    cap = capacity(steps)
    Console().print(table(steps, slo, args.model, args.url))
    if args.output:
        write_json(args.output, args, slo, steps, cap)
        print(f"wrote {args.output}")
    print(conclusion(cap, steps, slo))
    return 130 if interrupted else 0


def conclusion(cap: float, steps: Sequence[Step], slo: Objectives) -> str:
    """The last line: what to put in the manifest, or why there is nothing to put."""
    objectives = (f"p{slo.percentile:g} TTFT <= {slo.ttft_ms:g} ms and ITL <= "
                  f"{slo.itl_ms:g} ms")
    if not steps:
        return "capacity: not measured (interrupted before the first rate finished)"
    if cap == 0:
        return (f"capacity: 0 req/s: even the lowest rate ({steps[0].rate_rps:g} req/s) misses "
                f"{objectives}; loosen the objectives, shorten the requests or try lower "
                "--rates")
    return (f"capacity: {cap:g} req/s per replica at {objectives}; put `capacityRPS: {cap:g}` "
            "under spec.autoscaling")


def table(steps: Sequence[Step], slo: Objectives, model: str, url: str):
    """A rich Table: one row per rate."""
    from rich.table import Table

    p = f"p{slo.percentile:g}"
    t = Table(title=f"sluice profile: {model} @ {url} (TTFT <= {slo.ttft_ms:g} ms, ITL <= "
              f"{slo.itl_ms:g} ms at {p})", header_style="bold")
    for name in ("rate (req/s)", "requests", f"TTFT {p} (ms)", f"ITL {p} (ms)",
                 "attainment", "met?"):
        t.add_column(name, justify="right")
    for s in steps:
        failed = f" ({s.failed} failed: {', '.join(s.errors)})" if s.failed else ""
        t.add_row(f"{s.rate_rps:g}", f"{s.requests}{failed}", _ms(s.ttft_ms), _ms(s.itl_ms),
                  f"{s.attainment:.0%}", "yes" if s.met else "[red]no[/red]")
    return t


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def write_json(path: str | Path, args: argparse.Namespace, slo: Objectives,
               steps: Sequence[Step], cap: float) -> None:
    """``{model, url, input_len, output_len, lengths_from, arrivals, slo, percentile, capacity_rps,
    duration_s, steps}``; times in ms (``*_ms``) and s (``*_s``), rates in req/s."""
    data = {"model": args.model, "url": args.url, "input_len": args.input_len,
            "output_len": args.output_len, "lengths_from": args.lengths_from,
            "arrivals": args.arrivals,
            "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
            "percentile": slo.percentile, "capacity_rps": cap, "duration_s": args.duration,
            "steps": [asdict(s) for s in steps]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
