"""The runtime channel's transport failures: every one becomes a reply, never an exception."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from asyncio.selector_events import BaseSelectorEventLoop
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.cri import upstream
from shim.cri.calls import Status, UnaryCall
from shim.cri.upstream import RuntimeChannel
from shim.run import wait_for_runtime
from shim.status_cli import live_view
from tests.fake_cri import short_tmpdir
from tests.fake_runtime import FakeRuntime

VERSION = "/runtime.v1.RuntimeService/Version"


@pytest.fixture
def closes_at_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A socket whose far end accepts each connection and closes it at once (a runtime going
    down or coming up): made certain by closing it as soon as the client's connect returns,
    before the client has written anything."""
    with short_tmpdir() as workdir:
        path = str(Path(workdir) / "runtime.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(8)
            connect = upstream.connect_unix

            def connect_then_closed(address: str) -> socket.socket:
                sock = connect(address)
                peer, _ = listener.accept()  # queued already: no wait
                peer.close()
                return sock

            monkeypatch.setattr(upstream, "connect_unix", connect_then_closed)
            yield f"unix://{path}"


@pytest.mark.anyio
async def test_a_connection_closed_at_once_is_unavailable(closes_at_once: str) -> None:
    channel = RuntimeChannel(closes_at_once)
    try:
        for _ in range(2):  # and again on the next call, with a new connection
            reply = await channel.unary(UnaryCall(VERSION, (), b"", 5.0))
            assert reply.status is Status.UNAVAILABLE
            assert not reply.unanswered  # nothing was sent: the runtime did nothing
            assert "closed the connection" in reply.status_message
    finally:
        channel.close()


@pytest.mark.anyio
async def test_a_runtime_whose_listen_backlog_is_full_is_unavailable_and_says_why() -> None:
    """A stuck runtime that accepts nothing: the connect fails at once (EAGAIN). asyncio's own
    connect took EAGAIN for a connection in progress and handed grpclib a socket that was not
    connected, so the call was answered as if the runtime had closed the connection."""
    assert isinstance(asyncio.get_running_loop(), BaseSelectorEventLoop)  # asyncio's, not uvloop
    with (
        short_tmpdir() as workdir,
        socket.socket(socket.AF_UNIX) as stuck,
        contextlib.ExitStack() as queued,
    ):
        path = f"{workdir}/runtime.sock"
        stuck.bind(path)
        stuck.listen(0)  # and never accepts
        for _ in range(64):
            waiting = queued.enter_context(socket.socket(socket.AF_UNIX))
            waiting.setblocking(False)
            try:
                waiting.connect(path)
            except BlockingIOError:
                break
        else:
            raise AssertionError("the listen backlog never filled")
        channel = RuntimeChannel(f"unix://{path}")
        try:
            for _ in range(2):  # and again on the next call
                reply = await channel.unary(UnaryCall(VERSION, (), b"", 5.0))
                assert reply.status is Status.UNAVAILABLE
                assert not reply.unanswered  # nothing was sent: the runtime did nothing
                assert "listen backlog full" in reply.status_message, reply.status_message
        finally:
            channel.close()


@pytest.mark.anyio
async def test_the_wait_for_the_runtime_ends_with_its_own_error_on_connections_closed_at_once(
    closes_at_once: str,
) -> None:
    channel = RuntimeChannel(closes_at_once)
    try:
        with pytest.raises(RuntimeError, match="did not answer within"):
            await wait_for_runtime(channel, 0)
    finally:
        channel.close()


def test_status_tells_of_a_socket_that_closes_connections_at_once(closes_at_once: str) -> None:
    live = live_view(closes_at_once)
    assert live is not None
    assert live.containers is None
    assert live.error is not None
    assert "closed the connection" in live.error


@pytest.mark.anyio
async def test_the_wait_for_a_runtime_that_never_answers_keeps_to_its_budget() -> None:
    """upstreamWait: "seconds to wait for the runtime at start before exiting 1". A runtime
    that takes the connection and never answers (hung, or its CRI plugin not up) must not
    hold a probe past the budget: with upstreamWait = 0.5, not 5 s."""
    async with FakeRuntime() as fake:
        answer = fake.gate("Version")
        channel = RuntimeChannel(fake.endpoint)
        waiting = asyncio.ensure_future(wait_for_runtime(channel, 0.5))
        try:
            done, _ = await asyncio.wait({waiting}, timeout=3)
            assert done, "the wait outlasted its budget"
            with pytest.raises(RuntimeError, match=r"did not answer within 0\.5s"):
                waiting.result()
        finally:
            answer.set()
            channel.close()
            if not waiting.done():
                await asyncio.wait({waiting}, timeout=10)
