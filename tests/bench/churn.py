"""Pod churn against a real containerd: direct and through cpushim (static policy), same run.

    .venv/bin/python -m tests.bench.churn [--pods 50] [--rounds 3]

Needs root, containerd and runc (as the end-to-end tests do), and at least two CPUs. Each round
drives ``--pods`` Guaranteed 1-CPU pods on each path through kubelet's calls (RunPodSandbox,
CreateContainer, StartContainer, StopContainer, RemoveContainer, StopPodSandbox,
RemovePodSandbox) while a BestEffort container runs throughout, so through cpushim every pod
moves the shared container off its CPU and back. The paths take turns pod by pod, in an order
shuffled for each pod (seeded: ``--seed``), so all see the same moments of a noisy machine, and
the work a pod leaves behind for the next one (cpushim's deferred checkpoint writes,
containerd's clean-up) falls on every path alike. The report gives the median over rounds of
the wall time per pod and the ratio, and the mean difference to direct pod by pod with a 95 %
interval.

It also reads the shared container's cgroup ``cpuset.cpus`` the moment each StopContainer
returns: with cpushim the pool has grown before the return, so the time until the grown pool
is visible is 0; any pod where it is not counts as a miss, with the time it took.

``--static`` adds a third path, straight to containerd as kubelet's own static CPU manager
policy would call it: the exclusive CPU already in the CreateContainer request. It shows what
pinning itself costs containerd and the kernel (runc writing a cpuset), apart from cpushim.

``--baseline CHECKOUT`` adds a path through a second cpushim, run from another checkout of this
repository (``git worktree add /tmp/baseline HEAD~1``), each with its own BestEffort container:
two versions of cpushim compared in one run, pod by pod, where two runs an hour apart differ by
more than most changes do. ``--json FILE`` keeps every pod's and call's time for a closer look.

``--shared N`` runs N BestEffort pods per cpushim instead of one: every pinning and release
moves all of them before its call returns, so the run shows what each shared container adds
to a pod's calls (the direct path moves none; kubelet's static policy would move them in its
reconcile loop, up to 10 s later).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shim.cpuset import CPUSet
from tests.bench.procfs import cpu_seconds, machine_cpu_seconds
from tests.harness.containerd import (
    PrivateContainerd,
    ServingProcess,
    cpushim_command,
)
from tests.harness.images import build_image
from tests.harness.kubelet import ONE_CPU, WORKLOAD, KubeletClient, new_pod_uid

REPO = Path(__file__).resolve().parents[2]


def cgroup_cpus(client: KubeletClient, container_id: str) -> CPUSet:
    info = json.loads(client.container_status(container_id, verbose=True).info["info"])
    path = info["runtimeSpec"]["linux"]["cgroupsPath"].lstrip("/")
    return CPUSet.parse(Path("/sys/fs/cgroup/cpuset", path, "cpuset.cpus").read_text())


CallTimes = dict[str, list[float]]


def one_pod(
    client: KubeletClient,
    image: str,
    index: int,
    shared_cpus: Callable[[], CPUSet],
    full: CPUSet,
    calls: CallTimes,
    cpuset_cpus: str = "",
) -> tuple[float, float]:
    """Wall seconds of one pod's lifecycle, and the seconds from StopContainer's return until
    the shared container's cgroup shows every CPU again (0.0 when it already did at the
    return). Each call's own time is added to ``calls``."""
    wall = 0.0

    @contextlib.contextmanager
    def timed(name: str) -> Iterator[None]:
        nonlocal wall
        begin = time.perf_counter()
        yield
        took = time.perf_counter() - begin
        calls.setdefault(name, []).append(took)
        wall += took

    with timed("RunPodSandbox"):
        sandbox = client.run_pod_sandbox(f"churn-{index}", "bench", new_pod_uid(), "guaranteed")
    with timed("CreateContainer"):
        container_id = client.create_container(
            sandbox,
            "main",
            image,
            WORKLOAD,
            resources=ONE_CPU,
            cpuset_cpus=cpuset_cpus,
        )
    with timed("StartContainer"):
        client.start_container(container_id)
    with timed("StopContainer"):
        client.stop_container(container_id, timeout=5)
    returned = time.perf_counter()
    grown_after = _until(lambda: shared_cpus() == full, returned)
    with timed("RemoveContainer"):
        client.remove_container(container_id)
    with timed("StopPodSandbox"):
        client.stop_pod_sandbox(sandbox.id)
    with timed("RemovePodSandbox"):
        client.remove_pod_sandbox(sandbox.id)
    # The wall time is the calls' own: the cgroup reads between them are the benchmark's.
    return wall, grown_after


def _until(condition: Callable[[], bool], since: float, deadline: float = 10.0) -> float:
    if condition():
        return 0.0
    while time.perf_counter() - since < deadline:
        if condition():
            return time.perf_counter() - since
        time.sleep(0.001)
    return float("inf")


def tmpfs_dir() -> str | None:
    """/dev/shm when this machine has it (a tmpfs, like /run on a node)."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


@dataclass
class ShimPath:
    """A cpushim in front of the containerd, with the BestEffort containers it keeps moving
    (the first of them looked at after each stop)."""

    label: str
    process: ServingProcess
    client: KubeletClient | None = None
    sandbox_ids: list[str] = field(default_factory=list)
    shared_ids: list[str] = field(default_factory=list)
    cpu_before: float = 0.0


def start_shim(
    label: str, source: Path, containerd: PrivateContainerd, projection_root: Path, reserved: str
) -> ShimPath:
    """cpushim from the checkout at ``source`` (``python -m shim`` run there finds that tree's
    package before the installed one), with its own socket, state and projections."""
    listen = containerd.dir / f"{label}.sock"
    process = ServingProcess(
        cpushim_command(
            f"unix://{listen}",
            containerd.address,
            "--reserved-cpus",
            reserved,
            # As on a node: /run (a tmpfs) holds the projections, the state is on disk.
            "--projection-dir",
            str(projection_root / f"{label}-projection"),
            state_dir=containerd.dir / f"{label}-state",
            log_level="warning",
        ),
        socket_path=listen,
        log_path=containerd.dir / f"{label}.log",
        cwd=source,
    )
    process.start()
    return ShimPath(label, process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the order the paths take for each pod"
    )
    parser.add_argument(
        "--static",
        action="store_true",
        help="add a path pinned as kubelet's static policy would (no cpushim)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="add a path through a second cpushim run from another checkout of this repository"
        " (git worktree add /tmp/baseline <commit>), to compare two versions in one run",
    )
    parser.add_argument(
        "--shared",
        type=int,
        default=1,
        metavar="N",
        help="BestEffort pods each cpushim keeps moving (default 1)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="also write every pod's and call's time here"
    )
    args = parser.parse_args()
    if args.shared < 1:
        parser.error("--shared needs at least 1: the first is looked at after every stop")

    image = build_image()
    full = CPUSet.parse(Path("/sys/devices/system/cpu/online").read_text())
    if len(full) < 2:
        raise SystemExit("churn needs at least 2 CPUs (one reserved, one to pin)")
    reserved = str(full.take_lowest(1))
    with (
        PrivateContainerd(image.ref) as containerd,
        tempfile.TemporaryDirectory(dir=tmpfs_dir(), prefix="cpushim-churn-") as scratch,
    ):
        containerd.import_image(image)
        log_root = containerd.dir / "pod-logs"
        # Every cpushim starts before any container exists, so none adopts another's.
        sources = [("cpushim", REPO)]
        if args.baseline is not None:
            sources.append(("baseline", args.baseline.resolve()))
        shims: list[ShimPath] = []
        labels = ["direct", *(label for label, _ in sources)] + (["static"] if args.static else [])
        pod_walls: dict[str, list[float]] = {label: [] for label in labels}
        grown: dict[str, list[float]] = {label: [] for label in labels}
        calls: dict[str, CallTimes] = {label: {} for label in labels}
        # The CPU kubelet's static policy would give: the lowest one not reserved.
        static_cpu = str((full - full.take_lowest(1)).take_lowest(1))
        # CPU seconds used during each path's pods: containerd's, and the machine's (every
        # process and the kernel); each cpushim's over the whole run. Work a pod leaves behind
        # (cpushim's deferred records) may land in the next pod's window, of any path.
        used: dict[str, dict[str, float]] = {
            label: {"containerd": 0.0, "machine": 0.0} for label in labels
        }
        shim_cpu: dict[str, float] = {}
        assert containerd.pid is not None
        containerd_pid = containerd.pid
        try:
            for label, source in sources:
                shims.append(start_shim(label, source, containerd, Path(scratch), reserved))
            with contextlib.ExitStack() as clients:
                direct = clients.enter_context(KubeletClient(containerd.address, log_root=log_root))
                paths: list[tuple[str, KubeletClient]] = [("direct", direct)]
                for shim in shims:
                    via = shim.client = clients.enter_context(
                        KubeletClient(shim.process.address, log_root=log_root)
                    )
                    for number in range(args.shared):
                        background = via.run_pod_sandbox(
                            f"shared-{shim.label}-{number}", "bench", new_pod_uid(), "besteffort"
                        )
                        shim.sandbox_ids.append(background.id)
                        shared_id = via.create_container(background, "main", image.ref, WORKLOAD)
                        via.start_container(shared_id)
                        shim.shared_ids.append(shared_id)
                    paths.append((shim.label, via))
                if args.static:
                    paths.append(("static", direct))
                shared = {
                    s.label: functools.partial(cgroup_cpus, direct, s.shared_ids[0]) for s in shims
                }
                for shim in shims:
                    assert shim.process.process is not None
                    shim.cpu_before = cpu_seconds(shim.process.process.pid)
                order = random.Random(args.seed)
                for _ in range(args.rounds):
                    for index in range(args.pods):
                        for label, client in order.sample(paths, len(paths)):
                            containerd_before = cpu_seconds(containerd_pid)
                            machine_before = machine_cpu_seconds()
                            wall, after = one_pod(
                                client,
                                image.ref,
                                index,
                                # The direct and static paths look at the first cpushim's.
                                shared.get(label, shared["cpushim"]),
                                full,
                                calls[label],
                                static_cpu if label == "static" else "",
                            )
                            used[label]["containerd"] += cpu_seconds(containerd_pid) - (
                                containerd_before
                            )
                            used[label]["machine"] += machine_cpu_seconds() - machine_before
                            pod_walls[label].append(wall)
                            grown[label].append(after)
                for shim in shims:
                    assert shim.process.process is not None
                    assert shim.client is not None
                    shim_cpu[shim.label] = cpu_seconds(shim.process.process.pid) - shim.cpu_before
                    for sandbox_id in shim.sandbox_ids:
                        shim.client.teardown_pod(sandbox_id)
        finally:
            for shim in shims:
                if shim.process.stop() != 0:
                    print(shim.process.log())

    # Each round's wall time per path: the sum of its pods'.
    walls = {
        label: [sum(times[r * args.pods : (r + 1) * args.pods]) for r in range(args.rounds)]
        for label, times in pod_walls.items()
    }
    if args.json is not None:
        args.json.write_text(
            json.dumps({"pods": pod_walls, "rounds": walls, "calls": calls, "grown": grown})
        )
    report(args, labels, walls, pod_walls, calls, used, shim_cpu, grown, full)
    return 0


def paired_difference(
    times: list[float], reference: list[float], resamples: int = 2000
) -> tuple[float, float, float]:
    """Mean of ``times[i] - reference[i]`` (pods of one round and position), with a 95 %
    bootstrap interval (fixed seed: the same data always gives the same interval)."""
    diffs = [t - r for t, r in zip(times, reference, strict=True)]
    draw = random.Random(0)
    means = sorted(statistics.fmean(draw.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return (
        statistics.fmean(diffs),
        means[int(resamples * 0.025)],
        means[int(resamples * 0.975) - 1],
    )


def report(
    args: argparse.Namespace,
    labels: list[str],
    walls: dict[str, list[float]],
    pod_walls: dict[str, list[float]],
    calls: dict[str, CallTimes],
    used: dict[str, dict[str, float]],
    shim_cpu: dict[str, float],
    grown: dict[str, list[float]],
    full: CPUSet,
) -> None:
    per_pod = {label: statistics.median(walls[label]) / args.pods for label in labels}
    print(f"# churn benchmark  {time.strftime('%Y-%m-%d')}  {machine()}")
    print(
        f"# {args.pods} Guaranteed 1-CPU pods per path per round, the paths taking turns pod by"
        f" pod in a shuffled order (seed {args.seed}), beside {args.shared} running BestEffort"
        f" container{'s' if args.shared != 1 else ''} per cpushim;"
        f" median of {args.rounds} rounds"
    )
    print(f"{'path':<8} {'ms/pod':>8} {'ratio':>7}")
    for label in labels:
        print(f"{label:<8} {per_pod[label] * 1e3:8.1f} {per_pod[label] / per_pod['direct']:7.3f}")
    # How far one round is from another says how much to trust the ratios above.
    for label in labels[1:]:
        per_round = [c / d for c, d in zip(walls[label], walls["direct"], strict=True)]
        print(f"# {label} / direct, each round: " + " ".join(f"{r:.3f}" for r in per_round))
    # Pod by pod against direct: tighter than the rounds' medians, and with an interval.
    for label in labels[1:]:
        mean, low, high = paired_difference(pod_walls[label], pod_walls["direct"])
        means = statistics.fmean(pod_walls[label]) / statistics.fmean(pod_walls["direct"])
        print(
            f"# {label} - direct, paired per pod: {mean * 1e3:+.1f} ms"
            f" [95 % CI {low * 1e3:+.1f}, {high * 1e3:+.1f}]; ratio of means {means:.3f}"
        )
    for label, other in (("cpushim", "baseline"), ("cpushim", "static")):
        if other in walls:
            to_other = [c / s for c, s in zip(walls[label], walls[other], strict=True)]
            print(f"# {label} / {other}, each round: " + " ".join(f"{r:.3f}" for r in to_other))
    others = labels[1:]
    header = "".join(f" {label:>8}" for label in others)
    added = "".join(f" {'+' + label:>8}" for label in others)
    print(f"# per call, median ms: {'call':<18} {'direct':>8}{added}")
    for name, took in calls["direct"].items():
        d = statistics.median(took) * 1e3
        row = "".join(
            f" {statistics.median(calls[label][name]) * 1e3 - d:+8.2f}" for label in others
        )
        print(f"#                      {name:<18} {d:8.2f}{row}")
    pods_run = args.pods * args.rounds
    print(f"# CPU ms per pod:      {'process':<18} {'direct':>8}{header}")
    for shim_label, seconds in shim_cpu.items():
        shim_row = "".join(
            f" {seconds / pods_run * 1e3:8.2f}" if label == shim_label else f" {'-':>8}"
            for label in others
        )
        print(f"#                      {shim_label:<18} {'-':>8}{shim_row}")
    for name in ("containerd", "machine"):  # machine: every process and the kernel
        row = "".join(f" {used[label][name] / pods_run * 1e3:8.2f}" for label in labels)
        print(f"#                      {name:<18}{row}")
    for label in shim_cpu:
        misses = [t for t in grown[label] if t > 0]
        print(
            f"# {label}: shared container on {full} when StopContainer returned:"
            f" {len(grown[label]) - len(misses)}/{len(grown[label])} stops"
            + (f"; misses took {max(misses) * 1e3:.1f} ms at worst" if misses else "")
        )


def machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{nproc} CPUs ({model}), Python {platform.python_version()}"


if __name__ == "__main__":
    raise SystemExit(main())
