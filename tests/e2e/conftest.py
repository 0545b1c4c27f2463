"""Fixtures for end-to-end tests against a real containerd, directly and through cpushim.

Prerequisites: root, ``containerd``, ``runc`` and ``ctr`` on PATH, and a static busybox to build
the test image from. Off CI a missing prerequisite skips the e2e tests with the reason; with
``CI=true`` it is an error, so a CI machine that lost containerd cannot pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.containerd import (
    PrivateContainerd,
    ServingProcess,
    ServingProcessError,
    cpushim_command,
)
from tests.harness.images import TEST_IMAGE, ImageBuildError, build_image, find_busybox
from tests.harness.kubelet import KubeletClient
from tests.harness.prerequisites import require

REPO_ROOT = Path(__file__).resolve().parents[2]
CPUSHIM_START_TIMEOUT = 20.0
CPUSHIM_STOP_TIMEOUT = 20.0


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
