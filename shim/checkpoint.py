"""The checkpoint file: ``state.json`` in the state directory, replaced atomically.

A write is: write a temporary file beside it, fsync it, rename it over ``state.json``, fsync
the directory. A crash at any point leaves either the old checkpoint or the new one, never a
mix, and once ``save`` returns the new one survives a power cut. The whole sequence runs in one
worker thread so the event loop keeps relaying calls meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Final

from shim.state import CheckpointError, CPUState, decode_checkpoint, encode_checkpoint

STATE_FILE: Final = "state.json"


class CheckpointFile:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / STATE_FILE
        self.writes = 0
        # What cpushim last wrote: the file should hold exactly this while it runs.
        self.last_written: bytes | None = None
        # The state those bytes hold.
        self.saved: CPUState | None = None

    def load(self) -> CPUState | None:
        """The saved state, None when there is none; CheckpointError when it is unreadable."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc.strerror}") from exc
        try:
            return decode_checkpoint(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from exc

    def save_sync(self, state: CPUState) -> None:
        data = encode_checkpoint(state)
        write_atomically(self.path, data)
        self.writes += 1
        self.last_written = data
        self.saved = state

    async def save(self, state: CPUState) -> None:
        data = encode_checkpoint(state)
        await asyncio.to_thread(write_atomically, self.path, data)
        self.writes += 1
        self.last_written = data
        self.saved = state

    def on_disk(self) -> bytes | None:
        """The file's bytes now; None when it is missing or unreadable."""
        try:
            return self.path.read_bytes()
        except OSError:
            return None


def write_atomically(path: Path, data: bytes, mode: int = 0o600) -> None:
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    # A name of its own per write, so two writes in flight never share a temporary file.
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    temporary = Path(name)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
