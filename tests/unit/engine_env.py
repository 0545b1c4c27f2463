"""A fake 2-socket machine, a stateful fake containerd and kubelet's calls, for the engine's
unit tests. The machine: 2 sockets x 2 cores x 2 threads, siblings n and n+4, so socket 0 holds
CPUs 0,1,4,5 and socket 1 holds 2,3,6,7."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest

from shim.cgroups import CgroupLayout, CgroupVersion
from shim.checkpoint import CheckpointFile
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.server import RelayServer
from shim.cri.upstream import ChannelForward, RuntimeChannel
from shim.engine import Engine, EngineOptions, FailurePolicy, ProjectionSettings
from shim.engine import requests as rq
from shim.engine.resync import start as resync
from shim.policy import CPUPolicy
from shim.policy.static import StaticPolicy
from shim.progress import StartupProgress
from shim.run import RunOptions
from shim.state import integrity_problems
from tests.fake_cri import short_tmpdir
from tests.fake_runtime import FakeRuntime
from tests.harness.containerd import CgroupDriver
from tests.harness.kubelet import (
    QoSClass,
    milli_cpu_to_quota,
    milli_cpu_to_shares,
    pod_cgroup_parent,
)
from tests.harness.sysfs import MachineSpec, expected_topology

TOPOLOGY = expected_topology(MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2))
ALL = TOPOLOGY.online
GIB = 1024**3
# kubelet's packing puts a single CPU on the core that is already partly used: CPU 4, the
# sibling of reserved CPU 0.
FIRST_SINGLE = "4"
SHARED_AFTER_FIRST_SINGLE = "0-3,5-7"


def static_policy(reserved: str = "0") -> StaticPolicy:
    return StaticPolicy.create(TOPOLOGY, reserved=CPUSet.parse(reserved))


@dataclass
class Pod:
    sandbox_id: str
    config: pb.PodSandboxConfig
    qos: QoSClass

    @property
    def uid(self) -> str:
        return self.config.metadata.uid


@dataclass
class Kubelet:
    """Drives an engine with kubelet's calls and request shapes."""

    engine: Engine
    runtime: RuntimeChannel
    pods: list[Pod] = field(default_factory=list)
    # kubelet's --cgroup-driver: the form of the pods' cgroup parents.
    cgroup_driver: CgroupDriver = "cgroupfs"

    async def call(self, method: str, request: bytes, deadline: float = 10.0) -> Reply:
        call = UnaryCall(rq.RUNTIME + method, (), request, deadline)
        return await self.engine.handle(call, ChannelForward(self.runtime, call))

    async def ok(self, method: str, request: bytes) -> bytes:
        reply = await self.call(method, request)
        assert reply.status is Status.OK, f"{method}: {reply.status.name} {reply.status_message}"
        return reply.messages[0] if reply.messages else b""

    async def run_pod(
        self,
        name: str,
        qos: QoSClass,
        annotations: Mapping[str, str] | None = None,
        uid: str | None = None,
        resources: pb.LinuxContainerResources | None = None,
    ) -> Pod:
        """``resources``: the pod's totals kubelet puts in the sandbox config (its
        containers' or its pod-level resources), when a test needs them."""
        uid = uid or str(uuid.uuid4())
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace="default"),
            annotations=dict(annotations or {}),
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=pod_cgroup_parent(qos, uid, self.cgroup_driver), resources=resources
            ),
        )
        raw = await self.ok(
            "RunPodSandbox", pb.RunPodSandboxRequest(config=config).SerializeToString()
        )
        pod = Pod(pb.RunPodSandboxResponse.FromString(raw).pod_sandbox_id, config, qos)
        self.pods.append(pod)
        return pod

    def create_request(
        self, pod: Pod, name: str, milli_cpu: int = 0, attempt: int = 0, *, mems: str = ""
    ) -> pb.CreateContainerRequest:
        """kubelet's request; a Guaranteed pod's container has request == limit. ``mems``:
        the NUMA nodes kubelet's memory manager names (its Static policy)."""
        limit = milli_cpu if pod.qos == "guaranteed" else 0
        resources = pb.LinuxContainerResources(
            cpu_period=100_000,
            cpu_quota=milli_cpu_to_quota(limit),
            cpu_shares=milli_cpu_to_shares(milli_cpu),
            memory_limit_in_bytes=GIB if pod.qos == "guaranteed" else 0,
            oom_score_adj=-997 if pod.qos == "guaranteed" else 1000,
            cpuset_mems=mems,
        )
        return pb.CreateContainerRequest(
            pod_sandbox_id=pod.sandbox_id,
            config=pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name=name, attempt=attempt),
                image=pb.ImageSpec(image="busybox"),
                linux=pb.LinuxContainerConfig(resources=resources),
            ),
            sandbox_config=pod.config,
        )

    async def create(
        self, pod: Pod, name: str, milli_cpu: int = 0, attempt: int = 0, *, mems: str = ""
    ) -> Reply:
        request = self.create_request(pod, name, milli_cpu, attempt, mems=mems)
        return await self.call("CreateContainer", request.SerializeToString())

    async def start_new(
        self, pod: Pod, name: str, milli_cpu: int = 0, attempt: int = 0, *, mems: str = ""
    ) -> str:
        reply = await self.create(pod, name, milli_cpu, attempt, mems=mems)
        assert reply.status is Status.OK, reply.status_message
        container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
        await self.ok(
            "StartContainer",
            pb.StartContainerRequest(container_id=container_id).SerializeToString(),
        )
        # What the checkpoint says of it is written in the background: let it land.
        await self.engine.checkpoint_written()
        return container_id

    async def stop(self, container_id: str) -> None:
        request = pb.StopContainerRequest(container_id=container_id, timeout=10)
        await self.ok("StopContainer", request.SerializeToString())

    async def remove(self, container_id: str) -> None:
        request = pb.RemoveContainerRequest(container_id=container_id)
        await self.ok("RemoveContainer", request.SerializeToString())


@dataclass
class Env:
    fake: FakeRuntime
    state_dir: Path
    channel: RuntimeChannel
    engine: Engine
    kubelet: Kubelet

    def cpus(self, container_id: str) -> str:
        """The cpuset the runtime holds for a container (what its cgroup gets)."""
        return self.fake.containers[container_id].resources.cpuset_cpus

    def saved(self) -> dict[str, dict[str, str]]:
        body = orjson.loads((self.state_dir / "state.json").read_bytes())["body"]
        return {
            uid: {name: entry["cpus"] for name, entry in containers.items()}
            for uid, containers in body["assignments"].items()
        }

    def kernel_cpus(self, container_id: str) -> str | None:
        """What the container's (fake) cgroup says, when the fake keeps a cgroup tree."""
        return self.fake.cgroup_cpus(container_id)

    async def restart(
        self,
        policy: CPUPolicy | None = None,
        *,
        recover: bool = False,
        progress: StartupProgress | None = None,
    ) -> Engine:
        """A new engine on the same state dir and runtime, as after a crash; its resync tells
        ``progress`` how far it got."""
        engine = Engine(
            policy or self.engine.policy,
            CheckpointFile(self.state_dir),
            self.channel,
            self.engine.options,
            cgroups=self.engine.mover.layout,
            projection=self.engine.projection,
        )
        await resync(engine, recover_from_runtime=recover, progress=progress)
        self.engine = engine
        self.kubelet = Kubelet(engine, self.channel, self.kubelet.pods, self.kubelet.cgroup_driver)
        return engine


async def make_env(
    fake: FakeRuntime,
    state_dir: Path,
    policy: CPUPolicy | None = None,
    failure_policy: FailurePolicy = "fail-closed",
    *,
    options: EngineOptions | None = None,
    projection: ProjectionSettings | None = None,
) -> Env:
    """An engine on ``fake``; when the fake keeps a cgroup tree, the engine writes it (as a
    cgroup hierarchy of the fake's version), and kubelet's pods name cgroup parents in the
    form of the fake's cgroup driver."""
    channel = RuntimeChannel(fake.endpoint)
    layout = None
    if fake.cgroup_root is not None:
        layout = CgroupLayout(CgroupVersion(fake.cgroup_version), fake.cgroup_root)
    engine = Engine(
        policy or static_policy(),
        CheckpointFile(state_dir),
        channel,
        options or EngineOptions(failure_policy=failure_policy),
        cgroups=layout,
        projection=projection,
    )
    await resync(engine)
    kubelet = Kubelet(engine, channel, cgroup_driver=fake.cgroup_driver)
    return Env(fake, state_dir, channel, engine, kubelet)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    """The engine with the static policy, CPU 0 reserved, against a fresh fake runtime."""
    async with FakeRuntime() as fake:
        environment = await make_env(fake, tmp_path / "state")
        yield environment
        environment.channel.close()


@contextlib.asynccontextmanager
async def through_relay(env: Env) -> AsyncIterator[RuntimeChannel]:
    """The engine behind the relay, as cpushim serves kubelet: a channel to the relay's
    socket (the relay's own channel to the fake runtime is the engine's)."""
    with short_tmpdir() as workdir:
        relay = RelayServer(
            listen=f"unix://{workdir}/cri.sock",
            runtime_endpoint=env.fake.endpoint,
            interceptor=env.engine,
            runtime=env.channel,
            follower=env.engine,
        )
        await relay.start()
        kubelet = RuntimeChannel(f"unix://{workdir}/cri.sock")
        try:
            yield kubelet
        finally:
            kubelet.close()
            await relay.shutdown(1.0)


async def second_of_two_released(env: Env) -> Pod:
    """Two Guaranteed 1-CPU pods pinned, then stopped in turn: the second pod, whose CPU
    (1) the allocator alone would not choose again (it would give the first one's, 4)."""
    first = await env.kubelet.run_pod("first", "guaranteed")
    second = await env.kubelet.run_pod("second", "guaranteed")
    first_id = await env.kubelet.start_new(first, "main", 1000)
    second_id = await env.kubelet.start_new(second, "main", 1000)
    assert (env.cpus(first_id), env.cpus(second_id)) == (FIRST_SINGLE, "1")
    await env.kubelet.stop(first_id)
    await env.kubelet.stop(second_id)
    return second


async def pinned_on_half_cores(env: Env) -> tuple[Pod, str]:
    """A 2-CPU container pinned on halves of two cores (with CPU 0 reserved, and no option
    against it): socket 0 has only lone threads free when it is created, CPU 4 beside
    reserved 0 and the sibling of a 1-CPU neighbour's CPU, and kubelet's memory manager
    names node 0. Its pod and container id; the neighbours are stopped again."""
    first = await env.kubelet.start_new(await env.kubelet.run_pod("a", "guaranteed"), "m", 1000)
    neighbour_pod = await env.kubelet.run_pod("b", "guaranteed")
    neighbour = await env.kubelet.start_new(neighbour_pod, "m", 1000, mems="0")
    await env.kubelet.stop(first)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 2000, mems="0")
    await env.kubelet.stop(neighbour)
    halves = CPUSet.parse(env.cpus(container_id))
    assert len(halves) == 2
    assert env.engine.policy.topology.whole_cores_in(halves) != halves
    return pod, container_id


def assert_consistent(env: Env) -> None:
    """docs/architecture.md's invariants, on the engine's state and what the runtime holds."""
    state = env.engine.state
    assert integrity_problems(state, TOPOLOGY) == []
    for tracked in env.engine.containers.values():
        if tracked.phase.value == "exited":
            continue
        assignment = state.assignments.get(tracked.key)
        if assignment is not None and assignment.container_id == tracked.id:
            assert env.cpus(tracked.id) == str(assignment.cpus)
        else:
            assert env.cpus(tracked.id) == str(state.shared)


def updates_to(fake: FakeRuntime, container_id: str) -> list[str]:
    return [m.linux.cpuset_cpus for m in updates(fake) if m.container_id == container_id]


def updates(fake: FakeRuntime) -> list[pb.UpdateContainerResourcesRequest]:
    """The UpdateContainerResources requests the runtime got, in order."""
    return [
        m
        for m in fake.calls_of("UpdateContainerResources")
        if isinstance(m, pb.UpdateContainerResourcesRequest)
    ]


# What a runtime that is not what it claims may answer: no protobuf message.
UNDECODABLE = b"\x0a\x05ab"


def unreadable(env: Env, monkeypatch: pytest.MonkeyPatch, status: Status | None) -> set[str]:
    """Sandboxes and containers, by id, whose PodSandboxStatus and ContainerStatus calls
    fail with ``status`` (verbose or not) while their id is in the returned set; with
    ``status`` None they succeed with an answer that does not decode."""
    failing: set[str] = set()
    unary = env.channel.unary

    async def failed(call: UnaryCall, request: bytes | None = None) -> Reply:
        named = ""
        if call.path == rq.POD_SANDBOX_STATUS:
            named = pb.PodSandboxStatusRequest.FromString(call.request).pod_sandbox_id
        elif call.path == rq.CONTAINER_STATUS:
            named = pb.ContainerStatusRequest.FromString(call.request).container_id
        if named in failing:
            if status is None:
                return Reply.ok(UNDECODABLE)
            return Reply.error(status, "context deadline exceeded")
        return await unary(call, request)

    monkeypatch.setattr(env.channel, "unary", failed)
    return failing


async def until(condition: Callable[[], bool], what: str, deadline: float = 5.0) -> None:
    """Wait for ``condition`` (checked on every turn of the loop) for up to ``deadline`` s."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while not condition():
        if loop.time() > end:
            raise AssertionError(f"not within {deadline}s: {what}")
        await asyncio.sleep(0.001)


def in_process_options(fake: FakeRuntime, listen: Path, tmp_path: Path, sysfs: Path) -> RunOptions:
    """``cpushim run``'s options for a run in the test's own loop, in front of ``fake``:
    listening on ``listen``, its files below ``tmp_path``, no metrics."""
    return RunOptions(
        listen=f"unix://{listen}",
        runtime_endpoint=fake.endpoint,
        image_endpoint=fake.endpoint,
        state_dir=tmp_path / "state",
        sysfs_root=sysfs,
        projection_dir=tmp_path / "projection",
        metrics_address="",
    )
