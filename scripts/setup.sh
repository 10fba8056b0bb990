#!/usr/bin/env bash
# Install streamattn and what its tests need into the current Python (a fresh machine needs nothing else).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check -e ".[dev,gpu-check]"
