"""A CRI client that speaks the way kubelet does, over grpcio (an independent gRPC stack).

Requests carry what kubelet puts in them for a pod on a node with the cgroupfs driver (or the
systemd one, when asked) and ``cpuManagerPolicy: none``: sandbox cgroup parents per QoS class,
kubelet's labels and annotations, and kubelet's resource arithmetic (shares, CFS period and
quota, oom_score_adj).
Pods use the host network, since the test machines have no CNI.

Every call has a deadline. Calls are made through generic ``unary_unary`` / ``unary_stream``
callables built from the method table, so the same client exercises any relay in between.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import grpc
from google.protobuf.message import Message

from shim.cri import runtime_v1_pb2 as pb
from shim.cri.methods import BY_PATH, IMAGE_SERVICE, REQUEST_TYPES, RESPONSE_TYPES, RUNTIME_SERVICE
from tests.harness.containerd import CgroupDriver, remove_cgroup, wait_for

QoSClass = Literal["guaranteed", "burstable", "besteffort"]

# kubelet's constants (pkg/kubelet/cm and pkg/kubelet/qos).
CPU_PERIOD_US = 100_000
MIN_SHARES = 2
SHARES_PER_CPU = 1024
MILLI_PER_CPU = 1000
MIN_QUOTA_US = 1000
GUARANTEED_OOM_SCORE_ADJ = -997
BESTEFFORT_OOM_SCORE_ADJ = 1000

DEFAULT_TIMEOUT = 30.0

# What containerd 1.6 answers, for a moment, about a container killed from outside.
CONTAINERD_CATCHING_UP = ("still running", "ttrpc: closed")

_ResponseT = TypeVar("_ResponseT", bound=Message)


def milli_cpu_to_shares(milli_cpu: int) -> int:
    """kubelet's MilliCPUToShares: 1024 shares per CPU, at least 2."""
    if milli_cpu == 0:
        return MIN_SHARES
    return max(milli_cpu * SHARES_PER_CPU // MILLI_PER_CPU, MIN_SHARES)


def milli_cpu_to_quota(milli_cpu: int, period: int = CPU_PERIOD_US) -> int:
    """kubelet's milliCPUToQuota: 0 (no limit) without a limit, else at least 1000 µs."""
    if milli_cpu == 0:
        return 0
    return max(milli_cpu * period // MILLI_PER_CPU, MIN_QUOTA_US)


def memory_capacity_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def oom_score_adj(qos: QoSClass, memory_request: int, memory_capacity: int) -> int:
    """kubelet's GetContainerOOMScoreAdjust for an ordinary (not node-critical) container."""
    if qos == "guaranteed":
        return GUARANTEED_OOM_SCORE_ADJ
    if qos == "besteffort":
        return BESTEFFORT_OOM_SCORE_ADJ
    adjust = 1000 - (1000 * memory_request) // memory_capacity
    # Burstable stays strictly between the other two classes.
    if adjust < 1000 + GUARANTEED_OOM_SCORE_ADJ:
        return 1000 + GUARANTEED_OOM_SCORE_ADJ
    if adjust == BESTEFFORT_OOM_SCORE_ADJ:
        return adjust - 1
    return adjust


def pod_cgroup_parent(qos: QoSClass, uid: str, driver: CgroupDriver = "cgroupfs") -> str:
    """The pod cgroup kubelet computes: a path with the cgroupfs driver, a slice with the
    systemd one (each level a dash-separated word, the UID's own dashes made underscores)."""
    levels = ["kubepods"] + ([] if qos == "guaranteed" else [qos]) + [f"pod{uid}"]
    if driver == "systemd":
        return "-".join(level.replace("-", "_") for level in levels) + ".slice"
    return "/" + "/".join(levels)


@dataclass(frozen=True, slots=True)
class Sandbox:
    """A pod sandbox this client ran: its id and the config every CreateContainer repeats."""

    id: str
    config: pb.PodSandboxConfig
    qos: QoSClass

    @property
    def uid(self) -> str:
        return self.config.metadata.uid


@dataclass(frozen=True, slots=True)
class ContainerResources:
    """A container's resources as in its pod spec: CPU in millicores, memory in bytes."""

    cpu_milli_request: int = 0
    cpu_milli_limit: int = 0
    memory_request: int = 0
    memory_limit: int = 0


MIB = 1024 * 1024
# A Guaranteed container asking for one whole CPU: exclusive under the static policy.
ONE_CPU = ContainerResources(1000, 1000, 32 * MIB, 32 * MIB)
# PID 1 of a test container traps SIGTERM and exits 0, so StopContainer returns without
# waiting out the grace period and the exit code is deterministic.
WORKLOAD = ["sh", "-c", "trap 'exit 0' TERM; sleep infinity & wait"]


@dataclass(frozen=True, slots=True)
class KernelCpus:
    """What the kernel says a container's main process may run on."""

    pid: int
    cpus_allowed_list: str
    cgroup_path: str
    cgroup_cpuset_cpus: str


@dataclass
class EventStream:
    """A GetContainerEvents stream; iterate it, and call :meth:`cancel` when done."""

    _call: grpc.Call
    _responses: Iterator[pb.ContainerEventResponse] = field(repr=False)

    def __iter__(self) -> Iterator[pb.ContainerEventResponse]:
        return self._responses

    def cancel(self) -> None:
        self._call.cancel()


class KubeletClient:
    """A kubelet-shaped CRI client for one endpoint (``unix:///path``)."""

    def __init__(
        self,
        endpoint: str,
        *,
        log_root: Path,
        timeout: float = DEFAULT_TIMEOUT,
        cgroup_driver: CgroupDriver = "cgroupfs",
    ) -> None:
        self.endpoint = endpoint
        self.cgroup_driver = cgroup_driver
        self.log_root = log_root
        self.timeout = timeout
        # kubelet's gRPC client options: large messages (ListContainers on busy nodes).
        self._channel = grpc.insecure_channel(
            endpoint,
            options=[
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                ("grpc.max_send_message_length", 16 * 1024 * 1024),
            ],
        )
        self._memory_capacity = memory_capacity_bytes()
        self._sandboxes: dict[str, Sandbox] = {}

    def __enter__(self) -> KubeletClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # -- transport --------------------------------------------------------------------------

    def call(
        self,
        path: str,
        request: Message,
        response_type: type[_ResponseT],
        timeout: float | None = None,
    ) -> _ResponseT:
        """One unary call to ``path`` with a deadline; raises grpc.RpcError on failure."""
        if path in REQUEST_TYPES and not isinstance(request, REQUEST_TYPES[path]):
            raise TypeError(f"{path} takes {REQUEST_TYPES[path].__name__}")
        stub = self._channel.unary_unary(
            path,
            request_serializer=_serialize,
            response_deserializer=response_type.FromString,
        )
        response: _ResponseT = stub(request, timeout=self.timeout if timeout is None else timeout)
        return response

    def call_raw(self, path: str, request: bytes, timeout: float | None = None) -> bytes:
        """One unary call with an undecoded request and reply, for any method name."""
        stub = self._channel.unary_unary(
            path, request_serializer=_identity, response_deserializer=_identity
        )
        response: bytes = stub(request, timeout=self.timeout if timeout is None else timeout)
        return response

    def _runtime(self, method: str, request: Message, timeout: float | None = None) -> Message:
        path = f"/{RUNTIME_SERVICE}/{method}"
        return self.call(path, request, RESPONSE_TYPES[path], timeout)

    def _image(self, method: str, request: Message, timeout: float | None = None) -> Message:
        path = f"/{IMAGE_SERVICE}/{method}"
        return self.call(path, request, RESPONSE_TYPES[path], timeout)

    # -- runtime, images --------------------------------------------------------------------

    def version(self) -> pb.VersionResponse:
        response = self._runtime("Version", pb.VersionRequest(version="v1"))
        assert isinstance(response, pb.VersionResponse)
        return response

    def status(self, verbose: bool = False) -> pb.StatusResponse:
        response = self._runtime("Status", pb.StatusRequest(verbose=verbose))
        assert isinstance(response, pb.StatusResponse)
        return response

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Poll Status until the runtime reports RuntimeReady (CRI initialises after serving)."""

        def ready() -> bool:
            try:
                conditions = self.status().status.conditions
            except grpc.RpcError:
                return False
            return any(c.type == "RuntimeReady" and c.status for c in conditions)

        wait_for(ready, timeout, f"RuntimeReady from {self.endpoint}", interval=0.05)

    def list_images(self) -> pb.ListImagesResponse:
        response = self._image("ListImages", pb.ListImagesRequest())
        assert isinstance(response, pb.ListImagesResponse)
        return response

    def image_status(self, image: str, verbose: bool = False) -> pb.ImageStatusResponse:
        response = self._image(
            "ImageStatus", pb.ImageStatusRequest(image=pb.ImageSpec(image=image), verbose=verbose)
        )
        assert isinstance(response, pb.ImageStatusResponse)
        return response

    # -- pods -------------------------------------------------------------------------------

    def sandbox_config(
        self,
        name: str,
        namespace: str,
        uid: str,
        qos: QoSClass,
        *,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        attempt: int = 0,
        pod_resources: ContainerResources | None = None,
    ) -> pb.PodSandboxConfig:
        """The PodSandboxConfig kubelet builds for a host-network pod."""
        log_directory = self.log_root / f"{namespace}_{name}_{uid}"
        pod_labels = dict(labels or {})
        pod_labels.update(
            {
                "io.kubernetes.pod.name": name,
                "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": uid,
            }
        )
        pod_annotations = {
            "kubernetes.io/config.source": "api",
            "kubernetes.io/config.seen": datetime.now(UTC).isoformat(),
        }
        pod_annotations.update(annotations or {})
        linux = pb.LinuxPodSandboxConfig(
            cgroup_parent=pod_cgroup_parent(qos, uid, self.cgroup_driver),
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD),
            ),
        )
        if pod_resources is not None:
            linux.resources.CopyFrom(self.linux_resources(qos, pod_resources))
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=name, uid=uid, namespace=namespace, attempt=attempt
            ),
            # kubelet leaves hostname empty for host-network pods: they share the node's UTS
            # namespace, and runc refuses to set a hostname without a private one.
            log_directory=str(log_directory),
            labels=pod_labels,
            annotations=pod_annotations,
            linux=linux,
        )

    def run_pod_sandbox(
        self,
        name: str,
        namespace: str,
        uid: str,
        qos: QoSClass,
        *,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        attempt: int = 0,
        pod_resources: ContainerResources | None = None,
        runtime_handler: str = "",
        timeout: float | None = None,
    ) -> Sandbox:
        config = self.sandbox_config(
            name,
            namespace,
            uid,
            qos,
            labels=labels,
            annotations=annotations,
            attempt=attempt,
            pod_resources=pod_resources,
        )
        # kubelet creates the pod log directory before it asks for the sandbox.
        Path(config.log_directory).mkdir(parents=True, exist_ok=True)
        response = self._runtime(
            "RunPodSandbox",
            pb.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler),
            timeout,
        )
        assert isinstance(response, pb.RunPodSandboxResponse)
        sandbox = Sandbox(response.pod_sandbox_id, config, qos)
        self._sandboxes[sandbox.id] = sandbox
        return sandbox

    def stop_pod_sandbox(self, sandbox_id: str) -> None:
        self._runtime("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id))

    def remove_pod_sandbox(self, sandbox_id: str) -> None:
        self._runtime("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id))
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is not None:
            # kubelet removes the pod cgroup once the pod is gone; runc created it implicitly.
            remove_cgroup(sandbox.config.linux.cgroup_parent)

    def pod_sandbox_status(
        self, sandbox_id: str, verbose: bool = False
    ) -> pb.PodSandboxStatusResponse:
        response = self._runtime(
            "PodSandboxStatus",
            pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=verbose),
        )
        assert isinstance(response, pb.PodSandboxStatusResponse)
        return response

    def list_pod_sandbox(
        self, sandbox_id: str = "", labels: Mapping[str, str] | None = None
    ) -> pb.ListPodSandboxResponse:
        request = pb.ListPodSandboxRequest()
        if sandbox_id or labels:
            request.filter.id = sandbox_id
            request.filter.label_selector.update(labels or {})
        response = self._runtime("ListPodSandbox", request)
        assert isinstance(response, pb.ListPodSandboxResponse)
        return response

    def teardown_pod(self, sandbox_id: str) -> None:
        """Stop and remove a pod the way kubelet does when it is deleted: containers first,
        the pod's cgroup last (also for a pod another client ran)."""
        cgroup = "" if sandbox_id in self._sandboxes else self._sandbox_cgroup(sandbox_id)
        for container in self.list_containers(sandbox_id=sandbox_id).containers:
            self._stop_and_remove(container.id, container.state == pb.CONTAINER_RUNNING)
        self.stop_pod_sandbox(sandbox_id)
        self.remove_pod_sandbox(sandbox_id)
        if cgroup:
            remove_cgroup(cgroup, with_empty_pod_parent=True)

    def _sandbox_cgroup(self, sandbox_id: str) -> str:
        """The sandbox's cgroup path as the runtime's spec names it (cgroupfs driver:
        ``<pod cgroup>/<sandbox id>``, systemd's: ``<pod slice>:cri-containerd:<sandbox
        id>``); "" when the runtime does not say."""
        try:
            info = self.pod_sandbox_status(sandbox_id, verbose=True).info.get("info", "")
            path = json.loads(info)["runtimeSpec"]["linux"]["cgroupsPath"]
        except (grpc.RpcError, ValueError, KeyError, TypeError):
            return ""
        if not isinstance(path, str):
            return ""
        return path if path.startswith("/") or path.count(":") == 2 else ""

    def _stop_and_remove(self, container_id: str, running: bool, budget: float = 10.0) -> None:
        """StopContainer (if listed running) and RemoveContainer, both again while containerd
        is still catching up with a kill from outside, as kubelet retries on its next sync.

        containerd 1.6 lists such a container as exited a moment before its own task
        bookkeeping agrees ("still running"), and a StopContainer that meets its exit handler
        deleting the task fails on the shim's closed connection ("ttrpc: closed",
        containerd/containerd#11505). Any other error, or one past ``budget``, is raised.
        """
        deadline = time.monotonic() + budget
        stop = running
        while True:
            try:
                if stop:
                    self.stop_container(container_id, timeout=0)
                self.remove_container(container_id)
                return
            except grpc.RpcError as error:
                details = error.details() or ""
                catching_up = any(sign in details for sign in CONTAINERD_CATCHING_UP)
                if not catching_up or time.monotonic() > deadline:
                    raise
            stop = True
            time.sleep(0.05)

    def teardown_all(self) -> list[str]:
        """Best effort teardown of every pod this client ran; returns the errors met."""
        errors: list[str] = []
        for sandbox_id in list(self._sandboxes):
            try:
                self.teardown_pod(sandbox_id)
            except grpc.RpcError as error:
                errors.append(f"{sandbox_id[:12]}: {error.code().name} {error.details()}")
        return errors

    # -- containers -------------------------------------------------------------------------

    def linux_resources(
        self, qos: QoSClass, resources: ContainerResources
    ) -> pb.LinuxContainerResources:
        """kubelet's calculateLinuxResources plus its oom_score_adj, for cgroup v1."""
        cpu_milli_for_shares = resources.cpu_milli_request
        if cpu_milli_for_shares == 0 and resources.cpu_milli_limit:
            # A limit without a request means request = limit.
            cpu_milli_for_shares = resources.cpu_milli_limit
        return pb.LinuxContainerResources(
            cpu_period=CPU_PERIOD_US,
            cpu_quota=milli_cpu_to_quota(resources.cpu_milli_limit),
            cpu_shares=milli_cpu_to_shares(cpu_milli_for_shares),
            memory_limit_in_bytes=resources.memory_limit,
            oom_score_adj=oom_score_adj(qos, resources.memory_request, self._memory_capacity),
        )

    def create_container(
        self,
        sandbox: Sandbox,
        name: str,
        image: str,
        command: Sequence[str],
        args: Sequence[str] = (),
        *,
        resources: ContainerResources = ContainerResources(),
        attempt: int = 0,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = None,
        cpuset_cpus: str = "",
        cpuset_mems: str = "",
        volumes: Sequence[pb.Mount] = (),
    ) -> str:
        """CreateContainer as kubelet sends it; returns the container id. ``cpuset_cpus``: what
        kubelet's own static CPU manager policy would put in the request for an exclusive
        container (cpushim's tests leave it to cpushim); ``cpuset_mems``: the NUMA nodes its
        Static memory manager policy chose for a Guaranteed container; ``volumes``: the pod's
        volume mounts, before kubelet's termination log."""
        # kubelet's EnsureImageExists: the image must be present (no pulls here).
        status = self.image_status(image)
        if not status.HasField("image"):
            raise LookupError(f"image {image} is not present in {self.endpoint}")
        pod = sandbox.config.metadata
        termination_log = (
            Path(sandbox.config.log_directory).parent
            / ".kubelet-pods"
            / pod.uid
            / "containers"
            / name
            / f"termination-{attempt}"
        )
        # kubelet bind-mounts a per-container file as /dev/termination-log; it must exist.
        termination_log.parent.mkdir(parents=True, exist_ok=True)
        termination_log.touch()
        linux_resources = self.linux_resources(sandbox.qos, resources)
        linux_resources.cpuset_cpus = cpuset_cpus
        linux_resources.cpuset_mems = cpuset_mems
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name, attempt=attempt),
            # kubelet names the image by the id ImageStatus gave and keeps what the user wrote.
            image=pb.ImageSpec(image=status.image.id or image, user_specified_image=image),
            command=list(command),
            args=list(args),
            envs=[pb.KeyValue(key=k, value=v) for k, v in sorted((envs or {}).items())],
            mounts=[
                *volumes,
                pb.Mount(
                    container_path="/dev/termination-log",
                    host_path=str(termination_log),
                    propagation=pb.PROPAGATION_PRIVATE,
                ),
            ],
            labels={
                "io.kubernetes.container.name": name,
                "io.kubernetes.pod.name": pod.name,
                "io.kubernetes.pod.namespace": pod.namespace,
                "io.kubernetes.pod.uid": pod.uid,
            },
            annotations={
                "io.kubernetes.container.hash": f"{zlib.crc32(f'{name}|{image}'.encode()):08x}",
                "io.kubernetes.container.restartCount": str(attempt),
                "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
                "io.kubernetes.container.terminationMessagePolicy": "File",
                "io.kubernetes.pod.terminationGracePeriod": "30",
            },
            log_path=f"{name}/{attempt}.log",
            linux=pb.LinuxContainerConfig(
                resources=linux_resources,
                security_context=pb.LinuxContainerSecurityContext(
                    namespace_options=pb.NamespaceOption(
                        network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD
                    ),
                ),
            ),
        )
        (Path(sandbox.config.log_directory) / name).mkdir(parents=True, exist_ok=True)
        response = self._runtime(
            "CreateContainer",
            pb.CreateContainerRequest(
                pod_sandbox_id=sandbox.id, config=config, sandbox_config=sandbox.config
            ),
            timeout,
        )
        assert isinstance(response, pb.CreateContainerResponse)
        return response.container_id

    def start_container(self, container_id: str) -> None:
        self._runtime("StartContainer", pb.StartContainerRequest(container_id=container_id))

    def stop_container(self, container_id: str, timeout: int = 30) -> None:
        """StopContainer with a grace period of ``timeout`` seconds (the call's deadline is
        extended by it, as kubelet does)."""
        self._runtime(
            "StopContainer",
            pb.StopContainerRequest(container_id=container_id, timeout=timeout),
            self.timeout + timeout,
        )

    def remove_container(self, container_id: str) -> None:
        self._runtime("RemoveContainer", pb.RemoveContainerRequest(container_id=container_id))

    def container_status(
        self, container_id: str, verbose: bool = False
    ) -> pb.ContainerStatusResponse:
        response = self._runtime(
            "ContainerStatus",
            pb.ContainerStatusRequest(container_id=container_id, verbose=verbose),
        )
        assert isinstance(response, pb.ContainerStatusResponse)
        return response

    def list_containers(
        self,
        sandbox_id: str = "",
        container_id: str = "",
        state: pb.ContainerState.ValueType | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> pb.ListContainersResponse:
        request = pb.ListContainersRequest()
        if sandbox_id or container_id or state is not None or labels:
            request.filter.pod_sandbox_id = sandbox_id
            request.filter.id = container_id
            if state is not None:
                request.filter.state.state = state
            request.filter.label_selector.update(labels or {})
        response = self._runtime("ListContainers", request)
        assert isinstance(response, pb.ListContainersResponse)
        return response

    def list_container_stats(self, sandbox_id: str = "") -> pb.ListContainerStatsResponse:
        request = pb.ListContainerStatsRequest()
        if sandbox_id:
            request.filter.pod_sandbox_id = sandbox_id
        response = self._runtime("ListContainerStats", request)
        assert isinstance(response, pb.ListContainerStatsResponse)
        return response

    def exec_sync(
        self, container_id: str, cmd: Sequence[str], timeout: int = 10
    ) -> pb.ExecSyncResponse:
        """ExecSync with a command timeout of ``timeout`` s; the deadline allows for it."""
        response = self._runtime(
            "ExecSync",
            pb.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=timeout),
            self.timeout + timeout,
        )
        assert isinstance(response, pb.ExecSyncResponse)
        return response

    def update_container_resources(
        self,
        container_id: str,
        linux: pb.LinuxContainerResources,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        self._runtime(
            "UpdateContainerResources",
            pb.UpdateContainerResourcesRequest(
                container_id=container_id, linux=linux, annotations=dict(annotations or {})
            ),
        )

    def container_events(self, timeout: float | None = None) -> EventStream:
        """Open the server-streaming GetContainerEvents call (kubelet's evented PLEG)."""
        path = f"/{RUNTIME_SERVICE}/GetContainerEvents"
        assert BY_PATH[path].server_streaming
        stub = self._channel.unary_stream(
            path,
            request_serializer=_serialize,
            response_deserializer=pb.ContainerEventResponse.FromString,
        )
        call = stub(pb.GetEventsRequest(), timeout=timeout)
        return EventStream(call, call)

    # -- kernel truth -----------------------------------------------------------------------

    def container_info(self, container_id: str) -> dict[str, Any]:
        """The runtime's verbose ContainerStatus info (containerd: pid, OCI spec, ...)."""
        info = self.container_status(container_id, verbose=True).info
        if "info" not in info:
            raise LookupError(f"no verbose info for container {container_id}")
        decoded = json.loads(info["info"])
        assert isinstance(decoded, dict), decoded
        return decoded

    def recorded_cpuset_cpus(self, container_id: str) -> str:
        """The container's cpuset as the runtime records it: its OCI spec, which containerd
        rewrites on UpdateContainerResources (and runc's ``update`` applies)."""
        spec = self.container_info(container_id)["runtimeSpec"]
        return str(spec["linux"]["resources"]["cpu"].get("cpus", ""))

    def container_pid(self, container_id: str) -> int:
        """The host pid of the container's main process, from ContainerStatus verbose info."""
        pid = self.container_info(container_id).get("pid", 0)
        if not isinstance(pid, int) or pid <= 0:
            raise LookupError(f"container {container_id} has no running process (pid {pid!r})")
        return pid

    def kernel_cpus(self, container_id: str) -> KernelCpus:
        return kernel_cpus_of_pid(self.container_pid(container_id))


def kernel_cpus_of_pid(pid: int) -> KernelCpus:
    """``Cpus_allowed_list`` of ``pid`` and ``cpuset.cpus`` of its cgroup v1 cpuset cgroup."""
    allowed = read_status_field(pid, "Cpus_allowed_list")
    cgroup_path = cpuset_cgroup_of_pid(pid)
    cpuset_cpus = (
        Path("/sys/fs/cgroup/cpuset", cgroup_path.lstrip("/"), "cpuset.cpus").read_text().strip()
    )
    return KernelCpus(pid, allowed, cgroup_path, cpuset_cpus)


def read_status_field(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    raise LookupError(f"/proc/{pid}/status has no {name}")


def cpuset_cgroup_of_pid(pid: int) -> str:
    """The pid's cgroup path in the v1 cpuset hierarchy, from /proc/<pid>/cgroup."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hierarchy_id, controllers, path = line.split(":", 2)
        if "cpuset" in controllers.split(","):
            return path
    raise LookupError(f"pid {pid} has no cgroup v1 cpuset hierarchy")


def cgroup_file(controller: str, cgroup_path: str, name: str) -> str:
    """Read a cgroup v1 control file, e.g. ``cgroup_file("cpu", path, "cpu.cfs_quota_us")``."""
    return Path("/sys/fs/cgroup", controller, cgroup_path.lstrip("/"), name).read_text().strip()


def wait_for_container_state(
    client: KubeletClient,
    container_id: str,
    state: pb.ContainerState.ValueType,
    timeout: float = 30.0,
) -> None:
    wait_for(
        lambda: client.container_status(container_id).status.state == state,
        timeout,
        f"container {container_id[:12]} to reach state {pb.ContainerState.Name(state)}",
        interval=0.05,
    )


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _identity(data: bytes) -> bytes:
    return data


def new_pod_uid() -> str:
    """A fresh pod UID in the form the API server assigns (a random UUID)."""
    return str(uuid.uuid4())
