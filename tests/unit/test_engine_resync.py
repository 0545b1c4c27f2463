"""Start-up resync: which container keeps or gets CPUs, under which key, with which memory
nodes, when the checkpoint and the runtime disagree or the checkpoint is rebuilt."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.const import Status as GrpcStatus

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status, UnaryCall
from shim.engine import requests as rq
from shim.engine import resync
from shim.engine.resync import (
    adopt_sharing,
    live_status,
    placed_pod,
    spec_resources,
)
from shim.engine.sweeping import sweep
from shim.engine.watching import Watcher
from shim.kube import QOSClass
from shim.pods import ANNOTATION_CFS_QUOTA
from shim.policy import CPUPolicy
from shim.policy.none import NonePolicy
from shim.policy.options import StaticPolicyOptions
from shim.policy.static import StaticPolicy
from shim.state import ContainerKey, CPUState
from tests.fake_runtime import FakeContainer, FakeRuntime
from tests.unit.engine_env import (
    FIRST_SINGLE,
    TOPOLOGY,
    Env,
    Pod,
    assert_consistent,
    env,
    make_env,
    second_of_two_released,
    static_policy,
    unreadable,
    until,
)

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


def renamed(env: Env, container_id: str, new_id: str) -> str:
    """The container under another id (to set the order resync sees containers in)."""
    container: FakeContainer = env.fake.containers.pop(container_id)
    container.id = new_id
    env.fake.containers[new_id] = container
    return new_id


async def test_recovery_keeps_running_exclusive_cpus_before_choosing_new_ones(env: Env) -> None:
    kubelet = env.kubelet
    # A 7-CPU container holds every CPU but the reserved one.
    big = await kubelet.run_pod("big", "guaranteed")
    big_id = renamed(env, await kubelet.start_new(big, "main", 7000), "f" * 64)
    assert env.cpus(big_id) == "1-7"
    # A 1-CPU Guaranteed container that shares (made while cpushim was down, or refused).
    small = await kubelet.run_pod("small", "guaranteed")
    request = kubelet.create_request(small, "main", 1000)
    small_id = renamed(env, env.fake.add_container(small.sandbox_id, request.config), "0" * 64)

    await env.restart(recover=True)
    # The running exclusive container keeps its CPUs; the newcomer is the one that shares.
    assert env.saved() == {big.uid: {"main": "1-7"}}
    assert env.cpus(big_id) == "1-7"
    assert env.cpus(small_id) == "0"
    assert_consistent(env)


async def test_recovery_moves_no_exclusive_container_that_can_keep_its_cpus(env: Env) -> None:
    kubelet = env.kubelet
    pinned = await kubelet.run_pod("pinned", "guaranteed")
    pinned_id = renamed(env, await kubelet.start_new(pinned, "main", 1000), "f" * 64)
    assert env.cpus(pinned_id) == FIRST_SINGLE
    newcomer = await kubelet.run_pod("newcomer", "guaranteed")
    request = kubelet.create_request(newcomer, "main", 1000)
    renamed(env, env.fake.add_container(newcomer.sandbox_id, request.config), "0" * 64)

    await env.restart(recover=True)
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.engine.state.assignments[ContainerKey(pinned.uid, "main")].cpus == CPUSet.parse(
        FIRST_SINGLE
    )
    assert_consistent(env)


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


async def test_recovery_keeps_the_memory_nodes_kubelets_memory_manager_chose(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    request = env.kubelet.create_request(pod, "main", 1000)
    # The memory manager gave this 1-CPU container both nodes (its memory needs them).
    request.config.linux.resources.cpuset_mems = "0-1"
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    assert env.fake.containers[container_id].resources.cpuset_mems == "0-1"
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].mems == CPUSet.parse("0-1")

    await env.restart(recover=True)
    assert env.engine.state.assignments[key].mems == CPUSet.parse("0-1")
    # kubelet's next update (a resize) must not narrow them to the node of CPU 4.
    update = pb.UpdateContainerResourcesRequest(
        container_id=container_id, linux=request.config.linux.resources
    )
    await env.kubelet.ok("UpdateContainerResources", update.SerializeToString())
    assert env.fake.containers[container_id].resources.cpuset_mems == "0-1"


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


async def test_a_container_that_exits_while_start_up_reads_its_status_holds_no_cpus(
    env: Env,
) -> None:
    """The runtime's list says running, its ContainerStatus a moment later says exited: the
    container is exited (as a sweep takes it), so its CPUs go back, and it is not taken for
    one created and never started."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    asked = len(env.fake.calls_of("ContainerStatus"))
    gate = env.fake.gate("ContainerStatus")
    restarting = asyncio.create_task(env.restart())
    await until(
        lambda: len(env.fake.calls_of("ContainerStatus")) > asked, "start-up asks for its status"
    )
    env.fake.exit_container(container_id, 0)
    env.fake.ungate("ContainerStatus")
    gate.set()
    await restarting
    assert env.engine.state.assignments == {}
    assert env.saved() == {}
    assert container_id not in env.engine.containers
    assert_consistent(env)


async def test_a_sandbox_that_stops_while_start_up_reads_its_status_takes_no_cpus(
    env: Env,
) -> None:
    """The same for a sandbox: one the list says ready and its status stopped starts no
    container, so the one left created in it gives its CPUs back."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    reply = await env.kubelet.create(pod, "main", 1000)
    assert reply.status is Status.OK
    await env.engine.checkpoint_written()
    asked = len(env.fake.calls_of("PodSandboxStatus"))
    gate = env.fake.gate("PodSandboxStatus")
    restarting = asyncio.create_task(env.restart())
    await until(
        lambda: len(env.fake.calls_of("PodSandboxStatus")) > asked, "start-up asks for its status"
    )
    env.fake.sandboxes[pod.sandbox_id].state = pb.SANDBOX_NOTREADY
    env.fake.ungate("PodSandboxStatus")
    gate.set()
    await restarting
    assert env.engine.state.assignments == {}
    assert env.saved() == {}
    assert_consistent(env)


async def orphan_beside_its_next_attempt(env: Env) -> tuple[ContainerKey, str, str]:
    """Attempt 0 created (kubelet gave up on the call) and never started, attempt 1
    running, both on CPU 4; the orphan's id sorts first. (key, orphan id, running id)"""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    reply = await env.kubelet.create(pod, "main", 1000)
    orphan = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    running = await env.kubelet.start_new(pod, "main", 1000, attempt=1)
    orphan = renamed(env, orphan, "0" * 64)
    running = renamed(env, running, "f" * 64)
    assert env.cpus(orphan) == env.cpus(running) == FIRST_SINGLE
    return ContainerKey(pod.uid, "main"), orphan, running


async def test_recovery_pins_the_running_attempt_not_a_created_one_left_beside_it(
    env: Env,
) -> None:
    key, _, running = await orphan_beside_its_next_attempt(env)
    await env.restart(recover=True)
    assert env.engine.state.assignments[key].container_id == running
    assert env.cpus(running) == str(env.engine.state.assignments[key].cpus)


async def test_recovery_pins_the_running_attempt_even_when_it_needs_new_cpus(env: Env) -> None:
    key, orphan, running = await orphan_beside_its_next_attempt(env)
    # The running attempt's cpuset is no set it may keep (someone gave it every CPU); the
    # orphan's still is.
    env.fake.containers[running].resources.cpuset_cpus = "0-7"
    assert env.cpus(orphan) == FIRST_SINGLE

    await env.restart(recover=True)
    assert env.engine.state.assignments[key].container_id == running
    assert env.cpus(running) == str(env.engine.state.assignments[key].cpus)
    assert_consistent(env)


async def test_recovery_pins_a_running_attempt_before_a_later_one_created_beside_it(
    env: Env,
) -> None:
    # Listed together (the runtime's list raced the exit, or kubelet's create of the next
    # attempt came first): the running one is the one on the CPUs now.
    pod = await env.kubelet.run_pod("db", "guaranteed")
    running = renamed(env, await env.kubelet.start_new(pod, "main", 1000), "f" * 64)
    env.fake.containers[running].resources.cpuset_cpus = FIRST_SINGLE
    reply = await env.kubelet.create(pod, "main", 1000, attempt=1)
    created = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    created = renamed(env, created, "0" * 64)
    await env.restart(recover=True)
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].container_id == running
    assert env.cpus(running) == FIRST_SINGLE == str(env.engine.state.assignments[key].cpus)


async def test_recovery_pins_no_created_attempt_left_beside_a_later_exited_one(
    env: Env,
) -> None:
    # Attempt 0's create answer was lost; kubelet made attempt 1, which ran and exited.
    # kubelet never starts attempt 0: it must not hold CPUs.
    pod = await env.kubelet.run_pod("db", "guaranteed")
    reply = await env.kubelet.create(pod, "main", 1000)
    orphan = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    later = await env.kubelet.start_new(pod, "main", 1000, attempt=1)
    env.fake.exit_container(later, 0)
    await env.restart(recover=True)
    assert env.engine.state.assignments == {}
    assert env.engine.containers.get(orphan) is None or not env.engine.containers[orphan].exclusive
    assert_consistent(env)


async def test_recovery_under_none_gives_a_pinned_container_back_kubelets_memory_nodes(
    env: Env,
) -> None:
    """operations.md: one that loses its exclusive CPUs (a switch to the none policy) gets
    back the nodes kubelet chose; under --recover-from-runtime only containerd's record
    tells them."""
    kubelet = env.kubelet
    # Node 1 (CPUs 2,3,6,7) is full, so a container whose memory kubelet put on node 1 gets
    # a CPU of node 0 and keeps its memory on node 1.
    full = kubelet.create_request(await kubelet.run_pod("full", "guaranteed"), "main", 4000)
    full.config.linux.resources.cpuset_mems = "1"
    await kubelet.ok("CreateContainer", full.SerializeToString())
    pod = await kubelet.run_pod("db", "guaranteed")
    request = kubelet.create_request(pod, "main", 1000)
    request.config.linux.resources.cpuset_mems = "1"
    raw = await kubelet.ok("CreateContainer", request.SerializeToString())
    container_id = pb.CreateContainerResponse.FromString(raw).container_id
    assert env.fake.containers[container_id].resources.cpuset_mems == "1"
    assert 1 not in TOPOLOGY.numa_nodes_of(CPUSet.parse(env.cpus(container_id)))

    await env.restart(NonePolicy(TOPOLOGY), recover=True)
    assert env.engine.state.assignments == {}
    assert env.fake.containers[container_id].resources.cpuset_mems == "1"


async def test_a_container_whose_sandbox_is_not_listed_keeps_the_quota_its_pod_keeps(
    env: Env,
) -> None:
    """Without its sandbox the pod's cfs-quota annotation is not at hand; the quota cpushim
    left it is its word: the start-up's squaring of an exclusive container's settings must
    not drop it (nor a later move)."""
    pod = await env.kubelet.run_pod("db", "guaranteed", {"cpushim.io/cfs-quota": "keep"})
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    quota = env.fake.containers[container_id].resources.cpu_quota
    assert quota > 0
    del env.fake.sandboxes[pod.sandbox_id]
    await env.restart()
    assert env.fake.containers[container_id].resources.cpu_quota == quota
    assert env.engine.containers[container_id].keep_quota


@pytest.mark.parametrize("recover", [False, True])
async def test_a_created_container_left_in_a_stopped_sandbox_gets_no_cpus_at_a_restart(
    env: Env, recover: bool
) -> None:
    """The runtime starts no container in a stopped sandbox (containerd: "sandbox container
    is not running"), and its stop leaves a created one created: the orphan never runs, so
    a restart must not take back the CPUs the sandbox's stop released."""
    key, orphan, _ = await orphan_beside_its_next_attempt(env)
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("web", "besteffort"), "main")
    sandbox_id = env.fake.containers[orphan].sandbox_id
    stop = pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id)
    await env.kubelet.ok("StopPodSandbox", stop.SerializeToString())
    assert env.fake.containers[orphan].state == pb.CONTAINER_CREATED
    assert env.engine.state.assignments == {}

    await env.restart(recover=recover)
    assert key not in env.engine.state.assignments
    assert env.saved() == {}
    assert env.cpus(shared_id) == "0-7"
    assert_consistent(env)


async def test_a_recreated_container_gets_its_cpus_back_after_a_restart(env: Env) -> None:
    second = await second_of_two_released(env)
    await env.restart()
    again = await env.kubelet.start_new(second, "main", 1000, attempt=1)
    assert env.cpus(again) == "1"
    assert_consistent(env)


async def test_released_cpus_of_pods_removed_while_cpushim_was_down_are_forgotten(
    env: Env,
) -> None:
    kubelet = env.kubelet
    gone = await kubelet.run_pod("gone", "guaranteed")
    stays = await kubelet.run_pod("stays", "guaranteed")
    await kubelet.stop(await kubelet.start_new(gone, "main", 1000))
    await kubelet.stop(await kubelet.start_new(stays, "main", 1000))
    assert {key.pod_uid for key in env.engine.state.released} == {gone.uid, stays.uid}
    del env.fake.sandboxes[gone.sandbox_id]  # removed straight on the runtime

    await env.restart()
    # Each held CPU 4 in turn, "gone" first.
    assert dict(env.engine.state.released) == {
        ContainerKey(stays.uid, "main"): CPUSet.parse(FIRST_SINGLE)
    }


async def test_a_container_adopted_at_a_restart_gets_back_the_cpus_its_key_released(
    env: Env,
) -> None:
    second = await second_of_two_released(env)
    # Its next attempt, made straight on the runtime while cpushim was down: no cpuset.
    request = env.kubelet.create_request(second, "main", 1000, attempt=1)
    again = env.fake.add_container(second.sandbox_id, request.config)
    await env.restart()
    assert env.cpus(again) == "1"  # not the allocator's choice, 4
    key = ContainerKey(second.uid, "main")
    assert env.engine.state.assignments[key].container_id == again
    assert key not in env.engine.state.released
    assert_consistent(env)


# --- a live re-plan adopts as start-up does ---------------------------------------------------


@pytest.mark.parametrize("via", ["none", "reserved"])
async def test_a_container_a_reload_left_sharing_is_pinned_as_a_restart_would(
    env: Env, via: str
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 2000)
    # The reload takes its CPUs (none pins nothing; the reserved set leaves no room).
    lost = await env.engine.change_policy(
        NonePolicy(TOPOLOGY) if via == "none" else static_policy("0-6")
    )
    assert await adopt_sharing(env.engine, skip=lost) == []
    assert env.cpus(container_id) == "0-7"
    # Back: it asks for two CPUs and shares; a restart would adopt it on two.
    await env.engine.change_policy(static_policy("0"))
    assert env.cpus(container_id) == "0-7"
    assert await adopt_sharing(env.engine) == [ContainerKey(pod.uid, "main")]
    pinned = env.cpus(container_id)
    assert len(CPUSet.parse(pinned)) == 2
    assert env.fake.containers[container_id].resources.cpu_quota == -1
    assert env.saved() == {pod.uid: {"main": pinned}}
    assert env.engine.counters["adoptions_refused"] == 0
    assert_consistent(env)

    await env.restart(static_policy("0"))  # an upgrade's restart: nothing moves
    assert env.cpus(container_id) == pinned
    assert env.saved() == {pod.uid: {"main": pinned}}


async def started_under_none(env: Env, milli_cpu: int) -> tuple[Pod, str]:
    """A Guaranteed container started under the none policy: it shares."""
    await env.engine.change_policy(NonePolicy(TOPOLOGY))
    pod = await env.kubelet.run_pod("db", "guaranteed")
    return pod, await env.kubelet.start_new(pod, "main", milli_cpu)


async def test_a_container_created_under_none_is_pinned_when_the_policy_turns_static(
    env: Env,
) -> None:
    pod, container_id = await started_under_none(env, 1000)
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("web", "besteffort"), "m")
    await env.engine.change_policy(static_policy("0"))
    assert await adopt_sharing(env.engine) == [ContainerKey(pod.uid, "main")]
    assert env.cpus(container_id) == FIRST_SINGLE
    assert CPUSet.parse(FIRST_SINGLE).isdisjoint(CPUSet.parse(env.cpus(shared_id)))
    assert_consistent(env)


@pytest.mark.parametrize("how", ["reload", "restart"])
async def test_a_container_created_under_none_keeps_kubelets_choice_of_every_node_when_pinned(
    env: Env, how: str
) -> None:
    """kubelet's memory manager gave a 1-CPU container both nodes (its memory spans them)
    while the policy was none: it shares, on CPUs of both nodes. Pinned once the policy
    turns static, its memory stays on both, whether a reload or a restart turned it: a
    restart read kubelet's nodes as cpushim's own, since they are those of its CPUs."""
    await env.engine.change_policy(NonePolicy(TOPOLOGY))
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000, mems="0-1")
    if how == "reload":
        await env.engine.change_policy(static_policy("0"))
        assert await adopt_sharing(env.engine) == [ContainerKey(pod.uid, "main")]
    else:
        await env.restart(static_policy("0"))
    assert env.cpus(container_id) == FIRST_SINGLE
    assert env.fake.containers[container_id].resources.cpuset_mems == "0-1"
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].mems == CPUSet.parse("0-1")
    assert_consistent(env)


async def test_adoption_at_a_reload_leaves_a_container_whose_state_is_unknown_sharing(
    env: Env,
) -> None:
    pod, container_id = await started_under_none(env, 1000)
    await env.engine.change_policy(static_policy("0"))
    env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "busy")
    assert await adopt_sharing(env.engine) == []
    assert env.cpus(container_id) == "0-7"
    assert env.engine.state.assignments == {}
    assert await adopt_sharing(env.engine) == [ContainerKey(pod.uid, "main")]  # next reload


async def test_a_waiting_container_whose_state_cannot_be_read_is_warned_of_once_a_spell(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every sweep's adoption asks the runtime about a container that waits for exclusive
    CPUs: a ContainerStatus that keeps failing is told once, not at each, and again when it
    fails after a good read."""
    _, container_id = await started_under_none(env, 2000)
    await env.engine.change_policy(static_policy("0-6"))  # no room: it waits
    failing = unreadable(env, monkeypatch, Status.UNAVAILABLE)
    with caplog.at_level("WARNING", logger="shim.engine.resync"):
        for _ in range(2):
            failing.add(container_id)
            for _ in range(3):
                assert await adopt_sharing(env.engine) == []
            failing.clear()
            assert await adopt_sharing(env.engine) == []  # read, and refused for want of room
    told = [
        r.__dict__["fields"]["container_id"]
        for r in caplog.records
        if r.getMessage() == "cannot read a container's state; it stays as it is"
    ]
    assert told == [container_id, container_id]


async def test_adoption_at_a_reload_without_room_is_counted_and_changes_nothing(
    env: Env,
) -> None:
    _, container_id = await started_under_none(env, 2000)
    await env.engine.change_policy(static_policy("0-6"))  # one CPU left that is not reserved
    writes = env.engine.checkpoint.writes
    assert await adopt_sharing(env.engine) == []
    assert env.engine.counters["adoptions_refused"] == 1
    assert env.engine.checkpoint.writes == writes
    assert env.engine.state.assignments == {}
    assert env.cpus(container_id) == str(env.engine.state.shared) == "0-7"


async def test_a_container_that_exits_while_its_adoption_is_written_gives_the_cpus_back(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its next attempt's create marks it exited without waiting for the lock, and its own
    exit then releases nothing: the adoption must."""
    _, container_id = await started_under_none(env, 1000)
    await env.engine.change_policy(static_policy("0"))
    save = env.engine.checkpoint.save

    async def exit_meanwhile(state: CPUState) -> None:
        env.engine._mark_exited(env.engine.containers[container_id])
        await save(state)

    monkeypatch.setattr(env.engine.checkpoint, "save", exit_meanwhile)
    assert await adopt_sharing(env.engine) == []
    assert env.engine.state.assignments == {}
    assert env.engine.state.shared == CPUSet.parse("0-7")
    assert_consistent(env)


@pytest.mark.parametrize(
    "written_by_a_newer_version",
    [{"options": frozenset({"an-option-added-later"})}, {"policy": "dynamic"}],
    ids=["unknown option", "unknown policy"],
)
async def test_a_roll_back_starts_on_a_newer_versions_checkpoint(
    env: Env, written_by_a_newer_version: dict[str, object]
) -> None:
    """Every version so far writes format 1: a newer cpushim that wrote an option or a
    policy this one does not know leaves a well-formed file whose checksum matches. The
    configured policy differs from it, so start-up re-plans, as for any policy change, and
    the running container keeps its CPUs."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    newer = dataclasses.replace(env.engine.state, **written_by_a_newer_version)  # type: ignore[arg-type]
    env.engine.checkpoint.save_sync(newer)
    await env.restart()
    held = env.engine.state.assignments[ContainerKey(pod.uid, "main")]
    assert held.container_id == container_id
    assert str(held.cpus) == FIRST_SINGLE
    await env.engine.checkpoint_written()
    assert env.saved()[pod.uid] == {"main": FIRST_SINGLE}
    assert_consistent(env)


async def test_a_container_adopted_at_a_reload_gets_back_the_cpus_its_key_released(
    env: Env,
) -> None:
    second = await second_of_two_released(env)
    await env.engine.change_policy(NonePolicy(TOPOLOGY))
    again = await env.kubelet.start_new(second, "main", 1000, attempt=1)
    assert env.cpus(again) == "0-7"
    await env.engine.change_policy(static_policy("0"))
    assert await adopt_sharing(env.engine) == [ContainerKey(second.uid, "main")]
    assert env.cpus(again) == "1"  # not the allocator's choice, 4
    assert_consistent(env)


async def test_recovery_keeps_a_pinned_container_before_one_that_shares_a_pool_its_size(
    env: Env,
) -> None:
    """Under strict-cpu-reservation the shared pool is what the exclusive sets leave of the
    CPUs that are not reserved, so a container that asks for as many exclusive CPUs as the
    pool holds, and shares because a pin would empty it, runs on a set that looks free and
    the right size. Recovery must not take that for the container's own: the containers
    pinned on their CPUs keep them, whatever order the runtime lists them in."""
    policy = StaticPolicy.create(
        TOPOLOGY,
        reserved=CPUSet.parse("0"),
        options=StaticPolicyOptions(strict_cpu_reservation=True),
    )
    await env.restart(policy)
    kubelet = env.kubelet
    big = await kubelet.start_new(await kubelet.run_pod("big", "guaranteed"), "main", 4000)
    # Listed last by the runtime.
    pinned = renamed(
        env,
        await kubelet.start_new(await kubelet.run_pod("pinned", "guaranteed"), "main", 1000),
        "f" * 64,
    )
    assert (env.cpus(big), env.cpus(pinned), str(env.engine.state.shared)) == (
        "2-3,6-7",
        FIRST_SINGLE,
        "1,5",
    )
    pod = await kubelet.run_pod("db", "guaranteed")
    # Made while cpushim was down (and listed first); at the restart there is no room for it.
    request = kubelet.create_request(pod, "main", 2000)
    sharing = renamed(env, env.fake.add_container(pod.sandbox_id, request.config), "0" * 64)
    await env.restart()
    assert ContainerKey(pod.uid, "main") not in env.engine.state.assignments
    assert env.cpus(sharing) == "1,5"

    await env.restart(recover=True)
    held = {a.container_id: str(a.cpus) for a in env.engine.state.assignments.values()}
    assert held == {big: "2-3,6-7", pinned: FIRST_SINGLE}
    assert env.cpus(sharing) == "1,5"
    assert_consistent(env)


@pytest.fixture(params=["cgroupfs", "systemd"])
async def driven_env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Env]:
    """``env`` under each cgroup driver: the form of the pods' cgroup parents."""
    async with FakeRuntime(cgroup_driver=request.param) as fake:
        environment = await make_env(fake, tmp_path / "state")
        yield environment
        environment.channel.close()


@pytest.mark.parametrize("recover", [False, True], ids=["checkpoint", "recovered"])
async def test_a_sandbox_whose_shim_hangs_keeps_neither_cpushim_down_nor_its_pod_unpinned(
    driven_env: Env, recover: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """containerd asks the sandbox's shim when a PodSandboxStatus is verbose: one hung shim
    used to fail the whole start-up, after the call's 10 s. The verbose call is given up
    sooner, the plain status serves, and the pod's QoS class comes from its container's
    cgroup, so its exclusive CPU stays (or is adopted) as it was."""
    env = driven_env
    monkeypatch.setattr(resync, "SANDBOX_INFO_TIMEOUT", 0.2)
    deadlines: dict[bool, float | None] = {}
    unary = env.channel.unary

    async def recorded(call: UnaryCall, request: bytes | None = None) -> Reply:
        if call.path == rq.POD_SANDBOX_STATUS:
            asked = pb.PodSandboxStatusRequest.FromString(call.request)
            deadlines[asked.verbose] = call.timeout
        return await unary(call, request)

    monkeypatch.setattr(env.channel, "unary", recorded)
    pinned = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    sharing = await env.kubelet.run_pod("web", "burstable")
    sharing_id = await env.kubelet.start_new(sharing, "main", 500)
    await env.engine.checkpoint_written()
    env.fake.shims_hung.add(pinned.sandbox_id)

    await env.restart(recover=recover)
    assert env.saved() == {pinned.uid: {"main": FIRST_SINGLE}}
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert FIRST_SINGLE not in env.cpus(sharing_id).split(",")
    pod = env.engine.pods[pinned.sandbox_id]
    assert pod.qos is QOSClass.GUARANTEED
    assert pod.uid == pinned.uid
    asked = [
        request.verbose
        for request in env.fake.calls_of("PodSandboxStatus")
        if isinstance(request, pb.PodSandboxStatusRequest)
        and request.pod_sandbox_id == pinned.sandbox_id
    ]
    assert asked[-2:] == [True, False]
    assert deadlines == {True: 0.2, False: resync.CALL_TIMEOUT}
    assert_consistent(env)


async def test_sandboxes_whose_shims_hang_are_waited_for_together(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One after another, each hung shim's 3 s would add up past systemd's start timeout
    (and the restart that follows would start over)."""
    monkeypatch.setattr(resync, "SANDBOX_INFO_TIMEOUT", 0.2)
    pods = [await env.kubelet.run_pod(f"db-{n}", "guaranteed") for n in range(3)]
    for pod in pods:
        await env.kubelet.start_new(pod, "main", 1000)
        env.fake.shims_hung.add(pod.sandbox_id)
    asked = len(env.fake.calls_of("PodSandboxStatus"))
    await env.restart()
    calls = [
        request
        for request in env.fake.calls_of("PodSandboxStatus")[asked:]
        if isinstance(request, pb.PodSandboxStatusRequest)
    ]
    # Every verbose call went out before any of them was given up for the plain one.
    assert [request.verbose for request in calls] == [True] * 3 + [False] * 3
    assert {request.pod_sandbox_id for request in calls[:3]} == {p.sandbox_id for p in pods}
    assert len(env.saved()) == 3
    assert_consistent(env)


@pytest.mark.parametrize("recover", [False, True], ids=["checkpoint", "recovered"])
async def test_a_sandbox_whose_status_cannot_be_read_at_all_is_taken_from_the_list(
    driven_env: Env, recover: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain and verbose status both failing (containerd's shim sandboxer asks the shim for
    either) used to stop start-up, and with cpushim kubelet's runtime. The pod comes from
    the runtime's list, its QoS class from its container's cgroup: its CPU stays (or is
    adopted) as it was, and the sharing pod next to it gets none of it."""
    env = driven_env
    pinned = await env.kubelet.run_pod("db", "guaranteed", {ANNOTATION_CFS_QUOTA: "keep"})
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    sharing = await env.kubelet.run_pod("web", "burstable")
    sharing_id = await env.kubelet.start_new(sharing, "main", 500)
    await env.engine.checkpoint_written()
    unreadable(env, monkeypatch, Status.DEADLINE_EXCEEDED).add(pinned.sandbox_id)

    await env.restart(recover=recover)
    assert env.saved() == {pinned.uid: {"main": FIRST_SINGLE}}
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert FIRST_SINGLE not in env.cpus(sharing_id).split(",")
    pod = env.engine.pods[pinned.sandbox_id]
    assert (pod.uid, pod.qos) == (pinned.uid, QOSClass.GUARANTEED)
    # Its annotations come with the list's entry.
    assert env.engine.containers[pinned_id].keep_quota
    assert env.engine.counters["startup_status_errors"] == 1
    assert_consistent(env)


@pytest.mark.parametrize("status", [Status.UNKNOWN, None], ids=["failed", "undecodable"])
async def test_a_pinned_container_whose_status_cannot_be_read_keeps_its_cpus_for_a_sweep(
    env: Env, monkeypatch: pytest.MonkeyPatch, status: Status | None
) -> None:
    """A failed ContainerStatus, or one whose answer does not decode, used to stop start-up.
    The container may run: its CPUs stay held, given to no container adopted beside it,
    until the watcher's first sweep reads it and takes it in on them."""
    pinned = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    await env.engine.checkpoint_written()
    # Made while cpushim was down, it asks for every CPU but the reserved one: it fits only
    # if the unread container's CPU is given away.
    big = await env.kubelet.run_pod("big", "guaranteed")
    request = env.kubelet.create_request(big, "main", 7000)
    big_id = env.fake.add_container(big.sandbox_id, request.config)
    failing = unreadable(env, monkeypatch, status)
    failing.add(pinned_id)

    await env.restart()
    key = ContainerKey(pinned.uid, "main")
    assert env.saved() == {pinned.uid: {"main": FIRST_SINGLE}}
    assert env.engine.state.assignments[key].container_id == pinned_id
    assert pinned_id not in env.engine.containers
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.cpus(big_id) == str(env.engine.state.shared)
    assert FIRST_SINGLE not in env.engine.state.shared
    assert env.engine.counters["startup_status_errors"] == 1
    assert_consistent(env)

    failing.clear()
    watcher = Watcher(env.engine, resync_period=0)
    watcher.start()
    try:
        await until(lambda: pinned_id in env.engine.containers, "the sweep took it in")
    finally:
        await watcher.stop()
        await env.engine.drain(5.0)
    assert env.engine.containers[pinned_id].exclusive
    assert env.engine.state.assignments[key].container_id == pinned_id
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert_consistent(env)


async def replanned(env: Env, policy: CPUPolicy, when: str) -> None:
    """Re-planned under ``policy`` at a restart (``when`` "start-up"), or (``when``
    "reload") by a live re-plan, as a config reload makes, after a restart under the same
    policy: the containers start-up could not read are still untracked then."""
    if when == "start-up":
        await env.restart(policy)
        return
    await env.restart()
    await resync.replan_live(env.engine, policy, "config reload")


async def pinned_beside_big(env: Env) -> tuple[Pod, str, str]:
    """A 1-CPU container (its pod's UID sorting last) beside a 6-CPU one that leaves only
    the reserved CPU shared: strict-cpu-reservation then leaves the pool no CPU unless one
    of them gives way. Returns the small one's pod and the two container ids."""
    pinned = await env.kubelet.run_pod("db", "guaranteed", uid="ffffffff-0000-0000-0000-0")
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    big = await env.kubelet.run_pod("big", "guaranteed", uid="00000000-0000-0000-0000-0")
    big_id = await env.kubelet.start_new(big, "main", 6000)
    return pinned, pinned_id, big_id


STRICT = StaticPolicy.create(
    TOPOLOGY,
    reserved=CPUSet.parse("0"),
    options=StaticPolicyOptions(strict_cpu_reservation=True),
)


@pytest.mark.parametrize("when", ["start-up", "reload"])
async def test_a_replan_keeps_the_cpus_of_a_container_start_up_could_not_read(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """strict-cpu-reservation turned on leaves the shared pool no CPU unless an assignment
    gives way. The re-plan had the last key give way, here that of a container whose state
    the runtime could not give: its CPU went back to the pool while it ran there, and
    nothing moved it off until a sweep read it. It keeps it; the container that can be read
    gives way, and shares. A reload before the sweep re-plans as start-up does: the
    container is not tracked yet, and its assignment is known as held for it."""
    pinned, pinned_id, big_id = await pinned_beside_big(env)
    assert (env.cpus(pinned_id), env.cpus(big_id)) == (FIRST_SINGLE, "1-3,5-7")
    failing = unreadable(env, monkeypatch, Status.UNKNOWN)
    failing.add(pinned_id)
    with caplog.at_level("WARNING", logger="shim.engine"):
        await replanned(env, STRICT, when)
    key = ContainerKey(pinned.uid, "main")
    assert env.saved() == {pinned.uid: {"main": FIRST_SINGLE}}
    assert env.engine.state.assignments[key].container_id == pinned_id
    assert env.engine.state.shared == CPUSet.parse("1-3,5-7")
    assert env.cpus(big_id) == "1-3,5-7"
    assert not [r for r in caplog.records if "loses the CPUs" in r.getMessage()]
    assert_consistent(env)

    failing.clear()
    assert (await sweep(env.engine)).tracked == [pinned_id]
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.engine.containers[pinned_id].exclusive
    assert_consistent(env)


@pytest.mark.parametrize("when", ["start-up", "reload"])
@pytest.mark.parametrize(
    "policy", [static_policy("0,4"), NonePolicy(TOPOLOGY)], ids=["reserved-now", "none"]
)
async def test_a_replan_tells_of_cpus_a_container_start_up_could_not_read_loses(
    env: Env,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    policy: StaticPolicy | NonePolicy,
    when: str,
) -> None:
    """CPUs the new policy may hand to no container (reserved now, or none at all under
    ``none``) cannot stay held: the assignment goes, and that is told, since the container
    runs on them beside the shared containers until a sweep reads it and moves it. A
    reload used to give it new CPUs without a word, held while it ran on the old ones."""
    pinned = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    failing = unreadable(env, monkeypatch, Status.UNKNOWN)
    failing.add(pinned_id)

    with caplog.at_level("WARNING", logger="shim.engine"):
        await replanned(env, policy, when)
    assert env.saved() == {}
    lost = [r.__dict__["fields"] for r in caplog.records if "loses the CPUs" in r.getMessage()]
    assert [fields["containers"] for fields in lost] == [
        {str(ContainerKey(pinned.uid, "main")): FIRST_SINGLE}
    ]
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert_consistent(env)

    failing.clear()
    assert (await sweep(env.engine)).tracked == [pinned_id]
    # Moved: adopted onto CPUs it may hold now, or shared.
    assert_consistent(env)


async def test_a_reload_keeps_the_cpus_held_by_pod_and_name_for_a_container_not_read(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An assignment start-up kept without a container id, its container unread, is one a
    container cpushim does not track may run on too: a reload keeps it first, as it is, and
    the sweep that reads the container gives it the id there."""
    pinned, pinned_id, big_id = await pinned_beside_big(env)
    key = ContainerKey(pinned.uid, "main")
    env.engine.checkpoint.save_sync(env.engine.state.update(key, container_id=""))
    failing = unreadable(env, monkeypatch, Status.UNKNOWN)
    failing.add(pinned_id)
    await replanned(env, STRICT, "reload")
    assert env.saved() == {pinned.uid: {"main": FIRST_SINGLE}}
    assert env.engine.state.assignments[key].container_id == ""
    assert env.cpus(big_id) == str(env.engine.state.shared)

    failing.clear()
    assert (await sweep(env.engine)).tracked == [pinned_id]
    assert env.engine.state.assignments[key].container_id == pinned_id
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert_consistent(env)


@pytest.mark.parametrize("status", [Status.UNKNOWN, None], ids=["failed", "undecodable"])
async def test_a_container_start_up_could_not_read_is_not_warned_of_again_by_the_sweeps(
    env: Env,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    status: Status | None,
) -> None:
    """Start-up tells of it; the sweeps that follow (tried again while the runtime still
    cannot say) read it for the same reason and do not tell it again."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    await env.engine.checkpoint_written()
    failing = unreadable(env, monkeypatch, status)
    failing.add(container_id)
    with caplog.at_level("WARNING", logger="shim.engine.resync"):
        await env.restart()
        for _ in range(2):
            assert (await sweep(env.engine)).unfinished
    told = [
        (r.getMessage(), r.__dict__["fields"]["pod"], r.__dict__["fields"]["container_id"])
        for r in caplog.records
        if r.getMessage().startswith("cannot read a container's")
    ]
    assert told == [
        (
            "cannot read a container's status; it stays as it is until a sweep reads it",
            "default/db",
            container_id,
        )
    ]
    failing.clear()
    assert (await sweep(env.engine)).tracked == [container_id]
    assert env.engine.unread_untracked == set()


async def test_a_sweep_s_read_of_a_status_that_does_not_decode_is_warned_of_with_why(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Told as a failed call is, with the decode error: the container may live all the same,
    and nothing else would say why a sweep leaves it."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    unreadable(env, monkeypatch, None).add(container_id)
    with caplog.at_level("WARNING", logger="shim.engine.resync"):
        read = await resync.status_read(env.engine, container_id, pod.sandbox_id)
    assert read == resync.StatusRead(None, answered=False)
    warned = [r.__dict__["fields"] for r in caplog.records if "cannot read" in r.getMessage()]
    assert [fields["container_id"] for fields in warned] == [container_id]
    assert "does not decode" in warned[0]["error"]


async def test_a_container_whose_status_cannot_be_read_is_recovered_by_a_sweep(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under --recover-from-runtime nothing says what an unread container holds: it is left
    where it runs, and the sweep adopts it as start-up would have."""
    pinned = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    await env.engine.checkpoint_written()
    failing = unreadable(env, monkeypatch, Status.DEADLINE_EXCEEDED)
    failing.add(pinned_id)

    await env.restart(recover=True)
    assert env.saved() == {}
    assert pinned_id not in env.engine.containers
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.engine.sweep_wanted

    failing.clear()
    report = await sweep(env.engine)
    assert report.tracked == [pinned_id]
    assert report.adopted_exclusive == [ContainerKey(pinned.uid, "main")]
    assert env.saved() == {pinned.uid: {"main": FIRST_SINGLE}}
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert_consistent(env)


async def test_a_pod_start_up_could_not_place_is_placed_by_the_container_a_sweep_reads(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its sandbox's status failed at start-up, and so did its only container's: nothing
    told the pod's cgroup parent, so its QoS class. The sweep that reads the container
    finds the pod's cgroup in its answer (the sandbox's status failing still) and adopts it
    as start-up would have, where it used to leave it sharing until the next start."""
    pinned = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    failing = unreadable(env, monkeypatch, Status.DEADLINE_EXCEEDED)
    failing.update({pinned.sandbox_id, pinned_id})

    await env.restart(recover=True)
    assert env.engine.pods[pinned.sandbox_id].qos is None
    assert env.cpus(pinned_id) == FIRST_SINGLE

    failing.discard(pinned_id)
    report = await sweep(env.engine)
    assert report.tracked == [pinned_id]
    assert report.adopted_exclusive == [ContainerKey(pinned.uid, "main")]
    pod = env.engine.pods[pinned.sandbox_id]
    assert (pod.qos, pod.cgroup_parent) == (QOSClass.GUARANTEED, pinned.config.linux.cgroup_parent)
    assert env.saved() == {pinned.uid: {"main": FIRST_SINGLE}}
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert_consistent(env)


async def test_a_pod_start_up_could_not_place_by_any_container_is_told_of_once(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its sandbox's status failed, and so did every one of its containers': start-up,
    which tells of a pod none of its read containers places, said nothing of it. It is
    told once, naming the containers a sweep may yet place it by, and not again by the
    sweeps that try them while they fail, nor by the one that reads it and places it."""
    pinned = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    failing = unreadable(env, monkeypatch, Status.DEADLINE_EXCEEDED)
    failing.update({pinned.sandbox_id, pinned_id})

    with caplog.at_level("INFO", logger="shim.engine"):
        await env.restart(recover=True)
        for _ in range(2):
            assert (await sweep(env.engine)).unfinished
        failing.discard(pinned_id)
        assert (await sweep(env.engine)).tracked == [pinned_id]
    told = [
        (r.getMessage(), r.__dict__["fields"])
        for r in caplog.records
        if r.getMessage().startswith("a pod's cgroup parent is")
    ]
    unknown = (
        "a pod's cgroup parent is unknown; its containers share unless a sweep finds it on"
        " one start-up could not read"
    )
    assert [(message, fields.get("unread")) for message, fields in told] == [
        (unknown, [pinned_id]),
        ("a pod's cgroup parent is found on its container", None),
    ]
    assert told[0][1]["sandbox_id"] == pinned.sandbox_id
    assert env.engine.pods[pinned.sandbox_id].qos is QOSClass.GUARANTEED


async def test_a_create_cut_short_whose_container_cannot_be_read_keeps_its_cpus(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An assignment persisted without its container id finds its container by pod and
    name: one whose status fails may be it, so the CPUs stay held for the sweep."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    key = ContainerKey(pod.uid, "main")
    env.engine.checkpoint.save_sync(env.engine.state.update(key, container_id=""))
    failing = unreadable(env, monkeypatch, Status.UNKNOWN)
    failing.add(container_id)

    await env.restart()
    assert env.saved() == {pod.uid: {"main": FIRST_SINGLE}}
    assert env.engine.state.assignments[key].container_id == ""

    failing.clear()
    assert (await sweep(env.engine)).tracked == [container_id]
    assert env.engine.state.assignments[key].container_id == container_id
    assert env.cpus(container_id) == FIRST_SINGLE
    assert_consistent(env)


async def test_a_pod_whose_containers_name_another_pods_cgroup_is_not_classified_by_them(
    env: Env,
) -> None:
    """The parent found on a container is the pod's only when it names the pod's UID."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    container = await live_status(env.engine, container_id, pod.sandbox_id)
    assert container is not None
    unplaced = dataclasses.replace(
        env.engine.pods[pod.sandbox_id], qos=None, cgroup_parent="", uid="another"
    )
    assert placed_pod(unplaced, [container]) == unplaced
    own = dataclasses.replace(unplaced, uid=pod.uid)
    placed = placed_pod(own, [container])
    assert placed.qos is QOSClass.GUARANTEED
    assert placed.cgroup_parent == pod.config.linux.cgroup_parent


@pytest.mark.parametrize("recover", [False, True], ids=["checkpoint", "recovered"])
async def test_a_runtime_without_resources_in_its_status_is_read_from_the_containers_spec(
    env: Env, recover: bool
) -> None:
    """containerd before 1.6.9 gives no resources in ContainerStatus: the OCI spec in its
    verbose info has them, so a pinned container stays pinned, its quota still cpushim's."""
    pinned = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned, "main", 1000)
    sharing = await env.kubelet.run_pod("web", "burstable")
    sharing_id = await env.kubelet.start_new(sharing, "main", 500)
    await env.engine.checkpoint_written()
    env.fake.reports_resources = False

    await env.restart(recover=recover)
    assert env.saved() == {pinned.uid: {"main": FIRST_SINGLE}}
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert FIRST_SINGLE not in env.cpus(sharing_id).split(",")
    assert env.fake.containers[pinned_id].resources.cpu_quota == -1
    tracked = env.engine.containers[pinned_id]
    assert tracked.cpus_asked == 1
    assert_consistent(env)


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (
            {"cpu": {"shares": 1024, "quota": -1, "period": 100000, "cpus": "4", "mems": "0"}},
            pb.LinuxContainerResources(
                cpu_shares=1024,
                cpu_quota=-1,
                cpu_period=100000,
                cpuset_cpus="4",
                cpuset_mems="0",
            ),
        ),
        # protobuf's JSON mapping gives 64-bit integers as strings.
        (
            {"cpu": {"shares": "2048", "quota": "-1"}, "memory": {"limit": "1073741824"}},
            pb.LinuxContainerResources(
                cpu_shares=2048, cpu_quota=-1, memory_limit_in_bytes=1073741824
            ),
        ),
        ({"cpu": {"shares": -2, "cpus": 4, "quota": "--5"}}, pb.LinuxContainerResources()),
        ({"cpu": {"shares": 2**70}}, pb.LinuxContainerResources()),
        ({"cpu": "lots"}, pb.LinuxContainerResources()),
        (None, pb.LinuxContainerResources()),
    ],
)
def test_resources_read_from_a_containers_spec(info: object, expected: object) -> None:
    document = json.dumps({"runtimeSpec": {"linux": {"resources": info}}})
    assert spec_resources(document) == expected
    assert spec_resources("not json") == pb.LinuxContainerResources()
