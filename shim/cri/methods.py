"""Every method of the CRI ``runtime.v1`` services, and the message types of those cpushim decodes.

The method list follows the public CRI definition (kubernetes/cri-api,
``pkg/apis/runtime/v1/api.proto``) in its declaration order. The relay does not need it to
forward a call (it forwards unknown paths too); it is what logs, metrics and tests use to name
calls and to know which ones stream. ``REQUEST_TYPES`` / ``RESPONSE_TYPES`` cover only the
methods whose messages are in cpushim's proto subset (``runtime_v1.proto``).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from shim.cri import runtime_v1_pb2 as pb

RUNTIME_SERVICE = "runtime.v1.RuntimeService"
IMAGE_SERVICE = "runtime.v1.ImageService"


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: its service's full name, its method name and whether the server streams."""

    service: str
    name: str
    server_streaming: bool = False

    @property
    def path(self) -> str:
        """The gRPC ``:path`` of the call, e.g. ``/runtime.v1.RuntimeService/Version``."""
        return f"/{self.service}/{self.name}"


def _runtime(name: str, *, server_streaming: bool = False) -> Method:
    return Method(RUNTIME_SERVICE, name, server_streaming)


def _image(name: str, *, server_streaming: bool = False) -> Method:
    return Method(IMAGE_SERVICE, name, server_streaming)


ALL_METHODS: tuple[Method, ...] = (
    _runtime("Version"),
    _runtime("RunPodSandbox"),
    _runtime("StopPodSandbox"),
    _runtime("RemovePodSandbox"),
    _runtime("PodSandboxStatus"),
    _runtime("ListPodSandbox"),
    _runtime("StreamPodSandboxes", server_streaming=True),
    _runtime("CreateContainer"),
    _runtime("StartContainer"),
    _runtime("StopContainer"),
    _runtime("RemoveContainer"),
    _runtime("ListContainers"),
    _runtime("StreamContainers", server_streaming=True),
    _runtime("ContainerStatus"),
    _runtime("UpdateContainerResources"),
    _runtime("ReopenContainerLog"),
    _runtime("ExecSync"),
    _runtime("Exec"),
    _runtime("Attach"),
    _runtime("PortForward"),
    _runtime("ContainerStats"),
    _runtime("ListContainerStats"),
    _runtime("StreamContainerStats", server_streaming=True),
    _runtime("PodSandboxStats"),
    _runtime("ListPodSandboxStats"),
    _runtime("StreamPodSandboxStats", server_streaming=True),
    _runtime("UpdateRuntimeConfig"),
    _runtime("Status"),
    _runtime("CheckpointContainer"),
    _runtime("GetContainerEvents", server_streaming=True),
    _runtime("ListMetricDescriptors"),
    _runtime("ListPodSandboxMetrics"),
    _runtime("StreamPodSandboxMetrics", server_streaming=True),
    _runtime("RuntimeConfig"),
    _runtime("UpdatePodSandboxResources"),
    _image("ListImages"),
    _image("StreamImages", server_streaming=True),
    _image("ImageStatus"),
    _image("PullImage"),
    _image("RemoveImage"),
    _image("ImageFsInfo"),
)

BY_PATH: dict[str, Method] = {method.path: method for method in ALL_METHODS}

# Server-streaming calls that end only when their client ends them: kubelet's Evented PLEG
# keeps GetContainerEvents open for as long as it runs. (The Stream* list calls end by
# themselves, as their List* twins do.)
WATCH_PATHS: frozenset[str] = frozenset(
    {BY_PATH["/runtime.v1.RuntimeService/GetContainerEvents"].path}
)

# Method -> (request class, response class) for the methods whose messages are in the subset.
# A mistyped path fails at import (KeyError); tests check each pair against the services
# declared in runtime_v1.proto.
_SUBSET: tuple[tuple[Method, type[Message], type[Message]], ...] = (
    (BY_PATH["/runtime.v1.RuntimeService/Version"], pb.VersionRequest, pb.VersionResponse),
    (
        BY_PATH["/runtime.v1.RuntimeService/RunPodSandbox"],
        pb.RunPodSandboxRequest,
        pb.RunPodSandboxResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/StopPodSandbox"],
        pb.StopPodSandboxRequest,
        pb.StopPodSandboxResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/RemovePodSandbox"],
        pb.RemovePodSandboxRequest,
        pb.RemovePodSandboxResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/PodSandboxStatus"],
        pb.PodSandboxStatusRequest,
        pb.PodSandboxStatusResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/ListPodSandbox"],
        pb.ListPodSandboxRequest,
        pb.ListPodSandboxResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/CreateContainer"],
        pb.CreateContainerRequest,
        pb.CreateContainerResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/StartContainer"],
        pb.StartContainerRequest,
        pb.StartContainerResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/StopContainer"],
        pb.StopContainerRequest,
        pb.StopContainerResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/RemoveContainer"],
        pb.RemoveContainerRequest,
        pb.RemoveContainerResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/ListContainers"],
        pb.ListContainersRequest,
        pb.ListContainersResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/ContainerStatus"],
        pb.ContainerStatusRequest,
        pb.ContainerStatusResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/UpdateContainerResources"],
        pb.UpdateContainerResourcesRequest,
        pb.UpdateContainerResourcesResponse,
    ),
    (BY_PATH["/runtime.v1.RuntimeService/ExecSync"], pb.ExecSyncRequest, pb.ExecSyncResponse),
    (
        BY_PATH["/runtime.v1.RuntimeService/ListContainerStats"],
        pb.ListContainerStatsRequest,
        pb.ListContainerStatsResponse,
    ),
    (BY_PATH["/runtime.v1.RuntimeService/Status"], pb.StatusRequest, pb.StatusResponse),
    (
        BY_PATH["/runtime.v1.RuntimeService/GetContainerEvents"],
        pb.GetEventsRequest,
        pb.ContainerEventResponse,
    ),
    (
        BY_PATH["/runtime.v1.RuntimeService/UpdatePodSandboxResources"],
        pb.UpdatePodSandboxResourcesRequest,
        pb.UpdatePodSandboxResourcesResponse,
    ),
    (BY_PATH["/runtime.v1.ImageService/ListImages"], pb.ListImagesRequest, pb.ListImagesResponse),
    (
        BY_PATH["/runtime.v1.ImageService/ImageStatus"],
        pb.ImageStatusRequest,
        pb.ImageStatusResponse,
    ),
)

REQUEST_TYPES: dict[str, type[Message]] = {method.path: req for method, req, _ in _SUBSET}
RESPONSE_TYPES: dict[str, type[Message]] = {method.path: resp for method, _, resp in _SUBSET}
