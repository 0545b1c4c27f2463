"""A stateful fake of containerd's CRI RuntimeService, for the engine's unit tests.

It keeps sandboxes and containers and answers the lifecycle, list, status and update calls the
way containerd 1.6 does where cpushim depends on it: name reservation, UpdateContainerResources
merging non-zero fields into the container's resources (also for created and exited
containers), ContainerStatus reporting those resources, and verbose PodSandboxStatus info
holding the sandbox config as JSON. Other methods answer UNIMPLEMENTED.

Tests steer it with :meth:`FakeContainerd.fail_next`, :meth:`FakeContainerd.gate` (hold calls
of a method until an event is set) and :meth:`FakeContainerd.exit_container` (a process that
exits by itself), and read :attr:`FakeContainerd.calls`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError, Message
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from shim.cri import runtime_v1_pb2 as pb
from shim.cri.methods import ALL_METHODS
from tests.fake_cri import RawCodec, short_tmpdir


@dataclass
class FakeSandbox:
    id: str
    config: pb.PodSandboxConfig
    state: int = pb.SANDBOX_READY
    created_at: int = field(default_factory=time.time_ns)


@dataclass
class FakeContainer:
    id: str
    sandbox_id: str
    config: pb.ContainerConfig
    state: int = pb.CONTAINER_CREATED
    resources: pb.LinuxContainerResources = field(default_factory=pb.LinuxContainerResources)
    created_at: int = field(default_factory=time.time_ns)
    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0


@dataclass
class _Failure:
    status: Status
    message: str
    count: int


UnaryHandler = Callable[[Any], Message]


class FakeContainerd:
    """``async with FakeContainerd() as runtime:`` serves on ``runtime.endpoint``."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.containers: dict[str, FakeContainer] = {}
        self.calls: list[tuple[str, Message]] = []
        self._failures: dict[str, _Failure] = {}
        self._gates: dict[str, asyncio.Event] = {}
        self._tmp = short_tmpdir()
        self._server: Server | None = None
        self.socket_path = Path()
        self.endpoint = ""

    async def __aenter__(self) -> FakeContainerd:
        directory = self._tmp.__enter__()
        self.socket_path = directory / "containerd.sock"
        self.endpoint = f"unix://{self.socket_path}"
        self._server = Server([self], codec=RawCodec())
        await self._server.start(path=str(self.socket_path))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for gate in self._gates.values():
            gate.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._tmp.__exit__(exc_type, exc, tb)

    # --- steering -------------------------------------------------------------------------

    def fail_next(
        self, method: str, status: Status, message: str = "injected", count: int = 1
    ) -> None:
        """The next ``count`` calls of ``method`` fail with ``status``, changing nothing."""
        self._failures[method] = _Failure(status, message, count)

    def gate(self, method: str) -> asyncio.Event:
        """Calls of ``method`` are recorded, then wait until the returned event is set."""
        event = asyncio.Event()
        self._gates[method] = event
        return event

    def ungate(self, method: str) -> None:
        """New calls of ``method`` no longer wait (ones already waiting still do)."""
        self._gates.pop(method, None)

    def exit_container(self, container_id: str, exit_code: int = 0) -> None:
        """The container's process ends by itself, with no StopContainer."""
        container = self.containers[container_id]
        container.state = pb.CONTAINER_EXITED
        container.exit_code = exit_code
        container.finished_at = time.time_ns()

    def calls_of(self, method: str) -> list[Message]:
        return [request for name, request in self.calls if name == method]

    def add_sandbox(self, config: pb.PodSandboxConfig) -> str:
        sandbox = FakeSandbox(secrets.token_hex(32), config)
        self.sandboxes[sandbox.id] = sandbox
        return sandbox.id

    def add_container(
        self, sandbox_id: str, config: pb.ContainerConfig, state: int = pb.CONTAINER_RUNNING
    ) -> str:
        """A container made without cpushim (as while it was down)."""
        container = self._new_container(sandbox_id, config)
        container.state = state
        if state == pb.CONTAINER_RUNNING:
            container.started_at = time.time_ns()
        return container.id

    # --- grpclib plumbing -----------------------------------------------------------------

    def __mapping__(self) -> dict[str, Handler]:
        handlers: dict[str, tuple[type[Message], UnaryHandler]] = {
            "Version": (pb.VersionRequest, self._version),
            "RunPodSandbox": (pb.RunPodSandboxRequest, self._run_pod_sandbox),
            "StopPodSandbox": (pb.StopPodSandboxRequest, self._stop_pod_sandbox),
            "RemovePodSandbox": (pb.RemovePodSandboxRequest, self._remove_pod_sandbox),
            "PodSandboxStatus": (pb.PodSandboxStatusRequest, self._pod_sandbox_status),
            "ListPodSandbox": (pb.ListPodSandboxRequest, self._list_pod_sandbox),
            "CreateContainer": (pb.CreateContainerRequest, self._create_container),
            "StartContainer": (pb.StartContainerRequest, self._start_container),
            "StopContainer": (pb.StopContainerRequest, self._stop_container),
            "RemoveContainer": (pb.RemoveContainerRequest, self._remove_container),
            "ListContainers": (pb.ListContainersRequest, self._list_containers),
            "ContainerStatus": (pb.ContainerStatusRequest, self._container_status),
            "UpdateContainerResources": (
                pb.UpdateContainerResourcesRequest,
                self._update_container_resources,
            ),
        }
        mapping: dict[str, Handler] = {}
        for method in ALL_METHODS:
            name = method.path.rsplit("/", 1)[1]
            cardinality = (
                Cardinality.UNARY_STREAM if method.server_streaming else Cardinality.UNARY_UNARY
            )
            known = handlers.get(name) if method.path.startswith("/runtime.v1.Runtime") else None
            mapping[method.path] = Handler(self._serve(name, known), cardinality, bytes, bytes)
        return mapping

    def _serve(
        self, name: str, known: tuple[type[Message], UnaryHandler] | None
    ) -> Callable[[Stream[bytes, bytes]], Any]:
        async def handle(stream: Stream[bytes, bytes]) -> None:
            raw = await stream.recv_message()
            assert raw is not None
            if known is None:
                raise GRPCError(Status.UNIMPLEMENTED, f"fake containerd: {name}")
            request_type, handler = known
            try:
                request = request_type.FromString(raw)
            except DecodeError as exc:
                raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from exc
            self.calls.append((name, request))
            gate = self._gates.get(name)
            if gate is not None:
                await gate.wait()
            failure = self._failures.get(name)
            if failure is not None:
                failure.count -= 1
                if failure.count <= 0:
                    del self._failures[name]
                raise GRPCError(failure.status, failure.message)
            await stream.send_message(handler(request).SerializeToString())

        return handle

    # --- the calls ------------------------------------------------------------------------

    def _version(self, request: pb.VersionRequest) -> Message:
        return pb.VersionResponse(
            version="0.1.0",
            runtime_name="fake-containerd",
            runtime_version="0.0.0",
            runtime_api_version="v1",
        )

    def _sandbox(self, sandbox_id: str) -> FakeSandbox:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise GRPCError(
                Status.NOT_FOUND,
                f"an error occurred when try to find sandbox {sandbox_id!r}: not found",
            )
        return sandbox

    def _container(self, container_id: str) -> FakeContainer:
        container = self.containers.get(container_id)
        if container is None:
            raise GRPCError(
                Status.NOT_FOUND,
                f"an error occurred when try to find container {container_id!r}: not found",
            )
        return container

    def _run_pod_sandbox(self, request: pb.RunPodSandboxRequest) -> Message:
        meta = request.config.metadata
        for sandbox in self.sandboxes.values():
            other = sandbox.config.metadata
            if (other.name, other.namespace, other.uid, other.attempt) == (
                meta.name,
                meta.namespace,
                meta.uid,
                meta.attempt,
            ):
                raise GRPCError(
                    Status.UNKNOWN, f"failed to reserve sandbox name: reserved for {sandbox.id}"
                )
        return pb.RunPodSandboxResponse(pod_sandbox_id=self.add_sandbox(request.config))

    def _stop_pod_sandbox(self, request: pb.StopPodSandboxRequest) -> Message:
        sandbox = self._sandbox(request.pod_sandbox_id)
        for container in self.containers.values():
            if container.sandbox_id == sandbox.id and container.state == pb.CONTAINER_RUNNING:
                self.exit_container(container.id, 137)
        sandbox.state = pb.SANDBOX_NOTREADY
        return pb.StopPodSandboxResponse()

    def _remove_pod_sandbox(self, request: pb.RemovePodSandboxRequest) -> Message:
        self.sandboxes.pop(request.pod_sandbox_id, None)
        for container_id in [
            c.id for c in self.containers.values() if c.sandbox_id == request.pod_sandbox_id
        ]:
            del self.containers[container_id]
        return pb.RemovePodSandboxResponse()

    def _pod_sandbox_status(self, request: pb.PodSandboxStatusRequest) -> Message:
        sandbox = self._sandbox(request.pod_sandbox_id)
        response = pb.PodSandboxStatusResponse(
            status=pb.PodSandboxStatus(
                id=sandbox.id,
                metadata=sandbox.config.metadata,
                state=sandbox.state,
                created_at=sandbox.created_at,
                labels=sandbox.config.labels,
                annotations=sandbox.config.annotations,
            )
        )
        if request.verbose:
            config = MessageToDict(
                sandbox.config, preserving_proto_field_name=True, use_integers_for_enums=True
            )
            response.info["info"] = json.dumps({"pid": 4242, "config": config})
        return response

    def _list_pod_sandbox(self, request: pb.ListPodSandboxRequest) -> Message:
        wanted = request.filter
        items = []
        for sandbox in self.sandboxes.values():
            if wanted.id and wanted.id != sandbox.id:
                continue
            if wanted.HasField("state") and wanted.state.state != sandbox.state:
                continue
            labels = sandbox.config.labels
            if any(labels.get(k) != v for k, v in wanted.label_selector.items()):
                continue
            items.append(
                pb.PodSandbox(
                    id=sandbox.id,
                    metadata=sandbox.config.metadata,
                    state=sandbox.state,
                    created_at=sandbox.created_at,
                    labels=labels,
                    annotations=sandbox.config.annotations,
                )
            )
        return pb.ListPodSandboxResponse(items=items)

    def _new_container(self, sandbox_id: str, config: pb.ContainerConfig) -> FakeContainer:
        resources = pb.LinuxContainerResources()
        resources.CopyFrom(config.linux.resources)
        if resources.memory_limit_in_bytes and not resources.memory_swap_limit_in_bytes:
            resources.memory_swap_limit_in_bytes = resources.memory_limit_in_bytes
        container = FakeContainer(secrets.token_hex(32), sandbox_id, config, resources=resources)
        self.containers[container.id] = container
        return container

    def _create_container(self, request: pb.CreateContainerRequest) -> Message:
        sandbox = self._sandbox(request.pod_sandbox_id)
        if sandbox.state != pb.SANDBOX_READY:
            raise GRPCError(Status.UNKNOWN, f"sandbox {sandbox.id} is not ready")
        meta = request.config.metadata
        for other in self.containers.values():
            if other.sandbox_id == sandbox.id and (
                other.config.metadata.name,
                other.config.metadata.attempt,
            ) == (meta.name, meta.attempt):
                raise GRPCError(
                    Status.UNKNOWN, f"failed to reserve container name: reserved for {other.id}"
                )
        container = self._new_container(sandbox.id, request.config)
        return pb.CreateContainerResponse(container_id=container.id)

    def _start_container(self, request: pb.StartContainerRequest) -> Message:
        container = self._container(request.container_id)
        if container.state != pb.CONTAINER_CREATED:
            state = pb.ContainerState.Name(container.state)
            raise GRPCError(Status.UNKNOWN, f"container is in {state} state")
        container.state = pb.CONTAINER_RUNNING
        container.started_at = time.time_ns()
        return pb.StartContainerResponse()

    def _stop_container(self, request: pb.StopContainerRequest) -> Message:
        container = self._container(request.container_id)
        if container.state == pb.CONTAINER_RUNNING:
            self.exit_container(container.id, 137 if request.timeout == 0 else 0)
        return pb.StopContainerResponse()

    def _remove_container(self, request: pb.RemoveContainerRequest) -> Message:
        self.containers.pop(request.container_id, None)
        return pb.RemoveContainerResponse()

    def _list_containers(self, request: pb.ListContainersRequest) -> Message:
        wanted = request.filter
        items = []
        for c in self.containers.values():
            if wanted.id and wanted.id != c.id:
                continue
            if wanted.pod_sandbox_id and wanted.pod_sandbox_id != c.sandbox_id:
                continue
            if wanted.HasField("state") and wanted.state.state != c.state:
                continue
            if any(c.config.labels.get(k) != v for k, v in wanted.label_selector.items()):
                continue
            items.append(
                pb.Container(
                    id=c.id,
                    pod_sandbox_id=c.sandbox_id,
                    metadata=c.config.metadata,
                    image=c.config.image,
                    state=c.state,
                    created_at=c.created_at,
                    labels=c.config.labels,
                    annotations=c.config.annotations,
                )
            )
        return pb.ListContainersResponse(containers=items)

    def _container_status(self, request: pb.ContainerStatusRequest) -> Message:
        c = self._container(request.container_id)
        response = pb.ContainerStatusResponse(
            status=pb.ContainerStatus(
                id=c.id,
                metadata=c.config.metadata,
                state=c.state,
                created_at=c.created_at,
                started_at=c.started_at,
                finished_at=c.finished_at,
                exit_code=c.exit_code,
                image=c.config.image,
                labels=c.config.labels,
                annotations=c.config.annotations,
                resources=pb.ContainerResources(linux=c.resources),
            )
        )
        if request.verbose:
            parent = self.sandboxes[c.sandbox_id].config.linux.cgroup_parent
            cpu = {
                "shares": c.resources.cpu_shares,
                "quota": c.resources.cpu_quota,
                "period": c.resources.cpu_period,
                "cpus": c.resources.cpuset_cpus,
                "mems": c.resources.cpuset_mems,
            }
            spec = {
                "linux": {
                    "cgroupsPath": f"{parent}/{c.id}",
                    "resources": {"cpu": {k: v for k, v in cpu.items() if v}},
                }
            }
            response.info["info"] = json.dumps(
                {"sandboxID": c.sandbox_id, "pid": 4243, "runtimeSpec": spec}
            )
        return response

    def _update_container_resources(self, request: pb.UpdateContainerResourcesRequest) -> Message:
        current = self._container(request.container_id).resources
        new = request.linux
        # containerd's WithResources: zero and empty mean "leave as it is".
        for name in (
            "cpu_period",
            "cpu_quota",
            "cpu_shares",
            "memory_limit_in_bytes",
            "oom_score_adj",
            "memory_swap_limit_in_bytes",
            "cpuset_cpus",
            "cpuset_mems",
        ):
            value = getattr(new, name)
            if value:
                setattr(current, name, value)
        if new.hugepage_limits:
            del current.hugepage_limits[:]
            current.hugepage_limits.extend(new.hugepage_limits)
        if new.unified:
            current.unified.clear()
            current.unified.update(new.unified)
        return pb.UpdateContainerResourcesResponse()
