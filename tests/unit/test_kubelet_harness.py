"""The test kubelet's teardown rides out what containerd answers for a moment about a container
killed from outside, and raises everything else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.harness.kubelet import KubeletClient


class _RuntimeError(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped here
    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        return self._details


class _ScriptedRuntime:
    """Answers StopContainer and RemoveContainer from a script of errors, then succeeds."""

    def __init__(self, stop_errors: list[str], remove_errors: list[str]) -> None:
        self.stop_errors = stop_errors
        self.remove_errors = remove_errors
        self.calls: list[str] = []

    def stop_container(self, container_id: str, timeout: int = 30) -> None:
        self.calls.append(f"stop {container_id}")
        if self.stop_errors:
            raise _RuntimeError(self.stop_errors.pop(0))

    def remove_container(self, container_id: str) -> None:
        self.calls.append(f"remove {container_id}")
        if self.remove_errors:
            raise _RuntimeError(self.remove_errors.pop(0))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[KubeletClient]:
    # The channel connects lazily: nothing listens on the socket, and nothing needs to.
    with KubeletClient(f"unix://{tmp_path}/none.sock", log_root=tmp_path) as made:
        yield made


def _script(
    client: KubeletClient, monkeypatch: pytest.MonkeyPatch, stop: list[str], remove: list[str]
) -> _ScriptedRuntime:
    runtime = _ScriptedRuntime(stop, remove)
    monkeypatch.setattr(client, "stop_container", runtime.stop_container)
    monkeypatch.setattr(client, "remove_container", runtime.remove_container)
    return runtime


KILL_RACE = 'failed to kill container "c1": ttrpc: closed: unknown'
STILL_RUNNING = 'failed to remove container "c1": container is still running, to stop first'


def test_a_stop_that_meets_the_task_being_deleted_is_retried(
    client: KubeletClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _script(client, monkeypatch, stop=[KILL_RACE], remove=[])
    client._stop_and_remove("c1", running=True)
    assert runtime.calls == ["stop c1", "stop c1", "remove c1"]


def test_a_remove_of_a_container_still_running_stops_it_again(
    client: KubeletClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _script(client, monkeypatch, stop=[], remove=[STILL_RUNNING])
    client._stop_and_remove("c1", running=False)
    assert runtime.calls == ["remove c1", "stop c1", "remove c1"]


def test_any_other_error_is_raised_at_once(
    client: KubeletClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _script(client, monkeypatch, stop=["no such container"], remove=[])
    with pytest.raises(grpc.RpcError, match="no such container"):
        client._stop_and_remove("c1", running=True)
    assert runtime.calls == ["stop c1"]


def test_a_race_that_outlasts_the_budget_is_raised(
    client: KubeletClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = _script(client, monkeypatch, stop=[KILL_RACE] * 1000, remove=[])
    with pytest.raises(grpc.RpcError, match="ttrpc: closed"):
        client._stop_and_remove("c1", running=True, budget=0.0)
    assert runtime.calls == ["stop c1"]
