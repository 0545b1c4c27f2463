#!/usr/bin/env bash
# Install cpushim on a node, as root, from a checkout of this repository:
#
#   contrib/install.sh [--root DIR] [--wheel FILE] [--python PYTHON] [--skip-package]
#                      [--no-systemctl]
#
# What it installs (docs/operations.md has the whole procedure):
#   /opt/cpushim/                                  a virtualenv holding cpushim and its dependencies
#                                                  (pip install of this checkout, or of --wheel FILE)
#   /usr/bin/cpushim                               a symlink to /opt/cpushim/bin/cpushim
#   /etc/systemd/system/cpushim.service            from systemd/cpushim.service
#   /etc/systemd/system/kubelet.service.d/10-cpushim.conf
#                                                  from systemd/kubelet.service.d/10-cpushim.conf
#   /etc/cpushim/config.toml                       from contrib/config.toml, only when missing: an
#                                                  existing one is never overwritten
# then `systemctl daemon-reload` when systemd runs. It enables, starts and restarts nothing:
# kubelet goes through cpushim from its next restart.
#
# Running it again is harmless: it upgrades the package and the units, and keeps the config.
#
#   --root DIR       install under DIR instead of / (default: $DESTDIR, else /). systemctl is
#                    never run then. The virtualenv's scripts name DIR/opt/cpushim, so a tree
#                    installed this way runs where it is (tests, a chroot), not copied elsewhere.
#   --wheel FILE     install this wheel instead of the checkout
#   --python PYTHON  the Python (3.11 or later, with the venv module) the virtualenv is made
#                    with (default: python3); checked first, and a virtualenv it could not
#                    make is removed
#   --skip-package   leave /opt/cpushim and /usr/bin/cpushim alone: units and config only
#   --no-systemctl   do not run systemctl daemon-reload (default: run it when the root is /
#                    and systemd is running, i.e. /run/systemd/system exists)
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit "${1:-2}"
}

src="$(cd "$(dirname "$0")/.." && pwd)"
root="${DESTDIR:-/}"
wheel=""
python="python3"
python_given=0
skip_package=0
systemctl_mode="auto"

while [ $# -gt 0 ]; do
    case "$1" in
        --root) root="${2:?--root needs a directory}"; shift 2 ;;
        --root=*) root="${1#--root=}"; shift ;;
        --wheel) wheel="${2:?--wheel needs a file}"; shift 2 ;;
        --wheel=*) wheel="${1#--wheel=}"; shift ;;
        --python) python="${2:?--python needs an interpreter}"; python_given=1; shift 2 ;;
        --python=*) python="${1#--python=}"; python_given=1; shift ;;
        --skip-package) skip_package=1; shift ;;
        --no-systemctl) systemctl_mode="no"; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install.sh: unknown argument: $1" >&2; usage ;;
    esac
done

[ -n "$root" ] || root="/"
root="${root%/}"  # "" for /, so "$root/etc" is /etc
if [ -n "$root" ]; then
    mkdir -p "$root"
    root="$(cd "$root" && pwd)"
    [ "$root" != "/" ] || root=""
fi
if [ -n "$wheel" ]; then
    [ -f "$wheel" ] || { echo "install.sh: no such wheel: $wheel" >&2; exit 1; }
    wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
fi

say() { echo "install.sh: $*" >&2; }

# -- the package: a virtualenv in /opt/cpushim, /usr/bin/cpushim pointing into it ---------------
if [ "$skip_package" = 0 ]; then
    venv="$root/opt/cpushim"
    link="$root/usr/bin/cpushim"
    # Checked before anything is installed, so that a refusal leaves the node as it was.
    if [ -e "$link" ] && [ ! -L "$link" ]; then
        echo "install.sh: $link exists and is not a symlink; not replacing it" >&2
        exit 1
    fi
    if [ ! -x "$venv/bin/python" ]; then
        # Before the virtualenv: one made with an older Python would only refuse cpushim
        # at pip's turn, and later runs keep a virtualenv's Python.
        if ! version="$("$python" -c 'import sys; print(sys.version.split()[0])
sys.exit(sys.version_info < (3, 11))' 2>/dev/null)"; then
            echo "install.sh: cpushim needs Python 3.11 or later; $python is" \
                "${version:-not a Python that runs} (--python PYTHON names another)" >&2
            exit 1
        fi
        say "creating the virtualenv $venv"
        venv_was_there=0
        [ ! -e "$venv" ] || venv_was_there=1
        mkdir -p "$(dirname "$venv")"
        if ! "$python" -m venv "$venv"; then
            # Debian's python3 without python3-venv leaves bin/python and no pip: the next
            # run would take that for a virtualenv to upgrade, and fail at pip every time.
            [ "$venv_was_there" = 1 ] || rm -rf -- "$venv"
            echo "install.sh: could not create the virtualenv $venv with $python" >&2
            exit 1
        fi
    elif [ "$python_given" = 1 ]; then
        say "upgrading the virtualenv $venv with the Python it was made with, not $python" \
            "(remove $venv first to make it again)"
    fi
    package="${wheel:-$src}"
    say "installing $package into $venv"
    # The package with its dependencies, then the package again by force: an unchanged
    # version number (a checkout between releases) would otherwise be left as it was.
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$package"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
        --force-reinstall "$package"
    mkdir -p "$root/usr/bin"
    # Relative, so that it resolves inside the root it was installed to.
    ln -sfn ../../opt/cpushim/bin/cpushim "$link"
    say "$link -> /opt/cpushim/bin/cpushim"
fi

# -- the units --------------------------------------------------------------------------------
install -D -m 0644 "$src/systemd/cpushim.service" "$root/etc/systemd/system/cpushim.service"
install -D -m 0644 "$src/systemd/kubelet.service.d/10-cpushim.conf" \
    "$root/etc/systemd/system/kubelet.service.d/10-cpushim.conf"
say "installed $root/etc/systemd/system/cpushim.service"
say "installed $root/etc/systemd/system/kubelet.service.d/10-cpushim.conf"
# systemd lets EnvironmentFile= override Environment= whatever their order: kubeadm's unit
# reads these files, so one that assigns KUBELET_EXTRA_ARGS at all (kind's node image does,
# install guides often do) drops the drop-in's endpoint without a word.
for env_file in "$root/etc/default/kubelet" "$root/etc/sysconfig/kubelet"; do
    if [ -f "$env_file" ] &&
        grep -Eq '^[[:space:]]*(export[[:space:]]+)?KUBELET_EXTRA_ARGS=' "$env_file" &&
        ! grep -q 'unix:///run/cpushim/cri.sock' "$env_file"; then
        say "WARNING: $env_file sets KUBELET_EXTRA_ARGS, which overrides the drop-in's;" \
            "kubelet would keep calling containerd directly. Add" \
            "--container-runtime-endpoint=unix:///run/cpushim/cri.sock to KUBELET_EXTRA_ARGS there."
    fi
done

# Among drop-ins, systemd keeps the last assignment of a variable, in file name order over all
# their directories: another drop-in that sets KUBELET_EXTRA_ARGS either drops the endpoint
# (after ours) or loses its own flags to ours (before it).
drop_in_dirs=("$root/etc/systemd/system" "$root/run/systemd/system" "$root/usr/lib/systemd/system")
[ "$root/lib" -ef "$root/usr/lib" ] || drop_in_dirs+=("$root/lib/systemd/system")
for dir in "${drop_in_dirs[@]}"; do
    for other in "$dir"/kubelet.service.d/*.conf; do
        if [ -f "$other" ] && [ "$(basename "$other")" != 10-cpushim.conf ] &&
            grep -Eq '^[[:space:]]*Environment=.*KUBELET_EXTRA_ARGS=' "$other" &&
            ! grep -q 'unix:///run/cpushim/cri.sock' "$other"; then
            say "WARNING: $other also sets KUBELET_EXTRA_ARGS, and only the drop-in last by" \
                "name counts: kubelet loses either cpushim's endpoint or that file's flags. Add" \
                "--container-runtime-endpoint=unix:///run/cpushim/cri.sock to its" \
                "KUBELET_EXTRA_ARGS, in a drop-in named to sort after 10-cpushim.conf."
        fi
    done
done

# -- the config, never overwritten ------------------------------------------------------------
config="$root/etc/cpushim/config.toml"
if [ -e "$config" ] || [ -L "$config" ]; then
    say "kept the existing $config"
else
    install -d -m 0755 "$root/etc/cpushim"
    install -m 0644 "$src/contrib/config.toml" "$config"
    say "installed the default $config"
fi

# -- systemd ----------------------------------------------------------------------------------
if [ "$systemctl_mode" = auto ]; then
    if [ -z "$root" ] && [ -d /run/systemd/system ]; then
        systemctl_mode="yes"
    else
        systemctl_mode="no"
    fi
fi
if [ "$systemctl_mode" = yes ]; then
    systemctl daemon-reload
    say "systemctl daemon-reload done"
fi

if [ -z "$root" ]; then
    cat >&2 <<'EOF'
install.sh: done. To put kubelet behind cpushim (docs/operations.md):
  1. set kubelet's cpuManagerPolicy: none (coming from static: rm /var/lib/kubelet/cpu_manager_state)
  2. edit /etc/cpushim/config.toml (reservedSystemCPUs, cpuManagerPolicyOptions)
  3. systemctl enable --now cpushim.service && systemctl restart kubelet.service
EOF
fi
