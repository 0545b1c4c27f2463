"""Trying failed background work again, with a growing wait, until it is done or cpushim
drains or stops: moves the runtime refused and checkpoint writes that failed after the fact
(shim/engine/core.py), projection writes that failed (shim/engine/projecting.py), the
watcher's sweeps, watches and state directory (shim/engine/watching.py), a refused config
file and the config directory's watch (shim/engine/reloading.py), a refused re-plan for the
CPUs online (shim/engine/hotplug.py). The move records' own waits (shim/engine/moves.py)
grow up to the same ``MAX_RETRY_DELAY``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final

# The wait between attempts doubles up to this.
MAX_RETRY_DELAY: Final = 60.0


async def retry_until_done(
    attempt: Callable[[], Awaitable[bool]], first_delay: float, stop: asyncio.Event
) -> None:
    """Run ``attempt`` after ``first_delay``, then after twice as long each time (up to
    ``MAX_RETRY_DELAY``), until it returns True or ``stop`` is set; ``stop`` ends a wait at
    once."""
    delay = first_delay
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set() or await attempt():
            return
        delay = min(delay * 2, MAX_RETRY_DELAY)


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

    @property
    def running(self) -> bool:
        return self._task is not None

    def soon(self) -> None:
        """Start trying again, unless a retry runs already (it tries the new failure too) or
        ``stop`` is set."""
        if self._task is None and not self._stop.is_set():
            self._task = self._spawn(self._run())

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
            await retry_until_done(self._attempt, first_delay, self._stop)
        finally:
            # Not a new one started after end().
            if self._task is asyncio.current_task():
                self._task = None
