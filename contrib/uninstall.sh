#!/usr/bin/env bash
# Remove what contrib/install.sh installed, as root:
#
#   contrib/uninstall.sh [--root DIR] [--purge] [--no-systemctl]
#
# Removes /etc/systemd/system/kubelet.service.d/10-cpushim.conf (and that directory when it is
# left empty), /etc/systemd/system/cpushim.service, its enablement link
# /etc/systemd/system/multi-user.target.wants/cpushim.service, /usr/bin/cpushim when it is a
# symlink, and the virtualenv /opt/cpushim; then `systemctl daemon-reload` when systemd runs.
# /etc/cpushim/config.toml is kept, since it holds the node's settings (a later install keeps
# it too), and so are the unit's local settings (/etc/systemd/system/cpushim.service.d, from
# `systemctl edit cpushim`); --purge removes both, and the checkpoint directory
# /var/lib/cpushim as well.
# /run/cpushim is never touched: running containers have bind mounts of its projection
# directories, and it goes away at the next boot.
#
# It stops and restarts nothing. Put kubelet back on containerd first (docs/operations.md,
# "Roll back"): remove the drop-in or run this script, `systemctl restart kubelet`, and only
# then `systemctl stop cpushim`. Running it again is harmless. It warns of kubelet settings it
# leaves that still name cpushim's socket (/etc/default/kubelet, /etc/sysconfig/kubelet,
# /var/lib/kubelet/config.yaml, kubeadm-flags.env, kubelet.service and its other drop-ins in
# /etc/systemd/system): set containerd's endpoint back there before restarting kubelet.
#
#   --root DIR       uninstall from under DIR instead of / (default: $DESTDIR, else /);
#                    systemctl is never run then
#   --purge          also remove /etc/cpushim (the config), the unit's local settings
#                    (/etc/systemd/system/cpushim.service.d) and /var/lib/cpushim (the checkpoint)
#   --no-systemctl   do not run systemctl daemon-reload (default: run it when the root is /
#                    and systemd is running)
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit "${1:-2}"
}

root="${DESTDIR:-/}"
purge=0
systemctl_mode="auto"

while [ $# -gt 0 ]; do
    case "$1" in
        --root) root="${2:?--root needs a directory}"; shift 2 ;;
        --root=*) root="${1#--root=}"; shift ;;
        --purge) purge=1; shift ;;
        --no-systemctl) systemctl_mode="no"; shift ;;
        -h|--help) usage 0 ;;
        *) echo "uninstall.sh: unknown argument: $1" >&2; usage ;;
    esac
done

[ -n "$root" ] || root="/"
root="${root%/}"  # "" for /, so "$root/etc" is /etc
if [ -n "$root" ]; then
    [ -d "$root" ] || { echo "uninstall.sh: no such directory: $root" >&2; exit 1; }
    root="$(cd "$root" && pwd)"
    [ "$root" != "/" ] || root=""
fi

say() { echo "uninstall.sh: $*" >&2; }

remove() {
    if [ -e "$1" ] || [ -L "$1" ]; then
        rm -rf -- "$1"
        say "removed $1"
    fi
}

remove "$root/etc/systemd/system/kubelet.service.d/10-cpushim.conf"
rmdir --ignore-fail-on-non-empty "$root/etc/systemd/system/kubelet.service.d" 2>/dev/null || true
remove "$root/etc/systemd/system/multi-user.target.wants/cpushim.service"
remove "$root/etc/systemd/system/cpushim.service"

link="$root/usr/bin/cpushim"
if [ -L "$link" ]; then
    remove "$link"
elif [ -e "$link" ]; then
    say "left $link: not the symlink install.sh makes"
fi
remove "$root/opt/cpushim"

if [ "$purge" = 1 ]; then
    remove "$root/etc/cpushim"
    remove "$root/var/lib/cpushim"
elif [ -e "$root/etc/cpushim/config.toml" ]; then
    say "kept $root/etc/cpushim/config.toml (--purge removes it)"
fi

# `systemctl edit cpushim` keeps an operator's settings here; they outlive the unit unless
# purged, like the config.
overrides="$root/etc/systemd/system/cpushim.service.d"
if [ "$purge" = 1 ]; then
    remove "$overrides"
elif [ -e "$overrides" ]; then
    say "kept $overrides, the unit's local settings (--purge removes it)"
fi

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

# The drop-in is not the only way kubelet may have been pointed at cpushim: install.sh sends
# an operator whose /etc/default/kubelet sets KUBELET_EXTRA_ARGS to add the flag there, and the
# drop-in's comments send one without $KUBELET_EXTRA_ARGS to the KubeletConfiguration. Such an
# endpoint outlives this script, and kubelet would lose its runtime at `systemctl stop cpushim`.
shopt -s nullglob
for file in "$root/etc/default/kubelet" "$root/etc/sysconfig/kubelet" \
    "$root/var/lib/kubelet/config.yaml" "$root/var/lib/kubelet/kubeadm-flags.env" \
    "$root/etc/systemd/system/kubelet.service" "$root/etc/systemd/system/kubelet.service.d"/*.conf; do
    if [ -f "$file" ] && grep -Eq '^[^#]*/run/cpushim/cri\.sock' "$file"; then
        say "WARNING: $file still points kubelet at cpushim's socket (/run/cpushim/cri.sock):" \
            "put containerd's endpoint back there before restarting kubelet, or kubelet loses" \
            "its runtime when cpushim stops."
    fi
done
