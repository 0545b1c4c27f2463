"""Operating cpushim on a real containerd: systemd's readiness protocol, the metrics endpoint.

``cpushim run --config`` is started the way systemd starts it (``Type=notify``, with a
``$NOTIFY_SOCKET`` this test binds), so READY=1 can be checked against the socket serving.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import CPUSHIM_START_TIMEOUT, REPO_ROOT, Shim
from tests.e2e.pods import rpc_error, run_pod, start_shared_and_pinned
from tests.harness.containerd import (
    PrivateContainerd,
    cpushim_command,
    socket_accepts,
    wait_for,
)
from tests.harness.kubelet import ONE_CPU, KubeletClient

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("two_cpus")]

REACTION_TIMEOUT = 10.0


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
                env=dict(os.environ, NOTIFY_SOCKET=str(notify_path), WATCHDOG_USEC="400000"),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        try:
            try:
                ready = receive(notifications, CPUSHIM_START_TIMEOUT)
                # Start-up says what it is doing first (STATUS=, EXTEND_TIMEOUT_USEC=).
                while "READY=1" not in ready.splitlines():
                    assert "WATCHDOG=1" not in ready.splitlines(), "pinged before it served"
                    ready = receive(notifications, CPUSHIM_START_TIMEOUT)
            except TimeoutError:
                pytest.fail(f"no READY=1; cpushim's log:\n{log_path.read_text()}")
            lines = ready.splitlines()
            # READY=1 promises kubelet a socket that answers: it must already.
            assert socket_accepts(listen)
            with KubeletClient(f"unix://{listen}", log_root=tmp_path / "logs") as kubelet:
                assert kubelet.version().runtime_name == "containerd"
            assert any(line.startswith("STATUS=serving") for line in lines), lines
            # WatchdogSec= (here 0.4 s): pinged at half of it while it serves.
            assert receive(notifications, 10) == "WATCHDOG=1"

            process.send_signal(signal.SIGTERM)
            while (said := receive(notifications, 10)) == "WATCHDOG=1":
                pass  # one in flight
            assert "STOPPING=1" in said.splitlines()
            assert process.wait(30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


class Scrape:
    """One scrape of /metrics, parsed by prometheus_client's own parser."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]


def test_metrics_follow_a_real_lifecycle_and_healthz_follows_the_runtime(
    shim: Shim, via: Callable[[], KubeletClient]
) -> None:
    base = f"http://127.0.0.1:{free_port()}"
    shim.start("--metrics-address", base.removeprefix("http://"))

    def scrape() -> Scrape:
        status, text = get(f"{base}/metrics")
        assert status == 200, text
        return Scrape(text)

    assert get(f"{base}/healthz") == (200, "ok\n")
    start = scrape()
    assert start.value("cpu_manager_shared_pool_size_millicores") == 2000
    assert start.value("cpu_manager_pinning_requests_total") == 0

    kubelet = via()
    _, _, pinned_id = start_shared_and_pinned(kubelet)
    refused = rpc_error(lambda: run_pod(kubelet, "second", "guaranteed", ONE_CPU))
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

    pinned = scrape()
    assert pinned.value("cpu_manager_pinning_requests_total") == 2
    assert pinned.value("cpu_manager_pinning_errors_total") == 1
    assert pinned.value("cpu_manager_exclusive_cpu_allocation_count") == 1
    assert pinned.value("cpu_manager_shared_pool_size_millicores") == 1000
    create = "/runtime.v1.RuntimeService/CreateContainer"
    assert pinned.value("cpushim_relay_calls_total", method=create, code="OK") == 2
    assert pinned.value("cpushim_relay_calls_total", method=create, code="RESOURCE_EXHAUSTED") == 1
    assert pinned.value("cpushim_relay_call_duration_seconds_count", method=create) == 3

    # Drift, an exit from outside and a deleted state file: each is counted once.
    cgroup = kubelet.kernel_cpus(pinned_id).cgroup_path.lstrip("/")
    Path("/sys/fs/cgroup/cpuset", cgroup, "cpuset.cpus").write_text("0-1")
    wait_for(lambda: scrape().value("cpushim_drift_repairs_total") == 1, REACTION_TIMEOUT, "drift")
    os.kill(kubelet.container_pid(pinned_id), signal.SIGKILL)
    wait_for(
        lambda: scrape().value("cpu_manager_shared_pool_size_millicores") == 2000,
        REACTION_TIMEOUT,
        "the exit seen",
    )
    # The release's checkpoint write lands just after: delete the file once it has.
    wait_for(lambda: shim.assignments() == {}, REACTION_TIMEOUT, "the release in the checkpoint")
    shim.state_file.unlink()
    wait_for(
        lambda: scrape().value("cpushim_state_rewrites_total") == 1,
        REACTION_TIMEOUT,
        "the state file rewritten",
    )
    after = scrape()
    # Both started containers were found where containerd puts them, without asking it.
    assert after.value("cpushim_cgroups_derived_total") == 2
    assert after.value("cpushim_exits_seen_total") == 1
    assert after.value("cpushim_process_exits_seen_total") == 1
    assert after.value("cpu_manager_exclusive_cpu_allocation_count") == 0
    assert after.value("cpushim_config_errors_total") == 0
    assert after.value("cpushim_internal_errors_total") == 0

    # The runtime's socket goes away: /healthz says so, /metrics still answers.
    runtime_socket = Path(shim.containerd.address.removeprefix("unix://"))
    hidden = runtime_socket.with_name(f"{runtime_socket.name}.hidden")
    runtime_socket.rename(hidden)
    try:
        status, text = get(f"{base}/healthz")
        assert status == 503
        assert "unreachable" in text
        assert scrape().value("cpushim_drift_repairs_total") == 1
    finally:
        hidden.rename(runtime_socket)
    assert get(f"{base}/healthz") == (200, "ok\n")


@pytest.mark.usefixtures("direct")  # which tears the pods down after
def test_status_finds_the_state_and_the_socket_through_the_config_file(
    shim: Shim, via: Callable[[], KubeletClient], tmp_path: Path
) -> None:
    """An operator's `cpushim status --config FILE` on a node whose file moved the state
    directory and the socket: the pinned container, its CPU and what containerd says of it;
    once cpushim stops, the checkpoint alone, and a line saying why."""
    shim.start()
    _, pinned_pod, pinned_id = start_shared_and_pinned(via())
    # The container's id reaches the checkpoint within the record delay (a second).
    wait_for(lambda: pinned_id in shim.state_file.read_text(), REACTION_TIMEOUT, "the id written")
    config = tmp_path / "status.toml"
    config.write_text(f'listen = "{shim.address}"\nstateDir = "{shim.state_dir}"\n')
    status = [sys.executable, "-m", "shim", "status", "--config", str(config)]

    shown = subprocess.run(
        [*status, "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
    )
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    [assignment] = document["assignments"]
    assert (assignment["pod_uid"], assignment["cpus"]) == (pinned_pod.uid, "1")
    assert (assignment["container_id"], assignment["state"]) == (pinned_id, "running")
    assert document["runtime"]["error"] is None

    shim.stop()
    shown = subprocess.run(status, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    [row] = [line for line in shown.stdout.splitlines() if pinned_id[:13] in line]
    assert "default/guaranteed" in row
    assert row.split()[-1] == "1"
    assert f"no socket at {shim.socket_path}" in shown.stderr
