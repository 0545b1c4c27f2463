"""Telling whether a read waits on a FIFO put where a file should be, without a time bound."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tests.harness.containerd import wait_for

_T = TypeVar("_T")


def waiting_for_a_fifo_writer(thread_id: int) -> bool:
    """Whether the thread is blocked in open(2) of a FIFO, waiting for the other end."""
    try:
        return Path(f"/proc/self/task/{thread_id}/wchan").read_text() == "wait_for_partner"
    except OSError:
        return False


def without_waiting_on(fifo: Path, call: Callable[[], _T]) -> _T:
    """``call()``'s result, run in a thread; AssertionError when it waits for a writer of
    ``fifo`` instead (the thread is then let go by opening the FIFO's other end)."""
    results: list[_T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(call())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread_id = thread.native_id
    assert thread_id is not None
    blocked = False
    try:
        wait_for(
            lambda: not thread.is_alive() or waiting_for_a_fifo_writer(thread_id), 10, "the call"
        )
        blocked = thread.is_alive()
    finally:
        if thread.is_alive():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
    assert not blocked, f"the call waited for a writer of the FIFO {fifo}"
    if errors:
        raise errors[0]
    return results[0]
