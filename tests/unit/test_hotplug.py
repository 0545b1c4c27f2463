"""CPUs going offline and online while cpushim runs: told by a uevent or seen at a full look,
they make the policy planned again with the CPUs online now."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from shim import cgroups
from shim.cgroups import CgroupLayout, CgroupVersion
from shim.checkpoint import CheckpointFile
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.engine import EngineOptions, hotplug
from shim.engine.hotplug import (
    CPUFollower,
    give_back_online,
    hotplug_told,
    kubepods_tops,
    pod_cgroups,
)
from shim.engine.watching import Watcher
from shim.run import RunOptions, build_policy
from shim.state import ContainerKey, CPUState, integrity_problems
from tests.fake_runtime import FakeRuntime
from tests.harness.sysfs import MachineSpec, write_sysfs
from tests.unit.engine_env import Env, make_env, until, updates_to

pytestmark = pytest.mark.anyio

MACHINE = MachineSpec(sockets=2, cores_per_die=2, threads_per_core=2)


def uevent(action: str, subsystem: str = "cpu", cpu: int = 4) -> bytes:
    """A kernel uevent of CPU ``cpu``, or of memory block or node ``cpu`` of ``subsystem``."""
    device = {"cpu": "cpu/cpu", "memory": "memory/memory", "node": "node/node"}[subsystem]
    path = f"/devices/system/{device}{cpu}"
    fields = [f"{action}@{path}", f"ACTION={action}", f"DEVPATH={path}"]
    fields += [f"SUBSYSTEM={subsystem}", "SEQNUM=4242"]
    return "\0".join(fields).encode() + b"\0"


@pytest.mark.parametrize(
    ("datagram", "told"),
    [
        (uevent("offline"), "cpus"),
        (uevent("online"), "cpus"),
        (uevent("add"), "cpus"),
        (uevent("remove"), "cpus"),
        (uevent("change"), None),
        (uevent("offline", subsystem="memory"), "memory"),
        (uevent("online", subsystem="memory", cpu=40), "memory"),
        (uevent("add", subsystem="memory"), "memory"),
        (uevent("add", subsystem="node", cpu=2), "memory"),
        (uevent("remove", subsystem="node", cpu=2), "memory"),
        (uevent("change", subsystem="memory"), None),
        (b"libudev\0\xfe\xed\xca\xfeACTION=offline\0SUBSYSTEM=cpu\0", None),
        (b"libudev\0\xfe\xed\xca\xfeACTION=online\0SUBSYSTEM=memory\0", None),
        (b"", None),
        (b"offline@/devices/system/cpu/cpu4", None),
    ],
)
def test_only_the_kernels_cpu_and_memory_hotplug_uevents_count(
    datagram: bytes, told: str | None
) -> None:
    assert hotplug_told(datagram) == told


@dataclass
class Following:
    env: Env
    watcher: Watcher
    follower: CPUFollower
    sysfs: Path
    events: socket.socket | None

    def take_offline(self, *cpus: int) -> None:
        """What the kernel shows once CPUs went offline (or came back: fewer given)."""
        shutil.rmtree(self.sysfs)
        write_sysfs(replace(MACHINE, offline=frozenset(cpus)), self.sysfs)

    def with_memory_on(self, nodes: str) -> None:
        """What the kernel shows once memory went offline or online, the CPUs as they are:
        the nodes with memory are ``nodes``, and runc's writes of others are refused."""
        (self.sysfs / "devices" / "system" / "node" / "has_memory").write_text(nodes + "\n")
        self.env.fake.memory_nodes = CPUSet.parse(nodes)

    async def looks(self, count: int) -> None:
        """``count`` full looks of the watcher, each with the checks it asked for done."""
        for _ in range(count):
            await self.watcher.look_everywhere()
            await until(lambda: self.watcher.jobs.pending == 0, "watch jobs done")

    async def replanned_for_memory(self, count: int = 1) -> None:
        counters = self.env.engine.counters
        await until(lambda: counters["memory_hotplug_replans"] >= count, f"re-plan {count}")
        await until(lambda: self.watcher.jobs.pending == 0, "watch jobs done")

    async def replanned(self, count: int = 1) -> None:
        counters = self.env.engine.counters
        await until(lambda: counters["cpu_hotplug_replans"] >= count, f"re-plan {count}")
        await until(lambda: self.watcher.jobs.pending == 0, "watch jobs done")


@contextlib.asynccontextmanager
async def following(
    tmp_path: Path,
    *,
    reserved: str = "0",
    uevents: bool = True,
    unplaced: int | None = None,
    offline: frozenset[int] = frozenset(),
    policy_options: tuple[str, ...] = (),
) -> AsyncIterator[Following]:
    sysfs = write_sysfs(replace(MACHINE, offline=offline), tmp_path / "sys")
    if unplaced is not None:
        # Listed online, with no topology files: discovery leaves it out.
        shutil.rmtree(sysfs / "devices" / "system" / "cpu" / f"cpu{unplaced}" / "topology")
    options = RunOptions(sysfs_root=sysfs, reserved_cpus=reserved, policy_options=policy_options)
    kernel_side, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)

    def open_socket() -> socket.socket:
        if not uevents:
            raise PermissionError(13, "Permission denied")
        return ours

    async with FakeRuntime(cgroup_root=tmp_path / "cpuset") as fake:
        env = await make_env(
            fake,
            tmp_path / "state",
            build_policy(options),
            options=EngineOptions(record_delay=3600, retry_delay=0.01),
        )
        watcher = Watcher(env.engine, resync_period=0, sysfs_root=sysfs)
        watcher.start()
        follower = CPUFollower(watcher, lambda: options, build_policy, open_socket=open_socket)
        follower.start()
        await until(lambda: watcher.jobs.pending == 0, "the first check")
        try:
            yield Following(env, watcher, follower, sysfs, kernel_side if uevents else None)
        finally:
            follower.stop()
            await watcher.stop()
            await env.engine.drain(5.0)
            env.channel.close()
            kernel_side.close()
            ours.close()


async def pinned_and_shared(env: Env) -> tuple[str, str]:
    shared_pod = await env.kubelet.run_pod("web", "besteffort")
    shared_id = await env.kubelet.start_new(shared_pod, "main")
    pinned_pod = await env.kubelet.run_pod("db", "guaranteed")
    pinned_id = await env.kubelet.start_new(pinned_pod, "main", 1000)
    assert env.kernel_cpus(pinned_id) == "4"
    assert env.kernel_cpus(shared_id) == "0-3,5-7"
    return shared_id, pinned_id


async def test_a_pinned_cpu_gone_offline_is_replaced_and_left_out_of_the_pool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with following(tmp_path) as f:
        env = f.env
        shared_id, pinned_id = await pinned_and_shared(env)
        f.take_offline(4)
        assert f.events is not None
        f.events.send(uevent("offline"))
        await f.replanned()
        assert env.engine.counters["cpu_hotplug_events"] == 1
        moved = CPUSet.parse(env.kernel_cpus(pinned_id) or "")
        assert len(moved) == 1
        assert 4 not in moved
        assert 0 not in moved
        assert env.kernel_cpus(shared_id) == str(CPUSet.parse("0-3,5-7") - moved)
        assert 4 not in env.engine.state.shared
        # A container created now is not given the offline CPU (runc would refuse it).
        later = await env.kubelet.run_pod("late", "burstable")
        later_id = await env.kubelet.start_new(later, "main", 500)
        assert 4 not in CPUSet.parse(env.kernel_cpus(later_id) or "")
        (held,) = env.saved().values()
        assert held == {"main": str(moved)}
        assert "the CPUs online changed; re-planned with them" in caplog.text
        # The checkpoint names the new topology: a restart under it loads it.
        restarted = CheckpointFile(env.state_dir).load()
        assert restarted is not None
        now = build_policy(RunOptions(sysfs_root=f.sysfs, reserved_cpus="0")).topology
        assert integrity_problems(restarted, now) == []


async def test_a_sibling_back_online_moves_a_container_off_its_lone_thread(
    tmp_path: Path,
) -> None:
    """Under full-pcpus-only a core whose sibling is offline is whole with one thread; once
    the sibling is back, a container holding that thread alone is not on whole cores, and
    the re-plan moves it as it would at a restart."""
    async with following(
        tmp_path,
        reserved="0,4",
        offline=frozenset({5, 6, 7}),
        policy_options=("full-pcpus-only",),
    ) as f:
        env = f.env
        pod = await env.kubelet.run_pod("db", "guaranteed")
        pinned_id = await env.kubelet.start_new(pod, "main", 2000)
        held = CPUSet.parse(env.kernel_cpus(pinned_id) or "")
        assert len(held) == 2
        # The sibling of its first CPU comes back (siblings are n and n + 4).
        f.take_offline(*({5, 6, 7} - {min(held) + 4}))
        assert f.events is not None
        f.events.send(uevent("online", cpu=min(held) + 4))
        await f.replanned()
        topology = env.engine.policy.topology
        assert min(held) + 4 in topology.online
        moved = CPUSet.parse(env.kernel_cpus(pinned_id) or "")
        assert len(moved) == 2
        assert topology.whole_cores_in(moved) == moved
        assert env.engine.counters["pinning_errors"] == 0


async def test_kubelets_memory_nodes_stay_when_all_their_cpus_go_offline(tmp_path: Path) -> None:
    """CPU hotplug leaves a node's memory online (the kernel's memory nodes change with
    memory hotplug only): a container kubelet's memory manager put on node 1 moves to CPUs
    elsewhere when node 1's all go, and its memory stays where kubelet put it, as on a node
    with memory and no CPU, back online or not."""
    async with following(tmp_path) as f:
        env = f.env
        pod = await env.kubelet.run_pod("db", "guaranteed")
        container_id = await env.kubelet.start_new(pod, "main", 1000, mems="1")
        node_1 = env.engine.policy.topology.cpus_in_numa_node(1)
        assert CPUSet.parse(env.cpus(container_id)).issubset(node_1)
        f.take_offline(*node_1)
        assert f.events is not None
        f.events.send(uevent("offline", cpu=min(node_1)))
        await f.replanned()
        assert env.engine.policy.topology.numa_nodes == (0,)
        moved = CPUSet.parse(env.cpus(container_id))
        assert len(moved) == 1
        assert not moved & node_1
        assert env.fake.containers[container_id].resources.cpuset_mems == "1"
        key = ContainerKey(pod.uid, "main")
        assert env.engine.state.assignments[key].mems == CPUSet.parse("1")
        f.take_offline()
        f.events.send(uevent("online", cpu=min(node_1)))
        await f.replanned(2)
        assert env.cpus(container_id) == str(moved)
        assert env.fake.containers[container_id].resources.cpuset_mems == "1"


async def test_memory_that_follows_the_cpus_moves_with_them_to_another_node(
    tmp_path: Path,
) -> None:
    async with following(tmp_path) as f:
        env = f.env
        _, pinned_id = await pinned_and_shared(env)
        assert env.fake.containers[pinned_id].resources.cpuset_mems == "0"
        f.take_offline(1, 4, 5)  # node 0's CPUs but the reserved one
        assert f.events is not None
        f.events.send(uevent("offline"))
        await f.replanned()
        moved = CPUSet.parse(env.cpus(pinned_id))
        assert moved.issubset(env.engine.policy.topology.cpus_in_numa_node(1))
        assert env.fake.containers[pinned_id].resources.cpuset_mems == "1"


async def test_without_a_uevent_a_full_look_sees_the_change(tmp_path: Path) -> None:
    async with following(tmp_path, uevents=False) as f:
        shared_id, pinned_id = await pinned_and_shared(f.env)
        f.take_offline(4)
        await f.watcher.look_everywhere()
        await f.replanned()
        assert f.env.engine.counters["cpu_hotplug_events"] == 0
        assert 4 not in CPUSet.parse(f.env.kernel_cpus(shared_id) or "")
        assert f.env.kernel_cpus(pinned_id) != "4"


async def test_a_cpu_back_online_goes_back_to_the_pool(tmp_path: Path) -> None:
    async with following(tmp_path) as f:
        assert f.events is not None
        shared_pod = await f.env.kubelet.run_pod("web", "besteffort")
        shared_id = await f.env.kubelet.start_new(shared_pod, "main")
        f.take_offline(6, 7)
        f.events.send(uevent("offline", cpu=6) + b"")
        await f.replanned()
        assert f.env.kernel_cpus(shared_id) == "0-5"
        f.take_offline()
        f.events.send(uevent("online", cpu=6))
        await f.replanned(2)
        assert f.env.kernel_cpus(shared_id) == "0-7"
        assert f.env.engine.policy.topology.online == CPUSet.parse("0-7")


async def test_other_uevents_and_an_unchanged_machine_re_plan_nothing(tmp_path: Path) -> None:
    async with following(tmp_path) as f:
        assert f.events is not None
        counters = f.env.engine.counters
        f.events.send(uevent("change"))
        f.events.send(uevent("change", subsystem="memory"))
        f.events.send(uevent("online"))  # told, but the CPUs online are those planned
        await until(lambda: counters["cpu_hotplug_events"] == 1, "one told")
        await until(lambda: f.watcher.jobs.pending == 0, "watch jobs done")
        # Told, but the memory nodes are those planned.
        f.events.send(uevent("offline", subsystem="memory"))
        await until(lambda: counters["memory_hotplug_events"] == 1, "one told")
        await until(lambda: f.watcher.jobs.pending == 0, "watch jobs done")
        assert counters["cpu_hotplug_replans"] == counters["memory_hotplug_replans"] == 0


async def test_memory_brought_online_re_plans_with_the_new_memory_nodes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Memory hotplug (a CXL device's memory onlined as node 2) changes the memory nodes and
    no CPU: the policy is planned again with them, as a change of the CPUs online is."""
    async with following(tmp_path) as f:
        assert f.events is not None
        policy = f.env.engine.policy
        assert policy.topology.memory_nodes == CPUSet.parse("0-1")
        f.with_memory_on("0-2")
        f.events.send(uevent("add", subsystem="node", cpu=2))
        f.events.send(uevent("online", subsystem="memory", cpu=40))
        await f.replanned_for_memory()
        counters = f.env.engine.counters
        assert counters["memory_hotplug_events"] == 1
        assert counters["cpu_hotplug_events"] == counters["cpu_hotplug_replans"] == 0
        assert f.env.engine.policy is not policy
        assert f.env.engine.policy.topology.memory_nodes == CPUSet.parse("0-2")
        assert f.env.engine.policy.topology.online == policy.topology.online
        assert "the memory nodes changed; re-planned with them" in caplog.text
        # Taken offline again: followed back.
        f.with_memory_on("0-1")
        f.events.send(uevent("offline", subsystem="memory", cpu=40))
        await f.replanned_for_memory(2)
        assert f.env.engine.policy.topology.memory_nodes == CPUSet.parse("0-1")


async def test_without_a_uevent_a_full_look_sees_the_memory_nodes_change(tmp_path: Path) -> None:
    async with following(tmp_path, uevents=False) as f:
        f.with_memory_on("1")  # node 0's memory taken offline
        await f.watcher.look_everywhere()
        await f.replanned_for_memory()
        assert f.env.engine.policy.topology.memory_nodes == CPUSet.parse("1")
        assert f.env.engine.counters["memory_hotplug_events"] == 0


def mems(env: Env, container_id: str) -> str:
    """The memory nodes the runtime's record of the container holds ("": none of its own)."""
    return env.fake.containers[container_id].resources.cpuset_mems


async def test_memory_added_as_a_node_goes_to_the_containers_with_every_node(
    tmp_path: Path,
) -> None:
    """CXL memory onlined as node 2: a shared container has every node with memory, node 2
    now among them, and the re-plan writes them. Those whose nodes kubelet chose keep them,
    and an exclusive container's CPUs' nodes with memory are what they were: not moved."""
    async with following(tmp_path) as f:
        env = f.env
        assert f.events is not None
        shared_id, pinned_id = await pinned_and_shared(env)
        chosen_pod = await env.kubelet.run_pod("cache", "burstable")
        chosen_shared_id = await env.kubelet.start_new(chosen_pod, "main", 500, mems="1")
        chosen_pinned_pod = await env.kubelet.run_pod("queue", "guaranteed")
        chosen_pinned_id = await env.kubelet.start_new(chosen_pinned_pod, "main", 1000, mems="1")
        assert (mems(env, shared_id), mems(env, pinned_id)) == ("", "0")
        updated = {
            i: len(updates_to(env.fake, i)) for i in (pinned_id, chosen_shared_id, chosen_pinned_id)
        }
        f.with_memory_on("0-2")
        f.events.send(uevent("online", subsystem="memory", cpu=40))
        await f.replanned_for_memory()
        assert mems(env, shared_id) == "0-2"
        assert mems(env, pinned_id) == "0"
        assert mems(env, chosen_shared_id) == mems(env, chosen_pinned_id) == "1"
        assert {i: len(updates_to(env.fake, i)) for i in updated} == updated
        assert env.kernel_cpus(pinned_id) == "4"
        tracked = env.engine.containers[shared_id]
        assert not tracked.settings_stale
        # Written once: the next look finds it in place.
        before = len(updates_to(env.fake, shared_id))
        await f.watcher.look_everywhere()
        await until(lambda: f.watcher.jobs.pending == 0, "watch jobs done")
        assert len(updates_to(env.fake, shared_id)) == before


async def test_memory_of_an_exclusive_containers_node_taken_offline_is_followed(
    tmp_path: Path,
) -> None:
    """Node 0's memory taken offline: a container pinned there whose memory follows its CPUs
    has no node of theirs with memory left, so every node with memory (node 1) is its, and a
    shared container's every node is node 1 too."""
    async with following(tmp_path) as f:
        env = f.env
        assert f.events is not None
        shared_id, pinned_id = await pinned_and_shared(env)
        f.with_memory_on("1")
        f.events.send(uevent("offline", subsystem="memory", cpu=3))
        await f.replanned_for_memory()
        assert env.kernel_cpus(pinned_id) == "4"
        assert mems(env, pinned_id) == "1"
        assert mems(env, shared_id) == "1"
        assert not env.engine.containers[pinned_id].settings_stale


async def test_kubelets_memory_nodes_without_memory_give_way_until_it_comes_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kubelet's memory manager put two containers' memory on node 0, one pinned, one
    sharing. Node 0's memory taken offline, the kernel refuses a cpuset.mems naming it: they
    get every node with memory (node 1), told once each, and kubelet's choice stays recorded.
    Node 0's memory back, they get it back."""
    async with following(tmp_path) as f:
        env = f.env
        assert f.events is not None
        pinned_pod = await env.kubelet.run_pod("queue", "guaranteed")
        pinned_id = await env.kubelet.start_new(pinned_pod, "main", 1000, mems="0")
        shared_pod = await env.kubelet.run_pod("cache", "burstable")
        shared_id = await env.kubelet.start_new(shared_pod, "main", 500, mems="0")
        key = ContainerKey(pinned_pod.uid, "main")
        f.with_memory_on("1")
        f.events.send(uevent("offline", subsystem="memory", cpu=3))
        await f.replanned_for_memory()
        assert mems(env, pinned_id) == mems(env, shared_id) == "1"
        assert env.engine.state.assignments[key].mems == CPUSet.parse("0")
        assert env.engine.containers[shared_id].shared_mems == CPUSet.parse("0")
        assert not env.engine.containers[shared_id].settings_stale
        told = "memory nodes chosen for a container (by kubelet's memory manager, or an update"
        assert caplog.text.count(told) == 2
        # Moved again (CPU 4 taken offline) while narrowed: the move carries node 1 alone.
        f.take_offline(4)
        f.with_memory_on("1")
        f.events.send(uevent("offline"))
        await f.replanned()
        assert env.kernel_cpus(pinned_id) != "4"
        assert mems(env, pinned_id) == "1"
        assert caplog.text.count(told) == 2
        f.with_memory_on("0-1")
        f.events.send(uevent("online", subsystem="memory", cpu=3))
        await f.replanned_for_memory(2)
        assert mems(env, pinned_id) == mems(env, shared_id) == "0"
        assert not env.engine.containers[shared_id].settings_stale


async def test_a_cpu_listed_online_without_topology_files_is_no_change(tmp_path: Path) -> None:
    async with following(tmp_path, unplaced=7) as f:
        assert f.env.engine.policy.topology.online == CPUSet.parse("0-6")
        policy = f.env.engine.policy
        await f.looks(2)
        counters = f.env.engine.counters
        assert counters["cpu_hotplug_replans"] == counters["cpu_hotplug_replans_refused"] == 0
        assert f.env.engine.policy is policy


async def test_a_list_of_memory_nodes_that_reads_empty_is_warned_of_once_while_it_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every check reads the memory nodes: a list that stays empty is no change, and told
    once, not at every full look; told again once it read well in between."""
    async with following(tmp_path) as f:
        policy = f.env.engine.policy

        with caplog.at_level(logging.WARNING, logger="shim.topology"):
            f.with_memory_on("")
            await f.looks(3)
            f.with_memory_on("0-1")
            await f.looks(1)
            f.with_memory_on("")
            await f.looks(2)
        told = [r for r in caplog.records if "empty list of memory nodes" in r.getMessage()]
        assert len(told) == 2
        assert f.env.engine.policy is policy


async def test_cpus_online_that_cannot_be_read_are_warned_of_once_while_they_stay_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every check reads the CPUs online: a list that keeps failing the same way is told
    once, not at every full look; again when it fails otherwise, or after it read well
    (which is told too)."""
    async with following(tmp_path, uevents=False) as f:
        policy = f.env.engine.policy
        online_file = f.sysfs / "devices" / "system" / "cpu" / "online"

        with caplog.at_level(logging.INFO, logger="shim.engine.hotplug"):
            online_file.write_text("x\n")
            await f.looks(3)
            online_file.unlink()
            await f.looks(2)
            f.take_offline()
            await f.looks(2)
            online_file.write_text("x\n")
            await f.looks(2)
        told = [
            (r.levelname, r.getMessage())
            for r in caplog.records
            if "the CPUs online" in r.getMessage()
        ]
        unread = ("WARNING", "cannot read the CPUs online")
        read_again = ("INFO", "the CPUs online read again")
        assert told == [unread, unread, read_again, unread]
        assert f.env.engine.policy is policy


async def test_a_cpu_back_online_without_its_core_id_is_warned_of_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Left out as at start, it keeps the CPUs listed online apart from those planned with,
    so every check reads the topology again: the warning is given once, not at each."""
    async with following(tmp_path, uevents=False) as f:
        f.take_offline(7)
        await f.watcher.look_everywhere()
        await f.replanned()
        f.take_offline()
        core_id = f.sysfs / "devices" / "system" / "cpu" / "cpu7" / "topology" / "core_id"
        core_id.unlink()
        with caplog.at_level(logging.WARNING, logger="shim.topology"):
            await f.looks(3)
        told = [r.__dict__["fields"] for r in caplog.records if "lacks an id" in r.getMessage()]
        assert told == [{"cpu": 7, "missing": str(core_id)}]
        assert f.env.engine.policy.topology.online == CPUSet.parse("0-6")
        assert f.env.engine.counters["cpu_hotplug_replans"] == 1


async def test_a_reserved_cpu_gone_offline_is_refused_once_and_the_plan_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with following(tmp_path, reserved="0,4") as f:
        policy = f.env.engine.policy
        f.take_offline(4)
        with caplog.at_level(logging.ERROR):
            await f.watcher.look_everywhere()
            await until(lambda: f.watcher.jobs.pending == 0, "watch jobs done")
            await f.watcher.look_everywhere()
            await until(lambda: f.watcher.jobs.pending == 0, "watch jobs done")
        counters = f.env.engine.counters
        assert counters["cpu_hotplug_replans_refused"] == 1
        assert counters["cpu_hotplug_replans"] == 0
        assert f.env.engine.policy is policy
        assert caplog.text.count("cannot be planned with them") == 1
        (refusal,) = [r for r in caplog.records if r.name == "shim.engine.hotplug"]
        assert "reserved CPUs 4 are not online" in refusal.fields["error"]  # type: ignore[attr-defined]


async def test_a_checkpoint_that_could_not_be_written_is_tried_again_without_full_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With resyncPeriod 0 no full look compares the CPUs again: a re-plan refused for the
    machine's sake (the disk) is tried again on its own, as a refused config file is."""
    async with following(tmp_path) as f:
        assert f.watcher.resync_period == 0
        checkpoint = f.env.engine.checkpoint
        save = checkpoint.save
        failures = [OSError(errno.ENOSPC, "No space left on device")]

        async def save_once_failing(state: CPUState) -> None:
            if failures:
                raise failures.pop()
            await save(state)

        monkeypatch.setattr(checkpoint, "save", save_once_failing)
        shared_pod = await f.env.kubelet.run_pod("web", "besteffort")
        shared_id = await f.env.kubelet.start_new(shared_pod, "main")
        f.take_offline(4)
        assert f.events is not None
        f.events.send(uevent("offline"))
        counters = f.env.engine.counters
        await until(lambda: counters["cpu_hotplug_replans_refused"] == 1, "the refusal")
        await f.replanned()
        assert 4 not in CPUSet.parse(f.env.kernel_cpus(shared_id) or "")
        assert counters["cpu_hotplug_replans_refused"] == 1


async def test_stopping_closes_the_uevent_socket_and_leaves_the_full_look(tmp_path: Path) -> None:
    async with following(tmp_path) as f:
        f.follower.stop()
        assert f.follower.check_soon not in f.watcher.full_look_hooks
        f.take_offline(4)
        await f.watcher.look_everywhere()
        await until(lambda: f.watcher.jobs.pending == 0, "watch jobs done")
        assert f.env.engine.counters["cpu_hotplug_replans"] == 0


def cgroup(path: Path, cpus: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cpuset.cpus").write_text(cpus + "\n")
    return path


def cpus_of(path: Path) -> str:
    return (path / "cpuset.cpus").read_text().strip()


def test_a_cpu_back_online_is_given_back_down_kubelets_tree_but_not_into_pods(
    tmp_path: Path,
) -> None:
    root = cgroup(tmp_path, "0-3")  # the kernel gives it back to the root alone
    top = cgroup(root / "kubepods", "0-2")
    qos = cgroup(top / "besteffort", "0-2")
    pod = cgroup(qos / "pod1", "0-2")
    sandbox = cgroup(pod / "sandbox", "0-2")
    pinned = cgroup(cgroup(top / "pod2", "0-2") / "pinned", "2")
    # A pod cpushim does not know yet (its sandbox on its way), known by its name, with a
    # container another client made.
    unknown = cgroup(qos / "pod0a1b2c3d-0000-4000-8000-000000000000", "0-2")
    untracked = cgroup(unknown / "untracked", "1")
    narrow = cgroup(top / "narrow", "1")  # a set of its own, without CPU 3 before either
    elsewhere = cgroup(root / "system.slice", "0-2")
    widened = give_back_online(
        top, CPUSet.parse("3"), CPUSet.parse("0-3"), pods={pod, top / "pod2"}
    )
    assert cpus_of(top) == cpus_of(qos) == cpus_of(pod) == cpus_of(unknown) == "0-3"
    assert cpus_of(top / "pod2") == "0-3"
    # Inside pods nothing: containers are cpushim's to write, located or not.
    assert cpus_of(sandbox) == "0-2"
    assert cpus_of(pinned) == "2"
    assert cpus_of(untracked) == "1"
    assert cpus_of(narrow) == "1,3"
    assert cpus_of(elsewhere) == "0-2"
    assert widened[0] == top
    assert set(widened) == {top, qos, pod, top / "pod2", unknown, narrow}


def test_the_systemd_drivers_pod_slices_are_where_the_give_back_stops(tmp_path: Path) -> None:
    root = cgroup(tmp_path, "0-3")
    top = cgroup(root / "kubepods.slice", "0-2")
    qos = cgroup(top / "kubepods-burstable.slice", "0-2")
    pod = cgroup(qos / "kubepods-burstable-pod0a1b2c3d_0000_4000_8000_000000000000.slice", "0-2")
    guaranteed = cgroup(top / "kubepods-pod5678.slice", "0-2")
    scopes = [
        cgroup(pod / "cri-containerd-abc.scope", "1"),
        cgroup(guaranteed / "cri-containerd-def.scope", "2"),
    ]
    give_back_online(top, CPUSet.parse("3"), CPUSet.parse("0-3"), pods=set())
    assert cpus_of(top) == cpus_of(qos) == cpus_of(pod) == cpus_of(guaranteed) == "0-3"
    assert [cpus_of(scope) for scope in scopes] == ["1", "2"]


def test_nothing_is_given_back_that_a_parent_lacks(tmp_path: Path) -> None:
    root = cgroup(tmp_path, "0-2")  # CPU 3 not back in the root (offline again)
    top = cgroup(root / "kubepods", "0-2")
    assert give_back_online(top, CPUSet.parse("3"), CPUSet.parse("0-3"), pods=set()) == []
    assert cpus_of(top) == "0-2"


def test_kubelets_tree_is_found_from_either_drivers_cgroup_parents(tmp_path: Path) -> None:
    layout = CgroupLayout(CgroupVersion.V1, tmp_path)
    parents = [
        "/kubepods/burstable/pod1234",
        "kubepods-besteffort-pod5678.slice",
        "",
    ]
    assert kubepods_tops(layout, parents) == {tmp_path / "kubepods", tmp_path / "kubepods.slice"}
    assert pod_cgroups(layout, parents) == {
        tmp_path / "kubepods" / "burstable" / "pod1234",
        tmp_path
        / "kubepods.slice"
        / "kubepods-besteffort.slice"
        / "kubepods-besteffort-pod5678.slice",
    }


async def test_a_cpu_back_online_is_not_given_to_a_container_whose_start_is_in_flight(
    tmp_path: Path,
) -> None:
    """Under v1 a pinned container's cgroup exists from its StartContainer on (runc makes it)
    while cpushim locates it only once the start answers: the give-back must not widen it."""
    async with following(tmp_path) as f:
        env, root = f.env, tmp_path / "cpuset"
        assert f.events is not None
        f.take_offline(3)
        f.events.send(uevent("offline", cpu=3))
        await f.replanned()
        pod = await env.kubelet.run_pod("db", "guaranteed")
        reply = await env.kubelet.create(pod, "main", 1000)
        container_id = pb.CreateContainerResponse.FromString(reply.messages[0]).container_id
        cgroup_dir = env.fake.cgroup_dir(container_id)
        assert cgroup_dir is not None
        # The kubepods tree as the kernel left it (CPU 3 gone from all but the root), and the
        # container's cgroup as runc makes it before the start answers.
        cgroup(root, "0-7")
        for level in cgroup_dir.relative_to(root).parents:
            if level.parts:
                cgroup(root / level, "0-2,4-7")
        cgroup(cgroup_dir, env.fake.containers[container_id].resources.cpuset_cpus)
        pinned = cpus_of(cgroup_dir)
        assert 3 not in CPUSet.parse(pinned)
        start = env.fake.gate("StartContainer")
        starting = asyncio.create_task(
            env.kubelet.call(
                "StartContainer",
                pb.StartContainerRequest(container_id=container_id).SerializeToString(),
            )
        )
        await until(lambda: env.fake.calls_of("StartContainer") != [], "the start sent")
        f.take_offline()
        f.events.send(uevent("online", cpu=3))
        pod_dir = cgroup_dir.parent
        await until(lambda: cpus_of(pod_dir) == "0-7", "the pod's cgroup given CPU 3")
        assert cpus_of(cgroup_dir) == pinned
        start.set()
        await starting
        await f.replanned(2)


async def shared_in_kubelets_tree(env: Env, root: Path) -> tuple[str, Path, list[Path]]:
    """A BestEffort container started: its id, its cgroup, and the cgroups of kubelet's tree
    above it below ``root`` (its pod's, its QoS class's, kubepods), deepest first."""
    pod = await env.kubelet.run_pod("web", "besteffort")
    shared_id = await env.kubelet.start_new(pod, "main")
    cgroup_dir = env.fake.cgroup_dir(shared_id)
    assert cgroup_dir is not None
    kubelets = [root / level for level in cgroup_dir.relative_to(root).parents if level.parts]
    return shared_id, cgroup_dir, kubelets


async def test_a_cpu_back_online_after_a_refused_re_plan_is_given_back_to_kubelets_tree(
    tmp_path: Path,
) -> None:
    """Under v1 the kernel took the reserved CPU out of kubelet's tree as it went offline;
    the re-plan was refused, so the plan still names it. Back online, the CPUs online are
    those planned again, yet kubelet's tree must get it back: the shared containers' sets
    name it, and runc could create none below a pod's cgroup without it."""
    async with following(tmp_path, reserved="0,4") as f:
        env, root = f.env, tmp_path / "cpuset"
        assert f.events is not None
        _, cgroup_dir, kubelets = await shared_in_kubelets_tree(env, root)
        cgroup(root, "0-7")
        for level in kubelets:
            cgroup(level, "0-7")
        f.take_offline(4)
        # What the kernel does under v1 as the CPU goes: out of every cpuset but the root's.
        for level in [*kubelets, cgroup_dir]:
            cgroup(level, "0-3,5-7")
        f.events.send(uevent("offline"))
        counters = env.engine.counters
        await until(lambda: counters["cpu_hotplug_replans_refused"] == 1, "the refusal")
        f.take_offline()
        f.events.send(uevent("online"))
        await until(
            lambda: all(cpus_of(level) == "0-7" for level in kubelets),
            "kubelet's tree given CPU 4 back",
        )
        # No change to re-plan for, so no move: the container's cgroup is looked at again
        # (the kernel's change made no event to watch), and written back as planned.
        await until(lambda: cpus_of(cgroup_dir) == "0-7", "the container given CPU 4 back")
        assert counters["cpu_hotplug_replans"] == 0


def memory_nodes_of(path: Path) -> str:
    return (path / "cpuset.mems").read_text().strip()


def test_memory_back_online_is_given_back_down_kubelets_tree_but_not_into_pods(
    tmp_path: Path,
) -> None:
    root = tmp_path
    tree = [root, root / "kubepods", root / "kubepods" / "besteffort"]
    pod = tree[-1] / "pod1"
    container = pod / "web"
    for directory, nodes in [*((d, "0-1") for d in tree[1:]), (root, "0-2"), (pod, "0-1")]:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpuset.mems").write_text(nodes + "\n")
    container.mkdir()
    (container / "cpuset.mems").write_text("0\n")
    widened = give_back_online(
        tree[1], CPUSet.parse("2"), CPUSet.parse("0-2"), {pod}, cgroups.CPUSET_MEMS
    )
    assert widened == [tree[1], tree[2], pod]
    assert [memory_nodes_of(d) for d in (*tree, pod)] == ["0-2"] * 4
    assert memory_nodes_of(container) == "0"


async def test_memory_come_online_is_given_back_to_kubelets_tree_as_it_is_followed(
    tmp_path: Path,
) -> None:
    """Under v1 the kernel adds a node whose memory came online to the root cpuset alone, as
    it does a CPU: kubelet's tree gets it before the re-plan names it for containers, or
    runc's writes of it below a pod's cgroup would be refused."""
    async with following(tmp_path) as f:
        env, root = f.env, tmp_path / "cpuset"
        assert f.events is not None
        shared_id, _, kubelets = await shared_in_kubelets_tree(env, root)
        for directory, nodes in [(root, "0-2"), *((level, "0-1") for level in kubelets)]:
            (directory / "cpuset.mems").write_text(nodes + "\n")
        f.with_memory_on("0-2")
        f.events.send(uevent("online", subsystem="memory", cpu=40))
        await f.replanned_for_memory()
        assert [memory_nodes_of(level) for level in kubelets] == ["0-2"] * len(kubelets)
        assert mems(env, shared_id) == "0-2"


@pytest.mark.parametrize("offline", [(), (4,)])
async def test_a_give_back_under_way_at_shutdown_leaves_the_stopped_watcher_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: tuple[int, ...]
) -> None:
    """The give-back walks kubelet's tree in a worker thread; cpushim stops meanwhile (the
    follower, then the watcher). What the give-back would lead to after it, checks of the
    containers (the CPUs online as planned) or a re-plan (CPU 4 gone), is not done: the
    watcher that would run them has stopped, and the next start plans anew."""
    walking, walked = threading.Event(), threading.Event()

    def held_walk(top: Path, *args: object) -> list[Path]:
        walking.set()
        assert walked.wait(10.0), "never let go"
        return [top]  # widened, as when the kernel had taken a CPU from the tree

    async with following(tmp_path) as f:
        assert f.events is not None
        shared_pod = await f.env.kubelet.run_pod("web", "besteffort")
        shared_id = await f.env.kubelet.start_new(shared_pod, "main")
        await until(lambda: shared_id in f.watcher._containers, "watched")
        monkeypatch.setattr(hotplug, "give_back_online", held_walk)
        checked: list[str] = []  # after the stop

        async def check(container_id: str) -> None:
            if f.watcher._stopped:
                checked.append(container_id)

        monkeypatch.setattr(f.watcher, "check", check)
        f.take_offline(*offline)
        f.events.send(uevent("offline" if offline else "online"))
        await until(walking.is_set, "the give-back under way")
        f.follower.stop()
        await f.watcher.stop()
        walked.set()
        await until(lambda: f.watcher.jobs.pending == 0, "the follower's check done")
        assert checked == []
        assert f.env.engine.counters["cpu_hotplug_replans"] == 0
