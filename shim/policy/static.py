"""The static policy: exclusive CPUs for integer-CPU containers of Guaranteed pods, a shared
pool for everyone else. Pure: every method takes the current assignments and returns a value.

CPU classes, for a policy with reserved set R on a topology with online set O and isolated
set I (the kernel's ``isolcpus``):

* exclusive candidates: O - R. Isolated CPUs are candidates only when a request asks for them.
* shareable: O - I, minus R under strict-cpu-reservation. The shared pool is the shareable
  CPUs that no container holds exclusively; it is never allowed to become empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from shim.cpuset import CPUSet
from shim.policy.options import StaticPolicyOptions
from shim.policy.reserved import reserved_cpus
from shim.policy.take import AllocationError, SMTAlignmentError, take_by_topology
from shim.topology import Topology

__all__ = [
    "AllocationError",
    "ExclusiveRequest",
    "IsolatedMode",
    "SMTAlignmentError",
    "StaticPolicy",
    "take_by_topology",
]

IsolatedMode = Literal["avoid", "prefer", "require"]


@dataclass(frozen=True, slots=True)
class ExclusiveRequest:
    """What one container asks for.

    ``isolated`` says how the kernel's isolated CPUs may be used:

    * ``"avoid"`` (default): never; isolated CPUs are handed out only to containers that ask.
    * ``"prefer"``: all from isolated CPUs when enough of them are free, otherwise as
      ``"avoid"``. A set is never part isolated, part not: the two halves would be scheduled
      differently (no load balancing on isolated CPUs).
    * ``"require"``: only isolated CPUs; AllocationError when too few are free.

    ``numa_affinity`` is a topology hint (NUMA node ids): as many CPUs as possible come from
    those nodes (under align-by-socket: from the whole sockets holding them), the rest from
    anywhere, as kubelet does with the topology manager's hint.
    """

    count: int
    isolated: IsolatedMode = "avoid"
    numa_affinity: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"an exclusive request needs at least one CPU, got {self.count}")
        if self.isolated not in ("avoid", "prefer", "require"):
            raise ValueError(f"isolated must be avoid, prefer or require, not {self.isolated!r}")


# Stands for a resized container's own CPUs among the others' (StaticPolicy.resize).
_HELD: Any = object()


def _union(assignments: Mapping[Any, CPUSet]) -> int:
    mask = 0
    for cpus in assignments.values():
        mask |= cpus.mask
    return mask


@dataclass(frozen=True)
class StaticPolicy:
    """Topology, reserved CPUs and options; decisions are pure functions of assignments
    (any mapping whose values are the CPUSets already held exclusively)."""

    name: ClassVar[str] = "static"
    topology: Topology
    reserved: CPUSet
    options: StaticPolicyOptions = field(default_factory=StaticPolicyOptions)
    topology_manager_policy: str = "none"

    def __post_init__(self) -> None:
        # Goes through reserved_cpus for its checks: non-empty, online.
        reserved_cpus(self.topology, cpus=self.reserved)
        self.options.check_topology(self.topology, self.topology_manager_policy)
        if not self.shareable:
            raise ValueError(
                "no CPU is left for the shared pool: every online CPU is isolated"
                + (
                    " or reserved (strict-cpu-reservation)"
                    if self.options.strict_cpu_reservation
                    else ""
                )
            )

    @classmethod
    def create(
        cls,
        topology: Topology,
        *,
        reserved: CPUSet | None = None,
        reserved_count: int | None = None,
        options: StaticPolicyOptions | None = None,
        topology_manager_policy: str = "none",
    ) -> StaticPolicy:
        """A policy with the reserved set given explicitly or taken by count."""
        options = options or StaticPolicyOptions()
        return cls(
            topology=topology,
            reserved=reserved_cpus(topology, cpus=reserved, count=reserved_count, options=options),
            options=options,
            topology_manager_policy=topology_manager_policy,
        )

    @property
    def option_names(self) -> frozenset[str]:
        return self.options.enabled

    @property
    def shareable(self) -> CPUSet:
        """The CPUs shared containers run on while nobody holds them exclusively."""
        shareable = self.topology.online - self.topology.isolated
        if self.options.strict_cpu_reservation:
            shareable -= self.reserved
        return shareable

    @property
    def exclusive_candidates(self) -> CPUSet:
        return self.topology.online - self.reserved

    def shared_pool(self, assignments: Mapping[Any, CPUSet]) -> CPUSet:
        return CPUSet.from_mask(self.shareable.mask & ~_union(assignments))

    def free_cpus(self, assignments: Mapping[Any, CPUSet]) -> CPUSet:
        """Exclusive candidates nobody holds, isolated ones included."""
        return CPUSet.from_mask(self.exclusive_candidates.mask & ~_union(assignments))

    def allocate(
        self, assignments: Mapping[Any, CPUSet], request: ExclusiveRequest | int
    ) -> CPUSet:
        """The CPUs for a new exclusive request; AllocationError when it cannot be met."""
        if isinstance(request, int):
            request = ExclusiveRequest(request)
        held = _union(assignments)
        if held & self.reserved.mask:
            overlap = CPUSet.from_mask(held & self.reserved.mask)
            raise ValueError(f"assignments hold reserved CPUs {overlap}: the state is corrupt")
        free = self.free_cpus(assignments)
        isolated_free = free & self.topology.isolated
        plain_free = free - self.topology.isolated
        # Each pool is tried in turn; the label names it in the error when it is not the only one.
        pools: list[tuple[str, CPUSet]] = {
            "avoid": [("", plain_free)],
            "prefer": [("isolated", isolated_free), ("", plain_free)],
            "require": [("isolated", isolated_free)],
        }[request.isolated]

        error: AllocationError | None = None
        for label, pool in pools:
            try:
                chosen = self._take(pool, request)
            except SMTAlignmentError as exc:
                error = exc
                continue
            except AllocationError as exc:
                error = AllocationError(f"{label} CPUs: {exc}") if label else exc
                continue
            if not self.shareable.mask & ~(held | chosen.mask):
                error = AllocationError(
                    f"cannot allocate {request.count} CPUs: the shared pool"
                    f" ({self.shared_pool(assignments)}) must keep at least one CPU"
                )
                continue
            return chosen
        assert error is not None
        raise error

    def refusal(
        self, assignments: Mapping[Any, CPUSet], request: ExclusiveRequest, cpus: CPUSet
    ) -> str | None:
        """Why ``cpus``, chosen earlier (a running container's set, a next attempt's old
        one), may not be handed to ``request`` now; None when they may. These are the rules
        every choice meets; the preferences a new choice follows (the NUMA hint, spreading,
        caches) are not asked of a set that is already in use."""
        if len(cpus) != request.count:
            return f"{len(cpus)} CPUs ({cpus or 'none'}) for a request of {request.count}"
        if cpus & self.reserved:
            return f"{cpus} holds reserved CPUs {cpus & self.reserved}"
        if not cpus.issubset(self.exclusive_candidates):
            return f"{cpus} holds CPUs that are not online: {cpus - self.exclusive_candidates}"
        held = _union(assignments)
        if cpus.mask & held:
            taken = CPUSet.from_mask(cpus.mask & held)
            return f"{cpus} holds CPUs another container holds: {taken}"
        isolated = cpus & self.topology.isolated
        if request.isolated == "avoid" and isolated:
            return f"{cpus} holds isolated CPUs {isolated}, which the container did not ask for"
        if request.isolated == "require" and isolated != cpus:
            return f"{cpus} holds CPUs that are not isolated, and the container requires them"
        if request.isolated == "prefer" and isolated and isolated != cpus:
            return f"{cpus} is part isolated, part not"
        if self.options.full_pcpus_only and (
            request.count % self.topology.cpus_per_core
            or self.topology.whole_cores_in(cpus) != cpus
        ):
            # The count too: a core whose sibling is offline is whole with one thread.
            return f"{cpus} is not whole physical cores (full-pcpus-only)"
        if not self.shareable.mask & ~(held | cpus.mask):
            return f"{cpus} would leave the shared pool without a CPU"
        return None

    def resize(
        self, assignments: Mapping[Any, CPUSet], request: ExclusiveRequest, held: CPUSet
    ) -> CPUSet:
        """The CPUs for a running container that holds ``held`` and is resized in place to
        ``request`` (``assignments``: the other containers'); AllocationError when it cannot
        have them.

        The container keeps what it can, since its threads run there: a smaller count keeps
        the CPUs the policy would choose among its own, a larger one keeps all of them and
        adds the free threads of its cores, then free CPUs from its NUMA nodes (or from the
        nodes kubelet's hint names).
        When the kept set would break a rule a new choice keeps (``refusal``: isolated and
        plain CPUs mixed, a core split under full-pcpus-only), the whole set is chosen again
        as for a new container, with its old CPUs free for it."""
        kept: CPUSet | None = None
        if not held:
            return self.allocate(assignments, request)
        if request.count == len(held):
            kept = held
        elif request.count < len(held):
            with suppress(AllocationError):
                kept = self._take(held, request)
        else:
            kept = self._grow(assignments, request, held)
        if kept is not None and self.refusal(assignments, request, kept) is None:
            return kept
        return self.allocate(assignments, request)

    def _grow(
        self, assignments: Mapping[Any, CPUSet], request: ExclusiveRequest, held: CPUSet
    ) -> CPUSet | None:
        """``held`` and the CPUs added to it for ``request``; None when there are too few.
        The free threads of its own cores come first, as packing fills a used core first
        (not when spreading over cores), then CPUs from its NUMA nodes."""
        kept = held
        if not self.options.distribute_cpus_across_cores:
            free = self.free_cpus({**assignments, _HELD: held})
            isolated = self.topology.isolated
            alike = free & isolated if held.issubset(isolated) else free - isolated
            mask = 0
            for core in self.topology.core_masks.values():
                if core & held.mask:
                    mask |= core
            kept |= CPUSet(sorted(alike & CPUSet.from_mask(mask))[: request.count - len(held)])
        if len(kept) == request.count:
            return kept
        added = replace(
            request,
            count=request.count - len(kept),
            numa_affinity=request.numa_affinity or self.topology.numa_nodes_of(held),
        )
        try:
            return kept | self.allocate({**assignments, _HELD: kept}, added)
        except AllocationError:
            return None

    def _take(self, pool: CPUSet, request: ExclusiveRequest) -> CPUSet:
        count, options, topology = request.count, self.options, self.topology
        if request.numa_affinity is None:
            return take_by_topology(topology, pool, count, options=options)
        hinted = 0
        for node in request.numa_affinity:
            hinted |= topology.numa_masks.get(node, 0)
        if options.align_by_socket:
            for mask in topology.socket_masks.values():
                if mask & hinted:
                    hinted |= mask
        aligned = pool & CPUSet.from_mask(hinted)
        if options.full_pcpus_only:
            aligned = topology.whole_cores_in(aligned)
        share = min(count, len(aligned))
        if options.full_pcpus_only:
            share -= share % topology.cpus_per_core
        first = take_by_topology(topology, aligned, share, options=options)
        rest = take_by_topology(topology, pool - first, count - share, options=options)
        return first | rest
