"""Relay speed against a real containerd: direct and through cpushim, in the same run.

    .venv/bin/python -m tests.bench.relay [--calls 3000] [--seconds 4] [--rounds 3]

Needs root, containerd and runc (as the end-to-end tests do). For ``Version`` and for
``ListContainers`` with 50 containers it reports p50/p99 latency with one call in flight,
throughput with 16 in flight, and cpushim's CPU time per call. Runs alternate between direct,
a plain byte pipe (``tests.bench.pipe``: no HTTP/2 parsing, the floor of any relay process) and
cpushim; each figure is the median over ``--rounds``, and ratios compare with direct. The client
is grpcio's asyncio API (C core), an independent gRPC implementation, as kubelet's grpc-go is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from shim.cri import runtime_v1_pb2 as pb
from tests.bench.procfs import cpu_seconds
from tests.harness.containerd import (
    PrivateContainerd,
    cpushim_command,
    socket_accepts,
    wait_for,
)
from tests.harness.images import build_image

REPO = Path(__file__).resolve().parents[2]
RUNTIME = "/runtime.v1.RuntimeService/"
CONTAINERS = 50
IN_FLIGHT = 16


@dataclass
class Figures:
    p50_us: float
    p99_us: float
    calls_per_s: float
    relay_cpu_us: float | None = None


async def measure(
    target: str, path: str, request: bytes, calls: int, seconds: float, relay_pid: int | None
) -> Figures:
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        call = channel.unary_unary(path)
        for _ in range(200):  # warm up connections and caches
            await call(request, timeout=10)
        latencies = []
        for _ in range(calls):
            start = time.perf_counter()
            await call(request, timeout=10)
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        done = 0
        stop_at = time.perf_counter() + seconds
        cpu_before = cpu_seconds(relay_pid) if relay_pid else 0.0

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await call(request, timeout=10)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        elapsed = time.perf_counter() - started
        relay_cpu = None
        if relay_pid:
            relay_cpu = (cpu_seconds(relay_pid) - cpu_before) / done * 1e6
    return Figures(
        p50_us=latencies[len(latencies) // 2] * 1e6,
        p99_us=latencies[int(len(latencies) * 0.99)] * 1e6,
        calls_per_s=done / elapsed,
        relay_cpu_us=relay_cpu,
    )


def populate(target: str, image: str, containers: int) -> None:
    """One host-network pod holding ``containers`` created containers."""
    with grpc.insecure_channel(target) as channel:

        def rpc(name: str, request: object, reply: Callable[[bytes], object]) -> object:
            return channel.unary_unary(
                RUNTIME + name,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=reply,
            )(request, timeout=60)

        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="bench", uid="bench-uid", namespace="bench"),
            log_directory="/tmp",
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent="/kubepods/besteffort/podbench-uid",
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.NODE)
                ),
            ),
        )
        sandbox = rpc(
            "RunPodSandbox",
            pb.RunPodSandboxRequest(config=config),
            pb.RunPodSandboxResponse.FromString,
        )
        for i in range(containers):
            rpc(
                "CreateContainer",
                pb.CreateContainerRequest(
                    pod_sandbox_id=sandbox.pod_sandbox_id,  # type: ignore[attr-defined]
                    sandbox_config=config,
                    config=pb.ContainerConfig(
                        metadata=pb.ContainerMetadata(name=f"c{i}"),
                        image=pb.ImageSpec(image=image),
                        command=["sleep", "3600"],
                        log_path=f"c{i}.log",
                    ),
                ),
                pb.CreateContainerResponse.FromString,
            )


def start_cpushim(
    listen: Path, runtime: str, log: Path, event_loop: str
) -> subprocess.Popen[bytes]:
    command = cpushim_command(
        f"unix://{listen}",
        runtime,
        "--event-loop",
        event_loop,
        state_dir=listen.parent / "state",
        log_level="warning",
    )
    proc = subprocess.Popen(command, stderr=log.open("wb"), cwd=REPO)
    wait_for(lambda: socket_accepts(listen), 20, f"cpushim serving {listen}")
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--event-loop",
        default="auto",
        choices=("auto", "uvloop", "asyncio"),
        help="cpushim's event loop (its run --event-loop)",
    )
    args = parser.parse_args()

    image = build_image()
    with PrivateContainerd(image.ref) as containerd:
        containerd.import_image(image)
        populate(containerd.address, image.ref, CONTAINERS)
        listen = containerd.dir / "cpushim.sock"
        relay = start_cpushim(
            listen, containerd.address, containerd.dir / "cpushim.log", args.event_loop
        )
        pipe_socket = containerd.dir / "pipe.sock"
        pipe = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.bench.pipe",
                str(pipe_socket),
                str(containerd.socket_path),
                "asyncio" if args.event_loop == "asyncio" else "uvloop",
            ],
            stdout=subprocess.DEVNULL,
            cwd=REPO,
        )
        wait_for(lambda: socket_accepts(pipe_socket), 20, "byte pipe serving")
        try:
            listed = pb.ListContainersResponse.FromString(
                grpc.insecure_channel(containerd.address).unary_unary(RUNTIME + "ListContainers")(
                    b"", timeout=10
                )
            )
            reply_bytes = len(listed.SerializeToString())
            cases = [("Version", b""), ("ListContainers", b"")]
            results: dict[tuple[str, str], list[Figures]] = {}
            for _ in range(args.rounds):
                for name, request in cases:
                    for label, target, pid in (
                        ("direct", containerd.address, None),
                        ("pipe", f"unix://{pipe_socket}", pipe.pid),
                        ("cpushim", f"unix://{listen}", relay.pid),
                    ):
                        figures = asyncio.run(
                            measure(target, RUNTIME + name, request, args.calls, args.seconds, pid)
                        )
                        results.setdefault((name, label), []).append(figures)
        finally:
            relay.terminate()
            relay.wait(20)
            pipe.terminate()
            pipe.wait(20)

    print(
        f"# relay benchmark  {time.strftime('%Y-%m-%d')}  {machine()}  "
        f"cpushim --event-loop {args.event_loop}"
    )
    print(
        f"# ListContainers returns {len(listed.containers)} containers ({reply_bytes} bytes);"
        f" {args.calls} sequential calls, {IN_FLIGHT} in flight for {args.seconds:g}s,"
        f" median of {args.rounds} rounds"
    )
    header = (
        f"{'call':<15} {'path':<8} {'p50 us':>8} {'p99 us':>8} {'calls/s':>9}"
        f" {'relay CPU us/call':>18}"
    )
    print(header)
    for name, _ in cases:
        direct = median(results[(name, "direct")])
        piped = median(results[(name, "pipe")])
        relayed = median(results[(name, "cpushim")])
        for label, fig in (("direct", direct), ("pipe", piped), ("cpushim", relayed)):
            cpu = f"{fig.relay_cpu_us:.0f}" if fig.relay_cpu_us is not None else "-"
            print(
                f"{name:<15} {label:<8} {fig.p50_us:8.0f} {fig.p99_us:8.0f}"
                f" {fig.calls_per_s:9.0f} {cpu:>18}"
            )
        for label, fig in (("pipe/dir", piped), ("shim/dir", relayed)):
            print(
                f"{name:<15} {label:<8} {fig.p50_us - direct.p50_us:>+8.0f}"
                f" {fig.p99_us - direct.p99_us:>+8.0f}"
                f" {fig.calls_per_s / direct.calls_per_s:9.0%}"
            )
    return 0


def median(runs: list[Figures]) -> Figures:
    cpu = [f.relay_cpu_us for f in runs if f.relay_cpu_us is not None]
    return Figures(
        p50_us=statistics.median(f.p50_us for f in runs),
        p99_us=statistics.median(f.p99_us for f in runs),
        calls_per_s=statistics.median(f.calls_per_s for f in runs),
        relay_cpu_us=statistics.median(cpu) if cpu else None,
    )


def machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{os.cpu_count()} CPUs, {model}, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())
