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
    result = run_bench("engine.py", "--engines", "native", "hf", "--concurrency", "1", "2",
                       "--max-tokens", "4", "--requests-per-level", "1", "--hf-requests", "1",
                       out=tmp_path / "engine.json")
    for level in ("1", "2"):
        native = result["native"][level]
        assert native["failed"] == 0 and native["tok_s"] > 0 and native["peak_rss_mib"] > 100
        assert native["itl_ms"]["count"] == 3 * max(int(level), 4)  # 4 tokens → 3 gaps per request
    assert result["hf"]["2"]["requests_served"] == 1
    assert "native / hf tok/s at C=2" in result["ratios"]
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
    assert set(result["decode"]) >= {"fp32", "int8"}
    assert result["decode"]["int8"]["weight_bytes_per_token"] < result["decode"]["fp32"]["weight_bytes_per_token"] / 3


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
