"""The frame splice: one client HTTP/2 connection relayed onto one upstream connection.

Sans-I/O: bytes go in through :meth:`Splice.from_client` / :meth:`Splice.from_upstream`, bytes to
write come out of :meth:`Splice.take_output`, and calls the relay answers itself come out as
:class:`CallReceived` events. The asyncio adapter in :mod:`shim.cri.server` does the I/O.

Frames pass verbatim, so stream ids, HPACK state, settings and flow control are the two peers'
own, with these exceptions, each accounted for:

* SETTINGS frames in both directions are rewritten to ``HEADER_TABLE_SIZE = 0``, so header
  blocks become self-contained and the relay may drop or write whole blocks.
* The client's first frame is SETTINGS: what the relay writes for it waits behind the
  runtime's, or, when the connection ends (or has no runtime) before they come, goes behind
  the relay's own. Those promise the same zero-size table; the runtime's that come after
  them are acknowledged here, not forwarded.
* Intercepted calls are terminated here: their frames are not forwarded, the relay returns
  the client's flow-control credit for the request bytes it consumed, and writes the reply.
* Amended calls are intercepted calls whose HEADERS go on to the upstream at once while their
  request is held here (with credit returned as for a terminated call); the adapter then
  either answers them here (the upstream stream is reset) or hands back a request, maybe
  changed, which the relay writes on the same stream. From there on the call is followed:
  its reply passes, but for its trailers, held until the adapter releases them.
* Reply bytes the relay writes use up the client's connection window behind the upstream's
  back; that much of the client's later WINDOW_UPDATE credit is kept from the upstream, and
  upstream DATA that would overrun the client's real window waits here until credit arrives.
  Request bytes the relay writes for an amended call are accounted the same way in the other
  direction.
* At a graceful shutdown, watches (calls that end only when their client ends them) are
  ended here: reset upstream, what the upstream still sends on them dropped, its credit
  returned.
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
    MAX_HEADER_LIST,
    Header,
    HeaderBlockError,
    RequestBlockReader,
    block_value,
    decode_block,
    encode_block,
    grpc_status,
    header_value,
)
from shim.cri.methods import WATCH_PATHS

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
    """A call to answer here; an ``amended`` one may instead go on with
    :meth:`Splice.forward_request`."""

    stream_id: int
    call: UnaryCall
    amended: bool = False


@dataclass(frozen=True)
class CallCancelled:
    stream_id: int


@dataclass(frozen=True)
class CallCompleted:
    """A followed call's response has ended upstream; its trailers wait here until the adapter
    calls :meth:`Splice.release`. ``request`` and ``response`` are the call's messages (None
    when one could not be read: an unknown encoding, too large, or not one message);
    ``status`` the gRPC status of the trailers (None when they carried none). An amended
    call's event carries its decoded trailers when its status is not OK."""

    stream_id: int
    path: str
    request: bytes | None
    status: int | None
    response: bytes | None = None
    trailers: tuple[Header, ...] = ()


@dataclass(frozen=True)
class CallAborted:
    """A followed call ended without trailers: reset by either side, or the runtime's
    connection was lost. ``status`` is what its client is told. ``unprocessed`` when the
    runtime cannot have acted on it: refused (a GOAWAY below it, REFUSED_STREAM), or ended
    before its request was all written."""

    stream_id: int
    status: Status
    unprocessed: bool = False


@dataclass(frozen=True)
class ConnectionFailed:
    """The client broke HTTP/2; the adapter closes the connection after flushing."""

    reason: str


Event = CallReceived | CallCancelled | CallCompleted | CallAborted | ConnectionFailed


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
        # Insertion-ordered: the oldest id is the first key. An id discarded and added again
        # goes to the back, so it cannot be aged out by its earlier place.
        self._ids: dict[int, None] = {}
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
        self._ids[sid] = None
        if len(self._ids) > self._capacity:
            del self._ids[next(iter(self._ids))]

    def discard(self, sid: int) -> None:
        self._ids.pop(sid, None)

    def clear(self) -> None:
        self._ids.clear()


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
    adapter. An amended call's request is not copied: the adapter wrote it."""

    path: str
    request: _Copy | None
    response: _Copy

    @property
    def amended(self) -> bool:
        return self.request is None


@dataclass
class _Outgoing:
    """An amended request the relay writes upstream as the stream's and the connection's
    windows allow."""

    data: bytes
    send_window: int
    sent: int = 0


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
    # An amended call: its HEADERS went upstream, where its stream waits for the request.
    upstream_open: bool = False
    # Stream credit the upstream granted meanwhile: the relay's, for the request it writes.
    upstream_credit: int = 0


class Splice:
    def __init__(
        self,
        intercepted: Callable[[str], bool],
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST,
        observer: CallObserver | None = None,
        followed: Callable[[str], bool] | None = None,
        amended: Callable[[str], bool] | None = None,
    ) -> None:
        self._intercepted = intercepted
        # Intercepted calls whose request is held and written on their own upstream stream.
        self._amended_paths = amended
        # Spliced calls whose outcome the adapter must learn before the client does.
        self._followed_paths = followed
        self._following: dict[int, _Followed] = {}
        # Stream -> (first frame's flags, trailer frames) held until release().
        self._held_trailers: dict[int, tuple[int, list[bytes]]] = {}
        # An upstream RST_STREAM that came after held trailers, sent after them.
        self._held_resets: dict[int, bytes] = {}
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
        self._upstream_block_bytes = 0

        # Flow control towards the client (what the relay may still write to it).
        self._client_window = fr.DEFAULT_WINDOW
        self._client_initial_window = fr.DEFAULT_WINDOW
        self._client_max_frame = fr.DEFAULT_MAX_FRAME
        # The largest frame each side has said it takes (RFC 9113 6.5.2): a larger one from
        # the other side fails the connection before the relay buffers it.
        self._client_frame_limit = fr.DEFAULT_MAX_FRAME
        self._upstream_frame_limit = fr.DEFAULT_MAX_FRAME
        self._credit_to_keep = 0  # client credit owed for bytes the relay itself wrote
        self._held_for_client: deque[tuple[bytes, int]] = deque()
        self._held_for_client_bytes = 0
        # Flow control towards the upstream, for the amended requests the relay writes.
        self._upstream_window = fr.DEFAULT_WINDOW
        self._upstream_initial_window = fr.DEFAULT_WINDOW
        self._upstream_credit_to_keep = 0  # upstream credit owed for bytes the relay wrote
        self._held_for_upstream: deque[tuple[bytes, int]] = deque()
        self._held_for_upstream_bytes = 0
        self._amending: dict[int, _Outgoing] = {}

        self.open_streams: dict[int, bool] = {}  # spliced stream -> response started
        # Spliced calls that stay open until their client ends them (WATCH_PATHS), ended at
        # a shutdown; ids of ones ended since are dropped when the next comes.
        self._watches: set[int] = set()
        self._local: dict[int, _LocalStream] = {}
        self._local_closed = _RecentIds()
        # Calls answered here whose HEADERS still went upstream (then reset there).
        self._relayed_by_upstream = _RecentIds()
        self.highest_stream = 0
        self._goaway_last: int | None = None
        # The lowest last-stream-id of the runtime's GOAWAYs, which pass to the client
        # verbatim: the client takes both peers' GOAWAYs for one peer's, whose ids may
        # never rise (RFC 9113, 6.8).
        self._upstream_goaway_last: int | None = None
        self.failed = False
        self.upstream_absent = False
        # The first frame a client gets must be SETTINGS (RFC 9113 3.4): the runtime's, or
        # the relay's own where the relay writes before the runtime has spoken and the
        # connection is ending (or has no runtime). What the relay writes for the client
        # before either waits here.
        self._greeted = False
        self._ungreeted: list[bytes] = []
        # The client got the relay's SETTINGS first: the runtime's are acknowledged here and
        # never follow (the client would take them for the relay's changed), and the
        # client's acknowledgement of the relay's is not the runtime's.
        self._greeted_here = False
        self._own_settings_unacked = False
        # SETTINGS frames of the client's passed to the runtime, each of which it owes an
        # acknowledgement.
        self._client_settings_sent = 0

    # ------------------------------------------------------------------ outputs

    def take_output(self) -> tuple[list[bytes], list[bytes]]:
        """(chunks for the client, chunks for the upstream) produced since the last call."""
        to_client, to_upstream = self._out_client, self._out_upstream
        self._out_client, self._out_upstream = [], []
        if self.upstream_absent:
            to_upstream = []
        if not self._greeted and to_client:
            self._ungreeted += to_client
            to_client = []
        return to_client, to_upstream

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    @property
    def idle(self) -> bool:
        """No call in flight on this connection, and nothing waiting for the client's
        flow-control credit: a reply the runtime has ended may still be held here. An
        amended call its client reset is in flight too: the runtime is acting on it and the
        adapter must learn how it ended."""
        return (
            not self.open_streams
            and not self._local
            and not self._held_trailers
            and not self._held_for_client
            and not self._following
            and not self._amending
        )

    @property
    def waiting_for_credit(self) -> bool:
        """Something for the client waits for its flow-control credit: a reply the runtime
        sent, or one the relay writes itself."""
        return bool(self._held_for_client) or any(s.pending for s in self._local.values())

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
                if length > self._upstream_frame_limit:
                    raise fr.oversized_frame(length, self._upstream_frame_limit, "client")
                if self._client_block is not None and ftype != fr.CONTINUATION:
                    raise fr.FrameError("a frame interleaved inside a header block")
                end = pos + fr.FRAME_HEADER_LEN + length
                if end > end_buf:
                    break
                if ftype == fr.DATA:
                    if sid in self._local or sid in self._local_closed:
                        _forward(self._out_upstream, buf, span, pos)
                        self._client_data_local(sid, flags, buf[pos + 9 : end], length)
                        span = end
                    else:
                        if self._following:
                            followed = self._following.get(sid)
                            if followed is not None and followed.request is not None:
                                # Passes on unchanged; a copy is kept for the adapter.
                                followed.request.add(flags, buf[pos + 9 : end])
                        if self._held_for_upstream or length > self._upstream_window:
                            # Only after the relay wrote requests of its own: the client's
                            # view of the upstream's window exceeds the real one until the
                            # upstream returns credit for them.
                            held_bytes = self._held_for_upstream_bytes + length
                            if held_bytes > self._upstream_window + self._upstream_credit_to_keep:
                                # More than the client was given: the runtime never saw these
                                # bytes, so no credit would ever come to let them go.
                                raise fr.FrameError(
                                    "DATA beyond the runtime's connection flow-control window",
                                    fr.FLOW_CONTROL_ERROR,
                                )
                            _forward(self._out_upstream, buf, span, pos)
                            self._held_for_upstream.append(
                                (bytes(memoryview(buf)[pos:end]), length)
                            )
                            self._held_for_upstream_bytes = held_bytes
                            span = end
                        else:
                            self._upstream_window -= length
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
                    elif self._following and self._is_amended(sid):
                        _forward(self._out_upstream, buf, span, pos)
                        span = end
                        self._client_left_amended(sid)
                    else:
                        self.open_streams.pop(sid, None)
                        # Nothing more may be sent on a stream the client reset.
                        self._end_followed(sid, Status.CANCELLED)
                        self._held_trailers.pop(sid, None)
                        self._held_resets.pop(sid, None)
                        if self._timing:
                            self._finished(sid, Status.CANCELLED)
                        if self._held_for_upstream:
                            # Behind the stream's DATA still waiting for upstream credit.
                            _forward(self._out_upstream, buf, span, pos)
                            span = end
                            self._held_for_upstream.append((bytes(memoryview(buf)[pos:end]), 0))
                elif ftype == fr.PRIORITY and (sid in self._local or sid in self._local_closed):
                    _forward(self._out_upstream, buf, span, pos)
                    span = end
                elif ftype == fr.PING and self.upstream_absent and not flags & fr.FLAG_ACK:
                    self._out_client.append(fr.ping_ack(bytes(memoryview(buf)[pos + 9 : end])))
                pos = end
        except (fr.FrameError, HeaderBlockError) as exc:
            self._fail(f"client sent a malformed HTTP/2 stream: {exc}", _error_code(exc))
            return
        _forward(self._out_upstream, buf, span, pos)
        self._client_buf = _pending_after(buf, pos)

    def _client_settings(self, flags: int, raw: bytes) -> None:
        if flags & fr.FLAG_ACK:
            if self._own_settings_unacked:
                # The first the client acknowledges: the relay's were the first it got.
                self._own_settings_unacked = False
            else:
                self._out_upstream.append(raw)
            return
        settings = fr.parse_settings(raw[9:])
        if self.upstream_absent:
            self._out_client.append(fr.frame(fr.SETTINGS, fr.FLAG_ACK, 0))
        else:
            self._client_settings_sent += 1
        for key, value in settings:
            if key == fr.SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self._client_initial_window
                self._client_initial_window = value
                for stream in self._local.values():
                    stream.send_window += delta
            elif key == fr.SETTINGS_MAX_FRAME_SIZE:
                self._client_max_frame = value
                self._client_frame_limit = max(self._client_frame_limit, value)
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
            if stream.upstream_open:
                # The upstream may still be the one to answer on this stream.
                self._out_upstream.append(raw)
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
            if len(assembled) > MAX_HEADER_LIST:
                # Kept whole until its end: an endless block would take all memory.
                raise fr.FrameError(f"a header block longer than {MAX_HEADER_LIST} bytes")
            if flags & fr.FLAG_END_HEADERS:
                self._client_block = None
                self._client_headers_complete(sid, first_flags, raws, bytes(assembled))
            return
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
        refused_above = self._announced_goaway()
        if refused_above is not None and sid > refused_above:
            # Refused by a GOAWAY (ours, or the runtime's the client had not read yet): the
            # client retries it elsewhere, so it must not run here. Its later frames are
            # dropped (with credit returned) like a terminated call's.
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
            if (
                not end_stream
                and not self.upstream_absent
                and self._amended_paths is not None
                and self._amended_paths(path)
            ):
                # The upstream opens the stream now; the request follows once decided.
                self._out_upstream.extend(raws)
                self.open_streams[sid] = False
                self._local[sid] = _LocalStream(
                    headers=tuple(headers),
                    path=path,
                    send_window=self._client_initial_window,
                    upstream_open=True,
                )
                return
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
        if path in WATCH_PATHS:
            self._watches = {w for w in self._watches if w in self.open_streams}
            self._watches.add(sid)
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
        self.events.append(CallReceived(sid, call, stream.upstream_open))

    def _client_reset_local(self, sid: int) -> None:
        stream = self._local.pop(sid, None)
        if stream is not None:
            if stream.upstream_open:
                self.open_streams.pop(sid, None)
                self._out_upstream.append(fr.rst_stream(sid, fr.CANCEL))
            if self._timing:
                self._finished(sid, Status.CANCELLED)
            self._remember_closed(sid)
            self.events.append(CallCancelled(sid))

    # ------------------------------------------------------------------ amended requests

    def forward_request(self, sid: int, body: bytes) -> bool:
        """Send an amended call's request (``body``: its gRPC message frame) on the stream
        its HEADERS opened upstream; from here on the call is followed. False when the call
        can no longer be forwarded: reset, ended by the upstream, or answered here."""
        stream = self._local.get(sid)
        if stream is None or not stream.upstream_open or stream.replied or not stream.request_done:
            return False
        del self._local[sid]
        self._following[sid] = _Followed(stream.path, None, _Copy(self._max_request + 5))
        window = self._upstream_initial_window + stream.upstream_credit
        outgoing = self._amending[sid] = _Outgoing(body, window)
        self._pump_upstream(sid, outgoing)
        return True

    def _pump_upstream(self, sid: int, outgoing: _Outgoing) -> None:
        data = outgoing.data
        while True:
            left = len(data) - outgoing.sent
            # Never above the smallest frame every peer accepts: the upstream's own limit
            # may change under a SETTINGS frame still on its way to the client.
            size = min(left, outgoing.send_window, self._upstream_window, fr.DEFAULT_MAX_FRAME)
            if size <= 0 < left:
                return
            start = outgoing.sent
            outgoing.sent += size
            done = outgoing.sent == len(data)
            flags = fr.FLAG_END_STREAM if done else 0
            self._out_upstream.append(fr.frame(fr.DATA, flags, sid, data[start : start + size]))
            outgoing.send_window -= size
            self._upstream_window -= size
            self._upstream_credit_to_keep += size
            if done:
                del self._amending[sid]
                return

    def _upstream_credit(self, increment: int) -> int:
        """Take a connection WINDOW_UPDATE from the upstream into account; returns how much
        of it is the client's (the rest paid for bytes the relay wrote itself)."""
        self._upstream_window += increment
        keep = min(increment, self._upstream_credit_to_keep)
        self._upstream_credit_to_keep -= keep
        held = self._held_for_upstream
        while held and held[0][1] <= self._upstream_window:
            chunk, length = held.popleft()
            self._upstream_window -= length
            self._held_for_upstream_bytes -= length
            self._out_upstream.append(chunk)
        for sid, outgoing in list(self._amending.items()):
            self._pump_upstream(sid, outgoing)
        return increment - keep

    def _is_amended(self, sid: int) -> bool:
        followed = self._following.get(sid)
        return followed is not None and followed.amended

    def _client_left_amended(self, sid: int) -> None:
        """The client reset an amended call after its request went upstream. The runtime may
        be acting on it already, so it is not told: it finishes the call, and the adapter
        learns the outcome (as the engine must: a container may exist); the client hears
        nothing more of it."""
        self.open_streams.pop(sid, None)
        self._held_trailers.pop(sid, None)
        self._held_resets.pop(sid, None)
        self._relayed_by_upstream.add(sid)
        if self._timing:
            self._finished(sid, Status.CANCELLED)

    def _end_followed(self, sid: int, status: Status, *, refused: bool = False) -> None:
        """A followed call ended without trailers; an amended one's adapter must learn it
        (``refused``: the runtime said it did not act on it)."""
        followed = self._following.pop(sid, None)
        unwritten = self._amending.pop(sid, None) is not None
        if followed is not None and followed.amended:
            self.events.append(CallAborted(sid, status, refused or unwritten))

    def _upstream_ended_held(self, sid: int) -> None:
        """The upstream ended an amended call before its request was sent (a deadline): the
        client has the upstream's answer, so the call can no longer be forwarded."""
        stream = self._local.get(sid)
        if stream is None or not stream.upstream_open:
            return  # answered here; the upstream's end is its own business
        del self._local[sid]
        stream.upstream_open = False
        self._remember_closed(sid)  # the rest of its request is consumed here
        self.events.append(CallCancelled(sid))

    # ------------------------------------------------------------------ upstream -> client

    def from_upstream(self, data: bytes) -> None:
        if self.failed or self.upstream_absent:
            return
        buf = _with_pending(self._upstream_buf, data)
        pos, span, end_buf = 0, 0, len(buf)
        held = self._held_for_client
        try:
            while end_buf - pos >= fr.FRAME_HEADER_LEN:
                length, ftype, flags, sid = fr.parse_header(buf, pos)
                if length > self._client_frame_limit:
                    raise fr.oversized_frame(length, self._client_frame_limit, "runtime")
                if self._upstream_block is not None and ftype != fr.CONTINUATION:
                    raise fr.FrameError("a frame interleaved inside a header block")
                end = pos + fr.FRAME_HEADER_LEN + length
                if end > end_buf:
                    break
                if not self._greeted and (ftype != fr.SETTINGS or flags & fr.FLAG_ACK):
                    raise fr.FrameError("the runtime's first frame is not SETTINGS")
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
                        held_bytes = self._held_for_client_bytes + length
                        if held_bytes > self._client_window + self._credit_to_keep:
                            # More than the client gave the runtime: the client never saw
                            # these bytes, so no credit would ever come to let them go.
                            raise fr.FrameError(
                                "DATA beyond the client's connection flow-control window",
                                fr.FLOW_CONTROL_ERROR,
                            )
                        _forward(self._out_client, buf, span, pos)
                        held.append((bytes(memoryview(buf)[pos:end]), length))
                        self._held_for_client_bytes = held_bytes
                        span = end
                    else:
                        self._client_window -= length
                    if flags & fr.FLAG_END_STREAM:
                        spliced = self.open_streams.pop(sid, None) is not None
                        # A gRPC reply ends with trailers; its client fails it without them.
                        self._end_followed(sid, Status.INTERNAL)
                        if self._local and sid in self._local:
                            self._upstream_ended_held(sid)
                        if self._timing and spliced:
                            self._finished(sid, None)
                elif ftype == fr.HEADERS or ftype == fr.CONTINUATION:
                    _forward(self._out_client, buf, span, pos)
                    self._upstream_header_frame(ftype, flags, sid, bytes(memoryview(buf)[pos:end]))
                    span = end
                elif ftype == fr.SETTINGS and not flags & fr.FLAG_ACK:
                    _forward(self._out_client, buf, span, pos)
                    settings = fr.parse_settings(memoryview(buf)[pos + 9 : end])
                    self._upstream_settings(settings)
                    if self._greeted_here:
                        self._out_upstream.append(fr.frame(fr.SETTINGS, fr.FLAG_ACK, 0))
                    else:
                        rewritten = fr.with_setting(settings, fr.SETTINGS_HEADER_TABLE_SIZE, 0)
                        if self._greeted:
                            self._to_client(fr.settings_frame(rewritten), 0)
                        else:
                            self._greet(fr.settings_frame(rewritten))
                    span = end
                elif ftype == fr.RST_STREAM and sid in self._held_trailers:
                    # After the trailers (grpc-go resets a stream it answered before the
                    # request ended): it must not overtake them.
                    _forward(self._out_client, buf, span, pos)
                    span = end
                    self._held_resets[sid] = bytes(memoryview(buf)[pos:end])
                elif ftype == fr.RST_STREAM:
                    spliced = self.open_streams.pop(sid, None) is not None
                    status = _reset_status(buf[pos + 9 : end])
                    refused = int.from_bytes(buf[pos + 9 : pos + 13], "big") == fr.REFUSED_STREAM
                    self._end_followed(sid, status, refused=length >= 4 and refused)
                    if self._local and sid in self._local:
                        self._upstream_ended_held(sid)
                    if self._timing and spliced:
                        self._finished(sid, status)
                    if sid in self._relayed_by_upstream:
                        _forward(self._out_client, buf, span, pos)
                        self._relayed_by_upstream.discard(sid)
                        span = end
                    elif held:
                        # Its stream's reply may wait for the client's credit: the reset
                        # must not overtake it (the client would drop the reply).
                        _forward(self._out_client, buf, span, pos)
                        held.append((bytes(memoryview(buf)[pos:end]), 0))
                        span = end
                elif ftype == fr.GOAWAY and length >= 8:
                    last = fr.goaway_last_stream(buf[pos + 9 : end])
                    announced = self._announced_goaway()
                    if (announced is not None and last > announced) or held:
                        _forward(self._out_client, buf, span, pos)
                        span = end
                        goaway = bytes(memoryview(buf)[pos:end])
                        if announced is not None and last > announced:
                            # The client heard a lower id (the relay's GOAWAY, or an earlier
                            # one of the runtime's): passed on as it is, the id would rise.
                            code = int.from_bytes(buf[pos + 13 : pos + 17], "big")
                            goaway = fr.goaway(announced, code, bytes(buf[pos + 17 : end]))
                        # In order behind replies that wait for the client's credit, as the
                        # relay's own GOAWAY.
                        self._to_client(goaway, 0)
                    self._upstream_goaway(last)
                elif ftype == fr.WINDOW_UPDATE and sid == 0:
                    increment = fr.window_increment(buf[pos + 9 : end])
                    if (
                        self._upstream_credit_to_keep
                        or self._held_for_upstream
                        or self._amending
                        or held
                    ):
                        _forward(self._out_client, buf, span, pos)
                        span = end
                        clients = self._upstream_credit(increment)
                        if clients:
                            self._to_client(fr.window_update(0, clients), 0)
                    else:
                        # The common case: the whole credit is the client's; it passes verbatim.
                        self._upstream_window += increment
                elif ftype == fr.WINDOW_UPDATE and (
                    sid in self._relayed_by_upstream
                    or sid in self._amending
                    or (self._local and sid in self._local)
                ):
                    # Credit for a request the relay writes is the relay's, not the client's.
                    _forward(self._out_client, buf, span, pos)
                    span = end
                    increment = fr.window_increment(buf[pos + 9 : end])
                    outgoing = self._amending.get(sid)
                    held_stream = self._local.get(sid)
                    if outgoing is not None:
                        outgoing.send_window += increment
                        self._pump_upstream(sid, outgoing)
                    elif held_stream is not None and held_stream.upstream_open:
                        held_stream.upstream_credit += increment
                elif held:
                    _forward(self._out_client, buf, span, pos)
                    held.append((bytes(memoryview(buf)[pos:end]), 0))
                    span = end
                pos = end
        except (fr.FrameError, HeaderBlockError) as exc:
            self._fail(
                f"runtime sent a malformed HTTP/2 stream: {exc}",
                _error_code(exc),
                runtime_fault=True,
            )
            return
        _forward(self._out_client, buf, span, pos)
        self._upstream_buf = _pending_after(buf, pos)

    def _upstream_settings(self, settings: list[tuple[int, int]]) -> None:
        for key, value in settings:
            if key == fr.SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self._upstream_initial_window
                self._upstream_initial_window = value
                for sid, outgoing in list(self._amending.items()):
                    outgoing.send_window += delta
                    self._pump_upstream(sid, outgoing)
            elif key == fr.SETTINGS_MAX_FRAME_SIZE:
                self._upstream_frame_limit = max(self._upstream_frame_limit, value)

    def _to_client(self, chunk: bytes, data_length: int) -> None:
        """Write in order behind anything held for lack of client window."""
        if self._held_for_client or data_length > self._client_window:
            self._held_for_client.append((chunk, data_length))
            self._held_for_client_bytes += data_length
        else:
            self._client_window -= data_length
            self._out_client.append(chunk)

    def _release_held_for_client(self) -> None:
        held = self._held_for_client
        while held and held[0][1] <= self._client_window:
            chunk, length = held.popleft()
            self._client_window -= length
            self._held_for_client_bytes -= length
            self._out_client.append(chunk)

    def _upstream_header_frame(self, ftype: int, flags: int, sid: int, raw: bytes) -> None:
        # Whole blocks only, so frames the relay writes never land inside one.
        if ftype == fr.CONTINUATION:
            if self._upstream_block is None or self._upstream_block[0] != sid:
                raise fr.FrameError("CONTINUATION without an open header block")
            self._upstream_block[1].append(raw)
            self._upstream_block_bytes += len(raw) - fr.FRAME_HEADER_LEN
            if self._upstream_block_bytes > MAX_HEADER_LIST:
                # Kept whole until its end, as the client's: an endless block would take
                # all memory.
                raise fr.FrameError(f"a header block longer than {MAX_HEADER_LIST} bytes")
            if not flags & fr.FLAG_END_HEADERS:
                return
            raws = self._upstream_block[1]
            first_flags = fr.parse_header(raws[0], 0)[2]
            self._upstream_block = None
        else:
            if not flags & fr.FLAG_END_HEADERS:
                self._upstream_block = (sid, [raw])
                self._upstream_block_bytes = len(raw) - fr.FRAME_HEADER_LEN
                return
            raws, first_flags = [raw], flags
        if sid in self._relayed_by_upstream:
            if first_flags & fr.FLAG_END_STREAM:
                # The id stays known: grpc-go may follow its trailers with RST_STREAM, which
                # must not reach the client either (it could overtake the relay's answer).
                self._amending.pop(sid, None)
                followed = self._following.pop(sid, None)
                if followed is not None:
                    # An amended call its client left: only the adapter is told.
                    self.events.append(self._completed(sid, followed, first_flags, raws))
            return  # answered here; blocks are self-contained, so dropping one is safe
        if first_flags & fr.FLAG_END_STREAM:
            self.open_streams.pop(sid, None)
            if self._amending and self._amending.pop(sid, None) is not None:
                # Answered before the relay finished writing the request: end our side.
                self._out_upstream.append(fr.rst_stream(sid, fr.CANCEL))
            followed = self._following.pop(sid, None)
            if followed is not None:
                self._hold_trailers(sid, followed, first_flags, raws)
                return
            if self._local and sid in self._local:
                self._upstream_ended_held(sid)
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
        self.events.append(self._completed(sid, followed, flags, raws))

    @staticmethod
    def _completed(sid: int, followed: _Followed, flags: int, raws: list[bytes]) -> CallCompleted:
        status = _trailer_status(flags, raws)
        trailers: tuple[Header, ...] = ()
        if followed.amended and status != Status.OK:
            trailers = _trailer_headers(flags, raws)
        return CallCompleted(
            sid,
            followed.path,
            followed.request.message() if followed.request is not None else None,
            status,
            followed.response.message(),
            trailers,
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
        reset = self._held_resets.pop(sid, None)
        if reset is not None:
            self._to_client(reset, 0)

    # ------------------------------------------------------------------ replies written here

    def reply(self, sid: int, reply: Reply) -> None:
        """Answer a call the relay terminated (no-op if the client has reset it)."""
        stream = self._local.get(sid)
        if stream is None or stream.replied:
            return
        stream.replied = True
        if stream.upstream_open:
            # An amended call answered here: the stream its HEADERS opened upstream is
            # cancelled before any request byte reached it, and what comes back is dropped.
            stream.upstream_open = False
            self.open_streams.pop(sid, None)
            self._out_upstream.append(fr.rst_stream(sid, fr.CANCEL))
            self._relayed_by_upstream.add(sid)
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
            room = min(stream.send_window, self._client_window)
            if length and room <= 0:
                return
            if length > room:
                # As much as the client's windows take now: a frame that waited to fit
                # whole would wait for ever on a window smaller than a frame.
                payload = chunk[fr.FRAME_HEADER_LEN :]
                pending[0] = (fr.frame(fr.DATA, 0, sid, payload[room:]), length - room)
                chunk, length = fr.frame(fr.DATA, 0, sid, payload[:room]), room
            else:
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
        self._greet_here()

    def _greet(self, settings: bytes) -> None:
        """Make ``settings`` the first frame the client gets, ahead of what the relay wrote
        for it before."""
        self._greeted = True
        self._out_client[:0] = [settings, *self._ungreeted]
        self._ungreeted = []

    def _greet_here(self) -> None:
        """Send the relay's own SETTINGS if the client has had none. They promise what the
        runtime's, rewritten, promise: a zero-size header table, so the client's blocks stay
        self-contained; all else is the protocol's defaults, which no client may exceed."""
        if self._greeted:
            return
        self._greeted_here = True
        self._own_settings_unacked = True
        self._greet(fr.settings_frame([(fr.SETTINGS_HEADER_TABLE_SIZE, 0)]))

    @property
    def going_away(self) -> bool:
        """The client has been sent the relay's GOAWAY."""
        return self._goaway_last is not None

    def goaway(self) -> None:
        """Tell the client to open no new call here (graceful shutdown); calls in flight end.
        Watches would never end by themselves, so they are ended now: UNAVAILABLE for the
        client (ahead of the GOAWAY, at which h2 stops reading), cancelled upstream, and
        what the runtime still sends on them is dropped."""
        if self._goaway_last is None:
            self._greet_here()
            for sid in sorted(self._watches):
                started = self.open_streams.pop(sid, None)
                if started is None:
                    continue
                reset = fr.rst_stream(sid, fr.CANCEL)
                if self._held_for_upstream:
                    # Behind the request's DATA still waiting for upstream credit.
                    self._held_for_upstream.append((reset, 0))
                else:
                    self._out_upstream.append(reset)
                self._relayed_by_upstream.add(sid)
                if self._timing:
                    self._finished(sid, Status.UNAVAILABLE)
                self._end_stream_here(sid, started, "cpushim: shutting down")
            self._watches.clear()
            self._goaway_last = self._last_stream_to_announce()
            self._to_client(fr.goaway(self._goaway_last, fr.NO_ERROR), 0)

    def _last_stream_to_announce(self) -> int:
        """The id for a GOAWAY of the relay's: the last call it saw, never above one the
        client has already been told."""
        announced = self._announced_goaway()
        return self.highest_stream if announced is None else min(self.highest_stream, announced)

    def _announced_goaway(self) -> int | None:
        """The lowest last-stream-id the client has been sent in a GOAWAY, by either peer;
        None before any."""
        ids = [i for i in (self._goaway_last, self._upstream_goaway_last) if i is not None]
        return min(ids) if ids else None

    def _upstream_goaway(self, last: int) -> None:
        """The runtime goes away: calls above ``last`` it will never answer, and the client,
        which sees the GOAWAY, takes them for refused and retries them itself."""
        if self._upstream_goaway_last is not None and last >= self._upstream_goaway_last:
            return
        self._upstream_goaway_last = last
        # Open calls, and amended ones their client reset that the runtime will not finish.
        for sid in [sid for sid in {*self.open_streams, *self._following} if sid > last]:
            self.open_streams.pop(sid, None)
            self._end_followed(sid, Status.UNAVAILABLE, refused=True)
            self._upstream_ended_held(sid)
            # Not reported to the observer: the client retries them (as calls refused by
            # the relay's own GOAWAY).
            self._timing.pop(sid, None)
        # Calls the relay answers itself whose headers never went upstream: the client takes
        # them for refused too, so answering them here as well would run them twice.
        for sid, stream in list(self._local.items()):
            if sid > last and not stream.replied and not stream.upstream_open:
                del self._local[sid]
                self._remember_closed(sid)
                self.events.append(CallCancelled(sid))
                self._timing.pop(sid, None)

    def upstream_lost(self, reason: str) -> None:
        """The runtime connection is gone: end every spliced call with UNAVAILABLE (trailers
        already held for a followed call are still released by the adapter).

        A runtime that ended it before its SETTINGS (containerd closing connections as it
        restarts, or dying with them in its listen backlog) leaves the connection to the
        relay, as one whose runtime could not be reached (``upstream_absent``): the calls
        clients send once they have had the server's SETTINGS (grpc-go and grpcio send none
        before) get the relay's UNAVAILABLE instead of a GOAWAY that sends them straight back
        to a runtime that may end the next connection the same way."""
        self._upstream_block = None
        if not self._greeted:
            self.upstream_absent = True
            self._greet_here()
            # The runtime, which never spoke, acknowledged none of the client's SETTINGS.
            ack = fr.frame(fr.SETTINGS, fr.FLAG_ACK, 0)
            self._out_client += [ack] * self._client_settings_sent
        for sid, followed in self._following.items():
            if followed.amended:
                unwritten = sid in self._amending
                self.events.append(CallAborted(sid, Status.UNAVAILABLE, unwritten))
        self._following.clear()
        self._amending.clear()
        self._held_for_upstream.clear()
        self._held_for_upstream_bytes = 0
        for sid in [sid for sid, stream in self._local.items() if stream.upstream_open]:
            # Answered UNAVAILABLE below with the other calls open upstream.
            self._upstream_ended_held(sid)
        # What waits for the client's credit stays: replies the runtime ended whole still
        # reach the client, and a stream whose response headers wait there gets its
        # UNAVAILABLE trailers after them, in order.
        message = f"cpushim: lost the connection to the runtime: {reason}"
        for sid, started in sorted(self.open_streams.items()):
            if self._timing:
                self._finished(sid, Status.UNAVAILABLE)
            self._end_stream_here(sid, started, message)
        self.open_streams.clear()
        self._watches.clear()
        self._relayed_by_upstream.clear()
        if self._goaway_last is None and (self.highest_stream or not self.upstream_absent):
            self._goaway_last = self._last_stream_to_announce()
            # Behind what waits for credit: a client reads the replies first (h2 ends a
            # connection at its GOAWAY), and learns from it which calls to retry. One that
            # never reads again is let go by the adapter.
            self._to_client(fr.goaway(self._goaway_last, fr.NO_ERROR), 0)

    def _end_stream_here(self, sid: int, started: bool, message: str) -> None:
        """End a spliced call for the client with UNAVAILABLE: trailers when its response
        has started, trailers-only when not; in order behind what waits for its credit."""
        reply = Reply.error(Status.UNAVAILABLE, message)
        trailers = reply.trailers[2:] if started else reply.trailers
        block = encode_block(trailers)
        for chunk in fr.header_frames(sid, block, self._client_max_frame, end_stream=True):
            self._to_client(chunk, 0)

    def _fail(
        self, reason: str, code: int = fr.PROTOCOL_ERROR, *, runtime_fault: bool = False
    ) -> None:
        """Close both sides with GOAWAY: the peer at fault gets the error's code; a client
        whose runtime broke the stream did nothing wrong and gets INTERNAL_ERROR."""
        self.failed = True
        self._greet_here()
        if runtime_fault:
            # The runtime opens no streams of its own in gRPC: it gets last-stream-id 0.
            self._out_upstream.append(fr.goaway(0, code, reason.encode()))
            code = fr.INTERNAL_ERROR
        self._out_client.append(fr.goaway(self._last_stream_to_announce(), code, reason.encode()))
        self.events.append(ConnectionFailed(reason))


def _error_code(exc: fr.FrameError | HeaderBlockError) -> int:
    return exc.error_code if isinstance(exc, fr.FrameError) else fr.COMPRESSION_ERROR


def _trailer_headers(flags: int, raws: list[bytes]) -> tuple[Header, ...]:
    """A trailer block's headers; none when it cannot be read."""
    try:
        block = fr.header_block_fragment(flags, memoryview(raws[0])[9:])
        return tuple(decode_block(block + b"".join(raw[9:] for raw in raws[1:])))
    except (fr.FrameError, HeaderBlockError):
        return ()


def _trailer_status(flags: int, raws: list[bytes]) -> int | None:
    """The grpc-status in a trailer block of one or more frames; None when it has none."""
    if len(raws) == 1 and not flags & (fr.FLAG_PADDED | fr.FLAG_PRIORITY):
        return grpc_status(raws[0][9:])  # the common case: one plain frame
    try:
        block = fr.header_block_fragment(flags, memoryview(raws[0])[9:])
    except fr.FrameError:  # the client's to judge; this read does not fail a connection
        block = b""
    return grpc_status(block + b"".join(raw[9:] for raw in raws[1:]))
