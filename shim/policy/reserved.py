"""Which CPUs are reserved for the system (kubelet's ``reservedSystemCPUs`` or a count derived
from kube-reserved + system-reserved)."""

from __future__ import annotations

from shim.cpuset import CPUSet
from shim.policy.options import StaticPolicyOptions
from shim.policy.take import take_by_topology, take_distributed
from shim.topology import Topology

__all__ = ["ReservedCPUsError", "reserved_cpus"]


class ReservedCPUsError(ValueError):
    """The reservation is empty, names CPUs that are not online, takes every CPU, or cannot
    be met."""


def reserved_cpus(
    topology: Topology,
    *,
    cpus: CPUSet | None = None,
    count: int | None = None,
    options: StaticPolicyOptions | None = None,
) -> CPUSet:
    """The reserved set, from an explicit list or from a count; give exactly one.

    A count is taken from the lowest-numbered physical cores, whole cores first: cores in the
    order of their lowest CPU id (within the socket and NUMA node of the lowest one first),
    each taken whole while it fits, then single threads of the next cores. Operators expect
    the system's CPUs at the bottom of the map (CPU 0 and its siblings), even where a best fit
    would pick an emptier socket. Isolated CPUs are left out when the rest can cover the
    count: reserved CPUs run system daemons, and isolated CPUs are kept for exclusive use.
    Under distribute-cpus-across-cores or distribute-cpus-across-numa the count is taken as
    kubelet takes it, with that option's allocator.
    """
    if (cpus is None) == (count is None):
        raise ReservedCPUsError("give either an explicit reserved CPU list or a count, not both")
    if cpus is not None:
        offline = cpus - topology.online
        if offline:
            raise ReservedCPUsError(
                f"reserved CPUs {offline} are not online (online: {topology.online})"
            )
        if not cpus:
            raise ReservedCPUsError("the static policy needs at least one reserved CPU")
        if cpus == topology.online:
            # As for a count: nothing could ever be pinned, and a list is more often a typo
            # (0-63 for 0-3) than a wish.
            raise ReservedCPUsError(
                f"reserved CPUs {cpus} are every online CPU: at least one must stay for workloads"
            )
        return cpus
    assert count is not None
    if count < 1:
        raise ReservedCPUsError(f"the static policy needs at least one reserved CPU, got {count}")
    if count >= len(topology.online):
        raise ReservedCPUsError(
            f"cannot reserve {count} CPUs: only {len(topology.online)} online and at least one"
            " must stay for workloads"
        )
    housekeeping = topology.online - topology.isolated
    pool = housekeeping if len(housekeeping) >= count else topology.online
    if options is not None and options.distribute_cpus_across_cores:
        spread = StaticPolicyOptions(distribute_cpus_across_cores=True)
        return take_by_topology(topology, pool, count, options=spread)
    if options is not None and options.distribute_cpus_across_numa:
        # kubelet takes the count with the policy's takeByTopology, which under this option
        # spreads it over NUMA nodes (in whole cores under full-pcpus-only): a count larger
        # than a node is shared out, not a whole node and a bit of the next.
        return take_distributed(topology, pool, count, options)
    return lowest_cores_first(topology, pool, count)


def lowest_cores_first(topology: Topology, pool: CPUSet, count: int) -> CPUSet:
    """``count`` CPUs of ``pool``: whole cores first, then single threads of the next cores
    (lowest first). Sockets, the NUMA nodes in them and the cores in those are each taken in
    the order of their lowest CPU id, so the set stays on the socket of CPU 0 while it can,
    where CPU ids alternate between sockets (0, 2, 4 on one and 1, 3, 5 on the other) too,
    as kubelet's takeByTopology keeps it."""

    def lowest(cpus: CPUSet) -> int:
        return cpus.first() if cpus else -1

    def place(core: CPUSet) -> tuple[int, int, int]:
        info = topology.info(core.first())
        socket = lowest(topology.cpus_in_socket(info.socket) & pool)
        node = lowest(topology.cpus_in_numa_node(info.numa_node) & pool)
        return socket, node, core.first()

    cores = sorted(
        (cpus for cpus in (topology.cpus_in_core(core) & pool for core in topology.cores) if cpus),
        key=place,
    )
    taken = CPUSet()
    for core in cores:
        if len(taken) + len(core) > count:
            break  # the remainder comes from this core's threads on
        taken |= core
    for core in cores:
        if len(taken) >= count:
            break
        free = core - taken
        taken |= free.take_lowest(min(len(free), count - len(taken)))
    return taken
