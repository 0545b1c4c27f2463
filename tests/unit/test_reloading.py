"""Live reload of the config file: a good edit re-plans and moves containers, a bad one is
refused and changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import re
import select
import shutil
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from shim.config import KEYS, reload_options
from shim.cpuset import CPUSet
from shim.cri.calls import Status
from shim.engine import EngineOptions
from shim.engine.reloading import LIVE_FIELDS, POLICY_FIELDS, ConfigReloader, _content
from shim.engine.watching import Watcher
from shim.inotify import Inotify, WatchError
from shim.policy import CPUPolicy
from shim.run import RunOptions, build_policy
from shim.state import ContainerKey
from tests.fake_runtime import FakeRuntime
from tests.harness.fifo import waiting_for_a_fifo_writer, without_waiting_on
from tests.harness.kubelet import milli_cpu_to_quota
from tests.harness.sysfs import MachineSpec, write_sysfs
from tests.unit.engine_env import (
    ALL,
    FIRST_SINGLE,
    SHARED_AFTER_FIRST_SINGLE,
    Env,
    make_env,
    pinned_on_half_cores,
    until,
)

pytestmark = pytest.mark.anyio


@dataclass
class Reloading:
    env: Env
    watcher: Watcher
    reloader: ConfigReloader
    path: Path
    sysfs: Path

    def write(self, text: str) -> None:
        """Replace the file the way editors and config management do: temp file, rename."""
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text(f'sysfsRoot = "{self.sysfs}"\n{text}')
        os.replace(temporary, self.path)

    async def reloaded(self, counter: str, count: int = 1) -> None:
        await until(
            lambda: self.env.engine.counters[counter] >= count, f"{counter} = {count}", deadline=5
        )
        await until(lambda: self.watcher.jobs.pending == 0, "watch jobs done")


@contextlib.asynccontextmanager
async def reloading(
    tmp_path: Path, resync_period: float = 0.0, retry_delay: float = EngineOptions.retry_delay
) -> AsyncIterator[Reloading]:
    sysfs = write_sysfs(
        MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2), tmp_path / "sys"
    )
    path = tmp_path / "etc" / "config.toml"
    path.parent.mkdir()
    path.write_text(f'sysfsRoot = "{sysfs}"\nreservedSystemCPUs = "0"\n')
    options = reload_options(RunOptions(config_path=path))
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await make_env(
            fake,
            tmp_path / "state",
            build_policy(options),
            options=EngineOptions(record_delay=3600, retry_delay=retry_delay),
        )
        watcher = Watcher(env.engine, resync_period=resync_period)
        watcher.start()
        reloader = ConfigReloader(watcher, options, build_policy)
        reloader.start()
        # Its first look at the file (an edit made while cpushim started) is done.
        await until(lambda: watcher.jobs.pending == 0, "the reloader's first look")
        try:
            yield Reloading(env, watcher, reloader, path, sysfs)
        finally:
            reloader.stop()
            await watcher.stop()
            await env.engine.drain(5.0)
            env.channel.close()


@pytest.fixture
async def r(tmp_path: Path) -> AsyncIterator[Reloading]:
    async with reloading(tmp_path) as reloader:
        yield reloader


async def pinned_and_shared(env: Env) -> tuple[str, str]:
    shared_pod = await env.kubelet.run_pod("web", "besteffort")
    shared_id = await env.kubelet.start_new(shared_pod, "main")
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned_pod, "main", 1000)
    assert env.kernel_cpus(pinned_id) == FIRST_SINGLE
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    return shared_id, pinned_id


async def test_new_reserved_cpus_re_plan_and_move_the_containers(r: Reloading) -> None:
    env = r.env
    shared_id, pinned_id = await pinned_and_shared(env)
    # CPU 4 (the pinned container's) becomes reserved: it must move, and the pool with it.
    r.write('reservedSystemCPUs = "0,4"\n')
    await r.reloaded("config_reloads")
    assert env.engine.policy.reserved == CPUSet.parse("0,4")
    moved = CPUSet.parse(env.kernel_cpus(pinned_id) or "")
    assert len(moved) == 1
    assert not moved & CPUSet.parse("0,4")
    assert env.kernel_cpus(shared_id) == str(ALL - moved)
    (held,) = env.saved().values()
    assert held == {"main": str(moved)}
    saved = env.engine.checkpoint.load()
    assert saved is not None
    assert saved.reserved == CPUSet.parse("0,4")


async def test_a_container_that_loses_its_cpus_to_a_reload_gets_kubelets_settings_back(
    r: Reloading,
) -> None:
    env = r.env
    shared_id, pinned_id = await pinned_and_shared(env)
    assert env.fake.containers[pinned_id].resources.cpu_quota == -1
    r.write('cpuManagerPolicy = "none"\nreservedSystemCPUs = "0"\n')
    await r.reloaded("config_reloads")
    assert env.engine.policy.name == "none"
    # Asked for, so no pinning error: kubelet's counter would fire the operator's alert.
    assert env.engine.counters["pinning_errors"] == 0
    restored = env.fake.containers[pinned_id].resources
    assert restored.cpu_quota == milli_cpu_to_quota(1000)
    assert restored.cpuset_mems == "0-1"
    assert env.kernel_cpus(pinned_id) == env.kernel_cpus(shared_id) == str(ALL)
    assert not env.engine.containers[pinned_id].exclusive


async def test_a_reload_back_to_static_pins_the_containers_that_ask_as_a_restart_would(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shim")
    env = r.env
    shared_id, pinned_id = await pinned_and_shared(env)
    r.write('cpuManagerPolicy = "none"\nreservedSystemCPUs = "0"\n')
    await r.reloaded("config_reloads")
    # Created under none, it shares like everything else.
    late_id = await env.kubelet.start_new(
        await env.kubelet.run_pod("cache", "guaranteed"), "m", 1000
    )
    assert env.kernel_cpus(late_id) == str(ALL)

    r.write('reservedSystemCPUs = "0"\n')
    await r.reloaded("config_reloads", 2)
    pinned = {cid: CPUSet.parse(env.kernel_cpus(cid) or "") for cid in (pinned_id, late_id)}
    assert [len(cpus) for cpus in pinned.values()] == [1, 1]
    assert env.kernel_cpus(shared_id) == str(ALL - pinned[pinned_id] - pinned[late_id])
    assert env.fake.containers[late_id].resources.cpu_quota == -1
    (reloaded,) = [r for r in caplog.records if r.getMessage() == "config reloaded"][-1:]
    assert len(reloaded.fields["adopted_exclusive"]) == 2  # type: ignore[attr-defined]


async def test_a_create_under_way_when_the_policy_turns_static_is_pinned_after_it(
    r: Reloading,
) -> None:
    """Sent to share under none; the reload's adoption ran while the runtime still had it."""
    env = r.env
    r.write('cpuManagerPolicy = "none"\nreservedSystemCPUs = "0"\n')
    await r.reloaded("config_reloads")
    pod = await env.kubelet.run_pod("db", "guaranteed")
    held = env.fake.gate("CreateContainer")
    create = asyncio.ensure_future(env.kubelet.create(pod, "main", 1000))
    await until(lambda: bool(env.fake.calls_of("CreateContainer")), "the create sent")
    r.write('reservedSystemCPUs = "0"\n')
    await r.reloaded("config_reloads", 2)
    assert env.engine.state.assignments == {}
    env.fake.ungate("CreateContainer")
    held.set()
    reply = await create
    assert reply.status is Status.OK
    key = ContainerKey(pod.uid, "main")
    await until(lambda: key in env.engine.state.assignments, "adopted after its create")
    container_id = env.engine.state.assignments[key].container_id
    await until(lambda: env.cpus(container_id) == FIRST_SINGLE, "moved onto its CPU")
    assert env.fake.containers[container_id].resources.cpu_quota == -1


async def test_a_next_attempt_after_a_reload_gets_cpus_the_new_options_allow(
    r: Reloading,
) -> None:
    # Its last attempt's CPU (4, a lone thread) predates full-pcpus-only: preferring it would
    # give the container what the policy now refuses, a CPU without its sibling.
    env = r.env
    pod = await env.kubelet.run_pod("db", "guaranteed")
    first = await env.kubelet.start_new(pod, "main", 1000)
    assert env.kernel_cpus(first) == FIRST_SINGLE
    await env.kubelet.stop(first)
    r.write('reservedSystemCPUs = "0"\n[cpuManagerPolicyOptions]\nfull-pcpus-only = true\n')
    await r.reloaded("config_reloads")
    reply = await env.kubelet.create(pod, "main", 1000, attempt=1)
    assert reply.status is Status.RESOURCE_EXHAUSTED
    assert "full-pcpus-only" in reply.status_message or "SMT" in reply.status_message
    two = await env.kubelet.start_new(pod, "main", 2000, attempt=2)
    assert len(CPUSet.parse(env.kernel_cpus(two) or "")) == 2


async def test_switching_to_none_with_policy_options_on_is_refused_naming_the_table(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    env = r.env
    _, pinned_id = await pinned_and_shared(env)
    before = env.engine.state
    with caplog.at_level(logging.ERROR):
        r.write(
            'cpuManagerPolicy = "none"\nreservedSystemCPUs = "0"\n'
            "[cpuManagerPolicyOptions]\nfull-pcpus-only = true\n"
        )
        await r.reloaded("config_errors")
    assert env.engine.policy.name == "static"
    assert env.engine.state == before
    assert env.kernel_cpus(pinned_id) == FIRST_SINGLE
    refusals = [rec for rec in caplog.records if "refused" in rec.getMessage()]
    assert "[cpuManagerPolicyOptions]" in refusals[-1].__dict__["fields"]["error"]


async def test_a_file_that_does_not_parse_is_refused_and_nothing_changes(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    env = r.env
    _, pinned_id = await pinned_and_shared(env)
    before = env.engine.state
    r.write('reservedSystemCPUs = "0,4"\nnoSuchKey = 1\n')
    with caplog.at_level(logging.ERROR):
        await r.reloaded("config_errors")
    assert env.engine.state == before
    assert env.engine.policy.reserved == CPUSet.parse("0")
    assert env.kernel_cpus(pinned_id) == FIRST_SINGLE
    refusals = [rec for rec in caplog.records if "refused" in rec.getMessage()]
    assert refusals
    fields = refusals[-1].__dict__["fields"]
    assert fields["key"] == "noSuchKey"
    assert fields["line"] == 3
    assert str(r.path) in fields["error"]


async def test_values_that_make_no_policy_are_refused(r: Reloading) -> None:
    env = r.env
    await pinned_and_shared(env)
    before = env.engine.state
    r.write('reservedSystemCPUs = "9"\n')  # not a CPU of this machine
    await r.reloaded("config_errors")
    assert env.engine.state == before
    assert env.engine.policy.reserved == CPUSet.parse("0")
    # The next good edit still applies.
    r.write('reservedSystemCPUs = "0"\nfailurePolicy = "fail-open"\n')
    await r.reloaded("config_reloads")
    assert env.engine.options.failure_policy == "fail-open"
    assert env.engine.state == before


async def test_reserving_every_cpu_is_refused_and_nothing_changes(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    env = r.env
    shared_id, pinned_id = await pinned_and_shared(env)
    before = env.engine.state
    with caplog.at_level(logging.ERROR):
        r.write(f'reservedSystemCPUs = "{ALL}"\n')
        await r.reloaded("config_errors")
    assert env.engine.state == before
    assert env.engine.policy.reserved == CPUSet.parse("0")
    assert env.kernel_cpus(pinned_id) == FIRST_SINGLE
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    refusals = [rec for rec in caplog.records if "refused" in rec.getMessage()]
    fields = refusals[-1].__dict__["fields"]
    assert "every online CPU" in fields["error"]
    # operations.md: a bad value is refused with the file, line and key.
    assert (fields["key"], fields["line"]) == ("reservedSystemCPUs", 2)  # after sysfsRoot
    assert fields["error"].startswith("reservedSystemCPUs (--reserved-cpus): ")


async def test_keys_that_need_a_restart_are_named_not_applied(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    r.write(
        'reservedSystemCPUs = "0"\nlisten = "unix:///tmp/elsewhere.sock"\n'
        'metricsAddress = "127.0.0.1:9999"\nlogLevel = "debug"\n'
    )
    with caplog.at_level(logging.INFO):
        await r.reloaded("config_reloads")
    (record,) = [rec for rec in caplog.records if rec.getMessage() == "config reloaded"]
    # Named as in the file, so that the log leads to the line to look at.
    assert record.__dict__["fields"]["changed"] == ["listen", "logLevel", "metricsAddress"]
    assert record.__dict__["fields"]["need_restart"] == ["listen", "metricsAddress"]
    assert r.reloader.options.listen == "unix:///tmp/elsewhere.sock"


async def test_need_restart_names_what_differs_from_what_cpushim_started_with(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    """A key that needs a restart stays named until one: a later edit of another key does
    not hide it, and a key edited back to the value cpushim runs with needs none."""
    started = r.reloader.options.metrics_address
    edits = [
        ('metricsAddress = "127.0.0.1:9999"\n', ["metricsAddress"]),
        ('metricsAddress = "127.0.0.1:9999"\nresyncPeriod = 60\n', ["metricsAddress"]),
        (f'metricsAddress = "{started}"\nresyncPeriod = 60\n', []),
    ]
    with caplog.at_level(logging.INFO):
        for count, (text, _) in enumerate(edits, start=1):
            r.write(f'reservedSystemCPUs = "0"\n{text}')
            await r.reloaded("config_reloads", count)
    records = [rec for rec in caplog.records if rec.getMessage() == "config reloaded"]
    assert [rec.__dict__["fields"]["need_restart"] for rec in records] == [
        need for _, need in edits
    ]


async def test_recovery_turned_off_after_a_recovery_waits_for_no_restart(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/operations.md's recovery: start once with it on, then turn it off in the file.
    with caplog.at_level(logging.INFO):
        r.write('reservedSystemCPUs = "0"\nrecoverFromRuntime = true\n')
        await r.reloaded("config_reloads")
        r.write('reservedSystemCPUs = "0"\nrecoverFromRuntime = false\n')
        await r.reloaded("config_reloads", 2)
    *_, on, off = [rec for rec in caplog.records if rec.getMessage() == "config reloaded"]
    assert on.__dict__["fields"]["need_restart"] == ["recoverFromRuntime"]
    assert off.__dict__["fields"]["changed"] == ["recoverFromRuntime"]
    assert off.__dict__["fields"]["need_restart"] == []


async def test_an_edit_in_place_is_seen_too(r: Reloading) -> None:
    root = logging.getLogger()
    level = root.level
    try:
        r.path.write_text(
            f'sysfsRoot = "{r.sysfs}"\nreservedSystemCPUs = "0"\nlogLevel = "debug"\n'
        )
        await r.reloaded("config_reloads")
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(level)


async def events_handled(r: Reloading) -> None:
    """Every inotify event queued so far has been read and its work done."""
    fd = r.watcher.inotify._manager.get_fd()
    await until(
        lambda: not select.select([fd], [], [], 0)[0] and r.watcher.jobs.pending == 0,
        "inotify events handled",
    )


async def test_a_file_made_empty_and_written_after_is_read_once_written(r: Reloading) -> None:
    r.write('reservedSystemCPUs = "0,4"\n')
    await r.reloaded("config_reloads")
    # `rm` then `cat >`, `cp` onto a missing file, some editors: the file is made empty,
    # then written.
    r.path.unlink()
    with r.path.open("w") as made:
        await events_handled(r)
        # Neither the removal nor the empty file was read: the running config stays, and
        # no error counts.
        assert r.env.engine.policy.reserved == CPUSet.parse("0,4")
        assert r.env.engine.counters["config_errors"] == 0
        assert r.env.engine.counters["config_reloads"] == 1
        made.write(
            f'sysfsRoot = "{r.sysfs}"\nreservedSystemCPUs = "0,4"\nfailurePolicy = "fail-open"\n'
        )
    await r.reloaded("config_reloads", 2)
    assert r.env.engine.options.failure_policy == "fail-open"
    assert r.env.engine.counters["config_errors"] == 0


def lose_events(r: Reloading) -> Callable[[], None]:
    """Stop reading inotify events; the function returned drops what the kernel queued
    meanwhile and reports an overflow, as the kernel does when its queue is full."""
    loop = asyncio.get_running_loop()
    inotify = r.watcher.inotify
    fd = inotify._manager.get_fd()
    loop.remove_reader(fd)

    def overflow() -> None:
        while select.select([fd], [], [], 0)[0]:
            os.read(fd, 65536)
        loop.add_reader(fd, inotify._read)
        r.watcher._overflowed()

    return overflow


async def test_an_edit_whose_events_an_overflow_dropped_is_read_at_the_full_look(
    r: Reloading,
) -> None:
    r.write('reservedSystemCPUs = "0,4"\n')
    await r.reloaded("config_reloads")
    before = os.stat(r.path)
    with r.path.open("r+") as edited:
        edited.write(f'sysfsRoot = "{r.sysfs}"\nreservedSystemCPUs = "0,5"\n')
        edited.flush()
        await events_handled(r)  # its writes seen: being written
        overflow = lose_events(r)
    # Written in place, same size, and its time put back to the last read's: only the
    # bytes tell.
    os.utime(r.path, ns=(before.st_atime_ns, before.st_mtime_ns))
    overflow()
    await r.reloaded("config_reloads", 2)
    assert r.env.engine.policy.reserved == CPUSet.parse("0,5")


async def test_a_bad_file_is_refused_once_whatever_the_full_looks(r: Reloading) -> None:
    r.write("reservedSystemCPUs = [\n")
    await r.reloaded("config_errors")
    for _ in range(2):
        await r.watcher.look_everywhere()
        await events_handled(r)
    assert r.env.engine.counters["config_errors"] == 1


async def test_a_reload_asked_for_tells_the_refusal_again_without_counting_it(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    """`systemctl reload` on a file refused before: silence would read as "nothing to
    change", as if the file were good and running; the refusal is logged again, and
    counted once still."""
    with caplog.at_level(logging.INFO):
        r.write("reservedSystemCPUs = [\n")
        await r.reloaded("config_errors")
        r.reloader.read_again()
        await until(lambda: r.watcher.jobs.pending == 0, "watch jobs done")
    refusals = [rec for rec in caplog.records if rec.getMessage().startswith("config file refused")]
    assert len(refusals) == 2
    assert r.env.engine.counters["config_errors"] == 1


async def test_a_bad_file_touched_is_refused_once(r: Reloading) -> None:
    r.write("reservedSystemCPUs = [\n")
    await r.reloaded("config_errors")
    for _ in range(3):
        os.utime(r.path)  # touch: a close after writing, the same bytes
        with r.path.open("a"):
            pass
        await events_handled(r)
    assert r.env.engine.counters["config_errors"] == 1


async def test_a_sysfs_that_could_not_be_read_is_tried_again_at_the_full_look(
    r: Reloading,
) -> None:
    online = r.sysfs / "devices/system/cpu/online"
    aside = online.with_name("online.aside")
    online.rename(aside)
    r.write('reservedSystemCPUs = "0,4"\n')
    await r.reloaded("config_errors")
    await r.watcher.look_everywhere()  # still unreadable: not counted again
    await events_handled(r)
    assert r.env.engine.counters["config_errors"] == 1
    aside.rename(online)
    await r.watcher.look_everywhere()
    await r.reloaded("config_reloads")
    assert r.env.engine.policy.reserved == CPUSet.parse("0,4")


def group_made_later(monkeypatch: pytest.MonkeyPatch, group: str) -> Callable[[], None]:
    """No group ``group`` on this node until the function returned is called (groupadd)."""
    real = grp.getgrnam
    made: list[str] = []

    def getgrnam(name: str) -> grp.struct_group:
        if name in made:
            return grp.struct_group((name, "x", 4242, []))
        return real(name)

    monkeypatch.setattr(grp, "getgrnam", getgrnam)  # shim.config asks it
    return lambda: made.append(group)


async def test_a_file_refused_for_the_machines_sake_is_applied_once_the_machine_allows_it(
    r: Reloading, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A socketGroup named before `groupadd` made it: the same bytes are good once the group
    exists, and the next full look applies them, the reserved CPUs of the same edit too."""
    group = "cpushim-reload-test"
    groupadd = group_made_later(monkeypatch, group)
    r.write(f'reservedSystemCPUs = "0-1"\nsocketGroup = "{group}"\n')
    await r.reloaded("config_errors")
    await r.watcher.look_everywhere()  # no group yet: not counted again
    await events_handled(r)
    assert r.env.engine.counters["config_errors"] == 1
    groupadd()
    await r.watcher.look_everywhere()
    await r.reloaded("config_reloads")
    assert r.env.engine.policy.reserved == CPUSet.parse("0-1")
    assert r.reloader.options.socket_group == group


async def test_a_file_refused_for_the_machines_sake_applies_without_a_full_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With resyncPeriod 0 no full look reads it again: the file would wait for an edit or
    a SIGHUP once the group is made, though nothing in it is wrong."""
    groupadd = group_made_later(monkeypatch, "cpushim-reload-test")
    async with reloading(tmp_path, retry_delay=0.01) as r:
        r.write('reservedSystemCPUs = "0-1"\nsocketGroup = "cpushim-reload-test"\n')
        await r.reloaded("config_errors")
        groupadd()
        await r.reloaded("config_reloads")
        assert r.env.engine.policy.reserved == CPUSet.parse("0-1")
        assert r.env.engine.counters["config_errors"] == 1
        assert r.env.engine.counters["full_resyncs"] == 0
        await until(lambda: not r.reloader._retry.running, "the retry ended")


async def test_a_sysfs_that_could_not_be_read_is_tried_again_without_a_full_look(
    tmp_path: Path,
) -> None:
    async with reloading(tmp_path, retry_delay=0.01) as r:
        online = r.sysfs / "devices/system/cpu/online"
        aside = online.with_name("online.aside")
        online.rename(aside)
        r.write('reservedSystemCPUs = "0,4"\n')
        await r.reloaded("config_errors")
        aside.rename(online)
        await r.reloaded("config_reloads")
        assert r.env.engine.policy.reserved == CPUSet.parse("0,4")
        assert r.env.engine.counters["full_resyncs"] == 0


async def test_with_a_periodic_look_a_refused_file_waits_for_it(tmp_path: Path) -> None:
    """The full look reads a refused file again: no retry of its own beside it."""
    async with reloading(tmp_path, resync_period=3600, retry_delay=0.01) as r:
        r.write("reservedSystemCPUs = [\n")
        await r.reloaded("config_errors")
        assert not r.reloader._retry.running


async def test_a_stopped_reloader_reads_a_refused_file_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with reloading(tmp_path, retry_delay=3600) as r:
        r.write("reservedSystemCPUs = [\n")
        await r.reloaded("config_errors")
        assert r.reloader._retry.running
        reads: list[None] = []
        real = r.reloader.reload

        async def counted() -> None:
            reads.append(None)
            await real()

        monkeypatch.setattr(r.reloader, "reload", counted)
        r.reloader.stop()
        # Its hour-long wait ends with the reloader, and no read follows.
        await until(lambda: not r.reloader._retry.running, "the retry ended")
        assert reads == []


async def test_a_file_truncated_or_linked_without_a_close_is_read_at_the_full_look(
    r: Reloading,
) -> None:
    head = f'sysfsRoot = "{r.sysfs}"\nreservedSystemCPUs = "0,4"\n'
    r.write('reservedSystemCPUs = "0,4"\nfailurePolicy = "fail-open"\n')
    await r.reloaded("config_reloads")
    os.truncate(r.path, len(head.encode()))  # truncate(2) by path: no close
    await events_handled(r)
    await r.watcher.look_everywhere()
    await r.reloaded("config_reloads", 2)
    assert r.env.engine.options.failure_policy == "fail-closed"
    # A hard link made, then its other name removed before the event is handled: it looks
    # like a plain file made, whose close never comes.
    temporary = r.path.parent / ".config.toml.new"
    temporary.write_text(head + 'failurePolicy = "fail-open"\n')
    await events_handled(r)
    r.path.unlink()
    os.link(temporary, r.path)
    temporary.unlink()
    await events_handled(r)
    await r.watcher.look_everywhere()
    await r.reloaded("config_reloads", 3)
    assert str(r.env.engine.options.failure_policy) == "fail-open"


def test_a_fifo_at_the_config_path_is_not_waited_for(tmp_path: Path) -> None:
    # The reloader compares the file's bytes on the event loop: a FIFO put at the path must
    # not block it until a writer comes.
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    assert without_waiting_on(fifo, lambda: _content(str(fifo))) is None


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("/proc/self/mem", "Input/output error"),  # a regular file whose read fails
        ("/nonexistent/config.toml", "No such file or directory"),
        ("/dev/null", "not a regular file"),
    ],
)
async def test_a_config_file_that_cannot_be_read_is_refused_saying_why(
    r: Reloading, caplog: pytest.LogCaptureFixture, target: str, reason: str
) -> None:
    link = r.path.with_name(".config.toml.new")
    os.symlink(target, link)
    os.replace(link, r.path)
    with caplog.at_level(logging.ERROR):
        await r.reloaded("config_errors")
    (refusal,) = [
        record.__dict__["fields"]
        for record in caplog.records
        if record.getMessage() == "config file refused; the running config stays"
    ]
    assert refusal["error"] == f"{r.path}: cannot read the config file: {reason}"


async def test_a_fifo_renamed_over_the_config_is_refused_and_later_edits_are_read(
    r: Reloading,
) -> None:
    # Read again in a worker thread by its path, it held that thread (and every reload after
    # it: they wait for the one under way) until a writer came.
    fifo = r.path.parent.parent / "fifo"
    os.mkfifo(fifo)
    link = r.path.with_name(".config.toml.new")
    os.link(fifo, link)
    os.replace(link, r.path)
    try:
        await r.reloaded("config_errors")
    finally:
        if any(waiting_for_a_fifo_writer(int(t)) for t in os.listdir("/proc/self/task")):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    r.write('reservedSystemCPUs = "0,4"\n')
    await r.reloaded("config_reloads")
    assert r.env.engine.policy.reserved == CPUSet.parse("0,4")


async def test_a_reload_under_way_when_the_reloader_stops_applies_nothing(
    r: Reloading,
) -> None:
    gate = threading.Event()
    build = r.reloader._build_policy

    def slow_build(options: RunOptions) -> CPUPolicy:
        gate.wait(5)
        return build(options)

    r.reloader._build_policy = slow_build
    r.write('reservedSystemCPUs = "0,4"\n')
    await until(lambda: r.watcher.jobs.pending == 1, "the reload under way")
    r.reloader.stop()  # SIGTERM
    gate.set()
    await until(lambda: r.watcher.jobs.pending == 0, "the reload ended")
    assert r.env.engine.policy.reserved == CPUSet.parse("0")
    assert r.env.engine.counters["config_reloads"] == 0


async def test_an_edit_made_while_cpushim_started_is_read(r: Reloading) -> None:
    # The options were read before the wait for the runtime and the resync; the file
    # changed before the reloader's watch was placed.
    r.reloader.stop()
    r.write('reservedSystemCPUs = "0,4"\n')
    await events_handled(r)
    reloader = ConfigReloader(r.watcher, r.reloader.options, build_policy)
    reloader.start()
    try:
        await r.reloaded("config_reloads")
        assert r.env.engine.policy.reserved == CPUSet.parse("0,4")
    finally:
        reloader.stop()


@pytest.mark.parametrize("how", ["symlink", "hard link"])
async def test_a_file_linked_into_place_is_read(r: Reloading, how: str) -> None:
    other = r.path.parent.parent / "new.toml"
    other.write_text(f'sysfsRoot = "{r.sysfs}"\nreservedSystemCPUs = "0,4"\n')
    r.path.unlink()
    (os.symlink if how == "symlink" else os.link)(other, r.path)
    await r.reloaded("config_reloads")
    assert r.env.engine.policy.reserved == CPUSet.parse("0,4")


@pytest.mark.parametrize("how", ["removed", "renamed away"])
async def test_the_watch_comes_back_with_a_directory_made_again(r: Reloading, how: str) -> None:
    directory = r.path.parent
    if how == "removed":
        shutil.rmtree(directory)
    else:
        directory.rename(directory.with_name("etc.old"))
    await events_handled(r)
    # The file is gone: refused once, and the running config stays.
    assert r.env.engine.counters["config_errors"] == 1
    assert r.env.engine.policy.reserved == CPUSet.parse("0")
    # Full looks meanwhile count nothing more.
    errors = dict(r.env.engine.counters)
    for _ in range(2):
        await r.watcher.look_everywhere()
        await events_handled(r)
    for counter in ("config_errors", "watch_errors"):
        assert r.env.engine.counters[counter] == errors.get(counter, 0)
    directory.mkdir()
    r.write('reservedSystemCPUs = "0,4"\n')
    await r.reloaded("config_reloads")
    assert r.env.engine.policy.reserved == CPUSet.parse("0,4")
    # And the new directory is watched itself: a later edit is seen.
    r.write('reservedSystemCPUs = "0,4"\nfailurePolicy = "fail-open"\n')
    await r.reloaded("config_reloads", 2)
    assert r.env.engine.options.failure_policy == "fail-open"


async def test_a_refused_directory_watch_is_tried_again_with_no_full_look_to_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel refuses the directory's watch at start (its inotify limit reached): with
    resyncPeriod 0 no full look would try again, and edits went unseen until a SIGHUP."""
    directory = tmp_path / "etc"
    refusing = True
    subscribe = Inotify.subscribe

    def refused_while(self: Inotify, path: str, mask: int, callback: Any) -> Any:
        if refusing and path == str(directory):
            raise WatchError(errno.ENOSPC, "inotify watch limit reached", path)
        return subscribe(self, path, mask, callback)

    monkeypatch.setattr(Inotify, "subscribe", refused_while)
    async with reloading(tmp_path, retry_delay=0.01) as r:
        assert r.env.engine.counters["watch_errors"] >= 1
        refusing = False
        r.write('reservedSystemCPUs = "0,4"\n')
        await r.reloaded("config_reloads")
        assert r.env.engine.policy.reserved == CPUSet.parse("0,4")
        assert r.env.engine.counters["full_resyncs"] == 0
        # Watched: a later edit is seen.
        r.write('reservedSystemCPUs = "0,4"\nfailurePolicy = "fail-open"\n')
        await r.reloaded("config_reloads", 2)
        assert r.env.engine.options.failure_policy == "fail-open"


async def test_a_config_map_volume_swapping_its_data_link_is_read(r: Reloading) -> None:
    # A ConfigMap volume: config.toml -> ..data/config.toml, ..data -> a timestamped
    # directory; an update writes a new directory and renames a new ..data link into place.
    directory = r.path.parent
    first = directory / "..2026_11_24_1"
    first.mkdir()
    (first / "config.toml").write_text(r.path.read_text())
    (directory / "..data").symlink_to(first.name)
    r.path.unlink()
    r.path.symlink_to("..data/config.toml")
    await events_handled(r)
    second = directory / "..2026_11_24_2"
    second.mkdir()
    (second / "config.toml").write_text(f'sysfsRoot = "{r.sysfs}"\nreservedSystemCPUs = "0,4"\n')
    (directory / "..data_tmp").symlink_to(second.name)
    os.replace(directory / "..data_tmp", directory / "..data")
    await r.reloaded("config_reloads")
    assert r.env.engine.policy.reserved == CPUSet.parse("0,4")


async def test_a_config_directory_symlink_pointed_elsewhere_is_watched_there(
    r: Reloading,
) -> None:
    # /etc/cpushim as a symlink to a versioned directory, switched with `ln -sfn`.
    base = r.path.parent.parent
    first, second = base / "cpushim.v1", base / "cpushim.v2"
    for directory, reserved in ((first, "0"), (second, "0,4")):
        directory.mkdir()
        (directory / "config.toml").write_text(
            f'sysfsRoot = "{r.sysfs}"\nreservedSystemCPUs = "{reserved}"\n'
        )
    linked = base / "cpushim"
    linked.symlink_to(first.name)
    r.reloader.stop()
    options = replace(r.reloader.options, config_path=linked / "config.toml")
    reloader = ConfigReloader(r.watcher, options, build_policy)
    reloader.start()
    try:
        await events_handled(r)
        (base / "cpushim.tmp").symlink_to(second.name)
        os.replace(base / "cpushim.tmp", linked)
        # No event in the old directory tells of it: the next full look does.
        await r.watcher.look_everywhere()
        await r.reloaded("config_reloads")
        assert r.env.engine.policy.reserved == CPUSet.parse("0,4")
        # The new directory is the one watched now.
        (second / "config.toml").write_text(
            f'sysfsRoot = "{r.sysfs}"\nreservedSystemCPUs = "0,4"\nfailurePolicy = "fail-open"\n'
        )
        await r.reloaded("config_reloads", 2)
        assert r.env.engine.options.failure_policy == "fail-open"
    finally:
        reloader.stop()


async def test_a_bad_edit_made_again_after_a_good_one_is_counted_again(r: Reloading) -> None:
    good = r.path.read_text()
    for count in (1, 2):
        r.write("reservedSystemCPUs = [\n")
        await r.reloaded("config_errors", count)
        # Put back as it was: accepted, though nothing changes.
        r.path.write_text(good)
        await events_handled(r)
    assert r.env.engine.counters["config_errors"] == 2


async def test_read_again_applies_an_edit_no_watch_saw(r: Reloading) -> None:
    """SIGHUP (systemctl reload): an edit made while the directory's watch was lost (or on a
    file system whose changes inotify does not see) is read at once, not at the next full
    look (here never: resyncPeriod is 0)."""
    r.reloader._unwatch()  # no event reaches cpushim
    r.write('reservedSystemCPUs = "0-1"\n')
    await until(lambda: r.watcher.jobs.pending == 0, "watch jobs done")
    assert r.env.engine.counters["config_reloads"] == 0
    r.reloader.read_again()
    await r.reloaded("config_reloads")
    assert r.env.engine.policy.reserved == CPUSet.parse("0-1")


FULL = 'full-pcpus-only = "true"\n'
STRICT = 'strict-cpu-reservation = "true"\n'


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ('reservedSystemCPUs = "0,1"\n', 'reservedSystemCPUs = "0-1"\n'),
        (
            f"[cpuManagerPolicyOptions]\n{FULL}{STRICT}",
            f"[cpuManagerPolicyOptions]\n{STRICT}{FULL}",
        ),
    ],
)
async def test_an_edit_that_only_respells_a_value_changes_nothing(
    r: Reloading, before: str, after: str
) -> None:
    """A CPU list written another way, or the options' lines in another order, is the same
    setting: no re-plan, no log line, no count."""
    r.write(before)
    await r.reloaded("config_reloads")
    policy = r.env.engine.policy
    r.write(after)
    await until(lambda: r.reloader._last_read == r.path.read_bytes(), "the edit read")
    await until(lambda: r.watcher.jobs.pending == 0, "watch jobs done")
    assert r.env.engine.counters["config_reloads"] == 1
    assert r.env.engine.counters["config_errors"] == 0
    assert r.env.engine.policy is policy


async def test_a_failed_adoption_still_applies_the_rest_of_the_reload(
    r: Reloading, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new policy is in force once change_policy is done: an adoption that fails after
    it (an unexpected error) must not leave the log level, failure policy and resync period
    of the same edit unapplied, nor the reload uncounted."""
    import shim.engine.resync as resync

    async def broken(*args: object, **kwargs: object) -> list[ContainerKey]:
        raise RuntimeError("injected")

    # Where the re-plan's adoption is made (resync.replan_live).
    monkeypatch.setattr(resync, "adopt_sharing", broken)
    root = logging.getLogger()
    level = root.level
    try:
        r.write('reservedSystemCPUs = "0-1"\nlogLevel = "debug"\nfailurePolicy = "fail-open"\n')
        await r.reloaded("config_reloads")
        assert r.env.engine.policy.reserved == CPUSet.parse("0-1")
        assert root.level == logging.DEBUG
        assert r.env.engine.options.failure_policy == "fail-open"
        assert r.env.engine.counters["internal_errors"] == 1
    finally:
        root.setLevel(level)


def test_the_operations_guide_lists_the_keys_a_reload_applies() -> None:
    """docs/operations.md's list of what an edit changes without a restart is the reloader's:
    every other key is named in ``need_restart``."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    start = guide.index("cpushim watches the file and applies edits while it runs")
    listed = guide[start : guide.index("It logs `config reloaded`", start)]
    named = set(re.findall(r"`(\w+)`", listed)) & {key.name for key in KEYS}
    assert named == {key.name for key in KEYS if key.field in POLICY_FIELDS | LIVE_FIELDS}


def test_the_sample_config_says_which_keys_a_reload_applies() -> None:
    """contrib/config.toml, installed as /etc/cpushim/config.toml, is where operators edit:
    its header names the keys an edit changes at once, and they are the reloader's."""
    sample = (Path(__file__).resolve().parents[2] / "contrib" / "config.toml").read_text()
    start = sample.index("# cpushim watches this file")
    listed = sample[start : sample.index("next restart", start)]
    named = set(re.findall(r"\w+", listed)) & {key.name for key in KEYS}
    assert named == {key.name for key in KEYS if key.field in POLICY_FIELDS | LIVE_FIELDS}


async def test_a_reload_that_turns_full_pcpus_only_on_moves_a_container_off_half_cores(
    r: Reloading,
) -> None:
    """A kept set must be one the new options would hand out, as at a restart: a container
    on two lone threads moves onto a whole core."""
    env = r.env
    halves_pod, halves_id = await pinned_on_half_cores(env)
    topology = env.engine.policy.topology
    r.write('reservedSystemCPUs = "0"\n[cpuManagerPolicyOptions]\nfull-pcpus-only = true\n')
    await r.reloaded("config_reloads")
    moved = CPUSet.parse(env.kernel_cpus(halves_id) or "")
    assert len(moved) == 2
    assert topology.whole_cores_in(moved) == moved
    assert env.engine.state.assignments[ContainerKey(halves_pod.uid, "main")].cpus == moved
    assert env.engine.counters["pinning_errors"] == 0


async def test_a_single_cpu_container_shares_once_full_pcpus_only_is_turned_on(
    r: Reloading,
) -> None:
    """On an SMT machine full-pcpus-only hands out no odd count: the lone thread it ran on
    is not kept, no other set can be given, and the container shares, counted."""
    env = r.env
    shared_id, pinned_id = await pinned_and_shared(env)
    r.write('reservedSystemCPUs = "0"\n[cpuManagerPolicyOptions]\nfull-pcpus-only = true\n')
    await r.reloaded("config_reloads")
    assert env.engine.state.assignments == {}
    assert env.kernel_cpus(pinned_id) == env.kernel_cpus(shared_id) == str(ALL)
    assert env.engine.counters["pinning_errors"] == 1
