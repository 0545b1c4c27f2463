"""The Prometheus endpoint: ``/metrics`` and ``/healthz`` on a small HTTP server on the event loop.

Nothing is counted twice: the engine's own counters (``Engine.counters``) and state are read
when Prometheus scrapes, by a custom collector. The relay reports each call's end to a
:class:`RelayStats` (a :class:`~shim.cri.splice.CallObserver`), which keeps plain counts and
histogram buckets; they too become metric families only at scrape time.

Names follow kubelet's CPU manager where kubelet has one (``cpu_manager_*``: kubelet's
``kubelet_cpu_manager_*`` less the ``kubelet_`` prefix, so dashboards built for kubelet's static
policy need that prefix dropped); the rest are ``cpushim_*``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from shim.config import parse_address
from shim.cri.calls import Status
from shim.cri.methods import BY_PATH

if TYPE_CHECKING:
    from shim.engine import Engine
    from shim.state import CPUState

log = logging.getLogger(__name__)

# Engine counters that kubelet's CPU manager also exports, under kubelet's names.
KUBELET_COUNTERS: dict[str, tuple[str, str]] = {
    "pinning_requests": (
        "cpu_manager_pinning_requests",
        "Number of containers that asked for exclusive CPUs",
    ),
    "pinning_errors": (
        "cpu_manager_pinning_errors",
        "Number of exclusive CPU requests that could not be satisfied",
    ),
}

# Every other engine counter, exported as cpushim_<name>_total. A counter the engine uses
# that is missing here is still exported (with a generic help text), and a unit test fails.
ENGINE_COUNTERS: dict[str, str] = {
    "adoptions_refused": (
        "Running containers asking for exclusive CPUs that could not be given any at resync,"
        " at a re-plan (a reload of the policy, CPUs or memory going offline or online), at a"
        " release or at a sweep (each container once while it shares)"
    ),
    "bad_annotations": "CreateContainer calls refused for invalid cpushim pod annotations",
    "bad_names": (
        "CreateContainer calls refused because the pod UID or container name cannot name a"
        " projection directory"
    ),
    "bad_memory_nodes": "CreateContainer calls refused for a cpuset_mems that is not a list"
    " of NUMA nodes",
    "byte_reversed_cpusets": (
        "Drift repairs of a cpuset systemd applied with its bytes reversed (from a runc"
        " older than 1.1.6)"
    ),
    "cgroups_without_cpuset": (
        "Running containers whose cgroup (v2) has no cpuset.cpus: the cpuset controller is"
        " not enabled for it, so their CPUs are not enforced"
    ),
    "cgroup_writes": "Cpusets written straight into a container's cgroup",
    "cgroups_derived": (
        "Started containers whose cgroup and process were found from containerd's layout"
        " (without a ContainerStatus call)"
    ),
    "checkpoint_errors": (
        "Writes of the state checkpoint that failed after the fact (a record of what the"
        " runtime did, a rewrite, an adoption) and their retries; a decision's counts as an"
        " internal error"
    ),
    "child_cpuset_writes": (
        "Cpuset writes that made room for a container's move past the cgroups it made below"
        " its own (cgroup v1): into those cgroups, and widening the container's first"
    ),
    "config_errors": (
        "Config file reads refused, the running config kept: a file bad, gone or unreadable,"
        " or one whose policy could not be built or checkpointed (each refusal counted once)"
    ),
    "config_reloads": "Configuration reloads applied",
    "cpu_hotplug_events": "Kernel uevents telling of CPUs going offline or online",
    "cpu_hotplug_replans": (
        "Re-plans made because the CPUs online changed while cpushim ran (offline, online)"
    ),
    "cpu_hotplug_replans_refused": (
        "Changes of the CPUs online or of the memory nodes the policy could not be planned"
        " with (a reserved CPU went offline); the old plan stayed (each refusal counted once)"
    ),
    "memory_hotplug_events": (
        "Kernel uevents telling of memory blocks or NUMA nodes going offline or online"
    ),
    "memory_hotplug_replans": (
        "Re-plans made because the NUMA nodes with memory changed while cpushim ran, the CPUs"
        " online not (memory hotplug)"
    ),
    "cpu_resizes_applied": (
        "kubelet updates (in-place resizes) that gave a running container another count of"
        " exclusive CPUs, or made it share"
    ),
    "cpu_resizes_not_applied": (
        "kubelet updates (in-place resizes) asking a running container for another count of"
        " exclusive CPUs that cpushim cannot give now (refused: no room, a rule of the"
        " policy; or passed on: it waits for room to be adopted), once per count asked"
    ),
    "cpuset_update_errors": "UpdateContainerResources calls (cpuset moves) the runtime refused",
    "cpuset_updates": "Cpuset moves made through UpdateContainerResources",
    "drift_repairs": "Container cpusets found changed behind cpushim's back and written back",
    "offline_cpus_dropped": (
        "Container cpusets the kernel took CPUs out of as they went offline (cgroup v1),"
        " left so rather than written back (once per container and set)"
    ),
    "exits_seen": (
        "Container exits seen before any StopContainer reply (crashes, completed containers"
        " and most of kubelet's stops); their exclusive CPUs released"
    ),
    "fail_open_forwards": "Calls forwarded unchanged after an internal error (fail-open policy)",
    "failed_exclusive_creates": (
        "Exclusive CreateContainer calls that did not create a container after CPUs were"
        " chosen: refused by the runtime, or cancelled before they went out (the CPUs"
        " were returned)"
    ),
    "startup_status_errors": (
        "PodSandboxStatus (verbose and plain) and ContainerStatus calls that failed at"
        " start-up: the pod was taken from the runtime's list, the container left as it was"
        " (any CPUs it held kept) for a sweep"
    ),
    "unknown_create_outcomes": (
        "CreateContainer calls that went to the runtime and got no answer back (a lost"
        " connection, a reset stream); an exclusive one's CPUs stay held for the container's"
        " next attempt, or until its pod stops, and a sweep looks for the container"
    ),
    "full_resyncs": "Full comparisons of every container's cpuset and the state file",
    "inotify_overflows": "inotify queue overflows (each one triggers a full resync)",
    "untracked_containers_found": (
        "Live containers the runtime had and cpushim did not track (a fail-open create, a"
        " create whose answer was lost, another CRI client's), found by a sweep and taken in"
    ),
    "pods_without_qos": (
        "Pods run whose cgroup parent names no QoS class kubelet makes (kubelet's"
        " cgroupsPerQOS: false, or a pod made by hand): their containers share"
    ),
    "pod_level_resource_pods": (
        "Pods whose containers showed pod-level resources (two asking for exclusive CPUs, one"
        " of them for the whole pod's): none of their containers gets exclusive CPUs"
    ),
    "removed_containers_found": (
        "Tracked containers, and containers holding CPUs that start-up could not read, that"
        " the runtime no longer had (removed by another CRI client, their pod staying), found"
        " by a sweep and forgotten, their CPUs back in the shared pool"
    ),
    "unread_requests": (
        "Followed calls answered OK whose request could not be read (the watchers catch up)"
    ),
    "internal_errors": (
        "Unexpected errors in cpushim's own work: an intercepted call's decision, the work"
        " after a followed call, an adoption after a re-plan, a part of a full look"
    ),
    "periodic_resyncs": "Safety-net resyncs started by the resync period timer",
    "process_exits_seen": "Container processes seen exiting (on a pidfd)",
    "projection_errors": "Failures to write or clean up projection directories",
    "projection_writes": "Projection files written into containers' directories",
    "runtime_records": "Cpusets written to a cgroup that were then recorded with the runtime",
    "runtime_record_errors": (
        "Cpusets written to a cgroup that the runtime refused to record (retried later)"
    ),
    "systemd_records_at_once": (
        "Shrinks of a cpuset systemd holds a larger copy of (cgroup v2, systemd driver),"
        " recorded with the runtime before cpushim went on instead of later"
    ),
    "stuck_runtime_spells": (
        "Times a runtime call about a container went unanswered past its deadline (a hung"
        " containerd shim): its moves were written into its cgroup without waiting for it"
    ),
    "writes_past_stuck_runtime": (
        "Moves written into a container's cgroup while a runtime call about it went"
        " unanswered (written again once that call ended)"
    ),
    "stale_records_reapplied": (
        "Drift repairs of the cpuset the runtime's record held from before a move not yet"
        " told to it, applied again by systemd (a daemon-reload)"
    ),
    "state_rewrites": "Times the state file on disk was found changed and rewritten",
    "watch_errors": (
        "inotify watches that could not be placed, and state directories made again that"
        " could not be made or locked"
    ),
}

# CRI call latencies: fast listing calls take well under a millisecond through the relay, image
# pulls and stops with a grace period take seconds to minutes, streams as long as they last.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_OTHER_METHOD = "other"  # a path that is no CRI method: one label value, however many there are
_CODE_NAMES: dict[int | None, str] = {int(s): s.name for s in Status}
_CODE_NAMES[None] = ""  # no grpc-status seen: an empty label, which Prometheus treats as absent


class _Latencies:
    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.total = 0.0


class RelayStats:
    """Counts and latencies of the calls through the relay; the :class:`RelayServer`'s
    ``observer``. Called on the event loop for every call, so it only adds to numbers."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], int] = {}  # (method, code) -> calls
        self.latencies: dict[str, _Latencies] = {}  # method -> histogram
        self._method_of: dict[str, str] = {}  # path -> method label, for known paths

    def call_finished(self, path: str, status: int | None, seconds: float) -> None:
        method = self._method_of.get(path)
        if method is None:
            if path in BY_PATH:
                method = self._method_of[path] = path
            else:
                method = _OTHER_METHOD
        code = _CODE_NAMES.get(status)
        if code is None:
            code = str(status)
        key = (method, code)
        self.calls[key] = self.calls.get(key, 0) + 1
        hist = self.latencies.get(method)
        if hist is None:
            hist = self.latencies[method] = _Latencies()
        hist.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        hist.total += seconds

    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "cpushim_relay_calls",
            "CRI calls through the relay that ended, by method and gRPC status code",
            labels=("method", "code"),
        )
        for (method, code), count in sorted(self.calls.items()):
            calls.add_metric((method, code), count)
        yield calls
        durations = HistogramMetricFamily(
            "cpushim_relay_call_duration_seconds",
            "Time from a CRI call's request headers to the end of its response, by method",
            labels=("method",),
        )
        for method, hist in sorted(self.latencies.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*LATENCY_BUCKETS, float("inf")), hist.buckets, strict=True):
                cumulative += count
                buckets.append((_bound_label(bound), float(cumulative)))
            durations.add_metric((method,), buckets, hist.total)
        yield durations


def _bound_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class EngineCollector:
    """The engine's counters and CPU state, read at scrape time."""

    def __init__(self, engine: Engine, loaded: Callable[[], bool]) -> None:
        self.engine = engine
        self.loaded = loaded

    def collect(self) -> Iterator[Metric]:
        counters = self.engine.counters
        state = self.engine.state
        for key, (name, text) in KUBELET_COUNTERS.items():
            yield CounterMetricFamily(name, text, value=counters.get(key, 0))
        if self.loaded():
            # Before, the engine holds an empty state, not the checkpoint's: nothing pinned
            # and the whole node shared would be a lie for the wait and the resync.
            yield from self._state_gauges(state)
            yield GaugeMetricFamily(
                "cpushim_memory_narrowed_containers",
                "Live containers whose memory nodes kubelet's memory manager chose include one"
                " without memory now (memory hotplug): their memory is on those of them that"
                " have memory, else on every node with memory",
                value=self.engine.narrowed_memory_containers(),
            )
            yield GaugeMetricFamily(
                "cpushim_stuck_runtime_containers",
                "Live containers a runtime call about which went unanswered past its deadline (a"
                " hung containerd shim), none answered since: their moves are written into"
                " their cgroups without waiting for them",
                value=self.engine.stuck_runtime_containers(),
            )
        names = set(ENGINE_COUNTERS) | (set(counters) - set(KUBELET_COUNTERS))
        for key in sorted(names):
            text = ENGINE_COUNTERS.get(key, f"cpushim engine counter {key}")
            yield CounterMetricFamily(f"cpushim_{key}", text, value=counters.get(key, 0))

    @staticmethod
    def _state_gauges(state: CPUState) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "cpu_manager_shared_pool_size_millicores",
            "Size of the shared CPU pool for non-guaranteed QoS pods, in millicores",
            value=len(state.shared) * 1000,
        )
        yield GaugeMetricFamily(
            "cpu_manager_exclusive_cpu_allocation_count",
            "Number of CPUs exclusively allocated to containers",
            value=sum(len(a.cpus) for a in state.assignments.values()),
        )


class Metrics:
    """What ``/metrics`` and ``/healthz`` report for one engine and its relay.

    ``relay`` goes to :class:`~shim.cri.server.RelayServer` as its ``observer``.
    ``state_loaded`` stays False (``/healthz`` answers 503) until the caller sets it, once the
    engine's state has been loaded and resynced with the runtime. ``stopping``, set once a
    signal has begun the shutdown, fails ``/healthz`` again for the drain that follows.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.relay = RelayStats()
        self.state_loaded = False
        self.stopping = False
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, lambda: self.state_loaded))
        self.registry.register(self.relay)

    def render(self) -> bytes:
        """Every metric in the Prometheus text format 0.0.4 (what every Prometheus reads)."""
        return generate_latest(self.registry)

    def unhealthy(self, healthy: Callable[[], str | None]) -> str | None:
        """Why ``/healthz`` fails, or None when it passes."""
        if self.stopping:
            # The relay takes no new connection from the signal on, though the runtime
            # still answers: a check that passed would call a node fine that cannot start pods.
            return "shutting down"
        if not self.state_loaded:
            return "state not loaded yet"
        return healthy()


# --- the HTTP endpoint ---------------------------------------------------------------------------

_READ_TIMEOUT = 10.0
# Connections served at once; more are closed as they come. Each holds a descriptor for up
# to the read timeout, and cpushim's are kubelet's runtime's too (one scraper uses one).
MAX_CONNECTIONS = 64
_CLOSE_TIMEOUT = 1.0
_MAX_REQUEST_HEAD = 8192
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_TEXT = "text/plain; charset=utf-8"


async def serve_metrics(
    metrics: Metrics, address: str, healthy: Callable[[], str | None]
) -> MetricsServer:
    """Serve ``/metrics`` and ``/healthz`` on ``address`` (``HOST:PORT``) until the returned
    server's :meth:`~MetricsServer.close`.

    ``healthy`` is asked on each ``/healthz`` request: None when the runtime is reachable, else
    a one-line reason; it should answer from what is already known, without I/O.
    """
    host, port = parse_address(address)
    server = MetricsServer(metrics, healthy)
    await server.start(host, port)
    log.info("serving metrics", extra={"fields": {"address": address}})
    return server


class MetricsServer:
    """The HTTP endpoint and the connections it has open, so that its close can end them."""

    def __init__(self, metrics: Metrics, healthy: Callable[[], str | None]) -> None:
        self._metrics = metrics
        self._healthy = healthy
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.WriteTransport] = set()
        self._closing = False

    async def start(self, host: str, port: int) -> None:
        if _unspecified_ipv6(host):
            # asyncio makes an IPv6 socket IPv6 only; [::] means every address to those who
            # write it (Go servers, kubelet among them, listen on both families there).
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((host, port))
                self._server = await asyncio.start_server(self._handle, sock=sock)
            except BaseException:
                sock.close()
                raise
        else:
            self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True)

    async def close(self) -> None:
        """Stop serving and end every connection still open, without waiting for its client.

        From Python 3.12 a server's ``wait_closed`` waits for all its connections, and a
        client that sends nothing, or does not read its answer, holds its own for the read
        timeout and more: past the shutdown's bound (the grace plus 2 s), which this close
        comes after. Python 3.13's ``Server.abort_clients`` does this; 3.12's has none.
        """
        self._closing = True
        if self._server is None:
            return
        self._server.close()
        for transport in list(self._open):
            transport.abort()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing or len(self._open) >= MAX_CONNECTIONS:
            # Accepted before the close, its handler run after it; or one too many.
            writer.transport.abort()
            return
        self._open.add(writer.transport)
        try:
            await _serve_one(reader, writer, self._metrics, self._healthy)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception:
            log.exception("metrics endpoint request failed")
        finally:
            writer.close()
            # A close with data unsent waits for the client to read it: one that never does
            # would hold the connection for ever. Waited for, not cancelled: the wait is on
            # the connection's own future.
            closed = asyncio.ensure_future(writer.wait_closed())
            if not (await asyncio.wait({closed}, timeout=_CLOSE_TIMEOUT))[0]:
                writer.transport.abort()
            with contextlib.suppress(Exception):
                await closed
            self._open.discard(writer.transport)


def _unspecified_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host) == ipaddress.IPv6Address("::")
    except ValueError:  # a host name
        return False


async def _serve_one(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    metrics: Metrics,
    healthy: Callable[[], str | None],
) -> None:
    async with asyncio.timeout(_READ_TIMEOUT):
        request_line, whole = await _read_head(reader)
    parts = request_line.split()
    head_only = parts[:1] == [b"HEAD"]
    if not whole:
        _respond(writer, 400, _TEXT, b"request head too large\n", head_only=head_only)
        return
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        _respond(writer, 400, _TEXT, b"bad request line\n", head_only=head_only)
        return
    method, target = parts[0], _path_of(parts[1])
    if target not in (b"/metrics", b"/healthz"):
        _respond(writer, 404, _TEXT, b"not found; try /metrics or /healthz\n", head_only=head_only)
        return
    if method not in (b"GET", b"HEAD"):
        _respond(writer, 405, _TEXT, b"only GET and HEAD\n", extra=b"Allow: GET, HEAD\r\n")
        return
    if target == b"/metrics":
        _respond(writer, 200, CONTENT_TYPE_PLAIN_0_0_4, metrics.render(), head_only=head_only)
    else:
        reason = metrics.unhealthy(healthy)
        if reason is None:
            _respond(writer, 200, _TEXT, b"ok\n", head_only=head_only)
        else:
            line = " ".join(reason.split()) + "\n"
            _respond(writer, 503, _TEXT, line.encode(), head_only=head_only)
    async with asyncio.timeout(_READ_TIMEOUT):  # a client that never reads holds nothing
        await writer.drain()


def _path_of(target: bytes) -> bytes:
    """A request target's path: its query dropped, and an absolute-form target's scheme and
    authority (a proxy's ``GET http://host:port/metrics``, which RFC 9112 has servers take)."""
    path = target.split(b"?", 1)[0]
    scheme, separator, rest = path.partition(b"://")
    if separator and scheme.lower() in (b"http", b"https"):
        path = b"/" + rest.partition(b"/")[2]
    return path


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """A request's first line, its header lines read and dropped, and whether the head was
    whole (False: larger than ``_MAX_REQUEST_HEAD``, the line as far as it was read). Lines
    may end in a bare LF, as RFC 9112 lets a server take them (``printf 'GET /healthz
    HTTP/1.0\\n\\n' | nc``), and empty lines before the request line are skipped.
    IncompleteReadError when the client stops early."""
    request_line = b""
    size = 0
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # longer than the reader's own limit
            return request_line, False
        if not line.endswith(b"\n"):
            raise asyncio.IncompleteReadError(line, None)
        size += len(line)
        if size > _MAX_REQUEST_HEAD:
            return request_line or line[:16], False
        line = line.rstrip(b"\r\n")
        if not line:
            if request_line:
                return request_line, True
        elif not request_line:
            request_line = line


def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    content_type: str,
    body: bytes,
    *,
    head_only: bool = False,
    extra: bytes = b"",
) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
    ).encode() + extra
    writer.write(head + b"\r\n" + (b"" if head_only else body))
