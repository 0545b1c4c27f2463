"""The machine's CPU topology as plain data, and its discovery from sysfs.

Only online CPUs are described: an offline CPU has no topology in sysfs and cannot be given to a
container. Where the kernel has NUMA nodes, neither is a CPU that no node lists, nor anywhere one
whose topology lacks its core or package id (kubelet sees neither: cadvisor leaves them out).
Every grouping the allocator uses (socket, NUMA node, core, uncore cache) is also
precomputed as a bitmask so it can work with int operations only.

Beside the CPUs, the NUMA nodes with memory, every node a container's ``cpuset.mems`` may name.
They are not the CPUs' nodes where a node has memory and no online CPU (CXL memory, HBM, a node
whose CPUs are all offline), or CPUs and no memory.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import TypeAlias, TypeVar

from shim.cpuset import CPUSet
from shim.fileio import read_file

__all__ = ["CPUInfo", "CoreKey", "SysfsWarnings", "Topology", "TopologyError"]

# A physical core. Core ids restart in every package (and on some parts in every die), so
# the core id alone does not name a core.
CoreKey: TypeAlias = tuple[int, int, int]  # (socket, die, core id)

_K = TypeVar("_K")
_V = TypeVar("_V")

log = logging.getLogger(__name__)


class TopologyError(ValueError):
    """The topology is inconsistent, or sysfs lacks a file we cannot do without."""


@dataclass
class SysfsWarnings:
    """What reads of sysfs have warned of, kept by a reader that reads again (the CPU
    follower, at every check; a re-plan or a config reload), so that what stays as it was
    is told once and the operator's log does not fill with the same line. A read given none
    tells all it meets."""

    # The files whose last read failed (a list of memory nodes passed over, the CPUs online
    # unread), by path: why (the error, or "" for a list that reads empty). One that reads
    # well is forgotten, so failing again is told again; one that fails otherwise is told
    # anew.
    failing: dict[Path, str] = field(default_factory=dict)
    # What is told once for the reader's life, each re-read of the topology meeting it
    # again (the CPU follower reads it at every check while a CPU left out keeps the CPUs
    # listed online apart from those planned with): the CPUs left out for want of a core or
    # package id, with the file missing; the cache entries passed over for a level that is
    # not a number, by the level file.
    told: set[tuple[object, ...]] = field(default_factory=set)

    def failed(self, path: Path, error: str) -> bool:
        """Note that reading ``path`` failed with ``error``; whether to tell of it (its last
        read did not fail the same way)."""
        if self.failing.get(path) == error:
            return False
        self.failing[path] = error
        return True

    def read_well(self, path: Path) -> bool:
        """Note that ``path`` read well; whether its last read had failed."""
        return self.failing.pop(path, None) is not None

    def first_time(self, *what: object) -> bool:
        """Whether this reader meets ``what`` for the first time (and is to tell of it)."""
        if what in self.told:
            return False
        self.told.add(what)
        return True


@dataclass(frozen=True, slots=True)
class CPUInfo:
    """Where one logical CPU (hardware thread) sits."""

    cpu: int
    socket: int
    core_id: int
    numa_node: int = 0
    die: int = 0
    # The group kubelet's prefer-align-cpus-by-uncorecache keeps a request in: CPUs sharing a
    # level 3+ cache that is not the NUMA node's own, else the socket's CPUs (see
    # _with_cache_groups). An index: groups are numbered by their lowest CPU.
    uncore_cache: int = 0
    # The group sharing the highest-level cache, whatever that level is; for the status
    # pages only. The socket id when some CPU has no cache data.
    last_level_cache: int = 0

    @property
    def core(self) -> CoreKey:
        return (self.socket, self.die, self.core_id)


def _freeze(mapping: Mapping[_K, _V]) -> Mapping[_K, _V]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Topology:
    """Online CPUs and where they sit, plus the kernel's isolated CPUs (``isolcpus``) and the
    NUMA nodes with memory.

    Build from plain data (``Topology(cpus=[CPUInfo(...), ...])``) or with ``from_sysfs``.
    Isolated CPUs that are not online are dropped: they cannot be used either way.
    """

    cpus: tuple[CPUInfo, ...]
    isolated: CPUSet = field(default_factory=CPUSet)
    # Every memory node: the NUMA nodes with memory, which a container kubelet creates may
    # use unless kubelet's memory manager confines it (the root cpuset's ``cpuset.mems``).
    # Left empty, the nodes of the CPUs (a kernel that does not say; plain data in tests).
    memory_nodes: CPUSet = field(default_factory=CPUSet)

    # Derived in __post_init__; masks are CPUSet.mask ints for the allocator's hot loops.
    online: CPUSet = field(init=False, compare=False)
    socket_masks: Mapping[int, int] = field(init=False, repr=False, compare=False)
    numa_masks: Mapping[int, int] = field(init=False, repr=False, compare=False)
    uncore_masks: Mapping[int, int] = field(init=False, repr=False, compare=False)
    core_masks: Mapping[CoreKey, int] = field(init=False, repr=False, compare=False)
    cpu_core: Mapping[int, CoreKey] = field(init=False, repr=False, compare=False)
    cpus_per_core: int = field(init=False, compare=False)
    _by_cpu: Mapping[int, CPUInfo] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        infos = tuple(sorted(self.cpus, key=lambda info: info.cpu))
        by_cpu: dict[int, CPUInfo] = {}
        for info in infos:
            if info.cpu in by_cpu:
                raise TopologyError(f"CPU {info.cpu} is described twice")
            by_cpu[info.cpu] = info
        if not by_cpu:
            raise TopologyError("a topology needs at least one online CPU")
        online = CPUSet(by_cpu)

        sockets: dict[int, int] = {}
        numas: dict[int, int] = {}
        uncores: dict[int, int] = {}
        cores: dict[CoreKey, int] = {}
        for info in infos:
            bit = 1 << info.cpu
            sockets[info.socket] = sockets.get(info.socket, 0) | bit
            numas[info.numa_node] = numas.get(info.numa_node, 0) | bit
            uncores[info.uncore_cache] = uncores.get(info.uncore_cache, 0) | bit
            cores[info.core] = cores.get(info.core, 0) | bit

        def by_id(masks: dict[int, int]) -> dict[int, int]:
            return dict(sorted(masks.items()))

        # Cores are ordered by their lowest CPU, which is how kubelet numbers cores too.
        ordered_cores = dict(sorted(cores.items(), key=lambda item: item[1] & -item[1]))
        setattr_ = object.__setattr__
        setattr_(self, "cpus", infos)
        setattr_(self, "isolated", self.isolated & online)
        if not self.memory_nodes:
            setattr_(self, "memory_nodes", CPUSet(numas))
        setattr_(self, "online", online)
        setattr_(self, "socket_masks", _freeze(by_id(sockets)))
        setattr_(self, "numa_masks", _freeze(by_id(numas)))
        setattr_(self, "uncore_masks", _freeze(by_id(uncores)))
        setattr_(self, "core_masks", _freeze(ordered_cores))
        setattr_(self, "cpu_core", _freeze({info.cpu: info.core for info in infos}))
        setattr_(self, "cpus_per_core", max((m.bit_count() for m in cores.values()), default=1))
        setattr_(self, "_by_cpu", _freeze(by_cpu))

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_sysfs(cls, root: Path = Path("/sys"), warned: SysfsWarnings | None = None) -> Topology:
        """Read the topology below ``root``, which plays the part of ``/sys``. ``warned``:
        what earlier reads warned of, not told again (see :class:`SysfsWarnings`)."""
        if warned is None:
            warned = SysfsWarnings()
        cpus, isolated = _read_sysfs(root, warned)
        return cls(cpus=tuple(cpus), isolated=isolated, memory_nodes=memory_nodes(root, warned))

    # -- queries --------------------------------------------------------------------------

    def info(self, cpu: int) -> CPUInfo:
        try:
            return self._by_cpu[cpu]
        except KeyError:
            raise KeyError(f"CPU {cpu} is not online") from None

    @property
    def sockets(self) -> tuple[int, ...]:
        return tuple(self.socket_masks)

    @property
    def numa_nodes(self) -> tuple[int, ...]:
        """The NUMA nodes of the online CPUs (see ``memory_nodes`` for those with memory)."""
        return tuple(self.numa_masks)

    @property
    def uncore_caches(self) -> tuple[int, ...]:
        return tuple(self.uncore_masks)

    @property
    def cores(self) -> tuple[CoreKey, ...]:
        """Physical cores, ordered by their lowest CPU id."""
        return tuple(self.core_masks)

    @property
    def num_sockets(self) -> int:
        return len(self.socket_masks)

    @property
    def num_numa_nodes(self) -> int:
        return len(self.numa_masks)

    @property
    def num_cores(self) -> int:
        return len(self.core_masks)

    def cpus_in_socket(self, socket: int) -> CPUSet:
        return CPUSet.from_mask(self.socket_masks.get(socket, 0))

    def cpus_in_numa_node(self, node: int) -> CPUSet:
        return CPUSet.from_mask(self.numa_masks.get(node, 0))

    def cpus_in_uncore_cache(self, cache: int) -> CPUSet:
        return CPUSet.from_mask(self.uncore_masks.get(cache, 0))

    def cpus_in_core(self, core: CoreKey) -> CPUSet:
        return CPUSet.from_mask(self.core_masks.get(core, 0))

    def core_of(self, cpu: int) -> CoreKey:
        return self.info(cpu).core

    def siblings(self, cpu: int) -> CPUSet:
        """The hardware threads sharing ``cpu``'s core, ``cpu`` included (like the kernel's
        ``thread_siblings_list``)."""
        return self.cpus_in_core(self.core_of(cpu))

    def numa_nodes_of(self, cpus: CPUSet) -> frozenset[int]:
        return frozenset(n for n, m in self.numa_masks.items() if m & cpus.mask)

    def memory_nodes_of(self, cpus: CPUSet) -> CPUSet:
        """The memory nodes that go with ``cpus``: their NUMA nodes that have memory, or,
        when none has (CPUs of memory-less nodes only), every node with memory. The kernel
        refuses a cpuset.mems naming a node without memory, and places such CPUs' memory
        on the nearest nodes that have it."""
        return self.memory_nodes_within(CPUSet(self.numa_nodes_of(cpus)))

    def memory_nodes_within(self, nodes: CPUSet) -> CPUSet:
        """What a cpuset.mems confined to ``nodes`` may name: those of them that have memory,
        or, when none has, every node with memory. kubelet's memory manager may name a node
        whose memory went offline since (memory hotplug), which the kernel refuses."""
        return (nodes & self.memory_nodes) or self.memory_nodes

    def sockets_of(self, cpus: CPUSet) -> frozenset[int]:
        return frozenset(s for s, m in self.socket_masks.items() if m & cpus.mask)

    def numa_nodes_in_socket(self, socket: int) -> tuple[int, ...]:
        mask = self.socket_masks.get(socket, 0)
        return tuple(n for n, m in self.numa_masks.items() if m & mask)

    def sockets_in_numa_node(self, node: int) -> tuple[int, ...]:
        mask = self.numa_masks.get(node, 0)
        return tuple(s for s, m in self.socket_masks.items() if m & mask)

    @cached_property
    def layout(self) -> TopologyLayout:
        """Containment relations between the groupings, for the allocator."""
        return TopologyLayout.of(self)

    def whole_cores_in(self, cpus: CPUSet) -> CPUSet:
        """The CPUs of ``cpus`` whose every online sibling is also in ``cpus``."""
        return CPUSet.from_mask(whole_cores_mask(self, cpus.mask))


@dataclass(frozen=True, slots=True)
class TopologyLayout:
    """Which groupings contain which, with cores named by their index in ``core_list``."""

    core_list: tuple[int, ...]  # core masks, ordered by lowest CPU
    socket_cores: Mapping[int, tuple[int, ...]]
    numa_cores: Mapping[int, tuple[int, ...]]
    uncore_cores: Mapping[int, tuple[int, ...]]
    socket_numas: Mapping[int, tuple[int, ...]]
    numa_sockets: Mapping[int, tuple[int, ...]]
    numa_uncores: Mapping[int, tuple[int, ...]]

    @classmethod
    def of(cls, topology: Topology) -> TopologyLayout:
        core_list = tuple(topology.core_masks.values())

        def cores_in(masks: Mapping[int, int]) -> Mapping[int, tuple[int, ...]]:
            return _freeze(
                {
                    key: tuple(i for i, core in enumerate(core_list) if core & mask)
                    for key, mask in masks.items()
                }
            )

        def groups_in(
            outer: Mapping[int, int], inner: Mapping[int, int]
        ) -> Mapping[int, tuple[int, ...]]:
            return _freeze(
                {key: tuple(k for k, m in inner.items() if m & mask) for key, mask in outer.items()}
            )

        return cls(
            core_list=core_list,
            socket_cores=cores_in(topology.socket_masks),
            numa_cores=cores_in(topology.numa_masks),
            uncore_cores=cores_in(topology.uncore_masks),
            socket_numas=groups_in(topology.socket_masks, topology.numa_masks),
            numa_sockets=groups_in(topology.numa_masks, topology.socket_masks),
            numa_uncores=groups_in(topology.numa_masks, topology.uncore_masks),
        )


def whole_cores_mask(topology: Topology, mask: int) -> int:
    """The CPUs of ``mask`` whose core is entirely within ``mask``."""
    result = 0
    for core in topology.core_masks.values():
        if core & mask == core:
            result |= core
    return result


# -- sysfs discovery ----------------------------------------------------------------------

_NODE_DIR = re.compile(r"node([0-9]+)")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TopologyError(f"cannot read {path}: {reason}") from exc


def _read_int(path: Path) -> int:
    text = _read_text(path).strip()
    try:
        return int(text)
    except ValueError:
        raise TopologyError(f"{path} holds {text!r}, not an integer") from None


def _read_id(path: Path) -> int | None:
    """The integer in ``path``, or None when there is no such file."""
    try:
        return _read_int(path)
    except TopologyError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            return None
        raise


def _read_cpulist(path: Path) -> CPUSet:
    text = _read_text(path)
    try:
        return CPUSet.parse(text)
    except ValueError as exc:
        raise TopologyError(f"{path}: {exc}") from None


def _numa_nodes(node_dir: Path) -> dict[int, int]:
    """CPU -> NUMA node; empty when the kernel has no NUMA support (no node directory, or
    no node that lists a CPU)."""
    node_of: dict[int, int] = {}
    if not node_dir.is_dir():
        return node_of
    for entry in sorted(node_dir.iterdir()):
        match = _NODE_DIR.fullmatch(entry.name)
        if match is None or not entry.is_dir():
            continue
        for cpu in _read_cpulist(entry / "cpulist"):
            node_of[cpu] = int(match.group(1))
    return node_of


def _memory_nodes(node_dir: Path, warned: SysfsWarnings) -> CPUSet:
    """The NUMA nodes with memory: ``has_memory``, else (a kernel or a tree without it) the
    nodes ``online``, else none (a kernel without NUMA support: the nodes of the CPUs stand
    for them). A list that does not read, or reads empty, is passed over with a warning: the
    CPUs are read all the same, and every node is only what a container that shares gets."""
    for name in ("has_memory", "online"):
        path = node_dir / name
        if not path.exists():
            continue
        try:
            nodes = _read_cpulist(path)
        except TopologyError as exc:
            _memory_list_passed_over(path, str(exc), warned)
            continue
        if nodes:
            warned.read_well(path)
            return nodes
        _memory_list_passed_over(path, "", warned)
    return CPUSet()


def _memory_list_passed_over(path: Path, error: str, warned: SysfsWarnings) -> None:
    """Warn that the list of memory nodes at ``path`` is passed over, because of ``error``
    ("": it reads empty), unless the last read of it was passed over for the same reason:
    the CPU follower reads the list at every check, each uevent and full look."""
    if not warned.failed(path, error):
        return
    if error:
        log.warning(
            "ignoring a list of memory nodes that cannot be read",
            extra={"fields": {"path": str(path), "error": error}},
        )
    else:
        log.warning("ignoring an empty list of memory nodes", extra={"fields": {"path": str(path)}})


def _caches(cache_dir: Path, warned: SysfsWarnings) -> list[tuple[int, CPUSet]] | None:
    """``(level, CPUs sharing it)`` for each cache this CPU sees, in the order of their
    ``index`` directories' names (the order cadvisor reads them in), or None when sysfs does
    not say. An entry without a level or a CPU list says nothing and is passed over, and so
    is one whose level is not a number (with a warning, once per ``warned``: the other
    entries still count)."""
    if not cache_dir.is_dir():
        return None
    caches: list[tuple[int, CPUSet]] = []
    for index in sorted(cache_dir.glob("index[0-9]*")):
        level_file, shared_file = index / "level", index / "shared_cpu_list"
        if not (level_file.is_file() and shared_file.is_file()):
            continue
        level = _read_text(level_file).strip()
        if not level.isdecimal():
            if warned.first_time("cache level", level_file):
                log.warning(
                    "ignoring a cache whose level is not a number",
                    extra={"fields": {"path": str(level_file), "level": level}},
                )
            continue
        caches.append((int(level), _read_cpulist(shared_file)))
    return caches


def online_list(root: Path = Path("/sys")) -> Path:
    """The kernel's list of the CPUs online."""
    return root / "devices" / "system" / "cpu" / "online"


def online_cpus(root: Path = Path("/sys")) -> CPUSet:
    """The CPUs online now, from the kernel's list alone (one small read, for the checks
    that run while cpushim does: a CPU gone offline or back); OSError or ValueError when
    sysfs does not say."""
    return CPUSet.parse(read_file(str(online_list(root))).decode().strip())


def memory_nodes(root: Path = Path("/sys"), warned: SysfsWarnings | None = None) -> CPUSet:
    """The NUMA nodes with memory now, read as :meth:`Topology.from_sysfs` reads them (also
    for the checks that run while cpushim does: memory brought online or taken offline).
    Empty when sysfs does not say: a topology then takes its CPUs' nodes for them.
    ``warned``: what earlier reads warned of, not told again."""
    if warned is None:
        warned = SysfsWarnings()
    return _memory_nodes(root / "devices" / "system" / "node", warned)


def _read_sysfs(root: Path, warned: SysfsWarnings) -> tuple[list[CPUInfo], CPUSet]:
    cpu_dir = root / "devices" / "system" / "cpu"
    online = _read_cpulist(cpu_dir / "online")
    isolated_file = cpu_dir / "isolated"
    isolated = _read_cpulist(isolated_file) if isolated_file.exists() else CPUSet()
    node_of = _numa_nodes(root / "devices" / "system" / "node")

    found: list[tuple[int, int, int, int]] = []
    cluster_of: dict[int, int] = {}
    caches_of: dict[int, list[tuple[int, CPUSet]] | None] = {}
    for cpu in online:
        # Where the kernel has NUMA nodes, a CPU none of them lists (one going offline as we
        # read) is left out as if offline: kubelet knows CPUs only from the nodes' lists
        # (cadvisor builds its topology from them), and no node is right to file it under.
        if node_of and cpu not in node_of:
            continue
        topology_dir = cpu_dir / f"cpu{cpu}" / "topology"
        # A CPU taken offline after we read the online list loses its topology directory.
        if not topology_dir.is_dir():
            continue
        # Without one of its ids a CPU cannot be placed; cadvisor leaves it out with a
        # warning (so kubelet never sees it) rather than failing, and so do we.
        package_file, core_file = topology_dir / "physical_package_id", topology_dir / "core_id"
        socket, core_id = _read_id(package_file), _read_id(core_file)
        if socket is None or core_id is None:
            missing = package_file if socket is None else core_file
            if warned.first_time("CPU left out", cpu, missing):
                log.warning(
                    "leaving out a CPU whose topology lacks an id",
                    extra={"fields": {"cpu": cpu, "missing": str(missing)}},
                )
            continue
        die_file = topology_dir / "die_id"
        die = _read_int(die_file) if die_file.exists() else 0
        found.append((cpu, socket, die, core_id))
        cluster_file = topology_dir / "cluster_id"
        if cluster_file.is_file():
            cluster_of[cpu] = _read_int(cluster_file)
        caches_of[cpu] = _caches(cpu_dir / f"cpu{cpu}" / "cache", warned)
    found = _cores_named_apart(found, cluster_of)

    infos = [
        # Without NUMA support the kernel has one memory node, 0.
        CPUInfo(cpu=cpu, socket=socket, core_id=core_id, numa_node=node_of.get(cpu, 0), die=die)
        for cpu, socket, die, core_id in found
    ]
    return _with_cache_groups(infos, caches_of), isolated


def _cores_named_apart(
    found: list[tuple[int, int, int, int]], cluster_of: Mapping[int, int]
) -> list[tuple[int, int, int, int]]:
    """``(cpu, socket, die, core id)`` with core ids that name one core each.

    A core id is unique within a package and die on x86 and on ACPI arm64 servers, but on
    arm64 boards described by a device tree it restarts in every cluster while the package
    is the same for all, so (socket, die, core id) would join cores of different clusters
    into one with several threads. Only when one such key spans clusters is each core named
    by the lowest CPU of its (socket, die, cluster, core id) instead; elsewhere the kernel's
    ids stand, as kubelet reads them (``thread_siblings_list`` is not used for this: on some
    x86 parts it pairs cores that keep ids of their own, such as AMD's compute units).
    """
    clusters: dict[tuple[int, int, int], set[int]] = {}
    for cpu, socket, die, core_id in found:
        clusters.setdefault((socket, die, core_id), set()).add(cluster_of.get(cpu, 0))
    if all(len(seen) == 1 for seen in clusters.values()):
        return found
    lowest: dict[tuple[int, int, int, int], int] = {}
    for cpu, socket, die, core_id in sorted(found):
        lowest.setdefault((socket, die, cluster_of.get(cpu, 0), core_id), cpu)
    return [
        (cpu, socket, die, lowest[(socket, die, cluster_of.get(cpu, 0), core_id)])
        for cpu, socket, die, core_id in found
    ]


def _with_cache_groups(
    infos: list[CPUInfo], caches_of: Mapping[int, list[tuple[int, CPUSet]] | None]
) -> list[CPUInfo]:
    """Each CPU's uncore-cache and last-level-cache groups, numbered by lowest CPU.

    The uncore group is kubelet's for prefer-align-cpus-by-uncorecache: cadvisor keeps, as a
    core's uncore caches, those of level 3 or more that do not span exactly its NUMA node,
    and kubelet groups by the first one's id, else by the socket. So an L2 is never one (an
    arm64 cluster without an L3 groups by socket), and neither is an L3 that is the node's
    own (cluster-on-die parts): those group by socket too.

    The last-level group is the highest level's, whatever it is, for the status pages. Without
    cache data for every CPU the socket id stands in for all of them, so the two numberings
    never mix.
    """
    present = CPUSet(info.cpu for info in infos)
    node_masks: dict[int, int] = {}
    for info in infos:
        node_masks[info.numa_node] = node_masks.get(info.numa_node, 0) | 1 << info.cpu

    def sharing(cpu: int, cpus: CPUSet) -> int:
        # shared_cpu_list may name CPUs we left out (offline, in no node).
        return (cpus.mask & present.mask) | 1 << cpu

    uncore_key: dict[int, tuple[str, int]] = {}
    llc_group: dict[int, int] = {}
    for info in infos:
        caches = caches_of.get(info.cpu) or []
        node = node_masks[info.numa_node]
        uncore = next(
            (
                shared
                for level, cpus in caches
                if level >= 3 and (shared := sharing(info.cpu, cpus)) != node
            ),
            None,
        )
        uncore_key[info.cpu] = ("socket", info.socket) if uncore is None else ("cache", uncore)
        if caches:
            # The first of the highest level, as sysfs lists them.
            top = max(level for level, _ in caches)
            llc_group[info.cpu] = sharing(info.cpu, next(c for lv, c in caches if lv == top))
    uncore_ids = _numbered_by_lowest_cpu(infos, uncore_key)
    if len(llc_group) < len(infos):
        return [
            replace(info, uncore_cache=uncore_ids[info.cpu], last_level_cache=info.socket)
            for info in infos
        ]
    llc_ids = _numbered_by_lowest_cpu(infos, llc_group)
    return [
        replace(info, uncore_cache=uncore_ids[info.cpu], last_level_cache=llc_ids[info.cpu])
        for info in infos
    ]


def _numbered_by_lowest_cpu(infos: list[CPUInfo], group_of: Mapping[int, _K]) -> dict[int, int]:
    """CPU -> a dense index of its group, the groups in order of their lowest CPU."""
    index: dict[_K, int] = {}
    for info in sorted(infos, key=lambda info: info.cpu):
        index.setdefault(group_of[info.cpu], len(index))
    return {info.cpu: index[group_of[info.cpu]] for info in infos}
