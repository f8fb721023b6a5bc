"""The native paged decode kernel (csrc/paged_decode.cpp) against the gather + SDPA
reference, and the fallback when it is disabled or cannot be built.

Tolerances (|got - want| <= atol + rtol * |want|, outputs of magnitude up to ~4): fp32
atol = rtol = 1e-5; bf16 atol = rtol = 1e-2 and fp16 2e-3, about one ulp (both round their
output to the cache dtype, SDPA some intermediates too).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import filelock
import pytest
import torch

from sluice.worker.engine import attention, kernels
from sluice.worker.engine.attention import AttentionMetadata, decode_attention, sdpa_decode

BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS = 16, 64, 1024
LENS = [1, BLOCK_SIZE, BLOCK_SIZE + 1, 300]  # one token, a full block, one past it, long
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # atol = rtol


@pytest.fixture(scope="module")
def kernel():
    op = attention.native_paged_decode(torch.device("cpu"))
    if op is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the native kernel cannot be built here")
    assert op is not None, "the native paged decode kernel failed to build (see the warning)"
    return op


def decode_batch(lens: list[int], heads_q: int, heads_kv: int, dtype: torch.dtype, seed: int = 0,
                 head_dim: int = HEAD_DIM, block_size: int = BLOCK_SIZE):
    """Random q and caches, and block tables drawn without replacement from the pool, padded
    with 0 past each context like ModelRunner's. Returns (q, k_cache, v_cache, tables, lens, mask)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), heads_q, head_dim, generator=gen).to(dtype)
    shape = (NUM_BLOCKS, block_size, heads_kv, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    max_blocks = -(-max(lens) // block_size)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    for b, n in enumerate(lens):
        for i in range(-(-n // block_size)):
            tables[b, i] = free.pop()
    context_lens = torch.tensor(lens)
    max_len = max_blocks * block_size
    mask = (torch.arange(max_len) < context_lens.unsqueeze(1)).view(len(lens), 1, 1, max_len)
    return q, k_cache, v_cache, tables, context_lens, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("batch", [1, 64])
def test_kernel_matches_sdpa(kernel, dtype, group, batch):
    heads_kv = 3
    cases = [[n] for n in LENS] if batch == 1 else [[LENS[i % 4] + (i // 4) * 7 for i in range(batch)]]
    for lens in cases:
        q, k_cache, v_cache, tables, context_lens, mask = decode_batch(lens, heads_kv * group, heads_kv, dtype)
        scale = HEAD_DIM ** -0.5
        got = kernel(q, k_cache, v_cache, tables, context_lens, scale)
        want = sdpa_decode(q, k_cache, v_cache, tables, mask, scale)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"lens {lens}: {m}")


@pytest.mark.parametrize("head_dim, block_size", [(128, 16), (64, 8), (96, 16)])
def test_kernel_matches_sdpa_at_other_head_and_block_sizes(kernel, head_dim, block_size):
    """fp32 with heads of 64 or 128 in blocks of 16 takes the AVX-512 version; the rest the
    generic loop (here blocks of 8, heads of 96); both against SDPA."""
    lens = [1, block_size, block_size + 1, 77, 300]
    q, k_cache, v_cache, tables, context_lens, mask = decode_batch(
        lens, 6, 2, torch.float32, head_dim=head_dim, block_size=block_size)
    scale = head_dim ** -0.5
    got = kernel(q, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(got, sdpa_decode(q, k_cache, v_cache, tables, mask, scale),
                               atol=1e-5, rtol=1e-5)


def test_kernel_takes_int32_tables_and_rejects_bad_ones(kernel):
    q, k_cache, v_cache, tables, context_lens, mask = decode_batch([5, 40], 3, 3, torch.float32)
    want = sdpa_decode(q, k_cache, v_cache, tables, mask, 0.125)
    got = kernel(q, k_cache, v_cache, tables.int(), context_lens.int(), 0.125)
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(q, k_cache, v_cache, tables + NUM_BLOCKS, context_lens, 0.125)
    with pytest.raises(RuntimeError, match="context length out of range"):
        kernel(q, k_cache, v_cache, tables, context_lens * 10, 0.125)
    with pytest.raises(RuntimeError, match="head shapes do not match"):  # was SIGFPE (x % 0)
        kernel(q, k_cache[:, :, :0], v_cache[:, :, :0], tables, context_lens, 0.125)


def test_decode_attention_uses_the_kernel_on_cpu_and_sdpa_without_it(kernel, monkeypatch):
    q, k_cache, v_cache, tables, context_lens, mask = decode_batch([1, 17, 300], 9, 3, torch.float32)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), torch.arange(3), tables, context_lens,
                             None, [])
    native = decode_attention(q, k_cache, v_cache, meta, 0.125)  # no mask: only the kernel can run
    monkeypatch.setattr(attention, "native_paged_decode", lambda device: None)
    meta.decode_mask = mask
    fallback = decode_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.allclose(native, fallback, atol=1e-5)


def test_switch_off_missing_compiler_and_failed_build_fall_back(monkeypatch, caplog):
    load = kernels._load.__wrapped__  # the uncached loader
    monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    assert load() is False
    monkeypatch.delenv("SLUICE_NATIVE_KERNELS")

    def failed_build(**_):  # what cpp_extension raises when ninja's compile step fails
        raise RuntimeError("Error building extension 'sluice_kernels': [1/2] c++ -c paged_decode.cpp\n"
                           "FAILED: paged_decode.o\nc++ -c paged_decode.cpp\n"
                           "paged_decode.cpp:13:10: fatal error: ATen/ATen.h: No such file or directory\n"
                           "ninja: build stopped: subcommand failed.\n")

    monkeypatch.setattr("torch.utils.cpp_extension.load", failed_build)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        monkeypatch.setenv("CXX", "/nonexistent/c++")
        assert load() is False
        monkeypatch.setenv("CXX", sys.executable)  # any executable: the build itself is faked
        assert load() is False
    assert [r.message.split("aten's kernel: ")[1] for r in caplog.records] == [
        "RuntimeError: no C++ compiler: '/nonexistent/c++' not found",
        "RuntimeError: Error building extension 'sluice_kernels' "
        "paged_decode.cpp:13:10: fatal error: ATen/ATen.h: No such file or directory"]


def test_the_build_folder_is_keyed_by_environment_and_source(tmp_path, monkeypatch):
    """Two venvs (or two checkouts, or two CPUs of a cluster) sharing one extensions cache
    keep a build each."""
    here = kernels._build_directory(tmp_path)
    assert here.parent == tmp_path and here == kernels._build_directory(tmp_path)
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    assert kernels._build_directory(tmp_path) != here
    elsewhere = kernels._build_directory(tmp_path)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "flags : fpu sse2")  # another node
    assert kernels._build_directory(tmp_path) != elsewhere


HOLDER = ("import sys, time, filelock; from pathlib import Path; d = Path(sys.argv[1]); "
          "held = filelock.FileLock(d / 'build.lock'); held.acquire(); (d / 'lock').touch(); "
          "print('held', flush=True); time.sleep(float(sys.argv[2])); "
          "(d / 'lock').unlink(); held.release()")


def _holder(build, seconds: float) -> subprocess.Popen:
    """A process that builds in ``build`` for ``seconds``: it holds build.lock and torch's
    ``lock``, and removes the latter when done (as a build does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(build), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_build_is_waited_for_however_long_and_a_killed_ones_lock_removed(tmp_path,
                                                                                caplog):
    """torch's ``lock`` of a build still running is left alone while it lasts (an age rule
    removed a slow build's lock under load, and two builds raced in one folder); a
    leftover ``lock`` whose build was killed is removed at once."""
    build = tmp_path
    proc = _holder(build, 1.5)
    start = time.monotonic()
    with kernels.build_lock(build):
        assert time.monotonic() - start >= 1.0  # waited for the live build
        assert proc.wait(5) == 0
    assert not (build / "lock").exists()
    proc = _holder(build, 60)
    proc.kill()  # killed mid-build: the OS releases build.lock; torch's lock stays
    proc.wait()
    assert (build / "lock").exists()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=kernels.__name__), kernels.build_lock(build):
        assert time.monotonic() - start < 5
        assert not (build / "lock").exists()
    assert "the build that took it was killed" in caplog.text
    proc = _holder(build, 60)
    try:
        with pytest.raises(filelock.Timeout):
            with kernels.build_lock(build, wait_s=0.2):
                pass
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_worker_builds_the_kernel_past_a_killed_builds_lock(tmp_path):
    """A fresh extensions folder whose build folder holds a lock left by a killed build:
    the kernel is built and loaded (before, torch waited on the lock forever). In a child
    process: this one may have loaded the op already, and an op registers once."""
    code = ("import os, time, sys; from pathlib import Path; "
            "import torch; from sluice.worker.engine import kernels as a; "
            "d = a._build_directory(Path(os.environ['TORCH_EXTENSIONS_DIR'])); "
            "d.mkdir(parents=True); (d / 'lock').touch(); "
            "print(a.available(torch.device('cpu')), "
            "(d / 'lock').exists())")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"], proc.stdout + proc.stderr
