"""Builds batch tensors from scheduled sequences, owns the KV cache, runs the model."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sluice.worker.engine.attention import AttentionMetadata, native_paged_decode
from sluice.worker.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Loads the model and runs one forward pass per engine step.

    Args:
        hf_config: the checkpoint's transformers config.
        model_dir: folder with the safetensors weights.
        max_model_len: context length (sizes the rotary tables).
        block_size: tokens per KV block.
        dtype: "float32", "bfloat16" or "float16".
        device: "cpu" or "cuda".
        quantization: None, "int8" or "int4" (weight-only, applied after loading; see
            quant.py).

    ``attention_break_even`` is the context length (tokens) at which a prefill token's
    attention costs as many FLOPs as its linear layers (3,072 for SmolLM2-135M); the
    scheduler sizes prefill chunks with it.

    The KV block pool is created separately (``allocate_kv_cache``), once the engine has
    split its memory budget between this model and a speculative draft model.

    Raises:
        ValueError: a weight is missing or mis-shaped.
    """

    def __init__(self, hf_config, model_dir: Path, max_model_len: int, block_size: int,
                 dtype: str, device: str, quantization: str | None = None):
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.block_size = block_size
        # compiled here on first use, before the worker reports ready; without it decode
        # attention needs the padded length mask
        self.decode_needs_mask = native_paged_decode(self.device) is None
        torch.set_default_dtype(self.dtype)
        try:
            model = LlamaForCausalLM(hf_config, max_model_len, device="meta")
        finally:
            torch.set_default_dtype(torch.float32)
        model.rotary.to(self.device)
        model.load_weights(model_dir, self.device)
        if quantization is not None:
            from sluice.worker.engine.quant import quantize_int4, quantize_int8

            {"int8": quantize_int8, "int4": quantize_int4}[quantization](model)
            if model.fuse_decode_step():
                logger.info("decode steps run the layers in one native call (decode_layers)")
        self.model = model.eval()

        # per layer: a prefill token's linear layers cost 2 FLOPs per weight, its attention
        # 4·H·D FLOPs per context token (QK^T and PV); this context length makes them equal
        h, heads, d = hf_config.hidden_size, hf_config.num_attention_heads, model.head_dim
        linear_weights = 2 * h * heads * d + 2 * h * model.num_kv_heads * d + 3 * h * hf_config.intermediate_size
        self.attention_break_even = linear_weights / (2 * heads * d)

        elem = torch.finfo(self.dtype).bits // 8
        self.num_layers = hf_config.num_hidden_layers
        self.bytes_per_block = 2 * self.num_layers * block_size * model.num_kv_heads * model.head_dim * elem
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Create the block pool: per layer, K and V of [num_blocks, block_size, H_kv, D]
        (``bytes_per_block`` bytes per block over all layers)."""
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.num_blocks = num_blocks
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.num_layers)]

    @torch.inference_mode()
    def execute(self, batch: list[tuple[list[int], int, list[int]]], logit_rows: list[int]) -> torch.Tensor:
        """Run the model over a batch of token runs, writing their K/V into the pool.

        Args:
            batch: per sequence (token ids, position of the first one, block table); the
                table must already cover every position written. A run of one token takes
                the batched decode path, longer runs the prefill path.
            logit_rows: indices into the flat batch of the tokens whose logits are needed.

        Returns:
            logits [len(logit_rows), vocab] fp32.
        """
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])

    def _prepare(self, batch: list[tuple[list[int], int, list[int]]]):
        dev, bs = self.device, self.block_size
        ids, pos, slots, prefills = [], [], [], []
        decode_idx, decode_tables, decode_lens = [], [], []
        start = 0
        for token_ids, c, block_table in batch:
            n = len(token_ids)
            table = torch.tensor(block_table, dtype=torch.long)
            p = torch.arange(c, c + n)
            ids.append(torch.tensor(token_ids, dtype=torch.long))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if n == 1:
                decode_idx.append(start)
                decode_tables.append(table[:c // bs + 1])
                decode_lens.append(c + 1)
            else:
                prefills.append((start, n, c + n, table[:-(-(c + n) // bs)].to(dev)))
            start += n
        decode_token_idx = decode_block_tables = context_lens = decode_mask = None
        if decode_idx:
            decode_token_idx = torch.tensor(decode_idx, device=dev)
            decode_block_tables = torch.nn.utils.rnn.pad_sequence(decode_tables, batch_first=True).to(dev)
            context_lens = torch.tensor(decode_lens, device=dev)
            if self.decode_needs_mask:
                max_len = decode_block_tables.shape[1] * bs
                decode_mask = (torch.arange(max_len, device=dev) < context_lens.unsqueeze(1)).view(
                    len(decode_lens), 1, 1, max_len)
        meta = AttentionMetadata(torch.cat(slots).to(dev), decode_token_idx, decode_block_tables,
                                 context_lens, decode_mask, prefills)
        return torch.cat(ids).to(dev), torch.cat(pos).to(dev), meta
