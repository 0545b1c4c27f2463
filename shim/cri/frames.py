"""HTTP/2 frame layout (RFC 9113 §4, §6): constants, header parsing and the few frames the
relay writes itself. No I/O."""

from __future__ import annotations

import struct
from typing import Final

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_LEN: Final = 9

DATA: Final = 0x0
HEADERS: Final = 0x1
PRIORITY: Final = 0x2
RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PUSH_PROMISE: Final = 0x5
PING: Final = 0x6
GOAWAY: Final = 0x7
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9

FLAG_END_STREAM: Final = 0x1
FLAG_ACK: Final = 0x1
FLAG_END_HEADERS: Final = 0x4
FLAG_PADDED: Final = 0x8
FLAG_PRIORITY: Final = 0x20

SETTINGS_HEADER_TABLE_SIZE: Final = 0x1
SETTINGS_INITIAL_WINDOW_SIZE: Final = 0x4
SETTINGS_MAX_FRAME_SIZE: Final = 0x5

DEFAULT_WINDOW: Final = 65_535
DEFAULT_MAX_FRAME: Final = 16_384
MAX_FRAME_SIZE: Final = 2**24 - 1
MAX_WINDOW: Final = 2**31 - 1

# Error codes (RFC 9113 §7).
NO_ERROR: Final = 0x0
PROTOCOL_ERROR: Final = 0x1
INTERNAL_ERROR: Final = 0x2
FLOW_CONTROL_ERROR: Final = 0x3
FRAME_SIZE_ERROR: Final = 0x6
REFUSED_STREAM: Final = 0x7
CANCEL: Final = 0x8
COMPRESSION_ERROR: Final = 0x9

_HEADER = struct.Struct(">BHBBI")
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")


class FrameError(Exception):
    """A peer broke HTTP/2 framing; the connection cannot continue."""

    def __init__(self, message: str, error_code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.error_code = error_code


def oversized_frame(length: int, limit: int, sender: str) -> FrameError:
    """A frame longer than its receiver's SETTINGS_MAX_FRAME_SIZE (RFC 9113 4.2)."""
    receiver = "runtime" if sender == "client" else "client"
    return FrameError(
        f"a {length}-byte frame, above the {receiver}'s SETTINGS_MAX_FRAME_SIZE of {limit}",
        FRAME_SIZE_ERROR,
    )


def parse_header(buf: bytes | bytearray, pos: int) -> tuple[int, int, int, int]:
    """(payload length, type, flags, stream id) of the frame header at ``buf[pos:pos+9]``."""
    hi, lo, ftype, flags, sid = _HEADER.unpack_from(buf, pos)
    return (hi << 16) | lo, ftype, flags, sid & 0x7FFF_FFFF


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 16, n & 0xFFFF, ftype, flags, stream_id) + payload


def header_block_fragment(flags: int, payload: bytes | bytearray | memoryview) -> bytes:
    """The HPACK fragment inside a HEADERS payload, without padding and priority fields."""
    start, end = 0, len(payload)
    if flags & FLAG_PADDED:
        if end < 1:
            raise FrameError("HEADERS frame too short for its padding length")
        end -= payload[0]
        start = 1
    if flags & FLAG_PRIORITY:
        start += 5
    if start > end:
        raise FrameError("HEADERS frame padding exceeds its payload")
    return bytes(payload[start:end])


def data_payload(flags: int, payload: bytes | bytearray | memoryview) -> bytes:
    """The application bytes of a DATA frame, without padding."""
    if not flags & FLAG_PADDED:
        return bytes(payload)
    if not payload:
        raise FrameError("DATA frame too short for its padding length")
    pad = payload[0]
    if pad >= len(payload):
        raise FrameError("DATA frame padding exceeds its payload")
    return bytes(payload[1 : len(payload) - pad])


def parse_settings(payload: bytes | bytearray | memoryview) -> list[tuple[int, int]]:
    """The (key, value) pairs of a SETTINGS payload; FrameError for a value out of its range
    (RFC 9113 6.5.2) among those the relay acts on itself: a MAX_FRAME_SIZE of 0 would have
    every frame it writes cut into empty pieces for ever."""
    if len(payload) % 6:
        raise FrameError("SETTINGS payload is not a multiple of 6", FRAME_SIZE_ERROR)
    settings = [_SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]
    for key, value in settings:
        if key == SETTINGS_MAX_FRAME_SIZE and not DEFAULT_MAX_FRAME <= value <= MAX_FRAME_SIZE:
            raise FrameError(
                f"SETTINGS_MAX_FRAME_SIZE of {value}, outside {DEFAULT_MAX_FRAME}..{MAX_FRAME_SIZE}"
            )
        if key == SETTINGS_INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise FrameError(
                f"SETTINGS_INITIAL_WINDOW_SIZE of {value}, above {MAX_WINDOW}", FLOW_CONTROL_ERROR
            )
    return settings


def settings_frame(settings: list[tuple[int, int]]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in settings))


def with_setting(settings: list[tuple[int, int]], key: int, value: int) -> list[tuple[int, int]]:
    """``settings`` with ``key`` forced to ``value`` (replacing every occurrence)."""
    return [(k, v) for k, v in settings if k != key] + [(key, value)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def window_increment(payload: bytes | bytearray | memoryview) -> int:
    if len(payload) != 4:
        raise FrameError("WINDOW_UPDATE payload must be 4 bytes", FRAME_SIZE_ERROR)
    return int(_U32.unpack_from(payload, 0)[0]) & 0x7FFF_FFFF


def rst_stream(stream_id: int, error_code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(error_code))


def goaway(last_stream_id: int, error_code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _U32.pack(last_stream_id) + _U32.pack(error_code) + debug)


def goaway_last_stream(payload: bytes | bytearray | memoryview) -> int:
    """The last-stream-id of a GOAWAY payload (8 bytes or more; the reserved bit dropped)."""
    return int(_U32.unpack_from(payload, 0)[0]) & 0x7FFF_FFFF


def ping_ack(payload: bytes) -> bytes:
    return frame(PING, FLAG_ACK, 0, payload)


def header_frames(stream_id: int, block: bytes, max_frame: int, *, end_stream: bool) -> list[bytes]:
    """A header block as one HEADERS frame plus CONTINUATION frames when it is large."""
    first, rest = block[:max_frame], block[max_frame:]
    flags = FLAG_END_STREAM if end_stream else 0
    if not rest:
        return [frame(HEADERS, flags | FLAG_END_HEADERS, stream_id, first)]
    out = [frame(HEADERS, flags, stream_id, first)]
    while rest:
        chunk, rest = rest[:max_frame], rest[max_frame:]
        out.append(frame(CONTINUATION, 0 if rest else FLAG_END_HEADERS, stream_id, chunk))
    return out
