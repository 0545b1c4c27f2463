"""Trying failed background work again, with a growing wait, until it is done or cpushim
drains: moves the runtime refused (shim/engine/core.py), projection writes that failed
(shim/engine/projecting.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Final

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
