"""Moving a cgroup v1 cpuset that has cpusets of its own below it.

A container may make cgroups inside its own (Docker or containerd in a container, systemd as
the container's init, a CI runner that starts jobs in sub-cgroups). Cgroup v1 keeps every
child's ``cpuset.cpus`` inside its parent's and refuses (EBUSY) a parent write that would
leave a child with CPUs outside it: shrinking such a container's cpuset fails, through the
runtime too (``runc update`` writes the same file), and a shared container would go on
running on CPUs just handed out exclusively. Cgroup v2 needs none of this: a child's
effective CPUs follow its parent's by themselves.

So in v1 the children are moved with the container, the way v2 would see them: a child that
had every CPU of the container follows it to its new set; a child with fewer keeps those of
its CPUs the new set still has (all of the new set when none is left); a child never
configured (no CPUs, so no process) stays so. Every write keeps the kernel's rule, child
inside parent: first a cgroup whose children need room is widened to what it has and what
they get (parents first), then each child is narrowed to what it gets (children first); the
container's own write comes last, by the caller (straight into the cgroup, or by the
runtime).

:func:`plan_writes` is pure; :func:`child_cpusets` and :func:`write_children` do the I/O.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from shim import cgroups
from shim.cpuset import CPUSet

# The container's own cgroup, among the paths of a plan.
OWN = PurePosixPath(".")


def targets(
    old: CPUSet, new: CPUSet, children: Mapping[PurePosixPath, CPUSet]
) -> dict[PurePosixPath, CPUSet]:
    """What each child cgroup (a path relative to the container's, parents listed with their
    children) should hold once the container moves from ``old`` to ``new``."""
    had = {OWN: old}
    gets = {OWN: new}
    for path in sorted(children, key=lambda p: len(p.parts)):
        parent = path.parent
        current = children[path]
        if not current:
            target = current  # never configured: it can hold no process, so no CPU either
        elif current == had[parent]:
            target = gets[parent]
        else:
            target = (current & gets[parent]) or gets[parent]
        had[path], gets[path] = current, target
    del gets[OWN]
    return gets


def plan_writes(
    old: CPUSet, new: CPUSet, children: Mapping[PurePosixPath, CPUSet]
) -> list[tuple[PurePosixPath, CPUSet]]:
    """The writes, in order, that bring ``children`` to their :func:`targets` and leave the
    container (``OWN``) ready for its own write of ``new``; each keeps every child inside its
    parent. A cgroup is widened (parents first) only as far as its children's targets need,
    then each child is narrowed (children first). Empty when there are no children."""
    if not children:
        return []
    wanted = targets(old, new, children)
    holds = {OWN: old, **children}
    top_down = sorted(holds, key=lambda p: len(p.parts))
    room = {path: CPUSet() for path in holds}
    for path in wanted:
        room[path.parent] |= wanted[path]
    writes: list[tuple[PurePosixPath, CPUSet]] = []
    for path in top_down:
        widened = holds[path] | room[path]
        if widened != holds[path]:
            writes.append((path, widened))
            holds[path] = widened
    for path in reversed(top_down):
        if path != OWN and holds[path] != wanted[path]:
            writes.append((path, wanted[path]))
    return writes


def has_children(directory: Path) -> bool:
    """Whether the cgroup has cgroups below it: kernfs counts a directory's subdirectories
    in its link count, as ordinary file systems do, so one stat tells."""
    try:
        return os.stat(directory).st_nlink > 2
    except OSError:
        return False


def child_cpusets(directory: Path) -> dict[PurePosixPath, CPUSet]:
    """Every cgroup below ``directory`` with its ``cpuset.cpus``, by path relative to it; {}
    when there is none (:func:`has_children`: one stat, before any listing)."""
    found: dict[PurePosixPath, CPUSet] = {}
    pending = [PurePosixPath()]
    while pending:
        relative = pending.pop()
        here = directory / relative
        if not has_children(here):
            continue
        try:
            entries = [e.name for e in os.scandir(here) if e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed meanwhile
        for name in entries:
            child = relative / name
            with contextlib.suppress(ValueError):
                cpus = cgroups.read_cpus(directory / child)
                if cpus is not None:
                    found[child] = cpus
                    pending.append(child)
    return found


def write_children(directory: Path, new: CPUSet) -> int:
    """Prepare a v1 container cgroup with child cpusets for its move to ``new``: widen it and
    its children, then narrow the children (:func:`plan_writes`); the caller then writes
    ``new`` into the container. Returns how many cgroups were written (0: it has no
    children). OSError when a write is refused; a child removed meanwhile is skipped."""
    children = child_cpusets(directory)
    if not children:
        return 0
    old = cgroups.read_cpus(directory)
    if old is None:
        return 0
    written = 0
    for path, cpus in plan_writes(old, new, children):
        try:
            cgroups.write_cpus(directory / path, cpus)
        except FileNotFoundError:
            if path == OWN:
                raise
            continue
        written += 1
    return written


__all__ = ["OWN", "child_cpusets", "has_children", "plan_writes", "targets", "write_children"]
