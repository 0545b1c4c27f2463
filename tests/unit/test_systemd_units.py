"""The systemd units: ``systemd-analyze verify`` finds nothing to say about them, and
cpushim.service has the settings the node needs, consistent with contrib/config.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICE = REPO / "systemd" / "cpushim.service"
DROP_IN = REPO / "systemd" / "kubelet.service.d" / "10-cpushim.conf"
CONFIG = REPO / "contrib" / "config.toml"
EXEC_START = "/usr/bin/cpushim run --config /etc/cpushim/config.toml"


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze") or (
        "/usr/bin/systemd-analyze" if Path("/usr/bin/systemd-analyze").exists() else None
    )
    if found is None:
        reason = "systemd-analyze is not installed (apt-get install systemd)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: the unit check is mandatory)", pytrace=False)
        pytest.skip(reason)
    return found


def _units(workdir: Path) -> Path:
    """The two units in a unit directory of their own, beside a minimal kubelet.service for
    the drop-in to attach to. ExecStart= must name an executable that exists, so cpushim's is
    pointed at a stand-in (and only that word changes)."""
    stand_in = workdir / "bin" / "cpushim"
    stand_in.parent.mkdir()
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    units = workdir / "units"
    (units / "kubelet.service.d").mkdir(parents=True)
    text = SERVICE.read_text()
    assert f"ExecStart={EXEC_START}\n" in text
    (units / "cpushim.service").write_text(
        text.replace(f"ExecStart={EXEC_START}", f"ExecStart={stand_in} run", 1)
    )
    shutil.copy(DROP_IN, units / "kubelet.service.d" / DROP_IN.name)
    (units / "kubelet.service").write_text(
        "[Unit]\nDescription=kubelet (a stand-in)\n\n"
        f"[Service]\nExecStart={stand_in} $KUBELET_EXTRA_ARGS\nRestart=always\n\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
    return units


def _verify(units: Path) -> subprocess.CompletedProcess[str]:
    # The unit directory first, then systemd's own (a trailing ':'), for sysinit.target and
    # the other units every service depends on.
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:", "SYSTEMD_LOG_COLOR": "0"}
    return subprocess.run(
        [_systemd_analyze(), "verify", "--man=no", "cpushim.service", "kubelet.service"],
        cwd=units,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    done = _verify(_units(tmp_path))
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, output
    assert output == ""


def test_verify_reads_the_drop_in(tmp_path: Path) -> None:
    """The check above would pass vacuously if the drop-in were not loaded: a bad key in it
    must be reported."""
    units = _units(tmp_path)
    drop_in = units / "kubelet.service.d" / DROP_IN.name
    drop_in.write_text(drop_in.read_text().replace("\nWants=", "\nWantz=", 1))
    done = _verify(units)
    assert "Wantz" in done.stdout + done.stderr


def _settings(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections, each key with its values in order (comments left out)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_cpushim_service_settings() -> None:
    unit = _settings(SERVICE)["Unit"]
    service = _settings(SERVICE)["Service"]
    assert service["Type"] == ["notify"]
    assert service["ExecStart"] == [EXEC_START]
    assert "containerd.service" in " ".join(unit["After"]).split()
    assert "kubelet.service" in " ".join(unit["Before"]).split()
    assert service["Restart"] == ["always"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["WatchdogSec"] == ["30"]
    assert service["ProtectSystem"] == ["strict"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert set(" ".join(service["ReadWritePaths"]).split()) >= {"/var/lib/cpushim", "/run/cpushim"}
    assert _settings(SERVICE)["Install"]["WantedBy"] == ["multi-user.target"]


def test_writable_paths_cover_the_default_config() -> None:
    """What cpushim writes with the default config is writable under ProtectSystem=strict."""
    writable = [Path(p) for p in " ".join(_settings(SERVICE)["Service"]["ReadWritePaths"]).split()]
    config = tomllib.loads(CONFIG.read_text())
    for written in (
        Path(config["stateDir"]),
        Path(config["projectionDir"]),
        Path(config["listen"].removeprefix("unix://")).parent,
    ):
        assert any(written.is_relative_to(p) for p in writable), written


def test_kubelet_drop_in_points_at_the_listen_socket() -> None:
    drop_in = _settings(DROP_IN)
    assert drop_in["Unit"]["Wants"] == ["cpushim.service"]
    assert "Requires" not in drop_in["Unit"]
    assert drop_in["Unit"]["After"] == ["cpushim.service"]
    listen = tomllib.loads(CONFIG.read_text())["listen"]
    [environment] = drop_in["Service"]["Environment"]
    assert environment == f'"KUBELET_EXTRA_ARGS=--container-runtime-endpoint={listen}"'
