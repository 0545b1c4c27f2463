"""A whole pod lifecycle in kubelet's call order, straight to containerd and through cpushim.

Each variant drives the same scenario and keeps a transcript of normalised answers (ids, pod
UIDs and timestamps replaced by placeholders); the two transcripts must be equal, which shows
that cpushim relays every call, reply, status code and stream faithfully. Alongside, the kernel
is asked what each running container may run on: its main process's ``Cpus_allowed_list`` must
equal its cgroup's ``cpuset.cpus``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shim.cri import runtime_v1_pb2 as pb
from tests.e2e.conftest import ENDPOINT_NAMES, Endpoint, endpoint_for
from tests.harness.containerd import wait_for
from tests.harness.images import TEST_IMAGE
from tests.harness.kubelet import (
    MIB,
    WORKLOAD,
    ContainerResources,
    KubeletClient,
    cgroup_file,
    new_pod_uid,
)

pytestmark = pytest.mark.e2e

GUARANTEED_ONE_CPU = ContainerResources(
    cpu_milli_request=1000, cpu_milli_limit=1000, memory_request=64 * MIB, memory_limit=64 * MIB
)
RESIZED = ContainerResources(
    cpu_milli_request=1000, cpu_milli_limit=1000, memory_request=128 * MIB, memory_limit=128 * MIB
)
MISSING_CONTAINER_ID = "0" * 64

_TIMESTAMP_KEYS = frozenset({"created_at", "started_at", "finished_at", "timestamp"})
# Values that differ between any two runs by nature, not because of the path the call took.
_VOLATILE_ANNOTATIONS = frozenset({"kubernetes.io/config.seen"})
# What cpushim decides for a container (its cpuset, its projection mount) is allowed to differ
# from a direct run; the kernel checks cover it instead.
_CPUSHIM_DECIDED_KEYS = frozenset({"cpuset_cpus", "cpuset_mems"})
_CPUSHIM_MOUNT_PREFIX = "/run/cpushim"


class Normaliser:
    """Turns responses into plain data with run-specific values replaced by placeholders."""

    def __init__(self) -> None:
        self._placeholders: dict[str, str] = {}

    def name(self, value: str, placeholder: str) -> None:
        if value:
            self._placeholders[value] = placeholder

    def message(self, message: Message) -> Any:
        return self.value(MessageToDict(message, preserving_proto_field_name=True))

    def value(self, value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return self._mapping(value, key)
        if isinstance(value, list):
            items = [self.value(item, key) for item in value]
            if key == "mounts":
                items = [
                    mount
                    for mount in items
                    if not str(mount.get("container_path", "")).startswith(_CPUSHIM_MOUNT_PREFIX)
                ]
            return items
        if key in _TIMESTAMP_KEYS:
            return "<timestamp>"
        if isinstance(value, str):
            # Longest first, so an id is not half-replaced through a shorter one it contains.
            for original in sorted(self._placeholders, key=len, reverse=True):
                value = value.replace(original, self._placeholders[original])
        return value

    def _mapping(self, mapping: dict[str, Any], key: str) -> dict[str, Any]:
        if key == "info":
            # Verbose info is runtime-private JSON (pids, paths, spec); its keys are the API.
            return {name: "<json>" for name in sorted(mapping)}
        result: dict[str, Any] = {}
        for name, item in mapping.items():
            if name in _CPUSHIM_DECIDED_KEYS:
                continue
            if key == "annotations" and name in _VOLATILE_ANNOTATIONS:
                result[name] = "<volatile>"
                continue
            result[self.value(name)] = self.value(item, name)
        return result


@dataclass
class Transcript:
    """The normalised answer of each step, in order."""

    steps: list[tuple[str, Any]] = field(default_factory=list)

    def record(self, step: str, answer: Any) -> None:
        self.steps.append((step, answer))


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    """The RpcError that ``call`` must raise."""
    try:
        call()
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call succeeded; an error status was expected")


class EventCollector:
    """Reads GetContainerEvents in a thread while the scenario runs (kubelet's evented PLEG).

    containerd 1.6 answers UNIMPLEMENTED at once; newer runtimes stream until cancelled.
    """

    def __init__(self, client: KubeletClient) -> None:
        self._stream = client.container_events()
        self.events: list[pb.ContainerEventResponse] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, name="container-events", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                self.events.append(event)
        except grpc.RpcError as error:
            self.error = error

    def finished(self, container_id: str) -> bool:
        if self.error is not None or not self._thread.is_alive():
            return True
        return any(
            event.container_id == container_id
            and event.container_event_type == pb.CONTAINER_DELETED_EVENT
            for event in self.events
        )

    def close(self) -> None:
        """Cancel the stream and join the reader (idempotent)."""
        self._stream.cancel()
        self._thread.join(timeout=10.0)

    def summary(self, container_id: str, normaliser: Normaliser) -> Any:
        wait_for(lambda: self.finished(container_id), 10.0, "the container's deleted event")
        self.close()
        error = self.error
        if error is not None and error.code() != grpc.StatusCode.CANCELLED:
            return {"code": error.code().name, "details": normaliser.value(error.details())}
        return [
            pb.ContainerEventType.Name(event.container_event_type)
            for event in self.events
            if event.container_id == container_id
        ]


def assert_kernel_agrees(client: KubeletClient, container_id: str) -> str:
    """The container's process may run exactly where its cgroup says; returns that set."""
    kernel = client.kernel_cpus(container_id)
    assert kernel.cpus_allowed_list, kernel
    assert kernel.cpus_allowed_list == kernel.cgroup_cpuset_cpus, kernel
    return kernel.cgroup_cpuset_cpus


def run_lifecycle(client: KubeletClient) -> Transcript:
    """Drive one Guaranteed pod with one 1-CPU container through its whole life."""
    events = EventCollector(client)
    try:
        return _lifecycle(client, events)
    finally:
        events.close()


def _lifecycle(client: KubeletClient, events: EventCollector) -> Transcript:
    transcript = Transcript()
    normaliser = Normaliser()
    uid = new_pod_uid()
    normaliser.name(uid, "<pod-uid>")
    container_id = ""

    version = client.version()
    assert version.runtime_api_version == "v1"
    transcript.record("Version", normaliser.message(version))

    status = client.status()
    assert any(c.type == "RuntimeReady" and c.status for c in status.status.conditions)
    transcript.record("Status", normaliser.message(status))

    images = client.list_images()
    assert any(TEST_IMAGE in image.repo_tags for image in images.images)
    transcript.record("ListImages", normaliser.message(images))

    image = client.image_status(TEST_IMAGE)
    assert image.HasField("image")
    transcript.record("ImageStatus", normaliser.message(image))

    sandbox = client.run_pod_sandbox(
        "lifecycle", "e2e", uid, "guaranteed", annotations={"e2e.cpushim.io/scenario": "lifecycle"}
    )
    normaliser.name(sandbox.id, "<sandbox-id>")
    try:
        sandbox_status = client.pod_sandbox_status(sandbox.id)
        assert sandbox_status.status.state == pb.SANDBOX_READY
        assert sandbox_status.status.linux.namespaces.options.network == pb.NODE
        transcript.record("PodSandboxStatus", normaliser.message(sandbox_status))

        container_id = client.create_container(
            sandbox,
            "main",
            TEST_IMAGE,
            WORKLOAD,
            resources=GUARANTEED_ONE_CPU,
        )
        normaliser.name(container_id, "<container-id>")
        created = client.container_status(container_id)
        assert created.status.state == pb.CONTAINER_CREATED
        transcript.record("ContainerStatus created", normaliser.message(created))

        client.start_container(container_id)
        running = client.container_status(container_id)
        assert running.status.state == pb.CONTAINER_RUNNING
        transcript.record("ContainerStatus running", normaliser.message(running))

        verbose = client.container_status(container_id, verbose=True)
        assert "info" in verbose.info
        transcript.record("ContainerStatus verbose", normaliser.message(verbose))

        containers = client.list_containers(sandbox_id=sandbox.id)
        assert [c.id for c in containers.containers] == [container_id]
        transcript.record("ListContainers", normaliser.message(containers))
        running_only = client.list_containers(
            state=pb.CONTAINER_RUNNING, labels={"io.kubernetes.pod.uid": uid}
        )
        assert [c.id for c in running_only.containers] == [container_id]

        sandboxes = client.list_pod_sandbox(sandbox_id=sandbox.id)
        assert [s.id for s in sandboxes.items] == [sandbox.id]
        transcript.record("ListPodSandbox", normaliser.message(sandboxes))

        cgroup_cpus = assert_kernel_agrees(client, container_id)
        transcript.record("kernel: Cpus_allowed_list == cpuset.cpus", True)

        echo = client.exec_sync(container_id, ["echo", "hello from", "cpushim e2e"])
        assert (echo.exit_code, echo.stdout) == (0, b"hello from cpushim e2e\n")
        transcript.record("ExecSync echo", normaliser.message(echo))

        proc_status = client.exec_sync(container_id, ["cat", "/proc/self/status"])
        assert proc_status.exit_code == 0
        allowed_lines = [
            line.split(":", 1)[1].strip()
            for line in proc_status.stdout.decode().splitlines()
            if line.startswith("Cpus_allowed_list:")
        ]
        # An exec'd process joins the container's cgroup, so the cgroup bounds it too.
        assert allowed_lines == [cgroup_cpus]
        transcript.record("ExecSync /proc/self/status", {"Cpus_allowed_list lines": 1})

        stats = client.list_container_stats(sandbox.id)
        assert [s.attributes.id for s in stats.stats] == [container_id]
        transcript.record(
            "ListContainerStats",
            [normaliser.message(s.attributes) for s in stats.stats],
        )

        # An in-place memory resize, as kubelet sends it: the whole resource set, new values.
        resized = client.linux_resources("guaranteed", RESIZED)
        client.update_container_resources(container_id, resized)
        kernel = client.kernel_cpus(container_id)
        memory_limit = int(cgroup_file("memory", kernel.cgroup_path, "memory.limit_in_bytes"))
        assert memory_limit == RESIZED.memory_limit
        assert cgroup_file("cpu", kernel.cgroup_path, "cpu.cfs_quota_us") == str(resized.cpu_quota)
        assert_kernel_agrees(client, container_id)
        transcript.record("UpdateContainerResources", "ok")
        transcript.record(
            "ContainerStatus resized", normaliser.message(client.container_status(container_id))
        )

        missing = rpc_error(lambda: client.container_status(MISSING_CONTAINER_ID))
        transcript.record(
            "ContainerStatus missing",
            {"code": missing.code().name, "details": normaliser.value(missing.details())},
        )
        unknown = rpc_error(
            lambda: client.call_raw("/runtime.v1.RuntimeService/CpushimE2eNoSuchMethod", b"")
        )
        transcript.record("unknown method", unknown.code().name)

        client.stop_container(container_id, timeout=10)
        stopped = client.container_status(container_id)
        assert stopped.status.state == pb.CONTAINER_EXITED
        assert stopped.status.exit_code == 0
        transcript.record("ContainerStatus exited", normaliser.message(stopped))

        client.remove_container(container_id)
        assert not client.list_containers(sandbox_id=sandbox.id).containers
        transcript.record("RemoveContainer", "ok")

        client.stop_pod_sandbox(sandbox.id)
        stopped_sandbox = client.pod_sandbox_status(sandbox.id)
        assert stopped_sandbox.status.state == pb.SANDBOX_NOTREADY
        transcript.record("PodSandboxStatus stopped", normaliser.message(stopped_sandbox))
    finally:
        # Whatever failed above, leave no pod behind (a no-op once removed).
        client.teardown_all()

    assert not client.list_pod_sandbox(sandbox_id=sandbox.id).items
    gone = rpc_error(lambda: client.pod_sandbox_status(sandbox.id))
    transcript.record("PodSandboxStatus removed", gone.code().name)
    transcript.record("GetContainerEvents", events.summary(container_id, normaliser))
    return transcript


# Transcripts of the runs so far in this session, by endpoint name.
_TRANSCRIPTS: dict[str, Transcript] = {}


def test_pod_lifecycle(kubelet: KubeletClient, endpoint: Endpoint) -> None:
    _TRANSCRIPTS[endpoint.name] = run_lifecycle(kubelet)


def test_direct_and_via_cpushim_agree(request: pytest.FixtureRequest) -> None:
    pod_log_root = request.getfixturevalue("pod_log_root")
    for name in ENDPOINT_NAMES:
        if name not in _TRANSCRIPTS:
            # Run on its own (e.g. with -k): make the missing transcript here.
            with KubeletClient(endpoint_for(name, request).address, log_root=pod_log_root) as c:
                _TRANSCRIPTS[name] = run_lifecycle(c)
    direct, via_cpushim = (_TRANSCRIPTS[name].steps for name in ENDPOINT_NAMES)
    assert [step for step, _ in via_cpushim] == [step for step, _ in direct]
    for (step, expected), (_, actual) in zip(direct, via_cpushim, strict=True):
        assert actual == expected, f"{step}: cpushim answered differently from containerd"
