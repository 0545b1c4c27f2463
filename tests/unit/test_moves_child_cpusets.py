"""Containers with cgroups of their own under cgroup v1: their child cpusets move with them.

The fake containerd's cgroup tree is plain files; here every cpuset write, cpushim's and the
fake runtime's, is checked as cgroup v1 checks it (EBUSY when a child would be left outside),
so a move that forgets the children fails as it does on a node.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.const import Status as GrpcStatus

from shim import cgroups
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Status
from shim.engine import EngineOptions, ProjectionSettings
from shim.projection import read
from tests.fake_runtime import FakeRuntime, v1_children_outside
from tests.unit.engine_env import (
    FIRST_SINGLE,
    SHARED_AFTER_FIRST_SINGLE,
    Env,
    make_env,
    static_policy,
    until,
)
from tests.unit.test_watching import Watched, watched_env

pytestmark = pytest.mark.anyio


@pytest.fixture
def v1_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpushim's cgroup writes refused as cgroup v1 refuses them: EBUSY when a child would
    be left outside, EACCES when the parent does not have the set."""
    write = cgroups.write_list

    def write_as_v1(directory: Path, name: str, values: CPUSet) -> None:
        path = str(directory / name)
        if v1_children_outside(directory, name, str(values)):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)
        parent = directory.parent / name
        if parent.is_file() and not values.issubset(CPUSet.parse(parent.read_text().strip())):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), path)
        write(directory, name, values)

    monkeypatch.setattr(cgroups, "write_list", write_as_v1)


@pytest.fixture
async def env(tmp_path: Path, v1_rules: None) -> AsyncIterator[Env]:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        # Records only when drained, retries at once.
        options = EngineOptions(record_delay=3600.0, record_max_delay=3600.0, retry_delay=0.01)
        projection = ProjectionSettings(tmp_path / "projection", Path("/run/cpushim"))
        environment = await make_env(
            fake, tmp_path / "state", options=options, projection=projection
        )
        yield environment
        environment.channel.close()


async def located(env: Env, container_id: str) -> Path:
    tracked = env.engine.containers[container_id]
    await until(lambda: tracked.cgroup is not None, "the cgroup located")
    assert tracked.cgroup is not None
    return tracked.cgroup


def child(parent: Path, name: str, cpus: str, mems: str = "") -> Path:
    directory = parent / name
    directory.mkdir()
    (directory / "cpuset.cpus").write_text(cpus + "\n")
    if mems:
        (directory / "cpuset.mems").write_text(mems + "\n")
    return directory


def cpus_of(directory: Path) -> str:
    return (directory / "cpuset.cpus").read_text().strip()


async def test_a_shared_container_shrinks_and_grows_with_its_child_cpusets(env: Env) -> None:
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("ci", "besteffort"), "main")
    cgroup = await located(env, shared_id)
    inner = child(cgroup, "docker", "0-7")  # a runtime inside the container: every CPU
    job = child(inner, "job", FIRST_SINGLE)  # one of its containers, pinned

    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    assert env.cpus(pinned_id) == FIRST_SINGLE
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert cpus_of(inner) == SHARED_AFTER_FIRST_SINGLE
    assert cpus_of(job) == SHARED_AFTER_FIRST_SINGLE  # none of its CPUs left: all of the new
    assert env.engine.counters["child_cpuset_writes"] == 2

    await env.kubelet.stop(pinned_id)
    assert env.kernel_cpus(shared_id) == "0-7"
    assert cpus_of(inner) == "0-7"
    assert cpus_of(job) == FIRST_SINGLE  # its own CPU again, as cgroup v2 would show it


async def test_a_child_with_a_set_of_its_own_keeps_what_is_left_and_gets_it_back(env: Env) -> None:
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("ci", "besteffort"), "main")
    job = child(await located(env, shared_id), "job", f"{FIRST_SINGLE}-5")

    pinned_id = await env.kubelet.start_new(
        await env.kubelet.run_pod("db", "guaranteed"), "main", 1000
    )
    assert cpus_of(job) == "5"
    await env.kubelet.stop(pinned_id)
    assert env.kernel_cpus(shared_id) == "0-7"
    assert cpus_of(job) == f"{FIRST_SINGLE}-5"  # its own set again


async def test_a_pinned_container_moved_through_the_runtime_takes_its_children(env: Env) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    inner = child(await located(env, pinned_id), "inner", FIRST_SINGLE)

    # Its CPU becomes reserved: it gets another one, through the runtime (memory nodes and
    # quota move with it).
    assert await env.engine.change_policy(static_policy(reserved=f"0,{FIRST_SINGLE}")) == []
    moved = env.engine.state.assignments[next(iter(env.engine.state.assignments))].cpus
    assert FIRST_SINGLE not in str(moved)
    assert env.cpus(pinned_id) == str(moved)
    assert env.kernel_cpus(pinned_id) == str(moved)
    assert cpus_of(inner) == str(moved)
    assert env.engine.counters["cpuset_update_errors"] == 0


async def test_a_runtime_refusal_after_the_direct_write_is_tried_again(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    inner = child(await located(env, pinned_id), "inner", FIRST_SINGLE)
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)

    with caplog.at_level(logging.WARNING, logger="shim.engine.moves"):
        assert await env.engine.change_policy(static_policy(reserved=f"0,{FIRST_SINGLE}")) == []
    # Its memory nodes and quota go with the next try of the move, not with a record.
    (fields,) = refusal_warnings(caplog)
    assert fields["retry_in_s"] is None
    assert fields["retry"] == "with the move"
    moved = str(next(iter(env.engine.state.assignments.values())).cpus)
    # The CPUs are in place at once; the runtime's record follows on the retry.
    assert env.kernel_cpus(pinned_id) == moved
    assert cpus_of(inner) == moved
    await until(lambda: env.cpus(pinned_id) == moved, "the runtime's record moved")
    await until(lambda: not env.engine.containers[pinned_id].settings_stale, "settled")
    assert env.engine.counters["runtime_record_errors"] == 1
    assert env.engine.counters["drift_repairs"] == 0


def refusal_warnings(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    """The fields of every warning of a record the runtime refused."""
    return [r.__dict__["fields"] for r in caplog.records if "did not record" in r.getMessage()]


async def test_a_record_refused_after_the_tree_was_written_says_when_it_is_sent_again(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A shared container moved through the runtime past its children: the runtime refuses,
    the cgroups hold the new set, and the record is sent again after the record delay."""
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("ci", "besteffort"), "main")
    inner = child(await located(env, shared_id), "docker", "0-7")
    tracked = env.engine.containers[shared_id]
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    moved = CPUSet.parse(SHARED_AFTER_FIRST_SINGLE)
    with caplog.at_level(logging.WARNING, logger="shim.engine.moves"):
        async with tracked.write_lock:
            result = await env.engine.mover.update_locked(tracked, moved, "", None)
    assert result.moved
    assert cpus_of(inner) == SHARED_AFTER_FIRST_SINGLE
    (fields,) = refusal_warnings(caplog)
    assert fields["retry_in_s"] == env.engine.options.record_delay
    await env.engine.drain(5.0)  # sends what is due
    assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE


async def test_a_container_moved_past_its_children_is_projected_while_the_runtime_refuses(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    child(await located(env, pinned_id), "inner", FIRST_SINGLE)
    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE, count=1000)

    assert await env.engine.change_policy(static_policy(reserved=f"0,{FIRST_SINGLE}")) == []
    moved = str(next(iter(env.engine.state.assignments.values())).cpus)
    assert env.kernel_cpus(pinned_id) == moved  # it runs there
    assert env.engine.projector is not None
    assert env.engine.projection is not None
    await env.engine.projector.settle()
    assert read(env.engine.projection.directory / pod.uid / "main").cpus == moved
    assert env.engine.counters["cpuset_update_errors"] == 0


async def test_without_children_a_move_writes_the_container_alone(env: Env) -> None:
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("web", "besteffort"), "main")
    await located(env, shared_id)
    await env.kubelet.start_new(await env.kubelet.run_pod("db", "guaranteed"), "main", 1000)
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert env.engine.counters["child_cpuset_writes"] == 0


@pytest.fixture
async def w(tmp_path: Path, v1_rules: None) -> AsyncIterator[Watched]:
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        async for watched in watched_env(tmp_path, fake):
            yield watched


async def test_a_drift_repair_narrows_the_children_the_other_writer_widened(w: Watched) -> None:
    shared_id = await w.started("ci")
    await w.started("db", "guaranteed", 1000)
    cgroup = w.env.fake.cgroup_dir(shared_id)
    assert cgroup is not None
    inner = child(cgroup, "docker", SHARED_AFTER_FIRST_SINGLE)
    # Someone else gives the container and its runtime's cgroup every CPU (the watch is on
    # the container's file: that write is the one it sees).
    (inner / "cpuset.cpus").write_text("0-7\n")
    (cgroup / "cpuset.cpus").write_text("0-7\n")

    await until(lambda: cpus_of(inner) == SHARED_AFTER_FIRST_SINGLE, "child narrowed")
    await w.settled()
    assert w.env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert w.counters["drift_repairs"] == 1


async def test_a_shared_container_whose_repair_the_runtime_refused_settles(w: Watched) -> None:
    """A shared container's repair is written straight into its cgroup (children first) and
    then sent through the runtime, which refuses it: the cgroup is right, the record is left
    to be sent later, and nothing stays out of place (a move retried for settings a shared
    container does not have would be retried for good)."""
    shared_id = await w.started("ci")
    await w.started("db", "guaranteed", 1000)
    cgroup = w.env.fake.cgroup_dir(shared_id)
    assert cgroup is not None
    inner = child(cgroup, "docker", SHARED_AFTER_FIRST_SINGLE)
    w.env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    (inner / "cpuset.cpus").write_text("0-7\n")
    (cgroup / "cpuset.cpus").write_text("0-7\n")

    await until(lambda: w.env.engine.counters["runtime_record_errors"] == 1, "refused")
    await w.settled()
    assert w.env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert cpus_of(inner) == SHARED_AFTER_FIRST_SINGLE
    assert not w.env.engine.containers[shared_id].settings_stale
    assert w.env.engine._out_of_place() == []
    await w.env.engine.drain(5.0)
    assert w.env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE  # the runtime's record


async def test_a_drift_repair_writes_the_children_itself(
    w: Watched, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shim")
    shared_id = await w.started("ci")
    await w.started("db", "guaranteed", 1000)
    cgroup = w.env.fake.cgroup_dir(shared_id)
    assert cgroup is not None
    inner = child(cgroup, "docker", "0-7")
    (cgroup / "cpuset.cpus").write_text("0-7\n")
    await until(lambda: w.counters["drift_repairs"] == 1, "repaired")
    await w.settled()
    assert cpus_of(inner) == SHARED_AFTER_FIRST_SINGLE
    assert "direct repair failed" not in caplog.text


@pytest.mark.parametrize("refused", [False, True])
async def test_a_drift_repair_writes_the_container_once(
    w: Watched, monkeypatch: pytest.MonkeyPatch, refused: bool
) -> None:
    """The repair's direct write moves the children with the container; the update through
    the runtime that follows it makes no second write of the same set: done, it is in place,
    and refused (EACCES here), the kernel would refuse it again."""
    shared_id = await w.started("ci")
    await w.started("db", "guaranteed", 1000)
    cgroup = w.env.fake.cgroup_dir(shared_id)
    assert cgroup is not None
    inner = child(cgroup, "docker", SHARED_AFTER_FIRST_SINGLE)
    v1_write = cgroups.write_list
    tried: list[str] = []

    def counted(directory: Path, name: str, values: CPUSet) -> None:
        if directory == cgroup and name == cgroups.CPUSET_CPUS:
            tried.append(str(values))
            if refused:
                raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(directory / name))
        v1_write(directory, name, values)

    monkeypatch.setattr(cgroups, "write_list", counted)
    (cgroup / "cpuset.cpus").write_text("0-7\n")
    await until(lambda: w.counters["drift_repairs"] == 1, "repaired")
    await w.settled()
    assert w.env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE  # by runc, if refused
    assert cpus_of(inner) == SHARED_AFTER_FIRST_SINGLE
    assert tried == [SHARED_AFTER_FIRST_SINGLE]


async def test_a_pinned_container_moved_to_another_numa_node_takes_its_childrens_memory(
    env: Env,
) -> None:
    pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pod, "main", 1000)
    cgroup = await located(env, pinned_id)
    assert (cgroup / "cpuset.mems").read_text().strip() == "0"
    inner = child(cgroup, "inner", FIRST_SINGLE, mems="0")

    # Socket 0 (NUMA node 0) becomes reserved: the container moves to node 1.
    assert await env.engine.change_policy(static_policy(reserved="0-1,4-5")) == []
    moved = str(next(iter(env.engine.state.assignments.values())).cpus)
    assert env.kernel_cpus(pinned_id) == moved
    assert (cgroup / "cpuset.mems").read_text().strip() == "1"
    assert (cpus_of(inner), (inner / "cpuset.mems").read_text().strip()) == (moved, "1")
    assert env.engine.counters["cpuset_update_errors"] == 0


async def test_under_cgroup_v2_the_children_are_left_to_the_kernel(tmp_path: Path) -> None:
    async with FakeRuntime(cgroup_root=tmp_path / "cgroup", cgroup_version=2) as fake:
        env = await make_env(fake, tmp_path / "state")
        try:
            shared_id = await env.kubelet.start_new(
                await env.kubelet.run_pod("ci", "besteffort"), "main"
            )
            cgroup = await located(env, shared_id)
            # v2 takes a parent's write whatever its children hold; their effective CPUs
            # follow it.
            inner = child(cgroup, "docker", "0-7")
            await env.kubelet.start_new(await env.kubelet.run_pod("db", "guaranteed"), "main", 1000)
            assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
            assert cpus_of(inner) == "0-7"
            assert env.engine.counters["child_cpuset_writes"] == 0
        finally:
            env.channel.close()


@pytest.fixture
async def v2_before_5_17(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Env]:
    """Cgroup v2 on a kernel before 5.17 (Ubuntu 22.04, Debian 11): a cgroup's write below a
    child's own set is refused (EBUSY) as in v1, a child outside its parent is not."""
    write = cgroups.write_list

    def write_as_old_v2(directory: Path, name: str, values: CPUSet) -> None:
        if v1_children_outside(directory, name, str(values)):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(directory / name))
        write(directory, name, values)

    monkeypatch.setattr(cgroups, "write_list", write_as_old_v2)
    async with FakeRuntime(
        cgroup_root=tmp_path / "cgroup", cgroup_version=2, v2_before_5_17=True
    ) as fake:
        options = EngineOptions(record_delay=3600.0, record_max_delay=3600.0, retry_delay=0.01)
        environment = await make_env(fake, tmp_path / "state", options=options)
        yield environment
        environment.channel.close()


async def test_under_cgroup_v2_before_5_17_a_shared_container_moves_its_children(
    v2_before_5_17: Env,
) -> None:
    env = v2_before_5_17
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("ci", "besteffort"), "main")
    cgroup = await located(env, shared_id)
    follows = child(cgroup, "docker", "")  # never set: v2's "all of the parent's"
    pinned = child(cgroup, "job", "0-7")  # a nested runtime's --cpuset-cpus
    pinned_id = await env.kubelet.start_new(
        await env.kubelet.run_pod("db", "guaranteed"), "main", 1000
    )
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert cpus_of(pinned) == SHARED_AFTER_FIRST_SINGLE
    assert cpus_of(follows) == ""
    assert env.engine.counters["child_cpuset_writes"] == 1
    await env.kubelet.stop(pinned_id)
    assert (env.kernel_cpus(shared_id), cpus_of(pinned)) == ("0-7", "0-7")


async def test_under_cgroup_v2_before_5_17_a_child_that_inherits_is_left_with_what_is_below(
    v2_before_5_17: Env,
) -> None:
    # In v2 an empty cpuset.cpus is all of the parent's (a runtime's own cgroup inside the
    # container), not v1's "never configured": what is below it keeps its own set.
    env = v2_before_5_17
    shared_id = await env.kubelet.start_new(await env.kubelet.run_pod("ci", "besteffort"), "main")
    cgroup = await located(env, shared_id)
    job = child(cgroup, "job", f"{FIRST_SINGLE}-5")  # makes the old kernel refuse the shrink
    docker = child(cgroup, "docker", "")
    nested = child(docker, "nested", "5")  # a nested runtime's --cpuset-cpus=5
    pinned_id = await env.kubelet.start_new(
        await env.kubelet.run_pod("db", "guaranteed"), "main", 1000
    )
    assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
    assert (cpus_of(job), cpus_of(docker), cpus_of(nested)) == ("5", "", "5")
    await env.kubelet.stop(pinned_id)
    assert (cpus_of(job), cpus_of(docker), cpus_of(nested)) == (f"{FIRST_SINGLE}-5", "", "5")


async def test_under_cgroup_v2_before_5_17_a_move_through_the_runtime_takes_the_children(
    v2_before_5_17: Env,
) -> None:
    env = v2_before_5_17
    pinned_id = await env.kubelet.start_new(
        await env.kubelet.run_pod("db", "guaranteed"), "main", 1000
    )
    inner = child(await located(env, pinned_id), "inner", FIRST_SINGLE)
    assert await env.engine.change_policy(static_policy(reserved=f"0,{FIRST_SINGLE}")) == []
    moved = str(next(iter(env.engine.state.assignments.values())).cpus)
    assert FIRST_SINGLE not in moved
    assert (env.cpus(pinned_id), env.kernel_cpus(pinned_id), cpus_of(inner)) == (moved,) * 3
    assert env.engine.counters["cpuset_update_errors"] == 0


@pytest.mark.parametrize("runtime_refuses", [False, True])
async def test_kubelets_update_of_a_container_whose_move_is_pending_takes_its_children(
    tmp_path: Path, v1_rules: None, monkeypatch: pytest.MonkeyPatch, runtime_refuses: bool
) -> None:
    """kubelet's UpdateContainerResources carries cpushim's cpuset, which the runtime writes
    into the container's own cgroup only: with a move still to be tried again, the children
    would be left outside and v1 would refuse kubelet's call. When the runtime refuses the
    call for a reason of its own, the container has moved all the same."""
    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        # A failed move waits an hour for its retry: kubelet's update comes first.
        options = EngineOptions(record_delay=3600.0, record_max_delay=3600.0, retry_delay=3600.0)
        env = await make_env(fake, tmp_path / "state", options=options)
        try:
            shared_id = await env.kubelet.start_new(
                await env.kubelet.run_pod("ci", "besteffort"), "main"
            )
            cgroup = await located(env, shared_id)
            inner = child(cgroup, "docker", "0-7")
            v1_write = cgroups.write_list

            def refused_in_the_container(directory: Path, name: str, values: CPUSet) -> None:
                if directory == cgroup:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                v1_write(directory, name, values)

            monkeypatch.setattr(cgroups, "write_list", refused_in_the_container)
            await env.kubelet.start_new(await env.kubelet.run_pod("db", "guaranteed"), "main", 1000)
            # Written straight: refused; through the runtime: EBUSY, the child is outside.
            assert env.kernel_cpus(shared_id) == "0-7"
            monkeypatch.setattr(cgroups, "write_list", v1_write)

            update = pb.UpdateContainerResourcesRequest(
                container_id=shared_id,
                linux=pb.LinuxContainerResources(cpu_period=100_000, cpu_shares=2),
            )
            if runtime_refuses:
                env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
                reply = await env.kubelet.call(
                    "UpdateContainerResources", update.SerializeToString()
                )
                assert reply.status is Status.UNAVAILABLE  # kubelet tries again itself
            else:
                await env.kubelet.ok("UpdateContainerResources", update.SerializeToString())
            assert env.kernel_cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE
            assert cpus_of(inner) == SHARED_AFTER_FIRST_SINGLE
            assert env.engine.counters["child_cpuset_writes"] == 1
            tracked = env.engine.containers[shared_id]
            assert str(tracked.applied) == SHARED_AFTER_FIRST_SINGLE
            assert env.engine._out_of_place() == []
            assert env.engine.counters["runtime_record_errors"] == int(runtime_refuses)
            await env.engine.drain(5.0)
            assert env.cpus(shared_id) == SHARED_AFTER_FIRST_SINGLE  # the runtime's record
        finally:
            env.channel.close()


def mems_of(directory: Path) -> str:
    return (directory / "cpuset.mems").read_text().strip()


async def test_an_update_naming_memory_nodes_takes_the_children_with_it(env: Env) -> None:
    """An update that names memory nodes for a shared container (``crictl update
    --cpuset-mems``; cpushim passes them on) would have runc write them into the container's
    own cgroup only, which v1 refuses below a child that holds more. They are written
    children first, as the CPUs are. One the runtime refuses for a reason of its own leaves
    the cgroups on the container's nodes again, by a move tried again through the runtime."""
    pod = await env.kubelet.run_pod("ci", "burstable")
    shared_id = await env.kubelet.start_new(pod, "main", 500, mems="0-1")
    cgroup = await located(env, shared_id)
    inner = child(cgroup, "docker", "0-7", mems="0-1")
    update = pb.UpdateContainerResourcesRequest(
        container_id=shared_id, linux=pb.LinuxContainerResources(cpuset_mems="0")
    ).SerializeToString()
    tracked = env.engine.containers[shared_id]

    env.fake.fail_next("UpdateContainerResources", GrpcStatus.UNAVAILABLE)
    reply = await env.kubelet.call("UpdateContainerResources", update)
    assert reply.status is Status.UNAVAILABLE
    await until(
        lambda: not tracked.settings_stale and mems_of(cgroup) == "0-1", "the nodes given back"
    )
    assert mems_of(inner) == "0-1"
    assert env.fake.containers[shared_id].resources.cpuset_mems == "0-1"
    assert tracked.shared_mems == CPUSet.parse("0-1")

    await env.kubelet.ok("UpdateContainerResources", update)
    assert (mems_of(cgroup), mems_of(inner)) == ("0", "0")
    assert env.fake.containers[shared_id].resources.cpuset_mems == "0"
    assert tracked.shared_mems == CPUSet.parse("0")
    assert env.engine._out_of_place() == []
