"""The engine against a stateful fake containerd, on a fake 2-socket machine.

Calls go straight into ``Engine.handle`` with kubelet's request shapes (the relay in front of
it is tested on its own). The machine: 2 sockets x 2 cores x 2 threads, siblings n and n+4, so
socket 0 holds CPUs 0,1,4,5 and socket 1 holds 2,3,6,7; CPU 0 is reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import orjson
import pytest
from grpclib.const import Status as GrpcStatus

from shim import checkpoint as checkpoint_module
from shim.checkpoint import CheckpointFile
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Status, UnaryCall
from shim.cri.server import Pending
from shim.cri.upstream import RuntimeChannel
from shim.engine import Engine, EngineOptions
from shim.engine import requests as rq
from shim.engine.resync import StartupError, adopt_sharing, waiting_for_exclusive
from shim.engine.tracked import Phase
from shim.kube import QOSClass
from shim.policy.none import NonePolicy
from shim.policy.options import StaticPolicyOptions
from shim.policy.static import StaticPolicy
from shim.state import Assignment, ContainerKey, CPUState, topology_changed
from tests.fake_runtime import FakeRuntime
from tests.harness.kubelet import (
    QoSClass,
    milli_cpu_to_quota,
    milli_cpu_to_shares,
)
from tests.harness.sysfs import MachineSpec, expected_topology
from tests.unit.engine_env import (
    ALL,
    FIRST_SINGLE,
    GIB,
    SHARED_AFTER_FIRST_SINGLE,
    TOPOLOGY,
    Env,
    Pod,
    assert_consistent,
    env,
    make_env,
    pinned_on_half_cores,
    second_of_two_released,
    static_policy,
    through_relay,
    until,
    updates,
    updates_to,
)

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


# --- creating --------------------------------------------------------------------------------


async def test_a_guaranteed_container_is_pinned_after_the_shared_ones_move(env: Env) -> None:
    kubelet = env.kubelet
    besteffort = await kubelet.run_pod("web", "besteffort")
    shared_id = await kubelet.start_new(besteffort, "main")
    assert env.cpus(shared_id) == "0-7"

    guaranteed = await kubelet.run_pod("db", "guaranteed")
    pinned_id = await kubelet.start_new(guaranteed, "main", 2000)

    pinned = env.fake.containers[pinned_id].resources
    assert pinned.cpuset_cpus == "1,5"  # the two threads of core 1 on socket 0
    assert pinned.cpuset_mems == "0"
    assert pinned.cpu_quota == -1
    assert env.cpus(shared_id) == "0,2-4,6-7"
    # The shared container moved before the runtime saw the CreateContainer.
    order = [name for name, _ in env.fake.calls]
    last_update = max(i for i, name in enumerate(order) if name == "UpdateContainerResources")
    create = [i for i, name in enumerate(order) if name == "CreateContainer"][-1]
    assert last_update < create
    assert env.saved() == {guaranteed.uid: {"main": "1,5"}}
    assert (
        env.engine.state.assignments[ContainerKey(guaranteed.uid, "main")].container_id == pinned_id
    )
    assert_consistent(env)


@pytest.mark.parametrize(
    ("qos", "milli_cpu", "annotations"),
    [
        pytest.param("guaranteed", 1500, {}, id="fractional"),
        pytest.param("burstable", 1000, {}, id="burstable"),
        pytest.param("besteffort", 0, {}, id="besteffort"),
        pytest.param("guaranteed", 1000, {"cpushim.io/exclusive": "false"}, id="pod-opt-out"),
        pytest.param(
            "guaranteed", 1000, {"cpushim.io/exclusive.main": "false"}, id="container-opt-out"
        ),
    ],
)
async def test_containers_that_share(
    env: Env, qos: QoSClass, milli_cpu: int, annotations: dict[str, str]
) -> None:
    pod = await env.kubelet.run_pod("p", qos, annotations)
    container_id = await env.kubelet.start_new(pod, "main", milli_cpu)
    assert env.cpus(container_id) == "0-7"
    assert env.engine.state.assignments == {}
    assert env.fake.containers[container_id].resources.cpu_quota == milli_cpu_to_quota(
        milli_cpu if qos == "guaranteed" else 0
    )


async def test_per_container_opt_in_overrides_the_pod_opt_out(env: Env) -> None:
    pod = await env.kubelet.run_pod(
        "p",
        "guaranteed",
        {"cpushim.io/exclusive": "false", "cpushim.io/exclusive.fast": "true"},
    )
    slow = await env.kubelet.start_new(pod, "slow", 1000)
    fast = await env.kubelet.start_new(pod, "fast", 1000)
    assert env.cpus(fast) == FIRST_SINGLE
    assert env.cpus(slow) == SHARED_AFTER_FIRST_SINGLE


async def test_cfs_quota_keep_annotation(env: Env) -> None:
    pod = await env.kubelet.run_pod("p", "guaranteed", {"cpushim.io/cfs-quota": "keep"})
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    resources = env.fake.containers[container_id].resources
    assert resources.cpuset_cpus == FIRST_SINGLE
    assert resources.cpu_quota == 100_000


async def test_isolated_cpus_annotation(tmp_path: Path) -> None:
    topology = expected_topology(
        MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2, isolated=frozenset({3, 7}))
    )
    policy = StaticPolicy.create(topology, reserved=CPUSet.parse("0"))
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, policy)
        plain = await env.kubelet.run_pod("plain", "guaranteed")
        rt = await env.kubelet.run_pod("rt", "guaranteed", {"cpushim.io/isolated-cpus": "require"})
        assert env.cpus(await env.kubelet.start_new(rt, "main", 2000)) == "3,7"
        # Packing favours the socket with fewer free CPUs: socket 1 has only 2 and 6 left.
        assert env.cpus(await env.kubelet.start_new(plain, "main", 1000)) == "2"
        more = await env.kubelet.run_pod(
            "more", "guaranteed", {"cpushim.io/isolated-cpus": "require"}
        )
        reply = await env.kubelet.create(more, "main", 1000)
        assert reply.status is Status.RESOURCE_EXHAUSTED
        assert "isolated" in reply.status_message
        env.channel.close()


async def test_a_bad_annotation_is_refused_and_nothing_is_created(env: Env) -> None:
    pod = await env.kubelet.run_pod("p", "guaranteed", {"cpushim.io/isolated-cpus": "maybe"})
    reply = await env.kubelet.create(pod, "main", 1000)
    assert reply.status is Status.INVALID_ARGUMENT
    assert "cpushim.io/isolated-cpus" in reply.status_message
    assert "default/p" in reply.status_message
    assert env.fake.calls_of("CreateContainer") == []


async def test_a_malformed_request_is_refused(env: Env) -> None:
    reply = await env.kubelet.call("CreateContainer", b"\xff\xff\xff")
    assert reply.status is Status.INVALID_ARGUMENT
    assert "CreateContainerRequest" in reply.status_message
    assert env.fake.calls_of("CreateContainer") == []


async def test_not_enough_cpus_is_resource_exhausted_and_leaks_nothing(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    big = await kubelet.run_pod("big", "guaranteed")
    await kubelet.start_new(big, "main", 7000)
    updates_before = len(env.fake.calls_of("UpdateContainerResources"))
    saved_before = env.saved()

    greedy = await kubelet.run_pod("greedy", "guaranteed")
    reply = await kubelet.create(greedy, "worker", 2000)
    assert reply.status is Status.RESOURCE_EXHAUSTED
    message = reply.status_message
    assert "default/greedy" in message
    assert "worker" in message
    assert "2 exclusive CPUs" in message
    assert "free: none" in message
    assert len(env.fake.calls_of("CreateContainer")) == 2
    assert len(env.fake.calls_of("UpdateContainerResources")) == updates_before
    assert env.saved() == saved_before
    assert env.cpus(shared_id) == "0"
    assert env.engine.counters["pinning_errors"] == 1
    assert_consistent(env)


async def test_a_failed_create_is_rolled_back(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")
    env.fake.fail_next("CreateContainer", GrpcStatus.UNKNOWN, "disk full")
    reply = await kubelet.create(pod, "main", 2000)
    assert reply.status is Status.UNKNOWN
    assert reply.status_message == "disk full"
    # The CPUs were there: a failed create, not a pinning error.
    assert env.engine.counters["failed_exclusive_creates"] == 1
    assert env.engine.counters["pinning_errors"] == 0
    assert env.engine.state.assignments == {}
    assert env.saved() == {}
    assert env.cpus(shared_id) == "0-7"
    assert updates_to(env.fake, shared_id) == ["0,2-4,6-7", "0-7"]
    # kubelet retries; this time it works and gets the same CPUs.
    retried = await kubelet.start_new(pod, "main", 2000)
    assert env.cpus(retried) == "1,5"
    assert_consistent(env)


# --- releasing -------------------------------------------------------------------------------


async def test_stop_releases_and_grows_the_shared_containers_before_returning(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")
    pinned_id = await kubelet.start_new(pod, "main", 1000)
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    await kubelet.stop(pinned_id)
    assert env.cpus(shared_id) == "0-7"
    assert env.engine.state.assignments == {}
    assert env.saved() == {}
    await kubelet.remove(pinned_id)
    assert_consistent(env)


async def test_a_failed_stop_keeps_the_cpus(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    env.fake.fail_next("StopContainer", GrpcStatus.DEADLINE_EXCEEDED, "slow")
    reply = await env.kubelet.call(
        "StopContainer", pb.StopContainerRequest(container_id=pinned_id).SerializeToString()
    )
    assert reply.status is Status.DEADLINE_EXCEEDED
    assert env.saved() == {pod.uid: {"main": FIRST_SINGLE}}


async def test_a_recreated_container_gets_its_cpus_back(env: Env) -> None:
    second = await second_of_two_released(env)
    again = await env.kubelet.start_new(second, "main", 1000, attempt=1)
    assert env.cpus(again) == "1"


async def test_a_crashed_container_restarted_by_kubelet_keeps_its_cpus(env: Env) -> None:
    kubelet = env.kubelet
    pod = await kubelet.run_pod("db", "guaranteed")
    crashed = await kubelet.start_new(pod, "main", 2000)
    env.fake.exit_container(crashed, 137)
    restarted = await kubelet.start_new(pod, "main", 2000, attempt=1)
    assert env.cpus(restarted) == env.cpus(crashed) == "1,5"
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].container_id == restarted
    assert env.engine.state.assignments[key].attempt == 1
    # kubelet's garbage collector removes the old attempt: the new one keeps its CPUs.
    await kubelet.remove(crashed)
    assert env.engine.state.assignments[key].container_id == restarted
    assert_consistent(env)


async def test_cpus_of_exited_init_containers_are_reused(env: Env) -> None:
    kubelet = env.kubelet
    other = await kubelet.run_pod("other", "guaranteed")
    await kubelet.start_new(other, "main", 4000)  # leaves 2 CPUs to hand out
    pod = await kubelet.run_pod("app", "guaranteed")
    init_id = await kubelet.start_new(pod, "init", 2000)
    env.fake.exit_container(init_id, 0)  # ran to completion; kubelet sends no StopContainer
    app_id = await kubelet.start_new(pod, "app", 2000)
    assert env.cpus(app_id) == env.cpus(init_id)
    assert ContainerKey(pod.uid, "init") not in env.engine.state.assignments
    assert_consistent(env)


async def test_cpus_of_exited_init_containers_go_back_when_a_shared_container_follows(
    env: Env,
) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("app", "guaranteed")
    init_id = await kubelet.start_new(pod, "init", 2000)
    env.fake.exit_container(init_id, 0)  # ran to completion; kubelet sends no StopContainer
    app_id = await kubelet.start_new(pod, "app", 1500)  # a fraction of a CPU: it shares
    assert ContainerKey(pod.uid, "init") not in env.engine.state.assignments
    assert env.saved() == {}
    assert env.cpus(shared_id) == env.cpus(app_id) == "0-7"
    assert_consistent(env)


async def test_a_next_attempt_asking_for_more_than_is_free_gives_its_old_cpus_back(
    env: Env,
) -> None:
    # An in-place resize with resizePolicy RestartContainer: the next attempt asks for
    # another count. Refused, the old attempt's CPUs must not stay held in the checkpoint
    # while memory has let them go, nor stay out of the shared containers' pool.
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    await kubelet.start_new(await kubelet.run_pod("big", "guaranteed"), "main", 5000)
    pod = await kubelet.run_pod("app", "guaranteed")
    first = await kubelet.start_new(pod, "main", 1000)
    env.fake.exit_container(first, 1)
    reply = await kubelet.create(pod, "main", 3000, attempt=1)
    assert reply.status is Status.RESOURCE_EXHAUSTED
    assert ContainerKey(pod.uid, "main") not in env.engine.state.assignments
    await env.engine.checkpoint_written()
    saved = env.engine.checkpoint.load()
    assert saved is not None
    assert saved.assignments == env.engine.state.assignments
    assert env.cpus(shared_id) == str(env.engine.state.shared)
    assert len(env.engine.state.shared) == 3  # CPU 0 and the two the attempts did not hold
    assert_consistent(env)


async def test_a_next_attempt_that_shares_gives_its_old_exclusive_cpus_back(env: Env) -> None:
    # A resize from 1 CPU to 1.5 (resizePolicy RestartContainer): the next attempt shares.
    # Attempt 0 crashed unseen (kubelet sends no StopContainer for a crash, and kubelet keeps
    # the dead container, so no RemoveContainer comes either).
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("app", "guaranteed")
    first = await kubelet.start_new(pod, "main", 1000)
    env.fake.exit_container(first, 1)
    app_id = await kubelet.start_new(pod, "main", 1500, attempt=1)
    assert ContainerKey(pod.uid, "main") not in env.engine.state.assignments
    assert env.saved() == {}
    assert env.cpus(shared_id) == env.cpus(app_id) == "0-7"
    assert_consistent(env)


@pytest.mark.parametrize("milli_cpu", [500, 1000], ids=["shared", "exclusive"])
async def test_a_create_goes_on_when_a_siblings_state_cannot_be_read(
    env: Env, milli_cpu: int
) -> None:
    """Before a create, the pod's pinned containers that exited by themselves give their
    CPUs back; one the runtime says nothing of keeps them, and the create goes on (an
    exclusive one failed INTERNAL, or under fail-open went out unpinned)."""
    kubelet = env.kubelet
    pod = await kubelet.run_pod("app", "guaranteed")
    main_id = await kubelet.start_new(pod, "main", 1000)
    env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "busy")
    reply = await kubelet.create(pod, "sidecar", milli_cpu)
    assert reply.status is Status.OK, reply.status_message
    assert env.engine.state.holding(main_id) == ContainerKey(pod.uid, "main")  # kept
    assert (ContainerKey(pod.uid, "sidecar") in env.engine.state.assignments) == (milli_cpu == 1000)
    assert_consistent(env)


async def test_a_refusal_says_which_siblings_state_could_not_be_read(env: Env) -> None:
    kubelet = env.kubelet
    pod = await kubelet.run_pod("app", "guaranteed")
    await kubelet.start_new(pod, "main", 6000)  # one CPU left that is not reserved
    env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "busy")
    reply = await kubelet.create(pod, "sidecar", 2000)
    assert reply.status is Status.RESOURCE_EXHAUSTED
    assert reply.status_message.endswith(
        "; the runtime did not say whether main of the pod exited, so their CPUs stay held"
    )
    assert_consistent(env)


async def test_stop_and_remove_pod_sandbox_release_the_pod(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")
    await kubelet.start_new(pod, "a", 1000)
    await kubelet.start_new(pod, "b", 2000)
    assert len(CPUSet.parse(env.cpus(shared_id))) == 5
    await kubelet.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString(),
    )
    assert env.engine.state.assignments == {}
    assert env.cpus(shared_id) == "0-7"
    await kubelet.ok(
        "RemovePodSandbox",
        pb.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString(),
    )
    assert pod.sandbox_id not in env.engine.pods
    assert all(t.sandbox_id != pod.sandbox_id for t in env.engine.containers.values())
    assert_consistent(env)


# --- kubelet's own updates -------------------------------------------------------------------


async def test_kubelet_updates_pass_but_the_cpuset_stays_ours(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    request = pb.UpdateContainerResourcesRequest(
        container_id=pinned_id,
        linux=pb.LinuxContainerResources(
            cpu_period=100_000,
            cpu_quota=100_000,
            cpu_shares=1024,
            memory_limit_in_bytes=2 * GIB,
            cpuset_cpus="0-7",
        ),
    )
    await env.kubelet.ok("UpdateContainerResources", request.SerializeToString())
    resources = env.fake.containers[pinned_id].resources
    assert resources.memory_limit_in_bytes == 2 * GIB
    assert resources.cpuset_cpus == FIRST_SINGLE
    assert resources.cpu_quota == -1


def kubelet_resize(container_id: str, milli_cpu: int) -> bytes:
    """kubelet's in-place resize of a Guaranteed container: its whole resource set, with
    the CPU (request = limit) given."""
    return pb.UpdateContainerResourcesRequest(
        container_id=container_id,
        linux=pb.LinuxContainerResources(
            cpu_period=100_000,
            cpu_quota=milli_cpu_to_quota(milli_cpu),
            cpu_shares=milli_cpu_to_shares(milli_cpu),
            memory_limit_in_bytes=2 * GIB,
        ),
    ).SerializeToString()


async def beside_a_shared_one(env: Env, milli_cpu: int) -> tuple[str, Pod, str]:
    """A running BestEffort container, then a Guaranteed pod "db" whose one container asks
    for ``milli_cpu``: (the shared container's id, the pod, its container's id)."""
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("web", "besteffort"), "main")
    pod = await env.kubelet.run_pod("db", "guaranteed")
    return shared_id, pod, await env.kubelet.start_new(pod, "main", milli_cpu)


def resize_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "resize" in r.getMessage()
    ]


async def test_an_in_place_resize_to_more_cpus_keeps_the_old_ones_and_moves_the_shared_first(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    shared_id, pod, pinned_id = await beside_a_shared_one(env, 1000)
    assert env.cpus(pinned_id) == FIRST_SINGLE
    env.fake.calls.clear()
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    resources = env.fake.containers[pinned_id].resources
    assert resources.memory_limit_in_bytes == 2 * GIB  # the rest of the resize passes
    # CPU 4 kept; its sibling 0 is reserved, so the next comes from its socket.
    assert resources.cpuset_cpus == "1,4"
    assert resources.cpuset_mems == "0"
    assert resources.cpu_quota == -1
    assert env.cpus(shared_id) == "0,2-3,5-7"
    # The shared container left CPU 1 before kubelet's update gave it to the resized one.
    assert updates_to(env.fake, shared_id) == ["0,2-3,5-7"]
    order = [m.container_id for m in updates(env.fake)]
    assert order == [shared_id, pinned_id]
    assert env.saved()[pod.uid] == {"main": "1,4"}
    assert env.engine.counters["cpu_resizes_applied"] == 1
    assert env.engine.counters["cpu_resizes_not_applied"] == 0
    assert resize_warnings(caplog) == []
    # The same update again (a retry, another client's) changes nothing.
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert env.engine.counters["cpu_resizes_applied"] == 1
    # A memory-only update names no CPUs.
    memory_only = pb.UpdateContainerResourcesRequest(
        container_id=pinned_id, linux=pb.LinuxContainerResources(memory_limit_in_bytes=GIB)
    )
    await env.kubelet.ok("UpdateContainerResources", memory_only.SerializeToString())
    assert env.cpus(pinned_id) == "1,4"
    assert_consistent(env)


async def test_log_lines_name_a_container_by_its_pod_as_kubectl_shows_it(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator greps the log for a pod's namespace/name: every line of its container's
    life carries it, beside the checkpoint's key and the runtime's id, after a restart too."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    key = str(ContainerKey(pod.uid, "main"))

    def named(message: str) -> list[dict[str, object]]:
        return [
            {k: r.__dict__["fields"].get(k) for k in ("pod", "container", "container_id")}
            for r in caplog.records
            if r.getMessage() == message
        ]

    with caplog.at_level(logging.INFO, logger="shim.engine"):
        pinned_id = await env.kubelet.start_new(pod, "main", 1000)
        await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
        await env.restart()
        await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 1000))
        await env.kubelet.stop(pinned_id)
    whole = {"pod": "default/db", "container": key, "container_id": pinned_id}
    assert named("pinned") == [whole]
    assert named("resized in place") == [whole, whole]  # the second by an adopted record
    [released] = [r for r in caplog.records if r.getMessage() == "released"]
    assert released.__dict__["fields"]["pods"] == ["default/db"]
    assert released.__dict__["fields"]["containers"] == [key]


async def test_a_pods_refused_cpus_are_told_by_its_namespace_and_name(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The lines an operator looks for when a pod gets no exclusive CPUs name it as kubectl
    does, as the others of its containers' lives do: a create the policy refuses, and a
    container sharing since it was created under none that an adoption finds no room for."""
    big = await env.kubelet.run_pod("big", "guaranteed")
    reply = await env.kubelet.create(big, "main", 16_000)
    assert reply.status is Status.RESOURCE_EXHAUSTED
    await env.engine.change_policy(NonePolicy(TOPOLOGY))
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 2000)
    await env.engine.change_policy(static_policy("0-6"))  # one CPU left that is not reserved
    assert await adopt_sharing(env.engine) == []
    [refused] = [r for r in caplog.records if r.getMessage() == "allocation refused"]
    assert refused.__dict__["fields"]["pod"] == "default/big"
    assert refused.__dict__["fields"]["container"] == str(ContainerKey(big.uid, "main"))
    [shares] = [r for r in caplog.records if "cannot get its exclusive CPUs" in r.getMessage()]
    assert {k: shares.__dict__["fields"][k] for k in ("pod", "container", "container_id")} == {
        "pod": "default/db",
        "container": str(ContainerKey(pod.uid, "main")),
        "container_id": container_id,
    }


async def test_an_in_place_resize_to_fewer_cpus_gives_them_to_the_shared_once_left(
    env: Env,
) -> None:
    shared_id, pod, pinned_id = await beside_a_shared_one(env, 4000)
    assert env.cpus(pinned_id) == "2-3,6-7"  # socket 1
    env.fake.calls.clear()
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert env.cpus(pinned_id) == "2,6"  # a whole core of its own
    assert env.cpus(shared_id) == "0-1,3-5,7"
    # The resized container left CPUs 3 and 7 before the shared one was grown onto them.
    order = [m.container_id for m in updates(env.fake)]
    assert order == [pinned_id, shared_id]
    assert env.saved()[pod.uid] == {"main": "2,6"}
    assert env.engine.counters["cpu_resizes_applied"] == 1
    assert_consistent(env)


async def test_an_in_place_resize_to_a_fraction_shares_with_kubelets_quota_for_good(
    env: Env,
) -> None:
    shared_id, _, pinned_id = await beside_a_shared_one(env, 2000)
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 1500))
    resources = env.fake.containers[pinned_id].resources
    assert resources.cpuset_cpus == env.cpus(shared_id) == str(ALL)
    assert resources.cpu_quota == milli_cpu_to_quota(1500)
    assert env.engine.state.assignments == {}
    assert env.engine.counters["cpu_resizes_applied"] == 1
    # It asks for no exclusive CPUs now: no adoption takes it back to two.
    assert not env.engine.containers[pinned_id].exclusive
    assert waiting_for_exclusive(env.engine) == []
    assert await adopt_sharing(env.engine) == []
    assert_consistent(env)


async def test_an_in_place_resize_of_a_fraction_to_whole_cpus_pins_it(env: Env) -> None:
    shared_id, pod, fraction_id = await beside_a_shared_one(env, 1500)
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(fraction_id, 2000))
    resources = env.fake.containers[fraction_id].resources
    assert resources.cpuset_cpus == "1,5"
    assert resources.cpu_quota == -1
    assert env.cpus(shared_id) == "0,2-4,6-7"
    assignment = env.engine.state.assignments[ContainerKey(pod.uid, "main")]
    assert (assignment.container_id, assignment.sandbox_id) == (fraction_id, pod.sandbox_id)
    assert env.engine.counters["cpu_resizes_applied"] == 1
    # Back to a fraction: it shares again with kubelet's quota.
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(fraction_id, 1500))
    assert env.cpus(fraction_id) == str(env.engine.state.shared) == str(ALL)
    assert env.fake.containers[fraction_id].resources.cpu_quota == milli_cpu_to_quota(1500)
    assert_consistent(env)


async def test_an_in_place_resize_of_a_fraction_keeps_kubelets_memory_nodes(env: Env) -> None:
    """kubelet's Static memory manager confines a Guaranteed container with a fraction too
    (node 1 here): pinned by a resize, its CPUs come from there and its memory stays there,
    as an adoption would have it; back to a fraction, it shares with kubelet's node."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    fraction_id = await env.kubelet.start_new(pod, "main", 1500, mems="1")
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(fraction_id, 2000))
    resources = env.fake.containers[fraction_id].resources
    assert CPUSet.parse(resources.cpuset_cpus).issubset(CPUSet.parse("2-3,6-7"))  # socket 1
    assert resources.cpuset_mems == "1"
    assignment = env.engine.state.assignments[ContainerKey(pod.uid, "main")]
    assert assignment.mems == CPUSet.parse("1")

    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(fraction_id, 1500))
    resources = env.fake.containers[fraction_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == (str(ALL), "1")
    assert_consistent(env)


@pytest.mark.parametrize("restarted", [False, True], ids=["running", "after a restart"])
async def test_an_in_place_resize_of_a_fraction_keeps_kubelets_choice_of_every_node(
    env: Env, restarted: bool
) -> None:
    """kubelet's memory manager may name every node (the container's memory spans both):
    pinned by a resize, its memory stays on both nodes, not only those of its CPUs, after a
    restart of cpushim too, which reads kubelet's nodes from the runtime's record."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    fraction_id = await env.kubelet.start_new(pod, "main", 1500, mems="0-1")
    if restarted:
        await env.restart()
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(fraction_id, 1000))
    resources = env.fake.containers[fraction_id].resources
    assert len(CPUSet.parse(resources.cpuset_cpus)) == 1
    assert resources.cpuset_mems == "0-1"
    assignment = env.engine.state.assignments[ContainerKey(pod.uid, "main")]
    assert assignment.mems == CPUSet.parse("0-1")
    assert_consistent(env)


async def test_a_container_resized_back_to_whole_cpus_gets_its_old_ones_if_free(
    env: Env,
) -> None:
    first = await env.kubelet.run_pod("first", "guaranteed")
    first_id = await env.kubelet.start_new(first, "main", 1000)
    assert env.cpus(first_id) == FIRST_SINGLE
    _, pod, pinned_id = await beside_a_shared_one(env, 1000)
    before = env.cpus(pinned_id)
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 1500))
    # The CPU a new choice takes first is free again; the container's own is too.
    await env.kubelet.stop(first_id)
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 1000))
    assert env.cpus(pinned_id) == before != FIRST_SINGLE
    assert env.engine.state.released.get(ContainerKey(pod.uid, "main")) is None
    assert_consistent(env)


async def test_an_in_place_resize_without_room_is_refused_changing_nothing(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """kubelet retries a resize the runtime refuses at every sync of the pod and shows the
    error in the pod's status; the refusal is logged and counted once per count asked."""
    shared_id, pod, pinned_id = await beside_a_shared_one(env, 1000)
    calls = len(env.fake.calls)
    # Seven CPUs to hand out (CPU 0 is reserved): 8 do not fit.
    reply = await env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 8000))
    assert reply.status is Status.RESOURCE_EXHAUSTED
    assert reply.status_message.startswith(
        "cpushim: cannot resize pod default/db container main in place to 8 exclusive CPUs:"
    )
    assert "cannot allocate 8 CPUs" in reply.status_message
    assert "it holds 4; free: 1-3,5-7" in reply.status_message
    # Nothing went to the runtime, and nothing changed.
    assert len(env.fake.calls) == calls
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert env.saved()[pod.uid] == {"main": FIRST_SINGLE}
    assert env.engine.counters["cpu_resizes_not_applied"] == 1
    assert env.engine.counters["cpu_resizes_applied"] == 0
    [warning] = [r for r in caplog.records if r.getMessage() == "in-place CPU resize refused"]
    fields = warning.__dict__["fields"]
    assert (fields["exclusive_cpus_held"], fields["exclusive_cpus_asked"]) == (1, 8)
    assert fields["container_id"] == pinned_id
    # kubelet's retry: refused again, said once.
    reply = await env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 8000))
    assert reply.status is Status.RESOURCE_EXHAUSTED
    assert env.engine.counters["cpu_resizes_not_applied"] == 1
    # A count that fits is applied.
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert env.cpus(pinned_id) == "1,4"
    assert_consistent(env)


async def test_an_in_place_resize_once_room_is_made_is_applied_at_kubelets_retry(
    env: Env,
) -> None:
    big = await env.kubelet.run_pod("big", "guaranteed")
    big_id = await env.kubelet.start_new(big, "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    reply = await env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert reply.status is Status.RESOURCE_EXHAUSTED
    await env.kubelet.stop(big_id)
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert len(CPUSet.parse(env.cpus(pinned_id))) == 2
    assert env.engine.counters["cpu_resizes_applied"] == 1
    assert_consistent(env)


async def test_an_in_place_resize_whose_checkpoint_cannot_be_written_changes_nothing(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared_id, _, pinned_id = await beside_a_shared_one(env, 1000)
    before = env.engine.state
    calls = len(env.fake.calls)

    async def refused(state: CPUState) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(env.engine.checkpoint, "save", refused)
    # As for any decision that cannot be persisted: INTERNAL under fail-closed.
    reply = await env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert reply.status is Status.INTERNAL
    assert "No space left on device" in reply.status_message
    assert env.engine.state is before
    assert len(env.fake.calls) == calls
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert env.engine.counters["internal_errors"] == 1
    assert env.engine.counters["cpu_resizes_applied"] == 0
    monkeypatch.undo()
    assert_consistent(env)


async def test_a_restart_after_an_in_place_resize_keeps_the_new_set(env: Env) -> None:
    shared_id, pod, pinned_id = await beside_a_shared_one(env, 1000)
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    await env.restart()
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].cpus == CPUSet.parse("1,4")
    assert env.cpus(pinned_id) == "1,4"
    assert env.cpus(shared_id) == "0,2-3,5-7"
    assert_consistent(env)


async def test_a_resize_back_after_a_restart_that_kept_a_resize_the_runtime_refused(
    env: Env,
) -> None:
    """The runtime refused kubelet's resize to 2 after cpushim had persisted it and moved the
    container there; after a restart the runtime's record still asks for 1, the checkpoint
    holds 2. kubelet's resize back to 1 (the one it was created asking for) must apply: the
    container holds 2."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    reply = await env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert reply.status is Status.UNAVAILABLE
    assert len(CPUSet.parse(env.cpus(pinned_id))) == 2  # moved all the same
    await env.restart()
    key = ContainerKey(pod.uid, "main")
    assert len(env.engine.state.assignments[key].cpus) == 2
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 1000))
    assert len(env.engine.state.assignments[key].cpus) == 1
    assert env.cpus(pinned_id) == str(env.engine.state.assignments[key].cpus)
    assert_consistent(env)


async def test_resizes_that_would_change_no_exclusive_cpus_are_not_reported(env: Env) -> None:
    kubelet = env.kubelet
    burstable_id = await kubelet.start_new(await kubelet.run_pod("web", "burstable"), "main", 500)
    await kubelet.ok("UpdateContainerResources", kubelet_resize(burstable_id, 2000))
    opted_out = await kubelet.run_pod(
        "batch", "guaranteed", annotations={"cpushim.io/exclusive": "false"}
    )
    opted_out_id = await kubelet.start_new(opted_out, "main", 1000)
    await kubelet.ok("UpdateContainerResources", kubelet_resize(opted_out_id, 2000))
    assert env.engine.counters["cpu_resizes_not_applied"] == 0
    assert env.engine.counters["cpu_resizes_applied"] == 0
    # The none policy pins nothing, so no count of CPUs is held or asked for.
    await env.restart(NonePolicy(TOPOLOGY))
    pod = await env.kubelet.run_pod("db", "guaranteed")
    shared_id = await env.kubelet.start_new(pod, "main", 1000)
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(shared_id, 2000))
    assert env.engine.counters["cpu_resizes_not_applied"] == 0
    assert env.engine.counters["cpu_resizes_applied"] == 0
    assert env.engine.state.assignments == {}


async def test_the_next_attempt_after_a_resize_gets_the_new_count(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    first = await env.kubelet.start_new(pod, "main", 1000)
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(first, 2000))
    # resizePolicy RestartContainer: kubelet stops it and creates the next attempt.
    await env.kubelet.stop(first)
    second = await env.kubelet.start_new(pod, "main", 2000, attempt=1)
    assert len(CPUSet.parse(env.cpus(second))) == 2
    assert_consistent(env)


async def test_a_memory_resize_of_a_container_that_lost_its_cpus_is_not_a_cpu_resize(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 2000)
    # A reserved set that leaves one CPU for exclusive use: the container loses its two.
    lost = await env.engine.change_policy(static_policy(reserved="0-6"))
    assert lost == [ContainerKey(pod.uid, "main")]
    # kubelet resizes its memory only: the CPU values are the ones it was created with.
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert env.engine.counters["cpu_resizes_not_applied"] == 0


async def test_a_memory_resize_of_a_container_created_under_none_is_not_a_cpu_resize(
    env: Env,
) -> None:
    await env.restart(NonePolicy(TOPOLOGY))
    pod = await env.kubelet.run_pod("db", "guaranteed")
    shared_id = await env.kubelet.start_new(pod, "main", 1000)
    assert await env.engine.change_policy(static_policy()) == []
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(shared_id, 1000))
    assert env.engine.counters["cpu_resizes_not_applied"] == 0
    # A real resize of it is one all the same, and pins it.
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(shared_id, 2000))
    assert env.engine.counters["cpu_resizes_applied"] == 1
    assert len(CPUSet.parse(env.cpus(shared_id))) == 2
    assert_consistent(env)


async def test_a_memory_resize_of_a_container_adopted_without_cpus_is_not_a_cpu_resize(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 2000)
    await env.restart(static_policy(reserved="0-6"))  # no room for its two CPUs
    assert env.engine.state.assignments == {}
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert env.engine.counters["cpu_resizes_not_applied"] == 0


async def test_a_resize_back_to_the_created_count_after_an_adoption_at_another_is_applied(
    env: Env,
) -> None:
    """A container that lost its CPUs is resized while it waits (not applied: noted), then
    adopted for the count that resize asked. Resized back to the count it was created with,
    it must get that count: it holds another one now."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 2000)
    assert await env.engine.change_policy(static_policy(reserved="0-6")) != []
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 3000))
    await env.engine.change_policy(static_policy())
    key = ContainerKey(pod.uid, "main")
    assert await adopt_sharing(env.engine) == [key]
    assert len(env.engine.state.assignments[key].cpus) == 3
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(pinned_id, 2000))
    assert len(env.engine.state.assignments[key].cpus) == 2
    assert len(CPUSet.parse(env.cpus(pinned_id))) == 2
    assert env.engine.counters["cpu_resizes_applied"] == 1
    assert_consistent(env)


async def test_an_update_whose_shares_and_quota_disagree_is_no_resize(env: Env) -> None:
    """A Guaranteed container's request is its limit: a call naming 2 CPUs in its shares and
    1 in its quota (a memory resize carrying a CPU limit read back from the runtime) is no
    resize to 1, nor to a fraction; it goes on with the set kept."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 2000)
    cpus = env.cpus(pinned_id)
    mixed = pb.UpdateContainerResourcesRequest(
        container_id=pinned_id,
        linux=pb.LinuxContainerResources(
            cpu_period=100_000,
            cpu_quota=milli_cpu_to_quota(1000),
            cpu_shares=milli_cpu_to_shares(2000),
            memory_limit_in_bytes=2 * GIB,
        ),
    )
    await env.kubelet.ok("UpdateContainerResources", mixed.SerializeToString())
    assert env.cpus(pinned_id) == cpus
    assert env.fake.containers[pinned_id].resources.memory_limit_in_bytes == 2 * GIB
    assert env.engine.counters["cpu_resizes_applied"] == 0
    assert env.engine.counters["cpu_resizes_not_applied"] == 0
    assert_consistent(env)


async def test_an_update_without_cpu_shares_is_not_from_kubelet_and_not_a_resize(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    quota_only = pb.UpdateContainerResourcesRequest(
        container_id=pinned_id,
        linux=pb.LinuxContainerResources(cpu_period=100_000, cpu_quota=200_000),
    )
    await env.kubelet.ok("UpdateContainerResources", quota_only.SerializeToString())
    assert env.engine.counters["cpu_resizes_not_applied"] == 0


# --- concurrency and cancellation ------------------------------------------------------------


async def test_concurrent_creates_never_share_a_cpu(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pods = [await kubelet.run_pod(f"p{i}", "guaranteed") for i in range(4)]
    replies = await asyncio.gather(
        *(kubelet.create(p, "main", 1000 + 1000 * (i % 2)) for i, p in enumerate(pods))
    )
    assert [r.status for r in replies] == [Status.OK] * 4
    held = [a.cpus for a in env.engine.state.assignments.values()]
    assert sum(len(c) for c in held) == 6
    assert len(CPUSet().union(*held)) == 6
    assert env.cpus(shared_id) == str(env.engine.state.shared)
    assert_consistent(env)


async def test_a_shared_create_racing_an_exclusive_one_ends_on_the_new_pool(env: Env) -> None:
    kubelet = env.kubelet
    web = await kubelet.run_pod("web", "besteffort")
    db = await kubelet.run_pod("db", "guaranteed")
    gate = env.fake.gate("CreateContainer")
    shared = asyncio.create_task(kubelet.create(web, "main"))
    await wait_until(lambda: len(env.fake.calls_of("CreateContainer")) == 1)
    env.fake.ungate("CreateContainer")
    # The shared create is held in the runtime with the old pool in its request...
    exclusive = asyncio.create_task(kubelet.create(db, "main", 1000))
    await asyncio.sleep(0)
    gate.set()
    shared_reply, exclusive_reply = await asyncio.gather(shared, exclusive)
    assert exclusive_reply.status is Status.OK
    shared_id = pb.CreateContainerResponse.FromString(shared_reply.messages[0]).container_id
    # ...and is corrected before its CreateContainer returns.
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert_consistent(env)


async def test_drain_waits_for_the_checkpoint_of_a_create_it_found_in_flight(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    gate = env.fake.gate("CreateContainer")
    call = asyncio.create_task(env.kubelet.create(pod, "main", 1000))
    await wait_until(lambda: len(env.fake.calls_of("CreateContainer")) == 1)
    # Shutdown begins while the runtime creates; the id's checkpoint write does not exist yet.
    draining = asyncio.create_task(env.engine.drain(5.0))
    await asyncio.sleep(0)
    gate.set()
    await draining
    [container_id] = env.fake.containers
    saved = env.engine.checkpoint.load()
    assert saved is not None
    assert saved.assignments[ContainerKey(pod.uid, "main")].container_id == container_id
    assert (await call).status is Status.OK


async def test_work_survives_kubelet_giving_up_on_the_call(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    gate = env.fake.gate("CreateContainer")
    call = asyncio.create_task(env.kubelet.create(pod, "main", 1000))
    await wait_until(lambda: len(env.fake.calls_of("CreateContainer")) == 1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    gate.set()
    await env.engine.drain(5.0)
    [container_id] = env.fake.containers
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].container_id == container_id
    assert env.saved() == {pod.uid: {"main": FIRST_SINGLE}}


async def wait_until(condition: Callable[[], bool], within: float = 5.0) -> None:
    """Until ``condition()`` holds (the fake runtime has no event for "a call arrived")."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


@pytest.mark.parametrize("learnt_from", ["RunPodSandbox", "CreateContainer"])
async def test_an_unknown_cpushim_annotation_is_warned_of_once_and_ignored(
    env: Env, caplog: pytest.LogCaptureFixture, learnt_from: str
) -> None:
    """A misspelt opt-out did nothing and said nothing. The pod is learnt from its
    RunPodSandbox, or from its first create when that reply could not be read."""
    annotations = {
        "cpushim.io/exclusiv": "false",  # misspelt: the containers are still pinned
        "cpushim.io/cfs-quota": "keep",
        "cpushim.io/exclusive.sidecar": "true",
        "example.com/team": "db",
    }
    with caplog.at_level(logging.WARNING):
        if learnt_from == "RunPodSandbox":
            pod = await env.kubelet.run_pod("db", "guaranteed", annotations=annotations)
        else:
            config = pb.PodSandboxConfig(
                metadata=pb.PodSandboxMetadata(name="db", uid="uid-db", namespace="default"),
                annotations=annotations,
                linux=pb.LinuxPodSandboxConfig(cgroup_parent="/kubepods/poduid-db"),
            )
            request = pb.RunPodSandboxRequest(config=config).SerializeToString()
            # Straight to the runtime: the engine sees no RunPodSandbox reply.
            reply = await env.kubelet.runtime.unary(
                UnaryCall(rq.RUN_POD_SANDBOX, (), request, 10.0)
            )
            sandbox_id = pb.RunPodSandboxResponse.FromString(reply.messages[0]).pod_sandbox_id
            assert sandbox_id not in env.engine.pods
            pod = Pod(sandbox_id, config, "guaranteed")
        await env.kubelet.start_new(pod, "main", 1000)
        await env.kubelet.start_new(pod, "sidecar", 1000)
    told = [
        record.__dict__["fields"]
        for record in caplog.records
        if record.getMessage().startswith("pod annotations cpushim does not know")
    ]
    assert told == [
        {"pod": "default/db", "pod_uid": pod.uid, "annotations": ["cpushim.io/exclusiv"]}
    ]
    assert len(env.engine.state.assignments) == 2


async def test_a_pod_is_remembered_from_its_run_pod_sandbox_through_the_relay(env: Env) -> None:
    # RunPodSandbox is spliced and followed: the engine reads the sandbox id from the reply
    # the relay copied on its way to kubelet.
    async with through_relay(env) as kubelet:
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="web", uid="uid-1", namespace="shop"),
            linux=pb.LinuxPodSandboxConfig(cgroup_parent="/kubepods/poduid-1"),
        )
        request = pb.RunPodSandboxRequest(config=config).SerializeToString()
        reply = await kubelet.unary(UnaryCall(rq.RUN_POD_SANDBOX, (), request, 10.0))
    assert reply.status is Status.OK
    sandbox_id = pb.RunPodSandboxResponse.FromString(reply.messages[0]).pod_sandbox_id
    pod = env.engine.pods[sandbox_id]
    assert (pod.uid, pod.label, pod.qos) == ("uid-1", "shop/web", QOSClass.GUARANTEED)
    assert env.engine.counters["internal_errors"] == 0


class ObservedLock(asyncio.Lock):
    """The engine's lock, counting who waits for it: a test can tell when a call has made
    its choice and queued, without sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0

    async def acquire(self) -> Literal[True]:
        self.waiting += 1
        try:
            return await super().acquire()
        finally:
            self.waiting -= 1


async def test_a_create_queued_behind_a_reload_to_the_none_policy_shares(env: Env) -> None:
    kubelet = env.kubelet
    lock = env.engine.lock = ObservedLock()
    pod = await kubelet.run_pod("db", "guaranteed")
    async with lock:
        # The create sees the static policy, chooses exclusive CPUs and queues for the lock
        # behind a reload to the none policy.
        reload = asyncio.create_task(env.engine.change_policy(NonePolicy(TOPOLOGY)))
        await until(lambda: lock.waiting == 1, "the reload queued")
        create = asyncio.create_task(kubelet.create(pod, "main", 1000))
        await until(lambda: lock.waiting == 2, "the create queued")
    await reload
    reply = await create
    assert reply.status is Status.OK, reply.status_message
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    assert env.cpus(container_id) == "0-7"
    assert env.engine.state.assignments == {}
    assert env.engine.counters["pinning_errors"] == 0


async def test_a_shared_container_whose_move_was_refused_is_moved_on_a_retry(
    tmp_path: Path,
) -> None:
    # Created, not started: it moves through the runtime, which refuses once. The watches
    # compare its cgroup with what was applied, so only a retry takes it off the CPU just
    # handed out exclusively.
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path / "state", options=EngineOptions(retry_delay=0.01))
        try:
            kubelet = env.kubelet
            reply = await kubelet.create(await kubelet.run_pod("web", "besteffort"), "main")
            assert reply.status is Status.OK
            shared_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
            fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE, "busy")
            pinned_id = await kubelet.start_new(
                await kubelet.run_pod("db", "guaranteed"), "main", 1000
            )
            # No later decision comes: only a retry moves it.
            await until(lambda: env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE, "the retry")
            assert updates_to(fake, shared_id) == [SHARED_AFTER_FIRST_SINGLE] * 2  # refused, then
            assert env.cpus(pinned_id) == FIRST_SINGLE
            assert env.engine.counters["cpuset_update_errors"] == 1
            assert_consistent(env)
        finally:
            await env.engine.drain(5.0)
            env.channel.close()


# --- failures inside cpushim -----------------------------------------------------------------


async def test_internal_error_fail_closed_refuses_and_creates_nothing(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")

    async def broken_save(state: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(env.engine.checkpoint, "save", broken_save)
    reply = await env.kubelet.create(pod, "main", 1000)
    assert reply.status is Status.INTERNAL
    assert "No space left on device" in reply.status_message
    assert env.fake.calls_of("CreateContainer") == []
    assert env.engine.state.assignments == {}


async def test_internal_error_fail_open_forwards_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, failure_policy="fail-open")
        pod = await env.kubelet.run_pod("db", "guaranteed")

        async def broken_save(state: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(env.engine.checkpoint, "save", broken_save)
        container_id = await env.kubelet.start_new(pod, "main", 1000)
        assert env.cpus(container_id) == ""  # as kubelet asked: no cpuset
        assert env.engine.counters["fail_open_forwards"] == 1
        env.channel.close()


async def test_work_after_a_call_the_runtime_did_never_repeats_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, failure_policy="fail-open")
        pod = await env.kubelet.run_pod("web", "besteffort")
        reply = await env.kubelet.create(pod, "main")
        container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id

        async def broken(request: bytes, response: bytes | None) -> None:
            raise RuntimeError("a bug")

        def broken_now(request: bytes, response: bytes | None) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setitem(env.engine._after, rq.START_CONTAINER, broken)
        monkeypatch.setitem(env.engine._now, rq.START_CONTAINER, broken_now)
        request = pb.StartContainerRequest(container_id=container_id).SerializeToString()
        started = await env.kubelet.call("StartContainer", request)
        # The runtime started it once; kubelet hears so; the failure is counted.
        assert started.status is Status.OK
        assert len(fake.calls_of("StartContainer")) == 1
        assert env.engine.counters["internal_errors"] == 1
        assert env.engine.counters["fail_open_forwards"] == 0
        env.channel.close()


async def test_a_create_the_runtime_did_is_never_forwarded_again_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, failure_policy="fail-open")
        pod = await env.kubelet.run_pod("db", "guaranteed")

        def broken(state: object) -> None:
            raise RuntimeError("a bug after the forward")

        monkeypatch.setattr(env.engine, "_record_soon", broken)
        reply = await env.kubelet.create(pod, "main", 1000)
        # The runtime created it once, and kubelet hears what the runtime said.
        assert reply.status is Status.OK
        assert len(fake.calls_of("CreateContainer")) == 1
        assert env.engine.counters["internal_errors"] == 1
        assert env.engine.counters["fail_open_forwards"] == 0
        env.channel.close()


async def test_a_defect_after_kubelets_update_is_forwarded_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubelet's update runs in a task of its own that is handed the container's lock: a
    defect there is told by the call's failure handling, not once more by the task's."""
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path)
        pod = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(pod, "main", 1000)

        def broken(*args: object) -> None:
            raise RuntimeError("a bug after the forward")

        monkeypatch.setattr(env.engine, "_updated", broken)
        reply = await env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 1000))
        # The runtime took it once; kubelet hears what the runtime said.
        assert reply.status is Status.OK
        assert len(fake.calls_of("UpdateContainerResources")) == 1
        assert env.engine.counters["internal_errors"] == 1
        assert not env.engine.containers[pinned_id].write_lock.locked()
        env.channel.close()


async def test_calls_with_nothing_to_wait_for_are_followed_at_once(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    stop = pb.StopContainerRequest(container_id=container_id).SerializeToString()
    remove = pb.RemoveContainerRequest(container_id=container_id).SerializeToString()
    tracked = env.engine.containers[container_id]
    # Its CPUs still to release (a checkpoint write): not at once, and nothing done yet.
    assert env.engine.followed_now(rq.STOP_CONTAINER, stop, Status.OK, b"") is Pending.LATER
    assert env.engine.state.holding(container_id) is not None
    assert tracked.phase is Phase.RUNNING
    assert await env.engine.followed(rq.STOP_CONTAINER, stop, Status.OK, b"") is None
    assert env.engine.state.holding(container_id) is None
    # Released already (as when its process was seen ending): at once.
    assert env.engine.followed_now(rq.STOP_CONTAINER, stop, Status.OK, b"") is None
    assert env.engine.containers[container_id].phase is Phase.EXITED
    # While a decision holds the lock, nothing is done at once.
    async with env.engine.lock:
        assert env.engine.followed_now(rq.REMOVE_CONTAINER, remove, Status.OK, b"") is Pending.LATER
    assert container_id in env.engine.containers
    assert env.engine.followed_now(rq.REMOVE_CONTAINER, remove, Status.OK, b"") is None
    assert container_id not in env.engine.containers
    # A call the runtime refused needs nothing; an unreadable one goes the long way (counted).
    assert env.engine.followed_now(rq.STOP_CONTAINER, stop, Status.NOT_FOUND, None) is None
    assert env.engine.followed_now(rq.STOP_CONTAINER, None, Status.OK, None) is Pending.LATER


async def test_a_container_removed_behind_our_back_is_forgotten(env: Env) -> None:
    kubelet = env.kubelet
    gone_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    del env.fake.containers[gone_id]
    pod = await kubelet.run_pod("db", "guaranteed")
    pinned_id = await kubelet.start_new(pod, "main", 1000)
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert gone_id not in env.engine.containers


async def test_a_pinned_container_found_gone_by_a_move_gives_its_cpus_back(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")
    gone_id = await kubelet.start_new(pod, "main", 1000)
    del env.fake.containers[gone_id]  # removed straight on the runtime
    # A reload that reserves its CPU moves it, and the runtime no longer knows it.
    lost = await env.engine.change_policy(static_policy(reserved=f"0,{FIRST_SINGLE}"))
    assert lost == []
    assert gone_id not in env.engine.containers
    assert env.engine.state.assignments == {}
    assert env.saved() == {}
    assert env.cpus(shared_id) == str(ALL)
    assert_consistent(env)


async def test_a_pinned_container_an_update_finds_gone_gives_its_cpus_back(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")
    gone_id = await kubelet.start_new(pod, "main", 1000)
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    del env.fake.containers[gone_id]  # removed straight on the runtime
    reply = await kubelet.call("UpdateContainerResources", kubelet_resize(gone_id, 1000))
    assert reply.status is Status.NOT_FOUND  # the runtime's answer, passed on
    assert gone_id not in env.engine.containers
    assert env.engine.state.assignments == {}
    assert env.saved() == {}
    assert env.cpus(shared_id) == str(ALL)
    # Remembered as its CPUs, as any release: a next attempt gets them back.
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.released == {key: CPUSet.parse(FIRST_SINGLE)}
    assert_consistent(env)


# --- restarts --------------------------------------------------------------------------------


async def test_restart_keeps_assignments_and_releases_the_vanished(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    kept = await kubelet.run_pod("kept", "guaranteed")
    kept_id = await kubelet.start_new(kept, "main", 1000)
    vanished = await kubelet.run_pod("vanished", "guaranteed")
    vanished_id = await kubelet.start_new(vanished, "main", 2000)
    assert len(CPUSet.parse(env.cpus(shared_id))) == 5
    del env.fake.containers[vanished_id]  # went while cpushim was down

    await env.restart()
    assert env.saved() == {kept.uid: {"main": FIRST_SINGLE}}
    assert env.engine.state.assignments[ContainerKey(kept.uid, "main")].container_id == kept_id
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert_consistent(env)


async def test_restart_adopts_containers_created_while_down(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    # Made straight on the runtime, as if cpushim were down: no cpuset.
    pod = await kubelet.run_pod("db", "guaranteed")
    request = kubelet.create_request(pod, "main", 2000)
    adopted_id = env.fake.add_container(pod.sandbox_id, request.config)
    besteffort = await kubelet.run_pod("batch", "besteffort")
    other_id = env.fake.add_container(
        besteffort.sandbox_id, kubelet.create_request(besteffort, "main").config
    )

    await env.restart()
    assert env.saved() == {pod.uid: {"main": "1,5"}}
    assert env.cpus(adopted_id) == "1,5"
    assert env.fake.containers[adopted_id].resources.cpu_quota == -1
    assert env.cpus(other_id) == env.cpus(shared_id) == "0,2-4,6-7"
    assert_consistent(env)


async def test_restart_keeps_an_adopted_containers_cpuset_only_when_the_policy_accepts_it(
    tmp_path: Path,
) -> None:
    # Made straight on the runtime while cpushim was down, each already on CPUs of its own;
    # the options came on with this start.
    policy = StaticPolicy.create(
        TOPOLOGY,
        reserved=CPUSet.parse("0,4"),
        options=StaticPolicyOptions(full_pcpus_only=True),
    )
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path)
        kubelet = env.kubelet
        made: dict[str, str] = {}
        for name, cpus in (("whole", "2,6"), ("threads", "1,3")):
            pod = await kubelet.run_pod(name, "guaranteed")
            request = kubelet.create_request(pod, "main", 2000)
            request.config.linux.resources.cpuset_cpus = cpus
            made[name] = env.fake.add_container(pod.sandbox_id, request.config)

        await env.restart(policy)
        # A whole core is kept; two lone threads of two cores are not what full-pcpus-only
        # hands out, so that container gets the one whole core left.
        assert env.cpus(made["whole"]) == "2,6"
        assert env.cpus(made["threads"]) == "1,5"
        assert_consistent(env)
        env.channel.close()


@pytest.mark.parametrize(
    ("annotation", "kept"), [(None, False), ("prefer", True), ("require", True)]
)
async def test_restart_keeps_an_adopted_containers_isolated_cpus_only_when_it_asks(
    tmp_path: Path, annotation: str | None, kept: bool
) -> None:
    topology = expected_topology(
        MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2, isolated=frozenset({3, 7}))
    )
    policy = StaticPolicy.create(topology, reserved=CPUSet.parse("0"))
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, policy)
        annotations = {"cpushim.io/isolated-cpus": annotation} if annotation else {}
        pod = await env.kubelet.run_pod("rt", "guaranteed", annotations)
        request = env.kubelet.create_request(pod, "main", 1000)
        request.config.linux.resources.cpuset_cpus = "3"
        container_id = env.fake.add_container(pod.sandbox_id, request.config)

        await env.restart()
        cpus = CPUSet.parse(env.cpus(container_id))
        if kept:
            assert cpus == CPUSet.parse("3")
        else:
            assert len(cpus) == 1
            assert not cpus & topology.isolated
        assert env.saved() == {pod.uid: {"main": str(cpus)}}
        env.channel.close()


async def test_a_short_lived_containers_id_costs_no_checkpoint_write_of_its_own(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    before = env.engine.checkpoint.writes
    reply = await env.kubelet.create(pod, "main", 1000)
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    # The decision is on disk before the reply; the id waits for the record delay.
    assert env.engine.checkpoint.writes == before + 1
    key = ContainerKey(pod.uid, "main")
    assert env.engine.checkpoint.saved is not None
    assert env.engine.checkpoint.saved.assignments[key].container_id == ""
    # Stopped within the delay: the release's write is the only other one.
    await env.kubelet.stop(container_id)
    await env.engine.checkpoint_written()
    assert env.engine.checkpoint.writes == before + 2
    assert env.saved() == {}


async def test_a_new_containers_id_reaches_the_checkpoint_after_the_record_delay(
    tmp_path: Path,
) -> None:
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, options=EngineOptions(record_delay=0.05))
        pod = await env.kubelet.run_pod("db", "guaranteed")
        reply = await env.kubelet.create(pod, "main", 1000)
        container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
        key = ContainerKey(pod.uid, "main")

        def recorded() -> bool:
            saved = env.engine.checkpoint.saved
            return saved is not None and saved.assignments[key].container_id == container_id

        await wait_until(recorded)
        env.channel.close()


def awaiting(task: asyncio.Task[None]) -> str:
    """The name of what ``task``'s coroutine waits on now; "" while it is not suspended."""
    awaited = task.get_coro().cr_await  # type: ignore[union-attr]
    return str(getattr(awaited, "__qualname__", ""))


def engine_alone(state_dir: Path, record_delay: float) -> tuple[Engine, CPUState, CPUState]:
    """An engine whose runtime is never called, and two states, the second after the first."""
    policy = static_policy()
    engine = Engine(
        policy,
        CheckpointFile(state_dir),
        RuntimeChannel(f"unix://{state_dir}/nothing.sock"),
        EngineOptions(record_delay=record_delay),
    )
    first = CPUState.empty(policy).assign(
        ContainerKey("uid-1", "app"), Assignment(CPUSet.parse("1"), "ctr-1", "sb-1"), policy
    )
    second = first.assign(
        ContainerKey("uid-2", "db"), Assignment(CPUSet.parse("2"), "ctr-2", "sb-2"), policy
    )
    return engine, first, second


@pytest.mark.parametrize(
    ("cut", "record_delay", "waits_on"),
    [
        ("before it runs", 3600.0, None),
        ("in the record delay", 3600.0, "wait_for"),
        ("waiting for the lock", 0.0, "__aenter__"),
    ],
)
async def test_a_cancelled_background_write_leaves_later_changes_a_write_of_their_own(
    tmp_path: Path, cut: str, record_delay: float, waits_on: str | None
) -> None:
    """A background checkpoint write cancelled before it is under way (at any of its waits)
    no longer stands for one scheduled: the next change gets a write of its own, or it would
    stay in memory only, and a restart would load the state from before it."""
    engine, first, second = engine_alone(tmp_path, record_delay)
    async with engine.lock:  # the write's turn comes only once the test lets it
        engine._record_soon(first)
        persisting = engine._persisting
        assert persisting is not None
        if waits_on is not None:
            await until(lambda: waits_on in awaiting(persisting), f"the write at {cut}")
        persisting.cancel()
        await asyncio.wait({persisting})
    engine._record_soon(second)
    await asyncio.wait_for(engine.checkpoint_written(), 10)
    assert engine.checkpoint.load() == second


async def test_a_background_write_cancelled_while_it_writes_leaves_later_changes_theirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last of its waits: the write under way (in its worker thread) when cancelled."""
    engine, first, second = engine_alone(tmp_path, 0.0)
    writing, go_on = threading.Event(), threading.Event()
    write = engine.checkpoint._write

    def held_write(data: bytes) -> bytes:
        writing.set()
        assert go_on.wait(10)
        return write(data)

    monkeypatch.setattr(engine.checkpoint, "_write", held_write)
    engine._record_soon(first)
    persisting = engine._persisting
    assert persisting is not None
    await until(writing.is_set, "the write under way")
    persisting.cancel()
    go_on.set()
    await asyncio.wait({persisting})
    assert engine.checkpoint.load() == first
    engine._record_soon(second)
    await asyncio.wait_for(engine.checkpoint_written(), 10)
    assert engine.checkpoint.load() == second


async def test_restart_after_a_crash_mid_create_finds_the_container(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    key = ContainerKey(pod.uid, "main")
    # As if cpushim died after persisting the decision, before recording the id.
    env.engine.checkpoint.save_sync(env.engine.state.update(key, container_id=""))
    await env.restart()
    assert env.engine.state.assignments[key].container_id == container_id


async def test_a_corrupt_checkpoint_stops_start_up_with_a_way_out(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pod, "main", 1000)
    path = env.state_dir / "state.json"
    path.write_bytes(path.read_bytes().replace(b'"cpus": "4"', b'"cpus": "2"'))
    with pytest.raises(StartupError, match="checksum") as caught:
        await env.restart()
    assert "--recover-from-runtime" in str(caught.value)
    assert str(path) in str(caught.value)

    await env.restart(recover=True)
    assert env.saved() == {pod.uid: {"main": FIRST_SINGLE}}
    assert len(list(env.state_dir.glob("state.json.replaced-*"))) == 1


@pytest.mark.parametrize("error", [errno.EACCES, errno.EPERM])
async def test_a_checkpoint_cpushim_may_not_read_stops_start_up_naming_the_permission(
    env: Env, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """A checkpoint cpushim is not allowed to read (its mode, its owner, a confinement of the
    unit) says nothing of the state in it: recovering from the runtime would set it aside and
    still not let cpushim write the new one, so start-up names the file and the permission
    problem and does not offer that."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pod, "main", 1000)
    path = env.state_dir / "state.json"

    def refused(file: Path) -> bytes:
        raise PermissionError(error, os.strerror(error), str(file))

    monkeypatch.setattr(checkpoint_module, "read_regular_file", refused)
    with pytest.raises(StartupError) as caught:
        await env.restart()
    message = str(caught.value)
    assert f"{path}: {os.strerror(error)}" in message
    assert "permission" in message
    assert "--recover-from-runtime" not in message
    monkeypatch.undo()
    # Left as it was: once cpushim may read it, the state in it is what start-up takes.
    await env.restart()
    assert env.saved() == {pod.uid: {"main": FIRST_SINGLE}}
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].cpus == CPUSet.parse(
        FIRST_SINGLE
    )


async def test_recoveries_within_one_second_keep_every_old_checkpoint(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    await env.kubelet.start_new(await env.kubelet.run_pod("db", "guaranteed"), "main", 1000)
    monkeypatch.setattr("shim.engine.resync.time.strftime", lambda _format: "20261125T010203")
    kept = []
    for _ in range(3):
        kept.append((env.state_dir / "state.json").read_bytes())
        await env.restart(recover=True)
    found = sorted(env.state_dir.glob("state.json.replaced-*"))
    assert [p.name for p in found] == [
        "state.json.replaced-20261125T010203",
        "state.json.replaced-20261125T010203.1",
        "state.json.replaced-20261125T010203.2",
    ]
    assert [p.read_bytes() for p in found] == kept


async def test_a_checkpoint_written_for_other_cpus_is_re_planned_at_start(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A CPU taken offline while cpushim was down (a reboot with another isolcpus, one with
    a CPU back that went offline while cpushim ran and followed it): the containers keep
    what they can, the others get CPUs there are now, without a recovery by hand."""
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    kept_id = await kubelet.start_new(await kubelet.run_pod("kept", "guaranteed"), "main", 1000)
    moved_id = await kubelet.start_new(await kubelet.run_pod("db", "guaranteed"), "main", 1000)
    kept, lost = env.cpus(kept_id), CPUSet.parse(env.cpus(moved_id))
    fewer = expected_topology(
        MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2, offline=frozenset(lost))
    )
    with caplog.at_level(logging.WARNING):
        await env.restart(StaticPolicy.create(fewer, reserved=CPUSet.parse("0")))
    assert "the CPUs changed since the checkpoint was written" in caplog.text
    assert env.cpus(kept_id) == kept
    moved = CPUSet.parse(env.cpus(moved_id))
    assert len(moved) == 1
    assert not moved & (lost | CPUSet.parse("0") | CPUSet.parse(kept))
    assert env.cpus(shared_id) == str(env.engine.state.shared)
    assert not env.engine.state.shared & lost
    saved = env.engine.checkpoint.load()
    assert saved is not None
    assert not topology_changed(saved, fewer)
    assert_consistent(env)


async def test_a_re_plan_for_other_cpus_keeps_no_set_the_container_would_not_be_given(
    tmp_path: Path,
) -> None:
    """A reboot with another isolcpus (or SMT turned on): a kept assignment must still be
    one the policy would hand its container. One that avoids isolated CPUs does not keep
    a CPU isolated since, nor does one under full-pcpus-only keep a lone thread of a core
    whose sibling came online."""
    options = StaticPolicyOptions(full_pcpus_only=True)
    without_smt = expected_topology(MachineSpec(sockets=1, cores_per_die=4, threads_per_core=1))
    async with FakeRuntime() as fake:
        env = await make_env(
            fake, tmp_path, StaticPolicy.create(without_smt, reserved=CPUSet.parse("0"))
        )
        plain_id = await env.kubelet.start_new(
            await env.kubelet.run_pod("plain", "guaranteed"), "main", 1000
        )
        plain = CPUSet.parse(env.cpus(plain_id))
        # Now its CPU is isolated and every core has two threads (siblings n and n + 4).
        isolated_now = expected_topology(
            MachineSpec(sockets=1, cores_per_die=4, threads_per_core=2, isolated=frozenset(plain))
        )
        await env.restart(StaticPolicy.create(isolated_now, reserved=CPUSet.parse("0,4")))
        moved = CPUSet.parse(env.cpus(plain_id))
        assert len(moved) == 1
        assert not moved & isolated_now.isolated
        assert_consistent(env)

        await env.restart(StaticPolicy.create(without_smt, reserved=CPUSet.parse("0")))
        whole_id = await env.kubelet.start_new(
            await env.kubelet.run_pod("whole", "guaranteed"), "main", 2000
        )
        lone = CPUSet.parse(env.cpus(whole_id))
        with_smt = expected_topology(MachineSpec(sockets=1, cores_per_die=4, threads_per_core=2))
        await env.restart(
            StaticPolicy.create(with_smt, reserved=CPUSet.parse("0,4"), options=options)
        )
        cpus = CPUSet.parse(env.cpus(whole_id))
        assert cpus != lone
        assert with_smt.whole_cores_in(cpus) == cpus
        assert_consistent(env)
        env.channel.close()


async def test_a_restart_that_turns_full_pcpus_only_on_moves_a_container_off_half_cores(
    env: Env,
) -> None:
    """The same CPUs, an option turned on since: a kept set must meet it as after a topology
    change, so that a restart and a reload under the same config end alike."""
    pod, container_id = await pinned_on_half_cores(env)
    options = StaticPolicyOptions(full_pcpus_only=True)
    await env.restart(StaticPolicy.create(TOPOLOGY, reserved=CPUSet.parse("0"), options=options))
    moved = CPUSet.parse(env.cpus(container_id))
    assert len(moved) == 2
    assert TOPOLOGY.whole_cores_in(moved) == moved
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].cpus == moved
    assert_consistent(env)


async def test_a_checkpoint_in_itself_inconsistent_is_refused_on_other_cpus_too(
    env: Env,
) -> None:
    pinned_id = await env.kubelet.start_new(
        await env.kubelet.run_pod("db", "guaranteed"), "main", 1000
    )
    state = env.engine.state
    (key,) = state.assignments
    # A second container on the same CPUs: what no topology change explains.
    twin = ContainerKey("another-pod", "main")
    broken = dataclasses.replace(
        state,
        assignments=MappingProxyType(
            {
                **state.assignments,
                twin: dataclasses.replace(state.assignments[key], container_id="x"),
            }
        ),
    )
    env.engine.checkpoint.save_sync(broken)
    other = expected_topology(MachineSpec(sockets=1, cores_per_die=8, threads_per_core=1))
    with pytest.raises(StartupError, match="also holds"):
        await env.restart(StaticPolicy.create(other, reserved=CPUSet.parse("0")))
    assert env.cpus(pinned_id) == FIRST_SINGLE


async def test_a_new_reserved_set_is_replanned_without_a_drain(env: Env) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")
    pinned_id = await kubelet.start_new(pod, "main", 1000)
    assert env.cpus(pinned_id) == FIRST_SINGLE
    await env.restart(static_policy(reserved="0,4"))
    assert env.cpus(pinned_id) not in ("0", "4")
    assert len(CPUSet.parse(env.cpus(pinned_id))) == 1
    assert env.engine.state.reserved == CPUSet.parse("0,4")
    assert env.cpus(shared_id) == str(env.engine.state.shared)
    assert_consistent(env)


async def test_switching_to_the_none_policy_unpins_everything(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    engine = await env.restart(NonePolicy(TOPOLOGY))
    assert env.saved() == {}
    assert env.cpus(pinned_id) == "0-7"
    # A planned change: nothing was refused, so the operator's alert stays quiet.
    assert engine.counters["adoptions_refused"] == 0
    new_id = await env.kubelet.start_new(await env.kubelet.run_pod("g", "guaranteed"), "main", 1000)
    assert env.cpus(new_id) == "0-7"


async def test_a_next_attempt_keeps_its_cpus_across_an_option_that_only_steers_choices(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    first = await env.kubelet.start_new(pod, "main", 2000)
    before = env.cpus(first)
    spread = StaticPolicy.create(
        TOPOLOGY,
        reserved=CPUSet.parse("0"),
        options=StaticPolicyOptions(distribute_cpus_across_cores=True),
    )
    await env.restart(spread)
    await env.kubelet.stop(first)
    # The new option would spread a new pair over two cores; the pair this container ran
    # on breaks no rule, so its next attempt gets it back.
    assert spread.allocate(env.engine.state.exclusive(), 2) != CPUSet.parse(before)
    second = await env.kubelet.start_new(pod, "main", 2000, attempt=1)
    assert env.cpus(second) == before
    assert_consistent(env)


async def pinned_without_quota(env: Env) -> str:
    """A pinned 1-CPU container whose kubelet enforces no CPU limit (``cpuCFSQuota: false``:
    no quota, no period); its id."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    request = env.kubelet.create_request(pod, "main", 1000)
    request.config.linux.resources.cpu_quota = 0
    request.config.linux.resources.cpu_period = 0
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK, reply.status_message
    return pb.CreateContainerResponse.FromString(reply.messages[0]).container_id


async def test_a_container_that_loses_its_cpus_gets_kubelets_quota_and_every_node_back(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    pinned = env.fake.containers[pinned_id].resources
    assert (pinned.cpu_quota, pinned.cpuset_mems) == (-1, "0")  # CPU 4 is on node 0
    # The new engine knows the container only from the runtime: quota -1 is cpushim's mark.
    await env.restart(NonePolicy(TOPOLOGY))
    restored = env.fake.containers[pinned_id].resources
    assert restored.cpuset_cpus == "0-7"
    assert restored.cpuset_mems == "0-1"
    assert restored.cpu_quota == milli_cpu_to_quota(1000)
    # From now on it is a shared container like any other.
    assert not env.engine.containers[pinned_id].exclusive
    assert env.engine._desired(env.engine.containers[pinned_id]) == (ALL, "", None)


async def test_a_lost_container_that_kept_its_quota_gets_every_node_back(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed", {"cpushim.io/cfs-quota": "keep"})
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    assert env.fake.containers[pinned_id].resources.cpu_quota == milli_cpu_to_quota(1000)
    assert env.fake.containers[pinned_id].resources.cpuset_mems == "0"
    # Narrowed memory nodes are the only mark it carries.
    await env.restart(NonePolicy(TOPOLOGY))
    restored = env.fake.containers[pinned_id].resources
    assert (restored.cpuset_cpus, restored.cpuset_mems) == ("0-7", "0-1")
    assert restored.cpu_quota == milli_cpu_to_quota(1000)


async def test_a_restored_container_is_not_restored_again_at_the_next_restart(
    env: Env,
) -> None:
    pinned_id = await pinned_without_quota(env)  # so -1 stays after the restore
    await env.restart(NonePolicy(TOPOLOGY))
    assert len(updates_to(env.fake, pinned_id)) == 1
    await env.restart(NonePolicy(TOPOLOGY))
    assert len(updates_to(env.fake, pinned_id)) == 1
    assert not env.engine.containers[pinned_id].exclusive


async def lost_with_its_restore_refused(env: Env) -> str:
    """A pinned 1-CPU container that lost its CPU to a restart under the none policy, whose
    restore at that start the runtime refused: still marked, and at quota -1. Its id."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    await env.restart(NonePolicy(TOPOLOGY))
    assert env.fake.containers[pinned_id].resources.cpu_quota == -1
    assert env.engine.containers[pinned_id].exclusive
    return pinned_id


async def test_kubelets_update_of_a_lost_container_restores_it_with_kubelets_quota(
    env: Env,
) -> None:
    # kubelet's next update carries the restore, with kubelet's own quota (a resize's).
    pinned_id = await lost_with_its_restore_refused(env)
    request = pb.UpdateContainerResourcesRequest(
        container_id=pinned_id,
        linux=pb.LinuxContainerResources(
            cpu_period=100_000, cpu_quota=200_000, cpu_shares=2048, cpuset_cpus="3"
        ),
    )
    await env.kubelet.ok("UpdateContainerResources", request.SerializeToString())
    restored = env.fake.containers[pinned_id].resources
    assert (restored.cpuset_cpus, restored.cpuset_mems) == ("0-7", "0-1")
    assert restored.cpu_quota == 200_000
    assert not env.engine.containers[pinned_id].exclusive
    assert env.engine.containers[pinned_id].kubelet_quota == 200_000


async def test_a_lost_container_whose_kubelet_set_no_quota_keeps_none(env: Env) -> None:
    pinned_id = await pinned_without_quota(env)
    assert env.fake.containers[pinned_id].resources.cpu_quota == -1
    await env.restart(NonePolicy(TOPOLOGY))
    restored = env.fake.containers[pinned_id].resources
    assert (restored.cpuset_cpus, restored.cpuset_mems) == ("0-7", "0-1")
    assert restored.cpu_quota == -1  # no limit, as kubelet asked


async def test_a_checkpoint_that_fails_after_the_runtime_acted_keeps_memory_true(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")
    real_save = env.engine.checkpoint.save
    saves = 0

    async def save_once_then_fail(state: CPUState) -> None:
        nonlocal saves
        saves += 1
        if saves > 1:
            raise OSError(5, "Input/output error")
        await real_save(state)

    monkeypatch.setattr(env.engine.checkpoint, "save", save_once_then_fail)
    # Its retry (below) would count failures of its own.
    env.engine.options = dataclasses.replace(env.engine.options, retry_delay=3600.0)
    # The decision is persisted; recording the container id after the create is not.
    pinned_id = await kubelet.start_new(pod, "main", 1000)
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].container_id == pinned_id
    assert env.engine.counters["checkpoint_errors"] == 1
    # The stop happened in the runtime: the CPU is released and shared, disk or not.
    await kubelet.stop(pinned_id)
    assert env.engine.state.assignments == {}
    assert env.cpus(shared_id) == "0-7"
    assert env.engine.counters["checkpoint_errors"] == 2
    # The stale checkpoint is squared with the runtime at the next start.
    monkeypatch.undo()
    await env.restart()
    assert env.saved() == {}


def failing_saves(env: Env, monkeypatch: pytest.MonkeyPatch, after: int) -> list[int]:
    """Make the checkpoint's saves after the first ``after`` fail until the returned list
    is cleared (it holds a 1 while they fail)."""
    checkpoint = env.engine.checkpoint
    real_save = checkpoint.save
    saves = 0
    failing = [1]

    async def save(state: CPUState) -> None:
        nonlocal saves
        saves += 1
        if saves > after and failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        await real_save(state)

    monkeypatch.setattr(checkpoint, "save", save)
    return failing


async def test_a_checkpoint_write_that_failed_after_the_runtime_acted_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path / "state", options=EngineOptions(retry_delay=0.01))
        try:
            kubelet = env.kubelet
            pod = await kubelet.run_pod("db", "guaranteed")
            failing = failing_saves(env, monkeypatch, after=1)
            # The decision is persisted; the container id learnt from the create is not, and
            # no later decision comes to carry it.
            pinned_id = await kubelet.start_new(pod, "main", 1000)
            await until(lambda: env.engine.counters["checkpoint_errors"] >= 2, "a failed retry")
            assert env.engine.checkpoint.saved != env.engine.state
            failing.clear()
            await until(lambda: env.engine.checkpoint.saved == env.engine.state, "the retry")
            body = orjson.loads((env.state_dir / "state.json").read_bytes())["body"]
            assert body["assignments"][pod.uid]["main"]["container_id"] == pinned_id
            assert env.engine.checkpoint.on_disk() == env.engine.checkpoint.last_written
            await until(lambda: not env.engine._save_retry.running, "the retry done")
        finally:
            env.channel.close()


async def pinned_with_a_failed_record(env: Env, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A pinned container started whose record (the write after its decision's) failed, so
    a checkpoint retry runs, its first try an hour away; saves fail until the returned list
    is cleared (:func:`failing_saves`)."""
    env.engine.options = dataclasses.replace(env.engine.options, retry_delay=3600.0)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    failing = failing_saves(env, monkeypatch, after=1)
    await env.kubelet.start_new(pod, "main", 1000)
    return failing


async def test_a_drain_writes_a_checkpoint_its_retry_had_not_made_yet(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = await pinned_with_a_failed_record(env, monkeypatch)
    assert env.engine.checkpoint.saved != env.engine.state
    assert env.engine._save_retry.running
    failing.clear()
    await env.engine.drain(5.0)
    assert env.engine.checkpoint.saved == env.engine.state
    assert not env.engine._save_retry.running


async def test_a_checkpoint_write_that_fails_during_a_drain_is_made_again_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No retry starts once a drain has: its last step writes the state."""
    options = EngineOptions(record_delay=3600.0, retry_delay=3600.0)
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path / "state", options=options)
        try:
            pod = await env.kubelet.run_pod("db", "guaranteed")
            checkpoint = env.engine.checkpoint
            real_save = checkpoint.save
            saves = 0

            async def fail_the_second(state: CPUState) -> None:
                nonlocal saves
                saves += 1
                if saves == 2:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                await real_save(state)

            monkeypatch.setattr(checkpoint, "save", fail_the_second)
            # The decision is written; the container id waits for the record delay ...
            reply = await env.kubelet.create(pod, "main", 1000)
            assert reply.status is Status.OK
            assert saves == 1
            assert checkpoint.saved != env.engine.state
            assert not env.engine._save_retry.running
            # ... which the drain cuts short: that write fails, and no retry starts.
            await env.engine.drain(5.0)
            assert env.engine.counters["checkpoint_errors"] == 1
            assert saves == 3
            assert checkpoint.saved == env.engine.state
            assert checkpoint.on_disk() == checkpoint.last_written
            assert not env.engine._save_retry.running
        finally:
            env.channel.close()


async def test_a_checkpoint_retry_writes_nothing_once_a_later_write_caught_up(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubelet = env.kubelet
    failing = await pinned_with_a_failed_record(env, monkeypatch)
    checkpoint = env.engine.checkpoint
    assert checkpoint.saved != env.engine.state
    failing.clear()
    # The next decision's write carries the record that failed, and reaches the disk.
    await kubelet.start_new(await kubelet.run_pod("web", "guaranteed"), "main", 1000)
    assert checkpoint.saved == env.engine.state
    assert checkpoint.durable
    writes = checkpoint.writes
    assert await env.engine._save_again()  # the retry's attempt: done, with nothing to write
    assert checkpoint.writes == writes


async def test_a_write_that_caught_up_ends_the_checkpoint_retry_without_its_wait(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubelet = env.kubelet
    failing = await pinned_with_a_failed_record(env, monkeypatch)
    retry = env.engine._save_retry._task
    assert retry is not None
    failing.clear()
    await kubelet.start_new(await kubelet.run_pod("web", "guaranteed"), "main", 1000)
    assert not env.engine._save_retry.running
    await until(retry.done, "the retry gone, its hour not waited")
    assert retry.cancelled()
    assert env.engine.checkpoint.saved == env.engine.state


async def test_a_failed_fsync_of_the_state_directory_is_made_good_by_a_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renamed file may not be on the disk: writes go on until a fsync succeeds, even
    with no decision to make one."""
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path / "state", options=EngineOptions(retry_delay=0.01))
        try:
            real_sync = checkpoint_module.fsync_directory
            failures = [2]

            def sync(directory: Path) -> None:
                if failures[0] > 0:
                    failures[0] -= 1
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                real_sync(directory)

            monkeypatch.setattr(checkpoint_module, "fsync_directory", sync)
            pod = await env.kubelet.run_pod("db", "guaranteed")
            reply = await env.kubelet.create(pod, "main", 1000)
            assert reply.status is not Status.OK  # the decision's own write failed
            assert env.engine.state.assignments == {}
            assert not env.engine.checkpoint.durable
            await until(lambda: env.engine.checkpoint.durable, "a write whose fsync succeeds")
            assert failures == [0]
            assert env.engine.checkpoint.saved == env.engine.state
            await until(lambda: not env.engine._save_retry.running, "the retry done")
        finally:
            env.channel.close()


async def test_cpus_whose_container_id_was_never_learnt_go_with_their_sandbox(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pod = await kubelet.run_pod("db", "guaranteed")

    def broken(*_: object) -> None:
        raise RuntimeError("a bug while recording the container")

    monkeypatch.setattr(env.engine, "_record_created", broken)
    reply = await kubelet.create(pod, "main", 1000)
    assert reply.status is Status.OK  # the runtime made it: its reply stands
    monkeypatch.undo()
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].container_id == ""
    await kubelet.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString(),
    )
    assert env.engine.state.assignments == {}
    assert env.cpus(shared_id) == "0-7"


async def test_another_clients_update_of_a_lost_container_gives_kubelets_quota_back(
    env: Env,
) -> None:
    pinned_id = await lost_with_its_restore_refused(env)
    # Not kubelet's (no shares, no quota): it still restores the container, quota and all.
    request = pb.UpdateContainerResourcesRequest(
        container_id=pinned_id, linux=pb.LinuxContainerResources(memory_limit_in_bytes=2 * GIB)
    )
    await env.kubelet.ok("UpdateContainerResources", request.SerializeToString())
    restored = env.fake.containers[pinned_id].resources
    assert (restored.cpuset_cpus, restored.cpuset_mems) == ("0-7", "0-1")
    assert restored.cpu_quota == milli_cpu_to_quota(1000)
    assert not env.engine.containers[pinned_id].exclusive


async def test_an_adopted_container_kept_on_its_cpus_gets_an_exclusive_ones_settings(
    env: Env,
) -> None:
    # Pinned by kubelet's static policy before the switch: a CPU of its own, kubelet's quota,
    # every memory node.
    pod = await env.kubelet.run_pod("db", "guaranteed")
    request = env.kubelet.create_request(pod, "main", 1000)
    request.config.linux.resources.cpuset_cpus = "2"
    made = env.fake.add_container(pod.sandbox_id, request.config)
    await env.restart()
    resources = env.fake.containers[made].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems, resources.cpu_quota) == ("2", "1", -1)
    # Squared once: the next start finds nothing to do.
    updates = len(updates_to(env.fake, made))
    await env.restart()
    assert len(updates_to(env.fake, made)) == updates


async def test_a_pod_without_a_qos_cgroup_parent_shares_and_is_warned_about(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """kubelet with cgroupsPerQOS: false puts each pod right under its cgroup root: no QoS
    class can be read, so nothing is pinned. The operator is told, once per pod."""
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="flat", uid="u-flat", namespace="default"),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent="/podu-flat"),
    )
    with caplog.at_level(logging.WARNING):
        raw = await env.kubelet.ok(
            "RunPodSandbox", pb.RunPodSandboxRequest(config=config).SerializeToString()
        )
    sandbox_id = pb.RunPodSandboxResponse.FromString(raw).pod_sandbox_id
    pod = Pod(sandbox_id, config, "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    assert env.engine.state.assignments == {}
    assert env.cpus(container_id) == str(env.engine.state.shared)
    assert env.engine.counters["pods_without_qos"] == 1
    [warning] = [r for r in caplog.records if "cgroupsPerQOS" in r.getMessage()]
    assert warning.__dict__["fields"]["cgroup_parent"] == "/podu-flat"


async def test_a_refused_decision_the_disk_kept_is_written_over_with_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the directory's fsync failed: state.json holds a decision the engine did not
    take (the create failed). The engine's own state replaces it, without waiting for the
    next decision or a restart."""
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, options=EngineOptions(record_delay=0.05))
        pod = await env.kubelet.run_pod("db", "guaranteed")
        real_sync = checkpoint_module.fsync_directory
        failed: list[Path] = []

        def sync_fails_once(directory: Path) -> None:
            if not failed:
                failed.append(directory)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real_sync(directory)

        monkeypatch.setattr(checkpoint_module, "fsync_directory", sync_fails_once)
        reply = await env.kubelet.create(pod, "main", 1000)
        assert reply.status is Status.INTERNAL
        assert failed == [env.state_dir]
        assert env.engine.state.assignments == {}
        # Both: the file is renamed in the writer's thread before the loop learns it.
        await wait_until(
            lambda: env.engine.checkpoint.saved == env.engine.state and env.saved() == {}
        )
        env.channel.close()


async def test_a_decision_cancelled_while_the_disk_took_it_is_written_over_with_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy change cancelled (cpushim stopping) while its checkpoint is in the writer's
    thread: the thread renames the new plan into place all the same, but the engine keeps
    the old one and moved nobody. The engine's own state replaces the file's."""
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, options=EngineOptions(record_delay=0.05))
        pod = await env.kubelet.run_pod("db", "guaranteed")
        await env.kubelet.start_new(pod, "main", 1000)
        before = env.engine.state
        real_replace = checkpoint_module.replace_through_spare
        writing, go_on, written = threading.Event(), threading.Event(), threading.Event()

        def held_replace(
            path: Path, data: bytes, mode: int = 0o600, *, in_place: bool = True
        ) -> bytes:
            if go_on.is_set():
                return real_replace(path, data, mode, in_place=in_place)
            writing.set()
            assert go_on.wait(10)
            try:
                return real_replace(path, data, mode, in_place=in_place)
            finally:
                written.set()

        monkeypatch.setattr(checkpoint_module, "replace_through_spare", held_replace)
        changing = asyncio.create_task(env.engine.change_policy(static_policy(reserved="0,4")))
        assert await asyncio.to_thread(writing.wait, 10)
        changing.cancel()
        await asyncio.sleep(0)  # a turn of the loop: the cancel is delivered
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await changing
        assert env.engine.state == before  # the decision was not taken
        assert await asyncio.to_thread(written.wait, 10)  # and the plan is in the file
        await env.engine.checkpoint_written()
        assert env.engine.checkpoint.load() == before
        env.channel.close()
