"""The cascade's recorded answers: one JSONL line per (item, tier), written by
``sluice.cascade.recorder`` and replayed by ``sluice.cascade.calibrate``.

A line::

    {"id": "HumanEval/3", "kind": "code", "tier": "qwen-0-5b", "correct": true,
     "scores": {"q": 0.1, "quantile": -0.41, "min": -2.3, "mean": -0.08, "entropy": 0.12,
                "tokens": 87},
     "logprobs": [-0.0012, ...], "prompt_tokens": 140, "completion_tokens": 87,
     "answer": "...", "seconds": 6.2, "prompt": "..."}

``scores`` are ``policy.answer_scores`` at quantile ``q``; ``logprobs`` (natural log, 4
decimals) let any other quantile be replayed; ``prompt`` is the text the router's pre-route
sees (the user message), for ``fit_pre_route``; ``examples`` (code) says whether the answer
passes the examples its prompt writes down (``sluice.cascade.checks``), the code-execution
check.

Lines are appended one at a time and flushed, so a crash tears at most the last line, which
reading skips (and a resumed recording redoes).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sluice.cascade.checks import FAILED_EXAMPLES, WRONG_ARITHMETIC, wrong_steps
from sluice.cascade.policy import Scores, answer_scores

logger = logging.getLogger(__name__)

DEFAULT_QUANTILE = 0.1  # CascadeEscalationSpec.quantile's default


@dataclass(frozen=True)
class Record:
    """One tier's answer to one item.

    Attributes:
        id, kind: the ``evalset.Item``'s.
        tier: the InferenceService that answered.
        correct: ``evalset.check`` on the answer.
        scores: ``answer_scores`` at quantile ``q`` of the answer's token logprobs.
        q: the quantile ``scores.quantile`` was taken at.
        logprobs: the generated tokens' logprobs (natural log), for other quantiles.
        prompt_tokens, completion_tokens: the response's ``usage``.
        answer: the answer's text (first 2,000 characters).
        seconds: the request's wall time.
        prompt: the text the router's pre-route reads ("" when not recorded).
        examples: for code, ``checks.examples_pass``: whether the answer passes the
            examples its prompt writes (None: not code, no examples, or not recorded).
        max_tokens: the completion-token limit the answer was asked with (None: recorded
            before it was kept, with the recorder's defaults).
    """

    id: str
    kind: str
    tier: str
    correct: bool
    scores: Scores
    q: float
    logprobs: tuple[float, ...]
    prompt_tokens: int
    completion_tokens: int
    answer: str = ""
    seconds: float = 0.0
    prompt: str = ""
    examples: bool | None = None
    max_tokens: int | None = None

    def score(self, signal: str, quantile: float = DEFAULT_QUANTILE,
              prefix_tokens: int | None = None) -> float:
        """The signal's score; a quantile other than ``q`` is recomputed from ``logprobs``.
        ``checks`` is the logprob quantile, and -inf (escalates at any threshold) for an
        answer a check refutes (``refuted``; ``Scores.signal``).

        Args:
            prefix_tokens: score only the answer's first K tokens, as the router's ``prefix``
                streaming mode does (None: the whole answer, ``buffer`` mode and plain
                answers).

        Raises:
            ValueError: ``checks`` with ``prefix_tokens`` (a check needs the whole answer).
        """
        if signal == "checks":
            if prefix_tokens is not None:
                raise ValueError("the checks signal judges whole answers (it runs their "
                                 "code): it has no prefix mode")
            return replace(self.scores, quantile=self.score("logprob-quantile", quantile),
                           refuted=self.refuted()).signal(signal)
        if prefix_tokens is not None:
            return answer_scores(self.logprobs[:prefix_tokens], q=quantile).signal(signal)
        if signal == "logprob-quantile" and not math.isclose(quantile, self.q):
            return answer_scores(self.logprobs, q=quantile).quantile
        return self.scores.signal(signal)

    def refuted(self) -> str | None:
        """``checks.refutation`` of the answer, with the code examples' result as recorded
        (``examples``: the recorder ran them on the whole answer)."""
        if wrong_steps(self.answer):
            return WRONG_ARITHMETIC
        return FAILED_EXAMPLES if self.examples is False else None

    def escalation_tokens(self, prefix_tokens: int | None = None) -> int:
        """Tokens paid for this answer when it escalates: the prompt and what was generated
        before the decision (all of it; in ``prefix`` mode at most the first K, after which
        the router closes the stream and the worker aborts it)."""
        made = self.completion_tokens
        return self.prompt_tokens + (made if prefix_tokens is None else min(made, prefix_tokens))

    def to_json(self) -> dict:
        out = asdict(self)
        scores = out["scores"]
        del scores["refuted"]  # replayed from ``examples`` and ``answer`` (``refuted()``)
        out["scores"] = {"q": out.pop("q"), **scores}
        out["logprobs"] = [round(lp, 4) for lp in self.logprobs]
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> Record:
        """Raises KeyError/TypeError/ValueError on a malformed line."""
        s = dict(data["scores"])
        q = float(s.pop("q", DEFAULT_QUANTILE))
        for name in ("answer", "prompt"):
            if not isinstance(data.get(name, ""), str):
                raise TypeError(f"{name} is not text")
        return cls(str(data["id"]), str(data["kind"]), str(data["tier"]), bool(data["correct"]),
                   Scores(**s), q, tuple(float(x) for x in data["logprobs"]),
                   int(data["prompt_tokens"]), int(data["completion_tokens"]),
                   data.get("answer", ""), float(data.get("seconds", 0.0)),
                   data.get("prompt", ""), data.get("examples"),
                   None if data.get("max_tokens") is None else int(data["max_tokens"]))


def _lines(path: Path) -> Iterable[tuple[int, dict]]:
    """(line number, parsed object) of a JSONL file; a line that is not JSON (a torn write,
    after a crash) is skipped with a warning.

    Raises:
        ValueError: a line that is JSON but not an object, or a file that is not UTF-8 text
            (naming the file and line).
    """
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError:
                    logger.warning("%s:%d: not JSON, skipped (a torn write?)", path, n)
                    continue
                if not isinstance(data, dict):
                    raise ValueError(f"{path}:{n}: not a record (a JSON object): {line[:80]!r}")
                yield n, data
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def load_records(path: str | Path) -> list[Record]:
    """Every record of a JSONL file, in file order (a later duplicate wins in ``Replay``).

    Raises:
        ValueError: a line that is not a record (naming the file, the line and what is
            wrong), or a file that is not UTF-8 text.
    """
    records = []
    for n, data in _lines(Path(path)):
        try:
            records.append(Record.from_json(data))
        except (KeyError, TypeError, ValueError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise ValueError(f"{path}:{n}: not a record ({what})") from None
    return records


def done_pairs(path: str | Path) -> set[tuple[str, str]]:
    """The (item id, tier) pairs already recorded in ``path`` (empty if it does not exist):
    what a resumed ``record`` skips."""
    return {(str(d["id"]), str(d["tier"])) for _, d in _lines(Path(path))
            if "id" in d and "tier" in d}
