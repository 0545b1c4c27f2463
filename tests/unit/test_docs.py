"""The documents' links between each other: every relative link names a file of the checkout,
and every ``#anchor`` a heading of the document it points into, as GitHub renders them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    [
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "systemd").rglob("*.md"),
        *(REPO / "contrib").rglob("*.md"),
    ]
)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.MULTILINE)


def prose(path: Path) -> str:
    """The document without its code blocks, where a ``#`` or a ``](`` is code."""
    return _FENCE.sub("", path.read_text())


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces made hyphens."""
    text = re.sub(r"`", "", heading.lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a document's headings; a repeated one gets ``-1``, ``-2``, ... after it."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(prose(path)):
        name = anchor(heading)
        count = seen.get(name, 0)
        seen[name] = count + 1
        found.add(name if count == 0 else f"{name}-{count}")
    return found


def links(path: Path) -> Iterator[str]:
    for target in _LINK.findall(prose(path)):
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            yield target


def test_the_anchor_rule_is_githubs() -> None:
    assert anchor("Invariants (what the tests prove)") == "invariants-what-the-tests-prove"
    assert anchor("CPUs going offline and online") == "cpus-going-offline-and-online"
    assert anchor("Python: `repin_workers.py`") == "python-repin_workerspy"


def test_there_are_links_to_check() -> None:
    assert REPO / "docs" / "operations.md" in DOCUMENTS
    assert sum(1 for path in DOCUMENTS for target in links(path) if "#" in target) >= 5


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_link_names_a_file_and_heading_that_exist(path: Path) -> None:
    broken = []
    for target in links(path):
        name, _, heading = target.partition("#")
        destination = (path.parent / name).resolve() if name else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif heading and destination.suffix == ".md" and heading not in anchors(destination):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{path.relative_to(REPO)}: {broken}"
