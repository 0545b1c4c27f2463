"""The checkpoint file: round trips, atomic replacement, permissions, failures."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import shim.checkpoint as checkpoint_module
from shim.checkpoint import (
    BLOCK,
    STATE_FILE,
    CheckpointClosedError,
    CheckpointFile,
    StateDirectoryInUseError,
    hold_directory,
    padded,
    write_atomically,
)
from shim.cpuset import CPUSet
from shim.engine.resync import RECOVERY_HINT
from shim.policy.static import StaticPolicy
from shim.state import (
    Assignment,
    CheckpointError,
    ContainerKey,
    CPUState,
    decode_checkpoint,
    encode_checkpoint,
)
from tests.harness.crash import interrupted_checkpoint_write
from tests.harness.fifo import without_waiting_on
from tests.harness.sysfs import MachineSpec, expected_topology
from tests.unit.engine_env import until

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

# Past one block: writing it makes the spare grow.
BIG = TWO.assign(
    ContainerKey("uid-3", "big"),
    Assignment(CPUSet.parse("4"), "c" * 5000, "sb-3", 0, "default/big"),
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


SPARE = f".{STATE_FILE}.spare"


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- load and save ----------------------------------------------------------------------------


def test_save_then_load(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    assert file.path == tmp_path / STATE_FILE
    file.save_sync(TWO)
    assert file.load() == TWO
    # Padded with spaces to whole blocks (see shim/checkpoint.py): still the same JSON.
    assert file.path.read_bytes() == padded(encode_checkpoint(TWO))
    assert file.path.stat().st_size % BLOCK == 0
    assert CheckpointFile(tmp_path).load() == TWO  # another reader


def test_save_replaces_the_previous_state(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(TWO)
    file.save_sync(EMPTY)
    assert file.load() == EMPTY
    assert names(tmp_path) == [SPARE, STATE_FILE]


def test_load_of_a_missing_file(tmp_path: Path) -> None:
    assert CheckpointFile(tmp_path).load() is None
    assert CheckpointFile(tmp_path / "not" / "there").load() is None
    assert names(tmp_path) == []  # loading creates nothing


def nested_body(depth: int) -> bytes:
    """A checkpoint whose body holds lists ``depth`` deep: no file cpushim writes."""
    return b'{"version": 1, "checksum": "", "body": {"x": %s%s}}' % (b"[" * depth, b"]" * depth)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "it is not JSON"),
        (b"{", "it is not JSON"),
        (b"[]", "it is not a JSON object"),
        (encode_checkpoint(ONE).replace(b'"1,9"', b'"1,10"'), "its checksum does not match"),
        (encode_checkpoint(ONE)[:-40], "it is not JSON"),
        # Deeper than orjson writes (255 levels), so its checksum cannot be computed.
        (nested_body(300), "its body is nested too deeply"),
        # Deeper than orjson reads (1024 levels).
        (nested_body(2000), "it is not JSON"),
    ],
    ids=["empty", "cut short", "array", "edited", "truncated", "deep", "deeper"],
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
        assert names(tmp_path) == [SPARE, STATE_FILE]


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
    with pytest.raises(NotADirectoryError, match="Not a directory"):
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
    ("function", "error", "first"),
    [
        ("fsync", errno.EIO, True),
        ("write", errno.ENOSPC, True),
        ("fsync", errno.EIO, False),
        ("pwrite", errno.ENOSPC, False),
        ("ftruncate", errno.ENOSPC, False),
        ("link", errno.EIO, False),
    ],
    ids=[
        "first write, fsync fails",
        "first write, disk full",
        "fsync of the spare fails",
        "disk full in the spare",
        "no room to grow the spare",
        "link fails",
    ],
)
def test_failed_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, error: int, first: bool
) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    before = file.path.read_bytes()
    # TWO fits in ONE's block; a state past it makes the spare grow.
    new = BIG if function == "ftruncate" else TWO
    if first:
        (tmp_path / SPARE).unlink()  # the spare is made afresh: a new temporary file
    monkeypatch.setattr(os, function, raise_on_call(getattr(os, function), 1, error))
    with pytest.raises(OSError, match=re.escape(os.strerror(error))):
        file.save_sync(new)
    monkeypatch.undo()
    assert file.path.read_bytes() == before
    assert file.load() == ONE
    assert set(names(tmp_path)) <= {SPARE, STATE_FILE}
    assert file.writes == 1
    file.save_sync(new)  # and the next write goes through
    assert file.load() == new


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
    assert not thread.is_alive()
    assert errors == []  # both writes done: neither lost on the way
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
    assert names(tmp_path / "state") == [SPARE, STATE_FILE]


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
    assert names(tmp_path) == [SPARE, STATE_FILE]


class LateLock:
    """A stand-in for the writer's lock that the first thread to come takes only once
    ``go_on`` is set: a worker thread descheduled between starting its write and taking the
    lock, as the scheduler may leave one, for as long as the test wants."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counting = threading.Lock()
        self._comers = 0
        self._mine = threading.local()
        self.first_waiting = threading.Event()
        self.go_on = threading.Event()
        self.first_done = threading.Event()

    def __enter__(self) -> None:
        with self._counting:
            first = self._comers == 0
            self._comers += 1
        self._mine.first = first
        if first:
            self.first_waiting.set()
            assert self.go_on.wait(10)
        self._lock.acquire()

    def __exit__(self, *_: object) -> None:
        self._lock.release()
        if self._mine.first:
            self.first_done.set()


@pytest.mark.anyio
async def test_a_cancelled_save_returns_once_its_write_is_done(tmp_path: Path) -> None:
    """The worker thread of a save whose caller is cancelled goes on and renames its file
    into place: the caller gets control back only then, knowing the bytes for its own (the
    watcher of the state file would otherwise take them for someone else's)."""
    file = CheckpointFile(tmp_path)
    late = LateLock()
    file._writing = late  # type: ignore[assignment]
    saving = asyncio.create_task(file.save(ONE))
    await until(late.first_waiting.is_set, "the write under way", deadline=10.0)
    saving.cancel()
    await asyncio.sleep(0)  # a turn of the loop: the cancel is delivered
    late.go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(saving, 10)
    assert late.first_done.is_set()  # the caller came back after the write, not before
    assert file.load() == ONE
    assert file.last_written == file.path.read_bytes()
    assert file.saved == ONE


@pytest.mark.anyio
async def test_a_cancelled_save_is_never_renamed_over_a_later_one(tmp_path: Path) -> None:
    """Saves are made one at a time under a lock (the engine's). A cancelled caller lets it
    go; if its thread had not written yet, a later save could be renamed into place first,
    and the older state after it: a restart would load CPUs that are someone else's now."""
    file = CheckpointFile(tmp_path)
    late = LateLock()
    file._writing = late  # type: ignore[assignment]
    lock = asyncio.Lock()
    started: list[CPUState] = []
    entered: list[CPUState] = []

    async def save_under_lock(state: CPUState) -> None:
        started.append(state)
        async with lock:
            entered.append(state)
            await file.save(state)

    older = asyncio.create_task(save_under_lock(ONE))
    await until(late.first_waiting.is_set, "the older write under way", deadline=10.0)
    older.cancel()
    newer = asyncio.create_task(save_under_lock(TWO))
    # The newer save is either done (the older one let the lock go at once) or waits for it.
    await until(
        lambda: newer.done() or (TWO in started and TWO not in entered),
        "the newer save's turn",
        deadline=10.0,
    )
    late.go_on.set()
    await asyncio.wait({older, newer}, timeout=10)
    assert await asyncio.to_thread(late.first_done.wait, 10)
    assert older.cancelled()
    await newer  # done, and did not fail
    assert file.load() == TWO
    assert file.last_written == file.path.read_bytes()
    assert file.saved == TWO


@pytest.mark.anyio
async def test_close_lets_the_directory_go_once_the_write_under_way_is_done(
    tmp_path: Path,
) -> None:
    """Its caller cancelled (an engine task at the loop's end), the write goes on in its
    thread: the directory is let go only after it, and nothing is written after that."""
    file = CheckpointFile(tmp_path)
    file.hold()
    late = LateLock()
    file._writing = late  # type: ignore[assignment]
    saving = asyncio.create_task(file.save(ONE))
    await until(late.first_waiting.is_set, "the write under way", deadline=10.0)
    saving.cancel()
    closing = asyncio.create_task(file.close())
    await until(lambda: file._closed, "close begun")
    closing.cancel()  # a cancel waits for the write as well
    await asyncio.sleep(0)  # a turn of the loop: the cancel is delivered
    assert not closing.done()
    with pytest.raises(StateDirectoryInUseError):
        hold_directory(tmp_path)
    late.go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(closing, 10)
    assert late.first_done.is_set()
    assert saving.cancelled()
    assert file.load() == ONE
    os.close(hold_directory(tmp_path))
    with pytest.raises(CheckpointClosedError):
        await file.save(TWO)
    with pytest.raises(CheckpointClosedError):
        file.save_sync(TWO)
    assert file.load() == ONE
    assert file.saved == ONE


# --- the spare --------------------------------------------------------------------------------


def inode(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_ino, info.st_nlink


def test_writes_take_turns_between_two_files_overwritten_in_place(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    spare = tmp_path / SPARE
    file.save_sync(ONE)
    first, second = inode(file.path), inode(spare)
    assert first != second
    assert first[1] == second[1] == 1  # one name each
    file.save_sync(TWO)
    assert (inode(file.path), inode(spare)) == (second, first)
    file.save_sync(EMPTY)
    assert (inode(file.path), inode(spare)) == (first, second)
    assert file.load() == EMPTY
    assert names(tmp_path) == [SPARE, STATE_FILE]


def test_a_state_past_a_block_grows_the_file(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    file.save_sync(BIG)
    assert file.load() == BIG
    assert file.path.stat().st_size == len(padded(encode_checkpoint(BIG))) > BLOCK
    file.save_sync(ONE)  # and shrinks again
    assert file.load() == ONE
    assert file.path.read_bytes() == padded(encode_checkpoint(ONE))


def test_a_link_left_by_a_crash_mid_write_is_cleared(tmp_path: Path) -> None:
    # Crashed after linking state.json as .previous, before the renames.
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    os.link(file.path, tmp_path / f".{STATE_FILE}.previous")
    file.save_sync(TWO)
    assert file.load() == TWO
    assert names(tmp_path) == [SPARE, STATE_FILE]
    assert inode(file.path)[1] == inode(tmp_path / SPARE)[1] == 1


def test_a_crash_between_the_renames_leaves_a_spare_to_make_again(tmp_path: Path) -> None:
    # Crashed after the spare became state.json, before .previous became the spare.
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    os.link(file.path, tmp_path / f".{STATE_FILE}.previous")
    os.replace(tmp_path / SPARE, file.path)
    file.save_sync(TWO)
    assert file.load() == TWO
    assert names(tmp_path) == [SPARE, STATE_FILE]


@pytest.mark.parametrize("kind", ["second name", "symlink", "directory"])
def test_a_spare_that_is_not_cpushims_own_plain_file_is_never_written_through(
    tmp_path: Path, kind: str
) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    spare = tmp_path / SPARE
    spare.unlink()
    outside = tmp_path / "outside"
    outside.write_bytes(b"someone else's")
    if kind == "second name":
        os.link(file.path, spare)  # writing it in place would change state.json in place
        before = file.path.read_bytes()
    elif kind == "symlink":
        spare.symlink_to(outside)
    else:
        spare.mkdir()
        with pytest.raises(IsADirectoryError):
            file.save_sync(TWO)
        assert file.load() == ONE
        return
    file.save_sync(TWO)
    assert file.load() == TWO
    assert outside.read_bytes() == b"someone else's"
    if kind == "second name":
        assert before == padded(encode_checkpoint(ONE))
    assert inode(file.path)[1] == inode(spare)[1] == 1
    assert not spare.is_symlink()


def test_without_hard_links_every_write_takes_a_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    monkeypatch.setattr(os, "link", raise_on_call(os.link, 1, errno.EPERM))
    file.save_sync(TWO)
    assert file.load() == TWO
    assert set(names(tmp_path)) == {SPARE, STATE_FILE}


def test_a_fifo_in_place_of_the_spare_does_not_block_the_write(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    (tmp_path / SPARE).unlink()
    os.mkfifo(tmp_path / SPARE)
    file.save_sync(TWO)  # would block forever on a FIFO nobody reads
    assert file.load() == TWO
    assert stat.S_ISREG((tmp_path / SPARE).stat().st_mode)


def test_a_fifo_in_place_of_the_checkpoint_is_refused_without_waiting(tmp_path: Path) -> None:
    # Read on the event loop by the state file's watch: a FIFO there would block it, and
    # every CRI call with it, until a writer came.
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    file.path.unlink()
    os.mkfifo(file.path)
    assert without_waiting_on(file.path, file.on_disk) is None
    with pytest.raises(CheckpointError, match="not a regular file"):
        without_waiting_on(file.path, file.load)


@pytest.mark.usefixtures("no_umask")
def test_a_spare_opened_wider_is_narrowed_before_it_becomes_the_checkpoint(
    tmp_path: Path,
) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    (tmp_path / SPARE).chmod(0o644)
    file.save_sync(TWO)
    assert stat.S_IMODE(file.path.stat().st_mode) == 0o600


def test_a_spare_that_cannot_be_narrowed_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed chmod of the spare fails the write; every failed write must not also keep a
    descriptor open, or a disk that keeps failing uses up the process's descriptors."""
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    (tmp_path / SPARE).chmod(0o644)
    open_before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "fchmod", raise_on_call(os.fchmod, 1, errno.EIO))
    with pytest.raises(OSError, match=re.escape(os.strerror(errno.EIO))):
        file.save_sync(TWO)
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == open_before
    assert file.load() == ONE


def test_one_process_at_a_time_holds_a_state_directory(tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path; from shim.checkpoint import hold_directory;"
        " hold_directory(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"held\n"
        with pytest.raises(StateDirectoryInUseError, match="another cpushim"):
            hold_directory(tmp_path)
    finally:
        holder.communicate(b"", timeout=10)
    # Released when the holder ends, however it ends.
    os.close(hold_directory(tmp_path))


# --- what an interrupted write leaves ---------------------------------------------------------


def test_a_write_killed_before_its_rename_leaves_its_temporary_file(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    left = interrupted_checkpoint_write(file.path)
    assert left.name.startswith(f".{STATE_FILE}.")
    assert left.name.endswith(".tmp")
    assert file.load() == ONE  # the checkpoint itself is whole


def test_leftovers_of_interrupted_writes_are_removed_and_nothing_else(tmp_path: Path) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    state_left = interrupted_checkpoint_write(file.path)
    spare_left = interrupted_checkpoint_write(tmp_path / SPARE)
    # Names that are not a checkpoint write's temporary file, or not a file.
    others = ["notes.tmp", f"{STATE_FILE}.replaced-20261124T010203Z", f".{STATE_FILE}..tmp"]
    for name in others:
        (tmp_path / name).write_text("operator's")
    (tmp_path / f".{STATE_FILE}.abc12345.tmp").mkdir()

    removed = file.remove_leftovers()

    assert sorted(removed) == sorted([state_left, spare_left])
    assert names(tmp_path) == sorted([f".{STATE_FILE}.abc12345.tmp", SPARE, STATE_FILE, *others])
    assert file.load() == ONE
    file.save_sync(TWO)  # and writing goes on as before
    assert file.load() == TWO


def test_removing_leftovers_of_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert CheckpointFile(tmp_path / "absent").remove_leftovers() == []


def test_a_leftover_that_cannot_be_removed_is_left_and_the_rest_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    stuck = interrupted_checkpoint_write(file.path)
    other = interrupted_checkpoint_write(file.path)
    unlink = Path.unlink

    def refuse(path: Path, missing_ok: bool = False) -> None:
        if path == stuck:
            raise PermissionError(errno.EACCES, "refused", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    assert file.remove_leftovers() == [other]
    assert stuck.exists()
    assert file.load() == ONE


def test_a_spare_the_disk_refuses_fails_no_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a spare (the first write, or after a crash between the renames) state.json is
    written whole first and the spare made after. A full disk refusing the spare must not
    make the save raise: the engine takes a failed save to have changed nothing, while the
    file holds the new state."""
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    spare = tmp_path / ".state.json.spare"
    spare.unlink()  # as after a crash between the renames
    real = checkpoint_module.write_atomically

    def spare_refused(path: Path, data: bytes, mode: int = 0o600, **kwargs: bool) -> None:
        if path == spare:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, mode, **kwargs)

    monkeypatch.setattr(checkpoint_module, "write_atomically", spare_refused)
    file.save_sync(TWO)
    assert file.load() == TWO
    assert not spare.exists()
    monkeypatch.undo()
    file.save_sync(ONE)  # the disk has room again: the spare is made
    assert file.load() == ONE
    assert spare.exists()


@pytest.mark.parametrize("how", ["through the spare", "without a spare", "without hard links"])
@pytest.mark.anyio
async def test_a_failed_fsync_of_the_directory_leaves_the_new_file_known_as_cpushims_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The rename is done when the directory's fsync fails: the file holds the new state, and
    the watcher of the state file must take it for cpushim's own write, not someone else's.
    The save still fails: whether the new state survives a power cut is not known."""
    file = CheckpointFile(tmp_path)
    await file.save(ONE)
    if how == "without a spare":
        (tmp_path / SPARE).unlink()
    elif how == "without hard links":
        monkeypatch.setattr(os, "link", raise_on_call(os.link, 1, errno.EPERM))
    real = checkpoint_module.fsync_directory
    monkeypatch.setattr(checkpoint_module, "fsync_directory", raise_on_call(real, 1, errno.EIO))
    with pytest.raises(OSError, match=re.escape(os.strerror(errno.EIO))) as raised:
        await file.save(TWO)
    monkeypatch.undo()
    assert raised.value.errno == errno.EIO
    assert "power cut" in str(raised.value)
    assert file.load() == TWO
    assert file.last_written == file.path.read_bytes()
    assert file.saved == TWO
    assert file.writes == 1  # not counted as a write done


def test_after_a_failed_fsync_of_the_directory_the_old_checkpoint_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the directory's fsync failed, the renames before it may not be on the disk: the
    spare may still be ``state.json`` there, and a power cut while it is overwritten in
    place would leave a torn checkpoint. The writes take a new file each until a fsync of
    the directory succeeds, then take turns through the spare again."""
    file = CheckpointFile(tmp_path)
    file.save_sync(ONE)
    file.save_sync(TWO)
    real = checkpoint_module.fsync_directory
    monkeypatch.setattr(checkpoint_module, "fsync_directory", raise_on_call(real, 1, errno.EIO))
    with pytest.raises(OSError, match=re.escape(os.strerror(errno.EIO))):
        file.save_sync(EMPTY)
    monkeypatch.undo()
    # The file that was state.json before the failed fsync, and may still be on the disk.
    durable_before = os.open(tmp_path / SPARE, os.O_RDONLY)
    try:
        unsynced = os.pread(durable_before, 2 * BLOCK, 0)
        assert decode_checkpoint(unsynced) == TWO
        file.save_sync(ONE)
        assert os.pread(durable_before, 2 * BLOCK, 0) == unsynced
    finally:
        os.close(durable_before)
    assert file.load() == ONE
    # The directory synced again: through the spare, in place, from here on.
    spare = inode(tmp_path / SPARE)
    file.save_sync(TWO)
    assert inode(file.path) == spare
    assert file.load() == TWO
    assert names(tmp_path) == [SPARE, STATE_FILE]


def test_a_new_state_directory_is_made_durable_in_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start makes the directory: its parent is flushed, or a power cut soon
    after could lose the directory with the checkpoint written into it."""
    synced: list[Path] = []
    real = checkpoint_module.fsync_directory

    def recording(directory: Path) -> None:
        synced.append(directory)
        real(directory)

    monkeypatch.setattr(checkpoint_module, "fsync_directory", recording)
    state_dir = tmp_path / "var" / "cpushim"
    os.close(hold_directory(state_dir))
    assert synced == [state_dir.parent]
    os.close(hold_directory(state_dir))  # there already: nothing to flush
    assert synced == [state_dir.parent]


def test_the_operations_guide_shows_the_refusal_cpushim_logs() -> None:
    """docs/operations.md quotes the line an unusable checkpoint stops start-up with: an
    operator matches it against the journal, so its way out must be the one logged."""
    guide = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    section = guide[guide.index("## Recover from a bad checkpoint") :]
    quoted = re.search(r"the checkpoint is unusable: [^ ]*:? ?\.\.\. (.*?)\"}", section)
    assert quoted is not None
    assert quoted.group(1) == RECOVERY_HINT


def test_the_operations_guide_names_every_file_of_the_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator who lists /var/lib/cpushim finds each name there in docs/operations.md:
    what running cpushim keeps, what a crash mid-write leaves, with ``<random>`` for the
    random part of a temporary file's name."""
    guide = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    section = guide[guide.index("## Upgrade\n") : guide.index("## Roll back\n")]
    patterns = [
        re.compile(re.escape(quoted).replace(re.escape("<random>"), "[A-Za-z0-9_]+"))
        for quoted in re.findall(r"`(\.*state\.json[^`]*|\.[a-z][^`/ ]*)`", section)
    ]
    file = CheckpointFile(tmp_path)
    file.hold()
    try:
        file.save_sync(ONE)
        file.save_sync(TWO)
        interrupted_checkpoint_write(file.path)
        interrupted_checkpoint_write(tmp_path / SPARE)
        # A crash between the link of state.json as the previous file and the renames.
        real_replace = os.replace

        def crash(source: Any, target: Any) -> None:
            if Path(source).name == SPARE:
                raise KeyboardInterrupt
            real_replace(source, target)

        monkeypatch.setattr(os, "replace", crash)
        with pytest.raises(KeyboardInterrupt):
            file.save_sync(ONE)
        found = names(tmp_path)
    finally:
        file.release()
    assert len(found) == 6
    unnamed = [name for name in found if not any(p.fullmatch(name) for p in patterns)]
    assert not unnamed, f"docs/operations.md does not name {unnamed}"
