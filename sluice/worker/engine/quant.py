"""INT8 and 4-bit weight-only post-training quantization: an offline conversion plus a
module swap.

``quantize_int8(model)`` replaces every ``nn.Linear`` of the decoder layers (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``) and, by default, the ``lm_head`` with an
``Int8Linear`` holding per-output-channel symmetric int8 weights. The model file is not
touched (gpt-fast's ``WeightOnlyInt8QuantHandler`` does the same: convert, then swap).
Activations stay floating point; only the weights are stored in 8 bits, so batch-1 decode,
which streams every weight once per token, moves ~4x fewer bytes.

Quantization, per output row n of a weight W [N, K]::

    scale[n] = max_k |W[n, k]| / 127          (rounded up to the next bfloat16 value)
    Q[n, k]  = round(W[n, k] / scale[n])      in [-127, 127], int8
    y        = x @ (Q * scale[:, None]).T + b  = (x @ Q.T) * scale + b

Symmetric (no zero point), round-to-nearest, no calibration data. The rounding error of a
weight is at most scale[n] / 2, about 1/254 of its row's largest magnitude. LLM.int8()
(Dettmers et al. 2022) traced what breaks 8-bit inference to outlier features in the
*activations*, which is why they are not rounded to 8 bits here (the native kernel keeps
two int8 digits a value, ~16 bits, see Kernels). Measured on SmolLM2-135M
(bench/quant.py): perplexity 22.25 fp32 → 22.36 int8 weight-only, while W8A8 with per-tensor
dynamic activation quantization (fbgemm's dynamic Linear) gives 60.

Kernels:

- fp32 activations on CPU, any row count: Sluice's ``torch.ops.sluice.int8_linear(x [M, K]
  fp32, q packed [N / 4, K / 16, 4, 16] int8, scales [N] fp32) -> [M, N]``
  (``csrc/int8_linear.cpp``, built by ``kernels``): each row of x rounded to two int8
  digits (~16 bits), then exact integer dot products (AVX-512 VNNI) scaled back;
  perplexity 22.362 against 22.363 with x kept in fp32 (bench/quant.py). Below 48 rows
  (decode steps) over weights packed in 4-row tiles (``pack_tiles``) that it reads as one
  stream; from 48 rows (prefill chunks, large batches) as one int8 GEMM (oneDNN), 1.3-2.3x
  faster than the fp32 matmul. Both give a row the same bits in any batch.
- Without the native kernels (``SLUICE_NATIVE_KERNELS=0``, a failed build), or for bfloat16
  activations (measured on this AVX-512 CPU without AMX, torch 2.13, 1 thread):
  ``torch.ops.aten._weight_int8pack_mm(x [M, K], q [N, K] int8, scales [N]) -> [M, N]``
  needs a 2-D ``x`` contiguous in its last dim, a contiguous ``q``, and 1-D ``scales`` of
  the activation dtype. On x86 it is vectorized only for bfloat16 activations; with fp32
  activations it runs a scalar loop, 2.5x *slower* than the fp32 matmul it replaces. So
  for few rows (decode) fp32 activations are cast to bfloat16 for the kernel and the
  bfloat16 result back to fp32; the scales are rounded to bfloat16 at conversion, so the
  kernel and the fallback see the same quantized weights.
- Fallback, for many rows (prefill) or other devices/dtypes: ``(x @ Q.T) * scale``, i.e.
  the int8 weight is converted to the activation dtype inside the call and the matmul runs
  in fp32 (exact int8 → fp32); fp16 scales the weight first (``x @ (Q * scale).T``) since
  ``x @ Q.T`` can overflow it. Its conversion cost is fixed per call, so it wins once the
  matmul is large: aten's kernel and it cross near 32 rows (``ATEN_KERNEL_MAX_ROWS``).

The tied embedding (SmolLM2, Qwen2.5) shares one int8 table and one set of scales with the
lm_head: the lookup dequantizes just the rows it gathers (``Int8Embedding``).

4-bit (``quantize_int4``): the decoder layers' linears in llama.cpp's Q4_1 format, each row
in blocks of 32 weights with a float16 scale d and minimum m, ``W = d * q + m`` for q in
[0, 15] (``quantize_weight_int4``: m = the block's minimum, d = its range / 15); the lm_head
and tied embedding stay int8 (the GGUF files the model store reads hold them in 8 bits,
Q8_0, and the layers in Q4_1). Weights dequantized from a Q4_1 file come back to the file's
own blocks: a block's minimum is its m and its maximum m + 15 d, since Q4_1 quantizes them
to 0 and 15. ``Int4Linear`` runs ``torch.ops.sluice.int4_linear`` (``csrc/int4_linear.cpp``)
for fp32 rows, over the blocks packed in 4-row tiles (``pack_int4``): it rounds x to two
int8 digits per block of 32 (~16 bits; one, llama.cpp's Q8_1, cost 0.9 % perplexity) and
multiplies in integers (AVX-512 VNNI): SmolLM2's perplexity 22.29 against fp32's 22.25
(bench/quant.py). Without the native kernels it dequantizes the weight for each call and
runs the fp32 matmul (correct, but slower than fp32).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from sluice.worker.engine import kernels

logger = logging.getLogger(__name__)

QMAX = 127
# Rows (tokens) below which aten's int8 kernel beats dequantize-then-fp32-matmul on this CPU.
# Sluice's kernels (int8 and 4-bit) beat it at every row count.
ATEN_KERNEL_MAX_ROWS = 32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# aten::_weight_int8pack_mm reads past the weight's rows (a segfault, torch 2.13) unless
# in_features is a multiple of this; every Llama/Qwen projection is.
ATEN_K_MULTIPLE = 16


def _has_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantization.

    Args:
        weight: [N, K] float tensor.

    Returns:
        (q, scales): q [N, K] int8 in [-127, 127]; scales [N] fp32, each exactly a
        bfloat16 value, such that ``q * scales[:, None]`` approximates ``weight`` with an
        absolute error of at most ``scales[:, None] / 2``.
    """
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / QMAX).clamp_min(torch.finfo(torch.bfloat16).tiny)
    rounded = scales.to(torch.bfloat16)
    up = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    scales = torch.where(rounded.float() < scales, up, rounded).float()  # round up: |q| <= 127
    q = torch.round(w / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales


TILE_ROWS, TILE_COLUMNS = 4, 16  # csrc/int8_linear.cpp's tile: 4 rows x 16-column chunks
INT4_BLOCK = 32  # weights per (scale, minimum) block: llama.cpp's Q4_1
INT4_BLOCK_BYTES = TILE_ROWS * INT4_BLOCK // 2 + TILE_ROWS * 4  # csrc/int4_linear.cpp: 80


def pack_tiles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] → [N / 4, K / 16, 4, 16] (contiguous): the native kernel's layout, in which
    each tile of 4 weight rows is one sequential run (see csrc/int8_linear.cpp).

    Raises ValueError when N is not a multiple of 4 or K of 16."""
    n, k = q.shape
    if n % TILE_ROWS or k % TILE_COLUMNS:
        raise ValueError(f"[{n}, {k}] does not split into tiles of {TILE_ROWS} x {TILE_COLUMNS}")
    return q.view(n // TILE_ROWS, TILE_ROWS, k // TILE_COLUMNS, TILE_COLUMNS) \
        .permute(0, 2, 1, 3).contiguous()


def unpack_tiles(packed: torch.Tensor) -> torch.Tensor:
    """``pack_tiles``'s inverse: [N / 4, K / 16, 4, 16] → [N, K] (a copy)."""
    tiles, chunks = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, chunks * TILE_COLUMNS)


def quantize_weight_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization in blocks of 32 weights along each row (Q4_1).

    Args:
        weight: [N, K] float tensor, K a multiple of 32.

    Returns:
        (q, d, m): q [N, K] uint8 in [0, 15]; d, m [N, K / 32] float16, such that
        ``d * q + m`` (per block, in fp32) approximates ``weight`` within ``d / 2`` plus
        float16's rounding of d and m; weights that are a Q4_1 file's dequantized values
        come back exactly.

    Raises:
        ValueError: K is not a multiple of 32.
    """
    n, k = weight.shape
    if k % INT4_BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {INT4_BLOCK}")
    w = weight.detach().float().reshape(n, k // INT4_BLOCK, INT4_BLOCK)
    low, high = w.amin(dim=2), w.amax(dim=2)
    d, m = ((high - low) / 15).half(), low.half()
    scale = d.float().unsqueeze(2)
    q = torch.where(scale > 0, torch.round((w - m.float().unsqueeze(2)) / scale.clamp_min(1e-30)),
                    torch.zeros_like(w))
    return q.clamp_(0, 15).to(torch.uint8).reshape(n, k), d, m


def dequantize_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``quantize_weight_int4``'s weights back in fp32: [N, K]."""
    n, k = q.shape
    blocks = q.float().reshape(n, k // INT4_BLOCK, INT4_BLOCK)
    return torch.addcmul(m.float().unsqueeze(2), blocks, d.float().unsqueeze(2)).reshape(n, k)


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(q [N, K], d, m [N, K / 32]) → [N / 4, K / 32, 80] uint8, csrc/int4_linear.cpp's
    layout: per tile of 4 rows and block of 32 columns, each row's 32 nibbles in 16 bytes
    (byte j: q[j] low, q[j + 16] high, as GGML stores Q4_1), then each row's (d, m).

    Raises ValueError when N is not a multiple of 4 or K of 32."""
    n, k = q.shape
    if n % TILE_ROWS or k % INT4_BLOCK:
        raise ValueError(f"[{n}, {k}] does not split into tiles of {TILE_ROWS} x {INT4_BLOCK}")
    blocks = q.reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    nibbles = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # [N, K / 32, 16]
    dm = torch.stack([d, m], dim=2).view(torch.uint8)  # [N, K / 32, 4]: d then m, as bytes
    rows = torch.cat([nibbles, dm], dim=2)  # [N, K / 32, 20]
    tiles = rows.reshape(n // TILE_ROWS, TILE_ROWS, k // INT4_BLOCK, 20).permute(0, 2, 1, 3)
    return torch.cat([tiles[..., :16].reshape(n // TILE_ROWS, k // INT4_BLOCK, -1),
                      tiles[..., 16:].reshape(n // TILE_ROWS, k // INT4_BLOCK, -1)],
                     dim=2).contiguous()


def unpack_int4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_int4``'s inverse: (q [N, K] uint8, d, m [N, K / 32] float16)."""
    tiles, blocks = packed.shape[:2]
    n, k = tiles * TILE_ROWS, blocks * INT4_BLOCK
    nibbles = packed[..., :TILE_ROWS * 16].reshape(tiles, blocks, TILE_ROWS, 16)
    dm = packed[..., TILE_ROWS * 16:].reshape(tiles, blocks, TILE_ROWS, 4)
    nibbles = nibbles.permute(0, 2, 1, 3).reshape(n, blocks, 16)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2).reshape(n, k)
    dm = dm.permute(0, 2, 1, 3).reshape(n, blocks, 4).contiguous().view(torch.float16)
    return q, dm[..., 0].contiguous(), dm[..., 1].contiguous()


class Int4Linear(nn.Module):
    """``nn.Linear`` replacement with 4-bit weights in Q4_1 blocks (``quantize_weight_int4``),
    packed for ``csrc/int4_linear.cpp`` (``pack_int4``).

    Args:
        packed: [out_features / 4, in_features / 32, 80] uint8.
        out_features: N.
        bias: [out_features] or None.

    ``forward``: x [..., in_features] → [..., out_features] in x's dtype: the native kernel
    for fp32 rows on CPU at any row count (4-row tiles below 8 rows, 16-row groups from 8,
    the same result to the bit), else the dequantized weight's matmul. At 128 and 512 rows
    the kernel takes 0.9-1.2x the time of fp32's matmul and 1.6-2.9x int8's GEMM (its
    per-block fp32 steps); at batch 1 it is the fastest of the three.
    """

    def __init__(self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = out_features, packed.shape[1] * INT4_BLOCK
        self.register_buffer("weight", packed)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4Linear:
        packed = pack_int4(*quantize_weight_int4(linear.weight))
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, linear.out_features, bias)

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        """Whether ``linear``'s shape splits into the kernel's tiles and blocks."""
        return linear.out_features % TILE_ROWS == 0 and linear.in_features % INT4_BLOCK == 0

    def dequantized(self) -> torch.Tensor:
        """The weights [out_features, in_features] in fp32."""
        return dequantize_int4(*unpack_int4(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            y = self.forward(x.reshape(-1, self.in_features))
            return y.reshape(*x.shape[:-1], self.out_features)
        if x.dtype == torch.float32 and kernels.available_for(x):
            y = torch.ops.sluice.int4_linear(x.contiguous(), self.weight, self.out_features)
        else:
            y = F.linear(x, self.dequantized().to(x.dtype))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, weight=4-bit in blocks of {INT4_BLOCK} (Q4_1)"


class Int8Linear(nn.Module):
    """``nn.Linear`` replacement with int8 weights and per-output-channel fp32 scales.

    Args:
        weight: [out_features, in_features] int8.
        scales: [out_features] fp32 (bfloat16-representable; see ``quantize_weight``).
        bias: [out_features] or None, kept in its original dtype.

    The ``weight`` buffer holds the int8 weights row-major [out, in], or, where the native
    kernels run (``kernels.available``) and the shape splits into tiles, packed for them
    (``pack_tiles``; ``packed`` says which; ``rows()`` gives [out, in] either way).

    ``forward``: x [..., in_features] → [..., out_features] in x's dtype.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = (kernels.available(weight.device) and self.out_features % TILE_ROWS == 0
                       and self.in_features % TILE_COLUMNS == 0)
        self.register_buffer("weight", pack_tiles(weight) if self.packed else weight)
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))  # kernel wants act dtype
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        q, scales = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scales, bias)

    def rows(self) -> torch.Tensor:
        """The int8 weights [out_features, in_features], row-major."""
        return unpack_tiles(self.weight) if self.packed else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            y = self.forward(x.reshape(-1, self.in_features))
            return y.reshape(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        if self.packed and x.dtype == torch.float32 and kernels.available_for(x):
            y = torch.ops.sluice.int8_linear(x.contiguous(), self.weight, self.scales)
        elif (x.is_cpu and rows < ATEN_KERNEL_MAX_ROWS and x.dtype in _KERNEL_DTYPES
              and self.in_features % ATEN_K_MULTIPLE == 0 and _has_kernel()):
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.rows(),
                                                   self.scales_bf16).to(x.dtype)
        elif x.dtype == torch.float16:  # x @ Q.T can pass fp16's 65504: scale the weight first
            y = F.linear(x, self.rows().to(x.dtype) * self.scales.to(x.dtype)[:, None])
        else:
            y = F.linear(x, self.rows().to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, weight=int8 per-channel" \
               f"{', packed in tiles' if self.packed else ''}"


class Int8Embedding(nn.Module):
    """Embedding lookup over an int8 table with per-row scales (shared with a tied lm_head).

    Args:
        weight: [vocab, hidden] int8, or packed in tiles (``pack_tiles``) when ``packed``.
        scales: [vocab] fp32.
        dtype: dtype of the returned rows (the model's activation dtype).
        packed: whether ``weight`` is packed (the tied lm_head's table, shared as it is).

    ``forward``: ids [...] → [..., hidden] in ``dtype``; dequantizes only the gathered rows.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 packed: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.dtype, self.packed = dtype, packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed:  # row n is chunk column n % 4 of tile n // 4
            rows = self.weight[ids // TILE_ROWS, :, ids % TILE_ROWS].reshape(*ids.shape, -1)
        else:
            rows = self.weight[ids]
        return rows.to(self.dtype) * self.scales[ids].unsqueeze(-1).to(self.dtype)


def kernel_operands(module: nn.Module) -> tuple | None:
    """(weight, scales or None, bias or None) of a linear the native weight kernels run
    (``Int4Linear``, packed ``Int8Linear``), as ``csrc/decode_step.cpp`` takes them; None
    for any other module."""
    if isinstance(module, Int4Linear):
        return module.weight, None, module.bias
    if isinstance(module, Int8Linear) and module.packed:
        return module.weight, module.scales, module.bias
    return None


@torch.no_grad()
def quantize_int8(model: nn.Module, lm_head: bool = True, layers: bool = True) -> nn.Module:
    """Swap the model's linears for ``Int8Linear`` in place (call after loading weights).

    Args:
        model: a loaded ``LlamaForCausalLM`` (``layers`` of decoder layers, ``lm_head``,
            ``embed_tokens``).
        lm_head: also quantize the lm_head; with tied embeddings the embedding then reads
            the same int8 table (its fp32 copy is dropped). On SmolLM2-135M the tied table
            is 113 MB of the 538 MB fp32 weights: left in fp32 it is half of the bytes a
            decode step reads (220 MB vs 135 MB). Measured (bench/quant.py, 1 thread):
            batch-1 ITL 39 → 31 ms for perplexity 22.32 → 22.36 (fp32: 22.25), so it is on.
        layers: quantize the decoder layers' linears (``quantize_int4`` quantizes them
            itself, then only the lm_head here).

    Returns:
        the same model, for chaining.
    """
    before = _weight_bytes(model)
    count = 0
    for layer in model.layers if layers else ():
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear.from_linear(child))
                    count += 1
    if lm_head:
        tied = model.lm_head.weight is model.embed_tokens.weight
        dtype = model.embed_tokens.weight.dtype
        model.lm_head = Int8Linear.from_linear(model.lm_head)
        count += 1
        if tied:
            model.embed_tokens = Int8Embedding(model.lm_head.weight, model.lm_head.scales, dtype,
                                               model.lm_head.packed)
    if layers:  # (else quantize_int4 logs the whole conversion in one line)
        logger.info("int8 weight-only: %d linears%s quantized, weights %.1f MiB -> %.1f MiB",
                    count, " (lm_head included)" if lm_head else "", before / 2**20,
                    _weight_bytes(model) / 2**20)
    return model


@torch.no_grad()
def quantize_int4(model: nn.Module) -> nn.Module:
    """Swap the decoder layers' linears for ``Int4Linear`` (those whose shape splits into
    its tiles; any other stays fp32) and the lm_head, with a tied embedding, for int8
    (``quantize_int8``'s): in place, after loading weights.

    Returns:
        the same model, for chaining.
    """
    before = _weight_bytes(model)
    count = 0
    for layer in model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and Int4Linear.fits(child):
                    setattr(parent, name, Int4Linear.from_linear(child))
                    count += 1
    if not kernels.available(next(model.parameters()).device):
        logger.warning("4-bit weights without the native kernels: every matmul dequantizes its "
                       "weight first (slower than fp32)")
    quantize_int8(model, lm_head=True, layers=False)
    logger.info("4-bit weight-only: %d linears quantized (lm_head int8), weights %.1f MiB -> "
                "%.1f MiB", count, before / 2**20, _weight_bytes(model) / 2**20)
    return model


def _weight_bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied: count once
    return sum(t.numel() * t.element_size() for t in tensors.values())
