"""What ``cpushim status`` and ``cpushim topology`` print. Pure: values in, text or plain data
out; ``shim.status_cli`` does the reading and the printing.

The map draws every online CPU where it sits: a line per socket, and under it a row (or, when
the terminal is narrow or a node is large, a few rows) per NUMA node. A cell is a core: in the
status map one mark per hardware thread, in the topology map the threads' CPU ids. A status row
starts with its first CPU id, so a mark can be found again without counting from zero.

Marks: a container's tag (``A``, ``B``, ... in the order of the lowest CPU each holds; ``Aa``,
``Ab``, ... once there are more containers than letters), ``#`` reserved, ``.`` shared pool,
``~`` an idle isolated CPU, ``-`` free (in no pool). Offline CPUs have no place in sysfs's
topology, so they are listed apart. A 256-CPU node (2 sockets x 64 cores x 2 threads, 8 NUMA
nodes) takes 10 lines of 80 columns.

JSON (``--json``), format 1. Keys are only ever added; a change that removes or redefines a
key raises ``format``. CPU lists are strings in the kernel's list format (``"0-3,8"``, ``""``
for none).

``topology_json``::

    format            1
    online, isolated, offline
                      CPU lists (offline = present in sysfs but not online)
    memory_nodes      the NUMA nodes with memory (has_memory), a list in the same format
    summary           {"sockets", "dies", "numa_nodes", "last_level_caches",
                       "uncore_caches", "cores", "cpus"}: counts of what is online;
                       "threads_per_core": [min, max]
    cpus              one object per online CPU, by id: {"cpu", "socket", "die",
                      "numa_node", "core_id", "last_level_cache", "uncore_cache",
                      "isolated"}; core_id repeats across sockets, so a core is (socket,
                      die, core_id); last_level_cache numbers the groups sharing the
                      highest-level cache (the socket id without cache data),
                      uncore_cache the groups prefer-align-cpus-by-uncorecache keeps a
                      request in (kubelet's: a level 3+ cache that is not the NUMA node's
                      own, else the socket); both by lowest CPU

``status_json``: everything ``topology_json`` has, plus::

    policy, options   the checkpoint's policy name and sorted option names
    reserved, shared  CPU lists
    problems          what is inconsistent in the checkpoint or with this machine (strings;
                      a running cpushim would refuse this checkpoint at start), usually []
    topology_changed  true when the checkpoint was written for other CPUs (some offline,
                      online, added or isolated since): cpushim re-plans at its next start
    assignments       one object per exclusive assignment, by lowest CPU: {"tag", "pod_uid",
                      "pod" ("namespace/name", may be ""), "container", "container_id" ("" while
                      its CreateContainer is in flight), "sandbox_id", "attempt", "cpus",
                      "numa_nodes", "sockets", "mems" (the memory nodes kubelet's memory
                      manager chose, a list string; null: its CPUs' nodes with memory),
                      "mems_given" (those its cgroup is given: "mems" as far as they have
                      memory, else every node with memory; for null, its CPUs' nodes with
                      memory)}; "tag" is null when none of its CPUs is online
    cpus[i]           gains "owner" (container, reserved, isolated, shared or free), "tag",
                      "pod_uid" and "container" (null unless owner is container) and
                      "in_shared_pool" (reserved CPUs run shared containers too unless
                      strict-cpu-reservation is on)
    runtime           only when cpushim's socket was asked: {"source", "error" (null or
                      why it could not be asked), "containers" (how many it reported)};
                      each assignment then gains "state" (running, exited, created,
                      unknown, creating, gone, or "?" when the runtime was not reachable)
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from shim.cpuset import CPUSet
from shim.state import (
    Assignment,
    ContainerKey,
    CPUState,
    integrity_problems,
    topology_changed,
)
from shim.topology import Topology

__all__ = [
    "JSON_FORMAT",
    "MIN_WIDTH",
    "Live",
    "Owner",
    "OwnerKind",
    "container_tags",
    "owners_of",
    "render_assignments",
    "render_map",
    "render_status",
    "render_topology",
    "status_json",
    "topology_json",
]

JSON_FORMAT: Final = 1
# Narrower than this, a 256-CPU map cannot keep even two cores a row; asking for less gets this.
MIN_WIDTH: Final = 40

OwnerKind = Literal["container", "reserved", "isolated", "shared", "free"]


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a CPU belongs to, as the status map shows it."""

    kind: OwnerKind
    key: ContainerKey | None = None
    pod: str = ""  # "namespace/name" as the checkpoint has it; may be ""


RESERVED: Final = Owner("reserved")
ISOLATED: Final = Owner("isolated")
SHARED: Final = Owner("shared")
FREE: Final = Owner("free")

_MARKS: Final[Mapping[OwnerKind, str]] = {
    "reserved": "#",
    "shared": ".",
    "isolated": "~",
    "free": "-",
}
_KIND_NAMES: Final[Mapping[OwnerKind, str]] = {
    "reserved": "reserved",
    "shared": "shared pool",
    "isolated": "isolated, idle",
    "free": "free",
}
# SGR parameters. Containers get a background, so a pinned block stands out from the dim
# shared pool; consecutive tags never share a colour. Only the 8 basic colours: they render
# the same on every terminal that renders colour at all.
_KIND_SGR: Final[Mapping[OwnerKind, str]] = {
    "reserved": "33",
    "shared": "2",
    "isolated": "35",
    "free": "",
}
_TAG_SGR: Final = ("30;46", "30;42", "37;44", "30;43", "37;45", "37;41")
_ISOLATED_SGR: Final = "35"
_HEADER_SGR: Final = "1"
# Letters only: digits would read as CPU ids.
_ALPHABET: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Rows longer than this are hard to count along, however wide the terminal.
_MAX_CORES_PER_ROW: Final = 16
_ELLIPSIS: Final = ".."  # ASCII: the output also ends up in logs and serial consoles


# -- owners and tags ---------------------------------------------------------------------------


def owners_of(topology: Topology, state: CPUState) -> dict[int, Owner]:
    """The owner of every online CPU. The most specific fact wins: a container's hold, then
    reserved, then isolated, then the shared pool (under the ``none`` policy the pool holds
    isolated CPUs too, but showing them as isolated tells the operator more)."""
    held: dict[int, Owner] = {}
    for key, assignment in state.assignments.items():
        owner = Owner("container", key, assignment.pod)
        for cpu in assignment.cpus:
            held.setdefault(cpu, owner)
    owners: dict[int, Owner] = {}
    for cpu in topology.online:
        if cpu in held:
            owners[cpu] = held[cpu]
        elif cpu in state.reserved:
            owners[cpu] = RESERVED
        elif cpu in topology.isolated:
            owners[cpu] = ISOLATED
        elif cpu in state.shared:
            owners[cpu] = SHARED
        else:
            owners[cpu] = FREE
    return owners


def _tag_names(count: int) -> list[str]:
    """``count`` tags: single letters while they last, then ``Aa``, ``Ab``, ...: the case
    change shows where one tag ends in a cell such as ``AbAb``."""
    if count <= len(_ALPHABET):
        return list(_ALPHABET[:count])
    upper, lower = _ALPHABET[:26], _ALPHABET[26:]
    length = 2
    while 26**length < count:
        length += 1
    names: list[str] = []
    for index in range(count):
        letters = ""
        for _ in range(length - 1):
            index, digit = divmod(index, 26)
            letters = lower[digit] + letters
        names.append(upper[index] + letters)
    return names


def container_tags(owners: Mapping[int, Owner]) -> dict[ContainerKey, str]:
    """A short tag per container, in the order of the lowest CPU each holds: reading the map
    left to right, top to bottom meets A first (on the usual numbering)."""
    lowest: dict[ContainerKey, int] = {}
    for cpu, owner in sorted(owners.items()):
        if owner.key is not None:
            lowest.setdefault(owner.key, cpu)
    keys = sorted(lowest, key=lambda key: (lowest[key], key))
    return dict(zip(keys, _tag_names(len(keys)), strict=True))


# -- text helpers ------------------------------------------------------------------------------


def _paint(text: str, sgr: str, color: bool) -> str:
    if not color or not sgr or not text.strip():
        return text
    return f"\x1b[{sgr}m{text}\x1b[0m"


def _shorten(text: str, limit: int) -> str:
    """``text`` cut in the middle to at most ``limit`` characters: both ends of a pod name
    (the workload and the replica hash) say more than its middle."""
    if len(text) <= limit:
        return text
    if limit <= len(_ELLIPSIS):
        return text[:limit]
    keep = limit - len(_ELLIPSIS)
    head = (keep + 1) // 2
    return text[:head] + _ELLIPSIS + text[len(text) - (keep - head) :]


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text,
        width,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=True,
        break_on_hyphens=False,
    )


def _field(name: str, value: str, width: int, label_width: int = 12) -> list[str]:
    """``name  value``, the value wrapped after commas under itself: CPU lists have no spaces
    but may be long on a fragmented node. A piece longer than a line is cut into lines."""
    label = name.ljust(label_width)
    room = max(width - len(label), 8)
    parts = value.split(",")
    pieces = [part + "," for part in parts[:-1]] + parts[-1:]
    lines: list[str] = []
    line = ""
    for piece in pieces:
        if line and len(line) + len(piece) > room:
            lines.append(line)
            line = ""
        if not line:
            piece = piece.lstrip()
            while len(piece) > room:
                lines.append(piece[:room])
                piece = piece[room:]
        line += piece
    lines.append(line)
    return [(label if i == 0 else " " * len(label)) + text for i, text in enumerate(lines)]


def _cpus_text(cpus: CPUSet) -> str:
    return str(cpus) if cpus else "none"


def _ids(values: Iterable[int]) -> str:
    return str(CPUSet(values))


# -- the grid ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Node:
    socket: int
    numa: int
    cores: tuple[tuple[int, ...], ...]  # each core's CPU ids, ascending; cores by lowest CPU


def _nodes(topology: Topology) -> list[_Node]:
    groups: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for mask in topology.core_masks.values():
        cpus = tuple(CPUSet.from_mask(mask))
        info = topology.info(cpus[0])
        groups.setdefault((info.socket, info.numa_node), []).append(cpus)
    return [_Node(s, n, tuple(cores)) for (s, n), cores in sorted(groups.items())]


@dataclass(frozen=True, slots=True)
class _Cell:
    text: str  # what the cell shows, already padded to the grid's cell width
    painted: str  # the same with colour, when asked


def _socket_line(topology: Topology, socket: int, width: int, color: bool) -> str:
    cpus = topology.cpus_in_socket(socket)
    cores = sum(1 for core in topology.cores if core[0] == socket)
    nodes = _ids(topology.numa_nodes_in_socket(socket))
    text = f"Socket {socket}: {cores} cores, {len(cpus)} CPUs, NUMA {nodes}"
    return _paint(_shorten(text, width), _HEADER_SGR, color)


def _grid(
    topology: Topology,
    *,
    cell: Callable[[tuple[int, ...]], _Cell],
    cell_width: int,
    row_labels: bool,
    suffix: Callable[[_Node], str] | None,
    suffix_width: int,
    color: bool,
    width: int,
    gap: int = 1,
) -> list[str]:
    """Socket lines, and under each a row (or rows) of cells per NUMA node, ``gap`` blanks
    between cells."""
    nodes = _nodes(topology)
    node_width = max(len(f"NUMA {node.numa}") for node in nodes)
    cpu_width = len(str(topology.online.max()))
    prefix_width = 2 + node_width + 2 + (cpu_width + 2 if row_labels else 0)
    room = width - prefix_width - suffix_width
    fit = max(1, min(_MAX_CORES_PER_ROW, (room + gap) // (cell_width + gap)))

    # Rows of even length: 16 cores that do not fit in one row make two of 8, not 10 + 6.
    shape: dict[_Node, tuple[int, int]] = {}
    for node in nodes:
        rows = -(-len(node.cores) // fit)
        shape[node] = (rows, -(-len(node.cores) // rows))
    # Suffixes line up in one column across nodes of different sizes.
    widest = max(per_row for _, per_row in shape.values())

    lines: list[str] = []
    socket: int | None = None
    for node in nodes:
        if node.socket != socket:
            socket = node.socket
            lines.append(_socket_line(topology, socket, width, color))
        rows, per_row = shape[node]
        for row in range(rows):
            cores = node.cores[row * per_row : (row + 1) * per_row]
            label = f"NUMA {node.numa}" if row == 0 else ""
            head = "  " + label.ljust(node_width) + "  "
            if row_labels:
                head += str(cores[0][0]).rjust(cpu_width) + "  "
            cells = [cell(core) for core in cores]
            body = (" " * gap).join(c.painted for c in cells)
            tail = ""
            if suffix is not None and row == 0:
                pad = (widest - len(cores)) * (cell_width + gap)
                tail = " " * pad + "  " + suffix(node)
            lines.append((head + body + tail).rstrip())
    return lines


# -- the status map ----------------------------------------------------------------------------


def _labels(owners: Mapping[int, Owner], keys: Iterable[ContainerKey]) -> dict[ContainerKey, str]:
    """``pod/container`` without the namespace, unless two would then read the same."""
    pods = {owner.key: owner.pod for owner in owners.values() if owner.key is not None}

    def pod_name(key: ContainerKey, full: bool) -> str:
        pod = pods.get(key, "")
        if not pod:
            return key.pod_uid[:8]
        return pod if full else pod.rpartition("/")[2]

    short = {key: f"{pod_name(key, False)}/{key.name}" for key in keys}
    seen: dict[str, int] = {}
    for label in short.values():
        seen[label] = seen.get(label, 0) + 1
    return {
        key: label if seen[label] == 1 else f"{pod_name(key, True)}/{key.name}"
        for key, label in short.items()
    }


def _legend(
    owners: Mapping[int, Owner],
    tags: Mapping[ContainerKey, str],
    tag_width: int,
    color: bool,
    width: int,
) -> list[str]:
    lines = _wrap(
        "A cell is a core, one mark per thread; a row starts at the CPU on its left.", width
    )
    kinds = [kind for kind in _MARKS if any(owner.kind == kind for owner in owners.values())]
    entries = [
        (_paint(_MARKS[kind] * tag_width, _KIND_SGR[kind], color), _KIND_NAMES[kind])
        for kind in kinds
    ]
    labels = _labels(owners, tags)
    entries += [
        (_paint(tag, _TAG_SGR[index % len(_TAG_SGR)], color), labels[key])
        for index, (key, tag) in enumerate(tags.items())
    ]
    if not entries:
        return lines
    # Columns of equal width, filled row by row, as many as the width takes.
    limit = max(min(32, width - tag_width - 3), 8)
    texts = [_shorten(text, limit) for _, text in entries]
    column = tag_width + 1 + max(len(text) for text in texts) + 2
    columns = max(1, width // column)
    for start in range(0, len(entries), columns):
        parts = [
            entries[i][0] + " " + texts[i].ljust(column - tag_width - 1)
            for i in range(start, min(start + columns, len(entries)))
        ]
        lines.append(("  " + "".join(parts)).rstrip())
    return lines


def render_map(
    topology: Topology,
    owners: Mapping[int, Owner],
    color: bool,
    width: int,
    *,
    offline: CPUSet | None = None,
) -> str:
    """The CPU map with a legend, no line wider than ``width`` (at least ``MIN_WIDTH``).

    ``owners`` maps online CPUs to their owner (``owners_of``); a CPU it leaves out is free.
    """
    width = max(width, MIN_WIDTH)
    tags = container_tags(owners)
    tag_width = max((len(tag) for tag in tags.values()), default=1)
    sgr = {key: _TAG_SGR[index % len(_TAG_SGR)] for index, key in enumerate(tags)}
    threads = topology.cpus_per_core
    cell_width = threads * tag_width

    def mark(cpu: int) -> tuple[str, str]:
        owner = owners.get(cpu, FREE)
        if owner.key is not None:
            return tags[owner.key], sgr[owner.key]
        return _MARKS[owner.kind] * tag_width, _KIND_SGR[owner.kind]

    def cell(core: tuple[int, ...]) -> _Cell:
        runs: list[tuple[str, str]] = []  # marks of one colour painted once
        for text, sgr_ in map(mark, core):
            if runs and runs[-1][1] == sgr_:
                runs[-1] = (runs[-1][0] + text, sgr_)
            else:
                runs.append((text, sgr_))
        # A hybrid part's efficiency cores have fewer threads than its performance cores.
        pad = " " * (cell_width - tag_width * len(core))
        text = "".join(t for t, _ in runs) + pad
        return _Cell(text, "".join(_paint(t, s, color) for t, s in runs) + pad)

    def pinned(node: _Node) -> str:
        cpus = [cpu for core in node.cores for cpu in core]
        held = sum(1 for cpu in cpus if owners.get(cpu, FREE).kind == "container")
        return f"pinned {held}/{len(cpus)}"

    most = max(len(node.cores) * threads for node in _nodes(topology))
    lines = _grid(
        topology,
        cell=cell,
        cell_width=cell_width,
        row_labels=True,
        suffix=pinned,
        suffix_width=2 + len(f"pinned {most}/{most}"),
        color=color,
        width=width,
    )
    if offline:
        lines += _field("offline", str(offline), width, label_width=9)
    lines.append("")
    lines += _legend(owners, tags, tag_width, color, width)
    return "\n".join(lines) + "\n"


# -- the assignments table ---------------------------------------------------------------------


def _shorten_pod(pod: str, limit: int) -> str:
    """``namespace/name`` cut to ``limit``: the namespace gives way before the name."""
    if len(pod) <= limit:
        return pod
    namespace, _, name = pod.rpartition("/")
    room = limit - len(name) - 1 - len(_ELLIPSIS)
    if namespace and room >= 1:
        return namespace[:room] + _ELLIPSIS + "/" + name
    return _shorten(name, limit)


@dataclass(frozen=True, slots=True)
class _Column:
    header: str
    cells: list[str]
    # How far the column gives way before a column is dropped (soft), and after (hard);
    # None: never cut.
    soft: int | None = None
    hard: int | None = None
    droppable: bool = False
    shorten: Callable[[str, int], str] = _shorten


def _fit_table(
    columns: list[_Column],
    last: _Column,
    width: int | None,
    *,
    color: bool = False,
    row_sgr: Sequence[str] = (),
) -> list[str]:
    """Lines of ``columns`` plus ``last`` (a CPU list, wrapped after commas) in ``width``.

    To fit: cut the widest cuttable column down to its soft limit, then drop droppable
    columns (one if one is enough), then cut to the hard limits, then give any room left back
    to the cut columns. The CPU list keeps at least 8
    characters a line and never loses a CPU to a cut. With ``color``, the header is bold and
    data row r's first cell is painted ``row_sgr[r]``.
    """
    natural = [max(len(c.header), *(len(cell) for cell in c.cells)) for c in columns]
    widths = dict(enumerate(natural))
    last_natural = max(len(last.header), *(len(cell) for cell in last.cells))

    def total(last_room: int) -> int:
        return sum(widths.values()) + 2 * len(widths) + min(last_natural, last_room)

    def cut(limit_of: Callable[[_Column], int | None], last_room: int) -> None:
        while width is not None and total(last_room) > width:
            candidates = [
                i
                for i in widths
                if (limit := limit_of(columns[i])) is not None
                and widths[i] > max(limit, len(columns[i].header))
            ]
            if not candidates:
                return
            widths[max(candidates, key=lambda i: (widths[i], -i))] -= 1

    # A CPU list of up to 24 characters stays on one line while names are cut to their soft
    # limits; below that, it wraps.
    cut(lambda c: c.soft, 24)
    if width is not None and total(24) > width:
        # One column if one makes room, the narrowest that does; else all of them.
        droppable = [i for i, c in enumerate(columns) if c.droppable]
        singles = sorted(([i] for i in droppable), key=lambda choice: widths[choice[0]])
        drop = next(
            (
                choice
                for choice in singles
                if total(24) - sum(widths[i] + 2 for i in choice) <= width
            ),
            droppable,
        )
        for i in drop:
            del widths[i]
    cut(lambda c: c.hard, 8)
    # Room left over goes back to the columns that were cut.
    while width is not None and total(24) < width:
        short = [i for i in widths if widths[i] < natural[i]]
        if not short:
            break
        widths[max(short, key=lambda i: (natural[i] - widths[i], -i))] += 1

    used = sum(widths.values()) + 2 * len(widths)
    last_width = last_natural if width is None else max(8, width - used)
    header = "  ".join([columns[i].header.ljust(w) for i, w in widths.items()] + [last.header])
    lines = [_paint(header, _HEADER_SGR, color)]
    for row, value in enumerate(last.cells):
        cells = [columns[i].shorten(columns[i].cells[row], w) for i, w in widths.items()]
        padded = [cell.ljust(w) for cell, w in zip(cells, widths.values(), strict=True)]
        if color and padded and row < len(row_sgr):
            padded[0] = _paint(cells[0], row_sgr[row], True) + padded[0][len(cells[0]) :]
        pieces = _field("", value, last_width, 0)
        lines.append(("  ".join([*padded, pieces[0]])).rstrip())
        lines += [(" " * used + piece).rstrip() for piece in pieces[1:]]
    return lines


def _mems_given(topology: Topology, assignment: Assignment) -> CPUSet:
    """The memory nodes an exclusive container's cgroup is given on ``topology``: those
    kubelet's memory manager chose that have memory (else every node with memory), or, when
    it chose none, its CPUs' nodes that have memory. What cpushim's engine writes."""
    if assignment.mems is None:
        return topology.memory_nodes_of(assignment.cpus)
    return topology.memory_nodes_within(assignment.mems)


def _mems_narrowed(topology: Topology, assignment: Assignment) -> bool:
    """Whether kubelet's memory manager chose for it a node that has no memory now (memory
    hotplug), which its cgroup cannot be given."""
    return assignment.mems is not None and not assignment.mems.issubset(topology.memory_nodes)


def _mems_cell(topology: Topology, assignment: Assignment) -> str:
    """The nodes its cgroup is given; kubelet's choice after them when that was narrowed,
    so the column never shows a node the container does not have."""
    given = _ids(_mems_given(topology, assignment)) or "-"
    if _mems_narrowed(topology, assignment):
        return f"{given} (kubelet: {assignment.mems})"
    return given


def _by_lowest_cpu(state: CPUState) -> list[tuple[ContainerKey, Assignment]]:
    return sorted(
        state.assignments.items(),
        key=lambda item: (item[1].cpus.mask & -item[1].cpus.mask, item[0]),
    )


@dataclass(frozen=True)
class Live:
    """What the runtime says now, asked through cpushim's socket: the state of each container
    by id (``running``, ``exited``, ``created``, ``unknown``), or why it could not be asked."""

    source: str
    containers: Mapping[str, str] | None = None
    error: str | None = None

    def state_of(self, container_id: str) -> str:
        if not container_id:
            return "creating"
        if self.containers is None:
            return "?"
        return self.containers.get(container_id, "gone")


def render_assignments(
    state: CPUState,
    topology: Topology,
    *,
    width: int | None = None,
    color: bool = False,
    live: Live | None = None,
) -> str:
    """A table of the exclusive assignments, by lowest CPU, with the map's tags. Given a
    ``width``, names are cut and, if need be, the attempt and container id columns left out;
    CPU lists wrap instead of being cut. With ``live``, a STATE column says what the runtime
    reports of each container (``gone``: it no longer knows it)."""
    if not state.assignments:
        text = "No exclusive assignments: every container runs in the shared pool."
        return "\n".join(_wrap(text, width or len(text))) + "\n"
    tags = container_tags(owners_of(topology, state))
    order = _by_lowest_cpu(state)
    tag_cells = [tags.get(key, "-") for key, _ in order]
    columns = [
        _Column("TAG", tag_cells),
        _Column("POD", [a.pod or key.pod_uid for key, a in order], 24, 8, shorten=_shorten_pod),
        _Column("CONTAINER", [key.name for key, _ in order], 12, 8),
        # crictl's short id length; "(creating)": persisted before the runtime answered.
        _Column(
            "CONTAINER ID",
            [a.container_id[:13] or "(creating)" for _, a in order],
            droppable=True,
        ),
        _Column("ATTEMPT", [str(a.attempt) for _, a in order], droppable=True),
        _Column("NUMA", [_ids(topology.numa_nodes_of(a.cpus)) or "-" for _, a in order]),
    ]
    if any(
        _mems_narrowed(topology, a) or _mems_given(topology, a) != topology.memory_nodes_of(a.cpus)
        for _, a in order
    ):
        # Only when kubelet's memory manager put some container's memory elsewhere, or chose
        # a node that has no memory now.
        columns.append(_Column("MEMS", [_mems_cell(topology, a) for _, a in order]))
    if live is not None:
        columns.append(_Column("STATE", [live.state_of(a.container_id) for _, a in order]))
    cpus = _Column("CPUS", [str(a.cpus) for _, a in order])
    colours = {key: _TAG_SGR[index % len(_TAG_SGR)] for index, key in enumerate(tags)}
    lines = _fit_table(
        columns,
        cpus,
        None if width is None else max(width, MIN_WIDTH),
        color=color,
        row_sgr=[colours.get(key, "") for key, _ in order],
    )
    return "\n".join(lines) + "\n"


# -- the whole status page ---------------------------------------------------------------------


def render_status(
    topology: Topology,
    state: CPUState,
    *,
    offline: CPUSet | None = None,
    color: bool = False,
    width: int = 80,
    live: Live | None = None,
) -> str:
    """What ``cpushim status`` prints: a summary, any problems, the map and the table; with
    ``live``, where the runtime was asked and what each pinned container's state is."""
    width = max(width, MIN_WIDTH)
    owners = owners_of(topology, state)
    held = CPUSet().union(*(a.cpus for a in state.assignments.values())) & topology.online
    options = f" ({', '.join(sorted(state.options))})" if state.options else ""
    count = len(state.assignments)
    lines = _field("policy", state.policy + options, width)
    lines += _field(
        "CPUs",
        f"{len(topology.online)} online, {len(held)} pinned by {count}"
        f" container{'' if count == 1 else 's'}",
        width,
    )
    lines += _field("reserved", _cpus_text(state.reserved), width)
    lines += _field("shared pool", _cpus_text(state.shared), width)
    lines += _field("isolated", _cpus_text(topology.isolated), width)
    lines += _field("offline", _cpus_text(offline or CPUSet()), width)
    if CPUSet(topology.numa_nodes) - topology.memory_nodes:
        # Why the MEMS column may give a container other nodes than kubelet chose: the kernel
        # takes no cpuset.mems naming a node without memory.
        lines += _field("memory", f"nodes {_memory_nodes_text(topology)}", width)
    if live is not None:
        if live.error is not None:
            seen = f"{live.source}: not reachable ({live.error})"
        else:
            seen = f"{live.source}: {len(live.containers or {})} containers"
        lines += _field("runtime", seen, width)
    for problem in integrity_problems(state, topology):
        lines += _wrap(f"warning: the checkpoint is inconsistent: {problem}", width)
    if topology_changed(state, topology):
        lines += _wrap(
            "note: the checkpoint was written for other CPUs (some went offline or online, or"
            " were isolated, since); cpushim re-plans with these at its next start",
            width,
        )
    lines.append("")
    text = "\n".join(lines) + "\n"
    text += render_map(topology, owners, color, width) + "\n"
    return text + render_assignments(state, topology, width=width, color=color, live=live)


# -- the topology page -------------------------------------------------------------------------


def render_topology(
    topology: Topology, *, offline: CPUSet | None = None, color: bool = False, width: int = 80
) -> str:
    """What ``cpushim topology`` prints: a summary, then the same grid with CPU ids."""
    width = max(width, MIN_WIDTH)
    offline = offline or CPUSet()
    summary = _summary(topology)
    low, high = summary["threads_per_core"]
    lines = _field("sockets", str(summary["sockets"]), width, label_width=19)
    if summary["dies"] != summary["sockets"]:
        lines += _field("dies", str(summary["dies"]), width, label_width=19)
    lines += _field("NUMA nodes", str(summary["numa_nodes"]), width, label_width=19)
    memory_text = _memory_nodes_text(topology)
    if memory_text:
        lines += _field("memory nodes", memory_text, width, label_width=19)
    lines += _field("last-level caches", str(summary["last_level_caches"]), width, 19)
    lines += _field("uncore caches", str(summary["uncore_caches"]), width, label_width=19)
    lines += _field("cores", str(summary["cores"]), width, label_width=19)
    lines += _field("threads per core", str(low) if low == high else f"{low}-{high}", width, 19)
    lines += _field("CPUs online", f"{len(topology.online)}: {topology.online}", width, 19)
    lines += _field("isolated", _cpus_text(topology.isolated), width, label_width=19)
    lines += _field("offline", _cpus_text(offline), width, label_width=19)
    lines.append("")

    def text_of(cpu: int) -> str:
        return f"{cpu}*" if cpu in topology.isolated else str(cpu)

    cell_width = max(
        len(",".join(text_of(cpu) for cpu in CPUSet.from_mask(mask)))
        for mask in topology.core_masks.values()
    )

    def cell(core: tuple[int, ...]) -> _Cell:
        text = ",".join(text_of(cpu) for cpu in core)
        painted = ",".join(
            _paint(text_of(cpu), _ISOLATED_SGR if cpu in topology.isolated else "", color)
            for cpu in core
        )
        pad = " " * (cell_width - len(text))
        return _Cell(text + pad, painted + pad)

    lines += _grid(
        topology,
        cell=cell,
        cell_width=cell_width,
        row_labels=False,
        suffix=None,
        suffix_width=0,
        color=color,
        width=width,
        gap=2,  # cells hold commas: one blank would read as one list
    )
    lines.append("")
    legend = "A cell is a core: its threads' CPU ids"
    legend += "; * marks an isolated CPU (isolcpus)." if topology.isolated else "."
    lines += _wrap(legend, width)
    return "\n".join(lines) + "\n"


def _memory_nodes_text(topology: Topology) -> str:
    """The NUMA nodes with memory, when they are not those of the CPUs (memory-only nodes,
    CXL memory; memory-less nodes): what an exclusive container's or every node's
    ``cpuset.mems`` is made of. Empty when they are the CPUs' nodes."""
    with_cpus = CPUSet(topology.numa_nodes)
    if topology.memory_nodes == with_cpus:
        return ""
    notes = []
    if memory_only := topology.memory_nodes - with_cpus:
        notes.append(f"{memory_only} without CPUs")
    if memory_less := with_cpus - topology.memory_nodes:
        notes.append(f"{memory_less} without memory")
    return f"{topology.memory_nodes} ({'; '.join(notes)})"


# -- JSON --------------------------------------------------------------------------------------


def _summary(topology: Topology) -> dict[str, Any]:
    sizes = [mask.bit_count() for mask in topology.core_masks.values()]
    return {
        "sockets": topology.num_sockets,
        "dies": len({(info.socket, info.die) for info in topology.cpus}),
        "numa_nodes": topology.num_numa_nodes,
        "last_level_caches": len({info.last_level_cache for info in topology.cpus}),
        "uncore_caches": len(topology.uncore_masks),
        "cores": topology.num_cores,
        "cpus": len(topology.online),
        "threads_per_core": [min(sizes), max(sizes)],
    }


def _cpu_entry(topology: Topology, cpu: int) -> dict[str, Any]:
    info = topology.info(cpu)
    return {
        "cpu": cpu,
        "socket": info.socket,
        "die": info.die,
        "numa_node": info.numa_node,
        "core_id": info.core_id,
        "last_level_cache": info.last_level_cache,
        "uncore_cache": info.uncore_cache,
        "isolated": cpu in topology.isolated,
    }


def topology_json(topology: Topology, *, offline: CPUSet | None = None) -> dict[str, Any]:
    """The topology as plain data for ``cpushim topology --json`` (keys in the module doc)."""
    return {
        "format": JSON_FORMAT,
        "online": str(topology.online),
        "isolated": str(topology.isolated),
        "offline": str(offline or CPUSet()),
        "memory_nodes": str(topology.memory_nodes),
        "summary": _summary(topology),
        "cpus": [_cpu_entry(topology, cpu) for cpu in topology.online],
    }


def status_json(
    topology: Topology, state: CPUState, *, offline: CPUSet | None = None, live: Live | None = None
) -> dict[str, Any]:
    """The state on this machine as plain data for ``cpushim status --json``; with ``live``,
    ``runtime`` ({"source", "error", "containers"}) and each assignment's ``state``."""
    owners = owners_of(topology, state)
    tags = container_tags(owners)
    document = topology_json(topology, offline=offline)
    for entry in document["cpus"]:
        owner = owners[entry["cpu"]]
        entry.update(
            owner=owner.kind,
            tag=tags.get(owner.key) if owner.key else None,
            pod_uid=owner.key.pod_uid if owner.key else None,
            container=owner.key.name if owner.key else None,
            in_shared_pool=entry["cpu"] in state.shared,
        )
    document.update(
        policy=state.policy,
        options=sorted(state.options),
        reserved=str(state.reserved),
        shared=str(state.shared),
        problems=integrity_problems(state, topology),
        topology_changed=topology_changed(state, topology),
        assignments=[
            {
                "tag": tags.get(key),
                "pod_uid": key.pod_uid,
                "pod": a.pod,
                "container": key.name,
                "container_id": a.container_id,
                "sandbox_id": a.sandbox_id,
                "attempt": a.attempt,
                "cpus": str(a.cpus),
                "numa_nodes": sorted(topology.numa_nodes_of(a.cpus)),
                "sockets": sorted(topology.sockets_of(a.cpus)),
                "mems": None if a.mems is None else str(a.mems),
                "mems_given": str(_mems_given(topology, a)),
            }
            for key, a in _by_lowest_cpu(state)
        ],
    )
    if live is not None:
        document["runtime"] = {
            "source": live.source,
            "error": live.error,
            "containers": None if live.containers is None else len(live.containers),
        }
        for entry in document["assignments"]:
            entry["state"] = live.state_of(entry["container_id"])
    return document
