"""inotify on the asyncio loop (pyinotify underneath), with many subscribers per path.

The kernel keeps one watch per inode and pyinotify ignores a second ``add_watch`` of a watched
path, while cpushim may watch one directory for several reasons (a pod's cgroup is the parent
of each of its containers'). This adapter keeps one kernel watch per path with the union of
the subscribers' masks, hands each event to the subscribers whose mask has it, and drops the
kernel watch with the last subscriber.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import pyinotify

log = logging.getLogger(__name__)

IN_MODIFY: Final[int] = pyinotify.IN_MODIFY
IN_CLOSE_WRITE: Final[int] = pyinotify.IN_CLOSE_WRITE
IN_ATTRIB: Final[int] = pyinotify.IN_ATTRIB
IN_MOVED_FROM: Final[int] = pyinotify.IN_MOVED_FROM
IN_MOVED_TO: Final[int] = pyinotify.IN_MOVED_TO
IN_CREATE: Final[int] = pyinotify.IN_CREATE
IN_DELETE: Final[int] = pyinotify.IN_DELETE
IN_DELETE_SELF: Final[int] = pyinotify.IN_DELETE_SELF
IN_MOVE_SELF: Final[int] = pyinotify.IN_MOVE_SELF
IN_IGNORED: Final[int] = pyinotify.IN_IGNORED
IN_Q_OVERFLOW: Final[int] = pyinotify.IN_Q_OVERFLOW

# On a directory: every way a file in it is written, replaced by rename, made or removed. For
# files (the state, the config) that editors and cpushim itself replace by rename.
FILE_CHANGES: Final[int] = IN_CLOSE_WRITE | IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE | IN_CREATE


@dataclass(frozen=True)
class Event:
    path: str
    # The entry's name for an event on a directory's child; "" for the watched path itself.
    name: str
    mask: int


Callback = Callable[[Event], None]


class WatchError(OSError):
    """The kernel would not place a watch (path gone, out of watches)."""


@dataclass(eq=False)
class Subscription:
    path: str
    mask: int
    callback: Callback


@dataclass
class _Watched:
    wd: int
    mask: int
    subscriptions: list[Subscription] = field(default_factory=list)


class Inotify:
    """One inotify instance serving many subscriptions. ``on_overflow`` runs when the
    kernel's queue overflowed: events were lost, the caller must look again itself."""

    def __init__(self, on_overflow: Callable[[], None]) -> None:
        self._on_overflow = on_overflow
        # pyinotify logs a refused watch as an error of its own; the callers log it better.
        logging.getLogger("pyinotify").setLevel(logging.CRITICAL)
        self._manager = pyinotify.WatchManager()
        self._by_path: dict[str, _Watched] = {}
        self._by_wd: dict[int, str] = {}
        self._notifier: Any = None

    def start(self) -> None:
        self._notifier = pyinotify.AsyncioNotifier(
            self._manager, asyncio.get_running_loop(), default_proc_fun=_Dispatch(self)
        )

    def close(self) -> None:
        if self._notifier is not None:
            self._notifier.stop()
            self._notifier = None
        self._by_path.clear()
        self._by_wd.clear()

    @property
    def watch_count(self) -> int:
        """Kernel watches held (one per watched path)."""
        return len(self._by_path)

    @property
    def subscription_count(self) -> int:
        return sum(len(w.subscriptions) for w in self._by_path.values())

    def subscribe(self, path: str, mask: int, callback: Callback) -> Subscription:
        """Call ``callback`` for each event in ``mask`` on ``path``; WatchError when the
        kernel refuses the watch."""
        subscription = Subscription(path, mask, callback)
        watched = self._by_path.get(path)
        if watched is None:
            wd = self._add(path, mask)
            watched = self._by_path[path] = _Watched(wd, mask)
            self._by_wd[wd] = path
        elif mask & ~watched.mask:
            watched.mask |= mask
            self._manager.update_watch(watched.wd, mask=watched.mask, quiet=True)
        watched.subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        watched = self._by_path.get(subscription.path)
        if watched is None or subscription not in watched.subscriptions:
            return
        watched.subscriptions.remove(subscription)
        if watched.subscriptions:
            return
        del self._by_path[subscription.path]
        self._by_wd.pop(watched.wd, None)
        if watched.wd in self._manager.watches:
            self._manager.rm_watch(watched.wd, quiet=True)

    def _add(self, path: str, mask: int) -> int:
        result = self._manager.add_watch(path, mask, quiet=True)
        wd = result.get(path, -1)
        if wd < 0:
            raise WatchError(f"cannot watch {path}")
        return int(wd)

    def _dispatch(self, raw: Any) -> None:
        mask = int(raw.mask)
        if mask & IN_Q_OVERFLOW:
            self._on_overflow()
            return
        path = self._by_wd.get(int(raw.wd))
        if path is None:
            return
        watched = self._by_path[path]
        event = Event(path, raw.name or "", mask)
        if mask & IN_IGNORED:
            # The kernel dropped the watch (the path went away): so do we.
            del self._by_path[path]
            del self._by_wd[watched.wd]
        for subscription in list(watched.subscriptions):
            if subscription.mask & mask or mask & IN_IGNORED:
                try:
                    subscription.callback(event)
                except Exception:
                    log.exception("inotify subscriber failed", extra={"fields": {"path": path}})


class _Dispatch(pyinotify.ProcessEvent):  # type: ignore[misc]
    def __init__(self, inotify: Inotify) -> None:
        super().__init__()
        self._inotify = inotify

    def process_default(self, event: Any) -> None:
        self._inotify._dispatch(event)
