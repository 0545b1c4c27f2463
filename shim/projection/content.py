"""What a container's projection directory holds, as bytes: pure, no I/O.

``describe`` turns a container's cpuset and the machine's topology into a Projection;
``render`` gives the files to write for it, in the order they must be renamed into place.
"""

from __future__ import annotations

import time
from typing import Final

import orjson

from shim.cpuset import CPUSet
from shim.projection import CPUS_FILE, POOLS, STATE_FILE, Pool, Projection
from shim.topology import CoreKey, Topology

__all__ = ["core_name", "describe", "render", "rfc3339", "same_state"]

_NS_PER_S: Final = 1_000_000_000


def core_name(core: CoreKey) -> str:
    """A physical core as ``cpuset.json`` names it: ``"socket:die:core"``."""
    socket, die, core_id = core
    return f"{socket}:{die}:{core_id}"


def rfc3339(time_ns: int) -> str:
    """A wall-clock time in nanoseconds since the epoch, as RFC 3339 in UTC to the µs."""
    seconds, nanoseconds = divmod(time_ns, _NS_PER_S)
    # time.gmtime, not datetime: this is on the path of every projection write.
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return f"{stamp}.{nanoseconds // 1000:06d}Z"


def describe(
    *,
    cpus: CPUSet,
    mems: str,
    exclusive: bool,
    pool: Pool,
    topology: Topology,
    generation: int,
    updated_at: str,
) -> Projection:
    """The projection of a container holding ``cpus``; ValueError for CPUs that are not
    online, an empty set, or ``exclusive`` and ``pool`` that disagree."""
    if not cpus:
        raise ValueError("a container's projection needs at least one CPU")
    offline = cpus - topology.online
    if offline:
        raise ValueError(f"CPUs {offline} are not online on this machine")
    if pool not in POOLS:
        raise ValueError(f"pool {pool!r} is not one of {', '.join(POOLS)}")
    if exclusive != (pool == "exclusive"):
        raise ValueError(f"exclusive={exclusive} does not fit the {pool!r} pool")
    cores = sorted({topology.cpu_core[cpu] for cpu in cpus})
    return Projection(
        cpus=str(cpus),
        # Normalised, so "0,1" and "0-1" are one state.
        mems=str(CPUSet.parse(mems)),
        exclusive=exclusive,
        pool=pool,
        numa_nodes=tuple(sorted(topology.numa_nodes_of(cpus))),
        sockets=tuple(sorted(topology.sockets_of(cpus))),
        cores=tuple(core_name(core) for core in cores),
        isolated=str(cpus & topology.isolated),
        generation=generation,
        updated_at=updated_at,
    )


def same_state(a: Projection, b: Projection) -> bool:
    """Whether two projections differ in nothing but their generation and time."""
    return a.as_dict() | _NO_STAMP == b.as_dict() | _NO_STAMP


_NO_STAMP: Final = {"generation": 0, "updated_at": ""}


def render(projection: Projection) -> tuple[tuple[str, bytes], ...]:
    """The files of a projection directory as (name, content), in the order to rename them:
    ``cpuset.json`` last, since subscribers key on it and then expect ``cpus`` to be as new."""
    cpus = f"{projection.cpus}\n".encode("ascii")
    state = orjson.dumps(projection.as_dict(), option=orjson.OPT_APPEND_NEWLINE)
    return ((CPUS_FILE, cpus), (STATE_FILE, state))
