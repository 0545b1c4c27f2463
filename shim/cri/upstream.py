"""The relay's own channel to the runtime, for calls it answers itself and calls it makes itself.

Built on grpclib's connection and stream layer rather than its message API: a reply must reach
kubelet with the runtime's headers and trailers as they were (``grpc-status-details-bin``
included), which the message API would digest.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.protocol import H2Protocol
from grpclib.utils import Wrapper
from h2.errors import ErrorCodes

from shim.cri.calls import (
    GRPC_CONTENT_TYPE,
    MessageError,
    Reply,
    Status,
    UnaryCall,
    format_timeout,
    frame_message,
    unframe_messages,
)
from shim.cri.hpack_blocks import Header, header_value

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">BI")


def unix_path(endpoint: str) -> str:
    """The socket path of a ``unix://`` endpoint (a bare path is accepted too)."""
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://") :]
    elif "://" in endpoint:
        raise ValueError(f"unsupported endpoint {endpoint!r}: only unix:// sockets are served")
    else:
        path = endpoint
    if not path.startswith("/"):
        raise ValueError(f"endpoint {endpoint!r} must name an absolute socket path")
    return path


def connect_unix(path: str) -> socket.socket:
    """A non-blocking socket connected to ``path``. A Unix socket's connect never waits:
    when the listener's backlog is full it fails at once with EAGAIN, which asyncio's own
    connect (unlike uvloop's) takes for a connection in progress, handing back a socket that
    is not connected. So there is nothing for a timeout to bound either."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def backlog_hint(exc: OSError) -> str:
    """What to add to ``connect_unix``'s error: EAGAIN alone does not tell an operator that
    the runtime is stuck."""
    if exc.errno == errno.EAGAIN:
        return " (listen backlog full: the runtime accepts no connections)"
    return ""


class _UnixChannel(Channel):
    """grpclib's channel, its connections made by ``connect_unix`` so that a full backlog is
    an error on asyncio's loop too. grpclib (0.4.9) has no hook for the socket or the
    connect, so this overrides its private ``_create_connection``."""

    async def _create_connection(self) -> H2Protocol:
        assert self._path is not None
        _, protocol = await asyncio.get_running_loop().create_unix_connection(
            self._protocol_factory, sock=connect_unix(self._path)
        )
        return protocol


# Called with the runtime's reply the moment it arrives, before the handler that forwarded the
# call resumes; True when the handler's work on that reply is done, so the client may have all
# of it at once (see Forward).
ReplySeen = Callable[[Reply], bool]


class Forward(Protocol):
    """How an intercepted call goes on to the runtime, at most once; the handler may hand it
    a changed request. ``sent`` once it has gone (from then on the runtime may have acted on
    it), ``reply`` the runtime's answer once it is known.

    ``seen``, when given, runs as soon as the runtime's reply is in, inside the relay's own
    callback (it must not block), and at most once. When it returns True the client gets the
    end of the reply then, without waiting for the handler to return: work the handler would
    do on the reply before kubelet may see it goes there. A ``seen`` that raises is logged and
    counts as False."""

    sent: bool
    reply: Reply | None

    async def __call__(
        self, request: bytes | None = None, *, seen: ReplySeen | None = None
    ) -> Reply: ...


def reply_seen(seen: ReplySeen, reply: Reply, path: str) -> bool:
    """Run a Forward's ``seen`` hook: its answer, False when it failed."""
    try:
        return seen(reply)
    except Exception:
        log.exception("work on a reply failed", extra={"fields": {"path": path}})
        return False


class ForwardedTwiceError(RuntimeError):
    pass


class _NotConnectedError(Exception):
    """The runtime's socket could not be reached: the request never left."""


class ChannelForward:
    """A call answered here, forwarded on the relay's own channel to the runtime."""

    def __init__(self, runtime: RuntimeChannel, call: UnaryCall) -> None:
        self.runtime = runtime
        self.call = call
        self.sent = False
        self.reply: Reply | None = None

    async def __call__(
        self, request: bytes | None = None, *, seen: ReplySeen | None = None
    ) -> Reply:
        if self.sent:
            raise ForwardedTwiceError(f"{self.call.path} was already forwarded")
        self.sent = True
        self.reply = await self.runtime.unary(self.call, request)
        # The reply goes to the client when the handler returns whatever this says.
        if seen is not None:
            reply_seen(seen, self.reply, self.call.path)
        return self.reply


class RuntimeChannel:
    """One persistent HTTP/2 connection to the runtime, reconnected on demand."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._path = unix_path(endpoint)
        self._channel: Channel | None = None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    async def unary(self, call: UnaryCall, request: bytes | None = None) -> Reply:
        """Send ``call`` (with ``request`` in place of its message if given) and return the
        runtime's reply; transport failures become UNAVAILABLE or DEADLINE_EXCEEDED replies."""
        body = call.request if request is None else request
        # Set once the whole request has gone to the socket: before that, the runtime
        # cannot have acted on it, whatever ends the call.
        written: list[bool] = []
        try:
            if call.timeout is None:
                return await self._exchange(call, body, written)
            async with asyncio.timeout(call.timeout):
                return await self._exchange(call, body, written)
        except _NotConnectedError as exc:
            # Nothing was sent: the runtime did not act on it.
            return Reply.error(
                Status.UNAVAILABLE, f"cpushim: runtime {self.endpoint} unavailable: {exc}"
            )
        except TimeoutError:
            return (Reply.no_answer if written else Reply.error)(
                Status.DEADLINE_EXCEEDED, f"cpushim: {call.path} exceeded its deadline"
            )
        except (OSError, StreamTerminatedError, ConnectionError) as exc:
            return (Reply.no_answer if written else Reply.error)(
                Status.UNAVAILABLE, f"cpushim: runtime {self.endpoint} unavailable: {exc}"
            )
        except GRPCError as exc:
            return Reply.error(Status(exc.status.value), exc.message or str(exc))
        except MessageError as exc:
            return Reply.no_answer(exc.status, f"cpushim: bad reply from the runtime: {exc}")

    async def _exchange(self, call: UnaryCall, body: bytes, written: list[bool]) -> Reply:
        if self._channel is None:
            # Made here, not in __init__: grpclib binds a channel to the loop it is made in.
            self._channel = _UnixChannel(path=self._path)
        try:
            protocol: H2Protocol = await self._channel.__connect__()
        except OSError as exc:
            raise _NotConnectedError(f"{exc}{backlog_hint(exc)}") from exc
        if protocol.processor.connection.is_closing():
            # Accepted and closed before a stream could be made (a runtime restarting):
            # grpclib has dropped its transport already, and the next call connects anew.
            raise _NotConnectedError("the runtime closed the connection at once")
        wrapper = Wrapper()
        stream = protocol.processor.connection.create_stream(wrapper=wrapper)
        release = None
        try:
            with wrapper:
                release = await stream.send_request(
                    self._request_headers(call), _processor=protocol.processor
                )
                await stream.send_data(frame_message(body), end_stream=True)
                written.append(True)
                headers = _as_bytes(await stream.recv_headers())
                if header_value(headers, b"grpc-status") is not None:
                    return Reply(trailers=headers)
                raw = bytearray()
                while True:
                    # grpclib's buffer hands out exact sizes: a prefix, then its message.
                    prefix = await stream.recv_data(5)
                    if not prefix:
                        break
                    if len(prefix) < 5:
                        raise MessageError(Status.INTERNAL, "truncated gRPC message prefix")
                    raw += prefix
                    raw += await stream.recv_data(_PREFIX.unpack(prefix)[1])
                trailers = _as_bytes(await stream.recv_trailers())
        except asyncio.CancelledError:
            if stream.id is not None and stream.closable:
                stream.reset_nowait(ErrorCodes.CANCEL)
            raise
        finally:
            if release is not None:
                release()
        messages = unframe_messages(bytes(raw), header_value(headers, b"grpc-encoding"))
        return Reply(headers=headers, messages=tuple(messages), trailers=trailers)

    def _request_headers(self, call: UnaryCall) -> list[tuple[str, str]]:
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", call.path),
            (":authority", "localhost"),
            ("te", "trailers"),
            ("content-type", GRPC_CONTENT_TYPE.decode()),
        ]
        if call.timeout is not None:
            headers.append(("grpc-timeout", format_timeout(call.timeout).decode()))
        for name, value in call.metadata:
            headers.append((name.decode("ascii", "replace"), value.decode("latin-1")))
        return headers


def _as_bytes(headers: Sequence[tuple[str | bytes, str | bytes]]) -> tuple[Header, ...]:
    out = []
    for name, value in headers:
        n = name.encode("latin-1") if isinstance(name, str) else bytes(name)
        v = value.encode("latin-1") if isinstance(value, str) else bytes(value)
        out.append((n, v))
    return tuple(out)
