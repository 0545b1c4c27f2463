"""The checkpoint file: round trips, atomic replacement, permissions, failures."""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shim.checkpoint import STATE_FILE, CheckpointFile, write_atomically
from shim.cpuset import CPUSet
from shim.policy.static import StaticPolicy
from shim.state import Assignment, CheckpointError, ContainerKey, CPUState, encode_checkpoint
from tests.harness.sysfs import MachineSpec, expected_topology

TOPOLOGY = expected_topology(MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2))
POLICY = StaticPolicy.create(TOPOLOGY, reserved=CPUSet.parse("0,8"))
EMPTY = CPUState.empty(POLICY)
ONE = EMPTY.assign(
    ContainerKey("uid-1", "app"),
    Assignment(CPUSet.parse("1,9"), "ctr-1", "sb-1", 0, "default/web"),
    POLICY,
)
TWO = ONE.assign(
    ContainerKey("uid-2", "db"),
    Assignment(CPUSet.parse("2-3,10-11"), "ctr-2", "sb-2", 1, "default/db"),
    POLICY,
)


@pytest.fixture
def no_umask() -> Iterator[None]:
    """umask 0, so the modes seen are the ones cpushim asks for, not the umask's doing."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- load and save ----------------------------------------------------------------------------


def test_save_then_load(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    assert file.path == tmp_path / STATE_FILE
    file.save_sync(TWO)
    assert file.load() == TWO
    assert file.path.read_bytes() == encode_checkpoint(TWO)
    assert CheckpointFile(tmp_path).load() == TWO  # another reader


def test_save_replaces_the_previous_state(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(TWO)
    file.save_sync(EMPTY)
    assert file.load() == EMPTY
    assert names(tmp_path) == [STATE_FILE]


def test_load_of_a_missing_file(tmp_path: Path) -> None:
    assert CheckpointFile(tmp_path).load() is None
    assert CheckpointFile(tmp_path / "not" / "there").load() is None
    assert names(tmp_path) == []  # loading creates nothing


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "it is not JSON"),
        (b"{", "it is not JSON"),
        (b"[]", "it is not a JSON object"),
        (encode_checkpoint(ONE).replace(b'"1,9"', b'"1,10"'), "its checksum does not match"),
        (encode_checkpoint(ONE)[:-40], "it is not JSON"),
    ],
    ids=["empty", "cut short", "array", "edited", "truncated"],
)
def test_load_of_a_corrupt_file_names_the_path(tmp_path: Path, data: bytes, message: str) -> None:
    file = CheckpointFile(tmp_path)
    file.path.write_bytes(data)
    with pytest.raises(CheckpointError, match=re.escape(f"{file.path}: {message}")):
        file.load()


def test_load_of_an_unreadable_path(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.path.mkdir()
    with pytest.raises(CheckpointError, match=re.escape(f"cannot read {file.path}: ")):
        file.load()


def test_save_leaves_no_temporary_files(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    for state in (ONE, TWO, EMPTY, TWO):
        file.save_sync(state)
        assert names(tmp_path) == [STATE_FILE]


@pytest.mark.usefixtures("no_umask")
def test_file_mode_is_0600(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    assert stat.S_IMODE(file.path.stat().st_mode) == 0o600


@pytest.mark.usefixtures("no_umask")
def test_file_mode_is_0600_over_a_more_open_file(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.path.write_bytes(encode_checkpoint(ONE))
    file.path.chmod(0o644)
    file.save_sync(TWO)
    assert stat.S_IMODE(file.path.stat().st_mode) == 0o600


@pytest.mark.usefixtures("no_umask")
def test_missing_directory_is_created_0700(tmp_path: Path) -> None:
    directory = tmp_path / "var" / "lib" / "cpushim"
    file = CheckpointFile(directory)
    file.save_sync(ONE)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert file.load() == ONE


def test_an_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    directory.mkdir()
    directory.chmod(0o750)
    CheckpointFile(directory).save_sync(ONE)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750


def test_writes_counts_successful_saves(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    assert file.writes == 0
    file.save_sync(ONE)
    file.save_sync(ONE)
    assert file.writes == 2


def test_write_atomically_with_a_mode(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    write_atomically(path, b"{}\n", mode=0o640)
    assert path.read_bytes() == b"{}\n"
    # The mode is at most what was asked for (the umask may take more away).
    assert stat.S_IMODE(path.stat().st_mode) & ~0o640 == 0


def test_write_atomically_large_data(tmp_path: Path) -> None:
    path = tmp_path / "big"
    data = os.urandom(3 * 1024 * 1024 + 17)
    write_atomically(path, data)
    assert path.read_bytes() == data


# --- failures ---------------------------------------------------------------------------------


def test_directory_that_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "state"
    blocker.write_bytes(b"not a directory")
    file = CheckpointFile(blocker)
    with pytest.raises(FileExistsError, match="File exists"):
        file.save_sync(ONE)
    assert blocker.read_bytes() == b"not a directory"
    assert names(tmp_path) == ["state"]
    assert file.writes == 0


def raise_on_call(real: Callable[..., Any], which: int, error: int) -> Callable[..., Any]:
    """``real``, except that call number ``which`` (1-based) raises OSError(``error``)."""
    calls = [0]

    def fake(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == which:
            raise OSError(error, os.strerror(error))
        return real(*args, **kwargs)

    return fake


@pytest.mark.parametrize(
    ("function", "error"),
    [("fsync", errno.EIO), ("write", errno.ENOSPC)],
    ids=["fsync fails", "disk full"],
)
def test_failed_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, error: int
) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    before = file.path.read_bytes()
    monkeypatch.setattr(os, function, raise_on_call(getattr(os, function), 1, error))
    with pytest.raises(OSError, match=re.escape(os.strerror(error))):
        file.save_sync(TWO)
    monkeypatch.undo()
    assert file.path.read_bytes() == before
    assert file.load() == ONE
    assert names(tmp_path) == [STATE_FILE]
    assert file.writes == 1


def test_short_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def short_write(fd: int, data: bytes) -> int:
        return real_write(fd, bytes(data[:7]))

    monkeypatch.setattr(os, "write", short_write)
    file = CheckpointFile(tmp_path)
    file.save_sync(TWO)
    monkeypatch.undo()
    assert file.load() == TWO


def test_failed_rename_leaves_no_temporary_file(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.path.mkdir()  # state.json is a directory: the rename fails
    with pytest.raises(OSError, match="directory"):
        file.save_sync(ONE)
    assert names(tmp_path) == [STATE_FILE]


def test_overlapping_writes_do_not_corrupt_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = CheckpointFile(tmp_path)
    short, long = encode_checkpoint(ONE), encode_checkpoint(TWO)
    assert len(short) < len(long)
    real_write = os.write
    first_opened, go_on = threading.Event(), threading.Event()

    def write(fd: int, data: bytes) -> int:
        if bytes(data) == short and not go_on.is_set():
            first_opened.set()
            assert go_on.wait(10)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            write_atomically(file.path, short)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert first_opened.wait(10)
        write_atomically(file.path, long)  # the later write, complete
    finally:
        go_on.set()
        thread.join(10)
    monkeypatch.undo()
    # Either write may win, but the file must be one of them, whole.
    assert file.path.read_bytes() in (short, long)


# --- the async save ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_save(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path / "state")
    await file.save(ONE)
    assert file.writes == 1
    assert file.load() == ONE
    await file.save(TWO)
    assert file.writes == 2
    assert file.load() == TWO
    assert names(tmp_path / "state") == [STATE_FILE]


@pytest.mark.anyio
async def test_async_save_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = CheckpointFile(tmp_path)
    await file.save(ONE)
    monkeypatch.setattr(os, "fsync", raise_on_call(os.fsync, 1, errno.EIO))
    with pytest.raises(OSError, match=re.escape(os.strerror(errno.EIO))):
        await file.save(TWO)
    monkeypatch.undo()
    assert file.writes == 1
    assert file.load() == ONE
    assert names(tmp_path) == [STATE_FILE]
