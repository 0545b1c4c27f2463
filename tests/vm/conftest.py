"""Fixtures for the VM tests: prerequisites, the cached guest assets and the session payload.

Prerequisites: root (debootstrap, and 9p passthrough of root-owned files), QEMU, debootstrap
and Debian's apt tools. Off CI a missing one skips these tests with the reason; with
``CI=true`` it is an error, so a CI machine cannot pass them by skipping.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.prerequisites import require
from tests.vm.assets import AssetError, GuestAssets, StageTimes, build_payload, guest_assets
from tests.vm.machine import Guest, GuestRun, missing_host_tools
from tests.vm.topologies import TOPOLOGIES

STAGE_TIMES = StageTimes()


def missing_prerequisites() -> list[str]:
    missing: list[str] = []
    if platform.machine() != "x86_64":
        missing.append(f"an x86_64 host (this is {platform.machine()})")
    if os.geteuid() != 0:
        missing.append("root (debootstrap and the 9p root need it)")
    return missing + missing_host_tools()


@pytest.fixture(scope="session")
def vm_prerequisites() -> None:
    require("VM", missing_prerequisites())


@pytest.fixture(scope="session")
def vm_assets(vm_prerequisites: None) -> GuestAssets:
    try:
        return guest_assets(STAGE_TIMES)
    except AssetError as error:
        pytest.fail(f"building the guest failed: {error}", pytrace=False)


@pytest.fixture(scope="session")
def vm_payload(vm_prerequisites: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    with STAGE_TIMES.stage("payload (wheel of the checkout)"):
        try:
            return build_payload(tmp_path_factory.mktemp("vm-payload"))
        except AssetError as error:
            pytest.fail(f"building the payload failed: {error}", pytrace=False)


# A guest keeps about one host CPU busy (its workload is one chain of processes), so guests
# run side by side: on a 2-CPU host, three guests at once finish in about half the time of
# three in a row. CPUSHIM_VM_PARALLEL caps how many run at once.
# A watchdog for a hung guest, not a speed target: three guests side by side took 720-820 s
# each in CI on these 2-CPU hosts (2026-11-27; the systemd guest longest, since a pinned
# create there records each shared container's shrink with a runc update at once), and a
# slow host adds half as much again.
GUEST_BUDGET_SECONDS = 1500.0


class Guests:
    """The session's guests, one per selected topology, started as early as the cap allows;
    each test collects its own guest's result."""

    def __init__(self, guests: list[Guest], parallel: int) -> None:
        self.pending = list(guests)
        self.running: list[Guest] = []
        self.parallel = max(1, parallel)
        self.by_name = {guest.topology.name: guest for guest in guests}
        self._fill()

    def _fill(self) -> None:
        while self.pending and len(self.running) < self.parallel:
            guest = self.pending.pop(0)
            guest.start()
            self.running.append(guest)

    def result(self, name: str) -> GuestRun:
        guest = self.by_name[name]
        while guest in self.pending:
            # Make room: the oldest running guest is the one expected to end first.
            self.running[0].result()
            self.running.pop(0)
            self._fill()
        run = guest.result()
        if guest in self.running:
            self.running.remove(guest)
            self._fill()
        return run


def selected_topologies(session: pytest.Session) -> list[str]:
    names: list[str] = []
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and item.path.parent == Path(__file__).parent:
            name = callspec.params.get("topology_name")
            if name in TOPOLOGIES and name not in names:
                names.append(str(name))
    return names


@pytest.fixture(scope="session")
def vm_guests(
    request: pytest.FixtureRequest,
    vm_assets: GuestAssets,
    vm_payload: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Guests]:
    names = selected_topologies(request.session)
    results = tmp_path_factory.mktemp("vm-guests")
    guests = [
        Guest(TOPOLOGIES[name], vm_assets, vm_payload, results / name, GUEST_BUDGET_SECONDS)
        for name in names
    ]
    parallel = int(os.environ.get("CPUSHIM_VM_PARALLEL", str(len(guests))))
    try:
        instance = Guests(guests, parallel)
        yield instance
    finally:
        for guest in guests:
            guest.kill()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not STAGE_TIMES.seconds:
        return
    terminalreporter.section("VM stages (wall clock)")
    for name, seconds in STAGE_TIMES.seconds.items():
        terminalreporter.write_line(f"{name:<40} {seconds:7.1f} s")
    sys.stdout.flush()
