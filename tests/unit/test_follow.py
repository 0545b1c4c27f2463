"""Followed calls: spliced through unchanged, but their reply's end waits for the follower,
which gets the request, the reply and the runtime's status (shim/cri/splice.py,
shim/cri/server.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from shim.cri import frames as fr
from shim.cri.calls import Status, frame_message
from shim.cri.passthrough import PassthroughInterceptor
from shim.cri.server import (
    Afterwards,
    ClientConnection,
    Pending,
    RelayServer,
    UpstreamConnection,
)
from tests.fake_cri import command_of, script, short_tmpdir
from tests.unit.relay_env import RUNTIME, RelayEnv, relay_env, unary
from tests.unit.test_splice_h2 import request_headers

FOLLOWED = RUNTIME + "StopContainer"
OTHER = RUNTIME + "Version"


@dataclass
class Recorder:
    """A follower that records each call and, while ``gate`` is clear, holds it."""

    loop: asyncio.AbstractEventLoop | None = None
    gate: asyncio.Event | None = None
    seen: list[tuple[str, bytes | None, int | None]] = field(default_factory=list)
    responses: list[bytes | None] = field(default_factory=list)
    # The paths whose afterwards-callback ran.
    afterwards: list[str] = field(default_factory=list)
    afterwards_ran: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    # Follow at once (followed_now) rather than in a task; and the paths followed at once.
    at_once: bool = False
    now: list[str] = field(default_factory=list)

    def follows(self, path: str) -> bool:
        return path == FOLLOWED

    def followed_now(
        self, path: str, request: bytes | None, status: int | None, response: bytes | None
    ) -> Afterwards | Pending:
        if not self.at_once:
            return Pending.LATER
        self.now.append(path)
        self.seen.append((path, request, status))
        self.responses.append(response)

        def afterwards() -> None:
            self.afterwards.append(path)
            self.afterwards_ran.set()

        return afterwards

    async def followed(
        self, path: str, request: bytes | None, status: int | None, response: bytes | None
    ) -> Afterwards:
        self.seen.append((path, request, status))
        self.responses.append(response)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()

        def afterwards() -> None:
            self.afterwards.append(path)
            self.afterwards_ran.set()

        return afterwards

    def hold(self, env: RelayEnv) -> None:
        async def make() -> asyncio.Event:
            return asyncio.Event()

        self.loop = env.loop.loop
        self.gate = env.loop.run(make())

    def open_gate(self) -> None:
        assert self.loop is not None
        assert self.gate is not None
        self.loop.call_soon_threadsafe(self.gate.set)


@pytest.fixture
def followed() -> Iterator[tuple[RelayEnv, Recorder]]:
    recorder = Recorder()
    # Nothing terminated here: every call is spliced, StopContainer followed.
    with relay_env(PassthroughInterceptor(frozenset()), recorder) as env:
        yield env, recorder


def test_the_follower_gets_the_request_and_status_before_the_client_gets_the_reply(
    followed: tuple[RelayEnv, Recorder],
) -> None:
    env, recorder = followed
    recorder.hold(env)
    with env.channel() as channel:
        call = channel.unary_unary(FOLLOWED).future(script(b"echo:stopped"), timeout=10)
        assert recorder.entered.wait(10), "the follower was not called"
        # The runtime has answered, but the reply's end waits for the follower.
        assert not call.done()
        # Other calls on the same connection are not held up meanwhile.
        assert unary(channel, OTHER, b"echo:meanwhile", timeout=10).endswith(b"meanwhile")
        assert not call.done()
        recorder.open_gate()
        reply = call.result(timeout=10)
        assert reply.endswith(b"stopped")
    ((path, request, status),) = recorder.seen
    assert path == FOLLOWED
    assert request is not None
    assert command_of(request) == b"echo:stopped"
    assert recorder.responses == [reply]
    # What the follower left for after the reply ran once it was sent.
    assert recorder.afterwards_ran.wait(10)
    assert recorder.afterwards == [FOLLOWED]
    assert status == Status.OK


def test_a_failed_call_reaches_the_follower_with_its_status(
    followed: tuple[RelayEnv, Recorder],
) -> None:
    env, recorder = followed
    with env.channel() as channel, pytest.raises(grpc.RpcError) as caught:
        unary(channel, FOLLOWED, b"error:5:no such container", timeout=10)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    ((_, _, status),) = recorder.seen
    assert status == Status.NOT_FOUND
    assert recorder.responses == [None]


def test_a_compressed_request_is_read_decompressed(followed: tuple[RelayEnv, Recorder]) -> None:
    env, recorder = followed
    command = b"echo:" + b"z" * 4000
    with grpc.insecure_channel(env.relay_target, compression=grpc.Compression.Gzip) as channel:
        # Two calls: the first block may predate our zero-size table, the second cannot.
        for _ in range(2):
            # The fake runtime (grpclib) cannot decompress; the follower must.
            with pytest.raises(grpc.RpcError):
                unary(channel, FOLLOWED, command, timeout=10)
    assert [command_of(request or b"") for _, request, _ in recorder.seen] == [command] * 2


def test_a_request_over_many_frames_is_read_whole(followed: tuple[RelayEnv, Recorder]) -> None:
    env, recorder = followed
    command = b"echo:" + b"x" * 200_000  # many DATA frames of the default 16 KiB
    with env.channel() as channel:
        reply = unary(channel, FOLLOWED, command, timeout=10)
        assert reply.endswith(b"x" * 1000)
    ((_, request, _),) = recorder.seen
    assert request is not None
    assert command_of(request) == command
    # The reply came back over many frames too, and the follower has it whole.
    assert recorder.responses == [reply]


def test_a_call_the_client_gives_up_on_while_held_leaves_the_connection_usable(
    followed: tuple[RelayEnv, Recorder],
) -> None:
    env, recorder = followed
    recorder.hold(env)
    with env.channel() as channel:
        with pytest.raises(grpc.RpcError) as caught:
            unary(channel, FOLLOWED, b"echo:late", timeout=1)
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        recorder.open_gate()  # release() after the client's reset sends nothing
        recorder.gate = None
        assert unary(channel, FOLLOWED, b"echo:again", timeout=10).endswith(b"again")
        assert unary(channel, OTHER, b"echo:other", timeout=10).endswith(b"other")
    assert [status for _, _, status in recorder.seen] == [Status.OK, Status.OK]


def test_a_call_followed_at_once_is_released_without_waiting_for_a_task(
    followed: tuple[RelayEnv, Recorder],
) -> None:
    env, recorder = followed
    recorder.at_once = True
    recorder.hold(env)  # would hold the call, were it followed in a task
    with env.channel() as channel:
        reply = unary(channel, FOLLOWED, b"echo:stopped", timeout=10)
        assert reply.endswith(b"stopped")
        assert unary(channel, FOLLOWED, b"echo:again", timeout=10).endswith(b"again")
    assert recorder.now == [FOLLOWED, FOLLOWED]
    assert not recorder.entered.is_set()  # followed() was never called
    assert recorder.responses[0] == reply
    assert recorder.afterwards_ran.wait(10)
    assert recorder.afterwards[:1] == [FOLLOWED]


class RecordingTransport:
    """A transport that keeps each ``writelines`` call: one call is one send to the peer."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.eof = False
        self.reading_paused = False

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    def writelines(self, chunks: list[bytes]) -> None:
        assert not self.eof, "written after EOF"
        self.writes.append(b"".join(chunks))

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True


class Peers:
    """A real ClientConnection between two strict h2 peers, a client and a runtime, whose
    sends it records (one ``writelines`` is one send)."""

    def __init__(self, server: RelayServer) -> None:
        self.connection = ClientConnection(server)
        self.to_client, self.to_runtime = RecordingTransport(), RecordingTransport()
        self.connection.client = cast(asyncio.Transport, self.to_client)
        self.connection.upstream = cast(asyncio.Transport, self.to_runtime)
        self.connection._connecting = False
        self.client = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.runtime = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self.client.initiate_connection()
        self.runtime.initiate_connection()
        # Streams whose request the runtime has whole.
        self.requests_ended: set[int] = set()
        self.exchange()

    def exchange(self) -> None:
        """Pass everything each side has to send on, until nobody has more."""
        for _ in range(100):
            sent = self.client.data_to_send()
            if sent:
                self.connection.data_received(sent)
            answered = self.runtime.data_to_send()
            if answered:
                self.connection.upstream_data(answered)
            for data in self.to_runtime.writes:
                for event in self.runtime.receive_data(data):
                    if isinstance(event, h2.events.StreamEnded):
                        self.requests_ended.add(event.stream_id)
            for data in self.to_client.writes:
                self.client.receive_data(data)
            written = bool(self.to_runtime.writes or self.to_client.writes)
            self.to_runtime.writes.clear()
            self.to_client.writes.clear()
            if not (sent or answered or written):
                return
        raise AssertionError("the exchange did not settle")

    def call(self, path: str, request: bytes, timeout: bytes = b"9S") -> int:
        """Send a call's request (``timeout``: its grpc-timeout); its stream id."""
        stream: int = self.client.get_next_available_stream_id()
        headers = [
            (name, timeout if name == b"grpc-timeout" else value)
            for name, value in request_headers(path)
        ]
        self.client.send_headers(stream, headers)
        self.client.send_data(stream, frame_message(request), end_stream=True)
        return stream

    def answer(self, stream: int, reply: bytes) -> None:
        """The runtime's whole reply, in one read of the relay's."""
        self.runtime.send_headers(
            stream, [(b":status", b"200"), (b"content-type", b"application/grpc")]
        )
        self.runtime.send_data(stream, frame_message(reply))
        self.runtime.send_headers(stream, [(b"grpc-status", b"0")], end_stream=True)
        self.connection.upstream_data(self.runtime.data_to_send())

    def client_events(self) -> list[list[type[h2.events.Event]]]:
        """What the client made of each send it got since the last look, one list per send,
        leaving out stream ends."""
        kinds: list[list[type[h2.events.Event]]] = []
        for data in self.to_client.writes:
            events = self.client.receive_data(data)
            kinds.append([type(e) for e in events if not isinstance(e, h2.events.StreamEnded)])
        self.to_client.writes.clear()
        return kinds


@pytest.mark.anyio
@pytest.mark.parametrize("shutting_down", [False, True], ids=["serving", "shutting-down"])
async def test_a_reply_followed_at_once_reaches_the_client_in_one_write(
    shutting_down: bool,
) -> None:
    """When the runtime's whole reply comes in one read and the follower has nothing to wait
    for, its frames and its released trailers go to the client in one send, as they would
    without cpushim, not as the reply and then its end. The work the follower left for after
    the reply runs even when that reply was the last before the connection closes."""
    recorder = Recorder(at_once=True)
    server = RelayServer(
        listen="unix:///nonexistent/relay.sock",
        runtime_endpoint="unix:///nonexistent/runtime.sock",
        interceptor=PassthroughInterceptor(frozenset()),
        follower=recorder,
    )
    peers = Peers(server)
    stream = peers.call(FOLLOWED, script(b"echo:stopped"))
    peers.exchange()
    peers.connection._shutting_down = shutting_down
    peers.answer(stream, b"reply")

    assert peers.client_events() == [
        [h2.events.ResponseReceived, h2.events.DataReceived, h2.events.TrailersReceived]
    ]
    assert recorder.now == [FOLLOWED]
    assert recorder.afterwards == [FOLLOWED]
    # The last reply before a close: writing ends, and the runtime's side closes.
    assert peers.to_client.eof is shutting_down
    assert peers.to_runtime.closed is shutting_down


def ended_before_its_runtime(runtime_socket: Path) -> Peers:
    """A connection whose client was told to go away (and got EOF) while its runtime
    connection, to ``runtime_socket``, was still being made."""
    server = RelayServer(
        listen=f"unix://{runtime_socket.parent}/relay.sock",
        runtime_endpoint=f"unix://{runtime_socket}",
        interceptor=PassthroughInterceptor(frozenset()),
    )
    peers = Peers(server)
    connection = peers.connection
    connection.upstream = None
    connection._connecting = True
    connection.data_received(fr.PREFACE)  # held until the runtime is reached
    connection.begin_shutdown()  # no call in flight: it ends at once
    assert peers.to_client.eof
    return peers


@pytest.mark.anyio
async def test_an_upstream_that_connects_after_the_connection_ended_is_closed() -> None:
    """A client told to go away before its runtime connection was made (a shutdown right
    after it connected): the runtime connection, once made, is closed at once and carries
    nothing of the client's."""
    with short_tmpdir() as workdir:
        accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        accepted = asyncio.Queue()

        async def runtime(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.put_nowait((reader, writer))

        listening = await asyncio.start_unix_server(runtime, path=str(workdir / "runtime.sock"))
        try:
            peers = ended_before_its_runtime(workdir / "runtime.sock")
            connection = peers.connection
            await connection._connect_upstream()
            assert connection.upstream is None
            reader, writer = await asyncio.wait_for(accepted.get(), 5)
            try:
                assert await asyncio.wait_for(reader.read(), 5) == b""
            finally:
                writer.close()  # from 3.12 on, the server waits for its connections to close
        finally:
            listening.close()
            await asyncio.wait_for(listening.wait_closed(), 5)


@pytest.mark.anyio
async def test_an_unreachable_runtime_after_the_connection_ended_is_not_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same, with no runtime to reach: nobody is left to answer UNAVAILABLE to, so the
    connection does not switch to answering its calls itself, and logs nothing."""
    with short_tmpdir() as workdir:
        peers = ended_before_its_runtime(workdir / "nothing-listens-here.sock")
        connection = peers.connection
        peers.to_client.writes.clear()
        with caplog.at_level("WARNING", logger="shim.cri.server"):
            await connection._connect_upstream()
        assert not connection.splice.upstream_absent
        assert not caplog.records
        assert not peers.to_client.writes


@pytest.mark.anyio
async def test_losing_a_runtime_that_had_paused_the_client_resumes_its_reading() -> None:
    """containerd stopped reading (its socket full), so the relay paused the client's
    reading; then its connection went. The client's reading must go on: its credit for
    the replies still on their way, and its next calls, are read from it."""
    server = RelayServer(
        listen="unix:///nonexistent/relay.sock",
        runtime_endpoint="unix:///nonexistent/runtime.sock",
        interceptor=PassthroughInterceptor(frozenset()),
    )
    peers = Peers(server)
    peers.call(FOLLOWED, script(b"echo:stopped"))
    peers.exchange()
    UpstreamConnection(peers.connection).pause_writing()
    assert peers.to_client.reading_paused
    peers.connection.upstream_lost(ConnectionResetError("runtime gone"))
    assert not peers.to_client.reading_paused


@pytest.mark.anyio
async def test_a_client_that_reads_nothing_is_not_read_only_when_the_relay_answers_it() -> None:
    """With a runtime connection, what the client sends goes on to the runtime, which
    answers at its own pace: the client is read on (a protocol error it sends is still
    seen). Without one, the relay answers everything itself, and a client that reads nothing
    is read no more until it reads."""
    server = RelayServer(
        listen="unix:///nonexistent/relay.sock",
        runtime_endpoint="unix:///nonexistent/runtime.sock",
        interceptor=PassthroughInterceptor(frozenset()),
    )
    peers = Peers(server)
    connection = peers.connection
    connection.pause_writing()  # the client reads nothing
    assert peers.to_runtime.reading_paused
    assert not peers.to_client.reading_paused
    UpstreamConnection(connection).pause_writing()  # nor does the runtime
    assert peers.to_client.reading_paused
    UpstreamConnection(connection).resume_writing()
    assert not peers.to_client.reading_paused
    connection.upstream_lost(ConnectionResetError("runtime gone"))
    assert peers.to_client.reading_paused  # only the relay is left to answer it
    connection.resume_writing()  # the client reads again
    assert not peers.to_client.reading_paused
