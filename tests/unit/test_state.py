"""The engine's record of exclusive CPUs: invariants, integrity checks, replanning on a policy
change, the topology fingerprint and the checkpoint codec."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.cpuset import CPUSet
from shim.policy import CPUPolicy
from shim.policy.none import NonePolicy
from shim.policy.options import StaticPolicyOptions
from shim.policy.static import AllocationError, ExclusiveRequest, IsolatedMode, StaticPolicy
from shim.state import (
    CHECKPOINT_VERSION,
    Assignment,
    CheckpointError,
    ContainerKey,
    CPUState,
    UnknownPolicyError,
    decode_checkpoint,
    encode_checkpoint,
    integrity_problems,
    policy_of,
    replan,
    topology_changed,
    topology_fingerprint,
)
from shim.topology import CPUInfo, Topology
from tests.harness.sysfs import PROPERTY_SETTINGS, MachineSpec, expected_topology

P = CPUSet.parse

# 2 sockets x 4 cores x 2 threads: CPUs 0-15, siblings n and n+8, socket 0 = 0-3,8-11.
SPEC = MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2)
TOPOLOGY = expected_topology(SPEC)
# The same machine booted with isolcpus=6-7,14-15 (two whole cores of socket 1).
ISOLATED = expected_topology(dataclasses.replace(SPEC, isolated=frozenset({6, 7, 14, 15})))
# Two sockets sharing one NUMA node: align-by-socket cannot be rebuilt on it.
ONE_NUMA = expected_topology(dataclasses.replace(SPEC, sockets_per_numa=2))

RESERVED = P("0,8")
STATIC = StaticPolicy.create(TOPOLOGY, reserved=RESERVED)
STRICT = StaticPolicy.create(
    TOPOLOGY, reserved=RESERVED, options=StaticPolicyOptions(strict_cpu_reservation=True)
)
FULL = StaticPolicy.create(
    TOPOLOGY, reserved=RESERVED, options=StaticPolicyOptions(full_pcpus_only=True)
)
STATIC_ISOLATED = StaticPolicy.create(ISOLATED, reserved=RESERVED)
NONE = NonePolicy(TOPOLOGY)

A = ContainerKey("pod-a", "app")
B = ContainerKey("pod-b", "app")
C = ContainerKey("pod-c", "sidecar")


def state_with(policy: CPUPolicy, **holdings: str) -> CPUState:
    """A state under ``policy`` whose assignments are given as ``pod_uid="cpu list"`` (container
    "app"), assigned without asking the policy, so tests can build inconsistent states."""
    state = CPUState.empty(policy)
    for uid, cpus in holdings.items():
        key = ContainerKey(uid, "app")
        state = state.assign(
            key, Assignment(P(cpus), f"ctr-{uid}", f"sb-{uid}", 0, f"ns/{uid}"), policy
        )
    return state


def check_invariants(state: CPUState, policy: CPUPolicy) -> None:
    held = CPUSet()
    for cpus in state.exclusive().values():
        assert not cpus & held, "exclusive sets overlap"
        held |= cpus
    assert not held & state.reserved
    assert state.shared == policy.shared_pool(state.exclusive())
    assert not state.shared & held
    assert integrity_problems(state, policy.topology) == []


# --- CPUState: construction and the bookkeeping operations ------------------------------------


@pytest.mark.parametrize("policy", [STATIC, STRICT, FULL, STATIC_ISOLATED, NONE], ids=repr)
def test_empty_state_describes_the_policy(policy: CPUPolicy) -> None:
    state = CPUState.empty(policy)
    assert state.policy == policy.name
    assert state.options == policy.option_names
    assert state.reserved == policy.reserved
    assert state.topology == topology_fingerprint(policy.topology)
    assert state.shared == policy.shared_pool({})
    assert dict(state.assignments) == {}
    assert integrity_problems(state, policy.topology) == []


@pytest.mark.parametrize(
    ("policy", "shared"),
    [
        (STATIC, "0-15"),  # reserved CPUs are shared unless strict
        (STRICT, "1-7,9-15"),
        (STATIC_ISOLATED, "0-5,8-13"),  # isolated CPUs never are
        (NONE, "0-15"),
    ],
    ids=["static", "strict", "isolated", "none"],
)
def test_empty_shared_pool(policy: CPUPolicy, shared: str) -> None:
    assert CPUState.empty(policy).shared == P(shared)


def test_assign_and_release_recompute_the_shared_pool() -> None:
    state = CPUState.empty(STATIC)
    state = state.assign(A, Assignment(P("1,9")), STATIC)
    assert state.shared == P("0,2-8,10-15")
    state = state.assign(B, Assignment(P("2-3,10-11")), STATIC)
    assert state.shared == P("0,4-8,12-15")
    assert state.exclusive() == {A: P("1,9"), B: P("2-3,10-11")}
    state = state.release([A], STATIC)
    assert state.shared == P("0-1,4-9,12-15")
    assert state.exclusive() == {B: P("2-3,10-11")}
    check_invariants(state, STATIC)


def test_release_ignores_unknown_keys_and_takes_several() -> None:
    state = state_with(STATIC, a="1", b="2", c="3")
    released = state.release([ContainerKey("nobody", "x"), ContainerKey("a", "app")], STATIC)
    assert list(released.assignments) == [ContainerKey("b", "app"), ContainerKey("c", "app")]
    everything = state.release(list(state.assignments), STATIC)
    assert everything.shared == CPUState.empty(STATIC).shared
    assert dict(everything.assignments) == {}


def test_a_release_remembers_the_cpus_and_the_next_assignment_forgets_them() -> None:
    a, b, c = (ContainerKey(uid, "app") for uid in "abc")
    state = state_with(STATIC, a="1", b="2")
    released = state.release([a, ContainerKey("nobody", "x")], STATIC)
    assert dict(released.released) == {a: P("1")}
    # Anyone may take them meanwhile; the memory stays until the container is assigned.
    taken = released.assign(c, Assignment(P("1")), STATIC)
    assert dict(taken.released) == {a: P("1")}
    again = taken.release([c], STATIC).assign(a, Assignment(P("3")), STATIC)
    assert dict(again.released) == {c: P("1")}
    assert dict(state.released) == {}  # the original is unchanged
    assert state_with(STATIC, b="2").release([b], STATIC).shared == CPUState.empty(STATIC).shared


def test_keep_released_forgets_the_pods_that_are_gone() -> None:
    b = ContainerKey("b", "app")
    state = state_with(STATIC, a="1", b="2", c="3").release([ContainerKey("a", "app"), b], STATIC)
    assert state.keep_released({"a", "b"}) is state
    assert dict(state.keep_released({"b", "c"}).released) == {b: P("2")}
    assert dict(state.keep_released(set()).released) == {}
    assert state.keep_released(set()).assignments == state.assignments


def test_assignments_are_kept_sorted_and_read_only() -> None:
    state = CPUState.empty(STATIC)
    for key in (C, A, B):
        state = state.assign(key, Assignment(P(str(len(state.assignments) + 1))), STATIC)
    assert list(state.assignments) == [A, B, C]
    with pytest.raises(TypeError):
        state.assignments[A] = Assignment(P("5"))  # type: ignore[index]


def test_assign_does_not_change_the_original() -> None:
    empty = CPUState.empty(STATIC)
    empty.assign(A, Assignment(P("1")), STATIC)
    assert dict(empty.assignments) == {}
    assert empty.shared == P("0-15")


def test_update_changes_bookkeeping_only() -> None:
    state = state_with(STATIC, a="1,9")
    key = ContainerKey("a", "app")
    updated = state.update(key, container_id="new-id", attempt=3)
    assignment = updated.assignments[key]
    assert assignment == Assignment(P("1,9"), "new-id", "sb-a", 3, "ns/a")
    assert updated.shared == state.shared
    assert state.assignments[key].container_id == "ctr-a"


def test_update_of_an_unknown_key_raises() -> None:
    with pytest.raises(KeyError):
        CPUState.empty(STATIC).update(A, container_id="x")


def test_holding() -> None:
    state = state_with(STATIC, a="1", b="2")
    assert state.holding("ctr-b") == ContainerKey("b", "app")
    assert state.holding("ctr-a") == ContainerKey("a", "app")
    assert state.holding("unknown") is None


def test_under_switches_policy_and_recomputes_the_pool() -> None:
    state = state_with(STATIC, a="1,9")
    strict = state.under(STRICT)
    assert strict.options == frozenset({"strict-cpu-reservation"})
    assert strict.shared == P("2-7,10-15")
    assert strict.assignments == state.assignments
    assert integrity_problems(strict, TOPOLOGY) == []


def test_container_key_order_and_str() -> None:
    assert str(ContainerKey("uid-1", "app")) == "uid-1/app"
    assert sorted([C, B, A, ContainerKey("pod-a", "aaa")]) == [
        ContainerKey("pod-a", "aaa"),
        A,
        B,
        C,
    ]


# --- invariants under random allocation and release -------------------------------------------

POLICIES = [STATIC, STRICT, FULL, STATIC_ISOLATED]

ISOLATED_MODES = ["avoid", "avoid", "avoid", "prefer", "require"]
allocate = st.tuples(st.just("allocate"), st.integers(1, 4), st.sampled_from(ISOLATED_MODES))
release = st.tuples(st.just("release"), st.integers(0, 63), st.just(""))
# Three allocations for each release, so that states fill up.
operations = st.lists(st.one_of(allocate, allocate, allocate, release), min_size=4, max_size=30)


def run_operations(
    policy: StaticPolicy, ops: list[tuple[str, int, str]], check: bool = False
) -> CPUState:
    state = CPUState.empty(policy)
    for step, (op, number, isolated) in enumerate(ops):
        if op == "allocate":
            request = ExclusiveRequest(number, isolated)  # type: ignore[arg-type]
            try:
                cpus = policy.allocate(state.exclusive(), request)
            except AllocationError:
                continue
            key = ContainerKey(f"pod-{step}", "app")
            state = state.assign(key, Assignment(cpus, f"ctr-{step}", attempt=step), policy)
        elif state.assignments:
            keys = list(state.assignments)
            state = state.release([keys[number % len(keys)]], policy)
        if check:
            check_invariants(state, policy)
            assert state.shared, "the shared pool became empty"
    return state


@PROPERTY_SETTINGS
@given(st.sampled_from(POLICIES), operations)
def test_allocate_release_sequences_keep_the_invariants(
    policy: StaticPolicy, ops: list[tuple[str, int, str]]
) -> None:
    run_operations(policy, ops, check=True)


# --- integrity_problems -----------------------------------------------------------------------


def test_a_consistent_state_has_no_problems() -> None:
    assert integrity_problems(state_with(STATIC, a="1,9", b="2-3,10-11"), TOPOLOGY) == []
    assert integrity_problems(state_with(STATIC_ISOLATED, a="6-7"), ISOLATED) == []


def test_a_state_for_another_topology_is_checked_in_itself_only() -> None:
    """Start-up re-plans it with the CPUs there are now: CPUs not online any more and what
    its pool was are no problem, what is wrong in itself still is."""
    other = expected_topology(dataclasses.replace(SPEC, offline=frozenset({15})))
    consistent = state_with(STATIC, a="15", b="2-3")
    assert topology_changed(consistent, other)
    assert integrity_problems(consistent, other) == []
    overlapping = state_with(STATIC, a="1", b="1")
    problems = integrity_problems(overlapping, other)
    assert len(problems) == 1
    assert "also holds" in problems[0]


def test_isolation_change_is_a_change_of_topology() -> None:
    state = CPUState.empty(STATIC)
    assert topology_changed(state, ISOLATED)
    assert not topology_changed(state, TOPOLOGY)
    assert integrity_problems(state, ISOLATED) == []


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        pytest.param(
            state_with(STATIC, a="1-2", b="2-3"),
            ["b/app holds CPUs 2 that another container also holds"],
            id="overlapping assignments",
        ),
        pytest.param(
            state_with(STATIC, a="8-9"),
            ["a/app holds reserved CPUs 8"],
            id="reserved CPU",
        ),
        pytest.param(
            state_with(STATIC, a="15-17"),
            ["a/app holds CPUs 16-17 that are not online"],
            id="CPU not online",
        ),
        pytest.param(
            state_with(STATIC, a=""),
            ["a/app holds no CPUs"],
            id="empty assignment",
        ),
        pytest.param(
            dataclasses.replace(state_with(STATIC, a="1,9"), shared=P("0-15")),
            ["the shared pool 0-15 overlaps exclusive CPUs 1,9"],
            id="shared overlaps exclusive",
        ),
        pytest.param(
            state_with(STATIC, a="1", b="2").assign(
                ContainerKey("b", "app"),
                Assignment(P("2"), "ctr-a", "sb-b", 0, "ns/b"),
                STATIC,
            ),
            ["b/app and a/app name the same container ctr-a"],
            id="one container under two keys",
        ),
        pytest.param(
            # A newer version's: start-up re-plans it under the configured policy.
            dataclasses.replace(state_with(STATIC, a="1,9"), policy="dynamic"),
            [],
            id="unknown policy",
        ),
        pytest.param(
            dataclasses.replace(state_with(STATIC, a="1,9"), options=frozenset({"added-later"})),
            [],
            id="unknown option",
        ),
    ],
)
def test_integrity_problems(state: CPUState, expected: list[str]) -> None:
    assert integrity_problems(state, TOPOLOGY) == expected


@pytest.mark.parametrize(
    ("shared", "message"),
    [
        ("0,2-8,10-14", "the shared pool is 0,2-8,10-14 but its assignments leave 0,2-8,10-15"),
        ("", "the shared pool is empty but its assignments leave 0,2-8,10-15"),
        ("0,2-8,10-16", "the shared pool is 0,2-8,10-16 but its assignments leave 0,2-8,10-15"),
    ],
    ids=["missing CPU", "empty", "extra CPU"],
)
def test_shared_pool_that_does_not_add_up(shared: str, message: str) -> None:
    state = dataclasses.replace(state_with(STATIC, a="1,9"), shared=P(shared))
    problems = integrity_problems(state, TOPOLOGY)
    assert len(problems) == 1
    assert problems[0].startswith(message)
    assert "shared and exclusive CPUs do not add up to the allocatable CPUs" in problems[0]


def test_shared_pool_of_another_policy_does_not_add_up() -> None:
    # Written under strict-cpu-reservation, relabelled as plain static: reserved CPUs missing.
    state = dataclasses.replace(state_with(STRICT, a="1,9"), options=frozenset())
    (problem,) = integrity_problems(state, TOPOLOGY)
    assert problem.startswith("the shared pool is 2-7,10-15 but its assignments leave 0,2-8,10-15")


@pytest.mark.parametrize(
    ("topology", "changes", "message"),
    [
        (
            TOPOLOGY,
            {"options": frozenset({"full-pcpus-only", "distribute-cpus-across-cores"})},
            "can not be used at the same time",
        ),
        (
            ONE_NUMA,
            {"options": frozenset({"align-by-socket"})},
            "align-by-socket needs at least as many NUMA nodes as sockets",
        ),
        (TOPOLOGY, {"reserved": P("0,99")}, "reserved CPUs 99 are not online"),
        (TOPOLOGY, {"reserved": P("")}, "needs at least one reserved CPU"),
    ],
    ids=["conflicting options", "align-by-socket", "reserved offline", "none"],
)
def test_options_that_cannot_be_rebuilt(
    topology: Topology, changes: dict[str, Any], message: str
) -> None:
    policy = StaticPolicy.create(topology, reserved=RESERVED)
    state = dataclasses.replace(CPUState.empty(policy), **changes)
    (problem,) = integrity_problems(state, topology)
    assert problem.startswith("its policy cannot be rebuilt on this machine: ")
    assert message in problem
    with pytest.raises(CheckpointError, match=re.escape(message)):
        policy_of(state, topology)


def test_several_problems_are_all_reported() -> None:
    state = dataclasses.replace(state_with(STATIC, a="1-2", b="2,8"), policy="dynamic")
    assert integrity_problems(state, TOPOLOGY) == [
        "b/app holds CPUs 2 that another container also holds",
        "b/app holds reserved CPUs 8",
    ]


def test_policy_of_rebuilds_the_policy() -> None:
    assert policy_of(CPUState.empty(FULL), TOPOLOGY) == FULL
    assert policy_of(CPUState.empty(STRICT), TOPOLOGY) == STRICT
    assert policy_of(CPUState.empty(NONE), TOPOLOGY) == NONE
    with pytest.raises(UnknownPolicyError, match="unknown policy 'dynamic'"):
        policy_of(dataclasses.replace(CPUState.empty(STATIC), policy="dynamic"), TOPOLOGY)
    newer = dataclasses.replace(CPUState.empty(STATIC), options=frozenset({"b-later", "a-later"}))
    with pytest.raises(UnknownPolicyError, match=r"options \['a-later', 'b-later'\]"):
        policy_of(newer, TOPOLOGY)


# --- replan -----------------------------------------------------------------------------------


def test_replan_with_an_unchanged_policy_displaces_nothing() -> None:
    state = state_with(STATIC, a="1,9", b="2-3,10-11")
    planned, displaced = replan(state, STATIC)
    assert displaced == []
    assert planned == state


def test_replan_displaces_assignments_on_newly_reserved_cpus() -> None:
    state = state_with(STATIC, a="1,9", b="2-3,10-11", c="4")
    bigger = StaticPolicy.create(TOPOLOGY, reserved=P("0-1,8-9"))
    planned, displaced = replan(state, bigger)
    assert displaced == [ContainerKey("a", "app")]
    assert planned.assignments == {k: v for k, v in state.assignments.items() if k.pod_uid != "a"}
    assert planned.reserved == P("0-1,8-9")
    assert planned.shared == bigger.shared_pool(planned.exclusive())
    assert planned.shared == P("0-1,5-9,12-15")
    assert integrity_problems(planned, TOPOLOGY) == []


def test_replan_to_a_smaller_reserved_set_keeps_everything() -> None:
    # A smaller reserved set frees CPUs; every assignment is still valid.
    state = state_with(STATIC, a="1,9")
    smaller = StaticPolicy.create(TOPOLOGY, reserved=P("0"))
    planned, displaced = replan(state, smaller)
    assert displaced == []
    assert planned.reserved == P("0")
    assert planned.shared == P("0,2-8,10-15")
    assert integrity_problems(planned, TOPOLOGY) == []


def test_replan_to_none_displaces_everything() -> None:
    state = state_with(STATIC, a="1,9", b="2-3,10-11")
    planned, displaced = replan(state, NONE)
    assert displaced == [ContainerKey("a", "app"), ContainerKey("b", "app")]
    assert dict(planned.assignments) == {}
    assert planned.policy == "none"
    assert planned.options == frozenset()
    assert planned.shared == TOPOLOGY.online
    assert integrity_problems(planned, TOPOLOGY) == []


def test_replan_from_none_to_static() -> None:
    planned, displaced = replan(CPUState.empty(NONE), STRICT)
    assert displaced == []
    assert planned == CPUState.empty(STRICT)


def test_replan_displaces_the_later_of_two_overlapping_assignments() -> None:
    state = state_with(STATIC, a="1-2", b="2-3", c="4")
    planned, displaced = replan(state, STATIC)
    assert displaced == [ContainerKey("b", "app")]
    assert planned.exclusive() == {
        ContainerKey("a", "app"): P("1-2"),
        ContainerKey("c", "app"): P("4"),
    }
    assert planned.shared == STATIC.shared_pool(planned.exclusive())


def test_replan_keeps_a_set_only_if_the_policy_would_hand_it_to_its_request_now() -> None:
    """With the containers' requests, the new options are asked of every kept set; one with
    no request (no running container) is kept on its CPUs being candidates still."""
    state = state_with(STATIC, a="1,9", b="2,11", c="3", d="4")
    asks = {"a": 2, "b": 2, "c": 1}

    def request_of(key: ContainerKey, assignment: Assignment) -> ExclusiveRequest | None:
        count = asks.get(key.pod_uid)
        return None if count is None else ExclusiveRequest(count)

    planned, displaced = replan(state, FULL, request_of)
    # b holds halves of two cores, c a lone thread: full-pcpus-only hands out neither.
    assert displaced == [ContainerKey("b", "app"), ContainerKey("c", "app")]
    assert planned.exclusive() == {
        ContainerKey("a", "app"): P("1,9"),
        ContainerKey("d", "app"): P("4"),
    }
    assert planned.shared == FULL.shared_pool(planned.exclusive())


def test_replan_asks_isolation_of_a_kept_set() -> None:
    state = state_with(STATIC, a="6", b="7", c="5")
    modes: dict[str, IsolatedMode] = {"a": "avoid", "b": "require", "c": "require"}

    def request_of(key: ContainerKey, assignment: Assignment) -> ExclusiveRequest:
        return ExclusiveRequest(len(assignment.cpus), isolated=modes[key.pod_uid])

    # 6 and 7 are isolated now: a did not ask for isolated CPUs, c asks for them and 5 is not.
    _, displaced = replan(state, STATIC_ISOLATED, request_of)
    assert displaced == [ContainerKey("a", "app"), ContainerKey("c", "app")]


def test_replan_to_strict_reservation_moves_reserved_cpus_out_of_the_pool() -> None:
    state = state_with(STATIC, a="1,9")
    planned, displaced = replan(state, STRICT)
    assert displaced == []
    assert planned.options == frozenset({"strict-cpu-reservation"})
    assert planned.shared == P("2-7,10-15")


def test_replan_never_leaves_the_shared_pool_empty() -> None:
    # Legal under plain static: the reserved CPUs 0,8 keep the shared pool non-empty.
    state = CPUState.empty(STATIC)
    for step in range(7):
        cpus = STATIC.allocate(state.exclusive(), 2)
        state = state.assign(ContainerKey(f"pod-{step}", "app"), Assignment(cpus), STATIC)
    assert state.shared == P("0,8")
    check_invariants(state, STATIC)
    # Under strict-cpu-reservation the reserved CPUs leave the pool; nothing is displaced.
    planned, displaced = replan(state, STRICT)
    assert planned.shared, f"empty shared pool, displaced {displaced}"


def test_replan_keeps_the_sets_of_unmovable_containers_first_and_as_they_are() -> None:
    """A container that cannot be moved (its state unread) keeps its set without being asked
    what it requests (a lone thread under full-pcpus-only), ahead of the others, and gives
    way to an empty shared pool last; CPUs no container may hold now it loses all the same."""
    state = CPUState.empty(STATIC)
    for step in range(7):
        cpus = STATIC.allocate(state.exclusive(), 2)
        state = state.assign(ContainerKey(f"pod-{step}", "app"), Assignment(cpus), STATIC)
    last = ContainerKey("pod-6", "app")
    assert replan(state, STRICT)[1] == [last]

    def request_of(key: ContainerKey, assignment: Assignment) -> ExclusiveRequest:
        return ExclusiveRequest(len(assignment.cpus))

    planned, displaced = replan(state, STRICT, request_of, unmovable={last})
    assert last in planned.assignments
    assert len(displaced) == 1
    assert planned.shared == state.assignments[displaced[0]].cpus
    check_invariants(planned, STRICT)

    lone = state_with(STATIC, a="1", b="2,10", c="3")
    planned, displaced = replan(
        lone, FULL, request_of, unmovable={ContainerKey("a", "app"), ContainerKey("c", "app")}
    )
    assert displaced == []
    assert planned.exclusive() == lone.exclusive()
    bigger = StaticPolicy.create(TOPOLOGY, reserved=P("0-1,8-9"))
    _, displaced = replan(lone, bigger, request_of, unmovable={ContainerKey("a", "app")})
    assert displaced == [ContainerKey("a", "app")]


@PROPERTY_SETTINGS
@given(st.sampled_from([STATIC, FULL]), operations, st.sampled_from(["0,8", "0-1,8-9", "0-3"]))
def test_replan_result_is_consistent(
    policy: StaticPolicy, ops: list[tuple[str, int, str]], reserved: str
) -> None:
    state = run_operations(policy, ops)
    new = StaticPolicy.create(TOPOLOGY, reserved=P(reserved), options=policy.options)
    planned, displaced = replan(state, new)
    assert set(planned.assignments) | set(displaced) == set(state.assignments)
    assert not set(planned.assignments) & set(displaced)
    for key, assignment in planned.assignments.items():
        assert assignment == state.assignments[key]
    for key in displaced:
        assert state.assignments[key].cpus & new.reserved
    assert planned.shared == new.shared_pool(planned.exclusive())
    assert planned.reserved == new.reserved
    assert integrity_problems(planned, TOPOLOGY) == []


# --- topology_fingerprint ---------------------------------------------------------------------


def moved(topology: Topology, cpu: int, **changes: int) -> Topology:
    infos = tuple(
        dataclasses.replace(info, **changes) if info.cpu == cpu else info for info in topology.cpus
    )
    return Topology(cpus=infos, isolated=topology.isolated)


def test_fingerprint_format_and_equality() -> None:
    fingerprint = topology_fingerprint(TOPOLOGY)
    assert re.fullmatch(r"sha256:[0-9a-f]{32}", fingerprint)
    assert topology_fingerprint(expected_topology(SPEC)) == fingerprint
    shuffled = Topology(cpus=tuple(reversed(TOPOLOGY.cpus)))
    assert topology_fingerprint(shuffled) == fingerprint


def test_fingerprint_ignores_isolated_cpus_that_are_not_online() -> None:
    assert topology_fingerprint(Topology(cpus=TOPOLOGY.cpus, isolated=P("40"))) == (
        topology_fingerprint(TOPOLOGY)
    )


def test_fingerprint_is_the_one_earlier_versions_wrote() -> None:
    """A checkpoint written before is for this machine still: no re-plan at an upgrade."""
    assert topology_fingerprint(TOPOLOGY) == "sha256:7adb32261ba4a14e387f57f13c46407c"


def test_fingerprint_ignores_the_memory_nodes() -> None:
    """Which nodes have memory changes with memory hotplug (a CXL device added), which moves
    no CPU and makes no checkpoint stale."""
    with_cxl = expected_topology(dataclasses.replace(SPEC, memory_only_nodes=1))
    assert with_cxl.memory_nodes == P("0-2")
    assert topology_fingerprint(with_cxl) == topology_fingerprint(TOPOLOGY)
    assert not topology_changed(CPUState.empty(STATIC), with_cxl)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(
            expected_topology(dataclasses.replace(SPEC, offline=frozenset({15}))), id="offline"
        ),
        pytest.param(ISOLATED, id="isolated"),
        pytest.param(Topology(cpus=TOPOLOGY.cpus, isolated=P("15")), id="one more isolated"),
        pytest.param(moved(TOPOLOGY, 3, core_id=2), id="moves core"),
        pytest.param(moved(TOPOLOGY, 3, socket=1), id="moves socket"),
        pytest.param(moved(TOPOLOGY, 3, numa_node=1), id="moves NUMA node"),
        pytest.param(moved(TOPOLOGY, 3, uncore_cache=1), id="moves L3 group"),
        pytest.param(moved(TOPOLOGY, 3, die=1), id="moves die"),
        pytest.param(
            Topology(cpus=(*TOPOLOGY.cpus, CPUInfo(cpu=16, socket=1, core_id=4, numa_node=1))),
            id="CPU added",
        ),
    ],
)
def test_fingerprint_changes(other: Topology) -> None:
    assert topology_fingerprint(other) != topology_fingerprint(TOPOLOGY)


# --- the checkpoint codec ---------------------------------------------------------------------


def seal(body: dict[str, Any]) -> str:
    """The checksum format, computed independently of shim.state."""
    return "sha256:" + hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def document(state: CPUState) -> dict[str, Any]:
    loaded: dict[str, Any] = orjson.loads(encode_checkpoint(state))
    return loaded


def dump(doc: Any) -> bytes:
    return orjson.dumps(doc)


SAMPLE = CPUState.empty(STATIC).assign(
    ContainerKey("0f1e2d3c-uid", "app"),
    Assignment(P("1,9"), "ctr-1", "sb-1", 2, "default/web"),
    STATIC,
)
SAMPLE_UID, SAMPLE_NAME = "0f1e2d3c-uid", "app"


def test_encoding_layout() -> None:
    data = encode_checkpoint(SAMPLE)
    assert data.endswith(b"\n")
    doc = orjson.loads(data)
    # Indented, keys sorted: a file for operators to read.
    assert data == orjson.dumps(doc, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"
    assert set(doc) == {"version", "checksum", "body"}
    assert doc["version"] == CHECKPOINT_VERSION
    assert doc["checksum"] == seal(doc["body"])
    assert doc["body"] == {
        "policy": "static",
        "options": [],
        "reserved": "0,8",
        "topology": topology_fingerprint(TOPOLOGY),
        "shared": "0,2-8,10-15",
        "assignments": {
            SAMPLE_UID: {
                SAMPLE_NAME: {
                    "cpus": "1,9",
                    "container_id": "ctr-1",
                    "sandbox_id": "sb-1",
                    "attempt": 2,
                    "pod": "default/web",
                }
            }
        },
    }


def test_encoding_is_deterministic() -> None:
    a = (
        CPUState.empty(STATIC)
        .assign(B, Assignment(P("2")), STATIC)
        .assign(A, Assignment(P("1")), STATIC)
    )
    b = (
        CPUState.empty(STATIC)
        .assign(A, Assignment(P("1")), STATIC)
        .assign(B, Assignment(P("2")), STATIC)
    )
    assert encode_checkpoint(a) == encode_checkpoint(b)


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(CPUState.empty(STATIC), id="empty"),
        pytest.param(CPUState.empty(NONE), id="none"),
        pytest.param(CPUState.empty(STRICT), id="options"),
        pytest.param(SAMPLE, id="one"),
        pytest.param(
            CPUState.empty(STATIC).assign(
                ContainerKey("pöd-ünïcödé-日本", "κοντέινερ"),
                Assignment(P("3"), pod="名前空間/ポッド 🚀"),
                STATIC,
            ),
            id="unicode",
        ),
        pytest.param(
            CPUState.empty(STATIC).assign(A, Assignment(P("1")), STATIC),
            id="pending create",
        ),
        pytest.param(state_with(STATIC, a="1", b="2", c="3-4"), id="several"),
    ],
)
def test_round_trip(state: CPUState) -> None:
    decoded = decode_checkpoint(encode_checkpoint(state))
    assert decoded == state
    assert encode_checkpoint(decoded) == encode_checkpoint(state)


def test_released_cpus_round_trip_and_are_written_only_when_there_are_any() -> None:
    state = SAMPLE.assign(A, Assignment(P("2")), STATIC).release([A], STATIC)
    data = encode_checkpoint(state)
    assert orjson.loads(data)["body"]["released"] == {"pod-a": {"app": "2"}}
    assert decode_checkpoint(data) == state
    # Without any, the file is what earlier versions wrote and read.
    assert "released" not in orjson.loads(encode_checkpoint(SAMPLE))["body"]
    assert decode_checkpoint(encode_checkpoint(SAMPLE)).released == {}


def test_pod_level_marks_round_trip_and_are_written_only_when_there_are_any() -> None:
    state = SAMPLE.with_pod_level("pod-b").with_pod_level("pod-a")
    data = encode_checkpoint(state)
    assert orjson.loads(data)["body"]["podLevelResources"] == ["pod-a", "pod-b"]
    assert decode_checkpoint(data) == state
    assert "podLevelResources" not in orjson.loads(encode_checkpoint(SAMPLE))["body"]
    assert decode_checkpoint(encode_checkpoint(SAMPLE)).pod_level == frozenset()


@pytest.mark.parametrize("value", ["pod-a", [1], {"pod-a": True}])
def test_malformed_pod_level_marks_are_refused(value: object) -> None:
    doc = document(SAMPLE)
    doc["body"]["podLevelResources"] = value
    doc["checksum"] = seal(doc["body"])
    with pytest.raises(CheckpointError, match="its body is malformed"):
        decode_checkpoint(dump(doc))


def test_keep_released_forgets_the_marks_of_pods_that_are_gone() -> None:
    state = SAMPLE.with_pod_level("a").with_pod_level("b")
    assert state.keep_released({"a", "b", "c"}) is state
    assert state.keep_released({"b"}).pod_level == {"b"}


def test_decode_without_pod_label() -> None:
    doc = document(SAMPLE)
    del doc["body"]["assignments"][SAMPLE_UID][SAMPLE_NAME]["pod"]
    doc["checksum"] = seal(doc["body"])
    decoded = decode_checkpoint(dump(doc))
    assert decoded.assignments[ContainerKey(SAMPLE_UID, SAMPLE_NAME)].pod == ""


text = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


@st.composite
def states(draw: st.DrawFn) -> CPUState:
    policy = draw(st.sampled_from([STATIC, STRICT, FULL, STATIC_ISOLATED]))
    state = CPUState.empty(policy)
    for _ in range(draw(st.integers(0, 4)) * 3):
        if state.assignments and draw(st.integers(0, 3)) == 0:
            victim = draw(st.sampled_from(sorted(state.assignments)))
            state = state.release([victim], policy)
            continue
        key = ContainerKey(draw(text), draw(text))
        if key in state.assignments:
            continue
        request = ExclusiveRequest(draw(st.integers(1, 4)), draw(st.sampled_from(ISOLATED_MODES)))
        try:
            cpus = policy.allocate(state.exclusive(), request)
        except AllocationError:
            continue
        assignment = Assignment(
            cpus,
            container_id=draw(text),
            sandbox_id=draw(text),
            attempt=draw(st.integers(0, 2**32 - 1)),
            pod=draw(text),
            mems=draw(st.none() | st.sets(st.integers(0, 7), min_size=1).map(CPUSet)),
        )
        state = state.assign(key, assignment, policy)
    return state


@PROPERTY_SETTINGS
@given(states())
def test_round_trip_property(state: CPUState) -> None:
    data = encode_checkpoint(state)
    decoded = decode_checkpoint(data)
    assert decoded == state
    assert encode_checkpoint(decoded) == data


def edited_cpus(data: bytes) -> bytes:
    doc = orjson.loads(data)
    doc["body"]["assignments"][SAMPLE_UID][SAMPLE_NAME]["cpus"] = "1,10"
    return dump(doc)


def dropped_assignment(data: bytes) -> bytes:
    doc = orjson.loads(data)
    doc["body"]["assignments"] = {}
    return dump(doc)


def dropped_checksum(data: bytes) -> bytes:
    doc = orjson.loads(data)
    del doc["checksum"]
    return dump(doc)


def edited_checksum(data: bytes) -> bytes:
    doc = orjson.loads(data)
    doc["checksum"] = doc["checksum"][:-1] + ("0" if doc["checksum"][-1] != "0" else "1")
    return dump(doc)


def with_document(**changes: Any) -> Any:
    def edit(data: bytes) -> bytes:
        doc = orjson.loads(data)
        for name, value in changes.items():
            if value is KeyError:
                del doc[name]
            else:
                doc[name] = value
        return dump(doc)

    return edit


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        pytest.param(lambda d: b"", "it is not JSON", id="empty file"),
        pytest.param(lambda d: b"not json", "it is not JSON", id="not JSON"),
        pytest.param(lambda d: b"\xff\xfe{}", "it is not JSON", id="not UTF-8"),
        pytest.param(lambda d: d[: len(d) // 2], "it is not JSON", id="truncated file"),
        pytest.param(lambda d: b"[1, 2]", "it is not a JSON object", id="array"),
        pytest.param(lambda d: b'"state"', "it is not a JSON object", id="string"),
        pytest.param(lambda d: b"null", "it is not a JSON object", id="null"),
        pytest.param(
            with_document(version=2),
            "format version 2 is newer than 1, the one this cpushim reads: a newer cpushim",
            id="version 2",
        ),
        pytest.param(
            with_document(version=0), "format version 0 is not 1, the one this", id="version 0"
        ),
        pytest.param(
            with_document(version="1"), "format version '1' is not 1", id="version string"
        ),
        pytest.param(
            with_document(version=KeyError), "format version None is not 1", id="no version"
        ),
        pytest.param(with_document(body=KeyError), "it has no body", id="missing body"),
        pytest.param(with_document(body=[1]), "it has no body", id="body not an object"),
        pytest.param(
            edited_cpus, "its checksum does not match its body: it was edited", id="edited CPU"
        ),
        pytest.param(
            dropped_assignment, "its checksum does not match its body", id="truncated body"
        ),
        pytest.param(dropped_checksum, "its checksum does not match", id="no checksum"),
        pytest.param(edited_checksum, "its checksum does not match", id="edited checksum"),
    ],
)
def test_decode_errors(corrupt: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=re.escape(message)):
        decode_checkpoint(corrupt(encode_checkpoint(SAMPLE)))


def entry_set(**values: Any) -> Any:
    def edit(body: dict[str, Any]) -> None:
        body["assignments"][SAMPLE_UID][SAMPLE_NAME].update(values)

    return edit


def body_set(**values: Any) -> Any:
    def edit(body: dict[str, Any]) -> None:
        for name, value in values.items():
            if value is KeyError:
                del body[name]
            else:
                body[name] = value

    return edit


def entry_del(name: str) -> Any:
    def edit(body: dict[str, Any]) -> None:
        del body["assignments"][SAMPLE_UID][SAMPLE_NAME][name]

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(
            entry_set(cpus=19),
            "TypeError: 0f1e2d3c-uid/app cpus must be a string, not int",
            id="cpus not a string",
        ),
        pytest.param(entry_set(cpus="1-"), "ValueError: invalid CPU list '1-'", id="bad CPU list"),
        pytest.param(
            entry_set(cpus="3-1"), "ValueError: invalid CPU list '3-1'", id="reversed range"
        ),
        pytest.param(
            entry_set(attempt=-1),
            "ValueError: 0f1e2d3c-uid/app: attempt must be a non-negative integer",
            id="negative attempt",
        ),
        pytest.param(
            entry_set(attempt="2"),
            "attempt must be a non-negative integer",
            id="attempt a string",
        ),
        pytest.param(
            entry_set(attempt=1.5), "attempt must be a non-negative integer", id="float attempt"
        ),
        pytest.param(
            entry_set(container_id=None),
            "TypeError: container_id must be a string, not NoneType",
            id="container id null",
        ),
        pytest.param(
            entry_set(pod=7), "TypeError: pod must be a string, not int", id="pod not a string"
        ),
        pytest.param(entry_del("cpus"), "KeyError: 'cpus'", id="no cpus"),
        pytest.param(
            entry_set(mems=1),
            "TypeError: 0f1e2d3c-uid/app mems must be a string, not int",
            id="mems not a string",
        ),
        pytest.param(
            entry_set(mems="x"),
            "ValueError: 0f1e2d3c-uid/app mems: invalid CPU list 'x'",
            id="bad mems list",
        ),
        pytest.param(entry_del("sandbox_id"), "KeyError: 'sandbox_id'", id="no sandbox id"),
        pytest.param(
            body_set(assignments=[]),
            "TypeError: assignments must be an object",
            id="assignments not an object",
        ),
        pytest.param(
            body_set(assignments={SAMPLE_UID: ["app"]}),
            "TypeError: assignments of pod 0f1e2d3c-uid must be an object",
            id="pod not an object",
        ),
        pytest.param(
            body_set(assignments={SAMPLE_UID: {"app": "1,9"}}),
            "its body is malformed: TypeError",
            id="entry not an object",
        ),
        pytest.param(body_set(policy=KeyError), "KeyError: 'policy'", id="no policy"),
        pytest.param(
            body_set(options="full-pcpus-only"),
            "TypeError: options must be a list",
            id="options a string",
        ),
        pytest.param(
            body_set(options=[1]),
            "TypeError: an option must be a string, not int",
            id="option not a string",
        ),
        pytest.param(
            body_set(reserved=[0, 8]),
            "TypeError: reserved must be a string, not list",
            id="reserved not a string",
        ),
        pytest.param(
            body_set(shared="0-x"), "ValueError: invalid CPU list '0-x'", id="bad shared list"
        ),
        pytest.param(
            body_set(topology=None), "TypeError: topology must be a string", id="topology null"
        ),
        pytest.param(
            body_set(released=["1"]),
            "TypeError: released must be an object",
            id="released not an object",
        ),
        pytest.param(
            body_set(released={SAMPLE_UID: "1"}),
            "TypeError: released CPUs of pod 0f1e2d3c-uid must be an object",
            id="released pod not an object",
        ),
        pytest.param(
            body_set(released={SAMPLE_UID: {"app": 1}}),
            "TypeError: 0f1e2d3c-uid/app released must be a string, not int",
            id="released not a string",
        ),
        pytest.param(
            body_set(released={SAMPLE_UID: {"app": "1-x"}}),
            "ValueError: 0f1e2d3c-uid/app released: invalid CPU list '1-x'",
            id="bad released list",
        ),
    ],
)
def test_decode_malformed_body(edit: Any, message: str) -> None:
    doc = document(SAMPLE)
    edit(doc["body"])
    doc["checksum"] = seal(doc["body"])  # a body that is sealed but wrong
    with pytest.raises(CheckpointError, match=re.escape("its body is malformed: ")) as info:
        decode_checkpoint(dump(doc))
    assert message in str(info.value)


@pytest.mark.parametrize("where", ["version", "attempt"])
def test_decode_rejects_booleans_for_integers(where: str) -> None:
    doc = document(SAMPLE)
    if where == "version":
        doc["version"] = True
    else:
        doc["body"]["assignments"][SAMPLE_UID][SAMPLE_NAME]["attempt"] = True
    doc["checksum"] = seal(doc["body"])
    with pytest.raises(CheckpointError):
        decode_checkpoint(dump(doc))


def test_decode_leaves_consistency_to_integrity_problems() -> None:
    # The codec checks form, not meaning: an overlapping state decodes, then is caught.
    state = state_with(STATIC, a="1-2", b="2-3")
    decoded = decode_checkpoint(encode_checkpoint(state))
    assert integrity_problems(decoded, TOPOLOGY) == [
        "b/app holds CPUs 2 that another container also holds"
    ]


def test_an_empty_shared_pool_is_a_problem_even_when_it_adds_up() -> None:
    # Under strict-cpu-reservation every shareable CPU held exclusively leaves nothing shared.
    state = state_with(STRICT, a="1-7", b="9-15")
    assert state.shared == P("")
    assert integrity_problems(state, TOPOLOGY) == [
        "the shared pool is empty: containers without exclusive CPUs have none"
    ]


def test_replan_displaces_the_last_kept_assignments_for_the_shared_pool() -> None:
    # c loses its CPU to the new reserved set; a and b would then hold every shareable CPU of
    # the strict policy, so the later of them (b) gives way too. Displaced keys come sorted.
    state = state_with(STATIC, a="1-7", b="9-14", c="15")
    strict = StaticPolicy.create(
        TOPOLOGY, reserved=P("0,8,15"), options=StaticPolicyOptions(strict_cpu_reservation=True)
    )
    planned, displaced = replan(state, strict)
    assert displaced == [ContainerKey("b", "app"), ContainerKey("c", "app")]
    assert planned.exclusive() == {ContainerKey("a", "app"): P("1-7")}
    assert planned.shared == P("9-14")
    assert integrity_problems(planned, TOPOLOGY) == []


def test_memory_nodes_must_not_be_empty() -> None:
    state = state_with(STATIC, a="1,9")
    key = ContainerKey("a", "app")
    assert integrity_problems(state.update(key, mems=P("0")), TOPOLOGY) == []
    assert integrity_problems(state.update(key, mems=CPUSet()), TOPOLOGY) == [
        "a/app has an empty list of memory nodes"
    ]


def test_an_assignment_defaults_to_no_bookkeeping() -> None:
    assert Assignment(P("1")) == Assignment(P("1"), "", "", 0, "", None)
