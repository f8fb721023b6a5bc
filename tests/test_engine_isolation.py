"""One request must never hurt another (issue 10, items 1 and 2), inside the engine.

- Sampling parameters are normalized like vLLM's, so no finite temperature reaches the
  sampler as a division by zero.
- A fault in one sequence's sampling, draft verification or detokenization finishes that
  sequence alone (finish_reason "error", blocks freed); the rest of the batch goes on with
  exactly the tokens it gets when run alone. The faults are real: parameters set past the
  engine's checks (a NaN temperature makes torch.multinomial raise), and a stop string whose
  own method raises in the detokenizer. Nothing is mocked; the verification test wraps the
  real ``verify`` with a spy only to prove that is where the fault was raised.
- The scheduler shares the batch fairly between API requests (groups), and its block
  accounting holds under many small requests, preemption and aborts (property tests over
  seeded random workloads, no model needed): every step, each block's reference count is the
  number of tables holding it; at idle, free blocks == total blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from sluice.worker.engine import EngineConfig
from sluice.worker.engine import llm_engine as llm_engine_module
from sluice.worker.engine.fair_queue import FairQueue
from sluice.worker.engine.scheduler import Scheduler
from sluice.worker.engine.sequence import Sequence, SequenceStatus
from sluice.worker.sampling_params import (
    InvalidSamplingParams,
    SamplingParams,
    check_fits,
)

# --------------------------------------------------------------------------- parameters


def test_tiny_temperatures_are_greedy_or_raised_like_vllm():
    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(temperature=1e-300).temperature == 0.0
    assert SamplingParams(temperature=5e-6, top_p=0.5, top_k=3).top_k == 0  # greedy: off
    assert SamplingParams(temperature=1e-3).temperature == 1e-2  # vLLM's _MAX_TEMP
    assert SamplingParams(temperature=0.7).temperature == 0.7
    assert not SamplingParams(temperature=1e-2).greedy


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1.0),
    ("temperature", 2.5), ("top_p", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("seed", 2**64), ("logprobs", -1), ("stop", [""]),
    ("stop_token_ids", [-1]),
])
def test_out_of_range_parameters_are_refused_naming_the_field(field, value):
    params = SamplingParams(max_tokens=4, **{field: value})
    with pytest.raises(InvalidSamplingParams) as info:
        check_fits([1, 2, 3], params, 100)
    assert info.value.param == field and field in str(info.value)


# --------------------------------------------------------------------------- fair queue


_prompts = itertools.count(1)


def seq(request_id: str, group: str | None = None, prompt_len: int = 5,
        max_tokens: int = 3) -> Sequence:
    """A sequence with a prompt of its own (no prefix-cache hits between them)."""
    first = next(_prompts) * 1000
    return Sequence(request_id, list(range(first, first + prompt_len)),
                    SamplingParams(max_tokens=max_tokens, temperature=0.0), None, group)


def test_fair_queue_goes_round_robin_between_groups():
    q = FairQueue()
    big = [seq(f"big-{i}", "big") for i in range(5)]
    for s in big:
        q.append(s)
    small = seq("small")
    q.append(small)
    order = []
    while q:
        group = next(q.groups())
        order.append(q.pop(group).request_id)
    assert order == ["big-0", "small", "big-1", "big-2", "big-3", "big-4"]


def test_fair_queue_remove_and_push_front():
    q = FairQueue()
    a, b, c = seq("a", "g"), seq("b", "g"), seq("c", "h")
    for s in (a, b, c):
        q.append(s)
    assert q.remove(b) and not q.remove(b) and len(q) == 2 and b not in q
    q.push_front(b, resume_first=False)  # keeps g's place in the rotation, first in g
    assert [s.request_id for s in q] == ["b", "a", "c"]
    q.remove(a), q.remove(b)
    q.push_front(a, resume_first=True)  # g was gone: now first in the rotation
    assert list(q.groups()) == ["g", "h"]


# --------------------------------------------------------------------------- scheduler


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64,
              block_size: int = 4, prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(model="unused", block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget,
                          long_prefill_token_threshold=budget // 2,
                          enable_prefix_caching=prefix_caching)
    return Scheduler(config, num_blocks)


def check_block_accounting(s: Scheduler) -> None:
    """Each block's ref count is the number of tables holding it; free == unreferenced."""
    pool = s.block_manager
    holders = [0] * pool.num_blocks
    for r in s.running:
        assert r.status == SequenceStatus.RUNNING
        for block in r.block_table:
            holders[block] += 1
    for w in s.waiting:
        assert w.status == SequenceStatus.WAITING and not w.block_table
    assert holders == pool._ref_cnt
    assert set(pool._free) == {b for b, n in enumerate(holders) if n == 0}
    assert len(s.running) <= s.max_num_seqs


def step(s: Scheduler, rng: random.Random) -> list[Sequence]:
    """One simulated engine step: schedule, 'run', append a token to every sequence that
    reached its end, finish those at max_tokens. Returns the sequences that finished."""
    return advance(s, s.schedule(), rng)


def advance(s: Scheduler, scheduled: list[tuple[Sequence, int]], rng: random.Random
            ) -> list[Sequence]:
    assert sum(n for _, n in scheduled) <= s.max_num_batched_tokens
    for r, n in scheduled:
        assert s.block_manager.blocks_for(r.num_computed_tokens + n) <= len(r.block_table)
    done = []
    for r, n in scheduled:
        if r.num_computed_tokens + n == r.num_tokens:
            r.token_ids.append(rng.randrange(1, 50))
    s.on_computed(scheduled)
    for r, _ in scheduled:
        if r.num_output_tokens >= r.params.max_tokens:
            s.finish(r, SequenceStatus.FINISHED_LENGTH)
            done.append(r)
    return done


@pytest.mark.parametrize("seed", range(60))
def test_block_accounting_under_small_requests_preemption_and_aborts(seed):
    """Random workloads on a small pool: many small requests and a few fanned-out ones
    arrive over time, some abort, the pool is tight enough to preempt. Every step the
    accounting holds; at idle every block is free."""
    rng = random.Random(seed)
    s = scheduler(num_blocks=rng.randint(12, 40), max_num_seqs=rng.randint(2, 10),
                  budget=rng.choice([8, 16, 64]), block_size=rng.choice([2, 4]),
                  prefix_caching=rng.random() < 0.7)
    capacity = s.block_manager.num_blocks * s.block_manager.block_size
    live: dict[str, Sequence] = {}
    finished: set[str] = set()
    steps = 0
    for arrival in range(40):
        for j in range(rng.choice([1, 1, 1, 3, 8])):  # a request fans out into j sequences
            prompt_len = rng.randint(1, min(20, capacity // 2))
            r = Sequence(f"r{arrival}-{j}", [rng.randrange(1, 6) for _ in range(prompt_len)],
                         SamplingParams(max_tokens=rng.randint(1, min(12, capacity // 2)),
                                        temperature=0.0), None, f"r{arrival}")
            s.add(r)
            live[r.request_id] = r
        for _ in range(rng.randint(0, 3)):
            finished.update(r.request_id for r in step(s, rng))
            steps += 1
            check_block_accounting(s)
        if live and rng.random() < 0.2:  # a client leaves
            victim = rng.choice([r for r in live.values() if r.request_id not in finished])
            assert s.find(victim.request_id) is victim
            s.finish(victim, SequenceStatus.FINISHED_ABORTED)
            assert s.find(victim.request_id) is None
            finished.add(victim.request_id)
            check_block_accounting(s)
    while s.has_unfinished():
        finished.update(r.request_id for r in step(s, rng))
        check_block_accounting(s)
        steps += 1
        assert steps < 10_000, "the scheduler stopped making progress"
    assert finished == set(live)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert not s.running and not s.waiting and not s._running_of


def test_a_new_request_is_admitted_at_once_behind_thousands_of_one_requests_sequences():
    s = scheduler(num_blocks=256, max_num_seqs=8, budget=64)
    rng = random.Random(0)
    for i in range(2000):
        s.add(seq(f"big-{i}", "big", prompt_len=3, max_tokens=1))
    step(s, rng)
    small = seq("small", prompt_len=3, max_tokens=5)
    s.add(small)
    step(s, rng)
    assert small.status == SequenceStatus.RUNNING and small.num_output_tokens == 1
    while small.status == SequenceStatus.RUNNING:
        step(s, rng)
    assert small.num_output_tokens == 5
    assert len(s.waiting) > 1900  # it finished long before the big request
    assert s.num_preemptions == 0  # max_tokens 1: slots free up every step


def test_a_full_batch_of_one_requests_long_generations_makes_room_for_a_newcomer():
    s = scheduler(num_blocks=256, max_num_seqs=4, budget=64)
    rng = random.Random(0)
    big = [seq(f"big-{i}", "big", prompt_len=3, max_tokens=500) for i in range(6)]
    for b in big:
        s.add(b)
    for _ in range(3):
        step(s, rng)
    assert len(s.running) == 4
    small = seq("small", prompt_len=3, max_tokens=3)
    s.add(small)
    step(s, rng)
    assert small.status == SequenceStatus.RUNNING
    assert s.num_preemptions == 1 and big[3].status == SequenceStatus.WAITING
    assert big[3] is s.waiting.peek("big")  # first of its request to resume
    while small.status == SequenceStatus.RUNNING:
        step(s, rng)
        check_block_accounting(s)
    assert s.num_preemptions == 1  # no cycling


def test_one_requests_prompts_are_prefilled_like_one_long_prompt():
    """Alone, a request of many short prompts prefills long_prefill_token_threshold tokens a
    step (32 here); while other requests have work it gets an equal share of it (16 with one
    other request), as if its prompts were one long prompt, so the steps a small request
    waits for and decodes in stay short. A short prompt is never split for it, and a request of one
    sequence keeps its whole chunk."""
    s = scheduler(num_blocks=512, max_num_seqs=32, budget=64)
    assert s.long_prefill_token_threshold == 32
    rng = random.Random(0)
    for i in range(200):
        s.add(seq(f"big-{i}", "big", prompt_len=5, max_tokens=1))
    scheduled = s.schedule()
    assert sum(n for _, n in scheduled) == 30  # one chunk: 6 whole prompts, not the budget
    advance(s, scheduled, rng)
    small = seq("small", prompt_len=5, max_tokens=4)
    s.add(small)
    while small.status != SequenceStatus.FINISHED_LENGTH:
        scheduled = s.schedule()
        assert small in [r for r, _ in scheduled]
        assert sum(n for r, n in scheduled if r.group == "big") <= 16
        advance(s, scheduled, rng)
    long = seq("long", prompt_len=100, max_tokens=1)
    s.add(long)
    scheduled = s.schedule()
    assert dict((r.request_id, n) for r, n in scheduled)["long"] == 32  # its whole chunk
    assert sum(n for r, n in scheduled if r.group == "big") <= 16


def test_prefix_cache_counts_each_admitted_prompt_once():
    """A lookup undone because the request's prefill tokens are spent for the step (or the
    pool is short) is taken back out of the counters: /metrics' prefix-cache hit rate."""
    s = scheduler(num_blocks=512, max_num_seqs=32, budget=64)
    rng = random.Random(0)
    for i in range(50):
        s.add(seq(f"big-{i}", "big", prompt_len=5, max_tokens=1))
    while s.has_unfinished():
        step(s, rng)
    assert s.block_manager.prefix_cache_queries == 50 * 5 and s.num_preemptions == 0


def test_single_sequence_requests_keep_arrival_order_and_are_never_preempted_for_fairness():
    s = scheduler(num_blocks=256, max_num_seqs=2, budget=64)
    rng = random.Random(0)
    reqs = [seq(f"r{i}", prompt_len=3, max_tokens=4) for i in range(6)]
    for r in reqs:
        s.add(r)
    order = []
    while s.has_unfinished():
        order += [r.request_id for r in step(s, rng)]
    assert order == [f"r{i}" for i in range(6)]
    assert s.num_preemptions == 0


# --------------------------------------------------------------------------- engine


class RaisingStop(str):
    """A stop string whose own method raises: the detokenizer calls ``startswith`` on its
    stop strings while holding back text that could start one."""

    def startswith(self, *args, **kwargs):
        raise RuntimeError("stop string exploded")


@pytest.fixture(scope="module")
def engine(model_path):
    return llm_engine_module.LLMEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.25))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], after_add=None
        ) -> dict[str, list]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    if after_add:
        after_add()
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_idle(engine) -> None:
    pool = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks


def test_a_sampling_fault_fails_only_its_own_sequence(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = engine.generate([ids[0], ids[2]], greedy())
    bad = SamplingParams(max_tokens=12, temperature=0.8, seed=1)

    def break_it():  # past the engine's checks, as a validation bug would let it through
        bad.temperature = float("nan")

    outs = run(engine, {"good-0": (ids[0], greedy()), "bad": (ids[1], bad),
                        "good-2": (ids[2], greedy())}, after_add=break_it)
    assert outs["bad"][-1].finish_reason == "error" and outs["bad"][-1].finished
    assert "probability tensor" in outs["bad"][-1].error
    assert [tokens(outs["good-0"]), tokens(outs["good-2"])] == alone
    assert all(outs[g][-1].finish_reason == "length" for g in ("good-0", "good-2"))
    assert_idle(engine)


def test_a_detokenizer_fault_fails_only_its_own_sequence(engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = engine.generate([ids[0], ids[2]], greedy())
    outs = run(engine, {"good-0": (ids[0], greedy()),
                        "bad": (ids[1], greedy(stop=[RaisingStop("zz-never")])),
                        "good-2": (ids[2], greedy())})
    assert outs["bad"][-1].finish_reason == "error"
    assert "stop string exploded" in outs["bad"][-1].error
    assert [tokens(outs["good-0"]), tokens(outs["good-2"])] == alone
    assert_idle(engine)


def test_a_fault_while_verifying_drafts_fails_only_its_own_sequence(model_path, monkeypatch):
    engine = llm_engine_module.LLMEngine(EngineConfig(
        model=str(model_path), kv_cache_gib=0.1, speculative_method="ngram"))
    real_verify, raised = llm_engine_module.verify, []

    def spy(logits, drafts, params, generator):  # calls the real verify; records its faults
        try:
            return real_verify(logits, drafts, params, generator)
        except Exception as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(llm_engine_module, "verify", spy)
    repetitive = engine.tokenizer.encode("1 2 3 4 1 2 3 4 1 2 3 4 1 2 3 4 1 2 3")
    other = engine.tokenizer.encode(PROMPTS[0])
    alone = engine.generate([repetitive, other], greedy(max_tokens=16))
    bad = greedy(max_tokens=16)  # greedy first: its first token continues the pattern
    engine.add_request("bad", repetitive, bad)
    engine.add_request("good-r", repetitive, greedy(max_tokens=16))
    engine.add_request("good-o", other, greedy(max_tokens=16))
    outs: dict[str, list] = {"bad": [], "good-r": [], "good-o": []}
    for out in engine.step():  # prefill: the first tokens are sampled, no drafts yet
        outs[out.request_id].append(out)
    bad.temperature = float("nan")  # the next step verifies drafts with it
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    assert raised, "the fault was not raised while verifying drafts"
    assert outs["bad"][-1].finish_reason == "error"
    assert [tokens(outs["good-r"]), tokens(outs["good-o"])] == alone
    assert engine.num_accepted_tokens > 0
    assert_idle(engine)


def test_async_engine_fails_one_request_while_a_concurrent_one_completes(model_path):
    from sluice.worker.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1))
    try:
        ids = engine.tokenizer.encode(PROMPTS[0])

        async def collect(params: SamplingParams, rid: str) -> list:
            return [o async for o in engine.generate(ids, params, rid)]

        async def go():
            return await asyncio.gather(
                collect(greedy(max_tokens=30), "good"),
                collect(greedy(stop=[RaisingStop("zz")]), "bad"), return_exceptions=True)

        good, bad = asyncio.run(go())
        assert isinstance(bad, RuntimeError) and "stop string exploded" in str(bad)
        assert not isinstance(good, BaseException), good
        assert good[-1].finish_reason == "length" and good[-1].num_output_tokens == 30
        stats = engine.stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()


class UnmeasurableStop(str):
    """A stop string that passes the checks but cannot be measured: the detokenizer, built
    when the engine thread adds the request, takes the length of each stop string."""

    def __bool__(self):
        return True

    def __len__(self):
        raise RuntimeError("no length")


def test_async_engine_keeps_serving_after_a_request_it_cannot_add(model_path):
    from sluice.worker.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=str(model_path), kv_cache_gib=0.1))
    try:
        ids = engine.tokenizer.encode(PROMPTS[0])

        async def go():
            return await asyncio.gather(
                _collect(engine, ids, greedy(max_tokens=20), "good"),
                _collect(engine, ids, greedy(stop=[UnmeasurableStop("x")]), "bad"),
                return_exceptions=True)

        good, bad = asyncio.run(go())
        assert isinstance(bad, RuntimeError) and "no length" in str(bad)
        assert good[-1].num_output_tokens == 20
        after = asyncio.run(_collect(engine, ids, greedy(max_tokens=3), "after"))
        assert after[-1].num_output_tokens == 3
    finally:
        engine.shutdown()


async def _collect(engine, ids, params, rid) -> list:
    return [o async for o in engine.generate(ids, params, rid)]
