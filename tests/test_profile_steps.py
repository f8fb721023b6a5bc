"""`sluice profile --steps`: the step-time fit, a tiny real grid, and the committed profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice import cli
from sluice.bench import steps
from sluice.bench.steps import Fit, Point, Shape

PROFILES = Path(__file__).resolve().parents[1] / "sluice" / "sim" / "profiles"
KEYS = {"model", "threads", "points", "fit", "kv_capacity_tokens", "block_size", "r2", "machine"}
SHAPES = [(16, 0, 16), (512, 0, 512), (2048, 0, 2048), (109, 0, 621), (0, 1, 64),
          (0, 16, 8192), (0, 64, 2048), (512, 16, 4608)]


def _points(model: Fit) -> list[Point]:
    return [Point(p, d, kv, model.predict(p, d, kv)) for p, d, kv in SHAPES]


def test_the_fit_recovers_known_coefficients():
    truth = Fit(c0_ms=41.5, prefill_token_ms=3.25, decode_seq_ms=7.75, kv_token_ms=0.0125)
    got = steps.fit(_points(truth))
    for name, value in vars(truth).items():
        assert getattr(got, name) == pytest.approx(value, rel=1e-6), name
    assert steps.r2(_points(truth), got) == pytest.approx(1.0)
    assert max(map(abs, steps.relative_errors(_points(truth), got))) < 1e-9


def test_the_fit_never_goes_negative():
    """A slope the data would make negative is held at 0 (the simulator refuses < 0)."""
    points = _points(Fit(50.0, 4.0, 10.0, -0.002))
    got = steps.fit(points)
    assert got.kv_token_ms == 0.0 and min(vars(got).values()) >= 0.0 and got.c0_ms > 0
    assert steps.r2(points, got) > 0.99


def test_the_fit_refuses_shapes_that_do_not_determine_it():
    prefill_only = [Point(n, 0, n, 10.0 + n) for n in (16, 64, 128, 512)]
    with pytest.raises(ValueError, match="do not determine"):
        steps.fit(prefill_only)


def test_the_default_grid_fits_the_pool_and_the_budget():
    grid = steps.default_grid(chunk=128, break_even=3072.0, kv_capacity=11648)
    assert all(s.kv_tokens() <= 0.8 * 11648 for s in grid)
    assert all(s.prefill_seqs * s.prefill_len <= 2048 and s.decode_seqs <= 64 for s in grid)
    assert {s.prefill_seqs * s.prefill_len for s in grid if not s.decode_seqs} >= {16, 2048}
    assert {s.decode_seqs for s in grid if not s.prefill_seqs} == {1, 4, 16, 32, 64}
    assert any(s.prefill_seqs and s.decode_seqs for s in grid)  # mixed steps
    assert Shape(1, 76, 2048) in grid  # a chunk shrunk by its context, as the scheduler does


def test_profile_needs_a_server_without_steps(capsys):
    assert cli.main(["profile", "--model", "m"]) == 2
    assert "--url, --slo-ttft-ms and --slo-itl-ms are required (or --steps)" in \
        capsys.readouterr().err


def test_a_tiny_real_grid_writes_the_profile(model_path, tmp_path):
    import torch

    threads = torch.get_num_threads()
    out = tmp_path / "profile.json"
    assert cli.main(["profile", "--steps", "--tiny", "--repeats", "1", "--model",
                     str(model_path), "--output", str(out)]) == 0
    assert torch.get_num_threads() == threads  # restored for the rest of the session
    data = json.loads(out.read_text())
    assert set(data) == KEYS and data["threads"] == 1
    assert data["model"] == model_path.name and data["block_size"] == 16
    assert data["kv_capacity_tokens"] > 8192  # the default 0.5 GiB pool holds a context
    assert set(data["fit"]) == {"c0_ms", "prefill_token_ms", "decode_seq_ms", "kv_token_ms"}
    assert [(p["prefill_tokens"], p["decode_seqs"]) for p in data["points"]] == \
        [(16, 0), (32, 0), (0, 1), (0, 2)]
    for p in data["points"]:
        assert set(p) == {"prefill_tokens", "decode_seqs", "kv_tokens", "step_ms"}
        assert p["step_ms"] > 0 and p["kv_tokens"] >= p["prefill_tokens"] + p["decode_seqs"]


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct"])
def test_the_committed_profiles_load_and_fit(name):
    points, model, data = steps.load(PROFILES / f"{name}.json")
    assert set(data) == KEYS and data["model"] == name and data["threads"] == 1
    assert len(points) >= 20 and all(p.step_ms > 0 for p in points)
    assert model.c0_ms > 0 and min(vars(model).values()) >= 0
    assert vars(steps.fit(points)) == pytest.approx(vars(model))  # the points' own fit
    assert data["r2"] == pytest.approx(steps.r2(points, model)) and data["r2"] >= 0.9
