"""CRI calls from grpc-go, kubelet's own gRPC stack, straight to containerd and through cpushim.

cpushim rewrites SETTINGS so that both peers use an HPACK dynamic table of size 0, and relies on
their encoders applying it (docs/architecture.md, "Self-contained header blocks"). grpcio and
python h2 are covered elsewhere; here a small grpc-go client (tests/harness/goclient/main.go,
grpc-go 1.33 from Debian, dialled the way kubelet dials) makes the same calls on both paths. The
answers must be the same, and cpushim's debug log must say the client's header blocks became
self-contained: the proof that grpc-go honours the setting.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shim.cri import runtime_v1_pb2 as pb
from tests.harness.containerd import PrivateContainerd, ServingProcess, wait_for
from tests.harness.goclient import (
    INSTALL_HINT,
    GoClientError,
    GoClientRun,
    GoRequest,
    build_goclient,
    missing_go_prerequisites,
    run_goclient,
)
from tests.harness.images import TEST_IMAGE
from tests.harness.kubelet import KubeletClient, new_pod_uid
from tests.harness.prerequisites import on_ci

pytestmark = pytest.mark.e2e

RUNTIME = "/runtime.v1.RuntimeService"
IMAGES = "/runtime.v1.ImageService"
CALLS = 20
SELF_CONTAINED_LOG = "client header blocks are self-contained (HPACK table size 0 applied)"
MISSING_CONTAINER_ID = "0" * 64

# kubelet's remote runtime sends its own API version string in VersionRequest.
VERSION = GoRequest(f"{RUNTIME}/Version", pb.VersionRequest(version="0.1.0").SerializeToString())
STATUS = GoRequest(f"{RUNTIME}/Status")
LIST_CONTAINERS = GoRequest(f"{RUNTIME}/ListContainers")
LIST_POD_SANDBOX = GoRequest(f"{RUNTIME}/ListPodSandbox")
LIST_IMAGES = GoRequest(f"{IMAGES}/ListImages")
# An intercepted lifecycle call whose request is not a protobuf message (a truncated varint),
# and one that is valid but names a container nobody has.
# CreateContainer is terminated at cpushim (it rewrites the request); StartContainer passes
# through with its reply's end held until cpushim has done its part.
CREATE_MALFORMED = GoRequest(f"{RUNTIME}/CreateContainer", b"\xff\xff\xff\xff")
START_MALFORMED = GoRequest(f"{RUNTIME}/StartContainer", b"\xff\xff\xff\xff")
START_MISSING = GoRequest(
    f"{RUNTIME}/StartContainer",
    pb.StartContainerRequest(container_id=MISSING_CONTAINER_ID).SerializeToString(),
)

# Replies that are byte-for-byte the same on every call while nothing changes. The list replies
# are compared decoded and sorted instead: containerd lists from maps, in no fixed order.
STABLE = (VERSION, STATUS, LIST_IMAGES)
LISTS: dict[GoRequest, tuple[type[Message], str]] = {
    LIST_CONTAINERS: (pb.ListContainersResponse, "containers"),
    LIST_POD_SANDBOX: (pb.ListPodSandboxResponse, "items"),
    LIST_IMAGES: (pb.ListImagesResponse, "images"),
}

CODE_NOT_FOUND = 5
CODE_INVALID_ARGUMENT = 3


@pytest.fixture(scope="module")
def goclient(e2e_prerequisites: None) -> Path:
    """The grpc-go client binary, built once (and cached across sessions by source hash)."""
    missing = missing_go_prerequisites()
    if missing:
        reason = f"grpc-go client prerequisites missing: {'; '.join(missing)} ({INSTALL_HINT})"
        if on_ci():
            pytest.fail(f"{reason} (CI=true: e2e tests are mandatory)", pytrace=False)
        pytest.skip(reason)
    started = time.monotonic()
    try:
        binary = build_goclient()
    except GoClientError as error:
        pytest.fail(str(error), pytrace=False)
    print(f"grpc-go client ready in {time.monotonic() - started:.1f}s: {binary}")
    return binary


@pytest.fixture(scope="module")
def running_pod(
    containerd: PrivateContainerd, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A pod with one running container, so the list calls have something to list."""
    log_root = tmp_path_factory.mktemp("goclient-pod-logs")
    with KubeletClient(containerd.address, log_root=log_root) as client:
        try:
            sandbox = client.run_pod_sandbox("grpc-go", "e2e", new_pod_uid(), "besteffort")
            container_id = client.create_container(
                sandbox, "main", TEST_IMAGE, ["sleep", "infinity"]
            )
            client.start_container(container_id)
            yield container_id
        finally:
            errors = client.teardown_all()
            assert not errors, f"pod teardown failed: {errors}"


def decoded_list(request: GoRequest, reply: bytes | None) -> list[Any]:
    """A list reply as plain data, its items sorted by id."""
    message_type, field = LISTS[request]
    message = message_type.FromString(reply or b"")
    items = [
        MessageToDict(item, preserving_proto_field_name=True) for item in getattr(message, field)
    ]
    return sorted(items, key=lambda item: str(item.get("id", "")))


def not_ok(run: GoClientRun) -> list[str]:
    return [f"{c.method} {c.code_name}: {c.message}" for c in run.calls if not c.ok]


def test_grpc_go_replies_match_direct(
    goclient: Path, containerd: PrivateContainerd, cpushim: ServingProcess, running_pod: str
) -> None:
    """Kubelet's polling calls, interleaved on one grpc-go connection, give the same replies."""
    requests = [VERSION, STATUS, LIST_CONTAINERS, LIST_POD_SANDBOX, LIST_IMAGES]
    runs = {
        name: run_goclient(goclient, address, requests, calls=CALLS, print_replies=True)
        for name, address in (("direct", containerd.address), ("via_cpushim", cpushim.address))
    }
    for name, run in runs.items():
        assert not not_ok(run), f"{name}: calls failed: {not_ok(run)}"
        assert len(run.calls) == CALLS * len(requests)

    for request in STABLE:
        digests = {c.reply_sha256 for run in runs.values() for c in run.of(request)}
        assert len(digests) == 1, f"{request.method}: {len(digests)} distinct replies"
    version = pb.VersionResponse.FromString(runs["via_cpushim"].of(VERSION)[0].reply or b"")
    assert version.runtime_api_version == "v1"

    for request in LISTS:
        contents = {
            name: [decoded_list(request, c.reply) for c in run.of(request)]
            for name, run in runs.items()
        }
        first = contents["direct"][0]
        assert first, f"{request.method}: the direct reply lists nothing"
        for name, replies in contents.items():
            for index, content in enumerate(replies):
                assert content == first, f"{request.method}: {name} call {index} differs"
    listed = decoded_list(LIST_CONTAINERS, runs["via_cpushim"].of(LIST_CONTAINERS)[0].reply)
    assert running_pod in {item["id"] for item in listed}


def test_grpc_go_intercepted_errors(
    goclient: Path, containerd: PrivateContainerd, cpushim: ServingProcess
) -> None:
    """Errors from intercepted and followed calls, with spliced calls on the same connection."""
    requests = [CREATE_MALFORMED, START_MALFORMED, VERSION, START_MISSING, STATUS]
    direct = run_goclient(goclient, containerd.address, requests, calls=5)
    relayed = run_goclient(goclient, cpushim.address, requests, calls=5)

    malformed = relayed.of(CREATE_MALFORMED)
    assert {(c.code, c.code_name) for c in malformed} == {
        (CODE_INVALID_ARGUMENT, "InvalidArgument")
    }, malformed
    assert all(not c.ok for c in direct.of(CREATE_MALFORMED))
    # A followed call's error is the runtime's own, exactly as without cpushim.
    followed_direct = {(c.code, c.message) for c in direct.of(START_MALFORMED)}
    followed_relayed = {(c.code, c.message) for c in relayed.of(START_MALFORMED)}
    assert len(followed_direct) == 1, followed_direct
    assert next(iter(followed_direct))[0] != 0
    assert followed_relayed == followed_direct

    missing_direct = {(c.code, c.message) for c in direct.of(START_MISSING)}
    missing_relayed = {(c.code, c.message) for c in relayed.of(START_MISSING)}
    assert len(missing_direct) == 1, missing_direct
    assert next(iter(missing_direct))[0] == CODE_NOT_FOUND, missing_direct
    assert missing_relayed == missing_direct

    # The spliced calls after each answered-here call still reach containerd and succeed.
    for run in (direct, relayed):
        for request in (VERSION, STATUS):
            assert all(c.ok for c in run.of(request)), not_ok(run)


def test_grpc_go_applies_header_table_size_zero(goclient: Path, cpushim: ServingProcess) -> None:
    """grpc-go's encoder applies cpushim's SETTINGS_HEADER_TABLE_SIZE = 0.

    cpushim logs the line once per client connection whose header blocks became
    self-contained, which happens only when a block carries the encoder's dynamic table size
    update to 0. Only this test's one grpc-go connection talks to cpushim while the log is
    watched, so the lines that appear in that window are its own.
    """
    before = len(cpushim.log())
    run = run_goclient(goclient, cpushim.address, [VERSION, START_MISSING, STATUS], calls=5)
    assert all(c.ok for c in run.of(VERSION)), not_ok(run)

    def window() -> list[str]:
        return [line for line in cpushim.log()[before:].splitlines() if SELF_CONTAINED_LOG in line]

    try:
        wait_for(lambda: bool(window()), 5.0, "cpushim's self-contained header blocks line")
    except TimeoutError:
        pytest.fail(
            "grpc-go did not apply HEADER_TABLE_SIZE 0: cpushim never logged "
            f"{SELF_CONTAINED_LOG!r} for its connection; cpushim's log since the run:\n"
            + cpushim.log()[before:],
            pytrace=False,
        )
    assert len(window()) == 1, window()
