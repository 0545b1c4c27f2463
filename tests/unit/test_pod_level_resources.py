"""Pods with pod-level resources (KEP-2837): kubelet's static policy pins none of their
containers, and cpushim must not pin each one with the whole pod's CPUs."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from grpclib.const import Status as GrpcStatus

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Status
from shim.engine.resync import adopt_sharing, sandbox_config
from shim.engine.sweeping import sweep
from shim.kube import QOSClass
from shim.pods import Pod as ShimPod
from shim.pods import (
    has_own_resources,
    plan_container,
    shows_pod_level_resources,
    takes_whole_pod,
)
from shim.policy.none import NonePolicy
from shim.state import Assignment, ContainerKey
from tests.fake_runtime import FakeRuntime
from tests.harness.kubelet import milli_cpu_to_quota, milli_cpu_to_shares
from tests.unit.engine_env import (
    GIB,
    TOPOLOGY,
    Env,
    Pod,
    assert_consistent,
    env,
    make_env,
    static_policy,
    until,
)
from tests.unit.test_sweeping import create_with_reply_lost

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


def pod_totals(milli_cpu: int, memory: int) -> pb.LinuxContainerResources:
    """The sandbox config's resources as kubelet's calculateSandboxResources gives them."""
    return pb.LinuxContainerResources(
        cpu_period=100_000,
        cpu_quota=milli_cpu_to_quota(milli_cpu),
        cpu_shares=milli_cpu_to_shares(milli_cpu),
        memory_limit_in_bytes=memory,
    )


async def create(
    env: Env, pod: Pod, name: str, milli_cpu: int, memory: int, attempt: int = 0
) -> str:
    """kubelet's create of a Guaranteed container with these limits (a container without
    limits of its own gets its pod's pod-level ones), not started."""
    request = env.kubelet.create_request(pod, name, milli_cpu, attempt)
    request.config.linux.resources.memory_limit_in_bytes = memory
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK, reply.status_message
    return pb.CreateContainerResponse.FromString(reply.messages[0]).container_id


async def start(
    env: Env, pod: Pod, name: str, milli_cpu: int, memory: int, attempt: int = 0
) -> str:
    """kubelet's create and start of such a container."""
    container_id = await create(env, pod, name, milli_cpu, memory, attempt)
    await env.kubelet.ok(
        "StartContainer", pb.StartContainerRequest(container_id=container_id).SerializeToString()
    )
    await env.engine.checkpoint_written()
    return container_id


async def resize_in_place(env: Env, container_id: str, milli_cpu: int, memory: int) -> None:
    """kubelet's in-place resize of a Guaranteed container (InPlacePodVerticalScaling)."""
    resize = pb.UpdateContainerResourcesRequest(
        container_id=container_id, linux=pod_totals(milli_cpu, memory)
    )
    await env.kubelet.ok("UpdateContainerResources", resize.SerializeToString())


async def test_containers_inheriting_the_pods_limits_share(env: Env) -> None:
    """spec.resources cpu 2, memory 2Gi; two containers with none of their own: each asks
    for the whole pod. The first is pinned (it cannot be told from a one-container pod);
    the second shows the pod-level resources, and both share, as with kubelet."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    app = await start(env, pod, "app", 2000, 2 * GIB)
    assert len(CPUSet.parse(env.cpus(app))) == 2
    helper = await start(env, pod, "helper", 2000, 2 * GIB)
    assert env.engine.state.assignments == {}
    shared = str(env.engine.state.shared)
    assert env.cpus(app) == shared
    assert env.cpus(helper) == shared
    assert env.engine.counters["pod_level_resource_pods"] == 1
    # The pinned one gets kubelet's quota back as it shares.
    [*_, update] = [
        m
        for m in env.fake.calls_of("UpdateContainerResources")
        if isinstance(m, pb.UpdateContainerResourcesRequest) and m.container_id == app
    ]
    assert update.linux.cpu_quota == milli_cpu_to_quota(2000)
    await env.engine.checkpoint_written()
    assert env.saved() == {}
    # A restart of the first (its next attempt) shares too, and so does a third container.
    third = await start(env, pod, "third", 2000, 2 * GIB)
    env.fake.exit_container(app)
    again = await start(env, pod, "app", 2000, 2 * GIB, attempt=1)
    assert env.engine.state.assignments == {}
    assert env.cpus(third) == env.cpus(again) == shared
    assert_consistent(env)


async def test_a_container_with_limits_of_its_own_beside_one_inheriting_shares(env: Env) -> None:
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(3000, 2 * GIB))
    own = await start(env, pod, "own", 1000, GIB)
    assert len(CPUSet.parse(env.cpus(own))) == 1
    await start(env, pod, "inherits", 3000, 2 * GIB)
    assert env.engine.state.assignments == {}
    assert_consistent(env)


async def test_an_inheriting_container_beside_one_sharing_on_limits_of_its_own_shares(
    env: Env,
) -> None:
    """spec.resources cpu 2, memory 2Gi; a logger with limits of its own (half a CPU, so it
    shares), then the app with none of its own. In an ordinary pod the totals would be the
    two containers' sums, so the app asking for all of them beside a live logger shows
    pod-level resources: it shares, as with kubelet."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    logger = await start(env, pod, "logger", 500, GIB // 4)
    app = await start(env, pod, "app", 2000, 2 * GIB)
    assert env.engine.state.assignments == {}
    assert env.cpus(app) == env.cpus(logger) == str(env.engine.state.shared)
    assert env.engine.counters["pod_level_resource_pods"] == 1
    assert_consistent(env)


async def test_a_sibling_sharing_on_limits_of_its_own_unpins_one_inheriting(env: Env) -> None:
    """The same pod, its containers in the other order: the app alone cannot be told from
    a one-container pod and is pinned; the logger's create shows the pod-level resources,
    and the app gives its CPUs back."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    app = await start(env, pod, "app", 2000, 2 * GIB)
    assert len(CPUSet.parse(env.cpus(app))) == 2
    logger = await start(env, pod, "logger", 500, GIB // 4)
    assert env.engine.state.assignments == {}
    assert env.cpus(app) == env.cpus(logger) == str(env.engine.state.shared)
    assert env.engine.counters["pod_level_resource_pods"] == 1
    await env.engine.checkpoint_written()
    assert env.saved() == {}
    assert_consistent(env)


async def test_an_ephemeral_container_beside_a_pinned_one_unpins_nothing(env: Env) -> None:
    """kubectl debug in an ordinary pod: the debug container has no resources of its own
    (kubelet's minimum shares, no memory limit), so it is no evidence, whatever it joins."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, GIB))
    main = await start(env, pod, "main", 2000, GIB)
    cpus = env.cpus(main)
    await start(env, pod, "debugger-x7k2q", 0, 0)
    assert env.cpus(main) == cpus
    assert env.engine.counters["pod_level_resource_pods"] == 0


async def test_containers_of_an_ordinary_pod_are_pinned(env: Env) -> None:
    """The pod's totals are its containers' sums: no container takes the whole pod."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(3000, 2 * GIB))
    first = await start(env, pod, "main", 2000, GIB)
    second = await start(env, pod, "sidecar", 1000, GIB)
    assert len(CPUSet.parse(env.cpus(first))) == 2
    assert len(CPUSet.parse(env.cpus(second))) == 1
    assert env.engine.counters["pod_level_resource_pods"] == 0


async def test_an_ephemeral_container_does_not_unpin_a_one_container_pod(env: Env) -> None:
    """kubectl debug adds a container with no resources to a running pod: it asks for no
    exclusive CPUs, so the pinned container it joins stays pinned."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, GIB))
    main = await start(env, pod, "main", 2000, GIB)
    cpus = env.cpus(main)
    debug = await start(env, pod, "debugger-x7k2q", 0, 0)
    assert env.cpus(main) == cpus
    assert env.cpus(debug) == str(env.engine.state.shared)
    assert env.engine.counters["pod_level_resource_pods"] == 0


async def test_an_init_container_that_took_the_whole_pod_and_exited_unpins_nothing(
    env: Env,
) -> None:
    """An init container larger than the app containers sets the pod's totals alone. Its
    exit may not be seen yet when kubelet creates the app container: the runtime says it
    exited, so the app container is pinned."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    init = await start(env, pod, "init", 2000, 2 * GIB)
    env.fake.exit_container(init)  # cpushim has not seen the exit
    app = await start(env, pod, "app", 1000, GIB)
    assert len(CPUSet.parse(env.cpus(app))) == 1
    assert list(env.engine.state.assignments) == [ContainerKey(pod.uid, "app")]
    assert env.engine.counters["pod_level_resource_pods"] == 0


async def test_an_init_container_that_took_the_whole_pod_and_exited_unpins_nothing_shared(
    env: Env,
) -> None:
    """The same with an app container that shares: its create, while the pod still holds
    the init container's CPUs, finds the init container exited, which is no evidence."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    init = await start(env, pod, "init", 2000, 2 * GIB)
    env.fake.exit_container(init)  # cpushim has not seen the exit
    await start(env, pod, "app", 1500, GIB)
    assert env.engine.state.assignments == {}
    assert env.engine.state.pod_level == frozenset()
    assert env.engine.counters["pod_level_resource_pods"] == 0


async def test_a_restart_finds_pod_level_resources_from_the_running_containers(env: Env) -> None:
    """cpushim stopped between the create that showed them and the checkpoint that gave the
    first container's CPUs back: the restart shares both, and its checkpoint holds none."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    app = await start(env, pod, "app", 2000, 2 * GIB)
    helper = await start(env, pod, "helper", 2000, 2 * GIB)
    # As if the release had not reached the disk: the first container's CPUs still held.
    held = Assignment(CPUSet.parse("4-5"), app, pod.sandbox_id, 0, "default/plr", None)
    stale = env.engine.state.assign(ContainerKey(pod.uid, "app"), held, env.engine.policy)
    env.engine.checkpoint.save_sync(stale)
    await env.restart()
    assert env.engine.state.assignments == {}
    assert env.engine.pods[pod.sandbox_id].pod_level_resources
    assert env.cpus(app) == env.cpus(helper) == str(env.engine.state.shared)
    assert env.saved() == {}
    assert_consistent(env)


async def test_a_restart_pins_an_ordinary_pods_containers(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(3000, 2 * GIB))
    first = await start(env, pod, "main", 2000, GIB)
    await start(env, pod, "sidecar", 1000, GIB)
    before = dict(env.engine.state.assignments)
    await env.restart()
    assert not env.engine.pods[pod.sandbox_id].pod_level_resources
    assert {k: a.cpus for k, a in env.engine.state.assignments.items()} == {
        k: a.cpus for k, a in before.items()
    }
    assert len(CPUSet.parse(env.cpus(first))) == 2


async def test_after_a_restart_a_sweep_does_not_unpin_a_resized_ordinary_pod_beside_a_sharer(
    env: Env,
) -> None:
    """An ordinary pod (main 1.5 CPUs/1.5Gi, logger half a CPU/512Mi; totals 2/2Gi) whose
    main is resized in place onto the totals: after a restart, the runtime's record shows it
    taking the whole pod beside the logger, as a pod-level pod's would. The start-up is
    stricter than a create (every container with resources of its own must take the whole
    pod), and a sweep must not mark the pod on the same record a moment later."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    main = await start(env, pod, "main", 1500, 3 * GIB // 2)
    await start(env, pod, "logger", 500, GIB // 2)
    await resize_in_place(env, main, 2000, 2 * GIB)
    await env.restart()
    assert not env.engine.pods[pod.sandbox_id].pod_level_resources, "ordinary pod marked"
    await sweep(env.engine)
    assert env.engine.state.pod_level == frozenset(), "ordinary pod marked by a sweep"
    assert env.engine.counters["pod_level_resource_pods"] == 0


def _pod(cpu_shares: int, memory: int) -> ShimPod:
    return ShimPod(
        "sandbox",
        uid="uid",
        name="p",
        namespace="default",
        qos=QOSClass.GUARANTEED,
        cgroup_parent="/kubepods/poduid",
        cpu_shares=cpu_shares,
        memory_limit=memory,
    )


@pytest.mark.parametrize(
    ("shares", "memory", "whole"),
    [
        (2048, 2 * GIB, True),
        (2048, GIB, False),  # its memory limit is its own
        (1024, 2 * GIB, False),  # its CPU is its own
        (4096, 4 * GIB, False),  # resized in place past the pod's record of its totals
    ],
)
def test_takes_whole_pod(shares: int, memory: int, whole: bool) -> None:
    resources = pb.LinuxContainerResources(cpu_shares=shares, memory_limit_in_bytes=memory)
    assert takes_whole_pod(_pod(2048, 2 * GIB), resources) is whole


@pytest.mark.parametrize(
    ("shares", "memory", "own"),
    [
        (2, 0, False),  # kubectl debug's container: kubelet's minimum shares, no limit
        (0, 0, False),  # another client's, naming no resources
        (2, GIB, True),  # a Guaranteed container of 1 or 2 milliCPU
        (512, 0, True),
    ],
)
def test_has_own_resources(shares: int, memory: int, own: bool) -> None:
    resources = pb.LinuxContainerResources(cpu_shares=shares, memory_limit_in_bytes=memory)
    assert has_own_resources(resources) is own


def test_a_pod_whose_totals_kubelet_did_not_give_has_no_whole() -> None:
    resources = pb.LinuxContainerResources(cpu_shares=2048, memory_limit_in_bytes=GIB)
    assert not takes_whole_pod(_pod(0, 0), resources)


@pytest.mark.parametrize(
    ("whole", "shown"),
    [
        ([], False),
        ([True], False),  # one alone: a one-container pod looks the same
        ([False, False], False),
        ([True, False], True),
        ([False, True, False], True),
    ],
)
def test_shows_pod_level_resources(whole: list[bool], shown: bool) -> None:
    assert shows_pod_level_resources(whole) is shown


def test_a_marked_pod_plans_no_exclusive_cpus() -> None:
    resources = pb.LinuxContainerResources(
        cpu_period=100_000, cpu_quota=200_000, cpu_shares=2048, memory_limit_in_bytes=GIB
    )
    pod = _pod(2048, GIB)
    assert plan_container(pod, "app", resources).exclusive == 2
    marked = replace(pod, pod_level_resources=True)
    assert plan_container(marked, "app", resources).exclusive is None


def test_pod_from_config_reads_the_pods_totals() -> None:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="p", uid="u", namespace="default"),
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent="/kubepods/podu", resources=pod_totals(2000, GIB)
        ),
    )
    pod = ShimPod.from_config("sandbox", config)
    assert (pod.cpu_shares, pod.memory_limit) == (2048, GIB)


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        # containerd (Go's encoding/json): numbers
        ({"cpu_shares": 2048, "memory_limit_in_bytes": GIB}, (2048, GIB)),
        # protobuf's JSON mapping: 64-bit integers as strings
        ({"cpu_shares": "2048", "memory_limit_in_bytes": str(GIB)}, (2048, GIB)),
        ({}, (0, 0)),
        ({"cpu_shares": "lots", "memory_limit_in_bytes": True}, (0, 0)),
        (None, (0, 0)),
    ],
)
def test_the_runtimes_record_of_the_pods_totals_is_read_at_start_up(
    resources: dict[str, object] | None, expected: tuple[int, int]
) -> None:
    linux: dict[str, object] = {"cgroup_parent": "/kubepods/podu"}
    if resources is not None:
        linux["resources"] = resources
    status = pb.PodSandboxStatusResponse()
    status.info["info"] = json.dumps({"config": {"linux": linux}})
    item = pb.PodSandbox(
        id="sandbox", metadata=pb.PodSandboxMetadata(name="p", uid="u", namespace="default")
    )
    config = sandbox_config(item, status)
    got = (config.linux.resources.cpu_shares, config.linux.resources.memory_limit_in_bytes)
    assert got == expected
    assert config.linux.cgroup_parent == "/kubepods/podu"


async def test_restart_keeps_a_marked_pod_unpinned_while_one_container_is_exited(
    env: Env,
) -> None:
    """Live: a pod-level pod is marked for good, and its containers' next attempts share.
    A restart of cpushim while one of its two containers is exited (in back-off) must
    decide the same; it pins the other with the whole pod's CPUs instead."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    app = await start(env, pod, "app", 2000, 2 * GIB)
    helper = await start(env, pod, "helper", 2000, 2 * GIB)
    assert env.engine.state.assignments == {}
    env.fake.exit_container(helper)  # crash-looping: exited, its next attempt waits
    await env.restart()
    assert env.engine.state.assignments == {}, "restart pinned a pod-level pod's container"
    assert env.cpus(app) == str(env.engine.state.shared)


async def test_restart_after_an_in_place_resize_does_not_unpin_an_ordinary_pod(
    env: Env,
) -> None:
    """An ordinary Guaranteed pod (main 2 CPUs/1Gi, sidecar 1 CPU/512Mi; sandbox totals
    3 CPUs/1.5Gi as RunPodSandbox gave them). kubelet resizes main in place to 4 CPUs/2Gi
    (UpdateContainerResources); the sandbox's record in containerd keeps the totals of its
    creation. cpushim pins main's 4 CPUs and keeps both pinned while it runs; a restart must
    too."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(3000, GIB + GIB // 2))
    main = await start(env, pod, "main", 2000, GIB)
    sidecar = await start(env, pod, "sidecar", 1000, GIB // 2)
    assert len(env.engine.state.assignments) == 2
    await resize_in_place(env, main, 4000, 2 * GIB)
    resized = {k: a.cpus for k, a in env.engine.state.assignments.items()}
    assert len(resized[ContainerKey(pod.uid, "main")]) == 4
    await env.restart()
    assert not env.engine.pods[pod.sandbox_id].pod_level_resources
    assert {k: a.cpus for k, a in env.engine.state.assignments.items()} == resized
    assert len(CPUSet.parse(env.cpus(sidecar))) == 1


async def test_a_create_while_the_first_container_is_being_pinned_is_not_pinned_too(
    env: Env,
) -> None:
    """Two creates of a pod-level pod at once (kubelet gave up on the first's deadline and
    went on to the next container): the second must see the first, whose create holds the
    lock with its CPUs assigned; it is pinned as well, the pod holding its CPUs twice."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    gate = env.fake.gate("CreateContainer")

    async def create(name: str) -> str:
        request = env.kubelet.create_request(pod, name, 2000)
        request.config.linux.resources.memory_limit_in_bytes = 2 * GIB
        reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
        assert reply.status is Status.OK, reply.status_message
        return pb.CreateContainerResponse.FromString(reply.messages[0]).container_id

    first = asyncio.ensure_future(create("app"))
    await until(lambda: bool(env.engine.state.assignments), "the first create decided")
    second = asyncio.ensure_future(create("helper"))
    await until(lambda: env.engine.creates_in_flight == 2, "the second create waiting")
    gate.set()
    await asyncio.gather(first, second)
    await env.engine.checkpoint_written()
    held = {str(k): str(a.cpus) for k, a in env.engine.state.assignments.items()}
    assert held == {}, f"a pod-level pod pinned: {held}"
    assert_consistent(env)


async def test_a_reload_from_none_to_static_does_not_pin_a_pod_level_pods_containers(
    tmp_path: Path,
) -> None:
    """Under none no create looks for pod-level resources. A reload to static then adopts
    every container that asks for exclusive CPUs: each container of a pod-level pod gets
    the whole pod's CPUs, the double allocation the detection exists to prevent (and what a
    restart under static, which marks the pod, does not do)."""
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path / "state", NonePolicy(TOPOLOGY))
        try:
            pod = await env.kubelet.run_pod(
                "plr", "guaranteed", resources=pod_totals(2000, 2 * GIB)
            )
            await start(env, pod, "app", 2000, 2 * GIB)
            await start(env, pod, "helper", 2000, 2 * GIB)
            await env.engine.change_policy(static_policy())
            await adopt_sharing(env.engine)
            held = {str(k): str(a.cpus) for k, a in env.engine.state.assignments.items()}
            assert held == {}, f"a pod-level pod's containers pinned by the reload: {held}"
        finally:
            env.channel.close()


async def test_a_failed_status_of_an_exited_init_container_does_not_unpin_an_ordinary_pod(
    env: Env,
) -> None:
    """An ordinary pod whose init container (2 CPUs, 2Gi) sets its totals; the app container
    (1 CPU, 1Gi) comes before cpushim saw the init container exit, and the runtime's
    ContainerStatus fails once. The init container is then taken as live: the pod is marked
    pod-level for the rest of its life and never pinned, though a restart of cpushim (or
    the same create a moment later) pins it."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    init = await start(env, pod, "init", 2000, 2 * GIB)
    env.fake.exit_container(init)  # cpushim has not seen the exit
    env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE)
    app = await start(env, pod, "app", 1000, GIB)
    assert not env.engine.pods[pod.sandbox_id].pod_level_resources
    assert len(CPUSet.parse(env.cpus(app))) == 1


async def test_restart_does_not_unpin_a_one_container_pod_with_an_attempt_left_created(
    env: Env,
) -> None:
    """A one-container Guaranteed pod (its container is the pod's totals, so it takes the
    whole pod). kubelet's create of attempt 0 was made by the runtime but never started
    (kubelet went on to attempt 1, and attempt 0 stays created beside it until kubelet's
    GC). cpushim pins attempt 1 and never looks at attempt 0 (same container). A restart
    counts both attempts as two containers of the pod taking the whole pod, marks the pod
    pod-level and unpins the running container."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, GIB))
    left = await create(env, pod, "main", 2000, GIB)
    main = await start(env, pod, "main", 2000, GIB, attempt=1)
    assert env.fake.containers[left].state == pb.CONTAINER_CREATED
    before = {k: a.cpus for k, a in env.engine.state.assignments.items()}
    assert len(before) == 1
    assert len(CPUSet.parse(env.cpus(main))) == 2
    await env.restart()
    assert not env.engine.pods[pod.sandbox_id].pod_level_resources
    assert {k: a.cpus for k, a in env.engine.state.assignments.items()} == before


async def test_a_sweep_does_not_pin_a_second_container_of_a_pod_level_pod(env: Env) -> None:
    """The same gap through a sweep: a container of a pod-level pod that did not come
    through cpushim's create (another CRI client's, a fail-open create) is taken in and
    adopted with the whole pod's CPUs beside the one already pinned."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    await start(env, pod, "app", 2000, 2 * GIB)
    config = env.kubelet.create_request(pod, "helper", 2000).config
    config.linux.resources.memory_limit_in_bytes = 2 * GIB
    env.fake.add_container(pod.sandbox_id, config)
    await sweep(env.engine)
    held = {str(k): str(a.cpus) for k, a in env.engine.state.assignments.items()}
    assert held == {}, f"a pod-level pod pinned: {held}"
    assert env.engine.pods[pod.sandbox_id].pod_level_resources


async def test_a_create_queued_on_the_lock_while_its_pod_is_marked_is_not_pinned(
    env: Env,
) -> None:
    """A create that waited for the lock while a sibling's create marked its pod shares too."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    await start(env, pod, "app", 2000, 2 * GIB)
    gate = env.fake.gate("ContainerStatus")
    helper = asyncio.ensure_future(create(env, pod, "helper", 2000, 2 * GIB))
    # helper's create holds the lock, asking the runtime about app.
    await until(
        lambda: env.engine.lock.locked() and env.engine.creates_in_flight == 1,
        "helper's create under the lock",
    )
    third = asyncio.ensure_future(create(env, pod, "third", 2000, 2 * GIB))
    await until(lambda: env.engine.creates_in_flight == 2, "the third create waiting")
    env.fake.ungate("ContainerStatus")
    gate.set()
    await asyncio.gather(helper, third)
    await env.engine.checkpoint_written()
    assert pod.uid in env.engine.state.pod_level
    held = {str(k): str(a.cpus) for k, a in env.engine.state.assignments.items()}
    assert held == {}, f"a container of a marked pod-level pod pinned: {held}"


async def test_a_lost_create_and_its_pinned_sibling_are_unpinned_by_the_sweep(env: Env) -> None:
    """A create whose answer was lost held its CPUs, untracked, when its sibling was created
    and pinned too: the sweep that takes it in finds the pod-level resources and marks the
    pod, though no container waits for an adoption."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, GIB))
    main = await create_with_reply_lost(env, pod, 2000)
    await start(env, pod, "helper", 2000, GIB)
    report = await sweep(env.engine)
    assert report.tracked == [main]
    await env.engine.checkpoint_written()
    held = {str(k): str(a.cpus) for k, a in env.engine.state.assignments.items()}
    assert held == {}, f"a pod-level pod's containers pinned after the sweep: {held}"


async def test_a_restart_with_a_new_reserved_set_does_not_repin_a_marked_pods_container(
    env: Env,
) -> None:
    """cpushim stopped between the mark's checkpoint write and the release's: a restart under
    a new reserved set, which displaces that assignment, must not place it again."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    app = await start(env, pod, "app", 2000, 2 * GIB)
    await start(env, pod, "helper", 2000, 2 * GIB)
    assert env.engine.state.assignments == {}
    assert pod.uid in env.engine.state.pod_level
    held = Assignment(CPUSet.parse("2-3"), app, pod.sandbox_id, 0, "default/plr", None)
    stale = env.engine.state.assign(ContainerKey(pod.uid, "app"), held, env.engine.policy)
    assert stale.pod_level == frozenset({pod.uid})
    env.engine.checkpoint.save_sync(stale)
    await env.restart(static_policy(reserved="0,2"))
    pinned = {str(k): str(a.cpus) for k, a in env.engine.state.assignments.items()}
    assert pinned == {}, f"a marked pod's container pinned again at start-up: {pinned}"


async def test_restart_does_not_mark_an_ordinary_pod_by_an_init_attempt_left_created(
    env: Env,
) -> None:
    """An init container's attempt left created beside its later attempt (kubelet went on to
    the next when the create's answer was lost) never runs: a restart neither counts it as
    a container taking the whole pod nor pins it."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    left = await create(env, pod, "init", 2000, 2 * GIB)
    init = await start(env, pod, "init", 2000, 2 * GIB, attempt=1)
    env.fake.exit_container(init)  # completed
    app = await start(env, pod, "app", 1000, GIB)
    assert env.fake.containers[left].state == pb.CONTAINER_CREATED
    assert len(CPUSet.parse(env.cpus(app))) == 1
    before = {k: a.cpus for k, a in env.engine.state.assignments.items()}
    await env.restart()
    assert not env.engine.pods[pod.sandbox_id].pod_level_resources, "ordinary pod marked"
    assert {k: a.cpus for k, a in env.engine.state.assignments.items()} == before


async def test_a_sibling_whose_status_failed_is_looked_at_again_by_a_sweep(
    env: Env,
) -> None:
    """The runtime could not say whether the pinned sibling still ran when the second
    container was created, so both were pinned: a later sweep asks again and marks the pod."""
    pod = await env.kubelet.run_pod("plr", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    await start(env, pod, "app", 2000, 2 * GIB)
    env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, count=2)
    await start(env, pod, "helper", 2000, 2 * GIB)
    assert len(env.engine.state.assignments) == 2  # the documented transient
    await sweep(env.engine)
    await sweep(env.engine)
    held = {str(k): str(a.cpus) for k, a in env.engine.state.assignments.items()}
    assert held == {}, f"a pod-level pod's containers still pinned after sweeps: {held}"


async def test_restart_after_a_resize_onto_the_pods_old_totals_does_not_unpin_an_ordinary_pod(
    env: Env,
) -> None:
    """A container resized in place to exactly the totals the runtime recorded at the pod's
    start looks like it takes the whole pod; its sibling does not, so a restart (without
    the checkpoint's marks to go by) leaves the pod ordinary."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    main = await start(env, pod, "main", 1000, GIB)
    sidecar = await start(env, pod, "sidecar", 1000, GIB)
    await resize_in_place(env, main, 2000, 2 * GIB)
    assert len(env.engine.state.assignments) == 2
    assert env.engine.counters["pod_level_resource_pods"] == 0
    await env.restart()
    assert not env.engine.pods[pod.sandbox_id].pod_level_resources, "ordinary pod marked"
    assert len(CPUSet.parse(env.cpus(sidecar))) == 1


async def test_after_a_restart_neither_a_sweep_nor_a_sibling_unpins_a_resized_ordinary_pod(
    env: Env,
) -> None:
    """The start-up left the pod above ordinary because the runtime's record, which is all
    it had, cannot tell a container resized onto the pod's old totals from one that takes
    the whole pod. What it read there must not mark the pod a moment later: not at the next
    full look's sweep, nor at a sibling's next attempt (a mark is for good)."""
    pod = await env.kubelet.run_pod("db", "guaranteed", resources=pod_totals(2000, 2 * GIB))
    main = await start(env, pod, "main", 1000, GIB)
    sidecar = await start(env, pod, "sidecar", 1000, GIB)
    await resize_in_place(env, main, 2000, 2 * GIB)
    await env.restart()
    before = {k: a.cpus for k, a in env.engine.state.assignments.items()}
    assert len(before) == 2
    await sweep(env.engine)
    assert env.engine.state.pod_level == frozenset(), "ordinary pod marked by a sweep"
    assert {k: a.cpus for k, a in env.engine.state.assignments.items()} == before
    # The sidecar crashes; kubelet makes its next attempt.
    env.fake.exit_container(sidecar, 1)
    await env.engine.container_exited(sidecar)
    await start(env, pod, "sidecar", 1000, GIB, attempt=1)
    assert env.engine.state.pod_level == frozenset(), "ordinary pod marked by a create"
    assert len(env.engine.state.assignments) == 2
