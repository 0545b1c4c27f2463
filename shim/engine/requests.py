"""The CRI messages the engine writes: cpusets put into a container's resources. Pure."""

from __future__ import annotations

from typing import Final

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb

RUNTIME: Final = "/runtime.v1.RuntimeService/"
RUN_POD_SANDBOX: Final = RUNTIME + "RunPodSandbox"
STOP_POD_SANDBOX: Final = RUNTIME + "StopPodSandbox"
REMOVE_POD_SANDBOX: Final = RUNTIME + "RemovePodSandbox"
CREATE_CONTAINER: Final = RUNTIME + "CreateContainer"
START_CONTAINER: Final = RUNTIME + "StartContainer"
STOP_CONTAINER: Final = RUNTIME + "StopContainer"
REMOVE_CONTAINER: Final = RUNTIME + "RemoveContainer"
UPDATE_CONTAINER_RESOURCES: Final = RUNTIME + "UpdateContainerResources"
LIST_POD_SANDBOX: Final = RUNTIME + "ListPodSandbox"
POD_SANDBOX_STATUS: Final = RUNTIME + "PodSandboxStatus"
LIST_CONTAINERS: Final = RUNTIME + "ListContainers"
CONTAINER_STATUS: Final = RUNTIME + "ContainerStatus"

# CFS quota -1 is "no limit" to the kernel and to runc; 0 would mean "leave it as it is".
NO_QUOTA: Final = -1


def pin(
    resources: pb.LinuxContainerResources,
    cpus: CPUSet,
    mems: str = "",
    *,
    quota: int | None = None,
) -> None:
    """Write ``cpus`` into ``resources``, and ``mems`` and the CFS ``quota`` when given
    (``NO_QUOTA`` drops it)."""
    resources.cpuset_cpus = str(cpus)
    if mems:
        resources.cpuset_mems = mems
    if quota is not None:
        resources.cpu_quota = quota


def update_request(
    container_id: str, cpus: CPUSet, mems: str = "", *, quota: int | None = None
) -> bytes:
    """An UpdateContainerResources that changes only the cpuset (and the quota): containerd
    merges the non-zero fields into the container's spec, so the rest stays as it was."""
    request = pb.UpdateContainerResourcesRequest(container_id=container_id)
    pin(request.linux, cpus, mems, quota=quota)
    return request.SerializeToString()
