"""Writes each container's projection directory on the host: ``<root>/<pod-uid>/<container>/``.

Every file is replaced atomically (a temporary file in the same directory, fsync, rename, then
fsync of the directory), ``cpus`` before ``cpuset.json``, so a subscriber that sees a new
``cpuset.json`` finds ``cpus`` at least as new. Below the root, directories are opened one
level at a time without following symlinks and everything is done relative to them: a name
is validated before it becomes a path, and nothing is ever written outside the root.

Generations. A directory's generation grows by one per change, continuing from the one in
its ``cpuset.json``, so a new writer (a restarted cpushim) carries on. When there is no
readable ``cpuset.json`` (a new directory, or a damaged file), the generation starts from the
wall clock in microseconds, raised above the file's and directory's modification times and
above anything this writer wrote there. Earlier generations cannot reach that: each one
counted up from a wall-clock start by one per write, and a write takes far longer than a
microsecond, so a generation stays below the time it was written at. Only a clock stepped back
after a file was lost could repeat one. Microseconds since 1970 stay below 2**53 until the
year 2255, so JSON readers that hold numbers as doubles read them exactly.

The blocking work of one call runs in one worker thread; operations on one pod are serialised.
A thread cannot be stopped: when its caller is cancelled it runs on, and the pod's next
operation waits for it to end, lest two interleave their temporary files and renames.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import stat
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, ParamSpec, TypeVar

from shim.cpuset import CPUSet
from shim.fileio import write_and_sync
from shim.mountinfo import parse_mountinfo
from shim.projection import (
    CPUS_FILE,
    MAX_INTEGER,
    STATE_FILE,
    Pool,
    Projection,
    ProjectionError,
    parse,
)
from shim.projection.content import describe, render, rfc3339, same_state
from shim.topology import Topology

__all__ = ["ProjectionPathError", "ProjectionWriter", "check_name"]

# A file name's limit on Linux filesystems (NAME_MAX), in bytes.
NAME_MAX: Final = 255
# Pod UIDs (UUIDs, or hashes for static pods) and container names (DNS labels) fit easily;
# a leading letter or digit keeps our hidden temporary files and "." / ".." apart.
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TEMPORARY: Final = re.compile(r"\.(cpus|cpuset\.json)\.[0-9a-f]+\.tmp")
_OURS: Final = frozenset({CPUS_FILE, STATE_FILE})

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MODE_DIR: Final = 0o755
_MODE_FILE: Final = 0o644
# The stamp of a state not written yet.
_NO_TIME: Final = rfc3339(0)

_P = ParamSpec("_P")
_T = TypeVar("_T")


class ProjectionPathError(ValueError):
    """A pod UID or container name that cannot safely become a directory name."""


def check_name(kind: str, value: str) -> str:
    """``value`` when it is a safe single directory name; ProjectionPathError otherwise."""
    if not isinstance(value, str):
        raise ProjectionPathError(f"{kind} must be a string, got {type(value).__name__}")
    if len(value.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise ProjectionPathError(f"{kind} {value[:32]!r}... is longer than {NAME_MAX} bytes")
    if _NAME.fullmatch(value) is None:
        raise ProjectionPathError(
            f"{kind} {value!r} cannot be a directory name: it must be letters, digits,"
            " '.', '_' or '-', starting with a letter or digit"
        )
    return value


class ProjectionWriter:
    """The projection directories under ``root``.

    ``clock_ns`` gives the wall-clock time in nanoseconds (for ``updated_at`` and fresh
    generations); tests pass their own.
    """

    def __init__(
        self,
        root: Path,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        inline: bool | None = None,
    ) -> None:
        self.root = root
        self._clock_ns = clock_ns
        # Write on the event loop itself (True) or in a worker thread. On a memory file system
        # a write takes tens of microseconds and the hop to a thread costs far more (the
        # projection bench's p99 went from 10 ms to 1.5 ms); on a disk, fsync may take
        # milliseconds that must not stall the loop. None: decide from the file system.
        self.inline = on_memory_fs(root) if inline is None else inline
        # What each directory held when this writer last wrote or read it. A file still
        # holding those bytes needs no parsing, and the generation never goes back below it
        # even if the file is damaged.
        self._known: dict[str, dict[str, _Known]] = {}
        self._pod_locks: dict[str, _SharedLock] = {}
        # The worker thread of each pod's last blocking call, while it runs: one whose caller
        # was cancelled runs on, and the pod's lock alone would let the next call begin.
        self._threads: dict[str, asyncio.Future[Any]] = {}
        self.writes = 0
        self.unchanged = 0

    def directory(self, pod_uid: str, container_name: str) -> Path:
        """Where a container's files go; ProjectionPathError for an unsafe UID or name."""
        pod = check_name("pod UID", pod_uid)
        return self.root / pod / check_name("container name", container_name)

    async def write(
        self,
        pod_uid: str,
        container_name: str,
        cpus: CPUSet,
        mems: str,
        exclusive: bool,
        pool: Pool,
        topology: Topology,
    ) -> int:
        """Project a container's cpuset; returns the generation its directory now holds.

        Nothing is written when only the generation and time would change. ValueError for
        an unsafe name (ProjectionPathError) or a state that cannot be described.
        """
        check_name("pod UID", pod_uid)
        check_name("container name", container_name)
        # Built (and so checked) before anything touches the disk; the stamps come later.
        wanted = describe(
            cpus=cpus,
            mems=mems,
            exclusive=exclusive,
            pool=pool,
            topology=topology,
            generation=0,
            updated_at=_NO_TIME,
        )
        async with self._pod_lock(pod_uid):
            known = self._known.get(pod_uid, {}).get(container_name)
            if self.inline:
                now, written = _write(
                    self.root, pod_uid, container_name, wanted, known, self._clock_ns
                )
            else:
                now, written = await self._in_thread(
                    pod_uid,
                    _write,
                    self.root,
                    pod_uid,
                    container_name,
                    wanted,
                    known,
                    self._clock_ns,
                )
            self._known.setdefault(pod_uid, {})[container_name] = now
        if written:
            self.writes += 1
        else:
            self.unchanged += 1
        return now.state.generation

    async def remove(self, pod_uid: str, container_name: str) -> None:
        """Remove a container's directory, and its pod's when that is left empty."""
        self.directory(pod_uid, container_name)
        async with self._pod_lock(pod_uid):
            await self._in_thread(pod_uid, _remove_container, self.root, pod_uid, container_name)
        self._known.get(pod_uid, {}).pop(container_name, None)

    async def remove_pod(self, pod_uid: str, unless: Callable[[], bool] | None = None) -> None:
        """Remove a pod's directory with every container's in it; nothing when ``unless()``
        is true once the pod's lock is held."""
        check_name("pod UID", pod_uid)
        async with self._pod_lock(pod_uid):
            if unless is not None and unless():
                return
            if self.inline:
                _remove_pod(self.root, pod_uid)
            else:
                await self._in_thread(pod_uid, _remove_pod, self.root, pod_uid)
            self._known.pop(pod_uid, None)

    async def clean_stale(
        self,
        keep: Collection[tuple[str, str]],
        failed: Callable[[str, OSError], None] | None = None,
    ) -> list[Path]:
        """Remove the directories of containers not in ``keep`` (pod UID, container name) and
        pod directories left empty; returns what was removed. Entries that do not look like
        cpushim's (other names, symlinks, files, directories with other content) stay. A pod
        whose sweep fails is told to ``failed`` (raised without it) and the others go on."""
        kept: dict[str, set[str]] = {}
        for pod_uid, container_name in keep:
            kept.setdefault(pod_uid, set()).add(container_name)
        removed: list[Path] = []
        for pod_uid in await asyncio.to_thread(_pod_names, self.root):
            async with self._pod_lock(pod_uid):
                try:
                    names = await self._in_thread(
                        pod_uid, _sweep_pod, self.root, pod_uid, frozenset(kept.get(pod_uid, ()))
                    )
                except OSError as exc:
                    if failed is None:
                        raise
                    failed(pod_uid, exc)
                    continue
            pod_known = self._known.get(pod_uid, {})
            for name in names:
                pod_known.pop(name, None)
                removed.append(self.root / pod_uid / name if name else self.root / pod_uid)
        return removed

    @asynccontextmanager
    async def _pod_lock(self, pod_uid: str) -> AsyncIterator[None]:
        shared = self._pod_locks.get(pod_uid)
        if shared is None:
            shared = self._pod_locks[pod_uid] = _SharedLock()
        shared.users += 1
        try:
            async with shared.lock:
                running = self._threads.get(pod_uid)
                if running is not None:
                    # Through wait: awaited itself, the thread's task would be cancelled
                    # with this caller, and the next one would not wait for it either.
                    await asyncio.wait((running,))
                yield
        finally:
            shared.users -= 1
            if not shared.users:  # the map holds only locks in use
                del self._pod_locks[pod_uid]

    async def _in_thread(
        self, pod_uid: str, func: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        """``func`` in a worker thread, called holding the pod's lock; the thread is the
        pod's until it ends, even if this call is cancelled first."""
        running = asyncio.ensure_future(asyncio.to_thread(func, *args, **kwargs))
        self._threads[pod_uid] = running

        def ended(done: asyncio.Future[_T]) -> None:
            if self._threads.get(pod_uid) is done:
                del self._threads[pod_uid]

        running.add_done_callback(ended)
        return await asyncio.shield(running)


class _SharedLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


@dataclass(frozen=True)
class _Known:
    state: Projection
    files: dict[str, bytes]  # the bytes of each file for ``state``

    @classmethod
    def of(cls, state: Projection) -> _Known:
        return cls(state, dict(render(state)))


# -- the blocking part, run in a worker thread -----------------------------------------------


def _write(
    root: Path,
    pod_uid: str,
    container_name: str,
    wanted: Projection,
    known: _Known | None,
    clock_ns: Callable[[], int],
) -> tuple[_Known, bool]:
    """Bring the directory to ``wanted``; returns what it holds now and whether it was
    written."""
    with (
        _open_root(root, create=True) as root_fd,
        _open_dir(root_fd, pod_uid, create=True, where=root) as pod_fd,
    ):
        directory = _open_dir(pod_fd, container_name, create=True, where=root / pod_uid)
        with directory as dir_fd:
            return _update(dir_fd, directory.created, wanted, known, clock_ns)


def _update(
    dir_fd: int,
    created: bool,
    wanted: Projection,
    known: _Known | None,
    clock_ns: Callable[[], int],
) -> tuple[_Known, bool]:
    """Bring the open directory to ``wanted``; ``created`` when it was made just now."""
    state_data, state_ns = _read_file(dir_fd, STATE_FILE)
    cpus_data, cpus_ns = _read_file(dir_fd, CPUS_FILE)
    current = _recognise(state_data, known)
    if (
        current is not None
        and same_state(current.state, wanted)
        # A damaged or missing ``cpus`` beside an intact state is rewritten too, and so is
        # a file rolled back below what this writer wrote, lest its generations come again.
        and cpus_data == current.files[CPUS_FILE]
        and (known is None or current.state.generation >= known.state.generation)
    ):
        return current, False
    floor = known.state.generation + 1 if known is not None else 0
    now_ns = clock_ns()
    if current is not None:
        generation = max(current.state.generation + 1, floor)
    else:
        # Nothing to count on: see the module's notes. A directory made just now holds no
        # history, and its time would only say when it was made.
        modified_ns = max(state_ns, cpus_ns)
        if not created:
            modified_ns = max(modified_ns, os.fstat(dir_fd).st_mtime_ns)
        generation = max(now_ns // 1000, modified_ns // 1000 + 1, floor)
    if generation > MAX_INTEGER:
        # Only after a file damaged to hold the largest there is: a generation no reader
        # takes would stop every subscriber for good; starting again from the clock stops
        # none.
        generation = now_ns // 1000
    written = _Known.of(replace(wanted, generation=generation, updated_at=rfc3339(now_ns)))
    for name, data in written.files.items():  # in render's order: cpuset.json last
        _replace(dir_fd, name, data)
    os.fsync(dir_fd)
    return written, True


def _recognise(data: bytes | None, known: _Known | None) -> _Known | None:
    """The state ``cpuset.json`` holds; None when it is missing or not valid."""
    if data is None:
        return None
    if known is not None and data == known.files[STATE_FILE]:
        return known
    try:
        return _Known.of(parse(data))
    except ProjectionError:
        return None


def _read_file(dir_fd: int, name: str) -> tuple[bytes | None, int]:
    # O_NONBLOCK: a FIFO in a file's place would otherwise hold the open for ever (the event
    # loop itself on tmpfs).
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        # Missing, or something that is not a plain file (a symlink): not ours to read.
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            return None, 0
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            return None, 0
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks), status.st_mtime_ns
    finally:
        os.close(fd)


def _replace(dir_fd: int, name: str, data: bytes) -> None:
    """Replace ``name`` in the directory with ``data``: temp file, fsync, rename."""
    temporary = f".{name}.{os.urandom(6).hex()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, _MODE_FILE, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, _MODE_FILE)  # whatever the process umask
            write_and_sync(fd, data)
        finally:
            os.close(fd)
        os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise


class _Fd:
    """An open directory, closed on leaving the ``with``; ``created`` when it was just made."""

    def __init__(self, fd: int, *, created: bool = False) -> None:
        self.fd = fd
        self.created = created

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _open_root(root: Path, *, create: bool) -> _Fd:
    # The root is configuration, trusted as given (it may be a symlink, as /var/run is).
    try:
        return _Fd(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except FileNotFoundError:
        if not create:
            raise
    root.mkdir(mode=_MODE_DIR, parents=True, exist_ok=True)
    return _Fd(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))


def _open_dir(parent_fd: int, name: str, *, create: bool, where: Path) -> _Fd:
    """Open ``name`` in the parent as a real directory, never through a symlink; make it
    (0755, durably) when missing and ``create``."""
    try:
        return _Fd(_open_real_dir(parent_fd, name, where))
    except FileNotFoundError:
        if not create:
            raise
    created = True
    try:
        os.mkdir(name, _MODE_DIR, dir_fd=parent_fd)
    except FileExistsError:
        created = False  # made by someone else meanwhile
    fd = _open_real_dir(parent_fd, name, where)
    try:
        if created:
            os.fchmod(fd, _MODE_DIR)  # whatever the process umask
            os.fsync(parent_fd)  # the new entry survives a crash, as the files will
    except BaseException:
        os.close(fd)
        raise
    return _Fd(fd, created=created)


def _open_real_dir(parent_fd: int, name: str, where: Path) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotADirectoryError(
                exc.errno, "is a symlink or a file, not a projection directory", str(where / name)
            ) from None
        raise


def _remove_container(root: Path, pod_uid: str, container_name: str) -> None:
    try:
        with _open_root(root, create=False) as root_fd:
            with (
                _open_dir(root_fd, pod_uid, create=False, where=root) as pod_fd,
                suppress(FileNotFoundError),
            ):
                shutil.rmtree(container_name, dir_fd=pod_fd)
            _rmdir_if_empty(root_fd, pod_uid)
    except FileNotFoundError:
        pass


def _remove_pod(root: Path, pod_uid: str) -> None:
    try:
        with _open_root(root, create=False) as root_fd:
            # rmtree refuses a symlink too, but its error differs between Python versions.
            if stat.S_ISLNK(os.lstat(pod_uid, dir_fd=root_fd).st_mode):
                raise OSError(
                    errno.ELOOP,
                    "is a symbolic link, not a projection directory",
                    str(root / pod_uid),
                )
            shutil.rmtree(pod_uid, dir_fd=root_fd)
    except FileNotFoundError:
        pass


def _rmdir_if_empty(parent_fd: int, name: str) -> bool:
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            return False
        raise
    return True


def _pod_names(root: Path) -> list[str]:
    """Entries of the root that could be pod directories of ours."""
    try:
        with os.scandir(root) as entries:
            return sorted(
                entry.name
                for entry in entries
                if _NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
            )
    except FileNotFoundError:
        return []


def _sweep_pod(root: Path, pod_uid: str, keep: frozenset[str]) -> list[str]:
    """Remove the pod's container directories not in ``keep`` that hold nothing but our
    files, and the pod directory when that leaves it empty; returns the container names
    removed, and "" for the pod directory. Leftover temporary files of kept directories go."""
    removed: list[str] = []
    try:
        with _open_root(root, create=False) as root_fd:
            with _open_dir(root_fd, pod_uid, create=False, where=root) as pod_fd:
                for name in _container_names(pod_fd):
                    with _open_dir(pod_fd, name, create=False, where=root / pod_uid) as dir_fd:
                        ours = _our_files(dir_fd)
                        if ours is None:
                            continue  # someone else's content: leave it
                        for file in ours:
                            if name not in keep or _TEMPORARY.fullmatch(file):
                                os.unlink(file, dir_fd=dir_fd)
                    if name not in keep and _rmdir_if_empty(pod_fd, name):
                        removed.append(name)
            if not keep and _rmdir_if_empty(root_fd, pod_uid):
                removed.append("")
    except (FileNotFoundError, NotADirectoryError):
        pass  # gone meanwhile, or replaced by something that is not ours
    return removed


def _container_names(pod_fd: int) -> list[str]:
    with os.scandir(pod_fd) as entries:
        return sorted(
            entry.name
            for entry in entries
            if _NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
        )


def _our_files(dir_fd: int) -> list[str] | None:
    """The directory's entries when every one is a plain file cpushim writes; else None."""
    names = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if not entry.is_file(follow_symlinks=False):
                return None
            if entry.name not in _OURS and not _TEMPORARY.fullmatch(entry.name):
                return None
            names.append(entry.name)
    return names


MEMORY_FILE_SYSTEMS: Final = frozenset({"tmpfs", "ramfs"})


def on_memory_fs(path: Path, mountinfo: str | None = None) -> bool:
    """Whether ``path`` (made or not yet) is on a file system kept in memory, from
    ``/proc/self/mountinfo`` (or the text given)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return False
    # Symlinks in the part that exists are followed; the rest is taken as written.
    target = Path(os.path.realpath(path))
    best, best_type = "", ""
    for mount in parse_mountinfo(mountinfo):
        point = str(mount.point)
        inside = str(target) == point or str(target).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, mount.fstype
    return best_type in MEMORY_FILE_SYSTEMS
