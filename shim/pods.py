"""What cpushim decides about a container before it asks the policy: the pod it belongs to,
whether it gets exclusive CPUs, and what the pod's ``cpushim.io/`` annotations ask for. Pure.

Annotations (pod-level; kubelet passes a pod's annotations in its sandbox config):

* ``cpushim.io/isolated-cpus: prefer|require`` — exclusive CPUs from the kernel's isolated set;
* ``cpushim.io/cfs-quota: keep`` — keep kubelet's CFS quota on exclusive containers (by default
  cpushim removes it: a container alone on its CPUs has nothing to be throttled for, and
  quota throttling adds latency spikes);
* ``cpushim.io/exclusive: "false"`` — no exclusive CPUs for any container of the pod, or
  ``cpushim.io/exclusive.<container-name>: "false"`` for one container.

Any other ``cpushim.io/`` key is ignored; :func:`unknown_annotations` names them, so that a
misspelt one can be told of.

kubelet's memory manager (its ``Static`` policy) names the NUMA nodes a Guaranteed
container's memory comes from in the request's ``cpuset_mems``: :func:`kubelet_memory_nodes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.kube import MIN_SHARES, CgroupParentError, QOSClass, exclusive_cpu_count, pod_cgroup
from shim.policy.static import ExclusiveRequest, IsolatedMode

ANNOTATION_ISOLATED: Final = "cpushim.io/isolated-cpus"
ANNOTATION_CFS_QUOTA: Final = "cpushim.io/cfs-quota"
ANNOTATION_EXCLUSIVE: Final = "cpushim.io/exclusive"
ANNOTATION_PREFIX: Final = "cpushim.io/"
_KNOWN_ANNOTATIONS: Final = frozenset(
    {ANNOTATION_ISOLATED, ANNOTATION_CFS_QUOTA, ANNOTATION_EXCLUSIVE}
)

_BOOL: Final = {"true": True, "false": False}
_ISOLATED_MODES: Final[Mapping[str, IsolatedMode]] = {
    "avoid": "avoid",
    "prefer": "prefer",
    "require": "require",
}


class AnnotationError(ValueError):
    """A ``cpushim.io/`` annotation with a value cpushim does not know."""


class MemoryNodesError(ValueError):
    """A request's ``cpuset_mems`` that cpushim cannot honour."""


@dataclass(frozen=True, slots=True)
class Pod:
    sandbox_id: str
    uid: str
    name: str
    namespace: str
    # None when the cgroup parent is not one kubelet makes (a pod made by hand with crictl):
    # such a pod's containers share.
    qos: QOSClass | None
    cgroup_parent: str
    annotations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # The pod's CPU request as shares and its memory limit, as kubelet gives them in the
    # sandbox config (its totals over the containers, or the pod-level resources); 0 when
    # it gives none.
    cpu_shares: int = 0
    memory_limit: int = 0
    # Its containers showed pod-level resources (:func:`shows_pod_level_resources`): none
    # of them gets exclusive CPUs, as with kubelet's static policy.
    pod_level_resources: bool = False

    @property
    def label(self) -> str:
        """namespace/name, as kubectl shows the pod; "" when neither is known (a create
        without a sandbox config for a sandbox cpushim never saw), so that callers fall
        back to the UID."""
        if not self.namespace and not self.name:
            return ""
        return f"{self.namespace}/{self.name}"

    @classmethod
    def from_config(cls, sandbox_id: str, config: pb.PodSandboxConfig) -> Pod:
        parent = config.linux.cgroup_parent
        try:
            qos: QOSClass | None = pod_cgroup(parent).qos
        except CgroupParentError:
            qos = None
        meta = config.metadata
        return cls(
            sandbox_id=sandbox_id,
            uid=meta.uid,
            name=meta.name,
            namespace=meta.namespace,
            qos=qos,
            cgroup_parent=parent,
            annotations=MappingProxyType(dict(config.annotations)),
            cpu_shares=max(config.linux.resources.cpu_shares, 0),
            memory_limit=max(config.linux.resources.memory_limit_in_bytes, 0),
        )


@dataclass(frozen=True, slots=True)
class ContainerPlan:
    """``exclusive`` is the number of exclusive CPUs, or None for the shared pool."""

    exclusive: int | None
    isolated: IsolatedMode = "avoid"
    keep_quota: bool = False


def _flag(annotations: Mapping[str, str], name: str) -> bool | None:
    value = annotations.get(name)
    if value is None:
        return None
    parsed = _BOOL.get(value.strip().lower())
    if parsed is None:
        raise AnnotationError(f'annotation {name}: {value!r} is not "true" or "false"')
    return parsed


def unknown_annotations(annotations: Mapping[str, str]) -> list[str]:
    """The ``cpushim.io/`` keys among a pod's annotations that cpushim does not read, in name
    order. ``cpushim.io/exclusive.<name>`` is known whatever the name: the sandbox does not
    list the containers to come."""
    per_container = f"{ANNOTATION_EXCLUSIVE}."
    return sorted(
        key
        for key in annotations
        if key.startswith(ANNOTATION_PREFIX)
        and key not in _KNOWN_ANNOTATIONS
        and not (key.startswith(per_container) and len(key) > len(per_container))
    )


def isolated_mode(pod: Pod) -> IsolatedMode:
    """How the pod's exclusive CPUs may use the kernel's isolated ones; AnnotationError for
    a value cpushim does not know."""
    value = pod.annotations.get(ANNOTATION_ISOLATED, "avoid")
    isolated = _ISOLATED_MODES.get(value.strip().lower())
    if isolated is None:
        raise AnnotationError(
            f"annotation {ANNOTATION_ISOLATED}: {value!r} is not avoid, prefer or require"
        )
    return isolated


def plan_container(
    pod: Pod, container_name: str, resources: pb.LinuxContainerResources
) -> ContainerPlan:
    """Exclusive or shared, from the pod's QoS class, the container's CPU resources and the
    pod's annotations; AnnotationError for an annotation value cpushim does not know."""
    annotations = pod.annotations
    isolated = isolated_mode(pod)
    quota = annotations.get(ANNOTATION_CFS_QUOTA)
    if quota is not None and quota.strip().lower() not in ("keep", "remove"):
        raise AnnotationError(f"annotation {ANNOTATION_CFS_QUOTA}: {quota!r} is not keep or remove")
    per_container = _flag(annotations, f"{ANNOTATION_EXCLUSIVE}.{container_name}")
    pod_wide = _flag(annotations, ANNOTATION_EXCLUSIVE)
    wanted = per_container if per_container is not None else pod_wide
    count = None
    if pod.qos is not None and wanted is not False and not pod.pod_level_resources:
        count = exclusive_cpu_count(
            pod.qos, resources.cpu_shares, resources.cpu_quota, resources.cpu_period
        )
    return ContainerPlan(
        exclusive=count,
        isolated=isolated,
        keep_quota=quota is not None and quota.strip().lower() == "keep",
    )


def takes_whole_pod(pod: Pod, resources: pb.LinuxContainerResources) -> bool:
    """Whether a container asks for exactly all of its pod's CPU and memory. kubelet gives a
    container without limits of its own those of its pod's pod-level resources (KEP-2837);
    otherwise the pod's figures are its containers' totals, which one container reaches
    only when it is the only one, or an init container that runs alone. Exactly: a
    container resized in place past the totals its sandbox was made with (the runtime's
    record of them stays) is no match."""
    return (
        pod.cpu_shares > 0
        and pod.memory_limit > 0
        and resources.cpu_shares == pod.cpu_shares
        and resources.memory_limit_in_bytes == pod.memory_limit
    )


def has_own_resources(resources: pb.LinuxContainerResources) -> bool:
    """Whether a container asks for CPU or memory. In a Guaranteed pod every container
    kubelet makes from the pod's spec does (a memory limit at least); an ephemeral one
    (kubectl debug) has none, and gets kubelet's minimum shares, unless it inherits the
    pod's pod-level limits."""
    return resources.memory_limit_in_bytes > 0 or resources.cpu_shares > MIN_SHARES


def shows_pod_level_resources(whole: Sequence[bool]) -> bool:
    """Whether a Guaranteed pod whose live containers with resources of their own
    (:func:`has_own_resources`) are ``whole`` (:func:`takes_whole_pod`, one flag each) has
    pod-level resources: two or more of them, one taking the whole pod. An ordinary pod's
    totals are its containers' sums, which one reaches only alone, whether its siblings ask
    for exclusive CPUs or share. kubelet's static policy gives such a pod no exclusive CPUs;
    pinning each container that asks for them would hand out the pod's CPUs once per
    container. One alone cannot be told from a pod of one container (it is pinned, with the
    pod's CPUs), nor can containers that each set limits of their own (pinned within the
    pod's)."""
    return len(whole) >= 2 and any(whole)


def kubelet_memory_nodes(resources: pb.LinuxContainerResources) -> CPUSet | None:
    """The NUMA nodes kubelet's memory manager chose for the container (``cpuset_mems``,
    set by its ``Static`` policy only), or None when it chose none; MemoryNodesError when
    they do not parse. Which nodes exist is the kernel's to say: a node with memory and no
    CPU (CXL memory, HBM) is one kubelet may name, and the CPU topology does not list it."""
    text = resources.cpuset_mems.strip()
    if not text:
        return None
    try:
        nodes = CPUSet.parse(text)
    except ValueError as exc:
        raise MemoryNodesError(
            f"cpuset_mems {resources.cpuset_mems!r} is not a list of NUMA nodes: {exc}"
        ) from exc
    return nodes or None


def exclusive_request(
    count: int, isolated: IsolatedMode, memory_nodes: CPUSet | None
) -> ExclusiveRequest:
    """What a container asks the policy for; kubelet's memory nodes are its NUMA hint."""
    hint = frozenset(memory_nodes) if memory_nodes is not None else None
    return ExclusiveRequest(count, isolated=isolated, numa_affinity=hint)
