"""The stateful fake containerd (tests/fake_runtime.py), driven over a real gRPC connection."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import pytest
from google.protobuf.message import Message
from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.const import Status as GrpcStatus
from grpclib.exceptions import GRPCError

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.methods import ALL_METHODS, REQUEST_TYPES
from shim.cri.upstream import RuntimeChannel
from tests.fake_cri import RawCodec
from tests.fake_runtime import FakeRuntime, merge_resources

pytestmark = pytest.mark.anyio

M = TypeVar("M", bound=Message)
RUNTIME = "/runtime.v1.RuntimeService/"


class Client:
    def __init__(self, endpoint: str) -> None:
        self.channel = RuntimeChannel(endpoint)

    async def raw(self, path: str, request: bytes) -> Reply:
        return await self.channel.unary(
            UnaryCall(path=path, headers=(), request=request, timeout=5.0)
        )

    async def call(self, method: str, request: Message) -> Reply:
        return await self.raw(RUNTIME + method, request.SerializeToString())

    async def ok(self, method: str, request: Message, reply_type: type[M]) -> M:
        reply = await self.call(method, request)
        assert reply.status is Status.OK, reply.status_message
        return reply_type.FromString(reply.messages[0])

    async def fails(self, method: str, request: Message, status: Status) -> str:
        reply = await self.call(method, request)
        assert reply.status is status, (reply.status, reply.status_message)
        return reply.status_message

    # --- shortcuts -----------------------------------------------------------------------------

    async def run_pod(self, name: str, uid: str = "", attempt: int = 0, **labels: str) -> str:
        request = pb.RunPodSandboxRequest(config=pod_config(name, uid or f"uid-{name}", attempt))
        request.config.labels.update(labels)
        reply = await self.ok("RunPodSandbox", request, pb.RunPodSandboxResponse)
        return reply.pod_sandbox_id

    async def create(self, sandbox_id: str, name: str, attempt: int = 0, **labels: str) -> str:
        config = container_config(name, attempt)
        config.labels.update(labels)
        request = pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config)
        reply = await self.ok("CreateContainer", request, pb.CreateContainerResponse)
        return reply.container_id

    async def start(self, container_id: str) -> None:
        request = pb.StartContainerRequest(container_id=container_id)
        await self.ok("StartContainer", request, pb.StartContainerResponse)

    async def status(self, container_id: str, verbose: bool = False) -> pb.ContainerStatusResponse:
        request = pb.ContainerStatusRequest(container_id=container_id, verbose=verbose)
        return await self.ok("ContainerStatus", request, pb.ContainerStatusResponse)

    async def update(self, container_id: str, **fields: Any) -> Reply:
        request = pb.UpdateContainerResourcesRequest(
            container_id=container_id, linux=pb.LinuxContainerResources(**fields)
        )
        return await self.call("UpdateContainerResources", request)

    async def container_ids(self, query: pb.ContainerFilter | None = None) -> list[str]:
        request = pb.ListContainersRequest(filter=query)
        reply = await self.ok("ListContainers", request, pb.ListContainersResponse)
        return [c.id for c in reply.containers]

    async def sandbox_ids(self, query: pb.PodSandboxFilter | None = None) -> list[str]:
        request = pb.ListPodSandboxRequest(filter=query)
        reply = await self.ok("ListPodSandbox", request, pb.ListPodSandboxResponse)
        return [s.id for s in reply.items]


def pod_config(name: str, uid: str, attempt: int = 0) -> pb.PodSandboxConfig:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace="default", attempt=attempt)
    )
    config.annotations["io.kubernetes.pod.uid"] = uid
    config.labels["app"] = name
    config.linux.cgroup_parent = f"/kubepods/pod{uid}"
    return config


def container_config(name: str, attempt: int = 0) -> pb.ContainerConfig:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=attempt),
        image=pb.ImageSpec(image="docker.io/library/busybox:1.36"),
    )
    config.labels["io.kubernetes.container.name"] = name
    resources = config.linux.resources
    resources.cpu_period = 100_000
    resources.cpu_quota = 200_000
    resources.cpu_shares = 2048
    resources.memory_limit_in_bytes = 1 << 30
    return config


@pytest.fixture
async def rt() -> AsyncIterator[FakeRuntime]:
    async with FakeRuntime() as runtime:
        yield runtime


@pytest.fixture
async def client(rt: FakeRuntime) -> AsyncIterator[Client]:
    c = Client(rt.endpoint)
    yield c
    c.channel.close()


# --- serving ---------------------------------------------------------------------------------


async def test_socket_path_endpoint_and_cleanup() -> None:
    async with FakeRuntime() as runtime:
        path = runtime.socket_path
        assert runtime.endpoint == f"unix://{path}"
        assert path.exists()
        assert len(str(path)) < 100
    assert not path.exists()
    assert not path.parent.exists()


async def test_version(client: Client, rt: FakeRuntime) -> None:
    reply = await client.ok("Version", pb.VersionRequest(version="v1"), pb.VersionResponse)
    assert reply.runtime_name == "fake-containerd"
    assert reply.runtime_api_version == "v1"
    assert reply.version == "0.0.0"
    assert rt.calls == [("Version", pb.VersionRequest(version="v1"))]


async def test_status_reports_ready(client: Client) -> None:
    reply = await client.ok("Status", pb.StatusRequest(), pb.StatusResponse)
    assert {(c.type, c.status) for c in reply.status.conditions} == {
        ("RuntimeReady", True),
        ("NetworkReady", True),
    }


async def test_other_methods_are_unimplemented(client: Client, rt: FakeRuntime) -> None:
    served = {
        "Version",
        "Status",
        "RunPodSandbox",
        "StopPodSandbox",
        "RemovePodSandbox",
        "PodSandboxStatus",
        "ListPodSandbox",
        "CreateContainer",
        "StartContainer",
        "StopContainer",
        "RemoveContainer",
        "ListContainers",
        "ContainerStatus",
        "UpdateContainerResources",
    }
    others = [m for m in ALL_METHODS if m.name not in served and not m.server_streaming]
    assert others
    for method in others:
        reply = await client.raw(method.path, b"")
        assert reply.status is Status.UNIMPLEMENTED, method.path
    # Unknown request types are recorded too (as Empty, fields kept as unknown fields).
    assert [name for name, _ in rt.calls] == [m.name for m in others]


async def _stream_status(channel: Channel, path: str) -> GrpcStatus:
    call = channel.request(path, Cardinality.UNARY_STREAM, bytes, bytes)
    try:
        async with call as stream:
            await stream.send_message(b"", end=True)
            await stream.recv_message()
    except GRPCError as exc:
        return exc.status
    return GrpcStatus.OK


async def test_streaming_methods_are_unimplemented(rt: FakeRuntime) -> None:
    channel = Channel(path=str(rt.socket_path), codec=RawCodec())
    try:
        for method in (m for m in ALL_METHODS if m.server_streaming):
            status = await _stream_status(channel, method.path)
            assert status is GrpcStatus.UNIMPLEMENTED, method.path
    finally:
        channel.close()


async def test_malformed_request_is_invalid_argument(client: Client, rt: FakeRuntime) -> None:
    reply = await client.raw(RUNTIME + "ListContainers", b"\x0a\x05ab")
    assert reply.status is Status.INVALID_ARGUMENT
    assert rt.calls == []


async def test_every_subset_request_type_decodes(client: Client, rt: FakeRuntime) -> None:
    reply = await client.raw(RUNTIME + "ListPodSandbox", b"")
    assert reply.status is Status.OK
    assert rt.calls_of("ListPodSandbox") == [pb.ListPodSandboxRequest()]
    assert isinstance(rt.calls[0][1], REQUEST_TYPES[RUNTIME + "ListPodSandbox"])


# --- lifecycle -------------------------------------------------------------------------------


async def test_container_lifecycle(client: Client, rt: FakeRuntime) -> None:
    sandbox_id = await client.run_pod("web")
    assert re.fullmatch("[0-9a-f]{64}", sandbox_id)
    assert rt.sandboxes[sandbox_id].state == pb.SANDBOX_READY

    container_id = await client.create(sandbox_id, "main")
    assert re.fullmatch("[0-9a-f]{64}", container_id)
    container = rt.containers[container_id]
    assert container.state == pb.CONTAINER_CREATED
    assert container.sandbox_id == sandbox_id
    assert container.resources.cpu_quota == 200_000
    # containerd: swap follows the memory limit when none is given.
    assert container.resources.memory_swap_limit_in_bytes == 1 << 30

    await client.start(container_id)
    status = (await client.status(container_id)).status
    assert status.state == pb.CONTAINER_RUNNING
    assert status.started_at >= status.created_at > 0
    assert status.metadata.name == "main"
    assert status.image.image == "docker.io/library/busybox:1.36"
    assert status.labels["io.kubernetes.container.name"] == "main"
    assert status.resources.linux == container.resources

    again = await client.fails(
        "StartContainer", pb.StartContainerRequest(container_id=container_id), Status.UNKNOWN
    )
    assert again == "container is in CONTAINER_RUNNING state"

    await client.ok(
        "StopContainer",
        pb.StopContainerRequest(container_id=container_id, timeout=30),
        pb.StopContainerResponse,
    )
    status = (await client.status(container_id)).status
    assert status.state == pb.CONTAINER_EXITED
    assert status.exit_code == 0
    assert status.finished_at >= status.started_at
    # Stopping again is fine.
    await client.ok(
        "StopContainer",
        pb.StopContainerRequest(container_id=container_id),
        pb.StopContainerResponse,
    )
    assert rt.containers[container_id].exit_code == 0

    await client.ok(
        "RemoveContainer",
        pb.RemoveContainerRequest(container_id=container_id),
        pb.RemoveContainerResponse,
    )
    assert container_id not in rt.containers
    await client.fails(
        "ContainerStatus", pb.ContainerStatusRequest(container_id=container_id), Status.NOT_FOUND
    )

    await client.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
        pb.StopPodSandboxResponse,
    )
    assert rt.sandboxes[sandbox_id].state == pb.SANDBOX_NOTREADY
    await client.ok(
        "RemovePodSandbox",
        pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
        pb.RemovePodSandboxResponse,
    )
    assert rt.sandboxes == {}
    names = [name for name, _ in rt.calls]
    assert names[:3] == ["RunPodSandbox", "CreateContainer", "StartContainer"]


async def test_stop_with_zero_timeout_is_a_kill(client: Client, rt: FakeRuntime) -> None:
    container_id = await client.create(await client.run_pod("web"), "main")
    await client.start(container_id)
    await client.ok(
        "StopContainer",
        pb.StopContainerRequest(container_id=container_id),
        pb.StopContainerResponse,
    )
    assert rt.containers[container_id].exit_code == 137
    status = (await client.status(container_id)).status
    assert status.reason == "Error"


async def test_stopping_a_created_container_leaves_it_created(
    client: Client, rt: FakeRuntime
) -> None:
    container_id = await client.create(await client.run_pod("web"), "main")
    await client.ok(
        "StopContainer",
        pb.StopContainerRequest(container_id=container_id),
        pb.StopContainerResponse,
    )
    assert rt.containers[container_id].state == pb.CONTAINER_CREATED


async def test_stop_pod_sandbox_stops_its_running_containers(
    client: Client, rt: FakeRuntime
) -> None:
    sandbox_id = await client.run_pod("web")
    running = await client.create(sandbox_id, "main")
    await client.start(running)
    created = await client.create(sandbox_id, "sidecar")
    other_pod = await client.run_pod("db")
    elsewhere = await client.create(other_pod, "main")
    await client.start(elsewhere)

    await client.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
        pb.StopPodSandboxResponse,
    )
    assert rt.containers[running].state == pb.CONTAINER_EXITED
    assert rt.containers[running].finished_at > 0
    assert rt.containers[running].exit_code == 137
    assert rt.containers[created].state == pb.CONTAINER_CREATED
    assert rt.containers[elsewhere].state == pb.CONTAINER_RUNNING
    assert rt.sandboxes[sandbox_id].state == pb.SANDBOX_NOTREADY

    # No new containers in a stopped sandbox.
    request = pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container_config("x"))
    await client.fails("CreateContainer", request, Status.UNKNOWN)

    # Removing the sandbox removes its containers.
    await client.ok(
        "RemovePodSandbox",
        pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
        pb.RemovePodSandboxResponse,
    )
    assert set(rt.containers) == {elsewhere}
    assert set(rt.sandboxes) == {other_pod}


async def test_unknown_ids(client: Client, rt: FakeRuntime) -> None:
    missing = "f" * 64
    for method, request in [
        ("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=missing)),
        ("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=missing)),
        ("CreateContainer", pb.CreateContainerRequest(pod_sandbox_id=missing)),
        ("StartContainer", pb.StartContainerRequest(container_id=missing)),
        ("StopContainer", pb.StopContainerRequest(container_id=missing)),
        ("ContainerStatus", pb.ContainerStatusRequest(container_id=missing)),
        ("UpdateContainerResources", pb.UpdateContainerResourcesRequest(container_id=missing)),
    ]:
        message = await client.fails(method, request, Status.NOT_FOUND)
        assert "not found" in message
    # Removing what is not there succeeds, as in containerd.
    await client.ok(
        "RemovePodSandbox",
        pb.RemovePodSandboxRequest(pod_sandbox_id=missing),
        pb.RemovePodSandboxResponse,
    )
    await client.ok(
        "RemoveContainer",
        pb.RemoveContainerRequest(container_id=missing),
        pb.RemoveContainerResponse,
    )


async def test_ids_may_be_unique_prefixes(client: Client, rt: FakeRuntime) -> None:
    container_id = await client.create(await client.run_pod("web"), "main")
    status = await client.status(container_id[:12])
    assert status.status.id == container_id


# --- name reservation ------------------------------------------------------------------------


async def test_sandbox_name_reservation(client: Client, rt: FakeRuntime) -> None:
    first = await client.run_pod("web", uid="u1")
    request = pb.RunPodSandboxRequest(config=pod_config("web", "u1"))
    message = await client.fails("RunPodSandbox", request, Status.UNKNOWN)
    assert message.startswith("failed to reserve sandbox name")
    assert set(rt.sandboxes) == {first}
    # Another attempt, or another uid, is another name.
    await client.run_pod("web", uid="u1", attempt=1)
    await client.run_pod("web", uid="u2")
    # Removal frees the name; stopping does not.
    await client.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=first),
        pb.StopPodSandboxResponse,
    )
    await client.fails("RunPodSandbox", request, Status.UNKNOWN)
    await client.ok(
        "RemovePodSandbox",
        pb.RemovePodSandboxRequest(pod_sandbox_id=first),
        pb.RemovePodSandboxResponse,
    )
    await client.run_pod("web", uid="u1")


async def test_container_name_reservation(client: Client, rt: FakeRuntime) -> None:
    sandbox_id = await client.run_pod("web")
    first = await client.create(sandbox_id, "main")
    request = pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container_config("main"))
    message = await client.fails("CreateContainer", request, Status.UNKNOWN)
    assert message.startswith("failed to reserve container name")
    assert set(rt.containers) == {first}
    # Exited containers still hold their name...
    await client.start(first)
    rt.exit_container(first, 1)
    await client.fails("CreateContainer", request, Status.UNKNOWN)
    # ...a new attempt or another sandbox is another name...
    await client.create(sandbox_id, "main", attempt=1)
    await client.create(await client.run_pod("db"), "main")
    # ...and removal frees it.
    await client.ok(
        "RemoveContainer",
        pb.RemoveContainerRequest(container_id=first),
        pb.RemoveContainerResponse,
    )
    await client.create(sandbox_id, "main")


# --- UpdateContainerResources ----------------------------------------------------------------


async def test_update_merges_non_zero_fields(client: Client, rt: FakeRuntime) -> None:
    container_id = await client.create(await client.run_pod("web"), "main")
    await client.start(container_id)
    reply = await client.update(container_id, cpuset_cpus="1-2", cpu_quota=-1)
    assert reply.status is Status.OK
    resources = rt.containers[container_id].resources
    assert resources.cpuset_cpus == "1-2"
    assert resources.cpu_quota == -1  # non-zero: overrides
    assert resources.cpu_period == 100_000  # zero in the request: kept
    assert resources.cpu_shares == 2048
    assert resources.memory_limit_in_bytes == 1 << 30

    await client.update(container_id, cpuset_mems="0", cpu_shares=1024)
    status = (await client.status(container_id)).status
    assert status.resources.linux.cpuset_cpus == "1-2"
    assert status.resources.linux.cpuset_mems == "0"
    assert status.resources.linux.cpu_shares == 1024
    assert status.resources.linux.cpu_quota == -1

    await client.update(container_id, memory_limit_in_bytes=2 << 30)
    assert resources.memory_limit_in_bytes == 2 << 30
    assert resources.memory_swap_limit_in_bytes == 2 << 30
    await client.update(container_id, memory_swap_limit_in_bytes=3 << 30, oom_score_adj=-997)
    assert resources.memory_swap_limit_in_bytes == 3 << 30
    assert resources.oom_score_adj == -997

    updates = [
        m
        for m in rt.calls_of("UpdateContainerResources")
        if isinstance(m, pb.UpdateContainerResourcesRequest)
    ]
    assert [m.linux.cpuset_cpus for m in updates] == [
        "1-2",
        "",
        "",
        "",
    ]


async def test_update_works_in_every_state_but_removing(client: Client, rt: FakeRuntime) -> None:
    container_id = await client.create(await client.run_pod("web"), "main")
    assert (await client.update(container_id, cpuset_cpus="1")).status is Status.OK
    await client.start(container_id)
    rt.exit_container(container_id)
    assert (await client.update(container_id, cpuset_cpus="2")).status is Status.OK
    assert rt.containers[container_id].resources.cpuset_cpus == "2"
    rt.containers[container_id].removing = True
    reply = await client.update(container_id, cpuset_cpus="3")
    assert reply.status is Status.UNKNOWN
    assert "removing" in reply.status_message
    assert rt.containers[container_id].resources.cpuset_cpus == "2"


async def test_memory_nodes_without_memory_are_refused_as_the_kernel_does(
    client: Client, rt: FakeRuntime
) -> None:
    """A runc write of a cpuset.mems naming a node without memory fails (EINVAL): at a start,
    and at an update of a running container, whose spec keeps its nodes when none are given.
    A container not started has no cgroup: only its spec changes."""
    rt.memory_nodes = CPUSet.parse("0")
    sandbox_id = await client.run_pod("web")
    container_id = await client.create(sandbox_id, "main")
    assert (await client.update(container_id, cpuset_mems="1")).status is Status.OK
    message = await client.fails(
        "StartContainer", pb.StartContainerRequest(container_id=container_id), Status.UNKNOWN
    )
    assert "cpuset.mems: invalid argument" in message
    assert (await client.update(container_id, cpuset_mems="0")).status is Status.OK
    await client.start(container_id)
    assert (await client.update(container_id, cpuset_mems="0-1")).status is Status.UNKNOWN
    resources = rt.containers[container_id].resources
    assert resources.cpuset_mems == "0"  # containerd puts the spec back
    assert (await client.update(container_id, cpuset_cpus="2")).status is Status.OK
    # Node 1's memory went offline since the spec named it.
    resources.cpuset_mems = "0-1"
    assert (await client.update(container_id, cpuset_cpus="3")).status is Status.UNKNOWN
    assert (await client.update(container_id, cpuset_cpus="3", cpuset_mems="0")).status is Status.OK


def test_merge_hugepages_and_unified() -> None:
    current = pb.LinuxContainerResources(
        hugepage_limits=[
            pb.HugepageLimit(page_size="2MB", limit=1),
            pb.HugepageLimit(page_size="1GB"),
        ],
        unified={"memory.high": "1", "cpu.weight": "10"},
    )
    merge_resources(
        current,
        pb.LinuxContainerResources(
            hugepage_limits=[pb.HugepageLimit(page_size="2MB", limit=4)],
            unified={"memory.high": "2"},
        ),
    )
    assert {(h.page_size, h.limit) for h in current.hugepage_limits} == {("2MB", 4), ("1GB", 0)}
    assert dict(current.unified) == {"memory.high": "2", "cpu.weight": "10"}
    merge_resources(current, pb.LinuxContainerResources())
    assert len(current.hugepage_limits) == 2


# --- lists -----------------------------------------------------------------------------------


async def test_list_containers_filters(client: Client, rt: FakeRuntime) -> None:
    web = await client.run_pod("web")
    db = await client.run_pod("db")
    web_main = await client.create(web, "main", tier="front")
    web_side = await client.create(web, "side", tier="front")
    db_main = await client.create(db, "main", tier="back")
    await client.start(web_main)
    await client.start(db_main)

    assert await client.container_ids() == [web_main, web_side, db_main]
    assert await client.container_ids(pb.ContainerFilter(pod_sandbox_id=web)) == [
        web_main,
        web_side,
    ]
    assert await client.container_ids(pb.ContainerFilter(id=db_main)) == [db_main]
    assert await client.container_ids(pb.ContainerFilter(id="0" * 64)) == []
    running = pb.ContainerFilter(state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING))
    assert await client.container_ids(running) == [web_main, db_main]
    # A set state of CREATED (0) filters too: it is a message, present or not.
    created = pb.ContainerFilter(state=pb.ContainerStateValue(state=pb.CONTAINER_CREATED))
    assert await client.container_ids(created) == [web_side]
    front = pb.ContainerFilter(label_selector={"tier": "front"})
    assert await client.container_ids(front) == [web_main, web_side]
    both = pb.ContainerFilter(
        pod_sandbox_id=web, label_selector={"tier": "front"}, state=running.state
    )
    assert await client.container_ids(both) == [web_main]
    assert await client.container_ids(pb.ContainerFilter(label_selector={"tier": "x"})) == []

    reply = await client.ok("ListContainers", pb.ListContainersRequest(), pb.ListContainersResponse)
    item = reply.containers[0]
    assert item.pod_sandbox_id == web
    assert item.metadata.name == "main"
    assert item.image.image == "docker.io/library/busybox:1.36"
    assert item.state == pb.CONTAINER_RUNNING
    assert item.created_at > 0
    assert item.labels["tier"] == "front"


async def test_list_pod_sandbox_filters(client: Client, rt: FakeRuntime) -> None:
    web = await client.run_pod("web", tier="front")
    db = await client.run_pod("db", tier="back")
    await client.ok(
        "StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=db), pb.StopPodSandboxResponse
    )
    assert await client.sandbox_ids() == [web, db]
    assert await client.sandbox_ids(pb.PodSandboxFilter(id=db)) == [db]
    ready = pb.PodSandboxFilter(state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY))
    assert await client.sandbox_ids(ready) == [web]
    not_ready = pb.PodSandboxFilter(state=pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY))
    assert await client.sandbox_ids(not_ready) == [db]
    assert await client.sandbox_ids(pb.PodSandboxFilter(label_selector={"tier": "back"})) == [db]

    reply = await client.ok("ListPodSandbox", pb.ListPodSandboxRequest(), pb.ListPodSandboxResponse)
    item = reply.items[0]
    assert item.metadata.name == "web"
    assert item.metadata.uid == "uid-web"
    assert item.state == pb.SANDBOX_READY
    assert item.annotations["io.kubernetes.pod.uid"] == "uid-web"
    assert item.labels["tier"] == "front"


# --- verbose status --------------------------------------------------------------------------


async def test_pod_sandbox_status_verbose_info(client: Client, rt: FakeRuntime) -> None:
    sandbox_id = await client.run_pod("web")
    request = pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id)
    plain = await client.ok("PodSandboxStatus", request, pb.PodSandboxStatusResponse)
    assert plain.status.id == sandbox_id
    assert plain.status.metadata.name == "web"
    assert plain.status.state == pb.SANDBOX_READY
    assert plain.status.created_at > 0
    assert plain.status.labels["app"] == "web"
    assert plain.status.annotations["io.kubernetes.pod.uid"] == "uid-web"
    assert dict(plain.info) == {}

    request.verbose = True
    verbose = await client.ok("PodSandboxStatus", request, pb.PodSandboxStatusResponse)
    info = json.loads(verbose.info["info"])
    assert info["pid"] > 0
    assert info["config"] == {
        "metadata": {"name": "web", "uid": "uid-web", "namespace": "default"},
        "labels": {"app": "web"},
        "annotations": {"io.kubernetes.pod.uid": "uid-web"},
        "linux": {"cgroup_parent": "/kubepods/poduid-web"},
    }


async def test_container_status_verbose_info(client: Client, rt: FakeRuntime) -> None:
    sandbox_id = await client.run_pod("web")
    container_id = await client.create(sandbox_id, "main")
    await client.start(container_id)
    await client.update(container_id, cpuset_cpus="3", cpu_quota=-1)
    assert dict((await client.status(container_id)).info) == {}
    info = json.loads((await client.status(container_id, verbose=True)).info["info"])
    assert info["sandboxID"] == sandbox_id
    assert info["pid"] > 0
    linux = info["runtimeSpec"]["linux"]
    assert linux["cgroupsPath"] == f"/kubepods/poduid-web/{container_id}"
    assert linux["resources"]["cpu"] == {
        "shares": 2048,
        "quota": -1,
        "period": 100_000,
        "cpus": "3",
    }
    assert info["config"]["metadata"] == {"name": "main"}


# --- test controls ---------------------------------------------------------------------------


async def test_fail_next_changes_nothing(client: Client, rt: FakeRuntime) -> None:
    sandbox_id = await client.run_pod("web")
    rt.fail_next("CreateContainer", GrpcStatus.RESOURCE_EXHAUSTED, "disk full", count=2)
    request = pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container_config("main"))
    for _ in range(2):
        assert await client.fails("CreateContainer", request, Status.RESOURCE_EXHAUSTED) == (
            "disk full"
        )
    assert rt.containers == {}
    assert len(rt.calls_of("CreateContainer")) == 2
    container_id = await client.create(sandbox_id, "main")
    assert set(rt.containers) == {container_id}
    assert rt.calls_of("CreateContainer")[2] == request


async def test_fail_next_default_and_other_methods_unaffected(
    client: Client, rt: FakeRuntime
) -> None:
    container_id = await client.create(await client.run_pod("web"), "main")
    rt.fail_next("StartContainer", GrpcStatus.UNKNOWN)
    message = await client.fails(
        "StartContainer", pb.StartContainerRequest(container_id=container_id), Status.UNKNOWN
    )
    assert message == "injected"
    assert rt.containers[container_id].state == pb.CONTAINER_CREATED
    assert (await client.status(container_id)).status.state == pb.CONTAINER_CREATED
    await client.start(container_id)


def test_controls_reject_unknown_method_names() -> None:
    runtime = FakeRuntime()
    with pytest.raises(ValueError, match="not a CRI method"):
        runtime.fail_next("CreateContainers", GrpcStatus.UNKNOWN)
    with pytest.raises(ValueError, match="not a CRI method"):
        runtime.calls_of("/runtime.v1.RuntimeService/Version")


async def test_gate_holds_calls_until_set(client: Client, rt: FakeRuntime) -> None:
    sandbox_id = await client.run_pod("web")
    gate = rt.gate("CreateContainer")
    assert rt.gate("CreateContainer") is gate
    first = asyncio.create_task(client.create(sandbox_id, "a"))
    await wait_until(lambda: len(rt.calls_of("CreateContainer")) == 1)
    # Were the call not held, its reply would reach the client within two turns of the loop
    # after it was recorded: the reply crosses a unix socket within this process, which takes
    # turns, not time, however slow the host. Give it ten times that.
    for _ in range(20):
        await asyncio.sleep(0)
    assert not first.done()
    assert rt.containers == {}  # recorded, nothing done

    rt.ungate("CreateContainer")
    # A call after ungate goes through while the first is still held.
    second = await client.create(sandbox_id, "b")
    assert set(rt.containers) == {second}
    assert not first.done()

    gate.set()
    first_id = await first
    assert set(rt.containers) == {first_id, second}


async def test_gate_with_fail_next(client: Client, rt: FakeRuntime) -> None:
    container_id = await client.create(await client.run_pod("web"), "main")
    gate = rt.gate("StartContainer")
    rt.fail_next("StartContainer", GrpcStatus.DEADLINE_EXCEEDED, "slow")
    request = pb.StartContainerRequest(container_id=container_id)
    held = asyncio.create_task(client.call("StartContainer", request))
    await wait_until(lambda: len(rt.calls_of("StartContainer")) == 1)
    gate.set()
    assert (await held).status is Status.DEADLINE_EXCEEDED
    assert rt.containers[container_id].state == pb.CONTAINER_CREATED


async def test_exit_container(client: Client, rt: FakeRuntime) -> None:
    container_id = await client.create(await client.run_pod("web"), "main")
    with pytest.raises(ValueError, match="CONTAINER_CREATED"):
        rt.exit_container(container_id)
    await client.start(container_id)
    rt.exit_container(container_id, 3)
    status = (await client.status(container_id)).status
    assert status.state == pb.CONTAINER_EXITED
    assert status.exit_code == 3
    assert status.finished_at >= status.started_at
    assert status.reason == "Error"
    assert rt.calls_of("StopContainer") == []


async def test_added_objects_are_served(client: Client, rt: FakeRuntime) -> None:
    sandbox_id = rt.add_sandbox(pod_config("web", "u1"))
    config = container_config("main")
    config.linux.resources.cpuset_cpus = "0-7"
    container_id = rt.add_container(sandbox_id, config)
    config.linux.resources.cpuset_cpus = "changed"  # the fake keeps its own copy
    assert rt.calls == []

    assert await client.sandbox_ids() == [sandbox_id]
    status = (await client.status(container_id)).status
    assert status.state == pb.CONTAINER_RUNNING
    assert status.started_at > 0
    assert status.resources.linux.cpuset_cpus == "0-7"
    assert status.resources.linux.memory_swap_limit_in_bytes == 1 << 30

    exited = rt.add_container(sandbox_id, container_config("old"), pb.CONTAINER_EXITED)
    assert rt.containers[exited].finished_at > 0
    stopped = rt.add_sandbox(pod_config("db", "u2"), pb.SANDBOX_NOTREADY)
    assert rt.sandboxes[stopped].state == pb.SANDBOX_NOTREADY

    # Objects deleted behind the runtime's back are gone for the API too.
    del rt.containers[container_id]
    assert await client.container_ids() == [exited]


async def wait_until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    for _ in range(int(seconds * 1000)):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not met in time")
