"""The splice between two strict HTTP/2 state machines (python-hyper's h2) as client and
runtime: h2 raises on any framing, HPACK or flow-control violation, so these tests catch
accounting mistakes that tolerant peers would hide."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from shim.cri import frames as fr
from shim.cri.calls import Reply, Status, frame_message
from shim.cri.splice import CallCancelled, CallReceived, ConnectionFailed, Splice, _RecentIds

INTERCEPTED = "/runtime.v1.RuntimeService/CreateContainer"
SPLICED = "/runtime.v1.RuntimeService/ListContainers"


def grpc_body(message: bytes) -> bytes:
    return frame_message(message)


@dataclass
class Pair:
    splice: Splice
    client: h2.connection.H2Connection
    server: h2.connection.H2Connection
    client_events: list[Any] = field(default_factory=list)
    server_events: list[Any] = field(default_factory=list)
    splice_events: list[Any] = field(default_factory=list)
    auto_ack: bool = True

    def pump(self) -> None:
        for _ in range(10_000):
            moved = False
            data = self.client.data_to_send()
            if data:
                self.splice.from_client(data)
                moved = True
            data = self.server.data_to_send()
            if data:
                self.splice.from_upstream(data)
                moved = True
            to_client, to_upstream = self.splice.take_output()
            self.splice_events += self.splice.take_events()
            for chunk in to_upstream:
                self._handle(self.server, self.server.receive_data(chunk), self.server_events)
                moved = True
            for chunk in to_client:
                self._handle(self.client, self.client.receive_data(chunk), self.client_events)
                moved = True
            if not moved:
                return
        raise AssertionError("pump did not settle")

    def _handle(self, conn: h2.connection.H2Connection, events: list[Any], sink: list[Any]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and self.auto_ack:
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            sink.append(event)

    def read_everything(self, side: h2.connection.H2Connection) -> None:
        """``side`` (client or server) reads all it has received so far, and from now on
        reads as it receives."""
        self.auto_ack = True
        events = self.client_events if side is self.client else self.server_events
        for event in list(events):
            if isinstance(event, h2.events.DataReceived):
                side.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.pump()

    def received(self, events: list[Any], stream_id: int) -> bytes:
        return b"".join(
            e.data
            for e in events
            if isinstance(e, h2.events.DataReceived) and e.stream_id == stream_id
        )


def make_pair(*, client_window: int | None = None, amended: bool = False) -> Pair:
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    client.initiate_connection()
    if client_window is not None:
        client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: client_window})
    server.initiate_connection()
    splice = Splice(lambda path: path == INTERCEPTED, amended=(lambda path: amended))
    pair = Pair(splice, client, server)
    pair.pump()
    return pair


def request_headers(path: str, extra: list[tuple[bytes, bytes]] | None = None) -> list[Any]:
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path.encode()),
        (b":authority", b"localhost"),
        (b"te", b"trailers"),
        (b"content-type", b"application/grpc"),
        (b"grpc-timeout", b"9S"),
        *(extra or []),
    ]


def send_request(pair: Pair, path: str, body: bytes, **headers: Any) -> int:
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, request_headers(path, headers.get("extra")))
    pair.pump()
    view = memoryview(body)
    while view:
        pad = headers.get("pad")
        overhead = pad + 1 if pad is not None else 0  # padding counts against both limits
        window = pair.client.local_flow_control_window(sid) - overhead
        step = min(window, pair.client.max_outbound_frame_size - overhead, len(view))
        assert step > 0, "client stalled: the relay never returned flow-control credit"
        pair.client.send_data(sid, bytes(view[:step]), pad_length=pad)
        view = view[step:]
        pair.pump()
    pair.client.end_stream(sid)
    pair.pump()
    return sid


def respond(pair: Pair, sid: int, body: bytes) -> None:
    pair.server.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    view = memoryview(body)
    while view:
        window = pair.server.local_flow_control_window(sid)
        step = min(window, pair.server.max_outbound_frame_size, len(view))
        assert step > 0, "runtime stalled for lack of client credit"
        pair.server.send_data(sid, bytes(view[:step]))
        view = view[step:]
        pair.pump()
    pair.server.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
    pair.pump()


def test_both_peers_are_told_to_use_no_dynamic_table() -> None:
    pair = make_pair()
    assert pair.client.remote_settings.header_table_size == 0
    assert pair.server.remote_settings.header_table_size == 0


def test_spliced_call_reaches_the_runtime_verbatim() -> None:
    pair = make_pair()
    sid = send_request(pair, SPLICED, grpc_body(b"list"))
    assert pair.received(pair.server_events, sid) == grpc_body(b"list")
    respond(pair, sid, grpc_body(b"containers"))
    assert pair.received(pair.client_events, sid) == grpc_body(b"containers")
    assert pair.splice.idle


@pytest.mark.parametrize("size", [10, 70_000, 1_000_000])
@pytest.mark.parametrize("pad", [None, 17])
def test_intercepted_request_is_consumed_here_with_credit_returned(
    size: int, pad: int | None
) -> None:
    pair = make_pair()
    message = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    sid = send_request(pair, INTERCEPTED, grpc_body(message), pad=pad)
    # Nothing of this call reached the runtime: not the request, not even its headers.
    assert not [e for e in pair.server_events if getattr(e, "stream_id", 0) == sid]
    (event,) = [e for e in pair.splice_events if isinstance(e, CallReceived)]
    assert event.stream_id == sid
    assert event.call.request == message
    assert event.call.timeout == 9.0
    # The client's connection window is whole again: it can keep calling.
    assert pair.client.outbound_flow_control_window == pair.server.inbound_flow_control_window


def test_large_reply_written_here_then_spliced_traffic_respects_the_real_window() -> None:
    pair = make_pair()
    pair.auto_ack = False  # the client consumes slowly
    sid = send_request(pair, INTERCEPTED, grpc_body(b"create"))
    pair.splice.reply(sid, Reply.ok(b"r" * 200_000))
    pair.pump()
    spliced = send_request(pair, SPLICED, grpc_body(b"list"))
    respond_started = pair.server.local_flow_control_window(spliced)
    assert respond_started > 0
    # Let the client read everything, step by step, while the runtime also sends 300 KB.
    pair.read_everything(pair.client)
    respond(pair, spliced, grpc_body(b"s" * 300_000))
    assert pair.received(pair.client_events, sid) == grpc_body(b"r" * 200_000)
    assert pair.received(pair.client_events, spliced) == grpc_body(b"s" * 300_000)
    ended = {e.stream_id for e in pair.client_events if isinstance(e, h2.events.StreamEnded)}
    assert {sid, spliced} <= ended
    assert pair.splice.idle
    # Credit the relay kept back equals what it wrote itself: the runtime's view is exact.
    assert pair.server.outbound_flow_control_window == pair.client.inbound_flow_control_window


def test_a_reply_held_for_the_clients_window_keeps_the_connection_busy() -> None:
    """A spliced reply the runtime has ended, but that waits here for the client's credit,
    is still in flight: a connection told to go away closes only once it is idle."""
    pair = make_pair()
    pair.auto_ack = False  # the client has not read yet
    sid = send_request(pair, INTERCEPTED, grpc_body(b"create"))
    pair.splice.reply(sid, Reply.ok(b"r" * 60_000))  # most of the connection's 65,535
    pair.pump()
    spliced = send_request(pair, SPLICED, grpc_body(b"list"))
    respond(pair, spliced, grpc_body(b"s" * 20_000))
    pair.splice.goaway()
    pair.pump()
    assert pair.received(pair.client_events, spliced) != grpc_body(b"s" * 20_000)
    assert not pair.splice.idle

    pair.read_everything(pair.client)
    assert pair.received(pair.client_events, spliced) == grpc_body(b"s" * 20_000)
    ended = {e.stream_id for e in pair.client_events if isinstance(e, h2.events.StreamEnded)}
    assert spliced in ended
    assert [e for e in pair.client_events if isinstance(e, h2.events.ConnectionTerminated)]
    assert pair.splice.idle


@pytest.mark.parametrize("client_window", [1_000, 16_383])
def test_a_reply_written_here_larger_than_the_clients_window_gets_through(
    client_window: int,
) -> None:
    pair = make_pair(client_window=client_window)
    sid = send_request(pair, INTERCEPTED, grpc_body(b"create"))
    pair.splice.reply(sid, Reply.ok(b"r" * 50_000))  # frames of 16 KiB, above the window
    pair.pump()
    assert pair.received(pair.client_events, sid) == grpc_body(b"r" * 50_000)
    assert sid in {e.stream_id for e in pair.client_events if isinstance(e, h2.events.StreamEnded)}
    assert pair.splice.idle


def test_error_reply_is_trailers_only() -> None:
    pair = make_pair()
    sid = send_request(pair, INTERCEPTED, grpc_body(b"create"))
    pair.splice.reply(sid, Reply.error(Status.RESOURCE_EXHAUSTED, "no CPUs: 4 asked, 2 free"))
    pair.pump()
    (response,) = [e for e in pair.client_events if isinstance(e, h2.events.ResponseReceived)]
    headers = dict(response.headers)
    assert headers[b"grpc-status"] == b"8"
    assert headers[b"grpc-message"] == b"no CPUs: 4 asked, 2 free"
    assert sid in {e.stream_id for e in pair.client_events if isinstance(e, h2.events.StreamEnded)}


def test_header_blocks_split_over_continuation_frames() -> None:
    pair = make_pair()
    big = [(b"x-big", b"v" * 40_000)]
    spliced = send_request(pair, SPLICED, grpc_body(b"a"), extra=big)
    intercepted = send_request(pair, INTERCEPTED, grpc_body(b"b"), extra=big)
    (server_request,) = [e for e in pair.server_events if isinstance(e, h2.events.RequestReceived)]
    assert server_request.stream_id == spliced
    assert (b"x-big", b"v" * 40_000) in server_request.headers
    (call,) = [e for e in pair.splice_events if isinstance(e, CallReceived)]
    assert call.stream_id == intercepted
    assert (b"x-big", b"v" * 40_000) in call.call.headers
    pair.splice.reply(intercepted, Reply.ok(b"ok"))
    respond(pair, spliced, grpc_body(b"ok"))
    assert pair.splice.idle


def test_client_reset_cancels_the_call() -> None:
    pair = make_pair()
    sid = send_request(pair, INTERCEPTED, grpc_body(b"create"))
    pair.client.reset_stream(sid)
    pair.pump()
    assert CallCancelled(sid) in pair.splice_events
    pair.splice.reply(sid, Reply.ok(b"late"))  # the handler finishing late writes nothing
    pair.pump()
    assert pair.received(pair.client_events, sid) == b""


def test_calls_racing_our_goaway_never_reach_the_runtime() -> None:
    # (h2 closes its connection on GOAWAY, so the drain of calls in flight is covered by the
    # grpcio SIGTERM test; here: a call the client sent before it saw our GOAWAY.)
    pair = make_pair()
    first = send_request(pair, SPLICED, grpc_body(b"before"))
    pair.splice.goaway()
    goaway_bytes, _ = pair.splice.take_output()  # not yet seen by the client
    late = pair.client.get_next_available_stream_id()
    pair.client.send_headers(late, request_headers(SPLICED))
    pair.client.send_data(late, grpc_body(b"late"), end_stream=True)
    pair.splice.from_client(pair.client.data_to_send())
    _, to_upstream = pair.splice.take_output()
    assert to_upstream == []  # the client retries it elsewhere: it must not run here
    events = pair.client.receive_data(b"".join(goaway_bytes))
    (goaway,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway.last_stream_id == first
    assert goaway.error_code == 0


def test_runtime_loss_ends_open_calls_with_unavailable() -> None:
    pair = make_pair()
    waiting = send_request(pair, SPLICED, grpc_body(b"w"))
    started = send_request(pair, SPLICED, grpc_body(b"s"))
    pair.server.send_headers(
        started, [(b":status", b"200"), (b"content-type", b"application/grpc")]
    )
    pair.pump()
    pair.splice.upstream_lost("connection reset")
    to_client, _ = pair.splice.take_output()
    events = [e for chunk in to_client for e in pair.client.receive_data(chunk)]
    statuses = {}
    for event in events:
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            statuses[event.stream_id] = dict(event.headers)[b"grpc-status"]
    assert statuses == {waiting: b"14", started: b"14"}
    assert any(isinstance(e, h2.events.ConnectionTerminated) for e in events)


def frames_on(chunks: list[bytes], stream_id: int) -> list[int]:
    """The types of the whole frames on ``stream_id`` in ``chunks``, in order."""
    buf, kinds, pos = b"".join(chunks), [], 0
    while len(buf) - pos >= fr.FRAME_HEADER_LEN:
        length, kind, _, sid = fr.parse_header(buf, pos)
        if sid == stream_id:
            kinds.append(kind)
        pos += fr.FRAME_HEADER_LEN + length
    return kinds


def client_window_nearly_spent(pair: Pair) -> None:
    """The relay answers a call itself with 60,000 bytes the client does not read yet: what
    the runtime sends next waits in the relay for the client's credit."""
    pair.auto_ack = False
    sid = send_request(pair, INTERCEPTED, grpc_body(b"create"))
    pair.splice.reply(sid, Reply.ok(b"r" * 60_000))
    pair.pump()


def reply_headers(pair: Pair, sid: int) -> None:
    pair.server.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])


def test_runtime_loss_keeps_a_whole_reply_that_waits_for_client_credit() -> None:
    pair = make_pair()
    client_window_nearly_spent(pair)
    spliced = send_request(pair, SPLICED, grpc_body(b"list"))
    respond(pair, spliced, grpc_body(b"s" * 15_000))  # ended by the runtime, held here
    pair.splice.upstream_lost("connection reset")
    pair.pump()
    assert not pair.splice.idle
    pair.read_everything(pair.client)
    assert pair.received(pair.client_events, spliced) == grpc_body(b"s" * 15_000)
    ended = {e.stream_id for e in pair.client_events if isinstance(e, h2.events.StreamEnded)}
    assert spliced in ended
    assert pair.splice.idle


def test_runtime_loss_ends_a_call_whose_response_headers_wait_with_unavailable() -> None:
    pair = make_pair()
    client_window_nearly_spent(pair)
    first = send_request(pair, SPLICED, grpc_body(b"one"))
    second = send_request(pair, SPLICED, grpc_body(b"two"))
    reply_headers(pair, first)
    pair.server.send_data(first, grpc_body(b"a" * 15_000))  # waits for the client's credit
    reply_headers(pair, second)  # waits behind it
    pair.pump()
    pair.splice.upstream_lost("connection reset")
    pair.read_everything(pair.client)  # a malformed response would raise in h2 here
    statuses = {
        e.stream_id: dict(e.headers).get(b"grpc-status")
        for e in pair.client_events
        if isinstance(e, h2.events.TrailersReceived) and e.stream_id in (first, second)
    }
    assert statuses == {first: b"14", second: b"14"}


def test_a_runtime_reset_does_not_overtake_a_reply_that_waits_for_client_credit() -> None:
    # grpc-go resets (NO_ERROR) a stream it answered before the request ended; a client that
    # sees the reset first drops the reply.
    pair = make_pair()
    client_window_nearly_spent(pair)
    spliced = send_request(pair, SPLICED, grpc_body(b"list"))
    reply_headers(pair, spliced)
    pair.server.send_data(spliced, grpc_body(b"s" * 15_000))
    pair.server.send_headers(spliced, [(b"grpc-status", b"0")], end_stream=True)
    pair.splice.from_upstream(pair.server.data_to_send() + fr.rst_stream(spliced, fr.NO_ERROR))
    now, _ = pair.splice.take_output()
    pair.splice.from_client(fr.window_update(0, 1_000_000))  # the client reads at last
    later, _ = pair.splice.take_output()
    kinds = frames_on(now + later, spliced)
    assert kinds == [fr.HEADERS, fr.DATA, fr.HEADERS, fr.RST_STREAM]


@pytest.mark.parametrize("relay_wrote", [False, True])
def test_runtime_data_beyond_the_clients_window_fails_instead_of_piling_up(
    relay_wrote: bool,
) -> None:
    """What the runtime may send is the window the client gave it, the credit the relay keeps
    for its own replies included; a runtime that sends more (as no peer may) was once held
    here, without limit, waiting for credit the client, which never saw those bytes, would
    never give."""
    pair = make_pair()
    pair.auto_ack = False  # the client reads nothing: no credit comes back
    if relay_wrote:
        client_window_nearly_spent(pair)
    spliced = send_request(pair, SPLICED, grpc_body(b"list"))
    reply_headers(pair, spliced)
    pair.pump()
    allowed = pair.server.outbound_flow_control_window  # the runtime's view
    assert allowed == pair.splice._client_window + pair.splice._credit_to_keep
    sent = 0
    while sent < allowed:
        step = min(fr.DEFAULT_MAX_FRAME, allowed - sent)
        pair.splice.from_upstream(fr.frame(fr.DATA, 0, spliced, b"d" * step))
        sent += step
    assert not [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    pair.splice.take_output()
    pair.splice.from_upstream(fr.frame(fr.DATA, 0, spliced, b"d"))  # one byte more
    (failed,) = [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    assert "DATA beyond the client's connection flow-control window" in failed.reason
    to_client, to_upstream = pair.splice.take_output()
    assert_goaways_blame("runtime", to_client, to_upstream, fr.FLOW_CONTROL_ERROR)
    assert sum(length for _, length in pair.splice._held_for_client) <= allowed


def test_a_path_that_does_not_decode_fails_the_connection_with_goaway() -> None:
    pair = make_pair()
    send_request(pair, SPLICED, grpc_body(b"x"))
    assert pair.splice.client_blocks_self_contained  # :path is read without a decoder
    sid = pair.client.get_next_available_stream_id()
    # :method POST (static 3), then :path (name index 4) with a 1-byte Huffman value that
    # is all EOS padding of the wrong kind: no valid string.
    block = b"\x83\x04\x81\x00"
    pair.splice.from_client(fr.frame(fr.HEADERS, fr.FLAG_END_HEADERS, sid, block))
    assert any(isinstance(e, ConnectionFailed) for e in pair.splice.take_events())
    to_client, _ = pair.splice.take_output()
    assert goaway_codes(to_client) == [fr.COMPRESSION_ERROR]  # RFC 9113 4.3


def goaway_codes(chunks: list[bytes]) -> list[int]:
    data = b"".join(chunks)
    codes, pos = [], 0
    while pos + fr.FRAME_HEADER_LEN <= len(data):
        length, ftype, _, _ = fr.parse_header(data, pos)
        if ftype == fr.GOAWAY:
            codes.append(int.from_bytes(data[pos + 13 : pos + 17], "big"))
        pos += fr.FRAME_HEADER_LEN + length
    return codes


@pytest.mark.parametrize("side", ["client", "runtime"])
def test_a_frame_above_the_receivers_max_frame_size_fails_at_its_header(side: str) -> None:
    pair = make_pair()
    sid = send_request(pair, SPLICED, grpc_body(b"x"))
    pair.splice.take_output()
    # Only the header and a little of a 1 MiB DATA frame: it is refused at once, not
    # buffered until the rest comes.
    oversized = struct.pack(">I", 2**20)[1:] + bytes([fr.DATA, 0]) + struct.pack(">I", sid)
    oversized += b"y" * 100
    if side == "client":
        pair.splice.from_client(oversized)
    else:
        pair.splice.from_upstream(oversized)
    failures = [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    assert failures
    assert "SETTINGS_MAX_FRAME_SIZE of 16384" in failures[0].reason
    to_client, to_upstream = pair.splice.take_output()
    assert b"y" * 100 not in b"".join(to_client + to_upstream)
    assert_goaways_blame(side, to_client, to_upstream, fr.FRAME_SIZE_ERROR)


def assert_goaways_blame(
    side: str, to_client: list[bytes], to_upstream: list[bytes], code: int
) -> None:
    """The peer at fault gets GOAWAY with ``code``; a client whose runtime broke the stream
    gets INTERNAL_ERROR, and the runtime is told too."""
    if side == "client":
        assert goaway_codes(to_client) == [code]
        assert goaway_codes(to_upstream) == []
    else:
        assert goaway_codes(to_client) == [fr.INTERNAL_ERROR]
        assert goaway_codes(to_upstream) == [code]
        assert goaway_ids(to_upstream) == [0]  # the runtime opened no stream


INTERLEAVED = {
    "DATA": fr.frame(fr.DATA, 0, 1, b"x"),
    "WINDOW_UPDATE": fr.window_update(0, 100),
    "SETTINGS": fr.settings_frame([(fr.SETTINGS_INITIAL_WINDOW_SIZE, 70_000)]),
    "PING": fr.frame(fr.PING, 0, 0, b"\0" * 8),
    "RST_STREAM": fr.rst_stream(1, fr.CANCEL),
    "HEADERS": fr.frame(fr.HEADERS, fr.FLAG_END_HEADERS, 99, b"\x83"),
}


@pytest.mark.parametrize("side", ["client", "runtime"])
@pytest.mark.parametrize("kind", sorted(INTERLEAVED))
def test_a_frame_between_headers_and_their_continuation_fails_the_connection(
    side: str, kind: str
) -> None:
    pair = make_pair()
    sid = send_request(pair, SPLICED, grpc_body(b"x"))
    pair.splice.take_output()
    block = b"\x88"  # :status 200, whose CONTINUATION never comes
    if side == "client":
        sid = pair.client.get_next_available_stream_id()
        pair.splice.from_client(fr.frame(fr.HEADERS, 0, sid, b"\x83"))
        pair.splice.from_client(INTERLEAVED[kind])
    else:
        pair.splice.from_upstream(fr.frame(fr.HEADERS, 0, sid, block))
        pair.splice.from_upstream(INTERLEAVED[kind])
    failures = [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    assert [f.reason for f in failures] == [
        f"{side} sent a malformed HTTP/2 stream: a frame interleaved inside a header block"
    ]
    to_client, to_upstream = pair.splice.take_output()
    assert_goaways_blame(side, to_client, to_upstream, fr.PROTOCOL_ERROR)


def test_frames_up_to_the_size_the_runtime_announced_pass() -> None:
    pair = make_pair()
    pair.server.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 2**20})
    pair.pump()
    assert pair.client.max_outbound_frame_size == 2**20
    body = grpc_body(b"z" * 40_000)
    sid = send_request(pair, SPLICED, body)
    sizes = [
        e.flow_controlled_length
        for e in pair.server_events
        if isinstance(e, h2.events.DataReceived) and e.stream_id == sid
    ]
    assert max(sizes) > fr.DEFAULT_MAX_FRAME  # one frame larger than the default got through
    assert pair.received(pair.server_events, sid) == body
    assert not [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]


def test_the_relays_goaway_never_names_a_later_stream_than_the_runtimes() -> None:
    # RFC 9113, 6.8: the client takes the runtime's GOAWAYs and the relay's for one peer's;
    # grpc-go closes the whole connection on a GOAWAY whose id rose.
    pair = make_pair()
    first = send_request(pair, SPLICED, grpc_body(b"one"))
    second = send_request(pair, SPLICED, grpc_body(b"two"))
    pair.splice.from_upstream(fr.goaway(first, fr.NO_ERROR))  # the runtime drains
    # The client retries the call the runtime will not answer: the relay forgets it.
    assert set(pair.splice.open_streams) == {first}
    pair.splice.goaway()
    pair.splice.upstream_lost("closed")
    to_client, _ = pair.splice.take_output()
    assert second > first
    assert goaway_ids(to_client) == [first, first]  # the runtime's, passed on, then the relay's


def goaway_ids(chunks: list[bytes]) -> list[int]:
    buf, ids, pos = b"".join(chunks), [], 0
    while len(buf) - pos >= fr.FRAME_HEADER_LEN:
        length, kind, _, _ = fr.parse_header(buf, pos)
        if kind == fr.GOAWAY:
            ids.append(fr.goaway_last_stream(buf[pos + 9 : pos + 9 + length]))
        pos += fr.FRAME_HEADER_LEN + length
    return ids


def test_a_runtime_goaway_after_the_relays_never_names_a_later_stream() -> None:
    # cpushim drains first, then containerd stops gracefully: grpc-go's first GOAWAY names
    # 2^31-1. Passed on as it is, the id would rise under the calls still in flight.
    pair = make_pair()
    first = send_request(pair, SPLICED, grpc_body(b"one"))
    pair.splice.goaway()
    pair.splice.from_upstream(fr.goaway(0x7FFF_FFFF, fr.NO_ERROR, b"graceful"))
    to_client, _ = pair.splice.take_output()
    assert goaway_ids(to_client) == [first, first]
    assert set(pair.splice.open_streams) == {first}


def test_the_runtimes_goaway_waits_behind_a_reply_held_for_client_credit() -> None:
    pair = make_pair()
    client_window_nearly_spent(pair)
    spliced = send_request(pair, SPLICED, grpc_body(b"list"))
    respond(pair, spliced, grpc_body(b"s" * 15_000))  # held for the client's credit
    pair.splice.from_upstream(fr.goaway(spliced, fr.NO_ERROR))  # the runtime drains
    pair.pump()
    pair.read_everything(pair.client)  # h2 ends the connection at a GOAWAY: it comes last
    assert pair.received(pair.client_events, spliced) == grpc_body(b"s" * 15_000)
    ended = [
        i
        for i, e in enumerate(pair.client_events)
        if isinstance(e, h2.events.StreamEnded) and e.stream_id == spliced
    ]
    goaway = [
        i for i, e in enumerate(pair.client_events) if isinstance(e, h2.events.ConnectionTerminated)
    ]
    assert ended
    assert goaway
    assert ended[0] < goaway[0]


def test_a_call_answered_here_above_the_runtimes_goaway_is_cancelled_not_run_twice() -> None:
    # Its headers never went upstream (the relay answers it), so the runtime's GOAWAY may
    # name a lower id: the client takes the call for refused and retries it elsewhere.
    pair = make_pair()
    first = send_request(pair, SPLICED, grpc_body(b"one"))
    respond(pair, first, grpc_body(b"r1"))
    local = send_request(pair, INTERCEPTED, grpc_body(b"create"))
    assert any(isinstance(e, CallReceived) for e in pair.splice_events)
    pair.splice.from_upstream(fr.goaway(first, fr.NO_ERROR))
    cancelled = [e for e in pair.splice.take_events() if isinstance(e, CallCancelled)]
    assert [e.stream_id for e in cancelled] == [local]
    assert pair.splice.idle


def test_a_connection_failed_after_a_goaway_does_not_name_a_later_stream() -> None:
    pair = make_pair()
    first = send_request(pair, SPLICED, grpc_body(b"one"))
    send_request(pair, SPLICED, grpc_body(b"two"))
    pair.splice.from_upstream(fr.goaway(first, fr.NO_ERROR))
    pair.splice.from_client(fr.frame(fr.CONTINUATION, fr.FLAG_END_HEADERS, 99, b"\x82"))
    to_client, _ = pair.splice.take_output()
    assert goaway_ids(to_client) == [first, first]


def test_a_call_opened_above_the_runtimes_goaway_is_not_kept_in_flight() -> None:
    # Sent before the client read the runtime's GOAWAY: the runtime will not answer it, and
    # the client, once it reads the GOAWAY, retries it elsewhere.
    pair = make_pair()
    first = send_request(pair, SPLICED, grpc_body(b"one"))
    pair.splice.from_upstream(fr.goaway(first, fr.NO_ERROR))
    pair.splice.take_output()  # on its way to the client, not read yet
    late = pair.client.get_next_available_stream_id()
    pair.client.send_headers(late, request_headers(SPLICED))
    pair.client.send_data(late, grpc_body(b"late"), end_stream=True)
    pair.splice.from_client(pair.client.data_to_send())
    _, to_upstream = pair.splice.take_output()
    assert to_upstream == []
    assert set(pair.splice.open_streams) == {first}


WATCH = "/runtime.v1.RuntimeService/GetContainerEvents"


@pytest.mark.parametrize("started", [False, True], ids=["before its reply", "with events sent"])
def test_a_watch_open_at_shutdown_ends_at_once(started: bool) -> None:
    """kubelet's Evented PLEG keeps GetContainerEvents open for as long as it runs: left
    open, it held every shutdown for the whole grace period (with the listener closed, so
    kubelet reached no runtime meanwhile) and was then cut. It now ends with the relay's
    GOAWAY: UNAVAILABLE for the client, cancelled upstream, while unary calls finish."""
    pair = make_pair()
    watch = send_request(pair, WATCH, grpc_body(b""))
    unary = send_request(pair, SPLICED, grpc_body(b"list"))
    if started:
        reply_headers(pair, watch)
        pair.server.send_data(watch, grpc_body(b"event"))
        pair.pump()
        assert pair.received(pair.client_events, watch) == grpc_body(b"event")
    pair.splice.goaway()
    to_client, to_upstream = pair.splice.take_output()
    for chunk in to_upstream:
        pair.server_events += pair.server.receive_data(chunk)
    resets = [e for e in pair.server_events if isinstance(e, h2.events.StreamReset)]
    assert [(e.stream_id, e.error_code) for e in resets] == [(watch, fr.CANCEL)]
    events = [e for chunk in to_client for e in pair.client.receive_data(chunk)]
    (ended,) = [
        e
        for e in events
        if isinstance(e, h2.events.ResponseReceived | h2.events.TrailersReceived)
        and e.stream_id == watch
    ]
    assert dict(ended.headers)[b"grpc-status"] == b"14"
    assert b"shutting down" in dict(ended.headers)[b"grpc-message"]
    assert isinstance(events[-1], h2.events.ConnectionTerminated)  # after the watch's end
    assert set(pair.splice.open_streams) == {unary}
    # What the runtime sent on the watch before it read the reset goes no further, and its
    # credit goes back to the runtime; the unary call still gets its reply.
    pair.splice.from_upstream(fr.frame(fr.DATA, 0, watch, grpc_body(b"late event")))
    to_client, to_upstream = pair.splice.take_output()
    assert to_client == []
    assert to_upstream == [fr.window_update(0, len(grpc_body(b"late event")))]
    reply_headers(pair, unary)
    pair.server.send_data(unary, grpc_body(b"r"))
    pair.server.send_headers(unary, [(b"grpc-status", b"0")], end_stream=True)
    pair.splice.from_upstream(pair.server.data_to_send())
    to_client, _ = pair.splice.take_output()
    assert frames_on(to_client, unary) == [fr.HEADERS, fr.DATA, fr.HEADERS]
    assert pair.splice.idle


def test_malformed_grpc_body_on_an_intercepted_call_is_answered_not_forwarded() -> None:
    pair = make_pair()
    sid = send_request(pair, INTERCEPTED, struct.pack(">BI", 0, 100) + b"short")
    (response,) = [e for e in pair.client_events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b"grpc-status"] == b"13"
    assert not [e for e in pair.splice_events if isinstance(e, CallReceived)]
    assert sid not in {getattr(e, "stream_id", 0) for e in pair.server_events}


def test_client_that_keeps_its_dynamic_table_still_works() -> None:
    # A client that ignores HEADER_TABLE_SIZE = 0: its blocks are decoded in order, and an
    # intercepted call's HEADERS must reach the runtime (to keep its decoder in step) but be
    # reset there before any request byte.
    pair = make_pair()
    pair.client.encoder.header_table_size = 4096  # as if the setting had been ignored
    spliced = send_request(pair, SPLICED, grpc_body(b"one"))
    respond(pair, spliced, grpc_body(b"r1"))
    assert not pair.splice._reader.stateless
    intercepted = send_request(pair, INTERCEPTED, grpc_body(b"create"))
    server_streams = [e for e in pair.server_events if getattr(e, "stream_id", 0) == intercepted]
    assert [type(e) for e in server_streams] == [h2.events.RequestReceived, h2.events.StreamReset]
    (call,) = [e for e in pair.splice_events if isinstance(e, CallReceived)]
    assert call.call.request == b"create"
    pair.splice.reply(intercepted, Reply.ok(b"created"))
    pair.pump()
    assert pair.received(pair.client_events, intercepted) == grpc_body(b"created")
    again = send_request(pair, SPLICED, grpc_body(b"two"))  # indexed headers still decode
    (request,) = [
        e
        for e in pair.server_events
        if isinstance(e, h2.events.RequestReceived) and e.stream_id == again
    ]
    assert (b":path", SPLICED.encode()) in request.headers
    respond(pair, again, grpc_body(b"r2"))
    assert pair.received(pair.client_events, again) == grpc_body(b"r2")
    assert pair.splice.idle


def test_memory_of_finished_calls_stays_bounded() -> None:
    pair = make_pair()
    pair.client.encoder.header_table_size = 4096  # the fallback path remembers the most
    for i in range(1500):
        sid = send_request(pair, INTERCEPTED, grpc_body(b"%d" % i))
        pair.splice.reply(sid, Reply.ok(b"ok"))
        pair.pump()
    assert pair.splice.idle
    assert len(pair.splice._local_closed) <= 1024
    assert len(pair.splice._relayed_by_upstream) <= 1024
    assert len(pair.splice.take_events()) == 0


def test_remembered_ids_age_out_oldest_first_and_a_readded_id_starts_afresh() -> None:
    recent = _RecentIds(capacity=3)
    for sid in (1, 3, 5):
        recent.add(sid)
    recent.discard(1)
    recent.add(1)  # remembered again: now the newest
    recent.add(7)  # over capacity: 3, the oldest, goes
    assert [sid for sid in (1, 3, 5, 7) if sid in recent] == [1, 5, 7]
    recent.add(9)
    recent.add(11)
    assert [sid for sid in (1, 5, 7, 9, 11) if sid in recent] == [7, 9, 11]
    assert len(recent) == 3


def test_an_endless_header_block_from_the_client_fails_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A header block is kept whole until its END_HEADERS: one that never ends would take
    all memory. Past the largest header list a gRPC peer takes, the connection fails."""
    import shim.cri.splice as splice_module

    monkeypatch.setattr(splice_module, "MAX_HEADER_LIST", 4096)
    pair = make_pair()
    pair.splice.take_output()
    # HEADERS without END_HEADERS on a new stream, then CONTINUATIONs that never end it.
    pair.splice.from_client(fr.frame(fr.HEADERS, 0, 1, b"\x82"))
    for _ in range(5):
        pair.splice.from_client(fr.frame(fr.CONTINUATION, 0, 1, b"\x00" * 1000))
    failures = [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    assert failures
    assert "a header block longer than 4096 bytes" in failures[0].reason


BAD_SETTINGS = {
    "MAX_FRAME_SIZE 0": ((fr.SETTINGS_MAX_FRAME_SIZE, 0), fr.PROTOCOL_ERROR),
    "MAX_FRAME_SIZE below 16 KiB": ((fr.SETTINGS_MAX_FRAME_SIZE, 16_383), fr.PROTOCOL_ERROR),
    "MAX_FRAME_SIZE above 2^24-1": ((fr.SETTINGS_MAX_FRAME_SIZE, 2**24), fr.PROTOCOL_ERROR),
    "INITIAL_WINDOW_SIZE above 2^31-1": (
        (fr.SETTINGS_INITIAL_WINDOW_SIZE, 2**31),
        fr.FLOW_CONTROL_ERROR,
    ),
}


@pytest.mark.parametrize("side", ["client", "runtime"])
@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_a_setting_out_of_its_range_fails_the_connection(side: str, case: str) -> None:
    """RFC 9113 6.5.2. A client's MAX_FRAME_SIZE of 0 once made every frame the relay wrote
    to it (a reply, the UNAVAILABLE trailers when the runtime went) loop for ever."""
    setting, code = BAD_SETTINGS[case]
    pair = make_pair()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, request_headers(SPLICED))
    pair.pump()
    pair.splice.take_output()
    if side == "client":
        pair.splice.from_client(fr.settings_frame([setting]))
    else:
        pair.splice.from_upstream(fr.settings_frame([setting]))
    failures = [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    assert failures
    to_client, to_upstream = pair.splice.take_output()
    assert_goaways_blame(side, to_client, to_upstream, code)
    pair.splice.upstream_lost("closed")  # writes nothing more, and returns


def test_an_endless_header_block_from_the_runtime_fails_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runtime's header blocks are kept whole until their END_HEADERS too."""
    import shim.cri.splice as splice_module

    monkeypatch.setattr(splice_module, "MAX_HEADER_LIST", 4096)
    pair = make_pair()
    sid = send_request(pair, SPLICED, grpc_body(b"x"))
    pair.splice.take_output()
    pair.splice.from_upstream(fr.frame(fr.HEADERS, 0, sid, b"\x88"))
    for _ in range(5):
        pair.splice.from_upstream(fr.frame(fr.CONTINUATION, 0, sid, b"\x00" * 1000))
    failures = [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    assert failures
    assert "a header block longer than 4096 bytes" in failures[0].reason
    to_client, to_upstream = pair.splice.take_output()
    assert_goaways_blame("runtime", to_client, to_upstream, fr.PROTOCOL_ERROR)


def test_the_caches_keyed_by_a_peers_bytes_keep_no_large_entries() -> None:
    """The :path and grpc-status caches live as long as a connection (the status cache as
    long as cpushim): a peer sending ever new large values must not fill them with those."""
    from shim.cri import hpack_blocks
    from shim.cri.hpack_blocks import RequestBlockReader, encode_block, grpc_status

    reader = RequestBlockReader()
    reader.path(b"\x20" + encode_block([(b":path", b"/first")]))  # table size 0 applied
    assert reader.stateless
    for i in range(20):
        path = b"/%d" % i + b"p" * 100_000
        assert reader.path(encode_block([(b":method", b"POST"), (b":path", path)])) == path.decode()
        status = encode_block([(b"grpc-status", b"2"), (b"grpc-message", b"%d" % i * 50_000)])
        assert grpc_status(status) == 2
    assert sum(map(len, reader._path_cache)) < 100_000
    assert sum(map(len, hpack_blocks._status_cache)) < 100_000
    assert reader.path(encode_block([(b":path", SPLICED.encode())])) == SPLICED
    assert reader._path_cache  # a real call's path is still cached


# ---------------------------------------------------------------------------- the server's preface


def unspoken_pair() -> Pair:
    """A pair whose client has sent its preface and SETTINGS, and whose runtime has said
    nothing yet (its SETTINGS are not on their way)."""
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    client.initiate_connection()
    splice = Splice(lambda path: path == INTERCEPTED)
    splice.from_client(client.data_to_send())
    _, to_upstream = splice.take_output()
    server.receive_data(b"".join(to_upstream))
    return Pair(splice, client, server)


def frame_list(chunks: list[bytes]) -> list[tuple[int, int, int]]:
    """(type, flags, stream id) of each whole frame in ``chunks``, in order."""
    buf, found, pos = b"".join(chunks), [], 0
    while len(buf) - pos >= fr.FRAME_HEADER_LEN:
        length, kind, flags, sid = fr.parse_header(buf, pos)
        found.append((kind, flags, sid))
        pos += fr.FRAME_HEADER_LEN + length
    return found


RELAYS_SETTINGS = fr.settings_frame([(fr.SETTINGS_HEADER_TABLE_SIZE, 0)])
SETTINGS_ACK = (fr.SETTINGS, fr.FLAG_ACK, 0)


def open_call(pair: Pair, path: str) -> int:
    """A whole call the client sends without waiting for the server's SETTINGS (as RFC 9113
    3.4 lets it), passed to the splice."""
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, request_headers(path))
    pair.client.send_data(sid, grpc_body(b"early"), end_stream=True)
    pair.splice.from_client(pair.client.data_to_send())
    return sid


def test_a_runtime_lost_before_its_settings_leaves_the_relays_own_first() -> None:
    """The client's first frame from the server must be SETTINGS (RFC 9113 3.4); it once got
    the relay's UNAVAILABLE answers and GOAWAY with nothing before them, and grpc-go and
    grpcio fail such a connection for its first frame, saying nothing of the runtime."""
    pair = unspoken_pair()
    sid = open_call(pair, SPLICED)
    pair.splice.upstream_lost("connection closed by the runtime")
    to_client, _ = pair.splice.take_output()
    assert to_client[0] == RELAYS_SETTINGS  # the same as with no runtime connection at all
    kinds = frame_list(to_client)
    # An ack for the client's SETTINGS, which the runtime never gave; the call; GOAWAY.
    assert kinds == [(fr.SETTINGS, 0, 0), SETTINGS_ACK, (fr.HEADERS, 5, sid), (fr.GOAWAY, 0, 0)]
    events = pair.client.receive_data(b"".join(to_client))
    (answer,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    headers = dict(answer.headers)
    assert headers[b"grpc-status"] == b"14"
    assert b"lost the connection to the runtime" in headers[b"grpc-message"]
    assert pair.client.remote_settings.header_table_size == 0
    (goaway,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway.last_stream_id == sid
    assert pair.splice.idle


def test_a_runtime_lost_before_its_settings_with_no_call_open_leaves_the_relay_to_answer() -> None:
    """grpc-go and grpcio send no call before the server's SETTINGS: a GOAWAY straight after
    the relay's would send them back to a runtime that ends the next connection the same way,
    over and over until the call's deadline. The relay serves the connection itself instead,
    as one whose runtime could not be reached: each call is the relay's to answer."""
    pair = unspoken_pair()
    pair.splice.upstream_lost("connection closed by the runtime")
    to_client, _ = pair.splice.take_output()
    assert frame_list(to_client) == [(fr.SETTINGS, 0, 0), SETTINGS_ACK]
    pair.client.receive_data(b"".join(to_client))
    assert pair.splice.upstream_absent
    sid = open_call(pair, SPLICED)
    (received,) = [e for e in pair.splice.take_events() if isinstance(e, CallReceived)]
    assert received.stream_id == sid
    # The client's acknowledgement of the relay's SETTINGS is the relay's, and the runtime's
    # SETTINGS can no longer come: what the client writes goes nowhere.
    pair.splice.from_upstream(fr.settings_frame([]))
    to_client, to_upstream = pair.splice.take_output()
    assert (fr.SETTINGS, 0, 0) not in frame_list(to_client)
    assert to_upstream == []


@pytest.mark.parametrize("side", ["client", "runtime"])
def test_a_connection_failed_before_the_runtimes_settings_opens_with_the_relays(
    side: str,
) -> None:
    pair = unspoken_pair()
    if side == "client":
        # A CONTINUATION frame with no header block open.
        pair.splice.from_client(fr.frame(fr.CONTINUATION, fr.FLAG_END_HEADERS, 1, b"\x82"))
    else:
        # The runtime's first frame is not SETTINGS.
        pair.splice.from_upstream(fr.window_update(0, 1000))
    (failed,) = [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    if side == "runtime":
        assert "SETTINGS" in failed.reason
    to_client, to_upstream = pair.splice.take_output()
    assert frame_list(to_client) == [(fr.SETTINGS, 0, 0), (fr.GOAWAY, 0, 0)]
    assert_goaways_blame(side, to_client, to_upstream, fr.PROTOCOL_ERROR)


def test_a_goaway_before_the_runtimes_settings_sends_the_relays_and_holds_theirs_back() -> None:
    """Shutdown reaches a connection whose runtime has not spoken yet: the relay's SETTINGS
    go first, and the runtime's, coming later, must not follow them (the client would take
    them for the relay's own changed). They are acknowledged here, and the client's
    acknowledgement of the relay's goes no further."""
    pair = unspoken_pair()
    sid = open_call(pair, SPLICED)
    pair.splice.goaway()
    to_client, to_upstream = pair.splice.take_output()
    assert frame_list(to_client) == [(fr.SETTINGS, 0, 0), (fr.GOAWAY, 0, 0)]
    pair.server.receive_data(b"".join(to_upstream))  # the call
    pair.client.receive_data(b"".join(to_client))
    pair.splice.from_client(pair.client.data_to_send())  # the client's SETTINGS ACK
    _, to_upstream = pair.splice.take_output()
    assert SETTINGS_ACK not in frame_list(to_upstream)
    # The runtime speaks at last, and answers the call.
    pair.server.initiate_connection()
    pair.splice.from_upstream(pair.server.data_to_send())
    to_client, to_upstream = pair.splice.take_output()
    assert frame_list(to_client) == [SETTINGS_ACK]  # of the client's: that one passes
    assert frame_list(to_upstream) == [SETTINGS_ACK]
    pair.server.receive_data(b"".join(to_upstream))
    pair.server.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    pair.server.send_data(sid, grpc_body(b"late"))
    pair.server.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
    pair.splice.from_upstream(pair.server.data_to_send())
    to_client, _ = pair.splice.take_output()
    assert frame_list(to_client) == [(fr.HEADERS, 4, sid), (fr.DATA, 0, sid), (fr.HEADERS, 5, sid)]


def test_what_the_relay_writes_before_the_runtimes_settings_waits_behind_them() -> None:
    """A call the relay answers itself (here: its request is not one gRPC message) gets its
    answer, and the credit for its request, only after the runtime's SETTINGS."""
    pair = unspoken_pair()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, request_headers(INTERCEPTED))
    pair.client.send_data(sid, struct.pack(">BI", 0, 100) + b"short", end_stream=True)
    pair.splice.from_client(pair.client.data_to_send())
    to_client, _ = pair.splice.take_output()
    assert to_client == []
    pair.server.initiate_connection()
    pair.splice.from_upstream(pair.server.data_to_send())
    to_client, _ = pair.splice.take_output()
    kinds = frame_list(to_client)
    assert kinds[0] == (fr.SETTINGS, 0, 0)
    assert (fr.HEADERS, 5, sid) in kinds
    events = pair.client.receive_data(b"".join(to_client))
    (answer,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(answer.headers)[b"grpc-status"] == b"13"
    assert pair.client.remote_settings.header_table_size == 0
