"""What the engine hands back per step for each request: deltas since the last output."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Logprob of one token and its top alternatives.

    Attributes:
        token_id: the token at this position.
        logprob: natural-log probability of ``token_id`` under the (unscaled) model distribution.
        top: the ``k`` most likely (token_id, logprob) pairs at this position, best first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One request's progress since its previous RequestOutput.

    Attributes:
        request_id: the id given to ``generate``.
        new_token_ids: output tokens generated since the last output (may be empty).
        new_text: text that is now safe to stream: no half UTF-8 character and nothing that
            could still turn out to be the start of a stop string.
        new_logprobs: one TokenLogprob per new token, or None if logprobs were not asked for.
        prompt_logprobs: on the first output only, when asked: one entry per prompt token
            (the first is None, having no context).
        finished: True on the last output of the request.
        finish_reason: "stop" (EOS, stop token or stop string), "length", "abort", or
            "error" (this request failed inside a step; the others in it went on); None
            until finished.
        error: with finish_reason "error", what went wrong (the exception, as text).
        num_prompt_tokens: prompt length in tokens.
        num_output_tokens: output tokens so far (cumulative).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
