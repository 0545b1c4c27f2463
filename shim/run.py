"""``cpushim run``: wait for the runtime, serve the CRI socket, shut down cleanly on a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.passthrough import PassthroughInterceptor
from shim.cri.server import Interceptor, RelayServer
from shim.cri.upstream import RuntimeChannel

log = logging.getLogger("shim.run")

IMAGE_SERVICE_PREFIX = "/runtime.v1.ImageService/"
VERSION_PATH = "/runtime.v1.RuntimeService/Version"


@dataclass(frozen=True)
class RunOptions:
    listen: str
    runtime_endpoint: str
    image_endpoint: str
    socket_group: str | None
    upstream_wait: float
    shutdown_grace: float


class SeparateImageService:
    """Routes ImageService calls to their own endpoint when it is not the runtime's: they are
    answered by the relay over a channel to that endpoint (they are all unary)."""

    def __init__(self, inner: Interceptor, image_channel: RuntimeChannel) -> None:
        self._inner = inner
        self._images = image_channel

    def intercepts(self, path: str) -> bool:
        return path.startswith(IMAGE_SERVICE_PREFIX) or self._inner.intercepts(path)

    async def handle(self, call: UnaryCall, runtime: RuntimeChannel) -> Reply:
        if call.path.startswith(IMAGE_SERVICE_PREFIX):
            return await self._images.unary(call)
        return await self._inner.handle(call, runtime)


async def wait_for_runtime(channel: RuntimeChannel, budget: float) -> Reply:
    """Version calls with backoff until the runtime answers or ``budget`` seconds pass."""
    deadline = time.monotonic() + budget
    delay, attempt = 0.1, 0
    probe = UnaryCall(path=VERSION_PATH, headers=(), request=b"", timeout=5.0)
    while True:
        attempt += 1
        reply = await channel.unary(probe)
        if reply.status is Status.OK:
            return reply
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(
                f"runtime {channel.endpoint} did not answer within {budget:g}s "
                f"({attempt} attempts); last error: {reply.status.name}: {reply.status_message}"
            )
        log.info(
            "waiting for the runtime",
            extra={
                "fields": {
                    "runtime": channel.endpoint,
                    "attempt": attempt,
                    "error": reply.status_message,
                    "retry_in_s": round(delay, 2),
                }
            },
        )
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 2, 2.0)


async def run(options: RunOptions) -> int:
    interceptor: Interceptor = PassthroughInterceptor()
    image_channel: RuntimeChannel | None = None
    if options.image_endpoint != options.runtime_endpoint:
        image_channel = RuntimeChannel(options.image_endpoint)
        interceptor = SeparateImageService(interceptor, image_channel)
    server = RelayServer(
        listen=options.listen,
        runtime_endpoint=options.runtime_endpoint,
        interceptor=interceptor,
        socket_group=options.socket_group,
    )
    version = await wait_for_runtime(server.runtime, options.upstream_wait)
    await server.start()
    log.info(
        "serving",
        extra={
            "fields": {
                "listen": options.listen,
                "runtime": options.runtime_endpoint,
                "image": options.image_endpoint,
                "runtime_reply_bytes": sum(len(m) for m in version.messages),
            }
        },
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down", extra={"fields": {"grace_s": options.shutdown_grace}})
    finished = await server.shutdown(options.shutdown_grace)
    if image_channel is not None:
        image_channel.close()
    log.info("stopped", extra={"fields": {"calls_finished": finished}})
    return 0
