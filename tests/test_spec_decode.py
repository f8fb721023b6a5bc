"""Speculative decoding: n-gram proposer, Leviathan verification, and the engine end to end."""

from __future__ import annotations

import pytest
import torch

from sluice.worker.engine import EngineConfig, SamplingParams
from sluice.worker.engine.llm_engine import LLMEngine
from sluice.worker.engine.spec_decode import NgramProposer, verify


def test_ngram_proposer_continues_the_most_recent_longest_match():
    proposer = NgramProposer(num_tokens=3, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert proposer.propose(tokens, limit=10) == [9, 2, 6]  # "6 7" last seen at 5..6
    assert proposer.propose(tokens, limit=2) == [9, 2]
    assert proposer.propose([1, 2, 3], limit=10) == []
    assert proposer.propose(tokens, limit=0) == []


def test_greedy_verification_accepts_the_matching_prefix():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 7, 1]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [3, 4, 5], greedy, None) == [3, 4, 7]  # third draft wrong: corrected
    assert verify(logits, [3, 4, 7], greedy, None) == [3, 4, 7, 1]  # all accepted + bonus
    assert verify(logits, [0, 4, 7], greedy, None) == [3]


def test_rejection_sampling_keeps_the_target_distribution():
    """Leviathan et al.: whatever the draft, the first token is distributed as p."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 2.0, 0.5, 1.5, -1.0], [0.0] * 5])
    p = torch.softmax(logits[0] / 0.8, -1)
    params = SamplingParams(temperature=0.8)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(5)
    trials = 20000
    for _ in range(trials):
        counts[verify(logits, [3], params, gen)[0]] += 1
    assert torch.allclose(counts / trials, p, atol=0.012)


@pytest.fixture(scope="module")
def engines(model_path):
    make = lambda **kw: LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1, **kw))  # noqa: E731
    return make(), make(speculative_method="ngram", num_speculative_tokens=5)


PROMPT = ("Repeat this list exactly three times:\n"
          "apple, banana, cherry, date, elderberry, fig, grape\n"
          "apple, banana, cherry, date, elderberry, fig, grape\n")


def test_greedy_output_is_identical_with_ngram_speculation(engines):
    plain, spec = engines
    ids = [plain.tokenizer.encode(PROMPT), plain.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert spec.generate(ids, params) == plain.generate(ids, params)
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    pool = spec.scheduler.block_manager
    assert pool.num_free_blocks == pool.num_blocks


def test_speculation_respects_max_tokens_and_stop_strings(engines):
    plain, spec = engines
    ids = plain.tokenizer.encode(PROMPT)
    for params in (SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=30, temperature=0.0, stop=["fig"])):
        expected = plain.generate([ids], params)[0]
        got = spec.generate([ids], params)[0]
        assert got == expected
        assert len(got) <= params.max_tokens


def test_sampled_speculation_runs_and_is_seeded(engines):
    _, spec = engines
    ids = spec.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True)
    a, b = spec.generate([ids], params)[0], spec.generate([ids], params)[0]
    assert a == b and len(a) == 24
