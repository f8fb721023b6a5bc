"""Paged attention in plain PyTorch: K/V live in a block pool and are read via block tables.

Layout of one layer's cache (vLLM/nano-vllm style)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot s  = block_id * block_size + offset      (flat index into view(-1, H_kv, D))

    block_table of a sequence:  [b7, b2, b9]  → token t lives in block b[t // bs], offset t % bs

Each step first writes the new tokens' K/V to their slots (``slot_mapping``), then attends:
decode sequences (one query token) in one call; prefill chunks one sequence at a time,
causally, over their cached prefix plus the chunk. GQA is handled by SDPA's ``enable_gqa``.

Decode on CPU runs a C++ kernel (``csrc/paged_decode.cpp``, vLLM paged attention v1 with
FlashDecoding's online softmax) that reads the blocks in place; ``kernels`` builds it on
first use. Elsewhere (CUDA), when ``SLUICE_NATIVE_KERNELS=0``, or when the build fails
(logged once), decode is one batched SDPA over the gathered blocks with a length mask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.worker.engine import kernels

logger = logging.getLogger(__name__)

@dataclass
class AttentionMetadata:
    """Batch layout for one forward pass over T flattened tokens.

    Attributes:
        slot_mapping: [T] int64, cache slot of each new token.
        decode_token_idx: [B] int64, positions in the flat batch of the decode tokens.
        decode_block_tables: [B, max_blocks] int64, padded with 0 past each context.
        decode_context_lens: [B] int64, tokens each decode token attends over (itself included).
        decode_mask: [B, 1, 1, max_blocks * block_size] bool, True where a key is valid; None
            when the native kernel decodes (it reads ``decode_context_lens``).
        prefills: per prefill chunk (start in the flat batch, query length, context
            length incl. the chunk, block table [num_blocks] int64).
    """

    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[tuple[int, int, int, torch.Tensor]]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V in the cache and attend.

    Args:
        q: [T, H_q, D]; k, v: [T, H_kv, D] for the T new tokens.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], updated in place.
        meta: the batch layout.
        scale: softmax scale, usually D ** -0.5.

    Returns:
        [T, H_q, D] attention output.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    if not meta.prefills and meta.decode_token_idx is not None:
        return decode_attention(q, k_cache, v_cache, meta, scale)  # tokens = decodes, in order
    out = torch.empty_like(q)

    # SDPA gets 4-D [1, H, L, D] inputs: on CPU, 3-D ones fall back to the math kernel
    # (3-6x slower on long prefills, and it materialises the whole score matrix)
    for start, q_len, ctx_len, block_table in meta.prefills:
        qs = q[start:start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H_q, q_len, D]
        if ctx_len == q_len:  # no cached prefix: attend over the fresh K/V
            ks = k[start:start + q_len].transpose(0, 1).unsqueeze(0)
            vs = v[start:start + q_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ks = k_cache[block_table].view(-1, num_kv_heads, head_dim)[:ctx_len].transpose(0, 1).unsqueeze(0)
            vs = v_cache[block_table].view(-1, num_kv_heads, head_dim)[:ctx_len].transpose(0, 1).unsqueeze(0)
            # query i sits at position ctx_len - q_len + i and sees keys 0..that position
            rows = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1)

    if meta.decode_token_idx is not None:
        out[meta.decode_token_idx] = decode_attention(q[meta.decode_token_idx], k_cache, v_cache, meta, scale)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query token per sequence over its cached context: the native kernel when
    ``native_paged_decode`` has one for this device, else gather + SDPA.

    Args:
        q: [B, H_q, D], the decode tokens in the order of ``meta.decode_block_tables``.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], already holding these tokens.

    Returns:
        [B, H_q, D].
    """
    kernel = native_paged_decode(q.device)
    if kernel is not None:
        return kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    return sdpa_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, scale)


def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference (and CUDA) decode: gather every sequence's blocks, padded to the longest
    table, and run SDPA with a length mask. Shapes as ``decode_attention``; ``tables``
    [B, max_blocks], ``mask`` [B, 1, 1, max_blocks * block_size] bool."""
    batch, max_len = tables.shape[0], tables.shape[1] * k_cache.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    ks = k_cache[tables].view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2)
    vs = v_cache[tables].view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def native_paged_decode(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The compiled ``paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)``
    op for tensors on ``device``, or None: not a CPU device, ``SLUICE_NATIVE_KERNELS=0``, or
    the build failed."""
    return torch.ops.sluice.paged_decode if kernels.available(device) else None
