"""Admission control: bounded per-model queues, priority then earliest deadline first,
429 when full, removal in every exit path (no servers)."""

from __future__ import annotations

import asyncio

import pytest

from sluice.router.admission import AdmissionQueue, Rejected


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_fast_path_when_queue_empty_and_gate_open():
    async def scenario():
        q = AdmissionQueue(max_queue=2)
        assert await q.admit("m", "r", 0, 1.0, gate=lambda r: True) == 0.0
        assert q.waiting("m") == 0 and q.models() == []
    run(scenario())


def test_edf_within_priority_and_priority_first():
    async def scenario():
        q: AdmissionQueue[str] = AdmissionQueue(max_queue=10)
        order: list[str] = []
        closed = lambda r: False  # noqa: E731

        async def client(name, priority, deadline):
            await q.admit("m", name, priority, deadline, closed)
            order.append(name)

        tasks = [asyncio.create_task(client(*args)) for args in (
            ("late", 0, 30.0), ("early", 0, 10.0), ("urgent-class", -1, 99.0), ("mid", 0, 20.0))]
        await settle()
        assert q.waiting("m") == 4
        while q.kick("m", lambda r: True) is not None:
            await settle()
        await asyncio.gather(*tasks)
        assert order == ["urgent-class", "early", "mid", "late"]
        assert q.models() == []  # the empty queue is dropped
    run(scenario())


def test_a_queued_request_blocks_the_fast_path_of_later_ones():
    """FIFO fairness: with someone waiting, a newcomer queues even if the gate is open."""
    async def scenario():
        q: AdmissionQueue[str] = AdmissionQueue(max_queue=10)
        gate_open = False
        first = asyncio.create_task(q.admit("m", "a", 0, 1.0, lambda r: gate_open))
        await settle()
        gate_open = True
        second = asyncio.create_task(q.admit("m", "b", 0, 2.0, lambda r: gate_open))
        await settle()
        assert not second.done() and q.waiting("m") == 2
        q.kick("m", lambda r: gate_open)
        await settle()
        assert first.done() and not second.done()
        q.kick("m", lambda r: gate_open)
        await asyncio.gather(first, second)
    run(scenario())


def test_full_queue_rejects_at_once_with_retry_after():
    events = []

    async def scenario():
        q: AdmissionQueue[str] = AdmissionQueue(max_queue=2, retry_after=lambda m: 2.3,
                                                on_change=lambda *e: events.append(e))
        waiters = [asyncio.create_task(q.admit("m", str(i), 0, 1.0, lambda r: False))
                   for i in range(2)]
        await settle()
        with pytest.raises(Rejected) as info:
            await q.admit("m", "x", 0, 1.0, lambda r: False)
        assert info.value.reason == "queue_full" and info.value.retry_after_s == 3
        assert q.waiting("m") == 2
        other = await q.admit("other-model", "y", 0, 1.0, lambda r: True)  # own queue
        assert other == 0.0
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert q.waiting("m") == 0 and q.models() == []
    run(scenario())
    assert ("m", 2, "queue_full") in events


def test_zero_queue_rejects_whatever_the_gate_refuses():
    async def scenario():
        q: AdmissionQueue[str] = AdmissionQueue(max_queue=0)
        assert await q.admit("m", "a", 0, 1.0, lambda r: True) == 0.0
        with pytest.raises(Rejected):
            await q.admit("m", "b", 0, 1.0, lambda r: False)
    run(scenario())


def test_queue_timeout_rejects_and_leaves_the_queue():
    async def scenario():
        q: AdmissionQueue[str] = AdmissionQueue(max_queue=4, queue_timeout=0.05)
        with pytest.raises(Rejected) as info:
            await q.admit("m", "a", 0, 1.0, lambda r: False)
        assert info.value.reason == "queue_timeout" and info.value.retry_after_s >= 1
        assert q.waiting("m") == 0 and q.models() == []
    run(scenario())


def test_cancelled_waiters_leave_the_heap_at_once():
    """A client that disconnects while queued frees its slot immediately (bounded state)."""
    async def scenario():
        q: AdmissionQueue[int] = AdmissionQueue(max_queue=3)
        for round_ in range(50):
            tasks = [asyncio.create_task(q.admit("m", i, 0, float(i), lambda r: False))
                     for i in range(3)]
            await settle()
            assert q.waiting("m") == 3
            tasks[1].cancel()  # from the middle of the heap
            await settle()
            assert q.waiting("m") == 2
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert q.waiting("m") == 0 and q.models() == []
    run(scenario())


def test_kick_releases_one_at_a_time_and_only_through_the_gate():
    async def scenario():
        q: AdmissionQueue[int] = AdmissionQueue(max_queue=10)
        tasks = [asyncio.create_task(q.admit("m", i, 0, float(i), lambda r: False))
                 for i in range(3)]
        await settle()
        assert q.kick("m", lambda r: r == 99) is None  # the gate refuses the head
        assert q.kick("m", lambda r: True) == 0  # the released request
        await settle()
        assert [t.done() for t in tasks] == [True, False, False]
        q.kick_all(lambda model: (lambda r: True))
        q.kick_all(lambda model: (lambda r: True))
        await asyncio.gather(*tasks)
        assert q.kick("m", lambda r: True) is None and q.kick("nope", lambda r: True) is None
    run(scenario())


def test_bad_settings():
    with pytest.raises(ValueError):
        AdmissionQueue(max_queue=-1)
    with pytest.raises(ValueError):
        AdmissionQueue(queue_timeout=0)
