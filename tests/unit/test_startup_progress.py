"""Start-up under systemd's start timeout: while the resync makes progress cpushim extends
the timeout (EXTEND_TIMEOUT_USEC=) and says where it is (STATUS=); stuck, it says nothing,
so that systemd still ends a start-up that will never finish."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import shim.run
from shim.cri import runtime_v1_pb2 as pb
from shim.engine import EngineOptions
from shim.engine import resync as resyncing
from shim.progress import StartupProgress
from shim.run import PROGRESS_LOOK_INTERVAL, StartTimeoutExtender, start_extension
from tests.fake_cri import short_tmpdir
from tests.fake_runtime import FakeRuntime
from tests.harness.sysfs import MachineSpec, write_sysfs
from tests.unit.engine_env import Env, env, in_process_options, until

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


@pytest.fixture
def notifications() -> Iterator[tuple[socket.socket, str]]:
    """systemd's end of NOTIFY_SOCKET: a datagram socket the test reads, never blocking."""
    with short_tmpdir() as workdir:
        path = workdir / "notify"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(path))
            sock.setblocking(False)
            yield sock, str(path)


def pending(sock: socket.socket) -> list[str]:
    """The notifications sent so far and not read yet."""
    said = []
    while True:
        try:
            said.append(sock.recv(4096).decode())
        except BlockingIOError:
            return said


def test_progress_reads_as_a_status_line() -> None:
    progress = StartupProgress()
    progress.begin("resync: listing sandboxes")
    assert progress.describe() == "resync: listing sandboxes"
    progress.begin("resync", 120, "sandboxes")
    progress.advance()
    progress.advance(39)
    assert progress.describe() == "resync: 40 of 120 sandboxes"
    # Every phase begun and item done is a step, a new phase's included.
    assert progress.steps == 42


def test_the_extension_outlasts_the_longest_step_and_one_look() -> None:
    """A start-up that keeps moving is never cut off between two looks: a step seen done
    just after one look is told at the next, within the extension the look before gave."""
    sandbox_step = resyncing.SANDBOX_INFO_TIMEOUT + resyncing.CALL_TIMEOUT
    for update_timeout in (EngineOptions().update_timeout, 30.0):
        longest_step = max(sandbox_step, update_timeout)
        extension = start_extension(update_timeout)
        assert extension > longest_step + PROGRESS_LOOK_INTERVAL
        # Bounded by the step, not open-ended: a stuck start-up is still ended.
        assert extension < 3 * longest_step + PROGRESS_LOOK_INTERVAL


async def test_systemd_hears_of_progress_and_of_nothing_while_stuck(
    env: Env, notifications: tuple[socket.socket, str]
) -> None:
    sock, path = notifications
    for name in ("db", "web"):
        pod = await env.kubelet.run_pod(name, "guaranteed")
        await env.kubelet.start_new(pod, "main", 1000)
    progress = StartupProgress()
    extender = StartTimeoutExtender(progress, 31.5, environ={"NOTIFY_SOCKET": path})
    assert extender.look() is False  # nothing done yet
    statuses = env.fake.gate("ContainerStatus")
    asked = len(env.fake.calls_of("ContainerStatus"))
    restarting = asyncio.ensure_future(env.restart(progress=progress))
    try:
        await until(
            lambda: len(env.fake.calls_of("ContainerStatus")) > asked, "the first container asked"
        )
        assert extender.look() is True
        assert pending(sock) == ["EXTEND_TIMEOUT_USEC=31500000\nSTATUS=resync: 0 of 2 containers"]
        # Stuck on that one call: however often it looks, systemd hears nothing more, and
        # its start timeout runs out 31.5 s after this last word (or at TimeoutStartSec).
        assert extender.look() is False
        assert extender.look() is False
        assert pending(sock) == []
    finally:
        statuses.set()
        env.fake.ungate("ContainerStatus")
        await restarting
    assert extender.look() is True
    [said] = pending(sock)
    assert said.startswith("EXTEND_TIMEOUT_USEC=31500000\nSTATUS=resync: 2 of 2 ")


async def test_cpushim_extends_its_start_while_hung_shims_hold_the_resync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, notifications: tuple[socket.socket, str]
) -> None:
    """Sandboxes whose shims hang cost the resync their verbose status's deadline each, a
    few at a time: on a node with dozens, the start-up outlasts TimeoutStartSec. Each look
    that finds sandboxes read since the last extends it, saying how far the resync got,
    and READY=1 follows once it serves."""
    sock, path = notifications
    monkeypatch.setattr(shim.run, "cgroup_layout", lambda: None)  # no look at the node's
    monkeypatch.setattr(shim.run, "PROGRESS_LOOK_INTERVAL", 0.05)
    monkeypatch.setattr(resyncing, "SANDBOX_INFO_TIMEOUT", 0.3)
    monkeypatch.setattr(resyncing, "STATUS_CONCURRENCY", 2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    sysfs = write_sysfs(MachineSpec(sockets=1, cores_per_die=2, threads_per_core=2), tmp_path)
    hung = 6
    async with FakeRuntime() as fake:
        for n in range(hung):
            config = pb.PodSandboxConfig(
                metadata=pb.PodSandboxMetadata(name=f"db-{n}", uid=f"uid-{n}", namespace="ns")
            )
            fake.shims_hung.add(fake.add_sandbox(config))
        listen = fake.socket_path.with_name("cri.sock")
        options = in_process_options(fake, listen, tmp_path, sysfs)
        loop = asyncio.get_running_loop()
        said: list[str] = []

        async def read_until_ready() -> None:
            while not said or "READY=1" not in said[-1].splitlines():
                said.append((await loop.sock_recv(sock, 4096)).decode())

        running = asyncio.ensure_future(shim.run.run(options))
        try:
            await asyncio.wait_for(read_until_ready(), 20)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            done, _ = await asyncio.wait({running}, timeout=20)
        assert done
        assert running.result() == 0
    assert said[0] == f"STATUS=waiting for the runtime {fake.endpoint}"
    extension = start_extension(EngineOptions().update_timeout)
    extension_line = f"EXTEND_TIMEOUT_USEC={int(extension * 1_000_000)}"
    extended = [s.splitlines() for s in said if s.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extended, said
    assert all(lines[0] == extension_line for lines in extended)
    sandboxes_read = [
        int(lines[1].split()[1])
        for lines in extended
        if lines[1].startswith("STATUS=resync: ") and lines[1].endswith(f" of {hung} sandboxes")
    ]
    # Told as the hung shims were given up, a few at a time, never going back.
    assert sandboxes_read, extended
    assert sandboxes_read == sorted(sandboxes_read)
    assert sandboxes_read[0] < hung
    assert said[-1].startswith("READY=1")
