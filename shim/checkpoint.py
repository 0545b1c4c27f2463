"""The checkpoint file: ``state.json`` in the state directory, replaced atomically.

A write is: write a temporary file beside it, fsync it, rename it over ``state.json``, fsync
the directory. A crash at any point leaves either the old checkpoint or the new one, never a
mix, and once ``save`` returns the new one survives a power cut. When only the directory's
fsync fails, the new file is in place but may not survive one: the save fails all the same
(DirectorySyncError), and ``last_written`` holds the new bytes, which are cpushim's own. The
whole sequence runs in one worker thread so the event loop keeps relaying calls meanwhile.

The temporary file is a spare kept beside ``state.json`` (``.state.json.spare``): the inode the
previous write replaced. Its contents are overwritten in place, and the file is padded with
spaces (which JSON ignores) to whole blocks, so the overwrite changes no file metadata. The
names then move in one go: ``state.json`` is linked as ``.state.json.previous``, the spare is
renamed over ``state.json`` and the previous file becomes the spare. On ext4 that is one
journal commit per write where a new temporary file costs two: the checkpoint is written on
the CreateContainer and StopContainer paths, on the disk containerd fsyncs its own database to.
A spare that is missing, or anything but a plain file with one name, is made afresh. After a
failed fsync of the directory the renames before it may not be on the disk, where the spare
may still be ``state.json``: writes take a new temporary file each until a fsync succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
import threading
from pathlib import Path
from typing import Final

from shim.fileio import read_regular_file, write_and_sync
from shim.state import CheckpointError, CPUState, decode_checkpoint, encode_checkpoint

STATE_FILE: Final = "state.json"
# What the file's size is kept a multiple of (the usual file system block).
BLOCK: Final = 4096
# write_atomically's temporary file for a path: ".<name>." + tempfile.mkstemp's random part
# + this suffix.
_TEMPORARY_SUFFIX: Final = ".tmp"


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def _spare_of(path: Path) -> Path:
    """The spare beside ``path``: the inode its last write replaced, overwritten next time."""
    return path.with_name(f".{path.name}.spare")


def _temporary_names(path: Path) -> re.Pattern[str]:
    """The names write_atomically gives its temporary files for ``path``."""
    return re.compile(
        re.escape(_temporary_prefix(path)) + "[A-Za-z0-9_]+" + re.escape(_TEMPORARY_SUFFIX)
    )


class DirectorySyncError(OSError):
    """The new file is in place (``written`` holds its bytes), but the fsync of its directory
    failed: whether it survives a power cut is not known."""

    def __init__(self, cause: OSError, directory: Path, written: bytes) -> None:
        super().__init__(
            cause.errno,
            f"{cause.strerror}: the new file is in place, but may not survive a power cut"
            " (fsync of its directory failed)",
            str(directory),
        )
        self.written = written


class CheckpointAccessError(CheckpointError):
    """The checkpoint is there, but this process may not read it: nothing is known of the
    state in it, which may well be good."""


class CheckpointClosedError(OSError):
    """A save after :meth:`CheckpointFile.close`: the directory may be another process's."""


class CheckpointFile:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / STATE_FILE
        self.writes = 0
        # What cpushim last wrote: the file should hold exactly this while it runs.
        self.last_written: bytes | None = None
        # The state those bytes hold.
        self.saved: CPUState | None = None
        # One write at a time: they share the spare.
        self._writing = threading.Lock()
        # The last write's fsync of the directory failed, and none succeeded since: the
        # spare may still be state.json on the disk (under _writing).
        self._renames_unsynced = False
        # The lock on the directory's .lock (hold), while this process holds it.
        self._held: int | None = None
        # The worker threads' writes under way (save), which close waits for.
        self._in_flight: set[asyncio.Future[bytes]] = set()
        self._closed = False

    @property
    def durable(self) -> bool:
        """Whether the last write reached the disk: its fsync of the directory did not fail
        (nor did one since). Without any write yet, True."""
        return not self._renames_unsynced

    def hold(self) -> None:
        """Take the directory for this process (:func:`hold_directory`) until :meth:`release`."""
        self._held = hold_directory(self.directory)

    def hold_again(self) -> bool:
        """Take the directory again when the lock held is on another file than the
        directory's ``.lock`` now (the directory was removed and made again): True when it
        was taken again, False when nothing needed doing; StateDirectoryInUseError when
        another process took the new one meanwhile. Without a hold, nothing to do."""
        if self._held is None:
            return False
        held = os.fstat(self._held)
        try:
            now = os.stat(self.directory / LOCK_FILE, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return False
        fd = hold_directory(self.directory)
        os.close(self._held)
        self._held = fd
        return True

    def release(self) -> None:
        if self._held is not None:
            os.close(self._held)
            self._held = None

    async def close(self) -> None:
        """Refuse saves from now on (CheckpointClosedError), wait for the writes under way,
        then :meth:`release` the directory. A write that lands after the release could land
        over a checkpoint that the next holder has loaded, or written. Cancels meanwhile
        wait too (the worker threads cannot be stopped), and are raised once it is done."""
        self._closed = True
        cancelled = False
        try:
            while self._in_flight:
                try:
                    await asyncio.wait(set(self._in_flight))
                except asyncio.CancelledError:
                    cancelled = True
        finally:
            self.release()
        if cancelled:
            raise asyncio.CancelledError

    def load(self) -> CPUState | None:
        """The saved state, None when there is none; CheckpointError when it is unreadable
        (CheckpointAccessError when this process may not read it)."""
        try:
            data = read_regular_file(self.path)
        except FileNotFoundError:
            return None
        except PermissionError as exc:  # EACCES, EPERM
            raise CheckpointAccessError(f"cannot read {self.path}: {exc.strerror}") from exc
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc.strerror}") from exc
        try:
            return decode_checkpoint(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from exc

    def save_sync(self, state: CPUState) -> None:
        self._refuse_when_closed()
        try:
            written = self._write(encode_checkpoint(state))
        except DirectorySyncError as exc:
            self._renamed(exc, state)
            raise
        self._written(written, state)

    async def save(self, state: CPUState) -> None:
        """As :meth:`save_sync`, in a worker thread. A cancelled caller still waits for that
        thread to be done before CancelledError reaches it: the thread cannot be stopped, and
        the lock its caller holds (the engine's) must cover the rename, or a later save made
        once it is let go could be renamed into place first, and this older one over it."""
        self._refuse_when_closed()
        writing = asyncio.get_running_loop().run_in_executor(
            None, self._write, encode_checkpoint(state)
        )
        self._in_flight.add(writing)
        writing.add_done_callback(self._in_flight.discard)
        try:
            await asyncio.wait((writing,))
        except asyncio.CancelledError:
            await _done_despite_cancels(writing)
            with contextlib.suppress(OSError):  # nobody is left to be told it failed
                self._learn(writing, state)
            raise
        self._learn(writing, state)

    def _refuse_when_closed(self) -> None:
        if self._closed:
            raise CheckpointClosedError(
                errno.EBADF,
                "not written: cpushim is stopping and has let the state directory go",
                str(self.path),
            )

    def _learn(self, writing: asyncio.Future[bytes], state: CPUState) -> None:
        """Take in what a finished write left in the file; raises its OSError."""
        try:
            written = writing.result()
        except DirectorySyncError as exc:
            self._renamed(exc, state)
            raise
        self._written(written, state)

    def _written(self, written: bytes, state: CPUState) -> None:
        self.last_written = written
        self.writes += 1
        self.saved = state

    def _renamed(self, failure: DirectorySyncError, state: CPUState) -> None:
        # The file holds the new bytes whatever the fsync said: the watcher of the state
        # file must know them for cpushim's own, or it would take them for someone else's
        # and rewrite them (failing the same way while the disk does).
        self.last_written = failure.written
        self.saved = state

    def _write(self, data: bytes) -> bytes:
        with self._writing:
            try:
                written = replace_through_spare(
                    self.path, data, in_place=not self._renames_unsynced
                )
            except DirectorySyncError:
                self._renames_unsynced = True
                raise
            self._renames_unsynced = False
            return written

    def remove_leftovers(self) -> list[Path]:
        """Remove the temporary files of checkpoint writes that never finished (the process
        was killed, or the machine lost power, between creating one and renaming it); returns
        what was removed. Only for the directory's holder (:func:`hold_directory`): another
        writer's file in flight would look the same. The spare and every other name stay, and
        so does a leftover that cannot be removed (the next start tries again; a directory
        that refuses this refuses the checkpoint's own writes too, and those fail loudly)."""
        removed: list[Path] = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return removed
        # Of state.json's own writes, and of the spare's (made afresh with write_atomically).
        leftovers = [_temporary_names(self.path), _temporary_names(_spare_of(self.path))]
        for name in names:
            if not any(pattern.fullmatch(name) for pattern in leftovers):
                continue
            path = self.directory / name
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    continue
                path.unlink()
                removed.append(path)
        return removed

    def on_disk(self) -> bytes | None:
        """The file's bytes now; None when it is missing or unreadable."""
        try:
            return read_regular_file(self.path)
        except OSError:
            return None


async def _done_despite_cancels(future: asyncio.Future[bytes]) -> None:
    """Wait until ``future`` is done, whatever cancels come meanwhile: the caller raises
    CancelledError once it is."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((future,))


# The file whose flock says which process holds a state directory.
LOCK_FILE = ".lock"


class StateDirectoryInUseError(RuntimeError):
    pass


def hold_directory(directory: Path) -> int:
    """Take the state directory for this process (an flock on ``.lock`` in it, released when
    the process ends, however it ends); returns the descriptor to keep open. Two cpushims on
    one checkpoint would write over each other (through the same spare), so the second one
    refuses to start."""
    make_directory(directory)
    # Read-only: its close is no IN_CLOSE_WRITE, so a watch of the directory can tell a try
    # to take it from another process's writes.
    fd = os.open(
        directory / LOCK_FILE, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateDirectoryInUseError(
            f"another cpushim is using the state directory {directory}; refusing to start"
        ) from None
    return fd


def make_directory(directory: Path) -> None:
    """Make the state directory (and its parents) unless it is there; one made is flushed
    into its parent, so that its name survives a power cut with the checkpoint in it."""
    try:
        try:
            directory.mkdir(mode=0o700)
        except FileNotFoundError:
            directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            directory.mkdir(mode=0o700)
    except FileExistsError:
        if not directory.is_dir():
            raise NotADirectoryError(
                errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory)
            ) from None
        return
    fsync_directory(directory.parent)


def write_atomically(
    path: Path, data: bytes, mode: int = 0o600, *, sync_directory: bool = True
) -> None:
    """Replace ``path`` by a new file: write a temporary one, fsync it, rename it, and (unless
    told not to) fsync the directory so that the new name survives a power cut
    (DirectorySyncError when only that fails)."""
    directory = path.parent
    make_directory(directory)
    # A name of its own per write, so two writes in flight never share a temporary file.
    fd, name = tempfile.mkstemp(
        prefix=_temporary_prefix(path), suffix=_TEMPORARY_SUFFIX, dir=directory
    )
    temporary = Path(name)
    try:
        try:
            os.fchmod(fd, mode)
            write_and_sync(fd, data)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if sync_directory:
        _sync_renamed(directory, data)


def padded(data: bytes) -> bytes:
    """``data`` with spaces up to a whole number of blocks."""
    return data + b" " * (-len(data) % BLOCK)


def replace_through_spare(
    path: Path, data: bytes, mode: int = 0o600, *, in_place: bool = True
) -> bytes:
    """Replace ``path`` with ``data`` padded to whole blocks, through the spare beside it (see
    the module's notes); returns the bytes the file now holds. OSError when it cannot be
    written: ``path`` is left as it was, unless only the final fsync of the directory failed:
    then DirectorySyncError, and ``path`` holds the new bytes (the error's ``written``), not
    sure to survive a power cut. Not ``in_place`` (the last write's fsync of the directory
    failed, so the spare may still be ``path`` on the disk), through a new file instead."""
    content = padded(data)
    directory = path.parent
    make_directory(directory)
    spare = _spare_of(path)
    previous = directory / f".{path.name}.previous"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(previous)  # left by a crash between the link and the renames
    if not in_place:
        write_atomically(path, content, mode)
        return content
    fd = _open_spare(spare, mode)
    if fd is None:
        write_atomically(path, content, mode)
        # A file of its own for the next write to overwrite. The directory is not fsync'd
        # for it: a spare lost to a crash is made again. Nor can it fail the write, which
        # is done (a full disk refusing it leaves the next write to make one).
        with contextlib.suppress(OSError):
            write_atomically(spare, content, mode, sync_directory=False)
        return content
    try:
        if os.fstat(fd).st_size != len(content):
            os.ftruncate(fd, len(content))  # grown past a block: a metadata change, rarely
        view, offset = memoryview(content), 0
        while offset < len(content):
            offset += os.pwrite(fd, view[offset:], offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(path, previous)
    except FileNotFoundError:
        linked = False  # no checkpoint yet (or removed): the next write makes a new spare
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # A file system without hard links: a fresh temporary file each time.
        write_atomically(path, content, mode)
        return content
    else:
        linked = True
    os.replace(spare, path)
    if linked:
        with contextlib.suppress(OSError):
            # Without it the next write makes a new spare; state.json is written already.
            os.replace(previous, spare)
    _sync_renamed(directory, content)
    return content


def _sync_renamed(directory: Path, written: bytes) -> None:
    """fsync the directory a file holding ``written`` was just renamed into."""
    try:
        fsync_directory(directory)
    except OSError as exc:
        raise DirectorySyncError(exc, directory, written) from exc


def _open_spare(spare: Path, mode: int) -> int | None:
    """The spare opened for writing; None (and the name cleared) when there is none fit to
    be overwritten in place: a second name would mean overwriting another file's contents,
    and a FIFO would never take the write."""
    try:
        fd = os.open(spare, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        _clear(spare)
        return None
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            if stat.S_IMODE(info.st_mode) != mode:
                os.fchmod(fd, mode)  # it becomes state.json
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    _clear(spare)
    return None


def _clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(errno.EISDIR, "a directory stands where the spare goes", str(path))
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def fsync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
