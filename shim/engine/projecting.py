"""Keeps each container's projection directory (shim/projection) equal to its cpuset.

The engine calls :meth:`Projector.prepare` before it forwards a CreateContainer (the
directory must exist to be bind-mounted, and a workload may read it as soon as it starts) and
:meth:`Projector.update` after every change it made to a container's cgroup, so the files never
name CPUs the container does not have yet. Updates do not hold up the call that caused them:
each directory has at most one write in flight, and a write always carries the latest cpuset,
so a burst of changes costs one or two writes and they can never land out of order.

A container is known by its pod UID and name, like its directory: the next attempt of a
container writes where the previous one did, and the generation carries on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.engine.retrying import Retry
from shim.projection import Pool
from shim.projection.writer import ProjectionPathError, ProjectionWriter, check_name
from shim.state import ContainerKey
from shim.topology import Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cpuset:
    """What a container's directory says: its CPUs, memory nodes and pool."""

    cpus: CPUSet
    mems: str
    exclusive: bool

    @property
    def pool(self) -> Pool:
        return "exclusive" if self.exclusive else "shared"


class Projector:
    def __init__(
        self,
        writer: ProjectionWriter,
        topology: Topology,
        mount_path: Path,
        counters: Counter[str],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        *,
        draining: asyncio.Event | None = None,
        retry_delay: float = 1.0,
        named: Callable[[ContainerKey], dict[str, str]] = lambda key: {"container": str(key)},
    ) -> None:
        self.writer = writer
        # The fields a log line names a container by (the engine's: with its pod).
        self._named = named
        self.topology = topology
        self.mount_path = mount_path
        self.counters = counters
        self._spawn = spawn
        self._wanted: dict[ContainerKey, Cpuset] = {}
        self._written: dict[ContainerKey, Cpuset] = {}
        self._writers: dict[ContainerKey, asyncio.Task[None]] = {}
        # Set when cpushim drains: failed writes are no longer tried again.
        self._draining = draining or asyncio.Event()
        # Writes the directories whose write failed again, after ``retry_delay``, doubling
        # the wait up to a minute while it keeps failing; stops when every directory is
        # current or cpushim drains (the next start writes them all).
        self._retry = Retry(self._write_behind, retry_delay, self._draining, spawn)
        # Called with (key, generation) after each write; the projection bench listens here.
        self.on_written: Callable[[ContainerKey, int], None] | None = None

    @staticmethod
    def check(key: ContainerKey) -> str | None:
        """Why ``key`` cannot name a directory (a UID or name with '/', '..', NUL, ...), or
        None when it can."""
        try:
            check_name("pod UID", key.pod_uid)
            check_name("container name", key.name)
        except ProjectionPathError as exc:
            return str(exc)
        return None

    async def prepare(self, key: ContainerKey, cpuset: Cpuset) -> pb.Mount | None:
        """Write the directory of a container about to be created and return the mount that
        shows it inside; None when it cannot be written (logged and counted: the container is
        still created, without the mount)."""
        self._wanted[key] = cpuset
        writer = self._writers.get(key)
        if writer is not None:
            await asyncio.shield(writer)
        if not await self._write(key, cpuset):
            return None
        return pb.Mount(
            container_path=str(self.mount_path),
            host_path=str(self.writer.directory(key.pod_uid, key.name)),
            readonly=True,
            propagation=pb.PROPAGATION_PRIVATE,
            # On an SELinux node the runtime labels the directory for the container, as
            # kubelet asks for volumes; elsewhere the runtime does nothing with it.
            selinux_relabel=True,
        )

    def update(self, key: ContainerKey, cpuset: Cpuset) -> None:
        """The container's cgroup now holds ``cpuset``: project it soon."""
        if self.check(key) is not None:
            return
        self._wanted[key] = cpuset
        if key not in self._writers and self._written.get(key) != cpuset:
            self._writers[key] = self._spawn(self._write_until_current(key))

    async def _write_until_current(self, key: ContainerKey) -> None:
        try:
            while True:
                wanted = self._wanted.get(key)
                if wanted is None or wanted == self._written.get(key):
                    return
                if not await self._write(key, wanted):
                    # Without a retry the files would name the old CPUs until the container's
                    # cpuset changed again: on a quiet node, for good.
                    self._retry.soon()
                    return
        finally:
            self._writers.pop(key, None)

    def retry(self) -> None:
        """Write again every directory that is behind its container's cpuset."""
        for key, wanted in self._wanted.items():
            if key not in self._writers and self._written.get(key) != wanted:
                self._writers[key] = self._spawn(self._write_until_current(key))

    def _behind(self) -> bool:
        return any(self._written.get(key) != wanted for key, wanted in self._wanted.items())

    async def _write_behind(self) -> bool:
        """Write every directory that is behind; True when all are current."""
        self.retry()
        await self.settle()
        return not self._behind()

    async def _write(self, key: ContainerKey, cpuset: Cpuset) -> bool:
        # Until this write succeeds the directory may hold neither the last cpuset nor this
        # one (``cpus`` renamed, ``cpuset.json`` not): a move back to the last must write too.
        self._written.pop(key, None)
        try:
            generation = await self.writer.write(
                key.pod_uid,
                key.name,
                cpuset.cpus,
                cpuset.mems,
                cpuset.exclusive,
                cpuset.pool,
                self.topology,
            )
        except (OSError, ValueError) as exc:
            self.counters["projection_errors"] += 1
            log.warning(
                "could not write a container's projection",
                extra={"fields": {**self._named(key), "error": str(exc)}},
            )
            return False
        except Exception:
            # A projection is never worth a container's create, nor the retries of the
            # others behind it: counted as what it cost, with the trace to find why.
            self.counters["projection_errors"] += 1
            log.exception(
                "could not write a container's projection",
                extra={"fields": self._named(key)},
            )
            return False
        self._written[key] = cpuset
        self.counters["projection_writes"] += 1
        if self.on_written is not None:
            self.on_written(key, generation)
        return True

    async def forget_pod(self, pod_uid: str, unless: Callable[[], bool] | None = None) -> None:
        """The pod is removed: its directories go, unless ``unless()`` says the pod is back
        (a static pod's next sandbox), checked before anything goes and again under the pod's
        lock just before its directories do."""
        for key in [k for k in self._wanted if k.pod_uid == pod_uid]:
            # Asked again after each wait: a container of the pod's next sandbox is its own.
            if unless is not None and unless():
                return
            self._wanted.pop(key, None)
            self._written.pop(key, None)
            writer = self._writers.get(key)
            if writer is not None:
                await asyncio.shield(writer)
                if key not in self._wanted:
                    # The write under way recorded its cpuset as it ended.
                    self._written.pop(key, None)
        try:
            await self.writer.remove_pod(pod_uid, unless)
        except (OSError, ValueError) as exc:
            self.counters["projection_errors"] += 1
            log.warning(
                "could not remove a pod's projection",
                extra={"fields": {"pod_uid": pod_uid, "error": str(exc)}},
            )

    async def clean_stale(self, keep: Collection[ContainerKey]) -> None:
        """Remove the directories of containers that went while cpushim was down."""

        def failed(pod_uid: str, exc: OSError) -> None:
            self.counters["projection_errors"] += 1
            log.warning(
                "could not clean a pod's stale projections",
                extra={"fields": {"pod_uid": pod_uid, "error": str(exc)}},
            )

        try:
            removed = await self.writer.clean_stale([(k.pod_uid, k.name) for k in keep], failed)
        except OSError as exc:
            self.counters["projection_errors"] += 1
            log.warning("could not clean stale projections", extra={"fields": {"error": str(exc)}})
            return
        if removed:
            log.info(
                "removed stale projections",
                extra={"fields": {"directories": [str(p) for p in removed]}},
            )

    async def settle(self) -> None:
        """Wait until every update asked for so far is written (tests, benches, shutdown)."""
        while self._writers:
            await asyncio.wait(set(self._writers.values()))

    def written(self, key: ContainerKey) -> Cpuset | None:
        return self._written.get(key)
