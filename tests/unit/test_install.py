"""contrib/install.sh and contrib/uninstall.sh run into a temp root: idempotent both ways, the
config kept, nothing of theirs left behind; the package itself from a wheel of the checkout."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shim.cli import main

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "contrib" / "install.sh"
UNINSTALL = REPO / "contrib" / "uninstall.sh"

UNIT = "etc/systemd/system/cpushim.service"
DROP_IN = "etc/systemd/system/kubelet.service.d/10-cpushim.conf"
CONFIG = "etc/cpushim/config.toml"
OVERRIDES = "etc/systemd/system/cpushim.service.d"


def run(script: Path, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        ["bash", str(script), *args],
        env=env if env is not None else _env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"{script.name} {args}: exit {done.returncode}\n{done.stderr}"
    return done.stderr


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DESTDIR"}
    env.update(extra)
    return env


def tree(root: Path, *, contents: bool = True) -> dict[str, tuple[str, int, bytes | str | None]]:
    """Every path under root: its kind, permission bits and content (a link's target)."""
    found: dict[str, tuple[str, int, bytes | str | None]] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        mode = stat.S_IMODE(info.st_mode)
        name = str(path.relative_to(root))
        if stat.S_ISLNK(info.st_mode):
            found[name] = ("link", mode, os.readlink(path))
        elif stat.S_ISDIR(info.st_mode):
            found[name] = ("dir", mode, None)
        else:
            found[name] = ("file", mode, path.read_bytes() if contents else None)
    return found


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir() or p.is_symlink()}


@pytest.fixture
def fake_systemctl(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """PATH with a systemctl that only records its calls: the scripts must not call it when
    installing into a root other than /."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "systemctl-calls"
    script = bindir / "systemctl"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(0o755)
    return _env(PATH=f"{bindir}:{os.environ['PATH']}"), calls


def test_install_twice_gives_the_same_tree(
    tmp_path: Path, fake_systemctl: tuple[dict[str, str], Path]
) -> None:
    env, calls = fake_systemctl
    root = tmp_path / "root"
    run(INSTALL, "--root", str(root), "--skip-package", env=env)
    first = tree(root)
    run(INSTALL, "--root", str(root), "--skip-package", env=env)
    assert tree(root) == first
    assert set(first) == {
        "etc",
        "etc/cpushim",
        CONFIG,
        "etc/systemd",
        "etc/systemd/system",
        UNIT,
        "etc/systemd/system/kubelet.service.d",
        DROP_IN,
    }
    assert (root / UNIT).read_bytes() == (REPO / "systemd/cpushim.service").read_bytes()
    assert (root / DROP_IN).read_bytes() == (
        REPO / "systemd/kubelet.service.d/10-cpushim.conf"
    ).read_bytes()
    assert (root / CONFIG).read_bytes() == (REPO / "contrib/config.toml").read_bytes()
    for name in (UNIT, DROP_IN, CONFIG):
        assert first[name][1] == 0o644, name
    assert not calls.exists(), "systemctl was run for a root other than /"


def test_an_edited_config_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc/cpushim").mkdir(parents=True)
    edited = b'reservedSystemCPUs = "0,1"\n'
    (root / CONFIG).write_bytes(edited)
    (root / CONFIG).chmod(0o600)
    out = run(INSTALL, "--root", str(root), "--skip-package", "--no-systemctl")
    assert "kept the existing" in out
    assert (root / CONFIG).read_bytes() == edited
    assert stat.S_IMODE((root / CONFIG).stat().st_mode) == 0o600
    assert (root / UNIT).is_file()


def test_uninstall_twice_leaves_only_the_config(
    tmp_path: Path, fake_systemctl: tuple[dict[str, str], Path]
) -> None:
    env, calls = fake_systemctl
    root = tmp_path / "root"
    run(INSTALL, "--root", str(root), "--skip-package", env=env)
    # As `systemctl enable cpushim` leaves it.
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir()
    (wants / "cpushim.service").symlink_to("/etc/systemd/system/cpushim.service")
    # Not ours: kubeadm's drop-in beside ours, and a state directory.
    (root / "etc/systemd/system/kubelet.service.d/10-kubeadm.conf").write_text("[Service]\n")
    (root / "var/lib/cpushim").mkdir(parents=True)
    (root / "var/lib/cpushim/state.json").write_text("{}")
    (root / CONFIG).write_text("logLevel = 'debug'\n")
    # The operator's own settings for the unit, from `systemctl edit cpushim`.
    (root / OVERRIDES).mkdir()
    (root / OVERRIDES / "override.conf").write_text("[Service]\nNice=-5\n")

    out = run(UNINSTALL, "--root", str(root), env=env)
    assert f"kept {root / OVERRIDES}" in out
    after = tree(root)
    run(UNINSTALL, "--root", str(root), env=env)
    assert tree(root) == after
    assert files(root) == {
        CONFIG,
        f"{OVERRIDES}/override.conf",
        "etc/systemd/system/kubelet.service.d/10-kubeadm.conf",
        "var/lib/cpushim/state.json",
    }
    assert (root / CONFIG).read_text() == "logLevel = 'debug'\n"
    assert not calls.exists()

    # A later install keeps the config as well.
    run(INSTALL, "--root", str(root), "--skip-package", env=env)
    assert (root / CONFIG).read_text() == "logLevel = 'debug'\n"


def test_uninstall_purge_removes_config_and_state(tmp_path: Path) -> None:
    root = tmp_path / "root"
    run(INSTALL, "--root", str(root), "--skip-package", "--no-systemctl")
    (root / "var/lib/cpushim").mkdir(parents=True)
    (root / "var/lib/cpushim/state.json").write_text("{}")
    (root / OVERRIDES).mkdir()
    (root / OVERRIDES / "override.conf").write_text("[Service]\nNice=-5\n")
    run(UNINSTALL, "--root", str(root), "--purge", "--no-systemctl")
    run(UNINSTALL, "--root", str(root), "--purge", "--no-systemctl")
    assert files(root) == set()
    assert not (root / "etc/cpushim").exists()
    assert not (root / "etc/systemd/system/kubelet.service.d").exists()


def test_uninstall_leaves_a_cpushim_that_is_not_its_symlink(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/cpushim").write_text("#!/bin/sh\n")
    out = run(UNINSTALL, "--root", str(root), "--no-systemctl")
    assert "not the symlink" in out
    assert (root / "usr/bin/cpushim").is_file()


def test_destdir(tmp_path: Path) -> None:
    root = tmp_path / "staged"
    run(INSTALL, "--skip-package", env=_env(DESTDIR=str(root)))
    assert (root / UNIT).is_file()
    run(UNINSTALL, "--purge", env=_env(DESTDIR=str(root)))
    assert files(root) == set()


def test_unknown_argument_is_refused(tmp_path: Path) -> None:
    for script in (INSTALL, UNINSTALL):
        done = subprocess.run(
            ["bash", str(script), "--root", str(tmp_path), "--bogus"],
            env=_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 2
        assert "unknown argument: --bogus" in done.stderr
        assert "--root DIR" in done.stderr  # the usage follows


def _wheel(tmp_path: Path) -> Path:
    """A wheel of the checkout, built from a copy so the work tree gets no build/ (with build
    isolation: the virtualenvs of the other Pythons have no setuptools)."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copytree(REPO / "shim", source / "shim", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    out = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
    subprocess.run(
        [*pip, "--wheel-dir", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    [wheel] = out.glob("cpushim-*.whl")
    return wheel


def test_package_from_a_wheel(tmp_path: Path) -> None:
    """The pip part, once: a virtualenv at /opt/cpushim and /usr/bin/cpushim running it
    (about 20 s: the dependencies are installed into a new virtualenv)."""
    wheel = _wheel(tmp_path)
    root = tmp_path / "root"
    args = ("--root", str(root), "--wheel", str(wheel), "--python", sys.executable)
    run(INSTALL, *args, "--no-systemctl")
    link = root / "usr/bin/cpushim"
    assert os.readlink(link) == "../../opt/cpushim/bin/cpushim"
    assert link.resolve() == (root / "opt/cpushim/bin/cpushim").resolve()
    version = subprocess.run(
        [str(link), "--version"], capture_output=True, text=True, check=True, timeout=60
    )
    assert version.stdout.split() == ["cpushim", "0.1.0"]

    first = tree(root, contents=False)
    said = run(INSTALL, *args, "--no-systemctl")
    assert "with the Python it was made with, not" in said  # --python names no new one
    assert {k: v for k, v in tree(root, contents=False).items() if "__pycache__" not in k} == {
        k: v for k, v in first.items() if "__pycache__" not in k
    }

    run(UNINSTALL, "--root", str(root), "--no-systemctl")
    assert files(root) == {CONFIG}
    assert not (root / "opt/cpushim").exists()


def test_an_install_over_a_cpushim_that_is_not_its_symlink_changes_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/cpushim").write_text("#!/bin/sh\n")
    wheel = tmp_path / "cpushim-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")  # never read: the refusal comes before pip
    done = subprocess.run(
        ["bash", str(INSTALL), "--root", str(root), "--wheel", str(wheel)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "exists and is not a symlink" in done.stderr
    assert files(root) == {"usr/bin/cpushim"}


@pytest.mark.parametrize("name", ["etc/default/kubelet", "etc/sysconfig/kubelet"])
def test_install_warns_when_an_environment_file_overrides_the_drop_in(
    tmp_path: Path, name: str
) -> None:
    """systemd: settings from EnvironmentFile= override Environment=, in whatever order. The
    file may set it to nothing: the drop-in's endpoint is then dropped without a word and
    kubelet keeps talking to containerd."""
    root = tmp_path / "root"
    env_file = root / name
    env_file.parent.mkdir(parents=True)
    env_file.write_text("KUBELET_EXTRA_ARGS=\n")
    said = run(INSTALL, "--root", str(root), "--skip-package")
    assert re.search(rf"{re.escape(str(env_file))}.*KUBELET_EXTRA_ARGS", said), said
    assert "--container-runtime-endpoint=unix:///run/cpushim/cri.sock" in said


def test_install_is_quiet_about_an_environment_file_that_leaves_the_variable_alone(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    (root / "etc/default").mkdir(parents=True)
    (root / "etc/default/kubelet").write_text("# nothing here\nOTHER=1\n")
    assert "KUBELET_EXTRA_ARGS" not in run(INSTALL, "--root", str(root), "--skip-package")


# kubelet settings that name cpushim's socket outside the drop-in.
ENDPOINT_ELSEWHERE = [
    # Where install.sh tells the operator to put the flag.
    ("etc/default/kubelet", 'KUBELET_EXTRA_ARGS="--container-runtime-endpoint=unix:///run/cpushim/cri.sock"\n'),
    ("etc/sysconfig/kubelet", "KUBELET_EXTRA_ARGS=--container-runtime-endpoint=unix:///run/cpushim/cri.sock\n"),
    # Where the drop-in's comments send a kubelet.service without $KUBELET_EXTRA_ARGS.
    ("var/lib/kubelet/config.yaml", "kind: KubeletConfiguration\ncontainerRuntimeEndpoint: unix:///run/cpushim/cri.sock\n"),
    ("etc/systemd/system/kubelet.service.d/20-local.conf", '[Service]\nEnvironment="KUBELET_EXTRA_ARGS=--container-runtime-endpoint=unix:///run/cpushim/cri.sock"\n'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "text"), ENDPOINT_ELSEWHERE, ids=[name for name, _ in ENDPOINT_ELSEWHERE]
)
def test_uninstall_warns_of_kubelet_settings_still_naming_the_socket(
    tmp_path: Path, name: str, text: str
) -> None:
    """Removing the drop-in puts kubelet back on containerd only where the drop-in was the
    one to name cpushim's socket: an endpoint set elsewhere outlives the uninstall, and the
    roll back's `systemctl stop cpushim` would then leave kubelet without a runtime."""
    root = tmp_path / "root"
    run(INSTALL, "--root", str(root), "--skip-package", "--no-systemctl")
    named = root / name
    named.parent.mkdir(parents=True, exist_ok=True)
    named.write_text(text)
    said = run(UNINSTALL, "--root", str(root), "--no-systemctl")
    assert re.search(rf"WARNING: {re.escape(str(named))} .*cpushim's socket", said), said
    assert named.read_text() == text  # the operator's file: warned of, not edited


def test_uninstall_is_quiet_about_kubelet_settings_naming_containerd(tmp_path: Path) -> None:
    root = tmp_path / "root"
    run(INSTALL, "--root", str(root), "--skip-package", "--no-systemctl")
    (root / "etc/default").mkdir(parents=True)
    (root / "etc/default/kubelet").write_text(
        "# KUBELET_EXTRA_ARGS=--container-runtime-endpoint=unix:///run/cpushim/cri.sock\n"
        "KUBELET_EXTRA_ARGS=\n"
    )
    (root / "var/lib/kubelet").mkdir(parents=True)
    (root / "var/lib/kubelet/config.yaml").write_text(
        "containerRuntimeEndpoint: unix:///run/containerd/containerd.sock\n"
    )
    assert "WARNING" not in run(UNINSTALL, "--root", str(root), "--no-systemctl")


def _python_stub(tmp_path: Path, script: str) -> Path:
    stub = tmp_path / "python-stub"
    stub.write_text(f'#!/bin/sh\n{script}\nexec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    return stub


def _install_refused(root: Path, python: Path) -> str:
    done = subprocess.run(
        ["bash", str(INSTALL), "--root", str(root), "--python", str(python), "--no-systemctl"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    return done.stderr


def test_a_virtualenv_that_could_not_be_made_is_not_left_behind(tmp_path: Path) -> None:
    """Debian's python3 without python3-venv makes bin/python, then fails for want of
    ensurepip. Left there, the next run (python3-venv installed meanwhile) would take it for
    a virtualenv to upgrade, and fail with "No module named pip" every time after."""
    stub = _python_stub(
        tmp_path,
        'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        '    mkdir -p "$3/bin" && ln -s /bin/false "$3/bin/python"\n'
        '    echo "The virtual environment was not created successfully" >&2\n'
        "    exit 1\n"
        "fi",
    )
    root = tmp_path / "root"
    _install_refused(root, stub)
    assert not (root / "opt/cpushim").exists()
    assert not (root / "usr/bin/cpushim").exists()


def test_a_python_older_than_3_11_is_refused_before_the_virtualenv(tmp_path: Path) -> None:
    # As Python 3.9 would answer install.sh's check, and make a virtualenv (whose pip
    # would refuse cpushim, after the dependencies were fetched).
    stub = _python_stub(
        tmp_path,
        'if [ "$1" = -c ]; then echo 3.9.2; exit 1; fi\n'
        'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        '    mkdir -p "$3/bin" && ln -s /bin/false "$3/bin/python"\n'
        "    exit 0\n"
        "fi",
    )
    root = tmp_path / "root"
    said = _install_refused(root, stub)
    assert f"needs Python 3.11 or later; {stub} is 3.9.2" in said
    assert not (root / "opt").exists()


@pytest.mark.parametrize(
    "name",
    [
        "etc/systemd/system/kubelet.service.d/20-extra-args.conf",
        "etc/systemd/system/kubelet.service.d/05-node-ip.conf",
        "usr/lib/systemd/system/kubelet.service.d/20-extra-args.conf",
    ],
)
def test_install_warns_when_another_drop_in_sets_the_variable(tmp_path: Path, name: str) -> None:
    """systemd keeps the last Environment= assignment of a variable, drop-ins taken in name
    order: one sorted after ours drops the endpoint (kubelet keeps calling containerd), one
    before it loses its own flags to ours. Either way the operator must merge the two."""
    root = tmp_path / "root"
    drop_in = root / name
    drop_in.parent.mkdir(parents=True)
    drop_in.write_text('[Service]\nEnvironment="KUBELET_EXTRA_ARGS=--node-ip=10.0.0.5"\n')
    said = run(INSTALL, "--root", str(root), "--skip-package", "--no-systemctl")
    assert re.search(rf"WARNING: {re.escape(str(drop_in))} .*KUBELET_EXTRA_ARGS", said), said
    assert "--container-runtime-endpoint=unix:///run/cpushim/cri.sock" in said


def test_install_is_quiet_about_drop_ins_that_leave_the_variable_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    kubeadm = root / "usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf"
    kubeadm.parent.mkdir(parents=True)
    # As kubeadm's packages ship it: the variable is only read, from files and on ExecStart.
    kubeadm.write_text(
        "[Service]\n"
        'Environment="KUBELET_KUBECONFIG_ARGS=--kubeconfig=/etc/kubernetes/kubelet.conf"\n'
        "EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env\n"
        "ExecStart=\n"
        "ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_EXTRA_ARGS\n"
    )
    said = run(INSTALL, "--root", str(root), "--skip-package", "--no-systemctl")
    assert "WARNING" not in said
    # Installed twice: its own drop-in is no other.
    assert "WARNING" not in run(INSTALL, "--root", str(root), "--skip-package", "--no-systemctl")


def test_the_version_cpushim_prints_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/operations.md checks an upgrade with ``cpushim --version``: it must print the
    version pip installed (pyproject.toml's), not a second number left behind."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"cpushim {declared}\n"
    assert "cpushim --version" in (REPO / "docs" / "operations.md").read_text()
