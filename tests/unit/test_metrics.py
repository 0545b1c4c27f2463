"""The Prometheus endpoint: an engine driven through a container lifecycle against the fake
containerd, scraped over real HTTP; /healthz; and the relay's per-call counts and latencies
through a real RelayServer in front of the fake CRI server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import hpack
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import shim
import shim.metrics as metrics_module
from shim.cri.hpack_blocks import grpc_status
from shim.cri.passthrough import PassthroughInterceptor
from shim.cri.server import RelayServer
from shim.metrics import ENGINE_COUNTERS, KUBELET_COUNTERS, Metrics, RelayStats, serve_metrics
from shim.run import runtime_unreachable
from tests.fake_cri import (
    FUTURE_UNARY,
    CountingFakeRuntime,
    FakeRuntimeServer,
    script,
    short_tmpdir,
)
from tests.unit.engine_env import Env, env, until
from tests.unit.relay_env import RUNTIME, LoopThread, failure, unary

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture

SHIM = Path(shim.__file__).parent
VERSION = RUNTIME + "Version"
START = RUNTIME + "StartContainer"  # terminated at the relay by the passthrough interceptor


def free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def http_get(url: str, method: str = "GET") -> tuple[int, str, str]:
    """(status, content type, body) of a plain HTTP request, errors included."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, keyed by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Served:
    def __init__(self, metrics: Metrics, address: str) -> None:
        self.metrics = metrics
        self.url = f"http://{address}"
        self.reason: str | None = None

    async def get(self, path: str, method: str = "GET") -> tuple[int, str, str]:
        return await asyncio.to_thread(http_get, self.url + path, method)

    async def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, content_type, body = await self.get("/metrics")
        assert status == 200
        assert content_type.startswith("text/plain; version=0.0.4")
        return samples(body)


@pytest.fixture
async def served(env: Env) -> AsyncIterator[Served]:
    metrics = Metrics(env.engine)
    address = free_address()
    holder = Served(metrics, address)
    server = await serve_metrics(metrics, address, lambda: holder.reason)
    try:
        yield holder
    finally:
        await server.close()


# --- the engine's counters and state -------------------------------------------------------------


def counters_used_in_shim() -> set[str]:
    used = set()
    for path in SHIM.rglob("*.py"):
        used |= set(re.findall(r"""counters\[\s*["'](\w+)["']\s*\]""", path.read_text()))
    return used


def test_every_counter_the_engine_uses_is_exported_with_help() -> None:
    used = counters_used_in_shim()
    assert {"pinning_requests", "exits_seen", "cpuset_updates"} <= used  # the scan finds them
    missing = used - set(ENGINE_COUNTERS) - set(KUBELET_COUNTERS)
    assert not missing, f"add these engine counters to shim.metrics.ENGINE_COUNTERS: {missing}"
    assert not set(ENGINE_COUNTERS) & set(KUBELET_COUNTERS)


async def test_a_lifecycle_scraped_over_http(env: Env, served: Served) -> None:
    served.metrics.state_loaded = True
    before = await served.scrape()
    assert before[("cpu_manager_pinning_requests_total", ())] == 0
    assert before[("cpu_manager_shared_pool_size_millicores", ())] == 8000
    assert before[("cpu_manager_exclusive_cpu_allocation_count", ())] == 0
    for name in ENGINE_COUNTERS:  # every counter is there from the start, at zero
        assert before[(f"cpushim_{name}_total", ())] == 0

    kubelet = env.kubelet
    shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
    pinned_id = await kubelet.start_new(await kubelet.run_pod("db", "guaranteed"), "main", 2000)
    greedy = await kubelet.run_pod("greedy", "guaranteed")
    await kubelet.create(greedy, "worker", 8000)  # more than there is: a pinning error
    env.engine.counters["checkpoint_errors"] += 3

    during = await served.scrape()
    assert during[("cpu_manager_pinning_requests_total", ())] == 2
    assert during[("cpu_manager_pinning_errors_total", ())] == 1
    assert during[("cpu_manager_shared_pool_size_millicores", ())] == 6000
    assert during[("cpu_manager_exclusive_cpu_allocation_count", ())] == 2
    assert during[("cpushim_cpuset_updates_total", ())] >= 1  # the shared container moved
    assert during[("cpushim_checkpoint_errors_total", ())] == 3

    await env.engine.container_exited(pinned_id)
    await kubelet.stop(shared_id)
    env.engine.counters["made_up_for_this_test"] = 5  # a counter the table does not know yet

    after = await served.scrape()
    assert after[("cpushim_exits_seen_total", ())] == 1
    assert after[("cpu_manager_exclusive_cpu_allocation_count", ())] == 0
    assert after[("cpu_manager_shared_pool_size_millicores", ())] == 8000
    assert after[("cpushim_made_up_for_this_test_total", ())] == 5
    for key, value in env.engine.counters.items():
        name = KUBELET_COUNTERS[key][0] if key in KUBELET_COUNTERS else f"cpushim_{key}"
        assert after[(f"{name}_total", ())] == value, key


async def test_help_text_is_exported(served: Served) -> None:
    served.metrics.state_loaded = True
    _, _, body = await served.get("/metrics")
    assert "# HELP cpushim_drift_repairs_total " in body
    assert "# TYPE cpu_manager_pinning_requests_total counter" in body
    assert "# TYPE cpu_manager_shared_pool_size_millicores gauge" in body


async def test_the_state_s_gauges_wait_for_the_state(env: Env) -> None:
    # A restarted cpushim serves /metrics while it waits for the runtime and resyncs; its
    # engine's state is empty until then, whatever the checkpoint holds.
    await env.kubelet.start_new(await env.kubelet.run_pod("db", "guaranteed"), "main", 2000)
    metrics = Metrics(env.engine)

    def gauges() -> dict[str, float]:
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for sample in family.samples
            if family.type == "gauge"
        }

    assert gauges() == {}
    metrics.state_loaded = True
    assert gauges() == {
        "cpu_manager_exclusive_cpu_allocation_count": 2,
        "cpu_manager_shared_pool_size_millicores": 6000,
        "cpushim_memory_narrowed_containers": 0,
        "cpushim_stuck_runtime_containers": 0,
    }


# --- /healthz and the HTTP side --------------------------------------------------------------


async def test_healthz_needs_the_state_and_the_runtime(served: Served) -> None:
    status, _, body = await served.get("/healthz")
    assert (status, body) == (503, "state not loaded yet\n")

    served.metrics.state_loaded = True
    served.reason = "runtime unix:///run/containerd.sock:\n connection refused"
    status, _, body = await served.get("/healthz")
    assert (status, body) == (503, "runtime unix:///run/containerd.sock: connection refused\n")

    served.reason = None
    status, _, body = await served.get("/healthz")
    assert (status, body) == (200, "ok\n")
    status, _, body = await served.get("/healthz", method="HEAD")
    assert (status, body) == (200, "")


async def test_healthz_says_so_while_cpushim_shuts_down(served: Served) -> None:
    # The relay takes no new connection from the signal on: a health check must not pass.
    served.metrics.state_loaded = True
    served.metrics.stopping = True
    status, _, body = await served.get("/healthz")
    assert (status, body) == (503, "shutting down\n")
    served.reason = "runtime unix:///run/containerd.sock unreachable"
    assert (await served.get("/healthz"))[2] == "shutting down\n"  # the first reason wins


async def test_other_paths_and_methods_are_refused(served: Served) -> None:
    assert (await served.get("/"))[0] == 404
    assert (await served.get("/metrics", method="POST"))[0] == 405
    assert (await served.get("/metrics?name[]=x"))[0] == 200


async def raw_exchange(served: Served, request: bytes) -> bytes:
    """What the server sends for ``request``, written as is, up to its close."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_connections_beyond_the_bound_are_closed_at_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each idle connection holds a descriptor for the read timeout: unbounded, a client
    opening many could use up cpushim's, and with them kubelet's runtime."""
    monkeypatch.setattr(metrics_module, "MAX_CONNECTIONS", 3)
    # Longer than the test's wait: a close can only be the bound's.
    monkeypatch.setattr(metrics_module, "_READ_TIMEOUT", 60.0)
    address = free_address()
    server = await serve_metrics(Metrics(env.engine), address, lambda: None)
    host, port = address.rsplit(":", 1)
    idle = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
    try:
        await until(lambda: len(server._open) == 3, "three connections served")
        reader, writer = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing read
        writer.close()
        assert len(server._open) == 3
        # One ends: a new one is served.
        idle.pop()[1].close()
        await until(lambda: len(server._open) == 2, "one connection ended")
        assert (await asyncio.to_thread(http_get, f"http://{address}/healthz"))[0] in (200, 503)
    finally:
        for _, idle_writer in idle:
            idle_writer.close()
        await server.close()


async def test_a_garbled_request_is_answered_and_closed(served: Served) -> None:
    answer = await raw_exchange(served, b"nonsense\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ")


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /healthz HTTP/1.0\n\n",  # printf ... | nc
        b"GET /healthz HTTP/1.1\nHost: x\n\n",
        b"\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",  # an empty line before it
    ],
)
async def test_requests_with_bare_line_feeds_are_answered(
    served: Served, request_head: bytes
) -> None:
    served.metrics.state_loaded = True
    answer = await raw_exchange(served, request_head)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\nok\n")


@pytest.mark.parametrize(
    "target",
    [b"http://127.0.0.1:9464/healthz", b"HTTP://node.example/healthz?x=1"],
)
async def test_an_absolute_form_target_is_served_as_its_path(served: Served, target: bytes) -> None:
    """RFC 9112 has servers take a target in absolute form (a proxy's)."""
    served.metrics.state_loaded = True
    answer = await raw_exchange(served, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_a_request_head_too_large_is_refused(served: Served) -> None:
    headers = b"".join(b"X-Filler-%d: %s\r\n" % (n, b"x" * 100) for n in range(100))
    answer = await raw_exchange(served, b"GET /metrics HTTP/1.1\r\n" + headers + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert answer.endswith(b"request head too large\n")


async def test_a_head_request_too_large_is_refused_without_a_body(served: Served) -> None:
    headers = b"".join(b"X-Filler-%d: %s\r\n" % (n, b"x" * 100) for n in range(100))
    answer = await raw_exchange(served, b"HEAD /metrics HTTP/1.1\r\n" + headers + b"\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert body == b""


async def test_a_blank_request_line_is_refused(served: Served) -> None:
    answer = await raw_exchange(served, b"   \r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ")


async def test_no_answer_to_head_has_a_body(served: Served) -> None:
    for request_line in (
        b"HEAD /healthz HTTP/1.1",
        b"HEAD /metrics HTTP/1.1",
        b"HEAD /nowhere HTTP/1.1",
        b"HEAD /metrics HTTP/2.0",  # refused, and still without a body
    ):
        answer = await raw_exchange(served, request_line + b"\r\nHost: x\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 "), request_line
        assert body == b"", request_line


def huge_answer_served(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> tuple[Metrics, list[asyncio.StreamWriter]]:
    """Metrics whose answer fills the socket's buffers, and the writers of the connections
    served, in the order they came."""
    metrics = Metrics(env.engine)
    body = b"#" * (32 << 20)  # more than the kernel's buffers and the transport's limit
    monkeypatch.setattr(metrics, "render", lambda: body)
    writers: list[asyncio.StreamWriter] = []
    serve_one = metrics_module._serve_one

    async def seen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *args: Any) -> None:
        writers.append(writer)
        await serve_one(reader, writer, *args)

    monkeypatch.setattr(metrics_module, "_serve_one", seen)
    return metrics, writers


async def test_a_client_that_never_reads_does_not_keep_its_connection(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its answer fills the socket's buffers; the drain gives up after the read timeout, and
    # the close must not then wait for the client to read the rest.
    monkeypatch.setattr(metrics_module, "_READ_TIMEOUT", 0.2)
    metrics, writers = huge_answer_served(env, monkeypatch)
    address = free_address()
    server = await serve_metrics(metrics, address, lambda: None)
    host, port = address.rsplit(":", 1)
    try:
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect((host, int(port)))
            client.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            await until(lambda: bool(writers), "the request taken")
            # The client reads nothing: the server's end must close all the same.
            await asyncio.wait_for(writers[0].wait_closed(), 30)
    finally:
        await server.close()


async def test_closing_the_server_stops_serving(env: Env) -> None:
    address = free_address()
    server = await serve_metrics(Metrics(env.engine), address, lambda: None)
    assert (await asyncio.to_thread(http_get, f"http://{address}/metrics"))[0] == 200
    await server.close()
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(http_get, f"http://{address}/metrics")


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 on this machine")
async def test_the_unspecified_ipv6_address_serves_ipv4_too(env: Env) -> None:
    # As Go servers, kubelet among them, take it: an operator who writes [::] means every
    # address, and asyncio's own socket would be IPv6 only (IPV6_V6ONLY).
    with socket.socket(socket.AF_INET6) as probe:
        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind(("::", 0))
        port = probe.getsockname()[1]
    server = await serve_metrics(Metrics(env.engine), f"[::]:{port}", lambda: None)
    try:
        for url in (f"http://127.0.0.1:{port}/metrics", f"http://[::1]:{port}/metrics"):
            assert (await asyncio.to_thread(http_get, url))[0] == 200, url
    finally:
        await server.close()


def test_a_bad_address_is_refused() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        asyncio.run(serve_metrics(None, "nowhere", lambda: None))  # type: ignore[arg-type]


# --- the relay's calls -----------------------------------------------------------------------


class Relay(NamedTuple):
    channel: grpc.Channel
    stats: RelayStats
    reset: Callable[[], None]
    runtime: CountingFakeRuntime  # behind the relay, on its loop's thread


@pytest.fixture(scope="module")
def relay() -> Iterator[Relay]:
    """A real RelayServer with a RelayStats observer in front of the fake CRI server."""
    loop = LoopThread()
    stats = RelayStats()
    try:
        with short_tmpdir() as workdir:
            fake = FakeRuntimeServer(workdir / "runtime.sock")
            runtime = fake.runtime = CountingFakeRuntime()
            loop.run(fake.start())
            server = RelayServer(
                listen=f"unix://{workdir}/cri.sock",
                runtime_endpoint=fake.endpoint,
                interceptor=PassthroughInterceptor(),
                observer=stats,
            )
            loop.run(server.start())

            def reset() -> None:
                async def clear() -> None:
                    stats.calls.clear()
                    stats.latencies.clear()

                loop.run(clear())

            try:
                with grpc.insecure_channel(f"unix://{workdir}/cri.sock") as channel:
                    yield Relay(channel, stats, reset, runtime)
            finally:
                loop.run(server.shutdown(2.0))
                loop.run(fake.stop())
    finally:
        loop.stop()


def relay_samples(stats: RelayStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(stats)
    return samples(generate_latest(registry).decode())


def wait_until(condition: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    """Until ``condition`` (of what the relay's loop thread changes) holds; fail after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds}s: {what}")
        time.sleep(0.001)


def settle(stats: RelayStats, calls: int) -> None:
    """The relay reports a call's end as it forwards it, so at most a moment after the client
    has it; wait for that."""
    wait_until(lambda: sum(stats.calls.values()) >= calls, f"the relay counted {calls} calls")


def test_relay_calls_are_counted_by_method_and_code(relay: Relay) -> None:
    channel, stats, reset, _ = relay
    reset()
    for _ in range(3):
        unary(channel, VERSION, b"echo:hi", timeout=10)
    unary(channel, START, b"echo:start", timeout=10)
    assert failure(channel, VERSION, b"error:5:gone", timeout=10).code() == (
        grpc.StatusCode.NOT_FOUND
    )
    assert failure(channel, START, b"error:9:no", timeout=10).code() == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    unary(channel, FUTURE_UNARY, b"echo:new", timeout=10)
    events = list(channel.unary_stream(RUNTIME + "GetContainerEvents")(script(b"stream:3")))
    assert len(events) == 3
    settle(stats, 8)

    got = relay_samples(stats)

    def calls(method: str, code: str) -> float:
        return got.get(("cpushim_relay_calls_total", (("code", code), ("method", method))), 0)

    assert calls(VERSION, "OK") == 3
    assert calls(VERSION, "NOT_FOUND") == 1
    assert calls(START, "OK") == 1
    assert calls(START, "FAILED_PRECONDITION") == 1
    assert calls("other", "OK") == 1  # a method cpushim does not know: one label for all
    assert calls(RUNTIME + "GetContainerEvents", "OK") == 1
    count = ("cpushim_relay_call_duration_seconds_count", (("method", VERSION),))
    assert got[count] == 4
    inf = ("cpushim_relay_call_duration_seconds_bucket", (("le", "+Inf"), ("method", VERSION)))
    assert got[inf] == 4
    total = got[("cpushim_relay_call_duration_seconds_sum", (("method", VERSION),))]
    assert total > 0


def test_calls_that_time_out_or_are_cancelled_count_once(relay: Relay) -> None:
    channel, stats, reset, runtime = relay
    reset()
    tag = ("x-test", "reset")

    def reached_runtime(path: str) -> bool:
        return any(p == path and m.get(tag[0]) == tag[1] for p, _, m in runtime.calls)

    for path in (VERSION, START):
        # The runtime (or the relay's forward, for START) ends it at the deadline.
        error = failure(channel, path, b"sleep:1", timeout=0.2)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # No deadline: the client resets the stream (RST_STREAM CANCEL) when it gives up,
        # once the call has gone through the relay to the runtime.
        future = channel.unary_unary(path).future(script(b"sleep:1"), metadata=(tag,))
        wait_until(functools.partial(reached_runtime, path), f"{path} reached the runtime")
        assert future.cancel()
    settle(stats, 4)
    # The runtime's late answers must not count the calls again: let them all come, then
    # send one more call behind them on the same connection.
    wait_until(lambda: runtime.running == 0, "the runtime done with the calls")
    unary(channel, VERSION, b"echo:after", timeout=10)
    settle(stats, 5)
    assert stats.calls.pop((VERSION, "OK")) == 1
    # At the deadline the client's reset races the runtime's DEADLINE_EXCEEDED; either way
    # each call counts once.
    for path in (VERSION, START):
        assert stats.calls.get((path, "CANCELLED"), 0) >= 1
        assert (
            stats.calls.get((path, "CANCELLED"), 0)
            + stats.calls.get((path, "DEADLINE_EXCEEDED"), 0)
            == 2
        )
    assert {code for _, code in stats.calls} <= {"CANCELLED", "DEADLINE_EXCEEDED"}


# --- reading grpc-status from trailers -------------------------------------------------------


@pytest.mark.parametrize("huffman", [False, True])
def test_grpc_status_is_read_from_trailer_blocks(huffman: bool) -> None:
    encoder = hpack.Encoder()
    encoder.header_table_size = 0
    block = encoder.encode([(b"grpc-status", b"14"), (b"grpc-message", b"x")], huffman=huffman)
    assert grpc_status(block) == 14
    trailers_only = hpack.Encoder().encode(
        [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"0")],
        huffman=huffman,
    )
    assert grpc_status(trailers_only) == 0
    assert grpc_status(hpack.Encoder().encode([(b"grpc-message", b"x")], huffman=huffman)) is None
    assert grpc_status(b"\xbe") is None  # a dynamic table index
    assert grpc_status(b"\x00\x0bgrpc-status\x7f") is None  # truncated


async def test_every_metric_in_the_operations_guide_is_exported(env: Env) -> None:
    guide = (SHIM.parent / "docs" / "operations.md").read_text()
    # The metric table's rows: | `name{labels}` | type | meaning |
    row = r"^\| `((?:cpu_manager|cpushim)_\w+)(?:\{[^}]*\})?` \|"
    documented = set(re.findall(row, guide, re.MULTILINE))
    assert {"cpu_manager_pinning_errors_total", "cpushim_exits_seen_total"} <= documented
    metrics = Metrics(env.engine)
    metrics.state_loaded = True  # the state's gauges show once it is
    metrics.relay.call_finished(VERSION, 0, 0.001)  # labelled families show once they count
    exported = {
        sample.name
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
    }
    # A histogram is documented by its family name; its samples carry suffixes.
    missing = {
        name for name in documented if name not in exported and f"{name}_count" not in exported
    }
    assert not missing, f"docs/operations.md names metrics cpushim does not export: {missing}"


async def test_every_exported_metric_is_in_the_operations_guide(env: Env) -> None:
    guide = (SHIM.parent / "docs" / "operations.md").read_text()
    named = set(re.findall(r"`((?:cpu_manager|cpushim)_\w+)(?:\{[^}]*\})?`", guide))
    metrics = Metrics(env.engine)
    metrics.state_loaded = True
    metrics.relay.call_finished(VERSION, 0, 0.001)
    families = text_string_to_metric_families(metrics.render().decode())
    # A counter family is named without its _total; the guide names the samples.
    exported = {
        f"{family.name}_total" if family.type == "counter" else family.name for family in families
    }
    missing = exported - named
    assert not missing, f"docs/operations.md does not describe these metrics: {sorted(missing)}"


async def test_the_shutdown_ends_the_connections_still_open(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From Python 3.12 a closed server's wait_closed waits for its connections: one whose
    client sent nothing is kept for the read timeout (10 s), and one whose client does not read
    its answer for the drain's timeout and then the close's. The shutdown must not wait for
    them (it is bounded by the grace plus 2 s): it ends them."""
    metrics, writers = huge_answer_served(env, monkeypatch)
    address = free_address()
    server = await serve_metrics(metrics, address, lambda: None)
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as silent, socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((host, int(port)))
        stalled.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        await until(
            lambda: (
                len(writers) == 2 and any(w.transport.get_write_buffer_size() > 0 for w in writers)
            ),
            "both connections taken, one answer waiting for its client to read",
        )
        await asyncio.wait_for(server.close(), 60)  # against a hang only
        assert [w.transport.is_closing() for w in writers] == [True, True]
        silent.settimeout(30)
        assert await asyncio.to_thread(silent.recv, 1) == b""  # closed, not left to time out


# --- what /healthz asks of the runtime's socket ---------------------------------------------------


def test_the_runtime_probe_tells_a_listening_socket_from_a_missing_one() -> None:
    with short_tmpdir() as workdir:
        check_probe_on(workdir / "runtime.sock")


def check_probe_on(path: Path) -> None:
    assert runtime_unreachable(f"unix://{path}") == (
        f"runtime unix://{path} unreachable: [Errno 2] No such file or directory"
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(8)
        assert runtime_unreachable(f"unix://{path}") is None


def test_the_runtime_probe_does_not_wait_on_a_full_listen_backlog() -> None:
    # A runtime too busy to accept: a blocking connect would hold the event loop, and every
    # relayed call with it, until its timeout.
    with contextlib.ExitStack() as stack:
        path = stack.enter_context(short_tmpdir()) / "runtime.sock"
        listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        listener.bind(str(path))
        listener.listen(0)
        while True:  # fill the backlog, never accepting
            client = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            client.setblocking(False)
            try:
                client.connect(str(path))
            except BlockingIOError:
                break
        assert runtime_unreachable(f"unix://{path}") == (
            f"runtime unix://{path} takes no connection now: its listen backlog is full"
        )


async def test_the_guides_check_that_kubelet_comes_through_matches_a_line(env: Env) -> None:
    """docs/operations.md has the operator grep /metrics for kubelet's ListPodSandbox
    calls, its labels written in the order the exposition prints them."""
    guide = " ".join((SHIM.parent / "docs" / "operations.md").read_text().split())
    found = re.search(r"/metrics \| grep '([^']+)'", guide)
    assert found is not None
    pattern = found.group(1)
    assert "ListPodSandbox" in pattern
    metrics = Metrics(env.engine)
    metrics.relay.call_finished(RUNTIME + "ListPodSandbox", 0, 0.001)
    lines = metrics.render().decode().splitlines()
    assert any(pattern in line for line in lines if line.startswith("cpushim_relay_calls_total"))
