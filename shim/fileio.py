"""Small files read and written with plain system calls.

cpushim reads cgroupfs, procfs and its own state file several times per pod. Python's
``open()`` wraps each descriptor in buffered file objects and adds an ``fstat``, an ``ioctl``
and two ``lseek`` calls per file; on a hot path a bare ``open``/``read``/``close`` is all the
kernel needs.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# A regular file is read in as few calls as this allows; procfs and cgroupfs hand out at most
# a page per read(2) whatever is asked, and say they are done only with an empty read.
_CHUNK = 65536


def read_file(path: str | Path) -> bytes:
    """The whole file's bytes; OSError as ``open()`` raises it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            return chunk
        chunks = [chunk]
        while chunk := os.read(fd, _CHUNK):
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def read_regular_file(path: str | Path) -> bytes:
    """The whole of a regular file; OSError as ``open()`` raises it, and EINVAL for anything
    else at the path. The open does not block: a FIFO put there would wait for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks = []
        while chunk := os.read(fd, _CHUNK):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_and_sync(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (a short write goes on where it stopped), then fsync."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def identity(path: str | Path) -> tuple[int, int] | None:
    """Which file or directory ``path`` names now (device, inode); None when it names none.
    A watch placed on a directory follows that directory, not its name: a different
    identity under the name means the watch is on something else."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino
