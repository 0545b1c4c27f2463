"""The VM harness's pure parts: the topologies' CPU numbering, QEMU's arguments for them, the
kernel command line, the initramfs archive format (the guests themselves run in tests/vm/),
and the pod cgroup parents the kubelet-shaped client sends with either cgroup driver."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path

import pytest

from shim.cgroups import containerd_cgroups_path, relative_cgroup_path
from shim.cpuset import CPUSet
from shim.kube import QOSClass, pod_cgroup
from tests.harness.kubelet import QoSClass, pod_cgroup_parent
from tests.vm import machine
from tests.vm.assets import AssetError, cpio_newc, extract_vmlinux
from tests.vm.guest_scenarios import Node
from tests.vm.topologies import TOPOLOGIES, Topology

P = CPUSet.parse


def test_numbering_follows_qemu_socket_core_thread_order() -> None:
    snc = TOPOLOGIES["snc-2s"]
    assert snc.cpu_count == 16
    assert snc.core_cpus(snc.core_of(5)) == P("4-5")
    assert snc.socket_cpus(1) == P("8-15")
    assert [snc.numa_node_cpus(n) for n in range(4)] == [P("0-3"), P("4-7"), P("8-11"), P("12-15")]
    flat = TOPOLOGIES["flat-8"]
    assert flat.core_cpus(flat.core_of(3)) == P("3")
    assert flat.numa_node_cpus(0) == flat.cpus


def test_qemu_arguments_give_every_node_its_cpus_and_memory() -> None:
    arguments = TOPOLOGIES["xeon-2s"].qemu_arguments()
    assert arguments[arguments.index("-smp") + 1] == "16,sockets=2,cores=4,threads=2"
    numa = [arguments[i + 1] for i, a in enumerate(arguments) if a == "-numa"]
    assert numa == ["node,nodeid=0,cpus=0-7,memdev=ram0", "node,nodeid=1,cpus=8-15,memdev=ram1"]
    assert arguments[arguments.index("-m") + 1] == "1536M"


def test_numa_nodes_must_hold_whole_cores() -> None:
    with pytest.raises(ValueError, match="whole cores"):
        Topology("odd", "", 1, 3, 2, 2, P("0"))


def test_topology_survives_the_trip_to_the_guest() -> None:
    for topology in TOPOLOGIES.values():
        assert Topology.from_json(topology.to_json()) == topology


def test_an_unknown_cgroup_driver_is_refused() -> None:
    with pytest.raises(ValueError, match="cgroup driver 'openrc'"):
        Topology("odd", "", 1, 2, 1, 1, P("0"), cgroup_driver="openrc")  # type: ignore[arg-type]
    data = TOPOLOGIES["flat-8"].to_json() | {"cgroup_driver": "openrc"}
    with pytest.raises(ValueError, match="cgroup driver 'openrc'"):
        Topology.from_json(data)


def test_the_kernel_command_line_hands_pid_1_to_systemd_only_for_its_driver() -> None:
    systemd = machine.kernel_command_line(TOPOLOGIES["flat-8"]).split()
    assert "cpushim.init=systemd" in systemd
    assert "systemd.unified_cgroup_hierarchy=1" in systemd
    assert "cpushim.cgroup=2" in systemd
    v1 = Topology("v1", "", 1, 2, 1, 1, P("0"), cgroup_driver="systemd")
    assert "systemd.unified_cgroup_hierarchy=0" in machine.kernel_command_line(v1).split()
    for name in ("xeon-2s", "snc-2s"):
        cgroupfs = machine.kernel_command_line(TOPOLOGIES[name]).split()
        assert "cpushim.cgroup=1" in cgroupfs
        assert not [word for word in cgroupfs if "systemd" in word]


UID = "4f3c2a1b-0d9e-4c8b-a7f6-5e4d3c2b1a09"
SYSTEMD_UID = UID.replace("-", "_")


@pytest.mark.parametrize(
    ("qos", "expected", "cgroupfs", "slices"),
    [
        (
            "guaranteed",
            QOSClass.GUARANTEED,
            f"/kubepods/pod{UID}",
            f"kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice",
        ),
        (
            "burstable",
            QOSClass.BURSTABLE,
            f"/kubepods/burstable/pod{UID}",
            f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice",
        ),
        (
            "besteffort",
            QOSClass.BEST_EFFORT,
            f"/kubepods/besteffort/pod{UID}",
            f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_UID}.slice",
        ),
    ],
)
def test_pod_cgroup_parents_are_kubelets_with_either_driver(
    qos: QoSClass, expected: QOSClass, cgroupfs: str, slices: str
) -> None:
    assert pod_cgroup_parent(qos, UID) == cgroupfs
    systemd = pod_cgroup_parent(qos, UID, "systemd")
    assert systemd == slices.rsplit("/", 1)[-1]
    for parent in (cgroupfs, systemd):
        assert pod_cgroup(parent).qos == expected
        assert pod_cgroup(parent).pod_uid == UID
    scope = relative_cgroup_path(containerd_cgroups_path(systemd, "c0ffee"))
    assert str(scope) == f"{slices}/cri-containerd-c0ffee.scope"


def parse_newc(archive: bytes) -> list[tuple[str, int, bytes]]:
    entries: list[tuple[str, int, bytes]] = []
    offset = 0
    while True:
        header = archive[offset : offset + 110]
        assert header[:6] == b"070701"
        fields = [int(header[6 + 8 * i : 14 + 8 * i], 16) for i in range(13)]
        mode, size, name_size = fields[1], fields[6], fields[11]
        name_start = offset + 110
        name = archive[name_start : name_start + name_size - 1].decode()
        data_start = name_start + name_size + (-(110 + name_size) % 4)
        if name == "TRAILER!!!":
            return entries
        entries.append((name, mode, archive[data_start : data_start + size]))
        offset = data_start + size + (-size % 4)


def test_cpio_archive_reads_back() -> None:
    entries = [("bin", 0o040755, b""), ("bin/tool", 0o100755, b"abc"), ("init", 0o100755, b"x")]
    archive = cpio_newc(entries)
    assert len(archive) % 4 == 0
    assert parse_newc(archive) == entries
    assert parse_newc(gzip.decompress(gzip.compress(archive))) == entries


def test_vmlinux_comes_out_of_the_xz_payload() -> None:
    elf = b"\x7fELF" + bytes(range(256)) * 4
    bzimage = b"setup code" * 10 + lzma.compress(elf, format=lzma.FORMAT_XZ) + b"trailer"
    assert extract_vmlinux(bzimage) == elf
    with pytest.raises(AssetError, match="no xz payload"):
        extract_vmlinux(b"not a kernel")


def test_a_churn_seed_is_asked_for_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(machine.CHURN_SEED_VARIABLE, raising=False)
    assert machine.churn_seed_asked() is None
    monkeypatch.setenv(machine.CHURN_SEED_VARIABLE, " 1234 ")
    assert machine.churn_seed_asked() == 1234
    monkeypatch.setenv(machine.CHURN_SEED_VARIABLE, "abc")
    with pytest.raises(ValueError, match="CPUSHIM_VM_CHURN_SEED='abc'"):
        machine.churn_seed_asked()


class _ListedSandbox:
    def __init__(self, sandbox_id: str, name: str) -> None:
        self.id = sandbox_id
        self.metadata = type("Metadata", (), {"name": name})()


class _RuntimeWithPods:
    """What a scenario's client sees: the runtime's pods, and the ones torn down."""

    def __init__(self, *sandboxes: _ListedSandbox) -> None:
        self.sandboxes = list(sandboxes)
        self.torn_down: list[str] = []

    def list_pod_sandbox(self) -> object:
        return type("Listing", (), {"items": list(self.sandboxes)})()

    def teardown_pod(self, sandbox_id: str) -> None:
        self.torn_down.append(sandbox_id)


def test_a_scenario_starts_without_the_pods_an_earlier_one_left(tmp_path: Path) -> None:
    """A scenario cut short by its time limit may leave pods running: the next one tears them
    down first (their CPUs would count as the shared pool's in its invariants), but never the
    pods it runs itself."""
    node = Node(containerd=None, directory=tmp_path, topology=TOPOLOGIES["flat-8"])  # type: ignore[arg-type]
    runtime = _RuntimeWithPods(_ListedSandbox("left", "churn-pinned"), _ListedSandbox("own", "x"))
    node.client = runtime  # type: ignore[assignment]
    node.pods = [_ListedSandbox("own", "x")]  # type: ignore[list-item]
    node.clear_leftovers()
    assert runtime.torn_down == ["left"]
