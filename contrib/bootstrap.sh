#!/usr/bin/env bash
# Set up a machine for cpushim's demo and tests, idempotently: the runtime packages
# (containerd, runc, busybox-static), Go and grpc-go's sources (golang-go,
# golang-google-grpc-dev: the e2e tests build a grpc-go client offline from them) and a
# virtualenv with cpushim and its test tools.
#   contrib/bootstrap.sh [PYTHON]      (PYTHON defaults to python3; the venv goes to .venv)
# With WITH_VM=1 it also installs what the VM tests boot their guests with (tests/vm/):
# QEMU without its GUI recommends, and debootstrap.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${1:-python3}
venv=${VENV:-.venv}

missing=()
command -v containerd >/dev/null || missing+=(containerd)
command -v runc >/dev/null || missing+=(runc)
[ -x /bin/busybox ] || command -v busybox >/dev/null || missing+=(busybox-static)
# Debian installs Go library sources under /usr/share/gocode/src; tests/harness/goclient.py
# builds against them in GOPATH mode, since there is no Go module proxy to fetch from.
if ! command -v go >/dev/null || [ ! -d /usr/share/gocode/src/google.golang.org/grpc ]; then
    missing+=(golang-go golang-google-grpc-dev)
fi
vm_missing=()
if [ "${WITH_VM:-0}" = 1 ]; then
    command -v qemu-system-x86_64 >/dev/null || vm_missing+=(qemu-system-x86)
    command -v debootstrap >/dev/null || vm_missing+=(debootstrap)
fi
if [ $((${#missing[@]} + ${#vm_missing[@]})) -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "bootstrap: need root to install ${missing[*]} ${vm_missing[*]} (apt-get)" >&2
        exit 1
    fi
    echo "bootstrap: installing ${missing[*]} ${vm_missing[*]}" >&2
    apt-get update -qq
    if [ ${#missing[@]} -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    if [ ${#vm_missing[@]} -gt 0 ]; then
        # QEMU's recommends are its GUI and audio stacks; the guests need none of them.
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${vm_missing[@]}" >/dev/null
    fi
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "bootstrap: $python is older than Python 3.11" >&2
    exit 1
fi
# Reinstall only when the declared dependencies change.
stamp="$venv/.cpushim-deps"
want="$("$python" --version 2>&1) $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "bootstrap: installing cpushim and its test tools into $venv" >&2
    "$python" -m venv "$venv"
    log="$venv/bootstrap.log"
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,dev]' \
            >"$log" 2>&1; then
        cat "$log" >&2
        echo "bootstrap: pip install failed (log above, also in $log)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
