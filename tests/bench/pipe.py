"""A plain byte pipe between two unix sockets: the floor any relay process pays.

    python -m tests.bench.pipe LISTEN_PATH UPSTREAM_PATH [uvloop|asyncio]

No HTTP/2 parsing at all (so it could intercept nothing); the relay benchmark runs it beside
cpushim to show how much of cpushim's added latency is the extra process hop itself.
"""

from __future__ import annotations

import asyncio
import sys
from typing import cast


class Half(asyncio.Protocol):
    def __init__(self) -> None:
        self.peer: Half | None = None
        self.transport: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


async def serve(listen: str, upstream: str) -> None:
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    def accept() -> Half:
        client = Half()

        async def connect() -> None:
            _, up = await loop.create_unix_connection(Half, upstream)
            up.peer, client.peer = client, up
            # Either side may have spoken before the two were linked (the runtime sends its
            # SETTINGS at once).
            for half in (client, up):
                assert half.peer is not None
                assert half.peer.transport is not None
                for chunk in half.early:
                    half.peer.transport.write(chunk)
                half.early.clear()

        tasks.add(loop.create_task(connect()))
        return client

    server = await loop.create_unix_server(accept, listen)
    print("serving", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[3] == "uvloop":
        import uvloop

        uvloop.run(serve(sys.argv[1], sys.argv[2]))
    else:
        asyncio.run(serve(sys.argv[1], sys.argv[2]))
