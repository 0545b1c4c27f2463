"""How fast cpushim reacts to what no CRI call tells it, on a real containerd.

    .venv/bin/python -m tests.bench.reaction [--trials 200]

Needs root, containerd and runc (as the end-to-end tests do), and at least two CPUs.
cpushim runs with the static policy and the lowest CPU reserved, a BestEffort container runs
throughout.

(a) drift: a Guaranteed 1-CPU container's cgroup ``cpuset.cpus`` is overwritten with every
    CPU from outside; timed from the write until the file shows the container's CPU again.
(b) exit: a Guaranteed 1-CPU container's process is killed from outside (no kubelet call);
    timed from the kill until the BestEffort container's cgroup shows every CPU again.

Both are polled from this process every 0.2 ms, so the figures include up to that much.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from shim.cpuset import CPUSet
from tests.bench.churn import machine
from tests.harness.containerd import (
    PrivateContainerd,
    ServingProcess,
    cpushim_command,
    wait_for,
)
from tests.harness.images import build_image
from tests.harness.kubelet import (
    ONE_CPU,
    WORKLOAD,
    KubeletClient,
    Sandbox,
    new_pod_uid,
)

REPO = Path(__file__).resolve().parents[2]
POLL = 0.0002


def cpuset_file(client: KubeletClient, container_id: str) -> Path:
    info = json.loads(client.container_status(container_id, verbose=True).info["info"])
    path = info["runtimeSpec"]["linux"]["cgroupsPath"].lstrip("/")
    return Path("/sys/fs/cgroup/cpuset", path, "cpuset.cpus")


def read(path: Path) -> CPUSet | None:
    try:
        return CPUSet.parse(path.read_text().strip())
    except OSError:
        return None


def until(condition: Callable[[], bool], since: float, deadline: float = 10.0) -> float:
    while not condition():
        if time.perf_counter() - since > deadline:
            raise TimeoutError("no reaction within 10 s")
        time.sleep(POLL)
    return time.perf_counter() - since


def pinned(client: KubeletClient, image: str, index: int) -> tuple[Sandbox, str]:
    sandbox = client.run_pod_sandbox(f"pinned-{index}", "bench", new_pod_uid(), "guaranteed")
    container_id = client.create_container(
        sandbox,
        "main",
        image,
        WORKLOAD,
        resources=ONE_CPU,
    )
    client.start_container(container_id)
    return sandbox, container_id


def torn_down(client: KubeletClient, sandbox: Sandbox) -> None:
    """Tear a pod down once containerd has finished with its killed container (it refuses
    RemoveContainer for a moment after the exit)."""

    def attempt() -> bool:
        try:
            client.teardown_pod(sandbox.id)
        except grpc.RpcError:
            return False
        return True

    wait_for(attempt, 10.0, f"pod {sandbox.id[:12]} torn down", interval=0.01)


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"p50 {statistics.median(ordered) * 1e3:6.2f} ms  p99 {p99 * 1e3:6.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()

    image = build_image()
    full = CPUSet.parse(Path("/sys/devices/system/cpu/online").read_text())
    if len(full) < 2:
        raise SystemExit("reaction needs at least 2 CPUs (one reserved, one to pin)")
    drift: list[float] = []
    exits: list[float] = []
    with PrivateContainerd(image.ref) as containerd:
        containerd.import_image(image)
        listen = containerd.dir / "cpushim.sock"
        shim = ServingProcess(
            cpushim_command(
                f"unix://{listen}",
                containerd.address,
                "--reserved-cpus",
                str(full.take_lowest(1)),
                state_dir=containerd.dir / "cpushim-state",
                log_level="warning",
            ),
            socket_path=listen,
            log_path=containerd.dir / "cpushim.log",
            cwd=REPO,
        )
        shim.start()
        try:
            with KubeletClient(f"unix://{listen}", log_root=containerd.dir / "logs") as client:
                background = client.run_pod_sandbox("shared", "bench", new_pod_uid(), "besteffort")
                shared_id = client.create_container(background, "main", image.ref, WORKLOAD)
                client.start_container(shared_id)
                shared_file = cpuset_file(client, shared_id)

                sandbox, container_id = pinned(client, image.ref, 0)
                pinned_file = cpuset_file(client, container_id)
                own = read(pinned_file)
                assert own is not None
                for _ in range(args.trials):
                    begin = time.perf_counter()
                    pinned_file.write_text(str(full))
                    drift.append(until(lambda: read(pinned_file) == own, begin))
                client.teardown_pod(sandbox.id)

                for index in range(args.trials):
                    sandbox, container_id = pinned(client, image.ref, index + 1)
                    pid = client.container_pid(container_id)
                    grown = read(shared_file)
                    assert grown != full, grown
                    begin = time.perf_counter()
                    os.kill(pid, signal.SIGKILL)
                    exits.append(until(lambda: read(shared_file) == full, begin))
                    torn_down(client, sandbox)
                client.teardown_pod(background.id)
        finally:
            code = shim.stop()
            if code != 0:
                print(shim.log())

    print(f"# reaction benchmark  {time.strftime('%Y-%m-%d')}  {machine()}")
    print(f"# {args.trials} trials each; polled every {POLL * 1e3:.1f} ms")
    print(f"(a) outside write to cpuset restored:     {percentiles(drift)}")
    print(f"(b) container killed to shared pool grown: {percentiles(exits)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
