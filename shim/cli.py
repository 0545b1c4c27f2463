"""The ``cpushim`` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from shim import __version__
from shim import log as shim_log
from shim.cri.server import AlreadyServingError

DEFAULT_LISTEN = "unix:///run/cpushim/cri.sock"
DEFAULT_RUNTIME = "unix:///run/containerd/containerd.sock"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpushim", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cpushim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="serve the CRI socket in front of the runtime")
    run.add_argument("--listen", default=DEFAULT_LISTEN, help="socket kubelet connects to")
    run.add_argument("--runtime-endpoint", default=DEFAULT_RUNTIME, help="containerd's socket")
    run.add_argument(
        "--image-endpoint", default=None, help="image service socket (default: the runtime's)"
    )
    run.add_argument("--socket-group", default=None, help="group owning the listen socket")
    run.add_argument(
        "--upstream-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the runtime at start before giving up (default 60)",
    )
    run.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long calls in flight may take to finish on SIGTERM (default 10)",
    )
    policy = run.add_argument_group("CPU allocation")
    policy.add_argument(
        "--policy",
        default="static",
        choices=("none", "static"),
        help="static: exclusive CPUs for integer-CPU containers of Guaranteed pods (default);"
        " none: every container on every CPU",
    )
    reserved = policy.add_mutually_exclusive_group()
    reserved.add_argument(
        "--reserved-cpus",
        metavar="LIST",
        help="CPUs kept for system daemons, kernel list format (like kubelet's"
        " reservedSystemCPUs); never handed out exclusively",
    )
    reserved.add_argument(
        "--reserved-cpu-count",
        type=int,
        metavar="N",
        help="reserve N CPUs, lowest-numbered physical cores first (default 1)",
    )
    policy.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="NAME",
        help="a static policy option by kubelet's name, e.g. full-pcpus-only (repeatable)",
    )
    policy.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/var/lib/cpushim"),
        metavar="DIR",
        help="where state.json, the checkpoint, lives (default /var/lib/cpushim)",
    )
    policy.add_argument(
        "--sysfs-root",
        type=Path,
        default=Path("/sys"),
        metavar="DIR",
        help="where to read the CPU topology from (default /sys; for tests)",
    )
    policy.add_argument(
        "--failure-policy",
        default="fail-closed",
        choices=("fail-closed", "fail-open"),
        help="on an internal error: refuse the call with INTERNAL (fail-closed, default) or"
        " forward it unchanged (fail-open)",
    )
    policy.add_argument(
        "--recover-from-runtime",
        action="store_true",
        help="ignore the checkpoint (it is kept beside, renamed) and rebuild the assignments"
        " from the containers the runtime reports",
    )
    run.add_argument(
        "--event-loop",
        default="auto",
        choices=("auto", "uvloop", "asyncio"),
        help="event loop implementation; auto picks uvloop when it is installed",
    )
    run.add_argument("--log-level", default="info", choices=shim_log.LEVELS)
    return parser


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop to run on: uvloop roughly halves the relay's per-hop latency."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ValueError("--event-loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shim_log.setup(args.log_level)
    log = logging.getLogger("shim.cli")
    if args.command == "run":
        from shim.run import RunOptions, run

        options = RunOptions(
            listen=args.listen,
            runtime_endpoint=args.runtime_endpoint,
            image_endpoint=args.image_endpoint or args.runtime_endpoint,
            socket_group=args.socket_group,
            upstream_wait=args.upstream_wait,
            shutdown_grace=args.shutdown_grace,
            policy=args.policy,
            reserved_cpus=args.reserved_cpus,
            reserved_cpu_count=args.reserved_cpu_count,
            policy_options=tuple(args.policy_option),
            state_dir=args.state_dir,
            sysfs_root=args.sysfs_root,
            failure_policy=args.failure_policy,
            recover_from_runtime=args.recover_from_runtime,
        )
        try:
            with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
                return runner.run(run(options))
        except (AlreadyServingError, ValueError, RuntimeError, OSError) as exc:
            log.error("cannot run", extra={"fields": {"error": str(exc)}})
            return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
