"""gRPC message framing: compressed messages are inflated, within a bound; grpc-timeout
values."""

from __future__ import annotations

import gzip
import struct
import zlib

import pytest

from shim.cri.calls import (
    MAX_INFLATED,
    MessageError,
    Status,
    format_timeout,
    parse_timeout,
    unframe_messages,
)


def framed(payload: bytes, *, compressed: bool) -> bytes:
    return struct.pack(">BI", int(compressed), len(payload)) + payload


def test_gzip_and_deflate_messages_are_inflated() -> None:
    body = framed(gzip.compress(b"first"), compressed=True) + framed(b"plain", compressed=False)
    assert unframe_messages(body, b"gzip") == [b"first", b"plain"]
    assert unframe_messages(framed(zlib.compress(b"x" * 1000), compressed=True), b"deflate") == [
        b"x" * 1000
    ]


def test_a_message_that_inflates_past_the_bound_is_refused() -> None:
    # About 16 KiB of gzip that would become 16 MiB and one byte.
    bomb = gzip.compress(b"\0" * (MAX_INFLATED + 1), compresslevel=9)
    assert len(bomb) < MAX_INFLATED // 100
    with pytest.raises(MessageError) as refused:
        unframe_messages(framed(bomb, compressed=True), b"gzip")
    assert refused.value.status is Status.RESOURCE_EXHAUSTED
    # Exactly the bound still passes.
    exact = gzip.compress(b"\0" * MAX_INFLATED, compresslevel=9)
    (message,) = unframe_messages(framed(exact, compressed=True), b"gzip")
    assert len(message) == MAX_INFLATED


@pytest.mark.parametrize(
    ("payload", "encoding", "status"),
    [
        (gzip.compress(b"whole")[:-6], b"gzip", Status.INTERNAL),  # cut short
        (b"not gzip at all", b"gzip", Status.INTERNAL),
        (gzip.compress(b"x"), b"snappy", Status.UNIMPLEMENTED),
    ],
    ids=["truncated", "garbage", "unknown-encoding"],
)
def test_a_compressed_message_that_cannot_be_read_is_a_clear_error(
    payload: bytes, encoding: bytes, status: Status
) -> None:
    with pytest.raises(MessageError) as refused:
        unframe_messages(framed(payload, compressed=True), encoding)
    assert refused.value.status is status


@pytest.mark.parametrize(
    "seconds", [1e-6, 0.25, 99.9, 100.0, 99_999.0, 100_000.0, 6_000_000.0, 365 * 86_400.0]
)
def test_a_timeout_is_written_in_at_most_eight_digits_and_never_shorter(seconds: float) -> None:
    # gRPC over HTTP/2 allows eight digits before the unit; grpc-go refuses a longer value
    # (the call fails INTERNAL, "malformed grpc-timeout"). From about 28 hours on, the
    # relay's own channel once wrote nine digits of milliseconds.
    raw = format_timeout(seconds)
    assert len(raw) <= 9
    parsed = parse_timeout(raw)
    assert parsed is not None
    assert parsed >= seconds * (1 - 1e-9)
