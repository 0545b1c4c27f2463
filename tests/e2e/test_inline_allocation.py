"""Inline allocation through cpushim on a real containerd, checked by what the kernel says.

This machine has two CPUs; cpushim reserves CPU 0, so CPU 1 is the only one it can hand out
exclusively. Each test starts its own cpushim (static policy) on a fresh state directory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tests.e2e.conftest import CPUSHIM_START_TIMEOUT, REPO_ROOT, Shim
from tests.e2e.pods import (
    assert_kernel,
    cgroup_cpus_of,
    rpc_error,
    run_pod,
    shim_stopped,
    start_pinned,
    start_pod,
    start_shared_and_pinned,
)
from tests.e2e.test_operations import Scrape, free_port, get
from tests.harness.containerd import (
    ServingProcess,
    ServingProcessError,
    projection_dir_for,
    wait_for,
)
from tests.harness.crash import interrupted_checkpoint_write
from tests.harness.images import TEST_IMAGE
from tests.harness.kubelet import (
    MIB,
    ONE_CPU,
    WORKLOAD,
    ContainerResources,
    KubeletClient,
    cgroup_file,
    kernel_cpus_of_pid,
    milli_cpu_to_quota,
    new_pod_uid,
    read_status_field,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("two_cpus")]

# How long cpushim may take to act on what it is told in the background (an adoption).
REACTION_TIMEOUT = 10.0


def test_pinning_moves_shared_containers_before_create_and_back_before_stop_returns(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    shim.start()
    kubelet = via()
    _, shared_id = start_pod(kubelet, "besteffort", "besteffort")
    assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")

    pinned_pod, pinned_id = run_pod(kubelet, "guaranteed", "guaranteed", ONE_CPU)
    # Before the Guaranteed container has even started, the shared one is off CPU 1.
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    assert cgroup_cpus_of(kubelet, pinned_id) == "1"
    kubelet.start_container(pinned_id)
    pinned = kubelet.kernel_cpus(pinned_id)
    assert_kernel(pinned, "1")
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == "-1"
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}

    # No CPU is left: the next Guaranteed container is refused, and nothing is created.
    refused_pod = kubelet.run_pod_sandbox("refused", "default", new_pod_uid(), "guaranteed")
    error = rpc_error(
        lambda: kubelet.create_container(
            refused_pod,
            "main",
            TEST_IMAGE,
            WORKLOAD,
            resources=ONE_CPU,
        )
    )
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "default/refused" in (error.details() or "")
    assert "1 exclusive CPU" in (error.details() or "")
    assert list(direct.list_containers(sandbox_id=refused_pod.id).containers) == []
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}

    # When StopContainer returns, the shared container already runs on both CPUs again.
    kubelet.stop_container(pinned_id, timeout=5)
    assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
    assert shim.assignments() == {}

    # The freed CPU goes to the container that was refused.
    retried_id = kubelet.create_container(
        refused_pod,
        "main",
        TEST_IMAGE,
        WORKLOAD,
        resources=ONE_CPU,
    )
    kubelet.start_container(retried_id)
    assert_kernel(kubelet.kernel_cpus(retried_id), "1")
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")


def test_sigkill_and_restart_keep_every_assignment(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    shim.start()
    kubelet = via()
    shared_id, pinned_pod, pinned_id = start_shared_and_pinned(kubelet)
    before = shim.assignments()
    assert before == {pinned_pod.uid: {"main": "1"}}

    shim.kill()
    # Had it died inside a checkpoint write, that write's temporary file would be left too.
    left = interrupted_checkpoint_write(shim.state_file)
    shim.start()
    kubelet = via()
    assert shim.assignments() == before
    assert not left.exists()
    assert shim.process is not None
    assert "interrupted checkpoint writes" in shim.process.log()
    assert left.name in shim.process.log()
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    # It still knows CPU 1 is taken...
    late_pod = kubelet.run_pod_sandbox("late", "default", new_pod_uid(), "guaranteed")
    error = rpc_error(
        lambda: kubelet.create_container(
            late_pod, "main", TEST_IMAGE, WORKLOAD, resources=ContainerResources(1000, 1000)
        )
    )
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # ...and by whom: stopping the pinned container frees it and grows the shared one.
    kubelet.stop_container(pinned_id, timeout=5)
    assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
    assert shim.assignments() == {}


def test_containers_created_while_cpushim_was_down_are_adopted(
    shim: Shim, direct: KubeletClient
) -> None:
    shared_id, pinned_pod, pinned_id = start_shared_and_pinned(direct)
    assert_kernel(direct.kernel_cpus(pinned_id), "0-1")

    shim.start()
    # cpushim serves only once the resync has applied the state.
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}
    assert_kernel(direct.kernel_cpus(pinned_id), "1")
    assert_kernel(direct.kernel_cpus(shared_id), "0")


@pytest.mark.parametrize("recover", [False, True], ids=["checkpoint", "recovered"])
def test_a_pod_whose_shim_hangs_keeps_neither_cpushim_down_nor_its_cpu(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient], recover: bool
) -> None:
    """One hung shim used to stop cpushim's start-up (and so kubelet's runtime): the pod's
    class now comes from its container's cgroup, and its CPU stays."""
    shim.start()
    shared_id, pinned_pod, pinned_id = start_shared_and_pinned(via())
    shim.stop()
    with shim_stopped(direct, pinned_pod.id):
        shim.start(*(["--recover-from-runtime"] if recover else []))
        assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}
        assert_kernel(direct.kernel_cpus(pinned_id), "1")
        assert_kernel(direct.kernel_cpus(shared_id), "0")
        assert shim.process is not None
        assert "cannot read a sandbox's verbose status" in shim.process.log()
        # It serves, and knows CPU 1 is taken.
        kubelet = via()
        late_pod = kubelet.run_pod_sandbox("late", "default", new_pod_uid(), "guaranteed")
        error = rpc_error(
            lambda: kubelet.create_container(
                late_pod, "main", TEST_IMAGE, WORKLOAD, resources=ContainerResources(1000, 1000)
            )
        )
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_hung_shim_holds_up_no_other_pods_pinning_or_release(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """The shim of a shared container's pod hangs. cpushim's record of that container's
    move (a second after it) gets no answer: past its deadline the container's runtime is
    taken for stuck, and other pods' pinnings and releases move it in its cgroup without
    waiting for its shim. Once the shim goes on, the records it held land, and the cgroup
    ends with the latest cpuset, as does the runtime's record."""
    metrics = f"http://127.0.0.1:{free_port()}"
    shim.start("--metrics-address", metrics.removeprefix("http://"))
    kubelet = via()
    shared_pod, shared_id = start_pod(kubelet, "shared", "besteffort")
    _, pinned_id = start_pinned(kubelet)
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")

    def stuck() -> float:
        status, text = get(f"{metrics}/metrics")
        assert status == 200, text
        return Scrape(text).value("cpushim_stuck_runtime_containers")

    def log() -> str:
        return shim.process.log() if shim.process else ""

    with shim_stopped(direct, shared_pod.id):
        wait_for(lambda: stuck() == 1, 30.0, "the record past its deadline", on_timeout=log)
        kubelet.stop_container(pinned_id)
        assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
        kubelet.remove_container(pinned_id)
        _, second_id = start_pinned(kubelet)
        assert_kernel(kubelet.kernel_cpus(second_id), "1")
        assert_kernel(kubelet.kernel_cpus(shared_id), "0")
        assert "the runtime does not answer for a container" in log()

    wait_for(lambda: stuck() == 0, 30.0, "the shim answering again", on_timeout=log)
    wait_for(
        lambda: kubelet.recorded_cpuset_cpus(shared_id) == "0",
        REACTION_TIMEOUT,
        "the latest cpuset recorded",
        on_timeout=log,
    )
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    assert_kernel(kubelet.kernel_cpus(second_id), "1")


def test_kubelets_resize_of_a_pinned_container_whose_shim_hangs_holds_up_no_other_pod(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """kubelet resizes a pinned container in place to half a CPU while its pod's shim hangs:
    the resize gives CPU 1 back. cpushim waits for containerd a moment only, then writes the
    container's cgroup past the call, so a Guaranteed pod created meanwhile gets CPU 1 and
    runs there alone, the resized container moved off it. Once the shim goes on, the resize
    is answered and the runtime's record holds the latest cpuset."""
    shim.start()
    kubelet = via()
    shared_id, pinned_pod, pinned_id = start_shared_and_pinned(kubelet)
    pinned_pid = direct.container_pid(pinned_id)
    half = kubelet.linux_resources("guaranteed", ContainerResources(500, 500, 32 * MIB, 32 * MIB))
    resizer = via()
    process = shim.process
    assert process is not None

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with shim_stopped(direct, pinned_pod.id):
            resize = pool.submit(resizer.update_container_resources, pinned_id, half)
            wait_for(
                lambda: kernel_cpus_of_pid(pinned_pid).cgroup_cpuset_cpus == "0-1",
                REACTION_TIMEOUT,
                "the resized container moved past the held call",
                on_timeout=process.log,
            )
            second_pod, second_id = start_pinned(kubelet)
            assert_kernel(kubelet.kernel_cpus(second_id), "1")
            assert_kernel(kernel_cpus_of_pid(pinned_pid), "0")
            assert_kernel(kubelet.kernel_cpus(shared_id), "0")
            assert not resize.done()
        resize.result(timeout=60)

    wait_for(
        lambda: direct.recorded_cpuset_cpus(pinned_id) == "0",
        30.0,
        "the latest cpuset recorded",
        on_timeout=process.log,
    )
    assert_kernel(kernel_cpus_of_pid(pinned_pid), "0")
    assert_kernel(kubelet.kernel_cpus(second_id), "1")
    assert shim.assignments() == {second_pod.uid: {"main": "1"}}


def test_a_container_kubelets_static_policy_pinned_is_adopted_with_its_cpu_and_no_quota(
    shim: Shim, direct: KubeletClient
) -> None:
    """Switching a node from kubelet's static policy: its containers run on their exclusive
    CPU with kubelet's CFS quota. cpushim keeps the CPU and gives the container what an
    exclusive container of its own has: no quota (and the memory nodes of its CPU)."""
    sandbox = direct.run_pod_sandbox("static", "default", new_pod_uid(), "guaranteed")
    pinned_id = direct.create_container(
        sandbox, "main", TEST_IMAGE, WORKLOAD, resources=ONE_CPU, cpuset_cpus="1"
    )
    direct.start_container(pinned_id)
    pinned = direct.kernel_cpus(pinned_id)
    assert_kernel(pinned, "1")
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == str(
        milli_cpu_to_quota(1000)
    )

    shim.start()
    assert shim.assignments() == {sandbox.uid: {"main": "1"}}
    assert_kernel(direct.kernel_cpus(pinned_id), "1")
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == "-1"
    nodes = Path("/sys/devices/system/node/online").read_text().strip()
    assert cgroup_file("cpuset", pinned.cgroup_path, "cpuset.mems") == nodes  # one node here
    assert direct.container_info(pinned_id)["runtimeSpec"]["linux"]["resources"]["cpu"][
        "quota"
    ] in (-1, None)
    # A restart keeps it so (the unit tests check that it sends no update again).
    shim.stop()
    shim.start()
    assert shim.assignments() == {sandbox.uid: {"main": "1"}}
    assert_kernel(direct.kernel_cpus(pinned_id), "1")
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == "-1"


def test_a_container_that_loses_its_cpu_to_a_new_policy_gets_kubelets_quota_back(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    shim.start()
    kubelet = via()
    _, pinned_id = start_pinned(kubelet)
    cgroup = direct.kernel_cpus(pinned_id).cgroup_path
    assert cgroup_file("cpu", cgroup, "cpu.cfs_quota_us") == "-1"
    shim.stop()

    # No CPU is exclusive under the none policy: it shares, bounded by its own limit again.
    shim.start("--policy", "none")
    assert shim.assignments() == {}
    assert_kernel(direct.kernel_cpus(pinned_id), "0-1")
    assert cgroup_file("cpu", cgroup, "cpu.cfs_quota_us") == str(milli_cpu_to_quota(1000))
    # Its memory nodes go back too; this machine has one, so the unit tests check that.


def test_kubelets_in_place_resize_without_room_is_refused_and_changes_nothing(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """kubelet (InPlacePodVerticalScaling; its CPU manager off behind cpushim) resizes a
    running container with UpdateContainerResources, memory and CPU in calls of their own.
    The memory resize goes through, the cpuset staying cpushim's, without a CFS quota. The
    CPU resize to 2 CPUs, which this machine cannot give (CPU 0 is reserved), is refused with
    RESOURCE_EXHAUSTED (kubelet retries at every sync of the pod), changing nothing."""
    shim.start()
    kubelet = via()
    pinned_pod, pinned_id = start_pinned(kubelet)
    memory = kubelet.linux_resources(
        "guaranteed", ContainerResources(1000, 1000, 64 * MIB, 64 * MIB)
    )
    kubelet.update_container_resources(pinned_id, memory)
    pinned = direct.kernel_cpus(pinned_id)
    assert_kernel(pinned, "1")
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == "-1"
    assert int(cgroup_file("memory", pinned.cgroup_path, "memory.limit_in_bytes")) == 64 * MIB

    cpu = kubelet.linux_resources("guaranteed", ContainerResources(2000, 2000, 64 * MIB, 64 * MIB))
    error = rpc_error(lambda: kubelet.update_container_resources(pinned_id, cpu))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    details = error.details() or ""
    assert "in place to 2 exclusive CPUs: cannot allocate 2 CPUs" in details, details
    pinned = direct.kernel_cpus(pinned_id)
    assert_kernel(pinned, "1")
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == "-1"
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.shares") == "1024"
    assert direct.recorded_cpuset_cpus(pinned_id) == "1"
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}
    assert shim.process is not None
    [warning] = [
        json.loads(line)
        for line in shim.process.log().splitlines()
        if "in-place CPU resize refused" in line
    ]
    assert warning["container_id"] == pinned_id
    assert (warning["exclusive_cpus_held"], warning["exclusive_cpus_asked"]) == (1, 2)


def test_kubelets_in_place_resize_to_a_fraction_and_back_moves_the_container_live(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """kubelet resizes a pinned Guaranteed container in place to half a CPU: it gives CPU 1
    back and shares, bounded by kubelet's quota, and the shared container is grown onto
    CPU 1 once the resized one has left it. Resized to one CPU again, it gets CPU 1 back,
    the shared container moved off first. Its projection follows, and so does the
    checkpoint; the process keeps running throughout."""
    shim.start()
    kubelet = via()
    shared_id, pinned_pod, pinned_id = start_shared_and_pinned(kubelet)
    pid = direct.kernel_cpus(pinned_id).pid
    projection = projection_dir_for(shim.state_dir) / pinned_pod.uid / "main"

    half = kubelet.linux_resources("guaranteed", ContainerResources(500, 500, 64 * MIB, 64 * MIB))
    kubelet.update_container_resources(pinned_id, half)
    resized = direct.kernel_cpus(pinned_id)
    assert_kernel(resized, "0-1")
    assert resized.pid == pid
    assert cgroup_file("cpu", resized.cgroup_path, "cpu.cfs_quota_us") == str(
        milli_cpu_to_quota(500)
    )
    assert direct.recorded_cpuset_cpus(pinned_id) == "0-1"
    assert_kernel(direct.kernel_cpus(shared_id), "0-1")
    assert shim.assignments() == {}
    assert (projection / "cpus").read_text().strip() == "0-1"
    assert json.loads((projection / "cpuset.json").read_text())["exclusive"] is False

    whole = kubelet.linux_resources(
        "guaranteed", ContainerResources(1000, 1000, 64 * MIB, 64 * MIB)
    )
    kubelet.update_container_resources(pinned_id, whole)
    pinned = direct.kernel_cpus(pinned_id)
    assert_kernel(pinned, "1")
    assert pinned.pid == pid
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == "-1"
    assert direct.recorded_cpuset_cpus(pinned_id) == "1"
    assert_kernel(direct.kernel_cpus(shared_id), "0")
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}
    assert (projection / "cpus").read_text().strip() == "1"
    assert json.loads((projection / "cpuset.json").read_text())["exclusive"] is True
    assert shim.process is not None
    resizes = [
        json.loads(line) for line in shim.process.log().splitlines() if "resized in place" in line
    ]
    assert [(r["cpus_before"], r["cpus"]) for r in resizes] == [("1", "shared"), ("shared", "1")]


def test_a_container_left_sharing_for_want_of_room_is_pinned_once_resized_to_fit(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """A Guaranteed 2-CPU container made while cpushim was down finds one CPU to hand out,
    and shares. kubelet resizes it in place to one CPU: with no full looks (resync period
    0) and no release, the resize alone gets it adopted onto CPU 1."""
    _, shared_id = start_pod(direct, "besteffort", "besteffort")
    big_pod, big_id = start_pod(direct, "big", "guaranteed", ContainerResources(2000, 2000))
    shim.start("--resync-period", "0")
    assert shim.assignments() == {}
    assert_kernel(direct.kernel_cpus(big_id), "0-1")
    kubelet = via()
    kubelet.update_container_resources(
        big_id, kubelet.linux_resources("guaranteed", ContainerResources(1000, 1000))
    )
    wait_for(
        lambda: (
            shim.assignments() == {big_pod.uid: {"main": "1"}}
            and direct.kernel_cpus(big_id).cgroup_cpuset_cpus == "1"
        ),
        REACTION_TIMEOUT,
        "the resized container pinned",
    )
    assert_kernel(direct.kernel_cpus(big_id), "1")
    assert_kernel(direct.kernel_cpus(shared_id), "0")
    assert shim.process is not None
    assert "gave containers that shared the exclusive CPUs they ask for" in shim.process.log()


def test_kubelets_memory_nodes_are_checked_then_kept(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """kubelet's Static memory manager sends the NUMA nodes of a Guaranteed container in
    ``cpuset_mems``. A value that is no list of nodes is refused before anything is created;
    the nodes stay the container's. (The VM guests check that they steer the CPUs.)"""
    shim.start()
    kubelet = via()
    nodes = Path("/sys/devices/system/node/online").read_text().strip()
    pod = kubelet.run_pod_sandbox("numa", "default", new_pod_uid(), "guaranteed")
    error = rpc_error(
        lambda: kubelet.create_container(
            pod, "main", TEST_IMAGE, WORKLOAD, resources=ONE_CPU, cpuset_mems="node0"
        )
    )
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "pod default/numa container main: cpuset_mems 'node0'" in (error.details() or "")
    assert list(direct.list_containers(sandbox_id=pod.id).containers) == []
    assert shim.assignments() == {}

    container_id = kubelet.create_container(
        pod, "main", TEST_IMAGE, WORKLOAD, resources=ONE_CPU, cpuset_mems=nodes
    )
    kubelet.start_container(container_id)
    pinned = kubelet.kernel_cpus(container_id)
    assert_kernel(pinned, "1")
    assert cgroup_file("cpuset", pinned.cgroup_path, "cpuset.mems") == nodes
    assert shim.assignments() == {pod.uid: {"main": "1"}}
    saved = json.loads(shim.state_file.read_text())["body"]["assignments"][pod.uid]["main"]
    assert saved["mems"] == nodes


def test_a_corrupt_checkpoint_stops_start_up_until_recovered_from_the_runtime(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    shim.start()
    kubelet = via()
    pinned_pod, pinned_id = start_pinned(kubelet)
    shim.stop()
    text = shim.state_file.read_text()
    shim.state_file.write_text(text.replace('"cpus": "1"', '"cpus": "0"'))

    refused = ServingProcess(
        shim.command(),
        socket_path=shim.socket_path,
        log_path=shim.directory / "refused.log",
        cwd=REPO_ROOT,
    )
    with pytest.raises(ServingProcessError, match="exited with 1") as caught:
        refused.start(timeout=CPUSHIM_START_TIMEOUT)
    assert "checksum does not match" in str(caught.value)
    assert "--recover-from-runtime" in str(caught.value)

    shim.start("--recover-from-runtime")
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}
    kept = [p.name for p in shim.state_dir.iterdir() if p.name.startswith("state.json.replaced-")]
    assert len(kept) == 1
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")


def test_a_shared_container_with_cgroups_of_its_own_moves_with_them(
    shim: Shim, via: Callable[[], KubeletClient]
) -> None:
    """cgroup v1 refuses to shrink a cpuset below a child's (EBUSY), through ``runc update``
    too: a container running its own containers (Docker in a pod) would keep the CPU handed
    out exclusively. cpushim moves the children with it."""
    shim.start()
    kubelet = via()
    _, shared_id = start_pod(kubelet, "besteffort", "besteffort")
    cgroup = Path("/sys/fs/cgroup/cpuset", kubelet.kernel_cpus(shared_id).cgroup_path.lstrip("/"))
    inner = cgroup / "inner"  # as a runtime inside the container makes it: every CPU
    job = inner / "job"  # one of its containers, pinned to CPU 1
    for directory, cpus in ((inner, "0-1"), (job, "1")):
        directory.mkdir()
        (directory / "cpuset.cpus").write_text(cpus)
        (directory / "cpuset.mems").write_text((cgroup / "cpuset.mems").read_text())
    worker = subprocess.Popen(["sleep", "600"])
    try:
        (job / "tasks").write_text(str(worker.pid))
        assert read_status_field(worker.pid, "Cpus_allowed_list") == "1"

        _, pinned_id = start_pinned(kubelet)
        assert_kernel(kubelet.kernel_cpus(pinned_id), "1")
        assert_kernel(kubelet.kernel_cpus(shared_id), "0")
        assert (inner / "cpuset.cpus").read_text().strip() == "0"
        # Nothing of CPU 1 is left to the job: it gets what the container has.
        assert (job / "cpuset.cpus").read_text().strip() == "0"
        assert read_status_field(worker.pid, "Cpus_allowed_list") == "0"

        kubelet.stop_container(pinned_id, timeout=5)
        assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
        # The runtime's cgroup follows the container back; the job gets its own CPU again,
        # as cgroup v2 would show it.
        assert (inner / "cpuset.cpus").read_text().strip() == "0-1"
        assert (job / "cpuset.cpus").read_text().strip() == "1"
        assert read_status_field(worker.pid, "Cpus_allowed_list") == "1"
    finally:
        worker.kill()
        worker.wait()
        for directory in (job, inner):
            with contextlib.suppress(FileNotFoundError):
                directory.rmdir()


def test_a_pod_with_pod_level_resources_gets_no_exclusive_cpus(
    shim: Shim, via: Callable[[], KubeletClient]
) -> None:
    """spec.resources cpu 1, memory 64Mi, and two containers with no limits of their own:
    kubelet gives each the pod's (its sandbox config carries the pod's totals). The first is
    pinned to CPU 1, as a one-container pod would be; the second shows the pod-level
    resources, and both share CPUs 0-1 with kubelet's quota, as kubelet's static policy
    would have them. A restart keeps it so."""
    shim.start()
    kubelet = via()
    whole_pod = ContainerResources(1000, 1000, 64 * MIB, 64 * MIB)
    sandbox = kubelet.run_pod_sandbox(
        "pod-level", "default", new_pod_uid(), "guaranteed", pod_resources=whole_pod
    )
    first = kubelet.create_container(sandbox, "app", TEST_IMAGE, WORKLOAD, resources=whole_pod)
    kubelet.start_container(first)
    assert_kernel(kubelet.kernel_cpus(first), "1")
    second = kubelet.create_container(sandbox, "helper", TEST_IMAGE, WORKLOAD, resources=whole_pod)
    kubelet.start_container(second)
    for container_id in (first, second):
        assert_kernel(kubelet.kernel_cpus(container_id), "0-1")
    quota = cgroup_file("cpu", kubelet.kernel_cpus(first).cgroup_path, "cpu.cfs_quota_us")
    assert quota == str(milli_cpu_to_quota(1000))
    assert shim.assignments() == {}
    shim.stop()
    shim.start()
    for container_id in (first, second):
        assert_kernel(kubelet.kernel_cpus(container_id), "0-1")
    assert shim.assignments() == {}
