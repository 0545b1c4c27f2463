#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, types, unit and end-to-end tests (the
# end-to-end ones need root, containerd and runc), the VM tests (QEMU guests with
# multi-socket NUMA topologies, tests/vm/), then the unit tests on every other Python 3
# the machine has (3.12, 3.13 through pyenv). Each stage prints how long it took.
#   contrib/test.sh                    every stage
#   contrib/test.sh [pytest arguments] only pytest on Python 3.11, with these arguments
set -euo pipefail
cd "$(dirname "$0")/.."
# The VM tests' packages need root to install; without root those tests skip (off CI).
if [ "$(id -u)" -eq 0 ]; then
    WITH_VM=1 contrib/bootstrap.sh
else
    contrib/bootstrap.sh
fi

stage() {
    local name=$1 started=$SECONDS
    shift
    echo "== $name" >&2
    local status=0
    "$@" || status=$?
    if [ "$status" -ne 0 ]; then
        echo "== $name: failed (exit $status) after $((SECONDS - started)) s" >&2
        exit "$status"
    fi
    echo "== $name: $((SECONDS - started)) s" >&2
}

if [ $# -gt 0 ]; then
    .venv/bin/pytest "$@"
    exit
fi

stage "ruff" .venv/bin/ruff check shim tests contrib
stage "ruff format" .venv/bin/ruff format --check shim tests contrib
stage "mypy --strict" .venv/bin/mypy
stage "pytest (Python 3.11: unit and end-to-end)" .venv/bin/pytest --ignore=tests/vm
stage "pytest (Python 3.11: VM end-to-end in QEMU guests)" .venv/bin/pytest tests/vm

for version in 3.12 3.13; do
    python="$(ls -d "$HOME"/.pyenv/versions/"$version".*/bin/python3 2>/dev/null | sort -V | tail -1 || true)"
    if [ -z "$python" ]; then
        echo "== Python $version not installed here: skipped" >&2
        continue
    fi
    stage "bootstrap (Python $version)" env VENV=".venv-$version" contrib/bootstrap.sh "$python"
    stage "pytest (Python $version: unit)" ".venv-$version/bin/pytest" -q tests/unit
done
