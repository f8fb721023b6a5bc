"""Speculative decoding: a cheap proposer guesses k tokens, the target verifies them in one
forward pass.

Proposers (both greedy, so each draft's q is one-hot):
- n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``): find the
  most recent earlier occurrence of the sequence's last n tokens (longest n first) and
  propose the k tokens that followed it. It costs no model call, and wins on repetitive
  output (code edits, extraction, summaries that quote the prompt).
- a draft model (Leviathan et al. 2023; Chen et al. 2023): a smaller model with the same
  tokenizer runs k greedy decode steps for every decoding sequence in one batch.

Verifier (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"): the target scores the last sampled token and the k drafts in one pass, giving
k + 1 next-token distributions p_0..p_k. Draft i is accepted with probability
min(1, p_i(x) / q_i(x)); the n-gram proposer is deterministic (q_i is one-hot on x), so that
is p_i(x). At the first rejection a token is drawn from norm(max(0, p_i - q_i)) = p_i with x
removed; if all k are accepted a bonus token is drawn from p_k. The output is distributed
exactly as the target's. With temperature 0 this reduces to: accept while the draft equals
the argmax, then take the argmax. The verify pass runs the k + 1 tokens as a prefill chunk
(its attention and norms, not the decode step's kernels), so its logits match plain
decode's to ~1e-7 in fp32 but not to the bit: with int8 weights, whose rounding of x to two
digits carries such a difference on (~1e-3 in a logprob), a near tie can fall the other way
than in plain decode (a break-it pass saw it on 1 of 5 prompts, at a 2e-4 tie).
"""

from __future__ import annotations

import torch

from sluice.worker.engine.block_manager import BlockManager
from sluice.worker.engine.model_runner import ModelRunner
from sluice.worker.engine.sampler import argmax, draw, processed_probs
from sluice.worker.engine.sequence import Sequence
from sluice.worker.sampling_params import SamplingParams


class NgramProposer:
    """Prompt-lookup drafts.

    Args:
        num_tokens: k, the most tokens proposed per step.
        max_n, min_n: the n-gram sizes tried, longest first.
    """

    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 1):
        self.num_tokens, self.max_n, self.min_n = num_tokens, max_n, min_n

    def propose(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Set ``seq.spec_token_ids`` to up to ``min(k, limit)`` drafts for each decoding
        (sequence, limit) pair; [] where the n-gram has no earlier match."""
        for seq, limit in wanted:
            seq.spec_token_ids = self.lookup(seq.token_ids, min(self.num_tokens, limit))

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The k tokens that followed the latest earlier match of the last n tokens."""
        if k <= 0:
            return []
        total = len(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            pattern = token_ids[total - n:]
            for start in range(total - n - 1, -1, -1):  # most recent match first
                if token_ids[start:start + n] == pattern:
                    return token_ids[start + n:start + n + k]
        return []


class DraftModelProposer:
    """Greedy drafts from a smaller model that shares the target's tokenizer.

    The draft model keeps its own KV pool with as many blocks as the target's and is
    addressed through the target's block tables (as vLLM's draft-model worker did), so it
    needs no allocator of its own. ``seq.num_draft_computed`` counts the leading positions
    whose draft K/V are valid; each proposal first catches the draft up to the sequence's
    last token (the whole prompt the first time, then the one or two tokens the target
    added), then decodes k - 1 more steps::

        tokens:      t0 .. t(L-1) | d1 .. dk          (L = num_tokens)
        draft K/V:   catch-up     | d1 .. d(k-1)      → num_draft_computed = L + k - 1

    After verification accepted a drafts, the sequence has L + a + 1 tokens and the draft
    K/V are valid up to position min(L + k - 1, L + a) - 1, which is what
    ``min(num_draft_computed, num_tokens - 1)`` gives at the next proposal.

    Args:
        runner: the draft model's runner (``allocate_kv_cache`` done).
        block_manager: the target's block pool (for the lookahead slots the draft writes).
        num_tokens: k, the most drafts per step.
    """

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, num_tokens: int):
        self.runner, self.block_manager, self.num_tokens = runner, block_manager, num_tokens

    def propose(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Set ``seq.spec_token_ids`` (``min(k, limit)`` tokens) for each (sequence, limit)
        pair whose lookahead slots the pool can give; others get no drafts this step."""
        batch, rows, active = [], [], []
        for seq, limit in wanted:
            seq.spec_token_ids = []
            k = min(self.num_tokens, limit)
            # room for positions up to num_tokens + k - 2 (computed is num_tokens - 1)
            if k <= 0 or not self.block_manager.allocate_slots(seq, k):
                continue
            start = min(seq.num_draft_computed, seq.num_tokens - 1)
            batch.append((seq.token_ids[start:], start, seq.block_table))
            rows.append(sum(len(tokens) for tokens, _, _ in batch) - 1)
            active.append((seq, k))
        while active:
            next_tokens = argmax(self.runner.execute(batch, rows))
            for (seq, _), token in zip(active, next_tokens):
                seq.spec_token_ids.append(token)
                seq.num_draft_computed = seq.num_tokens + len(seq.spec_token_ids) - 1
            active = [(seq, k) for seq, k in active if len(seq.spec_token_ids) < k]
            batch = [([seq.spec_token_ids[-1]], seq.num_draft_computed, seq.block_table)
                     for seq, _ in active]
            rows = list(range(len(active)))


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """Accept a prefix of ``drafts`` and add one token from the target.

    Args:
        logits: [k + 1, vocab] fp32, the target's logits after the last sampled token and
            after each draft.
        drafts: the k proposed tokens.
        params: the request's sampling parameters.
        generator: the request's RNG (None: torch's default).

    Returns:
        1..k + 1 tokens: the accepted drafts followed by the corrected or bonus token.
    """
    if params.greedy:
        best = argmax(logits)
        out = []
        for i, draft in enumerate(drafts):
            if draft != best[i]:
                break
            out.append(draft)
        return out + [best[len(out)]]
    out = []
    for i, draft in enumerate(drafts):
        p = processed_probs(logits[i], params)
        if torch.rand((), generator=generator) < p[draft]:
            out.append(draft)
            continue
        p[draft] = 0.0  # residual distribution: max(0, p - one_hot(draft))
        return out + [_draw(p, generator)]
    return out + [_draw(processed_probs(logits[len(drafts)], params), generator)]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [vocab] (``sampler.draw``); its ValueError raised."""
    token = draw(probs[None], [generator])[0]
    if isinstance(token, Exception):
        raise token
    return token
