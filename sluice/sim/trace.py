"""Request traces: arrival times and token counts, and Mooncake's prefix-block ids.

Formats (see ../shared/traces/README.md):

- Azure LLM inference 2023 CSV: ``TIMESTAMP`` (wall clock, 100 ns digits), ``ContextTokens``
  (prompt), ``GeneratedTokens`` (output). No prefix information.
- Mooncake JSONL: ``timestamp`` (ms from the start), ``input_length``, ``output_length``,
  ``hash_ids`` (one id per 512-token prompt block; equal ids are a shareable prefix).

``scale(trace, k)`` multiplies the load without compressing time: each request is kept and
``k − 1`` copies arrive within a second after it (uniform jitter, seeded); each copy's block
ids are its own (in copy ``c``, 0 the original, id ``h`` becomes ``h·k + c``), so copies
share prefixes among themselves as the original requests do, not with each other.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from sluice.bench.workload import MOONCAKE_BLOCK_TOKENS, read_trace


@dataclass
class Trace:
    """Requests sorted by arrival, as parallel lists (one entry per request).

    Attributes:
        arrival_s: seconds from the trace's first arrival.
        prompt: prompt tokens (≥ 1).
        output: output tokens (≥ 1).
        blocks: prefix-block ids per request (empty tuples without prefix information).
        block_tokens: tokens per prefix block (512 for Mooncake).
    """

    arrival_s: list[float]
    prompt: list[int]
    output: list[int]
    blocks: list[tuple[int, ...]]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def span_s(self) -> float:
        return self.arrival_s[-1] - self.arrival_s[0] if self.arrival_s else 0.0


def load(path: str | Path, limit: int | None = None) -> Trace:
    """Read an Azure 2023 CSV or a Mooncake JSONL trace (by extension); ``limit``: the first
    requests only (``sluice.bench.workload.read_trace``).

    Raises:
        OSError: the file cannot be read.
        ValueError: an unknown extension, no requests or a malformed row.
    """
    if Path(path).suffix not in (".csv", ".jsonl"):
        raise ValueError(f"{path}: unknown trace format (want .csv or .jsonl)")
    rows = read_trace(path, limit)
    return Trace([r.arrival_s for r in rows], [r.input_tokens for r in rows],
                 [r.output_tokens for r in rows], [r.hash_ids for r in rows])


def without_too_large(trace: Trace, limit_tokens: int) -> tuple[Trace, list[int]]:
    """Leave out the requests a replica never serves: prompt + output tokens over
    ``limit_tokens`` (its context length, or its whole KV pool when that is smaller). The
    worker refuses those with a 400 whatever the fleet (``check_fits``, the native engine's
    ``check_request``), so they say nothing about autoscaling.

    Returns:
        the trace without them, and their indices in ``trace`` (arrival order).
    """
    large = [i for i, (p, o) in enumerate(zip(trace.prompt, trace.output))
             if p + o > limit_tokens]
    if not large:
        return trace, large
    out = set(large)
    keep = [i for i in range(len(trace)) if i not in out]

    def pick(column: list) -> list:
        return [column[i] for i in keep]
    return Trace(pick(trace.arrival_s), pick(trace.prompt), pick(trace.output),
                 pick(trace.blocks), trace.block_tokens), large


MAX_REQUESTS = 20_000_000  # a scaled trace's requests (1M take ~220 MiB of RSS in all)


def scale(trace: Trace, k: int, seed: int = 0) -> Trace:
    """``k`` times the requests, each copy within 1 s after its original (see the module
    docstring); k = 1 returns ``trace``.

    Raises ValueError for k < 1, or more than ``MAX_REQUESTS`` requests in all (they are
    held in memory: 10^9 of them grew by ~290 MiB a second until the machine ran out).
    """
    if k < 1:
        raise ValueError("scale needs k ≥ 1")
    if len(trace.arrival_s) * k > MAX_REQUESTS:
        raise ValueError(f"--scale-requests {k} makes {len(trace.arrival_s) * k:,} requests; "
                         f"at most {MAX_REQUESTS:,} fit in memory")
    if k == 1:
        return trace
    rng = random.Random(seed)
    rows = []
    for t, p, o, b in zip(trace.arrival_s, trace.prompt, trace.output, trace.blocks):
        for c in range(k):
            rows.append((t + (rng.random() if c else 0.0), p, o, tuple(h * k + c for h in b)))
    rows.sort(key=lambda r: r[0])
    return Trace([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                 [r[3] for r in rows], trace.block_tokens)
