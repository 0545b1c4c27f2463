"""Runs inside a test guest (started by tests/vm/guest-init.sh): the scenarios under pytest,
their JUnit report and timings written to the results directory the host reads back.

    python3 -m tests.vm.guest_runner RESULTS_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).with_name("guest_scenarios.py")


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


class ReportFailuresAtOnce:
    """Prints a failing scenario's report as soon as it fails, not at the end: a guest the
    host's watchdog kills still leaves the reason on its console."""

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            print(f"\n--- {report.nodeid} failed ({report.when}):\n{report.longreprtext}")
            sys.stdout.flush()


def main(argv: list[str]) -> int:
    results = Path(argv[1])
    os.environ["CPUSHIM_VM_RESULTS"] = str(results)
    started = uptime()
    code = pytest.main(
        [
            str(SCENARIOS),
            "-v",
            "--color=no",
            "-rfE",
            "--durations=0",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:hypothesispytest",
            "--rootdir",
            str(SCENARIOS.parent),
            "--junitxml",
            str(results / "junit.xml"),
            "-o",
            "junit_family=xunit2",
            "--timeout",
            "300",
        ],
        plugins=[ReportFailuresAtOnce()],
    )
    timings = {"userspace_started": started, "scenarios": uptime() - started}
    (results / "timings.json").write_text(json.dumps(timings))
    keep_logs(Path(tempfile.gettempdir()), results / "logs")
    return int(code)


def keep_logs(scratch: Path, destination: Path) -> None:
    """containerd's and each cpushim's logs, which live on the guest's tmpfs and would go
    with it: copied next to the results, named by their path."""
    destination.mkdir(exist_ok=True)
    for log in scratch.rglob("*.log"):
        if log.is_file() and "pod-logs" not in log.parts:
            name = "_".join(log.relative_to(scratch).parts)
            shutil.copyfile(log, destination / name)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
