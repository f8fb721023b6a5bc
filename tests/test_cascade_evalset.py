"""The cascade's evaluation set: generated arithmetic, the answer extractor, HumanEval through
the sandbox, and the sandbox's limits (real subprocesses, real sockets; no mocks)."""

from __future__ import annotations

import functools
import platform
import socket
import subprocess
import sys
import time

import pytest

from sluice.cascade import sandbox
from sluice.cascade.evalset import (Item, arithmetic_problems, check, code_program,
                                    extract_answer, humaneval_problems)

# --- extractor -----------------------------------------------------------------------------
REPLIES = [
    ("Lena starts with 17 apples.\n17 - 2 = 15\n15 + 13 = 28\nAnswer: 28", 28),
    ("Step 1: 88 - 33 = 55.\nStep 2: 55 × 3 = 165.\nThe answer is 165.", 165),
    ("So she has 1,234 coins left.\n\n**Answer:** 1,234", 1234),
    ("First compute 12 * 3 = 36. Then 36 + 4 = 40.\n#### 40", 40),
    ("Therefore, the final answer is $\\boxed{1{,}250}$.", 1250),
    ("Answer: 7\n\nWait, I made a mistake: 10 - 4 = 6.\nAnswer: 6", 6),
    ("The temperature ends 5 degrees below zero, so the answer is -5.", -5),
    ("He pays $12 for the books.\nAnswer: $12.", 12),
    ("Total = 24 / 2 = 12.0\nAnswer: 12.0", 12),
    ("Each of the 3 people gets 7 cards, so she keeps 7 cards.", 7),
    ("Answer: 3 + 4 = 7", 7),
    ("The answer is 42 apples (she started with 10).", 42),
    ("Let me answer this step by step.\n48 / 4 = 12\n12 + 30 = 42\nSo Maya has 42 marbles.", 42),
    ("Answer: 5,000,000", 5_000_000),
    ("10-3 = 7 marbles", 7),
    ("Answer: −8", -8),
    ("\\boxed{56} is the total; checking: 8 * 7 = 56.", 56),
    ("The answer is: **2,574**.", 2574),
    ("I cannot determine the number of marbles.", None),
    ("Answer: 12.5", None),
    ("#### 123456789012345678901", 123456789012345678901),
]


@pytest.mark.parametrize("reply,expected", REPLIES)
def test_extract_answer(reply, expected):
    assert extract_answer(reply) == expected


# --- arithmetic generator ------------------------------------------------------------------
def recompute(item: Item, max_value: int) -> int:
    """The answer from the structured form, checking the generator's bounds on the way."""
    value = item.start
    assert 1 <= value <= max_value
    for op, n in item.ops:
        if op == "add":
            assert 1 <= n <= max_value
            value += n
        elif op == "sub":
            assert 1 <= n <= max_value
            value -= n
        elif op == "mul":
            assert 2 <= n <= 9
            value *= n
        else:
            assert op == "div" and 2 <= n <= 9 and value % n == 0
            value //= n
        assert 1 <= value <= 10 * max_value
    return value


def test_generator_is_deterministic():
    a = arithmetic_problems(20, seed=7, steps=4, max_value=100)
    assert a == arithmetic_problems(20, seed=7, steps=4, max_value=100)
    assert a != arithmetic_problems(20, seed=8, steps=4, max_value=100)
    assert len({item.id for item in a}) == 20 and a[3].id == "arith-7-4x100-3"


@pytest.mark.parametrize("steps,max_value", [(1, 10), (2, 20), (4, 100), (6, 1000), (8, 10_000)])
def test_generated_answers_are_right(steps, max_value):
    for item in arithmetic_problems(50, seed=1, steps=steps, max_value=max_value):
        assert item.kind == "arithmetic"
        assert item.answer == recompute(item, max_value)
        assert f"has {item.start} " in item.prompt and 'Answer: <number>' in item.prompt
        story = item.prompt.split("\n\n", 1)[1]
        assert all(str(n) in story for _, n in item.ops)
        assert extract_answer(item.reference) == item.answer and check(item, item.reference)
        assert not check(item, item.reference + "\nAnswer: " + str(item.answer + 1))


def test_difficulty_ladder():
    ladder = [(2, 20), (4, 100), (6, 1000), (8, 10_000)]
    biggest = []
    for steps, max_value in ladder:
        items = arithmetic_problems(40, seed=3, steps=steps, max_value=max_value)
        assert all(len(item.ops) == steps for item in items)
        # one sentence per operation, plus the start and the question
        assert all(item.prompt.split("\n\n", 1)[1].count(". ") + 1 == steps + 2 for item in items)
        assert all(a[0] != b[0] for item in items for a, b in zip(item.ops, item.ops[1:]))
        biggest.append(max(max(item.start, item.answer) for item in items))
    assert biggest == sorted(biggest) and biggest[0] <= 200 and biggest[-1] >= 10_000


def test_generator_rejects_bad_arguments():
    for args in [(-1, 0, 2, 10), (1, 0, 0, 10), (1, 0, 2, 1)]:
        with pytest.raises(ValueError):
            arithmetic_problems(*args)


# --- HumanEval through the sandbox ---------------------------------------------------------
WRONG = {"HumanEval/0": "    return False\n", "HumanEval/2": "    return number\n",
         "HumanEval/4": "    return 0.0\n"}


@pytest.fixture(scope="module")
def humaneval() -> dict[str, Item]:
    return {item.id: item for item in humaneval_problems()}


def test_humaneval_loads_all_problems(humaneval):
    assert len(humaneval) == 164 and list(humaneval)[:2] == ["HumanEval/0", "HumanEval/1"]
    zero = humaneval["HumanEval/0"]
    assert zero.kind == "code" and zero.entry_point == "has_close_elements"
    assert "def check(candidate):" in zero.test and zero.prompt.startswith("from typing import List")


@pytest.mark.parametrize("task_id", sorted(WRONG))
def test_humaneval_canonical_passes_and_wrong_fails(humaneval, task_id):
    item = humaneval[task_id]
    assert check(item, item.reference)
    assert not check(item, WRONG[task_id])
    # a chatty reply with the whole function in a fence (the prompt's imports stay defined)
    header = item.prompt[item.prompt.index(f"def {item.entry_point}("):].split("\n", 1)[0]
    fenced = f"Here is my solution:\n```python\n{header}\n{item.reference}```\nDone."
    assert check(item, fenced)
    assert not check(item, f"```python\n{header}\n{WRONG[task_id]}```")


def test_code_program_prefers_the_fenced_block_defining_the_entry_point(humaneval):
    item = humaneval["HumanEval/2"]
    reply = ("```\n>>> truncate_number(3.5)\n```\n```python\n"
             "def truncate_number(number: float) -> float:\n    return number % 1.0\n```")
    program = code_program(item, reply)
    assert program.count(">>> truncate_number(3.5)") == 1  # the prompt's doctest only
    assert "    return number % 1.0\n" in program and check(item, reply)


# --- sandbox -------------------------------------------------------------------------------
def test_sandbox_runs_normal_code():
    result = sandbox.run_python("from __future__ import annotations\nprint(__name__, 6 * 7)")
    assert result.ok and result.returncode == 0 and not result.timed_out
    assert result.stdout_tail == "__main__ 42\n" and result.stderr_tail == ""
    failed = sandbox.run_python("raise SystemExit('bad answer')")
    assert not failed.ok and failed.returncode == 1 and "bad answer" in failed.stderr_tail


def test_sandbox_timeout_kills_an_infinite_loop():
    start = time.monotonic()
    result = sandbox.run_python("while True:\n    pass\n", timeout_s=1.0)
    assert result.timed_out and not result.ok and result.returncode == -9
    assert time.monotonic() - start < 1.0 + 2.0


@pytest.fixture
def listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        yield server


def assert_nobody_connected(server: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        server.accept()


def test_sandbox_socket_to_localhost_fails(listener):
    port = listener.getsockname()[1]
    guarded = sandbox.run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))")
    assert not guarded.ok and "network access is disabled" in guarded.stderr_tail
    # around the guard: the original class is still reachable, so the kernel layers decide
    raw = sandbox.run_python(f"import _socket\ns = _socket.SocketType()\ns.connect(('127.0.0.1', {port}))")
    assert not raw.ok and ("PermissionError" in raw.stderr_tail or "OSError" in raw.stderr_tail)
    assert_nobody_connected(listener)


def test_network_namespace_alone_blocks_localhost(listener):
    netns = sandbox._probe()[0]
    if netns is None:
        pytest.skip(f"no network namespace on this machine: {sandbox.layers()}")
    port = listener.getsockname()[1]
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
            "except OSError as e:\n    print(type(e).__name__, e.errno)\n")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                         timeout=30, preexec_fn=functools.partial(sandbox._unshare, netns))
    assert out.stdout.split()[0] in ("OSError", "ConnectionRefusedError"), out
    assert_nobody_connected(listener)


def test_sandbox_big_write_fails():
    """stdout is a file too: 64 MiB of it passes the 16 MiB file-size limit."""
    result = sandbox.run_python("import sys\nsys.stdout.buffer.write(b'x' * (64 << 20))\n"
                                "sys.stdout.flush()\n")
    assert not result.ok and "File too large" in result.stderr_tail


def test_sandbox_code_reads_but_changes_nothing_outside(tmp_path):
    """Code the router runs for a client (a prompt's stub, a model's answer), as root here:
    it cannot create, append to, truncate, remove, rename or chmod a file, nor signal another
    process; it can read. (seccomp, x86_64.)"""
    if platform.machine() != "x86_64" or not sandbox.layers()["seccomp"]:
        pytest.skip(f"the host-call filter is x86_64's: {platform.machine()}, {sandbox.layers()}")
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for code in (f"open({str(tmp_path / 'new')!r}, 'w')", f"open({str(victim)!r}, 'a')",
                     f"open({str(victim)!r}, 'r+')", f"import os; os.truncate({str(victim)!r}, 0)",
                     f"import os; os.unlink({str(victim)!r})",
                     f"import os; os.rename({str(victim)!r}, {str(tmp_path / 'moved')!r})",
                     f"import os; os.chmod({str(victim)!r}, 0o777)",
                     f"import os; os.mkdir({str(tmp_path / 'd')!r})",
                     f"import os, signal; os.kill({sleeper.pid}, signal.SIGKILL)"):
            result = sandbox.run_python(code, timeout_s=10)
            assert not result.ok and "Operation not permitted" in result.stderr_tail, code
        assert sleeper.poll() is None
        assert victim.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == \
            ["victim.txt"]
        assert (victim.stat().st_mode & 0o777) != 0o777
        read = sandbox.run_python(f"print(open({str(victim)!r}).read())", timeout_s=10)
        assert read.ok and read.stdout_tail.strip() == "kept"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sandbox_memory_is_bounded():
    result = sandbox.run_python("x = bytearray(2 << 30)")
    assert not result.ok and "MemoryError" in result.stderr_tail


def test_sandbox_fork_bomb_fails_fast():
    start = time.monotonic()
    result = sandbox.run_python("import os\nwhile True:\n    os.fork()\n", timeout_s=5.0)
    assert not result.ok
    if sandbox.layers()["seccomp"]:
        assert not result.timed_out and "PermissionError" in result.stderr_tail
        assert time.monotonic() - start < 3.0


def test_sandbox_rejects_a_bad_timeout():
    with pytest.raises(ValueError):
        sandbox.run_python("pass", timeout_s=0)


def test_every_humaneval_canonical_solution_passes_in_the_sandbox(humaneval):
    """The sandbox's limits break none of the 164 reference solutions (about 12 s serially)."""
    failed = [item.id for item in humaneval.values() if not check(item, item.reference)]
    assert failed == []
