"""The frame splice: one client HTTP/2 connection relayed onto one upstream connection.

Sans-I/O: bytes go in through :meth:`Splice.from_client` / :meth:`Splice.from_upstream`, bytes to
write come out of :meth:`Splice.take_output`, and calls the relay answers itself come out as
:class:`CallReceived` events. The asyncio adapter in :mod:`shim.cri.server` does the I/O.

Frames pass verbatim, so stream ids, HPACK state, settings and flow control are the two peers'
own, with three exceptions, each accounted for:

* SETTINGS frames in both directions are rewritten to ``HEADER_TABLE_SIZE = 0``, so header
  blocks become self-contained and the relay may drop or write whole blocks.
* Intercepted calls are terminated here: their frames are not forwarded, the relay returns
  the client's flow-control credit for the request bytes it consumed, and writes the reply.
* Reply bytes the relay writes use up the client's connection window behind the upstream's
  back; that much of the client's later WINDOW_UPDATE credit is kept from the upstream, and
  upstream DATA that would overrun the client's real window waits here until credit arrives.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from shim.cri import frames as fr
from shim.cri.calls import (
    MessageError,
    Reply,
    Status,
    UnaryCall,
    frame_message,
    parse_timeout,
    unframe_messages,
)
from shim.cri.hpack_blocks import (
    Header,
    HeaderBlockError,
    RequestBlockReader,
    block_value,
    decode_block,
    encode_block,
    grpc_status,
    header_value,
)

DEFAULT_MAX_REQUEST = 16 * 1024 * 1024
_CLOSED_LOCAL_MEMORY = 1024


def _with_pending(pending: bytearray, data: bytes) -> bytes | bytearray:
    """What to parse: usually a read holds whole frames, so the bytes object itself is parsed
    and a read forwarded whole goes on as the very same object, never copied."""
    if pending:
        pending += data
        return pending
    return data


def _pending_after(buf: bytes | bytearray, pos: int) -> bytearray:
    """The partial frame left after ``pos``, kept for the next read."""
    return bytearray(buf[pos:]) if pos < len(buf) else bytearray()


def _forward(out: list[bytes], buf: bytes | bytearray, start: int, stop: int) -> None:
    """Queue ``buf[start:stop]`` verbatim; a whole read is queued as the same object."""
    if stop <= start:
        return
    if start == 0 and stop == len(buf) and isinstance(buf, bytes):
        out.append(buf)
    else:
        out.append(bytes(memoryview(buf)[start:stop]))


@dataclass(frozen=True)
class CallReceived:
    stream_id: int
    call: UnaryCall


@dataclass(frozen=True)
class CallCancelled:
    stream_id: int


@dataclass(frozen=True)
class CallCompleted:
    """A followed call's response has ended upstream; its trailers wait here until the adapter
    calls :meth:`Splice.release`. ``request`` and ``response`` are the call's messages (None
    when one could not be read: an unknown encoding, too large, or not one message);
    ``status`` the gRPC status of the trailers (None when they carried none)."""

    stream_id: int
    path: str
    request: bytes | None
    status: int | None
    response: bytes | None = None


@dataclass(frozen=True)
class ConnectionFailed:
    """The client broke HTTP/2; the adapter closes the connection after flushing."""

    reason: str


Event = CallReceived | CallCancelled | CallCompleted | ConnectionFailed


class CallObserver(Protocol):
    """Told of every call the splice sees end (metrics). ``status`` is the call's gRPC status,
    or None when its trailers carried none; ``seconds`` runs from the request's HEADERS to the
    response's end (its trailers, or a reset). Calls still open when a connection closes, and
    calls refused by a GOAWAY, are not reported."""

    def call_finished(self, path: str, status: int | None, seconds: float) -> None: ...


def _response_encoding(flags: int, raws: list[bytes]) -> bytes | None:
    """The ``grpc-encoding`` of a response header block (None: identity, or unreadable, in
    which case the message will not unframe and the follower gets None)."""
    block = fr.header_block_fragment(flags, raws[0][9:]) + b"".join(r[9:] for r in raws[1:])
    try:
        return block_value(block, b"grpc-encoding")
    except HeaderBlockError:
        return None


def _reset_status(payload: bytes | bytearray) -> Status:
    """The status a gRPC client reports for a stream the server reset (gRPC over HTTP/2)."""
    code = int.from_bytes(payload[:4], "big") if len(payload) >= 4 else fr.INTERNAL_ERROR
    if code == fr.CANCEL:
        return Status.CANCELLED
    if code == fr.REFUSED_STREAM:
        return Status.UNAVAILABLE
    return Status.INTERNAL


class _RecentIds:
    """Stream ids remembered for a while: frames for them may still be in flight, but a
    connection that lives for months must not remember every id it ever saw."""

    def __init__(self, capacity: int = _CLOSED_LOCAL_MEMORY) -> None:
        self._ids: set[int] = set()
        self._order: deque[int] = deque()
        self._capacity = capacity

    def __contains__(self, sid: object) -> bool:
        return sid in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, sid: int) -> None:
        if sid in self._ids:
            return
        self._ids.add(sid)
        self._order.append(sid)
        if len(self._order) > self._capacity:
            self._ids.discard(self._order.popleft())

    def discard(self, sid: int) -> None:
        self._ids.discard(sid)  # its place in _order ages out harmlessly

    def clear(self) -> None:
        self._ids.clear()
        self._order.clear()


@dataclass
class _Copy:
    """The DATA one side of a followed call sent, copied as it passes; dropped once it runs
    past the limit."""

    limit: int
    encoding: bytes | None = None
    data: bytearray = field(default_factory=bytearray)
    too_large: bool = False

    def add(self, flags: int, payload: bytes | bytearray) -> None:
        if self.too_large:
            return
        data = fr.data_payload(flags, payload)
        if len(self.data) + len(data) > self.limit:
            self.too_large = True
            self.data.clear()
        else:
            self.data += data

    def message(self) -> bytes | None:
        """The single gRPC message copied; None when it is not exactly one readable one."""
        if self.too_large:
            return None
        try:
            messages = unframe_messages(bytes(self.data), self.encoding)
        except MessageError:
            return None
        return messages[0] if len(messages) == 1 else None


@dataclass
class _Followed:
    """A spliced call whose request and reply are copied and whose trailers are held for the
    adapter."""

    path: str
    request: _Copy
    response: _Copy


@dataclass
class _LocalStream:
    """A call the relay answers itself."""

    headers: tuple[Header, ...]
    path: str
    body: bytearray = field(default_factory=bytearray)
    request_done: bool = False
    send_window: int = fr.DEFAULT_WINDOW
    pending: deque[tuple[bytes, int]] = field(default_factory=deque)  # (frame, data length)
    discarding: bool = False  # request too large: drain the rest, answer once it ends
    replied: bool = False


class Splice:
    def __init__(
        self,
        intercepted: Callable[[str], bool],
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST,
        observer: CallObserver | None = None,
        followed: Callable[[str], bool] | None = None,
    ) -> None:
        self._intercepted = intercepted
        # Spliced calls whose outcome the adapter must learn before the client does.
        self._followed_paths = followed
        self._following: dict[int, _Followed] = {}
        # Stream -> (first frame's flags, trailer frames) held until release().
        self._held_trailers: dict[int, tuple[int, list[bytes]]] = {}
        self._observer = observer
        # With an observer: stream -> (path, start time) for each call in flight.
        self._timing: dict[int, tuple[str, float]] = {}
        self._max_request = max_request_bytes
        self._reader = RequestBlockReader()

        self._client_buf = bytearray()
        self._upstream_buf = bytearray()
        self._preface_seen = False
        self._out_client: list[bytes] = []
        self._out_upstream: list[bytes] = []
        self.events: list[Event] = []

        # A header block split over CONTINUATION frames, held until complete.
        self._client_block: tuple[int, int, list[bytes], bytearray] | None = None
        self._upstream_block: tuple[int, list[bytes]] | None = None

        # Flow control towards the client (what the relay may still write to it).
        self._client_window = fr.DEFAULT_WINDOW
        self._client_initial_window = fr.DEFAULT_WINDOW
        self._client_max_frame = fr.DEFAULT_MAX_FRAME
        self._credit_to_keep = 0  # client credit owed for bytes the relay itself wrote
        self._held_for_client: deque[tuple[bytes, int]] = deque()

        self.open_streams: dict[int, bool] = {}  # spliced stream -> response started
        self._local: dict[int, _LocalStream] = {}
        self._local_closed = _RecentIds()
        # Calls answered here whose HEADERS still went upstream (then reset there).
        self._relayed_by_upstream = _RecentIds()
        self.highest_stream = 0
        self._goaway_last: int | None = None
        self.failed = False
        self.upstream_absent = False

    # ------------------------------------------------------------------ outputs

    def take_output(self) -> tuple[list[bytes], list[bytes]]:
        """(chunks for the client, chunks for the upstream) produced since the last call."""
        to_client, to_upstream = self._out_client, self._out_upstream
        self._out_client, self._out_upstream = [], []
        if self.upstream_absent:
            to_upstream = []
        return to_client, to_upstream

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    @property
    def idle(self) -> bool:
        """No call in flight on this connection."""
        return not self.open_streams and not self._local and not self._held_trailers

    @property
    def client_blocks_self_contained(self) -> bool:
        """True once the client encodes header blocks without a dynamic table."""
        return self._reader.stateless

    # ------------------------------------------------------------------ client -> upstream

    def from_client(self, data: bytes) -> None:
        if self.failed:
            return
        buf = _with_pending(self._client_buf, data)
        pos = 0
        if not self._preface_seen:
            if len(buf) < len(fr.PREFACE):
                if not fr.PREFACE.startswith(bytes(buf)):
                    self._fail("client did not open with the HTTP/2 preface")
                elif buf is data:
                    self._client_buf = bytearray(data)
                return
            if not buf.startswith(fr.PREFACE):
                self._fail("client did not open with the HTTP/2 preface")
                return
            self._preface_seen = True
            self._out_upstream.append(fr.PREFACE)
            pos = len(fr.PREFACE)
        span = pos
        end_buf = len(buf)
        try:
            while end_buf - pos >= fr.FRAME_HEADER_LEN:
                length, ftype, flags, sid = fr.parse_header(buf, pos)
                end = pos + fr.FRAME_HEADER_LEN + length
                if end > end_buf:
                    break
                if ftype == fr.DATA:
                    if sid in self._local or sid in self._local_closed:
                        _forward(self._out_upstream, buf, span, pos)
                        self._client_data_local(sid, flags, buf[pos + 9 : end], length)
                        span = end
                    elif self._following and sid in self._following:
                        # Passes on unchanged; a copy is kept for the adapter.
                        self._following[sid].request.add(flags, buf[pos + 9 : end])
                elif ftype == fr.HEADERS or ftype == fr.CONTINUATION:
                    _forward(self._out_upstream, buf, span, pos)
                    self._client_header_frame(ftype, flags, sid, bytes(memoryview(buf)[pos:end]))
                    span = end
                elif ftype == fr.WINDOW_UPDATE:
                    if sid == 0 and not (self._credit_to_keep or self._held_for_client):
                        # The common case: nothing owed or waiting, so it passes verbatim.
                        self._client_window += fr.window_increment(buf[pos + 9 : end])
                        if self._local:
                            self._pump_local_all()
                    else:
                        _forward(self._out_upstream, buf, span, pos)
                        self._client_window_update(sid, bytes(memoryview(buf)[pos:end]))
                        span = end
                elif ftype == fr.SETTINGS:
                    _forward(self._out_upstream, buf, span, pos)
                    self._client_settings(flags, bytes(memoryview(buf)[pos:end]))
                    span = end
                elif ftype == fr.RST_STREAM:
                    if sid in self._local or sid in self._local_closed:
                        _forward(self._out_upstream, buf, span, pos)
                        self._client_reset_local(sid)
                        span = end
                    else:
                        self.open_streams.pop(sid, None)
                        # Nothing more may be sent on a stream the client reset.
                        self._following.pop(sid, None)
                        self._held_trailers.pop(sid, None)
                        if self._timing:
                            self._finished(sid, Status.CANCELLED)
                elif ftype == fr.PRIORITY and (sid in self._local or sid in self._local_closed):
                    _forward(self._out_upstream, buf, span, pos)
                    span = end
                elif ftype == fr.PING and self.upstream_absent and not flags & fr.FLAG_ACK:
                    self._out_client.append(fr.ping_ack(bytes(memoryview(buf)[pos + 9 : end])))
                elif self._client_block is not None:
                    raise fr.FrameError("frame interleaved inside a header block")
                pos = end
        except (fr.FrameError, HeaderBlockError) as exc:
            self._fail(f"client sent a malformed HTTP/2 stream: {exc}")
            return
        _forward(self._out_upstream, buf, span, pos)
        self._client_buf = _pending_after(buf, pos)

    def _client_settings(self, flags: int, raw: bytes) -> None:
        if flags & fr.FLAG_ACK:
            self._out_upstream.append(raw)
            return
        settings = fr.parse_settings(raw[9:])
        if self.upstream_absent:
            self._out_client.append(fr.frame(fr.SETTINGS, fr.FLAG_ACK, 0))
        for key, value in settings:
            if key == fr.SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self._client_initial_window
                self._client_initial_window = value
                for stream in self._local.values():
                    stream.send_window += delta
            elif key == fr.SETTINGS_MAX_FRAME_SIZE:
                self._client_max_frame = value
        self._out_upstream.append(
            fr.settings_frame(fr.with_setting(settings, fr.SETTINGS_HEADER_TABLE_SIZE, 0))
        )
        self._pump_local_all()

    def _client_window_update(self, sid: int, raw: bytes) -> None:
        increment = fr.window_increment(raw[9:])
        if sid == 0:
            self._client_window += increment
            keep = min(increment, self._credit_to_keep)
            self._credit_to_keep -= keep
            if increment - keep:
                self._out_upstream.append(fr.window_update(0, increment - keep))
            self._release_held_for_client()
            self._pump_local_all()
            return
        stream = self._local.get(sid)
        if stream is not None:
            stream.send_window += increment
            self._pump_local(sid, stream)
        elif sid not in self._local_closed:
            self._out_upstream.append(raw)

    def _client_header_frame(self, ftype: int, flags: int, sid: int, raw: bytes) -> None:
        if ftype == fr.CONTINUATION:
            if self._client_block is None or self._client_block[0] != sid:
                raise fr.FrameError("CONTINUATION without an open header block")
            _, first_flags, raws, assembled = self._client_block
            raws.append(raw)
            assembled += raw[9:]
            if flags & fr.FLAG_END_HEADERS:
                self._client_block = None
                self._client_headers_complete(sid, first_flags, raws, bytes(assembled))
            return
        if self._client_block is not None:
            raise fr.FrameError("HEADERS inside another header block")
        if sid == 0 or sid % 2 == 0:
            raise fr.FrameError(f"client HEADERS on stream {sid}")
        fragment = fr.header_block_fragment(flags, raw[9:])
        if not flags & fr.FLAG_END_HEADERS:
            self._client_block = (sid, flags, [raw], bytearray(fragment))
            return
        self._client_headers_complete(sid, flags, [raw], fragment)

    def _client_headers_complete(
        self, sid: int, flags: int, raws: list[bytes], block: bytes
    ) -> None:
        path = self._reader.path(block)
        end_stream = bool(flags & fr.FLAG_END_STREAM)
        local = self._local.get(sid)
        if local is not None or sid in self._local_closed:
            # Trailers on a call answered here: the client has no trailers in unary gRPC.
            if local is not None and end_stream:
                self._local_request_done(sid, local)
            return
        if sid in self.open_streams:
            self._out_upstream.extend(raws)
            return
        if sid <= self.highest_stream:
            raise fr.FrameError(f"client reused stream id {sid}")
        self.highest_stream = sid
        if self._goaway_last is not None and sid > self._goaway_last:
            # Refused by our GOAWAY: the client retries it elsewhere, so it must not run.
            # Its later frames are dropped (with credit returned) like a terminated call's.
            if not self._reader.stateless:
                self._out_upstream.extend(raws)
                self._out_upstream.append(fr.rst_stream(sid, fr.REFUSED_STREAM))
                self._relayed_by_upstream.add(sid)
            self._remember_closed(sid)
            return
        if self._observer is not None and path is not None:
            self._timing[sid] = (path, time.perf_counter())
        if path is not None and (self.upstream_absent or self._intercepted(path)):
            headers = self._reader.last_headers
            if headers is None:
                headers = decode_block(block)
            if not self._reader.stateless:
                # The upstream decoder must see this block to stay in step; cancel the stream
                # there before any request byte reaches it, and answer the call here.
                self._out_upstream.extend(raws)
                self._out_upstream.append(fr.rst_stream(sid, fr.CANCEL))
                self._relayed_by_upstream.add(sid)
            stream = _LocalStream(
                headers=tuple(headers),
                path=path,
                send_window=self._client_initial_window,
            )
            self._local[sid] = stream
            if end_stream:
                self._local_request_done(sid, stream)
            return
        self.open_streams[sid] = False
        if path is not None and self._followed_paths is not None and self._followed_paths(path):
            headers = self._reader.last_headers
            if headers is None:
                encoding = block_value(block, b"grpc-encoding")
            else:
                encoding = header_value(headers, b"grpc-encoding")
            # A gRPC message frame: 5 bytes of prefix, then at most the largest request.
            limit = self._max_request + 5
            self._following[sid] = _Followed(path, _Copy(limit, encoding), _Copy(limit))
        self._out_upstream.extend(raws)

    def _client_data_local(
        self, sid: int, flags: int, payload: bytes | bytearray, length: int
    ) -> None:
        if length:
            # Consumed here, never seen upstream: give the client its credit back.
            self._out_client.append(fr.window_update(0, length))
        stream = self._local.get(sid)
        if stream is None or stream.request_done:
            return
        if length and not flags & fr.FLAG_END_STREAM:
            self._out_client.append(fr.window_update(sid, length))
        data = fr.data_payload(flags, payload)
        if not stream.discarding:
            if len(stream.body) + len(data) > self._max_request + 5:
                stream.discarding = True
                stream.body.clear()
            else:
                stream.body += data
        if flags & fr.FLAG_END_STREAM:
            self._local_request_done(sid, stream)

    def _local_request_done(self, sid: int, stream: _LocalStream) -> None:
        stream.request_done = True
        if stream.discarding:
            self.reply(
                sid,
                Reply.error(
                    Status.RESOURCE_EXHAUSTED,
                    f"cpushim: {stream.path} request exceeds {self._max_request} bytes",
                ),
            )
            return
        body, stream.body = bytes(stream.body), bytearray()
        try:
            messages = unframe_messages(body, header_value(stream.headers, b"grpc-encoding"))
        except MessageError as exc:
            self.reply(sid, Reply.error(exc.status, f"cpushim: {stream.path}: {exc}"))
            return
        if len(messages) != 1:
            self.reply(
                sid,
                Reply.error(
                    Status.INVALID_ARGUMENT,
                    f"cpushim: {stream.path} is unary but carried {len(messages)} messages",
                ),
            )
            return
        call = UnaryCall(
            path=stream.path,
            headers=stream.headers,
            request=messages[0],
            timeout=parse_timeout(header_value(stream.headers, b"grpc-timeout")),
        )
        self.events.append(CallReceived(sid, call))

    def _client_reset_local(self, sid: int) -> None:
        if self._local.pop(sid, None) is not None:
            if self._timing:
                self._finished(sid, Status.CANCELLED)
            self._remember_closed(sid)
            self.events.append(CallCancelled(sid))

    # ------------------------------------------------------------------ upstream -> client

    def from_upstream(self, data: bytes) -> None:
        if self.failed:
            return
        buf = _with_pending(self._upstream_buf, data)
        pos, span, end_buf = 0, 0, len(buf)
        held = self._held_for_client
        try:
            while end_buf - pos >= fr.FRAME_HEADER_LEN:
                length, ftype, flags, sid = fr.parse_header(buf, pos)
                end = pos + fr.FRAME_HEADER_LEN + length
                if end > end_buf:
                    break
                if ftype == fr.DATA:
                    if self._following:
                        followed = self._following.get(sid)
                        if followed is not None:
                            followed.response.add(flags, buf[pos + 9 : end])
                    if sid in self._relayed_by_upstream:
                        _forward(self._out_client, buf, span, pos)
                        span = end
                        if length:
                            self._out_upstream.append(fr.window_update(0, length))
                    elif held or length > self._client_window:
                        _forward(self._out_client, buf, span, pos)
                        held.append((bytes(memoryview(buf)[pos:end]), length))
                        span = end
                    else:
                        self._client_window -= length
                    if flags & fr.FLAG_END_STREAM:
                        spliced = self.open_streams.pop(sid, None) is not None
                        self._following.pop(sid, None)
                        if self._timing and spliced:
                            self._finished(sid, None)
                elif ftype == fr.HEADERS or ftype == fr.CONTINUATION:
                    _forward(self._out_client, buf, span, pos)
                    self._upstream_header_frame(ftype, flags, sid, bytes(memoryview(buf)[pos:end]))
                    span = end
                elif ftype == fr.SETTINGS and not flags & fr.FLAG_ACK:
                    _forward(self._out_client, buf, span, pos)
                    settings = fr.parse_settings(memoryview(buf)[pos + 9 : end])
                    rewritten = fr.with_setting(settings, fr.SETTINGS_HEADER_TABLE_SIZE, 0)
                    self._to_client(fr.settings_frame(rewritten), 0)
                    span = end
                elif ftype == fr.RST_STREAM:
                    spliced = self.open_streams.pop(sid, None) is not None
                    self._following.pop(sid, None)
                    if self._timing and spliced:
                        self._finished(sid, _reset_status(buf[pos + 9 : end]))
                    if sid in self._relayed_by_upstream:
                        _forward(self._out_client, buf, span, pos)
                        self._relayed_by_upstream.discard(sid)
                        span = end
                elif ftype == fr.WINDOW_UPDATE and sid in self._relayed_by_upstream:
                    _forward(self._out_client, buf, span, pos)
                    span = end
                elif held:
                    _forward(self._out_client, buf, span, pos)
                    held.append((bytes(memoryview(buf)[pos:end]), 0))
                    span = end
                pos = end
        except (fr.FrameError, HeaderBlockError) as exc:
            self._fail(f"runtime sent a malformed HTTP/2 stream: {exc}")
            return
        _forward(self._out_client, buf, span, pos)
        self._upstream_buf = _pending_after(buf, pos)

    def _to_client(self, chunk: bytes, data_length: int) -> None:
        """Write in order behind anything held for lack of client window."""
        if self._held_for_client or data_length > self._client_window:
            self._held_for_client.append((chunk, data_length))
        else:
            self._client_window -= data_length
            self._out_client.append(chunk)

    def _release_held_for_client(self) -> None:
        held = self._held_for_client
        while held and held[0][1] <= self._client_window:
            chunk, length = held.popleft()
            self._client_window -= length
            self._out_client.append(chunk)

    def _upstream_header_frame(self, ftype: int, flags: int, sid: int, raw: bytes) -> None:
        # Whole blocks only, so frames the relay writes never land inside one.
        if ftype == fr.CONTINUATION:
            if self._upstream_block is None or self._upstream_block[0] != sid:
                raise fr.FrameError("CONTINUATION without an open header block")
            self._upstream_block[1].append(raw)
            if not flags & fr.FLAG_END_HEADERS:
                return
            raws = self._upstream_block[1]
            first_flags = fr.parse_header(raws[0], 0)[2]
            self._upstream_block = None
        else:
            if self._upstream_block is not None:
                raise fr.FrameError("HEADERS inside another header block")
            if not flags & fr.FLAG_END_HEADERS:
                self._upstream_block = (sid, [raw])
                return
            raws, first_flags = [raw], flags
        if sid in self._relayed_by_upstream:
            if first_flags & fr.FLAG_END_STREAM:
                self._relayed_by_upstream.discard(sid)
            return  # answered here; blocks are self-contained, so dropping one is safe
        if first_flags & fr.FLAG_END_STREAM:
            self.open_streams.pop(sid, None)
            followed = self._following.pop(sid, None)
            if followed is not None:
                self._hold_trailers(sid, followed, first_flags, raws)
                return
            if self._timing:
                self._finished_by_trailers(sid, first_flags, raws)
        elif sid in self.open_streams:
            self.open_streams[sid] = True
            followed = self._following.get(sid)
            if followed is not None:
                followed.response.encoding = _response_encoding(first_flags, raws)
        for chunk in raws:
            self._to_client(chunk, 0)

    # ------------------------------------------------------------------ followed calls

    def _hold_trailers(self, sid: int, followed: _Followed, flags: int, raws: list[bytes]) -> None:
        self._held_trailers[sid] = (flags, raws)
        self.events.append(
            CallCompleted(
                sid,
                followed.path,
                followed.request.message(),
                _trailer_status(flags, raws),
                followed.response.message(),
            )
        )

    def release(self, sid: int) -> None:
        """Send a followed call's held trailers: the client learns the call is done."""
        held = self._held_trailers.pop(sid, None)
        if held is None:
            return  # the client reset it meanwhile
        flags, raws = held
        if self._timing:
            self._finished_by_trailers(sid, flags, raws)
        for chunk in raws:
            self._to_client(chunk, 0)

    # ------------------------------------------------------------------ replies written here

    def reply(self, sid: int, reply: Reply) -> None:
        """Answer a call the relay terminated (no-op if the client has reset it)."""
        stream = self._local.get(sid)
        if stream is None or stream.replied:
            return
        stream.replied = True
        if self._timing:
            self._finished(sid, reply.status)
        max_frame = self._client_max_frame
        if reply.headers is None:
            for chunk in fr.header_frames(
                sid, encode_block(reply.trailers), max_frame, end_stream=True
            ):
                stream.pending.append((chunk, 0))
        else:
            for chunk in fr.header_frames(
                sid, encode_block(reply.headers), max_frame, end_stream=False
            ):
                stream.pending.append((chunk, 0))
            body = b"".join(frame_message(m) for m in reply.messages)
            for start in range(0, len(body), max_frame):
                piece = body[start : start + max_frame]
                stream.pending.append((fr.frame(fr.DATA, 0, sid, piece), len(piece)))
            for chunk in fr.header_frames(
                sid, encode_block(reply.trailers), max_frame, end_stream=True
            ):
                stream.pending.append((chunk, 0))
        self._pump_local(sid, stream)

    def _pump_local(self, sid: int, stream: _LocalStream) -> None:
        pending = stream.pending
        while pending:
            chunk, length = pending[0]
            if length and (length > stream.send_window or length > self._client_window):
                return
            pending.popleft()
            stream.send_window -= length
            if length:
                self._credit_to_keep += length
            self._to_client(chunk, length)
        if stream.replied:
            self._local.pop(sid, None)
            self._remember_closed(sid)

    def _pump_local_all(self) -> None:
        for sid, stream in list(self._local.items()):
            if stream.pending:
                self._pump_local(sid, stream)

    def _remember_closed(self, sid: int) -> None:
        self._local_closed.add(sid)

    # ------------------------------------------------------------------ observing calls

    def _finished(self, sid: int, status: int | None) -> None:
        timing = self._timing.pop(sid, None)
        if timing is not None and self._observer is not None:
            self._observer.call_finished(timing[0], status, time.perf_counter() - timing[1])

    def _finished_by_trailers(self, sid: int, flags: int, raws: list[bytes]) -> None:
        timing = self._timing.pop(sid, None)
        if timing is None or self._observer is None:
            return
        status = _trailer_status(flags, raws)
        self._observer.call_finished(timing[0], status, time.perf_counter() - timing[1])

    # ------------------------------------------------------------------ connection lifecycle

    def serve_without_upstream(self) -> None:
        """No runtime connection could be made: act as the server, so that every call gets a
        clear UNAVAILABLE from the adapter instead of a bare connection failure."""
        self.upstream_absent = True
        self._out_client.append(fr.settings_frame([(fr.SETTINGS_HEADER_TABLE_SIZE, 0)]))

    def goaway(self) -> None:
        """Tell the client to open no new call here (graceful shutdown); calls in flight end."""
        if self._goaway_last is None:
            self._goaway_last = self.highest_stream
            self._to_client(fr.goaway(self.highest_stream, fr.NO_ERROR), 0)

    def upstream_lost(self, reason: str) -> None:
        """The runtime connection is gone: end every spliced call with UNAVAILABLE (trailers
        already held for a followed call are still released by the adapter)."""
        self._upstream_block = None
        self._following.clear()
        self._held_for_client.clear()
        message = f"cpushim: lost the connection to the runtime: {reason}"
        for sid, started in sorted(self.open_streams.items()):
            if self._timing:
                self._finished(sid, Status.UNAVAILABLE)
            reply = Reply.error(Status.UNAVAILABLE, message)
            trailers = reply.trailers[2:] if started else reply.trailers
            block = encode_block(trailers)
            self._out_client.extend(
                fr.header_frames(sid, block, self._client_max_frame, end_stream=True)
            )
        self.open_streams.clear()
        self._relayed_by_upstream.clear()
        if self._goaway_last is None:
            self._goaway_last = self.highest_stream
            self._out_client.append(fr.goaway(self.highest_stream, fr.NO_ERROR))

    def _fail(self, reason: str) -> None:
        self.failed = True
        self._out_client.append(fr.goaway(self.highest_stream, fr.PROTOCOL_ERROR, reason.encode()))
        self.events.append(ConnectionFailed(reason))


def _trailer_status(flags: int, raws: list[bytes]) -> int | None:
    """The grpc-status in a trailer block of one or more frames; None when it has none."""
    if len(raws) == 1 and not flags & (fr.FLAG_PADDED | fr.FLAG_PRIORITY):
        return grpc_status(raws[0][9:])  # the common case: one plain frame
    try:
        block = fr.header_block_fragment(flags, memoryview(raws[0])[9:])
    except fr.FrameError:  # the client's to judge; this read does not fail a connection
        block = b""
    return grpc_status(block + b"".join(raw[9:] for raw in raws[1:]))
