"""inotify on the asyncio loop, with many subscribers per path.

The kernel keeps one watch per inode and pyinotify ignores a second ``add_watch`` of a watched
path, while cpushim may watch one directory for several reasons (a pod's cgroup is the parent
of each of its containers') and by several names (a symlink). This adapter keeps one kernel
watch per directory with the union of the subscribers' masks, hands each event to the
subscribers whose mask has it, and drops the kernel watch with the last subscriber.

pyinotify's ``WatchManager`` owns the inotify descriptor and places and removes the watches;
the events are read here, straight from the descriptor. pyinotify's own event processing
formats every event as a string whatever the log level, and keeps every rename's source path
for a minute, walking that memory after each read. cpushim renames files into watched
directories several times per pod (the checkpoint, projections), and under pod churn that
processing took about a fifth of cpushim's CPU; cpushim needs none of it, since it keeps its
own descriptor-to-path map.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

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

# struct inotify_event: int wd; uint32_t mask, cookie, len; char name[len] (NUL-padded).
_EVENT_HEADER: Final = struct.Struct("iIII")
# Room for many events; one read must hold at least one with the longest name (NAME_MAX 255).
_READ_SIZE: Final = 64 * 1024

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
    # The names it is watched by: more than one when two paths lead to one directory (a
    # symlink), for which the kernel keeps one watch and returns the same descriptor.
    paths: list[str]
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._manager.get_fd(), self._read)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._manager.get_fd())
            self._loop = None
        if not self._closed:
            self._closed = True
            self._manager.close()
        self._by_path.clear()
        self._by_wd.clear()

    @property
    def watch_count(self) -> int:
        """Kernel watches held (one per watched inode)."""
        return len(self._by_wd)

    @property
    def subscription_count(self) -> int:
        return sum(len(self._by_path[path].subscriptions) for path in self._by_wd.values())

    def subscribe(self, path: str, mask: int, callback: Callback) -> Subscription:
        """Call ``callback`` for each event in ``mask`` on ``path``; WatchError when the
        kernel refuses the watch."""
        subscription = Subscription(path, mask, callback)
        watched = self._by_path.get(path)
        if watched is None:
            wd = self._add(path, mask)
            known = self._by_wd.get(wd)
            if known is None:
                watched = _Watched(wd, mask, [path])
                self._by_wd[wd] = path
            else:
                # Another name of a watched directory: the kernel handed back its watch, with
                # this mask in place of the others'.
                watched = self._by_path[known]
                watched.paths.append(path)
                watched.mask |= mask
                self._manager.update_watch(wd, mask=watched.mask, quiet=True)
            self._by_path[path] = watched
        elif mask & ~watched.mask:
            watched.mask |= mask
            self._manager.update_watch(watched.wd, mask=watched.mask, quiet=True)
        watched.subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        path = subscription.path
        watched = self._by_path.get(path)
        if watched is None or subscription not in watched.subscriptions:
            return
        watched.subscriptions.remove(subscription)
        if any(other.path == path for other in watched.subscriptions):
            return
        del self._by_path[path]
        watched.paths.remove(path)
        if watched.paths:
            # The directory's other names still need the kernel's watch.
            self._by_wd[watched.wd] = watched.paths[0]
            return
        self._by_wd.pop(watched.wd, None)
        if watched.wd in self._manager.watches:
            self._manager.rm_watch(watched.wd, quiet=True)

    def _add(self, path: str, mask: int) -> int:
        result = self._manager.add_watch(path, mask, quiet=True)
        wd = result.get(path, -1)
        if wd < 0:
            raise WatchError(f"cannot watch {path}")
        return int(wd)

    def _read(self) -> None:
        try:
            data = os.read(self._manager.get_fd(), _READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        for wd, mask, name in parse_events(data):
            self._dispatch(wd, mask, name)

    def _dispatch(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._on_overflow()
            return
        if mask & IN_IGNORED:
            # The kernel dropped the watch (the path went away, or rm_watch): forget it.
            self._manager.watches.pop(wd, None)
        path = self._by_wd.get(wd)
        if path is None:
            return
        watched = self._by_path[path]
        events = {name_of: Event(name_of, name, mask) for name_of in watched.paths}
        if mask & IN_IGNORED:
            for name_of in watched.paths:
                del self._by_path[name_of]
            del self._by_wd[watched.wd]
        for subscription in list(watched.subscriptions):
            if subscription.mask & mask or mask & IN_IGNORED:
                try:
                    subscription.callback(events[subscription.path])
                except Exception:
                    log.exception(
                        "inotify subscriber failed", extra={"fields": {"path": subscription.path}}
                    )


def parse_events(data: bytes) -> list[tuple[int, int, str]]:
    """(watch descriptor, mask, name) of each event in one read of the inotify descriptor."""
    events: list[tuple[int, int, str]] = []
    pos = 0
    end = len(data)
    while pos + _EVENT_HEADER.size <= end:
        wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(data, pos)
        pos += _EVENT_HEADER.size
        name = os.fsdecode(data[pos : pos + length].rstrip(b"\0")) if length else ""
        pos += length
        events.append((wd, mask, name))
    return events
