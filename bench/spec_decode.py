"""Speculative decoding: batch-1 decode speed with and without drafts, same prompt, same run.

- n-gram (prompt lookup) on SmolLM2-135M-Instruct with a prompt whose answer repeats the
  prompt's structure (target ≥ 1.8×);
- a draft model: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct on a
  code prompt (target ≥ 1.3×; transformers' assisted generation gets 1.36× on this pair
  per ../shared/env-notes.md), with fp32 and with int8 draft weights (the draft's cost
  per token against the target's decides the speed-up; its rounding only moves the
  acceptance rate, never the output).

Greedy, ``ignore_eos``, ``--max-tokens`` output tokens; speed = output tokens ÷ wall time
of ``LLMEngine.generate`` (prefill included, identical in both runs). Each pair also
checks that the speculative output is token-for-token the plain one. One engine at a time
(the 1.5B model takes 6 GB in fp32).

    .venv/bin/python bench/spec_decode.py [--max-tokens 128] [--only ngram|draft]

Prints a table and writes JSON (default bench/results/spec_decode.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

from sluice.models import store
from sluice.worker.engine import EngineConfig
from sluice.worker.engine.llm_engine import LLMEngine
from sluice.worker.sampling_params import SamplingParams

# a completion prompt (no chat template): unit tests whose continuation repeats their shape
NGRAM_PROMPT = ("def test_add_1():\n    assert add(1, 1) == 2\n\ndef test_add_2():\n"
                "    assert add(2, 2) == 4\n\ndef test_add_3():\n    assert add(3, 3) == 6\n\n")
CODE_PROMPT = ("Write a Python class `Matrix` with methods add, sub, mul, transpose and "
               "__repr__, each with a docstring, then unit tests for every method.")
TARGETS = {"ngram": 1.8, "draft": 1.3}


def prompt_ids(engine: LLMEngine, text: str, chat: bool) -> list[int]:
    if chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text)


def timed(config: EngineConfig, text: str, chat: bool, max_tokens: int) -> dict:
    """Warm up, then one timed greedy generation. Frees the engine afterwards."""
    engine = LLMEngine(config)
    ids = prompt_ids(engine, text, chat)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([ids[:16]], SamplingParams(max_tokens=4, temperature=0.0))
    drafted, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
    start = time.perf_counter()
    out = engine.generate([ids], params)[0]
    seconds = time.perf_counter() - start
    drafted, accepted = engine.num_draft_tokens - drafted, engine.num_accepted_tokens - accepted
    del engine
    gc.collect()
    return {"tokens": out, "seconds": seconds, "tok_s": len(out) / seconds,
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


def pair(name: str, plain_cfg: EngineConfig, spec_cfg: EngineConfig, text: str, chat: bool,
         max_tokens: int) -> dict:
    plain = timed(plain_cfg, text, chat, max_tokens)
    spec = timed(spec_cfg, text, chat, max_tokens)
    row = {"method": name, "plain_tok_s": plain["tok_s"], "spec_tok_s": spec["tok_s"],
           "speedup": spec["tok_s"] / plain["tok_s"], "target": TARGETS[name],
           "identical": plain["tokens"] == spec["tokens"], "acceptance_rate": spec["acceptance_rate"],
           "accepted_per_step": (spec["accepted_tokens"] / (spec["draft_tokens"] / spec_cfg.num_speculative_tokens)
                                 if spec["draft_tokens"] else None),
           "k": spec_cfg.num_speculative_tokens}
    print(f"{name}: plain {row['plain_tok_s']:.2f} tok/s, speculative {row['spec_tok_s']:.2f} tok/s, "
          f"{row['speedup']:.2f}x (acceptance {row['acceptance_rate']:.2f}, identical {row['identical']})",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only", choices=("ngram", "draft"))
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--out", default="bench/results/spec_decode.json")
    args = parser.parse_args()
    rows = []
    if args.only in (None, "ngram"):
        smol = str(store.fetch("SmolLM2-135M-Instruct"))
        base = dict(model=smol, kv_cache_gib=0.25)
        rows.append(pair("ngram", EngineConfig(**base), EngineConfig(
            **base, speculative_method="ngram", num_speculative_tokens=args.k), NGRAM_PROMPT, False, args.max_tokens))
    if args.only in (None, "draft"):
        target = str(store.fetch("Qwen2.5-Coder-1.5B-Instruct"))
        draft = str(store.fetch("Qwen2.5-Coder-0.5B-Instruct"))
        base = dict(model=target, kv_cache_gib=0.25, max_model_len=2048)
        for quantization in (None, "int8"):  # the draft's weights; the target stays fp32
            rows.append(pair("draft", EngineConfig(**base), EngineConfig(
                **base, speculative_method="draft", speculative_model=draft,
                speculative_model_quantization=quantization, num_speculative_tokens=args.k),
                CODE_PROMPT, True, args.max_tokens))
            rows[-1]["draft_quantization"] = quantization
    print(f"\nbatch 1, greedy, {args.max_tokens} output tokens, torch threads {torch.get_num_threads()}, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"{'method':<11} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'target':>7} "
          f"{'accept':>7} {'identical':>9}")
    for r in rows:
        name = r["method"] + (f" ({r['draft_quantization']})" if r.get("draft_quantization") else "")
        print(f"{name:<11} {r['plain_tok_s']:>11.2f} {r['spec_tok_s']:>10.2f} {r['speedup']:>7.2f}x "
              f"{r['target']:>6.1f}x {r['acceptance_rate'] or 0:>7.2f} {str(r['identical']):>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"max_tokens": args.max_tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
