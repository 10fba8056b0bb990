#!/usr/bin/env bash
# The cache-state fuzz with more examples than CI and fresh random seeds (CI: 150 derandomised examples).
#   bash scripts/fuzz.sh                  # 2000 examples of up to 30 steps
#   bash scripts/fuzz.sh 20000 60         # examples, steps per example
#   STREAMATTN_FUZZ_EXAMPLES=500 bash scripts/fuzz.sh
# Extra arguments after the two numbers go to pytest (e.g. --hypothesis-seed=7). Failures are saved in
# .hypothesis/ and replayed first on the next run; hypothesis prints the failing rule sequence.
set -euo pipefail
cd "$(dirname "$0")/.."
export STREAMATTN_FUZZ_EXAMPLES="${1:-${STREAMATTN_FUZZ_EXAMPLES:-2000}}"
export STREAMATTN_FUZZ_STEPS="${2:-${STREAMATTN_FUZZ_STEPS:-30}}"
shift $(( $# < 2 ? $# : 2 ))
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m pytest tests/test_state_fuzz.py -k "test_state_machine" -x -q "$@"
