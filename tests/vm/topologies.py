"""The machines the VM tests emulate: what QEMU is told, and what the guest must then see.

QEMU numbers vCPUs socket by socket, core by core, thread by thread (``-smp`` order), and the
guest kernel takes that order from the ACPI tables, so CPU ``i`` of a guest sits on socket
``i // (cores * threads)``, core ``(i // threads) % cores`` of that socket. NUMA nodes split
each socket into equal runs of whole cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from shim.cpuset import CPUSet
from tests.harness.containerd import CgroupDriver


@dataclass(frozen=True, slots=True)
class Topology:
    """One emulated machine. ``reserved`` is what cpushim runs with (``--reserved-cpus``)."""

    name: str
    description: str
    sockets: int
    cores_per_socket: int
    threads_per_core: int
    numa_nodes_per_socket: int
    reserved: CPUSet
    memory_mib_per_node: int = 768
    # The guest mounts cgroup v1 hierarchies (as the CI host has) or the v2 unified one (as
    # most production nodes have).
    cgroup_version: int = 1
    # How containerd and the kubelet-shaped client name cgroups: "cgroupfs" (paths; the guest's
    # init is a shell script) or "systemd" (slices and scopes; systemd is the guest's PID 1
    # and mounts the hierarchy itself, as on most production nodes).
    cgroup_driver: CgroupDriver = "cgroupfs"

    def __post_init__(self) -> None:
        if self.cores_per_socket % self.numa_nodes_per_socket:
            raise ValueError(f"{self.name}: NUMA nodes must split a socket into whole cores")
        if self.cgroup_version not in (1, 2):
            raise ValueError(f"{self.name}: cgroup version {self.cgroup_version} is not 1 or 2")
        if self.cgroup_driver not in get_args(CgroupDriver):
            raise ValueError(f"{self.name}: cgroup driver {self.cgroup_driver!r} is unknown")

    @property
    def cpu_count(self) -> int:
        return self.sockets * self.cores_per_socket * self.threads_per_core

    @property
    def numa_node_count(self) -> int:
        return self.sockets * self.numa_nodes_per_socket

    @property
    def smt(self) -> bool:
        return self.threads_per_core > 1

    @property
    def cpus(self) -> CPUSet:
        return CPUSet(range(self.cpu_count))

    def socket_of(self, cpu: int) -> int:
        return cpu // (self.cores_per_socket * self.threads_per_core)

    def core_of(self, cpu: int) -> int:
        """A machine-wide core index (socket-major)."""
        return cpu // self.threads_per_core

    def numa_node_of(self, cpu: int) -> int:
        cores_per_node = self.cores_per_socket // self.numa_nodes_per_socket
        core_in_socket = self.core_of(cpu) % self.cores_per_socket
        return self.socket_of(cpu) * self.numa_nodes_per_socket + core_in_socket // cores_per_node

    def socket_cpus(self, socket: int) -> CPUSet:
        return CPUSet(cpu for cpu in range(self.cpu_count) if self.socket_of(cpu) == socket)

    def numa_node_cpus(self, node: int) -> CPUSet:
        return CPUSet(cpu for cpu in range(self.cpu_count) if self.numa_node_of(cpu) == node)

    def core_cpus(self, core: int) -> CPUSet:
        return CPUSet(cpu for cpu in range(self.cpu_count) if self.core_of(cpu) == core)

    @property
    def cpus_per_socket(self) -> int:
        return self.cores_per_socket * self.threads_per_core

    @property
    def cpus_per_numa_node(self) -> int:
        return self.cpus_per_socket // self.numa_nodes_per_socket

    def qemu_arguments(self) -> list[str]:
        """``-smp``, ``-cpu`` and one ``-numa node`` (with its own RAM) per node."""
        arguments = [
            # With TCG the default vCPU model is AMD-flavoured and the guest then sees no
            # SMT siblings; an Intel vendor string makes it read the thread topology.
            "-cpu",
            "max,vendor=GenuineIntel",
            "-smp",
            f"{self.cpu_count},sockets={self.sockets},cores={self.cores_per_socket},"
            f"threads={self.threads_per_core}",
            "-m",
            f"{self.memory_mib_per_node * self.numa_node_count}M",
        ]
        for node in range(self.numa_node_count):
            cpus = self.numa_node_cpus(node)
            arguments += [
                "-object",
                f"memory-backend-ram,id=ram{node},size={self.memory_mib_per_node}M",
                "-numa",
                f"node,nodeid={node},cpus={cpus.min()}-{cpus.max()},memdev=ram{node}",
            ]
        return arguments

    def to_json(self) -> dict[str, object]:
        """What the guest reads back (tests/vm/guest_scenarios.py): the same fields."""
        return {
            "name": self.name,
            "description": self.description,
            "sockets": self.sockets,
            "cores_per_socket": self.cores_per_socket,
            "threads_per_core": self.threads_per_core,
            "numa_nodes_per_socket": self.numa_nodes_per_socket,
            "reserved": str(self.reserved),
            "memory_mib_per_node": self.memory_mib_per_node,
            "cgroup_version": self.cgroup_version,
            "cgroup_driver": self.cgroup_driver,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Topology:
        return cls(
            name=str(data["name"]),
            description=str(data["description"]),
            sockets=int(str(data["sockets"])),
            cores_per_socket=int(str(data["cores_per_socket"])),
            threads_per_core=int(str(data["threads_per_core"])),
            numa_nodes_per_socket=int(str(data["numa_nodes_per_socket"])),
            reserved=CPUSet.parse(str(data["reserved"])),
            memory_mib_per_node=int(str(data["memory_mib_per_node"])),
            cgroup_version=int(str(data["cgroup_version"])),
            cgroup_driver=cgroup_driver(str(data["cgroup_driver"])),
        )


def cgroup_driver(name: str) -> CgroupDriver:
    if name == "systemd":
        return "systemd"
    if name == "cgroupfs":
        return "cgroupfs"
    raise ValueError(f"cgroup driver {name!r} is unknown")


TOPOLOGIES: dict[str, Topology] = {
    topology.name: topology
    for topology in (
        Topology(
            name="xeon-2s",
            description="2 sockets x 4 cores x 2 threads, one NUMA node per socket",
            sockets=2,
            cores_per_socket=4,
            threads_per_core=2,
            numa_nodes_per_socket=1,
            # kubelet's usual reservation on SMT: one whole core.
            reserved=CPUSet.parse("0-1"),
        ),
        Topology(
            name="flat-8",
            description="1 socket x 8 cores, no SMT, one NUMA node, cgroup v2 with the systemd"
            " driver",
            sockets=1,
            cores_per_socket=8,
            threads_per_core=1,
            numa_nodes_per_socket=1,
            reserved=CPUSet.parse("0"),
            cgroup_version=2,
            # No more than 8 CPUs: Debian bookworm's runc (1.1.5) hands systemd AllowedCPUs
            # with its bytes reversed, so a set reaching past CPU 7 is recorded wrong and
            # systemd writes the wrong set whenever it applies the unit (docs/testing.md).
            cgroup_driver="systemd",
        ),
        Topology(
            name="snc-2s",
            description="2 sockets x 4 cores x 2 threads, two NUMA nodes per socket"
            " (sub-NUMA clustering)",
            sockets=2,
            cores_per_socket=4,
            threads_per_core=2,
            numa_nodes_per_socket=2,
            reserved=CPUSet.parse("0-1"),
            memory_mib_per_node=512,
        ),
    )
}
