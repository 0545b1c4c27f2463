"""Trying failed background work again, with a growing wait, until it is done or cpushim
drains or stops: moves the runtime refused and checkpoint writes that failed after the fact
(shim/engine/core.py), projection writes that failed (shim/engine/projecting.py), the
watcher's sweeps, watches and state directory (shim/engine/watching.py), a refused config
file and the config directory's watch (shim/engine/reloading.py), a refused re-plan for the
CPUs online (shim/engine/hotplug.py). The move records' own waits (shim/engine/moves.py)
grow up to the same ``MAX_RETRY_DELAY``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final

# The wait between attempts doubles up to this.
MAX_RETRY_DELAY: Final = 60.0


async def retry_until_done(
    attempt: Callable[[], Awaitable[bool]],
    first_delay: float,
    stop: asyncio.Event,
    hurry: asyncio.Event,
) -> None:
    """Run ``attempt`` after ``first_delay``, then after twice as long each time (up to
    ``MAX_RETRY_DELAY``), until it returns True or ``stop`` is set; ``stop`` ends a wait at
    once. So does ``hurry``, which is then cleared, the waits starting over from
    ``first_delay``: what held the work up has gone."""
    delay = first_delay
    while True:
        await _until_either(stop, hurry, delay)
        hurried = hurry.is_set()
        hurry.clear()
        if stop.is_set() or await attempt():
            return
        delay = first_delay if hurried else min(delay * 2, MAX_RETRY_DELAY)


async def _until_either(first: asyncio.Event, second: asyncio.Event, wait: float) -> None:
    waits = {asyncio.ensure_future(first.wait()), asyncio.ensure_future(second.wait())}
    try:
        await asyncio.wait(waits, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()


class Retry:
    """At most one background ``retry_until_done`` of ``attempt`` at a time, started by
    ``soon()``. ``first_delay`` may be a callable, read at each start: the engine's options
    are replaced while it runs."""

    def __init__(
        self,
        attempt: Callable[[], Awaitable[bool]],
        first_delay: float | Callable[[], float],
        stop: asyncio.Event,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._attempt = attempt
        self._first_delay = first_delay
        self._stop = stop
        self._spawn = spawn
        self._task: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()

    @property
    def running(self) -> bool:
        return self._task is not None

    def soon(self) -> None:
        """Start trying again, unless a retry runs already (it tries the new failure too) or
        ``stop`` is set."""
        if self._task is None and not self._stop.is_set():
            self._task = self._spawn(self._run())

    def hurry(self) -> None:
        """Have the running retry try now, its waits starting over from the first delay:
        what failed may go through now (a runtime that did not answer answers again). No
        retry running: nothing to do."""
        if self._task is not None:
            self._hurry.set()

    def end(self) -> None:
        """End the running retry now, its work done otherwise, without waiting for it: it
        is cut where it is, its attempt too (only for attempts that are safe to cut), and a
        ``soon()`` from here on starts a new one."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    async def cancel(self) -> None:
        """Cut the running retry, its attempt too, and wait for it to end: only for
        attempts that are safe to cut."""
        task = self._task
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # A task cancelled before it ran never reaches its finally.
        if self._task is task:
            self._task = None

    async def _run(self) -> None:
        first_delay = self._first_delay() if callable(self._first_delay) else self._first_delay
        try:
            await retry_until_done(self._attempt, first_delay, self._stop, self._hurry)
        finally:
            # Not a new one started after end().
            if self._task is asyncio.current_task():
                self._task = None
                # Set during its last attempt: the next retry waits its first delay.
                self._hurry.clear()
