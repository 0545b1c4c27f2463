"""Calls that name a container or sandbox by a prefix of its id, as crictl lets an operator
do (``crictl stop 3f2a``) through cpushim's socket: the runtime takes any unique prefix, so
cpushim must know which container or sandbox the call acted on.

The fake runtime resolves prefixes as containerd does; the machine is engine_env's (CPU 0
reserved, 8 CPUs).
"""

from __future__ import annotations

import pytest

from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Status
from shim.state import ContainerKey
from tests.fake_runtime import FakeContainer
from tests.unit.engine_env import (
    FIRST_SINGLE,
    SHARED_AFTER_FIRST_SINGLE,
    Env,
    assert_consistent,
    env,
)

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture

PREFIX = 12  # what `crictl ps` shows of an id


async def test_a_stop_by_prefix_releases_before_it_returns(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pinned_id = await kubelet.start_new(await kubelet.run_pod("db", "guaranteed"), "main", 1000)
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    await kubelet.stop(pinned_id[:PREFIX])
    assert env.engine.state.assignments == {}
    assert env.cpus(shared_id) == "0-7"
    assert env.saved() == {}
    await kubelet.remove(pinned_id[:PREFIX])
    assert pinned_id not in env.engine.containers
    assert_consistent(env)


async def test_a_remove_by_prefix_forgets_the_container(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    await kubelet.stop(shared_id)
    await kubelet.remove(shared_id[:PREFIX])
    assert shared_id not in env.engine.containers


async def test_a_pod_stopped_and_removed_by_prefix_is_released_and_forgotten(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")
    await kubelet.start_new(pod, "main", 1000)
    prefix = pod.sandbox_id[:PREFIX]
    await kubelet.ok(
        "StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=prefix).SerializeToString()
    )
    assert env.engine.state.assignments == {}
    assert env.cpus(shared_id) == "0-7"
    await kubelet.ok(
        "RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=prefix).SerializeToString()
    )
    assert pod.sandbox_id not in env.engine.pods
    assert all(t.sandbox_id != pod.sandbox_id for t in env.engine.containers.values())
    # The pod's released CPUs go at the next decision.
    await kubelet.start_new(await kubelet.run_pod("next", "guaranteed"), "main", 1000)
    assert not any(key.pod_uid == pod.uid for key in env.engine.state.released)


async def test_a_create_in_a_sandbox_named_by_prefix_belongs_to_that_sandbox(env: Env) -> None:
    kubelet = env.kubelet
    pod = await kubelet.run_pod("db", "guaranteed")
    request = kubelet.create_request(pod, "main", 1000)
    request.pod_sandbox_id = pod.sandbox_id[:PREFIX]
    reply = await kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK, reply.status_message
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    assert env.engine.containers[container_id].sandbox_id == pod.sandbox_id
    assert list(env.engine.pods) == [pod.sandbox_id]
    # kubelet stops the pod by its full id: the container's CPUs go back.
    await kubelet.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString(),
    )
    assert env.engine.state.assignments == {}
    assert_consistent(env)


async def test_an_update_by_prefix_leaves_the_cpuset_to_cpushim(env: Env) -> None:
    kubelet = env.kubelet
    pinned_id = await kubelet.start_new(await kubelet.run_pod("db", "guaranteed"), "main", 1000)
    request = pb.UpdateContainerResourcesRequest(
        container_id=pinned_id[:PREFIX],
        linux=pb.LinuxContainerResources(cpuset_cpus="0-7", memory_limit_in_bytes=2 << 30),
    )
    await kubelet.ok("UpdateContainerResources", request.SerializeToString())
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.fake.containers[pinned_id].resources.memory_limit_in_bytes == 2 << 30


async def test_a_prefix_the_runtime_finds_ambiguous_changes_nothing(env: Env) -> None:
    kubelet = env.kubelet
    pod = await kubelet.run_pod("db", "guaranteed")
    pinned_id = await kubelet.start_new(pod, "main", 1000)
    # A container cpushim does not know (made straight on the runtime) whose id starts as
    # the pinned one's: unique among cpushim's, not among the runtime's.
    config = kubelet.create_request(pod, "other").config
    stranger: FakeContainer = env.fake.containers.pop(
        env.fake.add_container(pod.sandbox_id, config)
    )
    stranger.id = pinned_id[:PREFIX] + "0" * (64 - PREFIX)
    env.fake.containers[stranger.id] = stranger
    stranger_cpus = stranger.resources.cpuset_cpus
    request = pb.UpdateContainerResourcesRequest(
        container_id=pinned_id[:PREFIX], linux=pb.LinuxContainerResources(cpuset_cpus="0-7")
    )
    reply = await kubelet.call("UpdateContainerResources", request.SerializeToString())
    assert reply.status is not Status.OK  # the runtime cannot tell which
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.cpus(stranger.id) == stranger_cpus
    stop = pb.StopContainerRequest(container_id=pinned_id[:PREFIX])
    reply = await kubelet.call("StopContainer", stop.SerializeToString())
    assert reply.status is not Status.OK
    assert env.engine.state.holding(pinned_id) == ContainerKey(pod.uid, "main")
