"""What the engine knows of each container whose cpuset it writes."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from pathlib import Path

from shim.child_cpusets import Memory
from shim.cpuset import CPUSet
from shim.state import ContainerKey


class Phase(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    EXITED = "exited"


@dataclass(eq=False)
class Tracked:
    """A container the engine writes the cpuset of."""

    id: str
    key: ContainerKey
    sandbox_id: str
    # Created or adopted to hold exclusive CPUs, and so carrying their settings (the memory
    # nodes of those CPUs, no CFS quota unless kept) until a move gives it kubelet's back.
    exclusive: bool
    keep_quota: bool
    phase: Phase
    # The cpuset last written, to the cgroup or through the runtime; None when unknown.
    applied: CPUSet | None
    # Kubelet's attempt number of this container (its restarts in the pod).
    attempt: int = 0
    # The CFS quota kubelet gave it (0: none), restored when it loses its exclusive CPUs.
    kubelet_quota: int = 0
    # The NUMA nodes kubelet's memory manager gave it, when cpushim knows them: restored,
    # instead of every node, when it loses its exclusive CPUs.
    kubelet_mems: CPUSet | None = None
    # The NUMA nodes its cgroup keeps while it shares (cpushim leaves them as they are), for
    # its projection: kubelet's memory manager's from its create, the runtime's record or the
    # checkpoint (when that record holds cpushim's), or those given back when it lost
    # exclusive CPUs; None for every node. Those of them that have memory, when memory
    # hotplug took some away (Topology.memory_nodes_within).
    shared_mems: CPUSet | None = None
    # kubelet's memory nodes for it (above, or its assignment's) name a node that has no
    # memory now, and the warning that its memory goes elsewhere was given (by this run of
    # cpushim: start-up tells it again); cleared once they all have memory again, so that
    # another loss is told again.
    mems_narrowed: bool = False
    # Its pod's namespace/name ("" when unknown), for the logs: operators know pods by it.
    pod: str = ""
    # The container's cgroup directory, once located (after start).
    cgroup: Path | None = None
    # Its pod's cgroup parent (from the sandbox config), where the runtime puts its cgroup.
    cgroup_parent: str = ""
    # The cpuset the runtime's own record holds (its spec), when known: a cgroup written
    # directly is told to the runtime afterwards.
    recorded: CPUSet | None = None
    # The cpuset whose byte-reversed copy (systemd's, from an unfixed runc) was last written
    # back with the runtime told again; a repeat of that reversal is only written back.
    reversal_recorded: CPUSet | None = None
    # The container's first process on this host, as the runtime reports it; 0 when unknown.
    pid: int = 0
    # The count of exclusive CPUs kubelet's resources asked for when this attempt was created
    # or adopted (None: none), whatever it holds now (a new policy may have taken them, or
    # given it none): an update asking for that count again is not a resize.
    cpus_asked: int | None = None
    # The count of exclusive CPUs (0: none) an in-place resize asked for that cpushim did
    # not apply, once logged; None when kubelet's resources match what the container holds
    # or was created asking for.
    resize_noted: int | None = None
    # It asks for all of its pod's CPU and memory (shim/pods.py takes_whole_pod).
    whole_pod: bool = False
    # It asks for some CPU or memory (shim/pods.py has_own_resources): evidence, beside a
    # sibling taking the whole pod, that the pod's resources are pod-level ones.
    own_resources: bool = False
    # Its cgroup holds the cpuset it should but the runtime's record does not carry the
    # memory nodes or quota that go with it: adopted at start-up on the exclusive CPUs it had
    # (kubelet's static policy's), or moved straight in its cgroup past its child cpusets
    # while the runtime refused the rest, or past a call its runtime did not answer; or its
    # memory nodes derive from the machine's, which changed (memory hotplug): a shared
    # container's every node among them. One move through the runtime gives them.
    settings_stale: bool = False
    # It asks for exclusive CPUs, shares, and an adoption found none for it (logged and
    # counted once: adoption is tried again at every full look, and after a release).
    adoption_refused: bool = False
    # Its cgroup (v2) was seen without cpuset.cpus, and the warning given.
    no_cpuset_seen: bool = False
    # The runtime named a cgroup for it, running, that was not there, and the warning given.
    missing_cgroup_seen: bool = False
    # The runtime's description of its cgroup named none or could not be placed, and the
    # warning given.
    unplaceable_cgroup_seen: bool = False
    # The runtime's ContainerStatus answer for it did not decode, and the warning given.
    undecodable_status_seen: bool = False
    # A ContainerStatus call for it failed (an adoption's, while it waits for exclusive
    # CPUs), and the warning given; cleared when any call reads it (status_answered), so a
    # later failing spell is told again.
    failed_status_seen: bool = False
    # The cpuset its cgroup (v1) was left with when CPUs went offline, once warned of.
    offline_seen: CPUSet | None = None
    # Under cgroup v1, what cpushim knows of the cgroups the container made below its own,
    # by file (cpuset.cpus, cpuset.mems): moved with it (shim/child_cpusets.py).
    child_memory: dict[str, Memory] = field(default_factory=dict, repr=False)
    # When cpushim last wrote the cgroup directly (the loop's clock); the runtime is told once
    # the cpuset has stayed put for a while (shim/engine/moves.py).
    moved_at: float = 0.0
    # Held by every write of this container's cpuset (direct or through the runtime), so an
    # older cpuset can never land after a newer one; but for a container whose runtime is
    # stuck (below), which direct writes no longer wait for.
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    # A runtime call about it (an update, a record) went unanswered past its deadline (a hung
    # containerd shim), or has held the write lock longer than a move would wait: its moves
    # are written into its cgroup without waiting for that call, and a call that ends after
    # such a write writes the cgroup again (shim/engine/moves.py). Cleared when a call about
    # it is answered.
    runtime_stuck: bool = False
    # Of those, one whose call went unanswered past its deadline, not only slow: warned of
    # and counted (cpushim_stuck_runtime_containers).
    runtime_hung: bool = False

    @property
    def memory_nodes_chosen(self) -> CPUSet | None:
        """The memory nodes kubelet's memory manager chose for it, as far as cpushim knows
        them (None: none known): those kept from its create or from the exclusive CPUs it
        lost, else those its cgroup keeps while it shares."""
        return self.kubelet_mems if self.kubelet_mems is not None else self.shared_mems

    def status_answered(self) -> None:
        """A ContainerStatus call read its state: an adoption's, the watcher's looking for
        its cgroup, or a create's asking whether it still runs. Whichever it was, the
        runtime answers for it again, so a failing spell is over and a call that fails
        after this is told of anew (``failed_status_seen``)."""
        self.failed_status_seen = False

    def named(self) -> dict[str, str]:
        """The fields a log line names it by: its pod as kubectl shows it, the key the
        checkpoint holds it under, and the runtime's id."""
        return {"pod": self.pod, "container": str(self.key), "container_id": self.id}
