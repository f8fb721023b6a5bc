"""Checks that prove an answer wrong, for the cascade's ``checks`` signal.

Token confidence guesses; a check proves. Two checks, each cheap enough for the router to
run on every judged answer:

- **Code examples.** A function's docstring usually shows how it behaves, and the answer's
  code is run on those examples (``examples_pass``, in ``sandbox.run_python``: no network,
  resource limits, a timeout). Two styles are read: doctest (``>>> f(1, 2)`` then the
  expected output on the next lines, or ``>>> f(x) == y`` alone, which must give True); and,
  when a prompt has no ``>>>`` example (41 of HumanEval's first 100 problems only have these),
  written out: ``f(1, 2) => 3``, ``==``, ``==>``, ``➞``, ``->``, ``→``, ``=``, ``# returns``,
  ``returns``, ``should return``, anywhere on a line, for ``f`` a function the prompt defines,
  with literal arguments and a literal expected value (``true``/``false`` read as Python's).
  Anything else (``f(n) = 1 + n / 2, if n is even``, ``Input: ... Output: ...``) is not an
  example.
- **Arithmetic steps.** A step-by-step answer writes its steps as ``a op b = c``
  (``wrong_steps``): each one whose result is not what its left side computes (to the
  decimals written) is a wrong step, and an answer built on one is wrong. Only plain chains
  of numbers and ``+ - * / × ÷ x \\times \\div`` are read: a step with a parenthesis, a
  power, a variable or a percentage is skipped, never guessed at; so are chains of more
  than ``MAX_STEP_OPERATIONS`` operations and lines over ``MAX_LINE_CHARS`` (both readers
  stay linear in the text: the router runs them on every judged answer).

``refutation`` runs both: an answer either check refutes escalates at any threshold
(``policy.Scores.signal``).
"""

from __future__ import annotations

import ast
import re

from sluice.cascade.sandbox import run_python

FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)
DOCTEST = re.compile(r"^([ \t]*)>>> (.*)$")
DEFINED = re.compile(r"^[ \t]*def[ \t]+([A-Za-z_]\w*)[ \t]*\(", re.M)
CALLED = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\(")  # a call of a bare name
ARROW = re.compile(r"[ \t]*(?:==>|=>|==|➞|->|→|=|#[ \t]*=>|#[ \t]*returns?|returns?|"
                   r"should[ \t]+return)[ \t]*", re.I)
BOOLEANS = {"true": "True", "false": "False"}
EXAMPLES_TIMEOUT_S = 10.0
FAILED_EXAMPLES, WRONG_ARITHMETIC = "failed-examples", "wrong-arithmetic"  # refutations
MAX_LINE_CHARS = 500  # longer lines hold no example or step worth reading: skipped
MAX_STEP_OPERATIONS = 16  # a longer chain is skipped (and the step regex stays linear)

_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
# a hyphen is a minus with a space beside it (9-5 is a range), an x a times between spaces
_OPERATOR = r"(?:\+|(?<=[ \t])-|-(?=[ \t])|−|\*|×|(?<=[ \t])x(?=[ \t])|\\times|\\cdot|·|/|÷|\\div)"
STEP = re.compile(
    rf"(?<![\w^.)\]/*+\-−:,'’√∛∜]){_NUMBER}"  # not inside a time, a number, a root, ...
    rf"(?:[ \t]*{_OPERATOR}[ \t]*{_NUMBER}){{1,{MAX_STEP_OPERATIONS}}}[ \t]*=[ \t]*({_NUMBER})"
    rf"(?![\d.]*(?:[ \t]*{_OPERATOR}|[\w^(%:]|,\d|[ \t]+\d|[ \t]*\?|[ \t]*(?:remainder|rem\b|"
    r"[rR]\b|o'clock|[ap]\.?m\b|\(?mod\b)))", re.I)
_CHAIN_BEFORE = re.compile(rf"(?:{_OPERATOR}|\d)[ \t]*$")  # the tail of a chain or a number
# a line that speaks of another arithmetic (integer division, modulo) or of a wrong step
_ASIDE = re.compile(r"integer|floor|truncat|remainder|modul|\bmod\b|//|\bnot\b|isn't|wrong|"
                    r"incorrect|\bfalse\b|mistake|≠", re.I)
_TIMES = re.compile(r"\\times|\\cdot|×|·|(?<=[ \t])x(?=[ \t])")
_DOTTED_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:\.\d{3})+(?![\d.])")
_DIVIDE = re.compile(r"\\div|÷")

PASSED = "sluice-examples-passed"  # the runner's last line: answer code that exits 0 first fails
RUNNER = """

import io as _io, re as _re, sys as _sys
_ns = dict(globals())  # the stub and the answer's names; an example's assignments persist


def _matches(_got, _want):
    if _want == _got:
        return True
    if "..." in _want:  # doctest's ELLIPSIS: "..." stands for any text
        return _re.fullmatch(".*?".join(map(_re.escape, _want.split("..."))), _got, _re.S) is not None
    return False


def _passes(_source, _want):
    _want = _want.replace("<BLANKLINE>", "")
    _out, _stdout = _io.StringIO(), _sys.stdout
    _sys.stdout = _out
    try:
        try:
            _code, _value = compile(_source, "<example>", "eval"), True
        except SyntaxError:  # a statement: it passes when it runs (and prints what is wanted)
            _code, _value = compile(_source, "<example>", "exec"), False
        try:
            _got = eval(_code, _ns)
        except Exception as _e:  # an example that wants its exception
            _last = _want.strip().splitlines()[-1:] or [""]
            return _want.startswith("Traceback") and _last[0].split(":")[0].split(".")[-1] \
                == type(_e).__name__
    finally:
        _sys.stdout = _stdout
    _printed = _out.getvalue()
    if not _value or (_got is None and _printed):  # a statement, or a call that printed
        return _matches(_printed.strip(), _want.strip()) or (not _want and not _printed)
    if not _want:  # `f(x) == y` written without an output line
        return _got is True or _got is None
    try:
        if "..." in _want:  # ELLIPSIS, not the value Ellipsis
            raise ValueError(_want)
        _expected = eval(_want, _ns)  # '21' and "21" are one answer
    except Exception:
        return _matches(repr(_got), _want) or _matches(str(_got), _want)
    _decimals = _re.fullmatch(r"\\s*-?\\d*\\.(\\d+)\\s*", _want)
    if _decimals and isinstance(_got, (int, float)) and not isinstance(_got, bool):
        return abs(_got - _expected) <= 0.5 * 10 ** -len(_decimals.group(1)) + 1e-12  # rounded
    return _got == _expected


_failed = 0
for _source, _want in {examples!r}:
    try:
        _failed += not _passes(_source, _want)
    except BaseException:
        _failed += 1
if _failed:
    raise SystemExit(1)
print("\\n" + {passed!r})
"""


def prompt_examples(prompt: str) -> list[tuple[str, str]]:
    """The examples written in a prompt, as (source, expected output) pairs: its doctest
    examples, else its written-out ones (``written_examples``)."""
    return doctest_examples(prompt) or written_examples(prompt)


def doctest_examples(prompt: str) -> list[tuple[str, str]]:
    """The ``>>>`` examples: the output is the lines after the source, at its indentation,
    up to a blank line, the next example or a closing fence or docstring (``doctest``'s own
    parser refuses a whole prompt for one such line)."""
    lines, out, i = prompt.splitlines(), [], 0
    while i < len(lines):
        found = DOCTEST.match(lines[i])
        i += 1
        if not found:
            continue
        indent, source = found.groups()
        while i < len(lines) and lines[i].startswith(indent + "... "):  # continuation
            source += "\n" + lines[i][len(indent) + 4:]
            i += 1
        want = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent) \
                and not DOCTEST.match(lines[i]) \
                and not lines[i].strip().startswith(("```", '"""', "'''")):
            want.append(lines[i][len(indent):])
            i += 1
        out.append((source.strip() if "\n" not in source else source, "\n".join(want)))
    return out


def written_examples(prompt: str) -> list[tuple[str, str]]:
    """Examples written as ``f(args) <arrow> value`` (the module docstring's arrows), for
    ``f`` defined in the prompt, with literal arguments and a literal value; in prompt
    order, one per line at most (lines over ``MAX_LINE_CHARS`` skipped)."""
    names = set(DEFINED.findall(prompt))
    out = []
    for line in prompt.splitlines():
        if len(line) > MAX_LINE_CHARS:
            continue
        for call in CALLED.finditer(line):
            if call.group(1) in names:
                example = _written(line, call.start(), call.end() - 1)
                if example:
                    out.append(example)
                break
    return out


def _written(line: str, start: int, paren: int) -> tuple[str, str] | None:
    end = _closing(line, paren)
    if end is None:
        return None
    call = line[start:end]
    try:
        node = ast.parse(call, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # deep nesting too
        return None
    if not isinstance(node, ast.Call) or node.keywords or not all(map(_literal, node.args)):
        return None
    arrow = ARROW.match(line, end)
    if not arrow:
        return None
    want = line[arrow.end():].strip().removesuffix('"""').removesuffix("'''").strip()
    if "..." in want:  # `[0, 1, ..., 4]`: an abbreviation, not the value Ellipsis
        return None
    for text in (want.rstrip(".,;"), want):  # a sentence's full stop is not part of it
        text = BOOLEANS.get(text.lower(), text)
        if text and _literal(text):
            return call, text
    return None


def _closing(line: str, open_at: int) -> int | None:
    """The index after the parenthesis that closes the one at ``open_at`` (None: none on
    this line). Parentheses inside string literals are rare enough in examples to count."""
    depth = 0
    for j in range(open_at, len(line)):
        depth += {"(": 1, ")": -1}.get(line[j], 0)
        if depth == 0:
            return j + 1
    return None


def _literal(node: ast.AST | str) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def examples_pass(prompt: str, answer: str,
                  timeout_s: float = EXAMPLES_TIMEOUT_S) -> bool | None:
    """Does the answer's code pass the examples written in the prompt (what a router can
    run without the hidden tests)?

    The program is the prompt's code blocks (imports, the stub), then the answer's code
    blocks (or the whole answer when it has none), then each example: its value must equal
    the expected output read as a Python value (else its text: ``repr`` or ``str``), or
    be True (``f(x) == y`` written without an output line); all of it run in
    ``sandbox.run_python`` within ``timeout_s`` seconds. (A few HumanEval examples are
    themselves wrong, e.g. HumanEval/47's median 15.0: such an item always fails.)

    Returns:
        True when every example passes; False when one fails, raises, or the program does
        not finish in time; None when the prompt has no examples.
    """
    examples = prompt_examples(prompt)
    if not examples:
        return None
    code = FENCE.findall(answer) or [answer]
    program = "\n".join([*FENCE.findall(prompt), *code]) + RUNNER.format(examples=examples,
                                                                        passed=PASSED)
    result = run_python(program, timeout_s=timeout_s)
    return result.ok and result.stdout_tail.rstrip().endswith(PASSED)


def wrong_steps(answer: str) -> list[str]:
    """The steps ``a op b [op c ...] = r`` of an answer whose ``r`` is not the left side's
    value rounded to ``r``'s decimals (operator precedence as in Python; a division by zero
    is wrong). Not read: lines over ``MAX_LINE_CHARS``, lines that speak of another
    arithmetic or of a mistake (integer division, modulo, "not", "wrong", ...), times
    (10:30), ranges (9-5), numbers written with spaces or dots between thousands, a result
    followed by a unit of the clock or by "remainder", a question. ``[]`` when every step read
    adds up, or none was read."""
    wrong = []
    lines = (line for line in answer.splitlines()
             if len(line) <= MAX_LINE_CHARS and not _ASIDE.search(line))
    for line, found in ((line, f) for line in lines for f in STEP.finditer(line)):
        if _CHAIN_BEFORE.search(line, 0, found.start()):
            continue  # the last operations of a longer chain: not a step of its own
        step = found.group(0)
        readings = [step]  # 1.000 + 500 = 1.500 may be thousands: wrong only read both ways
        if _DOTTED_THOUSANDS.search(step):
            readings.append(_DOTTED_THOUSANDS.sub(lambda t: t.group(0).replace(".", ""), step))
        if all(_adds_up(reading) is False for reading in readings):
            wrong.append(step.strip())
    return wrong


def _adds_up(step: str) -> bool | None:
    """Whether ``left = result`` holds to the result's decimals; None when unreadable."""
    left, result = step.rsplit("=", 1)
    expression = _DIVIDE.sub("/", _TIMES.sub("*", left)).replace("−", "-").replace(",", "")
    try:
        value = eval(compile(ast.parse(expression.strip(), mode="eval"), "<step>", "eval"),
                     {"__builtins__": {}})
        result = result.strip().replace(",", "")
        off = abs(value - float(result)) - 0.5 * 10 ** -len(result.partition(".")[2])
    except ZeroDivisionError:
        return False
    except (SyntaxError, ValueError, TypeError, OverflowError, MemoryError, RecursionError):
        return None
    return off <= 1e-9 * max(1.0, abs(value))  # rounded half up or half even


def refutation(prompt: str, answer: str,
               timeout_s: float = EXAMPLES_TIMEOUT_S) -> str | None:
    """Why ``answer`` is proven wrong: ``WRONG_ARITHMETIC`` (``wrong_steps``, checked first:
    no process), ``FAILED_EXAMPLES`` (``examples_pass`` is False), or None (not refuted)."""
    if wrong_steps(answer):
        return WRONG_ARITHMETIC
    if examples_pass(prompt, answer, timeout_s) is False:
        return FAILED_EXAMPLES
    return None
