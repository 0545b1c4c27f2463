"""Moving a v1 cpuset with child cpusets: the plan against the kernel's rules, and the files."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.child_cpusets import OWN, child_cpusets, plan_writes, targets, write_children
from shim.cpuset import CPUSet

P = PurePosixPath


def cpus(text: str) -> CPUSet:
    return CPUSet.parse(text)


def apply_as_v1(
    old: CPUSet,
    new: CPUSet,
    children: dict[PurePosixPath, CPUSet],
    writes: list[tuple[PurePosixPath, CPUSet]],
) -> dict[PurePosixPath, CPUSet]:
    """The tree after ``writes`` and the container's own write of ``new``, each write checked
    as cgroup v1 checks it: inside the parent, around every child, never emptied."""
    holds = dict(children)
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


@st.composite
def trees(draw: st.DrawFn) -> tuple[CPUSet, CPUSet, dict[PurePosixPath, CPUSet]]:
    """A container's cpuset, the one it moves to, and child cpusets valid under v1."""
    universe = range(8)
    old = CPUSet(draw(st.sets(st.sampled_from(universe), min_size=1)))
    new = CPUSet(draw(st.sets(st.sampled_from(universe), min_size=1)))
    children: dict[PurePosixPath, CPUSet] = {}
    parents = [(P("."), old)]
    for index in range(draw(st.integers(0, 6))):
        parent, held = draw(st.sampled_from(parents))
        kind = draw(st.sampled_from(["follows", "fewer", "empty"]))
        if kind == "follows":
            value = held
        elif kind == "fewer":
            value = CPUSet(draw(st.sets(st.sampled_from(sorted(held)), min_size=1)))
        else:
            value = CPUSet()
        path = parent / f"c{index}"
        children[path] = value
        if value:
            parents.append((path, value))
    return old, new, children


@given(trees())
def test_every_write_keeps_the_kernels_rules_and_ends_at_the_targets(
    tree: tuple[CPUSet, CPUSet, dict[PurePosixPath, CPUSet]],
) -> None:
    old, new, children = tree
    writes = plan_writes(old, new, children)
    final = apply_as_v1(old, new, children, writes)
    assert final == {OWN: new, **targets(old, new, children)}
    for path, value in targets(old, new, children).items():
        assert value.issubset(new)
        assert bool(value) == bool(children[path])


@given(trees())
def test_a_plan_writes_each_cgroup_at_most_twice_a_leaf_once_and_nothing_without_children(
    tree: tuple[CPUSet, CPUSet, dict[PurePosixPath, CPUSet]],
) -> None:
    old, new, children = tree
    writes = plan_writes(old, new, children)
    written = [path for path, _ in writes]
    assert all(written.count(path) <= 2 for path in written)
    assert written.count(OWN) <= 1
    for path in children:
        if not any(other.parent == path for other in children):
            assert written.count(path) <= 1, f"leaf {path} widened"
    if not children:
        assert writes == []


@pytest.mark.parametrize(
    ("old", "new", "children", "expected"),
    [
        pytest.param(
            "0-3", "0-1", {"a": "0-3", "a/b": "0-3"}, {"a": "0-1", "a/b": "0-1"}, id="followers"
        ),
        pytest.param("0-3", "0-1", {"a": "1-2"}, {"a": "1"}, id="fewer keep what is left"),
        pytest.param("0-3", "0-1", {"a": "2-3"}, {"a": "0-1"}, id="none left: all of new"),
        pytest.param("0-1", "0-3", {"a": "0-1"}, {"a": "0-3"}, id="a follower grows"),
        pytest.param("0-1", "0-3", {"a": "1"}, {"a": "1"}, id="a pinned child stays"),
        pytest.param("0-3", "0-1", {"a": ""}, {"a": ""}, id="never configured"),
        pytest.param("0-3", "0-1", {"a": "0-2", "a/b": "0-2"}, {"a": "0-1", "a/b": "0-1"}),
    ],
)
def test_targets(old: str, new: str, children: dict[str, str], expected: dict[str, str]) -> None:
    tree = {P(k): cpus(v) for k, v in children.items()}
    assert targets(cpus(old), cpus(new), tree) == {P(k): cpus(v) for k, v in expected.items()}


def test_a_shrink_narrows_the_children_bottom_up_and_leaves_the_container_to_the_caller() -> None:
    tree = {P("a"): cpus("0-3"), P("a/b"): cpus("0-3")}
    assert plan_writes(cpus("0-3"), cpus("0"), tree) == [(P("a/b"), cpus("0")), (P("a"), cpus("0"))]


def test_a_move_to_other_cpus_widens_the_container_first() -> None:
    tree = {P("a"): cpus("0-1")}
    assert plan_writes(cpus("0-1"), cpus("2-3"), tree) == [
        (OWN, cpus("0-3")),
        (P("a"), cpus("2-3")),
    ]


# --- the files ---------------------------------------------------------------------------------


def cgroup(path: Path, value: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cpuset.cpus").write_text(value + "\n")
    (path / "tasks").write_text("")
    return path


def test_child_cpusets_finds_every_cgroup_below_and_nothing_else(tmp_path: Path) -> None:
    container = cgroup(tmp_path / "c", "0-3")
    assert child_cpusets(container) == {}
    cgroup(container / "inner", "0-3")
    cgroup(container / "inner" / "job", "2")
    (container / "inner" / "not-a-cgroup").mkdir()  # no cpuset.cpus
    assert child_cpusets(container) == {P("inner"): cpus("0-3"), P("inner/job"): cpus("2")}


def test_write_children_moves_them_and_leaves_the_container_at_old_or_wider(tmp_path: Path) -> None:
    container = cgroup(tmp_path / "c", "0-3")
    assert write_children(container, cpus("0-1")) == 0  # none: nothing written
    cgroup(container / "inner", "0-3")
    cgroup(container / "inner" / "job", "3")
    assert write_children(container, cpus("0-1")) == 2
    assert (container / "inner" / "cpuset.cpus").read_text() == "0-1"
    assert (container / "inner" / "job" / "cpuset.cpus").read_text() == "0-1"
    assert (container / "cpuset.cpus").read_text() == "0-3\n"  # the caller's to write


def test_write_children_skips_a_child_removed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = cgroup(tmp_path / "c", "0-3")
    cgroup(container / "gone", "0-3")
    cgroup(container / "stays", "0-3")
    found = child_cpusets(container)

    def found_then_removed(directory: Path) -> dict[PurePosixPath, CPUSet]:
        (container / "gone" / "cpuset.cpus").unlink()
        (container / "gone" / "tasks").unlink()
        (container / "gone").rmdir()
        return found

    monkeypatch.setattr("shim.child_cpusets.child_cpusets", found_then_removed)
    assert write_children(container, cpus("0")) == 1
    assert (container / "stays" / "cpuset.cpus").read_text() == "0"
