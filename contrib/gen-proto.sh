#!/usr/bin/env bash
# Regenerate shim/cri/runtime_v1_pb2.py and its type stub (.pyi) from shim/cri/runtime_v1.proto.
#
# protoc runs from the repository root with `-I .` so the descriptor registers the file as
# "shim/cri/runtime_v1.proto" and the module as shim.cri.runtime_v1_pb2; tests compare the
# committed output byte for byte against a fresh run, so always regenerate with this script.
#
# Uses grpc_tools (its bundled protoc) and mypy-protobuf's protoc-gen-mypy from the project
# venv (.venv), or from $PYTHON's environment when PYTHON is set.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

python="${PYTHON:-$repo_root/.venv/bin/python}"
if [[ ! -x "$python" ]]; then
    echo "gen-proto: no Python at $python (create .venv or set PYTHON)" >&2
    exit 1
fi
# protoc finds protoc-gen-mypy on PATH; it is installed beside the interpreter.
PATH="$(dirname "$python"):$PATH"
export PATH

"$python" -m grpc_tools.protoc \
    -I . \
    --python_out=. \
    --mypy_out=. \
    shim/cri/runtime_v1.proto

echo "gen-proto: wrote shim/cri/runtime_v1_pb2.py and shim/cri/runtime_v1_pb2.pyi"
