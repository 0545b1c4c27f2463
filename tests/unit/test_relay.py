"""The relay against a fake runtime, driven by grpcio (an independent gRPC implementation, as
kubelet's grpc-go client is). Each behaviour is checked both on the splice's fast path and on
the path of calls the relay intercepts (the container lifecycle methods), both when it
terminates them and when it amends them."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.settings
import hpack
import pytest

from shim.cri import frames as fr
from shim.cri import server
from shim.cri.calls import frame_message
from shim.cri.methods import ALL_METHODS
from shim.cri.passthrough import LIFECYCLE_PATHS, PassthroughInterceptor
from shim.cri.server import RelayServer
from tests.fake_cri import DETAILS, FUTURE_STREAM, FUTURE_UNARY, script, short_tmpdir
from tests.harness.containerd import wait_for
from tests.harness.prerequisites import require
from tests.unit.relay_env import RUNTIME, LoopThread, RelayEnv, failure, relay_env, unary

SPLICED = RUNTIME + "Version"
TERMINATED = RUNTIME + "StartContainer"
BOTH_PATHS = pytest.mark.parametrize("path", [SPLICED, TERMINATED], ids=["spliced", "terminated"])


@pytest.fixture(scope="module", params=["terminated", "amended"])
def env(request: pytest.FixtureRequest) -> Iterator[RelayEnv]:
    """The lifecycle methods either answered on the relay's own channel, or held and sent on
    on the client's own stream (as the engine does)."""
    amend = request.param == "amended"
    with relay_env(PassthroughInterceptor(amend=amend)) as environment:
        yield environment


@pytest.fixture(scope="module")
def channel(env: RelayEnv) -> Iterator[grpc.Channel]:
    with env.channel() as ch:
        yield ch


@pytest.mark.parametrize(
    "method", [m for m in ALL_METHODS if not m.server_streaming], ids=lambda m: m.path
)
def test_every_unary_method_is_relayed(channel: grpc.Channel, method: object) -> None:
    path = method.path  # type: ignore[attr-defined]
    request = b"echo:" + path.encode()
    assert (
        unary(channel, path, request, timeout=10) == b"reply-to:" + path.encode() + b":" + request
    )


@pytest.mark.parametrize(
    "method", [m for m in ALL_METHODS if m.server_streaming], ids=lambda m: m.path
)
def test_every_streaming_method_is_relayed(channel: grpc.Channel, method: object) -> None:
    path = method.path  # type: ignore[attr-defined]
    events = list(channel.unary_stream(path)(script(b"stream:5"), timeout=10))
    assert events == [b"event-%d" % i for i in range(5)]


def test_lifecycle_methods_are_terminated_at_the_relay(env: RelayEnv) -> None:
    assert env.relay is not None
    for path in LIFECYCLE_PATHS:
        assert env.relay.interceptor.intercepts(path)
    assert not env.relay.interceptor.intercepts(RUNTIME + "ListContainers")


def test_long_server_stream_and_its_error_status(channel: grpc.Channel) -> None:
    stream = channel.unary_stream(RUNTIME + "GetContainerEvents")(
        script(b"stream:2000!"), timeout=20
    )
    received, error = drain(stream)
    assert received == [b"event-%d" % i for i in range(2000)]
    assert error is not None
    assert error.code() == grpc.StatusCode.ABORTED
    assert error.details() == "stream aborted"
    assert dict(error.trailing_metadata())["grpc-status-details-bin"] == DETAILS


def drain(stream: Iterator[bytes]) -> tuple[list[bytes], grpc.RpcError | None]:
    """Every message of a server stream, and the error that ended it, if any."""
    received = []
    try:
        for message in stream:
            received.append(message)
    except grpc.RpcError as exc:
        return received, exc
    return received, None


def test_unknown_methods_pass_both_unary_and_streaming(channel: grpc.Channel) -> None:
    assert unary(channel, FUTURE_UNARY, b"new", timeout=10) == (
        b"reply-to:" + FUTURE_UNARY.encode() + b":new"
    )
    assert list(channel.unary_stream(FUTURE_STREAM)(script(b"stream:3"), timeout=10)) == [
        b"event-0",
        b"event-1",
        b"event-2",
    ]
    missing = failure(channel, RUNTIME + "NoSuchCallAnywhere", b"", timeout=10)
    assert missing.code() == grpc.StatusCode.UNIMPLEMENTED


@BOTH_PATHS
@pytest.mark.parametrize(
    "code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK], ids=lambda c: c.name
)
def test_error_codes_messages_and_details_pass_unchanged(
    env: RelayEnv, channel: grpc.Channel, path: str, code: grpc.StatusCode
) -> None:
    number = code.value[0]
    request = b"error:%d:it failed: 100%% \xc3\xa9" % number
    with env.channel(env.direct_target) as direct:
        expected = failure(direct, path, request, timeout=10)
    got = failure(channel, path, request, timeout=10)
    assert (
        (got.code(), got.details())
        == (expected.code(), expected.details())
        == (
            code,
            "it failed: 100% é",
        )
    )
    assert dict(got.trailing_metadata())["grpc-status-details-bin"] == DETAILS


@BOTH_PATHS
def test_metadata_passes_both_ways(env: RelayEnv, channel: grpc.Channel, path: str) -> None:
    call = channel.unary_unary(path)
    reply, outcome = call.with_call(
        script(b"meta"), metadata=[("x-request-id", "abc-123"), ("x-tenant", "t1")], timeout=10
    )
    assert reply == b"meta-reply"
    assert ("x-request-id", "abc-123") in outcome.initial_metadata()
    trailing = dict(outcome.trailing_metadata())
    assert trailing["x-trailer"] == "t1"
    assert trailing["x-tenant"] == "t1"
    _, _, seen = env.fake.runtime.calls[-1]
    assert seen["x-request-id"] == "abc-123"


@BOTH_PATHS
def test_deadline_is_propagated_and_enforced(
    env: RelayEnv, channel: grpc.Channel, path: str
) -> None:
    marker = b"echo:deadline:" + path.encode()
    started = time.monotonic()
    unary(channel, path, marker, timeout=7)
    took = time.monotonic() - started
    remaining = env.fake.runtime.deadlines[marker]
    # The client's 7 s less at most the time the whole call took; grpc-timeout is rounded
    # up to its unit by the client: allow a few milliseconds.
    assert remaining is not None
    assert 7 - took - 0.05 <= remaining <= 7.05

    # The runtime holds the call until after the client's deadline has ended it.
    held = b"deadline:" + path.encode()
    late = failure(channel, path, b"hold:" + held, timeout=1)
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    env.fake.runtime.wait_held(held)  # it reached the runtime, which never answered it
    env.fake.runtime.release(held)


def test_large_reply_passes(channel: grpc.Channel) -> None:
    size = 16 * 1024 * 1024
    reply = unary(channel, RUNTIME + "ListContainerStats", b"big:%d" % size, timeout=30)
    assert len(reply) == size
    assert reply == b"x" * size


def test_large_terminated_request_passes_intact(env: RelayEnv, channel: grpc.Channel) -> None:
    # Bigger than every HTTP/2 window: the relay must hand back flow-control credit itself.
    request = b"echo:" + os.urandom(3 * 1024 * 1024)
    assert unary(channel, RUNTIME + "CreateContainer", request, timeout=30) == (
        b"reply-to:" + (RUNTIME + "CreateContainer").encode() + b":" + request
    )
    assert env.fake.runtime.wire[-1] == (RUNTIME + "CreateContainer", script(request))


@BOTH_PATHS
def test_unknown_fields_reach_the_runtime_byte_for_byte(
    env: RelayEnv, channel: grpc.Channel, path: str
) -> None:
    # Field 999 is in no CRI message; a known field (1) rides along on the terminated path.
    request = b"\x0a\x03abc" + script(b"echo:unknown-field") + b"\xf8\x3e\x07"
    channel.unary_unary(path)(request, timeout=10)
    assert env.fake.runtime.wire[-1] == (path, request)


def test_large_terminated_reply_then_spliced_traffic(channel: grpc.Channel) -> None:
    # A reply the relay writes itself uses the client's window behind the runtime's back;
    # spliced traffic after it must still respect the client's real window.
    big = unary(channel, RUNTIME + "UpdateContainerResources", b"big:%d" % (5 << 20), timeout=30)
    assert len(big) == 5 << 20
    for _ in range(3):
        assert len(
            unary(channel, RUNTIME + "ListContainers", b"big:%d" % (3 << 20), timeout=30)
        ) == (3 << 20)


def test_concurrent_mixed_calls(channel: grpc.Channel) -> None:
    errors: list[str] = []

    def worker(n: int) -> None:
        for i in range(60):
            path = TERMINATED if i % 3 == 0 else SPLICED
            request = b"echo:%d:%d" % (n, i)
            try:
                got = unary(channel, path, request, timeout=20)
            except grpc.RpcError as exc:  # pragma: no cover - reported below
                errors.append(f"{path}: {exc.code()} {exc.details()}")
                continue
            if got != b"reply-to:" + path.encode() + b":" + request:
                errors.append(f"{path}: wrong reply {got[:60]!r}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


def test_client_encoder_drops_its_dynamic_table(env: RelayEnv, channel: grpc.Channel) -> None:
    # The relay relies on self-contained header blocks; grpcio must honour the setting.
    unary(channel, SPLICED, b"echo:1", timeout=10)
    unary(channel, SPLICED, b"echo:2", timeout=10)
    assert env.relay is not None
    readers = [conn.splice._reader.stateless for conn in env.relay.connections]
    assert readers
    assert all(readers)


# ---------------------------------------------------------------------------- bad input


def test_undecodable_request_is_invalid_argument_and_relay_keeps_serving(
    env: RelayEnv, channel: grpc.Channel
) -> None:
    path = RUNTIME + "CreateContainer"
    calls_before = len(env.fake.runtime.calls)
    try:
        channel.unary_unary(path)(b"\xff\xff\xff\xff", timeout=10)
        raise AssertionError("an undecodable request was accepted")
    except grpc.RpcError as exc:
        bad = exc
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "CreateContainerRequest" in bad.details()
    assert len(env.fake.runtime.calls) == calls_before  # nothing reached the runtime
    assert unary(channel, SPLICED, b"echo:after", timeout=10).endswith(b"echo:after")


def test_garbage_on_the_socket_closes_only_that_connection(
    env: RelayEnv, channel: grpc.Channel
) -> None:
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(env.relay_socket))
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 64)
        raw.settimeout(10)
        reply = b""
        while chunk := raw.recv(4096):
            reply += chunk
    assert b"preface" in reply  # GOAWAY debug data says why, then the socket closes
    assert unary(channel, SPLICED, b"echo:still", timeout=10).endswith(b"echo:still")


def test_bad_frame_sequence_closes_only_that_connection(
    env: RelayEnv, channel: grpc.Channel
) -> None:
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(env.relay_socket))
        # A CONTINUATION frame with no header block open.
        raw.sendall(fr.PREFACE + fr.settings_frame([]) + fr.frame(fr.CONTINUATION, 4, 1, b"\x82"))
        raw.settimeout(10)
        reply = b""
        while chunk := raw.recv(4096):
            reply += chunk
    assert b"CONTINUATION" in reply
    assert unary(channel, SPLICED, b"echo:ok", timeout=10).endswith(b"echo:ok")


# ---------------------------------------------------------------------------- runtime outage


def _spawn_runtime(socket_path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_cri", str(socket_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "serving"
    return proc


def attempt(channel: grpc.Channel, path: str, command: bytes) -> bytes | grpc.RpcError:
    try:
        return unary(channel, path, command, timeout=5)
    except grpc.RpcError as exc:
        return exc


@contextlib.contextmanager
def raw_client(env: RelayEnv) -> Iterator[tuple[socket.socket, h2.connection.H2Connection]]:
    """A plain socket to the relay and an h2 client whose preface is ready to send, for tests
    that read or hold back the frames themselves."""
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(env.relay_socket))
        raw.settimeout(10)
        client.initiate_connection()
        yield raw, client


def send_list_containers(
    raw: socket.socket, client: h2.connection.H2Connection, command: bytes, path: str = ""
) -> int:
    """A ListContainers call (or one to ``path``) scripting the fake runtime with
    ``command``, sent with whatever the client has queued before it; returns its stream id."""
    stream = client.get_next_available_stream_id()
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", (path or RUNTIME + "ListContainers").encode()),
        (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]
    client.send_headers(stream, headers)
    client.send_data(stream, frame_message(script(command)), end_stream=True)
    raw.sendall(client.data_to_send())
    return stream


def ask_and_read_nothing(
    relay: RelayServer, raw: socket.socket, client: h2.connection.H2Connection
) -> None:
    """Give the relay credit for a 16 MB reply, ask for one and read none of it; returns once
    the relay holds writes queued for the client."""
    window = 2**31 - 1
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    client.increment_flow_control_window(window - 65_535)
    send_list_containers(raw, client, b"big:16000000")

    def queued() -> int:
        return sum(
            conn.client.get_write_buffer_size()
            for conn in relay.connections
            if conn.client is not None
        )

    wait_for(lambda: queued() > 0, 10, "writes queued in the relay")


def frame_kinds(received: bytes) -> list[int]:
    """The types of the frames whose header is in ``received``."""
    kinds, pos = [], 0
    while pos + 9 <= len(received):
        length, kind, _, _ = fr.parse_header(received, pos)
        kinds.append(kind)
        pos += 9 + length
    return kinds


def lose_the_runtime(env: RelayEnv) -> None:
    """End the one client connection's runtime connection, as a crashed containerd would."""
    assert env.relay is not None
    (connection,) = env.relay.connections
    upstream = connection.upstream
    assert upstream is not None
    env.loop.loop.call_soon_threadsafe(upstream.abort)


def test_a_client_still_writing_after_its_last_reply_at_shutdown_is_not_cut_off() -> None:
    """The relay shuts down with a call in flight: the call's reply comes, then the end of
    the connection, and what the client writes after it (here a WINDOW_UPDATE for the reply
    it read) still lands. A socket closed outright there fails the client's write with EPIPE,
    and grpcio then fails a call whose whole reply it holds."""
    with relay_env() as env:
        relay = env.relay
        assert relay is not None
        with raw_client(env) as (raw, client):
            stream = send_list_containers(raw, client, b"hold:shutdown")
            env.fake.runtime.wait_held(b"shutdown")
            closing = asyncio.run_coroutine_threadsafe(relay.shutdown(10.0), env.loop.loop)
            received = b""
            while fr.GOAWAY not in frame_kinds(received):
                chunk = raw.recv(65536)
                assert chunk, "the connection ended before the relay's GOAWAY"
                received += chunk
            # The runtime answers only once the client has been told to go away.
            env.fake.runtime.release(b"shutdown")
            while chunk := raw.recv(65536):  # until the relay's end of the connection
                received += chunk
            # h2 stops at GOAWAY, so the frames are read here: the reply ended with status 0.
            decoder, kinds, status = hpack.Decoder(), [], None
            pos = 0
            while pos < len(received):
                length, kind, flags, sid = fr.parse_header(received, pos)
                payload = received[pos + 9 : pos + 9 + length]
                kinds.append(kind)
                if kind == fr.HEADERS and sid == stream:
                    fields = dict(decoder.decode(payload, raw=True))
                    if flags & fr.FLAG_END_STREAM:
                        status = fields[b"grpc-status"]
                pos += 9 + length
            assert fr.GOAWAY in kinds
            assert status == b"0"
            # A write after it (credit for the reply) still lands.
            raw.sendall(fr.window_update(0, 4096))
        assert closing.result(10) is True


def test_a_watch_open_at_shutdown_does_not_hold_it_up() -> None:
    """kubelet's Evented PLEG keeps GetContainerEvents open for as long as it runs. It ends
    with the relay's GOAWAY, UNAVAILABLE, and the shutdown is over once the other calls are:
    it once waited out the whole grace period, with no runtime for kubelet meanwhile, and
    then cut the watch."""
    with relay_env() as env, env.channel() as ch:
        relay = env.relay
        assert relay is not None
        watch = ch.unary_stream(RUNTIME + "GetContainerEvents")(
            script(b"stream:1:hold:watch"), timeout=60
        )
        try:
            assert next(watch) == b"event-0"
            closing = asyncio.run_coroutine_threadsafe(relay.shutdown(5.0), env.loop.loop)
            received, error = drain(watch)
            assert received == []
            assert error is not None
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error.details() == "cpushim: shutting down"
            assert closing.result(10) is True  # everything finished within the grace
        finally:
            env.fake.runtime.release(b"watch")


def test_a_client_that_stops_reading_does_not_hold_up_shutdown() -> None:
    """A client that gives the relay a large window and then reads nothing leaves the
    relay's writes queued in the process. Once the grace period is over the connection is
    closed anyway, and shutdown returns: a close that waited for those writes would wait
    for ever (and from Python 3.12 the server's wait_closed with it)."""
    with relay_env() as env:
        relay = env.relay
        assert relay is not None
        with raw_client(env) as (raw, client):
            ask_and_read_nothing(relay, raw, client)
            finished = env.loop.run(relay.shutdown(0.2), timeout=10)
            assert finished is False  # the call was still in flight
            assert not relay.connections
            # The client sees its connection end when it reads, cut short: what was queued
            # for it, then the end (a blocking read that times out fails the test).
            with contextlib.suppress(ConnectionResetError):
                while raw.recv(1 << 20):
                    pass


def test_a_client_that_stops_reading_is_dropped_when_its_runtime_connection_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside shutdown too: the runtime's connection ends while replies wait for a client
    that reads nothing. Its connection is told to go away and, once the client has been
    given ``_LINGER`` and then ``_STALLED_CLIENT`` seconds, dropped with what it never read."""
    monkeypatch.setattr(server, "_STALLED_CLIENT", 0.3)
    with relay_env() as env:
        relay = env.relay
        assert relay is not None
        with raw_client(env) as (raw, client):
            ask_and_read_nothing(relay, raw, client)
            lose_the_runtime(env)
            wait_for(lambda: not relay.connections, 10, "the stalled client's connection dropped")
        with env.channel() as ch:  # the relay itself serves on
            assert unary(ch, SPLICED, b"echo:after", timeout=10).endswith(b"echo:after")


def test_replies_held_for_credit_when_the_runtime_is_lost_do_not_keep_a_silent_client(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A reply the relay wrote itself spent the client's window, so a spliced reply waits in
    the relay for credit the client never gives; then the runtime's connection ends. The
    client is told to go away at once, and let go ``_STALLED_CLIENT`` seconds on."""
    monkeypatch.setattr(server, "_STALLED_CLIENT", 0.3)
    caplog.set_level(logging.WARNING, logger="shim.cri.server")
    with relay_env() as env:
        relay = env.relay
        assert relay is not None
        with raw_client(env) as (raw, client):
            # Answered by the relay itself: 60,000 of the client's 65,535 bytes of window.
            send_list_containers(raw, client, b"big:60000", path=TERMINATED)

            def spent() -> bool:
                return any(conn.splice._client_window < 10_000 for conn in relay.connections)

            wait_for(spent, 10, "the relay's own reply written")
            send_list_containers(raw, client, b"big:20000")

            def held() -> bool:
                return any(conn.splice._held_for_client for conn in relay.connections)

            wait_for(held, 10, "a spliced reply held for the client's credit")
            lose_the_runtime(env)
            wait_for(lambda: not relay.connections, 10, "the silent client let go")
    assert "did not read the replies left when the runtime" in caplog.text


def test_a_reading_client_keeps_a_slow_call_answered_here_when_the_runtime_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a client that leaves replies waiting for its credit and sends nothing is let go;
    a call the relay still answers on its own channel, for a client that reads, finishes."""
    monkeypatch.setattr(server, "_STALLED_CLIENT", 0.3)
    with relay_env() as env, env.channel() as ch:
        relay = env.relay
        assert relay is not None
        assert unary(ch, SPLICED, b"echo:warm", timeout=10).endswith(b"echo:warm")
        result: list[bytes | grpc.RpcError] = []

        def call() -> None:
            try:
                result.append(unary(ch, TERMINATED, b"hold:slow", timeout=8))
            except grpc.RpcError as exc:
                result.append(exc)

        caller = threading.Thread(target=call)
        caller.start()

        def answering() -> bool:
            return any(conn.splice._local for conn in relay.connections)

        env.fake.runtime.wait_held(b"slow")
        assert answering()
        (connection,) = relay.connections
        lose_the_runtime(env)
        # The call is answered only after the relay has looked at the client once it was
        # given _STALLED_CLIENT seconds (and kept it: it gives another period).
        wait_for(lambda: connection._unread is not None, 10, "the silent client timer armed")
        first_look = connection._unread
        wait_for(lambda: connection._unread is not first_look, 10, "the client looked at")
        env.fake.runtime.release(b"slow")
        caller.join(10)
        (outcome,) = result
        assert not isinstance(outcome, grpc.RpcError), outcome


def test_a_client_that_stops_reading_is_dropped_when_its_connection_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection closed for a protocol error while replies wait for a client that reads
    nothing is dropped ``_STALLED_CLIENT`` seconds on, not held for as long as the client
    lives; the log says so, and does not call the close of its runtime connection a loss."""
    monkeypatch.setattr(server, "_STALLED_CLIENT", 0.3)
    caplog.set_level(logging.WARNING, logger="shim.cri.server")
    with relay_env() as env:
        relay = env.relay
        assert relay is not None
        with raw_client(env) as (raw, client):
            ask_and_read_nothing(relay, raw, client)
            # A CONTINUATION frame with no header block open fails the connection.
            raw.sendall(fr.frame(fr.CONTINUATION, 4, 99, b"\x82"))
            wait_for(lambda: not relay.connections, 10, "the failed connection dropped")
        with env.channel() as ch:
            assert unary(ch, SPLICED, b"echo:after", timeout=10).endswith(b"echo:after")
    assert "did not read its last replies" in caplog.text
    assert "runtime connection lost" not in caplog.text


def test_a_client_that_reads_nothing_cannot_make_the_relay_buffer_its_answers() -> None:
    """The relay answers some frames itself: PINGs and SETTINGS when the runtime cannot be
    reached, credit for a request it consumes. A client that sends those and reads nothing
    once had the answers queued in the relay without limit; reading from it now stops while
    its writes back up, as grpc-go's server does (an HTTP/2 "ping flood")."""
    import select

    loop = LoopThread()
    try:
        with short_tmpdir() as workdir:
            relay = RelayServer(
                listen=f"unix://{workdir}/cri.sock",
                runtime_endpoint=f"unix://{workdir}/absent.sock",  # no runtime
                interceptor=PassthroughInterceptor(),
            )
            loop.run(relay.start())
            with socket.socket(socket.AF_UNIX) as raw:
                raw.connect(f"{workdir}/cri.sock")
                raw.sendall(fr.PREFACE + fr.settings_frame([]))
                raw.setblocking(False)
                pings = fr.frame(fr.PING, 0, 0, b"\0" * 8) * 4096
                total, sent = 8 * 2**20, 0
                while sent < total:
                    try:
                        sent += raw.send(pings)
                    except BlockingIOError:
                        # The relay reads nothing more while the client reads nothing.
                        if not select.select([], [raw], [], 1.0)[1]:
                            break

                async def queued() -> int:
                    return sum(
                        c.client.get_write_buffer_size()
                        for c in relay.connections
                        if c.client is not None
                    )

                assert sent < total
                assert loop.run(queued()) < 2**20
            loop.run(relay.shutdown(0.2))
    finally:
        loop.stop()


def test_a_runtime_that_accepts_nothing_is_answered_unavailable_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stuck runtime whose listen backlog is full: a Unix socket's connect never waits, it
    fails at once (EAGAIN), and each call is answered UNAVAILABLE with the reason. asyncio's
    own connect took EAGAIN for a connection in progress and gave the relay a socket that was
    not connected: the client then got a bare GOAWAY, not even SETTINGS first."""
    caplog.set_level(logging.WARNING, logger="shim.cri.server")
    loop = LoopThread()
    try:
        with (
            short_tmpdir() as workdir,
            socket.socket(socket.AF_UNIX) as stuck,
            contextlib.ExitStack() as queued,
        ):
            stuck.bind(f"{workdir}/runtime.sock")
            stuck.listen(0)  # and never accepts
            for _ in range(64):
                waiting = queued.enter_context(socket.socket(socket.AF_UNIX))
                waiting.setblocking(False)
                try:
                    waiting.connect(f"{workdir}/runtime.sock")
                except BlockingIOError:
                    break
            else:
                raise AssertionError("the listen backlog never filled")
            relay = RelayServer(
                listen=f"unix://{workdir}/cri.sock",
                runtime_endpoint=f"unix://{workdir}/runtime.sock",
                interceptor=PassthroughInterceptor(),
            )
            loop.run(relay.start())
            with grpc.insecure_channel(f"unix://{workdir}/cri.sock") as ch:
                for path in (SPLICED, TERMINATED):
                    down = failure(ch, path, b"echo:stuck", timeout=10)
                    assert down.code() == grpc.StatusCode.UNAVAILABLE, down.details()
                    assert "cpushim: runtime" in down.details()
                    assert "listen backlog full" in down.details()
            loop.run(relay.shutdown(2.0))
    finally:
        loop.stop()
    assert "runtime unreachable" in caplog.text


@pytest.mark.parametrize("runtime", ["closes at once", "reads, then closes", "dies with it queued"])
def test_a_runtime_that_ends_the_connection_before_a_word_is_answered_unavailable(
    runtime: str,
) -> None:
    """containerd closes a connection right after accepting it (while it restarts), or dies
    with it still waiting in its listen backlog, before its SETTINGS frame. The client, which
    waits for the server's SETTINGS before it sends a call, once got a bare GOAWAY as the
    first frame (grpcio: "Expected SETTINGS frame as the first frame"); told only SETTINGS and
    GOAWAY, it came straight back to a connection that ended the same way until its call's
    deadline. Each call is now answered UNAVAILABLE, naming the runtime connection lost."""
    loop = LoopThread()
    try:
        with short_tmpdir() as workdir, socket.socket(socket.AF_UNIX) as queued:
            runtime_socket = f"{workdir}/runtime.sock"

            async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                if runtime == "reads, then closes":
                    await reader.readexactly(len(fr.PREFACE))
                writer.close()

            served: asyncio.Server | None = None
            if runtime == "dies with it queued":
                queued.bind(runtime_socket)
                queued.listen(8)  # and never accepts
            else:
                served = loop.run(asyncio.start_unix_server(accepted, runtime_socket))
            relay = RelayServer(
                listen=f"unix://{workdir}/cri.sock",
                runtime_endpoint=f"unix://{runtime_socket}",
                interceptor=PassthroughInterceptor(),
            )
            loop.run(relay.start())
            paths = [SPLICED] if runtime == "dies with it queued" else [SPLICED, TERMINATED]
            with grpc.insecure_channel(f"unix://{workdir}/cri.sock") as ch:
                for path in paths:
                    with ThreadPoolExecutor(1) as caller:
                        call = caller.submit(failure, ch, path, b"echo:x", timeout=10)
                        if runtime == "dies with it queued":
                            wait_for(
                                lambda: any(c.upstream is not None for c in relay.connections),
                                10,
                                "the relay's connection queued in the runtime's backlog",
                            )
                            queued.close()
                        down = call.result(20)
                    assert down.code() == grpc.StatusCode.UNAVAILABLE, down.details()
                    assert "lost the connection to the runtime" in down.details()
                    assert runtime_socket in down.details()
            loop.run(relay.shutdown(2.0))
            if served is not None:
                loop.loop.call_soon_threadsafe(served.close)
    finally:
        loop.stop()


def test_runtime_crash_fails_fast_then_recovers() -> None:
    loop = LoopThread()
    runtime: subprocess.Popen[str] | None = None
    try:
        with short_tmpdir() as workdir:
            runtime_socket = workdir / "runtime.sock"
            runtime = _spawn_runtime(runtime_socket)
            relay = RelayServer(
                listen=f"unix://{workdir}/cri.sock",
                runtime_endpoint=f"unix://{runtime_socket}",
                interceptor=PassthroughInterceptor(),
            )
            loop.run(relay.start())
            with grpc.insecure_channel(f"unix://{workdir}/cri.sock") as ch:
                for path in (SPLICED, TERMINATED):
                    assert unary(ch, path, b"echo:before", timeout=10).endswith(b"before")
                in_flight: dict[str, grpc.RpcError] = {}

                def slow() -> None:
                    in_flight["error"] = failure(ch, SPLICED, b"hold:crash", timeout=60)

                caller = threading.Thread(target=slow)
                caller.start()
                deadline = time.monotonic() + 10
                while not any(conn.splice.open_streams for conn in relay.connections):
                    assert time.monotonic() < deadline, "the slow call never reached the relay"
                    time.sleep(0.01)
                runtime.kill()
                runtime.wait(10)
                runtime_socket.unlink()
                caller.join(20)
                assert in_flight["error"].code() == grpc.StatusCode.UNAVAILABLE
                assert "lost the connection to the runtime" in in_flight["error"].details()
                for path in (SPLICED, TERMINATED):
                    # Answered by cpushim at once: waiting for the runtime would end the call
                    # with DEADLINE_EXCEEDED.
                    down = failure(ch, path, b"echo:during", timeout=20)
                    assert down.code() == grpc.StatusCode.UNAVAILABLE, down.details()
                    assert "cpushim" in down.details()
                runtime = _spawn_runtime(runtime_socket)
                deadline = time.monotonic() + 30
                for path in (SPLICED, TERMINATED):
                    outcome = attempt(ch, path, b"echo:after")
                    while isinstance(outcome, grpc.RpcError):
                        assert outcome.code() == grpc.StatusCode.UNAVAILABLE, outcome.details()
                        assert time.monotonic() < deadline, "relay did not recover"
                        time.sleep(0.05)
                        outcome = attempt(ch, path, b"echo:after")
                    assert outcome.endswith(b"echo:after")
            loop.run(relay.shutdown(2.0))
    finally:
        if runtime is not None:
            runtime.kill()
            runtime.wait(10)
        loop.stop()


# ---------------------------------------------------------------------------- listen socket


def test_socket_mode_and_parent_directory(env: RelayEnv) -> None:
    st = os.stat(env.relay_socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert stat.S_IMODE(os.stat(env.relay_socket.parent).st_mode) == 0o750


@pytest.mark.parametrize(
    ("mode", "group", "expected"),
    [
        # cpushim's own directory (RuntimeDirectory=, or made by cpushim): the group comes in.
        (0o750, "root", ("daemon", 0o750)),
        (0o700, "root", ("daemon", 0o710)),
        (0o740, "daemon", ("daemon", 0o750)),
        # Passable already (like /run): left alone.
        (0o755, "root", ("root", 0o755)),
        (0o751, "root", ("root", 0o751)),
        (0o710, "daemon", ("daemon", 0o710)),
        # A group someone gave it: kept, with a warning.
        (0o750, "bin", ("bin", 0o750)),
    ],
)
def test_the_socket_group_is_let_through_the_sockets_own_directory(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mode: int,
    group: str,
    expected: tuple[str, int],
) -> None:
    if os.geteuid() != 0:
        require("relay", ["root, to give a directory another group"])
    directory = tmp_path / "run"
    directory.mkdir()
    os.chown(directory, -1, grp.getgrnam(group).gr_gid)
    directory.chmod(mode)
    server.open_directory_to_group(str(directory), grp.getgrnam("daemon").gr_gid)
    st = directory.stat()
    assert (grp.getgrgid(st.st_gid).gr_name, stat.S_IMODE(st.st_mode)) == expected
    kept_out = "its members cannot connect" in caplog.text
    assert kept_out == (group == "bin")
