"""INT8 and 4-bit weight-only quantization: perplexity, batch-1 decode latency and the
bandwidth floor.

Compares the native engine in fp32, with int8 weights (``quantize_int8``, lm_head included:
the default of ``--quantization int8``), with int8 layers but an fp32 lm_head (the
measurement behind that default), and with 4-bit layers (``--quantization int4``: the
GGUF's own Q4_1 blocks, lm_head int8), and with 4-bit layers run one op at a time from
Python instead of in one ``decode_layers`` call (what that call saves). Prints a table and
writes JSON (default bench/results/quant.json).

- perplexity: of a fixed English text embedded below, from prompt logprobs (the prefill
  path), plus the decode-kernel numerics (int8 prefill chunks small enough for the decode
  steps' kernel) and the share of positions whose top-1 token equals fp32's (teacher-forced).
- decode: batch 1, greedy, same prompt, ``--max-tokens`` tokens; ITL is the median
  ``engine.step()`` time over the decode steps of all rounds (rounds alternate between the
  variants so that background load hits them alike).
- floor: weight bytes read per decode token ÷ memory bandwidth. Bandwidth is measured here
  with a large tensor copy (read + write bytes ÷ time). ITL/floor says how close to
  memory-bound the decode is.
- llama.cpp, the CPU peer, on the GGUF file the model store fetched (SmolLM2's is Q4_1),
  same prompt tokens, same threads, greedy, batch 1 (``bench/llama_cpp_peer.py``, run in
  the side venv ``make llama-cpp`` builds; skipped with a line when it is missing): its ITL
  and prefill time, once per round between the native variants. Its weights row counts the
  GGUF file's bytes.

    .venv/bin/python bench/quant.py [--max-tokens 64] [--rounds 5] [--threads N] [--profile]
        [--llama-cpp-python .venv-llama-cpp/bin/python]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

from sluice.models import store
from sluice.worker.engine import EngineConfig
from sluice.worker.sampling_params import SamplingParams
from sluice.worker.engine import quant
from sluice.worker.engine.llm_engine import LLMEngine
from sluice.worker.engine.models.llama import RMSNorm

TEXT = """\
The river that runs through the old market town is not wide, but it is fast, and for most of \
the town's history it has decided where people could live and how they could earn a living. \
Mills were built along its banks in the twelfth century, first to grind grain and later to \
drive the looms of a small cloth industry. When the railway arrived, the mills closed one by \
one, and the buildings were turned into warehouses, then workshops, and finally apartments.

Every spring the water rises. Most years it stays inside its stone walls, but about once a \
decade it spills into the lower streets, and the shopkeepers move their goods upstairs and wait. \
The town council has debated a flood barrier for forty years. Engineers have drawn plans, \
residents have argued about the cost, and each time the water has gone down again before a \
decision was made.

Visitors usually come for the bridge. It has five arches of grey stone, and the middle one is \
higher than the others so that barges could pass beneath it. On market days the bridge is \
crowded with stalls selling bread, cheese, honey and vegetables from the farms in the valley. \
In the evening, when the stalls are packed away, people walk across it slowly and watch the \
light change on the water.

A small museum near the church tells the story of the town in a few rooms. There are tools from \
the mills, photographs of the great flood, a model of the bridge, and a letter written by a \
young weaver to her brother, who had gone to work in the city. She writes that the work is hard \
and the pay is poor, but that she would not leave the valley for anything, because the river \
sounds different here than anywhere else in the world.
"""

PROMPT = "Write a short story about a lighthouse keeper."
TARGET = 1.5  # batch-1 int8 ITL / bandwidth floor
ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = ROOT / ".venv-llama-cpp" / "bin" / "python"


def llama_cpp_round(python: Path, gguf: Path, prompt: list[int], max_tokens: int,
                    threads: int) -> dict:
    """One batch-1 run of llama.cpp (bench/llama_cpp_peer.py) in the side venv's Python."""
    out = subprocess.run([str(python), str(ROOT / "bench" / "llama_cpp_peer.py"), str(gguf),
                          "--tokens", ",".join(map(str, prompt)), "--max-tokens", str(max_tokens),
                          "--threads", str(threads)],
                         check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.splitlines()[-1])


def build_engines(path: Path) -> dict[str, LLMEngine]:
    """fp32; int8 through the engine flag; int8 layers with the lm_head left in fp32; int4;
    int4 with its decode steps through the Python layers (without ``decode_layers``)."""
    def make(quantization=None):
        return LLMEngine(EngineConfig(model=str(path), quantization=quantization, kv_cache_gib=0.1))
    int8_fp32_head = make()
    quant.quantize_int8(int8_fp32_head.runner.model, lm_head=False)
    int4_python_layers = make("int4")
    int4_python_layers.runner.model.decode_step_weights = None
    return {"fp32": make(), "int8": make("int8"), "int8, fp32 lm_head": int8_fp32_head,
            "int4": make("int4"), "int4, Python layers": int4_python_layers}


def prompt_logprobs(engine: LLMEngine, ids: list[int]) -> list:
    """Per-position TokenLogprob of ``ids[1:]`` (top-1 alternative included)."""
    engine.add_request(f"ppl-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         prompt_logprobs=1))
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.prompt_logprobs[1:] if o.prompt_logprobs else []
    return out


def quality(engines: dict[str, LLMEngine], path: Path) -> dict[str, dict]:
    """Perplexity and teacher-forced top-1 agreement with fp32 on TEXT; "int8, decode
    kernel" prefills in chunks of 32 tokens, so that every int8 matmul runs the decode
    steps' kernel (below 48 rows: fp32 activations) instead of the two-digit int8 GEMM."""
    ids = engines["fp32"].tokenizer.encode(TEXT)
    runs = {name: prompt_logprobs(e, ids) for name, e in engines.items()}
    runs["int8, decode kernel"] = prompt_logprobs(LLMEngine(EngineConfig(
        model=str(path), quantization="int8", kv_cache_gib=0.1, long_prefill_token_threshold=32)), ids)
    ref_top = [lp.top[0][0] for lp in runs["fp32"]]
    return {name: {"tokens": len(lps),
                   "perplexity": math.exp(-sum(lp.logprob for lp in lps) / len(lps)),
                   "top1_agreement": sum(lp.top[0][0] == t for lp, t in zip(lps, ref_top)) / len(lps)}
            for name, lps in runs.items()}


def decode_steps(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds of each step of one batch-1 request: the prefill, then each decode step."""
    engine.add_request(f"itl-{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def bytes_per_token(model: nn.Module) -> int:
    """Weight bytes one batch-1 decode step reads: every linear (int8 + the scales the kernel
    reads, or fp32), the norms; the embedding lookup reads one row and is left out."""
    total = 0
    for m in model.modules():
        if isinstance(m, quant.Int8Linear):
            tensors = [m.weight, m.scales_bf16, m.bias]
        elif isinstance(m, quant.Int4Linear):  # the nibbles with their (d, m) blocks
            tensors = [m.weight, m.bias]
        elif isinstance(m, nn.Linear):
            tensors = [m.weight, m.bias]
        elif isinstance(m, RMSNorm):
            tensors = [m.weight]
        else:
            continue
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def bandwidth(mib: int = 512, repeats: int = 9) -> tuple[float, float]:
    """Bytes/s on a tensor far larger than the caches: (``dst.copy_(src)`` counting read +
    write bytes, the floor's measure; ``src.sum()``, read only, for reference)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)

    def median_seconds(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    nbytes = src.numel() * 4
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src)), nbytes / median_seconds(src.sum)


def profile_decode(engine: LLMEngine, prompt: list[int], steps: int = 16) -> dict:
    """Where a batch-1 int8 decode step goes: op self times (torch.profiler) vs wall time."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(f"prof-{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    kernel = [e for e in events if e.key in ("sluice::int8_linear", "aten::_weight_int8pack_mm")]
    kernel_ms = sum(e.self_cpu_time_total for e in kernel) / 1e3 / steps
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(f"per decode step under the profiler (which adds a few us per op): wall {wall_ms:.1f} ms ="
          f" int8 matmuls {kernel_ms:.1f} ms + other ops {ops_ms - kernel_ms:.1f} ms"
          f" ({sum(e.count for e in events) / steps:.0f} op calls) + outside ops {wall_ms - ops_ms:.1f} ms")
    return {"wall_ms_per_step": wall_ms, "int8_matmul_ms_per_step": kernel_ms,
            "other_ops_ms_per_step": ops_ms - kernel_ms, "outside_ops_ms_per_step": wall_ms - ops_ms,
            "op_calls_per_step": sum(e.count for e in events) / steps,
            "top_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                         "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in events[:12]]}


def report(result: dict) -> None:
    """Print the quality and decode tables of a result."""
    quality_rows, rows = result["quality"], result["decode"]
    print(f"\n{result['model']}: {quality_rows['fp32']['tokens']} scored tokens; batch-1 decode of "
          f"{result['max_tokens']} tokens x {result['rounds']} rounds; torch threads {result['threads']}; "
          f"bandwidth: copy {result['copy_bandwidth_gb_s']:.1f} GB/s, "
          f"read {result['read_bandwidth_gb_s']:.1f} GB/s; "
          f"load average {result['load_average_1min'][0]:.1f}")
    print(f"{'variant':<22} | {'perplexity':>10} | {'top-1 = fp32':>12}")
    for name, q in quality_rows.items():
        print(f"{name:<22} | {q['perplexity']:>10.3f} | {q['top1_agreement']:>11.1%}")
    print(f"\n{'variant':<22} | {'prefill ms':>10} | {'ITL ms':>7} | {'min ms':>7} | {'p90 ms':>7} | "
          f"{'speedup':>7} | {'weights MB':>10} | {'floor ms':>8} | {'ITL/floor':>9}")
    for name, r in rows.items():
        print(f"{name:<22} | {r['prefill_ms']:>10.1f} | {r['itl_ms']:>7.1f} | {r['itl_min_ms']:>7.1f} | "
              f"{r['itl_p90_ms']:>7.1f} | "
              f"{r['speedup_vs_fp32']:>6.2f}x | {r['weight_bytes_per_token'] / 1e6:>10.1f} | "
              f"{r['floor_ms']:>8.1f} | {r['itl_over_floor']:>9.2f}")
    print(f"target int8 ITL <= {TARGET}x floor: {'met' if result['target_met'] else 'missed'}")
    peer = result.get("llama_cpp")
    if peer:
        print(f"llama.cpp {peer['llama_cpp_python']} on {Path(peer['gguf']).name}, "
              f"{result['prompt_tokens']}-token prompt: native int4 decodes at "
              f"{peer['native_int4_vs_llama_cpp']:.2f}x its tok/s, int8 at "
              f"{peer['native_int8_vs_llama_cpp']:.2f}x (fp32: "
              f"{peer['native_fp32_vs_llama_cpp']:.2f}x); target >= 1: "
              f"{'met' if peer['native_int4_vs_llama_cpp'] >= 1 else 'missed'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=store.DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="decode runs per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="profile int8 decode steps")
    parser.add_argument("--llama-cpp-python", default=str(LLAMA_CPP_PYTHON),
                        help="the side venv's Python with llama-cpp-python (make llama-cpp)")
    parser.add_argument("--out", default="bench/results/quant.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = store.fetch(args.model)
    engines = build_engines(model_dir)
    gguf = store.sluice_home() / "gguf" / f"{args.model}.gguf"
    peer_python = Path(args.llama_cpp_python)
    if not peer_python.exists() or not gguf.exists():
        print(f"llama.cpp skipped: {peer_python if not peer_python.exists() else gguf} is missing "
              "(make llama-cpp builds the side venv)")
        peer_python = None
    peer_runs = []
    tokenizer = engines["fp32"].tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True))
    load_before = os.getloadavg()[0]
    copy_bw, read_bw = bandwidth()
    quality_rows = quality(engines, model_dir)
    steps: dict[str, list[float]] = {name: [] for name in engines}
    prefills: dict[str, list[float]] = {name: [] for name in engines}
    for e in engines.values():
        decode_steps(e, prompt, 4)  # warm-up
    for _ in range(args.rounds):
        for name, e in engines.items():
            prefill, *decode = decode_steps(e, prompt, args.max_tokens)
            prefills[name].append(prefill)
            steps[name] += decode
        if peer_python:
            peer_runs.append(llama_cpp_round(peer_python, gguf, prompt, args.max_tokens,
                                             torch.get_num_threads()))
    copy_bw, read_bw = (max(a, b) for a, b in zip((copy_bw, read_bw), bandwidth()))  # less disturbed

    rows = {}
    for name, e in engines.items():
        itl = statistics.median(steps[name])
        nbytes = bytes_per_token(e.runner.model)
        rows[name] = {"itl_ms": itl * 1e3, "itl_min_ms": min(steps[name]) * 1e3,
                      "prefill_ms": statistics.median(prefills[name]) * 1e3,
                      "itl_p90_ms": sorted(steps[name])[int(0.9 * len(steps[name]))] * 1e3,
                      "weight_bytes_per_token": nbytes, "floor_ms": nbytes / copy_bw * 1e3,
                      "itl_over_floor": itl / (nbytes / copy_bw),
                      "floor_read_bw_ms": nbytes / read_bw * 1e3}
    for name in rows:
        rows[name]["speedup_vs_fp32"] = rows["fp32"]["itl_ms"] / rows[name]["itl_ms"]
    result = {"model": args.model, "threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
              "rounds": args.rounds, "copy_bandwidth_gb_s": copy_bw / 1e9,
              "read_bandwidth_gb_s": read_bw / 1e9,
              "load_average_1min": [load_before, os.getloadavg()[0]],
              "quality": quality_rows, "decode": rows, "target_itl_over_floor": TARGET,
              "target_met": rows["int8"]["itl_over_floor"] <= TARGET}
    result["prompt_tokens"] = len(prompt)
    if peer_runs:
        peer_steps = [t / 1e3 for run in peer_runs for t in run["step_ms"]]
        itl = statistics.median(peer_steps)
        nbytes = gguf.stat().st_size
        rows["llama.cpp (GGUF)"] = {
            "itl_ms": itl * 1e3, "itl_min_ms": min(peer_steps) * 1e3,
            "prefill_ms": statistics.median(r["prefill_ms"] for r in peer_runs),
            "itl_p90_ms": sorted(peer_steps)[int(0.9 * len(peer_steps))] * 1e3,
            "weight_bytes_per_token": nbytes, "floor_ms": nbytes / copy_bw * 1e3,
            "itl_over_floor": itl / (nbytes / copy_bw), "floor_read_bw_ms": nbytes / read_bw * 1e3,
            "speedup_vs_fp32": rows["fp32"]["itl_ms"] / (itl * 1e3)}
        result["llama_cpp"] = {
            "gguf": str(gguf), "llama_cpp_python": peer_runs[0]["llama_cpp_python"],
            "native_int4_vs_llama_cpp": itl * 1e3 / rows["int4"]["itl_ms"],
            "native_int8_vs_llama_cpp": itl * 1e3 / rows["int8"]["itl_ms"],
            "native_fp32_vs_llama_cpp": itl * 1e3 / rows["fp32"]["itl_ms"]}
    if args.profile:
        prof = result["profile_int8"] = profile_decode(engines["int8"], prompt)
        itl = rows["int8"]["itl_ms"]
        print(f"unprofiled int8 ITL {itl:.1f} ms: int8 matmuls ~{prof['int8_matmul_ms_per_step']:.1f} ms "
              f"({rows['int8']['weight_bytes_per_token'] / prof['int8_matmul_ms_per_step'] / 1e6:.1f} GB/s), "
              f"the rest (small ops, Python, sampling) ~{itl - prof['int8_matmul_ms_per_step']:.1f} ms")

    report(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
