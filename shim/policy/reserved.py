"""Which CPUs are reserved for the system (kubelet's ``reservedSystemCPUs`` or a count derived
from kube-reserved + system-reserved)."""

from __future__ import annotations

from shim.cpuset import CPUSet
from shim.policy.take import AllocationError, take_by_topology
from shim.topology import Topology

__all__ = ["ReservedCPUsError", "reserved_cpus"]


class ReservedCPUsError(ValueError):
    """The reservation is empty, names CPUs that are not online, or cannot be met."""


def reserved_cpus(
    topology: Topology, *, cpus: CPUSet | None = None, count: int | None = None
) -> CPUSet:
    """The reserved set, from an explicit list or from a count; give exactly one.

    A count is taken the way kubelet takes it, by topology-aware best fit over all online
    CPUs, which yields whole cores from the lowest-numbered socket first. Isolated CPUs are
    left out when the rest can cover the count: reserved CPUs run system daemons, and isolated
    CPUs are kept for exclusive use.
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
    try:
        return take_by_topology(topology, pool, count)
    except AllocationError as exc:  # pragma: no cover - the size checks above rule it out
        raise ReservedCPUsError(str(exc)) from exc
