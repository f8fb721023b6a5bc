"""`sluice bench`: load an OpenAI endpoint and report RPS, tokens/s, TTFT/ITL/E2E
percentiles, goodput under SLOs, errors and cost.

Exit status: 0 when every measured request succeeded; 1 when the run finished but some
requests failed (the report and --output are still written; warm-up failures do not
count); 2 for bad arguments or an unusable workload/tokenizer (nothing measured); 130 when
interrupted (Ctrl-C): the requests that had finished are still reported.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from rich.console import Console

from sluice.argtypes import (count, json_object, number, output_dir, output_file,
                             percent, positive, positive_count, positive_milliseconds,
                             positive_seconds, server_url, whole)
from sluice.bench import report, schedule, workload
from sluice.bench.runner import LoadConfig, run as run_load

logger = logging.getLogger(__name__)

DEFAULT_NUM_REQUESTS = 50  # synthetic workload with neither --num-requests nor --duration
# Requests in flight at most: each is a task and a connection (10^8 grew memory until the
# machine stalled); 100,000 is far beyond what one client process drives.
MAX_CONCURRENCY = 100_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("target")
    g.add_argument("--url", type=server_url, required=True,
                   help="server base URL, e.g. http://127.0.0.1:8000 (or .../v1)")
    g.add_argument("--model", required=True, help="model name sent in each request")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (prompt) or /v1/chat/completions (one user message)")
    g.add_argument("--tokenizer", help="tokenizer.json, a model folder or a model-store name "
                   "(default: --model in the model store)")

    g = parser.add_argument_group("load")
    g.add_argument("--concurrency", type=whole(1, MAX_CONCURRENCY),
                   help="closed loop: requests in flight (default "
                   "1); with --rate or --trace: a cap on requests in flight")
    g.add_argument("--rate", type=positive, help="open loop: mean arrivals per second")
    g.add_argument("--arrival", choices=("poisson", "bursty"),
                   help="open-loop gaps: exponential (default), or gamma with --burstiness")
    g.add_argument("--burstiness", type=positive, help="gamma shape of the gaps (1 = Poisson, "
                   f"< 1 burstier; gap CV = 1/sqrt(shape)); bursty default {schedule.BURSTY_DEFAULT}")
    g.add_argument("--num-requests", type=positive_count,
                   help="measured requests (default: the whole "
                   f"dataset/trace, else {DEFAULT_NUM_REQUESTS} unless --duration is given)")
    g.add_argument("--duration", type=positive_seconds,
                   help="stop issuing requests after this many "
                   "seconds (in-flight ones finish and count)")
    g.add_argument("--warmup", type=count, default=1, help="unmeasured requests first (32 in, "
                   "8 out tokens)")
    g.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths, arrivals")

    g = parser.add_argument_group("prompts (synthetic by default)")
    g.add_argument("--input-len", type=_lengths, default="128",
                   help="input tokens: N, fixed:N, uniform:LO:HI "
                   "or normal:MEAN:STD")
    g.add_argument("--output-len", type=_lengths, default="64",
                   help="output tokens (max_tokens), same forms")
    g.add_argument("--prefix-groups", type=count, default=0, help="G tenants: request i starts "
                   "with group i%%G's shared prefix")
    g.add_argument("--prefix-tokens", type=count, default=0, help="P: shared prefix tokens; a "
                   "prompt is then P shared + --input-len own tokens")
    g.add_argument("--dataset", help='JSONL file, one {"prompt": ..., "max_tokens": ...} a '
                   "line (no max_tokens: the first number of --output-len)")
    g.add_argument("--trace", help="replay a trace: Azure 2023 CSV or Mooncake JSONL (lengths "
                   "and arrival times)")
    g.add_argument("--time-scale", type=positive, help="multiply trace arrival "
                   "times (0.1 = ten times the rate; default 1)")
    g.add_argument("--max-input-tokens", type=positive_count, help="clamp trace input lengths")
    g.add_argument("--max-output-tokens", type=positive_count, help="clamp trace output lengths")

    g = parser.add_argument_group("requests")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so outputs are exactly max_tokens long")
    g.add_argument("--temperature", type=number(), help="sampling temperature (server default)")
    g.add_argument("--extra-body", type=json_object,
                   help='JSON merged into every request, e.g. \'{"min_tokens": 64}\'')
    g.add_argument("--connect-timeout", type=positive_seconds, default=10.0, help="seconds")
    g.add_argument("--read-timeout", type=positive_seconds, default=300.0,
                   help="seconds to the first byte and between chunks")
    g.add_argument("--request-timeout", type=positive_seconds, default=600.0,
                   help="seconds per request")

    g = parser.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=positive_milliseconds, help="goodput: TTFT objective")
    g.add_argument("--slo-itl-ms", type=positive_milliseconds,
                   help="goodput: ITL objective, checked on each "
                   "request's --slo-itl-percentile of its own gaps")
    g.add_argument("--slo-itl-percentile", type=percent, default=90.0, help="default 90")
    g.add_argument("--cost-per-hour", type=number(), help="price of one replica-hour")
    g.add_argument("--replicas", type=positive_count, default=1,
                   help="replicas behind --url (for cost)")
    g.add_argument("--output", type=output_file, help="write summary + per-request records as JSON")
    g.add_argument("--plot", type=output_dir, metavar="DIR",
                   help="write PNG histograms and latency over time")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def _lengths(text: str) -> workload.LengthDist:
    """--input-len/--output-len: a length distribution (``workload.LengthDist.parse``)."""
    try:
        return workload.LengthDist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _workload(args, tok: workload.Tokenizer):
    """(specs, arrivals, open_loop, num_requests) from the arguments. Raises ValueError."""
    builder = workload.PromptBuilder(tok)
    if sum(x is not None for x in (args.dataset, args.trace)) > 1:
        raise ValueError("give at most one of --dataset and --trace")
    if args.trace and args.rate:
        raise ValueError("--trace brings its own arrival times; scale them with --time-scale")
    _check_applies(args)
    if args.trace:
        rows = workload.read_trace(args.trace)
        specs = workload.from_trace(rows, builder, args.time_scale or 1.0, args.seed,
                                    args.max_input_tokens, args.max_output_tokens)
        n = min(args.num_requests or len(rows), len(rows))
        return list(_take(specs, n)), None, True, n
    if args.dataset:
        items = workload.from_jsonl(args.dataset, tok, default_max_tokens=
                                    args.output_len.a)
        n = args.num_requests or (None if args.duration else len(items))
        specs = iter(items) if n is not None and n <= len(items) else _cycle(items)
    else:
        specs = workload.synthetic(builder, args.input_len,
                                   args.output_len, args.seed,
                                   args.prefix_groups, args.prefix_tokens)
        n = args.num_requests or (None if args.duration else DEFAULT_NUM_REQUESTS)
    arrivals = None
    if args.rate:
        bursty = args.arrival == "bursty"
        shape = (args.burstiness or schedule.BURSTY_DEFAULT) if bursty else 1.0
        if not bursty and args.burstiness not in (None, 1.0):
            raise ValueError("--burstiness needs --arrival bursty")
        arrivals = schedule.arrivals(args.rate, shape, args.seed)
    if n is not None:  # build the prompts before the clock starts
        specs = list(_take(specs, n))
    return specs, arrivals, args.rate is not None, n


def _check_applies(args) -> None:
    """Refuse a flag that would be silently ignored. Raises ValueError naming it."""
    trace_only = {"--time-scale": args.time_scale, "--max-input-tokens": args.max_input_tokens,
                  "--max-output-tokens": args.max_output_tokens}
    given = [flag for flag, value in trace_only.items() if value is not None]
    if given and not args.trace:
        raise ValueError(f"{given[0]} applies to --trace replays only")
    if not args.rate and (args.burstiness is not None or args.arrival is not None):
        flag = "--burstiness" if args.burstiness is not None else "--arrival"
        raise ValueError(f"{flag} shapes open-loop arrivals: it needs --rate")


def _cycle(items):
    while True:
        yield from items


def _take(it, n):
    for _, item in zip(range(n), it):
        yield item


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    try:
        tok = workload.Tokenizer(workload.resolve_tokenizer(args.tokenizer, args.model))
        specs, arrivals, open_loop, n = _workload(args, tok)
        warmup = list(_take(workload.synthetic(workload.PromptBuilder(tok),
                                               workload.LengthDist("fixed", 32),
                                               workload.LengthDist("fixed", 8),
                                               seed=args.seed + 1_000_003), args.warmup))
    except (ValueError, OSError) as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    cfg = LoadConfig(
        url=args.url, model=args.model, endpoint=args.endpoint,
        concurrency=args.concurrency if open_loop else (args.concurrency or 1),
        open_loop=open_loop, num_requests=n, duration_s=args.duration,
        ignore_eos=args.ignore_eos, temperature=args.temperature, extra_body=args.extra_body,
        connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
        request_timeout_s=args.request_timeout)
    result = _run_with_progress(cfg, specs, tok, arrivals, warmup, n, args.quiet)
    records = result.records
    summary = report.summarize(records, args.slo_ttft_ms, args.slo_itl_ms,
                               args.slo_itl_percentile, args.cost_per_hour, args.replicas)
    mode = (f"open loop, {args.rate:g} req/s {args.arrival or 'poisson'}" if args.rate
            else "trace replay" if args.trace else f"closed loop, concurrency {cfg.concurrency}")
    Console().print(report.table(summary, title=f"sluice bench: {args.model} @ {args.url} "
                                                f"({mode})"))
    if args.output:
        config = {k: v.text if isinstance(v, workload.LengthDist) else v
                  for k, v in vars(args).items()}
        report.write_json(args.output, config, summary, records, result.started_at)
        print(f"wrote {args.output}")
    if args.plot:
        for path in report.plot(args.plot, records):
            print(f"wrote {path}")
    return 130 if result.interrupted else 0 if summary["failed"] == 0 else 1


def _run_with_progress(cfg, specs, tok, arrivals, warmup, total, quiet):
    """The run, with a rich progress bar on stderr unless ``quiet``."""
    if quiet:
        return asyncio.run(run_load(cfg, specs, tok, arrivals, warmup))
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn()]
    errors = 0
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("requests", total=total, errors=0)

        def done(record):
            nonlocal errors
            errors += not record.ok
            progress.update(task, advance=1, errors=errors)

        return asyncio.run(run_load(cfg, specs, tok, arrivals, warmup, done))
