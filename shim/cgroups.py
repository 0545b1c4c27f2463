"""Where a container's cpuset lives in the cgroup filesystem, and reading and writing it.

The path comes from what the runtime reports (the OCI spec's ``linux.cgroupsPath``, which
containerd shows in ContainerStatus' verbose info), not from a guess. Two drivers write that
field differently:

- cgroupfs: a path below the hierarchy's root, ``/kubepods/burstable/pod<uid>/<id>``;
- systemd: ``<slice>:<prefix>:<name>``, the unit ``<prefix>-<name>.scope`` inside ``<slice>``,
  where a slice named ``a-b-c.slice`` sits in ``a-b.slice`` inside ``a.slice`` (systemd's own
  naming rule: each dash opens a level).

Two hierarchies hold the cpuset: cgroup v1 mounts the cpuset controller on its own (usually
``/sys/fs/cgroup/cpuset``), cgroup v2 has one unified tree (usually ``/sys/fs/cgroup``). A hybrid
node (v1 controllers plus an empty v2 mount) keeps cpusets in v1. Both name the file
``cpuset.cpus``; v2 adds ``cgroup.events``, whose ``populated`` line turns 0 when the last
process leaves.

The parsing is pure; the readers and writers of cgroup files at the end are the only I/O.
"""

from __future__ import annotations

import enum
import errno
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from shim.cpuset import CPUSet
from shim.fileio import read_file
from shim.mountinfo import Mount, parse_mountinfo

CPUSET_CPUS = "cpuset.cpus"
CPUSET_MEMS = "cpuset.mems"
CGROUP_EVENTS = "cgroup.events"


class CgroupError(ValueError):
    """A cgroups path or mount table cpushim cannot place."""


class CgroupVersion(enum.IntEnum):
    V1 = 1
    V2 = 2


@dataclass(frozen=True)
class CgroupLayout:
    """Where the cpuset controller is mounted, and which cgroup version it is."""

    version: CgroupVersion
    root: Path

    @classmethod
    def from_mountinfo(cls, text: str) -> CgroupLayout:
        """The cpuset hierarchy from ``/proc/self/mountinfo``: v1's cpuset mount when there is
        one, else the v2 mount. Of several mounts of one, those of the whole hierarchy come
        first (a bind mount of a subtree, wherever it is, would put every container's cgroup
        in the wrong place), then the top one."""
        cpuset: list[Mount] = []
        unified: list[Mount] = []
        for mount in parse_mountinfo(text):
            if mount.fstype == "cgroup" and "cpuset" in mount.super_options:
                cpuset.append(mount)
            elif mount.fstype == "cgroup2":
                unified.append(mount)
        if cpuset:
            return cls(CgroupVersion.V1, _whole_first(cpuset).point)
        if unified:
            return cls(CgroupVersion.V2, _whole_first(unified).point)
        raise CgroupError("no cgroup v1 cpuset hierarchy and no cgroup v2 mount in mountinfo")

    @classmethod
    def detect(cls, proc: Path = Path("/proc")) -> CgroupLayout:
        return cls.from_mountinfo((proc / "self" / "mountinfo").read_text())

    def container_dir(self, cgroups_path: str) -> Path:
        """The directory of the cgroup named by an OCI ``cgroupsPath``."""
        return self.root / relative_cgroup_path(cgroups_path)


def _whole_first(mounts: list[Mount]) -> Mount:
    """Of the mounts of one hierarchy: one of all of it, the top one; the first of equals."""
    return min(mounts, key=lambda m: (m.root != "/", len(m.point.parts)))


def relative_cgroup_path(cgroups_path: str) -> PurePosixPath:
    """``cgroupsPath`` (either driver's form) as a path below the hierarchy's root."""
    if not cgroups_path:
        raise CgroupError("empty cgroupsPath")
    if "\0" in cgroups_path:
        raise CgroupError(f"cgroupsPath with a NUL byte: {cgroups_path!r}")
    if not cgroups_path.startswith("/") and cgroups_path.count(":") == 2:
        path = _systemd_path(cgroups_path)
    else:
        path = PurePosixPath(cgroups_path.lstrip("/"))
    # Checked on the raw text: PurePosixPath drops "." components silently.
    if not path.parts or any(part in ("..", ".") for part in cgroups_path.split("/")):
        raise CgroupError(f"cgroupsPath does not name a cgroup below the root: {cgroups_path!r}")
    return path


def _systemd_path(cgroups_path: str) -> PurePosixPath:
    slice_name, prefix, name = cgroups_path.split(":")
    if not name:
        raise CgroupError(f"systemd cgroupsPath without a unit name: {cgroups_path!r}")
    # runc's defaults: no slice means system.slice, a name ending in .slice is a slice itself,
    # any other a scope named prefix-name, the dash kept when the prefix is empty.
    unit = name if name.endswith(".slice") else f"{prefix}-{name}.scope"
    return expand_slice(slice_name or "system.slice") / unit


def expand_slice(slice_name: str) -> PurePosixPath:
    """A systemd slice's path from the root: ``a-b.slice`` is ``a.slice/a-b.slice``."""
    if not slice_name.endswith(".slice") or "/" in slice_name:
        raise CgroupError(f"not a systemd slice name: {slice_name!r}")
    if slice_name == "-.slice":
        return PurePosixPath()
    stem = slice_name.removesuffix(".slice")
    if not stem or stem.startswith("-") or stem.endswith("-") or "--" in stem:
        raise CgroupError(f"not a systemd slice name: {slice_name!r}")
    words = stem.split("-")
    return PurePosixPath(*("-".join(words[: i + 1]) + ".slice" for i in range(len(words))))


def systemd_byte_reversed(cpus: CPUSet) -> CPUSet:
    """The set systemd applies when a runc older than 1.1.6 (opencontainers/runc#3611;
    Debian bookworm's 1.1.5, for one) passes it ``cpus`` as ``AllowedCPUs`` with the
    systemd cgroup driver: runc sends the mask's bytes most significant first, and systemd
    reads the first byte as CPUs 0-7. A set within CPUs 0-7 comes through unchanged; beyond,
    systemd records another set, and writes it into the cgroup whenever it applies the unit
    again (a daemon-reload, the runtime's next update)."""
    mask = cpus.mask
    width = (mask.bit_length() + 7) // 8
    return CPUSet.from_mask(int.from_bytes(mask.to_bytes(width, "big"), "little"))


def populated(events_text: str) -> bool | None:
    """The ``populated`` flag of a v2 ``cgroup.events`` file; None when it has none."""
    for line in events_text.splitlines():
        key, _, value = line.partition(" ")
        if key == "populated":
            return value.strip() == "1"
    return None


def containerd_cgroups_path(cgroup_parent: str, container_id: str) -> str:
    """The OCI ``cgroupsPath`` containerd's CRI plugin gives a container of a pod whose
    sandbox has ``cgroup_parent``: a systemd slice names a scope, anything else a directory."""
    base = PurePosixPath(cgroup_parent).name
    if base.endswith(".slice"):
        return f"{base}:cri-containerd:{container_id}"
    return f"{cgroup_parent.rstrip('/')}/{container_id}"


def cgroup_parent_of(cgroups_path: str) -> str:
    """The cgroup parent a container's OCI ``cgroupsPath`` was made under, the other way
    round from :func:`containerd_cgroups_path`: the slice of a systemd one, the directory
    above any other; "" when it names none."""
    if not cgroups_path.startswith("/") and cgroups_path.count(":") == 2:
        return cgroups_path.split(":")[0]
    parent = PurePosixPath(cgroups_path).parent
    return str(parent) if parent.name else ""


# What containerd's shims call themselves (``comm``, cut to 15 bytes by the kernel).
CONTAINERD_SHIMS: Final = ("containerd-shim",)


def first_process(
    directory: Path, shims: tuple[str, ...] = CONTAINERD_SHIMS, proc: Path = Path("/proc")
) -> int:
    """The process a runtime's shim started in this container cgroup: the one process there
    whose parent's name begins with one of ``shims``. 0 when the cgroup is gone or empty,
    when no process there is a shim's child (a container that moved its process elsewhere,
    another runtime), or when more than one is (an exec beside the container's process),
    which only the runtime can tell apart."""
    try:
        pids = [int(word) for word in read_file(directory / "cgroup.procs").split()]
    except (OSError, ValueError):
        return 0
    found = [pid for pid in pids if _parent_is_one_of(pid, shims, proc)]
    return found[0] if len(found) == 1 else 0


def _parent_is_one_of(pid: int, names: tuple[str, ...], proc: Path) -> bool:
    """Whether the process's parent is called one of ``names`` (False when either is gone)."""
    try:
        stat = read_file(f"{proc}/{pid}/stat")
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; from the last ")".
        parent = int(stat[stat.rfind(b")") + 2 :].split()[1])
        comm = read_file(f"{proc}/{parent}/comm").decode(errors="replace").strip()
    except (OSError, ValueError, IndexError):
        return False
    return comm.startswith(names)


def read_cpus(directory: Path) -> CPUSet | None:
    """The cgroup's ``cpuset.cpus``; None when the cgroup is gone."""
    return read_list(directory, CPUSET_CPUS)


def read_list(directory: Path, name: str) -> CPUSet | None:
    """A cgroup file in the kernel's list format (``cpuset.cpus``, ``cpuset.mems``); None
    when the cgroup is gone, ValueError when it holds no list."""
    try:
        text = read_file(directory / name).decode()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        # kernfs: the file was open when its cgroup was removed.
        if exc.errno == errno.ENODEV:
            return None
        raise
    return CPUSet.parse(text.strip())


def write_list(directory: Path, name: str, values: CPUSet) -> None:
    """Write a cgroup file in the kernel's list format in one write(2), as the kernel wants
    it. OSError is the caller's to handle; the kernel's (kernel/cgroup/cpuset.c) are ENOENT
    or ENODEV when the cgroup is gone (ENODEV: removed after the open), EACCES under v1
    when the parent does not have these CPUs or nodes (v2 takes any set and narrows it to
    the parent's), EBUSY when a child has more (v1, and v2 before Linux 5.17), EINVAL for
    CPUs or nodes that are not online (v1) or do not exist, and ENOSPC under v1 for an
    empty set in a cgroup with processes."""
    # O_TRUNC as a shell redirection does: cgroupfs ignores it, a plain file (tests) needs it.
    fd = os.open(directory / name, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, str(values).encode() or b"\n")
    finally:
        os.close(fd)
