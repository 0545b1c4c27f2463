"""shim.fileio: whole files read and written with bare system calls."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shim import fileio


@pytest.mark.parametrize("size", [0, 1, 65535, 65536, 65537, 3 * 65536 + 5])
def test_read_file_returns_every_byte(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "file"
    path.write_bytes(data)
    assert fileio.read_file(path) == data
    assert fileio.read_file(str(path)) == data


def test_read_file_of_procfs_and_a_missing_file(tmp_path: Path) -> None:
    # A generated file reports size 0 to stat(2): it must still be read whole.
    assert fileio.read_file(f"/proc/{os.getpid()}/stat").startswith(f"{os.getpid()} (".encode())
    with pytest.raises(FileNotFoundError):
        fileio.read_file(tmp_path / "missing")


def test_read_file_reads_a_generated_file_longer_than_a_page() -> None:
    """procfs and cgroupfs give at most a page per read(2): a cgroup.procs of a container with
    many processes is such a file. /proc/self/maps of this interpreter is one too."""
    with open("/proc/self/maps", "rb") as stream:
        expected = stream.read()
    assert len(expected) > 2 * 4096
    found = fileio.read_file("/proc/self/maps")
    # The mappings may change between the two reads (an allocation); compare their starts.
    assert len(found) > 2 * 4096
    assert found.splitlines()[:20] == expected.splitlines()[:20]


def test_read_file_closes_its_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"x")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        fileio.read_file(path)
    assert len(os.listdir("/proc/self/fd")) == before


def test_write_and_sync_goes_on_after_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    calls: list[int] = []

    def short_write(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        return real_write(fd, bytes(data[:7]))

    monkeypatch.setattr(os, "write", short_write)
    path = tmp_path / "file"
    data = b"0123456789" * 10
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        fileio.write_and_sync(fd, data)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert len(calls) == 15
