"""How kubelet describes a container on the CRI: QoS class from the pod's cgroup parent, CPU
request and limit from the shares, quota and period it computes. Pure functions.

kubelet's conversions (pkg/kubelet/cm/helpers_linux.go):
``shares = max(2, milli * 1024 // 1000)`` (capped at 262144; 0 milliCPU also gives 2),
``quota = max(1000, limit_milli * period // 1000)`` when a limit is set, period 100000 by default.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MAX_SHARES",
    "MIN_QUOTA",
    "MIN_SHARES",
    "CgroupParentError",
    "PodCgroup",
    "QOSClass",
    "exclusive_cpu_count",
    "milli_cpu_limit",
    "milli_cpu_request",
    "pod_cgroup",
]

MIN_SHARES: Final = 2
MAX_SHARES: Final = 262144
SHARES_PER_CPU: Final = 1024
MIN_QUOTA: Final = 1000  # 1 ms


class QOSClass(enum.Enum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BEST_EFFORT = "BestEffort"


class CgroupParentError(ValueError):
    """The cgroup parent is not one kubelet makes for a pod."""


@dataclass(frozen=True, slots=True)
class PodCgroup:
    qos: QOSClass
    pod_uid: str


_QOS_DIRS: Final = {
    "": QOSClass.GUARANTEED,
    "burstable": QOSClass.BURSTABLE,
    "besteffort": QOSClass.BEST_EFFORT,
}

# A pod UID: a UUID, or for static pods the hex digest kubelet derives from the manifest.
_UID: Final = r"[0-9A-Za-z][0-9A-Za-z-]{0,127}"
_CGROUPFS: Final = re.compile(rf"(?:.*/)?kubepods(?:/(burstable|besteffort))?/pod({_UID})")
# systemd escapes "-" inside a unit name component, so the UID's dashes become underscores;
# a custom cgroup root adds "<root>-" in front (kubelet --cgroup-root).
_SYSTEMD: Final = re.compile(
    r"(?:.*/)?(?:[0-9A-Za-z_.]+-)*kubepods-(?:(burstable|besteffort)-)?"
    r"pod([0-9A-Za-z][0-9A-Za-z_]{0,127})\.slice"
)


def pod_cgroup(cgroup_parent: str) -> PodCgroup:
    """QoS class and pod UID from a sandbox's ``linux.cgroup_parent``.

    Accepts kubelet's cgroupfs form (``/kubepods/burstable/pod<uid>``) and systemd form
    (``kubepods-burstable-pod<uid_with_underscores>.slice``, alone or as the last element of a
    path such as ``/kubepods.slice/kubepods-burstable.slice/...``). A trailing ``/`` is
    tolerated. Anything else raises CgroupParentError: a pod cgroup we cannot classify must
    not be guessed at.
    """
    path = cgroup_parent.rstrip("/")
    match = _CGROUPFS.fullmatch(path)
    if match is not None:
        return PodCgroup(_QOS_DIRS[match.group(1) or ""], match.group(2))
    match = _SYSTEMD.fullmatch(path)
    if match is not None:
        return PodCgroup(_QOS_DIRS[match.group(1) or ""], match.group(2).replace("_", "-"))
    raise CgroupParentError(f"not a kubelet pod cgroup parent: {cgroup_parent!r}")


def milli_cpu_request(cpu_shares: int) -> int:
    """The CPU request in milliCPU behind ``cpu_shares``.

    kubelet's mapping is one-to-one above the minimum, so this is exact for every value it
    writes: ``k * 1024`` gives ``k * 1000``. The minimum 2 stands for 0, 1 or 2 milliCPU and
    gives 0; unset (0) also gives 0. Shares kubelet never writes round up to the next request
    that would produce at least that many. The cap 262144 means 256000 or more.
    """
    if cpu_shares < 0:
        raise ValueError(f"cpu_shares cannot be negative: {cpu_shares}")
    if cpu_shares <= MIN_SHARES:
        return 0
    return -(-min(cpu_shares, MAX_SHARES) * 1000 // SHARES_PER_CPU)


def milli_cpu_limit(cpu_quota: int, cpu_period: int) -> int | None:
    """The CPU limit in milliCPU behind a CFS quota and period, or None for no limit
    (quota <= 0 or period <= 0).

    Exact for every quota kubelet writes above the 1 ms floor; at the floor (1000 us) the
    limit was anything from 1 to ``ceil(1000 * 1000 / period)`` milliCPU and the largest is
    returned. Quotas kubelet never writes round up.
    """
    if cpu_quota <= 0 or cpu_period <= 0:
        return None
    return -(-cpu_quota * 1000 // cpu_period)


def request_is_limit(cpu_shares: int, cpu_quota: int, cpu_period: int) -> bool:
    """Whether a Guaranteed container's shares and quota name one CPU amount, as kubelet
    writes them (its request is its limit), to the milliCPU the mappings round to. True
    without a quota to compare with (none set, or kubelet's cpuCFSQuota off) and at either
    mapping's floor or cap, where the figures stand for a range."""
    limit = milli_cpu_limit(cpu_quota, cpu_period)
    if limit is None or cpu_quota <= MIN_QUOTA:
        return True
    if cpu_shares <= MIN_SHARES or cpu_shares >= MAX_SHARES:
        return True
    return abs(milli_cpu_request(cpu_shares) - limit) <= 1


def kubelet_cfs_quota(cpu_shares: int, cpu_quota: int, cpu_period: int) -> int:
    """The CFS quota kubelet gave a container (0: none), from its resources as the runtime
    holds them. A quota of -1 is cpushim's (it drops an exclusive container's quota; kubelet
    with its CPU manager off, as behind cpushim, never writes -1): behind it, kubelet's quota
    for a Guaranteed container of whole cores is those cores (from the shares) times the
    period, which kubelet leaves unset when it enforces no limit. Shares at their cap stand
    for 256 cores or more, so the cores are unknown there, and 0 is returned."""
    if cpu_quota > 0:
        return cpu_quota
    if cpu_quota != -1 or cpu_period <= 0:
        return 0
    if cpu_shares % SHARES_PER_CPU or not 0 < cpu_shares < MAX_SHARES:
        return 0
    return cpu_shares // SHARES_PER_CPU * cpu_period


def exclusive_cpu_count(
    qos: QOSClass, cpu_shares: int, cpu_quota: int, cpu_period: int
) -> int | None:
    """How many exclusive CPUs a container gets under the static policy, or None.

    Eligible: the pod is Guaranteed and the container's CPU is a whole number k >= 1 of cores
    (request == limit == k * 1000 milliCPU). Checked on the raw values so nothing is lost to
    rounding: shares == k * 1024 and, when a quota is set, quota == k * period. Without a quota
    (kubelet's cpuCFSQuota off) a Guaranteed pod's request equals its limit by definition, so
    the shares decide. Above 256 cores the shares are capped and the quota decides.
    """
    if qos is not QOSClass.GUARANTEED:
        return None
    limit_set = cpu_quota > 0 and cpu_period > 0
    if limit_set:
        if cpu_quota % cpu_period:
            return None
        cores = cpu_quota // cpu_period
        expected_shares = min(cores * SHARES_PER_CPU, MAX_SHARES)
        return cores if cores >= 1 and cpu_shares == expected_shares else None
    if cpu_shares % SHARES_PER_CPU or cpu_shares >= MAX_SHARES:
        return None
    cores = cpu_shares // SHARES_PER_CPU
    return cores if cores >= 1 else None
