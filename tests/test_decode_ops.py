"""The fused fp32 decode ops (csrc/decode_ops.cpp) against the PyTorch ops they replace, and
the whole model with them against the model without them (its plain PyTorch path, what
CUDA, other dtypes and SLUICE_NATIVE_KERNELS=0 run).

Tolerance: 1e-6 absolute and relative on values of magnitude ~1-10: the elementwise ops do
the same arithmetic (a compiler may fuse a multiply-add, one rounding instead of two); the
RMS sums its squares in another order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.worker.engine import EngineConfig, kernels
from sluice.worker.engine.llm_engine import LLMEngine
from sluice.worker.engine.models import llama
from sluice.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.available(torch.device("cpu")),
                                reason="the native kernels did not build here (see the warning)")
TOL = {"rtol": 1e-6, "atol": 1e-6}


def test_add_rms_norm_adds_the_residual_and_normalizes_in_place():
    torch.manual_seed(0)
    wide = torch.randn(5, 1000)
    x, residual = wide[:, :576], torch.randn(5, 576) * 3  # x's rows strided, as a slice's
    weight, eps = torch.rand(576) + 0.5, 1e-5
    want_residual = x + residual
    want = F.rms_norm(want_residual, (576,), weight, eps)
    torch.ops.sluice.add_rms_norm_(x, residual, weight, eps)
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(x, want, **TOL)
    with pytest.raises(RuntimeError, match="x and residual must be"):
        torch.ops.sluice.add_rms_norm_(x, residual[:, :10], weight, eps)


def test_silu_and_mul_is_swiglus_gate():
    torch.manual_seed(0)
    x = torch.randn(3, 2 * 1536) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.sluice.silu_and_mul(x), F.silu(gate) * up, **TOL)
    assert torch.ops.sluice.silu_and_mul(x[:0]).shape == (0, 1536)
    with pytest.raises(RuntimeError, match="even number of columns"):
        torch.ops.sluice.silu_and_mul(x[:, :5])


def test_silu_and_mul_at_the_extremes_and_past_the_vector_width():
    """17 values: one AVX-512 vector and a tail; exp16 saturates both ways, NaN stays NaN."""
    gate = torch.tensor([-1e4, -100.0, -88.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.5, 100.0, 1e4,
                         float("inf"), float("-inf"), float("nan"), 3.0, -3.0, 0.5])
    up = torch.linspace(-2.0, 2.0, 17)
    got = torch.ops.sluice.silu_and_mul(torch.cat([gate, up])[None])[0]
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=0.0, equal_nan=True)


def test_rotary_rotates_q_and_k_heads_in_place_and_leaves_v():
    torch.manual_seed(0)
    heads, kv, d = 9, 3, 64
    qkv = torch.randn(4, (heads + 2 * kv) * d)
    cos, sin = torch.randn(4, d), torch.randn(4, d)
    part = qkv[:, :(heads + kv) * d].view(4, heads + kv, d)
    x1, x2 = part.chunk(2, dim=-1)
    want = part * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]  # HF's formula
    v = qkv[:, (heads + kv) * d:].clone()
    torch.ops.sluice.rotary_(qkv, cos, sin, heads + kv, d)
    torch.testing.assert_close(part, want, **TOL)
    assert torch.equal(qkv[:, (heads + kv) * d:], v)
    with pytest.raises(RuntimeError, match="must fit"):
        torch.ops.sluice.rotary_(qkv, cos, sin, 100, d)


def greedy_with_logprobs(engine: LLMEngine, prompts: list[str]) -> list[list[tuple[int, float]]]:
    """Each prompt's 16 greedy tokens with their logprobs, all prompts in one batch."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), engine.tokenizer.encode(prompt),
                           SamplingParams(max_tokens=16, temperature=0.0, logprobs=0))
    got: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += [(lp.token_id, lp.logprob) for lp in out.new_logprobs]
    return [got[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("width", [1, 15, 16, 17, 33, 49152, 49155])
def test_argmax_rows_is_torch_argmax_with_its_ties_and_nans(width):
    """First index of the maximum in each row, as torch.argmax: ties (rounded values), a
    NaN (it wins, the first one), a row of -inf (index 0), +inf, strided rows."""
    torch.manual_seed(width)
    x = (torch.randn(6, width + 5) * 3).round()[:, 2:2 + width]  # strided rows, many ties
    x[1, width // 2] = float("nan")
    x[1, width - 1] = float("nan")
    x[2] = float("-inf")
    x[3, width - 1] = float("inf")
    x[4, 0] = float("nan")
    want = x.argmax(dim=-1).tolist()
    assert want[1] == width // 2 and want[2] == 0 and want[4] == 0
    assert torch.ops.sluice.argmax_rows(x).tolist() == want
    assert torch.ops.sluice.argmax_rows(x[:0]).tolist() == []
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.sluice.argmax_rows(x.double())


def test_the_model_with_fused_ops_equals_its_plain_pytorch_path(model_path, monkeypatch):
    """Batched prefill and decode through every fused op (residual stream, RoPE, SwiGLU,
    the pure-decode attention path) and through the PyTorch ops they replace."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    engine = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1))
    fused = greedy_with_logprobs(engine, prompts)
    monkeypatch.setattr(llama, "_native", lambda x: False)
    plain = greedy_with_logprobs(engine, prompts)
    for a, b in zip(fused, plain):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-4
