"""The CRI proto subset: wire compatibility, unknown-field preservation, generated code, methods.

Unknown-field tests write protobuf wire format by hand (a few lines of varint arithmetic), so
they do not depend on the classes under test to produce their input.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from google.protobuf.message import Message

from shim.cri import runtime_v1_pb2 as pb
from shim.cri.methods import (
    ALL_METHODS,
    BY_PATH,
    IMAGE_SERVICE,
    REQUEST_TYPES,
    RESPONSE_TYPES,
    RUNTIME_SERVICE,
    Method,
)
from tests.harness.prerequisites import require

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO = Path("shim/cri/runtime_v1.proto")

# -- wire format, by hand --------------------------------------------------------------------

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 negatives are ten-byte two's complement varints
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def f_varint(number: int, value: int) -> bytes:
    return tag(number, VARINT) + varint(value)


def f_len(number: int, payload: bytes | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else payload
    return tag(number, LEN) + varint(len(data)) + data


def f_fixed64(number: int, value: int) -> bytes:
    return tag(number, FIXED64) + struct.pack("<Q", value)


def f_fixed32(number: int, value: int) -> bytes:
    return tag(number, FIXED32) + struct.pack("<I", value)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> list[tuple[int, int, bytes]]:
    """Top-level (field number, wire type, raw value bytes) of a message, in wire order."""
    out: list[tuple[int, int, bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        start = pos
        if wire_type == VARINT:
            _, pos = read_varint(data, pos)
        elif wire_type == FIXED64:
            pos += 8
        elif wire_type == FIXED32:
            pos += 4
        elif wire_type == LEN:
            length, start = read_varint(data, pos)
            pos = start + length
        else:
            raise ValueError(f"unexpected wire type {wire_type}")
        out.append((number, wire_type, data[start:pos]))
    return out


def only_field(data: bytes, number: int) -> bytes:
    matches = [value for n, _, value in fields(data) if n == number]
    assert len(matches) == 1, (number, fields(data))
    return matches[0]


# -- unknown fields survive decode -> modify -> encode ----------------------------------------

# Field numbers cpushim's subset does not declare: invented ones far above the CRI's, and a real
# CRI field left out of the subset (ContainerConfig.CDI_devices = 17).
UNKNOWN_TOP = f_fixed64(4001, 0x1122334455667788) + f_len(4002, b"\x00\xffopaque")
UNKNOWN_RESOURCES = f_varint(9001, 7) + f_len(9002, "future knob") + f_fixed32(9003, 0xCAFE)
CDI_DEVICE = f_len(17, f_len(1, "vendor.example/gpu=0"))


def kubelet_create_container_wire() -> bytes:
    """A CreateContainerRequest as a newer kubelet might send it, built field by field."""
    resources = (
        f_varint(1, 100_000)  # cpu_period
        + f_varint(2, 200_000)  # cpu_quota
        + f_varint(3, 2048)  # cpu_shares
        + f_varint(4, 256 * 1024 * 1024)  # memory_limit_in_bytes
        + f_varint(5, -997)  # oom_score_adj
        + UNKNOWN_RESOURCES
    )
    config = (
        f_len(1, f_len(1, "app") + f_varint(2, 3))  # metadata: name, attempt
        + f_len(2, f_len(1, "sha256:" + "ab" * 32))  # image
        + f_len(3, "sleep")  # command
        + f_len(4, "infinity")  # args
        + f_len(15, f_len(1, resources))  # linux.resources
        + CDI_DEVICE
    )
    sandbox_config = f_len(1, f_len(1, "web") + f_len(2, "uid-1") + f_len(3, "prod")) + f_len(
        8, f_len(1, "/kubepods/poduid-1")
    )
    return f_len(1, "sandbox-1") + f_len(2, config) + f_len(3, sandbox_config) + UNKNOWN_TOP


def resources_of(request_wire: bytes) -> bytes:
    config = only_field(request_wire, 2)
    linux = only_field(config, 15)
    return only_field(linux, 1)


def test_unknown_fields_survive_decode_modify_encode() -> None:
    wire = kubelet_create_container_wire()
    request = pb.CreateContainerRequest.FromString(wire)

    resources = request.config.linux.resources
    assert (resources.cpu_period, resources.cpu_quota, resources.cpu_shares) == (
        100_000,
        200_000,
        2048,
    )
    assert resources.oom_score_adj == -997
    assert request.sandbox_config.linux.cgroup_parent == "/kubepods/poduid-1"

    # What cpushim does to a create call: set the cpuset, forward the rest untouched.
    resources.cpuset_cpus = "2-3"
    resources.cpuset_mems = "0"
    out = request.SerializeToString()

    top = fields(out)
    for number, wire_type, value in fields(UNKNOWN_TOP):
        assert (number, wire_type, value) in top
    nested = fields(resources_of(out))
    for number, wire_type, value in fields(UNKNOWN_RESOURCES):
        assert (number, wire_type, value) in nested
    assert (6, LEN, b"2-3") in nested
    assert (7, LEN, b"0") in nested
    config_fields = fields(only_field(out, 2))
    assert fields(CDI_DEVICE)[0] in config_fields

    # And a second trip changes nothing more.
    again = pb.CreateContainerRequest.FromString(out)
    assert again.SerializeToString() == out


def test_unknown_fields_survive_in_every_intercepted_request() -> None:
    """UpdateContainerResources is cpushim's other rewrite; its unknown fields survive too."""
    wire = (
        f_len(1, "c1")
        + f_len(2, f_varint(3, 1024) + UNKNOWN_RESOURCES)
        + f_len(3, f_varint(1, 5))  # windows resources: not in the subset at all
        + UNKNOWN_TOP
    )
    request = pb.UpdateContainerResourcesRequest.FromString(wire)
    request.linux.cpuset_cpus = "0"
    out = request.SerializeToString()
    assert (3, LEN, f_varint(1, 5)) in fields(out)
    linux = fields(only_field(out, 2))
    for item in fields(UNKNOWN_RESOURCES):
        assert item in linux


def test_known_fields_encode_to_the_public_wire_format() -> None:
    """Spot checks that the subset's numbers are the CRI's (a wrong number breaks the wire)."""
    assert pb.LinuxContainerResources(cpuset_cpus="1").SerializeToString() == f_len(6, "1")
    assert pb.LinuxContainerResources(cpuset_mems="0").SerializeToString() == f_len(7, "0")
    assert pb.LinuxContainerResources(memory_swap_limit_in_bytes=5).SerializeToString() == f_varint(
        10, 5
    )
    assert pb.ContainerConfig(linux=pb.LinuxContainerConfig()).SerializeToString() == f_len(15, b"")
    assert pb.LinuxPodSandboxConfig(
        resources=pb.LinuxContainerResources(cpu_shares=2)
    ).SerializeToString() == f_len(5, f_varint(3, 2))
    assert pb.ImageSpec(user_specified_image="x").SerializeToString() == f_len(18, "x")
    assert pb.ContainerStatus(image_id="i").SerializeToString() == f_len(17, "i")
    assert pb.ContainerEventResponse(
        containers_statuses=[pb.ContainerStatus()]
    ).SerializeToString() == f_len(5, b"")
    assert pb.LinuxSandboxSecurityContext(
        run_as_group=pb.Int64Value(value=1)
    ).SerializeToString() == f_len(8, f_varint(1, 1))


# Field numbers from the public api.proto for the fields cpushim reads or writes.
SPEC_NUMBERS: list[tuple[type[Message], str, int]] = [
    (pb.CreateContainerRequest, "pod_sandbox_id", 1),
    (pb.CreateContainerRequest, "config", 2),
    (pb.CreateContainerRequest, "sandbox_config", 3),
    (pb.ContainerConfig, "metadata", 1),
    (pb.ContainerConfig, "mounts", 7),
    (pb.ContainerConfig, "annotations", 10),
    (pb.ContainerConfig, "linux", 15),
    (pb.ContainerMetadata, "attempt", 2),
    (pb.PodSandboxConfig, "metadata", 1),
    (pb.PodSandboxConfig, "annotations", 7),
    (pb.PodSandboxConfig, "linux", 8),
    (pb.PodSandboxMetadata, "uid", 2),
    (pb.LinuxPodSandboxConfig, "cgroup_parent", 1),
    (pb.LinuxPodSandboxConfig, "overhead", 4),
    (pb.LinuxContainerResources, "cpu_period", 1),
    (pb.LinuxContainerResources, "cpu_quota", 2),
    (pb.LinuxContainerResources, "cpu_shares", 3),
    (pb.LinuxContainerResources, "oom_score_adj", 5),
    (pb.LinuxContainerResources, "hugepage_limits", 8),
    (pb.LinuxContainerResources, "unified", 9),
    (pb.Mount, "recursive_read_only", 8),
    (pb.UpdateContainerResourcesRequest, "annotations", 4),
    (pb.ContainerStatus, "resources", 16),
    (pb.PodSandboxStatusResponse, "containers_statuses", 3),
    (pb.LinuxContainerSecurityContext, "run_as_group", 12),
    (pb.StatusResponse, "features", 4),
]


@pytest.mark.parametrize(
    ("message", "field_name", "number"),
    SPEC_NUMBERS,
    ids=[f"{m.__name__}.{f}" for m, f, _ in SPEC_NUMBERS],
)
def test_field_numbers_match_the_public_api(
    message: type[Message], field_name: str, number: int
) -> None:
    assert message.DESCRIPTOR.fields_by_name[field_name].number == number


# -- kubelet-shaped messages round-trip ---------------------------------------------------------


def kubelet_create_container_request() -> pb.CreateContainerRequest:
    sandbox = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="web", uid="0b6f4c1e", namespace="prod", attempt=0),
        log_directory="/var/log/pods/prod_web_0b6f4c1e",
        dns_config=pb.DNSConfig(servers=["10.96.0.10"], searches=["prod.svc.cluster.local"]),
        port_mappings=[pb.PortMapping(protocol=pb.TCP, container_port=8080, host_port=0)],
        labels={"app": "web", "io.kubernetes.pod.uid": "0b6f4c1e"},
        annotations={"kubernetes.io/config.source": "api"},
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent="/kubepods/pod0b6f4c1e",
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER)
            ),
            sysctls={"net.core.somaxconn": "1024"},
            resources=pb.LinuxContainerResources(cpu_shares=2048, cpu_quota=200_000),
        ),
    )
    return pb.CreateContainerRequest(
        pod_sandbox_id="f" * 64,
        config=pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app", attempt=1),
            image=pb.ImageSpec(image="sha256:" + "ab" * 32, user_specified_image="busybox"),
            command=["sh", "-c"],
            args=["sleep infinity"],
            envs=[pb.KeyValue(key="A", value="1")],
            mounts=[
                pb.Mount(
                    container_path="/dev/termination-log",
                    host_path="/var/lib/kubelet/pods/x/containers/app/1",
                )
            ],
            labels={"io.kubernetes.container.name": "app"},
            annotations={"io.kubernetes.container.restartCount": "1"},
            log_path="app/1.log",
            linux=pb.LinuxContainerConfig(
                resources=pb.LinuxContainerResources(
                    cpu_period=100_000,
                    cpu_quota=200_000,
                    cpu_shares=2048,
                    memory_limit_in_bytes=1 << 30,
                    oom_score_adj=-997,
                    hugepage_limits=[pb.HugepageLimit(page_size="2MB", limit=0)],
                    unified={"memory.high": "max"},
                ),
                security_context=pb.LinuxContainerSecurityContext(
                    run_as_user=pb.Int64Value(value=1000)
                ),
            ),
        ),
        sandbox_config=sandbox,
    )


@pytest.mark.parametrize(
    "message",
    [
        kubelet_create_container_request(),
        pb.RunPodSandboxRequest(config=kubelet_create_container_request().sandbox_config),
        pb.UpdateContainerResourcesRequest(
            container_id="c" * 64,
            linux=pb.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0-1"),
            annotations={"k": "v"},
        ),
        pb.ListContainersRequest(
            filter=pb.ContainerFilter(
                state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING),
                label_selector={"io.kubernetes.pod.uid": "0b6f4c1e"},
            )
        ),
        pb.ContainerStatusResponse(
            status=pb.ContainerStatus(
                id="c" * 64,
                state=pb.CONTAINER_EXITED,
                exit_code=137,
                reason="OOMKilled",
                resources=pb.ContainerResources(linux=pb.LinuxContainerResources(cpuset_cpus="3")),
            ),
            info={"info": '{"pid": 42}'},
        ),
        pb.ContainerEventResponse(
            container_id="c" * 64,
            container_event_type=pb.CONTAINER_STOPPED_EVENT,
            pod_sandbox_status=pb.PodSandboxStatus(state=pb.SANDBOX_NOTREADY),
        ),
    ],
    ids=lambda message: type(message).__name__,
)
def test_kubelet_shaped_messages_round_trip(message: Message) -> None:
    wire = message.SerializeToString(deterministic=True)
    decoded = type(message).FromString(wire)
    assert decoded == message
    assert decoded.SerializeToString(deterministic=True) == wire


# -- generated code is up to date ----------------------------------------------------------------


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        require("proto", ["grpc_tools (grpcio-tools, a dev dependency) to regenerate and compare"])
    outputs = ["--python_out", str(tmp_path)]
    bin_dir = Path(sys.executable).parent
    mypy_plugin = shutil.which(
        "protoc-gen-mypy", path=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if mypy_plugin is not None:
        outputs += [f"--plugin=protoc-gen-mypy={mypy_plugin}", "--mypy_out", str(tmp_path)]
    # Same invocation as contrib/gen-proto.sh: from the repo root with -I . so the file
    # registers as shim/cri/runtime_v1.proto.
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", *outputs, str(PROTO)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    generated = ["runtime_v1_pb2.py"] + (["runtime_v1_pb2.pyi"] if mypy_plugin else [])
    for name in generated:
        fresh = (tmp_path / PROTO.parent / name).read_bytes()
        committed = (REPO_ROOT / PROTO.parent / name).read_bytes()
        assert fresh == committed, f"{PROTO.parent / name} is stale: run contrib/gen-proto.sh"


def test_descriptor_registers_the_repo_path() -> None:
    assert pb.DESCRIPTOR.name == "shim/cri/runtime_v1.proto"
    assert pb.DESCRIPTOR.package == "runtime.v1"


# -- the methods table ------------------------------------------------------------------------


def test_method_paths_are_unique_and_well_formed() -> None:
    paths = [method.path for method in ALL_METHODS]
    assert len(paths) == len(set(paths)) == len(BY_PATH)
    for method in ALL_METHODS:
        assert method.service in {RUNTIME_SERVICE, IMAGE_SERVICE}
        assert method.path == f"/{method.service}/{method.name}"
        assert BY_PATH[method.path] is method


def test_streaming_methods() -> None:
    assert BY_PATH["/runtime.v1.RuntimeService/GetContainerEvents"].server_streaming
    assert not BY_PATH["/runtime.v1.RuntimeService/ListContainers"].server_streaming
    for method in ALL_METHODS:
        if method.name.startswith("Stream"):
            assert method.server_streaming, method


def test_methods_cover_the_core_of_the_public_services() -> None:
    names = {(m.service, m.name) for m in ALL_METHODS}
    for name in (
        "Version",
        "RunPodSandbox",
        "CreateContainer",
        "UpdateContainerResources",
        "ExecSync",
        "Exec",
        "Attach",
        "PortForward",
        "Status",
        "CheckpointContainer",
        "ListMetricDescriptors",
        "ListPodSandboxMetrics",
        "RuntimeConfig",
        "UpdatePodSandboxResources",
    ):
        assert (RUNTIME_SERVICE, name) in names
    for name in ("ListImages", "ImageStatus", "PullImage", "RemoveImage", "ImageFsInfo"):
        assert (IMAGE_SERVICE, name) in names


def test_message_types_agree_with_the_proto_services() -> None:
    assert REQUEST_TYPES.keys() == RESPONSE_TYPES.keys()
    declared: set[str] = set()
    for service in pb.DESCRIPTOR.services_by_name.values():
        for rpc in service.methods:
            path = f"/{service.full_name}/{rpc.name}"
            declared.add(path)
            assert path in BY_PATH, f"{path} is declared in the proto but not in the table"
            assert BY_PATH[path].server_streaming == rpc.server_streaming
            assert REQUEST_TYPES[path].DESCRIPTOR is rpc.input_type
            assert RESPONSE_TYPES[path].DESCRIPTOR is rpc.output_type
    assert set(REQUEST_TYPES) == declared


def test_method_is_a_frozen_value() -> None:
    method = Method(RUNTIME_SERVICE, "Version", server_streaming=False)
    assert method == BY_PATH["/runtime.v1.RuntimeService/Version"]
    with pytest.raises(FrozenInstanceError):
        method.name = "Other"  # type: ignore[misc]
