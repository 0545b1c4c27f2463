"""What cpushim decides about a container before asking the policy: the pod's QoS class from
its cgroup parent, exclusive or shared from its CPU resources, and the cpushim.io/ annotations."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.cri import runtime_v1_pb2 as pb
from shim.kube import QOSClass
from shim.pods import (
    ANNOTATION_CFS_QUOTA,
    ANNOTATION_EXCLUSIVE,
    ANNOTATION_ISOLATED,
    AnnotationError,
    ContainerPlan,
    Pod,
    plan_container,
    unknown_annotations,
)
from tests.harness.kubelet import CPU_PERIOD_US, milli_cpu_to_quota, milli_cpu_to_shares
from tests.harness.sysfs import PROPERTY_SETTINGS

UID = "4c5b4d3e-1f2a-4b6c-8d9e-0a1b2c3d4e5f"
UID_ = UID.replace("-", "_")
G, B, BE = QOSClass.GUARANTEED, QOSClass.BURSTABLE, QOSClass.BEST_EFFORT


def sandbox_config(parent: str, annotations: dict[str, str] | None = None) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="web-0", uid=UID, namespace="shop", attempt=1),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent=parent),
        annotations=annotations or {},
    )


# --- Pod.from_config --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parent", "qos"),
    [
        # cgroupfs driver
        (f"/kubepods/pod{UID}", G),
        (f"/kubepods/burstable/pod{UID}", B),
        (f"/kubepods/besteffort/pod{UID}", BE),
        (f"/kubelet/kubepods/burstable/pod{UID}", B),  # --cgroup-root=/kubelet
        # systemd driver: the slice name alone, or its full path
        (f"kubepods-pod{UID_}.slice", G),
        (f"kubepods-burstable-pod{UID_}.slice", B),
        (f"kubepods-besteffort-pod{UID_}.slice", BE),
        (f"/kubepods.slice/kubepods-pod{UID_}.slice", G),
        (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice", B),
        (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice", BE),
        # not one kubelet makes: its containers share
        ("", None),
        ("/system.slice/containerd.service", None),
        ("/custom/pod-by-hand", None),
        (f"/kubepods/guaranteed/pod{UID}", None),
        (f"kubepods-guaranteed-pod{UID_}.slice", None),
    ],
)
def test_from_config_qos(parent: str, qos: QOSClass | None) -> None:
    pod = Pod.from_config("sandbox-1", sandbox_config(parent))
    assert pod.qos is qos
    assert pod.cgroup_parent == parent


def test_from_config_fields() -> None:
    annotations = {ANNOTATION_ISOLATED: "prefer", "kubernetes.io/config.source": "api"}
    pod = Pod.from_config("sandbox-1", sandbox_config(f"/kubepods/pod{UID}", annotations))
    assert pod == Pod(
        sandbox_id="sandbox-1",
        uid=UID,
        name="web-0",
        namespace="shop",
        qos=G,
        cgroup_parent=f"/kubepods/pod{UID}",
        annotations=annotations,
    )
    assert pod.label == "shop/web-0"
    assert dict(pod.annotations) == annotations
    with pytest.raises(TypeError):
        pod.annotations["x"] = "y"  # type: ignore[index]


def test_a_pod_known_by_neither_name_nor_namespace_has_no_label() -> None:
    """A create without a sandbox config for a sandbox cpushim never saw: the logs and the
    messages fall back to its UID on an empty label, which "/" would defeat."""
    pod = Pod("sandbox-1", uid="sandbox-1", name="", namespace="", qos=None, cgroup_parent="")
    assert pod.label == ""
    assert (pod.label or pod.uid) == "sandbox-1"


def test_from_config_copies_the_annotations() -> None:
    config = sandbox_config(f"/kubepods/pod{UID}", {ANNOTATION_EXCLUSIVE: "false"})
    pod = Pod.from_config("sandbox-1", config)
    config.annotations[ANNOTATION_EXCLUSIVE] = "true"
    assert pod.annotations == {ANNOTATION_EXCLUSIVE: "false"}


def test_from_an_empty_config() -> None:
    pod = Pod.from_config("sandbox-1", pb.PodSandboxConfig())
    assert pod.qos is None
    assert (pod.uid, pod.label) == ("", "")
    assert dict(pod.annotations) == {}


# --- plan_container: resources ----------------------------------------------------------------


def pod(qos: QOSClass | None = G, **annotations: str) -> Pod:
    return Pod(
        sandbox_id="sandbox-1",
        uid=UID,
        name="web-0",
        namespace="shop",
        qos=qos,
        cgroup_parent="",
        annotations=MappingProxyType(dict(annotations)),
    )


def resources(
    request_milli: int, limit_milli: int = 0, period: int = CPU_PERIOD_US
) -> pb.LinuxContainerResources:
    """What kubelet sends for a container's CPU (request and limit in milliCPU)."""
    return pb.LinuxContainerResources(
        cpu_shares=milli_cpu_to_shares(request_milli or limit_milli),
        cpu_quota=milli_cpu_to_quota(limit_milli, period),
        cpu_period=period,
    )


def raw(shares: int, quota: int = 0, period: int = CPU_PERIOD_US) -> pb.LinuxContainerResources:
    return pb.LinuxContainerResources(cpu_shares=shares, cpu_quota=quota, cpu_period=period)


@pytest.mark.parametrize(
    ("qos", "cpu", "exclusive"),
    [
        (G, raw(1024, 100_000), 1),
        (G, raw(2048, 200_000), 2),
        (G, raw(3 * 1024, 3 * 100_000), 3),
        (G, raw(16 * 1024, 16 * 100_000), 16),
        (G, resources(4000, 4000), 4),
        (G, resources(1500, 1500), None),  # fractional
        (G, raw(1536, 150_000), None),
        (G, resources(500, 500), None),
        (G, resources(2000, 2000, period=50_000), 2),  # another CFS period
        (G, raw(2048), 2),  # quota unset (cpuCFSQuota off): the shares decide
        (G, raw(2048, 0, 0), 2),
        (G, raw(1536), None),
        (G, raw(2048, 300_000), None),  # request and limit disagree: not kubelet's Guaranteed
        (G, raw(0), None),
        (B, resources(2000, 2000), None),
        (B, resources(2000, 4000), None),
        (B, raw(2048), None),
        (BE, raw(2), None),
        (None, resources(2000, 2000), None),  # a pod made by hand
    ],
)
def test_plan_from_resources(
    qos: QOSClass | None, cpu: pb.LinuxContainerResources, exclusive: int | None
) -> None:
    assert plan_container(pod(qos), "app", cpu) == ContainerPlan(exclusive=exclusive)


@PROPERTY_SETTINGS
@given(st.integers(1, 64_000), st.sampled_from([100_000, 50_000, 10_000]))
def test_plan_of_kubelet_guaranteed_containers(milli: int, period: int) -> None:
    plan = plan_container(pod(G), "app", resources(milli, milli, period))
    assert plan.exclusive == (milli // 1000 if milli % 1000 == 0 else None)


# --- plan_container: annotations --------------------------------------------------------------

TWO = resources(2000, 2000)


@pytest.mark.parametrize(
    ("value", "isolated"),
    [
        ("prefer", "prefer"),
        ("require", "require"),
        ("avoid", "avoid"),
        (" Require\n", "require"),
        ("PREFER", "prefer"),
    ],
)
def test_isolated_cpus_annotation(value: str, isolated: str) -> None:
    plan = plan_container(pod(G, **{ANNOTATION_ISOLATED: value}), "app", TWO)
    assert plan == ContainerPlan(exclusive=2, isolated=isolated)  # type: ignore[arg-type]


def test_isolated_cpus_default_is_avoid() -> None:
    assert plan_container(pod(G), "app", TWO).isolated == "avoid"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (ANNOTATION_ISOLATED, "always"),
        (ANNOTATION_ISOLATED, ""),
        (ANNOTATION_CFS_QUOTA, "drop"),
        (ANNOTATION_CFS_QUOTA, ""),
        (ANNOTATION_EXCLUSIVE, "no"),
        (ANNOTATION_EXCLUSIVE, "0"),
        (ANNOTATION_EXCLUSIVE, ""),
        (f"{ANNOTATION_EXCLUSIVE}.app", "yes"),
    ],
)
def test_bad_annotation_values_name_the_annotation(name: str, value: str) -> None:
    with pytest.raises(AnnotationError, match=re.escape(f"annotation {name}: {value!r}")):
        plan_container(pod(G, **{name: value}), "app", TWO)


def test_bad_annotation_is_reported_for_a_shared_container_too() -> None:
    with pytest.raises(AnnotationError, match=re.escape(ANNOTATION_CFS_QUOTA)):
        plan_container(pod(B, **{ANNOTATION_CFS_QUOTA: "drop"}), "app", TWO)


def test_bad_flag_of_another_container_is_not_read() -> None:
    plan = plan_container(pod(G, **{f"{ANNOTATION_EXCLUSIVE}.other": "maybe"}), "app", TWO)
    assert plan.exclusive == 2


@pytest.mark.parametrize(
    ("value", "keep"),
    [("keep", True), (" KEEP ", True), ("remove", False), (None, False)],
)
def test_cfs_quota_annotation(value: str | None, keep: bool) -> None:
    annotations = {} if value is None else {ANNOTATION_CFS_QUOTA: value}
    plan = plan_container(pod(G, **annotations), "app", TWO)
    assert plan == ContainerPlan(exclusive=2, keep_quota=keep)


@pytest.mark.parametrize(
    ("annotations", "app", "sidecar"),
    [
        pytest.param({}, 2, 2, id="no annotation"),
        pytest.param({ANNOTATION_EXCLUSIVE: "false"}, None, None, id="pod-wide false"),
        pytest.param({ANNOTATION_EXCLUSIVE: "FALSE"}, None, None, id="pod-wide FALSE"),
        pytest.param({ANNOTATION_EXCLUSIVE: "true"}, 2, 2, id="pod-wide true"),
        pytest.param(
            {f"{ANNOTATION_EXCLUSIVE}.sidecar": "false"}, 2, None, id="one container false"
        ),
        pytest.param(
            {ANNOTATION_EXCLUSIVE: "false", f"{ANNOTATION_EXCLUSIVE}.app": "true"},
            2,
            None,
            id="container true overrides pod-wide false",
        ),
        pytest.param(
            {ANNOTATION_EXCLUSIVE: "true", f"{ANNOTATION_EXCLUSIVE}.app": "false"},
            None,
            2,
            id="container false overrides pod-wide true",
        ),
        pytest.param({f"{ANNOTATION_EXCLUSIVE}.app": " True "}, 2, 2, id="container true, spaces"),
    ],
)
def test_exclusive_annotation(
    annotations: dict[str, str], app: int | None, sidecar: int | None
) -> None:
    guaranteed = pod(G, **annotations)
    assert plan_container(guaranteed, "app", TWO).exclusive == app
    assert plan_container(guaranteed, "sidecar", TWO).exclusive == sidecar


@pytest.mark.parametrize(
    ("qos", "cpu"),
    [(B, TWO), (G, resources(1500, 1500)), (None, TWO)],
    ids=["burstable", "fractional", "no QoS class"],
)
def test_exclusive_true_does_not_make_a_container_eligible(
    qos: QOSClass | None, cpu: pb.LinuxContainerResources
) -> None:
    annotations = {ANNOTATION_EXCLUSIVE: "true", f"{ANNOTATION_EXCLUSIVE}.app": "true"}
    assert plan_container(pod(qos, **annotations), "app", cpu).exclusive is None


def test_annotations_combine() -> None:
    annotated = pod(
        G,
        **{
            ANNOTATION_ISOLATED: "require",
            ANNOTATION_CFS_QUOTA: "keep",
            f"{ANNOTATION_EXCLUSIVE}.sidecar": "false",
        },
    )
    assert plan_container(annotated, "app", TWO) == ContainerPlan(2, "require", True)
    # A shared container still carries the pod's answers; they matter only when exclusive.
    assert plan_container(annotated, "sidecar", TWO) == ContainerPlan(None, "require", True)


def test_unknown_cpushim_annotations_are_ignored() -> None:
    plan = plan_container(pod(G, **{"cpushim.io/future-knob": "on"}), "app", TWO)
    assert plan == ContainerPlan(exclusive=2)


def test_unknown_annotations_are_the_cpushim_keys_not_read() -> None:
    annotations = {
        ANNOTATION_ISOLATED: "prefer",
        ANNOTATION_CFS_QUOTA: "keep",
        ANNOTATION_EXCLUSIVE: "false",
        f"{ANNOTATION_EXCLUSIVE}.sidecar": "false",  # any container name: none listed yet
        "cpushim.io/isolated-cpu": "require",
        f"{ANNOTATION_EXCLUSIVE}.": "false",  # names no container
        "cpushim.io/Exclusive": "false",
        "example.com/isolated-cpus": "require",  # not cpushim's
        "cpushim.io.example.com/exclusive": "false",
    }
    assert unknown_annotations(annotations) == [
        "cpushim.io/Exclusive",
        f"{ANNOTATION_EXCLUSIVE}.",
        "cpushim.io/isolated-cpu",
    ]


def test_plan_for_a_pod_from_config() -> None:
    config = sandbox_config(
        f"kubepods-pod{UID_}.slice", {ANNOTATION_ISOLATED: "prefer", ANNOTATION_CFS_QUOTA: "keep"}
    )
    plan = plan_container(Pod.from_config("sandbox-1", config), "app", resources(3000, 3000))
    assert plan == ContainerPlan(exclusive=3, isolated="prefer", keep_quota=True)


# --- the README's table -------------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readmes_annotation_table_is_what_plan_container_reads() -> None:
    """Each row of the README's annotation table names an annotation cpushim reads and the
    values it takes: each value listed is accepted, and each word listed anywhere in the
    table that a row does not list is refused by that row's annotation."""
    rows = re.findall(r"^\| `(cpushim\.io/[^`]+)` \| ([^|]+) \|", README.read_text(), re.M)
    values = {name: set(re.findall(r'`"?([a-z]+)"?`', cell)) for name, cell in rows}
    assert set(values) == {
        ANNOTATION_ISOLATED,
        ANNOTATION_CFS_QUOTA,
        ANNOTATION_EXCLUSIVE,
        f"{ANNOTATION_EXCLUSIVE}.<container>",
    }
    assert unknown_annotations({name.replace("<container>", "app"): "" for name in values}) == []
    words = set().union(*values.values())
    for name, listed in values.items():
        annotation = name.replace("<container>", "app")
        for word in sorted(words):
            planned = pod(G, **{annotation: word})
            if word in listed:
                plan_container(planned, "app", TWO)
            else:
                with pytest.raises(AnnotationError):
                    plan_container(planned, "app", TWO)
