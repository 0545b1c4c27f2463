"""The static policy's options, with kubelet's names (``cpuManagerPolicyOptions``) and rules."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from shim.topology import Topology

__all__ = [
    "ALIGN_BY_SOCKET",
    "DISTRIBUTE_CPUS_ACROSS_CORES",
    "DISTRIBUTE_CPUS_ACROSS_NUMA",
    "FULL_PCPUS_ONLY",
    "OPTION_NAMES",
    "PREFER_ALIGN_CPUS_BY_UNCORECACHE",
    "STRICT_CPU_RESERVATION",
    "OptionsError",
    "StaticPolicyOptions",
]

FULL_PCPUS_ONLY: Final = "full-pcpus-only"
DISTRIBUTE_CPUS_ACROSS_NUMA: Final = "distribute-cpus-across-numa"
ALIGN_BY_SOCKET: Final = "align-by-socket"
DISTRIBUTE_CPUS_ACROSS_CORES: Final = "distribute-cpus-across-cores"
STRICT_CPU_RESERVATION: Final = "strict-cpu-reservation"
PREFER_ALIGN_CPUS_BY_UNCORECACHE: Final = "prefer-align-cpus-by-uncorecache"

# Option name -> StaticPolicyOptions attribute.
OPTION_NAMES: Final[Mapping[str, str]] = {
    FULL_PCPUS_ONLY: "full_pcpus_only",
    DISTRIBUTE_CPUS_ACROSS_NUMA: "distribute_cpus_across_numa",
    ALIGN_BY_SOCKET: "align_by_socket",
    DISTRIBUTE_CPUS_ACROSS_CORES: "distribute_cpus_across_cores",
    STRICT_CPU_RESERVATION: "strict_cpu_reservation",
    PREFER_ALIGN_CPUS_BY_UNCORECACHE: "prefer_align_cpus_by_uncorecache",
}

# Pairs kubelet refuses to combine (policy_options.go, NewStaticPolicyOptions).
_EXCLUSIVE_PAIRS: Final = (
    (FULL_PCPUS_ONLY, DISTRIBUTE_CPUS_ACROSS_CORES),
    (DISTRIBUTE_CPUS_ACROSS_NUMA, DISTRIBUTE_CPUS_ACROSS_CORES),
    (PREFER_ALIGN_CPUS_BY_UNCORECACHE, DISTRIBUTE_CPUS_ACROSS_CORES),
    (PREFER_ALIGN_CPUS_BY_UNCORECACHE, DISTRIBUTE_CPUS_ACROSS_NUMA),
)

# Go's strconv.ParseBool, which kubelet uses for option values.
_TRUE: Final = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_FALSE: Final = frozenset({"0", "f", "F", "false", "FALSE", "False"})


class OptionsError(ValueError):
    """An unknown option, a bad value, or a combination kubelet rejects."""


@dataclass(frozen=True, slots=True)
class StaticPolicyOptions:
    """Which options are on. Construction checks the combinations kubelet refuses."""

    # Exclusive requests must be whole physical cores (a multiple of the SMT level).
    full_pcpus_only: bool = False
    # Requests larger than a NUMA node are spread evenly over the fewest NUMA nodes.
    distribute_cpus_across_numa: bool = False
    # A NUMA affinity hint is widened to the whole sockets it touches.
    align_by_socket: bool = False
    # Single threads are spread one per core before a core's second thread is used.
    distribute_cpus_across_cores: bool = False
    # Reserved CPUs are kept out of the shared pool too (only system daemons run there).
    strict_cpu_reservation: bool = False
    # Best effort: a request is packed into as few uncore-cache groups as possible.
    prefer_align_cpus_by_uncorecache: bool = False

    def __post_init__(self) -> None:
        enabled = self.enabled
        for first, second in _EXCLUSIVE_PAIRS:
            if first in enabled and second in enabled:
                raise OptionsError(
                    f"static policy options {first} and {second} can not be used at the same time"
                )

    @property
    def enabled(self) -> frozenset[str]:
        """The names of the options that are on."""
        return frozenset(name for name, attr in OPTION_NAMES.items() if getattr(self, attr))

    @classmethod
    def parse(cls, options: Iterable[str] | Mapping[str, str]) -> StaticPolicyOptions:
        """From a list of option names (each one switched on), or from kubelet's map form
        ``{"full-pcpus-only": "true"}`` whose values follow Go's ParseBool."""
        values: dict[str, bool] = {}
        items: Iterable[tuple[str, str]]
        if isinstance(options, Mapping):
            items = options.items()
        else:
            items = ((name, "true") for name in options)
        for name, raw in items:
            attr = OPTION_NAMES.get(name)
            if attr is None:
                valid = ", ".join(OPTION_NAMES)
                raise OptionsError(f"unknown CPU manager policy option {name!r}; valid: {valid}")
            if raw in _TRUE:
                values[attr] = True
            elif raw in _FALSE:
                values[attr] = False
            else:
                raise OptionsError(f"bad value {raw!r} for option {name!r}: want true or false")
        return cls(**values)

    def check_topology(self, topology: Topology, topology_manager_policy: str = "none") -> None:
        """Refuse what kubelet's ValidateStaticPolicyOptions refuses for this machine."""
        if not self.align_by_socket:
            return
        if topology_manager_policy == "single-numa-node":
            raise OptionsError(
                f"topology manager policy single-numa-node is incompatible with {ALIGN_BY_SOCKET}"
            )
        if topology.num_sockets > topology.num_numa_nodes:
            raise OptionsError(
                f"{ALIGN_BY_SOCKET} needs at least as many NUMA nodes as sockets; this machine"
                f" has {topology.num_sockets} sockets and {topology.num_numa_nodes} NUMA nodes"
            )

    def __str__(self) -> str:
        return ",".join(sorted(self.enabled)) or "(none)"
