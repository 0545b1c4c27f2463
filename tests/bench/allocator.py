"""Allocator latency: one static-policy decision on a big, busy machine.

Run: .venv/bin/python -m tests.bench.allocator [--runs N]

The machine: 256 threads, 2 sockets, 4 NUMA nodes per socket (8), 64 SMT cores per socket.
200 containers already hold CPUs, scattered (single CPUs allocated, then a random fifth
released), so best fit has to sort partly used cores. Each run is one ``allocate`` call.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from shim.cpuset import CPUSet
from shim.policy.options import StaticPolicyOptions
from shim.policy.static import ExclusiveRequest, StaticPolicy
from shim.topology import Topology
from tests.harness.sysfs import MachineSpec, expected_topology

MACHINE = MachineSpec(
    name="bench-256", sockets=2, cores_per_die=64, threads_per_core=2, numa_per_socket=4
)


def busy_assignments(policy: StaticPolicy, count: int, seed: int = 7) -> dict[int, CPUSet]:
    rng = random.Random(seed)
    assignments: dict[int, CPUSet] = {}
    serial = 0
    while len(assignments) < count * 5 // 4:
        assignments[serial] = policy.allocate(assignments, 1)
        serial += 1
    for key in rng.sample(sorted(assignments), len(assignments) - count):
        del assignments[key]
    return assignments


def measure(run: Callable[[], object], runs: int) -> tuple[float, float]:
    for _ in range(min(200, runs)):  # warm caches and the interpreter's specialisation
        run()
    samples = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        run()
        samples.append(time.perf_counter_ns() - start)
    samples.sort()
    p50 = statistics.median(samples) / 1000
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000
    return p50, p99


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5000)
    args = parser.parse_args()

    topology: Topology = expected_topology(MACHINE)
    print(f"machine: nproc={os.cpu_count()} cpu={cpu_model()!r} python={platform.python_version()}")
    print(
        f"topology: {len(topology.online)} CPUs, {topology.num_sockets} sockets,"
        f" {topology.num_numa_nodes} NUMA nodes, {topology.num_cores} cores"
    )
    scenarios = [
        ("packed, 4 CPUs, 200 assignments", StaticPolicyOptions(), ExclusiveRequest(4)),
        ("packed, 1 CPU, 200 assignments", StaticPolicyOptions(), ExclusiveRequest(1)),
        ("full-pcpus-only, 2 CPUs", StaticPolicyOptions(full_pcpus_only=True), ExclusiveRequest(2)),
        (
            "distribute-across-cores, 4 CPUs",
            StaticPolicyOptions(distribute_cpus_across_cores=True),
            ExclusiveRequest(4),
        ),
        (
            "uncore-cache, 4 CPUs",
            StaticPolicyOptions(prefer_align_cpus_by_uncorecache=True),
            ExclusiveRequest(4),
        ),
        (
            "distribute-across-numa, 16 CPUs",
            StaticPolicyOptions(distribute_cpus_across_numa=True),
            ExclusiveRequest(16),
        ),
    ]
    # One busy state for every scenario, built with the default options.
    assignments = busy_assignments(StaticPolicy.create(topology, reserved_count=4), 200)
    print(f"{'scenario':40} {'p50 us':>9} {'p99 us':>9}")
    for name, options, request in scenarios:
        policy = StaticPolicy.create(topology, reserved_count=4, options=options)
        free = len(policy.free_cpus(assignments))
        p50, p99 = measure(partial(policy.allocate, assignments, request), args.runs)
        print(f"{name:40} {p50:9.1f} {p99:9.1f}   ({len(assignments)} held, {free} free)")


if __name__ == "__main__":
    main()
