"""Per-request sampling parameters (the engine's view; the server validates user input).

Values are normalized the way vLLM's ``SamplingParams.__post_init__`` does, so that no
finite temperature can make the sampler divide by (an fp32) zero: below ``SAMPLING_EPS`` a
temperature means greedy, and one below ``MIN_TEMPERATURE`` is raised to it (vLLM's
``_MAX_TEMP``; vLLM sends the whole ``(0, MIN_TEMPERATURE)`` range there, we send its tiny
end to greedy, which is what it converges to). ``verify`` is the engine's own last check
(every engine's ``check_request`` runs it), so a request the API let through by mistake is
refused before it joins a batch rather than failing inside one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5  # temperatures below are greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # smaller sampling temperatures are raised to this (vLLM's _MAX_TEMP)
MAX_TEMPERATURE = 2.0  # OpenAI's and vLLM's upper bound
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's bound on a logit_bias value (the API checks it too)
# repetition_penalty's range (vLLM only asks > 0): a positive fp32 logit divided by 1e-45 is
# inf, and the row had no probability mass left (a 500)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


class InvalidSamplingParams(ValueError):
    """A sampling parameter out of range.

    Attributes:
        param: the request field at fault (``temperature``, ``top_p``, ...).
    """

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        max_tokens: the most output tokens to generate (>= 1).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. Values
            below ``SAMPLING_EPS`` become 0, values in ``[SAMPLING_EPS, MIN_TEMPERATURE)``
            become ``MIN_TEMPERATURE`` (at construction).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: per-request seed; the same seed and prompt give the same sample.
        stop: strings that end generation; the matched string is not returned.
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS (for benchmarks).
        min_tokens: output tokens before EOS, ``stop_token_ids`` or a stop string may end
            generation (vLLM's ``min_tokens``: the sampler masks those ids until then, and
            stop strings are looked for only in the text of later tokens).
        logprobs: if not None, return the chosen token's logprob and this many top alternatives.
        prompt_logprobs: if not None, also return logprobs of the prompt tokens (for echo).
        presence_penalty: subtracted from the logit of every token the output holds, in
            [-2, 2]; 0 disables it (OpenAI's, applied as vLLM does: output tokens only).
        frequency_penalty: subtracted from a token's logit once per time the output holds
            it, in [-2, 2]; 0 disables it.
        repetition_penalty: a token of the prompt or the output has a positive logit divided
            by it, a negative one multiplied (Keskar et al. 2019, CTRL; HF's and vLLM's);
            in [0.01, 100], 1 disables it.
        min_p: after the temperature, drop tokens whose probability is below ``min_p``
            times the most likely one's, in [0, 1]; 0 disables it (vLLM's; Nguyen et al.
            2024). Logprobs stay the model's own, before any of these.
        logit_bias: token id -> a number in [-100, 100] added to its logit, before the
            penalties (OpenAI's; vLLM's LogitBiasLogitsProcessor); None for none.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        # NaN compares False everywhere and is left for verify() to refuse
        if 0.0 < self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        elif SAMPLING_EPS <= self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.temperature == 0.0:  # greedy: the other knobs cannot change the argmax
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """A penalty changes the logits (they then depend on the tokens so far)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def verify(self) -> None:
        """Refuse values no sampler can use (the ranges of vLLM's ``_verify_args``).

        Raises:
            InvalidSamplingParams: naming the field.
        """
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
            raise InvalidSamplingParams(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], got {t}",
                "temperature")
        if 0.0 < t < MIN_TEMPERATURE:  # set after construction, bypassing __post_init__
            raise InvalidSamplingParams(
                f"temperature {t} is below {MIN_TEMPERATURE}: use 0 for greedy", "temperature")
        p = self.top_p
        if not (isinstance(p, (int, float)) and math.isfinite(p) and 0.0 < p <= 1.0):
            raise InvalidSamplingParams(f"top_p must be a finite number in (0, 1], got {p}",
                                        "top_p")
        for name, low, high in (("presence_penalty", -2.0, 2.0),
                                ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and low <= value <= high):  # (NaN fails)
                raise InvalidSamplingParams(f"{name} must be in [{low:g}, {high:g}], got {value}",
                                            name)
        for token, bias in (self.logit_bias or {}).items():
            if not (isinstance(token, int) and token >= 0 and isinstance(bias, (int, float))
                    and -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE):  # (NaN fails)
                raise InvalidSamplingParams(
                    f"logit_bias maps token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                    f"{MAX_LOGIT_BIAS_VALUE:g}], got {token!r}: {bias!r}", "logit_bias")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float))
                and MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY):  # (NaN fails)
            raise InvalidSamplingParams(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}], got {r}", "repetition_penalty")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidSamplingParams(
                f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}", "top_k")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidSamplingParams(f"seed must be in [-2^63, 2^64), got {self.seed}",
                                        "seed")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParams(
                f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got "
                f"{self.min_tokens}", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidSamplingParams(f"{name} must be a non-negative integer, got {value}",
                                            name)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSamplingParams("stop must be a list of non-empty strings", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingParams("stop_token_ids must be non-negative integers",
                                        "stop_token_ids")


def check_fits(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
               vocab_size: int | None = None) -> None:
    """The request rules every engine shares: the sampling parameters (``verify``), the
    ``logit_bias`` token ids against the model's ``vocab_size`` (when given), then the sizes.

    Raises:
        InvalidSamplingParams: a sampling parameter out of range, or a ``logit_bias`` token
            id out of the vocabulary (names the field).
        ValueError: empty prompt, max_tokens < 1, or prompt + max_tokens over
            ``max_model_len`` (the message says "N input tokens ... maximum context M").
    """
    params.verify()
    outside = sorted(t for t in params.logit_bias or {} if vocab_size is not None
                     and t >= vocab_size)
    if outside:
        raise InvalidSamplingParams(f"logit_bias token id {outside[0]} is out of the vocabulary "
                                    f"(size {vocab_size})", "logit_bias")
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if n + params.max_tokens > max_model_len:
        raise ValueError(f"{n} input tokens + max_tokens {params.max_tokens} exceeds the "
                         f"maximum context {max_model_len}")
