"""A replica's step-time model, loaded from a ``sluice profile --steps`` JSON profile.

One engine step runs a batch of ``prefill_tokens`` prompt tokens (chunks) and
``decode_seqs`` one-token decodes over ``kv_tokens`` of context held in the KV cache:

    step_ms = c0_ms + prefill_token_ms · prefill_tokens + decode_seq_ms · decode_seqs
              + kv_token_ms · kv_tokens [+ prefill_token2_ms · prefill_tokens²]

The profile format (one file per model, ``sluice/sim/profiles/<model>.json``)::

    {"model": str, "threads": int,
     "points": [{"prefill_tokens": int, "decode_seqs": int, "kv_tokens": int,
                 "step_ms": float}, ...],
     "fit": {"c0_ms": float, "prefill_token_ms": float, "decode_seq_ms": float,
             "kv_token_ms": float[, "prefill_token2_ms": float]},
     "kv_capacity_tokens": int, "block_size": int}

Only ``fit``, ``kv_capacity_tokens`` and ``block_size`` drive the simulator; ``points`` are
the measurements the fit came from (``StepModel.error`` reports how well it matches them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class StepModel:
    """Step time of one replica as a function of its batch, and its KV pool.

    Attributes:
        model: the profiled model's name.
        c0_ms: fixed cost of a step, ms.
        prefill_token_ms: ms per prompt token in the step.
        decode_seq_ms: ms per decoding sequence in the step.
        kv_token_ms: ms per token of context in the KV cache during the step.
        prefill_token2_ms: ms per squared prompt token of the step (attention; often 0).
        kv_capacity_tokens: tokens the replica's KV pool holds.
        block_size: tokens per KV block (allocation granularity).
    """

    model: str
    c0_ms: float
    prefill_token_ms: float
    decode_seq_ms: float
    kv_token_ms: float
    kv_capacity_tokens: int
    block_size: int = 16
    prefill_token2_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.c0_ms <= 0 or min(self.prefill_token_ms, self.decode_seq_ms, self.kv_token_ms,
                                  self.prefill_token2_ms) < 0:
            raise ValueError("a profile needs c0_ms > 0 and non-negative slopes")
        if self.kv_capacity_tokens < self.block_size or self.block_size < 1:
            raise ValueError("kv_capacity_tokens must hold at least one block of block_size ≥ 1")

    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        """One step's duration, ms."""
        return (self.c0_ms + self.prefill_token_ms * prefill_tokens
                + self.prefill_token2_ms * prefill_tokens * prefill_tokens
                + self.decode_seq_ms * decode_seqs + self.kv_token_ms * kv_tokens)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepModel:
        fit = data["fit"]
        return cls(model=str(data.get("model", "?")), c0_ms=float(fit["c0_ms"]),
                   prefill_token_ms=float(fit["prefill_token_ms"]),
                   decode_seq_ms=float(fit["decode_seq_ms"]),
                   kv_token_ms=float(fit["kv_token_ms"]),
                   prefill_token2_ms=float(fit.get("prefill_token2_ms", 0.0)),
                   kv_capacity_tokens=int(data["kv_capacity_tokens"]),
                   block_size=int(data.get("block_size", 16)))

    def error(self, points: list[dict[str, Any]]) -> float:
        """Mean absolute relative error of the fit over measured ``points`` (0.1 = 10 %)."""
        errors = [abs(self.step_ms(p["prefill_tokens"], p["decode_seqs"], p["kv_tokens"])
                      - p["step_ms"]) / p["step_ms"] for p in points if p["step_ms"] > 0]
        return sum(errors) / len(errors) if errors else 0.0


def load(path: str | Path) -> StepModel:
    """The step model of a profile file (see the module docstring).

    Raises:
        ValueError: a missing field or an invalid value; OSError: an unreadable file.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a step profile (not JSON: {exc})") from None
    try:
        model = StepModel.from_dict(data)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a step profile ({exc!r} missing or wrong)") from None
    if data.get("points"):
        logger.info("profile %s: fit error %.1f%% over %d points", path,
                    100 * model.error(data["points"]), len(data["points"]))
    return model


def default_path() -> Path | None:
    """The only committed profile, if exactly one exists (else the caller must choose)."""
    found = sorted(PROFILES_DIR.glob("*.json")) if PROFILES_DIR.is_dir() else []
    return found[0] if len(found) == 1 else None
