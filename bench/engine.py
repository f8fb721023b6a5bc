"""Output tokens/s of the native engine at 1, 8 and 32 concurrent requests vs HF transformers.

Same model, same prompts, one run: the native engine gets all C requests at once
(continuous batching); HF transformers serves the same requests one at a time with greedy
``generate``. Prints a table and writes JSON (default bench/results/engine.json).

    .venv/bin/python bench/engine.py [--max-tokens 64] [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from sluice.models import store
from sluice.worker.engine import EngineConfig, SamplingParams
from sluice.worker.engine.llm_engine import LLMEngine

TOPICS = ["the ocean", "a robot", "mountains", "coffee", "a lost key", "the moon", "trains", "winter"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts of varied length, tokenized with the model's chat template."""
    out = []
    for i in range(n):
        msg = f"Write a short story about {TOPICS[i % len(TOPICS)]} (version {i})."
        text = tokenizer.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer.encode(text))
    return out


def bench_native(engine: LLMEngine, batch: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(batch[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    return {"requests": len(batch), "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


def bench_hf(model, batch: list[list[int]], max_tokens: int) -> dict:
    tokens, start = 0, time.perf_counter()
    for ids in batch:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False)
        tokens += out.shape[1] - len(ids)
    elapsed = time.perf_counter() - start
    return {"requests": len(batch), "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=store.DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hf-requests", type=int, default=8,
                        help="HF serves at most this many of the C requests (its rate is per request)")
    parser.add_argument("--out", default="bench/results/engine.json")
    args = parser.parse_args()

    path = store.fetch(args.model)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_gib=1.0, max_num_seqs=64))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for c in args.concurrency:
        batch = prompts(engine.tokenizer, c)
        native = bench_native(engine, batch, args.max_tokens)
        with torch.inference_mode():
            ref = bench_hf(hf, batch[:min(c, args.hf_requests)], args.max_tokens)
        rows.append({"concurrency": c, "native": native, "hf": ref, "speedup": native["tok_s"] / ref["tok_s"]})
        print(f"C={c}: native {native['tok_s']:.1f} tok/s, HF {ref['tok_s']:.1f} tok/s", flush=True)

    print(f"\n{args.model}, {args.max_tokens} output tokens per request, torch threads {torch.get_num_threads()}")
    print(f"{'concurrent':>10} | {'native tok/s':>12} | {'HF 1-at-a-time tok/s':>20} | {'speedup':>7}")
    print("-" * 60)
    for r in rows:
        print(f"{r['concurrency']:>10} | {r['native']['tok_s']:>12.1f} | {r['hf']['tok_s']:>20.1f} | "
              f"{r['speedup']:>6.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                          "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
