"""Live reload of the config file: watched with inotify, validated, applied or refused.

The file's directory is watched, not the file: editors and config management replace it by
rename, which a watch on the file itself would not follow. The file is read when it is
closed after writing or renamed into place, never when it is made (``cp``, a shell redirect
and some editors make it empty and write it after). It is read again when it changed since
it was last read (its inode, size and mtime, through its symlinks): when another entry is
renamed into the directory (a ConfigMap volume swaps its ``..data`` link), and at every full
look of the watcher (an edit whose event an inotify overflow dropped). A directory removed or replaced is watched again as soon as it is back (its parent
is watched meanwhile). A file that does not parse, or whose values make no policy, is refused
with the reason (file, line, key) and the running config stays; so does a file that is gone.
A good one applies what can change while running:

- the policy, its options and the reserved CPUs: a new policy is built and the engine re-plans
  under it (``Engine.change_policy``): containers move, the checkpoint is rewritten;
- the failure policy, the log level and the resync period;

and logs the keys that only a restart applies (sockets, directories, the metrics address...).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from shim.config import KEYS, ConfigError, reload_options
from shim.inotify import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_MOVE_SELF,
    IN_MOVED_TO,
    Event,
    Subscription,
    WatchError,
)
from shim.log import set_level
from shim.policy import CPUPolicy

if TYPE_CHECKING:
    from shim.engine.watching import Watcher
    from shim.run import RunOptions

log = logging.getLogger(__name__)

# The RunOptions fields that make the policy.
POLICY_FIELDS = frozenset(
    {"policy", "reserved_cpus", "reserved_cpu_count", "policy_options", "sysfs_root"}
)
# The ones applied without a new policy.
LIVE_FIELDS = frozenset({"failure_policy", "log_level", "resync_period"})
# Where the options came from, not what they say.
_PROVENANCE = frozenset({"config_path", "cli_overrides"})
# The log names the keys an operator edits, not the fields they fill.
_KEY_OF_FIELD = {key.field: key.name for key in KEYS}

# The file holds a whole new content: written and closed, or renamed into place.
_CONTENT_EVENTS = IN_CLOSE_WRITE | IN_MOVED_TO
# The watched directory itself went (removed, renamed away; the kernel then drops the watch).
_DIRECTORY_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
# In the parent: the directory made again, or renamed into place.
_DIRECTORY_BACK = IN_CREATE | IN_MOVED_TO

# (inode, size, modification time) of the file; None when it is missing.
FileStamp = tuple[int, int, int] | None


def _stamp(path: str) -> FileStamp:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_ino, found.st_size, found.st_mtime_ns


class ConfigReloader:
    def __init__(
        self,
        watcher: Watcher,
        options: RunOptions,
        build_policy: Callable[[RunOptions], CPUPolicy],
    ) -> None:
        if options.config_path is None:
            raise ValueError("there is no config file to reload")
        self.watcher = watcher
        self.engine = watcher.engine
        self.options = options
        self._build_policy = build_policy
        self._subscription: Subscription | None = None
        # Watches the directory's parent while the directory is gone.
        self._parent_subscription: Subscription | None = None
        # The file as it was when last read: a full look reads it again only when it differs.
        self._read_stamp: FileStamp = _stamp(self.path)
        # An event said the file has a new content: read it whatever its stamp says (a
        # rewrite of the same size within the clock's tick keeps the stamp).
        self._written = False
        self._stopped = False

    @property
    def path(self) -> str:
        assert self.options.config_path is not None
        return str(self.options.config_path)

    def start(self) -> None:
        self._watch()
        self.watcher.full_look_hooks.append(self._on_full_look)

    def stop(self) -> None:
        self._stopped = True
        if self._on_full_look in self.watcher.full_look_hooks:
            self.watcher.full_look_hooks.remove(self._on_full_look)
        self._unwatch()
        self._unwatch_parent()

    def _watch(self) -> None:
        """Watch the file's directory; while it cannot be watched (gone), its parent."""
        assert self.options.config_path is not None
        directory = self.options.config_path.parent
        name = self.options.config_path.name

        def on_event(event: Event) -> None:
            if event.mask & _DIRECTORY_GONE and not event.name:
                # A directory renamed away keeps its kernel watch under the old path's name:
                # dropped, so that the one made again there gets its own.
                self._unwatch()
                self._watch_parent()
                self._check_soon()
            elif event.name == name:
                self._written = True
                self._check_soon()
            elif event.mask & IN_MOVED_TO:
                # Another entry renamed into place may be what the file's path resolves
                # through: a ConfigMap volume swaps its `..data` symlink. Read the file if its
                # stamp (taken through the links) changed.
                self._check_soon()

        try:
            self._subscription = self.watcher.inotify.subscribe(
                str(directory), _CONTENT_EVENTS | _DIRECTORY_GONE, on_event
            )
        except WatchError as exc:
            self.engine.counters["watch_errors"] += 1
            log.warning(
                "cannot watch the config file's directory; it is watched again when it is"
                " back, and read at every full look",
                extra={"fields": {"config": self.path, "error": str(exc)}},
            )
            self._watch_parent()
            return
        self._unwatch_parent()

    def _watch_parent(self) -> None:
        if self._parent_subscription is not None or self._stopped:
            return
        assert self.options.config_path is not None
        directory = self.options.config_path.parent

        def on_parent(event: Event) -> None:
            if event.name == directory.name:
                self._check_soon()

        # When the parent is gone too, the next full look tries again.
        with contextlib.suppress(WatchError):
            self._parent_subscription = self.watcher.inotify.subscribe(
                str(directory.parent), _DIRECTORY_BACK, on_parent
            )

    def _unwatch(self) -> None:
        if self._subscription is not None:
            self.watcher.inotify.unsubscribe(self._subscription)
            self._subscription = None

    def _unwatch_parent(self) -> None:
        if self._parent_subscription is not None:
            self.watcher.inotify.unsubscribe(self._parent_subscription)
            self._parent_subscription = None

    def _on_full_look(self) -> None:
        self._check_soon()

    def _check_soon(self) -> None:
        # One job for every reason, so that two reads never run at once.
        self.watcher.jobs.request("config", self._check)

    async def _check(self) -> None:
        """Watch the directory again if the watch was lost, and read the file again if an
        event said it was written or it changed since it was last read."""
        if self._stopped:
            return
        if self._subscription is None:
            self._watch()
        written, self._written = self._written, False
        if written or _stamp(self.path) != self._read_stamp:
            await self.reload()

    async def reload(self) -> None:
        """Read the file again and apply what changed; refuse a bad file."""
        if self._stopped:
            return
        self._read_stamp = _stamp(self.path)
        try:
            new = await asyncio.to_thread(reload_options, self.options)
        except ConfigError as exc:
            self._refuse(str(exc), line=exc.line, key=exc.key)
            return
        changed = sorted(
            f.name
            for f in fields(new)
            if f.name not in _PROVENANCE and getattr(new, f.name) != getattr(self.options, f.name)
        )
        if not changed:
            return
        policy: CPUPolicy | None = None
        if POLICY_FIELDS.intersection(changed):
            try:
                policy = await asyncio.to_thread(self._build_policy, new)
            except (OSError, ValueError) as exc:
                self._refuse(str(exc), line=None, key=None)
                return
        if policy is not None:
            try:
                lost = await self.engine.change_policy(policy)
            except OSError as exc:
                self._refuse(f"cannot write the checkpoint: {exc}", line=None, key=None)
                return
        else:
            lost = []
        self.engine.options = replace(self.engine.options, failure_policy=new.failure_policy)
        if new.log_level != self.options.log_level:
            set_level(new.log_level)
        if new.resync_period != self.options.resync_period:
            self.watcher.set_resync_period(new.resync_period)
        restart = [name for name in changed if name not in POLICY_FIELDS | LIVE_FIELDS]
        self.options = new
        self.engine.counters["config_reloads"] += 1
        log.info(
            "config reloaded",
            extra={
                "fields": {
                    "config": self.path,
                    "changed": sorted(_KEY_OF_FIELD.get(name, name) for name in changed),
                    "reserved": str(self.engine.policy.reserved),
                    "options": sorted(self.engine.policy.option_names),
                    "shared": str(self.engine.state.shared),
                    "lost_exclusive": [str(k) for k in lost],
                    "need_restart": sorted(_KEY_OF_FIELD.get(name, name) for name in restart),
                }
            },
        )

    def _refuse(self, error: str, *, line: int | None, key: str | None) -> None:
        self.engine.counters["config_errors"] += 1
        log.error(
            "config file refused; the running config stays",
            extra={"fields": {"config": self.path, "error": error, "line": line, "key": key}},
        )
