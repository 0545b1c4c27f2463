"""The one background retry at a time of shim/engine/retrying.py."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from shim.engine.retrying import Retry
from tests.unit.engine_env import until

pytestmark = pytest.mark.anyio


class Attempts:
    """An attempt that counts its calls and is done once ``done`` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.done = False

    async def __call__(self) -> bool:
        self.calls += 1
        return self.done


class Spawner:
    """Spawns as the engine does, and keeps the tasks for the test to see."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def __call__(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.append(task)
        return task


class Delay:
    """A first delay read at each start: once read, the retry waits."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.seconds


async def test_soon_starts_one_retry_that_tries_until_done_and_then_clears() -> None:
    attempt, spawn = Attempts(), Spawner()
    retry = Retry(attempt, 0.001, asyncio.Event(), spawn)
    assert not retry.running
    retry.soon()
    assert retry.running
    await until(lambda: attempt.calls >= 2, "tried twice")
    assert retry.running
    attempt.done = True
    await until(lambda: not retry.running, "the retry ended")
    assert len(spawn.tasks) == 1
    assert spawn.tasks[0].done()
    calls = attempt.calls
    retry.soon()  # a later failure starts another
    assert retry.running
    assert len(spawn.tasks) == 2
    await until(lambda: not retry.running, "the second retry ended")
    assert attempt.calls == calls + 1


async def test_a_second_soon_while_one_runs_starts_none() -> None:
    attempt, spawn = Attempts(), Spawner()
    delay = Delay(3600)
    retry = Retry(attempt, delay, asyncio.Event(), spawn)
    retry.soon()
    retry.soon()
    assert len(spawn.tasks) == 1
    await until(lambda: delay.reads == 1, "waiting")
    retry.soon()
    assert len(spawn.tasks) == 1
    await retry.cancel()


async def test_a_stopped_retry_does_not_start() -> None:
    attempt, spawn = Attempts(), Spawner()
    stop = asyncio.Event()
    stop.set()
    retry = Retry(attempt, 0.001, stop, spawn)
    retry.soon()
    assert not retry.running
    assert spawn.tasks == []


async def test_a_stop_ends_a_wait_without_another_try() -> None:
    attempt, spawn = Attempts(), Spawner()
    stop = asyncio.Event()
    delay = Delay(3600)
    retry = Retry(attempt, delay, stop, spawn)
    retry.soon()
    await until(lambda: delay.reads == 1, "waiting its hour")
    stop.set()
    await until(lambda: not retry.running, "the retry ended")
    assert attempt.calls == 0


async def test_a_callable_first_delay_is_read_at_each_start() -> None:
    attempt, spawn = Attempts(), Spawner()
    attempt.done = True
    delay = Delay(3600)
    retry = Retry(attempt, delay, asyncio.Event(), spawn)
    retry.soon()
    await until(lambda: delay.reads == 1, "waiting its hour")
    await retry.cancel()
    delay.seconds = 0.001
    retry.soon()
    await until(lambda: not retry.running, "tried after the new delay")
    assert delay.reads == 2
    assert attempt.calls == 1


async def test_a_retry_cancelled_before_it_ran_is_cleared() -> None:
    """Its coroutine never starts, so its own finally never clears it."""
    attempt, spawn = Attempts(), Spawner()
    retry = Retry(attempt, 0.001, asyncio.Event(), spawn)
    retry.soon()
    await retry.cancel()
    assert not retry.running
    assert spawn.tasks[0].cancelled()
    attempt.done = True
    retry.soon()
    assert retry.running
    await until(lambda: not retry.running, "a new one ran")
    assert attempt.calls == 1


async def test_end_cuts_the_running_retry_at_once_and_a_soon_after_starts_another() -> None:
    attempt, spawn = Attempts(), Spawner()
    delay = Delay(3600)
    retry = Retry(attempt, delay, asyncio.Event(), spawn)
    retry.soon()
    await until(lambda: delay.reads == 1, "waiting its hour")
    retry.end()
    assert not retry.running
    # A failure right after: its retry starts, even before the cut one has ended ...
    retry.soon()
    assert retry.running
    assert len(spawn.tasks) == 2
    await until(lambda: spawn.tasks[0].done(), "the cut retry ended")
    assert spawn.tasks[0].cancelled()
    # ... and the cut one's end does not clear it.
    assert retry.running
    assert attempt.calls == 0
    await retry.cancel()
    retry.end()  # with none running, nothing to do
    assert not retry.running


async def test_hurry_tries_now_and_starts_the_waits_over() -> None:
    """A move retry whose wait grew to a minute while a runtime did not answer tries at once
    when it answers again; with no retry running there is nothing to hurry."""
    attempt, spawn = Attempts(), Spawner()
    delay = Delay(3600)
    retry = Retry(attempt, delay, asyncio.Event(), spawn)
    retry.hurry()  # none running: nothing to hurry
    assert not retry.running
    retry.soon()
    await until(lambda: delay.reads == 1, "waiting its hour")
    retry.hurry()
    await until(lambda: attempt.calls == 1, "tried at once")
    assert retry.running  # failed: it waits again
    attempt.done = True
    retry.hurry()
    await until(lambda: not retry.running, "done")
    assert attempt.calls == 2


async def test_a_hurry_during_an_attempt_tries_once_more_at_once() -> None:
    """What held the work up went while it was being tried: the next try does not wait."""
    spawn = Spawner()
    calls = 0
    retry: Retry

    async def attempt() -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            retry.hurry()
            return False
        return True

    delay = Delay(3600)
    retry = Retry(attempt, delay, asyncio.Event(), spawn)
    retry.soon()
    await until(lambda: delay.reads == 1, "waiting its hour")
    retry.hurry()
    await until(lambda: not retry.running, "tried twice without waiting")
    assert calls == 2


async def test_after_a_hurry_the_waits_start_over_from_the_first_delay() -> None:
    attempt, spawn = Attempts(), Spawner()
    retry = Retry(attempt, 0.001, asyncio.Event(), spawn)
    retry.soon()
    # Waits of 1, 2, ... 512 ms so far: the next is about a second, the one after two.
    await until(lambda: attempt.calls >= 11, "the wait grown to a second")
    retry.hurry()
    await until(lambda: attempt.calls >= 12, "tried at once", deadline=0.5)
    await until(lambda: attempt.calls >= 13, "tried again after the first delay", deadline=0.5)
    await retry.cancel()
