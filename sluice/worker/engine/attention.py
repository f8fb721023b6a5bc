"""Paged attention in plain PyTorch: K/V live in a block pool and are read via block tables.

Layout of one layer's cache (vLLM/nano-vllm style)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot s  = block_id * block_size + offset      (flat index into view(-1, H_kv, D))

    block_table of a sequence:  [b7, b2, b9]  → token t lives in block b[t // bs], offset t % bs

Each step first writes the new tokens' K/V to their slots (``slot_mapping``), then attends:
decode sequences (one query token) in one call; prefill chunks one sequence at a time,
causally, over their cached prefix plus the chunk. GQA is handled by SDPA's ``enable_gqa``.

Decode on CPU runs a C++ kernel (``csrc/paged_decode.cpp``, vLLM paged attention v1 with
FlashDecoding's online softmax) that reads the blocks in place. It is compiled with
``torch.utils.cpp_extension`` on first use and cached in the torch extensions folder
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), in a folder keyed by the
source, the Python environment and torch (``_build_directory``): two checkouts' venvs
sharing one cache each keep their build, where a folder keyed by name alone was rebuilt
(8-11 s) at every worker start of the other one. Elsewhere (CUDA), when
``SLUICE_NATIVE_KERNELS=0``, or when the build fails (logged once), decode is one batched
SDPA over the gathered blocks with a length mask.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_PAGED_DECODE_SRC = Path(__file__).with_name("csrc") / "paged_decode.cpp"


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
    return _load_paged_decode() if device.type == "cpu" else None


@functools.cache
def _load_paged_decode() -> Callable[..., torch.Tensor] | None:
    if os.environ.get("SLUICE_NATIVE_KERNELS", "1") == "0":
        logger.info("SLUICE_NATIVE_KERNELS=0: decode attention uses gather + SDPA")
        return None
    try:
        from torch.utils import cpp_extension

        compiler = os.environ.get("CXX", "c++")  # what cpp_extension runs
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler: {compiler!r} not found")
        if shutil.which("ninja") is None:  # pip's ninja sits in the venv's bin, off PATH unless activated
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        build = _build_directory(Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                                      or cpp_extension.get_default_build_root()))
        build.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build / "lock")
        cpp_extension.load(name="sluice_paged_decode", sources=[str(_PAGED_DECODE_SRC)],
                           extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(build), is_python_module=False)
    except Exception as err:  # no compiler, headers or ninja: serve on the slower path
        logger.warning("native paged decode kernel unavailable, decode attention uses gather + SDPA: %s",
                       _build_failure(err))
        return None
    return torch.ops.sluice.paged_decode


_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# A build holds torch's lock file (``lock`` in its folder) for ~20 s here; one older than
# this is a build that was killed, and would make every later worker wait for it forever.
STALE_LOCK_S = 120.0


def _build_directory(root: Path) -> Path:
    """The kernel's build folder under ``root``: keyed by the source, the flags, this
    Python environment (its headers and libraries) and torch's version."""
    key = hashlib.sha256(b"\0".join([_PAGED_DECODE_SRC.read_bytes(), " ".join(_CFLAGS).encode(),
                                      sys.prefix.encode(), torch.__version__.encode()]))
    return root / f"sluice_paged_decode_{key.hexdigest()[:12]}"


def clear_stale_lock(lock: Path, stale_s: float = STALE_LOCK_S, poll_s: float = 0.5) -> bool:
    """Wait while another process's build holds ``lock``, until the lock is ``stale_s``
    seconds old; then remove it (logged) and return True. False when there was none or it
    was released. (torch's own wait has no end: a worker killed mid-build, e.g. by its
    supervisor, left every later worker of that cache hanging before its first log line.)"""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age >= stale_s:
            logger.warning("removing the native kernel's build lock %s, %.0f s old: the build "
                           "that took it must have been killed", lock, age)
            lock.unlink(missing_ok=True)
            return True
        time.sleep(min(poll_s, stale_s - age))


def _build_failure(err: Exception) -> str:
    """One line from cpp_extension's error: its head (minus the ninja command lines) and the
    first line of the compiler's output that says what went wrong."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
    why = next((line for line in lines[1:] if "error" in line.lower() or "not found" in line), "")
    return f"{type(err).__name__}: {lines[0].split(': [')[0][:200]} {why[:200]}".strip()
