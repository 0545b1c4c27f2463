"""Boot one guest for a topology under QEMU's TCG, let it run the scenarios, read the results.

The guest shares four host directories over virtio-9p: the cached root (read-only), the
cached Python packages (read-only), the session's payload (read-only) and a results
directory of its own (writable). Its serial console goes to ``console.log`` in the results
directory. A watchdog kills QEMU when the guest outlives its time budget, so a hung guest
fails its test and never the CI run's budget.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from tests.harness.images import ImageBuildError, find_busybox
from tests.vm.assets import GuestAssets
from tests.vm.topologies import Topology

QEMU = "qemu-system-x86_64"
PR_SET_PDEATHSIG = 1
QBOOT = Path("/usr/share/qemu/qboot.rom")
KERNEL_COMMAND_LINE = (
    # panic=-1 reboots at once on a panic (a dying init included), which ends QEMU.
    "console=ttyS0 panic=-1 mitigations=off quiet loglevel=4 rdinit=/init"
)


def missing_host_tools() -> list[str]:
    missing = [
        f"{tool} on PATH (Debian: {package})"
        for tool, package in (
            (QEMU, "qemu-system-x86"),
            ("debootstrap", "debootstrap"),
            ("apt-get", "apt"),
            ("dpkg-deb", "dpkg"),
        )
        if shutil.which(tool) is None
    ]
    if not QBOOT.exists():
        missing.append(f"{QBOOT} (Debian: qemu-system-data)")
    try:
        find_busybox()
    except ImageBuildError as error:
        missing.append(str(error))
    return missing


def kernel_command_line(topology: Topology) -> str:
    """Read by guest-init.sh: which cgroup hierarchy to mount, or, for the systemd driver,
    that systemd is PID 1 (it mounts the hierarchy the ``systemd.`` switch names)."""
    line = f"{KERNEL_COMMAND_LINE} cpushim.cgroup={topology.cgroup_version}"
    if topology.cgroup_driver == "systemd":
        unified = 1 if topology.cgroup_version == 2 else 0
        line += f" cpushim.init=systemd systemd.unified_cgroup_hierarchy={unified}"
    return line


def qemu_command(
    topology: Topology, assets: GuestAssets, payload: Path, results: Path
) -> list[str]:
    def share(tag: str, path: Path, *, readonly: bool) -> list[str]:
        options = f"local,path={path},mount_tag={tag},security_model=passthrough"
        options += ",multidevs=remap" + (",readonly=on" if readonly else "")
        return ["-virtfs", options]

    return [
        QEMU,
        "-machine",
        "pc",
        # One host thread runs all of a guest's vCPUs. With a thread per vCPU, guests side
        # by side put dozens of vCPU threads on the host's two CPUs, and a vCPU spinning on a
        # lock whose holder's thread is descheduled can stall a guest's boot for minutes.
        "-accel",
        "tcg,thread=single",
        *topology.qemu_arguments(),
        "-bios",
        str(QBOOT),
        "-kernel",
        str(assets.kernel),
        "-initrd",
        str(assets.initramfs),
        "-append",
        kernel_command_line(topology),
        *share("root", assets.root, readonly=True),
        *share("deps", assets.deps, readonly=True),
        *share("payload", payload, readonly=True),
        *share("results", results, readonly=False),
        "-nodefaults",
        "-display",
        "none",
        "-serial",
        f"file:{results / 'console.log'}",
        "-no-reboot",
    ]


# The churn scenario's seed, when a run asks for one (to replay a failure it printed).
CHURN_SEED_VARIABLE = "CPUSHIM_VM_CHURN_SEED"
CHURN_SEED_FILE = "churn-seed"


def churn_seed_asked() -> int | None:
    """The seed ``CPUSHIM_VM_CHURN_SEED`` asks the guests' churn scenario to use, if any."""
    value = os.environ.get(CHURN_SEED_VARIABLE, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{CHURN_SEED_VARIABLE}={value!r}: the seed a churn run printed, an integer"
        ) from None


@dataclass
class ScenarioResult:
    name: str
    outcome: str  # "passed", "failed", "error" or "skipped"
    seconds: float
    message: str = ""


@dataclass
class GuestRun:
    topology: Topology
    results: Path
    exit_code: int | None  # the guest's pytest exit code; None if it never wrote one
    timed_out: bool
    seconds: float
    scenarios: list[ScenarioResult] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def console_tail(self, lines: int = 60) -> str:
        try:
            text = (self.results / "console.log").read_text(errors="replace")
        except OSError:
            return "(no console output)"
        return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:
    """In the QEMU child before exec: the kernel kills it when pytest dies, so a cancelled
    run (SIGTERM, SIGKILL) leaves no guest running on the machine."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


_T = TypeVar("_T")


def _read_or_none(path: Path, parse: Callable[[str], _T]) -> _T | None:
    """A result file, or None when it is missing or torn (a guest killed mid-write)."""
    try:
        return parse(path.read_text())
    except (OSError, ValueError):
        return None


def read_junit(path: Path) -> list[ScenarioResult]:
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return []
    scenarios: list[ScenarioResult] = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = "failed" if kind == "failure" else kind
                message = (element.get("message") or "") + "\n" + (element.text or "")
                break
        scenarios.append(
            ScenarioResult(
                case.get("name", "?"), outcome, float(case.get("time", "0")), message.strip()
            )
        )
    return scenarios


class Guest:
    """One booting or booted guest: :meth:`start` returns at once, :meth:`result` waits
    (at most until ``budget`` seconds after the start, then kills QEMU)."""

    def __init__(
        self, topology: Topology, assets: GuestAssets, payload: Path, results: Path, budget: float
    ) -> None:
        self.topology = topology
        self.results = results
        self.budget = budget
        self.command = qemu_command(topology, assets, payload, results)
        self._process: subprocess.Popen[bytes] | None = None
        self._started = 0.0
        self._started_wall = 0.0
        self._run: GuestRun | None = None

    def start(self) -> None:
        self.results.mkdir(parents=True, exist_ok=True)
        (self.results / "topology.json").write_text(json.dumps(self.topology.to_json()))
        (self.results / "qemu-command").write_text(shlex.join(self.command) + "\n")
        seed = churn_seed_asked()
        if seed is not None:
            (self.results / CHURN_SEED_FILE).write_text(f"{seed}\n")
        self._started = time.monotonic()
        self._started_wall = time.time()
        with (self.results / "qemu.log").open("wb") as log:
            self._process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_die_with_parent,
            )

    def result(self) -> GuestRun:
        if self._run is not None:
            return self._run
        process = self._process
        if process is None:
            raise RuntimeError(f"guest {self.topology.name} was never started")
        timed_out = False
        try:
            process.wait(timeout=max(0.0, self._started + self.budget - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            process.kill()
            process.wait()
        seconds = time.monotonic() - self._started
        exit_file = self.results / "exit-code"
        exit_code = _read_or_none(exit_file, int)
        if exit_code is not None:
            # The guest may have ended well before anyone asked: its last write tells when.
            seconds = min(seconds, exit_file.stat().st_mtime - self._started_wall)
        timings = _read_or_none(self.results / "timings.json", json.loads) or {}
        self._run = GuestRun(
            self.topology,
            self.results,
            exit_code,
            timed_out,
            seconds,
            read_junit(self.results / "junit.xml"),
            {str(k): float(v) for k, v in timings.items()},
        )
        return self._run

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
