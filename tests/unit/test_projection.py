"""Projection: file content, the writer (atomicity, generations, names, removal) and the
subscriber (``read`` and ``watch``)."""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

import shim.projection as projection_module
import shim.projection.writer as writer_module
from shim.cpuset import CPUSet
from shim.projection import (
    CPUS_FILE,
    MAX_INTEGER,
    STATE_FILE,
    Pool,
    Projection,
    ProjectionError,
    parse,
    read,
    watch,
)
from shim.projection.content import core_name, describe, render, rfc3339
from shim.projection.writer import (
    ProjectionPathError,
    ProjectionWriter,
    check_name,
    on_memory_fs,
)
from tests.harness.prerequisites import require
from tests.harness.sysfs import MachineSpec, expected_topology

REPO = Path(__file__).resolve().parents[2]

# 2 sockets x 4 cores x 2 threads, 2 NUMA nodes per socket. Intel numbering: CPU n and n + 8
# are siblings; socket 0 holds CPUs 0-3 and 8-11 (nodes 0: cores 0-1, 1: cores 2-3), socket 1
# holds 4-7 and 12-15 (nodes 2 and 3). CPUs 9 and 12 are isolated.
TOPOLOGY = expected_topology(
    MachineSpec(
        sockets=2,
        cores_per_die=4,
        threads_per_core=2,
        numa_per_socket=2,
        isolated=frozenset({9, 12}),
    )
)
EARLY_NS = 1_000_000  # a clock 1 ms after the epoch: fresh generations start at 1000


@pytest.fixture
def tmpfs_path(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs when there is one, as /run is where cpushim writes."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="cpushim-test-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """umask 077, so modes that come out 0755 and 0644 were asked for, not inherited."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


async def project(
    writer: ProjectionWriter,
    cpus: str,
    *,
    pod: str = "pod-1",
    name: str = "app",
    mems: str = "",
    pool: Pool = "shared",
) -> int:
    exclusive = pool == "exclusive"
    return await writer.write(pod, name, CPUSet.parse(cpus), mems, exclusive, pool, TOPOLOGY)


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# --- content ----------------------------------------------------------------------------------


def test_describe_an_exclusive_container() -> None:
    state = describe(
        cpus=CPUSet.parse("1,4,9,12"),
        mems="0,2",
        exclusive=True,
        pool="exclusive",
        topology=TOPOLOGY,
        generation=7,
        updated_at="2026-01-02T03:04:05.000006Z",
    )
    assert state == Projection(
        cpus="1,4,9,12",
        mems="0,2",
        exclusive=True,
        pool="exclusive",
        numa_nodes=(0, 2),
        sockets=(0, 1),
        # CPU 1 and its sibling 9: core 1 of socket 0; CPU 4 and its sibling 12: core 0 of
        # socket 1.
        cores=("0:0:1", "1:0:0"),
        isolated="9,12",
        generation=7,
        updated_at="2026-01-02T03:04:05.000006Z",
    )
    assert state.cpu_ids() == frozenset({1, 4, 9, 12})


def test_describe_a_shared_container() -> None:
    state = describe(
        cpus=CPUSet.parse("0-3"),
        mems="",
        exclusive=False,
        pool="shared",
        topology=TOPOLOGY,
        generation=1,
        updated_at=rfc3339(0),
    )
    assert (state.numa_nodes, state.sockets, state.isolated) == ((0, 1), (0,), "")
    assert state.cores == ("0:0:0", "0:0:1", "0:0:2", "0:0:3")
    assert state.mems == ""


def test_cores_are_named_with_their_die() -> None:
    # Core ids restart in every die here, as on some parts.
    spec = MachineSpec(sockets=2, dies_per_socket=2, cores_per_die=2, core_ids=[0, 1, 0, 1])
    topology = expected_topology(spec)
    state = describe(
        cpus=topology.online,
        mems="",
        exclusive=False,
        pool="shared",
        topology=topology,
        generation=1,
        updated_at=rfc3339(0),
    )
    assert state.cores == (
        "0:0:0",
        "0:0:1",
        "0:1:0",
        "0:1:1",
        "1:0:0",
        "1:0:1",
        "1:1:0",
        "1:1:1",
    )
    assert core_name((1, 2, 3)) == "1:2:3"


@pytest.mark.parametrize(
    ("cpus", "exclusive", "pool", "message"),
    [
        ("", False, "shared", "at least one CPU"),
        ("3,99", False, "shared", "not online"),
        ("3", True, "shared", "does not fit"),
        ("3", False, "exclusive", "does not fit"),
        ("3", False, "private", "not one of"),
    ],
)
def test_describe_refuses(cpus: str, exclusive: bool, pool: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        describe(
            cpus=CPUSet.parse(cpus),
            mems="",
            exclusive=exclusive,
            pool=pool,
            topology=TOPOLOGY,
            generation=1,
            updated_at=rfc3339(0),
        )


def test_rfc3339() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00.000000Z"
    assert rfc3339(1_700_000_000_123_456_789) == "2023-11-14T22:13:20.123456Z"


def test_render_round_trips() -> None:
    state = describe(
        cpus=CPUSet.parse("0-2,8"),
        mems="0",
        exclusive=False,
        pool="reserved",
        topology=TOPOLOGY,
        generation=12,
        updated_at=rfc3339(1_700_000_000_000_000_000),
    )
    files = render(state)
    assert [name for name, _ in files] == [CPUS_FILE, STATE_FILE]  # the rename order
    assert dict(files)[CPUS_FILE] == b"0-2,8\n"
    assert dict(files)[STATE_FILE].endswith(b"\n")
    assert parse(dict(files)[STATE_FILE]) == state
    assert list(json.loads(dict(files)[STATE_FILE])) == [
        "cpus",
        "mems",
        "exclusive",
        "pool",
        "numa_nodes",
        "sockets",
        "cores",
        "isolated",
        "generation",
        "updated_at",
    ]


# --- parsing ----------------------------------------------------------------------------------

VALID: dict[str, Any] = {
    "cpus": "1,4,9,12",
    "mems": "0,2",
    "exclusive": True,
    "pool": "exclusive",
    "numa_nodes": [0, 2],
    "sockets": [0, 1],
    "cores": ["0:0:1", "1:0:0"],
    "isolated": "9,12",
    "generation": 7,
    "updated_at": "2026-01-02T03:04:05.000006Z",
}


def with_(**changes: Any) -> bytes:
    return json.dumps(VALID | changes).encode()


def without(name: str) -> bytes:
    return json.dumps({k: v for k, v in VALID.items() if k != name}).encode()


def test_parse_a_valid_file() -> None:
    state = parse(with_())
    assert state.as_dict() == VALID
    assert parse(with_(updated_at="2026-01-02T03:04:05+01:00")).updated_at.endswith("+01:00")


def test_parse_ignores_fields_it_does_not_know() -> None:
    assert parse(with_(llc="0-3", future={"x": 1})) == parse(with_())


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b'{"cpus": "1"', id="truncated"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
        pytest.param(b"[1, 2]", id="array"),
        *(pytest.param(without(name), id=f"no-{name}") for name in VALID),
        pytest.param(with_(cpus=""), id="no-cpus"),
        pytest.param(with_(cpus="1-"), id="bad-cpus"),
        pytest.param(with_(cpus=[1, 2]), id="cpus-list"),
        pytest.param(with_(mems="x"), id="bad-mems"),
        pytest.param(with_(exclusive="true"), id="exclusive-string"),
        pytest.param(with_(exclusive=1), id="exclusive-int"),
        pytest.param(with_(pool="private"), id="unknown-pool"),
        pytest.param(with_(pool="shared"), id="pool-disagrees"),
        pytest.param(with_(exclusive=False), id="exclusive-disagrees"),
        pytest.param(with_(numa_nodes=[0, -1]), id="negative-node"),
        pytest.param(with_(sockets=[True]), id="bool-socket"),
        pytest.param(with_(sockets="0,1"), id="sockets-string"),
        pytest.param(with_(cores=["0:1"]), id="core-two-parts"),
        pytest.param(with_(cores=[1]), id="core-int"),
        pytest.param(with_(cores=["0:0:01"]), id="core-leading-zero"),
        pytest.param(with_(isolated="2"), id="isolated-not-held"),
        pytest.param(with_(generation="7"), id="generation-string"),
        pytest.param(with_(generation=True), id="generation-bool"),
        pytest.param(with_(generation=7.5), id="generation-float"),
        pytest.param(with_(generation=-1), id="generation-negative"),
        # Valid JSON that no writer could render again, nor a float64 reader take exactly.
        pytest.param(with_(generation=2**53), id="generation-huge"),
        pytest.param(with_(numa_nodes=[2**64]), id="node-huge"),
        pytest.param(with_(sockets=[2**53]), id="socket-huge"),
        pytest.param(with_(updated_at="yesterday"), id="time-words"),
        pytest.param(with_(updated_at="2026-01-02 03:04:05Z"), id="time-space"),
        pytest.param(with_(updated_at="2026-13-02T03:04:05Z"), id="time-month-13"),
        pytest.param(with_(updated_at="2026-01-02T03:04:05"), id="time-no-zone"),
    ],
)
def test_parse_refuses(data: bytes) -> None:
    with pytest.raises(ProjectionError):
        parse(data)
    assert issubclass(ProjectionError, ValueError)


def test_read(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read(tmp_path)
    (tmp_path / STATE_FILE).write_bytes(with_())
    assert read(tmp_path) == parse(with_())
    assert read(str(tmp_path)).generation == 7
    (tmp_path / STATE_FILE).write_bytes(with_(cpus="1-"))
    with pytest.raises(ProjectionError, match=str(tmp_path / STATE_FILE)):
        read(tmp_path)


# --- the writer: files, modes, order ----------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.usefixtures("strict_umask")
async def test_write_lays_out_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "projection"
    writer = ProjectionWriter(root)
    generation = await project(writer, "1,9", mems="0", pool="exclusive")
    directory = writer.directory("pod-1", "app")
    assert directory == root / "pod-1" / "app"
    assert sorted(os.listdir(directory)) == [CPUS_FILE, STATE_FILE]  # no temporary left
    assert (directory / CPUS_FILE).read_bytes() == b"1,9\n"
    state = read(directory)
    assert (state.cpus, state.mems, state.pool, state.exclusive) == ("1,9", "0", "exclusive", True)
    assert state.generation == generation
    for path in (root / "pod-1", directory):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755
    for name in (CPUS_FILE, STATE_FILE):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o644


@pytest.mark.anyio
async def test_cpus_is_renamed_before_the_state_then_the_directory_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = ProjectionWriter(tmp_path)
    await project(writer, "1")
    steps: list[str] = []
    rename, fsync = os.rename, os.fsync

    def recording_rename(src: Any, dst: Any, **kwargs: Any) -> None:
        steps.append(f"rename {dst}")
        rename(src, dst, **kwargs)

    def recording_fsync(fd: int) -> None:
        steps.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        fsync(fd)

    monkeypatch.setattr(os, "rename", recording_rename)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    await project(writer, "2")
    assert steps == [
        "fsync file",
        f"rename {CPUS_FILE}",
        "fsync file",
        f"rename {STATE_FILE}",
        "fsync dir",
    ]


@pytest.mark.anyio
async def test_a_failed_write_leaves_the_last_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = ProjectionWriter(tmp_path)
    first = await project(writer, "1")
    fsync = os.fsync
    calls = 0

    def failing_second(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the temporary cpuset.json
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_second)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        await project(writer, "2")
    monkeypatch.undo()
    directory = writer.directory("pod-1", "app")
    assert sorted(os.listdir(directory)) == [CPUS_FILE, STATE_FILE]  # temporary removed
    assert read(directory).generation == first
    assert await project(writer, "2") == first + 1


# --- the writer: generations ------------------------------------------------------------------


@pytest.mark.anyio
async def test_generations_start_at_the_clock_and_grow_by_one(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path, clock_ns=lambda: EARLY_NS)
    generations = [await project(writer, cpus) for cpus in ("1", "2", "1-2", "3")]
    assert generations == [1000, 1001, 1002, 1003]
    assert read(writer.directory("pod-1", "app")).generation == 1003
    # Each directory counts on its own.
    assert await project(writer, "1", name="sidecar") == 1000


@pytest.mark.anyio
async def test_a_new_writer_carries_on(tmp_path: Path) -> None:
    first = ProjectionWriter(tmp_path)
    generations = [await project(first, cpus) for cpus in ("1", "2")]
    second = ProjectionWriter(tmp_path, clock_ns=lambda: EARLY_NS)  # a clock gone back
    assert await project(second, "3") == generations[-1] + 1
    assert await project(second, "4") == generations[-1] + 2


def damage(directory: Path, how: str) -> None:
    state = directory / STATE_FILE
    if how == "deleted":
        state.unlink()
    elif how == "garbage":
        state.write_bytes(b"\x00\x17garbage")
    elif how == "empty":
        state.write_bytes(b"")
    elif how == "wrong-schema":
        state.write_text(json.dumps({"cpus": "1", "generation": 1}))
    elif how == "everything":
        for path in directory.iterdir():
            path.unlink()
    else:
        raise AssertionError(how)


DAMAGES = ["deleted", "garbage", "empty", "wrong-schema", "everything"]


@pytest.mark.anyio
@pytest.mark.parametrize("how", DAMAGES)
async def test_generations_never_repeat_after_damage_with_a_new_writer(
    tmp_path: Path, how: str
) -> None:
    # The first writer's clock was far behind; the next has the same clock and no memory.
    first = ProjectionWriter(tmp_path, clock_ns=lambda: EARLY_NS)
    written = [await project(first, cpus) for cpus in ("1", "2", "3")]
    assert written == [1000, 1001, 1002]
    damage(first.directory("pod-1", "app"), how)
    second = ProjectionWriter(tmp_path, clock_ns=lambda: EARLY_NS)
    generation = await project(second, "4")
    assert generation > max(written)
    assert read(second.directory("pod-1", "app")).generation == generation


@pytest.mark.anyio
@pytest.mark.parametrize("how", DAMAGES)
async def test_generations_never_repeat_after_damage_with_the_same_writer(
    tmp_path: Path, how: str
) -> None:
    writer = ProjectionWriter(tmp_path, clock_ns=lambda: EARLY_NS)
    written = [await project(writer, cpus) for cpus in ("1", "2", "3")]
    directory = writer.directory("pod-1", "app")
    damage(directory, how)
    # Leave no trace in the file times either: only the writer's memory is left.
    for path in [directory, *directory.iterdir()]:
        os.utime(path, ns=(0, 0))
    assert await project(writer, "4") == max(written) + 1


@pytest.mark.anyio
@pytest.mark.parametrize("new_writer", [False, True], ids=["same writer", "new writer"])
async def test_a_file_at_the_largest_generation_is_followed_by_one_readers_take(
    tmp_path: Path, new_writer: bool
) -> None:
    writer = ProjectionWriter(tmp_path)
    await project(writer, "1")
    directory = writer.directory("pod-1", "app")
    largest = replace(read(directory), generation=MAX_INTEGER)
    (directory / STATE_FILE).write_bytes(dict(render(largest))[STATE_FILE])
    assert read(directory).generation == MAX_INTEGER  # one the readers take
    if new_writer:
        writer = ProjectionWriter(tmp_path)
    generation = await project(writer, "2")
    assert read(directory).generation == generation <= MAX_INTEGER


@pytest.mark.anyio
async def test_a_rolled_back_file_does_not_bring_generations_back(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path, clock_ns=lambda: EARLY_NS)
    directory = writer.directory("pod-1", "app")
    await project(writer, "1")
    old = (directory / STATE_FILE).read_bytes()
    await project(writer, "2")
    await project(writer, "1")  # 1002, the same state as the old file's 1000
    (directory / STATE_FILE).write_bytes(old)
    # Same content as the rolled-back file, yet written again above what was seen.
    assert await project(writer, "1") == 1003
    assert read(directory).generation == 1003


# --- the writer: nothing but the time changed --------------------------------------------------


@pytest.mark.anyio
async def test_an_unchanged_state_is_not_written(tmp_path: Path) -> None:
    ticks = iter(range(10**18, 2 * 10**18, 10**9))
    writer = ProjectionWriter(tmp_path, clock_ns=lambda: next(ticks))
    directory = writer.directory("pod-1", "app")
    first = await project(writer, "1-2", mems="0,1")

    def files() -> list[tuple[int, int, bytes]]:
        return [
            (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes())
            for path in (directory / CPUS_FILE, directory / STATE_FILE)
        ]

    before = files()
    assert await project(writer, "1-2", mems="0-1") == first  # the same mems, spelt otherwise
    assert (
        await ProjectionWriter(tmp_path).write(
            "pod-1", "app", CPUSet.parse("1,2"), "0,1", False, "shared", TOPOLOGY
        )
        == first
    )  # a new writer reads what is there
    assert files() == before
    assert (writer.writes, writer.unchanged) == (1, 1)

    assert await project(writer, "1-2", mems="0") == first + 1
    assert await project(writer, "1-2", mems="0", pool="reserved") == first + 2
    assert await project(writer, "1-3", mems="0", pool="reserved") == first + 3
    assert writer.writes == 4


@pytest.mark.anyio
async def test_a_damaged_cpus_file_is_written_again(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path)
    directory = writer.directory("pod-1", "app")
    first = await project(writer, "5")
    (directory / CPUS_FILE).write_bytes(b"0-15\n")
    assert await project(writer, "5") == first + 1
    assert (directory / CPUS_FILE).read_bytes() == b"5\n"
    (directory / CPUS_FILE).unlink()
    assert await project(writer, "5") == first + 2
    assert (directory / CPUS_FILE).read_bytes() == b"5\n"


# --- the writer: names become paths only when safe ---------------------------------------------

BAD_NAMES = [
    "",
    ".",
    "..",
    "/",
    "a/b",
    "../etc",
    "..%2f",
    "a\x00b",
    "x" * 256,
    ".hidden",
    "-rf",
    "a b",
    "a\nb",
    "é",
]


@pytest.mark.anyio
@pytest.mark.parametrize("bad", BAD_NAMES, ids=repr)
async def test_unsafe_names_are_refused(tmp_path: Path, bad: str) -> None:
    root = tmp_path / "projection"
    writer = ProjectionWriter(root)
    before = tree(tmp_path)
    for pod, name in ((bad, "app"), ("pod-1", bad)):
        with pytest.raises(ProjectionPathError):
            writer.directory(pod, name)
        with pytest.raises(ProjectionPathError):
            await writer.write(pod, name, CPUSet.parse("1"), "", False, "shared", TOPOLOGY)
        with pytest.raises(ProjectionPathError):
            await writer.remove(pod, name)
    with pytest.raises(ProjectionPathError):
        await writer.remove_pod(bad)
    assert tree(tmp_path) == before  # not even the root was made


def test_names_kubernetes_uses_are_accepted() -> None:
    for name in (
        "0f6fa1d4-6b1c-4bd3-9f4e-2d5a1ce0a6b4",  # a pod UID from the API server
        "6a0ec9ab8fd94d1e99b7c8a7b2c8b8e5",  # a static pod's UID (a hash)
        "istio-proxy",
        "app.v2_x",
        "x" * 255,
    ):
        assert check_name("name", name) == name


@pytest.mark.anyio
async def test_a_symlink_never_leads_a_write_outside(tmp_path: Path) -> None:
    root, outside = tmp_path / "projection", tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    (root / "pod-1").symlink_to(outside)
    writer = ProjectionWriter(root)
    with pytest.raises(NotADirectoryError, match="symlink"):
        await project(writer, "1")
    (root / "pod-2").mkdir()
    (root / "pod-2" / "app").symlink_to(outside)
    with pytest.raises(NotADirectoryError, match="symlink"):
        await project(writer, "1", pod="pod-2")
    with pytest.raises(OSError, match="symbolic link"):
        await writer.remove_pod("pod-1")
    assert list(outside.iterdir()) == []


# --- the writer: a caller cancelled -----------------------------------------------------------


# Long enough never to end a wait the test means to end; bounds a test gone wrong.
HELD_S = 10.0


def threads_beside(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each blocking call handed to a worker thread from now on, whether another was
    still running then."""
    running: list[object] = []
    beside: list[bool] = []
    to_thread = asyncio.to_thread

    def counting(func: Callable[..., Any], /, *args: Any) -> Any:
        beside.append(bool(running))
        token = object()
        running.append(token)

        def run() -> Any:
            try:
                return func(*args)
            finally:
                running.remove(token)

        return to_thread(run)

    monkeypatch.setattr(asyncio, "to_thread", counting)
    return beside


@pytest.mark.anyio
async def test_a_write_whose_caller_was_cancelled_ends_before_the_next_begins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker thread cannot be stopped: the write of a cancelled caller goes on, and the
    next write of its directory must not begin beside it, or the two interleave their
    temporary files and renames (and count from the same generation)."""
    writer = ProjectionWriter(tmp_path, inline=False)
    first = await project(writer, "1")
    held, release = threading.Event(), threading.Event()
    replace_file = writer_module._replace

    def holding(dir_fd: int, name: str, data: bytes) -> None:
        if data == b"2\n":  # the cancelled write's ``cpus``, before its rename
            held.set()
            release.wait(HELD_S)
        replace_file(dir_fd, name, data)

    monkeypatch.setattr(writer_module, "_replace", holding)
    beside = threads_beside(monkeypatch)
    cancelled = asyncio.create_task(project(writer, "2"))
    await anyio.to_thread.run_sync(held.wait, HELD_S)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    following = asyncio.create_task(project(writer, "3"))
    # Let the cancelled write's thread go on after the next write's first step: by then that
    # one has handed its work to a thread, or waits to.
    asyncio.get_running_loop().call_soon(release.set)
    generation = await following
    assert beside == [False, False], "a write began while the cancelled one's thread ran"
    assert generation == first + 2
    directory = writer.directory("pod-1", "app")
    assert (directory / CPUS_FILE).read_bytes() == b"3\n"
    assert (read(directory).cpus, read(directory).generation) == ("3", generation)


@pytest.mark.anyio
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "thread"])
async def test_a_removal_whose_caller_was_cancelled_ends_before_the_next_write_begins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    """A container's removal runs in a thread even where writes run on the loop: the write
    after one whose caller was cancelled waits for it, or the removal takes its files away."""
    writer = ProjectionWriter(tmp_path, inline=inline)
    first = await project(writer, "1")
    held, release, removed = threading.Event(), threading.Event(), threading.Event()
    remove_container = writer_module._remove_container

    def holding(root: Path, pod_uid: str, container_name: str) -> None:
        held.set()
        release.wait(HELD_S)
        remove_container(root, pod_uid, container_name)
        removed.set()

    monkeypatch.setattr(writer_module, "_remove_container", holding)
    beside = threads_beside(monkeypatch)
    cancelled = asyncio.create_task(writer.remove("pod-1", "app"))
    await anyio.to_thread.run_sync(held.wait, HELD_S)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    following = asyncio.create_task(project(writer, "3"))
    asyncio.get_running_loop().call_soon(release.set)  # after the write's first step
    generation = await following
    assert not any(beside), "a write began while the cancelled removal's thread ran"
    assert await anyio.to_thread.run_sync(removed.wait, HELD_S)
    directory = writer.directory("pod-1", "app")
    assert (directory / CPUS_FILE).read_bytes() == b"3\n"
    assert (read(directory).cpus, read(directory).generation) == ("3", generation)
    assert generation > first


# --- the writer: removal ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_remove_a_container_then_its_empty_pod(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path)
    await project(writer, "1", name="app")
    await project(writer, "2", name="sidecar")
    await writer.remove("pod-1", "app")
    assert tree(tmp_path) == [
        "pod-1",
        "pod-1/sidecar",
        "pod-1/sidecar/cpus",
        "pod-1/sidecar/cpuset.json",
    ]
    await writer.remove("pod-1", "sidecar")
    assert tree(tmp_path) == []
    await writer.remove("pod-1", "sidecar")  # gone already: nothing to do
    await ProjectionWriter(tmp_path / "never-made").remove("pod-1", "app")


@pytest.mark.anyio
async def test_remove_a_pod(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path)
    before = await project(writer, "1", name="app")
    await project(writer, "2", name="sidecar")
    await project(writer, "3", pod="pod-2")
    await writer.remove_pod("pod-1")
    assert tree(tmp_path) == ["pod-2", "pod-2/app", "pod-2/app/cpus", "pod-2/app/cpuset.json"]
    await writer.remove_pod("pod-1")  # gone already: nothing to do
    # Made again, the directory's generations start above those it held before.
    assert await project(writer, "1", name="app") > before


@pytest.mark.anyio
async def test_clean_stale_removes_only_what_is_ours_and_gone(tmp_path: Path) -> None:
    root, outside = tmp_path / "projection", tmp_path / "outside"
    writer = ProjectionWriter(root)
    for pod, name in (("u1", "a"), ("u1", "b"), ("u2", "c"), ("u5", "d")):
        await project(writer, "1", pod=pod, name=name)
    (root / "u6" / "f").mkdir(parents=True)  # made, never written (a crash): ours
    (root / "u1" / "a" / ".cpus.0a1b2c.tmp").write_bytes(b"1\n")  # a crash mid-write
    # Not ours: a file, a hidden directory, foreign content, symlinks.
    (root / "notes.txt").write_text("keep")
    (root / ".hidden").mkdir()
    (root / "u3" / "x").mkdir(parents=True)
    (root / "u3" / "x" / "data").write_text("keep")
    (outside / "e").mkdir(parents=True)
    (outside / "e" / CPUS_FILE).write_text("0\n")
    (root / "u4").symlink_to(outside)
    (root / "u1" / "link").symlink_to(outside / "e")

    removed = await writer.clean_stale({("u1", "a"), ("u5", "d"), ("u9", "z")})
    assert sorted(removed) == sorted(
        [root / "u1" / "b", root / "u2" / "c", root / "u2", root / "u6" / "f", root / "u6"]
    )
    assert tree(root) == [
        ".hidden",
        "notes.txt",
        "u1",
        "u1/a",
        "u1/a/cpus",
        "u1/a/cpuset.json",
        "u1/link",
        "u3",
        "u3/x",
        "u3/x/data",
        "u4",
        "u5",
        "u5/d",
        "u5/d/cpus",
        "u5/d/cpuset.json",
    ]
    assert (outside / "e" / CPUS_FILE).read_text() == "0\n"
    assert await writer.clean_stale({("u1", "a"), ("u5", "d")}) == []
    assert await ProjectionWriter(tmp_path / "never-made").clean_stale(()) == []


@pytest.mark.anyio
async def test_a_pod_whose_sweep_fails_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = ProjectionWriter(tmp_path)
    for pod in ("u1", "u2", "u3"):
        await project(writer, "1", pod=pod)
    sweep = writer_module._sweep_pod

    def refused_for_u2(root: Path, pod_uid: str, keep: frozenset[str]) -> list[str]:
        if pod_uid == "u2":
            raise OSError(errno.EBUSY, "busy", str(root / pod_uid))
        return sweep(root, pod_uid, keep)

    monkeypatch.setattr(writer_module, "_sweep_pod", refused_for_u2)
    failures: list[tuple[str, int | None]] = []
    removed = await writer.clean_stale((), lambda pod, exc: failures.append((pod, exc.errno)))
    assert failures == [("u2", errno.EBUSY)]
    assert sorted(removed) == sorted(tmp_path / path for path in ("u1", "u1/app", "u3", "u3/app"))
    with pytest.raises(OSError, match="busy"):  # told to no one: raised
        await writer.clean_stale(())


# --- atomicity: a reader in another process ---------------------------------------------------

# Reads until its stdin reaches EOF (or, with "stop", until its first failure) and prints a
# summary. Every read must find both files whole and valid, and generations never going back.
READER = r"""
import json, select, sys
from shim.cpuset import CPUSet
from shim.projection import read
directory, stop = sys.argv[1], sys.argv[2] == "stop"
reads, last, generations, failures = 0, -1, set(), []
while not (reads % 32 == 0 and select.select([sys.stdin], [], [], 0)[0]):
    reads += 1
    try:
        state = read(directory)
        with open(directory + "/cpus") as file:
            text = file.read()
        if not text.endswith("\n") or not CPUSet.parse(text):
            raise ValueError(f"cpus file holds {text!r}")
        if state.generation < last:
            raise ValueError(f"generation went back from {last} to {state.generation}")
        last = state.generation
        generations.add(last)
    except (OSError, ValueError) as exc:
        failures.append(repr(exc))
        if stop:
            break
print(json.dumps({"reads": reads, "generations": len(generations), "failures": failures[:5],
                  "failed": len(failures)}))
"""

# Different sizes, so a torn file would show.
CPU_LISTS = ["0", "0-15", "1,3,5,7,9,11,13,15", "2-3,10-11", "4"]


def start_reader(directory: Path, mode: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", READER, str(directory), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
        env=env,
    )


def summary_of(reader: subprocess.Popen[bytes]) -> dict[str, Any]:
    out, _ = reader.communicate(b"", timeout=60)  # EOF on its stdin stops it
    return dict(json.loads(out))


@pytest.mark.anyio
async def test_a_reader_never_sees_a_torn_file(tmpfs_path: Path) -> None:
    writer = ProjectionWriter(tmpfs_path)
    await project(writer, CPU_LISTS[0])
    reader = start_reader(writer.directory("pod-1", "app"), "all")
    try:
        for index in range(1, 10_001):
            await project(writer, CPU_LISTS[index % len(CPU_LISTS)], mems=str(index % 4))
    finally:
        summary = summary_of(reader)
    assert summary["failed"] == 0, summary["failures"]
    # The reader really ran alongside the writes.
    assert summary["reads"] > 1000
    assert summary["generations"] > 100


def test_the_reader_catches_a_writer_that_is_not_atomic(tmpfs_path: Path) -> None:
    """The check above can fail: the same reader against files rewritten in place."""
    directory = tmpfs_path / "pod-1" / "app"
    directory.mkdir(parents=True)
    states = [
        describe(
            cpus=CPUSet.parse(cpus),
            mems="",
            exclusive=False,
            pool="shared",
            topology=TOPOLOGY,
            generation=index,
            updated_at=rfc3339(0),
        )
        for index, cpus in enumerate(CPU_LISTS)
    ]

    def write_in_place(state: Projection) -> None:
        for name, data in render(state):
            with open(directory / name, "wb") as file:  # truncates, then writes
                file.write(data)

    write_in_place(states[0])
    reader = start_reader(directory, "stop")
    try:
        for index in range(100_000):
            if index % 32 == 0 and reader.poll() is not None:
                break
            write_in_place(states[index % len(states)])
    finally:
        summary = summary_of(reader)
    assert summary["failed"] == 1


# --- the subscriber ---------------------------------------------------------------------------


def watched_inodes() -> set[int]:
    """The inodes this process's inotify instances watch, from /proc/self/fdinfo."""
    found: set[int] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:inotify":
                continue
            lines = Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
        except OSError:
            continue  # closed meanwhile
        for line in lines:
            if line.startswith("inotify wd:"):
                fields = dict(item.split(":", 1) for item in line.split()[1:])
                found.add(int(fields["ino"], 16))
    return found


def inotify_fds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with suppress(OSError):  # closed meanwhile
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    return count


async def until(condition: Callable[[], bool], what: str, within: float = 5.0) -> None:
    """Until ``condition()`` holds (inotify tells no one else when a watch is placed)."""
    with anyio.move_on_after(within):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.001)
        return
    raise AssertionError(f"not within {within}s: {what}")


def watching(path: Path) -> Callable[[], bool]:
    inode = path.stat().st_ino
    return lambda: inode in watched_inodes()


States = MemoryObjectReceiveStream[Projection]


@asynccontextmanager
async def subscribed(path: Path) -> AsyncIterator[States]:
    """``watch(path)`` running in a task of its own, its states in a stream."""
    send, receive = anyio.create_memory_object_stream[Projection](1000)

    async def consume() -> None:
        async with aclosing(watch(path)) as states, send:
            async for state in states:
                await send.send(state)

    async with anyio.create_task_group() as group:
        group.start_soon(consume)
        yield receive
        group.cancel_scope.cancel()


async def next_state(states: States, within: float = 5.0) -> Projection:
    with anyio.fail_after(within):
        return await states.receive()


def nothing_more(states: States) -> bool:
    try:
        states.receive_nowait()
    except anyio.WouldBlock:
        return True
    return False


@pytest.mark.anyio
async def test_what_a_subscriber_of_the_directory_sees(tmp_path: Path) -> None:
    """What contrib/examples/README.md tells workloads that use inotify themselves."""
    writer = ProjectionWriter(tmp_path)
    directory = writer.directory("pod-1", "app")
    await project(writer, "1")
    inotify = projection_module._Inotify()
    try:
        inotify.add(str(directory), 0xFFF)  # IN_ALL_EVENTS
        await project(writer, "2-3")
        await project(writer, "2-3")  # unchanged: read, never renamed
        await project(writer, "2-3", mems="1")  # cpuset.json alone differs
        events = [(mask, name) for _, mask, name in inotify.events()]
    finally:
        inotify.close()
    moved_to = [name for mask, name in events if mask & projection_module._IN_MOVED_TO]
    # Each change: cpus, then cpuset.json, each renamed in whole, cpus even when it is as
    # it was.
    assert moved_to == [CPUS_FILE, STATE_FILE, CPUS_FILE, STATE_FILE]
    written = projection_module._IN_CREATE | projection_module._IN_CLOSE_WRITE
    for mask, name in events:
        if name in (CPUS_FILE, STATE_FILE):
            # Never made or written in place: only read (cpushim compares) and renamed in.
            assert not mask & written, (hex(mask), name)
        else:
            # The rest is the directory itself, or the hidden temporary files.
            assert name == "" or name.startswith("."), name


@pytest.mark.anyio
async def test_watch_yields_the_current_state_then_each_change_once(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path)
    directory = writer.directory("pod-1", "app")
    first = await project(writer, "1")
    async with subscribed(directory) as states:
        assert await next_state(states) == read(directory)
        assert read(directory).generation == first
        for index in range(20):
            generation = await project(writer, CPU_LISTS[index % len(CPU_LISTS)], mems=str(index))
            state = await next_state(states)
            assert state.generation == generation
            assert state == read(directory)
        # Rewrites that keep the generation: the unchanged state, a copy of the same file
        # renamed in, the cpus file alone. None is a new state.
        last = await project(writer, CPU_LISTS[19 % len(CPU_LISTS)], mems="19")
        copy = directory / ".copy"
        copy.write_bytes((directory / STATE_FILE).read_bytes())
        copy.rename(directory / STATE_FILE)
        (directory / CPUS_FILE).write_bytes((directory / CPUS_FILE).read_bytes())
        final = await project(writer, "7")
        assert final == last + 1
        assert (await next_state(states)).generation == final
        assert nothing_more(states)


@pytest.mark.anyio
async def test_watch_waits_for_the_directory_to_appear(tmp_path: Path) -> None:
    root = tmp_path / "projection"
    writer = ProjectionWriter(root)
    directory = writer.directory("pod-1", "app")
    async with subscribed(directory) as states:
        await until(watching(tmp_path), "the deepest directory that exists watched")
        root.mkdir()
        await until(watching(root), "the root watched")
        (root / "pod-1").mkdir()
        await until(watching(root / "pod-1"), "the pod directory watched")
        assert nothing_more(states)
        generation = await project(writer, "3")
        assert (await next_state(states)).generation == generation
        generation = await project(writer, "4")
        assert (await next_state(states)).generation == generation


@pytest.mark.anyio
async def test_watch_survives_removal_and_recreation(tmp_path: Path) -> None:
    root = tmp_path / "projection"
    writer = ProjectionWriter(root)
    directory = writer.directory("pod-1", "app")
    await project(writer, "1")
    async with subscribed(directory) as states:
        before = await next_state(states)
        old = directory.stat().st_ino
        await writer.remove_pod("pod-1")
        await until(lambda: old not in watched_inodes(), "the old directory unwatched")
        assert nothing_more(states)
        again = await project(writer, "2")
        assert again != before.generation
        assert (await next_state(states)).cpus == "2"

        # The whole root goes, then comes back.
        old = directory.stat().st_ino
        shutil.rmtree(root)
        await until(
            lambda: old not in watched_inodes() and watching(tmp_path)(),
            "back to watching the nearest parent",
        )
        assert nothing_more(states)
        third = await project(writer, "3")
        assert (await next_state(states)).generation == third


@pytest.mark.anyio
async def test_watch_follows_a_directory_replaced_by_rename(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path)
    directory = writer.directory("pod-1", "app")
    await project(writer, "1")
    other = ProjectionWriter(tmp_path)
    await project(other, "5", name="next")
    async with subscribed(directory) as states:
        await next_state(states)
        old = directory.stat().st_ino
        directory.rename(tmp_path / "pod-1" / "old")  # moved away: the watch must not follow
        await until(lambda: old not in watched_inodes(), "the old directory unwatched")
        (tmp_path / "pod-1" / "next").rename(directory)
        state = await next_state(states)
        assert state.cpus == "5"
        # Writes to the directory it moved away to are not this container's.
        await project(writer, "6", name="old")
        generation = await project(writer, "7")
        assert (await next_state(states)).generation == generation
        assert nothing_more(states)


@pytest.mark.anyio
async def test_watch_through_a_symlink_sees_the_directory_swapped(tmp_path: Path) -> None:
    """Behind a symlink (or a bind mount, inside a container) no parent reports the swap:
    only the directory's own watch does."""
    writer = ProjectionWriter(tmp_path / "projection")
    directory = writer.directory("pod-1", "app")
    await project(writer, "1")
    await project(writer, "5", name="next")
    link = tmp_path / "mine"
    link.symlink_to(directory)
    async with subscribed(link) as states:
        assert (await next_state(states)).cpus == "1"
        # Both renames before the watcher runs again: the link never dangles for it.
        directory.rename(directory.parent / "old")
        (directory.parent / "next").rename(directory)
        assert (await next_state(states)).cpus == "5"
        generation = await project(writer, "6")
        assert (await next_state(states)).generation == generation


@pytest.mark.anyio
async def test_watch_waits_out_files_written_in_place(tmp_path: Path) -> None:
    directory = tmp_path / "app"
    directory.mkdir()
    async with subscribed(directory) as states:
        await until(watching(directory), "the directory watched")
        state_file = directory / STATE_FILE
        state_file.write_bytes(with_(generation=3)[:10])  # created, empty, half: no state
        # A whole file written in place is seen once it is closed.
        state_file.write_bytes(with_(generation=4))
        assert (await next_state(states)).generation == 4
        # A file renamed in, not by cpushim's writer.
        temporary = directory / "tmp"
        temporary.write_bytes(with_(generation=5, cpus="2", isolated=""))
        temporary.rename(state_file)
        state = await next_state(states)
        assert (state.generation, state.cpus) == (5, "2")
        # Damaged in place: waited out, not raised.
        state_file.write_bytes(b"{")
        state_file.write_bytes(with_(generation=6))
        assert (await next_state(states)).generation == 6
        assert nothing_more(states)


@pytest.mark.anyio
async def test_closing_watch_releases_its_descriptor(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path)
    await project(writer, "1")
    before = inotify_fds()
    async with aclosing(watch(writer.directory("pod-1", "app"))) as states:
        await anext(states)
        assert inotify_fds() == before + 1
    assert inotify_fds() == before


# --- importable with the standard library and anyio only ---------------------------------------

IMPORT_CHECK = r"""
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
before = set(sys.modules)
import anyio
from shim.projection import watch

async def first():
    async for state in watch(sys.argv[3]):
        return state.generation

generation = anyio.run(first)
loaded = sorted(set(sys.modules) - before)
tops = {m.split(".")[0] for m in loaded}
foreign = sorted(tops - set(sys.stdlib_module_names) - {"anyio", "shim"})
print(generation, " ".join(m for m in loaded if m.startswith("shim")), "|", " ".join(foreign))
"""


@pytest.mark.anyio
async def test_the_subscriber_needs_only_the_standard_library_and_anyio(tmp_path: Path) -> None:
    writer = ProjectionWriter(tmp_path / "projection")
    generation = await project(writer, "1")
    # A path with anyio and what it depends on, nothing else: no site-packages.
    packages = tmp_path / "site"
    packages.mkdir()
    for name in ("anyio", "idna", "typing_extensions"):
        spec = importlib.util.find_spec(name)
        assert spec is not None
        assert spec.origin is not None
        if spec.submodule_search_locations:
            (packages / name).symlink_to(next(iter(spec.submodule_search_locations)))
        else:
            (packages / Path(spec.origin).name).symlink_to(spec.origin)
    shim_only = tmp_path / "source"
    shim_only.mkdir()
    (shim_only / "shim").symlink_to(REPO / "shim")
    result = await anyio.run_process(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            IMPORT_CHECK,
            str(packages),
            str(shim_only),
            str(writer.directory("pod-1", "app")),
        ],
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    seen, rest = result.stdout.decode().split(" ", 1)
    assert int(seen) == generation
    shim_modules, foreign = rest.split("|")
    assert shim_modules.split() == ["shim", "shim.cpuset", "shim.projection"]
    assert foreign.split() in ([], ["idna"], ["typing_extensions"], ["idna", "typing_extensions"])


# --- where the writer writes from ---------------------------------------------------------------

MOUNTINFO = """\
22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:21 / /run rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,mode=755
26 25 0:22 / /run/lock rw,nosuid shared:6 - tmpfs tmpfs rw
40 25 254:2 / /run/data rw,relatime shared:9 - xfs /dev/vdb rw
41 22 0:30 / /srv/my\\040dir rw shared:10 - ramfs ramfs rw
"""


@pytest.mark.parametrize(
    ("path", "memory"),
    [
        ("/run/cpushim/projection", True),  # made or not, below the tmpfs
        ("/run", True),
        ("/run/data/projection", False),  # a disk mounted below a tmpfs
        ("/runaway", False),  # a prefix of the name is not a parent
        ("/var/lib/cpushim", False),
        ("/srv/my dir/x", True),  # mountinfo escapes spaces as \040
    ],
)
def test_the_writer_writes_inline_only_on_a_memory_file_system(path: str, memory: bool) -> None:
    assert on_memory_fs(Path(path), MOUNTINFO) is memory


def test_this_machines_tmpfs_is_seen(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        require("projection", ["/dev/shm, a tmpfs"])
    assert ProjectionWriter(shm / "cpushim-not-made").inline
    assert ProjectionWriter(tmp_path, inline=False).inline is False


@pytest.mark.anyio
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "thread"])
@pytest.mark.parametrize("name", [STATE_FILE, CPUS_FILE])
async def test_a_fifo_in_a_file_s_place_is_replaced_without_waiting(
    tmp_path: Path, inline: bool, name: str
) -> None:
    # An open without O_NONBLOCK would wait for a writer for ever: inline, on the event loop.
    writer = ProjectionWriter(tmp_path, inline=inline)
    await project(writer, "1")
    fifo = writer.directory("pod-1", "app") / name
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        # Inline, a wait would hold the loop itself: the suite's own timeout ends it.
        with anyio.fail_after(10):
            await project(writer, "2")
    finally:
        if stat.S_ISFIFO(fifo.lstat().st_mode):  # free a thread stuck in open
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert fifo.is_file()
    assert read(writer.directory("pod-1", "app")).cpus == "2"
