"""Per-request sampling parameters (the engine's view; the server validates user input)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        max_tokens: the most output tokens to generate (>= 1).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: per-request seed; the same seed and prompt give the same sample.
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS (for benchmarks).
        logprobs: if not None, return the chosen token's logprob and this many top alternatives.
        prompt_logprobs: if not None, also return logprobs of the prompt tokens (for echo).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_fits(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int) -> None:
    """The request rules every engine shares.

    Raises:
        ValueError: empty prompt, max_tokens < 1, or prompt + max_tokens over
            ``max_model_len`` (the message says "N input tokens ... maximum context M").
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if n + params.max_tokens > max_model_len:
        raise ValueError(f"{n} input tokens + max_tokens {params.max_tokens} exceeds the "
                         f"maximum context {max_model_len}")
