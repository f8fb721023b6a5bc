"""Paged decode attention: the native kernel (csrc/paged_decode.cpp) vs gather + SDPA.

Side by side in one process on the same batches: SmolLM2-135M in fp32 (30 layers, 9 query
heads over 3 KV heads of 64, block size 16), B decode sequences whose contexts are drawn
uniformly from [--min-ctx, --max-ctx] tokens, their blocks scattered at random over the
pool (random K/V). Per B:

- attention: one decode step's attention, i.e. ``decode_attention`` on every layer's own
  cache (the cache write and the projections excluded; the fallback's mask is built before,
  as ``ModelRunner`` builds it once a step), ms;
- step: one whole decode step, ``ModelRunner.execute`` (batch tensors, the model, logits), ms.

Medians over --repeats rounds; the two variants alternate within a round so that background
load hits them alike. Both variants' attention outputs are checked equal (fp32, 1e-4).
Threads: --threads (default 1, for runs under ``taskset -c 1``).

    .venv/bin/python bench/paged_decode.py [--batch 1 8 64] [--repeats 20]

Prints a table and writes JSON (default bench/results/paged_decode.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig

from sluice.models import store
from sluice.worker.engine import attention
from sluice.worker.engine.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16


@contextmanager
def gather_sdpa(runner: ModelRunner):
    """The fallback decode path (what SLUICE_NATIVE_KERNELS=0 gives), inside this process."""
    saved = attention.native_paged_decode
    attention.native_paged_decode = lambda device: None
    runner.decode_needs_mask = True
    try:
        yield
    finally:
        attention.native_paged_decode = saved
        runner.decode_needs_mask = False


def decode_batch(batch: int, min_ctx: int, max_ctx: int, num_blocks: int, gen: torch.Generator):
    """ModelRunner.execute's input for ``batch`` decode tokens: (token ids, position, table)."""
    lens = torch.randint(min_ctx, max_ctx + 1, (batch,), generator=gen).tolist()
    free = torch.randperm(num_blocks, generator=gen).tolist()
    return [([int(torch.randint(1000, (1,), generator=gen))], n - 1,
             [free.pop() for _ in range(-(-n // BLOCK_SIZE))]) for n in lens]


def time_attention(runner: ModelRunner, batch, q: torch.Tensor, scale: float) -> tuple[float, torch.Tensor]:
    """Seconds for one step's decode attention over all layers, and the last layer's output."""
    _, _, meta = runner._prepare(batch)
    start = time.perf_counter()
    for k_cache, v_cache in runner.kv_caches:
        out = attention.decode_attention(q, k_cache, v_cache, meta, scale)
    return time.perf_counter() - start, out


def time_step(runner: ModelRunner, batch) -> float:
    start = time.perf_counter()
    runner.execute(batch, list(range(len(batch))))
    return time.perf_counter() - start


def measure(runner: ModelRunner, batch, heads: int, repeats: int, gen: torch.Generator) -> dict:
    head_dim = runner.model.head_dim
    q = torch.randn(len(batch), heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    times = {"native": {"attention": [], "step": []}, "sdpa": {"attention": [], "step": []}}
    for round_ in range(repeats + 1):  # round 0 warms up
        att_native, out_native = time_attention(runner, batch, q, scale)
        with gather_sdpa(runner):
            att_sdpa, out_sdpa = time_attention(runner, batch, q, scale)
        # on the same cache contents (a step rewrites each sequence's last slot)
        torch.testing.assert_close(out_native, out_sdpa, atol=1e-4, rtol=1e-4)
        step_native = time_step(runner, batch)
        with gather_sdpa(runner):
            step_sdpa = time_step(runner, batch)
        if round_:
            for name, att, step in (("native", att_native, step_native), ("sdpa", att_sdpa, step_sdpa)):
                times[name]["attention"].append(att * 1e3)
                times[name]["step"].append(step * 1e3)
    return {name: {part: statistics.median(ms) for part, ms in parts.items()} for name, parts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--min-ctx", type=int, default=128)
    parser.add_argument("--max-ctx", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "paged_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = store.fetch(store.DEFAULT_MODEL)
    hf_config = AutoConfig.from_pretrained(path)
    runner = ModelRunner(hf_config, path, args.max_ctx + BLOCK_SIZE, BLOCK_SIZE, "float32", "cpu")
    if runner.decode_needs_mask:
        raise SystemExit("the native paged decode kernel is unavailable here (see the warning above)")
    num_blocks = max(args.batch) * -(-args.max_ctx // BLOCK_SIZE)
    runner.allocate_kv_cache(num_blocks)
    gen = torch.Generator().manual_seed(0)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_(generator=gen)
        v_cache.normal_(generator=gen)

    rows = []
    for b in args.batch:
        batch = decode_batch(b, args.min_ctx, args.max_ctx, num_blocks, gen)
        ms = measure(runner, batch, hf_config.num_attention_heads, args.repeats, gen)
        rows.append({"batch": b, "mean_ctx": statistics.mean(pos + 1 for _, pos, _ in batch),
                     "max_ctx": max(pos + 1 for _, pos, _ in batch), **ms,
                     "attention_speedup": ms["sdpa"]["attention"] / ms["native"]["attention"],
                     "step_speedup": ms["sdpa"]["step"] / ms["native"]["step"]})

    print(f"decode attention per step ({runner.num_layers} layers) and whole decode step, ms, "
          f"median of {args.repeats}, {args.threads} thread(s)")
    print(f"{'B':>3} {'ctx mean/max':>13} | {'attn native':>11} {'gather+SDPA':>11} {'ratio':>6} | "
          f"{'step native':>11} {'gather+SDPA':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>3} {r['mean_ctx']:>7.0f}/{r['max_ctx']:<5} | {r['native']['attention']:>11.2f} "
              f"{r['sdpa']['attention']:>11.2f} {r['attention_speedup']:>5.2f}x | {r['native']['step']:>11.2f} "
              f"{r['sdpa']['step']:>11.2f} {r['step_speedup']:>5.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({"config": {**config, "model": store.DEFAULT_MODEL, "dtype": "float32",
                                               "block_size": BLOCK_SIZE}, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
