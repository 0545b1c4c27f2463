"""Amended calls through the splice, between strict HTTP/2 peers (h2): the request is held
at the relay while its HEADERS open the stream upstream, then either answered at the relay
or written, changed, on that same stream, whose reply is followed. h2 raises on any
flow-control overrun, so these tests check the relay's accounting of the bytes it writes."""

from __future__ import annotations

from typing import Any

import h2.events
import h2.settings
import pytest

from shim.cri import frames as fr
from shim.cri.calls import Reply, Status
from shim.cri.hpack_blocks import encode_block
from shim.cri.splice import (
    CallAborted,
    CallCancelled,
    CallCompleted,
    CallReceived,
    ConnectionFailed,
)
from tests.unit.test_splice_h2 import (
    INTERCEPTED,
    SPLICED,
    Pair,
    goaway_codes,
    grpc_body,
    make_pair,
    request_headers,
    respond,
    send_request,
)

OK_TRAILERS = [(b"grpc-status", b"0")]


def events_on(events: list[Any], sid: int, kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind) and getattr(e, "stream_id", 0) == sid]


def held_call(pair: Pair, body: bytes = b"create") -> int:
    sid = send_request(pair, INTERCEPTED, grpc_body(body))
    (received,) = [
        e for e in pair.splice_events if isinstance(e, CallReceived) and e.stream_id == sid
    ]
    assert received.amended
    assert received.call.request == body
    return sid


def forwarded(pair: Pair, body: bytes = b"create") -> int:
    """A held call whose request went on unchanged."""
    sid = held_call(pair, body)
    assert pair.splice.forward_request(sid, grpc_body(body))
    pair.pump()
    return sid


def windows_agree(pair: Pair) -> None:
    """The relay knows the runtime's real connection window, and the client's view of it is
    larger by exactly the credit the runtime still owes for the bytes the relay wrote (h2
    returns credit in batches); the runtime's view of the client's window is exact."""
    real = pair.server.inbound_flow_control_window
    assert pair.splice._upstream_window == real
    assert pair.client.outbound_flow_control_window == real + pair.splice._upstream_credit_to_keep
    assert pair.server.outbound_flow_control_window == pair.client.inbound_flow_control_window


def test_the_runtime_sees_the_headers_at_once_and_the_request_once_decided() -> None:
    pair = make_pair(amended=True)
    sid = held_call(pair)
    assert events_on(pair.server_events, sid, h2.events.RequestReceived)
    assert not events_on(pair.server_events, sid, h2.events.DataReceived)
    assert pair.splice.forward_request(sid, grpc_body(b"create, pinned"))
    pair.pump()
    assert pair.received(pair.server_events, sid) == grpc_body(b"create, pinned")
    assert events_on(pair.server_events, sid, h2.events.StreamEnded)


@pytest.mark.parametrize("size", [1, 1_000, 70_000, 300_000])
def test_a_changed_request_of_any_size_keeps_both_windows_exact(size: int) -> None:
    pair = make_pair(amended=True)
    sid = held_call(pair, b"r" * 500)
    changed = grpc_body(b"c" * size)
    assert pair.splice.forward_request(sid, changed)
    pair.pump()
    assert pair.received(pair.server_events, sid) == changed
    respond(pair, sid, grpc_body(b"created"))
    (completed,) = [e for e in pair.splice_events if isinstance(e, CallCompleted)]
    assert (completed.stream_id, completed.status, completed.response) == (sid, 0, b"created")
    # The reply reached the client, all but its end, which waits for the adapter.
    assert pair.received(pair.client_events, sid) == grpc_body(b"created")
    assert not events_on(pair.client_events, sid, h2.events.StreamEnded)
    pair.splice.release(sid)
    pair.pump()
    assert events_on(pair.client_events, sid, h2.events.StreamEnded)
    assert pair.splice.idle
    windows_agree(pair)
    # And the connection goes on: a spliced call after it.
    spliced = send_request(pair, SPLICED, grpc_body(b"x" * 100_000))
    respond(pair, spliced, grpc_body(b"listed"))
    assert pair.received(pair.client_events, spliced) == grpc_body(b"listed")
    windows_agree(pair)


def test_client_data_waits_while_the_relays_own_bytes_fill_the_runtimes_window() -> None:
    pair = make_pair(amended=True)
    pair.auto_ack = False  # the runtime reads nothing for now: no credit comes back
    sid = held_call(pair)
    assert pair.splice.forward_request(sid, grpc_body(b"a" * 60_000))
    pair.pump()
    # The client believes the whole window is free (the relay returned its credit for the
    # held request); the runtime has 60 KB less. A spliced request of 20 KB must wait.
    assert pair.client.outbound_flow_control_window > 60_000
    spliced = pair.client.get_next_available_stream_id()
    pair.client.send_headers(
        spliced,
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", SPLICED.encode()),
            (b":authority", b"x"),
            (b"content-type", b"application/grpc"),
        ],
    )
    pair.client.send_data(spliced, grpc_body(b"s" * 15_000), end_stream=True)
    pair.pump()  # h2 on the runtime side would raise on an overrun
    assert len(pair.received(pair.server_events, spliced)) < 15_005
    pair.read_everything(pair.server)
    assert pair.received(pair.server_events, spliced) == grpc_body(b"s" * 15_000)
    respond(pair, sid, grpc_body(b"ok"))
    pair.splice.release(sid)
    respond(pair, spliced, grpc_body(b"ok"))
    assert pair.splice.idle
    windows_agree(pair)


def test_a_smaller_stream_window_from_the_runtime_is_respected() -> None:
    pair = make_pair(amended=True)
    pair.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1_000})
    pair.pump()
    sid = held_call(pair)
    assert pair.splice.forward_request(sid, grpc_body(b"w" * 50_000))
    pair.pump()
    assert pair.received(pair.server_events, sid) == grpc_body(b"w" * 50_000)
    respond(pair, sid, grpc_body(b"ok"))
    pair.splice.release(sid)
    pair.pump()
    windows_agree(pair)


def test_a_call_answered_here_is_cancelled_upstream_before_any_request_byte() -> None:
    pair = make_pair(amended=True)
    sid = held_call(pair)
    pair.splice.reply(sid, Reply.error(Status.RESOURCE_EXHAUSTED, "no CPUs: 2 asked, 1 free"))
    pair.pump()
    (reset,) = events_on(pair.server_events, sid, h2.events.StreamReset)
    assert reset.error_code == h2.errors.ErrorCodes.CANCEL
    assert not events_on(pair.server_events, sid, h2.events.DataReceived)
    (response,) = events_on(pair.client_events, sid, h2.events.ResponseReceived)
    assert dict(response.headers)[b"grpc-status"] == b"8"
    assert not pair.splice.forward_request(sid, grpc_body(b"too late"))
    assert pair.splice.idle
    windows_agree(pair)


def test_a_client_reset_while_held_resets_upstream_and_cancels_the_call() -> None:
    pair = make_pair(amended=True)
    sid = held_call(pair)
    pair.client.reset_stream(sid)
    pair.pump()
    assert CallCancelled(sid) in pair.splice_events
    assert events_on(pair.server_events, sid, h2.events.StreamReset)
    assert not pair.splice.forward_request(sid, grpc_body(b"create"))
    assert pair.splice.idle


def test_a_client_reset_after_the_forward_leaves_the_runtime_to_finish_the_call() -> None:
    # The runtime may have created the container already: it is not told, and the adapter
    # (the engine) learns the outcome all the same; the client hears nothing more of it.
    pair = make_pair(amended=True)
    sid = forwarded(pair)
    pair.client.reset_stream(sid)
    pair.pump()
    assert not events_on(pair.server_events, sid, h2.events.StreamReset)
    # Still in flight: a shutdown that closed the connection now would cut the runtime off
    # in the middle of the create.
    assert not pair.splice.idle
    respond(pair, sid, grpc_body(b"created"))
    (completed,) = [e for e in pair.splice_events if isinstance(e, CallCompleted)]
    assert (completed.stream_id, completed.status, completed.response) == (sid, 0, b"created")
    pair.splice.release(sid)
    pair.pump()
    assert pair.received(pair.client_events, sid) == b""
    assert pair.splice.idle
    windows_agree(pair)


def test_a_runtime_reset_after_the_forward_aborts_the_call() -> None:
    pair = make_pair(amended=True)
    sid = forwarded(pair)
    pair.server.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    pair.pump()
    assert CallAborted(sid, Status.CANCELLED) in pair.splice_events
    assert events_on(pair.client_events, sid, h2.events.StreamReset)
    assert pair.splice.idle


def test_a_runtime_that_ends_the_call_while_it_is_held_has_the_last_word() -> None:
    # The runtime's deadline passed while the decision was being made.
    pair = make_pair(amended=True)
    sid = held_call(pair)
    pair.server.send_headers(
        sid,
        [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"4")],
        end_stream=True,
    )
    pair.pump()
    assert CallCancelled(sid) in pair.splice_events
    (response,) = events_on(pair.client_events, sid, h2.events.ResponseReceived)
    assert dict(response.headers)[b"grpc-status"] == b"4"
    assert not pair.splice.forward_request(sid, grpc_body(b"create"))
    pair.splice.reply(sid, Reply.ok(b"late"))  # writes nothing now
    pair.pump()
    assert len(events_on(pair.client_events, sid, h2.events.ResponseReceived)) == 1
    assert pair.splice.idle


def test_an_error_reply_reaches_the_adapter_with_its_message() -> None:
    pair = make_pair(amended=True)
    sid = forwarded(pair)
    pair.server.send_headers(
        sid,
        [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", b"6"),
            (b"grpc-message", b"name is reserved"),
        ],
        end_stream=True,
    )
    pair.pump()
    (completed,) = [e for e in pair.splice_events if isinstance(e, CallCompleted)]
    assert completed.status == 6
    assert completed.response is None
    assert (b"grpc-message", b"name is reserved") in completed.trailers
    pair.splice.release(sid)
    pair.pump()
    (response,) = events_on(pair.client_events, sid, h2.events.ResponseReceived)
    assert dict(response.headers)[b"grpc-message"] == b"name is reserved"


def test_losing_the_runtime_aborts_forwarded_calls_and_ends_held_ones() -> None:
    pair = make_pair(amended=True)
    held = held_call(pair)
    second = forwarded(pair, b"second")
    pair.splice.upstream_lost("connection reset")
    to_client, _ = pair.splice.take_output()
    events = [e for chunk in to_client for e in pair.client.receive_data(chunk)]
    splice_events = pair.splice.take_events()
    assert CallAborted(second, Status.UNAVAILABLE) in splice_events
    assert CallCancelled(held) in splice_events
    statuses = {
        e.stream_id: dict(e.headers)[b"grpc-status"]
        for e in events
        if isinstance(e, h2.events.ResponseReceived)
    }
    assert statuses == {held: b"14", second: b"14"}
    assert not pair.splice.forward_request(held, grpc_body(b"create"))


def test_a_runtime_answer_before_the_request_was_all_written_ends_the_call_in_order() -> None:
    # The runtime's deadline passed while the relay waited for stream credit; like grpc-go,
    # it resets the stream after its trailers. The reset must not overtake the held trailers.
    pair = make_pair(amended=True)
    pair.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1_000})
    pair.pump()
    pair.auto_ack = False
    sid = held_call(pair)
    assert pair.splice.forward_request(sid, grpc_body(b"w" * 50_000))
    pair.pump()
    pair.server.send_headers(
        sid,
        [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"4")],
        end_stream=True,
    )
    pair.server.reset_stream(sid, h2.errors.ErrorCodes.NO_ERROR)
    pair.pump()
    (completed,) = [e for e in pair.splice_events if isinstance(e, CallCompleted)]
    assert completed.status == Status.DEADLINE_EXCEEDED
    assert not events_on(pair.client_events, sid, h2.events.StreamReset)
    pair.splice.release(sid)
    pair.pump()
    (response,) = events_on(pair.client_events, sid, h2.events.ResponseReceived)
    assert dict(response.headers)[b"grpc-status"] == b"4"
    # (h2 reports no reset on a stream it has seen end.)
    assert events_on(pair.client_events, sid, h2.events.StreamEnded)
    assert pair.splice.idle


def test_a_runtime_reset_crossing_the_relays_own_cancel_keeps_the_relays_answer() -> None:
    pair = make_pair(amended=True)
    pair.auto_ack = False  # the client reads slowly: its connection window runs low
    spliced = send_request(pair, SPLICED, grpc_body(b"list"))
    respond(pair, spliced, grpc_body(b"l" * 60_000))
    sid = held_call(pair)
    pair.splice.reply(sid, Reply.ok(b"x" * 8_000))  # waits for the client's credit
    pair.pump()
    # The runtime reset the stream before our CANCEL reached it: the frames cross.
    pair.splice.from_upstream(fr.rst_stream(sid, fr.NO_ERROR))
    pair.pump()
    assert not [e for e in pair.splice_events if isinstance(e, CallCancelled)]
    pair.read_everything(pair.client)
    assert pair.received(pair.client_events, sid) == grpc_body(b"x" * 8_000)
    assert events_on(pair.client_events, sid, h2.events.StreamEnded)
    assert not events_on(pair.client_events, sid, h2.events.StreamReset)
    assert pair.splice.idle


def test_a_client_reset_waits_behind_its_streams_data_held_for_upstream_credit() -> None:
    pair = make_pair(amended=True)
    pair.auto_ack = False
    sid = held_call(pair)
    assert pair.splice.forward_request(sid, grpc_body(b"a" * 60_000))
    pair.pump()
    spliced = pair.client.get_next_available_stream_id()
    pair.client.send_headers(
        spliced,
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", SPLICED.encode()),
            (b":authority", b"x"),
            (b"content-type", b"application/grpc"),
        ],
    )
    pair.client.send_data(spliced, grpc_body(b"s" * 15_000))
    pair.client.reset_stream(spliced)
    pair.pump()
    assert not events_on(pair.server_events, spliced, h2.events.StreamReset)
    pair.read_everything(pair.server)
    kinds = [type(e) for e in pair.server_events if getattr(e, "stream_id", 0) == spliced]
    assert kinds[-1] is h2.events.StreamReset
    assert pair.received(pair.server_events, spliced) == grpc_body(b"s" * 15_000)


def test_stream_credit_the_runtime_grants_while_the_request_is_held_is_used() -> None:
    pair = make_pair(amended=True)
    pair.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1_000})
    pair.pump()
    sid = held_call(pair)
    pair.server.increment_flow_control_window(9_000, stream_id=sid)
    pair.pump()
    # Not the client's: it sent its whole request already.
    assert not [
        e for e in events_on(pair.client_events, sid, h2.events.WindowUpdated) if e.delta == 9_000
    ]
    pair.auto_ack = False
    assert pair.splice.forward_request(sid, grpc_body(b"c" * 20_000))
    pair.pump()
    assert len(pair.received(pair.server_events, sid)) == 10_000


def test_a_forwarded_call_the_runtime_refuses_by_goaway_was_not_processed() -> None:
    # Streams above a GOAWAY's last stream id were never acted on (RFC 9113 6.8): the
    # adapter must not take the call for one whose outcome is unknown.
    pair = make_pair(amended=True)
    sid = forwarded(pair)
    pair.server.close_connection(last_stream_id=0)
    pair.pump()
    (aborted,) = events_on(pair.splice_events, sid, CallAborted)
    assert aborted.unprocessed


def test_a_forwarded_call_the_runtime_refuses_by_reset_was_not_processed() -> None:
    pair = make_pair(amended=True)
    sid = forwarded(pair)
    pair.server.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
    pair.pump()
    (aborted,) = events_on(pair.splice_events, sid, CallAborted)
    assert aborted.unprocessed


def test_a_runtimes_trailers_and_reset_crossing_the_relays_answer_keep_it() -> None:
    """grpc-go ends a stream whose request never finished with trailers, then RST_STREAM
    (NO_ERROR), as at a held call's deadline. Crossing the relay's own answer, neither
    reaches the client: the reset would overtake the answer still waiting for its credit."""
    pair = make_pair(amended=True)
    sid = held_call(pair)
    pair.auto_ack = False  # the client has not read the answer yet
    pair.splice.reply(sid, Reply.ok(b"x" * 80_000))
    pair.pump()
    assert pair.splice._local[sid].pending  # the rest waits for the client's stream credit
    trailers = encode_block(
        [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"4")]
    )
    crossing = b"".join(fr.header_frames(sid, trailers, 16_384, end_stream=True))
    pair.splice.from_upstream(crossing + fr.rst_stream(sid, fr.NO_ERROR))
    pair.pump()
    pair.read_everything(pair.client)
    assert not events_on(pair.client_events, sid, h2.events.StreamReset)
    assert pair.received(pair.client_events, sid) == grpc_body(b"x" * 80_000)
    assert events_on(pair.client_events, sid, h2.events.StreamEnded)


def raw_data(sid: int, size: int) -> bytes:
    return fr.frame(fr.DATA, 0, sid, b"d" * size)


@pytest.mark.parametrize("relay_wrote", [0, 60_000])
def test_client_data_beyond_the_runtimes_window_fails_instead_of_piling_up(
    relay_wrote: int,
) -> None:
    """What the client may send is the window it was given, the relay's own bytes included;
    a client that sends more (as no peer may) was once held here, without limit, waiting for
    credit the runtime, which never saw those bytes, would never give."""
    pair = make_pair(amended=True)
    pair.auto_ack = False  # the runtime reads nothing: no credit comes back
    if relay_wrote:
        sid = held_call(pair)
        assert pair.splice.forward_request(sid, grpc_body(b"a" * (relay_wrote - 5)))
        pair.pump()
    spliced = pair.client.get_next_available_stream_id()
    pair.client.send_headers(spliced, request_headers(SPLICED))
    pair.pump()
    allowed = pair.client.outbound_flow_control_window  # the client's view, all its own
    assert allowed == pair.splice._upstream_window + pair.splice._upstream_credit_to_keep
    sent = 0
    while sent < allowed:
        step = min(fr.DEFAULT_MAX_FRAME, allowed - sent)
        pair.splice.from_client(raw_data(spliced, step))
        sent += step
    assert not [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    pair.splice.take_output()
    pair.splice.from_client(raw_data(spliced, 1))  # one byte more than it was given
    (failed,) = [e for e in pair.splice.take_events() if isinstance(e, ConnectionFailed)]
    assert "flow-control window" in failed.reason
    to_client, _ = pair.splice.take_output()
    assert goaway_codes(to_client) == [fr.FLOW_CONTROL_ERROR]
    assert sum(length for _, length in pair.splice._held_for_upstream) <= allowed
