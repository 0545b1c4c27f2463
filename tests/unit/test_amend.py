"""Amended calls through the relay's sockets, between grpcio and a fake runtime: the request
is held while the interceptor decides, then goes on, maybe changed, on the client's own stream
(shim/cri/server.py StreamForward), or is answered at the relay."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.upstream import Forward
from tests.fake_cri import command_of, script
from tests.harness.containerd import wait_for
from tests.unit.relay_env import RUNTIME, RelayEnv, relay_env, unary

CREATE = RUNTIME + "CreateContainer"


@dataclass
class Deciding:
    """Amends CreateContainer: holds it until let go (when gated), then answers or forwards
    it as the request's command says; records what forwarding returned."""

    gate: asyncio.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    forwarded: list[Reply] = field(default_factory=list)

    def intercepts(self, path: str) -> bool:
        return path == CREATE

    def amends(self, path: str) -> bool:
        return True

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
    relay = env.relay
    assert relay is not None
    wait_for(lambda: calls_in_flight(env) == 0 and not relay.connections, 10, "the close")
