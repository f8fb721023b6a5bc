"""``sluice cascade record | rescore | calibrate | check``: record every tier's answers, set
the threshold, then check the live cascade against its replay.

    sluice cascade record --url http://127.0.0.1:8000 --cascade coder --tiers small,big \\
        --set mix --out records.jsonl            # resumable: rerun to continue
    sluice cascade rescore --records records.jsonl   # code answers run on their examples again
    sluice cascade calibrate --records records.jsonl --tiers small,big \\
        --target-top-share 0.3 [--pre-route-share 0.1] [--out calibration.json]

    sluice cascade check --url http://127.0.0.1:8000 --manifest cascade.yaml --cascade coder \\
        --records records.jsonl --sample 24 [--out check.json]

``calibrate`` prints a table (each tier alone, the cascade on all items, the held-out
halves) and the YAML to paste under ``spec.cascade``; ``check`` sends a sample of the recorded
items to the served cascade and compares its answers with the replay's (``live``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sluice.argtypes import number, output_file, positive_count, server_url, whole
from sluice.cascade.policy import SIGNALS


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if len(names) < 2:
        raise argparse.ArgumentTypeError(f"need at least 2 comma-separated tiers, got {text!r}")
    return names


def _costs(text: str) -> list[float]:
    try:
        costs = [float(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"costs {text!r} are not comma-separated numbers")
    if any(not 0 < c < float("inf") for c in costs):
        raise argparse.ArgumentTypeError(f"costs {text!r} must be positive")
    return costs


_fraction = number(maximum=1.0)  # a quantile, a share of requests
_share = number(strict=True, maximum=1.0)  # a pre-route's share: leaving it out means none
_prefix_tokens = whole(1, 4096)  # spec.cascade.streaming.prefixTokens' range
_timeout = number("seconds", strict=True, maximum=86_400.0)  # per answer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="record every tier's answers to an eval set "
                         "through the router (resumable)")
    _router_arguments(rec)
    rec.add_argument("--cascade", required=True, help="the cascade's served model name")
    rec.add_argument("--tiers", type=_names, required=True,
                     help="tier InferenceService names, smallest first, comma-separated")
    rec.add_argument("--set", dest="which", default="mix",
                     choices=("arithmetic", "humaneval", "mix"))
    rec.add_argument("--sample", type=positive_count, default=None,
                     help="items (default: arithmetic 100, humaneval 164, mix 164 + 164)")
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--steps", type=positive_count, default=4,
                     help="arithmetic: operations per problem")
    rec.add_argument("--max-value", type=positive_count, default=100,
                     help="arithmetic: number size")
    rec.add_argument("--max-tokens", type=positive_count, default=None,
                     help="completion tokens per answer, every kind (default: 384 for "
                     "arithmetic, 512 for code)")
    rec.add_argument("--batch", type=positive_count, default=1,
                     help="items sent to a tier at once, answered in one continuous batch "
                     "(default 1; 8 records several times faster on CPU)")
    rec.add_argument("--out", default="records.jsonl", help="JSONL, appended to")

    res = sub.add_parser("rescore", help="run the recorded code answers on their prompts' "
                         "examples again (after the examples reader learns new styles)")
    res.add_argument("--records", required=True, help="JSONL from `sluice cascade record`, "
                     "rewritten in place")

    cal = sub.add_parser("calibrate", help="the threshold for a target top-tier share, "
                         "checked on held-out halves; prints the spec.cascade YAML")
    cal.add_argument("--records", required=True, help="JSONL from `sluice cascade record`")
    cal.add_argument("--tiers", type=_names, required=True, help="smallest first")
    cal.add_argument("--costs", type=_costs, default=None, help="per tier (default 1,2,4,...)")
    cal.add_argument("--signal", default="logprob-quantile", choices=SIGNALS)
    cal.add_argument("--quantile", type=_fraction, default=0.1)
    cal.add_argument("--target-top-share", type=_fraction, default=0.3)
    cal.add_argument("--pre-route-share", type=_share, default=None,
                     help="fit a pre-route model that sends at most this share (> 0) straight "
                     "to the top tier (default: no pre-route)")
    cal.add_argument("--prefix-tokens", type=_prefix_tokens, default=None,
                     help="calibrate for streams in the prefix mode: judge each answer's "
                     "first K tokens, and pay only those for one that escalates (default: "
                     "answers judged whole, the buffer mode and plain answers)")
    cal.add_argument("--splits", type=positive_count, default=20, help="held-out random halves")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--out", type=output_file, default=None,
                     help="write the results as JSON here")

    chk = sub.add_parser("check", help="send recorded items to the served cascade and "
                         "compare its answers with the replay of its spec on the records")
    _router_arguments(chk)
    chk.add_argument("--manifest", required=True,
                     help="the InferenceServices the router serves (the cascade's spec)")
    chk.add_argument("--cascade", required=True, help="the cascade's served model name")
    chk.add_argument("--records", required=True, help="JSONL from `sluice cascade record`")
    chk.add_argument("--sample", type=positive_count, default=None,
                     help="items, a seeded sample of those every tier answered (default all)")
    chk.add_argument("--seed", type=int, default=0)
    chk.add_argument("--concurrency", type=positive_count, default=8,
                     help="requests in flight (default 8, like record's --batch 8)")
    chk.add_argument("--max-tokens", type=positive_count, default=None,
                     help="completion tokens per answer (default: each item's recorded limit; "
                     "record's defaults for records that lack it)")
    chk.add_argument("--out", type=output_file, default=None,
                     help="write the comparison and answers as JSON")


def _router_arguments(parser: argparse.ArgumentParser) -> None:
    """What record and check both send requests with: the router, a timeout per answer."""
    parser.add_argument("--url", type=server_url, default="http://127.0.0.1:8000",
                        help="the router")
    parser.add_argument("--timeout", type=_timeout, default=600.0, help="seconds per answer")


def run(args: argparse.Namespace) -> int:
    return {"record": record, "rescore": rescore, "calibrate": calibrate,
            "check": check}[args.action](args)


def record(args: argparse.Namespace) -> int:
    from sluice.cascade import recorder

    try:
        items = recorder.select_items(args.which, args.sample, args.seed, args.steps,
                                      args.max_value)
        limits = None if args.max_tokens is None else dict.fromkeys(
            recorder.MAX_TOKENS, args.max_tokens)
        summary = recorder.record(items, args.tiers, args.url, args.cascade, args.out,
                                  max_tokens=limits, timeout_s=args.timeout,
                                  batch=args.batch)
    except (ValueError, ImportError, recorder.RecordError) as e:
        print(f"sluice cascade record: {e}", file=sys.stderr)
        return 2
    for tier in args.tiers:
        n = summary.answered.get(tier, 0)
        print(f"{tier}: {summary.correct.get(tier, 0)}/{n} correct this run")
    print(f"recorded {summary.recorded}, already there {summary.skipped}, failed "
          f"{summary.failed} (rerun to retry) → {args.out}")
    return 1 if summary.failed else 0


def rescore(args: argparse.Namespace) -> int:
    from sluice.cascade import recorder

    try:
        changes = recorder.rescore_examples(args.records)
    except (ValueError, OSError) as e:
        print(f"sluice cascade rescore: {e}", file=sys.stderr)
        return 2
    def name(value: bool | None) -> str:
        return {True: "pass", False: "fail", None: "no examples"}[value]

    print(f"{sum(changes.values())} code answers run on their prompts' examples; "
          f"{sum(n for (a, b), n in changes.items() if a != b)} changed")
    for (before, now), n in sorted(changes.items(), key=lambda kv: -kv[1]):
        print(f"  {name(before):>11} -> {name(now):<11} {n}")
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from sluice.cascade.calibrate import Replay, held_out, load_records, snippet

    path = Path(args.records)
    if not path.exists():
        print(f"sluice cascade calibrate: {path} does not exist", file=sys.stderr)
        return 2
    try:
        replay = Replay.build(load_records(path), args.tiers, args.signal, args.quantile,
                              args.costs, args.prefix_tokens)
        if len(replay) < 4:
            raise ValueError(f"{len(replay)} items answered by every tier of "
                             f"{','.join(args.tiers)}; need >= 4")
        pre = (replay.fit_pre_route(args.pre_route_share)
               if args.pre_route_share is not None else None)
    except (ValueError, KeyError, TypeError) as e:
        print(f"sluice cascade calibrate: {e}", file=sys.stderr)
        return 2
    routed = {i for i, p in zip(replay.ids, replay.prompts) if pre and pre.routes(p)}
    threshold = replay.threshold_for_share(args.target_top_share, routed)
    outcome = replay.simulate(threshold, routed)
    splits = {"held out": held_out(replay, target=args.target_top_share, splits=args.splits,
                                   seed=args.seed)}
    if pre is not None:
        splits["held out, pre-routed"] = held_out(
            replay, target=args.target_top_share, splits=args.splits, seed=args.seed,
            pre_route_share=args.pre_route_share)
    split = splits[list(splits)[-1]]
    from rich.console import Console
    Console().print(table(replay, outcome, splits))
    if pre is not None:
        hits = "" if pre.hit_rate is None else f", tier 0 wrong on {pre.hit_rate:.0%} of them"
        print(f"pre-route: {pre.share:.1%} of all items straight to the top tier{hits}; "
              f"held out: {split.pre_routed.mean:.1%}")
    text = snippet(threshold, args.signal, args.quantile, pre, comment=(
        f"sluice cascade calibrate: {len(replay)} items, target top-tier share "
        f"{args.target_top_share:g}\nheld out ({args.splits} halves): "
        f"{split.relative_accuracy.mean:.1%} of the top tier's accuracy, "
        f"{split.top_share.mean:.1%} at the top tier, {split.relative_cost.mean:.2f} of its cost"
        "\npaste under spec.cascade:"), prefix_tokens=args.prefix_tokens)
    print(text, end="")
    if args.out:
        result = {"records": str(path), "tiers": list(replay.tiers), "costs": list(replay.costs),
                  "signal": args.signal, "quantile": args.quantile,
                  "prefix_tokens": args.prefix_tokens, "items": len(replay),
                  "target_top_share": args.target_top_share, "threshold": threshold,
                  "all_items": outcome.to_json(), "held_out": split.to_json(),
                  "held_out_without_pre_route": splits["held out"].to_json(),
                  "tier_accuracy": replay.tier_accuracy(),
                  "pre_route": None if pre is None else vars(pre), "snippet": text}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def check(args: argparse.Namespace) -> int:
    from sluice.cascade import live, recorder
    from sluice.cascade.calibrate import Replay, load_records
    from sluice.cascade.evalset import items_by_id
    from sluice.cascade.policy import CascadePolicy
    from sluice.cascade.tiers import manifest_cascades

    try:
        if not Path(args.records).is_file():
            raise ValueError(f"--records {args.records}: no such file")
        if args.out and Path(args.out).resolve() in (Path(args.records).resolve(),
                                                     Path(args.manifest).resolve()):
            raise ValueError(f"--out {args.out} would overwrite the records or the manifest")
        served = manifest_cascades(args.manifest)
        if args.cascade not in served:
            raise ValueError(f"{args.manifest} serves no cascade named {args.cascade!r} "
                             f"(it serves: {', '.join(served) or 'none'})")
        spec = served[args.cascade].spec
        records = load_records(args.records)
        # check streams its requests, so the spec's streaming mode decides what is judged
        prefix = spec.streaming.prefix_tokens if spec.streaming.mode == "prefix" else None
        replay = Replay.build(records, spec.tiers, spec.escalation.signal,
                              spec.escalation.quantile, spec.tier_costs(), prefix)
        if not len(replay):
            raise ValueError(f"no item in {args.records} has a record for every tier of "
                             f"{args.cascade} ({', '.join(spec.tiers)})")
        pre_routed = live.pre_routed_ids(replay, CascadePolicy.from_spec(spec, spec.tiers))
        ids = live.sample(replay, args.sample, args.seed)
        items = items_by_id(ids)
        live.check_prompts(items, replay)
        limits = live.recorded_limits(items, records, spec.tiers, args.max_tokens)
        answers, failed = live.ask_all(items, args.url, args.cascade, spec.tiers,
                                       max_tokens=limits, concurrency=args.concurrency,
                                       timeout_s=args.timeout)
        if not answers:
            raise ValueError(f"all {len(failed)} requests failed: is the router at {args.url} "
                             "up and serving the cascade? (the warnings above say why)")
        result = live.compare(replay, spec.escalation.threshold, pre_routed, answers)
    except (OSError, ValueError, ImportError, recorder.RecordError) as e:
        print(f"sluice cascade check: {e}", file=sys.stderr)
        return 2
    n = result.items
    print(f"{args.cascade} ({' → '.join(spec.tiers)}, threshold "
          f"{spec.escalation.threshold:g}): {n} items live, {len(failed)} failed")
    print(f"  accuracy   live {result.live_accuracy:.1%}   replay {result.replay_accuracy:.1%}"
          f"   (right only live {result.live_only}, only in the replay {result.replay_only}; "
          f"McNemar p = {result.p_value:.3f}: "
          f"{'within noise' if result.within_noise else 'a real difference'})")
    print(f"  top share  live {result.live_top_share:.1%}   replay {result.replay_top_share:.1%}")
    print(f"  same tier as the replay on {result.same_tier}/{n}; the judged tier's score equal "
          f"to the recorded one on {result.same_score}/{n}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "cascade": args.cascade, "tiers": list(spec.tiers), "records": args.records,
            "threshold": spec.escalation.threshold, "signal": spec.escalation.signal,
            "sample": ids, "failed": failed, "comparison": result.to_json(),
            "answers": [vars(a) for a in answers]}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 1 if failed else 0


def table(replay, outcome, splits):
    """Each tier alone, the cascade on all items, the held-out halves (mean ± sd), each of
    ``splits`` (label → ``HeldOut``) a row."""
    from rich.table import Table

    kinds = sorted(set(replay.kinds))
    t = Table(title=f"cascade {' → '.join(replay.tiers)}: {len(replay)} items, "
              f"{replay.signal}", header_style="bold")
    for col in ("", "accuracy", "vs top", "top share", "cost vs top", *kinds):
        t.add_column(col, justify="left" if not col else "right")
    top_cost = outcome.top_cost
    by_kind = {k: replay.tier_accuracy(k) for k in kinds}
    top_acc = outcome.top_accuracy
    for j, tier in enumerate(replay.tiers):
        acc = sum(c[j] for c in replay.correct) / len(replay)
        cost = sum(s[j] for s in replay.spent) / len(replay)
        t.add_row(f"{tier} alone", f"{acc:.1%}", f"{acc / top_acc:.1%}" if top_acc else "-",
                  "100%" if j == replay.top else "0%", f"{cost / top_cost:.2f}",
                  *(f"{by_kind[k][tier]:.1%}" for k in kinds))
    t.add_row(f"cascade, all items (threshold {outcome.threshold:.4g})",
              f"{outcome.accuracy:.1%}", f"{outcome.relative_accuracy:.1%}",
              f"{outcome.top_share:.1%}", f"{outcome.relative_cost:.2f}",
              *(f"{outcome.kind_accuracy.get(k, 0):.1%}" for k in kinds))
    for label, split in splits.items():
        t.add_row(f"{label}, {split.splits} halves (mean ± sd)",
                  f"{split.accuracy.mean:.1%} ± {split.accuracy.sd:.1%}",
                  f"{split.relative_accuracy.mean:.1%} ± {split.relative_accuracy.sd:.1%}",
                  f"{split.top_share.mean:.1%} ± {split.top_share.sd:.1%}",
                  f"{split.relative_cost.mean:.2f} ± {split.relative_cost.sd:.2f}",
                  *("" for _ in kinds))
    return t
