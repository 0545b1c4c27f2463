"""``/proc/self/mountinfo``, parsed: where each file system is mounted, and its type. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Mount", "parse_mountinfo"]


@dataclass(frozen=True)
class Mount:
    point: Path
    fstype: str
    super_options: tuple[str, ...]
    # The directory of the file system this mount shows ("/" for the whole of it; a bind
    # mount of a subdirectory shows that subdirectory).
    root: str = "/"


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order; malformed lines are skipped."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        separator = fields.index("-")
        if separator < 5 or len(fields) < separator + 3:
            continue
        super_options = fields[separator + 3].split(",") if len(fields) > separator + 3 else []
        mounts.append(
            Mount(
                Path(_unescape(fields[4])),
                fields[separator + 1],
                tuple(super_options),
                _unescape(fields[3]),
            )
        )
    return mounts


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as three octal digits."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
