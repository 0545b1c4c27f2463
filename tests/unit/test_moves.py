"""Moves written straight into cgroups, and the runtime told afterwards.

The fake containerd keeps a cgroup tree in a temp directory (cgroup v1 layout, cgroupfs
driver): ``Env.kernel_cpus`` is what that tree says, ``Env.cpus`` what the runtime's record says.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from grpclib.const import Status as GrpcStatus

from shim import cgroups
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status, UnaryCall
from shim.engine import EngineOptions, moves, resync
from shim.engine import requests as rq
from shim.engine.sweeping import sweep
from shim.engine.tracked import Tracked
from shim.engine.watching import Watcher
from tests.fake_runtime import FakeRuntime
from tests.harness.containerd import CgroupDriver, wait_for
from tests.unit.engine_env import (
    ALL,
    FIRST_SINGLE,
    GIB,
    SHARED_AFTER_FIRST_SINGLE,
    TOPOLOGY,
    Env,
    assert_consistent,
    make_env,
    static_policy,
    unreadable,
    until,
    updates,
    updates_to,
)
from tests.unit.test_engine import kubelet_resize

pytestmark = pytest.mark.anyio

# Long enough that nothing is recorded during a test unless it drains or flushes.
NEVER = 3600.0


async def cgroup_env(
    tmp_path: Path,
    fake: FakeRuntime,
    record_delay: float,
    record_max_delay: float = NEVER,
    *,
    update_timeout: float = EngineOptions.update_timeout,
    stuck_after: float = EngineOptions.stuck_after,
    retry_delay: float = EngineOptions.retry_delay,
) -> Env:
    options = EngineOptions(
        record_delay=record_delay,
        record_max_delay=record_max_delay,
        update_timeout=update_timeout,
        stuck_after=stuck_after,
        retry_delay=retry_delay,
    )
    return await make_env(fake, tmp_path / "state", options=options)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        environment = await cgroup_env(tmp_path, fake, NEVER)
        yield environment
        environment.channel.close()


async def start_pinned_located(env: Env, milli_cpu: int) -> tuple[str, Tracked]:
    """A Guaranteed pod "db" whose container asks for ``milli_cpu``, started, once the
    engine knows where its cgroup is: its container's id and its tracking."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", milli_cpu)
    tracked = env.engine.containers[pinned_id]
    await until(lambda: tracked.cgroup is not None, "located")
    return pinned_id, tracked


async def start_located(env: Env, name: str) -> str:
    """A BestEffort container, started, once the engine knows where its cgroup is."""
    pod = await env.kubelet.run_pod(name, "besteffort")
    container_id = await env.kubelet.start_new(pod, "main")
    tracked = env.engine.containers[container_id]
    await until(lambda: tracked.cgroup is not None, f"{name}'s cgroup located")
    assert tracked.cgroup == env.fake.cgroup_dir(container_id)
    return container_id


async def test_a_shared_container_moves_in_its_cgroup_and_the_runtime_hears_later(
    env: Env,
) -> None:
    shared_id = await start_located(env, "web")
    guaranteed = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(guaranteed, "main", 1000)

    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert env.cpus(shared_id) == "0-7"
    assert updates_to(env.fake, shared_id) == []

    await env.engine.drain(5.0)
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert updates_to(env.fake, shared_id) == [SHARED_AFTER_FIRST_SINGLE]


async def test_moves_within_the_record_delay_cost_one_runtime_update_of_the_last(
    env: Env,
) -> None:
    shared_id = await start_located(env, "web")
    for index in range(3):
        pod = await env.kubelet.run_pod(f"db-{index}", "guaranteed")
        await env.kubelet.start_new(pod, "main", 1000)
    last = env.kernel_cpus(shared_id)
    assert last is not None
    assert len(last.split(",")) > 1 or "-" in last  # several CPUs left, three taken

    await env.engine.drain(5.0)
    assert updates_to(env.fake, shared_id) == [last]


async def test_a_move_and_its_return_before_the_delay_cost_no_runtime_update(env: Env) -> None:
    shared_id = await start_located(env, "web")
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    await env.kubelet.stop(pinned_id)
    assert env.kernel_cpus(shared_id) == "0-7"

    await env.engine.drain(5.0)
    assert updates_to(env.fake, shared_id) == []


class StillClock:
    """The loop's clock (the record delay's), standing still but for what the test adds, as
    in tests/unit/test_shutdown.py: time passes for the engine as the test says, however
    long the host takes. The loop's timers fire only when it is moved past them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        loop = asyncio.get_running_loop()
        self.now = loop.time()
        monkeypatch.setattr(loop, "time", lambda: self.now)

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """``until`` while the clock stands still: it turns the loop and the host's clock
        bounds the wait."""
        deadline = time.monotonic() + 5.0
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within 5s: {what}")
            await asyncio.sleep(0)


async def test_a_container_that_keeps_moving_is_recorded_once_it_stays_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, record_delay=1.0)
        shared_id = await start_located(env, "web")
        clock = StillClock(monkeypatch)
        # Three moves 0.6 s apart, each within the delay of the one before: a record one delay
        # after the first move would carry the second cpuset and need another for the third.
        for index in range(3):
            pod = await env.kubelet.run_pod(f"db-{index}", "guaranteed")
            await env.kubelet.start_new(pod, "main", 1000)
            clock.now += 0.6
        last = env.kernel_cpus(shared_id)
        assert last is not None
        clock.now += 0.4  # the last cpuset has stayed put for the delay
        await clock.until(lambda: updates_to(fake, shared_id) != [], "the record sent")
        assert updates_to(fake, shared_id) == [last]
        env.channel.close()


async def test_a_container_that_never_stays_put_is_still_recorded(tmp_path: Path) -> None:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        # The cpuset never stays put long enough; the longest delay still brings a record.
        env = await cgroup_env(tmp_path, fake, record_delay=NEVER, record_max_delay=0.05)
        shared_id = await start_located(env, "web")
        pod = await env.kubelet.run_pod("db", "guaranteed")
        await env.kubelet.start_new(pod, "main", 1000)
        moved = env.kernel_cpus(shared_id)
        await until(lambda: updates_to(fake, shared_id) == [moved], "the record sent")
        env.channel.close()


async def test_a_record_the_runtime_refuses_is_counted_logged_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, record_delay=0.0)
        shared_id = await start_located(env, "web")
        fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE, "containerd is busy")
        with caplog.at_level("WARNING", logger="shim.engine.moves"):
            pod = await env.kubelet.run_pod("db", "guaranteed")
            await env.kubelet.start_new(pod, "main", 1000)
            moved = env.kernel_cpus(shared_id)
            # Refused once, then sent again: the runtime's record catches up with the cgroup.
            await until(lambda: updates_to(fake, shared_id) == [moved, moved], "the retry")
            await until(lambda: env.engine.counters["runtime_records"] == 1, "recorded")
        assert env.cpus(shared_id) == moved
        assert env.engine.counters["runtime_record_errors"] == 1
        (warning,) = [r for r in caplog.records if "did not record" in r.getMessage()]
        assert "containerd is busy" in str(warning.__dict__["fields"]["error"])
        assert warning.__dict__["fields"]["pod"] == "default/web"
        assert warning.__dict__["fields"]["container_id"] == shared_id
        env.channel.close()


def record_retry_waits(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The waits the refused records' warnings announced, in order."""
    return [
        r.__dict__["fields"]["retry_in_s"]
        for r in caplog.records
        if "did not record" in r.getMessage()
    ]


async def test_a_record_the_runtime_keeps_refusing_is_retried_ever_less_often(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(moves, "MIN_RECORD_RETRY_DELAY", 0.02)
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, record_delay=0.0)
        shared_id = await start_located(env, "web")
        fake.fail_next("UpdateContainerResources", GrpcStatus.UNKNOWN, "runc update failed", 4)
        with caplog.at_level("WARNING", logger="shim.engine.moves"):
            pod = await env.kubelet.run_pod("db", "guaranteed")
            pinned_id = await env.kubelet.start_new(pod, "main", 1000)
            await until(lambda: env.engine.counters["runtime_records"] == 1, "recorded")
            # The next record (after the stop's move) is refused once: it waits the least.
            fake.fail_next("UpdateContainerResources", GrpcStatus.UNKNOWN, "runc update failed")
            await env.kubelet.stop(pinned_id)
            await until(lambda: env.engine.counters["runtime_records"] == 2, "recorded again")
        waits = record_retry_waits(caplog)
        assert waits == [0.02, 0.04, 0.08, 0.16, 0.02]
        assert env.cpus(shared_id) == "0-7"
        env.channel.close()


async def test_a_record_refused_after_one_went_through_waits_the_least_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same recorder goes on after a record that went through while the container moved
    (the move waited for the record's lock): a refusal then is the first in a row again."""
    monkeypatch.setattr(moves, "MIN_RECORD_RETRY_DELAY", 0.02)
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, record_delay=0.0)
        shared_id = await start_located(env, "web")
        fake.fail_next("UpdateContainerResources", GrpcStatus.UNKNOWN, "runc update failed", 2)
        with caplog.at_level("WARNING", logger="shim.engine.moves"):
            pod = await env.kubelet.run_pod("db", "guaranteed")
            pinned_id = await env.kubelet.start_new(pod, "main", 1000)
            await until(lambda: env.engine.counters["runtime_record_errors"] == 2, "refused")
            held = fake.gate("UpdateContainerResources")
            await until(lambda: len(updates_to(fake, shared_id)) == 3, "the third try held")
            # It goes through; the move the stop makes meanwhile is refused, once.
            fake.fail_next("UpdateContainerResources", GrpcStatus.UNKNOWN, "runc update failed")
            stopping = asyncio.create_task(env.kubelet.stop(pinned_id))
            lock = env.engine.containers[shared_id].write_lock
            await until(lambda: bool(lock._waiters), "the stop's move waits for the record")
            fake.ungate("UpdateContainerResources")
            held.set()
            await stopping
            await until(lambda: env.engine.counters["runtime_records"] == 2, "recorded again")
        waits = record_retry_waits(caplog)
        assert waits == [0.02, 0.04, 0.02]
        assert updates_to(fake, shared_id)[-1] == "0-7"
        env.channel.close()


async def test_an_update_in_flight_is_never_overtaken_by_an_older_cpuset(tmp_path: Path) -> None:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, record_delay=0.0)
        shared_id = await start_located(env, "web")
        held = fake.gate("UpdateContainerResources")
        pod = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(pod, "main", 1000)
        # The record of the shrunk pool is now at the runtime, held before it lands.
        await until(lambda: updates_to(fake, shared_id) != [], "the record sent")
        fake.ungate("UpdateContainerResources")

        stop = asyncio.create_task(env.kubelet.stop(pinned_id))
        # The grown pool waits for the update in flight: the stop cannot return while it is
        # held (a bounded wait for something that must not happen).
        done, _ = await asyncio.wait({stop}, timeout=0.5)
        assert not done
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        held.set()
        await stop

        # The grown pool was written after the held update landed, not before it.
        assert env.kernel_cpus(shared_id) == "0-7"
        await env.engine.drain(5.0)
        assert env.cpus(shared_id) == "0-7"
        env.channel.close()


@pytest.fixture
async def systemd_env(tmp_path: Path) -> AsyncIterator[Env]:
    """Cgroup v2 with the systemd driver: systemd keeps a copy of each scope's cpuset."""
    async with FakeRuntime(
        cgroup_root=tmp_path / "cgroup", cgroup_version=2, cgroup_driver="systemd"
    ) as fake:
        environment = await cgroup_env(tmp_path, fake, NEVER)
        yield environment
        environment.channel.close()


def position(fake: FakeRuntime, method: str, container_id: str = "") -> int:
    """Where the last call of ``method`` (naming ``container_id``, when given) came."""
    return max(
        index
        for index, (name, request) in enumerate(fake.calls)
        if name == method and getattr(request, "container_id", "") == container_id
    )


@pytest.mark.parametrize(
    ("version", "driver"), [(2, "systemd"), (2, "cgroupfs"), (1, "systemd"), (1, "cgroupfs")]
)
async def test_a_shrink_systemd_would_undo_is_recorded_before_the_pinned_container_exists(
    tmp_path: Path, version: int, driver: CgroupDriver
) -> None:
    """On cgroup v2 with the systemd driver, systemd keeps a copy of each container's cpuset
    (its scope's AllowedCPUs, which runc sets at every update) and writes it into the
    cgroup whenever it applies the unit again. A shrink written into the cgroup alone left
    that copy holding the CPUs just given out exclusively for the record delay: the shared
    container could be put back on them (seen in the VM churn scenario). Such a shrink is
    recorded before the pinned container is created; a grow, or a shrink the copy already
    lies within, waits as it does everywhere else."""
    async with FakeRuntime(
        cgroup_root=tmp_path / "cgroup", cgroup_version=version, cgroup_driver=driver
    ) as fake:
        env = await cgroup_env(tmp_path, fake, NEVER)
        at_once = version == 2 and driver == "systemd"
        shared_id = await start_located(env, "web")

        first = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(first, "main", 1000)
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        assert updates_to(fake, shared_id) == ([SHARED_AFTER_FIRST_SINGLE] if at_once else [])
        if at_once:
            update = position(fake, "UpdateContainerResources", shared_id)
            assert update < position(fake, "CreateContainer")
            assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE

        await env.kubelet.stop(pinned_id)  # a grow: recorded later
        assert env.kernel_cpus(shared_id) == "0-7"
        second = await env.kubelet.run_pod("db-2", "guaranteed")
        await env.kubelet.start_new(second, "main", 1000)  # the same CPU: within the copy
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        third = await env.kubelet.run_pod("db-3", "guaranteed")
        await env.kubelet.start_new(third, "main", 1000)  # past the copy again
        last = env.kernel_cpus(shared_id)
        assert last is not None
        assert last != SHARED_AFTER_FIRST_SINGLE
        expected = [SHARED_AFTER_FIRST_SINGLE, last] if at_once else []
        assert updates_to(fake, shared_id) == expected
        assert env.engine.counters["systemd_records_at_once"] == len(expected)

        await env.engine.drain(5.0)
        assert env.cpus(shared_id) == last
        env.channel.close()


async def test_after_a_refused_record_systemds_copy_is_taken_for_unknown(systemd_env: Env) -> None:
    """runc may tell systemd before it fails: after a refused update the copy may hold the
    refused set, so the next move is recorded at once even where the last record that went
    through lies within it."""
    env = systemd_env
    shared_id = await start_located(env, "web")
    first = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(first, "main", 1000)

    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    second = await env.kubelet.run_pod("db-2", "guaranteed")
    second_id = await env.kubelet.start_new(second, "main", 1000)
    shrunk = env.kernel_cpus(shared_id)  # the cgroup holds it all the same
    assert shrunk is not None
    assert shrunk != SHARED_AFTER_FIRST_SINGLE
    assert env.engine.counters["runtime_record_errors"] == 1

    await env.kubelet.stop(second_id)  # back within the last record that went through
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert updates_to(env.fake, shared_id) == [
        SHARED_AFTER_FIRST_SINGLE,
        shrunk,
        SHARED_AFTER_FIRST_SINGLE,
    ]
    assert env.engine.counters["systemd_records_at_once"] == 2
    await env.engine.drain(5.0)


async def test_a_refused_move_through_the_runtime_leaves_the_record_unknown(
    systemd_env: Env,
) -> None:
    """As after a refused record: runc may have told systemd before it failed."""
    env = systemd_env
    tracked = env.engine.containers[await start_located(env, "web")]
    assert tracked.recorded is not None
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    async with tracked.write_lock:
        result = await env.engine.mover.update_locked(tracked, CPUSet.parse("0-3"), "", None)
    assert not result.ok
    assert tracked.recorded is None
    assert env.engine.counters["cpuset_update_errors"] == 1


async def test_a_container_whose_cgroup_vanished_moves_through_the_runtime(env: Env) -> None:
    shared_id = await start_located(env, "web")
    cgroup = env.fake.cgroup_dir(shared_id)
    assert cgroup is not None
    shutil.rmtree(cgroup)

    pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pod, "main", 1000)
    assert updates_to(env.fake, shared_id) == [SHARED_AFTER_FIRST_SINGLE]
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE


async def test_a_cgroup_the_runtime_names_and_that_is_not_there_is_warned_of_once(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The runtime says the container runs in a cgroup cpushim does not find (a cgroup mount
    it does not see): it can be neither written nor watched, which the operator is told,
    once per container though every full look asks again."""
    ids = [await start_located(env, name) for name in ("web", "api")]
    missing = []
    for container_id in ids:
        tracked = env.engine.containers[container_id]
        assert tracked.cgroup is not None
        missing.append(str(tracked.cgroup))
        shutil.rmtree(tracked.cgroup)
        tracked.cgroup = None
        env.fake.containers[container_id].pid = os.getpid()  # a process that runs
    with caplog.at_level("WARNING", logger="shim.engine.moves"):
        for _ in range(2):  # two full looks
            for container_id in ids:
                found = await env.engine.mover.find(env.engine.containers[container_id])
                assert found == moves.Found(None)
    warned = [r.__dict__["fields"] for r in caplog.records if "not there" in r.getMessage()]
    told = [(fields["container_id"], fields["cgroup"]) for fields in warned]
    assert told == list(zip(ids, missing, strict=True))


async def test_a_cgroup_the_runtime_names_out_of_reach_is_warned_of_once(
    env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cgroupsPath cpushim cannot place (here one that climbs out of the hierarchy): told
    once per container, with its id, though every full look asks again."""
    ids = [await start_located(env, name) for name in ("web", "api")]
    monkeypatch.setattr(env.fake, "cgroup_path", lambda container_id: f"/../{container_id}")
    for container_id in ids:
        env.engine.containers[container_id].cgroup = None
    with caplog.at_level("WARNING", logger="shim.engine.moves"):
        for _ in range(2):  # two full looks
            for container_id in ids:
                found = await env.engine.mover.find(env.engine.containers[container_id])
                assert found == moves.Found(None)
    warned = [r.__dict__["fields"] for r in caplog.records if "cannot place" in r.getMessage()]
    assert [fields["container_id"] for fields in warned] == ids
    assert all("below the root" in fields["error"] for fields in warned)


async def test_a_cgroup_out_of_reach_at_start_up_is_warned_of_once_with_the_looks_after(
    env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up meets the cgroupsPath it cannot place first: the full looks after it, which
    ask again, do not warn of it a second time."""
    ids = [await start_located(env, name) for name in ("web", "api")]
    monkeypatch.setattr(env.fake, "cgroup_path", lambda container_id: f"/../{container_id}")
    with caplog.at_level("WARNING", logger="shim.engine.moves"):
        engine = await env.restart()
        for _ in range(2):  # two full looks
            for container_id in ids:
                tracked = engine.containers[container_id]
                assert tracked.cgroup is None
                assert await engine.mover.find(tracked) == moves.Found(None)
    warned = [r.__dict__["fields"] for r in caplog.records if "cannot place" in r.getMessage()]
    assert sorted(fields["container_id"] for fields in warned) == sorted(ids)


async def test_a_runtime_that_names_no_cgroup_is_warned_of_once_per_container(
    env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ContainerStatus whose verbose info gives no cgroupsPath: the container moves
    through the runtime, unwatched, as one whose cgroup cannot be placed, and the operator
    is told what is missing, once per container, from start-up's look and every full look
    after it together."""
    ids = [await start_located(env, name) for name in ("web", "api")]
    monkeypatch.setattr(env.fake, "cgroup_path", lambda container_id: "")

    def warned() -> list[str]:
        told = [r for r in caplog.records if "names no cgroup" in r.getMessage()]
        assert all("cgroupsPath" in r.getMessage() for r in told)
        return sorted(r.__dict__["fields"]["container_id"] for r in told)

    with caplog.at_level("WARNING", logger="shim.engine.moves"):
        engine = await env.restart()
        assert warned() == sorted(ids)
        for _ in range(2):  # two full looks
            for container_id in ids:
                tracked = engine.containers[container_id]
                assert tracked.cgroup is None
                assert await engine.mover.find(tracked) == moves.Found(None)
    assert warned() == sorted(ids)


async def test_a_status_that_does_not_decode_is_warned_of_once_per_container(
    env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime answers, and its answer does not decode: the container is left unlocated
    and asked about again (the watcher's retries, every full look), which the operator is
    told once per container, with the decode error."""
    ids = [await start_located(env, name) for name in ("web", "api")]
    unreadable(env, monkeypatch, None).update(ids)
    for container_id in ids:
        env.engine.containers[container_id].cgroup = None
    with caplog.at_level("WARNING", logger="shim.engine.moves"):
        for _ in range(3):  # the first look and two retries
            for container_id in ids:
                found = await env.engine.mover.find(env.engine.containers[container_id])
                assert found == moves.Found(None, answered=False)
    warned = [r.__dict__["fields"] for r in caplog.records if "cannot read" in r.getMessage()]
    assert [fields["container_id"] for fields in warned] == ids
    assert all("does not decode" in fields["error"] for fields in warned)


async def test_a_status_that_does_not_decode_is_told_once_by_the_sweep_and_the_watcher(
    env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracked container is read by every sweep's adoption while it waits for exclusive
    CPUs (resync.status_read) and by the watcher while it is not located: whichever meets
    the answer that does not decode first tells it, in the sweep's words, and neither
    again."""
    container_id = await start_located(env, "web")
    tracked = env.engine.containers[container_id]
    tracked.cgroup = None
    unreadable(env, monkeypatch, None).add(container_id)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            read = await resync.status_read(env.engine, container_id, tracked.sandbox_id)
            assert read == resync.StatusRead(None, answered=False)
            assert await env.engine.mover.find(tracked) == moves.Found(None, answered=False)
    warned = [r for r in caplog.records if "cannot read" in r.getMessage()]
    assert [r.getMessage() for r in warned] == [
        "cannot read a container's state; it stays as it is"
    ]
    assert warned[0].__dict__["fields"]["container_id"] == container_id
    assert "does not decode" in warned[0].__dict__["fields"]["error"]


@pytest.mark.parametrize("reader", ["watcher", "create"])
async def test_a_failing_status_read_by_another_call_in_between_is_told_again(
    env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """An adoption (resync.status_read) tells a failed ContainerStatus once while the calls
    keep failing. A good read by the watcher looking for the cgroup, or by a create asking
    whether the container still runs, ends that spell as the adoption's own does: a call
    that fails after it is told again, where it used to stay unsaid."""
    container_id = await start_located(env, "web")
    tracked = env.engine.containers[container_id]
    tracked.cgroup = None
    failing = unreadable(env, monkeypatch, Status.UNAVAILABLE)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            failing.add(container_id)
            for _ in range(2):
                read = await resync.status_read(env.engine, container_id, tracked.sandbox_id)
                assert read == resync.StatusRead(None, answered=False)
            failing.clear()
            if reader == "watcher":
                assert (await env.engine.mover.find(tracked)).cgroup is not None
            else:
                assert await env.engine._container_state(container_id) == pb.CONTAINER_RUNNING
    told = [
        r.__dict__["fields"]["container_id"]
        for r in caplog.records
        if r.getMessage() == "cannot read a container's state; it stays as it is"
    ]
    assert told == [container_id, container_id]


def refused_in(monkeypatch: pytest.MonkeyPatch, cgroup: Path) -> list[str]:
    """Writes into ``cgroup`` refused by the kernel (EACCES), as cgroup v1 refuses CPUs its
    parent lacks; the sets tried there, in order."""
    write = cgroups.write_list
    tried: list[str] = []

    def refused_in_the_container(directory: Path, name: str, values: CPUSet) -> None:
        if directory == cgroup:
            tried.append(str(values))
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(directory / name))
        write(directory, name, values)

    monkeypatch.setattr(cgroups, "write_list", refused_in_the_container)
    return tried


@pytest.mark.parametrize("child_cpus", [None, "0-3"])
async def test_a_refused_direct_write_is_left_to_the_runtime_not_made_again(
    env: Env, monkeypatch: pytest.MonkeyPatch, child_cpus: str | None
) -> None:
    """The kernel refuses a write into the container's cgroup (cgroup v1: its parent does
    not have the CPUs): the same write made again at once meets the same refusal, so the
    move goes straight on through the runtime. With a child cpuset or without one."""
    shared_id = await start_located(env, "web")
    cgroup = env.fake.cgroup_dir(shared_id)
    assert cgroup is not None
    if child_cpus is not None:
        (cgroup / "inner").mkdir()
        (cgroup / "inner" / "cpuset.cpus").write_text(child_cpus + "\n")
    tried = refused_in(monkeypatch, cgroup)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pod, "main", 1000)
    assert tried == [SHARED_AFTER_FIRST_SINGLE]
    assert updates_to(env.fake, shared_id) == [SHARED_AFTER_FIRST_SINGLE]
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE  # runc's write
    assert env.engine.counters["cgroup_writes"] == 0


async def test_a_refused_direct_write_whose_call_hangs_is_not_made_again_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel refuses a direct write, so the move goes through the runtime, whose shim
    hangs: the move is not written past the call (the kernel would refuse the same write
    again, and it was logged twice); it is left to the retry, and the pinning goes on."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05)
        shared_id = await start_located(env, "web")
        cgroup = fake.cgroup_dir(shared_id)
        assert cgroup is not None
        write = cgroups.write_list
        tried = refused_in(monkeypatch, cgroup)
        hung = fake.gate("UpdateContainerResources")
        pod = await env.kubelet.run_pod("db", "guaranteed")
        pinning = asyncio.create_task(env.kubelet.start_new(pod, "main", 1000))
        started, _ = await asyncio.wait({pinning}, timeout=5.0)
        assert started, "a pinning waited for the hung shim"
        assert tried == [SHARED_AFTER_FIRST_SINGLE]
        assert env.engine.counters["writes_past_stuck_runtime"] == 0

        monkeypatch.setattr(cgroups, "write_list", write)
        fake.ungate("UpdateContainerResources")
        hung.set()
        await env.engine.drain(5.0)
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE  # runc's write
        env.channel.close()


async def test_a_container_not_started_yet_moves_through_the_runtime(env: Env) -> None:
    pod = await env.kubelet.run_pod("web", "besteffort")
    reply = await env.kubelet.create(pod, "main")
    created_id = next(iter(env.engine.containers))
    assert reply.messages

    guaranteed = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(guaranteed, "main", 1000)
    assert updates_to(env.fake, created_id) == [SHARED_AFTER_FIRST_SINGLE]


async def test_exclusive_containers_are_created_with_their_cpus_not_moved(env: Env) -> None:
    await start_located(env, "web")
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    assert env.kernel_cpus(pinned_id) == FIRST_SINGLE
    assert updates_to(env.fake, pinned_id) == []


async def test_a_restart_trusts_the_cgroup_over_the_runtime_record(env: Env) -> None:
    shared_id = await start_located(env, "web")
    pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pod, "main", 1000)
    # cpushim stops before the runtime hears of the move: the record says 0-7, the kernel not.
    assert env.cpus(shared_id) == "0-7"

    engine = await env.restart()
    assert engine.containers[shared_id].applied is not None
    assert str(engine.containers[shared_id].applied) == SHARED_AFTER_FIRST_SINGLE
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    await engine.drain(5.0)
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE


async def test_a_restart_repairs_a_cgroup_changed_while_cpushim_was_down(env: Env) -> None:
    shared_id = await start_located(env, "web")
    cgroup = env.fake.cgroup_dir(shared_id)
    assert cgroup is not None
    (cgroup / "cpuset.cpus").write_text("3\n")

    await env.restart()
    assert env.kernel_cpus(shared_id) == "0-7"


async def test_without_its_process_in_the_cgroup_a_container_is_located_by_the_runtime(
    env: Env,
) -> None:
    # This fake writes no cgroup.procs unless it runs real processes: nothing to derive from.
    shared_id = await start_located(env, "web")
    assert env.engine.containers[shared_id].cgroup == env.fake.cgroup_dir(shared_id)
    assert env.engine.counters["cgroups_derived"] == 0
    assert len(env.fake.calls_of("ContainerStatus")) == 1


def test_a_process_that_ended_is_told_from_one_that_runs() -> None:
    """What tells a container whose cgroup is gone from one whose cgroup is elsewhere: its
    process is gone, or a zombie its parent (the runtime's shim) has not reaped yet."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert not moves._process_ended(child.pid)
        child.kill()
        stat = Path(f"/proc/{child.pid}/stat")
        wait_for(lambda: b") Z " in stat.read_bytes(), 10.0, "the child a zombie")
        assert moves._process_ended(child.pid)
    finally:
        child.kill()
        child.wait()
    assert moves._process_ended(child.pid)  # reaped: gone
    assert not moves._process_ended(0)  # not known: taken as running
    assert not moves._process_ended(os.getpid())


def test_a_process_reaped_between_the_open_and_the_read_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """procfs answers a read of an open ``/proc/<pid>/stat`` with ESRCH once the process has
    been reaped since the open: gone, not unknown (taken for running, the container would
    keep its CPUs, unwatched, until a full look)."""

    def reaped(path: str | Path) -> bytes:
        raise ProcessLookupError(errno.ESRCH, os.strerror(errno.ESRCH), str(path))

    monkeypatch.setattr(moves, "read_file", reaped)
    assert moves._process_ended(4242)


async def test_after_kubelets_refused_update_systemds_copy_is_taken_for_unknown(
    systemd_env: Env,
) -> None:
    """kubelet's own UpdateContainerResources carries cpushim's cpuset to runc, which may tell
    systemd before it fails, as for cpushim's own updates: after a refusal the copy may hold
    the refused set, so the next shrink is recorded at once, even one back within the last
    record that went through. Left as it was, that record said the shrink needed no record,
    and the delayed one found nothing to tell (the cgroup equal to the stale record): systemd
    kept the CPUs just pinned until the container next moved."""
    env = systemd_env
    shared_id = await start_located(env, "web")
    first = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(first, "main", 1000)
    await env.kubelet.stop(pinned_id)  # a grow: recorded later
    assert env.kernel_cpus(shared_id) == "0-7"

    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNKNOWN)
    request = pb.UpdateContainerResourcesRequest(
        container_id=shared_id,
        linux=pb.LinuxContainerResources(cpu_shares=2, memory_limit_in_bytes=1 << 30),
    )
    reply = await env.kubelet.call("UpdateContainerResources", request.SerializeToString())
    assert reply.status is not Status.OK
    assert updates_to(env.fake, shared_id)[-1] == "0-7"  # what runc may have told systemd

    second = await env.kubelet.run_pod("db-2", "guaranteed")
    await env.kubelet.start_new(second, "main", 1000)  # the same CPU again
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert updates_to(env.fake, shared_id)[-1] == SHARED_AFTER_FIRST_SINGLE
    assert env.engine.counters["systemd_records_at_once"] == 2
    await env.engine.drain(5.0)
    # Never told later either: the delayed record found the cgroup equal to the stale one.
    assert updates_to(env.fake, shared_id)[-1] == SHARED_AFTER_FIRST_SINGLE


async def test_a_restart_records_at_once_a_shrink_systemds_copy_would_undo(
    systemd_env: Env,
) -> None:
    """cpushim stopped (a crash) after a shrink reached the cgroup but not the runtime (its
    record at once refused): the runtime's record, and so systemd's copy, still holds the
    pinned CPU. The cgroup is where it should be, so resync does not move it; the record
    must still be made before cpushim goes on, not a record delay later."""
    env = systemd_env
    shared_id = await start_located(env, "web")
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    first = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(first, "main", 1000)
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert env.cpus(shared_id) == "0-7"  # the runtime's record (and systemd's copy)
    old = env.engine

    engine = await env.restart()
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert engine.counters["systemd_records_at_once"] == 1
    await engine.drain(5.0)
    await old.drain(5.0)


async def test_records_run_no_more_at_once_than_moves_through_the_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shared container moves in the same instant, so their records fall due together:
    a node's hundred shared containers would each fork a ``runc update`` at once, and hold
    their write locks (a create meanwhile waiting on them) until all were done. They run
    ``update_concurrency`` at a time, as moves through the runtime do."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        options = EngineOptions(record_delay=0.0, record_max_delay=NEVER, update_concurrency=2)
        env = await make_env(fake, tmp_path / "state", options=options)
        shared = [await start_located(env, f"web-{index}") for index in range(5)]
        channel = env.engine.mover.runtime
        unary = channel.unary
        in_flight = 0
        most = 0

        async def counted(call: UnaryCall, request: bytes | None = None) -> Reply:
            nonlocal in_flight, most
            if call.path != rq.UPDATE_CONTAINER_RESOURCES:
                return await unary(call, request)
            in_flight += 1
            most = max(most, in_flight)
            try:
                return await unary(call, request)
            finally:
                in_flight -= 1

        monkeypatch.setattr(channel, "unary", counted)
        pod = await env.kubelet.run_pod("db", "guaranteed")
        await env.kubelet.start_new(pod, "main", 1000)
        await until(lambda: env.engine.counters["runtime_records"] == len(shared), "recorded")
        assert [updates_to(fake, i) for i in shared] == [[SHARED_AFTER_FIRST_SINGLE]] * 5
        assert most == 2
        env.channel.close()


# --- a runtime that does not answer for a container (a hung containerd shim) -----------------


async def test_a_record_to_a_hung_shim_keeps_no_turn_from_other_containers_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records run ``update_concurrency`` at a time. One to a hung shim kept its turn until
    its deadline (and again at each retry): with as many hung shims as turns, no other
    container on the node was recorded. A record gives its turn back once it has gone
    unanswered for ``stuck_after``."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        options = EngineOptions(
            record_delay=0.0,
            record_max_delay=NEVER,
            update_timeout=NEVER,
            stuck_after=0.05,
            update_concurrency=1,
        )
        env = await make_env(fake, tmp_path / "state", options=options)
        hung_id = await start_located(env, "hung")
        other_id = await start_located(env, "web")
        channel = env.engine.mover.runtime
        unary = channel.unary
        answer = asyncio.Event()

        async def hung_for_one(call: UnaryCall, request: bytes | None = None) -> Reply:
            if call.path == rq.UPDATE_CONTAINER_RESOURCES:
                named = pb.UpdateContainerResourcesRequest.FromString(call.request).container_id
                if named == hung_id:
                    await answer.wait()
            return await unary(call, request)

        monkeypatch.setattr(channel, "unary", hung_for_one)
        pod = await env.kubelet.run_pod("db", "guaranteed")
        await env.kubelet.start_new(pod, "main", 1000)
        await until(
            lambda: updates_to(fake, other_id) == [SHARED_AFTER_FIRST_SINGLE],
            "the other container recorded beside the hung one",
        )
        assert updates_to(fake, hung_id) == []  # held before the fake saw it
        answer.set()
        await until(
            lambda: updates_to(fake, hung_id) == [SHARED_AFTER_FIRST_SINGLE],
            "the hung one recorded",
        )
        await env.engine.drain(5.0)
        env.channel.close()


@pytest.mark.parametrize(("version", "driver"), [(1, "cgroupfs"), (2, "systemd")])
async def test_a_shim_that_hangs_holds_up_no_other_pods_pinning_or_release(
    tmp_path: Path, version: int, driver: CgroupDriver
) -> None:
    """A record of a shared container whose shim hangs held the container's write lock until
    the call's deadline, and the decision that had to move it waited for that lock holding
    the engine's: every pinning and release on the node waited for the one shim (under the
    systemd driver every pinning did, its shrink recorded at once). A move now waits for
    such a call ``stuck_after`` at most, then writes the cgroup past it; the call, when it
    lands, has the latest cpuset written again."""
    async with FakeRuntime(
        cgroup_root=tmp_path / "cgroup", cgroup_version=version, cgroup_driver=driver
    ) as fake:
        env = await cgroup_env(tmp_path, fake, 0.0, update_timeout=NEVER, stuck_after=0.05)
        shared_id = await start_located(env, "web")
        hung = fake.gate("UpdateContainerResources")

        first = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(first, "main", 1000)
        await until(lambda: updates_to(fake, shared_id) != [], "a record sent, and held")
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        await env.kubelet.stop(pinned_id)
        assert env.kernel_cpus(shared_id) == "0-7"
        tracked = env.engine.containers[shared_id]
        # Slow so far, not past a deadline: not taken for a hung shim (nor warned of).
        assert tracked.runtime_stuck
        assert not tracked.runtime_hung
        assert env.engine.stuck_runtime_containers() == 0
        second = await env.kubelet.run_pod("db-2", "guaranteed")
        await env.kubelet.start_new(second, "main", 1000)
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        assert env.engine.counters["writes_past_stuck_runtime"] >= 1
        assert env.engine.counters["stuck_runtime_spells"] == 0

        # The shim answers: the held records land with the older cpusets they carry, and
        # the latest is written again after them.
        hung.set()
        fake.ungate("UpdateContainerResources")
        await env.engine.drain(5.0)
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        assert not tracked.runtime_stuck
        env.channel.close()


async def test_a_record_past_its_deadline_marks_the_runtime_stuck_until_one_is_answered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record that gets no answer within the call's deadline tells that the container's
    runtime is stuck, once; the next move does not wait for the record sent again; the
    first answer ends the spell."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        caplog.set_level(logging.INFO, logger="shim.engine.moves")
        env = await cgroup_env(tmp_path, fake, 0.0, update_timeout=1.0, stuck_after=NEVER)
        shared_id = await start_located(env, "web")
        tracked = env.engine.containers[shared_id]
        hung = fake.gate("UpdateContainerResources")
        pod = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(pod, "main", 1000)
        await until(lambda: tracked.runtime_stuck, "the record past its deadline")
        stuck = [r for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(stuck) == 1
        assert tracked.runtime_hung
        assert env.engine.stuck_runtime_containers() == 1
        assert env.engine.counters["stuck_runtime_spells"] == 1
        assert env.engine.counters["runtime_record_errors"] == 1

        # The record is sent again after a second, and hangs again, holding the lock: the
        # release's grow is written past it (a move waiting for it would wait for good).
        await until(lambda: len(updates_to(fake, shared_id)) == 2, "the record sent again")
        assert tracked.write_lock.locked()
        await env.kubelet.stop(pinned_id)
        assert env.kernel_cpus(shared_id) == "0-7"
        assert env.engine.counters["writes_past_stuck_runtime"] == 1

        fake.ungate("UpdateContainerResources")
        hung.set()
        await env.engine.drain(5.0)
        assert not tracked.runtime_stuck
        assert env.kernel_cpus(shared_id) == "0-7"
        assert env.cpus(shared_id) == "0-7"
        assert [r for r in caplog.records if "does not answer" in r.getMessage()] == stuck
        assert any("answers for a container again" in r.getMessage() for r in caplog.records)
        env.channel.close()


def burstable_resize(container_id: str) -> bytes:
    """kubelet's in-place resize of a Burstable container: its request to 1 CPU, no limit."""
    return pb.UpdateContainerResourcesRequest(
        container_id=container_id,
        linux=pb.LinuxContainerResources(
            cpu_period=100_000, cpu_shares=1024, memory_limit_in_bytes=GIB
        ),
    ).SerializeToString()


async def resize_lands(
    env: Env, hung: asyncio.Event, update: asyncio.Task[Reply], container_id: str, latest: str
) -> None:
    """The shim answers: kubelet's held resize lands, and the container's cgroup and the
    runtime's record end with ``latest``."""
    hung.set()
    env.fake.ungate("UpdateContainerResources")
    reply = await update
    assert reply.status is Status.OK
    assert env.fake.containers[container_id].resources.cpu_shares == 1024
    assert env.kernel_cpus(container_id) == latest
    await env.engine.drain(5.0)
    assert env.cpus(container_id) == latest


async def test_kubelets_update_of_a_container_whose_shim_hangs_holds_up_no_other_pod(
    tmp_path: Path,
) -> None:
    """kubelet's UpdateContainerResources (an in-place resize of a Burstable pod) was
    forwarded under the engine's lock: for a container whose shim hangs, every decision on
    the node waited until kubelet's deadline, minutes. It is forwarded holding the
    container's write lock alone; a pinning meanwhile moves the container past it, and the
    update, once it lands with the pool of when it was sent, has the latest written again."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05)
        pod = await env.kubelet.run_pod("web", "burstable")
        shared_id = await env.kubelet.start_new(pod, "main", 500)
        await until(lambda: env.engine.containers[shared_id].cgroup is not None, "located")
        hung = fake.gate("UpdateContainerResources")
        update = asyncio.create_task(
            env.kubelet.call("UpdateContainerResources", burstable_resize(shared_id))
        )
        await until(lambda: updates_to(fake, shared_id) == ["0-7"], "kubelet's update held")

        guaranteed = await env.kubelet.run_pod("db", "guaranteed")
        await env.kubelet.start_new(guaranteed, "main", 1000)
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
        assert not update.done()

        # The update carried the pool of when it was sent, and runc wrote it: the latest
        # is written again after it.
        await resize_lands(env, hung, update, shared_id, SHARED_AFTER_FIRST_SINGLE)
        assert env.engine.containers[shared_id].applied == CPUSet.parse(SHARED_AFTER_FIRST_SINGLE)
        env.channel.close()


async def test_kubelets_update_behind_a_hung_record_holds_up_no_other_pod(
    tmp_path: Path,
) -> None:
    """kubelet's UpdateContainerResources of a container whose shim hangs took the
    container's write lock under the engine's lock, waiting as long as it took: behind a
    record of the container in flight (its deadline, or for good), every pinning and release
    on the node waited with it. It waits for the lock a moment at most under the engine's
    lock, then outside it, and decides again once it has it."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, 0.0, update_timeout=NEVER, stuck_after=0.05)
        pod = await env.kubelet.run_pod("web", "burstable")
        shared_id = await env.kubelet.start_new(pod, "main", 500)
        tracked = env.engine.containers[shared_id]
        await until(lambda: tracked.cgroup is not None, "located")
        hung = fake.gate("UpdateContainerResources")
        first = await env.kubelet.run_pod("db", "guaranteed")
        await env.kubelet.start_new(first, "main", 1000)
        await until(lambda: updates_to(fake, shared_id) != [], "a record sent, and held")
        assert tracked.write_lock.locked()

        update = asyncio.create_task(
            env.kubelet.call("UpdateContainerResources", burstable_resize(shared_id))
        )
        await until(env.engine.lock.locked, "kubelet's update deciding")
        second = await env.kubelet.run_pod("db-2", "guaranteed")
        pinning = asyncio.create_task(env.kubelet.start_new(second, "main", 1000))
        done, _ = await asyncio.wait({pinning}, timeout=5.0)
        assert done, "a pinning waited for kubelet's update of another pod's container"
        latest = str(env.engine.state.shared)
        assert env.kernel_cpus(shared_id) == latest
        assert not update.done()

        await resize_lands(env, hung, update, shared_id, latest)
        assert not tracked.runtime_stuck
        env.channel.close()


async def test_kubelets_resize_of_exclusive_cpus_whose_shim_hangs_holds_up_no_other_pod(
    tmp_path: Path,
) -> None:
    """kubelet's in-place resize of a pinned container's count of exclusive CPUs was forwarded
    under the engine's lock, so that CPUs it gives back are not handed out before it has left
    them: with its shim hung, every decision on the node waited until kubelet's deadline,
    minutes. The call is waited for ``stuck_after`` at most: the container is moved in its
    cgroup past it, the CPUs it gave back go to the shared containers and may be handed out,
    and the call, when it lands, leaves the latest cpuset."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(
            tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05, retry_delay=0.05
        )
        shared_id = await start_located(env, "web")
        pinned_id, tracked = await start_pinned_located(env, 2000)
        held = env.engine.state.assignments[tracked.key].cpus
        assert len(held) == 2
        hung = fake.gate("UpdateContainerResources")

        resize = asyncio.create_task(
            env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 1000))
        )
        await until(lambda: updates_to(fake, pinned_id) != [], "kubelet's resize held")
        kept = env.engine.state.assignments[tracked.key].cpus
        assert len(kept) == 1
        assert kept.issubset(held)
        await until(lambda: env.kernel_cpus(pinned_id) == str(kept), "moved past the call")
        assert env.kernel_cpus(shared_id) == str(env.engine.state.shared)
        assert (held - kept).issubset(env.engine.state.shared)

        # Decisions go on: every CPU left, the one it gave back among them, is handed out,
        # and the other pod runs there alone.
        other = await env.kubelet.run_pod("db-2", "guaranteed")
        left = ALL - CPUSet.parse("0") - kept
        pinning = asyncio.create_task(env.kubelet.start_new(other, "main", 1000 * len(left)))
        started, _ = await asyncio.wait({pinning}, timeout=5.0)
        assert started, "a pinning waited for another pod's hung shim"
        other_id = pinning.result()
        assert env.kernel_cpus(other_id) == str(left)
        assert env.kernel_cpus(pinned_id) == str(kept)
        assert not resize.done()

        hung.set()
        fake.ungate("UpdateContainerResources")
        reply = await resize
        assert reply.status is Status.OK
        await env.engine.drain(5.0)
        assert env.kernel_cpus(pinned_id) == str(kept)
        assert env.cpus(pinned_id) == str(kept)
        assert fake.containers[pinned_id].resources.cpu_quota == -1
        assert not tracked.runtime_stuck
        assert_consistent(env)
        env.channel.close()


async def moved_to_the_other_socket(env: Env, tracked: Tracked, past: str) -> CPUSet:
    """A reload reserves the first socket's CPUs: the pinned container moves to the other
    socket, its memory node with it, written into its cgroup past ``past``, a held call that
    holds its write lock; the runtime's part is left to it (settings_stale). Its new CPUs."""
    reserved = TOPOLOGY.cpus_in_numa_node(0)
    reload = asyncio.create_task(env.engine.change_policy(static_policy(str(reserved))))
    done, _ = await asyncio.wait({reload}, timeout=5.0)
    assert done, f"a move waited for {past}"
    latest = env.engine.state.assignments[tracked.key].cpus
    assert TOPOLOGY.memory_nodes_of(latest) == CPUSet.parse("1")
    assert env.kernel_cpus(tracked.id) == str(latest)
    assert tracked.cgroup is not None
    assert cgroups.read_list(tracked.cgroup, cgroups.CPUSET_MEMS) == CPUSet.parse("1")
    assert tracked.settings_stale
    return latest


async def test_kubelets_update_a_move_went_past_leaves_the_moves_memory_nodes_to_give(
    tmp_path: Path,
) -> None:
    """kubelet's update of a pinned container is held by its hung shim; a reload moves the
    container to the other socket past the call, its memory node with it, and leaves its
    settings for the runtime (settings_stale). The call then lands, answered, with the nodes
    of when it was sent: its answer took the container's settings for given, and nothing
    gave the runtime the move's; the cgroup kept the older node for good."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(
            tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05, retry_delay=0.05
        )
        pinned_id, tracked = await start_pinned_located(env, 1000)
        assert tracked.cgroup is not None
        hung = fake.gate("UpdateContainerResources")
        update = asyncio.create_task(
            env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 1000))
        )
        await until(lambda: updates_to(fake, pinned_id) == [FIRST_SINGLE], "kubelet's update held")

        latest = await moved_to_the_other_socket(env, tracked, "kubelet's held update")

        hung.set()
        fake.ungate("UpdateContainerResources")
        reply = await update
        assert reply.status is Status.OK
        await until(
            lambda: not tracked.settings_stale and not env.engine._move_retry.running,
            "the move's settings given",
        )
        assert env.kernel_cpus(pinned_id) == str(latest)
        assert cgroups.read_list(tracked.cgroup, cgroups.CPUSET_MEMS) == CPUSet.parse("1")
        assert fake.containers[pinned_id].resources.cpuset_mems == "1"
        assert env.cpus(pinned_id) == str(latest)
        await env.engine.drain(5.0)
        env.channel.close()


async def test_a_resize_not_written_past_its_hung_call_hands_out_nothing_it_gives_back(
    tmp_path: Path,
) -> None:
    """A resize of exclusive CPUs whose call the shim holds is written into the cgroup past
    it, and the CPUs it gives back handed on. When that write cannot be made (the cgroup
    not located, or the kernel refuses), the container still runs on them: they are kept
    from every other pod until the runtime has taken them from it, as before."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05)
        pinned_id, tracked = await start_pinned_located(env, 2000)
        held = env.engine.state.assignments[tracked.key].cpus
        tracked.cgroup = None  # as for a container whose cgroup was not found
        hung = fake.gate("UpdateContainerResources")
        resize = asyncio.create_task(
            env.kubelet.call("UpdateContainerResources", kubelet_resize(pinned_id, 1000))
        )
        await until(lambda: updates_to(fake, pinned_id) != [], "kubelet's resize held")
        kept = env.engine.state.assignments[tracked.key].cpus

        other = await env.kubelet.run_pod("db-2", "guaranteed")
        left = ALL - CPUSet.parse("0") - kept
        pinning = asyncio.create_task(env.kubelet.start_new(other, "main", 1000 * len(left)))
        started, _ = await asyncio.wait({pinning}, timeout=0.5)
        assert not started, "the CPU it gives back was handed out while it ran there"
        assert env.kernel_cpus(pinned_id) == str(held)

        hung.set()
        fake.ungate("UpdateContainerResources")
        assert (await resize).status is Status.OK
        other_id = await pinning
        assert env.kernel_cpus(pinned_id) == str(kept)
        assert env.kernel_cpus(other_id) == str(left)
        await env.engine.drain(5.0)
        env.channel.close()


async def test_a_refused_move_through_the_runtime_overtaken_leaves_the_record_unknown(
    tmp_path: Path,
) -> None:
    """A move through the runtime that a direct write went past (its runtime stuck), then
    refused: runc may have told systemd the refused set before it failed, as for any refused
    update. The record was left as it was, and once the container was back where that
    record had it, the delayed record found nothing to tell: systemd's copy could keep the
    refused set."""
    async with FakeRuntime(
        cgroup_root=tmp_path / "cgroup", cgroup_version=2, cgroup_driver="systemd"
    ) as fake:
        env = await cgroup_env(tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05)
        shared_id = await start_located(env, "web")
        tracked = env.engine.containers[shared_id]
        assert tracked.recorded == CPUSet.parse("0-7")
        fake.fail_next("UpdateContainerResources", GrpcStatus.UNKNOWN)
        hung = fake.gate("UpdateContainerResources")

        async def through_the_runtime() -> moves.MoveResult:
            async with tracked.write_lock:
                return await env.engine.mover.update_locked(tracked, CPUSet.parse("0-3"), "", None)

        move = asyncio.create_task(through_the_runtime())
        await until(lambda: updates_to(fake, shared_id) == ["0-3"], "the move held")
        pod = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(pod, "main", 1000)
        assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE  # past the move
        await env.kubelet.stop(pinned_id)
        assert env.kernel_cpus(shared_id) == "0-7"

        fake.ungate("UpdateContainerResources")
        hung.set()
        result = await move
        assert not result.ok
        assert env.kernel_cpus(shared_id) == "0-7"
        assert tracked.recorded is None
        await env.engine.drain(5.0)
        assert updates_to(fake, shared_id) == ["0-3", "0-7"]
        env.channel.close()


async def test_a_repair_past_its_deadline_is_recorded_later_which_ends_the_spell(
    tmp_path: Path,
) -> None:
    """A drift repair writes the cgroup, then tells the runtime; when that call went past its
    deadline (a hung shim), the container's runtime was taken for stuck and nothing asked
    about it again: once the shim answered, the container still counted as stuck (and the
    alert on it fired) until it next moved, and the runtime's record stayed behind."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(tmp_path, fake, 0.0, update_timeout=0.2, stuck_after=NEVER)
        watcher = Watcher(env.engine, resync_period=0)
        watcher.start()
        shared_id = await start_located(env, "web")
        tracked = env.engine.containers[shared_id]
        await until(lambda: shared_id in watcher._containers, "watched")
        hung = fake.gate("UpdateContainerResources")
        cgroup = fake.cgroup_dir(shared_id)
        assert cgroup is not None
        (cgroup / "cpuset.cpus").write_text("3\n")

        await until(lambda: tracked.runtime_stuck, "the repair's update past its deadline")
        assert env.kernel_cpus(shared_id) == "0-7"
        fake.ungate("UpdateContainerResources")
        hung.set()
        await until(lambda: not tracked.runtime_stuck, "the spell ended")
        assert not tracked.runtime_hung
        assert updates_to(fake, shared_id) == ["0-7", "0-7"]  # the repair's, then a record
        await watcher.stop()
        await env.engine.drain(5.0)
        env.channel.close()


async def test_a_repair_waiting_its_turn_never_lands_the_cpuset_a_move_went_past(
    tmp_path: Path,
) -> None:
    """A drift repair writes the cgroup, then waits for its turn among the repairs' updates
    holding the container's write lock; a move of the container meanwhile, its runtime
    taken for stuck, went past it. The repair's update then carried the cpuset of before
    the move and was not taken for overtaken (the move came before the call went out): the
    runtime wrote the older cpuset, the engine took it for applied, and the shared container
    ran on a CPU just pinned until the next decision."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        options = EngineOptions(
            record_delay=NEVER,
            record_max_delay=NEVER,
            update_timeout=NEVER,
            stuck_after=0.05,
            update_concurrency=1,
        )
        env = await make_env(fake, tmp_path / "state", options=options)
        watcher = Watcher(env.engine, resync_period=0)
        watcher.start()
        first_id = await start_located(env, "api")
        second_id = await start_located(env, "web")
        await until(lambda: {first_id, second_id} <= set(watcher._containers), "watched")
        hung = fake.gate("UpdateContainerResources")

        async def drifted(container_id: str) -> None:
            cgroup = fake.cgroup_dir(container_id)
            assert cgroup is not None
            (cgroup / "cpuset.cpus").write_text("3\n")
            await until(lambda: env.kernel_cpus(container_id) == "0-7", "written back")

        # The first repair's update is held, the second waits for its turn.
        await drifted(first_id)
        await drifted(second_id)
        await until(lambda: len(updates(fake)) == 1, "the first repair's update held")
        assert env.engine.counters["drift_repairs"] == 2

        pod = await env.kubelet.run_pod("db", "guaranteed")
        await env.kubelet.start_new(pod, "main", 1000)
        assert env.kernel_cpus(second_id) == SHARED_AFTER_FIRST_SINGLE  # past the repair

        fake.ungate("UpdateContainerResources")
        hung.set()
        await until(lambda: watcher.jobs.pending == 0, "the repairs done")
        for container_id in (first_id, second_id):
            assert env.kernel_cpus(container_id) == SHARED_AFTER_FIRST_SINGLE, container_id
            assert env.engine.containers[container_id].applied == CPUSet.parse(
                SHARED_AFTER_FIRST_SINGLE
            )
        await watcher.stop()
        await env.engine.drain(5.0)
        assert env.cpus(second_id) == SHARED_AFTER_FIRST_SINGLE
        env.channel.close()


async def test_a_repair_a_move_went_past_leaves_the_moves_memory_nodes_to_give(
    tmp_path: Path,
) -> None:
    """A drift repair of a pinned container tells the runtime, and its shim hangs; a reload
    moves the container to the other socket past that call, its memory node with it, and
    leaves its settings for the runtime. The repair's call then landed, answered, with the
    node of before: taken for a move that went through, it had the container's settings
    taken for given, and the cgroup kept the older node for good."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(
            tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05, retry_delay=0.05
        )
        watcher = Watcher(env.engine, resync_period=0)
        watcher.start()
        pod = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(pod, "main", 1000)
        tracked = env.engine.containers[pinned_id]
        await until(lambda: pinned_id in watcher._containers, "watched")
        cgroup = tracked.cgroup
        assert cgroup is not None
        hung = fake.gate("UpdateContainerResources")
        (cgroup / "cpuset.cpus").write_text("3\n")
        await until(lambda: updates_to(fake, pinned_id) == [FIRST_SINGLE], "the repair's held")

        latest = await moved_to_the_other_socket(env, tracked, "the repair's held update")

        hung.set()
        fake.ungate("UpdateContainerResources")
        await until(
            lambda: not tracked.settings_stale and not env.engine._move_retry.running,
            "the move's settings given",
        )
        await until(lambda: watcher.jobs.pending == 0, "the repair done")
        assert env.kernel_cpus(pinned_id) == str(latest)
        assert cgroups.read_list(cgroup, cgroups.CPUSET_MEMS) == CPUSet.parse("1")
        assert fake.containers[pinned_id].resources.cpuset_mems == "1"
        await watcher.stop()
        await env.engine.drain(5.0)
        assert env.cpus(pinned_id) == str(latest)
        env.channel.close()


async def test_a_sweep_taking_in_a_container_whose_shim_hangs_holds_up_no_other_pod(
    tmp_path: Path,
) -> None:
    """A sweep takes in a container another client made, under the engine's lock: under the
    systemd driver its move is recorded at once, which a hung shim leaves to run on after
    ``stuck_after``; the sweep then waited for that record, the container's write lock
    held, to record it again: every pinning and release on the node waited for the shim."""
    async with FakeRuntime(
        cgroup_root=tmp_path / "cgroup", cgroup_version=2, cgroup_driver="systemd"
    ) as fake:
        env = await cgroup_env(tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05)
        pod = await env.kubelet.run_pod("tools", "besteffort")
        config = env.kubelet.create_request(pod, "debug").config
        outsider = fake.add_container(pod.sandbox_id, config)
        hung = fake.gate("UpdateContainerResources")
        sweeping = asyncio.create_task(sweep(env.engine))
        await until(lambda: updates_to(fake, outsider) != [], "the outsider's record held")
        await until(lambda: env.engine.containers[outsider].runtime_stuck, "taken for stuck")

        first = await env.kubelet.run_pod("db", "guaranteed")
        pinning = asyncio.create_task(env.kubelet.start_new(first, "main", 1000))
        done, _ = await asyncio.wait({pinning}, timeout=5.0)
        assert done, "a pinning waited for the sweep's record of another pod's container"
        await sweeping
        assert env.kernel_cpus(outsider) == SHARED_AFTER_FIRST_SINGLE

        fake.ungate("UpdateContainerResources")
        hung.set()
        await env.engine.drain(5.0)
        assert env.cpus(outsider) == SHARED_AFTER_FIRST_SINGLE
        env.channel.close()


async def test_a_move_through_the_runtime_of_a_hung_shims_container_holds_up_nothing(
    tmp_path: Path,
) -> None:
    """An exclusive container moves through the runtime (its quota and memory nodes go with
    its CPUs): with its shim hung, the call held the engine's lock until its deadline, and a
    second move waited for the first call's lock without a bound, so a reload that moved it
    and every pinning and release after waited for the one shim. The call is waited for
    ``stuck_after`` at most, a move behind a stuck call not at all: the CPUs and memory
    nodes are written into the cgroup past it, and the runtime gets the rest once it
    answers: at once then, whatever wait the move's retry has grown to meanwhile (here an
    hour)."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(
            tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05, retry_delay=NEVER
        )
        pinned_id, tracked = await start_pinned_located(env, 1000)
        key = tracked.key
        hung = fake.gate("UpdateContainerResources")

        # A reload reserves its CPU: it is given another, through the runtime.
        reload = asyncio.create_task(
            env.engine.change_policy(static_policy(reserved=f"0,{FIRST_SINGLE}"))
        )
        done, _ = await asyncio.wait({reload}, timeout=5.0)
        assert done, "a reload waited for the hung shim"
        moved = env.engine.state.assignments[key].cpus
        assert moved != CPUSet.parse(FIRST_SINGLE)
        assert env.kernel_cpus(pinned_id) == str(moved)
        assert env.cpus(pinned_id) == FIRST_SINGLE  # the runtime's record: the call is held
        assert tracked.runtime_stuck
        assert tracked.settings_stale  # its quota and memory nodes are the runtime's to set

        # Moved again behind the held call, which holds its lock: not waited for at all. To
        # the other socket: its memory node with it.
        assert TOPOLOGY.memory_nodes_of(moved) == CPUSet.parse("0")
        latest = await moved_to_the_other_socket(env, tracked, "the container's held call")
        assert env.engine.counters["writes_past_stuck_runtime"] == 2
        other = await env.kubelet.run_pod("db-2", "guaranteed")
        pinning = asyncio.create_task(env.kubelet.start_new(other, "main", 1000))
        started, _ = await asyncio.wait({pinning}, timeout=5.0)
        assert started, "a pinning waited for another pod's hung shim"

        # The shim answers: the held call lands with the older set, the latest is written
        # again after it, and the move's retry, hurried, gives the runtime the rest.
        fake.ungate("UpdateContainerResources")
        hung.set()
        await until(lambda: not tracked.settings_stale, "the move retried through the runtime")
        await env.engine.drain(5.0)
        assert env.kernel_cpus(pinned_id) == str(latest)
        assert env.cpus(pinned_id) == str(latest)
        assert fake.containers[pinned_id].resources.cpu_quota == -1
        assert not tracked.runtime_stuck
        env.channel.close()


async def test_retries_while_the_runtime_does_not_answer_count_no_new_write_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move retry tries a container whose shim hangs again and again: its CPUs are in
    place after the first write past the call, so the retries neither write them again nor
    count a write past a stuck runtime each; its memory nodes are written again (a late
    call may have written its own)."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await cgroup_env(
            tmp_path, fake, NEVER, update_timeout=NEVER, stuck_after=0.05, retry_delay=0.001
        )
        pinned_id, tracked = await start_pinned_located(env, 1000)
        mover = env.engine.mover
        tries = 0
        write_past_call = mover.write_past_call

        def counted(*args: Any) -> moves.MoveResult:
            nonlocal tries
            tries += 1
            return write_past_call(*args)

        monkeypatch.setattr(mover, "write_past_call", counted)
        hung = fake.gate("UpdateContainerResources")
        latest = await moved_to_the_other_socket(env, tracked, "the container's held call")
        await until(lambda: tries >= 4, "the move tried again")
        assert env.engine.counters["writes_past_stuck_runtime"] == 1
        assert env.kernel_cpus(pinned_id) == str(latest)

        fake.ungate("UpdateContainerResources")
        hung.set()
        await until(lambda: not tracked.settings_stale, "the move given through the runtime")
        await env.engine.drain(5.0)
        assert env.cpus(pinned_id) == str(latest)
        env.channel.close()


async def test_a_record_at_once_that_fails_gives_the_lock_back_and_is_logged(
    systemd_env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The record at once runs in a task of its own, holding the container's write lock:
    a defect in it must give the lock back (or every later move of the container would
    wait for it), be logged, and not pass for a runtime that does not answer."""
    env = systemd_env
    shared_id = await start_located(env, "web")
    tracked = env.engine.containers[shared_id]

    async def broken(tracked: object, cpus: object) -> Reply:
        raise RuntimeError("a defect")

    monkeypatch.setattr(env.engine.mover, "_send_record", broken)
    pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pod, "main", 1000)
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    await until(lambda: not tracked.write_lock.locked(), "the lock given back")
    assert not tracked.runtime_stuck
    assert env.engine.counters["internal_errors"] == 1
    assert any(r.getMessage() == "a runtime call about a container failed" for r in caplog.records)


@pytest.mark.parametrize(
    ("reply", "stuck_after"),
    [
        (Reply.error(Status.DEADLINE_EXCEEDED, "late"), True),
        (Reply.no_answer(Status.UNAVAILABLE, "connection lost"), True),
        (Reply.error(Status.CANCELLED, "kubelet gone"), True),
        (Reply.error(Status.UNKNOWN, "refused"), False),
        (Reply.ok(b""), False),
    ],
)
async def test_only_an_answer_ends_a_stuck_spell(env: Env, reply: Reply, stuck_after: bool) -> None:
    """A call that got no answer about the container (a lost connection, a caller that
    went away) says nothing of whether its runtime answers now: the spell goes on."""
    tracked = env.engine.containers[await start_located(env, "web")]
    tracked.runtime_stuck = True
    env.engine.mover.heard(tracked, reply)
    assert tracked.runtime_stuck is stuck_after
