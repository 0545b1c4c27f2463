"""``cpushim run`` as a real process in front of the fake runtime: start-up, the listen
socket's rules, logs, and shutdown on SIGTERM with a call in flight."""

from __future__ import annotations

import grp
import os
import signal
import socket
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import orjson
import pytest

from shim import __version__
from shim.cri.server import AlreadyServingError, prepare_socket_path
from tests.fake_cri import FakeRuntimeServer, short_tmpdir
from tests.harness.containerd import cpushim_command, wait_for
from tests.unit.relay_env import IMAGE, RUNTIME, LoopThread, failure, unary

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake() -> Iterator[FakeRuntimeServer]:
    loop = LoopThread()
    with short_tmpdir() as workdir:
        server = FakeRuntimeServer(workdir / "runtime.sock")
        loop.run(server.start())
        try:
            yield server
        finally:
            loop.run(server.stop())
            loop.stop()


def start_cpushim(
    listen: Path, runtime: str, log: Path, *extra: str, state: str = "state"
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cpushim_command(f"unix://{listen}", runtime, *extra, state_dir=listen.parent / state),
        stderr=log.open("wb"),
        cwd=REPO,
    )


def wait_serving(proc: subprocess.Popen[bytes], listen: Path, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"cpushim exited {proc.returncode}:\n{log.read_text()}")
        if listen.exists():
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(listen))
                    return
                except OSError:
                    pass
        time.sleep(0.02)
    raise AssertionError(f"cpushim did not serve {listen}:\n{log.read_text()}")


def refuses(listen: Path) -> bool:
    """Whether nothing takes connections at ``listen`` (as once cpushim begins to shut down)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(listen))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
    return False


def log_events(log: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def logged(log: Path, message: str) -> bool:
    """Whether a whole line of the log says ``message`` (the last may be half written)."""
    whole = log.read_text().rpartition("\n")[0]
    return any(
        orjson.loads(line)["msg"] == message for line in whole.splitlines() if line.startswith("{")
    )


def records(log: Path) -> list[dict[str, object]]:
    whole = log.read_text().rpartition("\n")[0]
    return [orjson.loads(line) for line in whole.splitlines() if line.startswith("{")]


def call_in_flight(
    fake: FakeRuntimeServer,
    channel: grpc.Channel,
    command: bytes,
    timeout: float,
    outcome: dict[str, object],
) -> threading.Thread:
    """A ListContainers call running ``command`` at the fake runtime, made on a thread of its
    own; returns once the runtime has it. Its reply or error lands in ``outcome``."""

    def call() -> None:
        try:
            outcome["reply"] = unary(channel, RUNTIME + "ListContainers", command, timeout=timeout)
        except grpc.RpcError as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(
        lambda: any(seen[1] == command for seen in fake.runtime.calls),
        10,
        "the call at the runtime",
    )
    return caller


def test_sigterm_finishes_the_call_in_flight_and_exits_zero(fake: FakeRuntimeServer) -> None:
    listen = fake.socket_path.parent / "sock" / "cri.sock"
    log = fake.socket_path.parent / "cpushim.log"
    proc = start_cpushim(listen, fake.endpoint, log)
    try:
        wait_serving(proc, listen, log)
        # The socket accepts connections a moment before the line is logged.
        wait_for(lambda: logged(log, "serving"), 10, "the serving line")
        (serving,) = [r for r in records(log) if r["msg"] == "serving"]
        assert serving["version"] == __version__
        outcome: dict[str, object] = {}
        with grpc.insecure_channel(f"unix://{listen}") as ch:
            assert unary(ch, RUNTIME + "Version", b"echo:v", timeout=10).endswith(b"echo:v")

            caller = call_in_flight(fake, ch, b"hold:term", 20, outcome)
            fake.runtime.wait_held(b"term")
            proc.send_signal(signal.SIGTERM)
            # The call is answered only once cpushim's relay has begun to shut down.
            wait_for(lambda: refuses(listen), 10, "cpushim to stop taking connections")
            assert proc.poll() is None, log.read_text()
            fake.runtime.release(b"term")
            caller.join(20)
        assert proc.wait(20) == 0
        assert "error" not in outcome, outcome
        assert outcome["reply"] == b"reply-to:/runtime.v1.RuntimeService/ListContainers:hold:term"
        messages = [e["msg"] for e in log_events(log)]
        assert "shutting down" in messages
        assert "stopped" in messages
        assert not listen.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def healthz(address: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_healthz_fails_from_the_signal_on(fake: FakeRuntimeServer) -> None:
    listen = fake.socket_path.parent / "sock" / "cri.sock"
    log = fake.socket_path.parent / "cpushim.log"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    proc = start_cpushim(listen, fake.endpoint, log, "--metrics-address", address)
    try:
        wait_serving(proc, listen, log)
        wait_for(lambda: logged(log, "serving"), 10, "the serving line")
        assert healthz(address) == (200, "ok\n")
        outcome: dict[str, object] = {}
        with grpc.insecure_channel(f"unix://{listen}") as ch:
            caller = call_in_flight(fake, ch, b"hold:drain", 20, outcome)
            fake.runtime.wait_held(b"drain")
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: refuses(listen), 10, "cpushim to stop taking connections")
            # The call in flight holds the shutdown: the endpoint still answers, and says why
            # the node's CRI socket takes no new connection.
            assert healthz(address) == (503, "shutting down\n")
            fake.runtime.release(b"drain")
            caller.join(20)
        assert proc.wait(20) == 0, log.read_text()
        assert "reply" in outcome, outcome
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_sigterm_ends_the_grace_period_at_once(fake: FakeRuntimeServer) -> None:
    listen = fake.socket_path.parent / "sock" / "cri.sock"
    log = fake.socket_path.parent / "cpushim.log"
    proc = start_cpushim(listen, fake.endpoint, log, "--shutdown-grace", "120")
    try:
        wait_serving(proc, listen, log)
        outcome: dict[str, object] = {}
        with grpc.insecure_channel(f"unix://{listen}") as ch:
            caller = call_in_flight(fake, ch, b"hold:forever", 110, outcome)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not logged(log, "shutting down"):
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "cpushim never began to shut down"
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, log.read_text()
            caller.join(20)
        assert isinstance(outcome.get("error"), grpc.RpcError), outcome
        events = log_events(log)
        assert any("cut short" in str(e["msg"]) for e in events)
        stopped = next(e for e in events if e["msg"] == "stopped")
        assert stopped["calls_finished"] is False
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    ("second_state", "says"),
    [
        ("state", "another cpushim is using the state directory"),
        ("other-state", "already serves"),
    ],
    ids=["same state directory", "own state directory"],
)
def test_refuses_a_socket_or_state_another_process_holds(
    fake: FakeRuntimeServer, second_state: str, says: str
) -> None:
    listen = fake.socket_path.parent / "live.sock"
    log = fake.socket_path.parent / "first.log"
    first = start_cpushim(listen, fake.endpoint, log)
    try:
        wait_serving(first, listen, log)
        second_log = fake.socket_path.parent / "second.log"
        second = start_cpushim(listen, fake.endpoint, second_log, state=second_state)
        assert second.wait(20) == 1
        errors = [e for e in log_events(second_log) if e["level"] == "error"]
        assert errors
        assert says in str(errors[0]["error"])
        with grpc.insecure_channel(f"unix://{listen}") as ch:  # the first one still serves
            assert unary(ch, RUNTIME + "Version", b"echo:x", timeout=10).endswith(b"echo:x")
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(20) == 0


def test_gives_up_clearly_when_the_runtime_never_appears() -> None:
    with short_tmpdir() as workdir:
        log = workdir / "cpushim.log"
        proc = start_cpushim(
            workdir / "cri.sock", f"unix://{workdir}/absent.sock", log, "--upstream-wait", "0.5"
        )
        assert proc.wait(20) == 1
        events = log_events(log)
        assert any(e["msg"] == "waiting for the runtime" for e in events)
        error = next(e for e in events if e["level"] == "error")
        assert "did not answer within 0.5s" in str(error["error"])
        assert not (workdir / "cri.sock").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_waiting_for_the_runtime_stops_cleanly(sig: signal.Signals) -> None:
    with short_tmpdir() as workdir:
        log = workdir / "cpushim.log"
        proc = start_cpushim(
            workdir / "cri.sock", f"unix://{workdir}/absent.sock", log, "--upstream-wait", "120"
        )
        try:
            deadline = time.monotonic() + 20
            while not logged(log, "waiting for the runtime"):
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "cpushim never waited for the runtime"
                time.sleep(0.02)
            proc.send_signal(sig)
            assert proc.wait(20) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert any(e["msg"] == "stopped before the runtime answered" for e in log_events(log))
        assert not (workdir / "cri.sock").exists()


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    with short_tmpdir() as workdir:
        path = workdir / "stale.sock"
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(str(path))
        dead.close()  # the file stays, nobody listens
        prepare_socket_path(str(path))
        assert not path.exists()


def test_non_socket_file_is_never_replaced() -> None:
    with short_tmpdir() as workdir:
        path = workdir / "precious"
        path.write_text("data")
        with pytest.raises(AlreadyServingError, match="not a socket"):
            prepare_socket_path(str(path))
        assert path.read_text() == "data"


def test_parent_directory_is_created_0750() -> None:
    with short_tmpdir() as workdir:
        path = workdir / "a" / "b" / "cri.sock"
        prepare_socket_path(str(path))
        assert oct(os.stat(path.parent).st_mode & 0o777) == oct(0o750)


def test_calls_fail_with_a_clear_unavailable_when_runtime_is_gone(
    fake: FakeRuntimeServer,
) -> None:
    listen = fake.socket_path.parent / "gone.sock"
    log = fake.socket_path.parent / "gone.log"
    proc = start_cpushim(listen, fake.endpoint, log)
    try:
        wait_serving(proc, listen, log)
        os.rename(fake.socket_path, fake.socket_path.with_suffix(".moved"))
        with grpc.insecure_channel(f"unix://{listen}") as ch:
            err = failure(ch, RUNTIME + "Version", b"echo:x", timeout=10)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "cpushim" in err.details()
        assert "runtime" in err.details()
    finally:
        os.rename(fake.socket_path.with_suffix(".moved"), fake.socket_path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_socket_group_is_applied(fake: FakeRuntimeServer) -> None:
    group = grp.getgrnam("daemon")  # present on every Debian system, and not root's group
    # A directory of the socket's own, as systemd's RuntimeDirectory= makes it: the group
    # is let through it too, or its members could not connect.
    directory = fake.socket_path.parent / "run"
    directory.mkdir(mode=0o750)
    listen = directory / "grp.sock"
    log = fake.socket_path.parent / "grp.log"
    proc = start_cpushim(listen, fake.endpoint, log, "--socket-group", group.gr_name)
    try:
        wait_serving(proc, listen, log)
        st = os.stat(listen)
        assert st.st_gid == group.gr_gid
        assert stat.S_IMODE(st.st_mode) == 0o660
        st = os.stat(directory)
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (group.gr_gid, 0o750)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_unknown_socket_group_is_a_clear_error_before_anything_starts(
    fake: FakeRuntimeServer,
) -> None:
    listen = fake.socket_path.parent / "nogrp.sock"
    log = fake.socket_path.parent / "nogrp.log"
    config = fake.socket_path.parent / "nogrp.toml"
    config.write_text('# a group this node lacks\nsocketGroup = "no-such-group-here"\n')
    proc = start_cpushim(listen, fake.endpoint, log, "--config", str(config), state="nogrp")
    assert proc.wait(20) == 1
    (error,) = [e for e in log_events(log) if e["level"] == "error"]
    assert str(error["error"]) == (
        f"{config}:2: socketGroup: no group named 'no-such-group-here' on this node"
    )
    assert not listen.exists()
    assert not (fake.socket_path.parent / "nogrp").exists()  # no state written, no resync


def test_image_calls_go_to_their_own_endpoint(fake: FakeRuntimeServer) -> None:
    loop = LoopThread()
    images = FakeRuntimeServer(fake.socket_path.parent / "images.sock")
    loop.run(images.start())
    listen = fake.socket_path.parent / "split.sock"
    log = fake.socket_path.parent / "split.log"
    proc = start_cpushim(listen, fake.endpoint, log, "--image-endpoint", images.endpoint)
    try:
        wait_serving(proc, listen, log)
        with grpc.insecure_channel(f"unix://{listen}") as ch:
            assert unary(ch, IMAGE + "ListImages", b"echo:i", timeout=10).endswith(b"echo:i")
            assert unary(ch, RUNTIME + "Version", b"echo:v", timeout=10).endswith(b"echo:v")
            err = failure(ch, IMAGE + "ImageStatus", b"error:5:no such image", timeout=10)
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert err.details() == "no such image"
        assert [call[0] for call in images.runtime.calls] == [
            IMAGE + "ListImages",
            IMAGE + "ImageStatus",
        ]
        assert not [call for call in fake.runtime.calls if call[0].startswith(IMAGE)]
        assert (RUNTIME + "Version", b"echo:v") in [call[:2] for call in fake.runtime.calls]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        loop.run(images.stop())
        loop.stop()


def test_a_listen_path_that_cannot_serve_is_refused_before_the_resync(
    fake: FakeRuntimeServer,
) -> None:
    """Before the wait for the runtime and the resync (which may move every container and
    writes the checkpoint), not after them."""
    listen = fake.socket_path.parent / "not-a-socket"
    listen.write_text("")
    log = fake.socket_path.parent / "cpushim.log"
    proc = start_cpushim(listen, fake.endpoint, log, state="fresh-state")
    assert proc.wait(20) == 1, log.read_text()
    assert "not a socket" in log.read_text()
    assert not [path for path, *_ in fake.runtime.calls if path.endswith("/ListContainers")]
    assert not (fake.socket_path.parent / "fresh-state" / "state.json").exists()


@pytest.mark.parametrize("with_config", [True, False])
def test_sighup_reads_the_config_again_and_cpushim_goes_on(
    fake: FakeRuntimeServer, with_config: bool
) -> None:
    """What operators send for "read your config" (systemctl reload): by default it would
    end the process without its shutdown (no drain, no STOPPING=1, the socket left)."""
    listen = fake.socket_path.parent / "sock" / "cri.sock"
    log = fake.socket_path.parent / "cpushim.log"
    extra: tuple[str, ...] = ()
    if with_config:
        config = fake.socket_path.parent / "config.toml"
        config.write_text('logLevel = "debug"\n')
        extra = ("--config", str(config))
    proc = start_cpushim(listen, fake.endpoint, log, *extra)
    try:
        wait_serving(proc, listen, log)
        wait_for(lambda: logged(log, "serving"), 10, "the serving line")
        proc.send_signal(signal.SIGHUP)
        said = (
            "SIGHUP: reading the config file again"
            if with_config
            else "SIGHUP: there is no config file to read again (--config); ignored"
        )
        wait_for(lambda: logged(log, said), 10, "the SIGHUP line")
        assert proc.poll() is None, log.read_text()
        with grpc.insecure_channel(f"unix://{listen}") as ch:
            assert unary(ch, RUNTIME + "Version", b"echo:x", timeout=10).endswith(b"echo:x")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0, log.read_text()


def test_systemds_watchdog_is_fed_while_cpushim_serves(fake: FakeRuntimeServer) -> None:
    """Under WatchdogSec= systemd passes WATCHDOG_USEC and restarts a service whose pings
    stop (a stuck event loop): cpushim pings from its loop, at half the timeout."""
    listen = fake.socket_path.parent / "sock" / "cri.sock"
    log = fake.socket_path.parent / "cpushim.log"
    notify_path = fake.socket_path.parent / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notifications:
        notifications.bind(str(notify_path))
        notifications.settimeout(20)
        proc = subprocess.Popen(
            cpushim_command(f"unix://{listen}", fake.endpoint, state_dir=listen.parent / "state"),
            stderr=log.open("wb"),
            cwd=REPO,
            env=dict(os.environ, NOTIFY_SOCKET=str(notify_path), WATCHDOG_USEC="200000"),
        )
        try:
            # Start-up's STATUS= lines come first; no ping before it serves.
            while "READY=1" not in (said := notifications.recv(4096).decode()).splitlines():
                assert said.startswith("STATUS="), said
            pings = [notifications.recv(4096).decode() for _ in range(3)]
            assert pings == ["WATCHDOG=1"] * 3, log.read_text()
            proc.send_signal(signal.SIGTERM)
            # The pings stop with the shutdown: STOPPING=1 comes next, after any in flight.
            while (said := notifications.recv(4096).decode()) == "WATCHDOG=1":
                pass
            assert "STOPPING=1" in said.splitlines()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()


def test_a_state_directory_that_cannot_be_used_is_named_with_its_setting(
    fake: FakeRuntimeServer,
) -> None:
    listen = fake.socket_path.parent / "sock" / "cri.sock"
    log = fake.socket_path.parent / "cpushim.log"
    (listen.parent).mkdir()
    (listen.parent / "state").write_text("a file where the directory should be")
    proc = start_cpushim(listen, fake.endpoint, log)
    assert proc.wait(20) == 1, log.read_text()
    [error] = [e for e in log_events(log) if e["level"] == "error"]
    assert error["error"] == (
        f"cannot use the state directory {listen.parent / 'state'} (stateDir, --state-dir):"
        " Not a directory"
    )
