"""``cpushim status`` and ``cpushim topology``: the map, the table and the JSON, against expected
text for fixture machines and against the topology and state they were drawn from; and the
command part, on generated sysfs trees and checkpoints.

Expected text lives in tests/unit/status_expected/. After a deliberate change of the output,
``CPUSHIM_REGENERATE_EXPECTED=1 pytest tests/unit/test_status.py`` rewrites the files that
differ and still fails for each, so a difference never passes unseen: read the diff, then run
again without the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import os
import re
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim import checkpoint as checkpoint_module
from shim.checkpoint import CheckpointFile
from shim.cli import build_parser, main
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.policy.none import NonePolicy
from shim.policy.static import ExclusiveRequest, StaticPolicy
from shim.state import Assignment, ContainerKey, CPUState, topology_fingerprint
from shim.status import (
    _MARKS,
    MIN_WIDTH,
    Live,
    Owner,
    OwnerKind,
    container_tags,
    owners_of,
    render_assignments,
    render_map,
    render_status,
    render_topology,
    status_json,
    topology_json,
)
from shim.status_cli import offline_cpus, status_locations, use_color
from shim.topology import CPUInfo, Topology
from tests.fake_runtime import FakeRuntime
from tests.harness.sysfs import (
    OFFLINE_NONCONTIGUOUS,
    PROPERTY_SETTINGS,
    SINGLE_SOCKET_NO_HT,
    MachineSpec,
    expected_topology,
    write_sysfs,
)

P = CPUSet.parse
EXPECTED_DIR = Path(__file__).parent / "status_expected"
REGENERATE = os.environ.get("CPUSHIM_REGENERATE_EXPECTED") == "1"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# -- fixture machines and states ---------------------------------------------------------------

# 2 sockets x 2 cores x 2 threads: CPUs 0-7, siblings n and n+4.
SMALL = MachineSpec(name="small", sockets=2, cores_per_die=2, threads_per_core=2)
# 1 socket x 8 cores, no SMT, booted with isolcpus=6-7.
NO_HT = dataclasses.replace(SINGLE_SOCKET_NO_HT, name="no-ht", isolated=frozenset({6, 7}))
# 2 sockets x 64 cores x 2 threads = 256 CPUs, 4 NUMA nodes and 8 L3 groups per socket.
BIG = MachineSpec(
    name="big",
    sockets=2,
    cores_per_die=64,
    threads_per_core=2,
    numa_per_socket=4,
    l3_per_die=8,
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    spec: MachineSpec
    state: Callable[[Topology], CPUState]

    @property
    def topology(self) -> Topology:
        return expected_topology(self.spec)

    @property
    def offline(self) -> CPUSet:
        return CPUSet(self.spec.offline)


Pin = tuple[str, str, str, int | ExclusiveRequest]  # pod uid, "namespace/name", container, CPUs


def pinned(
    policy: StaticPolicy, pins: list[Pin], *, pending: frozenset[str] = frozenset()
) -> CPUState:
    """A state as the engine would build it: each container's CPUs chosen by the policy in
    turn. Containers in ``pending`` have no container id yet."""
    state = CPUState.empty(policy)
    for index, (uid, pod, name, request) in enumerate(pins):
        cpus = policy.allocate(state.exclusive(), request)
        container_id = "" if name in pending else f"{index:02d}" + "c0ffee" * 10
        assignment = Assignment(cpus, container_id, f"sandbox-{uid}", index % 3, pod)
        state = state.assign(ContainerKey(uid, name), assignment, policy)
    return state


def small_state(topology: Topology) -> CPUState:
    policy = StaticPolicy.create(topology, reserved=P("0,4"))
    return pinned(
        policy,
        [
            ("uid-web", "default/web-0", "app", 2),
            ("uid-db", "default/db-0", "postgres", 1),
        ],
    )


def no_ht_state(topology: Topology) -> CPUState:
    policy = StaticPolicy.create(topology, reserved=P("0"))
    return pinned(
        policy,
        [
            ("uid-api", "prod/api-5d8f7b9c4-h2x9z", "server", 2),
            ("uid-rt", "prod/packet-router-0", "dataplane", ExclusiveRequest(1, "require")),
        ],
    )


def big_state(topology: Topology) -> CPUState:
    policy = StaticPolicy.create(topology, reserved=P("0,128"))
    return pinned(
        policy,
        [
            ("uid-web-1", "default/web-7f9c8d6b5-x2k4q", "app", 4),
            ("uid-web-2", "default/web-7f9c8d6b5-p9z8r", "app", 4),
            ("uid-pg", "db/postgres-0", "postgres", 16),
            ("uid-pg", "db/postgres-0", "metrics", 2),
            ("uid-pg-staging", "staging/postgres-0", "postgres", 2),
            ("uid-train", "ml/trainer-resnet50-imagenet-distributed-0", "worker", 32),
            ("9d1c2f7e-55aa-4e0b-9f3c-0123456789ab", "", "adopted", 6),
        ],
        pending=frozenset({"metrics"}),
    )


def big_many_state(topology: Topology) -> CPUState:
    """60 containers: more than there are single-letter tags."""
    policy = StaticPolicy.create(topology, reserved=P("0,128"))
    return pinned(
        policy, [(f"uid-{i}", f"batch/job-{i}", "main", 2 + (i % 3) * 2) for i in range(60)]
    )


def offline_state(topology: Topology) -> CPUState:
    policy = StaticPolicy.create(topology, reserved=P("0,16"))
    return pinned(policy, [("uid-a", "default/a", "app", 2)])


def none_state(topology: Topology) -> CPUState:
    return CPUState.empty(NonePolicy(topology))


CASES = [
    Case("small", SMALL, small_state),
    Case("no-ht", NO_HT, no_ht_state),
    Case("big", BIG, big_state),
    Case("big-many", BIG, big_many_state),
    Case("offline", OFFLINE_NONCONTIGUOUS, offline_state),
    Case("none-policy", NO_HT, none_state),
]
BY_NAME = {case.name: case for case in CASES}
WIDTHS = [MIN_WIDTH, 60, 80, 132]


# -- expected text -----------------------------------------------------------------------------


def check_expected(name: str, text: str) -> None:
    path = EXPECTED_DIR / name
    old = path.read_text(encoding="utf-8") if path.exists() else None
    if text == old:
        return
    if REGENERATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        pytest.fail(f"rewrote {path}: review the diff, then run without the variable")
    assert old is not None, f"{path} is missing (CPUSHIM_REGENERATE_EXPECTED=1 writes it)"
    assert text == old, f"output differs from {path}"


@pytest.mark.parametrize(
    ("case_name", "width"),
    [
        ("small", 80),
        ("no-ht", 80),
        ("big", 80),
        ("big", 132),
        ("big-many", 80),
        ("offline", 80),
        ("none-policy", 80),
    ],
)
def test_status_text(case_name: str, width: int) -> None:
    case = BY_NAME[case_name]
    topology = case.topology
    text = render_status(
        topology, case.state(topology), offline=case.offline, color=False, width=width
    )
    check_expected(f"status-{case_name}-{width}.txt", text)


@pytest.mark.parametrize("spec", [SMALL, NO_HT, BIG, OFFLINE_NONCONTIGUOUS], ids=lambda s: s.name)
def test_topology_text(spec: MachineSpec) -> None:
    text = render_topology(
        expected_topology(spec), offline=CPUSet(spec.offline), color=False, width=80
    )
    check_expected(f"topology-{spec.name}-80.txt", text)


def test_status_text_in_colour() -> None:
    case = BY_NAME["small"]
    topology = case.topology
    text = render_status(topology, case.state(topology), color=True, width=80)
    check_expected("status-small-80-color.txt", text)


# -- properties of every rendering -------------------------------------------------------------


def renderings(case: Case, width: int, color: bool) -> dict[str, str]:
    topology = case.topology
    state = case.state(topology)
    return {
        "status": render_status(topology, state, offline=case.offline, color=color, width=width),
        "topology": render_topology(topology, offline=case.offline, color=color, width=width),
        "map": render_map(topology, owners_of(topology, state), color, width),
        "table": render_assignments(state, topology, width=width, color=color),
    }


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_no_line_is_wider_than_asked(case: Case, width: int) -> None:
    for color in (False, True):
        for what, text in renderings(case, width, color).items():
            assert text.endswith("\n")
            for line in text.splitlines():
                visible = ANSI.sub("", line)
                assert len(visible) <= width, f"{what}, colour {color}: {line!r}"
                assert visible == visible.rstrip(), f"{what}: trailing blanks in {line!r}"
                assert visible.isascii(), f"{what}: {line!r}"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_colour_adds_escapes_and_nothing_else(case: Case, width: int) -> None:
    plain = renderings(case, width, color=False)
    coloured = renderings(case, width, color=True)
    for what in plain:
        assert "\x1b" not in plain[what]
        assert ANSI.sub("", coloured[what]) == plain[what], what
        # Escapes are balanced: every colour is reset on the same line.
        for line in coloured[what].splitlines():
            opened = len(re.findall(r"\x1b\[(?!0m)[0-9;]+m", line))
            assert opened == line.count("\x1b[0m"), line
    assert "\x1b[" in coloured["status"]


def test_a_narrower_width_than_the_minimum_is_the_minimum() -> None:
    case = BY_NAME["big"]
    topology = case.topology
    state = case.state(topology)
    assert render_status(topology, state, width=10) == render_status(
        topology, state, width=MIN_WIDTH
    )


def test_the_256_cpu_map_keeps_a_row_per_numa_node_in_80_columns() -> None:
    topology = expected_topology(BIG)
    state = big_state(topology)
    grid = grid_lines(render_map(topology, owners_of(topology, state), False, 80))
    assert [line for line in grid if line.startswith("Socket")] == [
        "Socket 0: 64 cores, 128 CPUs, NUMA 0-3",
        "Socket 1: 64 cores, 128 CPUs, NUMA 4-7",
    ]
    assert len(grid) == 10


# -- the map shows every CPU where it is -------------------------------------------------------

ROW = re.compile(r"^  (?:NUMA (\d+))?\s+(\d+)  (.*?)(?:  pinned (\d+)/(\d+))?$")


def grid_lines(text: str) -> list[str]:
    lines = text.splitlines()
    return lines[: lines.index("")]


def parse_map(text: str) -> list[tuple[int, int, list[str]]]:
    """(NUMA node, first CPU, cell texts) for every row of a plain status map."""
    rows = []
    node = -1
    for line in grid_lines(text):
        if line.startswith("Socket "):
            continue
        match = ROW.match(line)
        assert match is not None, line
        if match.group(1) is not None:
            node = int(match.group(1))
        rows.append((node, int(match.group(2)), match.group(3).split()))
    return rows


MARKS = {"reserved": "#", "shared": ".", "isolated": "~", "free": "-"}


def check_map(topology: Topology, owners: Mapping[int, Owner]) -> None:
    """Every online CPU, in every core, in every NUMA node, shows its owner's mark."""
    text = render_map(topology, owners, False, 80)
    tags = container_tags(owners)
    width = max((len(tag) for tag in tags.values()), default=1)

    def mark(cpu: int) -> str:
        owner = owners.get(cpu, Owner("free"))
        return tags[owner.key] if owner.key else MARKS[owner.kind] * width

    rows = parse_map(text)
    cells = [(node, first, cell) for node, first, row in rows for cell in row]
    # Cores in the order the map draws them: by socket, NUMA node, lowest CPU.
    cores = sorted(
        (tuple(CPUSet.from_mask(mask)) for mask in topology.core_masks.values()),
        key=lambda core: (topology.info(core[0]).socket, topology.info(core[0]).numa_node, core),
    )
    assert len(cells) == len(cores)
    for (node, _, cell), core in zip(cells, cores, strict=True):
        assert node == topology.info(core[0]).numa_node
        assert cell == "".join(mark(cpu) for cpu in core)
    # A row's label is the first CPU of its first core.
    index = 0
    for _, first, row in rows:
        assert first == cores[index][0]
        index += len(row)
    # The legend names every tag.
    for key, tag in tags.items():
        assert re.search(rf"(^|  ){tag} \S*{re.escape(key.name)}", text, re.M), tag


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_the_map_shows_each_cpu_owner(case: Case) -> None:
    topology = case.topology
    check_map(topology, owners_of(topology, case.state(topology)))


@st.composite
def machines_and_owners(draw: st.DrawFn) -> tuple[Topology, dict[int, Owner]]:
    spec = draw(
        st.builds(
            MachineSpec,
            sockets=st.integers(1, 2),
            cores_per_die=st.sampled_from([2, 4, 6, 8, 12]),
            threads_per_core=st.integers(1, 2),
            sibling_numbering=st.sampled_from(["intel", "amd"]),
            numa_per_socket=st.sampled_from([1, 2]),
        )
    )
    topology = expected_topology(spec)
    cpus = list(topology.online)
    options: tuple[OwnerKind, ...] = ("reserved", "isolated", "shared", "free", "container")
    kinds = st.sampled_from(options)
    owners: dict[int, Owner] = {}
    for cpu in cpus:
        kind = draw(kinds)
        if kind == "container":
            uid = draw(st.integers(0, 70))
            owners[cpu] = Owner("container", ContainerKey(f"uid-{uid}", "c"), f"ns/pod-{uid}")
        elif draw(st.booleans()) or kind != "free":
            owners[cpu] = Owner(kind)
    return topology, owners


@PROPERTY_SETTINGS
@given(machines_and_owners())
def test_the_map_shows_each_cpu_owner_on_any_machine(
    drawn: tuple[Topology, dict[int, Owner]],
) -> None:
    check_map(*drawn)


# -- owners and tags ---------------------------------------------------------------------------


def test_the_most_specific_owner_wins() -> None:
    topology = expected_topology(dataclasses.replace(SMALL, isolated=frozenset({3, 7})))
    key = ContainerKey("uid", "app")
    # Reserved 0 (also in the pool), 3 isolated and held, 7 isolated and idle, 6 in no pool.
    state = CPUState(
        policy="static",
        options=frozenset(),
        reserved=P("0"),
        topology=topology_fingerprint(topology),
        shared=P("0-2,4-5"),
        assignments={key: Assignment(P("3"), "c", "s", 0, "ns/pod")},
    )
    owners = owners_of(topology, state)
    assert owners[0] == Owner("reserved")
    assert owners[1] == Owner("shared")
    assert owners[3] == Owner("container", key, "ns/pod")
    assert owners[7] == Owner("isolated")
    assert owners[6] == Owner("free")
    assert set(owners) == set(topology.online)


def test_isolated_cpus_show_as_isolated_under_the_none_policy() -> None:
    topology = expected_topology(NO_HT)
    state = none_state(topology)
    assert state.shared == topology.online
    owners = owners_of(topology, state)
    assert {cpu for cpu, owner in owners.items() if owner.kind == "isolated"} == {6, 7}
    document = status_json(topology, state)
    assert [entry["in_shared_pool"] for entry in document["cpus"]] == [True] * 8


def test_tags_follow_the_lowest_cpu_and_stay_unique() -> None:
    keys = [ContainerKey(f"uid-{i}", "c") for i in range(700)]
    owners = {700 - i: Owner("container", key) for i, key in enumerate(keys)}
    tags = container_tags(owners)
    assert len(set(tags.values())) == 700
    assert tags[keys[-1]] == "Aaa"  # holds CPU 1: more than 676 containers take 3 letters
    assert all(re.fullmatch(r"[A-Z][a-z]{2}", tag) for tag in tags.values())
    few = container_tags({5: Owner("container", keys[0]), 2: Owner("container", keys[1])})
    assert few == {keys[1]: "A", keys[0]: "B"}
    many = container_tags({cpu: Owner("container", keys[cpu]) for cpu in range(53)})
    assert [many[keys[i]] for i in (0, 1, 26, 52)] == ["Aa", "Ab", "Ba", "Ca"]


def test_the_legend_adds_the_namespace_only_where_names_clash() -> None:
    topology = expected_topology(BIG)
    text = render_map(topology, owners_of(topology, big_state(topology)), False, 132)
    assert "db/postgres-0/postgres" in text
    assert "staging/postgres-0/postgres" in text
    assert " postgres-0/metrics" in text
    assert " web-7f9c8d6b5-x2k4q/app" in text
    assert " 9d1c2f7e/adopted" in text  # no pod name recorded: the UID's start


# -- the table ---------------------------------------------------------------------------------


def table_rows(text: str) -> list[list[str]]:
    """Rows of a plain table, each a list of its first line's cells, with the CPU list of its
    continuation lines joined back on."""
    rows: list[list[str]] = []
    for line in text.splitlines()[1:]:
        if line.startswith(" "):
            rows[-1][-1] += line.strip()
        else:
            rows.append(line.split())
    return rows


@pytest.mark.parametrize("width", [None, *WIDTHS])
def test_the_table_never_loses_a_cpu(width: int | None) -> None:
    topology = expected_topology(BIG)
    state = big_state(topology)
    text = render_assignments(state, topology, width=width)
    rows = table_rows(text)
    owners = owners_of(topology, state)
    tags = container_tags(owners)
    expected = sorted(state.assignments.items(), key=lambda item: item[1].cpus.min())
    assert [row[0] for row in rows] == [tags[key] for key, _ in expected]
    assert [P(row[-1]) for row in rows] == [a.cpus for _, a in expected]
    assert [row[-2] for row in rows] == [
        str(CPUSet(topology.numa_nodes_of(a.cpus))) for _, a in expected
    ]


def test_the_table_in_full() -> None:
    topology = expected_topology(BIG)
    state = big_state(topology)
    header, *lines = render_assignments(state, topology).splitlines()
    assert header.split("  ")[0:1] == ["TAG"]
    assert re.split(r"\s{2,}", header) == [
        "TAG",
        "POD",
        "CONTAINER",
        "CONTAINER ID",
        "ATTEMPT",
        "NUMA",
        "CPUS",
    ]
    rows = {line.split()[2]: line.split() for line in lines}
    assert rows["metrics"][1:5] == ["db/postgres-0", "metrics", "(creating)", "0"]
    assert rows["worker"][1] == "ml/trainer-resnet50-imagenet-distributed-0"
    assert rows["worker"][3] == "05c0ffeec0ffe"  # 13 characters, as crictl shows them
    assert rows["adopted"][1] == "9d1c2f7e-55aa-4e0b-9f3c-0123456789ab"


def test_a_narrow_table_drops_columns_before_names_become_unreadable() -> None:
    topology = expected_topology(BIG)
    state = big_state(topology)

    def header(width: int) -> list[str]:
        return re.split(r"\s{2,}", render_assignments(state, topology, width=width).split("\n")[0])

    everything = ["TAG", "POD", "CONTAINER", "CONTAINER ID", "ATTEMPT", "NUMA", "CPUS"]
    assert header(100) == everything
    # One column is enough at 80: the narrowest one that makes room goes, and the room left
    # goes back to the pod names.
    assert header(80) == ["TAG", "POD", "CONTAINER", "CONTAINER ID", "NUMA", "CPUS"]
    assert "default/web-7f9c8d6b5-x2k4q" in render_assignments(state, topology, width=80)
    assert header(60) == ["TAG", "POD", "CONTAINER", "NUMA", "CPUS"]
    assert "de../web-7f9c8d6b5-x2k4q" in render_assignments(state, topology, width=60)


def test_memory_kubelet_put_elsewhere_gets_a_column_of_its_own() -> None:
    """Only when some container's memory nodes are not those of its CPUs (kubelet's memory
    manager chose them, and its CPUs had to come from elsewhere)."""
    topology = expected_topology(BIG)
    state = big_state(topology)
    key, first = next(iter(state.assignments.items()))
    own_nodes = CPUSet(topology.numa_nodes_of(first.cpus))
    same = state.update(key, mems=own_nodes)
    assert "MEMS" not in render_assignments(same, topology).splitlines()[0]
    other = next(n for n in topology.numa_nodes if n not in own_nodes)
    moved = state.update(key, mems=CPUSet([other]))
    header, *lines = render_assignments(moved, topology).splitlines()
    columns = re.split(r"\s{2,}", header)
    assert columns[-2:] == ["MEMS", "CPUS"]
    row = next(line for line in lines if key.name in line.split())
    assert row.split()[-2] == str(other)
    document = round_trip(status_json(topology, moved))
    entry = next(a for a in document["assignments"] if a["container"] == key.name)
    assert entry["mems"] == str(other)


def test_the_memory_column_gives_cpus_of_a_memory_less_node_the_nodes_with_memory() -> None:
    """A container whose memory follows its CPUs shows where it is: for CPUs of a node
    without memory (node 1 here) every node with memory, not the node of its CPUs."""
    big = expected_topology(BIG)
    topology = Topology(cpus=big.cpus, isolated=big.isolated, memory_nodes=P("0,2-7"))
    state = big_state(topology)
    worker = next(k for k, a in state.assignments.items() if k.name == "worker")
    assert topology.numa_nodes_of(state.assignments[worker].cpus) == {1}
    adopted = next(k for k in state.assignments if k.name == "adopted")
    elsewhere = state.update(adopted, mems=P("3"))  # kubelet's memory manager's choice
    header, *lines = render_assignments(elsewhere, topology).splitlines()
    assert re.split(r"\s{2,}", header)[-2:] == ["MEMS", "CPUS"]
    row = next(line for line in lines if "worker" in line.split())
    assert row.split()[-2] == "0,2-7"


def test_the_memory_column_shows_the_nodes_given_when_kubelets_lost_their_memory() -> None:
    """kubelet's memory manager chose node 1, whose memory went offline since (memory
    hotplug): the container's cgroup gets every node with memory, not node 1, and the column
    says so, with kubelet's choice after it; the JSON keeps kubelet's choice in "mems"."""
    big = expected_topology(BIG)
    topology = Topology(cpus=big.cpus, isolated=big.isolated, memory_nodes=P("0,2-7"))
    state = big_state(topology)
    worker = next(k for k, a in state.assignments.items() if k.name == "worker")
    app = next(k for k, a in state.assignments.items() if a.pod.endswith("x2k4q"))
    assert topology.numa_nodes_of(state.assignments[worker].cpus) == {1}
    assert topology.numa_nodes_of(state.assignments[app].cpus) == {0}
    # Node 0's memory is the app's own: only its choice of node 1 beside it is narrowed.
    narrowed = state.update(worker, mems=P("1")).update(app, mems=P("0-1"))
    header, *lines = render_assignments(narrowed, topology, width=132).splitlines()
    columns = re.split(r"\s{2,}", header)
    assert columns[-2:] == ["MEMS", "CPUS"]
    cells = {
        tuple(line.split()[1:3]): re.split(r"\s{2,}", line)[columns.index("MEMS")] for line in lines
    }
    assert cells["ml/trainer-resnet50-imagenet-distributed-0", "worker"] == "0,2-7 (kubelet: 1)"
    assert cells["default/web-7f9c8d6b5-x2k4q", "app"] == "0 (kubelet: 0-1)"
    assert cells["default/web-7f9c8d6b5-p9z8r", "app"] == "0"
    document = round_trip(status_json(topology, narrowed))
    given = {
        (a["pod"], a["container"]): (a["mems"], a["mems_given"]) for a in document["assignments"]
    }
    assert given["ml/trainer-resnet50-imagenet-distributed-0", "worker"] == ("1", "0,2-7")
    assert given["default/web-7f9c8d6b5-x2k4q", "app"] == ("0-1", "0")
    assert given["default/web-7f9c8d6b5-p9z8r", "app"] == (None, "0")


@pytest.mark.parametrize(
    ("memory_nodes", "line"),
    [
        ("0-8", "0-8 (8 without CPUs)"),
        ("0,2-7", "0,2-7 (1 without memory)"),
        ("0,2-8", "0,2-8 (8 without CPUs; 1 without memory)"),
        ("0-7", None),
    ],
    ids=["memory-only node", "memory-less node", "both", "the CPUs' nodes"],
)
def test_the_topology_names_the_memory_nodes_when_they_are_not_the_cpus(
    memory_nodes: str, line: str | None
) -> None:
    """Memory-only nodes (CXL memory) and memory-less ones decide what an exclusive
    container's and every node's cpuset.mems are: the page says so only when they differ
    from the CPUs' nodes, and the JSON always lists them."""
    big = expected_topology(BIG)
    assert CPUSet(big.numa_nodes) == P("0-7")
    topology = Topology(cpus=big.cpus, isolated=big.isolated, memory_nodes=P(memory_nodes))
    page = render_topology(topology, width=80).splitlines()
    found = [text.split(None, 2)[2] for text in page if text.startswith("memory nodes ")]
    assert found == ([line] if line else [])
    assert topology_json(topology)["memory_nodes"] == memory_nodes


@pytest.mark.parametrize(
    ("memory_nodes", "line"),
    [
        ("0,2-7", "nodes 0,2-7 (1 without memory)"),
        ("0,2-8", "nodes 0,2-8 (8 without CPUs; 1 without memory)"),
        ("0-8", None),
        ("0-7", None),
    ],
    ids=["memory-less node", "both", "memory-only node", "the CPUs' nodes"],
)
def test_the_status_names_the_nodes_without_memory(memory_nodes: str, line: str | None) -> None:
    """A node without memory is why the MEMS column gives a container other nodes than
    kubelet's memory manager chose: the summary says which, as the topology page does, and
    only then (a memory-only node changes no container's nodes)."""
    big = expected_topology(BIG)
    topology = Topology(cpus=big.cpus, isolated=big.isolated, memory_nodes=P(memory_nodes))
    page = render_status(topology, big_state(topology), width=80).splitlines()
    summary = page[: page.index("")]
    found = [text.split(None, 1)[1] for text in summary if text.startswith("memory ")]
    assert found == ([line] if line else [])


def test_an_empty_state_has_no_table() -> None:
    topology = expected_topology(SMALL)
    state = CPUState.empty(StaticPolicy.create(topology, reserved=P("0")))
    assert render_assignments(state, topology) == (
        "No exclusive assignments: every container runs in the shared pool.\n"
    )


# -- problems ----------------------------------------------------------------------------------


def test_a_checkpoint_for_other_cpus_is_noted_as_re_planned_not_inconsistent() -> None:
    topology = expected_topology(SMALL)
    state = dataclasses.replace(small_state(topology), topology="sha256:" + "0" * 32)
    text = render_status(topology, state, width=80)
    assert "inconsistent" not in text
    assert "note: the checkpoint was written for other CPUs" in " ".join(text.split())
    document = status_json(topology, state)
    assert document["problems"] == []
    assert document["topology_changed"] is True
    assert status_json(topology, small_state(topology))["topology_changed"] is False
    assert "note:" not in render_status(topology, small_state(topology), width=80)


# -- JSON --------------------------------------------------------------------------------------

TOPOLOGY_KEYS = ["format", "online", "isolated", "offline", "memory_nodes", "summary", "cpus"]
STATUS_KEYS = [
    *TOPOLOGY_KEYS,
    "policy",
    "options",
    "reserved",
    "shared",
    "problems",
    "topology_changed",
    "assignments",
]
CPU_KEYS = [
    "cpu",
    "socket",
    "die",
    "numa_node",
    "core_id",
    "last_level_cache",
    "uncore_cache",
    "isolated",
]
OWNER_KEYS = ["owner", "tag", "pod_uid", "container", "in_shared_pool"]
ASSIGNMENT_KEYS = [
    "tag",
    "pod_uid",
    "pod",
    "container",
    "container_id",
    "sandbox_id",
    "attempt",
    "cpus",
    "numa_nodes",
    "sockets",
    "mems",
    "mems_given",
]


def round_trip(document: dict[str, Any]) -> dict[str, Any]:
    back: dict[str, Any] = orjson.loads(orjson.dumps(document))
    assert back == document
    return back


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_topology_json_round_trips(case: Case) -> None:
    topology = case.topology
    document = round_trip(topology_json(topology, offline=case.offline))
    assert list(document) == TOPOLOGY_KEYS
    assert document["format"] == 1
    assert all(list(entry) == CPU_KEYS for entry in document["cpus"])
    rebuilt = Topology(
        cpus=tuple(
            CPUInfo(
                cpu=e["cpu"],
                socket=e["socket"],
                core_id=e["core_id"],
                numa_node=e["numa_node"],
                die=e["die"],
                uncore_cache=e["uncore_cache"],
                last_level_cache=e["last_level_cache"],
            )
            for e in document["cpus"]
        ),
        isolated=CPUSet(e["cpu"] for e in document["cpus"] if e["isolated"]),
    )
    assert rebuilt == topology
    assert P(document["online"]) == topology.online
    assert P(document["isolated"]) == topology.isolated
    assert P(document["offline"]) == case.offline
    summary = document["summary"]
    assert summary["cpus"] == len(topology.online)
    assert summary["cores"] == topology.num_cores
    assert summary["numa_nodes"] == topology.num_numa_nodes
    assert summary["last_level_caches"] == len({c.last_level_cache for c in topology.cpus})
    assert summary["uncore_caches"] == len(topology.uncore_masks)


def test_uncore_groups_are_told_apart_from_last_level_caches() -> None:
    # Each socket's L3 is split per NUMA node: the highest-level cache is the node's, and
    # prefer-align-cpus-by-uncorecache groups by socket (kubelet's rule), so the two differ.
    topology = expected_topology(
        MachineSpec(sockets=2, cores_per_die=4, threads_per_core=2, numa_per_socket=2, l3_per_die=2)
    )
    document = topology_json(topology)
    assert document["summary"]["last_level_caches"] == topology.num_numa_nodes
    assert document["summary"]["uncore_caches"] == topology.num_sockets
    for entry in document["cpus"]:
        assert topology.cpus_in_uncore_cache(entry["uncore_cache"]) == topology.cpus_in_socket(
            entry["socket"]
        )
        sharing = CPUSet(
            e["cpu"] for e in document["cpus"] if e["last_level_cache"] == entry["last_level_cache"]
        )
        assert sharing == topology.cpus_in_numa_node(entry["numa_node"])
    page = render_topology(topology)
    assert re.search(rf"^last-level caches +{topology.num_numa_nodes}$", page, re.MULTILINE)
    assert re.search(rf"^uncore caches +{topology.num_sockets}$", page, re.MULTILINE)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_status_json_round_trips(case: Case) -> None:
    topology = case.topology
    state = case.state(topology)
    document = round_trip(status_json(topology, state, offline=case.offline))
    assert list(document) == STATUS_KEYS
    assert all(list(entry) == CPU_KEYS + OWNER_KEYS for entry in document["cpus"])
    assert all(list(entry) == ASSIGNMENT_KEYS for entry in document["assignments"])
    rebuilt = CPUState(
        policy=document["policy"],
        options=frozenset(document["options"]),
        reserved=P(document["reserved"]),
        topology=topology_fingerprint(topology),
        shared=P(document["shared"]),
        assignments={
            ContainerKey(a["pod_uid"], a["container"]): Assignment(
                P(a["cpus"]),
                a["container_id"],
                a["sandbox_id"],
                a["attempt"],
                a["pod"],
                None if a["mems"] is None else P(a["mems"]),
            )
            for a in document["assignments"]
        },
    )
    assert rebuilt == state
    owners = owners_of(topology, state)
    tags = container_tags(owners)
    for entry in document["cpus"]:
        owner = owners[entry["cpu"]]
        assert entry["owner"] == owner.kind
        if owner.key is None:
            assert (entry["tag"], entry["pod_uid"], entry["container"]) == (None, None, None)
        else:
            assert entry["tag"] == tags[owner.key]
            assert (entry["pod_uid"], entry["container"]) == (owner.key.pod_uid, owner.key.name)
    for a in document["assignments"]:
        cpus = P(a["cpus"])
        assert a["numa_nodes"] == sorted(topology.numa_nodes_of(cpus))
        assert a["sockets"] == sorted(topology.sockets_of(cpus))


# -- the commands ------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, CPUState]:
    """A fake sysfs (the offline fixture) and a checkpoint written for it; 100 columns."""
    monkeypatch.setenv("COLUMNS", "100")
    sysfs = write_sysfs(OFFLINE_NONCONTIGUOUS, tmp_path / "sys")
    state = offline_state(expected_topology(OFFLINE_NONCONTIGUOUS))
    state_dir = tmp_path / "state"
    CheckpointFile(state_dir).save_sync(state)
    return sysfs, state_dir, state


def run(argv: list[str]) -> int:
    """The command as ``cpushim`` runs it."""
    return main(argv)


def test_status_prints_the_page(
    node: tuple[Path, Path, CPUState], capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, state_dir, state = node
    # No socket to ask, and none looked for on this machine.
    argv = ["status", "--state-dir", str(state_dir), "--sysfs-root", str(sysfs), "--socket", ""]
    assert run([*argv, "--color", "never"]) == 0
    out, err = capsys.readouterr()
    topology = expected_topology(OFFLINE_NONCONTIGUOUS)
    assert out == render_status(topology, state, offline=P("5,23"), width=100)
    assert err == ""
    assert run([*argv, "--color", "always"]) == 0
    coloured = capsys.readouterr().out
    assert "\x1b[" in coloured
    assert ANSI.sub("", coloured) == out
    # Captured output is no terminal: auto means no colour.
    assert run(argv) == 0
    assert capsys.readouterr().out == out


def test_status_json(node: tuple[Path, Path, CPUState], capsys: pytest.CaptureFixture[str]) -> None:
    sysfs, state_dir, state = node
    argv = ["status", "--json", "--state-dir", str(state_dir), "--sysfs-root", str(sysfs)]
    assert run([*argv, "--socket", ""]) == 0
    document = orjson.loads(capsys.readouterr().out)
    topology = expected_topology(OFFLINE_NONCONTIGUOUS)
    assert document == status_json(topology, state, offline=P("5,23"))
    assert document["offline"] == "5,23"


def test_topology_prints_the_page_and_json(
    node: tuple[Path, Path, CPUState], capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, _, _ = node
    topology = expected_topology(OFFLINE_NONCONTIGUOUS)
    assert run(["topology", "--sysfs-root", str(sysfs)]) == 0
    assert capsys.readouterr().out == render_topology(topology, offline=P("5,23"), width=100)
    assert run(["topology", "--sysfs-root", str(sysfs), "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out) == topology_json(topology, offline=P("5,23"))


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n")
    assert err.count("\n") == 1, err
    return err


def test_a_missing_checkpoint_is_one_line_and_exit_1(
    node: tuple[Path, Path, CPUState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, _, _ = node
    empty = tmp_path / "empty"
    assert run(["status", "--state-dir", str(empty), "--sysfs-root", str(sysfs)]) == 1
    err = one_line_error(capsys)
    assert err.startswith(f"cpushim status: no checkpoint at {empty / 'state.json'}:")
    assert not empty.exists()  # a status look creates nothing


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        # Cut inside the document (the file is padded with spaces after it).
        (lambda data: data[: len(data.rstrip()) // 2], "it is not JSON"),
        (lambda data: data.replace(b'"0,16"', b'"0,17"'), "checksum does not match"),
        (lambda data: b"\n\n{\n", "it is not JSON"),
    ],
)
def test_a_corrupt_checkpoint_is_one_line_and_exit_1(
    node: tuple[Path, Path, CPUState],
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[bytes], bytes],
    says: str,
) -> None:
    sysfs, state_dir, _ = node
    path = state_dir / "state.json"
    path.write_bytes(damage(path.read_bytes()))
    assert run(["status", "--state-dir", str(state_dir), "--sysfs-root", str(sysfs)]) == 1
    err = one_line_error(capsys)
    assert err.startswith(f"cpushim status: cannot use the checkpoint: {path}: ")
    assert says in err


def test_a_checkpoint_read_while_cpushim_rewrites_it_is_read_again(
    node: tuple[Path, Path, CPUState],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two writes during one read can tear it: the file read is the spare the second write
    overwrites in place. The checksum tells, and a second read finds the file whole."""
    sysfs, state_dir, _ = node
    path = state_dir / "state.json"
    real_read = checkpoint_module.read_regular_file  # type: ignore[attr-defined]
    reads: list[Path] = []

    def torn_once(where: Path) -> bytes:
        reads.append(where)
        data = real_read(where)
        return data[: len(data.rstrip()) // 2] if len(reads) == 1 else data

    monkeypatch.setattr(checkpoint_module, "read_regular_file", torn_once)
    argv = ["status", "--state-dir", str(state_dir), "--sysfs-root", str(sysfs), "--socket", ""]
    assert run(argv) == 0
    assert reads == [path, path]
    assert "cannot use the checkpoint" not in capsys.readouterr().err


def test_an_unreadable_topology_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["topology", "--sysfs-root", str(tmp_path)]) == 1
    err = one_line_error(capsys)
    assert err.startswith("cpushim topology: cannot read the CPU topology: cannot read ")
    assert run(["status", "--sysfs-root", str(tmp_path), "--state-dir", str(tmp_path)]) == 1
    assert one_line_error(capsys).startswith("cpushim status: cannot read the CPU topology")


def test_offline_cpus_are_the_present_ones_not_online(tmp_path: Path) -> None:
    sysfs = write_sysfs(OFFLINE_NONCONTIGUOUS, tmp_path)
    topology = Topology.from_sysfs(sysfs)
    assert offline_cpus(sysfs, topology) == P("5,23")
    # The kernel's "possible" may run far beyond what is present; only present CPUs count.
    (sysfs / "devices/system/cpu/offline").write_text("5,23-255\n")
    assert offline_cpus(sysfs, topology) == P("5,23")
    (sysfs / "devices/system/cpu/present").unlink()
    assert offline_cpus(sysfs, topology) == CPUSet()


class FakeStream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("choice", "tty", "environ", "expected"),
    [
        ("always", False, {}, True),
        ("never", True, {"TERM": "xterm"}, False),
        ("auto", True, {"TERM": "xterm-256color"}, True),
        ("auto", False, {"TERM": "xterm-256color"}, False),
        ("auto", True, {"TERM": "dumb"}, False),
        ("auto", True, {}, False),
        ("auto", True, {"TERM": "xterm", "NO_COLOR": "1"}, False),
        ("auto", True, {"TERM": "xterm", "NO_COLOR": ""}, True),  # no-color.org: non-empty
        ("always", True, {"TERM": "dumb", "NO_COLOR": "1"}, True),
    ],
)
def test_use_color(choice: str, tty: bool, environ: dict[str, str], expected: bool) -> None:
    assert use_color(choice, FakeStream(tty), environ) is expected


def test_the_commands_parse_their_defaults() -> None:
    args = parse(["status"])
    assert (args.config_path, args.sysfs_root, args.json, args.color) == (
        None,  # as for cpushim run: no config file unless one is named
        Path("/sys"),
        False,
        "auto",
    )
    assert status_locations(args) == (Path("/var/lib/cpushim"), "unix:///run/cpushim/cri.sock")
    assert not hasattr(parse(["topology"]), "state_dir")
    with pytest.raises(SystemExit):
        parse(["status", "--color", "sometimes"])


# -- what the runtime says, through cpushim's socket --------------------------------------------


@pytest.mark.anyio
async def test_status_asks_the_socket_for_each_pinned_containers_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    topology = expected_topology(SMALL)
    sysfs = write_sysfs(SMALL, tmp_path / "sys")
    async with FakeRuntime() as fake:
        sandbox = fake.add_sandbox(
            pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="web-0", uid="uid-web"))
        )
        running = fake.add_container(
            sandbox, pb.ContainerConfig(metadata=pb.ContainerMetadata(name="app"))
        )
        state = small_state(topology)
        state = state.update(ContainerKey("uid-web", "app"), container_id=running)
        state_dir = tmp_path / "state"
        CheckpointFile(state_dir).save_sync(state)
        argv = ["status", "--state-dir", str(state_dir), "--sysfs-root", str(sysfs)]
        argv += ["--socket", fake.endpoint, "--color", "never"]

        def status_page() -> str:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert main(argv) == 0
            return out.getvalue()

        page = await asyncio.to_thread(status_page)
    live = Live(fake.endpoint, containers={running: "running"})
    assert page == render_status(topology, state, width=100, live=live)
    assert f"runtime     {fake.endpoint}: 1 containers" in page
    rows = {line.split()[0]: line.split() for line in page.splitlines() if "default/" in line}
    assert rows["A"][-2] == "running"  # web-0/app, then its CPUs
    assert rows["B"][-2] == "gone"  # db-0/postgres: the runtime no longer knows it


def test_status_says_when_the_socket_does_not_answer(
    node: tuple[Path, Path, CPUState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, state_dir, _ = node
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unbound:
        unbound.bind(str(dead))  # a socket file nobody listens on
        argv = ["status", "--state-dir", str(state_dir), "--sysfs-root", str(sysfs)]
        assert run([*argv, "--socket", f"unix://{dead}", "--json"]) == 0
    document = orjson.loads(capsys.readouterr().out)
    assert document["runtime"]["source"] == f"unix://{dead}"
    assert "unavailable" in document["runtime"]["error"]
    assert {a["state"] for a in document["assignments"]} == {"?"}


def test_status_without_a_socket_reads_the_checkpoint_only(
    node: tuple[Path, Path, CPUState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, state_dir, _ = node
    argv = ["status", "--state-dir", str(state_dir), "--sysfs-root", str(sysfs), "--json"]
    assert run([*argv, "--socket", f"unix://{tmp_path}/missing.sock"]) == 0
    assert "runtime" not in orjson.loads(capsys.readouterr().out)
    assert run([*argv, "--socket", ""]) == 0
    assert "runtime" not in orjson.loads(capsys.readouterr().out)


def test_status_without_a_socket_says_so_on_stderr_in_text_mode_only(
    node: tuple[Path, Path, CPUState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """cpushim removes its socket when it stops: the page alone would not tell that the
    containers' states are missing because cpushim is down (or listens elsewhere)."""
    sysfs, state_dir, state = node
    missing = tmp_path / "missing.sock"
    argv = ["status", "--state-dir", str(state_dir), "--sysfs-root", str(sysfs)]
    assert run([*argv, "--socket", f"unix://{missing}", "--color", "never"]) == 0
    out, err = capsys.readouterr()
    topology = expected_topology(OFFLINE_NONCONTIGUOUS)
    assert out == render_status(topology, state, offline=P("5,23"), width=100)
    assert err.count("\n") == 1, err
    assert err.startswith(f"cpushim status: no socket at {missing}: cpushim is not running")
    assert "--socket" in err
    assert "--config" in err
    # Scripts get the JSON as it was: no runtime key, nothing on stderr.
    assert run([*argv, "--socket", f"unix://{missing}", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "runtime" not in orjson.loads(out)
    assert err == ""
    # Asked not to ask: nothing to say.
    assert run([*argv, "--socket", "", "--color", "never"]) == 0
    assert capsys.readouterr().err == ""


# -- the config file of cpushim run --------------------------------------------------------------


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_status_reads_the_state_dir_and_socket_from_the_config_file(
    node: tuple[Path, Path, CPUState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, state_dir, state = node
    dead = tmp_path / "dead.sock"
    config = write_config(
        tmp_path,
        f'listen = "unix://{dead}"\nstateDir = "{state_dir}"\ncpuManagerPolicy = "static"\n',
    )
    argv = ["status", "--config", str(config), "--sysfs-root", str(sysfs), "--json"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unbound:
        unbound.bind(str(dead))  # a socket file nobody listens on: asked, not reachable
        assert run(argv) == 0
    document = orjson.loads(capsys.readouterr().out)
    assert document["runtime"]["source"] == f"unix://{dead}"
    del document["runtime"]
    for entry in document["assignments"]:
        del entry["state"]
    topology = expected_topology(OFFLINE_NONCONTIGUOUS)
    assert document == status_json(topology, state, offline=P("5,23"))


def test_flags_win_over_the_config_file(
    node: tuple[Path, Path, CPUState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, state_dir, state = node
    elsewhere = tmp_path / "elsewhere"
    config = write_config(
        tmp_path, f'listen = "unix://{tmp_path}/other.sock"\nstateDir = "{elsewhere}"\n'
    )
    argv = ["status", "--config", str(config), "--sysfs-root", str(sysfs), "--json"]
    assert run([*argv, "--state-dir", str(state_dir), "--socket", ""]) == 0
    out, err = capsys.readouterr()
    topology = expected_topology(OFFLINE_NONCONTIGUOUS)
    assert orjson.loads(out) == status_json(topology, state, offline=P("5,23"))
    assert err == ""
    # Without the flag, the file's stateDir is the one read.
    assert run(argv) == 1
    assert one_line_error(capsys).startswith(
        f"cpushim status: no checkpoint at {elsewhere / 'state.json'}:"
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('listen = "unix:///x.sock"\nstateDir = 3\n', ":2: stateDir: want a string, got 3"),
        ("\nlisten = \n", ":2: Invalid value"),  # tomllib's words, then where
        (
            'listen = "tcp://x"\n',
            ":1: listen: unsupported endpoint 'tcp://x': only unix:// sockets are served",
        ),
        ('stateDr = "/x"\n', ":1: stateDr: unknown key; did you mean stateDir?"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_file_and_line_and_exit_1(
    node: tuple[Path, Path, CPUState],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    says: str,
) -> None:
    sysfs, state_dir, _ = node
    config = write_config(tmp_path, text)
    # The file is refused whole, as cpushim run refuses it: flags do not mend it.
    argv = ["status", "--config", str(config), "--sysfs-root", str(sysfs)]
    assert run([*argv, "--state-dir", str(state_dir), "--socket", ""]) == 1
    assert one_line_error(capsys).startswith(f"cpushim status: {config}{says}")


def test_a_missing_config_file_is_one_line_and_exit_1(
    node: tuple[Path, Path, CPUState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, state_dir, _ = node
    missing = tmp_path / "config.toml"
    argv = ["status", "--config", str(missing), "--sysfs-root", str(sysfs)]
    assert run([*argv, "--state-dir", str(state_dir)]) == 1
    assert one_line_error(capsys) == (
        f"cpushim status: {missing}: cannot read the config file: No such file or directory\n"
    )


# -- the operations guide ----------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def guide_section(title: str) -> str:
    """The text of the operations guide's section headed ``title``, up to the next heading
    of the same or a higher level."""
    text = GUIDE.read_text()
    found = re.search(rf"^(#+) {re.escape(title)}\n", text, re.MULTILINE)
    assert found is not None, f"docs/operations.md has no section {title!r}"
    level = len(found.group(1))
    rest = text[found.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest if end is None else rest[: end.start()]


def json_keys(value: object) -> set[str]:
    """Every key of every object in a JSON document, at any depth."""
    if isinstance(value, dict):
        return set(value).union(*(json_keys(item) for item in value.values()))
    if isinstance(value, list):
        return set().union(*(json_keys(item) for item in value))
    return set()


def test_the_guide_names_every_key_of_the_json() -> None:
    """Scripts read ``--json``: every key either command can print is in the guide, as it
    spells it, so that a key added to the output cannot go undocumented."""
    section = guide_section("Read the JSON")
    named = set(re.findall(r"`([a-z_]+)`", section))
    case = BY_NAME["big"]
    topology, state = case.topology, case.state(case.topology)
    live = Live("unix:///run/cpushim/cri.sock", containers={})
    printed = json_keys(status_json(topology, state, offline=case.offline, live=live))
    assert printed >= json_keys(topology_json(topology, offline=case.offline))
    assert {"state", "runtime"} <= printed
    assert not printed - named, f"docs/operations.md does not name: {sorted(printed - named)}"


def test_the_guide_names_every_column_and_owner_of_the_page() -> None:
    """What the guide says about reading ``cpushim status``: each column of the table (with
    the memory and state columns, which only show at times) and each mark of the map."""
    section = guide_section("Read the page")
    case = BY_NAME["big"]
    topology, state = case.topology, case.state(case.topology)
    key, first = next(iter(state.assignments.items()))
    other = next(n for n in topology.numa_nodes if n not in topology.numa_nodes_of(first.cpus))
    moved = state.update(key, mems=CPUSet([other]))
    page = render_status(topology, moved, width=200, live=Live("unix:///x.sock", containers={}))
    header = next(line for line in page.splitlines() if line.startswith("TAG "))
    columns = re.split(r"\s{2,}", header.strip())
    assert {"MEMS", "STATE"} <= set(columns)
    missing = [column for column in columns if f"`{column}`" not in section]
    assert not missing, f"docs/operations.md does not name the columns {missing}"
    # The map's marks for what is not a container's; containers have letters.
    assert not {mark for mark in _MARKS.values() if f"`{mark}`" not in section}


def test_the_guide_names_every_flag_of_status_and_topology() -> None:
    """An operator looks for what ``cpushim status`` and ``cpushim topology`` accept where
    the guide shows them: each flag is named there, as written on the command line."""
    section = guide_section("Look at the CPUs")
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    flags = {
        flag
        for command in ("status", "topology")
        for action in subparsers.choices[command]._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }
    assert {"--json", "--color", "--sysfs-root"} <= flags
    missing = sorted(flag for flag in flags if not re.search(rf"`{flag}[` ]", section))
    assert not missing, f"docs/operations.md does not name {missing}"
