"""Llama-family decoder (Llama, SmolLM2, Qwen2) over a paged KV cache, in plain PyTorch.

One model file covers both families: Qwen2 is Llama with biases on the q/k/v projections.
RMSNorm, rotary embeddings with the checkpoint's scaling (computed by transformers' own
``ROPE_INIT_FUNCTIONS`` so every rope type matches HF), grouped-query attention, SwiGLU,
tied embeddings. q/k/v and gate/up are fused into one matmul each at load time.

In fp32 on CPU the small ops between the matmuls are fused C++ ops (``csrc/decode_ops.cpp``:
the residual add with RMSNorm, RoPE in place on q and k, SiLU-and-mul), as vLLM's layers
call its custom ops: a batch-1 decode step of SmolLM2 went from ~4,100 ATen calls to ~1,400.
Elsewhere (CUDA, bf16/fp16, ``SLUICE_NATIVE_KERNELS=0``) the same layers run PyTorch ops.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from sluice.worker.engine import kernels, quant
from sluice.worker.engine.attention import AttentionMetadata, paged_attention

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def _native(x: torch.Tensor) -> bool:
    """Whether the fused decode ops of ``csrc/decode_ops.cpp`` take ``x`` (fp32 on CPU,
    kernels built): they stand for several PyTorch ops each, with the same arithmetic."""
    return x.dtype == torch.float32 and kernels.available_for(x)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (Zhang & Sennrich 2019).

    ``forward(x)`` → y; ``forward(x, residual)`` → (norm(x + residual), x + residual), the
    residual add fused in (vLLM's ``fused_add_rms_norm``; both inputs may be overwritten).
    x, residual: [T, hidden].
    """

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            if _native(x):
                torch.ops.sluice.add_rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
            residual = x + residual
            return self.forward(residual), residual
        if x.dtype == torch.float32:  # ATen's fused op: the same values, fewer calls
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Linear):
    """``nn.Linear`` that is faster on CPU for the few-row inputs of decode steps.

    For x [M, in] fp32 on CPU with 2 ≤ M ≤ ``SKINNY_MAX_ROWS`` it computes (W · xᵀ)ᵀ
    instead of x · Wᵀ: MKL runs that GEMM with the weight [out, in] as the streamed left
    operand, 1.1-8x faster than ``F.linear`` here (e.g. 8960×1536, M = 5: 7.3 → 4.7 ms;
    49152×576, M = 2: 22.8 → 2.9 ms; bench/quant.py and bench/spec_decode.py show the
    effect end to end). A single row goes as two (a copy of itself) when the weight has
    at least ``PAD_MIN_WEIGHTS`` elements, because that GEMM also beats MKL's GEMV
    (8960×1536: 3.8 → 1.8 ms); smaller weights and larger M take ``F.linear``. Results
    equal ``F.linear``'s up to float rounding (another summation order).
    """

    SKINNY_MAX_ROWS = 64
    PAD_MIN_WEIGHTS = 4_000_000

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if (x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32
                or rows > self.SKINNY_MAX_ROWS
                or (rows == 1 and self.weight.numel() < self.PAD_MIN_WEIGHTS)):
            return F.linear(x, self.weight, self.bias)
        if rows == 1:
            y = torch.mm(self.weight, torch.cat([x, x]).t())[:, :1].t().contiguous()
        else:
            y = torch.mm(self.weight, x.t()).t().contiguous()
        return y if self.bias is None else y + self.bias


class RotaryEmbedding:
    """Rotary position embedding (Su et al. 2021), HF's rotate-half layout.

    cos/sin tables [max_positions, head_dim] are precomputed once, on the CPU even when the
    model is built on the meta device; ``to(device)`` moves them.
    """

    def __init__(self, config, head_dim: int, max_positions: int):
        inv_freq, scaling = _rope_inv_freq(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq.to("cpu"))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos() * scaling, emb.sin() * scaling

    def to(self, device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → (cos, sin), each [T, D] in ``dtype``: looked up once per forward
        pass and shared by every layer (``rotate_``)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate the first ``heads`` heads of x [T, C ≥ heads × head_dim] in place by (cos,
    sin) [T, head_dim] (``RotaryEmbedding``), rotate-half layout."""
    if _native(x):
        torch.ops.sluice.rotary_(x, cos, sin, heads, head_dim)
        return
    part = x[:, :heads * head_dim].view(-1, heads, head_dim)
    x1, x2 = part.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    part.copy_(part * cos + torch.cat((-x2, x1), dim=-1) * sin)


def _rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {
        **(getattr(config, "rope_scaling", None) or {}), "rope_theta": config.rope_theta}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params["rope_theta"]
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        return 1.0 / theta ** exponents, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 device=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias, device=device)
        self.o_proj = Linear(self.q_size, hidden, bias=False, device=device)
        self.scale = head_dim ** -0.5

    def forward(self, x, rope, k_cache, v_cache, meta):
        """x [T, hidden]; rope: ``RotaryEmbedding``'s (cos, sin) of the T positions."""
        qkv = self.qkv_proj(x)
        rotate_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)  # q, k side by side
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, device=None):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, device=device)
        self.down_proj = Linear(intermediate, hidden, bias=False, device=device)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if _native(gate_up):
            return self.down_proj(torch.ops.sluice.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, bias: bool, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.self_attn = Attention(config.hidden_size, config.num_attention_heads,
                                   config.num_key_value_heads, head_dim, bias, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, device)

    def forward(self, x, residual, rope, k_cache, v_cache, meta):
        """x [T, hidden]: the last layer's output (the embeddings for the first, with
        ``residual`` None); residual: the stream it adds to. Returns (output, residual)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, k_cache, v_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over flattened tokens of many sequences at once.

    Args:
        config: the HF config (``transformers.AutoConfig``) of a Llama or Qwen2 checkpoint.
        max_positions: largest position the rotary tables cover (the context length).
        device: where the parameters are created: "meta" builds the model without
            allocating or initializing them (then ``load_weights`` puts the loaded tensors
            in their place). Passed to each module rather than set with ``with
            torch.device(...)``, whose function mode imports ``torch._dynamo`` (1-2 s of a
            worker's boot).
    """

    def __init__(self, config, max_positions: int, device=None):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        # given its (uninitialized) weight: Embedding's own normal_ init imports torch._dynamo
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, device=device))
        self.layers = nn.ModuleList(DecoderLayer(config, self.head_dim, bias, device)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.decode_step_weights: list[torch.Tensor | None] | None = None  # fuse_decode_step

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] → final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions, x.dtype)
        if self.decode_step_weights is not None and not meta.prefills and _native(x):
            return torch.ops.sluice.decode_layers(
                x, *rope, self.decode_step_weights, [k for k, _ in kv_caches],
                [v for _, v in kv_caches], meta.slot_mapping, meta.decode_block_tables,
                meta.decode_context_lens, self.config.num_attention_heads, self.num_kv_heads,
                self.head_dim, self.norm.eps, self.layers[0].self_attn.scale)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, k_cache, v_cache, meta)
        return self.norm(x, residual)[0]

    def fuse_decode_step(self) -> bool:
        """Run decode steps through one C++ call (``csrc/decode_step.cpp``: the layers' same
        ops, so the same values, without the Python between them), where every layer linear
        runs a weight kernel (the 4-bit or packed int8 ones: ``quant.kernel_operands``) and
        the kernels are built. Returns whether it will."""
        weights = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [quant.kernel_operands(m) for m in
                       (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(operands is None for operands in linears):
                return False
            weights += [layer.input_layernorm.weight, *linears[0], *linears[1],
                        layer.post_attention_layernorm.weight, *linears[2], *linears[3]]
        if not kernels.available_for(self.norm.weight):
            return False
        self.decode_step_weights = [*weights, self.norm.weight]
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] in fp32."""
        return self.lm_head(hidden).float()

    def load_weights(self, model_dir: Path, device: torch.device) -> None:
        """Load HF-named safetensors shards, fusing q/k/v and gate/up.

        Each parameter (on the meta device until now, giving the shape and dtype) is replaced
        by the loaded tensor, cast to that dtype and moved to ``device``: a tensor already
        there in that dtype is kept as loaded, without allocating the model first and copying
        every weight (``to_empty`` + ``copy_`` took a third of a small model's boot).

        Raises:
            ValueError: a shard is unreadable, or a weight is missing or mis-shaped (the
                message names the file or tensor and the fix).
        """
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            try:
                weights.update(load_file(shard))
            except Exception as exc:  # safetensors raises its own error types for bad files
                raise ValueError(f"{shard} is unreadable ({exc}); delete {model_dir} and fetch "
                                 f"the model again (sluice models fetch NAME)") from exc
        params = dict(self.named_parameters())
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias"):
                names = [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
                if all(n in weights for n in names):
                    weights[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([weights.pop(n) for n in names])
            names = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
            if all(n in weights for n in names):
                weights[f"{p}mlp.gate_up_proj.weight"] = torch.cat([weights.pop(n) for n in names])
        for name, param in params.items():
            key = name if name == "lm_head.weight" else f"model.{name}"
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            tensor = weights.get(key)
            if tensor is None:
                raise ValueError(f"weight {key} is missing from {model_dir}")
            if tensor.shape != param.shape:
                raise ValueError(f"weight {key} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            module, _, attr = name.rpartition(".")
            setattr(self.get_submodule(module), attr, nn.Parameter(
                tensor.to(device=device, dtype=param.dtype), requires_grad=False))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
