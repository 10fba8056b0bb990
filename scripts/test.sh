#!/usr/bin/env bash
# The whole test suite from a fresh clone: install, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest tests -q "$@"
