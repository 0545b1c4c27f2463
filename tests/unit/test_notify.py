"""shim.notify against real datagram sockets: one bound in a temp dir, one abstract."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim import notify
from tests.fake_cri import short_tmpdir


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound to a path, as systemd binds its notify socket."""
    with short_tmpdir() as workdir:
        path = workdir / "notify"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(path))
            sock.settimeout(5)
            yield sock, str(path)


@pytest.fixture
def abstract_listener() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket in the abstract namespace; its NOTIFY_SOCKET spelling is @name."""
    name = f"cpushim-test-notify-{os.getpid()}-{os.urandom(4).hex()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        yield sock, "@" + name


def test_unset_or_empty_sends_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert notify.notify("READY=1", environ={}) is False
    assert notify.notify("READY=1", environ={"NOTIFY_SOCKET": ""}) is False
    assert notify.ready(environ={}) is False
    assert notify.stopping(environ={}) is False
    assert notify.status("x", environ={}) is False
    assert caplog.records == []


def test_ready_with_status_to_a_path(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify.ready("serving", environ={"NOTIFY_SOCKET": path}) is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_ready_without_status(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify.ready(environ={"NOTIFY_SOCKET": path}) is True
    assert sock.recv(4096) == b"READY=1"


def test_abstract_socket(abstract_listener: tuple[socket.socket, str]) -> None:
    sock, name = abstract_listener
    environ = {"NOTIFY_SOCKET": name}
    assert notify.stopping(environ=environ) is True
    assert sock.recv(4096) == b"STOPPING=1"
    assert notify.stopping("draining", environ=environ) is True
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    assert notify.notify("WATCHDOG=1", environ) is True
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_status_is_kept_to_one_line(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify.status("resync\ndone", environ={"NOTIFY_SOCKET": path}) is True
    assert sock.recv(4096) == b"STATUS=resync done"
    assert notify.ready("a\nb", environ={"NOTIFY_SOCKET": path}) is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=a b"


def test_non_ascii_status(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify.status("pinned 2 CPUs → ok", environ={"NOTIFY_SOCKET": path}) is True
    assert sock.recv(4096) == "STATUS=pinned 2 CPUs → ok".encode()


def test_reads_the_process_environment_by_default(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify.ready("up") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=up"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify.ready("up") is False


def _warning(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    [record] = [r for r in caplog.records if r.name == "shim.notify"]
    assert record.levelno == logging.WARNING
    return record


def test_nobody_listening_is_a_warning_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with short_tmpdir() as workdir:
        missing = str(workdir / "gone")
        with caplog.at_level(logging.WARNING, logger="shim.notify"):
            assert notify.ready("serving", environ={"NOTIFY_SOCKET": missing}) is False
    fields = _warning(caplog).fields  # type: ignore[attr-defined]
    assert fields["notify_socket"] == missing
    assert fields["message"] == "READY=1\nSTATUS=serving"
    assert fields["error"]


def test_a_stream_socket_refuses_datagrams(caplog: pytest.LogCaptureFixture) -> None:
    with short_tmpdir() as workdir:
        path = workdir / "stream"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream:
            stream.bind(str(path))
            stream.listen()
            with caplog.at_level(logging.WARNING, logger="shim.notify"):
                assert notify.status("x", environ={"NOTIFY_SOCKET": str(path)}) is False
    assert _warning(caplog).fields["error"]  # type: ignore[attr-defined]


def test_unsupported_address(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shim.notify"):
        assert notify.ready(environ={"NOTIFY_SOCKET": "vsock:2:1234"}) is False
    assert _warning(caplog).fields["notify_socket"] == "vsock:2:1234"  # type: ignore[attr-defined]


def test_a_path_too_long_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    path = str(Path("/tmp") / ("x" * 200))
    with caplog.at_level(logging.WARNING, logger="shim.notify"):
        assert notify.ready(environ={"NOTIFY_SOCKET": path}) is False
    assert _warning(caplog).fields["error"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4243"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], interval: float | None) -> None:
    assert notify.watchdog_interval(environ, pid=4242) == interval


def test_watchdog_ping(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify.watchdog(environ={"NOTIFY_SOCKET": path}) is True
    assert sock.recv(100) == b"WATCHDOG=1"


def test_extend_timeout_in_microseconds(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    environ = {"NOTIFY_SOCKET": path}
    assert notify.extend_timeout(31.5, environ=environ) is True
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=31500000"
    assert notify.extend_timeout(2, "resync:\n3 of 9 sandboxes", environ=environ) is True
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=2000000\nSTATUS=resync: 3 of 9 sandboxes"
    assert notify.extend_timeout(2, environ={}) is False
