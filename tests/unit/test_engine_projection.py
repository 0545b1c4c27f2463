"""The engine keeps each container's projection directory equal to its cpuset: written before
the container is created and mounted into it, rewritten after each move, removed with the pod,
swept at start."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import shim.projection.writer as writer_module
from shim import cgroups
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Status, UnaryCall
from shim.engine import EngineOptions, ProjectionSettings
from shim.engine import requests as rq
from shim.engine.projecting import Cpuset, Projector
from shim.engine.watching import Watcher
from shim.policy.none import NonePolicy
from shim.projection import CPUS_FILE, STATE_FILE, Projection, read
from shim.projection.writer import ProjectionWriter
from shim.state import ContainerKey
from tests.fake_runtime import FakeRuntime
from tests.unit.engine_env import (
    ALL,
    FIRST_SINGLE,
    SHARED_AFTER_FIRST_SINGLE,
    Env,
    Pod,
    make_env,
    unreadable,
    until,
)
from tests.unit.test_projection import TOPOLOGY

MOUNT = Path("/run/cpushim")
NEVER = 3600.0


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        environment = await make_env(
            fake,
            tmp_path / "state",
            options=EngineOptions(record_delay=NEVER),
            projection=ProjectionSettings(tmp_path / "projection", MOUNT),
        )
        yield environment
        environment.channel.close()


@contextlib.asynccontextmanager
async def watched(
    tmp_path: Path, retry_delay: float = EngineOptions.retry_delay
) -> AsyncIterator[tuple[FakeRuntime, Env, Watcher]]:
    """The engine with projections and a watcher with no full looks (resyncPeriod 0)."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await make_env(
            fake,
            tmp_path / "state",
            options=EngineOptions(record_delay=NEVER, retry_delay=retry_delay),
            projection=ProjectionSettings(tmp_path / "projection", MOUNT),
        )
        watcher = Watcher(env.engine, resync_period=0)
        watcher.start()
        try:
            yield fake, env, watcher
        finally:
            await watcher.stop()
            await env.engine.drain(5.0)
            env.channel.close()


def root(env: Env) -> Path:
    assert env.engine.projection is not None
    return env.engine.projection.directory


def projected(env: Env, pod: Pod, name: str) -> Projection:
    return read(root(env) / pod.uid / name)


async def settled(env: Env) -> None:
    assert env.engine.projector is not None
    await env.engine.projector.settle()


def mounts_of(env: Env, container_id: str) -> list[pb.Mount]:
    return list(env.fake.containers[container_id].config.mounts)


@pytest.mark.anyio
async def test_a_shared_container_is_created_with_its_directory_mounted_read_only(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("web", "besteffort")
    container_id = await env.kubelet.start_new(pod, "main")
    (mount,) = mounts_of(env, container_id)
    assert mount.container_path == str(MOUNT)
    assert mount.host_path == str(root(env) / pod.uid / "main")
    assert mount.readonly
    assert mount.selinux_relabel
    state = projected(env, pod, "main")
    assert (state.cpus, state.pool, state.exclusive) == (str(ALL), "shared", False)
    assert (root(env) / pod.uid / "main" / "cpus").read_text() == f"{ALL}\n"


@pytest.mark.anyio
async def test_a_pinned_container_and_the_shared_ones_see_every_change(env: Env) -> None:
    shared_pod = await env.kubelet.run_pod("web", "besteffort")
    await env.kubelet.start_new(shared_pod, "main")
    before = projected(env, shared_pod, "main")

    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned_pod, "main", 1000)
    await settled(env)
    pinned = projected(env, pinned_pod, "main")
    assert (pinned.cpus, pinned.pool, pinned.exclusive) == (FIRST_SINGLE, "exclusive", True)
    assert pinned.mems == "0"
    assert pinned.numa_nodes == (0,)
    assert pinned.sockets == (0,)
    shrunk = projected(env, shared_pod, "main")
    assert shrunk.cpus == SHARED_AFTER_FIRST_SINGLE
    assert shrunk.generation == before.generation + 1

    await env.kubelet.stop(pinned_id)
    await settled(env)
    grown = projected(env, shared_pod, "main")
    assert grown.cpus == str(ALL)
    assert grown.generation == shrunk.generation + 1


@pytest.mark.anyio
async def test_a_shared_container_s_memory_nodes_are_those_kubelet_gave_it(env: Env) -> None:
    # kubelet's Static memory manager confines a Guaranteed container with a fraction of a
    # CPU too: it shares, and the runtime keeps the nodes kubelet named in its cgroup.
    pod = await env.kubelet.run_pod("web", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 500, mems="1")
    assert env.fake.containers[container_id].resources.cpuset_mems == "1"
    assert projected(env, pod, "main").mems == "1"

    # Moved off the CPUs a pinned container takes: the CPUs change, the nodes do not.
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pinned_pod, "main", 1000)
    await settled(env)
    moved = projected(env, pod, "main")
    assert (moved.cpus, moved.mems) == (SHARED_AFTER_FIRST_SINGLE, "1")
    assert env.fake.containers[container_id].resources.cpuset_mems == "1"

    # A restart learns them from the runtime's record.
    await env.restart()
    await settled(env)
    assert projected(env, pod, "main") == moved


@pytest.mark.anyio
async def test_a_container_that_lost_its_cpus_projects_the_nodes_it_got_back(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000, mems="1")
    await settled(env)
    assert projected(env, pod, "main").pool == "exclusive"

    await env.engine.change_policy(NonePolicy(env.engine.policy.topology))
    await settled(env)
    assert env.fake.containers[container_id].resources.cpuset_mems == "1"
    shared = projected(env, pod, "main")
    assert (shared.cpus, shared.pool, shared.mems) == (str(ALL), "shared", "1")


@pytest.mark.anyio
async def test_a_projection_is_written_only_after_the_cgroup_holds_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared_pod = await env.kubelet.run_pod("web", "besteffort")
    shared_id = await env.kubelet.start_new(shared_pod, "main")
    tracked = env.engine.containers[shared_id]
    await until(lambda: tracked.cgroup is not None, "the shared container's cgroup located")
    written_to_cgroup: list[str] = []
    real_write = cgroups.write_list

    def write_list(directory: Path, name: str, cpus: CPUSet) -> None:
        real_write(directory, name, cpus)
        if directory == tracked.cgroup and name == cgroups.CPUSET_CPUS:
            written_to_cgroup.append(str(cpus))

    monkeypatch.setattr(cgroups, "write_list", write_list)
    projected_then: list[tuple[str, list[str]]] = []

    def on_written(key: ContainerKey, generation: int) -> None:
        if key == tracked.key:
            cpus = projected(env, shared_pod, "main").cpus
            projected_then.append((cpus, list(written_to_cgroup)))

    assert env.engine.projector is not None
    env.engine.projector.on_written = on_written
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned_pod, "main", 1000)
    await env.kubelet.stop(pinned_id)
    await settled(env)
    assert written_to_cgroup == [SHARED_AFTER_FIRST_SINGLE, str(ALL)]
    assert projected_then, "no projection was written for the shared container"
    for cpus, cgroup_so_far in projected_then:
        # Each set the file named had reached the cgroup before the file was written.
        assert cpus in cgroup_so_far, (cpus, cgroup_so_far)
    assert projected_then[-1][0] == str(ALL)


@pytest.mark.anyio
async def test_a_name_that_is_not_a_safe_directory_name_is_refused(env: Env) -> None:
    pod = await env.kubelet.run_pod("web", "guaranteed")
    free_before = env.engine.state.shared
    for name in ("../escape", "a/b", ".hidden", "nul\x00"):
        reply = await env.kubelet.create(pod, name, 1000)
        assert reply.status is Status.INVALID_ARGUMENT, name
        assert "directory name" in reply.status_message
    assert env.fake.containers == {}
    assert env.engine.state.shared == free_before
    assert env.engine.state.assignments == {}
    assert sorted(p.name for p in root(env).parent.iterdir() if p.name == "escape") == []


@pytest.mark.anyio
async def test_removing_the_pod_removes_its_directory(env: Env) -> None:
    pod = await env.kubelet.run_pod("web", "besteffort")
    container_id = await env.kubelet.start_new(pod, "main")
    assert (root(env) / pod.uid / "main").is_dir()
    await env.kubelet.stop(container_id)
    await env.kubelet.remove(container_id)
    # The next attempt writes the same directory: it stays until the pod goes.
    assert (root(env) / pod.uid / "main").is_dir()
    await env.kubelet.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString(),
    )
    await env.kubelet.ok(
        "RemovePodSandbox",
        pb.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString(),
    )
    # Once kubelet has its reply.
    await until(lambda: not (root(env) / pod.uid).exists(), "the pod's directory removed")


@pytest.mark.anyio
async def test_a_pod_back_before_its_directory_went_keeps_it(env: Env) -> None:
    # A static pod: its next sandbox has the same UID, and may come at once.
    pod = await env.kubelet.run_pod("web", "besteffort")
    await env.kubelet.start_new(pod, "main")
    await env.kubelet.ok(
        "StopPodSandbox",
        pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString(),
    )
    request = pb.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString()
    # As the relay does: the runtime removes it, then the engine follows.
    removed = await env.kubelet.runtime.unary(UnaryCall(rq.REMOVE_POD_SANDBOX, (), request, 10))
    assert removed.status is Status.OK
    after = env.engine.followed_now(rq.REMOVE_POD_SANDBOX, request, Status.OK, b"")
    assert callable(after)
    # The next sandbox of the same pod, and its container, come before the removal's work
    # after the reply has run.
    again = await env.kubelet.run_pod("web", "besteffort", uid=pod.uid)
    container_id = await env.kubelet.start_new(again, "main")
    after()
    await env.engine.drain(5)
    assert (root(env) / pod.uid / "main").is_dir()
    assert env.engine.projector is not None
    assert env.engine.projector.written(env.engine.containers[container_id].key) is not None


@pytest.mark.anyio
async def test_a_restart_sweeps_stale_directories_and_carries_generations_on(env: Env) -> None:
    kept_pod = await env.kubelet.run_pod("web", "besteffort")
    await env.kubelet.start_new(kept_pod, "main")
    gone_pod = await env.kubelet.run_pod("old", "besteffort")
    gone_id = await env.kubelet.start_new(gone_pod, "main")
    before = projected(env, kept_pod, "main")
    # Removed directly on the runtime while cpushim is down.
    env.fake.containers.pop(gone_id)
    env.fake.sandboxes.pop(gone_pod.sandbox_id)
    await env.restart()
    await settled(env)
    assert not (root(env) / gone_pod.uid).exists()
    assert projected(env, kept_pod, "main") == before
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pinned_pod, "main", 1000)
    await settled(env)
    after = projected(env, kept_pod, "main")
    assert after.cpus == SHARED_AFTER_FIRST_SINGLE
    assert after.generation == before.generation + 1


@pytest.mark.anyio
async def test_a_restart_keeps_the_directory_of_an_exited_container_whose_pod_is_there(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("job", "besteffort")
    container_id = await env.kubelet.start_new(pod, "main")
    # Exited while cpushim was down (a crash loop's back-off, a finished Job); the pod stays.
    env.fake.exit_container(container_id, exit_code=1)
    before = projected(env, pod, "main")
    await env.restart()
    await settled(env)
    assert projected(env, pod, "main") == before
    # Its next attempt finds it: the same cpuset, so the same generation (a directory made
    # afresh would start again from the clock, above it).
    await env.kubelet.start_new(pod, "main", attempt=1)
    await settled(env)
    assert projected(env, pod, "main").generation == before.generation


@pytest.mark.anyio
async def test_a_restart_keeps_the_directory_of_a_container_whose_status_cannot_be_read(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up leaves such a container for a sweep; it may run with its directory mounted."""
    pod = await env.kubelet.run_pod("web", "besteffort")
    container_id = await env.kubelet.start_new(pod, "main")
    before = projected(env, pod, "main")
    unreadable(env, monkeypatch, Status.UNKNOWN).add(container_id)
    await env.restart()
    await settled(env)
    assert container_id not in env.engine.containers
    assert projected(env, pod, "main") == before


@pytest.mark.anyio
async def test_a_projection_that_cannot_be_written_costs_the_mount_not_the_container(
    tmp_path: Path,
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the projection root should be\n")
    async with FakeRuntime() as fake:
        env = await make_env(
            fake, tmp_path / "state", projection=ProjectionSettings(blocked, MOUNT)
        )
        try:
            pod = await env.kubelet.run_pod("web", "besteffort")
            container_id = await env.kubelet.start_new(pod, "main")
            assert mounts_of(env, container_id) == []
            assert env.engine.counters["projection_errors"] >= 1
            assert blocked.read_text().startswith("a file")
        finally:
            env.channel.close()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "path",
    # However it is written (the runtime cleans the path), and below it: a mount point there
    # would have to be made inside the read-only projection.
    [
        str(MOUNT),
        f"{MOUNT}/",
        "/run//cpushim",
        "/run/./cpushim",
        "//run/cpushim",
        "///run/cpushim",
        "run/cpushim",
        f"{MOUNT}/extra",
        f"/{MOUNT}/extra",
    ],
)
async def test_a_mount_kubelet_already_has_at_the_path_is_left_alone(env: Env, path: str) -> None:
    pod = await env.kubelet.run_pod("web", "besteffort")
    request = env.kubelet.create_request(pod, "main")
    own = pb.Mount(container_path=path, host_path="/srv/elsewhere")
    request.config.mounts.append(own)
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    assert mounts_of(env, container_id) == [own]


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/run", "/run/", "//run", "run", "/run/."])
async def test_a_read_only_volume_above_the_path_is_left_alone(
    env: Env, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A mount point made inside a read-only volume fails the container's start (runc:
    "read-only file system"): the container is created as kubelet asked, without the
    projection, and the log says why."""
    pod = await env.kubelet.run_pod("web", "besteffort")
    request = env.kubelet.create_request(pod, "main")
    own = pb.Mount(container_path=path, host_path="/srv/elsewhere", readonly=True)
    request.config.mounts.append(own)
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    assert mounts_of(env, container_id) == [own]
    assert any("read-only volume above" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
async def test_a_writable_volume_above_the_path_keeps_the_projection(env: Env) -> None:
    """The runtime makes the mount point in a writable volume (an emptyDir at /run)."""
    pod = await env.kubelet.run_pod("web", "besteffort")
    request = env.kubelet.create_request(pod, "main")
    own = pb.Mount(container_path="/run", host_path="/srv/elsewhere")
    request.config.mounts.append(own)
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    assert [m.container_path for m in mounts_of(env, container_id)] == ["/run", str(MOUNT)]


@pytest.mark.anyio
async def test_a_mount_beside_the_path_does_not_stop_the_projection(env: Env) -> None:
    pod = await env.kubelet.run_pod("web", "besteffort")
    request = env.kubelet.create_request(pod, "main")
    own = pb.Mount(container_path=f"{MOUNT}-data", host_path="/srv/elsewhere")
    request.config.mounts.append(own)
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    assert [m.container_path for m in mounts_of(env, container_id)] == [f"{MOUNT}-data", str(MOUNT)]


@pytest.mark.anyio
async def test_an_unexpected_failure_of_the_writer_costs_the_mount_not_the_container(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not an OSError nor a ValueError: a defect of the writer's own, which must not refuse a
    # create (nor end the retries of the directories behind it).
    assert env.engine.projector is not None

    async def broken(*args: Any) -> int:
        raise TypeError("a writer's defect")

    monkeypatch.setattr(env.engine.projector.writer, "write", broken)
    pod = await env.kubelet.run_pod("web", "besteffort")
    container_id = await env.kubelet.start_new(pod, "main")
    assert mounts_of(env, container_id) == []
    assert env.engine.counters["projection_errors"] == 1
    assert env.engine.counters["internal_errors"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("by", ["its retry", "the full look"])
async def test_a_projection_write_that_failed_is_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, by: str
) -> None:
    # The retry comes after 50 ms, or (for the full look) not within the test at all.
    retry_delay = 0.05 if by == "its retry" else NEVER
    async with watched(tmp_path, retry_delay) as (_, env, watcher):
        shared = await env.kubelet.run_pod("web", "besteffort")
        shared_id = await env.kubelet.start_new(shared, "main")
        assert projected(env, shared, "main").cpus == str(ALL)
        # The projection's tmpfs is full for a moment: the shared container's next
        # write fails, once.
        projector = env.engine.projector
        assert projector is not None
        real_write = projector.writer.write
        failed: list[str] = []

        async def write(pod_uid: str, name: str, *args: Any) -> int:
            if pod_uid == shared.uid and not failed:
                failed.append(name)
                raise OSError(errno.ENOSPC, "No space left on device")
            return await real_write(pod_uid, name, *args)

        monkeypatch.setattr(projector.writer, "write", write)
        pinned = await env.kubelet.run_pod("db", "guaranteed")
        with caplog.at_level("WARNING", logger="shim.engine.projecting"):
            await env.kubelet.start_new(pinned, "main", 1000)
            await until(lambda: bool(failed), "the failed write")
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        assert env.engine.counters["projection_errors"] == 1
        [told] = [r for r in caplog.records if "projection" in r.getMessage()]
        assert told.__dict__["fields"]["pod"] == "default/web"
        if by == "the full look":
            await watcher.look_everywhere()
        # Nothing moves any more, yet the directory stops naming CPU 4, which the pinned
        # container holds now.
        await until(
            lambda: projected(env, shared, "main").cpus == SHARED_AFTER_FIRST_SINGLE,
            "the shared container's directory rewritten",
        )
        await projector.settle()
        assert env.engine.counters["projection_errors"] == 1


@pytest.mark.anyio
async def test_a_repair_that_ends_after_its_pod_went_does_not_make_its_directory_again(
    tmp_path: Path,
) -> None:
    async with watched(tmp_path) as (fake, env, watcher):
        pod = await env.kubelet.run_pod("web", "besteffort")
        container_id = await env.kubelet.start_new(pod, "main")
        await until(lambda: container_id in watcher._containers, "the container watched")
        # A drift repair tells the runtime, and waits for its answer.
        held = fake.gate("UpdateContainerResources")
        cgroup = fake.cgroup_dir(container_id)
        assert cgroup is not None
        (cgroup / "cpuset.cpus").write_text("3\n")
        await until(
            lambda: len(fake.calls_of("UpdateContainerResources")) == 1, "the repair's update"
        )
        # Meanwhile the pod is removed on the runtime, behind cpushim's back, and a sweep
        # forgets it: its directory goes.
        fake.containers.pop(container_id)
        fake.sandboxes.pop(pod.sandbox_id)
        await env.engine.forget_sandbox_removed_behind(pod.sandbox_id)
        await until(lambda: not (root(env) / pod.uid).exists(), "the pod's directory gone")
        held.set()
        await until(lambda: watcher.jobs.pending == 0, "the repair done")
        assert env.engine.projector is not None
        await env.engine.projector.settle()
        assert not (root(env) / pod.uid).exists()


@pytest.mark.anyio
async def test_a_pod_forgotten_while_its_projection_is_written_is_forgotten_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write under way when the pod is removed recorded its cpuset as it ended, after
    the pod's entries were dropped: one entry kept for good per pod removed during a move,
    claiming a directory that is gone."""
    writer = ProjectionWriter(tmp_path / "projection", inline=False)  # writes in a thread
    projector = Projector(
        writer, TOPOLOGY, Path("/run/cpushim"), Counter(), asyncio.get_running_loop().create_task
    )
    key = ContainerKey("pod-1", "app")
    await projector.prepare(key, Cpuset(CPUSet.parse("0-7"), "", exclusive=False))
    under_way = asyncio.Event()
    write = writer.write

    async def write_and_tell(*args: Any) -> int:
        under_way.set()
        return await write(*args)

    monkeypatch.setattr(writer, "write", write_and_tell)
    projector.update(key, Cpuset(CPUSet.parse("0-3"), "", exclusive=False))  # a move
    await under_way.wait()
    await projector.forget_pod("pod-1")
    assert not (tmp_path / "projection" / "pod-1").exists()
    assert projector.written(key) is None


@pytest.mark.anyio
async def test_a_write_that_failed_half_way_is_not_taken_for_the_old_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that failed after ``cpus`` was renamed left the directory holding neither the
    old state nor the new one: a move back to the old cpuset must still write it, or ``cpus``
    names CPUs the container does not have, beside a ``cpuset.json`` that says otherwise."""
    writer = ProjectionWriter(tmp_path / "projection", inline=True)
    draining = asyncio.Event()
    projector = Projector(
        writer,
        TOPOLOGY,
        Path("/run/cpushim"),
        Counter(),
        asyncio.get_running_loop().create_task,
        draining=draining,
        retry_delay=NEVER,  # only the move back may mend it
    )
    key = ContainerKey("pod-1", "app")
    before = Cpuset(CPUSet.parse("0-7"), "", exclusive=False)
    assert await projector.prepare(key, before) is not None
    directory = tmp_path / "projection" / "pod-1" / "app"
    real_replace = writer_module._replace
    failed: list[str] = []

    def replace_but_not_the_state(dir_fd: int, name: str, data: bytes) -> None:
        if name == STATE_FILE and not failed:  # the tmpfs filled up after ``cpus``
            failed.append(name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_replace(dir_fd, name, data)

    monkeypatch.setattr(writer_module, "_replace", replace_but_not_the_state)
    try:
        projector.update(key, Cpuset(CPUSet.parse("0-3"), "", exclusive=False))  # a move
        await projector.settle()
        assert failed
        assert (directory / CPUS_FILE).read_text() == "0-3\n"
        projector.update(key, before)  # and back, before the retry came
        await projector.settle()
        assert (directory / CPUS_FILE).read_text() == "0-7\n"
        assert read(directory).cpus == "0-7"
    finally:
        draining.set()
        await projector.settle()
