"""Topology: queries on plain data, and discovery from generated and real sysfs trees."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.cpuset import CPUSet
from shim.topology import CPUInfo, SysfsWarnings, Topology, TopologyError, memory_nodes
from tests.harness.sysfs import (
    AMD_EPYC_LIKE,
    OFFLINE_NONCONTIGUOUS,
    PROPERTY_SETTINGS,
    SINGLE_SOCKET_NO_HT,
    TWO_SOCKET_FOUR_NUMA,
    XEON_E5_2680_V3_X2,
    MachineSpec,
    expected_topology,
    write_sysfs,
)

FIXTURES = [
    XEON_E5_2680_V3_X2,
    SINGLE_SOCKET_NO_HT,
    TWO_SOCKET_FOUR_NUMA,
    AMD_EPYC_LIKE,
    OFFLINE_NONCONTIGUOUS,
]


def discover(spec: MachineSpec, root: Path) -> Topology:
    return Topology.from_sysfs(write_sysfs(spec, root))


@pytest.mark.parametrize("spec", FIXTURES, ids=lambda spec: spec.name)
def test_discovery_matches_the_description(spec: MachineSpec, tmp_path: Path) -> None:
    assert discover(spec, tmp_path) == expected_topology(spec)


def test_xeon(tmp_path: Path) -> None:
    topo = discover(XEON_E5_2680_V3_X2, tmp_path)
    assert topo.online == CPUSet.parse("0-47")
    assert topo.sockets == (0, 1)
    assert topo.numa_nodes == (0, 1)
    assert topo.num_cores == 24
    assert topo.cpus_per_core == 2
    assert topo.cpus_in_socket(0) == CPUSet.parse("0-11,24-35")
    assert topo.cpus_in_numa_node(1) == CPUSet.parse("12-23,36-47")
    assert topo.siblings(0) == CPUSet([0, 24])
    assert topo.siblings(47) == CPUSet([23, 47])
    # Core ids repeat in each socket (and skip 6-7 as the real part does).
    assert topo.info(6).core_id == 8
    assert topo.info(18).core_id == 8
    assert topo.core_of(6) == (0, 0, 8)
    assert topo.core_of(18) == (1, 0, 8)
    assert topo.cpus_in_core((0, 0, 8)) == CPUSet([6, 30])
    assert topo.cores[:3] == ((0, 0, 0), (0, 0, 1), (0, 0, 2))
    assert topo.cpus_in_uncore_cache(1) == topo.cpus_in_socket(1)
    assert topo.numa_nodes_in_socket(1) == (1,)
    assert topo.sockets_in_numa_node(0) == (0,)
    assert topo.sockets_of(CPUSet([0, 13])) == {0, 1}
    assert topo.numa_nodes_of(CPUSet([13])) == {1}
    assert topo.whole_cores_in(CPUSet([0, 24, 1])) == CPUSet([0, 24])


def test_amd_like_l3_groups_and_consecutive_siblings(tmp_path: Path) -> None:
    topo = discover(AMD_EPYC_LIKE, tmp_path)
    assert len(topo.online) == 128
    assert topo.cpus_per_core == 2
    assert topo.siblings(6) == CPUSet([6, 7])
    assert topo.uncore_caches == tuple(range(16))
    assert topo.cpus_in_uncore_cache(0) == CPUSet.parse("0-7")
    assert topo.cpus_in_uncore_cache(9) == CPUSet.parse("72-79")
    assert topo.info(72).socket == 1


def test_four_numa_nodes_on_two_sockets(tmp_path: Path) -> None:
    topo = discover(TWO_SOCKET_FOUR_NUMA, tmp_path)
    assert topo.num_sockets == 2
    assert topo.num_numa_nodes == 4
    assert topo.cpus_in_numa_node(1) == CPUSet.parse("5-9,25-29")
    assert topo.numa_nodes_in_socket(1) == (2, 3)


def test_offline_cpus_and_gaps(tmp_path: Path) -> None:
    topo = discover(OFFLINE_NONCONTIGUOUS, tmp_path)
    assert topo.online == CPUSet.parse("0-4,6-7,16-22")
    assert 5 not in topo.online
    assert 23 not in topo.online
    # CPU 21's sibling 5 is offline: its core has one usable thread.
    assert topo.siblings(21) == CPUSet([21])
    assert topo.cpus_per_core == 2
    assert topo.isolated == CPUSet([7, 22])
    # The offline CPU stays out of its L3 group even though sysfs lists it there.
    assert 5 not in topo.cpus_in_uncore_cache(topo.info(4).uncore_cache)


def test_optional_files_missing(tmp_path: Path) -> None:
    spec = MachineSpec(
        sockets=2,
        cores_per_die=2,
        threads_per_core=2,
        write_numa=False,
        write_cache=False,
        write_die_id=False,
        write_isolated=False,
    )
    topo = discover(spec, tmp_path)
    assert topo == expected_topology(spec)
    assert topo.numa_nodes == (0,)
    assert topo.isolated == CPUSet()
    assert [info.uncore_cache for info in topo.cpus] == [info.socket for info in topo.cpus]
    assert {info.die for info in topo.cpus} == {0}


def test_the_highest_complete_cache_entry_wins_stray_node_files_do_not_count(
    tmp_path: Path,
) -> None:
    spec = MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2, l3_per_die=2)
    root = write_sysfs(spec, tmp_path)
    cache = root / "devices/system/cpu/cpu0/cache"
    # A level without a CPU list, and a CPU list without a level: neither says anything.
    (cache / "index4").mkdir()
    (cache / "index4" / "level").write_text("4\n")
    (cache / "index5").mkdir()
    (cache / "index5" / "shared_cpu_list").write_text("0-15\n")
    # A lower level listed after the last-level cache does not replace it.
    (cache / "index6").mkdir()
    (cache / "index6" / "level").write_text("2\n")
    (cache / "index6" / "shared_cpu_list").write_text("0\n")
    (root / "devices/system/node/node7").write_text("not a node directory\n")
    assert Topology.from_sysfs(root) == expected_topology(spec)


def _write_cache(root: Path, cpu: int, index: int, level: int, shared: str) -> None:
    cache = root / f"devices/system/cpu/cpu{cpu}/cache/index{index}"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "level").write_text(f"{level}\n")
    (cache / "shared_cpu_list").write_text(f"{shared}\n")


def test_arm64_l2_clusters_without_l3_group_by_socket_for_the_uncore_option(
    tmp_path: Path,
) -> None:
    # Two clusters of four cores, each sharing an L2, no L3: cadvisor reports no uncore
    # cache (level 2 is never one), so kubelet aligns by socket. The L2 is still the last
    # level the status pages show.
    _arm64_board(tmp_path, [(cpu // 4, cpu % 4, str(cpu)) for cpu in range(8)])
    for cpu in range(8):
        _write_cache(tmp_path, cpu, 0, 1, str(cpu))
        _write_cache(tmp_path, cpu, 1, 2, "0-3" if cpu < 4 else "4-7")
    topology = Topology.from_sysfs(tmp_path)
    assert topology.uncore_caches == (0,)
    assert topology.cpus_in_uncore_cache(0) == topology.cpus_in_socket(0) == CPUSet.parse("0-7")
    assert [info.last_level_cache for info in topology.cpus] == [0] * 4 + [1] * 4


def test_an_l3_that_is_exactly_its_numa_node_groups_by_socket(tmp_path: Path) -> None:
    # Cluster-on-die: each socket's L3 is split in two halves, one per NUMA node. cadvisor
    # files such an L3 as the node's cache, not an uncore one, so kubelet aligns by socket.
    spec = MachineSpec(
        sockets=2, cores_per_die=8, threads_per_core=2, numa_per_socket=2, l3_per_die=2
    )
    topology = discover(spec, tmp_path)
    assert topology.uncore_caches == (0, 1)
    for socket in (0, 1):
        assert topology.cpus_in_uncore_cache(socket) == topology.cpus_in_socket(socket)
    assert topology == expected_topology(spec)
    halves = {info.last_level_cache for info in topology.cpus}
    assert halves == {0, 1, 2, 3}
    assert all(
        CPUSet(c.cpu for c in topology.cpus if c.last_level_cache == half)
        == topology.cpus_in_numa_node(half)
        for half in halves
    )


def test_without_an_l3_the_uncore_groups_are_the_sockets(tmp_path: Path) -> None:
    spec = MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2)
    root = write_sysfs(spec, tmp_path)
    for l3 in root.glob("devices/system/cpu/cpu*/cache/index3"):
        for child in l3.iterdir():
            child.unlink()
        l3.rmdir()
    topology = Topology.from_sysfs(root)
    assert topology.uncore_caches == (0, 1)
    for socket in (0, 1):
        assert topology.cpus_in_uncore_cache(socket) == topology.cpus_in_socket(socket)
    # The L2, one per core, is the last level now.
    assert len({info.last_level_cache for info in topology.cpus}) == topology.num_cores


@pytest.mark.parametrize("spec", [XEON_E5_2680_V3_X2, AMD_EPYC_LIKE], ids=lambda s: s.name)
def test_an_l3_per_socket_or_per_ccx_is_both_the_uncore_and_the_last_level_group(
    spec: MachineSpec, tmp_path: Path
) -> None:
    topology = discover(spec, tmp_path)
    assert [info.uncore_cache for info in topology.cpus] == [
        info.last_level_cache for info in topology.cpus
    ]


def test_the_first_cache_of_level_3_or_more_not_the_node_s_own_is_the_uncore_one(
    tmp_path: Path,
) -> None:
    # One socket, two NUMA nodes of four cores, an L3 per two cores and an L4 for the whole
    # socket: the L3 comes first and is not a node's own, so it groups (not the L4).
    spec = MachineSpec(cores_per_die=8, numa_per_socket=2, l3_per_die=4)
    root = write_sysfs(spec, tmp_path / "l3")
    for cpu in spec.online():
        _write_cache(root, cpu, 4, 4, "0-7")
    topology = Topology.from_sysfs(root)
    assert [topology.cpus_in_uncore_cache(u) for u in topology.uncore_caches] == [
        CPUSet.parse(cpus) for cpus in ("0-1", "2-3", "4-5", "6-7")
    ]
    # Two sockets of two nodes, an L3 per node (each node's own, passed over) and an L4 for
    # the whole machine: the L4 groups all eight CPUs, where the sockets would make two.
    spec = MachineSpec(sockets=2, cores_per_die=4, numa_per_socket=2, l3_per_die=2)
    root = write_sysfs(spec, tmp_path / "l4")
    for cpu in spec.online():
        _write_cache(root, cpu, 4, 4, "0-7")
    topology = Topology.from_sysfs(root)
    assert topology.uncore_caches == (0,)
    assert topology.cpus_in_uncore_cache(0) == CPUSet.parse("0-7")
    assert {info.last_level_cache for info in topology.cpus} == {0}


def _arm64_board(root: Path, cores: list[tuple[int, int, str]]) -> None:
    """One package; ``cores`` gives each CPU's cluster id, core id and the kernel's thread
    siblings (a device-tree arm64 board restarts the core ids in each cluster)."""
    cpu_dir = root / "devices" / "system" / "cpu"
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "online").write_text(f"0-{len(cores) - 1}\n")
    for cpu, (cluster, core_id, siblings) in enumerate(cores):
        topology = cpu_dir / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "cluster_id").write_text(f"{cluster}\n")
        (topology / "core_id").write_text(f"{core_id}\n")
        (topology / "thread_siblings_list").write_text(f"{siblings}\n")


def test_core_ids_that_restart_in_each_cluster_name_distinct_cores(tmp_path: Path) -> None:
    # Like an RK3588: four little cores in cluster 0, two pairs of big ones in 1 and 2.
    ids = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (2, 1)]
    _arm64_board(tmp_path, [(cluster, core, str(cpu)) for cpu, (cluster, core) in enumerate(ids)])
    topology = Topology.from_sysfs(tmp_path)
    assert topology.cpus_per_core == 1
    assert len(topology.core_masks) == 8
    assert topology.siblings(4) == CPUSet([4])


@pytest.mark.parametrize(
    "cores",
    [
        # AMD family 15h: the two cores of a compute unit are thread siblings to the kernel,
        # each with a core id of its own (kubelet reads the ids: four cores).
        [(0, 0, "0-1"), (0, 1, "0-1"), (0, 2, "2-3"), (0, 3, "2-3")],
        # Intel's E-cores, four to an L2 cluster: unique ids, one cluster per four.
        [(0, 0, "0"), (0, 1, "1"), (1, 2, "2"), (1, 3, "3")],
    ],
    ids=["compute-units", "l2-clusters"],
)
def test_core_ids_unique_in_their_package_are_kept(
    tmp_path: Path, cores: list[tuple[int, int, str]]
) -> None:
    _arm64_board(tmp_path, cores)
    topology = Topology.from_sysfs(tmp_path)
    assert [info.core_id for info in topology.cpus] == [0, 1, 2, 3]
    assert topology.cpus_per_core == 1


def test_cpu_in_online_list_without_topology_is_skipped(tmp_path: Path) -> None:
    root = write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path)
    cpu3 = root / "devices/system/cpu/cpu3/topology"
    for child in cpu3.iterdir():
        child.unlink()
    cpu3.rmdir()
    assert Topology.from_sysfs(root).online == CPUSet.parse("0-2,4-7")


def test_cpu_no_numa_node_lists_is_left_out_not_put_in_node_zero(tmp_path: Path) -> None:
    # A machine whose only node is 1 (node ids need not start at 0), and a CPU it does not
    # list: cadvisor builds kubelet's topology from the nodes' lists, so kubelet never sees
    # such a CPU; it is not given out here either (nor filed under a node 0 there is not).
    root = write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path)
    node_dir = root / "devices/system/node"
    (node_dir / "node0" / "cpulist").unlink()
    (node_dir / "node0").rmdir()
    (node_dir / "node1").mkdir()
    (node_dir / "node1" / "cpulist").write_text("0-5,7\n")
    topology = Topology.from_sysfs(root)
    assert topology.online == CPUSet.parse("0-5,7")
    assert topology.numa_nodes == (1,)


@pytest.mark.parametrize(
    "relative",
    [
        "devices/system/cpu/online",
        "devices/system/node/node0/cpulist",
    ],
)
def test_missing_mandatory_file_names_the_path(tmp_path: Path, relative: str) -> None:
    root = write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path)
    (root / relative).unlink()
    with pytest.raises(TopologyError, match=str(root / relative)):
        Topology.from_sysfs(root)


@pytest.mark.parametrize(
    ("relative", "content"),
    [
        ("devices/system/cpu/online", "0-x\n"),
        ("devices/system/cpu/isolated", "3-1\n"),
        ("devices/system/cpu/cpu1/topology/core_id", "one\n"),
        ("devices/system/cpu/cpu1/topology/physical_package_id", "\n"),
    ],
)
def test_malformed_file_names_the_path(tmp_path: Path, relative: str, content: str) -> None:
    root = write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path)
    (root / relative).write_text(content)
    with pytest.raises(TopologyError, match=str(root / relative)):
        Topology.from_sysfs(root)


@pytest.mark.parametrize("name", ["core_id", "physical_package_id"])
def test_a_cpu_without_a_core_or_package_id_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    # cadvisor skips such a CPU with a warning (kubelet never sees it) rather than failing.
    root = write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path)
    missing = root / "devices/system/cpu/cpu2/topology" / name
    missing.unlink()
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        topology = Topology.from_sysfs(root)
    assert topology.online == CPUSet.parse("0-1,3-7")
    fields = [getattr(record, "fields", None) for record in caplog.records]
    assert fields == [{"cpu": 2, "missing": str(missing)}]


def test_a_cpu_left_out_is_told_once_to_a_reader_that_reads_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once per CPU and missing file for a reader that keeps what it warned of (the CPU
    follower reads the topology again at every check); a read given none tells each time."""
    root = write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path)
    topology_dir = root / "devices/system/cpu"
    (topology_dir / "cpu2/topology/core_id").unlink()
    warned = SysfsWarnings()
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        for _ in range(2):
            assert Topology.from_sysfs(root, warned).online == CPUSet.parse("0-1,3-7")
        (topology_dir / "cpu5/topology/physical_package_id").unlink()
        for _ in range(2):
            assert Topology.from_sysfs(root, warned).online == CPUSet.parse("0-1,3-4,6-7")
    told = [getattr(record, "fields", None) for record in caplog.records]
    assert told == [
        {"cpu": 2, "missing": str(topology_dir / "cpu2/topology/core_id")},
        {"cpu": 5, "missing": str(topology_dir / "cpu5/topology/physical_package_id")},
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        Topology.from_sysfs(root)
        Topology.from_sysfs(root)
    assert len(caplog.records) == 4


@pytest.mark.parametrize("level", ["", "three", "L3"])
def test_a_cache_whose_level_is_not_a_number_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    # Two L3 groups of two cores in one NUMA node; CPU 1's L3 entry says nothing usable, so
    # CPU 1 has no uncore cache of its own and groups by socket, apart from CPU 0's L3.
    spec = MachineSpec(cores_per_die=4, l3_per_die=2)
    root = write_sysfs(spec, tmp_path)
    bad = root / "devices/system/cpu/cpu1/cache/index3/level"
    bad.write_text(f"{level}\n")
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        topology = Topology.from_sysfs(root)
    assert topology.online == spec.online()
    assert topology.cpus_in_uncore_cache(topology.info(0).uncore_cache) == CPUSet([0])
    assert topology.cpus_in_uncore_cache(topology.info(1).uncore_cache) == CPUSet([1])
    assert topology.cpus_in_uncore_cache(topology.info(2).uncore_cache) == CPUSet([2, 3])
    fields = [getattr(record, "fields", None) for record in caplog.records]
    assert fields == [{"path": str(bad), "level": level}]


def test_a_cache_passed_over_is_told_once_to_a_reader_that_reads_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once per level file for a reader that keeps what it warned of (the CPU follower reads
    the topology again at every check while the CPUs online differ from those planned
    with); a read given none tells each time."""
    spec = MachineSpec(cores_per_die=4, l3_per_die=2)
    root = write_sysfs(spec, tmp_path)
    cpu_dir = root / "devices/system/cpu"
    first, second = cpu_dir / "cpu1/cache/index3/level", cpu_dir / "cpu3/cache/index3/level"
    first.write_text("three\n")
    warned = SysfsWarnings()
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        for _ in range(2):
            assert Topology.from_sysfs(root, warned).online == spec.online()
        second.write_text("L3\n")
        for _ in range(2):
            assert Topology.from_sysfs(root, warned).online == spec.online()
    told = [getattr(record, "fields", None) for record in caplog.records]
    assert told == [
        {"path": str(first), "level": "three"},
        {"path": str(second), "level": "L3"},
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        Topology.from_sysfs(root)
        Topology.from_sysfs(root)
    assert len(caplog.records) == 4


# -- the memory nodes -------------------------------------------------------------------------


def test_memory_nodes_are_the_nodes_with_memory_not_those_of_the_cpus(tmp_path: Path) -> None:
    """A node with memory and no CPU (CXL memory), and one whose CPUs are all offline: both
    are memory nodes a container kubelet creates may use, though neither has an online CPU."""
    spec = MachineSpec(
        sockets=2, cores_per_die=2, offline=frozenset({2, 3}), memory_only_nodes=1, name="cxl"
    )
    topology = discover(spec, tmp_path)
    assert topology == expected_topology(spec)
    assert topology.numa_nodes == (0,)
    assert topology.memory_nodes == CPUSet([0, 1, 2])


def test_has_memory_is_the_kernels_word_over_the_nodes_online(tmp_path: Path) -> None:
    # Node 1 is online with CPUs and no memory (a memoryless node): cpuset.mems refuses it.
    root = write_sysfs(MachineSpec(sockets=2, cores_per_die=2, memory_only_nodes=1), tmp_path)
    (root / "devices/system/node/has_memory").write_text("0,2\n")
    topology = Topology.from_sysfs(root)
    assert topology.numa_nodes == (0, 1)
    assert topology.memory_nodes == CPUSet([0, 2])


def test_without_has_memory_the_nodes_online_are_the_memory_nodes(tmp_path: Path) -> None:
    spec = MachineSpec(sockets=2, cores_per_die=2, memory_only_nodes=1, write_has_memory=False)
    root = write_sysfs(spec, tmp_path)
    assert not (root / "devices/system/node/has_memory").exists()
    assert Topology.from_sysfs(root).memory_nodes == CPUSet([0, 1, 2])


def test_without_a_list_of_nodes_the_cpus_nodes_are_the_memory_nodes(tmp_path: Path) -> None:
    root = write_sysfs(MachineSpec(sockets=2, cores_per_die=2, memory_only_nodes=1), tmp_path)
    (root / "devices/system/node/has_memory").unlink()
    (root / "devices/system/node/online").unlink()
    topology = Topology.from_sysfs(root)
    assert topology.numa_nodes == (0, 1)
    assert topology.memory_nodes == CPUSet([0, 1])
    # And without NUMA support at all, node 0 (the kernel's only one).
    assert discover(MachineSpec(write_numa=False), tmp_path / "flat").memory_nodes == CPUSet([0])


@pytest.mark.parametrize(
    ("has_memory", "online", "found", "warned"),
    [
        pytest.param("0-x\n", "0-2\n", "0-2", ["has_memory"], id="has_memory malformed"),
        pytest.param("\n", "0-2\n", "0-2", ["has_memory"], id="has_memory empty"),
        pytest.param("2-0\n", "one\n", "0-1", ["has_memory", "online"], id="both malformed"),
        pytest.param("\n", "\n", "0-1", ["has_memory", "online"], id="both empty"),
    ],
)
def test_a_list_of_memory_nodes_that_does_not_read_is_passed_over_with_a_warning(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    has_memory: str,
    online: str,
    found: str,
    warned: list[str],
) -> None:
    """The CPUs are read all the same: every node is only what a shared container gets."""
    root = write_sysfs(MachineSpec(sockets=2, cores_per_die=2, memory_only_nodes=1), tmp_path)
    node_dir = root / "devices/system/node"
    (node_dir / "has_memory").write_text(has_memory)
    (node_dir / "online").write_text(online)
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        topology = Topology.from_sysfs(root)
    assert topology.online == CPUSet.parse("0-3")
    assert topology.memory_nodes == CPUSet.parse(found)
    paths = [getattr(record, "fields", {})["path"] for record in caplog.records]
    assert paths == [str(node_dir / name) for name in warned]


def test_a_list_of_memory_nodes_passed_over_again_is_told_once_until_it_reads_well(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader that reads again (the CPU follower, at every check) keeps what it warned
    of: the same failure is not told again, a list that read well in between or fails
    otherwise is."""
    root = write_sysfs(MachineSpec(sockets=2, cores_per_die=2, memory_only_nodes=1), tmp_path)
    has_memory = root / "devices/system/node/has_memory"
    warned = SysfsWarnings()
    steps = [
        ("\n", "0-2"),  # empty: told (the nodes online stand in)
        ("\n", "0-2"),  # the same: not told again
        ("0,2\n", "0,2"),  # reads well
        ("\n", "0-2"),  # empty again: told again
        ("0-x\n", "0-2"),  # another failure: told
        ("0-x\n", "0-2"),
    ]
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        for content, found in steps:
            has_memory.write_text(content)
            assert Topology.from_sysfs(root, warned).memory_nodes == CPUSet.parse(found)
            assert memory_nodes(root, warned) == CPUSet.parse(found)
    told = [(r.getMessage(), getattr(r, "fields", {})["path"]) for r in caplog.records]
    empty = ("ignoring an empty list of memory nodes", str(has_memory))
    unread = ("ignoring a list of memory nodes that cannot be read", str(has_memory))
    assert told == [empty, empty, unread]
    # A read given no memory of its own tells what it meets, each time.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shim.topology"):
        memory_nodes(root)
        memory_nodes(root)
    assert len(caplog.records) == 2


def test_plain_data_has_the_cpus_nodes_as_memory_nodes_unless_told() -> None:
    cpus = (CPUInfo(cpu=0, socket=0, core_id=0, numa_node=1),)
    assert Topology(cpus=cpus).memory_nodes == CPUSet([1])
    told = Topology(cpus=cpus, memory_nodes=CPUSet([0, 1, 3]))
    assert told.memory_nodes == CPUSet([0, 1, 3])
    assert told.numa_nodes == (1,)
    # Topologies differing in their memory nodes alone differ.
    assert told != Topology(cpus=cpus)
    assert Topology(cpus=cpus, memory_nodes=CPUSet([1])) == Topology(cpus=cpus)


def test_empty_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="online"):
        Topology.from_sysfs(tmp_path)


def test_this_machine() -> None:
    topo = Topology.from_sysfs(Path("/sys"))
    online = CPUSet.parse(Path("/sys/devices/system/cpu/online").read_text())
    assert topo.online == online
    assert CPUSet(os.sched_getaffinity(0)).issubset(topo.online)
    assert topo.num_sockets >= 1
    assert topo.num_cores >= 1
    assert sum(len(topo.cpus_in_core(core)) for core in topo.cores) == len(online)
    assert topo.cpus_per_core * topo.num_cores >= len(online)
    for cpu in topo.online:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if path.exists():
            assert topo.siblings(cpu) == CPUSet.parse(path.read_text()) & online


def test_plain_data_constructor_and_validation() -> None:
    topo = Topology(
        cpus=(
            CPUInfo(cpu=1, socket=0, core_id=0),
            CPUInfo(cpu=0, socket=0, core_id=0),
            CPUInfo(cpu=2, socket=0, core_id=1, uncore_cache=1),
        ),
        isolated=CPUSet([2, 9]),
    )
    assert [info.cpu for info in topo.cpus] == [0, 1, 2]
    assert topo.isolated == CPUSet([2])  # 9 is not online
    assert topo.cpus_per_core == 2
    assert topo.cores == ((0, 0, 0), (0, 0, 1))
    with pytest.raises(KeyError, match="not online"):
        topo.info(5)
    with pytest.raises(TopologyError, match="at least one online CPU"):
        Topology(cpus=())
    with pytest.raises(TopologyError, match="twice"):
        Topology(cpus=(CPUInfo(cpu=0, socket=0, core_id=0),) * 2)


def test_groups_come_ordered_by_id_and_unknown_ids_hold_nothing() -> None:
    # CPU 0 sits in socket 1; core (1, 0, 0) is CPUs 0 and 3, core (0, 0, 0) CPUs 1 and 2.
    topo = Topology(
        cpus=(
            CPUInfo(cpu=0, socket=1, core_id=0, numa_node=1, uncore_cache=1),
            CPUInfo(cpu=1, socket=0, core_id=0),
            CPUInfo(cpu=2, socket=0, core_id=0),
            CPUInfo(cpu=3, socket=1, core_id=0, numa_node=1, uncore_cache=1),
        )
    )
    assert topo.sockets == topo.numa_nodes == topo.uncore_caches == (0, 1)
    # Cores by their lowest CPU, as kubelet numbers them, not by their whole mask.
    assert topo.cores == ((1, 0, 0), (0, 0, 0))
    assert topo.cpu_core == {0: (1, 0, 0), 1: (0, 0, 0), 2: (0, 0, 0), 3: (1, 0, 0)}
    assert topo.sockets_of(CPUSet([0])) == frozenset({1})
    assert topo.numa_nodes_of(CPUSet([1, 2])) == frozenset({0})
    assert topo.numa_nodes_in_socket(0) == (0,)
    assert topo.sockets_in_numa_node(1) == (1,)
    assert topo.cpus_in_socket(7) == CPUSet()
    assert topo.cpus_in_numa_node(7) == CPUSet()
    assert topo.cpus_in_uncore_cache(7) == CPUSet()
    assert topo.cpus_in_core((7, 0, 0)) == CPUSet()
    assert topo.numa_nodes_in_socket(7) == ()
    assert topo.sockets_in_numa_node(7) == ()


def test_cpu_info_defaults() -> None:
    info = CPUInfo(cpu=3, socket=1, core_id=2)
    assert (info.numa_node, info.die, info.uncore_cache) == (0, 0, 0)
    assert info.core == (1, 0, 2)


machine_specs = st.builds(
    MachineSpec,
    sockets=st.integers(1, 2),
    dies_per_socket=st.integers(1, 2),
    cores_per_die=st.sampled_from([1, 2, 4, 6]),
    threads_per_core=st.integers(1, 2),
    sibling_numbering=st.sampled_from(["intel", "amd"]),
    memory_only_nodes=st.integers(0, 1),
    write_numa=st.booleans(),
    write_has_memory=st.booleans(),
    write_cache=st.booleans(),
)


# Each example writes a whole tree to disk: capped even under the thorough profile.
@settings(PROPERTY_SETTINGS, max_examples=min(PROPERTY_SETTINGS.max_examples, 150))
@given(machine_specs, st.data())
def test_discovery_round_trips_random_machines(spec: MachineSpec, data: st.DataObject) -> None:
    everything = sorted(spec.all_cpus())
    offline = data.draw(st.frozensets(st.sampled_from(everything), max_size=len(everything) - 1))
    isolated = data.draw(st.frozensets(st.sampled_from(everything)))
    numa = data.draw(st.sampled_from([n for n in (1, 2) if spec.cores_per_socket % n == 0]))
    l3 = data.draw(st.sampled_from([n for n in (1, 2) if spec.cores_per_die % n == 0]))
    spec = MachineSpec(
        **{
            **{f: getattr(spec, f) for f in spec.__dataclass_fields__},
            "offline": offline,
            "isolated": isolated,
            "numa_per_socket": numa,
            "l3_per_die": l3,
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        found = Topology.from_sysfs(write_sysfs(spec, Path(tmp)))
    assert found == expected_topology(spec)
    assert found.online == spec.online()
    # Every grouping partitions the online CPUs.
    for masks in (found.socket_masks, found.numa_masks, found.core_masks, found.uncore_masks):
        union = 0
        for mask in masks.values():
            assert union & mask == 0
            union |= mask
        assert union == found.online.mask
