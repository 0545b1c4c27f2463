"""How far start-up has got: what it is doing, how many of how many, and a count of every step.

The resync reports here as it goes; ``shim.run`` reads it to tell systemd that start-up is
still moving (``EXTEND_TIMEOUT_USEC=``) and what it is at (``STATUS=``). Nothing here does
I/O: it is a few counters, read and written on the event loop.
"""

from __future__ import annotations

__all__ = ["StartupProgress"]


class StartupProgress:
    """The current phase of start-up (``"resync"``), how many of its items (``"sandboxes"``)
    are done and of how many, and ``steps``: every phase begun and item done since start,
    which only grows, so that two looks that see the same ``steps`` saw no progress between
    them."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.items = ""
        self.done = 0
        self.total: int | None = None
        self.steps = 0

    def begin(self, phase: str, total: int | None = None, items: str = "") -> None:
        """A new phase of ``total`` ``items`` (None: not counted), none done yet."""
        self.phase = phase
        self.items = items
        self.done = 0
        self.total = total
        self.steps += 1

    def advance(self, count: int = 1) -> None:
        """``count`` more items of the phase are done."""
        self.done += count
        self.steps += count

    def describe(self) -> str:
        """One line for ``systemctl status``: ``"resync: 40 of 120 sandboxes"``."""
        if self.total is None:
            return self.phase
        return f"{self.phase}: {self.done} of {self.total} {self.items}".rstrip()
