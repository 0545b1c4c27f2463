#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, types, unit and end-to-end tests (the
# end-to-end ones need root, containerd and runc), then the unit tests on every other
# Python 3 the machine has (3.12, 3.13 through pyenv).
#   contrib/test.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
contrib/bootstrap.sh

echo "== ruff" >&2
.venv/bin/ruff check shim tests contrib
.venv/bin/ruff format --check shim tests contrib
echo "== mypy --strict" >&2
.venv/bin/mypy
echo "== pytest (Python 3.11: unit and end-to-end)" >&2
.venv/bin/pytest "$@"

for version in 3.12 3.13; do
    python="$(ls -d "$HOME"/.pyenv/versions/"$version".*/bin/python3 2>/dev/null | sort -V | tail -1 || true)"
    if [ -z "$python" ]; then
        echo "== Python $version not installed here: skipped" >&2
        continue
    fi
    echo "== pytest (Python $version: unit)" >&2
    VENV=".venv-$version" contrib/bootstrap.sh "$python"
    ".venv-$version/bin/pytest" -q tests/unit
done
