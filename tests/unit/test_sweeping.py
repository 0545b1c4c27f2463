"""The sweep: the runtime's containers that cpushim does not track, taken in while it runs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message
from grpclib.const import Status as GrpcStatus

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.upstream import ChannelForward, ReplySeen, RuntimeChannel
from shim.engine import EngineOptions, resync, watching
from shim.engine import requests as rq
from shim.engine.sweeping import sweep
from shim.engine.watching import Watcher
from shim.policy.static import StaticPolicy
from shim.state import ContainerKey
from tests.fake_runtime import FakeRuntime
from tests.harness.kubelet import milli_cpu_to_quota, milli_cpu_to_shares, pod_cgroup_parent
from tests.harness.sysfs import MachineSpec, expected_topology
from tests.unit.engine_env import (
    FIRST_SINGLE,
    SHARED_AFTER_FIRST_SINGLE,
    Env,
    Pod,
    assert_consistent,
    env,
    make_env,
    static_policy,
    unreadable,
    until,
)
from tests.unit.test_engine import kubelet_resize
from tests.unit.test_engine_failures import ReplyLost

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


@contextlib.asynccontextmanager
async def with_watcher(
    tmp_path: Path, fake: FakeRuntime, **settings: Any
) -> AsyncIterator[tuple[Env, Watcher]]:
    """An engine on ``fake`` (``settings`` as make_env takes them) with its watcher, and no
    periodic look: each test asks for its sweeps."""
    environment = await make_env(fake, tmp_path / "state", **settings)
    watcher = Watcher(environment.engine, resync_period=0)
    watcher.start()
    try:
        yield environment, watcher
    finally:
        await watcher.stop()
        await environment.engine.drain(5.0)
        environment.channel.close()


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[Env, Watcher]]:
    """A fail-open engine with its watcher."""
    async with FakeRuntime() as fake, with_watcher(tmp_path, fake, failure_policy="fail-open") as w:
        yield w


def break_next_save(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next checkpoint write fails as a full disk does; the ones after work."""
    real = env.engine.checkpoint.save
    broken = [True]

    async def save(state: object) -> None:
        if broken:
            broken.clear()
            raise OSError(28, "No space left on device")
        await real(state)  # type: ignore[arg-type]

    monkeypatch.setattr(env.engine.checkpoint, "save", save)


async def create_with_reply_lost(env: Env, pod: Pod, milli_cpu: int) -> str:
    """kubelet's create of container "main", made by the runtime, whose reply never reaches
    cpushim (kubelet went away): the id of the container made."""
    request = env.kubelet.create_request(pod, "main", milli_cpu).SerializeToString()
    call = UnaryCall(rq.CREATE_CONTAINER, (), request, 10.0)
    reply = await env.engine.handle(call, ReplyLost(env.channel, call))
    assert reply.status is Status.UNAVAILABLE
    [made] = env.fake.containers
    return made


def made_outside(
    env: Env, pod: Pod, name: str, milli_cpu: int = 0, state: int = pb.CONTAINER_RUNNING
) -> str:
    """A container another CRI client made on the runtime's own socket (running)."""
    config = env.kubelet.create_request(pod, name, milli_cpu).config
    return env.fake.add_container(pod.sandbox_id, config, state=state)


async def left_waiting(env: Env, watcher: Watcher, pod: Pod, milli_cpu: int) -> str:
    """A container another client made asking for ``milli_cpu``, taken in by a sweep that
    found no room for it: it shares, waiting. Its id, once the watch jobs are done."""
    outsider = made_outside(env, pod, "main", milli_cpu)
    watcher.sweep_soon()
    await until(lambda: env.engine.counters["adoptions_refused"] == 1, "refused: no room")
    # The sweep that follows one that took containers in, done too.
    await until(lambda: watcher.jobs.pending == 0, "the sweeps done")
    return outsider


async def test_a_fail_open_create_is_taken_in_and_pinned(
    watched: tuple[Env, Watcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision failed, the create went out unchanged: the container ran on every CPU
    until cpushim restarted. The sweep that follows gives it its exclusive CPU."""
    env, _ = watched
    pod = await env.kubelet.run_pod("db", "guaranteed")
    break_next_save(env, monkeypatch)
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    assert env.engine.counters["fail_open_forwards"] == 1
    [sent] = env.fake.calls_of("CreateContainer")
    assert isinstance(sent, pb.CreateContainerRequest)
    assert sent.config.linux.resources.cpuset_cpus == ""  # kubelet's request, unchanged
    key = ContainerKey(pod.uid, "main")
    await until(lambda: env.cpus(container_id) == FIRST_SINGLE, "the container pinned")
    assert env.engine.state.assignments[key].container_id == container_id
    assert env.engine.counters["untracked_containers_found"] == 1
    await env.engine.checkpoint_written()
    assert env.saved()[pod.uid] == {"main": FIRST_SINGLE}
    # It is tracked like any other: its stop gives the CPU back.
    await env.kubelet.stop(container_id)
    assert key not in env.engine.state.assignments
    assert_consistent(env)


async def test_a_fail_open_shared_create_moves_off_exclusive_cpus(
    watched: tuple[Env, Watcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    env, _ = watched
    pinned = await env.kubelet.start_new(
        await env.kubelet.run_pod("db", "guaranteed"), "main", 1000
    )
    pod = await env.kubelet.run_pod("web", "burstable")
    monkeypatch.setattr(env.engine, "_project_new", _broken)
    container_id = await env.kubelet.start_new(pod, "main", 500)
    assert env.engine.counters["fail_open_forwards"] == 1
    assert env.cpus(container_id) == ""  # kubelet's request unchanged: every CPU
    await until(lambda: container_id in env.engine.containers, "the container taken in")
    await until(lambda: env.cpus(container_id) == SHARED_AFTER_FIRST_SINGLE, "moved")
    assert env.cpus(pinned) == FIRST_SINGLE
    assert env.engine.containers[container_id].key == ContainerKey(pod.uid, "main")
    assert_consistent(env)


async def _broken(*args: object) -> None:
    raise RuntimeError("a bug")


async def test_a_container_another_client_made_shares(env: Env) -> None:
    await env.kubelet.start_new(await env.kubelet.run_pod("db", "guaranteed"), "main", 1000)
    pod = await env.kubelet.run_pod("tools", "besteffort")
    outsider = made_outside(env, pod, "debug")
    report = await sweep(env.engine)
    assert report.tracked == [outsider]
    assert env.cpus(outsider) == SHARED_AFTER_FIRST_SINGLE
    # A second sweep finds nothing new and calls nothing but the listing.
    updates = len(env.fake.calls_of("UpdateContainerResources"))
    assert (await sweep(env.engine)).tracked == []
    assert len(env.fake.calls_of("UpdateContainerResources")) == updates
    assert_consistent(env)


async def test_a_pod_cpushim_never_saw_is_learnt_from_the_runtime(env: Env) -> None:
    """A sandbox and its container made on the runtime's socket: classified from the
    sandbox's cgroup parent, as start-up classifies them."""
    uid = str(uuid.uuid4())
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="direct", uid=uid, namespace="default"),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent=pod_cgroup_parent("guaranteed", uid)),
    )
    sandbox_id = env.fake.add_sandbox(config)
    pod = Pod(sandbox_id, config, "guaranteed")
    outsider = made_outside(env, pod, "main", 2000)
    report = await sweep(env.engine)
    assert report.tracked == [outsider]
    assert report.adopted_exclusive == [ContainerKey(uid, "main")]
    assert len(CPUSet.parse(env.cpus(outsider))) == 2
    assert env.engine.pods[sandbox_id].uid == uid
    assert_consistent(env)


async def test_exited_containers_and_stopped_sandboxes_are_left_alone(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    config = env.kubelet.create_request(pod, "done", 1000).config
    env.fake.add_container(pod.sandbox_id, config, state=pb.CONTAINER_EXITED)
    stopped_config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="gone", uid=str(uuid.uuid4()), namespace="default")
    )
    stopped = env.fake.add_sandbox(stopped_config, state=pb.SANDBOX_NOTREADY)
    env.fake.add_container(stopped, config, state=pb.CONTAINER_CREATED)
    report = await sweep(env.engine)
    assert report.tracked == []
    assert not report.unfinished  # nothing would come of trying again
    assert env.engine.state.assignments == {}
    assert env.fake.calls_of("UpdateContainerResources") == []


class ReplyHeld:
    """A forward whose reply reaches cpushim only once ``release`` is set: the runtime has
    made the container and cpushim has not recorded it yet."""

    def __init__(self, runtime: RuntimeChannel, call: UnaryCall) -> None:
        self._inner = ChannelForward(runtime, call)
        self.release = asyncio.Event()
        self.sent = False
        self.reply: Reply | None = None

    async def __call__(
        self, request: bytes | None = None, *, seen: ReplySeen | None = None
    ) -> Reply:
        self.sent = True
        reply = await self._inner(request)
        await self.release.wait()
        self.reply = reply
        if seen is not None:
            seen(reply)
        return reply


async def create_on_its_way(env: Env) -> tuple[Pod, ReplyHeld, asyncio.Task[Reply]]:
    """A BestEffort pod's container made by the runtime, its create's reply held from
    cpushim (until ``release``): the pod, the forward, and the create's task."""
    pod = await env.kubelet.run_pod("web", "besteffort")
    request = env.kubelet.create_request(pod, "main").SerializeToString()
    call = UnaryCall(rq.CREATE_CONTAINER, (), request, 10.0)
    forward = ReplyHeld(env.channel, call)
    create = asyncio.create_task(env.engine.handle(call, forward))
    await until(lambda: bool(env.fake.containers), "the runtime made the container")
    return pod, forward, create


async def test_a_create_on_its_way_is_not_taken_for_an_unknown_container(env: Env) -> None:
    """The runtime has made the container and cpushim has not recorded it yet: the sweep
    waits for the create instead of taking the container in as unknown."""
    pod, forward, create = await create_on_its_way(env)
    [created] = env.fake.containers
    outsider = made_outside(env, pod, "other")
    assert env.engine.creates_in_flight == 1
    assert (await sweep(env.engine, settle=0.05)).tracked == []
    assert outsider not in env.engine.containers
    listed = len(env.fake.calls_of("ListContainers"))
    running = asyncio.create_task(sweep(env.engine))
    # It has listed both containers and waits for the create.
    await until(lambda: len(env.fake.calls_of("ListContainers")) > listed, "the sweep listed")
    assert not running.done()
    forward.release.set()
    reply = await create
    assert reply.status is Status.OK
    assert (await running).tracked == [outsider]
    assert env.engine.containers[created].key == ContainerKey(pod.uid, "main")
    assert env.engine.creates_in_flight == 0
    assert_consistent(env)


async def test_a_create_whose_answer_was_lost_gets_its_container(env: Env) -> None:
    """Its CPUs were held without a container id: the sweep names the container, so its
    stop (not only its pod's) gives them back."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    orphan = await create_with_reply_lost(env, pod, 1000)
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].container_id == ""
    report = await sweep(env.engine)
    assert report.tracked == [orphan]
    assert env.engine.state.assignments[key].container_id == orphan
    assert env.cpus(orphan) == FIRST_SINGLE
    await env.engine.checkpoint_written()
    assert env.saved()[pod.uid] == {"main": FIRST_SINGLE}
    await env.kubelet.stop(orphan)
    assert env.engine.state.assignments == {}
    assert_consistent(env)


async def test_a_runtime_that_cannot_list_leaves_everything(env: Env) -> None:
    pod = await env.kubelet.run_pod("tools", "besteffort")
    outsider = made_outside(env, pod, "debug")
    env.fake.fail_next("ListContainers", GrpcStatus.UNAVAILABLE)
    assert (await sweep(env.engine)).tracked == []
    assert outsider not in env.engine.containers
    assert (await sweep(env.engine)).tracked == [outsider]


async def test_a_container_whose_state_cannot_be_read_leaves_the_sweep_unfinished(
    env: Env,
) -> None:
    """Listed, but its ContainerStatus failed: it is not taken in now, and the sweep says
    so, or it waits for a full look that resyncPeriod 0 never brings."""
    pod = await env.kubelet.run_pod("tools", "besteffort")
    outsider = made_outside(env, pod, "debug")
    env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE)
    report = await sweep(env.engine)
    assert report.tracked == []
    assert report.unfinished
    report = await sweep(env.engine)
    assert report.tracked == [outsider]
    assert not report.unfinished


@pytest.mark.parametrize("status", [Status.UNAVAILABLE, None], ids=["failed", "undecodable"])
async def test_a_container_whose_state_cannot_be_read_is_warned_of_once_by_the_sweeps(
    env: Env,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    status: Status | None,
) -> None:
    """The sweep tries again (after 1 s, doubling up to a minute) while the runtime cannot
    say what an unknown container is: each is told once, not at every try, and forgotten
    once gone from the runtime's list or read."""
    pod = await env.kubelet.run_pod("tools", "besteffort")
    gone, kept = made_outside(env, pod, "debug"), made_outside(env, pod, "probe")
    failing = unreadable(env, monkeypatch, status)
    failing.update({gone, kept})
    with caplog.at_level("WARNING", logger="shim.engine.resync"):
        for _ in range(3):
            report = await sweep(env.engine)
            assert report.unfinished
            assert report.tracked == []
    told = [
        tuple(r.__dict__["fields"].get(k) for k in ("pod", "container", "container_id"))
        for r in caplog.records
        if r.getMessage() == "cannot read a container's state; it stays as it is"
    ]
    assert sorted(told) == sorted(
        [
            ("default/tools", f"{pod.uid}/debug", gone),
            ("default/tools", f"{pod.uid}/probe", kept),
        ]
    )
    await remove_container_outside(env, gone)
    failing.clear()
    assert (await sweep(env.engine)).tracked == [kept]
    assert env.engine.unread_untracked == set()


async def test_a_sandbox_whose_state_cannot_be_read_leaves_the_sweep_unfinished(
    env: Env,
) -> None:
    uid = str(uuid.uuid4())
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="direct", uid=uid, namespace="default"),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent=pod_cgroup_parent("besteffort", uid)),
    )
    outsider = made_outside(env, Pod(env.fake.add_sandbox(config), config, "besteffort"), "main")
    # Its verbose status, then its plain one.
    env.fake.fail_next("PodSandboxStatus", GrpcStatus.DEADLINE_EXCEEDED, count=2)
    report = await sweep(env.engine)
    assert report.tracked == []
    assert report.unfinished
    assert (await sweep(env.engine)).tracked == [outsider]


async def test_a_container_in_a_sandbox_whose_shim_hangs_is_pinned_by_its_cgroup(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """containerd asks the sandbox's shim for a verbose PodSandboxStatus: the plain status
    serves, and the container's cgroup tells the pod's QoS class."""
    monkeypatch.setattr(resync, "SANDBOX_INFO_TIMEOUT", 0.2)
    uid = str(uuid.uuid4())
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="direct", uid=uid, namespace="default"),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent=pod_cgroup_parent("guaranteed", uid)),
    )
    pod = Pod(env.fake.add_sandbox(config), config, "guaranteed")
    outsider = made_outside(env, pod, "main", 1000)
    env.fake.shims_hung.add(pod.sandbox_id)
    report = await sweep(env.engine)
    assert report.tracked == [outsider]
    assert not report.unfinished
    assert report.adopted_exclusive == [ContainerKey(uid, "main")]
    assert env.cpus(outsider) == FIRST_SINGLE


async def test_a_created_container_whose_sandboxes_cannot_be_listed_leaves_the_sweep_unfinished(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("tools", "besteffort")
    outsider = made_outside(env, pod, "debug", state=pb.CONTAINER_CREATED)
    env.fake.fail_next("ListPodSandbox", GrpcStatus.UNAVAILABLE)
    report = await sweep(env.engine)
    assert report.tracked == []
    assert report.unfinished
    assert (await sweep(env.engine)).tracked == [outsider]


async def test_a_container_gone_since_the_listing_leaves_the_sweep_finished(env: Env) -> None:
    """Removed between the listing and its ContainerStatus: nothing is left to take in, and
    a sweep tried again would only list it gone."""
    pod = await env.kubelet.run_pod("tools", "besteffort")
    made_outside(env, pod, "debug")
    env.fake.fail_next("ContainerStatus", GrpcStatus.NOT_FOUND)
    report = await sweep(env.engine)
    assert report.tracked == []
    assert not report.unfinished


async def test_the_full_look_sweeps(with_cgroups: tuple[Env, Watcher]) -> None:
    env, watcher = with_cgroups
    pod = await env.kubelet.run_pod("tools", "besteffort")
    outsider = made_outside(env, pod, "debug")
    await watcher.look_everywhere()
    assert outsider in env.engine.containers


async def test_a_container_taken_in_created_and_started_by_another_client_is_watched(
    with_cgroups: tuple[Env, Watcher],
) -> None:
    """Taken in while created, then started on the runtime's socket: cpushim never sees its
    StartContainer. The full look finds it running and watches it, so its exit gives its
    exclusive CPU back."""
    env, watcher = with_cgroups
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = made_outside(env, pod, "main", 1000, state=pb.CONTAINER_CREATED)
    report = await sweep(env.engine)
    assert report.adopted_exclusive == [ContainerKey(pod.uid, "main")]
    tracked = env.engine.containers[outsider]
    start = pb.StartContainerRequest(container_id=outsider).SerializeToString()
    await env.channel.unary(UnaryCall(rq.START_CONTAINER, (), start, 10.0))
    await watcher.look_everywhere()
    assert tracked.phase.value == "running"
    assert tracked.cgroup is not None
    assert env.kernel_cpus(outsider) == FIRST_SINGLE
    env.fake.exit_container(outsider)
    await watcher.look_everywhere()
    assert env.engine.state.assignments == {}


async def test_an_adoption_the_disk_refused_is_made_at_a_later_sweep(
    watched: tuple[Env, Watcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk is full for the create's decision and for the adoption that follows the
    fail-open create: the container shares until a sweep after the disk is back."""
    env, watcher = watched
    pod = await env.kubelet.run_pod("db", "guaranteed")
    real = env.engine.checkpoint.save
    full = [True]

    async def save(state: object) -> None:
        if full:
            raise OSError(28, "No space left on device")
        await real(state)  # type: ignore[arg-type]

    monkeypatch.setattr(env.engine.checkpoint, "save", save)
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    await until(lambda: container_id in env.engine.containers, "the container taken in")
    await watcher.look_everywhere()  # a sweep that finds the disk still full
    assert env.engine.state.assignments == {}
    assert env.cpus(container_id) == "0-7"
    full.clear()
    report = await sweep(env.engine)
    assert report.tracked == []
    assert report.adopted_exclusive == [ContainerKey(pod.uid, "main")]
    assert env.cpus(container_id) == FIRST_SINGLE
    assert_consistent(env)


async def test_a_container_with_no_room_is_refused_once_and_adopted_when_room_comes(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    first = await env.kubelet.run_pod("first", "guaranteed")
    holder = await env.kubelet.start_new(first, "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = made_outside(env, pod, "main", 2000)  # one CPU is left
    assert (await sweep(env.engine)).tracked == [outsider]
    assert env.engine.counters["adoptions_refused"] == 1
    caplog.clear()
    statuses = len(env.fake.calls_of("ContainerStatus"))
    for _ in range(3):
        assert (await sweep(env.engine)).adopted_exclusive == []
    assert env.engine.counters["adoptions_refused"] == 1
    # No room: not even tried (a runtime call per waiting container, under the lock).
    assert len(env.fake.calls_of("ContainerStatus")) == statuses
    assert "cannot get its exclusive CPUs" not in caplog.text
    assert env.cpus(outsider) == str(env.engine.state.shared)
    await env.kubelet.stop(holder)
    assert (await sweep(env.engine)).adopted_exclusive == [ContainerKey(pod.uid, "main")]
    assert len(CPUSet.parse(env.cpus(outsider))) == 2
    assert_consistent(env)


async def stop_sandbox(env: Env, sandbox_id: str) -> None:
    await env.kubelet.ok(
        "StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id).SerializeToString()
    )


async def test_created_container_of_stopped_sandbox_is_not_adopted_after_restart(env: Env) -> None:
    """Start-up counts a container left created in a stopped sandbox as exited (the runtime
    never starts it), and so does the sweep: it gets no CPUs, though its pod is known."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    reply = await env.kubelet.create(pod, "main", 1000)
    assert reply.status is Status.OK
    await stop_sandbox(env, pod.sandbox_id)  # kubelet never started it: it stays CREATED
    assert env.engine.state.assignments == {}
    await env.restart()
    assert env.engine.state.assignments == {}
    assert env.engine.containers == {}
    report = await sweep(env.engine)
    assert report.tracked == []
    assert env.engine.state.assignments == {}


async def test_lost_create_in_a_sandbox_stopped_since_gets_no_cpus(env: Env) -> None:
    """A create whose answer was lost, then its pod stopped (the held CPU goes back): the
    container the runtime made never runs, and the sweep gives it nothing."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    await create_with_reply_lost(env, pod, 1000)
    await stop_sandbox(env, pod.sandbox_id)
    assert env.engine.state.assignments == {}
    await sweep(env.engine)
    assert env.engine.state.assignments == {}


async def test_sweep_survives_a_container_removed_while_it_is_moved(env: Env) -> None:
    """The container goes away between the sweep's ContainerStatus and its move (a
    RemoveContainer needs no lock to reach the runtime): the move forgets it, and the sweep
    (and the full look it is part of) goes on."""
    pod = await env.kubelet.run_pod("tools", "besteffort")
    outsider = made_outside(env, pod, "debug")
    gate = env.fake.gate("UpdateContainerResources")
    running = asyncio.create_task(sweep(env.engine))
    await until(lambda: bool(env.fake.calls_of("UpdateContainerResources")), "the move")
    del env.fake.containers[outsider]  # removed on the runtime meanwhile
    gate.set()
    report = await running
    assert outsider not in env.engine.containers
    assert report.tracked in ([], [outsider])


async def test_a_lost_shared_create_is_swept_right_after(watched: tuple[Env, Watcher]) -> None:
    """Its container, made on the shared pool of then, is taken in at once (not at the next
    full look), so later pinnings move it."""
    env, _ = watched
    pod = await env.kubelet.run_pod("web", "burstable")
    orphan = await create_with_reply_lost(env, pod, 500)
    await until(lambda: orphan in env.engine.containers, "the lost shared create swept", 2.0)


async def test_a_sweep_creates_kept_from_the_lock_tries_again_without_a_full_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With resyncPeriod 0 no full look comes: a sweep that gave up while creates kept
    coming must try again by itself, or the container it found runs on any CPU until a
    restart."""
    monkeypatch.setattr(watching, "sweep", functools.partial(sweep, settle=0.05))
    async with (
        FakeRuntime() as fake,
        with_watcher(tmp_path, fake, options=EngineOptions(retry_delay=0.01)) as (env, watcher),
    ):
        pod, forward, create = await create_on_its_way(env)
        outsider = made_outside(env, pod, "other")
        listed = len(env.fake.calls_of("ListContainers"))
        watcher.sweep_soon()
        await until(
            lambda: len(env.fake.calls_of("ListContainers")) >= listed + 2,
            "a sweep that gave up, then another",
        )
        assert outsider not in env.engine.containers
        forward.release.set()
        assert (await create).status is Status.OK
        await until(lambda: outsider in env.engine.containers, "taken in by a later sweep")
        assert env.engine.counters["full_resyncs"] == 0


@pytest.mark.parametrize("failing", ["ContainerStatus", "ListContainers"])
async def test_a_sweep_that_cannot_list_or_read_tries_again_without_a_full_look(
    tmp_path: Path, failing: str
) -> None:
    """A lost create's answer (containerd restarting) asks for a sweep at once, when the
    runtime may not list or answer yet: with resyncPeriod 0 no full look would take its
    container in."""
    async with (
        FakeRuntime() as fake,
        with_watcher(tmp_path, fake, options=EngineOptions(retry_delay=0.01)) as (env, watcher),
    ):
        pod = await env.kubelet.run_pod("tools", "besteffort")
        outsider = made_outside(env, pod, "debug")
        env.fake.fail_next(failing, GrpcStatus.UNAVAILABLE, "restarting", count=2)
        watcher.sweep_soon()
        await until(lambda: outsider in env.engine.containers, "taken in by a later sweep")
        assert len(env.fake.calls_of("ListContainers")) >= 3
        assert env.engine.counters["full_resyncs"] == 0


async def test_a_stopped_watcher_sweeps_no_more(tmp_path: Path) -> None:
    async with (
        FakeRuntime() as fake,
        with_watcher(tmp_path, fake, options=EngineOptions(retry_delay=3600)) as (env, watcher),
    ):
        env.fake.fail_next("ListContainers", GrpcStatus.UNAVAILABLE, "restarting")
        listed = len(env.fake.calls_of("ListContainers"))
        watcher.sweep_soon()
        await until(lambda: watcher._sweep_retry.running, "a sweep to try again")
        await watcher.stop()
        # Its hour-long wait ends with the watcher, and no sweep follows.
        await until(lambda: not watcher._sweep_retry.running, "the retry ended")
        assert len(env.fake.calls_of("ListContainers")) == listed + 1


@pytest.fixture
async def sharing(tmp_path: Path) -> AsyncIterator[tuple[Env, Watcher]]:
    """The watcher with no periodic look."""
    async with FakeRuntime() as fake, with_watcher(tmp_path, fake) as (env, watcher):
        yield env, watcher


class AskedJobs:
    """The keys of the watch jobs asked for from now on."""

    def __init__(self, watcher: Watcher, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[str] = []
        request = watcher.jobs.request

        def recorded(key: str, job: Any) -> None:
            self.keys.append(key)
            request(key, job)

        monkeypatch.setattr(watcher.jobs, "request", recorded)

    @property
    def adoptions(self) -> int:
        return self.keys.count("adopt")


async def test_a_release_that_makes_room_adopts_a_waiting_container_without_a_full_look(
    sharing: tuple[Env, Watcher],
) -> None:
    """A container left sharing for lack of room waited for a full look after the CPUs
    came back; with resyncPeriod 0 none comes, and it shared until cpushim restarted."""
    env, watcher = sharing
    holder = await env.kubelet.start_new(await env.kubelet.run_pod("a", "guaranteed"), "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = made_outside(env, pod, "main", 2000)  # one CPU is left
    watcher.sweep_soon()
    await until(lambda: env.engine.counters["adoptions_refused"] == 1, "refused: no room")
    await env.kubelet.stop(holder)
    key = ContainerKey(pod.uid, "main")
    await until(lambda: len(CPUSet.parse(env.cpus(outsider))) == 2, "adopted once there is room")
    assert key in env.engine.state.assignments
    await until(lambda: watcher.jobs.pending == 0, "moved")
    assert env.engine.counters["full_resyncs"] == 0
    assert_consistent(env)


async def test_a_release_that_makes_room_adopts_a_container_a_reload_displaced(
    sharing: tuple[Env, Watcher],
) -> None:
    env, watcher = sharing
    pods = [await env.kubelet.run_pod(name, "guaranteed") for name in ("db", "x")]
    ids = {
        ContainerKey(pods[0].uid, "main"): await env.kubelet.start_new(pods[0], "main", 3000),
        ContainerKey(pods[1].uid, "main"): await env.kubelet.start_new(pods[1], "main", 1000),
    }
    [lost] = await env.engine.change_policy(static_policy("0-4"))  # 5-7 left: room for one
    [other] = [key for key in ids if key != lost]
    await env.kubelet.stop(ids[other])
    await until(lambda: lost in env.engine.state.assignments, "adopted once there is room")
    await until(lambda: watcher.jobs.pending == 0, "moved")
    assert env.engine.counters["full_resyncs"] == 0
    assert_consistent(env)


async def test_a_release_with_no_container_waiting_for_room_asks_for_no_adoption(
    sharing: tuple[Env, Watcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod's stop costs nothing more when nobody waits (the churn benchmark's path); nor,
    once the waiting one is adopted, do the releases after."""
    env, watcher = sharing
    jobs = AskedJobs(watcher, monkeypatch)
    holder = await env.kubelet.start_new(await env.kubelet.run_pod("a", "guaranteed"), "main", 1000)
    await env.kubelet.stop(holder)
    assert jobs.adoptions == 0

    holder = await env.kubelet.start_new(await env.kubelet.run_pod("b", "guaranteed"), "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = made_outside(env, pod, "main", 2000)
    watcher.sweep_soon()
    await until(lambda: env.engine.counters["adoptions_refused"] == 1, "refused: no room")
    await env.kubelet.stop(holder)
    await until(lambda: env.engine.state.holding(outsider) is not None, "adopted")
    await until(lambda: watcher.jobs.pending == 0, "jobs done")
    asked = jobs.adoptions
    assert asked >= 1
    other = await env.kubelet.start_new(await env.kubelet.run_pod("c", "guaranteed"), "main", 1000)
    await env.kubelet.stop(other)
    assert jobs.adoptions == asked


async def test_a_release_that_frees_too_few_cpus_asks_the_runtime_nothing(
    sharing: tuple[Env, Watcher],
) -> None:
    env, watcher = sharing
    big = await env.kubelet.start_new(await env.kubelet.run_pod("a", "guaranteed"), "main", 5000)
    small = await env.kubelet.start_new(await env.kubelet.run_pod("b", "guaranteed"), "main", 1000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = await left_waiting(env, watcher, pod, 3000)  # one CPU is left
    statuses = len(env.fake.calls_of("ContainerStatus"))
    await env.kubelet.stop(small)  # two free: not enough for three
    await until(lambda: watcher.jobs.pending == 0, "jobs done")
    assert len(env.fake.calls_of("ContainerStatus")) == statuses
    assert env.engine.state.holding(outsider) is None
    await env.kubelet.stop(big)
    await until(lambda: env.engine.state.holding(outsider) is not None, "adopted")
    assert env.engine.counters["adoptions_refused"] == 1


async def test_releases_do_not_ask_again_and_again_for_an_adoption_the_free_cpus_refused(
    tmp_path: Path,
) -> None:
    """Free CPUs it cannot have (isolated ones, for a pod that does not ask for them) make
    an adoption worth trying by count; tried at every release, it would cost a runtime call
    per waiting container, under the lock, at each. Tried again once other CPUs are free."""
    topology = expected_topology(
        MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2, isolated=frozenset({3, 7}))
    )
    policy = StaticPolicy.create(topology, reserved=CPUSet.parse("0"))
    isolated = {"cpushim.io/isolated-cpus": "require"}
    async with FakeRuntime() as fake, with_watcher(tmp_path, fake, policy=policy) as (env, watcher):
        holder = await env.kubelet.start_new(
            await env.kubelet.run_pod("a", "guaranteed"), "main", 5000
        )
        first = await env.kubelet.start_new(
            await env.kubelet.run_pod("rt", "guaranteed", isolated), "main", 1000
        )
        pod = await env.kubelet.run_pod("db", "guaranteed")
        outsider = await left_waiting(env, watcher, pod, 2000)
        statuses = len(env.fake.calls_of("ContainerStatus"))
        await env.kubelet.stop(first)  # 3 and 7 free: two, but isolated
        await until(lambda: len(env.fake.calls_of("ContainerStatus")) > statuses, "tried once")
        await until(lambda: watcher.jobs.pending == 0, "jobs done")
        statuses = len(env.fake.calls_of("ContainerStatus"))
        for n in range(3):
            again = await env.kubelet.start_new(
                await env.kubelet.run_pod(f"rt{n}", "guaranteed", isolated), "main", 1000
            )
            await env.kubelet.stop(again)  # the same two free again
            await until(lambda: watcher.jobs.pending == 0, "jobs done")
        assert len(env.fake.calls_of("ContainerStatus")) == statuses
        assert env.engine.state.holding(outsider) is None
        await env.kubelet.stop(holder)
        await until(lambda: env.engine.state.holding(outsider) is not None, "adopted")
        await until(lambda: watcher.jobs.pending == 0, "jobs done")
        assert not CPUSet.parse(env.cpus(outsider)) & CPUSet.parse("3,7")


async def test_a_refusal_at_start_up_is_not_counted_again_by_the_sweeps(env: Env) -> None:
    holder = await env.kubelet.start_new(await env.kubelet.run_pod("a", "guaranteed"), "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = made_outside(env, pod, "main", 2000)  # one CPU is left
    await env.restart()
    assert env.engine.counters["adoptions_refused"] == 1
    assert (await sweep(env.engine)).adopted_exclusive == []
    assert env.engine.counters["adoptions_refused"] == 1
    await env.kubelet.stop(holder)
    assert (await sweep(env.engine)).adopted_exclusive == [ContainerKey(pod.uid, "main")]
    assert len(CPUSet.parse(env.cpus(outsider))) == 2


@pytest.fixture
async def with_cgroups(tmp_path: Path) -> AsyncIterator[tuple[Env, Watcher]]:
    """An engine writing a fake cgroup tree, with its watcher."""
    async with (
        FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake,
        with_watcher(tmp_path, fake, options=EngineOptions(record_delay=3600)) as w,
    ):
        yield w


async def test_adoption_survives_a_container_removed_while_it_is_pinned(env: Env) -> None:
    """A sweep's adoption pins a sharing container that is removed on the runtime while the
    move is on its way (a RemoveContainer reaches containerd without the lock): its CPUs go
    back and the sweep goes on."""
    first = await env.kubelet.run_pod("first", "guaranteed")
    holder = await env.kubelet.start_new(first, "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = made_outside(env, pod, "main", 2000)  # one CPU is left: it shares
    assert (await sweep(env.engine)).tracked == [outsider]
    await env.kubelet.stop(holder)  # room now
    moves = len(env.fake.calls_of("UpdateContainerResources"))
    gate = env.fake.gate("UpdateContainerResources")
    running = asyncio.create_task(sweep(env.engine))
    await until(
        lambda: len(env.fake.calls_of("UpdateContainerResources")) > moves, "the pinning move"
    )
    del env.fake.containers[outsider]  # removed on the runtime meanwhile
    gate.set()
    report = await running
    assert report.adopted_exclusive == []
    assert env.engine.state.assignments == {}


async def test_a_container_started_while_the_sweep_took_it_in_is_watched(
    with_cgroups: tuple[Env, Watcher],
) -> None:
    """The sweep right after a fail-open create (not a full look) takes in a container while
    it is created, and it is started meanwhile (a StartContainer answered while the sweep
    held the lock finds it untracked): it is looked up after, and watched, so its exit gives
    its exclusive CPU back at once."""
    env, watcher = with_cgroups
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = made_outside(env, pod, "main", 1000, state=pb.CONTAINER_CREATED)
    gate = env.fake.gate("UpdateContainerResources")
    running = asyncio.create_task(sweep(env.engine))
    await until(lambda: bool(env.fake.calls_of("UpdateContainerResources")), "the take-in move")
    start = pb.StartContainerRequest(container_id=outsider).SerializeToString()
    await env.channel.unary(UnaryCall(rq.START_CONTAINER, (), start, 10.0))
    env.fake.ungate("UpdateContainerResources")
    gate.set()
    report = await running
    assert report.adopted_exclusive == [ContainerKey(pod.uid, "main")]
    assert env.engine.containers[outsider].phase.value == "running"
    assert watcher.watched_containers == 1
    env.fake.exit_container(outsider)
    await until(lambda: env.engine.state.assignments == {}, "its exit gives the CPU back", 2.0)


async def test_a_watcher_stopping_during_the_sweep_does_not_break_it(
    with_cgroups: tuple[Env, Watcher],
) -> None:
    """cpushim stops (the watcher with it) while the sweep looks up the containers it took
    in: the sweep ends without an error."""
    env, watcher = with_cgroups
    pod = await env.kubelet.run_pod("tools", "besteffort")
    made_outside(env, pod, "a", state=pb.CONTAINER_CREATED)
    made_outside(env, pod, "b", state=pb.CONTAINER_CREATED)
    running = asyncio.create_task(sweep(env.engine))
    await until(lambda: len(env.fake.calls_of("UpdateContainerResources")) == 2, "both taken in")
    gate = env.fake.gate("ContainerStatus")
    statuses = len(env.fake.calls_of("ContainerStatus"))
    await until(
        lambda: len(env.fake.calls_of("ContainerStatus")) > statuses, "the first look_at_created"
    )
    await watcher.stop()
    env.fake.ungate("ContainerStatus")
    gate.set()
    report = await running
    assert len(report.tracked) == 2


async def test_a_container_a_reload_displaced_is_not_reported_again_by_the_next_sweep(
    env: Env,
) -> None:
    """A reload that leaves a running container no room counts it in pinning_errors; the
    sweeps after do not count (or log) the same container again."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pod, "main", 3000)
    lost = await env.engine.change_policy(static_policy("0-5"))  # 6,7 left: no room for 3
    assert lost == [ContainerKey(pod.uid, "main")]
    assert env.engine.counters["pinning_errors"] == 1
    await sweep(env.engine)
    assert env.engine.counters["adoptions_refused"] == 0


async def test_a_never_running_container_costs_nothing_at_each_sweep(env: Env) -> None:
    """A container left created in a stopped sandbox (start-up counts it exited) is looked
    at by one sweep, not by every full look until the sandbox is removed."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.create(pod, "main", 1000)
    await env.kubelet.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString(),
    )
    await env.restart()
    await sweep(env.engine)
    statuses = len(env.fake.calls_of("ContainerStatus"))
    listings = len(env.fake.calls_of("ListPodSandbox"))
    await sweep(env.engine)
    assert len(env.fake.calls_of("ContainerStatus")) == statuses
    # The one listing of the sandboxes start-up learnt (to forget those gone), no more.
    assert len(env.fake.calls_of("ListPodSandbox")) == listings + 1


async def test_fail_open_next_attempt_is_adopted_though_a_dead_attempt_held_the_key(
    watched: tuple[Env, Watcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 0 is pinned and its StartContainer fails (containerd marks it exited; cpushim
    follows only an OK start, so it keeps its CPU). Attempt 1's create fails open on a full
    disk, which left attempt 0's assignment in place. The sweep that takes attempt 1 in
    gives attempt 0's CPU back first, so attempt 1 is pinned once the disk has room."""
    env, watcher = watched
    pod = await env.kubelet.run_pod("db", "guaranteed")
    reply = await env.kubelet.create(pod, "main", 1000)
    assert reply.status is Status.OK
    first = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    env.fake.fail_next("StartContainer", GrpcStatus.UNKNOWN, "exec: no such file")
    start = pb.StartContainerRequest(container_id=first).SerializeToString()
    assert (await env.kubelet.call("StartContainer", start)).status is not Status.OK
    env.fake._exited(env.fake.containers[first], 128)  # containerd: StartError, exited
    await env.engine.checkpoint_written()
    break_next_save(env, monkeypatch)
    second = await env.kubelet.start_new(pod, "main", 1000, attempt=1)
    assert env.engine.counters["fail_open_forwards"] == 1
    await until(lambda: second in env.engine.containers, "attempt 1 taken in")
    await watcher.look_everywhere()  # the disk is back: a full look, its sweep, adoption
    key = ContainerKey(pod.uid, "main")
    assert key in env.engine.state.assignments
    assert env.engine.state.assignments[key].container_id == second
    assert env.cpus(second) == FIRST_SINGLE


async def test_create_whose_recording_failed_after_the_forward_is_swept_soon(
    watched: tuple[Env, Watcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work after the forward fails (a bug in recording the reply): the runtime's OK reply
    stands and the container exists untracked, on CPUs held without its id. A sweep right
    after takes it in, as after a fail-open create or a lost answer."""
    env, _ = watched

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    pod = await env.kubelet.run_pod("db", "guaranteed")
    monkeypatch.setattr(env.engine, "_record_created", broken)
    reply = await env.kubelet.create(pod, "main", 1000)
    assert reply.status is Status.OK
    assert env.engine.counters["internal_errors"] == 1
    [made] = env.fake.containers
    monkeypatch.undo()
    await until(lambda: made in env.engine.containers, "taken in by a sweep", 2.0)


async def test_a_refused_container_resized_down_is_adopted_when_its_new_count_fits(
    env: Env,
) -> None:
    """Refused 2 CPUs, then resized in place to 1 while one is free: the sweep pins it on 1,
    as a restart would (the adoption plans from what kubelet asks now)."""
    holder_pod = await env.kubelet.run_pod("first", "guaranteed")
    await env.kubelet.start_new(holder_pod, "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = made_outside(env, pod, "main", 2000)  # one CPU is left: refused
    assert (await sweep(env.engine)).tracked == [outsider]
    assert env.engine.counters["adoptions_refused"] == 1
    update = pb.UpdateContainerResourcesRequest(
        container_id=outsider,
        linux=pb.LinuxContainerResources(
            cpu_period=100_000,
            cpu_quota=milli_cpu_to_quota(1000),
            cpu_shares=milli_cpu_to_shares(1000),
            memory_limit_in_bytes=1024**3,
        ),
    )
    await env.kubelet.ok("UpdateContainerResources", update.SerializeToString())
    report = await sweep(env.engine)
    assert report.adopted_exclusive == [ContainerKey(pod.uid, "main")]
    assert len(CPUSet.parse(env.cpus(outsider))) == 1


async def test_a_pod_learnt_by_a_sweep_is_forgotten_once_its_sandbox_is_gone(env: Env) -> None:
    """Another client's pod: its RemovePodSandbox never passes through cpushim. Once the
    runtime no longer lists the sandbox, the next sweep forgets the pod and its containers,
    and the CPUs its container held go back (its exit was never seen)."""
    uid = str(uuid.uuid4())
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="direct", uid=uid, namespace="default"),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent=pod_cgroup_parent("guaranteed", uid)),
    )
    sandbox_id = env.fake.add_sandbox(config)
    outsider = made_outside(env, Pod(sandbox_id, config, "guaranteed"), "main", 1000)
    assert (await sweep(env.engine)).adopted_exclusive == [ContainerKey(uid, "main")]
    assert sandbox_id in env.engine.pods
    # The other client tears its pod down on the runtime's socket.
    await remove_outside(env, sandbox_id)
    assert outsider not in env.fake.containers
    await sweep(env.engine)
    assert sandbox_id not in env.engine.pods
    assert outsider not in env.engine.containers
    assert env.engine.state.assignments == {}
    assert env.engine.learnt_sandboxes == set()
    assert_consistent(env)


async def test_kubelets_pods_are_never_forgotten_by_a_sweep(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    env.fake.fail_next("ListPodSandbox", GrpcStatus.UNAVAILABLE)
    await sweep(env.engine)
    assert env.engine.learnt_sandboxes == set()
    assert pod.sandbox_id in env.engine.pods
    assert env.engine.state.holding(container_id) == ContainerKey(pod.uid, "main")


def outside_pod(env: Env, name: str) -> Pod:
    """A Guaranteed pod another CRI client made on the runtime's own socket."""
    uid = str(uuid.uuid4())
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace="default"),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent=pod_cgroup_parent("guaranteed", uid)),
    )
    return Pod(env.fake.add_sandbox(config), config, "guaranteed")


async def on_runtime(env: Env, *calls: tuple[str, Message]) -> None:
    """Calls another CRI client makes on the runtime's own socket, each answered OK."""
    for method, request in calls:
        reply = await env.channel.unary(
            UnaryCall(rq.RUNTIME + method, (), request.SerializeToString(), 10.0)
        )
        assert reply.status is Status.OK


async def remove_outside(env: Env, sandbox_id: str) -> None:
    await on_runtime(
        env,
        ("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id)),
        ("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)),
    )


async def test_a_stale_sandbox_list_of_a_concurrent_sweep_forgets_a_live_pod(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sweeps run at once (the watcher's "sweep" job after a fail-open create, and a
    full look's). Sweep A's ListPodSandbox answer was made before pod "second"'s sandbox
    existed, and sweep B learns that pod meanwhile: A forgets only what was learnt before
    its listing, so the live pod keeps its container and its exclusive CPU."""
    first = outside_pod(env, "first")
    made_outside(env, first, "main", 1000)
    await sweep(env.engine)
    assert env.engine.learnt_sandboxes == {first.sandbox_id}  # A lists sandboxes at all

    real = env.engine.runtime.unary
    listed, go_on = asyncio.Event(), asyncio.Event()
    at_take_in, take_in = asyncio.Event(), asyncio.Event()
    sweep_a: asyncio.Task[object] | None = None

    async def unary(call: UnaryCall, *args: Any, **kwargs: Any) -> Reply:
        mine = asyncio.current_task() is sweep_a
        if mine and call.path == rq.LIST_CONTAINERS:
            at_take_in.set()  # A has forgotten; hold it before it looks for containers
            await take_in.wait()
        reply = await real(call, *args, **kwargs)
        if mine and call.path == rq.LIST_POD_SANDBOX and not listed.is_set():
            listed.set()  # the answer is made; it reaches sweep A late
            await go_on.wait()
        return reply

    monkeypatch.setattr(env.engine.runtime, "unary", unary)
    sweep_a = asyncio.create_task(sweep(env.engine))
    await listed.wait()

    second = outside_pod(env, "second")
    live = made_outside(env, second, "main", 1000)
    key = ContainerKey(second.uid, "main")
    assert (await sweep(env.engine)).adopted_exclusive == [key]  # sweep B
    pinned = env.engine.state.assignments[key].cpus
    assert env.cpus(live) == str(pinned)

    go_on.set()
    await at_take_in.wait()
    # Sweep A has run its forgetting; kubelet makes an exclusive container now.
    forgotten = live not in env.engine.containers or second.sandbox_id not in env.engine.pods
    pod = await env.kubelet.run_pod("db", "guaranteed")
    kubelets = await env.kubelet.start_new(pod, "main", 1000)
    given = env.cpus(kubelets)
    take_in.set()
    await sweep_a
    assert live in env.fake.containers  # it ran all along
    assert not forgotten
    assert given != str(pinned)
    assert env.engine.state.assignments[key].cpus == pinned
    assert_consistent(env)


async def test_a_pod_another_client_made_before_a_restart_is_forgotten_once_gone(
    env: Env,
) -> None:
    """Start-up learns another client's pod from the runtime too: once that client removes
    it on the runtime's socket, a sweep forgets it."""
    pod = outside_pod(env, "before-restart")
    outsider = made_outside(env, pod, "main", 1000)
    await env.restart()
    assert pod.sandbox_id in env.engine.pods
    await remove_outside(env, pod.sandbox_id)
    await env.engine.container_exited(outsider)  # its exit seen (pidfd / full look)
    await sweep(env.engine)
    assert pod.sandbox_id not in env.engine.pods
    assert outsider not in env.engine.containers


async def remove_container_outside(env: Env, container_id: str) -> None:
    """Another CRI client stops and removes a container on the runtime's own socket."""
    await on_runtime(
        env,
        ("StopContainer", pb.StopContainerRequest(container_id=container_id)),
        ("RemoveContainer", pb.RemoveContainerRequest(container_id=container_id)),
    )


async def test_a_container_another_client_removed_is_forgotten(env: Env) -> None:
    """crictl pointed at containerd's socket removes a pinned container, its pod staying:
    no StopContainer or RemoveContainer passed through cpushim, and no exit was seen (a
    full look would see it exited and keep it tracked until its pod went). The sweep finds
    it gone: it is forgotten and its CPU goes back."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned = await env.kubelet.start_new(pod, "main", 1000)
    kept = await env.kubelet.start_new(pod, "sidecar", 1000)
    await remove_container_outside(env, pinned)
    await sweep(env.engine)
    assert pinned not in env.engine.containers
    assert ContainerKey(pod.uid, "main") not in env.engine.state.assignments
    assert kept in env.engine.containers
    assert env.engine.counters["removed_containers_found"] == 1
    await env.engine.checkpoint_written()
    assert list(env.saved()[pod.uid]) == ["sidecar"]
    # Its CPU is free again: a new container of another pod gets it.
    other = await env.kubelet.run_pod("web", "guaranteed")
    assert await env.kubelet.start_new(other, "main", 1000)
    assert_consistent(env)


async def test_a_container_start_up_could_not_read_and_another_client_removed_frees_its_cpu(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinned, then cpushim restarts while the runtime cannot say what it is: its CPU stays
    held, untracked. Removed on the runtime without cpushim meanwhile, the sweep finds it
    gone from the listing and gives its CPU back, rather than keeping it held until its pod
    goes."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned = await env.kubelet.start_new(pod, "main", 1000)
    kept = await env.kubelet.start_new(pod, "sidecar", 1000)
    failing = unreadable(env, monkeypatch, Status.UNAVAILABLE)
    failing.add(pinned)
    await env.restart()
    key = ContainerKey(pod.uid, "main")
    assert pinned not in env.engine.containers
    assert str(env.engine.state.assignments[key].cpus) == FIRST_SINGLE
    await remove_container_outside(env, pinned)
    await sweep(env.engine)
    assert key not in env.engine.state.assignments
    assert kept in env.engine.containers
    assert env.engine.counters["removed_containers_found"] == 1
    assert CPUSet.parse(FIRST_SINGLE).issubset(env.engine.state.shared)
    assert_consistent(env)


async def test_an_exited_container_another_client_removed_is_forgotten(env: Env) -> None:
    pod = await env.kubelet.run_pod("job", "besteffort")
    done = await env.kubelet.start_new(pod, "main")
    env.fake.exit_container(done)
    await env.engine.container_exited(done)
    assert done in env.engine.containers  # kept until kubelet removes it
    await remove_container_outside(env, done)
    await sweep(env.engine)
    assert done not in env.engine.containers
    assert env.engine.counters["removed_containers_found"] == 1


async def test_a_container_created_after_the_listing_is_not_forgotten(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime's list was made before kubelet's create of a container reached it: the
    sweep gets the list afterwards, and must not take the new container for a removed one."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    real = env.engine.runtime.unary
    listed, go_on = asyncio.Event(), asyncio.Event()

    async def unary(call: UnaryCall, *args: Any, **kwargs: Any) -> Reply:
        reply = await real(call, *args, **kwargs)
        if call.path == rq.LIST_CONTAINERS and not listed.is_set():
            listed.set()  # the answer is made; it reaches the sweep late
            await go_on.wait()
        return reply

    monkeypatch.setattr(env.engine.runtime, "unary", unary)
    running = asyncio.create_task(sweep(env.engine))
    await listed.wait()
    created = await env.kubelet.start_new(pod, "main", 1000)
    go_on.set()
    await running
    assert created in env.engine.containers
    assert ContainerKey(pod.uid, "main") in env.engine.state.assignments
    assert env.engine.counters["removed_containers_found"] == 0
    assert_consistent(env)


async def test_a_slow_container_status_does_not_hold_back_creates(env: Env) -> None:
    """The sweep asks the runtime about each unknown container before it takes the engine
    lock: a runtime slow to answer (up to the call's 10 s timeout) delays no decision."""
    pod = await env.kubelet.run_pod("tools", "besteffort")
    outsider = made_outside(env, pod, "debug")
    gate = env.fake.gate("ContainerStatus")
    running = asyncio.create_task(sweep(env.engine))
    await until(lambda: bool(env.fake.calls_of("ContainerStatus")), "the sweep's question")
    env.fake.ungate("ContainerStatus")  # the sweep's call stays held
    db = await env.kubelet.run_pod("db", "guaranteed")
    pinned = await asyncio.wait_for(env.kubelet.start_new(db, "main", 1000), 2.0)
    assert env.cpus(pinned) == FIRST_SINGLE
    assert not running.done()
    gate.set()
    assert (await running).tracked == [outsider]
    assert env.cpus(outsider) == SHARED_AFTER_FIRST_SINGLE
    assert_consistent(env)


async def test_a_container_removed_while_the_sweep_waits_for_the_lock_is_forgotten_soon(
    watched: tuple[Env, Watcher],
) -> None:
    """The sweep asks about unknown containers before it takes the lock; one removed while
    it waits is taken in, and forgotten by the sweep that follows at once."""
    env, _ = watched
    pod = await env.kubelet.run_pod("tools", "besteffort")
    config = env.kubelet.create_request(pod, "debug").config
    config.linux.resources.cpuset_cpus = str(env.engine.state.shared)
    outsider = env.fake.add_container(pod.sandbox_id, config)
    await env.engine.lock.acquire()  # a decision under way
    running = asyncio.create_task(sweep(env.engine))
    await until(lambda: bool(env.fake.calls_of("ContainerStatus")), "the sweep's question")
    await remove_container_outside(env, outsider)
    env.engine.lock.release()
    await running
    assert outsider not in env.fake.containers
    # Taken in on what the runtime said before the lock; the sweep that follows at once
    # finds it gone.
    await until(lambda: outsider not in env.engine.containers, "the removed container forgotten")


async def test_an_attempt_left_created_beside_a_later_one_is_not_taken_in(env: Env) -> None:
    """kubelet went on to the next attempt when a create's answer was lost: the earlier one,
    left created, never runs, and gets no CPUs (as at start-up)."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    first = env.kubelet.create_request(pod, "main", 1000, attempt=0).config
    env.fake.add_container(pod.sandbox_id, first, state=pb.CONTAINER_CREATED)
    later = env.kubelet.create_request(pod, "main", 1000, attempt=1).config
    env.fake.add_container(pod.sandbox_id, later, state=pb.CONTAINER_EXITED)
    assert (await sweep(env.engine)).tracked == []
    assert env.engine.state.assignments == {}
    # Looked at once only.
    statuses = len(env.fake.calls_of("ContainerStatus"))
    await sweep(env.engine)
    assert len(env.fake.calls_of("ContainerStatus")) == statuses


async def test_a_container_that_ends_while_the_sweep_waits_for_the_lock_gives_its_cpus_back(
    with_cgroups: tuple[Env, Watcher],
) -> None:
    """A create whose answer was lost made its container; the sweep asks the runtime about
    it (running) before it takes the lock, and the container is stopped meanwhile (kubelet
    finds it by its labels, or it exits by itself) and its cgroup goes. Taken in on what the
    runtime said before, it holds the CPUs kept for it with no cgroup to watch: it is looked
    up at once, and its CPUs go back, not at the next full look (never, with no period)."""
    env, _ = with_cgroups
    env.engine.sweeper = None  # this test's sweep only
    pod = await env.kubelet.run_pod("db", "guaranteed")
    orphan = await create_with_reply_lost(env, pod, 1000)
    start = pb.StartContainerRequest(container_id=orphan).SerializeToString()
    await env.channel.unary(UnaryCall(rq.START_CONTAINER, (), start, 10.0))
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].container_id == ""
    await env.engine.lock.acquire()  # a decision under way
    running = asyncio.create_task(sweep(env.engine))
    await until(lambda: bool(env.fake.calls_of("ContainerStatus")), "the sweep's question")
    stop = pb.StopContainerRequest(container_id=orphan).SerializeToString()
    await env.channel.unary(UnaryCall(rq.STOP_CONTAINER, (), stop, 10.0))
    cgroup = env.fake.cgroup_dir(orphan)
    assert cgroup is not None
    assert not cgroup.exists()  # it went with the process
    env.engine.lock.release()
    await running
    await until(lambda: env.engine.state.assignments == {}, "its CPUs back", 2.0)
    assert env.engine.containers[orphan].phase.value == "exited"
    assert env.engine.counters["exits_seen"] == 1
    assert_consistent(env)


async def test_a_resize_down_that_makes_room_adopts_a_waiting_container_without_a_full_look(
    sharing: tuple[Env, Watcher],
) -> None:
    """A container left sharing for lack of room, resized in place to a count that fits,
    waited for a full look; with resyncPeriod 0 none comes."""
    env, watcher = sharing
    await env.kubelet.start_new(await env.kubelet.run_pod("a", "guaranteed"), "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = await left_waiting(env, watcher, pod, 2000)  # one CPU is left
    swept = len(env.fake.calls_of("ListContainers"))
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(outsider, 1000))
    key = ContainerKey(pod.uid, "main")
    await until(lambda: key in env.engine.state.assignments, "adopted at the count it fits")
    await until(lambda: watcher.jobs.pending == 0, "moved")
    assert len(CPUSet.parse(env.cpus(outsider))) == 1
    assert len(env.fake.calls_of("ListContainers")) == swept  # no sweep did it
    assert env.engine.counters["full_resyncs"] == 0
    assert_consistent(env)


@pytest.mark.parametrize("milli_cpu", [4000, 5500], ids=["fewer", "fraction"])
async def test_a_resize_down_of_another_container_adopts_a_waiting_one_without_a_full_look(
    sharing: tuple[Env, Watcher], milli_cpu: int
) -> None:
    """CPUs a pinned container gives back by an in-place resize are a release like a stop's:
    the container that waits for room is adopted then, not at a full look (with
    resyncPeriod 0 none comes)."""
    env, watcher = sharing
    holder = await env.kubelet.start_new(await env.kubelet.run_pod("a", "guaranteed"), "main", 6000)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    outsider = await left_waiting(env, watcher, pod, 2000)  # one CPU is left
    swept = len(env.fake.calls_of("ListContainers"))
    await env.kubelet.ok("UpdateContainerResources", kubelet_resize(holder, milli_cpu))
    key = ContainerKey(pod.uid, "main")
    await until(lambda: key in env.engine.state.assignments, "adopted once there is room")
    await until(lambda: watcher.jobs.pending == 0, "moved")
    assert len(CPUSet.parse(env.cpus(outsider))) == 2
    assert len(env.fake.calls_of("ListContainers")) == swept  # no sweep did it
    assert env.engine.counters["full_resyncs"] == 0
    assert_consistent(env)
