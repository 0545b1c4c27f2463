"""kubelet's request shapes: QoS from the cgroup parent, CPU from shares and quota."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.kube import (
    MAX_SHARES,
    CgroupParentError,
    PodCgroup,
    QOSClass,
    exclusive_cpu_count,
    kubelet_cfs_quota,
    milli_cpu_limit,
    milli_cpu_request,
    pod_cgroup,
    request_is_limit,
)
from tests.harness.sysfs import PROPERTY_SETTINGS

UID = "4c5b4d3e-1f2a-4b6c-8d9e-0a1b2c3d4e5f"
UID_ = UID.replace("-", "_")
STATIC_UID = "8f2d6c3b5e1a4f7d9c0b2a4e6d8f0a1c"  # static pods: a hex digest, no dashes
G, B, BE = QOSClass.GUARANTEED, QOSClass.BURSTABLE, QOSClass.BEST_EFFORT


@pytest.mark.parametrize(
    ("parent", "qos", "uid"),
    [
        (f"/kubepods/pod{UID}", G, UID),
        (f"/kubepods/burstable/pod{UID}", B, UID),
        (f"/kubepods/besteffort/pod{UID}", BE, UID),
        (f"/kubepods/burstable/pod{UID}/", B, UID),
        (f"kubepods/pod{STATIC_UID}", G, STATIC_UID),
        (f"/kubelet/kubepods/besteffort/pod{UID}", BE, UID),  # --cgroup-root=/kubelet
        (f"kubepods-pod{UID_}.slice", G, UID),
        (f"kubepods-burstable-pod{UID_}.slice", B, UID),
        (f"kubepods-besteffort-pod{UID_}.slice", BE, UID),
        (f"/kubepods.slice/kubepods-pod{UID_}.slice", G, UID),
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
            B,
            UID,
        ),
        (
            f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice",
            BE,
            UID,
        ),
        (f"kubepods-burstable-pod{STATIC_UID}.slice", B, STATIC_UID),
        (f"kubelet-kubepods-burstable-pod{UID_}.slice", B, UID),
    ],
)
def test_pod_cgroup(parent: str, qos: QOSClass, uid: str) -> None:
    assert pod_cgroup(parent) == PodCgroup(qos, uid)


@pytest.mark.parametrize(
    "parent",
    [
        "",
        "/",
        "/kubepods",
        "/kubepods/burstable",
        f"/kubepods/guaranteed/pod{UID}",
        f"/kubepods/burstable/{UID}",
        f"/kubepods/burstable/pod{UID}/extra",
        f"/system.slice/pod{UID}",
        "/kubepods/pod",
        f"/kubepods/pod{UID}/../../etc",
        "kubepods-burstable.slice",
        f"kubepods-burstable-pod{UID_}",
        f"kubepods-guaranteed-pod{UID_}.slice",
        f"kubepods-pod{UID}.slice",  # dashes must have been escaped to underscores
        "/kubepods/pod../x",
    ],
)
def test_pod_cgroup_rejects_other_shapes(parent: str) -> None:
    with pytest.raises(CgroupParentError, match="not a kubelet pod cgroup parent"):
        pod_cgroup(parent)


def kubelet_shares(milli: int) -> int:
    """kubelet's MilliCPUToShares."""
    if milli == 0:
        return 2
    return min(max(milli * 1024 // 1000, 2), MAX_SHARES)


def kubelet_quota(milli: int, period: int) -> int:
    """kubelet's MilliCPUToQuota (0 = no limit)."""
    if milli == 0:
        return 0
    return max(milli * period // 1000, 1000)


@pytest.mark.parametrize(
    ("shares", "milli"),
    [
        (0, 0),
        (2, 0),
        (3, 3),
        (102, 100),
        (512, 500),
        (1024, 1000),
        (2048, 2000),
        (1025, 1001),
        (1536, 1500),
        (MAX_SHARES, 256000),
        (MAX_SHARES + 5, 256000),
    ],
)
def test_milli_cpu_request(shares: int, milli: int) -> None:
    assert milli_cpu_request(shares) == milli


def test_milli_cpu_request_rejects_negative() -> None:
    with pytest.raises(ValueError, match="negative"):
        milli_cpu_request(-1)


@pytest.mark.parametrize(
    ("quota", "period", "milli"),
    [
        (0, 100000, None),
        (-1, 100000, None),
        (100000, 0, None),
        (100000, 100000, 1000),
        (250000, 100000, 2500),
        (1000, 100000, 10),
        (50000, 100000, 500),
        (3000, 10000, 300),
        (1, 100000, 1),  # below kubelet's floor: rounds up
        (100000, 1, 100000000),  # a 1 us period
    ],
)
def test_milli_cpu_limit(quota: int, period: int, milli: int | None) -> None:
    assert milli_cpu_limit(quota, period) == milli


@pytest.mark.parametrize(
    ("shares", "quota", "period", "expected"),
    [
        pytest.param(1024, 100000, 100000, 100000, id="kubelet's own quota"),
        pytest.param(2048, 150000, 100000, 150000, id="any quota kubelet set stands"),
        pytest.param(2048, -1, 100000, 200000, id="dropped by cpushim: cores times period"),
        pytest.param(3072, -1, 50000, 150000, id="another period"),
        pytest.param(1024, 0, 0, 0, id="kubelet enforces no limit"),
        pytest.param(1024, -1, 0, 0, id="dropped, no period: no limit"),
        pytest.param(1536, -1, 100000, 0, id="not whole cores"),
        pytest.param(0, -1, 100000, 0, id="no shares"),
        pytest.param(MAX_SHARES, -1, 100000, 0, id="shares at the cap: 256 cores or more"),
        pytest.param(1024, -2, 100000, 0, id="not cpushim's mark"),
        pytest.param(2048, 1, 100000, 1, id="the smallest quota stands"),
        pytest.param(2048, -1, -100000, 0, id="dropped, negative period: no limit"),
        pytest.param(2048, -1, 1, 2, id="dropped, a 1 us period"),
    ],
)
def test_kubelet_cfs_quota(shares: int, quota: int, period: int, expected: int) -> None:
    assert kubelet_cfs_quota(shares, quota, period) == expected


@PROPERTY_SETTINGS
@given(st.integers(1, 255), st.sampled_from([100000, 50000, 10000, 33333, 1000000]))
def test_kubelet_cfs_quota_recovers_what_kubelet_wrote(cores: int, period: int) -> None:
    shares = kubelet_shares(cores * 1000)
    assert kubelet_cfs_quota(shares, -1, period) == kubelet_quota(cores * 1000, period)


@PROPERTY_SETTINGS
@given(st.integers(3, 300000))
def test_request_inverts_kubelet_exactly(milli: int) -> None:
    shares = kubelet_shares(milli)
    if shares < MAX_SHARES:
        assert milli_cpu_request(shares) == milli


@PROPERTY_SETTINGS
@given(st.integers(1, 500000), st.sampled_from([100000, 50000, 10000, 33333, 1000000]))
def test_limit_inverts_kubelet_above_the_floor(milli: int, period: int) -> None:
    quota = kubelet_quota(milli, period)
    if quota > 1000:
        assert milli_cpu_limit(quota, period) == milli


@pytest.mark.parametrize(
    ("qos", "shares", "quota", "period", "expected"),
    [
        (G, 1024, 100000, 100000, 1),
        (G, 4096, 400000, 100000, 4),
        (G, 4096, 200000, 50000, 4),
        (G, 2048, 0, 0, 2),  # cpuCFSQuota off: no quota, shares decide
        (G, 2048, -1, 100000, 2),
        (G, 1536, 150000, 100000, None),  # 1.5 CPUs
        (G, 512, 50000, 100000, None),  # 0.5 CPU
        (G, 2, 1000, 100000, None),  # a few milliCPU
        (G, 2048, 100000, 100000, None),  # request != limit cannot be Guaranteed; refuse
        (G, 1024, 0, 0, 1),
        (G, 1500, 0, 0, None),
        (G, MAX_SHARES, 300 * 100000, 100000, 300),  # above 256 cores the quota decides
        (G, MAX_SHARES, 0, 0, None),  # capped shares without a quota: unknown
        (G, 262144, 256 * 100000, 100000, 256),  # exactly at the cap (262144 shares)
        (G, 2048, 0, 100000, 2),  # a period but no quota: shares decide
        (G, 2048, 200000, 0, 2),  # a quota but no period: no limit, shares decide
        (G, 1024, 1, 100000, None),  # a 1 us quota is a limit, and not whole cores
        (G, 2048, 3, 1, None),  # a 1 us period: 3 cores by the quota, 2 by the shares
        (G, 1024, 150000, 100000, None),  # a fractional limit, whatever the shares
        (G, 0, 0, 0, None),  # no CPU resources at all
        (B, 2048, 200000, 100000, None),
        (BE, 2, 0, 0, None),
    ],
)
def test_exclusive_cpu_count(
    qos: QOSClass, shares: int, quota: int, period: int, expected: int | None
) -> None:
    assert exclusive_cpu_count(qos, shares, quota, period) == expected


@PROPERTY_SETTINGS
@given(st.integers(1, 20000), st.sampled_from([100000, 50000, 10000]))
def test_exclusive_only_for_whole_cpus(milli: int, period: int) -> None:
    count = exclusive_cpu_count(G, kubelet_shares(milli), kubelet_quota(milli, period), period)
    assert count == (milli // 1000 if milli % 1000 == 0 else None)


@pytest.mark.parametrize(
    ("shares", "quota", "period", "agree"),
    [
        (2048, 200_000, 100_000, True),  # 2 CPUs
        (1536, 150_000, 100_000, True),  # 1500m
        (1025, 100_100, 100_000, True),  # 1001m: each mapping rounds its own way
        (2048, 100_000, 100_000, False),  # request 2, limit 1
        (1024, 150_000, 100_000, False),  # request 1, limit 1.5
        (2048, 0, 100_000, True),  # no quota to compare with
        (2048, -1, 100_000, True),  # cpushim's own
        (2, 1000, 100_000, True),  # both floors
        (4096, 4000, 1000, True),  # 4 CPUs on a 1 ms period
    ],
)
def test_request_is_limit(shares: int, quota: int, period: int, agree: bool) -> None:
    assert request_is_limit(shares, quota, period) is agree
