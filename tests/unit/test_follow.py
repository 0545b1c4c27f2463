"""Followed calls: spliced through unchanged, but their reply's end waits for the follower,
which gets the request, the reply and the runtime's status (shim/cri/splice.py,
shim/cri/server.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from shim.cri.calls import Status
from shim.cri.passthrough import PassthroughInterceptor
from shim.cri.server import Afterwards, Pending
from tests.fake_cri import command_of, script
from tests.unit.relay_env import RUNTIME, RelayEnv, relay_env, unary

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
