"""Every benchmark script in bench/ runs end to end (tiny settings) and writes its JSON.

Figures are not asserted here (timings on a shared machine are noise); what is asserted is
what must hold whatever the timing: speculative output identical to plain decoding, every
request served, the KV pool back to full (the scripts assert it), the table's keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, f"bench/{script}", *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_engine_bench_native_and_hf(tmp_path):
    result = run_bench("engine.py", "--engines", "native", "native-int8", "native-int4", "hf",
                       "--concurrency", "1", "2",
                       "--max-tokens", "4", "--requests-per-level", "1", "--hf-requests", "1",
                       out=tmp_path / "engine.json")
    for level in ("1", "2"):
        native = result["native"][level]
        assert native["failed"] == 0 and native["tok_s"] > 0 and native["peak_rss_mib"] > 100
        assert native["itl_ms"]["count"] == 3 * max(int(level), 4)  # 4 tokens → 3 gaps per request
    assert result["hf"]["2"]["requests_served"] == 1
    for quantized in ("native-int8", "native-int4"):
        assert result[quantized]["2"]["failed"] == 0 and result[quantized]["2"]["tok_s"] > 0
    assert {"native / hf tok/s at C=2", "native-int8 / hf tok/s at C=2",
            "native-int4 / hf tok/s at C=2"} <= set(result["ratios"])
    assert result["floor"]["weight_bytes"] == 134_515_008 * 4  # SmolLM2's parameters, fp32


@pytest.mark.slow
def test_spec_decode_bench_ngram(tmp_path):
    result = run_bench("spec_decode.py", "--only", "ngram", "--max-tokens", "24",
                       out=tmp_path / "spec.json")
    (row,) = result["rows"]
    assert row["method"] == "ngram" and row["identical"] is True and row["acceptance_rate"] > 0


@pytest.mark.slow
def test_chunked_prefill_bench(tmp_path):
    result = run_bench("chunked_prefill.py", "--long-tokens", "600", "--num-short", "3",
                       "--interval-ms", "50", "--short-tokens", "2", out=tmp_path / "chunked.json")
    assert result["chunk_tokens"] == 128
    for name in ("alone", "chunked", "unchunked"):
        assert result[name]["ttft_ms"]["count"] == 3
    assert result["chunked"]["long_ttft_ms"] > 0 and result["alone"]["long_ttft_ms"] is None


@pytest.mark.slow
def test_quant_bench(tmp_path):
    result = run_bench("quant.py", "--max-tokens", "4", "--rounds", "1", out=tmp_path / "quant.json")
    assert set(result["decode"]) >= {"fp32", "int8", "int4"}
    weights = {name: row["weight_bytes_per_token"] for name, row in result["decode"].items()}
    assert weights["int8"] < weights["fp32"] / 3
    # the layers at 0.625 bytes a weight, the lm_head int8: ~95 MB against int8's ~135 MB
    assert 0.65 < weights["int4"] / weights["int8"] < 0.75
    assert result["quality"]["int4"]["perplexity"] < 1.01 * result["quality"]["fp32"]["perplexity"]


LLAMA_CPP_PYTHON = ROOT / ".venv-llama-cpp" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_CPP_PYTHON.exists(), reason="llama.cpp is a benchmark peer, not a "
                    "dependency: `make llama-cpp` builds it (~7 min)")
def test_quant_bench_against_llama_cpp(tmp_path):
    result = run_bench("quant.py", "--max-tokens", "4", "--rounds", "1",
                       "--llama-cpp-python", str(LLAMA_CPP_PYTHON), out=tmp_path / "quant.json")
    peer = result["decode"]["llama.cpp (GGUF)"]
    assert peer["itl_ms"] > 0 and peer["prefill_ms"] > 0 and peer["weight_bytes_per_token"] > 0
    assert result["llama_cpp"]["native_int8_vs_llama_cpp"] > 0
    assert result["llama_cpp"]["native_int4_vs_llama_cpp"] > 0


AIPERF = Path("/tmp/aiperf-venv/bin/aiperf")


@pytest.mark.slow
@pytest.mark.skipif(not AIPERF.exists(), reason=f"aiperf is not a dependency (1.2 GB); no {AIPERF} "
                    "(see bench/aiperf_crosscheck.py)")
def test_aiperf_crosscheck(tmp_path):
    result = run_bench("aiperf_crosscheck.py", "--aiperf", str(AIPERF), "--num-requests", "4",
                       "--concurrency", "2", "--output-len", "8", "--rounds", "1",
                       out=tmp_path / "crosscheck.json")
    for tool in ("sluice bench", "aiperf"):
        (run,) = result["runs"][tool]
        assert run["failed"] == 0 and run["ttft_ms"] > 0 and run["itl_ms"] > 0
    assert set(result["relative_difference"]) == {"ttft_ms", "itl_ms"}


def test_aiperf_crosscheck_says_where_aiperf_is_missing(tmp_path):
    proc = subprocess.run([sys.executable, "bench/aiperf_crosscheck.py", "--aiperf",
                           str(tmp_path / "none"), "--out", str(tmp_path / "x.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "aiperf not found" in proc.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_autoscale_bench_tiny(tmp_path):
    result = run_bench("autoscale.py", "--tiny", "--slo-percentile", "90",
                       out=tmp_path / "autoscale.json")
    assert set(result["configs"]) == {"static-1", "static-2", "autoscale"}
    # the percentile reaches the profile (capacity at that tail) and the manifests' SLO
    assert result["slo"]["percentile"] == result["capacity"]["profile"]["percentile"] == 90
    assert result["capacity"]["capacity_rps"] > 0 and result["capacity"]["profile"]["steps"]
    for name, run in result["configs"].items():
        assert run["requests"] == result["cut"]["requests"] > 0
        assert run["failed"] == 0 and run["truncated"] == 0, (name, run["errors"])
        assert 0 <= run["attainment_pct"] <= min(run["ttft_attainment_pct"],
                                                   run["itl_attainment_pct"]) <= 100
    static1, static2 = result["configs"]["static-1"], result["configs"]["static-2"]
    assert static1["mean_replicas"] == pytest.approx(1, abs=0.01)
    assert static2["mean_replicas"] == pytest.approx(2, abs=0.01)
    assert static1["scale_events"] == static2["scale_events"] == []
    assert 1 - 0.01 <= result["configs"]["autoscale"]["mean_replicas"] <= 2 + 0.01
    assert set(result["targets"]) >= {"attainment_points_vs_static_max",
                                      "replica_seconds_ratio_vs_static_max", "all_met"}
    assert (tmp_path / "autoscale.png").stat().st_size > 10_000


def test_autoscale_bench_fits_the_cut_to_the_capacity():
    """With --time-scale unset, the cut plays at the fastest scale whose peak 10 s rate is
    within peak-load x capacity: 20 requests in 10 trace seconds at 1 req/s need 20 s."""
    sys.path.insert(0, str(ROOT / "bench"))
    import autoscale  # noqa: PLC0415  (bench/autoscale.py)
    from sluice.bench.workload import TraceRow

    trace = [TraceRow(i * 0.5, 100, 10) for i in range(20)] + [TraceRow(150.0 + i, 100, 10)
                                                                for i in range(3)]
    cut = autoscale.Cut("t.csv", 0.0, 200.0, 1.0, 1.0, 1.0, 256, 32, 0)
    fitted = autoscale.fit_time_scale(trace, cut, 1.0)
    peak = autoscale.describe_cut(autoscale.cut_trace(trace, fitted), fitted)["peak_rps_10s"]
    faster = autoscale.replace(cut, time_scale=fitted.time_scale / 1.05)
    assert peak <= 1.0 < autoscale.describe_cut(autoscale.cut_trace(trace, faster),
                                                faster)["peak_rps_10s"]
    assert 1.5 < fitted.time_scale < 2.5 and fitted.span_s == cut.span_s


def test_autoscale_sim_bench_one_cut(tmp_path):
    """The simulator's sweep of bench/autoscale.py cuts: static-2 is the yardstick (ratio 1),
    static-1 costs half, the oracle does no worse than static-1."""
    result = run_bench("autoscale_sim.py", "--cut", "2100,120,0.04,0.5", "--shift", "0",
                       "--shift", "0.25", out=tmp_path / "autoscale_sim.json")
    row, shifted = result["cuts"]
    assert (row["shift_s"], shifted["shift_s"], result["runs"]) == (0.0, 0.25, 2)
    assert row["cut"] == shifted["cut"] == "azure2023_code_2100_120_0.04_0.5"
    assert row["requests"] == shifted["requests"] > 0
    assert row["static-2"]["replica_ratio"] == 1.0 and row["static-2"]["scale_events"] == 0
    assert row["static-1"]["replica_ratio"] == pytest.approx(0.5, abs=0.02)
    assert row["oracle"]["attainment_pct"] >= row["static-1"]["attainment_pct"]
    assert row["sluice"]["policy"].startswith("sluice:") and isinstance(row["target_met"], bool)
    assert result["slo"]["attainmentPct"] == 99.0
    looser = run_bench("autoscale_sim.py", "--cut", "2100,120,0.04,0.5", "--shift", "0",
                       "--attainment", "95", out=tmp_path / "autoscale_sim_95.json")
    # a replica holds more load when 1 request in 20 may miss than when 1 in 100 may
    assert looser["cuts"][0]["capacity_rps"] > row["capacity_rps"]


def test_autoscale_bench_reads_the_supervisors_log_and_builds_valid_manifests():
    sys.path.insert(0, str(ROOT / "bench"))
    import autoscale  # noqa: PLC0415  (bench/autoscale.py)
    from sluice.api.service import parse_manifest

    log = "\n".join([
        "2026-01-01 10:00:00,000 INFO sluice.local.processes: started worker-0 (pid 1): http://a",
        "[worker-0] 2026-01-01 10:00:05,000 INFO x: started worker-9 (pid 9): http://not-ours",
        "2026-01-01 10:00:10,000 INFO sluice.local.autoscaler: autoscaler: 1 -> 2 replicas "
        "(burst; demand 2.00 req/s, capacity 1.00 req/s per replica, 3 queued, 0 held)",
        "2026-01-01 10:00:10,500 INFO sluice.local.processes: started worker-1 (pid 2): http://b",
        "2026-01-01 10:00:30,000 INFO sluice.local.processes: worker-1 stopped",
        "2026-01-01 10:00:40,000 ERROR sluice.local.processes: worker-0 exited with code 1 "
        "after 40 s; restarting in 1 s",
        "2026-01-01 10:00:41,000 INFO sluice.local.processes: started worker-0 (pid 3): http://a",
    ])
    events = autoscale.worker_events(log)
    t = events[0][0]
    assert [(round(e - t, 1), n) for e, n in events] == [(0, 1), (10.5, 2), (30, 1), (40, 0),
                                                         (41, 1)]
    # 1 worker for [5, 10.5), 2 for [10.5, 30), 1 for [30, 40), 0 for [40, 41), 1 for [41, 50)
    assert autoscale.integrate(events, t + 5, t + 50) == pytest.approx(5.5 + 39 + 10 + 9)
    assert autoscale.integrate(events, t - 5, t) == 0
    (event,) = autoscale.scale_events(log)
    assert (event["from"], event["to"], event["reason"]) == (1, 2, "burst")

    base = autoscale.yaml.safe_load(autoscale.EXAMPLE.read_text())
    slo = {"ttftMs": 2000, "itlMs": 300, "percentile": 95}
    for config in autoscale.CONFIGS:
        spec = parse_manifest(autoscale.build_manifest(base, config, slo, 0.5, {})).spec
        assert spec.autoscaling.enabled == (config == "autoscale")
        assert spec.replicas == {"static-1": 1, "static-2": 2, "autoscale": 1}[config]
        assert (spec.resources.cpu_threads(), spec.slo.ttft_ms, spec.autoscaling.capacity_rps) \
            == (1, 2000, 0.5)

    rows = [autoscale.workload.TraceRow(float(i), 1000 + i, 100) for i in range(100)]
    cut = autoscale.Cut("t", start_s=10, span_s=50, keep=0.5, time_scale=0.5, input_scale=0.1,
                        max_input=103, max_output=32)
    kept = autoscale.cut_trace(rows, cut)
    assert 10 < len(kept) < 40 and kept == autoscale.cut_trace(rows, cut)  # seeded
    assert all(0 <= r.arrival_s < 25 and r.input_tokens <= 103 and r.output_tokens == 32
               for r in kept)


@pytest.mark.slow
def test_fan_out_bench(tmp_path):
    """Tiny: 150 prompts x n 2 against a worker of its own; the small requests complete
    while the large one runs, and leaving it makes the worker idle (its abort)."""
    result = run_bench("fan_out.py", "--prompts", "150", "--n", "2", "--small", "2",
                       "--threads", "1", out=tmp_path / "fan_out.json")
    assert result["sequences"] == 300 and len(result["small_alone_seconds"]) == 2
    assert result["big_status"] in ("left", 200)
    if result["big_status"] == "left":
        assert len(result["small_seconds"]) == 2 and result["idle_after_abort_s"] is not None


def test_paged_decode_bench(tmp_path):
    """Tiny: B = 1 and 2, two rounds; both decode paths run and agree (the script asserts it)."""
    result = run_bench("paged_decode.py", "--batch", "1", "2", "--repeats", "2", "--max-ctx", "40",
                       "--min-ctx", "1", out=tmp_path / "paged_decode.json")
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["native"]["attention"] > 0 and row["sdpa"]["step"] > 0 and row["step_speedup"] > 0


@pytest.mark.slow
def test_boot_bench(tmp_path):
    result = run_bench("boot.py", "--rounds", "1", "--no-load", out=tmp_path / "boot.json")
    (name,) = result["conditions"]
    row = result["conditions"][name]
    assert name == "quiet" and len(row["fresh"]["boots_s"]) == len(row["forked"]["boots_s"]) == 1
    assert row["speedup"] == row["fresh"]["median_s"] / row["forked"]["median_s"]


@pytest.mark.slow
def test_gpu_bench_dry_run_on_the_cpu(tmp_path, model_path):
    """bench/gpu.py's own logic (a GPU is what it is for; none here): seeded random weights
    in the model's shape, the engine equal to HF in float32, every token counted."""
    result = run_bench("gpu.py", "--device", "cpu", "--model", str(model_path),
                       "--random-weights", "--prompts", "3", "--concurrency", "2",
                       "--output-len", "4", out=tmp_path / "gpu.json")
    fp32, bf16 = result["equality"]
    assert (fp32["dtype"], fp32["equal_alone"], fp32["equal_batched"]) == ("float32", 3, 3)
    assert fp32["differ_beyond_ties"] == [] and bf16["prompts"] == 3
    (row,) = result["throughput"]
    assert (row["native_tokens"], row["hf_tokens"]) == (8, 8)
    assert result["random_weights"] is True and result["gpu"] is None
