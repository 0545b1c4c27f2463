"""Shutdown on SIGTERM: calls in flight, then the engine's last work, within one grace."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import shim.run
from shim.checkpoint import CheckpointFile, StateDirectoryInUseError, hold_directory
from shim.cri.server import AlreadyServingError
from shim.engine import Engine
from shim.policy import CPUPolicy
from shim.run import LAST_WRITES_S, RunOptions, shut_down
from shim.state import CPUState
from shim.topology import SysfsWarnings
from tests.fake_runtime import FakeRuntime
from tests.harness.sysfs import MachineSpec, write_sysfs
from tests.unit.engine_env import in_process_options, until

pytestmark = pytest.mark.anyio


@dataclass
class Clock:
    now: float = 1000.0


@dataclass
class SlowCalls:
    """A relay whose calls in flight take ``takes`` seconds of the clock to finish (or the
    whole grace, if longer); ``signal_again`` stands for a second SIGTERM meanwhile."""

    clock: Clock
    takes: float
    signal_again: bool = False

    async def shutdown(self, grace: float, cut_short: asyncio.Event | None = None) -> bool:
        self.clock.now += min(self.takes, grace)
        if self.signal_again:
            assert cut_short is not None
            cut_short.set()
        return self.takes <= grace


@dataclass
class Draining:
    clock: Clock
    budgets: list[float] = field(default_factory=list)

    async def drain(self, grace: float) -> None:
        self.budgets.append(grace)
        self.clock.now += grace


async def stop(
    monkeypatch: pytest.MonkeyPatch, takes: float, grace: float, signal_again: bool = False
) -> tuple[bool, float, float]:
    """Run a shutdown on the clock: (every call finished, the drain's budget, time taken)."""
    clock = Clock()
    monkeypatch.setattr(asyncio.get_running_loop(), "time", lambda: clock.now)
    engine = Draining(clock)
    watching_stopped = []

    async def stop_watching() -> None:
        watching_stopped.append(clock.now)

    began = clock.now
    finished = await shut_down(
        SlowCalls(clock, takes, signal_again), engine, grace, asyncio.Event(), stop_watching
    )
    assert watching_stopped, "the watchers were not stopped"
    (budget,) = engine.budgets
    return finished, budget, clock.now - began


async def test_the_engine_gets_what_the_calls_left_of_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    finished, budget, took = await stop(monkeypatch, takes=3.0, grace=10.0)
    assert finished
    assert budget == pytest.approx(7.0)
    assert took == pytest.approx(10.0)


async def test_calls_that_take_the_whole_grace_leave_the_engine_its_last_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, the engine got a second full grace: 20 s of a 30 s stop timeout went at 15.
    finished, budget, took = await stop(monkeypatch, takes=60.0, grace=15.0)
    assert not finished
    assert budget == LAST_WRITES_S
    assert took == pytest.approx(15.0 + LAST_WRITES_S)


async def test_a_second_signal_leaves_the_engine_only_its_last_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    finished, budget, took = await stop(monkeypatch, takes=2.0, grace=120.0, signal_again=True)
    assert finished
    assert budget == LAST_WRITES_S
    assert took == pytest.approx(2.0 + LAST_WRITES_S)


@dataclass
class LongWork:
    """An engine whose last work takes its whole budget (a full look at a slow runtime under
    way at the signal), on the loop's own clock."""

    budgets: list[float] = field(default_factory=list)

    async def drain(self, grace: float) -> None:
        self.budgets.append(grace)
        await asyncio.sleep(grace)


async def test_a_second_signal_while_the_engine_works_leaves_it_only_its_last_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The calls ended at once, so the engine got the rest of the grace: a second signal
    then ends it as it ends the wait for calls, not the rest of a long grace later."""
    monkeypatch.setattr(shim.run, "LAST_WRITES_S", 0.05)
    loop = asyncio.get_running_loop()
    engine = LongWork()
    cut_short = asyncio.Event()

    async def stop_watching() -> None:
        pass

    stopping = asyncio.ensure_future(
        shut_down(SlowCalls(Clock(), takes=0.0), engine, 120.0, cut_short, stop_watching)
    )
    try:
        await until(lambda: bool(engine.budgets), "the engine's last work under way")
        signalled = loop.time()
        cut_short.set()
        done, _ = await asyncio.wait({stopping}, timeout=10)
        assert done, "the second signal left the engine the rest of the grace"
        assert stopping.result()
        assert loop.time() - signalled >= 0.04  # its last writes' time, less timer slack
        assert engine.budgets[0] == pytest.approx(120.0, abs=1.0)
    finally:
        stopping.cancel()


async def test_a_signal_during_the_start_up_resync_stops_without_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemctl stop while cpushim resyncs with a slow runtime: the signal is not left
    waiting for the resync (sandbox by sandbox, container by container, each call up to 10 s
    on a loaded runtime: past the unit's stop timeout), and cpushim never serves after it."""
    monkeypatch.setattr(shim.run, "cgroup_layout", lambda: None)  # no look at the node's
    sysfs = write_sysfs(MachineSpec(sockets=1, cores_per_die=2, threads_per_core=2), tmp_path)
    async with FakeRuntime() as fake:
        listing = fake.gate("ListPodSandbox")  # the resync's first call, never answered
        listen = fake.socket_path.with_name("cri.sock")
        options = in_process_options(fake, listen, tmp_path, sysfs)
        running = asyncio.ensure_future(shim.run.run(options))
        try:
            await until(lambda: bool(fake.calls_of("ListPodSandbox")), "the resync under way")
            # The loop's handler, not the default action that would end the test run.
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
            os.kill(os.getpid(), signal.SIGTERM)
            # Well within the resync's own call timeout (10 s), which would end it too.
            done, _ = await asyncio.wait({running}, timeout=5)
            assert done, "the signal waited for the resync"
            assert running.result() == 0
            assert not listen.exists()
        finally:
            listing.set()
            if not running.done():
                await asyncio.wait({running}, timeout=10)


async def test_a_socket_that_cannot_serve_after_the_resync_stops_what_the_resync_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process takes the listen path while cpushim resyncs: the socket's start
    fails after the watcher started and the engine may have work under way. cpushim ends
    with the error, but as a shutdown does: the watcher stopped (no periodic resync or
    watch left running on a closed channel) and the engine's last work drained."""
    monkeypatch.setattr(shim.run, "cgroup_layout", lambda: None)  # no look at the node's
    sysfs = write_sysfs(MachineSpec(sockets=1, cores_per_die=2, threads_per_core=2), tmp_path)
    drained: list[float] = []
    drain = Engine.drain

    async def recorded_drain(engine: Engine, grace: float) -> None:
        drained.append(grace)
        await drain(engine, grace)

    monkeypatch.setattr(Engine, "drain", recorded_drain)
    async with FakeRuntime() as fake:
        listing = fake.gate("ListPodSandbox")
        listen = fake.socket_path.with_name("cri.sock")
        options = in_process_options(fake, listen, tmp_path, sysfs)
        before = asyncio.all_tasks()
        running = asyncio.ensure_future(shim.run.run(options))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as squatter:
            try:
                await until(lambda: bool(fake.calls_of("ListPodSandbox")), "the resync under way")
                squatter.bind(str(listen))
                squatter.listen()
            finally:
                listing.set()
            with pytest.raises(AlreadyServingError, match="another process already serves"):
                await asyncio.wait_for(running, 20)
        package = str(Path(shim.__file__).parent) + os.sep
        left = {
            task
            for task in asyncio.all_tasks() - before
            if task.get_coro().cr_code.co_filename.startswith(package)  # type: ignore[union-attr]
        }
        assert left == set()
        assert drained == [LAST_WRITES_S]


async def test_the_state_directory_is_held_until_the_last_checkpoint_write_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's drain may end (its grace spent) with a checkpoint write in its worker
    thread: run() lets the state directory go only once that write is done, or another
    cpushim could take the directory and load a checkpoint that is then written over."""
    sysfs = write_sysfs(MachineSpec(sockets=1, cores_per_die=2, threads_per_core=2), tmp_path)
    options = RunOptions(state_dir=tmp_path / "state", sysfs_root=sysfs, metrics_address="")
    writing, go_on = threading.Event(), threading.Event()
    held_while_writing: list[bool] = []
    left_running: list[asyncio.Future[None]] = []
    last: list[CPUState] = []
    returned = asyncio.Event()

    def held_until_told(real: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
        def write(data: bytes) -> bytes:
            writing.set()
            assert go_on.wait(10)
            try:
                os.close(hold_directory(options.state_dir))
            except StateDirectoryInUseError:
                held_while_writing.append(True)
            else:
                held_while_writing.append(False)
            return real(data)

        return write

    async def ends_with_a_write_in_flight(
        options: RunOptions, policy: CPUPolicy, checkpoint: CheckpointFile, warned: SysfsWarnings
    ) -> int:
        monkeypatch.setattr(checkpoint, "_write", held_until_told(checkpoint._write))
        last.append(CPUState.empty(policy))
        # As an engine task the drain left running does: _run does not wait for it.
        left_running.append(asyncio.ensure_future(checkpoint.save(last[0])))
        await until(writing.is_set, "the last write under way")
        returned.set()
        return 0

    monkeypatch.setattr(shim.run, "_run", ends_with_a_write_in_flight)
    running = asyncio.ensure_future(shim.run.run(options))
    try:
        # What run() does once _run has returned, it does with the write still under way.
        await asyncio.wait_for(returned.wait(), 10)
        go_on.set()
        assert await asyncio.wait_for(running, 10) == 0
        await asyncio.wait_for(left_running[0], 10)
    finally:
        go_on.set()
    assert held_while_writing == [True]
    assert CheckpointFile(options.state_dir).load() == last[0]
    os.close(hold_directory(options.state_dir))  # let go once it is done
