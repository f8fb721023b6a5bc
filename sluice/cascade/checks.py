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
ARROW = re.compile(r"[ \t]*(?:==>|=>|==|➞|->|→|=|#[ \t]*=>|#[ \t]*returns?|returns?|"
                   r"should[ \t]+return)[ \t]*", re.I)
BOOLEANS = {"true": "True", "false": "False"}
EXAMPLES_TIMEOUT_S = 10.0
FAILED_EXAMPLES, WRONG_ARITHMETIC = "failed-examples", "wrong-arithmetic"  # refutations
MAX_LINE_CHARS = 500  # longer lines hold no example or step worth reading: skipped
MAX_STEP_OPERATIONS = 16  # a longer chain is skipped (and the step regex stays linear)

_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_OPERATOR = r"(?:\+|-|−|\*|×|x|\\times|\\cdot|·|/|÷|\\div)"
STEP = re.compile(rf"(?<![\w^.)\]/*+\-−]){_NUMBER}"
                  rf"(?:[ \t]*{_OPERATOR}[ \t]*{_NUMBER}){{1,{MAX_STEP_OPERATIONS}}}"
                  rf"[ \t]*=[ \t]*({_NUMBER})(?![\d.]*(?:[ \t]*{_OPERATOR}|[\w^(%]))")
_CHAIN_BEFORE = re.compile(rf"{_OPERATOR}[ \t]*$")  # a match there is the tail of a chain
_TIMES = re.compile(r"\\times|\\cdot|×|·|(?<=\d)[ \t]*x[ \t]*(?=[\d-])")
_DIVIDE = re.compile(r"\\div|÷")

RUNNER = """

def _passes(_source, _want):
    try:
        _got = eval(_source)
    except SyntaxError:  # a statement: it passes when it runs
        exec(_source)
        return True
    if not _want:  # `f(x) == y` written without an output line
        return _got is True or _got is None
    try:
        return _got == eval(_want)  # '21' and "21" are one answer
    except Exception:
        return repr(_got) == _want or str(_got) == _want

_failed = 0
for _source, _want in {examples!r}:
    try:
        _failed += not _passes(_source, _want)
    except Exception:
        _failed += 1
raise SystemExit(1 if _failed else 0)
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
        want = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent) \
                and not DOCTEST.match(lines[i]) \
                and not lines[i].strip().startswith(("```", '"""', "'''")):
            want.append(lines[i][len(indent):])
            i += 1
        out.append((source.strip(), "\n".join(want)))
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
        for name in names:
            example = _written(line, name)
            if example:
                out.append(example)
                break
    return out


def _written(line: str, name: str) -> tuple[str, str] | None:
    start = line.find(name + "(")
    while start > 0 and (line[start - 1].isalnum() or line[start - 1] in "_."):
        start = line.find(name + "(", start + 1)  # `f(` inside another name
    if start < 0:
        return None
    end = _closing(line, start + len(name))
    if end is None:
        return None
    call = line[start:end]
    try:
        node = ast.parse(call, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.keywords or not all(map(_literal, node.args)):
        return None
    arrow = ARROW.match(line, end)
    if not arrow:
        return None
    want = line[arrow.end():].strip()
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
    program = "\n".join([*FENCE.findall(prompt), *code]) + RUNNER.format(examples=examples)
    return run_python(program, timeout_s=timeout_s).ok


def wrong_steps(answer: str) -> list[str]:
    """The steps ``a op b [op c ...] = r`` of an answer whose ``r`` is not the left side's
    value rounded to ``r``'s decimals (operator precedence as in Python; a division by zero
    is wrong; lines over ``MAX_LINE_CHARS`` skipped). ``[]`` when every step read adds up,
    or none was read."""
    wrong = []
    lines = (line for line in answer.splitlines() if len(line) <= MAX_LINE_CHARS)
    for line, found in ((line, f) for line in lines for f in STEP.finditer(line)):
        if _CHAIN_BEFORE.search(line, 0, found.start()):
            continue  # the last operations of a longer chain: not a step of its own
        step = found.group(0)
        left, result = step.rsplit("=", 1)
        expression = _DIVIDE.sub("/", _TIMES.sub("*", left)).replace("−", "-").replace(",", "")
        try:
            value = eval(compile(ast.parse(expression.strip(), mode="eval"), "<step>", "eval"),
                         {"__builtins__": {}})
        except ZeroDivisionError:
            wrong.append(step.strip())
            continue
        except (SyntaxError, ValueError, TypeError, OverflowError, MemoryError):
            continue
        result = result.strip().replace(",", "")
        decimals = len(result.partition(".")[2])
        if round(value, decimals) != float(result):
            wrong.append(step.strip())
    return wrong


def refutation(prompt: str, answer: str,
               timeout_s: float = EXAMPLES_TIMEOUT_S) -> str | None:
    """Why ``answer`` is proven wrong: ``WRONG_ARITHMETIC`` (``wrong_steps``, checked first:
    no process), ``FAILED_EXAMPLES`` (``examples_pass`` is False), or None (not refuted)."""
    if wrong_steps(answer):
        return WRONG_ARITHMETIC
    if examples_pass(prompt, answer, timeout_s) is False:
        return FAILED_EXAMPLES
    return None
