"""Fixtures for end-to-end tests against a real containerd, directly and through cpushim.

Prerequisites: root, ``containerd``, ``runc`` and ``ctr`` on PATH, a static busybox to build the
test image from, and cgroup v1's cpuset hierarchy (the tests read v1 files; the VM tests cover
cgroup v2). Off CI a missing prerequisite skips the e2e tests with the reason; with
``CI=true`` it is an error, so a CI machine that lost containerd cannot pass by skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shim.cpuset import CPUSet
from tests.harness.containerd import (
    PrivateContainerd,
    ServingProcess,
    ServingProcessError,
    cpushim_command,
)
from tests.harness.images import TEST_IMAGE, ImageBuildError, build_image, find_busybox
from tests.harness.kubelet import KubeletClient
from tests.harness.prerequisites import on_ci, require

REPO_ROOT = Path(__file__).resolve().parents[2]
CPUSHIM_START_TIMEOUT = 20.0
CPUSHIM_STOP_TIMEOUT = 20.0
# What the tests read the kernel's cpusets from (tests.harness.kubelet.cgroup_file and others).
CPUSET_HIERARCHY = Path("/sys/fs/cgroup/cpuset")


def missing_prerequisites() -> list[str]:
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("root (containerd and runc need it)")
    missing += [
        f"{tool} on PATH" for tool in ("containerd", "runc", "ctr") if not shutil.which(tool)
    ]
    try:
        find_busybox()
    except ImageBuildError as error:
        missing.append(str(error))
    if not (CPUSET_HIERARCHY / "cpuset.cpus").is_file():
        missing.append(
            f"cgroup v1's cpuset hierarchy at {CPUSET_HIERARCHY} (these tests read v1 files;"
            " on a cgroup v2 host the VM tests, tests/vm, run cpushim end to end)"
        )
    return missing


@pytest.fixture(scope="session", autouse=True)
def e2e_prerequisites() -> None:
    require("e2e", missing_prerequisites())


@pytest.fixture(scope="session")
def containerd(e2e_prerequisites: None) -> Iterator[PrivateContainerd]:
    """A private containerd with the busybox test image imported (also its sandbox image)."""
    image = build_image(TEST_IMAGE)
    with PrivateContainerd(sandbox_image=image.ref) as instance:
        instance.import_image(image)
        with KubeletClient(instance.address, log_root=instance.dir / "pod-logs") as probe:
            probe.wait_ready()
        yield instance


@pytest.fixture(scope="session")
def cpushim(
    containerd: PrivateContainerd, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServingProcess]:
    """cpushim (``python -m shim run``) in front of the private containerd, as a relay: under
    the ``none`` policy every container gets every online CPU, so what kubelet sees through it
    matches the direct connection. The allocation tests start their own cpushim."""
    directory = tmp_path_factory.mktemp("cpushim")
    socket_path = directory / "cpushim.sock"
    shim = ServingProcess(
        cpushim_command(
            f"unix://{socket_path}",
            containerd.address,
            "--policy",
            "none",
            state_dir=directory / "state",
        ),
        socket_path=socket_path,
        log_path=directory / "cpushim.log",
        cwd=REPO_ROOT,
    )
    try:
        shim.start(timeout=CPUSHIM_START_TIMEOUT)
    except ServingProcessError as error:
        pytest.fail(str(error), pytrace=False)
    yield shim
    exit_code = shim.stop(timeout=CPUSHIM_STOP_TIMEOUT)
    assert exit_code == 0, f"cpushim exited with {exit_code} on SIGTERM; its log:\n{shim.log()}"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a test's CRI calls go: straight to containerd, or through cpushim."""

    name: str
    address: str


ENDPOINT_NAMES = ("direct", "via_cpushim")


def endpoint_for(name: str, request: pytest.FixtureRequest) -> Endpoint:
    containerd: PrivateContainerd = request.getfixturevalue("containerd")
    if name == "direct":
        return Endpoint(name, containerd.address)
    # Requested lazily so that the direct variant runs even while cpushim cannot start.
    shim: ServingProcess = request.getfixturevalue("cpushim")
    return Endpoint(name, shim.address)


@pytest.fixture(params=ENDPOINT_NAMES)
def endpoint(request: pytest.FixtureRequest) -> Endpoint:
    return endpoint_for(str(request.param), request)


@pytest.fixture(scope="session")
def pod_log_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One log root for every client, so pod log paths differ only by pod UID."""
    return tmp_path_factory.mktemp("pod-logs")


@pytest.fixture
def kubelet(endpoint: Endpoint, pod_log_root: Path) -> Iterator[KubeletClient]:
    """A kubelet-shaped client on ``endpoint``; pods it ran are torn down even on failure."""
    with KubeletClient(endpoint.address, log_root=pod_log_root) as client:
        try:
            yield client
        finally:
            errors = client.teardown_all()
            if errors:
                warnings.warn(
                    f"pod teardown on {endpoint.name} failed: {errors}",
                    RuntimeWarning,
                    stacklevel=1,
                )


# --- cpushim with the static policy on this machine's two CPUs --------------------------------
# The allocation tests (test_inline_allocation and those set up the same way) mark themselves
# with ``usefixtures("two_cpus")`` and start their own cpushim through ``shim``.


def online_cpus() -> CPUSet:
    return CPUSet.parse(Path("/sys/devices/system/cpu/online").read_text())


@pytest.fixture
def two_cpus() -> None:
    if len(online_cpus()) != 2:
        reason = f"these scenarios are written for a 2-CPU machine, this one has {online_cpus()}"
        if on_ci():
            # CI's end-to-end tests may not skip: a bigger CI machine must say so.
            pytest.fail(f"{reason} (CI=true: the end-to-end tests are mandatory)", pytrace=False)
        pytest.skip(reason)


class Shim:
    """cpushim with the static policy and CPU 0 reserved, restartable on one state dir."""

    def __init__(self, containerd: PrivateContainerd, directory: Path) -> None:
        self.containerd = containerd
        self.directory = directory
        self.state_dir = directory / "state"
        self.socket_path = directory / "cpushim.sock"
        self.process: ServingProcess | None = None
        self.runs = 0
        # Flags that would override a config file's keys; a test with a config clears them.
        self.reserved_flags: tuple[str, ...] = ("--reserved-cpus", "0")

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def command(self, *extra: str) -> list[str]:
        return cpushim_command(
            self.address,
            self.containerd.address,
            *self.reserved_flags,
            *extra,
            state_dir=self.state_dir,
        )

    def start(self, *extra: str) -> None:
        self.runs += 1
        self.process = ServingProcess(
            self.command(*extra),
            socket_path=self.socket_path,
            log_path=self.directory / f"cpushim-{self.runs}.log",
            cwd=REPO_ROOT,
        )
        try:
            self.process.start(timeout=CPUSHIM_START_TIMEOUT)
        except ServingProcessError as error:
            pytest.fail(str(error), pytrace=False)

    def stop(self) -> None:
        if self.process is not None:
            code = self.process.stop(timeout=CPUSHIM_STOP_TIMEOUT)
            assert code == 0, f"cpushim exited {code}; its log:\n{self.process.log()}"
            self.process = None

    def kill(self) -> None:
        assert self.process is not None
        assert self.process.process is not None
        os.kill(self.process.process.pid, signal.SIGKILL)
        self.process.process.wait(10)
        self.process = None

    def assignments(self) -> dict[str, dict[str, str]]:
        """pod uid -> container name -> CPUs, from the checkpoint."""
        body = json.loads(self.state_file.read_text())["body"]
        return {
            uid: {name: entry["cpus"] for name, entry in containers.items()}
            for uid, containers in body["assignments"].items()
        }


@pytest.fixture
def direct(containerd: PrivateContainerd) -> Iterator[KubeletClient]:
    """A client straight to containerd; every pod it or ``via`` made is torn down after."""
    with KubeletClient(containerd.address, log_root=containerd.dir / "pod-logs") as client:
        # Nothing from other tests may be running: cpushim would adopt it.
        for sandbox in client.list_pod_sandbox().items:
            client.teardown_pod(sandbox.id)
        yield client
        for sandbox in client.list_pod_sandbox().items:
            client.teardown_pod(sandbox.id)


@pytest.fixture
def shim(containerd: PrivateContainerd, tmp_path: Path) -> Iterator[Shim]:
    instance = Shim(containerd, tmp_path)
    yield instance
    if instance.process is not None:
        instance.stop()


@pytest.fixture
def via(shim: Shim, containerd: PrivateContainerd) -> Iterator[Callable[[], KubeletClient]]:
    """Opens a kubelet client on cpushim's socket (after the test has started cpushim)."""
    clients: list[KubeletClient] = []

    def open_client() -> KubeletClient:
        client = KubeletClient(shim.address, log_root=containerd.dir / "pod-logs")
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()
