"""``cpushim status`` and ``cpushim topology``: read sysfs and the checkpoint, print what
``shim.status`` renders. Read-only: neither changes a file, so both are safe on a live node.
When cpushim's socket exists, ``status`` also asks it (ListContainers, as kubelet does) what
state each pinned container is in. With ``--config``, ``status`` finds the checkpoint and the
socket where ``cpushim run`` given the same file would put them (``stateDir``, ``listen``);
its own flags win.

``shim.cli`` adds the subcommands with ``add_commands`` and calls ``args.handler(args)``, which
returns the exit code: 0, or 1 with a one-line message on stderr when the topology or the
config file or the checkpoint cannot be read. ``status`` also says on stderr, after its page,
when there is no socket to ask; its JSON stays as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, TextIO

import orjson

from shim.checkpoint import CheckpointFile
from shim.config import ConfigError, ConfigValues, load_config
from shim.cpuset import CPUSet
from shim.cri import runtime_v1_pb2 as pb
from shim.cri.calls import Status, UnaryCall
from shim.cri.upstream import RuntimeChannel, unix_path
from shim.state import CheckpointError, CPUState
from shim.status import Live, render_status, render_topology, status_json, topology_json
from shim.topology import Topology, TopologyError

__all__ = [
    "add_commands",
    "offline_cpus",
    "status_command",
    "status_locations",
    "topology_command",
    "use_color",
]

DEFAULT_STATE_DIR: Final = Path("/var/lib/cpushim")
DEFAULT_SOCKET: Final = "unix:///run/cpushim/cri.sock"
LIVE_TIMEOUT: Final = 3.0
DEFAULT_SYSFS_ROOT: Final = Path("/sys")
COLOR_CHOICES: Final = ("auto", "always", "never")


class _Failure(Exception):
    """What the command prints before it exits 1."""


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``status`` and ``topology`` to ``cpushim``'s subcommands; each sets ``handler``."""
    status = subparsers.add_parser(
        "status",
        help="draw the CPU map from the checkpoint: who holds which CPU",
        description="Draw every CPU where it sits (sockets, NUMA nodes, cores, threads) with"
        " its owner: a pinned container, the shared pool, reserved, isolated. Reads the"
        " checkpoint and sysfs, and asks cpushim's socket for the containers' states when"
        " it exists.",
    )
    status.add_argument(
        "--config",
        dest="config_path",
        type=Path,
        metavar="PATH",
        help="cpushim run's TOML config file: its listen and stateDir keys are the defaults"
        " of --socket and --state-dir (default: none, as for cpushim run)",
    )
    # --socket and --state-dir default to None, so that a flag given can be told from the
    # config file's key that it overrides.
    status.add_argument(
        "--socket",
        metavar="ADDRESS",
        help=f"cpushim's socket, asked for the containers' states when it exists"
        f" (default: the config file's listen, else {DEFAULT_SOCKET}; '' not to ask)",
    )
    status.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=f"where cpushim keeps state.json (default: the config file's stateDir, else"
        f" {DEFAULT_STATE_DIR})",
    )
    _add_common(status)
    status.set_defaults(handler=status_command)

    topology = subparsers.add_parser(
        "topology",
        help="draw the CPU topology cpushim discovers",
        description="Draw the sockets, NUMA nodes, cores and threads read from sysfs, with"
        " isolated and offline CPUs.",
    )
    _add_common(topology)
    topology.set_defaults(handler=topology_command)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sysfs-root",
        type=Path,
        default=DEFAULT_SYSFS_ROOT,
        metavar="DIR",
        help=f"where to read the CPU topology from (default {DEFAULT_SYSFS_ROOT})",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON for scripts instead of the map"
    )
    parser.add_argument(
        "--color",
        choices=COLOR_CHOICES,
        default="auto",
        help="colour the map: auto (default) = when stdout is a terminal, TERM is set and not"
        " dumb, and NO_COLOR is not set",
    )


# -- the adapters ------------------------------------------------------------------------------


def use_color(choice: str, stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether to colour: ``always``, ``never``, or ``auto``. Auto follows no-color.org (a
    non-empty NO_COLOR turns colour off) and wants a terminal whose TERM is set and not
    ``dumb``: an unset TERM is a cron job or a service, not a person."""
    if choice != "auto":
        return choice == "always"
    if environ.get("NO_COLOR"):
        return False
    if environ.get("TERM", "dumb") == "dumb":
        return False
    return stream.isatty()


def offline_cpus(sysfs_root: Path, topology: Topology) -> CPUSet:
    """CPUs present in the machine but not in ``topology``: taken offline, or online without
    a topology directory. Not the kernel's ``offline`` file: it also lists every possible
    CPU that is not present (a VM may show 4-255 there), which is noise to an operator."""
    try:
        present = CPUSet.parse((sysfs_root / "devices/system/cpu/present").read_text("ascii"))
    except (OSError, UnicodeDecodeError, ValueError):
        return CPUSet()
    return present - topology.online


def status_locations(args: argparse.Namespace) -> tuple[Path, str]:
    """The state directory and the socket address ``status`` reads: the flags given, over
    the config file's stateDir and listen, over cpushim run's defaults. ConfigError when
    the config file is missing or bad."""
    # Read and checked whole, as cpushim run reads it: a file that run would refuse says
    # nothing trustworthy about where run keeps its state.
    values: ConfigValues = {} if args.config_path is None else load_config(args.config_path)
    state_dir = args.state_dir
    if state_dir is None:
        from_file = values.get("state_dir")
        state_dir = from_file if isinstance(from_file, Path) else DEFAULT_STATE_DIR
    address = args.socket
    if address is None:
        from_file = values.get("listen")
        address = from_file if isinstance(from_file, str) else DEFAULT_SOCKET
    return state_dir, address


def _topology(sysfs_root: Path) -> Topology:
    try:
        return Topology.from_sysfs(sysfs_root)
    except TopologyError as exc:
        raise _Failure(f"cannot read the CPU topology: {exc}") from exc


def _state(state_dir: Path) -> CPUState:
    checkpoint = CheckpointFile(state_dir)
    try:
        try:
            state = checkpoint.load()
        except CheckpointError:
            # cpushim may have written twice during the read: the file read was the spare
            # that its second write overwrites in place. A damaged file fails again.
            state = checkpoint.load()
    except CheckpointError as exc:
        raise _Failure(f"cannot use the checkpoint: {exc}") from exc
    if state is None:
        raise _Failure(
            f"no checkpoint at {checkpoint.path}: cpushim has not saved its state there"
            " (--state-dir, or --config with its config file, if it runs with another)"
        )
    return state


def live_view(address: str) -> Live | None:
    """The containers' states from cpushim's socket; None when there is no socket to ask."""
    if not address:
        return None
    try:
        path = unix_path(address)
    except ValueError as exc:
        raise _Failure(f"--socket: {exc}") from exc
    if not os.path.exists(path):
        return None
    try:
        containers = asyncio.run(_list_containers(address))
    except (OSError, RuntimeError) as exc:
        return Live(address, error=" ".join(str(exc).split()))
    return Live(address, containers=containers)


async def _list_containers(address: str) -> dict[str, str]:
    channel = RuntimeChannel(address)
    try:
        request = pb.ListContainersRequest().SerializeToString()
        reply = await channel.unary(UnaryCall(LIST_CONTAINERS, (), request, LIVE_TIMEOUT))
    finally:
        channel.close()
    if reply.status is not Status.OK or not reply.messages:
        raise RuntimeError(f"ListContainers: {reply.status.name}: {reply.status_message}")
    listing = pb.ListContainersResponse.FromString(reply.messages[0])
    return {c.id: _STATES.get(c.state, "unknown") for c in listing.containers}


_STATES: Final = {
    pb.CONTAINER_CREATED: "created",
    pb.CONTAINER_RUNNING: "running",
    pb.CONTAINER_EXITED: "exited",
}
LIST_CONTAINERS: Final = "/runtime.v1.RuntimeService/ListContainers"


def _width() -> int:
    # COLUMNS first, then the terminal, then 80 (also when stdout is a pipe).
    return shutil.get_terminal_size().columns


def _json(document: Mapping[str, Any]) -> str:
    return orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n"


def _emit(text: str) -> int:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`cpushim status | head`). Point stdout at /dev/null so the
        # interpreter's flush at exit does not raise again, as the Python docs advise.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0


def _run(command: str, produce: Callable[[], str]) -> int:
    try:
        text = produce()
    except _Failure as exc:
        message = " ".join(str(exc).split())  # one line, whatever the cause said
        print(f"cpushim {command}: {message}", file=sys.stderr)
        return 1
    return _emit(text)


# -- the commands ------------------------------------------------------------------------------


def status_command(args: argparse.Namespace) -> int:
    notes: list[str] = []

    def produce() -> str:
        try:
            state_dir, address = status_locations(args)
        except ConfigError as exc:
            raise _Failure(str(exc)) from exc
        topology = _topology(args.sysfs_root)
        state = _state(state_dir)
        offline = offline_cpus(args.sysfs_root, topology)
        live = live_view(address)
        if args.json:
            # The JSON has no key for a socket never asked: "runtime" is left out, as ever.
            return _json(status_json(topology, state, offline=offline, live=live))
        if live is None and address:
            # cpushim removes its socket when it stops: without this the page would not
            # tell that the containers' states are missing, nor why.
            notes.append(
                f"no socket at {unix_path(address)}: cpushim is not running, or it listens"
                " elsewhere (--socket, or --config with its config file); the page shows"
                " the checkpoint without the containers' states"
            )
        color = use_color(args.color, sys.stdout, os.environ)
        return render_status(
            topology, state, offline=offline, color=color, width=_width(), live=live
        )

    code = _run("status", produce)
    for note in notes:
        print(f"cpushim status: {note}", file=sys.stderr)
    return code


def topology_command(args: argparse.Namespace) -> int:
    def produce() -> str:
        topology = _topology(args.sysfs_root)
        offline = offline_cpus(args.sysfs_root, topology)
        if args.json:
            return _json(topology_json(topology, offline=offline))
        color = use_color(args.color, sys.stdout, os.environ)
        return render_topology(topology, offline=offline, color=color, width=_width())

    return _run("topology", produce)
