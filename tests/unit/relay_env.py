"""A fake runtime and an in-process relay on a background event loop, for sync grpcio tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc

from shim.cri.passthrough import PassthroughInterceptor
from shim.cri.server import Follower, Interceptor, RelayServer
from tests.fake_cri import FakeRuntimeServer, script, short_tmpdir

T = TypeVar("T")

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGE = "/runtime.v1.ImageService/"
BIG_MESSAGES = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class RelayEnv:
    def __init__(
        self,
        workdir: Path,
        loop: LoopThread,
        interceptor: Interceptor | None = None,
        follower: Follower | None = None,
    ) -> None:
        self.workdir = workdir
        self.loop = loop
        self.interceptor = interceptor or PassthroughInterceptor()
        self.follower = follower
        self.fake = FakeRuntimeServer(workdir / "runtime.sock")
        self.relay: RelayServer | None = None
        self.relay_socket = workdir / "run" / "cri.sock"

    @property
    def direct_target(self) -> str:
        return f"unix://{self.fake.socket_path}"

    @property
    def relay_target(self) -> str:
        return f"unix://{self.relay_socket}"

    def start(self) -> None:
        self.loop.run(self.fake.start())
        self.relay = RelayServer(
            listen=self.relay_target,
            runtime_endpoint=self.fake.endpoint,
            interceptor=self.interceptor,
            follower=self.follower,
        )
        self.loop.run(self.relay.start())

    def stop(self) -> None:
        if self.relay is not None:
            self.loop.run(self.relay.shutdown(2.0))
        self.loop.run(self.fake.stop())

    def channel(self, target: str | None = None) -> grpc.Channel:
        return grpc.insecure_channel(target or self.relay_target, options=BIG_MESSAGES)


@contextmanager
def relay_env(
    interceptor: Interceptor | None = None, follower: Follower | None = None
) -> Iterator[RelayEnv]:
    loop = LoopThread()
    try:
        with short_tmpdir() as workdir:
            env = RelayEnv(workdir, loop, interceptor, follower)
            env.start()
            try:
                yield env
            finally:
                env.stop()
    finally:
        loop.stop()


def unary(channel: grpc.Channel, path: str, command: bytes, **kwargs: Any) -> bytes:
    """Call ``path`` with a request scripting the fake runtime (see tests.fake_cri)."""
    result: bytes = channel.unary_unary(path)(script(command), **kwargs)
    return result


def failure(channel: grpc.Channel, path: str, command: bytes, **kwargs: Any) -> grpc.RpcError:
    try:
        channel.unary_unary(path)(script(command), **kwargs)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{path} succeeded but a failure was expected")
