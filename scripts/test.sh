#!/usr/bin/env bash
# The whole test suite from a fresh clone: install, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
# Two worker processes (pytest-xdist): most tests run one thread (the `one_thread` fixture), so the
# second vCPU would idle. --dist loadscope keeps a module (or a class) on one worker: its module fixtures
# (a model, a server process) are built once; the scopes go out in tests/conftest.py's order (those marked
# heavy first), not xdist's. STREAMATTN_TEST_WORKERS=0 runs in this process.
exec "$PY" -m pytest tests -q -n "${STREAMATTN_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"
