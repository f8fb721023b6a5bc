"""`sluice profile --steps`: the native engine's step time over a grid of batch shapes, fitted
to the simulator's replica model::

    step_ms ≈ c0_ms + prefill_token_ms·prefill_tokens + decode_seq_ms·decode_seqs
                    + kv_token_ms·kv_tokens

A step is one ``LLMEngine.step()``: schedule → forward pass → sample → detokenize → stop
checks, the call a worker's engine thread makes in a loop (``AsyncEngine``). Measuring it
in-process drives the same engine code a worker runs, with the worker's default
``EngineConfig`` and its thread count, minus HTTP and asyncio, which happen outside the step.

The shape of a step, as recorded from the batch the scheduler actually handed the model:

- ``prefill_tokens``: tokens of the runs longer than one token (prefill chunks);
- ``decode_seqs``: runs of one token (decodes; the model runner's batched decode path);
- ``kv_tokens``: the KV tokens the step's attention reads, Σ over runs of (tokens already
  computed + tokens of the run).

Each grid point is set up with the real scheduler and block pool, but with the forward pass
stubbed out (zero logits): decoding sequences are "prefilled" to their context, and a
prefill chunk's context is a prefix-cache hit on a prompt stubbed the same way. The K/V
then hold zeros, which costs the model the same as real values. Then the point's step runs
for real ``repeats`` times (after two cheap warm-up steps for the whole grid); the point's
time is the median of the steps' CPU time ÷ threads (``StepProbe.measure``), so the other
processes of a shared machine do not stretch it.

The model is linear: a prefill chunk's attention over its cached context (query tokens ×
context tokens) has no term of its own and falls on ``kv_token_ms``, which decode steps
also set, so chunks late in a long prompt come out faster than measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """A grid point to set up: ``prefill_seqs`` chunks of ``prefill_len`` tokens, each
    over ``prefill_ctx`` cached tokens (a multiple of the block size), beside
    ``decode_seqs`` decoding sequences that attend over ``decode_ctx`` tokens each."""

    prefill_seqs: int = 0
    prefill_len: int = 0
    prefill_ctx: int = 0
    decode_seqs: int = 0
    decode_ctx: int = 0

    def kv_tokens(self) -> int:
        """KV tokens the step holds in the pool (tokens, before its own decodes advance)."""
        return (self.prefill_seqs * (self.prefill_ctx + self.prefill_len)
                + self.decode_seqs * self.decode_ctx)


@dataclass(frozen=True)
class Point:
    """One measured step: its shape (tokens, sequences, tokens) and median time (ms)."""

    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    step_ms: float


@dataclass(frozen=True)
class Fit:
    """The linear step-time model; coefficients in ms, ms per token, ms per sequence."""

    c0_ms: float
    prefill_token_ms: float
    decode_seq_ms: float
    kv_token_ms: float

    def predict(self, prefill_tokens: float, decode_seqs: float, kv_tokens: float) -> float:
        """Step time (ms) of a step of this shape."""
        return (self.c0_ms + self.prefill_token_ms * prefill_tokens
                + self.decode_seq_ms * decode_seqs + self.kv_token_ms * kv_tokens)


def fit(points: Sequence[Point]) -> Fit:
    """Non-negative least squares on relative error: the coefficients >= 0 that minimise
    Σ ((predicted − measured) / measured)². Relative, so a 50 ms decode step weighs as much
    as a 5 s prefill step (an absolute fit serves the long steps and misses short ones by
    multiples); non-negative, because a step never gets faster with more work (and the
    simulator's ``StepModel`` refuses negative slopes). With four unknowns the exact NNLS
    is a least-squares solve on each of the 15 non-empty sets of free coefficients.

    Raises:
        ValueError: fewer than 4 points, a step_ms <= 0, or shapes that do not determine
            the four coefficients (e.g. no decode point).
    """
    import itertools

    import numpy as np

    if len(points) < 4 or any(p.step_ms <= 0 for p in points):
        raise ValueError("the fit needs >= 4 points with step_ms > 0")
    y = np.array([p.step_ms for p in points])
    x = np.array([[1.0, p.prefill_tokens, p.decode_seqs, p.kv_tokens] for p in points]) / y[:, None]
    if np.linalg.matrix_rank(x) < 4:
        raise ValueError("the points' shapes do not determine the four coefficients")
    best, best_cost = None, float("inf")
    for k in range(1, 5):
        for free in map(list, itertools.combinations(range(4), k)):
            coef = np.zeros(4)
            coef[free] = np.linalg.lstsq(x[:, free], np.ones(len(y)), rcond=None)[0]
            cost = float(np.sum((x @ coef - 1.0) ** 2))
            if coef.min() >= 0 and cost < best_cost:
                best, best_cost = coef, cost
    return Fit(*(float(c) for c in best))


def r2(points: Sequence[Point], model: Fit) -> float:
    """Coefficient of determination of ``model`` on the points' step_ms (1 is exact)."""
    mean = statistics.fmean(p.step_ms for p in points)
    total = sum((p.step_ms - mean) ** 2 for p in points)
    residual = sum((p.step_ms - _predict(model, p)) ** 2 for p in points)
    return 1.0 - residual / total if total else 1.0


def relative_errors(points: Sequence[Point], model: Fit) -> list[float]:
    """Per point, (predicted − measured) / measured (0.1 = the model says 10% slower)."""
    return [(_predict(model, p) - p.step_ms) / p.step_ms for p in points]


def _predict(model: Fit, p: Point) -> float:
    return model.predict(p.prefill_tokens, p.decode_seqs, p.kv_tokens)


def default_grid(chunk: int, break_even: float, kv_capacity: int) -> list[Shape]:
    """Prefill-only steps of 16..2048 tokens (in chunks of at most ``chunk``, the engine's
    ``long_prefill_token_threshold``, as its scheduler cuts them), chunks over a cached
    context (shrunk as the scheduler shrinks them, by ``1 + ctx / break_even``), decode-only
    steps of 1..64 sequences at several contexts, and mixed steps. Shapes needing more
    than 80% of ``kv_capacity`` (tokens) are left out."""
    shapes = [Shape(-(-n // chunk), n // -(-n // chunk)) for n in (16, 64, 128, 512, 1024, 2048)]
    for ctx, seqs in ((512, 1), (2048, 1), (4096, 1), (1024, 8)):
        shapes.append(Shape(seqs, int(chunk / (1 + ctx / break_even)), ctx))
    for seqs, contexts in ((1, (64, 1024, 4096)), (4, (64, 1024)), (16, (64, 512)),
                           (32, (64, 256)), (64, (32, 128))):
        shapes += [Shape(decode_seqs=seqs, decode_ctx=ctx) for ctx in contexts]
    shapes += [Shape(4, chunk, 0, 16, 256), Shape(1, chunk, 0, 32, 128),
               Shape(8, chunk, 0, 4, 1024), Shape(1, int(chunk / (1 + 1024 / break_even)),
                                                  1024, 8, 512)]
    return [s for s in shapes if s.kv_tokens() <= 0.8 * kv_capacity]


# four cheap points (tests); their first and last warm the engine up before a grid
TINY_GRID = [Shape(1, 16), Shape(1, 32), Shape(decode_seqs=1, decode_ctx=32),
             Shape(decode_seqs=2, decode_ctx=128)]


class StepProbe:
    """Sets up and times grid points on one engine (an ``LLMEngine``).

    While it is open, the engine's ``runner.execute`` is wrapped: each forward pass's runs
    are recorded as (run length, tokens computed before it), and inside ``_stubbed()`` the
    model is skipped (zero logits). ``close()`` restores the runner.
    """

    def __init__(self, engine, threads: int, seed: int = 0):
        self.engine = engine
        self.threads = threads
        self.wall_over_cpu: list[float] = []  # per timed step: > 1 when it waited for a core
        self.rng = random.Random(seed)
        self.vocab = engine.runner.model.lm_head.weight.shape[0]
        self.runs: list[list[tuple[int, int]]] = []  # per forward pass since the last clear
        self._stub = False
        self._execute = engine.runner.execute
        engine.runner.execute = self._recorded

    def close(self) -> None:
        self._clear()
        del self.engine.runner.execute  # the class's method again

    def measure(self, shape: Shape, repeats: int = 3, warmup: int = 0) -> Point:
        """Run ``shape``'s step ``warmup + repeats`` times; the median of the timed ones.
        Its KV tokens are the median recorded (decodes grow by a token per repeat).

        A step's time is the process's CPU time over it ÷ ``threads``: its wall time on
        cores of its own, without the time the other processes of a shared machine held
        them (``wall_over_cpu`` keeps the ratio, 1.0 on an idle machine).

        Raises:
            RuntimeError: the scheduler preempted a sequence or ran another shape than
                asked (the pool or the budget is too small for it).
        """
        from sluice.worker.sampling_params import SamplingParams

        one = SamplingParams(max_tokens=1, ignore_eos=True)
        self._clear()
        prefix = self._tokens(shape.prefill_ctx)
        with self._stubbed():
            if prefix:  # computed, cached and freed: each chunk's request hits it
                self._add([prefix], one)
                self._drain(self.engine.has_unfinished_requests)
            prompt = shape.decode_ctx - 1  # + the token it samples: decode_ctx in its step
            self._add([self._tokens(prompt) for _ in range(shape.decode_seqs)], SamplingParams(
                max_tokens=self.engine.max_model_len - prompt, ignore_eos=True))
            self._drain(lambda: bool(self.engine.scheduler.waiting) or any(
                s.num_tokens - s.num_computed_tokens > 1 for s in self.engine.scheduler.running))
        preemptions = self.engine.scheduler.num_preemptions
        want = (shape.prefill_seqs * shape.prefill_len, shape.decode_seqs)
        times, kvs = [], []
        for i in range(warmup + repeats):
            chunks = self._add([prefix + self._tokens(shape.prefill_len)
                                for _ in range(shape.prefill_seqs)], one)
            self.runs.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            self.engine.step()
            cpu_ms = (time.process_time() - cpu) * 1000.0 / self.threads
            wall_ms = (time.perf_counter() - wall) * 1000.0
            for rid in chunks:  # finished already, unless the scheduler cut its chunk
                self.engine.abort_request(rid)
            got = self._last_shape()
            if got[:2] != want or self.engine.scheduler.num_preemptions != preemptions:
                raise RuntimeError(
                    f"{shape} ran as (prefill_tokens, decode_seqs) = {got[:2]}, preemptions "
                    f"{self.engine.scheduler.num_preemptions - preemptions}")
            if i >= warmup:
                times.append(cpu_ms)
                kvs.append(got[2])
                self.wall_over_cpu.append(wall_ms / cpu_ms)
        self._clear()
        return Point(*want, int(statistics.median(kvs)), statistics.median(times))

    def _recorded(self, batch, logit_rows):
        self.runs.append([(len(ids), computed) for ids, computed, _ in batch])
        if self._stub:
            import torch

            return torch.zeros(len(logit_rows), self.vocab)
        return self._execute(batch, logit_rows)

    def _last_shape(self) -> tuple[int, int, int]:
        """(prefill tokens, decode sequences, KV tokens read) of the step's forward pass."""
        (runs,) = self.runs
        return (sum(n for n, _ in runs if n > 1), sum(1 for n, _ in runs if n == 1),
                sum(c + n for n, c in runs))

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(max(0, n))]

    def _add(self, prompts: list[list[int]], params) -> list[str]:
        ids = [f"probe-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, prompt, params)
        return ids

    def _drain(self, pending) -> None:
        while pending():
            self.engine.step()

    def _clear(self) -> None:
        for rid in list(self.engine.scheduler.request_ids()):
            self.engine.abort_request(rid)

    @contextmanager
    def _stubbed(self) -> Iterator[None]:
        """Steps inside run the scheduler and the sampler, not the model."""
        self._stub = True
        try:
            yield
        finally:
            self._stub = False


def machine() -> str:
    """The CPU model, its cores, the OS and torch: where the profile was measured."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, {platform.system()} "
            f"{platform.machine()}, torch {torch.__version__}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``sluice profile``'s flags for ``--steps`` (it shares --model, --seed, --output)."""
    parser.add_argument("--steps", action="store_true",
                        help="instead of a server's capacity: the native engine's step time "
                        "over a grid of batch shapes, in-process, and its linear fit for the "
                        "simulator (--model: a store name or model folder)")
    parser.add_argument("--threads", type=int, default=1,
                        help="--steps: torch threads, as a worker of `sluice up` gets "
                        "(OMP_NUM_THREADS: the cores shared by the workers; default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="--steps: timed steps per point; the point's time is their median "
                        "(default %(default)s)")
    parser.add_argument("--max-prefill-tokens", type=int, default=2048,
                        help="--steps: largest prefill step of the grid, in tokens (default "
                        "%(default)s, the engine's token budget)")
    parser.add_argument("--tiny", action="store_true",
                        help="--steps: four cheap points instead of the grid (tests)")


def run(args: argparse.Namespace) -> int:
    """Load the engine with the worker's defaults (``EngineConfig(model)``, as ``sluice up``
    runs it), time the grid at ``--threads``, fit, print the table, write ``--output``.
    Exit status: 0 done; 2 bad arguments or no model."""
    import torch
    from rich.console import Console

    from sluice.models import store
    from sluice.worker.engine.config import EngineConfig

    if args.threads < 1 or args.repeats < 1 or args.max_prefill_tokens < 16:
        print("sluice profile --steps: --threads and --repeats must be >= 1, "
              "--max-prefill-tokens >= 16", file=sys.stderr)
        return 2
    try:
        config = EngineConfig(model=str(store.resolve(args.model)))
    except (store.ModelStoreError, ValueError) as exc:
        print(f"sluice profile --steps: {exc}", file=sys.stderr)
        return 2
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        profile = measure(config, args)
    finally:
        torch.set_num_threads(previous)
    Console().print(table(profile))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(profile, indent=1, allow_nan=False) + "\n")
        print(f"wrote {args.output}")
    return 0


def measure(config, args: argparse.Namespace) -> dict:
    """The profile of an engine built from ``config``, over the default grid (or
    ``--tiny``'s), with progress on stderr: ``{model, threads, points: [{prefill_tokens,
    decode_seqs, kv_tokens, step_ms}], fit: {c0_ms, prefill_token_ms, decode_seq_ms,
    kv_token_ms}, kv_capacity_tokens, block_size, r2, machine}`` (times in ms)."""
    from rich.console import Console

    from sluice.worker.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    capacity = engine.scheduler.block_manager.num_blocks * config.block_size
    grid = TINY_GRID if args.tiny else [
        s for s in default_grid(config.long_prefill_token_threshold,
                                engine.runner.attention_break_even, capacity)
        if s.prefill_seqs * s.prefill_len <= args.max_prefill_tokens]
    logger.info("%s: %d grid points, %d timed steps each, %d thread(s)", engine.model_name,
                len(grid), args.repeats, args.threads)
    err = Console(stderr=True)
    probe = StepProbe(engine, args.threads, args.seed)
    try:
        for warm in TINY_GRID[:1] + TINY_GRID[-1:]:  # first calls allocate and pick kernels
            probe.measure(warm, repeats=1)
        points = []
        for i, shape in enumerate(grid):
            points.append(probe.measure(shape, args.repeats))
            err.print(f"[{i + 1}/{len(grid)}] {points[-1]} (wall/CPU "
                      f"{statistics.median(probe.wall_over_cpu[-args.repeats:]):.2f})")
    finally:
        probe.close()
    ratios = sorted(probe.wall_over_cpu[2:])
    err.print(f"wall time / CPU time per step: median {statistics.median(ratios):.2f}, "
              f"max {ratios[-1]:.2f} (1.0: the step had its cores to itself)")
    model = fit(points)
    return {"model": engine.model_name, "threads": args.threads,
            "points": [asdict(p) for p in points], "fit": asdict(model),
            "kv_capacity_tokens": capacity, "block_size": config.block_size,
            "r2": r2(points, model), "machine": machine()}


def load(path: str | Path) -> tuple[list[Point], Fit, dict]:
    """A profile JSON's points, fit and whole document."""
    data = json.loads(Path(path).read_text())
    return [Point(**p) for p in data["points"]], Fit(**data["fit"]), data


def table(profile: dict):
    """A rich Table of a profile's points, the fit's prediction and its relative error."""
    from rich.table import Table

    points, model = [Point(**p) for p in profile["points"]], Fit(**profile["fit"])
    errors = relative_errors(points, model)
    f = model
    t = Table(title=f"{profile['model']} at {profile['threads']} thread(s): step_ms = "
              f"{f.c0_ms:.2f} + {f.prefill_token_ms:.4f}·prefill + {f.decode_seq_ms:.3f}·decode"
              f" + {f.kv_token_ms:.5f}·kv   (R² {profile['r2']:.3f}, max |error| "
              f"{max(map(abs, errors)):.0%})", header_style="bold")
    for name in ("prefill tokens", "decode seqs", "KV tokens", "step (ms)", "fit (ms)",
                 "error"):
        t.add_column(name, justify="right")
    for p, e in zip(points, errors):
        t.add_row(str(p.prefill_tokens), str(p.decode_seqs), str(p.kv_tokens),
                  f"{p.step_ms:.1f}", f"{_predict(model, p):.1f}", f"{e:+.0%}")
    return t
