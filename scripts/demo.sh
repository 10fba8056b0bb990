#!/usr/bin/env bash
# The main job on a fresh machine: install, then stream.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m streamattn.bench.demo "$@"
