"""Show cpushim at work on this machine: pods pinned through it, and what the kernel says.

Run as root from the repository root::

    .venv/bin/python contrib/demo.py            # through cpushim
    .venv/bin/python contrib/demo.py --direct   # straight to containerd, for comparison

It starts a private containerd (nothing else on the machine is touched), imports a busybox
image built locally, starts ``python -m shim run`` in front of it (static policy, the lowest
CPU reserved), and runs, the way kubelet would, a Burstable pod whose container asks for a
quarter of a CPU, then a Guaranteed pod whose container asks for 1 whole CPU, resizes that
one in place to half a CPU and back to 1 (kubelet's InPlacePodVerticalScaling), then stops
it. After each step it prints the CPUs the kernel lets each running container run
on, from its cgroup (``cpuset.cpus``) and from its process (``Cpus_allowed_list``), and what
the container itself reads in the directory cpushim projects into it (``/run/cpushim/cpus``).
Then it tears everything down, also when something failed on the way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Imports from the repository come after the path is set up.
from tests.harness.containerd import (  # noqa: E402
    ContainerdError,
    PrivateContainerd,
    ServingProcess,
    ServingProcessError,
    cpushim_command,
)
from tests.harness.images import TEST_IMAGE, ImageBuildError, build_image  # noqa: E402
from tests.harness.kubelet import (  # noqa: E402
    MIB,
    WORKLOAD,
    ContainerResources,
    KubeletClient,
    QoSClass,
    new_pod_uid,
)


@dataclass(frozen=True, slots=True)
class DemoPod:
    pod: str
    container: str
    qos: QoSClass
    cpu_milli_request: int
    cpu_milli_limit: int
    memory: int


SHARED = DemoPod("shared", "web", "burstable", 250, 500, 32 * MIB)
EXCLUSIVE = DemoPod("exclusive", "worker", "guaranteed", 1000, 1000, 64 * MIB)


@dataclass(frozen=True, slots=True)
class Row:
    container: str
    qos: str
    requested: str
    cgroup_cpus: str
    allowed_cpus: str
    projected_cpus: str


def preflight() -> list[str]:
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append("run as root: containerd and runc need it")
    problems += [
        f"{tool} is not installed (apt-get install containerd runc)"
        for tool in ("containerd", "runc", "ctr")
        if shutil.which(tool) is None
    ]
    return problems


def cpus_text(milli: int) -> str:
    return f"{milli // 1000}" if milli % 1000 == 0 else f"{milli / 1000:g}"


@dataclass
class Running:
    spec: DemoPod
    container_id: str


def start_pod(client: KubeletClient, spec: DemoPod) -> Running:
    sandbox = client.run_pod_sandbox(spec.pod, "demo", new_pod_uid(), spec.qos)
    container_id = client.create_container(
        sandbox,
        spec.container,
        TEST_IMAGE,
        WORKLOAD,
        resources=ContainerResources(
            spec.cpu_milli_request, spec.cpu_milli_limit, spec.memory, spec.memory
        ),
    )
    client.start_container(container_id)
    return Running(spec, container_id)


def resize_in_place(client: KubeletClient, item: Running, milli_cpu: int) -> None:
    """kubelet's in-place resize of the container's CPU (InPlacePodVerticalScaling): its
    whole resource set, request and limit both ``milli_cpu``, in one UpdateContainerResources."""
    spec = replace(item.spec, cpu_milli_request=milli_cpu, cpu_milli_limit=milli_cpu)
    client.update_container_resources(
        item.container_id,
        client.linux_resources(
            spec.qos, ContainerResources(milli_cpu, milli_cpu, spec.memory, spec.memory)
        ),
    )
    item.spec = spec


def projected_cpus(client: KubeletClient, container_id: str, kernel: str) -> str:
    """What the container reads in its projection, /run/cpushim/cpus ("-" without one).
    cpushim rewrites it just after the cgroup changes: give it a moment to catch up."""
    deadline = time.monotonic() + 1.0
    while True:
        result = client.exec_sync(container_id, ["cat", "/run/cpushim/cpus"])
        text = result.stdout.decode().strip() if result.exit_code == 0 else "-"
        if text in (kernel, "-") or time.monotonic() > deadline:
            return text
        time.sleep(0.02)


def rows_of(client: KubeletClient, running: list[Running]) -> list[Row]:
    rows: list[Row] = []
    for item in running:
        spec = item.spec
        kernel = client.kernel_cpus(item.container_id)
        requested = cpus_text(spec.cpu_milli_request)
        if spec.cpu_milli_limit != spec.cpu_milli_request:
            requested += f" (limit {cpus_text(spec.cpu_milli_limit)})"
        rows.append(
            Row(
                f"{spec.pod}/{spec.container}",
                spec.qos.capitalize(),
                requested,
                kernel.cgroup_cpuset_cpus,
                kernel.cpus_allowed_list,
                projected_cpus(client, item.container_id, kernel.cgroup_cpuset_cpus),
            )
        )
    return rows


def print_table(title: str, rows: list[Row]) -> None:
    headers = (
        "container",
        "QoS",
        "requested CPUs",
        "cgroup cpuset.cpus",
        "Cpus_allowed_list",
        "/run/cpushim/cpus",
    )
    table = [
        headers,
        *(
            (r.container, r.qos, r.requested, r.cgroup_cpus, r.allowed_cpus, r.projected_cpus)
            for r in rows
        ),
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    print(f"\n== {title}")
    for index, line in enumerate(table):
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )
        if index == 0:
            print("  ".join("-" * width for width in widths))


def run_scenario(client: KubeletClient, direct: bool) -> None:
    shared = start_pod(client, SHARED)
    print_table(
        "a Burstable pod runs: it shares every CPU cpushim does not reserve",
        rows_of(client, [shared]),
    )
    exclusive = start_pod(client, EXCLUSIVE)
    print_table(
        "a Guaranteed pod asks for 1 whole CPU and gets one to itself;\n"
        "   the Burstable pod moved off it before the Guaranteed one was created",
        rows_of(client, [shared, exclusive]),
    )
    resize_in_place(client, exclusive, 500)
    print_table(
        "kubectl resizes the Guaranteed pod in place to half a CPU:\n"
        "   it gives its CPU back and shares, still running",
        rows_of(client, [shared, exclusive]),
    )
    resize_in_place(client, exclusive, 1000)
    print_table(
        "and back to 1 whole CPU: it has one to itself again,\n"
        "   the Burstable pod moved off it first",
        rows_of(client, [shared, exclusive]),
    )
    client.stop_container(exclusive.container_id, timeout=5)
    print_table(
        "the Guaranteed container stopped;\n"
        "   its CPU was back in the shared pool before StopContainer returned",
        rows_of(client, [shared]),
    )
    if direct:
        print("\n(direct to containerd: nobody pins anything, every container runs everywhere)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--direct", action="store_true", help="talk to containerd directly, without cpushim"
    )
    args = parser.parse_args(argv)

    problems = preflight()
    if problems:
        for problem in problems:
            print(f"demo: {problem}", file=sys.stderr)
        return 2

    online = Path("/sys/devices/system/cpu/online").read_text().strip()
    with contextlib.ExitStack() as cleanup:
        try:
            image = build_image(TEST_IMAGE)
            print(f"starting a private containerd (sandbox image {image.ref}) ...")
            containerd = cleanup.enter_context(PrivateContainerd(sandbox_image=image.ref))
            containerd.import_image(image)
            endpoint = containerd.address
            if not args.direct:
                work = Path(
                    cleanup.enter_context(tempfile.TemporaryDirectory(prefix="cpushim-demo-"))
                )
                reserved = online.replace("-", ",").split(",")[0]
                shim = ServingProcess(
                    cpushim_command(
                        f"unix://{work / 'cpushim.sock'}",
                        containerd.address,
                        "--reserved-cpus",
                        reserved,
                        state_dir=work / "state",
                    ),
                    socket_path=work / "cpushim.sock",
                    log_path=work / "cpushim.log",
                    cwd=REPO_ROOT,
                )
                print(
                    f"starting cpushim in front of it (static policy, CPU {reserved} reserved) ..."
                )
                shim.start()
                cleanup.callback(shim.stop)
                endpoint = shim.address
            client = cleanup.enter_context(
                KubeletClient(endpoint, log_root=containerd.dir / "pod-logs")
            )
            # Registered after the client, so pods go before the relay and containerd do.
            cleanup.callback(client.teardown_all)
            client.wait_ready()
            print(f"online CPUs on this machine: {online}")
            run_scenario(client, args.direct)
        except (ContainerdError, ServingProcessError, ImageBuildError, TimeoutError) as error:
            print(f"demo: {error}", file=sys.stderr)
            return 1
        except grpc.RpcError as error:
            print(f"demo: CRI call failed: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        print("\ntearing down ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
