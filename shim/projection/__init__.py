"""A container's projected cpuset: read it, or subscribe to its changes.

cpushim keeps one directory per container (bind-mounted read-only at ``/run/cpushim`` inside
it) holding two files, each replaced by rename so a reader never sees a torn one:

- ``cpus``: the container's CPUs in the kernel's list format (``0-3,8``), one line;
- ``cpuset.json``: the whole state, described by :class:`Projection`. It is renamed after
  ``cpus``, so once it shows a generation, ``cpus`` is at least that new.

``read(path)`` returns the current state, ``watch(path)`` yields it and then every new one.

Workloads import this module without the rest of cpushim's dependencies: it needs the
standard library and anyio only (and ``shim.cpuset``, which is standard library only too).
inotify is reached through ctypes, so there is nothing to compile.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import struct
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, TypeAlias

import anyio

from shim.cpuset import CPUSet

__all__ = [
    "CPUS_FILE",
    "DEFAULT_PATH",
    "MAX_INTEGER",
    "POOLS",
    "STATE_FILE",
    "Pool",
    "Projection",
    "ProjectionError",
    "parse",
    "read",
    "watch",
]

CPUS_FILE: Final = "cpus"
STATE_FILE: Final = "cpuset.json"
# Where cpushim mounts a container's directory unless configured otherwise.
DEFAULT_PATH: Final = "/run/cpushim"

Pool: TypeAlias = Literal["exclusive", "shared", "reserved"]
POOLS: Final[tuple[Pool, ...]] = ("exclusive", "shared", "reserved")
# The largest integer (a generation, a NUMA node or socket id) a file may hold: what every
# JSON reader takes exactly (a float64's integers) and any writer can render again.
MAX_INTEGER: Final = 2**53 - 1

# RFC 3339 date-time (section 5.6); fromisoformat alone also takes forms RFC 3339 does not.
_RFC3339: Final = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})"
)
_CORE: Final = re.compile(r"(0|[1-9][0-9]*):(0|[1-9][0-9]*):(0|[1-9][0-9]*)")


class ProjectionError(ValueError):
    """A ``cpuset.json`` that is not a valid projection (malformed, or fields that disagree)."""


@dataclass(frozen=True, slots=True)
class Projection:
    """One state of a container's cpuset, as ``cpuset.json`` holds it.

    CPU and memory-node lists are strings in the kernel's list format, as cgroups and
    ``/proc/self/status`` print them; :meth:`cpu_ids` gives the CPUs as ints.
    """

    cpus: str
    # Memory nodes the container is confined to: its CPUs' nodes that have memory, or those
    # kubelet's memory manager chose (for a shared container too); "" when it is not confined,
    # so every node is allowed.
    mems: str
    # True exactly when pool is "exclusive": the CPUs are the container's alone.
    exclusive: bool
    pool: Pool
    # NUMA nodes and sockets (physical packages) holding at least one of the CPUs.
    numa_nodes: tuple[int, ...]
    sockets: tuple[int, ...]
    # Physical cores holding at least one of the CPUs, each named "socket:die:core" after
    # the CPU's topology/physical_package_id, die_id and core_id in sysfs (core ids restart
    # in every package and, on some parts, every die, so the three together name a core).
    cores: tuple[str, ...]
    # The CPUs among ``cpus`` that the kernel isolates (isolcpus), in list format.
    isolated: str
    # Grows by one with every change of this container's state and never repeats for its
    # directory, across cpushim restarts too. Compare generations to tell states apart.
    generation: int
    # When cpushim wrote this state, RFC 3339 in UTC.
    updated_at: str
    _cpu_set: CPUSet = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cpu_set", CPUSet.parse(self.cpus))

    def cpu_ids(self) -> frozenset[int]:
        """The CPUs as ints, ready for ``os.sched_setaffinity``."""
        return frozenset(self._cpu_set)

    def as_dict(self) -> dict[str, Any]:
        """The JSON object ``cpuset.json`` holds, in its field order."""
        return {
            "cpus": self.cpus,
            "mems": self.mems,
            "exclusive": self.exclusive,
            "pool": self.pool,
            "numa_nodes": list(self.numa_nodes),
            "sockets": list(self.sockets),
            "cores": list(self.cores),
            "isolated": self.isolated,
            "generation": self.generation,
            "updated_at": self.updated_at,
        }


# -- parsing --------------------------------------------------------------------------------


def parse(data: bytes | str) -> Projection:
    """The projection ``cpuset.json`` holds; ProjectionError naming the problem otherwise.

    Fields this version does not know are ignored, so an older workload keeps reading the files
    of a newer cpushim.
    """
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProjectionError(f"not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ProjectionError(f"expected a JSON object, got {type(document).__name__}")
    cpus = _cpu_list(document, "cpus")
    if not cpus:
        raise ProjectionError("'cpus' is empty: a container always has at least one CPU")
    mems = _cpu_list(document, "mems")
    exclusive = _field(document, "exclusive", bool)
    pool = _field(document, "pool", str)
    if pool not in POOLS:
        raise ProjectionError(f"'pool' is {pool!r}, not one of {', '.join(POOLS)}")
    if exclusive != (pool == "exclusive"):
        raise ProjectionError(f"'exclusive' is {exclusive} but 'pool' is {pool!r}")
    isolated = _cpu_list(document, "isolated")
    if not isolated.issubset(cpus):
        raise ProjectionError(f"'isolated' ({isolated}) is not among 'cpus' ({cpus})")
    cores = _field(document, "cores", list)
    for core in cores:
        if not isinstance(core, str) or _CORE.fullmatch(core) is None:
            raise ProjectionError(f"'cores' holds {core!r}, not a 'socket:die:core' name")
    generation = _field(document, "generation", int)
    if not 0 <= generation <= MAX_INTEGER:
        raise ProjectionError(f"'generation' is {generation}, not in 0..{MAX_INTEGER}")
    updated_at = _field(document, "updated_at", str)
    if _RFC3339.fullmatch(updated_at) is None or not _valid_time(updated_at):
        raise ProjectionError(f"'updated_at' is {updated_at!r}, not an RFC 3339 date-time")
    return Projection(
        cpus=str(cpus),
        mems=str(mems),
        exclusive=exclusive,
        pool=pool,
        numa_nodes=_id_list(document, "numa_nodes"),
        sockets=_id_list(document, "sockets"),
        cores=tuple(cores),
        isolated=str(isolated),
        generation=generation,
        updated_at=updated_at,
    )


def _field(document: dict[str, Any], name: str, kind: type[Any]) -> Any:
    if name not in document:
        raise ProjectionError(f"missing field {name!r}")
    value = document[name]
    # JSON true is a Python bool, and bool is an int: keep the two apart.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProjectionError(f"{name!r} is {value!r}, expected {kind.__name__}")
    return value


def _cpu_list(document: dict[str, Any], name: str) -> CPUSet:
    text = _field(document, name, str)
    try:
        return CPUSet.parse(text)
    except ValueError as exc:
        raise ProjectionError(f"{name!r}: {exc}") from None


def _id_list(document: dict[str, Any], name: str) -> tuple[int, ...]:
    values = _field(document, name, list)
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INTEGER:
            raise ProjectionError(f"{name!r} holds {value!r}, not an integer in 0..{MAX_INTEGER}")
    return tuple(sorted(set(values)))


def _valid_time(text: str) -> bool:
    try:
        datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def read(path: str | os.PathLike[str] = DEFAULT_PATH) -> Projection:
    """The current state in the projection directory ``path``.

    Raises FileNotFoundError when there is none yet, ProjectionError (a ValueError) when
    ``cpuset.json`` is malformed.
    """
    file = os.path.join(os.fspath(path), STATE_FILE)
    with open(file, "rb") as stream:
        data = stream.read()
    try:
        return parse(data)
    except ProjectionError as exc:
        raise ProjectionError(f"{file}: {exc}") from None


# -- inotify through ctypes -----------------------------------------------------------------

_IN_CLOSE_WRITE: Final = 0x00000008
_IN_MOVED_FROM: Final = 0x00000040
_IN_MOVED_TO: Final = 0x00000080
_IN_CREATE: Final = 0x00000100
_IN_DELETE: Final = 0x00000200
_IN_DELETE_SELF: Final = 0x00000400
_IN_MOVE_SELF: Final = 0x00000800
_IN_UNMOUNT: Final = 0x00002000
_IN_Q_OVERFLOW: Final = 0x00004000
_IN_IGNORED: Final = 0x00008000
_IN_ONLYDIR: Final = 0x01000000
_IN_MASK_ADD: Final = 0x20000000

# A directory on the way to the target: it going away, or its next entry coming, going or
# being replaced, means the watches must be placed again.
_SELF_GONE: Final = _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_UNMOUNT | _IN_IGNORED
_ENTRY_CHANGED: Final = _IN_CREATE | _IN_MOVED_TO | _IN_MOVED_FROM | _IN_DELETE
# The target itself: cpuset.json renamed in (cpushim's way), or written in place and closed.
_CONTENT: Final = _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_CREATE

_EVENT: Final = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len
# Room for at least one event with the longest name (NAME_MAX 255 + NUL).
_READ_SIZE: Final = 64 * 1024


class _Libc:
    """The three inotify calls, bound on first use so importing never needs Linux."""

    _instance: _Libc | None = None

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int

    @classmethod
    def get(cls) -> _Libc:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


def _os_error(path: str | None = None) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code), path)


class _Inotify:
    """One inotify instance; non-blocking, closed on exec."""

    def __init__(self) -> None:
        # IN_NONBLOCK and IN_CLOEXEC are defined as O_NONBLOCK and O_CLOEXEC.
        fd = int(_Libc.get().init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            raise _os_error()
        self.fd: int = fd

    def add(self, path: str, mask: int) -> int:
        wd = int(_Libc.get().add_watch(self.fd, os.fsencode(path), mask))
        if wd < 0:
            raise _os_error(path)
        return wd

    def events(self) -> Iterator[tuple[int, int, str]]:
        """Every queued event as (wd, mask, name), without blocking."""
        while True:
            try:
                data = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                return
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                name = data[start : start + length].split(b"\0", 1)[0]
                offset = start + length
                yield wd, mask, os.fsdecode(name)

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class _Watches:
    """What each watch of one arming is for."""

    inotify: _Inotify
    # Directories on the way: the name of their entry that leads to the target.
    leads_to: dict[int, set[str]] = field(default_factory=dict)
    # The target directory's watch, when it exists.
    target: int | None = None


def _prefixes(target: str) -> list[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b", "/a/b/c"]``."""
    parts = [part for part in target.split("/") if part]
    return ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _arm(target: str) -> _Watches:
    """Watch every existing directory from ``/`` down to ``target`` (or to the deepest one
    that exists). Each watch is placed before its child is looked up, so a child appearing
    at any moment is either found or reported."""
    watches = _Watches(_Inotify())
    try:
        prefixes = _prefixes(target)
        watched_parent = False
        for index, prefix in enumerate(prefixes):
            is_target = index == len(prefixes) - 1
            kind = _CONTENT if is_target else _ENTRY_CHANGED
            # IN_MASK_ADD: two prefixes may be one directory (a symlink to an ancestor).
            mask = kind | _SELF_GONE | _IN_ONLYDIR | _IN_MASK_ADD
            try:
                wd = watches.inotify.add(prefix, mask)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    if not watched_parent:
                        raise PermissionError(
                            errno.EACCES, f"cannot watch for {prefix!r} to appear", target
                        ) from exc
                    break  # its parent's watch reports when it appears
                if exc.errno == errno.EACCES and not is_target:
                    # A directory we may pass through but not watch: only its replacement
                    # goes unseen. Its child is watched next.
                    watched_parent = False
                    continue
                raise
            watched_parent = True
            if is_target:
                watches.target = wd
            else:
                watches.leads_to.setdefault(wd, set()).add(os.path.basename(prefixes[index + 1]))
    except BaseException:
        watches.inotify.close()
        raise
    return watches


def _read_if_whole(directory: str) -> Projection | None:
    """The state when there is a valid one; None while it is missing or not (yet) valid."""
    try:
        return read(directory)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ProjectionError):
        return None


async def watch(path: str | os.PathLike[str] = DEFAULT_PATH) -> AsyncGenerator[Projection, None]:
    """Yield the state in the projection directory ``path`` now, then each new state once.

    A state is new when its generation differs from the last one yielded; several changes in
    quick succession may arrive as their latest only. The first state is yielded as soon as a
    valid ``cpuset.json`` exists: the directory (and its parents) may appear later, and may be
    removed and made again. A missing or malformed file is waited out, not raised.

    Symlinks in ``path`` are followed when the watches are placed. A directory behind a
    symlink that is removed is noticed, but one made again there is found only once an entry
    on ``path`` itself changes; cpushim's own paths (a bind mount in the container, plain
    directories on the host) have no such symlink.

    Close the iterator to release its inotify descriptor (``contextlib.aclosing``, or
    leaving the ``async for`` of a generator the event loop finalises).
    """
    # The path is made absolute once, so a later chdir changes nothing. Like the reads and
    # watches below, this is inline: microseconds on the tmpfs cpushim writes to, where a
    # worker thread would add a hop to every change.
    target = os.path.abspath(os.fspath(path))  # noqa: ASYNC240
    last: int | None = None
    watches = _arm(target)
    try:
        reread = True
        while True:
            if reread and watches.target is not None:
                reread = False
                state = _read_if_whole(target)
                if state is not None and state.generation != last:
                    last = state.generation
                    yield state
            await anyio.wait_readable(watches.inotify.fd)
            rearm = False
            for wd, mask, name in watches.inotify.events():
                if mask & (_IN_Q_OVERFLOW | _SELF_GONE):
                    rearm = True  # lost events, or a directory on the way is gone
                elif wd == watches.target:
                    reread = reread or name == STATE_FILE
                elif name in watches.leads_to.get(wd, ()):
                    rearm = True  # the next directory came, went or was replaced
            if rearm:
                # A fresh instance: no stale watch or queued event of the old one survives.
                fresh = _arm(target)
                watches.inotify.close()
                watches, reread = fresh, True
    finally:
        watches.inotify.close()
