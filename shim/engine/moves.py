"""Moving a container to a new cpuset: straight into its cgroup when the engine knows where
that is, through the runtime (UpdateContainerResources) otherwise.

A direct write takes tens of microseconds where the runtime's ``runc update`` forks a process
and takes milliseconds; it is what makes a pod's create and stop cost about what they cost
without cpushim (docs/performance.md). The runtime is told afterwards, so its own record (the
spec, what ContainerStatus reports, what systemd holds for the scope) stays true: one update
carrying the latest cpuset once the container's cpuset has stayed put for ``record_delay``
seconds, so a burst of moves costs one ``runc update``; a container that keeps moving (a node
churning pods) is still recorded every ``record_max_delay`` seconds. Records run at most
``concurrency`` at a time, as moves through the runtime do. An update in flight is
waited for before the next direct write, so an older cpuset can never overwrite a newer one.
An update the runtime refuses is logged, counted (``runtime_record_errors``) and tried again
after the record delay, a second at least, the wait doubling up to a minute while it keeps
refusing. One record cannot wait: under cgroup v2 with the systemd driver, a shrink whose CPUs
systemd's copy of the cpuset still holds is recorded at once (:meth:`Mover.systemd_holds_more`).

A hung containerd shim answers no call about its containers until its call's deadline. A
move does not wait for such a call past ``stuck_after`` seconds: the container is taken for
stuck (``Tracked.runtime_stuck``) and its cgroup written without the call's lock, and the
call, when it ends, writes the cgroup again with the latest cpuset, since the runtime's write
of its older one may have landed after. Until a call about it is answered, its moves are
written at once and its records wait in the background, so one hung shim holds up no pod's
call but its own.

Exclusive containers (whose mems and CFS quota move too) and containers that have not started
(no cgroup yet) always go through the runtime, and so does a shared container given every
memory node anew (their list changed with memory hotplug).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import orjson
from google.protobuf.message import DecodeError

from shim import cgroups, child_cpusets
from shim.cgroups import CgroupError, CgroupLayout, CgroupVersion
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.upstream import RuntimeChannel
from shim.engine import requests as rq
from shim.engine.retrying import MAX_RETRY_DELAY
from shim.engine.tracked import Phase, Tracked
from shim.fileio import read_file

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class _Turn:
    """One of a semaphore's turns, which may be given back before the ``async with`` ends."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self._semaphore = semaphore
        self._held = False

    async def __aenter__(self) -> _Turn:
        await self._semaphore.acquire()
        self._held = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.give_back()

    def give_back(self) -> None:
        if self._held:
            self._held = False
            self._semaphore.release()


class Spawn(Protocol):
    """Runs work in the background, as the engine's own (drained and cancelled with it)."""

    def __call__(self, work: Coroutine[Any, Any, _T], /) -> asyncio.Task[_T]: ...


# The least wait before a record the runtime refused is sent again.
MIN_RECORD_RETRY_DELAY = 1.0


def cgroups_path_of(verbose_info: str) -> str:
    """The OCI ``cgroupsPath`` in a ContainerStatus verbose ``info`` document; "" when it
    names none. ValueError for a document that is not JSON of that shape."""
    try:
        spec = orjson.loads(verbose_info).get("runtimeSpec", {})
        path = spec.get("linux", {}).get("cgroupsPath", "")
    except AttributeError as exc:
        raise ValueError(f"not a verbose info document: {exc}") from None
    return path if isinstance(path, str) else ""


def pid_of(verbose_info: str) -> int:
    """The process id in a ContainerStatus verbose ``info`` document; 0 when it has none."""
    try:
        pid = orjson.loads(verbose_info).get("pid", 0) if verbose_info else 0
    except (ValueError, AttributeError):
        return 0
    return pid if isinstance(pid, int) and pid > 0 else 0


def container_status(reply: Reply) -> tuple[pb.ContainerStatusResponse | None, str]:
    """The status in a ContainerStatus answer, or why there is none (a failed call, or an
    answer that does not decode); NOT_FOUND is the caller's to tell first."""
    if reply.status is not Status.OK or not reply.messages:
        return None, f"{reply.status.name}: {reply.status_message}"
    try:
        return pb.ContainerStatusResponse.FromString(reply.messages[0]), ""
    except DecodeError as exc:
        return None, f"the answer does not decode ({exc})"


@dataclass(frozen=True)
class CgroupPlace:
    """Where the runtime says a container's cgroup is: ``directory`` is None when no layout
    is known, the runtime names none (``not_named``), or the name cannot be placed
    (``error`` says why)."""

    directory: Path | None
    error: str = ""
    # The runtime's answer gives no cgroupsPath: no verbose info, or none in its OCI spec.
    not_named: bool = False


NOT_NAMED: Final = CgroupPlace(None, not_named=True)


@dataclass(frozen=True)
class Found:
    """Where a container's cgroup is (None: not found), and whether the container has
    ended (its process is gone: its CPUs may go back)."""

    cgroup: Path | None
    ended: bool = False
    # False when the runtime did not answer (a failed call, an answer that does not decode):
    # the container may be running there all the same, and asking again may tell.
    answered: bool = True


def _process_ended(pid: int) -> bool:
    """Whether the process ``pid`` is gone or a zombie; False when unknown (0) or alive (a
    pid reused by another process counts as alive: the container is then not taken for
    ended)."""
    if pid <= 0:
        return False
    try:
        stat = read_file(f"/proc/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError):
        # ESRCH: opened, then reaped before the read.
        return True
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses; from the last ")".
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


class DirectWrite(enum.Enum):
    """What :meth:`Mover.write_now` did with a move."""

    WRITTEN = "written"
    # Not tried: the container moves through the runtime, or its write must wait for its
    # lock, or be recorded at once; :meth:`Mover.move` makes it.
    NOT_NOW = "not now"
    # Tried, and the kernel refused it: :meth:`Mover.move` with ``refused`` set asks the
    # runtime without making the write again.
    REFUSED = "refused"


@dataclass(frozen=True)
class MoveResult:
    ok: bool
    # The runtime no longer knows the container.
    gone: bool = False
    # Not ok, but the cgroup holds the new cpuset (written straight into it, past its child
    # cpusets): the runtime refused its record, and the memory nodes or quota with it.
    moved: bool = False


class Mover:
    def __init__(
        self,
        runtime: RuntimeChannel,
        layout: CgroupLayout | None,
        counters: Counter[str],
        *,
        timeout: float,
        record_delay: float,
        record_max_delay: float,
        spawn: Spawn,
        concurrency: int = 8,
        stuck_after: float = 2.0,
    ) -> None:
        self.runtime = runtime
        self.layout = layout
        self.counters = counters
        self.timeout = timeout
        # How long a move waits for a runtime call about the same container (which holds its
        # write lock) before taking that container's runtime for stuck.
        self.stuck_after = stuck_after
        self.record_delay = record_delay
        self.record_max_delay = record_max_delay
        self._spawn = spawn
        self._recorders: dict[str, asyncio.Task[None]] = {}
        # Called when the runtime answers again for a container that owes it the settings
        # of a move written past its calls (the engine hurries its move retry).
        self.answering_again: Callable[[], None] | None = None
        # Records fall due together (every shared container moves at once): each is a
        # ``runc update``, and holds its container's write lock while it runs.
        self._recording = asyncio.Semaphore(concurrency)
        self._flush = asyncio.Event()
        # The names a container's first process's parent may have (tests run their own).
        self.shims = cgroups.CONTAINERD_SHIMS

    # --- moving -----------------------------------------------------------------------------

    async def move(
        self,
        tracked: Tracked,
        cpus: CPUSet,
        mems: str,
        quota: int | None,
        *,
        refused: bool = False,
    ) -> MoveResult:
        """Move the container: a write of its cgroup when it moves that way, through the
        runtime otherwise, or when the kernel refuses the write. ``refused``: the kernel
        refused this write a moment ago (:meth:`write_now`), and would again."""
        if not refused and self.writes_directly(tracked, mems, quota):
            if not await self.turn(tracked):
                # A call about it that the runtime does not answer holds the lock: the cgroup
                # is written past it, and that call writes it again when it ends.
                if self._write_cgroup(tracked, cpus):
                    self.counters["writes_past_stuck_runtime"] += 1
                    return MoveResult(ok=True)
                return MoveResult(ok=False)
            handed_on = False
            try:
                if self._write_cgroup(tracked, cpus):
                    if self.systemd_holds_more(tracked, cpus) and not tracked.runtime_stuck:
                        handed_on = True
                        return await self._record_now(tracked, cpus)
                    return MoveResult(ok=True)
                handed_on = True
                return await self._update_handed_on(tracked, cpus, mems, quota, tree_first=False)
            finally:
                if not handed_on:
                    tracked.write_lock.release()
        return await self.update_through_runtime(tracked, cpus, mems, quota, tree_first=not refused)

    async def turn(self, tracked: Tracked) -> bool:
        """Take the container's write lock for a direct write, or for kubelet's update of it;
        False, without it, when the container's runtime is stuck: a call about it held the
        lock for ``stuck_after`` seconds, or one went unanswered past its deadline and none
        has been answered since (the holder may be such a call). Moves of other containers
        wait meanwhile (the engine's lock is held), so this wait bounds what one hung shim
        costs them."""
        lock = tracked.write_lock
        while True:
            if tracked.runtime_stuck and lock.locked():
                return False
            # Bounded even when the lock is free: a waiter may be queued for it already.
            try:
                async with asyncio.timeout(self.stuck_after):
                    await lock.acquire()
                return True
            except TimeoutError:
                if lock.locked():
                    self._stuck(tracked, waited=self.stuck_after)
                    return False
                # Released as the wait ran out: taken on the next turn of the loop.

    def write_now(
        self, tracked: Tracked, cpus: CPUSet, mems: str, quota: int | None
    ) -> DirectWrite:
        """Move the container by a write of its cgroup without suspending, when it moves that
        way, no write of its cpuset is under way and the move needs no record at once.
        Otherwise, or when the kernel refuses the write, it is to be moved with :meth:`move`.
        Not taking the lock is safe: nothing runs between the check and the write, and
        whoever takes the lock next reads ``tracked.applied`` afresh. A container whose
        runtime is stuck is written even while a call about it holds the lock (the call
        writes the cgroup again when it ends), and its shrinks are not recorded at once
        (the record would wait on the stuck runtime; it is left to the delayed one)."""
        stuck = tracked.runtime_stuck
        locked = tracked.write_lock.locked()
        if (
            (locked and not stuck)
            or not self.writes_directly(tracked, mems, quota)
            or (self.systemd_holds_more(tracked, cpus) and not stuck)
        ):
            return DirectWrite.NOT_NOW
        if self._write_cgroup(tracked, cpus):
            if locked:
                self.counters["writes_past_stuck_runtime"] += 1
            return DirectWrite.WRITTEN
        return DirectWrite.REFUSED

    def systemd_keeps_cpuset(self, tracked: Tracked) -> bool:
        """Whether systemd holds a copy of the container's cpuset (``AllowedCPUs``), which it
        writes into the cgroup whenever it applies the unit (at every daemon-reload, and
        when it realizes the unit again for its own reasons): on cgroup v2, for a container
        in a scope of its own (containerd's form under the systemd driver). runc sets that
        copy at every update. Under the cgroupfs driver no unit holds it."""
        return (
            self.layout is not None
            and self.layout.version is CgroupVersion.V2
            and tracked.cgroup is not None
            and tracked.cgroup.name.endswith(".scope")
        )

    def systemd_holds_more(self, tracked: Tracked, cpus: CPUSet) -> bool:
        """Whether systemd's copy of the cpuset may hold CPUs outside ``cpus``: a shrink
        written only into the cgroup would then be undone whenever systemd applies the unit
        again, and a shared container would run on CPUs just given out exclusively. Such a
        move is told to the runtime (and so to systemd) at once, before the caller goes on;
        a move that only grows the set is told later, as under the cgroupfs driver (a copy
        left behind can then take CPUs away from the container for a moment, never hand it
        another's). The copy is the runtime's record, unknown after a refused update (runc
        may have told systemd before it failed)."""
        if not self.systemd_keeps_cpuset(tracked):
            return False
        return tracked.recorded is None or not tracked.recorded.issubset(cpus)

    async def _record_now(self, tracked: Tracked, cpus: CPUSet) -> MoveResult:
        """Tell the runtime of a cpuset just written into the cgroup. The caller's write lock
        is handed on to this record (:meth:`_hand_on`), which waits for it ``stuck_after``
        seconds at most. The cgroup holds the cpuset whatever the runtime says: a refusal
        is counted and logged, and the record is left to the delayed one already planned,
        which tries again."""

        async def record() -> MoveResult:
            reply = await self._send_record(tracked, cpus)
            if reply.status is Status.NOT_FOUND:
                return MoveResult(ok=False, gone=True)
            if reply.status is Status.OK:
                self.counters["systemd_records_at_once"] += 1
            else:
                self._record_refused(tracked, cpus, reply, self.record_delay)
            return MoveResult(ok=True)

        # Still running, or failed: the cgroup is as written, the delayed record tries again.
        return await self._hand_on(tracked, record, self.stuck_after) or MoveResult(ok=True)

    def hand_on(
        self, tracked: Tracked, call: Callable[[], Awaitable[_T]], *, awaited: bool = False
    ) -> asyncio.Task[_T]:
        """Run ``call``, a runtime call about the container, in a task of its own that is
        handed the caller's write lock and gives it back when it ends (also when cancelled
        before it ran, as when the loop is torn down): the caller, who holds the engine's
        lock, can then wait for it a moment only (:meth:`answered_within`), since a call to
        a hung shim would hold it until its deadline. A defect in it is logged and counted
        here, unless ``awaited``: whoever awaits the task gets it, and tells it."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                tracked.write_lock.release()

        async def run() -> _T:
            try:
                return await call()
            finally:
                release()

        def done(task: asyncio.Task[_T]) -> None:
            release()
            if not awaited and not task.cancelled() and task.exception() is not None:
                self.counters["internal_errors"] += 1
                log.error(
                    "a runtime call about a container failed",
                    exc_info=task.exception(),
                    extra={"fields": tracked.named()},
                )

        calling = self._spawn(run())
        calling.add_done_callback(done)
        return calling

    def call_wait(self, tracked: Tracked) -> float:
        """How long a call about the container is waited for under the engine's lock: not at
        all while its runtime is taken for stuck, which would most likely hold it too."""
        return 0.0 if tracked.runtime_stuck else self.stuck_after

    async def answered_within(self, tracked: Tracked, call: asyncio.Task[Any], wait: float) -> bool:
        """Wait ``wait`` seconds at most for a call :meth:`hand_on` runs; whether it ended.
        When it has not, the container's runtime is taken for stuck."""
        await asyncio.wait({call}, timeout=wait)
        if call.done():
            return True
        self._stuck(tracked, waited=wait)
        return False

    async def _hand_on(
        self, tracked: Tracked, call: Callable[[], Awaitable[MoveResult]], wait: float
    ) -> MoveResult | None:
        """:meth:`hand_on`, waited for ``wait`` seconds at most: its result; None when it
        runs on past that or failed."""
        calling = self.hand_on(tracked, call)
        if not await self.answered_within(tracked, calling, wait):
            return None
        if calling.cancelled() or calling.exception() is not None:
            return None
        return calling.result()

    async def _send_record(self, tracked: Tracked, cpus: CPUSet) -> Reply:
        """UpdateContainerResources with a cpuset the cgroup already holds (the write lock
        held); on success it is the runtime's record."""
        moved_at = tracked.moved_at
        reply = await self.runtime.unary(
            UnaryCall(
                rq.UPDATE_CONTAINER_RESOURCES, (), rq.update_request(tracked.id, cpus), self.timeout
            )
        )
        self.heard(tracked, reply)
        if reply.status is Status.OK:
            tracked.recorded = cpus
            self.counters["runtime_records"] += 1
        if tracked.moved_at != moved_at:
            self.write_past(tracked)
        return reply

    # --- a runtime that does not answer for a container --------------------------------------

    def _stuck(self, tracked: Tracked, *, waited: float, deadline: bool = False) -> None:
        """A call about the container has gone unanswered for ``waited`` seconds: moves go past
        its calls from now on. Past the call's ``deadline`` the runtime is taken for hung
        (warned of, counted, the gauge's); before it, the call may only be slow (a
        ``runc update`` on a loaded node, or under emulation, can take seconds), which is
        logged at info level, once per spell."""
        if deadline and not tracked.runtime_hung:
            tracked.runtime_stuck = tracked.runtime_hung = True
            self.counters["stuck_runtime_spells"] += 1
            log.warning(
                "the runtime does not answer for a container (a hung containerd shim?); its"
                " moves are written into its cgroup without waiting for it until it answers",
                extra={"fields": {**tracked.named(), "waited_s": waited}},
            )
        elif not tracked.runtime_stuck:
            tracked.runtime_stuck = True
            log.info(
                "a runtime call about a container is slow; its moves go past its calls until"
                " one is answered",
                extra={"fields": {**tracked.named(), "waited_s": waited}},
            )

    def heard(self, tracked: Tracked, reply: Reply) -> None:
        """A call about the container has ended: whether its runtime answers."""
        if reply.status is Status.DEADLINE_EXCEEDED:
            self._stuck(tracked, waited=self.timeout, deadline=True)
        elif reply.unanswered or reply.status is Status.CANCELLED:
            # No answer about the container (a lost connection, the caller gone): it tells
            # nothing of whether its runtime answers.
            return
        elif tracked.runtime_stuck:
            if tracked.runtime_hung:
                log.info(
                    "the runtime answers for a container again", extra={"fields": tracked.named()}
                )
            tracked.runtime_stuck = tracked.runtime_hung = False
            if tracked.settings_stale and self.answering_again is not None:
                # Moves written past its calls left the runtime its part (write_past_call):
                # their retry need not wait out a delay grown while it did not answer.
                self.answering_again()

    def write_past(self, tracked: Tracked) -> None:
        """A call through the runtime has ended after a direct write went past it (its runtime
        was stuck): the runtime's write of the call's older cpuset may have landed after that
        one, so the latest is written again."""
        cpus = tracked.applied
        if cpus is None or tracked.cgroup is None or tracked.phase is not Phase.RUNNING:
            return
        log.info(
            "a late runtime call may have undone a newer cpuset; writing it again",
            extra={"fields": {**tracked.named(), "cpus": str(cpus)}},
        )
        self._write_cgroup(tracked, cpus)

    async def record_behind(self, tracked: Tracked) -> None:
        """Tell the runtime of a cpuset the cgroup holds and its record does not (found so
        at start-up or in a sweep: written before a stop, or by someone else): at once when
        systemd's copy may hold CPUs outside it, as :meth:`move` does for its own writes,
        else after the record delay (:meth:`record_later`). A sweep calls this under the
        engine's lock: the container's lock is waited for as a move waits for it, and when
        its runtime is stuck the record is left to the delayed one."""
        if not await self.turn(tracked):
            self.record_later(tracked)
            return
        handed_on = False
        try:
            cpus = tracked.applied
            if (
                cpus is not None
                and tracked.phase is Phase.RUNNING
                and self.systemd_holds_more(tracked, cpus)
                and not tracked.runtime_stuck
            ):
                handed_on = True
                await self._record_now(tracked, cpus)
        finally:
            if not handed_on:
                tracked.write_lock.release()
        if tracked.applied != tracked.recorded:
            self.record_later(tracked)

    def write_tree(self, tracked: Tracked, name: str, values: CPUSet) -> None:
        """Write a container's cgroup file ``name`` (``cpuset.cpus``, ``cpuset.mems``); under
        cgroup v1, the cgroups it made below its own first (shim/child_cpusets.py), and under
        v2 too when the kernel refuses the write for them (EBUSY: before Linux 5.17 v2 kept
        a child's own set inside its parent's as v1 does). OSError when refused, with the
        cgroups as they were."""
        directory = tracked.cgroup
        assert directory is not None
        if self.layout is None:
            cgroups.write_list(directory, name, values)
            return
        if self.layout.version is CgroupVersion.V2 and not tracked.child_memory.get(name):
            # Children it narrowed before (remembered) get their own sets back on the way.
            try:
                cgroups.write_list(directory, name, values)
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or not child_cpusets.has_children(directory):
                    raise
        memory = tracked.child_memory.get(name, {})
        written, tracked.child_memory[name] = child_cpusets.move_with_children(
            directory,
            name,
            values,
            memory,
            inherit_empty=self.layout.version is CgroupVersion.V2,
        )
        if written:
            self.counters["child_cpuset_writes"] += written

    def _write_cgroup(self, tracked: Tracked, cpus: CPUSet) -> bool:
        assert tracked.cgroup is not None
        try:
            # Inline, not in a worker thread: the write takes tens of microseconds, the hop
            # to a thread and back costs more on a busy node.
            self.write_tree(tracked, cgroups.CPUSET_CPUS, cpus)
        except OSError as exc:
            # Gone, or refused (a v1 parent without these CPUs, a child holding more, an
            # offline CPU): the runtime decides.
            log.info(
                "direct cgroup write failed; moving through the runtime",
                extra={"fields": {**tracked.named(), "error": str(exc)}},
            )
            return False
        self.counters["cgroup_writes"] += 1
        tracked.applied = cpus
        tracked.moved_at = asyncio.get_running_loop().time()
        self.record_later(tracked)
        return True

    @staticmethod
    def writes_directly(tracked: Tracked, mems: str, quota: int | None) -> bool:
        """Whether a move of this container is a write of its cgroup (else a runtime call)."""
        return (
            tracked.cgroup is not None
            and tracked.phase is Phase.RUNNING
            and not tracked.exclusive
            and not mems
            and quota is None
        )

    async def update_through_runtime(
        self,
        tracked: Tracked,
        cpus: CPUSet,
        mems: str,
        quota: int | None,
        *,
        tree_first: bool = True,
    ) -> MoveResult:
        """UpdateContainerResources under the container's write lock, which is waited for as
        a direct write waits for it (:meth:`turn`); the call is waited for ``stuck_after``
        seconds at most, and not at all while the runtime is taken for stuck. A call about
        the container that holds either up has the move written into the cgroup past it
        (:meth:`write_past_call`), unless the kernel has just refused that write (not
        ``tree_first``): the move is then not made, and its retry tries again."""
        if not await self.turn(tracked):
            return self._past_call(tracked, cpus, mems, quota, tree_first=tree_first)
        return await self._update_handed_on(tracked, cpus, mems, quota, tree_first=tree_first)

    async def _update_handed_on(
        self, tracked: Tracked, cpus: CPUSet, mems: str, quota: int | None, *, tree_first: bool
    ) -> MoveResult:
        """:meth:`update_locked`, the caller's write lock handed on to it (:meth:`_hand_on`)."""

        def update() -> Awaitable[MoveResult]:
            return self.update_locked(tracked, cpus, mems, quota, tree_first=tree_first)

        result = await self._hand_on(tracked, update, self.call_wait(tracked))
        if result is None:
            return self._past_call(tracked, cpus, mems, quota, tree_first=tree_first)
        return result

    def _past_call(
        self, tracked: Tracked, cpus: CPUSet, mems: str, quota: int | None, *, tree_first: bool
    ) -> MoveResult:
        if not tree_first:
            # The kernel refused this very write a moment ago: it would again.
            return MoveResult(ok=False)
        return self.write_past_call(tracked, cpus, mems, quota)

    def write_past_call(
        self, tracked: Tracked, cpus: CPUSet, mems: str, quota: int | None
    ) -> MoveResult:
        """A move through the runtime held up by a call about the container (its runtime
        stuck): its CPUs, then its memory nodes, are written into its cgroup past that call,
        so that it leaves CPUs just given out exclusively. What only the runtime sets (a CFS
        quota, its own record) is left to the move's retry, once the runtime answers: the
        move is not ok. The call, when it ends, writes the latest cpuset again
        (:meth:`write_past`)."""
        if tracked.cgroup is None or tracked.phase is not Phase.RUNNING:
            return MoveResult(ok=False)
        # A retry of the move while the runtime still does not answer: the CPUs are in place
        # (a late call's older ones are written over when it ends), the memory nodes written
        # again, since that call may have written its own.
        if tracked.applied != cpus:
            if not self._write_cgroup(tracked, cpus):
                return MoveResult(ok=False)
            self.counters["writes_past_stuck_runtime"] += 1
        if mems:
            try:
                self.write_tree(tracked, cgroups.CPUSET_MEMS, CPUSet.parse(mems))
            except OSError as exc:
                log.info(
                    "direct write of a container's memory nodes failed; left to the runtime",
                    extra={"fields": {**tracked.named(), "mems": mems, "error": str(exc)}},
                )
        if mems or quota is not None:
            tracked.settings_stale = True
        return MoveResult(ok=False, moved=True)

    async def update_locked(
        self,
        tracked: Tracked,
        cpus: CPUSet,
        mems: str,
        quota: int | None,
        *,
        tree_first: bool = True,
        cpus_written: bool = False,
    ) -> MoveResult:
        """UpdateContainerResources with the container's write lock already held; the
        cgroups below the container's written first (:meth:`write_tree_first`) unless
        ``tree_first`` is False: after a direct write of the same CPUs the kernel refused
        (:meth:`write_tree` is that write), which it would refuse again. ``cpus_written``:
        that write was just made, and only the memory nodes are left to write first."""
        written = tree_first and self.write_tree_first(
            tracked, cpus, mems, cpus_written=cpus_written
        )
        request = rq.update_request(tracked.id, cpus, mems, quota=quota)
        moved_at = tracked.moved_at
        reply = await self.runtime.unary(
            UnaryCall(rq.UPDATE_CONTAINER_RESOURCES, (), request, self.timeout)
        )
        self.heard(tracked, reply)
        if tracked.moved_at != moved_at:
            # A direct write went past this call (its runtime was stuck): that write's cpuset
            # is the latest, whatever the runtime did with this one. One that left memory
            # nodes or a quota to the runtime (write_past_call) is not given them by this
            # call's answer, which carried its own: not ok, or the caller would take them
            # for given (Engine._restored) and the move's retry would find nothing to do.
            if reply.status is Status.OK:
                tracked.recorded = cpus
            elif reply.status is not Status.NOT_FOUND:
                tracked.recorded = None  # as in _record_refused: runc may have told systemd
            self.write_past(tracked)
            ok = reply.status is Status.OK and not tracked.settings_stale
            return MoveResult(ok=ok, gone=reply.status is Status.NOT_FOUND)
        if reply.status is Status.OK:
            tracked.applied = tracked.recorded = cpus
            self.counters["cpuset_updates"] += 1
            return MoveResult(ok=True)
        if reply.status is Status.NOT_FOUND:
            return MoveResult(ok=False, gone=True)
        if written:
            self.refused_after_tree_write(tracked, cpus, mems, quota, reply)
            return MoveResult(ok=False, moved=True)
        self.counters["cpuset_update_errors"] += 1
        tracked.recorded = None  # as in _record_refused
        log.warning(
            "could not move a container",
            extra={
                "fields": {
                    **tracked.named(),
                    "cpus": str(cpus),
                    "error": f"{reply.status.name}: {reply.status_message}",
                }
            },
        )
        return MoveResult(ok=False)

    def write_tree_first(
        self, tracked: Tracked, cpus: CPUSet, mems: str, *, cpus_written: bool = False
    ) -> bool:
        """Before an update through the runtime (cpushim's move, or kubelet's call carrying
        cpushim's cpuset): under cgroup v1, a running container with child cpusets gets its
        CPUs (and memory nodes) written here, children first, since ``runc update`` writes
        the container's own files only and the kernel refuses a shrink below a child. True
        when written; the caller then settles a refusal with
        :meth:`refused_after_tree_write`. Under v2 the same, for kernels before 5.17, which
        refuse a shrink below a child's own set there too (:meth:`write_tree`).
        ``cpus_written``: the CPUs are in place already (a drift repair's direct write)."""
        directory = tracked.cgroup
        if (
            directory is None
            or tracked.phase is not Phase.RUNNING
            or self.layout is None
            or not child_cpusets.has_children(directory)
        ):
            return False
        files = [] if cpus_written else [(cgroups.CPUSET_CPUS, cpus)]
        if mems:
            files.append((cgroups.CPUSET_MEMS, CPUSet.parse(mems)))
        for name, values in files:
            try:
                self.write_tree(tracked, name, values)
            except OSError as exc:
                log.info(
                    "direct write of a container with child cpusets failed",
                    extra={"fields": {**tracked.named(), "file": name, "error": str(exc)}},
                )
                # The CPUs may have moved already: the runtime is asked for the rest.
                return name != cgroups.CPUSET_CPUS
        return True

    def refused_after_tree_write(
        self, tracked: Tracked, cpus: CPUSet, mems: str, quota: int | None, reply: Reply
    ) -> None:
        """The runtime refused an update after :meth:`write_tree_first` wrote the cgroups: the
        cpuset is in place (the watches compare with what was applied); what was refused is
        the runtime's record, and the memory nodes or quota that go with it."""
        tracked.applied = cpus
        tracked.moved_at = asyncio.get_running_loop().time()
        retry: float | str
        if mems or quota is not None:
            # Those go through the runtime only: the move is tried again for them, as for an
            # adopted container's settings.
            tracked.settings_stale = True
            retry = "with the move"
        else:
            self.record_later(tracked)
            retry = self.record_delay
        self._record_refused(tracked, cpus, reply, retry)

    # --- telling the runtime what was written directly -------------------------------------------

    def record_later(self, tracked: Tracked) -> None:
        """Tell the runtime of this container's cpuset after the record delay."""
        if tracked.id not in self._recorders:
            self._recorders[tracked.id] = self._spawn(self._record(tracked))

    async def _record(self, tracked: Tracked) -> None:
        loop = asyncio.get_running_loop()
        # Since when the runtime's record has been behind the cgroup.
        behind_since = loop.time()
        retry_at = 0.0
        refusals = 0  # in a row
        try:
            while tracked.phase is not Phase.EXITED:
                await self._until_due(tracked, behind_since, retry_at)
                # The turn first, then the lock: one waiting its turn holding the lock would
                # hold up a direct write of the container.
                turn = _Turn(self._recording)
                async with turn, tracked.write_lock:
                    cpus = tracked.applied
                    if cpus is None or cpus == tracked.recorded:
                        return
                    reply = await self._send_record_in_turn(tracked, cpus, turn)
                    if reply.status is Status.NOT_FOUND:
                        return  # gone: nothing left to record
                    if reply.status is not Status.OK:
                        # The cgroup is right; the runtime's record (and systemd's) is behind.
                        retrying = not self._flush.is_set()
                        delay = self._retry_delay(refusals)
                        refusals += 1
                        self._record_refused(
                            tracked, cpus, reply, delay if retrying else "at the next start"
                        )
                        if not retrying:
                            return  # shutting down: the next start's resync squares it
                        retry_at = loop.time() + delay
                        continue
                    refusals = 0
                behind_since = loop.time()
        finally:
            self._recorders.pop(tracked.id, None)

    async def _send_record_in_turn(self, tracked: Tracked, cpus: CPUSet, turn: _Turn) -> Reply:
        """:meth:`_send_record`, giving the turn back once the call has gone unanswered for
        ``stuck_after`` (at once while the runtime is taken for stuck): a record to a hung
        shim would keep it until its deadline, and with as many hung shims as turns, no
        other container on the node would be recorded."""
        giving_back = asyncio.get_running_loop().call_later(self.call_wait(tracked), turn.give_back)
        try:
            return await self._send_record(tracked, cpus)
        finally:
            giving_back.cancel()

    def _record_refused(
        self, tracked: Tracked, cpus: CPUSet, reply: Reply, retry: float | str
    ) -> None:
        """Count and log a refused record of a cpuset the cgroup already holds; ``retry``
        says when it is sent again: in so many seconds (``retry_in_s``), or with what."""
        self.counters["runtime_record_errors"] += 1
        # runc may have told systemd before it failed: what the record holds is unknown.
        tracked.recorded = None
        fields: dict[str, object] = {
            **tracked.named(),
            "cpus": str(cpus),
            "error": f"{reply.status.name}: {reply.status_message}",
            "retry_in_s": None if isinstance(retry, str) else retry,
        }
        if isinstance(retry, str):
            fields["retry"] = retry
        log.warning("the runtime did not record a container's cpuset", extra={"fields": fields})

    async def _until_due(self, tracked: Tracked, behind_since: float, not_before: float) -> None:
        """Until the cpuset has stayed put for the record delay, or the record has been behind
        for the longest delay (a container that keeps moving is still recorded now and then),
        and not before ``not_before`` (a retry); or until a flush."""
        loop = asyncio.get_running_loop()
        while not self._flush.is_set():
            due = min(tracked.moved_at + self.record_delay, behind_since + self.record_max_delay)
            due = max(due, not_before)
            wait = due - loop.time()
            if wait <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flush.wait(), wait)

    def _retry_delay(self, refusals: int) -> float:
        """How long a refused record waits before it is tried again: the record delay, never
        less than ``MIN_RECORD_RETRY_DELAY``, doubled for each refusal before it in a row up
        to a minute, so a runtime that keeps refusing (one ``runc update`` and one warning
        each time) is not called every second while the container lives."""
        first = max(self.record_delay, MIN_RECORD_RETRY_DELAY)
        return min(first * (1 << min(refusals, 16)), max(first, MAX_RETRY_DELAY))

    def flush(self) -> None:
        """Tell the runtime every cpuset written directly now, not after the delay (at
        shutdown); the recorders are the engine's tasks, which it waits for."""
        self._flush.set()

    # --- where the cgroup is -------------------------------------------------------------------

    async def locate(self, tracked: Tracked, *, just_started: bool = False) -> Path | None:
        """Find the container's cgroup and first process; set and return the cgroup (None
        when neither containerd's layout nor the runtime says, or the cgroup does not
        exist). Only ``just_started`` containers are found from the layout: later, the
        container's own process may have moved, or handed its place on."""
        return (await self.find(tracked, just_started=just_started)).cgroup

    async def find(self, tracked: Tracked, *, just_started: bool = False) -> Found:
        """:meth:`locate`, and when the cgroup is not found, whether that is because the
        container has ended: the runtime no longer knows it or says it exited, or the cgroup
        it names is gone with the process it names. A process that ends at once can take its
        cgroup with it before it is looked for (systemd removes an emptied scope at once),
        while containerd still reports the container running until its shim has cleaned up:
        no watch would then ever see the exit. Not ``answered`` when the runtime did not
        say."""
        if self.layout is None:
            return Found(None)
        if just_started and self._derive(tracked):
            return Found(tracked.cgroup)
        request = pb.ContainerStatusRequest(container_id=tracked.id, verbose=True)
        reply = await self.runtime.unary(
            UnaryCall(rq.CONTAINER_STATUS, (), request.SerializeToString(), self.timeout)
        )
        if reply.status is Status.NOT_FOUND:
            return Found(None, ended=True)
        status, error = container_status(reply)
        if status is None:
            if reply.status is Status.OK:
                # Answered, with an answer that does not decode: the next answer is likely
                # to be the same. A failed call (containerd restarting) is not told of.
                self.undecodable_status(tracked, error)
            return Found(None, answered=False)
        tracked.status_answered()
        info = status.info.get("info", "")
        place = self.cgroup_of(info)
        self.unplaced_cgroup(tracked, place)
        directory = place.directory
        if directory is None:
            return Found(None, ended=status.status.state == pb.CONTAINER_EXITED)
        if not directory.is_dir():
            ended = status.status.state == pb.CONTAINER_EXITED or _process_ended(pid_of(info))
            if not ended:
                self._missing_cgroup(tracked, directory)
            return Found(None, ended=ended)
        tracked.cgroup = directory
        tracked.pid = pid_of(info)
        return Found(directory)

    def _missing_cgroup(self, tracked: Tracked, directory: Path) -> None:
        """Warn, once per container, that the cgroup the runtime names for it is not there
        while it runs: most likely cpushim sees another cgroup tree than the runtime's (a
        mount or cgroup namespace of its own). Every full look asks again, and a warning at
        each would bury the first."""
        if tracked.missing_cgroup_seen:
            return
        tracked.missing_cgroup_seen = True
        log.warning(
            "the cgroup the runtime names for a running container is not there: its moves go"
            " through the runtime, nothing watches it for drift, and its exit is seen only at"
            " a full look or kubelet's next call for it",
            extra={
                "fields": {
                    **tracked.named(),
                    "cgroup": str(directory),
                }
            },
        )

    @staticmethod
    def undecodable_status(tracked: Tracked, error: str) -> None:
        """Warn, once per container, that the runtime's ContainerStatus answer for it does
        not decode (a runtime that speaks another CRI, a defect on either side), with the
        decode error. It is asked about again, and would be told at each: by the watcher
        while its cgroup is not located (after 1 s, up to a minute apart), and by every
        sweep's adoption while it waits for exclusive CPUs (resync.status_read, which warns
        in the same words, once while it stays so, of a container cpushim does not track
        and of a failed call for one it does)."""
        if tracked.undecodable_status_seen:
            return
        tracked.undecodable_status_seen = True
        log.warning(
            "cannot read a container's state; it stays as it is",
            extra={
                "fields": {
                    **tracked.named(),
                    "error": error,
                }
            },
        )

    def _derive(self, tracked: Tracked) -> bool:
        """Locate the container without asking the runtime: containerd names the cgroup from
        the pod's cgroup parent and the container id, and a just-started container has one
        process whose parent is outside it. A verbose ContainerStatus costs containerd a
        JSON rendering of the whole OCI spec, and cpushim its parsing, at every start; this
        costs a few small reads. The process must be a child of containerd's shim: a wrong
        process, watched on a pidfd, would have a running container's CPUs released when it
        ends. False (the runtime is asked) when either is not found for sure: another
        runtime's layout, an exec beside the process, a container gone."""
        assert self.layout is not None
        if not tracked.cgroup_parent:
            return False
        try:
            path = cgroups.containerd_cgroups_path(tracked.cgroup_parent, tracked.id)
            directory = self.layout.container_dir(path)
        except CgroupError:
            return False
        pid = cgroups.first_process(directory, self.shims)
        if pid == 0:
            return False
        tracked.cgroup, tracked.pid = directory, pid
        self.counters["cgroups_derived"] += 1
        return True

    def cgroup_of(self, verbose_info: str) -> CgroupPlace:
        """The cgroup directory named in a ContainerStatus verbose ``info`` document, or why
        there is none: ``NOT_NAMED``, or why it cannot be placed (told by
        :meth:`unplaced_cgroup`, once per container)."""
        if self.layout is None:
            return CgroupPlace(None)
        if not verbose_info:
            return NOT_NAMED
        try:
            path = cgroups_path_of(verbose_info)
            return CgroupPlace(self.layout.container_dir(path)) if path else NOT_NAMED
        except (ValueError, CgroupError) as exc:
            return CgroupPlace(None, str(exc))

    @staticmethod
    def unplaced_cgroup(tracked: Tracked, place: CgroupPlace) -> None:
        """Warn, once per container, that the runtime's answer names no cgroup for it, or one
        that cannot be placed: every full look asks again, and so does start-up's before
        it. Nothing to tell of a place found, or not looked for."""
        if tracked.unplaceable_cgroup_seen or not (place.not_named or place.error):
            return
        tracked.unplaceable_cgroup_seen = True
        fields = tracked.named()
        if place.not_named:
            log.warning(
                "the runtime names no cgroup for a container (its ContainerStatus verbose info"
                " has no runtimeSpec.linux.cgroupsPath): its moves go through the runtime,"
                " nothing watches it for drift, and its exit is seen only at a full look or"
                " kubelet's next call for it",
                extra={"fields": fields},
            )
            return
        log.warning(
            "cannot place a container's cgroup: its moves go through the runtime, and nothing"
            " watches it for drift",
            extra={"fields": {**fields, "error": place.error}},
        )
