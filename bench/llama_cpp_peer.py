"""llama.cpp, the CPU peer of bench/quant.py: batch-1 greedy decode of a GGUF file through
llama-cpp-python's API, run by the Python of a side venv (a benchmark peer, not a
dependency of Sluice: ``make llama-cpp`` builds it from its sdist).

    PEER_PYTHON bench/llama_cpp_peer.py GGUF --tokens 1,2,3 --max-tokens 64 --threads 2

Feeds the prompt's token ids (so both engines see the same prompt), then generates
``--max-tokens`` tokens greedily without stopping at EOS, one token per eval (its Python
server serves one request at a time too: this is llama.cpp's batch-1 path). Prints one JSON
line: prefill_ms (the prompt's eval), itl_ms (median per-token time: eval + greedy pick),
itl_min_ms, the per-token times and the versions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--tokens", required=True, help="the prompt's token ids, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import llama_cpp

    prompt = [int(t) for t in args.tokens.split(",")]
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=len(prompt) + args.max_tokens + 8,
                          n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                          verbose=False)
    llm.eval(prompt[:4])  # warm-up, then start over
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - start
    times = []
    for _ in range(args.max_tokens):
        start = time.perf_counter()
        token = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([token])
        times.append(time.perf_counter() - start)
    print(json.dumps({"prefill_ms": prefill * 1e3, "itl_ms": statistics.median(times) * 1e3,
                      "itl_min_ms": min(times) * 1e3, "step_ms": [t * 1e3 for t in times],
                      "threads": args.threads, "llama_cpp_python": llama_cpp.__version__}))


if __name__ == "__main__":
    main()
