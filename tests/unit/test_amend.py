"""Amended calls through the relay's sockets, between grpcio and a fake runtime: the request
is held while the interceptor decides, then goes on, maybe changed, on the client's own stream
(shim/cri/server.py StreamForward), or is answered at the relay."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import h2.events
import pytest

from shim.cri import server as server_module
from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.server import RelayServer
from shim.cri.upstream import ChannelForward, Forward, RuntimeChannel
from tests.fake_cri import command_of, script
from tests.harness.containerd import wait_for
from tests.unit.engine_env import until
from tests.unit.relay_env import RUNTIME, RelayEnv, relay_env, unary
from tests.unit.test_follow import Peers, Recorder

CREATE = RUNTIME + "CreateContainer"


class AmendsCreateContainer:
    """Intercepts CreateContainer alone, and amends it: its request is held on the client's
    own stream until ``handle`` forwards it."""

    def intercepts(self, path: str) -> bool:
        return path == CREATE

    def amends(self, path: str) -> bool:
        return True


@dataclass
class Deciding(AmendsCreateContainer):
    """Holds CreateContainer until let go (when gated), then answers or forwards it as the
    request's command says; records what forwarding returned."""

    gate: asyncio.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    forwarded: list[Reply] = field(default_factory=list)

    async def handle(self, call: UnaryCall, forward: Forward) -> Reply:
        self.entered.set()
        # As the engine does: the decision goes on when the client gives up.
        return await asyncio.shield(self._decide(call, forward))

    async def _decide(self, call: UnaryCall, forward: Forward) -> Reply:
        try:
            if self.gate is not None:
                await self.gate.wait()
            command = command_of(call.request)
            if command == b"refuse":
                return Reply.error(Status.RESOURCE_EXHAUSTED, "cpushim: no CPUs left")
            if command.startswith((b"error:", b"sleep:")):
                reply = await forward()
            else:
                reply = await forward(script(b"changed:" + command))
            self.forwarded.append(reply)
            if command == b"fail-after":
                raise RuntimeError("decision failed after the forward")
            return reply
        finally:
            self.done.set()


@pytest.fixture
def deciding() -> Iterator[tuple[RelayEnv, Deciding]]:
    interceptor = Deciding()
    with relay_env(interceptor) as env:
        yield env, interceptor


def hold(env: RelayEnv, interceptor: Deciding) -> None:
    async def make() -> asyncio.Event:
        return asyncio.Event()

    interceptor.gate = env.loop.run(make())


def calls_in_flight(env: RelayEnv) -> int:
    """Intercepted calls the relay is answering (read on its own loop)."""

    async def count() -> int:
        assert env.relay is not None
        return sum(len(connection._calls) for connection in env.relay.connections)

    return env.loop.run(count())


def let_go(env: RelayEnv, interceptor: Deciding) -> None:
    assert interceptor.gate is not None
    env.loop.loop.call_soon_threadsafe(interceptor.gate.set)


def test_the_changed_request_reaches_the_runtime_and_its_reply_the_client(
    deciding: tuple[RelayEnv, Deciding],
) -> None:
    env, interceptor = deciding
    with env.channel() as channel:
        reply = unary(channel, CREATE, b"pin", timeout=10)
    assert reply == b"reply-to:" + CREATE.encode() + b":changed:pin"
    assert env.fake.runtime.wire == [(CREATE, script(b"changed:pin"))]
    (outcome,) = interceptor.forwarded
    assert outcome.status is Status.OK
    assert outcome.messages == (reply,)


def test_a_refused_call_never_reaches_the_runtime(deciding: tuple[RelayEnv, Deciding]) -> None:
    env, _ = deciding
    with env.channel() as channel:
        with pytest.raises(grpc.RpcError) as raised:
            unary(channel, CREATE, b"refuse", timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert raised.value.details() == "cpushim: no CPUs left"
        # The connection is fine for the next call.
        assert unary(channel, CREATE, b"next", timeout=10).endswith(b"changed:next")
    assert [path for path, _ in env.fake.runtime.wire] == [CREATE]


def test_the_runtimes_error_reaches_the_interceptor_and_the_client(
    deciding: tuple[RelayEnv, Deciding],
) -> None:
    env, interceptor = deciding
    with env.channel() as channel, pytest.raises(grpc.RpcError) as raised:
        unary(channel, CREATE, b"error:6:name is reserved", timeout=10)
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert raised.value.details() == "name is reserved"
    (outcome,) = interceptor.forwarded
    assert outcome.status is Status.ALREADY_EXISTS
    assert outcome.status_message == "name is reserved"
    assert outcome.messages == ()
    assert not outcome.unanswered  # the runtime's own answer


def test_after_the_forward_the_runtimes_reply_stands_even_if_the_handler_fails(
    deciding: tuple[RelayEnv, Deciding],
) -> None:
    env, _ = deciding
    with env.channel() as channel:
        reply = unary(channel, CREATE, b"fail-after", timeout=10)
    assert reply == b"reply-to:" + CREATE.encode() + b":changed:fail-after"


def test_a_call_its_client_gave_up_on_is_not_forwarded(
    deciding: tuple[RelayEnv, Deciding],
) -> None:
    env, interceptor = deciding
    hold(env, interceptor)
    with env.channel() as channel:
        future = channel.unary_unary(CREATE).future(script(b"pin"), timeout=10)
        assert interceptor.entered.wait(5)
        future.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            future.result()
        # Let the decision go on only once the relay has seen the client's RST_STREAM.
        wait_for(lambda: not calls_in_flight(env), 5, "the relay to see the cancel", interval=0.005)
        let_go(env, interceptor)
        assert interceptor.done.wait(5)
    (outcome,) = interceptor.forwarded
    assert outcome.status is Status.CANCELLED
    assert not outcome.unanswered  # never sent: the runtime did nothing
    assert env.fake.runtime.wire == []


def test_a_call_held_past_its_deadline_is_not_forwarded(
    deciding: tuple[RelayEnv, Deciding],
) -> None:
    env, interceptor = deciding
    hold(env, interceptor)
    with env.channel() as channel:
        with pytest.raises(grpc.RpcError) as raised:
            unary(channel, CREATE, b"pin", timeout=0.3)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        let_go(env, interceptor)
        assert interceptor.done.wait(5)
    (outcome,) = interceptor.forwarded
    assert outcome.status is not Status.OK
    assert env.fake.runtime.wire == []


def test_a_client_gone_mid_call_ends_every_forward_waiting_on_it(
    deciding: tuple[RelayEnv, Deciding],
) -> None:
    env, interceptor = deciding
    channel = env.channel()
    futures = [
        channel.unary_unary(CREATE).future(script(b"sleep:30"), timeout=60) for _ in range(2)
    ]
    wait_for(lambda: len(env.fake.runtime.wire) == 2, 10, "both calls at the runtime")
    channel.close()
    for future in futures:
        with pytest.raises(grpc.RpcError):
            future.result()
    wait_for(lambda: len(interceptor.forwarded) == 2, 10, "both forwards to end")
    assert [reply.status for reply in interceptor.forwarded] == [Status.UNAVAILABLE] * 2
    # Sent and never answered: the runtime may have acted on them.
    assert all(reply.unanswered for reply in interceptor.forwarded)
    relay = env.relay
    assert relay is not None
    wait_for(lambda: calls_in_flight(env) == 0 and not relay.connections, 10, "the close")


# --- the seen hook: the reply's end without waiting for the handler ---------------------------


@dataclass
class Watching(AmendsCreateContainer):
    """Forwards CreateContainer with a ``seen`` hook that answers ``verdict`` (or raises),
    then waits for ``gate`` before returning, as a handler with more to do would."""

    verdict: bool | None  # None: the hook raises
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[Reply] = field(default_factory=list)
    # What the forward returned, and (once the gate opens) what the handler did.
    returned_forward: list[Reply] = field(default_factory=list)
    forwarded: asyncio.Event = field(default_factory=asyncio.Event)
    returned: list[Reply] = field(default_factory=list)

    async def handle(self, call: UnaryCall, forward: Forward) -> Reply:
        def hook(reply: Reply) -> bool:
            self.seen.append(reply)
            if self.verdict is None:
                raise RuntimeError("the hook failed")
            return self.verdict

        reply = await forward(call.request, seen=hook)
        self.returned_forward.append(reply)
        self.forwarded.set()
        await self.gate.wait()
        self.returned.append(reply)
        return reply


async def reached_runtime(peers: Peers, stream: int) -> None:
    """Let the relay's tasks run, passing on what either side sends, until the runtime has
    the whole request of ``stream``."""

    def passed() -> bool:
        peers.exchange()
        return stream in peers.requests_ended

    await until(passed, "the request reached the runtime")


def watched(verdict: bool | None) -> tuple[Peers, Watching]:
    interceptor = Watching(verdict)
    server = RelayServer(
        listen="unix:///nonexistent/relay.sock",
        runtime_endpoint="unix:///nonexistent/runtime.sock",
        interceptor=interceptor,
    )
    return Peers(server), interceptor


@pytest.mark.anyio
async def test_a_reply_the_hook_is_done_with_reaches_the_client_whole_at_once() -> None:
    """Before the handler returns, and in one send, as without cpushim."""
    peers, interceptor = watched(True)
    stream = peers.call(CREATE, b"create")
    await reached_runtime(peers, stream)
    peers.answer(stream, b"created")

    assert peers.client_events() == [
        [h2.events.ResponseReceived, h2.events.DataReceived, h2.events.TrailersReceived]
    ]
    (seen,) = interceptor.seen
    assert seen.status is Status.OK
    assert seen.messages == (b"created",)
    assert interceptor.returned == []
    interceptor.gate.set()
    await until(lambda: bool(interceptor.returned), "the handler returned")
    assert peers.client_events() == []  # nothing more: the end went once


@pytest.mark.anyio
@pytest.mark.parametrize("verdict", [False, None], ids=["not-done", "hook-failed"])
async def test_a_reply_the_hook_is_not_done_with_ends_when_the_handler_returns(
    verdict: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    peers, interceptor = watched(verdict)
    stream = peers.call(CREATE, b"create")
    await reached_runtime(peers, stream)
    with caplog.at_level(logging.ERROR):
        peers.answer(stream, b"created")

    assert peers.client_events() == [[h2.events.ResponseReceived, h2.events.DataReceived]]
    assert len(interceptor.seen) == 1
    assert ("work on a reply failed" in caplog.text) is (verdict is None)
    interceptor.gate.set()
    await until(lambda: bool(interceptor.returned), "the handler returned")
    assert peers.client_events() == [[h2.events.TrailersReceived]]


@pytest.mark.anyio
async def test_a_reply_after_the_forward_gave_up_waiting_is_not_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past its deadline (and grace) the forward answers DEADLINE_EXCEEDED and the handler
    acts on that: a reply the runtime sends later must not reach the hook as well."""
    monkeypatch.setattr(server_module, "_DEADLINE_GRACE", 0.0)
    peers, interceptor = watched(True)
    stream = peers.call(CREATE, b"create", timeout=b"20m")
    await reached_runtime(peers, stream)
    await asyncio.wait_for(interceptor.forwarded.wait(), 10)
    assert interceptor.returned_forward[0].status is Status.DEADLINE_EXCEEDED
    peers.answer(stream, b"created")
    assert interceptor.seen == []


def test_a_call_forwarded_on_the_relays_channel_shows_its_reply_to_the_hook_too() -> None:
    """ChannelForward (calls the relay answers, on its own channel): the hook runs once, with
    the runtime's reply, before the forward returns it; a failing hook changes nothing."""
    with relay_env() as env:

        async def forward_twice() -> tuple[list[Reply], Reply, Reply]:
            runtime = RuntimeChannel(env.fake.endpoint)
            seen: list[Reply] = []

            def done(reply: Reply) -> bool:
                seen.append(reply)
                return True

            def failing(reply: Reply) -> bool:
                seen.append(reply)
                raise RuntimeError("the hook failed")

            try:
                call = UnaryCall(CREATE, (), script(b"echo:created"), timeout=10.0)
                first = await ChannelForward(runtime, call)(seen=done)
                second = await ChannelForward(runtime, call)(seen=failing)
            finally:
                runtime.close()
            return seen, first, second

        seen, first, second = env.loop.run(forward_twice())
    assert seen == [first, second]
    assert first.status is second.status is Status.OK
    assert first.messages[0].endswith(b"created")


@pytest.mark.anyio
async def test_a_late_reply_to_an_amended_call_is_not_handed_to_the_follower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler gave up on the runtime's reply (deadline and grace) and has answered: a
    reply the runtime sends later is for nobody. Handed to the follower, it looked like a
    followed call whose request could not be read (a warning and unread_requests, for each
    late CreateContainer)."""
    monkeypatch.setattr(server_module, "_DEADLINE_GRACE", 0.0)
    interceptor = Watching(True)
    interceptor.gate.set()
    recorder = Recorder(at_once=True)  # followed at once: seen within the answer's pass
    server = RelayServer(
        listen="unix:///nonexistent/relay.sock",
        runtime_endpoint="unix:///nonexistent/runtime.sock",
        interceptor=interceptor,
        follower=recorder,
    )
    peers = Peers(server)
    stream = peers.call(CREATE, b"create", timeout=b"20m")
    await reached_runtime(peers, stream)
    await until(lambda: bool(interceptor.returned), "the handler returned")
    assert interceptor.returned[0].status is Status.DEADLINE_EXCEEDED
    peers.answer(stream, b"created")
    assert recorder.seen == []


@dataclass
class Slow(AmendsCreateContainer):
    """Forwards CreateContainer only once its deadline has passed (a decision that waited
    for the engine lock that long), and records when the forward gave up."""

    deadline: float
    arrived: float = 0.0
    returned: list[tuple[Reply, float]] = field(default_factory=list)

    async def handle(self, call: UnaryCall, forward: Forward) -> Reply:
        loop = asyncio.get_running_loop()
        self.arrived = loop.time()
        await until(lambda: loop.time() > self.arrived + self.deadline, "past the deadline", 10)
        reply = await forward(call.request)
        self.returned.append((reply, loop.time()))
        return reply


@pytest.mark.anyio
async def test_the_wait_for_a_reply_ends_by_the_calls_deadline_from_its_arrival(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not a whole deadline (and grace) from the forward: time the handler spent first
    (the engine's lock, its checkpoint) counts, as it does for the client."""
    monkeypatch.setattr(server_module, "_DEADLINE_GRACE", 0.0)
    interceptor = Slow(deadline=2.0)
    server = RelayServer(
        listen="unix:///nonexistent/relay.sock",
        runtime_endpoint="unix:///nonexistent/runtime.sock",
        interceptor=interceptor,
    )
    peers = Peers(server)
    peers.call(CREATE, b"create", timeout=b"2S")  # the runtime never answers
    peers.exchange()
    await until(lambda: bool(interceptor.returned), "the forward gave up", 10)
    [(reply, at)] = interceptor.returned
    assert reply.status is Status.DEADLINE_EXCEEDED
    # At once past the deadline, not a second deadline's length (2 s) after the forward.
    assert at - interceptor.arrived < 3.0
