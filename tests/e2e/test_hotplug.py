"""CPUs going offline and online on a real containerd, told by a real kernel uevent.

Taking one of this machine's two CPUs offline would take it out of every cpuset on the
machine (cgroup v1) for the rest of the run, so cpushim reads its CPUs from a generated sysfs
of the same shape, which the test changes, and the kernel is asked for a synthetic uevent
of the real CPU (writing the action to its ``uevent`` file), which reaches every listener as
a hotplug's does. The cpusets are the kernel's. The VM tests take a guest's CPU offline for
real.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from tests.e2e.conftest import Shim
from tests.e2e.pods import assert_kernel, start_pod
from tests.harness.containerd import wait_for
from tests.harness.kubelet import ONE_CPU, KubeletClient
from tests.harness.sysfs import MachineSpec, write_sysfs

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("two_cpus")]

REACTION_TIMEOUT = 10.0
MACHINE = MachineSpec(sockets=1, cores_per_die=2, threads_per_core=1)


def tell_the_kernel(action: str) -> None:
    Path("/sys/devices/system/cpu/cpu1/uevent").write_text(action)


def wait_until_on(shim: Shim, kubelet: KubeletClient, container_id: str, cpus: str) -> None:
    wait_for(
        lambda: kubelet.kernel_cpus(container_id).cpus_allowed_list == cpus,
        REACTION_TIMEOUT,
        f"container {container_id[:12]} on CPUs {cpus}",
        on_timeout=lambda: shim.process.log() if shim.process else "",
    )
    assert_kernel(kubelet.kernel_cpus(container_id), cpus)


def test_the_shared_pool_follows_a_cpu_going_offline_and_online(
    shim: Shim, via: Callable[[], KubeletClient], tmp_path: Path
) -> None:
    """Under the none policy (this machine's two CPUs leave the static one no room once one
    is offline: the unit tests cover the pinned container's move and the refusal) every
    container shares the CPUs online."""
    sysfs = write_sysfs(MACHINE, tmp_path / "sys")
    shim.reserved_flags = ()
    # No full looks: only the uevent can tell cpushim.
    shim.start("--policy", "none", "--sysfs-root", str(sysfs), "--resync-period", "0")
    kubelet = via()
    _, shared_id = start_pod(kubelet, "shared", "besteffort")
    _, guaranteed_id = start_pod(kubelet, "guaranteed", "guaranteed", ONE_CPU)
    for container_id in (shared_id, guaranteed_id):
        assert_kernel(kubelet.kernel_cpus(container_id), "0-1")

    shutil.rmtree(sysfs)
    write_sysfs(replace(MACHINE, offline=frozenset({1})), sysfs)
    tell_the_kernel("offline")
    for container_id in (shared_id, guaranteed_id):
        wait_until_on(shim, kubelet, container_id, "0")
    # A container created now is given the CPUs online only.
    _, later_id = start_pod(kubelet, "later", "burstable")
    assert_kernel(kubelet.kernel_cpus(later_id), "0")

    shutil.rmtree(sysfs)
    write_sysfs(MACHINE, sysfs)
    tell_the_kernel("online")
    for container_id in (shared_id, guaranteed_id, later_id):
        wait_until_on(shim, kubelet, container_id, "0-1")


def test_a_start_after_the_cpus_changed_re_plans_instead_of_refusing(
    shim: Shim, via: Callable[[], KubeletClient], tmp_path: Path
) -> None:
    """CPU 1 went offline while cpushim was down: its checkpoint was written for CPUs 0-1.
    It starts all the same, and the container is moved to the CPUs there are now."""
    sysfs = write_sysfs(MACHINE, tmp_path / "sys")
    shim.reserved_flags = ()
    flags = ("--policy", "none", "--sysfs-root", str(sysfs))
    shim.start(*flags)
    kubelet = via()
    _, shared_id = start_pod(kubelet, "shared", "besteffort")
    assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
    shim.stop()

    shutil.rmtree(sysfs)
    write_sysfs(replace(MACHINE, offline=frozenset({1})), sysfs)
    shim.start(*flags)
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    assert shim.process is not None
    assert "the CPUs changed since the checkpoint was written" in shim.process.log()
