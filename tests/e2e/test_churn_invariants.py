"""Random churn through cpushim on a real containerd, checked by what the kernel says after
every step.

A seeded sequence of what kubelet does to pods, from one pod of each kind: run a Guaranteed,
Burstable or BestEffort pod; create and start a container (its next attempt once the last one
exited; now and then started only at a later step); stop it, remove it; resize its CPU in
place; stop a sandbox, remove a stopped one; and a create beside another pod's create, stop or
exit, at once. Besides, what no call tells cpushim: container processes killed from outside
(as the OOM killer does; some restarted at once, as kubelet does on seeing the exit), and
cpushim itself SIGKILLed and started again between two calls (every other time, the first
among them, with a container killed while it is down). Same machine as test_inline_allocation:
two CPUs, CPU 0 reserved, so the Guaranteed 1-CPU containers compete for CPU 1, and one that
finds it taken (or asks for 2 CPUs) is refused with RESOURCE_EXHAUSTED.

After each step every container must have what a model of the node gives it: the exclusive
CPU for the one holding it, every CPU but that one for the rest. The kernel says so of each
running container (every process's Cpus_allowed_list, its cgroup's cpuset.cpus, and CFS quota
and shares as cpushim and kubelet want them), the container reads it in its projection, the
checkpoint names the holder, and containerd lists exactly the pods and containers the model
has, in the states it has them (so a refused create left nothing behind). After a CRI call
the kernel must agree as the call returns (what cpushim promises kubelet); after a kill, within
REACTION_TIMEOUT.

A failure names its seed and steps; ``CPUSHIM_E2E_CHURN_SEED=<seed>`` replays them (up to the
first race, whose winner the later steps depend on), another number runs another sequence,
and ``CPUSHIM_E2E_CHURN_STEPS`` makes it longer (docs/testing.md).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

import grpc
import pytest

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from tests.e2e.conftest import CPUSET_HIERARCHY, Shim, online_cpus
from tests.e2e.pods import NO_RESOURCES, cgroup_cpus_of
from tests.harness.containerd import remove_cgroup, wait_for
from tests.harness.images import TEST_IMAGE
from tests.harness.kubelet import (
    MIB,
    ONE_CPU,
    WORKLOAD,
    ContainerResources,
    KubeletClient,
    QoSClass,
    Sandbox,
    cgroup_file,
    cpuset_cgroup_of_pid,
    milli_cpu_to_quota,
    milli_cpu_to_shares,
    new_pod_uid,
    read_status_field,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("two_cpus")]

SEED_VARIABLE = "CPUSHIM_E2E_CHURN_SEED"
STEPS_VARIABLE = "CPUSHIM_E2E_CHURN_STEPS"
DEFAULT_SEED = 20240611
DEFAULT_STEPS = 100
# cpushim is SIGKILLed and started again once per this many steps, twice at least.
STEPS_PER_RESTART = 50
MAX_PODS = 6
# How long cpushim may take to act on what no call tells it (an exit), and containerd to list it.
REACTION_TIMEOUT = 10.0
STOP_GRACE_SECONDS = 5

HALF_CPU = ContainerResources(500, 500, 32 * MIB, 32 * MIB)
TWO_CPUS = ContainerResources(2000, 2000, 32 * MIB, 32 * MIB)
BURSTABLE = ContainerResources(250, 1000, 16 * MIB, 64 * MIB)


@dataclass(frozen=True, slots=True)
class PodKind:
    """A pod spec: its QoS class and its containers' resources, by container name."""

    name: str
    qos: QoSClass
    containers: Mapping[str, ContainerResources]
    weight: int


def exclusive_cpus(qos: QoSClass, resources: ContainerResources) -> int:
    """kubelet's static policy: whole CPUs of a Guaranteed pod's container, else none."""
    milli = resources.cpu_milli_request
    whole = milli == resources.cpu_milli_limit and milli > 0 and milli % 1000 == 0
    return milli // 1000 if qos == "guaranteed" and whole else 0


def resized(qos: QoSClass, resources: ContainerResources) -> ContainerResources | None:
    """What kubelet's in-place resize of the container's CPU would ask next (a whole CPU and
    half of one in turn for a Guaranteed pod, the limit halved or doubled for a Burstable
    one); None when its CPU cannot be resized (a BestEffort pod's, a Guaranteed pod's of
    more than one CPU)."""
    limit = resources.cpu_milli_limit
    if qos == "guaranteed" and limit in (500, 1000):
        other = 1500 - limit
        return replace(resources, cpu_milli_request=other, cpu_milli_limit=other)
    if qos == "burstable" and limit in (500, 1000):
        return replace(resources, cpu_milli_limit=1500 - limit)
    return None


POD_KINDS = (
    PodKind("pinned", "guaranteed", {"main": ONE_CPU}, 3),
    PodKind("pinned-helper", "guaranteed", {"main": ONE_CPU, "helper": HALF_CPU}, 2),
    PodKind("two-cpus", "guaranteed", {"main": TWO_CPUS}, 1),
    PodKind("burstable", "burstable", {"main": BURSTABLE}, 2),
    PodKind("besteffort", "besteffort", {"main": NO_RESOURCES}, 2),
)


@dataclass(slots=True)
class Container:
    """A container the model has: created through cpushim and not removed since."""

    id: str
    name: str
    attempt: int
    pinned: bool
    cpu_request: int
    cpu_limit: int
    state: pb.ContainerState.ValueType = pb.CONTAINER_CREATED
    pid: int = 0

    def label(self) -> str:
        return f"{self.name}#{self.attempt} {self.id[:12]}"


@dataclass(slots=True)
class Pod:
    """A pod the model has: run through cpushim and not removed since."""

    kind: PodKind
    sandbox: Sandbox
    ready: bool = True
    containers: dict[str, Container] = field(default_factory=dict)
    # The attempt each container name's next create carries (kubelet's restart count).
    next_attempt: dict[str, int] = field(default_factory=dict)
    # Each container's resources as the pod spec has them now (resized in place).
    resources: dict[str, ContainerResources] = field(default_factory=dict)

    def exclusive_cpus(self, name: str) -> int:
        return exclusive_cpus(self.kind.qos, self.resources[name])

    def label(self) -> str:
        return self.sandbox.config.metadata.name

    def live(self, name: str) -> bool:
        """A container of this name is created or running (kubelet creates no other then)."""
        return any(
            c.name == name and c.state != pb.CONTAINER_EXITED for c in self.containers.values()
        )


def projected_cpus(pid: int) -> Path:
    """The projected ``cpus`` file as the container's own processes see it."""
    return Path(f"/proc/{pid}/root/run/cpushim/cpus")


class ChurnFailure(AssertionError):
    """An invariant broken, or a call answered otherwise than the model expects."""


class Churn:
    """The node as the model has it, the steps that change it, and the checks after each."""

    def __init__(
        self,
        seed: int,
        shim: Shim,
        direct: KubeletClient,
        via: Callable[[], KubeletClient],
    ) -> None:
        self.seed = seed
        self.chance = random.Random(seed)
        self.shim = shim
        self.direct = direct
        self.via = via
        self.kubelet = via()
        flag, reserved = shim.reserved_flags
        assert flag == "--reserved-cpus", shim.reserved_flags
        self.reserved = CPUSet.parse(reserved)
        self.online = online_cpus()
        self.exclusive_pool = self.online - self.reserved
        self.pods: dict[str, Pod] = {}
        self.history: list[str] = []
        self.step = 0
        self.refusals = 0
        self.kills = 0

    # -- the model ------------------------------------------------------------------------------

    def containers(self) -> Iterator[tuple[Pod, Container]]:
        for pod in self.pods.values():
            for container in pod.containers.values():
                yield pod, container

    def holders(self) -> list[tuple[Pod, Container]]:
        """Pinned containers that have not exited, in a sandbox not stopped: those holding
        exclusive CPUs (a sandbox's stop releases its pod's, a container left created too)."""
        return [
            (pod, c)
            for pod, c in self.containers()
            if c.pinned and c.state != pb.CONTAINER_EXITED and pod.ready
        ]

    def expected_cpus(self, container: Container) -> CPUSet:
        if container.pinned:
            return self.exclusive_pool
        return self.online - (self.exclusive_pool if self.holders() else CPUSet())

    def expected_quota(self, container: Container) -> str:
        if container.pinned or container.cpu_limit == 0:
            return "-1"
        return str(milli_cpu_to_quota(container.cpu_limit))

    # -- checks ---------------------------------------------------------------------------------

    def fail(self, what: str) -> NoReturn:
        steps = "\n".join(f"  {line}" for line in self.history)
        log = self.shim.process.log().splitlines()[-30:] if self.shim.process else []
        raise ChurnFailure(
            f"churn seed {self.seed} (replay: {SEED_VARIABLE}={self.seed}), step {self.step}: "
            f"{what}\nsteps:\n{steps}\ncpushim's log, last lines:\n" + "\n".join(log)
        )

    def kernel_problems(self) -> list[str]:
        """What the kernel (and the checkpoint) says that the model does not."""
        problems: list[str] = []
        observed: dict[tuple[str, str], CPUSet] = {}
        for pod, container in self.containers():
            where = f"{pod.label()}/{container.label()}"
            want = self.expected_cpus(container)
            try:
                if container.state == pb.CONTAINER_CREATED and pod.ready:
                    recorded = CPUSet.parse(cgroup_cpus_of(self.direct, container.id))
                    if recorded != want:
                        problems.append(f"{where} (created) has cpuset {recorded}, not {want}")
                    continue
                if container.state != pb.CONTAINER_RUNNING:
                    continue
                cgroup = cpuset_cgroup_of_pid(container.pid)
                directory = CPUSET_HIERARCHY / cgroup.lstrip("/")
                cpus = CPUSet.parse((directory / "cpuset.cpus").read_text())
                observed[pod.sandbox.uid, container.name] = cpus
                if cpus != want:
                    problems.append(f"{where}: cgroup cpuset.cpus {cpus}, not {want}")
                pids = (directory / "cgroup.procs").read_text().split()
                if str(container.pid) not in pids:
                    problems.append(f"{where}: pid {container.pid} not in its cgroup {cgroup}")
                for pid in pids:
                    allowed = CPUSet.parse(read_status_field(int(pid), "Cpus_allowed_list"))
                    if allowed != want:
                        problems.append(
                            f"{where}: pid {pid} Cpus_allowed_list {allowed}, not {want}"
                        )
                quota = cgroup_file("cpu", cgroup, "cpu.cfs_quota_us")
                if quota != self.expected_quota(container):
                    problems.append(
                        f"{where}: cpu.cfs_quota_us {quota}, not {self.expected_quota(container)}"
                    )
                shares = cgroup_file("cpu", cgroup, "cpu.shares")
                if shares != str(milli_cpu_to_shares(container.cpu_request)):
                    problems.append(f"{where}: cpu.shares {shares}, not kubelet's")
            except (OSError, LookupError, ValueError, grpc.RpcError) as error:
                problems.append(f"{where}: cannot read: {error!r}")
        problems += self.exclusivity_problems(observed)
        return problems

    def exclusivity_problems(self, observed: Mapping[tuple[str, str], CPUSet]) -> list[str]:
        """By the checkpoint, whatever the model says: the exclusive sets are disjoint and
        free of reserved CPUs; the running containers holding them have them in the kernel,
        and no other running container has any of their CPUs. And they are the model's."""
        problems: list[str] = []
        try:
            assignments = self.shim.assignments()
        except (OSError, ValueError, KeyError) as error:
            return [f"cannot read the checkpoint: {error!r}"]
        assigned = {
            (uid, name): CPUSet.parse(cpus)
            for uid, containers in assignments.items()
            for name, cpus in containers.items()
        }
        held = CPUSet()
        for key, cpus in assigned.items():
            if cpus & held or cpus & self.reserved:
                problems.append(
                    f"checkpoint: {key} holds {cpus}, overlapping {held | self.reserved}"
                )
            held |= cpus
        for key, cpus in observed.items():
            if key in assigned and cpus != assigned[key]:
                problems.append(f"{key} holds {assigned[key]} but runs on {cpus}")
            if key not in assigned and cpus & held:
                problems.append(f"{key} shares {cpus}, which has exclusive CPUs of {held}")
        want = {(pod.sandbox.uid, c.name): self.exclusive_pool for pod, c in self.holders()}
        if assigned != want:
            problems.append(f"checkpoint assignments {assigned}, not {want}")
        return problems

    def runtime_problems(self) -> list[str]:
        """What containerd lists that the model does not have, or has otherwise."""
        sandboxes = {
            s.id: s.state == pb.SANDBOX_READY for s in self.direct.list_pod_sandbox().items
        }
        want_sandboxes = {pod.sandbox.id: pod.ready for pod in self.pods.values()}
        containers = {c.id: c.state for c in self.direct.list_containers().containers}
        want_containers = {c.id: c.state for _, c in self.containers()}
        problems: list[str] = []
        if sandboxes != want_sandboxes:
            problems.append(f"containerd's sandboxes (ready?) {sandboxes}, not {want_sandboxes}")
        if containers != want_containers:
            problems.append(f"containerd's containers {containers}, not {want_containers}")
        for pod, container in self.running():
            where = f"{pod.label()}/{container.label()}"
            if containers.get(container.id) == pb.CONTAINER_RUNNING:
                pid = self.direct.container_pid(container.id)
                if pid != container.pid:
                    problems.append(f"{where} runs as {pid} now")
            # What the workload reads of its CPUs (the projection), written beside the calls.
            try:
                projected = CPUSet.parse(projected_cpus(container.pid).read_text())
            except (OSError, ValueError) as error:
                problems.append(f"{where}: cannot read its projected CPUs: {error!r}")
                continue
            if projected != self.expected_cpus(container):
                problems.append(
                    f"{where}: projected CPUs {projected}, not {self.expected_cpus(container)}"
                )
        return problems

    def problems(self) -> list[str]:
        return self.kernel_problems() + self.runtime_problems()

    def settle(self, *, immediate: bool) -> None:
        """After a CRI call (``immediate``), the kernel already has it when the call returns;
        after what no call tells cpushim, it has it within REACTION_TIMEOUT. containerd's
        listing may lag a kill from outside either way."""
        if immediate:
            problems = self.kernel_problems()
            if problems:
                self.fail("right after the call returned:\n" + "\n".join(problems))
        try:
            wait_for(lambda: not self.problems(), REACTION_TIMEOUT, "the node to settle")
        except TimeoutError:
            self.fail(f"after {REACTION_TIMEOUT} s:\n" + "\n".join(self.problems()))
        problems = self.problems()
        if problems:
            self.fail("settled, then not:\n" + "\n".join(problems))

    # -- steps ----------------------------------------------------------------------------------

    def record(self, what: str) -> None:
        self.history.append(f"{self.step:3d} {what}")

    def run_pod(self, kind: PodKind | None = None) -> None:
        if kind is None:
            kind = self.chance.choices(POD_KINDS, [k.weight for k in POD_KINDS])[0]
        name = f"{kind.name}-{self.step}"
        self.record(f"run pod {name} ({kind.qos})")
        sandbox = self.kubelet.run_pod_sandbox(name, "default", new_pod_uid(), kind.qos)
        self.pods[sandbox.id] = Pod(
            kind,
            sandbox,
            next_attempt=dict.fromkeys(kind.containers, 0),
            resources=dict(kind.containers),
        )
        self.settle(immediate=True)

    def creatable(self) -> list[tuple[Pod, str]]:
        return [
            (pod, name)
            for pod in self.pods.values()
            if pod.ready
            for name in pod.kind.containers
            if not pod.live(name)
        ]

    def free(self) -> int:
        return 0 if self.holders() else len(self.exclusive_pool)

    def create(self, pod: Pod, name: str) -> str | grpc.RpcError:
        """kubelet's CreateContainer for the container's next attempt: its id, or the error."""
        try:
            return self.kubelet.create_container(
                pod.sandbox,
                name,
                TEST_IMAGE,
                WORKLOAD,
                resources=pod.resources[name],
                attempt=pod.next_attempt[name],
            )
        except grpc.RpcError as error:
            return error

    def created(
        self, pod: Pod, name: str, outcome: str | grpc.RpcError, fits: bool
    ) -> Container | None:
        """Checks a create's outcome against ``fits`` and puts it in the model; a refused one
        must have left no container behind. The container made, if one was."""
        attempt = pod.next_attempt[name]
        if isinstance(outcome, grpc.RpcError):
            if fits or outcome.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.fail(
                    f"create of {name}#{attempt} failed: {outcome.code()} {outcome.details()}"
                )
            self.refusals += 1
            left = [
                c.id
                for c in self.direct.list_containers(sandbox_id=pod.sandbox.id).containers
                if c.id not in pod.containers
            ]
            if left:
                self.fail(f"the refused create left containers {left} in containerd")
            return None  # kubelet's next try is the same attempt
        if not fits:
            self.fail(f"create of {name}#{attempt} with no exclusive CPU free was not refused")
        resources = pod.resources[name]
        pinned = pod.exclusive_cpus(name) > 0
        container = pod.containers[outcome] = Container(
            outcome,
            name,
            attempt,
            pinned,
            resources.cpu_milli_request or resources.cpu_milli_limit,
            resources.cpu_milli_limit,
        )
        pod.next_attempt[name] = attempt + 1
        return container

    def create_and_start(self) -> None:
        """kubelet's create and start; now and then the start waits for a later step (a
        kubelet restarted in between, a start that failed)."""
        pod, name = self.chance.choice(self.creatable())
        count = pod.exclusive_cpus(name)
        fits = count <= self.free()
        self.record(
            f"create {pod.label()}/{name}#{pod.next_attempt[name]} ({count} exclusive, "
            f"{self.free()} free)" + ("" if fits else ": refused")
        )
        container = self.created(pod, name, self.create(pod, name), fits)
        self.settle(immediate=True)
        if container is not None and self.chance.random() < 0.8:
            self.start(pod, container)

    def start(self, pod: Pod, container: Container) -> None:
        self.record(f"start {pod.label()}/{container.label()}")
        self.kubelet.start_container(container.id)
        container.state = pb.CONTAINER_RUNNING
        container.pid = self.direct.container_pid(container.id)
        self.settle(immediate=True)

    def startable(self) -> list[tuple[Pod, Container]]:
        return [(p, c) for p, c in self.in_state(pb.CONTAINER_CREATED) if p.ready]

    def start_created(self) -> None:
        pod, container = self.chance.choice(self.startable())
        self.start(pod, container)

    def race_partners(self, pod: Pod) -> tuple[list[tuple[Pod, str]], list[tuple[Pod, Container]]]:
        """What may happen beside a create in ``pod``: another pod's worker creating one, or
        stopping one, or one of another pod's processes dying."""
        creates = [(p, name) for p, name in self.creatable() if p is not pod]
        running = [(p, c) for p, c in self.running() if p is not pod]
        return creates, running

    def may_race(self) -> bool:
        return any(any(self.race_partners(pod)) for pod, _ in self.creatable())

    def race(self) -> None:
        """A create beside another pod's create, stop or exit, as kubelet's pod workers run
        at once. Two creates asking for the one CPU have one winner; one beside the stop or
        exit of the CPU's holder may find it taken or free, and either is right."""
        first = self.chance.choice([c for c in self.creatable() if any(self.race_partners(c[0]))])
        creates, running = self.race_partners(first[0])
        ending: tuple[Pod, Container] | None = None
        killing = False
        creating = [first]
        if running and (not creates or self.chance.random() < 0.6):
            ending = self.chance.choice(running)
            killing = self.chance.random() < 0.5
        else:
            creating.append(self.chance.choice(creates))
        free = self.free()
        counts = [pod.exclusive_cpus(name) for pod, name in creating]
        self.record(
            "at once: "
            + " and ".join(
                f"create {pod.label()}/{name}#{pod.next_attempt[name]} ({count} exclusive)"
                for (pod, name), count in zip(creating, counts, strict=True)
            )
            + (
                f" and {'kill' if killing else 'stop'} {ending[0].label()}/{ending[1].label()}"
                if ending
                else ""
            )
            + f" ({free} free)"
        )
        with ThreadPoolExecutor(len(creating) + 1) as pool:
            asked = [pool.submit(self.create, pod, name) for pod, name in creating]
            if ending is not None and killing:
                self.kill(*ending)
            stopped = (
                pool.submit(self.kubelet.stop_container, ending[1].id, STOP_GRACE_SECONDS)
                if ending is not None and not killing
                else None
            )
            outcomes = [future.result() for future in asked]
            if stopped is not None:
                stopped.result()
        if ending is not None:
            ending[1].state = pb.CONTAINER_EXITED
        # Creates of one exclusive CPU may win it; none of more (there is one to hand out).
        asking = [isinstance(o, str) for o, n in zip(outcomes, counts, strict=True) if n == 1]
        freed = 1 if ending is not None and ending[1].pinned else 0
        least, most = min(len(asking), free), min(len(asking), free + freed)
        if not least <= sum(asking) <= most:
            self.fail(f"{sum(asking)} of {len(asking)} creates asking for a CPU made: {outcomes}")
        made: list[tuple[Pod, Container | None]] = []
        for (pod, name), outcome, count in zip(creating, outcomes, counts, strict=True):
            fits = count == 0 or (count == 1 and isinstance(outcome, str))
            made.append((pod, self.created(pod, name, outcome, fits)))
        # A kill is told by no call: what it changes may come later.
        self.settle(immediate=not killing)
        for pod, container in made:
            if container is not None:
                self.start(pod, container)

    def in_state(self, state: pb.ContainerState.ValueType) -> list[tuple[Pod, Container]]:
        return [(p, c) for p, c in self.containers() if c.state == state]

    def running(self) -> list[tuple[Pod, Container]]:
        return self.in_state(pb.CONTAINER_RUNNING)

    def stop_container(self) -> None:
        pod, container = self.chance.choice(self.running())
        self.record(f"stop {pod.label()}/{container.label()}")
        self.kubelet.stop_container(container.id, timeout=STOP_GRACE_SECONDS)
        container.state = pb.CONTAINER_EXITED
        self.settle(immediate=True)

    def removable(self) -> list[tuple[Pod, Container]]:
        """Exited containers, and created ones kubelet gave up starting."""
        return self.in_state(pb.CONTAINER_EXITED) + self.in_state(pb.CONTAINER_CREATED)

    def remove_container(self) -> None:
        pod, container = self.chance.choice(self.removable())
        self.record(f"remove {pod.label()}/{container.label()}")
        self.kubelet.remove_container(container.id)
        del pod.containers[container.id]
        self.settle(immediate=True)

    def stop_sandbox(self) -> None:
        pod = self.chance.choice(list(self.pods.values()))
        self.record(f"stop sandbox {pod.label()}" + ("" if pod.ready else " (again)"))
        self.kubelet.stop_pod_sandbox(pod.sandbox.id)
        pod.ready = False
        # containerd stops what runs; a container only created stays so, never to start.
        for container in pod.containers.values():
            if container.state == pb.CONTAINER_RUNNING:
                container.state = pb.CONTAINER_EXITED
        self.settle(immediate=True)

    def remove_sandbox(self) -> None:
        pod = self.chance.choice([p for p in self.pods.values() if not p.ready])
        self.record(f"remove sandbox {pod.label()}")
        self.kubelet.remove_pod_sandbox(pod.sandbox.id)
        # What kubelet does once the pod is gone (the client did it if it ran the pod).
        remove_cgroup(pod.sandbox.config.linux.cgroup_parent)
        del self.pods[pod.sandbox.id]
        self.settle(immediate=True)

    def kill(self, pod: Pod, container: Container) -> None:
        """SIGKILL from outside, as the OOM killer would: no CRI call follows."""
        os.kill(container.pid, signal.SIGKILL)
        container.state = pb.CONTAINER_EXITED
        self.kills += 1

    def kill_process(self) -> None:
        pod, container = self.chance.choice(self.running())
        self.record(f"kill {pod.label()}/{container.label()} from outside")
        self.kill(pod, container)
        self.settle(immediate=False)

    def resizable(self) -> list[tuple[Pod, Container]]:
        return [
            (p, c)
            for p, c in self.running()
            if resized(p.kind.qos, p.resources[c.name]) is not None
        ]

    def resize(self) -> None:
        """kubelet's in-place resize of a running container's CPU (InPlacePodVerticalScaling):
        to a whole CPU it is pinned, when the CPU is free, else refused with nothing changed;
        to half a CPU it gives its CPU back and shares."""
        pod, container = self.chance.choice(self.resizable())
        wanted = resized(pod.kind.qos, pod.resources[container.name])
        assert wanted is not None
        count = exclusive_cpus(pod.kind.qos, wanted)
        fits = container.pinned or count <= self.free()
        self.record(
            f"resize {pod.label()}/{container.label()} to {wanted.cpu_milli_limit}m"
            + ("" if fits else ": refused")
        )
        try:
            self.kubelet.update_container_resources(
                container.id, self.kubelet.linux_resources(pod.kind.qos, wanted)
            )
        except grpc.RpcError as error:
            if fits or error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.fail(f"resize failed: {error.code()} {error.details()}")
            self.refusals += 1
        else:
            if not fits:
                self.fail("a resize to a CPU held by another container was not refused")
            # The pod spec has the new resources, and so has the container's next attempt.
            pod.resources[container.name] = wanted
            container.pinned = count > 0
            container.cpu_request = wanted.cpu_milli_request
            container.cpu_limit = wanted.cpu_milli_limit
        self.settle(immediate=True)

    def wait_listed_exited(self, container: Container) -> None:
        """Until containerd lists the container exited, as kubelet's PLEG learns of an exit."""
        wait_for(
            lambda: self.direct.container_status(container.id).status.state == pb.CONTAINER_EXITED,
            REACTION_TIMEOUT,
            f"containerd to list {container.label()} exited",
        )

    def kill_and_restart_in_place(self) -> None:
        """kubelet restarts a container that died (restartPolicy Always) as soon as it has
        seen the exit, which may be before cpushim has: the create then races the exit."""
        pod, container = self.chance.choice(self.running())
        self.record(f"kill {pod.label()}/{container.label()} from outside, then at once:")
        self.kill(pod, container)
        self.wait_listed_exited(container)
        fits = pod.exclusive_cpus(container.name) <= self.free()
        self.record(
            f"create {pod.label()}/{container.name}#{pod.next_attempt[container.name]}"
            + ("" if fits else ": refused")
        )
        again = self.created(pod, container.name, self.create(pod, container.name), fits)
        self.settle(immediate=True)
        if again is not None:
            self.start(pod, again)

    def restart_cpushim(self, kill_while_down: bool) -> None:
        """SIGKILL cpushim between two calls, and start it again; with ``kill_while_down``, a
        running container (the one holding the exclusive CPU, if one runs) dies meanwhile."""
        victim = None
        if kill_while_down and self.running():
            pinned = [(p, c) for p, c in self.running() if c.pinned]
            victim = self.chance.choice(pinned or self.running())
        self.record(
            "SIGKILL cpushim"
            + (f", kill {victim[0].label()}/{victim[1].label()}" if victim else "")
            + ", start it"
        )
        self.shim.kill()
        self.kubelet.close()
        if victim is not None:
            self.kill(*victim)
            # Its exit is what containerd tells the next start-up.
            self.wait_listed_exited(victim[1])
        self.shim.start()
        self.kubelet = self.via()
        self.settle(immediate=True)

    def choose(self) -> Callable[[], None]:
        pods = self.pods.values()
        weighted: list[tuple[float, Callable[[], None]]] = [
            (3.0 if len(pods) < 3 else 1.0 if len(pods) < MAX_PODS else 0.0, self.run_pod),
            (5.0 if self.creatable() else 0.0, self.create_and_start),
            (1.5 if self.may_race() else 0.0, self.race),
            (3.0 if self.startable() else 0.0, self.start_created),
            (2.0 if self.running() else 0.0, self.stop_container),
            (1.5 if self.removable() else 0.0, self.remove_container),
            (1.0 if self.running() else 0.0, self.kill_process),
            (1.5 if self.resizable() else 0.0, self.resize),
            (1.0 if self.running() else 0.0, self.kill_and_restart_in_place),
            # kubelet stops a stopped sandbox again (its pod's next sync, a GC).
            (0.6 if pods else 0.0, self.stop_sandbox),
            (1.0 if any(not p.ready for p in pods) else 0.0, self.remove_sandbox),
        ]
        weights = [w for w, _ in weighted]
        return self.chance.choices([step for _, step in weighted], weights)[0]

    def run(self, steps: int) -> None:
        # One pod of each kind to begin with, so that every kind is met in any sequence.
        first_pods = self.chance.sample(POD_KINDS, len(POD_KINDS))
        restarts = max(2, steps // STEPS_PER_RESTART)
        restart_at = sorted(self.chance.sample(range(steps // 5, steps), restarts))
        for self.step in range(steps):
            if first_pods:
                self.run_pod(first_pods.pop())
            elif restart_at and restart_at[0] == self.step:
                restart_at.pop(0)
                # Every other restart, the first among them, has a container die meanwhile.
                self.restart_cpushim(kill_while_down=(restarts - len(restart_at)) % 2 == 1)
            else:
                self.choose()()


def test_random_churn_keeps_the_kernel_as_the_model_has_it(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    seed = int(os.environ.get(SEED_VARIABLE) or DEFAULT_SEED)
    steps = int(os.environ.get(STEPS_VARIABLE) or DEFAULT_STEPS)
    shim.start()
    churn = Churn(seed, shim, direct, via)
    started = time.monotonic()
    try:
        churn.run(steps)
    except grpc.RpcError as error:
        churn.fail(f"call failed: {error.code()} {error.details()}")
    except (OSError, LookupError) as error:  # TimeoutError too
        churn.fail(f"{type(error).__name__}: {error}")
    print(
        f"churn seed {seed}: {steps} steps in {time.monotonic() - started:.1f} s,"
        f" {churn.refusals} refusals, {churn.kills} kills"
    )
    # The sequence met what it is there for (the restarts are certain).
    assert churn.refusals > 0, churn.history
    assert churn.kills > 0, churn.history
