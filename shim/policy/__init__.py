"""CPU allocation policies. Each is a pure value: decisions are functions of the current
exclusive assignments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from shim.cpuset import CPUSet
from shim.topology import Topology


class CPUPolicy(Protocol):
    """What the engine needs from a policy."""

    @property
    def name(self) -> str: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def reserved(self) -> CPUSet: ...

    @property
    def option_names(self) -> frozenset[str]:
        """The options that are on, by kubelet's names."""
        ...

    @property
    def exclusive_candidates(self) -> CPUSet: ...

    def shared_pool(self, assignments: Mapping[Any, CPUSet]) -> CPUSet: ...

    def allocate(self, assignments: Mapping[Any, CPUSet], request: Any) -> CPUSet: ...

    def resize(self, assignments: Mapping[Any, CPUSet], request: Any, held: CPUSet) -> CPUSet:
        """The CPUs for a running container holding ``held``, resized in place to ``request``;
        AllocationError when it cannot have them."""
        ...

    def refusal(self, assignments: Mapping[Any, CPUSet], request: Any, cpus: CPUSet) -> str | None:
        """Why ``cpus`` may not be handed to ``request`` now; None when they may."""
        ...
