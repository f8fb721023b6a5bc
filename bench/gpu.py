"""The native engine on CUDA (issue 13's GPU check): greedy output token for token against HF
transformers on the engine tests' prompts, and offline output tok/s against HF transformers'
batched ``generate`` on the same GPU.

    python bench/gpu.py [--model DIR] [--random-weights] [--out JSON]

Needs a CUDA device (none here: ``--device cpu --prompts 3`` is the tiny form the tests run,
a check of the script, not of CUDA). Not yet run on a GPU: the session that wrote it was
lent none.

Equality, in float32 (TF32 off, as both libraries default): the 22 prompts of
tests/test_engine.py, 24 greedy tokens each, through the engine one prompt at a time and all
at once (continuous batching), against HF ``generate`` on the GPU; HF on the CPU gives the
noise floor (a prompt on which HF's own CPU and GPU answers differ is a near-tie of the
weights, not an engine error). bfloat16 is reported the same way (not asserted: rounding
differs between any two bf16 implementations).

Speed, in bfloat16: C requests of 128 random prompt tokens, 128 output tokens each
(ignore_eos), submitted at once to ``LLMEngine.generate`` (the offline path, as vLLM's
``benchmark_throughput``); output tokens / wall seconds, after a warm-up. The anchor is HF
``generate`` on the same batch (equal lengths: no padding). vLLM is not an anchor here when
the machine has no vLLM build for its GPU (a CUDA vLLM wheel is ~400 MB; it does not travel to
a machine that cannot fetch): the JSON says so.

``--random-weights``: the model's own config and tokenizer with seeded random weights
(``AutoModelForCausalLM.from_config``, seed 0), for a machine the weights cannot reach (the
converted SmolLM2 folder is 540 MB). The equality test exercises the same code path on any
weights; the speed depends only on the shapes.

Exit status 0 when every float32 prompt matches HF on the GPU or is a near-tie (HF CPU and GPU
differ on it too), 1 otherwise, 2 without a CUDA device.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_engine import MAX_TOKENS, PROMPTS  # noqa: E402  (the engine tests' prompts)

from sluice.argtypes import positive_count, whole  # noqa: E402
from sluice.cli import Parser  # noqa: E402
from sluice.worker.engine import EngineConfig  # noqa: E402
from sluice.worker.engine.llm_engine import LLMEngine  # noqa: E402
from sluice.worker.sampling_params import SamplingParams  # noqa: E402

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def random_model(source: Path, into: Path) -> Path:
    """A folder with ``source``'s config and tokenizer and seeded random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source),
                                             dtype=torch.float32)
    model.save_pretrained(into, safe_serialization=True)
    for name in SIDE_FILES:
        if (source / name).exists():
            shutil.copy(source / name, into / name)
    return into


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Hand freed GPU memory back before the next model loads."""
    if device == "cuda":
        torch.cuda.empty_cache()


def hf_greedy(model, prompts: list[list[int]], device: str) -> list[list[int]]:
    """HF greedy ``generate``, one prompt at a time: MAX_TOKENS output ids each."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids], device=device), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


def equality(model_dir: Path, dtype: str, tokenizer, device: str, n: int) -> dict:
    """The engine against HF, greedy, on the first ``n`` PROMPTS (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    prompts = [tokenizer.encode(p) for p in PROMPTS[:n]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    on_cpu = hf_greedy(hf, prompts, "cpu")
    hf_gpu = hf_greedy(hf.to(device), prompts, device)
    del hf
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype=dtype,
                                    kv_cache_gib=1.0))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    alone = [engine.generate([ids], greedy)[0] for ids in prompts]
    batched = engine.generate(prompts, greedy)
    del engine
    release(device)
    ties = [i for i in range(len(prompts)) if on_cpu[i] != hf_gpu[i]]
    wrong = [i for i in range(len(prompts)) if i not in ties
             and (alone[i] != hf_gpu[i] or batched[i] != hf_gpu[i])]
    return {"dtype": dtype, "prompts": len(prompts), "max_tokens": MAX_TOKENS,
            "equal_alone": sum(a == r for a, r in zip(alone, hf_gpu)),
            "equal_batched": sum(b == r for b, r in zip(batched, hf_gpu)),
            "hf_cpu_vs_gpu_differ": ties, "differ_beyond_ties": wrong,
            "first_wrong": [{"prompt": PROMPTS[i], "hf": hf_gpu[i], "engine_alone": alone[i],
                             "engine_batched": batched[i]} for i in wrong[:3]]}


def throughput(model_dir: Path, concurrency: int, input_len: int, output_len: int,
               device: str) -> dict:
    """Output tok/s of the engine and of HF ``generate`` (bf16), C prompts at once."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(concurrency)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = torch.randint(100, vocab - 100, (concurrency, input_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype="bfloat16",
                                    kv_cache_gib=8.0, max_num_seqs=max(64, concurrency),
                                    max_num_batched_tokens=max(2048, input_len),
                                    enable_prefix_caching=False))
    engine.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    sync(device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(device)
    native_s = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    del engine
    release(device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    batch = torch.tensor(prompts, device=device)
    with torch.no_grad():
        hf.generate(batch[:2], attention_mask=torch.ones_like(batch[:2]), max_new_tokens=8,
                    do_sample=False)  # warm-up
        sync(device)
        start = time.perf_counter()
        hf_out = hf.generate(batch, attention_mask=torch.ones_like(batch),
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False)
        sync(device)
    hf_s = time.perf_counter() - start
    hf_tokens = (hf_out.shape[1] - input_len) * concurrency
    del hf
    release(device)
    return {"concurrency": concurrency, "input_len": input_len, "output_len": output_len,
            "native_tokens": tokens, "native_s": round(native_s, 3),
            "native_tok_s": round(tokens / native_s, 1), "hf_tokens": hf_tokens,
            "hf_s": round(hf_s, 3), "hf_tok_s": round(hf_tokens / hf_s, 1),
            "native_over_hf": round((tokens / native_s) / (hf_tokens / hf_s), 2)}


def _levels(text: str) -> list[int]:
    """``"1,64"`` → [1, 64]: concurrency levels, each a whole number ≥ 1."""
    return [positive_count(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="bench/gpu.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/sluice/models/"
                                                "SmolLM2-135M-Instruct"),
                        help="a converted model folder (default: the store's SmolLM2)")
    parser.add_argument("--random-weights", action="store_true",
                        help="the folder's config and tokenizer, seeded random weights")
    parser.add_argument("--concurrency", type=_levels, default="1,64,256",
                        help="comma-separated C values")
    parser.add_argument("--output-len", type=positive_count, default=128,
                        help="output tokens per request")
    parser.add_argument("--device", default="cuda", help="cuda (cpu: a slow dry run of the "
                        "script itself)")
    parser.add_argument("--prompts", type=whole(1), default=len(PROMPTS),
                        help="the first N of the engine tests' prompts")
    parser.add_argument("--out", default=str(ROOT / "bench/results/gpu.json"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    source = Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_model(source, Path(tmp)) if args.random_weights else source
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
        result = {"gpu": gpu, "torch": torch.__version__,
                  "model": source.name, "random_weights": args.random_weights,
                  "vllm": _vllm_version(), "equality": [], "throughput": []}
        for dtype in ("float32", "bfloat16"):
            row = equality(model_dir, dtype, tokenizer, args.device, args.prompts)
            result["equality"].append(row)
            print(f"{dtype}: engine = HF on {row['equal_alone']}/{row['prompts']} prompts alone, "
                  f"{row['equal_batched']}/{row['prompts']} batched; HF CPU vs GPU differ on "
                  f"{row['hf_cpu_vs_gpu_differ']}; beyond those: {row['differ_beyond_ties']}",
                  flush=True)
        for c in args.concurrency:
            row = throughput(model_dir, c, 128, args.output_len, args.device)
            result["throughput"].append(row)
            print(f"C={c}: native {row['native_tok_s']} tok/s, HF generate {row['hf_tok_s']} "
                  f"tok/s ({row['native_over_hf']}x)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if result["equality"][0]["differ_beyond_ties"] else 0


def _vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return vllm.__version__


if __name__ == "__main__":
    sys.exit(main())
