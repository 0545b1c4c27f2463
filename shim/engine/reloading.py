"""Live reload of the config file: watched with inotify, validated, applied or refused.

The file's directory is watched, not the file: editors and config management replace it by
rename, which a watch on the file itself would not follow. The file is read when it is
closed after writing, renamed into place or linked into place, never at the event that
makes it as a plain file (``cp``, a shell redirect and some editors make it empty and write
it after). It is read again when its bytes (through its symlinks) differ from those last
read: when another entry is renamed into the directory (a ConfigMap volume swaps its
``..data`` link), once at start (an edit made while cpushim started), and at every full
look of the watcher (an edit whose events an inotify overflow dropped; a full look reads
what is on disk). A directory removed or replaced is watched again as soon as it is back
(its parent is watched meanwhile); one whose watch the kernel refused (its inotify limit) is
tried again at every full look, or, with no full looks, on its own, as a refused file is
read (below). A file that does not parse, or whose values make no
policy, is refused with the reason (file, line, key) and the running config stays; so does
a file that is gone. The same refusal (same bytes, same reason) is counted once, and logged
once unless a read is asked for (SIGHUP: silence would pass for a good file). A refused
file is read again at every look, its bytes changed or not: the reason may be the machine's
(a socketGroup made since, a sysfs or checkpoint that failed), and the file then applies as
soon as the machine allows it. With no full looks (``resyncPeriod`` 0) it is read again on
its own, after a while that grows up to a minute. A good one applies what can change while
running:

- the policy, its options and the reserved CPUs: a new policy is built and the engine re-plans
  under it (``Engine.change_policy``): a container keeps its CPUs only when the new policy
  would hand them to it, the others move, the checkpoint is rewritten; then the
  containers that share and ask for exclusive CPUs get them where there is room, as start-up
  adopts them (``resync.adopt_sharing``);
- the failure policy, the log level and the resync period;

and logs the keys that only a restart applies (sockets, directories, the metrics address...)
whose values differ from those cpushim started with.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from shim.config import KEYS, ConfigError, key_line, reload_options
from shim.engine.resync import adopt_sharing, replan_live
from shim.engine.retrying import Retry
from shim.fileio import identity, read_regular_file
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
from shim.state import ContainerKey

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

# Events on the file's name in its directory.
_FILE_EVENTS = IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
# The file holds a whole new content: written and closed, or renamed into place.
_CONTENT_EVENTS = IN_CLOSE_WRITE | IN_MOVED_TO
# The watched directory itself went (removed, renamed away; the kernel then drops the watch).
_DIRECTORY_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
# In the parent: the directory made again, or renamed into place.
_DIRECTORY_BACK = IN_CREATE | IN_MOVED_TO


def _content(path: str) -> bytes | None:
    """The file's bytes through its symlinks; None when it cannot be read or is not a
    regular file (:func:`_read_config` says why)."""
    content = _read_config(path)
    return content if isinstance(content, bytes) else None


def _read_config(path: str) -> bytes | str:
    """The file's bytes through its symlinks, or why they cannot be had (the refusal's
    words). Read on the event loop: it must never block there (a FIFO put at the path
    would, until a writer came), so only a regular file is read, opened non-blocking."""
    try:
        return read_regular_file(path)
    except OSError as exc:
        return f"cannot read the config file: {exc.strerror or exc}"


def _is_link(path: str) -> bool:
    """A name made as a link (symbolic or hard) to a file that already has its content."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISLNK(found.st_mode) or found.st_nlink > 1


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
        # What the keys a reload does not apply hold until a restart: ``need_restart`` is
        # measured against these, not against the last edit's.
        self._started = options
        self._build_policy = build_policy
        self._directory = options.config_path.parent
        self._subscription: Subscription | None = None
        # The watched directory's (device, inode): a directory symlink pointed elsewhere is
        # watched again at the next check.
        self._watched_identity: tuple[int, int] | None = None
        # Watches the directory's parent while the directory is gone.
        self._parent_subscription: Subscription | None = None
        # The file's bytes when it was last read (None: missing), once read here at all: a
        # check without an event reads it again only when they differ.
        self._last_read: bytes | None = None
        self._read_once = False
        # An event since the last check said the file got a whole new content: read it
        # whatever its bytes say.
        self._written = False
        # A read asked for (SIGHUP): a refusal is told again, though not counted again.
        self._asked = False
        # The last refusal, by the bytes refused and the reason: the same one is not counted
        # again (a bad file touched, a machine fault met at every look).
        self._refused: tuple[bytes | None, str] | None = None
        # One read at a time: the retry's and the watch jobs'.
        self._reading = asyncio.Lock()
        self._stopped = False
        # The same, for the retry's wait (not cancelled: a reload cut half-way could leave a
        # re-plan made and not adopted).
        self._stopping = asyncio.Event()
        # Reads a refused file again while no full look will (resyncPeriod 0).
        self._retry = Retry(
            self._read_again,
            lambda: self.engine.options.retry_delay,
            self._stopping,
            self.engine._spawn,
        )
        # Watches the directory (or, while it is gone, its parent) again when the kernel
        # refused, while no full look will: edits would go unseen until a SIGHUP.
        self._watch_retry = Retry(
            self._watch_again,
            lambda: self.engine.options.retry_delay,
            self._stopping,
            self.engine._spawn,
        )

    @property
    def replanning(self) -> asyncio.Lock:
        """Held while a reload reads the file and re-plans: a re-plan for another reason
        (CPUs gone offline) takes it too, so that two never interleave."""
        return self._reading

    @property
    def path(self) -> str:
        assert self.options.config_path is not None
        return str(self.options.config_path)

    def start(self) -> None:
        self._watch()
        self.watcher.full_look_hooks.append(self._check_soon)
        # A create that went out to share while a reload changed the policy asks for this.
        self.engine.adopter = self._adopt
        # The options were read before the runtime was waited for and the resync: an edit
        # made meanwhile had no watch to tell of it.
        self._check_soon()

    def stop(self) -> None:
        self._stopped = True
        self._stopping.set()
        self.engine.adopter = None
        if self._check_soon in self.watcher.full_look_hooks:
            self.watcher.full_look_hooks.remove(self._check_soon)
        self._unwatch()
        self._unwatch_parent()

    async def _adopt(self) -> None:
        if not self._stopped:
            await adopt_sharing(self.engine)  # logs what it adopts

    def _watch(self) -> None:
        """Watch the file's directory; while it cannot be watched (gone), its parent."""
        name = os.path.basename(self.path)

        def on_event(event: Event) -> None:
            if event.mask & _DIRECTORY_GONE and not event.name:
                # A directory renamed away keeps its kernel watch under the old path's name:
                # dropped, so that the one made again there gets its own.
                self._unwatch()
                self._watch_parent()
                self._check_soon()
            elif event.name == name:
                # Made as a plain file, it is empty or being written: read at its close (or
                # at the next full look, when none comes). Made as a link, it is whole.
                if event.mask & _CONTENT_EVENTS or _is_link(self.path):
                    self._written = True
                    self._check_soon()
            elif event.mask & IN_MOVED_TO:
                # Another entry renamed into place may be what the file's path resolves
                # through: a ConfigMap volume swaps its `..data` symlink.
                self._check_soon()

        try:
            self._subscription = self.watcher.inotify.subscribe(
                str(self._directory), _FILE_EVENTS | _DIRECTORY_GONE, on_event
            )
        except WatchError as exc:
            self.engine.counters["watch_errors"] += 1
            log.warning(
                "cannot watch the config file's directory; it is watched again when it is"
                " back, and read at every full look",
                extra={"fields": {"config": self.path, "error": str(exc)}},
            )
            self._watch_parent()
            self._watch_again_later()
            return
        self._watched_identity = identity(self._directory)
        self._unwatch_parent()

    def _watch_parent(self) -> None:
        if self._parent_subscription is not None or self._stopped:
            return
        directory = self._directory

        def on_parent(event: Event) -> None:
            if event.name == directory.name:
                self._check_soon()
            elif event.mask & IN_IGNORED and not event.name:
                # The parent went too: so did the file, and the refusal's retry reads
                # (and watches) again.
                self._parent_subscription = None

        # When the parent is gone too, the next full look tries again (or the retry).
        try:
            self._parent_subscription = self.watcher.inotify.subscribe(
                str(directory.parent), _DIRECTORY_BACK, on_parent
            )
        except WatchError:
            self._watch_again_later()

    def _watch_again_later(self) -> None:
        if self.watcher.resync_period <= 0:
            self._watch_retry.soon()

    async def _watch_again(self) -> bool:
        """Watch again (a check: it reads the file too if it changed meanwhile); done when
        the directory is watched, or, while it is gone, its parent is."""
        if self._stopped or self.watcher.resync_period > 0:
            return True
        await self._check()
        if self._subscription is not None:
            return True
        return self._parent_subscription is not None and not self._directory.is_dir()

    def _unwatch(self) -> None:
        if self._subscription is not None:
            self.watcher.inotify.unsubscribe(self._subscription)
            self._subscription = None
        self._watched_identity = None

    def _unwatch_parent(self) -> None:
        if self._parent_subscription is not None:
            self.watcher.inotify.unsubscribe(self._parent_subscription)
            self._parent_subscription = None

    def read_again(self) -> None:
        """Read the file again whatever the watches said (SIGHUP, ``systemctl reload``): for
        an edit a lost or missed watch left unseen."""
        self._written = True
        self._asked = True
        self._check_soon()

    def _check_soon(self) -> None:
        # One job for every reason, so that two reads never run at once.
        self.watcher.jobs.request("config", self._check)

    async def _check(self) -> None:
        """Watch the directory again if the watch was lost (or the directory is another
        one now), and read the file when an event said it was written, when its bytes
        differ from those last read (a check without an event reads what is on disk), or
        when it was refused: what refused it may be the machine's (a socketGroup made since,
        an unreadable sysfs, a checkpoint that could not be written), not its bytes."""
        if self._stopped:
            return
        async with self._reading:
            await self._check_now()

    async def _check_now(self) -> None:
        if self._subscription is None:
            if self._directory.is_dir():
                self._watch()
            else:
                self._watch_parent()  # counted once, when the directory went
        elif identity(self._directory) != self._watched_identity:
            self._unwatch()
            self._watch()
        written, self._written = self._written, False
        refused = self._refused is not None  # the same refusal is not told again
        if written or refused or not self._read_once or _content(self.path) != self._last_read:
            await self.reload()

    async def reload(self) -> None:
        """Read the file again and apply what changed; refuse a bad file."""
        if self._stopped:
            return
        asked, self._asked = self._asked, False
        content = _read_config(self.path)
        self._last_read = content if isinstance(content, bytes) else None
        self._read_once = True
        try:
            if not isinstance(content, bytes):
                # Read without blocking, as the path may be anything (a FIFO would hold a
                # worker thread, and with it every later reload, until a writer came).
                raise ConfigError(Path(self.path), content)
            # A worker thread still: a key's check may ask the system (socketGroup's group).
            new = await asyncio.to_thread(reload_options, self.options, self._last_read)
        except ConfigError as exc:
            self._refuse(str(exc), line=exc.line, key=exc.key, asked=asked)
            return
        if self._stopped:
            return  # cpushim is stopping: no re-plan now
        changed = sorted(
            f.name
            for f in fields(new)
            if f.name not in _PROVENANCE and getattr(new, f.name) != getattr(self.options, f.name)
        )
        if not changed:
            self._refused = None  # accepted: a refusal of the same bytes later counts again
            return
        policy: CPUPolicy | None = None
        if POLICY_FIELDS.intersection(changed):
            try:
                policy = await asyncio.to_thread(self._build_policy, new)
            except (OSError, ValueError) as exc:
                key = getattr(exc, "key", None)
                line = key_line(self._last_read, key) if key is not None else None
                self._refuse(str(exc), line=line, key=key, asked=asked)
                return
            if self._stopped:
                return
        adopted: list[ContainerKey] = []
        if policy is not None:
            try:
                lost, adopted = await replan_live(self.engine, policy, "config reload")
            except OSError as exc:
                error = f"cannot write the checkpoint: {exc}"
                self._refuse(error, line=None, key=None, asked=asked)
                return
        else:
            lost = []
        self.engine.options = replace(self.engine.options, failure_policy=new.failure_policy)
        if new.log_level != self.options.log_level:
            set_level(new.log_level)
        if new.resync_period != self.options.resync_period:
            self.watcher.set_resync_period(new.resync_period)
        # Every key still waiting for a restart, not only this edit's: an earlier edit's stays
        # named until then, and one edited back to the value cpushim runs with needs none.
        restart = [
            f.name
            for f in fields(new)
            if f.name not in POLICY_FIELDS | LIVE_FIELDS | _PROVENANCE
            and getattr(new, f.name) != getattr(self._started, f.name)
        ]
        if not new.recover_from_runtime:
            # Turned off after a recovery (docs/operations.md): the next start reads the
            # checkpoint again, which is what turning it off asks; nothing waits for a restart.
            restart = [name for name in restart if name != "recover_from_runtime"]
        self.options = new
        self._refused = None
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
                    "adopted_exclusive": [str(k) for k in adopted],
                    "need_restart": sorted(_KEY_OF_FIELD.get(name, name) for name in restart),
                }
            },
        )

    def _refuse(
        self, error: str, *, line: int | None, key: str | None, asked: bool = False
    ) -> None:
        refusal = (self._last_read, error)
        self._read_again_later()
        if refusal != self._refused:
            self._refused = refusal
            self.engine.counters["config_errors"] += 1
        elif not asked:
            return
        log.error(
            "config file refused; the running config stays",
            extra={"fields": {"config": self.path, "error": error, "line": line, "key": key}},
        )

    def _read_again_later(self) -> None:
        """With no periodic look (``resyncPeriod`` 0), read a refused file again after
        ``retry_delay``, doubling the wait up to a minute, until it applies (or is edited to
        a file that does): what refused it may be the machine's, and nothing else would read
        it again before an edit or a SIGHUP. Every refusal, its bytes' too: telling the two
        apart would guess (reserved CPUs the node does not have are either), and a read
        costs little. With a period, the full looks read it (``_check_soon``)."""
        if self.watcher.resync_period <= 0:
            self._retry.soon()

    async def _read_again(self) -> bool:
        done = self._refused is None or self.watcher.resync_period > 0
        if done or self._stopped or self.engine._draining.is_set():
            return True
        try:
            await self._check()
        except Exception:
            # A defect, not the machine: reading again would fail the same way.
            log.exception("watch job failed", extra={"fields": {"job": "config"}})
            return True
        return self._refused is None
