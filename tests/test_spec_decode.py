"""Speculative decoding: n-gram and draft-model proposers, Leviathan verification, and the
engine end to end."""

from __future__ import annotations

import pytest
import torch

from sluice.worker.engine import EngineConfig
from sluice.worker.engine.llm_engine import LLMEngine
from sluice.worker.engine.spec_decode import NgramProposer, verify
from sluice.worker.sampling_params import SamplingParams


def test_ngram_proposer_continues_the_most_recent_longest_match():
    proposer = NgramProposer(num_tokens=3, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert proposer.lookup(tokens, 3) == [9, 2, 6]  # "6 7" last seen at 5..6
    assert proposer.lookup(tokens, 2) == [9, 2]
    assert proposer.lookup([1, 2, 3], 3) == []
    assert proposer.lookup(tokens, 0) == []


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


@pytest.fixture(scope="module")
def draft_engine(model_path):
    """SmolLM2 drafting for itself with int8 weights: close enough to accept most drafts,
    different enough that some are rejected (every verification path runs)."""
    return LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1, speculative_method="draft",
                                  speculative_model=str(model_path), num_speculative_tokens=4,
                                  speculative_model_quantization="int8"))


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


def test_penalized_requests_get_no_drafts_and_the_same_output(engines):
    """A penalty depends on every token before the one it scores, so a penalized request is
    not speculated (its drafts would be scored without the drafts before them); its output is
    the plain engine's, token for token, beside a speculated one."""
    plain, spec = engines
    ids = [plain.tokenizer.encode(PROMPT)] * 2
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                             repetition_penalty=1.2, frequency_penalty=0.4),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    drafts = spec.num_draft_tokens
    assert spec.generate(ids, params) == plain.generate(ids, params)
    assert spec.num_draft_tokens > drafts  # the plain one was speculated
    drafts = spec.num_draft_tokens
    spec.generate(ids[:1], params[:1])
    assert spec.num_draft_tokens == drafts


def test_logit_bias_applies_to_every_verified_position(engines):
    """A bias is the same at every position, so speculated requests keep their drafts and
    the verifier scores each with the bias: the plain engine's output, token for token."""
    plain, spec = engines
    ids = [plain.tokenizer.encode(PROMPT)]
    fig = plain.tokenizer.encode(" fig")[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                            logit_bias={fig: -100.0})
    drafts = spec.num_draft_tokens
    out = spec.generate(ids, params)
    assert out == plain.generate(ids, params) and fig not in out
    assert spec.num_draft_tokens > drafts


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


DRAFT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", PROMPT,
                 "Write a short poem about the sea."]


def test_greedy_output_is_identical_with_a_draft_model(engines, draft_engine):
    plain, _ = engines
    ids = [plain.tokenizer.encode(p) for p in DRAFT_PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    assert draft_engine.generate(ids, params) == plain.generate(ids, params)
    proposed, accepted = draft_engine.num_draft_tokens, draft_engine.num_accepted_tokens
    assert 0 < accepted < proposed  # accepted and rejected drafts both happened
    pool = draft_engine.scheduler.block_manager
    assert pool.num_free_blocks == pool.num_blocks


def test_draft_model_reuses_prefix_cache_and_survives_preemption(model_path, engines):
    """A six-block pool with four concurrent requests forces preemption (freed blocks reset
    the draft's progress); the repeated prompt hits the prefix cache. Output is unchanged."""
    plain, _ = engines
    small = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=6 * 2 * 737_280 / 2**30,
                                   max_num_batched_tokens=64, speculative_method="draft",
                                   speculative_model=str(model_path), num_speculative_tokens=3))
    assert small.scheduler.block_manager.num_blocks == 6
    ids = [plain.tokenizer.encode(p) for p in DRAFT_PROMPTS[1:3] * 2]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert small.generate(ids, params) == plain.generate(ids, params)
    assert small.scheduler.num_preemptions > 0
    assert small.scheduler.block_manager.prefix_cache_hits > 0
    assert small.num_accepted_tokens > 0
    assert small.scheduler.block_manager.num_free_blocks == 6


def test_draft_model_must_share_the_tokenizer(model_path, tmp_path):
    import shutil

    from tokenizers import Tokenizer

    other = tmp_path / "draft"
    other.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, other / name)
    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    tokenizer.add_tokens(["<not-in-the-target>"])
    tokenizer.save(str(other / "tokenizer.json"))
    with pytest.raises(ValueError, match="does not share the target model's tokenizer"):
        LLMEngine(EngineConfig(model=str(model_path), speculative_method="draft",
                               speculative_model=str(other)))
    with pytest.raises(ValueError, match="speculative_model is needed by, and only by"):
        EngineConfig(model=str(model_path), speculative_method="draft")
