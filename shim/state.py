"""Who holds which CPUs, as the engine records it, and the checkpoint codec. Pure: no I/O.

Only exclusive assignments are recorded: every other container runs on the shared pool, and
which containers those are is learnt again from the runtime on start (kubelet's memory nodes
for those whose runtime record cpushim changed are kept, :class:`KubeletMems`). The shared
pool is kept in the checkpoint anyway, so a reader (``cpushim status``, an operator) needs no
policy arithmetic, and so a checkpoint whose parts disagree is caught.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final, TypeVar

import orjson

from shim.cpuset import CPUSet
from shim.policy import CPUPolicy
from shim.policy.none import NonePolicy
from shim.policy.options import OPTION_NAMES, OptionsError, StaticPolicyOptions
from shim.policy.static import ExclusiveRequest, StaticPolicy
from shim.topology import Topology

__all__ = [
    "CHECKPOINT_VERSION",
    "Assignment",
    "CPUState",
    "CheckpointError",
    "ContainerKey",
    "KubeletMems",
    "UnknownPolicyError",
    "decode_checkpoint",
    "encode_checkpoint",
    "integrity_problems",
    "policy_of",
    "replan",
    "topology_changed",
    "topology_fingerprint",
]

CHECKPOINT_VERSION: Final = 1

_V = TypeVar("_V")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted; the message says what is wrong."""


@dataclass(frozen=True, slots=True, order=True)
class ContainerKey:
    """A container as kubelet names it: stable across restarts of the container."""

    pod_uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.pod_uid}/{self.name}"


@dataclass(frozen=True, slots=True)
class Assignment:
    cpus: CPUSet
    # Empty while the CreateContainer that got these CPUs is on its way to the runtime.
    container_id: str = ""
    sandbox_id: str = ""
    attempt: int = 0
    # "namespace/name", for messages and the status map.
    pod: str = ""
    # The NUMA nodes kubelet's memory manager chose for the container's memory; None: its
    # CPUs' nodes that have memory (Topology.memory_nodes_of).
    mems: CPUSet | None = None


@dataclass(frozen=True, slots=True)
class KubeletMems:
    """The memory nodes kubelet's memory manager chose for a container without exclusive
    CPUs, once cpushim has given it nodes of its own through the runtime (every node with
    memory as they were then, or those of kubelet's that had memory): the runtime's record of
    the container holds those from then on, and would pass them off as kubelet's choice."""

    container_id: str
    # None: kubelet chose none (every node with memory).
    mems: CPUSet | None


def topology_fingerprint(topology: Topology) -> str:
    """Changes when CPUs come or go, move between cores, sockets or NUMA nodes, or change
    isolation; stays the same across reboots of an unchanged machine."""
    rows = [(c.cpu, c.socket, c.die, c.numa_node, c.core_id, c.uncore_cache) for c in topology.cpus]
    body = orjson.dumps({"cpus": sorted(rows), "isolated": str(topology.isolated)})
    return "sha256:" + hashlib.sha256(body).hexdigest()[:32]


@dataclass(frozen=True)
class CPUState:
    policy: str
    options: frozenset[str]
    reserved: CPUSet
    topology: str
    shared: CPUSet
    assignments: Mapping[ContainerKey, Assignment] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # The exclusive CPUs each released container held last: its next attempt gets them back
    # when the policy would hand them out then (they may be anyone's meanwhile). Kept while
    # its pod may still come back with one; in the checkpoint, so a restart keeps them too.
    released: Mapping[ContainerKey, CPUSet] = field(default_factory=lambda: MappingProxyType({}))
    # The UIDs of pods found to have pod-level resources: none of their containers gets
    # exclusive CPUs. In the checkpoint, so a restart that sees fewer of their containers
    # running (one crashed, one completed) keeps them so.
    pod_level: frozenset[str] = frozenset()
    # kubelet's memory nodes of containers without exclusive CPUs whose runtime record holds
    # cpushim's, by pod UID and container name: a restart reads them here, not there. Kept
    # while the pod is there, as released CPUs are.
    kubelet_mems: Mapping[ContainerKey, KubeletMems] = field(
        default_factory=lambda: MappingProxyType({})
    )

    @classmethod
    def empty(cls, policy: CPUPolicy) -> CPUState:
        return cls(
            policy=policy.name,
            options=policy.option_names,
            reserved=policy.reserved,
            topology=topology_fingerprint(policy.topology),
            shared=policy.shared_pool({}),
        )

    def exclusive(self) -> dict[ContainerKey, CPUSet]:
        return {key: a.cpus for key, a in self.assignments.items()}

    def holding(self, container_id: str) -> ContainerKey | None:
        for key, assignment in self.assignments.items():
            if assignment.container_id == container_id:
                return key
        return None

    def _with(self, assignments: dict[ContainerKey, Assignment], policy: CPUPolicy) -> CPUState:
        cpus = {key: a.cpus for key, a in assignments.items()}
        return replace(
            self,
            assignments=MappingProxyType(dict(sorted(assignments.items()))),
            shared=policy.shared_pool(cpus),
        )

    def assign(self, key: ContainerKey, assignment: Assignment, policy: CPUPolicy) -> CPUState:
        assignments = dict(self.assignments)
        assignments[key] = assignment
        state = self._with(assignments, policy)
        if key not in self.released:
            return state
        released = dict(self.released)
        del released[key]
        return replace(state, released=MappingProxyType(released))

    def release(self, keys: Iterable[ContainerKey], policy: CPUPolicy) -> CPUState:
        """These containers' CPUs back to the shared pool, remembered as theirs."""
        assignments = dict(self.assignments)
        released = dict(self.released)
        for key in keys:
            assignment = assignments.pop(key, None)
            if assignment is not None:
                released[key] = assignment.cpus
        state = self._with(assignments, policy)
        return replace(state, released=MappingProxyType(dict(sorted(released.items()))))

    def keep_released(self, pod_uids: Collection[str]) -> CPUState:
        """Without the released CPUs, pod-level marks and kubelet's memory nodes of pods
        other than ``pod_uids`` (pods that are gone)."""
        kept = {key: cpus for key, cpus in self.released.items() if key.pod_uid in pod_uids}
        marked = frozenset(uid for uid in self.pod_level if uid in pod_uids)
        mems = {key: m for key, m in self.kubelet_mems.items() if key.pod_uid in pod_uids}
        unchanged = len(kept) == len(self.released) and len(mems) == len(self.kubelet_mems)
        if unchanged and marked == self.pod_level:
            return self
        return replace(
            self,
            released=MappingProxyType(kept),
            pod_level=marked,
            kubelet_mems=MappingProxyType(mems),
        )

    def with_kubelet_mems(self, key: ContainerKey, mems: KubeletMems | None) -> CPUState:
        """With ``mems`` recorded for the container ``key`` names (its earlier attempt's
        replaced; None: nothing recorded for it)."""
        if self.kubelet_mems.get(key) == mems:
            return self
        recorded = dict(self.kubelet_mems)
        if mems is None:
            del recorded[key]
        else:
            recorded[key] = mems
        return replace(self, kubelet_mems=MappingProxyType(dict(sorted(recorded.items()))))

    def with_pod_level(self, pod_uid: str) -> CPUState:
        """The pod marked as having pod-level resources."""
        return replace(self, pod_level=self.pod_level | {pod_uid})

    def update(self, key: ContainerKey, **changes: Any) -> CPUState:
        """The same CPUs, other bookkeeping (container id, sandbox, attempt)."""
        assignments = dict(self.assignments)
        assignments[key] = replace(assignments[key], **changes)
        return replace(self, assignments=MappingProxyType(assignments))

    def under(self, policy: CPUPolicy) -> CPUState:
        """These assignments under ``policy``'s name, options and reserved set; replan first
        when the policy changed."""
        return replace(
            self,
            policy=policy.name,
            options=policy.option_names,
            reserved=policy.reserved,
            topology=topology_fingerprint(policy.topology),
        )._with(dict(self.assignments), policy)


class UnknownPolicyError(CheckpointError):
    """A checkpoint written under a policy or option this version does not know (a newer
    cpushim's, before a roll back)."""


def policy_of(state: CPUState, topology: Topology) -> CPUPolicy:
    """The policy a checkpoint was written under; CheckpointError if it cannot be rebuilt
    (UnknownPolicyError when this version does not know it)."""
    if state.policy == "none":
        return NonePolicy(topology)
    if state.policy != "static":
        raise UnknownPolicyError(f"unknown policy {state.policy!r}")
    unknown = sorted(name for name in state.options if name not in OPTION_NAMES)
    if unknown:
        raise UnknownPolicyError(f"unknown CPU manager policy options {unknown}")
    try:
        return StaticPolicy(
            topology=topology,
            reserved=state.reserved,
            options=StaticPolicyOptions.parse(sorted(state.options)),
        )
    except (OptionsError, ValueError) as exc:
        raise CheckpointError(f"its policy cannot be rebuilt on this machine: {exc}") from exc


def topology_changed(state: CPUState, topology: Topology) -> bool:
    """Whether ``state`` was written for other CPUs: some went offline or online, were added
    or removed, or isolated (a reboot with another ``isolcpus``). Start-up re-plans such a
    state with the CPUs there are now, as a live change of them does."""
    return state.topology != topology_fingerprint(topology)


def integrity_problems(state: CPUState, topology: Topology) -> list[str]:
    """Everything that makes ``state`` inconsistent in itself or with this machine. One
    written for another topology (:func:`topology_changed`) is checked in itself only:
    which CPUs are online, and what its policy left for the pool, were another machine's."""
    problems: list[str] = []
    changed = topology_changed(state, topology)
    held = CPUSet()
    holders: dict[str, ContainerKey] = {}
    for key, assignment in state.assignments.items():
        cpus = assignment.cpus
        if assignment.container_id:
            other = holders.setdefault(assignment.container_id, key)
            if other != key:
                # One container under two names: releasing it would free only one of them.
                problems.append(
                    f"{key} and {other} name the same container {assignment.container_id}"
                )
        if not cpus:
            problems.append(f"{key} holds no CPUs")
        if not changed and not cpus.issubset(topology.online):
            problems.append(f"{key} holds CPUs {cpus - topology.online} that are not online")
        if cpus & held:
            problems.append(f"{key} holds CPUs {cpus & held} that another container also holds")
        if cpus & state.reserved:
            problems.append(f"{key} holds reserved CPUs {cpus & state.reserved}")
        if assignment.mems is not None and not assignment.mems:
            problems.append(f"{key} has an empty list of memory nodes")
        held |= cpus
    if state.shared & held:
        overlap = state.shared & held
        problems.append(f"the shared pool {state.shared} overlaps exclusive CPUs {overlap}")
    if changed:
        return problems
    try:
        policy = policy_of(state, topology)
    except UnknownPolicyError:
        # A newer version's policy or option: what its shared pool should be is not known
        # here. The configured policy differs from it, so start-up re-plans and computes
        # the pool again; everything checked above holds for any policy.
        return problems
    except CheckpointError as exc:
        problems.append(str(exc))
        return problems
    expected = policy.shared_pool(state.exclusive())
    if not problems and state.shared != expected:
        problems.append(
            f"the shared pool is {state.shared or 'empty'} but its assignments leave {expected}:"
            " shared and exclusive CPUs do not add up to the allocatable CPUs"
        )
    elif not problems and not state.shared:
        problems.append("the shared pool is empty: containers without exclusive CPUs have none")
    return problems


def replan(
    state: CPUState,
    policy: CPUPolicy,
    request_of: Callable[[ContainerKey, Assignment], ExclusiveRequest | None] | None = None,
    *,
    unmovable: Collection[ContainerKey] = (),
) -> tuple[CPUState, list[ContainerKey]]:
    """Keep each assignment that ``policy`` would hand its container now, beside the ones
    kept before it; return the state under ``policy`` and the keys that lost their assignment
    and need a new one. ``request_of`` tells what an assignment's container asks for: its set
    is kept only when the policy finds nothing against it (:meth:`refusal`: online, not
    reserved, isolation, whole cores, the shared pool), the rule a new choice meets. Without
    a request (no ``request_of``, or None: no container to ask for it) it is kept when all
    its CPUs are still exclusive candidates and none is taken by a kept one.

    ``unmovable``: keys whose containers may run on their CPUs and cannot be moved off them
    now (the runtime could not give their state). Their sets are kept that way, without a
    request, ahead of every other (whose refusal then counts them), and are the last to give
    way to an empty shared pool: a container that can be moved gets new CPUs or shares,
    where one that cannot would go on running on CPUs handed to others."""
    kept: dict[ContainerKey, Assignment] = {}
    displaced: list[ContainerKey] = []
    held = CPUSet()
    candidates = policy.exclusive_candidates

    def in_turn(key: ContainerKey) -> tuple[bool, ContainerKey]:
        """The unmovable first, then by key; the last gives way first."""
        return key not in unmovable, key

    for key, assignment in sorted(state.assignments.items(), key=lambda item: in_turn(item[0])):
        cpus = assignment.cpus
        request = None
        if request_of is not None and key not in unmovable:
            request = request_of(key, assignment)
        if request is None:
            keeps = cpus.issubset(candidates) and not cpus & held
        else:
            keeps = policy.refusal({k: a.cpus for k, a in kept.items()}, request, cpus) is None
        if keeps:
            kept[key] = assignment
            held |= cpus
        else:
            displaced.append(key)
    # The shared pool may not end up empty (a new reserved set, strict-cpu-reservation turned
    # on): the last kept assignments give way until it has a CPU.
    while kept and not policy.shared_pool({k: a.cpus for k, a in kept.items()}):
        last = max(kept, key=in_turn)
        del kept[last]
        displaced.append(last)
    planned = replace(state, assignments=MappingProxyType(kept)).under(policy)
    return planned, sorted(displaced)


# --- the checkpoint codec ---------------------------------------------------------------------


def _body(state: CPUState) -> dict[str, Any]:
    body: dict[str, Any] = {
        "policy": state.policy,
        "options": sorted(state.options),
        "reserved": str(state.reserved),
        "topology": state.topology,
        "shared": str(state.shared),
        "assignments": _per_container(state.assignments, _assignment_entry),
    }
    if state.released:
        # Only when there are any, as "mems" of an assignment: earlier versions ignore the
        # key.
        body["released"] = _per_container(state.released, str)
    if state.pod_level:
        # Only when there are any, as above.
        body["podLevelResources"] = sorted(state.pod_level)
    if state.kubelet_mems:
        # Only when there are any, as above. "" for none of kubelet's: every node.
        body["kubeletMems"] = _per_container(
            state.kubelet_mems,
            lambda given: {
                "container_id": given.container_id,
                "mems": "" if given.mems is None else str(given.mems),
            },
        )
    return body


def _assignment_entry(a: Assignment) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "cpus": str(a.cpus),
        "container_id": a.container_id,
        "sandbox_id": a.sandbox_id,
        "attempt": a.attempt,
        "pod": a.pod,
    }
    if a.mems is not None:
        # Only when kubelet chose them: a checkpoint without is what earlier versions wrote
        # and read (they ignore the key, so a rollback keeps working).
        entry["mems"] = str(a.mems)
    return entry


def _per_container(
    entries: Mapping[ContainerKey, _V], encode: Callable[[_V], Any]
) -> dict[str, dict[str, Any]]:
    """``entries`` as a checkpoint object keyed by pod UID, then container name, in key
    order (what :func:`_by_container` reads)."""
    pods: dict[str, dict[str, Any]] = {}
    for key, value in sorted(entries.items()):
        pods.setdefault(key.pod_uid, {})[key.name] = encode(value)
    return pods


def _checksum(body: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def encode_checkpoint(state: CPUState) -> bytes:
    body = _body(state)
    document = {"version": CHECKPOINT_VERSION, "checksum": _checksum(body), "body": body}
    return orjson.dumps(document, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


def decode_checkpoint(data: bytes) -> CPUState:
    """The state in ``data``; CheckpointError naming the first thing that is wrong."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(f"it is not JSON ({exc})") from exc
    if not isinstance(document, dict):
        raise CheckpointError("it is not a JSON object")
    version = document.get("version")
    if type(version) is int and version > CHECKPOINT_VERSION:
        # The usual way here is a roll back to an older cpushim.
        raise CheckpointError(
            f"format version {version} is newer than {CHECKPOINT_VERSION}, the one this"
            " cpushim reads: a newer cpushim wrote it, so run that version again"
        )
    if isinstance(version, bool) or version != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"format version {version!r} is not {CHECKPOINT_VERSION}, the one this cpushim reads"
        )
    body = document.get("body")
    if not isinstance(body, dict):
        raise CheckpointError("it has no body")
    try:
        checksum = _checksum(body)
    except orjson.JSONEncodeError as exc:
        # orjson reads 1024 levels but writes only 255: a body between the two decodes, and
        # is no file cpushim wrote (its own hold objects four deep).
        raise CheckpointError(
            f"its body is nested too deeply to check against its checksum ({exc}): it was edited"
        ) from exc
    if document.get("checksum") != checksum:
        raise CheckpointError("its checksum does not match its body: it was edited or truncated")
    try:
        return _state_of(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"its body is malformed: {type(exc).__name__}: {exc}") from exc


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    return value


def _cpu_list(value: object, what: str) -> CPUSet:
    """A list in the kernel's format, with ``what`` it is in the error."""
    try:
        return CPUSet.parse(_text(value, what))
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from exc


def _by_container(value: object, what: str, of_pod: str) -> Iterator[tuple[ContainerKey, Any]]:
    """Each entry of a checkpoint object keyed by pod UID, then container name."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be an object")
    for pod_uid, containers in value.items():
        if not isinstance(containers, dict):
            raise TypeError(f"{of_pod} of pod {pod_uid} must be an object")
        for name, entry in containers.items():
            yield ContainerKey(pod_uid, name), entry


def _state_of(body: Mapping[str, Any]) -> CPUState:
    assignments: dict[ContainerKey, Assignment] = {}
    for key, entry in _by_container(body["assignments"], "assignments", "assignments"):
        attempt = entry["attempt"]
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise ValueError(f"{key}: attempt must be a non-negative integer")
        mems = entry.get("mems")
        if mems is not None:
            mems = _cpu_list(mems, f"{key} mems")
        assignments[key] = Assignment(
            cpus=CPUSet.parse(_text(entry["cpus"], f"{key} cpus")),
            container_id=_text(entry["container_id"], "container_id"),
            sandbox_id=_text(entry["sandbox_id"], "sandbox_id"),
            attempt=attempt,
            pod=_text(entry.get("pod", ""), "pod"),
            mems=mems,
        )
    released = {
        key: _cpu_list(cpus, f"{key} released")
        for key, cpus in _by_container(body.get("released", {}), "released", "released CPUs")
    }
    options = body["options"]
    if not isinstance(options, list):
        raise TypeError("options must be a list")
    pod_level = body.get("podLevelResources", [])
    if not isinstance(pod_level, list):
        raise TypeError("podLevelResources must be a list")
    kubelet_mems: dict[ContainerKey, KubeletMems] = {}
    for key, entry in _by_container(
        body.get("kubeletMems", {}), "kubeletMems", "kubelet's memory nodes"
    ):
        if not isinstance(entry, dict):
            raise TypeError(f"{key} kubeletMems must be an object")
        mems = _cpu_list(entry["mems"], f"{key} kubeletMems")
        kubelet_mems[key] = KubeletMems(
            container_id=_text(entry["container_id"], f"{key} kubeletMems container_id"),
            mems=mems or None,
        )
    return CPUState(
        policy=_text(body["policy"], "policy"),
        options=frozenset(_text(o, "an option") for o in options),
        reserved=CPUSet.parse(_text(body["reserved"], "reserved")),
        topology=_text(body["topology"], "topology"),
        shared=CPUSet.parse(_text(body["shared"], "shared")),
        assignments=MappingProxyType(dict(sorted(assignments.items()))),
        released=MappingProxyType(dict(sorted(released.items()))),
        pod_level=frozenset(_text(uid, "a pod UID") for uid in pod_level),
        kubelet_mems=MappingProxyType(dict(sorted(kubelet_mems.items()))),
    )
