"""Start-up: load the checkpoint, check it, and square it with what the runtime reports.

The runtime is the truth about which containers exist; the checkpoint is the truth about which
CPUs they were given. Assignments whose containers are gone are released; running containers
cpushim does not know (created while it was down) are adopted, exclusive when their pod and
resources ask for it and CPUs are free, shared otherwise; a changed policy, option set or
reserved set is re-planned; then every container's cpuset is written where it differs. A
container whose status the runtime cannot give keeps any CPUs it holds, untracked, until a
sweep (shim/engine/sweeping.py) reads it and takes it in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

import orjson
from google.protobuf.message import DecodeError

from shim import cgroups
from shim.cgroups import CgroupVersion
from shim.checkpoint import CheckpointAccessError
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status, UnaryCall
from shim.engine import requests as rq
from shim.engine.core import Engine, tell_untracked_displaced
from shim.engine.moves import CgroupPlace, cgroups_path_of, container_status, pid_of
from shim.engine.tracked import Phase, Tracked
from shim.kube import CgroupParentError, kubelet_cfs_quota, pod_cgroup
from shim.pods import (
    AnnotationError,
    ContainerPlan,
    Pod,
    exclusive_request,
    has_own_resources,
    plan_container,
    takes_whole_pod,
)
from shim.policy import CPUPolicy
from shim.policy.static import AllocationError, ExclusiveRequest
from shim.progress import StartupProgress
from shim.state import (
    Assignment,
    CheckpointError,
    ContainerKey,
    CPUState,
    integrity_problems,
    replan,
    topology_changed,
)

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0
# A verbose PodSandboxStatus asks the sandbox's shim (containerd), which answers in
# milliseconds or, hung, never: each hung one would cost start-up the whole call timeout
# (systemd gives it two minutes), and the plain status that follows loses nothing the pod's
# containers cannot tell.
SANDBOX_INFO_TIMEOUT = 3.0
# Sandbox statuses asked at once at start-up.
STATUS_CONCURRENCY = 8

RECOVERY_HINT = (
    "To rebuild the state from what the runtime reports, start once with"
    " --recover-from-runtime (or recoverFromRuntime = true in the config file, set back"
    " after); the old file is kept beside it."
)

PERMISSION_HINT = (
    "Give cpushim read and write permission on the file and its directory back: their owner"
    " and mode, or what confines the unit (ReadWritePaths, SELinux, AppArmor)."
)


class StartupError(RuntimeError):
    """cpushim cannot start safely; the message says why and what to do."""


@dataclass(frozen=True)
class LiveContainer:
    id: str
    sandbox_id: str
    name: str
    attempt: int
    state: int
    resources: pb.LinuxContainerResources
    # ContainerStatus' verbose info document (it names the cgroup); "" when not given.
    info: str = ""


@dataclass
class ResyncReport:
    released: list[str] = field(default_factory=list)
    adopted_exclusive: list[str] = field(default_factory=list)
    adopted_shared: list[str] = field(default_factory=list)
    replanned: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    # Containers whose ContainerStatus failed or did not decode: left as they are for a sweep.
    unread: list[str] = field(default_factory=list)


async def start(
    engine: Engine,
    *,
    recover_from_runtime: bool = False,
    progress: StartupProgress | None = None,
) -> ResyncReport:
    """Load or rebuild the state, resync with the runtime and apply it; StartupError when the
    checkpoint cannot be trusted or the runtime cannot be listed. A sandbox or container
    whose status the runtime does not give does not stop it (see :func:`_sandboxes`,
    :func:`_reconcile`): cpushim down is kubelet's runtime down. Each step done is told to
    ``progress``: none waits longer than one runtime call's deadline (two for a sandbox: its
    verbose status given up, then the plain one), so progress that stops for longer means
    start-up is stuck."""
    if progress is None:
        progress = StartupProgress()
    progress.begin("resync: loading the checkpoint")
    loaded = _load(engine, recover_from_runtime)
    try:
        progress.begin("resync: listing sandboxes")
        pods, stopped, unplaced = await _sandboxes(engine, progress)
        progress.begin("resync: listing containers")
        live, exited, unread = await _containers(engine, pods, stopped, progress)
    except DecodeError as exc:
        raise StartupError(
            f"resync: {engine.runtime.endpoint} answered with a message that does not decode"
            f" ({exc}); is it a CRI runtime?"
        ) from exc
    for sandbox_id in unplaced:
        pods[sandbox_id] = _placed_or_told(pods[sandbox_id], live.values(), unread)
    report = ResyncReport(unread=[item.id for item in unread])
    pods = _with_pod_level_resources(pods, live, loaded.pod_level if loaded is not None else ())
    async with engine.lock:
        engine.pods = pods
        # Learnt from the runtime: one another client made never has its RemovePodSandbox
        # pass here, so a sweep forgets it once the runtime no longer lists it.
        engine.learnt_sandboxes = set(pods)
        state = _reconcile(engine, loaded, pods, live, unread, report)
        for pod in pods.values():
            if pod.pod_level_resources:
                state = state.with_pod_level(pod.uid)
        progress.begin("resync: writing the checkpoint")
        try:
            await engine.checkpoint.save(state)
        except OSError as exc:
            raise StartupError(f"cannot write {engine.checkpoint.path}: {exc}") from exc
        engine.state = state
        remembered = loaded.assignments if loaded is not None else {}
        engine.containers = {
            c.id: tracked_from_runtime(engine, c, pods, remembered) for c in live.values()
        }
        for tracked in engine.containers.values():
            # Told and counted here: the sweeps that try again do not tell it again.
            tracked.adoption_refused = str(tracked.key) in report.refused
        if report.refused:
            engine.wait_for_room()
        _whole_only_where_every_one_is(engine.containers.values())
        progress.begin("resync: moving containers")
        await engine._apply(moved=progress.advance)
        progress.begin("resync", len(engine.containers), "containers recorded")
        for tracked in engine.containers.values():
            if tracked.cgroup is not None and tracked.applied != tracked.recorded:
                # Written straight into the cgroup before a stop; the runtime never heard.
                await engine.mover.record_behind(tracked)
            engine.project(tracked)
            progress.advance()
    if engine.projector is not None:
        progress.begin("resync: removing stale projections")
        keep = {t.key for t in engine.containers.values()} | set(engine.state.assignments)
        # An exited container's directory stays with its pod, as while cpushim runs: its
        # next attempt (a crash loop's) writes there, the generation going on.
        keep |= {ContainerKey(pods[sid].uid, name) for sid, name in exited if sid in pods}
        # An unread one may run with its directory mounted.
        keep |= {
            ContainerKey(pods[c.pod_sandbox_id].uid, c.metadata.name)
            for c in unread
            if c.pod_sandbox_id in pods
        }
        await engine.projector.clean_stale(keep)
    if unread:
        # The runtime may answer for them later: a sweep takes them in as it takes in a
        # container cpushim does not track, and tries again while it cannot.
        engine._sweep_soon()
    log.info(
        "resynced with the runtime",
        extra={
            "fields": {
                "sandboxes": len(pods),
                "containers": len(live),
                "exclusive": {str(k): str(a.cpus) for k, a in engine.state.assignments.items()},
                "shared": str(engine.state.shared),
                "released": report.released,
                "adopted_exclusive": report.adopted_exclusive,
                "adopted_shared": len(report.adopted_shared),
                "replanned": report.replanned,
                "refused": report.refused,
                "unread": report.unread,
            }
        },
    )
    return report


def _load(engine: Engine, recover_from_runtime: bool) -> CPUState | None:
    path = engine.checkpoint.path
    if recover_from_runtime:
        if path.exists():
            stamp = time.strftime("%Y%m%dT%H%M%S")
            kept = path.with_name(f"{path.name}.replaced-{stamp}")
            again = 0
            while kept.exists():
                # A second recovery within the same second keeps its file too.
                again += 1
                kept = path.with_name(f"{path.name}.replaced-{stamp}.{again}")
            path.rename(kept)
            log.warning(
                "recovering from the runtime; the old checkpoint is kept",
                extra={"fields": {"kept_as": str(kept)}},
            )
        return None
    try:
        loaded = engine.checkpoint.load()
    except CheckpointAccessError as exc:
        # Not RECOVERY_HINT: the state in it may be good, and a recovery would set it aside
        # where a change of permissions is what is needed.
        raise StartupError(
            f"cpushim may not read its checkpoint: {exc}. {PERMISSION_HINT}"
        ) from exc
    except CheckpointError as exc:
        raise StartupError(f"the checkpoint is unusable: {exc}. {RECOVERY_HINT}") from exc
    if loaded is None:
        log.info("no checkpoint yet; starting empty", extra={"fields": {"path": str(path)}})
        return None
    problems = integrity_problems(loaded, engine.policy.topology)
    if problems:
        raise StartupError(
            f"the checkpoint {path} is inconsistent: {'; '.join(problems)}. {RECOVERY_HINT}"
        )
    if topology_changed(loaded, engine.policy.topology):
        # A reboot with a CPU back that went offline while cpushim ran (it followed it),
        # another isolcpus, a CPU hotplugged while cpushim was down: re-planned below.
        log.warning(
            "the CPUs changed since the checkpoint was written (offline, online, added,"
            " removed or isolated); re-planning with the CPUs there are now",
            extra={
                "fields": {
                    "path": str(path),
                    "written_for": loaded.topology,
                    "online": str(engine.policy.topology.online),
                    "isolated": str(engine.policy.topology.isolated),
                }
            },
        )
    return loaded


async def _call(engine: Engine, path: str, request: bytes) -> Reply:
    reply = await engine.runtime.unary(UnaryCall(path, (), request, CALL_TIMEOUT))
    if reply.status is not Status.OK or not reply.messages:
        name = path.rsplit("/", 1)[-1]
        raise StartupError(
            f"resync: {name} on {engine.runtime.endpoint} failed:"
            f" {reply.status.name}: {reply.status_message}"
        )
    return reply


async def _sandboxes(
    engine: Engine, progress: StartupProgress
) -> tuple[dict[str, Pod], set[str], set[str]]:
    """The listed pods by sandbox id, the ids of the sandboxes that are not ready, and of those
    whose pod's cgroup parent the runtime could not tell (:func:`sandbox_status`)."""
    reply = await _call(engine, rq.LIST_POD_SANDBOX, b"")
    pods: dict[str, Pod] = {}
    stopped: set[str] = set()
    unplaced: set[str] = set()
    items = pb.ListPodSandboxResponse.FromString(reply.messages[0]).items
    # A few at a time: each hung shim holds its call for SANDBOX_INFO_TIMEOUT, and one after
    # another, many would outlast systemd's start timeout (a restart then starts over).
    turns = asyncio.Semaphore(STATUS_CONCURRENCY)
    progress.begin("resync", len(items), "sandboxes")

    async def read_in_turn(sandbox_id: str) -> SandboxRead:
        async with turns:
            read = await sandbox_status(engine, sandbox_id)
        progress.advance()
        return read

    reads = await asyncio.gather(*(read_in_turn(item.id) for item in items))
    for item, read in zip(items, reads, strict=True):
        if item.state != pb.SANDBOX_READY:
            stopped.add(item.id)
        if read.error:
            # Kept down for one sandbox, cpushim would keep kubelet's runtime down for the
            # whole node. The list names the pod and carries its annotations; its cgroup
            # parent, and so its QoS class, is looked for on its containers, as when only
            # the verbose status fails. Nothing is released for it: its containers are
            # read (and held) as any other's.
            engine.counters["startup_status_errors"] += 1
            log.warning(
                "cannot read a sandbox's status; its pod is taken from the runtime's list",
                extra={"fields": {"sandbox_id": item.id, "error": read.error}},
            )
            unplaced.add(item.id)
            pods[item.id] = Pod.from_config(
                item.id, sandbox_config(item, pb.PodSandboxStatusResponse())
            )
            continue
        if read.status is None:
            continue  # removed since it was listed
        if read.status.status.state != pb.SANDBOX_READY:
            # Stopped since it was listed: a container left created in it never runs.
            stopped.add(item.id)
        if read.brief:
            unplaced.add(item.id)
        pods[item.id] = Pod.from_config(item.id, sandbox_config(item, read.status))
    return pods, stopped, unplaced


@dataclass(frozen=True)
class SandboxRead:
    # None when the sandbox is gone, or when the runtime could not say (``error``).
    status: pb.PodSandboxStatusResponse | None
    error: str = ""
    # Without the runtime's verbose info, which names the pod's cgroup parent.
    brief: bool = False


async def sandbox_status(engine: Engine, sandbox_id: str) -> SandboxRead:
    """The sandbox's status with the runtime's verbose info, else without it. containerd
    asks the sandbox's shim for the task's state when the status is verbose, so one hung
    shim would fail it (after ``SANDBOX_INFO_TIMEOUT``) and, at start-up, keep cpushim and
    with it kubelet's runtime down; the plain status comes from containerd's own store.
    The pod's cgroup parent may then be found on its containers (:func:`placed_pod`)."""
    read = await _sandbox_status(engine, sandbox_id, verbose=True)
    if not read.error:
        return read
    log.warning(
        "cannot read a sandbox's verbose status; asking for the plain one",
        extra={"fields": {"sandbox_id": sandbox_id, "error": read.error}},
    )
    plain = await _sandbox_status(engine, sandbox_id, verbose=False)
    if plain.error:
        return SandboxRead(None, f"{read.error}; without verbose info: {plain.error}")
    return replace(plain, brief=plain.status is not None)


async def _sandbox_status(engine: Engine, sandbox_id: str, *, verbose: bool) -> SandboxRead:
    request = pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=verbose)
    deadline = SANDBOX_INFO_TIMEOUT if verbose else CALL_TIMEOUT
    reply = await engine.runtime.unary(
        UnaryCall(rq.POD_SANDBOX_STATUS, (), request.SerializeToString(), deadline)
    )
    if reply.status is Status.NOT_FOUND:
        return SandboxRead(None)
    if reply.status is not Status.OK or not reply.messages:
        return SandboxRead(None, f"{reply.status.name}: {reply.status_message}")
    try:
        return SandboxRead(pb.PodSandboxStatusResponse.FromString(reply.messages[0]))
    except DecodeError as exc:
        return SandboxRead(None, f"the answer does not decode ({exc})")


def _placed_or_told(pod: Pod, live: Iterable[LiveContainer], unread: Iterable[pb.Container]) -> Pod:
    """``pod``, whose sandbox's status did not name its cgroup parent, placed from the
    containers start-up read (:func:`placed_pod`). When none of them shows it, and the pod
    has containers, that is told here, once: its containers share. Those whose status
    start-up could not read (``unread``) are named then, since the sweep that reads one
    may yet find the pod's cgroup on it and place the pod (``a pod's cgroup parent is found
    on its container``); the sweeps do not tell again that it is unknown."""
    containers = [c for c in live if c.sandbox_id == pod.sandbox_id]
    unread_here = sorted(c.id for c in unread if c.pod_sandbox_id == pod.sandbox_id)
    placed = placed_pod(pod, containers)
    if placed.qos is not None or not (containers or unread_here):
        return placed
    message = "a pod's cgroup parent is unknown; its containers share"
    fields: dict[str, object] = {"pod": pod.label, "sandbox_id": pod.sandbox_id}
    if unread_here:
        message += " unless a sweep finds it on one start-up could not read"
        fields["unread"] = unread_here
    log.warning(message, extra={"fields": fields})
    return placed


def placed_pod(pod: Pod, containers: Iterable[LiveContainer]) -> Pod:
    """``pod``, whose sandbox's status did not name its cgroup parent, with the parent its
    containers' cgroups are under (containerd names a container's cgroup after its pod's),
    and so its QoS class; as it was when none of them shows this pod's. Without one the
    pod cannot be classified, and its containers share."""
    for container in containers:
        try:
            path = cgroups_path_of(container.info or "{}")
        except ValueError:
            continue
        parent = cgroups.cgroup_parent_of(path)
        try:
            found = pod_cgroup(parent)
        except CgroupParentError:
            continue
        if found.pod_uid == pod.uid:
            return replace(pod, cgroup_parent=parent, qos=found.qos)
    return pod


def sandbox_config(item: pb.PodSandbox, status: pb.PodSandboxStatusResponse) -> pb.PodSandboxConfig:
    """The sandbox's config as kubelet sent it. The cgroup parent (the QoS class) is only in the
    runtime's verbose info (containerd: ``info`` JSON, ``config.linux.cgroup_parent``); without
    it the pod cannot be classified and its containers share."""
    config = pb.PodSandboxConfig(metadata=item.metadata)
    config.annotations.update(status.status.annotations or item.annotations)
    try:
        info = orjson.loads(status.info.get("info", "{}"))
        linux = info.get("config", {}).get("linux", {})
        parent = linux.get("cgroup_parent", "")
        resources = linux.get("resources") or {}
        shares = _json_int(resources.get("cpu_shares"))
        memory = _json_int(resources.get("memory_limit_in_bytes"))
    except (orjson.JSONDecodeError, AttributeError):
        parent, shares, memory = "", 0, 0
    if isinstance(parent, str):
        config.linux.cgroup_parent = parent
    # The pod's totals (or its pod-level resources), which tell pod-level resources apart.
    if shares > 0 and memory > 0:
        config.linux.resources.cpu_shares = shares
        config.linux.resources.memory_limit_in_bytes = memory
    return config


def _json_int(value: object, *, signed: bool = False) -> int:
    """An integer of a runtime's JSON: a number (Go's encoding/json, containerd's) or a
    string of digits (protobuf's JSON mapping of 64-bit integers); 0 otherwise, and for a
    negative one unless ``signed``."""
    if isinstance(value, str) and value.removeprefix("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return value if signed or value >= 0 else 0


async def _containers(
    engine: Engine, pods: Mapping[str, Pod], stopped: set[str], progress: StartupProgress
) -> tuple[dict[str, LiveContainer], list[tuple[str, str]], list[pb.Container]]:
    """Containers that are not exited (exited ones hold no CPUs), the (sandbox id, name)
    of the exited ones, and the listed containers whose status the runtime could not give
    (they may run). A container created in a sandbox that is stopped since counts as
    exited: the runtime starts none there (and the sandbox's stop left it created), so it
    never runs. So does one created beside a later attempt of it (kubelet went on to the
    next attempt when the create's answer was lost): kubelet never starts an earlier one."""
    reply = await _call(engine, rq.LIST_CONTAINERS, b"")
    live: dict[str, LiveContainer] = {}
    exited: list[tuple[str, str]] = []
    unread: list[pb.Container] = []
    items = pb.ListContainersResponse.FromString(reply.messages[0]).containers
    superseded = superseded_attempts(items)
    asked: list[pb.Container] = []
    for item in items:
        never_runs = item.state == pb.CONTAINER_CREATED and (
            item.pod_sandbox_id in stopped or item.id in superseded
        )
        if item.state == pb.CONTAINER_EXITED or never_runs:
            exited.append((item.pod_sandbox_id, item.metadata.name))
        else:
            asked.append(item)
    progress.begin("resync", len(asked), "containers")
    for item in asked:
        request = pb.ContainerStatusRequest(container_id=item.id, verbose=True).SerializeToString()
        status_reply = await engine.runtime.unary(
            UnaryCall(rq.CONTAINER_STATUS, (), request, CALL_TIMEOUT)
        )
        progress.advance()
        if status_reply.status is Status.NOT_FOUND:
            continue
        response, error = container_status(status_reply)
        if response is None:
            # Without its resources and cgroup nothing can be decided for it; stopping
            # start-up for it would keep kubelet's runtime down for the whole node.
            engine.counters["startup_status_errors"] += 1
            pod = pods.get(item.pod_sandbox_id)
            log.warning(
                "cannot read a container's status; it stays as it is until a sweep reads it",
                extra={
                    "fields": {
                        **_named_in(pod, item.pod_sandbox_id, item.metadata.name, item.id),
                        "sandbox_id": item.pod_sandbox_id,
                        "error": error,
                    }
                },
            )
            # The sweeps that read it again (and their retries) do not tell it again.
            engine.unread_untracked.add(item.id)
            unread.append(item)
            continue
        if response.status.state == pb.CONTAINER_EXITED:
            # Exited since it was listed: taken as listed, it would hold or even be given
            # CPUs, tracked as created, until a full look found it out.
            exited.append((item.pod_sandbox_id, item.metadata.name))
            continue
        live[item.id] = live_container(item.id, item.pod_sandbox_id, item.metadata, response)
    return live, exited, unread


def superseded_attempts(items: Iterable[pb.Container]) -> set[str]:
    """The ids of the containers left created beside a later attempt of themselves (kubelet
    went on to the next attempt when a create's answer was lost): kubelet never starts an
    earlier attempt, so they never run."""
    items = list(items)
    latest: dict[tuple[str, str], int] = {}
    for item in items:
        name = (item.pod_sandbox_id, item.metadata.name)
        latest[name] = max(latest.get(name, 0), item.metadata.attempt)
    return {
        item.id
        for item in items
        if item.state == pb.CONTAINER_CREATED
        and item.metadata.attempt < latest[(item.pod_sandbox_id, item.metadata.name)]
    }


def live_container(
    container_id: str,
    sandbox_id: str,
    metadata: pb.ContainerMetadata,
    response: pb.ContainerStatusResponse,
) -> LiveContainer:
    info = response.info.get("info", "")
    return LiveContainer(
        id=container_id,
        sandbox_id=sandbox_id,
        name=metadata.name,
        attempt=metadata.attempt,
        state=response.status.state,
        resources=(
            response.status.resources.linux
            if response.status.resources.HasField("linux")
            else spec_resources(info)
        ),
        info=info,
    )


def spec_resources(info: str) -> pb.LinuxContainerResources:
    """A container's resources as its OCI spec in the runtime's verbose info holds them:
    containerd fills ContainerStatus' resources from 1.6.9 on, so a container created by
    an older one (and running on through the upgrade) shows none there, and would be taken
    as asking for no CPU. Empty when the info has none."""
    resources = pb.LinuxContainerResources()
    try:
        spec = orjson.loads(info or "{}").get("runtimeSpec", {})
        linux = spec.get("linux", {}).get("resources") or {}
        cpu = linux.get("cpu") or {}
        memory = linux.get("memory") or {}
        resources.cpu_shares = _json_int(cpu.get("shares"))
        resources.cpu_quota = _json_int(cpu.get("quota"), signed=True)
        resources.cpu_period = _json_int(cpu.get("period"))
        resources.memory_limit_in_bytes = _json_int(memory.get("limit"), signed=True)
        cpus, mems = cpu.get("cpus", ""), cpu.get("mems", "")
    except (orjson.JSONDecodeError, AttributeError, ValueError):
        return pb.LinuxContainerResources()
    if isinstance(cpus, str):
        resources.cpuset_cpus = cpus
    if isinstance(mems, str):
        resources.cpuset_mems = mems
    return resources


def running_first(containers: Iterable[LiveContainer]) -> list[LiveContainer]:
    """Of two attempts of one container (one left created beside its next), the running one,
    else the later one, first: the one that gets the CPUs."""
    return sorted(containers, key=lambda c: (c.state != pb.CONTAINER_RUNNING, -c.attempt, c.id))


def _plan(pod: Pod | None, container: LiveContainer) -> ContainerPlan:
    if pod is None:
        return ContainerPlan(exclusive=None)
    try:
        return plan_container(pod, container.name, container.resources)
    except AnnotationError as exc:
        log.warning("pod annotation ignored at resync", extra={"fields": {"error": str(exc)}})
        return ContainerPlan(exclusive=None)


def _with_pod_level_resources(
    pods: dict[str, Pod], live: Mapping[str, LiveContainer], marked_before: Collection[str]
) -> dict[str, Pod]:
    """``pods``, with those marked as having pod-level resources: the checkpoint's marks
    (made while cpushim ran), and, for a checkpoint without them (recovered from the
    runtime), pods of two or more running containers asking for exclusive CPUs, every one
    of them for all of the pod's. Stricter than a create's test: the runtime's record of a
    pod's totals is from its start, and a container resized in place since may match it
    (one created and never started may be an attempt left behind). None of their
    containers is pinned."""
    eligible: dict[str, dict[str, bool]] = {}
    for container in running_first(live.values()):
        pod = pods.get(container.sandbox_id)
        if container.state != pb.CONTAINER_RUNNING or pod is None:
            continue
        if _plan(pod, container).exclusive is not None:
            names = eligible.setdefault(container.sandbox_id, {})
            names.setdefault(container.name, takes_whole_pod(pod, container.resources))
    marked = dict(pods)
    for sandbox_id, pod in pods.items():
        flags = list(eligible.get(sandbox_id, {}).values())
        if pod.uid in marked_before or (len(flags) >= 2 and all(flags)):
            marked[sandbox_id] = replace(pod, pod_level_resources=True)
    return marked


def _whole_only_where_every_one_is(containers: Iterable[Tracked]) -> None:
    """A container found taking its whole pod, in the runtime's record, shows pod-level
    resources only while every sibling with resources of its own does too: one resized in
    place onto the pod's old totals looks the same, and :func:`_with_pod_level_resources`
    left such a pod ordinary. Elsewhere the flags are cleared, so that a sweep or a
    sibling's create does not mark the pod on them a moment later (a mark is for good); a
    create asking for the whole pod tells it anew."""
    sized: dict[str, list[Tracked]] = {}
    for tracked in containers:
        if tracked.own_resources and tracked.phase is not Phase.EXITED:
            sized.setdefault(tracked.key.pod_uid, []).append(tracked)
    for siblings in sized.values():
        if not all(tracked.whole_pod for tracked in siblings):
            for tracked in siblings:
                tracked.whole_pod = False


def _reconcile(
    engine: Engine,
    loaded: CPUState | None,
    pods: dict[str, Pod],
    live: dict[str, LiveContainer],
    unread: Collection[pb.Container],
    report: ResyncReport,
) -> CPUState:
    """``unread``: listed containers whose status the runtime could not give. Any CPUs one
    of them holds stay held under the assignment as it is (it may run on them), a re-plan
    included while the new policy may hand them out, and none is adopted: a sweep takes
    them in once the runtime answers."""
    policy = engine.policy
    state = loaded if loaded is not None else CPUState.empty(policy)
    previous = dict(state.assignments)
    displaced: list[ContainerKey] = []
    if topology_changed(state, policy.topology) or (
        state.policy,
        state.options,
        state.reserved,
    ) != (policy.name, policy.option_names, policy.reserved):
        was = f"{state.policy} options={sorted(state.options)} reserved={state.reserved}"
        # A set is kept only if it would be handed out now, as a live re-plan keeps it: not
        # one isolated since, nor lone threads under full-pcpus-only (turned on since, or a
        # sibling back online). An unread container's is kept as it is, first: nothing can
        # move it off CPUs handed to another until a sweep reads it.
        unread_holders = {
            key
            for key, assignment in state.assignments.items()
            if _held_unread(key, assignment, pods, unread, _holder(key, assignment, pods, live))
        }
        state, displaced = replan(
            state, policy, _requests_now(pods, live), unmovable=unread_holders
        )
        tell_untracked_displaced(
            {key: previous[key].cpus for key in displaced if key in unread_holders}, policy
        )
        log.info(
            "policy or CPUs changed since the checkpoint; re-planned",
            extra={
                "fields": {
                    "was": was,
                    "now": f"{policy.name} options={sorted(policy.option_names)}"
                    f" reserved={policy.reserved}",
                    "displaced": [str(k) for k in displaced],
                }
            },
        )

    def key_of(container: LiveContainer) -> ContainerKey | None:
        pod = pods.get(container.sandbox_id)
        return None if pod is None else ContainerKey(pod.uid, container.name)

    # Assignments whose container is gone (or whose create never finished) go back.
    holders: dict[ContainerKey, LiveContainer] = {}
    gone: list[ContainerKey] = []
    for key, assignment in state.assignments.items():
        container = _holder(key, assignment, pods, live)
        if _held_unread(key, assignment, pods, unread, container):
            continue
        pod = pods.get(container.sandbox_id) if container is not None else None
        if container is None or (pod is not None and pod.pod_level_resources):
            # A pod with pod-level resources holds none (cpushim stopped before the create
            # that showed them had them given back).
            gone.append(key)
        else:
            holders[key] = container
    report.released.extend(str(key) for key in gone)
    # Of pods removed while cpushim was down, nothing comes back.
    state = state.release(gone, policy).keep_released(engine._pod_uids())
    for key, container in holders.items():
        if state.assignments[key].container_id != container.id:
            state = state.update(key, container_id=container.id, sandbox_id=container.sandbox_id)

    # Containers that lost their CPUs to a policy change, then unknown ones, get CPUs again.
    holding_ids = {a.container_id for a in state.assignments.values()}
    # Each with the memory nodes kubelet chose for it, as far as cpushim knows them.
    candidates: list[tuple[LiveContainer, int, ContainerPlan, CPUSet | None]] = []
    replanned_ids: set[str] = set()
    for key in displaced:
        old = previous[key]
        container = live.get(old.container_id)
        if container is not None:
            replanned_ids.add(container.id)
            report.replanned.append(str(key))
            if policy.name == "none":
                continue  # shares, as every container does under none: no refusal to count
            pod = pods.get(container.sandbox_id)
            if pod is not None and pod.pod_level_resources:
                continue  # its pod's mark came after this assignment: it shares
            plan = _plan(pod, container)
            candidates.append((container, len(old.cpus), plan, old.mems))
    # Of two containers of one pod and name (one left created beside its next attempt), the
    # running one, else the later attempt, is the one that gets the CPUs.
    for container in running_first(live.values()):
        if container.id in holding_ids or container.id in replanned_ids:
            continue
        plan = _plan(pods.get(container.sandbox_id), container)
        if plan.exclusive is None or policy.name == "none":
            report.adopted_shared.append(container.id)
            continue
        candidates.append(
            (
                container,
                plan.exclusive,
                plan,
                _kubelet_mems(engine, container, pinned=_may_be_pinned(engine, container, plan)),
            )
        )
    # The sets cpushim is seen to have handed out are kept first: under strict-cpu-reservation
    # a container that shares a pool of as many CPUs as it asks for runs on a set that looks
    # free, and keeping that ahead of them would leave a pinned container no pool CPU to
    # spare. The attempts of one pod and name keep their order above.
    pinned: dict[ContainerKey | None, bool] = {}
    for container, _, plan, _ in candidates:
        pinned.setdefault(
            key_of(container),
            container.id in replanned_ids or _shows_pinned(engine, container, plan),
        )
    candidates.sort(key=lambda candidate: not pinned[key_of(candidate[0])])

    # Two rounds: first every container that may keep the CPUs it runs on, then new choices
    # for the others, so that a new choice never takes a set a running container could keep.
    for keep_only in (True, False):
        pending: list[tuple[LiveContainer, int, ContainerPlan, CPUSet | None]] = []
        waiting: set[ContainerKey] = set()
        for container, count, plan, memory_nodes in candidates:
            pod = pods.get(container.sandbox_id)
            adopted_key = key_of(container)
            if adopted_key is None or pod is None or adopted_key in state.assignments:
                report.adopted_shared.append(container.id)
                continue
            if keep_only:
                # One that comes first for this key and waits for a new choice goes first
                # then too: another attempt keeping its set now would take the key from it.
                cpus = None
                if adopted_key not in waiting:
                    cpus = _kept_cpus(engine, state, container, count, plan, memory_nodes)
                if cpus is None:
                    pending.append((container, count, plan, memory_nodes))
                    waiting.add(adopted_key)
                    continue
            else:
                cpus = _adopted_cpus(
                    engine,
                    state,
                    container,
                    count,
                    plan,
                    memory_nodes,
                    released=state.released.get(adopted_key),
                )
            if cpus is None:
                report.refused.append(str(adopted_key))
                continue
            assignment = Assignment(
                cpus, container.id, container.sandbox_id, container.attempt, pod.label, memory_nodes
            )
            state = state.assign(adopted_key, assignment, policy)
            report.adopted_exclusive.append(str(adopted_key))
        candidates = pending
    return state.under(policy)


def _holder(
    key: ContainerKey,
    assignment: Assignment,
    pods: Mapping[str, Pod],
    live: Mapping[str, LiveContainer],
) -> LiveContainer | None:
    """The running container an assignment is for: the one it names, or, when it names
    none (cpushim stopped while the create was on its way: the runtime may have made it),
    the latest attempt of its pod and name."""
    if assignment.container_id:
        return live.get(assignment.container_id)
    matches = [
        c
        for c in live.values()
        if (pod := pods.get(c.sandbox_id)) is not None and ContainerKey(pod.uid, c.name) == key
    ]
    return max(matches, key=lambda c: c.attempt, default=None)


def _held_unread(
    key: ContainerKey,
    assignment: Assignment,
    pods: Mapping[str, Pod],
    unread: Collection[pb.Container],
    holder: LiveContainer | None,
) -> bool:
    """Whether the container an assignment is for may be one whose status could not be
    read: the one it names, or, when it names none, a later attempt of its pod and name
    than ``holder`` (the running one :func:`_holder` found, if any)."""
    if assignment.container_id:
        return any(c.id == assignment.container_id for c in unread)
    return any(
        (pod := pods.get(c.pod_sandbox_id)) is not None
        and ContainerKey(pod.uid, c.metadata.name) == key
        and (holder is None or c.metadata.attempt > holder.attempt)
        for c in unread
    )


def _requests_now(
    pods: Mapping[str, Pod], live: Mapping[str, LiveContainer]
) -> Callable[[ContainerKey, Assignment], ExclusiveRequest | None]:
    """What the running container an assignment is for asks the policy for, for
    :func:`replan`; None when it is not running (the release that follows sees to it)."""

    def request_of(key: ContainerKey, assignment: Assignment) -> ExclusiveRequest | None:
        container = _holder(key, assignment, pods, live)
        if container is None:
            return None
        plan = _plan(pods.get(container.sandbox_id), container)
        return exclusive_request(len(assignment.cpus), plan.isolated, assignment.mems)

    return request_of


def _shows_pinned(engine: Engine, container: LiveContainer, plan: ContainerPlan) -> bool:
    """Whether the runtime's record shows the settings cpushim gives an exclusive container."""
    resources = container.resources
    quota = kubelet_cfs_quota(resources.cpu_shares, resources.cpu_quota, resources.cpu_period)
    return _carries_exclusive_settings(engine, resources, plan, quota)


def _current_cpus(container: LiveContainer) -> CPUSet:
    try:
        return CPUSet.parse(container.resources.cpuset_cpus)
    except ValueError:
        return CPUSet()


def _recorded_mems(container: LiveContainer) -> CPUSet | None:
    """The memory nodes in the runtime's record; None when it names none it can read."""
    try:
        return CPUSet.parse(container.resources.cpuset_mems) or None
    except ValueError:
        return None


def _kubelet_mems(engine: Engine, container: LiveContainer, *, pinned: bool) -> CPUSet | None:
    """The memory nodes kubelet's memory manager chose for a container cpushim does not know,
    as far as the runtime's record tells. Those of a container that may be pinned
    (``pinned``: see :func:`_may_be_pinned`) that are its CPUs' nodes with memory may be
    cpushim's own (None). Any other's are kubelet's: nodes beyond its CPUs', its CPUs' nodes
    for a container that shares (its memory may span the nodes of the pool), or a restore's
    every node, which narrows nothing. None when the record names none."""
    mems = _recorded_mems(container)
    if pinned and mems == engine.policy.topology.memory_nodes_of(_current_cpus(container)):
        return None
    return mems


def _may_be_pinned(engine: Engine, container: LiveContainer, plan: ContainerPlan) -> bool:
    """Whether a container that asks for exclusive CPUs may run pinned: it shows the settings
    cpushim gives an exclusive one, or holds as many CPUs as it asks for. One on more CPUs
    than that shares a pool, and cpushim gave it no memory nodes of its own."""
    return _shows_pinned(engine, container, plan) or len(_current_cpus(container)) == plan.exclusive


def _kept_cpus(
    engine: Engine,
    state: CPUState,
    container: LiveContainer,
    count: int,
    plan: ContainerPlan,
    memory_nodes: CPUSet | None,
) -> CPUSet | None:
    """The container's current cpuset when the policy would hand it out now, else None."""
    current, _, refusal = _current_refusal(engine, state, container, count, plan, memory_nodes)
    return current if refusal is None else None


def _current_refusal(
    engine: Engine,
    state: CPUState,
    container: LiveContainer,
    count: int,
    plan: ContainerPlan,
    memory_nodes: CPUSet | None,
) -> tuple[CPUSet, ExclusiveRequest, str | None]:
    """The container's current cpuset, what it asks the policy for, and why the policy
    would not hand it that set now."""
    request = exclusive_request(count, plan.isolated, memory_nodes)
    current = _current_cpus(container)
    return current, request, engine.policy.refusal(state.exclusive(), request, current)


def _key_in(pod: Pod | None, sandbox_id: str, name: str) -> ContainerKey:
    """A container's key: its pod's UID and its name, the sandbox id standing in for the UID
    of a pod cpushim does not know."""
    return ContainerKey(pod.uid if pod is not None else sandbox_id, name)


def _named_in(pod: Pod | None, sandbox_id: str, name: str, container_id: str) -> dict[str, str]:
    """The fields a log line names a container the runtime reported by, as
    :meth:`Tracked.named` does a tracked one."""
    return {
        "pod": pod.label if pod is not None else "",
        "container": str(_key_in(pod, sandbox_id, name)),
        "container_id": container_id,
    }


def _live_named(engine: Engine, container: LiveContainer) -> dict[str, str]:
    pod = engine.pods.get(container.sandbox_id)
    return _named_in(pod, container.sandbox_id, container.name, container.id)


def _adopted_cpus(
    engine: Engine,
    state: CPUState,
    container: LiveContainer,
    count: int,
    plan: ContainerPlan,
    memory_nodes: CPUSet | None,
    *,
    released: CPUSet | None = None,
    quiet: bool = False,
) -> CPUSet | None:
    """The container's current cpuset when it is a valid free choice, else ``released``
    (the CPUs its key held last) when the policy would hand them out now, as a create's
    next attempt gets them back, else a new allocation (from ``memory_nodes`` as far as it
    can); None (the container shares) when the policy cannot satisfy it, logged and counted
    unless ``quiet``."""
    current, request, refusal = _current_refusal(
        engine, state, container, count, plan, memory_nodes
    )
    if refusal is None:
        return current
    if current and not quiet:
        log.info(
            "a running container's cpuset is not kept",
            extra={"fields": {**_live_named(engine, container), "reason": refusal}},
        )
    exclusive = state.exclusive()
    if released is not None and engine.policy.refusal(exclusive, request, released) is None:
        return released
    try:
        return engine.policy.allocate(exclusive, request)
    except AllocationError as exc:
        if quiet:
            return None
        engine.counters["adoptions_refused"] += 1
        log.error(
            "a running container cannot get its exclusive CPUs; it shares",
            extra={"fields": {**_live_named(engine, container), "count": count, "error": str(exc)}},
        )
        return None


async def replan_live(
    engine: Engine, policy: CPUPolicy, reason: str
) -> tuple[list[ContainerKey], list[ContainerKey]]:
    """Run under ``policy`` from now on (:meth:`Engine.change_policy`), then, as a restart
    would, the containers that share and ask for exclusive CPUs get them where it has room
    (:func:`adopt_sharing`). Returns the keys that lost their exclusive CPUs and those
    adopted. OSError when the checkpoint cannot be written, and nothing changes then. The
    new policy is in force whatever the adoption meets: a failure of it is logged and
    counted, and the sweeps try again. ``reason``: what asked for the re-plan, for the log."""
    lost = await engine.change_policy(policy)
    try:
        adopted = await adopt_sharing(engine, skip=lost)
    except Exception:
        engine.counters["internal_errors"] += 1
        log.exception(
            "adopting containers after a re-plan failed", extra={"fields": {"reason": reason}}
        )
        adopted = []
    return lost, adopted


async def adopt_sharing(engine: Engine, skip: Collection[ContainerKey] = ()) -> list[ContainerKey]:
    """After a live re-plan (a config reload): the containers that ask for exclusive CPUs
    and share (created under ``none``, or displaced by an earlier re-plan with no room)
    get them as start-up adopts a running container, so that a reload and a restart under
    the same config end alike. ``skip``: keys the re-plan just failed to place. Returns the
    keys adopted; a container whose state the runtime does not give now stays as it is,
    and so does everything when the checkpoint cannot be written."""
    async with engine.lock:
        await engine.mark_pods_with_pod_level_resources()
        waiting = waiting_for_exclusive(engine, skip)
        if not waiting:
            return []
        statuses = [await live_status(engine, t.id, t.sandbox_id) for t in waiting]
        live = [c for c in statuses if c is not None]
        state = engine.state
        adopted: list[tuple[Tracked, LiveContainer, ContainerPlan, CPUSet | None]] = []
        for container in running_first(live):
            tracked = engine.containers.get(container.id)
            pod = engine.pods.get(container.sandbox_id)
            # Removed while the runtime was asked (a removal is not a decision: no lock).
            if tracked is None or tracked.phase is Phase.EXITED or pod is None:
                continue
            plan = _plan(pod, container)
            if plan.exclusive is None or tracked.key in state.assignments:
                continue
            # Kubelet's own choice when cpushim kept it (from the assignment the container
            # lost, or the create), whatever its cgroup holds of it now; the runtime's record
            # can only tell nodes apart from the shared pool's.
            mems = tracked.memory_nodes_chosen
            if mems is None:
                mems = _kubelet_mems(
                    engine, container, pinned=_may_be_pinned(engine, container, plan)
                )
            # A refusal is told once per container: this runs at every full look, and
            # after a release while one waits.
            cpus = _adopted_cpus(
                engine,
                state,
                container,
                plan.exclusive,
                plan,
                mems,
                released=state.released.get(tracked.key),
                quiet=tracked.adoption_refused,
            )
            if cpus is None:
                tracked.adoption_refused = True
                engine.wait_for_room()
                continue
            assignment = Assignment(
                cpus, container.id, container.sandbox_id, container.attempt, pod.label, mems
            )
            state = state.assign(tracked.key, assignment, engine.policy)
            adopted.append((tracked, container, plan, mems))
        if not adopted:
            return []
        try:
            await engine._commit(state)
        except OSError as exc:
            engine.counters["checkpoint_errors"] += 1
            log.error(
                "could not write the checkpoint; the sharing containers stay as they are",
                extra={"fields": {"path": str(engine.checkpoint.path), "error": str(exc)}},
            )
            return []
        for tracked, container, plan, mems in adopted:
            resources = container.resources
            tracked.adoption_refused = False
            tracked.exclusive = True
            tracked.keep_quota = plan.keep_quota
            # The count the runtime's record asks for now: one a resize asked while it waited
            # (noted, not applied). A later resize back to its first count is one.
            tracked.cpus_asked = plan.exclusive
            tracked.resize_noted = None
            tracked.kubelet_quota = kubelet_cfs_quota(
                resources.cpu_shares, resources.cpu_quota, resources.cpu_period
            )
            tracked.kubelet_mems = mems
        # Exited or removed while the checkpoint was written (neither waits for the lock):
        # nothing would give the CPUs back after this.
        ended = [
            tracked.key
            for tracked, _, _, _ in adopted
            if tracked.phase is Phase.EXITED or tracked.id not in engine.containers
        ]
        if ended:
            await engine._release(ended)
        await engine._apply()
    # A container removed while it was moved (the runtime said NOT_FOUND) gave its CPUs back.
    keys = [
        tracked.key
        for tracked, _, _, _ in adopted
        if tracked.key not in ended and tracked.key in engine.state.assignments
    ]
    log.info(
        "gave containers that shared the exclusive CPUs they ask for",
        extra={
            "fields": {
                "adopted_exclusive": {
                    str(key): str(engine.state.assignments[key].cpus) for key in keys
                },
                "shared": str(engine.state.shared),
            }
        },
    )
    return keys


def waiting_for_exclusive(engine: Engine, skip: Collection[ContainerKey] = ()) -> list[Tracked]:
    """The live containers that ask for exclusive CPUs and share, under a policy that hands
    them out: those :func:`adopt_sharing` looks at."""
    if engine.policy.name == "none":
        return []
    return [
        tracked
        for tracked in engine.containers.values()
        if tracked.phase is not Phase.EXITED
        and tracked.cpus_asked is not None
        and tracked.sandbox_id in engine.pods
        and tracked.key not in engine.state.assignments
        and tracked.key not in skip
    ]


async def live_status(engine: Engine, container_id: str, sandbox_id: str) -> LiveContainer | None:
    """The runtime's word on one container now; None when it is gone or exited, or its state
    cannot be read (warned)."""
    return (await status_read(engine, container_id, sandbox_id)).live


@dataclass(frozen=True)
class StatusRead:
    # The container, when the runtime has it and it has not exited.
    live: LiveContainer | None
    # False when the runtime did not say (a failed call, an answer that does not decode):
    # the container may be live all the same.
    answered: bool = True


async def status_read(
    engine: Engine, container_id: str, sandbox_id: str, name: str = ""
) -> StatusRead:
    """:func:`live_status`, telling a container that is gone or exited from one whose state
    cannot be read. ``name``: the container's, when the runtime's listing gave it (for the
    log)."""
    request = pb.ContainerStatusRequest(container_id=container_id, verbose=True)
    reply = await engine.runtime.unary(
        UnaryCall(rq.CONTAINER_STATUS, (), request.SerializeToString(), CALL_TIMEOUT)
    )
    if reply.status is Status.NOT_FOUND:
        engine.unread_untracked.discard(container_id)
        return StatusRead(None)
    response, error = container_status(reply)
    tracked = engine.containers.get(container_id)
    if response is None:
        if tracked is not None and reply.status is Status.OK:
            # An adoption asks at every sweep, and the watcher while it is not located:
            # an answer that does not decode is told once for the container, by either.
            engine.mover.undecodable_status(tracked, error)
        elif _newly_unread(engine, container_id, tracked):
            pod = engine.pods.get(sandbox_id)
            fields = {"pod": pod.label if pod is not None else "", "container_id": container_id}
            if name:
                fields.update(_named_in(pod, sandbox_id, name, container_id))
            if tracked is not None:
                fields.update(tracked.named())
            fields["error"] = error
            log.warning(
                "cannot read a container's state; it stays as it is", extra={"fields": fields}
            )
        return StatusRead(None, answered=False)
    engine.unread_untracked.discard(container_id)
    if tracked is not None:
        tracked.status_answered()
    if response.status.state == pb.CONTAINER_EXITED:
        return StatusRead(None)
    return StatusRead(live_container(container_id, sandbox_id, response.status.metadata, response))


def _newly_unread(engine: Engine, container_id: str, tracked: Tracked | None) -> bool:
    """Whether a container whose state the runtime could not give (``tracked``: a failed
    call; one cpushim does not track: an answer that does not decode too) is to be told of,
    noting it as told, once while it stays so: an adoption asks again at every sweep about
    one that waits for exclusive CPUs, a sweep asks again at every try about one it does not
    track while the runtime cannot say, and start-up has told of those it could not read.
    A good read of a tracked one, by any call (:meth:`Tracked.status_answered`), ends the
    spell."""
    if tracked is not None:
        told = tracked.failed_status_seen
        tracked.failed_status_seen = True
        return not told
    if container_id in engine.unread_untracked:
        return False
    engine.unread_untracked.add(container_id)
    return True


def tracked_from_runtime(
    engine: Engine,
    container: LiveContainer,
    pods: dict[str, Pod],
    remembered: Mapping[ContainerKey, Assignment],
) -> Tracked:
    """``remembered``: the checkpoint's assignments, which say what kubelet's memory manager
    chose for containers that lose their CPUs in this resync (a new policy)."""
    pod = pods.get(container.sandbox_id)
    # A container that holds CPUs is known by its assignment's key even when its sandbox is
    # no longer listed (removed behind it): else it would share while its CPUs stay held.
    key = engine.state.holding(container.id) or _key_in(pod, container.sandbox_id, container.name)
    assignment = engine.state.assignments.get(key)
    known = assignment or remembered.get(key)
    resources = container.resources
    plan = _plan(pod, container)
    kubelet_quota = kubelet_cfs_quota(
        resources.cpu_shares, resources.cpu_quota, resources.cpu_period
    )
    holds = assignment is not None and assignment.container_id == container.id
    exclusive = holds or _carries_exclusive_settings(engine, resources, plan, kubelet_quota)
    keep_quota = plan.keep_quota
    if holds and pod is None:
        # Its sandbox is no longer listed, so its annotations are not at hand: the quota
        # cpushim gave it says whether they keep it (one that drops it has -1).
        keep_quota = resources.cpu_quota != rq.NO_QUOTA
    # cpushim gave it memory nodes of its own through the runtime (or was about to): its
    # record holds those, and the checkpoint kubelet's.
    given = engine.state.kubelet_mems.get(key)
    if given is not None and given.container_id != container.id:
        given = None
    kubelet_mems = known.mems if known is not None else None
    if known is None and exclusive:
        # Unpinned as cpushim stopped, its settings not given back yet: kubelet's nodes are
        # in the checkpoint. Or pinned while cpushim knew nothing of it
        # (--recover-from-runtime) and sharing now: the runtime's record is all that tells
        # what kubelet's memory manager chose.
        kubelet_mems = (
            given.mems if given is not None else _kubelet_mems(engine, container, pinned=True)
        )
    topology = engine.policy.topology
    shared_mems = None
    mems_given = not exclusive and given is not None
    if given is not None and not exclusive:
        shared_mems = given.mems
    elif not exclusive:
        # Its cgroup keeps the nodes it was created with: kubelet's memory manager's, every
        # node when its memory spans them all, which an in-place resize that pins it keeps
        # as a create's would. (Nodes cpushim put in the record, when it lost exclusive
        # CPUs or memory changed, have their entry in the checkpoint: above.)
        shared_mems = _recorded_mems(container)
    recorded = _current_cpus(container) or None
    running = container.state == pb.CONTAINER_RUNNING
    place = engine.mover.cgroup_of(container.info) if running else CgroupPlace(None)
    cgroup = place.directory
    applied = recorded
    if cgroup is not None:
        try:
            # The kernel's word over the runtime's record: a cgroup written directly may not
            # have been told to the runtime before cpushim stopped.
            applied = cgroups.read_cpus(cgroup)
        except (OSError, ValueError):
            cgroup = None
        if applied is None and cgroup is not None:
            layout = engine.mover.layout
            if layout is None or layout.version is not CgroupVersion.V2 or not cgroup.is_dir():
                cgroup = None
            # Else a v2 cgroup whose parent does not enable the cpuset controller: kept, so
            # its watch tells its exit (and warns of it) as for one met while cpushim ran.
            applied = recorded
    settings_stale = False
    if holds:
        assert assignment is not None
        # Kept on the CPUs it runs on, it is not moved: its mems and quota must be looked at.
        wanted = CPUSet.parse(engine._mems_of(assignment))
        quota_kept = keep_quota or resources.cpu_quota == rq.NO_QUOTA
        settings_stale = _recorded_mems(container) != wanted or not quota_kept
    elif mems_given:
        # Every node with memory, or kubelet's that have memory, as they were when cpushim
        # gave them: the memory may have changed while it was down.
        wanted = topology.memory_nodes
        if shared_mems is not None:
            wanted = topology.memory_nodes_within(shared_mems)
        settings_stale = _recorded_mems(container) != wanted
    elif shared_mems is not None:
        # kubelet's nodes, one of which lost its memory (memory hotplug) while cpushim was
        # down: the runtime's record would have the kernel refuse every update through it.
        settings_stale = not shared_mems.issubset(topology.memory_nodes)
    tracked = Tracked(
        settings_stale=settings_stale,
        id=container.id,
        key=key,
        sandbox_id=container.sandbox_id,
        pod=pod.label if pod is not None else "",
        exclusive=exclusive,
        keep_quota=keep_quota,
        kubelet_quota=kubelet_quota,
        kubelet_mems=kubelet_mems,
        shared_mems=shared_mems,
        phase=Phase.RUNNING if running else Phase.CREATED,
        applied=applied,
        cgroup=cgroup,
        cgroup_parent=pod.cgroup_parent if pod is not None else "",
        recorded=recorded,
        pid=pid_of(container.info) if cgroup is not None else 0,
        attempt=container.attempt,
        cpus_asked=plan.exclusive,
        whole_pod=pod is not None and takes_whole_pod(pod, resources),
        own_resources=has_own_resources(resources),
    )
    engine.mover.unplaced_cgroup(tracked, place)
    # Told now for each container whose chosen memory nodes include one without memory, so
    # that start-up's log names every one of them; the mark keeps a later move from telling
    # it again (a shared container's nodes are looked at again only when they change).
    engine._note_narrowing(tracked, engine._kubelets_mems(tracked))
    return tracked


def _carries_exclusive_settings(
    engine: Engine, resources: pb.LinuxContainerResources, plan: ContainerPlan, kubelet_quota: int
) -> bool:
    """Whether the runtime shows what cpushim gives an exclusive container: kubelet's quota
    replaced by -1 (kubelet with its CPU manager off never writes -1), or, for a container
    that could be exclusive, memory nodes narrower than every node with memory and exactly
    those of its CPUs that have memory (the annotation that keeps the quota leaves only
    those; CPUs of memory-less nodes alone have every node, no mark). One that holds
    no CPUs after the resync lost them while cpushim was down; its shared settings are written
    back.
    Settings equal to what a restore writes are not a mark, so a restored container is not
    restored again; nor are the nodes kubelet's memory manager chose for a container that
    shares: one with kubelet's quota when its pod does not keep it (cpushim drops it), or
    one on the shared pool, which may lie within one node."""
    if resources.cpu_quota == rq.NO_QUOTA and kubelet_quota > 0:
        return True
    if plan.exclusive is None or not resources.cpuset_mems:
        return False
    if resources.cpu_quota > 0 and not plan.keep_quota:
        return False
    topology = engine.policy.topology
    try:
        mems = CPUSet.parse(resources.cpuset_mems)
        cpus = CPUSet.parse(resources.cpuset_cpus)
    except ValueError:
        return False
    if cpus == engine.state.shared:
        return False
    return mems != topology.memory_nodes and mems == topology.memory_nodes_of(cpus)
