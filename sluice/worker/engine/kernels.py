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

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import filelock
import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_decode.cpp", "int8_linear.cpp", "int4_linear.cpp",
                             "decode_ops.cpp", "decode_step.cpp"))
HEADERS = tuple(Path(__file__).with_name("csrc") / name  # in the build key too
                for name in ("ops.h", "row_blocks.h", "vec_exp.h"))
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# How long a worker waits for another process's build of the same folder (~20-60 s here,
# minutes on a loaded machine) before it serves on the plain PyTorch paths.
BUILD_WAIT_S = 1800.0


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
        with build_lock(build):
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
    flags, this Python environment (its headers and libraries), torch's version and the
    CPU's feature flags (``-march=native``: a cache shared by the nodes of a cluster, the
    operator's hostPath or PVC model cache, keeps a build per instruction set)."""
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in SOURCES + HEADERS),
                                      " ".join(_CFLAGS).encode(), sys.prefix.encode(),
                                      torch.__version__.encode(), _cpu_flags().encode()]))
    return root / f"sluice_kernels_{key.hexdigest()[:12]}"


def _cpu_flags() -> str:
    """The first ``flags`` line of /proc/cpuinfo (the machine's name where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")),
                        platform.machine())
    except OSError:
        return platform.machine()


@contextlib.contextmanager
def build_lock(build: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold the build folder's ``build.lock`` (filelock: an OS lock, released when its
    holder ends, killed or not), waiting up to ``wait_s`` for another process's build.

    Under it no other process builds in ``build``, so torch's own lock file (``lock``, which
    torch waits on forever and never checks for a live holder) found there was left by a
    killed build: it is removed (logged). Judging that by the file's age instead removed
    the lock of a build that was slow, not dead, on a loaded machine.

    Raises:
        filelock.Timeout: another process held the lock for ``wait_s`` seconds.
    """
    held = filelock.FileLock(build / "build.lock")
    try:
        held.acquire(timeout=0)
    except filelock.Timeout:
        logger.info("waiting for another process's build of the native CPU kernels in %s",
                    build)
        held.acquire(timeout=wait_s)
    try:
        left = build / "lock"
        if left.exists():
            logger.warning("removing the native kernels' build lock %s: the build that took "
                           "it was killed", left)
            left.unlink(missing_ok=True)
        yield
    finally:
        held.release()


def _build_failure(err: Exception) -> str:
    """One line from cpp_extension's error: its head (minus the ninja command lines) and the
    first line of the compiler's output that says what went wrong."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
    why = next((line for line in lines[1:] if "error" in line.lower() or "not found" in line), "")
    return f"{type(err).__name__}: {lines[0].split(': [')[0][:200]} {why[:200]}".strip()
