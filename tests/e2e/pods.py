"""Pods as kubelet starts them, for the tests that run cpushim with the static policy on two
CPUs (the ``shim`` fixture), and the checks those tests make on what comes back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tests.harness.images import TEST_IMAGE
from tests.harness.kubelet import (
    ONE_CPU,
    WORKLOAD,
    ContainerResources,
    KernelCpus,
    KubeletClient,
    QoSClass,
    Sandbox,
    new_pod_uid,
)

NO_RESOURCES = ContainerResources()


def run_pod(
    client: KubeletClient, name: str, qos: QoSClass, resources: ContainerResources = NO_RESOURCES
) -> tuple[Sandbox, str]:
    """A pod whose one container is created, not started."""
    sandbox = client.run_pod_sandbox(name, "default", new_pod_uid(), qos)
    container_id = client.create_container(
        sandbox,
        "main",
        TEST_IMAGE,
        WORKLOAD,
        resources=resources,
    )
    return sandbox, container_id


def start_pod(
    client: KubeletClient, name: str, qos: QoSClass, resources: ContainerResources = NO_RESOURCES
) -> tuple[Sandbox, str]:
    """A pod whose one container is started: kubelet's RunPodSandbox, CreateContainer and
    StartContainer."""
    sandbox, container_id = run_pod(client, name, qos, resources)
    client.start_container(container_id)
    return sandbox, container_id


def start_pinned(client: KubeletClient) -> tuple[Sandbox, str]:
    """A started Guaranteed pod whose container asks for one whole CPU: the ``shim`` fixture's
    cpushim pins it to CPU 1, the one CPU it can hand out."""
    return start_pod(client, "guaranteed", "guaranteed", ONE_CPU)


def start_shared_and_pinned(client: KubeletClient) -> tuple[str, Sandbox, str]:
    """A started BestEffort container, then a pinned one (see ``start_pinned``) that leaves it
    CPU 0: (the shared container's id, the pinned pod, the pinned container's id)."""
    _, shared_id = start_pod(client, "besteffort", "besteffort")
    pinned_pod, pinned_id = start_pinned(client)
    return shared_id, pinned_pod, pinned_id


def assert_kernel(kernel: KernelCpus, cpus: str) -> None:
    assert kernel.cpus_allowed_list == cpus, kernel
    assert kernel.cgroup_cpuset_cpus == cpus, kernel


def cgroup_cpus_of(client: KubeletClient, container_id: str) -> str:
    """The container's cgroup cpuset.cpus, whether or not its process runs yet."""
    path = client.container_info(container_id)["runtimeSpec"]["linux"]["cgroupsPath"]
    cgroup = Path("/sys/fs/cgroup/cpuset", path.lstrip("/"), "cpuset.cpus")
    if cgroup.exists():
        return cgroup.read_text().strip()
    # Created, not started: runc makes the cgroup at start from the spec.
    return client.recorded_cpuset_cpus(container_id)


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@contextlib.contextmanager
def shim_stopped(client: KubeletClient, sandbox_id: str) -> Iterator[int]:
    """The sandbox's containerd shim stopped (SIGSTOP), as a hung one: containerd's verbose
    PodSandboxStatus asks it for the task's state, and waits. Its pid; continued after."""
    pause = json.loads(client.pod_sandbox_status(sandbox_id, verbose=True).info["info"])["pid"]
    shim_pid = parent_pid(pause)
    assert Path(f"/proc/{shim_pid}/comm").read_text().startswith("containerd-shim")
    os.kill(shim_pid, signal.SIGSTOP)
    try:
        yield shim_pid
    finally:
        os.kill(shim_pid, signal.SIGCONT)


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[1])
