"""The ``none`` policy: no exclusive CPUs; every container shares every online CPU, as with
kubelet's ``cpuManagerPolicy: none``. Switching a node from ``static`` to ``none`` through
cpushim unpins what was pinned, because the engine still writes each container's cpuset."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shim.cpuset import CPUSet
from shim.policy.take import AllocationError
from shim.topology import Topology


@dataclass(frozen=True)
class NonePolicy:
    name: ClassVar[str] = "none"
    topology: Topology
    reserved: CPUSet = field(default_factory=CPUSet)

    @property
    def option_names(self) -> frozenset[str]:
        return frozenset()

    @property
    def exclusive_candidates(self) -> CPUSet:
        return CPUSet()

    def shared_pool(self, assignments: Mapping[Any, CPUSet]) -> CPUSet:
        return self.topology.online

    def allocate(self, assignments: Mapping[Any, CPUSet], request: object) -> CPUSet:
        raise AllocationError("the none policy hands out no exclusive CPUs")

    def resize(self, assignments: Mapping[Any, CPUSet], request: object, held: CPUSet) -> CPUSet:
        raise AllocationError("the none policy hands out no exclusive CPUs")

    def refusal(
        self, assignments: Mapping[Any, CPUSet], request: object, cpus: CPUSet
    ) -> str | None:
        return "the none policy hands out no exclusive CPUs"
