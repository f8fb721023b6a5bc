"""The native engine against HF transformers on the real SmolLM2 weights."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from sluice.worker.engine import EngineConfig, sampler
from sluice.worker.engine.llm_engine import LLMEngine
from sluice.worker.sampling_params import InvalidSamplingParams, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\n",
    "What is the boiling point of water?",
    "Q: Who wrote Hamlet?\nA:",
    "SELECT * FROM users WHERE",
    "The three primary colors are",
    "In 1969, humans",
    "Here is a haiku about autumn:\n",
    "<html>\n<head>",
    "Photosynthesis is the process",
    "The square root of 144 is",
    "Dear Sir or Madam,",
    "A list of fruits: apple, banana,",
    "To be or not to be,",
    "The theory of relativity states that",
    "Rust and Go are both",
    "Step 1: Preheat the oven",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(model_path):
    return LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.25))


@pytest.fixture(scope="module")
def hf_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_reference(engine, hf_model):
    """HF greedy `generate` output ids for every prompt, one prompt at a time."""
    refs = []
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        refs.append(out[0, len(ids):].tolist())
    return refs


def greedy(max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_pool_idle(engine):
    pool = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks


def test_greedy_matches_hf_one_at_a_time(engine, hf_reference):
    for prompt, ref in zip(PROMPTS, hf_reference):
        out = engine.generate([engine.tokenizer.encode(prompt)], greedy())[0]
        assert out == ref, prompt
    assert_pool_idle(engine)


def test_greedy_matches_hf_in_batch_with_requests_joining_midway(engine, hf_reference):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:8]]
    results: dict[str, list[int]] = {}
    for i in range(4):
        engine.add_request(f"b{i}", ids[i], greedy())
    steps = 0
    while engine.has_unfinished_requests():
        if steps in (3, 7, 11, 15):  # the other four join while the first ones decode
            i = 4 + (3, 7, 11, 15).index(steps)
            engine.add_request(f"b{i}", ids[i], greedy())
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    for i in range(8):
        assert results[f"b{i}"] == hf_reference[i], PROMPTS[i]
    assert_pool_idle(engine)


def test_chunked_prefill_matches_unchunked(model_path, engine, hf_reference):
    small_budget = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.05,
                                          max_num_batched_tokens=4))
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    assert small_budget.generate(ids, greedy()) == hf_reference[:4]
    assert_pool_idle(small_budget)


def test_preemption_under_kv_pressure_gives_identical_output(model_path, engine):
    # 6 blocks of 16 tokens: each request needs 2-3 blocks at its end, so 8 cannot all run
    bytes_per_block = 2 * 30 * 16 * 3 * 64 * 4
    tight = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=6 * bytes_per_block / 2**30))
    assert tight.scheduler.block_manager.num_blocks == 6
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:8]]
    params = greedy(max_tokens=30, ignore_eos=True)
    expected = engine.generate(ids, params)
    assert tight.generate(ids, params) == expected
    assert tight.scheduler.num_preemptions > 0
    assert_pool_idle(tight)


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(engine):
    ids = engine.tokenizer.encode("1, 2, 3, 4,")
    full = "".join(o.new_text for o in _run(engine, ids, greedy(max_tokens=20, ignore_eos=True)))
    assert full.startswith(" 5, 6, 7, 8")
    outs = _run(engine, ids, greedy(max_tokens=20, stop=["7, 8"]))
    assert "".join(o.new_text for o in outs) == " 5, 6, "
    assert outs[-1].finish_reason == "stop"
    streamed = [o.new_text for o in outs]
    assert not any("7" in piece for piece in streamed)
    assert_pool_idle(engine)


def test_stop_string_inside_a_token(engine):
    # find a token the model emits that contains "DEF", then stop on "DE"
    prompt = "The alphabet in capitals: ABCDEFGHIJ. Again: ABC"
    ids = engine.tokenizer.encode(prompt)
    out_ids = engine.generate([ids], greedy(max_tokens=8))[0]
    pieces = [engine.tokenizer.decode([t]) for t in out_ids]
    assert any("DEF" in p for p in pieces), pieces
    outs = _run(engine, ids, greedy(max_tokens=8, stop=["DE"]))
    text = "".join(o.new_text for o in outs)
    assert "D" not in text and outs[-1].finish_reason == "stop"


def test_min_tokens_masks_eos_as_hf_min_new_tokens(engine, hf_model):
    """min_tokens: EOS cannot end the answer before it, token for token as HF's
    MinNewTokensLengthLogitsProcessor (vLLM's MinTokensLogitsProcessor)."""
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? One word."}],
        tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer.encode(prompt)
    eos = sorted(engine.eos_token_ids)
    free = engine.generate([ids], greedy(max_tokens=40))[0]
    assert len(free) < 20 and free[-1] in eos  # the answer ends well before min_tokens
    got = engine.generate([ids], greedy(max_tokens=40, min_tokens=20))[0]
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=20,
                            do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    assert got == ref[0, len(ids):].tolist()
    assert len(got) >= 20 and not set(got[:20]) & set(eos)
    assert_pool_idle(engine)


def test_min_tokens_defers_stop_strings_and_stop_token_ids(engine):
    ids = engine.tokenizer.encode("1, 2, 3, 4,")
    six = engine.tokenizer.encode(" 6")[-1]
    text = lambda outs: "".join(o.new_text for o in outs)  # noqa: E731
    outs = _run(engine, ids, greedy(max_tokens=12, stop=["6"]))  # " ", "5", ",", " ", "6"
    assert text(outs) == " 5, " and outs[-1].finish_reason == "stop"
    outs = _run(engine, ids, greedy(max_tokens=12, stop=["6"], min_tokens=6))
    assert text(outs) == " 5, 6, 7, 8," and outs[-1].finish_reason == "length"
    outs = _run(engine, ids, greedy(max_tokens=12, stop_token_ids=[six], min_tokens=6))
    out_ids = [t for o in outs for t in o.new_token_ids]
    assert out_ids[4] != six and len(out_ids) >= 6  # masked: another token instead
    assert len(out_ids) == 12 or (out_ids[-1] == six and outs[-1].finish_reason == "stop")
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens = 8\]"):
        engine.check_request(ids, greedy(max_tokens=8, min_tokens=9))
    assert_pool_idle(engine)


REPETITIVE = ["1, 2, 3, 4,", "apple, banana, apple, banana, apple,", "The quick brown fox"]


def test_repetition_penalty_matches_hf(engine, hf_model):
    """repetition_penalty over the prompt's and the output's tokens (a positive logit divided
    by it, a negative one multiplied: HF's RepetitionPenaltyLogitsProcessor, vLLM's
    ``apply_penalties``), greedy, token for token as HF ``generate``; penalized rows batched
    with plain ones leave those alone."""
    prompts = [engine.tokenizer.encode(p) for p in REPETITIVE]
    params = [greedy(repetition_penalty=1.3, ignore_eos=True), greedy(ignore_eos=True),
              greedy(repetition_penalty=0.8, ignore_eos=True)]
    got = engine.generate(prompts, params)
    plain = engine.generate(prompts, [greedy(ignore_eos=True)] * 3)
    for ids, p, out in zip(prompts, params, got):
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                repetition_penalty=p.repetition_penalty,
                                pad_token_id=0, eos_token_id=None)
        assert out == ref[0, len(ids):].tolist()
    assert got[0] != plain[0] and got[2] != plain[2] and got[1] == plain[1]
    assert_pool_idle(engine)


def _openai_penalized_greedy(hf_model, ids, steps, presence, frequency):
    """The reference: HF forward passes, each next token the argmax of the logits less
    ``frequency`` x its count in the output so far and ``presence`` if it is there at all
    (OpenAI's definition; vLLM's ``apply_penalties``: output tokens only)."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf_model(torch.tensor([ids + out])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                    minlength=logits.numel())[:logits.numel()].float()
            logits -= frequency * counts
            logits -= presence * (counts > 0).float()
            out.append(int(logits.argmax()))
    return out


def test_presence_and_frequency_penalties_match_a_reference_loop(engine, hf_model):
    prompts = [engine.tokenizer.encode(p) for p in REPETITIVE[:2]]
    params = [greedy(max_tokens=16, frequency_penalty=2.0, presence_penalty=-0.5,
                     ignore_eos=True),
              greedy(max_tokens=16, presence_penalty=1.5, ignore_eos=True)]
    got = engine.generate(prompts, params)
    for ids, p, out in zip(prompts, params, got):
        assert out == _openai_penalized_greedy(hf_model, ids, 16, p.presence_penalty,
                                               p.frequency_penalty)
    plain = engine.generate(prompts, [greedy(max_tokens=16, ignore_eos=True)] * 2)
    assert got[0] != plain[0] and got[1] != plain[1]
    assert_pool_idle(engine)


def test_penalties_exact_values():
    """sampler.penalize on a batch: repetition over prompt and output ids (each id once,
    however often it appears), then frequency x count and presence over output ids, each
    row with its own values; rows not named, and no-op values, change nothing."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 4.0, -1.0, 0.5]] * 4)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25),
              SamplingParams(temperature=0.0, frequency_penalty=-1.0),
              SamplingParams(temperature=0.0)]
    sampler.penalize(logits, [0, 3, 2], params, [torch.tensor(p) for p in ([0, 1, 1], [0, 1], [0, 1])],
                     [[3, 3, 1], [4, 4], [2, 2]])
    assert logits.tolist() == [[1.0, -4.0 - 0.5 - 0.25, 1.0, 2.0 - 1.0 - 0.25, -1.0, 0.5],
                               [2.0, -2.0, 1.0, 4.0, -1.0, 0.5],
                               [2.0, -2.0, 1.0, 4.0, -1.0, 0.5],
                               [2.0, -2.0, 1.0, 4.0, -1.0 + 2.0, 0.5]]


def test_min_p_drops_tokens_below_its_share_of_the_best():
    """min_p (vLLM's, Nguyen et al. 2024): after the temperature, tokens whose probability is
    below min_p x the best one's are dropped; top_p then works on what is left."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    probs = sampler.processed_probs(logits, SamplingParams(min_p=0.3))
    assert (probs > 0).tolist() == [True, True, True, False]  # 0.1 < 0.3 x 0.5
    torch.testing.assert_close(probs[:3] / probs.sum(), torch.tensor([0.5, 0.25, 0.15]) / 0.9)
    probs = sampler.processed_probs(logits, SamplingParams(min_p=0.3, top_p=0.8))
    assert (probs > 0).tolist() == [True, True, False, False]  # 0.5/0.9 + 0.25/0.9 >= 0.8
    probs = sampler.processed_probs(logits, SamplingParams(min_p=0.3, temperature=2.0))
    assert (probs > 0).all()  # flatter: 0.1's share passes


def test_logit_bias_matches_hf_sequence_bias(engine, hf_model):
    """logit_bias (OpenAI's; vLLM's LogitBiasLogitsProcessor): each listed token's logit gets
    its bias before anything else, greedy token for token as HF ``generate``'s
    ``sequence_bias`` with one-token sequences; rows without one are left alone."""
    ids = engine.tokenizer.encode(PROMPTS[0])  # "The capital of France is"
    paris = engine.tokenizer.encode(" Paris")[0]
    the = engine.tokenizer.encode(" the")[0]
    bias = {paris: -100.0, the: 4.5}
    got, plain = engine.generate([ids, ids], [greedy(logit_bias=bias), greedy()])
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            sequence_bias={(t,): b for t, b in bias.items()})
    assert got == ref[0, len(ids):].tolist()
    assert paris in plain and paris not in got and plain != got
    assert_pool_idle(engine)


def test_sampling_params_refuse_penalties_and_biases_out_of_range(engine):
    for kw, field in [({"presence_penalty": 2.5}, "presence_penalty"),
                      ({"frequency_penalty": -3}, "frequency_penalty"),
                      ({"repetition_penalty": 0.0}, "repetition_penalty"),
                      ({"repetition_penalty": float("inf")}, "repetition_penalty"),
                      ({"repetition_penalty": 1e-45}, "repetition_penalty"),
                      ({"repetition_penalty": 101}, "repetition_penalty"),
                      ({"min_p": 1.5}, "min_p"), ({"min_p": float("nan")}, "min_p"),
                      ({"logit_bias": {5: 100.5}}, "logit_bias"),
                      ({"logit_bias": {-1: 1.0}}, "logit_bias"),
                      ({"logit_bias": {5: float("nan")}}, "logit_bias")]:
        with pytest.raises(InvalidSamplingParams) as err:
            SamplingParams(**kw).verify()
        assert err.value.param == field
    with pytest.raises(InvalidSamplingParams, match="out of the vocabulary") as err:
        engine.check_request([1, 2], SamplingParams(logit_bias={49152: 1.0}))
    assert err.value.param == "logit_bias"
    engine.check_request([1, 2], SamplingParams(logit_bias={49151: -100}))


def test_non_ascii_stream_never_splits_a_character(engine):
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write 你好世界 and a party emoji 🎉 three times."}],
        tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer.encode(prompt)
    outs = _run(engine, ids, greedy(max_tokens=40))
    pieces = [o.new_text for o in outs]
    out_ids = [t for o in outs for t in o.new_token_ids]
    assert all("\ufffd" not in p for p in pieces)
    # a character cut by max_tokens is dropped, never emitted as U+FFFD
    assert "".join(pieces) == engine.tokenizer.decode(out_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert any(ord(c) > 0x2E80 for c in "".join(pieces))


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(engine, hf_reference):
    ids = engine.tokenizer.encode(PROMPTS[2])
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    a, b = engine.generate([ids, ids], [sampled, sampled])
    assert a == b
    top1 = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=1, seed=3)
    assert engine.generate([ids], top1)[0] == hf_reference[2]


def test_draw_samples_each_token_at_its_probability_and_fails_rows_without_mass():
    """sampler.draw (inverse transform over one batched cumsum): 40,000 seeded draws of
    [0.1, 0, 0.6, 0.3, 0] land within 0.01 of each probability (3.5 standard errors at
    most), never on a zero; a generator replays its draws; rows with NaN, inf or no mass get
    a ValueError and the others their token."""
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]).expand(40_000, 5).contiguous()
    picks = sampler.draw(probs, [torch.Generator().manual_seed(0)] * 40_000)
    freq = torch.bincount(torch.tensor(picks), minlength=5) / 40_000
    assert freq[1] == 0 and freq[4] == 0
    torch.testing.assert_close(freq, probs[0], atol=0.01, rtol=0)
    rows = torch.tensor([[2.0, 6.0], [float("nan"), 1.0], [0.0, 0.0], [float("inf"), 1.0]])
    again = [sampler.draw(rows, [torch.Generator().manual_seed(5)] + [None] * 3) for _ in range(2)]
    assert again[0][0] == again[1][0] in (0, 1)
    assert [type(t) for t in again[0][1:]] == [ValueError] * 3


def test_logprobs_match_hf(engine, hf_model):
    ids = engine.tokenizer.encode(PROMPTS[0])
    outs = _run(engine, ids, greedy(max_tokens=4, logprobs=3, prompt_logprobs=2))
    lps = [lp for o in outs for lp in o.new_logprobs]
    tokens = [lp.token_id for lp in lps]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + tokens])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(lps):
        row = ref[len(ids) - 1 + i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-3)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for p in range(1, len(ids)):
        assert prompt_lps[p].logprob == pytest.approx(ref[p - 1][ids[p]].item(), abs=1e-3)



def test_logprobs_stay_the_models_own_under_penalties_and_bias(engine, hf_model):
    """Penalties and logit_bias change the choice, not the logprobs reported (vLLM's
    default: the model's raw distribution): alone, and together (one copy of the logits)."""
    ids = engine.tokenizer.encode(REPETITIVE[1])
    banana = engine.tokenizer.encode(" banana")[0]
    for extra in ({"repetition_penalty": 1.5}, {"logit_bias": {banana: 8.0}},
                  {"frequency_penalty": 1.0, "logit_bias": {banana: 8.0}, "min_tokens": 2}):
        outs = _run(engine, ids, greedy(max_tokens=6, logprobs=1, **extra))
        lps = [lp for o in outs for lp in o.new_logprobs]
        tokens = [lp.token_id for lp in lps]
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids + tokens])).logits[0].float(), -1)
        for i, lp in enumerate(lps):
            assert lp.logprob == pytest.approx(ref[len(ids) - 1 + i][lp.token_id].item(),
                                               abs=1e-3), extra
    assert_pool_idle(engine)


def test_abort_frees_blocks_within_one_step(engine):
    ids = engine.tokenizer.encode(PROMPTS[5])
    engine.add_request("long", ids, greedy(max_tokens=200, ignore_eos=True))
    engine.add_request("short", ids, greedy(max_tokens=3))
    engine.step()
    engine.step()
    final = engine.abort_request("long")
    assert final[0].finished and final[0].finish_reason == "abort"
    assert [s.request_id for s in engine.scheduler.running] == ["short"]
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_idle(engine)


def test_rejects_requests_that_cannot_fit(engine):
    with pytest.raises(ValueError, match="8000 input tokens .* maximum context 5824"):
        engine.check_request([1] * 8000, greedy(max_tokens=500))
    with pytest.raises(ValueError, match="empty"):
        engine.check_request([], greedy())


def test_context_is_capped_to_what_the_kv_pool_holds(model_path, engine):
    # 0.25 GiB / (2 * 30 layers * 16 tokens * 3 heads * 64 dims * 4 bytes) = 364 blocks
    assert engine.scheduler.block_manager.num_blocks == 364
    assert engine.max_model_len == 364 * 16 == 5824
    with pytest.raises(ValueError, match="max_model_len 8192 is more than the KV cache holds"):
        LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.25, max_model_len=8192))


def _run(engine, ids, params):
    engine.add_request("solo", ids, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


@pytest.mark.slow
def test_qwen2_architecture_matches_hf():
    """The second family (q/k/v biases, 151k vocab) on real Qwen2.5-Coder-0.5B weights."""
    from sluice.models import store

    path = store.fetch("Qwen2.5-Coder-0.5B-Instruct")
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_gib=0.1))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write hello world in C"}], tokenize=False, add_generation_prompt=True)
    ids = [engine.tokenizer.encode(p) for p in ("def quicksort(arr):", "The capital of France is", chat)]
    outs = engine.generate(ids, greedy(max_tokens=16))
    for prompt, out in zip(ids, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
        assert out == ref.tolist()
    assert_pool_idle(engine)


TOKENIZER_TEXTS = ["hello world", "  leading spaces", "def f(x):\n\treturn x**2\n", "日本語のテキスト",
                   "émoji 🎉🚀", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>hi", "\n\n\n"]


@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct"])
def test_the_engine_loads_the_tokenizer_autotokenizer_would(model):
    """``load_tokenizer`` skips AutoTokenizer's config import (worker boot time) and must
    still give the same ids, vocabulary, special tokens and chat template, and
    ``load_config`` the same fields the model reads."""
    from transformers import AutoConfig, AutoTokenizer

    from sluice.models import store
    from sluice.worker.engine.llm_engine import load_config, load_tokenizer

    path = store.fetch(model)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    for text in TOKENIZER_TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.get_vocab() == theirs.get_vocab()
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (
        theirs.eos_token_id, theirs.bos_token_id, theirs.all_special_ids)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    config, reference = load_config(path), AutoConfig.from_pretrained(path)
    for field in ("architectures", "model_type", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "rms_norm_eps", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(config, field) == getattr(reference, field), field


def test_prefix_cache_computes_only_the_new_tokens(model_path):
    engine = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.25))
    shared = engine.tokenizer.encode("Here is a long shared document. " * 150)[:1000]
    first = shared + engine.tokenizer.encode(" Question one: what is it about?")
    second = shared + engine.tokenizer.encode(" Question two: summarize it.")
    cold = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.25,
                                  enable_prefix_caching=False))
    expected = cold.generate([second], greedy(max_tokens=8))

    engine.generate([first], greedy(max_tokens=8))
    pool = engine.scheduler.block_manager
    before_computed, before_hits = engine.scheduler.num_computed_tokens_total, pool.prefix_cache_hits
    assert engine.generate([second], greedy(max_tokens=8)) == expected
    hits = pool.prefix_cache_hits - before_hits
    assert hits == 992  # 62 full blocks of 16 tokens of the 1000-token prefix
    # the model ran the uncached prompt tokens plus one token per later decode step
    computed = engine.scheduler.num_computed_tokens_total - before_computed
    assert computed == len(second) - 992 + 7
    assert_pool_idle(engine)


def test_prefix_cache_never_serves_evicted_or_colliding_blocks(model_path):
    # a pool of 8 blocks: the second prompt evicts the first one's cached blocks
    bytes_per_block = 2 * 30 * 16 * 3 * 64 * 4
    engine = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=8 * bytes_per_block / 2**30))
    cold = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.05, enable_prefix_caching=False))
    a = engine.tokenizer.encode("The history of the Roman empire, told briefly: " * 5)[:80]
    b = engine.tokenizer.encode("A recipe for bread with flour, water and yeast: " * 5)[:80]
    params = greedy(max_tokens=10)
    for prompt in (a, b, a, b, a[:50] + b[50:]):
        assert engine.generate([prompt], params) == cold.generate([prompt], params)
    pool = engine.scheduler.block_manager
    # a forced hash collision must not hand out another prefix's K/V
    seq_blocks = dict(pool._cached)
    for h, block in seq_blocks.items():
        pool._tokens_of[block] = (-1,) * 16  # the stored tokens no longer match any prompt
    before = pool.prefix_cache_hits
    assert engine.generate([a], params) == cold.generate([a], params)
    assert pool.prefix_cache_hits == before
    assert_pool_idle(engine)


def test_prefill_chunks_shrink_as_their_context_grows(model_path, engine):
    chunked = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1,
                                     long_prefill_token_threshold=256))
    # SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1536 → 3,538,944 linear
    # weights per layer; attention costs 2·9·64 of them per context token
    assert chunked.runner.attention_break_even == 3072.0
    prompt = engine.tokenizer.encode("A very long document about rivers and lakes. " * 200)[:2000]
    chunked.add_request("long", prompt, greedy(max_tokens=2))
    seq = chunked.scheduler.find("long")
    chunks = []
    while seq.num_computed_tokens < len(prompt):
        before = seq.num_computed_tokens
        chunked.step()
        chunks.append(seq.num_computed_tokens - before)
    expected, done = [], 0
    while done < len(prompt):
        expected.append(min(len(prompt) - done, int(256 / (1 + done / 3072))))
        done += expected[-1]
    assert chunks == expected
    assert chunks[0] == 256 and chunks[-2] == int(256 / (1 + sum(chunks[:-2]) / 3072)) < 180
    while chunked.has_unfinished_requests():
        chunked.step()
    assert chunked.generate([prompt], greedy(max_tokens=4)) == engine.generate([prompt], greedy(max_tokens=4))
    assert_pool_idle(chunked)


def test_chunked_prefill_lets_short_requests_decode_during_a_long_prefill(model_path, engine):
    chunked = LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1, max_num_batched_tokens=64))
    long_prompt = engine.tokenizer.encode("A very long document about rivers and lakes. " * 60)[:600]
    short = engine.tokenizer.encode(PROMPTS[0])
    chunked.add_request("long", long_prompt, greedy(max_tokens=4))
    chunked.step()  # the long prefill starts and takes the whole budget
    chunked.add_request("short", short, greedy(max_tokens=6))
    short_tokens_during_long_prefill = 0
    long_seq = chunked.scheduler.find("long")
    while long_seq.num_computed_tokens < long_seq.num_prompt_tokens:
        outs = chunked.step()
        short_tokens_during_long_prefill += sum(len(o.new_token_ids) for o in outs if o.request_id == "short")
    assert short_tokens_during_long_prefill == 6  # the short request finished meanwhile
    while chunked.has_unfinished_requests():
        chunked.step()
    assert_pool_idle(chunked)


def test_an_abort_that_arrives_with_its_add_still_aborts(model_path):
    """A client that leaves while its request still waits to be added (the engine thread
    was busy with a long step): add and abort reach the engine thread in one batch."""
    from sluice.worker.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1))
    try:
        prompt = engine.engine.tokenizer.encode(PROMPTS[0])
        with engine._lock:  # the state the step thread finds after a long step
            engine._pending_adds.append(
                ("gone", prompt, greedy(max_tokens=1000, ignore_eos=True), None))
            engine._pending_aborts.append("gone")
        engine._wakeup.set()
        deadline = time.monotonic() + 30
        while (engine._pending_adds or engine.engine.has_unfinished_requests()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.engine.has_unfinished_requests()
        assert engine._thread.is_alive(), "the engine thread died on the batch"
        assert_pool_idle(engine.engine)
    finally:
        engine.shutdown()


def test_async_engine_reports_liveness_and_progress(model_path):
    """What the worker's health watch reads: ``alive()`` (the step thread) and the computed
    token count, which moves with every prefill chunk and decode step."""
    from sluice.worker.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1))
    try:
        assert engine.alive() and engine.stats().num_computed_tokens == 0
        prompt = engine.engine.tokenizer.encode(PROMPTS[0])

        async def run() -> None:
            async for _ in engine.generate(prompt, greedy(max_tokens=5), "r"):
                pass
        asyncio.run(run())
        assert engine.stats().num_computed_tokens == len(prompt) + 4
    finally:
        engine.shutdown()
    assert not engine.alive()
