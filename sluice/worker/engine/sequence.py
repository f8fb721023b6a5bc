"""A request inside the engine: its tokens, KV blocks, progress and output state."""

from __future__ import annotations

import enum
import functools
import time

import torch

from sluice.worker.engine.detokenizer import IncrementalDetokenizer
from sluice.worker.outputs import RequestOutput, TokenLogprob
from sluice.worker.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its own processing raised; the rest of the batch went on

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class Sequence:
    """One request (vLLM v1 vocabulary).

    Invariant: ``num_computed_tokens <= num_tokens``; a step closes the gap by up to the
    scheduler's budget, and a token is sampled whenever the gap reaches zero. Prefill and
    decode are not separate phases: a decode step is a gap of one.

    Attributes:
        token_ids: prompt followed by output tokens.
        num_prompt_tokens: prompt length.
        num_computed_tokens: tokens whose K/V are in the cache.
        block_table: KV block ids, in order; block i holds tokens [i*bs, (i+1)*bs).
        block_hashes: prefix-cache hashes of the leading full, computed blocks.
        generator: per-request RNG when a seed was given, else None (engine's RNG).
        logit_bias: the request's ``logit_bias`` as (token ids [k] int64, biases [k] fp32),
            built once for the sampler to add every step; None without one.
        group: the API request this sequence belongs to (one per prompt and choice share
            it); the scheduler shares slots fairly between groups. Defaults to request_id.
        error: why it finished with FINISHED_ERROR, else None.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, group: str | None = None):
        self.request_id = request_id
        self.group = request_id if group is None else group
        self.error: str | None = None
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, in order
        self.spec_token_ids: list[int] = []  # this step's speculative drafts
        self.num_draft_computed = 0  # positions with valid draft-model K/V (spec_decode.py)
        self.status = SequenceStatus.WAITING
        self.arrival_time = time.monotonic()
        self.detokenizer = detokenizer
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.logit_bias = None if not params.logit_bias else (
            torch.tensor(list(params.logit_bias), dtype=torch.long),
            torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self._num_sent_tokens = 0
        self._pending_logprobs: list[TokenLogprob] = []
        self._prompt_logprobs_sent = False

    @functools.cached_property
    def prompt_token_set(self) -> torch.Tensor:
        """The prompt's distinct token ids, [k] int64: repetition_penalty's, built once."""
        return torch.tensor(self.token_ids[:self.num_prompt_tokens], dtype=torch.long).unique()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def step_token_ids(self, n: int) -> list[int]:
        """The ``n`` tokens this step computes: the uncomputed ones, then the drafts."""
        return (self.token_ids[self.num_computed_tokens:] + self.spec_token_ids)[:n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> bool:
        """Add a sampled token; returns True if it completed a stop string."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self._pending_logprobs.append(logprob)
        # as vLLM: a stop string counts only in the text of tokens past min_tokens
        return self.detokenizer.add(token_id, self.num_output_tokens > self.params.min_tokens)

    def error_output(self) -> RequestOutput:
        """The last output of a sequence that failed (FINISHED_ERROR): no new tokens or
        text (its detokenizer may be what failed), the error."""
        return RequestOutput(request_id=self.request_id, new_token_ids=[], new_text="",
                             num_prompt_tokens=self.num_prompt_tokens,
                             num_output_tokens=self.num_output_tokens, finished=True,
                             finish_reason=SequenceStatus.FINISHED_ERROR.value,
                             error=self.error)

    def take_output(self) -> RequestOutput:
        """The delta since the previous call (tokens, safe text, logprobs)."""
        finished = self.is_finished
        new_ids = self.token_ids[self.num_prompt_tokens + self._num_sent_tokens:]
        self._num_sent_tokens += len(new_ids)
        output = RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_text=self.detokenizer.take(final=finished),
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            new_logprobs=self._pending_logprobs if self.params.logprobs is not None else None,
            finished=finished,
            finish_reason=self.status.value if finished else None,
        )
        self._pending_logprobs = []
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            if len(self.prompt_logprobs) == self.num_prompt_tokens or finished:
                output.prompt_logprobs = self.prompt_logprobs
                self._prompt_logprobs_sent = True
        return output
