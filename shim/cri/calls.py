"""Unary gRPC calls that the relay intercepts: the call, the reply and their wire framing.

A handler gets an intercepted call as a :class:`UnaryCall` and either forwards it (amended on
its own stream, or over the relay's own channel) or answers it with a :class:`Reply` that the
relay writes back to the client.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass, field, replace
from urllib.parse import quote, unquote

from shim.cri.hpack_blocks import Header, header_value

_PREFIX = struct.Struct(">BI")
# The most a compressed message may inflate to: kubelet's CRI client takes messages up to
# 16 MiB, and a few bytes of gzip must not make the relay hold gigabytes.
MAX_INFLATED = 16 * 1024 * 1024
_HOP_HEADERS = frozenset(
    {b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)
GRPC_CONTENT_TYPE = b"application/grpc"
# Characters grpc-message may carry unescaped (gRPC over HTTP/2: printable ASCII but '%').
_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)


class Status(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class MessageError(Exception):
    """A gRPC message body that cannot be unframed; carries the status to answer with."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


def encode_grpc_message(text: str) -> bytes:
    return quote(text, safe=_GRPC_MESSAGE_SAFE).encode("ascii")


def decode_grpc_message(raw: bytes) -> str:
    return unquote(raw.decode("ascii", "replace"))


def frame_message(message: bytes) -> bytes:
    """A message with its 5-byte gRPC length prefix (uncompressed)."""
    return _PREFIX.pack(0, len(message)) + message


def unframe_messages(body: bytes, encoding: bytes | None) -> list[bytes]:
    """The messages in a gRPC body; compressed ones are inflated (gzip or deflate)."""
    messages, pos = [], 0
    while pos < len(body):
        if len(body) - pos < 5:
            raise MessageError(Status.INTERNAL, "truncated gRPC message prefix")
        compressed, length = _PREFIX.unpack_from(body, pos)
        pos += 5
        if len(body) - pos < length:
            raise MessageError(
                Status.INTERNAL,
                f"gRPC message announces {length} bytes but {len(body) - pos} arrived",
            )
        payload = body[pos : pos + length]
        pos += length
        if compressed:
            payload = _inflate(payload, encoding)
        messages.append(payload)
    return messages


def _inflate(payload: bytes, encoding: bytes | None) -> bytes:
    if encoding == b"gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == b"deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise MessageError(
            Status.UNIMPLEMENTED, f"compressed message with unsupported grpc-encoding {encoding!r}"
        )
    inflater = zlib.decompressobj(wbits)
    try:
        message = inflater.decompress(payload, MAX_INFLATED)
        if inflater.unconsumed_tail:
            raise MessageError(
                Status.RESOURCE_EXHAUSTED,
                f"{encoding!r} message inflates to more than {MAX_INFLATED} bytes",
            )
        message += inflater.flush()
    except zlib.error as exc:
        raise MessageError(Status.INTERNAL, f"cannot inflate {encoding!r} message: {exc}") from exc
    if not inflater.eof:
        raise MessageError(Status.INTERNAL, f"cannot inflate {encoding!r} message: it is cut short")
    return message


@dataclass(frozen=True)
class UnaryCall:
    """An intercepted call as the client sent it."""

    path: str
    headers: tuple[Header, ...]
    request: bytes
    timeout: float | None  # seconds left when the call arrived (from grpc-timeout)

    @property
    def metadata(self) -> tuple[Header, ...]:
        """Request headers other than HTTP/2 pseudo-headers and per-hop gRPC ones (the relay
        sets those itself when it forwards the call)."""
        return tuple(
            (k, v) for k, v in self.headers if not k.startswith(b":") and k not in _HOP_HEADERS
        )


@dataclass(frozen=True)
class Reply:
    """What the client gets back: ``headers`` None means a trailers-only response."""

    trailers: tuple[Header, ...]
    headers: tuple[Header, ...] | None = None
    messages: tuple[bytes, ...] = field(default_factory=tuple)
    # Made by the relay for a request that went to the runtime and got no answer back (a
    # lost connection, a reset stream, a wait past its deadline): the runtime may or may not
    # have acted on it.
    unanswered: bool = False

    @classmethod
    def ok(cls, message: bytes) -> Reply:
        return cls(
            headers=((b":status", b"200"), (b"content-type", GRPC_CONTENT_TYPE)),
            messages=(message,),
            trailers=((b"grpc-status", b"0"),),
        )

    @classmethod
    def error(cls, status: Status, message: str) -> Reply:
        return cls(
            trailers=(
                (b":status", b"200"),
                (b"content-type", GRPC_CONTENT_TYPE),
                (b"grpc-status", str(int(status)).encode()),
                (b"grpc-message", encode_grpc_message(message)),
            )
        )

    @classmethod
    def no_answer(cls, status: Status, message: str) -> Reply:
        """What stands for the runtime's reply to a request it was sent but never answered."""
        return replace(cls.error(status, message), unanswered=True)

    @property
    def status(self) -> Status:
        raw = header_value(self.trailers, b"grpc-status")
        try:
            return Status(int(raw)) if raw is not None else Status.UNKNOWN
        except ValueError:
            return Status.UNKNOWN

    @property
    def status_message(self) -> str:
        raw = header_value(self.trailers, b"grpc-message")
        return decode_grpc_message(raw) if raw is not None else ""


def parse_timeout(raw: bytes | None) -> float | None:
    """Seconds from a grpc-timeout value such as ``b"9999815u"``."""
    if not raw or len(raw) < 2:
        return None
    units = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
    unit = units.get(raw[-1:])
    if unit is None or not raw[:-1].isdigit():
        return None
    return int(raw[:-1]) * unit


# Microseconds in each grpc-timeout unit, finest first.
_TIMEOUT_UNITS = ((b"u", 1), (b"m", 1_000), (b"S", 1_000_000), (b"M", 60_000_000))
_TIMEOUT_DIGITS = 99_999_999  # gRPC over HTTP/2 allows eight; grpc-go refuses a ninth


def format_timeout(seconds: float) -> bytes:
    """A grpc-timeout value in the finest unit that takes it in eight digits, rounded up
    in the coarser ones: a deadline cut to whole minutes would end the call early."""
    micros = max(1, int(seconds * 1_000_000))
    for unit, size in _TIMEOUT_UNITS:
        count = -(-micros // size)
        if count <= _TIMEOUT_DIGITS:
            return b"%d%s" % (count, unit)
    return b"%dH" % min(-(-micros // 3_600_000_000), _TIMEOUT_DIGITS)
