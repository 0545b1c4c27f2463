"""Static policy options: kubelet's names, values and refused combinations."""

from __future__ import annotations

import pytest

from shim.policy.options import (
    ALIGN_BY_SOCKET,
    DISTRIBUTE_CPUS_ACROSS_CORES,
    DISTRIBUTE_CPUS_ACROSS_NUMA,
    FULL_PCPUS_ONLY,
    OPTION_NAMES,
    PREFER_ALIGN_CPUS_BY_UNCORECACHE,
    STRICT_CPU_RESERVATION,
    OptionsError,
    StaticPolicyOptions,
)
from tests.harness.sysfs import (
    TWO_SOCKET_FOUR_NUMA,
    XEON_E5_2680_V3_X2,
    MachineSpec,
    expected_topology,
)


def test_names_are_kubelets() -> None:
    assert set(OPTION_NAMES) == {
        "full-pcpus-only",
        "distribute-cpus-across-numa",
        "align-by-socket",
        "distribute-cpus-across-cores",
        "strict-cpu-reservation",
        "prefer-align-cpus-by-uncorecache",
    }
    assert set(OPTION_NAMES.values()) == set(StaticPolicyOptions.__dataclass_fields__)


def test_default_is_all_off() -> None:
    assert StaticPolicyOptions.parse([]) == StaticPolicyOptions()
    assert StaticPolicyOptions().enabled == frozenset()
    assert str(StaticPolicyOptions()) == "(none)"


@pytest.mark.parametrize("name", sorted(OPTION_NAMES))
def test_each_name_switches_on_its_flag(name: str) -> None:
    options = StaticPolicyOptions.parse([name])
    assert options.enabled == {name}
    assert getattr(options, OPTION_NAMES[name]) is True


def test_list_form_and_duplicates() -> None:
    options = StaticPolicyOptions.parse([FULL_PCPUS_ONLY, STRICT_CPU_RESERVATION, FULL_PCPUS_ONLY])
    assert options == StaticPolicyOptions(full_pcpus_only=True, strict_cpu_reservation=True)
    assert str(options) == "full-pcpus-only,strict-cpu-reservation"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", True),
        ("True", True),
        ("TRUE", True),
        ("1", True),
        ("t", True),
        ("T", True),
        ("false", False),
        ("False", False),
        ("FALSE", False),
        ("0", False),
        ("f", False),
    ],
)
def test_map_form_follows_go_parsebool(value: str, expected: bool) -> None:
    options = StaticPolicyOptions.parse({FULL_PCPUS_ONLY: value})
    assert options.full_pcpus_only is expected


@pytest.mark.parametrize("value", ["yes", "", "on", "tRuE", "2"])
def test_map_form_rejects_bad_values(value: str) -> None:
    with pytest.raises(OptionsError, match=f"bad value {value!r} for option 'full-pcpus-only'"):
        StaticPolicyOptions.parse({FULL_PCPUS_ONLY: value})


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(OptionsError) as caught:
        StaticPolicyOptions.parse(["full-pcpus"])
    message = str(caught.value)
    assert "unknown CPU manager policy option 'full-pcpus'" in message
    for name in OPTION_NAMES:
        assert name in message


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (FULL_PCPUS_ONLY, DISTRIBUTE_CPUS_ACROSS_CORES),
        (DISTRIBUTE_CPUS_ACROSS_NUMA, DISTRIBUTE_CPUS_ACROSS_CORES),
        (PREFER_ALIGN_CPUS_BY_UNCORECACHE, DISTRIBUTE_CPUS_ACROSS_CORES),
        (PREFER_ALIGN_CPUS_BY_UNCORECACHE, DISTRIBUTE_CPUS_ACROSS_NUMA),
    ],
)
def test_refused_combinations(first: str, second: str) -> None:
    message = f"{first} and {second} can not be used at the same time"
    with pytest.raises(OptionsError, match=message):
        StaticPolicyOptions.parse([first, second])
    with pytest.raises(OptionsError, match=message):
        StaticPolicyOptions(**{OPTION_NAMES[first]: True, OPTION_NAMES[second]: True})
    # Switched off in the map form, the pair is fine.
    StaticPolicyOptions.parse({first: "true", second: "false"})


@pytest.mark.parametrize(
    "names",
    [
        [FULL_PCPUS_ONLY, PREFER_ALIGN_CPUS_BY_UNCORECACHE],
        [FULL_PCPUS_ONLY, DISTRIBUTE_CPUS_ACROSS_NUMA, ALIGN_BY_SOCKET, STRICT_CPU_RESERVATION],
        [DISTRIBUTE_CPUS_ACROSS_CORES, STRICT_CPU_RESERVATION, ALIGN_BY_SOCKET],
        [PREFER_ALIGN_CPUS_BY_UNCORECACHE, ALIGN_BY_SOCKET, STRICT_CPU_RESERVATION],
    ],
)
def test_accepted_combinations(names: list[str]) -> None:
    assert StaticPolicyOptions.parse(names).enabled == set(names)


def test_align_by_socket_against_the_machine() -> None:
    options = StaticPolicyOptions(align_by_socket=True)
    options.check_topology(expected_topology(XEON_E5_2680_V3_X2))
    options.check_topology(expected_topology(TWO_SOCKET_FOUR_NUMA))
    one_node = expected_topology(MachineSpec(sockets=2, cores_per_die=2, sockets_per_numa=2))
    with pytest.raises(OptionsError, match="needs at least as many NUMA nodes as sockets"):
        options.check_topology(one_node)
    with pytest.raises(OptionsError, match="single-numa-node is incompatible"):
        options.check_topology(expected_topology(XEON_E5_2680_V3_X2), "single-numa-node")
    # Without align-by-socket neither matters.
    StaticPolicyOptions().check_topology(one_node, "single-numa-node")
