#!/usr/bin/env bash
# The demo: a private containerd with cpushim in front of it, pods run through cpushim, and
# what the kernel says about each container's CPUs. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
contrib/bootstrap.sh
exec .venv/bin/python contrib/demo.py "$@"
