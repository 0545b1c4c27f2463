"""The ``cpushim`` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable

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
