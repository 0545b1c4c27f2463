"""Projected cpusets on a real containerd: what a container reads at /run/cpushim is what the
kernel gives it, and a subscriber on the host sees each change.

Same machine and setup as test_inline_allocation: two CPUs, CPU 0 reserved, so a Guaranteed
1-CPU container gets CPU 1 and shared containers run on CPU 0 meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from shim.cri import runtime_v1_pb2 as pb
from shim.projection import Projection, read, watch
from tests.e2e.conftest import Shim
from tests.e2e.pods import assert_kernel, start_pinned, start_pod
from tests.harness.containerd import projection_dir_for, wait_for
from tests.harness.images import TEST_IMAGE
from tests.harness.kubelet import ONE_CPU, WORKLOAD, KubeletClient, new_pod_uid

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("two_cpus")]

CHANGE_TIMEOUT = 10.0
# Inside the container: the projected files, then what the kernel says of the reader itself.
READ_INSIDE = (
    "cat /run/cpushim/cpus /run/cpushim/cpuset.json; grep Cpus_allowed_list /proc/self/status"
)


def read_inside(kubelet: KubeletClient, container_id: str) -> tuple[str, dict[str, object], str]:
    """(cpus file, cpuset.json, Cpus_allowed_list) as the container itself sees them."""
    result = kubelet.exec_sync(container_id, ["sh", "-c", READ_INSIDE])
    assert result.exit_code == 0, result.stderr.decode(errors="replace")
    cpus, state, allowed = result.stdout.decode().strip().splitlines()
    return cpus, json.loads(state), allowed.split(":", 1)[1].strip()


def host_directory(shim: Shim, pod_uid: str) -> Path:
    return projection_dir_for(shim.state_dir) / pod_uid / "main"


def test_a_shared_container_reads_its_cpuset_and_follows_a_pinning(
    shim: Shim, via: Callable[[], KubeletClient]
) -> None:
    shim.start()
    kubelet = via()
    shared_pod, shared_id = start_pod(kubelet, "besteffort", "besteffort")

    cpus, state, allowed = read_inside(kubelet, shared_id)
    assert cpus == allowed == "0-1"
    assert state["pool"] == "shared"
    assert state["exclusive"] is False
    assert state["cpus"] == "0-1"
    written = kubelet.exec_sync(shared_id, ["sh", "-c", "echo 1 > /run/cpushim/cpus"])
    assert written.exit_code != 0, "the projection is writable from inside the container"

    directory = host_directory(shim, shared_pod.uid)
    seen: list[Projection] = []

    async def follow_a_pinning() -> str:
        with anyio.fail_after(CHANGE_TIMEOUT):
            updates = watch(directory)
            first = await anext(updates)
            seen.append(first)
            assert first.cpus == "0-1"

            def pin() -> str:
                _, pinned_id = start_pinned(kubelet)
                return pinned_id

            pinned_id = await anyio.to_thread.run_sync(pin)
            async for update in updates:
                seen.append(update)
                if update.cpus == "0":
                    break
            await updates.aclose()
            return pinned_id

    pinned_id = anyio.run(follow_a_pinning)
    assert seen[-1].generation > seen[0].generation
    # The file changed after the kernel did: the shared container is on CPU 0 already.
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    cpus, state, allowed = read_inside(kubelet, shared_id)
    assert cpus == allowed == "0"
    assert state["generation"] == seen[-1].generation

    pinned = read_inside(kubelet, pinned_id)
    assert pinned[0] == pinned[2] == "1"
    assert pinned[1]["pool"] == "exclusive"
    assert pinned[1]["exclusive"] is True
    assert pinned[1]["mems"] == "0"

    kubelet.stop_container(pinned_id)
    assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
    wait_for(
        lambda: read(directory).cpus == "0-1",
        CHANGE_TIMEOUT,
        "the shared container's projection grown back to both CPUs",
    )


def test_removing_the_pod_removes_its_projection(
    shim: Shim, via: Callable[[], KubeletClient]
) -> None:
    shim.start()
    kubelet = via()
    pod, _ = start_pod(kubelet, "besteffort", "besteffort")
    directory = host_directory(shim, pod.uid)
    assert read(directory).cpus == "0-1"
    kubelet.teardown_pod(pod.id)
    # Removed once kubelet has RemovePodSandbox's reply.
    wait_for(lambda: not directory.parent.exists(), CHANGE_TIMEOUT, "the pod projection removed")


def test_a_container_with_a_read_only_volume_above_the_mount_point_starts(
    shim: Shim, via: Callable[[], KubeletClient], tmp_path: Path
) -> None:
    """runc cannot make /run/cpushim inside a read-only volume at /run: the container is
    created without the projection and runs, pinned as any other."""
    shim.start()
    kubelet = via()
    volume = tmp_path / "run-volume"
    volume.mkdir()
    sandbox = kubelet.run_pod_sandbox("ro-run", "default", new_pod_uid(), "guaranteed")
    container_id = kubelet.create_container(
        sandbox,
        "main",
        TEST_IMAGE,
        WORKLOAD,
        resources=ONE_CPU,
        volumes=[pb.Mount(container_path="/run", host_path=str(volume), readonly=True)],
    )
    kubelet.start_container(container_id)
    assert_kernel(kubelet.kernel_cpus(container_id), "1")
    listed = kubelet.exec_sync(container_id, ["ls", "/run"])
    assert listed.exit_code == 0, listed
    assert listed.stdout == b"", "the projection is mounted inside the read-only volume"
