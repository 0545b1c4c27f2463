"""The end-to-end suite names a host it cannot check (cgroup v2 only) as a missing prerequisite,
so it skips off CI and fails on CI with the reason, instead of failing test by test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e import conftest as e2e


def test_a_host_without_cgroup_v1_cpusets_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(e2e, "CPUSET_HIERARCHY", tmp_path / "cpuset")
    missing = e2e.missing_prerequisites()
    assert any("cgroup v1's cpuset hierarchy" in item and "tests/vm" in item for item in missing)


def test_a_host_with_cgroup_v1_cpusets_is_not_held_back_by_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hierarchy = tmp_path / "cpuset"
    hierarchy.mkdir()
    (hierarchy / "cpuset.cpus").write_text("0-1\n")
    monkeypatch.setattr(e2e, "CPUSET_HIERARCHY", hierarchy)
    assert not any("cgroup" in item for item in e2e.missing_prerequisites())
