"""What `sluice bench` sends: prompts cut to exact token counts, length distributions, and
workloads from a JSONL file or a public trace (/work/shared/traces formats).

Every generator is deterministic for a seed. Token counts are the model's own tokenizer's
(``tokenizer.json`` through the ``tokenizers`` library, no special tokens added), so a
synthetic prompt of 128 tokens is 128 tokens to that model's /v1/completions (the chat
endpoint adds its template around it).
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from sluice.bench.corpus import SONNETS

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_TOKENS = 512  # the Mooncake traces' hash_ids block size
MAX_LENGTH_TOKENS = 1_000_000  # a synthetic prompt or output longer than any context


@dataclass(frozen=True)
class RequestSpec:
    """One request to send.

    Attributes:
        prompt: the prompt text (the user message on the chat endpoint).
        max_tokens: output tokens asked for (exact with ignore_eos).
        input_tokens: tokens in ``prompt`` by the bench's tokenizer.
        arrival_s: offset from the run start for open-loop/trace replay, else None.
        group: shared-prefix group, or None.
    """

    prompt: str
    max_tokens: int
    input_tokens: int
    arrival_s: float | None = None
    group: int | None = None


class Tokenizer:
    """The model's tokenizer from its ``tokenizer.json`` (no special tokens on encode).

    Raises:
        ValueError: ``path`` is not a readable tokenizer.json.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HFTokenizer

        self.path = Path(path)
        try:
            self._tk = _HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # the tokenizers library raises bare Exceptions
            raise ValueError(f"{path}: not a readable tokenizer.json ({exc})") from None

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tk.decode(ids, skip_special_tokens=True)

    def count(self, text: str) -> int:
        return len(self.encode(text))


def resolve_tokenizer(tokenizer: str | None, model: str) -> Path:
    """``tokenizer.json`` for ``--tokenizer`` (a file, a model folder or a store name), or,
    when it is not given, for ``--model`` as a model-store name.

    Raises:
        ValueError: nothing found; the message says what to pass.
    """
    from sluice.models import store

    ref = tokenizer or model
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if ref.strip().lower() in store.REGISTRY:
        candidate = store.model_dir(ref.strip()) / "tokenizer.json"
        if candidate.is_file():
            return candidate
        raise ValueError(f"{candidate} is missing; run: sluice models fetch {ref.strip()}")
    raise ValueError(f"no tokenizer for {ref!r}: pass --tokenizer with a tokenizer.json, a "
                     "model folder, or a model-store name")


# --------------------------------------------------------------------------- lengths


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``fixed:N``, ``uniform:LO:HI`` (inclusive) or
    ``normal:MEAN:STD`` (rounded, clamped to ≥ 1)."""

    kind: str
    a: int
    b: float = 0.0

    @property
    def text(self) -> str:
        """The distribution as ``parse`` reads it."""
        return f"{self.kind}:{self.a}" + ("" if self.kind == "fixed" else f":{self.b:g}")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.split(":")
        try:
            if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
                dist = cls("fixed", int(parts[-1]))
            elif parts[0] == "uniform" and len(parts) == 3:
                dist = cls("uniform", int(parts[1]), int(parts[2]))
            elif parts[0] == "normal" and len(parts) == 3:
                dist = cls("normal", int(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad length distribution {text!r}: use N, fixed:N, "
                             "uniform:LO:HI or normal:MEAN:STD") from None
        if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or not dist.b >= 0:
            raise ValueError(f"bad length distribution {text!r}: lengths must be ≥ 1")
        if max(dist.a, dist.b) > MAX_LENGTH_TOKENS or not math.isfinite(dist.b):
            raise ValueError(f"bad length distribution {text!r}: lengths must be at most "
                             f"{MAX_LENGTH_TOKENS:,} tokens")
        return dist

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.randint(self.a, int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))


# --------------------------------------------------------------------------- prompts


class PromptBuilder:
    """Prompts of an exact token count, cut from random lines of real text.

    A prompt is random corpus lines joined and cut to ``n`` tokens; the cut is checked by
    re-encoding, and another draw is tried when a cut does not round-trip (a merge at the
    cut). Random lines, not one long window, so that two prompts share a leading KV block
    only when they are meant to (shared-prefix groups).
    """

    ATTEMPTS = 20

    def __init__(self, tokenizer: Tokenizer, corpus: str = SONNETS):
        self.tok = tokenizer
        self.lines = [line.strip() + "\n" for line in corpus.splitlines() if line.strip()]
        self.line_tokens = [tokenizer.count(line) for line in self.lines]

    def text(self, n: int, rng: random.Random) -> str:
        """A text of exactly ``n`` tokens (n ≥ 1)."""
        for _ in range(self.ATTEMPTS):
            parts, count = [], 0
            while count < n + 2:
                i = rng.randrange(len(self.lines))
                parts.append(self.lines[i])
                count += self.line_tokens[i]
            candidate = self.tok.decode(self.tok.encode("".join(parts))[:n])
            if self.tok.count(candidate) == n:
                return candidate
        raise ValueError(f"could not cut a {n}-token text in {self.ATTEMPTS} draws")

    def prefix(self, n: int, rng: random.Random) -> str:
        """A text of exactly ``n`` tokens ending in a newline, so that any text appended
        after it starts a new pre-token and leaves these ``n`` tokens unchanged."""
        for _ in range(self.ATTEMPTS):
            candidate = (self.text(n - 1, rng) if n > 1 else "") + "\n"
            if self.tok.count(candidate) == n and not candidate.endswith("\n\n"):
                return candidate
        raise ValueError(f"could not cut a {n}-token prefix in {self.ATTEMPTS} draws")

    def with_prefix(self, prefix: str, n: int, rng: random.Random) -> str:
        """``prefix`` + a suffix, ``n`` tokens in all, whose first tokens are exactly the
        prefix's own tokens."""
        prefix_ids = self.tok.encode(prefix)
        if n <= len(prefix_ids):
            raise ValueError(f"input length {n} must exceed the prefix ({len(prefix_ids)})")
        for _ in range(self.ATTEMPTS):
            full = prefix + self.text(n - len(prefix_ids), rng)
            ids = self.tok.encode(full)
            if len(ids) == n and ids[:len(prefix_ids)] == prefix_ids:
                return full
        raise ValueError(f"could not extend the prefix to {n} tokens in {self.ATTEMPTS} draws")


def synthetic(builder: PromptBuilder, input_len: LengthDist, output_len: LengthDist,
              seed: int = 0, prefix_groups: int = 0, prefix_tokens: int = 0
              ) -> Iterator[RequestSpec]:
    """An endless, deterministic stream of synthetic requests.

    With ``prefix_groups`` G > 0, request i belongs to group ``i % G`` and starts with that
    group's ``prefix_tokens``-token prefix (multi-tenant system prompts); its input length
    is then ``prefix_tokens`` + a sampled suffix length.
    """
    rng = random.Random(seed)
    prefixes = []
    if prefix_groups > 0:
        if prefix_tokens < 1:
            raise ValueError("--prefix-groups needs --prefix-tokens ≥ 1")
        prefixes = [builder.prefix(prefix_tokens, random.Random(f"{seed}:prefix:{g}"))
                    for g in range(prefix_groups)]
    for i in itertools.count():
        n_in, n_out = input_len.sample(rng), output_len.sample(rng)
        if prefixes:
            group = i % prefix_groups
            prompt = builder.with_prefix(prefixes[group], prefix_tokens + n_in, rng)
            yield RequestSpec(prompt, n_out, prefix_tokens + n_in, group=group)
        else:
            yield RequestSpec(builder.text(n_in, rng), n_out, n_in)


def from_jsonl(path: str | Path, tokenizer: Tokenizer, default_max_tokens: int
               ) -> list[RequestSpec]:
    """Requests from a JSONL file: ``{"prompt": str, "max_tokens": int}`` per line
    (``max_tokens`` optional). Blank lines are skipped; a bad line raises ValueError."""
    specs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
            max_tokens = int(item.get("max_tokens") or default_max_tokens)
            if not isinstance(prompt, str) or max_tokens < 1:
                raise TypeError
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: expected {{\"prompt\": str, \"max_tokens\": "
                             f"int}} ({type(exc).__name__})") from None
        specs.append(RequestSpec(prompt, max_tokens, tokenizer.count(prompt)))
    if not specs:
        raise ValueError(f"{path}: no requests")
    return specs


# --------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class TraceRow:
    """One trace request: arrival offset (s), token lengths, Mooncake prefix-block ids."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """An Azure LLM inference 2023 CSV (``.csv``: TIMESTAMP, ContextTokens, GeneratedTokens)
    or a Mooncake JSONL trace (otherwise: timestamp in ms, input_length, output_length,
    hash_ids); sorted by arrival, offsets from the first; lengths at least 1.

    Args:
        path: the trace file.
        limit: read only the file's first ``limit`` requests.

    Raises:
        OSError: the file cannot be read.
        ValueError: no requests, a missing column, or a malformed row (named by its line).
    """
    path = Path(path)
    try:
        rows = _read_rows(path, limit)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a text trace ({exc.reason} at byte {exc.start})") from None
    if not rows:
        raise ValueError(f"{path}: empty trace")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [TraceRow(t - t0, max(1, i), max(1, o), h) for t, i, o, h in rows]


def _read_rows(path: Path, limit: int | None) -> list[tuple[float, int, int, tuple[int, ...]]]:
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    with open(path, newline="") as f:
        if path.suffix == ".csv":
            reader = csv.DictReader(f)
            missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or ())]
            if missing and reader.fieldnames:
                raise ValueError(f"{path}: an Azure 2023 CSV needs the columns "
                                 f"{', '.join(AZURE_COLUMNS)}; {', '.join(missing)} missing")
            lines = ((reader.line_num, r) for r in reader)
            parse = _azure_row
        else:
            lines = ((n, line) for n, line in enumerate(f, 1) if line.strip())
            parse = _mooncake_row
        for n, raw in itertools.islice(lines, limit):
            try:
                rows.append(parse(raw))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ValueError(f"{path}:{n}: a malformed request ({what})") from None
    return rows


def _azure_row(r: dict) -> tuple[float, int, int, tuple[int, ...]]:
    if None in r.values():
        raise ValueError(f"{len(AZURE_COLUMNS)} columns wanted, fewer given")
    return (_azure_time(r["TIMESTAMP"]),
            *_counts(int(r["ContextTokens"]), int(r["GeneratedTokens"])), ())


def _mooncake_row(line: str) -> tuple[float, int, int, tuple[int, ...]]:
    r = json.loads(line)
    return (r["timestamp"] / 1000.0, *_counts(int(r["input_length"]), int(r["output_length"])),
            tuple(r.get("hash_ids") or ()))


def _counts(prompt: int, output: int) -> tuple[int, int]:
    if prompt < 0 or output < 0:
        raise ValueError(f"a negative token count ({prompt} in, {output} out)")
    return prompt, output


def _azure_time(text: str) -> float:
    """``2023-11-16 18:17:03.9799600`` → POSIX seconds (strptime takes ≤ 6 fraction digits)."""
    head, _, frac = text.strip().partition(".")
    return datetime.strptime(f"{head}.{(frac or '0')[:6]}", "%Y-%m-%d %H:%M:%S.%f").timestamp()


def from_trace(rows: list[TraceRow], builder: PromptBuilder, time_scale: float = 1.0,
               seed: int = 0, max_input_tokens: int | None = None,
               max_output_tokens: int | None = None) -> Iterator[RequestSpec]:
    """Trace rows → requests with ``arrival_s = offset × time_scale`` (0.5 = twice the rate;
    the burst shape is kept). Rows with ``hash_ids`` (Mooncake) get one fixed text per block
    id, so requests that share leading ids share those prompt tokens; other rows get
    independent prompts. The caps clamp lengths (a different workload: say so in reports)."""
    block = lru_cache(maxsize=4096)(
        lambda h: builder.prefix(MOONCAKE_BLOCK_TOKENS, random.Random(f"{seed}:block:{h}")))
    for i, row in enumerate(rows):
        n_in = min(row.input_tokens, max_input_tokens or row.input_tokens)
        n_out = min(row.output_tokens, max_output_tokens or row.output_tokens)
        rng = random.Random(f"{seed}:row:{i}")
        if row.hash_ids:
            text = "".join(block(h) for h in row.hash_ids[:-(-n_in // MOONCAKE_BLOCK_TOKENS)])
            prompt = builder.tok.decode(builder.tok.encode(text)[:n_in])
        else:
            prompt = builder.text(n_in, rng)
        yield RequestSpec(prompt, n_out, builder.tok.count(prompt),
                          arrival_s=row.arrival_s * time_scale)
