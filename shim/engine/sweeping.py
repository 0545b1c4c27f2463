"""While cpushim runs: containers the runtime has that cpushim does not track.

Start-up adopts every running container it finds; after that, cpushim learns containers from
the creates it relays. A few never pass through it as a create it records: one a fail-open
create forwarded unchanged (the decision had failed), one whose create's answer was lost (its
CPUs stay held without a container id), one whose recording failed after the runtime made it,
one another CRI client made on the runtime's own socket. Each would run on any CPU, exclusive
ones included, until cpushim restarted. The sweep lists the runtime's containers and takes
the unknown ones in as start-up does: shared containers move to the shared pool, a create
whose answer was lost gets its id, and those that ask for exclusive CPUs get them where there
is room (:func:`resync.adopt_sharing`).

A container removed on the runtime by another client while its pod stays never passes
through cpushim either: the sweep finds it missing from the list and forgets it, its CPUs
going back.

It runs at every full look of the watcher and soon after a fail-open create, a lost answer or
a failed recording. A create on its way (the runtime may have made the container, cpushim not
recorded it yet) would look unknown: the sweep takes the lock only when no create is on its
way. One that could not list the runtime, that the runtime could not tell what an unknown
container or its sandbox is, or that creates kept from the lock, says so
(``SweepReport.unfinished``), and the watcher sweeps again after a while: the full looks may
be off (``resyncPeriod`` 0), and what it found would run on any CPU meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Status, UnaryCall
from shim.engine import requests as rq
from shim.engine.core import Engine
from shim.engine.resync import (
    CALL_TIMEOUT,
    LiveContainer,
    adopt_sharing,
    placed_pod,
    running_first,
    sandbox_config,
    sandbox_status,
    status_read,
    superseded_attempts,
    tracked_from_runtime,
    waiting_for_exclusive,
)
from shim.engine.tracked import Phase, Tracked
from shim.pods import Pod
from shim.state import ContainerKey, CPUState

log = logging.getLogger(__name__)

# How long a sweep waits for the creates on their way to be recorded before it gives up
# (until a later sweep).
SETTLE_TIMEOUT = 10.0


@dataclass
class SweepReport:
    # Container ids taken in: moved to the shared pool, or given their held CPUs.
    tracked: list[str] = field(default_factory=list)
    # Keys given exclusive CPUs by the adoption that follows.
    adopted_exclusive: list[ContainerKey] = field(default_factory=list)
    # The runtime's untracked containers may be left for a later sweep: it could not be
    # listed, it could not say what one of them or its sandbox is, or creates kept coming.
    unfinished: bool = False


async def sweep(engine: Engine, *, settle: float = SETTLE_TIMEOUT) -> SweepReport:
    """Forget the tracked containers the runtime no longer has, take in its live containers
    that cpushim does not track, then give the containers that share and ask for exclusive
    CPUs theirs where there is room (one taken in now, or one whose adoption found no room
    or could not be written before). A runtime that cannot be listed now leaves everything
    as it is, and one that cannot say what an unknown container is leaves that one (the
    report says it is unfinished)."""
    report = SweepReport()
    if engine.learnt_sandboxes:
        await _forget_removed(engine)
    listing = await _listing(engine)
    if listing is None:
        report.unfinished = True
    else:
        if listing.gone or listing.held_gone:
            await _forget_gone(engine, listing.gone, listing.held_gone)
        if listing.unknown:
            # The runtime is asked about them before the lock: a slow answer holds no
            # decision back.
            found, pods, unread = await _found(engine, listing.unknown)
            if unread:
                report.unfinished = True
            if found:
                taken = await _take_in(engine, found, pods, settle)
                if taken is None:
                    report.unfinished = True
                else:
                    report.tracked = taken
            if report.tracked:
                # One removed while this waited for the lock was taken in all the same:
                # the next sweep's listing finds it gone, soon rather than a period later.
                engine._sweep_soon()
    if engine.pod_level_candidates():
        # Pinned before their pod showed pod-level resources (a sibling taken in now, or
        # one whose state the runtime could not give at its create): adoption may have
        # nothing to do, so the pods are marked here.
        async with engine.lock:
            await engine.mark_pods_with_pod_level_resources()
    if worth_adopting(engine, waiting_for_exclusive(engine)):
        report.adopted_exclusive = await adopt_sharing(engine)
    return report


def worth_adopting(engine: Engine, waiting: list[Tracked]) -> bool:
    """Whether an adoption (a runtime call per waiting container, under the lock) may give
    or tell anything: a container not yet refused is waiting (its refusal is told once), or
    enough CPUs are free for the smallest request."""
    if any(not t.adoption_refused for t in waiting):
        return True
    # A resize in place kubelet made since (noted, not applied) is what an adoption plans for.
    asked = [
        t.cpus_asked if t.resize_noted is None else t.resize_noted
        for t in waiting
        if t.cpus_asked is not None
    ]
    asked = [count for count in asked if count]
    if not asked:
        return False
    return len(engine.free_exclusive()) >= min(asked)


async def _take_in(
    engine: Engine, found: list[LiveContainer], pods: dict[str, Pod], settle: float
) -> list[str] | None:
    """The containers of ``found`` (their pods in ``pods`` when cpushim did not know them)
    taken in (tracked, moved, watched), by id; None when creates kept coming."""
    taken: list[str] = []
    if not await _lock_between_creates(engine, settle):
        log.info(
            "creates kept coming; the runtime's untracked containers wait for a later sweep",
            extra={"fields": {"containers": sorted(c.id for c in found)}},
        )
        return None
    try:
        # Recorded since they were listed: a create that was on its way.
        found = [container for container in found if container.id not in engine.containers]
        if not found:
            return taken
        _learn_pods(engine, pods, found)
        # An earlier attempt that exited behind a failed decision still holds the key: its
        # CPUs go back, so the one taken in can have them (as its create would have).
        await engine._release(_held_by_exited(engine, found))
        found = running_first(found)
        state = engine.state
        for container in found:
            state = _take_held(engine, state, container)
        await engine._record(state)
        for container in found:
            tracked = tracked_from_runtime(engine, container, engine.pods, {})
            engine.containers[container.id] = tracked
            taken.append(container.id)
        engine.counters["untracked_containers_found"] += len(taken)
        await engine._apply()
        for container_id in taken:
            moved = engine.containers.get(container_id)
            if moved is None:
                continue  # removed while it was moved: the runtime no longer knows it
            if moved.cgroup is not None and moved.applied != moved.recorded:
                await engine.mover.record_behind(moved)
            engine.project(moved)
            if moved.phase is Phase.RUNNING and engine.watcher is not None:
                engine.watcher.watch(moved)
    finally:
        engine.lock.release()
    # A StartContainer answered while the lock was held found it untracked, and one that
    # ended since the runtime was asked has no cgroup to watch: looked up.
    for container_id in taken:
        looked = engine.containers.get(container_id)
        watcher = engine.watcher  # None once cpushim stops
        if looked is None or watcher is None:
            continue
        if looked.phase is Phase.CREATED:
            await watcher.look_at_created(looked)
        elif looked.phase is Phase.RUNNING and looked.cgroup is None:
            await watcher.look_at_unlocated(looked)
    log.warning(
        "took in containers the runtime made without cpushim",
        extra={
            "fields": {
                "containers": {
                    cid: str(engine.containers[cid].key)
                    for cid in taken
                    if cid in engine.containers
                },
                "shared": str(engine.state.shared),
            }
        },
    )
    return taken


async def _lock_between_creates(engine: Engine, settle: float) -> bool:
    """Take the engine lock at a moment when no create is on its way, waiting up to
    ``settle`` seconds for one; False (the lock not taken) when creates kept coming."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle
    while await engine.creates_settled(deadline - loop.time()):
        await engine.lock.acquire()
        if not engine.creates_in_flight:
            return True
        # One came in between: whatever it made looks unknown until it is recorded.
        engine.lock.release()
    return False


async def _found(
    engine: Engine, unknown: dict[str, pb.Container]
) -> tuple[list[LiveContainer], dict[str, Pod], bool]:
    """Of ``unknown``, those live now, with the pods of sandboxes cpushim does not know: a
    container left created in a sandbox that is not ready never runs (as at start-up).
    True last when the runtime could not say about one of them: it is left for a later
    sweep."""
    found: list[LiveContainer] = []
    pods: dict[str, Pod] = {}
    not_ready: set[str] | None = None
    unread = False
    for container_id in sorted(unknown):
        listed = unknown[container_id]
        read = await status_read(engine, container_id, listed.pod_sandbox_id, listed.metadata.name)
        container = read.live
        if container is None:
            unread = unread or not read.answered
            continue
        if container.state == pb.CONTAINER_CREATED:
            if not_ready is None:
                not_ready = await _sandboxes_not_ready(engine)
            if not_ready is None:
                unread = True
                continue
            if container.sandbox_id in not_ready:
                engine.never_running.add(container_id)
                continue
        if container.sandbox_id not in engine.pods and container.sandbox_id not in pods:
            pod, answered = await _pod(engine, container)
            if pod is None:
                unread = unread or not answered
                continue
            pods[container.sandbox_id] = pod
        found.append(container)
    return found, pods, unread


def _learn_pods(engine: Engine, pods: dict[str, Pod], found: list[LiveContainer]) -> None:
    """The pods of ``found`` that cpushim learnt from the runtime (kubelet's own, run
    through cpushim meanwhile, stand), and those it knows without a cgroup parent placed
    from the container found (:func:`resync.placed_pod`, no runtime call): start-up could
    read neither their sandbox's verbose status nor a container naming the pod's cgroup
    (its containers' statuses failed too), and the pod would be taken for one that is not
    kubelet's, its containers sharing, until the next start. One whose parent is known and
    not kubelet's (made by hand) stays so."""
    for container in found:
        sandbox_id = container.sandbox_id
        pod = pods.get(sandbox_id)
        if pod is not None and sandbox_id not in engine.pods:
            engine.pods[sandbox_id] = engine.marked(pod)
            engine.learnt_sandboxes.add(sandbox_id)
            continue
        known = engine.pods.get(sandbox_id)
        if known is None or known.qos is not None or known.cgroup_parent:
            continue
        placed = placed_pod(known, [container])
        if placed.qos is not None:
            log.info(
                "a pod's cgroup parent is found on its container",
                extra={
                    "fields": {
                        "pod": placed.label,
                        "sandbox_id": sandbox_id,
                        "cgroup_parent": placed.cgroup_parent,
                    }
                },
            )
            engine.pods[sandbox_id] = placed


@dataclass
class _Listing:
    # The runtime's live containers cpushim does not track, by id.
    unknown: dict[str, pb.Container]
    # Containers cpushim tracked before the listing that the runtime no longer has.
    gone: list[str]
    # Containers cpushim does not track (start-up could not read them) that hold CPUs in
    # the checkpoint and that the runtime no longer has.
    held_gone: list[str]


async def _forget_gone(engine: Engine, gone: list[str], held_gone: list[str]) -> None:
    """Containers removed on the runtime without cpushim (another client's RemoveContainer,
    its pod staying): forgotten as kubelet's RemoveContainer would have them, any CPUs
    they hold back to the shared pool. ``held_gone``: untracked ones that hold CPUs (start-up
    could not read them); without this their CPUs would stay held until their pod went."""
    async with engine.lock:
        forgotten = [container_id for container_id in gone if container_id in engine.containers]
        # Still untracked and holding: a sweep may have taken one in meanwhile (then it is
        # in the next listing, or gone from it).
        unread = [
            container_id
            for container_id in held_gone
            if container_id not in engine.containers and engine.state.holding(container_id)
        ]
        if not forgotten and not unread:
            return
        named = {cid: str(engine.containers[cid].key) for cid in forgotten}
        for container_id in unread:
            named[container_id] = str(engine.state.holding(container_id))
        log.info(
            "containers removed without cpushim are forgotten",
            extra={"fields": {"containers": named}},
        )
        held: list[ContainerKey] = []
        for container_id in [*forgotten, *unread]:
            engine.untrack(container_id)
            key = engine.state.holding(container_id)
            if key is not None and key not in held:
                held.append(key)
        engine.counters["removed_containers_found"] += len(forgotten) + len(unread)
        await engine._release(held)


async def _forget_removed(engine: Engine) -> None:
    """Forget the sandboxes learnt from the runtime that it no longer lists. Only those
    learnt before the listing: one another sweep learns meanwhile may be newer than it."""
    learnt = set(engine.learnt_sandboxes)
    listed = await _sandbox_states(engine)
    if listed is None:
        return
    for sandbox_id in sorted(learnt - set(listed)):
        log.info(
            "a sandbox made without cpushim is gone; forgotten",
            extra={"fields": {"sandbox_id": sandbox_id}},
        )
        await engine.forget_sandbox_removed_behind(sandbox_id)


async def _sandbox_states(engine: Engine) -> dict[str, int] | None:
    """The runtime's sandboxes and their states; None when it cannot list them."""
    reply = await engine.runtime.unary(UnaryCall(rq.LIST_POD_SANDBOX, (), b"", CALL_TIMEOUT))
    if reply.status is not Status.OK or not reply.messages:
        return None
    try:
        items = pb.ListPodSandboxResponse.FromString(reply.messages[0]).items
    except DecodeError:
        return None
    return {item.id: item.state for item in items}


async def _sandboxes_not_ready(engine: Engine) -> set[str] | None:
    """The ids of the runtime's sandboxes that are not ready; None when it cannot list them
    (a created container is then left for a later sweep)."""
    states = await _sandbox_states(engine)
    if states is None:
        return None
    return {sandbox_id for sandbox_id, state in states.items() if state != pb.SANDBOX_READY}


async def _listing(engine: Engine) -> _Listing | None:
    """The runtime's containers as cpushim's tracking sees them; None when it cannot list
    them. Only containers tracked before the listing can be gone from it: one created
    meanwhile may be newer than the list."""
    tracked_before = set(engine.containers)
    reply = await engine.runtime.unary(UnaryCall(rq.LIST_CONTAINERS, (), b"", CALL_TIMEOUT))
    if reply.status is not Status.OK or not reply.messages:
        log.warning(
            "cannot list the runtime's containers; untracked ones are looked for later",
            extra={"fields": {"error": f"{reply.status.name}: {reply.status_message}"}},
        )
        return None
    try:
        listed = pb.ListContainersResponse.FromString(reply.messages[0]).containers
    except DecodeError:
        return None
    listed_ids = {item.id for item in listed}
    engine.never_running.intersection_update(listed_ids)
    engine.unread_untracked.intersection_update(listed_ids)
    # As at start-up.
    engine.never_running.update(superseded_attempts(listed) - set(engine.containers))
    unknown = {
        item.id: item
        for item in listed
        if item.state != pb.CONTAINER_EXITED
        and item.id not in engine.containers
        and item.id not in engine.never_running
    }
    held_gone = sorted(
        held.container_id
        for held in engine.state.assignments.values()
        if held.container_id
        and held.container_id not in engine.containers
        and held.container_id not in listed_ids
    )
    return _Listing(unknown, sorted(tracked_before - listed_ids), held_gone)


async def _pod(engine: Engine, container: LiveContainer) -> tuple[Pod | None, bool]:
    """The pod of a container whose sandbox cpushim never saw made, as the runtime reports
    it: None when the sandbox is gone or not ready (the runtime starts no container in a
    stopped one); and False when the runtime did not say."""
    sandbox_id = container.sandbox_id
    read = await sandbox_status(engine, sandbox_id)
    if read.error:
        log.warning(
            "cannot read a sandbox's state; its containers are looked at later",
            extra={"fields": {"sandbox_id": sandbox_id, "error": read.error}},
        )
        return None, False
    status = read.status
    if status is None or status.status.state != pb.SANDBOX_READY:
        return None, True
    item = pb.PodSandbox(
        id=sandbox_id,
        metadata=status.status.metadata,
        annotations=status.status.annotations,
        state=status.status.state,
    )
    pod = Pod.from_config(sandbox_id, sandbox_config(item, status))
    return (placed_pod(pod, [container]) if read.brief else pod), True


def _key_of(engine: Engine, container: LiveContainer) -> ContainerKey | None:
    """The container's key, by its pod's UID and its name; None when its pod is unknown."""
    pod = engine.pods.get(container.sandbox_id)
    return None if pod is None else ContainerKey(pod.uid, container.name)


def _held_by_exited(engine: Engine, found: Iterable[LiveContainer]) -> list[ContainerKey]:
    """The keys of ``found`` whose CPUs a container cpushim saw exit holds."""
    keys: list[ContainerKey] = []
    for container in found:
        key = _key_of(engine, container)
        if key is None:
            continue
        held = engine.state.assignments.get(key)
        holder = engine.containers.get(held.container_id) if held is not None else None
        if holder is not None and holder.phase is Phase.EXITED and key not in keys:
            keys.append(key)
    return keys


def _take_held(engine: Engine, state: CPUState, container: LiveContainer) -> CPUState:
    """A container whose create's answer was lost: its CPUs are held under its pod and name
    without an id; they are its from now on (as start-up finds it)."""
    key = _key_of(engine, container)
    if key is None:
        return state
    held = state.assignments.get(key)
    if held is None or held.container_id or held.sandbox_id != container.sandbox_id:
        return state
    log.info(
        "a create whose answer was lost made its container; it keeps its CPUs",
        extra={"fields": {**engine._named(key), "container_id": container.id}},
    )
    return state.update(key, container_id=container.id)
