"""Fake ``/sys`` trees generated from a machine description, and the topology they describe.

``MachineSpec`` says how a machine is built (sockets, dies, cores, threads, NUMA split, L3
groups, how the kernel numbers sibling threads, offline and isolated CPUs, renumbered ids,
NUMA nodes with memory and no CPU);
``write_sysfs`` lays out the files the kernel would show, and ``expected_topology`` gives the
Topology that discovery must find in them, computed independently of shim.topology's reader.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hypothesis import HealthCheck, settings

from shim.cpuset import CPUSet
from shim.topology import CPUInfo, Topology

__all__ = [
    "AMD_EPYC_LIKE",
    "OFFLINE_NONCONTIGUOUS",
    "PROPERTY_SETTINGS",
    "SINGLE_SOCKET_NO_HT",
    "TWO_SOCKET_FOUR_NUMA",
    "XEON_E5_2680_V3_X2",
    "MachineSpec",
    "ThreadSpec",
    "expected_topology",
    "write_sysfs",
]


@dataclass(frozen=True, slots=True)
class ThreadSpec:
    """One hardware thread as the generator lays it out."""

    cpu: int
    socket: int
    die: int
    core_id: int
    numa_node: int
    l3_group: int  # global index of its L3 group
    core_index: int  # global index of its core


@dataclass(frozen=True)
class MachineSpec:
    sockets: int = 1
    dies_per_socket: int = 1
    cores_per_die: int = 4
    threads_per_core: int = 1
    # "intel": siblings are n and n + <number of cores>; "amd": siblings are consecutive ids.
    sibling_numbering: Literal["intel", "amd"] = "intel"
    # NUMA nodes per socket (cores split evenly), or several sockets sharing one node.
    numa_per_socket: int = 1
    sockets_per_numa: int = 1
    # L3 groups per die (cores split evenly); 1 = one L3 per die.
    l3_per_die: int = 1
    offline: frozenset[int] = frozenset()
    isolated: frozenset[int] = frozenset()
    # Renumber logical CPUs: logical index i becomes cpu_ids[i] (non-contiguous ids).
    cpu_ids: Sequence[int] | None = None
    # Kernel core ids within a socket; real parts skip values (0-5, 8-13 on a 12-core Xeon).
    core_ids: Sequence[int] | None = None
    # NUMA nodes with memory and no CPU (CXL memory, HBM), numbered after the CPUs' nodes.
    memory_only_nodes: int = 0
    write_numa: bool = True
    # Without has_memory, discovery falls back on the nodes online (the same nodes here).
    write_has_memory: bool = True
    write_cache: bool = True
    write_die_id: bool = True
    write_isolated: bool = True
    name: str = field(default="machine", compare=False)

    @property
    def cores_per_socket(self) -> int:
        return self.dies_per_socket * self.cores_per_die

    @property
    def total_cores(self) -> int:
        return self.sockets * self.cores_per_socket

    @property
    def total_threads(self) -> int:
        return self.total_cores * self.threads_per_core

    def threads(self) -> list[ThreadSpec]:
        """Every thread, online or not, in logical-index order."""
        out: list[ThreadSpec] = []
        cores_per_numa = self.cores_per_socket // self.numa_per_socket
        cores_per_l3 = self.cores_per_die // self.l3_per_die
        for socket in range(self.sockets):
            for die in range(self.dies_per_socket):
                for k in range(self.cores_per_die):
                    in_socket = die * self.cores_per_die + k
                    core_index = socket * self.cores_per_socket + in_socket
                    if self.sockets_per_numa > 1:
                        numa = socket // self.sockets_per_numa
                    else:
                        numa = socket * self.numa_per_socket + in_socket // cores_per_numa
                    l3 = (socket * self.dies_per_socket + die) * self.l3_per_die + k // cores_per_l3
                    core_id = self.core_ids[in_socket] if self.core_ids else in_socket
                    for t in range(self.threads_per_core):
                        if self.sibling_numbering == "intel":
                            logical = t * self.total_cores + core_index
                        else:
                            logical = core_index * self.threads_per_core + t
                        cpu = self.cpu_ids[logical] if self.cpu_ids else logical
                        out.append(ThreadSpec(cpu, socket, die, core_id, numa, l3, core_index))
        out.sort(key=lambda th: th.cpu)
        return out

    def all_cpus(self) -> CPUSet:
        return CPUSet(th.cpu for th in self.threads())

    def online(self) -> CPUSet:
        return self.all_cpus() - CPUSet(self.offline)

    def memory_nodes(self) -> CPUSet:
        """The NUMA nodes with memory: every node of a CPU (online or not; each has memory
        here) and the memory-only ones after them."""
        cpu_nodes = CPUSet(th.numa_node for th in self.threads())
        last = max(cpu_nodes)
        return cpu_nodes | CPUSet(range(last + 1, last + 1 + self.memory_only_nodes))


def expected_topology(spec: MachineSpec) -> Topology:
    """The Topology that discovery should return for ``write_sysfs(spec, ...)``."""
    online = spec.online()
    threads = [th for th in spec.threads() if th.cpu in online]
    l3_cpus: dict[int, set[int]] = {}
    node_cpus: dict[int, set[int]] = {}
    for th in threads:
        l3_cpus.setdefault(th.l3_group, set()).add(th.cpu)
        node_cpus.setdefault(th.numa_node if spec.write_numa else 0, set()).add(th.cpu)

    def uncore_group(th: ThreadSpec) -> tuple[str, int]:
        # kubelet's rule: an L3 that is not exactly the CPU's NUMA node, else the socket.
        node = th.numa_node if spec.write_numa else 0
        if spec.write_cache and l3_cpus[th.l3_group] != node_cpus[node]:
            return ("l3", th.l3_group)
        return ("socket", th.socket)

    def dense(group_of: dict[int, tuple[str, int]]) -> dict[int, int]:
        # Groups numbered in order of their lowest online CPU (threads come sorted by CPU).
        order: dict[tuple[str, int], int] = {}
        for th in threads:
            order.setdefault(group_of[th.cpu], len(order))
        return {cpu: order[group] for cpu, group in group_of.items()}

    uncore = dense({th.cpu: uncore_group(th) for th in threads})
    llc = dense({th.cpu: ("l3", th.l3_group) for th in threads})
    infos = [
        CPUInfo(
            cpu=th.cpu,
            socket=th.socket,
            core_id=th.core_id,
            numa_node=th.numa_node if spec.write_numa else 0,
            die=th.die if spec.write_die_id else 0,
            uncore_cache=uncore[th.cpu],
            last_level_cache=llc[th.cpu] if spec.write_cache else th.socket,
        )
        for th in threads
    ]
    # Without node files the kernel has no NUMA support: the CPUs' one node stands for them.
    memory_nodes = spec.memory_nodes() if spec.write_numa else CPUSet([0])
    return Topology(
        cpus=tuple(infos), isolated=CPUSet(spec.isolated) & online, memory_nodes=memory_nodes
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="ascii")


def write_sysfs(spec: MachineSpec, root: Path) -> Path:
    """Write the fake tree under ``root`` (which plays ``/sys``) and return ``root``."""
    threads = spec.threads()
    everything = CPUSet(th.cpu for th in threads)
    online = spec.online()
    cpu_dir = root / "devices" / "system" / "cpu"
    _write(cpu_dir / "online", str(online))
    _write(cpu_dir / "possible", str(everything))
    _write(cpu_dir / "present", str(everything))
    _write(cpu_dir / "offline", str(everything - online))
    if spec.write_isolated:
        _write(cpu_dir / "isolated", str(CPUSet(spec.isolated)))

    by_core: dict[int, list[int]] = {}
    by_socket: dict[int, list[int]] = {}
    by_l3: dict[int, list[int]] = {}
    by_numa: dict[int, list[int]] = {}
    for th in threads:
        by_core.setdefault(th.core_index, []).append(th.cpu)
        by_socket.setdefault(th.socket, []).append(th.cpu)
        by_l3.setdefault(th.l3_group, []).append(th.cpu)
        by_numa.setdefault(th.numa_node, []).append(th.cpu)

    for th in threads:
        base = cpu_dir / f"cpu{th.cpu}"
        if th.cpu not in online:
            # The kernel drops topology/ and cache/ for an offline CPU; "online" reads 0.
            _write(base / "online", "0")
            continue
        _write(base / "online", "1")
        topo = base / "topology"
        _write(topo / "physical_package_id", str(th.socket))
        _write(topo / "core_id", str(th.core_id))
        if spec.write_die_id:
            _write(topo / "die_id", str(th.die))
        siblings = CPUSet(by_core[th.core_index]) & online
        _write(topo / "thread_siblings_list", str(siblings))
        _write(topo / "core_siblings_list", str(CPUSet(by_socket[th.socket]) & online))
        if spec.write_cache:
            # The kernel lists offline CPUs in shared_cpu_list too; discovery must drop them.
            core = str(CPUSet(by_core[th.core_index]))
            for index, (level, kind, shared) in enumerate(
                (
                    (1, "Data", core),
                    (1, "Instruction", core),
                    (2, "Unified", core),
                    (3, "Unified", str(CPUSet(by_l3[th.l3_group]))),
                )
            ):
                cache = base / "cache" / f"index{index}"
                _write(cache / "level", str(level))
                _write(cache / "type", kind)
                _write(cache / "shared_cpu_list", shared)
                _write(cache / "id", str(th.l3_group if level == 3 else th.core_index))

    if spec.write_numa:
        node_dir = root / "devices" / "system" / "node"
        memory_nodes = spec.memory_nodes()
        for node in memory_nodes:
            # A node of offline CPUs only, or of none, lists none ("\n", as the kernel writes).
            _write(
                node_dir / f"node{node}" / "cpulist", str(CPUSet(by_numa.get(node, ())) & online)
            )
        _write(node_dir / "online", str(memory_nodes))
        if spec.write_has_memory:
            _write(node_dir / "has_memory", str(memory_nodes))
    return root


# -- fixture machines ------------------------------------------------------------------------

# The seeds' node: 2 x Xeon E5-2680 v3, 12 cores each, HT; siblings n and n+24; a NUMA node
# per socket; core ids 0-5,8-13 in each socket, skipping 6-7 as the real part does.
XEON_E5_2680_V3_X2 = MachineSpec(
    name="xeon-e5-2680v3-x2",
    sockets=2,
    cores_per_die=12,
    threads_per_core=2,
    core_ids=(0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13),
)

SINGLE_SOCKET_NO_HT = MachineSpec(name="single-socket-no-ht", sockets=1, cores_per_die=8)

# Sub-NUMA clustering: 2 sockets, 2 NUMA nodes each, 10 cores per socket, HT.
TWO_SOCKET_FOUR_NUMA = MachineSpec(
    name="two-socket-four-numa",
    sockets=2,
    cores_per_die=10,
    threads_per_core=2,
    numa_per_socket=2,
)

# An EPYC-like part: 2 sockets, 8 CCXs (L3 groups) of 4 cores each per socket, SMT with
# consecutive sibling ids, so each L3 group is 8 consecutive CPU ids.
AMD_EPYC_LIKE = MachineSpec(
    name="amd-epyc-like",
    sockets=2,
    cores_per_die=32,
    threads_per_core=2,
    sibling_numbering="amd",
    l3_per_die=8,
)

# Gaps in the id space (ids 0-7 and 16-23) and two CPUs offline (one a sibling of a live one).
OFFLINE_NONCONTIGUOUS = MachineSpec(
    name="offline-noncontiguous",
    sockets=2,
    cores_per_die=4,
    threads_per_core=2,
    cpu_ids=(*range(8), *range(16, 24)),
    offline=frozenset({5, 23}),
    isolated=frozenset({7, 22}),
)


# -- hypothesis profiles for the pure-core property tests -----------------------------------
# "core-fast" keeps the unit suite quick on 2 cores; CPUSHIM_HYPOTHESIS_PROFILE=core-thorough
# runs many more examples (nightly, or after touching the allocator).
settings.register_profile("core-fast", max_examples=60, deadline=None)
settings.register_profile("core-thorough", max_examples=2000, deadline=None)
PROPERTY_SETTINGS = settings(
    parent=settings.get_profile(os.environ.get("CPUSHIM_HYPOTHESIS_PROFILE", "core-fast")),
    suppress_health_check=[HealthCheck.too_slow],
)
