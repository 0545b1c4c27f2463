"""``cpushim run``: wait for the runtime, serve the CRI socket, shut down cleanly on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from shim import __version__, notify
from shim.cgroups import CgroupError, CgroupLayout
from shim.checkpoint import CheckpointFile
from shim.cpuset import CPUSet
from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.server import Interceptor, RelayServer
from shim.cri.upstream import Forward, RuntimeChannel, unix_path
from shim.engine import Engine, EngineOptions, FailurePolicy, ProjectionSettings
from shim.engine.hotplug import CPUFollower
from shim.engine.reloading import ConfigReloader
from shim.engine.resync import CALL_TIMEOUT, SANDBOX_INFO_TIMEOUT
from shim.engine.resync import start as resync
from shim.engine.watching import Watcher
from shim.metrics import Metrics, serve_metrics
from shim.policy import CPUPolicy
from shim.policy.none import NonePolicy
from shim.policy.options import StaticPolicyOptions
from shim.policy.reserved import ReservedCPUsError
from shim.policy.static import StaticPolicy
from shim.progress import StartupProgress
from shim.topology import SysfsWarnings, Topology

log = logging.getLogger("shim.run")

T = TypeVar("T")

IMAGE_SERVICE_PREFIX = "/runtime.v1.ImageService/"
VERSION_PATH = "/runtime.v1.RuntimeService/Version"
# How long one Version call of the start-up wait may take; the last ones get what is left of
# --upstream-wait, but not less than the floor (a runtime that answers at all answers in it).
PROBE_TIMEOUT = 5.0
PROBE_TIMEOUT_FLOOR = 1.0


@dataclass(frozen=True)
class RunOptions:
    """What ``cpushim run`` does. The defaults here are the built-in ones: the config file
    (``shim.config``) overrides them and the command line overrides both."""

    listen: str = "unix:///run/cpushim/cri.sock"
    runtime_endpoint: str = "unix:///run/containerd/containerd.sock"
    # shim.config.resolve makes this follow runtime_endpoint unless it is set.
    image_endpoint: str = "unix:///run/containerd/containerd.sock"
    socket_group: str | None = None
    upstream_wait: float = 60.0
    shutdown_grace: float = 10.0
    policy: str = "static"
    reserved_cpus: str | None = None
    reserved_cpu_count: int | None = None
    policy_options: tuple[str, ...] = ()
    state_dir: Path = Path("/var/lib/cpushim")
    sysfs_root: Path = Path("/sys")
    failure_policy: FailurePolicy = "fail-closed"
    recover_from_runtime: bool = False
    # 0 turns the safety-net resync off.
    resync_period: float = 300.0
    projection_dir: Path = Path("/run/cpushim/projection")
    # A path inside each container, not on this host.
    projection_mount_path: Path = Path("/run/cpushim")
    # HOST:PORT of the Prometheus endpoint; "" switches it off.
    metrics_address: str = "127.0.0.1:9464"
    event_loop: str = "auto"
    log_level: str = "info"
    # Where these came from, so that a reload can read the file again and keep the flags.
    config_path: Path | None = None
    cli_overrides: frozenset[str] = frozenset()


class SettingError(ValueError):
    """A setting the machine cannot meet (its value was well-formed): names the config key
    and the flag, as a refusal of the file does."""

    def __init__(self, key: str, flag: str, message: str) -> None:
        super().__init__(f"{key} ({flag}): {message}")
        self.key = key


# kubelet's static policy refuses to start without reserved CPUs; cpushim takes the lowest core's
# first thread when none are named, so the shared pool always has a home.
DEFAULT_RESERVED_COUNT = 1


def build_policy(options: RunOptions, warned: SysfsWarnings | None = None) -> CPUPolicy:
    """The policy from the command line; ValueError (with the reason) when it cannot be.
    ``warned``: what earlier reads of sysfs warned of, not told again."""
    topology = Topology.from_sysfs(options.sysfs_root, warned)
    if options.policy == "none":
        if options.policy_options:
            # Named both ways: the same check refuses a flag and a reloaded config file.
            raise ValueError(
                "policy options ([cpuManagerPolicyOptions], --policy-option) need the static"
                " policy; empty them to switch to none"
            )
        return NonePolicy(topology)
    if options.policy != "static":
        raise ValueError(f"unknown policy {options.policy!r}: want none or static")
    if options.reserved_cpus is not None and options.reserved_cpu_count is not None:
        raise ValueError(
            "give reservedSystemCPUs (--reserved-cpus) or reservedCPUCount"
            " (--reserved-cpu-count), not both"
        )
    reserved = CPUSet.parse(options.reserved_cpus) if options.reserved_cpus is not None else None
    count = options.reserved_cpu_count
    if reserved is None and count is None:
        count = DEFAULT_RESERVED_COUNT
    try:
        return StaticPolicy.create(
            topology,
            reserved=reserved,
            reserved_count=count,
            options=StaticPolicyOptions.parse(options.policy_options),
        )
    except ReservedCPUsError as exc:
        if reserved is not None:
            raise SettingError("reservedSystemCPUs", "--reserved-cpus", str(exc)) from None
        raise SettingError("reservedCPUCount", "--reserved-cpu-count", str(exc)) from None


class SeparateImageService:
    """Routes ImageService calls to their own endpoint when it is not the runtime's: they are
    answered by the relay over a channel to that endpoint (they are all unary)."""

    def __init__(self, inner: Interceptor, image_channel: RuntimeChannel) -> None:
        self._inner = inner
        self._images = image_channel

    def intercepts(self, path: str) -> bool:
        return path.startswith(IMAGE_SERVICE_PREFIX) or self._inner.intercepts(path)

    def amends(self, path: str) -> bool:
        return not path.startswith(IMAGE_SERVICE_PREFIX) and self._inner.amends(path)

    async def handle(self, call: UnaryCall, forward: Forward) -> Reply:
        if call.path.startswith(IMAGE_SERVICE_PREFIX):
            return await self._images.unary(call)
        return await self._inner.handle(call, forward)


async def wait_for_runtime(channel: RuntimeChannel, budget: float) -> Reply:
    """Version calls with backoff until the runtime answers or ``budget`` seconds pass."""
    deadline = time.monotonic() + budget
    delay, attempt = 0.1, 0
    while True:
        attempt += 1
        # No probe outlasts the budget by more than a second: a runtime that takes the
        # connection and never answers would otherwise hold the last one its 5 s.
        timeout = min(PROBE_TIMEOUT, max(deadline - time.monotonic(), PROBE_TIMEOUT_FLOOR))
        probe = UnaryCall(path=VERSION_PATH, headers=(), request=b"", timeout=timeout)
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


def cgroup_layout() -> CgroupLayout | None:
    """Where cpusets live here; None (every move through the runtime) when that is unclear."""
    try:
        layout = CgroupLayout.detect()
    except (OSError, CgroupError) as exc:
        log.warning(
            "cannot find the cpuset hierarchy; containers move through the runtime only",
            extra={"fields": {"error": str(exc)}},
        )
        return None
    log.info(
        "cgroups",
        extra={"fields": {"version": int(layout.version), "cpuset_root": str(layout.root)}},
    )
    return layout


async def run(options: RunOptions) -> int:
    # The topology is read again at each re-plan, and the memory nodes at each check of the
    # CPU follower: what stays wrong in sysfs is told once, not at every read.
    warned = SysfsWarnings()
    policy = build_policy(options, warned)
    checkpoint = CheckpointFile(options.state_dir)
    try:
        checkpoint.hold()
    except OSError as exc:
        # A file in its place, a read-only mount, a path outside the unit's ReadWritePaths.
        raise RuntimeError(
            f"cannot use the state directory {options.state_dir} (stateDir, --state-dir):"
            f" {exc.strerror or exc}"
        ) from exc
    try:
        leftovers = checkpoint.remove_leftovers()
        if leftovers:
            log.warning(
                "removed what interrupted checkpoint writes left behind",
                extra={"fields": {"files": [str(p) for p in leftovers]}},
            )
        return await _run(options, policy, checkpoint, warned)
    finally:
        # The drain may have ended with an engine task's write still in its worker thread.
        await checkpoint.close()


async def _run(
    options: RunOptions, policy: CPUPolicy, checkpoint: CheckpointFile, warned: SysfsWarnings
) -> int:
    runtime = RuntimeChannel(options.runtime_endpoint)
    engine = Engine(
        policy,
        checkpoint,
        runtime,
        EngineOptions(failure_policy=options.failure_policy),
        cgroups=cgroup_layout(),
        projection=ProjectionSettings(options.projection_dir, options.projection_mount_path),
    )
    interceptor: Interceptor = engine
    image_channel: RuntimeChannel | None = None
    if options.image_endpoint != options.runtime_endpoint:
        image_channel = RuntimeChannel(options.image_endpoint)
        interceptor = SeparateImageService(interceptor, image_channel)
    metrics = Metrics(engine)
    server = RelayServer(
        listen=options.listen,
        runtime_endpoint=options.runtime_endpoint,
        interceptor=interceptor,
        socket_group=options.socket_group,
        runtime=runtime,
        observer=metrics.relay,
        follower=engine,
    )
    # From here on SIGTERM and SIGINT stop cpushim cleanly, whatever it is doing: waiting for
    # the runtime (which may take --upstream-wait), resyncing with it, or serving.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloader: ConfigReloader | None = None

    def hang_up() -> None:
        # What operators send for "read your config" (systemctl reload): by default it
        # would end the process with none of the shutdown's work done.
        if reloader is not None:
            log.info(
                "SIGHUP: reading the config file again", extra={"fields": {"path": reloader.path}}
            )
            reloader.read_again()
        elif options.config_path is None:
            log.info("SIGHUP: there is no config file to read again (--config); ignored")
        else:
            log.info("SIGHUP: the config file is read once the resync is done")

    loop.add_signal_handler(signal.SIGHUP, hang_up)
    async with contextlib.AsyncExitStack() as cleanup:
        # However _run ends: stopped, refused at start-up, or done.
        cleanup.callback(runtime.close)
        if image_channel is not None:
            cleanup.callback(image_channel.close)
        if options.metrics_address:
            # Before the wait for the runtime: /healthz answers 503 meanwhile, saying why.
            try:
                metrics_server = await serve_metrics(
                    metrics,
                    options.metrics_address,
                    lambda: runtime_unreachable(options.runtime_endpoint),
                )
            except OSError as exc:
                raise RuntimeError(
                    f"cannot serve metrics on {options.metrics_address}: {exc}"
                    ' (metricsAddress, --metrics-address; "" switches them off)'
                ) from exc
            cleanup.push_async_callback(metrics_server.close)
        # A listen path that cannot serve (another process on it, a file in its place, a
        # directory that cannot be made) is told now, not after the wait and a resync that
        # may move every container.
        server.check_listen_path()
        notify.status(f"waiting for the runtime {options.runtime_endpoint}")
        version = await _unless_stopped(
            wait_for_runtime(server.runtime, options.upstream_wait), stop
        )
        if version is None:
            log.info("stopped before the runtime answered")
            return 0
        log.info(
            "policy",
            extra={
                "fields": {
                    "policy": policy.name,
                    "reserved": str(policy.reserved),
                    "options": sorted(policy.option_names),
                    "online": str(policy.topology.online),
                    "isolated": str(policy.topology.isolated),
                    "state": str(engine.checkpoint.path),
                }
            },
        )
        # A resync goes sandbox by sandbox and container by container, each call up to 10 s on
        # a loaded runtime: a signal must not wait for all of them, past the unit's stop
        # timeout. Cut short, it is as if cpushim had crashed there, which the checkpoint
        # is made for: the next start resyncs again.
        progress = StartupProgress()
        extender = StartTimeoutExtender(progress, start_extension(engine.options.update_timeout))
        extending = loop.create_task(extender.run(PROGRESS_LOOK_INTERVAL))
        try:
            resynced = await _unless_stopped(
                resync(
                    engine, recover_from_runtime=options.recover_from_runtime, progress=progress
                ),
                stop,
            )
        finally:
            extending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await extending
        if resynced is None:
            metrics.stopping = True
            log.info("stopped before the resync with the runtime was done")
            await engine.drain(LAST_WRITES_S)
            return 0
        metrics.state_loaded = True
        watcher = Watcher(
            engine, resync_period=options.resync_period, sysfs_root=options.sysfs_root
        )
        watcher.start()
        follower: CPUFollower | None = None

        async def stop_watching() -> None:
            if follower is not None:
                follower.stop()
            if reloader is not None:
                reloader.stop()
            await watcher.stop()

        try:
            if options.config_path is not None:
                reloader = ConfigReloader(
                    watcher, options, functools.partial(build_policy, warned=warned)
                )
                reloader.start()
            follower = CPUFollower(
                watcher,
                lambda: reloader.options if reloader is not None else options,
                build_policy,
                lock=reloader.replanning if reloader is not None else None,
                warned=warned,
            )
            follower.start()
            # Checked before the resync, the listen path may have been taken since.
            await server.start()
        except BaseException:
            # Ended as a shutdown ends, less the calls (none was served): the watcher's
            # looks and retries would go on against a closed channel until the loop ends,
            # and the engine's last work (the runtime's records of the moves just written
            # into cgroups) would be dropped rather than done.
            metrics.stopping = True
            await stop_watching()
            await engine.drain(LAST_WRITES_S)
            raise
        log.info(
            "serving",
            extra={
                "fields": {
                    "listen": options.listen,
                    "runtime": options.runtime_endpoint,
                    "image": options.image_endpoint,
                    "runtime_reply_bytes": sum(len(m) for m in version.messages),
                    # After an upgrade, whether the process serving is the new one.
                    "version": __version__,
                }
            },
        )
        # The state is resynced and the socket serves: systemd may start kubelet now.
        notify.ready(f"serving {options.listen}; {len(engine.state.assignments)} pinned")
        pinging = _keep_watchdog_fed()
        await stop.wait()
        metrics.stopping = True
        if pinging is not None:
            pinging.cancel()
        notify.stopping()
        stop.clear()  # a second signal ends the grace period at once
        log.info("shutting down", extra={"fields": {"grace_s": options.shutdown_grace}})
        finished = await shut_down(server, engine, options.shutdown_grace, stop, stop_watching)
        log.info("stopped", extra={"fields": {"calls_finished": finished}})
        return 0


# What the engine's last work (the checkpoint of the last changes, the runtime's records)
# gets at least, when the calls in flight took the whole grace or a second signal came.
LAST_WRITES_S = 1.0


class _ShutsDown(Protocol):
    async def shutdown(self, grace: float, cut_short: asyncio.Event | None = None) -> bool: ...


class _Drains(Protocol):
    async def drain(self, grace: float) -> None: ...


async def shut_down(
    server: _ShutsDown,
    engine: _Drains,
    grace: float,
    cut_short: asyncio.Event,
    stop_watching: Callable[[], Awaitable[None]],
) -> bool:
    """Let calls in flight finish, then the engine's work, all within one ``grace`` (plus
    the server's wait for dropped connections and ``LAST_WRITES_S``, 2 s at most), so that
    a unit's stop timeout sized for the grace holds;
    True when every call finished. A second signal (``cut_short``) ends the wait for calls,
    or for the engine's work if the calls were done, and leaves the engine its last second."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    finished = await server.shutdown(grace, cut_short=cut_short)
    await stop_watching()
    if not cut_short.is_set():
        # Calls that ended early leave the engine most of the grace (a full look at a slow
        # runtime may be under way): a second signal must end that wait too.
        await _unless_stopped(engine.drain(max(deadline - loop.time(), LAST_WRITES_S)), cut_short)
    if cut_short.is_set():
        await engine.drain(LAST_WRITES_S)
    return finished


async def _unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """``work``'s result, or None (and ``work`` cancelled) if ``stop`` is set first."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def runtime_unreachable(endpoint: str) -> str | None:
    """Why the runtime's socket does not take a connection now, or None when it does: what
    /healthz reports. No CRI call is made. The connect does not block: a Unix socket's
    connect either completes at once or, when the runtime's listen backlog is full, would
    wait, and waiting here would hold every relayed call on the loop."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(unix_path(endpoint))
        except BlockingIOError:
            return f"runtime {endpoint} takes no connection now: its listen backlog is full"
        except OSError as exc:
            return f"runtime {endpoint} unreachable: {exc}"
    return None


# How often start-up's progress is looked at while it resyncs.
PROGRESS_LOOK_INTERVAL = 5.0


def start_extension(update_timeout: float) -> float:
    """How long systemd is asked to wait for start-up's next word each time it has made
    progress (``EXTEND_TIMEOUT_USEC=``). The longest one step of the resync may take when
    nothing is stuck is one runtime call's deadline, two for a sandbox whose shim hangs (its
    verbose status given up, then the plain one); a step seen done just after one look is
    told at the next: twice that plus a look's interval leaves slack for a loaded node.
    Not more: past ``TimeoutStartSec=``, a start-up stuck on one call (a checkpoint write
    on a hung disk, a cgroup write the kernel never completes) is ended within this of its
    last step, and the restart starts over, rather than kubelet waiting for ever."""
    longest_step = max(SANDBOX_INFO_TIMEOUT + CALL_TIMEOUT, update_timeout)
    return 2 * longest_step + PROGRESS_LOOK_INTERVAL


class StartTimeoutExtender:
    """Tells systemd that start-up is getting on, at each look that finds progress made
    since the one before; at none while it is stuck, so that systemd's start timeout
    still ends a start-up that will never finish."""

    def __init__(
        self,
        progress: StartupProgress,
        extension: float,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self.progress = progress
        self.extension = extension
        self._environ = environ
        self._seen = progress.steps

    def look(self) -> bool:
        """``EXTEND_TIMEOUT_USEC=`` with ``STATUS=`` saying where start-up is, when it
        made progress since the last look; True when that was sent."""
        if self.progress.steps == self._seen:
            return False
        self._seen = self.progress.steps
        return notify.extend_timeout(self.extension, self.progress.describe(), self._environ)

    async def run(self, interval: float) -> None:
        """Look every ``interval`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.look()


def _keep_watchdog_fed() -> asyncio.Task[None] | None:
    """Ping systemd's watchdog (``WatchdogSec=``) from the event loop while cpushim serves:
    a loop stuck for the whole timeout stops the pings, and systemd restarts cpushim, which
    resyncs from the runtime. None when systemd asks for no pings."""
    interval = notify.watchdog_interval()
    if interval is None:
        return None

    async def feed() -> None:
        while True:
            notify.watchdog()
            await asyncio.sleep(interval)

    return asyncio.get_running_loop().create_task(feed())
