"""Pod churn against a real containerd: direct and through cpushim (static policy), same run.

    .venv/bin/python -m tests.bench.churn [--pods 50] [--rounds 3]

Needs root, containerd and runc (as the end-to-end tests do), and at least two CPUs. Each round
drives ``--pods`` Guaranteed 1-CPU pods on each path through kubelet's calls (RunPodSandbox,
CreateContainer, StartContainer, StopContainer, RemoveContainer, StopPodSandbox,
RemovePodSandbox) while a BestEffort container runs throughout, so through cpushim every pod
moves the shared container off its CPU and back. The paths take turns pod by pod (which goes
first alternates too), so both see the same moments of a noisy machine; the report gives the
median over rounds of the wall time per pod, and the ratio.

It also reads the shared container's cgroup ``cpuset.cpus`` the moment each StopContainer
returns: with cpushim the pool has grown before the return, so the time until the grown pool
is visible is 0; any pod where it is not counts as a miss, with the time it took.

``--static`` adds a third path, straight to containerd as kubelet's own static CPU manager
policy would call it: the exclusive CPU already in the CreateContainer request. It shows what
pinning itself costs containerd and the kernel (runc writing a cpuset), apart from cpushim.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--static",
        action="store_true",
        help="add a path pinned as kubelet's static policy would (no cpushim)",
    )
    args = parser.parse_args()

    image = build_image()
    full = CPUSet.parse(Path("/sys/devices/system/cpu/online").read_text())
    if len(full) < 2:
        raise SystemExit("churn needs at least 2 CPUs (one reserved, one to pin)")
    with (
        PrivateContainerd(image.ref) as containerd,
        tempfile.TemporaryDirectory(dir=tmpfs_dir(), prefix="cpushim-churn-") as scratch,
    ):
        projection_root = Path(scratch)
        containerd.import_image(image)
        log_root = containerd.dir / "pod-logs"
        listen = containerd.dir / "cpushim.sock"
        shim = ServingProcess(
            cpushim_command(
                f"unix://{listen}",
                containerd.address,
                "--reserved-cpus",
                str(full.take_lowest(1)),
                # As on a node: /run (a tmpfs) holds the projections, the state is on disk.
                "--projection-dir",
                str(projection_root / "projection"),
                state_dir=containerd.dir / "cpushim-state",
                log_level="warning",
            ),
            socket_path=listen,
            log_path=containerd.dir / "cpushim.log",
            cwd=REPO,
        )
        shim.start()
        labels = ["direct", "cpushim"] + (["static"] if args.static else [])
        walls: dict[str, list[float]] = {label: [] for label in labels}
        grown: dict[str, list[float]] = {label: [] for label in labels}
        calls: dict[str, CallTimes] = {label: {} for label in labels}
        # The CPU kubelet's static policy would give: the lowest one not reserved.
        static_cpu = str((full - full.take_lowest(1)).take_lowest(1))
        # CPU seconds used during each path's pods: containerd's, and the machine's (every
        # process and the kernel); cpushim's over the whole run. Work a pod leaves behind
        # (cpushim's deferred records) may land in the next pod's window, of either path.
        used: dict[str, dict[str, float]] = {
            label: {"containerd": 0.0, "machine": 0.0} for label in labels
        }
        assert shim.process is not None
        assert containerd.pid is not None
        shim_pid, containerd_pid = shim.process.pid, containerd.pid
        try:
            with (
                KubeletClient(containerd.address, log_root=log_root) as direct,
                KubeletClient(f"unix://{listen}", log_root=log_root) as via,
            ):
                background = via.run_pod_sandbox("shared", "bench", new_pod_uid(), "besteffort")
                shared_id = via.create_container(background, "main", image.ref, WORKLOAD)
                via.start_container(shared_id)
                shared = lambda: cgroup_cpus(direct, shared_id)  # noqa: E731
                paths = [("direct", direct), ("cpushim", via)]
                if args.static:
                    paths.append(("static", direct))
                shim_cpu_before = cpu_seconds(shim_pid)
                for _ in range(args.rounds):
                    round_wall = dict.fromkeys(labels, 0.0)
                    for index in range(args.pods):
                        # Which path goes first turns with each pod.
                        turn = index % len(paths)
                        for label, client in paths[turn:] + paths[:turn]:
                            containerd_before = cpu_seconds(containerd_pid)
                            machine_before = machine_cpu_seconds()
                            wall, after = one_pod(
                                client,
                                image.ref,
                                index,
                                shared,
                                full,
                                calls[label],
                                static_cpu if label == "static" else "",
                            )
                            used[label]["containerd"] += cpu_seconds(containerd_pid) - (
                                containerd_before
                            )
                            used[label]["machine"] += machine_cpu_seconds() - machine_before
                            round_wall[label] += wall
                            grown[label].append(after)
                    for label, wall in round_wall.items():
                        walls[label].append(wall)
                shim_cpu = cpu_seconds(shim_pid) - shim_cpu_before
                via.teardown_pod(background.id)
        finally:
            code = shim.stop()
            if code != 0:
                print(shim.log())

    direct_pod = statistics.median(walls["direct"]) / args.pods
    shim_pod = statistics.median(walls["cpushim"]) / args.pods
    print(f"# churn benchmark  {time.strftime('%Y-%m-%d')}  {machine()}")
    print(
        f"# {args.pods} Guaranteed 1-CPU pods per path per round, the paths taking turns pod by"
        f" pod, beside one running BestEffort container; median of {args.rounds} rounds"
    )
    print(f"{'path':<8} {'ms/pod':>8} {'ratio':>7}")
    print(f"{'direct':<8} {direct_pod * 1e3:8.1f} {1.0:7.3f}")
    print(f"{'cpushim':<8} {shim_pod * 1e3:8.1f} {shim_pod / direct_pod:7.3f}")
    if args.static:
        static_pod = statistics.median(walls["static"]) / args.pods
        print(f"{'static':<8} {static_pod * 1e3:8.1f} {static_pod / direct_pod:7.3f}")
    # How far one round is from another says how much to trust the ratio above.
    per_round = [c / d for c, d in zip(walls["cpushim"], walls["direct"], strict=True)]
    print("# ratio of each round: " + " ".join(f"{r:.3f}" for r in per_round))
    if args.static:
        to_static = [c / s for c, s in zip(walls["cpushim"], walls["static"], strict=True)]
        print("# cpushim / static, each round: " + " ".join(f"{r:.3f}" for r in to_static))
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
    shim_row = "".join(
        f" {shim_cpu / pods_run * 1e3:8.2f}" if label == "cpushim" else f" {'-':>8}"
        for label in others
    )
    print(f"#                      {'cpushim':<18} {'-':>8}{shim_row}")
    for name in ("containerd", "machine"):  # machine: every process and the kernel
        row = "".join(f" {used[label][name] / pods_run * 1e3:8.2f}" for label in labels)
        print(f"#                      {name:<18}{row}")
    misses = [t for t in grown["cpushim"] if t > 0]
    print(
        f"# cpushim: shared container on {full} when StopContainer returned:"
        f" {len(grown['cpushim']) - len(misses)}/{len(grown['cpushim'])} stops"
        + (f"; misses took {max(misses) * 1e3:.1f} ms at worst" if misses else "")
    )
    return 0


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
