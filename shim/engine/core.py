"""The engine: turns intercepted lifecycle calls into allocation decisions, persists them,
moves the other containers, and forwards the call with the cpuset written into it.

Ordering for a create (docs/architecture.md): decide, persist the checkpoint, move shared
containers off the new exclusive CPUs, forward CreateContainer with the cpuset set, record the
container id. A failed forward is rolled back. Release mirrors it: forward, then release,
persist and grow the shared containers, all before the call returns to kubelet.

Decisions are made one at a time under one lock, and an exclusive container's whole create
(decide, persist, move, forward, record) holds it. A shared container's CreateContainer is
forwarded outside the lock, so those overlap in the runtime; one whose pool changed meanwhile
is corrected before its CreateContainer returns, so before it can start.

A call's work runs in a task of the engine's own, shielded from the call: when kubelet gives up
on a call (deadline, cancellation), what the runtime did is still recorded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import posixpath
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from google.protobuf.message import DecodeError, Message

from shim.cgroups import CgroupLayout
from shim.checkpoint import CheckpointFile, DirectorySyncError
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.passthrough import LIFECYCLE_PATHS, check_request
from shim.cri.server import Afterwards, Pending
from shim.cri.upstream import Forward, RuntimeChannel
from shim.engine import requests as rq
from shim.engine.moves import DirectWrite, Mover
from shim.engine.projecting import Cpuset, Projector
from shim.engine.retrying import Retry
from shim.engine.tracked import Phase, Tracked
from shim.kube import QOSClass, kubelet_cfs_quota, request_is_limit
from shim.pods import (
    AnnotationError,
    ContainerPlan,
    MemoryNodesError,
    Pod,
    exclusive_request,
    has_own_resources,
    isolated_mode,
    kubelet_memory_nodes,
    plan_container,
    shows_pod_level_resources,
    takes_whole_pod,
    unknown_annotations,
)
from shim.policy import CPUPolicy
from shim.policy.static import AllocationError, ExclusiveRequest
from shim.projection.writer import ProjectionWriter
from shim.state import Assignment, ContainerKey, CPUState, KubeletMems, replan
from shim.topology import Topology

if TYPE_CHECKING:
    from shim.engine.watching import Watcher

log = logging.getLogger(__name__)

# containerd's ids are 64 hex digits: one that long is no prefix of another, so is used as named.
FULL_ID_LENGTH = 64

_M = TypeVar("_M", bound=Message)
_T = TypeVar("_T")

FailurePolicy = Literal["fail-closed", "fail-open"]


@dataclass(frozen=True)
class EngineOptions:
    failure_policy: FailurePolicy = "fail-closed"
    # How many UpdateContainerResources calls run at once when containers move, and how many
    # records of cpusets written straight into cgroups (shim/engine/moves.py).
    update_concurrency: int = 8
    update_timeout: float = 10.0
    # How long a cpuset written straight into a cgroup waits before the runtime is told of it
    # (shim/engine/moves.py): moves within that time cost one runtime update. A new
    # container's id waits as long before its own checkpoint write, which any other write in
    # that time makes unneeded (a checkpoint without the id is squared at start-up).
    record_delay: float = 1.0
    # A container whose cpuset keeps moving is recorded with the runtime at least this often.
    record_max_delay: float = 10.0
    # A move the runtime refused, or a projection write that failed, is tried again after
    # this long, doubling up to a minute.
    retry_delay: float = 1.0
    # How long a move waits for a runtime call about the same container before taking its
    # runtime for stuck (a hung containerd shim) and writing its cgroup past that call.
    stuck_after: float = 2.0


@dataclass(frozen=True)
class ProjectionSettings:
    # Where each container's directory is made on the host.
    directory: Path
    # Where it is mounted inside the container.
    mount_path: Path


Handler = Callable[[UnaryCall, Forward], Awaitable[Reply]]


class Engine:
    """An :class:`~shim.cri.server.Interceptor` that allocates CPUs on the CRI path."""

    def __init__(
        self,
        policy: CPUPolicy,
        checkpoint: CheckpointFile,
        runtime: RuntimeChannel,
        options: EngineOptions | None = None,
        state: CPUState | None = None,
        cgroups: CgroupLayout | None = None,
        projection: ProjectionSettings | None = None,
    ) -> None:
        self.policy = policy
        self.checkpoint = checkpoint
        self.runtime = runtime
        self.options = options or EngineOptions()
        self.state = state if state is not None else CPUState.empty(policy)
        self.pods: dict[str, Pod] = {}
        self.containers: dict[str, Tracked] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self.lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        # A checkpoint write scheduled by _record_soon and not yet under way.
        self._persisting: asyncio.Task[None] | None = None
        self._persist_tasks: set[asyncio.Task[None]] = set()
        # Set: checkpoint writes waiting for the record delay go now (and, while draining,
        # every later one too).
        self._persist_now = asyncio.Event()
        # Set once drain() starts: no new background work, and retries stop.
        self._draining = asyncio.Event()
        # Applies again what the runtime refused, after ``retry_delay``, doubling the wait up
        # to a minute while it keeps refusing; stops when every container is in place or
        # cpushim drains (the next start's resync squares what is left).
        self._move_retry = Retry(
            self._apply_again, lambda: self.options.retry_delay, self._draining, self._spawn
        )
        # Writes the checkpoint again after a write that only logged its failure: with no
        # decision to follow on a quiet node, the file would stay behind memory, and a crash
        # would start again from it. Same waits as the moves'.
        self._save_retry = Retry(
            self._save_again, lambda: self.options.retry_delay, self._draining, self._spawn
        )
        # Set by the first of those failures (save_later): a drain's last step then makes
        # sure the file holds the engine's state (one that failed during the drain started
        # no retry). Not before: until the resync is done, the engine's state is not the one
        # to write.
        self._save_failed = False
        # Set by the watcher when it starts (shim/engine/watching.py); None without one.
        self.watcher: Watcher | None = None
        # Set by the config reloader (shim/engine/reloading.py): gives the containers that
        # share and ask for exclusive CPUs theirs, as a reload does; None without a reloader.
        self.adopter: Callable[[], Coroutine[Any, Any, object]] | None = None
        # Set by the watcher: asks for a sweep of the runtime's containers soon
        # (shim/engine/sweeping.py), after a create whose container cpushim did not record.
        self.sweeper: Callable[[], None] | None = None
        # A sweep asked for while no watcher runs (start-up left containers unread): made as
        # soon as one starts.
        self.sweep_wanted = False
        # A container that shares and asks for exclusive CPUs found no room (at start-up, a
        # reload, a sweep): a release then asks the watcher for an adoption (room_made), or
        # it would wait for a full look. Cleared once none waits: a release costs nothing
        # more then.
        self.room_wanted = False
        self.room_made: Callable[[], None] | None = None
        # The CPUs free when the last adoption a release asked for left a container waiting
        # (None after any other refusal): the next is tried only once others are free too.
        # CPUs a waiting container cannot have (isolated ones it does not ask for) would
        # otherwise make every release cost a runtime call per waiting container, under the
        # lock.
        self.room_tried: CPUSet | None = None
        # CreateContainer calls on their way: the runtime may have made their containers
        # before cpushim records them (the sweep waits for none to be on their way).
        self.creates_in_flight = 0
        # Containers a sweep found that never run (left created in a stopped sandbox): not
        # looked at again while the runtime lists them.
        self.never_running: set[str] = set()
        # Containers cpushim does not track whose state the runtime could not give (a
        # failed ContainerStatus, an answer that does not decode), warned of by start-up or
        # a sweep: a sweep asks again at every try (after 1 s, doubling up to a minute),
        # and each is told once. Forgotten once read, or gone from a sweep's listing.
        self.unread_untracked: set[str] = set()
        # Sandboxes whose pod start-up or a sweep learnt from the runtime (one another client
        # made never has its RemovePodSandbox pass here): forgotten, by a sweep, once the
        # runtime no longer lists them.
        self.learnt_sandboxes: set[str] = set()
        self._creates_settled = asyncio.Event()
        self._creates_settled.set()
        self.mover = Mover(
            runtime,
            cgroups,
            self.counters,
            timeout=self.options.update_timeout,
            record_delay=self.options.record_delay,
            record_max_delay=self.options.record_max_delay,
            spawn=self._spawn,
            concurrency=self.options.update_concurrency,
            stuck_after=self.options.stuck_after,
        )
        self.mover.answering_again = self._move_retry.hurry
        self.projection = projection
        # None: no projection directories (shim/engine/projecting.py).
        self.projector: Projector | None = None
        if projection is not None:
            self.projector = Projector(
                ProjectionWriter(projection.directory),
                policy.topology,
                projection.mount_path,
                self.counters,
                self._spawn,
                draining=self._draining,
                retry_delay=self.options.retry_delay,
                named=self._named,
            )
        # What follows a call the runtime has answered OK, for the calls whose request the
        # engine does not change: the relay passes them through and holds the reply's end
        # until this is done (follows/followed).
        self._after: dict[str, Callable[[bytes, bytes | None], Awaitable[Afterwards]]] = {
            rq.RUN_POD_SANDBOX: self._pod_sandbox_run,
            rq.START_CONTAINER: self._container_started,
            rq.STOP_CONTAINER: self._container_stopped,
            rq.REMOVE_CONTAINER: self._container_removed,
            rq.STOP_POD_SANDBOX: self._pod_sandbox_stopped,
            rq.REMOVE_POD_SANDBOX: self._pod_sandbox_removed,
        }
        # The same, done at once when there is nothing to wait for (``followed_now``); each
        # returns Pending.LATER, having done nothing, when there is.
        self._now: dict[str, Callable[[bytes, bytes | None], Afterwards | Pending]] = {
            rq.RUN_POD_SANDBOX: self._pod_sandbox_run_now,
            rq.START_CONTAINER: self._container_started_now,
            rq.STOP_CONTAINER: self._container_stopped_now,
            rq.REMOVE_CONTAINER: self._container_removed_now,
            rq.STOP_POD_SANDBOX: self._pod_sandbox_stopped_now,
            rq.REMOVE_POD_SANDBOX: self._pod_sandbox_removed_now,
        }
        self._handlers: dict[str, Handler] = {
            rq.CREATE_CONTAINER: self._create_container,
            rq.UPDATE_CONTAINER_RESOURCES: self._update_container_resources,
            **{path: self._forward_then_follow for path in self._after},
        }

    # --- the Interceptor protocol -----------------------------------------------------------

    def intercepts(self, path: str) -> bool:
        """The calls whose request the engine changes or must see before the runtime does;
        the other lifecycle calls are followed (below)."""
        return path in LIFECYCLE_PATHS and path not in self._after

    def amends(self, path: str) -> bool:
        """All of them go on on the client's own stream."""
        return True

    # --- the Follower protocol: calls the relay passes through --------------------------------

    def follows(self, path: str) -> bool:
        return path in self._after

    def followed_now(
        self, path: str, request: bytes | None, status: int | None, response: bytes | None
    ) -> Afterwards | Pending:
        """:meth:`followed`, done at once when the call needs nothing waited for: no decision
        under way (the lock is free; this never suspends, so nothing can come in between)
        and nothing to release, which is how kubelet's calls mostly find it (a stopped
        container's CPUs went back when its process ended)."""
        if status != Status.OK:
            return None
        handler = self._now.get(path)
        if request is None or handler is None or self.lock.locked():
            return Pending.LATER
        try:
            return handler(request, response)
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("work after a call failed", extra={"fields": {"path": path}})
            return None

    async def followed(
        self, path: str, request: bytes | None, status: int | None, response: bytes | None
    ) -> Afterwards:
        """The runtime has answered a followed call; its reply reaches kubelet after this,
        and what this returns runs after that."""
        if status != Status.OK:
            return None
        if request is None:
            self.counters["unread_requests"] += 1
            log.warning(
                "a call the runtime answered OK could not be read; the watchers catch up",
                extra={"fields": {"path": path}},
            )
            return None
        return await asyncio.shield(self._spawn(self._follow(path, request, response)))

    async def _follow(self, path: str, request: bytes, response: bytes | None) -> Afterwards:
        try:
            return await self._after[path](request, response)
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("work after a call failed", extra={"fields": {"path": path}})
            return None

    async def _forward_then_follow(self, call: UnaryCall, forward: Forward) -> Reply:
        """A followed call that reached the engine whole (``handle``): the same work."""
        reply = await forward()
        if reply.status is Status.OK:
            # The runtime has acted: whatever happens here, kubelet gets its reply (the
            # failure policy must not forward it a second time).
            response = reply.messages[0] if len(reply.messages) == 1 else None
            afterwards = self.followed_now(call.path, call.request, Status.OK, response)
            if afterwards is Pending.LATER:
                afterwards = await self._follow(call.path, call.request, response)
            if afterwards is not None:
                try:
                    afterwards()
                except Exception:
                    self.counters["internal_errors"] += 1
                    log.exception("work after a call failed", extra={"fields": {"path": call.path}})
        return reply

    async def handle(self, call: UnaryCall, forward: Forward) -> Reply:
        rejected = check_request(call)
        if rejected is not None:
            return rejected
        task = self._spawn(self._dispatch(call, forward))
        return await asyncio.shield(task)

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for calls in flight to finish their work, and for the
        runtime to be told of every cpuset written straight into a cgroup, and the checkpoint
        of every change (including work those calls start meanwhile). When a checkpoint
        write has failed after the fact, the last step writes the engine's state unless the
        file holds it already."""
        self._draining.set()
        self._persist_now.set()
        self.mover.flush()
        if self._save_retry.running:
            # The retry ends with the drain: one last write, or the next start reads a
            # checkpoint behind what the runtime did. Now, not after the rest of the work,
            # which may outlast the grace.
            self._spawn(self._save_again())
        deadline = asyncio.get_running_loop().time() + grace
        if not await self._tasks_done(deadline):
            return
        if self._save_failed:
            # A write that failed during the drain started no retry, and the one above may
            # have failed too: once nothing else writes, one last try.
            self._spawn(self._save_again())
            await self._tasks_done(deadline)

    async def _tasks_done(self, deadline: float) -> bool:
        """Wait until no background work is left (including work started meanwhile), or
        until the loop's clock reaches ``deadline``; whether none is left."""
        while self._tasks:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            await asyncio.wait(set(self._tasks), timeout=left)
        return True

    def _spawn(self, work: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def creates_settled(self, within: float) -> bool:
        """Wait up to ``within`` seconds for no create to be on its way; False if one still is."""
        if self._creates_settled.is_set():
            return True
        try:
            await asyncio.wait_for(self._creates_settled.wait(), max(within, 0.0))
        except TimeoutError:
            return False
        return True

    def _sweep_soon(self) -> None:
        if self.sweeper is not None:
            self.sweeper()
        else:
            self.sweep_wanted = True

    async def _dispatch(self, call: UnaryCall, forward: Forward) -> Reply:
        handler = self._handlers.get(call.path)
        if handler is None:
            return await forward()
        if call.path != rq.CREATE_CONTAINER:
            return await self._handle(handler, call, forward)
        self.creates_in_flight += 1
        self._creates_settled.clear()
        try:
            return await self._handle(handler, call, forward)
        finally:
            self.creates_in_flight -= 1
            if not self.creates_in_flight:
                self._creates_settled.set()

    async def _handle(self, handler: Handler, call: UnaryCall, forward: Forward) -> Reply:
        try:
            return await handler(call, forward)
        except Exception as exc:
            self.counters["internal_errors"] += 1
            if forward.sent:
                # The runtime has the call: its reply stands (a second forward would act twice).
                log.exception(
                    "work after forwarding a call failed", extra={"fields": {"path": call.path}}
                )
                if call.path == rq.CREATE_CONTAINER:
                    # Its container may be made and not recorded: the sweep takes it in.
                    self._sweep_soon()
                if forward.reply is not None:
                    return forward.reply
                return Reply.error(Status.INTERNAL, f"cpushim: {call.path} failed: {exc}")
            if self.options.failure_policy == "fail-open":
                self.counters["fail_open_forwards"] += 1
                log.exception(
                    "decision failed; forwarding the call unchanged (fail-open)",
                    extra={"fields": {"path": call.path}},
                )
                reply = await forward()
                if call.path == rq.CREATE_CONTAINER and reply.status is Status.OK:
                    # Made on whatever CPUs kubelet's request left it: the sweep takes it in.
                    self._sweep_soon()
                return reply
            log.exception(
                "decision failed; refusing the call (fail-closed)",
                extra={"fields": {"path": call.path}},
            )
            return Reply.error(Status.INTERNAL, f"cpushim: {call.path} failed: {exc}")

    # --- pods -------------------------------------------------------------------------------

    async def _pod_sandbox_run(self, request: bytes, response: bytes | None) -> None:
        self._pod_sandbox_run_now(request, response)

    def _pod_sandbox_run_now(self, request: bytes, response: bytes | None) -> None:
        """Remember the pod by its sandbox id. Without a readable reply it is learnt from its
        first CreateContainer, which carries the same sandbox config."""
        if response is None:
            return
        try:
            sandbox_id = pb.RunPodSandboxResponse.FromString(response).pod_sandbox_id
        except DecodeError:
            return
        config = pb.RunPodSandboxRequest.FromString(request).config
        pod = self._learn_pod(sandbox_id, config)
        if pod.qos is None and self.policy.name != "none":
            # kubelet with cgroupsPerQOS: false puts every pod under its cgroup root: no QoS
            # class to read, so nothing is pinned. Said once per pod, where it is decided.
            self.counters["pods_without_qos"] += 1
            log.warning(
                "cannot tell the pod's QoS class from its cgroup parent (kubelet's"
                " cgroupsPerQOS: false?); its containers share",
                extra={"fields": {"pod": pod.label, "cgroup_parent": pod.cgroup_parent}},
            )

    def _held_in_sandbox(self, sandbox_id: str) -> list[ContainerKey]:
        """The assignments of the sandbox's containers, also one whose container id was
        never learnt (the create's reply could not be recorded): once its sandbox stops,
        nothing else would ever release it."""
        return [key for key, a in self.state.assignments.items() if a.sandbox_id == sandbox_id]

    async def _pod_sandbox_stopped(self, request: bytes, response: bytes | None) -> None:
        sandbox_id = self._sandbox_id(pb.StopPodSandboxRequest.FromString(request).pod_sandbox_id)
        async with self.lock:
            self._mark_sandbox_exited(sandbox_id)
            await self._release(self._held_in_sandbox(sandbox_id))

    def _pod_sandbox_stopped_now(self, request: bytes, response: bytes | None) -> Pending | None:
        sandbox_id = self._sandbox_id(pb.StopPodSandboxRequest.FromString(request).pod_sandbox_id)
        if self._held_in_sandbox(sandbox_id):
            return Pending.LATER
        self._mark_sandbox_exited(sandbox_id)
        return None

    def _mark_sandbox_exited(self, sandbox_id: str) -> None:
        for tracked in self.containers.values():
            if tracked.sandbox_id == sandbox_id:
                self._mark_exited(tracked)

    async def _pod_sandbox_removed(self, request: bytes, response: bytes | None) -> Afterwards:
        sandbox_id = self._sandbox_id(pb.RemovePodSandboxRequest.FromString(request).pod_sandbox_id)
        async with self.lock:
            self._untrack_sandbox(sandbox_id)
            await self._release(self._held_in_sandbox(sandbox_id))
            return self._forget_sandbox(sandbox_id)

    def _pod_sandbox_removed_now(
        self, request: bytes, response: bytes | None
    ) -> Afterwards | Pending:
        sandbox_id = self._sandbox_id(pb.RemovePodSandboxRequest.FromString(request).pod_sandbox_id)
        if self._held_in_sandbox(sandbox_id):
            return Pending.LATER
        self._untrack_sandbox(sandbox_id)
        return self._forget_sandbox(sandbox_id)

    async def forget_sandbox_removed_behind(self, sandbox_id: str) -> None:
        """A sandbox a sweep learnt is gone from the runtime: forgotten as its RemovePodSandbox
        would have it (its containers untracked, any CPUs they hold back, its projections)."""
        async with self.lock:
            self._untrack_sandbox(sandbox_id)
            await self._release(self._held_in_sandbox(sandbox_id))
            afterwards = self._forget_sandbox(sandbox_id)
        self.learnt_sandboxes.discard(sandbox_id)
        if afterwards is not None:
            afterwards()

    def _untrack_sandbox(self, sandbox_id: str) -> None:
        for container_id in [t.id for t in self.containers.values() if t.sandbox_id == sandbox_id]:
            self.untrack(container_id)

    def _forget_sandbox(self, sandbox_id: str) -> Afterwards:
        """Forget a removed sandbox; when it was its pod's last, its projection directories
        go once kubelet has its reply (unless a sandbox of the same pod, a static pod's next,
        has come meanwhile), and its released CPUs at the next decision."""
        pod = self.pods.pop(sandbox_id, None)
        if pod is None or any(p.uid == pod.uid for p in self.pods.values()):
            return None
        uid = pod.uid
        projector = self.projector
        if projector is None:
            return None

        def back() -> bool:
            return any(p.uid == uid for p in self.pods.values())

        async def forget() -> None:
            try:
                await projector.forget_pod(uid, unless=back)
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("forgetting a pod failed", extra={"fields": {"pod_uid": uid}})

        return lambda: self._spawn(forget())

    def _learn_pod(self, sandbox_id: str, config: pb.PodSandboxConfig) -> Pod:
        """The pod of a sandbox kubelet names with its config, remembered; a sandbox seen for
        the first time (its RunPodSandbox, or a create whose reply to that was unreadable)
        has its unknown ``cpushim.io/`` annotations told of, once."""
        pod = self.marked(Pod.from_config(sandbox_id, config))
        new = sandbox_id not in self.pods
        self.pods[sandbox_id] = pod
        if new and (unknown := unknown_annotations(pod.annotations)):
            # Ignored as before: a pod must not fail for a key a later cpushim may read. But
            # a misspelt one silently does nothing the operator meant.
            log.warning(
                "pod annotations cpushim does not know are ignored (misspelt?)",
                extra={
                    "fields": {
                        "pod": pod.label,
                        "pod_uid": pod.uid,
                        "annotations": unknown,
                    }
                },
            )
        return pod

    def marked(self, pod: Pod) -> Pod:
        """``pod``, marked when the state says it has pod-level resources (a new sandbox of
        a marked pod, a pod learnt from the runtime)."""
        if pod.uid in self.state.pod_level and not pod.pod_level_resources:
            return replace(pod, pod_level_resources=True)
        return pod

    def _pod_of(self, sandbox_id: str, config: pb.PodSandboxConfig) -> Pod:
        if config.metadata.uid:
            return self._learn_pod(sandbox_id, config)
        known = self.pods.get(sandbox_id)
        if known is not None:
            return known
        # No sandbox config and a sandbox we never saw: nothing to classify by.
        return Pod(sandbox_id, uid=sandbox_id, name="", namespace="", qos=None, cgroup_parent="")

    # --- containers -------------------------------------------------------------------------

    async def _create_container(self, call: UnaryCall, forward: Forward) -> Reply:
        request = pb.CreateContainerRequest.FromString(call.request)
        pod = self._pod_of(self._sandbox_id(request.pod_sandbox_id), request.sandbox_config)
        meta = request.config.metadata
        try:
            plan = plan_container(pod, meta.name, request.config.linux.resources)
        except AnnotationError as exc:
            self.counters["bad_annotations"] += 1
            return Reply.error(Status.INVALID_ARGUMENT, f"cpushim: pod {pod.label}: {exc}")
        key = ContainerKey(pod.uid, meta.name)
        if self.projector is not None:
            problem = self.projector.check(key)
            if problem is not None:
                self.counters["bad_names"] += 1
                return Reply.error(Status.INVALID_ARGUMENT, f"cpushim: pod {pod.label}: {problem}")
        count = plan.exclusive if self.policy.name != "none" else None
        memory_nodes = None
        if count is not None:
            try:
                memory_nodes = kubelet_memory_nodes(request.config.linux.resources)
            except MemoryNodesError as exc:
                self.counters["bad_memory_nodes"] += 1
                return Reply.error(
                    Status.INVALID_ARGUMENT,
                    f"cpushim: pod {pod.label} container {meta.name}: {exc}",
                )
        # Every refusal of the request itself comes before this, so a refused create changes
        # nothing: the earlier attempt marked exited would no longer be watched, and its
        # exit, if cpushim has not seen it yet, would never give its CPUs back.
        for tracked in self.containers.values():
            if tracked.key == key:
                # kubelet makes the next attempt only once the previous one has exited.
                self._mark_exited(tracked)
        if count is None:
            return await self._create_shared(forward, request, pod, key, plan)
        return await self._create_exclusive(forward, request, pod, key, plan, count, memory_nodes)

    async def _shows_pod_level_resources(
        self, pod: Pod, key: ContainerKey, resources: pb.LinuxContainerResources
    ) -> bool:
        """Whether this create, beside the pod's live containers with resources of their
        own, shows the pod's resources to be pod-level ones (shim/pods.py). Costs nothing
        but for such a pod: a sibling that takes the whole pod is looked up in the runtime,
        since an init container that did may have exited a moment ago."""
        if not pod.cpu_shares:
            return False
        mine = [takes_whole_pod(pod, resources)] if has_own_resources(resources) else []
        siblings = [t for t in self._with_own_resources(pod.uid) if t.key != key]
        if not shows_pod_level_resources([*mine, *(t.whole_pod for t in siblings)]):
            return False
        live = await self._still_live(siblings)
        return shows_pod_level_resources([*mine, *(t.whole_pod for t in live)])

    def _with_own_resources(self, pod_uid: str) -> list[Tracked]:
        """The pod's containers not seen exited that have resources of their own, one per
        name (a later attempt's create marked the earlier ones exited)."""
        found: dict[ContainerKey, Tracked] = {}
        for tracked in self.containers.values():
            if (
                tracked.key.pod_uid == pod_uid
                and tracked.phase is not Phase.EXITED
                and tracked.own_resources
            ):
                found.setdefault(tracked.key, tracked)
        return list(found.values())

    async def _still_live(self, containers: list[Tracked]) -> list[Tracked]:
        """Those the runtime says have not exited: an init container that did a moment ago
        may not have been seen yet. One whose state is unknown now is left out: a mark is
        for good, and an exited one would make an ordinary pod look pod-level."""
        live: list[Tracked] = []
        for tracked in containers:
            try:
                state = await self._container_state(tracked.id)
            except RuntimeError:
                continue
            if state not in (None, pb.CONTAINER_EXITED):
                live.append(tracked)
        return live

    def pod_level_candidates(self) -> list[str]:
        """The UIDs of unmarked pods whose tracked containers show pod-level resources
        (before the runtime is asked whether they still run). No runtime call."""
        if self.policy.name == "none":
            return []
        uids = {t.key.pod_uid for t in self.containers.values() if t.whole_pod}
        candidates: list[str] = []
        for uid in sorted(uids - self.state.pod_level):
            sized = self._with_own_resources(uid)
            # A pod none of whose containers asks for exclusive CPUs loses nothing unmarked.
            if any(t.cpus_asked is not None for t in sized) and shows_pod_level_resources(
                [t.whole_pod for t in sized]
            ):
                candidates.append(uid)
        return candidates

    async def mark_pods_with_pod_level_resources(self) -> None:
        """Under the lock, before an adoption: the pods whose containers cpushim took in
        (another client's, or created to share under none) show pod-level resources as a
        create would have; they are marked, and none of their containers is adopted."""
        for uid in self.pod_level_candidates():
            live = await self._still_live(self._with_own_resources(uid))
            pod = next((p for p in self.pods.values() if p.uid == uid), None)
            if pod is not None and shows_pod_level_resources([t.whole_pod for t in live]):
                await self._mark_pod_level(pod)

    async def _mark_pod_level(self, pod: Pod) -> None:
        """Under the lock: from now on none of the pod's containers asks for exclusive CPUs
        (the mark is in the checkpoint), and those pinned give theirs back."""
        for sandbox_id, known in list(self.pods.items()):
            if known.uid == pod.uid:
                self.pods[sandbox_id] = replace(known, pod_level_resources=True)
        for tracked in self.containers.values():
            if tracked.key.pod_uid == pod.uid:
                tracked.cpus_asked = None
        self.counters["pod_level_resource_pods"] += 1
        log.info(
            "a pod with pod-level resources: its containers share, as kubelet's static policy"
            " gives such a pod no exclusive CPUs",
            extra={"fields": {"pod": pod.label, "pod_uid": pod.uid}},
        )
        await self._record(self.state.with_pod_level(pod.uid))
        await self._release([k for k in self.state.assignments if k.pod_uid == pod.uid])

    async def _create_shared(
        self,
        forward: Forward,
        request: pb.CreateContainerRequest,
        pod: Pod,
        key: ContainerKey,
        plan: ContainerPlan,
    ) -> Reply:
        if any(held.pod_uid == pod.uid for held in self.state.assignments):
            async with self.lock:
                # The previous attempt of this container, when it held exclusive CPUs (a
                # resize from whole CPUs to a fraction), and the pod's exited init containers
                # give their CPUs back before it is created, as before an exclusive one. A
                # sibling whose state cannot be read keeps its CPUs: the create goes on.
                await self._release([key])
                await self._release_exited_in_pod(pod.uid, keep=key)
                # Beside a pinned sibling that takes the whole pod, a container with
                # resources of its own shows them to be pod-level ones: in an ordinary pod
                # the sibling's would be less than the totals by this one's.
                if (
                    self.policy.name != "none"
                    and pod.uid not in self.state.pod_level
                    and await self._shows_pod_level_resources(
                        pod, key, request.config.linux.resources
                    )
                ):
                    await self._mark_pod_level(pod)
        pool = self.state.shared
        resources = request.config.linux.resources
        rq.pin(resources, pool)
        shared_mems = _nodes_asked(resources)
        narrowed = _narrowed(self.policy.topology, shared_mems)
        if narrowed:
            assert shared_mems is not None
            # Kept as kubelet's choice (it applies again once its nodes have memory); the
            # runtime is sent what the kernel takes, as an update would be.
            resources.cpuset_mems = str(self.policy.topology.memory_nodes_within(shared_mems))
            self._tell_narrowed(key, "", shared_mems)
        kept = self._nodes_kept(shared_mems)
        await self._project_new(request, key, Cpuset(pool, _mems(kept), exclusive=False))
        policy = self.policy
        reply = await forward(request.SerializeToString())
        response = _response(reply, pb.CreateContainerResponse)
        if response is None:
            if forward.sent and reply.unanswered:
                # The runtime may have made it on the pool of then: the sweep finds it.
                self.counters["unknown_create_outcomes"] += 1
                self._sweep_soon()
            return reply
        async with self.lock:
            self.containers[response.container_id] = Tracked(
                id=response.container_id,
                key=key,
                sandbox_id=pod.sandbox_id,
                pod=pod.label,
                cgroup_parent=self._cgroup_parent(request, pod),
                exclusive=False,
                keep_quota=True,
                shared_mems=shared_mems,
                mems_narrowed=narrowed,
                phase=Phase.CREATED,
                applied=pool,
                recorded=pool,
                attempt=request.config.metadata.attempt,
                cpus_asked=plan.exclusive,
                whole_pod=takes_whole_pod(pod, request.config.linux.resources),
                own_resources=has_own_resources(request.config.linux.resources),
            )
            if narrowed:
                # The runtime's record holds the narrowed nodes: kubelet's are kept here (off
                # the reply's path, as an exclusive create's id is).
                self._record_soon(
                    self.state.with_kubelet_mems(
                        key, KubeletMems(response.container_id, shared_mems)
                    )
                )
            # The pool changed while the runtime created it: correct it before it can start.
            await self._apply()
        if plan.exclusive is not None and self.policy is not policy and self.adopter is not None:
            # Sent to share (under none) while a reload changed the policy: that reload's
            # adoption ran before this container was known.
            self._spawn(self.adopter())
        return reply

    async def _create_exclusive(
        self,
        forward: Forward,
        request: pb.CreateContainerRequest,
        pod: Pod,
        key: ContainerKey,
        plan: ContainerPlan,
        count: int,
        memory_nodes: CPUSet | None,
    ) -> Reply:
        """``memory_nodes``: those kubelet's memory manager chose; the CPUs come from them as
        far as they can, and the container's memory stays there."""
        async with self.lock:
            if self.policy.name != "none":
                reply = await self._create_exclusive_locked(
                    forward, request, pod, key, plan, count, memory_nodes
                )
                if reply is not None:
                    return reply
                # It showed the pod's resources to be pod-level ones: it shares.
                pod = self.pods.get(pod.sandbox_id, pod)
                plan = replace(plan, exclusive=None)
        # Or a reload to the none policy took the lock first: the container shares.
        return await self._create_shared(forward, request, pod, key, plan)

    async def _create_exclusive_locked(
        self,
        forward: Forward,
        request: pb.CreateContainerRequest,
        pod: Pod,
        key: ContainerKey,
        plan: ContainerPlan,
        count: int,
        memory_nodes: CPUSet | None,
    ) -> Reply | None:
        """The exclusive create, under the engine lock; None when the container is to share
        instead (it showed its pod's resources to be pod-level ones)."""
        attempt = request.config.metadata.attempt
        self.counters["pinning_requests"] += 1
        # A sibling whose state the runtime does not give now keeps its CPUs, and the create
        # goes on with the others: failing it would fail a sidecar's pod for a slow reply.
        unknown = await self._release_exited_in_pod(pod.uid, keep=key)
        if pod.uid in self.state.pod_level:
            return None  # marked while this create waited for the lock
        # Under the lock: a sibling created meanwhile is recorded by now.
        if await self._shows_pod_level_resources(pod, key, request.config.linux.resources):
            await self._mark_pod_level(pod)
            return None
        held = self.state.assignments.get(key)
        if held is not None and self._may_keep(key, held.cpus, count, plan, memory_nodes):
            # A restart of the same container (next attempt): its CPUs follow it, when the
            # policy would hand out that set now (a reload or restart may have turned on an
            # option it does not meet).
            cpus = held.cpus
        else:
            if held is not None:
                # The next attempt asks for another count: the old CPUs go back first,
                # persisted and with the shared containers grown, so that a refusal
                # below leaves memory, the checkpoint and the cgroups agreeing.
                await self._release([key])
            chosen = self._choose(key, count, plan, memory_nodes, unknown)
            if isinstance(chosen, Reply):
                return chosen
            cpus = chosen
        assignment = Assignment(cpus, "", pod.sandbox_id, attempt, pod.label, memory_nodes)
        mems = self._mems_of(assignment)
        if _narrowed(self.policy.topology, memory_nodes):
            assert memory_nodes is not None
            self._tell_narrowed(key, "", memory_nodes)
        # The projection does not wait for the decision's fsync: until the container
        # exists nobody reads it, and a failed decision leaves it to the pod's removal.
        projecting = self._spawn(
            self._project_new(request, key, Cpuset(cpus, mems, exclusive=True))
        )
        try:
            try:
                decided = self.state.assign(key, assignment, self.policy)
                await self._commit(decided.keep_released(self._pod_uids()))
                await self._apply()
            finally:
                await projecting
        except Exception:
            # Nothing went to the runtime: the decision goes back (persisted, the shared
            # containers grown) before the failure policy answers, or forwards unchanged.
            if self.state.assignments.get(key) is assignment:
                await self._release([key])
            raise
        resources = request.config.linux.resources
        kubelet_quota = kubelet_cfs_quota(
            resources.cpu_shares, resources.cpu_quota, resources.cpu_period
        )
        rq.pin(resources, cpus, mems, quota=None if plan.keep_quota else rq.NO_QUOTA)
        recorded = False

        def record(reply: Reply) -> bool:
            """Learn the new container: done as the reply comes in (``seen``), so
            kubelet has the reply without waiting for this coroutine to be resumed, and
            knows the container no sooner than cpushim does."""
            nonlocal recorded
            response = _response(reply, pb.CreateContainerResponse)
            if response is None:
                return False
            self._record_created(
                request, pod, key, plan, assignment, kubelet_quota, response.container_id
            )
            recorded = True
            return True

        reply = await forward(request.SerializeToString(), seen=record)
        # Looked at again unless the hook recorded it: a hook that failed fails here too,
        # where the forwarded reply stands (Engine._dispatch), rather than rolling back
        # the CPUs of a container that exists.
        if not recorded and not record(reply):
            fields = {
                **self._named(key),
                "cpus": str(cpus),
                "error": f"{reply.status.name}: {reply.status_message}",
            }
            if forward.sent and reply.unanswered:
                # The request went out and no answer came back (kubelet's or the runtime's
                # connection was lost, the stream was reset, the wait gave up): the runtime
                # may have made the container on these CPUs. They stay held without a
                # container id, as while a create is on its way: the next attempt of the
                # container takes them over, its sandbox's stop releases them, a restart
                # finds the container by pod and name.
                self.counters["unknown_create_outcomes"] += 1
                # The sweep finds the container if the runtime made it, and gives it the id.
                self._sweep_soon()
                log.warning("create outcome unknown; its CPUs stay held", extra={"fields": fields})
                return reply
            if held is not None and not held.container_id and cpus == held.cpus:
                # An earlier create of this container went unanswered and this retry was
                # refused (containerd: its name is reserved for the container that create
                # made): that container may be on these CPUs, so they stay held, as before.
                await self._record(self.state.assign(key, held, self.policy))
                log.warning(
                    "create failed; its CPUs stay held for an earlier unanswered create",
                    extra={"fields": fields},
                )
                return reply
            # Not a pinning error: the CPUs were there, the runtime failed the create
            # (kubelet's counter, too, counts only what its policy could not allocate).
            self.counters["failed_exclusive_creates"] += 1
            log.info("create failed; CPUs returned", extra={"fields": fields})
            await self._release([key])
        return reply

    def _record_created(
        self,
        request: pb.CreateContainerRequest,
        pod: Pod,
        key: ContainerKey,
        plan: ContainerPlan,
        assignment: Assignment,
        kubelet_quota: int,
        container_id: str,
    ) -> None:
        """A pinned container the runtime has created: its id goes into the state, and it is
        tracked from now on. Runs under the decision's lock and never suspends."""
        # Off the reply's path: a checkpoint without the id is squared at start-up (the
        # container is found by pod and name), so this write need not be waited for.
        self._record_soon(self.state.update(key, container_id=container_id))
        cpus = assignment.cpus
        self.containers[container_id] = Tracked(
            id=container_id,
            key=key,
            sandbox_id=pod.sandbox_id,
            pod=pod.label,
            cgroup_parent=self._cgroup_parent(request, pod),
            exclusive=True,
            keep_quota=plan.keep_quota,
            kubelet_quota=kubelet_quota,
            kubelet_mems=assignment.mems,
            mems_narrowed=_narrowed(self.policy.topology, assignment.mems),
            phase=Phase.CREATED,
            applied=cpus,
            recorded=cpus,
            attempt=assignment.attempt,
            cpus_asked=plan.exclusive,
            whole_pod=takes_whole_pod(pod, request.config.linux.resources),
            own_resources=True,  # it asks for whole CPUs
        )
        log.info(
            "pinned",
            extra={
                "fields": {
                    **self.containers[container_id].named(),
                    "cpus": str(cpus),
                    "mems": self._mems_of(assignment),
                    "shared": str(self.state.shared),
                }
            },
        )

    def _may_keep(
        self,
        key: ContainerKey,
        cpus: CPUSet,
        count: int,
        plan: ContainerPlan,
        memory_nodes: CPUSet | None,
    ) -> bool:
        """Whether the policy would hand ``cpus``, which ``key`` holds, to its request now."""
        others = {k: c for k, c in self.state.exclusive().items() if k != key}
        request = exclusive_request(count, plan.isolated, memory_nodes)
        return self.policy.refusal(others, request, cpus) is None

    def wait_for_room(self) -> None:
        """A container that shares and asks for exclusive CPUs was refused them: the next
        release asks for its adoption."""
        self.room_wanted = True
        self.room_tried = None

    def free_exclusive(self) -> CPUSet:
        """The CPUs the policy could hand out exclusively that nobody holds now."""
        held = CPUSet().union(*self.state.exclusive().values())
        return self.policy.exclusive_candidates - held

    def _choose(
        self,
        key: ContainerKey,
        count: int,
        plan: ContainerPlan,
        memory_nodes: CPUSet | None,
        unknown: Sequence[ContainerKey] = (),
    ) -> CPUSet | Reply:
        exclusive = self.state.exclusive()
        free = self.free_exclusive()
        request = exclusive_request(count, plan.isolated, memory_nodes)
        released = self.state.released.get(key)
        # Old CPUs come back only as a set the policy would hand out now: a reload or a
        # restart may have turned on an option they do not meet.
        if released is not None and self.policy.refusal(exclusive, request, released) is None:
            return released
        try:
            return self.policy.allocate(exclusive, request)
        except AllocationError as exc:
            self.counters["pinning_errors"] += 1
            pod = self.pods.get(self._sandbox_of(key), None)
            label = pod.label if pod is not None else key.pod_uid
            message = (
                f"cpushim: cannot give pod {label} container {key.name} {count} exclusive"
                f" CPU{'s' if count != 1 else ''}: {exc} (free: {free or 'none'},"
                f" shared pool: {self.state.shared})"
            )
            if unknown:
                names = ", ".join(k.name for k in unknown)
                message += (
                    f"; the runtime did not say whether {names} of the pod exited, so"
                    " their CPUs stay held"
                )
            log.warning(
                "allocation refused", extra={"fields": {**self._named(key), "error": message}}
            )
            return Reply.error(Status.RESOURCE_EXHAUSTED, message)

    async def _project_new(
        self, request: pb.CreateContainerRequest, key: ContainerKey, cpuset: Cpuset
    ) -> None:
        """Write the projection of a container about to be created and mount it into it."""
        if self.projector is None:
            return
        target = str(self.projector.mount_path)
        mounts = request.config.mounts
        if any(_at_or_under(m.container_path, target) for m in mounts):
            log.warning(
                "the container already mounts something at the projection's path; not projected",
                extra={"fields": {**self._named(key), "path": target}},
            )
            return
        if any(m.readonly and _at_or_under(target, m.container_path) for m in mounts):
            # The runtime would have to make the mount point inside that read-only volume,
            # and the container would not start at all (runc: "read-only file system").
            log.warning(
                "the container mounts a read-only volume above the projection's path;"
                " not projected",
                extra={"fields": {**self._named(key), "path": target}},
            )
            return
        mount = await self.projector.prepare(key, cpuset)
        if mount is not None:
            request.config.mounts.append(mount)

    def project(self, tracked: Tracked) -> None:
        """Project a live container's cpuset as it is now (after its cgroup changed)."""
        if self.projector is None or tracked.phase is Phase.EXITED or tracked.applied is None:
            return
        if self.containers.get(tracked.id) is not tracked:
            # Forgotten while a move or repair of it was under way (its pod removed): a write
            # now would make its directory again, for good.
            return
        cpus, mems, _ = self._desired(tracked)
        if cpus != tracked.applied:
            return  # not moved yet; the move projects it
        if not mems:
            # Left as they are: the nodes the cgroup keeps, not every node.
            mems = _mems(self._nodes_kept(tracked.shared_mems))
        pinned = self._assignment_of(tracked) is not None
        self.projector.update(tracked.key, Cpuset(cpus, mems, exclusive=pinned))

    @staticmethod
    def _cgroup_parent(request: pb.CreateContainerRequest, pod: Pod) -> str:
        return request.sandbox_config.linux.cgroup_parent or pod.cgroup_parent

    def _pod_uids(self) -> set[str]:
        """The pods that have a sandbox: the released CPUs of any other pod are forgotten at
        the next decision (a pod's removal changes no CPU, so it writes no checkpoint)."""
        return {pod.uid for pod in self.pods.values()}

    def _sandbox_of(self, key: ContainerKey) -> str:
        for pod in self.pods.values():
            if pod.uid == key.pod_uid:
                return pod.sandbox_id
        return ""

    async def _container_started(self, request: bytes, response: bytes | None) -> Afterwards:
        return self._container_started_now(request, response)

    def _container_started_now(self, request: bytes, response: bytes | None) -> Afterwards:
        container_id = self._container_id(pb.StartContainerRequest.FromString(request).container_id)
        tracked = self.containers.get(container_id)
        if tracked is None:
            return None
        tracked.phase = Phase.RUNNING
        # Once kubelet has its reply: the ContainerStatus this needs would otherwise go out
        # ahead of the reply and have containerd busy with it when kubelet's next call comes.
        return lambda: self._spawn(self._locate(tracked))

    async def _locate(self, tracked: Tracked) -> None:
        """Learn where a started container's cgroup is, so later moves can write it directly
        and the watcher can watch it."""
        found = await self.mover.find(tracked, just_started=True)
        if found.ended:
            # Ended before its cgroup was looked for: no watch would see it.
            await self.container_exited(tracked.id)
        elif self.watcher is None:
            return
        elif tracked.cgroup is not None:
            self.watcher.watch(tracked)
        elif not found.answered:
            # Unwatched, its exit would hold its CPUs until a full look, and with
            # resyncPeriod 0 none comes.
            self.watcher.watch_again_later(tracked.id)

    def _mark_exited(self, tracked: Tracked) -> None:
        tracked.phase = Phase.EXITED
        if self.watcher is not None:
            self.watcher.unwatch(tracked.id)

    def _container_id(self, named: str) -> str:
        """The full id of a container a call names. kubelet sends full ids; crictl and other
        clients may send a prefix, which the runtime takes when it is unique: resolved
        among the containers cpushim knows (the runtime's are more, so where it finds the
        prefix ambiguous it refuses the call, and a refused call changes nothing here)."""
        if not named or named in self.containers or len(named) >= FULL_ID_LENGTH:
            return named
        known = set(self.containers)
        known.update(a.container_id for a in self.state.assignments.values())
        return _unique_prefix_match(named, known)

    def _sandbox_id(self, named: str) -> str:
        """The full id of a sandbox a call names (see ``_container_id``)."""
        if not named or named in self.pods or len(named) >= FULL_ID_LENGTH:
            return named
        known = set(self.pods)
        known.update(a.sandbox_id for a in self.state.assignments.values())
        known.update(t.sandbox_id for t in self.containers.values())
        return _unique_prefix_match(named, known)

    def untrack(self, container_id: str) -> None:
        """Stop tracking and watching a container the runtime no longer has (its CPUs are
        the caller's to release)."""
        self.containers.pop(container_id, None)
        if self.watcher is not None:
            self.watcher.unwatch(container_id)

    async def container_exited(self, container_id: str) -> None:
        """The container's process is gone without a call from kubelet (crash, an init
        container run to completion, a kill from outside): its CPUs go back at once."""
        async with self.lock:
            tracked = self.containers.get(container_id)
            if tracked is None or tracked.phase is Phase.EXITED:
                return
            self._mark_exited(tracked)
            self.counters["exits_seen"] += 1
            log.info(
                "container exited",
                extra={"fields": tracked.named()},
            )
            key = self.state.holding(container_id)
            if key is not None:
                await self._release([key])

    async def _container_stopped(self, request: bytes, response: bytes | None) -> None:
        container_id = self._container_id(pb.StopContainerRequest.FromString(request).container_id)
        async with self.lock:
            tracked = self.containers.get(container_id)
            if tracked is not None:
                self._mark_exited(tracked)
            key = self.state.holding(container_id)
            if key is not None:
                await self._release([key])

    def _container_stopped_now(self, request: bytes, response: bytes | None) -> Pending | None:
        container_id = self._container_id(pb.StopContainerRequest.FromString(request).container_id)
        if self.state.holding(container_id) is not None:
            return Pending.LATER
        tracked = self.containers.get(container_id)
        if tracked is not None:
            self._mark_exited(tracked)
        return None

    async def _container_removed(self, request: bytes, response: bytes | None) -> None:
        container_id = self._container_id(
            pb.RemoveContainerRequest.FromString(request).container_id
        )
        async with self.lock:
            await self._forget_removed(container_id)

    async def _forget_removed(self, container_id: str) -> None:
        """Under the lock: the runtime no longer has the container, so no call will name it
        again; it is untracked, and any CPUs it holds go back."""
        self.untrack(container_id)
        key = self.state.holding(container_id)
        if key is not None:
            await self._release([key])

    def _container_removed_now(self, request: bytes, response: bytes | None) -> Pending | None:
        container_id = self._container_id(
            pb.RemoveContainerRequest.FromString(request).container_id
        )
        if self.state.holding(container_id) is not None:
            return Pending.LATER
        self.untrack(container_id)
        return None

    async def _update_container_resources(self, call: UnaryCall, forward: Forward) -> Reply:
        request = pb.UpdateContainerResourcesRequest.FromString(call.request)
        # The request goes on naming the container as its client did: the runtime resolves
        # a prefix itself, and refuses one that also names a container cpushim does not know.
        while True:
            tracked = self.containers.get(self._container_id(request.container_id))
            if tracked is None:
                return await forward()
            forwarding: asyncio.Task[Reply] | None = None
            async with self.lock:
                resized, refusal = await self._resize_in_place(tracked, request.linux)
                if refusal is not None:
                    # kubelet retries a resize the runtime refuses at every sync of the pod,
                    # and shows the error in its status: the refusal is applied once there
                    # is room.
                    return refusal
                # Taken under the engine's lock, as every move takes it (no deadlock between
                # them), and waited for as a move waits: a record in flight to a hung shim
                # holds it until its deadline, and every other pod's decisions would wait.
                if await self.mover.turn(tracked):
                    update, forwarding = await self._forwarding(tracked, request, forward)
                    if not resized:
                        break
                    # A new count of exclusive CPUs is waited for under the lock: CPUs it
                    # gives back must not be handed out before it has left them.
                    wait = self.mover.call_wait(tracked)
                    if await self.mover.answered_within(tracked, forwarding, wait):
                        return await self._resize_answered(tracked, request, update, forwarding)
                if resized:
                    if not self.mover.write_past_call(tracked, *self._desired(tracked)).moved:
                        # Not written past the call either (its cgroup unknown, or the kernel
                        # refused): CPUs it gives back are not handed out before the runtime
                        # has taken them from it, however long its shim takes.
                        if forwarding is None:
                            await tracked.write_lock.acquire()
                            update, forwarding = await self._forwarding(tracked, request, forward)
                        return await self._resize_answered(tracked, request, update, forwarding)
                    # Its runtime does not answer for it (a hung shim would hold the call
                    # until kubelet's deadline, minutes): it is moved in its cgroup past
                    # the call, which writes the latest cpuset again when it ends, and the
                    # CPUs it gave back go to the others now.
                    self.project(tracked)
                    await self._grown_after_resize()
                    if forwarding is not None:
                        break
            # Waited for outside the engine's lock, then decided again (a resize applied
            # already is not one any more: it is forwarded as any other update).
            async with tracked.write_lock:
                pass
        # Forwarded holding the container's write lock alone: when its shim hangs, the call
        # waits until kubelet's deadline (minutes), and the decisions of every other pod
        # would wait with it. A move of this container meanwhile waits a moment, then goes
        # past the call (shim/engine/moves.py), which then writes the latest cpuset again.
        reply = await forwarding
        if reply.status is Status.OK and tracked.adoption_refused and tracked.resize_noted:
            # It waits for room, and the resize noted may fit: the adoption asked for when it
            # was noted may have read the runtime's record before the runtime took the new
            # count, and planned for the old one.
            self._room_for_resize()
        if tracked.settings_stale and reply.status is not Status.NOT_FOUND:
            # Written past the call, which the runtime refused or which carried older
            # settings (_gave_settings): its quota and memory nodes are given by the move's
            # retry.
            self._move_retry.soon()
        refused_nodes = update.asked is not None and reply.status is not Status.OK
        if refused_nodes or self._gone(tracked, request, reply):
            async with self.lock:
                await self._after_update(tracked, request, update, reply)
        return reply

    async def _forwarding(
        self, tracked: Tracked, request: pb.UpdateContainerResourcesRequest, forward: Forward
    ) -> tuple[_Update, asyncio.Task[Reply]]:
        """kubelet's update with cpushim's cpuset written into it, forwarded in a task that is
        handed the container's write lock (the caller's, taken under the engine's lock)."""
        try:
            update = await self._prepare_update(tracked, request)
        except BaseException:
            tracked.write_lock.release()
            raise
        call = partial(self._forward_update, tracked, update, request, forward)
        # Always awaited (the handler's failure policy tells a defect in it).
        return update, self.mover.hand_on(tracked, call, awaited=True)

    async def _resize_answered(
        self,
        tracked: Tracked,
        request: pb.UpdateContainerResourcesRequest,
        update: _Update,
        forwarding: asyncio.Task[Reply],
    ) -> Reply:
        """A resize of exclusive CPUs waited for under the engine's lock: its answer, what
        that leaves to do, and the CPUs it gave back handed on."""
        reply = await forwarding
        await self._after_update(tracked, request, update, reply)
        await self._grown_after_resize()
        return reply

    async def _forward_update(
        self,
        tracked: Tracked,
        update: _Update,
        request: pb.UpdateContainerResourcesRequest,
        forward: Forward,
    ) -> Reply:
        """Forward kubelet's update, cpushim's cpuset in it, holding the container's write
        lock (:meth:`Mover.hand_on` gives it back)."""
        reply = await forward(request.SerializeToString())
        self._updated(tracked, update, reply)
        return reply

    async def _grown_after_resize(self) -> None:
        """CPUs a resize gave back go to the shared containers now that it has left them,
        and, as after any release, to a container waiting for room."""
        await self._apply()
        self._tell_room_made()

    @staticmethod
    def _gone(tracked: Tracked, request: pb.UpdateContainerResourcesRequest, reply: Reply) -> bool:
        """Whether the runtime answered that the container is gone: only when named in full,
        as kubelet names it (that a prefix was not resolved to one container need not mean
        this one is gone)."""
        return reply.status is Status.NOT_FOUND and request.container_id == tracked.id

    async def _prepare_update(
        self, tracked: Tracked, request: pb.UpdateContainerResourcesRequest
    ) -> _Update:
        """Write cpushim's cpuset into an update of a tracked container (the engine's lock and
        the container's write lock held)."""
        cpus, mems, quota = self._desired(tracked)
        asked = None
        chosen_before = self.state.kubelet_mems.get(tracked.key)
        if mems:
            await self._keep_kubelets_mems([tracked])
        elif request.linux.cpuset_mems:
            # Not on kubelet's usual path: its updates name no memory nodes.
            asked = await self._take_asked_mems(tracked, request.linux)
        if request.linux.cpu_quota > 0:
            tracked.kubelet_quota = request.linux.cpu_quota
        # kubelet's own quota stands unless the container's exclusive CPUs drop it; an
        # update that names none (not kubelet's) still gives a container that lost its
        # exclusive CPUs kubelet's quota back, or _restored below would leave it at -1.
        theirs = quota != rq.NO_QUOTA and request.linux.cpu_quota > 0
        rq.pin(request.linux, cpus, mems, quota=None if theirs else quota)
        # With a move of the container still to be tried again, its children must make
        # room first, or cgroup v1 refuses the runtime's write and kubelet's call fails;
        # so must they for memory nodes the call names, which runc writes too.
        sent_mems = mems or (request.linux.cpuset_mems if asked is not None else "")
        written = self.mover.write_tree_first(tracked, cpus, sent_mems)
        return _Update(cpus, sent_mems, quota, asked, chosen_before, written, tracked.moved_at)

    def _updated(self, tracked: Tracked, update: _Update, reply: Reply) -> None:
        """What the runtime's answer to an update means for the container (its write lock
        held)."""
        self.mover.heard(tracked, reply)
        # A move went past the call while the runtime did not answer for the container: its
        # cpuset is the latest, and the runtime's write of the call's may have landed after.
        overtaken = tracked.moved_at != update.moved_at
        latest = tracked.applied
        cpus = update.cpus
        if reply.status is Status.OK:
            tracked.applied = tracked.recorded = cpus
            if update.asked is not None:
                # Its choice from now on, as a restart would know it: not the nodes kept
                # from exclusive CPUs it lost, which an adoption would give it otherwise.
                tracked.shared_mems = update.asked
                tracked.kubelet_mems = None
                # Told once the runtime took them: a refused update leaves the
                # container's own nodes, and the mark of their warning, as they were.
                self._note_narrowing(tracked, update.asked)
            if not overtaken or self._gave_settings(tracked, update):
                self._restored(tracked)
        elif update.written:
            self.mover.refused_after_tree_write(tracked, cpus, update.mems, update.quota, reply)
            if tracked.settings_stale:
                # Memory nodes or a quota went unrecorded with the refusal: the move that
                # gives them is tried again, not left to the next decision. Nodes the
                # call named, which the cgroups hold now, give way to the container's.
                self._move_retry.soon()
        elif reply.status is not Status.NOT_FOUND:
            # runc may have told systemd before it failed (or the reply was lost after it
            # did): what the record holds is unknown, as after cpushim's own refusals.
            tracked.recorded = None
        if overtaken:
            tracked.applied = latest
            self.mover.write_past(tracked)
        if reply.status is Status.OK or update.written or overtaken:
            self.project(tracked)

    def _gave_settings(self, tracked: Tracked, update: _Update) -> bool:
        """Whether an update a move went past carried the memory nodes and quota the
        container should have now. A move through the runtime past the call (its runtime
        not answering: Mover.write_past_call) writes the container's CPUs and memory nodes
        into its cgroup and leaves the rest to the move's retry (settings_stale): an answer
        to a call that carried other settings does not give them. Taken for given, the
        runtime's write of the call's older memory nodes would stay in the cgroup and its
        record, and a container that lost its exclusive CPUs would share with their quota."""
        _, mems, quota = self._desired(tracked)
        return (update.mems, update.quota) == (mems, quota)

    async def _after_update(
        self,
        tracked: Tracked,
        request: pb.UpdateContainerResourcesRequest,
        update: _Update,
        reply: Reply,
    ) -> None:
        """What an update's answer leaves to do under the engine's lock."""
        if update.asked is not None and reply.status is not Status.OK:
            # The nodes the refused call named are no one's choice: a restart would
            # otherwise take them from the checkpoint over the container's own.
            await self._record(self.state.with_kubelet_mems(tracked.key, update.chosen_before))
        if self._gone(tracked, request, reply):
            # Removed on the runtime without cpushim: no call from kubelet will name it
            # again, and its CPUs would stay held until a sweep found it gone.
            log.info(
                "an updated container is gone from the runtime; forgotten",
                extra={"fields": tracked.named()},
            )
            await self._forget_removed(tracked.id)

    async def _take_asked_mems(
        self, tracked: Tracked, resources: pb.LinuxContainerResources
    ) -> CPUSet | None:
        """The memory nodes an update names for a container whose nodes cpushim leaves as
        they are (one that shares): they are kubelet's choice for it from now on, as a
        create's are, once the runtime takes the update (the caller keeps them then, and
        tells of a narrowing), None: none that parse, passed on for the runtime to refuse.
        Those that have no memory now are left out of ``resources`` as a create's are, else
        the kernel refuses the update; the checkpoint keeps kubelet's choice first when the
        runtime's record will hold other nodes, or when it kept an earlier choice for the
        container, which a restart would take over the record. Under the lock."""
        asked = _nodes_asked(resources)
        if asked is None:
            return None
        topology = self.policy.topology
        narrowed = _narrowed(topology, asked)
        if narrowed or tracked.key in self.state.kubelet_mems:
            chosen = KubeletMems(tracked.id, asked)
            await self._record(self.state.with_kubelet_mems(tracked.key, chosen))
        if narrowed:
            resources.cpuset_mems = str(topology.memory_nodes_within(asked))
        return asked

    def _cpu_resize(
        self, tracked: Tracked, resources: pb.LinuxContainerResources
    ) -> _CPUResize | None:
        """The count of exclusive CPUs kubelet's update asks a running container for, when
        that is a resize: another count than it holds, and, for one that holds none, than
        it was created asking for (the CPU values of a memory resize of a container that
        lost its CPUs to a new policy, or that shares since it was created under none). One
        that holds some may hold another count than it was created with (a resize the
        runtime refused after cpushim applied it, found so by a restart). None otherwise."""
        if resources.cpu_shares == 0:
            return None  # names no CPU request (kubelet always does): another client's update
        pod = self.pods.get(tracked.sandbox_id)
        if pod is None or tracked.phase is Phase.EXITED:
            return None
        if pod.qos is QOSClass.GUARANTEED and not request_is_limit(
            resources.cpu_shares, resources.cpu_quota, resources.cpu_period
        ):
            # No CPU resize of kubelet's: a Guaranteed container's request is its limit. An
            # update whose shares and quota disagree (a memory resize carrying a CPU limit
            # read back from the runtime, which cpushim's quota of -1 leaves unknown) is
            # not taken for a fraction: its set stays.
            return None
        try:
            plan = plan_container(pod, tracked.key.name, resources)
        except AnnotationError:
            return None  # the pod's annotations were checked at create; nothing to compare with
        asked = plan.exclusive if self.policy.name != "none" else None
        key = self.state.holding(tracked.id)
        assignment = self.state.assignments[key] if key is not None else None
        held = len(assignment.cpus) if assignment is not None else None
        if asked == held or (held is None and asked == tracked.cpus_asked):
            self._resize_noted(tracked, None)
            return None
        return _CPUResize(asked or 0, plan, assignment)

    async def _resize_in_place(
        self, tracked: Tracked, resources: pb.LinuxContainerResources
    ) -> tuple[bool, Reply | None]:
        """kubelet resizes a running container's CPU in place (InPlacePodVerticalScaling)
        with UpdateContainerResources; under the lock, before the call is forwarded. A new
        count of exclusive CPUs is applied as a create's would be: decided, persisted, and
        the shared containers moved off CPUs it gains before the forward gives them to it
        (the caller grows them onto CPUs it gave back once the forward is done). A whole
        count becomes a set (:meth:`StaticPolicy.resize` keeps what it can of the old one),
        a fraction makes it share. Returns whether one was applied, and the refusal to answer
        kubelet with when the policy cannot give the count asked (RESOURCE_EXHAUSTED; nothing
        changes). OSError when the checkpoint cannot be written, and nothing changes then."""
        resize = self._cpu_resize(tracked, resources)
        if resize is None:
            return False, None
        held = resize.assignment
        if held is None and (tracked.exclusive or tracked.adoption_refused or not resize.asked):
            # One that lost its CPUs to a re-plan: adopted when room is made, for the count
            # this asks.
            self._note_waiting_resize(tracked, resize.asked)
            return False, None
        key = tracked.key
        policy = self.policy
        # kubelet's memory manager's choice: kept with its CPUs, or (as an adoption takes it)
        # the nodes it gave the container while it shared.
        mems = held.mems if held is not None else tracked.memory_nodes_chosen
        if held is not None and not resize.asked:
            state = self.state.release([key], policy)
            cpus = CPUSet()
        else:
            request = exclusive_request(resize.asked, resize.plan.isolated, mems)
            others = {k: a.cpus for k, a in self.state.assignments.items() if k != key}
            released = self.state.released.get(key)
            if (
                held is None
                and released is not None
                and not policy.refusal(others, request, released)
            ):
                # The CPUs it gave back when it last shrank to a fraction, as a create's next
                # attempt gets them back: its caches may still hold its data.
                cpus = released
            else:
                try:
                    cpus = policy.resize(others, request, held.cpus if held else CPUSet())
                except AllocationError as exc:
                    return False, self._resize_refused(tracked, resize, str(exc))
            assignment = held or Assignment(
                cpus,
                tracked.id,
                tracked.sandbox_id,
                tracked.attempt,
                self._pod_label_of(key),
                mems,
            )
            state = self.state.assign(key, replace(assignment, cpus=cpus), policy)
        await self._commit(state)
        before = held.cpus if held is not None else CPUSet()
        tracked.cpus_asked = resize.asked or None
        if resources.cpu_quota > 0:
            tracked.kubelet_quota = resources.cpu_quota
        if held is None:
            tracked.exclusive = True
            tracked.keep_quota = resize.plan.keep_quota
            # Restored, with kubelet's quota, should it share again.
            tracked.kubelet_mems = mems
        self._resize_noted(tracked, None)
        self.counters["cpu_resizes_applied"] += 1
        log.info(
            "resized in place",
            extra={
                "fields": {
                    **tracked.named(),
                    "exclusive_cpus_held": len(before),
                    "exclusive_cpus_asked": resize.asked,
                    "cpus_before": str(before) if before else "shared",
                    "cpus": str(cpus) if cpus else "shared",
                    "shared": str(self.state.shared),
                }
            },
        )
        if cpus - before:
            # The shared containers leave the CPUs it gains before the forward gives them.
            await self._apply(leave=tracked)
        return True, None

    def _resize_refused(self, tracked: Tracked, resize: _CPUResize, reason: str) -> Reply:
        """The answer to a resize the policy cannot give: logged and counted once per count
        asked (kubelet asks again at every sync of the pod)."""
        held = resize.assignment.cpus if resize.assignment is not None else CPUSet()
        message = (
            f"cpushim: cannot resize pod {self._pod_label_of(tracked.key) or tracked.key.pod_uid}"
            f" container {tracked.key.name} in place to {resize.asked} exclusive"
            f" CPU{'s' if resize.asked != 1 else ''}: {reason} (it holds {held or 'none'};"
            f" free: {self.free_exclusive() or 'none'}, shared pool: {self.state.shared})"
        )
        if tracked.resize_noted != resize.asked:
            self._resize_noted(tracked, resize.asked)
            self.counters["cpu_resizes_not_applied"] += 1
            log.warning(
                "in-place CPU resize refused",
                extra={
                    "fields": {
                        **tracked.named(),
                        "exclusive_cpus_held": len(held),
                        "exclusive_cpus_asked": resize.asked,
                        "error": message,
                    }
                },
            )
        return Reply.error(Status.RESOURCE_EXHAUSTED, message)

    def _note_waiting_resize(self, tracked: Tracked, noted: int) -> None:
        """An in-place resize to ``noted`` CPUs of a container that holds none and waits for
        exclusive CPUs (it lost them to a re-plan, or an adoption found no room): it goes on
        all the same, and the adoption that waits for room plans for the count asked.
        Logged and counted, once per count asked. (A pod with pod-level resources asks for
        none: no resize.)"""
        if tracked.resize_noted == noted:
            return
        self._resize_noted(tracked, noted)
        self.counters["cpu_resizes_not_applied"] += 1
        log.warning(
            "kubelet asks for another count of exclusive CPUs for a running container, and"
            " cpushim cannot apply it now; its cpuset is kept until the container is created"
            " again or resized once more",
            extra={
                "fields": {
                    **tracked.named(),
                    "exclusive_cpus_held": 0,
                    "exclusive_cpus_asked": noted,
                    "cpus": str(tracked.applied),
                    "reason": "it waits for room for the CPUs it asks",
                }
            },
        )

    def _resize_noted(self, tracked: Tracked, noted: int | None) -> None:
        """An adoption plans for the count a resize noted: one waiting for room may fit now,
        and would otherwise wait for a release or a full look."""
        changed = tracked.resize_noted != noted
        tracked.resize_noted = noted
        if changed and tracked.adoption_refused:
            self._room_for_resize()

    def _room_for_resize(self) -> None:
        """Have the containers waiting for room looked at again, as after a release."""
        if self.room_made is not None:
            self.room_tried = None
            self.room_made()

    # --- a new policy while running ------------------------------------------------------------

    async def change_policy(self, policy: CPUPolicy) -> list[ContainerKey]:
        """Run under ``policy`` from now on (a config reload, CPUs going offline or online):
        assignments it would hand their containers now are kept, the others get new CPUs
        where it can give them, every container is moved to match, and the checkpoint says
        so. A set a container cpushim does not track may run on (:meth:`untracked_holders`)
        is kept as it is, first, as start-up keeps an unread container's; one the policy
        cannot leave held is released and warned of. Containers kept on their CPUs whose
        memory nodes derive from the machine's are moved too when those changed
        (:meth:`_follow_memory_nodes`). Returns the containers that lost their exclusive
        CPUs for good (they share now). OSError when the checkpoint cannot be written, and
        nothing changes then."""
        async with self.lock:
            before = self.policy.topology
            # The rule start-up re-plans by: a set stays only if it would be handed out now,
            # and one a container cpushim does not track may run on is kept as it is, first.
            unmovable = self.untracked_holders()
            planned, displaced = replan(
                self.state,
                policy,
                lambda _, assignment: self._request_again(assignment),
                unmovable=unmovable,
            )
            lost: list[ContainerKey] = []
            # Told and counted here: the adoptions that try again do not tell it again.
            refused: set[ContainerKey] = set()
            untracked_lost: dict[ContainerKey, CPUSet] = {}
            for key in displaced:
                old = self.state.assignments[key]
                if key in unmovable:
                    # Released, as at start-up: new CPUs would be held for a container that
                    # goes on running on these until a sweep reads it, and that sweep's
                    # adoption gives it CPUs by what it asks for then.
                    lost.append(key)
                    untracked_lost[key] = old.cpus
                    continue
                if policy.name == "none":
                    # Asked for by the operator: nothing failed, and no alert should fire.
                    lost.append(key)
                    log.info(
                        "the none policy pins nothing; the container shares",
                        extra={"fields": self._named(key)},
                    )
                    continue
                try:
                    cpus = policy.allocate(planned.exclusive(), self._request_again(old))
                except AllocationError as exc:
                    lost.append(key)
                    refused.add(key)
                    self.counters["pinning_errors"] += 1
                    log.error(
                        "a running container cannot keep exclusive CPUs under the new policy;"
                        " it shares",
                        extra={"fields": {**self._named(key), "error": str(exc)}},
                    )
                    continue
                planned = planned.assign(key, replace(old, cpus=cpus), policy)
            await self._commit(planned.under(policy))
            self.policy = policy
            tell_untracked_displaced(untracked_lost, policy)
            for tracked in self.containers.values():
                if tracked.key in refused:
                    tracked.adoption_refused = True
                    self.wait_for_room()
            if policy.topology.memory_nodes != before.memory_nodes:
                self._follow_memory_nodes(before)
            if self.projector is not None:
                self.projector.topology = policy.topology
            await self._apply()
        return lost

    def untracked_holders(self) -> set[ContainerKey]:
        """The keys whose CPUs a container cpushim does not track may run on: one whose
        state start-up or a sweep could not read (held under its id, or under its pod and
        name when the checkpoint had none), or one whose create's answer was lost (held
        without an id). Nothing moves such a container off them: it is not tracked until
        a sweep reads it and takes it in, onto what its assignment holds then."""
        return {
            key
            for key, assignment in self.state.assignments.items()
            if assignment.container_id not in self.containers
        }

    def _follow_memory_nodes(self, before: Topology) -> None:
        """The machine's memory nodes changed (memory hotplug) from those of ``before``: the
        live containers whose memory nodes derive from them are marked to be written with
        their new ones by the re-plan's moves, through the runtime (which writes
        ``cpuset.mems``). Those are an exclusive container's whose kubelet named none, when
        its CPUs' nodes with memory changed, and a shared container's with every node; and
        a container's whose nodes kubelet's memory manager chose, when some of those lost
        their memory or got it back (:meth:`Topology.memory_nodes_within`). A container that
        lost its exclusive CPUs moves anyway, with its memory nodes as they are now."""
        now = self.policy.topology
        for tracked in self.containers.values():
            if tracked.phase is Phase.EXITED:
                continue
            assignment = self._assignment_of(tracked)
            if assignment is not None:
                follows = self._mems_of(assignment, before) != self._mems_of(assignment)
            else:
                chosen = tracked.shared_mems
                follows = not tracked.exclusive and (
                    _sharing_mems(before, chosen) != _sharing_mems(now, chosen)
                )
            if follows:
                tracked.settings_stale = True

    def _request_again(self, assignment: Assignment) -> ExclusiveRequest:
        """What a container that must move asks for: as many CPUs, isolated as its pod says,
        from the memory nodes kubelet chose for it."""
        pod = self.pods.get(assignment.sandbox_id)
        try:
            isolated = isolated_mode(pod) if pod is not None else "avoid"
        except AnnotationError:
            isolated = "avoid"
        return exclusive_request(len(assignment.cpus), isolated, assignment.mems)

    # --- decisions shared by the calls (the lock is held) --------------------------------------

    async def _commit(self, state: CPUState) -> None:
        """Persist ``state``, then make it the engine's: a failed write changes nothing (the
        caller has not acted on the decision yet and fails the call). One that failed only
        at the directory's fsync, or whose caller was cancelled meanwhile, may have put
        ``state`` in the file all the same: the engine's own state is written over it soon,
        so that a restart does not find CPUs held for a container the runtime was never
        asked for."""
        if state == self.state:
            return
        try:
            await self.checkpoint.save(state)
        except (DirectorySyncError, asyncio.CancelledError) as exc:
            if self.checkpoint.saved == state:
                self._record_soon(self.state)
            if isinstance(exc, DirectorySyncError):
                self.save_later()
            raise
        self.state = state
        self.save_succeeded()

    async def _record(self, state: CPUState) -> None:
        """Make ``state`` the engine's, then persist it. For what the runtime has already done
        (a container created or stopped): memory must follow the runtime even when the disk
        does not. A checkpoint left behind is squared with the runtime at the next start."""
        if state == self.state:
            return
        self.state = state
        await self._save_quietly(state)

    async def _save_quietly(self, state: CPUState) -> None:
        """Persist ``state``; a failure is logged and counted, not raised, and the engine's
        state is written again later (``save_later``)."""
        try:
            await self.checkpoint.save(state)
        except OSError as exc:
            self.counters["checkpoint_errors"] += 1
            log.error(
                "could not write the checkpoint; the state in memory is kept and written"
                " again later",
                extra={"fields": {"path": str(self.checkpoint.path), "error": str(exc)}},
            )
            self.save_later()
        else:
            self.save_succeeded()

    def save_later(self) -> None:
        """After a checkpoint write that failed and was only logged: write the engine's
        state again after ``retry_delay``, doubling the wait up to a minute, until a write
        (this one, or any other: ``save_succeeded``) has put it on the disk, or cpushim
        drains (which tries once more)."""
        self._save_failed = True
        self._save_retry.soon()

    def save_succeeded(self) -> None:
        """After a checkpoint write that succeeded, under the lock: the file now holds the
        engine's state, fsynced, so the retry of an earlier failed write has nothing left to
        do, and ends now rather than after its wait (up to a minute). Cutting it is safe:
        its attempt runs under the lock, so it is waiting, or waiting for the lock, with
        nothing done yet."""
        if (
            self._save_retry.running
            and self.checkpoint.saved == self.state
            and self.checkpoint.durable
        ):
            self._save_retry.end()

    async def _save_again(self) -> bool:
        async with self.lock:
            checkpoint = self.checkpoint
            if (
                checkpoint.saved == self.state
                and checkpoint.durable
                and checkpoint.on_disk() == checkpoint.last_written
            ):
                return True
            try:
                await self.checkpoint.save(self.state)
            except OSError as exc:
                self.counters["checkpoint_errors"] += 1
                # A drain's last try is the last: the next start reads the runtime's word
                # over the older file (its resync).
                later = "" if self._draining.is_set() else "; trying again later"
                log.error(
                    f"still cannot write the checkpoint{later}",
                    extra={"fields": {"path": str(self.checkpoint.path), "error": str(exc)}},
                )
                return False
            log.info(
                "checkpoint written again", extra={"fields": {"path": str(self.checkpoint.path)}}
            )
            return True

    def _record_soon(self, state: CPUState) -> None:
        """Make ``state`` the engine's now and persist it in the background, under the lock,
        so it is written in order with every other checkpoint write. The write waits up to
        the record delay: any checkpoint write meanwhile (the next decision, the release of a
        short-lived container) carries the change, and a burst costs one write."""
        self.state = state
        if self._persisting is None:
            task = self._persisting = self._spawn(self._persist_latest())
            self._persist_tasks.add(task)
            task.add_done_callback(self._persist_tasks.discard)
            task.add_done_callback(self._persist_ended)

    def _persist_ended(self, task: asyncio.Task[None]) -> None:
        # Cancelled before its turn (even before it first ran, when its own code never
        # runs): a later change must schedule a write of its own, not count on this one.
        if self._persisting is task:
            self._persisting = None

    async def checkpoint_written(self) -> None:
        """Write the changes waiting for the record delay now, and wait until they are."""
        self._persist_now.set()
        try:
            while self._persist_tasks:
                await asyncio.wait(set(self._persist_tasks))
        finally:
            if not self._draining.is_set():
                self._persist_now.clear()

    async def _persist_latest(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._persist_now.wait(), self.options.record_delay)
        async with self.lock:
            # From here on a new change schedules a write of its own.
            self._persisting = None
            if self.checkpoint.saved != self.state:
                await self._save_quietly(self.state)

    async def _release(self, keys: Iterable[ContainerKey]) -> None:
        """Give the CPUs of ``keys`` back to the shared pool and grow the shared containers."""
        keys = [k for k in keys if k in self.state.assignments]
        if not keys:
            return
        pods = sorted({self._pod_label_of(k) for k in keys} - {""})
        await self._record(self.state.release(keys, self.policy).keep_released(self._pod_uids()))
        log.info(
            "released",
            extra={
                "fields": {
                    "pods": pods,
                    "containers": [str(k) for k in keys],
                    "shared": str(self.state.shared),
                }
            },
        )
        await self._apply()
        self._tell_room_made()

    def _pod_label_of(self, key: ContainerKey) -> str:
        """The namespace/name of a container's pod, for the logs ("" when unknown)."""
        held = self.state.assignments.get(key)
        if held is not None and held.pod:
            return held.pod
        pod = self.pods.get(self._sandbox_of(key))
        return pod.label if pod is not None else ""

    def _named(self, key: ContainerKey) -> dict[str, str]:
        """The fields a log line names a container by when only its key is at hand (see
        :meth:`Tracked.named`)."""
        return {"pod": self._pod_label_of(key), "container": str(key)}

    def _tell_room_made(self) -> None:
        """After CPUs went back to the pool: a container waiting for room may fit now."""
        if self.room_wanted and self.room_made is not None:
            self.room_made()

    async def _release_exited_in_pod(self, pod_uid: str, keep: ContainerKey) -> list[ContainerKey]:
        """Release the CPUs of this pod's containers that have exited by themselves (init
        containers run to completion without a StopContainer), so they can be reused. A
        container whose state the runtime does not give is logged and keeps its CPUs; those
        are returned."""
        candidates = [
            (key, a.container_id)
            for key, a in self.state.assignments.items()
            if key.pod_uid == pod_uid and key != keep and a.container_id
        ]
        exited: list[ContainerKey] = []
        unknown: list[ContainerKey] = []
        for key, container_id in candidates:
            tracked = self.containers.get(container_id)
            if tracked is not None and tracked.phase is Phase.EXITED:
                exited.append(key)
                continue
            try:
                state = await self._container_state(container_id)
            except RuntimeError as exc:
                log.warning(
                    "cannot tell whether a container exited; its CPUs stay held",
                    extra={"fields": {**self._named(key), "error": str(exc)}},
                )
                unknown.append(key)
                continue
            if state in (None, pb.CONTAINER_EXITED):
                if tracked is not None:
                    self._mark_exited(tracked)
                exited.append(key)
        await self._release(exited)
        return unknown

    async def _container_state(self, container_id: str) -> int | None:
        """The runtime's state of a container; None when it does not know it."""
        request = pb.ContainerStatusRequest(container_id=container_id).SerializeToString()
        reply = await self.runtime.unary(
            UnaryCall(rq.CONTAINER_STATUS, (), request, self.options.update_timeout)
        )
        if reply.status is Status.NOT_FOUND:
            return None
        response = _response(reply, pb.ContainerStatusResponse)
        if response is None:
            raise RuntimeError(
                f"ContainerStatus {container_id}: {reply.status.name}: {reply.status_message}"
            )
        tracked = self.containers.get(container_id)
        if tracked is not None:
            tracked.status_answered()
        return response.status.state

    def _desired(self, tracked: Tracked) -> tuple[CPUSet, str, int | None]:
        """The cpuset, the mems (empty: left as they are) and the CFS quota (None: left as
        it is) a container should have now."""
        assignment = self._assignment_of(tracked)
        topology = self.policy.topology
        if assignment is not None:
            quota = None if tracked.keep_quota else rq.NO_QUOTA
            self._note_narrowing(tracked, assignment.mems)
            return assignment.cpus, self._mems_of(assignment), quota
        if tracked.exclusive:
            # It lost its exclusive CPUs (a new policy or reserved set): it shares now, so it
            # gets kubelet's settings back: its quota, and the memory nodes kubelet's memory
            # manager chose (when cpushim knows them), else every node with memory, as a
            # shared one has (a node with memory and no CPU among them).
            self._note_narrowing(tracked, tracked.kubelet_mems)
            mems = str(_sharing_mems(topology, tracked.kubelet_mems))
            return self.state.shared, mems, tracked.kubelet_quota or None
        if tracked.settings_stale:
            # Every node with memory, or those of kubelet's nodes that have memory, which
            # changed since its cgroup was given them (_follow_memory_nodes): the move writes
            # them as they are now.
            self._note_narrowing(tracked, tracked.shared_mems)
            return self.state.shared, str(_sharing_mems(topology, tracked.shared_mems)), None
        return self.state.shared, "", None

    def _mems_of(self, assignment: Assignment, topology: Topology | None = None) -> str:
        """An exclusive container's memory nodes, on ``topology`` (the machine's now when
        None): kubelet's choice as far as its nodes have memory, else its CPUs' nodes that
        have memory."""
        topology = topology or self.policy.topology
        if assignment.mems is not None:
            return str(topology.memory_nodes_within(assignment.mems))
        return str(topology.memory_nodes_of(assignment.cpus))

    def _nodes_kept(self, shared_mems: CPUSet | None) -> CPUSet | None:
        """The memory nodes the cgroup of a shared container with ``shared_mems`` keeps
        (None: every node): those of kubelet's that have memory."""
        if shared_mems is None:
            return None
        return self.policy.topology.memory_nodes_within(shared_mems)

    def narrowed_memory_containers(self) -> int:
        """How many live containers have memory nodes kubelet's memory manager chose of which
        some have no memory now, and so are given others (:meth:`_note_narrowing` warns of
        each once): for a gauge, so that it can be alerted on for as long as it lasts. From
        kubelet's choice as recorded and the nodes with memory now, not the warning's mark,
        which is brought up to date only where a container's memory nodes are worked out."""
        topology = self.policy.topology
        return sum(
            1
            for tracked in self.containers.values()
            if tracked.phase is not Phase.EXITED
            and _narrowed(topology, self._kubelets_mems(tracked))
        )

    def stuck_runtime_containers(self) -> int:
        """How many live containers' runtime calls went unanswered past their deadline, with
        none answered since (shim/engine/moves.py)."""
        return sum(
            1
            for tracked in self.containers.values()
            if tracked.runtime_hung and tracked.phase is not Phase.EXITED
        )

    def _kubelets_mems(self, tracked: Tracked) -> CPUSet | None:
        """The memory nodes kubelet's memory manager chose for ``tracked`` (None: none):
        its assignment's while it holds exclusive CPUs, else those it was created or
        updated with (``kubelet_mems`` for one that lost its exclusive CPUs and has not
        moved since)."""
        assignment = self._assignment_of(tracked)
        if assignment is not None:
            return assignment.mems
        return tracked.kubelet_mems if tracked.exclusive else tracked.shared_mems

    def _note_narrowing(self, tracked: Tracked, chosen: CPUSet | None) -> None:
        """Warn, once until they all have memory again, that the memory nodes kubelet's
        memory manager chose for ``tracked`` (``chosen``) name one without memory now."""
        narrowed = _narrowed(self.policy.topology, chosen)
        if narrowed and not tracked.mems_narrowed:
            assert chosen is not None
            self._tell_narrowed(tracked.key, tracked.id, chosen)
        tracked.mems_narrowed = narrowed

    def _tell_narrowed(self, key: ContainerKey, container_id: str, chosen: CPUSet) -> None:
        """The warning of :meth:`_note_narrowing` (``container_id``: "" before the create)."""
        topology = self.policy.topology
        log.warning(
            "memory nodes chosen for a container (by kubelet's memory manager, or an update"
            " that names them) have no memory now (memory hotplug), which the kernel refuses:"
            " its memory goes to those of them that have memory, else to every node with"
            " memory, until they have it again",
            extra={
                "fields": {
                    **self._named(key),
                    "container_id": container_id,
                    "kubelet_mems": str(chosen),
                    "mems": str(topology.memory_nodes_within(chosen)),
                    "memory_nodes": str(topology.memory_nodes),
                }
            },
        )

    async def _keep_kubelets_mems(self, given: Iterable[Tracked]) -> None:
        """Before memory nodes of cpushim's (every node with memory, or those of kubelet's
        that have memory) go into the runtime's record of containers without exclusive CPUs,
        the checkpoint keeps kubelet's choice for them: after a restart that record would
        pass cpushim's nodes off as kubelet's (a list of every node from before a memory
        change, say), and keep them for good. Under the lock."""
        state = self.state
        for tracked in given:
            if self._assignment_of(tracked) is None:
                chosen = KubeletMems(tracked.id, self._kubelets_mems(tracked))
                state = state.with_kubelet_mems(tracked.key, chosen)
        await self._record(state)

    def _lost(self, tracked: Tracked) -> bool:
        """Whether it carries an exclusive container's settings without its CPUs."""
        return tracked.exclusive and self._assignment_of(tracked) is None

    def _restored(self, tracked: Tracked) -> None:
        """After a move through the runtime: a container that lost its exclusive CPUs has its
        shared settings now, and moves like any shared container from here on; one that
        holds them has their memory nodes and quota now."""
        if self._lost(tracked):
            tracked.exclusive = False
            # The move gave it these (or every node) with kubelet's quota.
            tracked.shared_mems = tracked.kubelet_mems
        tracked.settings_stale = False

    def _assignment_of(self, tracked: Tracked) -> Assignment | None:
        """The exclusive CPUs this container holds, if it holds any."""
        if not tracked.exclusive:
            return None
        assignment = self.state.assignments.get(tracked.key)
        if assignment is None or assignment.container_id != tracked.id:
            return None
        return assignment

    async def reapply(self) -> None:
        """Move every container that is not where it should be (a safety net for the
        watcher's full look: a refused move leaves the cgroup equal to what was applied, so
        comparing the two finds nothing)."""
        async with self.lock:
            await self._apply()

    def _out_of_place(
        self, leave: Tracked | None = None
    ) -> list[tuple[Tracked, CPUSet, str, int | None]]:
        """Every live container whose cpuset is not what it should be, with what it should
        be (CPUs, mems, CFS quota); ``leave`` is not among them."""
        moves: list[tuple[Tracked, CPUSet, str, int | None]] = []
        for tracked in self.containers.values():
            if tracked.phase is Phase.EXITED or tracked is leave:
                continue
            cpus, mems, quota = self._desired(tracked)
            if cpus != tracked.applied or self._lost(tracked) or tracked.settings_stale:
                moves.append((tracked, cpus, mems, quota))
        return moves

    async def _apply(
        self, moved: Callable[[], None] | None = None, *, leave: Tracked | None = None
    ) -> None:
        """Write the cpuset of every live container whose cpuset is not what it should be;
        ``moved`` is called as each move ends (start-up's progress); ``leave`` is moved by
        the caller."""
        moves = self._out_of_place(leave)
        if not moves:
            return
        # Cgroup writes complete without suspending: done first, so other work on the loop
        # cannot slip in ahead of the caller's forward. The rest (runtime updates, writes
        # that failed or must wait for the container's lock) run concurrently after.
        waiting = []
        for tracked, cpus, mems, quota in moves:
            written = self.mover.write_now(tracked, cpus, mems, quota)
            if written is DirectWrite.WRITTEN:
                self.project(tracked)
                if moved is not None:
                    moved()
            else:
                waiting.append((tracked, cpus, mems, quota, written is DirectWrite.REFUSED))
        if not waiting:
            return
        await self._keep_kubelets_mems(t for t, _, mems, _, _ in waiting if mems)
        limit = asyncio.Semaphore(self.options.update_concurrency)
        gone: list[str] = []

        async def move(
            tracked: Tracked, cpus: CPUSet, mems: str, quota: int | None, refused: bool
        ) -> None:
            async with limit:
                if await self._write_cpuset(tracked, cpus, mems, quota, refused=refused):
                    gone.append(tracked.id)
            if moved is not None:
                moved()

        await asyncio.gather(*(move(*m) for m in waiting))
        # Removed behind cpushim's back (directly on the runtime): no call from kubelet will
        # name it again, so exclusive CPUs it held would stay held until its pod went.
        await self._release(k for i in gone if (k := self.state.holding(i)) is not None)

    async def _write_cpuset(
        self, tracked: Tracked, cpus: CPUSet, mems: str, quota: int | None, *, refused: bool
    ) -> bool:
        """Move one container (``refused``: :meth:`Mover.move`'s); True when the runtime no
        longer knows it (it is forgotten)."""
        result = await self.mover.move(tracked, cpus, mems, quota, refused=refused)
        if result.ok:
            self._restored(tracked)
        if result.ok or result.moved:
            self.project(tracked)
        if result.gone:
            self.untrack(tracked.id)
            return True
        if not result.ok:
            # tracked.applied is unchanged. Without a retry the container would stay where
            # it was (a shared one on CPUs just given out exclusively) until the next
            # decision: the watches compare the cgroup with what was applied.
            self._move_retry.soon()
        return False

    async def _apply_again(self) -> bool:
        """Apply every container's cpuset; True when all are in place."""
        async with self.lock:
            await self._apply()
            return not self._out_of_place()


def tell_untracked_displaced(lost: Mapping[ContainerKey, CPUSet], policy: CPUPolicy) -> None:
    """Warn of the sets that a re-plan (at start-up, or live) did not keep for containers
    cpushim does not track (``lost``, by key: :meth:`Engine.untracked_holders`). Such a set
    holds CPUs the policy hands to no container now (reserved, offline or gone, every one
    under ``none``), or alone would leave the shared pool without a CPU: neither may stay
    held (the shared pool is never empty, reserved CPUs are never exclusive), so the
    assignment goes and the pool gets what it may of its CPUs. The container goes on
    running there beside the shared containers (and beside any container given those CPUs
    meanwhile) until a sweep reads it and moves it, as under --recover-from-runtime."""
    if not lost:
        return
    log.warning(
        "a container whose state cannot be read loses the CPUs it holds to the re-plan; it"
        " runs on them, shared, until a sweep reads it and moves it",
        extra={
            "fields": {
                "containers": {str(key): str(cpus) for key, cpus in lost.items()},
                "allocatable": str(policy.exclusive_candidates),
            }
        },
    )


def _nodes_asked(resources: pb.LinuxContainerResources) -> CPUSet | None:
    """The NUMA nodes kubelet's memory manager named in a create (None: none, or none that
    parse, which is the runtime's to refuse for a container that shares)."""
    try:
        return kubelet_memory_nodes(resources)
    except MemoryNodesError:
        return None


def _mems(nodes: CPUSet | None) -> str:
    """Memory nodes as a projection names them: "" for every node."""
    return "" if nodes is None else str(nodes)


def _narrowed(topology: Topology, chosen: CPUSet | None) -> bool:
    """Whether memory nodes kubelet's memory manager chose name one without memory now (its
    memory went offline since), which the kernel refuses in a cpuset.mems."""
    return chosen is not None and not chosen.issubset(topology.memory_nodes)


def _sharing_mems(topology: Topology, chosen: CPUSet | None) -> CPUSet:
    """The memory nodes of a container without exclusive CPUs whose kubelet's memory manager
    chose ``chosen`` (None: none): those of them that have memory, else every node with
    memory."""
    return topology.memory_nodes if chosen is None else topology.memory_nodes_within(chosen)


def _at_or_under(container_path: str, target: str) -> bool:
    """Whether a container's mount lands on ``target`` or inside it, however its path is
    written (the runtime cleans it: ``/run/cpushim/`` is ``/run/cpushim``). One inside would
    need a mount point made in the read-only projection, and the container would not start."""
    path, target = _clean(container_path), _clean(target)
    return path == target or path.startswith(target.rstrip("/") + "/")


def _clean(path: str) -> str:
    """An absolute path as Go's filepath.Clean gives it, which the runtime uses: unlike
    posixpath.normpath, it keeps no two leading slashes."""
    return posixpath.normpath("/" + path.lstrip("/"))


def _unique_prefix_match(named: str, ids: set[str]) -> str:
    """The one id of ``ids`` that starts with ``named``, else ``named`` itself."""
    matches = [i for i in ids if i and i.startswith(named)]
    return matches[0] if len(matches) == 1 else named


def _response(reply: Reply, message_type: type[_M]) -> _M | None:
    """The decoded reply message of a successful call, else None."""
    if reply.status is not Status.OK or not reply.messages:
        return None
    try:
        return message_type.FromString(reply.messages[0])
    except DecodeError:
        return None


@dataclass(frozen=True)
class _Update:
    """An update of a tracked container as it went to the runtime."""

    cpus: CPUSet
    # The memory nodes and quota sent with the CPUs ("" / None: kubelet's own, untouched).
    mems: str
    quota: int | None
    # The memory nodes the call named for a container that shares, when there were some.
    asked: CPUSet | None
    # kubelet's choice the checkpoint held before.
    chosen_before: KubeletMems | None
    # Written below the container's child cpusets first (Mover.write_tree_first).
    written: bool
    # When the container's cgroup was last written directly, as the call went out.
    moved_at: float


@dataclass(frozen=True)
class _CPUResize:
    """A count of exclusive CPUs kubelet's update asks a running container for (0: none)."""

    asked: int
    plan: ContainerPlan
    # What it holds now; None: nothing.
    assignment: Assignment | None
