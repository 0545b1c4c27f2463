"""A private containerd for end-to-end tests: own root, state, sockets and runc root.

Usage::

    with PrivateContainerd(sandbox_image=TEST_IMAGE) as containerd:
        containerd.import_image(build_image())
        ...  # talk CRI to containerd.address

Two instances can run at once: everything containerd, its shims and runc keep on disk lives
under the instance's temp directory, and the shim sockets containerd derives under
/run/containerd/s/ are hashed from the instance's own socket path. What the instances do share
is the cgroup tree (containers go wherever their pod's ``cgroup_parent`` says); :meth:`stop`
removes only the cgroups of containers that belonged to this instance.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shim.cgroups import CGROUP_EVENTS, expand_slice, populated
from tests.harness.images import BuiltImage, import_image

CGROUP_ROOT = Path("/sys/fs/cgroup")
# kubelet's --cgroup-driver, which must be containerd's too: cgroup paths, or systemd slices
# and scopes (systemd must then be PID 1).
CgroupDriver = Literal["cgroupfs", "systemd"]
CRI_NAMESPACE = "k8s.io"

# Plugins this harness never uses; disabling them makes startup quicker and its log quieter.
_DISABLED_PLUGINS = (
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.internal.v1.opt",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
)


class ContainerdError(RuntimeError):
    """containerd did not start, or a ``ctr`` command failed."""


def wait_for(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    *,
    interval: float = 0.02,
    on_timeout: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition`` until it holds; raise TimeoutError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            detail = f"\n{on_timeout()}" if on_timeout is not None else ""
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}{detail}")
        time.sleep(interval)


def terminate(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, wait, SIGKILL after ``timeout``: returns once the process has exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)


def socket_accepts(path: Path) -> bool:
    """True when a Unix stream socket at ``path`` accepts a connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def overlayfs_works(directory: Path) -> bool:
    """True if an overlay filesystem can be mounted with its layers inside ``directory``.

    Probed by mounting one, since overlayfs depends on the kernel, the backing filesystem
    (e.g. not on overlay or some tmpfs setups) and the mount namespace we are in.
    """
    probe = Path(tempfile.mkdtemp(prefix="overlay-probe-", dir=directory))
    try:
        for part in ("lower", "upper", "work", "merged"):
            (probe / part).mkdir()
        options = f"lowerdir={probe / 'lower'},upperdir={probe / 'upper'},workdir={probe / 'work'}"
        mounted = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(probe / "merged")],
            capture_output=True,
            timeout=10,
            check=False,
        )
        if mounted.returncode != 0:
            return False
        subprocess.run(
            ["umount", str(probe / "merged")], capture_output=True, timeout=10, check=True
        )
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a valid TOML basic string


class _InDir:
    """A path in a PrivateContainerd's ``dir``, read like a property (and, like ``dir``, only
    once containerd is started)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: PrivateContainerd, owner: type[PrivateContainerd]) -> Path:
        return instance.dir / self.name


class PrivateContainerd:
    """A containerd process of its own, with the CRI plugin configured for these tests.

    The CRI plugin uses the cgroupfs driver (or systemd's, when asked), host networking only
    (no CNI), ``sandbox_image``
    set to a locally imported image (nothing can be pulled here) and
    ``restrict_oom_score_adj = true``: without CAP_SYS_RESOURCE, containerd may not lower a
    process's oom_score_adj below its own, and sandboxes fail to start unless it clamps.
    """

    def __init__(
        self,
        sandbox_image: str,
        *,
        base_dir: Path | None = None,
        snapshotter: str | None = None,
        start_timeout: float = 30.0,
        containerd_binary: str = "containerd",
        ctr_binary: str = "ctr",
        runc_binary: str = "runc",
        log_level: str = "info",
        cgroup_driver: CgroupDriver = "cgroupfs",
    ) -> None:
        self.sandbox_image = sandbox_image
        self.cgroup_driver = cgroup_driver
        self._base_dir_parent = base_dir
        self._requested_snapshotter = snapshotter
        self.start_timeout = start_timeout
        self._containerd = containerd_binary
        self._ctr = ctr_binary
        self._runc = runc_binary
        self.log_level = log_level
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self.snapshotter = ""

    # -- paths ------------------------------------------------------------------------------

    @property
    def dir(self) -> Path:
        if self._dir is None:
            raise ContainerdError("containerd is not started")
        return self._dir

    socket_path = _InDir("containerd.sock")
    root = _InDir("root")
    state = _InDir("state")
    runc_root = _InDir("runc")
    config_path = _InDir("config.toml")
    log_path = _InDir("containerd.log")

    @property
    def address(self) -> str:
        """The CRI endpoint, as kubelet's ``--container-runtime-endpoint`` would name it."""
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> PrivateContainerd:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._process is not None:
            raise ContainerdError("containerd is already started")
        for binary in (self._containerd, self._ctr, self._runc):
            if shutil.which(binary) is None:
                raise ContainerdError(f"{binary} not found on PATH")
        self._dir = Path(tempfile.mkdtemp(prefix="cpushim-containerd-", dir=self._base_dir_parent))
        try:
            self.snapshotter = self._requested_snapshotter or (
                "overlayfs" if overlayfs_works(self.dir) else "native"
            )
            for directory in (self.root, self.state, self.runc_root, self.dir / "cni"):
                directory.mkdir(parents=True, exist_ok=True)
            self.config_path.write_text(self.render_config())
            self._launch()
        except BaseException:
            self.stop()
            raise

    def restart(self, timeout: float = 20.0) -> None:
        """Stop the containerd process alone and start it again on the same root, state and
        socket, as ``systemctl restart containerd`` does on a node: the containers (their
        shims) run on, and containerd finds them again when it starts."""
        process, self._process = self._process, None
        if process is None:
            raise ContainerdError("containerd is not started")
        terminate(process, timeout)
        self._launch()

    def _launch(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    self._containerd,
                    "--config",
                    str(self.config_path),
                    "--log-level",
                    self.log_level,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: a Ctrl-C meant for pytest must not reach containerd
                # before the harness has stopped the containers in order.
                start_new_session=True,
            )
        wait_for(
            self._ready,
            self.start_timeout,
            f"containerd socket {self.socket_path}",
            on_timeout=self.log_tail,
        )

    def _ready(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            raise ContainerdError(
                f"containerd exited with {self._process.returncode} during startup\n"
                + self.log_tail()
            )
        return socket_accepts(self.socket_path)

    def render_config(self) -> str:
        cri = '[plugins."io.containerd.grpc.v1.cri"]'
        runc = f"{cri[:-1]}.containerd.runtimes.runc]"
        disabled = ", ".join(_toml_string(name) for name in _DISABLED_PLUGINS)
        return "\n".join(
            [
                "version = 2",
                f"root = {_toml_string(str(self.root))}",
                f"state = {_toml_string(str(self.state))}",
                f"disabled_plugins = [{disabled}]",
                "",
                "[grpc]",
                f"  address = {_toml_string(str(self.socket_path))}",
                "",
                "[ttrpc]",
                f"  address = {_toml_string(str(self.dir / 'containerd.sock.ttrpc'))}",
                "",
                "[debug]",
                '  address = ""',
                "",
                "[metrics]",
                '  address = ""',
                "",
                cri,
                f"  sandbox_image = {_toml_string(self.sandbox_image)}",
                "  restrict_oom_score_adj = true",
                "  systemd_cgroup = false",
                "  disable_apparmor = true",
                "  enable_selinux = false",
                # Port 0: an ephemeral port, so two instances do not fight over 10010.
                '  stream_server_address = "127.0.0.1"',
                '  stream_server_port = "0"',
                "  disable_tcp_service = true",
                "",
                f"{cri[:-1]}.containerd]",
                f"  snapshotter = {_toml_string(self.snapshotter)}",
                '  default_runtime_name = "runc"',
                "",
                runc,
                '  runtime_type = "io.containerd.runc.v2"',
                "",
                f"{runc[:-1]}.options]",
                f"  BinaryName = {_toml_string(shutil.which(self._runc) or self._runc)}",
                # runc's own state under this instance, so cleanup can find (only) its containers.
                f"  Root = {_toml_string(str(self.runc_root))}",
                f"  SystemdCgroup = {str(self.cgroup_driver == 'systemd').lower()}",
                "",
                f"{cri[:-1]}.cni]",
                f"  bin_dir = {_toml_string(str(self.dir / 'cni'))}",
                f"  conf_dir = {_toml_string(str(self.dir / 'cni'))}",
                "",
            ]
        )

    def stop(self, timeout: float = 20.0) -> None:
        """Stop containerd and clean up after it, even after a failed test.

        Order: note the containers still present (their cgroup paths live in the task bundles),
        stop containerd, kill and delete what runc still runs, end the shims, unmount what is
        left under the instance directory, remove the containers' cgroups, delete the directory.
        """
        if self._dir is None:
            return
        leftover_cgroups = self._leftover_cgroup_paths()
        process, self._process = self._process, None
        if process is not None:
            terminate(process, timeout)
        self._kill_runc_containers()
        self._kill_shims()
        self._unmount_under(self.dir)
        for cgroup_path in leftover_cgroups:
            remove_cgroup(cgroup_path, with_empty_pod_parent=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        self._dir = None

    # -- helpers ----------------------------------------------------------------------------

    def ctr(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        """Run ``ctr --address <socket> -n k8s.io ARGS...`` and return its stdout."""
        result = subprocess.run(
            [self._ctr, "--address", str(self.socket_path), "-n", CRI_NAMESPACE, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise ContainerdError(
                f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result.stdout

    def import_image(self, image: BuiltImage, timeout: float = 60.0) -> None:
        """Import ``image`` into the CRI namespace, unpacked for this instance's snapshotter."""
        import_image(
            image,
            str(self.socket_path),
            snapshotter=self.snapshotter,
            namespace=CRI_NAMESPACE,
            ctr=shutil.which(self._ctr),
            timeout=timeout,
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no containerd log)"
        return "containerd log (tail):\n" + "\n".join(text.splitlines()[-lines:])

    def _leftover_cgroup_paths(self) -> list[str]:
        """Cgroup paths of containers whose task bundles are still present."""
        paths: list[str] = []
        tasks = self.state / "io.containerd.runtime.v2.task"
        for config in sorted(tasks.glob("*/*/config.json")):
            try:
                spec = json.loads(config.read_text())
            except (OSError, ValueError):
                continue
            cgroup_path = spec.get("linux", {}).get("cgroupsPath", "")
            if isinstance(cgroup_path, str) and cgroup_path.startswith("/"):
                paths.append(cgroup_path)
        return paths

    def _kill_runc_containers(self) -> None:
        if not self.runc_root.is_dir():
            return
        for namespace_root in sorted(p for p in self.runc_root.iterdir() if p.is_dir()):
            listing = subprocess.run(
                [self._runc, "--root", str(namespace_root), "list", "--format", "json"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            try:
                containers = json.loads(listing.stdout or "null") or []
            except ValueError:
                containers = []
            for container in containers:
                container_id = str(container.get("id", ""))
                if not container_id:
                    continue
                subprocess.run(
                    [self._runc, "--root", str(namespace_root), "delete", "--force", container_id],
                    capture_output=True,
                    timeout=30,
                    check=False,
                )

    def _shim_pids(self) -> list[int]:
        """Processes of containerd-shim-runc-v2 started for this instance (by socket path)."""
        marker = str(self.socket_path).encode()
        pids: list[int] = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and marker in argv:
                pids.append(int(entry.name))
        return pids

    def _kill_shims(self) -> None:
        for pid in self._shim_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not self._shim_pids(), 10.0, "containerd shims to exit")

    @staticmethod
    def _unmount_under(directory: Path) -> None:
        prefix = str(directory.resolve()) + "/"
        for mount_point in sorted(_mount_points(), key=len, reverse=True):
            if mount_point.startswith(prefix):
                subprocess.run(
                    ["umount", "--lazy", mount_point], capture_output=True, timeout=10, check=False
                )


def _mount_points() -> list[str]:
    points: list[str] = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            if len(fields) > 4:
                # Field 5 is the mount point, with spaces and the like octal-escaped.
                points.append(fields[4].encode().decode("unicode_escape"))
    return points


def cgroup_hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (``/sys/fs/cgroup/cpuset``, ...), or the unified
    one alone where ``/sys/fs/cgroup`` is cgroup v2 (the VM tests' v2 guest)."""
    if not CGROUP_ROOT.is_dir():
        return []
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]
    return sorted(
        path
        for path in CGROUP_ROOT.iterdir()
        if path.is_dir() and not path.is_symlink() and (path / "cgroup.procs").exists()
    )


def remove_cgroup(cgroup_path: str, *, with_empty_pod_parent: bool = False) -> None:
    """Best effort: rmdir ``cgroup_path`` in every hierarchy (only empty cgroups go).

    With ``with_empty_pod_parent``, also its parent when that is a pod cgroup (``pod<uid>``)
    and empty, which is what kubelet would remove once the pod is gone. systemd's names (a
    pod's ``<slice>``, a container's ``<slice>:<prefix>:<id>``) go through systemd instead.
    """
    if cgroup_path.endswith(".slice") or (
        not cgroup_path.startswith("/") and cgroup_path.count(":") == 2
    ):
        slice_name, _, scope = cgroup_path.partition(":")
        if with_empty_pod_parent or not scope:
            stop_empty_pod_slice(slice_name)
        return
    relative = cgroup_path.strip("/")
    if not relative:
        return
    for hierarchy in cgroup_hierarchies():
        target = hierarchy / relative
        with contextlib.suppress(OSError):
            target.rmdir()
        parent = target.parent
        if with_empty_pod_parent and parent.name.startswith("pod") and parent != hierarchy:
            with contextlib.suppress(OSError):
                parent.rmdir()


def stop_empty_pod_slice(slice_name: str) -> None:
    """What kubelet does with the systemd driver once a pod is gone: stop its slice. A scope
    goes by itself when its last process exits; a slice stays until it is stopped. Only a
    pod slice that cgroup v2 reports empty is stopped: stopping a slice kills what runs in
    it, and elsewhere (cgroup v1, an unreadable file) emptiness cannot be told."""
    if "-pod" not in slice_name or not Path("/run/systemd/system").is_dir():
        return
    try:
        events = (CGROUP_ROOT / expand_slice(slice_name) / CGROUP_EVENTS).read_text()
    except (OSError, ValueError):
        return
    if populated(events) is False:
        subprocess.run(
            ["systemctl", "stop", slice_name], capture_output=True, timeout=30, check=False
        )


# -- a relay in front of containerd -----------------------------------------------------------


def cpushim_command(
    listen: str, runtime_endpoint: str, *extra: str, state_dir: Path, log_level: str = "debug"
) -> list[str]:
    """The command line that starts cpushim (its contract with these tests). ``state_dir``
    is required so that no test writes the node's real checkpoint; the projection directories
    go beside it (``<state_dir>-projection``). Metrics are off unless ``extra`` turns them on
    (a later flag wins), so that cpushims of several tests never compete for a port."""
    return [
        sys.executable,
        "-m",
        "shim",
        "run",
        "--listen",
        listen,
        "--runtime-endpoint",
        runtime_endpoint,
        "--state-dir",
        str(state_dir),
        "--projection-dir",
        str(projection_dir_for(state_dir)),
        "--metrics-address",
        "",
        "--log-level",
        log_level,
        *extra,
    ]


def projection_dir_for(state_dir: Path) -> Path:
    """Where :func:`cpushim_command` has cpushim write the projection directories."""
    return state_dir.with_name(f"{state_dir.name}-projection")


class ServingProcessError(RuntimeError):
    """A serving process exited, or did not listen in time; the message carries its log."""


@dataclass
class ServingProcess:
    """A subprocess that serves on a Unix socket (cpushim in front of containerd).

    :meth:`start` returns once the socket accepts connections; its stdout and stderr go to
    ``log_path``, which error messages quote.
    """

    command: list[str]
    socket_path: Path
    log_path: Path
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 20.0) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        process = self.process

        def listening() -> bool:
            if process.poll() is not None:
                raise ServingProcessError(
                    f"{self.command[0]} exited with {process.returncode} before listening on "
                    f"{self.socket_path}; its log:\n{self.log()}"
                )
            return socket_accepts(self.socket_path)

        try:
            wait_for(listening, timeout, f"a listener on {self.socket_path}", on_timeout=self.log)
        except TimeoutError as error:
            self.stop()
            raise ServingProcessError(str(error)) from None
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait, SIGKILL after ``timeout``; returns the exit code (None if never run)."""
        process = self.process
        if process is None:
            return None
        terminate(process, timeout)
        return process.returncode
