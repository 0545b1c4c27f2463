"""How long a workload waits to learn of its new cpuset through its projection directory.

    .venv/bin/python -m tests.bench.projection [--changes 500] [--dir DIR]

The engine runs in this process in front of the fake CRI runtime (tests/fake_runtime.py, which
keeps a cgroup-shaped tree of ``cpuset.cpus`` files), on the 2-socket fake machine of the unit
tests. A BestEffort container runs throughout; a Guaranteed 1-CPU container is created and
stopped in turn, so the shared container's cpuset shrinks and grows: each is one change. A
subscriber in another process (``shim.projection.watch`` on the shared container's directory,
as a workload would run it) prints each state as it gets it.

Timed from the moment the engine has decided a change (its state committed, before it moves any
container) until the subscriber's iterator yields it, with the system-wide monotonic clock
both processes share. One change is in flight at a time. DIR (default: a directory under
/dev/shm, a tmpfs like /run on a node) holds the projection directories.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from shim.engine import EngineOptions, ProjectionSettings
from shim.engine.core import Engine
from shim.engine.tracked import Tracked
from tests.fake_runtime import FakeRuntime
from tests.unit.engine_env import ALL, SHARED_AFTER_FIRST_SINGLE, make_env

REPO = Path(__file__).resolve().parents[2]
SUBSCRIBER = """
import sys, time, anyio
from shim.projection import watch

async def main() -> None:
    async for state in watch(sys.argv[1]):
        print(state.generation, state.cpus, time.monotonic_ns(), flush=True)

anyio.run(main)
"""


class Subscriber:
    def __init__(self, directory: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, str(directory)],
            stdout=subprocess.PIPE,
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert self.process.stdout is not None
        self.stdout = self.process.stdout

    async def next(self) -> tuple[int, str, int]:
        line = await asyncio.to_thread(self.stdout.readline)
        if not line:
            raise RuntimeError("the subscriber exited")
        generation, cpus, seen_ns = line.split()
        return int(generation), cpus.decode(), int(seen_ns)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def stamp_decisions(engine: Engine, decided: list[int]) -> None:
    """Record when each change of the shared pool is decided: ``_apply`` runs right after the
    new state is committed and before any container moves."""
    apply = engine._apply
    last = [engine.state.shared]

    async def stamped(
        moved: Callable[[], None] | None = None, *, leave: Tracked | None = None
    ) -> None:
        if engine.state.shared != last[0]:
            last[0] = engine.state.shared
            decided.append(time.monotonic_ns())
        await apply(moved, leave=leave)

    engine._apply = stamped  # type: ignore[method-assign]


async def measure(changes: int, root: Path) -> list[float]:
    async with FakeRuntime(cgroup_root=root / "cgroup") as fake:
        env = await make_env(
            fake,
            root / "state",
            options=EngineOptions(record_delay=3600.0),
            projection=ProjectionSettings(root / "projection", Path("/run/cpushim")),
        )
        kubelet = env.kubelet
        shared_pod = await kubelet.run_pod("web", "besteffort")
        await kubelet.start_new(shared_pod, "main")
        subscriber = Subscriber(root / "projection" / shared_pod.uid / "main")
        decided: list[int] = []
        stamp_decisions(env.engine, decided)
        latencies: list[float] = []
        try:
            _, cpus, _ = await subscriber.next()
            assert cpus == str(ALL), cpus
            pinned_pod = await kubelet.run_pod("db", "guaranteed")
            attempt = 0
            while len(latencies) < changes:
                pinned_id = await kubelet.start_new(pinned_pod, "main", 1000, attempt)
                attempt += 1
                for expected in (SHARED_AFTER_FIRST_SINGLE, str(ALL)):
                    _, cpus, seen_ns = await subscriber.next()
                    assert cpus == expected, (cpus, expected)
                    latencies.append((seen_ns - decided[-1]) / 1e6)
                    if expected == SHARED_AFTER_FIRST_SINGLE:
                        await kubelet.stop(pinned_id)
                await kubelet.remove(pinned_id)
        finally:
            subscriber.close()
            env.channel.close()
        return latencies[:changes]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=500)
    parser.add_argument("--dir", type=Path, default=None, help="where the directories go")
    args = parser.parse_args()
    base = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    with tempfile.TemporaryDirectory(dir=base, prefix="cpushim-bench-") as scratch:
        root = Path(scratch)
        latencies = asyncio.run(measure(args.changes, root))
        filesystem = subprocess.run(
            ["stat", "-f", "-c", "%T", str(root)], capture_output=True, text=True, check=False
        ).stdout.strip()
    print(
        f"projection: {len(latencies)} changes, decided -> subscriber yields it,"
        f" {filesystem or '?'} at {base or tempfile.gettempdir()},"
        f" {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(
        f"  p50 {statistics.median(latencies):.2f} ms  p99 {percentile(latencies, 0.99):.2f} ms"
        f"  max {max(latencies):.2f} ms  (target: p99 <= 10 ms)"
    )


if __name__ == "__main__":
    main()
