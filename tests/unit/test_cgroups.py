"""Where cpusets live: mount tables, both drivers' cgroupsPath forms, the files themselves."""

from __future__ import annotations

import errno
import os
from pathlib import Path, PurePosixPath

import pytest

from shim import cgroups
from shim.cgroups import (
    CgroupError,
    CgroupLayout,
    CgroupVersion,
    cgroup_parent_of,
    containerd_cgroups_path,
    expand_slice,
    first_process,
    populated,
    read_cpus,
    read_list,
    relative_cgroup_path,
    systemd_byte_reversed,
    write_list,
)
from shim.cpuset import CPUSet

# This machine's: cgroup v1 controllers under /sys/fs/cgroup plus an empty v2 mount.
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# A current systemd node: only the unified hierarchy.
UNIFIED = """\
25 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
35 25 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
# v1 with cpu and cpuset co-mounted, optional fields before the separator.
COMOUNTED = """\
36 25 0:31 / /sys/fs/cgroup/cpuset,cpu rw,nosuid shared:12 master:1 - cgroup cgroup rw,cpuset,cpu
"""


@pytest.mark.parametrize(
    ("mountinfo", "version", "root"),
    [
        pytest.param(HYBRID, CgroupVersion.V1, "/sys/fs/cgroup/cpuset", id="hybrid"),
        pytest.param(UNIFIED, CgroupVersion.V2, "/sys/fs/cgroup", id="unified"),
        pytest.param(COMOUNTED, CgroupVersion.V1, "/sys/fs/cgroup/cpuset,cpu", id="co-mounted"),
    ],
)
def test_the_cpuset_hierarchy_is_found_in_mountinfo(
    mountinfo: str, version: CgroupVersion, root: str
) -> None:
    layout = CgroupLayout.from_mountinfo(mountinfo)
    assert layout == CgroupLayout(version, Path(root))


def test_the_top_unified_mount_wins_when_v2_is_mounted_twice() -> None:
    text = UNIFIED + "50 35 0:30 /kubepods /var/lib/x/cg rw - cgroup2 cgroup2 rw\n"
    assert CgroupLayout.from_mountinfo(text).root == Path("/sys/fs/cgroup")


@pytest.mark.parametrize(
    "mount",
    [
        # A subtree bound at a shallower point (or a cgroup2 mount made inside a cgroup
        # namespace, propagated to the host), after the real mount or before it.
        "60 1 0:30 /kubepods.slice /cg rw shared:40 - cgroup2 cgroup2 rw,nsdelegate\n",
        "61 25 0:31 /kubepods /cs rw - cgroup cgroup rw,cpuset\n",
    ],
)
@pytest.mark.parametrize("before", [False, True])
def test_a_mount_of_a_subtree_is_not_taken_for_the_hierarchy(mount: str, before: bool) -> None:
    whole = UNIFIED if "cgroup2" in mount else COMOUNTED
    text = mount + whole if before else whole + mount
    expected = CgroupLayout.from_mountinfo(whole)
    assert CgroupLayout.from_mountinfo(text) == expected


def test_a_mount_of_a_subtree_is_taken_when_it_is_all_there_is() -> None:
    text = "60 1 0:30 /kubepods.slice /cg rw shared:40 - cgroup2 cgroup2 rw,nsdelegate\n"
    assert CgroupLayout.from_mountinfo(text) == CgroupLayout(CgroupVersion.V2, Path("/cg"))


def test_mount_points_with_escaped_spaces_are_unescaped() -> None:
    text = "34 31 0:31 / /mnt/my\\040cgroups rw - cgroup cgroup rw,cpuset\n"
    assert CgroupLayout.from_mountinfo(text).root == Path("/mnt/my cgroups")


def test_a_machine_without_cpusets_is_an_error() -> None:
    text = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    with pytest.raises(CgroupError, match="no cgroup v1 cpuset hierarchy"):
        CgroupLayout.from_mountinfo(text)


def test_this_machines_layout_is_detected() -> None:
    layout = CgroupLayout.detect()
    assert (layout.root / "cpuset.cpus").exists()


@pytest.mark.parametrize(
    ("cgroups_path", "expected"),
    [
        pytest.param(
            "/kubepods/burstable/pod1234/abcd",
            "kubepods/burstable/pod1234/abcd",
            id="cgroupfs",
        ),
        pytest.param("/kubepods/pod1234/abcd", "kubepods/pod1234/abcd", id="cgroupfs-guaranteed"),
        pytest.param(
            "kubepods-besteffort-pod12_34.slice:cri-containerd:abcd",
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12_34.slice/"
            "cri-containerd-abcd.scope",
            id="systemd",
        ),
        pytest.param(
            "kubepods-pod12.slice:cri-containerd:abcd",
            "kubepods.slice/kubepods-pod12.slice/cri-containerd-abcd.scope",
            id="systemd-guaranteed",
        ),
        pytest.param("system.slice:docker:abcd", "system.slice/docker-abcd.scope", id="docker"),
        pytest.param(":cri-containerd:abcd", "system.slice/cri-containerd-abcd.scope", id="none"),
        pytest.param("machine.slice::abcd", "machine.slice/-abcd.scope", id="no-prefix"),
        pytest.param("-.slice:x:y", "x-y.scope", id="root-slice"),
    ],
)
def test_both_drivers_cgroups_paths_resolve(cgroups_path: str, expected: str) -> None:
    assert relative_cgroup_path(cgroups_path) == PurePosixPath(expected)


@pytest.mark.parametrize(
    "cgroups_path",
    [
        "",
        "/",
        "/kubepods/../../etc",
        "/kubepods/./x",
        "kubepods.slice:cri-containerd:",
        "kubepods--x.slice:p:n",
        "not-a-slice:p:n",
        "/kube\0pods/x",
    ],
)
def test_paths_that_leave_the_hierarchy_or_make_no_sense_are_refused(cgroups_path: str) -> None:
    with pytest.raises(CgroupError):
        relative_cgroup_path(cgroups_path)


def test_a_layout_places_a_container_under_its_root() -> None:
    v2 = CgroupLayout(CgroupVersion.V2, Path("/sys/fs/cgroup"))
    assert v2.container_dir("kubepods-pod1.slice:cri-containerd:c1") == Path(
        "/sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice/cri-containerd-c1.scope"
    )


@pytest.mark.parametrize("bad", ["kubepods", "a/b.slice", "-a.slice", "a-.slice", ".slice"])
def test_bad_slice_names_are_refused(bad: str) -> None:
    with pytest.raises(CgroupError, match="not a systemd slice name"):
        expand_slice(bad)


def test_populated_reads_the_v2_events_file() -> None:
    assert populated("populated 1\nfrozen 0\n") is True
    assert populated("populated 0\nfrozen 0\n") is False
    assert populated("frozen 0\n") is None


@pytest.mark.parametrize(
    ("given", "applied"),
    [
        # Seen in a guest with Debian bookworm's runc 1.1.5 and the systemd driver.
        ("0-1,6-15", "0-9,14-15"),
        # The example of opencontainers/runc#3611.
        ("10-23", "0-7,10-15"),
        ("8", "0"),
        ("0,63", "7,56"),
        ("1,62", "6,57"),
    ],
)
def test_systemd_gets_the_mask_with_its_bytes_reversed_from_an_unfixed_runc(
    given: str, applied: str
) -> None:
    assert systemd_byte_reversed(CPUSet.parse(given)) == CPUSet.parse(applied)


def test_a_set_within_the_first_eight_cpus_comes_through_unchanged() -> None:
    for mask in range(256):
        assert systemd_byte_reversed(CPUSet.from_mask(mask)) == CPUSet.from_mask(mask)


def test_cpus_are_read_and_written_in_the_kernel_list_format(tmp_path: Path) -> None:
    (tmp_path / "cpuset.cpus").write_text("0-3\n")
    (tmp_path / "cpuset.mems").write_text("0\n")
    assert read_cpus(tmp_path) == CPUSet.parse("0-3")
    write_list(tmp_path, "cpuset.mems", CPUSet({1, 2, 3, 7}))
    assert (tmp_path / "cpuset.mems").read_text() == "1-3,7"
    assert read_list(tmp_path, "cpuset.mems") == CPUSet({1, 2, 3, 7})
    assert read_cpus(tmp_path / "gone") is None
    with pytest.raises(FileNotFoundError):
        write_list(tmp_path / "gone", "cpuset.cpus", CPUSet({1}))
    (tmp_path / "cpuset.cpus").write_text("zero\n")
    with pytest.raises(ValueError, match="zero"):
        read_cpus(tmp_path)


def failing_reads(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Every read of a cgroup file fails with ``code`` once it is open."""

    def read_file(path: str | Path) -> bytes:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(cgroups, "read_file", read_file)


def test_a_cgroup_removed_between_open_and_read_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernfs answers a read of a file whose cgroup was removed after the open with ENODEV."""
    (tmp_path / "cpuset.cpus").write_text("0-3\n")
    failing_reads(monkeypatch, errno.ENODEV)
    assert read_cpus(tmp_path) is None


def test_other_read_errors_are_the_callers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cpuset.cpus").write_text("0-3\n")
    failing_reads(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match="Input/output"):
        read_cpus(tmp_path)


@pytest.mark.parametrize(
    ("parent", "expected"),
    [
        # kubelet's cgroupfs driver: a path; containerd puts the container below it.
        ("/kubepods/burstable/pod-1", "/kubepods/burstable/pod-1/c1"),
        ("/kubepods/pod-2/", "/kubepods/pod-2/c1"),
        # kubelet's systemd driver: a slice name; containerd names a scope in it.
        ("kubepods-burstable-pod_1.slice", "kubepods-burstable-pod_1.slice:cri-containerd:c1"),
    ],
)
def test_containerds_cgroups_path_follows_the_driver(parent: str, expected: str) -> None:
    assert containerd_cgroups_path(parent, "c1") == expected
    # And it lands where the layout says such a path lands.
    relative_cgroup_path(expected)


def fake_proc(root: Path, processes: dict[int, tuple[str, int]]) -> Path:
    """A /proc with ``stat`` and ``comm`` per process: pid -> (comm, parent pid)."""
    for pid, (comm, parent) in processes.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1\n")
        (root / str(pid) / "comm").write_text(f"{comm[:15]}\n")
    return root


def cgroup_with(tmp_path: Path, pids: list[int]) -> Path:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
    return cgroup


SHIM = {1: ("systemd", 0), 200: ("containerd-shim-runc-v2", 1)}


def test_the_first_process_is_the_shims_child(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path / "proc",
        {
            **SHIM,
            300: ("sh -c (x) y", 200),  # comm with spaces and parentheses
            301: ("worker", 300),
            302: ("worker", 301),
        },
    )
    assert first_process(cgroup_with(tmp_path, [301, 300, 302]), proc=proc) == 300


def test_a_lone_process_that_is_not_the_shims_child_is_not_taken(tmp_path: Path) -> None:
    # The container's process moved to a child cgroup, leaving a child of its own; or
    # another runtime's layout.
    proc = fake_proc(tmp_path / "proc", {**SHIM, 300: ("app", 250), 250: ("init", 1)})
    assert first_process(cgroup_with(tmp_path, [300]), proc=proc) == 0


def test_two_children_of_the_shim_are_not_guessed_between(tmp_path: Path) -> None:
    # The container's process and an exec beside it.
    proc = fake_proc(tmp_path / "proc", {**SHIM, 300: ("app", 200), 400: ("sh", 200)})
    assert first_process(cgroup_with(tmp_path, [300, 400]), proc=proc) == 0


def test_a_process_gone_meanwhile_is_left_out(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", {**SHIM, 300: ("app", 200)})  # 999 has exited
    assert first_process(cgroup_with(tmp_path, [999, 300]), proc=proc) == 300


def test_other_shims_can_be_named(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", {1: ("init", 0), 500: ("conmon", 1), 600: ("app", 500)})
    cgroup = cgroup_with(tmp_path, [600])
    assert first_process(cgroup, proc=proc) == 0
    assert first_process(cgroup, ("conmon",), proc=proc) == 600


def test_no_first_process_without_the_cgroup_or_in_an_empty_one(tmp_path: Path) -> None:
    assert first_process(tmp_path / "gone") == 0
    assert first_process(cgroup_with(tmp_path, [])) == 0


@pytest.mark.parametrize(
    ("cgroups_path", "parent"),
    [
        ("/kubepods/burstable/pod-1/c1", "/kubepods/burstable/pod-1"),
        ("kubepods-burstable-pod_1.slice:cri-containerd:c1", "kubepods-burstable-pod_1.slice"),
        # kubelet's full systemd path, as the sandbox's parent names it.
        (
            "/kubepods.slice/kubepods-pod_2.slice/cri-containerd-c1.scope",
            "/kubepods.slice/kubepods-pod_2.slice",
        ),
        ("c1", ""),
        ("/c1", ""),
        ("", ""),
    ],
)
def test_the_cgroup_parent_of_a_containers_cgroups_path(cgroups_path: str, parent: str) -> None:
    assert cgroup_parent_of(cgroups_path) == parent


def test_the_cgroup_parent_of_containerds_path_is_the_parent_it_was_made_under() -> None:
    for parent in ("/kubepods/burstable/pod-1", "kubepods-burstable-pod_1.slice"):
        assert cgroup_parent_of(containerd_cgroups_path(parent, "c1")) == parent
