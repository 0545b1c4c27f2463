"""Small OCI images built locally from the host's static busybox, for tests without a registry.

The image holds ``/bin/busybox`` and a symlink per applet (``sh``, ``sleep``, ``cat``, ...), a
minimal ``/etc`` and the usual mount points. Its default command is ``sleep infinity``, so the
same image serves as the CRI sandbox ("pause") image and, with a command given per container,
as the workload image.

Builds are deterministic: fixed timestamps and ownership, sorted entries, uncompressed layers, so
the same busybox gives the same image digest on every run and every machine. Built archives are
cached under a temp directory keyed by the busybox binary's digest and the builder version.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import struct
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Bump when the archive layout changes, so cached archives of an older layout are not reused.
_BUILDER_VERSION = "1"

# A fixed, non-zero mtime: some tools treat 0 as "unset".
_EPOCH = 946684800  # 2000-01-01T00:00:00Z

TEST_IMAGE = "docker.io/cpushim/busybox:test"
"""The reference under which :func:`import_image` stores the image by default."""

_BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
_PT_INTERP = 3

_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


class ImageBuildError(RuntimeError):
    """The image could not be built (no static busybox, or busybox misbehaves)."""


@dataclass(frozen=True, slots=True)
class BuiltImage:
    """An OCI image layout archive on disk and what it will be known as once imported."""

    ref: str
    archive: Path
    manifest_digest: str
    config_digest: str


def find_busybox() -> Path:
    """The host's busybox binary; it must be statically linked to run inside the image."""
    for candidate in _BUSYBOX_CANDIDATES:
        path = Path(candidate)
        if path.is_file() and os.access(path, os.X_OK):
            if not _is_static_elf(path):
                raise ImageBuildError(
                    f"{path} is dynamically linked; install busybox-static "
                    "(apt-get install busybox-static)"
                )
            return path
    raise ImageBuildError(
        "no busybox found; install busybox-static (apt-get install busybox-static)"
    )


def _is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a PT_INTERP program header (no dynamic loader)."""
    with path.open("rb") as binary:
        ident = binary.read(16)
        if len(ident) < 16 or not ident.startswith(b"\x7fELF"):
            return False
        is_64 = ident[4] == 2
        order = "<" if ident[5] == 1 else ">"
        header = binary.read(48 if is_64 else 36)
        if is_64:
            (phoff,) = struct.unpack_from(order + "Q", header, 16)
            phentsize, phnum = struct.unpack_from(order + "HH", header, 38)
        else:
            (phoff,) = struct.unpack_from(order + "I", header, 12)
            phentsize, phnum = struct.unpack_from(order + "HH", header, 26)
        for index in range(phnum):
            binary.seek(phoff + index * phentsize)
            (p_type,) = struct.unpack(order + "I", binary.read(4))
            if p_type == _PT_INTERP:
                return False
    return True


def oci_architecture() -> str:
    """The OCI architecture name of this host (``amd64``, ``arm64``, ...)."""
    machine = platform.machine().lower()
    return {
        "x86_64": "amd64",
        "amd64": "amd64",
        "aarch64": "arm64",
        "arm64": "arm64",
        "ppc64le": "ppc64le",
        "s390x": "s390x",
        "riscv64": "riscv64",
    }.get(machine, machine)


def _applets(busybox: Path) -> list[str]:
    listing = subprocess.run(
        [str(busybox), "--list"], check=True, capture_output=True, text=True, timeout=10
    ).stdout
    applets = sorted({name.strip() for name in listing.splitlines() if name.strip()})
    # The image's commands resolve through these; refuse a busybox that lacks the basics.
    missing = {"sh", "sleep", "cat", "echo"} - set(applets)
    if missing:
        raise ImageBuildError(f"{busybox} lacks applets {sorted(missing)}")
    return [name for name in applets if name != "busybox" and "/" not in name]


def _tar_info(
    name: str, kind: bytes, mode: int, size: int = 0, linkname: str = ""
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.linkname = linkname
    info.mtime = _EPOCH
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _layer_bytes(busybox: Path, applets: Iterable[str]) -> bytes:
    """An uncompressed layer tar: the root filesystem of the image, deterministically ordered."""
    files: dict[str, bytes] = {
        "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        "etc/group": b"root:x:0:\nnogroup:x:65534:\n",
    }
    directories = {
        "bin": 0o755,
        "dev": 0o755,
        "etc": 0o755,
        "proc": 0o555,
        "root": 0o700,
        "run": 0o755,
        "sys": 0o555,
        "tmp": 0o1777,
        "var": 0o755,
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as layer:
        for name in sorted(directories):
            layer.addfile(_tar_info(name, tarfile.DIRTYPE, directories[name]))
        busybox_bytes = busybox.read_bytes()
        layer.addfile(
            _tar_info("bin/busybox", tarfile.REGTYPE, 0o755, len(busybox_bytes)),
            io.BytesIO(busybox_bytes),
        )
        for applet in applets:
            layer.addfile(_tar_info(f"bin/{applet}", tarfile.SYMTYPE, 0o777, linkname="busybox"))
        for name in sorted(files):
            content = files[name]
            layer.addfile(
                _tar_info(name, tarfile.REGTYPE, 0o644, len(content)), io.BytesIO(content)
            )
    return buffer.getvalue()


def _canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _image_archive(ref: str, layer: bytes) -> tuple[bytes, str, str]:
    """The OCI image layout tar for ``layer``, its manifest digest and its config digest."""
    layer_digest = _sha256(layer)
    config = _canonical_json(
        {
            "architecture": oci_architecture(),
            "os": "linux",
            "created": "2000-01-01T00:00:00Z",
            "config": {
                "Env": ["PATH=/bin"],
                "Cmd": ["sleep", "infinity"],
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{"created": "2000-01-01T00:00:00Z", "created_by": "cpushim test harness"}],
        }
    )
    config_digest = _sha256(config)
    manifest = _canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": _OCI_MANIFEST,
            "config": {"mediaType": _OCI_CONFIG, "digest": config_digest, "size": len(config)},
            "layers": [{"mediaType": _OCI_LAYER, "digest": layer_digest, "size": len(layer)}],
        }
    )
    manifest_digest = _sha256(manifest)
    index = _canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": _OCI_INDEX,
            "manifests": [
                {
                    "mediaType": _OCI_MANIFEST,
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "platform": {"architecture": oci_architecture(), "os": "linux"},
                    "annotations": {
                        # containerd names the imported image after this annotation.
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": ref.rpartition(":")[2],
                    },
                }
            ],
        }
    )
    entries: dict[str, bytes] = {
        "oci-layout": _canonical_json({"imageLayoutVersion": "1.0.0"}),
        "index.json": index,
    }
    for blob in (layer, config, manifest):
        entries[f"blobs/sha256/{_sha256(blob).removeprefix('sha256:')}"] = blob
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for directory in ("blobs", "blobs/sha256"):
            archive.addfile(_tar_info(directory, tarfile.DIRTYPE, 0o755))
        for name in sorted(entries):
            data = entries[name]
            archive.addfile(_tar_info(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    return buffer.getvalue(), manifest_digest, config_digest


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "cpushim-test-images"


def build_image(ref: str = TEST_IMAGE, cache_dir: Path | None = None) -> BuiltImage:
    """Build (or reuse from the cache) the busybox image archive that will be named ``ref``."""
    busybox = find_busybox()
    busybox_digest = hashlib.sha256(busybox.read_bytes()).hexdigest()
    key = hashlib.sha256(
        f"{_BUILDER_VERSION}\0{ref}\0{busybox_digest}\0{oci_architecture()}".encode()
    ).hexdigest()[:24]
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    archive_path = cache / f"busybox-{key}.tar"
    digests_path = cache / f"busybox-{key}.json"
    if archive_path.is_file() and digests_path.is_file():
        digests = json.loads(digests_path.read_text())
        return BuiltImage(ref, archive_path, digests["manifest"], digests["config"])

    archive, manifest_digest, config_digest = _image_archive(
        ref, _layer_bytes(busybox, _applets(busybox))
    )
    # Write to temp names and rename, so a concurrent or interrupted build never leaves a torn
    # archive that a later run would trust.
    for path, data in (
        (archive_path, archive),
        (digests_path, _canonical_json({"manifest": manifest_digest, "config": config_digest})),
    ):
        fd, temp_name = tempfile.mkstemp(dir=cache, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as temp:
            temp.write(data)
        os.replace(temp_name, path)
    return BuiltImage(ref, archive_path, manifest_digest, config_digest)


def import_image(
    image: BuiltImage,
    address: str,
    *,
    snapshotter: str | None = None,
    namespace: str = "k8s.io",
    ctr: str | None = None,
    timeout: float = 60.0,
) -> None:
    """Import ``image`` into the containerd at ``address`` (a socket path or ``unix://`` URL)."""
    ctr_binary = ctr or shutil.which("ctr")
    if ctr_binary is None:
        raise ImageBuildError("ctr not found on PATH")
    socket_path = address.removeprefix("unix://")
    command = [ctr_binary, "--address", socket_path, "-n", namespace, "images", "import"]
    if snapshotter:
        command += ["--snapshotter", snapshotter]
    command.append(str(image.archive))
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise ImageBuildError(
            f"ctr images import failed ({result.returncode}): {result.stderr.strip()}"
        )
