"""The relay's I/O: the listening socket, and per client connection one upstream connection
with a :class:`~shim.cri.splice.Splice` between them."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import grp
import logging
import os
import socket
import stat
import sys
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from shim.cri.calls import Reply, Status, UnaryCall, frame_message
from shim.cri.splice import (
    CallAborted,
    CallCancelled,
    CallCompleted,
    CallObserver,
    CallReceived,
    ConnectionFailed,
    Event,
    Splice,
)
from shim.cri.upstream import (
    ChannelForward,
    Forward,
    ForwardedTwiceError,
    ReplySeen,
    RuntimeChannel,
    backlog_hint,
    connect_unix,
    reply_seen,
    unix_path,
)

log = logging.getLogger(__name__)

# asyncio's socket transport from Python 3.12 sends a list with sendmsg and, unlike write(),
# never pauses its protocol however much it buffers: a peer that reads nothing would have the
# relay buffer its frames without limit. Such a transport gets them joined, through write().
_WRITELINES_SKIPS_FLOW_CONTROL = sys.version_info >= (3, 12)


def send_frames(transport: asyncio.WriteTransport, chunks: Sequence[bytes]) -> None:
    """Write ``chunks`` in order, the transport's flow control (pause_writing) kept."""
    if _WRITELINES_SKIPS_FLOW_CONTROL and type(transport).__module__ == "asyncio.selector_events":
        transport.write(b"".join(chunks))
    else:
        transport.writelines(chunks)


class Interceptor(Protocol):
    """Where cpushim hooks into the CRI: which calls it answers itself, and how."""

    def intercepts(self, path: str) -> bool: ...

    def amends(self, path: str) -> bool:
        """Of the intercepted calls, those that go on to the runtime on the client's own
        stream (their request held until :meth:`handle` forwards it) rather than on the
        relay's own channel: a decision that changes a request costs no second HTTP/2 call."""

    async def handle(self, call: UnaryCall, forward: Forward) -> Reply:
        """Answer ``call``, calling ``forward`` (at most once) to pass it on. Once it is
        forwarded, the runtime's reply is what the client gets."""


# Work a follower leaves for after the call's reply has gone to the client.
Afterwards = Callable[[], object] | None


class Pending(enum.Enum):
    """A follower's answer when a call cannot be followed at once (see ``followed_now``)."""

    LATER = "later"


class Follower(Protocol):
    """Learns the outcome of spliced calls before the client does: the call passes through
    untouched, but its trailers wait until :meth:`followed` returns. For calls where cpushim
    has work to do once the runtime has answered (a stopped container's CPUs go back before
    StopContainer returns) without changing the request, at the splice's cost rather than
    that of a second HTTP/2 call."""

    def follows(self, path: str) -> bool: ...

    def followed_now(
        self, path: str, request: bytes | None, status: int | None, response: bytes | None
    ) -> Afterwards | Pending:
        """:meth:`followed`, done at once when it can be done without waiting (its result),
        else ``Pending.LATER`` and nothing done: then :meth:`followed` is called. Most calls
        need no more than a note in memory, and this saves them a few trips round the loop
        with their reply held."""

    async def followed(
        self, path: str, request: bytes | None, status: int | None, response: bytes | None
    ) -> Afterwards:
        """``request`` and ``response`` are the call's messages, None when unreadable. What
        it returns is called once the reply's end has been handed to the client: work that
        must not hold the reply up, nor compete with it."""


class AlreadyServingError(RuntimeError):
    pass


def prepare_socket_path(path: str) -> None:
    """Create the parent directory (0750) and clear a stale socket; refuse a live one."""
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o750, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AlreadyServingError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket", extra={"fields": {"path": path}})
        os.unlink(path)
        return
    except OSError as exc:
        raise AlreadyServingError(f"cannot probe existing socket {path}: {exc}") from exc
    finally:
        probe.close()
    raise AlreadyServingError(f"another process already serves {path}; refusing to start")


def open_directory_to_group(directory: str, gid: int) -> None:
    """Let the members of ``gid`` through ``directory`` to the socket in it: connecting
    needs search permission on the directory as well as write permission on the socket.
    Only a directory that nobody gave a group of its own (owned by this process's user and
    group, as systemd's RuntimeDirectory= and :func:`prepare_socket_path` make it) takes
    the socket's group; any other that keeps the group out is left as it is, with a
    warning."""
    info = os.stat(directory)
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_IXOTH or (info.st_gid == gid and mode & stat.S_IXGRP):
        return
    fields = {"directory": directory, "group": grp.getgrgid(gid).gr_name}
    if info.st_uid != os.geteuid() or info.st_gid not in (os.getegid(), gid):
        log.warning(
            "the socket's directory keeps the socket's group out: its members cannot connect",
            extra={"fields": {**fields, "mode": f"{mode:04o}"}},
        )
        return
    os.chown(directory, -1, gid)
    os.chmod(directory, mode | stat.S_IXGRP)
    log.info("gave the socket's group search access to its directory", extra={"fields": fields})


class RelayServer:
    def __init__(
        self,
        *,
        listen: str,
        runtime_endpoint: str,
        interceptor: Interceptor,
        socket_group: str | None = None,
        socket_mode: int = 0o660,
        runtime: RuntimeChannel | None = None,
        observer: CallObserver | None = None,
        follower: Follower | None = None,
    ) -> None:
        self.listen_path = unix_path(listen)
        self.runtime_path = unix_path(runtime_endpoint)
        # The relay's own channel; the engine shares it for the calls it makes itself.
        self.runtime = runtime if runtime is not None else RuntimeChannel(runtime_endpoint)
        self._owns_runtime = runtime is None
        self.interceptor = interceptor
        # Told of each call's end (metrics); None costs the splice nothing.
        self.observer = observer
        self.follower = follower
        self._socket_group = socket_group
        self._socket_mode = socket_mode
        self._server: asyncio.AbstractServer | None = None
        self.connections: set[ClientConnection] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def check_listen_path(self) -> None:
        """Make the socket's directory and clear a stale socket; AlreadyServingError when
        the path is another process's (``start`` checks again)."""
        prepare_socket_path(self.listen_path)

    async def start(self) -> None:
        prepare_socket_path(self.listen_path)
        gid = -1
        if self._socket_group is not None:
            try:
                gid = grp.getgrnam(self._socket_group).gr_gid
            except KeyError as exc:
                raise ValueError(f"socket group {self._socket_group!r} does not exist") from exc
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # no window in which the socket is wider than asked
        try:
            self._server = await loop.create_unix_server(
                lambda: ClientConnection(self), self.listen_path, backlog=256
            )
        finally:
            os.umask(old_umask)
        if gid != -1:
            os.chown(self.listen_path, -1, gid)
        os.chmod(self.listen_path, self._socket_mode)
        if gid != -1:
            open_directory_to_group(os.path.dirname(self.listen_path) or ".", gid)

    def _connection_opened(self, conn: ClientConnection) -> None:
        self.connections.add(conn)
        self._idle.clear()

    def _connection_closed(self, conn: ClientConnection) -> None:
        self.connections.discard(conn)
        if not self.connections:
            self._idle.set()

    async def shutdown(self, grace: float, cut_short: asyncio.Event | None = None) -> bool:
        """Stop accepting, let calls in flight finish for up to ``grace`` seconds (less if
        ``cut_short`` is set meanwhile), then close every connection. True if everything
        finished in time."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.begin_shutdown()
        waits = [asyncio.ensure_future(self._idle.wait())]
        if cut_short is not None:
            waits.append(asyncio.ensure_future(cut_short.wait()))
        try:
            await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        finished = self._idle.is_set()
        if not finished:
            log.warning(
                "calls still in flight at the end of the shutdown grace period"
                if cut_short is None or not cut_short.is_set()
                else "shutdown grace period cut short; calls still in flight",
                extra={"fields": {"connections": len(self.connections), "grace_s": grace}},
            )
        # What is still queued for a client now is dropped: a close that waits to write it
        # waits for ever on a client that stopped reading (and Server.wait_closed with it).
        for conn in list(self.connections):
            conn.drop()
        if self.connections:
            # Each is told it is lost on the loop's next turn.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_DROP_WAIT):
                    await self._idle.wait()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        if self._owns_runtime:
            self.runtime.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.listen_path)
        return finished


class ClientConnection(asyncio.Protocol):
    """One kubelet connection and its twin connection to the runtime."""

    def __init__(self, server: RelayServer) -> None:
        self.server = server
        follower = server.follower
        self.splice = Splice(
            server.interceptor.intercepts,
            observer=server.observer,
            followed=follower.follows if follower is not None else None,
            amended=server.interceptor.amends,
        )
        self._following: set[asyncio.Task[None]] = set()
        self._forwards: dict[int, StreamForward] = {}
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self._early: list[bytes] = []
        self._connecting = True
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._shutting_down = False
        # Told to go away, its last call done: writing has ended (see _finish).
        self._finishing = False
        # Closes a connection told to go away whose client keeps its end open (_finish).
        self._linger: asyncio.TimerHandle | None = None
        # Closed by this side (abort): what follows is not news to log.
        self._aborting = False
        # Drops a closed connection whose client does not read what is queued (abort).
        self._stalled: asyncio.TimerHandle | None = None
        # Armed when the runtime is lost while replies wait for the client's credit.
        self._unread: asyncio.TimerHandle | None = None
        # Reads from the client so far: whether it still talks (gives credit) at all.
        self._client_reads = 0
        self._client_reads_at_arm = 0
        self._closed = False
        # Writes back up: to the client (it reads nothing), to the runtime (the same).
        self._client_full = False
        self._upstream_full = False
        self._blocks_self_contained = False
        # What each call is answered when the relay serves the connection itself (the
        # splice's ``upstream_absent``): why the runtime cannot be had.
        self.unavailable_message = ""

    # client side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not isinstance: uvloop's stream transports do not subclass asyncio's.
        self.client = cast(asyncio.Transport, transport)
        self.server._connection_opened(self)
        asyncio.get_running_loop().create_task(self._connect_upstream())

    async def _connect_upstream(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_unix_connection(
                lambda: UpstreamConnection(self), sock=connect_unix(self.server.runtime_path)
            )
        except OSError as exc:
            if self._closed or self._finishing:
                return  # no call of this connection's will be answered now
            hint = backlog_hint(exc)
            reason = f"{self.server.runtime.endpoint}: {exc.strerror or exc}{hint}"
            self.unavailable_message = f"cpushim: runtime {reason} is unavailable"
            log.warning(
                "runtime unreachable; answering this connection's calls with UNAVAILABLE",
                extra={
                    "fields": {"runtime": self.server.runtime.endpoint, "error": f"{exc}{hint}"}
                },
            )
            self.splice.serve_without_upstream()
        else:
            if self._closed or self._finishing:
                transport.close()
                return
            self.upstream = transport
        self._connecting = False
        early, self._early = self._early, []
        for chunk in early:
            self.splice.from_client(chunk)
        self._flush()

    def data_received(self, data: bytes) -> None:
        if self._finishing:
            return  # what a client sends while it reads its last replies needs no answer
        self._client_reads += 1
        if self._connecting:
            self._early.append(data)
            return
        self.splice.from_client(data)
        if not self._blocks_self_contained and self.splice.client_blocks_self_contained:
            self._blocks_self_contained = True
            log.debug("client header blocks are self-contained (HPACK table size 0 applied)")
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        for timer in (self._linger, self._stalled, self._unread):
            if timer is not None:
                timer.cancel()
        for task in self._calls.values():
            task.cancel()
        for forward in list(self._forwards.values()):
            forward.ended(Reply.no_answer(Status.UNAVAILABLE, "cpushim: the client went away"))
        if self.upstream is not None:
            self.upstream.close()
        self.server._connection_closed(self)

    def pause_writing(self) -> None:
        self._client_full = True
        if self.upstream is not None:
            self.upstream.pause_reading()
        self._steer_client_reading()

    def resume_writing(self) -> None:
        self._client_full = False
        if self.upstream is not None:
            self.upstream.resume_reading()
        self._steer_client_reading()

    def _steer_client_reading(self) -> None:
        """Read from the client unless what it sends cannot go anywhere: the runtime reads
        nothing, or, with no runtime connection, the client itself reads nothing. The relay
        then answers its PINGs, SETTINGS and calls itself, and a client that sends those and
        reads nothing would have the answers queued here without limit."""
        if self.client is None:
            return
        if self._upstream_full or (self._client_full and self.upstream is None):
            self.client.pause_reading()
        else:
            self.client.resume_reading()

    # upstream side
    def upstream_data(self, data: bytes) -> None:
        self.splice.from_upstream(data)
        self._flush()

    def upstream_lost(self, exc: Exception | None) -> None:
        self.upstream = None
        # A runtime that stopped reading paused the client's reading (pause_writing):
        # nothing would resume it now, and the client's credit for the replies still to go
        # would never be read.
        self._upstream_full = False
        self._steer_client_reading()
        if self._closed or self._finishing or self._aborting:
            return  # closed by this side
        reason = str(exc) if exc else "connection closed by the runtime"
        self.splice.upstream_lost(reason)
        fields = {"runtime": self.server.runtime.endpoint, "error": reason}
        if self.splice.upstream_absent:
            log.warning(
                "runtime connection lost before the runtime said anything; answering this"
                " connection's calls with UNAVAILABLE",
                extra={"fields": fields},
            )
            self.unavailable_message = (
                "cpushim: lost the connection to the runtime"
                f" {self.server.runtime.endpoint} before it answered: {reason}"
            )
        else:
            log.warning("runtime connection lost", extra={"fields": fields})
        if self.splice.going_away:
            self._shutting_down = True
        self._flush()
        if not self.splice.idle and not self._closed and self._unread is None:
            # Replies wait for the client's credit; a client that never gives it would
            # keep the connection (and them) for as long as it lives.
            self._arm_unread()

    def _arm_unread(self) -> None:
        self._client_reads_at_arm = self._client_reads
        loop = asyncio.get_running_loop()
        self._unread = loop.call_later(_STALLED_CLIENT, self._give_up_unread)

    def _give_up_unread(self) -> None:
        """Let the client go when replies still wait for credit and it sent nothing for
        ``_STALLED_CLIENT`` seconds; a client that reads, or calls still being answered,
        are given another period."""
        self._unread = None
        if self._closed or self._finishing or self._aborting or self.splice.idle:
            return
        if not self.splice.waiting_for_credit or self._client_reads != self._client_reads_at_arm:
            self._arm_unread()
            return
        log.warning(
            "closing a client connection that did not read the replies left when the runtime"
            " connection was lost",
            extra={"fields": {"waited_s": _STALLED_CLIENT}},
        )
        self.abort()

    # plumbing
    def _flush(self) -> None:
        """Act on the splice's events, then write what it has for both sides. Events first:
        a followed call the engine follows at once has its held trailers released here, and
        they go to the client in the same write as the reply's other frames, one send and
        one wake-up of the client instead of two."""
        afterwards: list[tuple[str, Callable[[], object]]] = []
        failed = False
        while not failed:
            events = self.splice.take_events()
            if not events:
                break
            failed = self._handle_events(events, afterwards)
        to_client, to_upstream = self.splice.take_output()
        # A closing transport must not be written to (Python 3.13 fails on it).
        if to_upstream and self.upstream is not None and not self.upstream.is_closing():
            send_frames(self.upstream, to_upstream)
        if (
            to_client
            and self.client is not None
            and not self.client.is_closing()
            and not self._finishing
        ):
            send_frames(self.client, to_client)
        if failed:
            self.abort()
        elif self._shutting_down and self.splice.idle:
            self._finish()
        # Work the follower left for after the reply runs even when the connection closes.
        for path, work in afterwards:
            self._run_afterwards(path, work)

    def _handle_events(
        self, events: list[Event], afterwards: list[tuple[str, Callable[[], object]]]
    ) -> bool:
        """Act on the splice's events; True when the connection failed and must close."""
        for event in events:
            if isinstance(event, CallReceived):
                forward: Forward
                if event.amended:
                    forward = self._forwards[event.stream_id] = StreamForward(
                        self, event.stream_id, event.call
                    )
                else:
                    forward = ChannelForward(self.server.runtime, event.call)
                task = asyncio.get_running_loop().create_task(
                    self._answer(event.stream_id, event.call, forward)
                )
                self._calls[event.stream_id] = task
            elif isinstance(event, CallCompleted):
                amended = self._forwards.get(event.stream_id)
                if amended is not None:
                    outcome = _outcome(event)
                    if amended.seen_now(outcome):
                        # The handler is done with the reply: its end goes to the client in
                        # this write, with the rest of it, not once the handler returns.
                        self.splice.release(event.stream_id)
                    amended.ended(outcome)
                    continue
                follower = self.server.follower
                if follower is not None and not follower.follows(event.path):
                    # The late reply to an amended call whose handler gave up waiting for
                    # it: nobody follows that path, and its request is not kept.
                    self.splice.release(event.stream_id)
                    continue
                if self._follow_now(event, afterwards):
                    continue
                task = asyncio.get_running_loop().create_task(self._follow(event))
                self._following.add(task)
                task.add_done_callback(self._following.discard)
            elif isinstance(event, CallAborted):
                amended = self._forwards.get(event.stream_id)
                if amended is not None:
                    message = "cpushim: the call ended without a reply"
                    amended.ended(
                        Reply.error(event.status, message)
                        if event.unprocessed
                        else Reply.no_answer(event.status, message)
                    )
            elif isinstance(event, CallCancelled):
                task_to_cancel = self._calls.pop(event.stream_id, None)
                if task_to_cancel is not None:
                    task_to_cancel.cancel()
                # Not yet sent, so it never will be: its forward finds the stream gone.
                self._forwards.pop(event.stream_id, None)
            elif isinstance(event, ConnectionFailed):
                log.warning("closing client connection", extra={"fields": {"reason": event.reason}})
                return True
        return False

    def _follow_now(
        self, event: CallCompleted, afterwards: list[tuple[str, Callable[[], object]]]
    ) -> bool:
        """Follow the call at once if the follower can; True when its reply was released."""
        follower = self.server.follower
        try:
            if follower is None:
                result: Afterwards | Pending = None
            else:
                result = follower.followed_now(
                    event.path, event.request, event.status, event.response
                )
        except Exception:
            log.exception("following a call failed", extra={"fields": {"path": event.path}})
            result = None
        if result is Pending.LATER:
            return False
        self.splice.release(event.stream_id)
        if result is not None:
            afterwards.append((event.path, result))
        return True

    def _run_afterwards(self, path: str, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception:
            log.exception("work after a reply failed", extra={"fields": {"path": path}})

    async def _answer(self, sid: int, call: UnaryCall, forward: Forward) -> None:
        try:
            if self.splice.upstream_absent:
                reply = Reply.error(Status.UNAVAILABLE, self.unavailable_message)
            else:
                reply = await self.server.interceptor.handle(call, forward)
        except asyncio.CancelledError:
            self._calls.pop(sid, None)
            # The interceptor's work may go on (it is shielded): a forward not yet made finds
            # its stream gone; one under way is still told its outcome (StreamForward.ended).
            if not forward.sent:
                self._forwards.pop(sid, None)
            raise
        except Exception as exc:
            log.exception("intercepted call failed", extra={"fields": {"path": call.path}})
            reply = Reply.error(Status.INTERNAL, f"cpushim: {call.path} failed: {exc}")
        self._calls.pop(sid, None)
        self._forwards.pop(sid, None)
        if isinstance(forward, StreamForward) and forward.sent:
            # The runtime's reply is on its way to the client already; its trailers waited.
            self.splice.release(sid)
        else:
            self.splice.reply(sid, reply)
        if self.splice.upstream_absent:
            # Send the client to a new connection for its next call, where the runtime
            # is tried again.
            self.splice.goaway()
            self._shutting_down = True
        self._flush()

    async def _follow(self, event: CallCompleted) -> None:
        follower = self.server.follower
        afterwards = None
        try:
            if follower is not None:
                afterwards = await follower.followed(
                    event.path, event.request, event.status, event.response
                )
        except Exception:
            log.exception("following a call failed", extra={"fields": {"path": event.path}})
        finally:
            self.splice.release(event.stream_id)
            self._flush()
        if afterwards is not None:
            self._run_afterwards(event.path, afterwards)

    def begin_shutdown(self) -> None:
        self._shutting_down = True
        self.splice.goaway()
        self._flush()

    def _finish(self) -> None:
        """Close a connection told to go away once its last call is done: the upstream at
        once, the client's once the client has read everything. Closing it outright while
        the client still writes (a WINDOW_UPDATE for the reply it is reading) fails that
        write with EPIPE, and a client may then fail a call whose whole reply it holds
        (grpcio: "Stream removed"). So writing ends here (EOF after what is queued) and the
        socket closes when the client closes its end, or after ``_LINGER`` seconds
        (:meth:`abort`)."""
        if self._finishing:
            return
        client = self.client
        if client is None or client.is_closing() or not client.can_write_eof():
            self.abort()
            return
        self._finishing = True
        if self.upstream is not None:
            self.upstream.close()
        client.write_eof()
        self._linger = asyncio.get_running_loop().call_later(_LINGER, self.abort)

    def abort(self) -> None:
        """Close both sides after what is queued has been written, and drop the client's
        side with it if it is still queued ``_STALLED_CLIENT`` seconds after the first close:
        a client that reads nothing would otherwise hold the socket and its replies for as
        long as it lives, outside shutdown too (the runtime's connection lost, a connection
        that failed)."""
        self._aborting = True
        if self.client is not None:
            self.client.close()
            if not self._closed and self._stalled is None:
                loop = asyncio.get_running_loop()
                self._stalled = loop.call_later(_STALLED_CLIENT, self._drop_stalled)
        if self.upstream is not None:
            self.upstream.close()

    def _drop_stalled(self) -> None:
        queued = self.client.get_write_buffer_size() if self.client is not None else 0
        log.warning(
            "dropping a closed client connection that did not read its last replies",
            extra={"fields": {"queued_bytes": queued, "waited_s": _STALLED_CLIENT}},
        )
        self.drop()

    def drop(self) -> None:
        """Close both sides now, dropping whatever is still queued for them."""
        if self.client is not None:
            self.client.abort()
        if self.upstream is not None:
            self.upstream.abort()


# How long a client told to go away may keep its end open after its last reply.
_LINGER = 1.0
# How long a closing connection's replies may stay queued for a client that reads nothing.
_STALLED_CLIENT = 10.0
# How long shutdown waits for the connections it dropped to be gone.
_DROP_WAIT = 1.0
# How long past a forwarded call's deadline its reply is still waited for.
_DEADLINE_GRACE = 5.0


class StreamForward:
    """Forwards an amended call on its own stream: the request goes where the call's HEADERS
    already went, and the runtime's reply passes to the client as it comes, all but its
    trailers, which wait for the handler to return (or for its ``seen`` hook's word)."""

    def __init__(self, connection: ClientConnection, stream_id: int, call: UnaryCall) -> None:
        self._connection = connection
        self._stream_id = stream_id
        self._call = call
        loop = asyncio.get_running_loop()
        self._outcome: asyncio.Future[Reply] = loop.create_future()
        # The call's deadline runs from its arrival (made with it, as its HEADERS came).
        self._arrived = loop.time()
        self._seen: ReplySeen | None = None
        self.sent = False
        self.reply: Reply | None = None

    async def __call__(
        self, request: bytes | None = None, *, seen: ReplySeen | None = None
    ) -> Reply:
        if self.sent:
            raise ForwardedTwiceError(f"{self._call.path} was already forwarded")
        body = frame_message(self._call.request if request is None else request)
        connection = self._connection
        if connection._closed or not connection.splice.forward_request(self._stream_id, body):
            return Reply.error(
                Status.CANCELLED, f"cpushim: {self._call.path} ended before it was forwarded"
            )
        self.sent = True
        self._seen = seen
        connection._flush()
        if self._call.timeout is None:
            self.reply = await self._outcome
            return self.reply
        # The runtime ends the call at its deadline; this bounds the wait should the reply
        # be stuck behind a client that stopped reading (the engine holds its lock here).
        try:
            async with asyncio.timeout_at(self._arrived + self._call.timeout + _DEADLINE_GRACE):
                self.reply = await asyncio.shield(self._outcome)
        except TimeoutError:
            self._seen = None  # a reply that comes now is no longer the handler's to see
            self.reply = Reply.no_answer(
                Status.DEADLINE_EXCEEDED, f"cpushim: no reply to {self._call.path} in time"
            )
        return self.reply

    def seen_now(self, reply: Reply) -> bool:
        """Hand the runtime's reply to the handler's ``seen`` hook, if it gave one and is
        still waiting (not past its deadline); True when the client may have the reply's end
        now."""
        seen, self._seen = self._seen, None
        if seen is None or self._outcome.done():
            return False
        return reply_seen(seen, reply, self._call.path)

    def ended(self, reply: Reply) -> None:
        """The runtime's answer, or what stands for it when there will be none."""
        self._connection._forwards.pop(self._stream_id, None)
        if not self._outcome.done():
            self._outcome.set_result(reply)


def _outcome(event: CallCompleted) -> Reply:
    """An amended call's reply, as the handler sees it (the client gets the runtime's)."""
    status = event.status if event.status is not None else Status.UNKNOWN
    trailers = event.trailers or ((b"grpc-status", str(int(status)).encode()),)
    messages = (event.response,) if event.response is not None else ()
    return Reply(trailers=trailers, headers=(), messages=messages)


class UpstreamConnection(asyncio.Protocol):
    def __init__(self, owner: ClientConnection) -> None:
        self.owner = owner

    def data_received(self, data: bytes) -> None:
        self.owner.upstream_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.upstream_lost(exc)

    def pause_writing(self) -> None:
        self.owner._upstream_full = True
        self.owner._steer_client_reading()

    def resume_writing(self) -> None:
        self.owner._upstream_full = False
        self.owner._steer_client_reading()
