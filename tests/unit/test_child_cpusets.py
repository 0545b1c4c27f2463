"""Moving a v1 cpuset with child cpusets: the plan against the kernel's rules, and the files."""

from __future__ import annotations

import errno
import os
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim import cgroups, fileio
from shim.child_cpusets import (
    OWN,
    Child,
    Memory,
    child_values,
    has_children,
    move_with_children,
    plan_writes,
    targets,
)
from shim.cpuset import CPUSet

P = PurePosixPath
CPUS = "cpuset.cpus"
Tree = dict[PurePosixPath, CPUSet]


def cpus(text: str) -> CPUSet:
    return CPUSet.parse(text)


def tree(**values: str) -> Tree:
    """Children by path, ``a__b`` for ``a/b``."""
    return {P(name.replace("__", "/")): cpus(value) for name, value in values.items()}


def apply_as_v1(
    old: CPUSet, new: CPUSet, found: Tree, writes: list[tuple[PurePosixPath, CPUSet]]
) -> Tree:
    """The tree after ``writes`` and the container's own write of ``new``, each write checked
    as cgroup v1 checks it: inside the parent, around every child, never emptied."""
    holds = dict(found)
    holds[OWN] = old
    for path, value in [*writes, (OWN, new)]:
        assert value, f"{path} emptied"
        if path != OWN:
            assert value.issubset(holds[path.parent]), f"{path}: {value} outside its parent"
        for other, held in holds.items():
            if other != OWN and other.parent == path:
                assert held.issubset(value), f"{path}: {value} leaves out child {other} ({held})"
        holds[path] = value
    return holds


def move(old: str, new: str, found: Tree, memory: Memory | None = None) -> tuple[Tree, Memory]:
    """One move planned and carried out under v1's rules: the children after it, and the
    memory it leaves."""
    writes, remembered = plan_writes(cpus(old), cpus(new), found, memory or {})
    after = apply_as_v1(cpus(old), cpus(new), found, writes)
    del after[OWN]
    return after, remembered


universe = st.sets(st.integers(0, 7), min_size=1).map(CPUSet)


@st.composite
def trees(draw: st.DrawFn) -> tuple[CPUSet, Tree]:
    """A container's cpuset and child cpusets valid under v1 below it."""
    old = draw(universe)
    found: Tree = {}
    parents = [(P("."), old)]
    for index in range(draw(st.integers(0, 6))):
        parent, held = draw(st.sampled_from(parents))
        kind = draw(st.sampled_from(["follows", "own", "empty"]))
        if kind == "follows":
            value = held
        elif kind == "own":
            value = CPUSet(draw(st.sets(st.sampled_from(sorted(held)), min_size=1)))
        else:
            value = CPUSet()
        path = parent / f"c{index}"
        found[path] = value
        if value:
            parents.append((path, value))
    return old, found


@given(trees(), st.lists(universe, min_size=1, max_size=4))
def test_moves_keep_the_kernels_rules_and_end_at_the_targets(
    start: tuple[CPUSet, Tree], sets: list[CPUSet]
) -> None:
    old, found = start
    memory: Memory = {}
    for new in sets:
        writes, remembered = plan_writes(old, new, found, memory)
        after = apply_as_v1(old, new, found, writes)
        assert after == {OWN: new, **{p: c.written for p, c in remembered.items()}}
        for path, child in remembered.items():
            assert child.written.issubset(new)
            assert bool(child.written) == bool(found[path])
        old, found, memory = new, {p: c.written for p, c in remembered.items()}, remembered


@given(trees(), universe)
def test_a_move_and_its_way_back_restore_every_child(
    start: tuple[CPUSet, Tree], new: CPUSet
) -> None:
    """What v2 shows: a child's own set comes back with its parent's CPUs."""
    old, found = start
    there, memory = move(str(old), str(new), found)
    back, _ = move(str(new), str(old), there, memory)
    assert back == found


@given(trees(), universe)
def test_a_plan_writes_each_cgroup_at_most_twice_a_leaf_once_and_nothing_without_children(
    start: tuple[CPUSet, Tree], new: CPUSet
) -> None:
    old, found = start
    writes, _ = plan_writes(old, new, found, {})
    written = [path for path, _ in writes]
    assert all(written.count(path) <= 2 for path in written)
    assert written.count(OWN) <= 1
    for path in found:
        if not any(other.parent == path for other in found):
            assert written.count(path) <= 1, f"leaf {path} widened"
    if not found:
        assert writes == []


@pytest.mark.parametrize(
    ("old", "new", "found", "expected"),
    [
        pytest.param("0-3", "0-1", tree(a="0-3", a__b="0-3"), tree(a="0-1", a__b="0-1")),
        pytest.param("0-3", "0-1", tree(a="1-2"), tree(a="1"), id="its own: what is left"),
        pytest.param("0-3", "0-1", tree(a="2-3"), tree(a="0-1"), id="none left: all of new"),
        pytest.param("0-1", "0-3", tree(a="0-1"), tree(a="0-3"), id="a follower grows"),
        pytest.param("0-1", "0-3", tree(a="1"), tree(a="1"), id="its own stays"),
        pytest.param("0-3", "0-1", tree(a=""), tree(a=""), id="never configured"),
        pytest.param("0-3", "0-1", tree(a="0-2", a__b="0-2"), tree(a="0-1", a__b="0-1")),
    ],
)
def test_targets(old: str, new: str, found: Tree, expected: Tree) -> None:
    got = targets(cpus(old), cpus(new), found, {})
    assert {path: child.written for path, child in got.items()} == expected


def test_a_pinned_child_gets_its_cpus_back_when_the_container_grows_again() -> None:
    shrunk, memory = move("0-3", "0", tree(a="0-3", a__job="1"))
    assert shrunk == tree(a="0", a__job="0")
    assert memory[P("a/job")] == Child(cpus("1"), cpus("0"))
    grown, _ = move("0", "0-3", shrunk, memory)
    assert grown == tree(a="0-3", a__job="1")


def test_a_child_its_owner_changed_since_is_taken_as_it_is_now() -> None:
    shrunk, memory = move("0-3", "0-1", tree(a="0-3"))
    assert (shrunk, memory[P("a")]) == (tree(a="0-1"), Child(None, cpus("0-1")))
    grown, _ = move("0-1", "0-3", tree(a="1"), memory)  # its owner pinned it meanwhile
    assert grown == tree(a="1")


def test_a_shrink_narrows_the_children_bottom_up_and_leaves_the_container_to_the_caller() -> None:
    writes, _ = plan_writes(cpus("0-3"), cpus("0"), tree(a="0-3", a__b="0-3"), {})
    assert writes == [(P("a/b"), cpus("0")), (P("a"), cpus("0"))]


def test_a_move_to_other_cpus_widens_the_container_first() -> None:
    writes, _ = plan_writes(cpus("0-1"), cpus("2-3"), tree(a="0-1"), {})
    assert writes == [(OWN, cpus("0-3")), (P("a"), cpus("2-3"))]


# --- the files ---------------------------------------------------------------------------------


def cgroup(path: Path, value: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / CPUS).write_text(value + "\n")
    (path / "tasks").write_text("")
    return path


def held(directory: Path) -> str:
    return (directory / CPUS).read_text().strip()


def test_child_values_finds_every_cgroup_below_and_nothing_else(tmp_path: Path) -> None:
    container = cgroup(tmp_path / "c", "0-3")
    assert not has_children(container)
    assert child_values(container, CPUS) == {}
    cgroup(container / "inner", "0-3")
    cgroup(container / "inner" / "job", "2")
    (container / "inner" / "not-a-cgroup").mkdir()  # no cpuset.cpus
    assert has_children(container)
    assert child_values(container, CPUS) == tree(inner="0-3", inner__job="2")


def test_a_file_that_holds_no_list_is_an_os_error(tmp_path: Path) -> None:
    container = cgroup(tmp_path / "c", "0-3")
    cgroup(container / "inner", "zero")
    with pytest.raises(OSError, match="holds no list"):
        move_with_children(container, CPUS, cpus("0"), {})


def test_a_move_writes_the_children_then_the_container(tmp_path: Path) -> None:
    container = cgroup(tmp_path / "c", "0-3")
    assert move_with_children(container, CPUS, cpus("0-2"), {}) == (0, {})  # alone
    assert held(container) == "0-2"
    cgroup(container / "inner", "0-2")
    cgroup(container / "inner" / "job", "2")
    count, memory = move_with_children(container, CPUS, cpus("0-1"), {})
    assert count == 2
    assert (held(container / "inner"), held(container / "inner" / "job")) == ("0-1", "0-1")
    assert held(container) == "0-1"
    assert memory[P("inner/job")] == Child(cpus("2"), cpus("0-1"))


def writes_failing_in(monkeypatch: pytest.MonkeyPatch, failing: Path, code: int) -> list[str]:
    """Every cgroup write from now on fails with ``code`` in ``failing``; returns the list
    each attempted write is logged in (``<directory name>=<list>``)."""
    write = cgroups.write_list
    tried: list[str] = []

    def written(directory: Path, name: str, values: CPUSet) -> None:
        tried.append(f"{directory.name}={values}")
        if directory == failing:
            raise OSError(code, os.strerror(code))
        write(directory, name, values)

    monkeypatch.setattr(cgroups, "write_list", written)
    return tried


def test_a_move_skips_a_child_removed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = cgroup(tmp_path / "c", "0-3")
    gone = cgroup(container / "gone", "0-3")
    cgroup(container / "stays", "0-3")
    writes_failing_in(monkeypatch, gone, errno.ENODEV)
    assert move_with_children(container, CPUS, cpus("0"), {})[0] == 1
    assert held(container / "stays") == "0"


def test_a_move_skips_a_child_removed_between_its_listing_and_its_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its file open, the child is removed: the read fails with ENODEV (kernfs)."""
    container = cgroup(tmp_path / "c", "0-3")
    gone = cgroup(container / "gone", "0-3")
    cgroup(container / "stays", "0-3")
    read = fileio.read_file

    def read_file(path: str | Path) -> bytes:
        if Path(path).parent == gone:
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), str(path))
        return read(path)

    monkeypatch.setattr(cgroups, "read_file", read_file)
    assert child_values(container, CPUS) == {P("stays"): cpus("0-3")}
    assert move_with_children(container, CPUS, cpus("0"), {})[0] == 1
    assert (held(container), held(container / "stays")) == ("0", "0")


def test_a_refused_write_undoes_the_ones_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = cgroup(tmp_path / "c", "0-1")
    refused = cgroup(container / "a", "0-1")
    cgroup(container / "b", "1")
    tried = writes_failing_in(monkeypatch, refused, errno.EBUSY)
    with pytest.raises(OSError, match="busy"):
        move_with_children(container, CPUS, cpus("2-3"), {})
    # The container widened, "b" moved, "a" refused: "b", then the container, put back.
    assert tried == ["c=0-3", "b=2-3", "a=2-3", "b=1", "c=0-1"]
    assert (held(container), held(container / "a"), held(container / "b")) == ("0-1", "0-1", "1")


def test_a_refused_write_of_the_container_undoes_its_childrens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child made between the look and the container's write holds more than the new set:
    the kernel refuses the container's write."""
    container = cgroup(tmp_path / "c", "0-1")
    cgroup(container / "a", "0-1")
    tried = writes_failing_in(monkeypatch, container, errno.EBUSY)
    with pytest.raises(OSError, match="busy"):
        move_with_children(container, CPUS, cpus("0"), {})
    assert tried == ["a=0", "c=0", "a=0-1"]
    assert (held(container), held(container / "a")) == ("0-1", "0-1")
