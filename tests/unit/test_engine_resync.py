"""Start-up resync: which container keeps or gets CPUs, under which key, with which memory
nodes, when the checkpoint and the runtime disagree or the checkpoint is rebuilt."""

from __future__ import annotations

import pytest

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.state import ContainerKey
from tests.fake_runtime import FakeContainer
from tests.unit.engine_env import (
    FIRST_SINGLE,
    Env,
    assert_consistent,
    env,
)

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


def renamed(env: Env, container_id: str, new_id: str) -> str:
    """The container under another id (to set the order resync sees containers in)."""
    container: FakeContainer = env.fake.containers.pop(container_id)
    container.id = new_id
    env.fake.containers[new_id] = container
    return new_id


async def test_a_pinned_container_whose_sandbox_is_gone_is_not_held_while_it_shares(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    # containerd lists the container but no longer its sandbox.
    del env.fake.sandboxes[pod.sandbox_id]

    await env.restart()
    key = ContainerKey(pod.uid, "main")
    # It keeps its CPUs, and runs on them: it is known by its assignment's key.
    assert env.engine.state.assignments[key].cpus == CPUSet.parse(FIRST_SINGLE)
    assert env.cpus(container_id) == FIRST_SINGLE
    assert_consistent(env)


async def test_an_exited_container_holding_cpus_gives_them_back_and_its_next_attempt_gets_them(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    first = await env.kubelet.start_new(pod, "main", 2000)
    before = env.cpus(first)
    env.fake.exit_container(first, 1)
    await env.restart()
    assert env.saved() == {}
    second = await env.kubelet.start_new(pod, "main", 2000, attempt=1)
    assert env.cpus(second) == before
    assert_consistent(env)


async def test_a_crash_mid_create_of_a_next_attempt_finds_it_beside_the_exited_one(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    first = await env.kubelet.start_new(pod, "main", 1000)
    await env.kubelet.stop(first)
    second = await env.kubelet.start_new(pod, "main", 1000, attempt=1)
    key = ContainerKey(pod.uid, "main")
    env.engine.checkpoint.save_sync(env.engine.state.update(key, container_id=""))
    await env.restart()
    assert env.engine.state.assignments[key].container_id == second
    assert_consistent(env)


async def test_a_created_container_not_started_keeps_its_cpus(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    reply = await env.kubelet.create(pod, "main", 1000)
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    await env.engine.checkpoint_written()
    await env.restart()
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].container_id == container_id
    assert env.cpus(container_id) == FIRST_SINGLE
    assert_consistent(env)
