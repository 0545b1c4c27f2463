"""Scenarios that run inside an emulated multi-socket guest (tests/vm/guest_runner.py), each
checked by what the guest kernel reports: ``Cpus_allowed_list`` and ``Mems_allowed_list`` of
the container's process and its cgroup's ``cpuset.cpus`` and ``cpuset.mems`` (cgroup v1 or
v2, with the cgroupfs or the systemd driver, as the topology says).

The file is not named ``test_*.py`` on purpose: the host's pytest never collects it. Every
scenario runs on every topology; what it expects is computed from the topology the host
asked QEMU for (``topology.json`` in the results directory), so none is ever skipped.

Scenarios with the same policy options share one cpushim (static policy, the topology's
reserved CPUs) in front of the guest's one containerd; each tears its pods down after.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from shim.cgroups import expand_slice
from shim.cpuset import CPUSet
from shim.topology import Topology as SysfsTopology
from tests.harness.containerd import (
    PrivateContainerd,
    ServingProcess,
    ServingProcessError,
    cpushim_command,
    wait_for,
)
from tests.harness.images import TEST_IMAGE, build_image
from tests.harness.kubelet import (
    MIB,
    WORKLOAD,
    ContainerResources,
    KubeletClient,
    QoSClass,
    Sandbox,
    cpuset_cgroup_of_pid,
    new_pod_uid,
    read_status_field,
)
from tests.vm.topologies import Topology

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Under TCG everything is slower than on the host; cpushim's start-up imports dominate.
CPUSHIM_START_TIMEOUT = 90.0
CHURN_STEPS = 20
CHURN_TIMEOUT_SECONDS = 900
# How long cpushim may take, under emulation, to see what no call tells it.
REACTION_TIMEOUT = 60.0
# Each running shared container is moved on every pinning and release (a runc update).
MAX_SHARED = 2


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def topology() -> Topology:
    results = Path(os.environ["CPUSHIM_VM_RESULTS"])
    data = json.loads((results / "topology.json").read_text())
    assert isinstance(data, dict)
    return Topology.from_json(data)


@pytest.fixture(scope="session")
def containerd(topology: Topology) -> Iterator[PrivateContainerd]:
    image = build_image(TEST_IMAGE)
    with PrivateContainerd(
        sandbox_image=image.ref, start_timeout=90.0, cgroup_driver=topology.cgroup_driver
    ) as instance:
        try:
            instance.import_image(image, timeout=120.0)
            with KubeletClient(instance.address, log_root=instance.dir / "pod-logs") as probe:
                probe.wait_ready(timeout=90.0)
            yield instance
        finally:
            # containerd's directory goes when it stops; its log goes home with the results.
            logs = Path(os.environ["CPUSHIM_VM_RESULTS"]) / "logs"
            logs.mkdir(exist_ok=True)
            shutil.copyfile(instance.log_path, logs / "containerd.log")


@dataclass(frozen=True, slots=True)
class Running:
    """A started container and what it was asked for (``cpus`` None: a shared container)."""

    name: str
    sandbox: Sandbox
    container_id: str
    pid: int
    cpus: int | None
    own_pod: bool


@dataclass(frozen=True, slots=True)
class Observed:
    """What the guest kernel says about one container."""

    cpus_allowed: CPUSet
    mems_allowed: CPUSet
    cgroup_cpus: CPUSet
    cgroup_mems: CPUSet


class Node:
    """cpushim in front of the guest's containerd, and a kubelet-shaped client through it.

    Starting cpushim costs seconds of emulated CPU, so one instance serves every scenario
    that wants the same policy options; a scenario leaves no pod behind (``finish``)."""

    def __init__(self, containerd: PrivateContainerd, directory: Path, topology: Topology):
        self.containerd = containerd
        self.directory = directory
        self.topology = topology
        self.socket_path = directory / "cpushim.sock"
        self.state_dir = directory / "state"
        self.options: tuple[str, ...] | None = None
        self.process: ServingProcess | None = None
        self.client: KubeletClient | None = None
        self.running: dict[str, Running] = {}
        self.pods: list[Sandbox] = []

    def start(self, *options: str) -> KubeletClient:
        """A cpushim with these ``--policy-option``s: the running one, or a new one on a
        fresh state directory once the previous one has stopped (two cpushims in front of
        one containerd would each adopt the other's containers)."""
        if self.client is not None and self.options == options:
            return self.client
        self.stop_cpushim()
        self.options = options
        extra = ["--policy", "static", "--reserved-cpus", str(self.topology.reserved)]
        for option in options:
            extra += ["--policy-option", option]
        directory = Path(
            tempfile.mkdtemp(prefix=f"{'-'.join(options) or 'default'}-", dir=self.directory)
        )
        self.socket_path = directory / "cpushim.sock"
        self.state_dir = directory / "state"
        self.process = ServingProcess(
            cpushim_command(
                f"unix://{self.socket_path}",
                self.containerd.address,
                *extra,
                state_dir=self.state_dir,
                log_level="info",
            ),
            socket_path=self.socket_path,
            log_path=directory / "cpushim.log",
        )
        try:
            self.process.start(timeout=CPUSHIM_START_TIMEOUT)
        except ServingProcessError as error:
            pytest.fail(str(error), pytrace=False)
        self.client = KubeletClient(
            f"unix://{self.socket_path}",
            log_root=self.containerd.dir / "pod-logs",
            timeout=60,
            cgroup_driver=self.containerd.cgroup_driver,
        )
        self.clear_leftovers()
        return self.client

    def clear_leftovers(self) -> None:
        """Tear down, through cpushim, every pod the runtime has that this scenario did not
        run: one an earlier scenario's teardown never reached (cut short by its timeout)
        would hold CPUs that this scenario's invariants count as the shared pool's."""
        if self.client is None:
            return
        owned = {pod.id for pod in self.pods}
        for sandbox in self.client.list_pod_sandbox().items:
            if sandbox.id not in owned:
                print(f"tearing down pod {sandbox.metadata.name} left by an earlier scenario")
                self.client.teardown_pod(sandbox.id)

    @property
    def kubelet(self) -> KubeletClient:
        assert self.client is not None, "start cpushim first"
        return self.client

    def run(
        self,
        name: str,
        cpus: int | None,
        qos: QoSClass | None = None,
        pod: Sandbox | None = None,
        memory_nodes: CPUSet | None = None,
    ) -> Running:
        """A container named ``name``: Guaranteed with ``cpus`` whole CPUs, or a shared one
        (BestEffort, or Burstable with half a CPU), in a pod of its own unless ``pod`` is
        given (of the same QoS class); ``memory_nodes``: what kubelet's Static memory
        manager would send in ``cpuset_mems``."""
        if cpus is not None:
            qos = "guaranteed"
            milli, memory = cpus * 1000, 32 * MIB
            resources = ContainerResources(milli, milli, memory, memory)
        elif qos == "burstable":
            resources = ContainerResources(500, 0, 16 * MIB, 0)
        else:
            qos, resources = "besteffort", ContainerResources()
        own_pod = pod is None
        sandbox = pod or self.pod(name, qos)
        container_id = self.kubelet.create_container(
            sandbox,
            name,
            TEST_IMAGE,
            WORKLOAD,
            resources=resources,
            cpuset_mems=",".join(map(str, memory_nodes or ())),
        )
        self.kubelet.start_container(container_id)
        pid = self.kubelet.container_pid(container_id)
        running = Running(name, sandbox, container_id, pid, cpus, own_pod)
        self.running[name] = running
        return running

    def pod(self, name: str, qos: QoSClass) -> Sandbox:
        sandbox = self.kubelet.run_pod_sandbox(name, "default", new_pod_uid(), qos)
        self.pods.append(sandbox)
        return sandbox

    def stop(self, running: Running) -> None:
        """kubelet's order: stop and remove the container, then the sandbox if it was the
        container's own."""
        self.kubelet.stop_container(running.container_id, timeout=10)
        self.kubelet.remove_container(running.container_id)
        if running.own_pod:
            self.kubelet.stop_pod_sandbox(running.sandbox.id)
            self.kubelet.remove_pod_sandbox(running.sandbox.id)
            self.pods.remove(running.sandbox)
        del self.running[running.name]

    def finish(self) -> None:
        """Tears down every pod the scenario ran, through cpushim, which must then hold no
        exclusive CPUs. Shared pods go first: every release of exclusive CPUs grows each
        running shared container (a runc update, seconds under emulation)."""
        self.running.clear()
        pods, self.pods = self.pods, []
        if self.client is None:
            return
        for sandbox in sorted(pods, key=lambda pod: pod.qos == "guaranteed"):
            self.client.teardown_pod(sandbox.id)
        errors = self.client.teardown_all()
        assert not errors, f"teardown through cpushim failed: {errors}"
        assert self.checkpoint() == {}, "cpushim still holds CPUs after every pod went"

    def stop_cpushim(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.process is not None:
            code = self.process.stop(timeout=30)
            log = self.process.log()
            self.process = None
            assert code == 0, f"cpushim exited {code}; its log:\n{log}"

    def repairs(self, running: Running) -> int:
        """How often cpushim logged writing back the container's cpuset, changed by another."""
        assert self.process is not None
        return sum(
            "behind cpushim's back" in line and running.container_id in line
            for line in self.process.log().splitlines()
        )

    def checkpoint(self) -> dict[str, CPUSet]:
        """Container name -> exclusive CPUs, from cpushim's state.json."""
        body = json.loads((self.state_dir / "state.json").read_text())["body"]
        return {
            name: CPUSet.parse(entry["cpus"])
            for containers in body["assignments"].values()
            for name, entry in containers.items()
        }


def unified_hierarchy() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def cpuset_directory(pid: int) -> Path:
    """The directory of the pid's cgroup that holds its ``cpuset.*`` files."""
    if not unified_hierarchy():
        return CGROUP_ROOT / "cpuset" / cpuset_cgroup_of_pid(pid).lstrip("/")
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return CGROUP_ROOT / line.removeprefix("0::").lstrip("/")
    raise LookupError(f"pid {pid} has no cgroup v2 entry")


def cpuset_file(directory: Path, name: str) -> CPUSet:
    """What the cgroup was given. In cgroup v2 a file never written is empty and the set is
    the parent's, so ``.effective`` says what it is then."""
    text = (directory / name).read_text().strip()
    if not text and unified_hierarchy():
        text = (directory / f"{name}.effective").read_text().strip()
    return CPUSet.parse(text)


def observe(running: Running) -> Observed:
    cgroup = cpuset_directory(running.pid)
    return Observed(
        cpus_allowed=CPUSet.parse(read_status_field(running.pid, "Cpus_allowed_list")),
        mems_allowed=CPUSet.parse(read_status_field(running.pid, "Mems_allowed_list")),
        cgroup_cpus=cpuset_file(cgroup, "cpuset.cpus"),
        cgroup_mems=cpuset_file(cgroup, "cpuset.mems"),
    )


@pytest.fixture(scope="session")
def shared_node(
    containerd: PrivateContainerd, topology: Topology, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    instance = Node(containerd, tmp_path_factory.mktemp("cpushim"), topology)
    yield instance
    instance.stop_cpushim()


@pytest.fixture
def node(shared_node: Node) -> Iterator[Node]:
    shared_node.clear_leftovers()
    try:
        yield shared_node
    finally:
        shared_node.finish()


# -- what every assignment must look like -------------------------------------------------------


def nodes_of(topology: Topology, cpus: CPUSet) -> CPUSet:
    return CPUSet(topology.numa_node_of(cpu) for cpu in cpus)


def assert_exclusive(topology: Topology, seen: Observed, count: int) -> CPUSet:
    """The kernel agrees with itself, the set has the size asked for, keeps off the reserved
    CPUs, and memory comes from exactly the NUMA nodes of those CPUs."""
    assert seen.cpus_allowed == seen.cgroup_cpus, seen
    assert len(seen.cpus_allowed) == count, seen
    assert not seen.cpus_allowed & topology.reserved, seen
    nodes = nodes_of(topology, seen.cpus_allowed)
    assert seen.mems_allowed == nodes, seen
    assert seen.cgroup_mems == nodes, seen
    return seen.cpus_allowed


def assert_invariants(node: Node) -> None:
    """docs/architecture.md's invariants, from the kernel: exclusive sets are disjoint from each
    other, from the reserved CPUs and from the shared pool; every shared container sees the
    same non-empty pool; pool and exclusive sets together are every CPU; cpushim's checkpoint
    names exactly the exclusive sets the kernel enforces."""
    topology = node.topology
    exclusive: dict[str, CPUSet] = {}
    shared: dict[str, CPUSet] = {}
    for name, running in node.running.items():
        seen = observe(running)
        assert seen.cpus_allowed == seen.cgroup_cpus, (name, seen)
        if running.cpus is None:
            shared[name] = seen.cpus_allowed
        else:
            exclusive[name] = assert_exclusive(topology, seen, running.cpus)
    taken = CPUSet()
    for name, cpus in exclusive.items():
        assert not cpus & taken, f"{name} {cpus} overlaps another exclusive set: {exclusive}"
        taken |= cpus
    pool = topology.cpus - taken
    assert pool, "the shared pool is empty"
    assert topology.reserved.issubset(pool)
    for name, cpus in shared.items():
        assert cpus == pool, (
            f"shared {name} runs on {cpus}, the pool is {pool} ({exclusive}); "
            + after_the_fact(node, node.running[name], pool)
        )
        if topology.cgroup_driver == "systemd":
            # systemd writes its copy into the cgroup whenever it applies the unit again: it
            # may lag behind a grow, never hold a CPU given out exclusively.
            held = systemd_record(node.running[name], "AllowedCPUs")
            assert held.issubset(pool), f"systemd holds {held} for shared {name} ({exclusive})"
    assert node.checkpoint() == exclusive


def after_the_fact(node: Node, running: Running, pool: CPUSet) -> str:
    """For a shared container found off the pool: whether it comes back by itself (a write
    that landed after cpushim's, which its watch then put right) or not (a move cpushim
    never made), what systemd holds for it, and what cpushim logged of it."""
    started = time.monotonic()
    try:
        wait_for(lambda: observe(running).cpus_allowed == pool, 10.0, "the pool")
        outcome = f"back on the pool {time.monotonic() - started:.2f} s later"
    except TimeoutError:
        outcome = f"still on {observe(running).cpus_allowed} 10 s later"
    if node.topology.cgroup_driver == "systemd":
        outcome += f"; systemd holds {systemd_record(running, 'AllowedCPUs')}"
    logged = [
        line[:400]
        for line in (node.process.log() if node.process is not None else "").splitlines()
        if running.container_id in line
    ]
    return outcome + "; cpushim logged of it:\n" + "\n".join(logged[-20:])


def refused(node: Node, name: str, cpus: int, pod: Sandbox) -> grpc.RpcError:
    """Creates a Guaranteed container that cpushim must refuse; returns the error kubelet
    would get."""
    with pytest.raises(grpc.RpcError) as caught:
        node.run(name, cpus, pod=pod)
    return caught.value


# -- scenarios ---------------------------------------------------------------------------------


def test_the_guest_kernel_sees_the_emulated_topology(topology: Topology) -> None:
    assert (2 if unified_hierarchy() else 1) == topology.cgroup_version
    seen = SysfsTopology.from_sysfs(Path("/sys"))
    assert seen.online == topology.cpus
    assert seen.num_sockets == topology.sockets
    assert seen.num_numa_nodes == topology.numa_node_count
    assert seen.cpus_per_core == topology.threads_per_core
    for socket in range(topology.sockets):
        assert seen.cpus_in_socket(socket) == topology.socket_cpus(socket)
    for numa_node in range(topology.numa_node_count):
        assert seen.cpus_in_numa_node(numa_node) == topology.numa_node_cpus(numa_node)
    for cpu in topology.cpus:
        assert seen.siblings(cpu) == topology.core_cpus(topology.core_of(cpu))


def test_two_cpus_are_one_whole_core_or_two_cores_of_one_numa_node(
    node: Node, topology: Topology
) -> None:
    node.start()
    cpus = assert_exclusive(topology, observe(node.run("pair", 2)), 2)
    cores = {topology.core_of(cpu) for cpu in cpus}
    if topology.smt:
        assert len(cores) == 1, f"{cpus} are not the threads of one core"
        assert cpus == topology.core_cpus(cores.pop())
    else:
        assert len(nodes_of(topology, cpus)) == 1, f"{cpus} span NUMA nodes"
    assert_invariants(node)


def test_a_socket_sized_request_gets_a_whole_socket_and_its_memory(
    node: Node, topology: Topology
) -> None:
    # The socket with the most free CPUs (the reserved ones sit on socket 0).
    free = {s: topology.socket_cpus(s) - topology.reserved for s in range(topology.sockets)}
    socket = max(free, key=lambda s: (len(free[s]), -s))
    node.start()
    seen = observe(node.run("socket", len(free[socket])))
    cpus = assert_exclusive(topology, seen, len(free[socket]))
    assert cpus == free[socket]
    socket_nodes = CPUSet(range(socket * topology.numa_nodes_per_socket,
                                (socket + 1) * topology.numa_nodes_per_socket))  # fmt: skip
    assert seen.mems_allowed == socket_nodes
    assert_invariants(node)


def test_three_cpus_pack_into_one_numa_node(node: Node, topology: Topology) -> None:
    node.start()
    cpus = assert_exclusive(topology, observe(node.run("three", 3)), 3)
    assert len(nodes_of(topology, cpus)) == 1, f"{cpus} span NUMA nodes"
    # Packed: as few cores as the SMT level allows (one whole core and a thread, on SMT).
    cores = {topology.core_of(cpu) for cpu in cpus}
    assert len(cores) == -(-3 // topology.threads_per_core), f"{cpus} use cores {cores}"
    assert_invariants(node)


def test_kubelets_memory_nodes_steer_the_cpus_and_hold_the_memory(
    node: Node, topology: Topology
) -> None:
    """kubelet's Static memory manager names the last NUMA node (the farthest from the
    reserved CPUs, where packing alone would not go): the CPUs come from it and the memory
    stays on it; when it has no CPU left to give, the memory still does."""
    last = topology.numa_node_count - 1
    here = topology.numa_node_cpus(last) - topology.reserved
    node.start()
    seen = observe(node.run("near", 1, memory_nodes=CPUSet([last])))
    assert seen.cpus_allowed == seen.cgroup_cpus, seen
    assert seen.cpus_allowed.issubset(here), seen
    assert seen.mems_allowed == seen.cgroup_mems == CPUSet([last]), seen
    if topology.numa_node_count > 1 and len(here) > 1:
        # Fill the node (the shared pool keeps the CPUs of the others), then ask again.
        rest = observe(node.run("rest", len(here) - 1, memory_nodes=CPUSet([last])))
        assert rest.cpus_allowed == here - seen.cpus_allowed, rest
        assert_invariants(node)  # so far memory is where the CPUs are
        away = observe(node.run("away", 1, memory_nodes=CPUSet([last])))
        assert away.cpus_allowed.isdisjoint(topology.numa_node_cpus(last)), away
        assert away.mems_allowed == away.cgroup_mems == CPUSet([last]), away


def test_shared_containers_never_touch_exclusive_cpus(node: Node, topology: Topology) -> None:
    node.start()
    node.run("besteffort", None, "besteffort")
    node.run("burstable", None, "burstable")
    assert_invariants(node)
    # One Guaranteed pod, several containers (pods cost seconds each under emulation).
    pod = node.pod("pinned", "guaranteed")
    for index, size in enumerate([2, 3, 1]):
        node.run(f"pinned-{index}", size, pod=pod)
        assert_invariants(node)
    node.stop(node.running["pinned-1"])
    assert_invariants(node)
    node.run("pinned-3", 4, pod=pod)
    assert_invariants(node)


def test_reserved_cpus_stay_reserved_when_every_other_cpu_is_taken(
    node: Node, topology: Topology
) -> None:
    node.start()
    node.run("besteffort", None, "besteffort")
    pod = node.pod("pinned", "guaranteed")
    free = len(topology.cpus - topology.reserved)
    index = 0
    while free:
        size = min(4, free)
        node.run(f"pinned-{index}", size, pod=pod)
        free -= size
        index += 1
    assert_invariants(node)
    assert observe(node.running["besteffort"]).cpus_allowed == topology.reserved
    error = refused(node, "one-more", 1, pod)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert_invariants(node)


def test_an_in_place_resize_grows_and_shrinks_the_set_around_its_cpus(
    node: Node, topology: Topology
) -> None:
    """kubelet resizes a running Guaranteed container in place (InPlacePodVerticalScaling):
    from 1 CPU to 3, it keeps its CPU and gains two, memory nodes following; back to 2, it
    keeps two of its three. The process runs on throughout, and the shared container never
    shares a CPU with it."""
    node.start()
    node.run("besteffort", None, "besteffort")
    running = node.run("resized", 1)
    first = assert_exclusive(topology, observe(running), 1)
    for count in (3, 2):
        before = observe(running).cpus_allowed
        milli, memory = count * 1000, 32 * MIB
        node.kubelet.update_container_resources(
            running.container_id,
            node.kubelet.linux_resources(
                "guaranteed", ContainerResources(milli, milli, memory, memory)
            ),
        )
        running = node.running["resized"] = dataclasses.replace(running, cpus=count)
        now = assert_exclusive(topology, observe(running), count)
        if count > len(before):
            assert before.issubset(now), f"grown from {before} to {now}"
        else:
            assert now.issubset(before), f"shrunk from {before} to {now}"
        assert node.kubelet.container_pid(running.container_id) == running.pid
        assert_invariants(node)
    assert first.issubset(observe(running).cpus_allowed) or topology.smt


# Its own limit: under the systemd driver every shrink of a shared container waits for a runc
# update (seconds each under emulation), and 300 s left it no margin on a loaded host.
@pytest.mark.timeout(CHURN_TIMEOUT_SECONDS)
def test_churn_keeps_every_invariant(node: Node, topology: Topology) -> None:
    """Random creates and stops of containers in two long-lived pods (a Guaranteed one for
    the pinned containers, a BestEffort one for the shared), as kubelet restarts containers
    in place; after every step, every invariant holds."""
    given = Path(os.environ["CPUSHIM_VM_RESULTS"]) / "churn-seed"
    seed = int(given.read_text()) if given.exists() else random.randrange(1 << 32)
    # Replayed with CPUSHIM_VM_CHURN_SEED=<seed> on the host (docs/testing.md).
    print(f"churn seed {seed}")
    chance = random.Random(seed)
    node.start()
    pinned_pod = node.pod("churn-pinned", "guaranteed")
    shared_pod = node.pod("churn-shared", "besteffort")
    node.run("shared", None, pod=shared_pod)
    allocatable = len(topology.cpus - topology.reserved)
    for step in range(CHURN_STEPS):
        pinned = [r for r in node.running.values() if r.cpus is not None]
        free = allocatable - sum(r.cpus or 0 for r in pinned)
        if pinned and (chance.random() < 0.4 or free == 0):
            node.stop(chance.choice(pinned))
        elif chance.random() < 0.15 and len(node.running) - len(pinned) < MAX_SHARED:
            node.run(f"shared-{step}", None, pod=shared_pod)
        else:
            size = chance.randint(1, 4)
            if size <= free:
                node.run(f"pinned-{step}", size, pod=pinned_pod)
            else:
                error = refused(node, f"pinned-{step}", size, pinned_pod)
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (seed, error)
        assert_invariants(node)


def test_an_overwritten_cpuset_and_a_killed_process_are_seen_in_this_hierarchy(
    node: Node, topology: Topology
) -> None:
    """What only cpushim's watches on the guest's cgroup files can catch (v1 or v2): a
    pinned container's cpuset overwritten from outside is put back, and a pinned process
    killed from outside gives its CPUs back to the shared container, with no call from
    kubelet for either."""
    node.start()
    shared = node.run("besteffort", None, "besteffort")
    pinned = node.run("pinned", 1)
    cpus = assert_exclusive(topology, observe(pinned), 1)
    (cpuset_directory(pinned.pid) / "cpuset.cpus").write_text(str(topology.cpus))
    wait_for(
        lambda: observe(pinned).cpus_allowed == cpus,
        REACTION_TIMEOUT,
        "the overwritten cpuset put back",
        on_timeout=lambda: str(observe(pinned)),
    )
    assert_invariants(node)
    os.kill(pinned.pid, signal.SIGKILL)
    del node.running[pinned.name]  # its pod goes at the end, with the others
    wait_for(
        lambda: observe(shared).cpus_allowed == topology.cpus and node.checkpoint() == {},
        REACTION_TIMEOUT,
        "the killed container's CPU back in the shared pool",
        on_timeout=lambda: f"{observe(shared)}, checkpoint {node.checkpoint()}",
    )
    assert_invariants(node)


def systemctl(*arguments: str) -> str:
    done = subprocess.run(
        ["systemctl", *arguments], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"systemctl {' '.join(arguments)}: {done.stderr}"
    return done.stdout


def scope_of(running: Running) -> str:
    return cpuset_directory(running.pid).name


def systemd_record(running: Running, name: str) -> CPUSet:
    """A property (``AllowedCPUs``, ``AllowedMemoryNodes``) of the container's scope, as
    systemd holds it and writes it again into the cgroup at every daemon-reload."""
    shown = systemctl("show", "--value", "--property", name, scope_of(running))
    return CPUSet.parse(shown.strip().replace(" ", ","))


def records(node: Node, running: Running) -> dict[str, CPUSet]:
    """Every record of the container's cpuset besides the kernel's: the runtime's (its OCI
    spec) and, with the systemd driver, systemd's."""
    held = {"runtime": CPUSet.parse(node.kubelet.recorded_cpuset_cpus(running.container_id))}
    if node.topology.cgroup_driver == "systemd":
        held["systemd"] = systemd_record(running, "AllowedCPUs")
    return held


def test_the_records_follow_every_move_and_re_applying_them_changes_nothing(
    node: Node, topology: Topology
) -> None:
    """cpushim moves a shared container by writing its cgroup, then has the runtime record
    the move (UpdateContainerResources; runc then sets the scope's AllowedCPUs when systemd
    is the driver). A record left behind would undo the move whenever it is applied again:
    systemd writes every unit's settings into its cgroup at each daemon-reload (package
    upgrades and node set-up run one). With the cgroupfs driver only the runtime's record
    exists, and nothing re-applies it."""
    systemd = topology.cgroup_driver == "systemd"
    node.start()
    shared = node.run("besteffort", None, "besteffort")
    pinned = node.run("pinned", 1)
    cpus = assert_exclusive(topology, observe(pinned), 1)
    assert observe(shared).cpus_allowed == topology.cpus - cpus

    def settled(*expected: tuple[Running, CPUSet]) -> None:
        """The kernel and every record say what ``expected`` pairs with each container, and
        still do after a reload."""

        def agreed() -> bool:
            return all(
                observe(running).cpus_allowed == want
                and set(records(node, running).values()) == {want}
                for running, want in expected
            )

        wait_for(
            agreed,
            REACTION_TIMEOUT,
            "the kernel and the records to agree",
            on_timeout=lambda: "; ".join(
                f"{running.name}: {observe(running)}, records {records(node, running)}"
                for running, _ in expected
            ),
        )
        if systemd:
            repairs = [node.repairs(running) for running, _ in expected]
            systemctl("daemon-reload")
            assert agreed()
            assert [node.repairs(running) for running, _ in expected] == repairs
        assert_invariants(node)

    settled((shared, topology.cpus - cpus), (pinned, cpus))
    if systemd:
        # Really the systemd driver: a scope of the pod's slice, named as kubelet names it.
        pod_slice = expand_slice(shared.sandbox.config.linux.cgroup_parent)
        scope = f"cri-containerd-{shared.container_id}.scope"
        assert cpuset_directory(shared.pid) == CGROUP_ROOT / pod_slice / scope
        assert systemd_record(pinned, "AllowedMemoryNodes") == nodes_of(topology, cpus)
        # systemd told from outside to put the shared container on every CPU, as a stale
        # record re-applied would: the cgroup and systemd's record are put back.
        repairs = node.repairs(shared)
        systemctl("set-property", "--runtime", scope, f"AllowedCPUs={topology.cpus}")
        wait_for(
            lambda: node.repairs(shared) > repairs,
            REACTION_TIMEOUT,
            "cpushim to see the shared container's cpuset changed by systemd",
        )
        settled((shared, topology.cpus - cpus), (pinned, cpus))
    node.stop(pinned)
    settled((shared, topology.cpus))


# Scenarios with policy options last: each options set needs a cpushim of its own.


def test_full_pcpus_only_takes_whole_cores_and_refuses_an_odd_request_on_smt(
    node: Node, topology: Topology
) -> None:
    kubelet = node.start("full-pcpus-only")
    if topology.smt:
        pod = node.pod("pinned", "guaranteed")
        error = refused(node, "odd", 3, pod)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert "SMT alignment" in str(error.details()), error.details()
        # Nothing of the refused container was created.
        assert not kubelet.list_containers().containers
        even = assert_exclusive(topology, observe(node.run("even", 4, pod=pod)), 4)
        for cpu in even:
            assert topology.core_cpus(topology.core_of(cpu)).issubset(even), f"{even} splits a core"
    else:
        # Without SMT every core is one CPU: an odd request is whole cores already.
        assert_exclusive(topology, observe(node.run("odd", 3)), 3)
    assert_invariants(node)


def test_distribute_cpus_across_numa_spreads_evenly_over_the_fewest_nodes(
    node: Node, topology: Topology
) -> None:
    allocatable = len(topology.cpus - topology.reserved)
    # More than one NUMA node holds, when the machine has more than one.
    count = min(topology.cpus_per_numa_node + 2, allocatable - 1)
    node.start("distribute-cpus-across-numa")
    cpus = assert_exclusive(topology, observe(node.run("spread", count)), count)
    per_node = [len(cpus & topology.numa_node_cpus(n)) for n in range(topology.numa_node_count)]
    used = [n for n in per_node if n]
    fewest = 1 if count <= topology.cpus_per_numa_node else 2
    assert len(used) == fewest, f"{cpus}: per node {per_node}"
    assert max(used) - min(used) <= 1, f"{cpus} is not spread evenly: per node {per_node}"
    assert_invariants(node)


# Last of all: under cgroup v1 a CPU taken offline leaves every cgroup outside kubelet's tree
# (containerd's, the guest's services) without it for the rest of the guest's life.


def on_pool(running: Running, pool: CPUSet, log: Callable[[], str]) -> None:
    wait_for(
        lambda: observe(running).cpus_allowed == pool,
        REACTION_TIMEOUT,
        f"{running.name} on {pool}",
        on_timeout=lambda: f"{observe(running)}\n{log()}",
    )


def test_a_cpu_gone_offline_is_replaced_and_given_back_once_online(
    node: Node, topology: Topology
) -> None:
    """The guest's kernel takes one of a pinned container's CPUs offline: cpushim hears it
    (a uevent) and re-plans, the container gets a whole set again, the shared pool and the
    containers created after leave the CPU out (under v1 runc refuses a set naming it);
    back online, the CPU returns to the pool (under v1 only once cpushim has given it back
    to kubelet's cgroups, as the kernel restores it to the root cpuset alone)."""
    node.start()
    shared = node.run("besteffort", None, "besteffort")
    pinned = node.run("pinned", 2)
    before = assert_exclusive(topology, observe(pinned), 2)
    cpu = before.max()
    online = Path(f"/sys/devices/system/cpu/cpu{cpu}/online")

    def cpushim_log() -> str:
        return node.process.log()[-6000:] if node.process is not None else ""

    online.write_text("0")
    try:
        up = topology.cpus - CPUSet([cpu])

        def replaced() -> bool:
            seen = observe(pinned)
            return (
                len(seen.cpus_allowed) == 2
                and seen.cpus_allowed == seen.cgroup_cpus
                and seen.cpus_allowed.issubset(up)
            )

        wait_for(
            replaced,
            REACTION_TIMEOUT,
            f"the pinned container off CPU {cpu}",
            on_timeout=lambda: f"{observe(pinned)}\n{cpushim_log()}",
        )
        now = assert_exclusive(topology, observe(pinned), 2)
        pool = up - now
        on_pool(shared, pool, cpushim_log)
        late = node.run("late", None, "burstable")
        assert observe(late).cpus_allowed == pool
        assert node.checkpoint() == {"pinned": now}
    finally:
        online.write_text("1")
    pool = topology.cpus - now
    for running in (shared, late):
        on_pool(running, pool, cpushim_log)
    after = node.run("after", None, "besteffort")
    assert observe(after).cpus_allowed == pool
    assert_invariants(node)
