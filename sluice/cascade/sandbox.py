"""Run untrusted Python (a model's code answer) in a throw-away subprocess.

``run_python(code)`` writes ``code`` to ``main.py`` in a fresh temporary directory and runs
it with ``python -I -S`` (isolated mode, no ``site``: no PYTHON* variables, no user site, no
``sitecustomize``, no site-packages; the standard library only) and a minimal environment.
Layers, each set in the child between fork and exec; those marked *probed* are tried once
per process (``layers()``) and, when they work, required by every run (fail closed):

1. **Process group.** The child leads its own session; on timeout, and after every run for
   stragglers, the whole group gets SIGKILL (repeated while a fork bomb is still forking).
2. **Resource limits.** Address space 1 GiB, CPU ``ceil(timeout_s) + 1`` s, each written
   file at most 16 MiB (stdout and stderr are files too), no core dumps, at most 64
   processes for the child's user. Linux exempts uid 0 from the last one.
3. **Network namespace** (*probed*). ``unshare(CLONE_NEWNET)`` (``CLONE_NEWUSER |
   CLONE_NEWNET`` when not root), through ``os.unshare`` (Python ≥ 3.12) or libc: the child
   sees only a loopback that is down, so every connect fails, 127.0.0.1 included.
4. **User ``nobody``** (*probed*, root only). Taken when the interpreter is readable by
   65534; then host files are out of reach and the process limit applies. An interpreter
   under ``/root`` (pyenv) is not, and the child stays uid 0 (its writes are bounded by
   the file-size limit only).
5. **seccomp** (*probed*, x86_64 and aarch64). A filter fails ``fork``, ``vfork``,
   ``clone``, ``clone3``, ``socket`` and ``socketpair`` with EPERM (ENOSYS for clone3), so
   a fork bomb cannot fork even as root, and no socket opens (AF_UNIX included). On x86_64
   it also fails every call that reaches past the child (``_DENY``): a signal to another
   process, ptrace, any change to a file (an open for writing, unlink, rename, chmod, ...),
   io_uring, mounts, modules, clocks: so code running as root can read, not write or kill.
6. **Socket guard.** A bootstrap (``-c``; it then runs ``main.py`` with ``runpy``, so the
   candidate keeps its own line numbers and ``__future__`` imports) replaces
   ``socket.socket``, ``_socket.socket``, ``socket.create_connection`` and
   ``socket.socketpair`` with a function that raises ``PermissionError``. Easy to get
   around (ctypes); it is the last line where 3 and 5 are refused.

On the development machine (root in a container, Linux 6.18, x86_64, pyenv Python under
``/root``) layers 1-3, 5 and 6 work; 4 does not: ``layers()`` → ``{"netns": True,
"nobody": False, "seccomp": True}``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
NOBODY = 65534
ADDRESS_SPACE_BYTES = 1 << 30
FILE_SIZE_BYTES = 16 << 20
MAX_PROCESSES = 64
TAIL_CHARS = 4000

GUARD = '''\
import socket as _s, _socket as _ss
def _no_network(*a, **k):
    raise PermissionError("network access is disabled in the sandbox")
_s.socket = _ss.socket = _s.create_connection = _s.socketpair = _no_network
del _s, _ss, _no_network
import runpy
runpy.run_path("main.py", run_name="__main__")
'''


@dataclass(frozen=True)
class SandboxResult:
    """One run: ``ok`` is exit status 0 within the deadline; tails are the last 4000 chars."""

    ok: bool
    returncode: int | None
    stdout_tail: str
    stderr_tail: str
    timed_out: bool


# --- kernel calls (prepared in the parent; only called in the forked child) -----------
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):
        os.unshare(flags)
    else:
        _check(_libc.unshare(flags), f"unshare(0x{flags:x})")


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


# (audit arch, {syscall number: errno}, {open-like syscall: index of its flags argument}).
# Denied everywhere: fork/vfork/clone/clone3/socket/socketpair. On x86_64 also what could
# touch the host outside the child (the child may run as root: the router runs code that
# its clients' prompts shape): signals to other processes (kill, tkill, tgkill,
# rt_(tg)sigqueueinfo, pidfd_send_signal/getfd), ptrace and process_vm_*, every change to a
# file (open/openat with a write, create, truncate or append flag, creat, openat2 (ENOSYS:
# glibc falls back to openat), truncate, unlink, rename, mkdir, rmdir, link, symlink, mknod,
# chmod, chown, utime*, *xattr), io_uring (file calls that seccomp would not see), mounts and
# handles (open_by_handle_at, the fsopen family), modules, kexec, reboot, clocks, host and
# domain names, swap, chroot/pivot_root, namespaces (setns), priorities and affinities of
# other processes, keyrings, bpf, perf_event_open, userfaultfd, syslog, ioperm/iopl, quotas.
# Reading stays possible (Python reads its standard library); what a run prints reaches
# only its caller's pass/fail verdict.
_HOST_X86_64 = (62, 200, 234, 129, 297, 424, 438, 101, 310, 311,  # signals, ptrace, vm
                85, 76, 87, 263, 82, 264, 316, 83, 258, 84, 86, 265, 88, 266, 133, 259,
                90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 280, 261,
                188, 189, 190, 197, 198, 199,  # files: creat ... fremovexattr
                425, 426, 427, 165, 166, 303, 304, 428, 429, 430, 431, 432, 433, 442,
                175, 176, 313, 246, 320, 169, 164, 227, 159, 305, 170, 171, 167, 168, 161,
                155, 163, 308, 141, 203, 144, 142, 251, 248, 249, 250, 321, 298, 323, 103,
                172, 173, 179, 153)
_DENY = {
    "x86_64": (0xC000003E, {57: 1, 58: 1, 56: 1, 435: 38, 41: 1, 53: 1, 437: 38,
                            **dict.fromkeys(_HOST_X86_64, 1)}, {2: 1, 257: 2}),
    "aarch64": (0xC00000B7, {220: 1, 435: 38, 198: 1, 199: 1}, {}),
}
_WRITE_FLAGS = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000  # O_WRONLY O_RDWR O_CREAT O_TRUNC O_APPEND
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # LD|W|ABS, JMP|{JEQ,JGE,JSET}|K
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000
_ARGS_OFFSET = 16  # seccomp_data: nr, arch, instruction pointer, then 6 64-bit arguments


def _seccomp_prog() -> _Prog | None:
    """The BPF program for this machine's architecture, or None where there is none."""
    if platform.machine() not in _DENY:
        return None
    arch, deny, opens = _DENY[platform.machine()]
    ops = [(_LD, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _KILL),  # other ABIs: kill
           (_LD, 0, 0, 0), (_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _KILL)]  # x32: kill
    for nr, flags_arg in opens.items():  # open for reading only (its flags' low word)
        ops += [(_JEQ, 0, 4, nr), (_LD, 0, 0, _ARGS_OFFSET + 8 * flags_arg),
                (_JSET, 0, 1, _WRITE_FLAGS), (_RET, 0, 0, _ERRNO | 1), (_RET, 0, 0, _ALLOW)]
    for nr, errno in deny.items():
        ops += [(_JEQ, 0, 1, nr), (_RET, 0, 0, _ERRNO | errno)]
    ops.append((_RET, 0, 0, _ALLOW))
    filters = (_Filter * len(ops))(*[_Filter(*op) for op in ops])
    return _Prog(len(ops), filters)


_SECCOMP = _seccomp_prog()


def _seccomp() -> None:
    _check(_libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_libc.prctl(22, 2, ctypes.byref(_SECCOMP), 0, 0), "prctl(PR_SET_SECCOMP)")


def _nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _child(cpu_s: int, netns: int | None, nobody: bool, seccomp: bool) -> None:
    """preexec_fn: limits, then the network namespace, the user drop and seccomp."""
    for limit, value in ((resource.RLIMIT_AS, ADDRESS_SPACE_BYTES), (resource.RLIMIT_CPU, cpu_s),
                         (resource.RLIMIT_FSIZE, FILE_SIZE_BYTES), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, MAX_PROCESSES)):
        resource.setrlimit(limit, (value, value))
    if netns is not None:
        _unshare(netns)
    if nobody:
        _nobody()
    if seccomp:
        _seccomp()


# --- probes -----------------------------------------------------------------------------
def _works(preexec) -> bool:
    """Whether the interpreter starts with ``preexec`` applied in the child."""
    try:
        subprocess.run([sys.executable, "-I", "-S", "-c", ""], check=True, timeout=30,
                       preexec_fn=preexec, cwd="/", stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        logger.info("sandbox layer unavailable (%s): %s", getattr(preexec, "__name__", preexec), e)
        return False


@functools.cache
def _probe() -> tuple[int | None, bool, bool]:
    """(netns unshare flags or None, drop to nobody, seccomp) that work here."""
    netns = None
    for flags in ([CLONE_NEWNET] if os.geteuid() == 0 else []) + [CLONE_NEWUSER | CLONE_NEWNET]:
        if _works(functools.partial(_unshare, flags)):
            netns = flags
            break
    nobody = os.geteuid() == 0 and _works(_nobody)
    seccomp = _SECCOMP is not None and _works(_seccomp)
    if netns is None and not seccomp:
        logger.warning("sandbox: no namespace or seccomp; only the socket guard blocks network")
    return netns, nobody, seccomp


def layers() -> dict[str, bool]:
    """Which probed layers apply on this machine: ``netns``, ``nobody``, ``seccomp``."""
    netns, nobody, seccomp = _probe()
    return {"netns": netns is not None, "nobody": nobody, "seccomp": seccomp}


# --- the run ----------------------------------------------------------------------------
def _kill_group(pgid: int) -> None:
    for _ in range(100):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4 * TAIL_CHARS))
        return f.read().decode("utf-8", "replace")[-TAIL_CHARS:]


def run_python(code: str, timeout_s: float = 10.0) -> SandboxResult:
    """Run ``code`` as a script in a sandboxed ``python -I -S`` (see the module docstring).

    Args:
        code: a whole Python program, run as ``__main__`` from ``main.py`` after the guard.
        timeout_s: wall-clock deadline in seconds (the CPU limit is ``ceil(timeout_s) + 1``).
    Returns:
        SandboxResult; ``returncode`` is negative for a signal (-9 after a timeout).
    Raises:
        ValueError for a non-positive timeout; OSError if a probed layer fails to apply.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    netns, nobody, seccomp = _probe()
    with tempfile.TemporaryDirectory(prefix="sluice-sandbox-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o711)
        work = root / "work"
        work.mkdir()
        if nobody:
            os.chown(work, NOBODY, NOBODY)
        (work / "main.py").write_text(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
        preexec = functools.partial(_child, math.ceil(timeout_s) + 1, netns, nobody, seccomp)
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", GUARD], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, preexec_fn=preexec)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        return SandboxResult(ok=proc.returncode == 0 and not timed_out,
                             returncode=proc.returncode, timed_out=timed_out,
                             stdout_tail=_tail(root / "stdout"), stderr_tail=_tail(root / "stderr"))
