"""Speculative decoding: a cheap proposer guesses k tokens, the target verifies them in one
forward pass.

Proposer: n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``):
find the most recent earlier occurrence of the sequence's last n tokens (longest n first)
and propose the k tokens that followed it. It costs no model call, and wins on repetitive
output (code edits, extraction, summaries that quote the prompt).

Verifier (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"): the target scores the last sampled token and the k drafts in one pass, giving
k + 1 next-token distributions p_0..p_k. Draft i is accepted with probability
min(1, p_i(x) / q_i(x)); the n-gram proposer is deterministic (q_i is one-hot on x), so that
is p_i(x). At the first rejection a token is drawn from norm(max(0, p_i - q_i)) = p_i with x
removed; if all k are accepted a bonus token is drawn from p_k. The output is distributed
exactly as the target's. With temperature 0 this reduces to: accept while the draft equals
the argmax, then take the argmax.
"""

from __future__ import annotations

import torch

from sluice.worker.engine.sampler import processed_probs
from sluice.worker.engine.sampling_params import SamplingParams


class NgramProposer:
    """Prompt-lookup drafts.

    Args:
        num_tokens: k, the most tokens proposed per step.
        max_n, min_n: the n-gram sizes tried, longest first.
    """

    def __init__(self, num_tokens: int, max_n: int = 4, min_n: int = 1):
        self.num_tokens, self.max_n, self.min_n = num_tokens, max_n, min_n

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens continuing ``token_ids`` ([] if no match)."""
        k = min(self.num_tokens, limit)
        if k <= 0:
            return []
        total = len(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            pattern = token_ids[total - n:]
            for start in range(total - n - 1, -1, -1):  # most recent match first
                if token_ids[start:start + n] == pattern:
                    return token_ids[start + n:start + n + k]
        return []


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
        best = logits.argmax(dim=-1).tolist()
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
        return out + [int(torch.multinomial(p, 1, generator=generator))]
    p = processed_probs(logits[len(drafts)], params)
    return out + [int(torch.multinomial(p, 1, generator=generator))]
