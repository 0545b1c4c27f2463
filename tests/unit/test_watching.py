"""The watcher on a fake cgroup tree (a temp directory: inotify works there as on cgroupfs for
writes and deletions) and a fake containerd that writes and removes it as runc would."""

from __future__ import annotations

import asyncio
import errno
import os
import select
import shutil
import stat
import subprocess
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from grpclib.const import Status as GrpcStatus

import shim.checkpoint as checkpoint_module
from shim.cgroups import CgroupLayout, CgroupVersion, systemd_byte_reversed
from shim.checkpoint import (
    LOCK_FILE,
    CheckpointFile,
    StateDirectoryInUseError,
    fsync_directory,
    hold_directory,
)
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import UnaryCall
from shim.engine import EngineOptions, watching
from shim.engine import requests as rq
from shim.engine.moves import MoveResult
from shim.engine.tracked import Phase, Tracked
from shim.engine.watching import Coalescer, Look, Watcher, _look
from shim.fileio import identity, read_file
from shim.inotify import FILE_CHANGES, Event, WatchError
from shim.policy.static import StaticPolicy
from shim.state import ContainerKey, CPUState
from tests.fake_runtime import FakeRuntime
from tests.harness.containerd import CgroupDriver
from tests.harness.fifo import waiting_for_a_fifo_writer
from tests.harness.sysfs import MachineSpec, expected_topology
from tests.unit.engine_env import (
    FIRST_SINGLE,
    SHARED_AFTER_FIRST_SINGLE,
    Env,
    make_env,
    until,
    updates_to,
)

pytestmark = pytest.mark.anyio


@dataclass
class Watched:
    env: Env
    watcher: Watcher

    @property
    def counters(self) -> dict[str, int]:
        return self.env.engine.counters

    async def settled(self) -> None:
        """Every event seen so far has been handled."""
        await until(lambda: self.watcher.jobs.pending == 0, "watch jobs done")

    async def started(self, name: str, qos: str = "besteffort", milli_cpu: int = 0) -> str:
        pod = await self.env.kubelet.run_pod(name, qos)  # type: ignore[arg-type]
        container_id = await self.env.kubelet.start_new(pod, "main", milli_cpu)
        await until(lambda: container_id in self.watcher._containers, f"{name} watched", deadline=5)
        await self.settled()
        return container_id


async def watched_env(
    tmp_path: Path,
    fake: FakeRuntime,
    resync_period: float = 0.0,
    policy: StaticPolicy | None = None,
    retry_delay: float = EngineOptions.retry_delay,
) -> AsyncIterator[Watched]:
    options = EngineOptions(record_delay=3600, retry_delay=retry_delay)
    env = await make_env(fake, tmp_path / "state", policy, options=options)
    watcher = Watcher(env.engine, resync_period=resync_period)
    watcher.start()
    try:
        yield Watched(env, watcher)
    finally:
        await watcher.stop()
        await env.engine.drain(5.0)
        env.channel.close()


@pytest.fixture
async def w(tmp_path: Path) -> AsyncIterator[Watched]:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        async for watched in watched_env(tmp_path, fake):
            yield watched


def cpuset_file(env: Env, container_id: str) -> Path:
    directory = env.fake.cgroup_dir(container_id)
    assert directory is not None
    return directory / "cpuset.cpus"


# --- jobs ------------------------------------------------------------------------------------


async def test_a_job_asked_for_while_it_runs_runs_once_more_after() -> None:
    # What makes the last event count: its job may have read the file before the change.
    jobs = Coalescer(asyncio.get_running_loop().create_task)
    started: list[int] = []
    release = asyncio.Event()

    async def job() -> None:
        started.append(len(started))
        await release.wait()

    jobs.request("state", job)
    await until(lambda: started == [0], "the first run")
    for _ in range(3):  # a burst: one more run covers all of it
        jobs.request("state", job)
    release.set()
    await until(lambda: jobs.pending == 0, "the runs done")
    assert started == [0, 1]
    jobs.request("state", job)  # and a later request runs it again
    await until(lambda: jobs.pending == 0 and len(started) == 3, "run again")


async def test_a_failing_job_is_logged_and_runs_again_when_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    jobs = Coalescer(asyncio.get_running_loop().create_task)
    runs: list[str] = []

    async def failing() -> None:
        runs.append("ran")
        raise RuntimeError("a defect")

    for expected in (1, 2):
        jobs.request("state", failing)
        await until(lambda: jobs.pending == 0, "done")
        assert len(runs) == expected
    assert caplog.text.count("watch job failed") == 2


# --- drift -----------------------------------------------------------------------------------


async def test_a_cpuset_written_by_someone_else_is_written_back(w: Watched) -> None:
    shared_id = await w.started("web")
    cpuset_file(w.env, shared_id).write_text("3\n")

    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "cpuset restored")
    await w.settled()
    assert w.counters["drift_repairs"] == 1
    # Through the runtime too, so its record says the same.
    assert updates_to(w.env.fake, shared_id) == ["0-7"]


async def test_an_exclusive_containers_cpuset_is_written_back(w: Watched) -> None:
    pinned_id = await w.started("db", "guaranteed", 1000)
    cpuset_file(w.env, pinned_id).write_text("0-7\n")

    await until(lambda: w.env.kernel_cpus(pinned_id) == FIRST_SINGLE, "pinned cpuset restored")
    await w.settled()
    assert w.counters["drift_repairs"] == 1
    update = w.env.fake.calls_of("UpdateContainerResources")[-1]
    assert update.linux.cpuset_cpus == FIRST_SINGLE  # type: ignore[attr-defined]
    assert update.linux.cpu_quota == -1  # type: ignore[attr-defined]


async def watched16(
    tmp_path: Path, version: CgroupVersion, driver: CgroupDriver
) -> AsyncIterator[Watched]:
    """A watcher on 16 CPUs (2 sockets x 4 cores x 2 threads, CPU 0 reserved)."""
    sixteen = expected_topology(MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2))
    policy = StaticPolicy.create(sixteen, reserved=CPUSet.parse("0"))
    root = tmp_path / "cgroup"
    async with FakeRuntime(cgroup_root=root, cgroup_version=version, cgroup_driver=driver) as fake:
        async for watched in watched_env(tmp_path, fake, policy=policy):
            yield watched


@pytest.fixture(params=[2, 1], ids=["v2", "v1"])
async def w16(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Watched]:
    """``watched16`` with the systemd driver, on cgroup v2 (where systemd keeps units'
    cpusets) and on v1."""
    async for watched in watched16(tmp_path, CgroupVersion(request.param), "systemd"):
        yield watched


@pytest.fixture
async def w16_cgroupfs_v2(tmp_path: Path) -> AsyncIterator[Watched]:
    """``watched16`` on cgroup v2 with the cgroupfs driver: systemd holds no container's
    cpuset."""
    async for watched in watched16(tmp_path, CgroupVersion.V2, "cgroupfs"):
        yield watched


async def test_a_cpuset_systemd_got_byte_reversed_from_runc_is_told_to_the_runtime_once(
    w16: Watched,
) -> None:
    """With the systemd driver, a runc older than 1.1.6 hands systemd every set past CPU 7
    with its bytes reversed, and systemd writes that set into the cgroup whenever it applies
    the unit. The cgroup is put right each time; the runtime is told once per set (which
    mends systemd's copy after a runc upgrade), not at every repeat, since each update would
    hand systemd the same reversed mask. Only cgroup v2 units hold a cpuset in systemd."""
    w = w16
    v2 = w.env.engine.mover.layout is not None and (
        w.env.engine.mover.layout.version is CgroupVersion.V2
    )
    shared_id = await w.started("web")
    await w.started("db", "guaranteed", 1000)
    pool = CPUSet.parse(w.env.kernel_cpus(shared_id) or "")
    reversed_pool = systemd_byte_reversed(pool)
    assert reversed_pool != pool

    async def repaired(times: int) -> None:
        await until(lambda: w.counters["drift_repairs"] == times, "repaired")
        await w.settled()

    for repeat in range(1, 4):
        told = len(updates_to(w.env.fake, shared_id))
        cpuset_file(w.env, shared_id).write_text(f"{reversed_pool}\n")
        await repaired(repeat)
        assert w.env.kernel_cpus(shared_id) == str(pool)
        assert w.counters["byte_reversed_cpusets"] == (repeat if v2 else 0)
        expected = 1 if repeat == 1 or not v2 else 0
        assert updates_to(w.env.fake, shared_id)[told:] == [str(pool)] * expected
    # Any other foreign set still goes through the runtime.
    cpuset_file(w.env, shared_id).write_text("3\n")
    await repaired(4)
    assert updates_to(w.env.fake, shared_id)[-1] == str(pool)
    assert w.counters["byte_reversed_cpusets"] == (3 if v2 else 0)


async def moved_before_its_record(w: Watched) -> tuple[str, CPUSet]:
    """A shared container grown straight in its cgroup, the runtime not told yet (a shrink
    that systemd's copy would undo is told at once): its id and the cpuset the runtime's
    record (and systemd's copy) still holds."""
    shared_id = await w.started("web")
    await w.started("db-0", "guaranteed", 1000)
    pinned_id = await w.started("db-1", "guaranteed", 1000)
    tracked = w.env.engine.containers[shared_id]
    recorded = tracked.recorded
    assert recorded is not None
    await w.env.kubelet.stop(pinned_id)  # grows web; the runtime is told later
    assert tracked.recorded == recorded
    assert tracked.applied != recorded
    return shared_id, recorded


@pytest.mark.parametrize("runc", ["fixed", "before-1.1.6"])
async def test_systemd_applying_the_runtimes_record_from_before_a_move_is_not_someone_else(
    w16: Watched, runc: str
) -> None:
    """A shared container's grow is written straight into its cgroup and told to the
    runtime (and so to systemd, with the systemd driver) only after the record delay. A
    daemon-reload meanwhile has systemd write the set it holds into the cgroup: the one from
    before the grow, byte-reversed by an unfixed runc. It is put right like any other, but it
    is not someone else's write, and the alert for those must not fire."""
    w = w16
    layout = w.env.engine.mover.layout
    v2 = layout is not None and layout.version is CgroupVersion.V2
    shared_id, recorded = await moved_before_its_record(w)
    pool = CPUSet.parse(w.env.kernel_cpus(shared_id) or "")
    assert pool != recorded
    held = systemd_byte_reversed(recorded) if runc != "fixed" else recorded
    assert held not in (pool, systemd_byte_reversed(pool))

    cpuset_file(w.env, shared_id).write_text(f"{held}\n")  # systemd's daemon-reload
    await until(lambda: w.counters["drift_repairs"] == 1, "repaired")
    await w.settled()
    assert w.env.kernel_cpus(shared_id) == str(pool)
    assert updates_to(w.env.fake, shared_id)[-1] == str(pool)
    someone_else = (
        w.counters["drift_repairs"]
        - w.counters["byte_reversed_cpusets"]
        - w.counters["stale_records_reapplied"]
    )
    assert someone_else == (0 if v2 else 1)
    assert w.counters["byte_reversed_cpusets"] == (1 if v2 and runc != "fixed" else 0)


@pytest.mark.parametrize("runc", ["fixed", "before-1.1.6"])
async def test_the_runtimes_old_record_written_under_the_cgroupfs_driver_is_someone_elses(
    w16_cgroupfs_v2: Watched, runc: str
) -> None:
    """With the cgroupfs driver no unit holds the container's cpuset, so systemd cannot
    write the runtime's record (or its byte reversal) into the cgroup: whoever did is
    someone else, and the alert for those must see it."""
    w = w16_cgroupfs_v2
    shared_id, recorded = await moved_before_its_record(w)
    written = systemd_byte_reversed(recorded) if runc != "fixed" else recorded

    cpuset_file(w.env, shared_id).write_text(f"{written}\n")
    await until(lambda: w.counters["drift_repairs"] == 1, "repaired")
    await w.settled()
    assert w.counters["stale_records_reapplied"] == 0
    assert w.counters["byte_reversed_cpusets"] == 0


async def test_cpushims_own_moves_are_not_drift(w: Watched) -> None:
    shared_id = await w.started("web")
    for index in range(3):
        pinned_id = await w.started(f"db-{index}", "guaranteed", 1000)
        await w.env.kubelet.stop(pinned_id)
    await w.settled()
    assert w.env.kernel_cpus(shared_id) == "0-7"
    assert w.counters["drift_repairs"] == 0
    assert w.counters["cgroup_writes"] == 6


async def test_cpus_the_kernel_took_out_as_they_went_offline_are_not_fought_over(
    w: Watched, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under cgroup v1 the kernel takes a CPU going offline out of every cpuset that held
    it, and refuses it back (EINVAL) until it is online: written back, by cpushim and then
    through the runtime, it would fail both ways at every full look, and the move retry
    would try again every minute, for ever, one warning each."""
    cpu_dir = tmp_path / "sys" / "devices" / "system" / "cpu"
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "online").write_text("0-7\n")
    w.watcher.sysfs_root = tmp_path / "sys"
    w.env.engine.options = replace(w.env.engine.options, retry_delay=0.01)
    shared_id = await w.started("web")
    told = len(updates_to(w.env.fake, shared_id))
    mover = w.env.engine.mover
    write_tree = mover.write_tree

    def as_the_kernel(tracked: Tracked, name: str, values: CPUSet) -> None:
        online = CPUSet.parse((cpu_dir / "online").read_text())
        if not values.issubset(online):
            raise OSError(errno.EINVAL, "Invalid argument")
        write_tree(tracked, name, values)

    mover.write_tree = as_the_kernel  # type: ignore[method-assign]
    w.env.fake.fail_next(
        "UpdateContainerResources", GrpcStatus.UNKNOWN, "write cpuset.cpus: invalid argument", 50
    )
    (cpu_dir / "online").write_text("0-2,4-7\n")
    cpuset_file(w.env, shared_id).write_text("0-2,4-7\n")  # as the kernel does, unseen
    for _ in range(2):
        await w.watcher.look_everywhere()
        await w.settled()

    assert w.env.kernel_cpus(shared_id) == "0-2,4-7"
    assert w.counters["drift_repairs"] == 0
    assert len(updates_to(w.env.fake, shared_id)) == told
    assert not w.env.engine._move_retry.running
    assert w.counters["offline_cpus_dropped"] == 1
    assert caplog.text.count("went offline") == 1

    # Anything else written there is still someone else's, and written back.
    w.env.fake.clear_failures("UpdateContainerResources")
    cpuset_file(w.env, shared_id).write_text("1\n")
    await until(lambda: w.counters["drift_repairs"] == 1, "repaired")
    await w.settled()
    assert len(updates_to(w.env.fake, shared_id)) == told + 1
    assert w.counters["offline_cpus_dropped"] == 1


# --- exits -----------------------------------------------------------------------------------


async def test_an_exited_containers_cpus_go_back_and_the_shared_ones_grow(w: Watched) -> None:
    shared_id = await w.started("web")
    pinned_id = await w.started("db", "guaranteed", 1000)
    assert w.env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE

    w.env.fake.exit_container(pinned_id, exit_code=137)  # its cgroup goes, as runc's does

    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "shared container grown")
    assert w.env.engine.state.holding(pinned_id) is None
    assert w.env.saved() == {}
    assert w.counters["exits_seen"] == 1
    assert w.watcher.watched_containers == 1


async def test_a_crash_looping_container_gets_its_cpus_back(w: Watched) -> None:
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    first = await w.env.kubelet.start_new(pod, "main", 1000)
    await until(lambda: first in w.watcher._containers, "watched")
    w.env.fake.exit_container(first, exit_code=1)
    await until(lambda: w.env.engine.state.holding(first) is None, "released on exit")

    second = await w.env.kubelet.start_new(pod, "main", 1000, attempt=1)
    assert w.env.kernel_cpus(second) == FIRST_SINGLE
    assert w.env.engine.state.assignments[ContainerKey(pod.uid, "main")].container_id == second


async def test_a_v2_cgroup_that_empties_is_an_exit(tmp_path: Path) -> None:
    async with FakeRuntime(cgroup_root=tmp_path / "unified", cgroup_version=2) as fake:
        env = await make_env(fake, tmp_path / "state", options=EngineOptions(record_delay=3600))
        env.engine.mover.layout = CgroupLayout(CgroupVersion.V2, tmp_path / "unified")
        watcher = Watcher(env.engine, resync_period=0)
        watcher.start()
        pod = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(pod, "main", 1000)
        await until(lambda: pinned_id in watcher._containers, "watched")
        directory = fake.cgroup_dir(pinned_id)
        assert directory is not None
        events = directory / "cgroup.events"
        await until(lambda: watcher.jobs.pending == 0, "settled")
        assert env.engine.state.holding(pinned_id) is not None
        # cgroup.events changes in place on v2; the directory stays until the runtime removes it.
        events.write_text("populated 0\nfrozen 0\n")
        await until(lambda: env.engine.state.holding(pinned_id) is None, "released on empty")
        assert env.engine.counters["exits_seen"] == 1
        await watcher.stop()
        env.channel.close()


def test_a_look_tells_an_exit_from_a_v2_cgroup_without_a_cpuset(tmp_path: Path) -> None:
    cgroup = tmp_path / "cri-containerd-abc.scope"
    cgroup.mkdir()
    (cgroup / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    # No cpuset.cpus: the parent's cgroup.subtree_control does not enable the controller.
    assert _look(cgroup, v2=True) == Look(alive=True, no_cpuset=True)
    (cgroup / "cpuset.cpus").write_text("1\n")
    assert _look(cgroup, v2=True) == Look(alive=True, cpus=CPUSet.parse("1"))
    (cgroup / "cpuset.cpus").unlink()
    assert _look(cgroup, v2=False) == Look(alive=False)  # under v1 the file goes with it
    (cgroup / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    assert _look(cgroup, v2=True) == Look(alive=False)
    shutil.rmtree(cgroup)
    assert _look(cgroup, v2=True) == Look(alive=False)


@pytest.mark.parametrize(
    ("removed_at", "v2"),
    [("cgroup.events", True), ("cpuset.cpus", True), ("cpuset.cpus", False)],
)
def test_a_look_takes_a_cgroup_removed_between_open_and_read_for_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, removed_at: str, v2: bool
) -> None:
    """kernfs answers the read of a file whose cgroup was removed after the open with
    ENODEV; other errors say nothing of the container's end."""
    cgroup = tmp_path / "cri-containerd-abc.scope"
    cgroup.mkdir()
    (cgroup / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    (cgroup / "cpuset.cpus").write_text("1\n")
    failing = errno.ENODEV

    def failing_read(path: str | Path) -> bytes:
        if os.path.basename(path) == removed_at:
            raise OSError(failing, os.strerror(failing), str(path))
        return read_file(path)

    monkeypatch.setattr(watching, "read_file", failing_read)
    assert _look(cgroup, v2=v2) == Look(alive=False)
    failing = errno.EIO
    assert _look(cgroup, v2=v2).alive


async def test_a_running_container_whose_v2_cgroup_has_no_cpuset_keeps_its_cpus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Taken for an exit, its exclusive CPUs went back to the pool while it ran on."""
    async with FakeRuntime(cgroup_root=tmp_path / "unified", cgroup_version=2) as fake:
        async for w in watched_env(tmp_path, fake):
            w.env.engine.mover.layout = CgroupLayout(CgroupVersion.V2, tmp_path / "unified")
            pinned_id = await w.started("db", "guaranteed", 1000)
            cpuset_file(w.env, pinned_id).unlink()
            await w.watcher.check(pinned_id)
            await w.watcher.check(pinned_id)
            assert w.counters["exits_seen"] == 0
            assert w.env.engine.state.holding(pinned_id) is not None
            assert w.counters["cgroups_without_cpuset"] == 1  # warned once
            assert caplog.text.count("cpuset controller is not enabled") == 1
            assert w.counters["drift_repairs"] == 0


async def test_after_a_restart_a_v2_cgroup_without_a_cpuset_is_still_watched(
    tmp_path: Path,
) -> None:
    """Dropped at start-up, its container had no watch: an exit went unseen until the next
    full look, its exclusive CPUs held meanwhile."""
    async with FakeRuntime(cgroup_root=tmp_path / "unified", cgroup_version=2) as fake:
        async for w in watched_env(tmp_path, fake):
            w.env.engine.mover.layout = CgroupLayout(CgroupVersion.V2, tmp_path / "unified")
            pinned_id = await w.started("db", "guaranteed", 1000)
            cpuset_file(w.env, pinned_id).unlink()
            await restart_and_see_the_exit(w.env, pinned_id)


async def test_a_container_found_without_its_cgroup_at_start_up_is_looked_up(
    tmp_path: Path,
) -> None:
    """A container that ends between the start-up's ContainerStatus and its look for the
    cgroup is tracked as running with no cgroup: with nothing to watch, its CPUs waited for
    the first full look (never, with no period). The watcher's start looks it up."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        async for w in watched_env(tmp_path, fake):
            pinned_id = await w.started("db", "guaranteed", 1000)
            await restart_after_an_unseen_end(w.env, pinned_id)


async def restart_after_an_unseen_end(env: Env, pinned_id: str) -> None:
    engine = await env.restart()
    env.fake.exit_container(pinned_id)
    engine.containers[pinned_id].cgroup = None  # as the start-up leaves it if the cgroup went
    watcher = Watcher(engine, resync_period=0)
    watcher.start()
    try:
        await until(lambda: engine.state.holding(pinned_id) is None, "released")
        assert engine.counters["exits_seen"] == 1
    finally:
        await watcher.stop()


async def restart_and_see_the_exit(env: Env, pinned_id: str) -> None:
    engine = await env.restart()
    tracked = engine.containers[pinned_id]
    assert tracked.cgroup == cpuset_file(env, pinned_id).parent
    watcher = Watcher(engine, resync_period=0)
    watcher.start()
    try:
        await watcher.check(pinned_id)
        assert engine.counters["cgroups_without_cpuset"] == 1
        (tracked.cgroup / "cgroup.events").write_text("populated 0\nfrozen 0\n")
        await until(lambda: engine.state.holding(pinned_id) is None, "released")
    finally:
        await watcher.stop()


# --- the state file --------------------------------------------------------------------------


@pytest.mark.parametrize("removed", ["the directory", "its lock file"])
async def test_the_state_directory_made_again_is_held_again(w: Watched, removed: str) -> None:
    # Held on a file that is gone, the lock would let a second cpushim start on the new one.
    checkpoint = w.env.engine.checkpoint
    checkpoint.hold()
    try:
        if removed == "the directory":
            shutil.rmtree(w.env.state_dir)
        else:
            (w.env.state_dir / LOCK_FILE).unlink()
        await until(lambda: (w.env.state_dir / LOCK_FILE).exists(), "lock file made again")
        await w.settled()
        with pytest.raises(StateDirectoryInUseError):
            os.close(hold_directory(w.env.state_dir))
        assert (w.env.state_dir / "state.json").exists()
    finally:
        checkpoint.release()
    os.close(hold_directory(w.env.state_dir))  # released with the checkpoint


async def events_seen_up_to_now(watcher: Watcher, directory: Path, name: str) -> None:
    """Every event the kernel queued on ``directory`` before this call has been handed out
    (one made after them has: inotify keeps their order), and the jobs they asked for done."""
    seen: list[str] = []

    def on_event(event: Event) -> None:
        if event.name == name:
            seen.append(name)

    subscription = watcher.inotify.subscribe(str(directory), FILE_CHANGES, on_event)
    try:
        (directory / name).write_bytes(b"")
        await until(lambda: bool(seen), f"{name} seen")
    finally:
        watcher.inotify.unsubscribe(subscription)
        (directory / name).unlink()
    await until(lambda: watcher.jobs.pending == 0, "watch jobs done")


async def test_a_state_directory_another_process_took_meanwhile_is_told_of_once(
    w: Watched, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = w.env.engine.checkpoint
    checkpoint.hold()
    try:
        shutil.rmtree(w.env.state_dir)
        other = hold_directory(w.env.state_dir)  # before the loop runs the watcher
        try:
            await until(lambda: w.counters["watch_errors"] >= 1, "told")
            assert "another process holds the state directory" in caplog.text
            # Each try opens and closes the other's .lock: no try may ask for the next one.
            for look in range(3):
                await w.watcher.look_everywhere()
                await events_seen_up_to_now(w.watcher, w.env.state_dir, f"sentinel-{look}")
            assert w.counters["watch_errors"] == 1
        finally:
            os.close(other)
        # Once the other lets go, the next look takes it.
        await w.watcher.look_everywhere()
        with pytest.raises(StateDirectoryInUseError):
            os.close(hold_directory(w.env.state_dir))
    finally:
        checkpoint.release()


@pytest.mark.parametrize("first", ["the directory's watch", "the state file's rewrite"])
async def test_a_state_directory_made_again_is_made_durable_in_its_parent(
    w: Watched, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    synced: list[Path] = []

    def recording(directory: Path) -> None:
        synced.append(directory)
        fsync_directory(directory)

    monkeypatch.setattr(checkpoint_module, "fsync_directory", recording)
    if first == "the directory's watch":
        w.env.state_dir.rename(w.env.state_dir.with_name("moved-away"))
    else:
        # rm -rf: state.json's deletion asks for its rewrite before the directory's goes.
        checkpoint = w.env.engine.checkpoint

        async def inline_save(state: CPUState) -> None:
            checkpoint.save_sync(state)

        monkeypatch.setattr(checkpoint, "save", inline_save)
        shutil.rmtree(w.env.state_dir)
        await w.watcher.check_state()
    await until(lambda: (w.env.state_dir / "state.json").exists(), "state made again")
    await w.settled()
    assert w.env.state_dir.parent in synced


async def test_a_lock_file_renamed_over_the_held_one_is_taken_again(w: Watched) -> None:
    checkpoint = w.env.engine.checkpoint
    checkpoint.hold()
    try:
        fresh = w.env.state_dir / ".lock.new"
        fresh.write_bytes(b"")
        os.replace(fresh, w.env.state_dir / LOCK_FILE)
        await events_seen_up_to_now(w.watcher, w.env.state_dir, "sentinel")
        with pytest.raises(StateDirectoryInUseError):
            os.close(hold_directory(w.env.state_dir))
    finally:
        checkpoint.release()


async def test_a_lock_another_process_lets_go_is_taken_without_a_full_look(w: Watched) -> None:
    w.env.engine.options = replace(w.env.engine.options, retry_delay=0.01)
    checkpoint = w.env.engine.checkpoint
    checkpoint.hold()
    try:
        (w.env.state_dir / LOCK_FILE).unlink()
        other = hold_directory(w.env.state_dir)  # before the loop runs the watcher
        try:
            await until(lambda: w.counters["watch_errors"] == 1, "told")
        finally:
            os.close(other)  # the other process ends
        await until(lambda: not w.watcher._state_retry.running, "taken by a later try")
        with pytest.raises(StateDirectoryInUseError):
            os.close(hold_directory(w.env.state_dir))
        assert w.counters["full_resyncs"] == 0
    finally:
        checkpoint.release()


async def test_a_state_directory_made_again_while_another_holds_it_is_watched(
    w: Watched,
) -> None:
    # The lock still held on the old .lock keeps the removed directory from going: no event
    # says it went, and the watch must move to the directory there now all the same.
    checkpoint = w.env.engine.checkpoint
    checkpoint.hold()
    try:
        shutil.rmtree(w.env.state_dir)
        other = hold_directory(w.env.state_dir)
        try:
            await until(lambda: w.counters["watch_errors"] >= 1, "told")
            await until(
                lambda: w.watcher._state_identity == identity(w.env.state_dir),
                "the directory there now watched",
            )
            await until(lambda: (w.env.state_dir / "state.json").exists(), "state rewritten")
            await w.settled()
            (w.env.state_dir / "state.json").write_bytes(b"{not json")
            await until(lambda: w.counters["state_rewrites"] >= 2, "its state file watched")
        finally:
            os.close(other)
    finally:
        checkpoint.release()


async def test_a_state_directory_that_could_not_be_made_again_is_made_later_without_a_look(
    retrying: Watched,
) -> None:
    """Removed, and something stood in its way for a while (a file where it was, a
    read-only file system): with resyncPeriod 0 no full look would make it again, watch it,
    and take its lock, and state.json would go unguarded and a second cpushim could start."""
    w = retrying
    state_dir = w.env.state_dir
    checkpoint = w.env.engine.checkpoint
    checkpoint.hold()
    try:
        shutil.rmtree(state_dir)
        state_dir.write_text("not a directory\n")  # before the loop runs the watcher
        try:
            await until(lambda: w.counters["watch_errors"] >= 2, "made and locked in vain, twice")
        finally:
            state_dir.unlink()
        await until(lambda: (state_dir / "state.json").exists(), "made again, state rewritten")
        await until(lambda: not w.watcher._state_retry.running, "the retry ended")
        with pytest.raises(StateDirectoryInUseError):
            os.close(hold_directory(state_dir))
        await w.settled()
        (state_dir / "state.json").unlink()
        await until(lambda: (state_dir / "state.json").exists(), "watched: rewritten again")
        assert w.counters["full_resyncs"] == 0
    finally:
        checkpoint.release()


async def test_a_state_directory_lock_that_could_not_be_taken_again_is_taken_later(
    retrying: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taking the lock again failed (EACCES, a full disk refusing the new .lock): with
    resyncPeriod 0 nothing would try again."""
    w = retrying
    checkpoint = w.env.engine.checkpoint
    checkpoint.hold()
    try:
        hold_again = checkpoint.hold_again
        failures = 2

        def failing() -> bool:
            nonlocal failures
            if failures:
                failures -= 1
                raise PermissionError(errno.EACCES, "permission denied")
            return hold_again()

        monkeypatch.setattr(checkpoint, "hold_again", failing)
        (w.env.state_dir / LOCK_FILE).unlink()
        await until(lambda: failures == 0, "refused twice")
        await until(lambda: not w.watcher._state_retry.running, "taken by a later try")
        with pytest.raises(StateDirectoryInUseError):
            os.close(hold_directory(w.env.state_dir))
        assert w.counters["full_resyncs"] == 0
    finally:
        checkpoint.release()


async def test_a_state_directory_the_kernel_would_not_watch_is_watched_later(
    retrying: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = retrying
    state_dir = w.env.state_dir
    kernel = OutOfWatches(w.watcher, state_dir, monkeypatch)
    shutil.rmtree(state_dir)
    await until(lambda: kernel.refused >= 2, "refused, and tried again")
    assert w.watcher._state_watch is None
    kernel.full = False
    await until(lambda: w.watcher._state_watch is not None, "watched at last")
    await until(lambda: not w.watcher._state_retry.running, "the retry ended")
    await w.settled()
    (state_dir / "state.json").unlink()
    await until(lambda: (state_dir / "state.json").exists(), "watched: rewritten")
    assert w.counters["full_resyncs"] == 0


async def test_a_stopped_watcher_tries_the_state_directory_no_more(w: Watched) -> None:
    state_dir = w.env.state_dir
    shutil.rmtree(state_dir)
    state_dir.write_text("not a directory\n")  # before the loop runs the watcher
    try:
        await until(lambda: w.watcher._state_retry.running, "a retry")
        errors = w.counters["watch_errors"]
        await w.watcher.stop()
        assert not w.watcher._state_retry.running
    finally:
        state_dir.unlink()
    assert w.counters["watch_errors"] == errors
    assert not state_dir.exists()


async def test_a_deleted_state_file_is_rewritten(w: Watched) -> None:
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    await w.env.kubelet.start_new(pod, "main", 1000)
    before = w.env.saved()
    (w.env.state_dir / "state.json").unlink()

    await until(lambda: (w.env.state_dir / "state.json").exists(), "state rewritten")
    assert w.env.saved() == before
    assert w.counters["state_rewrites"] == 1


def refuse_first_save(
    checkpoint: CheckpointFile, monkeypatch: pytest.MonkeyPatch
) -> list[CPUState]:
    """Make the checkpoint's next save fail (ENOSPC) and the ones after go through; the
    returned list gets the state it refused."""
    real_save = checkpoint.save
    refused: list[CPUState] = []

    async def refuse_once(state: CPUState) -> None:
        if not refused:
            refused.append(state)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        await real_save(state)

    monkeypatch.setattr(checkpoint, "save", refuse_once)
    return refused


async def test_a_state_file_whose_rewrite_failed_is_rewritten_later(
    w: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No event follows a rewrite that failed: only the retry puts memory back on the disk."""
    w.env.engine.options = replace(w.env.engine.options, retry_delay=0.01)
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    await w.env.kubelet.start_new(pod, "main", 1000)
    await w.settled()
    before = w.env.saved()
    checkpoint = w.env.engine.checkpoint
    refused = refuse_first_save(checkpoint, monkeypatch)
    (w.env.state_dir / "state.json").unlink()

    await until(lambda: (w.env.state_dir / "state.json").exists(), "state rewritten")
    assert refused
    assert w.env.saved() == before
    assert w.counters["checkpoint_errors"] == 1
    assert checkpoint.on_disk() == checkpoint.last_written


async def test_a_state_file_rewrite_that_succeeds_ends_the_retry_of_one_that_failed(
    w: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = w.env.engine
    engine.options = replace(engine.options, retry_delay=3600.0)
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    await w.env.kubelet.start_new(pod, "main", 1000)
    await w.settled()
    checkpoint = engine.checkpoint
    refuse_first_save(checkpoint, monkeypatch)
    (w.env.state_dir / "state.json").unlink()
    await until(lambda: w.counters["checkpoint_errors"] == 1, "the rewrite refused")
    assert engine._save_retry.running
    # Someone writes the file again: the watcher's rewrite of it succeeds.
    (w.env.state_dir / "state.json").write_bytes(b"{not json")
    await until(lambda: w.counters["state_rewrites"] == 2, "the state file rewritten")
    await w.settled()
    assert checkpoint.on_disk() == checkpoint.last_written
    assert not engine._save_retry.running


async def test_a_fifo_renamed_over_the_state_file_is_replaced_without_blocking(
    w: Watched,
) -> None:
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    await w.env.kubelet.start_new(pod, "main", 1000)
    path = w.env.state_dir / "state.json"
    good = path.read_bytes()
    fifo = w.env.state_dir.parent / "fifo"
    os.mkfifo(fifo)
    # The loop cannot tell it is blocked: a thread looks, and lets it go if it is.
    loop_thread, blocked, done = threading.get_native_id(), [], threading.Event()

    def guard() -> None:
        while not done.wait(0.005):
            if waiting_for_a_fifo_writer(loop_thread):
                blocked.append(True)
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    guarding = threading.Thread(target=guard)
    guarding.start()
    try:
        os.link(fifo, w.env.state_dir / "by-hand")
        os.replace(w.env.state_dir / "by-hand", path)
        await until(lambda: stat.S_ISREG(os.lstat(path).st_mode), "state.json rewritten")
    finally:
        done.set()
        guarding.join()
    assert path.read_bytes() == good
    assert not blocked, "the event loop waited for a writer of a FIFO at state.json"


@pytest.mark.parametrize("how", ["truncate", "write through an open descriptor"])
async def test_a_state_file_changed_without_a_close_is_rewritten(w: Watched, how: str) -> None:
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    await w.env.kubelet.start_new(pod, "main", 1000)
    path = w.env.state_dir / "state.json"
    good = path.read_bytes()
    held = os.open(path, os.O_WRONLY)
    try:
        if how == "truncate":
            os.truncate(path, 0)
        else:
            os.write(held, b"{not json")
        await until(lambda: path.read_bytes() == good, "state rewritten")
    finally:
        os.close(held)
    await w.settled()
    assert w.counters["state_rewrites"] == 1


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"version": 1}'])
async def test_an_edited_state_file_is_rewritten(w: Watched, content: bytes) -> None:
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    await w.env.kubelet.start_new(pod, "main", 1000)
    path = w.env.state_dir / "state.json"
    good = path.read_bytes()
    path.write_bytes(content)

    await until(lambda: path.read_bytes() == good, "state rewritten")
    await w.settled()
    assert w.counters["state_rewrites"] >= 1


async def test_a_replaced_state_file_is_rewritten(w: Watched) -> None:
    path = w.env.state_dir / "state.json"
    good = path.read_bytes()
    other = w.env.state_dir / "other.json"
    other.write_bytes(b'{"version": 1, "body": {}}')
    other.rename(path)

    await until(lambda: path.read_bytes() == good, "state rewritten")


async def test_a_deleted_state_directory_is_made_again(w: Watched) -> None:
    shutil.rmtree(w.env.state_dir)
    await until(lambda: (w.env.state_dir / "state.json").exists(), "state rewritten")
    # And watched again: a later deletion is seen too.
    await w.settled()
    (w.env.state_dir / "state.json").unlink()
    await until(lambda: (w.env.state_dir / "state.json").exists(), "state rewritten again")


async def test_a_state_directory_moved_away_is_made_again_and_watched(w: Watched) -> None:
    state_dir = w.env.state_dir
    state_dir.rename(state_dir.with_name("state.old"))
    await until(lambda: (state_dir / "state.json").exists(), "state rewritten")
    # The kernel's watch followed the old directory; the new one is watched too.
    await w.settled()
    (state_dir / "state.json").unlink()
    await until(lambda: (state_dir / "state.json").exists(), "state rewritten again")


async def test_cpushims_own_state_writes_are_not_rewritten(w: Watched) -> None:
    for index in range(3):
        pod = await w.env.kubelet.run_pod(f"db-{index}", "guaranteed")
        await w.env.kubelet.start_new(pod, "main", 1000)
    await w.settled()
    assert w.counters["state_rewrites"] == 0


async def test_a_write_whose_directory_fsync_failed_is_not_taken_for_someone_elses(
    w: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new file is renamed into place before the directory's fsync fails: it is
    cpushim's own, so the failure is counted as a checkpoint error, not as a state edited
    by someone else to be rewritten (which would fail the same way, and go round)."""
    engine = w.env.engine
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    container_id = await w.env.kubelet.start_new(pod, "main", 1000)
    await w.settled()
    real_sync = checkpoint_module.fsync_directory
    failed: list[Path] = []

    def sync_fails(directory: Path) -> None:
        if not failed:
            failed.append(directory)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_sync(directory)

    real_check = w.watcher.check_state
    checks = 0

    async def counted() -> None:
        nonlocal checks
        await real_check()
        checks += 1

    w.watcher.check_state = counted  # type: ignore[method-assign]
    monkeypatch.setattr(checkpoint_module, "fsync_directory", sync_fails)
    await w.env.kubelet.stop(container_id)  # its CPUs released: a checkpoint write
    assert failed == [w.env.state_dir]
    assert not engine.state.assignments
    await until(lambda: checks >= 1 and w.watcher.jobs.pending == 0, "the rename looked at")
    assert w.counters["checkpoint_errors"] == 1
    assert w.counters["state_rewrites"] == 0
    assert engine.checkpoint.on_disk() == engine.checkpoint.last_written
    assert engine.checkpoint.saved == engine.state


# --- lost events -----------------------------------------------------------------------------


async def test_an_overflow_leads_to_one_full_look(w: Watched) -> None:
    shared_id = await w.started("web")
    # Events lost: the watch is gone when the drift happens.
    w.watcher.unwatch(shared_id)
    cpuset_file(w.env, shared_id).write_text("2\n")

    w.watcher._overflowed()
    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "repaired by the full look")
    await w.settled()
    assert w.counters["inotify_overflows"] == 1
    assert w.counters["full_resyncs"] == 1
    assert shared_id in w.watcher._containers  # watched again


async def test_a_state_directory_removed_while_events_were_lost_is_watched_again(
    w: Watched,
) -> None:
    """The queue overflowed with the directory's own events in it (its removal, and the
    kernel's IN_IGNORED for the watch): the watch was left on the removed directory."""
    loop = asyncio.get_running_loop()
    descriptor = w.watcher.inotify._manager.get_fd()
    loop.remove_reader(descriptor)  # the events queue up unread...
    shutil.rmtree(w.env.state_dir)
    while select.select([descriptor], [], [], 0)[0]:
        os.read(descriptor, 65536)  # ...and are lost, as in an overflow
    loop.add_reader(descriptor, w.watcher.inotify._read)
    w.watcher._overflowed()
    await until(lambda: (w.env.state_dir / "state.json").exists(), "rewritten by the full look")
    await w.settled()

    (w.env.state_dir / "state.json").unlink()
    await until(lambda: (w.env.state_dir / "state.json").exists(), "a later removal seen")
    assert w.counters["full_resyncs"] == 1


async def test_a_check_asked_for_after_the_stop_is_not_made(w: Watched) -> None:
    """Work still finishing at shutdown (the CPU follower's give-back) may ask for checks:
    a stopped watcher makes none: what they would repair or release is the next start's."""
    shared_id = await w.started("web")
    w.watcher.check_soon(shared_id)
    assert w.watcher.jobs.pending == 1
    await w.settled()
    await w.watcher.stop()
    w.watcher.check_soon(shared_id)
    assert w.watcher.jobs.pending == 0


async def test_a_repair_refused_both_ways_is_tried_again(w: Watched) -> None:
    w.env.engine.options = replace(w.env.engine.options, retry_delay=0.01)
    shared_id = await w.started("web")
    mover = w.env.engine.mover
    write_tree = mover.write_tree
    refused: list[CPUSet] = []

    def refuse_once(tracked: Tracked, name: str, values: CPUSet) -> None:
        if not refused:
            refused.append(values)
            raise OSError(errno.EBUSY, "Device or resource busy")
        write_tree(tracked, name, values)

    mover.write_tree = refuse_once  # type: ignore[method-assign]
    w.env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE, "busy")
    cpuset_file(w.env, shared_id).write_text("3\n")
    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "repaired by a retry")
    assert refused == [CPUSet.parse("0-7")]
    assert w.counters["drift_repairs"] == 1


async def test_repairs_send_a_bounded_number_of_updates_at_once(
    w: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    # systemd's daemon-reload writes every container's cpuset at once; each repair's update
    # forks a runc, and a node's worth at once is a fork storm.
    limit = w.env.engine.options.update_concurrency
    ids = [await w.started(f"web-{n}") for n in range(limit + 2)]
    in_flight: list[str] = []
    peak = 0
    done = asyncio.Event()

    async def held_update(tracked: Tracked, *args: object, **kwargs: object) -> MoveResult:
        nonlocal peak
        in_flight.append(tracked.id)
        peak = max(peak, len(in_flight))
        await done.wait()
        in_flight.remove(tracked.id)
        return MoveResult(ok=True)

    monkeypatch.setattr(w.env.engine.mover, "update_locked", held_update)
    for container_id in ids:
        cpuset_file(w.env, container_id).write_text("2\n")
    # Each repair goes from its count to its update without a pause.
    await until(lambda: w.counters["drift_repairs"] == len(ids), "every repair under way")
    assert (peak, len(in_flight)) == (limit, limit)
    done.set()
    await until(lambda: not in_flight and peak == limit, "every update sent")
    await w.settled()
    assert all(w.env.kernel_cpus(container_id) == "0-7" for container_id in ids)


@pytest.mark.parametrize("failing", ["the sweep", "another container's look"])
async def test_a_failing_part_of_the_full_look_leaves_the_rest_done(
    w: Watched, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    # The full look is the safety net for lost events: a defect in one of its parts must not
    # end it before the drift it is there for is repaired.
    first_id = await w.started("first")
    shared_id = await w.started("web")
    w.watcher.unwatch(shared_id)  # its events lost
    cpuset_file(w.env, shared_id).write_text("2\n")

    async def broken(*args: object) -> None:
        raise RuntimeError("a defect")

    if failing == "the sweep":
        monkeypatch.setattr(watching, "sweep", broken)
    else:
        look_at = w.watcher._look_at

        async def broken_for_the_first(tracked: Tracked) -> None:
            if tracked.id == first_id:
                await broken()
            await look_at(tracked)

        monkeypatch.setattr(w.watcher, "_look_at", broken_for_the_first)
    await w.watcher.look_everywhere()
    assert w.env.kernel_cpus(shared_id) == "0-7"
    assert shared_id in w.watcher._containers
    assert w.counters["internal_errors"] == 1


async def test_a_full_look_moves_a_container_whose_move_the_runtime_refused(w: Watched) -> None:
    env = w.env
    env.engine.options = replace(env.engine.options, retry_delay=3600)  # no retry soon
    kubelet = env.kubelet
    reply = await kubelet.create(await kubelet.run_pod("web", "besteffort"), "main")
    shared_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    # Created, not started: its move goes through the runtime, which refuses it.
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE, "busy")
    pinned_id = await kubelet.start_new(await kubelet.run_pod("db", "guaranteed"), "main", 1000)
    await kubelet.ok(
        "StartContainer", pb.StartContainerRequest(container_id=shared_id).SerializeToString()
    )
    await until(lambda: shared_id in w.watcher._containers, "watched")
    await w.settled()
    # Its cgroup equals what was applied, so no watch sees anything wrong.
    assert env.kernel_cpus(shared_id) == "0-7"

    await w.watcher.look_everywhere()
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert env.kernel_cpus(pinned_id) == FIRST_SINGLE


async def test_a_watch_that_cannot_be_placed_leads_to_a_full_look(w: Watched) -> None:
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await w.env.kubelet.start_new(pod, "main", 1000)
    await until(lambda: pinned_id in w.watcher._containers, "watched")
    tracked = w.env.engine.containers[pinned_id]
    w.watcher.unwatch(pinned_id)
    # The process exits and its cgroup goes before the watch is placed.
    w.env.fake.exit_container(pinned_id)
    w.watcher.watch(tracked)

    await until(lambda: w.env.engine.state.holding(pinned_id) is None, "released")
    assert w.counters["watch_errors"] == 1


async def test_a_full_look_that_cannot_place_a_watch_starts_no_other(
    w: Watched, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shared_id = await w.started("web")
    cgroup = w.env.engine.containers[shared_id].cgroup
    assert cgroup is not None
    w.watcher.unwatch(shared_id)
    subscribe = w.watcher.inotify.subscribe

    def out_of_watches(path: str, mask: int, callback: Any) -> Any:
        if path.startswith(str(cgroup.parent)):
            raise WatchError(errno.ENOSPC, "no space left on device", path)
        return subscribe(path, mask, callback)

    monkeypatch.setattr(w.watcher.inotify, "subscribe", out_of_watches)
    await w.watcher.look_everywhere()
    await w.settled()
    assert w.counters["watch_errors"] == 1
    # Another look at once would fail the same way (the kernel is out of watches), and so on.
    assert w.counters["full_resyncs"] == 1
    assert "cannot watch a container's cgroup; tried again later" in caplog.text
    assert "looking at everything once" not in caplog.text

    monkeypatch.setattr(w.watcher.inotify, "subscribe", subscribe)
    await w.watcher.look_everywhere()
    assert shared_id in w.watcher._containers


@pytest.fixture
async def retrying(tmp_path: Path) -> AsyncIterator[Watched]:
    """No periodic look (resyncPeriod 0), and retries 10 ms apart."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        async for watched in watched_env(tmp_path, fake, retry_delay=0.01):
            yield watched


class OutOfWatches:
    """The kernel refuses every watch under ``root`` while ``full`` is set, as when
    max_user_watches is reached; ``refused`` counts its refusals."""

    def __init__(
        self, watcher: Watcher, root: Path | None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert root is not None
        self.root = str(root)
        self.full = True
        self.refused = 0
        self._subscribe = watcher.inotify.subscribe
        monkeypatch.setattr(watcher.inotify, "subscribe", self)

    def __call__(self, path: str, mask: int, callback: Any) -> Any:
        if self.full and path.startswith(self.root):
            self.refused += 1
            raise WatchError(errno.ENOSPC, "no space left on device", path)
        return self._subscribe(path, mask, callback)


async def test_a_watch_a_full_look_could_not_place_is_placed_later_without_another_look(
    retrying: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With resyncPeriod 0 no other full look comes: the container would go without drift
    repair and exit detection for good."""
    w = retrying
    shared_id = await w.started("web")
    w.watcher.unwatch(shared_id)
    kernel = OutOfWatches(w.watcher, w.env.fake.cgroup_root, monkeypatch)
    await w.watcher.look_everywhere()
    assert shared_id not in w.watcher._containers
    await until(lambda: kernel.refused >= 2, "the watch tried again")
    kernel.full = False
    await until(lambda: shared_id in w.watcher._containers, "watched at last")
    await until(lambda: not w.watcher._watch_retry.running, "the retry ended")
    assert w.counters["full_resyncs"] == 1


async def test_a_container_the_kernel_will_not_watch_is_still_repaired_and_seen_to_exit(
    retrying: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = retrying
    pinned_id = await w.started("db", "guaranteed", 1000)
    w.watcher.unwatch(pinned_id)
    OutOfWatches(w.watcher, w.env.fake.cgroup_root, monkeypatch)
    await w.watcher.look_everywhere()
    cpuset_file(w.env, pinned_id).write_text("0-7\n")
    await until(lambda: w.env.kernel_cpus(pinned_id) == FIRST_SINGLE, "repaired")
    w.env.fake.exit_container(pinned_id)
    await until(lambda: w.env.engine.state.holding(pinned_id) is None, "released")
    await until(lambda: not w.watcher._watch_retry.running, "the retry ended with the container")
    assert w.counters["full_resyncs"] == 1


def counted_retries(watcher: Watcher, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tries the watcher's watch retry makes from now on, in a one-item
    list."""
    attempts = [0]
    attempt = watcher._watch_retry._attempt

    async def counting() -> bool:
        attempts[0] += 1
        return bool(await attempt())

    monkeypatch.setattr(watcher._watch_retry, "_attempt", counting)
    return attempts


async def test_a_kernel_out_of_watches_for_many_containers_is_asked_once_per_retry(
    retrying: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One retry for them all, and one watch asked for at each of its tries: each refusal
    is a warning, and the kernel refuses the rest as it refused the first."""
    w = retrying
    ids = [await w.started(f"web{n}") for n in range(4)]
    for container_id in ids:
        w.watcher.unwatch(container_id)
    attempts = counted_retries(w.watcher, monkeypatch)
    kernel = OutOfWatches(w.watcher, w.env.fake.cgroup_root, monkeypatch)
    tasks = len(w.env.engine._tasks)
    await w.watcher.look_everywhere()
    assert kernel.refused == len(ids)
    assert len(w.env.engine._tasks) <= tasks + 1
    await until(lambda: attempts[0] >= 3, "three tries")
    assert kernel.refused - len(ids) <= attempts[0]
    kernel.full = False
    await until(lambda: all(i in w.watcher._containers for i in ids), "all watched")


async def test_a_stopped_watcher_tries_no_more_watches(
    w: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared_id = await w.started("web")
    w.watcher.unwatch(shared_id)
    kernel = OutOfWatches(w.watcher, w.env.fake.cgroup_root, monkeypatch)
    await w.watcher.look_everywhere()
    assert w.watcher._watch_retry.running
    refused = kernel.refused
    await w.watcher.stop()
    # Its wait (a second here) ends with the watcher, and no watch is asked for.
    await until(lambda: not w.watcher._watch_retry.running, "the retry ended")
    assert kernel.refused == refused


def statuses(w: Watched) -> int:
    return len(w.env.fake.calls_of("ContainerStatus"))


async def test_a_started_container_the_runtime_did_not_locate_is_looked_up_again(
    retrying: Watched,
) -> None:
    """The look after the start got no answer (containerd restarting): with resyncPeriod 0
    no full look comes, and its exit would hold its exclusive CPU, its drift go unrepaired,
    for good."""
    w = retrying
    shared_id = await w.started("web")
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "restarting", count=2)
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await w.env.kubelet.start_new(pod, "main", 1000)
    await until(lambda: pinned_id in w.watcher._containers, "watched once the runtime answers")
    assert statuses(w) >= 3
    w.env.fake.exit_container(pinned_id)
    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "its exit gives the CPU back")
    assert w.counters["full_resyncs"] == 0
    await until(lambda: not w.watcher._watch_retry.running, "the retry ended")


async def test_a_container_exited_before_the_runtime_answered_is_released_by_the_retry(
    retrying: Watched,
) -> None:
    w = retrying
    shared_id = await w.started("web")
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "restarting")
    gate = w.env.fake.gate("ContainerStatus")
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await w.env.kubelet.start_new(pod, "main", 1000)
    await until(lambda: statuses(w) == 2, "the retry asks")
    w.env.fake.exit_container(pinned_id)
    w.env.fake.ungate("ContainerStatus")
    gate.set()
    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "its exit gives the CPU back")
    await until(lambda: not w.watcher._watch_retry.running, "the retry ended")
    assert w.counters["exits_seen"] == 1
    assert w.counters["full_resyncs"] == 0


async def unlocated(w: Watched, name: str) -> Tracked:
    """A running shared container, unwatched and with no cgroup known: as a lookup that
    got no answer leaves it."""
    container_id = await w.started(name)
    w.watcher.unwatch(container_id)
    tracked = w.env.engine.containers[container_id]
    tracked.cgroup = None
    return tracked


async def test_an_unlocated_container_the_runtime_did_not_answer_for_is_looked_up_again(
    retrying: Watched,
) -> None:
    """Start-up's or a sweep's look for a running container's cgroup, unanswered."""
    w = retrying
    tracked = await unlocated(w, "web")
    shared_id = tracked.id
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "restarting")
    await w.watcher.look_at_unlocated(tracked)
    assert shared_id not in w.watcher._containers
    await until(lambda: shared_id in w.watcher._containers, "watched once the runtime answers")
    assert tracked.cgroup == w.env.fake.cgroup_dir(shared_id)
    assert w.counters["full_resyncs"] == 0


async def test_a_created_container_the_runtime_did_not_answer_for_is_looked_up_again(
    retrying: Watched,
) -> None:
    """One cpushim saw made and another client started: unanswered, it would run unwatched
    and be taken for created until a full look."""
    w = retrying
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    reply = await w.env.kubelet.create(pod, "main", 1000)
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    start = pb.StartContainerRequest(container_id=container_id).SerializeToString()
    await w.env.channel.unary(UnaryCall(rq.START_CONTAINER, (), start, 10.0))  # not through
    tracked = w.env.engine.containers[container_id]
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "restarting")
    await w.watcher.look_at_created(tracked)
    assert tracked.phase.value == "created"
    await until(lambda: container_id in w.watcher._containers, "watched once the runtime answers")
    assert tracked.phase.value == "running"
    w.env.fake.exit_container(container_id)
    await until(lambda: w.env.engine.state.holding(container_id) is None, "released")
    assert w.counters["full_resyncs"] == 0


async def test_a_full_look_that_could_not_locate_a_container_looks_it_up_again(
    retrying: Watched,
) -> None:
    w = retrying
    shared_id = (await unlocated(w, "web")).id
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "restarting")
    await w.watcher.look_everywhere()
    await until(lambda: shared_id in w.watcher._containers, "watched once the runtime answers")
    assert w.counters["full_resyncs"] == 1


async def test_a_runtime_that_does_not_answer_is_asked_of_one_container_per_retry(
    retrying: Watched, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One retry for them all, and one lookup at each of its tries: a runtime that did not
    answer for one would not for the rest."""
    w = retrying
    ids = [(await unlocated(w, f"web{n}")).id for n in range(4)]
    attempts = counted_retries(w.watcher, monkeypatch)
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "restarting", count=1000)
    tasks = len(w.env.engine._tasks)
    asked = statuses(w)
    for container_id in ids:
        await w.watcher.look_at_unlocated(w.env.engine.containers[container_id])
    assert statuses(w) == asked + len(ids)
    assert len(w.env.engine._tasks) <= tasks + 1
    await until(lambda: attempts[0] >= 3, "three tries")
    assert statuses(w) - asked - len(ids) <= attempts[0]
    w.env.fake.clear_failures("ContainerStatus")
    await until(lambda: all(i in w.watcher._containers for i in ids), "all watched")
    await until(lambda: not w.watcher._watch_retry.running, "the retry ended")


async def test_a_container_the_runtime_says_is_gone_is_not_looked_up_again(
    retrying: Watched,
) -> None:
    w = retrying
    tracked = await unlocated(w, "web")
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.NOT_FOUND)
    await w.watcher.look_at_unlocated(tracked)
    assert tracked.phase is Phase.EXITED
    assert not w.watcher._watch_retry.running
    assert not w.watcher._unwatched


async def test_a_stopped_watcher_looks_up_no_more(w: Watched) -> None:
    tracked = await unlocated(w, "web")
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "restarting")
    await w.watcher.look_at_unlocated(tracked)
    assert w.watcher._watch_retry.running
    asked = statuses(w)
    await w.watcher.stop()
    # Its wait (a second here) ends with the watcher, and the runtime is not asked.
    await until(lambda: not w.watcher._watch_retry.running, "the retry ended")
    assert statuses(w) == asked


async def test_the_periodic_look_repairs_what_no_event_told(tmp_path: Path) -> None:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        async for w in watched_env(tmp_path, fake, resync_period=0.05):
            shared_id = await w.started("web")
            w.watcher.unwatch(shared_id)
            cpuset_file(w.env, shared_id).write_text("2\n")
            await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "repaired")  # noqa: B023
            assert w.counters["periodic_resyncs"] >= 1


@pytest.fixture
async def periodic(tmp_path: Path) -> AsyncIterator[Watched]:
    """A watcher that looks at everything every 20 ms."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        async for watched in watched_env(tmp_path, fake, resync_period=0.02):
            yield watched


async def test_a_periodic_look_that_fails_does_not_end_the_periodic_look(
    periodic: Watched,
) -> None:
    real = periodic.watcher.check_state
    failures = 0

    async def fails_once() -> None:
        nonlocal failures
        if not failures:
            failures += 1
            raise RuntimeError("an unexpected error in one look")
        await real()

    periodic.watcher.check_state = fails_once  # type: ignore[method-assign]
    await until(lambda: failures == 1, "the failing look")
    looks = periodic.counters["periodic_resyncs"]
    await until(lambda: periodic.counters["periodic_resyncs"] >= looks + 2, "looks after it")


async def test_a_new_resync_period_does_not_cut_a_look_half_way(periodic: Watched) -> None:
    """A look releasing an exited container's CPUs when a config reload sets a new period:
    the look goes on, and the shared container is grown."""
    w = periodic
    shared_id = await w.started("web")
    pinned_id = await w.started("db", "guaranteed", 1000)
    assert w.env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    w.watcher.unwatch(pinned_id)  # its exit is left to the periodic look
    checkpoint = w.env.engine.checkpoint
    real_save = checkpoint.save
    saving, saved = asyncio.Event(), asyncio.Event()

    async def held_save(state: CPUState) -> None:
        saving.set()
        await saved.wait()
        await real_save(state)

    checkpoint.save = held_save  # type: ignore[method-assign]
    w.env.fake.exit_container(pinned_id)
    await asyncio.wait_for(saving.wait(), 5)  # the look is releasing
    # Long: the cut look's work must not be done by the next one instead.
    w.watcher.set_resync_period(3600)
    checkpoint.save = real_save  # type: ignore[method-assign]
    saved.set()
    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "shared grown")
    assert str(w.env.engine.state.shared) == "0-7"


# --- leaks -----------------------------------------------------------------------------------


async def test_a_container_forgotten_while_it_is_located_is_not_watched(w: Watched) -> None:
    """RemoveContainer's follow-up lands while the runtime is still asked where the
    container's cgroup is: no watch is placed afterwards, which nothing would remove."""
    gate = w.env.fake.gate("ContainerStatus")
    pod = await w.env.kubelet.run_pod("web", "besteffort")
    container_id = await w.env.kubelet.start_new(pod, "main")
    await until(lambda: len(w.env.fake.calls_of("ContainerStatus")) == 1, "locating")
    w.env.engine.untrack(container_id)
    gate.set()

    def locating() -> bool:
        return any(
            getattr(task.get_coro(), "__qualname__", "") == "Engine._locate"
            for task in w.env.engine._tasks
        )

    await until(lambda: not locating(), "located")
    assert container_id not in w.env.engine.containers
    assert w.watcher.watched_containers == 0


async def test_no_watch_or_task_outlives_500_container_lifecycles(w: Watched) -> None:
    await w.started("web")
    baseline = (w.watcher.inotify.watch_count, w.watcher.inotify.subscription_count)
    pod = await w.env.kubelet.run_pod("batch", "guaranteed")
    for attempt in range(500):
        container_id = await w.env.kubelet.start_new(pod, "main", 1000, attempt=attempt)
        await until(lambda: container_id in w.watcher._containers, "watched")  # noqa: B023
        if attempt % 2:
            await w.env.kubelet.stop(container_id)
        else:
            w.env.fake.exit_container(container_id)
            await until(
                lambda: w.env.engine.state.holding(container_id) is None,  # noqa: B023
                "released on exit",
            )
        await w.env.kubelet.remove(container_id)
    await w.settled()
    # What may still run: the one recorder of the shared container (it waits an hour here).
    await until(lambda: len(w.env.engine._tasks) <= 1, "engine tasks done")
    assert len(w.env.engine.mover._recorders) == len(w.env.engine._tasks)
    assert (w.watcher.inotify.watch_count, w.watcher.inotify.subscription_count) == baseline
    assert w.watcher.watched_containers == 1
    # Every exit by itself is seen; a stop may be seen from its cgroup before its reply.
    assert 250 <= w.counters["exits_seen"] <= 500
    assert w.env.engine.state.assignments == {}


# --- process exits, through pidfds -----------------------------------------------------------


# This process's name: the parent of the processes the fake runtime starts.
OWN_NAME = Path("/proc/self/comm").read_text().strip()


class Processes:
    """Real processes for the fake runtime's containers, so their exits are real."""

    def __init__(self) -> None:
        self.running: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self) -> int:
        process = subprocess.Popen(["sleep", "3600"])
        self.running[process.pid] = process
        return process.pid

    def kill(self, pid: int) -> None:
        process = self.running.pop(pid)
        process.kill()
        process.wait()

    def close(self) -> None:
        for pid in list(self.running):
            self.kill(pid)


async def with_processes(
    tmp_path: Path, version: int = 1, driver: CgroupDriver = "cgroupfs"
) -> AsyncIterator[tuple[Watched, Processes]]:
    """A watched engine whose containers' processes are real (children of this one)."""
    processes = Processes()
    try:
        async with FakeRuntime(
            cgroup_root=tmp_path / "cgroup",
            cgroup_version=version,
            cgroup_driver=driver,
            pid_source=processes.spawn,
        ) as fake:
            async for watched in watched_env(tmp_path, fake):
                # The fake's processes are this one's children, not a containerd shim's.
                watched.env.engine.mover.shims = (OWN_NAME,)
                yield watched, processes
    finally:
        processes.close()


@pytest.fixture
async def p(tmp_path: Path) -> AsyncIterator[tuple[Watched, Processes]]:
    async for watched_and_processes in with_processes(tmp_path):
        yield watched_and_processes


@pytest.fixture(
    params=[(1, "cgroupfs"), (1, "systemd"), (2, "cgroupfs"), (2, "systemd")],
    ids=["v1-cgroupfs", "v1-systemd", "v2-cgroupfs", "v2-systemd"],
)
async def every_layout(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Watched, Processes]]:
    """``p`` on each cgroup version with each driver: the systemd one names pods by slice
    (``kubepods-burstable-pod<uid_>.slice``) and containers by scope, below the slices'
    expanded path (``kubepods.slice/kubepods-burstable.slice/...``)."""
    version, driver = request.param
    async for watched_and_processes in with_processes(tmp_path, version, driver):
        yield watched_and_processes


@pytest.mark.parametrize("qos", ["guaranteed", "burstable", "besteffort"])
async def test_each_drivers_cgroup_is_found_on_each_version_for_each_qos_class(
    every_layout: tuple[Watched, Processes], qos: str
) -> None:
    """From containerd's layout at start and from the runtime's cgroupsPath later: the same
    directory, watched, and released from when the process ends."""
    w, processes = every_layout
    shared_id = await w.started("web")
    container_id = await w.started("app", qos, 1000)
    directory = w.env.fake.cgroup_dir(container_id)
    assert directory is not None
    assert directory.is_dir()
    if w.env.fake.cgroup_driver == "systemd":
        assert directory.name == f"cri-containerd-{container_id}.scope"
        pod_slice = directory.parent
        assert pod_slice.name.startswith("kubepods-")
        assert pod_slice.name.endswith(".slice")
        levels = pod_slice.relative_to(w.env.fake.cgroup_root or Path()).parts
        assert len(levels) == (2 if qos == "guaranteed" else 3)
    tracked = w.env.engine.containers[container_id]
    assert tracked.cgroup == directory
    assert w.counters["cgroups_derived"] == 2
    tracked.cgroup, tracked.pid = None, 0
    assert await w.env.engine.mover.locate(tracked) == directory
    pinned = qos == "guaranteed"
    assert w.env.kernel_cpus(container_id) == (FIRST_SINGLE if pinned else "0-7")
    assert w.env.kernel_cpus(shared_id) == (SHARED_AFTER_FIRST_SINGLE if pinned else "0-7")

    processes.kill(w.env.fake.containers[container_id].pid)
    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "shared container grown")
    await until(lambda: w.counters["exits_seen"] == 1, "the exit seen")
    assert w.env.engine.state.holding(container_id) is None


@pytest.fixture
async def v2_systemd(tmp_path: Path) -> AsyncIterator[tuple[Watched, Processes]]:
    """``p`` on cgroup v2 with the systemd driver."""
    async for watched_and_processes in with_processes(tmp_path, 2, "systemd"):
        yield watched_and_processes


async def test_a_container_whose_cgroup_went_before_it_was_located_gives_its_cpus_back(
    v2_systemd: tuple[Watched, Processes],
) -> None:
    """A process that ends at once: with the systemd driver, systemd removes the emptied
    scope at once, while containerd still reports the container running (it marks it
    exited only after its shim's cleanup). Neither the layout nor the runtime's cgroupsPath
    then finds a cgroup, so no watch is placed; the process is gone, and so the container."""
    w, processes = v2_systemd
    shared_id = await w.started("web")
    gate = w.env.fake.gate("ContainerStatus")

    def ended_at_once() -> int:
        pid = processes.spawn()
        processes.kill(pid)
        return pid

    w.env.fake.pid_source = ended_at_once
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await w.env.kubelet.start_new(pod, "main", 1000)
    assert w.env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    await until(lambda: len(w.env.fake.calls_of("ContainerStatus")) == 1, "asked where it is")
    directory = w.env.fake.cgroup_dir(pinned_id)
    assert directory is not None
    shutil.rmtree(directory)  # systemd's cleanup of the emptied scope
    assert w.env.fake.containers[pinned_id].state == pb.CONTAINER_RUNNING
    w.env.fake.ungate("ContainerStatus")
    gate.set()

    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "shared container grown")
    assert w.env.engine.state.holding(pinned_id) is None
    assert w.counters["exits_seen"] == 1


@pytest.fixture
async def patient(tmp_path: Path) -> AsyncIterator[Watched]:
    """No periodic look, and no retry during a test."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        async for watched in watched_env(tmp_path, fake, retry_delay=3600):
            yield watched


async def test_the_full_look_releases_a_container_that_exited_before_it_was_located(
    patient: Watched,
) -> None:
    """The look after the start told nothing (the runtime refused it), and the container
    exited before the next: by the full look (before the lookup's retry) the runtime's
    record says so."""
    w = patient
    shared_id = await w.started("web")
    w.env.fake.fail_next("ContainerStatus", GrpcStatus.UNAVAILABLE, "containerd restarting")
    pod = await w.env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await w.env.kubelet.start_new(pod, "main", 1000)
    await until(lambda: len(w.env.fake.calls_of("ContainerStatus")) == 2, "asked where it is")
    w.env.fake.exit_container(pinned_id, exit_code=1)  # its cgroup goes with it
    await w.settled()
    # Nothing but a look can tell: the start's look was refused, nothing is watched.
    assert w.env.engine.state.holding(pinned_id) is not None
    assert pinned_id not in w.watcher._containers

    await w.watcher.look_everywhere()
    assert w.env.engine.state.holding(pinned_id) is None
    assert w.env.kernel_cpus(shared_id) == "0-7"
    assert w.counters["exits_seen"] == 1


async def test_a_process_exit_releases_cpus_before_the_cgroup_goes(
    p: tuple[Watched, Processes],
) -> None:
    w, processes = p
    shared_id = await w.started("web")
    pinned_id = await w.started("db", "guaranteed", 1000)
    await until(lambda: w.watcher.pidfd_count == 2, "both processes watched")

    processes.kill(w.env.fake.containers[pinned_id].pid)  # the runtime has not noticed

    await until(lambda: w.env.kernel_cpus(shared_id) == "0-7", "shared container grown")
    assert w.env.engine.state.holding(pinned_id) is None
    assert w.counters["process_exits_seen"] == 1
    assert w.counters["exits_seen"] == 1
    cgroup = w.env.fake.cgroup_dir(pinned_id)
    assert cgroup is not None
    assert cgroup.is_dir()
    assert w.watcher.pidfd_count == 1


async def test_a_started_container_is_found_from_containerds_layout(
    p: tuple[Watched, Processes],
) -> None:
    w, _ = p
    container_id = await w.started("web")
    tracked = w.env.engine.containers[container_id]
    assert tracked.cgroup == w.env.fake.cgroup_dir(container_id)
    assert tracked.pid == w.env.fake.containers[container_id].pid
    assert w.counters["cgroups_derived"] == 1
    assert w.env.fake.calls_of("ContainerStatus") == []


async def test_with_an_exec_beside_the_process_the_runtime_is_asked(
    p: tuple[Watched, Processes],
) -> None:
    w, processes = p
    container_id = await w.started("web")
    tracked = w.env.engine.containers[container_id]
    cgroup = tracked.cgroup
    assert cgroup is not None
    # A second process whose parent is outside too: which one is the container's own is
    # only the runtime's to say.
    own = w.env.fake.containers[container_id].pid
    (cgroup / "cgroup.procs").write_text(f"{processes.spawn()}\n{own}\n")
    tracked.cgroup, tracked.pid = None, 0
    assert await w.env.engine.mover.locate(tracked, just_started=True) == cgroup
    assert tracked.pid == own
    assert len(w.env.fake.calls_of("ContainerStatus")) == 1
    assert w.counters["cgroups_derived"] == 1


async def test_a_container_located_later_is_asked_of_the_runtime(
    p: tuple[Watched, Processes],
) -> None:
    # Past its start, a container's own process may have moved or handed its place on.
    w, _ = p
    container_id = await w.started("web")
    tracked = w.env.engine.containers[container_id]
    cgroup = tracked.cgroup
    tracked.cgroup, tracked.pid = None, 0
    assert await w.env.engine.mover.locate(tracked) == cgroup
    assert len(w.env.fake.calls_of("ContainerStatus")) == 1
    assert w.counters["cgroups_derived"] == 1


async def test_a_reused_pid_is_not_watched(p: tuple[Watched, Processes]) -> None:
    """A pid that is not in the container's cgroup (the process exited and the number was
    given to another) must not stand for the container."""
    w, processes = p
    stranger = processes.spawn()
    w.env.fake.pid_source = lambda: stranger
    container_id = await w.started("web")
    cgroup = w.env.fake.cgroup_dir(container_id)
    assert cgroup is not None
    (cgroup / "cgroup.procs").write_text("")  # the stranger is not the container's
    w.watcher.unwatch(container_id)
    w.watcher.watch(w.env.engine.containers[container_id])
    assert w.watcher.pidfd_count == 0
    processes.kill(stranger)
    await w.settled()
    assert w.counters["exits_seen"] == 0


async def test_no_pidfd_outlives_its_container(p: tuple[Watched, Processes]) -> None:
    w, processes = p
    pod = await w.env.kubelet.run_pod("batch", "guaranteed")
    for attempt in range(50):
        container_id = await w.env.kubelet.start_new(pod, "main", 1000, attempt=attempt)
        await until(lambda: w.watcher.pidfd_count == 1, "watched")
        if attempt % 2:
            await w.env.kubelet.stop(container_id)
        else:
            processes.kill(w.env.fake.containers[container_id].pid)
            await until(
                lambda: w.env.engine.state.holding(container_id) is None,  # noqa: B023
                f"attempt {attempt} released on exit",
            )
        await w.env.kubelet.remove(container_id)
        assert w.watcher.pidfd_count == 0
    await w.settled()
    assert w.counters["process_exits_seen"] == 25


# --- after stop, and what cannot be made again -------------------------------------------------


async def test_a_stopped_watcher_starts_no_timer_and_looks_nowhere(w: Watched) -> None:
    await w.watcher.stop()
    # A config reload that finishes during shutdown sets a new period.
    w.watcher.set_resync_period(0.05)
    assert w.watcher._timer is None
    looks = w.counters["full_resyncs"]
    await w.watcher.look_everywhere()
    assert w.counters["full_resyncs"] == looks


async def test_a_state_directory_that_cannot_be_made_again_does_not_stop_the_full_look(
    w: Watched,
) -> None:
    state_dir = w.env.state_dir
    assert w.watcher._state_watch is not None
    w.watcher.inotify.unsubscribe(w.watcher._state_watch)
    w.watcher._state_watch = None
    shutil.rmtree(state_dir)
    # A file where the directory was (a read-only file system refuses the same way).
    state_dir.write_text("not a directory\n")
    try:
        errors = w.counters["watch_errors"]
        await w.watcher.look_everywhere()
        assert w.counters["watch_errors"] == errors + 1
        # The state check still ran, and said it could not write.
        assert w.counters["checkpoint_errors"] >= 1
    finally:
        state_dir.unlink()
