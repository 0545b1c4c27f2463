"""What a guest boots from, built once and cached: kernel, initramfs, root file system and
the Python packages cpushim and its tests need; plus the per-session payload (a wheel of the
checkout and the test sources).

Everything comes from the machine's own registries, never from the network at run time:
the kernel is Debian's ``linux-image-*-amd64`` (``apt-get download``), the root is a
``debootstrap --variant=minbase`` of the host's release, the Python packages are installed
from PyPI into a directory with the host's pip (the guest's Python has the same minor
version). The cache lives in ``$CPUSHIM_VM_CACHE`` (default ``~/.cache/cpushim/vm``); each
item is built into a temporary sibling and renamed into place, so an interrupted build never
leaves a half-made item that a later run would trust.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness.images import find_busybox

REPO_ROOT = Path(__file__).resolve().parents[2]
GUEST_DIR = Path(__file__).resolve().parent

# The guest's own packages; python3 runs cpushim and the scenarios, busybox-static the
# initramfs and the test image, systemd is PID 1 of the guests with the systemd cgroup driver.
GUEST_PACKAGES = ("containerd", "runc", "busybox-static", "python3", "systemd")
# What the initramfs loads before it can mount the root over virtio-9p, and overlay for
# containerd's snapshotter. Their dependencies are found from each module's modinfo.
GUEST_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
# Mount points the guest's init needs in the (read-only) root.
GUEST_MOUNT_POINTS = ("mnt/deps", "mnt/payload", "mnt/results")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
XZ_MAGIC = b"\xfd7zXZ\x00"


class AssetError(RuntimeError):
    """An asset could not be built; the message says which and why."""


@dataclass
class StageTimes:
    """Wall-clock seconds per named stage, in the order they ran (printed at the end)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started


@dataclass(frozen=True, slots=True)
class GuestAssets:
    kernel: Path  # a plain vmlinux, bootable as PVH
    initramfs: Path
    root: Path
    deps: Path  # site-packages of cpushim's and the tests' dependencies


def cache_dir() -> Path:
    configured = os.environ.get("CPUSHIM_VM_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "cpushim" / "vm"


def _run(command: list[str], what: str, *, cwd: Path | None = None, timeout: float = 600) -> str:
    try:
        result = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise AssetError(f"{what}: {command[0]} did not finish in {timeout:.0f} s") from None
    except FileNotFoundError:
        raise AssetError(f"{what}: {command[0]} is not installed") from None
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
        raise AssetError(f"{what}: {' '.join(command)} exited {result.returncode}:\n{tail}")
    return result.stdout


def _cached(target: Path, build: Callable[[Path], None]) -> Path:
    """Build ``target`` through a temporary sibling unless it is already there."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(scratch)
        scratch.rename(target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _digest(*parts: str | bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part.encode() if isinstance(part, str) else part)
        hasher.update(b"\0")
    return hasher.hexdigest()[:16]


# -- kernel ------------------------------------------------------------------------------------


def kernel_package() -> tuple[str, str]:
    """The package and version that ``linux-image-amd64`` points at on this machine."""
    depends = _run(["apt-cache", "depends", "linux-image-amd64"], "finding the guest kernel")
    match = re.search(r"Depends: (linux-image-[0-9][^\s]*-amd64)\b", depends)
    if match is None:
        raise AssetError(f"apt-cache knows no kernel for linux-image-amd64:\n{depends}")
    package = match.group(1)
    policy = _run(["apt-cache", "policy", package], "finding the guest kernel's version")
    version = re.search(r"Candidate: (\S+)", policy)
    if version is None or version.group(1) == "(none)":
        raise AssetError(f"no candidate version of {package}:\n{policy}")
    return package, version.group(1)


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The kernel ELF inside a bzImage whose payload is xz-compressed (Debian's), so that
    QEMU can boot it directly through its PVH entry point, skipping the real-mode setup."""
    start = bzimage.find(XZ_MAGIC)
    if start < 0:
        raise AssetError("the kernel image has no xz payload (not an xz-compressed bzImage)")
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    elf = decompressor.decompress(bzimage[start:])
    if not decompressor.eof or not elf.startswith(b"\x7fELF"):
        raise AssetError("the kernel image's xz payload did not decompress to an ELF file")
    return elf


def build_kernel(directory: Path) -> None:
    """``vmlinux`` and ``modules/`` (the kernel's module tree) from Debian's package."""
    package, _version = kernel_package()
    download = directory / "download"
    download.mkdir()
    _run(["apt-get", "download", package], f"downloading {package}", cwd=download)
    debs = list(download.glob("*.deb"))
    if len(debs) != 1:
        raise AssetError(f"apt-get download {package} left {debs}")
    unpacked = directory / "unpacked"
    _run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], f"unpacking {debs[0].name}")
    images = list((unpacked / "boot").glob("vmlinuz-*"))
    module_roots = list((unpacked / "lib" / "modules").iterdir())
    if len(images) != 1 or len(module_roots) != 1:
        raise AssetError(f"{package} holds {images} and {module_roots}, expected one of each")
    (directory / "vmlinux").write_bytes(extract_vmlinux(images[0].read_bytes()))
    module_roots[0].rename(directory / "modules")
    shutil.rmtree(download)
    shutil.rmtree(unpacked)


def kernel_dir() -> Path:
    package, version = kernel_package()
    return _cached(cache_dir() / f"kernel-{package}-{version}", build_kernel)


# -- initramfs ---------------------------------------------------------------------------------


def module_paths(modules_root: Path) -> dict[str, Path]:
    """Module name (dashes as underscores, as the kernel names them) -> its .ko file."""
    return {path.stem.replace("-", "_"): path for path in modules_root.rglob("*.ko")}


def module_dependencies(path: Path) -> list[str]:
    """The ``depends=`` list of a module's modinfo (the package ships no modules.dep)."""
    match = re.search(rb"\0depends=([^\0]*)\0", path.read_bytes())
    if match is None:
        return []
    return [name.replace("-", "_") for name in match.group(1).decode().split(",") if name]


def module_load_order(modules_root: Path, wanted: tuple[str, ...]) -> list[Path]:
    """``wanted`` and everything they depend on, each after its dependencies."""
    paths = module_paths(modules_root)
    order: list[str] = []

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in chain:
            raise AssetError(f"module dependency cycle: {' -> '.join((*chain, name))}")
        if name not in paths:
            raise AssetError(f"module {name} is not in {modules_root}")
        for dependency in module_dependencies(paths[name]):
            visit(dependency, (*chain, name))
        order.append(name)

    for name in wanted:
        visit(name, ())
    return [paths[name] for name in order]


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio archive in the kernel's initramfs format ("newc"): (name, mode, data) entries,
    directories before what they hold, then the trailer."""
    out = io.BytesIO()
    for inode, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        encoded = name.encode() + b"\0"
        fields = (inode, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        header = b"070701" + b"".join(f"{value:08x}".encode() for value in fields)
        out.write(header + encoded)
        out.write(b"\0" * (-(len(header) + len(encoded)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))
    return out.getvalue()


def build_initramfs(kernel: Path, busybox: Path, init_script: bytes) -> bytes:
    modules = module_load_order(kernel / "modules", GUEST_MODULES)
    directory, executable, regular = 0o040755, 0o100755, 0o100644
    entries: list[tuple[str, int, bytes]] = [
        ("bin", directory, b""),
        ("bin/busybox", executable, busybox.read_bytes()),
        ("init", executable, init_script),
        ("modules", directory, b""),
        ("modules/order", regular, "".join(f"{p.stem}\n" for p in modules).encode()),
    ]
    entries += [(f"modules/{path.name}", regular, path.read_bytes()) for path in modules]
    return gzip.compress(cpio_newc(entries), compresslevel=1)


def initramfs_file(kernel: Path) -> Path:
    # A static busybox: the initramfs has no libc for a dynamic one to load.
    busybox = find_busybox()
    init_script = (GUEST_DIR / "initramfs-init.sh").read_bytes()
    key = _digest(kernel.name, init_script, busybox.read_bytes(), *GUEST_MODULES)

    def build(directory: Path) -> None:
        (directory / "initramfs.img").write_bytes(build_initramfs(kernel, busybox, init_script))

    return _cached(cache_dir() / f"initramfs-{key}", build) / "initramfs.img"


# -- root file system --------------------------------------------------------------------------


def host_release() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "VERSION_CODENAME" and value:
            return value.strip('"')
    raise AssetError("/etc/os-release names no VERSION_CODENAME to debootstrap")


def build_root(directory: Path, release: str, mirror: str) -> None:
    root = directory / "root"
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(GUEST_PACKAGES)}",
            release,
            str(root),
            mirror,
        ],
        f"debootstrap {release} from {mirror}",
        timeout=900,
    )
    shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    for mount_point in GUEST_MOUNT_POINTS:
        (root / mount_point).mkdir(parents=True, exist_ok=True)
    # containerd copies the node's /etc/hosts into host-network sandboxes.
    (root / "etc" / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost\n")
    (root / "etc" / "hostname").write_text("cpushim-vm\n")


def root_dir() -> Path:
    release = host_release()
    mirror = os.environ.get("CPUSHIM_VM_MIRROR", DEFAULT_MIRROR)
    key = _digest(release, *GUEST_PACKAGES, *GUEST_MOUNT_POINTS, "hosts")
    return (
        _cached(cache_dir() / f"root-{release}-{key}", lambda d: build_root(d, release, mirror))
        / "root"
    )


def guest_python_version(root: Path) -> str:
    candidates = sorted(p.name for p in (root / "usr" / "bin").glob("python3.*") if p.is_file())
    versions = [name.removeprefix("python") for name in candidates if name.count(".") == 1]
    if not versions:
        raise AssetError(f"no python3.X in {root}/usr/bin")
    return versions[-1]


# -- Python packages ---------------------------------------------------------------------------


def requirements(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """cpushim's dependencies and its test extras, as pinned in pyproject.toml."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["test"]]


def deps_dir() -> Path:
    """cpushim's and the tests' packages for this Python's minor version, which must be the
    guest's (checked by :func:`guest_assets` once the root is there)."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    wanted = requirements()

    def build(directory: Path) -> None:
        _run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--target", str(directory / "site"), *wanted],
            "installing the guest's Python packages",
        )  # fmt: skip

    key = _digest(*wanted, "compiled")
    return _cached(cache_dir() / f"deps-py{python}-{key}", build) / "site"


def guest_assets(times: StageTimes) -> GuestAssets:
    """Every asset, built side by side when not cached (debootstrap is the long pole)."""

    def kernel_and_initramfs() -> tuple[Path, Path]:
        with times.stage("kernel"):
            kernel = kernel_dir()
        with times.stage("initramfs"):
            return kernel, initramfs_file(kernel)

    def python_packages() -> Path:
        with times.stage("python packages"):
            return deps_dir()

    with times.stage("assets, side by side"), ThreadPoolExecutor(max_workers=2) as pool:
        boot = pool.submit(kernel_and_initramfs)
        packages = pool.submit(python_packages)
        with times.stage("root file system"):
            root = root_dir()
        kernel, initramfs = boot.result()
        deps = packages.result()
    guest_python = guest_python_version(root)
    host_python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if guest_python != host_python:
        raise AssetError(
            f"the guest has Python {guest_python} and these tests run on {host_python}: the"
            f" packages are installed with this Python's pip, so run the VM tests on Python"
            f" {guest_python}"
        )
    return GuestAssets(kernel / "vmlinux", initramfs, root, deps)


# -- the session's payload ---------------------------------------------------------------------


def build_payload(directory: Path) -> Path:
    """A wheel of this checkout installed into ``site/``, the test sources into ``src/``
    and the guest's init script: what every guest of the session mounts read-only."""
    wheels = directory / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
         "--no-deps", "-w", str(wheels), str(REPO_ROOT)],
        "building a wheel of the checkout",
    )  # fmt: skip
    wheel = next(iter(wheels.glob("cpushim-*.whl")), None)
    if wheel is None:
        raise AssetError(f"pip wheel left no cpushim wheel in {wheels}")
    _run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-deps", "--target", str(directory / "site"), str(wheel)],
        "installing the wheel into the payload",
    )  # fmt: skip
    source = directory / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    (source / "tests").mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "tests" / "__init__.py", source / "tests" / "__init__.py")
    for package in ("harness", "vm"):
        shutil.copytree(REPO_ROOT / "tests" / package, source / "tests" / package, ignore=ignore)
    # Compiled here: the guest's shares are read-only and, under emulation, compiling every
    # module at each import would cost minutes. Python 3.X.y releases share one bytecode
    # format, so the host's 3.11 writes what the guest's 3.11 reads.
    _run([sys.executable, "-m", "compileall", "-q", str(source)], "compiling the test sources")
    shutil.copy2(GUEST_DIR / "guest-init.sh", directory / "guest-init.sh")
    return directory
