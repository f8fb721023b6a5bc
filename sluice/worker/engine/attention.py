"""Paged attention in plain PyTorch: K/V live in a block pool and are read via block tables.

Layout of one layer's cache (vLLM/nano-vllm style)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot s  = block_id * block_size + offset      (flat index into view(-1, H_kv, D))

    block_table of a sequence:  [b7, b2, b9]  → token t lives in block b[t // bs], offset t % bs

Each step first writes the new tokens' K/V to their slots (``slot_mapping``), then attends:
decode sequences (one query token) in one batched SDPA over their gathered blocks with a
length mask; prefill chunks one sequence at a time, causally, over their cached prefix plus
the chunk. GQA is handled by SDPA's ``enable_gqa``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Batch layout for one forward pass over T flattened tokens.

    Attributes:
        slot_mapping: [T] int64, cache slot of each new token.
        decode_token_idx: [B] int64, positions in the flat batch of the decode tokens.
        decode_block_tables: [B, max_blocks] int64, padded with 0 (masked by length).
        decode_mask: [B, 1, 1, max_blocks * block_size] bool, True where a key is valid.
        prefills: per prefill chunk (start in the flat batch, query length, context
            length incl. the chunk, block table [num_blocks] int64).
    """

    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
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
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]

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
        tables = meta.decode_block_tables
        batch = tables.shape[0]
        max_len = tables.shape[1] * block_size
        ks = k_cache[tables].view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2)
        vs = v_cache[tables].view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2)
        qs = q[meta.decode_token_idx].unsqueeze(2)  # [B, H_q, 1, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=True)
        out[meta.decode_token_idx] = o.squeeze(2)
    return out
