"""Leftovers of a process killed mid-way, made by the real code paths (not hand-written)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# write_atomically in a child that is SIGKILLed where a crash would hurt most: the temporary
# file written and fsync'd, not yet renamed over the target.
_KILLED_BEFORE_RENAME = """
import os, signal, sys
from pathlib import Path
from shim import checkpoint
def killed(*args):
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.os.replace = killed
checkpoint.write_atomically(Path(sys.argv[1]), b'{"half": "written"}')
"""


def interrupted_checkpoint_write(target: Path) -> Path:
    """Start writing ``target`` as the checkpoint does (a temporary file beside it) and kill
    the writer before the rename; returns the temporary file it left."""
    before = set(target.parent.iterdir()) if target.parent.exists() else set()
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_BEFORE_RENAME, str(target)], cwd=REPO, check=False
    )
    assert result.returncode == -9, f"the writer was not killed: exit {result.returncode}"
    (left,) = set(target.parent.iterdir()) - before
    return left
