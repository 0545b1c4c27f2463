"""A grpc-go CRI client (``goclient/main.go``), built offline from Debian's Go packages.

kubelet talks CRI through grpc-go. cpushim depends on its clients applying
``SETTINGS_HEADER_TABLE_SIZE = 0`` to their HPACK encoders (docs/architecture.md,
"Self-contained header blocks"), so the tests drive it with grpc-go itself, not only with
grpcio. There is no Go module proxy here: the client is built in GOPATH mode against the
sources the ``golang-google-grpc-dev`` package installs under ``/usr/share/gocode/src``
(grpc-go 1.33 and its dependencies, which apt pulls in).

Usage::

    binary = build_goclient()  # cached; rebuilt when main.go or the toolchain changes
    version = GoRequest("/runtime.v1.RuntimeService/Version")
    run = run_goclient(binary, address, [version], calls=20)
    assert all(call.ok for call in run.calls)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "goclient" / "main.go"
GOPATH = Path("/usr/share/gocode")
GRPC_SOURCES = GOPATH / "src" / "google.golang.org" / "grpc"
APT_PACKAGES = ("golang-go", "golang-google-grpc-dev")
INSTALL_HINT = f"apt-get install {' '.join(APT_PACKAGES)}, or run contrib/bootstrap.sh"

BUILD_TIMEOUT = 300.0


class GoClientError(RuntimeError):
    """The Go client could not be built, or a run of it failed (the message says why)."""


def missing_go_prerequisites() -> list[str]:
    """What is missing to build the Go client, as reasons a test can skip or fail with."""
    missing: list[str] = []
    if shutil.which("go") is None:
        missing.append("go on PATH")
    if not (GRPC_SOURCES / "clientconn.go").is_file():
        missing.append(f"grpc-go sources in {GRPC_SOURCES}")
    return missing


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "cpushim-goclient"


def _go_version() -> str:
    result = subprocess.run(
        ["go", "version"], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise GoClientError(f"`go version` failed: {result.stderr.strip()}")
    return result.stdout.strip()


def _grpc_version() -> str:
    """grpc-go's declared version (its version.go), so an upgraded package forces a rebuild."""
    try:
        return (GRPC_SOURCES / "version.go").read_text()
    except OSError:
        return ""


_built: dict[Path, Path] = {}


def build_goclient(cache_dir: Path | None = None) -> Path:
    """The path of the built client: reused from the cache when its sources are unchanged.

    The cache key covers main.go, the Go toolchain's version and grpc-go's version, so any of
    them changing gives a new binary. The first build of a session takes seconds (grpc-go and
    its dependencies compile from source); later ones reuse the binary.
    """
    missing = missing_go_prerequisites()
    if missing:
        raise GoClientError(
            f"cannot build the grpc-go client: missing {'; '.join(missing)} ({INSTALL_HINT})"
        )
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    if cache in _built and _built[cache].is_file():
        return _built[cache]
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, _go_version().encode(), _grpc_version().encode()])
    ).hexdigest()[:24]
    binary = cache / f"goclient-{key}"
    if not binary.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        # Build under a temp name and rename, so an interrupted or concurrent build never leaves
        # a torn binary that a later run would trust.
        fd, temp_name = tempfile.mkstemp(dir=cache, prefix=f".{binary.name}.")
        os.close(fd)
        env = {
            **os.environ,
            # GOPATH mode: imports resolve from Debian's packaged sources, never the network.
            "GO111MODULE": "off",
            "GOPATH": str(GOPATH),
            "GOFLAGS": "",
            "GOCACHE": str(cache / "go-build"),
            # Pure Go: no C compiler needed, and the binary depends on nothing at run time.
            "CGO_ENABLED": "0",
        }
        try:
            result = subprocess.run(
                ["go", "build", "-o", temp_name, str(SOURCE)],
                capture_output=True,
                text=True,
                env=env,
                timeout=BUILD_TIMEOUT,
                check=False,
            )
            if result.returncode != 0:
                raise GoClientError(
                    f"go build {SOURCE} failed ({result.returncode}):\n"
                    f"{result.stdout}{result.stderr}"
                )
            os.replace(temp_name, binary)
        finally:
            if os.path.exists(temp_name):
                os.unlink(temp_name)
    _built[cache] = binary
    return binary


@dataclass(frozen=True, slots=True)
class GoRequest:
    """A method to call and its request message, as protobuf bytes (empty: an empty message)."""

    method: str
    request: bytes = b""


@dataclass(frozen=True, slots=True)
class GoCall:
    """One call's outcome as the grpc-go client saw it."""

    request: GoRequest
    code: int
    code_name: str  # grpc-go's spelling: "OK", "InvalidArgument", "NotFound", ...
    message: str
    reply_length: int
    reply_sha256: str
    reply: bytes | None  # the reply's bytes, with ``print_replies``
    elapsed_us: int

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def ok(self) -> bool:
        return self.code == 0


@dataclass(frozen=True, slots=True)
class GoClientRun:
    """Every call of one run (one connection), in order, and the run's summary."""

    calls: list[GoCall]
    summary: Mapping[str, Any]
    stderr: str

    def of(self, request: GoRequest) -> list[GoCall]:
        """The calls made with ``request``, in order."""
        return [call for call in self.calls if call.request == request]


def run_goclient(
    binary: Path,
    address: str,
    requests: Sequence[GoRequest],
    *,
    calls: int = 1,
    call_timeout: float = 10.0,
    print_replies: bool = False,
    timeout: float = 120.0,
) -> GoClientRun:
    """Run the client on one connection to ``address``: ``calls`` calls of each request, the
    requests interleaved (r1, r2, r1, r2, ...)."""
    if not requests:
        raise ValueError("no requests")
    command = [str(binary), "-addr", address, "-calls", str(calls), "-timeout", f"{call_timeout}s"]
    for request in requests:
        command += ["-method", request.method, "-request-hex", request.request.hex()]
    if print_replies:
        command.append("-print-replies")
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise GoClientError(
            f"goclient on {address} exited with {result.returncode}:\n"
            f"{result.stdout}{result.stderr}"
        )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    if not lines or not lines[-1].get("summary"):
        raise GoClientError(f"goclient printed no summary:\n{result.stdout}{result.stderr}")
    parsed = [
        GoCall(
            request=requests[int(line["call"]) % len(requests)],
            code=int(line["code"]),
            code_name=str(line["code_name"]),
            message=str(line["message"]),
            reply_length=int(line["reply_length"]),
            reply_sha256=str(line["reply_sha256"]),
            # An empty reply's hex is left out of its line (omitempty).
            reply=bytes.fromhex(line.get("reply_hex", "")) if print_replies else None,
            elapsed_us=int(line["elapsed_us"]),
        )
        for line in lines[:-1]
    ]
    expected = calls * len(requests)
    if len(parsed) != expected:
        raise GoClientError(f"goclient reported {len(parsed)} calls; {expected} were asked for")
    return GoClientRun(calls=parsed, summary=lines[-1], stderr=result.stderr)
