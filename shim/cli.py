"""cpushim: a CPU manager for Kubernetes nodes, on the CRI path between kubelet and
containerd."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shim import __version__
from shim import log as shim_log
from shim.config import (
    EVENT_LOOPS,
    FAILURE_POLICIES,
    KEYS_BY_NAME,
    LOG_LEVELS,
    POLICIES,
    ConfigError,
    flag_type,
    load_config,
    resolve,
)
from shim.cri.server import AlreadyServingError
from shim.policy.options import OptionsError, StaticPolicyOptions
from shim.status_cli import add_commands as add_status_commands

if TYPE_CHECKING:
    from shim.run import RunOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpushim", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cpushim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # No argparse defaults: the namespace holds only the flags given, which override the
    # config file; the defaults are RunOptions'.
    run = sub.add_parser(
        "run",
        help="serve the CRI socket in front of the runtime",
        argument_default=argparse.SUPPRESS,
    )
    run.add_argument(
        "--config",
        dest="config_path",
        type=Path,
        metavar="PATH",
        help="a TOML file with a key for each flag below; flags override it",
    )
    _option(run, "listen", help="socket kubelet connects to (default unix:///run/cpushim/cri.sock)")
    _option(
        run,
        "runtimeEndpoint",
        help="containerd's socket (default unix:///run/containerd/containerd.sock)",
    )
    _option(run, "imageEndpoint", help="image service socket (default: the runtime's)")
    _option(run, "socketGroup", help="group owning the listen socket")
    _option(
        run,
        "upstreamWait",
        metavar="SECONDS",
        help="how long to wait for the runtime at start before giving up (default 60)",
    )
    _option(
        run,
        "shutdownGrace",
        metavar="SECONDS",
        help="how long calls in flight may take to finish on SIGTERM or SIGINT (default 10;"
        " a second signal ends the wait)",
    )
    policy = run.add_argument_group("CPU allocation")
    _option(
        policy,
        "cpuManagerPolicy",
        choices=POLICIES,
        help="static: exclusive CPUs for integer-CPU containers of Guaranteed pods, a shared"
        " pool for the rest (default); none: every container on every online CPU",
    )
    reserved = policy.add_mutually_exclusive_group()
    _option(
        reserved,
        "reservedSystemCPUs",
        metavar="LIST",
        help="CPUs never handed out exclusively, kernel list format (like kubelet's"
        " reservedSystemCPUs); shared containers still run on them unless"
        " strict-cpu-reservation; the none policy uses every online CPU whatever this says",
    )
    _option(
        reserved,
        "reservedCPUCount",
        metavar="N",
        help="reserve N CPUs, lowest-numbered physical cores first (default 1); under a"
        " distribute-cpus-across-* option, taken as that option's allocator takes them",
    )
    _option(
        policy,
        "cpuManagerPolicyOptions",
        action="append",
        type=_policy_option_name,
        metavar="NAME",
        help="a static policy option by kubelet's name, e.g. full-pcpus-only (repeatable;"
        " replaces the config file's options)",
    )
    _option(
        policy,
        "stateDir",
        metavar="DIR",
        help="where state.json, the checkpoint, lives (default /var/lib/cpushim)",
    )
    _option(
        policy,
        "sysfsRoot",
        metavar="DIR",
        help="where to read the CPU topology from (default /sys; for tests)",
    )
    _option(
        policy,
        "failurePolicy",
        choices=FAILURE_POLICIES,
        help="on an internal error deciding a call, before it reaches the runtime: refuse it"
        " with INTERNAL (fail-closed, default) or forward it unchanged (fail-open)",
    )
    _option(
        policy,
        "recoverFromRuntime",
        action=argparse.BooleanOptionalAction,
        help="ignore the checkpoint (it is kept beside, renamed) and rebuild the assignments"
        " from the containers the runtime reports (--no-recover-from-runtime: not, whatever"
        " the config file says)",
    )
    _option(
        policy,
        "resyncPeriod",
        metavar="SECONDS",
        help="how often the safety-net resync compares every cgroup with the state"
        " (default 300; 0: never)",
    )
    projection = run.add_argument_group("projection and metrics")
    _option(
        projection,
        "projectionDir",
        metavar="DIR",
        help="where each container's projected files are written on the host"
        " (default /run/cpushim/projection)",
    )
    _option(
        projection,
        "projectionMountPath",
        metavar="PATH",
        help="where those files appear inside the container (default /run/cpushim)",
    )
    _option(
        projection,
        "metricsAddress",
        metavar="HOST:PORT",
        help="where Prometheus metrics are served (default 127.0.0.1:9464; '' switches them off)",
    )
    _option(
        run,
        "eventLoop",
        choices=EVENT_LOOPS,
        help="event loop implementation; auto (default) picks uvloop when it is installed",
    )
    _option(run, "logLevel", choices=LOG_LEVELS, help="(default info)")
    add_status_commands(sub)
    return parser


def _policy_option_name(text: str) -> str:
    """One ``--policy-option``: a name the static policy knows, as the file's table wants."""
    try:
        StaticPolicyOptions.parse((text,))
    except OptionsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _option(group: argparse._ActionsContainer, key_name: str, **kwargs: Any) -> None:
    """The flag of config key ``key_name``, stored under its RunOptions field, so that flags
    and keys cannot drift apart (names, and the values each accepts)."""
    key = KEYS_BY_NAME[key_name]
    if "action" not in kwargs:
        # The flag takes what the key takes: a value the file refuses is refused here too.
        kwargs["type"] = flag_type(key_name)
    help_text = kwargs.pop("help", None)
    config_help = f"config key {key.name}"
    help_text = f"{help_text}; {config_help}" if help_text else config_help
    group.add_argument(key.flag, dest=key.field, help=help_text, **kwargs)


def run_options(args: argparse.Namespace) -> RunOptions:
    """The options of ``cpushim run``: the flags given, over the config file, over the
    built-in defaults. ConfigError when the config file is missing or bad."""
    flags = {name: value for name, value in vars(args).items() if name != "command"}
    if "policy_options" in flags:
        flags["policy_options"] = tuple(flags["policy_options"])
    path = flags.get("config_path")
    return resolve(flags, load_config(path) if isinstance(path, Path) else {})


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop to run on: uvloop roughly halves the relay's per-hop latency."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ValueError(
                    "event loop uvloop (--event-loop, eventLoop): uvloop is not installed"
                ) from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


def _run(args: argparse.Namespace) -> int:
    from shim.run import RunOptions, run

    log = logging.getLogger("shim.cli")
    try:
        options = run_options(args)
    except ConfigError as exc:
        shim_log.setup(getattr(args, "log_level", RunOptions.log_level))
        log.error(
            "cannot run",
            extra={
                "fields": {
                    "error": str(exc),
                    "config": str(exc.path),
                    "line": exc.line,
                    "key": exc.key,
                }
            },
        )
        return 1
    shim_log.setup(options.log_level)
    log_config(options)
    try:
        with asyncio.Runner(loop_factory=loop_factory(options.event_loop)) as runner:
            return runner.run(run(options))
    except (AlreadyServingError, ValueError, RuntimeError, OSError) as exc:
        log.error("cannot run", extra={"fields": {"error": str(exc)}})
        return 1


def log_config(options: RunOptions) -> None:
    """Say which config file is read and which flags override it; warn when the file turns
    on recoverFromRuntime, which, left there, throws the checkpoint away at every start."""
    if options.config_path is None:
        return
    log = logging.getLogger("shim.cli")
    log.info(
        "config",
        extra={
            "fields": {
                "config": str(options.config_path),
                "flags": sorted(options.cli_overrides - {"config_path"}),
            }
        },
    )
    if options.recover_from_runtime and "recover_from_runtime" not in options.cli_overrides:
        log.warning(
            "recoverFromRuntime is on in the config file: this start rebuilds the state from"
            " the runtime, and so will every later one until it is set back to false",
            extra={"fields": {"config": str(options.config_path)}},
        )


if __name__ == "__main__":
    sys.exit(main())
