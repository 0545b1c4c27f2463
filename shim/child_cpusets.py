"""Moving a cgroup v1 cpuset that has cpusets of its own below it.

A container may make cgroups inside its own (Docker or containerd in a container, systemd as
the container's init, a CI runner that starts jobs in sub-cgroups). Cgroup v1 keeps every
child's ``cpuset.cpus`` and ``cpuset.mems`` inside its parent's and refuses (EBUSY) a parent
write that would leave a child with CPUs or nodes outside it: shrinking such a container's
cpuset fails, through the runtime too (``runc update`` writes the same files), and a shared
container would go on running on CPUs just handed out exclusively. Cgroup v2 needs none of
this from Linux 5.17 on (a child's effective CPUs follow its parent's by themselves); before,
it refused such a shrink too, and the same moves serve there, for the children with a set of
their own (an empty one there is all of the parent's, not "never configured").

So in v1 the children are moved with the container the way v2 would show them. What a
child's owner gave it is what it *wants*: every CPU of its parent (it follows the parent, as
a runtime inside the container makes its cgroups), or a set of its own. A child that follows
gets all of its parent's new set; one with a set of its own gets what the new set leaves of
it, or all of the new set when nothing is left; one never configured (empty, so it holds no
process) stays empty. Wants are remembered between moves, so a set of its own comes back
when the container grows again; a child found holding something other than cpushim last
wrote there was changed by its owner, and what it holds is its new want.

Every write keeps the kernel's rule, child inside parent: first a cgroup whose children need
room is widened to what it has and what they get (parents first), then each child is
narrowed to what it gets (children first); the container's own write comes last. A write
that is refused midway (the container's own included: a child made meanwhile) has the ones
before it undone, so the tree is as it was. Sibling children marked ``cpu_exclusive`` that
would end up sharing a CPU are refused by the kernel as well; that needs the container and
each of its parents to be exclusive too, which kubelet's cgroups never are. Wants are
remembered while cpushim runs: after a restart a child is taken as it is then.

:func:`plan_writes` is pure; :func:`has_children`, :func:`child_values` and
:func:`move_with_children` do the I/O.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from shim import cgroups
from shim.cpuset import CPUSet

# The container's own cgroup, among the paths of a plan.
OWN = PurePosixPath(".")
# A child removed while it is written: nothing to move any more.
_GONE = (errno.ENOENT, errno.ENODEV)


@dataclass(frozen=True, slots=True)
class Child:
    """What cpushim knows of one child cgroup's file after a move."""

    # What its owner gave it; None: all of its parent's (it follows the parent).
    wants: CPUSet | None
    # What cpushim wrote there (or found right), to tell a later change by its owner.
    written: CPUSet


Memory = Mapping[PurePosixPath, Child]


def targets(
    old: CPUSet, new: CPUSet, found: Mapping[PurePosixPath, CPUSet], memory: Memory
) -> dict[PurePosixPath, Child]:
    """Each child cgroup's want and what it should hold once the container moves from
    ``old`` to ``new``: ``found`` holds every child (a path relative to the container's)
    with its value now, ``memory`` what the last move left (children gone since are
    dropped)."""
    had = {OWN: old}
    gets = {OWN: new}
    result: dict[PurePosixPath, Child] = {}
    for path in sorted(found, key=lambda p: len(p.parts)):
        parent = path.parent
        current = found[path]
        remembered = memory.get(path)
        wants: CPUSet | None
        if remembered is not None and remembered.written == current:
            wants = remembered.wants
        elif current == had[parent] and current:
            wants = None
        else:
            wants = current
        if wants is None:
            target = gets[parent]
        elif not wants:
            target = wants  # never configured: it can hold no process
        else:
            target = (wants & gets[parent]) or gets[parent]
        had[path], gets[path] = current, target
        result[path] = Child(wants, target)
    return result


def plan_writes(
    old: CPUSet, new: CPUSet, found: Mapping[PurePosixPath, CPUSet], memory: Memory
) -> tuple[list[tuple[PurePosixPath, CPUSet]], dict[PurePosixPath, Child]]:
    """The writes, in order, that bring the children to their :func:`targets` and leave the
    container (``OWN``) ready for its own write of ``new``, each keeping every child inside
    its parent (a cgroup is widened, parents first, only as far as its children's targets
    need, then each child is narrowed, children first); and the memory to keep for the next
    move. No writes when there are no children."""
    wanted = targets(old, new, found, memory)
    holds = {OWN: old, **found}
    top_down = sorted(holds, key=lambda p: len(p.parts))
    room = {path: CPUSet() for path in holds}
    for path, child in wanted.items():
        room[path.parent] |= child.written
    writes: list[tuple[PurePosixPath, CPUSet]] = []
    for path in top_down:
        widened = holds[path] | room[path]
        if widened != holds[path]:
            writes.append((path, widened))
            holds[path] = widened
    for path in reversed(top_down):
        if path != OWN and holds[path] != wanted[path].written:
            writes.append((path, wanted[path].written))
    return writes, wanted


def has_children(directory: Path) -> bool:
    """Whether the cgroup has cgroups below it: kernfs counts a directory's subdirectories
    in its link count, as ordinary file systems do, so one stat tells."""
    try:
        return os.stat(directory).st_nlink > 2
    except OSError:
        return False


def child_values(
    directory: Path, name: str, *, inherit_empty: bool = False
) -> dict[PurePosixPath, CPUSet]:
    """Every cgroup below ``directory`` with the list in its file ``name``, by path relative
    to it; {} when there is none (:func:`has_children`: one stat, before any listing).
    With ``inherit_empty`` (cgroup v2, where an empty list means all of the parent's), a
    cgroup holding an empty list is left out, and what is below it with it: it restricts
    nothing above it, and what restricts it is not moved. OSError when a directory cannot
    be listed or a file read or parsed."""
    found: dict[PurePosixPath, CPUSet] = {}
    pending = [PurePosixPath()]
    while pending:
        relative = pending.pop()
        here = directory / relative
        if not has_children(here):
            continue
        try:
            entries = sorted(e.name for e in os.scandir(here) if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed meanwhile
        for entry in entries:
            child = relative / entry
            values = _read(directory / child, name)
            if values is not None and (values or not inherit_empty):
                found[child] = values
                pending.append(child)
    return found


def move_with_children(
    directory: Path, name: str, new: CPUSet, memory: Memory, *, inherit_empty: bool = False
) -> tuple[int, dict[PurePosixPath, Child]]:
    """Write ``new`` into a v1 container cgroup's file ``name`` (``cpuset.cpus`` or
    ``cpuset.mems``), the cgroups below it first (:func:`plan_writes`). Returns how many
    writes made room (all but the container's own) and the memory for the next move.
    OSError when a write is refused, after every write before it was undone; a child
    removed meanwhile is skipped. ``inherit_empty``: as :func:`child_values` (cgroup v2)."""
    found = child_values(directory, name, inherit_empty=inherit_empty)
    old = _read(directory, name) if found else None
    if old is None:
        cgroups.write_list(directory, name, new)
        return 0, {}
    writes, remembered = plan_writes(old, new, found, memory)
    done: list[tuple[PurePosixPath, CPUSet]] = []
    holds = {OWN: old, **found}
    for path, values in [*writes, (OWN, new)]:
        try:
            cgroups.write_list(directory / path, name, values)
        except OSError as exc:
            if path != OWN and exc.errno in _GONE:
                continue
            _undo(directory, name, done)
            raise
        done.append((path, holds[path]))
        holds[path] = values
    return len(done) - 1, remembered


def _undo(directory: Path, name: str, done: list[tuple[PurePosixPath, CPUSet]]) -> None:
    """Write back what each cgroup held, last write first: each step gives back a state the
    kernel accepted before. Best effort: what cannot be undone is left to the next move."""
    for path, previous in reversed(done):
        try:
            cgroups.write_list(directory / path, name, previous)
        except OSError:
            continue


def _read(directory: Path, name: str) -> CPUSet | None:
    try:
        return cgroups.read_list(directory, name)
    except ValueError as exc:
        raise OSError(errno.EINVAL, f"{directory / name} holds no list: {exc}") from exc


__all__ = [
    "OWN",
    "Child",
    "Memory",
    "child_values",
    "has_children",
    "move_with_children",
    "plan_writes",
    "targets",
]
