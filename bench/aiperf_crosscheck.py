"""Cross-check ``sluice bench`` against NVIDIA's aiperf on the same endpoint and workload.

One native worker; the two tools take turns (sluice, aiperf, sluice, aiperf, ...) with the
same closed-loop load: C concurrent streams of /v1/completions, fixed-length synthetic
prompts, exactly ``--output-len`` tokens each (``ignore_eos``). The medians of TTFT and ITL
should agree within 10 %.

The tools define ITL slightly differently: sluice bench takes the median over every
inter-token gap; aiperf the median over requests of each request's mean gap
((E2E − TTFT) / (output tokens − 1)). On a steady closed loop both land on the same value.

aiperf is not a project dependency (1.2 GB); install it in its own venv first:

    python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf
    .venv/bin/python bench/aiperf_crosscheck.py [--aiperf /tmp/aiperf-venv/bin/aiperf]

Prints a table and writes JSON (default bench/results/aiperf_crosscheck.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from router import Proc, bench, free_port, load_average  # noqa: E402  (bench/router.py)
from sluice.models import store  # noqa: E402

TOLERANCE = 0.10  # |sluice − aiperf| / aiperf, medians


def run_sluice(url: str, model: Path, args, out: Path) -> dict[str, float]:
    s = bench(url, model.name, model, out, "--endpoint", "completions", "--concurrency",
              str(args.concurrency), "--num-requests", str(args.num_requests), "--input-len",
              str(args.input_len), "--output-len", str(args.output_len), "--warmup", "2")
    return {"ttft_ms": s["ttft_ms"]["p50"], "itl_ms": s["itl_ms"]["p50"], "failed": s["failed"]}


def run_aiperf(binary: str, url: str, model: Path, args, out_dir: Path) -> dict[str, float]:
    argv = [binary, "profile", "--model", model.name, "--url", url, "--endpoint-type",
            "completions", "--streaming", "--tokenizer", str(model), "--use-server-token-count",
            "--concurrency", str(args.concurrency), "--request-count", str(args.num_requests),
            "--warmup-request-count", "2",
            "--prompt-input-tokens-mean", str(args.input_len), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(args.output_len),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--ui-type", "none", "--output-artifact-dir", str(out_dir)]
    proc = subprocess.run(argv, cwd=out_dir.parent, capture_output=True, text=True)
    exported = out_dir / "profile_export_aiperf.json"
    if proc.returncode != 0 or not exported.exists():
        raise RuntimeError(f"aiperf failed ({proc.returncode}): {proc.stderr[-3000:]}")
    data = json.loads(exported.read_text())
    metrics = data.get("records", data)  # the summary metrics, keyed by tag
    errors = metrics.get("error_request_count") or {}
    return {"ttft_ms": metrics["time_to_first_token"]["p50"],
            "itl_ms": metrics["inter_token_latency"]["p50"],
            "failed": int(errors.get("avg") or 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=store.DEFAULT_MODEL)
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "/tmp/aiperf-venv/bin/aiperf")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="turns per tool")
    p.add_argument("--worker-threads", type=int, default=1, help="the worker's torch threads")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "aiperf_crosscheck.json"))
    args = p.parse_args()
    if not Path(args.aiperf).exists():
        print(f"aiperf not found at {args.aiperf}; see this script's docstring", file=sys.stderr)
        return 2
    model = store.fetch(args.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runs: dict[str, list[dict]] = {"sluice bench": [], "aiperf": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # one thread: the client (aiperf runs several busy processes) needs the other cores,
        # and an OpenMP team that loses a core to it slows down many times over
        worker = Proc([sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "worker",
                       "--model", str(model), "--port", str(port)], tmp / "worker.log",
                      env={"OMP_NUM_THREADS": str(args.worker_threads)})
        try:
            worker.ready(f"{url}/health")
            for r in range(args.rounds):
                runs["sluice bench"].append(run_sluice(url, model, args, tmp / f"sluice-{r}.json"))
                runs["aiperf"].append(run_aiperf(args.aiperf, url, model, args, tmp / f"aiperf-{r}"))
        finally:
            worker.stop()
    medians = {tool: {k: statistics.median(run[k] for run in rs) for k in ("ttft_ms", "itl_ms")}
               for tool, rs in runs.items()}
    diff = {k: abs(medians["sluice bench"][k] - medians["aiperf"][k]) / medians["aiperf"][k]
            for k in ("ttft_ms", "itl_ms")}
    result = {"model": args.model, "load_average": load_average(),
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "runs": runs, "medians": medians, "relative_difference": diff,
              "within_tolerance": all(d <= TOLERANCE for d in diff.values())}
    print(f"\n{args.model}: C={args.concurrency}, {args.num_requests} requests, "
          f"{args.input_len} in / {args.output_len} out, {args.rounds} turns per tool")
    print(f"{'tool':<14}| TTFT p50 ms | ITL p50 ms")
    for tool, m in medians.items():
        print(f"{tool:<14}| {m['ttft_ms']:11.1f} | {m['itl_ms']:10.2f}")
    print(f"{'difference':<14}| {diff['ttft_ms']:10.1%} | {diff['itl_ms']:9.1%}"
          f"   (tolerance {TOLERANCE:.0%}: {'met' if result['within_tolerance'] else 'missed'})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
