"""Watching on a real containerd: cpusets written back, exits seen, the state file rewritten.

Same machine and setup as test_inline_allocation: two CPUs, CPU 0 reserved, so a Guaranteed
1-CPU container gets CPU 1 and shared containers run on CPU 0 meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Shim
from tests.e2e.pods import (
    assert_kernel,
    run_pod,
    shim_stopped,
    start_pinned,
    start_pod,
    start_shared_and_pinned,
)
from tests.e2e.test_operations import Scrape, free_port, get
from tests.harness.containerd import PrivateContainerd, wait_for
from tests.harness.kubelet import (
    ONE_CPU,
    KubeletClient,
    Sandbox,
    cgroup_file,
    kernel_cpus_of_pid,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("two_cpus")]

REACTION_TIMEOUT = 10.0


def cpuset_file(client: KubeletClient, container_id: str) -> Path:
    cgroup = client.kernel_cpus(container_id).cgroup_path
    return Path("/sys/fs/cgroup/cpuset", cgroup.lstrip("/"), "cpuset.cpus")


def test_a_cpuset_written_by_hand_is_written_back(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    shim.start()
    kubelet = via()
    _, pinned_id = start_pinned(kubelet)
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")

    cpuset_file(kubelet, pinned_id).write_text("0-1")

    wait_for(
        lambda: kubelet.kernel_cpus(pinned_id).cgroup_cpuset_cpus == "1",
        REACTION_TIMEOUT,
        "the pinned container's cpuset written back",
    )
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")
    # containerd's record says the same (the repair went through it too).
    resources = direct.container_status(pinned_id).status.resources.linux
    assert resources.cpuset_cpus == "1"


def test_a_killed_container_gives_its_cpu_back_to_the_shared_ones(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    shim.start()
    kubelet = via()
    shared_id, pinned_pod, pinned_id = start_shared_and_pinned(kubelet)
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}

    os.kill(kubelet.container_pid(pinned_id), signal.SIGKILL)  # from outside, no kubelet call

    wait_for(
        lambda: kubelet.kernel_cpus(shared_id).cpus_allowed_list == "0-1",
        REACTION_TIMEOUT,
        "the shared container grown to both CPUs",
        on_timeout=lambda: shim.process.log() if shim.process else "",
    )
    assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
    assert shim.assignments() == {}


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_the_state_file_is_rewritten_when_someone_else_changes_it(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient], damage: str
) -> None:
    shim.start()
    kubelet = via()
    pinned_pod, pinned_id = start_pinned(kubelet)
    # The container id reaches the checkpoint just after CreateContainer returns.
    wait_for(
        lambda: pinned_id in shim.state_file.read_text(),
        REACTION_TIMEOUT,
        "the container id in the checkpoint",
    )
    good = shim.state_file.read_bytes()

    if damage == "delete":
        shim.state_file.unlink()
    else:
        shim.state_file.write_text('{"version": 1, "body": {"assignments": {}}}')

    def rewritten() -> bool:
        try:
            return shim.state_file.read_bytes() == good
        except FileNotFoundError:
            return False

    wait_for(rewritten, REACTION_TIMEOUT, "state.json rewritten from memory")
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}
    # And cpushim, restarted on it, keeps the assignment.
    shim.stop()
    shim.start()
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")


def started_on_a_config(
    shim: Shim, via: Callable[[], KubeletClient], config: Path, text: str
) -> tuple[KubeletClient, str, Sandbox, str]:
    """cpushim started on the config file ``config`` holding ``text`` (and no reserved-CPU
    flags of its own), then a shared container and a pinned one started through it: the
    client, the shared container's id, the pinned pod and its container's id."""
    config.write_text(text)
    shim.reserved_flags = ()
    shim.start("--config", str(config))
    kubelet = via()
    shared_id, pinned_pod, pinned_id = start_shared_and_pinned(kubelet)
    return kubelet, shared_id, pinned_pod, pinned_id


def test_a_config_edit_applies_live_and_a_bad_one_is_refused(
    shim: Shim, via: Callable[[], KubeletClient], tmp_path: Path
) -> None:
    config = tmp_path / "config.toml"
    kubelet, shared_id, pinned_pod, pinned_id = started_on_a_config(
        shim, via, config, 'reservedSystemCPUs = "0"\n'
    )
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")

    # Reserve CPU 1 instead: the pinned container moves to CPU 0, the shared one to CPU 1.
    replace_file(config, 'reservedSystemCPUs = "1"\n')
    wait_for(
        lambda: kubelet.kernel_cpus(pinned_id).cgroup_cpuset_cpus == "0",
        REACTION_TIMEOUT,
        "the pinned container moved off the newly reserved CPU",
    )
    assert_kernel(kubelet.kernel_cpus(pinned_id), "0")
    wait_for(
        lambda: kubelet.kernel_cpus(shared_id).cgroup_cpuset_cpus == "1",
        REACTION_TIMEOUT,
        "the shared container on the new shared pool",
    )
    assert_kernel(kubelet.kernel_cpus(shared_id), "1")
    assert shim.assignments() == {pinned_pod.uid: {"main": "0"}}

    # Not a CPU of this machine: refused, and nothing moves.
    config.write_text('reservedSystemCPUs = "7"\n')
    process = shim.process
    assert process is not None
    wait_for(
        lambda: "config file refused" in process.log(),
        REACTION_TIMEOUT,
        "the bad config refused",
    )
    refusal = next(line for line in process.log().splitlines() if "config file refused" in line)
    assert "reserved CPUs 7 are not online" in refusal
    assert_kernel(kubelet.kernel_cpus(pinned_id), "0")
    assert_kernel(kubelet.kernel_cpus(shared_id), "1")
    assert shim.assignments() == {pinned_pod.uid: {"main": "0"}}


def test_a_config_edit_moves_a_pinned_container_whose_shim_hangs_past_it(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient], tmp_path: Path
) -> None:
    """A reload that moves a pinned container goes through containerd (its quota and memory
    nodes move with its CPUs): with the container's pod shim hung, that update held every
    decision on the node until its deadline, again at every retry, and the container never
    left the CPU just reserved. The update is waited for 2 s at most: the CPUs are written
    into the cgroup past it, other pods are pinned meanwhile, and once the shim goes on the
    runtime gets the rest."""
    config = tmp_path / "config.toml"
    kubelet, shared_id, pinned_pod, pinned_id = started_on_a_config(
        shim, via, config, 'reservedSystemCPUs = "0"\n'
    )
    pinned_pid = direct.container_pid(pinned_id)
    cgroup = kernel_cpus_of_pid(pinned_pid).cgroup_path
    process = shim.process
    assert process is not None

    with shim_stopped(direct, pinned_pod.id):
        replace_file(config, 'reservedSystemCPUs = "1"\n')
        wait_for(
            lambda: kernel_cpus_of_pid(pinned_pid).cgroup_cpuset_cpus == "0",
            REACTION_TIMEOUT,
            "the pinned container moved off the newly reserved CPU",
            on_timeout=process.log,
        )
        assert_kernel(kernel_cpus_of_pid(pinned_pid), "0")
        assert shim.assignments() == {pinned_pod.uid: {"main": "0"}}
        # Decisions go on: a new pod is created and started through cpushim meanwhile.
        _, other_id = start_pod(kubelet, "other", "besteffort")
        assert_kernel(kubelet.kernel_cpus(other_id), "1")
        assert_kernel(kubelet.kernel_cpus(shared_id), "1")

    wait_for(
        lambda: direct.recorded_cpuset_cpus(pinned_id) == "0",
        30.0,
        "the runtime told of the move once the shim answers",
        on_timeout=process.log,
    )
    assert_kernel(kernel_cpus_of_pid(pinned_pid), "0")
    assert cgroup_file("cpu", cgroup, "cpu.cfs_quota_us") == "-1"


def test_a_config_edit_from_none_to_static_pins_a_running_guaranteed_container(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient], tmp_path: Path
) -> None:
    """As a restart under the new config would: no drain, no container restarted. (``direct``
    clears the pods of earlier tests first: they would compete for CPU 1.)"""
    config = tmp_path / "config.toml"
    kubelet, shared_id, pinned_pod, pinned_id = started_on_a_config(
        shim, via, config, 'cpuManagerPolicy = "none"\nreservedSystemCPUs = "0"\n'
    )
    pinned = kubelet.kernel_cpus(pinned_id)
    assert_kernel(pinned, "0-1")
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") != "-1"
    assert shim.assignments() == {}

    replace_file(config, 'reservedSystemCPUs = "0"\n')
    wait_for(
        lambda: kubelet.kernel_cpus(pinned_id).cgroup_cpuset_cpus == "1",
        REACTION_TIMEOUT,
        "the Guaranteed container pinned by the reload",
    )
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")
    assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == "-1"
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    assert shim.assignments() == {pinned_pod.uid: {"main": "1"}}


def test_containers_another_client_makes_on_containerd_are_taken_in(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """crictl or another CRI client on containerd's own socket, not cpushim's: its containers
    would run on the exclusive CPU until cpushim restarted. The full look (every second
    here) takes them in as start-up does: a shared one moves off the pinned CPU, and a
    Guaranteed one gets the CPU once it is free."""
    shim.start("--resync-period", "1")
    kubelet = via()
    _, pinned_id = start_pinned(kubelet)
    _, outsider_id = start_pod(direct, "outside", "besteffort")
    wait_for(
        lambda: direct.kernel_cpus(outsider_id).cgroup_cpuset_cpus == "0",
        REACTION_TIMEOUT,
        "the other client's container moved off the pinned CPU",
        on_timeout=lambda: shim.process.log() if shim.process else "",
    )
    assert_kernel(direct.kernel_cpus(outsider_id), "0")
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")
    # Tracked from now on: the pinned container's stop grows it before the reply.
    kubelet.stop_container(pinned_id, timeout=5)
    assert_kernel(direct.kernel_cpus(outsider_id), "0-1")
    guaranteed_pod, guaranteed_id = start_pinned(direct)
    wait_for(
        lambda: direct.kernel_cpus(guaranteed_id).cgroup_cpuset_cpus == "1",
        REACTION_TIMEOUT,
        "the other client's Guaranteed container pinned",
        on_timeout=lambda: shim.process.log() if shim.process else "",
    )
    assert_kernel(direct.kernel_cpus(guaranteed_id), "1")
    assert_kernel(direct.kernel_cpus(outsider_id), "0")
    assert shim.assignments() == {guaranteed_pod.uid: {"main": "1"}}


def test_a_created_container_another_client_removes_is_forgotten(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """kubelet created a Guaranteed container and had not started it when crictl, pointed at
    containerd's own socket, removed it: no process exits, no call passes through cpushim,
    and the pod stays. The full look (every second here) finds it gone: CPU 1 goes back, the
    shared container grows to it, and the container is forgotten rather than kept as exited
    until its pod goes."""
    metrics = f"http://127.0.0.1:{free_port()}"
    shim.start("--resync-period", "1", "--metrics-address", metrics.removeprefix("http://"))
    kubelet = via()
    _, shared_id = start_pod(kubelet, "shared", "besteffort")
    pod, created_id = run_pod(kubelet, "guaranteed", "guaranteed", ONE_CPU)
    assert shim.assignments() == {pod.uid: {"main": "1"}}
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    direct.remove_container(created_id)

    def forgotten() -> float:
        status, text = get(f"{metrics}/metrics")
        assert status == 200, text
        return Scrape(text).value("cpushim_removed_containers_found_total")

    wait_for(
        lambda: forgotten() == 1,
        REACTION_TIMEOUT,
        "the removed container forgotten",
        on_timeout=lambda: shim.process.log() if shim.process else "",
    )
    assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
    assert shim.assignments() == {}


def replace_file(path: Path, text: str) -> None:
    """As editors and config management do: a temporary file renamed over the old one."""
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(text)
    os.replace(temporary, path)


def test_after_a_containerd_restart_pins_releases_and_repairs_go_on(
    shim: Shim,
    containerd: PrivateContainerd,
    direct: KubeletClient,
    via: Callable[[], KubeletClient],
) -> None:
    """``systemctl restart containerd`` on a node (an upgrade): the containers run on, every
    connection to containerd drops, cpushim's own channel among them, and cpushim must go on
    as before: kubelet's next calls served, CPUs released and pinned, cpusets repaired."""
    shim.start()
    kubelet = via()
    shared_id, _, pinned_id = start_shared_and_pinned(kubelet)
    # The shared container's move to CPU 0 reaches containerd's record before the restart.
    wait_for(
        lambda: direct.recorded_cpuset_cpus(shared_id) == "0",
        REACTION_TIMEOUT,
        "containerd's record of the shared container before the restart",
    )
    containerd.restart()
    kubelet.wait_ready()  # through cpushim: kubelet's own way of waiting for its runtime
    assert_kernel(kubelet.kernel_cpus(pinned_id), "1")
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")

    kubelet.stop_container(pinned_id, timeout=5)
    assert_kernel(kubelet.kernel_cpus(shared_id), "0-1")
    assert shim.assignments() == {}
    # containerd's record of the shared container follows its cgroup again: only a call on
    # cpushim's own channel since the restart can have told it.
    wait_for(
        lambda: direct.recorded_cpuset_cpus(shared_id) == "0-1",
        REACTION_TIMEOUT,
        "containerd's record of the shared container",
    )
    next_pod, next_id = start_pinned(kubelet)
    assert_kernel(kubelet.kernel_cpus(next_id), "1")
    assert_kernel(kubelet.kernel_cpus(shared_id), "0")
    assert shim.assignments() == {next_pod.uid: {"main": "1"}}
    # The new container is watched, and its cpuset repaired.
    cpuset_file(kubelet, next_id).write_text("0-1")
    wait_for(
        lambda: kubelet.kernel_cpus(next_id).cgroup_cpuset_cpus == "1",
        REACTION_TIMEOUT,
        "the new pinned container's cpuset written back",
        on_timeout=lambda: shim.process.log() if shim.process else "",
    )


@contextlib.contextmanager
def small_tmpfs(directory: Path) -> Iterator[Path]:
    """``directory`` on a tmpfs of its own, 1 MiB: a disk that fills up in a moment."""
    directory.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: Path) -> Path:
    """A file that takes every free byte of ``directory``'s filesystem."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 4096)
    return filler


def test_a_fail_open_create_on_a_full_disk_is_pinned_once_the_disk_has_room(
    shim: Shim, direct: KubeletClient, via: Callable[[], KubeletClient]
) -> None:
    """The state directory's disk is full: the decision cannot be written, so under
    fail-open the create goes to containerd unchanged and the container runs on both CPUs.
    Once a checkpoint can be written again, a full look (every second here) gives it its
    exclusive CPU, as a restart would."""
    with small_tmpfs(shim.state_dir):
        shim.start("--failure-policy", "fail-open", "--resync-period", "1")
        kubelet = via()
        # The checkpoint is written over a spare file whose blocks it already has: without
        # one, a write needs new blocks.
        (shim.state_dir / ".state.json.spare").unlink()
        filler = fill(shim.state_dir)
        pod, container_id = start_pinned(kubelet)
        assert shim.process is not None
        assert "forwarding the call unchanged (fail-open)" in shim.process.log()
        assert kubelet.kernel_cpus(container_id).cgroup_cpuset_cpus == "0-1"
        filler.unlink()
        wait_for(
            lambda: kubelet.kernel_cpus(container_id).cgroup_cpuset_cpus == "1",
            REACTION_TIMEOUT,
            "the fail-open container pinned",
            on_timeout=lambda: shim.process.log() if shim.process else "",
        )
        pinned = kubelet.kernel_cpus(container_id)
        assert_kernel(pinned, "1")
        assert cgroup_file("cpu", pinned.cgroup_path, "cpu.cfs_quota_us") == "-1"
        assert shim.assignments() == {pod.uid: {"main": "1"}}
        kubelet.stop_container(container_id, timeout=5)
        assert shim.assignments() == {}
        shim.stop()
