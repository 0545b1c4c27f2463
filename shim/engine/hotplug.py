"""CPUs going offline and online while cpushim runs, and memory too: the policy is planned
again with the CPUs online and the NUMA nodes with memory now, as a config reload re-plans.

The topology is otherwise read once, at start. A CPU taken offline (by hand, by SMT switched
off, by rasdaemon or mcelog after too many corrected errors) would stay in the shared pool
and in assignments; under cgroup v1 the kernel takes it out of every cpuset and refuses it
back, and runc refuses every container whose cpuset names it, so kubelet could create no
shared container until cpushim was restarted.

The memory nodes (``has_memory``, every node a container's ``cpuset.mems`` may name) change
with memory hotplug alone: a memory block brought online or taken offline, CXL memory added
as a node of its own, with no CPU going anywhere. The re-plan writes the new ones to the
containers whose memory nodes derive from them (an exclusive one's CPUs' nodes with memory,
every node for one that shares), kept on their CPUs; those kubelet chose stay, but for nodes
that lost all their memory, which the kernel refuses (``Topology.memory_nodes_within``).

The kernel tells of a CPU going offline or online with a uevent (``NETLINK_KOBJECT_UEVENT``,
subsystem ``cpu``), and of memory with one of subsystem ``memory`` (a block) or ``node``;
the online list and the memory nodes (read as the topology reads them) are also compared at
every full look (no uevent socket, or one whose queue overflowed). A memory node list that
does not read, or reads empty, is no change: the topology stands in its CPUs' nodes for
it; it is warned of once while it stays so (``SysfsWarnings``), not at every check. A
change builds the policy again from the options in force (the config reload's, when
there is one, one at a time with it) and re-plans under it (``Engine.change_policy``):
containers whose CPUs went offline get others where there is room, and so do those the
policy would no longer give their CPUs (under full-pcpus-only, a lone thread whose sibling
came online), the pool follows, the checkpoint is rewritten with the new topology. A policy
that cannot be built (a reserved CPU named in the config went offline) is refused with the
reason, once per set of online CPUs and memory nodes, and the old plan stays; so is one
whose checkpoint cannot be written. A refused change is tried again at every full look, or
on its own while there are none (``resyncPeriod`` 0), as a refused config file is.

Under cgroup v1 a CPU back online is in the root cpuset only: before the re-plan hands it
out, the cgroups above kubelet's containers (the kubepods tree: its QoS classes and pods) get
it back, parents first, as they had every CPU when kubelet made them. Nothing inside a pod's
cgroup is touched: its containers' cgroups are cpushim's to write (the re-plan does), and one
cpushim has not located yet (its StartContainer in flight, one another client made) must not
be given a CPU the re-plan may pin for another container. Every check does the same for a
CPU the policy hands out that kubelet's tree lacks with no change to re-plan for: one that
went offline and came back before a check looked, or while the re-plan was refused. cgroup
v2 needs none of this (a cgroup with no set of its own follows its parent). The same goes
for a node whose memory came online: kubelet's tree gets it in ``cpuset.mems``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import socket
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Final, Literal, TypeAlias

from shim import cgroups
from shim.cgroups import CgroupError, CgroupLayout, CgroupVersion
from shim.cpuset import CPUSet
from shim.engine.resync import replan_live
from shim.engine.retrying import Retry
from shim.policy import CPUPolicy
from shim.topology import SysfsWarnings, Topology, memory_nodes, online_cpus, online_list

if TYPE_CHECKING:
    from shim.engine.watching import Watcher
    from shim.run import RunOptions

log = logging.getLogger(__name__)

NETLINK_KOBJECT_UEVENT: Final = 15
# The kernel's own uevents (udev re-broadcasts them, with a header of its own, to group 2).
_KERNEL_UEVENTS: Final = 1
_HOTPLUG_ACTIONS: Final = frozenset({b"online", b"offline", b"add", b"remove"})
# A memory block's (``memoryN``: brought online or taken offline, added or removed), or a
# NUMA node's (``nodeN``: one that gained its first memory, or lost its last, with memory
# hotplug, CXL memory among it).
_MEMORY_SUBSYSTEMS: Final = frozenset({b"memory", b"node"})
_JOB: Final = "cpus online"

Told: TypeAlias = Literal["cpus", "memory"]


def hotplug_told(datagram: bytes) -> Told | None:
    """What a kernel uevent tells of: a CPU going online or offline, added or removed
    ("cpus"), the same of a memory block or a NUMA node ("memory"), else None."""
    header, _, rest = datagram.partition(b"\0")
    if b"@" not in header:
        return None  # not the kernel's (udev's start with "libudev")
    values = dict(field.partition(b"=")[::2] for field in rest.split(b"\0") if b"=" in field)
    if values.get(b"ACTION") not in _HOTPLUG_ACTIONS:
        return None
    subsystem = values.get(b"SUBSYSTEM")
    if subsystem == b"cpu":
        return "cpus"
    return "memory" if subsystem in _MEMORY_SUBSYSTEMS else None


def open_uevents() -> socket.socket:
    """A non-blocking socket that receives the kernel's uevents; OSError when refused."""
    sock = socket.socket(
        socket.AF_NETLINK,
        socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
        NETLINK_KOBJECT_UEVENT,
    )
    try:
        sock.bind((0, _KERNEL_UEVENTS))
    except OSError:
        sock.close()
        raise
    return sock


# The names kubelet gives a pod's cgroup: ``pod<uid>`` (cgroupfs driver), and
# ``kubepods[-<qos>]-pod<uid, dashes as underscores>.slice`` (systemd driver).
_POD_CGROUP: Final = re.compile(
    r"pod[0-9a-fA-F][0-9a-fA-F-]*|.+-pod[0-9a-fA-F][0-9a-fA-F_]*\.slice"
)


def _cgroup_of_a_pod(cgroup_parent: str) -> PurePosixPath | None:
    """The pod's cgroup below the hierarchy's root, from its sandbox's cgroup parent; None
    when that names none."""
    if not cgroup_parent:
        return None
    try:
        relative = cgroups.relative_cgroup_path(cgroups.containerd_cgroups_path(cgroup_parent, "x"))
    except CgroupError:
        return None
    return relative.parent if len(relative.parts) > 1 else None


def kubepods_tops(layout: CgroupLayout, cgroup_parents: Iterable[str]) -> set[Path]:
    """The top cgroups of kubelet's tree (``kubepods``, ``kubepods.slice``) in the cpuset
    hierarchy, from pods' cgroup parents."""
    pods = (_cgroup_of_a_pod(parent) for parent in cgroup_parents)
    return {layout.root / PurePosixPath(pod.parts[0]) for pod in pods if pod is not None}


def pod_cgroups(layout: CgroupLayout, cgroup_parents: Iterable[str]) -> set[Path]:
    """The pods' own cgroups in the cpuset hierarchy, from their cgroup parents."""
    pods = (_cgroup_of_a_pod(parent) for parent in cgroup_parents)
    return {layout.root / pod for pod in pods if pod is not None}


def give_back_online(
    top: Path,
    came_online: CPUSet,
    handed_out: CPUSet,
    pods: set[Path],
    file: str = cgroups.CPUSET_CPUS,
) -> list[Path]:
    """Cgroup v1: add the CPUs of ``handed_out`` (those the policy gives containers) that
    came back online, and those ``top`` lacks (the kernel took them out as they went
    offline, and a check saw them online only: back before it looked, or while a re-plan
    was refused), to the cpusets of kubelet's tree below ``top`` (``top`` included),
    parents first, as far as each parent has them, down to the pods' cgroups and no
    further: nothing inside a pod's cgroup (a container's, or its sandbox's) is touched. A
    pod's cgroup is one of ``pods`` (those cpushim knows) or named as kubelet names them (a
    pod whose sandbox is on its way). Returns the cgroups widened; a cgroup that refuses
    (gone meanwhile, or the kernel's refusal) is logged and its subtree left. ``file`` says
    what: ``cpuset.cpus`` with CPUs, or ``cpuset.mems`` with NUMA nodes whose memory came
    online (the kernel adds those to the root cpuset alone, as it does CPUs)."""
    widened: list[Path] = []
    parent_cpus = cgroups.read_list(top.parent, file)
    top_cpus = cgroups.read_list(top, file)
    if parent_cpus is None or top_cpus is None:
        return widened
    came_online = (came_online | (parent_cpus - top_cpus)) & handed_out
    if not came_online:
        return widened
    pending: list[tuple[Path, CPUSet]] = [(top, parent_cpus)]
    while pending:
        directory, above = pending.pop()
        try:
            cpus = cgroups.read_list(directory, file)
            if cpus is None:
                continue
            wanted = cpus | (came_online & above)
            if wanted != cpus:
                cgroups.write_list(directory, file, wanted)
                widened.append(directory)
            is_pod = directory != top and (
                directory in pods or _POD_CGROUP.fullmatch(directory.name) is not None
            )
            if is_pod:
                continue
            children = [entry.path for entry in os.scandir(directory) if entry.is_dir()]
        except (OSError, ValueError) as exc:
            if not isinstance(exc, OSError) or exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning(
                    "cannot give what came back online to a cgroup",
                    extra={"fields": {"cgroup": str(directory), "file": file, "error": str(exc)}},
                )
            continue
        pending.extend((Path(child), wanted) for child in children)
    return widened


class CPUFollower:
    """Re-plans when the CPUs online, or the memory nodes, differ from those the policy was
    planned with."""

    def __init__(
        self,
        watcher: Watcher,
        options: Callable[[], RunOptions],
        build_policy: Callable[[RunOptions, SysfsWarnings], CPUPolicy],
        lock: asyncio.Lock | None = None,
        open_socket: Callable[[], socket.socket] = open_uevents,
        warned: SysfsWarnings | None = None,
    ) -> None:
        self.watcher = watcher
        self.engine = watcher.engine
        self._options = options
        self._build_policy = build_policy
        # Shared with the config reloader: a reload's policy is built from the sysfs of its
        # moment, and two re-plans must not interleave.
        self._lock = lock if lock is not None else asyncio.Lock()
        self._open_socket = open_socket
        self._socket: socket.socket | None = None
        # What the reads of sysfs warned of (a list of memory nodes that reads empty, a CPU
        # left out for want of a core id, a cache whose level is not a number, the CPUs
        # online that cannot be read): each check
        # reads the memory nodes, and the topology while the CPUs online differ from those
        # planned with, and what stays as it was is told once, not at every uevent and full
        # look.
        self.warned = warned if warned is not None else SysfsWarnings()
        # The last refusal (the CPUs online, the memory nodes, the reason): told once.
        self._refused: tuple[CPUSet, CPUSet, str] | None = None
        self._stopped = False
        self._stopping = asyncio.Event()
        # Checks again after a refusal while no full look will (resyncPeriod 0): the reason
        # may be the machine's (a checkpoint that could not be written), and no uevent
        # comes for it.
        self._retry = Retry(
            self._check_again,
            lambda: self.engine.options.retry_delay,
            self._stopping,
            self.engine._spawn,
        )

    def start(self) -> None:
        try:
            self._socket = self._open_socket()
        except OSError as exc:
            log.warning(
                "cannot receive the kernel's hotplug events; CPUs going offline or online, and"
                " memory nodes changing, are followed at each full look (resyncPeriod) only,"
                " and with resyncPeriod 0 at the next start",
                extra={"fields": {"error": str(exc)}},
            )
        else:
            asyncio.get_running_loop().add_reader(self._socket.fileno(), self._on_uevents)
        self.watcher.full_look_hooks.append(self.check_soon)
        # The CPUs may have changed between the policy's sysfs read and now.
        self.check_soon()

    def stop(self) -> None:
        self._stopped = True
        self._stopping.set()
        if self.check_soon in self.watcher.full_look_hooks:
            self.watcher.full_look_hooks.remove(self.check_soon)
        if self._socket is not None:
            asyncio.get_running_loop().remove_reader(self._socket.fileno())
            self._socket.close()
            self._socket = None

    def check_soon(self) -> None:
        if not self._stopped:
            self.watcher.jobs.request(_JOB, self.check)

    def _on_uevents(self) -> None:
        assert self._socket is not None
        told: set[Told] = set()
        lost = False
        while True:
            try:
                datagram = self._socket.recv(65536)
            except BlockingIOError:
                break
            except OSError as exc:
                # ENOBUFS: the queue overflowed and events were lost; look anyway.
                if exc.errno != errno.ENOBUFS:
                    break
                lost = True
                continue
            what = hotplug_told(datagram)
            if what is not None:
                told.add(what)
        if "cpus" in told or lost:  # lost ones counted as CPUs' as they always were
            self.engine.counters["cpu_hotplug_events"] += 1
        if "memory" in told:
            self.engine.counters["memory_hotplug_events"] += 1
        if told or lost:
            self.check_soon()

    async def check(self) -> None:
        """Re-plan if the CPUs online, or the memory nodes, are not those the policy was
        planned with."""
        async with self._lock:
            if self._stopped:
                return
            options = self._options()
            try:
                online = online_cpus(options.sysfs_root)
                memory = memory_nodes(options.sysfs_root, self.warned)
            except (OSError, ValueError) as exc:
                # Told once while it fails so, not at every uevent and full look.
                if self.warned.failed(online_list(options.sysfs_root), str(exc)):
                    log.warning(
                        "cannot read the CPUs online", extra={"fields": {"error": str(exc)}}
                    )
                return
            if self.warned.read_well(online_list(options.sysfs_root)):
                log.info("the CPUs online read again", extra={"fields": {"online": str(online)}})
            planned = self.engine.policy.topology
            # No list of memory nodes (none that reads): the topology takes the CPUs' nodes.
            if online == planned.online and (not memory or memory == planned.memory_nodes):
                self._refused = None
                # A CPU may have gone offline and come back before this look (or while a
                # re-plan was refused): under v1 kubelet's tree has lost it all the same.
                await self._give_back_unplanned()
                return
            try:
                policy = await asyncio.to_thread(self._build_policy, options, self.warned)
            except (OSError, ValueError) as exc:
                self._refuse(online, memory, str(exc))
                return
            now = policy.topology
            if self._stopped:
                return
            if not _changed(planned, now):
                # Listed online with no topology files (read as not there at start too):
                # nothing to plan anew.
                self._refused = None
                await self._give_back_unplanned()
                return
            came_online, went_offline = now.online - planned.online, planned.online - now.online
            await self._give_back(policy, came_online, now.memory_nodes - planned.memory_nodes)
            if self._stopped:
                return  # stopped during the walk: the next start plans with the CPUs then
            cpus_changed = now.online != planned.online
            reason = "CPUs online changed" if cpus_changed else "memory nodes changed"
            try:
                lost, adopted = await replan_live(self.engine, policy, reason)
            except OSError as exc:
                self._refuse(online, memory, f"cannot write the checkpoint: {exc}")
                return
            self._refused = None
            fields = {
                "went_offline": str(went_offline),
                "came_online": str(came_online),
                "online": str(now.online),
                "memory_nodes_before": str(planned.memory_nodes),
                "memory_nodes": str(now.memory_nodes),
                "shared": str(self.engine.state.shared),
                "lost_exclusive": [str(key) for key in lost],
                "adopted_exclusive": [str(key) for key in adopted],
            }
            if cpus_changed:
                self.engine.counters["cpu_hotplug_replans"] += 1
                message = "the CPUs online changed; re-planned with them"
            else:
                self.engine.counters["memory_hotplug_replans"] += 1
                message = "the memory nodes changed; re-planned with them"
            log.warning(message, extra={"fields": fields})
        # A change while the policy was built made a uevent (or waits for the next full
        # look), which runs this again.

    async def _give_back_unplanned(self) -> None:
        """Give kubelet's tree what it lacks with no re-plan to follow: the containers'
        cgroups lost the CPUs too, with no event to tell the watcher (the kernel's change),
        and no move writes them. Each is looked at again, and written back as planned."""
        # Stopped during the walk (off the loop), the checks would outlive the watcher.
        if not await self._give_back(self.engine.policy, CPUSet(), CPUSet()) or self._stopped:
            return
        for tracked in list(self.engine.containers.values()):
            if tracked.cgroup is not None:
                self.watcher.check_soon(tracked.id)

    async def _give_back(self, policy: CPUPolicy, came_online: CPUSet, memory_came: CPUSet) -> bool:
        """Cgroup v1: kubelet's tree gets back the CPUs ``policy`` hands out that it lacks
        (:func:`give_back_online`), before the re-plan hands them out, and so the memory
        nodes (``memory_came``: those whose memory came online) a container may be given.
        Whether any cgroup was widened."""
        layout = self.engine.mover.layout
        if layout is None or layout.version is not CgroupVersion.V1:
            return False
        given = False
        walks = (
            (
                cgroups.CPUSET_CPUS,
                came_online,
                policy.shared_pool({}) | policy.exclusive_candidates,
            ),
            (cgroups.CPUSET_MEMS, memory_came, policy.topology.memory_nodes),
        )
        parents = [pod.cgroup_parent for pod in self.engine.pods.values()]
        pods = pod_cgroups(layout, parents)
        for top in sorted(kubepods_tops(layout, parents)):
            for file, came, handed_out in walks:
                # A walk of every pod's cgroups: off the loop. One with nothing to give
                # back ends after two reads.
                try:
                    widened = await asyncio.to_thread(
                        give_back_online, top, came, handed_out, pods, file
                    )
                except (OSError, ValueError) as exc:
                    log.warning(
                        "cannot give what came back online to a cgroup",
                        extra={
                            "fields": {"cgroup": str(top.parent), "file": file, "error": str(exc)}
                        },
                    )
                    continue
                if widened:
                    given = True
                    log.info(
                        "what came back online given back to kubelet's cgroups (cgroup v1)",
                        extra={"fields": {"top": str(top), "file": file, "cgroups": len(widened)}},
                    )
        return given

    async def _check_again(self) -> bool:
        """Done when the plan follows the CPUs online, or full looks will check instead."""
        if self._stopped or self.engine._draining.is_set() or self.watcher.resync_period > 0:
            return True
        try:
            await self.check()
        except Exception:
            # A defect, not the machine: checking again would fail the same way.
            log.exception("watch job failed", extra={"fields": {"job": _JOB}})
            return True
        return self._refused is None

    def _refuse(self, online: CPUSet, memory: CPUSet, reason: str) -> None:
        if self.watcher.resync_period <= 0:
            self._retry.soon()
        if self._refused == (online, memory, reason):
            return
        self._refused = (online, memory, reason)
        self.engine.counters["cpu_hotplug_replans_refused"] += 1
        log.error(
            "the CPUs online or the memory nodes changed and the policy cannot be planned"
            " with them; the old plan stays (docs/operations.md)",
            extra={"fields": {"online": str(online), "memory_nodes": str(memory), "error": reason}},
        )


def _changed(planned: Topology, now: Topology) -> bool:
    """Whether ``now`` has other CPUs online, or other memory nodes, than ``planned``."""
    return now.online != planned.online or now.memory_nodes != planned.memory_nodes
