"""The static policy: topology-aware best fit, reserved CPUs, the shared pool, isolcpus.

Expected sets are derived from the rules in docs/allocator.md; several cases mirror the
results kubelet's own tests expect for the same machine shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from shim.cpuset import CPUSet
from shim.policy import take
from shim.policy.options import OptionsError, StaticPolicyOptions
from shim.policy.reserved import ReservedCPUsError, reserved_cpus
from shim.policy.static import (
    AllocationError,
    ExclusiveRequest,
    IsolatedMode,
    SMTAlignmentError,
    StaticPolicy,
    take_by_topology,
)
from shim.topology import Topology
from tests.harness.sysfs import (
    AMD_EPYC_LIKE,
    OFFLINE_NONCONTIGUOUS,
    PROPERTY_SETTINGS,
    SINGLE_SOCKET_NO_HT,
    TWO_SOCKET_FOUR_NUMA,
    XEON_E5_2680_V3_X2,
    MachineSpec,
    expected_topology,
)

XEON = expected_topology(XEON_E5_2680_V3_X2)
NO_HT = expected_topology(SINGLE_SOCKET_NO_HT)
FOUR_NUMA = expected_topology(TWO_SOCKET_FOUR_NUMA)
EPYC = expected_topology(AMD_EPYC_LIKE)
GAPS = expected_topology(OFFLINE_NONCONTIGUOUS)
# kubelet's test shapes: "dual socket HT" (socket 0 = even ids, siblings n and n+6) and
# "dual socket, multi NUMA per socket, HT" (80 CPUs, 4 NUMA nodes, siblings n and n+40).
DUAL_HT = expected_topology(
    MachineSpec(
        sockets=2,
        cores_per_die=3,
        threads_per_core=2,
        cpu_ids=(0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11),
    )
)
MULTI_NUMA_80 = expected_topology(
    MachineSpec(sockets=2, cores_per_die=20, threads_per_core=2, numa_per_socket=2)
)
SINGLE_HT = expected_topology(MachineSpec(sockets=1, cores_per_die=4, threads_per_core=2))

PACKED = StaticPolicyOptions()
FULL = StaticPolicyOptions(full_pcpus_only=True)
NUMA = StaticPolicyOptions(distribute_cpus_across_numa=True)
NUMA_FULL = StaticPolicyOptions(distribute_cpus_across_numa=True, full_pcpus_only=True)
SPREAD = StaticPolicyOptions(distribute_cpus_across_cores=True)
UNCORE = StaticPolicyOptions(prefer_align_cpus_by_uncorecache=True)

P = CPUSet.parse


@pytest.mark.parametrize(
    ("name", "topology", "available", "count", "options", "expected"),
    [
        # Packed best fit on the 2 x 12-core Xeon (siblings n, n+24).
        ("one thread", XEON, P("0-47"), 1, PACKED, "0"),
        ("two threads: one whole core", XEON, P("0-47"), 2, PACKED, "0,24"),
        ("three: a core then a thread on the same socket", XEON, P("0-47"), 3, PACKED, "0-1,24"),
        ("a socket's worth: the whole socket", XEON, P("0-47"), 24, PACKED, "0-11,24-35"),
        ("socket plus a core", XEON, P("0-47"), 26, PACKED, "0-12,24-36"),
        ("everything", XEON, P("0-47"), 48, PACKED, "0-47"),
        ("fill the partly used core first", XEON, P("1-47"), 1, PACKED, "24"),
        ("prefer the busier socket", XEON, P("1-23,25-47"), 2, PACKED, "1,25"),
        ("free socket is taken whole", XEON, P("1-47"), 24, PACKED, "12-23,36-47"),
        ("kubelet: single socket HT, some taken", SINGLE_HT, P("1,3,5-7"), 1, PACKED, "6"),
        ("no HT: lowest ids", NO_HT, P("0-7"), 3, PACKED, "0-2"),
        # Two sockets with two NUMA nodes each: sockets are taken whole first, then nodes.
        ("4 NUMA: a node's worth", FOUR_NUMA, P("0-39"), 10, PACKED, "0-4,20-24"),
        ("4 NUMA: node plus a core", FOUR_NUMA, P("0-39"), 12, PACKED, "0-5,20-25"),
        ("4 NUMA: a socket's worth", FOUR_NUMA, P("0-39"), 20, PACKED, "0-9,20-29"),
        ("4 NUMA: socket plus node", FOUR_NUMA, P("0-39"), 30, PACKED, "0-14,20-34"),
        # The fullest group cannot hold the request: the best fit among those that can.
        ("4 NUMA: 3 into one node", FOUR_NUMA, P("4-19,24-39"), 3, PACKED, "5-6,25"),
        ("socket with one core left", XEON, P("0,12-24,36-47"), 3, PACKED, "12-13,36"),
        ("full cores into one node", FOUR_NUMA, P("4-19,24-39"), 4, FULL, "5-6,25-26"),
        # ... but a result already inside one node stays as best fit made it: whole cores
        # elsewhere beat lone threads, and a whole L3 group beats two halves.
        ("one node already: whole core", FOUR_NUMA, P("0-1,5-19,25-39"), 2, PACKED, "5,25"),
        ("one node already: cores", FOUR_NUMA, P("0-3,5-19,25-39"), 4, PACKED, "5-6,25-26"),
        ("one node already: one L3", EPYC, P("3-12,64-127"), 8, UNCORE, "64-71"),
        (
            "nothing holds 14: packed",
            FOUR_NUMA,
            P("4-9,24-29,35-39"),
            14,
            PACKED,
            "4-9,24-29,35-36",
        ),
        # Consecutive sibling ids (AMD numbering).
        ("amd: one whole core", EPYC, EPYC.online, 2, PACKED, "0-1"),
        ("amd: packed crosses an L3 boundary", EPYC, EPYC.online - P("0-5"), 4, PACKED, "6-9"),
        # full-pcpus-only: whole cores, never the sibling of a taken thread.
        ("full cores skip a half-used core", XEON, P("1-47"), 2, FULL, "1,25"),
        ("full cores: four", XEON, P("1-47"), 4, FULL, "1-2,25-26"),
        # distribute-cpus-across-cores: one thread per core first, group by group.
        ("spread: one thread per core", XEON, P("0-47"), 3, SPREAD, "0-2"),
        ("spread: amd numbering", EPYC, EPYC.online, 3, SPREAD, "0,2,4"),
        ("spread: kubelet dual socket, 3", DUAL_HT, P("0-11"), 3, SPREAD, "0,2,4"),
        ("spread: kubelet dual socket, 8", DUAL_HT, P("0-11"), 8, SPREAD, "0-4,6,8,10"),
        ("spread: second threads last", XEON, P("0-47"), 14, SPREAD, "0-11,24-25"),
        # prefer-align-cpus-by-uncorecache: keep the request inside one L3 group.
        ("uncore: fits one L3 group", EPYC, EPYC.online - P("0-5"), 4, UNCORE, "8-11"),
        ("uncore: fullest group that fits", EPYC, EPYC.online - P("0-3,8-13"), 2, UNCORE, "14-15"),
        ("uncore: whole groups then a partial", EPYC, EPYC.online, 10, UNCORE, "0-9"),
        ("uncore: two whole groups", EPYC, EPYC.online - P("0"), 16, UNCORE, "8-23"),
        # distribute-cpus-across-numa (kubelet's takeByTopologyNUMADistributed cases).
        ("numa: 12 over two nodes", FOUR_NUMA, P("0-39"), 12, NUMA, "0-2,5-7,20-22,25-27"),
        ("numa: balance picks the emptier node", DUAL_HT, P("1-5,7-11"), 1, NUMA, "1"),
        ("numa: kubelet 8 on dual socket", DUAL_HT, P("0-11"), 8, NUMA, "0-3,6-9"),
        ("numa: 26 over 2", MULTI_NUMA_80, P("0-79"), 26, NUMA, "0-6,10-16,40-45,50-55"),
        ("numa: 26 in cores", MULTI_NUMA_80, P("0-79"), 26, NUMA_FULL, "0-6,10-15,40-46,50-55"),
        (
            "numa: 62 with spill-over to 0 and 1",
            MULTI_NUMA_80,
            P("0-79"),
            62,
            NUMA,
            "0-7,10-17,20-27,30-37,40-47,50-57,60-66,70-76",
        ),
        (
            "numa: spill-over keeps balance",
            MULTI_NUMA_80,
            P("0-8,10-18,20-39,40-48,50-58,60-79"),
            62,
            NUMA,
            "0-7,10-17,20-27,30-37,40-46,50-56,60-67,70-77",
        ),
        (
            "numa: spill-over in cores keeps balance",
            MULTI_NUMA_80,
            P("0-8,10-18,20-39,40-48,50-58,60-79"),
            62,
            NUMA_FULL,
            "0-7,10-16,20-27,30-37,40-47,50-56,60-67,70-77",
        ),
        (
            "numa: remainder only where it fits",
            MULTI_NUMA_80,
            P("0-3,10-13,20-23,30-36,40-43,50-53,60-63,70-76"),
            34,
            NUMA,
            "0-3,10-13,20-23,30-34,40-43,50-53,60-63,70-74",
        ),
        (
            "numa: last 3 nodes for balance",
            MULTI_NUMA_80,
            P("2-29,31-39,42-69,71-79"),
            48,
            NUMA,
            "10-17,20-27,31-38,50-57,60-67,71-78",
        ),
        ("numa: small request stays in one node", XEON, P("0-47"), 3, NUMA, "0-1,24"),
        # Cores 5 and 7 each lost a sibling to offlining: they count as half-used cores.
        ("offline siblings: lone threads first", GAPS, P("6-7,21-22"), 1, PACKED, "7"),
        ("offline siblings: whole core", GAPS, P("6-7,21-22"), 2, PACKED, "6,22"),
    ],
)
def test_take_by_topology(
    name: str,
    topology: Topology,
    available: CPUSet,
    count: int,
    options: StaticPolicyOptions,
    expected: str,
) -> None:
    assert str(take_by_topology(topology, available, count, options=options)) == expected


def test_take_zero_and_negative() -> None:
    assert take_by_topology(XEON, XEON.online, 0) == CPUSet()
    with pytest.raises(ValueError, match="negative"):
        take_by_topology(XEON, XEON.online, -1)


def test_take_more_than_available() -> None:
    with pytest.raises(AllocationError, match="cannot allocate 49 CPUs: only 48 available"):
        take_by_topology(XEON, XEON.online, 49)
    with pytest.raises(AllocationError, match="only 0 available"):
        take_by_topology(XEON, CPUSet(), 1)
    # Offline CPUs in `available` do not count.
    with pytest.raises(AllocationError, match=r"only 1 available \(4\)"):
        take_by_topology(GAPS, P("4-5,23"), 3)


def test_full_pcpus_only_errors() -> None:
    with pytest.raises(SMTAlignmentError, match=r"3 CPUs requested.*multiple of 2 CPUs per core"):
        take_by_topology(XEON, XEON.online, 3, options=FULL)
    # 4 free threads but only one whole core among them.
    with pytest.raises(SMTAlignmentError, match="4 CPUs requested but only 2 CPUs in whole"):
        take_by_topology(XEON, P("0-2,24"), 4, options=FULL)


# -- reserved CPUs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topology", "count", "expected"),
    [
        (XEON, 1, "0"),
        (XEON, 2, "0,24"),
        (XEON, 3, "0-1,24"),
        (XEON, 4, "0-1,24-25"),
        (NO_HT, 2, "0-1"),
        (FOUR_NUMA, 10, "0-4,20-24"),
        # Lowest-numbered cores even where kubelet's best fit would pick the socket with fewer
        # usable CPUs (offline, isolated): the system's CPUs stay at the bottom of the map.
        (GAPS, 2, "0,16"),
        (GAPS, 3, "0-1,16"),
    ],
)
def test_reserved_by_count_takes_lowest_whole_cores(
    topology: Topology, count: int, expected: str
) -> None:
    assert str(reserved_cpus(topology, count=count)) == expected


def test_reserved_by_count_leaves_isolated_cpus_alone() -> None:
    topology = Topology(cpus=XEON.cpus, isolated=P("0-5,24-29"))
    assert str(reserved_cpus(topology, count=2)) == "6,30"
    # Spread one thread per core, too.
    assert str(reserved_cpus(topology, count=2, options=SPREAD)) == "6-7"


def test_reserved_explicit() -> None:
    assert reserved_cpus(XEON, cpus=P("0,24")) == P("0,24")
    with pytest.raises(ReservedCPUsError, match=r"reserved CPUs 5,23 are not online"):
        reserved_cpus(GAPS, cpus=P("0,5,23"))
    with pytest.raises(ReservedCPUsError, match="at least one"):
        reserved_cpus(XEON, cpus=CPUSet())
    # Every online CPU, as a list as by a count, leaves nothing to pin; GAPS has CPUs offline.
    with pytest.raises(ReservedCPUsError, match="every online CPU: at least one must stay"):
        reserved_cpus(XEON, cpus=XEON.online)
    with pytest.raises(ReservedCPUsError, match="every online CPU"):
        reserved_cpus(GAPS, cpus=GAPS.online)
    assert reserved_cpus(GAPS, cpus=GAPS.online - P("0")) == GAPS.online - P("0")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "either"),
        ({"cpus": P("0"), "count": 1}, "either"),
        ({"count": 0}, "at least one"),
        ({"count": 48}, "cannot reserve 48"),
    ],
)
def test_reserved_bad_input(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ReservedCPUsError, match=message):
        reserved_cpus(XEON, **kwargs)


# -- the policy --------------------------------------------------------------------------------


def test_policy_allocates_and_keeps_the_shared_pool() -> None:
    policy = StaticPolicy.create(XEON, reserved_count=2)
    assert policy.reserved == P("0,24")
    assignments: dict[str, CPUSet] = {}
    assignments["a"] = policy.allocate(assignments, 2)
    assert assignments["a"] == P("1,25")
    assignments["b"] = policy.allocate(assignments, ExclusiveRequest(24))
    assert assignments["b"] == P("12-23,36-47")
    assert policy.shared_pool(assignments) == P("0,2-11,24,26-35")
    assert policy.free_cpus(assignments) == P("2-11,26-35")


def test_request_for_more_than_free() -> None:
    policy = StaticPolicy.create(XEON, reserved_count=2)
    with pytest.raises(AllocationError, match="cannot allocate 47 CPUs: only 46 available"):
        policy.allocate({}, 47)


def test_shared_pool_is_never_emptied() -> None:
    loose = StaticPolicy.create(NO_HT, reserved_count=1)
    assert loose.allocate({}, 7) == P("1-7")
    assert loose.shared_pool({"x": P("1-7")}) == P("0")

    strict = StaticPolicy.create(
        NO_HT, reserved_count=1, options=StaticPolicyOptions(strict_cpu_reservation=True)
    )
    assert strict.shareable == P("1-7")
    assert strict.allocate({}, 6) == P("1-6")
    with pytest.raises(AllocationError, match=r"shared pool \(1-7\) must keep at least one CPU"):
        strict.allocate({}, 7)


def test_policy_refuses_a_machine_with_nothing_to_share() -> None:
    topology = Topology(cpus=NO_HT.cpus, isolated=P("1-7"))
    with pytest.raises(ValueError, match="shared pool"):
        StaticPolicy.create(
            topology, reserved=P("0"), options=StaticPolicyOptions(strict_cpu_reservation=True)
        )


def test_policy_checks_options_against_the_machine() -> None:
    one_numa = expected_topology(MachineSpec(sockets=2, cores_per_die=2, sockets_per_numa=2))
    with pytest.raises(OptionsError, match="2 sockets and 1 NUMA nodes"):
        StaticPolicy.create(
            one_numa, reserved_count=1, options=StaticPolicyOptions(align_by_socket=True)
        )


def test_corrupt_assignments_are_refused() -> None:
    policy = StaticPolicy.create(XEON, reserved_count=2)
    with pytest.raises(ValueError, match="reserved CPUs 0"):
        policy.allocate({"x": P("0-1")}, 1)


@pytest.mark.parametrize(
    ("mode", "count", "expected"),
    [
        # Socket 1 has fewer usable CPUs (5 and 23 offline, 7 and 22 isolated): best fit.
        ("avoid", 2, "4,20"),
        # Socket 1 cannot hold 5, socket 0 can: all 5 from socket 0.
        ("avoid", 5, "1-3,17-18"),
        ("require", 2, "7,22"),
        ("require", 1, "22"),  # core {6,22} sorts before core {7}
        ("prefer", 2, "7,22"),
        ("prefer", 3, "4,6,20"),
    ],
)
def test_isolated_cpus(mode: Any, count: int, expected: str) -> None:
    policy = StaticPolicy.create(GAPS, reserved=P("0,16"))
    assert policy.shareable == GAPS.online - P("7,22")
    got = policy.allocate({}, ExclusiveRequest(count, isolated=mode))
    assert str(got) == expected


def test_isolated_required_but_too_few() -> None:
    policy = StaticPolicy.create(GAPS, reserved=P("0,16"))
    with pytest.raises(AllocationError, match="isolated CPUs: cannot allocate 3 CPUs: only 2"):
        policy.allocate({}, ExclusiveRequest(3, isolated="require"))


def test_numa_affinity_hint() -> None:
    policy = StaticPolicy.create(XEON, reserved_count=2)
    hinted = ExclusiveRequest(2, numa_affinity=frozenset({1}))
    assert policy.allocate({}, hinted) == P("12,36")
    # More than the hinted node holds: fill it, then the rest from elsewhere.
    big = policy.allocate({}, ExclusiveRequest(26, numa_affinity=frozenset({1})))
    assert big.issuperset(XEON.cpus_in_numa_node(1))
    assert len(big) == 26


def test_align_by_socket_widens_the_hint_to_the_socket() -> None:
    request = ExclusiveRequest(12, numa_affinity=frozenset({1}))
    plain = StaticPolicy.create(FOUR_NUMA, reserved_count=2)
    by_socket = StaticPolicy.create(
        FOUR_NUMA, reserved_count=2, options=StaticPolicyOptions(align_by_socket=True)
    )
    # Socket 1 is the busier one, so best fit sends the CPUs that do not fit node 1 there.
    held = {"x": P("10-16,30-35")}
    from_plain = plain.allocate(held, request)
    assert from_plain.issuperset(FOUR_NUMA.cpus_in_numa_node(1))
    assert not from_plain.issubset(FOUR_NUMA.cpus_in_socket(0))
    from_socket = by_socket.allocate(held, request)
    assert from_socket.issuperset(FOUR_NUMA.cpus_in_numa_node(1))
    assert from_socket.issubset(FOUR_NUMA.cpus_in_socket(0))


def test_full_pcpus_only_policy() -> None:
    policy = StaticPolicy.create(XEON, reserved_count=1, options=FULL)
    assert policy.allocate({}, 2) == P("1,25")
    with pytest.raises(SMTAlignmentError, match="3 CPUs requested"):
        policy.allocate({}, 3)
    # 46 free threads, but 24 (its sibling is reserved) and 25 (its sibling is held) are
    # halves of cores: 44 in whole cores.
    with pytest.raises(SMTAlignmentError, match="46 CPUs requested but only 44 CPUs in whole"):
        policy.allocate({"x": P("1")}, 46)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"count": 0}, "at least one CPU"), ({"count": 1, "isolated": "maybe"}, "isolated must")],
)
def test_request_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExclusiveRequest(**kwargs)


# -- properties over random machines and request sequences ------------------------------------


@st.composite
def machines(draw: st.DrawFn) -> Topology:
    sockets = draw(st.integers(1, 2))
    cores = draw(st.sampled_from([1, 2, 3, 4, 6]))
    spec = MachineSpec(
        sockets=sockets,
        dies_per_socket=draw(st.integers(1, 2)),
        cores_per_die=cores,
        threads_per_core=draw(st.integers(1, 2)),
        sibling_numbering=draw(st.sampled_from(["intel", "amd"])),
        numa_per_socket=draw(st.sampled_from([n for n in (1, 2) if cores % n == 0])),
        l3_per_die=draw(st.sampled_from([n for n in (1, 2, 3) if cores % n == 0])),
    )
    everything = sorted(spec.all_cpus())
    offline = draw(st.frozensets(st.sampled_from(everything), max_size=len(everything) // 3))
    assume(len(everything) - len(offline) >= 2)
    spec = MachineSpec(**{**_fields(spec), "offline": offline})
    online = sorted(spec.online())
    isolated = draw(st.frozensets(st.sampled_from(online), max_size=len(online) // 2))
    return Topology(cpus=expected_topology(spec).cpus, isolated=CPUSet(isolated))


def _fields(spec: MachineSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


@st.composite
def option_sets(draw: st.DrawFn) -> StaticPolicyOptions:
    flags = draw(st.fixed_dictionaries({name: st.booleans() for name in _OPTION_FIELDS}))
    try:
        return StaticPolicyOptions(**flags)
    except OptionsError:
        assume(False)
        raise


_OPTION_FIELDS = [
    "full_pcpus_only",
    "distribute_cpus_across_numa",
    "align_by_socket",
    "distribute_cpus_across_cores",
    "strict_cpu_reservation",
    "prefer_align_cpus_by_uncorecache",
]

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("alloc"),
            st.integers(1, 8),
            st.sampled_from(["avoid", "avoid", "prefer", "require"]),
            st.one_of(st.none(), st.frozensets(st.integers(0, 3), min_size=1, max_size=2)),
        ),
        st.tuples(st.just("release"), st.integers(0, 50)),
    ),
    max_size=12,
)


def _union(assignments: Mapping[Any, CPUSet]) -> CPUSet:
    return CPUSet().union(*assignments.values())


@PROPERTY_SETTINGS
@given(machines(), option_sets(), st.data(), operations)
def test_policy_invariants(
    topology: Topology, options: StaticPolicyOptions, data: st.DataObject, ops: list[Any]
) -> None:
    online = sorted(topology.online)
    if data.draw(st.booleans(), label="reserve by count"):
        count = data.draw(st.integers(1, max(1, min(3, len(online) - 1))), label="count")
        reserved = reserved_cpus(topology, count=count, options=options)
    else:
        reserved = CPUSet(data.draw(st.frozensets(st.sampled_from(online), min_size=1)))
    try:
        policy = StaticPolicy(topology, reserved, options)
    except ValueError:  # align-by-socket on the wrong machine, or nothing left to share
        assume(False)
        raise
    assert not policy.reserved & policy.exclusive_candidates

    assignments: dict[int, CPUSet] = {}
    serial = 0
    for op in ops:
        if op[0] == "release":
            if assignments:
                del assignments[sorted(assignments)[op[1] % len(assignments)]]
        else:
            _, count, mode, hint = op
            request = ExclusiveRequest(count, isolated=mode, numa_affinity=hint)
            free_before = policy.free_cpus(assignments)
            plain_free = free_before - topology.isolated
            # Any free set of the right size: when the policy would accept it, a request for
            # it must not be refused.
            candidate = CPUSet()
            if len(free_before) >= count:
                pick = st.sets(st.sampled_from(sorted(free_before)), min_size=count, max_size=count)
                candidate = CPUSet(data.draw(pick, label="candidate"))
            accepted = bool(candidate) and policy.refusal(assignments, request, candidate) is None
            try:
                got = policy.allocate(assignments, request)
            except AllocationError:
                _check_refusal_was_needed(policy, assignments, request, plain_free)
                # Cores of unequal thread counts (an offline sibling) may leave full-pcpus-only
                # no whole-core set that packing finds, though one exists.
                uneven = len({m.bit_count() for m in topology.core_masks.values()}) > 1
                packing_limit = (
                    options.full_pcpus_only and uneven and count % topology.cpus_per_core == 0
                )
                assert not accepted or packing_limit, candidate
            else:
                assert len(got) == count
                assert got.issubset(free_before)
                assert got.isdisjoint(policy.reserved)
                assert got.isdisjoint(_union(assignments))
                if mode == "avoid":
                    assert got.isdisjoint(topology.isolated)
                elif mode == "require":
                    assert got.issubset(topology.isolated)
                else:
                    assert got.issubset(topology.isolated) or got.isdisjoint(topology.isolated)
                if options.full_pcpus_only:
                    assert topology.whole_cores_in(got) == got
                # What allocate hands out, the policy accepts when it is chosen again.
                assert policy.refusal(assignments, request, got) is None
                assignments[serial] = got
                serial += 1

        shared = policy.shared_pool(assignments)
        exclusive = _union(assignments)
        assert shared, "the shared pool must never be empty"
        assert shared.isdisjoint(exclusive)
        assert shared | exclusive == policy.shareable | exclusive
        assert sum(len(cpus) for cpus in assignments.values()) == len(exclusive)


SINGLE_HT_ISOLATED = expected_topology(
    MachineSpec(sockets=1, cores_per_die=4, threads_per_core=2, isolated=frozenset({3, 7}))
)
STRICT = StaticPolicyOptions(strict_cpu_reservation=True)


@pytest.mark.parametrize(
    ("name", "options", "held", "count", "mode", "cpus", "refused_for"),
    [
        ("a free plain CPU", PACKED, "1", 1, "avoid", "2", None),
        ("a whole free core", FULL, "1", 2, "avoid", "2,6", None),
        ("too few", PACKED, "1", 2, "avoid", "2", "1 CPUs (2) for a request of 2"),
        ("none at all", PACKED, "", 1, "avoid", "", "0 CPUs (none)"),
        ("reserved", PACKED, "1", 1, "avoid", "0", "reserved CPUs 0"),
        ("not online", PACKED, "1", 1, "avoid", "9", "not online: 9"),
        ("held by another", PACKED, "1", 1, "avoid", "1", "another container holds: 1"),
        ("isolated, not asked for", PACKED, "1", 1, "avoid", "3", "isolated CPUs 3"),
        ("isolated, required", PACKED, "1", 1, "require", "3", None),
        ("plain, isolated required", PACKED, "1", 1, "require", "2", "not isolated"),
        ("isolated, preferred", PACKED, "1", 2, "prefer", "3,7", None),
        ("plain, isolated preferred", PACKED, "1", 2, "prefer", "2,6", None),
        ("half isolated, preferred", PACKED, "1", 2, "prefer", "2-3", "part isolated"),
        ("lone threads, full-pcpus-only", FULL, "1", 2, "avoid", "2,5", "whole physical cores"),
        ("the last shareable CPUs", STRICT, "1,5", 3, "avoid", "2,4,6", "shared pool"),
    ],
)
def test_refusal_of_a_set_chosen_before(
    name: str,
    options: StaticPolicyOptions,
    held: str,
    count: int,
    mode: IsolatedMode,
    cpus: str,
    refused_for: str | None,
) -> None:
    policy = StaticPolicy(SINGLE_HT_ISOLATED, P("0"), options)
    assignments = {"other": P(held)} if held else {}
    refusal = policy.refusal(assignments, ExclusiveRequest(count, isolated=mode), P(cpus))
    if refused_for is None:
        assert refusal is None, name
    else:
        assert refusal is not None, name
        assert refused_for in refusal, (name, refusal)


def test_refusal_under_full_pcpus_only_asks_for_a_multiple_of_the_threads_per_core() -> None:
    # CPU 7 is offline, so core 3 has one thread: whole, yet not a set full-pcpus-only hands
    # to a 1-CPU request.
    topology = expected_topology(
        MachineSpec(sockets=1, cores_per_die=4, threads_per_core=2, offline=frozenset({7}))
    )
    policy = StaticPolicy(topology, P("0"), FULL)
    with pytest.raises(SMTAlignmentError):
        policy.allocate({}, ExclusiveRequest(1))
    refusal = policy.refusal({}, ExclusiveRequest(1), P("3"))
    assert refusal is not None
    assert "whole physical cores" in refusal


def _check_refusal_was_needed(
    policy: StaticPolicy,
    assignments: Mapping[Any, CPUSet],
    request: ExclusiveRequest,
    plain_free: CPUSet,
) -> None:
    """Without full-pcpus-only, a plain request fails only when too few CPUs are free (keeping
    one for the shared pool when nothing else would be left in it)."""
    if policy.options.full_pcpus_only or request.isolated != "avoid":
        return
    keeps_shared = policy.shared_pool(assignments) - plain_free  # shared CPUs nobody can take
    needed_spare = 0 if keeps_shared else 1
    assert request.count > len(plain_free) - needed_spare


@PROPERTY_SETTINGS
@given(machines(), option_sets(), st.data())
def test_take_by_topology_properties(
    topology: Topology, options: StaticPolicyOptions, data: st.DataObject
) -> None:
    online = sorted(topology.online)
    available = CPUSet(data.draw(st.frozensets(st.sampled_from(online))))
    count = data.draw(st.integers(0, len(online)))
    try:
        got = take_by_topology(topology, available, count, options=options)
    except SMTAlignmentError:
        assert options.full_pcpus_only
        return
    except AllocationError:
        assert count > len(available)
        return
    assert len(got) == count
    assert got.issubset(available)
    if options.full_pcpus_only:
        assert topology.whole_cores_in(got) == got
    # Whole-socket rule: on a machine of equal sockets, one NUMA node each, a request of
    # exactly a socket's worth gets a whole socket when one is free.
    sizes = {len(topology.cpus_in_socket(s)) for s in topology.sockets}
    if (
        not options.distribute_cpus_across_numa
        and len(sizes) == 1
        and topology.num_numa_nodes == topology.num_sockets
    ):
        for socket in topology.sockets:
            cpus = topology.cpus_in_socket(socket)
            if cpus.issubset(available) and len(cpus) == count:
                assert got in {topology.cpus_in_socket(s) for s in topology.sockets}
                break


# -- against kubelet's static policy ---------------------------------------------------------


def test_spread_takes_every_cores_first_free_thread_before_a_second_one() -> None:
    # allocator.md: kubelet's spread order is ascending CPU id within the socket, so with
    # CPU 5 held its 12th CPU is 24, CPU 0's sibling in the same container; cpushim takes
    # 29, core 5's free thread, so that the container's CPUs share no core.
    got = take_by_topology(XEON, XEON.online - P("5"), 12, options=SPREAD)
    assert got == P("0-4,6-11,29")


def test_reserved_count_follows_distribute_cpus_across_cores() -> None:
    # kubelet takes the reserved count with its own takeByTopology, options included.
    policy = StaticPolicy.create(XEON, reserved_count=2, options=SPREAD)
    assert policy.reserved == P("0-1")
    assert StaticPolicy.create(XEON, reserved_count=2).reserved == P("0,24")


@pytest.mark.parametrize(
    ("options", "count", "expected"),
    [
        (NUMA, 12, "0-2,5-7,20-22,25-27"),
        (NUMA_FULL, 12, "0-2,5-7,20-22,25-27"),
        # Not a multiple of the SMT level: takeByTopologyNUMADistributed falls back to packed
        # (no SMT alignment check for the reserved set).
        (NUMA_FULL, 13, "0-6,20-25"),
        # Within one NUMA node it is the packed choice.
        (NUMA, 3, "0-1,20"),
    ],
)
def test_reserved_count_follows_distribute_cpus_across_numa(
    options: StaticPolicyOptions, count: int, expected: str
) -> None:
    # kubelet's newStaticPolicy takes the reserved count with the policy's takeByTopology,
    # which under distribute-cpus-across-numa is takeByTopologyNUMADistributed: 12 CPUs on
    # nodes of 10 go 6 + 6 over nodes 0 and 1 (as "numa: 12 over two nodes" above), not a
    # whole node and a core.
    assert str(reserved_cpus(FOUR_NUMA, count=count, options=options)) == expected


@pytest.mark.parametrize(("available", "count"), [("47", 3), ("47", 4), ("", 2)])
def test_full_pcpus_only_shortage_is_an_smt_alignment_error(available: str, count: int) -> None:
    # kubelet's enforceSMTAlignment runs before allocation: a non-multiple, or more than the
    # whole free cores hold, is an SMTAlignmentError even when few CPUs are free at all.
    with pytest.raises(SMTAlignmentError):
        take_by_topology(XEON, P(available), count, options=FULL)


# -- the orderings, one rule at a time, on small machines --------------------------------------

# 2 sockets x 4 cores x 2 threads (siblings n, n+8); socket 0 = 0-3,8-11, socket 1 = 4-7,12-15.
SMALL = expected_topology(MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2))
# The same with two NUMA nodes per socket: 0-1,8-9 | 2-3,10-11 | 4-5,12-13 | 6-7,14-15.
NUMA_PAIRS = expected_topology(
    MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2, numa_per_socket=2)
)
# The same with one NUMA node holding both sockets.
SHARED_NUMA = expected_topology(
    MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2, sockets_per_numa=2)
)
# 4 sockets of 2 cores, two per NUMA node: sockets 0-1,8-9 | 2-3,10-11 | 4-5,12-13 | 6-7,14-15,
# nodes 0-3,8-11 | 4-7,12-15.
SOCKET_PAIRS = expected_topology(
    MachineSpec(sockets=4, cores_per_die=2, threads_per_core=2, sockets_per_numa=2)
)
# AMD numbering (siblings 2n, 2n+1), two L3 groups per socket: 0-3 | 4-7 | 8-11 | 12-15.
SMALL_AMD_L3 = expected_topology(
    MachineSpec(
        sockets=2, cores_per_die=4, threads_per_core=2, l3_per_die=2, sibling_numbering="amd"
    )
)
# One socket, one NUMA node, L3 groups 0-7 | 8-15 (AMD numbering).
ONE_NODE_AMD_L3 = expected_topology(
    MachineSpec(
        sockets=1, cores_per_die=8, threads_per_core=2, l3_per_die=2, sibling_numbering="amd"
    )
)
# One core per NUMA node, L3 groups of two cores: 0-1,8-9 | 2-3,10-11 | 4-5,12-13 | 6-7,14-15.
CORE_NODES = expected_topology(
    MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2, numa_per_socket=4, l3_per_die=2)
)
FULL_UNCORE = StaticPolicyOptions(full_pcpus_only=True, prefer_align_cpus_by_uncorecache=True)


@pytest.mark.parametrize(
    ("name", "topology", "available", "count", "options", "expected"),
    [
        # Step 1: whole groups, the level above first, each while the request needs its size.
        (
            "a free node's worth, in the busier socket",
            NUMA_PAIRS,
            P("0-5,7-15"),
            4,
            PACKED,
            "4-5,12-13",
        ),
        (
            "a free socket, then the busier node",
            NUMA_PAIRS,
            P("0-4,6-12,14-15"),
            10,
            PACKED,
            "0-4,8-12",
        ),
        (
            "one node, two sockets: a free socket whole",
            SHARED_NUMA,
            P("1-7,9-15"),
            10,
            PACKED,
            "1,4-7,9,12-15",
        ),
        # Step 2: cores group by group, groups in best-fit order (sockets within NUMA-first
        # order where a node holds sockets, nodes within socket-first order where a socket
        # holds nodes).
        (
            "one node, two sockets: a core of the busier socket",
            SHARED_NUMA,
            P("0-3,5-15"),
            2,
            PACKED,
            "5,13",
        ),
        ("a whole core of the busier node", NUMA_PAIRS, P("4-6,8-15"), 2, PACKED, "6,14"),
        ("sockets in their node's order", SOCKET_PAIRS, P("0-5,7-13"), 2, PACKED, "4,12"),
        # One group instead of two: the node (else socket) whose whole cores cover the
        # request, then with a cache group that holds it, then the fewest free.
        ("one node: the fewest free", NUMA_PAIRS, P("0,2-4,6-8,10-15"), 3, PACKED, "4,12-13"),
        ("one socket: its whole cores decide", SMALL_AMD_L3, P("3-6,8-15"), 4, PACKED, "8-11"),
        ("one socket: cores enough beat more cores", SMALL, P("0-7,9-13"), 6, PACKED, "1-3,9-11"),
        (
            "one node, two sockets: one socket holds it",
            SHARED_NUMA,
            P("0,5-15"),
            6,
            SPREAD,
            "5-7,12-14",
        ),
        (
            "one socket, full cores and a cache group",
            NUMA_PAIRS,
            P("1-2,4-7,9-15"),
            6,
            FULL_UNCORE,
            "4-6,12-14",
        ),
        (
            "one socket: a cache group exactly its size",
            NUMA_PAIRS,
            P("0-6,8-14"),
            6,
            UNCORE,
            "4-6,12-14",
        ),
        # Socket 0 has the fewest free, socket 1 a free cache group: that decides only under
        # prefer-align-cpus-by-uncorecache.
        ("one socket: the fewest free", CORE_NODES, P("0,3-15"), 4, PACKED, "0,3,8,11"),
        (
            "one socket: the one a cache group holds it in",
            CORE_NODES,
            P("0,3-15"),
            4,
            UNCORE,
            "4-5,12-13",
        ),
        # distribute-cpus-across-cores: idle cores first, second threads when they must.
        ("spread: an idle core first", SINGLE_HT, P("1-7"), 1, SPREAD, "1"),
        ("spread: then second threads", DUAL_HT, P("0-4,6"), 4, SPREAD, "0,2,4,6"),
        ("spread: a whole node is enough", FOUR_NUMA, P("0-30,32-39"), 10, SPREAD, "15-19,35-39"),
        # distribute-cpus-across-numa.
        ("numa: a node exactly the size", NUMA_PAIRS, P("0-5"), 2, NUMA, "4-5"),
        ("numa: shares only where they fit", DUAL_HT, P("0-2,4"), 4, NUMA, "0-2,4"),
        ("numa: the even split, not the first tried", DUAL_HT, P("0-2"), 1, NUMA, "0"),
        # 8 from each node, the 3 left one each on the three nodes with room (larger subsets
        # first), not two on one node.
        (
            "numa: the remainder spread",
            FOUR_NUMA,
            P("0-1,3-21,23-29,31-39"),
            35,
            NUMA,
            "0-1,3-21,23-28,31-38",
        ),
        (
            "numa: the remainder where a node has room",
            NUMA_PAIRS,
            P("0,8,11-15"),
            3,
            NUMA,
            "0,8,12",
        ),
        (
            "numa: the remainder on the node that has it",
            NUMA_PAIRS,
            P("0-1,3-6,13-15"),
            8,
            NUMA,
            "0-1,4-6,13-15",
        ),
        (
            "numa: a remainder of whole cores on one node",
            SMALL_AMD_L3,
            P("0-5,7-15"),
            10,
            NUMA_FULL,
            "0-3,8-13",
        ),
        (
            "numa: each node's share packed, caches ignored",
            ONE_NODE_AMD_L3,
            P("2-13,15"),
            1,
            NUMA,
            "15",
        ),
        # The fewest nodes come from the machine's average node (kubelet's
        # rangeNUMANodesNeededToSatisfy): 8 of GAPS's 14 CPUs go over two nodes, though node 0
        # alone has 8.
        (
            "numa: node count from the average node",
            GAPS,
            GAPS.online,
            8,
            NUMA,
            "0-1,4,6,16-17,20,22",
        ),
    ],
)
def test_take_by_topology_orderings(
    name: str,
    topology: Topology,
    available: CPUSet,
    count: int,
    options: StaticPolicyOptions,
    expected: str,
) -> None:
    assert str(take_by_topology(topology, available, count, options=options)) == expected, name


def test_full_pcpus_only_never_splits_a_core_where_threads_per_core_differ() -> None:
    # CPU 6 is offline: core {2} has one thread. Socket 1 (2-3,7) is taken whole, and the one
    # CPU still wanted would split core {1,5}: packing refuses rather than hand that out.
    topology = expected_topology(
        MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2, offline=frozenset({6}))
    )
    try:
        got = take_by_topology(topology, P("1-5,7"), 4, options=FULL)
    except SMTAlignmentError:
        return
    assert topology.whole_cores_in(got) == got


# -- hints, reserved sets and values, rule by rule ---------------------------------------------


def test_a_policy_built_directly_checks_its_reserved_set() -> None:
    # policy_of rebuilds a checkpoint's policy this way, not through create().
    with pytest.raises(ReservedCPUsError, match="not online"):
        StaticPolicy(GAPS, P("0,5"))
    with pytest.raises(ReservedCPUsError, match="at least one"):
        StaticPolicy(XEON, CPUSet())
    with pytest.raises(ReservedCPUsError, match="every online CPU"):
        StaticPolicy(XEON, XEON.online)


def test_a_hint_adds_no_cpu_outside_its_nodes() -> None:
    # CPU 0 is not reserved and is free: neither a hint for node 1 nor one for a node the
    # machine does not have may pull it in.
    policy = StaticPolicy.create(XEON, reserved=P("12,36"))
    assert policy.allocate({}, ExclusiveRequest(1, numa_affinity=frozenset({1}))) == P("13")
    unhinted = policy.allocate({}, ExclusiveRequest(1))
    assert policy.allocate({}, ExclusiveRequest(1, numa_affinity=frozenset({7}))) == unhinted


def test_align_by_socket_widens_the_hint_only_to_its_own_sockets() -> None:
    # Socket 1 is the busier: best fit alone would go there, the hint for node 0 keeps the
    # CPUs in socket 0.
    by_socket = StaticPolicy.create(
        FOUR_NUMA, reserved_count=2, options=StaticPolicyOptions(align_by_socket=True)
    )
    held = {"x": P("10-16,30-35")}
    got = by_socket.allocate(held, ExclusiveRequest(2, numa_affinity=frozenset({0})))
    assert got.issubset(FOUR_NUMA.cpus_in_socket(0))


def test_a_hinted_node_of_lone_threads_still_gives_what_it_has() -> None:
    # Node 0 has only single threads free (their siblings are held): requests for 2 and 3
    # take them there, not socket 1's free core (23,47), which best fit alone would choose.
    policy = StaticPolicy.create(XEON, reserved=P("0,24"))
    held = {"x": P("1-11"), "y": P("12-22,36-46")}
    assert policy.allocate(held, ExclusiveRequest(2)) == P("23,47")
    for count in (2, 3):
        got = policy.allocate(held, ExclusiveRequest(count, numa_affinity=frozenset({0})))
        assert got.issubset(XEON.cpus_in_numa_node(0))
        assert len(got) == count


def test_full_pcpus_only_takes_whole_cores_of_the_hinted_node_then_the_rest() -> None:
    policy = StaticPolicy.create(XEON, reserved_count=2, options=FULL)
    # Node 1 has one whole core (12,36) and two lone threads (13, 14): the whole core comes
    # from there, the rest from whole cores elsewhere; the halves are never split off.
    held = {"x": P("15-23,37-47")}
    got = policy.allocate(held, ExclusiveRequest(4, numa_affinity=frozenset({1})))
    assert got == P("1,12,25,36")
    # Socket 0 is nearly full: a request node 1 can hold stays there all the same.
    busy = {"x": P("2-11,26-35")}
    got = policy.allocate(busy, ExclusiveRequest(4, numa_affinity=frozenset({1})))
    assert got.issubset(XEON.cpus_in_numa_node(1))


def test_full_pcpus_only_hint_on_a_node_with_a_lone_thread() -> None:
    # CPU 6 is offline: node 1 is 2-3,7, core {2} one thread. Its whole cores give 3 CPUs, so
    # a request for 4 takes one 2-thread core there (a multiple of the SMT level), the rest
    # elsewhere.
    topology = expected_topology(
        MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2, offline=frozenset({6}))
    )
    policy = StaticPolicy(topology, P("0,4"), FULL)
    got = policy.allocate({}, ExclusiveRequest(4, numa_affinity=frozenset({1})))
    assert got == P("1,3,5,7")


def test_reserved_by_count_uses_isolated_cpus_only_when_the_rest_cannot_cover_it() -> None:
    # Exactly two CPUs are not isolated: they are the reserved pair, not 0 and 24.
    topology = Topology(cpus=XEON.cpus, isolated=XEON.online - P("6,30"))
    assert reserved_cpus(topology, count=2) == P("6,30")


def test_requests_options_and_policies_are_immutable_values() -> None:
    request = ExclusiveRequest(2)
    assert hash(request) == hash(ExclusiveRequest(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.count = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL.full_pcpus_only = False  # type: ignore[misc]
    policy = StaticPolicy.create(XEON, reserved_count=2)
    assert hash(policy) == hash(StaticPolicy.create(XEON, reserved_count=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.reserved = P("0")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("spec", "available", "count", "options", "expected"),
    [
        # Four threads per core, four CPUs offline: the remainder's round robin passes a node
        # it has already emptied, and skips it.
        pytest.param(
            MachineSpec(
                sockets=4,
                cores_per_die=4,
                threads_per_core=4,
                numa_per_socket=2,
                offline=frozenset({9, 41, 49, 52}),
            ),
            "0-8,10,12-19,21-30,32-40,42-45,47-48,50-51,53-63",
            55,
            NUMA,
            "0-8,10,12-19,21-30,32-40,42-45,47-48,50,53-63",
            id="remainder skips an emptied node",
        ),
        # Two L3 groups per die: each node's share, and the remainder, are packed without
        # regard to cache groups (the uncore option cannot be combined with this one).
        pytest.param(
            MachineSpec(
                sockets=4,
                dies_per_socket=2,
                cores_per_die=8,
                sockets_per_numa=2,
                l3_per_die=2,
                offline=frozenset({12, 14, 37, 57, 60}),
            ),
            "0,3,5,8,15,17-22,25-27,30-31,35-36,38,43,46-47,49-51,53-54,56,59,61-62",
            19,
            NUMA,
            "17-22,25-27,30,49-51,53-54,56,59,61-62",
            id="remainder packed without caches",
        ),
        pytest.param(
            MachineSpec(
                sockets=2,
                dies_per_socket=2,
                cores_per_die=6,
                threads_per_core=2,
                l3_per_die=3,
                offline=frozenset({23, 27}),
            ),
            "0-16,18-19,22,24,26,28-36,39,41-46",
            28,
            NUMA_FULL,
            "0,2,4-10,12,15,18-19,22,24,26,28-34,36,39,42-43,46",
            id="fallback packed without caches",
        ),
    ],
)
def test_distribute_across_numa_on_uneven_machines(
    spec: MachineSpec,
    available: str,
    count: int,
    options: StaticPolicyOptions,
    expected: str,
) -> None:
    # Found by differential fuzzing; the placements are today's, pinned.
    topology = expected_topology(spec)
    assert str(take_by_topology(topology, P(available), count, options=options)) == expected


# Two sockets whose CPU ids alternate (even ids on socket 0, odd on socket 1), siblings n and
# n + 8, as many two-socket servers number them.
INTERLEAVED = expected_topology(
    MachineSpec(
        sockets=2,
        cores_per_die=4,
        threads_per_core=2,
        cpu_ids=[0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15],
    )
)


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        # kubelet's NewStaticPolicy: takeByTopology(allCPUs, n) keeps socket 0.
        (1, "0"),
        (2, "0,8"),
        (3, "0,2,8"),
        (4, "0,2,8,10"),
        (5, "0,2,4,8,10"),
        (9, "0,2,4,6,8,10,12,14,1"),
    ],
)
def test_reserved_by_count_stays_on_cpu_0s_socket_where_ids_alternate(
    count: int, expected: str
) -> None:
    assert reserved_cpus(INTERLEAVED, count=count) == P(expected)
    if count < 8:
        # The same as kubelet's packed best fit takes on this uniform machine.
        assert take_by_topology(INTERLEAVED, INTERLEAVED.online, count) == P(expected)


def test_distribute_across_numa_searches_the_remainder_once_per_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 8 NUMA nodes of 4 CPUs, all free: 18 CPUs go 3 to each of 5 nodes, and the 3 left over
    # are placed by trying subsets of the 5. All 56 combinations of 5 nodes leave the same
    # counts (1, 1, 1, 1, 1), so one search must serve them all: searching again per
    # combination is what made 195 CPUs on 16 such nodes take 15 s, on the CRI path.
    topology = expected_topology(MachineSpec(sockets=2, cores_per_die=16, numa_per_socket=4))
    hand_out = take._hand_out
    calls = 0

    def counted(free: dict[int, int], nodes: Sequence[int], amount: int, group: int) -> bool:
        nonlocal calls
        calls += 1
        return hand_out(free, nodes, amount, group)

    monkeypatch.setattr(take, "_hand_out", counted)
    got = take_by_topology(topology, topology.online, 18, options=NUMA)
    assert got == P("0-14,16-18")
    # One search: the subsets of 5, 4 and 3 nodes that can absorb 3 CPUs.
    assert calls == 1 + 5 + 10


# --- in-place resizes -------------------------------------------------------------------------
# FOUR_NUMA: node 0 is 0-4,20-24, node 1 5-9,25-29 (socket 0); nodes 2 and 3 are socket 1.


@pytest.mark.parametrize(
    ("name", "options", "others", "held", "request_", "expected"),
    [
        ("same count: kept", PACKED, "", "5-6,25-26", ExclusiveRequest(4), "5-6,25-26"),
        ("smaller: a whole core of its own", PACKED, "", "5-6,25-26", ExclusiveRequest(2), "5,25"),
        ("smaller: one of its threads", PACKED, "", "7,27", ExclusiveRequest(1), "7"),
        ("larger: its own node first", PACKED, "", "7,27", ExclusiveRequest(4), "5,7,25,27"),
        (
            "larger: its node full, then the nearest",
            PACKED,
            "5-6,8-9,25-26,28-29",
            "7,27",
            ExclusiveRequest(4),
            "1,7,21,27",
        ),
        (
            "larger: kubelet's hint over its own node",
            PACKED,
            "",
            "7,27",
            ExclusiveRequest(4, numa_affinity=frozenset({2})),
            "7,10,27,30",
        ),
        ("larger: whole cores", FULL, "", "7,27", ExclusiveRequest(4), "5,7,25,27"),
    ],
)
def test_a_resize_keeps_what_it_can_of_its_set(
    name: str,
    options: StaticPolicyOptions,
    others: str,
    held: str,
    request_: ExclusiveRequest,
    expected: str,
) -> None:
    policy = StaticPolicy(FOUR_NUMA, P("0"), options)
    assignments = {"other": P(others)} if others else {}
    got = policy.resize(assignments, request_, P(held))
    assert got == P(expected), name
    assert policy.refusal(assignments, request_, got) is None


def test_a_resize_onto_a_set_the_rules_refuse_chooses_again() -> None:
    # It holds isolated CPU 3 and prefers isolated ones: its sibling 7 is isolated too.
    policy = StaticPolicy(SINGLE_HT_ISOLATED, P("0"), PACKED)
    assert policy.resize({}, ExclusiveRequest(2, isolated="prefer"), P("3")) == P("3,7")
    # Three: only two CPUs are isolated, and a set is never part isolated, so all three are
    # chosen again among the plain ones.
    got = policy.resize({}, ExclusiveRequest(3, isolated="prefer"), P("3"))
    assert len(got) == 3
    assert got.isdisjoint(SINGLE_HT_ISOLATED.isolated)
    # A plain set that prefers isolated CPUs keeps growing plain: its threads run there.
    assert policy.resize({}, ExclusiveRequest(2, isolated="prefer"), P("1")) == P("1,5")
    # A lone thread under full-pcpus-only grows into whole cores, its own thread's if free.
    policy = StaticPolicy(SINGLE_HT, P("0"), FULL)
    assert policy.resize({}, ExclusiveRequest(2), P("2")) == P("2,6")
    assert policy.resize({"other": P("6")}, ExclusiveRequest(2), P("2")) in (P("1,5"), P("3,7"))


def test_a_resize_without_room_is_refused() -> None:
    policy = StaticPolicy(SINGLE_HT, P("0"), PACKED)
    # Seven candidates: six held by another, one by this container; the shared pool needs
    # one of the two that are left.
    with pytest.raises(AllocationError):
        policy.resize({"other": P("1-3,5-6")}, ExclusiveRequest(3), P("4"))
    assert policy.resize({"other": P("1-3,5-6")}, ExclusiveRequest(2), P("4")) in (
        P("4,7"),
        P("4,0"),
    )
    with pytest.raises(SMTAlignmentError):
        StaticPolicy(SINGLE_HT, P("0"), FULL).resize({}, ExclusiveRequest(3), P("1,5"))


def test_a_resize_of_a_container_holding_nothing_is_a_new_choice() -> None:
    policy = StaticPolicy(FOUR_NUMA, P("0"), PACKED)
    assert policy.resize({}, ExclusiveRequest(2), CPUSet()) == policy.allocate(
        {}, ExclusiveRequest(2)
    )


@given(data=st.data())
@PROPERTY_SETTINGS
def test_resizes_hand_out_sets_the_policy_accepts(data: st.DataObject) -> None:
    """Resized sets are valid choices: the count asked, free or the container's own, and
    accepted by ``refusal``. Without options or isolated CPUs in play, a resize never moves a
    thread it keeps: a smaller set lies inside the old one, a larger one holds it."""
    options = data.draw(st.sampled_from([PACKED, FULL, SPREAD, NUMA]), label="options")
    policy = StaticPolicy(FOUR_NUMA, P("0"), options)
    assignments: dict[int, CPUSet] = {}
    for serial in range(data.draw(st.integers(1, 6), label="containers")):
        count = data.draw(st.sampled_from([2, 4, 6]), label="count")
        with suppress(AllocationError):
            assignments[serial] = policy.allocate(assignments, ExclusiveRequest(count))
    assume(assignments)
    key = data.draw(st.sampled_from(sorted(assignments)), label="resized")
    held = assignments.pop(key)
    request = ExclusiveRequest(data.draw(st.sampled_from([2, 4, 6, 8, 10]), label="new count"))
    free = policy.free_cpus(assignments)
    try:
        got = policy.resize(assignments, request, held)
    except AllocationError:
        assume(False)
        raise
    assert len(got) == request.count
    assert got.issubset(free)
    assert policy.refusal(assignments, request, got) is None
    if options == PACKED:
        assert got.issubset(held) if request.count <= len(held) else held.issubset(got)
