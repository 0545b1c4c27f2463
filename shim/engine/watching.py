"""Watching instead of polling: each running container's cgroup, the state file, and a full
look now and then in case an event was lost.

- A container's ``cpuset.cpus`` changed by anyone but cpushim is written back (drift repair).
  Every write of cpushim's holds the container's write lock and sets ``Tracked.applied``
  first, so a check made under that lock that finds the file unequal to ``applied`` has found
  someone else's write.
- A container's first process exiting is seen on a pidfd (``pidfd_open(2)``, readable once
  the process is gone) the moment the kernel reaps it; the runtime removes the cgroup only
  after its shim has noticed, tens of milliseconds later. The cgroup watch stays as the net
  for containers whose process cannot be opened (gone already, a kernel without pidfds).
- A container whose cgroup went away (the runtime removes it when the process exits: v1 and
  v2 alike show it as a deletion in the parent directory) or whose v2 ``cgroup.events`` says
  ``populated 0`` has exited: its CPUs are released at once.
- ``state.json`` replaced, edited or deleted by anyone but cpushim is rewritten from memory,
  which is the truth while cpushim runs.
- Overflow of the kernel's event queue, a watch the kernel refused, and a slow timer each lead
  to one full look: the runtime's containers cpushim does not track (shim/engine/sweeping.py),
  every container's cgroup against the state, and the state file. A watch the full look
  cannot place either, or a container whose cgroup the runtime did not say where to find, is
  asked for again on its own, with a growing wait, while the container runs: the timer may be
  off (``resyncPeriod`` 0).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any, Final, NamedTuple

from shim import cgroups
from shim.cgroups import CGROUP_EVENTS, CPUSET_CPUS, CgroupVersion
from shim.checkpoint import LOCK_FILE, StateDirectoryInUseError, make_directory
from shim.cpuset import CPUSet
from shim.engine.core import Engine
from shim.engine.resync import adopt_sharing, waiting_for_exclusive
from shim.engine.retrying import Retry
from shim.engine.sweeping import sweep, worth_adopting
from shim.engine.tracked import Phase, Tracked
from shim.fileio import identity, read_file
from shim.inotify import (
    FILE_CHANGES,
    IN_CLOSE_WRITE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    Event,
    Inotify,
    Subscription,
    WatchError,
)
from shim.topology import online_cpus

log = logging.getLogger(__name__)

DEFAULT_RESYNC_PERIOD = 300.0

_GONE_EVENTS = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
# The state directory's .lock gone, replaced, or let go by a holder that opened it to write
# (cpushim opens it read-only: its own tries to take it, which open and close it, must not
# ask for the next try).
_LOCK_EVENTS = IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_CLOSE_WRITE


class Coalescer:
    """Runs one job per key at a time; a request made while it runs runs it once more after,
    so a burst of events costs at most two runs and the last event is never missed."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self._spawn = spawn
        self._running: set[str] = set()
        self._again: set[str] = set()

    def request(self, key: str, job: Callable[[], Awaitable[None]]) -> None:
        if key in self._running:
            self._again.add(key)
            return
        self._running.add(key)
        self._spawn(self._run(key, job))

    async def _run(self, key: str, job: Callable[[], Awaitable[None]]) -> None:
        try:
            while True:
                self._again.discard(key)
                try:
                    await job()
                except Exception:
                    log.exception("watch job failed", extra={"fields": {"job": key}})
                if key not in self._again:
                    return
        finally:
            self._running.discard(key)
            self._again.discard(key)

    @property
    def pending(self) -> int:
        return len(self._running)


class Watcher:
    def __init__(
        self,
        engine: Engine,
        resync_period: float = DEFAULT_RESYNC_PERIOD,
        sysfs_root: Path | None = None,
    ) -> None:
        self.engine = engine
        self.resync_period = resync_period
        # Where the CPUs online now are read, to tell a CPU gone offline from a drift (None:
        # not read, every drift is written back).
        self.sysfs_root = sysfs_root
        self.inotify = Inotify(on_overflow=self._overflowed)
        self.jobs = Coalescer(engine._spawn)
        self._containers: dict[str, list[Subscription]] = {}
        # Container id -> a pidfd of its first process, read-watched on the loop.
        self._pidfds: dict[str, int] = {}
        self._state_watch: Subscription | None = None
        # The state directory the watch was placed on (device, inode).
        self._state_identity: tuple[int, int] | None = None
        # The .lock another process held when this one tried to take it again (told once).
        self._contended_lock: tuple[int, int] | None = None
        # Running containers with no watch that no event would bring: a full look could not
        # place it, or the runtime did not say where their cgroup is (created ones too). In
        # the order they are tried again (the last refused last).
        self._unwatched: dict[str, None] = {}
        self._timer: asyncio.Task[None] | None = None
        # Called at the start of every full look (the config reloader reads its file again:
        # an edit whose event an overflow dropped is applied then).
        self.full_look_hooks: list[Callable[[], None]] = []
        # Set by stop(): a job or a reload still finishing places no watch and no timer.
        self._stopped = False
        # The same, for the waits of the retries that stop() does not cancel.
        self._stopping = asyncio.Event()

        def delay() -> float:
            return engine.options.retry_delay

        # Tries the state directory again while it cannot be made, watched or locked again
        # (another process holds its new lock). Each try is synchronous: a stop's cancel
        # cuts only a wait.
        self._state_retry = Retry(self._state_dir_again, delay, engine._draining, engine._spawn)
        # Sweeps again after one that left the runtime's containers unlooked at (see
        # _sweep). Not cancelled by stop(): a sweep cut half-way could leave a container
        # taken in and not moved.
        self._sweep_retry = Retry(self._sweep_again, delay, self._stopping, engine._spawn)
        # Asks for the _unwatched containers' watches again (see watch_again_later). Not
        # cancelled by stop(): a check cut half-way could leave a repair unrecorded.
        self._watch_retry = Retry(self._watch_again, delay, self._stopping, engine._spawn)
        # Repairs' runtime updates at once, as for moves: systemd's daemon-reload rewrites
        # every container's cpuset together, and each update forks a runc.
        self._repair_updates = asyncio.Semaphore(engine.options.update_concurrency)

    @property
    def pidfd_count(self) -> int:
        """Processes watched for their exit (the leak tests count them)."""
        return len(self._pidfds)

    @property
    def counters(self) -> dict[str, int]:
        return self.engine.counters

    # --- life -------------------------------------------------------------------------------

    def start(self) -> None:
        """Watch the state file and every running container the engine knows where to find."""
        self.inotify.start()
        self.engine.watcher = self
        self.engine.sweeper = self.sweep_soon
        self.engine.room_made = self.adopt_soon
        self._watch_state_dir()
        if self._state_watch is None:
            self._state_dir_again_later()
        for tracked in list(self.engine.containers.values()):
            if tracked.phase is not Phase.RUNNING:
                continue
            if tracked.cgroup is not None:
                self.watch(tracked)
            else:
                # Ended between the start-up's look at the runtime and its look for the
                # cgroup, it would hold its CPUs until the first full look.
                self.jobs.request(tracked.id, partial(self.look_at_unlocated, tracked))
        if self.engine.sweep_wanted:
            # Start-up could not read some containers: until a sweep takes them in, nothing
            # watches them, and those that hold no CPUs run wherever they ran.
            self.engine.sweep_wanted = False
            self.sweep_soon()
        if self.resync_period > 0:
            self._timer = asyncio.get_running_loop().create_task(self._periodically())

    async def stop(self) -> None:
        self._stopped = True
        self._stopping.set()
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
        self._timer = None
        await self._state_retry.cancel()
        self.engine.watcher = None
        self.engine.sweeper = None
        self.engine.room_made = None
        for container_id in list(self._pidfds):
            self._close_pidfd(container_id)
        self._containers.clear()
        self._unwatched.clear()
        self._state_watch = None
        self.inotify.close()

    def set_resync_period(self, period: float) -> None:
        """Resync every ``period`` seconds from now on; 0 stops the periodic resync."""
        self.resync_period = period
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if period > 0 and not self._stopped:
            self._timer = asyncio.get_running_loop().create_task(self._periodically())

    async def _periodically(self) -> None:
        while True:
            await asyncio.sleep(self.resync_period)
            self.counters["periodic_resyncs"] += 1
            # A job, not awaited here: a look that fails must not end the timer, and a timer
            # cancelled by a new period (a config reload) must not cut a look half-way (a
            # release whose shared containers were never grown).
            self.jobs.request("full-resync", self.look_everywhere)

    def _overflowed(self) -> None:
        self.counters["inotify_overflows"] += 1
        log.warning("inotify queue overflowed; looking at everything once")
        self.jobs.request("full-resync", self.look_everywhere)

    def sweep_soon(self) -> None:
        """Look for the runtime's containers cpushim does not track (a fail-open create)."""
        if not self._stopped:
            self.jobs.request("sweep", self._sweep)

    async def _sweep(self) -> None:
        if (await sweep(self.engine)).unfinished:
            # Swept again after ``retry_delay``, doubling the wait up to a minute, until a
            # sweep is not left unfinished (the runtime lists, creates pause): what it found
            # runs on any CPU, or holds CPUs with no id, and with ``resyncPeriod`` 0 no full
            # look would ever come.
            self._sweep_retry.soon()

    async def _sweep_again(self) -> bool:
        if self._stopped or self.engine._draining.is_set():
            return True
        try:
            return not (await sweep(self.engine)).unfinished
        except Exception:
            # A defect, not a busy runtime: trying again would fail the same way.
            log.exception("watch job failed", extra={"fields": {"job": "sweep"}})
            return True

    def adopt_soon(self) -> None:
        """Give the containers that share for lack of room the exclusive CPUs they ask for,
        now that a release gave some back: with ``resyncPeriod`` 0 no full look's sweep
        would."""
        if not self._stopped:
            self.jobs.request("adopt", self._adopt)

    async def _adopt(self) -> None:
        engine = self.engine
        if self._stopped or engine._draining.is_set():
            return
        waiting = waiting_for_exclusive(engine)
        tried = engine.room_tried
        if worth_adopting(engine, waiting) and (
            tried is None or not engine.free_exclusive().issubset(tried)
        ):
            await adopt_sharing(engine)
            waiting = waiting_for_exclusive(engine)
            engine.room_tried = engine.free_exclusive()
        if not any(tracked.adoption_refused for tracked in waiting):
            engine.room_wanted = False
            engine.room_tried = None

    # --- containers -------------------------------------------------------------------------

    def watch(self, tracked: Tracked, *, look_on_failure: bool = True) -> bool:
        """Watch a running container's cgroup: its cpuset, and its going away. When the
        kernel refuses, one full look follows (unless this is one, or a retry: the watch
        is then asked for again later); False then."""
        if tracked.id in self._containers or tracked.cgroup is None or self._stopped:
            return tracked.id in self._containers
        known = self.engine.containers.get(tracked.id)
        if tracked.phase is not Phase.RUNNING or known is not tracked:
            # Stopped or forgotten while it was being located: nobody would unwatch it.
            return False
        directory = tracked.cgroup
        container_id = tracked.id

        def on_cgroup(event: Event) -> None:
            if event.name == CPUSET_CPUS or event.mask & IN_IGNORED:
                self.jobs.request(container_id, lambda: self.check(container_id))

        def on_parent(event: Event) -> None:
            if event.name == directory.name:
                self.jobs.request(container_id, lambda: self.check(container_id))

        def on_events(event: Event) -> None:
            self.jobs.request(container_id, lambda: self.check(container_id))

        subscriptions: list[Subscription] = []
        try:
            subscriptions.append(
                self.inotify.subscribe(str(directory), IN_MODIFY | IN_CLOSE_WRITE, on_cgroup)
            )
            subscriptions.append(
                self.inotify.subscribe(str(directory.parent), IN_DELETE | IN_MOVED_FROM, on_parent)
            )
            layout = self.engine.mover.layout
            if layout is not None and layout.version is CgroupVersion.V2:
                subscriptions.append(
                    self.inotify.subscribe(str(directory / CGROUP_EVENTS), IN_MODIFY, on_events)
                )
        except WatchError as exc:
            for subscription in subscriptions:
                self.inotify.unsubscribe(subscription)
            self.counters["watch_errors"] += 1
            # The cgroup may be gone already: a full look finds out. Within one, no other
            # follows at once: a kernel out of watches would refuse it too, look after look.
            then = "looking at everything once" if look_on_failure else "tried again later"
            log.warning(
                f"cannot watch a container's cgroup; {then}",
                extra={"fields": {**tracked.named(), "error": str(exc)}},
            )
            if look_on_failure:
                self.jobs.request("full-resync", self.look_everywhere)
            else:
                self.watch_again_later(container_id)
            return False
        self._unwatched.pop(container_id, None)
        self._containers[container_id] = subscriptions
        self._watch_process(tracked)
        # It may have changed between the runtime making it and the watch: look once.
        self.jobs.request(container_id, lambda: self.check(container_id))
        return True

    def watch_again_later(self, container_id: str) -> None:
        """Ask for the container's watch again after ``retry_delay``, doubling the wait up
        to a minute, while it runs, and first for its cgroup when the runtime did not say
        where it is: with nothing watching it, its drift goes unrepaired and its exit unseen
        until a full look, and with ``resyncPeriod`` 0 none comes. One task for every such
        container: a kernel out of watches, or a runtime that does not answer, refuses them
        all together."""
        if self._stopped:
            return
        self._unwatched.pop(container_id, None)
        self._unwatched[container_id] = None  # last: the others are asked for first
        self._watch_retry.soon()

    async def _watch_again(self) -> bool:
        if self._stopped or self.engine._draining.is_set():
            return True
        refused = unanswered = False
        for container_id in list(self._unwatched):
            tracked = self.engine.containers.get(container_id)
            if tracked is not None and tracked.cgroup is None and tracked.phase is not Phase.EXITED:
                # One unanswered lookup a try: a runtime that did not answer for this one
                # would not for the rest either, each call waiting for its timeout.
                if unanswered:
                    continue
                if not await self._look_up(tracked):
                    # Asked for again (last) when still unanswered; else it ended, or has no
                    # cgroup to watch.
                    unanswered = container_id in self._unwatched
                    continue
            if tracked is None or tracked.phase is not Phase.RUNNING or tracked.cgroup is None:
                self._unwatched.pop(container_id, None)
                continue
            # One refusal a try: the kernel would refuse the rest as it did this one, each
            # with a warning.
            if not refused and self.watch(tracked, look_on_failure=False):
                self._unwatched.pop(container_id, None)
                continue  # its first check follows
            refused = True
            self._unwatched.setdefault(container_id, None)  # one just located
            # What its watch would have told meanwhile: a drift, an exit. Under the
            # container's key, so that it never runs beside another check of it.
            self.jobs.request(container_id, functools.partial(self.check, container_id))
        return not self._unwatched

    def check_soon(self, container_id: str) -> None:
        """Look at the container's cgroup soon (:meth:`check`), unless the watcher stopped:
        its checks end with it, and a repair or a release then is the next start's."""
        if not self._stopped:
            self.jobs.request(container_id, functools.partial(self.check, container_id))

    def unwatch(self, container_id: str) -> None:
        self._unwatched.pop(container_id, None)
        for subscription in self._containers.pop(container_id, []):
            self.inotify.unsubscribe(subscription)
        self._close_pidfd(container_id)

    def _watch_process(self, tracked: Tracked) -> None:
        """Learn of the container's process exiting from a pidfd, when one can be had for the
        right process: the pid must still be in the container's cgroup, or it was reused."""
        if tracked.pid <= 0 or tracked.cgroup is None or not hasattr(os, "pidfd_open"):
            return
        try:
            pidfd = os.pidfd_open(tracked.pid)
        except OSError:
            return  # exited already; the cgroup watch and the first check see to it
        if not _holds(tracked.cgroup, tracked.pid):
            os.close(pidfd)
            return
        container_id = tracked.id
        self._pidfds[container_id] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._process_exited, container_id)

    def _process_exited(self, container_id: str) -> None:
        self._close_pidfd(container_id)
        self.counters["process_exits_seen"] += 1
        # Its own key: a request under the container's key while a check runs reruns the check.
        self.jobs.request(
            f"{container_id}:exit", lambda: self.engine.container_exited(container_id)
        )

    def _close_pidfd(self, container_id: str) -> None:
        pidfd = self._pidfds.pop(container_id, None)
        if pidfd is not None:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)

    @property
    def watched_containers(self) -> int:
        return len(self._containers)

    async def check(self, container_id: str) -> None:
        """Compare one container's cgroup with what cpushim wrote; repair or release."""
        tracked = self.engine.containers.get(container_id)
        if tracked is None or tracked.phase is not Phase.RUNNING or tracked.cgroup is None:
            return
        directory = tracked.cgroup
        async with tracked.write_lock:
            if tracked.phase is not Phase.RUNNING:
                return
            # cgroupfs answers from memory: a worker thread would cost more than the reads.
            layout = self.engine.mover.layout
            look = _look(directory, layout is not None and layout.version is CgroupVersion.V2)
            gone = not look.alive
            if look.no_cpuset:
                self._unenforced(tracked)
            elif (
                look.cpus is not None
                and look.cpus != tracked.applied
                and not self._taken_offline(tracked, look.cpus)
            ):
                await self._repair(tracked, look.cpus)
        if gone:
            await self.engine.container_exited(container_id)

    def _unenforced(self, tracked: Tracked) -> None:
        """Warn, once per container, that its cgroup has no cpuset: nothing cpushim or the
        runtime writes pins it there, and it runs on whatever its parent allows."""
        if tracked.no_cpuset_seen:
            return
        tracked.no_cpuset_seen = True
        self.counters["cgroups_without_cpuset"] += 1
        log.warning(
            "a container's cgroup has no cpuset.cpus: the cpuset controller is not enabled in"
            " its parent's cgroup.subtree_control, so its CPUs are not enforced",
            extra={
                "fields": {
                    **tracked.named(),
                    "cgroup": str(tracked.cgroup),
                    "cpus": str(tracked.applied),
                }
            },
        )

    def _taken_offline(self, tracked: Tracked, found: CPUSet) -> bool:
        """Whether ``found`` is what cpushim wrote less CPUs that are offline now: cgroup v1
        takes a CPU going offline out of every cpuset, and refuses it back (EINVAL) until
        it is online again, so a write back would fail, through the runtime too, at every
        look. Not written back then; warned once per container and set."""
        applied = tracked.applied
        if self.sysfs_root is None or applied is None or not found.issubset(applied):
            return False
        try:
            online = online_cpus(self.sysfs_root)
        except (OSError, ValueError):
            return False
        offline = applied - online
        if not offline or found != applied - offline:
            return False
        if tracked.offline_seen != found:
            tracked.offline_seen = found
            self.counters["offline_cpus_dropped"] += 1
            log.warning(
                "CPUs went offline and the kernel took them out of a container's cpuset"
                " (cgroup v1); not written back, which the kernel refuses. cpushim"
                " re-plans with the CPUs online now (docs/operations.md)",
                extra={
                    "fields": {
                        **tracked.named(),
                        "offline": str(offline),
                        "found": str(found),
                        "cpus": str(applied),
                    }
                },
            )
        return True

    async def _repair(self, tracked: Tracked, found: CPUSet) -> None:
        """Write the cpuset back (held: the container's write lock)."""
        cpus, mems, quota = self.engine._desired(tracked)
        assert tracked.cgroup is not None
        self.counters["drift_repairs"] += 1
        fields = {
            **tracked.named(),
            "found": str(found),
            "cpus": str(cpus),
        }
        reversal = self._reversed_by_runtime(tracked, found, cpus)
        if not reversal and self._record_applied_again(tracked, found, cpus):
            fields["cause"] = "systemd applied the runtime's record from before the last move"
            self.counters["stale_records_reapplied"] += 1
        if reversal:
            fields["cause"] = "systemd applied the runtime's mask byte-reversed"
            self.counters["byte_reversed_cpusets"] += 1
            if self.counters["byte_reversed_cpusets"] == 1:
                log.warning(
                    "a cgroup holds its cpuset with the mask's bytes reversed, as systemd"
                    " records it from a runc older than 1.1.6 (opencontainers/runc#3611);"
                    " systemd writes that set again when it applies the unit (every"
                    " daemon-reload), and cpushim writes it back each time: upgrade runc",
                    extra={"fields": fields},
                )
        log.warning(
            "cpuset changed behind cpushim's back; writing it back", extra={"fields": fields}
        )
        try:
            self.engine.mover.write_tree(tracked, CPUSET_CPUS, cpus)
            tracked.applied = cpus
            written = True
        except OSError as exc:
            # What the cgroup holds: if the runtime fails too, the move retries see the
            # container out of place and try again.
            tracked.applied = found
            written = False
            log.info(
                "direct repair failed; the runtime repairs it",
                extra={"fields": {**tracked.named(), "error": str(exc)}},
            )
        else:
            # The runtime is told once per set, which mends systemd's copy once runc is
            # fixed; again and again, each update would hand systemd the same reversed mask.
            if reversal and tracked.reversal_recorded == cpus:
                self.engine.project(tracked)
                return
        if reversal:
            tracked.reversal_recorded = cpus
        # Through the runtime too, so its own record (and systemd's) says the same. The CPUs
        # are not written into the tree again: in place, or refused and refused again.
        moved_at = tracked.moved_at
        async with self._repair_updates:
            if tracked.moved_at != moved_at:
                # A move went past the repair while it waited for its turn (the container's
                # runtime taken for stuck): its cpuset is the latest, and is recorded later.
                return
            result = await self.engine.mover.update_locked(
                tracked, cpus, mems, quota, tree_first=written, cpus_written=written
            )
        if result.ok:
            self.engine._restored(tracked)
        else:
            if written and not result.gone:
                # The cgroup holds it: the runtime's record (and systemd's copy) is told later,
                # as after a refused record, whose answer also ends a spell of the runtime
                # taken for stuck (a call past its deadline) that nothing else would end.
                self.engine.mover.record_later(tracked)
            if (result.moved and tracked.settings_stale) or tracked.applied != cpus:
                self.engine._move_retry.soon()  # for the memory nodes and quota, or the CPUs
        self.engine.project(tracked)

    def _reversed_by_runtime(self, tracked: Tracked, found: CPUSet, cpus: CPUSet) -> bool:
        """Whether ``found`` is ``cpus``, or the set the runtime's record still holds (a move
        written straight into the cgroup is told to the runtime, and so to systemd, only
        later), as an unfixed runc hands it to systemd (which keeps a cgroup v2 unit's cpuset
        only), for a container that still holds its own settings. Another set that happens
        to match (``8`` reads as ``0``) is taken for it too: it is written back all the same,
        and the runtime is told the first time."""
        held = {cpus} if tracked.recorded is None else {cpus, tracked.recorded}
        return (
            self.engine.mover.systemd_keeps_cpuset(tracked)
            and found != cpus
            and found in {cgroups.systemd_byte_reversed(c) for c in held}
            and not self.engine._lost(tracked)
        )

    def _record_applied_again(self, tracked: Tracked, found: CPUSet, cpus: CPUSet) -> bool:
        """Whether ``found`` is the set the runtime's record holds from before a move written
        straight into the cgroup and not told yet: systemd's copy (cgroup v2, the systemd
        driver), which it writes again whenever it applies the unit (a daemon-reload). Put
        right like any other, but nobody else's write."""
        return (
            self.engine.mover.systemd_keeps_cpuset(tracked)
            and found != cpus
            and found == tracked.recorded
            and not self.engine._lost(tracked)
        )

    # --- the state file ---------------------------------------------------------------------

    def _watch_state_dir(self) -> None:
        if self._stopped:
            return
        directory = self.engine.checkpoint.path.parent
        try:
            make_directory(directory)
        except OSError as exc:
            # A file where the directory was, a read-only file system: the state check that
            # follows still runs, and says what it finds.
            self.counters["watch_errors"] += 1
            log.warning(
                "cannot make the state directory again; tried again later",
                extra={"fields": {"path": str(directory), "error": str(exc)}},
            )
            return

        def on_event(event: Event) -> None:
            if event.mask & _GONE_EVENTS and not event.name:
                if self._state_watch is not None:
                    # A directory moved away keeps its kernel watch, under the old path's
                    # name: dropped, so that the directory made again there gets its own.
                    self.inotify.unsubscribe(self._state_watch)
                self._state_watch = None
                self.jobs.request("state-dir", self._look_at_state)
            elif event.name == self.engine.checkpoint.path.name:
                self.jobs.request("state", self.check_state)
            elif event.name == LOCK_FILE and event.mask & _LOCK_EVENTS:
                self.jobs.request("state-lock", self._hold_state_dir_again)

        try:
            self._state_identity = identity(directory)
            self._state_watch = self.inotify.subscribe(
                # IN_MODIFY too: a truncate(2) by path, or a write through a descriptor held
                # open, changes the file with no close; cpushim's own writes go to other
                # names, renamed into place.
                str(directory),
                FILE_CHANGES | IN_MODIFY | _GONE_EVENTS,
                on_event,
            )
        except WatchError as exc:
            self.counters["watch_errors"] += 1
            log.warning(
                "cannot watch the state directory; tried again later",
                extra={"fields": {"path": str(directory), "error": str(exc)}},
            )

    def _watch_state_dir_there_now(self) -> None:
        """Watch the state directory at its path now. One removed or replaced while the
        events that would have told it were lost (an overflow), or kept from going by a file
        still open in it, leaves the watch on a directory no longer there."""
        directory = self.engine.checkpoint.path.parent
        if self._state_watch is not None and identity(directory) != self._state_identity:
            self.inotify.unsubscribe(self._state_watch)
            self._state_watch = None
        if self._state_watch is None:
            self._watch_state_dir()

    async def _look_at_state(self) -> None:
        """The state directory watched and held as it is now, and its file as last written:
        after the directory went, and at every full look."""
        await self._hold_state_dir_again()
        await self.check_state()

    async def _hold_state_dir_again(self) -> None:
        """Take the lock of a state directory (or a ``.lock``) made again: the one held is on
        a file that is gone, and a second cpushim started now would not be refused. While
        another process holds it, or the directory cannot be made, watched or locked again,
        tried again with a growing wait."""
        # The lock held on the old .lock keeps the removed directory from going, so no event
        # says it went: the watch is moved to the directory there now.
        self._watch_state_dir_there_now()
        if not self._take_state_lock() or self._state_watch is None:
            self._state_dir_again_later()

    def _state_dir_again_later(self) -> None:
        """Make, watch and lock the state directory again after ``retry_delay``, doubling
        the wait up to a minute, until all three are done: unwatched, state.json is not
        guarded, and unlocked, a second cpushim could start on it; and with ``resyncPeriod``
        0 no full look would try again."""
        # Its retry stops on the engine's drain; stop() cancels one running, and none starts
        # after.
        if not self._stopped:
            self._state_retry.soon()

    async def _state_dir_again(self) -> bool:
        if self._stopped:
            return True
        watched = self._state_watch is not None
        self._watch_state_dir_there_now()
        if not watched and self._state_watch is not None:
            # Made again or watched only now: its file may be missing, or changed unseen.
            self.jobs.request("state", self.check_state)
        return self._take_state_lock() and self._state_watch is not None

    def _take_state_lock(self) -> bool:
        """Take the state directory's lock again if it needs it: False while another process
        holds it (told of once for each of its lock files) or it cannot be taken."""
        checkpoint = self.engine.checkpoint
        try:
            if checkpoint.hold_again():
                log.warning(
                    "the state directory's lock was removed; taken again",
                    extra={"fields": {"path": str(checkpoint.directory)}},
                )
            self._contended_lock = None
        except StateDirectoryInUseError as exc:
            contended = identity(checkpoint.directory / LOCK_FILE)
            if contended is not None and contended == self._contended_lock:
                return False  # told already
            self._contended_lock = contended
            self.counters["watch_errors"] += 1
            log.error(
                "another process holds the state directory made again: two cpushims undo each"
                " other's cpusets; stop the other",
                extra={"fields": {"error": str(exc)}},
            )
            return False
        except OSError as exc:
            self.counters["watch_errors"] += 1
            log.warning(
                "cannot take the state directory's lock again; tried again later",
                extra={
                    "fields": {"path": str(self.engine.checkpoint.directory), "error": str(exc)}
                },
            )
            return False
        return True

    async def check_state(self) -> None:
        """Rewrite ``state.json`` from memory when it is not what cpushim last wrote."""
        checkpoint = self.engine.checkpoint
        # Most events are cpushim's own writes: those need neither the lock nor a rewrite. The
        # file was just written (page cache, a few kilobytes), so it is read on the loop.
        found = checkpoint.on_disk()
        if found is not None and found == checkpoint.last_written:
            return
        async with self.engine.lock:
            found = checkpoint.on_disk()
            if found is not None and found == checkpoint.last_written:
                return
            self.counters["state_rewrites"] += 1
            log.warning(
                "the state file was changed by someone else; rewriting it from memory",
                extra={
                    "fields": {
                        "path": str(checkpoint.path),
                        "found": "missing" if found is None else f"{len(found)} bytes",
                    }
                },
            )
            try:
                await checkpoint.save(self.engine.state)
            except OSError as exc:
                self.counters["checkpoint_errors"] += 1
                log.error(
                    "cannot rewrite the state file",
                    extra={"fields": {"path": str(checkpoint.path), "error": str(exc)}},
                )
                self.engine.save_later()
            else:
                self.engine.save_succeeded()

    # --- everything -------------------------------------------------------------------------

    async def look_everywhere(self) -> None:
        """One full look: moves the runtime refused tried again, every running container
        (placing watches that are missing), then the state file."""
        if self._stopped:
            return
        self.counters["full_resyncs"] += 1
        for hook in self.full_look_hooks:
            hook()
        # Each part on its own: the look is the safety net for lost events, and one part's
        # failure (a defect) must not take the others with it.
        await self._part_of_look("sweep", self._sweep())
        await self._part_of_look("reapply", self.engine.reapply())
        for tracked in list(self.engine.containers.values()):
            await self._part_of_look("container", self._look_at(tracked), tracked.id)
        if self.engine.projector is not None:
            self.engine.projector.retry()
        await self._part_of_look("state", self._look_at_state())

    async def _part_of_look(
        self, part: str, work: Coroutine[Any, Any, None], container_id: str = ""
    ) -> None:
        try:
            await work
        except Exception:
            self.counters["internal_errors"] += 1
            fields = {"part": part} | ({"container_id": container_id} if container_id else {})
            log.exception("a part of the full look failed", extra={"fields": fields})

    async def _look_at(self, tracked: Tracked) -> None:
        if tracked.phase is Phase.CREATED and not await self._look_up(tracked):
            return
        if tracked.phase is not Phase.RUNNING:
            return
        if tracked.cgroup is None and not await self._look_up(tracked):
            return
        await self.check(tracked.id)
        running = tracked.phase is Phase.RUNNING and tracked.cgroup is not None
        if running and tracked.id not in self._containers:
            self.watch(tracked, look_on_failure=False)

    async def look_at_unlocated(self, tracked: Tracked) -> None:
        """A running container whose cgroup was not there when a sweep took it in, or at
        start-up (both ask the runtime first, and a container stopped meanwhile has lost its
        cgroup by then): with nothing to watch, only a look tells its end, and the CPUs it
        was given would wait for the next full look."""
        if await self._look_up(tracked):
            self.watch(tracked)

    async def look_at_created(self, tracked: Tracked) -> None:
        """A container cpushim saw made and never saw started: one another CRI client started
        (taken in by a sweep, or at start-up, while created) runs with nothing watching it,
        and its exit would never give its CPUs back."""
        if await self._look_up(tracked):
            self.watch(tracked)

    async def _look_up(self, tracked: Tracked) -> bool:
        """Ask the runtime where the cgroup of a running (or created) container is: True
        when it is found (to be watched; a created one is running). One that ended gives
        its CPUs back; one the runtime did not answer for is asked about again later."""
        phase = tracked.phase
        found = await self.engine.mover.find(tracked)
        if tracked.phase is not phase or self.engine.containers.get(tracked.id) is not tracked:
            # Started, stopped or removed through cpushim meanwhile: that call's own work
            # looks after it.
            self._unwatched.pop(tracked.id, None)
            return False
        if not found.answered:
            self.watch_again_later(tracked.id)
            return False
        self._unwatched.pop(tracked.id, None)
        if found.ended:
            await self.engine.container_exited(tracked.id)
            return False
        if found.cgroup is None:
            return False
        if phase is Phase.CREATED:
            tracked.phase = Phase.RUNNING
            log.info(
                "a container cpushim saw created is running; watching it",
                extra={"fields": tracked.named()},
            )
        return True


class Look(NamedTuple):
    # The cgroup still holds a process.
    alive: bool
    # Its cpuset; None when unreadable.
    cpus: CPUSet | None = None
    # A live cgroup v2 without cpuset.cpus: the cpuset controller is not enabled for it.
    no_cpuset: bool = False


GONE: Final = Look(alive=False)


def _look(directory: Path, v2: bool) -> Look:
    """Whether the cgroup still holds a process, and its cpuset. Run on every change the
    watches see (each move of a shared container, twice a pod under churn): plain reads, no
    pathlib."""
    base = str(directory)
    if v2:  # cgroup v1 has no cgroup.events
        try:
            populated = cgroups.populated(read_file(f"{base}/{CGROUP_EVENTS}").decode())
        except (FileNotFoundError, NotADirectoryError):
            return GONE
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return GONE  # removed between the open and the read (as read_list takes it)
            populated = None
        if populated is False:
            return GONE
    try:
        text = read_file(f"{base}/{CPUSET_CPUS}").decode()
    except (FileNotFoundError, NotADirectoryError):
        # Under v1 the file goes with the cgroup. Under v2 a cgroup whose parent does not
        # enable the cpuset controller (cgroup.subtree_control) has no such file while it
        # runs: only the directory's going tells an exit there.
        if v2 and os.path.isdir(base):
            return Look(alive=True, no_cpuset=True)
        return GONE
    except OSError as exc:
        return GONE if exc.errno == errno.ENODEV else Look(alive=True)
    try:
        return Look(alive=True, cpus=CPUSet.parse(text.strip()))
    except ValueError:
        return Look(alive=True)


def _holds(cgroup: Path, pid: int) -> bool:
    """Whether ``pid`` is one of the processes of ``cgroup``."""
    try:
        return str(pid).encode() in read_file(cgroup / "cgroup.procs").split()
    except OSError:
        return False
