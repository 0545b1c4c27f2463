"""kubelet's memory manager: the NUMA nodes its Static policy puts in a CreateContainer's
``cpuset_mems`` steer an exclusive container's CPUs and stay its memory nodes, through the
checkpoint, a restart and a re-plan. The fake machine's node 0 holds CPUs 0,1,4,5 and node 1
holds CPUs 2,3,6,7 (tests/unit/engine_env.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from grpclib.const import Status as GrpcStatus
from prometheus_client.parser import text_string_to_metric_families

from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Status
from shim.engine.resync import adopt_sharing
from shim.engine.tracked import Phase
from shim.metrics import Metrics
from shim.pods import ANNOTATION_ISOLATED, MemoryNodesError, kubelet_memory_nodes
from shim.policy.none import NonePolicy
from shim.policy.static import StaticPolicy
from shim.state import (
    Assignment,
    ContainerKey,
    CPUState,
    KubeletMems,
    decode_checkpoint,
    encode_checkpoint,
    integrity_problems,
)
from shim.topology import Topology
from tests.fake_runtime import FakeRuntime
from tests.harness.sysfs import MachineSpec, expected_topology
from tests.unit.engine_env import (
    FIRST_SINGLE,
    GIB,
    TOPOLOGY,
    Env,
    Pod,
    assert_consistent,
    env,
    make_env,
    static_policy,
    until,
    updates_to,
)

pytestmark = pytest.mark.anyio
__all__ = ["env"]  # the fixture

NODE_1 = CPUSet.parse("2-3,6-7")


# --- what kubelet sent ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mems", "nodes"),
    [("", None), ("  ", None), ("1", "1"), ("0,1", "0-1"), ("0-1", "0-1"), ("0,2", "0,2")],
)
def test_kubelets_memory_nodes_are_read_from_cpuset_mems(mems: str, nodes: str | None) -> None:
    """Node 2 has no CPU on the fake machine: a memory-only node (CXL memory, HBM) is one
    kubelet may name, and the kernel, not the CPU topology, knows which exist."""
    resources = pb.LinuxContainerResources(cpuset_mems=mems)
    found = kubelet_memory_nodes(resources)
    assert found == (CPUSet.parse(nodes) if nodes is not None else None)


@pytest.mark.parametrize("mems", ["one", "1-0", "0,,1", "-1"])
def test_memory_nodes_that_do_not_parse_are_refused(mems: str) -> None:
    resources = pb.LinuxContainerResources(cpuset_mems=mems)
    with pytest.raises(MemoryNodesError, match=f"cpuset_mems '{mems}' is not a list of NUMA"):
        kubelet_memory_nodes(resources)


# --- the checkpoint ------------------------------------------------------------------------


def state_with(mems: CPUSet | None) -> CPUState:
    policy = static_policy()
    assignment = Assignment(CPUSet.parse("2"), "c1", "s1", 0, "default/db", mems)
    return CPUState.empty(policy).assign(ContainerKey("uid", "main"), assignment, policy)


def test_the_checkpoint_keeps_kubelets_memory_nodes() -> None:
    state = state_with(CPUSet.parse("1"))
    data = encode_checkpoint(state)
    assert orjson.loads(data)["body"]["assignments"]["uid"]["main"]["mems"] == "1"
    assert decode_checkpoint(data) == state


def test_a_checkpoint_without_memory_nodes_is_written_as_before() -> None:
    """No key at all when kubelet chose none: what earlier versions wrote, and can read back
    after a rollback."""
    data = encode_checkpoint(state_with(None))
    assert "mems" not in orjson.loads(data)["body"]["assignments"]["uid"]["main"]
    assert decode_checkpoint(data).assignments[ContainerKey("uid", "main")].mems is None


def test_an_empty_list_of_memory_nodes_is_an_integrity_problem() -> None:
    assert integrity_problems(state_with(CPUSet.parse("1")), TOPOLOGY) == []
    assert integrity_problems(state_with(CPUSet()), TOPOLOGY) == [
        "uid/main has an empty list of memory nodes"
    ]


# --- the engine ----------------------------------------------------------------------------


async def create(env: Env, pod: Pod, mems: str, name: str = "main", attempt: int = 0) -> str:
    """kubelet's CreateContainer for a 1-CPU container with its memory manager's nodes."""
    request = env.kubelet.create_request(pod, name, 1000, attempt)
    request.config.linux.resources.cpuset_mems = mems
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK, reply.status_message
    return pb.CreateContainerResponse.FromString(reply.messages[0]).container_id


async def test_an_exclusive_container_gets_cpus_and_memory_on_kubelets_node(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "1")
    resources = env.fake.containers[container_id].resources
    assert CPUSet.parse(resources.cpuset_cpus).issubset(NODE_1)
    assert len(CPUSet.parse(resources.cpuset_cpus)) == 1
    assert resources.cpuset_mems == "1"
    await env.engine.checkpoint_written()
    assert env.engine.checkpoint.load() == env.engine.state
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].mems == CPUSet.parse("1")
    assert_consistent(env)


async def test_without_kubelets_nodes_memory_follows_the_cpus(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "")
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == (FIRST_SINGLE, "0")
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].mems is None


async def test_a_full_node_gives_cpus_elsewhere_and_memory_stays_where_kubelet_put_it(
    env: Env,
) -> None:
    """The nodes are a hint for the CPUs (as the topology manager's is to kubelet's CPU
    manager), and the memory manager's decision for the memory."""
    filler = await env.kubelet.run_pod("filler", "guaranteed")
    ids = [await create(env, filler, "1", name=f"c{index}") for index in range(4)]
    assert CPUSet().union(*(CPUSet.parse(env.cpus(i)) for i in ids)) == NODE_1
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "1")
    resources = env.fake.containers[container_id].resources
    assert CPUSet.parse(resources.cpuset_cpus).issubset(CPUSet.parse("1,4-5"))
    assert resources.cpuset_mems == "1"
    assert_consistent(env)


async def test_memory_nodes_that_do_not_parse_are_refused_and_nothing_is_created(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    request = env.kubelet.create_request(pod, "main", 1000)
    request.config.linux.resources.cpuset_mems = "one"
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.INVALID_ARGUMENT
    assert "pod default/db container main: cpuset_mems 'one'" in reply.status_message
    assert env.fake.calls_of("CreateContainer") == []
    assert env.engine.state.assignments == {}
    assert env.engine.counters["bad_memory_nodes"] == 1


async def test_kubelets_nodes_survive_a_restart_and_steer_a_replan(env: Env) -> None:
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("web", "besteffort"), "main")
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "1")
    await env.engine.checkpoint_written()
    held = env.cpus(container_id)
    # Its CPU becomes reserved: the re-plan gives it another, from node 1 again.
    await env.restart(static_policy(reserved=f"0,{held}"))
    resources = env.fake.containers[container_id].resources
    assert resources.cpuset_cpus != held
    assert CPUSet.parse(resources.cpuset_cpus).issubset(NODE_1)
    assert resources.cpuset_mems == "1"
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].mems == CPUSet.parse("1")
    assert env.cpus(shared_id) == str(env.engine.state.shared)
    assert_consistent(env)
    # And a plain restart keeps them as they are.
    await env.restart()
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].mems == CPUSet.parse("1")
    tracked = env.engine.containers[container_id]
    assert env.engine._desired(tracked)[1] == "1"


async def test_a_reload_replan_is_steered_by_kubelets_nodes(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "1")
    held = env.cpus(container_id)
    lost = await env.engine.change_policy(static_policy(reserved=f"0,{held}"))
    assert lost == []
    resources = env.fake.containers[container_id].resources
    assert resources.cpuset_cpus != held
    assert CPUSet.parse(resources.cpuset_cpus).issubset(NODE_1)
    assert resources.cpuset_mems == "1"
    assert_consistent(env)


async def test_a_reload_replan_keeps_an_isolated_container_on_isolated_cpus(
    tmp_path: Path,
) -> None:
    topology = expected_topology(
        MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2, isolated=frozenset({3, 7}))
    )
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path, StaticPolicy.create(topology, reserved=CPUSet([0])))
        pod = await env.kubelet.run_pod("rt", "guaranteed", {ANNOTATION_ISOLATED: "prefer"})
        container_id = await env.kubelet.start_new(pod, "main", 1000)
        held = env.cpus(container_id)
        assert held in ("3", "7")
        await env.engine.change_policy(
            StaticPolicy.create(topology, reserved=CPUSet.parse(f"0,{held}"))
        )
        assert env.cpus(container_id) in ("3", "7")
        assert env.cpus(container_id) != held
        env.channel.close()


async def test_kubelets_update_keeps_its_memory_nodes(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "1")
    request = pb.UpdateContainerResourcesRequest(
        container_id=container_id,
        linux=pb.LinuxContainerResources(
            cpu_shares=1024, memory_limit_in_bytes=2 * GIB, cpuset_cpus="0-7", cpuset_mems="0-1"
        ),
    )
    await env.kubelet.ok("UpdateContainerResources", request.SerializeToString())
    resources = env.fake.containers[container_id].resources
    assert resources.memory_limit_in_bytes == 2 * GIB
    assert CPUSet.parse(resources.cpuset_cpus).issubset(NODE_1)
    assert resources.cpuset_mems == "1"


async def test_the_next_attempt_keeps_its_cpus_and_takes_the_new_requests_nodes(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    first = await create(env, pod, "1")
    await env.kubelet.stop(first)
    again = await create(env, pod, "0-1", attempt=1)
    assert env.cpus(again) == env.cpus(first)
    assert env.fake.containers[again].resources.cpuset_mems == "0-1"
    assert env.engine.state.assignments[ContainerKey(pod.uid, "main")].mems == CPUSet.parse("0-1")


async def test_under_the_none_policy_kubelets_nodes_survive_a_restart(env: Env) -> None:
    """Narrowed memory nodes are no mark of cpushim's when the cpuset spans more nodes: kubelet's
    memory manager chose them for a container on the shared pool."""
    await env.restart(NonePolicy(TOPOLOGY))
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "1")
    assert env.fake.containers[container_id].resources.cpuset_mems == "1"
    await env.restart()
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-7", "1")


async def sharing_on_node_0(env: Env, keep_quota: bool) -> str:
    """A container that asks for exclusive CPUs and shares (none were free when a restart
    adopted it), its memory on node 0 by kubelet's memory manager, on a shared pool that lies
    within node 0 (node 1 is all exclusive): its nodes are exactly those of the CPUs it runs
    on, and narrower than all of them."""
    filler = await env.kubelet.run_pod("filler", "guaranteed")
    for index in range(4):
        await create(env, filler, "1", name=f"c{index}")
    annotations = {"cpushim.io/cfs-quota": "keep"} if keep_quota else {}
    pod = await env.kubelet.run_pod("db", "guaranteed", annotations)
    # Made while cpushim was down: 4 CPUs, and only 1,4,5 are free.
    request = env.kubelet.create_request(pod, "main", 4000)
    request.config.linux.resources.cpuset_mems = "0"
    container_id = env.fake.add_container(pod.sandbox_id, request.config)
    await env.restart()
    assert ContainerKey(pod.uid, "main") not in env.engine.state.assignments
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == (str(env.engine.state.shared), "0")
    return container_id


@pytest.mark.parametrize("keep_quota", [False, True], ids=["quota removed", "quota kept"])
async def test_kubelets_nodes_of_a_container_sharing_a_pool_within_one_node_survive_a_restart(
    env: Env, keep_quota: bool
) -> None:
    """It never held exclusive CPUs: a restart must leave kubelet's nodes alone."""
    container_id = await sharing_on_node_0(env, keep_quota)
    await env.restart()  # an upgrade, say: nothing changed meanwhile
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-1,4-5", "0")
    assert resources.cpu_quota == 400_000
    assert not env.engine.containers[container_id].exclusive


async def test_kubelets_nodes_of_a_sharing_container_survive_a_pool_grown_meanwhile(
    env: Env,
) -> None:
    """A container of node 0 went while cpushim was down, so the pool is no longer the set
    the sharing one runs on: kubelet's quota, which cpushim drops from a container it pins
    (its pod does not keep it), still says it never held exclusive CPUs."""
    other = await create(env, await env.kubelet.run_pod("other", "guaranteed"), "0")
    container_id = await sharing_on_node_0(env, keep_quota=False)
    assert env.cpus(container_id) == "0-1,5"
    del env.fake.containers[other]
    await env.restart()
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-1,4-5", "0")
    assert resources.cpu_quota == 400_000


@pytest.mark.parametrize("keep_quota", [False, True], ids=["quota removed", "quota kept"])
async def test_a_switch_to_none_gives_back_kubelets_nodes_not_every_node(
    env: Env, keep_quota: bool
) -> None:
    """A container that loses its exclusive CPUs gets kubelet's settings back: the memory
    manager's nodes among them, known from the checkpoint; and they stay at the next restart
    (narrowed nodes on the whole shared pool are no mark of cpushim's)."""
    annotations = {"cpushim.io/cfs-quota": "keep"} if keep_quota else {}
    pod = await env.kubelet.run_pod("db", "guaranteed", annotations)
    container_id = await create(env, pod, "1")
    await env.engine.checkpoint_written()
    await env.restart(NonePolicy(TOPOLOGY))
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-7", "1")
    assert resources.cpu_quota == 100_000
    await env.restart()
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-7", "1")


async def test_a_reload_to_none_gives_back_kubelets_nodes(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "1")
    lost = await env.engine.change_policy(NonePolicy(TOPOLOGY))
    assert lost == [ContainerKey(pod.uid, "main")]
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-7", "1")


async def test_a_container_adopted_again_at_a_reload_keeps_kubelets_nodes(env: Env) -> None:
    """The memory manager put its memory on both nodes (it fits on neither alone): the
    runtime's record, equal to the shared pool's nodes, cannot tell that from no choice."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "0-1")
    key = ContainerKey(pod.uid, "main")
    held = env.cpus(container_id)
    lost = await env.engine.change_policy(static_policy(reserved=f"0,{held}"))
    assert lost == []  # another CPU: its nodes stay kubelet's
    assert env.engine.state.assignments[key].mems == CPUSet.parse("0-1")
    lost = await env.engine.change_policy(NonePolicy(TOPOLOGY))  # none: it shares
    assert lost == [key]
    assert env.fake.containers[container_id].resources.cpuset_mems == "0-1"
    await env.engine.change_policy(static_policy())
    assert await adopt_sharing(env.engine) == [key]
    assert env.engine.state.assignments[key].mems == CPUSet.parse("0-1")
    assert env.fake.containers[container_id].resources.cpuset_mems == "0-1"
    assert_consistent(env)


async def test_memory_nodes_refused_leave_the_earlier_attempt_as_it_was(env: Env) -> None:
    """A refused create changes nothing: the earlier attempt, which cpushim has not seen
    exit yet, is still watched, so its exit gives its CPUs back when it comes."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    first = await env.kubelet.start_new(pod, "main", 1000)
    request = env.kubelet.create_request(pod, "main", 1000, attempt=1)
    request.config.linux.resources.cpuset_mems = "one"
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.INVALID_ARGUMENT
    assert env.engine.containers[first].phase is Phase.RUNNING
    env.fake.exit_container(first, 1)
    await env.engine.container_exited(first)  # what the watcher calls when it sees the exit
    assert env.engine.state.assignments == {}
    assert env.saved() == {}
    assert_consistent(env)


# --- every node: a node with memory and no CPU ---------------------------------------------

# The fake machine with node 2 holding memory and no CPU (CXL memory), as the kernel's
# has_memory tells: a container kubelet creates gets nodes 0-2, and so must one cpushim gives
# every node.
WITH_CXL = Topology(
    cpus=TOPOLOGY.cpus, isolated=TOPOLOGY.isolated, memory_nodes=CPUSet.parse("0-2")
)


@contextlib.asynccontextmanager
async def env_on(machine: Topology, tmp_path: Path) -> AsyncIterator[Env]:
    """The engine with the static policy, CPU 0 reserved, on ``machine``'s memory nodes."""
    async with FakeRuntime() as fake:
        policy = StaticPolicy.create(machine, reserved=CPUSet([0]))
        environment = await make_env(fake, tmp_path / "state", policy)
        yield environment
        environment.channel.close()


@pytest.fixture
async def cxl_env(tmp_path: Path) -> AsyncIterator[Env]:
    async with env_on(WITH_CXL, tmp_path) as environment:
        yield environment


async def test_a_memory_only_node_is_passed_on_and_does_not_steer_the_cpus(
    cxl_env: Env,
) -> None:
    pod = await cxl_env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(cxl_env, pod, "2")
    resources = cxl_env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == (FIRST_SINGLE, "2")


async def test_an_exclusive_containers_memory_still_follows_its_cpus(cxl_env: Env) -> None:
    pod = await cxl_env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(cxl_env, pod, "")
    resources = cxl_env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == (FIRST_SINGLE, "0")


async def test_a_container_that_loses_its_cpus_gets_the_memory_only_node_too(
    cxl_env: Env,
) -> None:
    pod = await cxl_env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(cxl_env, pod, "")
    lost = await cxl_env.engine.change_policy(NonePolicy(WITH_CXL))
    assert lost == [ContainerKey(pod.uid, "main")]
    resources = cxl_env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-7", "0-2")
    assert cxl_env.engine.containers[container_id].shared_mems is None


@pytest.mark.parametrize("keep_quota", [False, True], ids=["quota removed", "quota kept"])
async def test_at_a_restart_the_memory_only_node_tells_exclusive_settings_apart(
    cxl_env: Env, keep_quota: bool
) -> None:
    """An exclusive container on CPUs of both nodes has memory nodes 0-1: every node with a
    CPU, and still narrower than every node with memory, so a restart that finds it sharing
    (here: a switch to none) knows it by them, and gives it every node back, node 2 among
    them. The next restart takes those for every node: no mark, no narrowing of its own."""
    env = cxl_env
    annotations = {"cpushim.io/cfs-quota": "keep"} if keep_quota else {}
    pod = await env.kubelet.run_pod("db", "guaranteed", annotations)
    request = env.kubelet.create_request(pod, "main", 6000)
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK, reply.status_message
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    resources = env.fake.containers[container_id].resources
    assert len(CPUSet.parse(resources.cpuset_cpus)) == 6
    assert resources.cpuset_mems == "0-1"
    await env.engine.checkpoint_written()
    await env.restart(NonePolicy(WITH_CXL))
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-7", "0-2")
    assert resources.cpu_quota == 600_000
    await env.restart()
    tracked = env.engine.containers[container_id]
    assert not tracked.exclusive
    assert tracked.shared_mems is None  # its projection says every node
    assert env.fake.containers[container_id].resources.cpuset_mems == "0-2"


# --- a node with CPUs and no memory --------------------------------------------------------

# The fake machine with node 1's memory gone (a memory-less node, as some firmware and
# partitioned machines show): the kernel refuses a cpuset.mems that names node 1.
NODE_1_WITHOUT_MEMORY = Topology(
    cpus=TOPOLOGY.cpus, isolated=TOPOLOGY.isolated, memory_nodes=CPUSet.parse("0")
)


@pytest.mark.parametrize(
    ("cpus", "nodes"),
    [("4", "0"), ("2-3", "0"), ("3-4", "0")],
    ids=["node with memory", "memory-less node", "both"],
)
def test_the_memory_nodes_of_cpus_are_their_nodes_that_have_memory(cpus: str, nodes: str) -> None:
    assert NODE_1_WITHOUT_MEMORY.memory_nodes_of(CPUSet.parse(cpus)) == CPUSet.parse(nodes)
    # On the machine whose every node has memory, they are the CPUs' own nodes.
    assert TOPOLOGY.memory_nodes_of(CPUSet.parse(cpus)) == CPUSet(
        TOPOLOGY.numa_nodes_of(CPUSet.parse(cpus))
    )


@pytest.mark.parametrize(
    ("chosen", "nodes"), [("0", "0"), ("0-1", "0"), ("1", "0")], ids=["all", "some", "none"]
)
def test_kubelets_nodes_are_narrowed_to_those_with_memory(chosen: str, nodes: str) -> None:
    """Node 1 lost its memory: of the nodes kubelet chose, those with memory, else every node
    with memory."""
    found = NODE_1_WITHOUT_MEMORY.memory_nodes_within(CPUSet.parse(chosen))
    assert found == CPUSet.parse(nodes)


def test_cpus_of_memory_less_nodes_only_go_with_every_node_with_memory() -> None:
    machine = Topology(cpus=TOPOLOGY.cpus, memory_nodes=CPUSet.parse("0,2"))
    assert machine.memory_nodes_of(NODE_1) == CPUSet.parse("0,2")


@pytest.fixture
async def memory_less_env(tmp_path: Path) -> AsyncIterator[Env]:
    async with env_on(NODE_1_WITHOUT_MEMORY, tmp_path) as environment:
        yield environment


@pytest.mark.parametrize(("millicpus", "mems"), [(4000, "0"), (7000, "0")], ids=["node 1", "both"])
async def test_an_exclusive_container_on_a_memory_less_node_gets_memory_the_kernel_takes(
    memory_less_env: Env, millicpus: int, mems: str
) -> None:
    """Four CPUs fill node 1, whose CPUs have no memory of their own; seven span both nodes.
    Either way its cpuset.mems names only nodes with memory, and a restart finds it holding
    its CPUs with nothing to put right."""
    env = memory_less_env
    pod = await env.kubelet.run_pod("db", "guaranteed")
    request = env.kubelet.create_request(pod, "main", millicpus)
    reply = await env.kubelet.call("CreateContainer", request.SerializeToString())
    assert reply.status is Status.OK, reply.status_message
    container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
    resources = env.fake.containers[container_id].resources
    cpus = CPUSet.parse(resources.cpuset_cpus)
    if millicpus == 4000:
        assert cpus == NODE_1
    assert len(cpus) == millicpus // 1000
    assert resources.cpuset_mems == mems
    await env.engine.checkpoint_written()
    updates = len(env.fake.calls_of("UpdateContainerResources"))
    await env.restart()
    tracked = env.engine.containers[container_id]
    assert tracked.exclusive
    assert not tracked.settings_stale
    assert len(env.fake.calls_of("UpdateContainerResources")) == updates
    assert env.fake.containers[container_id].resources.cpuset_mems == mems
    assert_consistent(env)


@pytest.mark.parametrize("keep_quota", [False, True], ids=["quota removed", "quota kept"])
async def test_a_container_on_a_memory_less_node_is_recovered_from_the_runtime_as_it_was(
    memory_less_env: Env, keep_quota: bool
) -> None:
    env = memory_less_env
    annotations = {"cpushim.io/cfs-quota": "keep"} if keep_quota else {}
    pod = await env.kubelet.run_pod("db", "guaranteed", annotations)
    container_id = await env.kubelet.start_new(pod, "main", 4000)
    await env.engine.checkpoint_written()
    updates = len(env.fake.calls_of("UpdateContainerResources"))
    await env.restart(recover=True)
    tracked = env.engine.containers[container_id]
    assert tracked.exclusive
    assert env.saved() == {pod.uid: {"main": str(NODE_1)}}
    assert tracked.kubelet_mems is None
    assert len(env.fake.calls_of("UpdateContainerResources")) == updates
    assert env.fake.containers[container_id].resources.cpuset_mems == "0"
    assert_consistent(env)


# Node 1 with CPUs and no memory, node 2 with memory and no CPU: every node with memory is 0,2.
MEMORY_LESS_AND_MEMORY_ONLY = Topology(
    cpus=TOPOLOGY.cpus, isolated=TOPOLOGY.isolated, memory_nodes=CPUSet.parse("0,2")
)


@pytest.fixture
async def mixed_env(tmp_path: Path) -> AsyncIterator[Env]:
    async with env_on(MEMORY_LESS_AND_MEMORY_ONLY, tmp_path) as environment:
        yield environment


async def test_at_a_restart_memory_nodes_beside_a_memory_less_node_mark_exclusive_settings(
    mixed_env: Env,
) -> None:
    """Six CPUs span node 0 and the memory-less node 1: their memory nodes are node 0 alone,
    narrower than every node with memory. With the quota kept they are the only mark, so a
    restart that finds the container sharing (here: a switch to none) knows it by them and
    gives it every node with memory back, not node 0 alone for good."""
    env = mixed_env
    pod = await env.kubelet.run_pod("db", "guaranteed", {"cpushim.io/cfs-quota": "keep"})
    container_id = await env.kubelet.start_new(pod, "main", 6000)
    resources = env.fake.containers[container_id].resources
    assert CPUSet.parse(resources.cpuset_cpus) & NODE_1
    assert resources.cpuset_mems == "0"
    await env.engine.checkpoint_written()
    await env.restart(NonePolicy(MEMORY_LESS_AND_MEMORY_ONLY))
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-7", "0,2")
    assert resources.cpu_quota == 600_000
    assert env.engine.containers[container_id].shared_mems is None


# --- kubelet's nodes that lost their memory ------------------------------------------------

NARROWED = (
    "memory nodes chosen for a container (by kubelet's memory manager, or an update that names"
    " them) have no memory now"
)


@pytest.mark.parametrize(("chosen", "mems"), [("1", "0"), ("0-1", "0")], ids=["none", "one"])
async def test_a_create_naming_a_node_without_memory_gets_those_with_memory(
    memory_less_env: Env, caplog: pytest.LogCaptureFixture, chosen: str, mems: str
) -> None:
    """kubelet's memory manager names node 1, whose memory went offline since it chose it:
    the kernel would refuse it in cpuset.mems (the fake runtime's start too), so the create
    carries those of kubelet's nodes that have memory, else every node with memory, for a
    pinned and a sharing container alike; kubelet's choice stays recorded, told once each."""
    env = memory_less_env
    env.fake.memory_nodes = NODE_1_WITHOUT_MEMORY.memory_nodes
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned_pod, "main", 1000, mems=chosen)
    shared_pod = await env.kubelet.run_pod("cache", "burstable")
    shared_id = await env.kubelet.start_new(shared_pod, "main", 500, mems=chosen)
    assert CPUSet.parse(env.cpus(pinned_id)).issubset(NODE_1) == (chosen == "1")
    assert env.fake.containers[pinned_id].resources.cpuset_mems == mems
    assert env.fake.containers[shared_id].resources.cpuset_mems == mems
    key = ContainerKey(pinned_pod.uid, "main")
    assert env.engine.state.assignments[key].mems == CPUSet.parse(chosen)
    assert env.engine.containers[shared_id].shared_mems == CPUSet.parse(chosen)
    # A move of the pinned one (its CPU reserved now) carries them again, told no more.
    held = env.cpus(pinned_id)
    policy = StaticPolicy.create(NODE_1_WITHOUT_MEMORY, reserved=CPUSet.parse(f"0,{held}"))
    assert await env.engine.change_policy(policy) == []
    assert env.cpus(pinned_id) != held
    assert env.fake.containers[pinned_id].resources.cpuset_mems == mems
    assert await env.engine._apply_again()
    assert caplog.text.count(NARROWED) == 2


def narrowed_gauge(env: Env) -> float:
    """What /metrics says of the containers whose memory nodes are narrowed now."""
    metrics = Metrics(env.engine)
    metrics.state_loaded = True
    text = metrics.render().decode()
    name = "cpushim_memory_narrowed_containers"
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return family.samples[0].value


async def test_a_gauge_counts_the_containers_whose_nodes_are_narrowed_now(
    memory_less_env: Env,
) -> None:
    """The warning is told once per container; the gauge says how many there are for as
    long as it lasts: pinned or sharing, through a restart, none once node 1 has memory
    again. A container whose nodes all have memory, and one that exited, are not counted."""
    env = memory_less_env
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    await env.kubelet.start_new(pinned_pod, "main", 1000, mems="0-1")
    shared_pod = await env.kubelet.run_pod("cache", "burstable")
    await env.kubelet.start_new(shared_pod, "main", 500, mems="1")
    await env.kubelet.start_new(shared_pod, "sidecar", 500, mems="0")
    exited = await env.kubelet.start_new(shared_pod, "init", 500, mems="1")
    assert narrowed_gauge(env) == 3
    await env.kubelet.stop(exited)
    assert narrowed_gauge(env) == 2
    await env.engine.checkpoint_written()
    await env.restart()
    assert narrowed_gauge(env) == 2
    await env.engine.change_policy(static_policy())  # node 1's memory back
    assert narrowed_gauge(env) == 0


async def test_at_a_restart_kubelets_nodes_without_memory_are_narrowed(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 1's memory went offline while cpushim was down: the runtime's records of a pinned
    and a sharing container still name it, and the next update through the runtime that
    keeps them would be refused, again and again. Start-up writes the nodes with memory."""
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned_pod, "main", 1000, mems="1")
    shared_pod = await env.kubelet.run_pod("cache", "burstable")
    shared_id = await env.kubelet.start_new(shared_pod, "main", 500, mems="0-1")
    env.fake.memory_nodes = NODE_1_WITHOUT_MEMORY.memory_nodes
    await env.restart(StaticPolicy.create(NODE_1_WITHOUT_MEMORY, reserved=CPUSet([0])))
    assert env.fake.containers[pinned_id].resources.cpuset_mems == "0"
    assert env.fake.containers[shared_id].resources.cpuset_mems == "0"
    key = ContainerKey(pinned_pod.uid, "main")
    assert env.engine.state.assignments[key].mems == CPUSet.parse("1")
    assert env.engine.containers[shared_id].shared_mems == CPUSet.parse("0-1")
    assert not env.engine.containers[shared_id].settings_stale
    assert caplog.text.count(NARROWED) == 2
    # Any move through the runtime now goes through.
    for container_id in (pinned_id, shared_id):
        tracked = env.engine.containers[container_id]
        cpus = CPUSet.parse(env.cpus(container_id))
        assert (await env.engine.mover.update_through_runtime(tracked, cpus, "", None)).ok


async def test_a_sharing_container_adopted_while_narrowed_keeps_kubelets_nodes(
    memory_less_env: Env,
) -> None:
    """Created under none with kubelet's node 1, which has no memory now: it shares on node
    0's memory. Adopted at a reload to static, its assignment records node 1, which steers
    its CPUs, and its memory stays on node 0 until node 1 has memory again."""
    env = memory_less_env
    await env.engine.change_policy(NonePolicy(NODE_1_WITHOUT_MEMORY))
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000, mems="1")
    assert env.fake.containers[container_id].resources.cpuset_mems == "0"
    await env.engine.change_policy(StaticPolicy.create(NODE_1_WITHOUT_MEMORY, reserved=CPUSet([0])))
    key = ContainerKey(pod.uid, "main")
    assert await adopt_sharing(env.engine) == [key]
    assert env.engine.state.assignments[key].mems == CPUSet.parse("1")
    assert CPUSet.parse(env.cpus(container_id)).issubset(NODE_1)
    assert env.fake.containers[container_id].resources.cpuset_mems == "0"
    await env.engine.change_policy(static_policy())  # node 1's memory back
    assert env.fake.containers[container_id].resources.cpuset_mems == "1"


# --- kubelet's nodes of sharing containers across a restart ------------------------------


def test_the_checkpoint_keeps_kubelets_nodes_of_containers_given_cpushims() -> None:
    """Only when there are any, "" for none of kubelet's; they go with their pod."""
    web, cache = ContainerKey("uid-web", "main"), ContainerKey("uid-cache", "main")
    state = (
        state_with(None)
        .with_kubelet_mems(web, KubeletMems("c2", None))
        .with_kubelet_mems(cache, KubeletMems("c3", CPUSet.parse("1")))
    )
    data = encode_checkpoint(state)
    assert orjson.loads(data)["body"]["kubeletMems"] == {
        "uid-cache": {"main": {"container_id": "c3", "mems": "1"}},
        "uid-web": {"main": {"container_id": "c2", "mems": ""}},
    }
    assert decode_checkpoint(data) == state
    # What earlier versions wrote, and read back after a rollback (they ignore the key).
    earlier = encode_checkpoint(state_with(None))
    assert "kubeletMems" not in orjson.loads(earlier)["body"]
    assert decode_checkpoint(earlier).kubelet_mems == {}
    assert dict(state.keep_released({"uid", "uid-cache"}).kubelet_mems) == {
        cache: KubeletMems("c3", CPUSet.parse("1"))
    }


def recorded_mems(env: Env, container_id: str) -> str:
    return env.fake.containers[container_id].resources.cpuset_mems


async def test_kubelets_nodes_are_on_disk_before_the_runtime_gets_cpushims(env: Env) -> None:
    """A restart between the two would find the runtime's record holding cpushim's nodes and
    nothing saying they are not kubelet's."""
    container_id = await env.kubelet.start_new(await env.kubelet.run_pod("web", "besteffort"), "m")
    gate = env.fake.gate("UpdateContainerResources")
    replan = asyncio.create_task(
        env.engine.change_policy(StaticPolicy.create(NODE_1_WITHOUT_MEMORY, reserved=CPUSet([0])))
    )
    try:
        await until(lambda: bool(updates_to(env.fake, container_id)), "the update sent")
        saved = env.engine.checkpoint.load()
        assert saved is not None
        assert [m.container_id for m in saved.kubelet_mems.values()] == [container_id]
    finally:
        gate.set()
        await replan
    assert recorded_mems(env, container_id) == "0"


async def test_every_node_cpushim_gave_a_sharing_container_is_no_choice_of_kubelets(
    env: Env,
) -> None:
    """kubelet made it with no nodes; node 1's memory taken offline, cpushim named every node
    with memory (node 0) in its record. Node 1's memory back while cpushim was down, the
    restart gives it every node again: node 0 was never kubelet's choice."""
    container_id = await env.kubelet.start_new(await env.kubelet.run_pod("web", "besteffort"), "m")
    assert recorded_mems(env, container_id) == ""
    await env.engine.change_policy(StaticPolicy.create(NODE_1_WITHOUT_MEMORY, reserved=CPUSet([0])))
    assert recorded_mems(env, container_id) == "0"
    await env.engine.checkpoint_written()
    await env.restart(static_policy())
    assert recorded_mems(env, container_id) == "0-1"
    tracked = env.engine.containers[container_id]
    assert tracked.shared_mems is None
    assert not tracked.settings_stale


async def test_every_node_given_back_with_lost_cpus_is_no_choice_of_kubelets(env: Env) -> None:
    """Pinned with no nodes of kubelet's, then unpinned by a switch to none: every node with
    memory (0-1) went into its record. Node 2's memory came online while cpushim was down
    (CXL): the restart gives it every node, 0-2."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000)
    assert await env.engine.change_policy(NonePolicy(TOPOLOGY)) == [ContainerKey(pod.uid, "main")]
    assert recorded_mems(env, container_id) == "0-1"
    await env.engine.checkpoint_written()
    await env.restart(NonePolicy(WITH_CXL))
    assert recorded_mems(env, container_id) == "0-2"
    assert env.engine.containers[container_id].shared_mems is None


async def test_kubelets_nodes_of_a_sharing_container_outlive_a_restart_while_narrowed(
    env: Env,
) -> None:
    """kubelet put its memory on node 1, whose memory went offline: its record holds node 0.
    A restart meanwhile knows node 1 for kubelet's choice, which comes back with the memory."""
    pod = await env.kubelet.run_pod("cache", "burstable")
    container_id = await env.kubelet.start_new(pod, "main", 500, mems="1")
    await env.engine.change_policy(StaticPolicy.create(NODE_1_WITHOUT_MEMORY, reserved=CPUSet([0])))
    assert recorded_mems(env, container_id) == "0"
    await env.engine.checkpoint_written()
    await env.restart()
    tracked = env.engine.containers[container_id]
    assert tracked.shared_mems == CPUSet.parse("1")
    assert not tracked.settings_stale
    await env.engine.change_policy(static_policy())
    assert recorded_mems(env, container_id) == "1"


async def test_kubelets_nodes_of_a_create_narrowed_outlive_a_restart(
    memory_less_env: Env,
) -> None:
    env = memory_less_env
    pod = await env.kubelet.run_pod("cache", "burstable")
    container_id = await env.kubelet.start_new(pod, "main", 500, mems="1")
    assert recorded_mems(env, container_id) == "0"
    await env.restart()
    assert env.engine.containers[container_id].shared_mems == CPUSet.parse("1")


async def test_a_restart_tells_each_narrowed_container_once_and_no_move_tells_it_again(
    memory_less_env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 1, which kubelet chose for a pinned and a sharing container, has no memory: each
    was told once. A restart tells each once more, so its log names them, the sharing one
    too, whose runtime record holds node 0 already and which has nothing to move. A later
    memory change that moves both (node 2's memory comes online) tells neither again: node 1
    still has none, the same loss."""
    env = memory_less_env
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned_pod, "main", 1000, mems="1")
    shared_pod = await env.kubelet.run_pod("cache", "burstable")
    shared_id = await env.kubelet.start_new(shared_pod, "main", 500, mems="1")
    assert caplog.text.count(NARROWED) == 2
    await env.engine.checkpoint_written()
    await env.restart()
    assert caplog.text.count(NARROWED) == 4
    assert all(env.engine.containers[i].mems_narrowed for i in (pinned_id, shared_id))
    assert not env.engine.containers[shared_id].settings_stale
    with_node_2 = Topology(cpus=TOPOLOGY.cpus, memory_nodes=CPUSet.parse("0,2"))
    env.fake.memory_nodes = with_node_2.memory_nodes
    await env.engine.change_policy(StaticPolicy.create(with_node_2, reserved=CPUSet([0])))
    assert (recorded_mems(env, pinned_id), recorded_mems(env, shared_id)) == ("0,2", "0,2")
    assert caplog.text.count(NARROWED) == 4


async def test_kubelets_nodes_of_a_container_unpinned_as_cpushim_stopped_are_given_back(
    env: Env,
) -> None:
    """Unpinned by a restart under none, whose giving back of kubelet's settings the runtime
    refused: its record still holds cpushim's marks, and node 1, which is also its CPU's
    node with memory, so it cannot tell kubelet's choice. The next restart finds it in the
    checkpoint, and gives node 1 back, not every node."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await env.kubelet.start_new(pod, "main", 1000, mems="1")
    assert CPUSet.parse(env.cpus(container_id)).issubset(NODE_1)
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    unpinned = await env.restart(NonePolicy(TOPOLOGY))
    unpinned._move_retry.end()
    assert env.fake.containers[container_id].resources.cpu_quota == -1
    await env.restart()
    resources = env.fake.containers[container_id].resources
    assert (resources.cpuset_cpus, resources.cpuset_mems) == ("0-7", "1")
    assert resources.cpu_quota == 100_000


# --- updates that name memory nodes ------------------------------------------------------


def mems_update(container_id: str, mems: str) -> bytes:
    """An update naming memory nodes (kubelet's name none; ``crictl update --cpuset-mems``)."""
    request = pb.UpdateContainerResourcesRequest(
        container_id=container_id, linux=pb.LinuxContainerResources(cpuset_mems=mems)
    )
    return request.SerializeToString()


async def test_an_update_naming_a_node_without_memory_gets_those_with_memory(
    memory_less_env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """An update names node 1 for a sharing container, whose memory went offline: the kernel
    would refuse it (the fake runtime too), so the runtime gets node 0, told once. Node 1 is
    the container's choice from then on, as a create's would be: kept in the checkpoint
    before the runtime's record holds node 0, so a restart knows it, and given again once
    node 1 has memory."""
    env = memory_less_env
    env.fake.memory_nodes = NODE_1_WITHOUT_MEMORY.memory_nodes
    pod = await env.kubelet.run_pod("cache", "burstable")
    container_id = await env.kubelet.start_new(pod, "main", 500)
    await env.kubelet.ok("UpdateContainerResources", mems_update(container_id, "1"))
    assert recorded_mems(env, container_id) == "0"
    assert env.engine.containers[container_id].shared_mems == CPUSet.parse("1")
    saved = env.engine.checkpoint.load()
    assert saved is not None
    key = ContainerKey(pod.uid, "main")
    assert saved.kubelet_mems[key] == KubeletMems(container_id, CPUSet.parse("1"))
    assert caplog.text.count(NARROWED) == 1
    await env.restart()
    assert env.engine.containers[container_id].shared_mems == CPUSet.parse("1")
    env.fake.memory_nodes = TOPOLOGY.memory_nodes
    await env.engine.change_policy(static_policy())  # node 1's memory back
    assert recorded_mems(env, container_id) == "1"


async def test_memory_nodes_an_update_names_replace_those_of_the_create(
    memory_less_env: Env,
) -> None:
    """Created naming node 1, which has no memory now: it shares on node 0's memory, node 1
    kept as its choice. An update naming node 0 makes that its choice: no longer narrowed,
    and kept when node 1's memory comes back, across a restart too."""
    env = memory_less_env
    pod = await env.kubelet.run_pod("cache", "burstable")
    container_id = await env.kubelet.start_new(pod, "main", 500, mems="1")
    assert recorded_mems(env, container_id) == "0"
    await env.engine.checkpoint_written()
    await env.kubelet.ok("UpdateContainerResources", mems_update(container_id, "0"))
    tracked = env.engine.containers[container_id]
    assert tracked.shared_mems == CPUSet.parse("0")
    assert not tracked.mems_narrowed
    await env.restart()
    assert env.engine.containers[container_id].shared_mems == CPUSet.parse("0")
    await env.engine.change_policy(static_policy())  # node 1's memory back
    assert recorded_mems(env, container_id) == "0"


async def test_memory_nodes_of_an_update_the_runtime_refuses_are_not_kept(
    memory_less_env: Env,
) -> None:
    """Created naming node 1 (no memory now, so node 0's is used, node 1 kept as its choice
    in the checkpoint); an update naming node 0 that the runtime refuses leaves node 1 its
    choice, on disk too: a restart does not take the refused nodes for it."""
    env = memory_less_env
    pod = await env.kubelet.run_pod("cache", "burstable")
    container_id = await env.kubelet.start_new(pod, "main", 500, mems="1")
    await env.engine.checkpoint_written()
    key = ContainerKey(pod.uid, "main")
    kept = KubeletMems(container_id, CPUSet.parse("1"))
    assert env.engine.state.kubelet_mems[key] == kept
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.INTERNAL, "runc says no")
    reply = await env.kubelet.call("UpdateContainerResources", mems_update(container_id, "0"))
    assert reply.status is Status.INTERNAL
    assert env.engine.containers[container_id].shared_mems == CPUSet.parse("1")
    await env.engine.checkpoint_written()
    saved = env.engine.checkpoint.load()
    assert saved is not None
    assert saved.kubelet_mems[key] == kept
    await env.restart()
    assert env.engine.containers[container_id].shared_mems == CPUSet.parse("1")


async def test_an_update_names_the_nodes_an_adoption_gives_a_container_that_lost_its_cpus(
    env: Env,
) -> None:
    """Pinned on kubelet's node 1, then unpinned by a switch to none: it shares on node 1's
    memory, kept as its choice. An update naming node 0 makes that its choice, so the
    adoption that pins it again gives it node 0, as it would after a restart, not node 1."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    container_id = await create(env, pod, "1")
    key = ContainerKey(pod.uid, "main")
    assert await env.engine.change_policy(NonePolicy(TOPOLOGY)) == [key]
    assert recorded_mems(env, container_id) == "1"
    await env.kubelet.ok("UpdateContainerResources", mems_update(container_id, "0"))
    assert recorded_mems(env, container_id) == "0"
    assert env.engine.containers[container_id].memory_nodes_chosen == CPUSet.parse("0")
    await env.engine.change_policy(static_policy())
    assert await adopt_sharing(env.engine) == [key]
    assert env.engine.state.assignments[key].mems == CPUSet.parse("0")
    assert recorded_mems(env, container_id) == "0"
    assert_consistent(env)


@pytest.mark.parametrize(("created", "updated"), [("1", "0"), ("0", "1")], ids=["off", "onto"])
async def test_an_update_the_runtime_refuses_changes_no_warning_of_narrowed_nodes(
    memory_less_env: Env, caplog: pytest.LogCaptureFixture, created: str, updated: str
) -> None:
    """A refused update naming memory nodes leaves the container's own as they were, and
    their warning with them: the loss of node 1's memory is told once for a container whose
    nodes name it, not again at the next memory change that moves it (node 2's memory
    comes), and a container whose nodes do not name it is told nothing of an update naming
    node 1 that the runtime refused."""
    env = memory_less_env
    pod = await env.kubelet.run_pod("cache", "burstable")
    container_id = await env.kubelet.start_new(pod, "main", 500, mems=created)
    told = caplog.text.count(NARROWED)
    assert told == (1 if created == "1" else 0)
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.INTERNAL, "runc says no")
    reply = await env.kubelet.call("UpdateContainerResources", mems_update(container_id, updated))
    assert reply.status is Status.INTERNAL
    assert env.engine.containers[container_id].mems_narrowed == (created == "1")
    with_node_2 = Topology(cpus=TOPOLOGY.cpus, memory_nodes=CPUSet.parse("0,2"))
    env.fake.memory_nodes = with_node_2.memory_nodes
    await env.engine.change_policy(StaticPolicy.create(with_node_2, reserved=CPUSet([0])))
    assert caplog.text.count(NARROWED) == told
