"""systemd's service notification protocol (``sd_notify(3)``), with no dependency.

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET``: the path of a Unix datagram socket, or
``@name`` for a socket in the abstract namespace. A notification is one datagram of
newline-separated ``KEY=value`` assignments, such as ``READY=1`` or ``STATUS=serving``.

Nothing here raises on a failed send: a service must not stop because its supervisor could
not be told something. Every function returns whether the datagram was sent, and a failure
is logged as a warning. Without ``$NOTIFY_SOCKET`` (not started by systemd, or not with
``Type=notify``) nothing is sent and nothing is logged.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Final

__all__ = [
    "NOTIFY_SOCKET",
    "extend_timeout",
    "notify",
    "ready",
    "status",
    "stopping",
    "watchdog",
    "watchdog_interval",
]

log = logging.getLogger(__name__)

NOTIFY_SOCKET: Final = "NOTIFY_SOCKET"


def notify(message: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send ``message`` (``KEY=value`` lines) to ``$NOTIFY_SOCKET`` in ``environ``.

    True when the datagram was sent; False when the variable is unset or empty, or when the
    send failed (logged as a warning, never raised).
    """
    target = environ.get(NOTIFY_SOCKET, "")
    if not target:
        return False
    address: str | bytes
    if target.startswith("@"):
        # The abstract namespace: a leading NUL byte instead of the '@'.
        address = b"\0" + os.fsencode(target[1:])
    elif target.startswith("/"):
        address = target
    else:
        # systemd 253 added vsock:CID:PORT for virtual machines; a node's service has no use
        # for it.
        log.warning(
            "cannot notify systemd: unsupported NOTIFY_SOCKET address",
            extra={"fields": {"notify_socket": target, "message": message}},
        )
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), address)
    except OSError as exc:
        log.warning(
            "cannot notify systemd",
            extra={"fields": {"notify_socket": target, "message": message, "error": str(exc)}},
        )
        return False
    return True


def _one_line(text: str) -> str:
    # A value ends at the newline: one inside STATUS= would start another assignment.
    return " ".join(text.splitlines())


def ready(status_text: str | None = None, environ: Mapping[str, str] = os.environ) -> bool:
    """``READY=1``: start-up is done (systemd then starts the units ordered after this one),
    with ``STATUS=status_text`` when given."""
    message = "READY=1"
    if status_text is not None:
        message += f"\nSTATUS={_one_line(status_text)}"
    return notify(message, environ)


def stopping(status_text: str | None = None, environ: Mapping[str, str] = os.environ) -> bool:
    """``STOPPING=1``: the service is shutting down, with ``STATUS=status_text`` when given."""
    message = "STOPPING=1"
    if status_text is not None:
        message += f"\nSTATUS={_one_line(status_text)}"
    return notify(message, environ)


def status(text: str, environ: Mapping[str, str] = os.environ) -> bool:
    """``STATUS=text``: one line shown by ``systemctl status``."""
    return notify(f"STATUS={_one_line(text)}", environ)


def extend_timeout(
    seconds: float, status_text: str | None = None, environ: Mapping[str, str] = os.environ
) -> bool:
    """``EXTEND_TIMEOUT_USEC=``: systemd does not end what the service is doing (starting,
    under ``TimeoutStartSec=``) for lack of time before ``seconds`` from now. Past the unit's
    own timeout the service lives only as long as these keep coming, each within the time
    the one before gave (systemd 236 and later). With ``STATUS=status_text`` when given."""
    message = f"EXTEND_TIMEOUT_USEC={max(int(seconds * 1_000_000), 0)}"
    if status_text is not None:
        message += f"\nSTATUS={_one_line(status_text)}"
    return notify(message, environ)


def watchdog_interval(
    environ: Mapping[str, str] = os.environ, pid: int | None = None
) -> float | None:
    """Seconds between the ``WATCHDOG=1`` pings systemd's ``WatchdogSec=`` asks for: half
    its timeout (``$WATCHDOG_USEC``), as sd_watchdog_enabled(3) advises. None when it asks
    for none, or names another process (``$WATCHDOG_PID``: a child that inherited the
    environment is not the one watched)."""
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    return int(usec) / 1_000_000 / 2


def watchdog(environ: Mapping[str, str] = os.environ) -> bool:
    """``WATCHDOG=1``: the service is alive."""
    return notify("WATCHDOG=1", environ)
