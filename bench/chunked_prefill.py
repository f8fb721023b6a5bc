"""Chunked prefill: TTFT of short requests while a prompt near the context limit prefills.

A steady stream of 50-token prompts (one every ``--interval-ms``, ``--short-tokens`` output
tokens each) runs through one in-process ``LLMEngine`` in three scenarios, same run:

- ``alone``: the short requests only (the reference);
- ``chunked``: plus one long prompt (``--long-tokens``, near the context limit) arriving
  with the first short one, prefilled in chunks of ``long_prefill_token_threshold``
  tokens that share each step with the decodes (the engine's default);
- ``unchunked``: the same, with the whole long prefill allowed in one step (threshold and
  budget = the long prompt), which is what chunking avoids.

TTFT is measured from each short request's scheduled arrival to its first output token
(queueing included). Target: chunked p99 TTFT ≤ 3× alone.

    .venv/bin/python bench/chunked_prefill.py [--long-tokens 7000]

Prints a table and writes JSON (default bench/results/chunked_prefill.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from sluice.bench.report import describe
from sluice.models import store
from sluice.worker.engine import EngineConfig
from sluice.worker.engine.llm_engine import LLMEngine
from sluice.worker.sampling_params import SamplingParams

TARGET = 3.0
TEXT = ("Rivers carve valleys over thousands of years, carrying sediment from the mountains "
        "to the sea, where deltas slowly grow. ")


def run(engine: LLMEngine, shorts: list[list[int]], long: list[int] | None, args) -> dict:
    """Feed the arrivals in real time, step the engine, return short-request TTFTs (s)."""
    start = time.perf_counter()
    arrivals = [start + i * args.interval_ms / 1000 for i in range(len(shorts))]
    first_token: dict[str, float] = {}
    short_params = SamplingParams(max_tokens=args.short_tokens, temperature=0.0, ignore_eos=True)
    if long is not None:
        engine.add_request("long", long, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    added = 0
    while added < len(shorts) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while added < len(shorts) and arrivals[added] <= now:
            engine.add_request(f"short-{added}", shorts[added], short_params)
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[added] - now))
            continue
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter()
    ttft = [first_token[f"short-{i}"] - arrivals[i] for i in range(len(shorts))]
    pool = engine.scheduler.block_manager
    assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"
    return {"ttft_ms": describe(ttft, 1000.0),
            "long_ttft_ms": (first_token["long"] - start) * 1000 if long is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=store.DEFAULT_MODEL)
    parser.add_argument("--long-tokens", type=int, default=7000)
    parser.add_argument("--num-short", type=int, default=40)
    parser.add_argument("--interval-ms", type=float, default=150.0)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="long_prefill_token_threshold (default: the engine's)")
    parser.add_argument("--out", default="bench/results/chunked_prefill.json")
    args = parser.parse_args()
    path = str(store.fetch(args.model))
    base = dict(model=path, kv_cache_gib=1.0, enable_prefix_caching=False)
    chunked = LLMEngine(EngineConfig(**base, long_prefill_token_threshold=args.chunk_tokens))
    unchunked = LLMEngine(EngineConfig(**base, max_num_batched_tokens=args.long_tokens,
                                       long_prefill_token_threshold=args.long_tokens))
    ids = chunked.tokenizer.encode(TEXT * (args.long_tokens // 20 + 1))
    long = ids[:args.long_tokens]
    shorts = [ids[i * 7:i * 7 + 50] for i in range(args.num_short)]  # distinct 50-token prompts
    chunked.generate([shorts[0]], SamplingParams(max_tokens=2))  # warm-up
    unchunked.generate([shorts[0]], SamplingParams(max_tokens=2))
    result = {"model": args.model, "long_tokens": args.long_tokens, "num_short": args.num_short,
              "interval_ms": args.interval_ms, "chunk_tokens": chunked.scheduler.long_prefill_token_threshold,
              "budget_tokens": chunked.scheduler.max_num_batched_tokens, "load_avg": os.getloadavg(),
              "alone": run(chunked, shorts, None, args),
              "chunked": run(chunked, shorts, long, args),
              "unchunked": run(unchunked, shorts, long, args)}
    alone = result["alone"]["ttft_ms"]["p99"]
    print(f"\n{args.model}: {args.num_short} short prompts (50 tokens, every {args.interval_ms:.0f} ms) "
          f"with a {args.long_tokens}-token prompt; chunks of {result['chunk_tokens']} tokens "
          "at an empty context, fewer as it grows")
    print(f"{'scenario':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'p99/alone':>10} {'long TTFT':>10}")
    for name in ("alone", "chunked", "unchunked"):
        r = result[name]
        long_ttft = "-" if r["long_ttft_ms"] is None else f"{r['long_ttft_ms']:.0f}"
        print(f"{name:<10} {r['ttft_ms']['p50']:>9.0f} {r['ttft_ms']['p99']:>9.0f} "
              f"{r['ttft_ms']['p99'] / alone:>9.2f}x {long_ttft:>10}")
    result["chunked_p99_ratio"] = result["chunked"]["ttft_ms"]["p99"] / alone
    result["target"] = TARGET
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"target chunked p99 <= {TARGET}x alone: {'met' if result['chunked_p99_ratio'] <= TARGET else 'missed'}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
