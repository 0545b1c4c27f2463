"""cpushim on emulated multi-socket NUMA machines: one QEMU guest per topology runs every
scenario of tests/vm/guest_scenarios.py against its own kernel, containerd and runc.

Each test passes only when the guest ran every scenario in that file and each one passed;
a guest that hangs is killed by the watchdog and its console is quoted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.vm.conftest import GUEST_BUDGET_SECONDS, STAGE_TIMES, Guests
from tests.vm.machine import GuestRun
from tests.vm.topologies import TOPOLOGIES

pytestmark = pytest.mark.vm

SCENARIO_FILE = Path(__file__).with_name("guest_scenarios.py")


def scenario_names() -> list[str]:
    tree = ast.parse(SCENARIO_FILE.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]


def describe(run: GuestRun) -> str:
    lines = [f"guest {run.topology.name}: {run.seconds:.0f} s, results in {run.results}"]
    for scenario in run.scenarios:
        lines.append(f"  {scenario.outcome:<7} {scenario.seconds:6.1f} s  {scenario.name}")
        if scenario.message:
            lines += ["    " + line for line in scenario.message.splitlines()[-25:]]
    return "\n".join(lines)


def test_scenario_file_has_scenarios() -> None:
    assert len(scenario_names()) >= 8


@pytest.mark.timeout(2 * GUEST_BUDGET_SECONDS + 900)
@pytest.mark.parametrize("topology_name", list(TOPOLOGIES))
def test_every_scenario_passes_in_the_guest(topology_name: str, vm_guests: Guests) -> None:
    name = topology_name
    with STAGE_TIMES.stage(f"waiting for guest {name}"):
        run = vm_guests.result(name)
    STAGE_TIMES.seconds[f"guest {name} (boot to power-off)"] = run.seconds
    print(describe(run))
    if run.timed_out:
        pytest.fail(
            f"guest {name} still ran after {run.seconds:.0f} s and was killed;"
            f" console:\n{run.console_tail()}\n{describe(run)}",
            pytrace=False,
        )
    if run.exit_code is None:
        pytest.fail(
            f"guest {name} ended without a result; console:\n{run.console_tail()}",
            pytrace=False,
        )
    ran = {scenario.name: scenario.outcome for scenario in run.scenarios}
    expected = {scenario: "passed" for scenario in scenario_names()}
    if ran != expected or run.exit_code != 0:
        pytest.fail(
            f"{describe(run)}\nguest pytest exit code {run.exit_code}; console:\n"
            f"{run.console_tail()}",
            pytrace=False,
        )
