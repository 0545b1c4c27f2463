"""Operating cpushim on a real containerd: systemd's readiness protocol, the metrics endpoint.

``cpushim run --config`` is started the way systemd starts it (``Type=notify``, with a
``$NOTIFY_SOCKET`` this test binds), so READY=1 can be checked against the socket serving.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import CPUSHIM_START_TIMEOUT, REPO_ROOT
from tests.harness.containerd import PrivateContainerd, cpushim_command, socket_accepts
from tests.harness.kubelet import KubeletClient

pytestmark = pytest.mark.e2e


def receive(notifications: socket.socket, timeout: float) -> str:
    notifications.settimeout(timeout)
    return notifications.recv(4096).decode()


def test_ready_is_sent_once_the_socket_serves_and_stopping_on_sigterm(
    containerd: PrivateContainerd, tmp_path: Path
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('reservedSystemCPUs = "0"\nlogLevel = "info"\n')
    listen = tmp_path / "cpushim.sock"
    command = cpushim_command(
        f"unix://{listen}",
        containerd.address,
        "--config",
        str(config),
        state_dir=tmp_path / "state",
    )
    notify_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notifications:
        notifications.bind(str(notify_path))
        log_path = tmp_path / "cpushim.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=dict(os.environ, NOTIFY_SOCKET=str(notify_path)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        try:
            try:
                ready = receive(notifications, CPUSHIM_START_TIMEOUT)
            except TimeoutError:
                pytest.fail(f"no notification; cpushim's log:\n{log_path.read_text()}")
            lines = ready.splitlines()
            assert "READY=1" in lines
            # READY=1 promises kubelet a socket that answers: it must already.
            assert socket_accepts(listen)
            with KubeletClient(f"unix://{listen}", log_root=tmp_path / "logs") as kubelet:
                assert kubelet.version().runtime_name == "containerd"
            assert any(line.startswith("STATUS=serving") for line in lines), lines

            process.send_signal(signal.SIGTERM)
            assert "STOPPING=1" in receive(notifications, 10).splitlines()
            assert process.wait(30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
