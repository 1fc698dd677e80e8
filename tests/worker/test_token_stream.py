"""TokenBuffer and Waker without a server: the engine never waits, the bound cancels once, an
async consumer is woken once per loop turn and takes what piled up in one go."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gpu_worker.core.token_stream import TokenBuffer, Waker, overflow_error
from services.common.errors import InvalidArgument, ResourceExhausted

END = object()


def test_a_full_buffer_cancels_its_sequence_once_and_drops_later_tokens():
    cancels = []
    buffer = TokenBuffer(limit=3)
    buffer.on_overflow = lambda: cancels.append(1)
    for token in range(10):     # no consumer at all: every put returns at once
        buffer.put(token)
    assert cancels == [1], "the overflow must cancel the sequence exactly once"
    taken = buffer.take_nowait()
    assert taken.tokens == [0, 1, 2] and taken.overflowed, "held more than the bound"
    assert buffer.peak == 3


def test_a_consumer_that_keeps_up_never_overflows():
    buffer = TokenBuffer(limit=2)
    got = []
    for token in range(100):
        buffer.put(token)
        got.extend(buffer.take_nowait().tokens)
    buffer.put(END)
    assert got == list(range(100)) and buffer.take_nowait().ended and not buffer.overflowed


def test_an_engine_error_reaches_the_consumer_and_ends_the_stream():
    buffer = TokenBuffer(limit=8)
    buffer.put(1)
    buffer.put(RuntimeError("step failed"))
    taken = buffer.get(timeout=5)
    assert taken.tokens == [1] and taken.ended and isinstance(taken.error, RuntimeError)


@pytest.mark.parametrize("limit", [0, -1, (1 << 20) + 1])
def test_a_buffer_bound_outside_its_range_is_invalid_argument(limit):
    with pytest.raises(InvalidArgument):
        TokenBuffer(limit=limit)


def test_the_overflow_status_names_the_bound_and_how_to_fix_it():
    err = overflow_error(8)
    assert isinstance(err, ResourceExhausted)
    assert "--max-stream-buffer-tokens 8" in err.message and "raise the bound" in err.message


def test_a_stream_interval_holds_tokens_after_the_first_until_it_fills_or_the_stream_ends():
    buffer = TokenBuffer(limit=16, interval=3)
    buffer.put(10)
    assert buffer.get(timeout=0).tokens == [10], "the first token must not wait for others"
    buffer.put(11)
    buffer.put(12)
    assert buffer.get(timeout=0.01).tokens == [11, 12], "a timed-out get takes what is there"
    for token in (13, 14):
        buffer.put(token)
    assert not buffer._has_news(), "2 tokens of an interval of 3 are no news yet"
    buffer.put(15)
    assert buffer.get(timeout=0).tokens == [13, 14, 15]
    buffer.put(16)
    buffer.put(END)
    taken = buffer.get(timeout=0)
    assert taken.tokens == [16] and taken.ended, "the end hands over the rest at once"


@pytest.mark.parametrize("limit,interval", [(16, 0), (16, 17), (4096, 1025)])
def test_a_stream_interval_outside_1_to_the_bound_is_invalid_argument(limit, interval):
    with pytest.raises(InvalidArgument, match="stream interval"):
        TokenBuffer(limit=limit, interval=interval)


def test_an_async_consumer_is_woken_once_an_interval_fills_not_for_each_token():
    async def scenario() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        waker = Waker(loop)
        buffer = TokenBuffer(limit=64, waker=waker, interval=4)
        wakes = []
        original = buffer._wake_on_loop
        buffer._wake_on_loop = lambda: (wakes.append(1), original())[1]
        got: list[list[int]] = []
        first = threading.Event()   # the first take happened: the first token went alone

        async def consume():
            while True:
                taken = await buffer.take()
                if taken.tokens:
                    got.append(taken.tokens)
                    first.set()
                if taken.ended:
                    return

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)

        def produce():
            buffer.put(0)
            first.wait(10)          # a loaded machine may wake the loop late: wait, not sleep
            for token in range(1, 10):
                buffer.put(token)
                time.sleep(0.002)   # the consumer is parked before each put, mostly
            buffer.put(END)

        await loop.run_in_executor(None, produce)
        await asyncio.wait_for(task, 10)
        return got, len(wakes)

    got, wakes = asyncio.run(scenario())
    assert [t for chunk in got for t in chunk] == list(range(10)) and got[0] == [0], got
    # on a loaded machine a late consumer takes more than 4 at once, never fewer before the end
    assert all(len(chunk) >= 4 for chunk in got[1:-1]) and len(got) <= 4, got
    assert wakes <= len(got) + 1, f"{wakes} loop wake-ups for {len(got)} takes and the end"


def test_many_streams_advancing_in_one_step_cost_one_loop_wakeup():
    async def scenario() -> tuple[int, list[list[int]]]:
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)
        loop.call_soon_threadsafe = counting   # type: ignore[method-assign]
        waker = Waker(loop)
        buffers = [TokenBuffer(64, waker) for _ in range(50)]
        takers = [asyncio.ensure_future(b.take()) for b in buffers]
        await asyncio.sleep(0)                  # every consumer now waits

        def engine_step() -> None:              # one step: a token for every stream
            for b in buffers:
                b.put(7)
        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()
        taken = await asyncio.wait_for(asyncio.gather(*takers), 10)
        return calls, [t.tokens for t in taken]
    calls, tokens = asyncio.run(scenario())
    assert tokens == [[7]] * 50
    assert calls == 1, f"{calls} loop wake-ups for one step of 50 streams"


def test_a_consumer_busy_writing_takes_what_piled_up_in_one_message():
    async def scenario() -> list[list[int]]:
        waker = Waker(asyncio.get_running_loop())
        buffer = TokenBuffer(64, waker)
        buffer.put(1)
        first = await buffer.take()             # then "writes" while the engine goes on
        thread = threading.Thread(target=lambda: [buffer.put(t) for t in (2, 3, 4, 5)])
        thread.start()
        thread.join()
        second = await asyncio.wait_for(buffer.take(), 10)
        return [first.tokens, second.tokens]
    assert asyncio.run(scenario()) == [[1], [2, 3, 4, 5]]


def test_an_overflow_reaches_the_loop_even_while_the_consumer_is_not_waiting():
    async def scenario() -> bool:
        loop = asyncio.get_running_loop()
        heard = asyncio.Event()
        buffer = TokenBuffer(2, Waker(loop))
        buffer.on_overflow_loop = heard.set
        thread = threading.Thread(target=lambda: [buffer.put(t) for t in range(5)])
        thread.start()
        thread.join()
        await asyncio.wait_for(heard.wait(), 10)
        return buffer.overflowed
    assert asyncio.run(scenario())
