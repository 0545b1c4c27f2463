"""A stateful in-process fake of containerd 1.6's CRI RuntimeService (runtime.v1).

It keeps pod sandboxes and containers and answers the lifecycle, list, status and
UpdateContainerResources calls the way containerd 1.6 does, so that cpushim's allocation engine
can be tested without a real runtime. It is a grpclib server on a unix socket with a raw-bytes
codec (as :mod:`tests.fake_cri`); requests are decoded with cpushim's own protobuf subset.

    async with FakeRuntime() as rt:
        channel = RuntimeChannel(rt.endpoint)
        ...
        assert rt.containers[container_id].resources.cpuset_cpus == "1"

Tests can look at and change the state directly (``rt.sandboxes``, ``rt.containers``), script
failures (:meth:`FakeRuntime.fail_next`), hold calls (:meth:`FakeRuntime.gate`), make a process
exit by itself (:meth:`FakeRuntime.exit_container`) and add objects as if they had been made
before the test (:meth:`FakeRuntime.add_sandbox`, :meth:`FakeRuntime.add_container`).

Every call is recorded in ``calls`` (method name, decoded request) in arrival order; requests
of methods outside the protobuf subset are recorded as ``google.protobuf.empty_pb2.Empty``
holding their fields as unknown fields. A request whose bytes do not decode is answered
INVALID_ARGUMENT and is not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, TypeVar

from google.protobuf import empty_pb2
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError, Message
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.methods import ALL_METHODS, REQUEST_TYPES, Method
from tests.fake_cri import RawCodec, short_tmpdir
from tests.harness.containerd import CgroupDriver

RUNTIME_NAME = "fake-containerd"
RUNTIME_VERSION = "1.6.0-fake"
RUNTIME_API_VERSION = "v1"
VERSION = "0.0.0"

METHOD_NAMES: frozenset[str] = frozenset(method.name for method in ALL_METHODS)

_SIGKILL_EXIT = 137

_M = TypeVar("_M", bound=Message)


@dataclass
class FakeSandbox:
    id: str
    config: pb.PodSandboxConfig
    state: int
    created_at: int
    runtime_handler: str = ""
    pid: int = 0


@dataclass
class FakeContainer:
    id: str
    sandbox_id: str
    config: pb.ContainerConfig
    state: int
    resources: pb.LinuxContainerResources
    created_at: int
    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0
    removing: bool = False
    pid: int = 0


def new_id() -> str:
    """A container or sandbox id the way containerd makes them: 64 hex characters."""
    return secrets.token_hex(32)


def _sandbox_state(state: int) -> pb.PodSandboxState.ValueType:
    return pb.PodSandboxState.ValueType(state)


def _container_state(state: int) -> pb.ContainerState.ValueType:
    return pb.ContainerState.ValueType(state)


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _resolve(prefix: str, ids: Iterable[str]) -> str | None:
    """containerd's truncindex: a full id, or a prefix that names exactly one id."""
    if not prefix:
        return None
    found = [candidate for candidate in ids if candidate.startswith(prefix)]
    if prefix in found:
        return prefix
    return found[0] if len(found) == 1 else None


def _initial_resources(config: pb.ContainerConfig) -> pb.LinuxContainerResources:
    resources = pb.LinuxContainerResources()
    resources.CopyFrom(config.linux.resources)
    if resources.memory_limit_in_bytes and not resources.memory_swap_limit_in_bytes:
        # containerd: swap equal to the memory limit so the container does not swap.
        resources.memory_swap_limit_in_bytes = resources.memory_limit_in_bytes
    return resources


def merge_resources(
    current: pb.LinuxContainerResources, update: pb.LinuxContainerResources
) -> None:
    """Merge ``update`` into ``current`` the way containerd's ``WithResources`` changes a spec:
    non-zero numbers and non-empty strings override (a CFS quota of -1 is non-zero), the
    memory limit brings the swap limit with it unless a swap limit is given, hugepage limits
    override per page size and unified entries per key."""
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
        value = getattr(update, name)
        if value:
            setattr(current, name, value)
    if update.memory_limit_in_bytes and not update.memory_swap_limit_in_bytes:
        current.memory_swap_limit_in_bytes = update.memory_limit_in_bytes
    if update.hugepage_limits:
        limits = {limit.page_size: limit.limit for limit in current.hugepage_limits}
        limits.update((limit.page_size, limit.limit) for limit in update.hugepage_limits)
        del current.hugepage_limits[:]
        for page_size, limit in limits.items():
            current.hugepage_limits.add(page_size=page_size, limit=limit)
    current.unified.update(update.unified)


def v1_children_outside(directory: Path, name: str, values: str) -> list[Path]:
    """The child cpusets below ``directory`` whose file ``name`` (``cpuset.cpus``,
    ``cpuset.mems``) holds more than ``values``: a write of ``values`` there is refused with
    EBUSY by cgroup v1 (a child stays inside its parent)."""
    allowed = CPUSet.parse(values.strip())
    return [
        child
        for child in sorted(directory.iterdir())
        if (child / name).is_file()
        and not CPUSet.parse((child / name).read_text().strip()).issubset(allowed)
    ]


def _omit_empty(values: Mapping[str, object]) -> dict[str, object]:
    return {key: value for key, value in values.items() if value}


def _config_json(config: Message) -> dict[str, Any]:
    return MessageToDict(config, preserving_proto_field_name=True, use_integers_for_enums=True)


def _not_found(kind: str, object_id: str) -> GRPCError:
    return GRPCError(
        Status.NOT_FOUND, f"an error occurred when try to find {kind} {object_id!r}: not found"
    )


class FakeRuntime:
    """containerd 1.6's CRI runtime service, in memory, on a unix socket; an async context
    manager (``async with FakeRuntime() as rt``). ``socket_path`` and ``endpoint`` exist from
    ``__aenter__`` on."""

    socket_path: Path
    endpoint: str

    def __init__(
        self,
        cgroup_root: Path | None = None,
        cgroup_version: int = 1,
        pid_source: Callable[[], int] | None = None,
        cgroup_driver: CgroupDriver = "cgroupfs",
        v2_before_5_17: bool = False,
    ) -> None:
        # With a root, started containers get a cgroup directory below it holding
        # ``cpuset.cpus``, written on start and update and removed when the process exits, as
        # runc does. The cgroupfs driver's layout: the sandbox's cgroup parent, then the
        # container id; the systemd driver's: the pod slice's path (each dash of its name a
        # level), then the scope ``cri-containerd-<id>.scope``.
        self.cgroup_root = cgroup_root
        # kubelet's and containerd's (they agree): the form of the pods' cgroup parents
        # kubelet sends (tests.harness.kubelet.pod_cgroup_parent) and so of the cgroup paths.
        self.cgroup_driver = cgroup_driver
        # Version 2 adds the ``cgroup.events`` file, "populated 1" while the process runs.
        self.cgroup_version = cgroup_version
        # Whether runc's update is refused (EBUSY) below a child cpuset's own set: under v1,
        # and under v2 on kernels before 5.17.
        self.children_bound_updates = cgroup_version == 1 or v2_before_5_17
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.containers: dict[str, FakeContainer] = {}
        self.calls: list[tuple[str, Message]] = []
        self._failures: dict[str, deque[tuple[Status, str]]] = {}
        self._gates: dict[str, asyncio.Event] = {}
        # Sandboxes whose shim does not answer: containerd asks it for the sandbox task's
        # state when a PodSandboxStatus is verbose, so those hang (until the fake closes)
        # while plain ones answer.
        self.shims_hung: set[str] = set()
        self._closing = asyncio.Event()
        # containerd before 1.6.9 gives no resources in ContainerStatus (its verbose info's
        # OCI spec has them).
        self.reports_resources = True
        # The NUMA nodes with memory, when a test says: runc's write of a cpuset.mems that
        # names another (a start, an update of a running container) is refused by the kernel.
        self.memory_nodes: CPUSet | None = None
        self._next_pid = 1000
        # Gives started containers real processes (their pids go into ``cgroup.procs``), for
        # tests of what the engine does when a process exits; fake numbers otherwise.
        self.pid_source = pid_source
        self._server: Server | None = None
        self._exit_stack = contextlib.ExitStack()
        self._handlers: dict[str, Callable[[Any], Message]] = {
            "Version": self._version,
            "Status": self._status,
            "RunPodSandbox": self._run_pod_sandbox,
            "StopPodSandbox": self._stop_pod_sandbox,
            "RemovePodSandbox": self._remove_pod_sandbox,
            "PodSandboxStatus": self._pod_sandbox_status,
            "ListPodSandbox": self._list_pod_sandbox,
            "CreateContainer": self._create_container,
            "StartContainer": self._start_container,
            "StopContainer": self._stop_container,
            "RemoveContainer": self._remove_container,
            "ListContainers": self._list_containers,
            "ContainerStatus": self._container_status,
            "UpdateContainerResources": self._update_container_resources,
        }

    # --- serving -------------------------------------------------------------------------------

    async def __aenter__(self) -> FakeRuntime:
        try:
            workdir = self._exit_stack.enter_context(short_tmpdir())
            self.socket_path = workdir / "containerd.sock"
            self.endpoint = f"unix://{self.socket_path}"
            self._server = Server([self], codec=RawCodec())
            await self._server.start(path=str(self.socket_path))
        except BaseException:
            self._server = None
            self._exit_stack.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._closing.set()
        try:
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
                self._server = None
        finally:
            self._exit_stack.close()

    def __mapping__(self) -> dict[str, Handler]:
        mapping: dict[str, Handler] = {}
        for method in ALL_METHODS:
            cardinality = (
                Cardinality.UNARY_STREAM if method.server_streaming else Cardinality.UNARY_UNARY
            )
            mapping[method.path] = Handler(self._endpoint(method), cardinality, bytes, bytes)
        return mapping

    def _endpoint(self, method: Method) -> Callable[[Stream[bytes, bytes]], Any]:
        async def handle(stream: Stream[bytes, bytes]) -> None:
            await self._serve(method, stream)

        return handle

    async def _serve(self, method: Method, stream: Stream[bytes, bytes]) -> None:
        raw = await stream.recv_message()
        request_type = REQUEST_TYPES.get(method.path, empty_pb2.Empty)
        try:
            request = request_type.FromString(raw or b"")
        except DecodeError as exc:
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"cannot decode the {method.name} request: {exc}"
            ) from exc
        self.calls.append((method.name, request))
        pending = self._failures.get(method.name)
        failure = pending.popleft() if pending else None
        gate = self._gates.get(method.name)
        if gate is not None:
            await gate.wait()
        if failure is not None:
            raise GRPCError(*failure)
        if (
            isinstance(request, pb.PodSandboxStatusRequest)
            and request.verbose
            and request.pod_sandbox_id in self.shims_hung
        ):
            await self._closing.wait()
            raise GRPCError(Status.UNAVAILABLE, "the runtime is closing")
        handler = self._handlers.get(method.name)
        if handler is None or method.server_streaming:
            raise GRPCError(Status.UNIMPLEMENTED, f"method {method.name} not implemented")
        reply = handler(request)
        await stream.send_message(reply.SerializeToString())

    # --- test controls -------------------------------------------------------------------------

    def fail_next(
        self, method: str, status: Status, message: str = "injected", count: int = 1
    ) -> None:
        """The next ``count`` calls of ``method`` (in arrival order) fail with ``status`` and
        change nothing; they are still recorded in ``calls``. Failures queue up."""
        self._check_name(method)
        self._failures.setdefault(method, deque()).extend([(status, message)] * count)

    def clear_failures(self, method: str) -> None:
        """Calls of ``method`` no longer fail: the failures still queued are dropped."""
        self._check_name(method)
        self._failures.pop(method, None)

    def gate(self, method: str) -> asyncio.Event:
        """Hold calls of ``method``: each is recorded, then waits until the returned event is
        set before doing anything. Gating a gated method returns the same event."""
        self._check_name(method)
        return self._gates.setdefault(method, asyncio.Event())

    def ungate(self, method: str) -> None:
        """Calls of ``method`` that arrive from now on are not held. Calls already waiting keep
        waiting for the event :meth:`gate` returned (set it to release them)."""
        self._check_name(method)
        self._gates.pop(method, None)

    def calls_of(self, method: str) -> list[Message]:
        """The requests of every call of ``method`` so far, in arrival order."""
        self._check_name(method)
        return [request for name, request in self.calls if name == method]

    def exit_container(self, container_id: str, exit_code: int = 0) -> None:
        """The container's process exits by itself (RUNNING -> EXITED)."""
        container = self.containers[container_id]
        if container.state != pb.CONTAINER_RUNNING:
            state = pb.ContainerState.Name(_container_state(container.state))
            raise ValueError(f"container {container_id} is {state}, not running")
        self._exited(container, exit_code)

    def add_sandbox(self, config: pb.PodSandboxConfig, state: int = pb.SANDBOX_READY) -> str:
        """A sandbox made outside the test's calls (no name reservation check); its id."""
        sandbox = FakeSandbox(
            id=new_id(),
            config=self._copy(config),
            state=state,
            created_at=time.time_ns(),
            pid=self._pid(),
        )
        self.sandboxes[sandbox.id] = sandbox
        return sandbox.id

    def add_container(
        self, sandbox_id: str, config: pb.ContainerConfig, state: int = pb.CONTAINER_RUNNING
    ) -> str:
        """A container made outside the test's calls (no name reservation check, sandbox state
        not checked) in ``state``; its id. Its resources are derived from the config as
        CreateContainer derives them."""
        if sandbox_id not in self.sandboxes:
            raise KeyError(f"no sandbox {sandbox_id}")
        now = time.time_ns()
        container = FakeContainer(
            id=new_id(),
            sandbox_id=sandbox_id,
            config=self._copy(config),
            state=state,
            resources=_initial_resources(config),
            created_at=now,
        )
        if state in (pb.CONTAINER_RUNNING, pb.CONTAINER_EXITED):
            container.started_at = now
            container.pid = self._pid()
        if state == pb.CONTAINER_EXITED:
            container.finished_at = now
        self.containers[container.id] = container
        if state == pb.CONTAINER_RUNNING:
            self._make_cgroup(container)
        return container.id

    # --- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _check_name(method: str) -> None:
        if method not in METHOD_NAMES:
            raise ValueError(f"{method!r} is not a CRI method name (e.g. 'CreateContainer')")

    @staticmethod
    def _copy(message: _M) -> _M:
        copy = type(message)()
        copy.CopyFrom(message)
        return copy

    def _pid(self) -> int:
        self._next_pid += 1
        return self._next_pid

    def _sandbox(self, sandbox_id: str) -> FakeSandbox:
        found = _resolve(sandbox_id, self.sandboxes)
        if found is None:
            raise _not_found("sandbox", sandbox_id)
        return self.sandboxes[found]

    def _container(self, container_id: str) -> FakeContainer:
        found = _resolve(container_id, self.containers)
        if found is None:
            raise _not_found("container", container_id)
        return self.containers[found]

    def _exited(self, container: FakeContainer, exit_code: int) -> None:
        container.state = pb.CONTAINER_EXITED
        container.exit_code = exit_code
        container.finished_at = time.time_ns()
        cgroup = self.cgroup_dir(container.id)
        if cgroup is not None and cgroup.is_dir():
            shutil.rmtree(cgroup)

    def _check_memory_nodes(self, mems: str) -> None:
        """runc's write of ``mems`` into a cpuset.mems, which the kernel refuses (EINVAL)
        when it names a node without memory."""
        if self.memory_nodes is None or not mems:
            return
        if not CPUSet.parse(mems).issubset(self.memory_nodes):
            raise GRPCError(
                Status.UNKNOWN,
                f"failed to write {mems!r}: write cpuset.mems: invalid argument",
            )

    def _make_cgroup(self, container: FakeContainer) -> None:
        cgroup = self.cgroup_dir(container.id)
        if cgroup is None:
            return
        cgroup.mkdir(parents=True, exist_ok=True)
        (cgroup / "cpuset.cpus").write_text(container.resources.cpuset_cpus + "\n")
        if self.cgroup_version == 1 and container.resources.cpuset_mems:
            (cgroup / "cpuset.mems").write_text(container.resources.cpuset_mems + "\n")
        if self.cgroup_version == 2:
            (cgroup / "cgroup.events").write_text("populated 1\nfrozen 0\n")
        if self.pid_source is not None:
            (cgroup / "cgroup.procs").write_text(f"{container.pid}\n")

    def cgroup_path(self, container_id: str) -> str:
        """The OCI ``cgroupsPath`` containerd gives a container: ``<pod slice>:cri-containerd:
        <id>`` when the cgroup parent is a systemd slice (kubelet's systemd driver),
        ``<parent>/<id>`` otherwise."""
        container = self.containers[container_id]
        sandbox = self.sandboxes.get(container.sandbox_id)
        parent = sandbox.config.linux.cgroup_parent if sandbox is not None else ""
        base = PurePosixPath(parent).name
        if base.endswith(".slice"):
            return f"{base}:cri-containerd:{container.id}"
        return f"{parent}/{container.id}"

    def cgroup_dir(self, container_id: str) -> Path | None:
        """The container's cgroup directory under ``cgroup_root`` (None without a root)."""
        if self.cgroup_root is None:
            return None
        path = self.cgroup_path(container_id)
        if not path.startswith("/") and path.count(":") == 2:
            # systemd's rule, written out here rather than taken from shim.cgroups:
            # a-b-c.slice is a.slice/a-b.slice/a-b-c.slice.
            slice_name, prefix, name = path.split(":")
            words = slice_name.removesuffix(".slice").split("-")
            levels = ["-".join(words[: i + 1]) + ".slice" for i in range(len(words))]
            return self.cgroup_root.joinpath(*levels, f"{prefix}-{name}.scope")
        return self.cgroup_root / path.lstrip("/")

    def cgroup_cpus(self, container_id: str) -> str | None:
        """What the container's cgroup ``cpuset.cpus`` holds; None when it has none."""
        cgroup = self.cgroup_dir(container_id)
        if cgroup is None or not (cgroup / "cpuset.cpus").exists():
            return None
        return (cgroup / "cpuset.cpus").read_text().strip()

    @staticmethod
    def _sandbox_name(config: pb.PodSandboxConfig) -> str:
        meta = config.metadata
        return "_".join((meta.name, meta.namespace, meta.uid, str(meta.attempt)))

    # --- Version, Status -----------------------------------------------------------------------

    def _version(self, request: pb.VersionRequest) -> pb.VersionResponse:
        return pb.VersionResponse(
            version=VERSION,
            runtime_name=RUNTIME_NAME,
            runtime_version=RUNTIME_VERSION,
            runtime_api_version=RUNTIME_API_VERSION,
        )

    def _status(self, request: pb.StatusRequest) -> pb.StatusResponse:
        reply = pb.StatusResponse()
        for condition in ("RuntimeReady", "NetworkReady"):
            reply.status.conditions.add(type=condition, status=True)
        return reply

    # --- sandboxes -----------------------------------------------------------------------------

    def _run_pod_sandbox(self, request: pb.RunPodSandboxRequest) -> pb.RunPodSandboxResponse:
        name = self._sandbox_name(request.config)
        for sandbox in self.sandboxes.values():
            if self._sandbox_name(sandbox.config) == name:
                raise GRPCError(
                    Status.UNKNOWN,
                    f"failed to reserve sandbox name {name!r}: name {name!r} is reserved for"
                    f" {sandbox.id!r}",
                )
        sandbox_id = self.add_sandbox(request.config)
        self.sandboxes[sandbox_id].runtime_handler = request.runtime_handler
        return pb.RunPodSandboxResponse(pod_sandbox_id=sandbox_id)

    def _stop_pod_sandbox(self, request: pb.StopPodSandboxRequest) -> pb.StopPodSandboxResponse:
        sandbox = self._sandbox(request.pod_sandbox_id)
        for container in self.containers.values():
            if container.sandbox_id == sandbox.id and container.state == pb.CONTAINER_RUNNING:
                self._exited(container, _SIGKILL_EXIT)
        sandbox.state = pb.SANDBOX_NOTREADY
        return pb.StopPodSandboxResponse()

    def _remove_pod_sandbox(
        self, request: pb.RemovePodSandboxRequest
    ) -> pb.RemovePodSandboxResponse:
        found = _resolve(request.pod_sandbox_id, self.sandboxes)
        if found is not None:
            for container_id in [c.id for c in self.containers.values() if c.sandbox_id == found]:
                del self.containers[container_id]
            del self.sandboxes[found]
        return pb.RemovePodSandboxResponse()

    def _pod_sandbox(self, sandbox: FakeSandbox) -> pb.PodSandbox:
        return pb.PodSandbox(
            id=sandbox.id,
            metadata=sandbox.config.metadata,
            state=_sandbox_state(sandbox.state),
            created_at=sandbox.created_at,
            labels=sandbox.config.labels,
            annotations=sandbox.config.annotations,
            runtime_handler=sandbox.runtime_handler,
        )

    def _pod_sandbox_status(
        self, request: pb.PodSandboxStatusRequest
    ) -> pb.PodSandboxStatusResponse:
        sandbox = self._sandbox(request.pod_sandbox_id)
        config = sandbox.config
        reply = pb.PodSandboxStatusResponse(
            status=pb.PodSandboxStatus(
                id=sandbox.id,
                metadata=config.metadata,
                state=_sandbox_state(sandbox.state),
                created_at=sandbox.created_at,
                labels=config.labels,
                annotations=config.annotations,
                runtime_handler=sandbox.runtime_handler,
            )
        )
        options = config.linux.security_context.namespace_options
        reply.status.linux.namespaces.options.CopyFrom(options)
        if request.verbose:
            info = {
                "pid": sandbox.pid,
                "processStatus": "running" if sandbox.state == pb.SANDBOX_READY else "deleted",
                "runtimeHandler": sandbox.runtime_handler,
                "config": _config_json(config),
            }
            reply.info["info"] = json.dumps(info)
        return reply

    def _list_pod_sandbox(self, request: pb.ListPodSandboxRequest) -> pb.ListPodSandboxResponse:
        query = request.filter
        sandboxes: Iterable[FakeSandbox] = self.sandboxes.values()
        if query.id:
            found = _resolve(query.id, self.sandboxes)
            sandboxes = [self.sandboxes[found]] if found is not None else []
        reply = pb.ListPodSandboxResponse()
        for sandbox in sandboxes:
            if query.HasField("state") and sandbox.state != query.state.state:
                continue
            if not _matches(sandbox.config.labels, query.label_selector):
                continue
            reply.items.append(self._pod_sandbox(sandbox))
        return reply

    # --- containers ----------------------------------------------------------------------------

    def _create_container(self, request: pb.CreateContainerRequest) -> pb.CreateContainerResponse:
        sandbox = self._sandbox(request.pod_sandbox_id)
        if sandbox.state != pb.SANDBOX_READY:
            raise GRPCError(Status.UNKNOWN, f"sandbox container {sandbox.id!r} is not running")
        meta = request.config.metadata
        name = f"{meta.name}_{self._sandbox_name(sandbox.config)}"
        for other in self.containers.values():
            other_meta = other.config.metadata
            if (other.sandbox_id, other_meta.name, other_meta.attempt) == (
                sandbox.id,
                meta.name,
                meta.attempt,
            ):
                raise GRPCError(
                    Status.UNKNOWN,
                    f"failed to reserve container name {name!r}: name {name!r} is reserved"
                    f" for {other.id!r}",
                )
        container_id = self.add_container(sandbox.id, request.config, pb.CONTAINER_CREATED)
        return pb.CreateContainerResponse(container_id=container_id)

    def _start_container(self, request: pb.StartContainerRequest) -> pb.StartContainerResponse:
        container = self._container(request.container_id)
        if container.state != pb.CONTAINER_CREATED:
            state = pb.ContainerState.Name(_container_state(container.state))
            raise GRPCError(Status.UNKNOWN, f"container is in {state} state")
        self._check_memory_nodes(container.resources.cpuset_mems)
        container.state = pb.CONTAINER_RUNNING
        container.started_at = time.time_ns()
        container.pid = self.pid_source() if self.pid_source is not None else self._pid()
        self._make_cgroup(container)
        return pb.StartContainerResponse()

    def _stop_container(self, request: pb.StopContainerRequest) -> pb.StopContainerResponse:
        container = self._container(request.container_id)
        if container.state == pb.CONTAINER_RUNNING:
            self._exited(container, _SIGKILL_EXIT if request.timeout == 0 else 0)
        return pb.StopContainerResponse()

    def _remove_container(self, request: pb.RemoveContainerRequest) -> pb.RemoveContainerResponse:
        found = _resolve(request.container_id, self.containers)
        if found is not None:
            del self.containers[found]
        return pb.RemoveContainerResponse()

    def _list_containers(self, request: pb.ListContainersRequest) -> pb.ListContainersResponse:
        query = request.filter
        containers: Iterable[FakeContainer] = self.containers.values()
        if query.id:
            found = _resolve(query.id, self.containers)
            containers = [self.containers[found]] if found is not None else []
        sandbox_id = query.pod_sandbox_id
        if sandbox_id:
            sandbox_id = _resolve(sandbox_id, self.sandboxes) or sandbox_id
        reply = pb.ListContainersResponse()
        for container in containers:
            if sandbox_id and container.sandbox_id != sandbox_id:
                continue
            if query.HasField("state") and container.state != query.state.state:
                continue
            if not _matches(container.config.labels, query.label_selector):
                continue
            config = container.config
            reply.containers.append(
                pb.Container(
                    id=container.id,
                    pod_sandbox_id=container.sandbox_id,
                    metadata=config.metadata,
                    image=config.image,
                    image_ref=config.image.image,
                    state=_container_state(container.state),
                    created_at=container.created_at,
                    labels=config.labels,
                    annotations=config.annotations,
                )
            )
        return reply

    def _container_status(self, request: pb.ContainerStatusRequest) -> pb.ContainerStatusResponse:
        container = self._container(request.container_id)
        config = container.config
        reason = ""
        if container.state == pb.CONTAINER_EXITED:
            reason = "Completed" if container.exit_code == 0 else "Error"
        status = pb.ContainerStatus(
            id=container.id,
            metadata=config.metadata,
            state=_container_state(container.state),
            created_at=container.created_at,
            started_at=container.started_at,
            finished_at=container.finished_at,
            exit_code=container.exit_code,
            image=config.image,
            image_ref=config.image.image,
            reason=reason,
            labels=config.labels,
            annotations=config.annotations,
            mounts=config.mounts,
            log_path=config.log_path,
        )
        if self.reports_resources:
            status.resources.linux.CopyFrom(container.resources)
        reply = pb.ContainerStatusResponse(status=status)
        if request.verbose:
            reply.info["info"] = json.dumps(self._container_info(container))
        return reply

    def _container_info(self, container: FakeContainer) -> dict[str, Any]:
        resources = container.resources
        cpu = _omit_empty(
            {
                "shares": resources.cpu_shares,
                "quota": resources.cpu_quota,
                "period": resources.cpu_period,
                "cpus": resources.cpuset_cpus,
                "mems": resources.cpuset_mems,
            }
        )
        memory = _omit_empty(
            {
                "limit": resources.memory_limit_in_bytes,
                "swap": resources.memory_swap_limit_in_bytes,
            }
        )
        linux_resources = _omit_empty(
            {"cpu": cpu, "memory": memory, "unified": dict(resources.unified)}
        )
        return {
            "sandboxID": container.sandbox_id,
            "pid": container.pid,
            "removing": container.removing,
            "config": _config_json(container.config),
            "runtimeSpec": {
                "linux": {
                    "cgroupsPath": self.cgroup_path(container.id),
                    "resources": linux_resources,
                }
            },
        }

    def _update_container_resources(
        self, request: pb.UpdateContainerResourcesRequest
    ) -> pb.UpdateContainerResourcesResponse:
        container = self._container(request.container_id)
        if container.removing:
            raise GRPCError(Status.UNKNOWN, f"container {container.id!r} is in removing state")
        if container.state == pb.CONTAINER_RUNNING:
            # The spec's as updated: containerd keeps the nodes it holds when none are given.
            self._check_memory_nodes(request.linux.cpuset_mems or container.resources.cpuset_mems)
        cgroup = self.cgroup_dir(container.id)
        running = container.state == pb.CONTAINER_RUNNING and cgroup is not None
        if running and cgroup is not None and cgroup.is_dir() and self.children_bound_updates:
            # runc update writes the container's own files only, as the kernel refuses them.
            wanted = {
                "cpuset.cpus": request.linux.cpuset_cpus or container.resources.cpuset_cpus,
                "cpuset.mems": request.linux.cpuset_mems,
            }
            for name, values in wanted.items():
                if values and v1_children_outside(cgroup, name, values):
                    raise GRPCError(
                        Status.UNKNOWN,
                        f"failed to update resources: write {cgroup}/{name}:"
                        " device or resource busy",
                    )
        merge_resources(container.resources, request.linux)
        if running and cgroup is not None and cgroup.is_dir():
            (cgroup / "cpuset.cpus").write_text(container.resources.cpuset_cpus + "\n")
            if (cgroup / "cpuset.mems").is_file() and container.resources.cpuset_mems:
                (cgroup / "cpuset.mems").write_text(container.resources.cpuset_mems + "\n")
        return pb.UpdateContainerResourcesResponse()
