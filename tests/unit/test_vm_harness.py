"""The VM harness's pure parts: the topologies' CPU numbering, QEMU's arguments for them, and
the initramfs archive format (the guests themselves run in tests/vm/)."""

from __future__ import annotations

import gzip
import lzma

import pytest

from shim.cpuset import CPUSet
from tests.vm import machine
from tests.vm.assets import AssetError, cpio_newc, extract_vmlinux
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
