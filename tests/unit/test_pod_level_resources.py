"""Pods with pod-level resources (KEP-2837): kubelet's static policy pins none of their
containers, and cpushim must not pin each one with the whole pod's CPUs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.engine.resync import sandbox_config
from shim.kube import QOSClass
from shim.pods import Pod as ShimPod
from shim.pods import plan_container, shows_pod_level_resources, takes_whole_pod
from shim.state import Assignment, ContainerKey
from tests.harness.kubelet import milli_cpu_to_quota, milli_cpu_to_shares
from tests.unit.engine_env import GIB, Env, Pod, assert_consistent, env

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


async def start(
    env: Env, pod: Pod, name: str, milli_cpu: int, memory: int, attempt: int = 0
) -> str:
    """kubelet's create and start of a Guaranteed container with these limits (a container
    without limits of its own gets its pod's pod-level ones)."""
    request = env.kubelet.create_request(pod, name, milli_cpu, attempt)
    request.config.linux.resources.memory_limit_in_bytes = memory
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status.name == "OK", reply.status_message
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    await env.kubelet.ok(
        "StartContainer", pb.StartContainerRequest(container_id=container_id).SerializeToString()
    )
    await env.engine.checkpoint_written()
    return container_id


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
        (4096, 4 * GIB, True),
    ],
)
def test_takes_whole_pod(shares: int, memory: int, whole: bool) -> None:
    resources = pb.LinuxContainerResources(cpu_shares=shares, memory_limit_in_bytes=memory)
    assert takes_whole_pod(_pod(2048, 2 * GIB), resources) is whole


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
