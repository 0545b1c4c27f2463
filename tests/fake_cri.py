"""A programmable fake CRI runtime (grpclib server, raw bytes codec) for relay unit tests.

Every method of runtime.v1 RuntimeService and ImageService is served. A test scripts what the
fake does through the request itself: :func:`script` puts a command in protobuf field 999, which
no CRI message defines, so the request is a valid message of every type (an unknown field that
must survive the relay). Commands:

* ``b"echo:..."``          reply with the same bytes (the default for anything else too)
* ``b"error:<code>:<msg>"`` fail with that gRPC status, message and status details
* ``b"sleep:<seconds>"``   wait before answering (deadline tests)
* ``b"hold:<name>"``       wait until the test calls :meth:`FakeRuntime.release` (from any
  thread); :meth:`FakeRuntime.wait_held` returns once such a call is held. In a process of its
  own (``python -m tests.fake_cri``) a held call is let go only when the process ends.
* ``b"big:<n>"``           reply with n bytes
* ``b"meta"``              echo request metadata as initial and trailing metadata
* ``b"stream:<n>"``        (server-streaming methods) send n messages then end
* ``b"stream:<n>:hold:<name>"`` (server-streaming methods) send n messages, then hold as
  ``hold:<name>`` does (a stream kept open, as kubelet's GetContainerEvents is), then end
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.base import CodecBase, StatusDetailsCodecBase
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from shim.cri.methods import ALL_METHODS

DETAILS = b"\x08\x05\x12\x0bfake-detail"
SCRIPT_FIELD = 999
_SCRIPT_TAG = bytes([((SCRIPT_FIELD << 3) | 2) & 0x7F | 0x80, (SCRIPT_FIELD << 3 | 2) >> 7])


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def script(command: bytes) -> bytes:
    """A request message carrying ``command`` in unknown field 999."""
    return _SCRIPT_TAG + _varint(len(command)) + command


def command_of(request: bytes) -> bytes:
    """The command :func:`script` put in ``request`` (the raw bytes if there is none)."""
    if not request.startswith(_SCRIPT_TAG):
        return request
    pos, length, shift = len(_SCRIPT_TAG), 0, 0
    while True:
        byte = request[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return request[pos : pos + length]


# Methods cpushim has no schema for (a newer CRI's calls): the relay must pass them too.
FUTURE_UNARY = "/runtime.v1.RuntimeService/FutureUnaryCall"
FUTURE_STREAM = "/runtime.v1.RuntimeService/StreamFutureThings"


_EMPTY_LISTS = ("/ListPodSandbox", "/ListContainers")


class RawCodec(CodecBase):
    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


class RawDetailsCodec(StatusDetailsCodecBase):
    def encode(self, status: Status, message: str | None, details: Any) -> bytes:
        return bytes(details)

    def decode(self, status: Status, message: str | None, data: bytes) -> Any:
        return data


class FakeRuntime:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, dict[str, str]]] = []
        self.deadlines: dict[bytes, float | None] = {}  # request -> seconds left on arrival
        self.wire: list[tuple[str, bytes]] = []  # requests exactly as they arrived
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's (set when it starts)
        self._held: dict[bytes, threading.Event] = {}  # hold name -> a call has been held
        self._released: dict[bytes, asyncio.Event] = {}  # hold name -> let go (the loop's)

    def wait_held(self, name: bytes, timeout: float = 10.0) -> None:
        """Return once a call scripted ``hold:<name>`` has been held (from any thread)."""
        if not self._held.setdefault(name, threading.Event()).wait(timeout):
            raise TimeoutError(f"no call held as {name!r} within {timeout}s")

    def release(self, name: bytes) -> None:
        """Let the calls held as ``name`` answer, and later ones pass (from any thread)."""
        assert self.loop is not None, "the server has not started"
        self.loop.call_soon_threadsafe(lambda: self._gate(name).set())

    def _gate(self, name: bytes) -> asyncio.Event:
        return self._released.setdefault(name, asyncio.Event())

    async def _hold(self, name: bytes) -> None:
        gate = self._gate(name)
        self._held.setdefault(name, threading.Event()).set()
        await gate.wait()

    def __mapping__(self) -> dict[str, Handler]:
        methods = [(m.path, m.server_streaming) for m in ALL_METHODS]
        methods += [(FUTURE_UNARY, False), (FUTURE_STREAM, True)]
        mapping = {}
        for path, streaming in methods:
            if streaming:
                mapping[path] = Handler(
                    self._streaming(path), Cardinality.UNARY_STREAM, bytes, bytes
                )
            else:
                mapping[path] = Handler(self._unary(path), Cardinality.UNARY_UNARY, bytes, bytes)
        return mapping

    def _unary(self, path: str) -> Any:
        async def handle(stream: Stream[bytes, bytes]) -> None:
            wire = await stream.recv_message()
            assert wire is not None
            self.wire.append((path, wire))
            request = command_of(wire)
            metadata = {k: str(v) for k, v in stream.metadata.items()} if stream.metadata else {}
            self.calls.append((path, request, metadata))
            self.deadlines[request] = (
                stream.deadline.time_remaining() if stream.deadline is not None else None
            )
            if request.startswith(b"error:"):
                _, code, message = request.split(b":", 2)
                raise GRPCError(Status(int(code)), message.decode(), DETAILS)
            if request.startswith(b"sleep:"):
                await asyncio.sleep(float(request[6:]))
            if request.startswith(b"hold:"):
                await self._hold(request[5:])
            if request.startswith(b"big:"):
                await stream.send_message(b"x" * int(request[4:]))
                return
            if request == b"meta":
                echoed = {k: v for k, v in metadata.items() if k.startswith("x-")}
                await stream.send_initial_metadata(metadata=echoed)
                await stream.send_message(b"meta-reply")
                await stream.send_trailing_metadata(metadata={"x-trailer": "t1", **echoed})
                return
            if not request and path.endswith(_EMPTY_LISTS):
                # What cpushim's start-up resync asks: a runtime with nothing in it.
                await stream.send_message(b"")
                return
            await stream.send_message(b"reply-to:" + path.encode() + b":" + request)

        return handle

    def _streaming(self, path: str) -> Any:
        async def handle(stream: Stream[bytes, bytes]) -> None:
            wire = await stream.recv_message()
            assert wire is not None
            request = command_of(wire)
            self.calls.append((path, request, {}))
            hold = None
            if request.startswith(b"stream:") and b":hold:" in request:
                request, hold = request.split(b":hold:", 1)
            count = int(request[7:].rstrip(b"!")) if request.startswith(b"stream:") else 3
            for i in range(count):
                await stream.send_message(b"event-%d" % i)
            if hold is not None:
                await self._hold(hold)
            if request.endswith(b"!"):
                raise GRPCError(Status.ABORTED, "stream aborted", DETAILS)

        return handle


class FakeRuntimeServer:
    """The fake runtime listening on a unix socket; start/stop may be repeated."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.runtime = FakeRuntime()
        self._server: Server | None = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket_path}"

    async def start(self) -> None:
        self.runtime.loop = asyncio.get_running_loop()
        self._server = Server(
            [self.runtime], codec=RawCodec(), status_details_codec=RawDetailsCodec()
        )
        await self._server.start(path=str(self.socket_path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()


class CountingFakeRuntime(FakeRuntime):
    """A :class:`FakeRuntime` that counts its handlers while they run, however they end
    (answered, failed, or cancelled by the client's reset or at the call's deadline): once
    none runs, every call that reached it has been answered (grpclib writes the trailers as
    the handler returns) or dropped, and no late answer is still to come."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0  # one int, so another thread reads it whole

    def _counted(self, handle: Any) -> Any:
        async def counted(stream: Stream[bytes, bytes]) -> None:
            self.running += 1
            try:
                await handle(stream)
            finally:
                self.running -= 1

        return counted

    def _unary(self, path: str) -> Any:
        return self._counted(super()._unary(path))

    def _streaming(self, path: str) -> Any:
        return self._counted(super()._streaming(path))


@contextlib.contextmanager
def short_tmpdir() -> Iterator[Path]:
    """A temp dir with a short path: unix socket paths are limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="cs-", dir="/tmp") as name:
        yield Path(name)


async def _serve_forever(socket_path: Path) -> None:
    server = FakeRuntimeServer(socket_path)
    await server.start()
    print("serving", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    # A fake runtime in its own process, so a test can kill it the way a runtime crashes.
    import sys

    asyncio.run(_serve_forever(Path(sys.argv[1])))
