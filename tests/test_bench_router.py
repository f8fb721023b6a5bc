"""bench/router.py runs end to end with tiny settings and writes its JSON (figures are not
asserted: timings on a shared machine are noise; what must hold is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import router as bench_router  # noqa: E402  (bench/router.py)


def test_coprime_groups_and_overhead_summary():
    assert bench_router.coprime_groups(8, 4) == 9 and bench_router.coprime_groups(7, 4) == 7
    paths = {"direct": {"latency": [{"e2e_p50_ms": 1.0, "e2e_p99_ms": 2.0, "rps": 0, "failed": 0}],
                        "throughput": [{"rps": 100.0, "e2e_p50_ms": 0, "e2e_p99_ms": 0,
                                        "failed": 0}]},
             "sluice": {"latency": [{"e2e_p50_ms": 1.5, "e2e_p99_ms": 3.0, "rps": 0, "failed": 0}],
                        "throughput": [{"rps": 80.0, "e2e_p50_ms": 0, "e2e_p99_ms": 0,
                                        "failed": 1, "ttft_p50_ms": 900.0,
                                        "router_cpu_ms_per_request": 0.6}]},
             "vllm-router": {"latency": [{"e2e_p50_ms": 1.2, "e2e_p99_ms": 2.5, "rps": 0,
                                          "failed": 0}],
                             "throughput": [{"rps": 90.0, "e2e_p50_ms": 0, "e2e_p99_ms": 0,
                                             "failed": 0, "router_cpu_ms_per_request": 0.3}]},
             "vllm-router-cache-aware": {
                 "latency": [{"e2e_p50_ms": 1.2, "e2e_p99_ms": 2.5, "rps": 0, "failed": 0}],
                 "throughput": [{"rps": 90.0, "e2e_p50_ms": 0, "e2e_p99_ms": 0, "failed": 0,
                                 "router_cpu_ms_per_request": 0.4}]},
             "sluice-httptools": {
                 "latency": [{"e2e_p50_ms": 1.6, "e2e_p99_ms": 3.1, "rps": 0, "failed": 0}],
                 "throughput": [{"rps": 75.0, "e2e_p50_ms": 0, "e2e_p99_ms": 0, "failed": 0,
                                 "router_cpu_ms_per_request": 0.75}]}}
    out = bench_router.summarize_overhead(paths)
    assert out["sluice"]["added_p50_ms"] == pytest.approx(0.5)
    assert out["sluice"]["added_p99_ms"] == pytest.approx(1.0)
    assert out["sluice"]["failed"] == 1
    assert out["sluice"]["ttft_p50_ms_at_max"] == 900.0
    assert out["direct"]["ttft_p50_ms_at_max"] is None  # (rows of an older run: none)
    assert out["sluice_vs_vllm_router_rps"] == pytest.approx(80 / 90)
    assert out["sluice_vs_vllm_router_cpu"] == pytest.approx(2.0)
    assert out["sluice_vs_vllm_router_cache_aware_cpu"] == pytest.approx(1.5)
    assert out["sluice_vs_sluice_httptools_cpu"] == pytest.approx(0.8)


@pytest.mark.slow
def test_router_bench_tiny(tmp_path):
    out = tmp_path / "router.json"
    proc = subprocess.run(
        [sys.executable, "bench/router.py", "--out", str(out), "--rounds", "1",
         "--overhead-requests", "10", "--throughput-concurrency", "4", "--replicas", "2",
         "--num-requests", "4", "--rate", "2", "--prefix-groups", "2", "--prefix-tokens", "64",
         "--input-len", "8", "--output-len", "2", "--kv-cache-gib", "0.05",
         "--policies", "round-robin", "slo", "--quality-rounds", "1",
         "--poll-endpoints", "3", "--poll-rounds", "2", "--scale-workers", "1", "3",
         "--scale-requests", "10", "--scale-concurrency", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout
    result = json.loads(out.read_text())
    summary = result["overhead"]["summary"]
    assert summary["direct"]["failed"] == 0 and summary["sluice"]["failed"] == 0
    assert summary["sluice"]["max_rps"] > 0 and "added_p50_ms" in summary["sluice"]
    assert summary["sluice-httptools"]["failed"] == 0 and summary["sluice-httptools"]["max_rps"] > 0
    vllm = result["overhead"]["vllm_router"]
    assert vllm["ran"] == ("vllm-router" in summary) and (vllm["ran"] or vllm["why"])
    assert vllm["ran"] == ("vllm-router-cache-aware" in summary)
    assert [row["endpoints"] for row in result["poll"]["rows"]] == [3]
    assert result["poll"]["rows"][0]["sluice_cpu_ms_per_round"] > 0
    assert [(row["workers"], row["failed"]) for row in result["scale"]["rows"]] == [(1, 0), (3, 0)]
    quality = result["quality"]
    assert quality["prefix_groups"] == 3  # 2 is not coprime with 2 replicas
    for policy in ("round-robin", "slo"):
        row = quality["policies"][policy]
        assert row["failed"] == 0 and row["ttft_p90_ms"] > 0
        assert row["prefix_hit_rate"] is not None
