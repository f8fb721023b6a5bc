"""Sluice's C++ CPU kernels (``csrc/``), built once with ``torch.utils.cpp_extension`` into
one library that registers ``torch.ops.sluice.*``:

- ``paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)``: decode attention
  over the paged KV cache, read in place (``attention.decode_attention``);
- ``int8_linear(x, q, scales)`` and ``int4_linear(x, w, N)``: the int8 and 4-bit weight
  matmuls (``quant.Int8Linear``, ``quant.Int4Linear``), at any row count;
- ``add_rms_norm_``, ``silu_and_mul``, ``rotary_``: the small ops between a layer's matmuls;
- ``argmax_rows(x)``: each row's greedy token (``sampler.argmax``);
- ``decode_layers(...)``: a whole decode step's layers in one call, for models whose
  linears all run those kernels (``LlamaForCausalLM.fuse_decode_step``).

The build (~10-20 s) happens on first use and is cached in the torch extensions folder
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), in a folder keyed by the
sources, the flags, the Python environment and torch (``_build_directory``): two checkouts'
venvs sharing one cache each keep their build, where a folder keyed by name alone was
rebuilt at every worker start of the other one. With ``SLUICE_NATIVE_KERNELS=0``, or when
the build fails (logged once, naming the compiler's error), every caller takes its plain
PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_decode.cpp", "int8_linear.cpp", "int4_linear.cpp",
                             "decode_ops.cpp", "decode_step.cpp"))
HEADERS = tuple(Path(__file__).with_name("csrc") / name  # in the build key too
                for name in ("ops.h", "row_blocks.h", "vec_exp.h"))
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# A build holds torch's lock file (``lock`` in its folder) for ~20 s here; one older than
# this is a build that was killed, and would make every later worker wait for it forever.
STALE_LOCK_S = 120.0


def available(device: torch.device) -> bool:
    """Whether ``torch.ops.sluice`` holds the kernels for tensors on ``device``: a CPU
    device, ``SLUICE_NATIVE_KERNELS`` not 0, and the library built and loaded."""
    return device.type == "cpu" and _load()


def available_for(x: torch.Tensor) -> bool:
    """``available(x.device)``, cheaper (no device object): called per op of a step."""
    return x.is_cpu and _load()


@functools.cache
def _load() -> bool:
    if os.environ.get("SLUICE_NATIVE_KERNELS", "1") == "0":
        logger.info("SLUICE_NATIVE_KERNELS=0: the plain PyTorch paths run (decode attention "
                    "by gather + SDPA, int8 matmuls by aten)")
        return False
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
        first = not (build / "sluice_kernels.so").exists()
        if first:  # (a first `sluice up` is otherwise silent for this long)
            logger.info("building the native CPU kernels into %s (once per checkout and "
                        "torch: ~30-60 s on 2 cores)", build)
        started = time.monotonic()
        cpp_extension.load(name="sluice_kernels", sources=[str(s) for s in SOURCES],
                           extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(build), is_python_module=False)
        if first:
            logger.info("native CPU kernels built in %.1f s", time.monotonic() - started)
    except Exception as err:  # no compiler, headers or ninja: serve on the slower paths
        logger.warning("native CPU kernels unavailable, decode attention uses gather + SDPA "
                       "and int8 matmuls aten's kernel: %s", _build_failure(err))
        return False
    return True


def _build_directory(root: Path) -> Path:
    """The kernels' build folder under ``root``: keyed by the sources and headers, the
    flags, this Python environment (its headers and libraries) and torch's version."""
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in SOURCES + HEADERS),
                                      " ".join(_CFLAGS).encode(), sys.prefix.encode(),
                                      torch.__version__.encode()]))
    return root / f"sluice_kernels_{key.hexdigest()[:12]}"


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
            logger.warning("removing the native kernels' build lock %s, %.0f s old: the build "
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
