"""The engine driven by a model of what kubelet and the node do (Hypothesis's stateful
testing), against the stateful fake containerd with a cgroup tree and the watcher, on the
fake 2-socket machine of ``engine_env`` (CPU 0 reserved).

The rules are kubelet's calls in kubelet's order for each pod (its sandbox, then its
containers each created and started; a container stopped before it is removed, a sandbox
stopped before it is removed; a container's next attempt once the last one exited; an
in-place CPU resize), the calls of two or three pods at once (kubelet's pod workers run side
by side), a container's process exiting by itself, its cpuset written from outside, and
cpushim restarted from its checkpoint, after a clean stop or a crash (also right after a
call's reply, its work in the background cut).

The model keeps which pods and containers there are and what each asks for, not which CPUs
each got (the engine's choice). After every step, once the engine has settled, the engine's
state is checked against the model, and against the checkpoint, the cgroups and the
runtime's records. Three machines: cgroup v1 with the cgroupfs driver, v2 with the systemd
driver, and v1 under full-pcpus-only.

Runs are derandomized (the same sequences every run, no example database): a quick pass.
``CPUSHIM_HYPOTHESIS_PROFILE=core-thorough`` runs 300 random sequences of 40 steps on each
machine (about 8 minutes), which finds what the quick pass does not.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Reply, Status
from shim.engine import EngineOptions
from shim.engine.tracked import Phase
from shim.engine.watching import Watcher
from shim.policy.options import StaticPolicyOptions
from shim.policy.static import StaticPolicy
from shim.state import ContainerKey
from tests.fake_runtime import FakeRuntime
from tests.harness.containerd import CgroupDriver
from tests.harness.kubelet import QoSClass, milli_cpu_to_quota
from tests.unit.engine_env import ALL, TOPOLOGY, Env, Pod, assert_consistent, make_env, until
from tests.unit.test_engine import kubelet_resize

# Shrinking a failure runs many sequences, which can take minutes: pytest's timeout would
# cut it (inside the event loop, so as a failure of its own) before the report.
pytestmark = pytest.mark.timeout(1200)

_T = TypeVar("_T")

RESERVED = CPUSet.parse("0")
THREADS_PER_CORE = 2
# A pod's containers, in the order kubelet creates them.
NAMES = ("a", "b", "c")
MAX_LIVE_PODS = 5
# Guaranteed pods, the ones that hold CPUs, half the time.
QOS_CLASSES: tuple[QoSClass, ...] = ("guaranteed", "burstable", "guaranteed", "besteffort")
# What a container asks for (milli-CPUs): in a Guaranteed pod, whole CPUs or a fraction.
GUARANTEED_CPUS = (1000, 2000, 3000, 4000, 500, 1500)
CONTAINER_CPUS: dict[str, tuple[int, ...]] = {
    "guaranteed": GUARANTEED_CPUS,
    "burstable": (0, 500, 1000),
    "besteffort": (0,),
}
# The NUMA nodes kubelet's Static memory manager names for a Guaranteed pod's container (none:
# no memory manager, or its None policy). They steer the CPUs, never refuse them.
MEMORY_NODES = ("", "0", "1", "0-1")
OPT_OUT = {"cpushim.io/exclusive": "false"}
# One call in eight is followed by a crash of cpushim.
CRASHES = st.integers(0, 7).map(lambda n: n == 7)

THOROUGH = os.environ.get("CPUSHIM_HYPOTHESIS_PROFILE") == "core-thorough"


class Short:
    """Shown by its repr in Hypothesis's report of a failing sequence."""

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


@dataclass(repr=False)
class ModelPod(Short):
    pod: Pod
    opted_out: bool
    ready: bool = True
    # Its containers by name: the milli-CPUs each asks for (request = limit when
    # Guaranteed).
    specs: dict[str, int] = field(default_factory=dict)
    # And the memory nodes kubelet names for it ("": none).
    mems: dict[str, str] = field(default_factory=dict)
    # The attempt number of each container's next create (kubelet's restart count).
    next_attempt: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.pod.config.metadata.name

    def __repr__(self) -> str:
        opted_out = ", opted out" if self.opted_out else ""
        return f"{self.label}({self.pod.qos}{opted_out})"


@dataclass(repr=False)
class ModelContainer(Short):
    id: str
    pod: ModelPod
    name: str
    attempt: int
    milli_cpu: int
    mems: str
    running: bool = True

    @property
    def key(self) -> ContainerKey:
        return ContainerKey(self.pod.pod.uid, self.name)

    @property
    def exclusive_cpus(self) -> int:
        """How many exclusive CPUs it holds while it runs."""
        return exclusive_count(self.pod, self.milli_cpu)

    def __repr__(self) -> str:
        return f"{self.pod.label}/{self.name}#{self.attempt}({self.milli_cpu}m)"


def exclusive_count(pod: ModelPod, milli_cpu: int) -> int:
    """kubelet's static policy's rule (whole CPUs of a Guaranteed pod), less cpushim's
    opt-out annotation."""
    if pod.pod.qos != "guaranteed" or pod.opted_out or milli_cpu % 1000:
        return 0
    return milli_cpu // 1000


@dataclass(repr=False)
class Step(Short):
    """One of kubelet's actions on one pod, as the model sees it: whether it succeeds with
    ``free`` exclusive CPUs left (refused with RESOURCE_EXHAUSTED otherwise), and how many
    more are free once it has."""

    what: str
    pod: ModelPod
    # The calls; True when they succeeded, False when refused for want of CPUs.
    calls: Callable[[], Coroutine[Any, Any, bool]]
    fits: Callable[[int], bool]
    frees: int
    # The model's change once it succeeded.
    done: Callable[[], None]
    # The running container it acts on; None for a create.
    container: ModelContainer | None = None

    def __repr__(self) -> str:
        return f"{self.what} of {self.container or self.pod}"


class ErrorsLogged(logging.Handler):
    """Records cpushim logs at ERROR or above: an internal error is a failure here."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def _cancel_the_rest() -> None:
    """Cancel the loop's tasks but this one, and wait for them to end."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


class KubeletAndNode(RuleBasedStateMachine):
    """On cgroup v1 with kubelet's cgroupfs driver (the fake's cgroup tree)."""

    cgroup_version = 1
    cgroup_driver: CgroupDriver = "cgroupfs"
    # kubelet's full-pcpus-only: exclusive CPUs come as whole cores, so a count that is not
    # a multiple of the threads per core is refused; CPU 4, beside reserved 0, is never
    # handed out.
    whole_cores = False

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.workdir = Path(tempfile.mkdtemp(prefix="cpushim-model-"))
        self.errors = ErrorsLogged()
        logging.getLogger("shim").addHandler(self.errors)
        self.pods: list[ModelPod] = []
        self.pods_made = 0
        self.containers: list[ModelContainer] = []
        self.fake = FakeRuntime(
            cgroup_root=self.workdir / "cgroup",
            cgroup_version=self.cgroup_version,
            cgroup_driver=self.cgroup_driver,
        )
        self.run(self.fake.__aenter__())
        options = StaticPolicyOptions(full_pcpus_only=self.whole_cores)
        self.env: Env = self.run(
            make_env(
                self.fake,
                self.workdir / "state",
                StaticPolicy.create(TOPOLOGY, reserved=RESERVED, options=options),
                options=EngineOptions(record_delay=0.01, retry_delay=0.05),
            )
        )
        self.watcher = self.run(self._watch())

    def run(self, work: Coroutine[Any, Any, _T]) -> _T:
        return self.loop.run_until_complete(work)

    async def _watch(self) -> Watcher:
        watcher = Watcher(self.env.engine, resync_period=0)
        watcher.start()
        return watcher

    def teardown(self) -> None:
        try:
            self.run(self._stop())
        finally:
            self.run(_cancel_the_rest())
            self.loop.close()
            logging.getLogger("shim").removeHandler(self.errors)
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def _stop(self) -> None:
        await self.watcher.stop()
        await self.env.engine.drain(5.0)
        await self.env.engine.checkpoint.close()
        self.env.channel.close()
        await self.fake.__aexit__(None, None, None)

    # --- the model -------------------------------------------------------------------------

    def running(self) -> list[ModelContainer]:
        return [c for c in self.containers if c.running]

    def exited(self) -> list[ModelContainer]:
        return [c for c in self.containers if not c.running]

    def free_exclusive(self) -> int:
        """How many CPUs could be handed out exclusively now."""
        held = sum(c.exclusive_cpus for c in self.running())
        allowed = ALL - RESERVED
        if self.whole_cores:
            allowed = TOPOLOGY.whole_cores_in(allowed)
        return len(allowed) - held

    def fits(self, count: int, free: int) -> bool:
        """Whether ``count`` exclusive CPUs can be had with ``free`` free."""
        return count <= free and not (self.whole_cores and count % THREADS_PER_CORE)

    def live_pods(self) -> list[ModelPod]:
        return [p for p in self.pods if p.ready]

    def creatable(self) -> list[tuple[ModelPod, str]]:
        """What kubelet would create now: in a ready pod, a container whose create was
        refused, or the next attempt of one that exited."""
        busy = {(id(c.pod), c.name) for c in self.running()}
        return [(p, n) for p in self.live_pods() for n in p.specs if (id(p), n) not in busy]

    def resizable(self) -> list[ModelContainer]:
        return [c for c in self.running() if c.pod.pod.qos == "guaranteed"]

    # --- kubelet's actions, as steps -------------------------------------------------------

    def create_step(self, pod: ModelPod, name: str, data: st.DataObject | None = None) -> Step:
        """Create and start a container; with ``data``, cpushim may crash between the
        calls and after them."""
        milli_cpu = pod.specs[name]
        mems = pod.mems.get(name, "")
        attempt = pod.next_attempt.get(name, 0)
        count = exclusive_count(pod, milli_cpu)
        made: list[str] = []

        async def calls() -> bool:
            reply = await self.env.kubelet.create(pod.pod, name, milli_cpu, attempt, mems=mems)
            if reply.status is Status.RESOURCE_EXHAUSTED:
                # Refused: no container, and nothing held for it.
                assert not [
                    c
                    for c in self.fake.containers.values()
                    if c.sandbox_id == pod.pod.sandbox_id
                    and (c.config.metadata.name, c.config.metadata.attempt) == (name, attempt)
                ]
                assert ContainerKey(pod.pod.uid, name) not in self.env.engine.state.assignments
                return False
            container_id = self.created(reply)
            if data is not None:
                self.check_cgroups()
                await self.maybe_crash(data, "a create")
            request = pb.StartContainerRequest(container_id=container_id)
            await self.env.kubelet.ok("StartContainer", request.SerializeToString())
            made.append(container_id)
            if data is not None:
                self.check_cgroups()
                await self.maybe_crash(data, "a start")
            return True

        def done() -> None:
            pod.next_attempt[name] = attempt + 1
            container = ModelContainer(made[0], pod, name, attempt, milli_cpu, mems)
            self.containers.append(container)

        kind = "exclusive" if count else "shared"
        return Step(f"create {kind}", pod, calls, lambda free: self.fits(count, free), -count, done)

    @staticmethod
    def created(reply: Reply) -> str:
        assert reply.status is Status.OK, f"{reply.status.name}: {reply.status_message}"
        return pb.CreateContainerResponse.FromString(reply.messages[0]).container_id

    def stop_step(self, container: ModelContainer) -> Step:
        async def calls() -> bool:
            await self.env.kubelet.stop(container.id)
            return True

        return self._ending_step("stop", container, calls)

    def exit_step(self, container: ModelContainer) -> Step:
        """The container's process ends by itself; done once the engine has seen it."""

        async def calls() -> bool:
            self.fake.exit_container(container.id)
            await until(lambda: self.exit_seen(container), f"the exit of {container} seen")
            return True

        return self._ending_step("exit", container, calls)

    @staticmethod
    def _ending_step(
        name: str, container: ModelContainer, calls: Callable[[], Coroutine[Any, Any, bool]]
    ) -> Step:
        """A step after which the container no longer runs, its exclusive CPUs given back."""

        def done() -> None:
            container.running = False

        return Step(
            name,
            container.pod,
            calls,
            lambda free: True,
            container.exclusive_cpus,
            done,
            container,
        )

    def exit_seen(self, container: ModelContainer) -> bool:
        """The engine has seen the container exit (a new one may not track it any more),
        and its CPUs are back, the shared containers grown onto them: that is done under the
        engine's lock, which the exit took to mark it."""
        engine = self.env.engine
        tracked = engine.containers.get(container.id)
        gone = tracked is None or tracked.phase is Phase.EXITED
        return gone and engine.state.holding(container.id) is None and not engine.lock.locked()

    def resize_step(self, container: ModelContainer, milli_cpu: int) -> Step:
        """kubelet's in-place CPU resize of a running Guaranteed container."""
        held = container.exclusive_cpus
        asked = exclusive_count(container.pod, milli_cpu)

        async def calls() -> bool:
            request = kubelet_resize(container.id, milli_cpu)
            reply = await self.env.kubelet.call("UpdateContainerResources", request)
            if reply.status is Status.RESOURCE_EXHAUSTED:
                return False
            assert reply.status is Status.OK, f"{reply.status.name}: {reply.status_message}"
            return True

        def done() -> None:
            container.milli_cpu = milli_cpu

        return Step(
            f"resize {held} to {asked}",
            container.pod,
            calls,
            lambda free: self.fits(asked, free + held),
            held - asked,
            done,
            container,
        )

    def take(self, step: Step) -> None:
        """Take one step alone: it succeeds exactly when the model says it fits."""
        fits = step.fits(self.free_exclusive())
        succeeded = self.run(step.calls())
        event(f"{step.what}{'' if succeeded else ', refused'}")
        assert succeeded == fits, f"{step.what}: {succeeded}, with {self.free_exclusive()} free"
        if succeeded:
            step.done()
        self.check_cgroups()

    async def maybe_crash(self, data: st.DataObject, after: str) -> None:
        """Now and then cpushim crashes right after a call's reply, its work in the
        background (the checkpoint's record of a new container's id, the runtime's records
        of moves written into cgroups, the look for a started container's cgroup) cut."""
        if data.draw(CRASHES, label=f"crash after {after}"):
            event(f"crash after {after}")
            await self.restart(crash=True)

    # --- kubelet's calls -------------------------------------------------------------------

    @initialize(data=st.data())
    def first_pod(self, data: st.DataObject) -> None:
        self.run_pod(data)

    @precondition(lambda self: len(self.live_pods()) < MAX_LIVE_PODS)
    @rule(data=st.data())
    def run_pod(self, data: st.DataObject) -> None:
        """kubelet's sync of a new pod: its sandbox, then its containers one by one."""
        qos: QoSClass = data.draw(st.sampled_from(QOS_CLASSES), label="qos")
        opted_out = qos == "guaranteed" and data.draw(st.booleans(), label="opted out")
        mems = st.sampled_from(MEMORY_NODES if qos == "guaranteed" else ("",))
        container = st.tuples(st.sampled_from(CONTAINER_CPUS[qos]), mems)
        specs = data.draw(st.lists(container, min_size=1, max_size=len(NAMES)), label="containers")
        name = f"p{self.pods_made}"
        self.pods_made += 1
        annotations = OPT_OUT if opted_out else None
        pod = ModelPod(self.run(self.env.kubelet.run_pod(name, qos, annotations)), opted_out)
        pod.specs = {name: cpus for name, (cpus, _) in zip(NAMES, specs, strict=False)}
        pod.mems = {name: mems for name, (_, mems) in zip(NAMES, specs, strict=False)}
        self.pods.append(pod)
        for container_name in pod.specs:
            self.take(self.create_step(pod, container_name, data))

    @precondition(lambda self: self.creatable())
    @rule(data=st.data())
    def create_and_start(self, data: st.DataObject) -> None:
        """kubelet's retry of a container whose create was refused, or its next attempt
        after one exited, sometimes asking for another count (an in-place resize whose
        policy is RestartContainer)."""
        pod, name = data.draw(st.sampled_from(self.creatable()), label="pod and name")
        if data.draw(st.booleans(), label="asks for another count"):
            pod.specs[name] = data.draw(
                st.sampled_from(CONTAINER_CPUS[pod.pod.qos]), label="milli_cpu"
            )
        self.take(self.create_step(pod, name, data))

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def stop_container(self, data: st.DataObject) -> None:
        container = data.draw(st.sampled_from(self.running()), label="container")
        self.take(self.stop_step(container))
        self.run(self.maybe_crash(data, "a stop"))

    @precondition(lambda self: self.exited())
    @rule(data=st.data())
    def remove_container(self, data: st.DataObject) -> None:
        container = data.draw(st.sampled_from(self.exited()), label="container")
        self.run(self.env.kubelet.remove(container.id))
        self.containers.remove(container)
        self.check_cgroups()

    @precondition(lambda self: self.resizable())
    @rule(data=st.data())
    def resize_in_place(self, data: st.DataObject) -> None:
        container = data.draw(st.sampled_from(self.resizable()), label="container")
        milli_cpu = data.draw(
            st.sampled_from([m for m in GUARANTEED_CPUS if m != container.milli_cpu]),
            label="milli_cpu",
        )
        self.take(self.resize_step(container, milli_cpu))
        self.run(self.maybe_crash(data, "a resize"))

    @precondition(lambda self: self.live_pods())
    @rule(data=st.data(), containers_first=st.booleans())
    def stop_sandbox(self, data: st.DataObject, containers_first: bool) -> None:
        """kubelet kills a pod's containers, then its sandbox; the sandbox's stop goes out
        even when a container's did not (its own stop then kills what is left)."""
        pod = data.draw(st.sampled_from(self.live_pods()), label="pod")
        self.stop_pod(pod, containers_first)

    def stop_pod(self, pod: ModelPod, containers_first: bool) -> None:
        for container in self.running():
            if container.pod is pod:
                if containers_first:
                    self.take(self.stop_step(container))
                container.running = False
        request = pb.StopPodSandboxRequest(pod_sandbox_id=pod.pod.sandbox_id)
        self.run(self.env.kubelet.ok("StopPodSandbox", request.SerializeToString()))
        pod.ready = False
        self.check_cgroups()

    @precondition(lambda self: any(not p.ready for p in self.pods))
    @rule(data=st.data())
    def remove_sandbox(self, data: st.DataObject) -> None:
        pod = data.draw(st.sampled_from([p for p in self.pods if not p.ready]), label="pod")
        request = pb.RemovePodSandboxRequest(pod_sandbox_id=pod.pod.sandbox_id)
        self.run(self.env.kubelet.ok("RemovePodSandbox", request.SerializeToString()))
        self.pods.remove(pod)
        self.containers = [c for c in self.containers if c.pod is not pod]
        self.check_cgroups()

    def steps_at_hand(self, data: st.DataObject) -> list[Step]:
        """A step kubelet could take now for each pod with something to do, and a running
        container's exit by itself in some of them."""
        steps: dict[object, list[Step]] = {}
        for pod, name in self.creatable():
            steps.setdefault(id(pod), []).append(self.create_step(pod, name))
        for container in self.running():
            steps.setdefault(id(container.pod), []).append(self.stop_step(container))
            steps.setdefault(("exit", id(container.pod)), []).append(self.exit_step(container))
        for container in self.resizable():
            milli_cpu = data.draw(st.sampled_from(GUARANTEED_CPUS), label="milli_cpu")
            if milli_cpu != container.milli_cpu:
                steps.setdefault(id(container.pod), []).append(
                    self.resize_step(container, milli_cpu)
                )
        chosen: list[Step] = []
        for choices in steps.values():
            step = data.draw(st.sampled_from(choices), label="step")
            if step.container is None or all(c.container is not step.container for c in chosen):
                chosen.append(step)
        return chosen

    @rule(data=st.data())
    def pods_at_once(self, data: st.DataObject) -> None:
        """kubelet's workers of two or three pods call at the same time, and a container
        may exit meanwhile: the steps succeed as in one order or another."""
        steps = self.steps_at_hand(data)
        if len(steps) < 2:
            return
        steps = data.draw(st.permutations(steps).map(lambda s: s[:3]), label="steps at once")

        async def together() -> list[bool]:
            return list(await asyncio.gather(*(step.calls() for step in steps)))

        free = self.free_exclusive()
        orders = []
        for order in itertools.permutations(steps):
            left = free
            outcome = {}
            for step in order:
                outcome[id(step)] = fits = step.fits(left)
                left += step.frees if fits else 0
            orders.append(outcome)
        results = self.run(together())
        seen = {id(step): result for step, result in zip(steps, results, strict=True)}
        what = ", ".join(step.what for step in steps)
        event(f"at once: {what}")
        assert seen in orders, f"{what}: {results} with {free} free"
        for step, succeeded in zip(steps, results, strict=True):
            if succeeded:
                step.done()
        self.check_cgroups()

    # --- the node --------------------------------------------------------------------------

    @precondition(lambda self: self.running())
    @rule(
        data=st.data(),
        exit_code=st.sampled_from([0, 1, 137]),
        then=st.sampled_from(["nothing", "next attempt", "stop", "stop sandbox", "crash"]),
    )
    def exits_by_itself(self, data: st.DataObject, exit_code: int, then: str) -> None:
        """The process ends without a call from kubelet (a crash, a run to completion): the
        watcher sees its cgroup go. Before it does, kubelet (which sees it from its own
        relist) may start the next attempt, or stop the container or its pod, or cpushim
        may crash."""
        container = data.draw(st.sampled_from(self.running()), label="container")
        self.fake.exit_container(container.id, exit_code)
        container.running = False
        pod = container.pod
        if then == "next attempt" and pod.ready:
            self.take(self.create_step(pod, container.name))
        elif then == "stop":
            self.take(self.stop_step(container))
        elif then == "stop sandbox" and pod.ready:
            self.stop_pod(pod, containers_first=False)
        elif then == "crash":
            self.run(self.restart(crash=True))
        self.run(until(lambda: self.exit_seen(container), f"the exit of {container} seen"))

    @precondition(lambda self: self.running())
    @rule(data=st.data(), cpus=st.sets(st.sampled_from(sorted(ALL)), min_size=1))
    def cpuset_changed_behind(self, data: st.DataObject, cpus: set[int]) -> None:
        """Someone else writes a running container's cpuset (an operator, systemd): the
        watcher writes the engine's back."""
        container = data.draw(st.sampled_from(self.running()), label="container")
        directory = self.fake.cgroup_dir(container.id)
        assert directory is not None
        (directory / "cpuset.cpus").write_text(f"{CPUSet(cpus)}\n")
        state = self.env.engine.state
        assignment = state.assignments.get(container.key)
        wanted = str(assignment.cpus if assignment is not None else state.shared)
        self.run(
            until(
                lambda: self.env.kernel_cpus(container.id) == wanted,
                f"{container}'s cpuset written back",
            )
        )

    @rule(crash=st.booleans())
    def restart_cpushim(self, crash: bool) -> None:
        self.run(self.restart(crash))

    async def restart(self, crash: bool) -> None:
        """A new engine from the checkpoint, after a clean stop (its last writes done) or a
        crash (its work in the background cut where it was): the running containers' CPUs
        are what they were. (A container that exited unseen gives its CPUs back.)"""
        running = {c.id for c in self.running()}

        def assignments() -> dict[ContainerKey, tuple[CPUSet, str]]:
            state = self.env.engine.state
            return {
                key: (a.cpus, a.container_id)
                for key, a in state.assignments.items()
                if a.container_id in running
            }

        before = assignments()
        await self.new_engine(crash)
        assert assignments() == before
        self.check_cgroups()

    async def new_engine(self, crash: bool) -> None:
        engine = self.env.engine
        await self.watcher.stop()
        if crash:
            # asyncio.wait, not gather: from Python 3.12 a gather of tasks that are all done
            # returns without yielding to the loop, so their callbacks that empty
            # ``_tasks`` would never run and this loop would never end.
            while engine._tasks:
                for task in engine._tasks:
                    task.cancel()
                await asyncio.wait(set(engine._tasks))
        else:
            await engine.drain(5.0)
        # A checkpoint write in a worker thread ends before the next process starts.
        await engine.checkpoint.close()
        await self.env.restart()
        self.watcher = await self._watch()

    # --- what must hold --------------------------------------------------------------------

    def check_cgroups(self) -> None:
        """docs/architecture.md's invariant 4: when a call returns, every running
        container's cgroup holds its exclusive CPUs, or the shared pool."""
        state = self.env.engine.state
        for container in self.running():
            assignment = state.assignments.get(container.key)
            wanted = assignment.cpus if assignment is not None else state.shared
            assert self.env.kernel_cpus(container.id) == str(wanted), container

    def check_resources(self, container: ModelContainer) -> None:
        """The rest of what the runtime holds for a running container: an exclusive one
        without CFS quota, on the memory nodes kubelet named, else those of its CPUs; one
        that shares with kubelet's quota and memory nodes (none: every node)."""
        resources = self.fake.containers[container.id].resources
        assignment = self.env.engine.state.assignments.get(container.key)
        nodes = CPUSet.parse(resources.cpuset_mems)
        if assignment is not None:
            assert resources.cpu_quota == -1, container
            wanted = CPUSet.parse(container.mems) or TOPOLOGY.memory_nodes_of(assignment.cpus)
            assert nodes == wanted, container
            return
        limit = container.milli_cpu if container.pod.pod.qos == "guaranteed" else 0
        assert resources.cpu_quota == milli_cpu_to_quota(limit), container
        if container.mems:
            assert nodes == CPUSet.parse(container.mems), container
        else:
            assert nodes in (CPUSet(), TOPOLOGY.memory_nodes_of(ALL)), container

    @invariant()
    def consistent(self) -> None:
        self.run(self._settled())
        engine = self.env.engine
        state = engine.state
        assert self.errors.messages == []
        assert engine.counters["internal_errors"] == 0

        # Exclusive sets disjoint, none reserved, the shared pool all the other CPUs.
        held = CPUSet()
        for key, assignment in state.assignments.items():
            assert not assignment.cpus & held, f"{key} shares CPUs"
            assert not assignment.cpus & RESERVED, f"{key} holds a reserved CPU"
            held |= assignment.cpus
        assert state.shared == ALL - held
        if self.whole_cores:
            assert TOPOLOGY.whole_cores_in(held) == held

        # Held exactly by the running containers that ask for them, as many as they ask.
        expected = {c.key: (c.id, c.exclusive_cpus) for c in self.running() if c.exclusive_cpus}
        actual = {key: (a.container_id, len(a.cpus)) for key, a in state.assignments.items()}
        assert actual == expected

        # Each running container tracked as running and where the engine wants it, in its
        # cgroup and in the runtime's record; nothing tracked that the runtime has not.
        for container in self.running():
            tracked = engine.containers.get(container.id)
            assert tracked is not None, f"{container} not tracked"
            assert tracked.phase is Phase.RUNNING, f"{container} is {tracked.phase}"
        self.check_cgroups()
        for container in self.running():
            self.check_resources(container)
        assert set(engine.containers) <= {c.id for c in self.containers}
        assert set(engine.pods) <= {p.pod.sandbox_id for p in self.pods}

        # The checkpoint on disk is the state in memory.
        assert engine.checkpoint.load() == state
        assert_consistent(self.env)

    async def _settled(self) -> None:
        """The watcher's jobs done, the checkpoint written, the runtime told of every move
        written straight into a cgroup."""
        engine = self.env.engine
        await until(lambda: self.watcher.jobs.pending == 0, "the watcher's jobs done")
        await engine.checkpoint_written()

        def recorded() -> bool:
            return all(self.env.cpus(c.id) == self.env.kernel_cpus(c.id) for c in self.running())

        await until(recorded, "the runtime told of every move")
        await until(lambda: not engine.mover._recorders, "the records done")


class KubeletAndNodeOnV2WithSystemd(KubeletAndNode):
    """On cgroup v2 with kubelet's systemd driver: a scope per container, whose cpuset
    systemd keeps a copy of."""

    cgroup_version = 2
    cgroup_driver: CgroupDriver = "systemd"


class KubeletAndNodeWithWholeCores(KubeletAndNode):
    """Under kubelet's full-pcpus-only option."""

    whole_cores = True


# Derandomized: the same sequences at every run, so CI fails or passes alike.
SETTINGS = settings(
    max_examples=300 if THOROUGH else 15,
    stateful_step_count=40 if THOROUGH else 25,
    derandomize=not THOROUGH,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
KubeletAndNode.TestCase.settings = SETTINGS
KubeletAndNodeOnV2WithSystemd.TestCase.settings = SETTINGS
KubeletAndNodeWithWholeCores.TestCase.settings = SETTINGS
TestKubeletAndNode = KubeletAndNode.TestCase
TestKubeletAndNodeOnV2WithSystemd = KubeletAndNodeOnV2WithSystemd.TestCase
TestKubeletAndNodeWithWholeCores = KubeletAndNodeWithWholeCores.TestCase
