"""The inotify adapter: one kernel watch per path, many subscribers, events read straight."""

from __future__ import annotations

import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shim import inotify
from shim.inotify import Event, Inotify, parse_events
from tests.unit.engine_env import until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def watcher() -> AsyncIterator[Inotify]:
    overflows: list[None] = []
    watching = Inotify(on_overflow=lambda: overflows.append(None))
    watching.start()
    yield watching
    watching.close()


async def test_two_subscribers_share_one_kernel_watch(watcher: Inotify, tmp_path: Path) -> None:
    writes: list[Event] = []
    removals: list[Event] = []
    first = watcher.subscribe(str(tmp_path), inotify.IN_CLOSE_WRITE, writes.append)
    watcher.subscribe(str(tmp_path), inotify.IN_DELETE, removals.append)
    assert watcher.watch_count == 1
    assert watcher.subscription_count == 2

    (tmp_path / "a").write_text("x")
    (tmp_path / "a").unlink()
    await until(lambda: bool(writes and removals), "a write and a removal seen")
    assert [e.name for e in writes] == ["a"]
    assert [e.name for e in removals] == ["a"]

    watcher.unsubscribe(first)
    assert watcher.watch_count == 1
    (tmp_path / "b").write_text("x")
    (tmp_path / "b").unlink()
    await until(lambda: len(removals) == 2, "the second removal seen")
    assert [e.name for e in writes] == ["a"]


async def test_every_rename_is_delivered(watcher: Inotify, tmp_path: Path) -> None:
    arrived: list[str] = []
    # Both halves: the kernel merges a queued event with an identical one before it, and two
    # IN_MOVED_TO of the same name differ only in the cookie, which it does not compare.
    watcher.subscribe(
        str(tmp_path),
        inotify.IN_MOVED_FROM | inotify.IN_MOVED_TO,
        lambda e: arrived.append(e.name) if e.mask & inotify.IN_MOVED_TO else None,
    )
    # As cpushim writes its checkpoint and projections: a temporary file renamed over the
    # real one, many times.
    for index in range(300):
        temporary = tmp_path / f".state.json.{index}.tmp"
        temporary.write_text(str(index))
        os.replace(temporary, tmp_path / "state.json")
    await until(lambda: len(arrived) == 300, "every rename seen")
    assert set(arrived) == {"state.json"}


async def test_the_last_unsubscribe_drops_the_kernel_watch(
    watcher: Inotify, tmp_path: Path
) -> None:
    subscription = watcher.subscribe(str(tmp_path), inotify.IN_CREATE, lambda e: None)
    watcher.unsubscribe(subscription)
    assert watcher.watch_count == 0
    assert watcher.subscription_count == 0


async def test_a_missing_path_is_a_watch_error(watcher: Inotify, tmp_path: Path) -> None:
    with pytest.raises(inotify.WatchError, match="cannot watch"):
        watcher.subscribe(str(tmp_path / "absent"), inotify.IN_CREATE, lambda e: None)
    assert watcher.watch_count == 0


async def test_a_removed_directory_drops_its_watch(watcher: Inotify, tmp_path: Path) -> None:
    directory = tmp_path / "cgroup"
    directory.mkdir()
    seen: list[Event] = []
    watcher.subscribe(str(directory), inotify.IN_CREATE, seen.append)
    directory.rmdir()
    await until(lambda: any(e.mask & inotify.IN_IGNORED for e in seen), "the watch dropped")
    assert watcher.watch_count == 0
    # Watched again once it is back, under a new kernel watch.
    directory.mkdir()
    watcher.subscribe(str(directory), inotify.IN_CREATE, seen.append)
    (directory / "cpuset.cpus").write_text("0")
    await until(lambda: any(e.name == "cpuset.cpus" for e in seen), "the new watch works")


@pytest.mark.parametrize("dropped", ["link", "real"])
async def test_two_names_of_one_directory_share_its_watch(
    watcher: Inotify, tmp_path: Path, dropped: str
) -> None:
    """The kernel keeps one watch per inode: a second name's add_watch returns the first's
    descriptor, and replaces its mask."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    seen: dict[str, list[Event]] = {"real": [], "link": []}
    subscriptions = {
        "real": watcher.subscribe(str(real), inotify.IN_CLOSE_WRITE, seen["real"].append),
        "link": watcher.subscribe(str(link), inotify.IN_DELETE, seen["link"].append),
    }
    assert watcher.watch_count == 1
    (real / "a").write_text("x")
    (real / "a").unlink()
    await until(lambda: bool(seen["real"] and seen["link"]), "the write and the removal seen")
    assert [(e.path, e.name) for e in seen["real"]] == [(str(real), "a")]
    assert [(e.path, e.name) for e in seen["link"]] == [(str(link), "a")]

    watcher.unsubscribe(subscriptions[dropped])  # the other name still needs the watch
    kept = "real" if dropped == "link" else "link"
    assert watcher.watch_count == 1
    (real / "b").write_text("x")
    (real / "b").unlink()
    await until(lambda: len(seen[kept]) == 2, "the kept name's event seen")
    watcher.unsubscribe(subscriptions[kept])
    assert watcher.watch_count == 0


async def test_a_removed_directory_drops_every_name_of_its_watch(
    watcher: Inotify, tmp_path: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    seen: list[Event] = []
    watcher.subscribe(str(real), inotify.IN_CREATE, seen.append)
    watcher.subscribe(str(tmp_path / "link"), inotify.IN_CREATE, seen.append)
    real.rmdir()
    await until(lambda: sum(bool(e.mask & inotify.IN_IGNORED) for e in seen) == 2, "dropped")
    assert watcher.watch_count == watcher.subscription_count == 0
    real.mkdir()
    watcher.subscribe(str(tmp_path / "link"), inotify.IN_CREATE, seen.append)
    (real / "x").write_text("")
    await until(lambda: any(e.name == "x" for e in seen), "watched again by its other name")


def test_events_are_parsed_with_their_padded_names() -> None:
    def raw(wd: int, mask: int, name: bytes, padded: int) -> bytes:
        return struct.pack("iIII", wd, mask, 7, padded) + name.ljust(padded, b"\0")

    data = raw(1, inotify.IN_MOVED_TO, b"state.json", 16) + raw(-1, inotify.IN_Q_OVERFLOW, b"", 0)
    assert parse_events(data) == [
        (1, inotify.IN_MOVED_TO, "state.json"),
        (-1, inotify.IN_Q_OVERFLOW, ""),
    ]
